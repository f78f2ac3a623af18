//! Upload-path ingest throughput — open the envelope, parse and validate the delta, fold it —
//! against the kernel's fold alone, measured in the same run, for 1M- and 25M-parameter models.
//!
//! `make bench` (or `cargo bench -p hora-server --bench ingest`). Throughput is in GB/s of
//! sealed update bytes (what arrives over the wire, about 4 bytes per parameter); then the same
//! update compressed (int8, and top-1% in int8), its ingest time next to float32's.

use std::hint::black_box;
use std::time::{Duration, Instant};

use hora_common::codec::{Compression, ValueCodec};
use hora_common::envelope::{self, Binding, RoundSecretKey};
use hora_common::kernel::WeightedSum;
use hora_common::model::{DType, Model, ModelDigest, ModelSpec, TensorSpec};
use hora_server::round::open_update;
use rand_chacha::rand_core::SeedableRng;
use rand_chacha::ChaCha8Rng;

fn spec(params: usize) -> ModelSpec {
    // A few tensors, like a real network.
    let sizes = [
        params / 2,
        params / 4,
        params / 8,
        params - params / 2 - params / 4 - params / 8,
    ];
    ModelSpec::new(
        sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| TensorSpec {
                name: format!("layer{i}.weight"),
                shape: vec![n],
                dtype: DType::F32,
            })
            .collect(),
    )
    .expect("valid spec")
}

fn best_of(reps: usize, mut f: impl FnMut() -> Duration) -> Duration {
    (0..reps).map(|_| f()).min().expect("reps > 0")
}

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        return; // under the test runners: nothing to run
    }
    let reps = 5;
    println!(
        "upload-path ingest (open + validate + fold) vs fold alone, best of {reps}, {} threads",
        rayon::current_num_threads()
    );
    for params in [1_000_000usize, 25_000_000] {
        let spec = spec(params);
        let mut delta = Model::zeros(&spec);
        delta
            .data_mut()
            .iter_mut()
            .enumerate()
            .for_each(|(i, v)| *v = ((i % 997) as f32 - 498.0) * 1e-4);
        let key = RoundSecretKey::generate().expect("rng");
        let digest = ModelDigest([1; 32]);
        let binding = Binding {
            task: "bench",
            round: 1,
            client: "c-0001",
            base_model: &digest,
        };
        let sealed =
            envelope::seal(&delta.to_safetensors(), &key.public_key(), &binding).expect("seal");
        let mut sum = WeightedSum::new(spec.clone());

        let ingest = best_of(reps, || {
            let mut body = sealed.clone(); // the server receives a fresh body; not timed
            let t = Instant::now();
            let view = open_update(&mut body, &key, &binding, &spec, None).expect("valid update");
            sum.add_update_scaled(10.0, 1.0, &view).expect("fold");
            t.elapsed()
        });
        let mut body = sealed.clone();
        let view = open_update(&mut body, &key, &binding, &spec, None).expect("valid update");
        let fold = best_of(reps, || {
            let t = Instant::now();
            sum.add_update_scaled(10.0, 1.0, &view).expect("fold");
            t.elapsed()
        });
        black_box(sum.sum()[0]);
        let gbps = |t: Duration| sealed.len() as f64 / t.as_secs_f64() / 1e9;
        println!(
            "  {:>4}M params ({:>4.0} MB sealed): ingest {:6.2} GB/s ({:7.1} ms)   fold alone {:6.2} GB/s ({:7.1} ms)   ingest/fold = {:.2}",
            params / 1_000_000,
            sealed.len() as f64 / 1e6,
            gbps(ingest),
            ingest.as_secs_f64() * 1e3,
            gbps(fold),
            fold.as_secs_f64() * 1e3,
            fold.as_secs_f64() / ingest.as_secs_f64()
        );
        // The same update compressed: the server decodes it inside the fold.
        for (label, compression) in [("int8", None), ("top-1% int8", Some(0.01))] {
            let compression = Compression {
                values: ValueCodec::Int8,
                block_size: 256,
                top_k: compression,
            };
            let bytes = compression
                .encode(&mut delta.clone(), &mut ChaCha8Rng::seed_from_u64(1))
                .expect("encode");
            let sealed_small = envelope::seal(&bytes, &key.public_key(), &binding).expect("seal");
            let time = best_of(reps, || {
                let mut body = sealed_small.clone();
                let t = Instant::now();
                let view = open_update(&mut body, &key, &binding, &spec, Some(&compression))
                    .expect("valid update");
                sum.add_update_scaled(10.0, 1.0, &view).expect("fold");
                t.elapsed()
            });
            println!(
                "        {label:<12} ({:>6.1} MB sealed): ingest {:7.1} ms = {:.2}x float32's ingest time",
                sealed_small.len() as f64 / 1e6,
                time.as_secs_f64() * 1e3,
                time.as_secs_f64() / ingest.as_secs_f64()
            );
        }
    }
}
