//! A worker of a simulated federation: it trains virtual clients, one [`Job`] at a time, for
//! the engine that started it (`hora-server simulate`, or `hora.simulation.run` from Python).
//!
//! A worker keeps no client between jobs. What a client is — its data and the trainer that
//! trains on it — comes from a [`Population`], made on demand from the client's id: the
//! built-in one ([`builtin`], `hora-simulate-worker`) runs the [`SupervisedTrainer`] a
//! deployed `hora-client train` runs; the Python package's runs the user's `train_fn` or
//! `TorchTrainer`, as a deployed `hora.Client` would. Everything around training is this
//! module's, the same for both: the round's global model (read once per round from the
//! engine's directory), `local − global`, the task's compression (rounding drawn from
//! `(seed, client, round)`) with error feedback kept in the client's file of the state
//! directory, and the protocol. So whichever worker trains a client, and however many there
//! are, the same update comes out.
//!
//! The protocol is hora-common's [`simulation`](hora_common::simulation) module.
//!
//! [`SupervisedTrainer`]: crate::SupervisedTrainer

#[cfg(feature = "torch")]
pub mod builtin;

use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use hora_common::model::{Limits, Model, ModelDigest};
use hora_common::simulation::{self, client_seed, FrameError, Job, Mean, Reply, Setup, TrainJob};
use hora_common::wire::ModelKind;
use rand::SeedableRng;
use rand_chacha::ChaCha12Rng;

use crate::client::Start;
use crate::error::{ClientError, Result};
use crate::trainer::{EvaluateRequest, Evaluation, TrainRequest, Trainer};

/// The virtual clients of a federation, as one worker sees them: any client's data and
/// trainer, made when a job names the client.
pub trait Population {
    /// How many training examples `client` has (the simulated clock's compute time, and the
    /// weight FedAvg would give it).
    fn examples(&mut self, client: u64) -> Result<u64>;

    /// A trainer over `client`'s data, for one job.
    fn trainer(&mut self, client: u64) -> Result<Box<dyn Trainer>>;

    /// The initial weights of a built-in model, made from `seed`.
    fn initial(&mut self, model_kind: &ModelKind, seed: u64) -> Result<Model> {
        let _ = seed;
        Err(ClientError::Training(format!(
            "this worker cannot make a {model_kind:?} model's initial weights: give the simulation its initial model"
        )))
    }

    /// `model` on the held-out data of `clients`: by default, each client's trainer evaluates
    /// it and the results are weighted by their examples (the pooled mean; a metric a client
    /// gives no finite value of is NaN in the [`Evaluation`] and left out of the mean).
    fn evaluate(
        &mut self,
        model: &Model,
        model_kind: &ModelKind,
        clients: &[u64],
    ) -> Result<Evaluation> {
        let (mut loss, mut accuracy, mut examples) = (Mean::default(), Mean::default(), 0u64);
        for &client in clients {
            let request = EvaluateRequest {
                task: "simulation",
                round: 0,
                model_kind,
                module: None,
            };
            let Some(e) = self.trainer(client)?.evaluate(model, request)? else {
                continue;
            };
            loss.add(e.loss, e.examples);
            accuracy.add(e.accuracy, e.examples);
            examples += e.examples;
        }
        Ok(Evaluation {
            loss: loss.value().unwrap_or(f64::NAN),
            accuracy: accuracy.value().unwrap_or(f64::NAN),
            examples,
        })
    }
}

/// Serves jobs from `input` until it closes: the setup frame first (`open` makes the
/// population from it), then one reply per job.
pub fn serve<P: Population>(
    mut input: impl BufRead,
    mut output: impl Write,
    open: impl FnOnce(&Setup) -> Result<P>,
) -> Result<()> {
    let (setup, _): (Setup, _) = simulation::read_frame(&mut input).map_err(protocol)?;
    // A setup this worker cannot serve (data it cannot read, say) fails every job with why,
    // so the engine can say it.
    let mut worker = Worker::new(setup, open).map_err(|e| e.to_string());
    loop {
        let (job, _payload): (Job, _) = match simulation::read_frame(&mut input) {
            Ok(frame) => frame,
            Err(FrameError::Closed) => return Ok(()),
            Err(e) => return Err(protocol(e)),
        };
        let done = match &mut worker {
            Ok(worker) => worker.run(job),
            Err(why) => Err(ClientError::Training(why.clone())),
        };
        let (reply, payload) = done.unwrap_or_else(|e| {
            let error = e.to_string();
            (Reply::Failed { error }, Vec::new())
        });
        simulation::write_frame(&mut output, &reply, &payload).map_err(protocol)?;
    }
}

fn protocol(e: FrameError) -> ClientError {
    ClientError::Protocol(format!("simulation worker: {e}"))
}

struct Worker<P> {
    setup: Setup,
    population: P,
    /// The models read last, by digest (a round's jobs share its model and frozen base).
    models: Vec<(ModelDigest, Model)>,
}

/// Models a worker keeps read: a round's, and the frozen base of a part-of-a-model task.
const MODELS_KEPT: usize = 2;

impl<P: Population> Worker<P> {
    fn new(setup: Setup, open: impl FnOnce(&Setup) -> Result<P>) -> Result<Self> {
        if setup.protocol != simulation::PROTOCOL {
            return Err(ClientError::Protocol(format!(
                "the engine speaks simulation protocol {}, this worker {}: run a worker of the same release as the engine",
                setup.protocol,
                simulation::PROTOCOL
            )));
        }
        let population = open(&setup)?;
        Ok(Worker {
            setup,
            population,
            models: Vec::new(),
        })
    }

    fn run(&mut self, job: Job) -> Result<(Reply, Vec<u8>)> {
        match job {
            Job::Initial { model_kind, seed } => {
                let model = self.population.initial(&model_kind, seed)?;
                Ok((Reply::Initial, model.to_safetensors()))
            }
            Job::Sizes { clients } => {
                let examples = clients
                    .into_iter()
                    .map(|c| self.check(c).and_then(|c| self.population.examples(c)))
                    .collect::<Result<Vec<u64>>>()?;
                Ok((Reply::Sizes { examples }, Vec::new()))
            }
            Job::Train(job) => self.train(job),
            Job::Evaluate {
                model,
                frozen_base,
                model_kind,
                clients,
            } => {
                let start = self.start(model, frozen_base)?;
                for &c in &clients {
                    self.check(c)?;
                }
                let e = self
                    .population
                    .evaluate(start.model(), &model_kind, &clients)?;
                let finite = |v: f64| v.is_finite().then_some(v);
                let reply = Reply::Evaluated {
                    loss: finite(e.loss),
                    accuracy: finite(e.accuracy),
                    examples: e.examples,
                };
                Ok((reply, Vec::new()))
            }
        }
    }

    /// `client`, if the federation has it.
    fn check(&self, client: u64) -> Result<u64> {
        match client < self.setup.clients {
            true => Ok(client),
            false => Err(ClientError::Training(format!(
                "client {client} is not in the federation of {} clients",
                self.setup.clients
            ))),
        }
    }

    /// What a round trains from: `model`, completed by `frozen_base` for a task that trains
    /// part of its model (as a deployed client completes it).
    fn start(&mut self, model: ModelDigest, frozen_base: Option<ModelDigest>) -> Result<Start> {
        let global = self.read(model)?;
        let whole = match frozen_base {
            Some(base) => Some(Model::merge(&self.read(base)?, &global).map_err(|e| {
                ClientError::Protocol(format!(
                    "the task's frozen base and its model do not make one model: {e}"
                ))
            })?),
            None => None,
        };
        Ok(Start { global, whole })
    }

    fn read(&mut self, digest: ModelDigest) -> Result<Model> {
        if let Some(i) = self.models.iter().position(|(d, _)| *d == digest) {
            // (The most recent last: a round's model and its frozen base both stay.)
            let kept = self.models.remove(i);
            let model = kept.1.clone();
            self.models.push(kept);
            return Ok(model);
        }
        let path = self.setup.models_dir.join(format!("{digest}.safetensors"));
        let model = Model::read_file(&path, &Limits::default())?;
        if model.digest() != digest {
            return Err(ClientError::Protocol(format!(
                "{} does not hold model {digest}",
                path.display()
            )));
        }
        if self.models.len() == MODELS_KEPT {
            self.models.remove(0);
        }
        self.models.push((digest, model.clone()));
        Ok(model)
    }

    fn train(&mut self, job: TrainJob) -> Result<(Reply, Vec<u8>)> {
        let started = Instant::now();
        let start = self.start(job.model, job.frozen_base)?;
        let trainable = start.trainable();
        let mut trainer = self.population.trainer(self.check(job.client)?)?;
        let outcome = trainer.train(
            start.model(),
            TrainRequest {
                task: "simulation",
                round: job.round,
                config: &job.training,
                model_kind: &job.model_kind,
                module: None,
                trainable: trainable.as_deref(),
                // (Simulated time decides stragglers: training always runs its epochs.)
                deadline: Instant::now() + Duration::from_secs(365 * 24 * 3600),
                progress: &mut |_| {},
            },
        )?;
        let mut delta = start.delta(&outcome.weights)?;
        let payload = match &job.compression {
            None => delta.to_safetensors(),
            Some(compression) => {
                compression
                    .validate(&delta.spec())
                    .map_err(|m| ClientError::Protocol(format!("the task's compression: {m}")))?;
                let residual = self.residual_path(job.client);
                if compression.error_feedback() {
                    if let Some(carried) = Model::read_file(&residual, &Limits::default())
                        .ok()
                        .filter(|r| r.spec() == delta.spec())
                    {
                        let values = delta.data_mut().iter_mut().zip(carried.data());
                        values.for_each(|(d, r)| *d += r);
                    }
                }
                let mut rng =
                    ChaCha12Rng::seed_from_u64(client_seed(self.setup.seed, job.client, job.round));
                let bytes = compression.encode(&mut delta, &mut rng)?;
                if compression.error_feedback() {
                    // Replaced by rename, never changed in place: a simulation's checkpoint
                    // links the file it had.
                    let next = residual.with_extension("residual.next");
                    delta.write_file(&next)?;
                    std::fs::rename(&next, &residual).map_err(|e| {
                        ClientError::Training(format!("keeping {}: {e}", residual.display()))
                    })?;
                }
                bytes
            }
        };
        let reply = Reply::Trained {
            num_examples: outcome.num_examples,
            metrics: outcome.metrics,
            seconds: started.elapsed().as_secs_f64(),
        };
        Ok((reply, payload))
    }

    fn residual_path(&self, client: u64) -> PathBuf {
        self.setup.state_dir.join(format!("{client}.residual"))
    }
}
