//! MNIST-shaped data for the benchmarks: this machine cannot download MNIST.

use std::path::Path;

use rand::{Rng, SeedableRng};

/// Writes MNIST-shaped IDX files (`train-*`, `t10k-*`) into `dir`, `train` training images and a
/// sixth as many held out: each image its class's random 28×28 pattern, dimmed to leave room
/// for up to `noise` of uniform noise (the larger, the harder to tell the classes apart).
pub fn write(dir: &Path, train: usize, noise: u8) {
    std::fs::create_dir_all(dir).expect("mnist dir");
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    let patterns: Vec<Vec<u8>> = (0..10)
        .map(|_| (0..784).map(|_| rng.random_range(0..=255u8)).collect())
        .collect();
    let signal = |p: u8| (u16::from(p) * u16::from(255 - noise) / 255) as u8;
    let mut write = |prefix: &str, n: usize| {
        let labels: Vec<u8> = (0..n).map(|i| (i % 10) as u8).collect();
        let mut images = vec![0, 0, 0x08, 3];
        for d in [n as u32, 28, 28] {
            images.extend_from_slice(&d.to_be_bytes());
        }
        for &l in &labels {
            images.extend(
                patterns[l as usize]
                    .iter()
                    .map(|&p| signal(p) + rng.random_range(0..=noise)),
            );
        }
        let mut idx_labels = vec![0, 0, 0x08, 1];
        idx_labels.extend_from_slice(&(n as u32).to_be_bytes());
        idx_labels.extend_from_slice(&labels);
        std::fs::write(dir.join(format!("{prefix}-images-idx3-ubyte")), images).expect("images");
        std::fs::write(dir.join(format!("{prefix}-labels-idx1-ubyte")), idx_labels)
            .expect("labels");
    };
    write("train", train);
    write("t10k", (train / 6).max(10));
}
