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
    Algorithm, CollectiveError, Communicator, DistributedOptimizer, ElasticMeeting, Fusion,
    LrScaling, Snapshot, SyncOptimizer, UseNccl,
};
use hora_common::wire::SyncRejoin;

use super::checkpoint;
use super::{Result, SyncError};
use crate::data::{DataSource, Dataset};
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
    /// Whether gradients on GPUs are averaged through NCCL.
    pub nccl: UseNccl,
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
    /// In the last world.
    pub learning_rate: f64,
    /// An elastic run's commits in memory, and the time they took (the copy, the question to
    /// the server, the ranks' agreement).
    pub commits: u64,
    pub commit_time: Duration,
}

/// The same permutation on every rank (and in every run) for `epoch`.
fn permutation(n: usize, seed: u64, epoch: u64) -> Vec<i64> {
    let mut order: Vec<i64> = (0..n as i64).collect();
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    order.shuffle(&mut rng);
    order
}

/// An elastic job's worker (a job created with `--min-world-size`): how it meets each of its
/// worlds at the server, which forms a world from whoever joined, and how often it commits.
pub struct Elastic<'a> {
    pub meeting: ElasticMeeting<'a>,
    /// Commit the training state in memory every this many steps (and at every epoch's end).
    pub commit_every: u64,
}

/// Where a run's worlds come from.
pub enum Worlds<'a> {
    /// One world, formed by the caller: a failed worker ends the job.
    Fixed(Box<Communicator>),
    /// As many as it takes: after a lost worker, the survivors roll back to their last commit
    /// and form the next world; workers that join wait for a commit.
    Elastic(Elastic<'a>),
}

/// A world this worker trained in.
#[derive(Debug, Clone, PartialEq)]
pub struct WorldReport {
    pub generation: u64,
    pub rank: u32,
    pub size: u32,
    /// The step training starts from in this world (every rank's state is rank 0's).
    pub step: u64,
    /// An elastic run's SHA-256 over the parameters, the optimizer's state and step count and
    /// the position in the data: the same on every rank of a world.
    pub digest: Option<String>,
    /// From the failure that ended the last world to this one's first step (an elastic job
    /// that lost a worker).
    pub recovered_in: Option<Duration>,
    pub learning_rate: f64,
}

/// Where the training is: the epoch, and how many samples of its permutation the worlds have
/// consumed (a world of any size takes the next `size × batch × passes`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct Position {
    epoch: u64,
    offset: u64,
}

/// What an elastic job rolls back to.
struct Commit {
    snapshot: Snapshot,
    position: Position,
}

/// How a world ended.
enum Ended {
    Finished,
    /// Workers wait to join: every rank committed and re-forms.
    Grow,
    /// A worker was lost (the error says which); this one rolls back.
    Lost(SyncError),
}

/// Whether `e` is a lost or stalled worker that an elastic job survives (not a bug, a
/// mismatch or bad data, which would fail the next world too).
fn survivable(e: &SyncError) -> bool {
    matches!(e, SyncError::Collective(c) if c.survivable())
}

/// Trains `config` on this worker's shard in lock-step with the others of each world.
/// `on_step(step, total)`, `on_epoch` and `on_world` report progress.
pub fn train(
    config: &SyncTraining,
    worlds: Worlds<'_>,
    on_step: &mut dyn FnMut(u64, u64),
    on_epoch: &mut dyn FnMut(&EpochReport),
    on_world: &mut dyn FnMut(&WorldReport),
) -> Result<SyncReport> {
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
    let train_data = DeviceData::new(&train_set, config.device)?;
    tch::manual_seed(config.seed as i64);
    let mut net = Network::builtin(&config.architecture, config.device)?;
    let mut optimizer =
        SyncOptimizer::new(net.parameters(), config.algorithm, config.learning_rate)?;
    let (mut comm, elastic) = match worlds {
        Worlds::Fixed(comm) => (*comm, None),
        Worlds::Elastic(e) => (e.meeting.meet(None)?, Some(e)),
    };
    // Rank 0 of the first world restores its newest checkpoint; the broadcast hands it (or
    // rank 0's fresh initialisation) to everyone, step count included.
    let mut restored = false;
    if comm.rank() == 0 {
        if let Some(dir) = &config.checkpoint_dir {
            if let Some((meta, tensors)) = checkpoint::latest(dir)? {
                checkpoint::restore(&tensors, optimizer.parameters(), &optimizer.state())?;
                optimizer.set_steps(meta.step);
                restored = true;
                tracing::info!(
                    step = meta.step,
                    written_by_world_size = meta.world_size,
                    "resuming from {}",
                    dir.join(&meta.tensors).display()
                );
            }
        }
    }
    let mut run = Run {
        config,
        net: &mut net,
        train_data: &train_data,
        test_set: test_set.as_ref().filter(|t| !t.is_empty()),
        test_data: None,
        samples: train_set.len() as u64,
        restored,
        position: Position::default(),
        loss_sum: 0.0,
        seen: 0,
        commit: None,
        report: SyncReport {
            epochs: Vec::new(),
            steps: 0,
            resumed_from: None,
            learning_rate: 0.0,
            commits: 0,
            commit_time: Duration::ZERO,
        },
    };
    let mut first = true;
    let mut failed_at: Option<Instant> = None;
    let rank = loop {
        let world = comm.world().clone();
        let lr = config.lr_scaling.apply(config.learning_rate, world.size);
        optimizer.set_lr(lr)?;
        run.report.learning_rate = lr;
        let attached = config.nccl.attach(&mut comm, config.device);
        let mut dist = DistributedOptimizer::new(
            optimizer,
            comm,
            Fusion::new(config.fusion_bytes),
            config.backward_passes_per_step,
        )?;
        let started = attached
            .map_err(SyncError::from)
            .and_then(|_| run.world(&mut dist, first, elastic.as_ref()));
        let ended = match started {
            Ok(start) => {
                first = false;
                on_world(&WorldReport {
                    generation: world.generation,
                    rank: world.rank,
                    size: world.size,
                    step: start.step,
                    digest: start.digest,
                    recovered_in: failed_at.take().map(|t| t.elapsed()),
                    learning_rate: lr,
                });
                run.train(&mut dist, elastic.as_ref(), on_step, on_epoch)
            }
            Err(e) => Err(e),
        };
        optimizer = dist.into_optimizer();
        let ended = match ended {
            Ok(ended) => ended,
            Err(e) if elastic.is_some() && survivable(&e) => Ended::Lost(e),
            Err(e) => return Err(e),
        };
        let Some(e) = &elastic else { break world.rank };
        let committed = match ended {
            Ended::Finished => break world.rank,
            Ended::Grow => {
                tracing::info!(
                    generation = world.generation,
                    "workers wait to join: forming a larger world"
                );
                optimizer.steps()
            }
            Ended::Lost(err) => {
                failed_at = Some(Instant::now());
                // Back to the last commit: what every survivor holds alike. A worker that has
                // none (its first world failed) joins as a newcomer and receives the state.
                let Some(commit) = &run.commit else {
                    tracing::warn!(error = %err, "lost a worker before this one had any state: joining as a newcomer");
                    comm = e.meeting.meet(None)?;
                    continue;
                };
                optimizer.restore(&commit.snapshot)?;
                optimizer.zero_grad();
                run.rollback();
                tracing::warn!(generation = world.generation, step = optimizer.steps(), error = %err, "lost a worker: rolled back to the last commit, forming the next world");
                optimizer.steps()
            }
        };
        comm = e.meeting.meet(Some(SyncRejoin {
            generation: world.generation,
            rank: world.rank,
            committed,
        }))?;
    };
    let report = run.report;
    if let (Some(e), 0) = (&elastic, rank) {
        // Workers that join from now on (started late, or retried by their launcher) learn
        // that there is nothing to do instead of waiting for a world.
        if let Err(why) = e.meeting.service.finish() {
            tracing::warn!(error = %why, "could not tell the server the job finished: workers that join later wait for a world until their timeout");
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

/// A world's starting point, the same on every rank.
struct Start {
    step: u64,
    digest: Option<String>,
}

/// A run's training state besides the optimizer's, carried from world to world.
struct Run<'a> {
    config: &'a SyncTraining,
    net: &'a mut Network,
    train_data: &'a DeviceData,
    /// Held out for rank 0's accuracy, on the device once a rank 0 needs it.
    test_set: Option<&'a Dataset>,
    test_data: Option<DeviceData>,
    samples: u64,
    /// Rank 0 of the first world restored a checkpoint.
    restored: bool,
    position: Position,
    /// This rank's training loss sum and samples in the current epoch.
    loss_sum: f64,
    seen: u64,
    /// An elastic run's last commit.
    commit: Option<Commit>,
    report: SyncReport,
}

impl Run<'_> {
    /// Samples one step of a world of `size` consumes.
    fn step_samples(&self, size: u32) -> u64 {
        u64::from(size)
            * self.config.batch_size.max(1) as u64
            * u64::from(self.config.backward_passes_per_step.max(1))
    }

    /// Brings every rank of a new world to rank 0's state and position (a checkpoint's, in the
    /// first world), and commits it for an elastic run.
    fn world(
        &mut self,
        dist: &mut DistributedOptimizer,
        first: bool,
        elastic: Option<&Elastic<'_>>,
    ) -> Result<Start> {
        let size = dist.comm().size();
        let step_samples = self.step_samples(size);
        let steps_per_epoch = self.samples / step_samples;
        if steps_per_epoch == 0 {
            return Err(SyncError::Config(format!(
                "{} training samples do not fill one step of {size} workers × batch {} × {} passes: lower --batch-size",
                self.samples,
                self.config.batch_size.max(1),
                self.config.backward_passes_per_step.max(1)
            )));
        }
        dist.broadcast_state(0)?;
        let steps = dist.optimizer().steps();
        if first && self.restored {
            // A checkpoint's step count puts the first world at its place in the data.
            self.position = Position {
                epoch: steps / steps_per_epoch,
                offset: (steps % steps_per_epoch) * step_samples,
            };
        }
        let (position, restored) =
            broadcast_position(dist.comm(), self.position, first && self.restored)?;
        self.position = position;
        self.restored = false;
        self.report.steps = steps;
        // A world's epoch loss counts from its start.
        (self.loss_sum, self.seen) = (0.0, 0);
        if restored {
            self.report.resumed_from = Some(steps);
            if self.position.epoch > self.config.epochs
                || (self.position.epoch == self.config.epochs && self.position.offset > 0)
            {
                return Err(SyncError::Checkpoint(format!(
                    "the checkpoint is at step {steps}, past the {} steps of {} epochs: raise --epochs or use another --checkpoint-dir",
                    self.config.epochs * steps_per_epoch,
                    self.config.epochs
                )));
            }
        }
        let digest = match elastic {
            Some(_) => {
                self.commit(dist)?;
                Some(state_digest(dist.optimizer(), self.position)?)
            }
            None => None,
        };
        Ok(Start {
            step: steps,
            digest,
        })
    }

    /// Commits the training state in memory.
    fn commit(&mut self, dist: &DistributedOptimizer) -> Result<()> {
        self.commit = Some(Commit {
            snapshot: dist.optimizer().snapshot()?,
            position: self.position,
        });
        Ok(())
    }

    /// Back to the last commit's position (the optimizer's part is restored by the caller).
    fn rollback(&mut self) {
        if let Some(c) = &self.commit {
            self.position = c.position;
        }
    }

    /// Trains in the current world until the last epoch ends, or (elastic) workers wait to
    /// join at a commit.
    fn train(
        &mut self,
        dist: &mut DistributedOptimizer,
        elastic: Option<&Elastic<'_>>,
        on_step: &mut dyn FnMut(u64, u64),
        on_epoch: &mut dyn FnMut(&EpochReport),
    ) -> Result<Ended> {
        let (rank, size) = (dist.comm().rank(), dist.comm().size());
        let batch = self.config.batch_size.max(1);
        let passes = u64::from(self.config.backward_passes_per_step.max(1));
        let step_samples = self.step_samples(size);
        let steps_per_epoch = self.samples / step_samples;
        let mut order = Vec::new();
        let mut epoch_start = Instant::now();
        while self.position.epoch < self.config.epochs {
            let Position { epoch, offset } = self.position;
            if offset + step_samples > self.samples {
                self.end_epoch(dist, epoch, &mut epoch_start, on_epoch)?;
                continue;
            }
            if order.is_empty() || offset == 0 {
                order = permutation(self.samples as usize, self.config.seed, epoch);
            }
            let step = dist.optimizer().steps();
            for pass in 0..passes {
                let at = (offset + pass * step_samples / passes) as usize + rank as usize * batch;
                let idx = Tensor::from_slice(&order[at..at + batch]).to_device(self.config.device);
                let Batch { loss, value, .. } = batch_loss(self.net, self.train_data, &idx)?;
                if !value.is_finite() {
                    return Err(SyncError::Config(format!(
                        "the training loss became {value} at step {step}: lower the learning rate"
                    )));
                }
                self.loss_sum += value * batch as f64;
                self.seen += batch as u64;
                dist.backward_step(&loss)?;
            }
            self.position.offset += step_samples;
            let done = dist.optimizer().steps();
            self.report.steps = done;
            let total = self.config.epochs.saturating_mul(steps_per_epoch);
            on_step(done, total.max(done));
            let periodic =
                self.config.checkpoint_every > 0 && done % self.config.checkpoint_every == 0;
            let epoch_done = self.position.offset + step_samples > self.samples;
            // Rank 0 writes while the others wait at the next collective: --timeout must cover
            // a checkpoint's write.
            if rank == 0 && (epoch_done || periodic) {
                if let Some(dir) = &self.config.checkpoint_dir {
                    let opt = dist.optimizer();
                    checkpoint::save(dir, done, size, opt.parameters(), &opt.state())?;
                }
            }
            if epoch_done {
                self.end_epoch(dist, epoch, &mut epoch_start, on_epoch)?;
            }
            if let Some(e) = elastic {
                let due = epoch_done || (e.commit_every > 0 && done % e.commit_every == 0);
                if due && self.commit_and_ask(dist, e)? {
                    return Ok(Ended::Grow);
                }
            }
        }
        Ok(Ended::Finished)
    }

    /// The epoch's report (every rank's loss sums), and the next epoch.
    fn end_epoch(
        &mut self,
        dist: &mut DistributedOptimizer,
        epoch: u64,
        epoch_start: &mut Instant,
        on_epoch: &mut dyn FnMut(&EpochReport),
    ) -> Result<()> {
        let mut mine = self.loss_sum.to_le_bytes().to_vec();
        mine.extend_from_slice(&self.seen.to_le_bytes());
        let all = dist.comm().allgather(&mine)?;
        let (mut total_loss, mut total_seen) = (0.0, 0u64);
        for blob in &all {
            let pair = <[u8; 16]>::try_from(blob.as_slice()).map_err(|_| {
                CollectiveError::Protocol("a rank sent a malformed epoch summary".into())
            })?;
            total_loss += f64::from_le_bytes(pair[..8].try_into().unwrap_or_default());
            total_seen += u64::from_le_bytes(pair[8..].try_into().unwrap_or_default());
        }
        let accuracy = match (self.test_set, dist.comm().rank()) {
            (Some(set), 0) => {
                let test = match self.test_data.take() {
                    Some(test) => test,
                    None => DeviceData::new(set, self.config.device)?,
                };
                let accuracy = evaluate(self.net, &test, 1024)?.accuracy;
                self.test_data = Some(test);
                Some(accuracy)
            }
            _ => None,
        };
        let report = EpochReport {
            epoch: epoch + 1,
            epochs: self.config.epochs,
            loss: total_loss / total_seen.max(1) as f64,
            samples: total_seen,
            accuracy,
            elapsed: epoch_start.elapsed(),
        };
        on_epoch(&report);
        self.report.epochs.push(report);
        (self.loss_sum, self.seen) = (0.0, 0);
        self.position = Position {
            epoch: epoch + 1,
            offset: 0,
        };
        *epoch_start = Instant::now();
        Ok(())
    }

    /// Commits, and asks the server (rank 0, for everyone) whether workers wait to join a
    /// world with room for them.
    fn commit_and_ask(&mut self, dist: &mut DistributedOptimizer, e: &Elastic<'_>) -> Result<bool> {
        let started = Instant::now();
        self.commit(dist)?;
        let comm = dist.comm();
        // Rank 0 asks at every commit: the question also tells the server this world is alive.
        let waiting = match comm.rank() {
            0 => match e.meeting.service.status() {
                Ok(status) => status.waiting > 0 && comm.size() < e.meeting.max_world_size,
                Err(err) => {
                    tracing::warn!(error = %err, "could not ask the server whether workers wait to join");
                    false
                }
            },
            _ => false,
        };
        let all = comm.allgather(&[u8::from(waiting)])?;
        let grow = all.first().is_some_and(|b| b.first() == Some(&1));
        self.report.commits += 1;
        self.report.commit_time += started.elapsed();
        Ok(grow)
    }
}

/// Rank 0's position, and whether rank 0 restored it from a checkpoint, on every rank.
fn broadcast_position(
    comm: &mut Communicator,
    position: Position,
    restored: bool,
) -> Result<(Position, bool)> {
    let mut mine = position.epoch.to_le_bytes().to_vec();
    mine.extend_from_slice(&position.offset.to_le_bytes());
    mine.push(u8::from(restored));
    let all = comm.allgather(&mine)?;
    let root = all
        .first()
        .and_then(|b| <[u8; 17]>::try_from(b.as_slice()).ok())
        .ok_or_else(|| CollectiveError::Protocol("rank 0 sent a malformed position".into()))?;
    let position = Position {
        epoch: u64::from_le_bytes(root[..8].try_into().unwrap_or_default()),
        offset: u64::from_le_bytes(root[8..16].try_into().unwrap_or_default()),
    };
    Ok((position, root[16] == 1))
}

/// SHA-256 over the parameters, the optimizer's state and step count, and the position.
fn state_digest(optimizer: &SyncOptimizer, position: Position) -> Result<String> {
    let mut hash = ring::digest::Context::new(&ring::digest::SHA256);
    let tensors = optimizer
        .parameters()
        .iter()
        .map(|(_, t)| t.shallow_clone())
        .chain(optimizer.state().into_iter().map(|(_, t)| t));
    for t in tensors {
        let values = Vec::<f32>::try_from(
            t.f_detach()?
                .f_to_kind(tch::Kind::Float)?
                .f_flatten(0, -1)?,
        )?;
        for v in values {
            hash.update(&v.to_le_bytes());
        }
    }
    for n in [optimizer.steps(), position.epoch, position.offset] {
        hash.update(&n.to_le_bytes());
    }
    Ok(hex::encode(hash.finish().as_ref()))
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
