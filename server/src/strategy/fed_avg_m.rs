//! FedAvgM: FedAvg with server momentum (Hsu, Qi and Brown, "Measuring the Effects of
//! Non-Identical Data Distribution for Federated Visual Classification", 2019). The round's
//! pseudo-gradient Δ (the example-weighted mean of the clients' deltas) feeds a heavy-ball
//! momentum buffer on the server:
//!
//! ```text
//! m ← β·m + Δ        x ← x + η·m        (m starts at 0)
//! ```
//!
//! Parameters (JSON `{"name":"fed_avg_m","eta":1.0,"momentum":0.9}`):
//! - `eta` (η, server learning rate) = 1.0: the first round is exactly FedAvg's, as in Hsu et al.
//!   and Flower's FedAvgM default.
//! - `momentum` (β) = 0.9, the usual heavy-ball value and one of those Hsu et al. sweep on
//!   skewed (non-IID) client data, like the demo's Synthetic(1,1). Flower's default is 0, which
//!   would make this strategy FedAvg. Along a steady direction the step grows to η/(1−β) = 10 × Δ; on
//!   a quadratic, heavy ball is stable for η·L < 2(1+β), a wider range than FedAvg's η·L < 2, so
//!   momentum does not destabilise a federation FedAvg handles. Lower η (0.1 keeps the steady
//!   step at FedAvg's) if the loss oscillates.
//!
//! State: m, one f32 per parameter.

use super::Strategy;

pub struct FedAvgM {
    pub eta: f64,
    pub momentum: f64,
}

impl Strategy for FedAvgM {
    fn name(&self) -> &'static str {
        "fed_avg_m"
    }

    fn state_per_parameter(&self) -> usize {
        1
    }

    fn apply(&self, global: &mut [f32], state: &mut [f32], sum: &[f64], total_weight: f64) {
        for ((x, s), m) in global.iter_mut().zip(sum).zip(state.iter_mut()) {
            let next = self.momentum * f64::from(*m) + s / total_weight;
            *x = (f64::from(*x) + self.eta * next) as f32;
            *m = next as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::strategy::tests::{assert_close, rounds, run_whole};

    #[test]
    fn follows_heavy_ball_momentum_over_rounds() {
        let strategy = FedAvgM {
            eta: 0.7,
            momentum: 0.8,
        };
        let (initial, data) = rounds(40, 5, 2);
        let got = run_whole(&strategy, &initial, &data);
        let mut x: Vec<f64> = initial.iter().map(|&v| f64::from(v)).collect();
        let mut m = vec![0.0f64; x.len()];
        for ((sum, weight), published) in data.iter().zip(&got) {
            for i in 0..x.len() {
                m[i] = 0.8 * m[i] + sum[i] / weight;
                x[i] += 0.7 * m[i];
            }
            assert_close(published, &x);
        }
    }

    #[test]
    fn without_momentum_and_at_rate_one_it_is_fed_avg() {
        let (initial, data) = rounds(16, 3, 3);
        let plain = run_whole(&super::super::FedAvg, &initial, &data);
        let m = FedAvgM {
            eta: 1.0,
            momentum: 0.0,
        };
        assert_eq!(run_whole(&m, &initial, &data), plain);
    }
}
