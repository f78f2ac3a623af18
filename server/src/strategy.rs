//! Strategies turn a round's summed deltas into the next global model. Each is a small piece
//! over the shared kernel (Flower's layout: one strategy, one type); FedAvg is the first.

use hora_common::kernel::{KernelError, WeightedSum};
use hora_common::model::Model;
use hora_common::wire::StrategyConfig;

pub trait Strategy: Send + Sync {
    fn name(&self) -> &'static str;

    /// Updates `global` in place from the round's weighted sum of client deltas.
    fn aggregate(&self, global: &mut Model, deltas: &WeightedSum) -> Result<(), KernelError>;
}

/// FedAvg (McMahan et al. 2017): the global model moves by the example-weighted mean of the
/// clients' deltas. Computed in f64 straight into the global model: no mean-sized temporary.
pub struct FedAvg;

impl Strategy for FedAvg {
    fn name(&self) -> &'static str {
        "fed_avg"
    }

    fn aggregate(&self, global: &mut Model, deltas: &WeightedSum) -> Result<(), KernelError> {
        if deltas.updates() == 0 || deltas.total_weight() <= 0.0 {
            return Err(KernelError::Empty);
        }
        if !global.same_layout(deltas.spec()) {
            return Err(KernelError::LayoutMismatch(
                "global model and deltas differ".into(),
            ));
        }
        let total = deltas.total_weight();
        for (g, s) in global.data_mut().iter_mut().zip(deltas.sum()) {
            *g = (f64::from(*g) + s / total) as f32;
        }
        Ok(())
    }
}

pub fn from_config(config: &StrategyConfig) -> Box<dyn Strategy> {
    match config {
        StrategyConfig::FedAvg => Box::new(FedAvg),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fedavg_moves_by_the_weighted_mean_delta() {
        let mut global = Model::from_tensors([("w", vec![2], vec![1.0, 1.0])]).unwrap();
        let mut sum = WeightedSum::new(global.spec());
        sum.add_flat(1.0, &[1.0, 0.0]).unwrap();
        sum.add_flat(3.0, &[-1.0, 4.0]).unwrap();
        FedAvg.aggregate(&mut global, &sum).unwrap();
        assert_eq!(global.data(), &[0.5, 4.0]);
        let empty = WeightedSum::new(global.spec());
        assert!(FedAvg.aggregate(&mut global, &empty).is_err());
    }
}
