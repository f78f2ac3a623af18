//! A simulated federation: the server's round engine in this process, its virtual clients on a
//! pool of worker processes, and a simulated clock.
//!
//! ```text
//! hora-server simulate ──▶ Coordinator (real modes, strategies, DP) over a MemoryStore,
//!        │                  acknowledging updates as they fold (Acknowledge::OnFold)
//!        │                        ▲ join, upload (plaintext: nothing is sealed)
//!        └──▶ driver ─────────────┘
//!               │ Train{client, round, model}       ▲ encoded update
//!               └──▶ workers (hora-simulate-worker) ──┘
//! ```
//!
//! The engine is the one `hora-server serve` runs; it enters the simulation through one seam,
//! chosen when the [`Coordinator`](crate::round::Coordinator) opens: an in-process store and no durability waits. Nothing
//! crosses a network, so there is no TLS, HTTP or sealing between the clients and the engine.
//!
//! The driver ([`driver`]) plays the field: each round it samples clients that are online at
//! the simulated time, joins them through the engine (which selects them), works out from
//! each client's [`profile::Device`] when its update would arrive, and trains only the clients
//! whose updates the engine would take — the first `target_clients` to finish within the
//! deadline — on the workers, folding their updates in the order they would have arrived. A
//! round the deadline cuts short is expired through the engine, which publishes it or
//! abandons it as it would any round. An asynchronous (FedBuff) task runs as events on the same
//! clock: clients start whenever a training slot is free and their updates arrive in order of
//! finishing, each against the version it started from.
//!
//! Determinism: a client's data, device, training and rounding all derive from the seed and
//! its id, and the engine folds updates in simulated-arrival order (ties by id), whatever
//! order the workers finish in, so the same seed gives the same model bit for bit with any
//! number of workers (central DP's noise aside: it is drawn from the operating system).

pub mod checkpoint;
pub mod cli;
pub mod driver;
pub mod history;
pub mod profile;
pub mod workers;

use std::ffi::OsString;

pub use driver::{run, run_until, Outcome};
pub use history::Row;
pub use profile::{Device, Profile};
/// What stops a [`run_until`].
pub use tokio_util::sync::CancellationToken;

use crate::error::ServerError;

/// What to simulate.
#[derive(Debug, Clone)]
pub struct Simulation {
    /// The task as `POST /admin/v1/tasks` takes it (`initial_model` may be left out).
    /// `round_deadline_secs` is in simulated seconds.
    pub task: serde_json::Value,
    /// The initial weights (then the task's `initial_model` is their digest, or left out);
    /// `None`: the built-in model's, made from the seed.
    pub initial: Option<hora_common::model::Model>,
    /// How many virtual clients the federation has.
    pub clients: u64,
    /// The federation's data, as `hora-client train --data` takes it
    /// (`synthetic:alpha=1,beta=1`): each client's shard is made by the worker that trains it.
    pub data: String,
    /// How a dataset that is not synthetic is split among the clients: `iid` (the default),
    /// `dirichlet:alpha=A`, `shards:k=K` or `quantity:sigma=S`.
    pub partition: Option<String>,
    pub seed: u64,
    /// Worker processes (each trains one client at a time on one thread).
    pub workers: usize,
    /// The worker's program and arguments (`hora-simulate-worker`).
    pub worker_command: Vec<OsString>,
    pub profile: Profile,
    /// After each published round, the model is evaluated on the pooled held-out data of this
    /// many clients (drawn once from the seed); 0: no evaluation.
    pub evaluate_clients: u64,
    /// Keep a checkpoint in this folder after every round, and resume from the one it holds
    /// (synchronous tasks; see [`checkpoint`]).
    pub checkpoint: Option<std::path::PathBuf>,
}

/// Why a simulation could not run.
#[derive(Debug, thiserror::Error)]
pub enum SimulationError {
    #[error("{0}")]
    Setup(String),
    #[error("simulation workers: {0}")]
    Workers(String),
    #[error(transparent)]
    Engine(#[from] ServerError),
    #[error("the simulation was stopped")]
    Cancelled,
}

impl From<crate::store::StoreError> for SimulationError {
    fn from(e: crate::store::StoreError) -> Self {
        SimulationError::Engine(e.into())
    }
}

/// The `hora-simulate-worker` next to the running program, else the one on `PATH`, as a worker
/// command.
pub fn default_worker_command() -> Vec<OsString> {
    const WORKER: &str = "hora-simulate-worker";
    let beside = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|d| d.join(WORKER)))
        .filter(|p| p.is_file());
    vec![beside.map_or_else(|| OsString::from(WORKER), |p| p.into_os_string())]
}
