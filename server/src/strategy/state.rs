//! A stateful strategy's state in the blob store, streamed stretch by stretch.
//!
//! One blob per published round, under a fresh name, with a trailer of the SHA-256 of every byte
//! before it (so a torn or altered blob is caught on reading):
//!
//! ```text
//! blobs/strategy/<32 hex>.state
//!     "HORASTA2"  u64 parameters  u64 values per parameter  f32 values, little-endian,
//!                                                             parameter-major (m₀ v₀ m₁ v₁ …)
//!     SHA-256 of all the above
//! ```
//!
//! (States of earlier versions, `"HORASTA1"` without the trailer, are named `<64 hex>.state` by
//! the SHA-256 of their bytes, and still read.)
//!
//! A round reads the previous blob and writes the next one in step with the model's stretches
//! ([`FileState`]), so its memory is one stretch of state, whatever the model size. The next
//! blob streams into the blob store under its name from the first byte (an object store puts it
//! once, never copies it) and is visible only once complete ([`StateWriter::commit`]: durable,
//! whole or not at all); the caller then records its name in the transaction that publishes the
//! model, and deletes the previous blob after that is flushed. A crash in between leaves an
//! unreferenced blob, which the start-up sweep removes.

use std::io::{BufReader, Read, Write};

use ring::digest::{Context, SHA256};

use super::{StateStretches, Strategy};
use crate::store::files::{fresh_name, Sealing};
use crate::store::{short_or_carried, BlobKind, BlobStore, StoreError};

const MAGIC: &[u8; 8] = b"HORASTA2";
/// States of earlier versions: no trailer, named by their SHA-256.
const MAGIC_V1: &[u8; 8] = b"HORASTA1";

fn io_error(name: &str) -> impl FnOnce(std::io::Error) -> StoreError + '_ {
    move |source| StoreError::Io {
        path: format!("{}/{name}", BlobKind::StrategyState.folder()),
        source,
    }
}

fn corrupt(name: &str, reason: impl Into<String>) -> StoreError {
    StoreError::Corrupt {
        key: format!("strategy state {name}"),
        reason: reason.into(),
    }
}

/// Whether `name` could be a state file's name (the sweep and the loaders check it before
/// touching a path built from a stored record).
pub fn valid_name(name: &str) -> bool {
    name.strip_suffix(".state").is_some_and(|hex| {
        matches!(hex.len(), 32 | 64) && hex.bytes().all(|b| b.is_ascii_hexdigit())
    })
}

/// Reads a state file in order, hashing as it goes; [`StateReader::finish`] checks the trailer
/// (or an earlier version's content address) once everything is read.
pub struct StateReader {
    name: String,
    file: BufReader<Box<dyn Read + Send>>,
    sealing: Sealing,
    /// f32 values not yet read.
    remaining: u64,
    bytes: Vec<u8>,
}

impl StateReader {
    /// Opens state `name` and checks that it holds `parameters` × `per_parameter` values.
    pub fn open(
        blobs: &dyn BlobStore,
        name: &str,
        parameters: usize,
        per_parameter: usize,
    ) -> Result<Self, StoreError> {
        if !valid_name(name) {
            return Err(corrupt(name, "not a state file name"));
        }
        let mut file =
            BufReader::with_capacity(1 << 20, blobs.reader(BlobKind::StrategyState, name, None)?);
        let mut header = [0u8; 24];
        file.read_exact(&mut header)
            .map_err(|e| short_or_carried(e, || corrupt(name, "shorter than its header")))?;
        let word = |i: usize| u64::from_le_bytes(header[i..i + 8].try_into().expect("8 bytes"));
        let trailer = match &header[..8] {
            m if m == MAGIC => true,
            m if m == MAGIC_V1 => false,
            _ => return Err(corrupt(name, "not a strategy state")),
        };
        if word(8) != parameters as u64 || word(16) != per_parameter as u64 {
            return Err(corrupt(
                name,
                format!(
                    "expected {parameters} parameters × {per_parameter} values, the header says {} × {}",
                    word(8),
                    word(16)
                ),
            ));
        }
        let mut sealing = Sealing::new(trailer);
        sealing.hash.update(&header);
        Ok(StateReader {
            name: name.to_string(),
            file,
            sealing,
            remaining: (parameters * per_parameter) as u64,
            bytes: Vec::new(),
        })
    }

    /// Fills `into` with the next values.
    pub fn read(&mut self, into: &mut [f32]) -> Result<(), StoreError> {
        if into.len() as u64 > self.remaining {
            return Err(corrupt(&self.name, "read past the end of the state"));
        }
        self.bytes.resize(into.len() * 4, 0);
        self.file
            .read_exact(&mut self.bytes)
            .map_err(|e| short_or_carried(e, || corrupt(&self.name, "truncated")))?;
        self.sealing.hash.update(&self.bytes);
        for (v, b) in into.iter_mut().zip(self.bytes.chunks_exact(4)) {
            *v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }
        self.remaining -= into.len() as u64;
        Ok(())
    }

    /// Checks that every value was read, then the trailer (or an earlier version's name), and
    /// that nothing follows.
    pub fn finish(self) -> Result<(), StoreError> {
        if self.remaining != 0 {
            return Err(corrupt(&self.name, "not read to the end"));
        }
        self.sealing
            .check(self.file, &self.name, "state")
            .map_err(|e| short_or_carried(e, || corrupt(&self.name, "unreadable")))?
            .map_err(|reason| corrupt(&self.name, reason))
    }
}

/// Reads a whole state file to check it (at start-up: a damaged state makes its task unavailable
/// with a clear reason, rather than failing every round close later). Memory: one buffer.
pub fn verify(
    blobs: &dyn BlobStore,
    name: &str,
    parameters: usize,
    per_parameter: usize,
) -> Result<(), StoreError> {
    let mut reader = StateReader::open(blobs, name, parameters, per_parameter)?;
    let mut buf = vec![0f32; 1 << 16];
    while reader.remaining > 0 {
        let n = (reader.remaining as usize).min(buf.len());
        reader.read(&mut buf[..n])?;
    }
    reader.finish()
}

/// Writes a new state blob under a fresh name, visible at [`StateWriter::commit`]. Dropped
/// uncommitted (an aggregation that failed), nothing of it stays.
pub struct StateWriter {
    name: String,
    blob: Box<dyn crate::store::blobs::BlobWriter>,
    hash: Context,
    bytes: Vec<u8>,
}

impl StateWriter {
    pub fn create(
        blobs: &dyn BlobStore,
        parameters: usize,
        per_parameter: usize,
    ) -> Result<Self, StoreError> {
        let name = fresh_name("state");
        let mut writer = StateWriter {
            blob: blobs.writer(BlobKind::StrategyState, &name)?,
            name,
            hash: Context::new(&SHA256),
            bytes: Vec::new(),
        };
        let mut header = MAGIC.to_vec();
        header.extend((parameters as u64).to_le_bytes());
        header.extend((per_parameter as u64).to_le_bytes());
        writer.put(&header)?;
        Ok(writer)
    }

    fn put(&mut self, bytes: &[u8]) -> Result<(), StoreError> {
        self.hash.update(bytes);
        self.blob
            .write_all(bytes)
            .map_err(io_error("a new strategy state"))
    }

    /// Appends the next values.
    pub fn write(&mut self, values: &[f32]) -> Result<(), StoreError> {
        let mut bytes = std::mem::take(&mut self.bytes);
        bytes.clear();
        bytes.extend(values.iter().flat_map(|v| v.to_le_bytes()));
        let written = self.put(&bytes);
        self.bytes = bytes;
        written
    }

    /// Appends the trailer, makes the blob durable and visible, and returns its name.
    pub fn commit(mut self) -> Result<String, StoreError> {
        let trailer = std::mem::replace(&mut self.hash, Context::new(&SHA256)).finish();
        self.blob
            .write_all(trailer.as_ref())
            .map_err(io_error("a new strategy state"))?;
        self.blob.commit()?;
        Ok(self.name)
    }
}

/// One round's state stretches, streamed from the previous file (or the strategy's initial
/// state before the first round) into the next.
pub struct FileState<'a> {
    strategy: &'a dyn Strategy,
    previous: Option<StateReader>,
    next: StateWriter,
    buf: Vec<f32>,
}

impl<'a> FileState<'a> {
    pub fn open(
        strategy: &'a dyn Strategy,
        blobs: &dyn BlobStore,
        previous: Option<&str>,
        parameters: usize,
    ) -> Result<Self, StoreError> {
        let per = strategy.state_per_parameter();
        Ok(FileState {
            strategy,
            previous: previous
                .map(|name| StateReader::open(blobs, name, parameters, per))
                .transpose()?,
            next: StateWriter::create(blobs, parameters, per)?,
            buf: Vec::new(),
        })
    }

    /// Checks the previous file was what its name says, then makes the next one durable and
    /// returns its name.
    pub fn commit(self) -> Result<String, StoreError> {
        if let Some(previous) = self.previous {
            previous.finish()?;
        }
        self.next.commit()
    }
}

impl StateStretches for FileState<'_> {
    fn next(&mut self, parameters: usize) -> Result<&mut [f32], StoreError> {
        self.buf
            .resize(parameters * self.strategy.state_per_parameter(), 0.0);
        match &mut self.previous {
            Some(reader) => reader.read(&mut self.buf)?,
            None => self.strategy.initial_state(&mut self.buf),
        }
        Ok(&mut self.buf)
    }

    fn done(&mut self) -> Result<(), StoreError> {
        self.next.write(&self.buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::DirBlobs;

    #[test]
    fn state_files_round_trip_and_damage_is_caught() {
        let dir = tempfile::tempdir().unwrap();
        let blobs = DirBlobs::open(dir.path()).unwrap();
        let values: Vec<f32> = (0..10).map(|i| i as f32 * 0.5 - 1.0).collect();
        let mut w = StateWriter::create(&blobs, 5, 2).unwrap();
        w.write(&values[..3]).unwrap();
        w.write(&values[3..]).unwrap();
        let name = w.commit().unwrap();
        assert!(valid_name(&name), "{name}");
        verify(&blobs, &name, 5, 2).unwrap();

        let mut r = StateReader::open(&blobs, &name, 5, 2).unwrap();
        let mut got = vec![0f32; 10];
        r.read(&mut got[..4]).unwrap();
        r.read(&mut got[4..]).unwrap();
        r.finish().unwrap();
        assert_eq!(got, values);

        // Wrong layout, missing values, a flipped bit, a bad name: all refused.
        assert!(StateReader::open(&blobs, &name, 10, 1).is_err());
        let mut r = StateReader::open(&blobs, &name, 5, 2).unwrap();
        r.read(&mut got[..4]).unwrap();
        assert!(r.finish().is_err());
        let path = blobs.path(BlobKind::StrategyState, &name).unwrap();
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[30] ^= 1;
        assert!(corrupt_once(&blobs, &name, &bytes, (5, 2)));
        assert!(StateReader::open(&blobs, "../x.state", 5, 2).is_err());
        // Torn: the trailer cut short.
        bytes[30] ^= 1;
        assert!(corrupt_once(
            &blobs,
            &name,
            &bytes[..bytes.len() - 5],
            (5, 2)
        ));
    }

    /// Whether state `name`, once its file holds `bytes`, is refused as corrupt (laid out as
    /// `layout`: parameters × values per parameter).
    fn corrupt_once(blobs: &DirBlobs, name: &str, bytes: &[u8], layout: (usize, usize)) -> bool {
        let path = blobs.path(BlobKind::StrategyState, name).unwrap();
        std::fs::write(path, bytes).unwrap();
        matches!(
            verify(blobs, name, layout.0, layout.1),
            Err(StoreError::Corrupt { .. })
        )
    }

    #[test]
    fn states_of_the_first_format_named_by_their_hash_still_read() {
        let dir = tempfile::tempdir().unwrap();
        let blobs = DirBlobs::open(dir.path()).unwrap();
        let mut bytes = MAGIC_V1.to_vec();
        bytes.extend(2u64.to_le_bytes());
        bytes.extend(1u64.to_le_bytes());
        bytes.extend([0.5f32, -1.0].iter().flat_map(|v| v.to_le_bytes()));
        let name = format!("{}.state", hora_common::sha256_hex(&bytes));
        assert!(valid_name(&name));
        let mut w = blobs.writer(BlobKind::StrategyState, &name).unwrap();
        w.write_all(&bytes).unwrap();
        w.commit().unwrap();
        let mut r = StateReader::open(&blobs, &name, 2, 1).unwrap();
        let mut got = [0f32; 2];
        r.read(&mut got).unwrap();
        r.finish().unwrap();
        assert_eq!(got, [0.5, -1.0]);
        // A flipped bit no longer matches the name.
        bytes[26] ^= 1;
        assert!(corrupt_once(&blobs, &name, &bytes, (2, 1)));
    }

    #[test]
    fn an_uncommitted_writer_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let blobs = DirBlobs::open(dir.path()).unwrap();
        let mut w = StateWriter::create(&blobs, 2, 1).unwrap();
        w.write(&[1.0, 2.0]).unwrap();
        drop(w);
        assert!(blobs.list(BlobKind::StrategyState).unwrap().is_empty());
    }
}
