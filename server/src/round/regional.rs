//! The round engine's side of a regional task (one with a `parent`, see [`crate::upstream`]):
//! its rounds open from the parent's offers, and the partial a round kept is settled once the
//! parent has it. Every change is one durable write of the task's record (and, for a new round,
//! its open-round record) under the task's writing turn.

use std::sync::Arc;

use hora_common::wire::{RoundOffer, TaskState};

use super::{lock, Coordinator, Task};
use crate::error::ServerError;
use crate::store::TaskRecord;

impl Coordinator {
    /// Opens the local round that trains for the parent's `offer` (its model stored already),
    /// if the task runs, has no round open and keeps no partial: false when it opened none.
    /// Blocking.
    pub(crate) fn open_from_parent(
        self: &Arc<Self>,
        task: &Arc<Task>,
        offer: RoundOffer,
    ) -> Result<bool, ServerError> {
        let writing = lock(&task.writing);
        let mut record = task.record();
        if task.current().is_some()
            || record.state != TaskState::Running
            || record.published >= record.config.rounds
        {
            return Ok(false);
        }
        let previous = record.global_model;
        let (parent_round, model) = (offer.round, offer.model);
        let Some(link) = record.parent.as_mut().filter(|l| l.partial.is_none()) else {
            return Ok(false);
        };
        let attempt = link.attempt;
        link.offer = Some(offer);
        record.global_model = model;
        let round = self.fresh_round(&record, record.published + 1, attempt, None)?;
        // The record first: a crash before the round is stored leaves none open, and the agent
        // joins the parent's round again (and is handed the same offer).
        self.store.put_task(&task.id, &record)?;
        self.store
            .put_open_round(&task.id, &round.record(&lock(&round.acc)))?;
        round.collection.persist_new(&*self.store)?;
        self.store.flush()?;
        tracing::info!(task = %task.id, round = round.number, attempt, parent_round, model = %model, "opened a round from the parent's");
        *lock(&task.round) = Some(round.clone());
        *lock(&task.record) = record;
        drop(writing);
        task.bump();
        self.watch(task.clone(), round);
        // The parent's previous model, once nothing names it (the records that stopped naming
        // it are durable already).
        if previous != model {
            if let Err(e) = crate::store::remove_unused_models(&*self.store, vec![previous]) {
                tracing::debug!(task = %task.id, error = %e, "the parent's previous model stays until the next start's sweep");
            }
        }
        Ok(true)
    }

    /// The partial of local round `round` went to the parent (or was lost): forget it.
    /// Blocking.
    pub(crate) fn settle_partial(&self, task: &Task, round: u64) -> Result<(), ServerError> {
        self.rewrite(task, |record| match record.parent.as_mut() {
            Some(link) if link.partial.as_ref().is_some_and(|p| p.round == round) => {
                link.partial = None;
                true
            }
            _ => false,
        })
    }

    /// The parent's task ended: so does the regional task, once it has no round open.
    /// Blocking.
    pub(crate) fn finish_regional(&self, task: &Task) -> Result<(), ServerError> {
        if task.current().is_some() {
            return Ok(());
        }
        self.rewrite(task, |record| match record.state {
            TaskState::Running | TaskState::Paused => {
                record.state = TaskState::Finished;
                record.ended_reason = Some("the parent's task ended".into());
                true
            }
            _ => false,
        })
    }

    /// Changes the task's record with `change` (which says whether it changed anything) and
    /// makes it durable, under the task's writing turn. Blocking.
    fn rewrite(
        &self,
        task: &Task,
        change: impl FnOnce(&mut TaskRecord) -> bool,
    ) -> Result<(), ServerError> {
        let _writing = lock(&task.writing);
        let mut record = task.record();
        if !change(&mut record) {
            return Ok(());
        }
        self.store.put_task(&task.id, &record)?;
        self.store.flush()?;
        *lock(&task.record) = record;
        task.bump();
        Ok(())
    }
}
