//! A task: its record (configuration, state, what it has published), its open round, and the
//! operator's verbs on it — create, list, pause, resume, stop, round history and models.

use std::sync::{Arc, Mutex};

use hora_common::model::{name_matches, Model, ModelDigest, ModelSpec};
use hora_common::wire::{self, ErrorCode, OpenRoundStatus, RoundRecord, TaskInfo, TaskState};
use tokio::sync::watch;

use super::{capacity, lock, now_ms, Coordinator, Ending, Round};
use crate::dp;
use crate::error::ServerError;
use crate::secagg;
use crate::store::{PartRecord, TaskRecord};
use crate::strategy;

/// A task the coordinator serves.
pub struct Task {
    pub id: String,
    /// The record as stored: copied out by readers, replaced only once a new one is durable.
    pub(crate) record: Mutex<TaskRecord>,
    /// Held by whoever writes the record (a round's close, a pause, a resume, a stop) from
    /// reading it to replacing it, across the store's write and flush: writers take turns,
    /// readers never wait on the disk.
    pub(crate) writing: Mutex<()>,
    pub(crate) round: Mutex<Option<Arc<Round>>>,
    /// Wakes the task's group committer: an update or a selection waits to be made durable.
    pub(crate) commit_wanted: tokio::sync::Notify,
    /// Requests of this task that may wait on its round's lock on a blocking thread at once
    /// (joins, upload checks): the rest wait here, on the runtime, so a flood at one task whose
    /// large checkpoint holds that lock for seconds cannot take every blocking thread.
    pub(crate) lock_waiters: Arc<tokio::sync::Semaphore>,
    pub(crate) changed: watch::Sender<u64>,
    /// The L2 norms and weights of the task's last accepted updates, for the adaptive bounds.
    pub(crate) recent: Mutex<Recent>,
    /// The task's strategy, built once from its (immutable) configuration.
    pub(crate) strategy: Box<dyn strategy::Strategy>,
    /// Blobs written for writes of the task's records that failed with an unknown outcome (the
    /// database went away mid-commit): kept, since the record naming them may have landed,
    /// and removed once a later write of the same record landed and names another.
    pub(crate) unsettled: Mutex<Vec<Unsettled>>,
    /// Cancels the deadline watcher of the task's open evaluation, by its round (once it ends
    /// otherwise).
    pub(crate) evaluation_watch: Mutex<Option<(u64, tokio_util::sync::CancellationToken)>>,
    /// The coordinator's [`Coordinator::watch_changes`], bumped with the task's own.
    changes: Arc<watch::Sender<u64>>,
}

/// A blob kept after a write of unknown outcome (see [`Task::unsettled`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Unsettled {
    /// A checkpoint of the open round: superseded by the next checkpoint or close that lands.
    Checkpoint(String),
    /// A strategy's state: superseded by the next close that lands.
    StrategyState(String),
}

impl Task {
    /// A place among the task's requests that wait for its round's lock on blocking threads
    /// (at most [`super::LOCK_WAITERS`]); moved into the blocking work, so it is held for as
    /// long as that thread waits even if the request that started it is dropped.
    pub(crate) async fn lock_waiter(&self) -> tokio::sync::OwnedSemaphorePermit {
        self.lock_waiters
            .clone()
            .acquire_owned()
            .await
            .expect("the lock waiters' semaphore is never closed")
    }

    pub(crate) fn new(
        id: String,
        record: TaskRecord,
        round: Option<Arc<Round>>,
        strategy: Box<dyn strategy::Strategy>,
        changes: Arc<watch::Sender<u64>>,
    ) -> Task {
        Task {
            id,
            record: Mutex::new(record),
            writing: Mutex::default(),
            round: Mutex::new(round),
            commit_wanted: tokio::sync::Notify::new(),
            lock_waiters: Arc::new(tokio::sync::Semaphore::new(super::LOCK_WAITERS)),
            changed: watch::channel(0).0,
            recent: Mutex::default(),
            strategy,
            unsettled: Mutex::default(),
            evaluation_watch: Mutex::default(),
            changes,
        }
    }

    /// Keeps `blob` until a later write settles it (see [`Task::unsettled`]).
    pub(crate) fn unsettled(&self, blob: Unsettled) {
        super::lock(&self.unsettled).push(blob);
    }

    /// The kept blobs that a write which just landed supersedes, taken off the list:
    /// checkpoints after a checkpoint, everything after a close.
    pub(crate) fn settled(&self, by_close: bool) -> Vec<Unsettled> {
        let mut unsettled = super::lock(&self.unsettled);
        let (settled, kept) = std::mem::take(&mut *unsettled)
            .into_iter()
            .partition(|b| by_close || matches!(b, Unsettled::Checkpoint(_)));
        *unsettled = kept;
        settled
    }
}

/// The L2 norms and the weights of a task's last accepted updates (as folded, after any
/// clipping), kept in memory: after a restart the adaptive bounds wait for their warm-up again.
#[derive(Default)]
pub(crate) struct Recent {
    pub(crate) norms: Window,
    pub(crate) weights: Window,
}

/// The last [`wire::ADAPTIVE_NORM_WINDOW`] values of something about accepted updates.
#[derive(Default)]
pub(crate) struct Window(std::collections::VecDeque<f64>);

impl Window {
    /// `factor` times the median, once the warm-up is over.
    pub(crate) fn bound(&self, factor: f64) -> Option<f64> {
        if self.0.len() < wire::ADAPTIVE_NORM_WARMUP {
            return None;
        }
        let mut sorted: Vec<f64> = self.0.iter().copied().collect();
        sorted.sort_by(f64::total_cmp);
        let median = sorted[sorted.len() / 2];
        (median > 0.0).then_some(factor * median)
    }

    pub(crate) fn record(&mut self, norm: f64) {
        if norm.is_finite() {
            if self.0.len() == wire::ADAPTIVE_NORM_WINDOW {
                self.0.pop_front();
            }
            self.0.push_back(norm);
        }
    }
}

impl Task {
    pub(crate) fn record(&self) -> TaskRecord {
        self.record.lock().expect("task lock").clone()
    }

    /// The task's state, read without copying its record (the long polls and the round's
    /// watcher look at it on every change).
    pub(crate) fn state(&self) -> TaskState {
        lock(&self.record).state
    }

    pub(crate) fn current(&self) -> Option<Arc<Round>> {
        self.round.lock().expect("round slot").clone()
    }

    /// An update was accepted: its norm (when the adaptive norm bound is on) and its weight
    /// join the windows the adaptive bounds take their medians of.
    pub(crate) fn accepted(&self, norm: Option<f64>, weight: u64) {
        let mut recent = lock(&self.recent);
        if let Some(norm) = norm {
            recent.norms.record(norm);
        }
        recent.weights.record(weight as f64);
    }

    pub(crate) fn bump(&self) {
        self.changed.send_modify(|v| *v += 1);
        self.shown();
    }

    /// Tells the dashboard's feed only (not the task's long polls) of a change clients need
    /// not hear of: an evaluation that ended, say.
    pub(crate) fn shown(&self) {
        self.changes.send_modify(|v| *v = v.wrapping_add(1));
    }

    /// Notified whenever the task's state or round changes.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

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

impl Coordinator {
    pub fn create_task(
        self: &Arc<Self>,
        config: wire::CreateTask,
    ) -> Result<TaskInfo, ServerError> {
        validate_task(&config)?;
        if let (Some(parent), None) = (&config.parent, &self.parent) {
            return Err(ServerError::BadRequest(format!(
                "task `{}` names a parent task (`{}`), but this server has no parent: start it with --parent https://… (and --parent-ca, --parent-enrolment-token) to make it a regional aggregator",
                config.id, parent.task
            )));
        }
        let initial = self.store.read_model(&config.initial_model).map_err(|_| {
            ServerError::BadRequest(format!(
                "no uploaded model with digest {}: upload it first with POST /admin/v1/models",
                config.initial_model
            ))
        })?;
        // A task that trains part of its model: from here on its model is that part.
        let (initial, base) = match &config.trainable {
            None => (initial, None),
            Some(patterns) => split_model(initial, patterns)?,
        };
        if let Some(dp) = &config.differential_privacy {
            dp::validate_for_model(dp, &config, initial.numel())
                .map_err(ServerError::BadRequest)?;
        }
        if let Some(compression) = &config.compression {
            compression
                .validate(&initial.spec())
                .map_err(ServerError::BadRequest)?;
        }
        if let wire::ModelKind::TorchScript { module_digest } = &config.model {
            if !self.store.has_module(module_digest)? {
                return Err(ServerError::BadRequest(format!("no uploaded TorchScript module {module_digest}: upload it first with POST /admin/v1/modules")));
            }
        }
        let id = config.id.clone();
        let part = base.as_ref().map(|base| PartRecord {
            base: base.digest(),
            base_spec: base.spec(),
            initial: initial.digest(),
        });
        let record = TaskRecord {
            spec: initial.spec(),
            state: TaskState::Running,
            published: 0,
            global_model: part.as_ref().map_or(config.initial_model, |p| p.initial),
            created_unix_ms: now_ms(),
            strategy_state: None,
            dp: config.differential_privacy.as_ref().map(dp::DpState::new),
            ended_reason: None,
            part,
            evaluating: None,
            parent: config.parent.as_ref().map(|_| Default::default()),
            config,
        };
        // The registry is read by every request: its lock is never held across the store. The
        // store's create is the arbiter between two creates of one id.
        let exists =
            || ServerError::conflict(ErrorCode::TaskExists, format!("task `{id}` exists already"));
        // The base and the part are stored once the request is known good, and again (a head
        // request each) once the record names them: the part may be a model another task's
        // retention prunes meanwhile (its round's model, made the initial one of this task).
        let store_part = || -> Result<(), ServerError> {
            if let Some(base) = &base {
                self.store.put_model(base)?;
                self.store.put_model(&initial)?;
            }
            Ok(())
        };
        if self.tasks.read().expect("tasks lock").contains_key(&id) {
            return Err(exists());
        }
        store_part()?;
        if !self.store.create_task(&id, &record)? {
            return Err(exists());
        }
        store_part()?;
        if let Some(part) = &record.part {
            tracing::info!(
                task = %id,
                trainable = initial.numel(),
                frozen = base.as_ref().map_or(0, Model::numel),
                base = %part.base,
                "the task trains part of its model"
            );
        }
        drop((initial, base));
        // A regional task's first round is opened from its parent's, by its agent.
        let round = match record.parent {
            None => Some(self.new_round(&id, &record, 1, 0)?),
            Some(_) => None,
        };
        if record.dp.is_some() {
            self.metrics.dp_epsilon(&id, 0.0);
        }
        let strategy = strategy::from_config(&record.config.strategy);
        let task = Arc::new(Task::new(
            id.clone(),
            record,
            round.clone(),
            strategy,
            self.changes.clone(),
        ));
        self.tasks
            .write()
            .expect("tasks lock")
            .insert(id.clone(), task.clone());
        task.bump();
        self.commit_for(task.clone());
        match round {
            Some(round) => self.watch(task.clone(), round),
            None => self.follow_parent(task.clone()),
        }
        tracing::info!(task = %id, "task created");
        Ok(self.info(&task))
    }

    /// Every task, as they are now (the registry's lock is not held afterwards).
    pub(crate) fn all_tasks(&self) -> Vec<Arc<Task>> {
        self.tasks
            .read()
            .expect("tasks lock")
            .values()
            .cloned()
            .collect()
    }

    pub fn list(&self) -> Vec<TaskInfo> {
        let mut infos: Vec<_> = self.all_tasks().iter().map(|t| self.info(t)).collect();
        infos.sort_by(|a, b| a.config.id.cmp(&b.config.id));
        infos
    }

    pub fn info(&self, task: &Task) -> TaskInfo {
        let record = task.record();
        let open_round = task.current().map(|r| {
            let (_, accepted) = r.counts();
            OpenRoundStatus {
                round: r.number,
                attempt: r.attempt,
                selected: r.collection.selected(&r) as u32,
                accepted: accepted as u32,
                deadline_unix_ms: r.deadline(),
                stage: r.collection.stage(),
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
            frozen_base: record.part.map(|p| wire::FrozenBase {
                model: p.base,
                spec: p.base_spec,
            }),
        }
    }

    /// Pause, resume or stop.
    pub async fn set_state(
        self: &Arc<Self>,
        task: Arc<Task>,
        to: TaskState,
    ) -> Result<TaskInfo, ServerError> {
        let from = task.state();
        match (from, to) {
            (TaskState::Stopped | TaskState::Finished, _) => {
                return Err(ServerError::conflict(
                    ErrorCode::TaskEnded,
                    format!("task `{}` is {:?} and cannot change state", task.id, from)
                        .to_lowercase(),
                ))
            }
            (a, b) if a == b => return Ok(self.info(&task)),
            _ => {}
        }
        let (me, t) = (self.clone(), task.clone());
        crate::blocking(move || {
            let _writing = lock(&t.writing);
            let mut record = t.record();
            record.state = to;
            me.store.put_task(&t.id, &record)?;
            me.store.flush()?;
            *lock(&t.record) = record;
            Ok(())
        })
        .await?;
        tracing::info!(task = %task.id, state = ?to, "task state changed");
        match to {
            TaskState::Stopped => {
                if let Some(round) = task.current() {
                    let me = self.clone();
                    let t = task.clone();
                    tokio::task::spawn_blocking(move || {
                        me.close(&t, &round, Ending::Abandon("task stopped".into()))
                    })
                    .await
                    .map_err(ServerError::internal)??;
                }
            }
            TaskState::Running => {
                // A resumed plain round gets a whole deadline again, and closes at once if it is
                // full (its watcher wakes at the bump below).
                if let Some(round) = task.current().filter(|r| r.collection.restarts_on_resume()) {
                    round.set_deadline(now_ms() + task.record().config.round_deadline_secs * 1000);
                    let (me, t) = (self.clone(), task.clone());
                    crate::blocking(move || {
                        me.close_if_full(&t, &round);
                        Ok(())
                    })
                    .await?;
                }
            }
            _ => {}
        }
        task.bump();
        Ok(self.info(&task))
    }

    /// The model with digest `hex` if clients of `task` may download it: the current global
    /// model, its frozen base, or (asynchronous tasks) the base of a version updates may still
    /// be trained from.
    pub fn served_model(&self, task: &Task, hex: &str) -> Result<ModelDigest, ServerError> {
        let digest = ModelDigest::from_hex(hex)
            .map_err(|e| ServerError::BadRequest(format!("digest: {e}")))?;
        let record = task.record();
        let base = record.part.as_ref().is_some_and(|p| p.base == digest);
        let earlier = task.current().is_some_and(|r| r.collection.serves(&digest));
        let evaluated = record
            .evaluating
            .as_ref()
            .is_some_and(|e| e.model == digest);
        if digest != record.global_model && !base && !earlier && !evaluated {
            return Err(ServerError::conflict(
                ErrorCode::RoundClosed,
                format!(
                    "model {hex} is no longer handed out: task `{}` moved on; poll and join again",
                    task.id
                ),
            ));
        }
        if !self.store.has_model(&digest)? {
            return Err(pruned(&format!("model {hex}")));
        }
        Ok(digest)
    }

    pub fn history(&self, task: &Task) -> Result<Vec<RoundRecord>, ServerError> {
        Ok(self.store.history(&task.id)?)
    }

    /// The model digest published by round `round` (0: the initial model).
    pub fn round_model(&self, task: &Task, round: u64) -> Result<ModelDigest, ServerError> {
        let record = task.record();
        if round == 0 {
            return Ok(record.initial_model());
        }
        let published = self
            .store
            .round_attempts(&task.id, round)?
            .into_iter()
            .find(|r| r.round == round && r.model.is_some())
            .ok_or_else(|| {
                ServerError::NotFound(format!(
                    "task `{}` has not published round {round}",
                    task.id
                ))
            })?;
        let digest = published.model.expect("found by its model");
        if published.pruned && !self.store.has_model(&digest)? {
            return Err(pruned(&format!("round {round}'s model")));
        }
        Ok(digest)
    }
}

/// 410 for a model (`what`) whose file the retention policy removed.
fn pruned(what: &str) -> ServerError {
    ServerError::Gone {
        code: ErrorCode::ModelPruned,
        message: format!("{what} was removed by the server's retention policy (--retain-rounds-last, --retain-rounds-every)"),
    }
}

/// `model` split by a task's `trainable` patterns: its trainable part (the task's model from
/// now on) and its frozen base (none when the patterns name every tensor).
fn split_model(model: Model, patterns: &[String]) -> Result<(Model, Option<Model>), ServerError> {
    let bad = |m: String| Err(ServerError::BadRequest(m));
    let total: usize = patterns.iter().map(String::len).sum();
    if patterns.is_empty() || patterns.len() > MAX_TRAINABLE_PATTERNS || total > 64 << 10 {
        return bad(format!("trainable must name 1 to {MAX_TRAINABLE_PATTERNS} tensors or patterns, of at most 64 KiB together (leave it out to train every tensor)"));
    }
    let names = || model.tensors().iter().map(|t| t.name.as_str());
    for pattern in patterns {
        if pattern.is_empty() {
            return bad("a trainable pattern is empty".into());
        }
        if !names().any(|name| name_matches(pattern, name)) {
            let some: Vec<&str> = names().take(8).collect();
            return bad(format!(
                "trainable pattern `{pattern}` names no tensor of the model (its tensors include {some:?}; `*` stands for any run of characters)"
            ));
        }
    }
    let (part, base) = model.split(|name| patterns.iter().any(|p| name_matches(p, name)));
    drop(model);
    Ok((part, Some(base).filter(|b| !b.tensors().is_empty())))
}

/// The most names or patterns a task's `trainable` may list.
const MAX_TRAINABLE_PATTERNS: usize = 1024;

fn validate_task(c: &wire::CreateTask) -> Result<(), ServerError> {
    let bad = |m: String| Err(ServerError::BadRequest(m));
    if !wire::valid_id(&c.id) {
        return bad(format!("task id `{}` must be 1-64 of [A-Za-z0-9_.-]", c.id));
    }
    if c.rounds == 0 {
        return bad("rounds must be at least 1".into());
    }
    // The digest becomes a file name: 64 hex digits and nothing else (no path can hide in it).
    if let wire::ModelKind::TorchScript { module_digest } = &c.model {
        if module_digest.len() != 64
            || !module_digest
                .bytes()
                .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        {
            return bad(format!(
                "module_digest {module_digest:?} must be the 64 lowercase hex digits POST /admin/v1/modules answered"
            ));
        }
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
    if let Some(config) = &c.asynchronous {
        super::asynchronous::validate(config, c).map_err(ServerError::BadRequest)?;
    }
    // (Before secure aggregation's checks: combining the two is the first thing to hear about.)
    if let Some(config) = &c.differential_privacy {
        dp::validate(config, c).map_err(ServerError::BadRequest)?;
    }
    if c.compression.is_some() && c.secure_aggregation.is_some() {
        return bad("secure aggregation quantises updates itself (its clip and scale) and cannot take compressed ones: remove compression, or secure_aggregation".into());
    }
    if let Some(config) = &c.evaluation {
        super::evaluation::validate(config, c).map_err(ServerError::BadRequest)?;
    }
    if let Some(parent) = &c.parent {
        if !wire::valid_id(&parent.task) {
            return bad(format!(
                "parent.task `{}` must be 1-64 of [A-Za-z0-9_.-]",
                parent.task
            ));
        }
        // The parent's round does what these would do, once, for the whole tree.
        let theirs = [
            (c.secure_aggregation.is_some(), "secure_aggregation"),
            (c.asynchronous.is_some(), "asynchronous"),
            (c.differential_privacy.is_some(), "differential_privacy"),
            (c.evaluation.is_some(), "evaluation"),
            (c.strategy != wire::StrategyConfig::default(), "strategy"),
        ];
        if let Some((_, what)) = theirs.iter().find(|(set, _)| *set) {
            return bad(format!("a regional task (one with a parent) forwards plain rounds' partials, and the parent's task decides `{what}` for the whole tree: leave it out here"));
        }
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
    if b.adaptive_norm_factor
        .is_some_and(|f| !(f.is_finite() && f > 1.0))
    {
        return bad("update_bounds.adaptive_norm_factor must be a finite number above 1 (or null for no bound)".into());
    }
    if b.adaptive_weight_factor
        .is_some_and(|f| !(f.is_finite() && f > 1.0))
    {
        return bad("update_bounds.adaptive_weight_factor must be a finite number above 1 (or null for no bound)".into());
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
