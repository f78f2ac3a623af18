//! `hora-client sync`: synchronous data-parallel training on Horovod's model, built on the
//! collective stack of `hora-collective` (its ring, links, fusion and distributed optimizer).
//!
//! What is the edge client's here: [`rendezvous`] joins a job at the Hora server over this
//! client's HTTPS transport; [`checkpoint`] writes rank 0's checkpoints and finds the one to
//! resume from; [`worker`] trains the built-in MLP on a sharded dataset.

#[cfg(feature = "torch")]
pub mod checkpoint;
pub mod rendezvous;
#[cfg(feature = "torch")]
pub mod worker;

pub use hora_collective::CollectiveError;
pub use rendezvous::ServerRendezvous;
use thiserror::Error;

/// Why a sync job failed: its collectives (which name the rank at fault), its data or model, or
/// its checkpoints.
#[derive(Debug, Error)]
pub enum SyncError {
    #[error(transparent)]
    Collective(#[from] CollectiveError),
    #[cfg(feature = "torch")]
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
    #[error("{0}")]
    Config(String),
    /// Data, model or state-directory errors shared with the federated client.
    #[error("{0}")]
    Client(#[from] crate::error::ClientError),
    #[error("checkpoint: {0}")]
    Checkpoint(String),
}

pub type Result<T, E = SyncError> = std::result::Result<T, E>;
