//! A TorchScript model trained federated: the operator writes the model in Python
//! (`examples/support/make_torchscript.py`, `torch.jit.script`), uploads the `.pt` with its
//! initial weights, and the server hands the module out with each round's weights. The
//! `hora-client` processes train its parameters through libtorch: no Python on the clients.
//!
//! `cargo run --release --example torchscript` (needs `python3` with torch to write the module,
//! or `--module FILE.pt`). Fails unless the federated model clearly beats the initial one.

#[path = "support/federation.rs"]
mod federation;

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use clap::Parser;
use hora_client::data::synthetic::{self, SyntheticConfig};
use hora_client::data::Dataset;
use hora_client::network::Network;
use hora_client::supervised::{evaluate, DeviceData};
use hora_common::wire::{CreateTask, ModelKind, OptimizerConfig, StrategyConfig, TrainingConfig};
use tch::Device;

use federation::Federation;

#[derive(Parser)]
struct Args {
    /// A module to use instead of writing one with Python.
    #[arg(long)]
    module: Option<PathBuf>,
    /// The Python with torch that writes the module.
    #[arg(long, env = "HORA_PYTHON", default_value = "python3")]
    python: String,
    #[arg(long, default_value_t = 4)]
    clients: usize,
    #[arg(long, default_value_t = 5)]
    rounds: u64,
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    let args = Args::parse();
    tch::set_num_threads(1); // a small model; the client processes need the cores
    let mut fed = Federation::start()?;
    let module = match args.module {
        Some(m) => m,
        None => {
            let out = fed.dir.path().join("model.pt");
            let script = concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/examples/support/make_torchscript.py"
            );
            let status = Command::new(&args.python)
                .arg(script)
                .arg(&out)
                .status()
                .with_context(|| {
                    format!(
                        "running {} (set HORA_PYTHON to a Python with torch)",
                        args.python
                    )
                })?;
            ensure!(status.success(), "{script} failed ({status})");
            out
        }
    };
    let bytes = std::fs::read(&module).with_context(|| format!("reading {}", module.display()))?;
    let initial = Network::torchscript(&module, Device::Cpu)?.weights()?;
    let module_digest = fed.upload_module(bytes).await?;
    let digest = fed.upload_model(&initial).await?;
    let task = "torchscript";
    let kind = ModelKind::TorchScript { module_digest };
    fed.create_task(&CreateTask {
        parent: None,
        trainable: None,
        evaluation: None,
        compression: None,
        id: task.into(),
        initial_model: digest,
        model: kind,
        strategy: StrategyConfig::FedAvg,
        rounds: args.rounds,
        min_clients: args.clients as u32,
        target_clients: args.clients as u32,
        over_selection: 0.0,
        round_deadline_secs: 300,
        training: TrainingConfig {
            epochs: 2,
            batch_size: 10,
            learning_rate: 0.01,
            optimizer: OptimizerConfig::Adam,
            ..Default::default()
        },
        secure_aggregation: None,
        update_bounds: Default::default(),
        differential_privacy: None,
        asynchronous: None,
    })
    .await?;
    let mut config = SyntheticConfig::iid(args.clients, 7);
    config.min_samples = 300;
    let data = config.to_string();
    fed.spawn_clients(task, &data, args.clients, &[]).await?;
    let shards = synthetic::shards(&config)?;
    let test = Dataset::concat(&shards.iter().map(|s| &s.test).collect::<Vec<_>>())?;
    let test = DeviceData::new(&test, Device::Cpu)?;
    let mut net = Network::torchscript(&module, Device::Cpu)?;
    let before = evaluate(&mut net, &test, 4096)?.accuracy;
    println!("round 0: test accuracy {before:.4} (the module's initial weights)");
    let mut after = before;
    for round in 1..=args.rounds {
        let record = fed
            .wait_round(task, round, Duration::from_secs(600))
            .await?;
        net.set_weights(&fed.round_model(task, round).await?)?;
        after = evaluate(&mut net, &test, 4096)?.accuracy;
        println!(
            "round {round}: {} clients, {} examples, test accuracy {after:.4}",
            record.participants.len(),
            record.examples
        );
    }
    fed.wait_clients(Duration::from_secs(60))?;
    ensure!(
        after > before + 0.3,
        "federated training of the TorchScript module did not learn: {before:.4} -> {after:.4}"
    );
    println!(
        "RESULT {}",
        serde_json::json!({"before": before, "after": after})
    );
    Ok(())
}
