//! Round-latency benchmark: one small federation run end to end in Hora and then in Flower, on
//! this machine, in one run.
//!
//! Hora: the real release `hora-server` on loopback TLS (sealed uploads, durable
//! acknowledgement, a temporary data directory) and 10 `hora-client train` processes training
//! an MLP (60-32-10) on their shards of Synthetic-IID (100 samples each, 80 of them to train on),
//! one local epoch of batch 20, SGD. Each client writes where each round's time went
//! (`--timings`); the round time is publish to publish, a round being published when the last
//! acknowledgement of its uploads arrives (the upload that fills a round is acknowledged once
//! the round is published).
//!
//! Flower: `benches/flower_round.py` (flwr from `scripts/setup-flower.sh`) runs the same
//! federation — a server process, 10 client processes over gRPC, with Hora's TLS certificates,
//! the same shards, model, local epochs, batch size and optimizer, FedAvg — and times its rounds
//! the same way, publish to publish (when `aggregate_fit` returns). Then again without TLS.
//!
//! Prints Hora's per-phase breakdown, the round time percentiles of both and the ratio
//! (`RESULT round latency hora/flower = …`, target ≤ 1.0).
//!
//! `cargo build --release -p hora-server -p hora-client --bins && cargo bench -p hora --bench round_latency`
//! (`HORA_BENCH_ROUNDS` measured rounds, 30; `HORA_BENCH_WARMUP` rounds first, 5;
//! `HORA_FLOWER_PYTHON` the Python with flwr, else `scripts/setup-flower.sh` installs it;
//! `HORA_BENCH_FLOWER=0` runs Hora alone, to profile it).

#[path = "common/flower.rs"]
mod flower;
#[path = "common/harness.rs"]
mod harness;
#[path = "../tests/support/mod.rs"]
mod support;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use hora_client::data::synthetic::SyntheticConfig;
use hora_client::network::{Architecture, Network};
use hora_common::wire::{RoundOutcome, RoundRecord, TaskInfo};
use reqwest::Method;
use support::*;

const CLIENTS: usize = 10;
const HIDDEN: usize = 32;
const SAMPLES: usize = 100;
const TASK: &str = "latency";

fn data() -> SyntheticConfig {
    let mut config = SyntheticConfig::iid(CLIENTS, 0);
    config.min_samples = SAMPLES;
    config.max_samples = SAMPLES;
    config
}

/// One client's `--timings` line.
#[derive(serde::Deserialize, Clone)]
struct Timings {
    round: u64,
    outcome: String,
    seen_unix_us: u64,
    acked_unix_us: u64,
    join_ms: f64,
    download_ms: f64,
    train_ms: f64,
    record_ms: f64,
    seal_ms: f64,
    upload_ms: f64,
    finish_ms: f64,
}

fn percentile(values: &[f64], p: f64) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    v[((v.len() - 1) as f64 * p).round() as usize]
}

fn median(values: &[f64]) -> f64 {
    percentile(values, 0.5)
}

/// The sum and count of a Prometheus histogram in `/metrics` text.
fn histogram(metrics: &str, name: &str) -> (f64, f64) {
    let value = |suffix: &str| {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name}_{suffix} ")))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (value("sum"), value("count"))
}

fn main() {
    harness::main(run);
}

/// What the Hora run measured.
struct HoraRun {
    rounds_ms: Vec<f64>,
    /// Per measured round: the phases of the client whose acknowledgement came last, and the
    /// mean over all clients, in the order of [`PHASES`].
    last: Vec<[f64; PHASES.len()]>,
    mean: Vec<[f64; PHASES.len()]>,
    server_round_ms: Vec<f64>,
    ingest_ms: f64,
    close_ms: f64,
}

const PHASES: [&str; 8] = [
    "wake: publish → poll answered",
    "join",
    "download the model",
    "train (1 epoch, 4 batches)",
    "record the delta on disk",
    "encode the delta",
    "seal + upload → durable ack",
    "mark uploaded on disk",
];

async fn run_hora(dir: &Path, warmup: u64, rounds: u64) -> (HoraRun, PathBuf) {
    let server = Server::start_with(&dir.join("server"), &[]);
    let admin = server.api(ADMIN_TOKEN);
    let arch = Architecture::Mlp {
        inputs: 60,
        hidden: vec![HIDDEN],
        classes: 10,
    };
    tch::manual_seed(0);
    let initial = Network::builtin(&arch, tch::Device::Cpu)
        .and_then(|n| n.weights())
        .expect("initial weights");
    let digest = admin.upload_model(&initial).await;
    let total = warmup + rounds;
    admin
        .create_task(&harness::fedavg_task(
            TASK,
            digest,
            arch.to_kind(),
            total,
            CLIENTS as u32,
            120,
        ))
        .await;
    let mut clients = Processes(Vec::new());
    for k in 0..CLIENTS {
        let timings = dir.join(format!("timings-{k}.jsonl"));
        let extra = [std::ffi::OsStr::new("--timings"), timings.as_os_str()];
        let (state, log) = (
            dir.join(format!("client-{k}")),
            dir.join(format!("client-{k}.log")),
        );
        let data = data().to_string();
        clients
            .0
            .push(spawn_train_client(&server, TASK, &state, &data, k, &extra, &log).await);
    }

    // /metrics once the warm-up rounds are published, and at the end: the server's own
    // histograms over the measured rounds only.
    let started = Instant::now();
    loop {
        let info: TaskInfo = admin
            .ok(admin.request(Method::GET, &format!("/admin/v1/tasks/{TASK}")))
            .await;
        if info.published_rounds >= warmup {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(600),
            "the warm-up rounds did not finish; see the logs in {}",
            dir.display()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let before = admin.metrics().await;
    for (k, c) in clients.0.iter_mut().enumerate() {
        let status = loop {
            if let Some(status) = c.try_wait().expect("client status") {
                break status;
            }
            assert!(
                started.elapsed() < Duration::from_secs(1200),
                "the clients did not finish; see the logs in {}",
                dir.display()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert!(
            status.success(),
            "client {k} failed ({status}); see {}",
            dir.join(format!("client-{k}.log")).display()
        );
    }
    let after = admin.metrics().await;
    let history: Vec<RoundRecord> = admin
        .ok(admin.request(Method::GET, &format!("/admin/v1/tasks/{TASK}/rounds")))
        .await;
    assert!(
        history.iter().all(|r| r.outcome == RoundOutcome::Published),
        "a round was abandoned"
    );
    let certs = server.data_dir.join("certs");
    drop(server);

    let per_ms = |(sum, count): (f64, f64), (sum0, count0): (f64, f64)| {
        (sum - sum0) / (count - count0).max(1.0) * 1e3
    };
    let ingest_ms = per_ms(
        histogram(&after, "hora_ingest_seconds"),
        histogram(&before, "hora_ingest_seconds"),
    );
    let close_ms = per_ms(
        histogram(&after, "hora_aggregation_seconds"),
        histogram(&before, "hora_aggregation_seconds"),
    );

    let mut timings: Vec<Vec<Timings>> = Vec::new();
    for k in 0..CLIENTS {
        let text =
            std::fs::read_to_string(dir.join(format!("timings-{k}.jsonl"))).expect("timings");
        timings.push(
            text.lines()
                .map(|l| serde_json::from_str(l).expect("a timings line"))
                .collect(),
        );
    }
    let of_round = |r: u64| -> Vec<&Timings> {
        timings
            .iter()
            .map(|t| {
                t.iter()
                    .find(|t| t.round == r && t.outcome == "uploaded")
                    .unwrap_or_else(|| panic!("a client has no upload in round {r}"))
            })
            .collect()
    };
    let published = |r: u64| {
        of_round(r)
            .iter()
            .map(|t| t.acked_unix_us)
            .max()
            .unwrap_or(0)
    };
    let mut run = HoraRun {
        rounds_ms: Vec::new(),
        last: Vec::new(),
        mean: Vec::new(),
        server_round_ms: history
            .iter()
            .filter(|r| r.round > warmup)
            .map(|r| r.duration_ms as f64)
            .collect(),
        ingest_ms,
        close_ms,
    };
    for r in warmup + 1..=total {
        let previous = published(r - 1);
        let now = published(r);
        run.rounds_ms.push((now - previous) as f64 / 1e3);
        let phases = |t: &Timings| {
            [
                t.seen_unix_us.saturating_sub(previous) as f64 / 1e3,
                t.join_ms,
                t.download_ms,
                t.train_ms,
                t.record_ms,
                t.seal_ms,
                t.upload_ms,
                t.finish_ms,
            ]
        };
        let clients = of_round(r);
        let last = clients
            .iter()
            .max_by_key(|t| t.acked_unix_us)
            .expect("clients");
        run.last.push(phases(last));
        let mut mean = [0.0; PHASES.len()];
        for t in &clients {
            for (m, v) in mean.iter_mut().zip(phases(t)) {
                *m += v / clients.len() as f64;
            }
        }
        run.mean.push(mean);
    }
    (run, certs)
}

/// Flower's round times (ms, publish to publish, measured rounds only) and its version.
fn run_flower(
    python: &str,
    dir: &Path,
    tls: Option<&Path>,
    warmup: u64,
    rounds: u64,
) -> (Vec<f64>, String, f64) {
    let t = harness::sgd_training();
    let mut args: Vec<std::ffi::OsString> = vec!["--data".into(), dir.into()];
    for (flag, value) in [
        ("--clients", CLIENTS.to_string()),
        ("--rounds", (warmup + rounds).to_string()),
        ("--inputs", "60".into()),
        ("--hidden", HIDDEN.to_string()),
        ("--classes", "10".into()),
        ("--epochs", t.epochs.to_string()),
        ("--batch-size", t.batch_size.to_string()),
        ("--lr", t.learning_rate.to_string()),
        ("--momentum", "0".into()),
    ] {
        args.extend([flag.into(), value.into()]);
    }
    if let Some(tls) = tls {
        args.extend(["--tls".into(), tls.into()]);
    }
    let result = flower::run(python, &args);
    let published: Vec<f64> =
        serde_json::from_value(result["published_unix"].clone()).expect("published");
    let rounds_ms = published
        .windows(2)
        .skip(warmup as usize - 1)
        .map(|w| (w[1] - w[0]) * 1e3)
        .collect();
    let fits: Vec<Vec<f64>> =
        serde_json::from_value(result["client_fit_seconds"].clone()).expect("fits");
    let fit_ms: Vec<f64> = fits
        .iter()
        .flat_map(|f| f.iter().skip(warmup as usize).map(|s| s * 1e3))
        .collect();
    (
        rounds_ms,
        result["flwr"].as_str().unwrap_or("?").to_string(),
        median(&fit_ms),
    )
}

async fn run() {
    let warmup = harness::env_or("HORA_BENCH_WARMUP", 5).max(1) as u64;
    let rounds = harness::env_or("HORA_BENCH_ROUNDS", 30).max(2) as u64;
    let python = flower::wanted();
    let dir = tempfile::Builder::new()
        .prefix("hora-round-latency-")
        .tempdir()
        .expect("tempdir");
    let params = 60 * HIDDEN + HIDDEN + HIDDEN * 10 + 10;
    println!(
        "round latency: {CLIENTS} client processes, MLP 60-{HIDDEN}-10 ({params} parameters), \
         Synthetic-IID {} training samples each, 1 local epoch of batch {}, SGD; {warmup} warm-up \
         then {rounds} measured rounds",
        SAMPLES * 4 / 5,
        harness::sgd_training().batch_size
    );
    let (hora, certs) = run_hora(dir.path(), warmup, rounds).await;

    let (flower_tls, version, flower_fit, flower_plain) = if let Some(python) = &python {
        flower::write_shards(dir.path(), &data());
        let (tls, version, fit) = run_flower(python, dir.path(), Some(&certs), warmup, rounds);
        let (plain, _, _) = run_flower(python, dir.path(), None, warmup, rounds);
        (tls, version, fit, plain)
    } else {
        (Vec::new(), "(not run)".to_string(), f64::NAN, Vec::new())
    };

    println!();
    println!(
        "Hora (TLS, sealed uploads, durable acknowledgement), one round, ms (median over rounds)"
    );
    println!(
        "{:<34} {:>12} {:>14}",
        "phase", "last client", "client mean"
    );
    for (i, phase) in PHASES.iter().enumerate() {
        let last: Vec<f64> = hora.last.iter().map(|p| p[i]).collect();
        let mean: Vec<f64> = hora.mean.iter().map(|p| p[i]).collect();
        println!(
            "{phase:<34} {:>12.2} {:>14.2}",
            median(&last),
            median(&mean)
        );
    }
    println!(
        "{:<34} {:>12.2}",
        "(the last client's phases, summed)",
        median(
            &hora
                .last
                .iter()
                .map(|p| p[..PHASES.len() - 1].iter().sum())
                .collect::<Vec<f64>>()
        )
    );
    println!(
        "server (/metrics, means): open+validate+fold an update {:.2} ms; close+publish a round {:.2} ms; \
         round open → published (round history) median {:.0} ms",
        hora.ingest_ms,
        hora.close_ms,
        median(&hora.server_round_ms)
    );
    println!();
    println!(
        "{:<42} {:>9} {:>9}",
        "round, publish to publish (ms)", "p50", "p90"
    );
    let row = |name: &str, v: &[f64]| {
        println!("{name:<42} {:>9.1} {:>9.1}", median(v), percentile(v, 0.9));
    };
    row("Hora (TLS, sealed, durable)", &hora.rounds_ms);
    row(&format!("Flower {version} (gRPC + TLS)"), &flower_tls);
    row(&format!("Flower {version} (gRPC, no TLS)"), &flower_plain);
    println!("(a Flower client's fit, median: {flower_fit:.2} ms)");
    let ratio = median(&hora.rounds_ms) / median(&flower_tls);
    let plain = median(&hora.rounds_ms) / median(&flower_plain);
    println!();
    println!("RESULT round latency hora/flower = {ratio:.2} (target ≤ 1.0; against Flower without TLS {plain:.2})");
}
