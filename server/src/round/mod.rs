//! The round engine: tasks, their rounds, and everything that moves a round along.
//!
//! A round attempt is **open** from the moment the previous one is published. Its [`Phase`] is
//! a type: it is **collecting** (clients join — the first `target × (1 + over_selection)` are
//! selected, others are told when to come back — and their updates are folded into the round's
//! running sum at once), then **closing** (tallied; the strategy turns the sum into the next
//! global model), then **published**, or **abandoned** with a reason (fewer than `min_clients`
//! updates by the deadline, a sum that is not finite, a secure-aggregation attempt that lost too
//! many clients) — an abandoned round is retried as a new attempt with a fresh key.
//!
//! How updates arrive is the round's [`Collection`], the seam between the engine and a round
//! mode: [`plain`] sealed uploads (each opened, validated and folded on arrival), [`secure`]
//! aggregation (Bonawitz et al.'s four stages; the server learns only the sum), or
//! [`asynchronous`] buffers (FedBuff: a round is a version, published every `buffer_size`
//! updates, whichever version each update was trained from). Everything else
//! is shared by every mode and read top to bottom:
//!
//! - [`coordinator`]: the [`Coordinator`] — tasks loaded and resumed at start, long polls, joins.
//! - [`upload`]: the sealed-upload path — checks before the body, envelope, validation, update
//!   bounds, the mode's fold, the wait for durability.
//! - [`task`]: a task's record and the operator's verbs (create, pause, resume, stop, history).
//! - [`commit`]: group commit. A folded update is *pending* until a checkpoint that contains it
//!   is durable: the committer, woken by the first pending update, writes the sum (atomic file,
//!   fsync, rename), then the round's record listing its contributors, flushes, and only then are
//!   those uploads acknowledged. A crash loses only unacknowledged uploads, which clients retry;
//!   the restarted round resumes from its last checkpoint, so the published model is the same as
//!   without the crash. Writes are O(model) per commit, not per upload.
//! - [`deadline`]: one watcher per open round, for every mode: it closes a full round, a round
//!   whose deadline passed, and retries a close that failed (storage trouble).
//! - [`close`]: tally → publish or abandon → open the next round, in one store transaction
//!   (before it, the task's previous federated evaluation may end in a transaction of its own).
//! - [`evaluation`]: federated evaluation — opened as a round publishes, offered in polls,
//!   reports folded into running sums, ended into the round's history entry; secure rounds
//!   carry their clients' evaluations in the masked inputs instead.
//!
//! Locks: a round's accumulator lock may be taken while holding nothing; the task's writing
//! turn (held across store writes of its record) while holding it or nothing; and the task's
//! record and round slots while holding either — never the other way round.

pub mod asynchronous;
mod close;
pub mod collection;
mod commit;
pub mod coordinator;
mod deadline;
pub mod evaluation;
pub mod phase;
pub mod plain;
mod regional;
pub mod replicas;
pub mod secure;
pub mod seen;
pub mod strikes;
pub mod task;
pub mod upload;

use std::collections::{BTreeSet, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use hora_common::envelope::RoundSecretKey;
use hora_common::kernel::WeightedSum;
use hora_common::model::ModelDigest;
use hora_common::wire;
use tokio::sync::{watch, Notify};

pub use collection::Collection;
pub use coordinator::{Acknowledge, Coordinator, CoordinatorConfig};
pub use phase::{Ending, Phase};
pub use replicas::Role;
pub use task::Task;
pub use upload::{
    open_update, too_large_hint, upload_limit, Admission, Ingest, Sealing, UpdateBody,
};

use crate::store::{CheckpointRecord, Contribution, OpenRoundRecord, TaskRecord};

pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// A wait of between half of `base_ms` and all of it, so that clients told to come back do not
/// come back as one herd.
pub(crate) fn jitter(base_ms: u64) -> u64 {
    use rand::Rng;
    rand::rng().random_range(base_ms / 2..=base_ms)
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock()
        .expect("a round-engine lock was poisoned by an earlier panic")
}

/// How many requests of one task may wait on its round's lock on blocking threads at once.
pub(crate) const LOCK_WAITERS: usize = 16;

/// Clients selected per round: the target plus the over-selection.
pub(crate) fn capacity(config: &wire::CreateTask) -> usize {
    (f64::from(config.target_clients) * (1.0 + config.over_selection)).ceil() as usize
}

/// What waiting uploads learn about their round.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Durability {
    /// The first `n` contributions are durable.
    Upto(usize),
    /// The attempt was abandoned: nothing of it counts.
    Abandoned(String),
    /// A follower's attempt ended (the leader closed it, or another replica took an update
    /// this one held): its first `upto` contributions are durable (in its partial, which the
    /// leader merges), the rest never will be.
    Ended { upto: usize, why: String },
}

/// What joining clients learn about their selection: a client is told it is selected only once
/// a record listing it is durable, so a crash can never turn its upload into `not_selected`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum SelectionDurability {
    /// The first `n` selections (in the order they were made) are durable.
    Upto(usize),
    /// The attempt closed: it takes no more clients.
    Closed,
}

/// A round's running state, under one lock.
pub(crate) struct Accumulator {
    pub(crate) phase: Phase,
    pub(crate) sum: WeightedSum,
    pub(crate) selected: BTreeSet<String>,
    /// How many of `selected` a durable record lists (selections only grow within an attempt).
    pub(crate) selected_durable: usize,
    /// Selected clients whose upload reached the round (admitted to be read), accepted or not.
    pub(crate) tried: BTreeSet<String>,
    /// Every accepted contribution, the durable ones first.
    pub(crate) contributions: Vec<Contribution>,
    /// The clients behind regional aggregators' partials among `contributions`, beyond one a
    /// partial (Σ contributors − 1): kept as they are folded, so counting is O(1).
    pub(crate) behind: u64,
    pub(crate) durable: usize,
    /// The last durable checkpoint of the sum, as the open-round record must describe it.
    pub(crate) checkpoint: Option<Checkpointed>,
    /// The sum holds the round's differential-privacy noise (see `dp`): never noise it twice.
    pub(crate) noised: bool,
    /// The round is full: the deadline watcher closes it now rather than at the deadline.
    pub(crate) close_requested: bool,
    /// Closes of this attempt that failed (storage trouble): from the first, checkpoints make
    /// uploads durable again while the close is retried.
    pub(crate) failed_closes: u32,
    /// The serving replicas whose partials `sum` holds (see [`replicas`]).
    pub(crate) merged: Vec<String>,
    /// Their partials' blobs, removed once the close that merged them is durable.
    pub(crate) partial_files: Vec<String>,
    /// The leader's count of the clients whose updates other replicas hold for this attempt
    /// (their partials), for closing a round full across replicas.
    pub(crate) elsewhere: u64,
}

impl Accumulator {
    /// How many clients' updates the attempt holds: those behind a regional aggregator's
    /// partial counted each.
    pub(crate) fn contributors(&self) -> u64 {
        (self.contributions.len() as u64).saturating_add(self.behind)
    }

    /// [`Accumulator::behind`] of `contributions`.
    pub(crate) fn behind(contributions: &[Contribution]) -> u64 {
        contributions.iter().fold(0u64, |n, c| {
            n.saturating_add(c.contributors.saturating_sub(1))
        })
    }

    pub(crate) fn new(spec: hora_common::model::ModelSpec) -> Self {
        Accumulator {
            phase: Phase::Collecting,
            sum: WeightedSum::new(spec),
            selected: BTreeSet::new(),
            selected_durable: 0,
            tried: BTreeSet::new(),
            contributions: Vec::new(),
            behind: 0,
            durable: 0,
            checkpoint: None,
            noised: false,
            close_requested: false,
            failed_closes: 0,
            merged: Vec::new(),
            partial_files: Vec::new(),
            elsewhere: 0,
        }
    }
}

/// What a checkpoint file holds, captured when it was written: the live sum's total weight and
/// noise flag may have moved on since (uploads folded, noise added by a close that then failed),
/// and a record must never pair the file with them.
#[derive(Clone)]
pub(crate) struct Checkpointed {
    pub(crate) file: String,
    pub(crate) total_weight: f64,
    pub(crate) noised: bool,
}

/// Who is in an attempt, for the readers that must never wait behind its accumulator (whose
/// lock a checkpoint holds across a model-sized write): the long polls, the task's status and
/// the secure-aggregation messages. Changed together with the accumulator, under its lock, and
/// itself never held across anything.
#[derive(Default)]
pub(crate) struct Roster {
    pub(crate) selected: HashSet<String>,
    pub(crate) contributed: HashSet<String>,
    /// Contributions taken (an asynchronous buffer may hold two of one client, from two base
    /// versions).
    pub(crate) accepted: usize,
}

impl Roster {
    pub(crate) fn of(acc: &Accumulator) -> Roster {
        Roster {
            selected: acc.selected.iter().cloned().collect(),
            contributed: acc.contributions.iter().map(|c| c.client.clone()).collect(),
            accepted: acc.contributions.len(),
        }
    }

    /// `client`'s update was taken.
    pub(crate) fn contributed(&mut self, client: &str) {
        self.contributed.insert(client.to_string());
        self.accepted += 1;
    }
}

/// One attempt of one round.
pub struct Round {
    pub number: u64,
    pub attempt: u32,
    pub(crate) key: RoundSecretKey,
    pub base: ModelDigest,
    pub(crate) opened_unix_ms: u64,
    pub(crate) opened: Instant,
    /// The attempt was resumed after a restart (its deadline may have passed meanwhile).
    pub(crate) resumed: bool,
    pub(crate) deadline_unix_ms: std::sync::atomic::AtomicU64,
    pub(crate) acc: Mutex<Accumulator>,
    /// Who `acc` has selected and taken updates from, readable while `acc` is busy.
    pub(crate) roster: Mutex<Roster>,
    pub(crate) durability: watch::Sender<Durability>,
    /// Why the last checkpoint failed, while the store is unreachable (None once one lands):
    /// waiting uploads are answered 503 at once rather than at the durability timeout.
    pub(crate) storage_trouble: watch::Sender<Option<String>>,
    /// What waiting joins learn about their selection.
    pub(crate) selection: watch::Sender<SelectionDurability>,
    /// How the round's updates arrive.
    pub collection: Arc<dyn Collection>,
    /// Wakes the round's deadline watcher (a close was requested, the clock moved).
    pub(crate) wake: Notify,
}

impl Round {
    pub(crate) fn deadline(&self) -> u64 {
        self.deadline_unix_ms
            .load(std::sync::atomic::Ordering::SeqCst)
    }

    pub(crate) fn set_deadline(&self, unix_ms: u64) {
        self.deadline_unix_ms
            .store(unix_ms, std::sync::atomic::Ordering::SeqCst);
        self.wake.notify_one();
    }

    /// The round's phase now.
    pub fn phase(&self) -> Phase {
        lock(&self.acc).phase.clone()
    }

    /// Whether `client` is selected for this attempt, and whether its update is in (never
    /// waits on the accumulator).
    pub(crate) fn standing(&self, client: &str) -> (bool, bool) {
        let roster = lock(&self.roster);
        (
            roster.selected.contains(client),
            roster.contributed.contains(client),
        )
    }

    /// How many clients this attempt has selected and taken updates from (never waits on the
    /// accumulator).
    pub(crate) fn counts(&self) -> (usize, usize) {
        let roster = lock(&self.roster);
        (roster.selected.len(), roster.accepted)
    }

    /// What a client admitted to this attempt is told; it must be done by `deadline_unix_ms`.
    pub(crate) fn offer(&self, record: &TaskRecord, deadline_unix_ms: u64) -> wire::RoundOffer {
        wire::RoundOffer {
            round: self.number,
            attempt: self.attempt,
            model: self.base,
            model_kind: record.config.model.clone(),
            round_key: self.key.public_key(),
            deadline_unix_ms,
            training: record.config.training.clone(),
            secure_aggregation: self.collection.offer(),
            compression: record.config.compression.clone(),
            // (The HTTP layer, which takes chunks, says so.)
            upload_chunk_bytes: None,
            frozen_base: record.part.as_ref().map(|p| p.base),
        }
    }

    pub(crate) fn record(&self, acc: &Accumulator) -> OpenRoundRecord {
        let mut record = OpenRoundRecord {
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
            earlier: Vec::new(),
            slots: Vec::new(),
            merged: acc.merged.clone(),
        };
        self.collection.record(&mut record);
        record
    }
}

#[cfg(test)]
mod tests;
