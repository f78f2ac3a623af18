//! The ring's connections: each worker sends to its right neighbour and receives from its left,
//! over one TCP connection each (for two workers, two connections between the same pair).
//!
//! Frames are a 16-byte header — kind, an auxiliary word, payload length — and the payload. The
//! connecting side opens with `Hello` (protocol version, the world's session and generation, its
//! rank); the accepting side answers `Welcome` only to the left neighbour it expects, so a worker
//! of another job, another generation or another version is refused instead of corrupting a
//! reduction.
//!
//! Failure is loud and fast. Reads and writes have a timeout (`--timeout`, 30 s by default); a
//! closed connection or a timeout is turned into an error naming the rank at the other end; and
//! the worker that notices first sends an `Abort` frame naming the failed rank to its right
//! neighbour, which forwards it, so every survivor stops and names the same rank. Payload lengths
//! are checked against what the receiver expects before anything is read into memory.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::thread;
use std::time::{Duration, Instant};

use super::rendezvous::World;
use super::{Result, SyncError};

/// Bumped whenever frames change: workers of different versions refuse each other.
const PROTOCOL_VERSION: u32 = 1;
const HEADER_LEN: usize = 16;
const MAGIC: u8 = 0xA7;
/// The largest control payload (hello, op header, abort) accepted.
const MAX_CONTROL: u64 = 64 << 10;
/// Kernel socket buffers: a few pipelined sub-chunks in flight each way.
const SOCKET_BUFFER: usize = 8 << 20;

/// What a frame carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    Hello = 1,
    Welcome = 2,
    /// The description of the collective a rank is about to run (see `ring::OpHeader`).
    Op = 3,
    Data = 4,
    Blob = 5,
    Abort = 6,
}

impl Kind {
    fn from_u8(b: u8) -> Option<Kind> {
        Some(match b {
            1 => Kind::Hello,
            2 => Kind::Welcome,
            3 => Kind::Op,
            4 => Kind::Data,
            5 => Kind::Blob,
            6 => Kind::Abort,
            _ => return None,
        })
    }
}

/// A frame header as read.
#[derive(Debug, Clone, Copy)]
pub struct Header {
    pub kind: Kind,
    pub aux: u32,
    pub len: u64,
}

fn encode_header(kind: Kind, aux: u32, len: u64) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[0] = MAGIC;
    h[1] = kind as u8;
    h[4..8].copy_from_slice(&aux.to_le_bytes());
    h[8..16].copy_from_slice(&len.to_le_bytes());
    h
}

/// The sending end (to the right neighbour).
pub struct Outbound {
    stream: TcpStream,
    /// The neighbour's rank, for error messages.
    pub peer: u32,
    timeout: Duration,
}

/// The receiving end (from the left neighbour).
pub struct Inbound {
    stream: TcpStream,
    pub peer: u32,
    timeout: Duration,
}

impl Outbound {
    /// Writes one frame: header, then payload.
    pub fn send(&mut self, kind: Kind, aux: u32, payload: &[u8]) -> Result<()> {
        let header = encode_header(kind, aux, payload.len() as u64);
        self.stream
            .write_all(&header)
            .and_then(|()| self.stream.write_all(payload))
            .map_err(|e| self.failed(e))
    }

    /// Tells the right neighbour that `rank` failed (best effort: it may be the one that died).
    pub fn abort(&mut self, rank: Option<u32>, message: &str) {
        let mut payload = rank.unwrap_or(u32::MAX).to_le_bytes().to_vec();
        payload.extend_from_slice(message.as_bytes());
        payload.truncate(MAX_CONTROL as usize);
        let _ = self.stream.set_write_timeout(Some(Duration::from_secs(2)));
        let _ = self.send(Kind::Abort, 0, &payload);
        let _ = self.stream.shutdown(Shutdown::Both);
    }

    fn failed(&self, e: io::Error) -> SyncError {
        let what = match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => format!(
                "stopped receiving for {} s: it stalled or died (raise --timeout if a step can legitimately take longer)",
                self.timeout.as_secs()
            ),
            _ => format!("closed its connection ({e}): the process exited or crashed"),
        };
        SyncError::PeerFailed {
            rank: self.peer,
            what,
        }
    }
}

impl Inbound {
    /// Reads the next header. An `Abort` frame becomes the error it reports.
    pub fn header(&mut self) -> Result<Header> {
        let mut h = [0u8; HEADER_LEN];
        self.stream.read_exact(&mut h).map_err(|e| self.failed(e))?;
        let kind = Kind::from_u8(h[1])
            .filter(|_| h[0] == MAGIC)
            .ok_or_else(|| {
                SyncError::Protocol(format!(
                    "rank {} sent a malformed frame header (is it running the same Hora version?)",
                    self.peer
                ))
            })?;
        let header = Header {
            kind,
            aux: u32::from_le_bytes([h[4], h[5], h[6], h[7]]),
            len: u64::from_le_bytes([h[8], h[9], h[10], h[11], h[12], h[13], h[14], h[15]]),
        };
        if kind == Kind::Abort {
            let payload = self.control_payload(header.len)?;
            let (rank, message) = payload.split_at(4.min(payload.len()));
            let rank = <[u8; 4]>::try_from(rank).map(u32::from_le_bytes).ok();
            let message = String::from_utf8_lossy(message).into_owned();
            return Err(match rank {
                Some(rank) if rank != u32::MAX => SyncError::PeerFailed {
                    rank,
                    what: format!("{message} (reported around the ring by rank {})", self.peer),
                },
                _ => SyncError::Mismatch(message),
            });
        }
        Ok(header)
    }

    /// Reads a header that must be `kind` with exactly `len` payload bytes.
    pub fn expect(&mut self, kind: Kind, len: u64) -> Result<Header> {
        let h = self.header()?;
        if h.kind != kind || h.len != len {
            return Err(SyncError::Protocol(format!(
                "rank {} sent a {:?} frame of {} bytes where a {kind:?} frame of {len} bytes was due \
                 (the ranks are out of step: do all of them make the same collective calls?)",
                self.peer, h.kind, h.len
            )));
        }
        Ok(h)
    }

    /// Reads a payload whose length the header gave (already checked by the caller).
    pub fn payload(&mut self, buf: &mut [u8]) -> Result<()> {
        self.stream.read_exact(buf).map_err(|e| self.failed(e))
    }

    /// Reads a small payload, refusing anything over the control limit before allocating.
    pub fn control_payload(&mut self, len: u64) -> Result<Vec<u8>> {
        if len > MAX_CONTROL {
            return Err(SyncError::Protocol(format!(
                "rank {} sent a control frame of {len} bytes (limit {MAX_CONTROL})",
                self.peer
            )));
        }
        let mut buf = vec![0u8; len as usize];
        self.payload(&mut buf)?;
        Ok(buf)
    }

    fn failed(&self, e: io::Error) -> SyncError {
        let what = match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => format!(
                "sent nothing for {} s: it stalled or died (raise --timeout if a step can legitimately take longer)",
                self.timeout.as_secs()
            ),
            _ => format!("closed its connection ({e}): the process exited or crashed"),
        };
        SyncError::PeerFailed {
            rank: self.peer,
            what,
        }
    }
}

/// Both ends of one worker's place in the ring (none in a world of one).
pub struct Links {
    pub inbound: Inbound,
    pub outbound: Outbound,
}

fn tune(stream: &TcpStream, timeout: Duration) -> io::Result<()> {
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    let socket = socket2::SockRef::from(stream);
    socket.set_send_buffer_size(SOCKET_BUFFER)?;
    socket.set_recv_buffer_size(SOCKET_BUFFER)?;
    Ok(())
}

fn hello_payload(world: &World) -> Vec<u8> {
    format!(
        "{PROTOCOL_VERSION} {} {} {} {}",
        world.session, world.generation, world.rank, world.size
    )
    .into_bytes()
}

impl Links {
    /// Binds the address this worker will accept its left neighbour on (before the rendezvous,
    /// so the address it announces is already listening).
    pub fn listen(address: &str) -> Result<TcpListener> {
        TcpListener::bind(address).map_err(|e| {
            SyncError::io(
                format!("listening for the ring on {address} (choose another with --listen)"),
                e,
            )
        })
    }

    /// Connects to the right neighbour and accepts the left one, both within `timeout`.
    pub fn connect(world: &World, listener: TcpListener, timeout: Duration) -> Result<Links> {
        if world.size < 2 {
            return Err(SyncError::Config(
                "a world of one has no ring to connect".into(),
            ));
        }
        let deadline = Instant::now() + timeout;
        let right = world.right();
        let address = world.peers[right as usize].clone();
        let hello = hello_payload(world);
        let outbound = thread::scope(|s| {
            let out = s.spawn(|| connect_right(&address, right, &hello, deadline, timeout));
            let inbound = accept_left(world, &listener, deadline, timeout);
            let outbound = out
                .join()
                .map_err(|_| SyncError::Config("the connecting thread panicked".into()))?;
            Ok::<_, SyncError>((inbound?, outbound?))
        })?;
        Ok(Links {
            inbound: outbound.0,
            outbound: outbound.1,
        })
    }
}

fn resolve(address: &str) -> Result<Vec<SocketAddr>> {
    address
        .to_socket_addrs()
        .map(|a| a.collect())
        .map_err(|e| SyncError::io(format!("resolving the ring address {address}"), e))
}

fn connect_right(
    address: &str,
    rank: u32,
    hello: &[u8],
    deadline: Instant,
    timeout: Duration,
) -> Result<Outbound> {
    let addrs = resolve(address)?;
    let mut delay = Duration::from_millis(20);
    loop {
        let attempt = addrs
            .iter()
            .find_map(|a| TcpStream::connect_timeout(a, Duration::from_secs(5).min(timeout)).ok());
        if let Some(stream) = attempt {
            tune(&stream, timeout).map_err(|e| SyncError::io("tuning the ring socket", e))?;
            let mut out = Outbound {
                stream,
                peer: rank,
                timeout,
            };
            out.send(Kind::Hello, 0, hello)?;
            let mut back = Inbound {
                stream: out
                    .stream
                    .try_clone()
                    .map_err(|e| SyncError::io("cloning the ring socket", e))?,
                peer: rank,
                timeout,
            };
            let refused = |why: String| {
                SyncError::Protocol(format!(
                    "rank {rank} at {address} refused this worker: {why}"
                ))
            };
            let h = back.header().map_err(|e| match e {
                SyncError::Mismatch(why) => refused(why),
                e => e,
            })?;
            back.control_payload(h.len)?;
            if h.kind != Kind::Welcome {
                return Err(refused(format!("answered {:?}", h.kind)));
            }
            return Ok(out);
        }
        if Instant::now() + delay > deadline {
            return Err(SyncError::PeerFailed {
                rank,
                what: format!(
                    "could not be reached at {address} within {} s: it did not start, or the address is wrong",
                    timeout.as_secs()
                ),
            });
        }
        thread::sleep(delay);
        delay = (delay * 2).min(Duration::from_millis(500));
    }
}

fn accept_left(
    world: &World,
    listener: &TcpListener,
    deadline: Instant,
    timeout: Duration,
) -> Result<Inbound> {
    let left = world.left();
    let expected = {
        let mut w = world.clone();
        w.rank = left;
        hello_payload(&w)
    };
    listener
        .set_nonblocking(true)
        .map_err(|e| SyncError::io("configuring the ring listener", e))?;
    loop {
        match listener.accept() {
            Ok((stream, from)) => {
                stream
                    .set_nonblocking(false)
                    .and_then(|()| tune(&stream, timeout.min(Duration::from_secs(10))))
                    .map_err(|e| SyncError::io("tuning the ring socket", e))?;
                let mut inbound = Inbound {
                    stream,
                    peer: left,
                    timeout,
                };
                let Ok(h) = inbound.header() else { continue };
                let Ok(hello) = inbound.control_payload(h.len) else {
                    continue;
                };
                let mut reply = Outbound {
                    stream: inbound
                        .stream
                        .try_clone()
                        .map_err(|e| SyncError::io("cloning the ring socket", e))?,
                    peer: left,
                    timeout,
                };
                if h.kind != Kind::Hello || hello != expected {
                    let why = format!(
                        "expected rank {left} of session {} generation {} (protocol {PROTOCOL_VERSION}), got {:?}",
                        world.session,
                        world.generation,
                        String::from_utf8_lossy(&hello)
                    );
                    tracing::warn!(%from, "refused a ring connection: {why}");
                    reply.abort(None, &why);
                    continue;
                }
                reply.send(Kind::Welcome, 0, b"")?;
                inbound
                    .stream
                    .set_read_timeout(Some(timeout))
                    .map_err(|e| SyncError::io("tuning the ring socket", e))?;
                return Ok(inbound);
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if Instant::now() > deadline {
                    return Err(SyncError::PeerFailed {
                        rank: left,
                        what: format!(
                            "did not connect within {} s: it did not start, or it cannot reach this worker's address {}",
                            timeout.as_secs(),
                            world.peers[world.rank as usize]
                        ),
                    });
                }
                thread::sleep(Duration::from_millis(10));
            }
            Err(e) => return Err(SyncError::io("accepting the left neighbour", e)),
        }
    }
}
