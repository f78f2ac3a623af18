//! The ring's connections: each worker sends to its right neighbour and receives from its left,
//! over one TCP connection each (for two workers, two connections between the same pair).
//!
//! Frames are a 16-byte header — kind, an auxiliary word, payload length — and the payload.
//! After the handshake every frame is sealed (AES-256-GCM, a key per connection and direction
//! derived from the session over the handshake's transcript, a counter nonce; see `sealed`):
//! its header and its payload are two records, each with its tag, so a frame that was altered,
//! dropped, replayed or injected on the way stops the ring with an error naming the rank it
//! came from, and nothing a worker sends can be read on the way.
//!
//! **Who gets in.** The ring port is open to anyone who can reach it, so a connection is a
//! stranger until it proves otherwise. The accepting side speaks first with a `Challenge` (the
//! protocol version and a fresh random nonce); the connecting side answers `Hello` with its own
//! nonce and a proof that it knows the world's session (an HMAC over both nonces, the version,
//! the generation, the world size and both ranks — see `handshake`); the accepting side checks it
//! and only then answers `Welcome` with its own proof, which the connecting side checks in turn.
//! So a worker of another job, generation or version is refused instead of corrupting a
//! reduction, and neither side sends anything secret, or derived from a secret other than the
//! proofs. A refused connection is told "not a member of this ring" and nothing else; the
//! refusing worker logs the details. Every accepted connection is challenged at once and has a
//! few seconds (never past the ring's deadline) to answer; only one whose answer has arrived and
//! starts as a hello should is given a thread to check it, and addresses whose connections stayed
//! silent, sent garbage or proved nothing are suspect for a backoff that doubles (see
//! `accept_left`): strangers cannot hold up the real neighbour, however many there are and
//! however often they reconnect.
//!
//! Failure is loud and fast. Reads and writes have a timeout (`--timeout`, 30 s by default); a
//! closed connection or a timeout is turned into an error naming the rank at the other end; and
//! the worker that notices first sends an `Abort` frame naming the failed rank to its right
//! neighbour, which forwards it, so every survivor stops and names the same rank. Payload lengths
//! are checked against what the receiver expects before anything is read into memory.
//!
//! **Shared memory between neighbours on one host.** When both ends run on the same machine
//! (same kernel boot id, exchanged only once both sides have proved themselves), the receiving
//! side offers a ring of slots in a shared-memory file (`/dev/shm`, mode 0600, unlinked as soon
//! as both have mapped it): the sender writes a piece straight into a free slot and sends only a
//! 16-byte header over TCP, and the receiver reduces straight out of the slot and hands it back
//! with a credit frame. One copy per byte instead of two through the kernel, and no payload
//! system calls — what NCCL and MPI do within a node. The sender maps only a regular file of
//! its own user with mode 0600, opened without following links. The TCP connection stays: it
//! carries the headers, credits, aborts and timeouts, so failure detection is the same either
//! way. `HORA_RING_SHM=0` turns it off. Pieces go in and out of slots with
//! [`kernel::copy`], whose speed does not depend on where the caller's buffer starts
//! (`HORA_RING_PLAIN_COPY=1` uses memcpy instead, for the benchmark's comparison). The slots' contents are not sealed: shared memory is
//! reachable only by this user on this host (a file of mode 0600 that is unlinked at once), who
//! can read and write both processes' memory anyway; the headers, credits and aborts that cross
//! the socket are sealed like every other frame.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::{Duration, Instant};

use hora_common::kernel;

use crate::handshake::{self, LinkTerms, Nonces, RingKey, Role, NONCE_LEN, PROOF_LEN};
use crate::rendezvous::World;
use crate::sealed::{Opener, SealError, Sealer, TAG_LEN};
use crate::{CollectiveError, Result};

/// Bumped whenever frames or the handshake change: workers of different versions refuse each
/// other. Version 2: the challenge-response handshake (version 1 sent the session in the clear);
/// version 3: frames sealed after the handshake.
const PROTOCOL_VERSION: u32 = 3;
/// The most one accepted connection is given to send its hello and prove itself (less when the
/// ring's deadline is nearer, or its address is suspect). A real neighbour needs milliseconds.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Handshakes in progress at once, each for a connection whose hello is in; another waits for
/// one of them to end (which takes microseconds: the proof is checked at once).
const MAX_HANDSHAKES: usize = 32;
/// How a worker is told to leave its frames unsealed, for error messages.
const UNSEALED_KNOB: &str = "--ring-unsealed (seal_frames=False in Python)";
/// All a refused connection is told.
pub(crate) const REFUSAL: &str = "not a member of this ring";
/// `Challenge`: version, the accepting side's nonce, whether it seals its frames.
const CHALLENGE_LEN: usize = 4 + NONCE_LEN + 1;
/// `Hello`: version, generation, world size, rank, whether it seals its frames, the connecting
/// side's nonce, its proof.
const HELLO_LEN: usize = 4 + 8 + 4 + 4 + 1 + NONCE_LEN + PROOF_LEN;
/// The longest host id (a boot id is 36 characters) or shared-memory offer.
const MAX_HOST_FRAME: usize = 512;
const HEADER_LEN: usize = 16;
/// The most a header record takes: the header, then its tag (none when unsealed).
const HEADER_RECORD: usize = HEADER_LEN + TAG_LEN;
const MAGIC: u8 = 0xA7;
/// The largest control payload (hello, op header, abort) accepted.
pub(crate) const MAX_CONTROL: u64 = 64 << 10;
/// Kernel socket buffers: a few pipelined sub-chunks in flight each way.
const SOCKET_BUFFER: usize = 8 << 20;

/// What a frame carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// The connecting side's answer to a challenge, with its proof of membership.
    Hello = 1,
    /// The accepting side's proof of membership.
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
    /// The accepting side's opening: the protocol version and a fresh nonce.
    Challenge = 10,
    /// After the proofs, the connecting side's host id (empty: no shared memory).
    Host = 11,
    /// The accepting side's answer to `Host`: `shm PATH SLOT_BYTES`, or empty for TCP only.
    Offer = 12,
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
            10 => Kind::Challenge,
            11 => Kind::Host,
            12 => Kind::Offer,
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

/// A header's fields, if it is one of ours.
fn decode_header(h: &[u8]) -> Option<Header> {
    let kind = Kind::from_u8(*h.get(1)?).filter(|_| h[0] == MAGIC)?;
    Some(Header {
        kind,
        aux: u32::from_le_bytes(h.get(4..8)?.try_into().ok()?),
        len: u64::from_le_bytes(h.get(8..16)?.try_into().ok()?),
    })
}

/// Bytes a frame with a stream payload of `len` bytes takes with tags of `tag` bytes: its
/// header record, then (unless the payload is empty) the payload record.
fn framed_len(len: usize, tag: usize) -> usize {
    HEADER_LEN + tag + if len == 0 { 0 } else { len + tag }
}

/// Seals a header announcing `kind`, `aux` and `len` into `record` (`HEADER_LEN` bytes and a
/// tag's).
fn seal_header(
    sealer: &mut Sealer,
    kind: Kind,
    aux: u32,
    len: usize,
    record: &mut [u8],
) -> Result<(), SealError> {
    let (header, tag) = record.split_at_mut(HEADER_LEN);
    header.copy_from_slice(&encode_header(kind, aux, len as u64));
    sealer.seal(header, tag)
}

/// Seals a frame laid out in `frame` (`framed_len(len, tag)` bytes, its payload of `len` bytes
/// already after the header record).
fn seal_frame(
    sealer: &mut Sealer,
    kind: Kind,
    aux: u32,
    len: usize,
    frame: &mut [u8],
) -> Result<(), SealError> {
    let (record, rest) = frame.split_at_mut(HEADER_LEN + sealer.tag_len());
    seal_header(sealer, kind, aux, len, record)?;
    if len > 0 {
        let (body, tag) = rest.split_at_mut(len);
        sealer.seal(body, tag)?;
    }
    Ok(())
}

/// What a record that does not open says about the rank it came from (or, sealing, what
/// 2^64 records on one connection mean).
fn unsealed(peer: u32, e: SealError) -> CollectiveError {
    match e {
        SealError::Forged => CollectiveError::PeerFailed {
            rank: peer,
            what: "sent a frame that failed authentication: the connection from it was tampered \
                   with on the way (bytes altered, dropped, replayed or injected), so this worker \
                   stopped trusting it. Check the network between the workers, then restart the \
                   job"
            .into(),
        },
        SealError::Exhausted => CollectiveError::Protocol(format!(
            "the connection with rank {peer} carried 2^64 frames, the most one key may seal; \
             restart the job to form a new ring"
        )),
    }
}

/// How a relayed failure is marked: "(reported around the ring by rank N)".
const RELAYED: &str = "reported around the ring by rank";

/// What a failed read or write on a neighbour's connection says about the neighbour.
fn peer_failed(peer: u32, timeout: Duration, silent: &str, e: io::Error) -> CollectiveError {
    let what = match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => format!(
            "{silent} for {} s: it stalled or died (raise --timeout if a step can legitimately take longer)",
            timeout.as_secs()
        ),
        _ => format!("closed its connection ({e}): the process exited or crashed"),
    };
    CollectiveError::PeerFailed { rank: peer, what }
}

/// The sending end (to the right neighbour).
pub struct Outbound {
    stream: TcpStream,
    /// The neighbour's rank, for error messages.
    pub peer: u32,
    timeout: Duration,
    slots: Option<SenderSlots>,
    /// Seals what this side sends.
    seal: Sealer,
    /// Opens the slot credits that come back.
    open: Opener,
}

/// The receiving end (from the left neighbour).
pub struct Inbound {
    stream: TcpStream,
    pub peer: u32,
    timeout: Duration,
    slots: Option<ReceiverSlots>,
    /// Opens what the left neighbour sends.
    open: Opener,
    /// Seals the slot credits sent back.
    seal: Sealer,
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
    /// Writes one frame, sealed: header, then payload.
    pub fn send(&mut self, kind: Kind, aux: u32, payload: &[u8]) -> Result<()> {
        let at = HEADER_LEN + self.seal.tag_len();
        let mut frame = vec![0u8; framed_len(payload.len(), self.seal.tag_len())];
        frame[at..at + payload.len()].copy_from_slice(payload);
        seal_frame(&mut self.seal, kind, aux, payload.len(), &mut frame)
            .map_err(|e| unsealed(self.peer, e))?;
        self.stream.write_all(&frame).map_err(|e| self.failed(e))
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
                .ok_or_else(|| CollectiveError::Config("no slots".into()))?;
            let at = slot as usize * slots.slot_bytes;
            // SAFETY: `at + len` lies within the mapping (len <= slot_bytes, slot < SLOTS); the
            // slice covers only this slot, which this side holds until it announces it, so
            // nothing else reads or writes these bytes meanwhile (see `create_slots`).
            let dst =
                unsafe { std::slice::from_raw_parts_mut(slots.map.as_mut_ptr().add(at), len) };
            match direct {
                Some(bytes) => kernel::copy(dst, bytes, plain_copy()),
                None => fill(dst)?,
            }
            // The slot's bytes are written before the header that announces them.
            std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
            let record = &mut [0u8; HEADER_RECORD][..HEADER_LEN + self.seal.tag_len()];
            seal_header(&mut self.seal, Kind::SlotData, slot, len, record)
                .map_err(|e| unsealed(self.peer, e))?;
            return self.stream.write_all(record).map_err(|e| self.failed(e));
        }
        let tag = self.seal.tag_len();
        if let (0, Some(bytes)) = (tag, direct) {
            // Unsealed, a piece in host memory goes as it is: no copy.
            let header = encode_header(Kind::Data, 0, len as u64);
            return self
                .stream
                .write_all(&header)
                .and_then(|()| self.stream.write_all(bytes))
                .map_err(|e| self.failed(e));
        }
        // The frame is laid out in `scratch` (sealing is in place), then written at once.
        let total = framed_len(len, tag);
        scratch.resize(total.div_ceil(4), 0);
        let frame = &mut bytemuck::cast_slice_mut::<u32, u8>(scratch)[..total];
        let body = &mut frame[HEADER_LEN + tag..HEADER_LEN + tag + len];
        match direct {
            Some(bytes) => body.copy_from_slice(bytes),
            None => fill(body)?,
        }
        seal_frame(&mut self.seal, Kind::Data, 0, len, frame)
            .map_err(|e| unsealed(self.peer, e))?;
        self.stream.write_all(frame).map_err(|e| self.failed(e))
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
        let record = &mut [0u8; HEADER_RECORD][..HEADER_LEN + self.open.tag_len()];
        self.stream.read_exact(record).map_err(|e| self.failed(e))?;
        let (h, tag) = record.split_at_mut(HEADER_LEN);
        self.open.open(h, tag).map_err(|e| unsealed(self.peer, e))?;
        let slot = match decode_header(h) {
            Some(Header {
                kind: Kind::Credit,
                aux,
                ..
            }) => aux,
            _ => {
                return Err(CollectiveError::Protocol(format!(
                    "rank {} sent something other than a slot credit back",
                    self.peer
                )))
            }
        };
        if slot >= SLOTS {
            return Err(CollectiveError::Protocol(format!(
                "rank {} returned slot {slot} of {SLOTS}",
                self.peer
            )));
        }
        Ok(slot)
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

    fn failed(&self, e: io::Error) -> CollectiveError {
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
        let record = &mut [0u8; HEADER_RECORD][..HEADER_LEN + self.open.tag_len()];
        self.stream.read_exact(record).map_err(|e| self.failed(e))?;
        let (h, tag) = record.split_at_mut(HEADER_LEN);
        self.open.open(h, tag).map_err(|e| unsealed(self.peer, e))?;
        decode_header(h).ok_or_else(|| {
            CollectiveError::Protocol(format!(
                "rank {} sent a malformed frame header (is it running the same Hora version?)",
                self.peer
            ))
        })
    }

    /// The failure an `Abort` frame with `len` payload bytes reports.
    fn abort_error(&mut self, len: u64) -> Result<CollectiveError> {
        let payload = self.control_payload(len)?;
        let (rank, message) = payload.split_at(4.min(payload.len()));
        let rank = <[u8; 4]>::try_from(rank).map(u32::from_le_bytes).ok();
        let message = String::from_utf8_lossy(message).into_owned();
        Ok(match rank {
            // The first rank to forward it says so; the others pass it on as it is.
            Some(rank) if rank != u32::MAX => CollectiveError::PeerFailed {
                rank,
                what: if message.contains(RELAYED) {
                    message
                } else {
                    format!("{message} ({RELAYED} {})", self.peer)
                },
            },
            _ => CollectiveError::Mismatch(message),
        })
    }

    /// An abort frame that arrives within `wait`, as the error it reports (used after our right
    /// neighbour hung up, to learn whether it did so because of a failure elsewhere).
    pub fn pending_abort(&mut self, wait: Duration) -> Option<CollectiveError> {
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
            return Err(CollectiveError::Protocol(format!(
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
                kernel::copy(dst, self.slot(slot, dst.len())?, plain_copy());
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
                // The payload and its tag in one read.
                let total = len + if len == 0 { 0 } else { self.open.tag_len() };
                scratch.resize(total.div_ceil(4), 0);
                let buf = &mut bytemuck::cast_slice_mut::<u32, u8>(scratch)[..total];
                if len > 0 {
                    self.stream.read_exact(buf).map_err(|e| self.failed(e))?;
                    let (body, tag) = buf.split_at_mut(len);
                    self.open
                        .open(body, tag)
                        .map_err(|e| unsealed(self.peer, e))?;
                }
                f(&buf[..len])
            }
            Incoming::Slot(slot) => {
                let result = f(self.slot(slot, len)?);
                self.credit(slot)?;
                result
            }
        }
    }

    fn slot(&self, slot: u32, len: usize) -> Result<&[u8]> {
        let slots = self.slots.as_ref().ok_or_else(|| {
            CollectiveError::Protocol("a slot piece without shared memory".into())
        })?;
        // The header that announced the slot was read after the sender wrote it.
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        if slot >= SLOTS || len > slots.slot_bytes {
            return Err(CollectiveError::Protocol(format!(
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
        let record = &mut [0u8; HEADER_RECORD][..HEADER_LEN + self.seal.tag_len()];
        seal_header(&mut self.seal, Kind::Credit, slot, 0, record)
            .map_err(|e| unsealed(self.peer, e))?;
        self.stream.write_all(record).map_err(|e| self.failed(e))
    }

    /// Reads and opens a payload whose length the header gave (already checked by the caller).
    pub fn payload(&mut self, buf: &mut [u8]) -> Result<()> {
        if buf.is_empty() {
            return Ok(());
        }
        let tag = &mut [0u8; TAG_LEN][..self.open.tag_len()];
        self.stream
            .read_exact(buf)
            .and_then(|()| self.stream.read_exact(tag))
            .map_err(|e| self.failed(e))?;
        self.open.open(buf, tag).map_err(|e| unsealed(self.peer, e))
    }

    /// Reads a small payload, refusing anything over the control limit before allocating.
    pub fn control_payload(&mut self, len: u64) -> Result<Vec<u8>> {
        if len > MAX_CONTROL {
            return Err(CollectiveError::Protocol(format!(
                "rank {} sent a control frame of {len} bytes (limit {MAX_CONTROL})",
                self.peer
            )));
        }
        let mut buf = vec![0u8; len as usize];
        self.payload(&mut buf)?;
        Ok(buf)
    }

    fn failed(&self, e: io::Error) -> CollectiveError {
        peer_failed(self.peer, self.timeout, "sent nothing", e)
    }
}

/// How a worker's links are made.
#[derive(Debug, Clone, Copy)]
pub struct LinkOptions {
    /// The ring's deadline to connect, and its read and write timeout afterwards.
    pub timeout: Duration,
    /// Shared-memory slots of this many bytes offered to a same-host left neighbour (`None`:
    /// TCP only).
    pub slot_bytes: Option<usize>,
    /// Seal every frame after the handshake (see `sealed`); every worker of a world must agree.
    pub seal_frames: bool,
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

/// Whether pieces are copied in and out of slots with plain memcpy (`HORA_RING_PLAIN_COPY=1`:
/// what `benches/allreduce.rs` compares [`kernel::copy`] with).
fn plain_copy() -> bool {
    static PLAIN: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *PLAIN.get_or_init(|| std::env::var("HORA_RING_PLAIN_COPY").is_ok_and(|v| v == "1"))
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
/// once the sender has mapped it. Its name says nothing about the world (this process, the
/// rank, a random part): anyone on the host can list `/dev/shm`.
fn create_slots(rank: u32, slot_bytes: usize) -> io::Result<(PathBuf, ReceiverSlots)> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};

    let mut nonce = [0u8; 8];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut nonce)
        .map_err(|_| io::Error::other("no randomness"))?;
    let path = PathBuf::from(format!(
        "/dev/shm/hora-ring-{}-{rank}-{}",
        std::process::id(),
        hex::encode(nonce)
    ));
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&path)?;
    let mapped = (|| {
        // The umask may have taken bits away; the sender maps nothing but mode 0600.
        file.set_permissions(std::fs::Permissions::from_mode(0o600))?;
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
    // SAFETY: geteuid has no preconditions and cannot fail.
    let user = unsafe { libc::geteuid() };
    attach_slots_of(path, slot_bytes, user)
}

/// [`attach_slots`], for a ring file that must belong to `owner`.
fn attach_slots_of(path: &str, slot_bytes: usize, owner: u32) -> io::Result<SenderSlots> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};

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
    // Not through a symbolic link (another user's, pointing at one of our files).
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)?;
    // Checked on the open file (fstat), not the name: what is checked is what is mapped. Only
    // our own private file: another user's could be read or rewritten by that user meanwhile.
    let meta = file.metadata()?;
    if !meta.file_type().is_file() {
        return Err(io::Error::other(format!("{path} is not a regular file")));
    }
    if meta.uid() != owner {
        return Err(io::Error::other(format!(
            "{path} belongs to user {}, not to this worker's user {owner}",
            meta.uid()
        )));
    }
    if meta.mode() & 0o7777 != 0o600 {
        return Err(io::Error::other(format!(
            "{path} has mode {:o}, not 600",
            meta.mode() & 0o7777
        )));
    }
    if meta.len() != total as u64 {
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
            CollectiveError::io(
                format!("listening for the ring on {address} (choose another with --ring-listen)"),
                e,
            )
        })
    }

    /// Connects to the right neighbour and accepts the left one, both within `options.timeout`,
    /// each proving to the other that it is a member of `world`.
    pub fn connect(world: &World, listener: TcpListener, options: &LinkOptions) -> Result<Links> {
        let LinkOptions {
            timeout,
            slot_bytes,
            seal_frames,
        } = *options;
        if world.size < 2 {
            return Err(CollectiveError::Config(
                "a world of one has no ring to connect".into(),
            ));
        }
        let deadline = Instant::now() + timeout;
        let key = RingKey::derive(&world.session);
        let host = host_id();
        let terms = |from, to| LinkTerms {
            version: PROTOCOL_VERSION,
            generation: world.generation,
            size: world.size,
            from,
            to,
            sealed: seal_frames,
        };
        let right = world.right();
        let connector = Connector {
            address: &world.peers[right as usize],
            rank: right,
            terms: terms(world.rank, right),
            key: &key,
            host: host.as_deref(),
            timeout,
            deadline,
        };
        let gate = Gate {
            key: key.clone(),
            terms: terms(world.left(), world.rank),
            timeout,
            offer: host
                .clone()
                .zip(slot_bytes.map(|b| b.clamp(64, MAX_SLOT_BYTES).div_ceil(64) * 64)),
        };
        let own_address = &world.peers[world.rank as usize];
        let (inbound, outbound) = thread::scope(|s| {
            let out = s.spawn(|| connector.connect());
            let inbound = accept_left(gate, &listener, deadline, own_address);
            let outbound = out
                .join()
                .map_err(|_| CollectiveError::Config("the connecting thread panicked".into()))?;
            match (inbound, outbound) {
                // A refusal by the right neighbour (another session: other --peers, another
                // job) explains a left neighbour that never came better than the wait does.
                (Err(_), Err(refused @ CollectiveError::Protocol(_))) => Err(refused),
                (inbound, outbound) => Ok::<_, CollectiveError>((inbound?, outbound?)),
            }
        })?;
        Ok(Links { inbound, outbound })
    }
}

fn resolve(address: &str) -> Result<Vec<SocketAddr>> {
    address
        .to_socket_addrs()
        .map(|a| a.collect())
        .map_err(|e| CollectiveError::io(format!("resolving the ring address {address}"), e))
}

/// Reads exactly `buf.len()` bytes by `deadline`, however slowly the other side sends them.
fn read_by(stream: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> io::Result<()> {
    let mut filled = 0;
    while filled < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        stream.set_read_timeout(Some(left))?;
        match stream.read(&mut buf[filled..]) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Reads one handshake frame by `deadline`: its kind and a payload of at most `max` bytes (a
/// malformed or longer frame is `InvalidData`, refused before anything is allocated).
fn read_frame_by(
    stream: &mut TcpStream,
    max: usize,
    deadline: Instant,
) -> io::Result<(Kind, Vec<u8>)> {
    let mut h = [0u8; HEADER_LEN];
    read_by(stream, &mut h, deadline)?;
    let kind = Kind::from_u8(h[1])
        .filter(|_| h[0] == MAGIC)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "not a Hora ring frame"))?;
    let len = u64::from_le_bytes([h[8], h[9], h[10], h[11], h[12], h[13], h[14], h[15]]);
    if len > max as u64 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a {kind:?} frame of {len} bytes"),
        ));
    }
    let mut payload = vec![0u8; len as usize];
    read_by(stream, &mut payload, deadline)?;
    Ok((kind, payload))
}

/// Writes one frame by `deadline`.
fn write_frame_by(
    stream: &mut TcpStream,
    kind: Kind,
    payload: &[u8],
    deadline: Instant,
) -> io::Result<()> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(io::ErrorKind::TimedOut.into());
    }
    stream.set_write_timeout(Some(left))?;
    let mut frame = encode_header(kind, 0, payload.len() as u64).to_vec();
    frame.extend_from_slice(payload);
    stream.write_all(&frame)
}

/// Writes one sealed frame by `deadline` (the handshake's last frames, once both sides proved
/// themselves).
fn write_sealed_by(
    stream: &mut TcpStream,
    sealer: &mut Sealer,
    kind: Kind,
    payload: &[u8],
    deadline: Instant,
) -> io::Result<()> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(io::ErrorKind::TimedOut.into());
    }
    stream.set_write_timeout(Some(left))?;
    let at = HEADER_LEN + sealer.tag_len();
    let mut frame = vec![0u8; framed_len(payload.len(), sealer.tag_len())];
    frame[at..at + payload.len()].copy_from_slice(payload);
    seal_frame(sealer, kind, 0, payload.len(), &mut frame)
        .map_err(|_| io::Error::other("no more frames may be sealed on this connection"))?;
    stream.write_all(&frame)
}

/// Reads one sealed frame by `deadline`: its kind and a payload of at most `max` bytes. One
/// that does not open, or is longer, is `InvalidData`.
fn read_sealed_by(
    stream: &mut TcpStream,
    opener: &mut Opener,
    max: usize,
    deadline: Instant,
) -> io::Result<(Kind, Vec<u8>)> {
    let forged = || {
        io::Error::new(
            io::ErrorKind::InvalidData,
            "a frame that failed authentication",
        )
    };
    let record = &mut [0u8; HEADER_RECORD][..HEADER_LEN + opener.tag_len()];
    read_by(stream, record, deadline)?;
    let (h, tag) = record.split_at_mut(HEADER_LEN);
    opener.open(h, tag).map_err(|_| forged())?;
    let header = decode_header(h)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "not a Hora ring frame"))?;
    if header.len > max as u64 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a {:?} frame of {} bytes", header.kind, header.len),
        ));
    }
    let len = header.len as usize;
    let mut payload = vec![0u8; len + if len == 0 { 0 } else { opener.tag_len() }];
    if len > 0 {
        read_by(stream, &mut payload, deadline)?;
        let (body, tag) = payload.split_at_mut(len);
        opener.open(body, tag).map_err(|_| forged())?;
        payload.truncate(len);
    }
    Ok((header.kind, payload))
}

/// The text of an `Abort` frame's payload (after the rank).
fn abort_text(payload: &[u8]) -> String {
    String::from_utf8_lossy(payload.get(4..).unwrap_or_default()).into_owned()
}

/// The connecting side's answer to a challenge.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Hello {
    version: u32,
    generation: u64,
    size: u32,
    rank: u32,
    sealed: bool,
    nonce: [u8; NONCE_LEN],
    proof: [u8; PROOF_LEN],
}

impl Hello {
    fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(HELLO_LEN);
        b.extend_from_slice(&self.version.to_le_bytes());
        b.extend_from_slice(&self.generation.to_le_bytes());
        b.extend_from_slice(&self.size.to_le_bytes());
        b.extend_from_slice(&self.rank.to_le_bytes());
        b.push(u8::from(self.sealed));
        b.extend_from_slice(&self.nonce);
        b.extend_from_slice(&self.proof);
        b
    }

    fn decode(b: &[u8]) -> Option<Hello> {
        if b.len() != HELLO_LEN {
            return None;
        }
        let (version, rest) = b.split_at(4);
        let (generation, rest) = rest.split_at(8);
        let (size, rest) = rest.split_at(4);
        let (rank, rest) = rest.split_at(4);
        let (sealed, rest) = rest.split_at(1);
        let (nonce, proof) = rest.split_at(NONCE_LEN);
        Some(Hello {
            version: u32::from_le_bytes(version.try_into().ok()?),
            generation: u64::from_le_bytes(generation.try_into().ok()?),
            size: u32::from_le_bytes(size.try_into().ok()?),
            rank: u32::from_le_bytes(rank.try_into().ok()?),
            sealed: match sealed[0] {
                0 => false,
                1 => true,
                _ => return None,
            },
            nonce: nonce.try_into().ok()?,
            proof: proof.try_into().ok()?,
        })
    }
}

/// The connecting side of the handshake: this worker, to its right neighbour.
struct Connector<'a> {
    address: &'a str,
    /// The right neighbour's rank.
    rank: u32,
    terms: LinkTerms,
    key: &'a RingKey,
    /// This host's id, offered once both sides have proved themselves.
    host: Option<&'a str>,
    timeout: Duration,
    deadline: Instant,
}

/// How a connection attempt that did not end in a link ended.
enum Attempt {
    /// The connection closed before the handshake was done (the neighbour was busy with
    /// strangers, or gave up on a slow handshake): worth another try.
    Closed(String),
    Failed(CollectiveError),
}

impl Connector<'_> {
    /// Connects, retrying until the deadline while nobody listens or the connection closes
    /// mid-handshake; a refusal or a failed proof ends it at once.
    fn connect(&self) -> Result<Outbound> {
        let (rank, address) = (self.rank, self.address);
        let addrs = resolve(address)?;
        let mut delay = Duration::from_millis(20);
        let mut closed = None;
        loop {
            let attempt = addrs.iter().find_map(|a| {
                TcpStream::connect_timeout(a, Duration::from_secs(5).min(self.timeout)).ok()
            });
            if let Some(stream) = attempt {
                match self.handshake(stream) {
                    Ok(out) => return Ok(out),
                    Err(Attempt::Failed(e)) => return Err(e),
                    Err(Attempt::Closed(why)) => {
                        tracing::debug!(rank, "{why}; trying again");
                        closed = Some(why);
                    }
                }
            }
            if Instant::now() + delay > self.deadline {
                let what = match closed {
                    Some(why) => format!(
                        "did not complete the handshake at {address} within {} s ({why})",
                        self.timeout.as_secs()
                    ),
                    None => format!(
                        "could not be reached at {address} within {} s: it did not start, or the address is wrong",
                        self.timeout.as_secs()
                    ),
                };
                return Err(CollectiveError::PeerFailed { rank, what });
            }
            thread::sleep(delay);
            delay = (delay * 2).min(Duration::from_millis(500));
        }
    }

    /// Challenge, hello, welcome — then, proved both ways, the shared-memory offer.
    fn handshake(&self, mut stream: TcpStream) -> Result<Outbound, Attempt> {
        let (rank, address, deadline) = (self.rank, self.address, self.deadline);
        tune(&stream, self.timeout)
            .map_err(|e| Attempt::Failed(CollectiveError::io("tuning the ring socket", e)))?;
        let io_failed = |e: io::Error| match e.kind() {
            io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => {
                Attempt::Failed(CollectiveError::PeerFailed {
                    rank,
                    what: format!(
                        "did not answer the handshake at {address} within {} s: it stalled, or \
                         something other than a Hora worker listens there",
                        self.timeout.as_secs()
                    ),
                })
            }
            io::ErrorKind::InvalidData => Attempt::Failed(CollectiveError::Protocol(format!(
                "the process at {address}, where rank {rank} should be, sent {e}: is it a Hora \
                 worker of this version?"
            ))),
            _ => Attempt::Closed(format!(
                "the connection to rank {rank} at {address} closed during the handshake ({e})"
            )),
        };
        let refused = |payload: &[u8]| {
            Attempt::Failed(CollectiveError::Protocol(format!(
                "rank {rank} at {address} refused this worker: {} (every worker needs the same \
                 world: the same server job and generation, or the same --peers list and \
                 session secret)",
                abort_text(payload)
            )))
        };
        let unexpected = |kind: Kind, what: &str| {
            Attempt::Failed(CollectiveError::Protocol(format!(
                "the process at {address}, where rank {rank} should be, sent a {kind:?} frame \
                 where {what} was due: is it a Hora worker of this version?"
            )))
        };

        let (kind, challenge) =
            read_frame_by(&mut stream, MAX_HOST_FRAME, deadline).map_err(io_failed)?;
        match kind {
            Kind::Challenge if challenge.len() >= 4 => {}
            Kind::Abort => return Err(refused(&challenge)),
            kind => return Err(unexpected(kind, "a challenge")),
        }
        // The version first: another version's challenge may have another length.
        let (version, rest) = challenge.split_at(4);
        let version = u32::from_le_bytes(version.try_into().unwrap_or_default());
        if version != PROTOCOL_VERSION {
            return Err(Attempt::Failed(CollectiveError::Protocol(format!(
                "rank {rank} at {address} speaks ring protocol {version}, this worker \
                 {PROTOCOL_VERSION}: run the same Hora version on every worker"
            ))));
        }
        if challenge.len() != CHALLENGE_LEN {
            return Err(unexpected(Kind::Challenge, "a challenge of another length"));
        }
        let (their_nonce, their_sealed) = rest.split_at(NONCE_LEN);
        if their_sealed != [u8::from(self.terms.sealed)] {
            return Err(Attempt::Failed(CollectiveError::Protocol(format!(
                "rank {rank} at {address} {} its ring frames and this worker {}: give every \
                 worker the same setting (sealing is on unless a worker is started with \
                 {UNSEALED_KNOB})",
                if self.terms.sealed {
                    "does not seal"
                } else {
                    "seals"
                },
                if self.terms.sealed {
                    "does"
                } else {
                    "does not"
                },
            ))));
        }
        let nonces = Nonces {
            acceptor: their_nonce.try_into().unwrap_or_default(),
            connector: handshake::nonce().map_err(Attempt::Failed)?,
        };
        let hello = Hello {
            version: PROTOCOL_VERSION,
            generation: self.terms.generation,
            size: self.terms.size,
            rank: self.terms.from,
            sealed: self.terms.sealed,
            nonce: nonces.connector,
            proof: self.key.prove(Role::Connector, &self.terms, &nonces),
        };
        write_frame_by(&mut stream, Kind::Hello, &hello.encode(), deadline).map_err(io_failed)?;
        let (kind, welcome) =
            read_frame_by(&mut stream, MAX_HOST_FRAME, deadline).map_err(io_failed)?;
        match kind {
            Kind::Welcome => {}
            Kind::Abort => return Err(refused(&welcome)),
            kind => return Err(unexpected(kind, "a welcome")),
        }
        if !self
            .key
            .verify(Role::Acceptor, &self.terms, &nonces, &welcome)
        {
            return Err(Attempt::Failed(CollectiveError::Protocol(format!(
                "the process at {address}, where rank {rank} should be, could not prove that it \
                 belongs to this ring: a stranger, or a worker of another job or generation"
            ))));
        }

        // Proved both ways: from here on every frame is sealed, and the host id and the offer
        // are for a member only.
        let (mut seal, mut open) = if self.terms.sealed {
            let keys = self.key.frame_keys(&self.terms, &nonces);
            (
                Sealer::new(keys.to_acceptor),
                Opener::new(keys.to_connector),
            )
        } else {
            (Sealer::plain(), Opener::plain())
        };
        let host = self.host.unwrap_or_default();
        write_sealed_by(
            &mut stream,
            &mut seal,
            Kind::Host,
            host.as_bytes(),
            deadline,
        )
        .map_err(io_failed)?;
        let (kind, offer) =
            read_sealed_by(&mut stream, &mut open, MAX_HOST_FRAME, deadline).map_err(io_failed)?;
        if kind != Kind::Offer {
            return Err(unexpected(kind, "an offer"));
        }
        let mut slots = None;
        // "shm PATH SLOT_BYTES": a same-host offer of shared-memory slots.
        let offer = String::from_utf8_lossy(&offer).into_owned();
        let mut words = offer.split_whitespace();
        if let (Some("shm"), Some(path), Some(bytes)) = (words.next(), words.next(), words.next()) {
            let answer = match bytes
                .parse()
                .map_err(io::Error::other)
                .and_then(|b| attach_slots(path, b))
            {
                Ok(mapped) => {
                    slots = Some(mapped);
                    b"yes".as_slice()
                }
                Err(e) => {
                    tracing::debug!("shared memory with rank {rank} unavailable ({e}); using TCP");
                    b"no".as_slice()
                }
            };
            write_sealed_by(&mut stream, &mut seal, Kind::Attached, answer, deadline)
                .map_err(io_failed)?;
        }
        tune(&stream, self.timeout)
            .map_err(|e| Attempt::Failed(CollectiveError::io("tuning the ring socket", e)))?;
        Ok(Outbound {
            stream,
            peer: rank,
            timeout: self.timeout,
            slots,
            seal,
            open,
        })
    }
}

/// What the accepting side checks each connection against; shared with the handshake threads.
struct Gate {
    key: RingKey,
    /// `from` is the left neighbour's rank, `to` this worker's.
    terms: LinkTerms,
    /// The ring's read and write timeout, for the admitted connection.
    timeout: Duration,
    /// This host's id and the slot size offered to a same-host neighbour.
    offer: Option<(String, usize)>,
}

/// Why a connection was not admitted: logged by this worker, never sent. (The silent, and
/// those that send what is not a hello, are closed by the accept loop before any handshake.)
enum Refused {
    /// It spoke the protocol and proved nothing: another job, generation, version or secret.
    Unproven(String),
    /// It proved itself, and then its handshake failed.
    Failed(String),
}

/// Counts a handshake in progress for as long as it lives.
struct Running(Arc<AtomicUsize>);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Connections waiting to show their first bytes, at most; past it the oldest (of a suspect
/// address first) is closed to make room.
const MAX_PENDING: usize = 256;
/// How long a connection from a suspect address is given to send its hello (others are given
/// [`HANDSHAKE_TIMEOUT`]). A real neighbour needs milliseconds.
const SUSPECT_SILENCE: Duration = Duration::from_secs(1);
/// The first backoff of an address whose connection failed; it doubles with each failure.
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// Addresses remembered at most.
const MAX_SUSPECTS: usize = 4096;

/// Addresses whose connections stayed silent, sent what is not a hello, or did not prove
/// themselves: each is suspect for a backoff that doubles with every failure. A suspect's
/// connections are still accepted (a real neighbour may share its address: a NAT, a host
/// running several workers), but they get [`SUSPECT_SILENCE`] to speak and are the first closed
/// when the pending connections are at their limit.
#[derive(Default)]
struct Backoff {
    /// Failures in a row and until when the address is suspect.
    addresses: std::collections::HashMap<std::net::IpAddr, (u32, Instant)>,
}

impl Backoff {
    fn strike(&mut self, ip: std::net::IpAddr, now: Instant) {
        if self.addresses.len() >= MAX_SUSPECTS {
            self.addresses.retain(|_, (_, until)| *until > now);
            if self.addresses.len() >= MAX_SUSPECTS {
                return;
            }
        }
        let (strikes, until) = self.addresses.entry(ip).or_insert((0, now));
        // A failure long after the last backoff ended starts over.
        if now > *until + MAX_BACKOFF {
            *strikes = 0;
        }
        let backoff = FIRST_BACKOFF
            .saturating_mul(1 << (*strikes).min(16))
            .min(MAX_BACKOFF);
        *strikes = strikes.saturating_add(1);
        *until = now + backoff;
    }

    fn suspect(&self, ip: std::net::IpAddr, now: Instant) -> bool {
        self.addresses
            .get(&ip)
            .is_some_and(|&(_, until)| until > now)
    }
}

/// An accepted connection that has been challenged and has not yet sent a whole hello.
struct Pending {
    stream: TcpStream,
    from: SocketAddr,
    /// The nonce of the challenge it was sent.
    nonce: [u8; NONCE_LEN],
    accepted: Instant,
    /// When it must have sent its hello.
    speak_by: Instant,
    suspect: bool,
    /// Its hello is in; it waits for a handshake thread.
    ready: bool,
    /// What it has sent so far (the first `got` bytes), taken off the socket: bytes left unread
    /// would wake `poll(2)` again at once, and the accept loop would spin until `speak_by`.
    first: [u8; HEADER_LEN + HELLO_LEN],
    got: usize,
}

/// What a pending connection has sent so far.
#[derive(Clone, Copy)]
enum FirstBytes {
    /// A whole hello's worth, under a hello's header: worth a handshake.
    Hello,
    /// Nothing yet, or the start of a hello.
    Waiting,
    /// A hello's header with another length: a worker of another Hora version.
    OtherVersion,
    /// Something that is not a hello, or it hung up.
    Wrong(&'static str),
}

impl Pending {
    /// Takes what has arrived (up to a hello's worth) and judges all it has sent so far.
    fn first_bytes(&mut self) -> FirstBytes {
        let expected = encode_header(Kind::Hello, 0, HELLO_LEN as u64);
        while self.got < self.first.len() {
            match (&self.stream).read(&mut self.first[self.got..]) {
                Ok(0) => return FirstBytes::Wrong("it hung up before its hello"),
                Ok(n) => self.got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(_) => return FirstBytes::Wrong("its connection failed"),
            }
        }
        let (n, got) = (self.got, &self.first);
        if n >= HEADER_LEN && got[..8] == expected[..8] && got[8..16] != expected[8..16] {
            FirstBytes::OtherVersion
        } else if got[..n.min(HEADER_LEN)] != expected[..n.min(HEADER_LEN)] {
            FirstBytes::Wrong("it sent what is not a hello")
        } else if n == got.len() {
            FirstBytes::Hello
        } else {
            FirstBytes::Waiting
        }
    }

    /// The body of its hello, once [`Pending::first_bytes`] has found it whole.
    fn hello(&self) -> [u8; HELLO_LEN] {
        let mut hello = [0u8; HELLO_LEN];
        hello.copy_from_slice(&self.first[HEADER_LEN..]);
        hello
    }

    /// Tells it, as far as the socket takes it at once, that it is not a member; and closes it.
    fn refuse(self) {
        let mut frame = encode_header(Kind::Abort, 0, (4 + REFUSAL.len()) as u64).to_vec();
        frame.extend_from_slice(&u32::MAX.to_le_bytes());
        frame.extend_from_slice(REFUSAL.as_bytes());
        let _ = (&self.stream).write(&frame);
        let _ = self.stream.shutdown(Shutdown::Both);
    }
}

/// What a handshake thread reports.
enum Outcome {
    Admitted(Box<Inbound>),
    /// The connection from this address was refused: it did not prove itself.
    Refused(std::net::IpAddr),
}

#[cfg(test)]
thread_local! {
    /// How many times the accept loop has gone round on this thread.
    static ACCEPT_ROUNDS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Accepts connections until one proves to be the left neighbour, or until `deadline`.
///
/// Strangers must not be able to keep the real neighbour out, however many there are and however
/// often they reconnect. So a connection costs a thread only once it has shown the expected first
/// bytes: every accepted connection is sent its challenge at once and waits, in a pool of at
/// most [`MAX_PENDING`] watched with `poll(2)`, until a whole hello has arrived under a hello's
/// header (what it sends is read as it comes, so a partial hello does not keep `poll` awake) —
/// then its handshake runs on a short-lived thread ([`MAX_HANDSHAKES`] at most), which
/// checks the proof in microseconds. A connection that sends anything else is closed at once; one
/// that stays silent is closed after [`HANDSHAKE_TIMEOUT`]; and their addresses are suspect for a
/// while ([`Backoff`]). The real neighbour answers its challenge within a round trip, so it is
/// through before silent strangers can matter.
fn accept_left(
    gate: Gate,
    listener: &TcpListener,
    deadline: Instant,
    own_address: &str,
) -> Result<Inbound> {
    use std::os::fd::AsRawFd;

    let left = gate.terms.from;
    let timeout = gate.timeout;
    let gate = Arc::new(gate);
    let (report, outcomes) = mpsc::channel::<Outcome>();
    let running = Arc::new(AtomicUsize::new(0));
    let mut pending: Vec<Pending> = Vec::new();
    let mut backoff = Backoff::default();
    let mut came = 0u64;
    listener
        .set_nonblocking(true)
        .map_err(|e| CollectiveError::io("configuring the ring listener", e))?;
    loop {
        #[cfg(test)]
        ACCEPT_ROUNDS.with(|n| n.set(n.get() + 1));
        let now = Instant::now();
        while let Ok(outcome) = outcomes.try_recv() {
            match outcome {
                Outcome::Admitted(inbound) => return Ok(*inbound),
                Outcome::Refused(ip) => backoff.strike(ip, now),
            }
        }
        if now >= deadline {
            let others = match came {
                0 => String::new(),
                n => format!(" ({n} connections came and none proved to be rank {left})"),
            };
            return Err(CollectiveError::PeerFailed {
                rank: left,
                what: format!(
                    "did not connect within {} s: it did not start, or it cannot reach this worker's address {own_address}{others}",
                    timeout.as_secs(),
                ),
            });
        }

        // Everyone who knocked: challenged at once, then pending.
        loop {
            match listener.accept() {
                Ok((stream, from)) => {
                    came += 1;
                    let nonce = match challenge(&stream, gate.terms.sealed) {
                        Ok(nonce) => nonce,
                        Err(e) => {
                            tracing::debug!(%from, "challenging a ring connection: {e}");
                            continue;
                        }
                    };
                    if pending.len() >= MAX_PENDING {
                        // Make room: the oldest of a suspect address, else the oldest.
                        let victim = (0..pending.len())
                            .min_by_key(|&i| (!pending[i].suspect, pending[i].accepted))
                            .unwrap_or(0);
                        let evicted = pending.swap_remove(victim);
                        tracing::debug!(from = %evicted.from, "{MAX_PENDING} ring connections pending: closed the oldest");
                        evicted.refuse();
                    }
                    let suspect = backoff.suspect(from.ip(), now);
                    let allowance = if suspect {
                        SUSPECT_SILENCE
                    } else {
                        HANDSHAKE_TIMEOUT
                    };
                    pending.push(Pending {
                        stream,
                        from,
                        nonce,
                        accepted: now,
                        speak_by: deadline.min(now + allowance),
                        suspect,
                        ready: false,
                        first: [0; HEADER_LEN + HELLO_LEN],
                        got: 0,
                    });
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                // What one connection did (it reset before it was accepted), or too many open
                // files for a moment: the listener is fine.
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::ConnectionAborted
                            | io::ErrorKind::ConnectionReset
                            | io::ErrorKind::Interrupted
                    ) || matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)) =>
                {
                    tracing::debug!("accepting on the ring port: {e}");
                    break;
                }
                Err(e) => return Err(CollectiveError::io("accepting the left neighbour", e)),
            }
        }

        // Those that have shown a hello go to a handshake; the wrong and the silent go.
        let mut i = 0;
        while i < pending.len() {
            let verdict = pending[i].first_bytes();
            match verdict {
                FirstBytes::Hello if running.load(Ordering::Acquire) < MAX_HANDSHAKES => {
                    let p = pending.swap_remove(i);
                    handshake_thread(&gate, p, deadline, &running, &report);
                    continue;
                }
                FirstBytes::Hello => pending[i].ready = true,
                FirstBytes::Waiting if now < pending[i].speak_by => {}
                FirstBytes::Waiting | FirstBytes::Wrong(_) | FirstBytes::OtherVersion => {
                    let p = pending.swap_remove(i);
                    match verdict {
                        FirstBytes::OtherVersion => tracing::warn!(
                            from = %p.from,
                            "refused a ring connection: it sent a hello of another length (a \
                             worker of another Hora version? run the same version everywhere)"
                        ),
                        FirstBytes::Wrong(why) => {
                            tracing::debug!(from = %p.from, "closed a ring connection: {why}")
                        }
                        _ => tracing::debug!(
                            from = %p.from,
                            "closed a ring connection: it said nothing in time"
                        ),
                    }
                    backoff.strike(p.from.ip(), now);
                    p.refuse();
                    continue;
                }
            }
            i += 1;
        }

        // Wait for a knock, more first bytes, or (every 10 ms) a handshake's outcome. What came
        // has been read, so `poll` sleeps until something new does. A connection whose hello is
        // in waits for a thread, not for bytes: it is not watched.
        let mut fds = vec![libc::pollfd {
            fd: listener.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        }];
        for p in &pending {
            if !p.ready {
                fds.push(libc::pollfd {
                    fd: p.stream.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                });
            }
        }
        let wait = deadline
            .saturating_duration_since(Instant::now())
            .min(Duration::from_millis(10));
        // SAFETY: `fds` is a live array of `fds.len()` pollfd structs whose descriptors stay
        // open for the call (the listener and the pending streams are borrowed meanwhile).
        let _ = unsafe {
            libc::poll(
                fds.as_mut_ptr(),
                fds.len() as libc::nfds_t,
                wait.as_millis() as libc::c_int,
            )
        };
    }
}

/// Sends an accepted connection its challenge (the version, a fresh nonce, whether this world
/// seals its frames) without waiting, and returns the nonce.
fn challenge(stream: &TcpStream, sealed: bool) -> io::Result<[u8; NONCE_LEN]> {
    stream.set_nonblocking(true)?;
    let nonce = handshake::nonce().map_err(|e| io::Error::other(e.to_string()))?;
    let mut frame = encode_header(Kind::Challenge, 0, CHALLENGE_LEN as u64).to_vec();
    frame.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    frame.extend_from_slice(&nonce);
    frame.push(u8::from(sealed));
    // A fresh socket's buffer takes these few bytes at once.
    match (&*stream).write(&frame)? {
        n if n == frame.len() => Ok(nonce),
        _ => Err(io::Error::other("the challenge did not fit the socket")),
    }
}

/// Runs the rest of `p`'s handshake on a short-lived thread, which reports its outcome.
fn handshake_thread(
    gate: &Arc<Gate>,
    p: Pending,
    deadline: Instant,
    running: &Arc<AtomicUsize>,
    report: &mpsc::Sender<Outcome>,
) {
    running.fetch_add(1, Ordering::AcqRel);
    let counted = Running(Arc::clone(running));
    let (gate, report) = (Arc::clone(gate), report.clone());
    let from = p.from;
    let spawned = thread::Builder::new()
        .name("hora-ring-handshake".into())
        .stack_size(256 << 10)
        .spawn(move || {
            let _counted = counted;
            let hello = p.hello();
            let outcome = match admit(&gate, p.stream, p.from, p.nonce, &hello, deadline) {
                Ok(inbound) => Outcome::Admitted(Box::new(inbound)),
                Err(Some(ip)) => Outcome::Refused(ip),
                Err(None) => return,
            };
            // Nobody listens any more if the deadline passed meanwhile.
            let _ = report.send(outcome);
        });
    if let Err(e) = spawned {
        tracing::warn!(%from, "no thread for a ring handshake ({e}): closed the connection");
    }
}

/// Runs the rest of one challenged connection's handshake: the left neighbour, proved; or the
/// connection told only that it is not a member, closed, the reason logged, and its address if
/// it failed to prove itself (`None`: it did, and failed afterwards). Its `hello` (the body, its
/// proof in it) has been read already; once proved, it has until the ring's `deadline` to finish.
fn admit(
    gate: &Gate,
    mut stream: TcpStream,
    from: SocketAddr,
    ours: [u8; NONCE_LEN],
    hello: &[u8; HELLO_LEN],
    deadline: Instant,
) -> Result<Inbound, Option<std::net::IpAddr>> {
    match handshake_left(gate, &mut stream, ours, hello, deadline) {
        Ok(Admitted { slots, open, seal }) => {
            if let Err(e) = tune(&stream, gate.timeout) {
                tracing::warn!(%from, "tuning the left neighbour's socket: {e}");
                return Err(None);
            }
            Ok(Inbound {
                stream,
                peer: gate.terms.from,
                timeout: gate.timeout,
                slots,
                open,
                seal,
            })
        }
        Err(refused) => {
            let tell = match refused {
                Refused::Unproven(why) => {
                    tracing::warn!(%from, "refused a ring connection: {why}");
                    true
                }
                Refused::Failed(why) => {
                    tracing::warn!(%from, "the left neighbour's handshake failed: {why}");
                    false
                }
            };
            if tell {
                let mut payload = u32::MAX.to_le_bytes().to_vec();
                payload.extend_from_slice(REFUSAL.as_bytes());
                let soon = Instant::now() + Duration::from_secs(1);
                let _ = write_frame_by(&mut stream, Kind::Abort, &payload, soon);
            }
            let _ = stream.shutdown(Shutdown::Both);
            Err(tell.then_some(from.ip()))
        }
    }
}

/// What the accepting side's handshake settled.
struct Admitted {
    /// The slots mapped, if the neighbour took them.
    slots: Option<ReceiverSlots>,
    open: Opener,
    seal: Sealer,
}

/// The accepting side of the handshake after its challenge (nonce `ours`) and the `hello` that
/// answered it (read by the accept loop): welcome — then, proved both ways and sealed, the
/// shared-memory offer.
fn handshake_left(
    gate: &Gate,
    stream: &mut TcpStream,
    ours: [u8; NONCE_LEN],
    hello: &[u8; HELLO_LEN],
    deadline: Instant,
) -> Result<Admitted, Refused> {
    let terms = &gate.terms;
    let failed = |e: io::Error| Refused::Failed(e.to_string());

    stream
        .set_nonblocking(false)
        .and_then(|()| tune(stream, HANDSHAKE_TIMEOUT))
        .map_err(failed)?;
    let hello = Hello::decode(hello)
        .ok_or_else(|| Refused::Unproven(format!("a hello is {HELLO_LEN} bytes")))?;
    if hello.version != PROTOCOL_VERSION {
        return Err(Refused::Unproven(format!(
            "it speaks ring protocol {}, this worker {PROTOCOL_VERSION}: run the same Hora \
             version on every worker",
            hello.version
        )));
    }
    if hello.sealed != terms.sealed {
        return Err(Refused::Unproven(format!(
            "it says it is rank {} and {} its frames, and this worker {}: give every worker the \
             same setting (sealing is on unless a worker is started with {UNSEALED_KNOB})",
            hello.rank,
            if hello.sealed {
                "seals"
            } else {
                "does not seal"
            },
            if terms.sealed { "does" } else { "does not" },
        )));
    }
    let nonces = Nonces {
        acceptor: ours,
        connector: hello.nonce,
    };
    if !gate
        .key
        .verify(Role::Connector, terms, &nonces, &hello.proof)
    {
        return Err(Refused::Unproven(format!(
            "it did not prove that it knows this world's session; it says it is rank {} of {} \
             in generation {}, and this worker waits for rank {} of {} in generation {} (a \
             worker of another job or generation, one given another --peers list or session \
             secret, or a stranger)",
            hello.rank, hello.size, hello.generation, terms.from, terms.size, terms.generation
        )));
    }
    let proof = gate.key.prove(Role::Acceptor, terms, &nonces);
    write_frame_by(stream, Kind::Welcome, &proof, deadline).map_err(failed)?;

    // Proved both ways: from here on every frame is sealed, and the host id and the offer are
    // for a member only, which is given until the ring's deadline (not cut off mid-way by the
    // strangers' short one).
    let (mut open, mut seal) = if terms.sealed {
        let keys = gate.key.frame_keys(terms, &nonces);
        (
            Opener::new(keys.to_acceptor),
            Sealer::new(keys.to_connector),
        )
    } else {
        (Opener::plain(), Sealer::plain())
    };
    let (kind, host) =
        read_sealed_by(stream, &mut open, MAX_HOST_FRAME, deadline).map_err(failed)?;
    if kind != Kind::Host {
        return Err(Refused::Failed(format!(
            "it sent a {kind:?} frame where its host id was due"
        )));
    }
    let created = gate
        .offer
        .as_ref()
        .filter(|(own, _)| !host.is_empty() && host == own.as_bytes())
        .and_then(|&(_, slot_bytes)| {
            create_slots(terms.to, slot_bytes)
                .map_err(|e| tracing::debug!("no shared memory for the ring ({e}); using TCP"))
                .ok()
                .map(|(path, slots)| (path, slots, slot_bytes))
        });
    let Some((path, slots, slot_bytes)) = created else {
        write_sealed_by(stream, &mut seal, Kind::Offer, b"", deadline).map_err(failed)?;
        return Ok(Admitted {
            slots: None,
            open,
            seal,
        });
    };
    let offer = format!("shm {} {slot_bytes}", path.display());
    let answer = write_sealed_by(stream, &mut seal, Kind::Offer, offer.as_bytes(), deadline)
        .and_then(|()| read_sealed_by(stream, &mut open, 16, deadline));
    // Both sides have it mapped (or never will): the name can go.
    let _ = std::fs::remove_file(&path);
    let slots = match answer.map_err(failed)? {
        (Kind::Attached, yes) if yes == b"yes" => Some(slots),
        (Kind::Attached, _) => None,
        (kind, _) => {
            return Err(Refused::Failed(format!(
                "it sent a {kind:?} frame where its answer to the shared-memory offer was due"
            )))
        }
    };
    Ok(Admitted { slots, open, seal })
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &str = "the operator's shared secret";

    /// Rank `rank` of a world of two on loopback, with `listener`'s address as rank 0's.
    fn world(listener: &TcpListener, rank: u32, secret: &str) -> World {
        let peers = vec![
            listener.local_addr().unwrap().to_string(),
            "127.0.0.1:9".to_string(),
        ];
        World::from_peers(peers, rank, Some(secret)).unwrap()
    }

    /// What rank 0 of `world` checks its left neighbour (rank 1) against.
    fn gate(world: &World) -> Gate {
        Gate {
            key: RingKey::derive(&world.session),
            terms: terms(world, 1, 0),
            timeout: Duration::from_secs(5),
            offer: None,
        }
    }

    fn terms(world: &World, from: u32, to: u32) -> LinkTerms {
        LinkTerms {
            version: PROTOCOL_VERSION,
            generation: world.generation,
            size: world.size,
            from,
            to,
            sealed: true,
        }
    }

    /// Rank 1 of `world` connecting to rank 0, by `deadline`.
    fn connect_as_rank_1(world: &World, deadline: Instant) -> Result<Outbound> {
        let key = RingKey::derive(&world.session);
        Connector {
            address: &world.peers[0],
            rank: 0,
            terms: terms(world, 1, 0),
            key: &key,
            host: None,
            timeout: Duration::from_secs(5),
            deadline,
        }
        .connect()
    }

    /// Everything the other end sends until it closes (or 10 s pass).
    fn read_all(stream: &mut TcpStream) -> Vec<u8> {
        let _ = stream.set_read_timeout(Some(Duration::from_millis(200)));
        let (mut got, mut buf, end) = (
            Vec::new(),
            [0u8; 4096],
            Instant::now() + Duration::from_secs(10),
        );
        while Instant::now() < end {
            match stream.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) => {}
                Err(_) => break,
            }
        }
        got
    }

    fn contains(haystack: &[u8], needle: &[u8]) -> bool {
        haystack.windows(needle.len()).any(|w| w == needle)
    }

    #[test]
    fn a_peer_of_another_session_is_refused_and_learns_nothing_of_ours() {
        let listener = Links::listen("127.0.0.1:0").unwrap();
        let ours = world(&listener, 0, SECRET);
        let theirs = world(&listener, 1, "another job's secret, just as long");
        let deadline = Instant::now() + Duration::from_secs(20);
        thread::scope(|s| {
            let accepting = s.spawn(|| accept_left(gate(&ours), &listener, deadline, "here"));
            // A stranger that guessed a session: a well-formed hello with a proof under its key.
            let mut stranger = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
            let (kind, challenge) = read_frame_by(&mut stranger, 64, deadline).unwrap();
            assert_eq!((kind, challenge.len()), (Kind::Challenge, CHALLENGE_LEN));
            let nonces = Nonces {
                acceptor: challenge[4..4 + NONCE_LEN].try_into().unwrap(),
                connector: [7; NONCE_LEN],
            };
            let hello = Hello {
                version: PROTOCOL_VERSION,
                generation: 0,
                size: 2,
                rank: 1,
                sealed: true,
                nonce: nonces.connector,
                proof: RingKey::derive(&theirs.session).prove(
                    Role::Connector,
                    &terms(&theirs, 1, 0),
                    &nonces,
                ),
            };
            write_frame_by(&mut stranger, Kind::Hello, &hello.encode(), deadline).unwrap();
            let mut told = challenge.clone();
            told.extend(read_all(&mut stranger));
            assert!(contains(&told, REFUSAL.as_bytes()), "{told:?}");
            let raw_session = hex::decode(&ours.session).unwrap();
            let our_proof =
                RingKey::derive(&ours.session).prove(Role::Acceptor, &terms(&ours, 1, 0), &nonces);
            let secrets: [&[u8]; 4] = [
                ours.session.as_bytes(),
                &raw_session,
                SECRET.as_bytes(),
                &our_proof,
            ];
            for secret in secrets {
                assert!(!contains(&told, secret), "the stranger was told {told:?}");
            }
            // An honest worker of another world: refused, and told why it might be.
            let e = connect_as_rank_1(&theirs, deadline)
                .err()
                .unwrap()
                .to_string();
            assert!(
                e.contains("refused this worker: not a member of this ring")
                    && !e.contains(&ours.session),
                "{e}"
            );
            // The real neighbour still gets in.
            let out = connect_as_rank_1(&world(&listener, 1, SECRET), deadline).unwrap();
            let inbound = accepting.join().unwrap().unwrap();
            assert_eq!((inbound.peer, out.peer), (1, 0));
        });
    }

    #[test]
    fn silent_strangers_do_not_hold_up_the_real_neighbour() {
        let listener = Links::listen("127.0.0.1:0").unwrap();
        let ours = world(&listener, 0, SECRET);
        let start = Instant::now();
        let deadline = start + Duration::from_secs(20);
        let at = listener.local_addr().unwrap();
        // Silent, one that stops mid-header, one that sends garbage.
        let mut strangers: Vec<TcpStream> =
            (0..6).map(|_| TcpStream::connect(at).unwrap()).collect();
        strangers[4].write_all(&[MAGIC, 1, 0]).unwrap();
        strangers[5].write_all(&[0xff; 64]).unwrap();
        thread::scope(|s| {
            let accepting = s.spawn(|| accept_left(gate(&ours), &listener, deadline, "here"));
            thread::sleep(Duration::from_millis(200));
            let out = connect_as_rank_1(&world(&listener, 1, SECRET), deadline).unwrap();
            let inbound = accepting.join().unwrap().unwrap();
            assert_eq!((inbound.peer, out.peer), (1, 0));
        });
        assert!(
            start.elapsed() < HANDSHAKE_TIMEOUT,
            "the real neighbour waited {:?} behind silent strangers",
            start.elapsed()
        );
        // The strangers are let go too, told nothing but the challenge and the refusal.
        for mut s in strangers {
            let told = read_all(&mut s);
            assert!(!contains(&told, ours.session.as_bytes()));
        }
    }

    #[test]
    fn the_deadline_holds_however_many_strangers_connect() {
        let listener = Links::listen("127.0.0.1:0").unwrap();
        let ours = world(&listener, 0, SECRET);
        let at = listener.local_addr().unwrap();
        // More strangers than handshakes run at once, all silent.
        let strangers: Vec<TcpStream> = (0..MAX_HANDSHAKES * 2)
            .map(|_| TcpStream::connect(at).unwrap())
            .collect();
        let start = Instant::now();
        let e = accept_left(
            gate(&ours),
            &listener,
            start + Duration::from_secs(2),
            "here",
        )
        .err()
        .unwrap()
        .to_string();
        assert!(
            start.elapsed() < Duration::from_millis(2500),
            "returned after {:?}",
            start.elapsed()
        );
        assert!(
            e.starts_with("rank 1 did not connect within") && e.contains("connections came"),
            "{e}"
        );
        drop(strangers);

        // With the handshakes full of strangers, the real neighbour gets in once they time out.
        let strangers: Vec<TcpStream> = (0..MAX_HANDSHAKES * 2)
            .map(|_| TcpStream::connect(at).unwrap())
            .collect();
        let start = Instant::now();
        let deadline = start + Duration::from_secs(20);
        thread::scope(|s| {
            let accepting = s.spawn(|| accept_left(gate(&ours), &listener, deadline, "here"));
            let out = connect_as_rank_1(&world(&listener, 1, SECRET), deadline).unwrap();
            accepting.join().unwrap().unwrap();
            assert_eq!(out.peer, 0);
        });
        assert!(
            start.elapsed() < HANDSHAKE_TIMEOUT + Duration::from_secs(3),
            "{:?}",
            start.elapsed()
        );
        drop(strangers);
    }

    #[test]
    fn strangers_that_stop_after_the_first_byte_do_not_make_the_accept_loop_spin() {
        let listener = Links::listen("127.0.0.1:0").unwrap();
        let ours = world(&listener, 0, SECRET);
        let at = listener.local_addr().unwrap();
        let start = Instant::now();
        let deadline = start + Duration::from_secs(20);
        // Each sends the first byte of a hello's header, and then nothing.
        let strangers: Vec<TcpStream> = (0..4)
            .map(|_| {
                let mut c = TcpStream::connect(at).unwrap();
                c.write_all(&[MAGIC]).unwrap();
                c
            })
            .collect();
        let wait = Duration::from_secs(1);
        thread::scope(|s| {
            let accepting = s.spawn(|| {
                let inbound = accept_left(gate(&ours), &listener, deadline, "here");
                (inbound, ACCEPT_ROUNDS.with(|n| n.get()))
            });
            thread::sleep(wait);
            let out = connect_as_rank_1(&world(&listener, 1, SECRET), deadline).unwrap();
            let (inbound, rounds) = accepting.join().unwrap();
            assert_eq!((inbound.unwrap().peer, out.peer), (1, 0));
            // It wakes every 10 ms to look for a handshake's outcome, and for each knock and
            // byte: about 100 rounds a second; allowed ten times that. Spinning on an unread
            // byte goes round hundreds of thousands of times a second.
            let bound = start.elapsed().as_millis() as u64 + 200;
            assert!(
                rounds < bound,
                "the accept loop went round {rounds} times in {:?}",
                start.elapsed()
            );
        });
        drop(strangers);
    }

    /// A stranger at `at` until `stop`: it connects, does what `kind` says (0: nothing, 1:
    /// garbage, 2: a hello-shaped answer with a wrong proof), waits until it is closed, and
    /// connects again at once.
    fn stranger(at: SocketAddr, kind: usize, stop: &std::sync::atomic::AtomicBool) {
        while !stop.load(Ordering::Relaxed) {
            let Ok(mut c) = TcpStream::connect(at) else {
                thread::sleep(Duration::from_millis(1));
                continue;
            };
            let _ = c.set_read_timeout(Some(Duration::from_millis(100)));
            match kind {
                1 => drop(c.write_all(&[0x5a; 64])),
                2 => {
                    let mut frame = encode_header(Kind::Hello, 0, HELLO_LEN as u64).to_vec();
                    frame.extend_from_slice(&[3; HELLO_LEN]);
                    frame[HEADER_LEN..HEADER_LEN + 4]
                        .copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
                    frame[HEADER_LEN + 20] = 1; // sealed
                    let _ = c.write_all(&frame);
                }
                _ => {}
            }
            let mut buf = [0u8; 256];
            while !stop.load(Ordering::Relaxed) {
                match c.read(&mut buf) {
                    Ok(0) => break,
                    Ok(_) => {}
                    Err(e)
                        if matches!(
                            e.kind(),
                            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                        ) => {}
                    Err(_) => break,
                }
            }
        }
    }

    #[test]
    fn strangers_that_reconnect_in_a_loop_do_not_keep_the_neighbour_out() {
        let listener = Links::listen("127.0.0.1:0").unwrap();
        let ours = world(&listener, 0, SECRET);
        let at = listener.local_addr().unwrap();
        let stop = std::sync::atomic::AtomicBool::new(false);
        let start = Instant::now();
        let deadline = start + Duration::from_secs(10);
        thread::scope(|s| {
            // More silent strangers than handshakes may run at once, and others that send
            // garbage or a wrong proof; each reconnects the moment it is closed.
            for i in 0..MAX_HANDSHAKES + 24 {
                let kind = if i < MAX_HANDSHAKES + 8 { 0 } else { 1 + i % 2 };
                let stop = &stop;
                s.spawn(move || stranger(at, kind, stop));
            }
            let accepting = s.spawn(|| accept_left(gate(&ours), &listener, deadline, "here"));
            // Let them take whatever they can first.
            thread::sleep(Duration::from_millis(500));
            let out = connect_as_rank_1(&world(&listener, 1, SECRET), deadline);
            let inbound = accepting.join().unwrap();
            stop.store(true, Ordering::Relaxed);
            let (out, inbound) = (out.unwrap(), inbound.unwrap());
            assert_eq!((inbound.peer, out.peer), (1, 0));
        });
        assert!(
            start.elapsed() < Duration::from_millis(500) + HANDSHAKE_TIMEOUT,
            "the real neighbour got in after {:?}",
            start.elapsed()
        );
    }

    /// Links a world of two on loopback, each rank with `options(rank)`: each rank's outcome.
    fn connect_two(options: impl Fn(u32) -> LinkOptions + Sync) -> Vec<Result<Links>> {
        let listeners: Vec<TcpListener> = (0..2)
            .map(|_| Links::listen("127.0.0.1:0").unwrap())
            .collect();
        let peers: Vec<String> = listeners
            .iter()
            .map(|l| l.local_addr().unwrap().to_string())
            .collect();
        let options = &options;
        thread::scope(|s| {
            let handles: Vec<_> = listeners
                .into_iter()
                .enumerate()
                .map(|(rank, listener)| {
                    let world =
                        World::from_peers(peers.clone(), rank as u32, Some(SECRET)).unwrap();
                    s.spawn(move || Links::connect(&world, listener, &options(rank as u32)))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn workers_that_disagree_on_sealing_refuse_each_other_and_say_why() {
        let errors: Vec<String> = connect_two(|rank| LinkOptions {
            timeout: Duration::from_secs(5),
            slot_bytes: None,
            seal_frames: rank == 0,
        })
        .into_iter()
        .map(|l| l.err().unwrap().to_string())
        .collect();
        assert!(
            errors[0].contains("does not seal its ring frames and this worker does"),
            "{}",
            errors[0]
        );
        assert!(
            errors[1].contains("seals its ring frames and this worker does not"),
            "{}",
            errors[1]
        );
    }

    /// A world of two whose rank 1 reaches rank 0 through a proxy that records what rank 1
    /// sends and, at byte `flip`, flips a bit of it. Every rank allreduces a buffer of its own
    /// (rank r: all r + 1234.5); returns each rank's outcome and what the proxy saw.
    fn through_a_proxy(seal_frames: bool, flip: Option<usize>) -> (Vec<Result<()>>, Vec<u8>) {
        let listeners: Vec<TcpListener> = (0..2)
            .map(|_| Links::listen("127.0.0.1:0").unwrap())
            .collect();
        let proxy = TcpListener::bind("127.0.0.1:0").unwrap();
        let peers = vec![
            proxy.local_addr().unwrap().to_string(),
            listeners[1].local_addr().unwrap().to_string(),
        ];
        let rank_0 = listeners[0].local_addr().unwrap();
        let seen = std::sync::Mutex::new(Vec::new());
        let outcomes = thread::scope(|s| {
            let seen = &seen;
            s.spawn(move || {
                let (from_1, _) = proxy.accept().unwrap();
                let to_0 = TcpStream::connect(rank_0).unwrap();
                let (mut back_from, mut back_to) =
                    (to_0.try_clone().unwrap(), from_1.try_clone().unwrap());
                thread::spawn(move || io::copy(&mut back_from, &mut back_to));
                let (mut from_1, mut to_0) = (from_1, to_0);
                let mut buf = [0u8; 4096];
                let mut at = 0;
                while let Ok(n @ 1..) = from_1.read(&mut buf) {
                    if let Some(i) = flip.filter(|&i| (at..at + n).contains(&i)) {
                        buf[i - at] ^= 0x10;
                    }
                    seen.lock().unwrap().extend_from_slice(&buf[..n]);
                    at += n;
                    if to_0.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
                let _ = to_0.shutdown(Shutdown::Both);
            });
            let handles: Vec<_> = listeners
                .into_iter()
                .enumerate()
                .map(|(rank, listener)| {
                    let world =
                        World::from_peers(peers.clone(), rank as u32, Some(SECRET)).unwrap();
                    s.spawn(move || {
                        let options = crate::ring::CommOptions {
                            timeout: Duration::from_secs(5),
                            shared_memory: false,
                            seal_frames,
                            ..Default::default()
                        };
                        let links = Links::connect(&world, listener, &options.links())?;
                        let mut comm = crate::ring::Communicator::new(world, Some(links), options)?;
                        let mut buf = vec![rank as f32 + 1234.5; 100_000];
                        comm.allreduce(&mut buf[..], crate::ring::Reduce::Sum, 0)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap())
                .collect::<Vec<_>>()
        });
        (outcomes, seen.into_inner().unwrap())
    }

    #[test]
    fn sealed_frames_cannot_be_read_or_altered_on_the_way() {
        // Rank 1's values as they would cross the wire in the clear.
        let clear: Vec<u8> = [1235.5f32; 8]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        // Unsealed (the test's own check): the values cross in the clear.
        let (outcomes, seen) = through_a_proxy(false, None);
        assert!(outcomes.iter().all(|o| o.is_ok()), "{outcomes:?}");
        assert!(contains(&seen, &clear));
        // Sealed: nothing readable, and the reduction is right.
        let (outcomes, seen) = through_a_proxy(true, None);
        assert!(outcomes.iter().all(|o| o.is_ok()), "{outcomes:?}");
        assert!(seen.len() > 200_000 && !contains(&seen, &clear));
        // One bit flipped in a data frame: rank 0 stops and names rank 1, the sender.
        let (outcomes, _) = through_a_proxy(true, Some(50_000));
        let e = outcomes[0].as_ref().err().unwrap().to_string();
        assert!(
            e.starts_with("rank 1 sent a frame that failed authentication"),
            "{e}"
        );
        assert!(outcomes[1].is_err());
    }

    #[test]
    fn an_impostor_at_the_neighbours_address_is_not_trusted() {
        let impostor = TcpListener::bind("127.0.0.1:0").unwrap();
        let ours = world(&impostor, 1, SECRET);
        let deadline = Instant::now() + Duration::from_secs(20);
        thread::scope(|s| {
            let connecting = s.spawn(|| connect_as_rank_1(&ours, deadline));
            let (mut stream, _) = impostor.accept().unwrap();
            let mut challenge = PROTOCOL_VERSION.to_le_bytes().to_vec();
            challenge.extend_from_slice(&[1; NONCE_LEN]);
            challenge.push(1);
            write_frame_by(&mut stream, Kind::Challenge, &challenge, deadline).unwrap();
            let (kind, hello) = read_frame_by(&mut stream, HELLO_LEN, deadline).unwrap();
            assert_eq!(kind, Kind::Hello);
            assert!(!contains(&hello, ours.session.as_bytes()));
            write_frame_by(&mut stream, Kind::Welcome, &[0; PROOF_LEN], deadline).unwrap();
            let e = connecting.join().unwrap().err().unwrap().to_string();
            assert!(
                e.contains("could not prove that it belongs to this ring"),
                "{e}"
            );
            // No host id, nothing else: the connection just closed.
            assert!(read_all(&mut stream).is_empty());
        });
    }

    /// A ring file of `bytes` bytes with `mode`, and its path.
    struct RingFile(String);

    impl RingFile {
        fn new(tag: &str, bytes: usize, mode: u32) -> RingFile {
            use std::os::unix::fs::PermissionsExt;
            let path = format!("/dev/shm/hora-ring-test-{}-{tag}", std::process::id());
            let file = std::fs::File::create(&path).unwrap();
            file.set_len(bytes as u64).unwrap();
            file.set_permissions(std::fs::Permissions::from_mode(mode))
                .unwrap();
            RingFile(path)
        }
    }

    impl Drop for RingFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    #[test]
    fn ring_files_of_another_user_or_mode_or_behind_a_link_are_not_attached() {
        let bytes = 64;
        let own = RingFile::new("own", bytes * SLOTS as usize, 0o600);
        assert!(attach_slots(&own.0, bytes).is_ok());
        // SAFETY: no preconditions.
        let user = unsafe { libc::geteuid() };
        let e = attach_slots_of(&own.0, bytes, user.wrapping_add(1))
            .err()
            .unwrap();
        assert!(e.to_string().contains("belongs to user"), "{e}");
        for mode in [0o644, 0o660, 0o400, 0o4600] {
            let other = RingFile::new(&format!("mode{mode:o}"), bytes * SLOTS as usize, mode);
            let e = attach_slots(&other.0, bytes).err().unwrap();
            assert!(e.to_string().contains("has mode"), "{mode:o}: {e}");
        }
        let link = RingFile(format!(
            "/dev/shm/hora-ring-test-{}-link",
            std::process::id()
        ));
        std::os::unix::fs::symlink(&own.0, &link.0).unwrap();
        let e = attach_slots(&link.0, bytes).err().unwrap();
        assert_eq!(e.raw_os_error(), Some(libc::ELOOP), "{e}");
        // And what this side creates is what the other side accepts.
        let (path, _slots) = create_slots(0, bytes).unwrap();
        let made = RingFile(path.display().to_string());
        assert!(attach_slots(&made.0, bytes).is_ok());
    }

    #[test]
    fn proved_neighbours_on_one_host_share_memory() {
        if host_id().is_none() {
            return; // No /dev/shm here, or HORA_RING_SHM=0: nothing to offer.
        }
        let links: Vec<Links> = connect_two(|_| LinkOptions {
            timeout: Duration::from_secs(10),
            slot_bytes: Some(4096),
            seal_frames: true,
        })
        .into_iter()
        .map(|l| l.unwrap())
        .collect();
        for (rank, l) in links.iter().enumerate() {
            assert!(
                l.inbound.slots.is_some() && l.outbound.slots.is_some(),
                "rank {rank}"
            );
        }
    }

    #[test]
    fn hellos_round_trip_and_only_at_their_length() {
        let hello = Hello {
            version: PROTOCOL_VERSION,
            generation: 3,
            size: 4,
            rank: 2,
            sealed: false,
            nonce: [5; NONCE_LEN],
            proof: [6; PROOF_LEN],
        };
        let bytes = hello.encode();
        assert_eq!(bytes.len(), HELLO_LEN);
        assert_eq!(Hello::decode(&bytes), Some(hello));
        assert_eq!(Hello::decode(&bytes[1..]), None);
    }

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

    /// One connection's frame keys (to the acceptor, to the connector), as both ends derive them.
    fn frame_keys() -> (crate::sealed::DirectionKey, crate::sealed::DirectionKey) {
        let nonces = Nonces {
            acceptor: [1; NONCE_LEN],
            connector: [2; NONCE_LEN],
        };
        let keys = RingKey::derive("a session").frame_keys(
            &LinkTerms {
                version: PROTOCOL_VERSION,
                generation: 0,
                size: 2,
                from: 1,
                to: 0,
                sealed: true,
            },
            &nonces,
        );
        (keys.to_acceptor, keys.to_connector)
    }

    #[test]
    fn abort_frames_name_the_failed_rank_once() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let timeout = Duration::from_secs(5);
        let (to_acceptor, to_connector) = frame_keys();
        let sender = thread::spawn(move || {
            let stream = TcpStream::connect(addr).unwrap();
            let mut out = Outbound {
                stream,
                peer: 1,
                timeout,
                slots: None,
                seal: Sealer::new(to_acceptor),
                open: Opener::new(to_connector),
            };
            out.abort(Some(7), "closed its connection");
        });
        let (stream, _) = listener.accept().unwrap();
        let (to_acceptor, to_connector) = frame_keys();
        let mut inbound = Inbound {
            stream,
            peer: 3,
            timeout,
            slots: None,
            open: Opener::new(to_acceptor),
            seal: Sealer::new(to_connector),
        };
        let e = inbound.header().unwrap_err().to_string();
        assert_eq!(
            e,
            "rank 7 closed its connection (reported around the ring by rank 3)"
        );
        sender.join().unwrap();
    }
}
