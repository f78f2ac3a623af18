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
//! honest clients reconnect), and only when every such connection is busy is the newcomer
//! refused. Either way the server keeps descriptors for its own files and `/healthz` keeps
//! answering.
//!
//! "Busy" means waiting on the server. Each request's body is wrapped in a [`WatchedBody`] that
//! tells its connection when the handler asked for more of the body and the client has not sent
//! it, and whose bytes restart the idle clock like any other. A connection whose every request in
//! flight is waiting so, and which has moved no byte for the idle timeout, holds up nobody but its
//! own client: at a cap it makes room like an idle one, the idlest first. The idle timeout is the
//! threshold because it is already the server's word for "this peer has gone quiet": an honest
//! sender on a lossy link can pause for seconds (TCP retransmissions back off 1, 2, 4 s…), and
//! one quiet for as long as an idle connection may live is not sending its body, while the body's
//! rate floor may still allow it minutes (a fast start banks time). A long poll, a join waiting
//! for its world, an upload waiting for room in the body budget or being folded, and a connection
//! with any such request beside a stalled body, wait on the server and are never evicted.
//!
//! Each request also carries a [`Peer`], through which the API counts the requests of one
//! address that are in flight before their credentials passed ([`Peer::unauthenticated`]).

use std::collections::HashMap;
use std::future::{Future, Ready};
use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use axum::http::Request;
use http_body::{Body, Frame, SizeHint};
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
    /// A connection quiet this long is closed if no request is in flight on it, and evicted at
    /// a cap if every request on it waits for its client's body.
    pub idle_timeout: Duration,
    /// Requests from one IP address in flight at once before their credentials passed.
    pub max_unauthenticated_per_source: usize,
}

/// The live connections.
pub struct Connections {
    limits: ConnectionLimits,
    epoch: Instant,
    next_id: AtomicU64,
    live: Mutex<HashMap<u64, Arc<ConnState>>>,
    /// Requests in flight whose credentials have not passed, by source (sources with none are
    /// not kept).
    unauthenticated: Mutex<HashMap<IpAddr, usize>>,
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
    /// Request bodies on this connection whose reader is waiting for the client's next bytes.
    awaiting_body: AtomicUsize,
    /// Set to close the connection at its next read (idle or stalled at a cap).
    evicted: AtomicBool,
    reader: Mutex<Option<Waker>>,
}

impl ConnState {
    fn idle(&self) -> bool {
        self.in_flight.load(Ordering::SeqCst) == 0
    }

    /// Whether the connection may be closed to make room at a cap: it is not closing already,
    /// and either no request is in flight on it, or every one is waiting for its client's body
    /// and no byte has moved for `quiet_ms`.
    fn evictable(&self, now_ms: u64, quiet_ms: u64) -> bool {
        if self.evicted.load(Ordering::SeqCst) {
            return false;
        }
        let in_flight = self.in_flight.load(Ordering::SeqCst);
        in_flight == 0
            || (self.awaiting_body.load(Ordering::SeqCst) >= in_flight
                && now_ms.saturating_sub(self.last_activity_ms.load(Ordering::SeqCst)) >= quiet_ms)
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
            unauthenticated: Mutex::new(HashMap::new()),
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
    /// refused. A connection whose requests all wait for their bodies and that has been quiet for
    /// the idle timeout counts as idle ([`ConnState::evictable`]).
    fn admit(self: &Arc<Self>, source: Option<IpAddr>) -> Option<Arc<ConnState>> {
        let mut live = self.live.lock().expect("connection table");
        let (now, quiet_ms) = (self.now_ms(), self.limits.idle_timeout.as_millis() as u64);
        let evictable = |c: &&Arc<ConnState>| c.evictable(now, quiet_ms);
        let key = source.map(source_key);
        let from_source = |c: &&Arc<ConnState>| key.is_some() && c.source.map(source_key) == key;
        let held = live
            .values()
            .filter(|c| from_source(c) && !c.evicted.load(Ordering::SeqCst))
            .count();
        // Which cap is reached, if any: the source's first (its own connections make room).
        let full = if source.is_some() && held >= self.limits.max_per_source {
            Some((
                ["evicted_at_source_cap", "evicted_stalled_at_source_cap"],
                "refused_at_source_cap",
                true,
            ))
        } else if live.len() >= self.limits.max_connections {
            Some((
                ["evicted_at_cap", "evicted_stalled_at_cap"],
                "refused_at_cap",
                false,
            ))
        } else {
            None
        };
        if let Some(([idle, stalled], refused, same_source)) = full {
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
            let why = if c.idle() { idle } else { stalled };
            c.evict();
            self.metrics.connections_closed(why);
        }
        let state = Arc::new(ConnState {
            id: self.next_id.fetch_add(1, Ordering::SeqCst),
            source,
            epoch: self.epoch,
            last_activity_ms: AtomicU64::new(self.now_ms()),
            in_flight: AtomicUsize::new(0),
            awaiting_body: AtomicUsize::new(0),
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

    /// Counts one more unauthenticated request of `source` in flight, unless it has its limit.
    fn begin_unauthenticated(&self, source: IpAddr) -> bool {
        let mut counts = self.unauthenticated.lock().expect("unauthenticated table");
        let count = counts.entry(source_key(source)).or_insert(0);
        if *count >= self.limits.max_unauthenticated_per_source {
            return false;
        }
        *count += 1;
        true
    }

    fn end_unauthenticated(&self, source: IpAddr) {
        let mut counts = self.unauthenticated.lock().expect("unauthenticated table");
        let source = source_key(source);
        if let Some(count) = counts.get_mut(&source) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                counts.remove(&source);
            }
        }
    }
}

/// An address as the per-source limits count it (connections, unauthenticated requests, the
/// admin token's budget): IPv4 as it is (an IPv4-mapped IPv6 address as its IPv4 one), IPv6 by
/// its /64, what one host or one customer line is commonly given.
pub fn source_key(ip: IpAddr) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V6(v6) => IpAddr::V6((u128::from(v6) & !((1u128 << 64) - 1)).into()),
        v4 => v4,
    }
}

/// What a request knows of its connection: put in each request's extensions by
/// [`TrackRequests`] (absent where the server runs without the guard, as in-process tests do).
#[derive(Clone)]
pub struct Peer {
    connections: Arc<Connections>,
    source: Option<IpAddr>,
}

impl Peer {
    /// The address the request came from, where it could be read.
    pub fn source(&self) -> Option<IpAddr> {
        self.source
    }

    /// Counts the request among its source's requests in flight whose credentials have not
    /// passed, until [`Unauthenticated::passed`] or its drop; None when the source has
    /// `max_unauthenticated_per_source` already, and the request is to be refused at once. A
    /// request whose source could not be read is not counted.
    pub fn unauthenticated(&self) -> Option<Unauthenticated> {
        let source = match self.source {
            Some(source) if !self.connections.begin_unauthenticated(source) => {
                self.connections.metrics.unauthenticated_refused.inc();
                return None;
            }
            source => source,
        };
        Some(Unauthenticated(Arc::new(Counted {
            connections: self.connections.clone(),
            source,
            counted: AtomicBool::new(source.is_some()),
        })))
    }
}

/// A request counted among its source's unauthenticated requests in flight ([`Peer`]); cloned
/// into the request, so its credential checks can say they passed. The count ends at the first
/// of [`Unauthenticated::passed`] and the drop of the last clone.
#[derive(Clone)]
pub struct Unauthenticated(Arc<Counted>);

struct Counted {
    connections: Arc<Connections>,
    source: Option<IpAddr>,
    counted: AtomicBool,
}

impl Counted {
    fn end(&self) {
        if let Some(source) = self.source {
            if self.counted.swap(false, Ordering::SeqCst) {
                self.connections.end_unauthenticated(source);
            }
        }
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.end();
    }
}

impl Unauthenticated {
    /// The request's credentials passed: it no longer counts against its source.
    pub fn passed(&self) {
        self.0.end();
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
                connections: self.connections.clone(),
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

    /// Once evicted, nothing more is written either: the handler of a stalled body that the
    /// eviction cut off would otherwise answer it with a refusal its client takes as final,
    /// where a closed connection is one it retries.
    fn evicted(&self) -> Option<io::Error> {
        self.state.evicted.load(Ordering::SeqCst).then(|| {
            io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "connection closed by the server to make room",
            )
        })
    }

    /// While the read is pending: whether the connection should end now, else arms the timer
    /// for the moment it would.
    fn expired(&mut self, cx: &mut Context<'_>) -> Option<&'static str> {
        if self.state.evicted.load(Ordering::SeqCst) {
            return Some(EVICTED);
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

/// Why an evicted connection's read ends; counted once, under its reason, by the admission that
/// evicted it.
const EVICTED: &str = "evicted";

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
                    if why != EVICTED {
                        self.connections.metrics.connections_closed(why);
                    }
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
        if let Some(closed) = self.evicted() {
            return Poll::Ready(Err(closed));
        }
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
        if let Some(closed) = self.evicted() {
            return Poll::Ready(Err(closed));
        }
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

/// Counts a connection's requests in flight (from the call until the response is ready), wraps
/// each one's body in a [`WatchedBody`], and gives each its [`Peer`].
#[derive(Clone)]
pub struct TrackRequests<S> {
    inner: S,
    state: Arc<ConnState>,
    connections: Arc<Connections>,
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

impl<S, B> tower::Service<Request<B>> for TrackRequests<S>
where
    S: tower::Service<Request<WatchedBody<B>>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future =
        Pin<Box<dyn std::future::Future<Output = Result<S::Response, S::Error>> + Send + 'static>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        self.state.in_flight.fetch_add(1, Ordering::SeqCst);
        self.state.touch();
        let guard = InFlight(self.state.clone());
        let mut request = request.map(|inner| WatchedBody {
            inner,
            conn: self.state.clone(),
            started: false,
            waiting: false,
        });
        request.extensions_mut().insert(Peer {
            connections: self.connections.clone(),
            source: self.state.source,
        });
        let future = self.inner.call(request);
        Box::pin(async move {
            let response = future.await;
            drop(guard);
            response
        })
    }
}

/// A request body that tells its connection while its reader waits for the client's next bytes
/// (the connection may then be evicted at a cap once quiet long enough), and whose bytes restart
/// the idle clock. A body nobody reads, or one waiting for room in the body budget, is not
/// waiting for its client.
pub struct WatchedBody<B> {
    inner: B,
    conn: Arc<ConnState>,
    /// Whether the body has been asked for bytes yet.
    started: bool,
    /// Whether its last poll found no bytes (counted in the connection's `awaiting_body`).
    waiting: bool,
}

impl<B> WatchedBody<B> {
    fn set_waiting(&mut self, waiting: bool) {
        if waiting != self.waiting {
            self.waiting = waiting;
            match waiting {
                true => self.conn.awaiting_body.fetch_add(1, Ordering::SeqCst),
                false => self.conn.awaiting_body.fetch_sub(1, Ordering::SeqCst),
            };
        }
    }
}

impl<B> Drop for WatchedBody<B> {
    fn drop(&mut self) {
        self.set_waiting(false);
    }
}

impl<B: Body + Unpin> Body for WatchedBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        if !self.started {
            // The client's quiet time counts from when the server asks for its body, not from
            // a wait of the server's own before (for room in the body budget).
            self.started = true;
            self.conn.touch();
        }
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if matches!(polled, Poll::Ready(Some(Ok(_)))) {
            self.conn.touch();
        }
        self.set_waiting(polled.is_pending());
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
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
        table_idle(max_connections, max_per_source, Duration::from_secs(60))
    }

    fn table_idle(
        max_connections: usize,
        max_per_source: usize,
        idle_timeout: Duration,
    ) -> Arc<Connections> {
        Connections::new(
            ConnectionLimits {
                max_connections,
                max_per_source,
                idle_timeout,
                max_unauthenticated_per_source: 2,
            },
            Arc::new(ServerMetrics::default()),
        )
    }

    /// A request body whose client never sends a byte.
    struct Silent;

    impl Body for Silent {
        type Data = axum::body::Bytes;
        type Error = std::convert::Infallible;

        fn poll_frame(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
            Poll::Pending
        }
    }

    /// A request in flight on `conn` (as [`TrackRequests`] counts it), with its body; the
    /// request ends when the guard is dropped.
    fn request(conn: &Arc<ConnState>) -> (InFlight, WatchedBody<Silent>) {
        conn.in_flight.fetch_add(1, Ordering::SeqCst);
        let body = WatchedBody {
            inner: Silent,
            conn: conn.clone(),
            started: false,
            waiting: false,
        };
        (InFlight(conn.clone()), body)
    }

    /// The handler asks `body` for its next bytes, once.
    fn ask(body: &mut WatchedBody<Silent>) {
        let mut cx = Context::from_waker(Waker::noop());
        assert!(Pin::new(body).poll_frame(&mut cx).is_pending());
    }

    #[tokio::test]
    async fn a_body_stalled_for_the_idle_timeout_makes_room_and_a_long_poll_never_does() {
        let connections = table_idle(3, 3, Duration::from_millis(100));
        let (stalled, polling, both) = (
            connections.admit(None).unwrap(),
            connections.admit(None).unwrap(),
            connections.admit(None).unwrap(),
        );
        // An upload whose client stopped sending; a long poll (no body to wait for); a
        // connection with a stalled upload and a long poll (HTTP/2 streams).
        let (_upload, mut body) = request(&stalled);
        ask(&mut body);
        let _poll = request(&polling);
        let (_upload_2, mut body_2) = request(&both);
        ask(&mut body_2);
        let _poll_2 = request(&both);
        // Quiet for less than the idle timeout: nothing may make room.
        assert!(connections.admit(None).is_none());
        tokio::time::sleep(Duration::from_millis(150)).await;
        // Then the stalled upload's connection is closed for the newcomer, and only it.
        let newcomer = connections.admit(None).unwrap();
        assert!(stalled.evicted.load(Ordering::SeqCst));
        assert!(!polling.evicted.load(Ordering::SeqCst));
        assert!(!both.evicted.load(Ordering::SeqCst));
        connections.release(stalled.id);
        let _busy = request(&newcomer);
        assert!(connections.admit(None).is_none());
    }

    #[tokio::test]
    async fn a_body_that_receives_bytes_or_is_not_being_read_is_not_stalled() {
        let connections = table_idle(1, 1, Duration::from_millis(50));
        let conn = connections.admit(None).unwrap();
        // A body the handler has not asked for yet (its upload waits for room in the budget).
        let (_upload, mut body) = request(&conn);
        tokio::time::sleep(Duration::from_millis(80)).await;
        assert!(!conn.evictable(connections.now_ms(), 50));
        // Asked for at last: the client's quiet time counts from now.
        ask(&mut body);
        assert!(!conn.evictable(connections.now_ms(), 50));
        tokio::time::sleep(Duration::from_millis(80)).await;
        assert!(conn.evictable(connections.now_ms(), 50));
        // Bytes moving on the connection restart the clock.
        conn.touch();
        assert!(!conn.evictable(connections.now_ms(), 50));
        // A body read to its end (or dropped) waits for nothing.
        drop(body);
        assert_eq!(conn.awaiting_body.load(Ordering::SeqCst), 0);
        tokio::time::sleep(Duration::from_millis(80)).await;
        assert!(!conn.evictable(connections.now_ms(), 50));
    }

    #[test]
    fn unauthenticated_requests_are_counted_per_source_until_they_pass_or_end() {
        let connections = table(10, 10);
        let peer = |ip: &str| Peer {
            connections: connections.clone(),
            source: Some(ip.parse().unwrap()),
        };
        let (a, b) = (peer("10.0.0.1"), peer("10.0.0.2"));
        let first = a.unauthenticated().unwrap();
        let second = a.unauthenticated().unwrap();
        // A third from the same source is refused; another source is not.
        assert!(a.unauthenticated().is_none());
        let _other = b.unauthenticated().unwrap();
        // Credentials that pass free the place at once (once, however often it is said)...
        second.passed();
        second.passed();
        let third = a.unauthenticated().unwrap();
        assert!(a.unauthenticated().is_none());
        // ...and so does the end of the request, when the last clone of it goes.
        let clone = first.clone();
        drop(first);
        assert!(a.unauthenticated().is_none());
        drop(clone);
        let _fourth = a.unauthenticated().unwrap();
        drop((second, third));
        // An unreadable source is not counted.
        let unknown = Peer {
            connections: connections.clone(),
            source: None,
        };
        let _held: Vec<_> = (0..5).map(|_| unknown.unauthenticated().unwrap()).collect();
        // One IPv6 /64 is one source, whatever its interface identifiers; the next /64 is
        // another; an IPv4-mapped address is its IPv4 one.
        let (v6, v6_too) = (peer("2001:db8:0:1::1"), peer("2001:db8:0:1:ffff::2"));
        let _v6 = (
            v6.unauthenticated().unwrap(),
            v6_too.unauthenticated().unwrap(),
        );
        assert!(peer("2001:db8:0:1::3").unauthenticated().is_none());
        let _next = peer("2001:db8:0:2::1").unauthenticated().unwrap();
        let _mapped = peer("::ffff:10.0.0.2").unauthenticated().unwrap(); // beside `_other`
        assert!(peer("::ffff:10.0.0.2").unauthenticated().is_none());
    }

    #[tokio::test]
    async fn the_end_of_a_request_restarts_the_idle_clock() {
        let connections = table(2, 2);
        let conn = connections.admit(None).unwrap();
        /// A handler that answers at once.
        struct Answer;
        impl tower::Service<Request<WatchedBody<String>>> for Answer {
            type Response = ();
            type Error = std::convert::Infallible;
            type Future = Ready<Result<(), Self::Error>>;
            fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
                Poll::Ready(Ok(()))
            }
            fn call(&mut self, _: Request<WatchedBody<String>>) -> Self::Future {
                std::future::ready(Ok(()))
            }
        }
        let mut service = TrackRequests {
            inner: Answer,
            state: conn.clone(),
            connections: connections.clone(),
        };
        // A request that began long ago (a long poll that moved no byte while it waited).
        let call = tower::Service::call(&mut service, Request::new(String::new()));
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
        // An IPv6 /64 is one source: a third address in it evicts the idlest of its two.
        let ip = |s: &str| Some(s.parse::<IpAddr>().unwrap());
        let v6 = connections.admit(ip("2001:db8::1")).unwrap();
        tokio::time::sleep(Duration::from_millis(5)).await;
        let _v6_too = connections.admit(ip("2001:db8::2:3")).unwrap();
        let _third = connections.admit(ip("2001:db8::ffff:4")).unwrap();
        assert!(v6.evicted.load(Ordering::SeqCst));
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
