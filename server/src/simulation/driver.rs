//! The simulation's driver: the field around the engine — who is online, who joins, whose
//! update arrives when — on a simulated clock. See the [module](super) for the picture.

use std::collections::{BinaryHeap, HashMap, HashSet, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hora_common::model::{Model, ModelDigest, ModelSpec};
use hora_common::simulation::{self, client_seed, Job, Mean, Reply, TrainJob};
use hora_common::wire::{self, ErrorCode, RoundOutcome, TaskState, UpdateMeta};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha12Rng;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use super::checkpoint::{self, Saved};
use super::history::Row;
use super::workers::{Answer, Pool};
use super::{Simulation, SimulationError};
use crate::error::ServerError;
use crate::metrics::ServerMetrics;
use crate::round::{Acknowledge, Coordinator, CoordinatorConfig, Round, Task, UpdateBody};
use crate::store::{MemoryStore, Store};

/// The engine's deadline for every round: the simulated clock, not the engine's, ends rounds
/// (a week, the longest a task may set).
const ENGINE_DEADLINE_SECS: u64 = 604_800;

mod federated;
mod secure;

/// The engine's time for every secure-aggregation stage (a day, the longest a task may set).
const ENGINE_STAGE_SECS: u64 = 86_400;

/// Domain tags of the seeds the driver draws with, apart from the workers' streams.
const SAMPLING: u64 = 0x5A3D_0001;
const DROPOUTS: u64 = 0x5A3D_0002;
const STARTS: u64 = 0x5A3D_0003;
const EVALUATION: u64 = 0x5A3D_0004;

/// Clients a worker evaluates at once (not a function of the workers: the same sums whatever
/// their number).
const EVALUATION_CHUNK: usize = 25;

/// How long the driver waits for the engine to move a round on before it gives up.
const ENGINE_WAIT: Duration = Duration::from_secs(600);

/// What a simulation ends with.
#[derive(Debug)]
pub struct Outcome {
    /// One row per round attempt (asynchronous: per version).
    pub history: Vec<Row>,
    /// The task's last published model (whole: with its frozen base, for a task that trains
    /// part of its model).
    pub model: Model,
    pub wall_seconds: f64,
    /// Updates the engine took.
    pub updates: u64,
    /// The engine's history of the task: every attempt's participants, dropouts, examples.
    pub records: Vec<wire::RoundRecord>,
}

/// Runs `sim` to the end of its task, calling `on_row` as each round closes.
pub async fn run(
    sim: &Simulation,
    on_row: &mut (dyn FnMut(&Row) + Send),
) -> Result<Outcome, SimulationError> {
    run_until(sim, on_row, CancellationToken::new()).await
}

/// [`run`], stopped (the engine stopped, the workers killed) with
/// [`SimulationError::Cancelled`] once `cancel` is cancelled.
pub async fn run_until(
    sim: &Simulation,
    on_row: &mut (dyn FnMut(&Row) + Send),
    cancel: CancellationToken,
) -> Result<Outcome, SimulationError> {
    let started = Instant::now();
    let made = |what: &Path, e: std::io::Error| {
        SimulationError::Setup(format!("making {}: {e}", what.display()))
    };
    if sim.clients == 0 {
        return Err(SimulationError::Setup(
            "a federation needs at least one client (--clients)".into(),
        ));
    }
    // Where the workers find the models and the clients keep their state: a scratch folder,
    // or the checkpoint folder's `live` (made anew: the checkpoint holds what carries over).
    let scratch = match &sim.checkpoint {
        Some(_) => None,
        None => Some(
            tempfile::Builder::new()
                .prefix("hora-simulation-")
                .tempdir()
                .map_err(|e| made(&std::env::temp_dir(), e))?,
        ),
    };
    let work = match (&sim.checkpoint, &scratch) {
        (Some(dir), _) => dir.join("live"),
        (None, Some(scratch)) => scratch.path().to_path_buf(),
        (None, None) => unreachable!("a scratch folder is made where there is no checkpoint"),
    };
    let setup = simulation::Setup {
        protocol: simulation::PROTOCOL,
        data: sim.data.clone(),
        partition: sim.partition.clone(),
        clients: sim.clients,
        seed: sim.seed,
        models_dir: work.join("models"),
        state_dir: work.join("clients"),
        threads: 1,
    };
    let (checkpoint, fingerprint) = (sim.checkpoint.clone(), checkpoint::fingerprint(sim));
    let (models, clients) = (setup.models_dir.clone(), setup.state_dir.clone());
    let live = work.clone();
    let resumed = off_runtime(move || {
        if let Some(dir) = &checkpoint {
            checkpoint::claim(dir)?;
            if work.exists() {
                std::fs::remove_dir_all(&work).map_err(|e| made(&work, e))?;
            }
        }
        for d in [&models, &clients] {
            std::fs::create_dir_all(d).map_err(|e| made(d, e))?;
        }
        let Some(dir) = checkpoint else {
            return Ok(None);
        };
        let found = checkpoint::find(&dir, &fingerprint, &work)?;
        if found.is_some() {
            checkpoint::restore_clients(&dir, &clients)?;
        }
        Ok(found)
    })
    .await?;
    let pool =
        Pool::start(&sim.worker_command, sim.workers, &setup).map_err(SimulationError::Workers)?;
    // (The engine's store lives beside the workers' files: a checkpoint links its blobs.)
    let store_dir = sim.checkpoint.as_ref().map(|_| live);
    let mut field = Field::open(sim, pool, &setup, started, resumed, store_dir).await?;
    let outcome = tokio::select! {
        outcome = field.run(on_row) => outcome,
        () = cancel.cancelled() => Err(SimulationError::Cancelled),
    };
    field.coordinator.stop().await;
    drop(scratch);
    outcome
}

/// A client in flight: when its update arrives (simulated), and the worker's answer.
struct Arrival {
    at_s: f64,
    client: u64,
    /// The round (version) it trains for.
    round: u64,
    answer: oneshot::Receiver<Answer>,
}

impl PartialEq for Arrival {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other).is_eq()
    }
}
impl Eq for Arrival {}
impl PartialOrd for Arrival {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Arrival {
    /// The earliest first (a max-heap of the reverse), ties by client id.
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        other
            .at_s
            .total_cmp(&self.at_s)
            .then(other.client.cmp(&self.client))
    }
}

/// A client the engine selected for a synchronous attempt.
struct Selected {
    client: u64,
    examples: u64,
    offer: wire::RoundOffer,
    /// Simulated seconds from the attempt's start until its update would arrive.
    took_s: f64,
    /// Whether it drops out of the attempt (the profile's draw).
    drops_out: bool,
}

/// What the round's clients sent, for its row.
#[derive(Default)]
struct Traffic {
    taken: u64,
    bytes_up: u64,
    bytes_down: u64,
    /// Clients that sent nothing the engine took, beyond those it counts itself.
    lost: u64,
}

/// The federation around the engine.
struct Field<'s> {
    sim: &'s Simulation,
    pool: Pool,
    coordinator: Arc<Coordinator>,
    store: Arc<Store>,
    /// The same store, as itself: what a checkpoint saves.
    memory: Arc<MemoryStore>,
    /// The clients' state folder (a checkpoint links its files).
    clients_dir: PathBuf,
    task: Arc<Task>,
    /// The simulated deadline of a round (an asynchronous slot's, unused).
    deadline_s: f64,
    spec: ModelSpec,
    models_dir: PathBuf,
    written: HashSet<ModelDigest>,
    /// Each client's training examples, once known (O(clients) numbers, never data).
    sizes: HashMap<u64, u64>,
    evaluation_clients: Vec<u64>,
    clock_s: f64,
    started: Instant,
    rows: Vec<Row>,
    updates: u64,
    /// Trainings that failed in a row (the trainer raised; not a worker that died).
    failing: u64,
}

impl<'s> Field<'s> {
    /// The engine over an in-process store, and the task created in it (or, resuming, the
    /// checkpoint's store, whose task the engine recovers as after a restart).
    async fn open(
        sim: &'s Simulation,
        pool: Pool,
        setup: &simulation::Setup,
        started: Instant,
        resumed: Option<(MemoryStore, Saved)>,
        store_dir: Option<PathBuf>,
    ) -> Result<Field<'s>, SimulationError> {
        let mut json = sim.task.clone();
        let object = json
            .as_object_mut()
            .ok_or_else(|| SimulationError::Setup("the task must be a JSON object".into()))?;
        let deadline_s = object
            .get("round_deadline_secs")
            .and_then(|v| v.as_f64())
            .filter(|d| *d > 0.0)
            .ok_or_else(|| {
                SimulationError::Setup(
                    "the task needs round_deadline_secs (simulated seconds, above 0)".into(),
                )
            })?;
        object.insert("round_deadline_secs".into(), ENGINE_DEADLINE_SECS.into());
        // Stages close when their clients are in, or as the simulated clock says: never by the
        // engine's clock.
        if let Some(secure) = object
            .get_mut("secure_aggregation")
            .and_then(|v| v.as_object_mut())
        {
            secure.insert("stage_secs".into(), ENGINE_STAGE_SECS.into());
        }
        // The same for an evaluation's deadline: the driver ends it.
        if let Some(deadline) = object
            .get_mut("evaluation")
            .and_then(|v| v.as_object_mut())
            .and_then(|e| e.get_mut("deadline_secs"))
            .filter(|d| !d.is_null())
        {
            *deadline = ENGINE_DEADLINE_SECS.into();
        }
        // Refused before anything starts.
        let set = |key: &str| object.get(key).is_some_and(|v| !v.is_null());
        if set("asynchronous") && sim.checkpoint.is_some() {
            return Err(SimulationError::Setup(
                "checkpoints are kept for synchronous tasks only in this release: simulate this asynchronous (FedBuff) task without a checkpoint folder".into(),
            ));
        }
        let id = object
            .get("id")
            .and_then(|v| v.as_str())
            .ok_or_else(|| SimulationError::Setup("the task needs an id".into()))?
            .to_string();
        let (memory, saved) = match resumed {
            Some((store, saved)) => (Arc::new(store), Some(saved)),
            None => {
                let initial = Self::initial(sim, &pool, object).await?;
                let memory = off_runtime(move || {
                    let store = Arc::new(match &store_dir {
                        Some(dir) => MemoryStore::new_in(dir)?,
                        None => MemoryStore::new()?,
                    });
                    let digest = (store.clone() as Arc<Store>).put_model(&initial)?;
                    Ok((store, digest))
                })
                .await;
                let (memory, digest) = memory?;
                object.insert(
                    "initial_model".into(),
                    serde_json::to_value(digest).unwrap_or_default(),
                );
                (memory, None)
            }
        };
        let store: Arc<Store> = memory.clone();
        let engine = CoordinatorConfig {
            commit_window: Duration::ZERO,
            acknowledge: Acknowledge::OnFold,
            durability_timeout: ENGINE_WAIT,
            graph_seed: Some(sim.seed),
            ..CoordinatorConfig::default()
        };
        let coordinator =
            Coordinator::open(store.clone(), engine, Arc::new(ServerMetrics::default()))?;
        coordinator.start();
        if saved.is_none() {
            let config: wire::CreateTask = serde_json::from_value(json)
                .map_err(|e| SimulationError::Setup(format!("the task: {e}")))?;
            let creating = coordinator.clone();
            off_runtime(move || Ok(creating.create_task(config)?)).await?;
        }
        let task = coordinator.task(&id)?;
        let spec = task.spec();
        let mut rng = ChaCha12Rng::seed_from_u64(client_seed(sim.seed ^ EVALUATION, 0, 0));
        let mut evaluation_clients: Vec<u64> = (0..sim.clients).collect();
        evaluation_clients.shuffle(&mut rng);
        evaluation_clients.truncate(sim.evaluate_clients.min(sim.clients) as usize);
        evaluation_clients.sort_unstable();
        let mut field = Field {
            sim,
            pool,
            coordinator,
            store,
            memory,
            clients_dir: setup.state_dir.clone(),
            task,
            deadline_s,
            spec,
            models_dir: setup.models_dir.clone(),
            written: HashSet::new(),
            sizes: HashMap::new(),
            evaluation_clients,
            clock_s: 0.0,
            started,
            rows: Vec::new(),
            updates: 0,
            failing: 0,
        };
        if let Some(saved) = saved {
            tracing::info!(
                rounds = saved.rows.len(),
                sim_time_s = saved.clock_s,
                "resuming the simulation from its checkpoint"
            );
            field.clock_s = saved.clock_s;
            field.started = started
                .checked_sub(Duration::from_secs_f64(saved.wall_s.max(0.0)))
                .unwrap_or(started);
            field.rows = saved.rows;
            field.updates = saved.updates;
            field.failing = saved.failing;
        }
        Ok(field)
    }

    /// The initial model: the simulation's, else the built-in model's made from the seed.
    async fn initial(
        sim: &Simulation,
        pool: &Pool,
        task: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<Model, SimulationError> {
        if let Some(initial) = &sim.initial {
            return Ok(initial.clone());
        }
        if task.contains_key("initial_model") {
            return Err(SimulationError::Setup(
                "the task names an initial_model, which a simulation cannot fetch: leave it out (the built-in model's initial weights are made from the seed) or give the weights (--initial FILE)".into(),
            ));
        }
        let kind = task.get("model").cloned().unwrap_or_default();
        let model_kind = serde_json::from_value(kind).map_err(|e| {
            SimulationError::Setup(format!("the task's `model` is not a model kind: {e}"))
        })?;
        let job = Job::Initial {
            model_kind,
            seed: sim.seed,
        };
        let (_, bytes) = answer(pool.run(job).await)?;
        Model::from_safetensors(&bytes, &Default::default())
            .map_err(|e| SimulationError::Workers(format!("the initial model: {e}")))
    }

    /// Writes the checkpoint of this moment, between rounds (with `--checkpoint`).
    async fn checkpoint(&self) -> Result<(), SimulationError> {
        let Some(dir) = self.sim.checkpoint.clone() else {
            return Ok(());
        };
        let saved = Saved {
            fingerprint: checkpoint::fingerprint(self.sim),
            clock_s: self.clock_s,
            wall_s: self.started.elapsed().as_secs_f64(),
            rows: self.rows.clone(),
            updates: self.updates,
            failing: self.failing,
        };
        let (memory, clients) = (self.memory.clone(), self.clients_dir.clone());
        off_runtime(move || checkpoint::write(&dir, &memory, &clients, &saved)).await
    }

    async fn run(
        &mut self,
        on_row: &mut (dyn FnMut(&Row) + Send),
    ) -> Result<Outcome, SimulationError> {
        let asynchronous = self.task.record().config.asynchronous.is_some();
        match asynchronous {
            true => self.versions(on_row).await?,
            false => {
                let secure = self.task.record().config.secure_aggregation.is_some();
                while let Some(round) = self.open_round() {
                    match secure {
                        true => self.secure_round(round, on_row).await?,
                        false => self.round(round, on_row).await?,
                    }
                    self.checkpoint().await?;
                }
            }
        }
        // (The whole model, for a task that trains part of it.)
        let (store, digest, base) = (
            self.store.clone(),
            self.task.global_model(),
            self.frozen_base(),
        );
        let model = off_runtime(move || {
            let part = store.read_model(&digest)?;
            match base {
                None => Ok(part),
                Some(base) => Model::merge(&store.read_model(&base)?, &part).map_err(|e| {
                    SimulationError::Setup(format!("the published part and its base: {e}"))
                }),
            }
        })
        .await?;
        Ok(Outcome {
            records: self.history().await?,
            history: std::mem::take(&mut self.rows),
            model,
            wall_seconds: self.started.elapsed().as_secs_f64(),
            updates: self.updates,
        })
    }

    /// The task's open round, while it runs.
    fn open_round(&self) -> Option<Arc<Round>> {
        match self.task.state() {
            TaskState::Running => self.task.current(),
            _ => None,
        }
    }

    /// One synchronous round attempt: select, plan arrivals, train and fold the updates the
    /// engine takes, close at the simulated deadline if it is not full before.
    async fn round(
        &mut self,
        round: Arc<Round>,
        on_row: &mut (dyn FnMut(&Row) + Send),
    ) -> Result<(), SimulationError> {
        let config = self.task.record().config;
        let (number, attempt) = (round.number, round.attempt);
        let candidates = self.candidates(&round).await?;
        let mut traffic = Traffic::default();
        let mut arrivals = Vec::new();
        for s in self.select(&round, candidates, &mut traffic).await? {
            if !s.drops_out && s.took_s <= self.deadline_s {
                arrivals.push((s.took_s, s.client, s.offer));
            }
        }
        arrivals.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        self.prepare(round.base).await?;
        // In order of arrival until the round is full: a client whose update is lost (its
        // worker failed, the engine refused it) makes room for the next to arrive. No more
        // clients train than the round can still take (a trained client's state, its error
        // feedback, has moved on).
        let target = u64::from(config.target_clients);
        let window = 2 * self.sim.workers.max(1) as u64;
        let (mut flying, mut planned) = (VecDeque::new(), arrivals.into_iter());
        let mut took = self.deadline_s;
        loop {
            while (flying.len() as u64) < window.min(target.saturating_sub(traffic.taken)) {
                let Some((at, client, offer)) = planned.next() else {
                    break;
                };
                flying.push_back((at, client, self.train(client, &offer)));
            }
            let Some((at, client, answer)) = flying.pop_front() else {
                break;
            };
            if self.deliver(client, number, answer, &mut traffic).await? && traffic.taken >= target
            {
                took = at; // full: the engine closes it
                break;
            }
        }
        if traffic.taken < target {
            self.coordinator.expire_round(&self.task, &round);
        }
        self.attempt_ended(number, attempt, took, traffic, on_row)
            .await
    }

    /// Once a synchronous attempt that took `took` simulated seconds is over in the field:
    /// waits for the engine to close it, moves the clock on, and records its row.
    async fn attempt_ended(
        &mut self,
        number: u64,
        attempt: u32,
        took: f64,
        mut traffic: Traffic,
        on_row: &mut (dyn FnMut(&Row) + Send),
    ) -> Result<(), SimulationError> {
        // (The engine counts every selected client that sent nothing it took as dropped.)
        traffic.lost = 0;
        self.moved_on(number, attempt).await?;
        self.clock_s += took;
        self.record(number, attempt, traffic, on_row).await
    }

    /// An asynchronous task: clients start whenever a training slot is free and arrive in
    /// order of finishing; a version closes every `buffer_size` updates.
    async fn versions(
        &mut self,
        on_row: &mut (dyn FnMut(&Row) + Send),
    ) -> Result<(), SimulationError> {
        let config = self.task.record().config;
        let (concurrency, buffer) = config.asynchronous.as_ref().map_or((1, 1), |a| {
            (a.concurrency.max(1) as usize, u64::from(a.buffer_size))
        });
        let mut rng = ChaCha12Rng::seed_from_u64(client_seed(self.sim.seed ^ STARTS, 0, 0));
        let mut flying: BinaryHeap<Arrival> = BinaryHeap::new();
        // Clients training now, and those whose update the open version holds (the engine
        // takes one update a client a version).
        let (mut busy, mut in_version) = (HashSet::new(), HashSet::new());
        let mut traffic = Traffic::default();
        // Clients started so far: what each start's dropout is drawn with.
        let mut starts: u64 = 0;
        // Simulated quarters of an hour waited in a row for a client to come online.
        let mut idle = 0u32;
        while let Some(round) = self.open_round() {
            let version = round.number;
            // Fill the free slots with clients online now (their sizes asked in one go).
            let mut excluded: HashSet<u64> = busy.union(&in_version).copied().collect();
            let mut picks = Vec::new();
            while flying.len() + picks.len() < concurrency {
                let Some(client) = self.pick(&mut rng, &excluded) else {
                    break;
                };
                excluded.insert(client);
                picks.push(client);
            }
            let sizes = self.sizes(&picks).await?;
            for (client, examples) in picks.into_iter().zip(sizes) {
                let device = self.sim.profile.device(self.sim.seed, client);
                starts += 1;
                let samples = examples.saturating_mul(config.training.epochs.into());
                let took = device.round_seconds(self.model_bytes(), samples, self.update_bytes());
                // A client that drops out, has nothing to train on, or would hold its training
                // slot past the deadline (the engine gives the slot to another) sends nothing.
                if self.drops_out(client, starts, device.dropout)
                    || examples == 0
                    || took > self.deadline_s
                {
                    traffic.lost += 1;
                    continue;
                }
                let Some(offer) = self.join(client).await? else {
                    break; // the engine holds the others back
                };
                self.prepare(offer.model).await?;
                traffic.bytes_down += self.model_bytes();
                busy.insert(client);
                flying.push(Arrival {
                    at_s: self.clock_s + took,
                    client,
                    round: offer.round,
                    answer: self.train(client, &offer),
                });
            }
            let Some(next) = flying.pop() else {
                // Nobody online: the clock moves on a quarter of an hour, for a week at most.
                idle += 1;
                if idle > 4 * 24 * 7 {
                    return Err(SimulationError::Setup(format!(
                        "no client came online to train version {version} in a simulated week: the federation is too small for its availability profile"
                    )));
                }
                self.clock_s += 900.0;
                continue;
            };
            idle = 0;
            busy.remove(&next.client);
            self.clock_s = self.clock_s.max(next.at_s);
            if self
                .deliver(next.client, next.round, next.answer, &mut traffic)
                .await?
            {
                in_version.insert(next.client);
            }
            let full =
                self.open_round().map(|r| r.number) != Some(version) || traffic.taken >= buffer;
            if full {
                self.moved_on(version, round.attempt).await?;
                let traffic = std::mem::take(&mut traffic);
                in_version.clear();
                self.record(version, round.attempt, traffic, on_row).await?;
            }
        }
        Ok(())
    }

    /// The clients online for attempt `round` (drawn from the seed, the round and the attempt),
    /// as many as it selects, with their training examples.
    async fn candidates(&mut self, round: &Round) -> Result<Vec<(u64, u64)>, SimulationError> {
        let capacity = crate::round::capacity(&self.task.record().config);
        let sampling = client_seed(self.sim.seed ^ SAMPLING, round.number, round.attempt.into());
        let clients = self.online(capacity, sampling);
        let sizes = self.sizes(&clients).await?;
        Ok(clients.into_iter().zip(sizes).collect())
    }

    /// Joins `candidates` to attempt `round` through the engine: those it selects, each with
    /// its download counted, its dropout drawn and its update's arrival worked out.
    async fn select(
        &mut self,
        round: &Round,
        candidates: Vec<(u64, u64)>,
        traffic: &mut Traffic,
    ) -> Result<Vec<Selected>, SimulationError> {
        let epochs = u64::from(self.task.record().config.training.epochs);
        let nonce = round.number << 16 | u64::from(round.attempt);
        let mut selected = Vec::with_capacity(candidates.len());
        for (client, examples) in candidates {
            let Some(offer) = self.join(client).await? else {
                continue;
            };
            traffic.bytes_down += self.model_bytes();
            let device = self.sim.profile.device(self.sim.seed, client);
            let samples = examples.saturating_mul(epochs);
            selected.push(Selected {
                client,
                examples,
                offer,
                took_s: device.round_seconds(self.model_bytes(), samples, self.update_bytes()),
                drops_out: self.drops_out(client, nonce, device.dropout),
            });
        }
        Ok(selected)
    }

    /// Up to `n` distinct clients online at the simulated time, drawn with `seed`.
    fn online(&self, n: usize, seed: u64) -> Vec<u64> {
        let mut rng = ChaCha12Rng::seed_from_u64(seed);
        let mut picked = Vec::with_capacity(n);
        let mut seen = HashSet::new();
        let n = n.min(self.sim.clients as usize);
        // Draws with rejection: at most 20 tries a place, so an offline fleet cannot spin.
        for _ in 0..n.saturating_mul(20) {
            if picked.len() == n {
                break;
            }
            let client = rng.random_range(0..self.sim.clients);
            if !seen.insert(client) {
                continue;
            }
            if self
                .sim
                .profile
                .device(self.sim.seed, client)
                .online_at(self.clock_s)
            {
                picked.push(client);
            }
        }
        picked
    }

    /// A client online now and not `excluded`.
    fn pick(&self, rng: &mut ChaCha12Rng, excluded: &HashSet<u64>) -> Option<u64> {
        (0..64).find_map(|_| {
            let client = rng.random_range(0..self.sim.clients);
            let device = self.sim.profile.device(self.sim.seed, client);
            (!excluded.contains(&client) && device.online_at(self.clock_s)).then_some(client)
        })
    }

    /// Whether `client` drops out of what it started, `nonce` telling its starts apart.
    fn drops_out(&self, client: u64, nonce: u64, chance: f64) -> bool {
        let seed = client_seed(self.sim.seed ^ DROPOUTS, client, nonce);
        chance > 0.0 && ChaCha12Rng::seed_from_u64(seed).random::<f64>() < chance
    }

    fn model_bytes(&self) -> u64 {
        self.spec.numel() as u64 * 4
    }

    /// What an update weighs on the wire, before it is made (the encoding's bound).
    fn update_bytes(&self) -> u64 {
        let compression = self.task.record().config.compression;
        compression.map_or(self.model_bytes(), |c| c.limits(&self.spec).max_bytes)
    }

    /// Training examples of each of `clients`, asking the workers for those not known yet.
    async fn sizes(&mut self, clients: &[u64]) -> Result<Vec<u64>, SimulationError> {
        let unknown: Vec<u64> = clients
            .iter()
            .copied()
            .filter(|c| !self.sizes.contains_key(c))
            .collect();
        let per = unknown.len().div_ceil(self.sim.workers.max(1)).max(1);
        let asked: Vec<_> = unknown
            .chunks(per)
            .map(|chunk| {
                let job = Job::Sizes {
                    clients: chunk.to_vec(),
                };
                (chunk.to_vec(), self.pool.submit(job.clone()), job)
            })
            .collect();
        for (chunk, rx, job) in asked {
            match self.settle(job, rx).await?.0 {
                Reply::Sizes { examples } if examples.len() == chunk.len() => {
                    self.sizes.extend(chunk.into_iter().zip(examples));
                }
                other => return Err(unexpected(other)),
            }
        }
        Ok(clients.iter().map(|c| self.sizes[c]).collect())
    }

    /// The answer to `job` (queued as `rx`), asked again of the other workers while the one
    /// that took it died. (A client's training is not asked again: its worker's death is that
    /// client's dropout.)
    async fn settle(&self, job: Job, rx: oneshot::Receiver<Answer>) -> Answer {
        let mut answer = rx
            .await
            .unwrap_or_else(|_| Err("a worker went away".into()));
        for _ in 0..self.sim.workers {
            if answer.is_ok() {
                break;
            }
            answer = self.pool.run(job.clone()).await;
        }
        answer
    }

    async fn join(&self, client: u64) -> Result<Option<wire::RoundOffer>, SimulationError> {
        let joined = self.coordinator.join(&self.task, &client_id(client)).await;
        match joined {
            Ok(joined) => Ok(joined.offer),
            Err(e) if e.code() == ErrorCode::TaskEnded => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Writes the model the workers train from, once.
    /// (With the task's frozen base, for a task that trains part of its model.)
    async fn prepare(&mut self, digest: ModelDigest) -> Result<(), SimulationError> {
        for digest in [Some(digest), self.frozen_base()].into_iter().flatten() {
            if self.written.contains(&digest) {
                continue;
            }
            let store = self.store.clone();
            let path = self.models_dir.join(format!("{digest}.safetensors"));
            off_runtime(move || {
                let model = store.read_model(&digest)?;
                model
                    .write_file(&path)
                    .map_err(|e| SimulationError::Setup(format!("writing {}: {e}", path.display())))
            })
            .await?;
            self.written.insert(digest);
        }
        Ok(())
    }

    /// The frozen base of a task that trains part of its model.
    fn frozen_base(&self) -> Option<ModelDigest> {
        self.task.record().part.map(|p| p.base)
    }

    /// The engine's history of the task (read off the runtime: it is the store's).
    async fn history(&self) -> Result<Vec<wire::RoundRecord>, SimulationError> {
        let (coordinator, task) = (self.coordinator.clone(), self.task.clone());
        off_runtime(move || Ok(coordinator.history(&task)?)).await
    }

    fn train(&self, client: u64, offer: &wire::RoundOffer) -> oneshot::Receiver<Answer> {
        self.pool.submit(Job::Train(TrainJob {
            client,
            round: offer.round,
            model: offer.model,
            model_kind: offer.model_kind.clone(),
            training: offer.training.clone(),
            compression: offer.compression.clone(),
            frozen_base: offer.frozen_base,
        }))
    }

    /// Uploads `client`'s trained update for `round` to the engine, as a deployed client would
    /// after sealing (here the plaintext goes in as it is).
    async fn deliver(
        &mut self,
        client: u64,
        round: u64,
        answer: oneshot::Receiver<Answer>,
        traffic: &mut Traffic,
    ) -> Result<bool, SimulationError> {
        let Some((num_examples, metrics, payload)) =
            self.trained(client, round, answer, traffic).await?
        else {
            return Ok(false);
        };
        let bytes = payload.len() as u64;
        let meta = UpdateMeta {
            num_examples,
            metrics,
            contributors: None,
        };
        let body = UpdateBody::Opened(Box::new(payload));
        let uploaded = self
            .coordinator
            .upload(self.task.clone(), client_id(client), round, meta, body, ())
            .await;
        match uploaded {
            Ok(_) => {
                self.failing = 0;
                traffic.taken += 1;
                traffic.bytes_up += bytes;
                self.updates += 1;
                return Ok(true);
            }
            // Refused as a deployed client's update would be (too stale, the round closed):
            // the engine's answer stands.
            Err(e) if refused(&e) => {
                tracing::debug!(client, round, error = %e, "the engine refused a virtual client's update");
                traffic.lost += 1;
            }
            Err(e) => return Err(e.into()),
        }
        Ok(false)
    }

    /// What `client`'s training for `round` made (examples, metrics, the encoded update), or
    /// None if it failed (the client counts as dropped out). Trainings that fail for client
    /// after client, or workers that have all exited, stop the run.
    async fn trained(
        &mut self,
        client: u64,
        round: u64,
        answer: oneshot::Receiver<Answer>,
        traffic: &mut Traffic,
    ) -> Result<Option<(u64, wire::Metrics, Vec<u8>)>, SimulationError> {
        let answer = answer
            .await
            .unwrap_or_else(|_| Err("a worker went away".into()));
        match answer {
            Ok((
                Reply::Trained {
                    num_examples,
                    metrics,
                    ..
                },
                payload,
            )) => Ok(Some((num_examples, metrics, payload))),
            Ok((Reply::Failed { error }, _)) => {
                // A trainer that fails for client after client is a bug, not a fleet's
                // dropouts: the run stops with what it raised.
                self.failing += 1;
                let target = u64::from(self.task.record().config.target_clients.max(1));
                if self.failing >= target {
                    return Err(SimulationError::Workers(format!(
                        "{} virtual clients' trainings failed in a row, the last (client {client}, round {round}) with: {error}",
                        self.failing
                    )));
                }
                tracing::warn!(client, round, %error, "a virtual client's training failed: it counts as dropped out");
                traffic.lost += 1;
                Ok(None)
            }
            Err(error) => {
                tracing::warn!(client, round, %error, "a virtual client's worker failed: the client counts as dropped out");
                traffic.lost += 1;
                if self.pool.alive() == 0 {
                    return Err(SimulationError::Workers(format!(
                        "every simulation worker has exited (the last error: {error})"
                    )));
                }
                Ok(None)
            }
            Ok((other, _)) => Err(unexpected(other)),
        }
    }

    /// Waits until the engine has closed attempt `attempt` of round `number`.
    async fn moved_on(&self, number: u64, attempt: u32) -> Result<(), SimulationError> {
        let mut changes = self.task.subscribe();
        let waited = tokio::time::timeout(ENGINE_WAIT, async {
            loop {
                let moved = match self.open_round() {
                    None => true,
                    Some(r) => (r.number, r.attempt) != (number, attempt),
                };
                if moved || changes.changed().await.is_err() {
                    return;
                }
            }
        });
        waited.await.map_err(|_| {
            SimulationError::Setup(format!(
                "the engine did not close round {number} within {} s",
                ENGINE_WAIT.as_secs()
            ))
        })
    }

    /// The history row of the closed attempt, evaluated when it published.
    async fn record(
        &mut self,
        number: u64,
        attempt: u32,
        traffic: Traffic,
        on_row: &mut (dyn FnMut(&Row) + Send),
    ) -> Result<(), SimulationError> {
        self.federated_evaluation(number).await?;
        let (store, task) = (self.store.clone(), self.task.id.clone());
        let attempts = off_runtime(move || Ok(store.round_attempts(&task, number)?)).await?;
        let entry = attempts
            .iter()
            .find(|r| r.attempt == attempt)
            .ok_or_else(|| {
                SimulationError::Setup(format!(
                    "the engine has no history entry for round {number} attempt {attempt}"
                ))
            })?;
        let (eval_loss, eval_accuracy) = match (&entry.outcome, entry.model) {
            (RoundOutcome::Published, Some(model)) => self.evaluate(model).await?,
            _ => (None, None),
        };
        let row = Row {
            round: number,
            attempt,
            outcome: match entry.outcome {
                RoundOutcome::Published => "published".into(),
                RoundOutcome::Abandoned { .. } => "abandoned".into(),
            },
            sim_time_s: self.clock_s,
            wall_time_s: self.started.elapsed().as_secs_f64(),
            participants: entry.participants.len() as u64,
            dropouts: entry.dropped.len() as u64 + traffic.lost,
            examples: entry.examples,
            loss: entry.metrics.loss,
            eval_loss,
            eval_accuracy,
            federated_loss: entry.evaluation.and_then(|e| e.loss),
            federated_accuracy: entry.evaluation.and_then(|e| e.accuracy),
            epsilon: entry.privacy.as_ref().map(|p| p.epsilon),
            bytes_down: traffic.bytes_down,
            bytes_up: traffic.bytes_up,
        };
        on_row(&row);
        self.rows.push(row);
        self.carried_into_rows(number).await
    }

    /// `model`'s loss and accuracy on the evaluation clients' pooled held-out data, split over
    /// the workers and added up in client order.
    async fn evaluate(
        &mut self,
        model: ModelDigest,
    ) -> Result<(Option<f64>, Option<f64>), SimulationError> {
        if self.evaluation_clients.is_empty() {
            return Ok((None, None));
        }
        self.prepare(model).await?;
        let (model_kind, frozen_base) = (self.task.record().config.model, self.frozen_base());
        let asked: Vec<_> = self
            .evaluation_clients
            .chunks(EVALUATION_CHUNK)
            .map(|chunk| {
                let job = Job::Evaluate {
                    model,
                    frozen_base,
                    model_kind: model_kind.clone(),
                    clients: chunk.to_vec(),
                };
                (self.pool.submit(job.clone()), job)
            })
            .collect();
        let (mut loss, mut accuracy) = (Mean::default(), Mean::default());
        for (rx, job) in asked {
            match self.settle(job, rx).await?.0 {
                Reply::Evaluated {
                    loss: l,
                    accuracy: a,
                    examples: n,
                } => {
                    loss.add(l.unwrap_or(f64::NAN), n);
                    accuracy.add(a.unwrap_or(f64::NAN), n);
                }
                other => return Err(unexpected(other)),
            }
        }
        Ok((loss.value(), accuracy.value()))
    }
}

/// Runs `work` (store reads, file writes) on a blocking thread, never on the runtime's.
async fn off_runtime<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, SimulationError> + Send + 'static,
) -> Result<T, SimulationError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| SimulationError::Setup(format!("a blocking task failed: {e}")))?
}

/// A virtual client's id in the engine.
pub fn client_id(client: u64) -> String {
    format!("sim-{client}")
}

fn answer(answer: Answer) -> Result<(Reply, Vec<u8>), SimulationError> {
    match answer {
        Ok((Reply::Failed { error }, _)) | Err(error) => Err(SimulationError::Workers(error)),
        Ok(done) => Ok(done),
    }
}

impl From<String> for SimulationError {
    fn from(e: String) -> Self {
        SimulationError::Workers(e)
    }
}

/// An update the engine refused as it would a deployed client's (too stale, its round closed,
/// not valid), rather than an engine failure.
fn refused(e: &ServerError) -> bool {
    matches!(
        e,
        ServerError::Conflict { .. }
            | ServerError::Invalid { .. }
            | ServerError::InvalidUpdate(_)
            | ServerError::Quarantined(_)
    )
}

fn unexpected(reply: Reply) -> SimulationError {
    match reply {
        Reply::Failed { error } => SimulationError::Workers(error),
        other => SimulationError::Workers(format!("an unexpected reply: {other:?}")),
    }
}
