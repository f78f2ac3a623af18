//! Compressed updates benchmark: bytes on the wire per update and test accuracy after the last
//! round, for float32 (no compression, the baseline), float16, int8, 4-bit, top-1% with error
//! feedback, and top-1% in int8 — every one of them a federation of real processes run in this
//! one benchmark, on two workloads:
//!
//! - the demo: Synthetic(1,1), 10 clients, multinomial logistic regression (610 parameters),
//!   `make demo`'s training (5 local epochs of Adam at 0.01, batch 10);
//! - the MNIST-format MLP (784-200-200-10, 199,210 parameters): 4 clients on MNIST-shaped IDX
//!   files (this machine cannot download MNIST: images are a per-class pattern plus noise), one
//!   local epoch of SGD at 0.05, batch 20.
//!
//! The bytes are the sealed uploads the server received (its `hora_upload_bytes_total` counter
//! over the federation, divided by the updates it took); the accuracy is the last published
//! model's on the held-out data. Ends with `RESULT` lines against the targets (int8: at least
//! 3.9× fewer bytes within 0.01 of float32's accuracy; top-1% with error feedback: at least 50×
//! fewer within 0.03).
//!
//! `cargo build --release -p hora-server -p hora-client --bins && cargo bench -p hora --bench compression`
//! (`HORA_BENCH_ROUNDS` rounds, 20).

#[path = "common/harness.rs"]
mod harness;
#[path = "common/mnist.rs"]
mod mnist;
#[path = "../tests/support/mod.rs"]
mod support;

use std::path::Path;
use std::time::{Duration, Instant};

use hora_client::data::idx::load_mnist_dir;
use hora_client::data::synthetic::{self, SyntheticConfig};
use hora_client::data::Dataset;
use hora_client::network::{Architecture, Network};
use hora_client::supervised::{evaluate, DeviceData};
use hora_common::codec::{Compression, ValueCodec};
use hora_common::wire::{OptimizerConfig, RoundRecord, TaskInfo, TaskState, TrainingConfig};
use reqwest::Method;
use support::*;

/// The codecs compared, float32 first (the baseline).
fn codecs() -> Vec<(&'static str, Option<Compression>)> {
    let c = |values, top_k| {
        Some(Compression {
            values,
            block_size: 256,
            top_k,
        })
    };
    vec![
        ("float32", None),
        ("float16", c(ValueCodec::F16, None)),
        ("int8", c(ValueCodec::Int8, None)),
        ("4-bit", c(ValueCodec::Int4, None)),
        ("top-1% + EF", c(ValueCodec::F32, Some(0.01))),
        ("top-1% int8 + EF", c(ValueCodec::Int8, Some(0.01))),
    ]
}

struct Workload {
    name: &'static str,
    arch: Architecture,
    clients: usize,
    /// `--data` of client k.
    data: Box<dyn Fn(usize) -> String>,
    training: TrainingConfig,
    test: Dataset,
}

/// One federation's figures.
struct Outcome {
    bytes_per_update: f64,
    accuracy: f64,
}

fn main() {
    harness::main(run);
}

async fn run() {
    let rounds = harness::env_or("HORA_BENCH_ROUNDS", 20).max(1) as u64;
    let dir = tempfile::Builder::new()
        .prefix("hora-compression-")
        .tempdir()
        .expect("tempdir");
    tch::set_num_threads(1);
    let demo = SyntheticConfig::non_iid(1.0, 1.0, 10, 0);
    let shards = synthetic::shards(&demo).expect("shards");
    let demo_test = Dataset::concat(&shards.iter().map(|s| &s.test).collect::<Vec<_>>())
        .expect("pooled test data");
    let mnist = dir.path().join("mnist");
    mnist::write(&mnist, 2000, 225);
    let demo_data = demo.to_string();
    let mnist_data = format!("mnist:{}", mnist.display());
    let workloads = [
        Workload {
            name: "demo (Synthetic(1,1), logreg, 10 clients)",
            arch: Architecture::Logreg {
                inputs: 60,
                classes: 10,
            },
            clients: 10,
            data: Box::new(move |_| demo_data.clone()),
            training: TrainingConfig {
                epochs: 5,
                batch_size: 10,
                learning_rate: 0.01,
                optimizer: OptimizerConfig::Adam,
                ..Default::default()
            },
            test: demo_test,
        },
        Workload {
            name: "MNIST-format MLP (784-200-200-10, 4 clients)",
            arch: Architecture::Mlp {
                inputs: 784,
                hidden: vec![200, 200],
                classes: 10,
            },
            clients: 4,
            data: Box::new(move |_| mnist_data.clone()),
            training: harness::sgd_training(),
            test: load_mnist_dir(&mnist, "t10k").expect("the MNIST-format test set"),
        },
    ];
    let server = Server::start_with(&dir.path().join("server"), &[]);
    let admin = server.api(ADMIN_TOKEN);
    let mut results = Vec::new();
    for (w, workload) in workloads.iter().enumerate() {
        println!("\n{}: {rounds} rounds", workload.name);
        println!(
            "  {:<18} {:>16} {:>10} {:>14} {:>12}",
            "codec", "bytes/update", "vs f32", "test accuracy", "vs f32"
        );
        let mut baseline: Option<Outcome> = None;
        for (c, (label, compression)) in codecs().into_iter().enumerate() {
            let task = format!("w{w}-c{c}");
            let outcome = federate(
                &server,
                &admin,
                dir.path(),
                &task,
                workload,
                compression,
                rounds,
            )
            .await;
            let base = baseline.as_ref().unwrap_or(&outcome);
            let fewer = base.bytes_per_update / outcome.bytes_per_update;
            let delta = outcome.accuracy - base.accuracy;
            println!(
                "  {label:<18} {:>16.0} {:>9.2}× {:>14.4} {:>+12.4}",
                outcome.bytes_per_update, fewer, outcome.accuracy, delta
            );
            results.push((workload.name, label, fewer, delta));
            if baseline.is_none() {
                baseline = Some(outcome);
            }
        }
    }
    println!();
    for (workload, label, fewer, delta) in results {
        let target = match label {
            "int8" => Some((3.9, 0.01)),
            "top-1% + EF" => Some((50.0, 0.03)),
            _ => None,
        };
        if let Some((bytes, accuracy)) = target {
            let reached = fewer >= bytes && delta >= -accuracy;
            println!(
                "RESULT compression {workload} {label}: {fewer:.2}x fewer bytes, accuracy {delta:+.4} vs float32 (target >= {bytes}x within {accuracy}: {})",
                if reached { "reached" } else { "NOT reached" }
            );
        }
    }
}

/// Runs one federation of `workload` with `compression` to its end.
async fn federate(
    server: &Server,
    admin: &Api,
    dir: &Path,
    task: &str,
    workload: &Workload,
    compression: Option<Compression>,
    rounds: u64,
) -> Outcome {
    tch::manual_seed(0);
    let initial = Network::builtin(&workload.arch, tch::Device::Cpu)
        .and_then(|n| n.weights())
        .expect("initial weights");
    let digest = admin.upload_model(&initial).await;
    let mut config = harness::fedavg_task(
        task,
        digest,
        workload.arch.to_kind(),
        rounds,
        workload.clients as u32,
        300,
    );
    config.training = workload.training.clone();
    config.compression = compression;
    let before = admin.metric("hora_upload_bytes_total").await;
    admin.create_task(&config).await;
    let mut clients = Processes(Vec::new());
    for k in 0..workload.clients {
        let log = dir.join(format!("{task}-{k}.log"));
        let state = dir.join(format!("{task}-{k}"));
        let data = (workload.data)(k);
        clients
            .0
            .push(spawn_train_client(server, task, &state, &data, k, &[], &log).await);
    }
    let started = Instant::now();
    loop {
        let info: TaskInfo = admin
            .ok(admin.request(Method::GET, &format!("/admin/v1/tasks/{task}")))
            .await;
        if info.state == TaskState::Finished {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(1200),
            "task {task} did not finish; see the logs in {}",
            dir.display()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let history: Vec<RoundRecord> = admin
        .ok(admin.request(Method::GET, &format!("/admin/v1/tasks/{task}/rounds")))
        .await;
    let updates: usize = history.iter().map(|r| r.participants.len()).sum();
    let bytes = admin.metric("hora_upload_bytes_total").await - before;
    drop(clients);
    let model = admin.round_model(task, rounds).await;
    let mut net = Network::builtin(&workload.arch, tch::Device::Cpu).expect("network");
    net.set_weights(&model).expect("weights");
    let test = DeviceData::new(&workload.test, tch::Device::Cpu).expect("test data");
    Outcome {
        bytes_per_update: bytes / updates.max(1) as f64,
        accuracy: evaluate(&mut net, &test, 4096)
            .expect("evaluation")
            .accuracy,
    }
}
