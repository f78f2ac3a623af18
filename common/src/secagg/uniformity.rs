//! What the server sees of one client must look like uniform noise, whatever the client's input:
//! statistical tests on masked uploads of deliberately structured inputs (all zeros; one wave
//! shared by every client), and the proof that the same tests reject those inputs unmasked.
//!
//! Each statistic is compared with a bound seven standard deviations out (a normal tail of about
//! 1e-12; some 800 comparisons per run), so a false failure is astronomically unlikely, while
//! the plaintexts miss by orders of magnitude:
//! - chi-square of the 256-bin histogram of the upload's bytes (255 degrees of freedom; the
//!   bound is the Wilson–Hilferty quantile);
//! - the frequency of ones at each of the 32 bit positions of a word (|z| per position);
//! - the serial correlation of successive words, read as uniform values in [0, 1);
//! - for a plaintext with variation, the (Pearson) correlation of the upload with it.

use rand_chacha::rand_core::{RngCore, SeedableRng};

use super::simulate::{run, Outcome};
use super::Quantiser;

/// Standard deviations a statistic may stray before the test fails.
const Z: f64 = 7.0;
const N: usize = 20;
const M: usize = 100_000;

/// The chi-square quantile `z` standard deviations up (Wilson–Hilferty).
fn chi2_limit(df: f64, z: f64) -> f64 {
    let a = 2.0 / (9.0 * df);
    df * (1.0 - a + z * a.sqrt()).powi(3)
}

fn byte_chi2(words: &[u32]) -> f64 {
    let mut counts = [0u64; 256];
    for w in words {
        for b in w.to_le_bytes() {
            counts[usize::from(b)] += 1;
        }
    }
    let expected = (words.len() * 4) as f64 / 256.0;
    counts
        .iter()
        .map(|&c| (c as f64 - expected).powi(2) / expected)
        .sum()
}

/// The largest |z| over the 32 bit positions of the frequency of ones.
fn worst_bit_z(words: &[u32]) -> f64 {
    let n = words.len() as f64;
    (0..32)
        .map(|bit| {
            let ones = words.iter().filter(|&&w| w >> bit & 1 == 1).count() as f64;
            ((ones - n / 2.0) / (n / 4.0).sqrt()).abs()
        })
        .fold(0.0, f64::max)
}

/// A word as a uniform value centred on 0 (variance 1/12 under the null hypothesis).
fn centred(w: u32) -> f64 {
    (f64::from(w) + 0.5) / 4_294_967_296.0 - 0.5
}

/// The lag-1 correlation of the words in units of its standard deviation under independence.
fn serial_z(words: &[u32]) -> f64 {
    let pairs = (words.len() - 1) as f64;
    let s: f64 = words
        .windows(2)
        .map(|p| centred(p[0]) * centred(p[1]))
        .sum();
    // Σ u_i·u_{i+1} has mean 0 and standard deviation √pairs / 12.
    s / (pairs.sqrt() / 12.0)
}

/// Pearson's correlation of `a` with `b` times √N: about standard normal when they are
/// independent (and one of them is uniform), √N when they are the same.
fn cross_z(a: &[u32], b: &[u32]) -> f64 {
    let n = a.len() as f64;
    let mean = |v: &[u32]| v.iter().map(|&w| centred(w)).sum::<f64>() / n;
    let (ma, mb) = (mean(a), mean(b));
    let (mut sab, mut saa, mut sbb) = (0.0, 0.0, 0.0);
    for (&x, &y) in a.iter().zip(b) {
        let (dx, dy) = (centred(x) - ma, centred(y) - mb);
        sab += dx * dy;
        saa += dx * dx;
        sbb += dy * dy;
    }
    sab / (saa * sbb).sqrt() * n.sqrt()
}

/// Which of the three statistics `words` passes: [bytes, bits, serial].
fn verdict(words: &[u32]) -> ([bool; 3], String) {
    let (chi2, limit) = (byte_chi2(words), chi2_limit(255.0, Z));
    let (bits, serial) = (worst_bit_z(words), serial_z(words));
    (
        [chi2 < limit, bits < Z, serial.abs() < Z],
        format!(
            "byte chi-square {chi2:.1} (bound {limit:.1}), worst bit |z| {bits:.2}, serial z {serial:.2}"
        ),
    )
}

fn assert_uniform(what: &str, words: &[u32]) {
    let (pass, stats) = verdict(words);
    assert_eq!(pass, [true; 3], "{what} does not look uniform: {stats}");
}

fn assert_rejected(what: &str, words: &[u32]) {
    let (pass, stats) = verdict(words);
    assert_eq!(
        pass, [false; 3],
        "every statistic must reject {what}: {stats}"
    );
}

fn protocol(inputs: &[Vec<u32>]) -> Outcome {
    let out = run(inputs, &vec![None; inputs.len()]).unwrap();
    assert_eq!(out.sum, out.expected);
    assert_eq!(out.uploads.len(), inputs.len());
    out
}

/// Every client's delta is all zeros: the plaintexts are zeros and one weight.
fn zeros() -> Vec<Vec<u32>> {
    let q = Quantiser::for_round(1.0, 100, N).unwrap();
    let mut rng = rand_chacha::ChaCha20Rng::seed_from_u64(1);
    (0..N)
        .map(|c| q.encode(&vec![0.0; M], 10 + c as u64, &mut rng))
        .collect()
}

/// Every client's delta is the same slow wave (off-centre: a wave symmetric about 0 would set
/// each bit of its two's-complement words half the time).
fn wave() -> Vec<Vec<u32>> {
    let q = Quantiser::for_round(1.0, 100, N).unwrap();
    let mut rng = rand_chacha::ChaCha20Rng::seed_from_u64(2);
    let delta: Vec<f32> = (0..M)
        .map(|i| 0.3 + (i as f32 * 0.01).sin() * 0.2)
        .collect();
    (0..N)
        .map(|c| q.encode(&delta, 10 + c as u64, &mut rng))
        .collect()
}

#[test]
fn the_bounds_are_the_stated_quantiles() {
    // Chi-square with 255 degrees of freedom: mean 255, standard deviation √510 ≈ 22.6; seven
    // standard normal deviations up is about 447.
    let limit = chi2_limit(255.0, Z);
    assert!((440.0..455.0).contains(&limit), "{limit}");
    // Uniform words pass (a ChaCha20 stream stands in for a mask).
    let mut rng = rand_chacha::ChaCha20Rng::seed_from_u64(9);
    let noise: Vec<u32> = (0..=M).map(|_| rng.next_u32()).collect();
    assert_uniform("a ChaCha20 stream", &noise);
}

#[test]
fn a_masked_upload_of_zeros_looks_uniform_to_the_server() {
    let inputs = zeros();
    assert_rejected("the plaintext of zeros", &inputs[0]);
    let out = protocol(&inputs);
    assert_eq!(out.first_upload, out.uploads[0]);
    assert_eq!(out.first_upload.len(), M + 1);
    assert_uniform("the masked upload of zeros", &out.first_upload);
    // Every other client's upload too.
    for (i, upload) in out.uploads.iter().enumerate().skip(1) {
        assert_uniform(&format!("upload {i}"), upload);
    }
}

#[test]
fn a_masked_upload_is_independent_of_its_plaintext() {
    let inputs = wave();
    assert_rejected("the plaintext wave", &inputs[0]);
    let out = protocol(&inputs);
    let (upload, plain) = (&out.first_upload, &inputs[out.survivors[0]]);
    assert_uniform("the masked upload of a wave", upload);
    // What was added to the plaintext is itself uniform…
    let mask: Vec<u32> = upload
        .iter()
        .zip(plain)
        .map(|(y, x)| y.wrapping_sub(*x))
        .collect();
    assert_uniform("upload − plaintext", &mask);
    // …uncorrelated with it…
    let z = cross_z(upload, plain);
    assert!(
        z.abs() < Z,
        "the upload correlates with its plaintext: z = {z:.2}"
    );
    // …and changes every coordinate (a coincidence has probability 2^-32 per coordinate).
    let same = upload.iter().zip(plain).filter(|(y, x)| y == x).count();
    assert!(same <= 3, "{same} coordinates went through unmasked");
    // The test can tell: a mask that covered only the low 16 bits would leave the upload
    // correlated with the plaintext.
    let leaky: Vec<u32> = plain
        .iter()
        .zip(&mask)
        .map(|(x, r)| x.wrapping_add(r >> 16))
        .collect();
    let z = cross_z(&leaky, plain);
    assert!(z > 100.0, "a leaky mask goes unnoticed: z = {z:.2}");
}

#[test]
fn the_uploads_of_all_but_one_client_sum_to_noise() {
    // The server holds every upload; adding up all but one does not cancel the others' masks
    // (their self-masks stay in, and so do the pairwise masks they share with the one left
    // out), so it says nothing about their sum — nor, subtracted from the total, about the one.
    let inputs = zeros();
    let out = protocol(&inputs);
    for left_out in [0, N / 2, N - 1] {
        let mut partial = vec![0u32; M + 1];
        for (i, upload) in out.uploads.iter().enumerate() {
            if i != left_out {
                partial
                    .iter_mut()
                    .zip(upload)
                    .for_each(|(s, v)| *s = s.wrapping_add(*v));
            }
        }
        assert_uniform(&format!("the sum of all uploads but {left_out}"), &partial);
    }
}
