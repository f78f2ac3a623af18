//! Blobs as files under one data directory (the layout is in the [module docs](super)): the
//! [`Blobs`] of every store that keeps its blobs on local disk, whatever keeps its records
//! ([`SledStore`](super::SledStore), [`PostgresStore`](super::PostgresStore)). One copy: a store
//! says where its directory is ([`InDataDir`]) and gets the rest.

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use hora_common::model::ModelDigest;

use super::files::{self, io, write_atomic};
use super::{sweep_blobs, Blobs, Referenced, StoreError};

/// A store whose blobs are files under one data directory.
pub(super) trait InDataDir {
    fn data_dir(&self) -> &Path;

    /// Where a checkpoint or masked sum lives.
    fn checkpoint_path(&self, file: &str) -> PathBuf {
        self.data_dir().join("checkpoints").join(file)
    }

    /// Deletes the blob files `refs` does not name (see [`files::sweep_dir`]); `refs` None when
    /// some record could not be read, so that only temporary files go.
    fn sweep_files(&self, refs: Option<Referenced>) -> Result<usize, StoreError> {
        let all_known = refs.is_some();
        let refs = refs.unwrap_or_default();
        let dir = self.data_dir();
        let removed = sweep_blobs(&dir.join("blobs"), &refs, all_known)?;
        Ok(removed
            + files::sweep_dir(
                &dir.join("checkpoints"),
                &refs.checkpoints,
                false,
                all_known,
            )?)
    }
}

/// Creates the data directory (private to this user) and its blob directories, if needed.
pub(super) fn create(dir: &Path) -> Result<(), StoreError> {
    files::make_private_dir(dir)?;
    for sub in [
        "blobs/models",
        "blobs/modules",
        "blobs/strategy",
        "checkpoints",
    ] {
        fs::create_dir_all(dir.join(sub)).map_err(io(dir))?;
    }
    Ok(())
}

impl<T: InDataDir> Blobs for T {
    fn model_path(&self, digest: &ModelDigest) -> PathBuf {
        self.data_dir()
            .join("blobs/models")
            .join(format!("{}.safetensors", digest.to_hex()))
    }

    fn module_path(&self, hex_digest: &str) -> PathBuf {
        self.data_dir()
            .join("blobs/modules")
            .join(format!("{hex_digest}.pt"))
    }

    fn strategy_state_dir(&self) -> PathBuf {
        self.data_dir().join("blobs/strategy")
    }

    fn remove_strategy_state(&self, name: &str) {
        if crate::strategy::state::valid_name(name) {
            let _ = fs::remove_file(self.strategy_state_dir().join(name));
        }
    }

    fn put_model_bytes(&self, digest: &ModelDigest, safetensors: &[u8]) -> Result<(), StoreError> {
        let path = self.model_path(digest);
        if !path.exists() {
            write_atomic(&path, |w| w.write_all(safetensors))?;
        }
        Ok(())
    }

    fn model_bytes(&self, digest: &ModelDigest) -> Result<Vec<u8>, StoreError> {
        let path = self.model_path(digest);
        fs::read(&path).map_err(io(&path))
    }

    fn put_module(&self, bytes: &[u8]) -> Result<String, StoreError> {
        let hex_digest = hora_common::sha256_hex(bytes);
        let path = self.module_path(&hex_digest);
        if !path.exists() {
            write_atomic(&path, |w| w.write_all(bytes))?;
        }
        Ok(hex_digest)
    }

    /// Streams the sum to a temporary file, hashing as it writes, then renames it to its
    /// content address (the sum is the largest thing the server holds: never hold it twice).
    fn write_checkpoint(&self, sum: &[f64]) -> Result<String, StoreError> {
        let dir = self.data_dir().join("checkpoints");
        let tmp_name = files::temp_name("ckpt-");
        let mut hash = ring::digest::Context::new(&ring::digest::SHA256);
        write_atomic(&dir.join(&tmp_name), |w| {
            files::encode_checkpoint(sum, |bytes| {
                hash.update(bytes);
                w.write_all(bytes)
            })
        })?;
        let name = files::checkpoint_name(hash);
        let path = dir.join(&name);
        fs::rename(dir.join(&tmp_name), &path).map_err(io(&path))?;
        File::open(&dir)
            .and_then(|d| d.sync_all())
            .map_err(io(&dir))?;
        Ok(name)
    }

    fn read_checkpoint(&self, file: &str, expected_len: usize) -> Result<Vec<f64>, StoreError> {
        let path = self.checkpoint_path(file);
        let f = File::open(&path).map_err(io(&path))?;
        files::decode_checkpoint(f, file, expected_len, |e| io(&path)(e))
    }

    fn write_masked_sum(&self, sum: &[u32]) -> Result<String, StoreError> {
        let (name, bytes) = files::encode_masked_sum(sum);
        let path = self.checkpoint_path(&name);
        if !path.exists() {
            write_atomic(&path, |w| w.write_all(&bytes))?;
        }
        Ok(name)
    }

    fn read_masked_sum(&self, file: &str, expected_len: usize) -> Result<Vec<u32>, StoreError> {
        let path = self.checkpoint_path(file);
        let bytes = fs::read(&path).map_err(io(&path))?;
        files::decode_masked_sum(&bytes, file, expected_len)
    }

    fn remove_checkpoint(&self, file: &str) {
        let _ = fs::remove_file(self.checkpoint_path(file));
    }
}
