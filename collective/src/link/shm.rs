//! Shared memory between ring neighbours on one host: a ring of slots in a file under
//! `/dev/shm` that the receiving side creates and offers and the sending side maps. A slot is
//! the sender's from the receiver's credit until the header that announces it, and the
//! receiver's from that header until its credit; the headers and credits travel over the link's
//! TCP connection (see `tcp`). The slot memory, its checks, and the link's shared-memory path
//! (`impl Outbound` and `impl Inbound` below) are all here; the TCP stream's path is in `tcp`.

use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

use hora_common::kernel;

use super::frame::{decode_header, seal_header, unsealed, Header, Kind, HEADER_LEN, HEADER_RECORD};
use super::tcp::{Inbound, Outbound};
use crate::{CollectiveError, Result};

/// The sender's side of a shared-memory slot ring.
pub(super) struct SenderSlots {
    map: memmap2::MmapMut,
    slot_bytes: usize,
    /// Slots the receiver has handed back.
    free: Vec<u32>,
}

/// The receiver's side of a shared-memory slot ring.
pub(super) struct ReceiverSlots {
    map: memmap2::Mmap,
    slot_bytes: usize,
}

/// Slots offered to a same-host sender.
pub(super) const SLOTS: u32 = 8;
/// Larger pieces go over TCP (and no more than 8 × this is put in /dev/shm per link).
pub(super) const MAX_SLOT_BYTES: usize = 16 << 20;

impl SenderSlots {
    /// The largest piece a slot holds.
    pub(super) fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// A slot this side holds, if any.
    pub(super) fn take(&mut self) -> Option<u32> {
        self.free.pop()
    }

    /// A slot the receiver handed back (`slot < SLOTS`, checked by the caller); false if this
    /// side held it already (a credit sent twice).
    pub(super) fn give_back(&mut self, slot: u32) -> bool {
        if self.free.contains(&slot) {
            return false;
        }
        self.free.push(slot);
        true
    }

    /// Whether this side holds every slot again: nothing is left for the receiver to read.
    pub(super) fn all_back(&self) -> bool {
        self.free.len() >= SLOTS as usize
    }

    /// The first `len` bytes of slot `slot`, which this side holds (from [`Self::take`]).
    pub(super) fn slot_mut(&mut self, slot: u32, len: usize) -> &mut [u8] {
        assert!(
            slot < SLOTS && len <= self.slot_bytes,
            "a slot out of bounds"
        );
        let at = slot as usize * self.slot_bytes;
        // SAFETY: `at + len` lies within the mapping (checked above: the mapping is
        // SLOTS × slot_bytes); the slice covers only this slot, which this side holds until it
        // announces it, so nothing else reads or writes these bytes meanwhile (see
        // `create_slots`).
        unsafe { std::slice::from_raw_parts_mut(self.map.as_mut_ptr().add(at), len) }
    }
}

impl ReceiverSlots {
    /// The largest piece a slot holds.
    pub(super) fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// The first `len` bytes of slot `slot`, which the sender announced; `None` out of bounds.
    pub(super) fn slot(&self, slot: u32, len: usize) -> Option<&[u8]> {
        if slot >= SLOTS || len > self.slot_bytes {
            return None;
        }
        // The header that announced the slot was read after the sender wrote it.
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        let at = slot as usize * self.slot_bytes;
        // SAFETY: in bounds (checked above); the slice covers only this slot, which the sender
        // filled before announcing it and will not touch again until this side's credit.
        Some(unsafe { std::slice::from_raw_parts(self.map.as_ptr().add(at), len) })
    }
}

/// A link's shared-memory path (the TCP stream's is in `tcp`): the sending end writes a piece
/// into a slot it holds and announces it with a header on the socket; the receiving end reads it
/// in place and hands the slot back with a credit.
impl Outbound {
    /// Sends one data piece of `len` bytes (at most a slot's) through a slot: `direct` as it is,
    /// or what `fill` writes straight into the slot.
    pub(super) fn send_to_slot(
        &mut self,
        len: usize,
        direct: Option<&[u8]>,
        fill: impl FnOnce(&mut [u8]) -> Result<()>,
    ) -> Result<()> {
        let slot = self.free_slot()?;
        let dst = self
            .slots
            .as_mut()
            .ok_or_else(|| CollectiveError::Config("no slots".into()))?
            .slot_mut(slot, len);
        match direct {
            Some(bytes) => kernel::copy(dst, bytes, plain_copy()),
            None => fill(dst)?,
        }
        // The slot's bytes are written before the header that announces them.
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        let record = &mut [0u8; HEADER_RECORD][..HEADER_LEN + self.seal.tag_len()];
        seal_header(&mut self.seal, Kind::SlotData, slot, len, record)
            .map_err(|e| unsealed(self.peer, e))?;
        self.stream.write_all(record).map_err(|e| self.failed(e))
    }

    /// Waits until the receiver has handed back every slot. Called at the end of each
    /// collective, so that no credit is left unread in the socket: closing a socket with unread
    /// data resets the connection, and the reset could destroy data the neighbour still has to
    /// read.
    pub fn settle(&mut self) -> Result<()> {
        while self.slots.as_ref().is_some_and(|s| !s.all_back()) {
            self.read_credit()?;
        }
        Ok(())
    }

    /// A slot the receiver is done with, waiting for its credit if none is free.
    fn free_slot(&mut self) -> Result<u32> {
        loop {
            if let Some(slot) = self.slots.as_mut().and_then(|s| s.take()) {
                return Ok(slot);
            }
            self.read_credit()?;
        }
    }

    /// Reads the next slot credit and takes the slot back.
    fn read_credit(&mut self) -> Result<()> {
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
        if !self.slots.as_mut().is_some_and(|s| s.give_back(slot)) {
            return Err(CollectiveError::Protocol(format!(
                "rank {} returned slot {slot}, which it did not hold",
                self.peer
            )));
        }
        Ok(())
    }
}

impl Inbound {
    /// The slot a `SlotData` header announces, if it is one of this link's and in bounds.
    pub(super) fn announced_slot(&self, h: &Header) -> Option<u32> {
        self.slots
            .as_ref()
            .filter(|s| h.aux < SLOTS && h.len as usize <= s.slot_bytes())
            .map(|_| h.aux)
    }

    /// Copies the piece in `slot` into `dst` and hands the slot back.
    pub(super) fn slot_into(&mut self, slot: u32, dst: &mut [u8]) -> Result<()> {
        kernel::copy(dst, self.slot(slot, dst.len())?, plain_copy());
        self.credit(slot)
    }

    /// Runs `f` on the piece of `len` bytes in `slot`, in place, and hands the slot back.
    pub(super) fn with_slot<T>(
        &mut self,
        slot: u32,
        len: usize,
        f: impl FnOnce(&[u8]) -> Result<T>,
    ) -> Result<T> {
        let result = f(self.slot(slot, len)?);
        self.credit(slot)?;
        result
    }

    fn slot(&self, slot: u32, len: usize) -> Result<&[u8]> {
        let slots = self.slots.as_ref().ok_or_else(|| {
            CollectiveError::Protocol("a slot piece without shared memory".into())
        })?;
        slots.slot(slot, len).ok_or_else(|| {
            CollectiveError::Protocol(format!(
                "rank {} announced a piece outside its slots",
                self.peer
            ))
        })
    }

    fn credit(&mut self, slot: u32) -> Result<()> {
        let record = &mut [0u8; HEADER_RECORD][..HEADER_LEN + self.seal.tag_len()];
        seal_header(&mut self.seal, Kind::Credit, slot, 0, record)
            .map_err(|e| unsealed(self.peer, e))?;
        self.stream.write_all(record).map_err(|e| self.failed(e))
    }
}

/// Whether pieces are copied in and out of slots with plain memcpy (`HORA_RING_PLAIN_COPY=1`:
/// what `benches/allreduce.rs` compares [`kernel::copy`] with).
pub(super) fn plain_copy() -> bool {
    static PLAIN: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *PLAIN.get_or_init(|| std::env::var("HORA_RING_PLAIN_COPY").is_ok_and(|v| v == "1"))
}

/// This machine's identity for the shared-memory offer: the kernel's boot id (two processes
/// with the same one share `/dev/shm`), unless `HORA_RING_SHM=0`.
pub(super) fn host_id() -> Option<String> {
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
pub(super) fn create_slots(rank: u32, slot_bytes: usize) -> io::Result<(PathBuf, ReceiverSlots)> {
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
pub(super) fn attach_slots(path: &str, slot_bytes: usize) -> io::Result<SenderSlots> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let user = unsafe { libc::geteuid() };
    attach_slots_of(path, slot_bytes, user)
}

/// [`attach_slots`], for a ring file that must belong to `owner`.
pub(super) fn attach_slots_of(
    path: &str,
    slot_bytes: usize,
    owner: u32,
) -> io::Result<SenderSlots> {
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
