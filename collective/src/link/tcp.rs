//! A link's two ends once the handshake is done: pieces and control frames out to the right
//! neighbour, in from the left, with abort frames that carry a failure around the ring. This
//! file is their TCP stream path; a piece that goes through shared-memory slots takes the
//! path in `shm` instead.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::time::Duration;

use crate::sealed::{Opener, Sealer, TAG_LEN};
use crate::{CollectiveError, Result};

use super::frame::{
    decode_header, encode_header, framed_len, peer_failed, seal_frame, unsealed, Header, Kind,
    HEADER_LEN, HEADER_RECORD, MAX_CONTROL, RELAYED,
};
use super::shm::{ReceiverSlots, SenderSlots};

/// The sending end (to the right neighbour).
pub struct Outbound {
    pub(super) stream: TcpStream,
    /// The neighbour's rank, for error messages.
    pub peer: u32,
    pub(super) timeout: Duration,
    pub(super) slots: Option<SenderSlots>,
    /// Seals what this side sends.
    pub(super) seal: Sealer,
    /// Opens the slot credits that come back.
    pub(super) open: Opener,
}

/// The receiving end (from the left neighbour).
pub struct Inbound {
    pub(super) stream: TcpStream,
    pub peer: u32,
    pub(super) timeout: Duration,
    pub(super) slots: Option<ReceiverSlots>,
    /// Opens what the left neighbour sends.
    pub(super) open: Opener,
    /// Seals the slot credits sent back.
    pub(super) seal: Sealer,
}

/// Where an announced data piece is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Incoming {
    /// In the TCP stream, right after the header.
    Stream,
    /// In shared-memory slot `n`.
    Slot(u32),
}

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
        if self.slots.as_ref().is_some_and(|s| len <= s.slot_bytes()) {
            return self.send_to_slot(len, direct, fill);
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

    /// Tells the right neighbour that `rank` failed (best effort: it may be the one that died).
    pub fn abort(&mut self, rank: Option<u32>, message: &str) {
        let mut payload = rank.unwrap_or(u32::MAX).to_le_bytes().to_vec();
        payload.extend_from_slice(message.as_bytes());
        payload.truncate(MAX_CONTROL as usize);
        let _ = self.stream.set_write_timeout(Some(Duration::from_secs(2)));
        let _ = self.send(Kind::Abort, 0, &payload);
        let _ = self.stream.shutdown(Shutdown::Both);
    }

    pub(super) fn failed(&self, e: io::Error) -> CollectiveError {
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
            Kind::Data => Some(Incoming::Stream),
            Kind::SlotData => self.announced_slot(&h).map(Incoming::Slot),
            _ => None,
        };
        let Some(incoming) = incoming.filter(|_| h.len == len) else {
            return Err(CollectiveError::Protocol(format!(
                "rank {} sent a {:?} frame of {} bytes where a data piece of {len} bytes was due \
                 (the ranks are out of step: do all of them make the same collective calls?)",
                self.peer, h.kind, h.len
            )));
        };
        Ok(incoming)
    }

    /// Copies an announced piece into `dst`.
    pub fn data_into(&mut self, incoming: Incoming, dst: &mut [u8]) -> Result<()> {
        match incoming {
            Incoming::Stream => self.payload(dst),
            Incoming::Slot(slot) => self.slot_into(slot, dst),
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
            Incoming::Slot(slot) => self.with_slot(slot, len, f),
        }
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

    pub(super) fn failed(&self, e: io::Error) -> CollectiveError {
        peer_failed(self.peer, self.timeout, "sent nothing", e)
    }
}
