//! The records the store keeps, and its error.
//!
//! Records are stored as JSON by [`SledStore`](super::SledStore) and
//! [`PostgresStore`](super::PostgresStore) (small, and readable when an operator has to look), so
//! every field added later needs `#[serde(default)]` for stores written before it.

use std::fmt;

use hora_common::model::{ModelDigest, ModelSpec};
use hora_common::wire::{CreateTask, EvaluationSums, Metrics, Redacted, RoundOffer, TaskState};
use serde::{Deserialize, Serialize};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("database: {0}")]
    Db(#[from] sled::Error),
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("corrupt record {key}: {reason}")]
    Corrupt { key: String, reason: String },
    #[error("model blob: {0}")]
    Model(#[from] hora_common::model::ModelError),
    #[error("the store was written by a newer hora-server (store format {found}; this one reads formats up to {supported}): run a hora-server at least as new as the one that wrote it")]
    NewerFormat { found: u32, supported: u32 },
    /// PostgreSQL cannot be reached or cannot serve now (down, restarting, refusing this
    /// server's connections, no connection free in time): worth retrying, and the API answers
    /// 503 `store_unavailable`.
    #[error("PostgreSQL at {at} is not answering ({reason}): check that it is running and accepts this server's connections, and that --store names it (host, port, database, user, password)")]
    Unavailable { at: String, reason: String },
    /// PostgreSQL refused a query.
    #[error("PostgreSQL: {0}")]
    Postgres(String),
    /// The blob store failed a request (cannot be reached, refused it): the API answers 503
    /// `store_unavailable`.
    #[error("blob store {at}: {reason}")]
    Blobs { at: String, reason: String },
    /// This replica's lease on the database (under `epoch`) was taken by another: it no longer
    /// leads, and its writes are refused (the API answers 503 `shutting_down`).
    #[error("this replica no longer leads: its lease on the database (epoch {epoch}) was taken by another replica, so it writes nothing more and steps down")]
    Fenced { epoch: i64 },
    /// A replica whose blobs are under its own data directory would take over from one on
    /// another host.
    #[error("the database was last led by a replica on host {host}, and this one keeps its blobs under its own data directory: replicas on more than one machine must share their blobs (--blobs file:///shared/dir or s3://bucket/prefix), or the records would name files this machine does not have")]
    Unshared { host: String },
    /// The server was asked to stop while it stood by for the lease.
    #[error("stopped while standing by")]
    Stopped,
    /// A replica that does not lead wrote for an attempt that is closing or closed (the leader
    /// sealed it) or that is not the task's open one.
    #[error("round {round} (attempt {attempt}) of task `{task}` is closing or closed: this replica records nothing more for it")]
    AttemptSealed {
        task: String,
        round: u64,
        attempt: u32,
    },
    /// A replica's partial holds an update whose claim another replica took over (this one
    /// was cut off long enough to count as gone): it can record nothing more of the attempt.
    #[error("another replica took over client `{client}`'s update of round {round} of task `{task}`, which this replica's partial holds: this replica records nothing more of the round")]
    ClaimLost {
        task: String,
        round: u64,
        client: String,
    },
    /// An asynchronous task's update was claimed for a client that holds no training slot in
    /// the store (it never joined, its slot lapsed, or an earlier update spent it).
    #[error("client `{client}` holds no training slot of task `{task}`: join the task first (a slot lapses round_deadline_secs after it is given, and is spent by the upload it was given for)")]
    NoTrainingSlot { task: String, client: String },
    /// What replicas share of an attempt (selections, claims, partial sums) was asked of a
    /// store only one server uses.
    #[error("{0} needs a store that replicas share (--store postgres://…)")]
    NotShared(&'static str),
    #[error("the database's schema migration {version} ({name}) is not the one this hora-server ships (its SQL was changed after it was applied): run the hora-server that set the database up, or restore the migration's original file")]
    MigrationChanged { version: u32, name: String },
}

impl StoreError {
    /// Whether a blob written for the failed write must stay: the database went away mid-commit
    /// (it may have committed the record naming the blob), or this replica was fenced (another
    /// replica leads now, and blobs are content-addressed in a store they share: it may have
    /// written and recorded the same one). Left, it is an orphan at worst, which the sweep at a
    /// start removes.
    pub fn keeps_new_blobs(&self) -> bool {
        matches!(
            self,
            StoreError::Unavailable { .. } | StoreError::Fenced { .. }
        )
    }

    /// Whether the failed write may have landed after all: the database went away mid-commit.
    /// A blob under a fresh name (a checkpoint, a strategy state) that only this write names
    /// must then stay until a later write settles it; after any other failure it can go.
    pub fn may_have_landed(&self) -> bool {
        matches!(self, StoreError::Unavailable { .. })
    }
}

/// A task as stored.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TaskRecord {
    pub config: CreateTask,
    pub spec: ModelSpec,
    pub state: TaskState,
    /// Rounds published so far; the open round is `published + 1`.
    pub published: u64,
    pub global_model: ModelDigest,
    pub created_unix_ms: u64,
    /// The file under `blobs/strategy/` holding a stateful strategy's state after round
    /// `published`; None before the first round (the strategy's initial state) and for
    /// stateless strategies. Written with `global_model`, in the same record.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strategy_state: Option<String>,
    /// The privacy spent so far and the clip norm, for a task with differential privacy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dp: Option<crate::dp::DpState>,
    /// Why the task ended before its rounds were done (its privacy budget).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended_reason: Option<String>,
    /// For a task that trains part of its model (`config.trainable`): where the rest is. `spec`
    /// and `global_model` are then the trainable part's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub part: Option<PartRecord>,
    /// The federated evaluation taking reports now (`config.evaluation`): its running sums,
    /// never the reports. Written with every report it counts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub evaluating: Option<EvaluationRecord>,
    /// For a regional task (`config.parent`): where it stands with its parent's rounds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<ParentRecord>,
}

/// Where a regional task stands with its parent's task (see [`crate::upstream`]).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ParentRecord {
    /// The parent's offer (its round, model and public key) that the open local round, or the
    /// last one, trains for; None before the first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offer: Option<RoundOffer>,
    /// The attempt the next local round opens as: 0 after a partial, one more after an
    /// abandoned attempt (whose successor keeps its number).
    #[serde(default)]
    pub attempt: u32,
    /// The last local round's partial, until the parent has taken it (or closed its round
    /// without it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partial: Option<PartialRecord>,
}

impl ParentRecord {
    /// The parent's round the open (or last) local round trains for.
    pub fn round(&self) -> Option<u64> {
        self.offer.as_ref().map(|o| o.round)
    }
}

/// A closed local round's partial, waiting to be forwarded to the parent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PartialRecord {
    /// The local round it closed.
    pub round: u64,
    /// The parent's round it is for.
    pub parent_round: u64,
    /// The example-weighted mean delta of the round's updates (a model blob).
    pub model: ModelDigest,
    pub examples: u64,
    pub contributors: u64,
    pub metrics: Metrics,
}

impl TaskRecord {
    /// The model round 0 published: the initial model, or its trainable part.
    pub fn initial_model(&self) -> ModelDigest {
        self.part
            .as_ref()
            .map_or(self.config.initial_model, |p| p.initial)
    }

    /// The models the task needs whatever its history: the current one, the one its open
    /// evaluation hands out, a regional task's partial not yet forwarded, and the initial one or, for a task that trains part of its model,
    /// the initial one's trainable part and its frozen base (the whole model as uploaded is no
    /// longer needed).
    pub fn own_models(&self) -> impl Iterator<Item = ModelDigest> {
        let initial = match &self.part {
            Some(p) => [Some(p.base), Some(p.initial)],
            None => [Some(self.config.initial_model), None],
        };
        let evaluated = self.evaluating.as_ref().map(|e| e.model);
        let partial = self.parent.as_ref().and_then(|p| p.partial.as_ref());
        std::iter::once(self.global_model)
            .chain(evaluated)
            .chain(partial.map(|p| p.model))
            .chain(initial.into_iter().flatten())
    }
}

/// A task that trains part of its model: its initial model, split by the task's `trainable`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PartRecord {
    /// The frozen base: the tensors no round changes.
    pub base: ModelDigest,
    pub base_spec: ModelSpec,
    /// The initial model's trainable tensors (round 0's model).
    pub initial: ModelDigest,
}

/// An evaluation taking reports: a published round's model, whose example-weighted result goes
/// into that round's history entry when it ends.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct EvaluationRecord {
    pub round: u64,
    /// The attempt that published the round (its history entry's key).
    pub attempt: u32,
    pub model: ModelDigest,
    pub deadline_unix_ms: u64,
    pub sums: EvaluationSums,
    /// The clients whose reports are in the sums (each counts once).
    pub reporters: std::collections::BTreeSet<String>,
    /// With `held_out`: the clients that trained the round, sorted (they are not asked).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub trainers: Vec<String>,
}

/// A task id and its record, or why the record could not be read.
pub type TaskRead = (String, Result<TaskRecord, StoreError>);

/// One accepted update, as the round's records keep it (never the update itself).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Contribution {
    pub client: String,
    pub examples: u64,
    pub metrics: Metrics,
    /// Under differential privacy: whether the update's norm was within the round's clip norm
    /// (what adaptive clipping counts).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unclipped: Option<bool>,
    /// In an asynchronous task: the version the update was trained from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base: Option<u64>,
    /// How many clients' updates it holds (a regional aggregator's partial holds several).
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub contributors: u64,
}

fn one() -> u64 {
    1
}

fn is_one(n: &u64) -> bool {
    *n == 1
}

/// The durable part of a round's accumulator.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CheckpointRecord {
    pub file: String,
    pub contributions: Vec<Contribution>,
    pub total_weight: f64,
    /// The sum holds the round's differential-privacy noise already (a close that failed
    /// after adding it): it must not be noised again.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub noised: bool,
}

/// A serving replica's durable partial sum of an open attempt: what the leader merges when it
/// closes the attempt (see `round::replicas`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ReplicaPartial {
    /// The replica (its id, new at each start of a process).
    pub replica: String,
    pub round: u64,
    pub attempt: u32,
    /// Its sum's checkpoint blob.
    pub file: String,
    pub total_weight: f64,
    pub contributions: Vec<Contribution>,
}

/// Another replica's claim on an update (see [`super::RoundLog::claim_update`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    pub replica: String,
    /// Whether the process that holds it was seen lately (its heartbeat, within the lease).
    pub alive: bool,
}

/// Whether a join recorded in a shared store ([`super::RoundLog::select_client`]) holds a place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SharedSelection {
    /// The client holds a place (taken now or before).
    Selected,
    /// The attempt has its capacity of clients.
    Full,
    /// The attempt is closing or is no longer the task's open one.
    Closed,
}

/// Whether a training slot asked of a shared store ([`super::RoundLog::take_slot`]) is held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotTaken {
    /// The client holds a slot (taken now or before) until this time (Unix ms).
    Held { until_unix_ms: u64 },
    /// `concurrency` clients hold one.
    Full,
    /// The client's update of the open version is in already: it waits for the next.
    Contributed,
    /// The version is closing or is no longer the task's open one.
    Closed,
}

/// The round a task has open, enough to resume it after a crash.
#[derive(Clone, Serialize, Deserialize)]
pub struct OpenRoundRecord {
    pub round: u64,
    pub attempt: u32,
    /// The round's X25519 secret (hex). Deleted with this record when the round closes.
    pub secret: String,
    pub base_model: ModelDigest,
    pub opened_unix_ms: u64,
    pub deadline_unix_ms: u64,
    pub selected: Vec<String>,
    pub checkpoint: Option<CheckpointRecord>,
    /// In an asynchronous task: the keys of the earlier versions clients may still upload
    /// updates for (those at most `max_staleness` behind). Deleted with this record.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub earlier: Vec<EarlierVersion>,
    /// In an asynchronous task: the clients holding a training slot, and when each lapses (Unix
    /// ms). A client is told it holds one only once a record listing it is durable, so a
    /// restart never refuses the upload it trained for.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub slots: Vec<TrainingSlot>,
    /// The serving replicas whose partials the checkpoint's sum holds already (a close that
    /// merged them failed): never merged twice.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub merged: Vec<String>,
}

impl fmt::Debug for OpenRoundRecord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OpenRoundRecord")
            .field("round", &self.round)
            .field("attempt", &self.attempt)
            .field("secret", &Redacted)
            .field("base_model", &self.base_model)
            .field("opened_unix_ms", &self.opened_unix_ms)
            .field("deadline_unix_ms", &self.deadline_unix_ms)
            .field("selected", &self.selected)
            .field("checkpoint", &self.checkpoint)
            .field("earlier", &self.earlier)
            .field("slots", &self.slots)
            .field("merged", &self.merged)
            .finish()
    }
}

/// A client's training slot in an asynchronous task.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TrainingSlot {
    pub client: String,
    pub until_unix_ms: u64,
}

/// What opening an update trained from an earlier version of an asynchronous task needs.
#[derive(Clone, Serialize, Deserialize, PartialEq)]
pub struct EarlierVersion {
    pub round: u64,
    /// The version's X25519 secret (hex).
    pub secret: String,
    pub base_model: ModelDigest,
}

impl fmt::Debug for EarlierVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EarlierVersion")
            .field("round", &self.round)
            .field("secret", &Redacted)
            .field("base_model", &self.base_model)
            .finish()
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ClientRecord {
    pub secret_hash: String,
    pub label: Option<String>,
    pub enrolled_unix_ms: u64,
    pub revoked: bool,
    /// The Ed25519 identity key (hex) the client registered at enrolment; it signs the keys
    /// the client advertises in secure aggregation.
    #[serde(default)]
    pub identity_key: Option<String>,
    /// The tasks this client may use; None: every task.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tasks: Option<Vec<String>>,
    /// A regional aggregator: its updates may stand for several clients.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub aggregator: bool,
    /// An aggregator's cap on the clients one update may stand for (None: the server's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_contributors: Option<u64>,
    /// Updates of this client refused in a row as invalid or out of bounds (an accepted one
    /// starts the count again).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub strikes: u32,
    /// Why and since when the client is quarantined: refused everything until released.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quarantined: Option<Quarantine>,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// A client's quarantine: after `--quarantine-after` refused updates in a row.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Quarantine {
    pub since_unix_ms: u64,
    pub reason: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EnrolmentRecord {
    pub expires_unix_ms: u64,
    /// The tasks the enrolled client may use; None: every task.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tasks: Option<Vec<String>>,
    /// The enrolled client is a regional aggregator.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub aggregator: bool,
    /// Its cap on the clients one update may stand for (None: the server's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_contributors: Option<u64>,
}

/// Which published round models are kept: the last `last` rounds and every `every`th round (0
/// turns either off; both 0 keeps everything). The current global model and the task's initial
/// model are always kept.
///
/// And how much of the history keeps its detail: entries of rounds more than `detail` rounds
/// behind are compacted ([`RoundRecord::compact`](hora_common::wire::RoundRecord::compact): their per-client lists give way to their
/// lengths), so a task's history grows by a small constant per round, whatever its number of
/// participants; 0 keeps every entry whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    pub last: u64,
    pub every: u64,
    pub detail: u64,
}

impl Default for Retention {
    fn default() -> Self {
        Retention {
            last: 50,
            every: 10,
            detail: 1000,
        }
    }
}

impl Retention {
    /// Whether round `round`'s model is kept once `published` rounds are published.
    pub fn keeps(&self, round: u64, published: u64) -> bool {
        (self.last == 0 && self.every == 0)
            || round + self.last > published
            || (self.every > 0 && round % self.every == 0)
    }

    /// The rounds up to which history entries are compacted once `published` rounds are out
    /// (0: none).
    pub fn compacted_upto(&self, published: u64) -> u64 {
        match self.detail {
            0 => 0,
            d => published.saturating_sub(d),
        }
    }
}

/// A synchronous allreduce job as stored: its definition and how many worlds it has formed. The
/// world being formed is never stored (see `rendezvous`): after a restart, workers join again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SyncJobRecord {
    pub id: String,
    pub world_size: u32,
    /// SHA-256 of the job's bearer token (hex), as for the admin token.
    pub token_hash: String,
    /// Worlds formed so far.
    pub generations: u64,
    /// An elastic job's smallest world and quiet time (see `CreateSyncJob`); `None`: a fixed
    /// world of `world_size`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub elastic: Option<ElasticSyncJob>,
    /// Its workers said its training finished: it forms no more worlds.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub finished: bool,
}

/// An elastic job's terms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ElasticSyncJob {
    pub min_world_size: u32,
    pub settle_ms: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_open_rounds_debug_never_shows_its_secrets() {
        let secret = "5ec7e75ec7e75ec7e75ec7e75ec7e75ec7e75ec7e75ec7e75ec7e75ec7e75ec7";
        let earlier = "ea71e7ea71e7ea71e7ea71e7ea71e7ea71e7ea71e7ea71e7ea71e7ea71e7ea71";
        let record = OpenRoundRecord {
            round: 3,
            attempt: 1,
            secret: secret.into(),
            base_model: ModelDigest([7; 32]),
            opened_unix_ms: 1,
            deadline_unix_ms: 2,
            selected: vec!["c-1".into()],
            checkpoint: None,
            earlier: vec![EarlierVersion {
                round: 2,
                secret: earlier.into(),
                base_model: ModelDigest([8; 32]),
            }],
            slots: Vec::new(),
            merged: Vec::new(),
        };
        let shown = format!("{record:?}");
        assert!(!shown.contains(secret), "{shown}");
        assert!(!shown.contains(earlier), "{shown}");
        assert_eq!(shown.matches("<redacted>").count(), 2, "{shown}");
        assert!(
            shown.contains("round: 3") && shown.contains("c-1"),
            "{shown}"
        );
    }
}
