//! The CPU averaging kernel against this machine's memory bandwidth, measured in the same run.
//!
//! `make bench` (or `cargo bench -p hora-common --bench kernel`). Set `HORA_BENCH_PARAMS` to change
//! the model size (default 100,000,000 parameters) and `HORA_BENCH_REPS` the repetitions (best
//! of N is reported).
//!
//! Bytes are counted as STREAM counts them: what the loop reads plus what it writes.
//! - baselines over f64 arrays of the same element count, on the same rayon pool and chunking:
//!   read `Σ a` (8 B/element), write `a = s` (8 B), copy `a = b` (16 B), triad `a = b + s·c`
//!   (24 B), read-modify-write `a += s·b` (24 B); the machine's bandwidth is the best of the five
//!   (the most demanding yardstick for us).
//! - fold `sum += w·update`: f64 sum read and written, f32 update read = 20 B per parameter.
//!
//! Printed: the fold's memory throughput and its ratio to the bandwidth (the design target is
//! ≥ 0.8), and the throughput in update bytes (4 B per parameter; at most 4/20 of memory traffic
//! by construction, since the f64 accumulator must be read and written for every update).

use std::hint::black_box;
use std::time::{Duration, Instant};

use hora_common::kernel::WeightedSum;
use hora_common::model::{DType, Model, ModelSpec, TensorSpec};
use rayon::prelude::*;

const CHUNK: usize = 1 << 15;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Best wall time of `reps` runs of `f`.
fn best_of(reps: usize, mut f: impl FnMut()) -> Duration {
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .min()
        .expect("reps > 0")
}

fn gbps(bytes: f64, t: Duration) -> f64 {
    bytes / t.as_secs_f64() / 1e9
}

fn main() {
    // `cargo bench` passes `--bench`; under `cargo test`/nextest this binary is a test list with
    // nothing in it.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let n = env_usize("HORA_BENCH_PARAMS", 100_000_000);
    let reps = env_usize("HORA_BENCH_REPS", 5).max(1);
    let threads = rayon::current_num_threads();
    println!(
        "averaging kernel: {n} parameters ({:.0} MB of f32), {threads} threads, best of {reps}",
        n as f64 * 4e-6
    );

    // A model split into a few tensors, like a real network (the kernel sees one flat buffer).
    let sizes = [n / 2, n / 4, n / 8, n - n / 2 - n / 4 - n / 8];
    let spec = ModelSpec::new(
        sizes
            .iter()
            .enumerate()
            .map(|(i, &len)| TensorSpec {
                name: format!("layer{i}.weight"),
                shape: vec![len],
                dtype: DType::F32,
            })
            .collect(),
    )
    .expect("valid spec");

    // Touch every page before timing anything.
    let mut a: Vec<f64> = (0..n).into_par_iter().map(|i| i as f64).collect();
    let b: Vec<f64> = (0..n).into_par_iter().map(|i| (i % 7) as f64).collect();
    let c: Vec<f64> = (0..n).into_par_iter().map(|i| (i % 5) as f64).collect();
    let s = black_box(0.5f64);

    let read = best_of(reps, || {
        // Eight independent partial sums so the loop vectorises and is not latency-bound.
        let total: f64 = a
            .par_chunks(CHUNK)
            .map(|c| {
                let mut lanes = [0.0f64; 8];
                let mut blocks = c.chunks_exact(8);
                for x in &mut blocks {
                    lanes.iter_mut().zip(x).for_each(|(l, v)| *l += v);
                }
                lanes.iter().sum::<f64>() + blocks.remainder().iter().sum::<f64>()
            })
            .sum();
        black_box(total);
    });
    let write = best_of(reps, || {
        a.par_chunks_mut(CHUNK).for_each(|a| a.fill(s));
        black_box(&a);
    });
    let copy = best_of(reps, || {
        a.par_chunks_mut(CHUNK)
            .zip(b.par_chunks(CHUNK))
            .for_each(|(a, b)| a.copy_from_slice(b));
        black_box(&a);
    });
    let triad = best_of(reps, || {
        a.par_chunks_mut(CHUNK)
            .zip(b.par_chunks(CHUNK).zip(c.par_chunks(CHUNK)))
            .for_each(|(a, (b, c))| {
                a.iter_mut()
                    .zip(b.iter().zip(c))
                    .for_each(|(a, (b, c))| *a = b + s * c)
            });
        black_box(&a);
    });
    let rmw = best_of(reps, || {
        a.par_chunks_mut(CHUNK)
            .zip(b.par_chunks(CHUNK))
            .for_each(|(a, b)| a.iter_mut().zip(b).for_each(|(a, b)| *a += s * b));
        black_box(&a);
    });
    drop((a, b, c));

    let nf = n as f64;
    let baselines = [
        ("read", gbps(8.0 * nf, read)),
        ("write", gbps(8.0 * nf, write)),
        ("copy", gbps(16.0 * nf, copy)),
        ("triad", gbps(24.0 * nf, triad)),
        ("a += s*b", gbps(24.0 * nf, rmw)),
    ];
    let bandwidth = baselines.iter().map(|b| b.1).fold(0.0, f64::max);
    for (name, bw) in baselines {
        println!("  memory bandwidth, {name:<9} {bw:7.2} GB/s");
    }

    let update = Model::from_flat(
        &spec,
        (0..n)
            .into_par_iter()
            .map(|i| ((i % 1000) as f32) * 1e-3)
            .collect(),
    )
    .expect("flat buffer matches the spec");
    let mut sum = WeightedSum::new(spec);
    sum.add(1.0, &update).expect("fold"); // first touch of the accumulator
    let fold = best_of(reps, || {
        sum.add(black_box(3.0), &update).expect("fold");
    });
    black_box(sum.finish().expect("finish"));

    let traffic = gbps(20.0 * nf, fold);
    let update_bytes = gbps(4.0 * nf, fold);
    println!(
        "  fold sum += w*update  {:7.2} GB/s memory traffic ({:.1} ms per update of {:.0} MB)",
        traffic,
        fold.as_secs_f64() * 1e3,
        nf * 4e-6
    );
    println!(
        "  fold, update bytes    {update_bytes:7.2} GB/s ({:.1} updates/s)",
        1.0 / fold.as_secs_f64()
    );
    let ratio = traffic / bandwidth;
    println!(
        "RESULT kernel fold / memory bandwidth = {ratio:.2} (target >= 0.80: {})",
        if ratio >= 0.8 { "met" } else { "NOT met" }
    );
}
