//! A worker of a simulated federation (`hora-client simulate-worker`): it trains virtual
//! clients, one [`Job`] at a time, for the engine that started it (`hora-server simulate`).
//!
//! A worker keeps no client between jobs. A client's data is made from `(data, seed, client)`
//! when its job comes (a synthetic shard is generated, never read from anyone else's; a
//! dataset is read once per worker and the client's share of it taken by the partitioner); the
//! trainer is the built-in [`SupervisedTrainer`] a deployed `hora-client train` runs, seeded
//! from `(seed, client)`; the update is `local − global` encoded as the task's compression says
//! (rounding drawn from `(seed, client, round)`), with error feedback read from and written to
//! the client's file in the state directory. So whichever worker trains a client, and however
//! many there are, the same update comes out.
//!
//! The protocol is hora-common's [`simulation`](hora_common::simulation) module.

use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use hora_common::model::{Limits, Model, ModelDigest};
use hora_common::simulation::{self, client_seed, FrameError, Job, Reply, Setup, TrainJob};
use rand::SeedableRng;
use rand_chacha::ChaCha12Rng;
use tch::Device;

use crate::client::difference;
use crate::data::partition::{Partitioner, Plan};
use crate::data::{DataSource, Dataset};
use crate::error::{ClientError, Result};
use crate::network::Network;
use crate::trainer::{EvaluateRequest, TrainRequest, Trainer};
use crate::SupervisedTrainer;

/// Serves jobs from `input` until it closes: the setup frame first, then one reply per job.
pub fn serve(mut input: impl BufRead, mut output: impl Write) -> Result<()> {
    let (setup, _): (Setup, _) = simulation::read_frame(&mut input).map_err(protocol)?;
    // A setup this worker cannot serve (data it cannot read, say) fails every job with why,
    // so the engine can say it.
    let mut worker = Worker::new(setup).map_err(|e| e.to_string());
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
        let (reply, payload) = match done {
            Ok(done) => done,
            Err(e) => (
                Reply::Failed {
                    error: e.to_string(),
                },
                Vec::new(),
            ),
        };
        simulation::write_frame(&mut output, &reply, &payload).map_err(protocol)?;
    }
}

fn protocol(e: FrameError) -> ClientError {
    ClientError::Protocol(format!("simulation worker: {e}"))
}

struct Worker {
    setup: Setup,
    source: DataSource,
    /// How a dataset that is not synthetic is split; the dataset and its split, once read.
    partition: Option<Partitioner>,
    pooled: Option<(Dataset, Plan)>,
    /// The last global model read, by digest (a round's jobs share it).
    model: Option<(ModelDigest, Model)>,
}

impl Worker {
    fn new(setup: Setup) -> Result<Self> {
        if setup.protocol != simulation::PROTOCOL {
            return Err(ClientError::Protocol(format!(
                "the engine speaks simulation protocol {}, this worker {}: run a hora-client of the same release as hora-server",
                setup.protocol,
                simulation::PROTOCOL
            )));
        }
        let mut source: DataSource = setup
            .data
            .parse()
            .map_err(|e| ClientError::Training(format!("--data: {e}")))?;
        let partition = match (&mut source, &setup.partition) {
            (DataSource::Synthetic(_), Some(p)) => {
                return Err(ClientError::Training(format!(
                    "--partition {p}: synthetic data is split among clients by its generator; partition a dataset (FILE.csv, mnist:DIR) instead"
                )))
            }
            (DataSource::Synthetic(config), None) => {
                config.clients = usize::try_from(setup.clients).unwrap_or(usize::MAX);
                config.seed = setup.seed;
                None
            }
            (_, p) => Some(
                p.as_deref()
                    .unwrap_or("iid")
                    .parse::<Partitioner>()
                    .map_err(|e| ClientError::Training(e.to_string()))?,
            ),
        };
        tch::set_num_threads(setup.threads.max(1) as i32);
        Ok(Worker {
            setup,
            source,
            partition,
            pooled: None,
            model: None,
        })
    }

    fn run(&mut self, job: Job) -> Result<(Reply, Vec<u8>)> {
        match job {
            Job::Initial { model_kind, seed } => {
                tch::manual_seed(seed as i64);
                let net = Network::for_kind(&model_kind, None, Device::Cpu)?;
                Ok((Reply::Initial, net.weights()?.to_safetensors()))
            }
            Job::Sizes { clients } => {
                let mut examples = Vec::with_capacity(clients.len());
                for c in clients {
                    examples.push(self.data(c)?.0.len() as u64);
                }
                Ok((Reply::Sizes { examples }, Vec::new()))
            }
            Job::Train(job) => self.train(job),
            Job::Evaluate {
                model,
                model_kind,
                clients,
            } => self.evaluate(model, &model_kind, &clients),
        }
    }

    /// Client `client`'s training and held-out data.
    fn data(&mut self, client: u64) -> Result<(Dataset, Option<Dataset>)> {
        if client >= self.setup.clients {
            return Err(ClientError::Training(format!(
                "client {client} is not in the federation of {} clients",
                self.setup.clients
            )));
        }
        let k = usize::try_from(client).map_err(|_| ClientError::Training("client id".into()))?;
        let Some(partitioner) = self.partition else {
            return Ok(self.source.load(Some(k), 0.0)?);
        };
        if self.pooled.is_none() {
            // The whole dataset once per worker; each client's share of it when it trains.
            let (data, _) = self.source.load(None, 0.0)?;
            let clients = usize::try_from(self.setup.clients).unwrap_or(usize::MAX);
            let plan = Plan::new(
                partitioner,
                &data.labels,
                data.num_classes,
                clients,
                self.setup.seed,
            )?;
            self.pooled = Some((data, plan));
        }
        let Some((data, plan)) = &self.pooled else {
            unreachable!("read just above");
        };
        let shard = data.subset(&plan.indices(k));
        let (train, test) = shard.split(0.8, client_seed(self.setup.seed, client, 1))?;
        Ok((train, Some(test)))
    }

    fn global(&mut self, digest: ModelDigest) -> Result<Model> {
        if let Some((d, model)) = &self.model {
            if *d == digest {
                return Ok(model.clone());
            }
        }
        let path = self.setup.models_dir.join(format!("{digest}.safetensors"));
        let model = Model::read_file(&path, &Limits::default())?;
        if model.digest() != digest {
            return Err(ClientError::Protocol(format!(
                "{} does not hold model {digest}",
                path.display()
            )));
        }
        self.model = Some((digest, model.clone()));
        Ok(model)
    }

    fn train(&mut self, job: TrainJob) -> Result<(Reply, Vec<u8>)> {
        let started = Instant::now();
        let global = self.global(job.model)?;
        let (train, test) = self.data(job.client)?;
        let seed = client_seed(self.setup.seed, job.client, 0) as i64;
        let mut trainer = SupervisedTrainer::new(train, test, Device::Cpu)?.with_seed(Some(seed));
        let outcome = trainer.train(
            &global,
            TrainRequest {
                task: "simulation",
                round: job.round,
                config: &job.training,
                model_kind: &job.model_kind,
                module: None,
                trainable: job.trainable.as_deref(),
                // (Simulated time decides stragglers: training always runs its epochs.)
                deadline: Instant::now() + Duration::from_secs(365 * 24 * 3600),
                progress: &mut |_| {},
            },
        )?;
        let local = match &job.trainable {
            Some(_) => outcome.weights.only(|name| global.tensor(name).is_some()),
            None => outcome.weights,
        };
        let mut delta = difference(&local, &global)?;
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
                    delta.write_file(&residual)?;
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

    /// `model` on the pooled held-out data of `clients`.
    fn evaluate(
        &mut self,
        digest: ModelDigest,
        model_kind: &hora_common::wire::ModelKind,
        clients: &[u64],
    ) -> Result<(Reply, Vec<u8>)> {
        let model = self.global(digest)?;
        let mut pooled: Option<Dataset> = None;
        for &client in clients {
            let Some(test) = self.data(client)?.1 else {
                continue;
            };
            match &mut pooled {
                None => pooled = Some(test),
                Some(p) => {
                    p.features.extend_from_slice(&test.features);
                    p.labels.extend_from_slice(&test.labels);
                }
            }
        }
        let Some(pooled) = pooled.filter(|p| !p.is_empty()) else {
            return Ok((
                Reply::Evaluated {
                    loss: 0.0,
                    accuracy: 0.0,
                    examples: 0,
                },
                Vec::new(),
            ));
        };
        let mut trainer = SupervisedTrainer::new(pooled.clone(), Some(pooled), Device::Cpu)?;
        let evaluation = trainer
            .evaluate(
                &model,
                EvaluateRequest {
                    task: "simulation",
                    round: 0,
                    model_kind,
                    module: None,
                },
            )?
            .ok_or_else(|| ClientError::Training("no held-out data to evaluate on".into()))?;
        Ok((
            Reply::Evaluated {
                loss: evaluation.loss,
                accuracy: evaluation.accuracy,
                examples: evaluation.examples,
            },
            Vec::new(),
        ))
    }
}
