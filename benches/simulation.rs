//! The simulation benchmark (`make bench-simulation`): Hora's `hora-server simulate` against
//! Flower's Simulation Runtime (Ray backend) on the same task, side by side in one run, then
//! Hora at scale against the raw training throughput of the same model in one process.
//!
//! The task (issue #47's): Synthetic(1,1), multinomial logistic regression 60 → 10, 1,000
//! clients, 100 a round, 10 rounds, one local epoch (SGD at 0.05, batches of 10), FedAvg, each
//! run from the same initial weights; three seeds. For each run it measures the wall time and the
//! peak of the proportional set size (PSS: pages shared between processes counted once) summed
//! over every process of the run (Hora: the engine and its workers; Flower: the driver, Ray's
//! daemons and its workers), sampled every 50 ms; and the final model's accuracy on the pooled
//! held-out splits of all clients, computed here the same way for both. Targets: wall time
//! ≤ 0.2× Flower's, memory ≤ 0.25×, accuracy within 0.02 (means of the seeds).
//!
//! Then the scale run: 100,000 clients, 1,000 a round, 10 rounds, with its peak memory and
//! client-updates per second, against the same clients' training done in this one process
//! (the worker's trainer without the engine, pipes or other processes): engine overhead
//! = 1 − simulated rate ÷ raw rate, each on one worker (target ≤ 20%).
//!
//! Hora runs two ways: `hora-server simulate` with the built-in Rust trainer, and
//! `hora.simulation.run` from Python with a `train_fn` that runs Flower's client's very training
//! (`benches/simulation_common.py`), in `benches/hora_simulation.py`, with the Python of
//! `HORA_PACKAGE_PYTHON`, which the Makefile target installs the release package into (without
//! it, that path is skipped). Each is reported against Flower on its own.
//!
//! Knobs: `HORA_BENCH_FLOWER=0` runs Hora alone; `HORA_SIM_SEEDS` (3), `HORA_SIM_CLIENTS`
//! (1000), `HORA_SIM_SCALE_CLIENTS` (100000; 0 skips the scale run). The release binaries must
//! be built (the Makefile target does it).

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hora_client::data::synthetic::{self, SyntheticConfig};
use hora_client::trainer::{TrainRequest, Trainer};
use hora_client::SupervisedTrainer;
use hora_common::model::Model;

// (Each benchmark uses part of what they share.)
#[allow(dead_code)]
#[path = "common/flower.rs"]
mod flower;
#[allow(dead_code)]
#[path = "common/harness.rs"]
mod harness;

fn main() {
    harness::main(bench);
}

/// `target/release/<name>`, beside this benchmark's `deps/`.
fn binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("this benchmark's path");
    let path = exe
        .parent()
        .and_then(|d| d.parent())
        .expect("deps/")
        .join(name);
    assert!(
        path.exists(),
        "{} is missing: cargo build --release -p hora-server -p hora-client (make bench-simulation does)",
        path.display()
    );
    path
}

fn task(per_round: u32, rounds: u64) -> serde_json::Value {
    serde_json::json!({
        "id": "bench",
        "model": {"kind": "builtin", "name": "logreg", "params": {"inputs": 60, "classes": 10}},
        "rounds": rounds, "min_clients": 1, "target_clients": per_round,
        "round_deadline_secs": 600,
        "training": {"epochs": 1, "batch_size": 10, "learning_rate": 0.05,
                     "optimizer": {"name": "sgd", "momentum": 0.0}},
    })
}

/// What one measured run took.
struct Run {
    wall_s: f64,
    peak_pss_mib: f64,
}

/// Runs `command` in a process group of its own, sampling the PSS of it and every process
/// descended from it every 50 ms; waits for it to succeed.
fn measure(mut command: Command) -> Run {
    use std::os::unix::process::CommandExt;
    let started = Instant::now();
    let child = command
        .process_group(0)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start the measured run");
    let root = child.id();
    let done = Arc::new(AtomicBool::new(false));
    let sampler = {
        let done = done.clone();
        std::thread::spawn(move || {
            let mut peak = 0u64;
            while !done.load(Ordering::Relaxed) {
                peak = peak.max(tree_pss_kib(root));
                std::thread::sleep(Duration::from_millis(50));
            }
            peak
        })
    };
    let out = child.wait_with_output().expect("wait for the run");
    let wall_s = started.elapsed().as_secs_f64();
    done.store(true, Ordering::Relaxed);
    let peak = sampler.join().expect("sampler");
    // Anything of the run's own process group still alive (a daemon it left) goes now.
    // SAFETY: kill(2) on the process group this benchmark made for the run.
    unsafe { libc::kill(-(root as i32), libc::SIGKILL) };
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the run failed ({}):\n{stdout}",
        out.status
    );
    Run {
        wall_s,
        peak_pss_mib: peak as f64 / 1024.0,
    }
}

/// The summed PSS (KiB) of `root`, its descendants and its process group.
fn tree_pss_kib(root: u32) -> u64 {
    let mut parent: HashMap<u32, u32> = HashMap::new();
    let mut group: HashMap<u32, u32> = HashMap::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return 0;
    };
    for e in entries.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // After the command's closing parenthesis: state, ppid, pgrp, …
        let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
            continue;
        };
        let fields: Vec<&str> = rest.split_whitespace().collect();
        if let (Some(ppid), Some(pgrp)) = (fields.get(1), fields.get(2)) {
            parent.insert(pid, ppid.parse().unwrap_or(0));
            group.insert(pid, pgrp.parse().unwrap_or(0));
        }
    }
    let ours = |mut pid: u32| {
        if group.get(&pid) == Some(&root) {
            return true;
        }
        for _ in 0..64 {
            if pid == root {
                return true;
            }
            match parent.get(&pid) {
                Some(&p) if p > 1 => pid = p,
                _ => return false,
            }
        }
        false
    };
    parent
        .keys()
        .filter(|&&pid| ours(pid))
        .map(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))
                .ok()
                .and_then(|s| {
                    s.lines()
                        .find_map(|l| l.strip_prefix("Pss:"))
                        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
                })
                .unwrap_or(0)
        })
        .sum()
}

/// Writes an `.npy` file of `shape` from little-endian `data`.
fn write_npy(path: &Path, descr: &str, shape: &[usize], data: &[u8]) {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let shape = match dims.len() {
        1 => format!("({},)", dims[0]),
        _ => format!("({})", dims.join(", ")),
    };
    let mut header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).expect("npy file"));
    f.write_all(b"\x93NUMPY\x01\x00").unwrap();
    f.write_all(&(header.len() as u16).to_le_bytes()).unwrap();
    f.write_all(header.as_bytes()).unwrap();
    f.write_all(data).unwrap();
}

/// Every client's training split, concatenated for Flower; and the pooled held-out splits.
fn write_shards(dir: &Path, config: &SyntheticConfig) -> (Vec<f32>, Vec<i64>) {
    let (mut features, mut labels, mut offsets) = (Vec::new(), Vec::new(), vec![0i64]);
    let (mut test_x, mut test_y) = (Vec::new(), Vec::new());
    for k in 0..config.clients {
        let shard = synthetic::shard(config, k).expect("shard");
        features.extend_from_slice(&shard.train.features);
        labels.extend_from_slice(&shard.train.labels);
        offsets.push(labels.len() as i64);
        test_x.extend_from_slice(&shard.test.features);
        test_y.extend_from_slice(&shard.test.labels);
    }
    let bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let ints = |v: &[i64]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    write_npy(
        &dir.join("features.npy"),
        "<f4",
        &[labels.len(), 60],
        &bytes(&features),
    );
    write_npy(
        &dir.join("labels.npy"),
        "<i8",
        &[labels.len()],
        &ints(&labels),
    );
    write_npy(
        &dir.join("offsets.npy"),
        "<i8",
        &[offsets.len()],
        &ints(&offsets),
    );
    (test_x, test_y)
}

/// Accuracy of logistic regression `weight` (10 × 60) and `bias` on the pooled test data.
fn accuracy(weight: &[f32], bias: &[f32], x: &[f32], y: &[i64]) -> f64 {
    let correct = x
        .chunks(60)
        .zip(y)
        .filter(|(row, &label)| {
            let logit = |c: usize| {
                let w = &weight[c * 60..(c + 1) * 60];
                bias[c] + w.iter().zip(row.iter()).map(|(a, b)| a * b).sum::<f32>()
            };
            let best = (0..10).max_by(|&a, &b| logit(a).total_cmp(&logit(b)));
            best == Some(label as usize)
        })
        .count();
    correct as f64 / y.len().max(1) as f64
}

fn initial(seed: u64) -> Model {
    tch::manual_seed(seed as i64);
    let arch = hora_client::network::Architecture::Logreg {
        inputs: 60,
        classes: 10,
    };
    hora_client::network::Network::builtin(&arch, tch::Device::Cpu)
        .and_then(|n| n.weights())
        .expect("initial weights")
}

fn linear(model: &Model) -> (Vec<f32>, Vec<f32>) {
    let w = model
        .tensor("linear.weight")
        .expect("linear.weight")
        .to_vec();
    let b = model.tensor("linear.bias").expect("linear.bias").to_vec();
    (w, b)
}

/// `hora-server simulate` of the task: its run, and its final model.
fn hora(
    dir: &Path,
    task: &serde_json::Value,
    clients: u64,
    seed: u64,
    workers: usize,
    initial: Option<&Model>,
) -> (Run, Model) {
    let task_path = dir.join("task.json");
    std::fs::write(&task_path, task.to_string()).expect("task");
    let initial_path = dir.join("initial.safetensors");
    let model_path = dir.join("hora.safetensors");
    let mut command = Command::new(binary("hora-server"));
    command
        .arg("simulate")
        .arg(&task_path)
        .args([
            "--clients",
            &clients.to_string(),
            "--seed",
            &seed.to_string(),
        ])
        .args(["--workers", &workers.to_string(), "--evaluate-clients", "0"])
        .args(["--data", "synthetic:alpha=1,beta=1"])
        .arg("--model")
        .arg(&model_path)
        .arg("--worker-command")
        .arg(binary("hora-simulate-worker"));
    if let Some(initial) = initial {
        initial.write_file(&initial_path).expect("initial model");
        command.arg("--initial").arg(&initial_path);
    }
    let run = measure(command);
    let model = Model::read_file(&model_path, &Default::default()).expect("hora's model");
    (run, model)
}

/// The same clients' training in this one process: the worker's work without the engine.
fn raw_updates_per_s(clients: u64, seed: u64, updates: u64) -> f64 {
    tch::set_num_threads(1);
    let config = SyntheticConfig::non_iid(1.0, 1.0, clients as usize, seed);
    let global = initial(seed);
    let training = serde_json::from_value(task(1, 1)["training"].clone()).expect("training");
    let kind = serde_json::from_value(task(1, 1)["model"].clone()).expect("kind");
    let started = Instant::now();
    for k in 0..updates {
        let client = (k * 7_919) % clients;
        let shard = synthetic::shard(&config, client as usize).expect("shard");
        let mut trainer = SupervisedTrainer::new(shard.train, Some(shard.test), tch::Device::Cpu)
            .expect("trainer")
            .with_seed(Some(k as i64));
        let outcome = trainer
            .train(
                &global,
                TrainRequest {
                    task: "raw",
                    round: 1,
                    config: &training,
                    model_kind: &kind,
                    module: None,
                    trainable: None,
                    deadline: Instant::now() + Duration::from_secs(3600),
                    progress: &mut |_| {},
                },
            )
            .expect("training");
        let delta = hora_client::client::difference(&outcome.weights, &global).expect("delta");
        std::hint::black_box(delta.to_safetensors());
    }
    updates as f64 / started.elapsed().as_secs_f64()
}

/// The arguments the Python paths share: the data, the federation, the initial and final model.
fn common_args(dir: &Path, clients: u64, seed: u64, out: &Path) -> Vec<std::ffi::OsString> {
    let mut args: Vec<std::ffi::OsString> = vec!["--data".into(), dir.into()];
    for (flag, value) in [
        ("--clients", clients.to_string()),
        ("--per-round", "100".into()),
        ("--rounds", "10".into()),
        ("--seed", seed.to_string()),
    ] {
        args.extend([flag.into(), value.into()]);
    }
    args.extend([
        "--initial".into(),
        dir.join("initial.bin").into(),
        "--out".into(),
        out.into(),
    ]);
    args
}

/// The accuracy of the model a Python path wrote (`weight`, 10 × 60, then `bias`, float32).
fn read_accuracy(path: &Path, x: &[f32], y: &[i64]) -> f64 {
    let flat: Vec<f32> = std::fs::read(path)
        .expect("the run's model")
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    accuracy(&flat[..600], &flat[600..610], x, y)
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

async fn bench() {
    let seeds = harness::env_or("HORA_SIM_SEEDS", 3) as u64;
    let clients = harness::env_or("HORA_SIM_CLIENTS", 1_000) as u64;
    let scale = harness::env_or("HORA_SIM_SCALE_CLIENTS", 100_000) as u64;
    let workers = std::thread::available_parallelism().map_or(1, |n| n.get());
    let python = flower::wanted();
    let standard = task(100, 10);
    let hora_python = std::env::var("HORA_PACKAGE_PYTHON").ok();
    if hora_python.is_none() {
        println!(
            "HORA_PACKAGE_PYTHON is not set: the Python path (hora.simulation.run) is skipped"
        );
    }
    let (mut hora_rows, mut flower_rows, mut python_rows) = (Vec::new(), Vec::new(), Vec::new());
    for seed in 0..seeds {
        let dir = tempfile::tempdir().expect("scratch");
        let config = SyntheticConfig::non_iid(1.0, 1.0, clients as usize, seed);
        let (test_x, test_y) = write_shards(dir.path(), &config);
        let start = initial(seed);
        let (run, model) = hora(dir.path(), &standard, clients, seed, workers, Some(&start));
        let (w, b) = linear(&model);
        let acc = accuracy(&w, &b, &test_x, &test_y);
        println!(
            "seed {seed}: hora   {:7.2} s  peak PSS {:7.1} MiB  accuracy {acc:.4}",
            run.wall_s, run.peak_pss_mib
        );
        hora_rows.push((run.wall_s, run.peak_pss_mib, acc));
        let (w0, b0) = linear(&start);
        let init: Vec<u8> = w0.iter().chain(&b0).flat_map(|x| x.to_le_bytes()).collect();
        std::fs::write(dir.path().join("initial.bin"), init).expect("initial.bin");
        if let Some(python) = &hora_python {
            let out = dir.path().join("hora-python.bin");
            let mut command = Command::new(python);
            command
                .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/hora_simulation.py"))
                .args(common_args(dir.path(), clients, seed, &out))
                .args(["--workers", &workers.to_string()]);
            let run = measure(command);
            let acc = read_accuracy(&out, &test_x, &test_y);
            println!(
                "seed {seed}: hora.simulation (Python train_fn) {:7.2} s  peak PSS {:7.1} MiB  accuracy {acc:.4}",
                run.wall_s, run.peak_pss_mib
            );
            python_rows.push((run.wall_s, run.peak_pss_mib, acc));
        }
        if let Some(python) = &python {
            let out = dir.path().join("flower.bin");
            let mut command = Command::new(python);
            command
                .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/flower_simulation.py"))
                .args(common_args(dir.path(), clients, seed, &out))
                .args(["--cpus", &workers.to_string()])
                .env("RAY_DEDUP_LOGS", "0");
            let run = measure(command);
            let acc = read_accuracy(&out, &test_x, &test_y);
            println!(
                "seed {seed}: flower {:7.2} s  peak PSS {:7.1} MiB  accuracy {acc:.4}",
                run.wall_s, run.peak_pss_mib
            );
            flower_rows.push((run.wall_s, run.peak_pss_mib, acc));
        }
    }
    let col = |rows: &[(f64, f64, f64)], i: usize| {
        mean(&rows.iter().map(|r| [r.0, r.1, r.2][i]).collect::<Vec<_>>())
    };
    println!(
        "hora (hora-server simulate, {workers} workers), mean of {seeds} seeds: {:.2} s, {:.1} MiB, accuracy {:.4}",
        col(&hora_rows, 0),
        col(&hora_rows, 1),
        col(&hora_rows, 2)
    );
    if !python_rows.is_empty() {
        println!(
            "hora.simulation (Python train_fn, {workers} workers), mean of {seeds} seeds: {:.2} s, {:.1} MiB, accuracy {:.4}",
            col(&python_rows, 0),
            col(&python_rows, 1),
            col(&python_rows, 2)
        );
    }
    if !flower_rows.is_empty() {
        println!(
            "flower (Simulation Runtime, Ray, {workers} CPUs), mean of {seeds} seeds: {:.2} s, {:.1} MiB, accuracy {:.4}",
            col(&flower_rows, 0),
            col(&flower_rows, 1),
            col(&flower_rows, 2)
        );
        for (path, rows) in [
            ("hora-server simulate", &hora_rows),
            ("hora.simulation, Python train_fn", &python_rows),
        ] {
            if rows.is_empty() {
                continue;
            }
            println!(
                "RESULT simulation hora/flower ({path}): wall {:.3} (target <= 0.2), memory {:.3} (target <= 0.25), accuracy {:+.4} (target within 0.02)",
                col(rows, 0) / col(&flower_rows, 0),
                col(rows, 1) / col(&flower_rows, 1),
                col(rows, 2) - col(&flower_rows, 2)
            );
        }
    }
    if scale == 0 {
        return;
    }
    let dir = tempfile::tempdir().expect("scratch");
    let big = task(1_000, 10);
    let raw = raw_updates_per_s(scale, 0, 2_000);
    for w in [1, workers] {
        let (run, _) = hora(dir.path(), &big, scale, 0, w, None);
        let rate = 10_000.0 / run.wall_s;
        println!(
            "scale: {scale} clients, 1000 a round, 10 rounds on {w} worker(s): {:.1} s, {rate:.0} updates/s, peak PSS {:.1} MiB",
            run.wall_s, run.peak_pss_mib
        );
        if w == 1 {
            println!(
                "RESULT simulation engine overhead at {scale} clients: {:.3} (1 - {rate:.0} / {raw:.0} raw updates/s in one process; target <= 0.20)",
                1.0 - rate / raw
            );
        }
    }
}
