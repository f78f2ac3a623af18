//! Deterministic generators for tests of the kernel and its backends (feature `test-util`;
//! always on for this crate's own tests). Not part of the stable API.

use rand::{rngs::StdRng, Rng, SeedableRng};

use crate::model::{DType, Model, ModelSpec, TensorSpec};

/// A spec of 1-D f32 tensors `t0`, `t1`, … with the given lengths.
pub fn spec(sizes: &[usize]) -> ModelSpec {
    ModelSpec::new(
        sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| TensorSpec {
                name: format!("t{i}"),
                shape: vec![n],
                dtype: DType::F32,
            })
            .collect(),
    )
    .unwrap()
}

/// `count` updates whose elements sit around a per-element base value away from zero, with
/// weights spread over three orders of magnitude (like example counts).
pub fn updates(spec: &ModelSpec, count: usize, seed: u64) -> Vec<(f64, Model)> {
    let mut rng = StdRng::seed_from_u64(seed);
    let base: Vec<f32> = (0..spec.numel())
        .map(|_| rng.random_range(0.5f32..2.0) * if rng.random_bool(0.5) { 1.0 } else { -1.0 })
        .collect();
    (0..count)
        .map(|_| {
            let data = base
                .iter()
                .map(|b| b + rng.random_range(-1.0f32..1.0))
                .collect();
            (
                rng.random_range(1.0..1000.0f64).round(),
                Model::from_flat(spec, data).unwrap(),
            )
        })
        .collect()
}

/// The weighted mean computed in f64 from scratch.
pub fn reference(updates: &[(f64, Model)]) -> Vec<f64> {
    let n = updates[0].1.numel();
    let total: f64 = updates.iter().map(|(w, _)| w).sum();
    let mut acc = vec![0.0f64; n];
    for (w, m) in updates {
        for (a, v) in acc.iter_mut().zip(m.data()) {
            *a += w * f64::from(*v);
        }
    }
    acc.iter().map(|a| a / total).collect()
}

pub fn max_relative_error(got: &[f32], want: &[f64]) -> f64 {
    got.iter()
        .zip(want)
        .map(|(g, w)| (f64::from(*g) - w).abs() / w.abs())
        .fold(0.0, f64::max)
}
