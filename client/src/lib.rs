//! hora-client: the Hora client SDK (and, in `main.rs`, the `hora-client` binary).
//!
//! A client downloads its task's global model, trains on data that never leaves it with tch
//! (libtorch), seals `local − global` to the round key (hora-common's envelope) and uploads it.
//!
//! - [`client`]: [`Client`] — enrolment, long polling, joining, downloads (cached by digest),
//!   the round from training to a durable upload, and resuming after a restart.
//! - [`trainer`]: the [`Trainer`] trait users implement to bring their own model and data.
//! - [`supervised`]: the built-in trainer (cross-entropy classification; SGD with momentum or
//!   Adam; FedProx's proximal term) over a [`network::Network`]: logistic regression, MLP, CNN
//!   ([`network::Architecture`]) or the task's TorchScript module.
//! - [`data`]: datasets (CSV, MNIST IDX, and the FedProx paper's Synthetic(α, β) generator).
//! - [`transport`]: HTTPS with retries (exponential backoff, full jitter) for transient
//!   failures only; [`error`]: what a refusal means and what to do about it.
//! - [`simulate`]: a worker of a simulated federation, which trains virtual clients for the
//!   engine of `hora-server simulate` (`hora-simulate-worker`) or of
//!   `hora.simulation.run` (the user's Python trainer).
//! - [`state`]: credentials, cached models and the round in progress on the client's disk.
//! - [`device`]: `auto`/`cpu`/`cuda:N` as the user says it.
//!
//! ```no_run
//! # async fn demo(train: hora_client::data::Dataset) -> hora_client::Result<()> {
//! use hora_client::{Client, ClientConfig, SupervisedTrainer};
//! let config = ClientConfig::new("https://127.0.0.1:8443", "ca.pem", "client-state");
//! let client = Client::connect(config, Some("one-time-enrolment-token")).await?;
//! let mut trainer = SupervisedTrainer::new(train, None, tch::Device::Cpu)?;
//! client.run("my-task", &mut trainer, None, &mut |_| {}, &mut |r| println!("{r:?}")).await?;
//! # Ok(()) }
//! ```

pub mod client;
pub mod data;
#[cfg(feature = "torch")]
pub mod device;
pub mod error;
#[cfg(feature = "torch")]
pub mod network;
pub mod secure;
pub mod simulate;
pub mod state;
#[cfg(feature = "torch")]
pub mod supervised;
pub mod sync;
pub mod trainer;
pub mod transport;

pub use client::{Attempt, Client, ClientConfig, RoundOutcome, RoundReport, RoundTimings};
pub use error::{ClientError, Result};
#[cfg(feature = "torch")]
pub use supervised::SupervisedTrainer;
pub use trainer::{
    EvaluateRequest, Evaluation, Paced, Progress, TrainOutcome, TrainRequest, Trainer,
};
