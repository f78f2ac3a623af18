//! Where blobs live: one narrow trait, [`BlobStore`], over a local data directory
//! ([`DirBlobs`], the default) or an object store ([`ObjectBlobs`]: `--blobs file:///dir`, a
//! local or mounted directory, or `--blobs s3://bucket/prefix`); and what the server does with
//! blobs, [`Blobs`], written once on top of it. A blob store belongs to one deployment's
//! records ([`bind`]).
//!
//! A blob is a kind ([`BlobKind`], a folder or key prefix) and a name that proves its contents:
//! a model by its digest, a module or a masked sum by the SHA-256 of its bytes (content
//! addresses), a checkpoint or a strategy state by a trailer of its SHA-256 under a fresh name
//! of its own (known before the bytes, so the blob is written under it). Nothing hands out a local
//! path: readers get a reader or a stream over a byte range, writers stream in, existence is a
//! head request. So any server holding the records reads any blob another wrote.
//!
//! # Safety of writes
//!
//! A blob is visible under its name only whole, and durable before the call that writes it
//! returns (so before any record names it):
//!
//! - [`DirBlobs`]: a temporary file in the kind's folder, fsync, rename, fsync of the folder.
//! - [`ObjectBlobs`]: a put (one request up to [`object::PART_BYTES`], a multipart upload past
//!   it: the parts are invisible until the upload completes) is atomic in every object store;
//!   S3, GCS and Azure acknowledge a put once the object is durably stored (S3: redundantly,
//!   across devices, read-after-write consistent). `file://` writes through `object_store`'s
//!   local store with fsync on (file, then folder) and an atomic rename. Every blob is written
//!   under its final name from the first byte, so no object is ever copied: models and modules
//!   by their digest, checkpoints and strategy states under a fresh random name, with a trailer
//!   of their SHA-256 to prove their contents.
//!
//! A crash leaves at worst an unreferenced blob or a temporary one, which the start-up sweep
//! ([`sweep`]) removes; an abandoned multipart upload's parts are the object store's to expire
//! (an S3 lifecycle rule `AbortIncompleteMultipartUpload`).

use std::io::{Read, Write};
use std::ops::Range;
use std::time::{Duration, SystemTime};

use hora_common::model::{Limits, Model, ModelDigest};

use super::{files, Referenced, StoreError};

mod dir;
pub mod object;
#[cfg(test)]
pub(crate) mod test_s3;

pub use self::dir::DirBlobs;
pub use self::object::{BlobLocation, BlobRetry, ObjectBlobs};

/// What a blob is, and so where it lives: the same folders under a data directory and key
/// prefixes in an object store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BlobKind {
    /// Global models, `<digest hex>.safetensors`.
    Model,
    /// TorchScript modules, `<sha256 hex>.pt`.
    Module,
    /// Stateful strategies' states, `<sha256 hex>.state` (see `strategy::state`).
    StrategyState,
    /// Accumulator checkpoints (`.ckpt`) and secure aggregation's masked sums (`.msum`).
    Checkpoint,
    /// What the blob store says of itself: `store-id`, the id of the records it belongs to
    /// ([`bind`]). Never swept (not in [`BlobKind::ALL`]).
    Meta,
}

impl BlobKind {
    pub const ALL: [BlobKind; 4] = [
        BlobKind::Model,
        BlobKind::Module,
        BlobKind::StrategyState,
        BlobKind::Checkpoint,
    ];

    /// The folder (or key prefix) of this kind's blobs.
    pub fn folder(self) -> &'static str {
        match self {
            BlobKind::Model => "blobs/models",
            BlobKind::Module => "blobs/modules",
            BlobKind::StrategyState => "blobs/strategy",
            BlobKind::Checkpoint => "checkpoints",
            BlobKind::Meta => "blobs/meta",
        }
    }
}

/// The blob naming the records a blob store belongs to, and the records' meta key holding it.
const STORE_ID: &str = "store-id";

/// Whether the blob store answers (a head request for its id), for `/readyz`.
pub fn reachable(blobs: &dyn BlobStore) -> Result<(), StoreError> {
    blobs.head(BlobKind::Meta, STORE_ID).map(drop)
}

/// Ties blobs kept apart from the records (`--blobs`) to those records, with an id written in
/// each: the blob `blobs/meta/store-id` first, then the records' meta `store-id`. A blob store
/// tied to other records is refused (their server's blobs would be swept as unreferenced by
/// this one), and so is a blob store holding blobs but no id while the records have one
/// (`--blobs` changed between runs). Untied records and blobs (a new deployment, or one from
/// before the ids) are tied now; so is an empty blob store to records that have an id (a fresh
/// location). Records with tasks but no id over blobs with one take the blobs' id: the first
/// start with ids, ended between the two writes. The blob's id is created only if absent, so of
/// two new deployments started at once on one new location, one ties it and the other is
/// refused.
pub fn bind(store: &super::Store) -> Result<(), StoreError> {
    // Judged again when another server tied the blobs between our look and our write (once is
    // enough: the id, once there, stays).
    for _ in 0..2 {
        if let Some(bound) = try_bind(store)? {
            return Ok(bound);
        }
    }
    Err(StoreError::Blobs {
        at: store.blobs().describe(),
        reason: "their id changed while this server was reading it: is another server starting on this --blobs location?".into(),
    })
}

/// The id of the records `blobs` belong to, if they were tied to some.
fn marker(blobs: &dyn BlobStore) -> Result<Option<String>, StoreError> {
    Ok(match blobs.head(BlobKind::Meta, STORE_ID)? {
        Some(_) => Some(
            String::from_utf8_lossy(&read_all(blobs, BlobKind::Meta, STORE_ID)?)
                .trim()
                .to_string(),
        ),
        None => None,
    })
}

/// Before a replica whose blobs are files in its own data directory stands by for records in a
/// shared database: whether those files are the records' (the records name blobs that must be
/// here). A data directory tied to other records, or none while the records are tied, is
/// refused at start, saying what to do, instead of when the replica takes over. Reads only:
/// [`bind`] ties a new deployment's once it leads.
pub fn check_unshared(store: &super::Store) -> Result<(), StoreError> {
    let blobs = store.blobs();
    let refused = |why: String| StoreError::Blobs {
        at: blobs.describe(),
        reason: why,
    };
    const WHAT: &str = "a replica without --blobs serves the blobs of its own data directory, so replicas without it must share one --data-dir on one host; otherwise give every replica --blobs (file:///a-shared-dir or s3://…)";
    match (store.meta(STORE_ID)?, marker(blobs)?) {
        (Some(ours), Some(theirs)) if ours != theirs => Err(refused(format!(
            "this data directory's blobs belong to another Hora store (id {theirs}; the database's records are {ours}): {WHAT}"
        ))),
        (Some(ours), None) => Err(refused(format!(
            "the database's records (store {ours}) were written with blobs this data directory does not hold: {WHAT}"
        ))),
        _ => Ok(()),
    }
}

/// Before a replica serves without leading (see `round::replicas`): whether `store`'s blobs are
/// the ones its records were written with, as the replica that led first tied them. Reads only.
pub fn check_tied(store: &super::Store) -> Result<(), StoreError> {
    let blobs = store.blobs();
    match (store.meta(STORE_ID)?, marker(blobs)?) {
        (Some(ours), Some(theirs)) if ours == theirs => Ok(()),
        (ours, theirs) => Err(StoreError::Blobs {
            at: blobs.describe(),
            reason: format!(
                "these blobs are not tied to the database's records yet (records {}, blobs {}): a replica serves without leading only once one has led with the same --blobs",
                ours.as_deref().unwrap_or("not tied"),
                theirs.as_deref().unwrap_or("not tied")
            ),
        }),
    }
}

/// [`bind`], or None when another server wrote the blobs' id first.
fn try_bind(store: &super::Store) -> Result<Option<()>, StoreError> {
    let blobs = store.blobs();
    let refused = |why: String| StoreError::Blobs {
        at: blobs.describe(),
        reason: why,
    };
    let marker = marker(blobs)?;
    let adopt = |id: &str| -> Result<(), StoreError> {
        store.put_meta(STORE_ID, id)?;
        store.flush()
    };
    match (store.meta(STORE_ID)?, marker) {
        (Some(ours), Some(theirs)) if ours == theirs => Ok(Some(())),
        (Some(ours), Some(theirs)) => Err(refused(format!("these blobs belong to another Hora store (id {theirs}; this server's records are {ours}): give each deployment its own --blobs location; sharing one would let each server delete the other's blobs as unreferenced"))),
        (None, Some(theirs)) if !store.tasks()?.is_empty() => adopt(&theirs).map(Some),
        (None, Some(theirs)) => Err(refused(format!("these blobs belong to another Hora store (id {theirs}) and this server's records are new: give this server its own --blobs location (to move a deployment, move its records with its blobs)"))),
        (Some(ours), None) => {
            let used = BlobKind::ALL
                .into_iter()
                .map(|kind| blobs.list(kind).map(|l| l.is_empty()))
                .collect::<Result<Vec<_>, _>>()?;
            if used.contains(&false) {
                return Err(refused(format!("these blobs were not written for this server's records (store {ours}): was --blobs changed since the last run? Point it back at the blobs these records were written with")));
            }
            Ok(blobs
                .create(BlobKind::Meta, STORE_ID, ours.as_bytes())?
                .then_some(()))
        }
        (None, None) => {
            let id = format!("{:032x}", rand::random::<u128>());
            if !blobs.create(BlobKind::Meta, STORE_ID, id.as_bytes())? {
                return Ok(None);
            }
            adopt(&id).map(Some)
        }
    }
}

/// Whether `name` can name a blob: one path segment of safe characters (names come from
/// records and requests; none may reach outside its kind's folder).
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 200
        && name != "."
        && name != ".."
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_'))
}

/// What a head request tells.
#[derive(Debug, Clone, Copy)]
pub struct BlobMeta {
    pub len: u64,
    /// When the blob was written (the sweep spares young ones); None where the store cannot say.
    pub modified: Option<SystemTime>,
}

/// Bytes as an asynchronous response body takes them.
pub type ByteStream =
    futures_util::stream::BoxStream<'static, Result<bytes::Bytes, std::io::Error>>;

/// A reader of the next `len` bytes of `file`, buffered.
fn file_reader(file: std::fs::File, len: u64) -> Box<dyn Read + Send> {
    Box::new(std::io::BufReader::with_capacity(1 << 20, file.take(len)))
}

/// A stream of the next `len` bytes of `file`: concurrent downloads cost a buffer each, not a
/// file read whole each.
fn file_stream(file: std::fs::File, len: u64) -> ByteStream {
    use tokio::io::AsyncReadExt;
    let file = tokio::fs::File::from_std(file).take(len);
    Box::pin(tokio_util::io::ReaderStream::with_capacity(file, 256 << 10))
}

/// A blob (or a range of it) being read as a stream.
pub struct BlobStream {
    /// The bytes the stream yields.
    pub len: u64,
    /// The whole blob's length.
    pub total: u64,
    pub stream: ByteStream,
}

/// A blob being written: [`commit`](BlobWriter::commit) makes it durable under its name;
/// dropped uncommitted, nothing of it stays (a temporary file is removed, a multipart upload
/// aborted).
pub trait BlobWriter: Write + Send {
    /// Makes what was written durable as the blob the writer was started for: visible whole or
    /// not at all. A blob of that name already there is replaced (a name is a content address
    /// or a fresh one: it has the same bytes).
    fn commit(self: Box<Self>) -> Result<(), StoreError>;
}

/// Where blobs are kept. Synchronous, like the stores: called on blocking threads.
pub trait BlobStore: Send + Sync {
    /// The blob's length and age; None if there is none of that name.
    fn head(&self, kind: BlobKind, name: &str) -> Result<Option<BlobMeta>, StoreError>;

    /// Reads `range` of the blob (the whole of it if None), in order. A blob that is not there
    /// is an [`StoreError::Io`] of kind `NotFound`.
    fn reader(
        &self,
        kind: BlobKind,
        name: &str,
        range: Option<Range<u64>>,
    ) -> Result<Box<dyn Read + Send>, StoreError>;

    /// The same bytes as a stream, for a response body: opened here (on a blocking thread),
    /// polled on any runtime.
    fn stream(
        &self,
        kind: BlobKind,
        name: &str,
        range: Option<Range<u64>>,
    ) -> Result<BlobStream, StoreError>;

    /// Starts writing blob `name` of `kind`. Every blob is written under its name from the
    /// first byte (a content address, or a fresh name for a blob that proves its contents by a
    /// trailer): an object store puts it once and never copies it.
    fn writer(&self, kind: BlobKind, name: &str) -> Result<Box<dyn BlobWriter>, StoreError>;

    /// Writes a small blob unless one of that name is there already, atomically (two servers
    /// creating it at once: one wins, and the other is told so); true if this call wrote it.
    fn create(&self, kind: BlobKind, name: &str, bytes: &[u8]) -> Result<bool, StoreError>;

    /// Deletes a blob; false if there was none (where the store can tell).
    fn remove(&self, kind: BlobKind, name: &str) -> Result<bool, StoreError>;

    /// Every blob of `kind`, temporary ones included (their names start with `.tmp-`).
    fn list(&self, kind: BlobKind) -> Result<Vec<(String, BlobMeta)>, StoreError>;

    /// Whether other servers may be writing here too: then the start-up sweep spares every
    /// blob younger than [`SHARED_GRACE`], which another server may be about to record.
    fn shared(&self) -> bool;

    /// Where the blobs are, for messages.
    fn describe(&self) -> String;

    /// Removes what interrupted writes left where [`BlobStore::list`] does not show it; for
    /// the start-up sweep, when nothing is being written. Returns how many.
    fn remove_staged(&self) -> Result<usize, StoreError> {
        Ok(0)
    }
}

/// How young a blob of a shared store must be for the sweep to leave it, whatever the records
/// say: longer than any write and the record that follows it.
pub const SHARED_GRACE: Duration = Duration::from_secs(3600);

/// How young an unreferenced model or module must be for the sweep to keep it: an admin uploads
/// them before creating the task that names them.
pub const UPLOAD_GRACE: Duration = Duration::from_secs(86_400);

fn model_name(digest: &ModelDigest) -> String {
    format!("{}.safetensors", digest.to_hex())
}

fn module_name(hex_digest: &str) -> String {
    format!("{hex_digest}.pt")
}

/// Writes `bytes` as blob `name` of `kind`.
fn put(blobs: &dyn BlobStore, kind: BlobKind, name: &str, bytes: &[u8]) -> Result<(), StoreError> {
    let mut w = blobs.writer(kind, name)?;
    w.write_all(bytes).map_err(files::io_at(name))?;
    w.commit()
}

/// Reads a whole blob.
fn read_all(blobs: &dyn BlobStore, kind: BlobKind, name: &str) -> Result<Vec<u8>, StoreError> {
    let mut bytes = Vec::new();
    blobs
        .reader(kind, name, None)?
        .read_to_end(&mut bytes)
        .map_err(files::io_at(name))?;
    Ok(bytes)
}

/// What the server does with blobs: written once here over [`BlobStore`], for every store.
pub trait Blobs {
    /// Where this store keeps its blobs.
    fn blobs(&self) -> &dyn BlobStore;

    /// Stores f32 safetensors bytes whose digest the caller computed (a no-op if that digest is
    /// there already).
    fn put_model_bytes(&self, digest: &ModelDigest, safetensors: &[u8]) -> Result<(), StoreError> {
        let name = model_name(digest);
        if self.blobs().head(BlobKind::Model, &name)?.is_none() {
            put(self.blobs(), BlobKind::Model, &name, safetensors)?;
        }
        Ok(())
    }

    /// Stores a model under its digest (a no-op if it is there already).
    fn put_model(&self, model: &Model) -> Result<ModelDigest, StoreError> {
        let digest = model.digest();
        self.put_model_bytes(&digest, &model.to_safetensors())?;
        Ok(digest)
    }

    /// Whether model `digest` is stored (a head request).
    fn has_model(&self, digest: &ModelDigest) -> Result<bool, StoreError> {
        Ok(self
            .blobs()
            .head(BlobKind::Model, &model_name(digest))?
            .is_some())
    }

    /// The stored safetensors bytes of a model.
    fn model_bytes(&self, digest: &ModelDigest) -> Result<Vec<u8>, StoreError> {
        read_all(self.blobs(), BlobKind::Model, &model_name(digest))
    }

    fn read_model(&self, digest: &ModelDigest) -> Result<Model, StoreError> {
        Ok(Model::from_safetensors(
            &self.model_bytes(digest)?,
            &Limits::default(),
        )?)
    }

    /// A model's bytes as a stream (a download): those from byte `range.0` to byte `range.1`
    /// (inclusive; the end if None) when they are within the model (the rest of a download
    /// that broke off), else all of them.
    fn model_stream(
        &self,
        digest: &ModelDigest,
        range: Option<(u64, Option<u64>)>,
    ) -> Result<BlobStream, StoreError> {
        let name = model_name(digest);
        let range = match range {
            None | Some((0, None)) => None,
            Some((start, end)) => self
                .blobs()
                .head(BlobKind::Model, &name)?
                .map(|meta| start..end.map_or(meta.len, |e| e.saturating_add(1).min(meta.len)))
                .filter(|r| r.start < r.end),
        };
        self.blobs().stream(BlobKind::Model, &name, range)
    }

    /// Deletes a model's blob; false if there was none.
    fn remove_model(&self, digest: &ModelDigest) -> Result<bool, StoreError> {
        self.blobs().remove(BlobKind::Model, &model_name(digest))
    }

    /// Stores a TorchScript module under the hex SHA-256 of its bytes, which it returns.
    fn put_module(&self, bytes: &[u8]) -> Result<String, StoreError> {
        let hex_digest = hora_common::sha256_hex(bytes);
        let name = module_name(&hex_digest);
        if self.blobs().head(BlobKind::Module, &name)?.is_none() {
            put(self.blobs(), BlobKind::Module, &name, bytes)?;
        }
        Ok(hex_digest)
    }

    /// Whether module `hex_digest` is stored (false for a digest that names no blob).
    fn has_module(&self, hex_digest: &str) -> Result<bool, StoreError> {
        let name = module_name(hex_digest);
        Ok(valid_name(&name) && self.blobs().head(BlobKind::Module, &name)?.is_some())
    }

    /// A module's bytes as a stream (a download).
    fn module_stream(&self, hex_digest: &str) -> Result<BlobStream, StoreError> {
        self.blobs()
            .stream(BlobKind::Module, &module_name(hex_digest), None)
    }

    /// Deletes a strategy state no record refers to any more (nothing for a name that is not a
    /// state's).
    fn remove_strategy_state(&self, name: &str) {
        if crate::strategy::state::valid_name(name) {
            let _ = self.blobs().remove(BlobKind::StrategyState, name);
        }
    }

    /// Writes an accumulator checkpoint (the f64 sum) under a fresh name, which it returns.
    /// The sum is streamed out under that name from the first byte (an object store puts it
    /// once: no copy, whatever its size), hashed as it goes into the trailer that proves it (it
    /// is the largest thing the server holds: never hold it twice).
    fn write_checkpoint(&self, sum: &[f64]) -> Result<String, StoreError> {
        let name = files::fresh_name("ckpt");
        let mut w = self.blobs().writer(BlobKind::Checkpoint, &name)?;
        files::encode_checkpoint(sum, |bytes| w.write_all(bytes))
            .map_err(files::io_at("a new checkpoint"))?;
        w.commit()?;
        Ok(name)
    }

    /// Reads a checkpoint back; corrupt if it does not hold `expected_len` values or its
    /// contents do not match its checksum.
    fn read_checkpoint(&self, file: &str, expected_len: usize) -> Result<Vec<f64>, StoreError> {
        let r = self.blobs().reader(BlobKind::Checkpoint, file, None)?;
        files::decode_checkpoint(r, file, expected_len, files::io_at(file))
    }

    /// Writes the sum of a secure-aggregation attempt's masked inputs, named by the SHA-256 of
    /// its encoding; returns the name.
    fn write_masked_sum(&self, sum: &[u32]) -> Result<String, StoreError> {
        let (name, bytes) = files::encode_masked_sum(sum);
        if self.blobs().head(BlobKind::Checkpoint, &name)?.is_none() {
            put(self.blobs(), BlobKind::Checkpoint, &name, &bytes)?;
        }
        Ok(name)
    }

    /// Writes a serving replica's masked partial sum under a name no other write shares
    /// (salted: see `files`); returns the name. [`read_masked_sum`](Self::read_masked_sum)
    /// reads it.
    fn write_masked_partial(&self, sum: &[u32]) -> Result<String, StoreError> {
        let (name, bytes) = files::encode_masked_partial(sum);
        put(self.blobs(), BlobKind::Checkpoint, &name, &bytes)?;
        Ok(name)
    }

    fn read_masked_sum(&self, file: &str, expected_len: usize) -> Result<Vec<u32>, StoreError> {
        let bytes = read_all(self.blobs(), BlobKind::Checkpoint, file)?;
        files::decode_masked_sum(&bytes, file, expected_len)
    }

    /// Deletes a checkpoint or masked sum (nothing if there is none).
    fn remove_checkpoint(&self, file: &str) {
        let _ = self.blobs().remove(BlobKind::Checkpoint, file);
    }
}

/// Deletes temporary blobs and, when `refs` is known (every task's records could be read),
/// every blob it does not name: except unreferenced models and modules younger than
/// [`UPLOAD_GRACE`], and, in a shared store, anything younger than [`SHARED_GRACE`]. Returns
/// the number of blobs removed. `now` is the sweep's clock.
pub(super) fn sweep(
    blobs: &dyn BlobStore,
    refs: Option<&Referenced>,
    now: SystemTime,
) -> Result<usize, StoreError> {
    let none = Default::default();
    let (refs_known, refs) = match refs {
        Some(r) => (true, r),
        None => (false, &none),
    };
    let younger = |meta: &BlobMeta, limit: Duration| {
        meta.modified
            .map(|m| now.duration_since(m).map(|age| age < limit).unwrap_or(true))
            .unwrap_or(false)
    };
    let mut removed = blobs.remove_staged()?;
    for kind in BlobKind::ALL {
        let (keep, upload_grace): (&std::collections::HashSet<String>, bool) = match kind {
            BlobKind::Model => (&refs.models, true),
            BlobKind::Module => (&refs.modules, true),
            BlobKind::StrategyState => (&refs.states, false),
            BlobKind::Checkpoint => (&refs.checkpoints, false),
            BlobKind::Meta => continue,
        };
        for (name, meta) in blobs.list(kind)? {
            if blobs.shared() && younger(&meta, SHARED_GRACE) {
                continue;
            }
            let temp = name.starts_with(".tmp-");
            let kept = !refs_known
                || keep.contains(&name)
                || (upload_grace && younger(&meta, UPLOAD_GRACE));
            if temp || !kept {
                blobs.remove(kind, &name)?;
                removed += 1;
            }
        }
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::StoreLocation;

    /// A server's store: sled records in `records`, blobs in `blobs` (file://).
    fn open(records: &std::path::Path, blobs: &std::path::Path) -> Result<(), String> {
        let location = BlobLocation::File(blobs.to_path_buf());
        StoreLocation::Sled
            .open(records, &location)
            .map(drop)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn blobs_are_tied_to_their_records_and_another_deployments_are_refused() {
        let [a, b, shared, elsewhere, unmarked] =
            std::array::from_fn(|_| tempfile::tempdir().unwrap());
        // The first server ties the blobs to its records, and finds them again.
        open(a.path(), shared.path()).unwrap();
        open(a.path(), shared.path()).unwrap();
        // A second deployment on the same blobs is refused: it would sweep the first's.
        let refused = open(b.path(), shared.path()).unwrap_err();
        assert!(
            refused.contains("belong to another Hora store"),
            "{refused}"
        );
        // A fresh, empty location is taken by records that have an id...
        open(a.path(), elsewhere.path()).unwrap();
        // ...but one holding blobs and no id is not (--blobs changed between runs).
        let model = hora_common::model::Model::from_tensors([("w", vec![1], vec![1.0])]).unwrap();
        let other = ObjectBlobs::open(&BlobLocation::File(unmarked.path().to_path_buf())).unwrap();
        put(&other, BlobKind::Model, &model_name(&model.digest()), b"x").unwrap();
        drop(other);
        let refused = open(a.path(), unmarked.path()).unwrap_err();
        assert!(refused.contains("was --blobs changed"), "{refused}");
        // The sweep leaves the id alone, and removes what an interrupted write left staged
        // (`object_store` hides such files from listings).
        let staged = shared
            .path()
            .join(BlobKind::Checkpoint.folder())
            .join("a.ckpt#12");
        std::fs::create_dir_all(staged.parent().unwrap()).unwrap();
        std::fs::write(&staged, b"half a checkpoint").unwrap();
        let store = StoreLocation::Sled
            .open(a.path(), &BlobLocation::File(shared.path().to_path_buf()))
            .unwrap();
        assert_eq!(store.sweep_orphans().unwrap(), 1);
        assert!(!staged.exists());
        drop(store);
        open(a.path(), shared.path()).unwrap();
    }
}
