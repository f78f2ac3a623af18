//! The secure-aggregation round mode: updates arrive through the four stages of Bonawitz et
//! al.'s protocol ([`crate::secagg`] runs them), and the round's sum is what unmasking yields.
//! The server never sees an individual update; a stage that loses too many clients abandons the
//! attempt, and the round is retried with fresh keys.

use std::sync::Arc;

use hora_common::kernel::WeightedSum;
use hora_common::wire::{ErrorCode, SecAggEvaluation, SecAggOffer, SecureAggregationConfig};
use tokio::sync::watch;

use super::collection::{Collection, Step};
use super::upload::Admission;
use super::{capacity, Coordinator, Ending, Round, Task};
use crate::error::ServerError;
use crate::secagg::{self, Outcome, SecAggRound, Sharing};
use crate::store::{Contribution, OpenRoundRecord, Store, TaskRecord};

/// How round `number` of a task with federated evaluation carries it: its clients evaluate
/// the model it trains from (round `number − 1`'s) when the task evaluates that round.
fn evaluation(record: &TaskRecord, number: u64) -> Option<SecAggEvaluation> {
    let config = record.config.evaluation.as_ref()?;
    let from = number.saturating_sub(1);
    Some(SecAggEvaluation {
        round: config.evaluates(from, record.config.rounds).then_some(from),
    })
}

/// Secure aggregation's stages, for one attempt.
pub struct SecureCollection(Arc<SecAggRound>);

impl SecureCollection {
    pub(crate) fn new(
        record: &TaskRecord,
        config: &SecureAggregationConfig,
        number: u64,
        attempt: u32,
        now: u64,
        sharing: Option<Sharing>,
        graph_seed: Option<u64>,
    ) -> Result<Self, ServerError> {
        Ok(SecureCollection(Arc::new(SecAggRound::new(
            hora_common::secagg::Context::new(&record.config.id, number, attempt),
            config.clone(),
            capacity(&record.config),
            record.config.min_clients as usize,
            now,
            record.config.round_deadline_secs,
            record.spec.numel(),
            evaluation(record, number),
            sharing,
            graph_seed,
        )?)))
    }

    pub(crate) fn resume(
        store: &Store,
        record: &TaskRecord,
        config: &SecureAggregationConfig,
        open: &OpenRoundRecord,
        sharing: Option<Sharing>,
    ) -> Result<Self, ServerError> {
        Ok(SecureCollection(Arc::new(SecAggRound::resume(
            store,
            hora_common::secagg::Context::new(&record.config.id, open.round, open.attempt),
            config.clone(),
            capacity(&record.config),
            record.config.min_clients as usize,
            open.opened_unix_ms,
            record.config.round_deadline_secs,
            record.spec.numel(),
            evaluation(record, open.round),
            sharing,
        )?)))
    }

    pub fn round(&self) -> &SecAggRound {
        &self.0
    }
}

impl Collection for SecureCollection {
    fn mode(&self) -> &'static str {
        "secure aggregation"
    }

    fn stage(&self) -> Option<String> {
        let stage = match self.0.stage_now() {
            secagg::Stage::Advertise => "advertise",
            secagg::Stage::ShareKeys => "share_keys",
            secagg::Stage::MaskedInput => "masked_input",
            secagg::Stage::Unmask => "unmask",
            secagg::Stage::Ended => "ended",
        };
        Some(stage.into())
    }

    fn admit_join(&self, store: &Store, task: &str, client: &str) -> Result<bool, ServerError> {
        // Keys are advertised right after joining: once advertising has closed, the attempt's
        // participants are fixed.
        if self.0.stage_caught_up(store)? != secagg::Stage::Advertise {
            return Ok(false);
        }
        let registered = store
            .client(client)?
            .is_some_and(|c| c.identity_key.is_some());
        if !registered {
            return Err(ServerError::conflict(
                ErrorCode::NoIdentityKey,
                format!("task `{task}` uses secure aggregation, which needs an identity key registered at enrolment; client `{client}` has none: enrol it again with a current client"),
            ));
        }
        Ok(true)
    }

    fn offer(&self) -> Option<SecAggOffer> {
        Some(self.0.offer())
    }

    fn check_upload(
        &self,
        task: &Task,
        _: &Arc<Round>,
        _: &str,
        _: u64,
    ) -> Result<Admission, ServerError> {
        let task = &task.id;
        Err(ServerError::conflict(
            ErrorCode::SecureAggregation,
            format!("task `{task}` uses secure aggregation: updates go through its stages (/v1/tasks/{{task}}/secagg/…), not a sealed upload"),
        ))
    }

    fn next_deadline(&self, _: &Round) -> u64 {
        self.0.deadline()
    }

    fn expire(&self, _: &Round) {
        self.0.expire_stage();
    }

    fn changes(&self) -> Option<watch::Receiver<u64>> {
        Some(self.0.changed.subscribe())
    }

    fn at_deadline(&self, store: &Store) -> Result<Step, ServerError> {
        Ok(step(self.0.tick(store)?))
    }

    /// The stages sum the replicas' masked partial sums themselves.
    fn merges_partials(&self) -> bool {
        false
    }

    fn followed(&self, store: &Store) -> Result<Step, ServerError> {
        Ok(step(self.0.followed(store)?))
    }

    fn retry_after_failed_close(&self, ending: Ending) -> Option<Ending> {
        Some(ending) // the stages are over: only the same ending can follow
    }

    fn examples(&self, _: &[Contribution], sum: &WeightedSum) -> u64 {
        // Only the total is known: it was summed inside the masked vectors.
        sum.total_weight() as u64
    }

    fn strikes_dropouts(&self) -> bool {
        // The stages do not yet tell a client's fault from a dropout, nor the settings' own
        // (a threshold too high); no strikes until they do.
        false
    }

    fn restarts_on_resume(&self) -> bool {
        false // the stages keep their own clocks; none closes while the task is paused
    }

    fn persist_new(&self, store: &Store) -> Result<(), ServerError> {
        self.0.persist_new(store)
    }

    fn clear(&self, store: &Store, task: &str) -> Result<(), ServerError> {
        Ok(store.secagg_clear(task)?)
    }

    fn leftover_files(&self) -> Vec<String> {
        self.0.sum_files()
    }

    fn secure_aggregation(&self, _: &str) -> Result<Arc<SecAggRound>, ServerError> {
        Ok(self.0.clone())
    }
}

/// What a stage's outcome does to the round.
fn step(outcome: Outcome) -> Step {
    match outcome {
        Outcome::Continue => Step::Continue,
        Outcome::Abandon(reason) => Step::End(Ending::Abandon(reason)),
        Outcome::Publish {
            values,
            total_weight,
            survivors,
            evaluation,
        } => Step::Sum {
            values,
            total_weight,
            contributors: survivors,
            evaluation,
        },
    }
}

impl Coordinator {
    /// The attempt `attempt` of round `round_number` of `task`, for a message from `client`.
    pub fn secagg_round(
        &self,
        task: &Task,
        client: &str,
        round_number: u64,
        attempt: u32,
    ) -> Result<(Arc<Round>, Arc<SecAggRound>), ServerError> {
        let round = task.current().ok_or_else(|| {
            ServerError::conflict(
                ErrorCode::RoundClosed,
                format!("task `{}` has no open round", task.id),
            )
        })?;
        let s = round.collection.secure_aggregation(&task.id)?;
        if round_number != round.number {
            return Err(ServerError::conflict(
                if round_number < round.number {
                    ErrorCode::RoundClosed
                } else {
                    ErrorCode::WrongRound
                },
                format!(
                    "round {round_number} is not open; the open round is {}",
                    round.number
                ),
            ));
        }
        if attempt != round.attempt {
            return Err(ServerError::conflict(
                if attempt < round.attempt { ErrorCode::RoundAbandoned } else { ErrorCode::WrongRound },
                format!(
                    "attempt {attempt} of round {round_number} is not the open one ({}): poll and join the retry",
                    round.attempt
                ),
            ));
        }
        if !round.standing(client).0 {
            return Err(ServerError::conflict(
                ErrorCode::NotSelected,
                format!(
                    "client `{client}` is not selected for round {round_number}: join it first"
                ),
            ));
        }
        Ok((round, s))
    }

    /// [`Coordinator::secagg_round`] for a client that may have joined at another replica: the
    /// store says whether it did (and this replica's copy of the selections learns it).
    pub async fn secagg_attempt(
        self: &Arc<Self>,
        task: &Arc<Task>,
        client: &str,
        round_number: u64,
        attempt: u32,
    ) -> Result<(Arc<Round>, Arc<SecAggRound>), ServerError> {
        let refused = match self.secagg_round(task, client, round_number, attempt) {
            Err(e) if e.code() == ErrorCode::NotSelected => e,
            other => return other,
        };
        let Some(round) = task.current().filter(|_| self.store.shared()) else {
            return Err(refused);
        };
        let (me, t, c) = (self.clone(), task.clone(), client.to_string());
        let learned =
            crate::blocking(move || round.collection.selected_elsewhere(&me, &t, &round, &c))
                .await?;
        match learned {
            true => self.secagg_round(task, client, round_number, attempt),
            false => Err(refused),
        }
    }

    /// Acts on what a secure-aggregation message did: publishes the unmasked sum, or abandons
    /// the attempt (the round is retried). Blocking.
    pub fn secagg_outcome(
        self: &Arc<Self>,
        task: &Arc<Task>,
        round: &Arc<Round>,
        outcome: Outcome,
    ) -> Result<(), ServerError> {
        self.step(task, round, step(outcome))
    }
}
