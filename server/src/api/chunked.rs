//! Chunked uploads: an update too large for one body travels as an upload session of sealed
//! chunks, and resumes after a cut connection without sending again what the server holds.
//!
//! 1. `POST /v1/tasks/{task}/rounds/{round}/uploads` with the plaintext's SHA-256 and length
//!    ([`UploadStart`]): after the checks an upload passes before its body is read (the round,
//!    the client's place in it, the size against the task's limit), the server opens a session
//!    and answers where it stands ([`UploadSession`]). The same plaintext again resumes its
//!    session; another one of the same client and task takes its place.
//! 2. `PUT …/uploads/{digest}/chunks/{index}`: chunk `index` only when it is the one the session
//!    expects next, sealed with [`envelope::seal_chunk`] (its index, the upload's digest, length
//!    and chunk size in the associated data), so a chunk replayed, reordered, skipped, or taken
//!    from another upload is refused. Each is opened with the round's key on arrival and its
//!    plaintext appended to the session's spool file; the server's memory holds a bounded number
//!    of chunks (the body budget) whatever the size of the update.
//! 3. `POST …/uploads/{digest}/complete` with the update's metadata: once every byte arrived and
//!    the spool's digest is the one announced, the spool is folded like a sealed body's
//!    plaintext ([`UpdateBody::Opened`]), through a read-only mapping of the file.
//!
//! Sessions live in this process: a restarted server (or another replica) knows none, answers
//! `upload_unknown`, and the client starts its upload again. The spool files together stay
//! within `--spool-bytes` (a session reserves its whole length when it starts); a session left
//! idle for [`IDLE`] is dropped with its file when the next one starts.

use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::routing::{post, put};
use axum::{Json, Router};
use hora_common::envelope::{self, Binding, Chunk};
use hora_common::wire::{ApiError, ErrorCode, UpdateReceipt, UploadSession, UploadStart};
use tokio::sync::{Mutex as AsyncMutex, OwnedSemaphorePermit};

use super::client::{settled, strikes, update_meta};
use super::{declared_length, json_body, read_upload, ApiPath, ClientAuth, Shared};
use crate::error::ServerError;
use crate::round::{upload_limit, Admission, Ingest, Round, Sealing, Task, UpdateBody};

/// A session untouched for this long is dropped (with its spool file) when the next one starts.
pub const IDLE: Duration = Duration::from_secs(15 * 60);

/// How the server takes chunked uploads.
#[derive(Debug, Clone)]
pub struct Chunking {
    /// Plaintext bytes per chunk, offered to the clients.
    pub chunk_bytes: u64,
    /// The most bytes all sessions' spool files may hold together.
    pub spool_bytes: u64,
}

/// Empties (or makes) the spool directory: what a previous process spooled belongs to sessions
/// and requests nobody knows any more. Blocking; run before serving.
pub fn prepare_spool(dir: &Path) -> std::io::Result<()> {
    match std::fs::remove_dir_all(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    std::fs::create_dir_all(dir)
}

pub fn routes() -> Router<Shared> {
    Router::new()
        .route("/v1/tasks/{task}/rounds/{round}/uploads", post(start))
        .route(
            "/v1/tasks/{task}/rounds/{round}/uploads/{digest}/chunks/{index}",
            put(chunk),
        )
        .route(
            "/v1/tasks/{task}/rounds/{round}/uploads/{digest}/complete",
            post(complete),
        )
}

/// A session, locked by the request that works on it (across its spool's I/O).
type Held = Arc<AsyncMutex<Session>>;

/// The chunked uploads in progress, one per client and task at most.
pub struct Sessions {
    chunking: Chunking,
    spool_dir: PathBuf,
    /// By (task, client).
    open: Mutex<HashMap<(String, String), Held>>,
    /// Spool bytes promised to open sessions.
    reserved: Arc<Mutex<u64>>,
}

struct Session {
    round: u64,
    digest: [u8; 32],
    length: u64,
    chunk_bytes: u64,
    received: u64,
    next: u64,
    hasher: ring::digest::Context,
    spool: Spool,
    touched: Instant,
}

impl Session {
    fn state(&self) -> UploadSession {
        UploadSession {
            digest: hex::encode(self.digest),
            length: self.length,
            chunk_bytes: self.chunk_bytes,
            received: self.received,
            next_chunk: self.next,
            chunks: Chunk::count(self.length, self.chunk_bytes),
        }
    }

    fn is_for(&self, round: u64, start: &[u8; 32], length: u64, chunk_bytes: u64) -> bool {
        self.round == round
            && &self.digest == start
            && self.length == length
            && self.chunk_bytes == chunk_bytes
    }
}

/// A session's spool file and its share of the spool budget, both given back when it goes.
struct Spool {
    path: PathBuf,
    file: File,
    bytes: u64,
    reserved: Arc<Mutex<u64>>,
}

impl Drop for Spool {
    fn drop(&mut self) {
        *self.reserved.lock().expect("spool lock") -= self.bytes;
        let path = std::mem::take(&mut self.path);
        let remove = move || {
            if let Err(e) = std::fs::remove_file(&path) {
                tracing::warn!(path = %path.display(), error = %e, "removing an upload's spool file failed");
            }
        };
        // (Off the runtime's workers when dropped on one.)
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => drop(runtime.spawn_blocking(remove)),
            Err(_) => remove(),
        }
    }
}

fn unknown(digest: &str) -> ServerError {
    ServerError::Gone {
        code: ErrorCode::UploadUnknown,
        message: format!(
            "the server holds no upload {digest} of this client to this task (it completed, was idle for over {} minutes, or the server restarted): start it again with POST …/uploads",
            IDLE.as_secs() / 60
        ),
    }
}

impl Sessions {
    pub fn new(chunking: Chunking, spool_dir: PathBuf) -> Self {
        Sessions {
            chunking,
            spool_dir,
            open: Mutex::default(),
            reserved: Arc::default(),
        }
    }

    fn session(&self, key: &(String, String), digest: &str) -> Result<Held, ServerError> {
        self.open
            .lock()
            .expect("sessions lock")
            .get(key)
            .cloned()
            .ok_or_else(|| unknown(digest))
    }

    /// Resumes the session of this plaintext, or opens one in the place of any other of the
    /// client's sessions for the task.
    async fn start(
        &self,
        key: (String, String),
        round: u64,
        digest: [u8; 32],
        length: u64,
    ) -> Result<UploadSession, ServerError> {
        let chunk_bytes = self.chunking.chunk_bytes;
        let existing = self.open.lock().expect("sessions lock").get(&key).cloned();
        if let Some(existing) = existing {
            let mut session = existing.lock().await;
            if session.is_for(round, &digest, length, chunk_bytes) {
                session.touched = Instant::now();
                return Ok(session.state());
            }
        }
        let (replaced, idle) = {
            let mut open = self.open.lock().expect("sessions lock");
            let replaced = open.remove(&key);
            // Idle sessions go (one that a request holds is not idle).
            let idle: Vec<_> = open
                .iter()
                .filter(|(_, s)| s.try_lock().is_ok_and(|s| s.touched.elapsed() > IDLE))
                .map(|(k, _)| k.clone())
                .collect();
            let idle: Vec<_> = idle.iter().filter_map(|k| open.remove(k)).collect();
            (replaced, idle)
        };
        drop((replaced, idle));
        let reserved = {
            let mut reserved = self.reserved.lock().expect("spool lock");
            if *reserved + length > self.chunking.spool_bytes {
                return Err(ServerError::unavailable(
                    ErrorCode::Busy,
                    format!(
                        "the server's spool for chunked uploads is full ({} of --spool-bytes {} promised to uploads in progress, this one needs {length}); retry later",
                        *reserved, self.chunking.spool_bytes
                    ),
                ));
            }
            *reserved += length;
            self.reserved.clone()
        };
        let dir = self.spool_dir.clone();
        let spool = crate::blocking(move || {
            let created = create_spool(&dir);
            let (path, file) = match created {
                Ok(made) => made,
                Err(e) => {
                    *reserved.lock().expect("spool lock") -= length;
                    return Err(ServerError::internal(format!(
                        "creating a spool file in {} failed: {e}",
                        dir.display()
                    )));
                }
            };
            Ok(Spool {
                path,
                file,
                bytes: length,
                reserved,
            })
        })
        .await?;
        let session = Session {
            round,
            digest,
            length,
            chunk_bytes,
            received: 0,
            next: 0,
            hasher: ring::digest::Context::new(&ring::digest::SHA256),
            spool,
            touched: Instant::now(),
        };
        let state = session.state();
        self.open
            .lock()
            .expect("sessions lock")
            .insert(key, Arc::new(AsyncMutex::new(session)));
        Ok(state)
    }
}

/// A new file of this process's own in the spool directory, readable by its owner only.
fn create_spool(dir: &Path) -> std::io::Result<(PathBuf, File)> {
    use std::os::unix::fs::OpenOptionsExt;
    let name: [u8; 16] = rand::random();
    let path = dir.join(format!("{}.spool", hex::encode(name)));
    let file = std::fs::OpenOptions::new()
        .create_new(true)
        .read(true)
        .write(true)
        .mode(0o600)
        .open(&path)?;
    Ok((path, file))
}

fn sessions(state: &Shared) -> Result<&Sessions, ServerError> {
    state.sessions.as_ref().ok_or_else(|| {
        ServerError::NotFound(
            "this server takes updates in one body only (chunked uploads are off: --upload-chunk-bytes 0)".into(),
        )
    })
}

fn parse_digest(hex_digest: &str) -> Result<[u8; 32], ServerError> {
    let mut digest = [0u8; 32];
    hex::decode_to_slice(hex_digest, &mut digest).map_err(|_| {
        ServerError::BadRequest(
            "an upload's digest is its plaintext's SHA-256, 64 hex digits".into(),
        )
    })?;
    Ok(digest)
}

/// The round an upload of `client` to round `round` is admitted to, and the key it is sealed
/// to; a client whose update is in already is told so.
async fn admitted(
    state: &Shared,
    task: &Arc<Task>,
    client: &str,
    round: u64,
) -> Result<(Arc<Round>, Sealing), ServerError> {
    match state
        .coordinator
        .check_upload_blocking(task, client, round)
        .await?
    {
        Admission::Fresh(open, sealing) => Ok((open, sealing)),
        Admission::Pending(..) => Err(ServerError::conflict(
            ErrorCode::AlreadyContributed,
            format!("this client's update to round {round} is in already"),
        )),
    }
}

#[utoipa::path(post, path = "/v1/tasks/{task}/rounds/{round}/uploads", tag = "client",
    params(("task" = String, Path), ("round" = u64, Path)),
    request_body = UploadStart,
    security(("client_credentials" = [])),
    responses(
        (status = 200, body = UploadSession, description = "the session: new, or where this plaintext's session stands"),
        (status = 404, body = ApiError, description = "`not_found`: no such task, or the server takes updates in one body only"),
        (status = 409, body = ApiError, description = "as for `…/update`: wrong, closed or abandoned round; not selected; already contributed; `upload_in_progress`"),
        (status = 413, body = ApiError, description = "`payload_too_large`: over the task's update size"),
        (status = 503, body = ApiError, description = "`busy`: the spool for chunked uploads is full (retry later)")))]
pub async fn start(
    State(state): State<Shared>,
    auth: ClientAuth,
    ApiPath((task, round)): ApiPath<(String, u64)>,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<UploadSession>, ServerError> {
    let sessions = sessions(&state)?;
    let task = state.coordinator.task(&task)?;
    let start: UploadStart = json_body(&state, &headers, body).await?;
    let digest = parse_digest(&start.digest)?;
    let record = task.record();
    let limit =
        upload_limit(&record.spec, record.config.compression.as_ref()) - envelope::OVERHEAD as u64;
    if start.length > limit {
        return Err(ServerError::PayloadTooLarge {
            got: start.length,
            limit,
        });
    }
    let _in_flight = state.uploads.begin(&task.id, &auth.id)?;
    admitted(&state, &task, &auth.id, round).await?;
    let key = (task.id.clone(), auth.id.clone());
    Ok(Json(
        sessions.start(key, round, digest, start.length).await?,
    ))
}

#[utoipa::path(put, path = "/v1/tasks/{task}/rounds/{round}/uploads/{digest}/chunks/{index}", tag = "client",
    params(("task" = String, Path), ("round" = u64, Path), ("digest" = String, Path), ("index" = u64, Path)),
    request_body(content = inline(super::doc::Binary), content_type = "application/octet-stream", description = "the chunk, sealed with its index in the associated data"),
    security(("client_credentials" = [])),
    responses(
        (status = 200, body = UploadSession, description = "the chunk is held; the session as it now stands"),
        (status = 400, body = ApiError, description = "`invalid_update`: the chunk does not open as this chunk of this upload; `bad_request`: its length is not the chunk's"),
        (status = 409, body = ApiError, description = "`chunk_out_of_order`: not the chunk the session expects next (see `POST …/uploads`); or the round no longer takes the update"),
        (status = 408, body = ApiError, description = "`upload_too_slow`: the body arrived too slowly"),
        (status = 410, body = ApiError, description = "`upload_unknown`: no such session (start the upload again)"),
        (status = 411, body = ApiError, description = "`length_required`: no `Content-Length`"),
        (status = 503, body = ApiError, description = "`busy`: no room to read the body (retry)")))]
pub async fn chunk(
    State(state): State<Shared>,
    auth: ClientAuth,
    ApiPath((task, round, digest, index)): ApiPath<(String, u64, String, u64)>,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<UploadSession>, ServerError> {
    let sessions = sessions(&state)?;
    let task = state.coordinator.task(&task)?;
    let _in_flight = state.uploads.begin(&task.id, &auth.id)?;
    let key = (task.id.clone(), auth.id.clone());
    let mut session = sessions.session(&key, &digest)?.lock_owned().await;
    if parse_digest(&digest)? != session.digest || round != session.round {
        return Err(unknown(&digest));
    }
    let upload = session.digest;
    let at = Chunk {
        upload: &upload,
        length: session.length,
        chunk_bytes: session.chunk_bytes,
        index,
    };
    let range = match at.range() {
        Some(range) if index == session.next => range,
        _ => {
            return Err(ServerError::conflict(
                ErrorCode::ChunkOutOfOrder,
                format!(
                    "chunk {index} is not the one upload {digest} expects: {} of its {} chunks are in, send chunk {}",
                    session.next,
                    Chunk::count(session.length, session.chunk_bytes),
                    session.next
                ),
            ))
        }
    };
    let sealed_length = range.end - range.start + envelope::OVERHEAD as u64;
    // (A chunk of another length is malformed, whichever way it is off: 400 before reading.)
    if declared_length(&headers, u64::MAX)? != sealed_length {
        return Err(ServerError::BadRequest(format!(
            "chunk {index} of upload {digest} is {sealed_length} bytes sealed; send exactly that"
        )));
    }
    let (open, sealing) = admitted(&state, &task, &auth.id, round).await?;
    let within = Duration::from_secs(task.record().config.round_deadline_secs);
    let (mut body, permit) = read_upload(&state, &headers, body, sealed_length, within).await?;
    let (t, client) = (task.clone(), auth.id.clone());
    let held =
        crate::blocking(move || {
            let (key, sealed, base) = sealing.key(&open);
            let binding = Binding {
                task: &t.id,
                round: sealed,
                client: &client,
                base_model: &base,
            };
            let chunk = Chunk {
                upload: &upload,
                length: session.length,
                chunk_bytes: session.chunk_bytes,
                index,
            };
            let plaintext = envelope::open_chunk(&mut body, key, &binding, &chunk)
                .map_err(|e| ServerError::InvalidUpdate(format!("chunk {index}: {e}")))?;
            session.spool.file.write_all(plaintext).map_err(|e| {
                ServerError::internal(format!("spooling chunk {index} failed: {e}"))
            })?;
            session.hasher.update(plaintext);
            session.received += plaintext.len() as u64;
            session.next += 1;
            session.touched = Instant::now();
            drop(permit);
            Ok(session.state())
        })
        .await;
    match &held {
        Ok(_) => {
            state.coordinator.metrics.upload_bytes.inc_by(sealed_length);
        }
        Err(e) => {
            state.coordinator.metrics.upload_rejected(e.code().as_str());
            if e.code() == ErrorCode::InvalidUpdate {
                strikes(&state, &auth.id, Some(e)).await;
            }
        }
    }
    held.map(Json)
}

/// An ingest slot alone: a chunked upload's spool needs the CPU work of checking and folding,
/// its memory is a mapping of its file.
struct Slot(Option<OwnedSemaphorePermit>);

impl Ingest for Slot {
    fn opened(&mut self) {
        self.0 = None;
    }
}

#[utoipa::path(post, path = "/v1/tasks/{task}/rounds/{round}/uploads/{digest}/complete", tag = "client",
    params(("task" = String, Path), ("round" = u64, Path), ("digest" = String, Path), ("x-hora-update" = String, Header, description = "UpdateMeta as JSON")),
    security(("client_credentials" = [])),
    responses(
        (status = 200, body = UpdateReceipt, description = "folded and durable"),
        (status = 400, body = ApiError, description = "`invalid_update`: what arrived is not the plaintext announced, or not a valid update"),
        (status = 409, body = ApiError, description = "`chunk_out_of_order`: chunks are missing (the message says which is next); or as for `…/update`"),
        (status = 410, body = ApiError, description = "`upload_unknown`: no such session (start the upload again)"),
        (status = 503, body = ApiError, description = "as for `…/update`: retry the completion")))]
pub async fn complete(
    State(state): State<Shared>,
    auth: ClientAuth,
    ApiPath((task, round, digest)): ApiPath<(String, u64, String)>,
    headers: HeaderMap,
) -> Result<Json<UpdateReceipt>, ServerError> {
    let result = async {
        let sessions = sessions(&state)?;
        let task = state.coordinator.task(&task)?;
        let meta = update_meta(&headers)?;
        let _in_flight = state.uploads.begin(&task.id, &auth.id)?;
        // A retry of a completion whose update is folded but not yet durable.
        if let Some(receipt) = state
            .coordinator
            .pending_receipt(&task, &auth.id, round)
            .await?
        {
            return Ok(receipt);
        }
        let key = (task.id.clone(), auth.id.clone());
        let held = sessions.session(&key, &digest)?;
        let session = held.clone().lock_owned().await;
        if parse_digest(&digest)? != session.digest || round != session.round {
            return Err(unknown(&digest));
        }
        if session.received != session.length {
            return Err(ServerError::conflict(
                ErrorCode::ChunkOutOfOrder,
                format!(
                    "upload {digest} is not whole: {} of its {} chunks are in, send chunk {}",
                    session.next,
                    Chunk::count(session.length, session.chunk_bytes),
                    session.next
                ),
            ));
        }
        // The session is done with whatever comes next, unless the server cannot take the
        // update now (then the completion may be retried with what is spooled).
        sessions
            .open
            .lock()
            .expect("sessions lock")
            .retain(|_, s| !Arc::ptr_eq(s, &held));
        if session.hasher.clone().finish().as_ref() != session.digest {
            return Err(ServerError::InvalidUpdate(format!(
                "the chunks of upload {digest} are not the plaintext it announced (another SHA-256)"
            )));
        }
        let (session, plaintext) = crate::blocking(move || {
            // SAFETY: the file is this process's own (created new, mode 0600, in the spool
            // directory), and nothing writes to it while it is mapped: its session is locked
            // here and no longer in the table, and its spool goes only with the session.
            let mapped = unsafe { memmap2::Mmap::map(&session.spool.file) }
                .map_err(|e| ServerError::internal(format!("mapping a spooled upload: {e}")))?;
            Ok((session, mapped))
        })
        .await?;
        let slot = state
            .ingest
            .clone()
            .acquire_owned()
            .await
            .map_err(ServerError::internal)?;
        let outcome = state
            .coordinator
            .upload(
                task,
                auth.id.clone(),
                round,
                meta,
                UpdateBody::Opened(Box::new(plaintext)),
                Slot(Some(slot)),
            )
            .await;
        if let Err(
            ServerError::Unavailable { .. }
            | ServerError::Timeout { .. }
            | ServerError::Internal(_),
        ) = &outcome
        {
            drop(session);
            sessions
                .open
                .lock()
                .expect("sessions lock")
                .insert(key, held);
        }
        outcome
    }
    .await;
    settled(&state, &auth.id, round, result).await.map(Json)
}
