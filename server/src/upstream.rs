//! A regional aggregator's link to its parent: the two-level tree of the design (a hospital
//! network's site server under a national one, an edge region under a central one).
//!
//! A server started with `--parent https://…` is a client of that parent, enrolled once with an
//! aggregator enrolment token (`hora-server admin enrol --aggregator` on the parent) and keeping
//! its credentials under `<data dir>/parent`. A task created on it with `parent: {task}` is a
//! regional task, and its agent ([`Coordinator::follow_parent`]) moves it through the parent's
//! rounds, one cycle each:
//!
//! 1. **join** the parent's open round (taking a place there as any client does) and download
//!    its model;
//! 2. **open** a local round from that model ([`Coordinator::open_from_parent`]): the region's
//!    clients join, train and upload as they would to any server, and the round closes at its
//!    target or deadline as any plain round;
//! 3. the close **keeps the partial** instead of publishing a model: the example-weighted mean
//!    delta of the round's updates, its example count and its number of clients, durable in the
//!    task's record ([`crate::store::PartialRecord`]) with the round's history entry;
//! 4. **forward** it: sealed to the parent's round key and uploaded as one update that stands for
//!    that many clients (`UpdateMeta::contributors`), weighted by their examples. The parent folds
//!    it as it folds any update, so its FedAvg over the regions equals the flat federation's;
//!    then the partial is settled and the cycle starts again at the parent's next round.
//!
//! Every step is durable before the next: the parent's offer is kept with the round it opened,
//! so a region that crashes forwards its kept partial after its restart under the same round
//! key, and one the parent already holds is answered as it was the first time (or
//! `already_contributed`, which settles it). A partial the parent refuses for good (its round
//! closed without it, the region was too slow; or an update it does not take) is logged as lost
//! with its clients and examples, and the region moves on to the parent's next round. A local
//! attempt abandoned short of its minimum is not retried on its own: the next attempt starts
//! from the parent's round as it then is. The parent's strategy applies; a regional task takes
//! plain rounds only, and the parent's task must be plain without central DP (which take each
//! client's update themselves).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use hora_common::envelope;
use hora_common::model::{Model, ModelDigest, ModelSpec};
use hora_common::wire::{
    ApiError, Credentials, EnrolRequest, ErrorCode, JoinResponse, PollResponse, RoundOffer,
    TaskState, UpdateMeta, UploadSession, UploadStart, MIN_UPLOAD_CHUNK_BYTES,
};
use reqwest::{Method, StatusCode};

use crate::api::client::UPDATE_META_HEADER;
use crate::error::ServerError;
use crate::round::{Coordinator, Task};
use crate::store::PartialRecord;

/// How a server reaches its parent (`--parent`, `--parent-ca`, `--parent-enrolment-token`).
#[derive(Clone)]
pub struct ParentConfig {
    /// `https://host:port` URLs of the parent (several: its replicas), as [`parent_urls`]
    /// checked them.
    pub urls: Vec<String>,
    /// The CA certificate the parent's certificate chains to.
    pub ca: PathBuf,
    /// The aggregator enrolment token, needed until the first enrolment succeeded.
    pub enrolment_token: Option<String>,
    /// Where the parent's credentials are kept.
    pub state_dir: PathBuf,
}

impl std::fmt::Debug for ParentConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParentConfig")
            .field("urls", &self.urls)
            .field("ca", &self.ca)
            .field(
                "enrolment_token",
                &self.enrolment_token.as_ref().map(|_| "(secret)"),
            )
            .field("state_dir", &self.state_dir)
            .finish()
    }
}

/// The parent's URLs of `--parent` (comma-separated): each `https://host[:port]`, without a
/// path, a query or credentials (what the server sends there is a bearer token).
pub fn parent_urls(value: &str) -> Result<Vec<String>, String> {
    let mut urls = Vec::new();
    for part in value.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let url = reqwest::Url::parse(part).map_err(|e| format!("`{part}`: {e}"))?;
        if url.scheme() != "https"
            || url.host_str().is_none()
            || !matches!(url.path(), "" | "/")
            || url.query().is_some()
            || !url.username().is_empty()
            || url.password().is_some()
        {
            return Err(format!(
                "`{part}` must be https://host:port, with nothing after the port"
            ));
        }
        urls.push(part.trim_end_matches('/').to_string());
    }
    match urls.is_empty() {
        true => Err("give the parent's https://host:port".into()),
        false => Ok(urls),
    }
}

/// The parent, as this server's regional tasks reach it: one client identity for all of them.
pub struct Parent {
    config: ParentConfig,
    client: tokio::sync::OnceCell<ParentClient>,
}

impl Parent {
    pub fn new(config: ParentConfig) -> Parent {
        Parent {
            config,
            client: tokio::sync::OnceCell::new(),
        }
    }

    /// The client of the parent, enrolled at the first call that reaches it.
    async fn client(&self) -> Result<&ParentClient, String> {
        self.client
            .get_or_try_init(|| ParentClient::connect(&self.config))
            .await
    }
}

/// A refusal or failure of a request to the parent.
#[derive(Debug)]
struct Refused {
    /// None: no answer at all.
    status: Option<StatusCode>,
    code: Option<ErrorCode>,
    message: String,
}

impl Refused {
    fn local(message: String) -> Refused {
        Refused {
            status: None,
            code: None,
            message,
        }
    }
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

/// The most bytes of a refusal's body read.
const MAX_ERROR_BYTES: usize = 64 << 10;
/// The most bytes of a JSON answer read.
const MAX_JSON_BYTES: usize = 1 << 20;
/// How long one request to the parent may take (a model's download or a partial's upload).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(900);

/// This server as a client of its parent: the client API's enrolment, join, poll, model
/// download and sealed upload (the SDK, `hora-client`, brings libtorch, which the server never
/// links). A request goes to the parent's URLs in turn while they cannot be reached or answer
/// that they stand by or stop; the agent's loop retries the rest.
struct ParentClient {
    http: reqwest::Client,
    urls: Vec<String>,
    id: String,
    token: String,
    /// The partial each regional task is forwarding, as encoded for the parent's round, kept
    /// until it is settled: a try after a cut connection sends the same bytes (a lossy
    /// compression rounds at random, and safetensors' metadata has no fixed order), so a
    /// chunked upload resumes where the parent's session ends instead of starting again.
    encoded: std::sync::Mutex<HashMap<String, EncodedPartial>>,
}

/// A partial (by its digest) encoded for a round of the parent.
struct EncodedPartial {
    partial: ModelDigest,
    round: u64,
    plaintext: Arc<Vec<u8>>,
}

impl ParentClient {
    /// Reads the credentials kept in the state directory, or enrols with the token (under a
    /// secret kept first, so that a retried enrolment whose answer was lost is the same).
    async fn connect(config: &ParentConfig) -> Result<ParentClient, String> {
        let (ca, dir) = (config.ca.clone(), config.state_dir.clone());
        let (http, kept, secret) = crate::blocking(move || {
            let http = crate::tls::https_client(&ca, None).map_err(ServerError::internal)?;
            std::fs::create_dir_all(&dir).map_err(ServerError::internal)?;
            let creds = dir.join("credentials.json");
            let kept = match std::fs::read(&creds) {
                Ok(bytes) => Some(serde_json::from_slice::<Credentials>(&bytes).map_err(|e| {
                    ServerError::internal(format!("{} is damaged ({e}): remove it, and the server enrols again with the secret kept beside it and --parent-enrolment-token", creds.display()))
                })?),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
                Err(e) => return Err(ServerError::internal(e)),
            };
            let secret_file = dir.join("enrolment-secret");
            let secret = match std::fs::read_to_string(&secret_file) {
                Ok(s) => s.trim().to_string(),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    let secret = crate::auth::new_secret()?;
                    crate::tls::write_private(&secret_file, &secret).map_err(ServerError::internal)?;
                    secret
                }
                Err(e) => return Err(ServerError::internal(e)),
            };
            Ok((http, kept, secret))
        })
        .await
        .map_err(|e| format!("preparing the parent's client (--parent-ca, <data dir>/parent): {e}"))?;
        let mut client = ParentClient {
            http,
            urls: config.urls.clone(),
            id: String::new(),
            token: String::new(),
            encoded: Default::default(),
        };
        let creds = match kept {
            Some(creds) => creds,
            None => {
                client.token = config.enrolment_token.clone().ok_or_else(|| {
                    "this server has not enrolled with its parent yet: give it an aggregator enrolment token of the parent (HORA_PARENT_ENROLMENT_TOKEN or --parent-enrolment-token, from `hora-server admin enrol --aggregator` there)".to_string()
                })?;
                let request = EnrolRequest {
                    secret: Some(secret),
                    label: Some("regional aggregator".into()),
                    identity_key: None,
                };
                let creds: Credentials = client
                    .json(Method::POST, "/v1/enrol", |r| r.json(&request))
                    .await
                    .map_err(|e| format!("enrolling with the parent: {e}"))?;
                let text = serde_json::to_string(&creds).map_err(|e| e.to_string())?;
                let file = config.state_dir.join("credentials.json");
                crate::blocking(move || {
                    crate::tls::write_private(&file, &text).map_err(ServerError::internal)
                })
                .await
                .map_err(|e| format!("keeping the parent's credentials: {e}"))?;
                tracing::info!(client = %creds.client_id, "enrolled with the parent");
                creds
            }
        };
        client.token = format!("{}.{}", creds.client_id, creds.secret);
        client.id = creds.client_id;
        Ok(client)
    }

    /// Sends a request to the parent: the first URL that answers other than standing by or
    /// stopping. A success's response, or the refusal.
    async fn send(
        &self,
        method: Method,
        path: &str,
        build: impl Fn(reqwest::RequestBuilder) -> reqwest::RequestBuilder,
    ) -> Result<reqwest::Response, Refused> {
        let mut last = Refused::local("no parent URL".into());
        for url in &self.urls {
            let request = self
                .http
                .request(method.clone(), format!("{url}{path}"))
                .bearer_auth(&self.token)
                .timeout(REQUEST_TIMEOUT);
            let resp = match build(request).send().await {
                Ok(resp) if resp.status().is_success() => return Ok(resp),
                Ok(resp) => resp,
                Err(e) => {
                    last = Refused::local(format!("{url}: {e}"));
                    continue;
                }
            };
            let status = resp.status();
            let text = read_limited(resp, MAX_ERROR_BYTES)
                .await
                .unwrap_or_default();
            let text = String::from_utf8_lossy(&text);
            let refused = match serde_json::from_str::<ApiError>(&text) {
                Ok(e) => Refused {
                    status: Some(status),
                    message: format!("{url}: {status}: {}: {}", e.code.as_str(), e.message),
                    code: Some(e.code),
                },
                Err(_) => Refused {
                    status: Some(status),
                    code: None,
                    message: format!("{url}: {status}: {text}"),
                },
            };
            match refused.code {
                // Another replica of the parent may serve.
                Some(ErrorCode::Standby | ErrorCode::ShuttingDown) => last = refused,
                _ => return Err(refused),
            }
        }
        Err(last)
    }

    async fn json<T: serde::de::DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        build: impl Fn(reqwest::RequestBuilder) -> reqwest::RequestBuilder,
    ) -> Result<T, Refused> {
        let resp = self.send(method, path, build).await?;
        let bytes = read_limited(resp, MAX_JSON_BYTES)
            .await
            .map_err(Refused::local)?;
        serde_json::from_slice(&bytes)
            .map_err(|e| Refused::local(format!("{path}: an answer that does not parse: {e}")))
    }

    async fn join(&self, task: &str) -> Result<JoinResponse, Refused> {
        self.json(Method::POST, &format!("/v1/tasks/{task}/join"), |r| r)
            .await
    }

    /// The task's state once a round later than `after` (or a later attempt of it) opens, or
    /// after the parent's longest poll.
    async fn poll(&self, task: &str, after: &RoundOffer) -> Result<PollResponse, Refused> {
        let path = format!(
            "/v1/tasks/{task}/poll?wait_ms=25000&after={}&attempt={}",
            after.round, after.attempt
        );
        self.json(Method::GET, &path, |r| r).await
    }

    /// The parent's model `digest`, checked against its digest and the task's spec.
    async fn model(
        &self,
        task: &str,
        digest: &ModelDigest,
        spec: &ModelSpec,
    ) -> Result<Model, String> {
        let path = format!("/v1/tasks/{task}/model?digest={}", digest.to_hex());
        let limits = spec.limits();
        let resp = self
            .send(Method::GET, &path, |r| r)
            .await
            .map_err(|e| e.to_string())?;
        let bytes = read_limited(resp, limits.max_bytes as usize).await?;
        let model = Model::from_safetensors(&bytes, &limits).map_err(|e| {
            format!("the parent's model does not fit this task's (create the regional task with the parent's model, kind and trainable tensors): {e}")
        })?;
        if model.digest() != *digest || model.spec() != *spec {
            return Err(format!(
                "the parent's model is not {digest} of this task's shapes: create the regional task with the parent's model, kind and trainable tensors"
            ));
        }
        Ok(model)
    }

    /// Encodes `delta` as the offer asks, seals it to the round's key and uploads it: in one
    /// body, or, when the parent takes chunks and the partial is larger than one, as an upload
    /// session ([`ParentClient::upload_chunked`]), as the parent's own clients do.
    async fn upload(
        &self,
        task: &str,
        offer: &RoundOffer,
        partial: &PartialRecord,
        store: &Arc<crate::store::Store>,
        meta: &UpdateMeta,
    ) -> Result<(), Refused> {
        let plaintext = match self.encoded_for(task, partial.model, offer.round) {
            Some(kept) => kept,
            None => {
                let (store, digest, o) = (store.clone(), partial.model, offer.clone());
                let plaintext =
                    crate::blocking(move || encode_partial(store.read_model(&digest)?, &o))
                        .await
                        .map_err(|e| {
                            Refused::local(format!(
                                "reading and encoding the partial {}: {e}",
                                partial.model
                            ))
                        })?;
                let plaintext = Arc::new(plaintext);
                crate::round::lock(&self.encoded).insert(
                    task.to_string(),
                    EncodedPartial {
                        partial: partial.model,
                        round: offer.round,
                        plaintext: plaintext.clone(),
                    },
                );
                plaintext
            }
        };
        let meta = serde_json::to_string(meta)
            .map_err(|e| Refused::local(format!("the partial's metadata: {e}")))?;
        let chunked = offer
            .upload_chunk_bytes
            .filter(|&chunk| chunk > 0 && plaintext.len() as u64 > chunk);
        if chunked.is_some() {
            match self
                .upload_chunked(task, offer, plaintext.clone(), &meta)
                .await
            {
                // A parent restarted without chunked uploads (or a replica of it that takes
                // none) still takes the partial in one body.
                Err(e)
                    if e.status == Some(StatusCode::NOT_FOUND)
                        && e.code == Some(ErrorCode::NotFound) =>
                {
                    tracing::info!(task, error = %e, "the parent takes no chunked uploads now: forwarding the partial in one body");
                }
                done => return done,
            }
        }
        let (id, t, o) = (self.id.clone(), task.to_string(), offer.clone());
        let sealed = crate::blocking(move || {
            envelope::seal(&plaintext, &o.round_key, &o.binding(&t, &id))
                .map_err(ServerError::internal)
        })
        .await
        .map_err(|e| Refused::local(format!("sealing the partial: {e}")))?;
        let path = format!("/v1/tasks/{task}/rounds/{}/update", offer.round);
        self.send(Method::POST, &path, |r| {
            r.header(UPDATE_META_HEADER, &meta).body(sealed.clone())
        })
        .await
        .map(drop)
    }

    /// `task`'s partial `partial` as encoded for the parent's round `round`, if kept.
    fn encoded_for(&self, task: &str, partial: ModelDigest, round: u64) -> Option<Arc<Vec<u8>>> {
        crate::round::lock(&self.encoded)
            .get(task)
            .filter(|e| e.partial == partial && e.round == round)
            .map(|e| e.plaintext.clone())
    }

    /// `task`'s partial is settled: its encoding is no longer kept.
    fn settled(&self, task: &str) {
        crate::round::lock(&self.encoded).remove(task);
    }

    /// Uploads `plaintext` as a chunked upload session (`POST …/uploads`, a `PUT` of each
    /// chunk, sealed with its index, then `POST …/complete`). A session the parent still holds
    /// resumes from the chunk it expects next, so a partial whose upload was cut (or whose
    /// region restarted) sends again only what the parent lacks; any refusal on the way ends
    /// this try, and [`settled`] says whether the next one starts (or resumes) it again.
    async fn upload_chunked(
        &self,
        task: &str,
        offer: &RoundOffer,
        plaintext: Arc<Vec<u8>>,
        meta: &str,
    ) -> Result<(), Refused> {
        let hashed = plaintext.clone();
        let digest: [u8; 32] = crate::blocking(move || {
            let digest = ring::digest::digest(&ring::digest::SHA256, &hashed);
            digest.as_ref().try_into().map_err(ServerError::internal)
        })
        .await
        .map_err(|e| Refused::local(format!("hashing the partial: {e}")))?;
        let (hex_digest, length) = (hex::encode(digest), plaintext.len() as u64);
        let uploads = format!("/v1/tasks/{task}/rounds/{}/uploads", offer.round);
        let start = UploadStart {
            digest: hex_digest.clone(),
            length,
        };
        let mut at: UploadSession = self
            .json(Method::POST, &uploads, |r| r.json(&start))
            .await?;
        if at.digest != hex_digest || at.length != length || at.chunk_bytes < MIN_UPLOAD_CHUNK_BYTES
        {
            return Err(Refused::local(format!(
                "the parent answered the start of upload {hex_digest} ({length} bytes) with another ({} of {} bytes, chunks of {})",
                at.digest, at.length, at.chunk_bytes
            )));
        }
        if at.received > 0 {
            tracing::info!(
                task,
                chunk = at.next_chunk,
                chunks = at.chunks,
                "resuming the partial's upload where the parent's copy ends"
            );
        }
        while at.received < length {
            let (index, chunk_bytes) = (at.next_chunk, at.chunk_bytes);
            let range = envelope::chunk_range(length, chunk_bytes, index);
            let Some(range) = range.filter(|r| r.start == at.received) else {
                return Err(Refused::local(format!(
                    "the parent expects chunk {index} of upload {hex_digest}, which does not start at the {} bytes it says it holds",
                    at.received
                )));
            };
            let (id, t, o, p) = (
                self.id.clone(),
                task.to_string(),
                offer.clone(),
                plaintext.clone(),
            );
            let sealed = crate::blocking(move || {
                let binding = o.binding(&t, &id);
                envelope::seal_chunk_of(&p, &digest, chunk_bytes, index, &o.round_key, &binding)
                    .map_err(ServerError::internal)
            })
            .await
            .map_err(|e| Refused::local(format!("sealing a chunk of the partial: {e}")))?;
            let path = format!("{uploads}/{hex_digest}/chunks/{index}");
            let next: UploadSession = self
                .json(Method::PUT, &path, |r| r.body(sealed.clone()))
                .await?;
            if next.next_chunk != index + 1 || next.received != range.end {
                return Err(Refused::local(format!(
                    "the parent took chunk {index} of upload {hex_digest} but says it holds {} bytes, next chunk {}",
                    next.received, next.next_chunk
                )));
            }
            at = next;
        }
        let path = format!("{uploads}/{hex_digest}/complete");
        self.send(Method::POST, &path, |r| r.header(UPDATE_META_HEADER, meta))
            .await
            .map(drop)
    }
}

/// The plaintext of `partial` as `offer` asks it encoded.
fn encode_partial(partial: Model, offer: &RoundOffer) -> Result<Vec<u8>, ServerError> {
    let Some(compression) = &offer.compression else {
        return Ok(partial.to_safetensors());
    };
    let mut unsent = partial;
    compression
        .encode(&mut unsent, &mut rand::rng())
        .map_err(ServerError::internal)
}

/// A response's body, refused past `limit` bytes (checked against its length first).
async fn read_limited(mut resp: reqwest::Response, limit: usize) -> Result<Vec<u8>, String> {
    if resp.content_length().is_some_and(|n| n > limit as u64) {
        return Err(format!("the parent's answer is larger than {limit} bytes"));
    }
    let mut body = Vec::new();
    while let Some(chunk) = resp.chunk().await.map_err(|e| e.to_string())? {
        if body.len() + chunk.len() > limit {
            return Err(format!("the parent's answer is larger than {limit} bytes"));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// What became of a forwarded partial.
enum Forwarded {
    /// The parent folded it (now, or at an earlier attempt whose answer was lost).
    Taken,
    /// The parent refused it for good.
    Lost(String),
}

impl Coordinator {
    /// Starts the agent that moves regional task `task` through its parent's rounds; it ends
    /// with the task (or the server).
    pub(crate) fn follow_parent(self: &Arc<Self>, task: Arc<Task>) {
        let Some(parent_task) = task.record().config.parent.map(|p| p.task) else {
            return;
        };
        let Some(parent) = self.parent.clone() else {
            tracing::error!(task = %task.id, parent_task = %parent_task, "a regional task, but this server has no parent: it opens no round until the server runs with --parent again");
            return;
        };
        let me = self.clone();
        let stopping = self.stopping.clone();
        self.background.spawn(async move {
            let mut failures = 0u32;
            loop {
                let step = tokio::select! {
                    step = me.upstream_step(&parent, &task, &parent_task) => step,
                    _ = stopping.cancelled() => return,
                };
                let wait = match step {
                    Ok(Next::Now) => {
                        failures = 0;
                        continue;
                    }
                    Ok(Next::After(wait)) => {
                        failures = 0;
                        wait
                    }
                    Ok(Next::Done) => return,
                    Err(e) => {
                        failures = failures.saturating_add(1);
                        let wait = Duration::from_millis(250 << failures.min(7));
                        tracing::warn!(task = %task.id, parent_task = %parent_task, error = %e, retry_in_ms = wait.as_millis() as u64, "the regional task cannot go on with its parent's round; trying again");
                        wait
                    }
                };
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    _ = stopping.cancelled() => return,
                }
            }
        });
    }

    /// One step of the cycle.
    async fn upstream_step(
        self: &Arc<Self>,
        parent: &Parent,
        task: &Arc<Task>,
        parent_task: &str,
    ) -> Result<Next, String> {
        // (Subscribed before reading, so a change made meanwhile is not missed.)
        let mut changes = task.subscribe();
        let record = task.record();
        let Some(link) = record.parent.clone() else {
            return Ok(Next::Done);
        };
        if let Some(partial) = link.partial {
            let client = parent.client().await?;
            let outcome = match link.offer.filter(|o| o.round == partial.parent_round) {
                Some(offer) => forward(client, parent_task, &offer, &partial, &self.store).await?,
                None => Forwarded::Lost("the parent's offer for its round is not kept".into()),
            };
            match &outcome {
                Forwarded::Taken => {
                    tracing::info!(task = %task.id, round = partial.round, parent_task, parent_round = partial.parent_round, contributors = partial.contributors, examples = partial.examples, "the round's partial was forwarded to the parent")
                }
                Forwarded::Lost(why) => {
                    tracing::warn!(task = %task.id, round = partial.round, parent_task, parent_round = partial.parent_round, contributors = partial.contributors, examples = partial.examples, reason = %why, "the parent did not take this round's partial: its updates are lost to the parent")
                }
            }
            let (me, t) = (self.clone(), task.clone());
            crate::blocking(move || me.settle_partial(&t, partial.round))
                .await
                .map_err(|e| format!("recording the forwarded partial: {e}"))?;
            return Ok(Next::Now);
        }
        match record.state {
            TaskState::Stopped | TaskState::Finished => return Ok(Next::Done),
            TaskState::Running if task.current().is_none() => {}
            // A local round is open (or the task paused): wait for it to close.
            _ => {
                let _ = tokio::time::timeout(Duration::from_secs(30), changes.changed()).await;
                return Ok(Next::Now);
            }
        }
        let client = parent.client().await?;
        let offer = match join_parent(client, parent_task, link.offer.as_ref()).await? {
            Some(offer) => offer,
            None => {
                tracing::info!(task = %task.id, parent_task, "the parent's task has ended: so does this regional task");
                let (me, t) = (self.clone(), task.clone());
                crate::blocking(move || me.finish_regional(&t))
                    .await
                    .map_err(|e| format!("finishing the regional task: {e}"))?;
                return Ok(Next::Now);
            }
        };
        let store = self.store.clone();
        let digest = offer.model;
        let stored = crate::blocking(move || Ok(store.has_model(&digest)?))
            .await
            .map_err(|e| e.to_string())?;
        if !stored {
            let model = client
                .model(parent_task, &offer.model, &record.spec)
                .await
                .map_err(|e| format!("downloading the parent's model: {e}"))?;
            let store = self.store.clone();
            crate::blocking(move || Ok(store.put_model(&model)?))
                .await
                .map_err(|e| e.to_string())?;
        }
        let (me, t) = (self.clone(), task.clone());
        let opened = crate::blocking(move || me.open_from_parent(&t, offer))
            .await
            .map_err(|e| format!("opening the round: {e}"))?;
        Ok(match opened {
            true => Next::Now,
            // (Paused, say, since the step began.)
            false => Next::After(Duration::from_secs(1)),
        })
    }
}

/// What the agent does after a step.
enum Next {
    Now,
    After(Duration),
    Done,
}

/// Joins the parent's open round: its offer, or None once the parent's task has ended. While
/// the parent's round `last` (whose partial it has) is open, waits for the next.
async fn join_parent(
    client: &ParentClient,
    task: &str,
    last: Option<&RoundOffer>,
) -> Result<Option<RoundOffer>, String> {
    loop {
        match client.join(task).await {
            Ok(JoinResponse {
                offer: Some(offer), ..
            }) => return Ok(Some(offer)),
            Ok(JoinResponse { retry_after_ms, .. }) => {
                tokio::time::sleep(Duration::from_millis(retry_after_ms.clamp(100, 5_000))).await
            }
            Err(e) if e.code == Some(ErrorCode::TaskEnded) => return Ok(None),
            Err(e) if e.code == Some(ErrorCode::AlreadyContributed) => match last {
                Some(last) => {
                    client
                        .poll(task, last)
                        .await
                        .map_err(|e| format!("waiting for the parent's next round: {e}"))?;
                }
                None => tokio::time::sleep(Duration::from_secs(1)).await,
            },
            Err(e) => return Err(format!("joining the parent's round: {e}")),
        }
    }
}

/// Uploads `partial` to the parent's round of `offer`, the one it was trained for.
async fn forward(
    client: &ParentClient,
    task: &str,
    offer: &RoundOffer,
    partial: &PartialRecord,
    store: &Arc<crate::store::Store>,
) -> Result<Forwarded, String> {
    let meta = UpdateMeta {
        num_examples: partial.examples,
        metrics: partial.metrics,
        contributors: Some(partial.contributors),
    };
    let outcome = match client.upload(task, offer, partial, store, &meta).await {
        Ok(()) => Ok(Forwarded::Taken),
        Err(e) => settled(e),
    };
    if outcome.is_ok() {
        client.settled(task);
    }
    outcome
}

/// What an upload's refusal says about the partial: the parent has it already, or refuses it
/// for good (a 4xx: its round is gone, or it does not take such an update); anything else (no
/// answer, a timeout, a 5xx, an upload of it still being read) is retried.
fn settled(e: Refused) -> Result<Forwarded, String> {
    match (&e.code, e.status) {
        (Some(ErrorCode::AlreadyContributed), _) => Ok(Forwarded::Taken),
        // An upload still being read, or a chunked one to start or resume again.
        (
            Some(
                ErrorCode::UploadInProgress
                | ErrorCode::UploadTooSlow
                | ErrorCode::ChunkOutOfOrder
                | ErrorCode::UploadUnknown,
            ),
            _,
        ) => Err(e.message),
        (_, Some(s))
            if s.is_client_error()
                && s != StatusCode::REQUEST_TIMEOUT
                && s != StatusCode::TOO_MANY_REQUESTS =>
        {
            Ok(Forwarded::Lost(e.message))
        }
        _ => Err(format!("forwarding the partial: {e}")),
    }
}
