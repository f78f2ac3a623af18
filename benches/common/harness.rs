//! What the process benchmarks share: the `--bench` guard and runtime, knobs from the
//! environment, and the local training both Hora and Flower do in them.

use std::future::Future;

use hora_common::model::ModelDigest;
use hora_common::wire::{CreateTask, ModelKind, OptimizerConfig, StrategyConfig, TrainingConfig};

/// Runs `bench` on a two-thread runtime, only under `cargo bench` (`cargo test` and nextest
/// list and run bench targets without `--bench`: nothing to do then).
pub fn main<F: Future<Output = ()>>(bench: impl FnOnce() -> F) {
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
        .block_on(bench());
}

/// The variable `name` as a number, else `default`.
pub fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// One local epoch of batch 20, SGD at 0.05 without momentum (what flower_round.py does too).
pub fn sgd_training() -> TrainingConfig {
    TrainingConfig {
        epochs: 1,
        batch_size: 20,
        learning_rate: 0.05,
        optimizer: OptimizerConfig::Sgd { momentum: 0.0 },
        ..Default::default()
    }
}

/// A FedAvg task of `rounds` rounds over `clients` clients with [`sgd_training`], and nothing
/// else switched on: the round both process benchmarks time.
pub fn fedavg_task(
    id: &str,
    initial_model: ModelDigest,
    model: ModelKind,
    rounds: u64,
    clients: u32,
    round_deadline_secs: u64,
) -> CreateTask {
    CreateTask {
        parent: None,
        trainable: None,
        evaluation: None,
        compression: None,
        id: id.into(),
        initial_model,
        model,
        strategy: StrategyConfig::FedAvg,
        rounds,
        min_clients: clients,
        target_clients: clients,
        over_selection: 0.0,
        round_deadline_secs,
        training: sgd_training(),
        secure_aggregation: None,
        update_bounds: Default::default(),
        differential_privacy: None,
        asynchronous: None,
    }
}
