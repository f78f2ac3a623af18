//! The asynchronous round mode (FedBuff, Nguyen et al., AISTATS 2022): no round waits for its
//! slowest client.
//!
//! A task's *version* `v` is its open round `v`, and the round's running sum is the buffer that
//! makes version `v + 1`'s model. A client pulls the current version whenever it is free — at
//! most `concurrency` hold a training slot at once; the others are told when to come back (pace
//! steering) — trains, and uploads its delta sealed to the key of the version it pulled. The
//! update is folded into whatever buffer is open when it arrives, weighted by its example count
//! times the staleness factor `w(s)` of the versions published since its base (`s`):
//!
//! ```text
//! model(v+1) = strategy(model(v), Σ nᵢ·w(sᵢ)·Δᵢ / Σ nᵢ)
//! ```
//!
//! which is FedBuff's `1/K · Σ w(sᵢ)·Δᵢ` with equal example counts, and plain FedAvg when nothing
//! is stale. The buffer is published through the task's strategy (FedAdam and the rest work as
//! in synchronous rounds) once it holds `buffer_size` updates. An update more than
//! `max_staleness` versions behind is refused (409 `too_stale`), and so is one whose client's
//! training slot has lapsed (409 `not_selected`: it joins again); an update whose buffer closed
//! while it was being opened goes into the next.
//!
//! Every guarantee of the plain path holds: uploads are sealed to the key of their base version
//! and bound to task, client and base model; each client contributes at most one update per base
//! version (and only from a version later than its last one), one at a time; an update is
//! acknowledged only once a checkpoint or the publication that contains it is durable. The keys
//! of the versions still within `max_staleness` travel in the open round's record, so a restart
//! opens the updates clients trained before it. On a store that replicas share, every replica
//! serves the task: see [`super::replicas`].

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use hora_common::envelope::RoundSecretKey;
use hora_common::model::ModelDigest;
use hora_common::wire::{self, AsynchronousConfig, ErrorCode, VersionStaleness};

use super::collection::{send_again, Collection, Folded, Joined, Opened, Step};
use super::plain::already_contributed;
use super::replicas::learn_selected;
use super::upload::{Admission, Sealing};
use super::{jitter, lock, now_ms, Coordinator, Round, Task};
use crate::error::ServerError;
use crate::metrics::ServerMetrics;
use crate::store::{
    Contribution, EarlierVersion, OpenRoundRecord, Retention, SlotTaken, Store, TaskRecord,
    TrainingSlot,
};

/// Buffered asynchronous aggregation. One collection serves every version of its task.
pub struct AsyncCollection {
    config: AsynchronousConfig,
    /// How long a client may hold a training slot (the task's round deadline).
    slot_ms: u64,
    state: Mutex<State>,
}

struct State {
    /// The keys and base models of earlier versions that updates may still be trained from.
    earlier: BTreeMap<u64, Earlier>,
    /// The base version of each client's newest accepted update: its next one must be trained
    /// from a later version. (Entries older than the staleness window are refused as too stale
    /// anyway.)
    last_base: HashMap<String, u64>,
    /// What each fold into an attempt that is still open changed in `last_base`: (version,
    /// attempt, client, the client's base before). An abandoned attempt's updates never count,
    /// so their clients get their earlier base back (and may train from that version again).
    undo: Vec<(u64, u32, String, Option<u64>)>,
    /// Clients holding a training slot, with when the slot lapses (Unix ms).
    slots: HashMap<String, u64>,
    /// Moving average of the time between accepted updates (ms), for pace steering.
    interval_ms: f64,
    last_fold: Option<Instant>,
}

struct Earlier {
    key: Arc<RoundSecretKey>,
    base: ModelDigest,
}

impl AsyncCollection {
    pub fn new(record: &TaskRecord, config: &AsynchronousConfig) -> Self {
        AsyncCollection {
            config: config.clone(),
            slot_ms: record.config.round_deadline_secs * 1000,
            state: Mutex::new(State {
                earlier: BTreeMap::new(),
                last_base: HashMap::new(),
                undo: Vec::new(),
                slots: HashMap::new(),
                interval_ms: 1_000.0,
                last_fold: None,
            }),
        }
    }

    /// The collection of a task resumed after a restart: the earlier versions' keys from the
    /// open record, and each client's newest base from the history of the versions still within
    /// the staleness window and from the open buffer's checkpoint.
    pub fn resume(
        store: &Store,
        record: &TaskRecord,
        config: &AsynchronousConfig,
        open: &OpenRoundRecord,
    ) -> Result<Self, ServerError> {
        let collection = AsyncCollection::new(record, config);
        let mut state = lock(&collection.state);
        for e in &open.earlier {
            let mut secret = [0u8; 32];
            hex::decode_to_slice(&e.secret, &mut secret)
                .map_err(|_| ServerError::internal("corrupt key of an earlier version"))?;
            state.earlier.insert(
                e.round,
                Earlier {
                    key: Arc::new(RoundSecretKey::from_bytes(secret)),
                    base: e.base_model,
                },
            );
        }
        let now = now_ms();
        state.slots = open
            .slots
            .iter()
            .filter(|s| s.until_unix_ms > now)
            .map(|s| (s.client.clone(), s.until_unix_ms))
            .collect();
        // (Only the versions within the staleness window: the rest of the history is not read.)
        let oldest = open.round.saturating_sub(config.max_staleness);
        let window = store.history_page(&record.config.id, oldest.saturating_sub(1), usize::MAX)?;
        for version in window {
            // Abandoned versions' updates never counted: they do not hold their clients back.
            if version.model.is_none() {
                continue;
            }
            if let Some(s) = &version.staleness {
                for (client, base) in version.participants.iter().zip(&s.bases) {
                    let last = state.last_base.entry(client.clone()).or_insert(*base);
                    *last = (*last).max(*base);
                }
            }
        }
        for c in open.checkpoint.iter().flat_map(|c| &c.contributions) {
            if let Some(base) = c.base {
                let before = state.last_base.insert(c.client.clone(), base);
                state
                    .undo
                    .push((open.round, open.attempt, c.client.clone(), before));
            }
        }
        drop(state);
        Ok(collection)
    }

    /// Clients holding a training slot now.
    pub fn training(&self) -> usize {
        let now = now_ms();
        lock(&self.state)
            .slots
            .values()
            .filter(|until| **until > now)
            .count()
    }

    /// Gives `client` a training slot on the current version `round` if one is free (or the
    /// one it holds). The client is told only once a record listing the slot is durable: it is
    /// listed among the version's selections, which the engine's commit makes durable, and the
    /// record of a version lists the slots held when it is written (see [`Collection::record`]),
    /// so a restart never refuses the upload the client trained for. Blocking.
    fn join(
        &self,
        round: &Arc<Round>,
        record: &TaskRecord,
        client: &str,
    ) -> Result<Joined, ServerError> {
        let now = now_ms();
        // The round's lock first, as every path takes them: a record of the round that lists
        // the client among its selections lists its slot too.
        let mut acc = lock(&round.acc);
        if !acc.phase.is_collecting() {
            return Ok(Joined::Wait); // the version is being published: ask the next one
        }
        let mut state = lock(&self.state);
        if state
            .last_base
            .get(client)
            .is_some_and(|b| *b >= round.number)
        {
            return Err(already_contributed(client, round.number));
        }
        state.slots.retain(|_, until| *until > now);
        let until = match state.slots.get(client) {
            Some(until) => *until,
            None if state.slots.len() >= self.config.concurrency as usize => {
                return Ok(Joined::Wait)
            }
            None => {
                let until = now + self.slot_ms;
                state.slots.insert(client.to_string(), until);
                until
            }
        };
        drop(state);
        if acc.selected.insert(client.to_string()) {
            lock(&round.roster).selected.insert(client.to_string());
        }
        Ok(Joined::offered(round, record, until, acc.selected.len()))
    }

    /// [`AsyncCollection::join`] on a store replicas share: the slot is taken in the store, so
    /// that the task's concurrency holds across replicas and the client may upload at any of
    /// them; durable once this returns. A client whose update of the open version is in, at
    /// whichever replica, waits for the next. Blocking.
    fn join_shared(
        &self,
        engine: &Coordinator,
        task: &Task,
        record: &TaskRecord,
        round: &Arc<Round>,
        client: &str,
    ) -> Result<Joined, ServerError> {
        if !lock(&round.acc).phase.is_collecting() {
            return Ok(Joined::Wait);
        }
        if lock(&self.state)
            .last_base
            .get(client)
            .is_some_and(|b| *b >= round.number)
        {
            return Err(already_contributed(client, round.number));
        }
        // (The store's transaction is not held under a lock.)
        let taken = engine.store().take_slot(
            &task.id,
            round.number,
            round.attempt,
            client,
            self.slot_ms,
            self.config.concurrency,
        )?;
        let until = match taken {
            SlotTaken::Held { until_unix_ms } => until_unix_ms,
            SlotTaken::Full | SlotTaken::Closed => return Ok(Joined::Wait),
            SlotTaken::Contributed => return Err(already_contributed(client, round.number)),
        };
        learn_selected(round, &mut lock(&round.acc), client);
        lock(&self.state).slots.insert(client.to_string(), until);
        task.bump();
        Ok(Joined::offered(round, record, until, 0))
    }

    /// The checks an upload trained from version `base` must pass before its body is read.
    fn admit_upload(
        &self,
        round: &Arc<Round>,
        client: &str,
        base: u64,
    ) -> Result<Admission, ServerError> {
        if base > round.number {
            return Err(ServerError::conflict(
                ErrorCode::WrongRound,
                format!(
                    "version {base} is not published yet; the current version is {}",
                    round.number
                ),
            ));
        }
        self.check_staleness(round.number, base)?;
        let acc = lock(&round.acc);
        match acc
            .contributions
            .iter()
            .position(|c| c.client == client && c.base == Some(base))
        {
            Some(index) if index < acc.durable => return Err(already_contributed(client, base)),
            Some(index) => return Ok(Admission::Pending(round.clone(), index)),
            None => {}
        }
        let state = lock(&self.state);
        if let Some(last) = state.last_base.get(client).filter(|b| **b >= base) {
            return Err(ServerError::conflict(
                ErrorCode::AlreadyContributed,
                format!("client `{client}` has already contributed an update trained from version {last}; train from a later version"),
            ));
        }
        // Only a client holding a training slot uploads: the slots are what bounds how many
        // train at once (and so how fast updates may arrive).
        if state
            .slots
            .get(client)
            .is_none_or(|until| *until <= now_ms())
        {
            return Err(ServerError::conflict(
                ErrorCode::NotSelected,
                format!("client `{client}` holds no training slot: join the task first (a slot lapses round_deadline_secs after it is given, and is spent by the upload it was given for)"),
            ));
        }
        let sealing = match base == round.number {
            true => Sealing::Current,
            false => match state.earlier.get(&base) {
                Some(e) => Sealing::Earlier {
                    round: base,
                    key: e.key.clone(),
                    base: e.base,
                },
                None => return Err(too_stale(base, round.number, self.config.max_staleness)),
            },
        };
        Ok(Admission::Fresh(round.clone(), sealing))
    }

    fn check_staleness(&self, version: u64, base: u64) -> Result<u64, ServerError> {
        let staleness = version - base;
        match staleness > self.config.max_staleness {
            true => Err(too_stale(base, version, self.config.max_staleness)),
            false => Ok(staleness),
        }
    }

    /// Folds an opened update (`update.base` says which version it was trained from) into the
    /// buffer open now (the one checked may have closed meanwhile: the update goes into the
    /// next), weighted by its example count and its staleness; `scale` is what the task's norm
    /// bound asks for. With `only` (the version its claim across replicas is for), into that
    /// one or none: its client sends it again for the next. Returns the round it went into, its
    /// index there, and whether it was folded now (false: a retry that raced its first
    /// attempt).
    fn fold_into_open(
        &self,
        task: &Task,
        only: Option<&Arc<Round>>,
        opened: Opened<'_>,
    ) -> Result<Folded, ServerError> {
        let Opened {
            mut update,
            sealed: base,
            scale,
            view,
            ..
        } = opened;
        update.base = Some(base);
        let client = &update.client;
        // A close holds the buffer's lock until the next version is installed, so a buffer found
        // closed has a successor already, unless the task ended.
        for _ in 0..64 {
            let round = match only {
                Some(round) => round.clone(),
                None => task.current().ok_or_else(|| {
                    ServerError::conflict(ErrorCode::RoundClosed, "the task takes no more updates")
                })?,
            };
            let mut acc = lock(&round.acc);
            if !acc.phase.is_collecting() {
                drop(acc);
                if only.is_some() {
                    return Err(send_again(
                        round.number,
                        "closed while this update was being read",
                    ));
                }
                if task.current().is_some_and(|c| !Arc::ptr_eq(&c, &round)) {
                    continue;
                }
                return Err(ServerError::conflict(
                    ErrorCode::RoundClosed,
                    "the task took no more updates while this one was being checked",
                ));
            }
            let staleness = self.check_staleness(round.number, base)?;
            if let Some(index) = acc
                .contributions
                .iter()
                .position(|c| c.client == *client && c.base == Some(base))
            {
                return Ok(Folded {
                    round: round.clone(),
                    index,
                    now: false,
                });
            }
            // (The collection's state is shared by every version and read by polls and joins:
            // never held across the model-sized fold. The round's lock, held throughout, keeps
            // the check and the record together.)
            if lock(&self.state)
                .last_base
                .get(client)
                .is_some_and(|b| *b >= base)
            {
                return Err(already_contributed(client, base));
            }
            let factor = self.config.staleness.weight(staleness);
            if !(factor.is_finite() && factor > 0.0) {
                return Err(too_stale(base, round.number, self.config.max_staleness));
            }
            acc.sum
                .add_update_scaled(update.examples as f64, scale * factor, view)
                .map_err(|e| ServerError::InvalidUpdate(e.to_string()))?;
            let mut state = lock(&self.state);
            let before = state.last_base.insert(client.clone(), base);
            state
                .undo
                .push((round.number, round.attempt, client.clone(), before));
            state.slots.remove(client);
            let now = Instant::now();
            if let Some(last) = state.last_fold.replace(now) {
                let ms = (now - last).as_secs_f64() * 1e3;
                state.interval_ms = 0.8 * state.interval_ms + 0.2 * ms;
            }
            drop(state);
            lock(&round.roster).contributed(&update.client);
            acc.contributions.push(update);
            return Ok(Folded {
                round: round.clone(),
                index: acc.contributions.len() - 1,
                now: true,
            });
        }
        Err(ServerError::unavailable(
            ErrorCode::RoundClosed,
            "versions are being published faster than this update could be folded; retry it",
        ))
    }
}

fn too_stale(base: u64, version: u64, max: u64) -> ServerError {
    ServerError::conflict(
        ErrorCode::TooStale,
        format!(
            "the update was trained from version {base}, {} versions behind the current {version}; this task takes updates at most {max} versions stale: pull the current model and train again",
            version - base
        ),
    )
}

impl Collection for AsyncCollection {
    fn mode(&self) -> &'static str {
        "asynchronous"
    }

    fn select(
        &self,
        engine: &Coordinator,
        task: &Task,
        record: &TaskRecord,
        round: &Arc<Round>,
        client: &str,
    ) -> Result<Joined, ServerError> {
        let joined = match engine.store().shared() {
            true => self.join_shared(engine, task, record, round, client),
            false => self.join(round, record, client),
        };
        self.report(&engine.metrics, &task.id, round.counts().1);
        joined
    }

    /// Whether `client` holds a slot, and whether it has contributed an update trained from
    /// the open version (it waits for the next).
    fn standing(&self, round: &Round, client: &str) -> (bool, bool) {
        let state = lock(&self.state);
        (
            state
                .slots
                .get(client)
                .is_some_and(|until| *until > now_ms()),
            state
                .last_base
                .get(client)
                .is_some_and(|b| *b >= round.number),
        )
    }

    fn selected(&self, _: &Round) -> usize {
        self.training()
    }

    /// A slot another replica gave: the store has it.
    fn selected_elsewhere(
        &self,
        engine: &Coordinator,
        task: &Task,
        _: &Round,
        client: &str,
    ) -> Result<bool, ServerError> {
        let Some(until) = engine.store().training_slot(&task.id, client)? else {
            return Ok(false);
        };
        // (The store's clock says the slot holds now; this replica's may run ahead of it.)
        let until = until.max(now_ms() + 1_000);
        lock(&self.state).slots.insert(client.to_string(), until);
        Ok(true)
    }

    fn spends_slots(&self) -> bool {
        true
    }

    /// An update trained from version `b` goes into whichever version is open when it is
    /// folded, within `max_staleness`.
    fn carries_over(&self) -> bool {
        true
    }

    /// The updates other replicas folded count as their clients' newest, as this replica's
    /// own do (and are undone with them if the version is abandoned).
    fn merged(&self, round: &Round, contributions: &[Contribution]) {
        let mut state = lock(&self.state);
        for c in contributions {
            let Some(base) = c.base else { continue };
            let before = state.last_base.get(&c.client).copied();
            state
                .last_base
                .insert(c.client.clone(), before.map_or(base, |b| b.max(base)));
            state
                .undo
                .push((round.number, round.attempt, c.client.clone(), before));
            state.slots.remove(&c.client);
        }
    }

    /// How long a client without a slot waits before asking again: about the time until the
    /// next update frees one, jittered so that waiting clients do not come back as one herd.
    fn retry_after_ms(&self, _: &Round) -> u64 {
        jitter((lock(&self.state).interval_ms as u64).clamp(200, 30_000))
    }

    fn check_upload(
        &self,
        _: &Task,
        round: &Arc<Round>,
        client: &str,
        base: u64,
    ) -> Result<Admission, ServerError> {
        self.admit_upload(round, client, base)
    }

    fn fold(
        &self,
        engine: &Coordinator,
        task: &Task,
        round: &Arc<Round>,
        opened: Opened<'_>,
    ) -> Result<Folded, ServerError> {
        let sealed = opened.sealed;
        // Across replicas, an update goes only into the version it was claimed for (a claim is
        // what keeps a retry at another replica from being folded twice).
        let only = engine.store().shared().then_some(round);
        let folded = self.fold_into_open(task, only, opened)?;
        if folded.now {
            engine
                .metrics
                .update_staleness(&task.id, folded.round.number - sealed);
            engine.metrics.async_training(&task.id, self.training());
        }
        Ok(folded)
    }

    fn report(&self, metrics: &ServerMetrics, task: &str, buffered: usize) {
        metrics.async_buffered(task, buffered);
        metrics.async_training(task, self.training());
    }

    fn attempt_key(&self, number: u64) -> Option<RoundSecretKey> {
        let state = lock(&self.state);
        let e = state.earlier.get(&number)?;
        Some(RoundSecretKey::from_bytes(*e.key.to_bytes()))
    }

    fn serves(&self, digest: &ModelDigest) -> bool {
        lock(&self.state)
            .earlier
            .values()
            .any(|e| e.base == *digest)
    }

    fn retention(&self, mut policy: Retention) -> Retention {
        // Clients may still download (and train from) any version within the staleness window,
        // and a restart reads who trained from which of them in their history entries.
        let window = self.config.max_staleness + 1;
        if policy.last != 0 || policy.every != 0 {
            policy.last = policy.last.max(window);
        }
        if policy.detail != 0 {
            policy.detail = policy.detail.max(window);
        }
        policy
    }

    fn next_deadline(&self, _: &Round) -> u64 {
        u64::MAX // a version is published when its buffer is full, never for the time
    }

    fn at_deadline(&self, _: &Store) -> Result<Step, ServerError> {
        Ok(Step::Continue)
    }

    fn full_at(&self, _: &wire::CreateTask) -> usize {
        self.config.buffer_size as usize
    }

    fn staleness(&self, version: u64, contributions: &[Contribution]) -> Option<VersionStaleness> {
        let bases = contributions
            .iter()
            .map(|c| c.base.unwrap_or(version))
            .collect();
        Some(VersionStaleness::of(version, bases))
    }

    /// Keeps the key of `round`, which is closing, for updates trained from it that arrive
    /// later (and for a retry of it, which keeps the key its clients sealed to); forgets keys no
    /// update may use any more.
    fn retire(&self, round: &Round) {
        let mut state = lock(&self.state);
        state.earlier.insert(
            round.number,
            Earlier {
                key: Arc::new(RoundSecretKey::from_bytes(*round.key.to_bytes())),
                base: round.base,
            },
        );
        let oldest = round.number.saturating_sub(self.config.max_staleness);
        state.earlier.retain(|v, _| *v >= oldest);
    }

    /// The attempt `round` is closed: published, its updates count for good; abandoned, its
    /// clients get their earlier base back.
    fn settle(&self, round: &Round, abandoned: bool) {
        let mut state = lock(&self.state);
        let State {
            undo, last_base, ..
        } = &mut *state;
        let mut i = undo.len();
        while i > 0 {
            i -= 1;
            if (undo[i].0, undo[i].1) != (round.number, round.attempt) {
                continue;
            }
            let (_, _, client, before) = undo.remove(i);
            if abandoned {
                match before {
                    Some(base) => last_base.insert(client, base),
                    None => last_base.remove(&client),
                };
            }
        }
    }

    /// The earlier versions' keys and the training slots travel in the open round's record.
    fn record(&self, record: &mut OpenRoundRecord) {
        let state = lock(&self.state);
        record.earlier = state
            .earlier
            .iter()
            .map(|(round, e)| EarlierVersion {
                round: *round,
                secret: hex::encode(*e.key.to_bytes()),
                base_model: e.base,
            })
            .collect();
        let now = now_ms();
        record.slots = state
            .slots
            .iter()
            .filter(|(_, until)| **until > now)
            .map(|(client, until)| TrainingSlot {
                client: client.clone(),
                until_unix_ms: *until,
            })
            .collect();
        record.slots.sort_by(|a, b| a.client.cmp(&b.client));
    }

    /// A version's history lists no dropped clients: a client that joined while it was open
    /// may well have its update folded into a later one.
    fn dropped(&self, _: &BTreeSet<String>, _: &[String]) -> Vec<String> {
        Vec::new()
    }
}

/// Why an asynchronous configuration is refused for this task, if it is.
pub fn validate(config: &AsynchronousConfig, task: &wire::CreateTask) -> Result<(), String> {
    config.check()?;
    if task.secure_aggregation.is_some() {
        return Err("asynchronous tasks cannot use secure_aggregation: its masks cancel only within one round's fixed set of clients".into());
    }
    if task.differential_privacy.is_some() {
        return Err("asynchronous tasks cannot use differential_privacy yet: its accounting assumes rounds of sampled clients".into());
    }
    if task.min_clients > config.buffer_size {
        return Err(format!(
            "min_clients ({}) must not exceed asynchronous.buffer_size ({}): a version is published when its buffer holds buffer_size updates",
            task.min_clients, config.buffer_size
        ));
    }
    if config.max_staleness > MAX_STALENESS {
        return Err(format!(
            "asynchronous.max_staleness must be at most {MAX_STALENESS}"
        ));
    }
    Ok(())
}

/// The largest `max_staleness` a task may set (the keys of that many versions are kept).
const MAX_STALENESS: u64 = 1_000;
