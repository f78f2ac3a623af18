//! hora-common: what the Hora server, the client SDK and the synchronous allreduce mode share.
//!
//! - [`model`]: the model format — named f32 tensors in one flat buffer, safetensors in and out
//!   (f16/bf16 widened), a SHA-256 digest, validation against a [`model::ModelSpec`], and size
//!   limits checked before anything is allocated.
//! - [`codec`]: compressed updates — f16/bf16, int8 and 4-bit with per-block scales and
//!   stochastic rounding, top-k with error feedback — and the server's reading of them.
//! - [`envelope`]: how a client's delta travels — sealed to the round's X25519 key (HKDF-SHA256,
//!   AES-256-GCM) and bound to task, round, client and base model.
//! - [`kernel`]: the averaging kernel — a running weighted sum (`add`, `merge`, `finish`) on the
//!   CPU at memory bandwidth. Its libtorch backend is the sibling crate `hora-common-tch`
//!   (`common/tch/`), so that the server, which depends on this crate, never links libtorch.
//! - [`secagg`]: secure aggregation (SecAgg+): keys, Shamir shares, masks, quantisation, the
//!   client's state machine and the server's unmasking, so that the server learns only sums.
//! - [`simulation`]: what a simulated federation's engine and its workers (virtual clients'
//!   training, in other processes) say to each other over a pipe.
//! - [`tls`]: rustls with the ring provider: PEM reading and the client configuration.
//! - [`wire`]: the JSON types of the client (`/v1`) and admin (`/admin/v1`) APIs.
//!
//! A round on the server reads top to bottom through these: an upload is [`envelope::open`]ed,
//! parsed with [`model::Model::from_safetensors`] under the task's [`model::ModelSpec::limits`],
//! checked with [`model::ModelSpec::check`] and [`model::Model::check_finite`], and folded with
//! [`kernel::WeightedSum::add`]; the round's result is [`kernel::WeightedSum::finish`].

pub mod codec;
#[cfg(feature = "config")]
pub mod config;
pub mod envelope;
pub mod kernel;
#[cfg(feature = "logging")]
pub mod logging;
pub mod model;
pub mod secagg;
pub mod simulation;
#[cfg(any(test, feature = "test-util"))]
pub mod testing;
pub mod tls;
pub mod wire;

/// The hex SHA-256 of `bytes`: how modules, masked sums and stored secrets are named and checked.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(ring::digest::digest(&ring::digest::SHA256, bytes))
}
