//! The federated Synthetic benchmark, end to end with real processes: a `hora-server` (embedded
//! sled, development TLS), a task training multinomial logistic regression, and one
//! `hora-client train` process per client, each generating only its own shard of the FedProx
//! paper's Synthetic(α, β) (or Synthetic-IID) data. After every round the published global model
//! is scored on the pooled held-out data, and each client evaluates it on its own held-out split
//! (federated evaluation: the task's history holds the example-weighted result, shown next to
//! the pooled score), and at the end a centralised model trained on the
//! pooled training data with the same budget (rounds × local epochs, same batch size and learning
//! rate) gives the reference accuracy.
//!
//! This is `make demo`: `cargo run --release --example federated` (defaults: 10 clients,
//! 20 rounds, Synthetic(1,1)). By default it federates twice on the same data, from the same
//! initial model and with the same budget: FedAvg, then FedProx (`--fedprox-mu`, μ = 0.1), whose
//! proximal term keeps each client's local model near the global one and so copes with data as
//! heterogeneous as Synthetic(1,1)'s. `--strategy`, `--proximal-mu` or `--dp` (or `--single`)
//! run only the federation they describe. `--iid`, `--alpha`, `--beta`, `--clients`, `--rounds`
//! and the training options (Adam at 0.01, 5 local epochs, batch 10 by default) change it;
//! `--json` adds a machine-readable summary line.

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
    CreateTask, DpConfig, EvaluationConfig, OptimizerConfig, StrategyConfig, TaskState,
    TrainingConfig,
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
    /// FedProx's μ for the second federation of the default comparison.
    #[arg(long, default_value_t = 0.1, value_parser = positive,
          conflicts_with_all = ["single", "strategy", "proximal_mu", "dp"])]
    fedprox_mu: f64,
    /// Run only the federation the options describe (no FedProx comparison).
    #[arg(long)]
    single: bool,
    /// Print a final `RESULT {json}` line.
    #[arg(long)]
    json: bool,
    /// Leave the server up at the end (until Ctrl-C), to look at the federations in its
    /// dashboard (`make demo KEEP=1`).
    #[arg(long)]
    keep: bool,
}

/// One federation of the demo: its label and what the server and the clients are told.
struct Run {
    label: String,
    task: String,
    strategy: StrategyConfig,
    training: TrainingConfig,
    dp: Option<DpConfig>,
}

/// What every federation of the demo shares: the data, the model and the scoring.
struct Setup {
    clients: usize,
    rounds: u64,
    data: String,
    arch: Architecture,
    initial: hora_common::model::Model,
    test: DeviceData,
}

/// Runs one federation to its end; the published models' test accuracy, round 0 first, and
/// the last round's ε under differential privacy.
async fn federate(
    fed: &mut Federation,
    setup: &Setup,
    run: &Run,
) -> Result<(Vec<f64>, Option<f64>)> {
    let digest = fed.upload_model(&setup.initial).await?;
    fed.create_task(&CreateTask {
        parent: None,
        trainable: None,
        // Every client evaluates every published model on its own held-out split.
        evaluation: Some(EvaluationConfig {
            every: 1,
            clients: setup.clients as u32,
            fraction: None,
            held_out: false,
            deadline_secs: None,
        }),
        compression: None,
        id: run.task.clone(),
        initial_model: digest,
        model: setup.arch.to_kind(),
        strategy: run.strategy.clone(),
        rounds: setup.rounds,
        min_clients: setup.clients as u32,
        target_clients: setup.clients as u32,
        over_selection: 0.0,
        round_deadline_secs: 300,
        training: run.training.clone(),
        secure_aggregation: None,
        update_bounds: Default::default(),
        differential_privacy: run.dp.clone(),
        asynchronous: None,
    })
    .await?;
    for k in 0..setup.clients {
        let extra = vec!["--seed".to_string(), k.to_string()];
        fed.spawn_named_shard_client(
            &format!("{}-client-{k}", run.task),
            &run.task,
            &setup.data,
            k,
            &extra,
        )
        .await?;
    }
    println!(
        "\n{}: strategy {}; FedProx μ {}; differential privacy {}",
        run.label,
        serde_json::to_string(&run.strategy)?,
        run.training.proximal_mu,
        run.dp
            .as_ref()
            .map_or("off".to_string(), |d| serde_json::to_string(d)
                .unwrap_or_default()),
    );
    println!(
        "{:>5}  {:>7}  {:>8}  {:>10}  {:>13}  {:>7}",
        "round", "clients", "examples", "train loss", "test accuracy", "ε"
    );
    let mut accuracy = vec![score(&setup.arch, &setup.initial, &setup.test)?];
    println!(
        "{:>5}  {:>7}  {:>8}  {:>10}  {:>13.4}",
        0, "-", "-", "-", accuracy[0]
    );
    let mut epsilon = None;
    for round in 1..=setup.rounds {
        let record = fed
            .wait_round(&run.task, round, Duration::from_secs(600))
            .await?;
        let model = fed.round_model(&run.task, round).await?;
        accuracy.push(score(&setup.arch, &model, &setup.test)?);
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
        let info = fed.task(&run.task).await?;
        // (Finished after its last round is no early end: a fast task gets there before this
        // loop reads its next round.)
        if round < setup.rounds
            && info.state == TaskState::Finished
            && info.published_rounds == round
        {
            println!("the task finished early (its privacy budget)");
            break;
        }
    }
    fed.wait_clients(Duration::from_secs(60))?;
    // The clients' federated evaluation of each round's model (their held-out splits stay
    // with them), next to the same model scored here on those splits pooled.
    println!(
        "{:>5}  {:>19}  {:>14}  {:>21}",
        "round", "federated accuracy", "federated loss", "centralised accuracy"
    );
    for record in fed.rounds(&run.task).await? {
        let Some(e) = record.evaluation else {
            continue;
        };
        let show = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.4}"));
        println!(
            "{:>5}  {:>19}  {:>14}  {:>21}",
            record.round,
            format!("{} ({} clients)", show(e.accuracy), e.clients),
            show(e.loss),
            show(accuracy.get(record.round as usize).copied()),
        );
    }
    Ok((accuracy, epsilon))
}

fn positive(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v > 0.0 && v.is_finite() => Ok(v),
        _ => Err("a positive number (FedProx with μ = 0 is FedAvg)".into()),
    }
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
    let setup = Setup {
        clients: args.clients,
        rounds: args.rounds,
        data,
        arch: arch.clone(),
        initial: initial.clone(),
        test,
    };
    let configured = Run {
        label: "the configured federation".into(),
        task: "synthetic".into(),
        strategy: args.strategy.clone().unwrap_or_default(),
        training: training.clone(),
        dp: args.dp.clone(),
    };
    let compare =
        !args.single && args.strategy.is_none() && args.proximal_mu == 0.0 && args.dp.is_none();
    let runs = if compare {
        vec![
            Run {
                label: "FedAvg".into(),
                ..configured
            },
            Run {
                label: "FedProx".into(),
                task: "synthetic-fedprox".into(),
                strategy: StrategyConfig::default(),
                training: TrainingConfig {
                    proximal_mu: args.fedprox_mu,
                    ..training.clone()
                },
                dp: None,
            },
        ]
    } else {
        vec![configured]
    };
    let mut fed = Federation::start()?;
    let mut results = Vec::new();
    for run in &runs {
        results.push(federate(&mut fed, &setup, run).await?);
    }
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
    let centralized = evaluate(&mut net, &setup.test, 4096)?.accuracy;
    println!("\ncentralised model (pooled data, {epochs} epochs): test accuracy {centralized:.4}");
    for (run, (accuracy, _)) in runs.iter().zip(&results) {
        let last = *accuracy.last().unwrap_or(&f64::NAN);
        println!(
            "{:<26} after {} rounds: test accuracy {last:.4} ({:.2}x centralised)",
            run.label,
            accuracy.len() - 1,
            last / centralized
        );
    }
    println!("{} federation(s) took {federated_secs:.1} s", runs.len());
    if args.json {
        let runs: Vec<_> = runs
            .iter()
            .zip(&results)
            .map(|(run, (accuracy, epsilon))| {
                serde_json::json!({"label": run.label, "accuracy": accuracy,
                    "strategy": run.strategy, "proximal_mu": run.training.proximal_mu,
                    "dp": run.dp, "epsilon": epsilon})
            })
            .collect();
        println!(
            "RESULT {}",
            serde_json::json!({"runs": runs, "centralized": centralized, "iid": args.iid})
        );
    }
    fed.kill_clients();
    println!(
        "\ndashboard: {}/dashboard/ (the browser warns of the development certificate; its CA is {})",
        fed.url,
        fed.ca.display()
    );
    println!("sign in once with: {}", fed.sign_in_link().await?);
    if args.keep {
        println!("the server stays up until Ctrl-C");
        tokio::signal::ctrl_c().await?;
    } else {
        println!("(the server stops now: `make demo KEEP=1` keeps it up to look)");
    }
    Ok(())
}
