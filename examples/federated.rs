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
use hora_common::wire::{
    CreateTask, DpConfig, OptimizerConfig, StrategyConfig, TaskState, TrainingConfig,
};
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
    /// The server's strategy as JSON, e.g. `{"name":"fed_adam","eta":0.03}` (default FedAvg).
    #[arg(long, value_parser = json_arg::<StrategyConfig>)]
    strategy: Option<StrategyConfig>,
    /// FedProx's proximal coefficient μ for the clients' local training (0: none).
    #[arg(long, default_value_t = 0.0)]
    proximal_mu: f64,
    /// Central differential privacy as JSON, e.g.
    /// `{"noise_multiplier":1.0,"clip":{"mode":"fixed","norm":0.5}}`.
    #[arg(long, value_parser = json_arg::<DpConfig>)]
    dp: Option<DpConfig>,
    /// Print a final `RESULT {json}` line.
    #[arg(long)]
    json: bool,
}

fn json_arg<T: serde::de::DeserializeOwned>(s: &str) -> Result<T, String> {
    serde_json::from_str(s).map_err(|e| format!("not valid here: {e}"))
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
        proximal_mu: args.proximal_mu,
        ..Default::default()
    };

    let mut fed = Federation::start()?;
    let digest = fed.upload_model(&initial).await?;
    let task = "synthetic";
    fed.create_task(&CreateTask {
        id: task.into(),
        initial_model: digest,
        model: arch.to_kind(),
        strategy: args.strategy.clone().unwrap_or_default(),
        rounds: args.rounds,
        min_clients: args.clients as u32,
        target_clients: args.clients as u32,
        over_selection: 0.0,
        round_deadline_secs: 300,
        training: training.clone(),
        secure_aggregation: None,
        update_bounds: Default::default(),
        differential_privacy: args.dp.clone(),
        asynchronous: None,
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
        "strategy {}; FedProx μ {}; differential privacy {}",
        serde_json::to_string(&args.strategy.clone().unwrap_or_default())?,
        args.proximal_mu,
        args.dp
            .as_ref()
            .map_or("off".to_string(), |d| serde_json::to_string(d)
                .unwrap_or_default()),
    );
    println!(
        "{:>5}  {:>7}  {:>8}  {:>10}  {:>13}  {:>7}",
        "round", "clients", "examples", "train loss", "test accuracy", "ε"
    );
    let mut accuracy = vec![score(&arch, &initial, &test)?];
    println!(
        "{:>5}  {:>7}  {:>8}  {:>10}  {:>13.4}",
        0, "-", "-", "-", accuracy[0]
    );
    let mut epsilon = None;
    for round in 1..=args.rounds {
        let record = fed
            .wait_round(task, round, Duration::from_secs(600))
            .await?;
        let model = fed.round_model(task, round).await?;
        accuracy.push(score(&arch, &model, &test)?);
        epsilon = record.privacy.as_ref().map(|p| p.epsilon);
        println!(
            "{:>5}  {:>7}  {:>8}  {:>10}  {:>13.4}  {:>7}",
            round,
            record.participants.len(),
            record.examples,
            record
                .metrics
                .loss
                .map_or("-".into(), |l| format!("{l:.4}")),
            accuracy[round as usize],
            record
                .privacy
                .as_ref()
                .map_or("-".into(), |p| format!("{:.2}", p.epsilon)),
        );
        if round < args.rounds && fed.task(task).await?.state == TaskState::Finished {
            println!("the task finished early (its privacy budget)");
            break;
        }
    }
    fed.wait_clients(Duration::from_secs(60))?;
    let federated_secs = started.elapsed().as_secs_f64();

    // Centralised: the pooled training data, the same initial model and the same budget.
    let mut net = Network::builtin(&arch, Device::Cpu)?;
    net.set_weights(&initial)?;
    let train = DeviceData::new(&pooled_train, Device::Cpu)?;
    let epochs = args.epochs * args.rounds as u32;
    // Plain local training: FedProx's proximal term has no global model to pull towards here.
    let centralised_training = TrainingConfig {
        proximal_mu: 0.0,
        ..training.clone()
    };
    fit(
        &mut net,
        &train,
        &centralised_training,
        epochs,
        None,
        &mut |_| {},
    )?;
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
            serde_json::json!({"accuracy": accuracy, "centralized": centralized, "iid": args.iid,
                "strategy": args.strategy, "proximal_mu": args.proximal_mu, "dp": args.dp,
                "epsilon": epsilon})
        );
    }
    Ok(())
}
