//! An elastic sync job's two costs, in one run of real processes on loopback: what a commit
//! costs a worker (the in-memory copy of the parameters and optimizer state, rank 0's question
//! to the server, the ranks' agreement) next to what a training step costs, and how long the
//! survivors take from a worker's SIGKILL to training again (detection, rollback, the server's
//! quiet time, the new ring's handshake and rank 0's broadcast; target < 5 s).
//!
//! Four `hora-client sync --elastic` workers (an MLP of 60-256-256-10 on 4,000 synthetic samples,
//! batch 32 each, a commit every 20 steps) in a job of three to four with the default quiet time
//! (1 s); rank 2 of the first world is killed when rank 0 reports its third epoch.
//!
//! `cargo build --release -p hora-server -p hora-client --bins && cargo bench -p hora --bench elastic`

#[path = "../tests/support/mod.rs"]
mod support;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Instant;

use support::*;

const WORKERS: usize = 4;
const COMMIT_EVERY: u64 = 20;

fn main() {
    // `cargo test` and nextest list and run bench targets without `--bench`: nothing to do then.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let dir = tempfile::tempdir().expect("a temporary directory");
    let server = Server::start_with(&dir.path().join("server"), &[]);
    let api = server.api(ADMIN_TOKEN);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let job = runtime.block_on(api.create_sync_job(&hora_common::wire::CreateSyncJob {
        id: "bench".into(),
        world_size: WORKERS as u32,
        min_world_size: Some(3),
        settle_ms: None,
    }));
    let token = job.token.expect("the job's token");
    let args: Vec<String> = [
        "sync",
        "--elastic",
        "--commit-every",
        &COMMIT_EVERY.to_string(),
        "--server",
        &server.url,
        "--ca",
        &server.ca.display().to_string(),
        "--job",
        "bench",
        "--token",
        &token,
        "--world-size",
        &WORKERS.to_string(),
        "--timeout",
        "10",
        "--model",
        "mlp",
        "--params",
        r#"{"inputs":60,"hidden":[256,256],"classes":10}"#,
        "--data",
        "synthetic-iid:clients=1,seed=3,min_samples=4000,max_samples=4000",
        "--epochs",
        "8",
        "--batch-size",
        "32",
        "--threads",
        "1",
        "--no-progress",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let (send, lines) = mpsc::channel::<(usize, String, Instant)>();
    let mut workers: Vec<Option<Child>> = (0..WORKERS)
        .map(|i| {
            let mut child = Command::new(binary("hora-client"))
                .args(&args)
                .env("HORA_LOG", "warn")
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()
                .expect("start a worker");
            let stdout = child.stdout.take().expect("its stdout");
            let send = send.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                    let _ = send.send((i, line, Instant::now()));
                }
            });
            Some(child)
        })
        .collect();
    drop(send);

    let mut victim = None;
    let mut killed_at = None;
    let mut back = Vec::new();
    let mut commits = Vec::new();
    let mut epochs = Vec::new();
    for (i, line, at) in lines.iter() {
        if line.starts_with("world 1: rank 2 of 4 ") {
            victim = Some(i);
        }
        if line.starts_with("epoch ") && killed_at.is_none() {
            epochs.push(line.clone());
        }
        if line.starts_with("epoch 3/") && killed_at.is_none() {
            if let Some(mut child) = victim.and_then(|v| workers[v].take()) {
                child.kill().expect("kill rank 2");
                let _ = child.wait();
                killed_at = Some(Instant::now());
            }
        }
        if line.starts_with("world 2: ") {
            let total = killed_at.map(|k| at.duration_since(k));
            back.push((line.clone(), total));
        }
        if line.contains(" commits, ") {
            commits.push(line.clone());
        }
    }
    for child in workers.iter_mut().flatten() {
        let _ = child.wait();
    }

    // A step's time in the first world, from rank 0's epoch lines (epoch seconds / its steps).
    let steps_per_epoch = 4000.0 * 0.8 / (WORKERS as f64 * 32.0);
    let step_ms: Vec<f64> = epochs
        .iter()
        .filter_map(|l| {
            l.rsplit(" · ")
                .next()?
                .trim_end_matches(" s")
                .parse::<f64>()
                .ok()
        })
        .map(|s| s * 1e3 / steps_per_epoch.floor())
        .collect();
    let commit_ms: Vec<f64> = commits
        .iter()
        .filter_map(|l| l.split(", ").nth(1)?.split(" ms").next()?.parse().ok())
        .collect();
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    println!("elastic job: {WORKERS} workers, a commit every {COMMIT_EVERY} steps, quiet time 1 s");
    for (line, total) in &back {
        println!(
            "  {line}  [{:.0} ms after the SIGKILL]",
            total.map_or(f64::NAN, |d| d.as_secs_f64() * 1e3)
        );
    }
    for line in &commits {
        println!("  {line}");
    }
    let recovery = back
        .iter()
        .filter_map(|(_, t)| *t)
        .max()
        .map_or(f64::NAN, |d| d.as_secs_f64());
    println!(
        "RESULT elastic commit = {:.2} ms (a step {:.2} ms: {:.1}% of {COMMIT_EVERY} steps)",
        mean(&commit_ms),
        mean(&step_ms),
        100.0 * mean(&commit_ms) / (mean(&step_ms) * COMMIT_EVERY as f64)
    );
    println!(
        "RESULT elastic recovery = {recovery:.2} s from SIGKILL to training again (target < 5 s)"
    );
}
