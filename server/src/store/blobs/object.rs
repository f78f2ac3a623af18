//! [`ObjectBlobs`]: blobs in an object store through the `object_store` crate, where every
//! server of a deployment can read what any other wrote: `--blobs file:///dir` (a directory,
//! local or shared: NFS, a mounted volume) or `--blobs s3://bucket/prefix` (AWS S3 or any
//! S3-compatible server, `--blobs-endpoint`).
//!
//! The keys are the data directory's paths (`blobs/models/<hex>.safetensors`, …) under the
//! prefix. `object_store` is asynchronous and the stores are not: each call runs on the blob
//! store's own small runtime and is waited for on a channel, as the PostgreSQL store does
//! (`postgres::driver`). Writes stream: up to [`PART_BYTES`] they are one put, past it a
//! multipart upload of [`PART_BYTES`] parts, a few in flight; reads stream too, a chunk at a
//! time.

use std::fmt;
use std::future::Future;
use std::io::{Read, Seek, SeekFrom, Write};
use std::ops::Range;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;

use bytes::Bytes;
use futures_util::{StreamExt, TryStreamExt};
use object_store::path::Path as Key;
use object_store::{GetOptions, GetRange, GetResultPayload, ObjectStore, ObjectStoreExt};

use super::{valid_name, BlobKind, BlobMeta, BlobStore, BlobStream, BlobWriter, ByteStream};
use crate::store::StoreError;

/// The size of a multipart upload's parts, and the most a write holds before it starts one
/// (S3 wants parts of at least 5 MiB).
pub const PART_BYTES: usize = 8 << 20;
/// Parts in flight per upload: a writer holds at most this many parts and one being filled.
const PARTS_IN_FLIGHT: usize = 4;

/// Where the blobs are, as `--blobs` names them. `Debug` is `Display`: the endpoint's
/// credentials masked.
#[derive(Clone, Default, PartialEq, Eq)]
pub enum BlobLocation {
    /// Files under the data directory (the default).
    #[default]
    DataDir,
    /// `file:///dir`: a directory (local, or a mounted volume) through `object_store`'s local
    /// store (fsync on).
    File(PathBuf),
    /// `s3://bucket[/prefix]`: credentials and region from the usual AWS environment
    /// variables; `endpoint` (`--blobs-endpoint`) for an S3-compatible server; how requests
    /// that fail are retried (`--blobs-retries`, `--blobs-retry-secs`).
    S3 {
        bucket: String,
        prefix: String,
        endpoint: Option<String>,
        retry: BlobRetry,
    },
}

/// How a request to an object store that failed (a 5xx, a dropped connection) is retried
/// before the caller hears of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlobRetry {
    /// Retries of one request (`--blobs-retries`, 3).
    pub max_retries: usize,
    /// The most time spent retrying one request, in seconds (`--blobs-retry-secs`, 15). A
    /// store that is down is answered 503 after this, and the callers retry by themselves
    /// (clients, the group commit, a round's close): longer rides out longer blips, shorter
    /// tells clients sooner.
    pub timeout_secs: u64,
}

impl Default for BlobRetry {
    fn default() -> Self {
        BlobRetry {
            max_retries: 3,
            timeout_secs: 15,
        }
    }
}

impl FromStr for BlobLocation {
    type Err = String;

    fn from_str(url: &str) -> Result<Self, String> {
        if let Some(path) = url.strip_prefix("file://") {
            if !path.starts_with('/') {
                return Err(format!(
                    "`{url}`: give an absolute directory, file:///path/to/blobs"
                ));
            }
            return Ok(BlobLocation::File(PathBuf::from(path)));
        }
        if let Some(rest) = url.strip_prefix("s3://") {
            let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
            if bucket.is_empty() {
                return Err(format!(
                    "`{url}` names no bucket: give s3://bucket or s3://bucket/prefix"
                ));
            }
            return Ok(BlobLocation::S3 {
                bucket: bucket.to_string(),
                prefix: prefix.trim_matches('/').to_string(),
                endpoint: None,
                retry: BlobRetry::default(),
            });
        }
        Err(format!(
            "unknown blob store `{url}`: give file:///path/to/dir (a directory, local or shared) or s3://bucket/prefix (with --blobs-endpoint for an S3-compatible server); without --blobs, blobs are files under the data directory"
        ))
    }
}

impl fmt::Debug for BlobLocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for BlobLocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BlobLocation::DataDir => f.write_str("the data directory"),
            BlobLocation::File(dir) => write!(f, "file://{}", dir.display()),
            BlobLocation::S3 {
                bucket,
                prefix,
                endpoint,
                ..
            } => {
                write!(f, "s3://{bucket}/{prefix}")?;
                match endpoint {
                    // Masked: an endpoint may carry credentials.
                    Some(e) => write!(f, " at {}", hora_common::config::mask_password(e)),
                    None => Ok(()),
                }
            }
        }
    }
}

impl BlobLocation {
    /// With the endpoint `--blobs-endpoint` names (for `s3://` only).
    pub fn with_endpoint(self, endpoint: Option<String>) -> Result<Self, String> {
        match (self, endpoint) {
            (location, None) => Ok(location),
            (
                BlobLocation::S3 {
                    bucket,
                    prefix,
                    retry,
                    ..
                },
                Some(endpoint),
            ) => Ok(BlobLocation::S3 {
                bucket,
                prefix,
                endpoint: Some(endpoint),
                retry,
            }),
            (_, Some(_)) => Err("--blobs-endpoint is for --blobs s3://…".into()),
        }
    }

    /// With the retries `--blobs-retries` and `--blobs-retry-secs` say (for `s3://` only).
    pub fn with_retry(self, retries: Option<usize>, secs: Option<u64>) -> Result<Self, String> {
        match (self, retries.is_some() || secs.is_some()) {
            (location, false) => Ok(location),
            (
                BlobLocation::S3 {
                    bucket,
                    prefix,
                    endpoint,
                    retry,
                },
                true,
            ) => {
                let retry = BlobRetry {
                    max_retries: retries.unwrap_or(retry.max_retries),
                    timeout_secs: secs.unwrap_or(retry.timeout_secs),
                };
                if retry.max_retries > 100 || !(1..=3600).contains(&retry.timeout_secs) {
                    return Err(format!(
                        "--blobs-retries {} and --blobs-retry-secs {}: give 0 to 100 retries within 1 to 3600 s",
                        retry.max_retries, retry.timeout_secs
                    ));
                }
                Ok(BlobLocation::S3 {
                    bucket,
                    prefix,
                    endpoint,
                    retry,
                })
            }
            (_, true) => {
                Err("--blobs-retries and --blobs-retry-secs are for --blobs s3://…".into())
            }
        }
    }

    /// Opens the blobs: `data_dir`'s files for [`BlobLocation::DataDir`].
    pub fn open(&self, data_dir: &std::path::Path) -> Result<Arc<dyn BlobStore>, StoreError> {
        Ok(match self {
            BlobLocation::DataDir => Arc::new(super::DirBlobs::open(data_dir)?),
            _ => Arc::new(ObjectBlobs::open(self)?),
        })
    }
}

/// Blobs in an object store.
pub struct ObjectBlobs {
    store: Arc<dyn ObjectStore>,
    /// Some until dropped (then shut down without waiting, as the PostgreSQL store's).
    runtime: Option<tokio::runtime::Runtime>,
    shown: String,
    /// The directory of a `file://` store, whose staged writes the sweep looks for.
    local: Option<PathBuf>,
}

impl ObjectBlobs {
    pub fn open(location: &BlobLocation) -> Result<Self, StoreError> {
        let shown = location.to_string();
        let failed = |reason: String| StoreError::Blobs {
            at: shown.clone(),
            reason,
        };
        match location {
            BlobLocation::DataDir => Err(failed("the data directory's blobs are DirBlobs".into())),
            BlobLocation::File(dir) => {
                crate::store::files::make_private_dir(dir)?;
                let local = object_store::local::LocalFileSystem::new_with_prefix(dir)
                    .map_err(|e| failed(e.to_string()))?
                    .with_fsync(true)
                    .with_automatic_cleanup(false);
                let mut blobs = Self::with_store(Arc::new(local), shown)?;
                blobs.local = Some(dir.clone());
                Ok(blobs)
            }
            BlobLocation::S3 {
                bucket,
                prefix,
                endpoint,
                retry,
            } => {
                let builder = object_store::aws::AmazonS3Builder::from_env();
                Self::open_s3(bucket, prefix, endpoint.as_deref(), *retry, builder)
            }
        }
    }

    /// Blobs in S3 bucket `bucket` under `prefix`, at `endpoint` (an S3-compatible server) or
    /// AWS's; `builder` holds the credentials and region (from the environment, for the server).
    pub fn open_s3(
        bucket: &str,
        prefix: &str,
        endpoint: Option<&str>,
        retry: BlobRetry,
        mut builder: object_store::aws::AmazonS3Builder,
    ) -> Result<Self, StoreError> {
        let shown = BlobLocation::S3 {
            bucket: bucket.into(),
            prefix: prefix.into(),
            endpoint: endpoint.map(Into::into),
            retry,
        }
        .to_string();
        let failed = |reason: String| StoreError::Blobs {
            at: shown.clone(),
            reason,
        };
        builder = builder.with_bucket_name(bucket);
        if let Some(endpoint) = endpoint {
            let url = reqwest::Url::parse(endpoint)
                .map_err(|e| failed(format!("--blobs-endpoint `{endpoint}`: {e}")))?;
            // Plain http only to this machine (an S3-compatible server next to the server, as
            // the tests run one); AWS_ALLOW_HTTP=true opts in elsewhere.
            let loopback = match url.host_str() {
                Some("localhost") => true,
                Some(host) => host
                    .trim_matches(['[', ']'])
                    .parse::<std::net::IpAddr>()
                    .is_ok_and(|a| a.is_loopback()),
                None => false,
            };
            if url.scheme() == "http" && loopback {
                builder = builder.with_allow_http(true);
            }
            builder = builder.with_endpoint(endpoint);
        }
        // A transfer lasts as long as its reader's pace (a download to a slow client) or the
        // object's size (a multipart upload's part): no limit on a whole request, unless the operator
        // set one (AWS_TIMEOUT); a connection quiet for a minute is given up instead.
        use object_store::aws::AmazonS3ConfigKey::Client;
        use object_store::ClientConfigKey;
        for (key, value) in [
            (ClientConfigKey::Timeout, "24h"),
            (ClientConfigKey::ReadTimeout, "60s"),
        ] {
            if builder.get_config_value(&Client(key)).is_none() {
                builder = builder.with_config(Client(key), value);
            }
        }
        // A store that is down is answered 503 within seconds (`retry`), not after
        // object_store's three minutes of retries: the callers retry by themselves (clients,
        // the group commit, a round's close).
        if builder
            .get_config_value(&Client(ClientConfigKey::ConnectTimeout))
            .is_none()
        {
            builder = builder.with_config(Client(ClientConfigKey::ConnectTimeout), "5s");
        }
        builder = builder.with_retry(object_store::RetryConfig {
            max_retries: retry.max_retries,
            retry_timeout: std::time::Duration::from_secs(retry.timeout_secs),
            ..Default::default()
        });
        // object_store's HTTP client is reqwest with rustls and no provider of its own: it takes
        // the process's default, which is ring (the only provider in the tree) unless one was
        // installed already.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let s3 = builder.build().map_err(|e| failed(e.to_string()))?;
        let store: Arc<dyn ObjectStore> = if prefix.is_empty() {
            Arc::new(s3)
        } else {
            Arc::new(object_store::prefix::PrefixStore::new(
                s3,
                Key::from(prefix),
            ))
        };
        Self::with_store(store, shown)
    }

    /// Blobs in `store`, `shown` in messages.
    pub fn with_store(store: Arc<dyn ObjectStore>, shown: String) -> Result<Self, StoreError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("hora-blobs")
            .enable_all()
            .build()
            .map_err(|source| StoreError::Io {
                path: "the blob store's runtime".into(),
                source,
            })?;
        Ok(ObjectBlobs {
            store,
            runtime: Some(runtime),
            shown,
            local: None,
        })
    }

    fn handle(&self) -> &tokio::runtime::Handle {
        self.runtime
            .as_ref()
            .expect("the runtime lives until the blobs are dropped")
            .handle()
    }

    fn key(&self, kind: BlobKind, name: &str) -> Result<Key, StoreError> {
        if !valid_name(name) {
            return Err(missing(&format!("{}/{name}", kind.folder())));
        }
        Ok(Key::from(kind.folder()).join(name))
    }

    fn error(&self, key: &Key) -> impl Fn(object_store::Error) -> StoreError + '_ {
        let key = key.to_string();
        move |e| match e {
            object_store::Error::NotFound { .. } => missing(&key),
            e => StoreError::Blobs {
                at: self.shown.clone(),
                reason: format!("{key}: {e}"),
            },
        }
    }
}

/// What reading a blob that is not there gives, as a missing file does.
fn missing(key: &str) -> StoreError {
    StoreError::Io {
        path: key.to_string(),
        source: std::io::ErrorKind::NotFound.into(),
    }
}

/// The longest one call to the blob store may take (a part's upload, a listing), its retries
/// included: a store that stops answering holds a blocking
/// thread (and whatever lock its caller holds) no longer.
const CALL_LIMIT: std::time::Duration = std::time::Duration::from_secs(300);

/// Runs `work` on `handle`'s runtime and waits for it, from any thread (as
/// `postgres::driver::Driver::run` does), for at most [`CALL_LIMIT`].
fn run<T, F>(handle: &tokio::runtime::Handle, work: F) -> Result<T, object_store::Error>
where
    F: Future<Output = Result<T, object_store::Error>> + Send + 'static,
    T: Send + 'static,
{
    let (answer, answered) = std::sync::mpsc::sync_channel(1);
    handle.spawn(async move {
        let answered = tokio::time::timeout(CALL_LIMIT, work)
            .await
            .unwrap_or_else(|_| {
                Err(object_store::Error::Generic {
                    store: "blobs",
                    source: format!(
                        "no answer within {} s: check that the blob store is up and reachable",
                        CALL_LIMIT.as_secs()
                    )
                    .into(),
                })
            });
        let _ = answer.send(answered);
    });
    answered.recv().unwrap_or_else(|_| {
        Err(object_store::Error::Generic {
            store: "blobs",
            source: "the blob store's runtime ended the call without an answer".into(),
        })
    })
}

/// Bytes read from a local file at the start of a range, or from the object store's stream.
enum Payload {
    File(std::fs::File, u64),
    Stream(ByteStream),
}

impl ObjectBlobs {
    fn get(
        &self,
        kind: BlobKind,
        name: &str,
        range: Option<Range<u64>>,
    ) -> Result<(Payload, u64, u64), StoreError> {
        let key = self.key(kind, name)?;
        let store = self.store.clone();
        let options = GetOptions {
            range: range.map(GetRange::Bounded),
            ..Default::default()
        };
        let at = key.clone();
        let got = run(
            self.handle(),
            async move { store.get_opts(&at, options).await },
        )
        .map_err(self.error(&key))?;
        let (len, total) = (got.range.end - got.range.start, got.meta.size);
        let payload = match got.payload {
            GetResultPayload::File(mut file, path) => {
                file.seek(SeekFrom::Start(got.range.start))
                    .map_err(crate::store::files::io(&path))?;
                Payload::File(file, len)
            }
            GetResultPayload::Stream(stream) => Payload::Stream(
                stream
                    .map_err({
                        let (at, key) = (self.shown.clone(), key.to_string());
                        move |e| {
                            std::io::Error::other(StoreError::Blobs {
                                at: at.clone(),
                                reason: format!("reading {key}: {e}"),
                            })
                        }
                    })
                    .boxed(),
            ),
        };
        Ok((payload, len, total))
    }
}

impl BlobStore for ObjectBlobs {
    fn head(&self, kind: BlobKind, name: &str) -> Result<Option<BlobMeta>, StoreError> {
        if !valid_name(name) {
            return Ok(None);
        }
        let key = self.key(kind, name)?;
        let store = self.store.clone();
        let at = key.clone();
        match run(self.handle(), async move { store.head(&at).await }) {
            Ok(meta) => Ok(Some(BlobMeta {
                len: meta.size,
                modified: Some(meta.last_modified.into()),
            })),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.error(&key)(e)),
        }
    }

    fn reader(
        &self,
        kind: BlobKind,
        name: &str,
        range: Option<Range<u64>>,
    ) -> Result<Box<dyn Read + Send>, StoreError> {
        Ok(match self.get(kind, name, range)?.0 {
            Payload::File(file, len) => super::file_reader(file, len),
            Payload::Stream(stream) => Box::new(StreamReader {
                handle: self.handle().clone(),
                stream: Some(stream),
                chunk: Bytes::new(),
            }),
        })
    }

    fn stream(
        &self,
        kind: BlobKind,
        name: &str,
        range: Option<Range<u64>>,
    ) -> Result<BlobStream, StoreError> {
        let (payload, len, total) = self.get(kind, name, range)?;
        let stream = match payload {
            Payload::File(file, len) => super::file_stream(file, len),
            Payload::Stream(stream) => stream,
        };
        Ok(BlobStream { len, total, stream })
    }

    /// Written to its key directly: a put, or a multipart upload's completion, is atomic.
    fn writer(&self, kind: BlobKind, name: &str) -> Result<Box<dyn BlobWriter>, StoreError> {
        let key = self.key(kind, name)?;
        let upload = object_store::buffered::BufWriter::with_capacity(
            self.store.clone(),
            key.clone(),
            PART_BYTES,
        )
        .with_max_concurrency(PARTS_IN_FLIGHT);
        Ok(Box::new(ObjectWriter {
            handle: self.handle().clone(),
            key,
            upload: Some(upload),
            pending: Vec::new(),
            shown: self.shown.clone(),
        }))
    }

    /// A put with `If-None-Match: *` on S3 (and a hard link on `file://`). An S3-compatible
    /// store told not to use conditional puts (`AWS_CONDITIONAL_PUT=disabled`) gets a look,
    /// then a put: not atomic.
    fn create(&self, kind: BlobKind, name: &str, bytes: &[u8]) -> Result<bool, StoreError> {
        let key = self.key(kind, name)?;
        let (store, at) = (self.store.clone(), key.clone());
        let payload = object_store::PutPayload::from(bytes.to_vec());
        let created = run(self.handle(), async move {
            store
                .put_opts(&at, payload, object_store::PutMode::Create.into())
                .await
        });
        match created {
            Ok(_) => Ok(true),
            Err(object_store::Error::AlreadyExists { .. }) => Ok(false),
            Err(object_store::Error::NotImplemented { .. }) => {
                tracing::warn!(blobs = %self.shown, "the blob store takes no conditional puts: {name} is written after a look, which two servers starting at once could both pass");
                if self.head(kind, name)?.is_some() {
                    return Ok(false);
                }
                super::put(self, kind, name, bytes)?;
                Ok(true)
            }
            Err(e) => Err(self.error(&key)(e)),
        }
    }

    fn remove(&self, kind: BlobKind, name: &str) -> Result<bool, StoreError> {
        let key = self.key(kind, name)?;
        let store = self.store.clone();
        let at = key.clone();
        match run(self.handle(), async move { store.delete(&at).await }) {
            Ok(()) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(self.error(&key)(e)),
        }
    }

    fn list(&self, kind: BlobKind) -> Result<Vec<(String, BlobMeta)>, StoreError> {
        let prefix = Key::from(kind.folder());
        let store = self.store.clone();
        let at = prefix.clone();
        let listed = run(self.handle(), async move {
            store.list(Some(&at)).try_collect::<Vec<_>>().await
        })
        .map_err(self.error(&prefix))?;
        Ok(listed
            .into_iter()
            .filter_map(|meta| {
                // Only this kind's own blobs: nothing deeper (the prefix is a folder).
                let rest = meta.location.prefix_match(&prefix)?.collect::<Vec<_>>();
                let [name] = rest.as_slice() else {
                    return None;
                };
                Some((
                    name.as_ref().to_string(),
                    BlobMeta {
                        len: meta.size,
                        modified: Some(meta.last_modified.into()),
                    },
                ))
            })
            .collect())
    }

    fn shared(&self) -> bool {
        true
    }

    fn describe(&self) -> String {
        self.shown.clone()
    }

    /// `object_store`'s local store writes `<key>#<n>` and renames it into place; a crash, or
    /// an upload given up, leaves it behind, and its listings hide such names.
    fn remove_staged(&self) -> Result<usize, StoreError> {
        let Some(dir) = &self.local else {
            return Ok(0);
        };
        let staged = |name: &str| {
            name.rsplit_once('#')
                .is_some_and(|(_, n)| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
        };
        let mut removed = 0;
        for kind in BlobKind::ALL {
            let folder = dir.join(kind.folder());
            let entries = match std::fs::read_dir(&folder) {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                entries => entries.map_err(crate::store::files::io(&folder))?,
            };
            for entry in entries {
                let entry = entry.map_err(crate::store::files::io(&folder))?;
                if entry.file_name().to_str().is_some_and(staged) {
                    std::fs::remove_file(entry.path())
                        .map_err(crate::store::files::io(&entry.path()))?;
                    removed += 1;
                }
            }
        }
        Ok(removed)
    }
}

impl Drop for ObjectBlobs {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

/// Reads an object store's stream from a blocking thread, a chunk at a time.
struct StreamReader {
    handle: tokio::runtime::Handle,
    /// None only while a chunk is being fetched (or after the stream failed).
    stream: Option<ByteStream>,
    chunk: Bytes,
}

impl Read for StreamReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        while self.chunk.is_empty() {
            let Some(mut stream) = self.stream.take() else {
                return Err(std::io::Error::other("the blob's stream failed earlier"));
            };
            let (answer, answered) = std::sync::mpsc::sync_channel(1);
            self.handle.spawn(async move {
                let next = stream.next().await;
                let _ = answer.send((stream, next));
            });
            let (stream, next) = answered
                .recv()
                .map_err(|_| std::io::Error::other("the blob store's runtime ended"))?;
            match next {
                None => return Ok(0),
                Some(chunk) => {
                    self.stream = Some(stream);
                    self.chunk = chunk?;
                }
            }
        }
        let n = buf.len().min(self.chunk.len());
        buf[..n].copy_from_slice(&self.chunk.split_to(n));
        Ok(n)
    }
}

/// An upload in progress: small writes gather in `pending` and go out a megabyte at a time to
/// `object_store`'s buffered writer (one put, or a multipart upload once past [`PART_BYTES`]).
struct ObjectWriter {
    handle: tokio::runtime::Handle,
    /// The blob's key.
    key: Key,
    /// Some until committed (or failed).
    upload: Option<object_store::buffered::BufWriter>,
    pending: Vec<u8>,
    shown: String,
}

const PENDING_BYTES: usize = 1 << 20;

impl ObjectWriter {
    fn failed(&self, e: impl fmt::Display) -> StoreError {
        StoreError::Blobs {
            at: self.shown.clone(),
            reason: format!("writing {}: {e}", self.key),
        }
    }

    /// Hands `bytes` to the upload (waiting while its parts in flight are at the limit).
    fn send(&mut self, bytes: Bytes) -> std::io::Result<()> {
        let Some(mut upload) = self.upload.take() else {
            return Err(std::io::Error::other("the upload failed earlier"));
        };
        let upload = run(&self.handle, async move {
            upload.put(bytes).await?;
            Ok(upload)
        })
        .map_err(|e| std::io::Error::other(self.failed(e)))?;
        self.upload = Some(upload);
        Ok(())
    }
}

impl Write for ObjectWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.pending.is_empty() && buf.len() >= PENDING_BYTES {
            // Large writes go out as they are (a part at most per call), never copied whole.
            let n = buf.len().min(PART_BYTES);
            self.send(Bytes::copy_from_slice(&buf[..n]))?;
            return Ok(n);
        }
        let n = buf.len().min(PENDING_BYTES - self.pending.len());
        self.pending.extend_from_slice(&buf[..n]);
        if self.pending.len() >= PENDING_BYTES {
            let bytes = Bytes::from(std::mem::take(&mut self.pending));
            self.send(bytes)?;
        }
        Ok(n)
    }

    /// Durability comes with [`BlobWriter::commit`]; nothing to do before.
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl BlobWriter for ObjectWriter {
    fn commit(mut self: Box<Self>) -> Result<(), StoreError> {
        if !self.pending.is_empty() {
            let bytes = Bytes::from(std::mem::take(&mut self.pending));
            self.send(bytes).map_err(|e| self.failed(e))?;
        }
        let Some(mut upload) = self.upload.take() else {
            return Err(self.failed("the upload failed earlier"));
        };
        run(&self.handle, async move {
            use tokio::io::AsyncWriteExt;
            upload
                .shutdown()
                .await
                .map_err(|e| object_store::Error::Generic {
                    store: "blobs",
                    source: Box::new(e),
                })
        })
        .map_err(|e| self.failed(e))
    }
}

impl Drop for ObjectWriter {
    /// Uncommitted: abort the upload (a multipart upload's parts are deleted; a buffered put
    /// never happened).
    fn drop(&mut self) {
        if let Some(mut upload) = self.upload.take() {
            self.handle.spawn(async move {
                let _ = upload.abort().await;
            });
        }
    }
}
