//! The seam between the round engine and a round mode: how a round's updates come in.
//!
//! The engine ([`super`]) owns everything every mode shares — selection, the running sum and its
//! checkpoints, the deadline watcher, closing and publishing. A [`Collection`] answers the few
//! questions on which modes differ: may this client join now, what does its offer carry, how do
//! updates arrive, when must the watcher look next and what happens then, and what the mode
//! keeps in the store. [`super::plain::PlainCollection`] takes sealed uploads,
//! [`super::secure::SecureCollection`] runs secure aggregation's stages and
//! [`super::asynchronous::AsyncCollection`] buffers updates trained from whichever version each
//! client pulled; a new mode is one more implementation.

use std::sync::Arc;

use hora_common::wire::{CreateTask, SecAggOffer, VersionStaleness};
use tokio::sync::watch;

use hora_common::kernel::WeightedSum;

use super::asynchronous::AsyncCollection;
use super::{Ending, Round};
use crate::error::ServerError;
use crate::secagg::SecAggRound;
use crate::store::{Contribution, OpenRoundRecord, Store, TaskRecord};

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
    },
}

/// How a round's updates come in. One implementation per round mode.
pub trait Collection: Send + Sync {
    /// The mode's name, for logs and refusals.
    fn mode(&self) -> &'static str;

    /// Whether `client` may join now: `Ok(false)` tells it to come back later, an error refuses
    /// it for good (it cannot take part in this mode as it is).
    fn admit_join(&self, _store: &Store, _task: &str, _client: &str) -> Result<bool, ServerError> {
        Ok(true)
    }

    /// What a round offer carries for this mode.
    fn offer(&self) -> Option<SecAggOffer> {
        None
    }

    /// Refuses a sealed upload unless that is how this mode's updates arrive.
    fn check_sealed_upload(&self, _task: &str) -> Result<(), ServerError> {
        Ok(())
    }

    /// When the deadline watcher must next look at the round (Unix ms).
    fn next_deadline(&self, round: &Round) -> u64;

    /// Changes that move [`Collection::next_deadline`] early (a stage that closed).
    fn changes(&self) -> Option<watch::Receiver<u64>> {
        None
    }

    /// What is due now that the round's deadline has passed. Blocking (it may write the store).
    fn at_deadline(&self, store: &Store) -> Result<Step, ServerError>;

    /// The ending a failed close must retry: `None` when the round can collect on (and closes
    /// again when full or at its deadline), `Some` when the mode can take nothing more.
    fn retry_after_failed_close(&self, ending: Ending) -> Option<Ending>;

    /// The round's example count for its history.
    fn examples(&self, contributions: &[Contribution], _sum: &WeightedSum) -> u64 {
        contributions
            .iter()
            .fold(0u64, |sum, c| sum.saturating_add(c.examples))
    }

    /// The task was resumed after a pause: whether the round gets a whole deadline again (and
    /// closes at once if it is full).
    fn restarts_on_resume(&self) -> bool;

    /// Stores what a new attempt of this mode needs to survive a restart (and drops what an
    /// older attempt stored).
    fn persist_new(&self, _store: &Store) -> Result<(), ServerError> {
        Ok(())
    }

    /// Drops what the mode stored for `task` once its rounds are over.
    fn clear(&self, _store: &Store, _task: &str) -> Result<(), ServerError> {
        Ok(())
    }

    /// A file the mode wrote for the round, removed once the round has closed.
    fn leftover_file(&self) -> Option<String> {
        None
    }

    /// The secure-aggregation protocol of the round, when that is its mode.
    fn secure(&self) -> Option<&Arc<SecAggRound>> {
        None
    }

    /// The asynchronous collection, when that is the round's mode.
    fn asynchronous(&self) -> Option<&AsyncCollection> {
        None
    }

    /// How many updates make the round full (it closes then, before its deadline).
    fn full_at(&self, config: &CreateTask) -> usize {
        config.target_clients as usize
    }

    /// How stale the updates that make version `version` were, for its history.
    fn staleness(
        &self,
        _version: u64,
        _contributions: &[Contribution],
    ) -> Option<VersionStaleness> {
        None
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
) -> Result<(Arc<dyn Collection>, u64), ServerError> {
    let deadline = now + record.config.round_deadline_secs * 1000;
    if let Some(config) = &record.config.asynchronous {
        let collection = match previous.filter(|p| p.asynchronous().is_some()) {
            Some(p) => p.clone(),
            None => Arc::new(AsyncCollection::new(record, config)),
        };
        return Ok((collection, deadline));
    }
    Ok(match &record.config.secure_aggregation {
        Some(config) => {
            let s = super::secure::SecureCollection::new(record, config, number, attempt, now)?;
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
) -> Result<Arc<dyn Collection>, ServerError> {
    if let Some(config) = &record.config.asynchronous {
        return Ok(Arc::new(AsyncCollection::resume(
            store, record, config, open,
        )?));
    }
    Ok(match &record.config.secure_aggregation {
        Some(config) => Arc::new(super::secure::SecureCollection::resume(
            store, record, config, open,
        )?),
        None => Arc::new(super::plain::PlainCollection),
    })
}
