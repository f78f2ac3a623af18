//! FedAvg (McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized
//! Data", AISTATS 2017): the global model moves by the round's pseudo-gradient Δ, the
//! example-weighted mean of the clients' deltas — x ← x + Δ.
//!
//! No parameters and no state: the server step is 1, so the model after a round is the
//! example-weighted mean of the clients' local models, as in the paper. The default strategy.

use super::Strategy;

pub struct FedAvg;

impl Strategy for FedAvg {
    fn name(&self) -> &'static str {
        "fed_avg"
    }

    fn apply(&self, global: &mut [f32], _state: &mut [f32], sum: &[f64], total_weight: f64) {
        for (x, s) in global.iter_mut().zip(sum) {
            *x = (f64::from(*x) + s / total_weight) as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::strategy::tests::{assert_close, rounds, run_whole};

    #[test]
    fn moves_by_the_weighted_mean_delta_every_round() {
        let (initial, data) = rounds(40, 4, 1);
        let got = run_whole(&FedAvg, &initial, &data);
        let mut x: Vec<f64> = initial.iter().map(|&v| f64::from(v)).collect();
        for ((sum, weight), published) in data.iter().zip(&got) {
            for (x, s) in x.iter_mut().zip(sum) {
                *x += s / weight;
            }
            assert_close(published, &x);
        }
    }
}
