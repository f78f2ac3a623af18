//! Federated evaluation as the field plays it, for a task with `evaluation`. Once a round the task evaluates is published, clients online at
//! the simulated time are drawn from the seed and the round; those the engine offers the
//! evaluation to ([`Coordinator::evaluation_offer`](crate::round::Coordinator), which applies
//! `held_out` and `fraction`) evaluate the published model on their own held-out data on the
//! workers, up to the `clients` the task asks for, and report in the draw's order (a client
//! with no held-out examples, or whose evaluation fails, reports nothing). The evaluation then
//! ends as its deadline would end it
//! ([`Coordinator::expire_evaluation`](crate::round::Coordinator::expire_evaluation)), and the
//! engine's summary goes into the round's history entry and the row's `federated_*` columns.
//! (Their downloads are not in the round's `bytes_down`: that is the training's traffic.)
//!
//! Clients evaluate while the next round trains, as in the field: the simulated clock does not
//! wait for them.
//!
//! A secure-aggregation task's clients evaluate the model they train from inside their masked
//! inputs, as deployed clients do (see `secure`): the server learns only the sum, which is
//! recorded for round `r` once round `r + 1` publishes, and filled into `r`'s row then (the
//! row already reported while the run goes on lacks it; the result's history has it).

use hora_common::simulation::{client_seed, Job, Reply};
use hora_common::wire::EvaluationReport;
use tokio::sync::oneshot;

use super::{client_id, off_runtime, refused, unexpected, Field, Row};
use crate::simulation::workers::Answer;
use crate::simulation::SimulationError;

/// Domain tag of the draws of evaluating clients.
const EVALUATORS: u64 = 0x5A3D_0007;

/// Clients drawn for each report an evaluation asks for (some are not offered it: they trained
/// the round, or a `fraction` leaves them out).
const DRAWS_PER_REPORT: usize = 4;

impl Field<'_> {
    /// Round `round`'s federated evaluation, if the task asks for one (see the module).
    pub(super) async fn federated_evaluation(&mut self, round: u64) -> Result<(), SimulationError> {
        let record = self.task.record();
        let Some(config) = record.config.evaluation.clone() else {
            return Ok(());
        };
        if record.evaluating.as_ref().is_none_or(|e| e.round != round) {
            return Ok(());
        }
        let wanted = config.clients as usize;
        let seed = client_seed(self.sim.seed ^ EVALUATORS, round, 0);
        let drawn = self.online(wanted.saturating_mul(DRAWS_PER_REPORT), seed);
        let mut asked = Vec::new();
        for client in drawn {
            if asked.len() == wanted {
                break;
            }
            let Some(offer) = self
                .coordinator
                .evaluation_offer(&self.task, &client_id(client))
            else {
                continue;
            };
            self.prepare(offer.model).await?;
            let job = Job::Evaluate {
                model: offer.model,
                frozen_base: offer.frozen_base,
                model_kind: offer.model_kind,
                clients: vec![client],
            };
            asked.push((client, self.pool.submit(job.clone()), job));
        }
        let mut reports = Vec::with_capacity(asked.len());
        for (client, rx, job) in asked {
            if let Some(report) = self.evaluation_report(client, job, rx).await? {
                reports.push((client, report));
            }
        }
        let (coordinator, task) = (self.coordinator.clone(), self.task.clone());
        off_runtime(move || {
            for (client, report) in reports {
                let id = client_id(client);
                match coordinator.report_evaluation(&task, &id, round, &report) {
                    Ok(_) => {}
                    Err(e) if refused(&e) => {
                        tracing::debug!(client, round, error = %e, "the engine refused a virtual client's evaluation");
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            Ok(coordinator.expire_evaluation(&task, round)?)
        })
        .await
    }

    /// `client`'s report of the evaluation `job` asked for (queued as `rx`), or None when it
    /// has nothing to report: no held-out examples, a trainer that gave no figure, or an
    /// evaluation that failed.
    pub(super) async fn evaluation_report(
        &self,
        client: u64,
        job: Job,
        rx: oneshot::Receiver<Answer>,
    ) -> Result<Option<EvaluationReport>, SimulationError> {
        match self.settle(job, rx).await {
            Ok((
                Reply::Evaluated {
                    loss,
                    accuracy,
                    examples,
                },
                _,
            )) => {
                let report = EvaluationReport {
                    num_examples: examples,
                    loss,
                    accuracy,
                };
                Ok(report.check().is_ok().then_some(report))
            }
            Ok((Reply::Failed { error }, _)) | Err(error) => {
                tracing::warn!(client, %error, "a virtual client's evaluation failed: it reports nothing");
                Ok(None)
            }
            Ok((other, _)) => Err(unexpected(other)),
        }
    }

    /// A secure task's round `round` carried the evaluation of the round before it, in its
    /// clients' masked inputs: once it publishes, the engine has the sums in that round's
    /// history entry, and its row gets them.
    pub(super) async fn carried_into_rows(&mut self, round: u64) -> Result<(), SimulationError> {
        let config = self.task.record().config;
        if config.secure_aggregation.is_none() || config.evaluation.is_none() || round < 2 {
            return Ok(());
        }
        let (store, task) = (self.store.clone(), self.task.id.clone());
        let evaluated = round - 1;
        let attempts = off_runtime(move || Ok(store.round_attempts(&task, evaluated)?)).await?;
        let Some(e) = attempts.iter().find_map(|r| r.evaluation) else {
            return Ok(());
        };
        let published = |r: &&mut Row| r.round == evaluated && r.outcome == "published";
        if let Some(row) = self.rows.iter_mut().find(published) {
            row.federated_loss = e.loss;
            row.federated_accuracy = e.accuracy;
        }
        Ok(())
    }
}
