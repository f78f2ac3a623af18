//! Strategies turn a round's summed deltas into the next global model — and, for the stateful
//! ones, into their next state. One strategy, one file (Flower's layout), all over one shared
//! walk of the model:
//!
//! - Every strategy starts from the round's pseudo-gradient Δ = Σ wᵢ·δᵢ / Σ wᵢ, the
//!   example-weighted mean of the clients' deltas (δ = local − global), computed in f64 from the
//!   running sum the coordinator folded uploads into. FedAvg adds it; FedAvgM adds it through
//!   server momentum; FedAdam, FedYogi and FedAdagrad (Reddi et al., "Adaptive Federated
//!   Optimization", ICLR 2021, Algorithm 2) step by η·m/(√v + τ).
//! - [`aggregate_in_place`] walks the global model's f32 bytes in stretches of 64 Ki parameters
//!   (256 KiB of scratch) and hands each stretch, with the same stretch of the sum and of the
//!   strategy's state, to [`Strategy::apply`]. Every rule is per coordinate, so a strategy never
//!   needs the whole model, and publishing allocates no second model-sized buffer.
//! - State (momentum m, second moment v) is [`Strategy::state_per_parameter`] f32 values per
//!   parameter, parameter-major, in a file of its own with a SHA-256 trailer ([`state`]). A round streams the
//!   previous file into the next one stretch by stretch, so the state is never in memory whole.
//!   [`aggregate_round`] returns the new file's name; the coordinator records it in the same
//!   sled transaction that publishes the new model (the task record), so the model and the state
//!   that goes with it become durable together: a server killed at any moment resumes with the
//!   state of its last published round, never a reset or half-updated optimizer.
//! - The state is f32 because the model is: it keeps the model's precision and costs half of
//!   f64 to store and stream. The arithmetic of each update is f64.
//! - Besides the update rule, a strategy decides how the round's client metrics are combined
//!   ([`Strategy::aggregate_metrics`]; the example-weighted mean by default) and whether a client
//!   asking to join the open round is selected ([`Strategy::admits`]; first come, first served up
//!   to the round's capacity by default).

mod fed_adagrad;
mod fed_adam;
mod fed_avg;
mod fed_avg_m;
mod fed_yogi;
pub mod state;

pub use fed_adagrad::FedAdagrad;
pub use fed_adam::FedAdam;
pub use fed_avg::FedAvg;
pub use fed_avg_m::FedAvgM;
pub use fed_yogi::FedYogi;

use hora_common::kernel::{KernelError, WeightedSum};
use hora_common::model::{DType, ModelDigest, ModelView};
use hora_common::wire::{Metrics, StrategyConfig};

use crate::store::{Contribution, StoreError};

pub trait Strategy: Send + Sync {
    fn name(&self) -> &'static str;

    /// How many f32 values of state the strategy keeps per parameter across rounds (0:
    /// stateless).
    fn state_per_parameter(&self) -> usize {
        0
    }

    /// Fills `state` (a stretch's worth, parameter-major) with the state before the first round.
    fn initial_state(&self, state: &mut [f32]) {
        state.fill(0.0);
    }

    /// Moves `global`, a stretch of the flat parameters, by the round's deltas: `sum` is the
    /// same stretch of Σ wᵢ·δᵢ and `total_weight` is Σ wᵢ. `state` is the stretch's state
    /// (`state_per_parameter()` values per parameter, parameter-major), read and updated in
    /// place. Called stretch by stretch, in order.
    fn apply(&self, global: &mut [f32], state: &mut [f32], sum: &[f64], total_weight: f64);

    /// The round's metrics from its contributions.
    fn aggregate_metrics(&self, contributions: &[Contribution]) -> Metrics {
        weighted_mean_metrics(contributions)
    }

    /// Whether `client`, asking to join the open round, is selected, when `selected` clients of
    /// the round's `capacity` (target × (1 + over-selection)) are already.
    fn admits(&self, _client: &str, selected: usize, capacity: usize) -> bool {
        selected < capacity
    }
}

pub fn from_config(config: &StrategyConfig) -> Box<dyn Strategy> {
    match *config {
        StrategyConfig::FedAvg => Box::new(FedAvg),
        StrategyConfig::FedAvgM { eta, momentum } => Box::new(FedAvgM { eta, momentum }),
        StrategyConfig::FedAdam {
            eta,
            beta_1,
            beta_2,
            tau,
        } => Box::new(FedAdam {
            eta,
            beta_1,
            beta_2,
            tau,
        }),
        StrategyConfig::FedYogi {
            eta,
            beta_1,
            beta_2,
            tau,
        } => Box::new(FedYogi {
            eta,
            beta_1,
            beta_2,
            tau,
        }),
        StrategyConfig::FedAdagrad { eta, beta_1, tau } => {
            Box::new(FedAdagrad { eta, beta_1, tau })
        }
    }
}

/// Checks a task's strategy parameters (at task creation); the error is for the operator.
pub fn validate(config: &StrategyConfig) -> Result<(), String> {
    // Bounds that keep the update rule finite: a step larger than 1000 × the mean delta, or a
    // τ below 1e-9 once v has underflowed in f32, would make every round non-finite, every
    // attempt abandoned.
    let within = |name: &str, v: f64, low: f64, high: f64| {
        if v.is_finite() && v >= low && v <= high && v > 0.0 {
            Ok(())
        } else {
            Err(format!(
                "strategy.{name} must be a positive number between {low:e} and {high} (got {v})"
            ))
        }
    };
    let positive = |name: &str, v: f64| within(name, v, f64::MIN_POSITIVE, 1000.0);
    let tau = |v: f64| within("tau", v, 1e-9, 1000.0);
    let decay = |name: &str, v: f64| {
        if (0.0..1.0).contains(&v) {
            Ok(())
        } else {
            Err(format!(
                "strategy.{name} must be at least 0 and less than 1 (got {v})"
            ))
        }
    };
    match *config {
        StrategyConfig::FedAvg => Ok(()),
        StrategyConfig::FedAvgM { eta, momentum } => {
            positive("eta", eta)?;
            decay("momentum", momentum)
        }
        StrategyConfig::FedAdam {
            eta,
            beta_1,
            beta_2,
            tau: t,
        }
        | StrategyConfig::FedYogi {
            eta,
            beta_1,
            beta_2,
            tau: t,
        } => {
            positive("eta", eta)?;
            decay("beta_1", beta_1)?;
            decay("beta_2", beta_2)?;
            tau(t)
        }
        StrategyConfig::FedAdagrad {
            eta,
            beta_1,
            tau: t,
        } => {
            positive("eta", eta)?;
            decay("beta_1", beta_1)?;
            tau(t)
        }
    }
}

/// The example-weighted mean of each metric over the contributions that report it.
pub fn weighted_mean_metrics(contributions: &[Contribution]) -> Metrics {
    let mean = |get: fn(&Metrics) -> Option<f64>| {
        let (mut num, mut den) = (0.0, 0.0);
        for c in contributions {
            if let Some(v) = get(&c.metrics) {
                num += v * c.examples as f64;
                den += c.examples as f64;
            }
        }
        (den > 0.0).then(|| num / den)
    };
    Metrics {
        loss: mean(|m| m.loss),
        accuracy: mean(|m| m.accuracy),
    }
}

/// The step FedAdam, FedYogi and FedAdagrad share (Reddi et al. 2021, Algorithm 2); they differ
/// only in `second_moment(v, Δ²)`. State per parameter: (m, v).
fn adaptive_apply(
    global: &mut [f32],
    state: &mut [f32],
    sum: &[f64],
    total_weight: f64,
    (eta, beta_1, tau): (f64, f64, f64),
    second_moment: impl Fn(f64, f64) -> f64,
) {
    for ((x, s), mv) in global.iter_mut().zip(sum).zip(state.chunks_exact_mut(2)) {
        let delta = s / total_weight;
        let m = beta_1 * f64::from(mv[0]) + (1.0 - beta_1) * delta;
        let v = second_moment(f64::from(mv[1]), delta * delta);
        *x = (f64::from(*x) + eta * m / (v.sqrt() + tau)) as f32;
        mv[0] = m as f32;
        mv[1] = v as f32;
    }
}

/// The adaptive strategies' state before the first round: m = 0 and v = τ² (Algorithm 2 asks
/// for v₋₁ ≥ τ²; the least such value).
fn adaptive_initial_state(state: &mut [f32], tau: f64) {
    for mv in state.chunks_exact_mut(2) {
        mv[0] = 0.0;
        mv[1] = (tau * tau) as f32;
    }
}

/// Where each stretch's state comes from and goes back to, in the model's order.
pub trait StateStretches {
    /// The state of the next `parameters` parameters, to be updated in place.
    fn next(&mut self, parameters: usize) -> Result<&mut [f32], StoreError>;
    /// The stretch last handed out is updated.
    fn done(&mut self) -> Result<(), StoreError>;
}

/// The state of a stateless strategy: nothing.
pub struct NoState;

impl StateStretches for NoState {
    fn next(&mut self, _: usize) -> Result<&mut [f32], StoreError> {
        Ok(&mut [])
    }

    fn done(&mut self) -> Result<(), StoreError> {
        Ok(())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum AggregateError {
    #[error(transparent)]
    Kernel(#[from] KernelError),
    #[error("strategy state: {0}")]
    State(#[from] StoreError),
}

/// Parameters per stretch: 256 KiB of f32 scratch.
const STRETCH: usize = 1 << 16;

/// Applies `strategy` to a global model held as f32 safetensors bytes, in place (the header
/// stays valid), with its state from `state`, and returns the new model's digest. Memory: a
/// 256 KiB scratch buffer (and what `state` holds of one stretch), whatever the model size.
pub fn aggregate_in_place(
    strategy: &dyn Strategy,
    safetensors: &mut [u8],
    deltas: &WeightedSum,
    state: &mut dyn StateStretches,
) -> Result<ModelDigest, AggregateError> {
    if deltas.updates() == 0 || deltas.total_weight() <= 0.0 {
        return Err(KernelError::Empty.into());
    }
    let bad = |m: String| KernelError::LayoutMismatch(m);
    let view =
        ModelView::parse(safetensors, &Default::default()).map_err(|e| bad(e.to_string()))?;
    if view.spec() != *deltas.spec() || view.tensors().iter().any(|t| t.dtype != DType::F32) {
        return Err(bad("the global model does not match the round's spec".into()).into());
    }
    let ranges = view.byte_ranges(safetensors);
    drop(view);
    let per = strategy.state_per_parameter();
    let mut scratch = vec![0f32; STRETCH];
    let mut offset = 0;
    for range in ranges {
        for bytes in safetensors[range].chunks_mut(STRETCH * 4) {
            let n = bytes.len() / 4;
            let values = &mut scratch[..n];
            for (v, b) in values.iter_mut().zip(bytes.chunks_exact(4)) {
                *v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
            let stretch_state = state.next(n)?;
            strategy.apply(
                values,
                stretch_state,
                &deltas.sum()[offset..offset + n],
                deltas.total_weight(),
            );
            // A model with a NaN or an infinity is never published: nobody could train from it
            // and the task would never recover. Nor is a state that overflowed f32: it would
            // freeze or poison its coordinates for every later round. (The bytes are a copy;
            // the stored model and state stay.)
            if let Some(i) = values.iter().position(|v| !v.is_finite()) {
                return Err(KernelError::NotFinite(format!(
                    "parameter {} would be {}",
                    offset + i,
                    values[i]
                ))
                .into());
            }
            if let Some(i) = stretch_state.iter().position(|v| !v.is_finite()) {
                return Err(KernelError::NotFinite(format!(
                    "the {} state of parameter {} would be {}",
                    strategy.name(),
                    offset + i / per,
                    stretch_state[i]
                ))
                .into());
            }
            state.done()?;
            for (v, b) in values.iter().zip(bytes.chunks_exact_mut(4)) {
                b.copy_from_slice(&v.to_le_bytes());
            }
            offset += n;
        }
    }
    ModelView::parse(safetensors, &Default::default())
        .ok()
        .and_then(|v| v.digest())
        .ok_or_else(|| bad("the updated model no longer parses".into()).into())
}

/// A round's aggregation with the strategy's state in the blob store: the previous state is
/// read from blob `previous` (the strategy's initial state when None) and the new one written
/// to a new durable blob. Returns the new model's digest and the new state's name (None for a
/// stateless strategy). Nothing is published here: the caller records both in one transaction,
/// then removes the previous state.
pub fn aggregate_round(
    strategy: &dyn Strategy,
    safetensors: &mut [u8],
    deltas: &WeightedSum,
    blobs: &dyn crate::store::BlobStore,
    previous: Option<&str>,
) -> Result<(ModelDigest, Option<String>), AggregateError> {
    if strategy.state_per_parameter() == 0 {
        let digest = aggregate_in_place(strategy, safetensors, deltas, &mut NoState)?;
        return Ok((digest, None));
    }
    let parameters = deltas.spec().numel();
    let mut files = state::FileState::open(strategy, blobs, previous, parameters)?;
    let digest = aggregate_in_place(strategy, safetensors, deltas, &mut files)?;
    Ok((digest, Some(files.commit()?)))
}

#[cfg(test)]
mod tests;
