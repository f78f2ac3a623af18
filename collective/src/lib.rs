//! Hora's collective stack: synchronous allreduce for datacenter workers, on Horovod's model.
//!
//! Federated rounds suit edge devices; inside a datacenter, workers that each hold a shard of the
//! data train one model in lock-step and average gradients every step. This crate is everything
//! such a worker needs to talk to the others, and nothing of the federated client: no HTTP
//! client, no enrolment, no local state. The pieces, in the order a worker meets them:
//!
//! - [`launch`] reads a rank and world size from the launcher (hora-run, torchrun, mpirun,
//!   Slurm, or flags);
//! - [`rendezvous`] gathers the world: at a rendezvous service (the Hora server's
//!   `/v1/sync/{job}/join`, reached through the [`Rendezvous`] trait that `hora-client`
//!   implements over its HTTPS transport), or from a static list of peer addresses; every worker
//!   learns its rank, the world size and its ring neighbours;
//! - [`link`] connects each worker to its ring neighbours over TCP: a small frame protocol with a
//!   handshake in which neighbours prove to each other that they know the world's session (a
//!   challenge-response, `handshake`; strangers learn nothing), every frame after it sealed with
//!   AES-256-GCM under keys of the connection (`sealed`), timeouts, and abort frames that
//!   carry the name of a failed rank around the ring so that every survivor can say who is
//!   missing; between neighbours on one host the payloads go through shared memory instead;
//! - [`ring`] runs the collectives over those links — allreduce (ring reduce-scatter, then
//!   allgather), broadcast and allgather — pipelined in sub-chunks so that sending, receiving and
//!   reducing overlap, with optional half-precision on the wire;
//! - [`region`] is the narrow interface between the ring and the memory it reduces: host `f32`
//!   slices (hora-common's kernel) or, with the `torch` feature, tensor views on any device
//!   (hora-common-tch's kernel, CUDA included);
//! - [`world`] binds, meets and connects: a [`Communicator`] from a launcher's rank;
//! - [`nccl`] runs the collectives of tensors in GPU memory through NCCL (the library PyTorch's
//!   wheel ships, opened at run time), agreed on over the ring ([`Communicator::use_nccl`]);
//! - [`fusion`] packs lists of buffers into fusion buffers (Horovod's fusion threshold): host
//!   memory ([`HostFusion`], what the Python package uses), or tensors of any device with the
//!   `torch` feature;
//! - with the `torch` feature, `optimizer` is the training API with Horovod's rules built in:
//!   broadcast of rank 0's parameters and optimizer state, a distributed optimizer that
//!   allreduces gradients after `backward_passes_per_step` local passes, learning-rate scaling by
//!   world size.
//!
//! `hora-client sync` (the MLP trained on a sharded dataset, with checkpoints) and the Python
//! package's `hora.sync` are built on this crate.

pub mod fusion;
mod handshake;
pub mod launch;
pub mod link;
pub mod nccl;
#[cfg(feature = "torch")]
pub mod optimizer;
pub mod region;
pub mod rendezvous;
pub mod ring;
mod sealed;
pub mod world;

use std::io;

use hora_common::kernel::KernelError;
use thiserror::Error;

#[cfg(feature = "torch")]
pub use fusion::Fusion;
pub use fusion::HostFusion;
pub use launch::{torchrun_peers, LaunchRank};
#[cfg(feature = "torch")]
pub use optimizer::{Algorithm, DistributedOptimizer, LrScaling, Snapshot, SyncOptimizer, UseNccl};
pub use rendezvous::{Rendezvous, World};
pub use ring::{CommOptions, Communicator, Reduce, Wire};
pub use world::{bind, connect, form_world, ElasticMeeting, Meeting};

/// Why a collective failed. Every variant that involves another worker names its rank, so that
/// an operator knows which process to look at.
#[derive(Debug, Error)]
pub enum CollectiveError {
    /// Another worker died, stalled, or reported a failure.
    #[error("rank {rank} {what}")]
    PeerFailed { rank: u32, what: String },
    /// The ranks made different collective calls (different sizes, order, or tensors).
    #[error("{0}")]
    Mismatch(String),
    /// A worker of another job, generation or version spoke to us, or sent a malformed frame.
    #[error("protocol error: {0}")]
    Protocol(String),
    #[error("rendezvous: {0}")]
    Rendezvous(String),
    /// The job's training finished before this worker joined it: there is nothing to do.
    #[error("{0}")]
    JobFinished(String),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: io::Error,
    },
    #[error("averaging kernel: {0}")]
    Kernel(#[from] KernelError),
    #[cfg(feature = "torch")]
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
    #[error("{0}")]
    Config(String),
    /// NCCL or the CUDA runtime refused a call.
    #[error("NCCL: {0}")]
    Nccl(String),
    /// An NCCL collective did not complete: a rank died or stalled mid-collective.
    #[error("NCCL: {0}")]
    NcclStalled(String),
    /// A collective failed earlier; the ring is no longer in a known state.
    #[error("this worker's ring failed earlier ({0}); a new world must be formed (an elastic job does it itself; restart a fixed one)")]
    Poisoned(String),
}

impl CollectiveError {
    /// Whether this is a lost or stalled worker that an elastic job survives (by rolling back
    /// and forming the next world), not a bug, a mismatch or bad data, which would fail the next
    /// world too.
    pub fn survivable(&self) -> bool {
        matches!(
            self,
            CollectiveError::PeerFailed { .. }
                | CollectiveError::NcclStalled(_)
                | CollectiveError::Poisoned(_)
                | CollectiveError::Io { .. }
        )
    }

    pub(crate) fn io(context: impl Into<String>, source: io::Error) -> Self {
        CollectiveError::Io {
            context: context.into(),
            source,
        }
    }
}

pub type Result<T, E = CollectiveError> = std::result::Result<T, E>;
