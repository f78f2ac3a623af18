//! Discrete Gaussian noise for a round's sum, drawn with integer arithmetic from a cryptographic
//! generator: no floating-point number decides any step of the sampling.
//!
//! **Why discrete.** Noise drawn as a floating-point number (a ziggurat, Box–Muller, inversion)
//! is open to floating-point attacks: which doubles `x + noise` can take, and how likely each
//! is, depends on the low-order bits of `x`, so a published value can give away the value it
//! was meant to hide (Mironov 2012, "On Significance of the Least Significant Bits for
//! Differential Privacy", for the Laplace mechanism; Gaussian samplers on doubles have the same
//! weakness). Here every published coordinate is an exact function of an *integer*: the sum
//! rounded to a grid, plus an integer drawn exactly from the discrete Gaussian
//! `N_Z(0, σ²)`, `P(k) ∝ exp(−k²/(2σ²))` (Canonne, Kamath, Steinke 2020, "The Discrete Gaussian
//! for Differential Privacy", CKS20 below).
//!
//! **The grid.** For noise of standard deviation `s` on a sum of L2 sensitivity `C` with `d`
//! coordinates ([`Grid::for_sum`]), the grid step `g` is the power of two with
//! `s/g ∈ [2^28, 2^29)` ([`FINENESS`]), and each coordinate `x` becomes `g·(round(x/g) + k)`,
//! `k ∼ N_Z(0, σ²)` with `σ = ⌈s/g + (s/C)·√d⌉ + 1` grid steps.
//! - `g` is a power of two, so `x/g`, its rounding to an integer `m`, and the product by `g` are
//!   exact in f64; the one addition `m + k` is exact below 2^53 and otherwise rounds as a
//!   function of the integer `m + k` alone. The output is therefore post-processing of the
//!   integer vector `m + k`: two sums that round to the same grid point publish the same
//!   distribution, bit for bit, and the low bits of the output carry nothing more.
//! - Rounding moves a coordinate by at most `g/2`, so neighbouring sums (`‖x − x′‖₂ ≤ C`) round
//!   to integer vectors at most `C/g + √d` apart. `σ` holds `(s/C)·√d` steps beyond `s/g` for
//!   that: `σ / (C/g + √d) ≥ s/C = z`, the multiplier the accountant is given. The price is
//!   noise larger than asked by a relative `z·√d/2^28`: 1.2e−5 for z = 1 and 10⁷ coordinates.
//!   The ceiling and the `+ 1` cover the f64 rounding of `s/C·√d` (and leave a margin, below).
//! - 2^28 steps per standard deviation make the grid far finer than anything the model can
//!   notice, and keep `σ` below 2^31 (asserted: [`NoiseError::Scale`]), so every probability the
//!   sampler uses is a ratio of integers below 2^64.
//!
//! The noise on the count that steers an adaptive clip ([`gaussian`], [`Grid::for_count`]) is
//! `g·k` with `σ = ⌈s/g⌉` and `g ≤ ½`: the count it is added to is a multiple of ½, hence of
//! `g`, so no rounding (and no extra noise) is needed, and the one f64 addition the caller does
//! rounds as a function of the exact noised count.
//!
//! **The sampler** (CKS20, Algorithms 1–3), in integers on a ChaCha20 stream:
//! - Bernoulli(n/d): a uniform integer below `d` is below `n`. Uniform integers are exact: below
//!   2^16 by rejection on the fewest bits that can hold them, above by Lemire's
//!   multiply-and-reject (the rejection removes the bias). Bits are taken from the stream as
//!   needed, each used once.
//! - Bernoulli(exp(−γ)), γ = n/d ∈ [0, 1]: von Neumann's method — count K up from 1 while a
//!   Bernoulli(γ/K) succeeds, and answer "K is odd"; Bernoulli(γ/K) is Bernoulli(1/K) and
//!   Bernoulli(n/d), independent. For γ > 1: ⌊γ⌋ Bernoulli(exp(−1)) and one Bernoulli(exp(−(γ −
//!   ⌊γ⌋))), stopping at the first failure.
//! - Discrete Laplace of scale `t` (`P(x) ∝ exp(−|x|/t)`): `U` uniform below `t`, kept with
//!   probability exp(−U/t); `V` the number of Bernoulli(exp(−1)) successes before the first
//!   failure; `X = U + t·V` with a uniform sign, drawing again on a negative zero.
//! - Discrete Gaussian: `Y` from the discrete Laplace, kept with probability
//!   `exp(−(|Y| − σ²/t)²/(2σ²))`. CKS20 take `t = ⌊σ⌋ + 1`; any `t > 0` gives the same
//!   distribution, and with `σ` an integer, `t = σ` makes the exponent `(|Y| − σ)²/(2σ²)`, a
//!   ratio of integers (about 76% of the candidates are kept, as with CKS20's choice).
//!
//! **What the privacy rests on** (the accountant is unchanged). For integer vectors μ, ν and
//! every order α > 1, `D_α(N_Z(μ, σ²I) ‖ N_Z(ν, σ²I)) ≤ α‖μ − ν‖²/(2σ²)`, the continuous
//! Gaussian's value (CKS20, Theorem 4, coordinate by coordinate: the exponents combine into
//! `α(α−1)(μᵢ−νᵢ)²/(2σ²)` times a shifted theta sum `Σ_x exp(−(x − c)²/(2σ²))`, which is largest
//! at integer shifts). The accountant evaluates the sampled mechanism's
//! `A_α = E_{P₀}[((1−q) + q·P₁/P₀)^α]` (Mironov, Talwar, Zhang 2019); at integer α that is
//! `Σ_k C(α,k)(1−q)^{α−k} q^k E_{P₀}[(P₁/P₀)^k]`, and for the discrete Gaussian each
//! `E_{P₀}[(P₁/P₀)^k]` is the continuous value times a ratio of theta sums at most 1, so `A_α`
//! is no larger. The fractional orders, and the reverse direction of the add/remove pair (where
//! MTZ19 use properties of the continuous density), are not proved separately here: with σ ≥ 2^28
//! grid steps the discrete sums equal the continuous integrals to far below f64 precision
//! (Poisson summation: the differences are of order exp(−2π²σ²)), so the accountant's figures
//! carry over in the regime used.
//!
//! **What remains.** The sum and the clip before the grid are f64 computations: each update is
//! scaled to norm `C` up to rounding, and the fold's rounding depends on which updates are in it,
//! so the computed sum's sensitivity exceeds `C` by rounding errors (at most of order
//! `updates² · 2^−53 · C` in L2, and far less in practice). That is a question of sensitivity,
//! not a channel: what the output reveals is bounded by how far the rounded integer vector can
//! move, and the `+ 1` in `σ` absorbs a move of `C·2^−29` beyond `C` — more than those errors for
//! rounds of up to a few thousand updates even in the worst case. The sampler's running time
//! varies with its draws (rejection is not constant-time); the time to noise millions of
//! coordinates shows only an aggregate of them.
//!
//! **Randomness.** A fresh 256-bit seed from the operating system (ring's `SystemRandom`, i.e.
//! getrandom) keys a ChaCha20 stream cipher used as the generator, and the seed never leaves
//! the call (it is neither logged nor stored; whoever held it could subtract the noise). The sum
//! is noised in place, stretch by stretch: each stretch of [`STRETCH`] coordinates draws from
//! its own ChaCha20 stream (the same key, stream number = stretch index — independent
//! keystreams), so stretches are noised in parallel and no second model-sized buffer exists.

use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha20Rng;
use rayon::prelude::*;
use ring::rand::{SecureRandom, SystemRandom};

/// Coordinates per stretch (and per ChaCha20 stream): 512 KiB of f64.
pub const STRETCH: usize = 1 << 16;

/// The grid step is the power of two `g` with `stddev/g ∈ [2^FINENESS, 2^(FINENESS+1))`.
pub const FINENESS: i32 = 28;

/// The largest `σ` (in grid steps) the sampler takes: `2σ²` must stay below 2^64.
pub const MAX_SIGMA: u64 = 1 << 31;

#[derive(Debug, thiserror::Error)]
pub enum NoiseError {
    #[error("the operating system's random number generator failed")]
    NoRandomness,
    #[error("the noise cannot be drawn on a grid: {0}")]
    Scale(String),
}

/// Where the noise lives: integer multiples of `step` (a power of two), with the discrete
/// Gaussian's `σ` in steps.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Grid {
    pub step: f64,
    pub sigma: u64,
}

impl Grid {
    /// The grid for noise of standard deviation `stddev` on a sum of `len` coordinates whose L2
    /// sensitivity is `sensitivity` (see the module doc: `σ` makes up for the rounding).
    pub fn for_sum(stddev: f64, sensitivity: f64, len: usize) -> Result<Grid, NoiseError> {
        if !(sensitivity.is_finite() && sensitivity > 0.0) {
            return Err(NoiseError::Scale(format!(
                "the sensitivity must be positive and finite (got {sensitivity})"
            )));
        }
        let step = pow2(log2_floor(stddev)? - FINENESS);
        // Exact: `step` is a power of two and the quotient is in [2^28, 2^29).
        let steps = stddev / step;
        let rounding = stddev / sensitivity * (len as f64).sqrt();
        Grid::with_sigma(step, (steps + rounding).ceil() + 1.0)
    }

    /// The grid for noise of standard deviation `stddev` on a count that is a multiple of ½:
    /// the step is at most ½, so the count lies on the grid.
    pub fn for_count(stddev: f64) -> Result<Grid, NoiseError> {
        let step = pow2((log2_floor(stddev)? - FINENESS).min(-1));
        Grid::with_sigma(step, (stddev / step).ceil())
    }

    fn with_sigma(step: f64, sigma: f64) -> Result<Grid, NoiseError> {
        if sigma.is_nan() || sigma > MAX_SIGMA as f64 {
            return Err(NoiseError::Scale(format!(
                "σ would be {sigma} grid steps, above 2^31: the noise multiplier times √(coordinates) is too large"
            )));
        }
        Ok(Grid {
            step,
            sigma: sigma as u64,
        })
    }
}

/// `⌊log₂ x⌋` for a positive x in [2^−900, 2^900] (read off the exponent bits: exact).
fn log2_floor(x: f64) -> Result<i32, NoiseError> {
    if !(x.is_finite() && (f64::powi(2.0, -900)..=f64::powi(2.0, 900)).contains(&x)) {
        return Err(NoiseError::Scale(format!(
            "the standard deviation must be positive and finite (got {x})"
        )));
    }
    Ok(((x.to_bits() >> 52) & 0x7ff) as i32 - 1023)
}

/// `2^e` for a normal exponent.
fn pow2(e: i32) -> f64 {
    debug_assert!((-1022..=1023).contains(&e));
    f64::from_bits(((e + 1023) as u64) << 52)
}

/// A fresh 256-bit seed from the operating system.
fn os_seed() -> Result<[u8; 32], NoiseError> {
    let mut seed = [0u8; 32];
    SystemRandom::new()
        .fill(&mut seed)
        .map_err(|_| NoiseError::NoRandomness)?;
    Ok(seed)
}

/// Adds independent discrete Gaussian noise of standard deviation (at least) `stddev` to every
/// value, on the grid of [`Grid::for_sum`], from a fresh OS-seeded generator; `sensitivity` is
/// the sum's L2 sensitivity (the clip norm). Returns the grid.
pub fn add_gaussian_noise(
    values: &mut [f64],
    stddev: f64,
    sensitivity: f64,
) -> Result<Grid, NoiseError> {
    let grid = Grid::for_sum(stddev, sensitivity, values.len())?;
    let mut seed = os_seed()?;
    add_noise_on_grid(values, grid, &seed);
    seed.fill(0);
    Ok(grid)
}

/// [`add_gaussian_noise`] from a given seed (deterministic: for tests and benchmarks).
pub fn add_gaussian_noise_seeded(
    values: &mut [f64],
    stddev: f64,
    sensitivity: f64,
    seed: &[u8; 32],
) -> Result<Grid, NoiseError> {
    let grid = Grid::for_sum(stddev, sensitivity, values.len())?;
    add_noise_on_grid(values, grid, seed);
    Ok(grid)
}

/// Rounds every value to the grid [`add_gaussian_noise`] would use for the same arguments, with
/// no noise: for a sum noised once already that took more (unnoised) updates since, as after a
/// close that failed once it had noised the sum, so what is published stays on the grid.
pub fn snap_to_grid(values: &mut [f64], stddev: f64, sensitivity: f64) -> Result<Grid, NoiseError> {
    let grid = Grid::for_sum(stddev, sensitivity, values.len())?;
    values.par_chunks_mut(STRETCH).for_each(|values| {
        values
            .iter_mut()
            .for_each(|v| *v = (*v / grid.step).round() * grid.step)
    });
    Ok(grid)
}

/// Each value `x` becomes `step·(round(x/step) + k)`, `k ∼ N_Z(0, sigma²)`.
fn add_noise_on_grid(values: &mut [f64], grid: Grid, seed: &[u8; 32]) {
    values
        .par_chunks_mut(STRETCH)
        .enumerate()
        .for_each(|(stretch, values)| {
            let mut bits = Bits::new(stream(seed, stretch as u64));
            for v in values {
                let k = discrete_gaussian(&mut bits, grid.sigma);
                // Exact but for the addition, which rounds as a function of the integer sum.
                *v = ((*v / grid.step).round() + k as f64) * grid.step;
            }
        });
}

/// Stream number `stream` of the ChaCha20 generator keyed by `seed`.
fn stream(seed: &[u8; 32], stream: u64) -> ChaCha20Rng {
    let mut rng = ChaCha20Rng::from_seed(*seed);
    rng.set_stream(stream);
    rng
}

/// One discrete Gaussian draw of standard deviation (at least) `stddev`, a multiple of the
/// step of [`Grid::for_count`], from a fresh OS-seeded generator (the noise on a count).
pub fn gaussian(stddev: f64) -> Result<f64, NoiseError> {
    let grid = Grid::for_count(stddev)?;
    let mut bits = Bits::new(ChaCha20Rng::from_seed(os_seed()?));
    Ok(discrete_gaussian(&mut bits, grid.sigma) as f64 * grid.step)
}

/// Uniform random bits from a generator, each used once: a draw takes only as many as it needs
/// (a sign one bit, a uniform integer below 3 two), so the cipher runs several times less than
/// with a 64-bit word per draw.
struct Bits<R> {
    rng: R,
    word: u64,
    left: u32,
}

impl<R: RngCore> Bits<R> {
    fn new(rng: R) -> Self {
        Bits {
            rng,
            word: 0,
            left: 0,
        }
    }

    /// `n ≤ 32` fresh uniform bits, as an integer below 2^n. (A word's last bits, when fewer
    /// than `n`, are dropped unused.)
    fn take(&mut self, n: u32) -> u64 {
        debug_assert!((1..=32).contains(&n));
        if self.left < n {
            self.word = self.rng.next_u64();
            self.left = 64;
        }
        let x = self.word & ((1u64 << n) - 1);
        self.word >>= n;
        self.left -= n;
        x
    }

    /// A uniform integer in `[0, n)`, `n ≥ 1`, exactly. Below 2^16: the fewest bits that can
    /// hold `n − 1`, drawn again while they are not below `n`. Above: Lemire's
    /// multiply-and-reject ("Fast Random Integer Generation in an Interval", 2019) on a 32- or
    /// 64-bit word — the high half of `x·n` is uniform once the products whose low half is below
    /// `2^w mod n` are rejected.
    fn below(&mut self, n: u64) -> u64 {
        debug_assert!(n >= 1);
        if n <= 1 << 16 {
            if n == 1 {
                return 0;
            }
            let width = 64 - (n - 1).leading_zeros();
            loop {
                let x = self.take(width);
                if x < n {
                    return x;
                }
            }
        }
        if n < 1 << 32 {
            let mut product = self.take(32) * n;
            if (product as u32 as u64) < n {
                let threshold = (1u64 << 32) % n;
                while (product as u32 as u64) < threshold {
                    product = self.take(32) * n;
                }
            }
            return product >> 32;
        }
        let mut product = u128::from(self.rng.next_u64()) * u128::from(n);
        if (product as u64) < n {
            let threshold = n.wrapping_neg() % n;
            while (product as u64) < threshold {
                product = u128::from(self.rng.next_u64()) * u128::from(n);
            }
        }
        (product >> 64) as u64
    }
}

/// Bernoulli(exp(−num/den)) for `num ≤ den`, `den ≥ 1` (CKS20, Algorithm 1).
fn bernoulli_exp_minus_fraction(bits: &mut Bits<impl RngCore>, num: u64, den: u64) -> bool {
    debug_assert!(num <= den && den >= 1);
    if num == 0 {
        return true;
    }
    let mut k = 1u64;
    // While Bernoulli(γ/k) = Bernoulli(1/k) ∧ Bernoulli(num/den) succeeds, k grows.
    loop {
        if k > 1 && bits.below(k) != 0 {
            break;
        }
        if num < den && bits.below(den) >= num {
            break;
        }
        k += 1;
    }
    k % 2 == 1
}

/// Bernoulli(exp(−num/den)) for any `num`, `den ≥ 1`.
fn bernoulli_exp_minus(bits: &mut Bits<impl RngCore>, num: u128, den: u64) -> bool {
    let wide = u128::from(den);
    if num <= wide {
        return bernoulli_exp_minus_fraction(bits, num as u64, den);
    }
    let (whole, rest) = (num / wide, (num % wide) as u64);
    let mut i = 0u128;
    while i < whole {
        if !bernoulli_exp_minus_fraction(bits, 1, 1) {
            return false;
        }
        i += 1;
    }
    bernoulli_exp_minus_fraction(bits, rest, den)
}

/// `P(x) ∝ exp(−|x|/t)` over the integers, `t ≥ 1` (CKS20, Algorithm 2 with an integer scale).
fn discrete_laplace(bits: &mut Bits<impl RngCore>, t: u64) -> i64 {
    loop {
        let u = bits.below(t);
        if !bernoulli_exp_minus_fraction(bits, u, t) {
            continue;
        }
        let mut v = 0u64;
        while bernoulli_exp_minus_fraction(bits, 1, 1) {
            v += 1;
        }
        // Beyond i64 only after more than 2^32 successes in a row, probability below
        // exp(−2^32): the draw is made again, never wrapped.
        let Some(x) = v
            .checked_mul(t)
            .and_then(|x| x.checked_add(u))
            .and_then(|x| i64::try_from(x).ok())
        else {
            continue;
        };
        let negative = bits.take(1) == 1;
        if negative && x == 0 {
            continue;
        }
        return if negative { -x } else { x };
    }
}

/// `P(k) ∝ exp(−k²/(2σ²))` over the integers, `1 ≤ σ ≤ 2^31` (CKS20, Algorithm 3 with
/// `t = σ`).
fn discrete_gaussian(bits: &mut Bits<impl RngCore>, sigma: u64) -> i64 {
    debug_assert!((1..=MAX_SIGMA).contains(&sigma));
    let den = 2 * sigma * sigma;
    loop {
        let y = discrete_laplace(bits, sigma);
        let off = u128::from(y.unsigned_abs().abs_diff(sigma));
        if bernoulli_exp_minus(bits, off * off, den) {
            return y;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sum_that_took_updates_after_its_noise_is_snapped_back_to_the_grid() {
        let mut sum = vec![0.25; 1000];
        let grid = add_gaussian_noise_seeded(&mut sum, 1.3, 0.7, &[7; 32]).unwrap();
        // Updates folded after the noise are off the grid; snapping puts every value back on it.
        for (i, v) in sum.iter_mut().enumerate() {
            *v += 1e-9 * i as f64 + 0.3;
        }
        let snapped = snap_to_grid(&mut sum, 1.3, 0.7).unwrap();
        assert_eq!((snapped.step, snapped.sigma), (grid.step, grid.sigma));
        for v in &sum {
            assert_eq!(
                (v / grid.step).fract(),
                0.0,
                "{v} is off the grid of {}",
                grid.step
            );
        }
    }

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
    /// one with probability below 1e−5. (The discrete Gaussian with 2^28 steps per deviation
    /// differs from the continuous one far below these errors, and so does the excess the grid
    /// adds, 1.3·√131072/2^28 relative.)
    #[test]
    fn noise_has_mean_zero_and_the_requested_deviation() {
        let s = 1.3 * 0.7;
        let mut values = vec![0.0; 2 * STRETCH];
        add_gaussian_noise(&mut values, s, 0.7).unwrap();
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
        let (mut b, mut c) = (vec![10.0; 1000], vec![10.0; 1000]);
        add_gaussian_noise_seeded(&mut b, 1.0, 1.0, &[7; 32]).unwrap();
        add_gaussian_noise_seeded(&mut c, 1.0, 1.0, &[7; 32]).unwrap();
        assert_eq!(b, c, "a seed determines the noise");
        let (mean, _) = mean_and_std(&b);
        assert!((mean - 10.0).abs() < 5.0 / 1000f64.sqrt());
        let (mut d, mut e) = (vec![0.0; 1000], vec![0.0; 1000]);
        add_gaussian_noise(&mut d, 1.0, 1.0).unwrap();
        add_gaussian_noise(&mut e, 1.0, 1.0).unwrap();
        assert_ne!(d, e, "every call draws a fresh seed");
        assert_ne!(gaussian(1.0).unwrap(), gaussian(1.0).unwrap());
    }

    /// The grid of the module doc: a power-of-two step with stddev/step in [2^28, 2^29), and σ
    /// large enough to cover the rounding, by no more than the rounding needs.
    #[test]
    fn the_grid_is_a_power_of_two_and_sigma_covers_the_rounding() {
        for (s, c, d) in [
            (0.91, 0.7, 131_072usize),
            (3e-9, 1e-9, 10_000_000),
            (5e4, 10.0, 1),
        ] {
            let grid = Grid::for_sum(s, c, d).unwrap();
            assert_eq!(grid.step, pow2(grid.step.log2() as i32), "{grid:?}");
            let steps = s / grid.step;
            assert!((2f64.powi(28)..2f64.powi(29)).contains(&steps), "{grid:?}");
            let needed = steps + s / c * (d as f64).sqrt();
            let sigma = grid.sigma as f64;
            assert!(
                sigma >= needed && sigma <= needed + 2.0,
                "{grid:?} for {needed}"
            );
            // σ over the rounded sum's sensitivity in steps is at least z = s/c.
            assert!(sigma / (c / grid.step + (d as f64).sqrt()) >= s / c);
        }
        let count = Grid::for_count(5.0).unwrap();
        assert!(count.step <= 0.5 && count.sigma as f64 * count.step >= 5.0);
        assert_eq!(
            Grid::for_count(1e9).unwrap().step,
            0.5,
            "½ stays on the grid"
        );
        for (s, c) in [
            (0.0, 1.0),
            (-1.0, 1.0),
            (f64::NAN, 1.0),
            (1.0, 0.0),
            (1.0, f64::NAN),
        ] {
            assert!(Grid::for_sum(s, c, 10).is_err(), "{s} {c}");
        }
        // A multiplier of 1e5 on 10^9 coordinates would need σ above 2^31 steps.
        assert!(matches!(
            Grid::for_sum(1e5, 1.0, 1_000_000_000),
            Err(NoiseError::Scale(_))
        ));
    }

    /// Every noised value is an integer multiple of the step, at an integer number of steps
    /// from the original rounded to the grid — exactly the integers the sampler drew from each
    /// stretch's stream — and an original's low bits do not reach the output.
    #[test]
    fn every_noised_value_lies_on_the_grid() {
        let seed = [3; 32];
        let originals: Vec<f64> = (0..STRETCH + 5000)
            .map(|i| (i as f64 * 0.618_033_988_749_895).sin() * 37.0)
            .collect();
        let mut values = originals.clone();
        let grid = add_gaussian_noise_seeded(&mut values, 0.25, 0.1, &seed).unwrap();
        let mut streams = [0, 1].map(|number| Bits::new(stream(&seed, number)));
        for (i, (v, x)) in values.iter().zip(&originals).enumerate() {
            let steps = v / grid.step;
            assert_eq!(steps, steps.trunc(), "{v} is not on the grid of {grid:?}");
            let k = discrete_gaussian(&mut streams[i / STRETCH], grid.sigma);
            assert_eq!(steps - (x / grid.step).round(), k as f64, "coordinate {i}");
        }
        // Originals that differ in their low bits but round to the same grid point publish the
        // same values, bit for bit.
        let mut nudged: Vec<f64> = originals
            .iter()
            .map(|x| ((x / grid.step).round() + 0.25) * grid.step)
            .collect();
        add_gaussian_noise_seeded(&mut nudged, 0.25, 0.1, &seed).unwrap();
        assert_eq!(nudged, values);
    }

    /// `exp(−k²/(2σ²))/Z` for |k| ≤ 12σ (the rest weighs below e^−72).
    fn pmf(sigma: f64) -> Vec<(i64, f64)> {
        let reach = (12.0 * sigma) as i64;
        let weights: Vec<(i64, f64)> = (-reach..=reach)
            .map(|k| (k, (-(k * k) as f64 / (2.0 * sigma * sigma)).exp()))
            .collect();
        let z: f64 = weights.iter().map(|(_, w)| w).sum();
        weights.into_iter().map(|(k, w)| (k, w / z)).collect()
    }

    /// The sampler's empirical pmf against `exp(−k²/(2σ²))/Z` for σ = 1, 2 and 3: every value
    /// with probability above 1e−4 within 5 standard errors of it, and the chi-square over those
    /// buckets (and one for the rest) below its 1e−6 quantile. A rounded continuous Gaussian
    /// would fail at σ = 1 (P(0) = 0.383 instead of 0.399, 30 standard errors away), as would a
    /// wrong envelope or acceptance test.
    #[test]
    fn discrete_gaussian_matches_its_pmf() {
        let draws = 400_000;
        let mut bits = Bits::new(ChaCha20Rng::from_seed([5; 32]));
        for sigma in [1u64, 2, 3] {
            let pmf = pmf(sigma as f64);
            let reach = pmf.last().unwrap().0;
            let mut counts = vec![0u64; pmf.len()];
            for _ in 0..draws {
                let k = discrete_gaussian(&mut bits, sigma);
                assert!(k.abs() <= reach, "{k} drawn at σ = {sigma}");
                counts[(k + reach) as usize] += 1;
            }
            let n = draws as f64;
            let (mut chi2, mut rest_seen, mut rest_p, mut buckets) = (0.0, 0.0, 0.0, 0);
            for ((k, p), seen) in pmf.iter().zip(&counts) {
                let seen = *seen as f64;
                if *p < 1e-4 {
                    rest_seen += seen;
                    rest_p += p;
                    continue;
                }
                let se = (p * (1.0 - p) / n).sqrt();
                assert!(
                    (seen / n - p).abs() <= 5.0 * se,
                    "σ = {sigma}: P({k}) = {} against {p}",
                    seen / n
                );
                chi2 += (seen - n * p).powi(2) / (n * p);
                buckets += 1;
            }
            chi2 += (rest_seen - n * rest_p).powi(2) / (n * rest_p);
            // Degrees of freedom: `buckets` (buckets + 1 cells). ν + 12√ν is above the 1e−6
            // quantile of χ²_ν for the ν here (9, 15 and 23).
            let nu = buckets as f64;
            assert!(
                chi2 <= nu + 12.0 * nu.sqrt(),
                "σ = {sigma}: χ² = {chi2}, ν = {nu}"
            );
        }
    }

    /// Bernoulli(exp(−γ)) for γ below, at and above 1, within 5 standard errors.
    #[test]
    fn bernoulli_exp_minus_has_the_right_mean() {
        let draws = 200_000;
        let mut bits = Bits::new(ChaCha20Rng::from_seed([9; 32]));
        for (num, den) in [(0u128, 1u64), (1, 3), (1, 1), (7, 4), (5, 2), (1001, 1000)] {
            let p = (-(num as f64) / den as f64).exp();
            let hits = (0..draws)
                .filter(|_| bernoulli_exp_minus(&mut bits, num, den))
                .count() as f64;
            let se = (p * (1.0 - p) / draws as f64).sqrt();
            assert!(
                (hits / draws as f64 - p).abs() <= 5.0 * se,
                "exp(−{num}/{den}): {} against {p}",
                hits / draws as f64
            );
        }
    }

    /// Uniform integers in each of `below`'s three regimes (fewest bits, Lemire on 32 and on
    /// 64 bits): six equal ranges of [0, n), each within 5 standard errors of 1/6.
    #[test]
    fn below_is_uniform_and_in_range() {
        let mut bits = Bits::new(ChaCha20Rng::from_seed([1; 32]));
        let draws = 120_000;
        for n in [6u64, 6 << 27, (6 << 60) + 6] {
            let mut counts = [0u32; 6];
            for _ in 0..draws {
                let x = bits.below(n);
                assert!(x < n);
                counts[(u128::from(x) * 6 / u128::from(n)) as usize] += 1;
            }
            let p = 1.0 / 6.0;
            let se = (p * (1.0 - p) / draws as f64).sqrt();
            for c in counts {
                assert!(
                    (f64::from(c) / draws as f64 - p).abs() <= 5.0 * se,
                    "{n}: {counts:?}"
                );
            }
        }
        assert_eq!(bits.below(1), 0);
        // Ranges just past each regime's edge: 2^16 + 1 and 2^32.
        assert!((0..1000).all(|_| bits.below((1 << 16) + 1) <= 1 << 16));
        assert!((0..1000).all(|_| bits.below(1 << 32) < 1 << 32));
    }
}
