//! Closing a round attempt: tally → publish or abandon → open the next attempt.
//!
//! - **tally**: who contributed and who dropped, the example count, the strategy's aggregate of
//!   the clients' metrics, and whether the attempt ends short (fewer than `min_clients`); under
//!   central DP the sum is noised here, once, and a round past the privacy budget ends the task.
//! - **publish**: the strategy turns the sum into the next global model (in the old model's
//!   bytes, in place); a result that is not finite abandons the attempt instead.
//! - **record**: the model file, then one store transaction with the task record, the round's
//!   history entry and the next attempt's open record (a retry of the same round, or the next
//!   round), flushed. Only then does anyone see the outcome: waiting uploads are acknowledged (or
//!   told the attempt was abandoned), pollers are woken, the next attempt's watcher starts.
//!
//! A close that fails leaves nothing half-done: the stored state is the previous one, and the
//! round's phase says how the close is retried (see [`super::phase`]).

use std::sync::Arc;
use std::time::Instant;

use hora_common::kernel::{KernelError, WeightedSum};
use hora_common::wire::{Metrics, RoundOutcome, RoundRecord, TaskState};

use super::collection::Step;
use super::task::Unsettled;
use super::{lock, Accumulator, Coordinator, Durability, Ending, Round, SelectionDurability, Task};
use crate::dp;
use crate::error::ServerError;
use crate::store::{Contribution, PartialRecord, TaskRecord};
use crate::strategy;

/// What the tally of an attempt found.
struct Tally {
    /// The task record as the close will write it.
    record: TaskRecord,
    updates: usize,
    /// The clients whose updates `updates` hold (a regional aggregator's stand for several).
    contributors: u64,
    participants: Vec<String>,
    dropped: Vec<String>,
    examples: u64,
    metrics: hora_common::wire::Metrics,
    /// Why the attempt ends without a model, if it does.
    abandon: Option<String>,
    /// What central DP spent on the round, when it publishes.
    privacy: Option<Box<dp::Publication>>,
    /// The clients the attempt's failure is traced to: it ended short, and they were selected
    /// (and told so, durably) but no upload of theirs ever reached it. They earn strikes.
    struck: Vec<String>,
    /// What the close did to the task's federated evaluations.
    evaluations: super::evaluation::Moved,
}

/// The next global model: its digest and bytes, and the strategy state recorded with it.
type Aggregated = (hora_common::model::ModelDigest, Vec<u8>, Option<String>);

impl Coordinator {
    /// Acts on a step of `round` (from its deadline watcher or a mode's own message). Blocking.
    pub(crate) fn step(
        self: &Arc<Self>,
        task: &Arc<Task>,
        round: &Arc<Round>,
        step: Step,
    ) -> Result<(), ServerError> {
        match step {
            Step::Continue => {
                task.bump();
                Ok(())
            }
            Step::End(ending) => self.close(task, round, ending),
            Step::Sum {
                values,
                total_weight,
                contributors,
                evaluation,
            } => {
                {
                    let mut acc = lock(&round.acc);
                    let n = contributors.len() as u64;
                    acc.sum = WeightedSum::from_parts(task.spec(), values, total_weight as f64, n)
                        .map_err(ServerError::internal)?;
                    acc.contributions = contributors
                        .into_iter()
                        .map(|client| Contribution {
                            client,
                            examples: 0,
                            metrics: Metrics::default(),
                            unclipped: None,
                            base: None,
                            contributors: 1,
                        })
                        .collect();
                    acc.durable = acc.contributions.len();
                    acc.behind = 0;
                    *lock(&round.roster) = super::Roster::of(&acc);
                }
                let closed = self.close(task, round, Ending::Publish);
                // The evaluation the inputs carried counts with the attempt that published
                // (an abandoned one's survivors are not the round's).
                if let (Ok(()), Some((evaluated, sums))) = (&closed, &evaluation) {
                    if round.phase() == super::Phase::Published {
                        self.record_carried_evaluation(task, *evaluated, sums);
                    }
                }
                closed
            }
        }
    }

    /// Closes `round`: publishes it when it has enough updates (and `ending` is not an
    /// abandonment), else abandons it; then opens the next round or the retry. Blocking.
    pub(crate) fn close(
        self: &Arc<Self>,
        task: &Arc<Task>,
        round: &Arc<Round>,
        ending: Ending,
    ) -> Result<(), ServerError> {
        let mut acc = lock(&round.acc);
        if !acc.phase.begin_close().map_err(ServerError::internal)? {
            return Ok(()); // closing or closed by someone else
        }
        let started = Instant::now();
        let merged = match self.store.shared() {
            true => self.merge_partials(task, round, &mut acc),
            false => Ok(()),
        };
        let closed = merged
            .and_then(|()| self.tally(task, round, &mut acc, &ending))
            .and_then(|tally| self.publish(task, round, &acc, tally));
        let (mut tally, history, next) = match closed {
            Ok(v) => v,
            Err(e) => {
                let retry = round.collection.retry_after_failed_close(ending);
                acc.phase
                    .close_failed(retry)
                    .map_err(ServerError::internal)?;
                acc.failed_closes += 1;
                round.wake.notify_one();
                // Uploads the close would have acknowledged get a checkpoint meanwhile.
                task.commit_wanted.notify_one();
                return Err(e);
            }
        };
        if let Some(c) = acc.checkpoint.take() {
            self.store.remove_checkpoint(&c.file);
        }
        for file in std::mem::take(&mut acc.partial_files) {
            self.store.remove_checkpoint(&file);
        }
        // Blobs kept after writes of unknown outcome are superseded by the records just written.
        for settled in task.settled(true) {
            match settled {
                Unsettled::Checkpoint(file) => self.store.remove_checkpoint(&file),
                Unsettled::StrategyState(name) => {
                    if !self.state_used_by_another_task(&task.id, &name) {
                        self.store.remove_strategy_state(&name);
                    }
                }
            }
        }
        for file in round.collection.leftover_files() {
            self.store.remove_checkpoint(&file);
        }
        round.collection.settle(round, tally.abandon.is_some());
        let outcome = tally.abandon.clone().map_or(Ok(()), Err);
        acc.phase.closed(outcome).map_err(ServerError::internal)?;
        round.selection.send_replace(SelectionDurability::Closed);
        match &tally.abandon {
            None => {
                round
                    .durability
                    .send_replace(Durability::Upto(tally.updates));
                self.metrics
                    .round_published(&task.id, started.elapsed().as_secs_f64());
                round.collection.report(&self.metrics, &task.id, 0);
                let what = match history.forwarded_to {
                    Some(_) => "round closed: its partial goes to the parent",
                    None => "round published",
                };
                tracing::info!(task = %task.id, round = round.number, updates = tally.updates, examples = tally.examples, loss = ?history.metrics.loss, model = %history.model.map(|d| d.to_hex()[..12].to_string()).unwrap_or_default(), "{what}");
            }
            Some(r) => {
                round
                    .durability
                    .send_replace(Durability::Abandoned(r.clone()));
                self.metrics.round_abandoned(&task.id);
                tracing::warn!(task = %task.id, round = round.number, attempt = round.attempt, reason = %r, "round abandoned");
            }
        }
        drop(acc);
        // The attempt failed because clients it selected sent nothing: a strike each (so one
        // that keeps taking a place and starving rounds is quarantined). The close is durable
        // already; a strike that cannot be written is logged and lost. Before the change is
        // announced: whoever sees the next round sees the strikes too.
        if let Some(reason) = &tally.abandon {
            for client in &tally.struck {
                let why = format!(
                    "selected for round {} (attempt {}) of task `{}`, which was abandoned ({reason}), and sent nothing",
                    round.number, round.attempt, task.id
                );
                self.strike(client, Some(&why));
            }
        }
        task.bump();
        match next {
            // Runs on one of the runtime's blocking threads, which can spawn.
            Some(next) => self.watch(task.clone(), next),
            None => self.metrics.round_sum_bytes(&task.id, 0),
        }
        if tally.abandon.is_none() {
            self.evaluations_moved(task, std::mem::take(&mut tally.evaluations));
        }
        // Off the publish → wake-up path: pollers already know of the next round.
        if tally.abandon.is_none() {
            let published = tally.record.published;
            let retention = round.collection.retention(self.config.retention);
            match self.store.prune_models(&task.id, retention, published) {
                Ok(0) => {}
                Ok(n) => tracing::debug!(task = %task.id, files = n, "pruned round models"),
                Err(e) => {
                    tracing::warn!(task = %task.id, error = %e, "pruning old round models failed; files left behind are removed by the sweep at the next start")
                }
            }
        }
        Ok(())
    }

    /// Who is in, what the round's metrics are, and whether it ends short; the DP noise.
    fn tally(
        &self,
        task: &Task,
        round: &Round,
        acc: &mut Accumulator,
        ending: &Ending,
    ) -> Result<Tally, ServerError> {
        let mut record = task.record();
        let updates = acc.contributions.len();
        let contributors = acc.contributors();
        let participants: Vec<String> =
            acc.contributions.iter().map(|c| c.client.clone()).collect();
        let dropped = round.collection.dropped(&acc.selected, &participants);
        let examples = round.collection.examples(&acc.contributions, &acc.sum);
        let metrics = task.strategy.aggregate_metrics(&acc.contributions);
        let min = u64::from(record.config.min_clients);
        let short = matches!(ending, Ending::Publish) && contributors < min;
        // Not after a restart (the deadline may have passed while the server was down), and
        // only when every selection was durable (a client whose join was not answered was
        // never told it is in).
        let struck = match short
            && round.collection.strikes_dropouts()
            && !round.resumed
            && acc.selected_durable == acc.selected.len()
        {
            true => dropped
                .iter()
                .filter(|c| !acc.tried.contains(*c))
                .cloned()
                .collect(),
            false => Vec::new(),
        };
        let mut abandon = match ending {
            Ending::Abandon(r) => Some(r.clone()),
            Ending::Publish if contributors < min => Some(format!(
                "{contributors} of the required {min} updates by the deadline"
            )),
            Ending::Publish => None,
        };
        // Central DP: the sum is noised once and divided by the expected count before the
        // strategy sees it; a round that would exceed the privacy budget ends the task instead.
        let mut privacy = None;
        if let Some(state) = record.dp.clone().filter(|_| abandon.is_none()) {
            let facts = dp::RoundFacts::of(
                &*self.store,
                &task.id,
                round.number,
                acc.selected.len(),
                &acc.contributions,
            )?;
            match dp::close_round(&record.config, &state, &mut acc.sum, &mut acc.noised, facts)
                .map_err(ServerError::internal)?
            {
                dp::Closing::Publish(publication) => privacy = Some(publication),
                dp::Closing::BudgetReached(why) => {
                    tracing::warn!(task = %task.id, reason = %why, "the task finishes: privacy budget");
                    record.state = TaskState::Finished;
                    record.ended_reason = Some(why.clone());
                    abandon = Some(why);
                }
            }
        }
        Ok(Tally {
            record,
            updates,
            contributors,
            participants,
            dropped,
            examples,
            metrics,
            abandon,
            privacy,
            struck,
            evaluations: Default::default(),
        })
    }

    /// The next global model, or `None` with the tally's `abandon` set when the attempt ends
    /// without one. A stateful strategy also writes its next state (a new durable file,
    /// recorded below with the model); the previous state stays until then.
    fn aggregate(
        &self,
        task: &Task,
        round: &Round,
        acc: &Accumulator,
        tally: &mut Tally,
    ) -> Result<Option<Aggregated>, ServerError> {
        if tally.abandon.is_some() {
            return Ok(None);
        }
        if tally.record.parent.is_some() {
            // A regional task's round forwards its partial, the example-weighted mean delta,
            // instead of publishing a model: the parent's strategy makes the next one.
            let partial = acc.sum.finish().map_err(ServerError::internal)?;
            if let Err(e) = partial.check_finite() {
                tally.abandon = Some(format!("the round's partial is not finite ({e}): some update is out of range; bound updates with update_bounds.max_norm"));
                return Ok(None);
            }
            return Ok(Some((partial.digest(), partial.to_safetensors(), None)));
        }
        let mut bytes = self.store.model_bytes(&round.base)?;
        match strategy::aggregate_round(
            task.strategy.as_ref(),
            &mut bytes,
            &acc.sum,
            self.store.blobs(),
            tally.record.strategy_state.as_deref(),
        ) {
            Ok((digest, state)) => Ok(Some((digest, bytes, state))),
            // A result that is not finite is never published.
            Err(strategy::AggregateError::Kernel(KernelError::NotFinite(detail))) => {
                tally.abandon = Some(format!("the aggregated model is not finite ({detail}): some update is out of range; bound updates with update_bounds.max_norm"));
                Ok(None)
            }
            // (A blob store that stopped answering mid-state is a 503, retried; not a 500.)
            Err(strategy::AggregateError::State(e)) => Err(e.into()),
            Err(e) => Err(ServerError::internal(e)),
        }
    }

    /// Publishes (or abandons) the attempt and opens the next, durably; returns the tally, the
    /// history entry and the next attempt. On failure nothing is recorded and any strategy state
    /// written for the model is removed again.
    fn publish(
        self: &Arc<Self>,
        task: &Task,
        round: &Round,
        acc: &Accumulator,
        mut tally: Tally,
    ) -> Result<(Tally, RoundRecord, Option<Arc<Round>>), ServerError> {
        let aggregated = self.aggregate(task, round, acc, &mut tally)?;
        let previous_state = tally.record.strategy_state.clone();
        let new_state = aggregated.as_ref().and_then(|(_, _, state)| state.clone());
        // Set once the task record naming the new state is written: from then on the file may be
        // what the store names, and only the startup sweep may judge it unused.
        let recorded = std::cell::Cell::new(false);
        // The task's writing turn is held from here until the new record is in memory, so an
        // operator's pause or resume (`set_state`, which takes the same turn) is neither lost nor
        // able to write back the record this close replaces. One made since the close began is
        // kept; a stop closes the round itself, and a finished task stays finished. Readers of
        // the record never wait for this: they copy the one in memory.
        let writing = lock(&task.writing);
        let current = task.record();
        let record = &mut tally.record;
        if matches!(current.state, TaskState::Running | TaskState::Paused)
            && matches!(record.state, TaskState::Running | TaskState::Paused)
        {
            record.state = current.state;
        }
        // Evaluation reports may have been counted since the tally copied the record.
        record.evaluating = current.evaluating;
        let written = (|| -> Result<(RoundRecord, Option<Arc<Round>>), ServerError> {
            let model = match aggregated {
                Some((digest, bytes, state)) => {
                    self.store.put_model_bytes(&digest, &bytes)?;
                    drop(bytes);
                    record.published += 1;
                    match &mut record.parent {
                        // Forwarded by the upstream agent once this record is durable.
                        Some(parent) => {
                            parent.attempt = 0;
                            parent.partial = Some(PartialRecord {
                                round: round.number,
                                parent_round: parent.round().unwrap_or_default(),
                                model: digest,
                                examples: tally.examples,
                                contributors: tally.contributors,
                                metrics: tally.metrics,
                            })
                        }
                        None => {
                            record.global_model = digest;
                            record.strategy_state = state;
                        }
                    }
                    if record.published >= record.config.rounds {
                        record.state = TaskState::Finished;
                    }
                    if let Some(p) = &tally.privacy {
                        record.dp = Some(p.state.clone());
                        if let Some(why) = &p.budget_reached {
                            tracing::warn!(task = %task.id, reason = %why, "the task finishes: privacy budget");
                            record.state = TaskState::Finished;
                            record.ended_reason = Some(why.clone());
                        }
                    }
                    Some(digest)
                }
                None => None,
            };
            let forwarded_to = record
                .parent
                .as_ref()
                .filter(|_| model.is_some())
                .and_then(|p| p.round());
            // A regional task's abandoned attempt is not retried from here: its next attempt
            // starts from the parent's round as it then is.
            if let (Some(parent), Some(_)) = (&mut record.parent, &tally.abandon) {
                parent.attempt = round.attempt + 1;
            }
            if let Some(digest) = model.filter(|_| forwarded_to.is_none()) {
                let published = (round.number, round.attempt, digest);
                tally.evaluations =
                    self.open_evaluation(task, record, published, &tally.participants);
            }
            let history = RoundRecord {
                round: round.number,
                attempt: round.attempt,
                outcome: match &tally.abandon {
                    None => RoundOutcome::Published,
                    Some(r) => RoundOutcome::Abandoned { reason: r.clone() },
                },
                participants: tally.participants.clone(),
                dropped: tally.dropped.clone(),
                examples: tally.examples,
                metrics: tally.metrics,
                duration_ms: round.opened.elapsed().as_millis() as u64,
                privacy: tally
                    .privacy
                    .as_ref()
                    .filter(|_| model.is_some())
                    .map(|p| p.spent.clone()),
                model,
                contributors: Some(tally.contributors),
                forwarded_to,
                pruned: false,
                staleness: round.collection.staleness(round.number, &acc.contributions),
                compacted: None,
                evaluation: None,
            };
            // The retry of an abandoned attempt, or the next round (the mode may keep what the
            // closing attempt's clients still need, such as its key).
            round.collection.retire(round);
            let previous = Some(&round.collection);
            let next = match record.state {
                // A regional task's next round (or attempt) starts from its parent's: the
                // upstream agent opens it.
                TaskState::Running | TaskState::Paused if record.parent.is_some() => None,
                TaskState::Running | TaskState::Paused => Some(match &tally.abandon {
                    None => self.fresh_round(record, round.number + 1, 0, previous)?,
                    Some(_) => {
                        self.fresh_round(record, round.number, round.attempt + 1, previous)?
                    }
                }),
                _ => None,
            };
            let next_record = next.as_ref().map(|r| r.record(&lock(&r.acc)));
            self.store.finish_round(
                &task.id,
                record,
                &history,
                round.attempt,
                next_record.as_ref(),
            )?;
            recorded.set(true);
            match &next {
                Some(n) => n.collection.persist_new(&*self.store)?,
                None => round.collection.clear(&*self.store, &task.id)?,
            }
            self.store.flush()?;
            Ok((history, next))
        })();
        if let Ok((history, next)) = &written {
            // ε on /metrics first, then the open round: whoever sees the new count of published
            // rounds sees what they spent and can join the next one.
            if let Some(p) = &history.privacy {
                self.metrics.dp_epsilon(&task.id, p.epsilon);
            }
            *lock(&task.round) = next.clone();
            *lock(&task.record) = record.clone();
        }
        drop(writing);
        let (history, next) = match written {
            Ok(v) => v,
            Err(e) => {
                // (A database that went away mid-commit may have committed it: then the record
                // names the new file, which stays until a later close lands. A state written
                // under its fresh name is no other replica's or task's.)
                if let Some(new) = new_state.filter(|n| Some(n) != previous_state.as_ref()) {
                    match e.code() == hora_common::wire::ErrorCode::StoreUnavailable
                        || recorded.get()
                    {
                        true => task.unsettled(Unsettled::StrategyState(new)),
                        false => self.store.remove_strategy_state(&new),
                    }
                }
                return Err(e);
            }
        };
        // The new state is published with the model: the previous one is garbage now (a state
        // of an earlier version, named by its content, may be another task's too).
        if let Some(old) = previous_state.filter(|o| {
            Some(o) != tally.record.strategy_state.as_ref()
                && !self.state_used_by_another_task(&task.id, o)
        }) {
            self.store.remove_strategy_state(&old);
        }
        Ok((tally, history, next))
    }

    /// Whether a task other than `task` records the strategy state file `name`. State files of
    /// earlier versions are content-addressed, so two tasks with the same strategy, spec and sums
    /// may share one; the startup sweep keeps every recorded file, and a task must not delete
    /// another's. (States written now have names of their own.)
    fn state_used_by_another_task(&self, task: &str, name: &str) -> bool {
        self.tasks
            .read()
            .expect("tasks lock")
            .values()
            .filter(|t| t.id != task)
            .any(|t| lock(&t.record).strategy_state.as_deref() == Some(name))
    }
}
