//! The frames neighbours exchange: a 16-byte header (kind, an auxiliary word, payload length)
//! and a payload, sealed after the handshake (see `sealed`); the handshake's messages; reading
//! and writing them by a deadline; what a failed read or write says about the neighbour.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use crate::handshake::{NONCE_LEN, PROOF_LEN};
use crate::sealed::{Opener, SealError, Sealer, TAG_LEN};
use crate::{CollectiveError, Result};

/// `Challenge`: version, the accepting side's nonce, whether it seals its frames.
pub(super) const CHALLENGE_LEN: usize = 4 + NONCE_LEN + 1;
/// `Hello`: version, generation, world size, rank, whether it seals its frames, the connecting
/// side's nonce, its proof.
pub(super) const HELLO_LEN: usize = 4 + 8 + 4 + 4 + 1 + NONCE_LEN + PROOF_LEN;
/// The longest host id (a boot id is 36 characters) or shared-memory offer.
pub(super) const MAX_HOST_FRAME: usize = 512;
pub(super) const HEADER_LEN: usize = 16;
/// The most a header record takes: the header, then its tag (none when unsealed).
pub(super) const HEADER_RECORD: usize = HEADER_LEN + TAG_LEN;
pub(super) const MAGIC: u8 = 0xA7;
/// The largest control payload (hello, op header, abort) accepted.
pub(crate) const MAX_CONTROL: u64 = 64 << 10;

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

pub(super) fn encode_header(kind: Kind, aux: u32, len: u64) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[0] = MAGIC;
    h[1] = kind as u8;
    h[4..8].copy_from_slice(&aux.to_le_bytes());
    h[8..16].copy_from_slice(&len.to_le_bytes());
    h
}

/// A header's fields, if it is one of ours.
pub(super) fn decode_header(h: &[u8]) -> Option<Header> {
    let kind = Kind::from_u8(*h.get(1)?).filter(|_| h[0] == MAGIC)?;
    Some(Header {
        kind,
        aux: u32::from_le_bytes(h.get(4..8)?.try_into().ok()?),
        len: u64::from_le_bytes(h.get(8..16)?.try_into().ok()?),
    })
}

/// Bytes a frame with a stream payload of `len` bytes takes with tags of `tag` bytes: its
/// header record, then (unless the payload is empty) the payload record.
pub(super) fn framed_len(len: usize, tag: usize) -> usize {
    HEADER_LEN + tag + if len == 0 { 0 } else { len + tag }
}

/// Seals a header announcing `kind`, `aux` and `len` into `record` (`HEADER_LEN` bytes and a
/// tag's).
pub(super) fn seal_header(
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
pub(super) fn seal_frame(
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
pub(super) fn unsealed(peer: u32, e: SealError) -> CollectiveError {
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
pub(super) const RELAYED: &str = "reported around the ring by rank";

/// What a failed read or write on a neighbour's connection says about the neighbour.
pub(super) fn peer_failed(
    peer: u32,
    timeout: Duration,
    silent: &str,
    e: io::Error,
) -> CollectiveError {
    let what = match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => format!(
            "{silent} for {} s: it stalled or died (raise --timeout if a step can legitimately take longer)",
            timeout.as_secs()
        ),
        _ => format!("closed its connection ({e}): the process exited or crashed"),
    };
    CollectiveError::PeerFailed { rank: peer, what }
}

/// Reads exactly `buf.len()` bytes by `deadline`, however slowly the other side sends them.
pub(super) fn read_by(stream: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> io::Result<()> {
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
pub(super) fn read_frame_by(
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
pub(super) fn write_frame_by(
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
pub(super) fn write_sealed_by(
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
pub(super) fn read_sealed_by(
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
pub(super) fn abort_text(payload: &[u8]) -> String {
    String::from_utf8_lossy(payload.get(4..).unwrap_or_default()).into_owned()
}

/// The connecting side's answer to a challenge.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Hello {
    pub(super) version: u32,
    pub(super) generation: u64,
    pub(super) size: u32,
    pub(super) rank: u32,
    pub(super) sealed: bool,
    pub(super) nonce: [u8; NONCE_LEN],
    pub(super) proof: [u8; PROOF_LEN],
}

impl Hello {
    pub(super) fn encode(&self) -> Vec<u8> {
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

    pub(super) fn decode(b: &[u8]) -> Option<Hello> {
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
