//! Durable state, behind one narrow trait per consumer.
//!
//! The server holds one `Arc<dyn `[`Storage`]`>`; each part of it uses only the slice it needs:
//!
//! - [`RoundLog`]: tasks, the round each has open, finishing a round, round history and the
//!   pruning of old round models (the coordinator);
//! - [`Blobs`]: global models, TorchScript modules, strategy state files, accumulator
//!   checkpoints and secure aggregation's masked sums (the coordinator, secure aggregation, the
//!   model and module downloads, the admin uploads);
//! - [`Registry`]: clients and one-time enrolment tokens (authentication, the admin API);
//! - [`SyncJobs`]: synchronous allreduce jobs (the rendezvous);
//! - [`SecaggLog`]: secure-aggregation protocol records, as bytes (typed access, JSON, is on
//!   `dyn Storage`: `secagg_get`, `secagg_put`, `secagg_scan`);
//! - [`Housekeeping`]: what `serve` does at start (the orphan sweep, server-wide settings).
//!
//! Each that keeps records extends [`Durable`], whose [`flush`](Durable::flush) makes every record
//! written so far durable (blobs are durable once written).
//!
//! Three implementations: [`SledStore`], the server's default, over one data directory;
//! [`PostgresStore`] (`--store postgres://…`), records in PostgreSQL for replicas sharing them;
//! and [`MemoryStore`], for tests, which keeps records in memory. Each keeps its blobs in a
//! [`BlobStore`] (`blobs/`): files under the data directory ([`DirBlobs`], the default) or an
//! object store ([`ObjectBlobs`], `--blobs file:///…` or `s3://…`, which replicas share). One
//! conformance suite (`conformance/`) holds every store, on every blob store, to the same
//! contracts.
//!
//! # The data directory ([`SledStore`]; [`PostgresStore`] without `db/`; an object store
//! holds the same `blobs/` and `checkpoints/` keys under its prefix)
//!
//! ```text
//! <data>/db/                      sled: tasks, open rounds, round history, clients, enrolments,
//!                                 sync jobs, secure-aggregation records, meta
//! <data>/blobs/models/<hex>.safetensors   global models, content-addressed by model digest
//! <data>/blobs/modules/<hex>.pt           TorchScript modules, by SHA-256 of their bytes
//! <data>/blobs/strategy/<hex>.state      stateful strategies' state (see `strategy::state`),
//!                                         a fresh name, SHA-256 trailer; one per task, the current
//! <data>/checkpoints/<hex>.ckpt   round accumulators (f64 sums), a fresh name, SHA-256 trailer
//! <data>/checkpoints/<hex>.msum   secure aggregation's masked sums (u32), by SHA-256 of their bytes
//! ```
//!
//! Blobs are written atomically and durably (see [`blobs`]: a temporary file, fsync, rename,
//! fsync of the directory; or an object store's put); only then is the record that refers to
//! them written and flushed. So a record never points at a torn blob, and a crash leaves at
//! worst an unreferenced one, which [`Housekeeping::sweep_orphans`] removes at start. Records are JSON (small, and readable when an
//! operator has to look). Nothing here ever holds a client's individual update: checkpoints are
//! sums of several.

use std::collections::HashSet;

use hora_common::model::ModelDigest;
use hora_common::wire::{EvaluationSummary, RoundRecord};
use serde::{de::DeserializeOwned, Deserialize, Serialize};

pub mod blobs;
#[cfg(test)]
mod conformance;
pub(crate) mod files;
mod memory;
pub mod postgres;
mod records;
mod sled;

pub use self::blobs::{BlobKind, BlobLocation, BlobRetry, BlobStore, Blobs, DirBlobs, ObjectBlobs};
pub use self::files::le_words;
pub(crate) use self::files::short_or_carried;
pub use self::memory::{link_tree, MemoryStore};
pub use self::postgres::PostgresStore;
pub use self::records::*;
pub use self::sled::SledStore;

/// Where the records live, as `--store` says: `sled` (the default, embedded, under the data
/// directory) or a PostgreSQL URL. Blobs are where `--blobs` says ([`BlobLocation`]), files
/// under the data directory by default, whichever keeps the records.
#[derive(Debug, Clone, Default)]
pub enum StoreLocation {
    #[default]
    Sled,
    Postgres(Box<postgres::Target>),
}

impl std::str::FromStr for StoreLocation {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if s == "sled" {
            Ok(StoreLocation::Sled)
        } else if s.starts_with("postgres://") || s.starts_with("postgresql://") {
            Ok(StoreLocation::Postgres(Box::new(s.parse()?)))
        } else {
            Err(format!(
                "unknown store `{}`: give `sled` (the embedded store under the data directory, the default) or postgres://user:password@host:port/database",
                s.split("://").next().unwrap_or_default()
            ))
        }
    }
}

impl StoreLocation {
    /// Opens the store, its blobs where `blobs` says (under `data_dir` by default); a
    /// PostgreSQL store waits to lead, with the default lease (see [`open_leading`]).
    ///
    /// [`open_leading`]: StoreLocation::open_leading
    pub fn open(
        &self,
        data_dir: &std::path::Path,
        blobs: &BlobLocation,
    ) -> Result<std::sync::Arc<Store>, StoreError> {
        let lease = postgres::LeaseSettings::new(
            postgres::Replica::this("(embedded)"),
            std::time::Duration::from_secs(10),
        );
        self.open_leading(data_dir, blobs, &lease, &|| false)
    }

    /// Opens the store, its blobs where `blobs` says (under `data_dir` by default). A
    /// PostgreSQL store is opened to lead: this waits, standing by, until the database's lease
    /// is this replica's (see `postgres::lease`), or until `give_up` says to stop.
    pub fn open_leading(
        &self,
        data_dir: &std::path::Path,
        blobs: &BlobLocation,
        lease: &postgres::LeaseSettings,
        give_up: &dyn Fn() -> bool,
    ) -> Result<std::sync::Arc<Store>, StoreError> {
        let apart = !matches!(blobs, BlobLocation::DataDir);
        let blobs = blobs.open(data_dir)?;
        let store: std::sync::Arc<Store> = match self {
            StoreLocation::Sled => std::sync::Arc::new(SledStore::open_with(data_dir, blobs)?),
            StoreLocation::Postgres(target) => {
                let lease = postgres::LeaseSettings {
                    shared_blobs: apart,
                    ..lease.clone()
                };
                let opened = PostgresStore::open_with(target, blobs)?;
                if !apart {
                    // Files of this data directory: standing by is worth it only if they are
                    // the records'.
                    self::blobs::check_unshared(&opened)?;
                }
                std::sync::Arc::new(opened.claim(&lease, give_up)?)
            }
        };
        // Blobs apart from their records, or records that other replicas share: tied together.
        if apart || matches!(self, StoreLocation::Postgres(_)) {
            self::blobs::bind(&*store)?;
        }
        Ok(store)
    }
}

impl StoreLocation {
    /// Opens the store for a replica that serves without leading (see `round::replicas`): a
    /// PostgreSQL store with its blobs where every replica reaches them (`--blobs`), tied to
    /// its records already by the replica that led first. None for any other store: its
    /// replicas stand by.
    pub fn open_following(
        &self,
        data_dir: &std::path::Path,
        blobs: &BlobLocation,
        lease: std::time::Duration,
    ) -> Result<Option<std::sync::Arc<Store>>, StoreError> {
        let StoreLocation::Postgres(target) = self else {
            return Ok(None);
        };
        if matches!(blobs, BlobLocation::DataDir) {
            return Ok(None);
        }
        let store: std::sync::Arc<Store> = std::sync::Arc::new(
            PostgresStore::open_with(target, blobs.open(data_dir)?)?.with_lease(lease),
        );
        self::blobs::check_tied(&*store)?;
        Ok(Some(store))
    }
}

/// What a store's change feed says (see [`RoundLog::changes`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreChange {
    /// A change to this task, its open round or its history was committed (by this server or
    /// another on the same database).
    Task(String),
    /// Changes may have gone unheard (the feed lost its connection and has it back): re-read
    /// whatever is watched. A subscriber that lagged (`RecvError::Lagged`) is in the same spot.
    Missed,
}

/// The lease a replica leads under ([`Housekeeping::lease`]).
pub struct LeaseWatch {
    /// Its fencing token.
    pub epoch: i64,
    /// Becomes the reason once the lease is lost (the server then steps down).
    pub lost: tokio::sync::watch::Receiver<Option<String>>,
}

/// What the server holds: every consumer's slice of the store.
pub trait Storage:
    RoundLog + Blobs + Registry + SyncJobs + SecaggLog + Housekeeping + Send + Sync
{
}

impl<T> Storage for T where
    T: RoundLog + Blobs + Registry + SyncJobs + SecaggLog + Housekeeping + Send + Sync
{
}

/// The store as its consumers name it: `&Store`, `Arc<Store>`.
pub type Store = dyn Storage;

/// The durability barrier every record-keeping trait shares.
pub trait Durable {
    /// Makes everything written so far durable.
    fn flush(&self) -> Result<(), StoreError>;
}

/// Tasks and their rounds.
pub trait RoundLog: Durable {
    fn task(&self, id: &str) -> Result<Option<TaskRecord>, StoreError>;

    /// Every task, each read on its own: one corrupt record does not hide the others.
    fn tasks_each(&self) -> Result<Vec<TaskRead>, StoreError>;

    /// Every task, in id order; an error if any cannot be read.
    fn tasks(&self) -> Result<Vec<(String, TaskRecord)>, StoreError> {
        self.tasks_each()?
            .into_iter()
            .map(|(id, record)| record.map(|r| (id, r)))
            .collect()
    }

    /// Creates a task if the id is free; false if it exists (and it is left as it was).
    fn create_task(&self, id: &str, task: &TaskRecord) -> Result<bool, StoreError>;

    fn put_task(&self, id: &str, task: &TaskRecord) -> Result<(), StoreError>;

    fn open_round(&self, task: &str) -> Result<Option<OpenRoundRecord>, StoreError>;

    fn put_open_round(&self, task: &str, round: &OpenRoundRecord) -> Result<(), StoreError>;

    /// Records a finished round and moves the task on, in one transaction: writes `task`, adds
    /// `record` to the history (under its round and `attempt`), and replaces the open round with
    /// `next` (or removes it). Either all of it is durable after the next flush or none of it.
    fn finish_round(
        &self,
        task_id: &str,
        task: &TaskRecord,
        record: &RoundRecord,
        attempt: u32,
        next: Option<&OpenRoundRecord>,
    ) -> Result<(), StoreError>;

    /// Ends a federated evaluation, in one transaction: writes `task` (which no longer has it
    /// open) and sets `evaluation` on the history entry of `round`'s `attempt`.
    fn end_evaluation(
        &self,
        task_id: &str,
        task: &TaskRecord,
        round: u64,
        attempt: u32,
        evaluation: &EvaluationSummary,
    ) -> Result<(), StoreError>;

    /// A task's finished rounds, by round then attempt (rounds are numbered from 1).
    fn history(&self, task: &str) -> Result<Vec<RoundRecord>, StoreError> {
        self.history_page(task, 0, usize::MAX)
    }

    /// At most `limit` history entries (every attempt) of rounds after `after`, oldest first:
    /// one page, read without reading the rest of the history.
    fn history_page(
        &self,
        task: &str,
        after: u64,
        limit: usize,
    ) -> Result<Vec<RoundRecord>, StoreError>;

    /// Every attempt of round `round` of `task`, read without the rest of the history.
    fn round_attempts(&self, task: &str, round: u64) -> Result<Vec<RoundRecord>, StoreError>;

    /// Whether a history entry not yet pruned (of any task) names model `digest`. Answered
    /// without reading the histories (an index of the models they name).
    fn model_in_history(&self, digest: &ModelDigest) -> Result<bool, StoreError>;

    /// Applies `retention` to `task`'s published models now that `published` rounds are out:
    /// marks the rounds that fall out of it as pruned and deletes their model files, unless
    /// another retained round or task still uses the same model (content-addressed). Returns the
    /// number of files removed.
    fn prune_models(
        &self,
        task: &str,
        retention: Retention,
        published: u64,
    ) -> Result<usize, StoreError>;

    /// A subscription to the changes committed to tasks, their open rounds and their histories,
    /// by this server or any other on the same store; None for a store only this process writes
    /// (sled, memory), whose writers can wake their own waiters.
    fn changes(&self) -> Option<tokio::sync::broadcast::Receiver<StoreChange>> {
        None
    }

    // -- what serving replicas share of an open attempt (a store only one server uses has
    // -- none: its reads find nothing and its writes answer `NotShared`) ---------------------

    /// Whether several replicas serve from this store (each may take joins and uploads of a
    /// plain round; the leader merges their partials when it closes the attempt).
    fn shared(&self) -> bool {
        false
    }

    /// Selects `client` for attempt `attempt` of round `round` of `task` if it is the task's open
    /// attempt, not sealed, and fewer than `capacity` clients hold a place in it: durable when
    /// this returns. A client selected already keeps its place.
    fn select_client(
        &self,
        _task: &str,
        _round: u64,
        _attempt: u32,
        _client: &str,
        _capacity: usize,
    ) -> Result<SharedSelection, StoreError> {
        Err(StoreError::NotShared("selecting across replicas"))
    }

    /// Gives `client` a training slot of asynchronous task `task` for `slot_ms` from now (the
    /// store's clock), or finds the unexpired one it holds: durable when this returns. Refused
    /// while `concurrency` clients hold one, while the client's update of the open attempt
    /// (`round`, `attempt`) is claimed (it waits for the next version), and once that attempt
    /// is closing.
    #[allow(clippy::too_many_arguments)]
    fn take_slot(
        &self,
        _task: &str,
        _round: u64,
        _attempt: u32,
        _client: &str,
        _slot_ms: u64,
        _concurrency: u32,
    ) -> Result<SlotTaken, StoreError> {
        Err(StoreError::NotShared("training slots across replicas"))
    }

    /// When the unexpired training slot `client` holds for `task` lapses (Unix ms), if it holds
    /// one.
    fn training_slot(&self, _task: &str, _client: &str) -> Result<Option<u64>, StoreError> {
        Ok(None)
    }

    /// Takes `client`'s update of the attempt for `replica` (`<process's replica id>#<serving
    /// incarnation>`) to fold, unless another took it already: None when it is `replica`'s
    /// (now or before), else the other's claim. With `from` (a claim found before, whose
    /// holder is gone and holds no such update), takes it over if it is still `from`'s. With
    /// `slotted` (an asynchronous task's update), a new claim needs the client to hold a
    /// training slot ([`StoreError::NoTrainingSlot`] otherwise), which the update spends once
    /// it is durable.
    #[allow(clippy::too_many_arguments)]
    fn claim_update(
        &self,
        _task: &str,
        _round: u64,
        _attempt: u32,
        _client: &str,
        _replica: &str,
        _from: Option<&str>,
        _slotted: bool,
    ) -> Result<Option<Claim>, StoreError> {
        Err(StoreError::NotShared("taking updates across replicas"))
    }

    /// Which replica holds the claim on `client`'s update of the attempt, if one does (read
    /// only).
    fn claim_holder(
        &self,
        _task: &str,
        _round: u64,
        _attempt: u32,
        _client: &str,
    ) -> Result<Option<String>, StoreError> {
        Ok(None)
    }

    /// Records `partial` as its replica's durable partial sum of its attempt (replacing the one
    /// recorded before); [`StoreError::AttemptSealed`] once the attempt is closing or closed,
    /// [`StoreError::ClaimLost`] when the claim on one of the `fresh` clients' updates (those
    /// not in its replica's last partial) is no longer the replica's.
    fn put_partial(
        &self,
        _task: &str,
        _partial: &ReplicaPartial,
        _fresh: &[String],
    ) -> Result<(), StoreError> {
        Err(StoreError::NotShared("partial sums of replicas"))
    }

    /// Seals the attempt (no replica selects or records a partial for it from now on) and
    /// returns every replica's partial of it. The leader's, when it closes the attempt.
    fn seal_partials(
        &self,
        _task: &str,
        _round: u64,
        _attempt: u32,
    ) -> Result<Vec<ReplicaPartial>, StoreError> {
        Ok(Vec::new())
    }

    /// Whether a seal covers attempt `attempt` of round `round` of `task`: a leader began
    /// closing it (no replica records anything more for it).
    fn sealed(&self, _task: &str, _round: u64, _attempt: u32) -> Result<bool, StoreError> {
        Ok(false)
    }

    /// Every partial recorded for `task`'s attempts (their blobs are in use).
    fn partials(&self, _task: &str) -> Result<Vec<ReplicaPartial>, StoreError> {
        Ok(Vec::new())
    }
}

/// Clients and enrolment.
pub trait Registry: Durable {
    fn client(&self, id: &str) -> Result<Option<ClientRecord>, StoreError>;

    /// Every client, in id order.
    fn clients(&self) -> Result<Vec<(String, ClientRecord)>, StoreError>;

    fn put_client(&self, id: &str, c: &ClientRecord) -> Result<(), StoreError>;

    /// Changes client `id` in place, atomically with respect to every other write of it (a
    /// strike never undoes a revocation made meanwhile); the record as changed, or None if
    /// there is no such client. `change` may run more than once.
    fn update_client(
        &self,
        id: &str,
        change: &mut dyn FnMut(&mut ClientRecord),
    ) -> Result<Option<ClientRecord>, StoreError>;

    fn put_enrolment(&self, token_hash: &str, e: &EnrolmentRecord) -> Result<(), StoreError>;

    /// The enrolment of a token, still unspent.
    fn enrolment(&self, token_hash: &str) -> Result<Option<EnrolmentRecord>, StoreError>;

    /// Spends an enrolment and creates client `id` in one transaction: a token works once, and
    /// is spent only by the enrolment that creates a client. Returns the spent enrolment, or
    /// None (and changes nothing) when the token was not there (spent meanwhile) or a client
    /// `id` exists already (never replaced).
    fn enrol(
        &self,
        token_hash: &str,
        id: &str,
        client: &ClientRecord,
    ) -> Result<Option<EnrolmentRecord>, StoreError>;
}

/// Synchronous allreduce jobs.
pub trait SyncJobs: Durable {
    /// Every job, in id order.
    fn sync_jobs(&self) -> Result<Vec<SyncJobRecord>, StoreError>;

    /// Creates a sync job if the id is free; false if it exists.
    fn create_sync_job(&self, job: &SyncJobRecord) -> Result<bool, StoreError>;

    fn put_sync_job(&self, job: &SyncJobRecord) -> Result<(), StoreError>;

    /// Deletes a sync job; false if there was none.
    fn remove_sync_job(&self, id: &str) -> Result<bool, StoreError>;
}

/// Secure-aggregation attempts' protocol records, keyed `task\0kind\0client`, as bytes (the
/// records are `secagg`'s; `secagg_get`, `secagg_put` and `secagg_scan` on `dyn Storage` read
/// and write them typed).
pub trait SecaggLog: Durable {
    fn secagg_get_bytes(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError>;

    fn secagg_put_bytes(&self, key: &str, value: &[u8]) -> Result<(), StoreError>;

    /// Every record under `prefix`, keyed by what follows the prefix, in key order.
    fn secagg_scan_bytes(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, StoreError>;

    /// Forgets a task's secure-aggregation records (a new attempt starts from nothing).
    fn secagg_clear(&self, task: &str) -> Result<(), StoreError>;

    /// A serving replica's write of a stage's message: only while the record at `gate` holds
    /// exactly `open` (the leader says the stage takes messages), and only if the record at
    /// `claim`'s key is absent or already `claim`'s value (which is written with `writes`).
    /// A leader's write of `gate` waits for those in flight, so once it has changed the gate,
    /// every message of the stage is in the store. This default reads, then writes: enough for
    /// a store one server owns, whose secure-aggregation round orders its writes under its lock.
    fn secagg_put_gated(
        &self,
        gate: &str,
        open: &[u8],
        claim: (&str, &[u8]),
        writes: &[(&str, &[u8])],
    ) -> Result<Gated, StoreError> {
        if self.secagg_get_bytes(gate)?.as_deref() != Some(open) {
            return Ok(Gated::Closed);
        }
        match self.secagg_get_bytes(claim.0)? {
            Some(held) if held != claim.1 => return Ok(Gated::Taken(held)),
            Some(_) => {}
            None => self.secagg_put_bytes(claim.0, claim.1)?,
        }
        for (key, value) in writes {
            self.secagg_put_bytes(key, value)?;
        }
        Ok(Gated::Written)
    }
}

/// What [`SecaggLog::secagg_put_gated`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Gated {
    /// Written (or the claim held its value already: a repeat).
    Written,
    /// The gate is not open: nothing written.
    Closed,
    /// The claim holds another value (returned): nothing written.
    Taken(Vec<u8>),
}

/// What the server does with its store at start.
pub trait Housekeeping: Durable {
    /// A server-wide setting (the admin token's hash).
    fn meta(&self, key: &str) -> Result<Option<String>, StoreError>;

    fn put_meta(&self, key: &str, value: &str) -> Result<(), StoreError>;

    /// Deletes temporary files and blobs no record refers to. Run at start, before serving.
    /// Models and modules younger than a day are kept (an admin uploads them before creating the
    /// task); with any task unreadable, only temporary files go.
    fn sweep_orphans(&self) -> Result<usize, StoreError>;

    /// Whether the store answers now (`/readyz`): an embedded store always does; a database
    /// is asked a trivial query.
    fn ready(&self) -> Result<(), StoreError> {
        Ok(())
    }

    /// For a replica that leads under a lease (see [`StoreLocation::open`]): the lease. None
    /// for stores one server owns alone.
    fn lease(&self) -> Option<LeaseWatch> {
        None
    }

    /// Gives up leading (the server stops): the lease is handed back so a standby takes over.
    fn step_down(&self) -> Result<(), StoreError> {
        Ok(())
    }
}

/// Typed access to the secure-aggregation records (JSON).
impl<'a> dyn Storage + 'a {
    pub fn secagg_get<T: DeserializeOwned>(&self, key: &str) -> Result<Option<T>, StoreError> {
        self.secagg_get_bytes(key)?
            .map(|bytes| decode(key, &bytes))
            .transpose()
    }

    pub fn secagg_put<T: Serialize>(&self, key: &str, value: &T) -> Result<(), StoreError> {
        self.secagg_put_bytes(key, &json(value))
    }

    /// Every record under `prefix`, keyed by what follows the prefix.
    pub fn secagg_scan<T: DeserializeOwned>(
        &self,
        prefix: &str,
    ) -> Result<Vec<(String, T)>, StoreError> {
        self.secagg_scan_bytes(prefix)?
            .into_iter()
            .map(|(k, bytes)| {
                let value = decode(&format!("{prefix}{k}"), &bytes)?;
                Ok((k, value))
            })
            .collect()
    }
}

fn json<T: Serialize>(value: &T) -> Vec<u8> {
    serde_json::to_vec(value).expect("records serialise")
}

fn decode<T: DeserializeOwned>(key: &str, bytes: &[u8]) -> Result<T, StoreError> {
    serde_json::from_slice(bytes).map_err(|e| StoreError::Corrupt {
        key: key.to_string(),
        reason: e.to_string(),
    })
}

/// The blob files the records refer to, by file name.
#[derive(Default)]
struct Referenced {
    models: HashSet<String>,
    modules: HashSet<String>,
    states: HashSet<String>,
    /// Checkpoints and masked sums.
    checkpoints: HashSet<String>,
}

/// What every task's records refer to; None when some task cannot be read, as then nobody can
/// tell its blobs from orphans.
fn referenced(
    store: &(impl RoundLog + SecaggLog + ?Sized),
) -> Result<Option<Referenced>, StoreError> {
    /// The one field of secure aggregation's state record (and of a replica's masked partial
    /// sum's) the sweep needs.
    #[derive(Deserialize)]
    struct SecaggState {
        sum_file: Option<String>,
    }
    let mut readable = Vec::new();
    for (id, task) in store.tasks_each()? {
        match task.and_then(|t| Ok((t, store.history(&id)?, store.open_round(&id)?))) {
            Ok(parts) => readable.push((id, parts)),
            Err(_) => return Ok(None),
        }
    }
    let mut refs = Referenced::default();
    for (id, (task, history, open)) in readable {
        for model in task.own_models() {
            refs.models
                .insert(format!("{}.safetensors", model.to_hex()));
        }
        // Only the current state: the previous one is deleted once its successor is
        // published, so any other state file is a leftover of a crash.
        refs.states.extend(task.strategy_state.clone());
        if let hora_common::wire::ModelKind::TorchScript { module_digest } = &task.config.model {
            refs.modules.insert(format!("{module_digest}.pt"));
        }
        for r in history {
            if let Some(d) = r.model.filter(|_| !r.pruned) {
                refs.models.insert(format!("{}.safetensors", d.to_hex()));
            }
        }
        if let Some(c) = open.and_then(|open| open.checkpoint) {
            refs.checkpoints.insert(c.file);
        }
        for p in store.partials(&id)? {
            refs.checkpoints.insert(p.file);
        }
        let key = format!("{id}\0state\0");
        if let Some(bytes) = store.secagg_get_bytes(&key)? {
            let state: SecaggState = decode(&key, &bytes)?;
            refs.checkpoints.extend(state.sum_file);
        }
        // (Replicas' masked sums of an attempt, beside the leader's.)
        let parts = format!("{id}\0part\0");
        for (replica, bytes) in store.secagg_scan_bytes(&parts)? {
            let part: SecaggState = decode(&format!("{parts}{replica}"), &bytes)?;
            refs.checkpoints.extend(part.sum_file);
        }
    }
    Ok(Some(refs))
}

/// The second half of [`RoundLog::prune_models`]: deletes the files of `dropped` models (just
/// marked pruned) that no task and no unpruned round still uses.
pub(crate) fn remove_unused_models(
    store: &(impl RoundLog + Blobs + ?Sized),
    dropped: Vec<ModelDigest>,
) -> Result<usize, StoreError> {
    if dropped.is_empty() {
        return Ok(0);
    }
    // The tasks' own models, then the history's index: the cost does not grow with the
    // history, so the 100,000th publication of a task prunes as cheaply as the 10th.
    let mut in_use = HashSet::new();
    for (_, t) in store.tasks_each()? {
        let Ok(t) = t else {
            return Ok(0); // an unreadable task may use any model: delete nothing
        };
        in_use.extend(t.own_models());
    }
    for digest in &dropped {
        if store.model_in_history(digest)? {
            in_use.insert(*digest);
        }
    }
    // The records that stopped naming these models are durable before any file goes: a crash in
    // between must not leave a record that names a deleted model.
    store.flush()?;
    let mut removed = 0;
    for digest in dropped.into_iter().filter(|d| !in_use.contains(d)) {
        if store.remove_model(&digest).unwrap_or(false) {
            removed += 1;
        }
    }
    Ok(removed)
}
