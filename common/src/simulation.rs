//! What a simulated federation's engine and its workers say to each other.
//!
//! A simulation (`hora-server simulate`) runs the server's round engine in one process and its
//! virtual clients on a pool of workers (`hora-simulate-worker` processes). A worker holds
//! no client: each [`Job`] names the client it trains for, the worker builds that client's data
//! from `(data, seed, client)`, trains from the round's global model, and answers with the
//! encoded update, exactly what a deployed client would seal and upload.
//!
//! ```text
//! engine ──Setup──▶ worker            (once)
//! engine ──Job────▶ worker ──Reply──▶ engine   (any number, one at a time per worker)
//! ```
//!
//! Frames go over the worker's standard input and output: one line of JSON ([`Header`]), then
//! `payload` raw bytes (a model or an encoded update; none for most messages). Every size is
//! checked before anything is allocated.

use std::io::{BufRead, Write};
use std::path::PathBuf;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::codec::Compression;
use crate::model::ModelDigest;
use crate::wire::{Metrics, ModelKind, TrainingConfig};

/// The protocol's version: an engine and a worker of different versions refuse each other.
pub const PROTOCOL: u32 = 2;

/// The longest header line a frame may have.
pub const MAX_HEADER_BYTES: usize = 1 << 20;

/// The largest payload a frame may carry (a model or an update of 1 GiB of f32 values).
pub const MAX_PAYLOAD_BYTES: u64 = 1 << 32;

/// The first frame an engine sends a worker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Setup {
    pub protocol: u32,
    /// The federation's data, as `hora-client train --data` takes it (a synthetic source's
    /// `clients` and `seed` are the simulation's).
    pub data: String,
    /// How a dataset that is not synthetic is split among the clients (`iid`,
    /// `dirichlet:alpha=A`, `shards:k=K`, `quantity:sigma=S`); a synthetic one is split by its
    /// generator.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partition: Option<String>,
    /// How many virtual clients the federation has (client ids are `0..clients`).
    pub clients: u64,
    /// The simulation's seed: data, training and rounding all derive from it.
    pub seed: u64,
    /// Where the engine writes each global model the workers train from (`<digest>.safetensors`).
    pub models_dir: PathBuf,
    /// Where clients' state lives between their rounds (error feedback), one file per client.
    pub state_dir: PathBuf,
    /// libtorch's threads in the worker (1 keeps training bit-for-bit reproducible).
    pub threads: u32,
}

/// Work for a worker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "job", rename_all = "snake_case", deny_unknown_fields)]
pub enum Job {
    /// The initial weights of a built-in model, from the seed.
    Initial { model_kind: ModelKind, seed: u64 },
    /// How many training examples each of these clients has.
    Sizes { clients: Vec<u64> },
    /// One round of one client: train from `model`, answer with the encoded update.
    Train(TrainJob),
    /// Evaluate `model` on these clients' held-out data, pooled.
    Evaluate {
        model: ModelDigest,
        /// For a task that trains part of its model: the frozen base `model` completes.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        frozen_base: Option<ModelDigest>,
        model_kind: ModelKind,
        clients: Vec<u64>,
    },
}

/// One client's local training for one round.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainJob {
    pub client: u64,
    /// The round (an asynchronous task's version) the client trains for.
    pub round: u64,
    pub model: ModelDigest,
    pub model_kind: ModelKind,
    pub training: TrainingConfig,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compression: Option<Compression>,
    /// For a task that trains part of its model: the frozen base `model` (the trainable part)
    /// completes. The client trains the whole model and the update carries the part.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frozen_base: Option<ModelDigest>,
}

/// A worker's answer to a [`Job`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "snake_case", deny_unknown_fields)]
pub enum Reply {
    /// The payload is the model's safetensors.
    Initial,
    Sizes {
        examples: Vec<u64>,
    },
    /// The payload is the update, encoded as the task's compression says (its plaintext before
    /// sealing).
    Trained {
        num_examples: u64,
        metrics: Metrics,
        /// Seconds the training took on the worker (wall time, not simulated).
        seconds: f64,
    },
    /// The examples' mean loss and accuracy: either is None where the trainer gave none (or
    /// no finite value).
    Evaluated {
        loss: Option<f64>,
        accuracy: Option<f64>,
        examples: u64,
    },
    /// The job failed; the worker goes on with the next. A failed training counts as the
    /// client's dropout.
    Failed {
        error: String,
    },
}

/// An example-weighted mean of the finite values given.
#[derive(Default)]
pub struct Mean {
    sum: f64,
    weight: u64,
}

impl Mean {
    pub fn add(&mut self, value: f64, examples: u64) {
        if value.is_finite() && examples > 0 {
            self.sum += value * examples as f64;
            self.weight += examples;
        }
    }

    pub fn value(&self) -> Option<f64> {
        (self.weight > 0).then(|| self.sum / self.weight as f64)
    }
}

/// A frame's first line.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Header<T> {
    /// The bytes that follow the line.
    pub payload: u64,
    pub body: T,
}

/// What can go wrong on a worker's pipe.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("the other side closed the pipe")]
    Closed,
    #[error("reading or writing the pipe failed: {0}")]
    Io(#[from] std::io::Error),
    #[error("a frame is malformed: {0}")]
    Malformed(String),
}

/// Writes one frame and flushes it.
pub fn write_frame<T: Serialize>(
    out: &mut impl Write,
    body: &T,
    payload: &[u8],
) -> Result<(), FrameError> {
    let header = Header {
        payload: payload.len() as u64,
        body,
    };
    let mut line = serde_json::to_vec(&header).map_err(|e| FrameError::Malformed(e.to_string()))?;
    line.push(b'\n');
    out.write_all(&line)?;
    out.write_all(payload)?;
    out.flush()?;
    Ok(())
}

/// Reads one frame: its body and its payload. [`FrameError::Closed`] at a clean end of input.
pub fn read_frame<T: DeserializeOwned>(
    input: &mut impl BufRead,
) -> Result<(T, Vec<u8>), FrameError> {
    let mut line = Vec::new();
    // (`take` bounds the line before it is read whole.)
    let read = std::io::Read::take(&mut *input, MAX_HEADER_BYTES as u64 + 1)
        .read_until(b'\n', &mut line)?;
    if read == 0 {
        return Err(FrameError::Closed);
    }
    if line.last() != Some(&b'\n') {
        return Err(match line.len() > MAX_HEADER_BYTES {
            true => FrameError::Malformed(format!(
                "a header line is longer than {MAX_HEADER_BYTES} bytes"
            )),
            false => FrameError::Closed,
        });
    }
    let header: Header<T> =
        serde_json::from_slice(&line).map_err(|e| FrameError::Malformed(e.to_string()))?;
    if header.payload > MAX_PAYLOAD_BYTES {
        return Err(FrameError::Malformed(format!(
            "a payload of {} bytes is over the limit of {MAX_PAYLOAD_BYTES}",
            header.payload
        )));
    }
    let mut payload = vec![0; header.payload as usize];
    input.read_exact(&mut payload).map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => FrameError::Closed,
        _ => FrameError::Io(e),
    })?;
    Ok((header.body, payload))
}

/// A seed of its own for each `(seed, client, round)`: what a client's training and rounding
/// draw from, whichever worker trains it.
pub fn client_seed(seed: u64, client: u64, round: u64) -> u64 {
    // SplitMix64 over the three, so neighbouring ids give unrelated streams.
    let mut x = seed ^ client.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ round.rotate_left(32);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_bad_ones_are_refused() {
        let job = Job::Sizes {
            clients: vec![3, 1],
        };
        let mut pipe = Vec::new();
        write_frame(&mut pipe, &job, b"abc").unwrap();
        write_frame(&mut pipe, &Reply::Initial, &[]).unwrap();
        let mut input = std::io::Cursor::new(pipe);
        let (read, payload): (Job, _) = read_frame(&mut input).unwrap();
        assert_eq!((read, payload.as_slice()), (job, &b"abc"[..]));
        let (reply, payload): (Reply, _) = read_frame(&mut input).unwrap();
        assert_eq!((reply, payload.len()), (Reply::Initial, 0));
        assert!(matches!(
            read_frame::<Reply>(&mut input),
            Err(FrameError::Closed)
        ));

        // A payload over the limit is refused before it is allocated; a cut one is a close.
        let huge = format!(
            "{{\"payload\":{},\"body\":{{\"reply\":\"initial\"}}}}\n",
            MAX_PAYLOAD_BYTES + 1
        );
        let mut input = std::io::Cursor::new(huge.into_bytes());
        assert!(matches!(
            read_frame::<Reply>(&mut input),
            Err(FrameError::Malformed(m)) if m.contains("over the limit")
        ));
        let cut = b"{\"payload\":5,\"body\":{\"reply\":\"initial\"}}\nab".to_vec();
        assert!(matches!(
            read_frame::<Reply>(&mut std::io::Cursor::new(cut)),
            Err(FrameError::Closed)
        ));
        let junk = b"{\"payload\":0,\"body\":{\"reply\":\"nonsense\"}}\n".to_vec();
        assert!(matches!(
            read_frame::<Reply>(&mut std::io::Cursor::new(junk)),
            Err(FrameError::Malformed(_))
        ));
    }

    #[test]
    fn client_seeds_differ_by_client_and_round_and_repeat() {
        let a = client_seed(7, 1, 1);
        assert_eq!(a, client_seed(7, 1, 1));
        assert_ne!(a, client_seed(7, 2, 1));
        assert_ne!(a, client_seed(7, 1, 2));
        assert_ne!(a, client_seed(8, 1, 1));
    }
}
