//! The built-in population (`hora-simulate-worker`): a client's data is made from
//! `(data, seed, client)` when its job comes (a synthetic shard is generated, never read from
//! anyone else's; a dataset is read once per worker and the client's share of it taken by the
//! partitioner), and its trainer is the [`SupervisedTrainer`] a deployed `hora-client train`
//! runs, seeded from `(seed, client)`.

use std::io::{BufRead, Write};

use hora_common::model::Model;
use hora_common::simulation::{client_seed, Setup};
use hora_common::wire::ModelKind;
use tch::Device;

use super::Population;
use crate::data::partition::{Partitioner, Plan};
use crate::data::{DataSource, Dataset};
use crate::error::{ClientError, Result};
use crate::network::Network;
use crate::trainer::{EvaluateRequest, Evaluation, Trainer};
use crate::SupervisedTrainer;

/// Serves the engine on `input` and `output` with the built-in trainer.
pub fn serve(input: impl BufRead, output: impl Write) -> Result<()> {
    super::serve(input, output, Builtin::open)
}

/// Clients of a synthetic generator or of a partitioned dataset, trained by the built-in
/// trainer.
pub struct Builtin {
    clients: u64,
    seed: u64,
    source: DataSource,
    /// How a dataset that is not synthetic is split; the dataset and its split, once read.
    partition: Option<Partitioner>,
    pooled: Option<(Dataset, Plan)>,
}

impl Builtin {
    pub fn open(setup: &Setup) -> Result<Self> {
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
        Ok(Builtin {
            clients: setup.clients,
            seed: setup.seed,
            source,
            partition,
            pooled: None,
        })
    }

    /// Client `client`'s training and held-out data.
    fn data(&mut self, client: u64) -> Result<(Dataset, Option<Dataset>)> {
        let k = usize::try_from(client).map_err(|_| ClientError::Training("client id".into()))?;
        let Some(partitioner) = self.partition else {
            return Ok(self.source.load(Some(k), 0.0)?);
        };
        if self.pooled.is_none() {
            // The whole dataset once per worker; each client's share of it when it trains.
            let (data, _) = self.source.load(None, 0.0)?;
            let clients = usize::try_from(self.clients).unwrap_or(usize::MAX);
            let plan = Plan::new(
                partitioner,
                &data.labels,
                data.num_classes,
                clients,
                self.seed,
            )?;
            self.pooled = Some((data, plan));
        }
        let Some((data, plan)) = &self.pooled else {
            unreachable!("read just above");
        };
        let shard = data.subset(&plan.indices(k));
        let (train, test) = shard.split(0.8, client_seed(self.seed, client, 1))?;
        Ok((train, Some(test)))
    }
}

impl Population for Builtin {
    fn examples(&mut self, client: u64) -> Result<u64> {
        Ok(self.data(client)?.0.len() as u64)
    }

    fn trainer(&mut self, client: u64) -> Result<Box<dyn Trainer>> {
        let (train, test) = self.data(client)?;
        let seed = client_seed(self.seed, client, 0) as i64;
        let trainer = SupervisedTrainer::new(train, test, Device::Cpu)?.with_seed(Some(seed));
        Ok(Box::new(trainer))
    }

    fn initial(&mut self, model_kind: &ModelKind, seed: u64) -> Result<Model> {
        tch::manual_seed(seed as i64);
        Network::for_kind(model_kind, None, Device::Cpu)?.weights()
    }

    /// On the clients' held-out data pooled, in one pass.
    fn evaluate(
        &mut self,
        model: &Model,
        model_kind: &ModelKind,
        clients: &[u64],
    ) -> Result<Evaluation> {
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
            return Ok(Evaluation {
                loss: 0.0,
                accuracy: 0.0,
                examples: 0,
            });
        };
        let mut trainer = SupervisedTrainer::new(pooled.clone(), Some(pooled), Device::Cpu)?;
        let request = EvaluateRequest {
            task: "simulation",
            round: 0,
            model_kind,
            module: None,
        };
        trainer
            .evaluate(model, request)?
            .ok_or_else(|| ClientError::Training("no held-out data to evaluate on".into()))
    }
}
