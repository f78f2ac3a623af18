//! Synchronous FedAvg against asynchronous FedBuff on a heterogeneous fleet, end to end with real
//! processes: one `hora-server`, and for each mode the same fleet of `hora-client train`
//! processes on the FedProx paper's Synthetic data, whose local training takes from
//! `--fast-secs` (client 0) to `--spread` times that (the last client), spaced evenly
//! (`hora-client --min-train-secs`: a slower device, simulated).
//!
//! - **sync**: rounds of `--buffer` clients plus `--over-selection` (30%: the production
//!   practice of Bonawitz et al. 2019), each closed when `--buffer` updates are in; the
//!   over-selected stragglers' work is thrown away.
//! - **async**: FedBuff with buffers of `--buffer` updates, every client training all the time
//!   (`concurrency` = the fleet), updates weighted `(1 + staleness)^-½`.
//!
//! Each mode runs until its global model first scores `--target` on the pooled held-out data (or
//! `--time-limit`), timed from the moment its task is resumed with the whole fleet up and waiting
//! (the task is created paused while the processes start); then the clients are killed. The table gives the wall time to the target and the client-seconds of training
//! whose update was not used (refused as late or too stale), from each client's `--timings`.
//!
//! `cargo build --release --bins --example asynchronous && target/release/examples/asynchronous`
//! runs both modes on Synthetic-IID and on Synthetic(1,1) (`make bench`). `--versions N` runs
//! the asynchronous mode alone until N versions are published (the task then finishes) and
//! reports who contributed; `--json` adds a machine-readable `RESULT` line.

#[path = "support/federation.rs"]
mod federation;

use std::collections::BTreeMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use clap::Parser;
use hora_client::data::synthetic::{self, SyntheticConfig};
use hora_client::data::Dataset;
use hora_client::network::{Architecture, Network};
use hora_client::supervised::{evaluate, DeviceData};
use hora_common::model::Model;
use hora_common::wire::{
    AsynchronousConfig, CreateTask, OptimizerConfig, RoundOutcome, Staleness, TrainingConfig,
};
use serde_json::json;
use tch::Device;

use federation::Federation;

#[derive(Parser, Clone)]
struct Args {
    #[arg(long, default_value_t = 50)]
    clients: usize,
    /// The fastest client's local training time (seconds).
    #[arg(long, default_value_t = 0.5)]
    fast_secs: f64,
    /// The slowest client is this many times slower than the fastest.
    #[arg(long, default_value_t = 10.0)]
    spread: f64,
    /// Updates per version (FedBuff's K), and per synchronous round.
    #[arg(long, default_value_t = 10)]
    buffer: u32,
    /// Synchronous rounds select this fraction more clients than they need.
    #[arg(long, default_value_t = 0.3)]
    over_selection: f64,
    #[arg(long, default_value_t = 100)]
    max_staleness: u64,
    /// Test accuracy to reach, per dataset: `iid` and `non-iid` (Synthetic(1,1)).
    #[arg(long, default_value_t = 0.9)]
    target_iid: f64,
    #[arg(long, default_value_t = 0.45)]
    target_non_iid: f64,
    /// Give up on a mode after this many seconds.
    #[arg(long, default_value_t = 300)]
    time_limit: u64,
    /// Datasets to run: `iid`, `non-iid` or both (comma-separated).
    #[arg(long, default_value = "iid,non-iid", value_delimiter = ',')]
    datasets: Vec<String>,
    /// Run the asynchronous mode alone until this many versions are published.
    #[arg(long)]
    versions: Option<u64>,
    #[arg(long, default_value_t = 1)]
    epochs: u32,
    #[arg(long, default_value_t = 10)]
    batch_size: u32,
    #[arg(long, default_value_t = 0.02)]
    learning_rate: f64,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Samples per client: the power law's minimum and cap.
    #[arg(long, default_value_t = 200)]
    min_samples: usize,
    #[arg(long, default_value_t = 1000)]
    max_samples: usize,
    /// Print a final `RESULT {json}` line.
    #[arg(long)]
    json: bool,
}

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Sync,
    Async,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Sync => "sync FedAvg",
            Mode::Async => "async FedBuff",
        }
    }
}

/// The data of one dataset: what clients generate for themselves, and the pooled test set.
struct Data {
    label: String,
    description: String,
    test: DeviceData,
    arch: Architecture,
    initial: Model,
    target: f64,
}

/// What one mode's run measured.
struct Outcome {
    /// Seconds from the task's creation to the first model at the target, if reached.
    to_target: Option<f64>,
    best: f64,
    /// Rounds or versions published by then.
    published: u64,
    /// Client-seconds of training: in all, and on updates that were not used.
    trained_secs: f64,
    wasted_secs: f64,
    updates_used: u64,
    updates_wasted: u64,
    /// Per client: updates acknowledged.
    acknowledged: Vec<u64>,
    /// Per client: updates in the published history.
    in_history: Vec<u64>,
    too_stale: u64,
    max_staleness: u64,
}

fn score(data: &Data, model: &Model) -> Result<f64> {
    let mut net = Network::builtin(&data.arch, Device::Cpu)?;
    net.set_weights(model)?;
    Ok(evaluate(&mut net, &data.test, 4096)?.accuracy)
}

fn unix_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

/// `hora_uploads_rejected_total{reason="…"}` from the metrics text.
fn rejected(metrics: &str, reason: &str) -> u64 {
    let key = format!("hora_uploads_rejected_total{{reason=\"{reason}\"}}");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&key))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

async fn run_mode(
    fed: &mut Federation,
    args: &Args,
    data: &Data,
    shards: &str,
    mode: Mode,
) -> Result<Outcome> {
    let task = format!(
        "{}-{}",
        data.label,
        if mode == Mode::Sync { "sync" } else { "async" }
    );
    let digest = fed.upload_model(&data.initial).await?;
    let slowest = args.fast_secs * args.spread;
    let training = TrainingConfig {
        epochs: args.epochs,
        batch_size: args.batch_size,
        learning_rate: args.learning_rate,
        optimizer: OptimizerConfig::Adam,
        ..Default::default()
    };
    let rounds = args.versions.unwrap_or(100_000);
    let config = CreateTask {
        parent: None,
        trainable: None,
        evaluation: None,
        compression: None,
        id: task.clone(),
        initial_model: digest,
        model: data.arch.to_kind(),
        strategy: Default::default(),
        rounds,
        min_clients: args.buffer,
        target_clients: args.buffer,
        over_selection: if mode == Mode::Sync {
            args.over_selection
        } else {
            0.0
        },
        // Room for the slowest client, however loaded the machine.
        round_deadline_secs: (slowest * 6.0).ceil() as u64 + 30,
        training,
        secure_aggregation: None,
        update_bounds: Default::default(),
        differential_privacy: None,
        asynchronous: (mode == Mode::Async).then_some(AsynchronousConfig {
            buffer_size: args.buffer,
            max_staleness: args.max_staleness,
            concurrency: args.clients as u32,
            staleness: Staleness::Polynomial { exponent: 0.5 },
        }),
    };
    // The task is held paused until the whole fleet is up (loading libtorch and generating
    // its shard takes each process a while): the clock starts with every client waiting.
    fed.create_task(&config).await?;
    fed.task_verb(&task, "pause").await?;
    let mut timings = Vec::new();
    for k in 0..args.clients {
        let secs = if args.clients > 1 {
            args.fast_secs + (slowest - args.fast_secs) * k as f64 / (args.clients - 1) as f64
        } else {
            args.fast_secs
        };
        let name = format!("{task}-{k}");
        let file = fed.dir.path().join(format!("{name}.timings"));
        let extra: Vec<String> = [
            "--label".to_string(),
            name.clone(),
            "--seed".to_string(),
            k.to_string(),
            "--min-train-secs".into(),
            format!("{secs:.3}"),
            "--timings".into(),
            file.display().to_string(),
        ]
        .into();
        fed.spawn_named_shard_client(&name, &task, shards, k, &extra)
            .await?;
        timings.push(file);
    }

    let ready = Instant::now();
    loop {
        let ids = fed.client_ids().await?;
        let up = ids
            .values()
            .filter(|label| label.starts_with(&format!("{task}-")))
            .count();
        if up == args.clients {
            break;
        }
        if !fed.clients_running()? || ready.elapsed() > Duration::from_secs(600) {
            bail!("only {up} of {} clients of {task} came up", args.clients);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Enrolled clients poll at once; their polls are held while the task is paused.
    tokio::time::sleep(Duration::from_secs(2)).await;
    // (Clocks first: a client's held poll may see the resume before its answer reaches us.)
    let started = Instant::now();
    let started_us = unix_us();
    fed.task_verb(&task, "resume").await?;
    let limit = Duration::from_secs(args.time_limit);
    let mut scored = 0;
    let mut best = 0.0f64;
    let mut to_target = None;
    let mut reached_us = None;
    let published = loop {
        let history = fed.rounds(&task).await?;
        let latest = history
            .iter()
            .filter(|r| r.outcome == RoundOutcome::Published)
            .map(|r| r.round)
            .max()
            .unwrap_or(0);
        if latest > scored {
            let model = fed.round_model(&task, latest).await?;
            let accuracy = score(data, &model)?;
            scored = latest;
            best = best.max(accuracy);
            if args.versions.is_none() && accuracy >= data.target {
                to_target = Some(started.elapsed().as_secs_f64());
                reached_us = Some(unix_us());
                break latest;
            }
        }
        if args.versions.is_some_and(|v| latest >= v) {
            break latest;
        }
        if started.elapsed() > limit {
            break latest;
        }
        if !fed.clients_running()? {
            bail!("every client of {task} exited before the run ended");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let end_us = reached_us.unwrap_or_else(unix_us);
    if args.versions.is_some() {
        // The task finished with its last version: the clients end by themselves.
        fed.wait_clients(Duration::from_secs(120))?;
    } else {
        fed.kill_clients();
        fed.task_verb(&task, "stop").await?;
    }
    let metrics = fed.metrics().await?;
    let history = fed.rounds(&task).await?;

    // What each client's `--timings` says: every round it trained for, and how it ended.
    let mut outcome = Outcome {
        to_target,
        best,
        published,
        trained_secs: 0.0,
        wasted_secs: 0.0,
        updates_used: 0,
        updates_wasted: 0,
        acknowledged: vec![0; args.clients],
        in_history: vec![0; args.clients],
        too_stale: rejected(&metrics, "too_stale"),
        max_staleness: 0,
    };
    for (k, file) in timings.iter().enumerate() {
        let text = std::fs::read_to_string(file).unwrap_or_default();
        for line in text.lines() {
            let v: serde_json::Value = serde_json::from_str(line).context("a timings line")?;
            let seen = v["seen_unix_us"].as_u64().unwrap_or(0);
            if seen < started_us || seen > end_us {
                continue; // work begun after the target was reached is not counted
            }
            let secs = v["train_ms"].as_f64().unwrap_or(0.0) / 1e3;
            outcome.trained_secs += secs;
            match v["outcome"].as_str() {
                Some("uploaded" | "resumed") => {
                    outcome.acknowledged[k] += 1;
                    outcome.updates_used += 1;
                }
                _ => {
                    outcome.wasted_secs += secs;
                    outcome.updates_wasted += 1;
                }
            }
        }
    }
    // Which client is which: the history names clients by id, the timings files by index;
    // the server's client list maps labels (the process names) to ids.
    let ids = fed.client_ids().await?;
    for record in history
        .iter()
        .filter(|r| r.outcome == RoundOutcome::Published)
    {
        if let Some(s) = &record.staleness {
            outcome.max_staleness = outcome.max_staleness.max(s.max);
        }
        for p in &record.participants {
            if let Some(k) = ids
                .get(p)
                .and_then(|name| name.strip_prefix(&format!("{task}-")))
                .and_then(|k| k.parse::<usize>().ok())
            {
                outcome.in_history[k] += 1;
            }
        }
    }
    Ok(outcome)
}

fn dataset(args: &Args, label: &str) -> Result<(Data, String)> {
    let iid = match label {
        "iid" => true,
        "non-iid" => false,
        other => bail!("unknown dataset `{other}`: iid or non-iid"),
    };
    let mut config = if iid {
        SyntheticConfig::iid(args.clients, args.seed)
    } else {
        SyntheticConfig::non_iid(1.0, 1.0, args.clients, args.seed)
    };
    config.min_samples = args.min_samples;
    config.max_samples = args.max_samples;
    let shards = synthetic::shards(&config)?;
    let pooled_test = Dataset::concat(&shards.iter().map(|s| &s.test).collect::<Vec<_>>())?;
    let arch = Architecture::Logreg {
        inputs: config.dim,
        classes: config.classes,
    };
    tch::manual_seed(args.seed as i64);
    let initial = Network::builtin(&arch, Device::Cpu)?.weights()?;
    Ok((
        Data {
            label: label.to_string(),
            description: if iid {
                "Synthetic-IID".into()
            } else {
                "Synthetic(1, 1)".into()
            },
            test: DeviceData::new(&pooled_test, Device::Cpu)?,
            arch,
            initial,
            target: if iid {
                args.target_iid
            } else {
                args.target_non_iid
            },
        },
        config.to_string(),
    ))
}

fn secs(v: Option<f64>) -> String {
    v.map_or("not reached".into(), |s| format!("{s:.1} s"))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    let args = Args::parse();
    tch::set_num_threads(1);
    let modes = match args.versions {
        Some(_) => vec![Mode::Async],
        None => vec![Mode::Sync, Mode::Async],
    };
    let mut fed = Federation::start()?;
    println!(
        "{} clients, local training {:.2}-{:.2} s ({}x spread), {} update(s) per round/version, \
         sync over-selection {:.0}%, async max staleness {} and weight (1+s)^-0.5",
        args.clients,
        args.fast_secs,
        args.fast_secs * args.spread,
        args.spread,
        args.buffer,
        args.over_selection * 100.0,
        args.max_staleness
    );
    let mut results = BTreeMap::new();
    for label in &args.datasets {
        let (data, shards) = dataset(&args, label)?;
        println!(
            "\n{}: target test accuracy {:.2} (initial {:.4})",
            data.description,
            data.target,
            score(&data, &data.initial)?
        );
        println!(
            "{:>14}  {:>12}  {:>9}  {:>9}  {:>13}  {:>14}  {:>9}",
            "mode",
            "to target",
            "published",
            "best acc",
            "client-s used",
            "client-s wasted",
            "refused"
        );
        let mut rows = Vec::new();
        for &mode in &modes {
            let o = run_mode(&mut fed, &args, &data, &shards, mode).await?;
            println!(
                "{:>14}  {:>12}  {:>9}  {:>9.4}  {:>13.1}  {:>8.1} ({:>3})  {:>9}",
                mode.name(),
                secs(o.to_target),
                o.published,
                o.best,
                o.trained_secs - o.wasted_secs,
                o.wasted_secs,
                o.updates_wasted,
                o.too_stale
            );
            rows.push((mode, o));
        }
        if let [(_, sync), (_, asy)] = &rows[..] {
            if let (Some(s), Some(a)) = (sync.to_target, asy.to_target) {
                println!(
                    "async reaches {:.2} {:.2}x sooner than sync; wasted client-seconds: sync {:.1}, async {:.1}",
                    data.target,
                    s / a,
                    sync.wasted_secs,
                    asy.wasted_secs
                );
            }
        }
        let summary: Vec<_> = rows
            .iter()
            .map(|(mode, o)| {
                json!({
                    "mode": if *mode == Mode::Sync { "sync" } else { "async" },
                    "to_target_secs": o.to_target, "published": o.published, "best": o.best,
                    "trained_secs": o.trained_secs, "wasted_secs": o.wasted_secs,
                    "updates_used": o.updates_used, "updates_wasted": o.updates_wasted,
                    "acknowledged": o.acknowledged, "in_history": o.in_history,
                    "too_stale": o.too_stale, "max_staleness": o.max_staleness,
                })
            })
            .collect();
        results.insert(label.clone(), summary);
        if fed.clients_running()? {
            bail!("clients still running after their task ended");
        }
    }
    if args.json {
        println!("RESULT {}", json!(results));
    }
    Ok(())
}
