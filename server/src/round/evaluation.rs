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
//! A secure-aggregation task's server learns nothing of any one client, and plain reports would
//! tell it more than its training does: there the clients of the next round evaluate the model
//! they train from inside their masked inputs (`secagg::quantise::EVALUATION_SLOTS`), and once
//! that round publishes, the sums unmasking gave are recorded in the evaluated round's entry
//! ([`Coordinator::record_carried_evaluation`]).

use std::sync::Arc;
use std::time::Duration;

use hora_common::model::ModelDigest;
use hora_common::wire::{
    self, ErrorCode, EvaluationConfig, EvaluationOffer, EvaluationReceipt, EvaluationReport,
    EvaluationSums, RoundOutcome,
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
    if task.secure_aggregation.is_some()
        && (config.fraction.is_some() || config.held_out || config.deadline_secs.is_some())
    {
        return Err("with secure aggregation, the clients of the next round evaluate a round's model inside their masked inputs (the server learns only the sum): fraction, held_out and deadline_secs do not apply; leave them out".into());
    }
    // (The last round's model is not evaluated in a secure task: no round trains from it.)
    if task.secure_aggregation.is_some() && config.every >= task.rounds {
        return Err(format!(
            "with secure aggregation a round's model is evaluated by the next round's clients, so evaluation.every ({}) must be below rounds ({}) for any model to be evaluated",
            config.every, task.rounds
        ));
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

/// Whether `client` may report on round `round` now, from `record`: `Some` receipt when its
/// report is counted already (a repeat), `None` when it may, or why not.
pub(crate) fn admission(
    task: &str,
    record: &TaskRecord,
    client: &str,
    round: u64,
) -> Result<Option<EvaluationReceipt>, ServerError> {
    let closed = |message: String| Err(ServerError::conflict(ErrorCode::EvaluationClosed, message));
    let (Some(config), false) = (
        &record.config.evaluation,
        record.config.secure_aggregation.is_some(),
    ) else {
        return closed(format!("task `{task}` takes no evaluation reports (none asked for, or its evaluations travel inside secure aggregation's masked inputs)"));
    };
    let Some(e) = record.evaluating.as_ref().filter(|e| e.round == round) else {
        return closed(format!("no evaluation of round {round} is taking reports (it ended, or that round is not evaluated): nothing to send"));
    };
    if e.reporters.contains(client) {
        return Ok(Some(EvaluationReceipt {
            round,
            reports: e.reporters.len() as u32,
        }));
    }
    match refusal(config, task, e, client) {
        Some(refused) => Err(refused),
        None => Ok(None),
    }
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
    /// is acknowledged again, once durable (a retry whose answer was lost). Blocking.
    pub(crate) fn report_evaluation(
        &self,
        task: &Task,
        client: &str,
        round: u64,
        report: &EvaluationReport,
    ) -> Result<EvaluationReceipt, ServerError> {
        // Refusals and repeats from the record in memory, before the writing turn: a flood of
        // them never queues behind a close.
        let admitted = admission(&task.id, &lock(&task.record), client, round)?;
        if let Some(receipt) = admitted {
            self.store.flush()?;
            return Ok(receipt);
        }
        report.check().map_err(ServerError::BadRequest)?;
        let writing = lock(&task.writing);
        let mut record = task.record();
        if let Some(receipt) = admission(&task.id, &record, client, round)? {
            self.store.flush()?;
            return Ok(receipt);
        }
        let clients = record.config.evaluation.as_ref().map_or(0, |c| c.clients) as usize;
        // Counted as an update's weight is: at most the task's max_weight.
        let examples = report
            .num_examples
            .min(record.config.update_bounds.max_weight);
        let e = record.evaluating.as_mut().ok_or_else(|| {
            ServerError::internal("an admitted evaluation report has no evaluation")
        })?;
        // (Finite: at most 1,000 reports of at most u64::MAX examples of a loss of at most 1e9.)
        e.sums.add(report, examples);
        e.reporters.insert(client.to_string());
        let receipt = EvaluationReceipt {
            round,
            reports: e.reporters.len() as u32,
        };
        let ended = match e.reporters.len() >= clients {
            true => self.end_evaluation(task, &mut record)?,
            false => {
                self.store.put_task(&task.id, &record)?;
                // (The record in memory is what was written, before the flush: a retry after
                // a failed flush finds its report counted, and is answered once one goes
                // through.)
                *lock(&task.record) = record;
                self.store.flush()?;
                None
            }
        };
        drop(writing);
        self.metrics.evaluation_reported(&task.id, 1);
        if let Some(ended) = ended {
            self.evaluation_ended(task, &ended, "complete");
        }
        Ok(receipt)
    }

    /// Ends the evaluation that `record`, the task's record as it stands, has open (if any):
    /// its result into its round's history entry and the record without it, written together
    /// and flushed; the record in memory follows what was written. Returns it. The caller holds
    /// the task's writing turn.
    fn end_evaluation(
        &self,
        task: &Task,
        record: &mut TaskRecord,
    ) -> Result<Option<EvaluationRecord>, ServerError> {
        let Some(e) = record.evaluating.take() else {
            return Ok(None);
        };
        let written = self
            .store
            .end_evaluation(&task.id, record, e.round, e.attempt, &e.sums.summary())
            .map_err(ServerError::from)
            .and_then(|()| Ok(self.store.flush()?));
        if let Err(err) = written {
            // The record in memory keeps it open, as it was before: a report retried after
            // this failure is counted again from there, and the end written again.
            record.evaluating = Some(e);
            return Err(err);
        }
        *lock(&task.record) = record.clone();
        let mut watch = lock(&task.evaluation_watch);
        if let Some((_, token)) = watch.take_if(|(round, _)| *round == e.round) {
            token.cancel();
        }
        drop(watch);
        task.shown();
        self.evaluation_told(task, e.round, &e.sums, "ended");
        Ok(Some(e))
    }

    /// What follows an evaluation's end, off the task's writing turn: the model it kept is
    /// removed if retention dropped its round meanwhile and nothing else uses it. Blocking.
    fn evaluation_ended(&self, task: &Task, e: &EvaluationRecord, why: &str) {
        tracing::debug!(task = %task.id, round = e.round, why, "federated evaluation over");
        let kept =
            e.model == task.global_model() || self.store.model_in_history(&e.model).unwrap_or(true);
        if kept {
            return;
        }
        if let Err(err) = crate::store::remove_unused_models(&*self.store, vec![e.model]) {
            tracing::warn!(task = %task.id, round = e.round, error = %err, "removing the evaluated model failed; if retention dropped its round, the sweep at the next start removes it");
        }
    }

    /// The log line and /metrics of an evaluation of round `round` that ended with `sums`.
    fn evaluation_told(&self, task: &Task, round: u64, sums: &EvaluationSums, why: &str) {
        let s = sums.summary();
        self.metrics.evaluation_ended(&task.id, round, &s);
        tracing::info!(task = %task.id, round, clients = s.clients, examples = s.examples, loss = ?s.loss, accuracy = ?s.accuracy, why, "federated evaluation ended");
    }

    /// Records the evaluation of round `round`'s model that a secure round's masked inputs
    /// carried (the server learned only its sums) in that round's history entry. Blocking. A
    /// failure is logged, not returned: the round that carried it publishes all the same.
    pub(crate) fn record_carried_evaluation(&self, task: &Task, round: u64, sums: &EvaluationSums) {
        let written = (|| -> Result<(), ServerError> {
            let attempts = self.store.round_attempts(&task.id, round)?;
            let Some(published) = attempts
                .iter()
                .rev()
                .find(|r| r.outcome == RoundOutcome::Published)
            else {
                return Ok(());
            };
            let _writing = lock(&task.writing);
            let record = task.record();
            self.store.end_evaluation(
                &task.id,
                &record,
                round,
                published.attempt,
                &sums.summary(),
            )?;
            Ok(self.store.flush()?)
        })();
        match written {
            Ok(()) => {
                self.metrics.evaluation_reported(&task.id, sums.clients);
                self.evaluation_told(
                    task,
                    round,
                    sums,
                    "carried by the next round's masked inputs",
                );
            }
            Err(e) => {
                tracing::warn!(task = %task.id, round, error = %e, "recording the federated evaluation the round's masked inputs carried failed; the round goes on without it")
            }
        }
    }

    /// In the close that publishes round `round` (its `attempt`) as `model`, with the task's
    /// writing turn held: opens the round's evaluation in `record` (the record the close will
    /// write) if the task evaluates that round with plain reports, ending the one still open
    /// first. Ending it is the previous evaluation's business, not the close's: if it cannot
    /// be written, its reports are lost (and logged), and the close goes on.
    pub(crate) fn open_evaluation(
        &self,
        task: &Task,
        record: &mut TaskRecord,
        (round, attempt, model): (u64, u32, ModelDigest),
        trainers: &[String],
    ) -> Moved {
        let Some(config) = record.config.evaluation.clone() else {
            return Moved::default();
        };
        if record.config.secure_aggregation.is_some()
            || !config.evaluates(round, record.config.rounds)
        {
            return Moved::default(); // (secure rounds carry their evaluations themselves)
        }
        let ended = match record.evaluating.take() {
            Some(_) => {
                let mut current = task.record();
                match self.end_evaluation(task, &mut current) {
                    Ok(ended) => ended,
                    Err(e) => {
                        tracing::warn!(task = %task.id, round, error = %e, "ending the previous federated evaluation failed; its reports are lost, and the next evaluation begins");
                        None
                    }
                }
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
        Moved {
            ended,
            opened: Some((round, deadline_unix_ms)),
        }
    }

    /// Once the close that published is durable and its pollers are woken: the ended
    /// evaluation's model is cleaned up, the opened one gets its deadline's watcher.
    pub(crate) fn evaluations_moved(self: &Arc<Self>, task: &Arc<Task>, moved: Moved) {
        if let Some((round, deadline)) = moved.opened {
            self.watch_evaluation(task.clone(), round, deadline);
        }
        if let Some(e) = moved.ended {
            self.evaluation_ended(task, &e, "the next evaluation began");
        }
    }

    /// Ends round `round`'s evaluation at its deadline (if it is still open then), retrying
    /// every second while the store refuses; a watcher ends early when its evaluation does.
    pub(crate) fn watch_evaluation(self: &Arc<Self>, task: Arc<Task>, round: u64, at_ms: u64) {
        let me = self.clone();
        let cancelled = self.stopping.child_token();
        {
            // Only for the evaluation open now (a late start for one that ended, or that the
            // next replaced, would cancel the watcher of the one open).
            let record = lock(&task.record);
            if record.evaluating.as_ref().is_none_or(|e| e.round != round) {
                return;
            }
            let previous = lock(&task.evaluation_watch).replace((round, cancelled.clone()));
            if let Some((_, token)) = previous {
                token.cancel();
            }
        }
        self.background.spawn(async move {
            let wait = Duration::from_millis(at_ms.saturating_sub(now_ms()));
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = cancelled.cancelled() => return,
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
                    _ = cancelled.cancelled() => return,
                }
            }
        });
    }

    /// Ends round `round`'s evaluation now, as its deadline would end it (a simulation's clock,
    /// not the server's, says when that passes); nothing if it has ended already. Blocking.
    pub fn expire_evaluation(&self, task: &Task, round: u64) -> Result<(), ServerError> {
        self.end_evaluation_at_deadline(task, round)
    }

    /// Blocking.
    fn end_evaluation_at_deadline(&self, task: &Task, round: u64) -> Result<(), ServerError> {
        let writing = lock(&task.writing);
        let mut record = task.record();
        if record.evaluating.as_ref().is_none_or(|e| e.round != round) {
            return Ok(()); // ended otherwise
        }
        let ended = self.end_evaluation(task, &mut record)?;
        drop(writing);
        if let Some(e) = ended {
            self.evaluation_ended(task, &e, "deadline");
        }
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

    #[test]
    fn secure_tasks_take_evaluation_without_the_plain_reports_settings() {
        let task = |evaluation: serde_json::Value| -> wire::CreateTask {
            serde_json::from_value(serde_json::json!({
                "id": "s", "initial_model": "00".repeat(32), "model": {"kind": "builtin", "name": "mlp"},
                "rounds": 3, "min_clients": 3, "target_clients": 5, "round_deadline_secs": 60,
                "secure_aggregation": {}, "evaluation": evaluation,
            }))
            .unwrap()
        };
        let ok = task(serde_json::json!({"clients": 5}));
        validate(ok.evaluation.as_ref().unwrap(), &ok).unwrap();
        for settings in [
            serde_json::json!({"clients": 5, "fraction": 0.5}),
            serde_json::json!({"clients": 5, "held_out": true}),
            serde_json::json!({"clients": 5, "deadline_secs": 9}),
        ] {
            let t = task(settings.clone());
            let refused = validate(t.evaluation.as_ref().unwrap(), &t).unwrap_err();
            assert!(refused.contains("masked inputs"), "{settings}: {refused}");
        }
        // Every third round of three: only the last, which no round trains from.
        let never = task(serde_json::json!({"clients": 5, "every": 3}));
        let refused = validate(never.evaluation.as_ref().unwrap(), &never).unwrap_err();
        assert!(refused.contains("below rounds (3)"), "{refused}");
    }
}
