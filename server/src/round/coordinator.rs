//! The [`Coordinator`]: every task and its open round, loaded (and resumed from the last
//! checkpoints) at start; the client verbs every round mode shares — the long poll and joining.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use hora_common::envelope::RoundSecretKey;
use hora_common::kernel::WeightedSum;
use hora_common::wire::{self, ErrorCode, TaskState};
use rand::Rng;
use tokio::sync::{watch, Notify};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::collection::Joined;
use super::{
    collection, jitter, lock, now_ms, Accumulator, Checkpointed, Collection, Durability, Roster,
    Round, SelectionDurability, Task,
};
use crate::error::ServerError;
use crate::metrics::ServerMetrics;
use crate::store::{OpenRoundRecord, Store, TaskRecord};
use crate::strategy;

/// Tunables of the coordinator.
#[derive(Debug, Clone)]
pub struct CoordinatorConfig {
    /// How long the committer waits after the first pending update for more to join the commit.
    pub commit_window: Duration,
    /// The longest a long poll is held open: see [`CoordinatorConfig::poll_cap`].
    pub max_poll_wait: Duration,
    /// The longest an upload waits for durability before it is answered 503 (and retried).
    pub durability_timeout: Duration,
    /// Which published round models are kept.
    pub retention: crate::store::Retention,
    /// Strikes in a row after which a client is quarantined (0: never; see [`super::strikes`]).
    pub quarantine_after: u32,
    /// The parent server of a regional aggregator (`--parent`): its regional tasks forward
    /// their rounds' partials there ([`crate::upstream`]).
    pub parent: Option<crate::upstream::ParentConfig>,
    /// Whether this replica leads or serves without leading (see [`super::replicas`]).
    pub role: super::Role,
    /// This replica's id, which its claims and partials carry in a store replicas share.
    pub replica: String,
    /// When an update (or a selection) is acknowledged.
    pub acknowledge: Acknowledge,
    /// Where secure aggregation's neighbour graphs come from: `None`, the operating system's
    /// generator (a server); `Some(seed)`, the seed mixed with each attempt's task, round and
    /// attempt, so that a run repeats (a simulated federation).
    pub graph_seed: Option<u64>,
}

/// When the engine acknowledges an update or a selection: the one seam through which a
/// simulation ([`crate::simulation`]) enters the round engine, chosen when it opens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Acknowledge {
    /// Once a checkpoint that holds it is durable (group commit, [`super::commit`]): a server.
    #[default]
    Durable,
    /// As soon as it is folded: an in-process store that nothing outlives, where there is
    /// nothing to wait for (a simulated federation).
    OnFold,
}

impl CoordinatorConfig {
    /// The longest a long poll may be held on a server whose connections idle out after
    /// `idle_timeout` and whose requests time out after `request_timeout`: `max_poll_wait`, but
    /// at most four fifths of either, so a poll is answered before any timeout of the server's
    /// (or of a proxy configured like it) can end it. Each answer reports the cap.
    pub fn poll_cap(
        max_poll_wait: Duration,
        idle_timeout: Duration,
        request_timeout: Duration,
    ) -> Duration {
        max_poll_wait
            .min(idle_timeout * 4 / 5)
            .min(request_timeout * 4 / 5)
    }
}

impl Default for CoordinatorConfig {
    fn default() -> Self {
        CoordinatorConfig {
            commit_window: Duration::from_millis(2),
            max_poll_wait: Duration::from_secs(30),
            durability_timeout: Duration::from_secs(60),
            retention: crate::store::Retention::default(),
            quarantine_after: 5,
            parent: None,
            role: super::Role::Leader,
            replica: "local".into(),
            acknowledge: Acknowledge::Durable,
            graph_seed: None,
        }
    }
}

/// Every task and its open round.
pub struct Coordinator {
    pub(crate) store: Arc<Store>,
    pub(crate) tasks: RwLock<HashMap<String, Arc<Task>>>,
    /// Tasks whose stored state could not be loaded, with the reason: they answer 503 while the
    /// other tasks serve.
    broken: RwLock<HashMap<String, String>>,
    pub(crate) config: CoordinatorConfig,
    /// The background work (the committer, the rounds' watchers), stopped by [`Coordinator::stop`].
    pub(crate) background: TaskTracker,
    pub(crate) stopping: CancellationToken,
    pub metrics: Arc<ServerMetrics>,
    /// Bumped whenever any task changes (every task's [`Task::bump`], a task created): what the
    /// dashboard's live feed waits on.
    pub(crate) changes: Arc<watch::Sender<u64>>,
    /// When each client was last seen and its accepted updates, since the start.
    pub clients_seen: super::seen::ClientsSeen,
    /// The parent of a regional aggregator.
    pub(crate) parent: Option<Arc<crate::upstream::Parent>>,
}

impl Coordinator {
    /// Loads every task and resumes open rounds from their last checkpoints.
    pub fn open(
        store: Arc<Store>,
        config: CoordinatorConfig,
        metrics: Arc<ServerMetrics>,
    ) -> Result<Arc<Self>, ServerError> {
        let parent = config
            .parent
            .clone()
            .map(|p| Arc::new(crate::upstream::Parent::new(p)));
        let coordinator = Arc::new(Coordinator {
            parent,
            store,
            tasks: RwLock::new(HashMap::new()),
            broken: RwLock::new(HashMap::new()),
            config,
            background: TaskTracker::new(),
            stopping: CancellationToken::new(),
            metrics,
            changes: Arc::new(watch::channel(0).0),
            clients_seen: Default::default(),
        });
        for (id, record) in coordinator.store.tasks_each()? {
            // One task's corrupt state must not keep the others from serving.
            let loaded = record.map_err(ServerError::from).and_then(|record| {
                let strategy = strategy::from_config(&record.config.strategy);
                // A damaged strategy state makes the task unavailable now, with the reason,
                // rather than failing every round close later.
                if let Some(name) = &record.strategy_state {
                    strategy::state::verify(
                        coordinator.store.blobs(),
                        name,
                        record.spec.numel(),
                        strategy.state_per_parameter(),
                    )?;
                }
                if record.config.differential_privacy.is_some() && record.dp.is_none() {
                    // Starting the count afresh would under-report ε: stop here instead.
                    return Err(ServerError::internal(
                        "the task has differential privacy but no privacy accounting state",
                    ));
                }
                let round = match coordinator.store.open_round(&id)? {
                    // (A follower's sum is its own, and starts empty.)
                    Some(open) if coordinator.follows() => {
                        Some(coordinator.follower_round(&record, open)?)
                    }
                    Some(open) => Some(coordinator.resume_round(&record, open)?),
                    None if coordinator.follows() => None,
                    // (A regional task's rounds are opened from its parent's.)
                    None if matches!(record.state, TaskState::Running | TaskState::Paused)
                        && record.published < record.config.rounds
                        && record.parent.is_none() =>
                    {
                        Some(coordinator.new_round(&id, &record, record.published + 1, 0)?)
                    }
                    None => None,
                };
                Ok((record, round, strategy))
            });
            let (record, round, strategy) = match loaded {
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
            let task = Arc::new(Task::new(
                id.clone(),
                record,
                round,
                strategy,
                coordinator.changes.clone(),
            ));
            coordinator
                .tasks
                .write()
                .expect("tasks lock")
                .insert(id, task);
        }
        Ok(coordinator)
    }

    /// Starts the background work: each task's group committer, its round's deadlines and its
    /// evaluation's.
    pub fn start(self: &Arc<Self>) {
        self.follow_store();
        for task in self.all_tasks() {
            self.commit_for(task.clone());
            if self.follows() {
                continue; // the leader decides
            }
            if let Some(e) = task.record().evaluating {
                self.watch_evaluation(task.clone(), e.round, e.deadline_unix_ms);
            }
            if let Some(round) = task.current() {
                let spans = self.store.shared();
                self.watch(task.clone(), round);
                if spans {
                    let (me, id) = (self.clone(), task.id.clone());
                    self.background.spawn(async move {
                        let caught = crate::blocking(move || me.catch_up(&id)).await;
                        if let Err(e) = caught {
                            tracing::warn!(error = %e, "reading what other replicas recorded of a resumed round failed; the round closes at its next full count or deadline");
                        }
                    });
                }
            }
            if task.record().parent.is_some() {
                self.follow_parent(task);
            }
        }
    }

    /// Stops the background work and waits for it to end (a close in progress finishes first).
    /// What is acknowledged is durable already; uploads still waiting are answered 503 and
    /// retried by their clients against the next start.
    pub async fn stop(&self) {
        self.stopping.cancel();
        self.background.close();
        self.background.wait().await;
    }

    pub(crate) fn resume_round(
        &self,
        record: &TaskRecord,
        open: OpenRoundRecord,
    ) -> Result<Arc<Round>, ServerError> {
        let mut secret = [0u8; 32];
        hex::decode_to_slice(&open.secret, &mut secret)
            .map_err(|_| ServerError::internal("corrupt round secret"))?;
        let collection = collection::resume(&*self.store, record, &open, self.sharing())?;
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
        let behind = Accumulator::behind(&contributions);
        let selected: std::collections::BTreeSet<String> = open.selected.into_iter().collect();
        let selected_durable = selected.len();
        let acc = Accumulator {
            merged: open.merged,
            sum,
            selected,
            selected_durable,
            contributions,
            behind,
            durable,
            checkpoint,
            noised,
            ..Accumulator::new(record.spec.clone())
        };
        Ok(Arc::new(Round {
            number: open.round,
            attempt: open.attempt,
            key: RoundSecretKey::from_bytes(secret),
            base: open.base_model,
            opened_unix_ms: open.opened_unix_ms,
            opened: Instant::now(),
            resumed: true,
            deadline_unix_ms: open.deadline_unix_ms.into(),
            roster: Mutex::new(Roster::of(&acc)),
            acc: Mutex::new(acc),
            durability: watch::channel(Durability::Upto(durable)).0,
            storage_trouble: watch::channel(None).0,
            selection: watch::channel(SelectionDurability::Upto(selected_durable)).0,
            collection,
            wake: Notify::new(),
        }))
    }

    /// A fresh round (or a retry of an abandoned one), persisted before anyone sees it.
    pub(crate) fn new_round(
        &self,
        task_id: &str,
        record: &TaskRecord,
        number: u64,
        attempt: u32,
    ) -> Result<Arc<Round>, ServerError> {
        let round = self.fresh_round(record, number, attempt, None)?;
        self.store
            .put_open_round(task_id, &round.record(&lock(&round.acc)))?;
        round.collection.persist_new(&*self.store)?;
        self.store.flush()?;
        Ok(round)
    }

    /// A new attempt of round `number`, not yet stored; `previous` is the attempt it follows.
    pub(crate) fn fresh_round(
        &self,
        record: &TaskRecord,
        number: u64,
        attempt: u32,
        previous: Option<&Arc<dyn Collection>>,
    ) -> Result<Arc<Round>, ServerError> {
        let now = now_ms();
        let (collection, deadline) = collection::for_new_attempt(
            record,
            number,
            attempt,
            now,
            previous,
            self.sharing(),
            self.config.graph_seed,
        )?;
        // A retried attempt may keep the key its clients sealed their updates to.
        let key = match collection.attempt_key(number) {
            Some(key) => key,
            None => RoundSecretKey::generate().map_err(ServerError::internal)?,
        };
        Ok(Arc::new(Round {
            number,
            attempt,
            key,
            base: record.global_model,
            opened_unix_ms: now,
            opened: Instant::now(),
            resumed: false,
            deadline_unix_ms: deadline.into(),
            acc: Mutex::new(Accumulator::new(record.spec.clone())),
            roster: Mutex::default(),
            durability: watch::channel(Durability::Upto(0)).0,
            storage_trouble: watch::channel(None).0,
            selection: watch::channel(SelectionDurability::Upto(0)).0,
            collection,
            wake: Notify::new(),
        }))
    }

    /// Changes whenever any task changes.
    pub fn watch_changes(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }

    pub fn task(&self, id: &str) -> Result<Arc<Task>, ServerError> {
        if let Some(task) = self.tasks.read().expect("tasks lock").get(id) {
            return Ok(task.clone());
        }
        if self.broken.read().expect("broken lock").contains_key(id) {
            return Err(ServerError::unavailable(
                ErrorCode::TaskUnavailable,
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

    // -- clients ----------------------------------------------------------------------------

    fn retry_after(&self, task: &Task) -> u64 {
        match task.current() {
            Some(round) => round.collection.retry_after_ms(&round),
            None => jitter(5_000),
        }
    }

    /// The task's state for `client`; waits up to `wait` (at most the poll cap) for a round later
    /// than `after`, or, with `attempt`, for a later attempt of round `after` too: the retry of
    /// an abandoned attempt wants the updates of the attempt it replaces again.
    pub async fn poll(
        &self,
        task: Arc<Task>,
        client: &str,
        (after, attempt): (Option<u64>, Option<u32>),
        evaluated: Option<u64>,
        wait: Duration,
    ) -> wire::PollResponse {
        let mut changed = task.changed.subscribe();
        let deadline = tokio::time::Instant::now() + wait.min(self.config.max_poll_wait);
        let later = |r: &Round| match after {
            None => true,
            Some(a) => r.number > a || (r.number == a && attempt.is_some_and(|x| r.attempt > x)),
        };
        loop {
            let state = task.state();
            let round = task.current();
            let evaluation = self.evaluation_offer(&task, client);
            let evaluate = evaluation
                .as_ref()
                .is_some_and(|e| evaluated.is_some_and(|done| e.round > done));
            let ready = evaluate
                || match state {
                    TaskState::Running => round.as_deref().is_some_and(later),
                    // A paused task holds the poll until it is resumed (or the wait is over), so a
                    // resumed task has its clients back at once.
                    TaskState::Paused => false,
                    TaskState::Stopped | TaskState::Finished => true,
                };
            if ready || tokio::time::Instant::now() >= deadline {
                let (selected, contributed) = round
                    .as_ref()
                    .map(|r| r.collection.standing(r, client))
                    .unwrap_or((false, false));
                return wire::PollResponse {
                    task: task.id.clone(),
                    state,
                    open_round: round.as_ref().map(|r| r.number),
                    attempt: round.map(|r| r.attempt),
                    selected,
                    contributed,
                    max_wait_ms: self.config.max_poll_wait.as_millis() as u64,
                    evaluation,
                    retry_after_ms: match state {
                        // The poll has waited already: come straight back.
                        TaskState::Paused => rand::rng().random_range(100..=1_000),
                        _ => self.retry_after(&task),
                    },
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

    /// Selects `client` for the open round if there is room, and answers once the selection is
    /// durable: a selected client's upload is never refused as `not_selected` after a crash.
    pub async fn join(
        self: &Arc<Self>,
        task: &Arc<Task>,
        client: &str,
    ) -> Result<wire::JoinResponse, ServerError> {
        let (me, t, c) = (self.clone(), task.clone(), client.to_string());
        // Selection takes the round's lock (and may read the store): on a blocking thread.
        let waiting = task.lock_waiter().await;
        let joined = crate::blocking(move || {
            let _waiting = waiting;
            me.select(&t, &c)
        })
        .await?;
        let (round, upto, answer) = match joined {
            Joined::Wait => {
                return Ok(wire::JoinResponse {
                    offer: None,
                    retry_after_ms: self.retry_after(task),
                })
            }
            Joined::Selected {
                round,
                upto,
                answer,
            } => (round, upto, answer),
        };
        let mut selection = round.selection.subscribe();
        let durable = |s: &SelectionDurability| match s {
            SelectionDurability::Upto(n) => *n >= upto,
            SelectionDurability::Closed => true,
        };
        if !durable(&selection.borrow()) {
            task.commit_wanted.notify_one();
        }
        let waited = tokio::time::timeout(
            self.config.durability_timeout,
            selection.wait_for(durable),
        )
        .await
        .map_err(|_| {
            ServerError::unavailable(
                ErrorCode::NotDurableYet,
                format!(
                    "the selection for round {} is not durable after {} s (storage is slow); join again",
                    round.number,
                    self.config.durability_timeout.as_secs()
                ),
            )
        })?
        .map(|s| s.clone())
        // The round (held here) owns the sender: it cannot be gone.
        .map_err(ServerError::internal)?;
        match waited {
            SelectionDurability::Upto(_) => Ok(*answer),
            // The attempt closed before the selection was recorded: nothing to train for.
            SelectionDurability::Closed => Ok(wire::JoinResponse {
                offer: None,
                retry_after_ms: self.retry_after(task),
            }),
        }
    }

    /// The selection itself (blocking): the round's mode decides.
    fn select(&self, task: &Task, client: &str) -> Result<Joined, ServerError> {
        let record = task.record();
        match record.state {
            TaskState::Running => {}
            TaskState::Paused => return Ok(Joined::Wait),
            s => {
                return Err(ServerError::conflict(
                    ErrorCode::TaskEnded,
                    format!("task `{}` is {}", task.id, format!("{s:?}").to_lowercase()),
                ))
            }
        }
        let Some(round) = task.current() else {
            return Ok(Joined::Wait);
        };
        round.collection.select(self, task, &record, &round, client)
    }
}
