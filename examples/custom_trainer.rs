//! Bring your own model and data with the SDK: a [`Trainer`] written here (linear regression,
//! y = w·x + b, trained with plain tch tensors and mean squared error) and three in-process
//! clients built on [`hora_client::Client`], each holding its own private points of the line
//! y = 3x − 1 with noise. The SDK does the rest: enrolment, long polling, sealing, uploading.
//!
//! `cargo run --release --example custom_trainer`. Fails unless the federation recovers the line.

#[path = "support/federation.rs"]
mod federation;

use anyhow::{ensure, Result};
use hora_client::{Client, ClientConfig, Progress, TrainOutcome, TrainRequest, Trainer};
use hora_common::model::Model;
use hora_common::wire::{CreateTask, Metrics, ModelKind, StrategyConfig, TrainingConfig};
use tch::{Kind, Tensor};

use federation::Federation;

/// One client's private data and its own training loop.
struct LineFit {
    xs: Tensor,
    ys: Tensor,
}

impl LineFit {
    fn new(seed: i64, n: i64) -> Self {
        tch::manual_seed(seed);
        let xs = Tensor::rand([n, 1], (Kind::Float, tch::Device::Cpu)) * 4.0 - 2.0;
        let noise = Tensor::randn([n, 1], (Kind::Float, tch::Device::Cpu)) * 0.1;
        let ys = &xs * 3.0 - 1.0 + noise;
        LineFit { xs, ys }
    }
}

impl Trainer for LineFit {
    fn train(
        &mut self,
        global: &Model,
        request: TrainRequest<'_>,
    ) -> hora_client::Result<TrainOutcome> {
        let value = |name: &str| f64::from(global.tensor(name).map_or(0.0, |t| t[0]));
        let mut w = Tensor::from(value("w")).set_requires_grad(true);
        let mut b = Tensor::from(value("b")).set_requires_grad(true);
        let lr = request.config.learning_rate;
        let steps = request.config.epochs.max(1);
        let mut loss_value = 0.0;
        for step in 0..steps {
            let loss = (&self.xs * &w + &b - &self.ys).square().mean(Kind::Float);
            loss.backward();
            tch::no_grad(|| {
                let _ = w.f_sub_(&(w.grad() * lr));
                let _ = b.f_sub_(&(b.grad() * lr));
            });
            let _ = w.grad().zero_();
            let _ = b.grad().zero_();
            loss_value = loss.double_value(&[]);
            (request.progress)(Progress {
                epoch: step + 1,
                epochs: steps,
                samples: u64::from(step + 1) * self.xs.size()[0] as u64,
                total_samples: u64::from(steps) * self.xs.size()[0] as u64,
                loss: loss_value,
            });
        }
        let weights = Model::from_tensors([
            ("b", vec![1], vec![b.double_value(&[]) as f32]),
            ("w", vec![1], vec![w.double_value(&[]) as f32]),
        ])?;
        Ok(TrainOutcome {
            weights,
            num_examples: self.xs.size()[0] as u64,
            metrics: Metrics {
                loss: Some(loss_value),
                accuracy: None,
            },
            stopped_early: false,
        })
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    let fed = Federation::start()?;
    let initial = Model::from_tensors([("b", vec![1], vec![0.0]), ("w", vec![1], vec![0.0])])?;
    let digest = fed.upload_model(&initial).await?;
    let rounds = 10;
    fed.create_task(&CreateTask {
        parent: None,
        trainable: None,
        evaluation: None,
        compression: None,
        id: "line".into(),
        initial_model: digest,
        // The server only needs a name for models it does not know; our trainer ignores it.
        model: ModelKind::Builtin {
            name: "line".into(),
            params: Default::default(),
        },
        strategy: StrategyConfig::FedAvg,
        rounds,
        min_clients: 3,
        target_clients: 3,
        over_selection: 0.0,
        round_deadline_secs: 60,
        training: TrainingConfig {
            epochs: 20,
            learning_rate: 0.1,
            ..Default::default()
        },
        secure_aggregation: None,
        update_bounds: Default::default(),
        differential_privacy: None,
        asynchronous: None,
    })
    .await?;

    let mut clients = Vec::new();
    for k in 0..3 {
        let token = fed.enrolment_token().await?;
        let config = ClientConfig::new(
            &fed.url,
            &fed.ca,
            fed.dir.path().join(format!("client-{k}")),
        );
        let client = Client::connect(config, Some(&token)).await?;
        let mut trainer = LineFit::new(k, 50 + 25 * k);
        clients.push(tokio::spawn(async move {
            client
                .run("line", &mut trainer, None, &mut |_| {}, &mut |r| {
                    println!(
                        "client {k}: round {} loss {:.4}",
                        r.round,
                        r.metrics.loss.unwrap_or(f64::NAN)
                    )
                })
                .await
        }));
    }
    for c in clients {
        c.await??;
    }
    let info = fed.task("line").await?;
    ensure!(
        info.published_rounds == rounds,
        "{} of {rounds} rounds published",
        info.published_rounds
    );
    let global = fed.round_model("line", rounds).await?;
    let (w, b) = (
        global.tensor("w").unwrap_or(&[0.0])[0],
        global.tensor("b").unwrap_or(&[0.0])[0],
    );
    println!("federated fit after {rounds} rounds: y = {w:.3}x {b:+.3} (truth: y = 3x - 1)");
    ensure!(
        (w - 3.0).abs() < 0.1 && (b + 1.0).abs() < 0.1,
        "the federation did not recover the line"
    );
    Ok(())
}
