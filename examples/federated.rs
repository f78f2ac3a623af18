//! The federated Synthetic benchmark, end to end with real processes: a `hora-server` (embedded
//! sled, development TLS), a task training multinomial logistic regression, and one
//! `hora-client train` process per client, each generating only its own shard of the FedProx
//! paper's Synthetic(α, β) (or Synthetic-IID) data. After every round the published global model
//! is scored on the pooled held-out data, and at the end a centralised model trained on the
//! pooled training data with the same budget (rounds × local epochs, same batch size and learning
//! rate) gives the reference accuracy.
//!
//! This is `make demo`: `cargo run --release --example federated` (defaults: 10 clients,
//! 20 rounds, Synthetic(1,1)). `--iid`, `--alpha`, `--beta`, `--clients`, `--rounds` and the
//! training options (Adam at 0.01, 5 local epochs, batch 10 by default) change it; `--json` adds a machine-readable summary line.

#[path = "support/federation.rs"]
mod federation;

use std::time::{Duration, Instant};

use anyhow::Result;
use clap::Parser;
use hora_client::data::synthetic::{self, SyntheticConfig};
use hora_client::data::Dataset;
use hora_client::network::{Architecture, Network};
use hora_client::supervised::{evaluate, fit, DeviceData};
use hora_common::wire::{CreateTask, OptimizerConfig, StrategyConfig, TrainingConfig};
use tch::Device;

use federation::Federation;

#[derive(Parser)]
struct Args {
    #[arg(long, default_value_t = 10)]
    clients: usize,
    #[arg(long, default_value_t = 20)]
    rounds: u64,
    /// Synthetic-IID instead of Synthetic(α, β).
    #[arg(long)]
    iid: bool,
    #[arg(long, default_value_t = 1.0)]
    alpha: f64,
    #[arg(long, default_value_t = 1.0)]
    beta: f64,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Local epochs per round.
    #[arg(long, default_value_t = 5)]
    epochs: u32,
    #[arg(long, default_value_t = 10)]
    batch_size: u32,
    #[arg(long, default_value_t = 0.01)]
    learning_rate: f64,
    /// SGD (with --momentum) instead of Adam.
    #[arg(long)]
    sgd: bool,
    /// SGD momentum.
    #[arg(long, default_value_t = 0.0)]
    momentum: f64,
    /// Samples per client: the power law's minimum and cap.
    #[arg(long, default_value_t = 500)]
    min_samples: usize,
    #[arg(long, default_value_t = 5000)]
    max_samples: usize,
    /// Print a final `RESULT {json}` line.
    #[arg(long)]
    json: bool,
}

fn score(arch: &Architecture, model: &hora_common::model::Model, test: &DeviceData) -> Result<f64> {
    let mut net = Network::builtin(arch, Device::Cpu)?;
    net.set_weights(model)?;
    Ok(evaluate(&mut net, test, 4096)?.accuracy)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    let args = Args::parse();
    // The model is tiny: libtorch's intra-op threads cost more than they give, and the clients
    // (one thread each) need the cores.
    tch::set_num_threads(1);
    let started = Instant::now();
    let mut config = if args.iid {
        SyntheticConfig::iid(args.clients, args.seed)
    } else {
        SyntheticConfig::non_iid(args.alpha, args.beta, args.clients, args.seed)
    };
    config.min_samples = args.min_samples;
    config.max_samples = args.max_samples;
    // Each client process generates its own shard from this description.
    let data = config.to_string();
    // The same shards the clients generate for themselves, pooled for scoring and the baseline.
    let shards = synthetic::shards(&config)?;
    let pooled_train = Dataset::concat(&shards.iter().map(|s| &s.train).collect::<Vec<_>>())?;
    let pooled_test = Dataset::concat(&shards.iter().map(|s| &s.test).collect::<Vec<_>>())?;
    let test = DeviceData::new(&pooled_test, Device::Cpu)?;
    let arch = Architecture::Logreg {
        inputs: config.dim,
        classes: config.classes,
    };
    tch::manual_seed(args.seed as i64);
    let initial = Network::builtin(&arch, Device::Cpu)?.weights()?;
    let training = TrainingConfig {
        epochs: args.epochs,
        batch_size: args.batch_size,
        learning_rate: args.learning_rate,
        optimizer: if args.sgd {
            OptimizerConfig::Sgd {
                momentum: args.momentum,
            }
        } else {
            OptimizerConfig::Adam
        },
        ..Default::default()
    };

    let mut fed = Federation::start()?;
    let digest = fed.upload_model(&initial).await?;
    let task = "synthetic";
    fed.create_task(&CreateTask {
        id: task.into(),
        initial_model: digest,
        model: arch.to_kind(),
        strategy: StrategyConfig::FedAvg,
        rounds: args.rounds,
        min_clients: args.clients as u32,
        target_clients: args.clients as u32,
        over_selection: 0.0,
        round_deadline_secs: 300,
        training: training.clone(),
        secure_aggregation: None,
        update_bounds: Default::default(),
        differential_privacy: None,
    })
    .await?;
    fed.spawn_clients(task, &data, args.clients, &["--seed", "{k}"])
        .await?;
    println!(
        "{} clients on {} ({} training and {} held-out samples in all; shard sizes {}..{}), \
         logistic regression, {} local epoch(s) of batch {} at lr {} ({})",
        args.clients,
        if args.iid {
            "Synthetic-IID".to_string()
        } else {
            format!("Synthetic({}, {})", args.alpha, args.beta)
        },
        pooled_train.len(),
        pooled_test.len(),
        shards
            .iter()
            .map(|s| s.train.len() + s.test.len())
            .min()
            .unwrap_or(0),
        shards
            .iter()
            .map(|s| s.train.len() + s.test.len())
            .max()
            .unwrap_or(0),
        args.epochs,
        args.batch_size,
        args.learning_rate,
        if args.sgd { "SGD" } else { "Adam" },
    );
    println!(
        "{:>5}  {:>7}  {:>8}  {:>10}  {:>13}",
        "round", "clients", "examples", "train loss", "test accuracy"
    );
    let mut accuracy = vec![score(&arch, &initial, &test)?];
    println!(
        "{:>5}  {:>7}  {:>8}  {:>10}  {:>13.4}",
        0, "-", "-", "-", accuracy[0]
    );
    for round in 1..=args.rounds {
        let record = fed
            .wait_round(task, round, Duration::from_secs(600))
            .await?;
        let model = fed.round_model(task, round).await?;
        accuracy.push(score(&arch, &model, &test)?);
        println!(
            "{:>5}  {:>7}  {:>8}  {:>10}  {:>13.4}",
            round,
            record.participants.len(),
            record.examples,
            record
                .metrics
                .loss
                .map_or("-".into(), |l| format!("{l:.4}")),
            accuracy[round as usize],
        );
    }
    fed.wait_clients(Duration::from_secs(60))?;
    let federated_secs = started.elapsed().as_secs_f64();

    // Centralised: the pooled training data, the same initial model and the same budget.
    let mut net = Network::builtin(&arch, Device::Cpu)?;
    net.set_weights(&initial)?;
    let train = DeviceData::new(&pooled_train, Device::Cpu)?;
    let epochs = args.epochs * args.rounds as u32;
    fit(&mut net, &train, &training, epochs, None, &mut |_| {})?;
    let centralized = evaluate(&mut net, &test, 4096)?.accuracy;
    let last = *accuracy.last().unwrap_or(&f64::NAN);
    println!(
        "centralised model (pooled data, {epochs} epochs): test accuracy {centralized:.4}; \
         federated after {} rounds: {last:.4} ({:.2}x); federation took {federated_secs:.1} s",
        args.rounds,
        last / centralized
    );
    if args.json {
        println!(
            "RESULT {}",
            serde_json::json!({"accuracy": accuracy, "centralized": centralized, "iid": args.iid})
        );
    }
    Ok(())
}
