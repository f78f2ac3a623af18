//! The seam between the round engine and a round mode: how a round's clients are admitted and
//! how their updates come in.
//!
//! The engine ([`super`]) owns everything every mode shares — the long poll, the upload path
//! (envelope, validation, update bounds), the running sum and its checkpoints, the deadline
//! watcher, closing and publishing. A [`Collection`] carries every step on which modes differ:
//! joining and selection, a client's standing, the upload check and the fold, when a waiting
//! client should come back, the keys updates are sealed to, what happens when an attempt closes,
//! which models are retained, and what the mode keeps in the store. Each step's default is the
//! plain mode's ([`super::plain`]); [`super::plain::PlainCollection`] takes them all,
//! [`super::secure::SecureCollection`] runs secure aggregation's stages and
//! [`super::asynchronous::AsyncCollection`] buffers updates trained from whichever version each
//! client pulled. The engine never asks which mode a round is in: a new mode is one more
//! implementation.

use std::collections::BTreeSet;
use std::sync::Arc;

use hora_common::codec::Update;
use hora_common::envelope::RoundSecretKey;
use hora_common::kernel::WeightedSum;
use hora_common::model::ModelDigest;
use hora_common::wire::{self, CreateTask, ErrorCode, SecAggOffer, VersionStaleness};
use tokio::sync::watch;

use super::asynchronous::AsyncCollection;
use super::upload::Admission;
use super::{jitter, now_ms, plain, Coordinator, Ending, Round, Task};
use crate::error::ServerError;
use crate::metrics::ServerMetrics;
use crate::secagg::{SecAggRound, Sharing};
use crate::store::{Contribution, OpenRoundRecord, Retention, Store, TaskRecord};

/// What the deadline watcher (or a mode's own message) does to a round.
#[derive(Debug)]
pub enum Step {
    /// Nothing ends yet (a stage moved on: waiters are woken).
    Continue,
    /// Close the round with this ending.
    End(Ending),
    /// The mode computed the round's sum itself (secure aggregation unmasks it): install it as
    /// the round's sum, with the clients in it, and close to publish.
    Sum {
        values: Vec<f64>,
        total_weight: u64,
        contributors: Vec<String>,
        /// The sums of the contributors' evaluations of round `.0`'s model, which their inputs
        /// carried (secure aggregation's federated evaluation).
        evaluation: Option<(u64, wire::EvaluationSums)>,
    },
}

/// What a join decided.
pub enum Joined {
    /// Not now: come back after the task's retry interval.
    Wait,
    /// Selected: `answer` goes out once the round's first `upto` selections are durable (a
    /// selected client's upload is never refused as `not_selected` after a crash).
    Selected {
        round: Arc<Round>,
        upto: usize,
        answer: Box<wire::JoinResponse>,
    },
}

impl Joined {
    /// Selected for `round`, offered until `until` (Unix ms): answered once its first `upto`
    /// selections are durable (0: durable already).
    pub fn offered(round: &Arc<Round>, record: &TaskRecord, until: u64, upto: usize) -> Joined {
        Joined::Selected {
            round: round.clone(),
            upto,
            answer: Box::new(wire::JoinResponse {
                offer: Some(round.offer(record, until)),
                retry_after_ms: 0,
            }),
        }
    }
}

/// The answer to an update of a mode that [carries over](Collection::carries_over) whose
/// version `number` took no more updates before this replica recorded it (`why`): 503, sent
/// again, it goes into the next version.
pub fn send_again(number: u64, why: &str) -> ServerError {
    ServerError::unavailable(
        ErrorCode::RoundClosed,
        format!(
            "version {number} {why}; send the same upload again: it goes into the next version"
        ),
    )
}

/// Where an update went: the round it was folded into (an asynchronous buffer that closed
/// meanwhile hands it to the next), its index there, and whether it was folded now (false: a
/// retry that raced its own first attempt, answered as that one is).
pub struct Folded {
    pub round: Arc<Round>,
    pub index: usize,
    pub now: bool,
}

/// An update opened and checked by the upload path, ready to fold.
pub struct Opened<'a> {
    /// The contribution as the round's record will list it.
    pub update: Contribution,
    /// The version whose key the update was sealed to (the one it was trained from).
    pub sealed: u64,
    /// Its weight in the sum (its example count, or 1 under central DP).
    pub weight: f64,
    /// What the task's norm bound (or DP clipping) scales it by.
    pub scale: f64,
    pub view: &'a Update<'a>,
}

/// How a round's clients take part. One implementation per round mode; every step defaults to
/// the plain mode's.
pub trait Collection: Send + Sync {
    /// The mode's name, for logs and refusals.
    fn mode(&self) -> &'static str;

    // -- joining ------------------------------------------------------------------------------

    /// Whether `client` may join now: `Ok(false)` tells it to come back later, an error refuses
    /// it for good (it cannot take part in this mode as it is).
    fn admit_join(&self, _store: &Store, _task: &str, _client: &str) -> Result<bool, ServerError> {
        Ok(true)
    }

    /// Selects `client` for `round` if there is room. Blocking (it takes the round's lock and
    /// may read the store).
    fn select(
        &self,
        engine: &Coordinator,
        task: &Task,
        record: &TaskRecord,
        round: &Arc<Round>,
        client: &str,
    ) -> Result<Joined, ServerError> {
        if !self.admit_join(engine.store(), &task.id, client)? {
            return Ok(Joined::Wait);
        }
        match engine.store().shared() {
            true => engine.select_shared(task, record, round, client),
            false => plain::select(task, record, round, client),
        }
    }

    /// Whether `client`, refused as not selected by this replica's copy of `round`, holds a
    /// place that another replica gave it (the store says); if so, the copy learns it.
    /// Blocking.
    fn selected_elsewhere(
        &self,
        engine: &Coordinator,
        task: &Task,
        round: &Round,
        client: &str,
    ) -> Result<bool, ServerError> {
        engine.selected_in_store(task, round, client)
    }

    /// Whether the round's sum is the merge of the replicas' durable partials of it (see
    /// [`super::replicas`]), sealed and merged by the leader's close. A mode that sums what
    /// the replicas took itself (secure aggregation, at its stages) says no.
    fn merges_partials(&self) -> bool {
        true
    }

    /// Whether a client's update spends a training slot it holds in the store (taken when it
    /// joined, at any replica): a claim on an update across replicas needs one.
    fn spends_slots(&self) -> bool {
        false
    }

    /// Whether an update that a replica folded into a round the leader closed before the
    /// replica recorded it may go into a later round: its client is asked to send it again
    /// (503) rather than told it missed the round.
    fn carries_over(&self) -> bool {
        false
    }

    /// The leader merged other replicas' partials of `round` into its sum: their updates, now
    /// the round's too.
    fn merged(&self, _round: &Round, _contributions: &[Contribution]) {}

    /// What a round offer carries for this mode.
    fn offer(&self) -> Option<SecAggOffer> {
        None
    }

    /// Whether `client` is selected (holds a place to train) in `round`, and whether its update
    /// is in. Never waits on the round's accumulator.
    fn standing(&self, round: &Round, client: &str) -> (bool, bool) {
        round.standing(client)
    }

    /// How many clients are selected (training) now, for the task's status.
    fn selected(&self, round: &Round) -> usize {
        round.counts().0
    }

    /// The round's stage, for the task's status, where the mode has stages.
    fn stage(&self) -> Option<String> {
        None
    }

    /// How long a client that is not selected now waits before asking again (jittered, so that
    /// waiting clients do not come back as one herd).
    fn retry_after_ms(&self, round: &Round) -> u64 {
        jitter(round.deadline().saturating_sub(now_ms()).clamp(500, 60_000))
    }

    // -- uploads ------------------------------------------------------------------------------

    /// The checks a sealed upload of `client`, trained for round (or version) `number`, must
    /// pass before its body is worth reading. Blocking (it may take the round's lock).
    fn check_upload(
        &self,
        _task: &Task,
        round: &Arc<Round>,
        client: &str,
        number: u64,
    ) -> Result<Admission, ServerError> {
        plain::check_upload(round, client, number)
    }

    /// Folds an opened update into the round (or, for a mode whose rounds take updates from
    /// earlier ones, into whichever is open now). Blocking.
    fn fold(
        &self,
        _engine: &Coordinator,
        _task: &Task,
        round: &Arc<Round>,
        opened: Opened<'_>,
    ) -> Result<Folded, ServerError> {
        plain::fold(round, opened)
    }

    /// Reports the mode's own gauges, now that the open round holds `buffered` updates.
    fn report(&self, _metrics: &ServerMetrics, _task: &str, _buffered: usize) {}

    /// The protocol a secure-aggregation message takes part in, if this is that mode.
    fn secure_aggregation(&self, task: &str) -> Result<Arc<SecAggRound>, ServerError> {
        Err(ServerError::conflict(
            ErrorCode::NotSecureAggregation,
            format!("task `{task}` does not use secure aggregation"),
        ))
    }

    // -- keys and models ----------------------------------------------------------------------

    /// The key a new attempt of round `number` must keep (updates were sealed to it already),
    /// if any; a fresh key otherwise.
    fn attempt_key(&self, _number: u64) -> Option<RoundSecretKey> {
        None
    }

    /// Whether clients may still download `digest`, an earlier global model (to train from it).
    fn serves(&self, _digest: &ModelDigest) -> bool {
        false
    }

    /// Which published models are kept, given the server's policy.
    fn retention(&self, policy: Retention) -> Retention {
        policy
    }

    // -- the watcher and the close ------------------------------------------------------------

    /// When the deadline watcher must next look at the round (Unix ms).
    fn next_deadline(&self, round: &Round) -> u64 {
        round.deadline()
    }

    /// Brings [`Collection::next_deadline`] to now (see [`Coordinator::expire_round`]).
    fn expire(&self, round: &Round) {
        round.set_deadline(now_ms());
    }

    /// Changes that move [`Collection::next_deadline`] early (a stage that closed).
    fn changes(&self) -> Option<watch::Receiver<u64>> {
        None
    }

    /// What is due now that another replica changed the round's records in the store it
    /// shares (its stage messages, or the leader's). Blocking.
    fn followed(&self, _store: &Store) -> Result<Step, ServerError> {
        Ok(Step::Continue)
    }

    /// What is due now that the round's deadline has passed. Blocking (it may write the store).
    fn at_deadline(&self, _store: &Store) -> Result<Step, ServerError> {
        // Published if it has the minimum, abandoned otherwise: the close decides.
        Ok(Step::End(Ending::Publish))
    }

    /// The ending a failed close must retry: `None` when the round can collect on (and closes
    /// again when full or at its deadline), `Some` when the mode can take nothing more.
    fn retry_after_failed_close(&self, _ending: Ending) -> Option<Ending> {
        None
    }

    /// How many updates make the round full (it closes then, before its deadline).
    fn full_at(&self, config: &CreateTask) -> usize {
        config.target_clients as usize
    }

    /// The round's example count for its history.
    fn examples(&self, contributions: &[Contribution], _sum: &WeightedSum) -> u64 {
        contributions
            .iter()
            .fold(0u64, |sum, c| sum.saturating_add(c.examples))
    }

    /// How stale the updates that make version `version` were, for its history.
    fn staleness(
        &self,
        _version: u64,
        _contributions: &[Contribution],
    ) -> Option<VersionStaleness> {
        None
    }

    /// Who the round's history lists as dropped: selected, but without an update in it.
    fn dropped(&self, selected: &BTreeSet<String>, participants: &[String]) -> Vec<String> {
        selected
            .iter()
            .filter(|c| !participants.contains(c))
            .cloned()
            .collect()
    }

    /// Whether an attempt abandoned short (too few updates by its deadline) is traced to the
    /// clients it selected that sent nothing: each earns a strike (see [`super::strikes`]).
    fn strikes_dropouts(&self) -> bool {
        true
    }

    /// `round` is closing and the attempt after it is about to open (before either is stored).
    fn retire(&self, _round: &Round) {}

    /// `round`'s close is durable: published, or abandoned.
    fn settle(&self, _round: &Round, _abandoned: bool) {}

    /// The task was resumed after a pause: whether the round gets a whole deadline again (and
    /// closes at once if it is full).
    fn restarts_on_resume(&self) -> bool {
        true
    }

    // -- the store ----------------------------------------------------------------------------

    /// Adds what the mode keeps in an open round's record (the engine fills in the rest).
    fn record(&self, _record: &mut OpenRoundRecord) {}

    /// Stores what a new attempt of this mode needs to survive a restart (and drops what an
    /// older attempt stored).
    fn persist_new(&self, _store: &Store) -> Result<(), ServerError> {
        Ok(())
    }

    /// Drops what the mode stored for `task` once its rounds are over.
    fn clear(&self, _store: &Store, _task: &str) -> Result<(), ServerError> {
        Ok(())
    }

    /// Files the mode wrote for the round, removed once the round has closed.
    fn leftover_files(&self) -> Vec<String> {
        Vec::new()
    }
}

/// The collection a new attempt of `record`'s task, opened at `now` (Unix ms), uses, and the
/// attempt's deadline. `previous` is the collection of the attempt before it, if any: an
/// asynchronous task keeps one collection for all its versions.
pub fn for_new_attempt(
    record: &TaskRecord,
    number: u64,
    attempt: u32,
    now: u64,
    previous: Option<&Arc<dyn Collection>>,
    sharing: Option<Sharing>,
    graph_seed: Option<u64>,
) -> Result<(Arc<dyn Collection>, u64), ServerError> {
    let deadline = now + record.config.round_deadline_secs * 1000;
    if let Some(config) = &record.config.asynchronous {
        // One collection serves every version of an asynchronous task.
        let collection = match previous {
            Some(p) => p.clone(),
            None => Arc::new(AsyncCollection::new(record, config)),
        };
        return Ok((collection, deadline));
    }
    Ok(match &record.config.secure_aggregation {
        Some(config) => {
            let s = super::secure::SecureCollection::new(
                record, config, number, attempt, now, sharing, graph_seed,
            )?;
            // Under secure aggregation the round's deadline is when masked inputs are due.
            let deadline = s.round().latest_input_deadline_unix_ms;
            (Arc::new(s), deadline)
        }
        None => (Arc::new(super::plain::PlainCollection), deadline),
    })
}

/// The collection of an attempt resumed after a restart.
pub fn resume(
    store: &Store,
    record: &TaskRecord,
    open: &OpenRoundRecord,
    sharing: Option<Sharing>,
) -> Result<Arc<dyn Collection>, ServerError> {
    if let Some(config) = &record.config.asynchronous {
        return Ok(Arc::new(AsyncCollection::resume(
            store, record, config, open,
        )?));
    }
    Ok(match &record.config.secure_aggregation {
        Some(config) => Arc::new(super::secure::SecureCollection::resume(
            store, record, config, open, sharing,
        )?),
        None => Arc::new(super::plain::PlainCollection),
    })
}
