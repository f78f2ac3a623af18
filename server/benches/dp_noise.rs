//! Central DP's noise on 1M and 10M coordinates: the server's discrete Gaussian on a grid (exact
//! integer sampling, the sum rounded to the grid) against the continuous sampler it replaced
//! (rand_distr's `StandardNormal`, a ziggurat on f64, kept here only as the baseline), both on
//! the same ChaCha20 streams stretch by stretch, on one thread and on all of them, measured in
//! the same run.
//!
//! `make bench` (or `cargo bench -p hora-server --bench dp_noise`).

use std::hint::black_box;
use std::time::{Duration, Instant};

use hora_server::dp::noise::{add_gaussian_noise_seeded, STRETCH};
use rand::SeedableRng;
use rand_chacha::ChaCha20Rng;
use rand_distr::{Distribution, StandardNormal};
use rayon::prelude::*;

/// The baseline: what the server did before the discrete sampler (floating-point noise, open
/// to floating-point attacks).
fn continuous_noise(values: &mut [f64], stddev: f64, seed: &[u8; 32]) {
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

/// The fastest of `reps` runs of `noise` on a fresh copy of `sum` (the copy is not timed).
fn best_of(reps: usize, sum: &[f64], mut noise: impl FnMut(&mut [f64])) -> Duration {
    let mut values = sum.to_vec();
    (0..reps)
        .map(|_| {
            values.copy_from_slice(sum);
            let t = Instant::now();
            noise(&mut values);
            let elapsed = t.elapsed();
            black_box(&values);
            elapsed
        })
        .min()
        .expect("reps > 0")
}

fn main() {
    // `cargo test`/`nextest` list and run bench targets without `--bench`: nothing to do then.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let reps = 3;
    let (clip, multiplier) = (0.1, 1.0);
    let stddev = clip * multiplier;
    let seed = [42u8; 32];
    let all = rayon::current_num_threads();
    let mut pools = vec![(1, rayon::ThreadPoolBuilder::new().num_threads(1).build())];
    if all > 1 {
        pools.push((
            all,
            rayon::ThreadPoolBuilder::new().num_threads(all).build(),
        ));
    }
    println!(
        "DP noise, discrete Gaussian on a grid (the server's) vs continuous ziggurat (the old sampler), best of {reps}, noise {stddev} on a clip of {clip}"
    );
    for n in [1_000_000usize, 10_000_000] {
        // A sum with arbitrary low bits, as a real one has.
        let sum: Vec<f64> = (0..n).map(|i| (i as f64 * 0.618_034).sin() * 0.3).collect();
        for (threads, pool) in &pools {
            let pool = pool.as_ref().expect("thread pool");
            let discrete = best_of(reps, &sum, |values| {
                pool.install(|| add_gaussian_noise_seeded(values, stddev, clip, &seed))
                    .expect("grid");
            });
            let continuous = best_of(reps, &sum, |values| {
                pool.install(|| continuous_noise(values, stddev, &seed));
            });
            let per = |d: Duration| d.as_secs_f64() * 1e9 / n as f64;
            println!(
                "{:>4}M coordinates, {threads:>2} thread{}: discrete {:>7.3} s ({:>5.1} ns/coordinate), continuous {:>7.3} s ({:>4.1} ns/coordinate), ratio {:.1}x",
                n / 1_000_000,
                if *threads == 1 { " " } else { "s" },
                discrete.as_secs_f64(),
                per(discrete),
                continuous.as_secs_f64(),
                per(continuous),
                discrete.as_secs_f64() / continuous.as_secs_f64(),
            );
        }
    }
}
