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
//! `upload_unknown`, and the client starts its upload again. A session belongs to its round's
//! attempt (the round key its chunks are sealed to): a retried attempt starts afresh. It ends,
//! and its spool file goes, when its update is folded or refused, when the round no longer
//! admits it, when its client starts another upload to the task, or when no chunk reached it for
//! [`IDLE`] (swept as sessions start, and every minute). So an update's
//! plaintext stays on the server's disk (mode 0600, in `<data-dir>/spool`, emptied at start)
//! while its upload is in progress and about [`IDLE`] after it stalls. The spool files together stay within
//! `--spool-bytes` (a session reserves its whole length when it starts; only a client admitted
//! to the round may start one, one per task).

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::routing::{post, put};
use axum::{Json, Router};
use hora_common::envelope::{self, Binding, Chunk, RoundPublicKey};
use hora_common::wire::{
    ApiError, ErrorCode, UpdateMeta, UpdateReceipt, UploadSession, UploadStart,
};
use tokio::sync::{Mutex as AsyncMutex, OwnedMutexGuard, OwnedSemaphorePermit};

use super::client::{settled, strikes, update_meta};
use super::{declared_length, json_body, read_upload, ApiPath, ClientAuth, Shared};
use crate::error::ServerError;
use crate::round::{
    too_large_hint, upload_limit, Admission, Ingest, Round, Sealing, Task, UpdateBody,
};

/// A session no chunk reached for this long ends (with its spool file) at the next sweep.
pub const IDLE: Duration = Duration::from_secs(15 * 60);

/// How the server takes chunked uploads.
#[derive(Debug, Clone)]
pub struct Chunking {
    /// Plaintext bytes per chunk, offered to the clients.
    pub chunk_bytes: u64,
    /// The most bytes all sessions' spool files may hold together.
    pub spool_bytes: u64,
}

/// Sweeps `state`'s idle upload sessions every minute, for as long as the state lives (a session
/// starting sweeps too, so the spool makes room before it refuses one).
pub fn sweep_idle(state: &Shared) {
    if state.sessions.is_none() {
        return;
    }
    let state = Arc::downgrade(state);
    tokio::spawn(async move {
        let mut every = tokio::time::interval(Duration::from_secs(60));
        loop {
            every.tick().await;
            match state.upgrade() {
                Some(state) => {
                    if let Some(sessions) = &state.sessions {
                        sessions.sweep();
                    }
                }
                None => break,
            }
        }
    });
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

/// Whose session: (task, client).
type Who = (String, String);

/// The chunked uploads in progress, one per client and task at most.
pub struct Sessions {
    chunking: Chunking,
    spool_dir: PathBuf,
    /// By (task, client): the upload's digest, and its session.
    open: Mutex<HashMap<Who, ([u8; 32], Held)>>,
    /// Spool bytes promised to open sessions.
    reserved: Arc<Mutex<u64>>,
}

struct Session {
    round: u64,
    /// The round key its chunks are sealed to (a retried attempt of the round has another).
    key: RoundPublicKey,
    digest: [u8; 32],
    length: u64,
    chunk_bytes: u64,
    received: u64,
    next: u64,
    hasher: ring::digest::Context,
    spool: Spool,
    /// When a chunk last arrived (or the session started or resumed).
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

    /// Appends chunk `index`'s plaintext at the end of what the session holds. Blocking.
    fn append(&mut self, index: u64, plaintext: &[u8]) -> Result<(), ServerError> {
        use std::os::unix::fs::FileExt;
        let file = &self.spool.file;
        if let Err(e) = file.write_all_at(plaintext, self.received) {
            // (What a failed write left past the end goes: the chunk is sent again.)
            let _ = file.set_len(self.received);
            return Err(ServerError::internal(format!(
                "spooling chunk {index} failed: {e}"
            )));
        }
        self.hasher.update(plaintext);
        self.received += plaintext.len() as u64;
        self.next += 1;
        self.touched = Instant::now();
        Ok(())
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
            "the server holds no upload {digest} of this client to this task (it completed or was refused, the round moved on, it had no chunk for {} minutes, or the server restarted): start it again with POST …/uploads",
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

    /// The session of upload `digest` of this (task, client).
    fn session(&self, key: &Who, digest: &str) -> Result<Held, ServerError> {
        let wanted = parse_digest(digest)?;
        match self.open.lock().expect("sessions lock").get(key) {
            Some((upload, held)) if *upload == wanted => Ok(held.clone()),
            _ => Err(unknown(digest)),
        }
    }

    /// Whether `held` is still the session of its (task, client): not ended while its
    /// locker waited.
    fn is_open(&self, key: &Who, held: &Held) -> bool {
        self.open
            .lock()
            .expect("sessions lock")
            .get(key)
            .is_some_and(|(_, h)| Arc::ptr_eq(h, held))
    }

    /// Ends `held` (its spool goes once the last request holding it lets go).
    fn end(&self, key: &Who, held: &Held) {
        let mut open = self.open.lock().expect("sessions lock");
        if open.get(key).is_some_and(|(_, h)| Arc::ptr_eq(h, held)) {
            open.remove(key);
        }
    }

    /// Ends the sessions no chunk reached for [`IDLE`] (one a request holds is not idle).
    pub fn sweep(&self) {
        let idle: Vec<_> = {
            let mut open = self.open.lock().expect("sessions lock");
            let keys: Vec<_> = open
                .iter()
                .filter(|(_, (_, s))| s.try_lock().is_ok_and(|s| s.touched.elapsed() > IDLE))
                .map(|(k, _)| k.clone())
                .collect();
            keys.iter().filter_map(|k| open.remove(k)).collect()
        };
        drop(idle);
    }

    /// Resumes the session of this plaintext sealed to `key`, or opens one in the place of any
    /// other of the client's sessions for the task.
    async fn start(
        &self,
        who: Who,
        round: u64,
        key: RoundPublicKey,
        digest: [u8; 32],
        length: u64,
    ) -> Result<UploadSession, ServerError> {
        self.sweep();
        let chunk_bytes = self.chunking.chunk_bytes;
        let existing = self.open.lock().expect("sessions lock").get(&who).cloned();
        if let Some((_, existing)) = existing {
            let mut session = existing.lock().await;
            if (
                session.round,
                session.key,
                session.digest,
                session.length,
                session.chunk_bytes,
            ) == (round, key, digest, length, chunk_bytes)
                && self.is_open(&who, &existing)
            {
                session.touched = Instant::now();
                return Ok(session.state());
            }
        }
        let replaced = self.open.lock().expect("sessions lock").remove(&who);
        drop(replaced);
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
        let spool = crate::blocking(move || match create_spool(&dir) {
            Ok((path, file)) => Ok(Spool {
                path,
                file,
                bytes: length,
                reserved,
            }),
            Err(e) => {
                *reserved.lock().expect("spool lock") -= length;
                Err(ServerError::internal(format!(
                    "creating a spool file in {} failed: {e}",
                    dir.display()
                )))
            }
        })
        .await?;
        let session = Session {
            round,
            key,
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
            .insert(who, (digest, Arc::new(AsyncMutex::new(session))));
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
/// to. A client whose update is in already is told so once it is durable (a client that hears
/// it may count its update in).
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
        Admission::Pending(..) => {
            state
                .coordinator
                .pending_receipt(task, client, round)
                .await?;
            Err(ServerError::conflict(
                ErrorCode::AlreadyContributed,
                format!("this client's update to round {round} is in already"),
            ))
        }
    }
}

/// Whether a refusal leaves the upload able to go on (the server busy or slow, or a chunk the
/// client sends again: a cut body, one out of order): else its session ends.
fn goes_on(e: &ServerError) -> bool {
    matches!(
        e,
        ServerError::Unavailable { .. } | ServerError::Timeout { .. }
    ) || matches!(e.code(), ErrorCode::ChunkOutOfOrder | ErrorCode::BadRequest)
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
            hint: too_large_hint(&record),
        });
    }
    let _in_flight = state.uploads.begin(&task.id, &auth.id)?;
    let (open, sealing) = admitted(&state, &task, &auth.id, round).await?;
    let key = sealing.key(&open).0.public_key();
    let who = (task.id.clone(), auth.id.clone());
    Ok(Json(
        sessions
            .start(who, round, key, digest, start.length)
            .await?,
    ))
}

#[utoipa::path(put, path = "/v1/tasks/{task}/rounds/{round}/uploads/{digest}/chunks/{index}", tag = "client",
    params(("task" = String, Path), ("round" = u64, Path), ("digest" = String, Path), ("index" = u64, Path)),
    request_body(content = inline(super::doc::Binary), content_type = "application/octet-stream", description = "the chunk, sealed with its index in the associated data"),
    security(("client_credentials" = [])),
    responses(
        (status = 200, body = UploadSession, description = "the chunk is held; the session as it now stands"),
        (status = 400, body = ApiError, description = "`invalid_update`: the chunk does not open as this chunk of this upload; `bad_request`: its length is not the chunk's"),
        (status = 408, body = ApiError, description = "`upload_too_slow`: the body arrived too slowly"),
        (status = 409, body = ApiError, description = "`chunk_out_of_order`: not the chunk the session expects next (see `POST …/uploads`); `upload_in_progress`: another request of this client to the task is under way; `already_contributed`; or the round no longer takes the update (closed, abandoned, the attempt the upload began in is over)"),
        (status = 410, body = ApiError, description = "`upload_unknown`: no such session (start the upload again)"),
        (status = 411, body = ApiError, description = "`length_required`: no `Content-Length`"),
        (status = 503, body = ApiError, description = "`busy`: no room to read the body; `not_durable_yet`, `store_unavailable`, `shutting_down`: retry")))]
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
    let who = (task.id.clone(), auth.id.clone());
    let held = sessions.session(&who, &digest)?;
    let mut session = held.clone().lock_owned().await;
    if round != session.round || !sessions.is_open(&who, &held) {
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
    let held_chunk = async {
        let (open, sealing) = admitted(&state, &task, &auth.id, round).await?;
        if sealing.key(&open).0.public_key() != session.key {
            return Err(ServerError::conflict(
                ErrorCode::RoundClosed,
                format!("the attempt of round {round} that upload {digest} began in is over; join the round again"),
            ));
        }
        let within = Duration::from_secs(task.record().config.round_deadline_secs);
        let (mut body, permit) =
            read_upload(&state, &headers, body, sealed_length, within).await?;
        let (t, client) = (task.clone(), auth.id.clone());
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
            session.append(index, plaintext)?;
            drop(permit);
            Ok(session.state())
        })
        .await
    }
    .await;
    match &held_chunk {
        Ok(_) => {
            state.coordinator.metrics.upload_bytes.inc_by(sealed_length);
            state.coordinator.metrics.upload_chunks.inc();
        }
        Err(e) => {
            // (A round that moved on, a client no longer admitted: the upload cannot end well.)
            if !goes_on(e) && e.code() != ErrorCode::InvalidUpdate {
                sessions.end(&who, &held);
            }
            if e.code() == ErrorCode::InvalidUpdate {
                state.coordinator.metrics.upload_rejected(e.code().as_str());
                strikes(&state, &auth.id, Some(e)).await;
            }
        }
    }
    held_chunk.map(Json)
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
        (status = 403, body = ApiError, description = "`forbidden`: the `x-hora-update` header says the update stands for several clients (`contributors`) and this client is not enrolled as a regional aggregator, or for more than its enrolment's `max_contributors`"),
        (status = 409, body = ApiError, description = "`chunk_out_of_order`: chunks are missing (the message says which is next); or as for `…/update`"),
        (status = 410, body = ApiError, description = "`upload_unknown`: no such session (start the upload again)"),
        (status = 503, body = ApiError, description = "as for `…/update`: retry the completion")))]
pub async fn complete(
    State(state): State<Shared>,
    auth: ClientAuth,
    ApiPath((task, round, digest)): ApiPath<(String, u64, String)>,
    headers: HeaderMap,
) -> Result<Json<UpdateReceipt>, ServerError> {
    let early = async {
        sessions(&state)?;
        let task = state.coordinator.task(&task)?;
        let meta = update_meta(&headers, &auth)?;
        let in_flight = state.uploads.begin(&task.id, &auth.id)?;
        Ok((task, meta, in_flight))
    }
    .await;
    let (task, meta, _in_flight) = match early {
        Ok(early) => early,
        Err(e) => return settled(&state, &auth.id, round, Err(e)).await.map(Json),
    };
    // Detached, and counted there: a client that hangs up stops a completion neither halfway
    // nor before its outcome counts (strikes, metrics); its retry finds what became of it.
    let (state, client) = (state.clone(), auth.id.clone());
    tokio::spawn(async move {
        let outcome = completion(&state, task, client.clone(), round, &digest, meta).await;
        settled(&state, &client, round, outcome).await
    })
    .await
    .map_err(ServerError::internal)?
    .map(Json)
}

/// Folds a whole upload's spool, and ends its session unless the upload can go on.
async fn completion(
    state: &Shared,
    task: Arc<Task>,
    client: String,
    round: u64,
    digest: &str,
    meta: UpdateMeta,
) -> Result<UpdateReceipt, ServerError> {
    let sessions = sessions(state)?;
    let who = (task.id.clone(), client.clone());
    let held = sessions.session(&who, digest).ok();
    // Waits for a completion of this upload still under way.
    let session = match &held {
        Some(held) => Some(held.clone().lock_owned().await),
        None => None,
    };
    // A retry of a completion whose update is in: its receipt, once durable.
    match state
        .coordinator
        .pending_receipt(&task, &client, round)
        .await
    {
        Ok(None) => {}
        Ok(Some(receipt)) => {
            if let Some(held) = &held {
                sessions.end(&who, held);
            }
            return Ok(receipt);
        }
        Err(e) => {
            if let Some(held) = held.as_ref().filter(|_| !goes_on(&e)) {
                sessions.end(&who, held);
            }
            return Err(e);
        }
    }
    let (Some(held), Some(session)) = (held, session) else {
        return Err(unknown(digest));
    };
    if round != session.round || !sessions.is_open(&who, &held) {
        return Err(unknown(digest));
    }
    let (session, outcome) = fold_spool(state, &task, &client, round, digest, meta, session).await;
    // (Ended while its lock is held: a retry waiting for it finds it gone.)
    if !matches!(&outcome, Err(e) if goes_on(e)) {
        sessions.end(&who, &held);
    }
    drop(session);
    outcome
}

/// The completion proper: the whole plaintext, the digest announced, then the upload path. The
/// session's lock comes back with the outcome (None only if the mapping's thread panicked).
async fn fold_spool(
    state: &Shared,
    task: &Arc<Task>,
    client: &str,
    round: u64,
    digest: &str,
    meta: UpdateMeta,
    session: OwnedMutexGuard<Session>,
) -> (
    Option<OwnedMutexGuard<Session>>,
    Result<UpdateReceipt, ServerError>,
) {
    if session.received != session.length {
        let e = ServerError::conflict(
            ErrorCode::ChunkOutOfOrder,
            format!(
                "upload {digest} is not whole: {} of its {} chunks are in, send chunk {}",
                session.next,
                Chunk::count(session.length, session.chunk_bytes),
                session.next
            ),
        );
        return (Some(session), Err(e));
    }
    if session.hasher.clone().finish().as_ref() != session.digest {
        let e = ServerError::InvalidUpdate(format!(
            "the chunks of upload {digest} are not the plaintext it announced (another SHA-256)"
        ));
        return (Some(session), Err(e));
    }
    match admitted(state, task, client, round).await {
        Ok((open, sealing)) if sealing.key(&open).0.public_key() == session.key => {}
        Ok(_) => {
            let e = ServerError::conflict(
                ErrorCode::RoundClosed,
                format!("the attempt of round {round} that upload {digest} began in is over; join the round again"),
            );
            return (Some(session), Err(e));
        }
        Err(e) => return (Some(session), Err(e)),
    }
    let mapped = crate::blocking(move || {
        let mapped = map_spool(&session);
        Ok((session, mapped))
    })
    .await;
    let (session, plaintext) = match mapped {
        Ok((session, Ok(plaintext))) => (session, plaintext),
        Ok((session, Err(e))) => return (Some(session), Err(e)),
        Err(e) => return (None, Err(e)),
    };
    let slot = match state.ingest.clone().acquire_owned().await {
        Ok(slot) => slot,
        Err(e) => return (Some(session), Err(ServerError::internal(e))),
    };
    let outcome = state
        .coordinator
        .upload(
            task.clone(),
            client.to_string(),
            round,
            meta,
            UpdateBody::Opened(Box::new(plaintext)),
            Slot(Some(slot)),
        )
        .await;
    (Some(session), outcome)
}

/// A read-only mapping of a whole session's spool, once its length on disk is what it
/// received. Blocking.
fn map_spool(session: &Session) -> Result<memmap2::Mmap, ServerError> {
    let length = session.spool.file.metadata().map(|m| m.len());
    if !matches!(length, Ok(l) if l == session.length) {
        return Err(ServerError::internal(format!(
            "a spooled upload is {length:?} bytes on disk, not the {} it received",
            session.length
        )));
    }
    // SAFETY: the file is this process's own (created new, mode 0600, in the spool directory),
    // and nothing writes to it while it is mapped: its session is locked while it is folded
    // (chunks are written only under that lock), and its spool goes only with the session.
    unsafe { memmap2::Mmap::map(&session.spool.file) }
        .map_err(|e| ServerError::internal(format!("mapping a spooled upload: {e}")))
}
