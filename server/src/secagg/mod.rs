//! A round attempt under secure aggregation: the server's side of the four stages, their
//! deadlines, and what is stored so that a restarted server carries on.
//!
//! ```text
//! Advertise ──(all selected advertised | deadline)──▶ ShareKeys ──(all shared | deadline)──▶
//! MaskedInput ──(all uploaded | training deadline)──▶ Unmask ──(all answered | deadline)──▶ done
//! ```
//!
//! At each transition the set of clients still in the protocol shrinks (U1 ⊇ U2 ⊇ U3) and is
//! fixed from then on; a message for a closed stage is refused (409 `stage_closed`), a client
//! left out of a stage is told so (409 `dropped_out`). Whenever the survivors can no longer
//! complete the attempt — fewer than the task's minimum, or a secret that fewer than `t`
//! remaining neighbours hold shares of — the attempt is abandoned and the coordinator retries
//! the round with fresh keys.
//!
//! Schedule: advertising closes once every selected client has advertised, or `stage_secs`
//! after the first advertisement (so clients that start late still get in), or — if nobody
//! comes — `round_deadline_secs` after the round opened. Sharing then has `stage_secs`; masked
//! inputs are due `stage_secs + round_deadline_secs` after advertising closed (the roster tells
//! clients when, so they know how long they may train); unmasking has `stage_secs` from when
//! the masked inputs are in.
//!
//! What is stored (sled tree `secagg`, one prefix per task): the stage record (stage, deadline,
//! participants with their signed public keys, the graph seed, U2, U3 and the name of the
//! masked-sum file), each advertisement, each sender's *encrypted* share bundles, and the
//! revealed unmask shares. The sum of the masked inputs is a checkpoint file. Individual masked
//! inputs are folded into the sum as they arrive and never stored; the shares are encrypted to
//! clients; so nothing stored unmasks a single client.
//!
//! Across replicas (a store they share), every replica takes any client's messages and the
//! leader alone moves the stages on: see [`shared`].

mod messages;
mod shared;
mod stages;

pub use shared::Sharing;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Mutex;

use hora_common::secagg::unmask::Participant;
use hora_common::secagg::{graph, hex_array, Context, Quantiser, SecAggError};
use hora_common::wire::{
    ErrorCode, EvaluationSums, SecAggAdvertise, SecAggEvaluation, SecAggOffer, SecAggReceipt,
    SecAggShareBundles, SecAggUnmask, SecureAggregationConfig,
};
use ring::rand::SecureRandom;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::error::ServerError;
use crate::round::now_ms;
use crate::store::Store;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stage {
    Advertise,
    ShareKeys,
    MaskedInput,
    Unmask,
    /// Published or abandoned: the coordinator has taken over.
    Ended,
}

/// A client's advertisement with the identity key it was checked against.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AdvertRecord {
    pub identity_key: String,
    pub keys: SecAggAdvertise,
}

/// The stage record (see the module doc).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StateRecord {
    pub round: u64,
    pub attempt: u32,
    pub stage: Stage,
    pub deadline_unix_ms: u64,
    pub input_deadline_unix_ms: u64,
    pub seed: String,
    /// Participants (sorted ids) once advertising has closed.
    pub participants: Vec<String>,
    pub threshold: usize,
    pub degree: usize,
    pub shared: Vec<String>,
    pub survivors: Vec<String>,
    pub sum_file: Option<String>,
}

/// What a message or deadline did to the attempt.
#[derive(Debug)]
pub enum Outcome {
    Continue,
    Abandon(String),
    /// The survivors' unmasked, decoded sum: `Σ w·x` per coordinate and `Σ w`.
    Publish {
        values: Vec<f64>,
        total_weight: u64,
        survivors: Vec<String>,
        /// With federated evaluation: the round whose model the survivors evaluated, and the
        /// sums of their evaluations (their inputs' evaluation slots).
        evaluation: Option<(u64, EvaluationSums)>,
    },
}

struct Inner {
    stage: Stage,
    deadline_unix_ms: u64,
    /// When masked inputs are due (fixed when advertising closes).
    input_deadline_unix_ms: u64,
    seed: [u8; 32],
    adverts: BTreeMap<String, AdvertRecord>,
    participants: Vec<Participant>,
    degree: usize,
    threshold: usize,
    mail: BTreeMap<String, SecAggShareBundles>,
    shared: BTreeSet<usize>,
    survivors: BTreeSet<usize>,
    sum: Vec<u32>,
    sum_file: Option<String>,
    answers: BTreeMap<String, SecAggUnmask>,
    /// Across replicas, while masked inputs come in: the participants whose inputs this
    /// replica's own partial sum (`sum`) holds.
    mine: BTreeSet<usize>,
    /// Whether the last write of that partial may or may not have landed (see `shared`).
    unsettled: bool,
    /// Replicas' partial sums merged into an attempt that then ended: removed with the
    /// attempt's own sum once its close is recorded.
    spent: Vec<String>,
}

pub struct SecAggRound {
    pub ctx: Context,
    pub quantiser: Quantiser,
    config: SecureAggregationConfig,
    capacity: usize,
    min_clients: usize,
    /// The latest the round can need masked inputs by (for the offer).
    pub latest_input_deadline_unix_ms: u64,
    round_deadline_ms: u64,
    vector_len: usize,
    /// The task's federated evaluation, carried in the inputs' evaluation slots.
    evaluation: Option<SecAggEvaluation>,
    inner: Mutex<Inner>,
    /// `inner.stage`, readable without the lock (which is held across store writes): for the
    /// task's status.
    stage_now: AtomicU8,
    /// Bumped at every stage change, for the long polls.
    pub changed: watch::Sender<u64>,
    /// How this replica shares the attempt with others (None: the server is alone).
    sharing: Option<Sharing>,
}

/// The parameters a task's rounds run with, checked at task creation.
pub fn quantiser_for(
    config: &SecureAggregationConfig,
    capacity: usize,
) -> Result<Quantiser, ServerError> {
    Quantiser::for_round(config.clip, config.max_weight, capacity)
        .map_err(|e| ServerError::BadRequest(e.to_string()))
}

/// Checks a task's secure-aggregation settings (at task creation).
pub fn validate(
    config: &SecureAggregationConfig,
    min_clients: u32,
    capacity: usize,
) -> Result<(), ServerError> {
    let bad = |m: String| Err(ServerError::BadRequest(m));
    if min_clients < 3 {
        return bad("secure aggregation needs min_clients >= 3: with two clients each could subtract its own update from the sum and learn the other's".into());
    }
    if config.stage_secs == 0 || config.stage_secs > 86_400 {
        return bad("secure_aggregation.stage_secs must be between 1 and 86400".into());
    }
    if let Some(k) = config.degree {
        if k < 2 {
            return bad("secure_aggregation.degree must be at least 2".into());
        }
    }
    if let Some(t) = config.threshold {
        // The degree a full round runs with (raised to even; the default when unset).
        let all = capacity.saturating_sub(1);
        let k = config
            .degree
            .map_or_else(|| graph::default_degree(capacity), |k| k as usize)
            .min(all);
        let k = if k + k % 2 >= all { all } else { k + k % 2 };
        if t < 2 || t as usize > k || t as usize <= k / 2 {
            return bad(format!(
                "secure_aggregation.threshold must be a majority of the {k} neighbours each client has in a full round: between {} and {k}",
                (k / 2 + 1).max(2)
            ));
        }
    }
    quantiser_for(config, capacity).map(|_| ())
}

impl Inner {
    /// Adds a masked input (little-endian u32s) into the masked sum of `len` values, or with
    /// `add` false takes it back out (a write that did not land).
    fn fold(&mut self, body: &[u8], len: usize, add: bool) {
        if self.sum.len() != len {
            self.sum = vec![0; len];
        }
        for (s, w) in self.sum.iter_mut().zip(crate::store::le_words(body)) {
            *s = if add {
                s.wrapping_add(w)
            } else {
                s.wrapping_sub(w)
            };
        }
    }
}

fn lock(m: &Mutex<Inner>) -> std::sync::MutexGuard<'_, Inner> {
    m.lock()
        .expect("a secure-aggregation lock was poisoned by an earlier panic")
}

fn secagg_error(e: SecAggError) -> ServerError {
    let code = match &e {
        SecAggError::Forged(_) => ErrorCode::ForgedMessage,
        SecAggError::LowOrderKey => ErrorCode::LowOrderKey,
        SecAggError::Stage(_) => ErrorCode::StageClosed,
        _ => ErrorCode::InvalidSecaggMessage,
    };
    ServerError::Invalid {
        code,
        message: e.to_string(),
    }
}

fn dropped_out(client: &str, stage: &str) -> ServerError {
    ServerError::conflict(
        ErrorCode::DroppedOut,
        format!(
            "client `{client}` is not part of this attempt any more: it missed the {stage} stage"
        ),
    )
}

fn stage_closed(stage: Stage, now: Stage) -> ServerError {
    ServerError::conflict(
        ErrorCode::StageClosed,
        format!("the {stage:?} stage is closed; the attempt is at {now:?}").to_lowercase(),
    )
}

/// The neighbour graph's seed of the attempt `ctx`, from a seed of the caller's
/// ([`CoordinatorConfig::graph_seed`](crate::round::CoordinatorConfig::graph_seed)).
fn derived_graph_seed(seed: u64, ctx: &hora_common::secagg::Context) -> [u8; 32] {
    let mut digest = ring::digest::Context::new(&ring::digest::SHA256);
    digest.update(b"hora secagg graph seed");
    digest.update(&seed.to_le_bytes());
    digest.update(&(ctx.task.len() as u64).to_le_bytes());
    digest.update(ctx.task.as_bytes());
    digest.update(&ctx.round.to_le_bytes());
    digest.update(&ctx.attempt.to_le_bytes());
    let mut out = [0u8; 32];
    out.copy_from_slice(digest.finish().as_ref());
    out
}

fn key(task: &str, kind: &str, client: &str) -> String {
    format!("{task}\0{kind}\0{client}")
}

impl SecAggRound {
    /// A new attempt.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        ctx: Context,
        config: SecureAggregationConfig,
        capacity: usize,
        min_clients: usize,
        opened_unix_ms: u64,
        round_deadline_secs: u64,
        numel: usize,
        evaluation: Option<SecAggEvaluation>,
        sharing: Option<Sharing>,
        graph_seed: Option<u64>,
    ) -> Result<SecAggRound, ServerError> {
        let seed = match graph_seed {
            Some(seed) => derived_graph_seed(seed, &ctx),
            None => {
                let mut seed = [0u8; 32];
                ring::rand::SystemRandom::new()
                    .fill(&mut seed)
                    .map_err(|_| {
                        ServerError::internal("the system random number generator failed")
                    })?;
                seed
            }
        };
        let quantiser = quantiser_for(&config, capacity)?;
        let stage_ms = config.stage_secs * 1000;
        Ok(SecAggRound {
            latest_input_deadline_unix_ms: opened_unix_ms
                + 2 * (round_deadline_secs * 1000 + stage_ms),
            round_deadline_ms: round_deadline_secs * 1000,
            stage_now: AtomicU8::new(Stage::Advertise as u8),
            inner: Mutex::new(Inner {
                stage: Stage::Advertise,
                deadline_unix_ms: opened_unix_ms + round_deadline_secs * 1000,
                input_deadline_unix_ms: 0,
                seed,
                adverts: BTreeMap::new(),
                participants: Vec::new(),
                degree: 0,
                threshold: 0,
                mail: BTreeMap::new(),
                shared: BTreeSet::new(),
                survivors: BTreeSet::new(),
                sum: Vec::new(),
                sum_file: None,
                answers: BTreeMap::new(),
                mine: BTreeSet::new(),
                unsettled: false,
                spent: Vec::new(),
            }),
            ctx,
            quantiser,
            config,
            capacity,
            min_clients: min_clients.max(3),
            vector_len: Quantiser::len(numel)
                + evaluation.map_or(0, |_| hora_common::secagg::quantise::EVALUATION_SLOTS),
            evaluation,
            changed: watch::channel(0).0,
            sharing,
        })
    }

    /// Rebuilds an attempt from the store after a restart (or, for a replica that does not
    /// lead, from what the leader stored).
    #[allow(clippy::too_many_arguments)]
    pub fn resume(
        store: &Store,
        ctx: Context,
        config: SecureAggregationConfig,
        capacity: usize,
        min_clients: usize,
        opened_unix_ms: u64,
        round_deadline_secs: u64,
        numel: usize,
        evaluation: Option<SecAggEvaluation>,
        sharing: Option<Sharing>,
    ) -> Result<SecAggRound, ServerError> {
        let round = SecAggRound::new(
            ctx,
            config,
            capacity,
            min_clients,
            opened_unix_ms,
            round_deadline_secs,
            numel,
            evaluation,
            sharing,
            None, // (the stored attempt's seed replaces it)
        )?;
        let task = round.ctx.task.clone();
        let state = store
            .secagg_get::<StateRecord>(&key(&task, "state", ""))?
            .filter(|s| (s.round, s.attempt) == (round.ctx.round, round.ctx.attempt));
        let mut inner = lock(&round.inner);
        match state {
            Some(state) => round.load(store, &mut inner, &state, true)?,
            // A fresh attempt: nothing of an older one counts. (A follower leaves that to the
            // leader, and learns the attempt's state when the leader stores it.)
            None if !round.follows() => store.secagg_clear(&task)?,
            None => {}
        }
        if round.sharing.is_some() && !round.follows() {
            // The gate opens for the stage stored (again, if a leader died closing it: the
            // stage takes messages until it closes once more).
            round.save_state(store, &inner)?;
        }
        drop(inner);
        Ok(round)
    }

    /// Takes in the stage record `state` of this attempt and every message stored for it; the
    /// masked sum too, if `sum` (a replica's own partial sum is its own).
    fn load(
        &self,
        store: &Store,
        inner: &mut Inner,
        state: &StateRecord,
        sum: bool,
    ) -> Result<(), ServerError> {
        self.set_stage(inner, state.stage);
        inner.deadline_unix_ms = state.deadline_unix_ms;
        inner.input_deadline_unix_ms = state.input_deadline_unix_ms;
        inner.seed = hex_array("seed", &state.seed).map_err(ServerError::internal)?;
        inner.adverts = self.scan(store, "adv")?;
        if !state.participants.is_empty() && inner.participants.is_empty() {
            self.fix_participants(inner, &state.participants, state.degree, state.threshold)?;
        }
        inner.mail = self.scan(store, "mail")?;
        inner.shared = self.indices(inner, &state.shared)?;
        inner.survivors = self.indices(inner, &state.survivors)?;
        if sum {
            inner.sum = match &state.sum_file {
                Some(file) => store.read_masked_sum(file, self.vector_len)?,
                None => vec![0; self.vector_len],
            };
            inner.sum_file = state.sum_file.clone();
        }
        inner.answers = self.scan(store, "unmask")?;
        if self.sharing.is_some() && inner.stage == Stage::MaskedInput {
            self.gather(store, inner)?;
        }
        Ok(())
    }

    /// Every client's message `kind` stored for the task.
    fn scan<T: serde::de::DeserializeOwned>(
        &self,
        store: &Store,
        kind: &str,
    ) -> Result<BTreeMap<String, T>, ServerError> {
        let prefix = key(&self.ctx.task, kind, "");
        Ok(store.secagg_scan::<T>(&prefix)?.into_iter().collect())
    }

    /// The participant indices of `ids`.
    fn indices(&self, inner: &Inner, ids: &[String]) -> Result<BTreeSet<usize>, ServerError> {
        ids.iter()
            .map(|id| {
                inner
                    .participants
                    .iter()
                    .position(|p| &p.id == id)
                    .ok_or_else(|| ServerError::internal(format!("unknown participant {id}")))
            })
            .collect()
    }

    pub fn offer(&self) -> SecAggOffer {
        SecAggOffer {
            attempt: self.ctx.attempt,
            clip: self.quantiser.clip,
            scale: self.quantiser.scale,
            max_weight: self.quantiser.max_weight,
            evaluation: self.evaluation,
        }
    }

    pub fn stage(&self) -> Stage {
        lock(&self.inner).stage
    }

    /// The stage as of its last change, without waiting for the round's lock.
    pub fn stage_now(&self) -> Stage {
        match self.stage_now.load(Ordering::Relaxed) {
            0 => Stage::Advertise,
            1 => Stage::ShareKeys,
            2 => Stage::MaskedInput,
            3 => Stage::Unmask,
            _ => Stage::Ended,
        }
    }

    fn set_stage(&self, inner: &mut Inner, stage: Stage) {
        inner.stage = stage;
        self.stage_now.store(stage as u8, Ordering::Relaxed);
    }

    pub fn deadline(&self) -> u64 {
        lock(&self.inner).deadline_unix_ms
    }

    /// The files of the attempt's masked sums (removed once the round's close is recorded).
    pub fn sum_files(&self) -> Vec<String> {
        let inner = lock(&self.inner);
        inner.sum_file.iter().chain(&inner.spent).cloned().collect()
    }

    /// Clients whose masked input is in the sum.
    pub fn survivors(&self) -> usize {
        lock(&self.inner).survivors.len()
    }

    fn save_state(&self, store: &Store, inner: &Inner) -> Result<(), ServerError> {
        let ids = |set: &BTreeSet<usize>| -> Vec<String> {
            set.iter()
                .map(|&i| inner.participants[i].id.clone())
                .collect()
        };
        let record = StateRecord {
            round: self.ctx.round,
            attempt: self.ctx.attempt,
            stage: inner.stage,
            deadline_unix_ms: inner.deadline_unix_ms,
            input_deadline_unix_ms: inner.input_deadline_unix_ms,
            seed: hex::encode(inner.seed),
            participants: inner.participants.iter().map(|p| p.id.clone()).collect(),
            threshold: inner.threshold,
            degree: inner.degree,
            shared: ids(&inner.shared),
            survivors: ids(&inner.survivors),
            sum_file: inner.sum_file.clone(),
        };
        store.secagg_put(&key(&self.ctx.task, "state", ""), &record)?;
        if self.sharing.is_some() && inner.stage != Stage::Ended {
            // (After the record: a replica that finds the gate open finds the stage stored.)
            self.set_gate(store, inner.stage, true)?;
        }
        Ok(())
    }

    /// Persists the first record of a new attempt (and clears the task's older ones).
    pub fn persist_new(&self, store: &Store) -> Result<(), ServerError> {
        store.secagg_clear(&self.ctx.task)?;
        self.save_state(store, &lock(&self.inner))
    }

    fn fix_participants(
        &self,
        inner: &mut Inner,
        ids: &[String],
        degree: usize,
        threshold: usize,
    ) -> Result<(), ServerError> {
        let neighbours = graph::neighbours(ids.len(), degree, &inner.seed);
        inner.participants = ids
            .iter()
            .zip(neighbours)
            .enumerate()
            .map(|(i, (id, neighbours))| {
                let advert = inner.adverts.get(id).ok_or_else(|| {
                    ServerError::internal(format!("participant {id} has no advertisement"))
                })?;
                Ok(Participant {
                    id: id.clone(),
                    index: i as u32 + 1,
                    mask_key: hex_array("mask_key", &advert.keys.mask_key)
                        .map_err(ServerError::internal)?,
                    neighbours,
                })
            })
            .collect::<Result<_, ServerError>>()?;
        inner.degree = degree;
        inner.threshold = threshold;
        Ok(())
    }

    /// Read sides refuse once the attempt has ended (its outcome is the coordinator's now).
    fn not_ended(&self, inner: &Inner) -> Result<(), ServerError> {
        if inner.stage == Stage::Ended {
            return Err(ServerError::conflict(
                ErrorCode::RoundAbandoned,
                format!(
                    "attempt {} of round {} has ended; poll for what comes next",
                    self.ctx.attempt, self.ctx.round
                ),
            ));
        }
        Ok(())
    }

    /// Checks that the attempt is at `stage`. A replica that does not lead may not have
    /// heard yet that the leader moved the stage on: it reads the leader's record first.
    fn require(&self, store: &Store, inner: &mut Inner, stage: Stage) -> Result<(), ServerError> {
        if inner.stage < stage && self.follows() {
            self.sync(store, inner)?;
        }
        if inner.stage != stage {
            return Err(stage_closed(stage, inner.stage));
        }
        Ok(())
    }

    fn participant(&self, inner: &Inner, client: &str, stage: &str) -> Result<usize, ServerError> {
        inner
            .participants
            .iter()
            .position(|p| p.id == client)
            .ok_or_else(|| dropped_out(client, stage))
    }

    fn receipt(&self, accepted: usize) -> SecAggReceipt {
        SecAggReceipt {
            round: self.ctx.round,
            attempt: self.ctx.attempt,
            accepted: accepted as u32,
        }
    }

    /// A client's second message for a stage: the same one again is a retry after a lost
    /// acknowledgement (acknowledged again), another one a 409 `code`.
    fn repeated(
        &self,
        same: bool,
        accepted: usize,
        code: ErrorCode,
        message: String,
    ) -> Result<(SecAggReceipt, Outcome), ServerError> {
        if same {
            return Ok((self.receipt(accepted), Outcome::Continue));
        }
        Err(ServerError::conflict(code, message))
    }

    /// A stage's message is in: the receipt, and the stage closed once `accepted` reaches
    /// `expected`.
    fn progress(
        &self,
        store: &Store,
        inner: &mut Inner,
        accepted: usize,
        expected: usize,
    ) -> Result<(SecAggReceipt, Outcome), ServerError> {
        // (Only the leader moves the stages on: it counts what every replica took.)
        let outcome = if accepted >= expected && !self.follows() {
            self.close_stage(store, inner)?
        } else {
            Outcome::Continue
        };
        Ok((self.receipt(accepted), outcome))
    }

    /// The read sides: `None` while the attempt is at `open` or before, else the state and
    /// `client`'s participant index.
    fn ready(
        &self,
        client: &str,
        open: Stage,
    ) -> Result<Option<(std::sync::MutexGuard<'_, Inner>, usize)>, ServerError> {
        let inner = lock(&self.inner);
        self.not_ended(&inner)?;
        if inner.stage <= open {
            return Ok(None);
        }
        let me = self.participant(&inner, client, "advertise")?;
        Ok(Some((inner, me)))
    }
}
