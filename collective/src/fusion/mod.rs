//! Fusion (Horovod's): many small buffers make one large one, so a model with hundreds of
//! parameter tensors pays for a few ring passes, not hundreds of latency-bound ones.
//!
//! Buffers are packed in order into buckets of at most a threshold of `f32` bytes (64 MiB by
//! default; a larger buffer forms a bucket of its own); each bucket is copied into a fusion
//! buffer, reduced or broadcast in one collective, and copied back. Every rank must pass buffers
//! of the same shapes in the same order: each bucket's shapes are fingerprinted and the ranks
//! compare fingerprints before exchanging a byte.
//!
//! [`HostFusion`] fuses host `f32` memory: what the Python package's `hora.sync` hands over for
//! its tensors and arrays (so Python does no packing of its own). With the `torch` feature,
//! [`Fusion`] fuses tch tensors of any kind and device, a GPU's on the GPU.

#[cfg(feature = "torch")]
mod tensor;

use std::ops::Range;

#[cfg(feature = "torch")]
pub use tensor::Fusion;

use crate::ring::{fingerprint, Communicator, Reduce};
use crate::{CollectiveError, Result};

/// Horovod's default fusion threshold.
pub const DEFAULT_THRESHOLD: usize = 64 << 20;

/// Consecutive runs of buffers of at most `threshold` bytes together (a larger buffer alone);
/// `sizes` gives each buffer's bytes and whether it must start a new bucket (another device).
pub(crate) fn plan(
    sizes: impl IntoIterator<Item = (usize, bool)>,
    threshold: usize,
) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let (mut start, mut bytes, mut count) = (0, 0usize, 0);
    for (i, (size, apart)) in sizes.into_iter().enumerate() {
        if i > start && (bytes.saturating_add(size) > threshold || apart) {
            out.push(start..i);
            (start, bytes) = (i, 0);
        }
        bytes = bytes.saturating_add(size);
        count = i + 1;
    }
    if start < count {
        out.push(start..count);
    }
    out
}

/// What the ranks compare before a bucket's collective: its shapes, in order.
pub(crate) fn shapes_fingerprint<'a>(
    shapes: impl IntoIterator<Item = &'a [u64]>,
    salt: u64,
) -> u64 {
    fingerprint(
        std::iter::once(salt).chain(
            shapes
                .into_iter()
                .flat_map(|s| std::iter::once(s.len() as u64).chain(s.iter().copied())),
        ),
    )
}

/// One buffer of host memory to fuse, with its shape (for the ranks' comparison; its element
/// count must be the shape's product).
pub struct Part<'a> {
    pub shape: Vec<u64>,
    pub values: &'a mut [f32],
}

/// Fuses host `f32` buffers for the collectives, reusing one fusion buffer between calls.
#[derive(Debug)]
pub struct HostFusion {
    threshold_bytes: usize,
    buffer: Vec<f32>,
}

impl Default for HostFusion {
    fn default() -> Self {
        HostFusion::new(DEFAULT_THRESHOLD)
    }
}

impl HostFusion {
    pub fn new(threshold_bytes: usize) -> Self {
        HostFusion {
            threshold_bytes: threshold_bytes.max(4),
            buffer: Vec::new(),
        }
    }

    /// Buckets of at most `threshold_bytes` from now on (the fusion buffer is kept).
    pub fn set_threshold(&mut self, threshold_bytes: usize) {
        self.threshold_bytes = threshold_bytes.max(4);
    }

    /// Replaces each part by its sum or mean over all ranks.
    pub fn allreduce(
        &mut self,
        comm: &mut Communicator,
        parts: &mut [Part<'_>],
        reduce: Reduce,
    ) -> Result<()> {
        self.run(parts, 0, |fused, fp| comm.allreduce(fused, reduce, fp))
    }

    /// Replaces each part by `root`'s.
    pub fn broadcast(
        &mut self,
        comm: &mut Communicator,
        parts: &mut [Part<'_>],
        root: u32,
    ) -> Result<()> {
        self.run(parts, 1, |fused, fp| comm.broadcast(fused, root, fp))
    }

    /// Packs `parts` bucket by bucket into the fusion buffer, runs `collective` on it with the
    /// bucket's fingerprint (its shapes, and `salt`, which tells the kinds of collective apart),
    /// and copies the result back. For callers that run the collective their own way (the
    /// Python binding releases the interpreter's lock around it, and only around it).
    pub fn run(
        &mut self,
        parts: &mut [Part<'_>],
        salt: u64,
        mut collective: impl FnMut(&mut [f32], u64) -> Result<()>,
    ) -> Result<()> {
        for (i, part) in parts.iter().enumerate() {
            let elements = part
                .shape
                .iter()
                .try_fold(1u64, |n, &d| n.checked_mul(d))
                .and_then(|n| usize::try_from(n).ok());
            if elements != Some(part.values.len()) {
                return Err(CollectiveError::Config(format!(
                    "buffer {i} has {} elements but its shape {:?} says otherwise",
                    part.values.len(),
                    part.shape
                )));
            }
        }
        let sizes = parts.iter().map(|p| (p.values.len() * 4, false));
        for bucket in plan(sizes, self.threshold_bytes) {
            let parts = &mut parts[bucket];
            let fp = shapes_fingerprint(parts.iter().map(|p| p.shape.as_slice()), salt);
            let total: usize = parts.iter().map(|p| p.values.len()).sum();
            self.buffer.resize(total, 0.0);
            let mut at = 0;
            for p in parts.iter() {
                self.buffer[at..at + p.values.len()].copy_from_slice(p.values);
                at += p.values.len();
            }
            collective(&mut self.buffer[..total], fp)?;
            let mut at = 0;
            for p in parts.iter_mut() {
                let n = p.values.len();
                p.values.copy_from_slice(&self.buffer[at..at + n]);
                at += n;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ring::tests::with_world;
    use crate::CommOptions;

    #[test]
    fn plans_respect_the_threshold_and_the_breaks() {
        let sizes = |ns: &[usize]| ns.iter().map(|&n| (n * 4, false)).collect::<Vec<_>>();
        assert_eq!(plan(sizes(&[10, 10, 30, 5, 5]), 80), vec![0..2, 2..3, 3..5]);
        assert_eq!(plan(sizes(&[10, 10, 30, 5, 5]), 1 << 20), vec![0..5]);
        assert_eq!(plan(sizes(&[10, 10, 30, 5, 5]), 4).len(), 5);
        assert_eq!(plan(sizes(&[]), 80), Vec::<Range<usize>>::new());
        let apart = [(4, false), (4, true), (4, false)];
        assert_eq!(plan(apart, 1 << 20), vec![0..1, 1..3]);
    }

    #[test]
    fn fused_host_buffers_are_averaged_and_broadcast_in_place() {
        let results = with_world(3, CommOptions::default(), |comm| {
            let r = comm.rank() as f32;
            let mut a = vec![r; 6];
            let mut b: Vec<f32> = (0..7).map(|i| 10.0 * r + i as f32).collect();
            let mut c = vec![r + 1.0];
            // A threshold that splits the list into several buckets.
            let mut fusion = HostFusion::new(32);
            let mut parts = [
                Part {
                    shape: vec![2, 3],
                    values: &mut a,
                },
                Part {
                    shape: vec![7],
                    values: &mut b,
                },
                Part {
                    shape: vec![],
                    values: &mut c,
                },
            ];
            fusion.allreduce(comm, &mut parts, Reduce::Average).unwrap();
            let mut own = vec![r; 4];
            fusion
                .broadcast(
                    comm,
                    &mut [Part {
                        shape: vec![4],
                        values: &mut own,
                    }],
                    1,
                )
                .unwrap();
            (a, b, c, own)
        });
        for (a, b, c, own) in results {
            assert_eq!(a, vec![1.0; 6]);
            assert_eq!(b, (0..7).map(|i| 10.0 + i as f32).collect::<Vec<_>>());
            assert_eq!(c, vec![2.0]);
            assert_eq!(own, vec![1.0; 4]);
        }
    }

    #[test]
    fn different_shapes_on_different_ranks_or_a_wrong_shape_are_errors() {
        let results = with_world(2, CommOptions::default(), |comm| {
            let shape = if comm.rank() == 0 {
                vec![2, 3]
            } else {
                vec![3, 2]
            };
            let mut values = vec![0.0; 6];
            HostFusion::default()
                .allreduce(
                    comm,
                    &mut [Part {
                        shape,
                        values: &mut values,
                    }],
                    Reduce::Sum,
                )
                .map_err(|e| e.to_string())
        });
        let errors: Vec<String> = results.into_iter().map(|r| r.unwrap_err()).collect();
        assert!(
            errors.iter().all(|e| e.contains("differs between ranks")),
            "both ranks compare the other's shapes with their own: {errors:?}"
        );
        let mut values = vec![0.0; 5];
        let err = HostFusion::default()
            .allreduce(
                &mut Communicator::single(),
                &mut [Part {
                    shape: vec![2, 3],
                    values: &mut values,
                }],
                Reduce::Sum,
            )
            .unwrap_err();
        assert!(err.to_string().contains("5 elements"), "{err}");
    }
}
