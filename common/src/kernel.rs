//! The averaging kernel: a running weighted sum over a model's parameters.
//!
//! Everything that averages in Hora goes through it: the server folds each client's delta into
//! the round's sum the moment it arrives (so memory is O(model), never O(clients × model)),
//! partial sums from shards or hierarchical aggregators combine with [`WeightedSum::merge`], and
//! the allreduce ring reduces its chunks with the same operations.
//!
//! Three operations: [`WeightedSum::add`] folds `weight × update` into the sum,
//! [`WeightedSum::merge`] adds another partial sum, [`WeightedSum::finish`] divides by the total
//! weight. The sum is kept in **f64**: a running f32 sum of a thousand updates drifts by a few
//! 1e-6 relative (error grows like √n·ε₃₂), while f64 keeps the result within f32 rounding of the
//! exact weighted mean. It costs bandwidth (20 bytes moved per parameter and update instead of 12)
//! and is what makes the result independent of arrival order to the last f32 bit in practice.
//!
//! Backends: this module is the CPU one — one pass over flat buffers, split into fixed chunks
//! that rayon spreads over the cores for large models, with no allocation per `add`; it runs at
//! memory bandwidth (see `benches/kernel.rs`). The libtorch backend, `hora_common_tch`, runs the
//! same arithmetic on any tch device, CUDA included. It is a crate of its own rather than a cargo
//! feature of this one because Cargo unifies features across a workspace build: a feature that
//! the client switched on would link libtorch into the server whenever both are built together.
//!
//! The kernel does not validate values: callers check updates (finite, right spec) before folding.

use rayon::prelude::*;
use thiserror::Error;

use crate::codec::Update;
use crate::model::{f32_le, widen_half, DType, Model, ModelSpec, ModelView};

/// Elements per parallel task: 32 Ki f32 + 32 Ki f64 = 384 KiB, about an L2's worth.
pub(crate) const CHUNK: usize = 1 << 15;
/// Below this many elements one thread is faster than waking the pool.
pub(crate) const PARALLEL_MIN: usize = 1 << 17;

/// Why a fold was refused. The sum is unchanged when any of these is returned.
#[derive(Debug, Error, PartialEq)]
pub enum KernelError {
    #[error("weight {0} is not a positive finite number")]
    BadWeight(f64),
    #[error("update does not match the model: {0}")]
    LayoutMismatch(String),
    #[error("nothing to average: no update has been added")]
    Empty,
    /// The result would hold a NaN or an infinity (updates that overflow f32 when averaged).
    #[error("the result is not finite: {0}")]
    NotFinite(String),
    /// A backend (libtorch) failed; the message is the backend's.
    #[error("{0}")]
    Backend(String),
}

/// A running weighted sum over the parameters of one model spec, accumulated in f64.
#[derive(Debug, Clone, PartialEq)]
pub struct WeightedSum {
    spec: ModelSpec,
    sum: Vec<f64>,
    total_weight: f64,
    updates: u64,
}

impl WeightedSum {
    /// An empty sum for models of `spec` (allocates the f64 accumulator once).
    pub fn new(spec: ModelSpec) -> Self {
        let sum = vec![0.0; spec.numel()];
        WeightedSum {
            spec,
            sum,
            total_weight: 0.0,
            updates: 0,
        }
    }

    /// Rebuilds a sum from its parts (a checkpoint).
    pub fn from_parts(
        spec: ModelSpec,
        sum: Vec<f64>,
        total_weight: f64,
        updates: u64,
    ) -> Result<Self, KernelError> {
        if sum.len() != spec.numel() {
            return Err(KernelError::LayoutMismatch(format!(
                "{} accumulated values for a spec of {} parameters",
                sum.len(),
                spec.numel()
            )));
        }
        if !(total_weight.is_finite() && total_weight >= 0.0) {
            return Err(KernelError::BadWeight(total_weight));
        }
        Ok(WeightedSum {
            spec,
            sum,
            total_weight,
            updates,
        })
    }

    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    /// Σ weight × update, element by element.
    pub fn sum(&self) -> &[f64] {
        &self.sum
    }

    /// The sum itself, for mechanisms that post-process it in place (the server's central
    /// differential privacy adds noise to it, stretch by stretch).
    pub fn sum_mut(&mut self) -> &mut [f64] {
        &mut self.sum
    }

    pub fn total_weight(&self) -> f64 {
        self.total_weight
    }

    /// Replaces the total weight [`finish`](Self::finish) divides by: a fixed denominator (the
    /// expected number of updates, as differentially private averaging uses) instead of Σ wᵢ.
    pub fn set_total_weight(&mut self, total_weight: f64) -> Result<(), KernelError> {
        check_weight(total_weight)?;
        self.total_weight = total_weight;
        Ok(())
    }

    /// Number of updates folded in (merges included).
    pub fn updates(&self) -> u64 {
        self.updates
    }

    /// Folds `weight × update` into the sum. `update` must have this sum's spec (names and shapes).
    pub fn add(&mut self, weight: f64, update: &Model) -> Result<(), KernelError> {
        if !update.same_layout(&self.spec) {
            return Err(KernelError::LayoutMismatch(
                "tensor names or shapes differ from the spec".into(),
            ));
        }
        self.add_flat(weight, update.data())
    }

    /// Folds `weight × update` where `update` is a flat buffer in the spec's layout.
    pub fn add_flat(&mut self, weight: f64, update: &[f32]) -> Result<(), KernelError> {
        check_weight(weight)?;
        if update.len() != self.sum.len() {
            return Err(KernelError::LayoutMismatch(format!(
                "{} values for a model of {} parameters",
                update.len(),
                self.sum.len()
            )));
        }
        zip_apply(&mut self.sum, update, |s, u| *s += weight * f64::from(u));
        self.counted(weight);
        Ok(())
    }

    /// Folds `weight × update` straight from safetensors bytes (f32, or f16/bf16 widened on the
    /// fly): the server's upload path, which never materialises the update as a [`Model`].
    pub fn add_view(&mut self, weight: f64, update: &ModelView<'_>) -> Result<(), KernelError> {
        self.add_view_scaled(weight, 1.0, update)
    }

    /// Folds `weight × scale × update`, counting `weight` (not `weight × scale`) in the total:
    /// an update clipped to a norm bound (scale < 1) keeps its example weight.
    pub fn add_view_scaled(
        &mut self,
        weight: f64,
        scale: f64,
        update: &ModelView<'_>,
    ) -> Result<(), KernelError> {
        let factor = fold_factor(weight, scale)?;
        let theirs = update.tensors();
        let ours = self.spec.tensors();
        if theirs.len() != ours.len()
            || theirs
                .iter()
                .zip(ours)
                .any(|(t, o)| t.name != o.name || t.shape != o.shape)
        {
            return Err(KernelError::LayoutMismatch(
                "tensor names or shapes differ from the spec".into(),
            ));
        }
        let mut offset = 0;
        for t in theirs {
            let n = t.numel();
            let sum = &mut self.sum[offset..offset + n];
            offset += n;
            match t.dtype {
                DType::F32 => {
                    zip_apply_bytes::<4>(sum, t.data, |s, b| *s += factor * f64::from(f32_le(b)))
                }
                dtype => zip_apply_bytes::<2>(sum, t.data, |s, b| {
                    *s += factor * f64::from(widen_half(dtype, [b[0], b[1]]))
                }),
            }
        }
        self.counted(weight);
        Ok(())
    }

    /// Folds `weight × scale × update` for an update in either format ([`crate::codec`]): an
    /// encoded one is decoded value by value into the sum, never widened as a whole.
    pub fn add_update_scaled(
        &mut self,
        weight: f64,
        scale: f64,
        update: &Update<'_>,
    ) -> Result<(), KernelError> {
        let view = match update {
            Update::Dense(view) => return self.add_view_scaled(weight, scale, view),
            Update::Encoded(view) => view,
        };
        let factor = fold_factor(weight, scale)?;
        if view.numel() != self.sum.len() {
            return Err(KernelError::LayoutMismatch(
                "the encoded update is for another spec".into(),
            ));
        }
        view.fold_scaled(&mut self.sum, factor);
        self.counted(weight);
        Ok(())
    }

    /// One more update of `weight` in the sum.
    fn counted(&mut self, weight: f64) {
        self.total_weight += weight;
        self.updates += 1;
    }

    /// Adds another partial sum over the same spec: `merge` of partial sums equals one sum.
    pub fn merge(&mut self, other: &WeightedSum) -> Result<(), KernelError> {
        if other.spec != self.spec {
            return Err(KernelError::LayoutMismatch(
                "partial sums are over different specs".into(),
            ));
        }
        zip_apply(&mut self.sum, &other.sum, |s, o| *s += o);
        self.total_weight += other.total_weight;
        self.updates += other.updates;
        Ok(())
    }

    /// The weighted mean, Σ wᵢ·uᵢ / Σ wᵢ, as a model of the spec.
    pub fn finish(&self) -> Result<Model, KernelError> {
        if self.updates == 0 || self.total_weight <= 0.0 {
            return Err(KernelError::Empty);
        }
        let mut model = Model::zeros(&self.spec);
        let total = self.total_weight;
        zip_apply(model.data_mut(), &self.sum, |m, s| *m = (s / total) as f32);
        Ok(model)
    }
}

/// Values a collective received from the wire: f32 values, or half-precision bits when the
/// wire is compressed.
#[derive(Debug, Clone, Copy)]
pub enum Received<'a> {
    F32(&'a [f32]),
    /// IEEE binary16 bits.
    F16(&'a [u16]),
}

impl Received<'_> {
    pub fn len(&self) -> usize {
        match self {
            Received::F32(v) => v.len(),
            Received::F16(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Weights are positive finite numbers (example counts, or 1 for a plain mean). Shared by the
/// backends so they refuse the same things.
pub fn check_weight(weight: f64) -> Result<(), KernelError> {
    if weight.is_finite() && weight > 0.0 {
        Ok(())
    } else {
        Err(KernelError::BadWeight(weight))
    }
}

// ---------------------------------------------------------------------------------------------
// Elementwise f32 operations of the collectives: the allreduce ring reduces each chunk it
// receives with these, on the host, as the chunk arrives (the libtorch backend has the same
// operations for tensors on any device).

/// `dst` = `src`, at the same speed however the two sit against each other. A plain copy
/// (`copy_from_slice`, memcpy) of a large piece becomes `rep movsb` on x86-64, which slows down
/// by up to 4× when the destination is not at the source's offset within a cache line: a
/// shared-memory slot starts on a page, the caller's buffer wherever its allocator put it (16
/// bytes past a 64-byte boundary is common; a tensor's slice, anywhere). Such a piece is copied
/// here in cache-line blocks through registers instead (measured on a 64 MiB buffer at +4 bytes:
/// 3.3 → 13 GB/s); pieces at the same offset within a line, and small ones, go to memcpy.
/// `plain` (`HORA_RING_PLAIN_COPY=1`, for benchmarks) always uses memcpy. The allreduce
/// benchmark's alignment table is what shows the blocks were not turned back into memcpy.
pub fn copy(dst: &mut [u8], src: &[u8], plain: bool) {
    assert_eq!(dst.len(), src.len(), "copy: lengths differ");
    const LINE: usize = 64;
    let apart = (dst.as_ptr() as usize ^ src.as_ptr() as usize) % LINE;
    if plain || apart == 0 || dst.len() < 4096 {
        dst.copy_from_slice(src);
        return;
    }
    let mut to = dst.chunks_exact_mut(LINE);
    let mut from = src.chunks_exact(LINE);
    for (to, from) in (&mut to).zip(&mut from) {
        // A block in registers, then stored: the compiler emits vector loads and stores, not a
        // call to memcpy.
        let mut block = [0u8; LINE];
        block.copy_from_slice(from);
        to.copy_from_slice(&block);
    }
    to.into_remainder().copy_from_slice(from.remainder());
}

/// `weight × scale`, once both are checked: a positive finite weight, and a positive finite
/// scale (what a norm bound asks for).
fn fold_factor(weight: f64, scale: f64) -> Result<f64, KernelError> {
    check_weight(weight)?;
    if !(scale.is_finite() && scale > 0.0) {
        return Err(KernelError::BadWeight(scale));
    }
    Ok(weight * scale)
}

/// `dst[i] += src[i]`: one received chunk folded into this rank's partial sum. On the calling
/// thread only: the ring already runs one reducing thread per rank beside its sending thread,
/// and spreading a piece over the pool would make them contend (with the other ranks on the
/// same host too).
pub fn accumulate(dst: &mut [f32], src: &[f32]) {
    assert_eq!(dst.len(), src.len(), "accumulate: lengths differ");
    dst.iter_mut().zip(src).for_each(|(d, s)| *d += s);
}

/// `dst[i] = (dst[i] + src[i]) × factor`: the last piece of a sum and its mean in one pass.
pub fn accumulate_scaled(dst: &mut [f32], src: &[f32], factor: f32) {
    assert_eq!(dst.len(), src.len(), "accumulate_scaled: lengths differ");
    dst.iter_mut()
        .zip(src)
        .for_each(|(d, s)| *d = (*d + s) * factor);
}

/// `dst[i] *= factor`: the sum turned into a mean (on the calling thread, like [`accumulate`]).
pub fn scale(dst: &mut [f32], factor: f32) {
    dst.iter_mut().for_each(|d| *d *= factor);
}

/// Half-precision bits (IEEE binary16, as they travel on the wire) from f32 values.
pub fn encode_f16(src: &[f32], dst: &mut [u16]) {
    use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
    assert_eq!(dst.len(), src.len(), "encode_f16: lengths differ");
    dst.reinterpret_cast_mut::<half::f16>()
        .convert_from_f32_slice(src);
}

/// f32 values from half-precision bits.
pub fn decode_f16(src: &[u16], dst: &mut [f32]) {
    use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
    assert_eq!(dst.len(), src.len(), "decode_f16: lengths differ");
    src.reinterpret_cast::<half::f16>()
        .convert_to_f32_slice(dst);
}

/// Rounds every value to the nearest half-precision value (f16 compression on the wire: the
/// rank that finished a chunk rounds its own copy too, so every rank ends with the same bits).
pub fn round_to_f16(values: &mut [f32]) {
    // Through a block on the stack with the slice conversions (vectorised where the CPU has
    // F16C), not one scalar conversion per value.
    let mut bits = [0u16; 1024];
    for chunk in values.chunks_mut(bits.len()) {
        let bits = &mut bits[..chunk.len()];
        encode_f16(chunk, bits);
        decode_f16(bits, chunk);
    }
}

/// `f(dst[i], src[i])` for every i, chunked over rayon's pool when the buffers are large. The
/// per-chunk loop is a plain zip that LLVM vectorises.
fn zip_apply<D: Send, S: Copy + Send + Sync>(
    dst: &mut [D],
    src: &[S],
    f: impl Fn(&mut D, S) + Sync,
) {
    debug_assert_eq!(dst.len(), src.len());
    let chunk = |d: &mut [D], s: &[S]| d.iter_mut().zip(s).for_each(|(d, s)| f(d, *s));
    if dst.len() < PARALLEL_MIN {
        chunk(dst, src);
    } else {
        dst.par_chunks_mut(CHUNK)
            .zip(src.par_chunks(CHUNK))
            .for_each(|(d, s)| chunk(d, s));
    }
}

/// Like [`zip_apply`] with the source given as raw little-endian elements of `W` bytes each.
fn zip_apply_bytes<const W: usize>(
    dst: &mut [f64],
    src: &[u8],
    f: impl Fn(&mut f64, &[u8]) + Sync,
) {
    debug_assert_eq!(dst.len() * W, src.len());
    let chunk = |d: &mut [f64], s: &[u8]| {
        d.iter_mut()
            .zip(s.chunks_exact(W))
            .for_each(|(d, s)| f(d, s))
    };
    if dst.len() < PARALLEL_MIN {
        chunk(dst, src);
    } else {
        dst.par_chunks_mut(CHUNK)
            .zip(src.par_chunks(CHUNK * W))
            .for_each(|(d, s)| chunk(d, s));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copy_is_exact_at_every_offset_and_length() {
        let src: Vec<u8> = (0..20_000u32).map(|i| (i * 7 + 3) as u8).collect();
        for offset in [0, 1, 4, 16, 17, 63] {
            for len in [0, 5, 4095, 4096, 4096 + 63, 12_345] {
                let from = &src[offset..offset + len];
                let mut to = vec![0u8; len + 3];
                copy(&mut to[3..], from, false);
                assert_eq!(&to[3..], from, "offset {offset}, length {len}");
                assert_eq!(&to[..3], &[0, 0, 0]);
            }
        }
    }
    use crate::model::Limits;
    use crate::testing::{max_relative_error, reference, spec, updates};
    use proptest::prelude::*;

    #[test]
    fn collective_ops_sum_scale_and_round_trip_half_precision() {
        let n = PARALLEL_MIN + 3; // the parallel path and a ragged tail
        let a: Vec<f32> = (0..n).map(|i| i as f32 * 0.5 - 7.0).collect();
        let b: Vec<f32> = (0..n).map(|i| (i % 13) as f32 - 1.25).collect();
        let mut sum = a.clone();
        accumulate(&mut sum, &b);
        scale(&mut sum, 0.5);
        let mut fused = a.clone();
        accumulate_scaled(&mut fused, &b, 0.5);
        assert_eq!(fused, sum);
        for i in [0, 1, 4096, n - 1] {
            assert_eq!(sum[i], (a[i] + b[i]) * 0.5, "element {i}");
        }
        let mut bits = vec![0u16; n];
        encode_f16(&b, &mut bits);
        let mut back = vec![0f32; n];
        decode_f16(&bits, &mut back);
        assert_eq!(back, b, "small integers and quarters are exact in f16");
        let mut rounded = vec![1.0f32 / 3.0, 65504.0, 1e-8];
        round_to_f16(&mut rounded);
        assert_eq!(rounded, [0.333_251_95, 65504.0, 0.0]);
    }

    #[test]
    fn matches_f64_reference_for_1000_updates() {
        // Large enough to take the parallel path, small enough to stay quick.
        let spec = spec(&[PARALLEL_MIN + 1234, 3, 1]);
        let ups = updates(&spec, 1000, 1);
        let mut sum = WeightedSum::new(spec);
        for (w, m) in &ups {
            sum.add(*w, m).unwrap();
        }
        assert_eq!(sum.updates(), 1000);
        let err = max_relative_error(sum.finish().unwrap().data(), &reference(&ups));
        assert!(err < 1e-6, "max relative error {err:e}");
    }

    #[test]
    fn folding_from_bytes_equals_folding_models() {
        let big = spec(&[PARALLEL_MIN + 5, 7]);
        let ups = updates(&big, 5, 11);
        let (mut a, mut b) = (WeightedSum::new(big.clone()), WeightedSum::new(big.clone()));
        for (w, m) in &ups {
            a.add(*w, m).unwrap();
            let bytes = m.to_safetensors();
            b.add_view(*w, &ModelView::parse(&bytes, &big.limits()).unwrap())
                .unwrap();
        }
        assert_eq!(a, b);
        // f16 on the wire is widened on the fly.
        let half: Vec<u8> = [1.5f32, -2.0]
            .iter()
            .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
            .collect();
        let view_bytes = safetensors::serialize(
            [(
                "t0",
                safetensors::tensor::TensorView::new(safetensors::Dtype::F16, vec![2], &half)
                    .unwrap(),
            )],
            None,
        )
        .unwrap();
        let s2 = spec(&[2]);
        let mut c = WeightedSum::new(s2);
        c.add_view(
            2.0,
            &ModelView::parse(&view_bytes, &Limits::default()).unwrap(),
        )
        .unwrap();
        assert_eq!(c.sum(), &[3.0, -4.0]);
        let wrong = Model::from_tensors([("x", vec![2], vec![0.0; 2])])
            .unwrap()
            .to_safetensors();
        assert!(matches!(
            c.add_view(1.0, &ModelView::parse(&wrong, &Limits::default()).unwrap()),
            Err(KernelError::LayoutMismatch(_))
        ));
    }

    #[test]
    fn refusals_leave_the_sum_unchanged() {
        let s = spec(&[4]);
        let mut sum = WeightedSum::new(s.clone());
        assert_eq!(sum.finish(), Err(KernelError::Empty));
        let m = Model::from_flat(&s, vec![1.0, 2.0, 3.0, 4.0]).unwrap();
        sum.add(2.0, &m).unwrap();
        let before = sum.clone();
        for w in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert!(
                matches!(sum.add(w, &m), Err(KernelError::BadWeight(_))),
                "weight {w}"
            );
        }
        assert!(matches!(
            sum.add_flat(1.0, &[1.0; 3]),
            Err(KernelError::LayoutMismatch(_))
        ));
        let other = Model::from_flat(&spec(&[2, 2]), vec![0.0; 4]).unwrap();
        assert!(matches!(
            sum.add(1.0, &other),
            Err(KernelError::LayoutMismatch(_))
        ));
        assert!(matches!(
            sum.merge(&WeightedSum::new(spec(&[2, 2]))),
            Err(KernelError::LayoutMismatch(_))
        ));
        assert_eq!(sum, before);
        assert_eq!(sum.finish().unwrap().data(), &[1.0, 2.0, 3.0, 4.0]);
    }

    #[test]
    fn from_parts_round_trips_and_checks_sizes() {
        let s = spec(&[3]);
        let mut sum = WeightedSum::new(s.clone());
        sum.add_flat(3.0, &[1.0, 2.0, 3.0]).unwrap();
        let back = WeightedSum::from_parts(
            s.clone(),
            sum.sum().to_vec(),
            sum.total_weight(),
            sum.updates(),
        )
        .unwrap();
        assert_eq!(back, sum);
        assert!(WeightedSum::from_parts(s.clone(), vec![0.0; 2], 1.0, 1).is_err());
        assert!(WeightedSum::from_parts(s, vec![0.0; 3], f64::NAN, 1).is_err());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// Splitting the updates into partial sums in any way and merging them gives one sum.
        #[test]
        fn merge_of_partial_sums_equals_one_sum(
            sizes in prop::collection::vec(1usize..300, 1..4),
            seed in any::<u64>(),
            count in 1usize..40,
            cuts in prop::collection::vec(0usize..40, 0..5),
        ) {
            let spec = spec(&sizes);
            let ups = updates(&spec, count, seed);
            let mut whole = WeightedSum::new(spec.clone());
            for (w, m) in &ups { whole.add(*w, m).unwrap(); }

            let mut bounds: Vec<usize> = cuts.into_iter().map(|c| c % (count + 1)).collect();
            bounds.extend([0, count]);
            bounds.sort_unstable();
            let mut merged = WeightedSum::new(spec.clone());
            for part in bounds.windows(2) {
                let mut partial = WeightedSum::new(spec.clone());
                for (w, m) in &ups[part[0]..part[1]] { partial.add(*w, m).unwrap(); }
                merged.merge(&partial).unwrap();
            }
            prop_assert_eq!(merged.updates(), whole.updates());
            prop_assert!((merged.total_weight() - whole.total_weight()).abs() <= 1e-9 * whole.total_weight());
            for (a, b) in merged.sum().iter().zip(whole.sum()) {
                prop_assert!((a - b).abs() <= 1e-12 * b.abs().max(1.0), "{} vs {}", a, b);
            }
            let (a, b) = (merged.finish().unwrap(), whole.finish().unwrap());
            for (x, y) in a.data().iter().zip(b.data()) {
                prop_assert!((x - y).abs() <= 2.0 * f32::EPSILON * y.abs(), "{} vs {}", x, y);
            }
        }
    }
}
