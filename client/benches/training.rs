//! Local training speed: hora's built-in trainer (`supervised::fit`, the code path a client runs
//! each round) on the FedAvg paper's MLP (784-200-200-10) against the same model, data, batch
//! size and optimizer in PyTorch (Python), measured in the same run on the same threads. Both
//! run libtorch, so the ratio measures what our side adds.
//!
//! `cargo bench -p hora-client --bench training` (with `python3` and torch on PATH, as
//! `make bench` arranges). Environment: HORA_BENCH_SAMPLES (8192), HORA_BENCH_BATCH (32),
//! HORA_BENCH_EPOCHS (2), HORA_BENCH_RUNS (3), HORA_BENCH_THREADS (the CPU count).

use std::process::Command;
use std::time::Instant;

use hora_client::data::Dataset;
use hora_client::network::{Architecture, Network};
use hora_client::supervised::{fit, DeviceData};
use hora_common::wire::{OptimizerConfig, TrainingConfig};
use tch::{Device, Kind, Tensor};

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        return; // `cargo test --benches` builds and runs benches without --bench: nothing to time
    }
    let samples = env("HORA_BENCH_SAMPLES", 8192);
    let batch = env("HORA_BENCH_BATCH", 32);
    let epochs = env("HORA_BENCH_EPOCHS", 2) as u32;
    let runs = env("HORA_BENCH_RUNS", 3);
    let threads = env(
        "HORA_BENCH_THREADS",
        std::thread::available_parallelism().map_or(1, |n| n.get()),
    );
    tch::set_num_threads(threads as i32);
    tch::manual_seed(0);
    let xs = Tensor::rand([samples as i64, 784], (Kind::Float, Device::Cpu));
    let ys = Tensor::randint(10, [samples as i64], (Kind::Int64, Device::Cpu));
    let data = Dataset::new(
        Vec::<f32>::try_from(&xs.flatten(0, -1)).expect("features"),
        Vec::<i64>::try_from(&ys).expect("labels"),
        vec![784],
        10,
    )
    .expect("dataset");
    let data = DeviceData::new(&data, Device::Cpu).expect("device data");
    let arch = Architecture::Mlp {
        inputs: 784,
        hidden: vec![200, 200],
        classes: 10,
    };
    let mut net = Network::builtin(&arch, Device::Cpu).expect("network");
    let config = TrainingConfig {
        batch_size: batch as u32,
        learning_rate: 0.01,
        optimizer: OptimizerConfig::Sgd { momentum: 0.0 },
        ..Default::default()
    };
    fit(&mut net, &data, &config, 1, None, &mut |_| {}).expect("warm-up");
    let mut hora = 0.0f64;
    for _ in 0..runs {
        let t = Instant::now();
        fit(&mut net, &data, &config, epochs, None, &mut |_| {}).expect("fit");
        hora = hora.max((samples as u32 * epochs) as f64 / t.elapsed().as_secs_f64());
    }

    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/torch_mlp.py");
    let python = std::env::var("HORA_PYTHON").unwrap_or_else(|_| "python3".into());
    let out = Command::new(&python)
        .arg(script)
        .args([
            "--samples",
            &samples.to_string(),
            "--batch",
            &batch.to_string(),
        ])
        .args(["--epochs", &epochs.to_string(), "--runs", &runs.to_string()])
        .args(["--threads", &threads.to_string()])
        .output()
        .unwrap_or_else(|e| {
            panic!("running {python} {script}: {e} (set HORA_PYTHON to a Python with torch)")
        });
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{script} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let pytorch: f64 = stdout
        .lines()
        .find_map(|l| l.strip_prefix("samples_per_sec "))
        .and_then(|v| v.trim().parse().ok())
        .expect("samples_per_sec line");
    println!(
        "MLP 784-200-200-10, {samples} samples, batch {batch}, SGD, {threads} thread(s), best of {runs} x {epochs} epochs"
    );
    println!("  hora (tch, supervised::fit): {hora:>10.0} samples/s");
    println!("  PyTorch (Python):            {pytorch:>10.0} samples/s");
    println!(
        "RESULT local training samples/s hora / PyTorch = {:.2} (target >= 0.90)",
        hora / pytorch
    );
}
