//! Federated evaluation: a task with `evaluation` asks some clients, after a round (version) is
//! published, to evaluate its model on their held-out data.
//!
//! - **open**: the close that publishes an evaluated round opens its evaluation in the same
//!   record (`TaskRecord::evaluating`), ending the previous one first if it is still open.
//! - **offer**: a poll tells a client about the evaluation when it may take part: it has not
//!   reported yet, fewer than `clients` have, the deadline has not passed, and — per the
//!   task's settings — it did not train the round (`held_out`) and its fixed draw for the round
//!   falls within `fraction`.
//! - **report**: each report is checked, its example count bounded as an update's weight is,
//!   and folded at once into the running sums; the record with the new sums is durable before
//!   the client is answered. Reports are never kept, only the sums and who reported.
//! - **end**: once `clients` have reported, at the deadline (a watcher per evaluation), or when
//!   the next evaluation opens, the example-weighted means go into the round's history entry
//!   and the record drops the evaluation, in one store transaction.
//!
//! Secure aggregation's tasks are refused `evaluation`: their server learns nothing of any one
//! client, and a plain report would tell it more than their training does.

use std::sync::Arc;
use std::time::Duration;

use hora_common::model::ModelDigest;
use hora_common::wire::{
    self, ErrorCode, EvaluationConfig, EvaluationOffer, EvaluationReceipt, EvaluationReport,
};

use super::{lock, now_ms, Coordinator, Task};
use crate::error::ServerError;
use crate::store::{EvaluationRecord, TaskRecord};

/// What a publishing close did to its task's evaluations.
#[derive(Debug, Default)]
pub(crate) struct Moved {
    /// The evaluation the close ended (the next one began).
    pub(crate) ended: Option<EvaluationRecord>,
    /// The round and deadline of the evaluation it opened.
    pub(crate) opened: Option<(u64, u64)>,
}

/// Why a task's `evaluation` is refused, if it is.
pub(crate) fn validate(config: &EvaluationConfig, task: &wire::CreateTask) -> Result<(), String> {
    config.check()?;
    if task.secure_aggregation.is_some() {
        return Err("evaluation is not available with secure aggregation yet: its server learns only the sum of the clients' updates, and plain evaluation reports would tell it each client's results; remove evaluation, or secure_aggregation".into());
    }
    Ok(())
}

/// Whether `client`'s fixed draw for round `round` of `task` falls within `fraction`: a hash
/// of the three, so a client is asked (or not) the same way on every poll and every replica.
fn drawn(task: &str, round: u64, client: &str, fraction: f64) -> bool {
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    for part in [
        b"hora evaluation draw".as_slice(),
        task.as_bytes(),
        &round.to_le_bytes(),
    ] {
        ctx.update(&(part.len() as u64).to_le_bytes());
        ctx.update(part);
    }
    ctx.update(client.as_bytes());
    let digest = ctx.finish();
    let mut head = [0u8; 8];
    head.copy_from_slice(&digest.as_ref()[..8]);
    (u64::from_le_bytes(head) as f64) < fraction * 2f64.powi(64)
}

/// Why `client` may not report to `e` now, if it may not (a 409 or 403 to send).
fn refusal(
    config: &EvaluationConfig,
    task: &str,
    e: &EvaluationRecord,
    client: &str,
) -> Option<ServerError> {
    let closed = |why: &str| {
        Some(ServerError::conflict(
            ErrorCode::EvaluationClosed,
            format!("the evaluation of round {} {why}: nothing to send", e.round),
        ))
    };
    if now_ms() >= e.deadline_unix_ms {
        return closed("is past its deadline");
    }
    if e.reporters.len() >= config.clients as usize {
        return closed(&format!("has its {} reports", config.clients));
    }
    let not_asked = |why: &str| {
        Some(ServerError::Forbidden(format!(
            "this client is not asked to evaluate round {}: {why}",
            e.round
        )))
    };
    if config.held_out
        && e.trainers
            .binary_search_by(|t| t.as_str().cmp(client))
            .is_ok()
    {
        return not_asked("it trained that round, and the task evaluates on held-out clients");
    }
    if config
        .fraction
        .is_some_and(|f| !drawn(task, e.round, client, f))
    {
        return not_asked(
            "the task evaluates with a fraction of its clients, and this one was not drawn",
        );
    }
    None
}

impl Coordinator {
    /// The evaluation `client` is asked for now, if any.
    pub(crate) fn evaluation_offer(&self, task: &Task, client: &str) -> Option<EvaluationOffer> {
        let record = lock(&task.record);
        let config = record.config.evaluation.as_ref()?;
        let e = record.evaluating.as_ref()?;
        if e.reporters.contains(client) || refusal(config, &task.id, e, client).is_some() {
            return None;
        }
        Some(EvaluationOffer {
            round: e.round,
            model: e.model,
            model_kind: record.config.model.clone(),
            frozen_base: record.part.as_ref().map(|p| p.base),
            deadline_unix_ms: e.deadline_unix_ms,
        })
    }

    /// Counts `client`'s report on round `round`'s model, durably. A report already counted
    /// is acknowledged again (a retry whose answer was lost). Blocking.
    pub(crate) fn report_evaluation(
        &self,
        task: &Task,
        client: &str,
        round: u64,
        report: &EvaluationReport,
    ) -> Result<EvaluationReceipt, ServerError> {
        report.check().map_err(ServerError::BadRequest)?;
        let writing = lock(&task.writing);
        let mut record = task.record();
        let Some(config) = record.config.evaluation.clone() else {
            return Err(ServerError::conflict(
                ErrorCode::EvaluationClosed,
                format!("task `{}` does not evaluate its models", task.id),
            ));
        };
        let Some(e) = record.evaluating.as_mut().filter(|e| e.round == round) else {
            return Err(ServerError::conflict(
                ErrorCode::EvaluationClosed,
                format!("no evaluation of round {round} is taking reports (it ended, or that round is not evaluated): nothing to send"),
            ));
        };
        let receipt = |e: &EvaluationRecord| EvaluationReceipt {
            round,
            reports: e.reporters.len() as u32,
        };
        if e.reporters.contains(client) {
            return Ok(receipt(e));
        }
        if let Some(refused) = refusal(&config, &task.id, e, client) {
            return Err(refused);
        }
        // Counted as an update's weight is, so no report outweighs the task's bound.
        let examples = report
            .num_examples
            .min(record.config.update_bounds.max_weight);
        e.sums.add(report, examples);
        e.reporters.insert(client.to_string());
        let answer = receipt(e);
        let complete = e.reporters.len() >= config.clients as usize;
        let ended = match complete {
            true => self.end_into(&task.id, &mut record)?,
            false => {
                self.store.put_task(&task.id, &record)?;
                None
            }
        };
        self.store.flush()?;
        *lock(&task.record) = record;
        drop(writing);
        self.metrics.evaluation_reported(&task.id);
        if let Some(ended) = ended {
            self.evaluation_ended(task, &ended, "complete");
        }
        task.bump();
        Ok(answer)
    }

    /// Ends the evaluation `record` has open (if any) in the store: its means into its round's
    /// history entry and `record` without it, written together; returns it. The caller holds
    /// the task's writing turn, flushes, and puts `record` in memory.
    fn end_into(
        &self,
        task: &str,
        record: &mut TaskRecord,
    ) -> Result<Option<EvaluationRecord>, ServerError> {
        let Some(e) = record.evaluating.take() else {
            return Ok(None);
        };
        let written =
            self.store
                .end_evaluation(task, record, e.round, e.attempt, &e.sums.summary());
        if let Err(err) = written {
            record.evaluating = Some(e);
            return Err(err.into());
        }
        Ok(Some(e))
    }

    /// What follows an evaluation's end, once it is durable: the operator is told (the log,
    /// /metrics), and the model it kept is removed if retention dropped its round meanwhile
    /// and nothing else uses it. Blocking.
    fn evaluation_ended(&self, task: &Task, e: &EvaluationRecord, why: &str) {
        let s = e.sums.summary();
        self.metrics.evaluation_ended(&task.id, e.round, &s);
        tracing::info!(task = %task.id, round = e.round, clients = s.clients, examples = s.examples, loss = ?s.loss, accuracy = ?s.accuracy, why, "federated evaluation ended");
        if let Err(err) = crate::store::remove_unused_models(&*self.store, vec![e.model]) {
            tracing::warn!(task = %task.id, round = e.round, error = %err, "removing the evaluated model failed; if retention dropped its round, the sweep at the next start removes it");
        }
    }

    /// In the close that publishes round `round` (its `attempt`) as `model`, with the task's
    /// writing turn held: opens the round's evaluation in `record` (the record the close will
    /// write) if the task evaluates that round, ending the one still open first (durably, now).
    pub(crate) fn open_evaluation(
        &self,
        task: &Task,
        record: &mut TaskRecord,
        (round, attempt, model): (u64, u32, ModelDigest),
        trainers: &[String],
    ) -> Result<Moved, ServerError> {
        let Some(config) = record.config.evaluation.clone() else {
            return Ok(Moved::default());
        };
        if !config.evaluates(round, record.config.rounds) {
            return Ok(Moved::default());
        }
        // The one still open ends first, in the record as it stands before this close (which
        // may yet fail): stored and in memory alike.
        let ended = match record.evaluating.take() {
            Some(_) => {
                let mut current = task.record();
                let ended = self.end_into(&task.id, &mut current)?;
                self.store.flush()?;
                *lock(&task.record) = current;
                ended
            }
            None => None,
        };
        let seconds = config
            .deadline_secs
            .unwrap_or(record.config.round_deadline_secs);
        let mut trainers = match config.held_out {
            true => trainers.to_vec(),
            false => Vec::new(),
        };
        trainers.sort();
        let deadline_unix_ms = now_ms() + seconds * 1000;
        record.evaluating = Some(EvaluationRecord {
            round,
            attempt,
            model,
            deadline_unix_ms,
            sums: Default::default(),
            reporters: Default::default(),
            trainers,
        });
        Ok(Moved {
            ended,
            opened: Some((round, deadline_unix_ms)),
        })
    }

    /// Once the close that published is durable: the ended evaluation is told, the opened one
    /// gets its deadline's watcher.
    pub(crate) fn evaluations_moved(self: &Arc<Self>, task: &Arc<Task>, moved: Moved) {
        if let Some(e) = moved.ended {
            self.evaluation_ended(task, &e, "the next evaluation began");
        }
        if let Some((round, deadline)) = moved.opened {
            self.watch_evaluation(task.clone(), round, deadline);
        }
    }

    /// Ends round `round`'s evaluation at its deadline (if it is still open then), retrying
    /// every second while the store refuses.
    pub(crate) fn watch_evaluation(self: &Arc<Self>, task: Arc<Task>, round: u64, at_ms: u64) {
        let me = self.clone();
        let stopping = self.stopping.clone();
        self.background.spawn(async move {
            let wait = Duration::from_millis(at_ms.saturating_sub(now_ms()));
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = stopping.cancelled() => return,
            }
            loop {
                let (m, t) = (me.clone(), task.clone());
                let ended = crate::blocking(move || m.end_evaluation_at_deadline(&t, round)).await;
                match ended {
                    Ok(()) => return,
                    Err(e) => {
                        tracing::warn!(task = %task.id, round, error = %e, "ending an evaluation at its deadline failed; trying again in a second");
                    }
                }
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                    _ = stopping.cancelled() => return,
                }
            }
        });
    }

    /// Blocking.
    fn end_evaluation_at_deadline(&self, task: &Task, round: u64) -> Result<(), ServerError> {
        let writing = lock(&task.writing);
        let mut record = task.record();
        if record.evaluating.as_ref().is_none_or(|e| e.round != round) {
            return Ok(()); // ended otherwise
        }
        let ended = self.end_into(&task.id, &mut record)?;
        self.store.flush()?;
        *lock(&task.record) = record;
        drop(writing);
        if let Some(e) = ended {
            self.evaluation_ended(task, &e, "deadline");
        }
        task.bump();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fraction_draws_about_that_share_of_clients_the_same_way_each_time() {
        let drawn_of = |round| {
            (0..4000)
                .filter(|c| drawn("t", round, &format!("client-{c}"), 0.25))
                .count()
        };
        let n = drawn_of(1);
        assert!((900..=1100).contains(&n), "{n} of 4000 drawn at 0.25");
        assert_eq!(n, drawn_of(1), "a fixed draw");
        assert_ne!(
            (0..64)
                .map(|c| drawn("t", 1, &format!("client-{c}"), 0.5))
                .collect::<Vec<_>>(),
            (0..64)
                .map(|c| drawn("t", 2, &format!("client-{c}"), 0.5))
                .collect::<Vec<_>>(),
            "another round draws others"
        );
        assert!(drawn("t", 1, "c", 1.0));
    }
}
