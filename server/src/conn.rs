//! Connection guard: what keeps a flood of connections from locking the server out.
//!
//! Every accepted TCP connection is registered here before its TLS handshake and wrapped in a
//! [`GuardedStream`] that notes when bytes last moved either way, and when a request on it last
//! began or ended. A connection that has no request in flight and has been quiet for the idle
//! timeout is closed: that covers clients that connect and say nothing, that send half a request
//! line and stall, and keep-alive connections nobody uses (HTTP/1.1 and HTTP/2 alike, since it
//! looks at bytes, not frames). A request in flight (a long poll, an upload being folded) keeps
//! its connection; those are bounded by their own limits (the long poll's wait, the body's
//! minimum rate, the request timeout).
//!
//! The end of a request counts as activity: over HTTP/2 a handler's answer is written by the
//! connection's task after the handler returns, and a long poll that moved no byte while it
//! waited must not find its connection "idle since it began" in between and lose its answer.
//!
//! The number of connections is capped well under the process's file-descriptor limit, and so is
//! the number from one IP address (a quarter of the cap by default), so one source cannot take
//! every slot. When a connection arrives at either cap, the longest-idle connection (of its
//! source, at the source's cap) is closed to make room (an attacker's idle sockets go first,
//! honest clients reconnect), and only when every such connection has a request in flight is
//! the newcomer refused. Either way the server keeps descriptors for its own files and
//! `/healthz` keeps answering.

use std::collections::HashMap;
use std::future::{Future, Ready};
use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::Sleep;

use crate::metrics::ServerMetrics;

/// How many connections, and how long an idle one may stay.
#[derive(Debug, Clone)]
pub struct ConnectionLimits {
    pub max_connections: usize,
    /// Connections from one IP address.
    pub max_per_source: usize,
    pub idle_timeout: Duration,
}

/// The live connections.
pub struct Connections {
    limits: ConnectionLimits,
    epoch: Instant,
    next_id: AtomicU64,
    live: Mutex<HashMap<u64, Arc<ConnState>>>,
    metrics: Arc<ServerMetrics>,
}

/// One connection's bookkeeping, shared by its stream and the requests on it.
pub struct ConnState {
    id: u64,
    /// The peer's address (None where it could not be read).
    source: Option<IpAddr>,
    /// [`Connections::epoch`].
    epoch: Instant,
    /// Milliseconds since `epoch` when bytes last moved or a request began or ended.
    last_activity_ms: AtomicU64,
    in_flight: AtomicUsize,
    /// Set to close the connection at its next read (idle at the cap).
    evicted: AtomicBool,
    reader: Mutex<Option<Waker>>,
}

impl ConnState {
    fn idle(&self) -> bool {
        self.in_flight.load(Ordering::SeqCst) == 0
    }

    fn touch(&self) {
        self.last_activity_ms
            .store(self.epoch.elapsed().as_millis() as u64, Ordering::SeqCst);
    }

    fn evict(&self) {
        self.evicted.store(true, Ordering::SeqCst);
        if let Some(waker) = self.reader.lock().expect("waker slot").take() {
            waker.wake();
        }
    }
}

/// Raises the soft limit on open files to the hard limit, and returns the soft limit now in
/// force (None where it cannot be read).
pub fn raise_fd_limit() -> Option<u64> {
    match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(limit) => Some(limit),
        Err(e) => {
            tracing::warn!(error = %e, "could not raise the open-file limit");
            rlimit::getrlimit(rlimit::Resource::NOFILE)
                .ok()
                .map(|(soft, _)| soft)
        }
    }
}

/// The connection cap: the configured one, or three quarters of the file-descriptor limit
/// (at most 16,384), leaving the rest for the store, blobs and checkpoints.
pub fn default_max_connections(fd_limit: Option<u64>) -> usize {
    let fds = fd_limit.unwrap_or(1024);
    ((fds.saturating_sub(64)) * 3 / 4).clamp(16, 16_384) as usize
}

impl Connections {
    pub fn new(limits: ConnectionLimits, metrics: Arc<ServerMetrics>) -> Arc<Self> {
        Arc::new(Connections {
            limits,
            epoch: Instant::now(),
            next_id: AtomicU64::new(0),
            live: Mutex::new(HashMap::new()),
            metrics,
        })
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// Connections open now.
    pub fn open(&self) -> usize {
        self.live.lock().expect("connection table").len()
    }

    /// Admits a connection from `source`, closing the longest-idle one (of that source, at its
    /// cap) if a cap is reached; None when every candidate is busy and the newcomer must be
    /// refused.
    fn admit(self: &Arc<Self>, source: Option<IpAddr>) -> Option<Arc<ConnState>> {
        let mut live = self.live.lock().expect("connection table");
        let evictable = |c: &&Arc<ConnState>| c.idle() && !c.evicted.load(Ordering::SeqCst);
        let from_source = |c: &&Arc<ConnState>| source.is_some() && c.source == source;
        let held = live
            .values()
            .filter(|c| from_source(c) && !c.evicted.load(Ordering::SeqCst))
            .count();
        // Which cap is reached, if any: the source's first (its own connections make room).
        let full = if source.is_some() && held >= self.limits.max_per_source {
            Some(("evicted_at_source_cap", "refused_at_source_cap", true))
        } else if live.len() >= self.limits.max_connections {
            Some(("evicted_at_cap", "refused_at_cap", false))
        } else {
            None
        };
        if let Some((evicted, refused, same_source)) = full {
            let idlest = live
                .values()
                .filter(evictable)
                .filter(|c| !same_source || from_source(c))
                .min_by_key(|c| c.last_activity_ms.load(Ordering::SeqCst))
                .cloned();
            let Some(c) = idlest else {
                self.metrics.connections_closed(refused);
                return None;
            };
            c.evict();
            self.metrics.connections_closed(evicted);
        }
        let state = Arc::new(ConnState {
            id: self.next_id.fetch_add(1, Ordering::SeqCst),
            source,
            epoch: self.epoch,
            last_activity_ms: AtomicU64::new(self.now_ms()),
            in_flight: AtomicUsize::new(0),
            evicted: AtomicBool::new(false),
            reader: Mutex::new(None),
        });
        live.insert(state.id, state.clone());
        self.metrics.connections_open.set(live.len() as i64);
        Some(state)
    }

    fn release(&self, id: u64) {
        let mut live = self.live.lock().expect("connection table");
        live.remove(&id);
        self.metrics.connections_open.set(live.len() as i64);
    }
}

/// The axum-server acceptor that registers and wraps each TCP connection (before TLS).
#[derive(Clone)]
pub struct GuardAcceptor {
    connections: Arc<Connections>,
}

impl GuardAcceptor {
    pub fn new(connections: Arc<Connections>) -> Self {
        GuardAcceptor { connections }
    }
}

impl<S> axum_server::accept::Accept<TcpStream, S> for GuardAcceptor {
    type Stream = GuardedStream;
    type Service = TrackRequests<S>;
    type Future = Ready<io::Result<(GuardedStream, TrackRequests<S>)>>;

    fn accept(&self, stream: TcpStream, service: S) -> Self::Future {
        let source = stream.peer_addr().ok().map(|a| a.ip());
        let Some(state) = self.connections.admit(source) else {
            return std::future::ready(Err(io::Error::other(
                "connection refused: every connection slot has a request in flight",
            )));
        };
        let _ = stream.set_nodelay(true);
        let idle = self.connections.limits.idle_timeout;
        std::future::ready(Ok((
            GuardedStream {
                inner: stream,
                state: state.clone(),
                connections: self.connections.clone(),
                idle,
                timer: Box::pin(tokio::time::sleep(idle)),
            },
            TrackRequests {
                inner: service,
                state,
            },
        )))
    }
}

/// A TCP stream that notes activity and ends itself when idle too long or evicted.
pub struct GuardedStream {
    inner: TcpStream,
    state: Arc<ConnState>,
    connections: Arc<Connections>,
    idle: Duration,
    timer: Pin<Box<Sleep>>,
}

impl Drop for GuardedStream {
    fn drop(&mut self) {
        self.connections.release(self.state.id);
    }
}

impl GuardedStream {
    fn touch(&self) {
        self.state.touch();
    }

    /// While the read is pending: whether the connection should end now, else arms the timer
    /// for the moment it would.
    fn expired(&mut self, cx: &mut Context<'_>) -> Option<&'static str> {
        if self.state.evicted.load(Ordering::SeqCst) {
            return Some("evicted_at_cap");
        }
        *self.state.reader.lock().expect("waker slot") = Some(cx.waker().clone());
        loop {
            // Idleness first: a request's end touches the clock before it leaves the count, so
            // a connection seen idle here is seen with its last request's end.
            let idle = self.state.idle();
            let since = self
                .connections
                .now_ms()
                .saturating_sub(self.state.last_activity_ms.load(Ordering::SeqCst));
            let idle_ms = self.idle.as_millis() as u64;
            if idle && since >= idle_ms {
                return Some("idle_timeout");
            }
            // Busy connections are looked at again after a whole timeout; idle ones when theirs
            // runs out.
            let wait = if idle { idle_ms - since } else { idle_ms };
            self.timer
                .as_mut()
                .reset(tokio::time::Instant::now() + Duration::from_millis(wait.max(1)));
            if self.timer.as_mut().poll(cx).is_pending() {
                return None;
            }
        }
    }
}

impl AsyncRead for GuardedStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        match Pin::new(&mut self.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before {
                    self.touch();
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => match self.expired(cx) {
                Some(why) => {
                    self.connections.metrics.connections_closed(why);
                    Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("connection closed by the server: {why}"),
                    )))
                }
                None => Poll::Pending,
            },
        }
    }
}

impl AsyncWrite for GuardedStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let written = Pin::new(&mut self.inner).poll_write(cx, data);
        if matches!(written, Poll::Ready(Ok(n)) if n > 0) {
            self.touch();
        }
        written
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let written = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if matches!(written, Poll::Ready(Ok(n)) if n > 0) {
            self.touch();
        }
        written
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Counts a connection's requests in flight: from the call until the response is ready.
#[derive(Clone)]
pub struct TrackRequests<S> {
    inner: S,
    state: Arc<ConnState>,
}

/// Marks one request in flight; dropped when the handler's future ends (or is dropped). Its end
/// restarts the idle clock, so the answer has the idle timeout to be written.
struct InFlight(Arc<ConnState>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.touch();
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

impl<S, R> tower::Service<R> for TrackRequests<S>
where
    S: tower::Service<R>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future =
        Pin<Box<dyn std::future::Future<Output = Result<S::Response, S::Error>> + Send + 'static>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: R) -> Self::Future {
        self.state.in_flight.fetch_add(1, Ordering::SeqCst);
        self.state.touch();
        let guard = InFlight(self.state.clone());
        let future = self.inner.call(request);
        Box::pin(async move {
            let response = future.await;
            drop(guard);
            response
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cap_leaves_room_for_files() {
        assert_eq!(default_max_connections(Some(1024)), 720);
        assert_eq!(default_max_connections(Some(1 << 20)), 16_384);
        assert_eq!(default_max_connections(Some(10)), 16);
    }

    /// A connection table with these caps and a one-minute idle timeout.
    fn table(max_connections: usize, max_per_source: usize) -> Arc<Connections> {
        Connections::new(
            ConnectionLimits {
                max_connections,
                max_per_source,
                idle_timeout: Duration::from_secs(60),
            },
            Arc::new(ServerMetrics::default()),
        )
    }

    #[tokio::test]
    async fn the_end_of_a_request_restarts_the_idle_clock() {
        let connections = table(2, 2);
        let conn = connections.admit(None).unwrap();
        /// A handler that answers at once.
        struct Answer;
        impl tower::Service<()> for Answer {
            type Response = ();
            type Error = std::convert::Infallible;
            type Future = Ready<Result<(), Self::Error>>;
            fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
                Poll::Ready(Ok(()))
            }
            fn call(&mut self, (): ()) -> Self::Future {
                std::future::ready(Ok(()))
            }
        }
        let mut service = TrackRequests {
            inner: Answer,
            state: conn.clone(),
        };
        // A request that began long ago (a long poll that moved no byte while it waited).
        let call = tower::Service::call(&mut service, ());
        conn.last_activity_ms.store(0, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!conn.idle());
        call.await.unwrap();
        // Answered: idle now, but quiet only since the answer, so the answer has the whole idle
        // timeout to be written.
        assert!(conn.idle());
        assert!(conn.last_activity_ms.load(Ordering::SeqCst) >= 20);
    }

    #[tokio::test]
    async fn one_source_makes_room_among_its_own_connections_and_leaves_the_others() {
        let connections = table(10, 2);
        let (a, b): (IpAddr, IpAddr) = ("127.0.0.1".parse().unwrap(), "127.0.0.2".parse().unwrap());
        let other = connections.admit(Some(b)).unwrap();
        tokio::time::sleep(Duration::from_millis(5)).await;
        let first = connections.admit(Some(a)).unwrap();
        tokio::time::sleep(Duration::from_millis(5)).await;
        let second = connections.admit(Some(a)).unwrap();
        // A third from `a` evicts `a`'s idlest, not the older connection of `b`.
        let third = connections.admit(Some(a)).unwrap();
        assert!(first.evicted.load(Ordering::SeqCst));
        assert!(!other.evicted.load(Ordering::SeqCst));
        assert!(!second.evicted.load(Ordering::SeqCst));
        connections.release(first.id);
        // With both of `a`'s connections busy, `a` is refused while `b` is still welcome.
        second.in_flight.fetch_add(1, Ordering::SeqCst);
        third.in_flight.fetch_add(1, Ordering::SeqCst);
        assert!(connections.admit(Some(a)).is_none());
        assert!(connections.admit(Some(b)).is_some());
    }

    #[tokio::test]
    async fn at_the_cap_the_idlest_connection_makes_room_and_busy_ones_stay() {
        let connections = table(2, 2);
        let a = connections.admit(None).unwrap();
        tokio::time::sleep(Duration::from_millis(5)).await;
        let b = connections.admit(None).unwrap();
        // A third evicts `a`, the longest idle.
        let c = connections.admit(None).unwrap();
        assert!(a.evicted.load(Ordering::SeqCst));
        assert!(!b.evicted.load(Ordering::SeqCst));
        connections.release(a.id);
        // With every connection busy, a newcomer is refused.
        b.in_flight.fetch_add(1, Ordering::SeqCst);
        c.in_flight.fetch_add(1, Ordering::SeqCst);
        assert!(connections.admit(None).is_none());
        assert_eq!(connections.open(), 2);
    }
}
