//! Sealed-envelope throughput: seal and open (decrypt + verify) in GB/s of plaintext, next to a
//! plain memory copy of the same buffer measured in the same run.
//!
//! `make bench` (or `cargo bench -p hora-common --bench envelope`). `HORA_BENCH_ENVELOPE_MB` sets
//! the payload size (default 400 MB: the delta of a 100M-parameter f32 model).

use std::hint::black_box;
use std::time::{Duration, Instant};

use hora_common::envelope::{self, Binding, RoundSecretKey};
use hora_common::model::ModelDigest;

fn best_of(reps: usize, mut f: impl FnMut() -> Duration) -> Duration {
    (0..reps).map(|_| f()).min().expect("reps > 0")
}

fn main() {
    // Only under `cargo bench` (which passes `--bench`); under the test runners this is a no-op.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let mb: usize = std::env::var("HORA_BENCH_ENVELOPE_MB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(400);
    let reps = 5;
    let len = mb * 1_000_000;
    let plaintext: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
    let key = RoundSecretKey::generate().expect("rng");
    let digest = ModelDigest([3; 32]);
    let binding = Binding {
        task: "bench",
        round: 1,
        client: "client-0001",
        base_model: &digest,
    };
    println!("envelope: {mb} MB payload, best of {reps}");

    let mut scratch = vec![0u8; len];
    let copy = best_of(reps, || {
        let t = Instant::now();
        scratch.copy_from_slice(black_box(&plaintext));
        black_box(&scratch);
        t.elapsed()
    });
    let sealed = envelope::seal(&plaintext, &key.public_key(), &binding).expect("seal");
    let seal = best_of(reps, || {
        let t = Instant::now();
        black_box(envelope::seal(&plaintext, &key.public_key(), &binding).expect("seal"));
        t.elapsed()
    });
    let open = best_of(reps, || {
        let mut buf = sealed.clone(); // not timed: the server opens the body it received in place
        let t = Instant::now();
        let opened = envelope::open(&mut buf, &key, &binding).expect("open");
        black_box(opened.len());
        t.elapsed()
    });

    let gbps = |t: Duration| len as f64 / t.as_secs_f64() / 1e9;
    println!("  memcpy (baseline)   {:7.2} GB/s", gbps(copy));
    println!(
        "  seal                {:7.2} GB/s (includes copying the plaintext into the envelope)",
        gbps(seal)
    );
    println!("  open (in place)     {:7.2} GB/s", gbps(open));
    println!(
        "RESULT envelope open = {:.2} GB/s, {:.2}x of memcpy",
        gbps(open),
        gbps(open) / gbps(copy)
    );
}
