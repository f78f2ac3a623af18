//! Gaussian noise for a round's sum, from a cryptographic generator.
//!
//! The noise is what the privacy guarantee rests on, so it must be unpredictable to anyone who
//! sees the published model: a fresh 256-bit seed from the operating system (ring's
//! `SystemRandom`, i.e. getrandom) keys a ChaCha20 stream cipher used as the generator, and the
//! seed never leaves the call (it is neither logged nor stored; whoever held it could subtract
//! the noise). Normal deviates come from `rand_distr::StandardNormal` (a ziggurat sampler, exact
//! up to f64 rounding), scaled to the requested standard deviation.
//!
//! The sum is noised in place, stretch by stretch: each stretch of [`STRETCH`] coordinates draws
//! from its own ChaCha20 stream (the same key, stream number = stretch index — independent
//! keystreams), so stretches are noised in parallel and no second model-sized buffer exists.

use rand::SeedableRng;
use rand_chacha::ChaCha20Rng;
use rand_distr::{Distribution, StandardNormal};
use rayon::prelude::*;
use ring::rand::{SecureRandom, SystemRandom};

/// Coordinates per stretch (and per ChaCha20 stream): 512 KiB of f64.
pub const STRETCH: usize = 1 << 16;

#[derive(Debug, thiserror::Error)]
#[error("the operating system's random number generator failed")]
pub struct NoRandomness;

/// A fresh 256-bit seed from the operating system.
fn os_seed() -> Result<[u8; 32], NoRandomness> {
    let mut seed = [0u8; 32];
    SystemRandom::new()
        .fill(&mut seed)
        .map_err(|_| NoRandomness)?;
    Ok(seed)
}

/// Adds independent N(0, stddev²) noise to every value, from a fresh OS-seeded generator.
pub fn add_gaussian_noise(values: &mut [f64], stddev: f64) -> Result<(), NoRandomness> {
    let mut seed = os_seed()?;
    add_gaussian_noise_seeded(values, stddev, &seed);
    seed.fill(0);
    Ok(())
}

/// [`add_gaussian_noise`] from a given seed (deterministic: for tests).
pub fn add_gaussian_noise_seeded(values: &mut [f64], stddev: f64, seed: &[u8; 32]) {
    values
        .par_chunks_mut(STRETCH)
        .enumerate()
        .for_each(|(stretch, values)| {
            let mut rng = ChaCha20Rng::from_seed(*seed);
            rng.set_stream(stretch as u64);
            for v in values {
                let z: f64 = StandardNormal.sample(&mut rng);
                *v += stddev * z;
            }
        });
}

/// One N(0, stddev²) draw from a fresh OS-seeded generator (the noise on a count).
pub fn gaussian(stddev: f64) -> Result<f64, NoRandomness> {
    let mut rng = ChaCha20Rng::from_seed(os_seed()?);
    let z: f64 = StandardNormal.sample(&mut rng);
    Ok(stddev * z)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mean_and_std(values: &[f64]) -> (f64, f64) {
        let n = values.len() as f64;
        let mean = values.iter().sum::<f64>() / n;
        let var = values.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / (n - 1.0);
        (mean, var.sqrt())
    }

    /// Noise on a zero sum of n = 131072 coordinates (two stretches) with s = σ·C = 1.3 × 0.7.
    /// For n independent N(0, s²) draws the sample mean has standard error s/√n and the sample
    /// standard deviation s/√(2n) (to first order); the fraction beyond 2s is p = 0.0455 with
    /// standard error √(p(1−p)/n). Every check allows 5 standard errors: a correct sampler fails
    /// one with probability below 1e−5.
    #[test]
    fn noise_has_mean_zero_and_the_requested_deviation() {
        let s = 1.3 * 0.7;
        let mut values = vec![0.0; 2 * STRETCH];
        add_gaussian_noise(&mut values, s).unwrap();
        let n = values.len() as f64;
        let (mean, std) = mean_and_std(&values);
        assert!(mean.abs() <= 5.0 * s / n.sqrt(), "mean {mean}");
        assert!(
            (std / s - 1.0).abs() <= 5.0 / (2.0 * n).sqrt(),
            "std {std} for {s}"
        );
        let p = 0.045_500_263_896_358_41; // P(|Z| > 2) = erfc(√2)
        let beyond = values.iter().filter(|v| v.abs() > 2.0 * s).count() as f64 / n;
        assert!(
            (beyond - p).abs() <= 5.0 * (p * (1.0 - p) / n).sqrt(),
            "{beyond} beyond 2s"
        );
        // The stretches draw from different streams: no correlation between them.
        let (a, b) = values.split_at(STRETCH);
        let corr = a.iter().zip(b).map(|(x, y)| x * y).sum::<f64>() / (STRETCH as f64 * s * s);
        assert!(
            corr.abs() <= 5.0 / (STRETCH as f64).sqrt(),
            "correlation {corr}"
        );
    }

    #[test]
    fn noise_is_added_in_place_and_fresh_each_time() {
        let mut a = vec![10.0; 1000];
        add_gaussian_noise_seeded(&mut a, 0.0, &[7; 32]);
        assert!(a.iter().all(|v| *v == 10.0));
        let (mut b, mut c) = (vec![10.0; 1000], vec![10.0; 1000]);
        add_gaussian_noise_seeded(&mut b, 1.0, &[7; 32]);
        add_gaussian_noise_seeded(&mut c, 1.0, &[7; 32]);
        assert_eq!(b, c, "a seed determines the noise");
        let (mean, _) = mean_and_std(&b);
        assert!((mean - 10.0).abs() < 5.0 / 1000f64.sqrt());
        let (mut d, mut e) = (vec![0.0; 1000], vec![0.0; 1000]);
        add_gaussian_noise(&mut d, 1.0).unwrap();
        add_gaussian_noise(&mut e, 1.0).unwrap();
        assert_ne!(d, e, "every call draws a fresh seed");
        assert_ne!(gaussian(1.0).unwrap(), gaussian(1.0).unwrap());
    }
}
