//! The collectives: allreduce, broadcast and allgather over the ring of [`Links`].
//!
//! **Allreduce** is the bandwidth-optimal ring (Patarasuk & Yuan; Baidu's and Horovod's): the
//! buffer is cut into N chunks; in N−1 reduce-scatter steps each rank sends one chunk to its
//! right neighbour and adds the chunk arriving from its left, after which rank r holds the full
//! sum of chunk r+1; it scales that chunk to the mean, and N−1 allgather steps pass the finished
//! chunks around. Every rank sends and receives 2(N−1)/N of the buffer, whatever N.
//!
//! **Pipelining.** Chunks are cut further into sub-chunks (`CommOptions::sub_chunk_bytes`). A
//! sending thread writes pieces to the right neighbour while the calling thread reads pieces from
//! the left and reduces them, and a piece is handed to the sender the moment its reduction is
//! done — so the next step's sending starts before this step's receiving ends, and network and
//! kernel work overlap. Pieces travel between the two threads by ownership (disjoint
//! [`Region`]s), so there is no lock and no shared mutable memory.
//!
//! **Agreement.** Before each collective, every rank sends its right neighbour a description of
//! the call (kind, sequence number, element count, wire format, root, a fingerprint of the
//! tensors) and compares the one from its left: ranks that disagree fail with an error that says
//! how, instead of exchanging mismatched bytes or waiting forever.
//!
//! **Failure.** The first error poisons the communicator: it closes its links and tells its
//! right neighbour which rank failed (see [`crate::link`]); later calls fail at once.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::mpsc;
use std::thread;
use std::time::Duration;

use crate::link::{Kind, LinkOptions, Links};
use crate::nccl::{self, DeviceBuffer, Nccl, Stream, Want};
pub use crate::region::Wire;
use crate::region::{Apply, Received, Region};
use crate::rendezvous::World;
use crate::{CollectiveError, Result};

/// Tuning of the collectives.
#[derive(Debug, Clone)]
pub struct CommOptions {
    /// Bytes of one pipelined piece (on the wire).
    pub sub_chunk_bytes: usize,
    /// How the allreduce sends its values.
    pub wire: Wire,
    /// A neighbour silent for this long is declared failed.
    pub timeout: Duration,
    /// Pass pieces through shared memory to a neighbour on the same host (see [`crate::link`]).
    pub shared_memory: bool,
    /// Seal every frame on the ring's TCP connections (AES-256-GCM; see [`crate::link`]). On by
    /// default; every worker of a world must agree. Off only on a network nobody else can reach.
    pub seal_frames: bool,
}

impl Default for CommOptions {
    fn default() -> Self {
        CommOptions {
            sub_chunk_bytes: 256 << 10,
            wire: Wire::F32,
            timeout: Duration::from_secs(30),
            shared_memory: true,
            seal_frames: true,
        }
    }
}

impl CommOptions {
    /// How this worker's links are made.
    pub fn links(&self) -> LinkOptions {
        LinkOptions {
            timeout: self.timeout,
            slot_bytes: self.shared_memory.then_some(self.sub_chunk_bytes),
            seal_frames: self.seal_frames,
        }
    }
}

/// Sum or mean.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reduce {
    Sum,
    Average,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum OpKind {
    Allreduce = 1,
    Broadcast = 2,
    Allgather = 3,
}

/// What each rank announces before a collective.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct OpHeader {
    kind: OpKind,
    seq: u64,
    elements: u64,
    wire: u8,
    root: u32,
    fingerprint: u64,
    /// Elements per pipelined piece: ranks must cut buffers alike.
    piece: u32,
}

impl OpHeader {
    fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(33);
        b.push(self.kind as u8);
        b.extend_from_slice(&self.seq.to_le_bytes());
        b.extend_from_slice(&self.elements.to_le_bytes());
        b.push(self.wire);
        b.extend_from_slice(&self.root.to_le_bytes());
        b.extend_from_slice(&self.fingerprint.to_le_bytes());
        b.extend_from_slice(&self.piece.to_le_bytes());
        b
    }

    fn decode(b: &[u8]) -> Option<OpHeader> {
        if b.len() != 34 {
            return None;
        }
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or_default());
        let kind = match b[0] {
            1 => OpKind::Allreduce,
            2 => OpKind::Broadcast,
            3 => OpKind::Allgather,
            _ => return None,
        };
        Some(OpHeader {
            kind,
            seq: u64_at(1),
            elements: u64_at(9),
            wire: b[17],
            root: u32::from_le_bytes(b[18..22].try_into().unwrap_or_default()),
            fingerprint: u64_at(22),
            piece: u32::from_le_bytes(b[30..34].try_into().unwrap_or_default()),
        })
    }

    fn describe(&self) -> String {
        let what = match self.kind {
            OpKind::Allreduce => format!(
                "allreduce of {} elements ({})",
                self.elements,
                match self.wire {
                    2 => "f16 wire",
                    NCCL_WIRE => "through NCCL",
                    _ => "f32 wire",
                }
            ),
            OpKind::Broadcast => {
                format!(
                    "broadcast of {} elements from rank {}",
                    self.elements, self.root
                )
            }
            OpKind::Allgather => "allgather".to_string(),
        };
        format!(
            "{what}, tensors {:016x}, pieces of {} bytes (--sub-chunk-kib)",
            self.fingerprint, self.piece
        )
    }
}

/// The wire byte of a collective that runs through NCCL.
const NCCL_WIRE: u8 = 16;

/// `fingerprint` with each device buffer's element count and type.
fn fingerprint_of(bufs: &[DeviceBuffer], fingerprint: u64) -> u64 {
    self::fingerprint(
        std::iter::once(fingerprint).chain(
            bufs.iter()
                .flat_map(|b| [b.count as u64, b.dtype.code() as u64]),
        ),
    )
}

/// FNV-1a over a description of the tensors (shapes, names): ranks whose tensors differ get
/// different fingerprints.
pub fn fingerprint(parts: impl IntoIterator<Item = u64>) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for b in p.to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// Which pieces to send first and which to receive, in order.
struct Plan {
    first_sends: Vec<Range<usize>>,
    receives: Vec<Receive>,
}

struct Receive {
    range: Range<usize>,
    apply: Apply,
    /// Scale/round the piece once received (the chunk this rank finishes).
    finish: bool,
    /// Hand the piece to the sender afterwards.
    forward: bool,
}

/// One worker's end of the collectives.
pub struct Communicator {
    world: World,
    links: Option<Links>,
    options: CommOptions,
    seq: u64,
    poisoned: Option<String>,
    /// NCCL, for tensors in GPU memory, once [`Communicator::use_nccl`] formed it.
    nccl: Option<Nccl>,
}

impl Communicator {
    /// A communicator over established links (`None` only for a world of one).
    pub fn new(world: World, links: Option<Links>, options: CommOptions) -> Result<Self> {
        if world.size > 1 && links.is_none() {
            return Err(CollectiveError::Config(format!(
                "a world of {} needs ring links",
                world.size
            )));
        }
        Ok(Communicator {
            world,
            links,
            options,
            seq: 0,
            poisoned: None,
            nccl: None,
        })
    }

    /// A world of one: every collective is the identity (allreduce's mean of one).
    pub fn single() -> Self {
        Communicator {
            world: World::single(),
            links: None,
            options: CommOptions::default(),
            seq: 0,
            poisoned: None,
            nccl: None,
        }
    }

    pub fn rank(&self) -> u32 {
        self.world.rank
    }

    pub fn size(&self) -> u32 {
        self.world.size
    }

    pub fn world(&self) -> &World {
        &self.world
    }

    pub fn options(&self) -> &CommOptions {
        &self.options
    }

    /// Element-wise sum or mean of `buf` over all ranks, in place.
    pub fn allreduce<R: Region>(&mut self, buf: R, reduce: Reduce, fingerprint: u64) -> Result<()> {
        let n = self.world.size as usize;
        let factor = (reduce == Reduce::Average).then_some(1.0 / n as f32);
        if n == 1 {
            let mut buf = buf;
            return if factor.is_some() {
                buf.finish(None, Wire::F32)
            } else {
                Ok(())
            };
        }
        let wire = self.options.wire;
        let header = self.header(OpKind::Allreduce, buf.len(), 0, fingerprint);
        let plan = allreduce_plan(self.world.rank as usize, n, buf.len());
        self.run(header, |comm| comm.pipeline(buf, &plan, wire, factor))
    }

    /// Copies `root`'s `buf` into every rank's `buf`.
    pub fn broadcast<R: Region>(&mut self, buf: R, root: u32, fingerprint: u64) -> Result<()> {
        let n = self.world.size;
        if root >= n {
            return Err(CollectiveError::Config(format!(
                "broadcast root {root} is not a rank of a world of {n}"
            )));
        }
        if n == 1 {
            return Ok(());
        }
        let rank = self.world.rank;
        let whole = 0..buf.len();
        let plan = if rank == root {
            Plan {
                first_sends: vec![whole],
                receives: vec![],
            }
        } else {
            Plan {
                first_sends: vec![],
                receives: vec![Receive {
                    range: whole,
                    apply: Apply::Overwrite,
                    finish: false,
                    // The rank just left of the root ends the chain.
                    forward: (rank + 1) % n != root,
                }],
            }
        };
        let header = self.header(OpKind::Broadcast, buf.len(), root, fingerprint);
        // Broadcast copies exact values: always f32 on the wire.
        self.run(header, |comm| comm.pipeline(buf, &plan, Wire::F32, None))
    }

    /// Every rank's `mine` (small: metrics, counters), in rank order.
    pub fn allgather(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        let n = self.world.size as usize;
        if n == 1 {
            return Ok(vec![mine.to_vec()]);
        }
        if mine.len() > crate::link::MAX_CONTROL as usize {
            return Err(CollectiveError::Config(format!(
                "allgather carries small values (at most {} bytes), not {}",
                crate::link::MAX_CONTROL,
                mine.len()
            )));
        }
        let header = self.header(OpKind::Allgather, 0, 0, 0);
        let rank = self.world.rank as usize;
        self.run(header, |comm| {
            let links = comm
                .links
                .as_mut()
                .ok_or(CollectiveError::Config("no links".into()))?;
            let mut all = vec![Vec::new(); n];
            all[rank] = mine.to_vec();
            let (inbound, outbound) = (&mut links.inbound, &mut links.outbound);
            thread::scope(|s| {
                let (tx, rx) = mpsc::channel::<Vec<u8>>();
                let sender = s.spawn(move || -> Result<()> {
                    for blob in rx {
                        outbound.send(Kind::Blob, 0, &blob)?;
                    }
                    Ok(())
                });
                let received = (|| -> Result<()> {
                    tx.send(mine.to_vec()).ok();
                    for step in 0..n - 1 {
                        let h = inbound.header()?;
                        if h.kind != Kind::Blob {
                            return Err(CollectiveError::Protocol(format!(
                                "rank {} sent {:?} during an allgather",
                                inbound.peer, h.kind
                            )));
                        }
                        let blob = inbound.control_payload(h.len)?;
                        if step + 1 < n - 1 {
                            tx.send(blob.clone()).ok();
                        }
                        all[(rank + n - step - 1) % n] = blob;
                    }
                    Ok(())
                })();
                drop(tx);
                let sent = sender
                    .join()
                    .unwrap_or_else(|_| Err(CollectiveError::Config("sender panicked".into())));
                received.and(sent)
            })?;
            Ok(all)
        })
    }

    /// Forms an NCCL communicator of this world on CUDA device `device`, over which
    /// [`device_allreduce`](Self::device_allreduce) and
    /// [`device_broadcast`](Self::device_broadcast) then run. Every rank calls it (a collective,
    /// as [`attach_nccl`](Self::attach_nccl)): either every rank uses NCCL or none does, with an
    /// error on every rank naming each rank that cannot and why. Returns NCCL's version.
    pub fn use_nccl(&mut self, device: i32) -> Result<String> {
        self.form_nccl(Want::Cuda(device))
    }

    /// Forms NCCL as this rank wants it (`Off` and `Cpu` take part, saying why they cannot): a
    /// world where some rank cannot use it is not an error unless it is `required`, and every
    /// rank then goes on without it. Every rank of the world calls it. Returns NCCL's version
    /// when it is used.
    pub fn attach_nccl(&mut self, want: Want, required: bool) -> Result<Option<String>> {
        match self.form_nccl(want) {
            Ok(version) => {
                tracing::info!(version = %version, ?want, "tensors on the GPU are averaged through NCCL");
                Ok(Some(version))
            }
            Err(e @ CollectiveError::Config(_)) if !required => {
                match want {
                    Want::Cuda(_) => {
                        tracing::info!(reason = %e, "NCCL is not used: the ring averages on each rank's device")
                    }
                    Want::Cpu | Want::Off => tracing::debug!(reason = %e, "NCCL is not used"),
                }
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// Every rank says whether it can use NCCL, and on which GPU; if all can, each on its own,
    /// rank 0 makes the NCCL id, the ring carries it, and every rank joins the communicator.
    fn form_nccl(&mut self, want: Want) -> Result<String> {
        if let Some(nccl) = &self.nccl {
            return match want == Want::Cuda(nccl.device()) {
                true => Ok(nccl.version().to_string()),
                false => Err(CollectiveError::Config(format!(
                    "this ring's NCCL communicator is on cuda:{} already: one GPU per worker, for the life of its world",
                    nccl.device()
                ))),
            };
        }
        let offers = self.allgather(&nccl::Offer::new(want).encode())?;
        nccl::agree_on(&offers)?;
        let Want::Cuda(device) = want else {
            return Err(CollectiveError::Protocol(
                "the ranks agreed on NCCL, though this one cannot use it".into(),
            ));
        };
        let mine = match self.world.rank {
            0 => nccl::make_id(),
            _ => Vec::new(),
        };
        let ids = self.allgather(&mine)?;
        let id = nccl::read_id(ids.first().map_or(&[][..], Vec::as_slice))?;
        let formed = Nccl::init(
            id,
            self.world.rank,
            self.world.size,
            device,
            self.options.timeout,
        );
        let formed = match formed {
            Ok(formed) => formed,
            Err(e) => {
                // The others may be waiting in NCCL's formation: they time out there, and this
                // ring is in no known state.
                self.poison(&e);
                return Err(e);
            }
        };
        let version = formed.version().to_string();
        self.nccl = Some(formed);
        Ok(version)
    }

    /// Drops this ring's NCCL communicator (every rank, at the end of its world): a caller that
    /// holds a lock others wait on (Python's) calls it without the lock, since NCCL's teardown
    /// may wait for the other ranks.
    pub fn drop_nccl(&mut self) {
        self.nccl = None;
    }

    /// The NCCL communicator [`use_nccl`](Self::use_nccl) formed, if any.
    pub fn nccl(&self) -> Option<&Nccl> {
        self.nccl.as_ref()
    }

    /// Sums or averages each buffer in GPU memory over all ranks, in place, through NCCL on
    /// `stream`; returns once the stream has done it. Agreed on over the ring first, like every
    /// collective (element counts, types and `fingerprint` must match on every rank).
    ///
    /// # Safety
    /// Each buffer is `count` elements of `dtype` of device memory on the device
    /// [`use_nccl`](Self::use_nccl) named, that nothing frees or resizes until this returns;
    /// `stream` is a live stream of that device, or null (its default stream).
    pub unsafe fn device_allreduce(
        &mut self,
        bufs: &[DeviceBuffer],
        reduce: Reduce,
        stream: Stream,
        fingerprint: u64,
    ) -> Result<()> {
        let header = self.device_header(OpKind::Allreduce, bufs, 0, fingerprint);
        // SAFETY: the caller's promise.
        self.on_device(header, |nccl| unsafe {
            nccl.allreduce(bufs, reduce, stream)
        })
    }

    /// Copies `root`'s buffers in GPU memory into every rank's, through NCCL on `stream`.
    ///
    /// # Safety
    /// As [`device_allreduce`](Self::device_allreduce).
    pub unsafe fn device_broadcast(
        &mut self,
        bufs: &[DeviceBuffer],
        root: u32,
        stream: Stream,
        fingerprint: u64,
    ) -> Result<()> {
        if root >= self.world.size {
            return Err(CollectiveError::Config(format!(
                "broadcast root {root} is not a rank of a world of {}",
                self.world.size
            )));
        }
        let header = self.device_header(OpKind::Broadcast, bufs, root, fingerprint);
        // SAFETY: the caller's promise.
        self.on_device(header, |nccl| unsafe { nccl.broadcast(bufs, root, stream) })
    }

    /// The header of a device collective: every buffer's count and type go into its
    /// fingerprint; the wire byte says NCCL.
    fn device_header(
        &mut self,
        kind: OpKind,
        bufs: &[DeviceBuffer],
        root: u32,
        fingerprint: u64,
    ) -> OpHeader {
        let elements = bufs.iter().map(|b| b.count).sum();
        let described = fingerprint_of(bufs, fingerprint);
        let mut header = self.header(kind, elements, root, described);
        header.wire = NCCL_WIRE;
        header.piece = 0;
        header
    }

    /// Runs a device collective once every rank agreed to it: the headers are gathered from
    /// all ranks, so either every rank starts it or none does (NCCL would wait for the missing
    /// ones). Poisons the ring on failure.
    fn on_device(
        &mut self,
        header: OpHeader,
        op: impl FnOnce(&mut Nccl) -> Result<()>,
    ) -> Result<()> {
        if let Some(why) = &self.poisoned {
            return Err(CollectiveError::Poisoned(why.clone()));
        }
        if self.nccl.is_none() {
            return Err(CollectiveError::Config(
                "NCCL is not set up on this ring: call use_nccl (every rank) first".into(),
            ));
        }
        if self.world.size > 1 {
            let all = self.allgather(&header.encode())?;
            let differs = all.iter().enumerate().find(|(_, h)| **h != header.encode());
            if let Some((rank, theirs)) = differs {
                let theirs = OpHeader::decode(theirs)
                    .map_or_else(|| "a malformed call".to_string(), |h| h.describe());
                let e = CollectiveError::Mismatch(format!(
                    "collective #{} differs between ranks: rank {rank} called {theirs}, rank {} called {}. \
                     Every rank must make the same collective calls, with the same tensors, in the same order",
                    header.seq,
                    self.world.rank,
                    header.describe()
                ));
                self.poison(&e);
                return Err(e);
            }
        }
        let result = match self.nccl.as_mut() {
            Some(nccl) => op(nccl),
            None => Ok(()),
        };
        if let Err(e) = &result {
            self.poison(e);
        }
        result
    }

    fn header(&mut self, kind: OpKind, elements: usize, root: u32, fingerprint: u64) -> OpHeader {
        self.seq += 1;
        OpHeader {
            kind,
            seq: self.seq,
            elements: elements as u64,
            wire: match (kind, self.options.wire) {
                (OpKind::Allreduce, Wire::F16) => 2,
                _ => 1,
            },
            root,
            fingerprint,
            piece: self.options.sub_chunk_bytes.min(u32::MAX as usize) as u32,
        }
    }

    /// Agrees on the call with the neighbours, runs it, and poisons the ring on failure.
    fn run<T>(&mut self, header: OpHeader, body: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        if let Some(why) = &self.poisoned {
            return Err(CollectiveError::Poisoned(why.clone()));
        }
        let result = self.agree(&header).and_then(|()| body(self));
        if let Err(e) = &result {
            self.poison(e);
        }
        result
    }

    fn agree(&mut self, mine: &OpHeader) -> Result<()> {
        let rank = self.world.rank;
        let links = self
            .links
            .as_mut()
            .ok_or(CollectiveError::Config("no links".into()))?;
        links.outbound.send(Kind::Op, 0, &mine.encode())?;
        let h = links.inbound.header()?;
        if h.kind != Kind::Op {
            return Err(CollectiveError::Protocol(format!(
                "rank {} sent {:?} where a collective call was due",
                links.inbound.peer, h.kind
            )));
        }
        let payload = links.inbound.control_payload(h.len)?;
        let theirs = OpHeader::decode(&payload).ok_or_else(|| {
            CollectiveError::Protocol(format!(
                "rank {} sent a malformed collective header",
                links.inbound.peer
            ))
        })?;
        let mut comparable = theirs;
        if mine.kind == OpKind::Allgather {
            comparable.elements = mine.elements;
        }
        if comparable != *mine {
            return Err(CollectiveError::Mismatch(format!(
                "collective #{} differs between ranks: rank {} called {}, rank {rank} called {}. \
                 Every rank must make the same collective calls, with the same tensors, in the same order",
                mine.seq.min(theirs.seq),
                links.inbound.peer,
                theirs.describe(),
                mine.describe()
            )));
        }
        Ok(())
    }

    fn poison(&mut self, error: &CollectiveError) {
        let message = error.to_string();
        tracing::error!("collective failed: {message}");
        self.poisoned = Some(message);
        // NCCL's collectives cannot go on either; aborted, never destroyed (a destroy waits
        // for ranks that may be gone).
        if let Some(nccl) = self.nccl.as_mut() {
            nccl.abort();
        }
        if let Some(mut links) = self.links.take() {
            let (failed, what) = match error {
                CollectiveError::PeerFailed { rank, what } => (Some(*rank), what.clone()),
                CollectiveError::Mismatch(m) => (None, m.clone()),
                other => (None, format!("rank {} failed: {other}", self.world.rank)),
            };
            // Close the inbound side first: a left neighbour still writing to us gets a reset
            // at once instead of waiting out its timeout.
            drop(links.inbound);
            links.outbound.abort(failed, &what);
        }
    }

    /// Runs a plan: this thread receives and reduces, a scoped thread sends.
    fn pipeline<R: Region>(
        &mut self,
        buf: R,
        plan: &Plan,
        wire: Wire,
        factor: Option<f32>,
    ) -> Result<()> {
        let piece = (self.options.sub_chunk_bytes / wire.width()).max(1);
        let links = self
            .links
            .as_mut()
            .ok_or(CollectiveError::Config("no links".into()))?;
        let mut pool = split_into_pieces(buf, plan, piece);
        let (inbound, outbound) = (&mut links.inbound, &mut links.outbound);
        thread::scope(|s| {
            let (to_send, send_queue) = mpsc::channel::<(usize, R)>();
            let (give_back, returned) = mpsc::channel::<(usize, R)>();
            let sender = s.spawn(move || -> Result<()> {
                let mut scratch = Vec::new();
                for (start, region) in send_queue {
                    let len = region.len() * wire.width();
                    outbound.send_data(len, region.wire_bytes(wire), &mut scratch, |buf| {
                        region.encode(buf, wire)
                    })?;
                    if give_back.send((start, region)).is_err() {
                        return Ok(());
                    }
                }
                outbound.settle()
            });

            let received = (|| -> Result<()> {
                for range in &plan.first_sends {
                    for p in pieces(range.clone(), piece) {
                        let region = take(&mut pool, &returned, p.start)?;
                        to_send.send((p.start, region)).map_err(|_| sender_gone())?;
                    }
                }
                let mut scratch: Vec<u32> = Vec::new();
                for step in &plan.receives {
                    for p in pieces(step.range.clone(), piece) {
                        let mut region = take(&mut pool, &returned, p.start)?;
                        let len = p.len() * wire.width();
                        let incoming = inbound.data_header(len as u64)?;
                        // An overwrite lands in place when it can: no scratch copy.
                        let in_place = step.apply == Apply::Overwrite
                            && match region.receive_bytes(wire) {
                                Some(bytes) => {
                                    inbound.data_into(incoming, bytes)?;
                                    true
                                }
                                None => false,
                            };
                        if !in_place {
                            inbound.data_with(incoming, len, &mut scratch, |bytes| {
                                let received = match wire {
                                    Wire::F32 => Received::F32(bytemuck::cast_slice(bytes)),
                                    Wire::F16 => Received::F16(bytemuck::cast_slice(bytes)),
                                };
                                if step.finish && step.apply == Apply::Add {
                                    region.add_and_finish(received, factor, wire)
                                } else {
                                    region.apply(step.apply, received)
                                }
                            })?;
                        }
                        if step.finish && (in_place || step.apply != Apply::Add) {
                            region.finish(factor, wire)?;
                        }
                        if step.forward {
                            to_send.send((p.start, region)).map_err(|_| sender_gone())?;
                        } else {
                            pool.insert(p.start, region);
                        }
                    }
                }
                Ok(())
            })();
            drop(to_send);
            let sent = sender.join().unwrap_or_else(|_| {
                Err(CollectiveError::Config(
                    "the sending thread panicked".into(),
                ))
            });
            // A failed send explains a failed receive better than the other way round only when
            // the receive failed because the sender was gone.
            match (received, sent) {
                (Err(CollectiveError::Config(m)), Err(e)) if m == SENDER_GONE => {
                    // The right neighbour may have closed because of a failure further round
                    // the ring: the abort naming it is then on its way from the left.
                    Err(inbound.pending_abort(Duration::from_secs(2)).unwrap_or(e))
                }
                (Ok(()), Err(e)) => Err(inbound.pending_abort(Duration::from_secs(2)).unwrap_or(e)),
                (received, sent) => received.and(sent),
            }
        })
    }
}

const SENDER_GONE: &str = "the sending thread stopped";

fn sender_gone() -> CollectiveError {
    CollectiveError::Config(SENDER_GONE.into())
}

/// The pieces of `range`: consecutive sub-ranges of at most `piece` elements.
fn pieces(range: Range<usize>, piece: usize) -> impl Iterator<Item = Range<usize>> {
    let end = range.end;
    range
        .step_by(piece)
        .map(move |start| start..(start + piece).min(end))
}

/// Cuts `buf` at every piece boundary of the plan's ranges, keyed by start offset.
fn split_into_pieces<R: Region>(buf: R, plan: &Plan, piece: usize) -> BTreeMap<usize, R> {
    let len = buf.len();
    let mut cuts: Vec<usize> = plan
        .first_sends
        .iter()
        .chain(plan.receives.iter().map(|r| &r.range))
        .flat_map(|r| pieces(r.clone(), piece).map(|p| p.start))
        .filter(|&c| c < len)
        .collect();
    cuts.sort_unstable();
    cuts.dedup();
    let mut pool = BTreeMap::new();
    let mut rest = buf;
    let mut at = 0;
    for &cut in cuts.iter().skip_while(|&&c| c == 0) {
        let (head, tail) = rest.split_at(cut - at);
        pool.insert(at, head);
        rest = tail;
        at = cut;
    }
    pool.insert(at, rest);
    pool
}

/// The piece starting at `start`, waiting for the sender to give it back if it has it.
fn take<R>(
    pool: &mut BTreeMap<usize, R>,
    returned: &mpsc::Receiver<(usize, R)>,
    start: usize,
) -> Result<R> {
    loop {
        if let Some(r) = pool.remove(&start) {
            return Ok(r);
        }
        let (s, r) = returned.recv().map_err(|_| sender_gone())?;
        pool.insert(s, r);
    }
}

/// Chunk `i` of `len` elements cut into `n` near-equal chunks.
fn chunk(i: usize, n: usize, len: usize) -> Range<usize> {
    (len * i / n)..(len * (i + 1) / n)
}

/// Rank r: reduce-scatter sends chunk r−s and adds chunk r−s−1 at step s; it then owns chunk
/// r+1, finishes it, and the allgather sends chunk r+1−s and overwrites chunk r−s.
fn allreduce_plan(rank: usize, n: usize, len: usize) -> Plan {
    let at = |k: isize| chunk(k.rem_euclid(n as isize) as usize, n, len);
    let r = rank as isize;
    let mut receives = Vec::with_capacity(2 * (n - 1));
    for s in 0..n as isize - 1 {
        receives.push(Receive {
            range: at(r - s - 1),
            apply: Apply::Add,
            finish: s == n as isize - 2,
            forward: true,
        });
    }
    for s in 0..n as isize - 1 {
        receives.push(Receive {
            range: at(r - s),
            apply: Apply::Overwrite,
            finish: false,
            forward: s < n as isize - 2,
        });
    }
    Plan {
        first_sends: vec![at(r)],
        receives,
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::link::Links;
    #[cfg(feature = "torch")]
    use crate::region::TensorRegion;
    use std::net::TcpListener;

    /// `n` communicators on loopback, one per thread, running `f`.
    pub(crate) fn with_world<T: Send>(
        n: u32,
        options: CommOptions,
        f: impl Fn(&mut Communicator) -> T + Sync,
    ) -> Vec<T> {
        with_world_options(n, |_| options.clone(), f)
    }

    /// [`with_world`] with options of each rank's own.
    pub(crate) fn with_world_options<T: Send>(
        n: u32,
        options: impl Fn(u32) -> CommOptions,
        f: impl Fn(&mut Communicator) -> T + Sync,
    ) -> Vec<T> {
        let listeners: Vec<TcpListener> = (0..n)
            .map(|_| Links::listen("127.0.0.1:0").unwrap())
            .collect();
        let peers: Vec<String> = listeners
            .iter()
            .map(|l| l.local_addr().unwrap().to_string())
            .collect();
        thread::scope(|s| {
            let handles: Vec<_> = listeners
                .into_iter()
                .enumerate()
                .map(|(rank, listener)| {
                    let world =
                        World::from_peers(peers.clone(), rank as u32, Some("a test ring's secret"))
                            .unwrap();
                    let (options, f) = (options(rank as u32), &f);
                    s.spawn(move || {
                        let links = (n > 1)
                            .then(|| Links::connect(&world, listener, &options.links()).unwrap());
                        let mut comm = Communicator::new(world, links, options).unwrap();
                        f(&mut comm)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    fn data(rank: u32, len: usize) -> Vec<f32> {
        (0..len)
            .map(|i| ((i * 7 + rank as usize * 13) % 101) as f32 * 0.25 - rank as f32)
            .collect()
    }

    fn mean(n: u32, len: usize) -> Vec<f32> {
        let mut sum = vec![0f64; len];
        for r in 0..n {
            for (s, v) in sum.iter_mut().zip(data(r, len)) {
                *s += f64::from(v);
            }
        }
        sum.iter().map(|s| (s / f64::from(n)) as f32).collect()
    }

    #[test]
    fn plans_cover_every_chunk() {
        for n in 2..6 {
            for rank in 0..n {
                let plan = allreduce_plan(rank, n, 1000);
                assert_eq!(plan.receives.len(), 2 * (n - 1));
                let finished: Vec<_> = plan.receives.iter().filter(|r| r.finish).collect();
                assert_eq!(finished.len(), 1);
                assert_eq!(finished[0].range, chunk((rank + 1) % n, n, 1000));
            }
        }
    }

    #[test]
    fn allreduce_is_the_mean_for_small_worlds_and_odd_sizes() {
        for shared_memory in [true, false] {
            allreduce_is_the_mean(CommOptions {
                sub_chunk_bytes: 64, // many pieces per chunk
                shared_memory,
                ..Default::default()
            });
        }
    }

    fn allreduce_is_the_mean(options: CommOptions) {
        for n in 1..=4u32 {
            for len in [1usize, 2, 3, 5, 17, 1000, 4099] {
                let results = with_world(n, options.clone(), |comm| {
                    let mut buf = data(comm.rank(), len);
                    comm.allreduce(&mut buf[..], Reduce::Average, 0).unwrap();
                    buf
                });
                let want = mean(n, len);
                for (rank, got) in results.iter().enumerate() {
                    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                        assert!(
                            (g - w).abs() <= 1e-5 * w.abs().max(1.0),
                            "n={n} len={len} rank={rank} [{i}]: {g} vs {w}"
                        );
                    }
                    assert_eq!(got, &results[0], "every rank holds the same bits");
                }
            }
        }
    }

    #[test]
    fn half_precision_wire_rounds_alike_on_every_rank() {
        let options = CommOptions {
            wire: Wire::F16,
            sub_chunk_bytes: 256,
            ..Default::default()
        };
        let results = with_world(3, options, |comm| {
            let mut buf = data(comm.rank(), 3001);
            comm.allreduce(&mut buf[..], Reduce::Average, 0).unwrap();
            buf
        });
        let want = mean(3, 3001);
        for got in &results {
            assert_eq!(got, &results[0]);
            for (g, w) in got.iter().zip(&want) {
                assert!((g - w).abs() <= 2e-3 * w.abs().max(1.0), "{g} vs {w}");
            }
        }
    }

    #[test]
    fn broadcast_and_allgather() {
        let results = with_world(
            4,
            CommOptions {
                sub_chunk_bytes: 100,
                ..Default::default()
            },
            |comm| {
                let mut buf = data(comm.rank(), 777);
                comm.broadcast(&mut buf[..], 2, 0).unwrap();
                let all = comm
                    .allgather(format!("rank {}", comm.rank()).as_bytes())
                    .unwrap();
                (buf, all)
            },
        );
        for (buf, all) in &results {
            assert_eq!(buf, &data(2, 777));
            let names: Vec<String> = all
                .iter()
                .map(|b| String::from_utf8(b.clone()).unwrap())
                .collect();
            assert_eq!(names, ["rank 0", "rank 1", "rank 2", "rank 3"]);
        }
    }

    #[cfg(feature = "torch")]
    #[test]
    fn tensors_on_the_tch_backend_reduce_like_host_memory() {
        let mut devices = vec![tch::Device::Cpu];
        if tch::Cuda::is_available() {
            devices.push(tch::Device::Cuda(0));
        }
        for device in devices {
            let results = with_world(
                3,
                CommOptions {
                    sub_chunk_bytes: 400,
                    ..Default::default()
                },
                |comm| {
                    let t = tch::Tensor::from_slice(&data(comm.rank(), 2500)).to_device(device);
                    comm.allreduce(TensorRegion::new(&t).unwrap(), Reduce::Average, 0)
                        .unwrap();
                    Vec::<f32>::try_from(&t.to_device(tch::Device::Cpu)).unwrap()
                },
            );
            let want = mean(3, 2500);
            for got in &results {
                for (g, w) in got.iter().zip(&want) {
                    assert!(
                        (g - w).abs() <= 1e-5 * w.abs().max(1.0),
                        "{device:?}: {g} vs {w}"
                    );
                }
            }
        }
    }

    #[test]
    fn ranks_cutting_pieces_differently_are_told_which_option_differs() {
        let results = with_world_options(
            2,
            |rank| CommOptions {
                sub_chunk_bytes: if rank == 0 { 1024 } else { 4096 },
                ..Default::default()
            },
            |comm| {
                let mut buf = vec![1f32; 5000];
                comm.allreduce(&mut buf[..], Reduce::Sum, 0)
                    .map_err(|e| e.to_string())
            },
        );
        for r in results {
            let e = r.unwrap_err();
            assert!(
                e.contains("pieces of 1024 bytes") && e.contains("pieces of 4096 bytes"),
                "{e}"
            );
        }
    }

    #[test]
    fn mismatched_calls_fail_on_every_rank_instead_of_hanging() {
        let results = with_world(
            3,
            CommOptions {
                timeout: Duration::from_secs(10),
                ..Default::default()
            },
            |comm| {
                let len = if comm.rank() == 1 { 101 } else { 100 };
                let mut buf = vec![1f32; len];
                let first = comm
                    .allreduce(&mut buf[..], Reduce::Sum, 0)
                    .map_err(|e| e.to_string());
                let second = comm
                    .allreduce(&mut buf[..], Reduce::Sum, 0)
                    .map_err(|e| e.to_string());
                (first, second)
            },
        );
        let mut explained = 0;
        for (first, second) in &results {
            let first = first.as_ref().unwrap_err();
            if first.contains("differs between ranks") && first.contains("101") {
                explained += 1;
            }
            assert!(
                second.as_ref().unwrap_err().contains("failed earlier"),
                "{second:?}"
            );
        }
        assert!(explained >= 1, "{results:?}");
    }
}
