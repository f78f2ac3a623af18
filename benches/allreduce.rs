//! Ring allreduce bus bandwidth next to torch.distributed's Gloo backend, on this machine, in one
//! run: for world sizes 2 and 4 and buffers of 4, 64 and 256 MiB, both time back-to-back
//! allreduces of f32 buffers between local processes over loopback TCP, and the table shows
//! nccl-tests' bus bandwidth (algbw × 2(n−1)/n) of each and their ratio. Hora's half-precision
//! wire is shown as a separate row (Gloo has no equivalent). The ring's TCP frames are sealed
//! (AES-256-GCM) by default; the TCP-only ring runs both sealed and unsealed (`--unsealed`),
//! and the ratio is the cost of sealing (`RESULT allreduce n=… tcp busbw sealed/unsealed = …`).
//!
//! A last table shows how where the caller's buffer starts (on a page, 16 or 4 bytes past one)
//! changes the bus bandwidth, with pieces copied through shared memory by memcpy (before) and by
//! `kernel::copy` (after), and over TCP (`RESULT allreduce n=2 …MiB shm after busbw offset
//! 16/aligned = …`).
//!
//! `make bench` (it builds `examples/collective` in release first). `HORA_BENCH_RANKS=2,4`,
//! `HORA_BENCH_MIB=4,64,256`, `HORA_BENCH_ALIGN_MIB=64` and `HORA_BENCH_ITERATIONS=5` change the
//! set-up; `HORA_BENCH_RANKS=` (empty) runs the alignment table alone.

#[path = "../tests/support/mod.rs"]
mod support;

use std::process::{Command, Stdio};

use support::{example, free_port};

fn env_list(name: &str, default: &str) -> Vec<usize> {
    std::env::var(name)
        .unwrap_or_else(|_| default.into())
        .split(',')
        .filter_map(|v| v.trim().parse().ok())
        .collect()
}

/// busbw (bytes/s) by buffer size, from JSON lines.
fn parse(stdout: &[u8]) -> Vec<(usize, f64)> {
    String::from_utf8_lossy(stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| Some((v["bytes"].as_u64()? as usize, v["busbw"].as_f64()?)))
        .collect()
}

fn hora(n: usize, sizes: &str, iterations: usize, flags: &[&str]) -> Vec<(usize, f64)> {
    hora_with(n, sizes, iterations, flags, &[])
}

fn hora_with(
    n: usize,
    sizes: &str,
    iterations: usize,
    flags: &[&str],
    env: &[(&str, &str)],
) -> Vec<(usize, f64)> {
    let peers: Vec<String> = (0..n)
        .map(|_| format!("127.0.0.1:{}", free_port()))
        .collect();
    let peers = peers.join(",");
    // The ring's shared secret: fresh for each world.
    let secret = format!("{:032x}", rand::random::<u128>());
    let children: Vec<_> = (0..n)
        .map(|rank| {
            let mut cmd = Command::new(example("collective"));
            cmd.args(["--bench", "--peers", &peers, "--rank", &rank.to_string()])
                .env("HORA_SYNC_SECRET", &secret)
                .args(["--bytes", sizes, "--iterations", &iterations.to_string()])
                .stdout(Stdio::piped())
                .args(flags)
                // Only what this case asks for: an exported switch must not turn every column
                // into one of them.
                .env_remove("HORA_RING_PLAIN_COPY")
                .env_remove("HORA_RING_SHM")
                .envs(env.iter().copied())
                .stderr(Stdio::inherit());
            cmd.spawn()
                .expect("start examples/collective (make bench builds it)")
        })
        .collect();
    let mut outputs: Vec<_> = children
        .into_iter()
        .map(|c| c.wait_with_output().expect("collective worker"))
        .collect();
    assert!(
        outputs.iter().all(|o| o.status.success()),
        "a hora worker failed"
    );
    parse(&outputs.remove(0).stdout)
}

fn gloo(n: usize, sizes: &str, iterations: usize) -> Vec<(usize, f64)> {
    let python = std::env::var("HORA_TORCH_PYTHON").unwrap_or_else(|_| "python3".into());
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/gloo_allreduce.py");
    let out = Command::new(python)
        .args([script, &n.to_string(), sizes, &iterations.to_string(), "2"])
        .arg(free_port().to_string())
        .stderr(Stdio::inherit())
        .output()
        .expect("run the Gloo baseline (PyTorch from scripts/setup-libtorch.sh)");
    assert!(out.status.success(), "the Gloo baseline failed");
    parse(&out.stdout)
}

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let ranks = env_list("HORA_BENCH_RANKS", "2,4");
    let mib = env_list("HORA_BENCH_MIB", "4,64,256");
    let iterations = env_list("HORA_BENCH_ITERATIONS", "5")[0].max(1);
    let sizes = mib
        .iter()
        .map(|m| (m << 20).to_string())
        .collect::<Vec<_>>()
        .join(",");
    println!("allreduce bus bandwidth (GB/s; nccl-tests busbw = algbw × 2(n−1)/n), {iterations} iterations after 2 warm-up, local processes");
    println!("hora: same-host neighbours pass pieces through shared memory (TCP carries headers, credits, failures); hora tcp: everything over loopback TCP, like Gloo, sealed (AES-256-GCM, the default); tcp plain: the same, unsealed (--unsealed); f16: half precision on the wire");
    println!(
        "{:>5} {:>6} {:>8} {:>8} {:>8} {:>10} {:>10} {:>10} {:>12} {:>9}",
        "ranks",
        "MiB",
        "hora",
        "gloo",
        "ratio",
        "hora tcp",
        "tcp/gloo",
        "tcp plain",
        "sealed/plain",
        "hora f16"
    );
    for &n in &ranks {
        let ours = hora(n, &sizes, iterations, &[]);
        // Sealed and unsealed back to back, twice in alternation, the best of each: the
        // machine's noise should not decide the ratio.
        let best = |a: Vec<(usize, f64)>, b: Vec<(usize, f64)>| -> Vec<(usize, f64)> {
            a.iter().zip(&b).map(|(x, y)| (x.0, x.1.max(y.1))).collect()
        };
        let tcp_first = hora(n, &sizes, iterations, &["--tcp-only"]);
        let plain_first = hora(n, &sizes, iterations, &["--tcp-only", "--unsealed"]);
        let plain = best(
            plain_first,
            hora(n, &sizes, iterations, &["--tcp-only", "--unsealed"]),
        );
        let tcp = best(tcp_first, hora(n, &sizes, iterations, &["--tcp-only"]));
        let half = hora(n, &sizes, iterations, &["--fp16"]);
        let theirs = gloo(n, &sizes, iterations);
        let rows = ours
            .len()
            .min(theirs.len())
            .min(tcp.len())
            .min(plain.len())
            .min(half.len());
        for i in 0..rows {
            let (bytes, h) = ours[i];
            let (g, t, p, f) = (theirs[i].1, tcp[i].1, plain[i].1, half[i].1);
            println!(
                "{n:>5} {:>6} {:>8.2} {:>8.2} {:>8.2} {:>10.2} {:>10.2} {:>10.2} {:>12.2} {:>9.2}",
                bytes >> 20,
                h / 1e9,
                g / 1e9,
                h / g,
                t / 1e9,
                t / g,
                p / 1e9,
                t / p,
                f / 1e9
            );
        }
        for i in 0..rows {
            println!(
                "RESULT allreduce n={n} {}MiB busbw hora/gloo = {:.2}",
                ours[i].0 >> 20,
                ours[i].1 / theirs[i].1
            );
            println!(
                "RESULT allreduce n={n} {}MiB tcp busbw sealed/unsealed = {:.2}",
                tcp[i].0 >> 20,
                tcp[i].1 / plain[i].1
            );
        }
    }
    alignment(iterations);
}

/// Where the caller's buffer starts, before and after the alignment-proof copy: 2 ranks, one
/// size (`HORA_BENCH_ALIGN_MIB`, 64), buffers on a page and 16 and 4 bytes past one, pieces
/// copied in and out of shared-memory slots with memcpy (`HORA_RING_PLAIN_COPY=1`, before) or
/// with `kernel::copy` (after), and over TCP (where the kernel copies). Interleaved, three
/// times, the best of each: the machine's noise should not decide the ratio.
fn alignment(iterations: usize) {
    let mib = env_list("HORA_BENCH_ALIGN_MIB", "64")
        .first()
        .copied()
        .unwrap_or(64)
        .max(1);
    let size = (mib << 20).to_string();
    let offsets = ["0", "16", "4"];
    // (name, flags, environment)
    type Case = (
        &'static str,
        &'static [&'static str],
        &'static [(&'static str, &'static str)],
    );
    let cases: [Case; 3] = [
        ("shm before", &[], &[("HORA_RING_PLAIN_COPY", "1")]),
        ("shm after", &[], &[]),
        ("tcp", &["--tcp-only"], &[]),
    ];
    let mut best = vec![[0f64; 3]; offsets.len()];
    for _ in 0..3 {
        for (o, offset) in offsets.iter().enumerate() {
            for (c, (_, flags, env)) in cases.iter().enumerate() {
                let flags: Vec<&str> = flags.iter().copied().chain(["--offset", offset]).collect();
                if let Some(&(_, busbw)) = hora_with(2, &size, iterations, &flags, env).first() {
                    best[o][c] = best[o][c].max(busbw);
                }
            }
        }
    }
    println!();
    println!("buffer alignment: 2 ranks, {mib} MiB, the buffer this many bytes past a page (GB/s busbw; shm before: pieces copied with memcpy, after: with kernel::copy)");
    println!(
        "{:>7} {:>11} {:>10} {:>8}",
        "offset", cases[0].0, cases[1].0, cases[2].0
    );
    for (o, offset) in offsets.iter().enumerate() {
        let [b, a, t] = best[o];
        println!(
            "{offset:>7} {:>11.2} {:>10.2} {:>8.2}",
            b / 1e9,
            a / 1e9,
            t / 1e9
        );
    }
    for (o, offset) in offsets.iter().enumerate().skip(1) {
        for (c, (name, _, _)) in cases.iter().enumerate() {
            println!(
                "RESULT allreduce n=2 {mib}MiB {name} busbw offset {offset}/aligned = {:.2}",
                best[o][c] / best[0][c]
            );
        }
    }
}
