//! What every strategy must satisfy (stretch by stretch is the same as all at once; state on
//! disk carries over rounds; bad parameters are refused), and the helpers each strategy's own
//! tests use to check its rule against a computation written out in the test.

use hora_common::model::Model;

use super::*;
use crate::store::{BlobKind, BlobStore, DirBlobs};

/// `rounds` rounds of data over `n` parameters: the initial model and, per round, the sum
/// Σ wᵢ·δᵢ of 2–4 clients' deltas with their total weight Σ wᵢ. Weights and delta scales vary
/// round to round; parameter 0 never moves (Δ = 0). Deterministic (xorshift from `seed`).
pub fn rounds(n: usize, rounds: usize, seed: u64) -> (Vec<f32>, Vec<(Vec<f64>, f64)>) {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut uniform = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 11) as f64 / (1u64 << 53) as f64
    };
    let initial: Vec<f32> = (0..n).map(|_| (uniform() * 2.0 - 1.0) as f32).collect();
    let data = (0..rounds)
        .map(|r| {
            let scale = [0.3, 0.02, 0.1, 0.005, 0.2][r % 5];
            let clients = 2 + (uniform() * 3.0) as usize;
            let mut sum = vec![0.0f64; n];
            let mut total = 0.0;
            for _ in 0..clients {
                let weight = (1.0 + uniform() * 99.0).floor();
                total += weight;
                for s in sum.iter_mut().skip(1) {
                    *s += weight * (uniform() * 2.0 - 1.0) * scale;
                }
            }
            (sum, total)
        })
        .collect();
    (initial, data)
}

/// The global model after each round, the strategy applied to whole vectors.
pub fn run_whole(
    strategy: &dyn Strategy,
    initial: &[f32],
    data: &[(Vec<f64>, f64)],
) -> Vec<Vec<f32>> {
    let mut state = vec![0f32; initial.len() * strategy.state_per_parameter()];
    strategy.initial_state(&mut state);
    let mut x = initial.to_vec();
    data.iter()
        .map(|(sum, weight)| {
            strategy.apply(&mut x, &mut state, sum, *weight);
            x.clone()
        })
        .collect()
}

/// Equal to 1e-6, relative to values of magnitude one or more and absolute below.
pub fn assert_close(got: &[f32], want: &[f64]) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let err = (f64::from(*g) - w).abs();
        assert!(
            err <= 1e-6 * w.abs().max(1.0),
            "parameter {i}: {g} but the rule gives {w} (error {err:e})"
        );
    }
}

fn all_strategies() -> Vec<Box<dyn Strategy>> {
    [
        StrategyConfig::FedAvg,
        StrategyConfig::fed_avg_m(),
        StrategyConfig::fed_adam(),
        StrategyConfig::fed_yogi(),
        StrategyConfig::fed_adagrad(),
        StrategyConfig::FedAdam {
            eta: 0.1,
            beta_1: 0.5,
            beta_2: 0.9,
            tau: 1e-2,
        },
    ]
    .iter()
    .map(from_config)
    .collect()
}

/// A whole state vector handed out stretch by stretch.
struct InMemory<'a> {
    values: &'a mut [f32],
    per: usize,
    at: usize,
}

impl StateStretches for InMemory<'_> {
    fn next(&mut self, parameters: usize) -> Result<&mut [f32], StoreError> {
        let start = self.at;
        self.at += parameters * self.per;
        Ok(&mut self.values[start..self.at])
    }

    fn done(&mut self) -> Result<(), StoreError> {
        Ok(())
    }
}

#[test]
fn applying_stretch_by_stretch_is_applying_to_the_whole_vector() {
    let (initial, data) = rounds(101, 4, 7);
    for strategy in all_strategies() {
        let whole = run_whole(strategy.as_ref(), &initial, &data);
        let per = strategy.state_per_parameter();
        let mut state = vec![0f32; initial.len() * per];
        strategy.initial_state(&mut state[..3 * per]);
        strategy.initial_state(&mut state[3 * per..]);
        let mut x = initial.clone();
        for ((sum, weight), want) in data.iter().zip(&whole) {
            let mut start = 0;
            for len in [1, 13, 0, 40, 7, 40].into_iter().cycle() {
                let end = (start + len).min(x.len());
                strategy.apply(
                    &mut x[start..end],
                    &mut state[start * per..end * per],
                    &sum[start..end],
                    *weight,
                );
                start = end;
                if start == x.len() {
                    break;
                }
            }
            assert_eq!(&x, want, "{}", strategy.name());
        }
    }
}

#[test]
fn aggregate_in_place_walks_tensors_and_stretches_in_the_model_order() {
    // Two stretches and a piece in one tensor, a small one, and a tensor across nothing.
    let spec_model = Model::from_tensors([
        ("a", vec![3, STRETCH], vec![0.0; 3 * STRETCH]),
        ("b", vec![5], vec![0.0; 5]),
        ("c", vec![STRETCH / 2 + 3], vec![0.0; STRETCH / 2 + 3]),
    ])
    .unwrap();
    let spec = spec_model.spec();
    let (initial, data) = rounds(spec.numel(), 3, 8);
    for strategy in all_strategies() {
        let whole = run_whole(strategy.as_ref(), &initial, &data);
        let mut bytes = Model::from_flat(&spec, initial.clone())
            .unwrap()
            .to_safetensors();
        let mut state = vec![0f32; spec.numel() * strategy.state_per_parameter()];
        strategy.initial_state(&mut state);
        for ((sum, weight), want) in data.iter().zip(&whole) {
            let deltas = WeightedSum::from_parts(spec.clone(), sum.clone(), *weight, 3).unwrap();
            let mut stretches = InMemory {
                values: &mut state,
                per: strategy.state_per_parameter(),
                at: 0,
            };
            let digest =
                aggregate_in_place(strategy.as_ref(), &mut bytes, &deltas, &mut stretches).unwrap();
            let published = Model::from_safetensors(&bytes, &Default::default()).unwrap();
            assert_eq!(published.data(), &want[..], "{}", strategy.name());
            assert_eq!(digest, published.digest());
        }
    }
}

#[test]
fn state_carries_over_rounds_through_files_and_each_round_writes_a_new_one() {
    let model = Model::from_tensors([("w", vec![30], vec![0.0; 30]), ("b", vec![3], vec![0.0; 3])])
        .unwrap();
    let spec = model.spec();
    let (initial, data) = rounds(spec.numel(), 4, 9);
    let dir = tempfile::tempdir().unwrap();
    let blobs = DirBlobs::open(dir.path()).unwrap();
    let states = |blobs: &DirBlobs| -> Vec<String> {
        let listed = blobs.list(BlobKind::StrategyState).unwrap();
        listed.into_iter().map(|(name, _)| name).collect()
    };
    for strategy in all_strategies() {
        let whole = run_whole(strategy.as_ref(), &initial, &data);
        let mut bytes = Model::from_flat(&spec, initial.clone())
            .unwrap()
            .to_safetensors();
        let mut previous: Option<String> = None;
        for ((sum, weight), want) in data.iter().zip(&whole) {
            let deltas = WeightedSum::from_parts(spec.clone(), sum.clone(), *weight, 2).unwrap();
            let (_, next) = aggregate_round(
                strategy.as_ref(),
                &mut bytes,
                &deltas,
                &blobs,
                previous.as_deref(),
            )
            .unwrap();
            let published = Model::from_safetensors(&bytes, &Default::default()).unwrap();
            assert_eq!(published.data(), &want[..], "{}", strategy.name());
            assert_eq!(next.is_some(), strategy.state_per_parameter() > 0);
            if let Some(name) = &next {
                state::verify(&blobs, name, spec.numel(), strategy.state_per_parameter()).unwrap();
                assert_ne!(Some(name), previous.as_ref(), "the state moved");
                // The previous file is the caller's to remove, once the new one is published.
                if let Some(old) = &previous {
                    assert!(blobs.remove(BlobKind::StrategyState, old).unwrap());
                }
            }
            previous = next;
        }
        if let Some(last) = previous {
            blobs.remove(BlobKind::StrategyState, &last).unwrap();
        }
        // Nothing temporary is left behind.
        assert_eq!(states(&blobs), Vec::<String>::new());
    }
}

#[test]
fn a_failed_round_leaves_the_previous_state_and_no_new_file() {
    let model = Model::from_tensors([("w", vec![4], vec![0.5; 4])]).unwrap();
    let spec = model.spec();
    let dir = tempfile::tempdir().unwrap();
    let blobs = DirBlobs::open(dir.path()).unwrap();
    let adam = from_config(&StrategyConfig::fed_adam());
    let mut bytes = model.to_safetensors();
    let deltas = WeightedSum::from_parts(spec.clone(), vec![0.1, -0.2, 0.0, 0.3], 1.0, 1).unwrap();
    let (_, first) = aggregate_round(adam.as_ref(), &mut bytes, &deltas, &blobs, None).unwrap();
    let first = first.unwrap();
    // Δ² overflows f32 in v: refused, not published, and nothing new on disk.
    let huge = WeightedSum::from_parts(spec, vec![1e30, 0.0, 0.0, 0.0], 1.0, 1).unwrap();
    let mut copy = bytes.clone();
    let err = aggregate_round(adam.as_ref(), &mut copy, &huge, &blobs, Some(&first)).unwrap_err();
    assert!(
        matches!(&err, AggregateError::Kernel(KernelError::NotFinite(m)) if m.contains("state")),
        "{err}"
    );
    let files: Vec<_> = blobs
        .list(BlobKind::StrategyState)
        .unwrap()
        .into_iter()
        .map(|(name, _)| name)
        .collect();
    assert_eq!(files, vec![first.clone()]);
    // A missing previous state is an error, not a silent reset.
    blobs.remove(BlobKind::StrategyState, &first).unwrap();
    assert!(matches!(
        aggregate_round(adam.as_ref(), &mut bytes, &deltas, &blobs, Some(&first)),
        Err(AggregateError::State(_))
    ));
}

#[test]
fn fedavg_moves_by_the_weighted_mean_delta_in_place() {
    let global =
        Model::from_tensors([("w", vec![2], vec![1.0, 1.0]), ("b", vec![1], vec![0.0])]).unwrap();
    let mut sum = WeightedSum::new(global.spec());
    // Flat layout is b, w.
    sum.add_flat(1.0, &[2.0, 1.0, 0.0]).unwrap();
    sum.add_flat(3.0, &[-2.0, -1.0, 4.0]).unwrap();
    let mut bytes = global.to_safetensors();
    let digest = aggregate_in_place(&FedAvg, &mut bytes, &sum, &mut NoState).unwrap();
    let published = Model::from_safetensors(&bytes, &Default::default()).unwrap();
    assert_eq!(published.tensor("b").unwrap(), &[-1.0]);
    assert_eq!(published.tensor("w").unwrap(), &[0.5, 4.0]);
    assert_eq!(digest, published.digest());
    let empty = WeightedSum::new(global.spec());
    assert!(aggregate_in_place(&FedAvg, &mut bytes, &empty, &mut NoState).is_err());
}

#[test]
fn a_result_that_overflows_f32_is_refused() {
    let global = Model::from_tensors([("w", vec![2], vec![f32::MAX, 0.0])]).unwrap();
    let mut sum = WeightedSum::new(global.spec());
    sum.add_flat(1.0, &[f32::MAX, 1.0]).unwrap();
    let mut bytes = global.to_safetensors();
    assert!(matches!(
        aggregate_in_place(&FedAvg, &mut bytes, &sum, &mut NoState),
        Err(AggregateError::Kernel(KernelError::NotFinite(_)))
    ));
}

#[test]
fn bad_parameters_are_refused_with_the_field_named() {
    for good in [
        StrategyConfig::FedAvg,
        StrategyConfig::fed_avg_m(),
        StrategyConfig::fed_adam(),
        StrategyConfig::fed_yogi(),
        StrategyConfig::fed_adagrad(),
        StrategyConfig::FedAvgM {
            eta: 0.5,
            momentum: 0.0,
        },
    ] {
        validate(&good).unwrap();
    }
    let adam = |eta, beta_1, beta_2, tau| StrategyConfig::FedAdam {
        eta,
        beta_1,
        beta_2,
        tau,
    };
    for (bad, field) in [
        (adam(0.0, 0.9, 0.99, 1e-3), "eta"),
        (adam(-0.1, 0.9, 0.99, 1e-3), "eta"),
        (adam(f64::INFINITY, 0.9, 0.99, 1e-3), "eta"),
        (adam(0.1, 1.0, 0.99, 1e-3), "beta_1"),
        (adam(0.1, -0.1, 0.99, 1e-3), "beta_1"),
        (adam(0.1, 0.9, 1.5, 1e-3), "beta_2"),
        (adam(0.1, 0.9, f64::NAN, 1e-3), "beta_2"),
        (adam(0.1, 0.9, 0.99, 0.0), "tau"),
        (
            StrategyConfig::FedYogi {
                eta: 0.1,
                beta_1: 0.9,
                beta_2: 0.99,
                tau: -1.0,
            },
            "tau",
        ),
        (
            StrategyConfig::FedAvgM {
                eta: 1.0,
                momentum: 1.0,
            },
            "momentum",
        ),
        (
            StrategyConfig::FedAvgM {
                eta: 0.0,
                momentum: 0.5,
            },
            "eta",
        ),
        (
            StrategyConfig::FedAdagrad {
                eta: 0.1,
                beta_1: 0.9,
                tau: f64::NAN,
            },
            "tau",
        ),
    ] {
        let message = validate(&bad).unwrap_err();
        assert!(
            message.starts_with(&format!("strategy.{field} must be")),
            "{bad:?}: {message}"
        );
    }
}

#[test]
fn metrics_are_the_example_weighted_mean_and_selection_is_first_come() {
    let c = |examples, loss: Option<f64>| Contribution {
        contributors: 1,
        client: "c".into(),
        examples,
        metrics: Metrics {
            loss,
            accuracy: Some(0.5),
        },
        unclipped: None,
        base: None,
    };
    let adam = from_config(&StrategyConfig::fed_adam());
    let m = adam.aggregate_metrics(&[c(1, Some(1.0)), c(3, Some(2.0)), c(4, None)]);
    assert_eq!(m.loss, Some(7.0 / 4.0));
    assert_eq!(m.accuracy, Some(0.5));
    assert_eq!(adam.aggregate_metrics(&[]), Metrics::default());
    assert!(adam.admits("x", 4, 5));
    assert!(!adam.admits("x", 5, 5));
}
