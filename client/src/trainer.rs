//! The seam between the SDK and a model: a [`Trainer`] takes the round's global weights and
//! returns locally trained ones. The SDK does everything around it (polling, downloading,
//! `delta = local − global`, sealing, uploading, retries, resuming); a trainer only trains.
//!
//! [`crate::supervised::SupervisedTrainer`] is the built-in one (logistic regression, MLP, CNN or
//! the task's TorchScript module on a labelled dataset); users bring their own by implementing
//! the trait (see `examples/custom_trainer.rs`).

use std::path::PathBuf;
use std::time::Instant;

use hora_common::model::Model;
use hora_common::wire::{Metrics, ModelKind, TrainingConfig};

use crate::error::Result;

/// What a round asks of the trainer.
pub struct TrainRequest<'a> {
    pub task: &'a str,
    pub round: u64,
    pub config: &'a TrainingConfig,
    pub model_kind: &'a ModelKind,
    /// The task's TorchScript module, downloaded, when `model_kind` is TorchScript.
    pub module: Option<PathBuf>,
    /// For a task that trains part of its model: the tensors to train (sorted). The others
    /// are its frozen base: a trainer should not train them (what it does to them is left out
    /// of the update anyway).
    pub trainable: Option<&'a [String]>,
    /// Stop training (between batches) once this instant passes; the SDK leaves a margin before
    /// the round's deadline for sealing and uploading.
    pub deadline: Instant,
    /// Called as training progresses (drives the progress bar).
    pub progress: &'a mut (dyn FnMut(Progress) + Send),
}

/// How far local training is.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Progress {
    pub epoch: u32,
    pub epochs: u32,
    /// Samples processed so far in this round, over all epochs.
    pub samples: u64,
    pub total_samples: u64,
    /// Mean loss of the current epoch so far.
    pub loss: f64,
}

/// What local training produced.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainOutcome {
    /// The locally trained weights (same names and shapes as the global model).
    pub weights: Model,
    /// The example count FedAvg weights this update by.
    pub num_examples: u64,
    pub metrics: Metrics,
    /// Whether training stopped at the deadline before finishing its epochs.
    pub stopped_early: bool,
}

/// Loss and accuracy of a model on some data.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Evaluation {
    pub loss: f64,
    pub accuracy: f64,
    pub examples: u64,
}

/// Local training, as the SDK drives it. Runs on a blocking thread, so it may take as long as
/// it needs (within `request.deadline`).
pub trait Trainer: Send + 'static {
    /// Trains from `global` on local data.
    fn train(&mut self, global: &Model, request: TrainRequest<'_>) -> Result<TrainOutcome>;

    /// Evaluates `model`, a published global model, on local held-out data, for the task's
    /// federated evaluation (data not trained on: the server aggregates the clients' reports
    /// weighted by `examples`). `Ok(None)`, the default: this trainer has no such data, and
    /// the client declines.
    fn evaluate(
        &mut self,
        model: &Model,
        request: EvaluateRequest<'_>,
    ) -> Result<Option<Evaluation>> {
        let _ = (model, request);
        Ok(None)
    }
}

/// What an evaluation asks of the trainer.
pub struct EvaluateRequest<'a> {
    pub task: &'a str,
    /// The round (version) that published the model.
    pub round: u64,
    pub model_kind: &'a ModelKind,
    /// The task's TorchScript module, downloaded, when `model_kind` is TorchScript.
    pub module: Option<PathBuf>,
}

/// A trainer whose every training takes at least `min` (but never past the request's deadline):
/// a slower device, simulated, for drills and benchmarks of a fleet whose speeds differ.
pub struct Paced<T> {
    pub inner: T,
    pub min: std::time::Duration,
}

impl<T: Trainer> Trainer for Paced<T> {
    fn train(&mut self, global: &Model, request: TrainRequest<'_>) -> Result<TrainOutcome> {
        let started = Instant::now();
        let until = (started + self.min).min(request.deadline);
        let outcome = self.inner.train(global, request)?;
        if let Some(rest) = until.checked_duration_since(Instant::now()) {
            std::thread::sleep(rest);
        }
        Ok(outcome)
    }

    fn evaluate(
        &mut self,
        model: &Model,
        request: EvaluateRequest<'_>,
    ) -> Result<Option<Evaluation>> {
        self.inner.evaluate(model, request)
    }
}
