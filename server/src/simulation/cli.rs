//! `hora-server simulate`: a simulated federation from the command line, with the built-in
//! trainers of `hora-client` (no Python), printing one row per round.

use std::ffi::OsString;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;

use super::{history, Profile, Simulation};

/// `hora-server simulate TASK.json --clients N …`
#[derive(Debug, Args)]
pub struct SimulateArgs {
    /// The task, as `POST /admin/v1/tasks` takes it (`initial_model` may be left out: the
    /// built-in model's initial weights are then made from --seed). Its `round_deadline_secs`
    /// is in simulated seconds.
    pub task: PathBuf,
    /// Virtual clients in the federation.
    #[arg(long)]
    pub clients: u64,
    /// The federation's data: each client's shard is made by the worker that trains it.
    #[arg(long, default_value = "synthetic:alpha=1,beta=1")]
    pub data: String,
    /// How a dataset that is not synthetic (FILE.csv, mnist:DIR) is split among the clients:
    /// iid, dirichlet:alpha=A (label skew), shards:k=K (K classes a client) or quantity:sigma=S
    /// (log-normal sizes).
    #[arg(long)]
    pub partition: Option<String>,
    /// The initial weights (safetensors); default: the built-in model's, made from --seed.
    #[arg(long, value_name = "FILE")]
    pub initial: Option<PathBuf>,
    /// Seed of the data, the devices, sampling and training: the same seed gives the same model.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Worker processes (default: one per core).
    #[arg(long)]
    pub workers: Option<usize>,
    /// Devices and networks: uniform[:speed=S,mbps=M], heterogeneous[:dropout=P] or
    /// trace:FILE.csv (samples_per_s,down_mbps,up_mbps,latency_ms[,online_fraction,dropout]).
    #[arg(long, default_value = "uniform")]
    pub profile: String,
    /// Evaluate each published model on the pooled held-out data of this many clients.
    #[arg(long, default_value_t = 100)]
    pub evaluate_clients: u64,
    /// Also print the simulated time at which the evaluation first reached this accuracy.
    #[arg(long)]
    pub target_accuracy: Option<f64>,
    /// Write the per-round history here (.csv, else JSON).
    #[arg(long)]
    pub history: Option<PathBuf>,
    /// Write the final model here (safetensors).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Keep a checkpoint in this folder after every round, and resume from the one it holds:
    /// run the same command again after an interruption (synchronous tasks).
    #[arg(long, value_name = "DIR")]
    pub checkpoint: Option<PathBuf>,
    /// The worker's command (default: the hora-simulate-worker beside this program, else on
    /// PATH).
    #[arg(long, num_args = 1.., value_name = "PROGRAM [ARG]...")]
    pub worker_command: Option<Vec<OsString>>,
}

/// Runs the simulation the arguments describe, printing its table.
pub async fn run(args: SimulateArgs) -> Result<()> {
    let text = std::fs::read_to_string(&args.task)
        .with_context(|| format!("reading the task {}", args.task.display()))?;
    let task: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not JSON", args.task.display()))?;
    let profile: Profile = args.profile.parse().map_err(anyhow::Error::msg)?;
    let workers = args.workers.unwrap_or_else(|| {
        std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
    });
    let initial = match &args.initial {
        None => None,
        Some(path) => Some(
            hora_common::model::Model::read_file(path, &Default::default())
                .with_context(|| format!("reading the initial model {}", path.display()))?,
        ),
    };
    let sim = Simulation {
        task,
        initial,
        clients: args.clients,
        data: args.data.clone(),
        partition: args.partition.clone(),
        seed: args.seed,
        workers,
        worker_command: args
            .worker_command
            .clone()
            .unwrap_or_else(super::default_worker_command),
        profile,
        evaluate_clients: args.evaluate_clients,
        checkpoint: args.checkpoint.clone(),
    };
    println!(
        "simulating {} clients of {} on {workers} workers, seed {}, profile {}",
        sim.clients, sim.data, sim.seed, args.profile
    );
    println!("{}", history::header());
    let outcome = super::run(&sim, &mut |row| println!("{}", row.line())).await?;
    let last = outcome.history.last();
    println!(
        "done: {} updates in {:.2} s of wall time ({:.0} updates/s), {:.1} s simulated",
        outcome.updates,
        outcome.wall_seconds,
        outcome.updates as f64 / outcome.wall_seconds.max(1e-9),
        last.map_or(0.0, |r| r.sim_time_s)
    );
    if let Some(target) = args.target_accuracy {
        match history::time_to_accuracy(&outcome.history, target) {
            Some(t) => println!("accuracy {target} first reached at {t:.1} s simulated"),
            None => println!("accuracy {target} was not reached"),
        }
    }
    if let Some(path) = &args.history {
        let text = match path.extension().and_then(|e| e.to_str()) {
            Some("csv") => history::csv(&outcome.history),
            _ => serde_json::to_string_pretty(&outcome.history)?,
        };
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(path) = &args.model {
        outcome
            .model
            .write_file(path)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
