//! `hora-client sync`: a datacenter worker that trains a built-in model on its shard of a
//! dataset in lock-step with the other workers of its job.
//!
//! Forming the world ([`form_world`], in [`super::world`]): bind the ring port, meet the others
//! (at the server or from `--peers`), connect to the ring neighbours. Training ([`train`]): every rank builds the
//! model from the same seed, then takes rank 0's parameters and optimizer state (restored from
//! rank 0's newest checkpoint when there is one); each step, every rank computes gradients on its
//! part of the global batch and the [`DistributedOptimizer`] averages them on the ring.
//!
//! Sharding is DistributedSampler's: every rank shuffles the whole training set with the same
//! seeded permutation per epoch, cuts it into global batches of `world size × batch size`, and
//! takes its own slice of each, so N workers with batch b follow the same trajectory as one
//! worker with batch N·b (the test checks it). The remainder that does not fill a global batch is
//! dropped, as every rank must take the same number of steps.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use tch::{Device, Tensor};

use hora_collective::{
    Algorithm, CollectiveError, Communicator, DistributedOptimizer, Fusion, LrScaling,
    SyncOptimizer,
};

use super::checkpoint;
use super::{Result, SyncError};
use crate::data::DataSource;
use crate::network::{Architecture, Network};
use crate::supervised::{batch_loss, evaluate, Batch, DeviceData};

pub use hora_collective::{form_world, Meeting};

/// What `hora-client sync` trains, and how.
#[derive(Debug, Clone)]
pub struct SyncTraining {
    pub architecture: Architecture,
    pub data: DataSource,
    /// Fraction of a CSV file held out for the accuracy rank 0 reports.
    pub holdout: f64,
    pub epochs: u64,
    /// Per worker: the global batch is `world size × batch_size`.
    pub batch_size: usize,
    /// Before scaling by [`SyncTraining::lr_scaling`].
    pub learning_rate: f64,
    pub lr_scaling: LrScaling,
    pub algorithm: Algorithm,
    pub backward_passes_per_step: u32,
    pub seed: u64,
    pub device: Device,
    pub fusion_bytes: usize,
    pub checkpoint_dir: Option<PathBuf>,
    /// Checkpoint every this many steps (0: at the end of each epoch only).
    pub checkpoint_every: u64,
    /// Rank 0 writes the final weights here (safetensors).
    pub save: Option<PathBuf>,
}

/// One epoch, as every rank sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct EpochReport {
    pub epoch: u64,
    pub epochs: u64,
    /// Mean training loss over every rank's samples.
    pub loss: f64,
    pub samples: u64,
    /// Held-out accuracy (rank 0 only; all ranks hold the same model).
    pub accuracy: Option<f64>,
    pub elapsed: Duration,
}

/// A finished run.
#[derive(Debug, Clone, PartialEq)]
pub struct SyncReport {
    pub epochs: Vec<EpochReport>,
    /// Optimizer steps at the end.
    pub steps: u64,
    /// The step a checkpoint was resumed from.
    pub resumed_from: Option<u64>,
    pub learning_rate: f64,
}

/// The same permutation on every rank (and in every run) for `epoch`.
fn permutation(n: usize, seed: u64, epoch: u64) -> Vec<i64> {
    let mut order: Vec<i64> = (0..n as i64).collect();
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    order.shuffle(&mut rng);
    order
}

/// Trains `config` on this worker's shard in lock-step with the others of `comm`'s world.
/// `on_step(step, total)` and `on_epoch` report progress.
pub fn train(
    config: &SyncTraining,
    comm: Communicator,
    on_step: &mut dyn FnMut(u64, u64),
    on_epoch: &mut dyn FnMut(&EpochReport),
) -> Result<SyncReport> {
    let (rank, size) = (comm.rank(), comm.size());
    let (train_set, test_set) = config
        .data
        .load(Some(0), config.holdout)
        .map_err(crate::error::ClientError::from)?;
    if train_set.sample_len() != config.architecture.input_len() {
        return Err(SyncError::Config(format!(
            "the data has {} features per sample but the model takes {}",
            train_set.sample_len(),
            config.architecture.input_len()
        )));
    }
    let batch = config.batch_size.max(1);
    let passes = u64::from(config.backward_passes_per_step.max(1));
    let global_batch = batch * size as usize;
    let steps_per_epoch = (train_set.len() / global_batch) as u64 / passes;
    if steps_per_epoch == 0 {
        return Err(SyncError::Config(format!(
            "{} training samples do not fill one step of {size} workers × batch {batch} × {passes} passes: lower --batch-size",
            train_set.len()
        )));
    }
    let train_data = DeviceData::new(&train_set, config.device)?;
    let test_data = match (&test_set, rank) {
        (Some(t), 0) if !t.is_empty() => Some(DeviceData::new(t, config.device)?),
        _ => None,
    };

    tch::manual_seed(config.seed as i64);
    let mut net = Network::builtin(&config.architecture, config.device)?;
    let lr = config.lr_scaling.apply(config.learning_rate, size);
    let optimizer = SyncOptimizer::new(net.parameters(), config.algorithm, lr)?;
    let mut dist = DistributedOptimizer::new(
        optimizer,
        comm,
        Fusion::new(config.fusion_bytes),
        config.backward_passes_per_step,
    )?;

    // Rank 0 restores its newest checkpoint; the broadcast hands it (or rank 0's fresh
    // initialisation) to everyone, step count included.
    if rank == 0 {
        if let Some(dir) = &config.checkpoint_dir {
            if let Some((meta, tensors)) = checkpoint::latest(dir)? {
                let opt = dist.optimizer_mut();
                checkpoint::restore(&tensors, opt.parameters(), &opt.state())?;
                opt.set_steps(meta.step);
                tracing::info!(
                    step = meta.step,
                    written_by_world_size = meta.world_size,
                    "resuming from {}",
                    dir.join(&meta.tensors).display()
                );
            }
        }
    }
    dist.broadcast_state(0)?;
    let start = dist.optimizer().steps();
    let resumed_from = (start > 0).then_some(start);
    let total = config.epochs.checked_mul(steps_per_epoch).ok_or_else(|| {
        SyncError::Config(format!(
            "{} epochs of {steps_per_epoch} steps is too many",
            config.epochs
        ))
    })?;
    if start > total {
        return Err(SyncError::Checkpoint(format!(
            "the checkpoint is at step {start}, past the {total} steps of {} epochs: raise --epochs or use another --checkpoint-dir",
            config.epochs
        )));
    }

    let mut report = SyncReport {
        epochs: Vec::new(),
        steps: start,
        resumed_from,
        learning_rate: lr,
    };
    let mut order = Vec::new();
    let (mut loss_sum, mut seen) = (0.0f64, 0u64);
    let mut epoch_start = Instant::now();
    for step in start..total {
        let epoch = step / steps_per_epoch;
        let position = step % steps_per_epoch;
        if position == 0 || order.is_empty() {
            order = permutation(train_set.len(), config.seed, epoch);
        }
        for pass in 0..passes {
            let global = ((position * passes + pass) as usize) * global_batch;
            let mine = &order[global + rank as usize * batch..global + (rank as usize + 1) * batch];
            let idx = Tensor::from_slice(mine).to_device(config.device);
            let Batch { loss, value, .. } = batch_loss(&mut net, &train_data, &idx)?;
            if !value.is_finite() {
                return Err(SyncError::Config(format!(
                    "the training loss became {value} at step {step}: lower the learning rate"
                )));
            }
            loss_sum += value * batch as f64;
            seen += batch as u64;
            dist.backward_step(&loss)?;
        }
        report.steps = step + 1;
        on_step(step + 1, total);
        let epoch_done = position + 1 == steps_per_epoch;
        let periodic = config.checkpoint_every > 0 && (step + 1) % config.checkpoint_every == 0;
        // Rank 0 writes while the others wait at the next collective: --timeout must cover a
        // checkpoint's write.
        if rank == 0 && (epoch_done || periodic) {
            if let Some(dir) = &config.checkpoint_dir {
                let opt = dist.optimizer();
                checkpoint::save(dir, step + 1, size, opt.parameters(), &opt.state())?;
            }
        }
        if epoch_done {
            // Every rank's loss sum and count: the epoch's loss over the whole global batch.
            let mut mine = loss_sum.to_le_bytes().to_vec();
            mine.extend_from_slice(&seen.to_le_bytes());
            let all = dist.comm().allgather(&mine)?;
            let (mut total_loss, mut total_seen) = (0.0, 0u64);
            for blob in &all {
                let pair = <[u8; 16]>::try_from(blob.as_slice()).map_err(|_| {
                    CollectiveError::Protocol("a rank sent a malformed epoch summary".into())
                })?;
                total_loss += f64::from_le_bytes(pair[..8].try_into().unwrap_or_default());
                total_seen += u64::from_le_bytes(pair[8..].try_into().unwrap_or_default());
            }
            let accuracy = match &test_data {
                Some(test) => Some(evaluate(&mut net, test, 1024)?.accuracy),
                None => None,
            };
            let epoch_report = EpochReport {
                epoch: epoch + 1,
                epochs: config.epochs,
                loss: total_loss / total_seen.max(1) as f64,
                samples: total_seen,
                accuracy,
                elapsed: epoch_start.elapsed(),
            };
            on_epoch(&epoch_report);
            report.epochs.push(epoch_report);
            (loss_sum, seen) = (0.0, 0);
            epoch_start = Instant::now();
        }
    }
    if rank == 0 {
        if let Some(path) = &config.save {
            let weights = net.weights()?;
            crate::state::write_atomic(path, &weights.to_safetensors(), false)?;
        }
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permutations_depend_on_seed_and_epoch_only() {
        let a = permutation(100, 7, 0);
        assert_eq!(a, permutation(100, 7, 0));
        assert_ne!(a, permutation(100, 7, 1));
        assert_ne!(a, permutation(100, 8, 0));
        let mut sorted = a.clone();
        sorted.sort();
        assert_eq!(sorted, (0..100).collect::<Vec<i64>>());
    }
}
