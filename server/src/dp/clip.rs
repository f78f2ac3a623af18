//! Per-update L2 clipping: what bounds one client's influence on a round's sum.
//!
//! Differential privacy needs the *sensitivity* of the sum — how far one client can move it —
//! to be bounded, so each update Δ is scaled to `Δ·min(1, C/‖Δ‖₂)` and folded with weight 1:
//! then adding or removing a client moves the sum by at most `C` in L2, whatever its data, and
//! Gaussian noise of standard deviation `z·C` per coordinate hides it. Example counts must not
//! weight the sum (a client claiming a million examples would multiply its sensitivity), so
//! under DP every update counts once — the uniform weighting of DP-FedAvg (McMahan, Ramage,
//! Talwar, Zhang 2018, "Learning Differentially Private Recurrent Language Models").
//!
//! **Fixed clipping** uses one `C` for every round. Too small a `C` biases the update; too large
//! a `C` drowns it in noise (the noise scales with `C`, the signal does not).
//!
//! **Adaptive clipping** (Andrew, Thakkar, McMahan, Ramaswamy 2021, "Differentially Private
//! Learning with Adaptive Clipping") moves `C` towards the γ-quantile of the updates' norms. In
//! round t each update contributes the bit `bᵢ = [‖Δᵢ‖ ≤ Cₜ]`; the server releases the noised
//! fraction `b̃ = (Σᵢ(bᵢ − ½) + N(0, σ_b²))/m + ½` (m: the expected number of updates; the
//! centred bits have sensitivity ½) and sets `Cₜ₊₁ = Cₜ·exp(−η_C·(b̃ − γ))`: too many unclipped
//! updates shrink `C`, too few grow it. Releasing `b̃` costs privacy too. Two Gaussian queries
//! with noise multipliers `z_Δ` (the sum, sensitivity C) and `2σ_b` (the count, sensitivity ½)
//! together are one Gaussian query with `z⁻² = z_Δ⁻² + (2σ_b)⁻²` (the paper's Section 3.1), so
//! to account the round with the operator's `z`, the sum gets the larger multiplier
//! `z_Δ = (z⁻² − (2σ_b)⁻²)^{−1/2}`, which needs `2σ_b > z`. The paper suggests `σ_b = m/20`.

/// The factor that brings an update of L2 norm `norm` to at most `clip`.
pub fn clip_factor(norm: f64, clip: f64) -> f64 {
    if norm <= clip {
        1.0
    } else {
        clip / norm
    }
}

/// The noise multiplier left for the sum when the count query (noise `count_noise`) takes its
/// share of the total multiplier `z`: `(z⁻² − (2σ_b)⁻²)^{−1/2}`. None when `2σ_b ≤ z`.
pub fn sum_noise_multiplier(z: f64, count_noise: f64) -> Option<f64> {
    let rest = z.powi(-2) - (2.0 * count_noise).powi(-2);
    (rest > 0.0).then(|| rest.powf(-0.5))
}

/// The paper's default count noise for `expected` updates per round.
pub fn default_count_noise(expected: u32) -> f64 {
    f64::from(expected) / 20.0
}

/// The bounds an adaptive clip norm is kept within, so that a long run of lopsided rounds can
/// never drive it to 0 or to infinity.
pub const CLIP_RANGE: (f64, f64) = (1e-12, 1e12);

/// Adaptive clipping's settings (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdaptiveClip {
    /// γ.
    pub target_quantile: f64,
    /// η_C.
    pub learning_rate: f64,
}

impl AdaptiveClip {
    /// `b̃ = (unclipped − updates/2 + count_noise)/expected + ½`, within [0, 1]; `count_noise`
    /// is one N(0, σ_b²) draw.
    pub fn noised_fraction(
        unclipped: usize,
        updates: usize,
        expected: f64,
        count_noise: f64,
    ) -> f64 {
        let centred = unclipped as f64 - updates as f64 / 2.0 + count_noise;
        (centred / expected + 0.5).clamp(0.0, 1.0)
    }

    /// `C·exp(−η_C·(b̃ − γ))`, within [`CLIP_RANGE`].
    pub fn next_clip(&self, clip: f64, noised_fraction: f64) -> f64 {
        let next = clip * (-self.learning_rate * (noised_fraction - self.target_quantile)).exp();
        next.clamp(CLIP_RANGE.0, CLIP_RANGE.1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clipping_bounds_the_norm_and_leaves_small_updates_alone() {
        assert_eq!(clip_factor(0.5, 1.0), 1.0);
        assert_eq!(clip_factor(1.0, 1.0), 1.0);
        assert_eq!(clip_factor(4.0, 1.0), 0.25);
        assert!((clip_factor(3.0, 0.7) * 3.0 - 0.7).abs() < 1e-15);
    }

    #[test]
    fn the_sum_keeps_what_the_count_leaves_of_the_total_noise() {
        // z = 1, σ_b = 5 (m = 100): z_Δ = (1 − 1/100)^{-1/2} ≈ 1.00504.
        let z_sum = sum_noise_multiplier(1.0, 5.0).unwrap();
        assert!((z_sum - 1.0 / (0.99f64).sqrt()).abs() < 1e-12);
        // Recombined, the two queries have exactly the total multiplier.
        let z = (z_sum.powi(-2) + (2.0 * 5.0f64).powi(-2)).powf(-0.5);
        assert!((z - 1.0).abs() < 1e-12);
        // The count cannot take all of it.
        assert_eq!(sum_noise_multiplier(1.0, 0.5), None);
        assert_eq!(sum_noise_multiplier(2.0, 0.9), None);
        assert_eq!(default_count_noise(100), 5.0);
    }

    /// The geometric rule of Andrew et al. 2021: with γ = 0.5 and η = 0.2, a round where every
    /// update was unclipped (b̃ = 1) shrinks C by e^{−0.1}, one where none was (b̃ = 0) grows it
    /// by e^{0.1}, and b̃ = γ leaves it where it is.
    #[test]
    fn adaptive_clip_moves_towards_the_target_quantile() {
        let rule = AdaptiveClip {
            target_quantile: 0.5,
            learning_rate: 0.2,
        };
        let c = 2.0;
        assert!((rule.next_clip(c, 1.0) - c * (-0.1f64).exp()).abs() < 1e-15);
        assert!((rule.next_clip(c, 0.0) - c * 0.1f64.exp()).abs() < 1e-15);
        assert_eq!(rule.next_clip(c, 0.5), c);
        // b̃: 7 of 10 unclipped with m = 10 and no noise is 0.7; noise moves it by noise/m.
        assert!((AdaptiveClip::noised_fraction(7, 10, 10.0, 0.0) - 0.7).abs() < 1e-15);
        assert!((AdaptiveClip::noised_fraction(7, 10, 10.0, 1.0) - 0.8).abs() < 1e-15);
        assert_eq!(AdaptiveClip::noised_fraction(10, 10, 10.0, 50.0), 1.0);
        assert_eq!(AdaptiveClip::noised_fraction(0, 10, 10.0, -50.0), 0.0);
        // Iterated on updates whose norms are spread over [0, 10), C settles near the median.
        let norms: Vec<f64> = (0..100).map(|i| f64::from(i) / 10.0).collect();
        let mut c = 0.1;
        for _ in 0..400 {
            let unclipped = norms.iter().filter(|n| **n <= c).count();
            c = rule.next_clip(c, AdaptiveClip::noised_fraction(unclipped, 100, 100.0, 0.0));
        }
        assert!((4.0..6.0).contains(&c), "{c}");
        // It never reaches 0 or infinity.
        let mut tiny = 1e-11;
        for _ in 0..1000 {
            tiny = rule.next_clip(tiny, 1.0);
        }
        assert_eq!(tiny, CLIP_RANGE.0);
    }
}
