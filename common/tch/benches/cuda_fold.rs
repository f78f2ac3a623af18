//! The averaging kernel on a GPU: how close its fold (`sum += weight × update`, one fused
//! `addcmul_`) comes to the GPU's memory bandwidth, measured in the same run as a
//! device-to-device copy of the same tensor (what the memory can do at all).
//!
//! A fold of n f32 values into an f32 sum reads the sum and the update and writes the sum:
//! 12n bytes; into the f64 sum the federated server-side kernel keeps, 20n. A copy moves 8n.
//! Throughput is bytes moved per second; the ratio fold/copy is the figure (target ≥ 0.8).
//!
//! `cargo bench -p hora-common-tch --bench cuda_fold` (`make bench-gpu` runs it with the GPU
//! allreduce benchmark). Without a CUDA device it says so and measures nothing.

use std::time::Instant;

use hora_common::model::{DType, ModelSpec, TensorSpec};
use hora_common_tch::TchWeightedSum;
use tch::{Cuda, Device, Kind, Tensor};

const WARMUP: usize = 3;
const ITERATIONS: usize = 20;

fn seconds(device: usize, mut f: impl FnMut()) -> f64 {
    for _ in 0..WARMUP {
        f();
    }
    Cuda::synchronize(device as i64);
    let started = Instant::now();
    for _ in 0..ITERATIONS {
        f();
    }
    Cuda::synchronize(device as i64);
    started.elapsed().as_secs_f64() / ITERATIONS as f64
}

fn main() {
    // `cargo bench` passes `--bench`; under `cargo test`/nextest this binary is a test list with
    // nothing in it.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    if !Cuda::is_available() {
        println!(
            "cuda_fold: skipped: no CUDA device is visible (Cuda::device_count() = {}); run it on a machine with one",
            Cuda::device_count()
        );
        return;
    }
    let index = 0;
    let device = Device::Cuda(index);
    println!("averaging kernel on cuda:{index}: fold (sum += w × update) vs a device-to-device copy, GB/s of memory traffic");
    println!(
        "  {:>6} {:>5} {:>9} {:>9} {:>10}",
        "MiB", "sum", "fold", "copy", "fold/copy"
    );
    for mib in [64usize, 256, 1024] {
        let n = (mib << 20) / 4;
        let spec = ModelSpec::new(vec![TensorSpec {
            name: "w".into(),
            shape: vec![n],
            dtype: DType::F32,
        }])
        .expect("a one-tensor spec");
        let update = Tensor::rand([n as i64], (Kind::Float, device));
        let mut copy = Tensor::empty([n as i64], (Kind::Float, device));
        let copy_s = seconds(index, || {
            copy.copy_(&update);
        });
        let copy_gbs = 8.0 * n as f64 / copy_s / 1e9;
        for (kind, width) in [(Kind::Float, 4.0), (Kind::Double, 8.0)] {
            let mut sum =
                TchWeightedSum::with_kind(spec.clone(), device, kind).expect("a sum on the GPU");
            let fold_s = seconds(index, || sum.add(0.5, &update).expect("a fold"));
            let fold_gbs = (4.0 + 2.0 * width) * n as f64 / fold_s / 1e9;
            let name = if width == 4.0 { "f32" } else { "f64" };
            println!(
                "  {mib:>6} {name:>5} {fold_gbs:>9.1} {copy_gbs:>9.1} {:>10.2}",
                fold_gbs / copy_gbs
            );
            println!(
                "RESULT cuda_fold {mib}MiB {name} sum: fold {fold_gbs:.1} GB/s, copy {copy_gbs:.1} GB/s, fold/copy = {:.2}",
                fold_gbs / copy_gbs
            );
        }
    }
}
