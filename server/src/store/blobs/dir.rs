//! [`DirBlobs`]: blobs as files under one local data directory, the default (the layout is in
//! the [store's docs](crate::store)).

use std::fs::{self, File};
use std::io::{BufWriter, Read, Seek, SeekFrom, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};

use super::{valid_name, BlobKind, BlobMeta, BlobStore, BlobStream, BlobWriter};
use crate::store::files::{self, io};
use crate::store::StoreError;

/// Blob files under `<dir>/blobs/…` and `<dir>/checkpoints/`.
pub struct DirBlobs {
    dir: PathBuf,
    /// Whether writes are made durable (fsync of the file and its folder); off only for the
    /// memory store's scratch directory, which outlives nothing.
    durable: bool,
}

impl DirBlobs {
    /// Blobs under data directory `dir`, created (private to this user) if needed.
    pub fn open(dir: &Path) -> Result<Self, StoreError> {
        Self::create(dir, true)
    }

    /// Blobs in a scratch directory: written by rename, without fsync.
    pub(crate) fn scratch(dir: &Path) -> Result<Self, StoreError> {
        Self::create(dir, false)
    }

    fn create(dir: &Path, durable: bool) -> Result<Self, StoreError> {
        files::make_private_dir(dir)?;
        for kind in BlobKind::ALL.into_iter().chain([BlobKind::Meta]) {
            let sub = dir.join(kind.folder());
            fs::create_dir_all(&sub).map_err(io(&sub))?;
        }
        Ok(DirBlobs {
            dir: dir.to_path_buf(),
            durable,
        })
    }

    /// The file of blob `name`; a name that could reach outside its folder names nothing.
    pub(crate) fn path(&self, kind: BlobKind, name: &str) -> Result<PathBuf, StoreError> {
        let path = self.dir.join(kind.folder()).join(name);
        if valid_name(name) {
            Ok(path)
        } else {
            Err(StoreError::Io {
                path: path.display().to_string(),
                source: std::io::ErrorKind::NotFound.into(),
            })
        }
    }

    /// Opens a blob's file at the start of `range`; the file and the bytes to read.
    fn open_range(
        &self,
        kind: BlobKind,
        name: &str,
        range: Option<Range<u64>>,
    ) -> Result<(File, u64, u64), StoreError> {
        let path = self.path(kind, name)?;
        let mut file = File::open(&path).map_err(io(&path))?;
        let total = file.metadata().map_err(io(&path))?.len();
        let range = range.unwrap_or(0..total);
        if range.start > range.end || range.end > total {
            return Err(StoreError::Io {
                path: path.display().to_string(),
                source: std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!("range {range:?} is outside the blob's {total} bytes"),
                ),
            });
        }
        file.seek(SeekFrom::Start(range.start)).map_err(io(&path))?;
        Ok((file, range.end - range.start, total))
    }
}

impl BlobStore for DirBlobs {
    fn head(&self, kind: BlobKind, name: &str) -> Result<Option<BlobMeta>, StoreError> {
        if !valid_name(name) {
            return Ok(None);
        }
        let path = self.path(kind, name)?;
        match fs::metadata(&path) {
            Ok(m) => Ok(Some(BlobMeta {
                len: m.len(),
                modified: m.modified().ok(),
            })),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io(&path)(e)),
        }
    }

    fn reader(
        &self,
        kind: BlobKind,
        name: &str,
        range: Option<Range<u64>>,
    ) -> Result<Box<dyn Read + Send>, StoreError> {
        let (file, len, _) = self.open_range(kind, name, range)?;
        Ok(super::file_reader(file, len))
    }

    fn stream(
        &self,
        kind: BlobKind,
        name: &str,
        range: Option<Range<u64>>,
    ) -> Result<BlobStream, StoreError> {
        let (file, len, total) = self.open_range(kind, name, range)?;
        Ok(BlobStream {
            len,
            total,
            stream: super::file_stream(file, len),
        })
    }

    fn writer(&self, kind: BlobKind, name: &str) -> Result<Box<dyn BlobWriter>, StoreError> {
        let path = self.path(kind, name)?;
        let folder = self.dir.join(kind.folder());
        let tmp = folder.join(files::temp_name(""));
        let file = File::create(&tmp).map_err(io(&tmp))?;
        Ok(Box::new(DirWriter {
            file: Some(BufWriter::with_capacity(1 << 20, file)),
            folder,
            tmp,
            path,
            durable: self.durable,
        }))
    }

    /// Written to a temporary file, then hard-linked to its name (which fails if the name is
    /// taken), so it appears whole or not at all.
    fn create(&self, kind: BlobKind, name: &str, bytes: &[u8]) -> Result<bool, StoreError> {
        let path = self.path(kind, name)?;
        let folder = self.dir.join(kind.folder());
        let tmp = folder.join(files::temp_name(""));
        let result = (|| {
            let mut file = File::create(&tmp)?;
            file.write_all(bytes)?;
            if self.durable {
                file.sync_all()?;
            }
            drop(file);
            let linked = match fs::hard_link(&tmp, &path) {
                Ok(()) => true,
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => false,
                Err(e) => return Err(e),
            };
            if linked && self.durable {
                File::open(&folder)?.sync_all()?;
            }
            Ok(linked)
        })();
        let _ = fs::remove_file(&tmp);
        result.map_err(io(&path))
    }

    fn remove(&self, kind: BlobKind, name: &str) -> Result<bool, StoreError> {
        let path = self.path(kind, name)?;
        match fs::remove_file(&path) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(io(&path)(e)),
        }
    }

    fn list(&self, kind: BlobKind) -> Result<Vec<(String, BlobMeta)>, StoreError> {
        let folder = self.dir.join(kind.folder());
        let mut listed = Vec::new();
        for entry in fs::read_dir(&folder).map_err(io(&folder))? {
            let entry = entry.map_err(io(&folder))?;
            let Ok(name) = entry.file_name().into_string() else {
                continue; // not a name this server writes, nor one it could be asked for
            };
            let meta = entry.metadata().map_err(io(&entry.path()))?;
            if meta.is_file() {
                listed.push((
                    name,
                    BlobMeta {
                        len: meta.len(),
                        modified: meta.modified().ok(),
                    },
                ));
            }
        }
        Ok(listed)
    }

    fn shared(&self) -> bool {
        false
    }

    fn describe(&self) -> String {
        self.dir.display().to_string()
    }
}

/// A temporary file in the kind's folder until committed.
struct DirWriter {
    file: Option<BufWriter<File>>,
    folder: PathBuf,
    tmp: PathBuf,
    path: PathBuf,
    durable: bool,
}

impl Write for DirWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.file.as_mut().expect("open until committed").write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.file.as_mut().expect("open until committed").flush()
    }
}

impl BlobWriter for DirWriter {
    /// Flush, fsync, rename, fsync of the folder.
    fn commit(mut self: Box<Self>) -> Result<(), StoreError> {
        let path = self.path.clone();
        let file = self.file.take().expect("committed once");
        let result = (|| {
            let file = file.into_inner().map_err(|e| e.into_error())?;
            if self.durable {
                file.sync_all()?;
            }
            drop(file);
            fs::rename(&self.tmp, &path)?;
            if self.durable {
                File::open(&self.folder)?.sync_all()?;
            }
            Ok(())
        })();
        if result.is_err() {
            let _ = fs::remove_file(&self.tmp);
        }
        result.map_err(io(&path))
    }
}

impl Drop for DirWriter {
    fn drop(&mut self) {
        if self.file.take().is_some() {
            let _ = fs::remove_file(&self.tmp);
        }
    }
}
