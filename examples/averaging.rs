//! One federated round through hora-common's pipeline, in one process: the server's round key,
//! ten clients that each seal a weight delta bound to task, round, client and base model, and a
//! server side that opens, parses, validates and folds each upload the moment it arrives, then
//! publishes the example-weighted mean. Bad uploads (tampered, replayed into another round, NaN,
//! wrong shape) are refused without disturbing what was already folded.
//!
//! Run it with `make demo` (or `cargo run --release --example averaging`).

use anyhow::{ensure, Context, Result};
use hora_common::envelope::{self, Binding, RoundSecretKey};
use hora_common::kernel::WeightedSum;
use hora_common::model::{Model, ModelDigest, ModelSpec};
use rand::{rngs::StdRng, Rng, SeedableRng};

const TASK: &str = "demo-task";
const ROUND: u64 = 1;

/// The server's side of one upload: open → parse under the task's limits → validate → fold.
fn ingest(
    sum: &mut WeightedSum,
    key: &RoundSecretKey,
    spec: &ModelSpec,
    base: &ModelDigest,
    client: &str,
    examples: u64,
    mut body: Vec<u8>,
) -> Result<()> {
    let binding = Binding {
        task: TASK,
        round: ROUND,
        client,
        base_model: base,
    };
    let plaintext = envelope::open(&mut body, key, &binding)?;
    let delta = Model::from_safetensors(plaintext, &spec.limits())?;
    spec.check(&delta)?;
    delta.check_finite()?;
    sum.add(examples as f64, &delta)?;
    Ok(())
}

fn main() -> Result<()> {
    let mut rng = StdRng::seed_from_u64(2026);
    let global = Model::from_tensors([
        (
            "fc1.weight",
            vec![64, 60],
            (0..64 * 60)
                .map(|_| rng.random_range(-0.1f32..0.1))
                .collect(),
        ),
        ("fc1.bias", vec![64], vec![0.0; 64]),
        (
            "fc2.weight",
            vec![10, 64],
            (0..640).map(|_| rng.random_range(-0.1f32..0.1)).collect(),
        ),
        ("fc2.bias", vec![10], vec![0.0; 10]),
    ])?;
    let spec = global.spec();
    let base = global.digest();
    let round_key = RoundSecretKey::generate()?;
    println!(
        "task {TASK}, round {ROUND}: global model {} ({} parameters)",
        &base.to_hex()[..16],
        spec.numel()
    );

    let mut sum = WeightedSum::new(spec.clone());
    let mut reference = vec![0f64; spec.numel()];
    let mut total_examples = 0u64;
    let mut last_upload = None;
    println!(
        "{:<10} {:>8} {:>12} {:>10}",
        "client", "examples", "sealed bytes", "status"
    );
    for i in 0..10 {
        let client = format!("client-{i:02}");
        let examples = rng.random_range(20..500u64);
        // A client's local training, stood in for by a random step away from the global model.
        let mut delta = Model::zeros(&spec);
        delta
            .data_mut()
            .iter_mut()
            .for_each(|d| *d = rng.random_range(-0.05f32..0.05));
        let binding = Binding {
            task: TASK,
            round: ROUND,
            client: &client,
            base_model: &base,
        };
        let body = envelope::seal(&delta.to_safetensors(), &round_key.public_key(), &binding)?;
        let sealed_len = body.len();
        last_upload = Some((client.clone(), examples, body.clone()));

        ingest(&mut sum, &round_key, &spec, &base, &client, examples, body)?;
        for (r, d) in reference.iter_mut().zip(delta.data()) {
            *r += examples as f64 * f64::from(*d);
        }
        total_examples += examples;
        println!(
            "{client:<10} {examples:>8} {sealed_len:>12} {:>10}",
            "folded"
        );
    }

    // What a hostile or broken client might send: each is refused and the sum is untouched.
    let (client, examples, body) = last_upload.context("no uploads")?;
    let before = sum.clone();
    let mut tampered = body.clone();
    let mid = tampered.len() / 2;
    tampered[mid] ^= 1;
    let mut nan = Model::zeros(&spec);
    nan.data_mut()[7] = f32::NAN;
    let nan_body = envelope::seal(
        &nan.to_safetensors(),
        &round_key.public_key(),
        &Binding {
            task: TASK,
            round: ROUND,
            client: &client,
            base_model: &base,
        },
    )?;
    let small = Model::from_tensors([("fc1.bias", vec![64], vec![0.0; 64])])?;
    let small_body = envelope::seal(
        &small.to_safetensors(),
        &round_key.public_key(),
        &Binding {
            task: TASK,
            round: ROUND,
            client: &client,
            base_model: &base,
        },
    )?;
    let replay_key = RoundSecretKey::generate()?; // the next round's key
    for (what, key, body) in [
        ("tampered byte", &round_key, tampered),
        ("replayed into round 2", &replay_key, body),
        ("NaN value", &round_key, nan_body),
        ("missing tensors", &round_key, small_body),
    ] {
        let err = ingest(&mut sum, key, &spec, &base, &client, examples, body)
            .expect_err("must be refused");
        println!("refused {what:<22} {err}");
    }
    ensure!(sum == before, "a refused upload changed the sum");

    let mean = sum.finish()?;
    let worst = mean
        .data()
        .iter()
        .zip(&reference)
        .map(|(m, r)| (f64::from(*m) - r / total_examples as f64).abs())
        .fold(0.0, f64::max);
    println!(
        "published: mean of {} deltas over {total_examples} examples, digest {}",
        sum.updates(),
        &mean.digest().to_hex()[..16]
    );
    println!("largest difference from an independent f64 computation: {worst:.2e}");
    ensure!(
        worst < 1e-7,
        "averaging differs from the reference by {worst:e}"
    );
    Ok(())
}
