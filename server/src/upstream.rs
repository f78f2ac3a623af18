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
//! Every step is durable before the next: a region that crashes forwards its kept partial after
//! its restart (joining again hands back the same round key), and one the parent already took is
//! answered `already_contributed`, which settles it. A partial the parent's round closed without
//! (the region was too slow) is logged as lost with its clients and examples; the region moves on
//! to the parent's next round. The parent's strategy, privacy and evaluation apply; a regional
//! task takes plain rounds only.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use hora_common::envelope::{self, Binding};
use hora_common::model::{Model, ModelDigest};
use hora_common::wire::{
    ApiError, Credentials, EnrolRequest, ErrorCode, JoinResponse, PollResponse, RoundOffer,
    TaskState, UpdateMeta,
};
use reqwest::Method;

use crate::error::ServerError;
use crate::round::{lock, Coordinator, Task};
use crate::store::PartialRecord;

/// How a server reaches its parent (`--parent`, `--parent-ca`, `--parent-enrolment-token`).
#[derive(Clone)]
pub struct ParentConfig {
    /// `https://host:port`, or several comma-separated (the parent's replicas).
    pub url: String,
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
            .field("url", &self.url)
            .field("ca", &self.ca)
            .field(
                "enrolment_token",
                &self.enrolment_token.as_ref().map(|_| "…"),
            )
            .field("state_dir", &self.state_dir)
            .finish()
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
    code: Option<ErrorCode>,
    message: String,
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

/// This server as a client of its parent: the client API's enrolment, join, poll, model
/// download and sealed upload (the SDK's `hora-client` brings libtorch, which the server never
/// links). A request goes to each of the parent's URLs in turn until one answers; the agent's
/// loop retries the rest.
struct ParentClient {
    http: reqwest::Client,
    urls: Vec<String>,
    id: String,
    token: String,
}

impl ParentClient {
    /// Reads the credentials kept in the state directory, or enrols with the token (under a
    /// secret kept first, so that a retried enrolment whose answer was lost is the same).
    async fn connect(config: &ParentConfig) -> Result<ParentClient, String> {
        let (ca, dir) = (config.ca.clone(), config.state_dir.clone());
        let (http, kept, secret) = crate::blocking(move || {
            let http = crate::tls::https_client(&ca, None).map_err(ServerError::internal)?;
            std::fs::create_dir_all(&dir).map_err(ServerError::internal)?;
            let kept = match std::fs::read(dir.join("credentials.json")) {
                Ok(bytes) => Some(
                    serde_json::from_slice::<Credentials>(&bytes).map_err(ServerError::internal)?,
                ),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
                Err(e) => return Err(ServerError::internal(e)),
            };
            let secret_file = dir.join("enrolment-secret");
            let secret = match std::fs::read_to_string(&secret_file) {
                Ok(s) => s.trim().to_string(),
                Err(_) => {
                    let secret = crate::auth::new_secret()?;
                    crate::tls::write_private(&secret_file, &secret)
                        .map_err(ServerError::internal)?;
                    secret
                }
            };
            Ok((http, kept, secret))
        })
        .await
        .map_err(|e| {
            format!("preparing the parent's client (--parent-ca, <data dir>/parent): {e}")
        })?;
        let urls: Vec<String> = config
            .url
            .split(',')
            .map(|u| u.trim().trim_end_matches('/').to_string())
            .filter(|u| !u.is_empty())
            .collect();
        let mut client = ParentClient {
            http,
            urls,
            id: String::new(),
            token: String::new(),
        };
        let creds = match kept {
            Some(creds) => creds,
            None => {
                let token = config.enrolment_token.clone().ok_or_else(|| {
                    "this server has not enrolled with its parent yet: give it an aggregator enrolment token of the parent (--parent-enrolment-token, from `hora-server admin enrol --aggregator` there)".to_string()
                })?;
                client.token = token;
                let request = EnrolRequest {
                    secret: Some(secret),
                    label: Some("regional aggregator".into()),
                    identity_key: None,
                };
                let creds: Credentials = client
                    .json(Method::POST, "/v1/enrol", |r| r.json(&request))
                    .await
                    .map_err(|e| format!("enrolling with the parent: {e}"))?;
                let (dir, text) = (
                    config.state_dir.clone(),
                    serde_json::to_string(&creds).map_err(|e| e.to_string())?,
                );
                crate::blocking(move || {
                    crate::tls::write_private(&dir.join("credentials.json"), &text)
                        .map_err(ServerError::internal)
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

    /// Sends a request to the first of the parent's URLs that answers: the response, or the
    /// parent's refusal.
    async fn send(
        &self,
        method: Method,
        path: &str,
        build: impl Fn(reqwest::RequestBuilder) -> reqwest::RequestBuilder,
    ) -> Result<reqwest::Response, Refused> {
        let mut last = String::from("no parent URL");
        for url in &self.urls {
            let request = self
                .http
                .request(method.clone(), format!("{url}{path}"))
                .bearer_auth(&self.token)
                .timeout(Duration::from_secs(120));
            match build(request).send().await {
                Ok(resp) if resp.status().is_success() => return Ok(resp),
                Ok(resp) => {
                    let status = resp.status();
                    let text = resp.text().await.unwrap_or_default();
                    return Err(match serde_json::from_str::<ApiError>(&text) {
                        Ok(e) => Refused {
                            message: format!("{status}: {}: {}", e.code.as_str(), e.message),
                            code: Some(e.code),
                        },
                        Err(_) => Refused {
                            code: None,
                            message: format!("{status}: {text}"),
                        },
                    });
                }
                Err(e) => last = format!("{url}: {e}"),
            }
        }
        Err(Refused {
            code: None,
            message: last,
        })
    }

    async fn json<T: serde::de::DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        build: impl Fn(reqwest::RequestBuilder) -> reqwest::RequestBuilder,
    ) -> Result<T, Refused> {
        let resp = self.send(method, path, build).await?;
        resp.json().await.map_err(|e| Refused {
            code: None,
            message: format!("{path}: an answer that does not parse: {e}"),
        })
    }

    async fn join(&self, task: &str) -> Result<JoinResponse, Refused> {
        self.json(Method::POST, &format!("/v1/tasks/{task}/join"), |r| r)
            .await
    }

    async fn poll(&self, task: &str) -> Result<PollResponse, Refused> {
        self.json(
            Method::GET,
            &format!("/v1/tasks/{task}/poll?wait_ms=0"),
            |r| r,
        )
        .await
    }

    /// The parent's model `digest`, checked against its digest and the task's spec.
    async fn model(
        &self,
        task: &str,
        digest: &ModelDigest,
        spec: &hora_common::model::ModelSpec,
    ) -> Result<Model, String> {
        let path = format!("/v1/tasks/{task}/model?digest={}", digest.to_hex());
        let bytes = self
            .send(Method::GET, &path, |r| r)
            .await
            .map_err(|e| e.to_string())?
            .bytes()
            .await
            .map_err(|e| e.to_string())?;
        let model = Model::from_safetensors(&bytes, &spec.limits()).map_err(|e| {
            format!("the parent's model does not fit this task's (create the regional task with the parent's model, kind and trainable tensors): {e}")
        })?;
        if model.digest() != *digest || model.spec() != *spec {
            return Err(format!(
                "the parent's model is not {digest} of this task's shapes: create the regional task with the parent's model, kind and trainable tensors"
            ));
        }
        Ok(model)
    }

    /// Encodes `delta` as the offer asks, seals it to the round's key and uploads it.
    async fn upload(
        &self,
        task: &str,
        offer: &RoundOffer,
        delta: Model,
        meta: &UpdateMeta,
    ) -> Result<(), Refused> {
        let (id, t, o) = (self.id.clone(), task.to_string(), offer.clone());
        let sealed = crate::blocking(move || {
            let plaintext = match &o.compression {
                None => delta.to_safetensors(),
                Some(compression) => {
                    let mut unsent = delta;
                    compression
                        .encode(&mut unsent, &mut rand::rng())
                        .map_err(ServerError::internal)?
                }
            };
            let binding = Binding {
                task: &t,
                round: o.round,
                client: &id,
                base_model: &o.model,
            };
            envelope::seal(&plaintext, &o.round_key, &binding).map_err(ServerError::internal)
        })
        .await
        .map_err(|e| Refused {
            code: None,
            message: format!("sealing the partial: {e}"),
        })?;
        let meta = serde_json::to_string(meta).unwrap_or_default();
        let path = format!("/v1/tasks/{task}/rounds/{}/update", offer.round);
        self.send(Method::POST, &path, |r| {
            r.header("x-hora-update", &meta).body(sealed.clone())
        })
        .await
        .map(drop)
    }
}

/// What became of a forwarded partial.
enum Forwarded {
    /// The parent folded it (now, or at an earlier attempt whose answer was lost).
    Taken,
    /// The parent's round closed without it.
    Lost(String),
}

impl Coordinator {
    /// Starts the agent that moves regional task `task` through its parent's rounds; it ends
    /// with the task (or the server).
    pub(crate) fn follow_parent(self: &Arc<Self>, task: Arc<Task>) {
        let Some(parent) = self.parent.clone() else {
            return;
        };
        let Some(parent_task) = task.record().config.parent.map(|p| p.task) else {
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
                match step {
                    Ok(true) => failures = 0,
                    Ok(false) => return,
                    Err(e) => {
                        failures = failures.saturating_add(1);
                        let wait = Duration::from_millis(500 << failures.min(6));
                        tracing::warn!(task = %task.id, parent_task = %parent_task, error = %e, retry_in_ms = wait.as_millis() as u64, "the regional task cannot reach its parent's round; trying again");
                        tokio::select! {
                            _ = tokio::time::sleep(wait) => {}
                            _ = stopping.cancelled() => return,
                        }
                    }
                }
            }
        });
    }

    /// One step of the cycle; false once the task has nothing more to do.
    async fn upstream_step(
        self: &Arc<Self>,
        parent: &Parent,
        task: &Arc<Task>,
        parent_task: &str,
    ) -> Result<bool, String> {
        // (Subscribed before reading, so a change made meanwhile is not missed.)
        let mut changes = task.subscribe();
        let record = task.record();
        let Some(link) = record.parent.clone() else {
            return Ok(false);
        };
        if let Some(partial) = link.partial {
            let client = parent.client().await?;
            let outcome = self.forward(client, parent_task, &partial).await?;
            match &outcome {
                Forwarded::Taken => {
                    tracing::info!(task = %task.id, round = partial.round, parent_task, parent_round = partial.parent_round, contributors = partial.contributors, examples = partial.examples, "the round's partial was forwarded to the parent")
                }
                Forwarded::Lost(why) => {
                    tracing::warn!(task = %task.id, round = partial.round, parent_task, parent_round = partial.parent_round, contributors = partial.contributors, examples = partial.examples, reason = %why, "the parent's round closed without this round's partial: its updates are lost to the parent (give the regional task a shorter round deadline than the parent's)")
                }
            }
            let (me, t) = (self.clone(), task.clone());
            crate::blocking(move || me.partial_settled(&t, partial.round))
                .await
                .map_err(|e| format!("recording the forwarded partial: {e}"))?;
            return Ok(true);
        }
        match record.state {
            TaskState::Stopped | TaskState::Finished => return Ok(false),
            TaskState::Running if task.current().is_none() => {}
            // A local round is open (or the task paused): wait for it to close.
            _ => {
                let _ = tokio::time::timeout(Duration::from_secs(30), changes.changed()).await;
                return Ok(true);
            }
        }
        let client = parent.client().await?;
        let offer = match self.join_parent(client, parent_task).await? {
            Some(offer) => offer,
            None => {
                tracing::info!(task = %task.id, parent_task, "the parent's task has ended: so does this regional task");
                let (me, t) = (self.clone(), task.clone());
                crate::blocking(move || me.finish_regional(&t))
                    .await
                    .map_err(|e| format!("finishing the regional task: {e}"))?;
                return Ok(false);
            }
        };
        if !self
            .store
            .has_model(&offer.model)
            .map_err(|e| e.to_string())?
        {
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
        crate::blocking(move || me.open_from_parent(&t, offer.round, offer.model))
            .await
            .map_err(|e| format!("opening the round: {e}"))?;
        Ok(true)
    }

    /// Joins the parent's open round: its offer, or None once the parent's task has ended.
    async fn join_parent(
        &self,
        client: &ParentClient,
        task: &str,
    ) -> Result<Option<RoundOffer>, String> {
        loop {
            match client.join(task).await {
                Ok(JoinResponse {
                    offer: Some(offer), ..
                }) => return Ok(Some(offer)),
                Ok(JoinResponse { retry_after_ms, .. }) => {
                    tokio::time::sleep(Duration::from_millis(retry_after_ms.clamp(100, 5_000)))
                        .await
                }
                Err(e) if e.code == Some(ErrorCode::TaskEnded) => return Ok(None),
                Err(e) => return Err(format!("joining the parent's round: {e}")),
            }
        }
    }

    /// Uploads `partial` to the parent's round it was trained for.
    async fn forward(
        &self,
        client: &ParentClient,
        task: &str,
        partial: &PartialRecord,
    ) -> Result<Forwarded, String> {
        // Joining again hands a selected client its round's offer (and key) back.
        let offer = match client.join(task).await {
            Ok(JoinResponse {
                offer: Some(offer), ..
            }) => offer,
            Ok(JoinResponse { .. }) => {
                let poll = client
                    .poll(task)
                    .await
                    .map_err(|e| format!("asking the parent's task: {e}"))?;
                return match poll.open_round {
                    Some(open) if open <= partial.parent_round => Err(format!(
                        "the parent's round {open} takes no update now; trying again"
                    )),
                    open => Ok(Forwarded::Lost(format!(
                        "the parent's open round is {open:?}"
                    ))),
                };
            }
            Err(e) => return gone(e),
        };
        if offer.round != partial.parent_round {
            return Ok(Forwarded::Lost(format!(
                "the parent's open round is {}",
                offer.round
            )));
        }
        let store = self.store.clone();
        let digest = partial.model;
        let delta: Model = crate::blocking(move || Ok(store.read_model(&digest)?))
            .await
            .map_err(|e| format!("reading the partial {digest}: {e}"))?;
        let meta = UpdateMeta {
            num_examples: partial.examples,
            metrics: partial.metrics,
            contributors: Some(partial.contributors),
        };
        match client.upload(task, &offer, delta, &meta).await {
            Ok(_) => Ok(Forwarded::Taken),
            Err(e) => gone(e),
        }
    }

    /// Opens the local round that trains for the parent's round `parent_round`, from `model`, if
    /// the task has no round open and no partial kept. Blocking.
    pub(crate) fn open_from_parent(
        self: &Arc<Self>,
        task: &Arc<Task>,
        parent_round: u64,
        model: ModelDigest,
    ) -> Result<(), ServerError> {
        let writing = lock(&task.writing);
        let mut record = task.record();
        if task.current().is_some()
            || record.state != TaskState::Running
            || record.published >= record.config.rounds
        {
            return Ok(());
        }
        let Some(link) = record.parent.as_mut().filter(|l| l.partial.is_none()) else {
            return Ok(());
        };
        link.round = parent_round;
        record.global_model = model;
        let round = self.fresh_round(&record, record.published + 1, 0, None)?;
        // The record first: a crash before the round is stored leaves none open, and the agent
        // joins the parent's round again (and is handed the same offer).
        self.store.put_task(&task.id, &record)?;
        self.store
            .put_open_round(&task.id, &round.record(&lock(&round.acc)))?;
        round.collection.persist_new(&*self.store)?;
        self.store.flush()?;
        tracing::info!(task = %task.id, round = round.number, parent_round, model = %model, "opened a round from the parent's");
        *lock(&task.round) = Some(round.clone());
        *lock(&task.record) = record;
        drop(writing);
        task.bump();
        self.watch(task.clone(), round);
        Ok(())
    }

    /// The partial of local round `round` went to the parent (or was lost): forget it. Blocking.
    fn partial_settled(&self, task: &Task, round: u64) -> Result<(), ServerError> {
        let _writing = lock(&task.writing);
        let mut record = task.record();
        match record.parent.as_mut() {
            Some(link) if link.partial.as_ref().is_some_and(|p| p.round == round) => {
                link.partial = None
            }
            _ => return Ok(()),
        }
        self.store.put_task(&task.id, &record)?;
        self.store.flush()?;
        *lock(&task.record) = record;
        task.bump();
        Ok(())
    }

    /// The parent's task ended: the regional task finishes too. Blocking.
    fn finish_regional(&self, task: &Task) -> Result<(), ServerError> {
        let _writing = lock(&task.writing);
        let mut record = task.record();
        if task.current().is_some() || record.state != TaskState::Running {
            return Ok(());
        }
        record.state = TaskState::Finished;
        record.ended_reason = Some("the parent's task ended".into());
        self.store.put_task(&task.id, &record)?;
        self.store.flush()?;
        *lock(&task.record) = record;
        task.bump();
        Ok(())
    }
}

/// What an upload's refusal says about the partial: the parent has it already, or its round
/// is gone; anything else is an error the agent retries.
fn gone(e: Refused) -> Result<Forwarded, String> {
    match &e.code {
        Some(ErrorCode::AlreadyContributed) => Ok(Forwarded::Taken),
        Some(
            code @ (ErrorCode::RoundClosed
            | ErrorCode::WrongRound
            | ErrorCode::RoundAbandoned
            | ErrorCode::NotSelected),
        ) => Ok(Forwarded::Lost(format!("{} ({e})", code.as_str()))),
        _ => Err(format!("forwarding the partial: {e}")),
    }
}
