//! FedAdam (Reddi et al., "Adaptive Federated Optimization", ICLR 2021, Algorithm 2): Adam on
//! the server, with the round's pseudo-gradient Δ (the example-weighted mean of the clients'
//! deltas) as its gradient:
//!
//! ```text
//! m ← β₁·m + (1−β₁)·Δ      v ← β₂·v + (1−β₂)·Δ²      x ← x + η·m/(√v + τ)
//! ```
//!
//! with m₀ = 0 and v₀ = τ² (Algorithm 2 asks for v₋₁ ≥ τ²), and no bias correction, as in the
//! paper.
//!
//! Parameters (JSON `{"name":"fed_adam"}` takes them all by default):
//! - `eta` (η, server learning rate) = 0.1, Flower's default. Early on, each coordinate moves by
//!   about η per round whatever the size of its Δ (m/√v ≈ sign Δ when |Δ| ≫ τ), so η is a step
//!   in weight units; the paper tunes η per task. On the demo (Synthetic(1,1), logistic
//!   regression, 20 rounds) 0.1 reaches 0.86 test accuracy where 0.01 stays at 0.37, and 0.3
//!   reaches 0.89.
//! - `beta_1` (β₁) = 0.9 and `beta_2` (β₂) = 0.99: the values of the paper's experiments, also
//!   Flower's.
//! - `tau` (τ, adaptivity) = 1e-3, Flower's FedYogi default (the paper tunes τ per task over
//!   10⁻¹⁰…10⁻¹). Coordinates whose Δ is well below τ take steps smaller than η, so parameters
//!   the clients barely move stay put. (Flower's FedAdam uses 1e-9, which gives even noise-sized
//!   Δ full η steps.)
//!
//! State: (m, v), two f32 per parameter.

use super::{adaptive_apply, adaptive_initial_state, Strategy};

pub struct FedAdam {
    pub eta: f64,
    pub beta_1: f64,
    pub beta_2: f64,
    pub tau: f64,
}

impl Strategy for FedAdam {
    fn name(&self) -> &'static str {
        "fed_adam"
    }

    fn state_per_parameter(&self) -> usize {
        2
    }

    fn initial_state(&self, state: &mut [f32]) {
        adaptive_initial_state(state, self.tau);
    }

    fn apply(&self, global: &mut [f32], state: &mut [f32], sum: &[f64], total_weight: f64) {
        let beta_2 = self.beta_2;
        adaptive_apply(
            global,
            state,
            sum,
            total_weight,
            (self.eta, self.beta_1, self.tau),
            |v, delta_sq| beta_2 * v + (1.0 - beta_2) * delta_sq,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::strategy::tests::{assert_close, rounds, run_whole};

    #[test]
    fn follows_algorithm_2_with_adam_over_rounds() {
        let (eta, b1, b2, tau) = (0.05, 0.8, 0.95, 1e-2);
        let strategy = FedAdam {
            eta,
            beta_1: b1,
            beta_2: b2,
            tau,
        };
        let (initial, data) = rounds(40, 5, 4);
        let got = run_whole(&strategy, &initial, &data);
        let mut x: Vec<f64> = initial.iter().map(|&v| f64::from(v)).collect();
        let mut m = vec![0.0f64; x.len()];
        let mut v = vec![tau * tau; x.len()];
        for ((sum, weight), published) in data.iter().zip(&got) {
            for i in 0..x.len() {
                let d = sum[i] / weight;
                m[i] = b1 * m[i] + (1.0 - b1) * d;
                v[i] = b2 * v[i] + (1.0 - b2) * d * d;
                x[i] += eta * m[i] / (v[i].sqrt() + tau);
            }
            assert_close(published, &x);
        }
    }
}
