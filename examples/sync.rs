//! Synchronous data-parallel training with real processes, Horovod-style: a `hora-server` for
//! the rendezvous, a sync job of N workers, and N `hora-client sync` processes on this machine
//! that train the MLP together — each on its slice of every global batch of the training data,
//! averaging gradients every step over a TCP ring between them (the server is not in that path).
//! Rank 0 prints each epoch's training loss (over all workers' samples) and held-out accuracy.
//!
//! `cargo run --release --example sync` (after `cargo build --release --bins`). Defaults: 4
//! workers, Synthetic-IID (60 features, 10 classes, 20,000 samples), MLP 60-200-200-10, batch 32
//! per worker, SGD with momentum at 0.025 × world size (Horovod's scaling), 5 epochs. `--data
//! mnist:DIR` with `--inputs 784` trains on MNIST; `--fp16` sends gradients as half precision.

#[path = "support/federation.rs"]
mod federation;

use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use clap::Parser;

use federation::Federation;

#[derive(Parser)]
struct Args {
    #[arg(long, default_value_t = 4)]
    workers: u32,
    #[arg(long, default_value_t = 5)]
    epochs: u64,
    #[arg(long, default_value_t = 32)]
    batch_size: usize,
    #[arg(long, default_value_t = 0.025)]
    learning_rate: f64,
    #[arg(
        long,
        default_value = "synthetic-iid:clients=1,seed=0,min_samples=25000,max_samples=25000"
    )]
    data: String,
    #[arg(long, default_value_t = 60)]
    inputs: usize,
    #[arg(long, default_value = "200,200")]
    hidden: String,
    #[arg(long, default_value_t = 10)]
    classes: usize,
    /// Half precision on the wire.
    #[arg(long)]
    fp16: bool,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<()> {
    let args = Args::parse();
    let mut federation = Federation::start()?;
    let token = federation.create_sync_job("mlp-sync", args.workers).await?;
    let params = serde_json::json!({
        "inputs": args.inputs,
        "hidden": args.hidden.split(',').map(|h| h.trim().parse::<usize>()).collect::<Result<Vec<_>, _>>()?,
        "classes": args.classes,
    })
    .to_string();
    println!(
        "{} workers · MLP {}-{}-{} · {} · batch {} per worker · {} epochs",
        args.workers,
        args.inputs,
        args.hidden.replace(',', "-"),
        args.classes,
        args.data,
        args.batch_size,
        args.epochs
    );
    let threads =
        (std::thread::available_parallelism().map_or(1, |n| n.get()) as u32 / args.workers).max(1);
    for rank in 0..args.workers {
        let mut worker: Vec<String> = [
            "sync",
            "--server",
            &federation.url,
            "--job",
            "mlp-sync",
            "--token",
            &token,
            "--world-size",
            &args.workers.to_string(),
            "--rank",
            &rank.to_string(),
            "--model",
            "mlp",
            "--params",
            &params,
            "--data",
            &args.data,
            "--epochs",
            &args.epochs.to_string(),
            "--batch-size",
            &args.batch_size.to_string(),
            "--learning-rate",
            &args.learning_rate.to_string(),
            "--threads",
            &threads.to_string(),
            "--device",
            "cpu",
            "--no-progress",
        ]
        .map(String::from)
        .into();
        worker.push("--ca".into());
        worker.push(federation.ca.display().to_string());
        if args.fp16 {
            worker.push("--fp16".into());
        }
        federation.spawn_process(&format!("rank-{rank}"), &worker)?;
    }

    // Follow rank 0's log until every worker has exited.
    let start = Instant::now();
    let log = federation.log_path("rank-0");
    let mut shown = 0;
    loop {
        let running = federation.clients_running();
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        for line in text.lines().skip(shown) {
            if line.starts_with("epoch") || line.starts_with("rank 0") {
                println!("{line}");
            }
            shown += 1;
        }
        if !running? {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    if !std::fs::read_to_string(&log)?.contains("done:") {
        bail!("rank 0 did not finish:\n{}", std::fs::read_to_string(&log)?);
    }
    println!("{:.1} s in all", start.elapsed().as_secs_f64());
    Ok(())
}
