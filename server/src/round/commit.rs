//! Group commit: uploads are acknowledged only once a checkpoint that contains them is durable.
//!
//! A folded update is *pending*. Each task has its own committer, so a large model's checkpoint
//! never holds up the acknowledgements of another task. It is woken by the first pending update, waits a short
//! window for more (at least as long as the last checkpoint took: while one is written, uploads
//! queue behind the accumulator lock, so one checkpoint covers many uploads when the model is
//! large), then per round writes the sum (a blob of its own, durable), then the round's record
//! listing its contributors, flushes, and only then are those uploads acknowledged
//! ([`Coordinator::receipt`]). A failed checkpoint acknowledges nothing and is tried again a
//! second later, until one lands. The round's publication is durable too: it acknowledges whatever it contains.

use std::sync::Arc;
use std::time::{Duration, Instant};

use hora_common::wire::{self, ErrorCode};

use super::task::Unsettled;
use super::{
    lock, Accumulator, Checkpointed, Coordinator, Durability, Round, SelectionDurability, Task,
};
use crate::error::ServerError;

/// How long the committer waits before it tries a failed checkpoint again.
const RETRY: Duration = Duration::from_secs(1);

impl Coordinator {
    /// Starts `task`'s group committer, which runs until the coordinator stops.
    pub(crate) fn commit_for(self: &Arc<Self>, task: Arc<Task>) {
        let me = self.clone();
        self.background
            .spawn(async move { me.committer(task).await });
    }

    /// Group commit of one task: whenever uploads (or selections) are pending, wait a short
    /// window for more, then write one checkpoint of the open round.
    async fn committer(self: Arc<Self>, task: Arc<Task>) {
        // Checkpoints are spaced by at least the time the last one took: while one is written
        // uploads queue behind the accumulator lock, and between two of them several uploads
        // fold, so one checkpoint covers many uploads when the model is large.
        let mut last = Duration::ZERO;
        // Checkpoints failed in a row (logged at 1, 2, 4, 8, …: an outage is not a flood).
        let mut failures: u64 = 0;
        loop {
            tokio::select! {
                _ = task.commit_wanted.notified() => {}
                _ = self.stopping.cancelled() => return,
            }
            // (Acknowledged as they fold, updates have nothing to wait for together: no window,
            // not even the timer's tick of a zero-length sleep.)
            if self.config.acknowledge == super::Acknowledge::Durable {
                tokio::time::sleep(self.config.commit_window.max(last)).await;
            }
            let started = Instant::now();
            let Some(round) = task.current() else {
                continue;
            };
            let (me, t, r) = (self.clone(), task.clone(), round.clone());
            let checkpointed = crate::blocking(move || me.checkpoint(&t, &r)).await;
            last = started.elapsed();
            match checkpointed {
                Ok(()) => {
                    if failures > 0 {
                        tracing::info!(task = %task.id, failures, "a checkpoint landed again");
                        failures = 0;
                    }
                    round
                        .storage_trouble
                        .send_if_modified(|t| t.take().is_some());
                }
                Err(e) => {
                    failures += 1;
                    if failures.is_power_of_two() {
                        tracing::error!(task = %task.id, error = %e, failures, "checkpoint failed; uploads stay unacknowledged and it is tried again every second");
                    }
                    if e.code() == ErrorCode::StoreUnavailable {
                        round.storage_trouble.send_replace(Some(e.to_string()));
                    }
                    // Tried again by itself: the uploads it holds become durable once the store
                    // is back, whether or not their clients send them again.
                    task.commit_wanted.notify_one();
                    tokio::select! {
                        () = tokio::time::sleep(RETRY) => {}
                        _ = self.stopping.cancelled() => return,
                    }
                }
            }
        }
    }

    fn checkpoint(&self, task: &Task, round: &Round) -> Result<(), ServerError> {
        let mut acc = lock(&round.acc);
        if !acc.phase.is_collecting() {
            return Ok(());
        }
        if self.config.acknowledge == super::Acknowledge::OnFold {
            // Nothing outlives the store: what is folded is as durable as it will be.
            acc.durable = acc.contributions.len();
            round.durability.send_replace(Durability::Upto(acc.durable));
            selection_recorded(round, &mut acc);
            return Ok(());
        }
        // A full round's close makes its uploads durable (and sooner): no checkpoint for it,
        // unless a close has failed already.
        let updates = acc.durable < acc.contributions.len()
            && !(acc.close_requested && acc.failed_closes == 0);
        if self.follows() {
            // A follower's selections are durable as they are made (in the store), and its
            // updates in its partial: it never writes the leader's record.
            return match updates {
                true => self.checkpoint_partial(task, round, &mut acc),
                false => Ok(()),
            };
        }
        if !updates {
            return match acc.selected_durable < acc.selected.len() {
                true => self.record_selection(task, round, &mut acc),
                false => Ok(()),
            };
        }
        let started = Instant::now();
        let file = self.store.write_checkpoint(acc.sum.sum())?;
        let written = Checkpointed {
            file,
            total_weight: acc.sum.total_weight(),
            noised: acc.noised,
        };
        let old = acc.checkpoint.replace(written);
        let pending = acc.durable;
        acc.durable = acc.contributions.len();
        let record = round.record(&acc);
        let written = self
            .store
            .put_open_round(&task.id, &record)
            .and_then(|_| self.store.flush());
        if let Err(e) = written {
            // Roll back: these uploads are not durable yet.
            acc.durable = pending;
            if let Some(new) = std::mem::replace(&mut acc.checkpoint, old) {
                // A database that went away mid-commit may have committed the record naming the
                // new file: then it stays until a later checkpoint lands. Else it goes now.
                match e.may_have_landed() {
                    true => task.unsettled(Unsettled::Checkpoint(new.file)),
                    false => self.store.remove_checkpoint(&new.file),
                }
            }
            return Err(e.into());
        }
        // The record names the new file (every checkpoint has a name of its own): the previous
        // one, and any kept after writes of unknown outcome, are garbage now.
        if let Some(old) = old {
            self.store.remove_checkpoint(&old.file);
        }
        for settled in task.settled(false) {
            if let Unsettled::Checkpoint(file) = settled {
                self.store.remove_checkpoint(&file);
            }
        }
        round.durability.send_replace(Durability::Upto(acc.durable));
        selection_recorded(round, &mut acc);
        self.metrics
            .store_commit_seconds
            .observe(started.elapsed().as_secs_f64());
        tracing::debug!(task = %task.id, round = round.number, durable = acc.durable, ms = started.elapsed().as_millis() as u64, "checkpoint");
        Ok(())
    }

    /// Makes the round's selections durable when no update is pending: the open-round record
    /// (which lists them) alone, no checkpoint of the sum.
    fn record_selection(
        &self,
        task: &Task,
        round: &Round,
        acc: &mut Accumulator,
    ) -> Result<(), ServerError> {
        self.store
            .put_open_round(&task.id, &round.record(acc))
            .and_then(|_| self.store.flush())?;
        selection_recorded(round, acc);
        Ok(())
    }

    /// Acknowledges contribution `index` of `round` once a commit (or the publication) that
    /// contains it is durable — waiting at most the durability timeout, after which the client
    /// is told to retry (and its retry waits the same way; nothing is folded twice).
    pub(crate) async fn receipt(
        &self,
        round: &Arc<Round>,
        index: usize,
    ) -> Result<wire::UpdateReceipt, ServerError> {
        let mut durability = round.durability.subscribe();
        let mut trouble = round.storage_trouble.subscribe();
        // (Only trouble that comes after this upload was folded: an earlier failure's is old news
        // to it, and the next checkpoint, which holds it, may land.)
        trouble.mark_unchanged();
        let durable = durability.wait_for(|d| match d {
            Durability::Upto(n) => *n > index,
            Durability::Abandoned(_) | Durability::Ended { .. } => true,
        });
        let troubled = async {
            loop {
                if trouble.changed().await.is_err() {
                    return std::future::pending().await;
                }
                if let Some(why) = trouble.borrow_and_update().clone() {
                    return why;
                }
            }
        };
        let waited = tokio::time::timeout(self.config.durability_timeout, async {
            tokio::select! {
                // (Durable wins a tie: a receipt rather than a needless retry.)
                biased;
                durable = durable => Ok(durable),
                why = troubled => Err(why),
            }
        })
        .await
        .map_err(|_| {
            ServerError::unavailable(
                ErrorCode::NotDurableYet,
                format!(
                    "the update was accepted but is not durable after {} s (storage is slow); retry the same upload to get its receipt",
                    self.config.durability_timeout.as_secs()
                ),
            )
        })?
        .map_err(|why| {
            ServerError::unavailable(
                ErrorCode::StoreUnavailable,
                format!("the update was taken but cannot be made durable now ({why}); retry the same upload to get its receipt"),
            )
        })?;
        let outcome = waited.map(|d| d.clone()).map_err(|_| {
            ServerError::unavailable(
                ErrorCode::ShuttingDown,
                "the server is shutting down; retry the upload",
            )
        })?;
        match outcome {
            Durability::Ended { upto, why } if index >= upto && round.collection.carries_over() => {
                Err(super::collection::send_again(
                    round.number,
                    &format!("took no more updates here before this one was recorded ({why})"),
                ))
            }
            Durability::Ended { upto, why } if index >= upto => Err(ServerError::conflict(
                ErrorCode::RoundClosed,
                format!(
                    "round {} took no more updates here before this one was recorded ({why}); poll for the next round",
                    round.number
                ),
            )),
            Durability::Upto(_) | Durability::Ended { .. } => Ok(wire::UpdateReceipt {
                round: round.number,
                accepted: index as u32 + 1,
            }),
            Durability::Abandoned(reason) => Err(ServerError::conflict(
                ErrorCode::RoundAbandoned,
                format!(
                    "round {} was abandoned ({reason}); poll for the retry",
                    round.number
                ),
            )),
        }
    }
}

/// A record listing every selection of `acc` is durable now: their joins are answered.
fn selection_recorded(round: &Round, acc: &mut Accumulator) {
    acc.selected_durable = acc.selected.len();
    round
        .selection
        .send_replace(SelectionDurability::Upto(acc.selected_durable));
}
