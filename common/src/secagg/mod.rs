//! Secure aggregation: Practical Secure Aggregation (Bonawitz et al., CCS 2017) over SecAgg+'s
//! sparse neighbour graph (Bell et al., CCS 2020). The server learns the sum of the round's
//! updates and nothing about any single one.
//!
//! One round attempt has four stages; each client's part is [`ClientSession`], the server's
//! arithmetic is [`unmask`] (its state machine, deadlines and storage live in the server crate):
//!
//! 0. **Advertise** — each client makes two X25519 keys (`c` for masks, `s` for share
//!    encryption) and sends their public halves signed with its Ed25519 identity ([`keys`]).
//! 1. **Share keys** — the server fixes the participants and the neighbour [`graph`]; each
//!    client checks its neighbours' signatures, draws a self-mask seed `b`, splits `b` and its
//!    `c` secret t-of-k with [`shamir`], and sends each neighbour its shares, AES-GCM-encrypted
//!    under a key only the two of them can derive.
//! 2. **Masked input** — each client [`quantise`]s its weighted delta into Z_2^32 and uploads it
//!    plus its self-mask plus, for every neighbour that shared, ± the pairwise mask they agree
//!    on ([`masks`]). The server adds the uploads as they come; each is uniformly random to it.
//! 3. **Unmask** — the server names each client's surviving and dropped neighbours; the client
//!    reveals shares of the survivors' `b` and of the dropped ones' `c`, never both for one
//!    peer. With `t` shares of each, the server removes the self-masks and the pairwise masks
//!    that have no partner, leaving the sum of the survivors' inputs.
//!
//! Every key, mask and ciphertext is bound to a [`Context`] (task, round, attempt), so nothing
//! carries over between rounds or retries.
//!
//! **Threat model.** The server is honest but curious: it runs the protocol as written and
//! learns nothing beyond the sum from everything it sees and stores. Clients may misbehave in
//! what they send (forged keys, misdirected shares, replays, greedy unmask answers) and are
//! refused. Not implemented: Bonawitz et al.'s consistency-check round (survivors sign the
//! survivor set before anyone reveals), which is what stops an *actively malicious* server from
//! telling different neighbours of one client different survivor sets and so collecting both
//! its self-mask and its mask key; nor a PKI beyond the identity keys registered at enrolment,
//! which the server relays.

#[cfg(test)]
mod adversarial;
pub mod client;
pub mod graph;
pub mod keys;
pub mod masks;
pub mod quantise;
pub mod shamir;
#[cfg(any(test, feature = "test-util"))]
pub mod simulate;
#[cfg(test)]
mod uniformity;
pub mod unmask;

pub use client::{ClientSession, Stage};
pub use keys::Identity;
pub use quantise::Quantiser;
pub use unmask::Unmasker;

use thiserror::Error;

#[derive(Debug, Error)]
pub enum SecAggError {
    #[error("malformed secure-aggregation message: {0}")]
    Malformed(String),
    #[error("a key is a low-order point (it would make the shared secret predictable)")]
    LowOrderKey,
    #[error("forged or misdirected message: {0}")]
    Forged(String),
    #[error("not enough participants: {0}")]
    Threshold(String),
    #[error("inconsistent shares: {0}")]
    Inconsistent(String),
    #[error("out of order: {0}")]
    Stage(String),
    #[error("{0}")]
    Parameters(String),
    #[error("the system random number generator failed")]
    Rng,
}

/// What every key, mask and ciphertext of one round attempt is bound to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Context {
    pub task: String,
    pub round: u64,
    pub attempt: u32,
}

impl Context {
    pub fn new(task: &str, round: u64, attempt: u32) -> Self {
        Context {
            task: task.to_string(),
            round,
            attempt,
        }
    }

    pub(crate) fn encode_into(&self, out: &mut Vec<u8>) {
        keys::put_str(out, &self.task);
        out.extend_from_slice(&self.round.to_be_bytes());
        out.extend_from_slice(&self.attempt.to_be_bytes());
    }
}

/// Decodes a fixed-size hex field of a message.
pub fn hex_array<const N: usize>(what: &str, s: &str) -> Result<[u8; N], SecAggError> {
    let mut out = [0u8; N];
    hex::decode_to_slice(s, &mut out)
        .map_err(|_| SecAggError::Malformed(format!("{what} must be {N} bytes of hex")))?;
    Ok(out)
}
