//! The built-in trainer: supervised classification with cross-entropy on a labelled
//! [`Dataset`], for any [`Network`] (built-in architecture or TorchScript module).
//!
//! One round of local training is the task's [`TrainingConfig`]: `epochs` passes over the local
//! training split in shuffled mini-batches of `batch_size`, SGD (with momentum) or Adam at
//! `learning_rate`, and FedProx's proximal term when `proximal_mu > 0`:
//! loss + μ/2·‖w − w_global‖². The optimizer's state starts afresh each round (its momentum
//! belongs to the local problem, not to the federation). The data is moved to the device once.

use std::time::Instant;

use hora_common::model::Model;
use hora_common::wire::{Metrics, ModelKind, OptimizerConfig, TrainingConfig};
use tch::nn::{self, OptimizerConfig as _};
use tch::{Device, Kind, Reduction, Tensor};

use crate::data::Dataset;
use crate::error::{ClientError, Result};
use crate::network::{Architecture, Network};
use crate::trainer::{EvaluateRequest, Evaluation, Progress, TrainOutcome, TrainRequest, Trainer};

/// A dataset as tensors on a device: features `[N, sample_len]` (f32) and labels `[N]` (i64).
pub struct DeviceData {
    pub features: Tensor,
    pub labels: Tensor,
}

impl DeviceData {
    pub fn new(data: &Dataset, device: Device) -> Result<Self> {
        let n = data.len() as i64;
        let features = Tensor::from_slice(&data.features)
            .view([n, data.sample_len() as i64])
            .to_device(device);
        let labels = Tensor::from_slice(&data.labels).to_device(device);
        Ok(DeviceData { features, labels })
    }

    pub fn len(&self) -> usize {
        self.labels.size()[0] as usize
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What [`fit`] did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FitReport {
    /// Mean training loss of the last (possibly partial) epoch.
    pub loss: f64,
    /// Accuracy on the training batches of the last epoch, as they were seen.
    pub accuracy: f64,
    pub samples: u64,
    pub epochs_completed: u32,
    pub stopped_early: bool,
}

fn optimizer(net: &Network, config: &TrainingConfig) -> Result<nn::Optimizer> {
    let lr = config.learning_rate;
    let opt = match config.optimizer {
        OptimizerConfig::Sgd { momentum } => nn::Sgd {
            momentum,
            ..Default::default()
        }
        .build(net.var_store(), lr),
        OptimizerConfig::Adam => nn::Adam::default().build(net.var_store(), lr),
    };
    Ok(opt?)
}

fn check_config(config: &TrainingConfig) -> Result<()> {
    let ok = config.batch_size > 0
        && config.learning_rate.is_finite()
        && config.learning_rate > 0.0
        && config.proximal_mu.is_finite()
        && config.proximal_mu >= 0.0
        && match config.optimizer {
            OptimizerConfig::Sgd { momentum } => momentum.is_finite() && momentum >= 0.0,
            OptimizerConfig::Adam => true,
        };
    if ok {
        Ok(())
    } else {
        Err(ClientError::Training(format!(
            "the task's training configuration is unusable: {config:?}"
        )))
    }
}

/// Trains `net` on `data` for `epochs` epochs of `config` (its `epochs` field is ignored in
/// favour of the argument, so a centralised baseline can run a whole federation's budget).
/// Stops between batches once `deadline` passes.
pub fn fit(
    net: &mut Network,
    data: &DeviceData,
    config: &TrainingConfig,
    epochs: u32,
    deadline: Option<Instant>,
    progress: &mut dyn FnMut(Progress),
) -> Result<FitReport> {
    check_config(config)?;
    let n = data.len() as i64;
    let batch = i64::from(config.batch_size);
    let mut opt = optimizer(net, config)?;
    // FedProx: the starting (global) weights, fixed for the round.
    let anchor: Vec<Tensor> = if config.proximal_mu > 0.0 {
        net.parameters()
            .iter()
            .map(|(_, v)| v.detach().copy())
            .collect()
    } else {
        Vec::new()
    };
    let total_samples = n as u64 * u64::from(epochs);
    let mut report = FitReport {
        loss: f64::NAN,
        accuracy: f64::NAN,
        samples: 0,
        epochs_completed: 0,
        stopped_early: false,
    };
    'epochs: for epoch in 0..epochs {
        let order = Tensor::randperm(n, (Kind::Int64, data.features.device()));
        let (mut loss_sum, mut correct, mut seen) = (0.0f64, 0i64, 0i64);
        for start in (0..n).step_by(batch as usize) {
            if deadline.is_some_and(|d| Instant::now() >= d) {
                report.stopped_early = true;
                break 'epochs;
            }
            let idx = order.narrow(0, start, batch.min(n - start));
            let Batch {
                logits,
                labels: ys,
                loss,
                value: batch_loss,
            } = batch_loss(net, data, &idx)?;
            if !batch_loss.is_finite() {
                return Err(ClientError::Training(format!(
                    "the training loss became {batch_loss} in epoch {}: lower the learning rate",
                    epoch + 1
                )));
            }
            let loss = if anchor.is_empty() {
                loss
            } else {
                let mut prox = Tensor::zeros([], (Kind::Float, data.features.device()));
                for ((_, w), w0) in net.parameters().iter().zip(&anchor) {
                    prox += (w - w0).square().sum(Kind::Float);
                }
                loss + prox * (config.proximal_mu / 2.0)
            };
            opt.backward_step(&loss);
            let m = idx.size()[0];
            loss_sum += batch_loss * m as f64;
            correct += logits
                .argmax(-1, false)
                .eq_tensor(&ys)
                .sum(Kind::Int64)
                .int64_value(&[]);
            seen += m;
            report.samples += m as u64;
            report.loss = loss_sum / seen as f64;
            report.accuracy = correct as f64 / seen as f64;
            progress(Progress {
                epoch: epoch + 1,
                epochs,
                samples: report.samples,
                total_samples,
                loss: report.loss,
            });
        }
        report.epochs_completed = epoch + 1;
    }
    Ok(report)
}

/// One training batch's forward pass.
pub struct Batch {
    pub logits: Tensor,
    pub labels: Tensor,
    /// Mean cross-entropy, to backpropagate.
    pub loss: Tensor,
    /// Its value (checked finite by the caller, who can say where it went wrong).
    pub value: f64,
}

/// The forward pass and mean cross-entropy of `net` (training mode) on the samples `idx` of
/// `data`: shared by local training and the sync workers.
pub fn batch_loss(net: &mut Network, data: &DeviceData, idx: &Tensor) -> Result<Batch> {
    let xs = data.features.index_select(0, idx);
    let labels = data.labels.index_select(0, idx);
    let logits = net.forward(&xs, true)?;
    let loss = logits.f_cross_entropy_loss::<Tensor>(&labels, None, Reduction::Mean, -100, 0.0)?;
    let value = loss.double_value(&[]);
    Ok(Batch {
        logits,
        labels,
        loss,
        value,
    })
}

/// Mean cross-entropy and accuracy of `net` on `data`, in batches of `batch`.
pub fn evaluate(net: &mut Network, data: &DeviceData, batch: usize) -> Result<Evaluation> {
    let n = data.len() as i64;
    let (mut loss, mut correct) = (0.0f64, 0i64);
    tch::no_grad(|| -> Result<()> {
        for start in (0..n).step_by(batch.max(1)) {
            let len = (batch as i64).min(n - start);
            let xs = data.features.narrow(0, start, len);
            let ys = data.labels.narrow(0, start, len);
            let logits = net.forward(&xs, false)?;
            loss += logits
                .f_cross_entropy_loss::<Tensor>(&ys, None, Reduction::Sum, -100, 0.0)?
                .double_value(&[]);
            correct += logits
                .argmax(-1, false)
                .eq_tensor(&ys)
                .sum(Kind::Int64)
                .int64_value(&[]);
        }
        Ok(())
    })?;
    let examples = n.max(1) as f64;
    Ok(Evaluation {
        loss: loss / examples,
        accuracy: correct as f64 / examples,
        examples: n as u64,
    })
}

/// The built-in [`Trainer`]: a labelled training split (and optionally a held-out split whose
/// accuracy is reported with each update) on one device.
pub struct SupervisedTrainer {
    train: Dataset,
    test: Option<Dataset>,
    device: Device,
    /// The network of the current task kind, with the data already on its device.
    prepared: Option<Prepared>,
    seed: Option<i64>,
}

struct Prepared {
    kind: ModelKind,
    net: Network,
    train: DeviceData,
    test: Option<DeviceData>,
}

impl SupervisedTrainer {
    pub fn new(train: Dataset, test: Option<Dataset>, device: Device) -> Result<Self> {
        if train.is_empty() {
            return Err(ClientError::Training(
                "the local training data is empty: nothing to train on".into(),
            ));
        }
        Ok(SupervisedTrainer {
            train,
            test,
            device,
            prepared: None,
            seed: None,
        })
    }

    /// Re-seeds libtorch's generator from `seed` and the round right before each round's
    /// training, so a round's update is reproducible — also when the round is retried after
    /// an abandoned attempt, or trained by a fresh process.
    pub fn with_seed(mut self, seed: Option<i64>) -> Self {
        self.seed = seed;
        self
    }

    fn prepare(
        &mut self,
        kind: &ModelKind,
        module: Option<&std::path::Path>,
    ) -> Result<&mut Prepared> {
        let stale = self.prepared.as_ref().is_none_or(|p| &p.kind != kind);
        if stale {
            check_data_fits(kind, &self.train)?;
            let mut net = Network::for_kind(kind, module, self.device)?;
            // One sample through the network: its output must have a logit per class.
            let probe = DeviceData::new(&self.train.subset(&[0]), self.device)?;
            let out = tch::no_grad(|| net.forward(&probe.features, false))?;
            let width = out.size().get(1).copied().unwrap_or(0);
            if out.dim() != 2 || width < self.train.num_classes as i64 {
                return Err(ClientError::Training(format!(
                    "the model maps a sample to shape {:?}, but the local data has {} classes: the task's model and this client's data do not match",
                    out.size(),
                    self.train.num_classes
                )));
            }
            let train = DeviceData::new(&self.train, self.device)?;
            let test = match &self.test {
                Some(t) if !t.is_empty() => Some(DeviceData::new(t, self.device)?),
                _ => None,
            };
            self.prepared = Some(Prepared {
                kind: kind.clone(),
                net,
                train,
                test,
            });
        }
        Ok(self.prepared.as_mut().expect("prepared above"))
    }
}

/// A built-in architecture must read as many values per sample as the data has, and have a
/// logit for every class (libtorch would otherwise abort mid-training).
fn check_data_fits(kind: &ModelKind, data: &Dataset) -> Result<()> {
    let ModelKind::Builtin { name, params } = kind else {
        return Ok(()); // a TorchScript module is probed with one sample instead
    };
    let arch = Architecture::from_builtin(name, params)?;
    let classes = arch.classes();
    if arch.input_len() != data.sample_len() || classes < data.num_classes {
        return Err(ClientError::Training(format!(
            "the task's `{name}` model reads {} values per sample into {classes} classes, but the local data has {} values per sample and {} classes: check --data against the task",
            arch.input_len(),
            data.sample_len(),
            data.num_classes
        )));
    }
    Ok(())
}

impl Trainer for SupervisedTrainer {
    fn train(&mut self, global: &Model, request: TrainRequest<'_>) -> Result<TrainOutcome> {
        let seed = self.seed;
        let prepared = self.prepare(request.model_kind, request.module.as_deref())?;
        prepared.net.set_weights(global)?;
        prepared.net.train_only(request.trainable);
        if let Some(seed) = seed {
            tch::manual_seed(seed.wrapping_add((request.round as i64).wrapping_mul(1_000_003)));
        }
        let report = fit(
            &mut prepared.net,
            &prepared.train,
            request.config,
            request.config.epochs,
            Some(request.deadline),
            request.progress,
        )?;
        let weights = prepared.net.weights()?;
        let accuracy = match &prepared.test {
            Some(test) => evaluate(&mut prepared.net, test, 1024)?.accuracy,
            None => report.accuracy,
        };
        // FedAvg weights by the examples a client learnt from: its whole split once it finished
        // an epoch, else the samples it reached.
        let full = prepared.train.len() as u64;
        let num_examples = if report.epochs_completed > 0 {
            full
        } else {
            report.samples.min(full)
        };
        Ok(TrainOutcome {
            weights,
            num_examples,
            metrics: Metrics {
                loss: report.loss.is_finite().then_some(report.loss),
                accuracy: accuracy.is_finite().then_some(accuracy),
            },
            stopped_early: report.stopped_early,
        })
    }

    /// On the held-out split; a trainer without one declines.
    fn evaluate(
        &mut self,
        model: &Model,
        request: EvaluateRequest<'_>,
    ) -> Result<Option<Evaluation>> {
        if self.test.as_ref().is_none_or(Dataset::is_empty) {
            return Ok(None);
        }
        let prepared = self.prepare(request.model_kind, request.module.as_deref())?;
        let Some(test) = &prepared.test else {
            return Ok(None);
        };
        prepared.net.set_weights(model)?;
        Ok(Some(evaluate(&mut prepared.net, test, 1024)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::synthetic::{self, SyntheticConfig};

    fn logreg() -> Network {
        let arch = Architecture::Logreg {
            inputs: 60,
            classes: 10,
        };
        Network::builtin(&arch, Device::Cpu).unwrap()
    }

    #[test]
    fn training_lowers_the_loss_and_raises_accuracy() {
        tch::manual_seed(0);
        let shard = synthetic::shard(&SyntheticConfig::iid(4, 3), 0).unwrap();
        let train = DeviceData::new(&shard.train, Device::Cpu).unwrap();
        let mut net = logreg();
        let before = evaluate(&mut net, &train, 256).unwrap();
        let config = TrainingConfig {
            batch_size: 16,
            learning_rate: 0.05,
            ..Default::default()
        };
        let report = fit(&mut net, &train, &config, 20, None, &mut |_| {}).unwrap();
        let after = evaluate(&mut net, &train, 256).unwrap();
        assert_eq!(report.epochs_completed, 20);
        assert_eq!(report.samples, 20 * shard.train.len() as u64);
        assert!(after.loss < before.loss * 0.8, "{before:?} -> {after:?}");
        assert!(
            after.accuracy > before.accuracy + 0.2,
            "{before:?} -> {after:?}"
        );
    }

    #[test]
    fn the_proximal_term_keeps_weights_near_the_global_model() {
        let shard = synthetic::shard(&SyntheticConfig::non_iid(1.0, 1.0, 4, 5), 1).unwrap();
        let train = DeviceData::new(&shard.train, Device::Cpu).unwrap();
        let mut drift = Vec::new();
        for mu in [0.0, 10.0] {
            tch::manual_seed(1);
            let mut net = logreg();
            let start = net.weights().unwrap();
            let config = TrainingConfig {
                batch_size: 8,
                learning_rate: 0.02,
                proximal_mu: mu,
                ..Default::default()
            };
            fit(&mut net, &train, &config, 5, None, &mut |_| {}).unwrap();
            let end = net.weights().unwrap();
            let d: f64 = start
                .data()
                .iter()
                .zip(end.data())
                .map(|(a, b)| f64::from(a - b).powi(2))
                .sum();
            drift.push(d.sqrt());
        }
        assert!(drift[1] < drift[0] * 0.7, "drift with μ=0, 10: {drift:?}");
    }

    #[test]
    fn a_passed_deadline_stops_training_at_once() {
        let shard = synthetic::shard(&SyntheticConfig::iid(2, 1), 0).unwrap();
        let train = DeviceData::new(&shard.train, Device::Cpu).unwrap();
        let mut net = logreg();
        let report = fit(
            &mut net,
            &train,
            &TrainingConfig::default(),
            3,
            Some(Instant::now()),
            &mut |_| {},
        )
        .unwrap();
        assert!(report.stopped_early);
        assert_eq!((report.samples, report.epochs_completed), (0, 0));
    }

    #[test]
    fn data_that_does_not_fit_the_model_is_refused_before_training() {
        let shard = synthetic::shard(&SyntheticConfig::iid(2, 2), 0).unwrap();
        let mut trainer = SupervisedTrainer::new(shard.train, None, Device::Cpu).unwrap();
        let global = logreg().weights().unwrap();
        for arch in [
            Architecture::Logreg {
                inputs: 784,
                classes: 10,
            },
            Architecture::Logreg {
                inputs: 60,
                classes: 2,
            },
        ] {
            let kind = arch.to_kind();
            let request = TrainRequest {
                task: "t",
                round: 1,
                config: &TrainingConfig::default(),
                model_kind: &kind,
                module: None,
                trainable: None,
                deadline: Instant::now() + std::time::Duration::from_secs(60),
                progress: &mut |_| {},
            };
            let err = trainer.train(&global, request).unwrap_err().to_string();
            assert!(err.contains("check --data against the task"), "{err}");
        }
    }

    #[test]
    fn adam_and_momentum_train_and_a_bad_config_is_refused() {
        let shard = synthetic::shard(&SyntheticConfig::iid(2, 2), 1).unwrap();
        let train = DeviceData::new(&shard.train, Device::Cpu).unwrap();
        for optimizer in [
            OptimizerConfig::Adam,
            OptimizerConfig::Sgd { momentum: 0.9 },
        ] {
            let mut net = logreg();
            let before = evaluate(&mut net, &train, 64).unwrap().loss;
            let config = TrainingConfig {
                optimizer,
                learning_rate: 0.01,
                ..Default::default()
            };
            fit(&mut net, &train, &config, 5, None, &mut |_| {}).unwrap();
            let after = evaluate(&mut net, &train, 64).unwrap().loss;
            assert!(after < before, "{optimizer:?}: {before} -> {after}");
        }
        let mut net = logreg();
        let bad = TrainingConfig {
            batch_size: 0,
            ..Default::default()
        };
        assert!(fit(&mut net, &train, &bad, 1, None, &mut |_| {}).is_err());
    }
}
