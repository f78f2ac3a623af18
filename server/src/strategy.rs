//! Strategies turn a round's summed deltas into the next global model. Each is a small piece
//! over the shared kernel (Flower's layout: one strategy, one type); FedAvg is the first.

use hora_common::kernel::{KernelError, WeightedSum};
use hora_common::model::{DType, ModelDigest, ModelView};
use hora_common::wire::StrategyConfig;

pub trait Strategy: Send + Sync {
    fn name(&self) -> &'static str;

    /// Moves `global`, a stretch of the flat parameters, by the round's deltas: `sum` is the
    /// same stretch of Σ wᵢ·δᵢ and `total_weight` is Σ wᵢ. Called stretch by stretch, so a
    /// strategy never needs the whole model at once.
    fn apply(&self, global: &mut [f32], sum: &[f64], total_weight: f64);
}

/// FedAvg (McMahan et al. 2017): the global model moves by the example-weighted mean of the
/// clients' deltas, computed in f64.
pub struct FedAvg;

impl Strategy for FedAvg {
    fn name(&self) -> &'static str {
        "fed_avg"
    }

    fn apply(&self, global: &mut [f32], sum: &[f64], total_weight: f64) {
        for (g, s) in global.iter_mut().zip(sum) {
            *g = (f64::from(*g) + s / total_weight) as f32;
        }
    }
}

pub fn from_config(config: &StrategyConfig) -> Box<dyn Strategy> {
    match config {
        StrategyConfig::FedAvg => Box::new(FedAvg),
    }
}

/// Applies `strategy` to a global model held as f32 safetensors bytes, in place (the header
/// stays valid), and returns the new model's digest. Memory: a 256 KiB scratch buffer, whatever
/// the model size — publishing costs no second model-sized buffer.
pub fn aggregate_in_place(
    strategy: &dyn Strategy,
    safetensors: &mut [u8],
    deltas: &WeightedSum,
) -> Result<ModelDigest, KernelError> {
    if deltas.updates() == 0 || deltas.total_weight() <= 0.0 {
        return Err(KernelError::Empty);
    }
    let bad = |m: String| KernelError::LayoutMismatch(m);
    let view =
        ModelView::parse(safetensors, &Default::default()).map_err(|e| bad(e.to_string()))?;
    if view.spec() != *deltas.spec() || view.tensors().iter().any(|t| t.dtype != DType::F32) {
        return Err(bad(
            "the global model does not match the round's spec".into()
        ));
    }
    let ranges = view.byte_ranges(safetensors);
    drop(view);
    const STRETCH: usize = 1 << 16;
    let mut scratch = vec![0f32; STRETCH];
    let mut offset = 0;
    for range in ranges {
        for bytes in safetensors[range].chunks_mut(STRETCH * 4) {
            let n = bytes.len() / 4;
            let values = &mut scratch[..n];
            for (v, b) in values.iter_mut().zip(bytes.chunks_exact(4)) {
                *v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
            strategy.apply(
                values,
                &deltas.sum()[offset..offset + n],
                deltas.total_weight(),
            );
            // A model with a NaN or an infinity is never published: nobody could train from it
            // and the task would never recover. (The bytes are a copy; the stored model stays.)
            if let Some(i) = values.iter().position(|v| !v.is_finite()) {
                return Err(KernelError::NotFinite(format!(
                    "parameter {} would be {}",
                    offset + i,
                    values[i]
                )));
            }
            for (v, b) in values.iter().zip(bytes.chunks_exact_mut(4)) {
                b.copy_from_slice(&v.to_le_bytes());
            }
            offset += n;
        }
    }
    ModelView::parse(safetensors, &Default::default())
        .ok()
        .and_then(|v| v.digest())
        .ok_or_else(|| bad("the updated model no longer parses".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fedavg_moves_by_the_weighted_mean_delta_in_place() {
        use hora_common::model::Model;
        let global =
            Model::from_tensors([("w", vec![2], vec![1.0, 1.0]), ("b", vec![1], vec![0.0])])
                .unwrap();
        let mut sum = WeightedSum::new(global.spec());
        // Flat layout is b, w.
        sum.add_flat(1.0, &[2.0, 1.0, 0.0]).unwrap();
        sum.add_flat(3.0, &[-2.0, -1.0, 4.0]).unwrap();
        let mut bytes = global.to_safetensors();
        let digest = aggregate_in_place(&FedAvg, &mut bytes, &sum).unwrap();
        let published = Model::from_safetensors(&bytes, &Default::default()).unwrap();
        assert_eq!(published.tensor("b").unwrap(), &[-1.0]);
        assert_eq!(published.tensor("w").unwrap(), &[0.5, 4.0]);
        assert_eq!(digest, published.digest());
        let empty = WeightedSum::new(global.spec());
        assert!(aggregate_in_place(&FedAvg, &mut bytes, &empty).is_err());
    }

    #[test]
    fn a_result_that_overflows_f32_is_refused() {
        use hora_common::model::Model;
        let global = Model::from_tensors([("w", vec![2], vec![f32::MAX, 0.0])]).unwrap();
        let mut sum = WeightedSum::new(global.spec());
        sum.add_flat(1.0, &[f32::MAX, 1.0]).unwrap();
        let mut bytes = global.to_safetensors();
        assert!(matches!(
            aggregate_in_place(&FedAvg, &mut bytes, &sum),
            Err(KernelError::NotFinite(_))
        ));
    }
}
