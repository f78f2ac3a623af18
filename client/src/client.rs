//! The SDK's [`Client`]: one enrolled client of one server, and the round it takes part in.
//!
//! A round, top to bottom ([`Client::participate`]):
//! 1. long-poll the task until a round is open that this client has not contributed to, and join
//!    it (the server may say "not this one": the client waits for the next);
//! 2. fetch the global model (from the cache when the digest is known) and, for TorchScript
//!    tasks, the module;
//! 3. train through the [`Trainer`] until its epochs are done or the deadline (less a margin for
//!    the upload) arrives; the task's `on_deadline` says whether a partial update is sent;
//! 4. `delta = local − global`, recorded on disk (while it is being uploaded: a write is not
//!    worth holding up the round for), so a client restarted after that uploads the same delta
//!    instead of training again;
//! 5. seal the delta to the round key (bound to task, round, client and base model) and upload it
//!    with its example count and metrics; retried on transient failures, and an
//!    `already_contributed` answer to a retry means an earlier attempt got through.
//!
//! Each [`RoundReport`] says where the round's time went, phase by phase ([`RoundTimings`]).
//!
//! In a task with federated evaluation, a poll may also ask the client to evaluate a published
//! model on its held-out data ([`Trainer::evaluate`]): the client does so before anything else
//! the poll says, and reports the result ([`Client::evaluate`]). A trainer without held-out
//! data declines, and a failed evaluation is logged, never fatal to the training.

use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use hora_common::envelope;
use hora_common::model::{Limits, Model, ModelDigest};
use hora_common::tls::Identity;
use hora_common::wire::{
    Credentials, DeadlinePolicy, EnrolRequest, ErrorCode, EvaluationOffer, EvaluationReceipt,
    EvaluationReport, JoinResponse, Metrics, ModelKind, PollResponse, RoundOffer, TaskState,
    UpdateMeta, UpdateReceipt, UploadSession, UploadStart, MAX_LOSS, MIN_UPLOAD_CHUNK_BYTES,
};
use reqwest::Method;

use crate::error::{ClientError, Result};
use crate::state::{RoundState, StateDir};
use crate::trainer::{EvaluateRequest, Progress, TrainRequest, Trainer};
use crate::transport::{check, Connection, RetryPolicy};

/// Header carrying an update's [`UpdateMeta`] (the body is the sealed envelope).
pub const UPDATE_META_HEADER: &str = "x-hora-update";

/// Where and how a client connects.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// `https://host:port`, or several comma-separated, tried in turn when one cannot be
    /// reached.
    pub server: String,
    /// The CA certificate the server's certificate chains to.
    pub ca: PathBuf,
    /// A client certificate for servers that require mutual TLS.
    pub identity: Option<Identity>,
    /// Credentials, cached models and the round in progress.
    pub state_dir: PathBuf,
    /// Shown to operators (`hora-server admin clients`).
    pub label: Option<String>,
    pub retry: RetryPolicy,
    /// How long one long poll may be held open.
    pub poll_wait: Duration,
    /// Refuse models larger than this before downloading them.
    pub limits: Limits,
    /// Fault drill for secure aggregation: vanish (stop talking to the server and return
    /// [`ClientError::DroppedOut`]) right after completing this stage, as a crashed device would.
    pub drop_out_after: Option<hora_common::secagg::Stage>,
}

impl ClientConfig {
    pub fn new(
        server: impl Into<String>,
        ca: impl Into<PathBuf>,
        state_dir: impl Into<PathBuf>,
    ) -> Self {
        ClientConfig {
            server: server.into(),
            ca: ca.into(),
            identity: None,
            state_dir: state_dir.into(),
            label: None,
            retry: RetryPolicy::default(),
            poll_wait: Duration::from_secs(30),
            limits: Limits::default(),
            drop_out_after: None,
        }
    }
}

/// How one round went for this client.
#[derive(Debug, Clone, PartialEq)]
pub struct RoundReport {
    pub round: u64,
    /// The attempt of the round (0 first; an abandoned attempt is retried as the next one).
    pub attempt: u32,
    pub outcome: RoundOutcome,
    pub num_examples: u64,
    pub metrics: Metrics,
    pub train_time: Duration,
    /// Where the round's time went.
    pub timings: RoundTimings,
}

/// Where one round's time went for this client, phase by phase in the order they run. A phase
/// the round did not go through (the update was resumed, the round was missed) is zero; a
/// secure-aggregation round puts its key exchange, masking and unmasking under `upload`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RoundTimings {
    /// Long-polling until this round was open, from the start of [`Client::participate`]
    /// (in [`Client::run`]: from the end of the client's previous round).
    pub wait: Duration,
    /// Asking to take part.
    pub join: Duration,
    /// The global model (and TorchScript module): from the cache or downloaded and verified.
    pub download: Duration,
    /// Local training (the [`Trainer`]).
    pub train: Duration,
    /// `local − global` (its record on disk, for a restarted client to upload it again, is
    /// written while the upload is under way).
    pub record: Duration,
    /// Encoding the delta as the round asks (safetensors, or its compression).
    pub seal: Duration,
    /// Sealing the update to the round key (whole, or chunk by chunk as it goes) and sending it
    /// until the server acknowledged it (folded and durable).
    pub upload: Duration,
    /// After the acknowledgement: marking the round uploaded on disk.
    pub finish: Duration,
    /// When the poll that found the round open returned, in µs since the Unix epoch.
    pub seen_unix_us: u64,
    /// When the server's acknowledgement arrived, in µs since the Unix epoch (0: none did).
    pub acked_unix_us: u64,
}

impl RoundTimings {
    /// The phases as (name, time) pairs, in order.
    pub fn phases(&self) -> [(&'static str, Duration); 8] {
        [
            ("wait", self.wait),
            ("join", self.join),
            ("download", self.download),
            ("train", self.train),
            ("record", self.record),
            ("seal", self.seal),
            ("upload", self.upload),
            ("finish", self.finish),
        ]
    }
}

pub(crate) fn now_unix_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RoundOutcome {
    /// The server acknowledged the update (`accepted` counts the round's updates so far, when
    /// the acknowledgement reached us).
    Uploaded { accepted: Option<u32> },
    /// Resumed after a restart: the update trained before it was uploaded now.
    Resumed { accepted: Option<u32> },
    /// The deadline came first and the task says to skip.
    Skipped,
    /// The round closed before our update arrived (the server answered 409).
    Missed { reason: String },
    /// The server refused the update as not selected for an attempt it had admitted this
    /// client to, even after the client joined again (see [`Client::participate`]).
    NotSelected { reason: String },
    /// The attempt was abandoned (too few updates by its deadline, too many secure-aggregation
    /// dropouts); the server retries the round, and this client joins the retry with the same
    /// update.
    Abandoned { reason: String },
}

impl RoundOutcome {
    /// The outcome's name in reports (`uploaded`, `resumed`, `skipped`, `missed`,
    /// `not_selected`, `abandoned`).
    pub fn name(&self) -> &'static str {
        match self {
            RoundOutcome::Uploaded { .. } => "uploaded",
            RoundOutcome::Resumed { .. } => "resumed",
            RoundOutcome::Skipped => "skipped",
            RoundOutcome::Missed { .. } => "missed",
            RoundOutcome::NotSelected { .. } => "not_selected",
            RoundOutcome::Abandoned { .. } => "abandoned",
        }
    }
}

/// A round attempt a client dealt with (contributed to, skipped or missed): its polls wait for
/// a later round, or for a later attempt of this round, which wants the client's update again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attempt {
    pub round: u64,
    pub attempt: u32,
}

impl RoundReport {
    /// The attempt this report dealt with.
    pub fn dealt_with(&self) -> Attempt {
        Attempt {
            round: self.round,
            attempt: self.attempt,
        }
    }
}

/// How often in a row an upload may be refused as `not_selected` before the client gives the
/// attempt up (it rejoins after each: a selection that went missing is made again).
const REJOINS: u32 = 3;

/// What [`Client::run`] did before the task ended.
#[derive(Debug, Clone, PartialEq)]
pub struct RunSummary {
    pub rounds: Vec<RoundReport>,
    pub final_state: TaskState,
}

/// One enrolled client of one server.
pub struct Client {
    pub(crate) conn: Connection,
    pub(crate) state: StateDir,
    pub(crate) id: String,
    pub(crate) config: ClientConfig,
    /// Per task, the last round whose evaluation this client dealt with (evaluated, declined
    /// or refused): polls wait for a later one.
    evaluated: std::sync::Mutex<std::collections::HashMap<String, u64>>,
}

pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// The largest model whose cache write a download does not wait for.
const CACHED_IN_BACKGROUND: usize = 64 << 20;

/// Runs blocking work on one of the runtime's blocking threads without waiting for it (at once
/// when there is no runtime): writes to the client's cache that the round need not wait for.
fn in_background(f: impl FnOnce() + Send + 'static) {
    match tokio::runtime::Handle::try_current() {
        Ok(h) => drop(h.spawn_blocking(f)),
        Err(_) => f(),
    }
}

/// Runs blocking work (training) without stalling the async runtime's other tasks.
pub(crate) fn blocking<R>(f: impl FnOnce() -> R) -> R {
    match tokio::runtime::Handle::try_current() {
        Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(f)
        }
        _ => f(),
    }
}

impl Client {
    /// Opens the state directory and authenticates: with the stored credentials when there are
    /// some, else by enrolling with `enrolment_token` (and storing what the server returns).
    pub async fn connect(config: ClientConfig, enrolment_token: Option<&str>) -> Result<Client> {
        let state = StateDir::open(&config.state_dir)?;
        let conn = Connection::new(
            &config.server,
            &config.ca,
            config.identity.as_ref(),
            config.retry,
        )?;
        let creds = match state.credentials()? {
            Some(creds) => {
                tracing::debug!(client = %creds.client_id, "using stored credentials");
                creds
            }
            None => {
                let token = enrolment_token.ok_or_else(|| ClientError::State {
                    dir: config.state_dir.clone(),
                    message: "holds no credentials and no enrolment token was given: pass --token (from `hora-server admin enrol`)".into(),
                })?;
                // The identity that signs this client's secure-aggregation keys, made before
                // enrolling so that the server registers its public half with the client.
                let identity = match state.identity()? {
                    Some(identity) => identity,
                    None => state.create_identity()?,
                };
                // Our own secret, recorded before it is sent: enrolment is then idempotent, and
                // retried like any other request (a repeat whose first answer was lost gets the
                // same credentials; so does a client restarted meanwhile).
                let request = EnrolRequest {
                    secret: Some(state.enrolment_secret()?),
                    label: config.label.clone(),
                    identity_key: Some(hex::encode(identity.public_key())),
                };
                let creds: Credentials = conn
                    .json("enrolling", || {
                        conn.request(Method::POST, "/v1/enrol", Duration::ZERO)
                            .bearer_auth(token)
                            .json(&request)
                    })
                    .await?;
                state.save_enrolled(&creds)?;
                tracing::info!(client = %creds.client_id, "enrolled");
                creds
            }
        };
        Ok(Client {
            conn: conn.with_token(format!("{}.{}", creds.client_id, creds.secret)),
            state,
            id: creds.client_id,
            config,
            evaluated: Default::default(),
        })
    }

    /// This client's id (as the server and its operators know it).
    pub fn id(&self) -> &str {
        &self.id
    }

    pub fn state(&self) -> &StateDir {
        &self.state
    }

    /// The task's state; held open up to `wait` (at most the server's cap) until a round later
    /// than `after` opens, or a later attempt of `after`'s round.
    pub async fn poll(
        &self,
        task: &str,
        after: Option<Attempt>,
        wait: Duration,
    ) -> Result<PollResponse> {
        let mut path = format!(
            "/v1/tasks/{task}/poll?wait_ms={}&evaluated={}",
            wait.as_millis(),
            self.evaluated_upto(task)
        );
        if let Some(a) = after {
            path.push_str(&format!("&after={}&attempt={}", a.round, a.attempt));
        }
        self.conn
            .json("polling", || self.conn.request(Method::GET, &path, wait))
            .await
    }

    /// Asks to take part in the open round.
    pub async fn join(&self, task: &str) -> Result<JoinResponse> {
        let path = format!("/v1/tasks/{task}/join");
        self.conn
            .json("joining", || {
                self.conn.request(Method::POST, &path, Duration::ZERO)
            })
            .await
    }

    /// The global model with `digest`: from the cache, else downloaded and verified.
    pub async fn model(&self, task: &str, digest: &ModelDigest) -> Result<Model> {
        let (state, d, limits) = (self.state.clone(), *digest, self.config.limits);
        let cached = tokio::task::spawn_blocking(move || state.cached_model(&d, &limits)).await;
        if let Ok(Some(m)) = cached {
            return Ok(m);
        }
        // Pinned to the digest: in an asynchronous task the version may move on meanwhile, and
        // the server still hands out the one the offer names.
        let path = format!("/v1/tasks/{task}/model?digest={}", digest.to_hex());
        let mut resume = true;
        let (model, bytes) = loop {
            let what = "downloading the model";
            let (bytes, resumed) = match self.download(what, &path, resume).await {
                Ok(got) => got,
                Err(e) if e.code() == Some(&ErrorCode::RoundClosed) => {
                    return Err(ClientError::RoundMovedOn(e.to_string()))
                }
                Err(e) => return Err(e),
            };
            match Model::from_safetensors(&bytes, &self.config.limits) {
                Ok(model) if model.digest() == *digest || !resumed => break (model, bytes),
                Err(e) if !resumed => return Err(e.into()),
                // A resumed download that does not make the model: once more, whole.
                _ => {
                    tracing::warn!(
                        "{what}: the resumed download did not make the model; downloading it whole"
                    );
                    resume = false;
                }
            }
        };
        let got = model.digest();
        if got != *digest {
            return Err(ClientError::RoundMovedOn(format!(
                "the global model is now {}, the round trained from {}",
                got.to_hex(),
                digest.to_hex()
            )));
        }
        // The cache saves a download after a restart or for a retried round (and keeps a
        // task's frozen base); a small model's round need not wait for the write. A large one's
        // does: its bytes (as downloaded, no copy) go before the model is trained and its update
        // encoded, so that a client holds two copies of the model at most (three of a frozen
        // base for a moment, while it is merged with the round's model).
        let (state, digest) = (self.state.clone(), *digest);
        let large = bytes.len() > CACHED_IN_BACKGROUND;
        let write = move || {
            if let Err(e) = state.cache_model_bytes(&digest, &bytes) {
                tracing::warn!(error = %e, "caching the global model failed");
            }
        };
        match large {
            true => drop(tokio::task::spawn_blocking(write).await),
            false => in_background(write),
        }
        Ok(model)
    }

    /// The task's TorchScript module (hex SHA-256 `digest`), downloaded once and verified.
    pub async fn module(&self, task: &str, digest: &str) -> Result<PathBuf> {
        if digest.len() != 64 || !digest.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(ClientError::Protocol(format!(
                "the task names module `{digest}`, which is not a hex SHA-256"
            )));
        }
        let path = self.state.module_path(digest);
        if path.exists() {
            return Ok(path);
        }
        let (bytes, _) = self
            .download(
                "downloading the TorchScript module",
                &format!("/v1/tasks/{task}/module"),
                true,
            )
            .await?;
        let got = hora_common::sha256_hex(&bytes);
        if got != digest {
            return Err(ClientError::Protocol(format!(
                "the TorchScript module's SHA-256 is {got}, but the task names {digest}"
            )));
        }
        self.state.save_module(digest, &bytes)
    }

    /// A download, sent again (within the retry budget) when its body breaks off midway, as it
    /// does when the server is restarted while it answers.
    /// Downloads `path`: the bytes, and whether an attempt resumed a body that broke off (with
    /// `resume`, an attempt asks for the rest of the same blob only: `Range` and `If-Range`;
    /// without, each starts from the first byte).
    async fn download(&self, what: &str, path: &str, resume: bool) -> Result<(Vec<u8>, bool)> {
        let start = Instant::now();
        let mut attempt = 0u32;
        let mut resumed = false;
        // What arrived of a download that broke off, and the ETag it came with.
        let mut got = Partial::default();
        loop {
            attempt += 1;
            if !resume {
                got = Partial::default();
            }
            resumed |= !got.bytes.is_empty();
            match self.download_once(what, path, &mut got).await {
                Err(Cut(e)) if start.elapsed() < self.config.retry.budget => {
                    let delay = self.config.retry.backoff(attempt);
                    tracing::warn!(
                        "{what}: the answer broke off after {} bytes ({e}); asking for the rest in {:.1} s",
                        got.bytes.len(),
                        delay.as_secs_f64()
                    );
                    tokio::time::sleep(delay).await;
                }
                Err(Cut(e)) => return Err(ClientError::Protocol(format!("{what}: {e}"))),
                Ok(result) => return result.map(|()| (got.bytes, resumed)),
            }
        }
    }

    /// One download into `got`, from where an earlier attempt stopped when the server can: the
    /// answer (or a refusal) in `Ok`, a body that broke off in `Err`.
    async fn download_once(
        &self,
        what: &str,
        path: &str,
        got: &mut Partial,
    ) -> Result<Result<()>, Cut> {
        let max = self.config.limits.max_bytes;
        let resume = got.etag.clone().filter(|_| !got.bytes.is_empty());
        let from = got.bytes.len();
        let sent = self
            .conn
            .send(what, || {
                let req = self.conn.request(Method::GET, path, Duration::ZERO);
                match &resume {
                    Some(etag) => req
                        .header(reqwest::header::RANGE, format!("bytes={from}-"))
                        .header(reqwest::header::IF_RANGE, etag.as_str()),
                    None => req,
                }
            })
            .await;
        let (resp, _) = match sent {
            Ok(sent) => sent,
            Err(e) => return Ok(Err(e)),
        };
        let mut resp = match check(resp).await {
            Ok(resp) => resp,
            Err(e) => return Ok(Err(e)),
        };
        let too_large = || {
            ClientError::Protocol(format!(
                "{what}: the answer exceeds the client's limit of {max} bytes"
            ))
        };
        // The rest of the blob we have the start of, or (200) all of it again.
        let continues = resp.status() == reqwest::StatusCode::PARTIAL_CONTENT;
        let header = |name| {
            resp.headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        let etag = header(reqwest::header::ETAG);
        if continues {
            // The rest of the very blob asked for, to its end: anything else starts again.
            let range = header(reqwest::header::CONTENT_RANGE).unwrap_or_default();
            let rest = content_range(&range).filter(|&(first, last, total)| {
                resume.is_some()
                    && first == from as u64
                    && last.checked_add(1) == Some(total)
                    && resp.content_length().is_none_or(|n| n == total - first)
                    && etag == resume
            });
            if rest.is_none() {
                *got = Partial::default();
                return Err(Cut(format!(
                    "asked for the bytes from {from} on, the server sent `{range}`"
                )));
            }
            tracing::info!("{what}: resuming at byte {from}");
        } else {
            got.bytes.clear();
        }
        got.etag = etag;
        let already = got.bytes.len() as u64;
        if resp.content_length().is_some_and(|n| already + n > max) {
            return Ok(Err(too_large()));
        }
        // Read chunk by chunk against the limit: an answer without a Content-Length (or one that
        // runs past it) is cut off at the limit, not buffered whole.
        got.bytes
            .reserve(resp.content_length().unwrap_or(0) as usize);
        while let Some(chunk) = resp.chunk().await.map_err(|e| Cut(e.to_string()))? {
            if (got.bytes.len() + chunk.len()) as u64 > max {
                return Ok(Err(too_large()));
            }
            got.bytes.extend_from_slice(&chunk);
        }
        Ok(Ok(()))
    }

    /// What round `offer` trains from: the global model (with the frozen base, once downloaded
    /// and then kept by its digest, for a task that trains part of its model) and, for a
    /// TorchScript task, its module.
    pub(crate) async fn round_inputs(
        &self,
        task: &str,
        offer: &RoundOffer,
    ) -> Result<(Start, Option<PathBuf>)> {
        self.model_inputs(task, &offer.model, offer.frozen_base, &offer.model_kind)
            .await
    }

    /// The model `model` names (with the frozen base `frozen_base` names, for a task that
    /// trains part of its model) and, for a TorchScript task, its module.
    async fn model_inputs(
        &self,
        task: &str,
        model: &ModelDigest,
        frozen_base: Option<ModelDigest>,
        model_kind: &ModelKind,
    ) -> Result<(Start, Option<PathBuf>)> {
        let base = match &frozen_base {
            Some(digest) => Some(self.model(task, digest).await?),
            None => None,
        };
        let global = self.model(task, model).await?;
        let whole = base
            .map(|base| Model::merge(&base, &global))
            .transpose()
            .map_err(|e| {
                ClientError::Protocol(format!(
                    "the task's frozen base and its model do not make one model: {e}"
                ))
            })?;
        let module = match model_kind {
            ModelKind::TorchScript { module_digest } => {
                Some(self.module(task, module_digest).await?)
            }
            ModelKind::Builtin { .. } => None,
        };
        Ok((Start { global, whole }, module))
    }

    /// Encodes `delta` as the round asks, seals it to the round key and uploads it: in one
    /// body, or in chunks when the server takes them and the update is larger than one
    /// ([`Client::upload_encoded`]). `Ok(None)` means an earlier attempt of this upload got
    /// through but its acknowledgement was lost.
    pub async fn upload(
        &self,
        task: &str,
        offer: &RoundOffer,
        delta: &Model,
        meta: &UpdateMeta,
    ) -> Result<Option<UpdateReceipt>> {
        let (plaintext, _) = encode_update(offer, delta)?;
        self.upload_encoded(task, offer, plaintext, meta).await
    }

    /// Uploads an encoded update (its plaintext, before sealing). When the offer says the server
    /// takes chunks and the update is larger than one, it goes as an upload session: each chunk
    /// sealed with its index as it is sent, and a connection cut halfway resumes from the chunk
    /// the server expects next, so what was acknowledged is not sent again; otherwise it is
    /// sealed whole and sent in one body ([`Client::upload_sealed`]). The CPU work of sealing
    /// is done off the async runtime.
    pub async fn upload_encoded(
        &self,
        task: &str,
        offer: &RoundOffer,
        plaintext: Vec<u8>,
        meta: &UpdateMeta,
    ) -> Result<Option<UpdateReceipt>> {
        let plaintext = std::sync::Arc::new(plaintext);
        match offer
            .upload_chunk_bytes
            .filter(|&chunk| chunk > 0 && plaintext.len() as u64 > chunk)
        {
            Some(_) => self.upload_chunked(task, offer, plaintext, meta).await,
            None => {
                let (id, t, o) = (self.id.clone(), task.to_string(), offer.clone());
                let sealed = tokio::task::spawn_blocking(move || {
                    envelope::seal(&plaintext, &o.round_key, &o.binding(&t, &id))
                })
                .await
                .map_err(|e| ClientError::Training(format!("sealing the update failed: {e}")))??;
                self.upload_sealed(task, offer, sealed, meta).await
            }
        }
    }

    /// [`Client::upload_encoded`] as an upload session, in the offer's chunks.
    async fn upload_chunked(
        &self,
        task: &str,
        offer: &RoundOffer,
        plaintext: std::sync::Arc<Vec<u8>>,
        meta: &UpdateMeta,
    ) -> Result<Option<UpdateReceipt>> {
        let hashed = plaintext.clone();
        let digest: [u8; 32] = tokio::task::spawn_blocking(move || {
            let digest = ring::digest::digest(&ring::digest::SHA256, &hashed);
            digest.as_ref().try_into().expect("SHA-256 is 32 bytes")
        })
        .await
        .map_err(|e| ClientError::Training(format!("hashing the update failed: {e}")))?;
        let hex_digest = hex::encode(digest);
        let length = plaintext.len() as u64;
        let uploads = format!("/v1/tasks/{task}/rounds/{}/uploads", offer.round);
        let start = UploadStart {
            digest: hex_digest.clone(),
            length,
        };
        let meta = serde_json::to_string(meta).expect("metadata serialises");
        let mut setbacks = Setbacks {
            policy: self.conn.retry_policy(),
            upload: &hex_digest,
            stalls: 0,
            restarts: 0,
            again: false,
        };
        'session: loop {
            // Where the session stands (a new one, or the rest of this plaintext's).
            let mut at: UploadSession = loop {
                let (resp, attempts) = self
                    .conn
                    .send("starting the upload", || {
                        self.conn
                            .request(Method::POST, &uploads, Duration::ZERO)
                            .json(&start)
                    })
                    .await?;
                match receipt(resp, setbacks.attempts(attempts)).await {
                    Ok(Some(at)) => break at,
                    Ok(None) => return Ok(None),
                    // The request an earlier connection carried is still ending there.
                    Err(e) if e.code() == Some(&ErrorCode::UploadInProgress) => {
                        setbacks.stalled(&e).await?
                    }
                    Err(e) => return Err(e),
                }
            };
            // (In the chunks the session cuts: a restarted server may cut others than offered.)
            if at.digest != hex_digest
                || at.length != length
                || at.chunk_bytes < MIN_UPLOAD_CHUNK_BYTES
            {
                return Err(ClientError::Protocol(format!(
                    "the server answered the start of upload {hex_digest} ({length} bytes) with another upload ({} of {} bytes, chunks of {})",
                    at.digest, at.length, at.chunk_bytes
                )));
            }
            let chunk_bytes = at.chunk_bytes;
            if at.received > 0 && at.received < length {
                tracing::info!(
                    chunk = at.next_chunk,
                    chunks = at.chunks,
                    received = at.received,
                    "resuming the upload where the server's copy ends"
                );
            }
            // The chunks the server does not hold yet, one after another.
            while at.received < length {
                let index = at.next_chunk;
                let range = envelope::chunk_range(length, chunk_bytes, index);
                let Some(range) = range.filter(|r| r.start == at.received) else {
                    return Err(ClientError::Protocol(format!(
                        "the server expects chunk {index} of upload {hex_digest}, which does not start at the {} bytes it says it holds",
                        at.received
                    )));
                };
                let (id, t, o, p) = (
                    self.id.clone(),
                    task.to_string(),
                    offer.clone(),
                    plaintext.clone(),
                );
                let sealed = tokio::task::spawn_blocking(move || {
                    let binding = o.binding(&t, &id);
                    envelope::seal_chunk_of(&p, &digest, chunk_bytes, index, &o.round_key, &binding)
                })
                .await
                .map_err(|e| ClientError::Training(format!("sealing a chunk failed: {e}")))??;
                let path = format!("{uploads}/{hex_digest}/chunks/{index}");
                let (resp, attempts) = self
                    .conn
                    .send("uploading a chunk of the update", || {
                        self.conn
                            .request(Method::PUT, &path, Duration::ZERO)
                            .body(sealed.clone())
                    })
                    .await?;
                match receipt::<UploadSession>(resp, setbacks.attempts(attempts)).await {
                    Ok(Some(next)) => {
                        if next.next_chunk != index + 1 || next.received != range.end {
                            return Err(ClientError::Protocol(format!(
                                "the server took chunk {index} of upload {hex_digest} but says it holds {} bytes, next chunk {}",
                                next.received, next.next_chunk
                            )));
                        }
                        setbacks.stalls = 0;
                        at = next;
                    }
                    Ok(None) => return Ok(None),
                    // An acknowledgement lost on a cut connection (the chunk is in), the request
                    // that connection carried still ending on the server, or a chunk that came
                    // too slowly: ask where the upload stands.
                    Err(e)
                        if matches!(
                            e.code(),
                            Some(
                                ErrorCode::ChunkOutOfOrder
                                    | ErrorCode::UploadInProgress
                                    | ErrorCode::UploadTooSlow
                            )
                        ) =>
                    {
                        tracing::info!(error = %e, "asking the server where the upload stands");
                        setbacks.stalled(&e).await?;
                        continue 'session;
                    }
                    Err(e) if e.code() == Some(&ErrorCode::UploadUnknown) => {
                        setbacks.lost(e)?;
                        continue 'session;
                    }
                    Err(e) => return Err(e),
                }
            }
            let path = format!("{uploads}/{hex_digest}/complete");
            loop {
                let (resp, attempts) = self
                    .conn
                    .send("completing the upload", || {
                        self.conn
                            .request(Method::POST, &path, Duration::ZERO)
                            .header(UPDATE_META_HEADER, &meta)
                    })
                    .await?;
                match receipt(resp, setbacks.attempts(attempts)).await {
                    Ok(done) => return Ok(done),
                    // A completion of this upload is still under way there: its outcome.
                    Err(e) if e.code() == Some(&ErrorCode::UploadInProgress) => {
                        setbacks.stalled(&e).await?
                    }
                    Err(e) if e.code() == Some(&ErrorCode::ChunkOutOfOrder) => {
                        setbacks.stalled(&e).await?;
                        continue 'session;
                    }
                    Err(e) if e.code() == Some(&ErrorCode::UploadUnknown) => {
                        setbacks.lost(e)?;
                        continue 'session;
                    }
                    Err(e) => return Err(e),
                }
            }
        }
    }

    /// `delta` encoded as the round asks ([`RoundOffer::compression`]) and sealed to the round
    /// key of `offer`, bound to the task, round, this client and the base model. What a
    /// compression leaves out is dropped: [`Client::contribute`] keeps it for the next round
    /// (error feedback); [`Client::seal_update`] hands it back. CPU work the size of the model.
    pub fn seal(&self, task: &str, offer: &RoundOffer, delta: &Model) -> Result<Vec<u8>> {
        self.seal_update(task, offer, delta)
            .map(|(sealed, _)| sealed)
    }

    /// [`Client::seal`], and what the encoding left out when the round's compression keeps it
    /// (top-k: the values not sent, and the rounding of those sent), to be added to the next
    /// round's update once the server has taken this one.
    pub fn seal_update(
        &self,
        task: &str,
        offer: &RoundOffer,
        delta: &Model,
    ) -> Result<(Vec<u8>, Option<Model>)> {
        seal_update(&self.id, task, offer, delta)
    }

    /// Uploads an update sealed by [`Client::seal`] (see [`Client::upload`]).
    pub async fn upload_sealed(
        &self,
        task: &str,
        offer: &RoundOffer,
        sealed: Vec<u8>,
        meta: &UpdateMeta,
    ) -> Result<Option<UpdateReceipt>> {
        let path = format!("/v1/tasks/{task}/rounds/{}/update", offer.round);
        let meta = serde_json::to_string(meta).expect("metadata serialises");
        let (resp, attempts) = self
            .conn
            .send("uploading the update", || {
                self.conn
                    .request(Method::POST, &path, Duration::ZERO)
                    .header(UPDATE_META_HEADER, &meta)
                    .body(sealed.clone())
            })
            .await?;
        let receipt = receipt(resp, attempts).await?;
        if receipt.is_none() {
            tracing::info!(
                round = offer.round,
                "an earlier upload attempt was acknowledged"
            );
        }
        Ok(receipt)
    }

    /// Waits for a round this client can contribute to and contributes. `Ok(None)` when the
    /// task has ended.
    pub async fn participate<T: Trainer + ?Sized>(
        &self,
        task: &str,
        trainer: &mut T,
        progress: &mut (dyn FnMut(Progress) + Send),
    ) -> Result<Option<RoundReport>> {
        self.participate_after(task, None, trainer, progress).await
    }

    /// [`Client::participate`] in a round attempt later than `after` (the last one this client
    /// dealt with: a skipped or missed attempt is not tried again, but the retry of an abandoned
    /// attempt is a later attempt of the same round, and wants this client's update again).
    pub async fn participate_after<T: Trainer + ?Sized>(
        &self,
        task: &str,
        mut after: Option<Attempt>,
        trainer: &mut T,
        progress: &mut (dyn FnMut(Progress) + Send),
    ) -> Result<Option<RoundReport>> {
        let waiting = Instant::now();
        let mut rejoins = 0;
        loop {
            let poll = self.poll(task, after, self.config.poll_wait).await?;
            if let Some(offer) = &poll.evaluation {
                self.evaluate_once(task, offer, trainer).await;
            }
            let seen = Instant::now();
            let seen_unix_us = now_unix_us();
            match poll.state {
                TaskState::Running => {}
                TaskState::Paused => {
                    tracing::info!("task `{task}` is paused; waiting");
                    tokio::time::sleep(Duration::from_millis(poll.retry_after_ms)).await;
                    continue;
                }
                TaskState::Finished | TaskState::Stopped => return Ok(None),
            }
            let Some(open) = poll.open_round else {
                continue; // the long poll ran out with nothing open: poll again
            };
            let current = Attempt {
                round: open,
                attempt: poll.attempt.unwrap_or(0),
            };
            if !poll.wants_update(after.map(|a| (a.round, a.attempt))) {
                // In already, or an attempt dealt with: wait for a later one.
                if poll.contributed {
                    after = Some(current);
                }
                continue;
            }
            let join = match self.join(task).await {
                Ok(j) => j,
                Err(e) if e.code() == Some(&ErrorCode::TaskEnded) => return Ok(None),
                Err(e) if e.code() == Some(&ErrorCode::AlreadyContributed) => {
                    after = Some(current);
                    continue;
                }
                Err(e) => return Err(e),
            };
            match join.offer {
                Some(offer) => {
                    let joined = Instant::now();
                    let mut report = self.contribute(task, &offer, trainer, progress).await?;
                    if matches!(report.outcome, RoundOutcome::NotSelected { .. })
                        && rejoins < REJOINS
                    {
                        // Refused as not selected for an attempt we were told we are in: join
                        // again (the update is kept, and goes up once we are in).
                        rejoins += 1;
                        tracing::warn!(round = offer.round, attempt = offer.attempt, "the server no longer lists this client as selected; joining the round again");
                        continue;
                    }
                    report.timings.wait = seen - waiting;
                    report.timings.join = joined - seen;
                    report.timings.seen_unix_us = seen_unix_us;
                    let t = &report.timings;
                    tracing::debug!(
                        round = report.round,
                        wait_ms = t.wait.as_secs_f64() * 1e3,
                        join_ms = t.join.as_secs_f64() * 1e3,
                        download_ms = t.download.as_secs_f64() * 1e3,
                        train_ms = t.train.as_secs_f64() * 1e3,
                        record_ms = t.record.as_secs_f64() * 1e3,
                        seal_ms = t.seal.as_secs_f64() * 1e3,
                        upload_ms = t.upload.as_secs_f64() * 1e3,
                        finish_ms = t.finish.as_secs_f64() * 1e3,
                        "round timings"
                    );
                    return Ok(Some(report));
                }
                None => {
                    tracing::debug!(round = open, "not selected; waiting for the next round");
                    after = Some(current);
                    tokio::time::sleep(Duration::from_millis(join.retry_after_ms.min(1_000))).await;
                }
            }
        }
    }

    /// The last round of `task` whose evaluation this client dealt with (0: none).
    fn evaluated_upto(&self, task: &str) -> u64 {
        let evaluated = self.evaluated.lock().unwrap_or_else(|e| e.into_inner());
        evaluated.get(task).copied().unwrap_or(0)
    }

    /// [`Client::evaluate`], once per round's evaluation (dealt with if it fails: an
    /// evaluation is never worth failing the training over, and it is not retried).
    async fn evaluate_once<T: Trainer + ?Sized>(
        &self,
        task: &str,
        offer: &EvaluationOffer,
        trainer: &mut T,
    ) {
        if offer.round <= self.evaluated_upto(task) {
            return;
        }
        match self.evaluate(task, offer, trainer).await {
            Ok(Some(receipt)) => {
                tracing::info!(
                    round = offer.round,
                    reports = receipt.reports,
                    "evaluated the round's model and reported"
                )
            }
            Ok(None) => {
                tracing::debug!(
                    round = offer.round,
                    "asked to evaluate, but the trainer has no held-out data; declined"
                )
            }
            Err(e) => {
                tracing::warn!(round = offer.round, error = %e, "federated evaluation of the round's model failed; going on without it")
            }
        }
        let mut evaluated = self.evaluated.lock().unwrap_or_else(|e| e.into_inner());
        let upto = evaluated.entry(task.to_string()).or_default();
        *upto = (*upto).max(offer.round);
    }

    /// Evaluates the model `offer` names through `trainer` and reports the result; `Ok(None)`
    /// when the trainer declines (no held-out data). A report the server took already (a retry
    /// whose answer was lost) is acknowledged again.
    pub async fn evaluate<T: Trainer + ?Sized>(
        &self,
        task: &str,
        offer: &EvaluationOffer,
        trainer: &mut T,
    ) -> Result<Option<EvaluationReceipt>> {
        let (start, module) = self
            .model_inputs(task, &offer.model, offer.frozen_base, &offer.model_kind)
            .await?;
        let request = EvaluateRequest {
            task,
            round: offer.round,
            model_kind: &offer.model_kind,
            module,
        };
        let Some(report) = evaluation_report(trainer, start.model(), request)? else {
            return Ok(None);
        };
        let path = format!("/v1/tasks/{task}/evaluations/{}", offer.round);
        let receipt = self
            .conn
            .json("reporting an evaluation", || {
                self.conn
                    .request(Method::POST, &path, Duration::ZERO)
                    .json(&report)
            })
            .await?;
        Ok(Some(receipt))
    }

    /// Trains on, seals and uploads for the round `offer` describes.
    pub async fn contribute<T: Trainer + ?Sized>(
        &self,
        task: &str,
        offer: &RoundOffer,
        trainer: &mut T,
        progress: &mut (dyn FnMut(Progress) + Send),
    ) -> Result<RoundReport> {
        if let Some(secure) = &offer.secure_aggregation {
            return self
                .contribute_secure(task, offer, secure, trainer, progress)
                .await;
        }
        // An update trained for this round and not yet taken: not uploaded (a restart, or a
        // refusal that kept it), or uploaded to an earlier attempt that was abandoned (its retry
        // trains from the same base, and takes the same update).
        let saved = self.state.round(task)?.filter(|s| {
            s.round == offer.round
                && s.base == offer.model
                && (!s.uploaded || s.attempt < offer.attempt)
        });
        let resumed = match saved {
            None => None,
            Some(saved) => {
                let (state, limits) = (self.state.clone(), self.config.limits);
                let (t, model) = (task.to_string(), offer.model);
                tokio::task::spawn_blocking(move || {
                    let delta = state.trained_delta(&t, &limits)?;
                    // A delta the model's layout no longer fits would be refused after every
                    // restart.
                    let fits = state
                        .cached_model(&model, &limits)
                        .is_none_or(|global| global.spec() == delta.spec());
                    fits.then_some((delta, saved))
                })
                .await
                .ok()
                .flatten()
            }
        };
        let started = Instant::now();
        let mut timings = RoundTimings::default();
        let (delta, record, resumed) = match resumed {
            Some((delta, record)) => {
                tracing::info!(
                    round = offer.round,
                    attempt = offer.attempt,
                    "uploading the update trained for this round before"
                );
                (delta, record, true)
            }
            None => {
                let (start, module) = match self.round_inputs(task, offer).await {
                    Ok(inputs) => inputs,
                    Err(ClientError::RoundMovedOn(reason)) => {
                        return Ok(RoundReport {
                            round: offer.round,
                            attempt: offer.attempt,
                            outcome: RoundOutcome::Missed { reason },
                            num_examples: 0,
                            metrics: Metrics::default(),
                            train_time: started.elapsed(),
                            timings: RoundTimings {
                                download: started.elapsed(),
                                ..timings
                            },
                        })
                    }
                    Err(e) => return Err(e),
                };
                timings.download = started.elapsed();
                let training = Instant::now();
                let outcome = train_until(
                    trainer,
                    task,
                    offer,
                    &start,
                    module,
                    offer.deadline_unix_ms,
                    progress,
                )?;
                timings.train = training.elapsed();
                let report = |outcome: RoundOutcome| RoundReport {
                    round: offer.round,
                    attempt: offer.attempt,
                    outcome,
                    num_examples: 0,
                    metrics: Metrics::default(),
                    train_time: started.elapsed(),
                    timings,
                };
                if outcome.stopped_early && offer.training.on_deadline == DeadlinePolicy::Skip {
                    tracing::warn!(round = offer.round, "the deadline came before training finished; skipping the round as the task says");
                    return Ok(report(RoundOutcome::Skipped));
                }
                if outcome.num_examples == 0 {
                    tracing::warn!(
                        round = offer.round,
                        "no examples were trained on before the deadline; skipping the round"
                    );
                    return Ok(report(RoundOutcome::Skipped));
                }
                let recording = Instant::now();
                let mut delta = start.delta(&outcome.weights)?;
                // Error feedback: what earlier rounds left out goes with this update (and is in
                // the delta recorded for a restart, which does not add it again).
                if offer
                    .compression
                    .as_ref()
                    .is_some_and(|c| c.error_feedback())
                {
                    let (state, t, limits) =
                        (self.state.clone(), task.to_string(), self.config.limits);
                    delta = tokio::task::spawn_blocking(move || carry(&state, &t, &limits, delta))
                        .await
                        .map_err(|e| ClientError::State {
                            dir: self.config.state_dir.clone(),
                            message: format!("reading the error-feedback residual failed: {e}"),
                        })??;
                }
                let record = RoundState {
                    round: offer.round,
                    attempt: offer.attempt,
                    base: offer.model,
                    num_examples: outcome.num_examples,
                    metrics: outcome.metrics,
                    uploaded: false,
                };
                timings.record = recording.elapsed();
                (delta, record, false)
            }
        };
        let train_time = started.elapsed();
        let meta = UpdateMeta {
            num_examples: record.num_examples,
            metrics: record.metrics,
            contributors: None,
        };
        let sealing = Instant::now();
        let (plaintext, unsent, delta) = {
            let o = offer.clone();
            tokio::task::spawn_blocking(move || {
                encode_update(&o, &delta).map(|(plaintext, unsent)| (plaintext, unsent, delta))
            })
            .await
            .map_err(|e| ClientError::Training(format!("encoding the update failed: {e}")))??
        };
        let uploading = Instant::now();
        timings.seal = uploading - sealing;
        // The record for a restart is written while the update travels (the server answers a
        // restarted client's second upload of a round as a duplicate, whichever delta it is),
        // then what this encoding left out (a restart encodes the recorded delta again, and
        // writes its own).
        let delta = (!resumed).then_some(delta);
        let saving = (delta.is_some() || unsent.is_some()).then(|| {
            let (state, task, record) = (self.state.clone(), task.to_string(), record.clone());
            tokio::task::spawn_blocking(move || {
                if let Some(delta) = delta {
                    state.save_trained(&task, &record, &delta)?;
                }
                match unsent {
                    Some(unsent) => state.save_unsent(&task, &unsent),
                    None => Ok(()),
                }
            })
        });
        let uploaded = self.upload_encoded(task, offer, plaintext, &meta).await;
        timings.upload = uploading.elapsed();
        if let Some(saving) = saving {
            saving.await.map_err(|e| ClientError::State {
                dir: self.config.state_dir.clone(),
                message: format!("recording the trained update failed: {e}"),
            })??;
        }
        let finishing = Instant::now();
        let outcome = match uploaded {
            Ok(receipt) => {
                timings.acked_unix_us = now_unix_us();
                self.state.mark_uploaded(task, &record, offer.attempt)?;
                let accepted = receipt.map(|r| r.accepted);
                if resumed {
                    RoundOutcome::Resumed { accepted }
                } else {
                    RoundOutcome::Uploaded { accepted }
                }
            }
            // Kept for the retry of the round, which takes the same update.
            Err(ClientError::Conflict { error }) if error.code == ErrorCode::RoundAbandoned => {
                RoundOutcome::Abandoned {
                    reason: error.message,
                }
            }
            // Kept for joining again.
            Err(ClientError::Conflict { error }) if error.code == ErrorCode::NotSelected => {
                RoundOutcome::NotSelected {
                    reason: error.message,
                }
            }
            Err(ClientError::Conflict { error })
                if matches!(error.code, ErrorCode::RoundClosed | ErrorCode::TooStale) =>
            {
                // The update can never be accepted now: do not keep it, nor resume it (with
                // error feedback, all of it carries into the next).
                match offer
                    .compression
                    .as_ref()
                    .is_some_and(|c| c.error_feedback())
                {
                    true => self.state.untaken(task)?,
                    false => self.state.clear_round(task)?,
                }
                RoundOutcome::Missed {
                    reason: error.message,
                }
            }
            Err(e) => return Err(e),
        };
        timings.finish = finishing.elapsed();
        Ok(RoundReport {
            round: offer.round,
            attempt: offer.attempt,
            outcome,
            num_examples: record.num_examples,
            metrics: record.metrics,
            train_time,
            timings,
        })
    }

    /// Takes part in rounds until the task ends (or `max_rounds` rounds were contributed to),
    /// calling `on_round` after each. A missed round is reported and the client carries on;
    /// every other refusal ends the run with its error.
    pub async fn run<T: Trainer + ?Sized>(
        &self,
        task: &str,
        trainer: &mut T,
        max_rounds: Option<u64>,
        progress: &mut (dyn FnMut(Progress) + Send),
        on_round: &mut (dyn FnMut(&RoundReport) + Send),
    ) -> Result<RunSummary> {
        let mut rounds = Vec::new();
        while max_rounds.is_none_or(|m| (rounds.len() as u64) < m) {
            // After an abandoned attempt the same round is open again as a later attempt, which
            // the poll finds.
            let last = rounds.last().map(RoundReport::dealt_with);
            match self
                .participate_after(task, last, trainer, progress)
                .await?
            {
                Some(report) => {
                    on_round(&report);
                    rounds.push(report);
                }
                None => break,
            }
        }
        let final_state = self.poll(task, None, Duration::ZERO).await?.state;
        if matches!(final_state, TaskState::Finished | TaskState::Stopped) {
            // No retry of any attempt can want the last update now: do not keep it.
            self.state.clear_round(task)?;
        }
        Ok(RunSummary {
            rounds,
            final_state,
        })
    }
}

/// `delta` with what error feedback carries into it ([`StateDir::carried`]) when that fits the
/// model and is finite. Blocking.
fn carry(state: &StateDir, task: &str, limits: &Limits, mut delta: Model) -> Result<Model> {
    let Some(carried) = state
        .carried(task, limits)
        .filter(|r| r.spec() == delta.spec())
    else {
        return Ok(delta);
    };
    if let Err(e) = carried.check_finite() {
        tracing::warn!("dropping the error-feedback residual: {e}");
        return Ok(delta);
    }
    delta
        .data_mut()
        .iter_mut()
        .zip(carried.data())
        .for_each(|(d, r)| *d += r);
    delta.check_finite()?;
    Ok(delta)
}

/// How a chunked upload fares: answers in a row that moved it no further and fresh starts after
/// the server lost its session (both bounded), and whether some request was sent again (an
/// `already_contributed` answer then means an earlier one got through).
struct Setbacks<'a> {
    policy: &'a RetryPolicy,
    upload: &'a str,
    stalls: u32,
    restarts: u32,
    again: bool,
}

impl Setbacks<'_> {
    /// The attempts to count for a request that took `attempts`: more than one once any was
    /// sent again.
    fn attempts(&mut self, attempts: u32) -> u32 {
        self.again |= attempts > 1;
        u32::from(self.again) + 1
    }

    /// An answer that moved the upload no further (`why`): waits before asking again, or ends
    /// the upload after eight in a row.
    async fn stalled(&mut self, why: &ClientError) -> Result<()> {
        self.stalls += 1;
        if self.stalls > 8 {
            return Err(ClientError::Protocol(format!(
                "upload {} made no progress in {} answers in a row (the last: {why}); retry later",
                self.upload,
                self.stalls - 1
            )));
        }
        tokio::time::sleep(self.policy.backoff(self.stalls)).await;
        Ok(())
    }

    /// The server lost the session (`why`): start again, at most three times.
    fn lost(&mut self, why: ClientError) -> Result<()> {
        self.restarts += 1;
        if self.restarts > 3 {
            return Err(why);
        }
        tracing::info!(error = %why, "the server lost the upload; starting it again");
        self.again = true;
        Ok(())
    }
}

/// `delta` encoded as `offer` asks and sealed for `client` (see [`Client::seal_update`]).
fn seal_update(
    client: &str,
    task: &str,
    offer: &RoundOffer,
    delta: &Model,
) -> Result<(Vec<u8>, Option<Model>)> {
    let (plaintext, unsent) = encode_update(offer, delta)?;
    let sealed = envelope::seal(&plaintext, &offer.round_key, &offer.binding(task, client))?;
    Ok((sealed, unsent))
}

/// `delta` encoded as `offer` asks (its plaintext before sealing), and what the encoding left
/// out when the round's compression keeps it (error feedback).
fn encode_update(offer: &RoundOffer, delta: &Model) -> Result<(Vec<u8>, Option<Model>)> {
    match &offer.compression {
        None => Ok((delta.to_safetensors(), None)),
        Some(compression) => {
            compression.validate(&delta.spec()).map_err(|m| {
                ClientError::Protocol(format!("the task's compression is unusable here: {m}"))
            })?;
            let mut unsent = delta.clone();
            let bytes = compression.encode(&mut unsent, &mut rand::rng())?;
            Ok((bytes, compression.error_feedback().then_some(unsent)))
        }
    }
}

/// What has arrived of a download, and the ETag of the blob it is the start of.
#[derive(Default)]
struct Partial {
    bytes: Vec<u8>,
    etag: Option<String>,
}

/// A download whose body broke off before its end, or whose resumption did not continue it
/// (worth sending again).
struct Cut(String);

/// `bytes FIRST-LAST/TOTAL` of a `Content-Range` header.
fn content_range(value: &str) -> Option<(u64, u64, u64)> {
    let (range, total) = value.strip_prefix("bytes ")?.split_once('/')?;
    let (first, last) = range.split_once('-')?;
    let (first, last) = (first.parse().ok()?, last.parse().ok()?);
    (first <= last).then_some((first, last, total.parse().ok()?))
}

/// Trains round `offer` from `start` until `deadline_unix_ms`, less a tenth of the time left
/// (at most 5 s) for what must follow (sealing or masking, and the upload).
#[allow(clippy::too_many_arguments)]
pub(crate) fn train_until<T: Trainer + ?Sized>(
    trainer: &mut T,
    task: &str,
    offer: &RoundOffer,
    start: &Start,
    module: Option<PathBuf>,
    deadline_unix_ms: u64,
    progress: &mut (dyn FnMut(Progress) + Send),
) -> Result<crate::trainer::TrainOutcome> {
    let remaining = Duration::from_millis(deadline_unix_ms.saturating_sub(now_ms()));
    let trainable = start.trainable();
    let request = TrainRequest {
        task,
        round: offer.round,
        config: &offer.training,
        model_kind: &offer.model_kind,
        module,
        trainable: trainable.as_deref(),
        deadline: Instant::now() + remaining - (remaining / 10).min(Duration::from_secs(5)),
        progress,
    };
    blocking(|| trainer.train(start.model(), request))
}

/// `trainer`'s evaluation of `model` as a report the server takes, or `None` when it declines.
pub(crate) fn evaluation_report<T: Trainer + ?Sized>(
    trainer: &mut T,
    model: &Model,
    request: EvaluateRequest<'_>,
) -> Result<Option<EvaluationReport>> {
    let Some(evaluation) = blocking(|| trainer.evaluate(model, request))? else {
        return Ok(None);
    };
    let report = EvaluationReport {
        num_examples: evaluation.examples,
        loss: Some(evaluation.loss).filter(|l| (0.0..=MAX_LOSS).contains(l)),
        accuracy: Some(evaluation.accuracy).filter(|a| (0.0..=1.0).contains(a)),
    };
    report.check().map_err(|e| {
        ClientError::Training(format!("the trainer's evaluation cannot be reported: {e}"))
    })?;
    Ok(Some(report))
}

/// A JSON receipt, or `None` when the refusal says an earlier attempt of this request (one of
/// `attempts`) already got through and only its acknowledgement was lost.
pub(crate) async fn receipt<T: serde::de::DeserializeOwned>(
    resp: reqwest::Response,
    attempts: u32,
) -> Result<Option<T>> {
    match check(resp).await {
        Ok(resp) => {
            let bytes = resp
                .bytes()
                .await
                .map_err(|e| ClientError::Protocol(format!("reading the receipt: {e}")))?;
            serde_json::from_slice(&bytes)
                .map(Some)
                .map_err(|e| ClientError::Protocol(format!("decoding the receipt: {e}")))
        }
        Err(e) if attempts > 1 && e.code() == Some(&ErrorCode::AlreadyContributed) => Ok(None),
        Err(e) => Err(e),
    }
}

/// What a round trains from.
pub(crate) struct Start {
    /// The round's model: what the update is the difference to.
    pub(crate) global: Model,
    /// For a task that trains part of its model: the round's model with the frozen base.
    pub(crate) whole: Option<Model>,
}

impl Start {
    /// What the trainer starts from.
    pub(crate) fn model(&self) -> &Model {
        self.whole.as_ref().unwrap_or(&self.global)
    }

    /// The trainable tensors' names, for a task that trains part of its model.
    pub(crate) fn trainable(&self) -> Option<Vec<String>> {
        self.whole.as_ref().map(|_| {
            let names = self.global.tensors().iter();
            names.map(|t| t.name.clone()).collect()
        })
    }

    /// `local − global` over the round's model's tensors: a trainer of a task that trains part
    /// of its model returns the whole model or only the trainable part. The whole model goes
    /// first.
    pub(crate) fn delta(self, local: &Model) -> Result<Model> {
        let Start { global, whole } = self;
        let whole = whole.map(|whole| whole.spec());
        if whole.is_some_and(|whole| local.spec() == whole) {
            let trained = local.only(|name| global.tensor(name).is_some());
            return difference(&trained, &global);
        }
        difference(local, &global)
    }
}

/// `local − global`, checked to be finite and of the same layout.
pub fn difference(local: &Model, global: &Model) -> Result<Model> {
    if local.spec() != global.spec() {
        return Err(ClientError::Training(format!(
            "the trainer returned weights of another layout: {:?}, the task's model is {:?}",
            local.spec(),
            global.spec()
        )));
    }
    let mut delta = local.clone();
    for (d, g) in delta.data_mut().iter_mut().zip(global.data()) {
        *d -= g;
    }
    delta.check_finite().map_err(|e| {
        ClientError::Training(format!(
            "the trained weights are not finite ({e}): lower the learning rate"
        ))
    })?;
    Ok(delta)
}

#[cfg(test)]
mod tests {
    use super::content_range;

    #[test]
    fn a_content_range_is_read_whole_or_not_at_all() {
        assert_eq!(content_range("bytes 10-99/100"), Some((10, 99, 100)));
        for bad in [
            "bytes 10-9/100",
            "bytes */100",
            "bytes 10-99",
            "items 10-99/100",
            "bytes -5-99/100",
            "bytes 10-99/*",
        ] {
            assert_eq!(content_range(bad), None, "{bad}");
        }
    }
}
