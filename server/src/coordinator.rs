//! The coordinator: tasks, their rounds, and everything that moves a round along.
//!
//! A round is **open** from the moment the previous one is published: clients join it (the first
//! `target × (1 + over_selection)` are selected; others are told when to come back) and upload
//! sealed deltas, each folded into the round's running sum at once (**collecting**). When the
//! target number of updates is in, or the deadline passes with at least `min_clients`, it is
//! **aggregated** by the task's strategy and the new global model is **published**; with fewer
//! than `min_clients` at the deadline the attempt is abandoned (the reason goes into the round
//! history) and the round is retried with a fresh key.
//!
//! Durability is a group commit. A folded update is *pending* until a checkpoint that contains
//! it is durable: the committer, woken by the first pending update, writes the sum (atomic file,
//! fsync, rename) and then the round's sled record listing its contributors, flushes, and only
//! then are those uploads acknowledged. A crash loses only unacknowledged uploads, which clients
//! retry; the restarted round resumes from the last checkpoint, so the published model is the
//! same as without the crash. Writes are O(model) per commit, not per upload.
//!
//! Locks: a round's accumulator lock may be taken while holding nothing, and the task's record
//! and round slots may be taken while holding it — never the other way round.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use hora_common::envelope::{self, Binding, RoundSecretKey};
use hora_common::kernel::{KernelError, WeightedSum};
use hora_common::model::{ModelDigest, ModelSpec, ModelView};
use hora_common::wire::{
    self, Metrics, OpenRoundStatus, RoundOffer, RoundOutcome, RoundRecord, TaskInfo, TaskState,
    UpdateMeta,
};
use rand::Rng;
use tokio::sync::{watch, Notify};

use crate::dp;
use crate::error::ServerError;
use crate::metrics::ServerMetrics;
use crate::secagg::{self, SecAggRound};
use crate::store::{CheckpointRecord, Contribution, OpenRoundRecord, Store, TaskRecord};
use crate::strategy;

pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Tunables of the coordinator.
#[derive(Debug, Clone)]
pub struct CoordinatorConfig {
    /// How long the committer waits after the first pending update for more to join the commit.
    pub commit_window: Duration,
    /// The longest a long poll is held open.
    pub max_poll_wait: Duration,
    /// The longest an upload waits for durability before it is answered 503 (and retried).
    pub durability_timeout: Duration,
    /// Which published round models are kept.
    pub retention: crate::store::Retention,
}

impl Default for CoordinatorConfig {
    fn default() -> Self {
        CoordinatorConfig {
            commit_window: Duration::from_millis(2),
            max_poll_wait: Duration::from_secs(30),
            durability_timeout: Duration::from_secs(60),
            retention: crate::store::Retention::default(),
        }
    }
}

/// Whether an upload is worth reading.
pub enum Admission {
    /// No update from this client in the round yet.
    Fresh(Arc<Round>),
    /// Its update is the round's contribution `.1`, folded but not yet durable.
    Pending(Arc<Round>, usize),
}

/// What waiting uploads learn about their round.
#[derive(Debug, Clone, PartialEq)]
enum Durability {
    /// The first `n` contributions are durable.
    Upto(usize),
    /// The attempt was abandoned: nothing of it counts.
    Abandoned(String),
}

struct Accumulator {
    sum: WeightedSum,
    selected: BTreeSet<String>,
    /// Every accepted contribution, the durable ones first.
    contributions: Vec<Contribution>,
    durable: usize,
    closing: bool,
    /// The last durable checkpoint of the sum, as the open-round record must describe it.
    checkpoint: Option<Checkpointed>,
    /// The sum holds the round's differential-privacy noise (see `dp`): never noise it twice.
    noised: bool,
}

/// What a checkpoint file holds, captured when it was written: the live sum's total weight and
/// noise flag may have moved on since (uploads folded, noise added by a close that then failed),
/// and a record must never pair the file with them.
#[derive(Clone)]
struct Checkpointed {
    file: String,
    total_weight: f64,
    noised: bool,
}

pub struct Round {
    pub number: u64,
    pub attempt: u32,
    key: RoundSecretKey,
    pub base: ModelDigest,
    opened_unix_ms: u64,
    opened: Instant,
    deadline_unix_ms: std::sync::atomic::AtomicU64,
    acc: Mutex<Accumulator>,
    durability: watch::Sender<Durability>,
    /// The attempt's secure-aggregation protocol, when the task asks for it.
    pub secagg: Option<Arc<SecAggRound>>,
    /// A secure-aggregation ending whose closing failed, for the deadline watcher to retry:
    /// `Some(None)` publishes (the sum is in the accumulator), `Some(Some(reason))` abandons.
    secagg_retry: Mutex<Option<Option<String>>>,
}

/// Clients selected per round: the target plus the over-selection.
fn capacity(config: &wire::CreateTask) -> usize {
    (f64::from(config.target_clients) * (1.0 + config.over_selection)).ceil() as usize
}

impl Round {
    fn deadline(&self) -> u64 {
        self.deadline_unix_ms
            .load(std::sync::atomic::Ordering::SeqCst)
    }

    fn record(&self, acc: &Accumulator) -> OpenRoundRecord {
        OpenRoundRecord {
            round: self.number,
            attempt: self.attempt,
            secret: hex::encode(*self.key.to_bytes()),
            base_model: self.base,
            opened_unix_ms: self.opened_unix_ms,
            deadline_unix_ms: self.deadline(),
            selected: acc.selected.iter().cloned().collect(),
            checkpoint: acc.checkpoint.clone().map(|c| CheckpointRecord {
                file: c.file,
                contributions: acc.contributions[..acc.durable].to_vec(),
                total_weight: c.total_weight,
                noised: c.noised,
            }),
        }
    }
}

pub struct Task {
    pub id: String,
    record: Mutex<TaskRecord>,
    round: Mutex<Option<Arc<Round>>>,
    changed: watch::Sender<u64>,
}

impl Task {
    fn record(&self) -> TaskRecord {
        self.record.lock().expect("task lock").clone()
    }

    fn current(&self) -> Option<Arc<Round>> {
        self.round.lock().expect("round slot").clone()
    }

    fn bump(&self) {
        self.changed.send_modify(|v| *v += 1);
    }

    /// Notified whenever the task's state or round changes.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }
}

pub struct Coordinator {
    store: Arc<Store>,
    tasks: RwLock<HashMap<String, Arc<Task>>>,
    /// Tasks whose stored state could not be loaded, with the reason: they answer 503 while the
    /// other tasks serve.
    broken: RwLock<HashMap<String, String>>,
    config: CoordinatorConfig,
    commit_wanted: Notify,
    pub metrics: Arc<ServerMetrics>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock()
        .expect("a coordinator lock was poisoned by an earlier panic")
}

impl Coordinator {
    /// Loads every task and resumes open rounds from their last checkpoints.
    pub fn open(
        store: Arc<Store>,
        config: CoordinatorConfig,
        metrics: Arc<ServerMetrics>,
    ) -> Result<Arc<Self>, ServerError> {
        let coordinator = Arc::new(Coordinator {
            store,
            tasks: RwLock::new(HashMap::new()),
            broken: RwLock::new(HashMap::new()),
            config,
            commit_wanted: Notify::new(),
            metrics,
        });
        for (id, record) in coordinator.store.tasks_each()? {
            // One task's corrupt state must not keep the others from serving.
            let loaded = record.map_err(ServerError::from).and_then(|record| {
                // A damaged strategy state makes the task unavailable now, with the reason,
                // rather than failing every round close later.
                if let Some(name) = &record.strategy_state {
                    let per = strategy::from_config(&record.config.strategy).state_per_parameter();
                    strategy::state::verify(
                        &coordinator.store.strategy_state_dir(),
                        name,
                        record.spec.numel(),
                        per,
                    )?;
                }
                if record.config.differential_privacy.is_some() && record.dp.is_none() {
                    // Starting the count afresh would under-report ε: stop here instead.
                    return Err(ServerError::internal(
                        "the task has differential privacy but no privacy accounting state",
                    ));
                }
                let round = match coordinator.store.open_round(&id)? {
                    Some(open) => Some(coordinator.resume_round(&record, open)?),
                    None if matches!(record.state, TaskState::Running | TaskState::Paused)
                        && record.published < record.config.rounds =>
                    {
                        Some(coordinator.new_round(&id, &record, record.published + 1, 0)?)
                    }
                    None => None,
                };
                Ok((record, round))
            });
            let (record, round) = match loaded {
                Ok(v) => v,
                Err(e) => {
                    let detail = match &e {
                        ServerError::Internal(m) => m.clone(),
                        other => other.to_string(),
                    };
                    tracing::error!(task = %id, error = %detail, "cannot load this task's stored state; it answers 503 until repaired or deleted, the other tasks serve");
                    coordinator
                        .broken
                        .write()
                        .expect("broken lock")
                        .insert(id, detail);
                    coordinator.metrics.tasks_broken.inc();
                    continue;
                }
            };
            if let Some(r) = &round {
                tracing::info!(task = %id, round = r.number, attempt = r.attempt, accepted = lock(&r.acc).durable, "resumed open round");
            }
            if let (Some(config), Some(state)) = (&record.config.differential_privacy, &record.dp) {
                coordinator.metrics.dp_epsilon(&id, state.epsilon(config));
            }
            let task = Arc::new(Task {
                id: id.clone(),
                record: Mutex::new(record),
                round: Mutex::new(round),
                changed: watch::channel(0).0,
            });
            coordinator
                .tasks
                .write()
                .expect("tasks lock")
                .insert(id, task);
        }
        Ok(coordinator)
    }

    /// Starts the background work: the group committer and the round deadlines.
    pub fn start(self: &Arc<Self>) {
        let me = self.clone();
        tokio::spawn(async move { me.committer().await });
        for task in self.tasks.read().expect("tasks lock").values() {
            if let Some(round) = task.current() {
                self.watch_deadline(task.clone(), round);
            }
        }
    }

    fn resume_round(
        &self,
        record: &TaskRecord,
        open: OpenRoundRecord,
    ) -> Result<Arc<Round>, ServerError> {
        let mut secret = [0u8; 32];
        hex::decode_to_slice(&open.secret, &mut secret)
            .map_err(|_| ServerError::internal("corrupt round secret"))?;
        let (sum, contributions, checkpoint, noised) = match open.checkpoint {
            Some(c) => {
                let values = self.store.read_checkpoint(&c.file, record.spec.numel())?;
                let n = c.contributions.len() as u64;
                let sum = WeightedSum::from_parts(record.spec.clone(), values, c.total_weight, n)
                    .map_err(ServerError::internal)?;
                let durable = Checkpointed {
                    file: c.file,
                    total_weight: c.total_weight,
                    noised: c.noised,
                };
                (sum, c.contributions, Some(durable), c.noised)
            }
            None => (
                WeightedSum::new(record.spec.clone()),
                Vec::new(),
                None,
                false,
            ),
        };
        let durable = contributions.len();
        let secagg = match &record.config.secure_aggregation {
            Some(config) => Some(Arc::new(SecAggRound::resume(
                &*self.store,
                hora_common::secagg::Context::new(&record.config.id, open.round, open.attempt),
                config.clone(),
                capacity(&record.config),
                record.config.min_clients as usize,
                open.opened_unix_ms,
                record.config.round_deadline_secs,
                record.spec.numel(),
            )?)),
            None => None,
        };
        Ok(Arc::new(Round {
            number: open.round,
            attempt: open.attempt,
            key: RoundSecretKey::from_bytes(secret),
            base: open.base_model,
            opened_unix_ms: open.opened_unix_ms,
            opened: Instant::now(),
            deadline_unix_ms: open.deadline_unix_ms.into(),
            acc: Mutex::new(Accumulator {
                sum,
                selected: open.selected.into_iter().collect(),
                contributions,
                durable,
                closing: false,
                checkpoint,
                noised,
            }),
            durability: watch::channel(Durability::Upto(durable)).0,
            secagg,
            secagg_retry: Mutex::new(None),
        }))
    }

    /// A fresh round (or a retry of an abandoned one), persisted before anyone sees it.
    fn new_round(
        &self,
        task_id: &str,
        record: &TaskRecord,
        number: u64,
        attempt: u32,
    ) -> Result<Arc<Round>, ServerError> {
        let round = self.fresh_round(record, number, attempt)?;
        self.store
            .put_open_round(task_id, &round.record(&lock(&round.acc)))?;
        if let Some(s) = &round.secagg {
            s.persist_new(&*self.store)?;
        }
        self.store.flush()?;
        Ok(round)
    }

    fn fresh_round(
        &self,
        record: &TaskRecord,
        number: u64,
        attempt: u32,
    ) -> Result<Arc<Round>, ServerError> {
        let now = now_ms();
        let secagg = match &record.config.secure_aggregation {
            Some(config) => Some(Arc::new(SecAggRound::new(
                hora_common::secagg::Context::new(&record.config.id, number, attempt),
                config.clone(),
                capacity(&record.config),
                record.config.min_clients as usize,
                now,
                record.config.round_deadline_secs,
                record.spec.numel(),
            )?)),
            None => None,
        };
        // Under secure aggregation the round's deadline is when masked inputs are due.
        let deadline = secagg
            .as_ref()
            .map_or(now + record.config.round_deadline_secs * 1000, |s| {
                s.latest_input_deadline_unix_ms
            });
        Ok(Arc::new(Round {
            number,
            attempt,
            key: RoundSecretKey::generate().map_err(ServerError::internal)?,
            base: record.global_model,
            opened_unix_ms: now,
            opened: Instant::now(),
            deadline_unix_ms: deadline.into(),
            acc: Mutex::new(Accumulator {
                sum: WeightedSum::new(record.spec.clone()),
                selected: BTreeSet::new(),
                contributions: Vec::new(),
                durable: 0,
                closing: false,
                checkpoint: None,
                noised: false,
            }),
            durability: watch::channel(Durability::Upto(0)).0,
            secagg,
            secagg_retry: Mutex::new(None),
        }))
    }

    pub fn task(&self, id: &str) -> Result<Arc<Task>, ServerError> {
        if let Some(task) = self.tasks.read().expect("tasks lock").get(id) {
            return Ok(task.clone());
        }
        if self.broken.read().expect("broken lock").contains_key(id) {
            return Err(ServerError::unavailable(
                "task_unavailable",
                format!("task `{id}` cannot be served: its stored state is damaged (the operator finds the detail in the server log)"),
            ));
        }
        Err(ServerError::NotFound(format!("no task `{id}`")))
    }

    /// Tasks whose stored state could not be loaded, and why.
    pub fn broken_tasks(&self) -> Vec<(String, String)> {
        let mut broken: Vec<_> = self
            .broken
            .read()
            .expect("broken lock")
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        broken.sort();
        broken
    }

    pub fn store(&self) -> &Store {
        &*self.store
    }

    // -- admin ------------------------------------------------------------------------------

    pub fn create_task(
        self: &Arc<Self>,
        config: wire::CreateTask,
    ) -> Result<TaskInfo, ServerError> {
        validate_task(&config)?;
        let initial = self.store.read_model(&config.initial_model).map_err(|_| {
            ServerError::BadRequest(format!(
                "no uploaded model with digest {}: upload it first with POST /admin/v1/models",
                config.initial_model
            ))
        })?;
        if let wire::ModelKind::TorchScript { module_digest } = &config.model {
            if !self.store.module_path(module_digest).exists() {
                return Err(ServerError::BadRequest(format!("no uploaded TorchScript module {module_digest}: upload it first with POST /admin/v1/modules")));
            }
        }
        let id = config.id.clone();
        let record = TaskRecord {
            spec: initial.spec(),
            state: TaskState::Running,
            published: 0,
            global_model: config.initial_model,
            created_unix_ms: now_ms(),
            strategy_state: None,
            dp: config.differential_privacy.as_ref().map(dp::DpState::new),
            ended_reason: None,
            config,
        };
        let mut tasks = self.tasks.write().expect("tasks lock");
        if tasks.contains_key(&id) || !self.store.create_task(&id, &record)? {
            return Err(ServerError::conflict(
                "task_exists",
                format!("task `{id}` exists already"),
            ));
        }
        let round = self.new_round(&id, &record, 1, 0)?;
        if record.dp.is_some() {
            self.metrics.dp_epsilon(&id, 0.0);
        }
        let task = Arc::new(Task {
            id: id.clone(),
            record: Mutex::new(record),
            round: Mutex::new(Some(round.clone())),
            changed: watch::channel(0).0,
        });
        tasks.insert(id.clone(), task.clone());
        drop(tasks);
        self.watch_deadline(task.clone(), round);
        tracing::info!(task = %id, "task created");
        Ok(self.info(&task))
    }

    pub fn list(&self) -> Vec<TaskInfo> {
        let tasks: Vec<_> = self
            .tasks
            .read()
            .expect("tasks lock")
            .values()
            .cloned()
            .collect();
        let mut infos: Vec<_> = tasks.iter().map(|t| self.info(t)).collect();
        infos.sort_by(|a, b| a.config.id.cmp(&b.config.id));
        infos
    }

    pub fn info(&self, task: &Task) -> TaskInfo {
        let record = task.record();
        let open_round = task.current().map(|r| {
            let acc = lock(&r.acc);
            OpenRoundStatus {
                round: r.number,
                attempt: r.attempt,
                selected: acc.selected.len() as u32,
                accepted: acc.contributions.len() as u32,
                deadline_unix_ms: r.deadline(),
            }
        });
        TaskInfo {
            config: record.config,
            state: record.state,
            spec: record.spec,
            published_rounds: record.published,
            global_model: record.global_model,
            open_round,
            ended_reason: record.ended_reason,
        }
    }

    /// Pause, resume or stop.
    pub async fn set_state(
        self: &Arc<Self>,
        task: Arc<Task>,
        to: TaskState,
    ) -> Result<TaskInfo, ServerError> {
        let from = task.record().state;
        match (from, to) {
            (TaskState::Stopped | TaskState::Finished, _) => {
                return Err(ServerError::conflict(
                    "task_ended",
                    format!("task `{}` is {:?} and cannot change state", task.id, from)
                        .to_lowercase(),
                ))
            }
            (a, b) if a == b => return Ok(self.info(&task)),
            _ => {}
        }
        {
            let mut record = lock(&task.record);
            record.state = to;
            self.store.put_task(&task.id, &record)?;
            self.store.flush()?;
        }
        tracing::info!(task = %task.id, state = ?to, "task state changed");
        match to {
            TaskState::Stopped => {
                if let Some(round) = task.current() {
                    let me = self.clone();
                    let t = task.clone();
                    tokio::task::spawn_blocking(move || {
                        me.close_round(&t, &round, Some("task stopped"))
                    })
                    .await
                    .map_err(ServerError::internal)??;
                }
            }
            TaskState::Running => {
                // A resumed round gets a whole deadline again, and closes at once if it is full.
                if let Some(round) = task.current().filter(|r| r.secagg.is_none()) {
                    let deadline = now_ms() + task.record().config.round_deadline_secs * 1000;
                    round
                        .deadline_unix_ms
                        .store(deadline, std::sync::atomic::Ordering::SeqCst);
                    self.watch_deadline(task.clone(), round.clone());
                    self.close_if_full(&task, &round);
                }
            }
            _ => {}
        }
        task.bump();
        Ok(self.info(&task))
    }

    pub fn history(&self, task: &Task) -> Result<Vec<RoundRecord>, ServerError> {
        Ok(self.store.history(&task.id)?)
    }

    /// The model digest published by round `round` (0: the initial model).
    pub fn round_model(&self, task: &Task, round: u64) -> Result<ModelDigest, ServerError> {
        let record = task.record();
        if round == 0 {
            return Ok(record.config.initial_model);
        }
        let published = self
            .history(task)?
            .into_iter()
            .find(|r| r.round == round && r.model.is_some())
            .ok_or_else(|| {
                ServerError::NotFound(format!(
                    "task `{}` has not published round {round}",
                    task.id
                ))
            })?;
        let digest = published.model.expect("found by its model");
        if published.pruned && !self.store.model_path(&digest).exists() {
            return Err(ServerError::Gone {
                code: "model_pruned",
                message: format!(
                    "round {round}'s model was removed by the server's retention policy (--retain-rounds-last, --retain-rounds-every)"
                ),
            });
        }
        Ok(digest)
    }

    // -- clients ----------------------------------------------------------------------------

    fn retry_after(&self, task: &Task) -> u64 {
        let base = task
            .current()
            .map(|r| r.deadline().saturating_sub(now_ms()))
            .unwrap_or(5_000)
            .clamp(500, 60_000);
        // Jitter spreads reconnects so a federation never comes back as one herd.
        rand::rng().random_range(base / 2..=base)
    }

    /// The task's state for `client`; waits up to `wait` for a round later than `after`.
    pub async fn poll(
        &self,
        task: Arc<Task>,
        client: &str,
        after: Option<u64>,
        wait: Duration,
    ) -> wire::PollResponse {
        let mut changed = task.changed.subscribe();
        let deadline = tokio::time::Instant::now() + wait.min(self.config.max_poll_wait);
        loop {
            let state = task.record().state;
            let round = task.current();
            let ready = state != TaskState::Running
                || round
                    .as_ref()
                    .is_some_and(|r| after.is_none_or(|a| r.number > a));
            if ready || tokio::time::Instant::now() >= deadline {
                let (selected, contributed) = round
                    .as_ref()
                    .map(|r| {
                        let acc = lock(&r.acc);
                        (
                            acc.selected.contains(client),
                            acc.contributions.iter().any(|c| c.client == client),
                        )
                    })
                    .unwrap_or((false, false));
                return wire::PollResponse {
                    task: task.id.clone(),
                    state,
                    open_round: round.map(|r| r.number),
                    selected,
                    contributed,
                    retry_after_ms: self.retry_after(&task),
                };
            }
            if tokio::time::timeout_at(deadline, changed.changed())
                .await
                .is_err()
            {
                continue; // timed out: answer with what there is
            }
        }
    }

    /// Selects `client` for the open round if there is room.
    pub fn join(&self, task: &Task, client: &str) -> Result<wire::JoinResponse, ServerError> {
        let record = task.record();
        match record.state {
            TaskState::Running => {}
            TaskState::Paused => {
                return Ok(wire::JoinResponse {
                    offer: None,
                    retry_after_ms: self.retry_after(task),
                })
            }
            s => {
                return Err(ServerError::conflict(
                    "task_ended",
                    format!("task `{}` is {}", task.id, format!("{s:?}").to_lowercase()),
                ))
            }
        }
        let Some(round) = task.current() else {
            return Ok(wire::JoinResponse {
                offer: None,
                retry_after_ms: self.retry_after(task),
            });
        };
        let capacity = capacity(&record.config);
        if let Some(s) = &round.secagg {
            // Keys are advertised right after joining: once advertising has closed, the
            // attempt's participants are fixed.
            if s.stage() != secagg::Stage::Advertise {
                return Ok(wire::JoinResponse {
                    offer: None,
                    retry_after_ms: self.retry_after(task),
                });
            }
            let registered = self
                .store
                .client(client)?
                .is_some_and(|c| c.identity_key.is_some());
            if !registered {
                return Err(ServerError::conflict(
                    "no_identity_key",
                    format!("task `{}` uses secure aggregation, which needs an identity key registered at enrolment; client `{client}` has none: enrol it again with a current client", task.id),
                ));
            }
        }
        {
            let mut acc = lock(&round.acc);
            if acc.contributions.iter().any(|c| c.client == client) {
                return Err(already_contributed(client, round.number));
            }
            if !acc.selected.contains(client) {
                let strategy = strategy::from_config(&record.config.strategy);
                if acc.closing || !strategy.admits(client, acc.selected.len(), capacity) {
                    return Ok(wire::JoinResponse {
                        offer: None,
                        retry_after_ms: self.retry_after(task),
                    });
                }
                acc.selected.insert(client.to_string());
                // Selection survives a restart on a best-effort basis (the next commit or close
                // flushes it); a client that loses it simply joins again.
                let rec = round.record(&acc);
                self.store.put_open_round(&task.id, &rec)?;
            }
        }
        task.bump();
        Ok(wire::JoinResponse {
            offer: Some(RoundOffer {
                round: round.number,
                model: round.base,
                model_kind: record.config.model.clone(),
                round_key: round.key.public_key(),
                deadline_unix_ms: round.deadline(),
                training: record.config.training.clone(),
                secure_aggregation: round.secagg.as_ref().map(|s| s.offer()),
            }),
            retry_after_ms: 0,
        })
    }

    /// The upload path: checks the round, opens the envelope, validates, folds, and returns
    /// once the update is durable. `body` is the sealed envelope, decrypted in place.
    /// `permit` (an ingest slot) is released as soon as the update is folded, before the wait
    /// for durability, so the next body can be read meanwhile.
    pub async fn upload(
        self: &Arc<Self>,
        task: Arc<Task>,
        client: String,
        round_number: u64,
        meta: UpdateMeta,
        mut body: Vec<u8>,
        permit: crate::api::body::IngestPermit,
    ) -> Result<wire::UpdateReceipt, ServerError> {
        let round = match self.check_upload(&task, &client, round_number)? {
            Admission::Fresh(round) => round,
            Admission::Pending(round, index) => return self.receipt(&round, index).await,
        };
        if meta.num_examples == 0 {
            return Err(ServerError::InvalidUpdate(
                "num_examples must be at least 1".into(),
            ));
        }
        for (name, v) in [
            ("loss", meta.metrics.loss),
            ("accuracy", meta.metrics.accuracy),
        ] {
            if v.is_some_and(|v| !v.is_finite()) {
                return Err(ServerError::InvalidUpdate(format!(
                    "metric `{name}` must be a finite number"
                )));
            }
        }
        let record = task.record();
        let spec = record.spec;
        let bounds = record.config.update_bounds;
        let dp = record.dp;
        // Example counts above the task's bound count as the bound.
        let weight = meta.num_examples.min(bounds.max_weight.max(1));
        let me = self.clone();
        let (round, index, _folded) = tokio::task::spawn_blocking(move || -> Result<_, ServerError> {
            let started = Instant::now();
            let binding = Binding {
                task: &task.id,
                round: round.number,
                client: &client,
                base_model: &round.base,
            };
            let view = open_update(&mut body, &round.key, &binding, &spec)?;
            let norm = match bounds.max_norm.is_some() || dp.is_some() {
                true => view.l2_norm(),
                false => 0.0,
            };
            let scale = match bounds.max_norm {
                None => 1.0,
                Some(bound) => {
                    match bounds.on_norm_exceeded {
                        _ if norm <= bound => 1.0,
                        wire::NormPolicy::Clip => bound / norm,
                        wire::NormPolicy::Refuse => {
                            return Err(ServerError::invalid(
                                "update_norm_exceeded",
                                format!("the update's L2 norm {norm:.6e} exceeds the task's bound of {bound}: clip it or lower the learning rate"),
                            ))
                        }
                    }
                }
            };
            // Under central DP every update is clipped to the round's norm and weighs 1.
            let (fold_weight, scale, unclipped) = match &dp {
                Some(state) => {
                    let (factor, unclipped) = state.clip_update(norm);
                    (1.0, scale.min(factor), Some(unclipped))
                }
                None => (weight as f64, scale, None),
            };
            let index = {
                let mut acc = lock(&round.acc);
                // Re-check under the lock: the round may have closed, or a duplicate raced us.
                if acc.closing {
                    return Err(ServerError::conflict(
                        "round_closed",
                        format!(
                            "round {} closed while the update was being checked",
                            round.number
                        ),
                    ));
                }
                if let Some(index) = acc.contributions.iter().position(|c| c.client == client) {
                    // A retry raced its own first attempt: answer as the first is answered.
                    return Ok((round.clone(), index, false));
                }
                acc.sum
                    .add_view_scaled(fold_weight, scale, &view)
                    .map_err(|e| ServerError::InvalidUpdate(e.to_string()))?;
                acc.contributions.push(Contribution {
                    client,
                    examples: weight,
                    metrics: meta.metrics,
                    unclipped,
                });
                acc.contributions.len() - 1
            };
            me.metrics
                .ingest_seconds
                .observe(started.elapsed().as_secs_f64());
            me.close_if_full(&task, &round);
            Ok((round, index, true))
        })
        .await
        .map_err(ServerError::internal)??;
        drop(permit);
        self.commit_wanted.notify_one();
        self.receipt(&round, index).await
    }

    /// Acknowledges contribution `index` of `round` once a commit (or the publication) that
    /// contains it is durable — waiting at most the durability timeout, after which the client
    /// is told to retry (and its retry waits the same way; nothing is folded twice).
    async fn receipt(
        &self,
        round: &Arc<Round>,
        index: usize,
    ) -> Result<wire::UpdateReceipt, ServerError> {
        let mut durability = round.durability.subscribe();
        let waited = tokio::time::timeout(
            self.config.durability_timeout,
            durability.wait_for(|d| match d {
                Durability::Upto(n) => *n > index,
                Durability::Abandoned(_) => true,
            }),
        )
        .await
        .map_err(|_| {
            ServerError::unavailable(
                "not_durable_yet",
                format!(
                    "the update was accepted but is not durable after {} s (storage is slow); retry the same upload to get its receipt",
                    self.config.durability_timeout.as_secs()
                ),
            )
        })?;
        let outcome = waited.map(|d| d.clone()).map_err(|_| {
            ServerError::unavailable(
                "shutting_down",
                "the server is shutting down; retry the upload",
            )
        })?;
        match outcome {
            Durability::Upto(_) => Ok(wire::UpdateReceipt {
                round: round.number,
                accepted: index as u32 + 1,
            }),
            Durability::Abandoned(reason) => Err(ServerError::conflict(
                "round_abandoned",
                format!(
                    "round {} was abandoned ({reason}); poll for the retry",
                    round.number
                ),
            )),
        }
    }

    /// The checks an upload must pass before its body is worth reading. A client whose update
    /// is folded but not yet durable (a retry after a lost answer) is admitted as
    /// [`Admission::Pending`]: it waits for durability like the first request.
    pub fn check_upload(
        &self,
        task: &Task,
        client: &str,
        round_number: u64,
    ) -> Result<Admission, ServerError> {
        let state = task.record().state;
        if matches!(state, TaskState::Stopped | TaskState::Finished) {
            return Err(ServerError::conflict(
                "round_closed",
                format!(
                    "task `{}` is {} and takes no more updates",
                    task.id,
                    format!("{state:?}").to_lowercase()
                ),
            ));
        }
        let round = task
            .current()
            .ok_or_else(|| ServerError::conflict("round_closed", "no round is open"))?;
        if round.secagg.is_some() {
            return Err(ServerError::conflict(
                "secure_aggregation",
                format!("task `{}` uses secure aggregation: updates go through its stages (/v1/tasks/{{task}}/secagg/…), not a sealed upload", task.id),
            ));
        }
        if round_number != round.number {
            let code = if round_number < round.number {
                "round_closed"
            } else {
                "wrong_round"
            };
            return Err(ServerError::conflict(
                code,
                format!(
                    "round {round_number} is not open; the open round is {}",
                    round.number
                ),
            ));
        }
        let acc = lock(&round.acc);
        if acc.closing {
            return Err(ServerError::conflict(
                "round_closed",
                format!("round {} is closing", round.number),
            ));
        }
        if !acc.selected.contains(client) {
            return Err(ServerError::conflict(
                "not_selected",
                format!(
                    "client `{client}` is not selected for round {}: join it first",
                    round.number
                ),
            ));
        }
        match acc.contributions.iter().position(|c| c.client == client) {
            Some(index) if index < acc.durable => Err(already_contributed(client, round.number)),
            Some(index) => Ok(Admission::Pending(round.clone(), index)),
            None => Ok(Admission::Fresh(round.clone())),
        }
    }

    /// The receipt of `client`'s update to the open round if it is folded but not yet durable
    /// (so a retry need not send its body again).
    pub async fn pending_receipt(
        &self,
        task: &Task,
        client: &str,
        round_number: u64,
    ) -> Result<Option<wire::UpdateReceipt>, ServerError> {
        match self.check_upload(task, client, round_number)? {
            Admission::Fresh(_) => Ok(None),
            Admission::Pending(round, index) => self.receipt(&round, index).await.map(Some),
        }
    }

    fn close_if_full(self: &Arc<Self>, task: &Arc<Task>, round: &Arc<Round>) {
        let record = task.record();
        if record.state != TaskState::Running
            || lock(&round.acc).contributions.len() < record.config.target_clients as usize
        {
            return;
        }
        let (me, task, round) = (self.clone(), task.clone(), round.clone());
        tokio::spawn(async move { me.close_until_done(task, round).await });
    }

    /// Closes `round`, retrying every second while closing fails (storage trouble) and the
    /// round is still the task's open one; the uploads in it wait meanwhile.
    async fn close_until_done(self: Arc<Self>, task: Arc<Task>, round: Arc<Round>) {
        loop {
            let (me, t, r) = (self.clone(), task.clone(), round.clone());
            let closed = tokio::task::spawn_blocking(move || me.close_round(&t, &r, None))
                .await
                .map_err(ServerError::internal)
                .and_then(|r| r);
            match closed {
                Ok(()) => return,
                Err(e) => {
                    tracing::error!(task = %task.id, round = round.number, error = %e, "closing the round failed; retrying in a second");
                }
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
            let current = task.current();
            if !current.as_ref().is_some_and(|c| Arc::ptr_eq(c, &round))
                || task.record().state != TaskState::Running
            {
                return;
            }
        }
    }

    fn watch_deadline(self: &Arc<Self>, task: Arc<Task>, round: Arc<Round>) {
        if round.secagg.is_some() {
            return self.watch_secagg_deadlines(task, round);
        }
        let me = self.clone();
        tokio::spawn(async move {
            loop {
                let wait = round.deadline().saturating_sub(now_ms());
                tokio::time::sleep(Duration::from_millis(wait)).await;
                let current = task.current();
                if !current.as_ref().is_some_and(|c| Arc::ptr_eq(c, &round))
                    || lock(&round.acc).closing
                {
                    return; // closed or replaced meanwhile
                }
                if round.deadline() > now_ms() {
                    continue; // moved (resume)
                }
                if task.record().state != TaskState::Running {
                    return; // paused: resume restarts the clock
                }
                me.close_until_done(task, round).await;
                return;
            }
        });
    }

    /// Group commit: whenever uploads are pending, wait a short window for more, then write one
    /// checkpoint per round that has any.
    async fn committer(self: Arc<Self>) {
        // Checkpoints are spaced by at least the time the last one took: while one is written
        // uploads queue behind the accumulator lock, and between two of them several uploads
        // fold, so one checkpoint covers many uploads when the model is large.
        let mut last = Duration::ZERO;
        loop {
            self.commit_wanted.notified().await;
            tokio::time::sleep(self.config.commit_window.max(last)).await;
            let started = Instant::now();
            let tasks: Vec<_> = self
                .tasks
                .read()
                .expect("tasks lock")
                .values()
                .cloned()
                .collect();
            for task in tasks {
                let Some(round) = task.current() else {
                    continue;
                };
                let me = self.clone();
                let result =
                    tokio::task::spawn_blocking(move || me.checkpoint(&task, &round)).await;
                if let Ok(Err(e)) | Err(e) = result.map_err(ServerError::internal) {
                    tracing::error!(error = %e, "checkpoint failed; uploads stay unacknowledged and will be retried");
                }
            }
            last = started.elapsed();
        }
    }

    /// Whether a task other than `task` records the strategy state file `name`. State files are
    /// content-addressed, so two tasks with the same strategy, spec and sums share one; the
    /// startup sweep keeps every recorded file, and a task must not delete another's.
    fn state_used_by_another_task(&self, task: &str, name: &str) -> bool {
        self.tasks
            .read()
            .expect("tasks lock")
            .values()
            .filter(|t| t.id != task)
            .any(|t| lock(&t.record).strategy_state.as_deref() == Some(name))
    }

    fn checkpoint(&self, task: &Task, round: &Round) -> Result<(), ServerError> {
        let mut acc = lock(&round.acc);
        if acc.closing || acc.durable == acc.contributions.len() {
            return Ok(());
        }
        let started = Instant::now();
        let file = self.store.write_checkpoint(acc.sum.sum())?;
        let written = Checkpointed {
            file,
            total_weight: acc.sum.total_weight(),
            noised: acc.noised,
        };
        let old = acc.checkpoint.replace(written);
        let pending = acc.durable;
        acc.durable = acc.contributions.len();
        let record = round.record(&acc);
        let written = self
            .store
            .put_open_round(&task.id, &record)
            .and_then(|_| self.store.flush());
        if let Err(e) = written {
            // Roll back: these uploads are not durable yet.
            acc.durable = pending;
            let new = std::mem::replace(&mut acc.checkpoint, old);
            let kept = acc.checkpoint.as_ref().map(|c| c.file.as_str());
            if let Some(new) = new.filter(|n| Some(n.file.as_str()) != kept) {
                self.store.remove_checkpoint(&new.file);
            }
            return Err(e.into());
        }
        // (Equal contents have equal names: never delete the file just written.)
        let kept = acc.checkpoint.as_ref().map(|c| c.file.as_str());
        if let Some(old) = old.filter(|o| Some(o.file.as_str()) != kept) {
            self.store.remove_checkpoint(&old.file);
        }
        round.durability.send_replace(Durability::Upto(acc.durable));
        tracing::debug!(task = %task.id, round = round.number, durable = acc.durable, ms = started.elapsed().as_millis() as u64, "checkpoint");
        Ok(())
    }

    /// Closes `round`: publishes it when it has enough updates (and `abandon` is None), else
    /// abandons it; then opens the next round or the retry. Blocking (file and database I/O).
    fn close_round(
        self: &Arc<Self>,
        task: &Arc<Task>,
        round: &Arc<Round>,
        abandon: Option<&str>,
    ) -> Result<(), ServerError> {
        let mut acc = lock(&round.acc);
        if acc.closing {
            return Ok(());
        }
        acc.closing = true;
        let started = Instant::now();
        let mut record = task.record();
        let n = acc.contributions.len();
        let participants: Vec<String> =
            acc.contributions.iter().map(|c| c.client.clone()).collect();
        let dropped: Vec<String> = acc
            .selected
            .iter()
            .filter(|c| !participants.contains(c))
            .cloned()
            .collect();
        let examples: u64 = match &round.secagg {
            // Only the total is known: it was summed inside the masked vectors.
            Some(_) => acc.sum.total_weight() as u64,
            None => acc
                .contributions
                .iter()
                .fold(0u64, |sum, c| sum.saturating_add(c.examples)),
        };
        let strategy = strategy::from_config(&record.config.strategy);
        let metrics = strategy.aggregate_metrics(&acc.contributions);
        let mut reason = match abandon {
            Some(r) => Some(r.to_string()),
            None if n < record.config.min_clients as usize => Some(format!(
                "{n} of the required {} updates by the deadline",
                record.config.min_clients
            )),
            None => None,
        };

        // Central DP: the sum is noised once and divided by the expected count before the
        // strategy sees it; a round that would exceed the privacy budget ends the task instead.
        let mut privacy = None;
        if let Some(state) = record.dp.clone().filter(|_| reason.is_none()) {
            let acc = &mut *acc;
            let closing = dp::RoundFacts::of(
                &*self.store,
                &task.id,
                round.number,
                acc.selected.len(),
                &acc.contributions,
            )
            .map_err(ServerError::from)
            .and_then(|facts| {
                dp::close_round(&record.config, &state, &mut acc.sum, &mut acc.noised, facts)
                    .map_err(ServerError::internal)
            });
            match closing {
                Ok(dp::Closing::Publish(publication)) => privacy = Some(publication),
                Ok(dp::Closing::BudgetReached(why)) => {
                    tracing::warn!(task = %task.id, reason = %why, "the task finishes: privacy budget");
                    record.state = TaskState::Finished;
                    record.ended_reason = Some(why.clone());
                    reason = Some(why);
                }
                Err(e) => {
                    acc.closing = false;
                    return Err(e);
                }
            }
        }

        // The new global model is computed in the old one's file bytes, in place. A result that
        // is not finite abandons the attempt: it is never published.
        let aggregated = match &reason {
            None => {
                // A stateful strategy also writes its next state (a new durable file, published
                // below in the same record as the model); the previous state stays until then.
                let aggregate = || -> Result<_, ServerError> {
                    let mut bytes = self.store.model_bytes(&round.base)?;
                    match strategy::aggregate_round(
                        strategy.as_ref(),
                        &mut bytes,
                        &acc.sum,
                        &self.store.strategy_state_dir(),
                        record.strategy_state.as_deref(),
                    ) {
                        Ok((digest, state)) => Ok(Some((digest, bytes, state))),
                        Err(strategy::AggregateError::Kernel(KernelError::NotFinite(detail))) => {
                            Err(ServerError::InvalidUpdate(detail))
                        }
                        Err(e) => Err(ServerError::internal(e)),
                    }
                };
                match aggregate() {
                    Ok(v) => v,
                    Err(ServerError::InvalidUpdate(detail)) => {
                        reason = Some(format!("the aggregated model is not finite ({detail}): some update is out of range; bound updates with update_bounds.max_norm"));
                        None
                    }
                    Err(e) => {
                        acc.closing = false;
                        return Err(e);
                    }
                }
            }
            Some(_) => None,
        };
        let previous_state = record.strategy_state.clone();
        let new_state = aggregated.as_ref().and_then(|(_, _, state)| state.clone());
        // Set once the task record naming the new state is written: from then on the file may be
        // what the store names, and only the startup sweep may judge it unused.
        let recorded = std::cell::Cell::new(false);
        // The task record is held from here until the new one is in memory, so an operator's
        // pause or resume (`set_state`, which writes the record under the same lock) is neither
        // lost nor able to write back the record this close replaces. One made since the close
        // began is kept; a stop closes the round itself, and a finished task stays finished.
        let mut current = lock(&task.record);
        if matches!(current.state, TaskState::Running | TaskState::Paused)
            && matches!(record.state, TaskState::Running | TaskState::Paused)
        {
            record.state = current.state;
        }
        let result = (|| -> Result<(RoundRecord, Option<Arc<Round>>), ServerError> {
            let outcome_model = match aggregated {
                Some((digest, bytes, state)) => {
                    self.store.put_model_bytes(&digest, &bytes)?;
                    drop(bytes);
                    record.published += 1;
                    record.global_model = digest;
                    record.strategy_state = state;
                    if record.published >= record.config.rounds {
                        record.state = TaskState::Finished;
                    }
                    if let Some(p) = &privacy {
                        record.dp = Some(p.state.clone());
                        if let Some(why) = &p.budget_reached {
                            tracing::warn!(task = %task.id, reason = %why, "the task finishes: privacy budget");
                            record.state = TaskState::Finished;
                            record.ended_reason = Some(why.clone());
                        }
                    }
                    Some(digest)
                }
                None => None,
            };
            let history = RoundRecord {
                round: round.number,
                attempt: round.attempt,
                outcome: match &reason {
                    None => RoundOutcome::Published,
                    Some(r) => RoundOutcome::Abandoned { reason: r.clone() },
                },
                participants: participants.clone(),
                dropped: dropped.clone(),
                examples,
                metrics,
                duration_ms: round.opened.elapsed().as_millis() as u64,
                privacy: privacy
                    .as_ref()
                    .filter(|_| outcome_model.is_some())
                    .map(|p| p.spent.clone()),
                model: outcome_model,
                pruned: false,
            };
            let next = match record.state {
                TaskState::Running | TaskState::Paused => Some(match &reason {
                    None => self.fresh_round(&record, round.number + 1, 0)?,
                    Some(_) => self.fresh_round(&record, round.number, round.attempt + 1)?,
                }),
                _ => None,
            };
            let next_record = next.as_ref().map(|r| r.record(&lock(&r.acc)));
            self.store.finish_round(
                &task.id,
                &record,
                &history,
                round.attempt,
                next_record.as_ref(),
            )?;
            recorded.set(true);
            match next.as_ref().and_then(|n| n.secagg.as_ref()) {
                Some(s) => s.persist_new(&*self.store)?,
                None if round.secagg.is_some() => self.store.secagg_clear(&task.id)?,
                None => {}
            }
            self.store.flush()?;
            Ok((history, next))
        })();
        if result.is_ok() {
            *current = record.clone();
        }
        drop(current);

        let (history, next) = match result {
            Ok(v) => v,
            Err(e) => {
                // Nothing was published: keep collecting and let the deadline try again (from
                // the previous state, which is still the recorded one).
                if let Some(new) = new_state.filter(|n| {
                    !recorded.get()
                        && Some(n) != previous_state.as_ref()
                        && !self.state_used_by_another_task(&task.id, n)
                }) {
                    self.store.remove_strategy_state(&new);
                }
                acc.closing = false;
                return Err(e);
            }
        };
        // The new state is published with the model: the previous one is garbage now. (Equal
        // contents have equal names: never delete the file just recorded.)
        if let Some(old) = previous_state.filter(|o| {
            Some(o) != record.strategy_state.as_ref()
                && !self.state_used_by_another_task(&task.id, o)
        }) {
            self.store.remove_strategy_state(&old);
        }
        if let Some(c) = acc.checkpoint.take() {
            self.store.remove_checkpoint(&c.file);
        }
        if let Some(file) = round.secagg.as_ref().and_then(|s| s.sum_file()) {
            self.store.remove_checkpoint(&file);
        }
        match &reason {
            None => {
                round.durability.send_replace(Durability::Upto(n));
                self.metrics
                    .round_published(&task.id, started.elapsed().as_secs_f64());
                if let Some(p) = &history.privacy {
                    self.metrics.dp_epsilon(&task.id, p.epsilon);
                }
                tracing::info!(task = %task.id, round = round.number, updates = n, examples, loss = ?history.metrics.loss, model = %history.model.map(|d| d.to_hex()[..12].to_string()).unwrap_or_default(), "round published");
            }
            Some(r) => {
                round
                    .durability
                    .send_replace(Durability::Abandoned(r.clone()));
                self.metrics.round_abandoned(&task.id);
                tracing::warn!(task = %task.id, round = round.number, attempt = round.attempt, reason = %r, "round abandoned");
            }
        }
        drop(acc);
        if reason.is_none() {
            match self
                .store
                .prune_models(&task.id, self.config.retention, record.published)
            {
                Ok(0) => {}
                Ok(n) => tracing::debug!(task = %task.id, files = n, "pruned round models"),
                Err(e) => {
                    tracing::warn!(task = %task.id, error = %e, "pruning old round models failed; they stay until the next round")
                }
            }
        }
        *lock(&task.round) = next.clone();
        task.bump();
        if let Some(next) = next {
            // Runs on one of the runtime's blocking threads, which can spawn.
            self.watch_deadline(task.clone(), next);
        }
        Ok(())
    }
}

/// The upload path's checks, in order: open the envelope in place (authenticity and binding),
/// parse the safetensors under the spec's limits, check names, shapes and dtypes against the
/// spec, and check every value is finite. What comes back can be folded as it is.
pub fn open_update<'a>(
    body: &'a mut [u8],
    key: &RoundSecretKey,
    binding: &Binding<'_>,
    spec: &ModelSpec,
) -> Result<ModelView<'a>, ServerError> {
    let invalid = |e: &dyn std::fmt::Display| ServerError::InvalidUpdate(e.to_string());
    let plaintext = envelope::open(body, key, binding).map_err(|e| invalid(&e))?;
    let view = ModelView::parse(plaintext, &spec.limits()).map_err(|e| invalid(&e))?;
    spec.check_spec(&view.spec()).map_err(|e| invalid(&e))?;
    view.check_finite().map_err(|e| invalid(&e))?;
    Ok(view)
}

fn already_contributed(client: &str, round: u64) -> ServerError {
    ServerError::conflict(
        "already_contributed",
        format!("client `{client}` has already uploaded its update for round {round}"),
    )
}

fn validate_task(c: &wire::CreateTask) -> Result<(), ServerError> {
    let bad = |m: String| Err(ServerError::BadRequest(m));
    if !wire::valid_id(&c.id) {
        return bad(format!("task id `{}` must be 1-64 of [A-Za-z0-9_.-]", c.id));
    }
    if c.rounds == 0 {
        return bad("rounds must be at least 1".into());
    }
    if c.min_clients == 0 || c.target_clients < c.min_clients {
        return bad(format!(
            "need 1 <= min_clients ({}) <= target_clients ({})",
            c.min_clients, c.target_clients
        ));
    }
    if !(0.0..=10.0).contains(&c.over_selection) {
        return bad("over_selection must be between 0 and 10".into());
    }
    if c.round_deadline_secs == 0 || c.round_deadline_secs > 7 * 86_400 {
        return bad("round_deadline_secs must be between 1 and 604800".into());
    }
    // (Before secure aggregation's checks: combining the two is the first thing to hear about.)
    if let Some(config) = &c.differential_privacy {
        dp::validate(config, c).map_err(ServerError::BadRequest)?;
    }
    if let Some(sa) = &c.secure_aggregation {
        secagg::validate(sa, c.min_clients, capacity(c))?;
    }
    if let Err(message) = strategy::validate(&c.strategy) {
        return bad(message);
    }
    let b = &c.update_bounds;
    if b.max_weight == 0 {
        return bad("update_bounds.max_weight must be at least 1".into());
    }
    if b.max_norm.is_some_and(|n| !(n.is_finite() && n > 0.0)) {
        return bad("update_bounds.max_norm must be a positive finite number".into());
    }
    let t = &c.training;
    if t.epochs == 0
        || t.batch_size == 0
        || !(t.learning_rate.is_finite() && t.learning_rate > 0.0)
        || !(t.proximal_mu.is_finite() && t.proximal_mu >= 0.0)
    {
        return bad("training needs epochs >= 1, batch_size >= 1, a positive learning_rate and proximal_mu >= 0".into());
    }
    Ok(())
}

/// The spec of a task, for the upload route's size limit.
pub fn upload_limit(spec: &ModelSpec) -> u64 {
    spec.limits().max_bytes + envelope::OVERHEAD as u64
}

impl Task {
    pub fn spec(&self) -> ModelSpec {
        self.record().spec
    }

    pub fn module_digest(&self) -> Option<String> {
        match self.record().config.model {
            wire::ModelKind::TorchScript { module_digest } => Some(module_digest),
            wire::ModelKind::Builtin { .. } => None,
        }
    }

    pub fn global_model(&self) -> ModelDigest {
        self.record().global_model
    }
}

// -- secure aggregation ------------------------------------------------------------------------

impl Coordinator {
    /// The attempt `attempt` of round `round_number` of `task`, for a message from `client`.
    pub fn secagg_round(
        &self,
        task: &Task,
        client: &str,
        round_number: u64,
        attempt: u32,
    ) -> Result<(Arc<Round>, Arc<SecAggRound>), ServerError> {
        let round = task.current().ok_or_else(|| {
            ServerError::conflict(
                "round_closed",
                format!("task `{}` has no open round", task.id),
            )
        })?;
        let Some(s) = round.secagg.clone() else {
            return Err(ServerError::conflict(
                "not_secure_aggregation",
                format!("task `{}` does not use secure aggregation", task.id),
            ));
        };
        if round_number != round.number {
            return Err(ServerError::conflict(
                if round_number < round.number {
                    "round_closed"
                } else {
                    "wrong_round"
                },
                format!(
                    "round {round_number} is not open; the open round is {}",
                    round.number
                ),
            ));
        }
        if attempt != round.attempt {
            return Err(ServerError::conflict(
                if attempt < round.attempt { "round_abandoned" } else { "wrong_round" },
                format!(
                    "attempt {attempt} of round {round_number} is not the open one ({}): poll and join the retry",
                    round.attempt
                ),
            ));
        }
        if !lock(&round.acc).selected.contains(client) {
            return Err(ServerError::conflict(
                "not_selected",
                format!(
                    "client `{client}` is not selected for round {round_number}: join it first"
                ),
            ));
        }
        Ok((round, s))
    }

    /// Acts on what a secure-aggregation message or deadline did: publishes the unmasked sum,
    /// or abandons the attempt (the round is retried). Blocking.
    pub fn secagg_outcome(
        self: &Arc<Self>,
        task: &Arc<Task>,
        round: &Arc<Round>,
        outcome: secagg::Outcome,
    ) -> Result<(), ServerError> {
        match outcome {
            secagg::Outcome::Continue => {
                task.bump();
                Ok(())
            }
            secagg::Outcome::Abandon(reason) => {
                let closed = self.close_round(task, round, Some(&reason));
                if closed.is_err() {
                    *lock(&round.secagg_retry) = Some(Some(reason));
                }
                closed
            }
            secagg::Outcome::Publish {
                values,
                total_weight,
                survivors,
            } => {
                {
                    let mut acc = lock(&round.acc);
                    let n = survivors.len() as u64;
                    acc.sum = WeightedSum::from_parts(task.spec(), values, total_weight as f64, n)
                        .map_err(ServerError::internal)?;
                    acc.contributions = survivors
                        .into_iter()
                        .map(|client| Contribution {
                            client,
                            examples: 0,
                            metrics: Metrics::default(),
                            unclipped: None,
                        })
                        .collect();
                    acc.durable = acc.contributions.len();
                }
                let closed = self.close_round(task, round, None);
                if closed.is_err() {
                    *lock(&round.secagg_retry) = Some(None);
                }
                closed
            }
        }
    }

    /// Closes each stage of a secure-aggregation attempt at its deadline.
    fn watch_secagg_deadlines(self: &Arc<Self>, task: Arc<Task>, round: Arc<Round>) {
        let me = self.clone();
        tokio::spawn(async move {
            let Some(s) = round.secagg.clone() else {
                return;
            };
            loop {
                let mut changed = s.changed.subscribe();
                let wait = s.deadline().saturating_sub(now_ms());
                // Wake at the deadline, or when the stage moves on (its deadline changes).
                let _ = tokio::time::timeout(Duration::from_millis(wait), changed.changed()).await;
                let current = task.current();
                if !current.as_ref().is_some_and(|c| Arc::ptr_eq(c, &round)) {
                    return;
                }
                if s.stage() == secagg::Stage::Ended {
                    // Ended, but the closing failed: try again until it goes through.
                    let Some(retry) = lock(&round.secagg_retry).take() else {
                        return;
                    };
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    let (me2, task2, round2) = (me.clone(), task.clone(), round.clone());
                    let _ = tokio::task::spawn_blocking(move || {
                        if let Err(e) = me2.close_round(&task2, &round2, retry.as_deref()) {
                            tracing::error!(task = %task2.id, error = %e, "closing the secure-aggregation round failed again; retrying");
                            *lock(&round2.secagg_retry) = Some(retry);
                        }
                    })
                    .await;
                    continue;
                }
                if task.record().state != TaskState::Running {
                    // Paused: no stage closes until the task is resumed.
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    continue;
                }
                if s.deadline() > now_ms() {
                    continue;
                }
                let (me2, task2, round2, s2) = (me.clone(), task.clone(), round.clone(), s.clone());
                let result = tokio::task::spawn_blocking(move || {
                    let outcome = s2.tick(&*me2.store)?;
                    me2.secagg_outcome(&task2, &round2, outcome)
                })
                .await
                .map_err(ServerError::internal)
                .and_then(|r| r);
                if let Err(e) = result {
                    tracing::error!(task = %task.id, round = round.number, error = %e, "closing a secure-aggregation stage failed; retrying in a second");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        });
    }
}
