//! FedAdagrad (Reddi et al., "Adaptive Federated Optimization", ICLR 2021, Algorithm 2): Adagrad
//! on the server, with the round's pseudo-gradient Δ (the example-weighted mean of the clients'
//! deltas) as its gradient. v sums every round's Δ², so steps shrink like 1/√rounds:
//!
//! ```text
//! m ← β₁·m + (1−β₁)·Δ      v ← v + Δ²      x ← x + η·m/(√v + τ)
//! ```
//!
//! with m₀ = 0 and v₀ = τ² (Algorithm 2 asks for v₋₁ ≥ τ²).
//!
//! Parameters (JSON `{"name":"fed_adagrad"}` takes them all by default):
//! - `eta` (η, server learning rate) = 0.1, Flower's FedAdagrad default. With β₁ = 0.9 the first
//!   round moves each coordinate by about η·(1−β₁) = 0.01; later steps peak near 0.02 and then
//!   decay like η/√rounds.
//! - `beta_1` (β₁) = 0.9, the momentum Algorithm 2 gives all three adaptive methods. (Flower's
//!   FedAdagrad fixes it at 0; set `"beta_1": 0` for that, and lower η tenfold to keep the step.)
//! - `tau` (τ, adaptivity) = 1e-3, as for FedAdam and FedYogi.
//!
//! State: (m, v), two f32 per parameter.

use super::{adaptive_apply, adaptive_initial_state, Strategy};

pub struct FedAdagrad {
    pub eta: f64,
    pub beta_1: f64,
    pub tau: f64,
}

impl Strategy for FedAdagrad {
    fn name(&self) -> &'static str {
        "fed_adagrad"
    }

    fn state_per_parameter(&self) -> usize {
        2
    }

    fn initial_state(&self, state: &mut [f32]) {
        adaptive_initial_state(state, self.tau);
    }

    fn apply(&self, global: &mut [f32], state: &mut [f32], sum: &[f64], total_weight: f64) {
        adaptive_apply(
            global,
            state,
            sum,
            total_weight,
            (self.eta, self.beta_1, self.tau),
            |v, delta_sq| v + delta_sq,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::strategy::tests::{assert_close, rounds, run_whole};

    #[test]
    fn follows_algorithm_2_with_adagrad_over_rounds() {
        let (eta, b1, tau) = (0.2, 0.5, 5e-3);
        let strategy = FedAdagrad {
            eta,
            beta_1: b1,
            tau,
        };
        let (initial, data) = rounds(40, 5, 6);
        let got = run_whole(&strategy, &initial, &data);
        let mut x: Vec<f64> = initial.iter().map(|&v| f64::from(v)).collect();
        let mut m = vec![0.0f64; x.len()];
        let mut v = vec![tau * tau; x.len()];
        for ((sum, weight), published) in data.iter().zip(&got) {
            for i in 0..x.len() {
                let d = sum[i] / weight;
                m[i] = b1 * m[i] + (1.0 - b1) * d;
                v[i] += d * d;
                x[i] += eta * m[i] / (v[i].sqrt() + tau);
            }
            assert_close(published, &x);
        }
    }
}
