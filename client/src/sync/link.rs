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
//!
//! **Shared memory between neighbours on one host.** When both ends run on the same machine
//! (same kernel boot id), the receiving side offers a ring of slots in a shared-memory file
//! (`/dev/shm`, unlinked as soon as both have mapped it): the sender writes a piece straight
//! into a free slot and sends only a 16-byte header over TCP, and the receiver reduces straight
//! out of the slot and hands it back with a credit frame. One copy per byte instead of two
//! through the kernel, and no payload system calls — what NCCL and MPI do within a node. The TCP
//! connection stays: it carries the headers, credits, aborts and timeouts, so failure detection
//! is the same either way. `HORA_RING_SHM=0` turns it off.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::thread;
use std::time::{Duration, Instant};

use super::rendezvous::World;
use super::{Result, SyncError};

/// Bumped whenever frames change: workers of different versions refuse each other.
const PROTOCOL_VERSION: u32 = 1;
const HEADER_LEN: usize = 16;
const MAGIC: u8 = 0xA7;
/// The largest control payload (hello, op header, abort) accepted.
pub(crate) const MAX_CONTROL: u64 = 64 << 10;
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
    /// A data piece waiting in shared-memory slot `aux`.
    SlotData = 7,
    /// The receiver is done with slot `aux` (flows back to the sender).
    Credit = 8,
    /// The connecting side mapped the offered shared memory (or, with payload `no`, did not).
    Attached = 9,
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
            7 => Kind::SlotData,
            8 => Kind::Credit,
            9 => Kind::Attached,
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

/// How a relayed failure is marked: "(reported around the ring by rank N)".
const RELAYED: &str = "reported around the ring by rank";

/// What a failed read or write on a neighbour's connection says about the neighbour.
fn peer_failed(peer: u32, timeout: Duration, silent: &str, e: io::Error) -> SyncError {
    let what = match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => format!(
            "{silent} for {} s: it stalled or died (raise --timeout if a step can legitimately take longer)",
            timeout.as_secs()
        ),
        _ => format!("closed its connection ({e}): the process exited or crashed"),
    };
    SyncError::PeerFailed { rank: peer, what }
}

/// The sending end (to the right neighbour).
pub struct Outbound {
    stream: TcpStream,
    /// The neighbour's rank, for error messages.
    pub peer: u32,
    timeout: Duration,
    slots: Option<SenderSlots>,
}

/// The receiving end (from the left neighbour).
pub struct Inbound {
    stream: TcpStream,
    pub peer: u32,
    timeout: Duration,
    slots: Option<ReceiverSlots>,
}

/// The sender's side of a shared-memory slot ring.
struct SenderSlots {
    map: memmap2::MmapMut,
    slot_bytes: usize,
    /// Slots the receiver has handed back.
    free: Vec<u32>,
}

/// The receiver's side of a shared-memory slot ring.
struct ReceiverSlots {
    map: memmap2::Mmap,
    slot_bytes: usize,
}

/// Where an announced data piece is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Incoming {
    /// In the TCP stream, right after the header.
    Stream,
    /// In shared-memory slot `n`.
    Slot(u32),
}

/// Slots offered to a same-host sender.
const SLOTS: u32 = 8;
/// Larger pieces go over TCP (and no more than 8 × this is put in /dev/shm per link).
const MAX_SLOT_BYTES: usize = 16 << 20;

impl Outbound {
    /// Writes one frame: header, then payload.
    pub fn send(&mut self, kind: Kind, aux: u32, payload: &[u8]) -> Result<()> {
        let header = encode_header(kind, aux, payload.len() as u64);
        self.stream
            .write_all(&header)
            .and_then(|()| self.stream.write_all(payload))
            .map_err(|e| self.failed(e))
    }

    /// Sends one data piece of `len` bytes: `direct` as it is, or what `fill` writes. Over
    /// shared memory `fill` writes straight into a slot and only a header crosses the socket;
    /// otherwise `fill` writes into `scratch`.
    pub fn send_data(
        &mut self,
        len: usize,
        direct: Option<&[u8]>,
        scratch: &mut Vec<u32>,
        fill: impl FnOnce(&mut [u8]) -> Result<()>,
    ) -> Result<()> {
        if self.slots.as_ref().is_some_and(|s| len <= s.slot_bytes) {
            let slot = self.free_slot()?;
            let slots = self
                .slots
                .as_mut()
                .ok_or_else(|| SyncError::Config("no slots".into()))?;
            let at = slot as usize * slots.slot_bytes;
            // SAFETY: `at + len` lies within the mapping (len <= slot_bytes, slot < SLOTS); the
            // slice covers only this slot, which this side holds until it announces it, so
            // nothing else reads or writes these bytes meanwhile (see `create_slots`).
            let dst =
                unsafe { std::slice::from_raw_parts_mut(slots.map.as_mut_ptr().add(at), len) };
            match direct {
                Some(bytes) => dst.copy_from_slice(bytes),
                None => fill(dst)?,
            }
            // The slot's bytes are written before the header that announces them.
            std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
            let header = encode_header(Kind::SlotData, slot, len as u64);
            return self.stream.write_all(&header).map_err(|e| self.failed(e));
        }
        match direct {
            Some(bytes) => self.send(Kind::Data, 0, bytes),
            None => {
                scratch.resize(len.div_ceil(4), 0);
                let buf = &mut bytemuck::cast_slice_mut::<u32, u8>(scratch)[..len];
                fill(buf)?;
                self.send(Kind::Data, 0, buf)
            }
        }
    }

    /// Waits until the receiver has handed back every slot. Called at the end of each
    /// collective, so that no credit is left unread in the socket: closing a socket with unread
    /// data resets the connection, and the reset could destroy data the neighbour still has to
    /// read.
    pub fn settle(&mut self) -> Result<()> {
        while self
            .slots
            .as_ref()
            .is_some_and(|s| s.free.len() < SLOTS as usize)
        {
            let slot = self.read_credit()?;
            if let Some(s) = self.slots.as_mut() {
                s.free.push(slot);
            }
        }
        Ok(())
    }

    /// A slot the receiver is done with, waiting for its credit if none is free.
    fn free_slot(&mut self) -> Result<u32> {
        loop {
            if let Some(slot) = self.slots.as_mut().and_then(|s| s.free.pop()) {
                return Ok(slot);
            }
            let slot = self.read_credit()?;
            if let Some(s) = self.slots.as_mut() {
                s.free.push(slot);
            }
        }
    }

    fn read_credit(&mut self) -> Result<u32> {
        {
            let mut h = [0u8; HEADER_LEN];
            self.stream.read_exact(&mut h).map_err(|e| self.failed(e))?;
            if h[0] != MAGIC || Kind::from_u8(h[1]) != Some(Kind::Credit) {
                return Err(SyncError::Protocol(format!(
                    "rank {} sent something other than a slot credit back",
                    self.peer
                )));
            }
            let slot = u32::from_le_bytes([h[4], h[5], h[6], h[7]]);
            if slot >= SLOTS {
                return Err(SyncError::Protocol(format!(
                    "rank {} returned slot {slot} of {SLOTS}",
                    self.peer
                )));
            }
            Ok(slot)
        }
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
        peer_failed(self.peer, self.timeout, "stopped receiving", e)
    }
}

impl Inbound {
    /// Reads the next header. An `Abort` frame becomes the error it reports.
    pub fn header(&mut self) -> Result<Header> {
        let header = self.raw_header()?;
        if header.kind == Kind::Abort {
            return Err(self.abort_error(header.len)?);
        }
        Ok(header)
    }

    /// The next header as it is, `Abort` included.
    fn raw_header(&mut self) -> Result<Header> {
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
        Ok(Header {
            kind,
            aux: u32::from_le_bytes([h[4], h[5], h[6], h[7]]),
            len: u64::from_le_bytes([h[8], h[9], h[10], h[11], h[12], h[13], h[14], h[15]]),
        })
    }

    /// The failure an `Abort` frame with `len` payload bytes reports.
    fn abort_error(&mut self, len: u64) -> Result<SyncError> {
        let payload = self.control_payload(len)?;
        let (rank, message) = payload.split_at(4.min(payload.len()));
        let rank = <[u8; 4]>::try_from(rank).map(u32::from_le_bytes).ok();
        let message = String::from_utf8_lossy(message).into_owned();
        Ok(match rank {
            // The first rank to forward it says so; the others pass it on as it is.
            Some(rank) if rank != u32::MAX => SyncError::PeerFailed {
                rank,
                what: if message.contains(RELAYED) {
                    message
                } else {
                    format!("{message} ({RELAYED} {})", self.peer)
                },
            },
            _ => SyncError::Mismatch(message),
        })
    }

    /// An abort frame that arrives within `wait`, as the error it reports (used after our right
    /// neighbour hung up, to learn whether it did so because of a failure elsewhere).
    pub fn pending_abort(&mut self, wait: Duration) -> Option<SyncError> {
        let _ = self.stream.set_read_timeout(Some(wait));
        let found = match self.raw_header() {
            Ok(h) if h.kind == Kind::Abort => self.abort_error(h.len).ok(),
            _ => None,
        };
        let _ = self.stream.set_read_timeout(Some(self.timeout));
        found
    }

    /// Reads the header of a data piece of exactly `len` bytes: in the stream or in a slot.
    pub fn data_header(&mut self, len: u64) -> Result<Incoming> {
        let h = self.header()?;
        let incoming = match h.kind {
            Kind::Data => Incoming::Stream,
            Kind::SlotData
                if self
                    .slots
                    .as_ref()
                    .is_some_and(|s| h.aux < SLOTS && h.len as usize <= s.slot_bytes) =>
            {
                Incoming::Slot(h.aux)
            }
            _ => Incoming::Stream,
        };
        if !matches!(h.kind, Kind::Data | Kind::SlotData)
            || h.len != len
            || (h.kind == Kind::SlotData && incoming == Incoming::Stream)
        {
            return Err(SyncError::Protocol(format!(
                "rank {} sent a {:?} frame of {} bytes where a data piece of {len} bytes was due \
                 (the ranks are out of step: do all of them make the same collective calls?)",
                self.peer, h.kind, h.len
            )));
        }
        Ok(incoming)
    }

    /// Copies an announced piece into `dst`.
    pub fn data_into(&mut self, incoming: Incoming, dst: &mut [u8]) -> Result<()> {
        match incoming {
            Incoming::Stream => self.payload(dst),
            Incoming::Slot(slot) => {
                dst.copy_from_slice(self.slot(slot, dst.len())?);
                self.credit(slot)
            }
        }
    }

    /// Runs `f` on an announced piece of `len` bytes: read into `scratch`, or in its slot.
    pub fn data_with<T>(
        &mut self,
        incoming: Incoming,
        len: usize,
        scratch: &mut Vec<u32>,
        f: impl FnOnce(&[u8]) -> Result<T>,
    ) -> Result<T> {
        match incoming {
            Incoming::Stream => {
                scratch.resize(len.div_ceil(4), 0);
                let buf = &mut bytemuck::cast_slice_mut::<u32, u8>(scratch)[..len];
                self.payload(buf)?;
                f(buf)
            }
            Incoming::Slot(slot) => {
                let result = f(self.slot(slot, len)?);
                self.credit(slot)?;
                result
            }
        }
    }

    fn slot(&self, slot: u32, len: usize) -> Result<&[u8]> {
        let slots = self
            .slots
            .as_ref()
            .ok_or_else(|| SyncError::Protocol("a slot piece without shared memory".into()))?;
        // The header that announced the slot was read after the sender wrote it.
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        if slot >= SLOTS || len > slots.slot_bytes {
            return Err(SyncError::Protocol(format!(
                "rank {} announced a piece outside its slots",
                self.peer
            )));
        }
        let at = slot as usize * slots.slot_bytes;
        // SAFETY: in bounds (checked above); the slice covers only this slot, which the sender
        // filled before announcing it and will not touch again until this side's credit.
        Ok(unsafe { std::slice::from_raw_parts(slots.map.as_ptr().add(at), len) })
    }

    fn credit(&mut self, slot: u32) -> Result<()> {
        let header = encode_header(Kind::Credit, slot, 0);
        self.stream.write_all(&header).map_err(|e| self.failed(e))
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
        peer_failed(self.peer, self.timeout, "sent nothing", e)
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

/// This machine's identity for the shared-memory offer: the kernel's boot id (two processes
/// with the same one share `/dev/shm`), unless `HORA_RING_SHM=0`.
fn host_id() -> Option<String> {
    if std::env::var("HORA_RING_SHM").is_ok_and(|v| v == "0") {
        return None;
    }
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .ok()
        .map(|id| id.trim().to_string())
        .filter(|id| !id.is_empty() && Path::new("/dev/shm").is_dir())
}

/// Creates and maps a slot ring for a same-host sender; the file is unlinked by the caller
/// once the sender has mapped it.
fn create_slots(
    session: &str,
    rank: u32,
    slot_bytes: usize,
) -> io::Result<(PathBuf, ReceiverSlots)> {
    let mut nonce = [0u8; 8];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut nonce)
        .map_err(|_| io::Error::other("no randomness"))?;
    let path = PathBuf::from(format!(
        "/dev/shm/hora-ring-{}-{rank}-{}",
        &session[..session.len().min(8)],
        hex::encode(nonce)
    ));
    let mut options = std::fs::OpenOptions::new();
    options.read(true).write(true).create_new(true);
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    let file = options.open(&path)?;
    let mapped = (|| {
        // Reserve the pages now: a sparse file on a full /dev/shm would fail later, on a write
        // into the mapping, with SIGBUS.
        let len = (slot_bytes * SLOTS as usize) as libc::off_t;
        // SAFETY: a plain system call on a file descriptor this function owns.
        let reserved =
            unsafe { libc::posix_fallocate(std::os::fd::AsRawFd::as_raw_fd(&file), 0, len) };
        if reserved != 0 {
            return Err(io::Error::from_raw_os_error(reserved));
        }
        // SAFETY: the file is new, private (0600, a random name, unlinked once the sender has
        // mapped it), and only its sender writes to it, into slots this side has handed over
        // by credit; this side reads a slot only between the header that announces it and the
        // credit that returns it.
        unsafe { memmap2::Mmap::map(&file) }
    })();
    match mapped {
        Ok(map) => Ok((path, ReceiverSlots { map, slot_bytes })),
        Err(e) => {
            let _ = std::fs::remove_file(&path);
            Err(e)
        }
    }
}

/// Maps the slot ring a same-host receiver offered.
fn attach_slots(path: &str, slot_bytes: usize) -> io::Result<SenderSlots> {
    // Only a ring file of the shape this code makes: a stray listener cannot point us at
    // another file.
    let name = path.strip_prefix("/dev/shm/hora-ring-").unwrap_or("");
    if name.is_empty() || name.contains('/') || name.contains("..") {
        return Err(io::Error::other(format!("{path} is not a Hora ring file")));
    }
    let total = slot_bytes
        .checked_mul(SLOTS as usize)
        .filter(|_| (64..=MAX_SLOT_BYTES).contains(&slot_bytes))
        .ok_or_else(|| io::Error::other(format!("slots of {slot_bytes} bytes")))?;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)?;
    if file.metadata()?.len() != total as u64 {
        return Err(io::Error::other(
            "the shared-memory file has the wrong size",
        ));
    }
    // SAFETY: see `create_slots`: this side writes a slot only while it holds it (before the
    // header that hands it over, after the credit that returns it).
    let map = unsafe { memmap2::MmapMut::map_mut(&file)? };
    Ok(SenderSlots {
        map,
        slot_bytes,
        free: (0..SLOTS).rev().collect(),
    })
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

    /// Connects to the right neighbour and accepts the left one, both within `timeout`. A
    /// same-host left neighbour is offered shared-memory slots of `slot_bytes` (`None`: TCP).
    pub fn connect(
        world: &World,
        listener: TcpListener,
        timeout: Duration,
        slot_bytes: Option<usize>,
    ) -> Result<Links> {
        if world.size < 2 {
            return Err(SyncError::Config(
                "a world of one has no ring to connect".into(),
            ));
        }
        let deadline = Instant::now() + timeout;
        let right = world.right();
        let address = world.peers[right as usize].clone();
        let host = host_id();
        let mut hello = hello_payload(world);
        if let Some(host) = &host {
            hello.extend_from_slice(format!(" shm={host}").as_bytes());
        }
        let offer = host
            .as_deref()
            .zip(slot_bytes.map(|b| b.clamp(64, MAX_SLOT_BYTES).div_ceil(64) * 64));
        let outbound = thread::scope(|s| {
            let out = s.spawn(|| connect_right(&address, right, &hello, deadline, timeout));
            let inbound = accept_left(world, &listener, deadline, timeout, offer);
            let outbound = out
                .join()
                .map_err(|_| SyncError::Config("the connecting thread panicked".into()))?;
            match (inbound, outbound) {
                // A refusal by the right neighbour (another session: other --peers, another
                // job) explains a left neighbour that never came better than the wait does.
                (Err(_), Err(refused @ SyncError::Protocol(_))) => Err(refused),
                (inbound, outbound) => Ok::<_, SyncError>((inbound?, outbound?)),
            }
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
                slots: None,
            };
            out.send(Kind::Hello, 0, hello)?;
            let mut back = Inbound {
                stream: out
                    .stream
                    .try_clone()
                    .map_err(|e| SyncError::io("cloning the ring socket", e))?,
                peer: rank,
                timeout,
                slots: None,
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
            let welcome = back.control_payload(h.len)?;
            if h.kind != Kind::Welcome {
                return Err(refused(format!("answered {:?}", h.kind)));
            }
            // "shm PATH SLOT_BYTES": a same-host offer of shared-memory slots.
            let welcome = String::from_utf8_lossy(&welcome).into_owned();
            let mut words = welcome.split_whitespace();
            if let (Some("shm"), Some(path), Some(bytes)) =
                (words.next(), words.next(), words.next())
            {
                match bytes
                    .parse()
                    .map_err(io::Error::other)
                    .and_then(|b| attach_slots(path, b))
                {
                    Ok(slots) => {
                        out.slots = Some(slots);
                        out.send(Kind::Attached, 0, b"yes")?;
                    }
                    Err(e) => {
                        tracing::debug!(
                            "shared memory with rank {rank} unavailable ({e}); using TCP"
                        );
                        out.send(Kind::Attached, 0, b"no")?;
                    }
                }
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
    offer: Option<(&str, usize)>,
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
                    slots: None,
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
                    slots: None,
                };
                let (hello, their_host) = match hello.windows(5).position(|w| w == b" shm=") {
                    Some(at) => (
                        hello[..at].to_vec(),
                        Some(String::from_utf8_lossy(&hello[at + 5..]).into_owned()),
                    ),
                    None => (hello, None),
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
                let same_host = offer.filter(|(host, _)| their_host.as_deref() == Some(*host));
                let created = same_host.and_then(|(_, slot_bytes)| {
                    create_slots(&world.session, world.rank, slot_bytes)
                        .map_err(|e| {
                            tracing::debug!("no shared memory for the ring ({e}); using TCP")
                        })
                        .ok()
                        .map(|(path, slots)| (path, slots, slot_bytes))
                });
                match created {
                    Some((path, slots, slot_bytes)) => {
                        let welcome = format!("shm {} {slot_bytes}", path.display());
                        let attached =
                            reply
                                .send(Kind::Welcome, 0, welcome.as_bytes())
                                .and_then(|()| {
                                    let h = inbound.header()?;
                                    let answer = inbound.control_payload(h.len)?;
                                    Ok(h.kind == Kind::Attached && answer == b"yes")
                                });
                        // Both sides have it mapped (or never will): the name can go.
                        let _ = std::fs::remove_file(&path);
                        if attached? {
                            inbound.slots = Some(slots);
                        }
                    }
                    None => reply.send(Kind::Welcome, 0, b"")?,
                }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_hora_ring_files_of_sane_size_are_attached() {
        for (path, bytes) in [
            ("/etc/passwd", 64),
            ("/dev/shm/hora-ring-../../etc/passwd", 64),
            ("/dev/shm/other", 64),
            ("/dev/shm/hora-ring-x", usize::MAX),
            ("/dev/shm/hora-ring-x", 0),
        ] {
            assert!(attach_slots(path, bytes).is_err(), "{path} {bytes}");
        }
    }

    #[test]
    fn abort_frames_name_the_failed_rank_once() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let timeout = Duration::from_secs(5);
        let sender = thread::spawn(move || {
            let stream = TcpStream::connect(addr).unwrap();
            let mut out = Outbound {
                stream,
                peer: 1,
                timeout,
                slots: None,
            };
            out.abort(Some(7), "closed its connection");
        });
        let (stream, _) = listener.accept().unwrap();
        let mut inbound = Inbound {
            stream,
            peer: 3,
            timeout,
            slots: None,
        };
        let e = inbound.header().unwrap_err().to_string();
        assert_eq!(
            e,
            "rank 7 closed its connection (reported around the ring by rank 3)"
        );
        sender.join().unwrap();
    }
}
