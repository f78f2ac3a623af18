//! One worker of a collective check or benchmark: start N of these (one per rank) with the same
//! `--peers`, and each runs allreduce, broadcast and allgather over the ring and either checks
//! the results or times them.
//!
//! - `--check` (what `tests/sync.rs` runs): for every `--elements` size, every rank's buffer is
//!   a deterministic function of its rank, so each worker computes the exact element-wise mean of
//!   all ranks itself and compares the allreduce with it; the broadcast must equal the root's
//!   buffer, the allgather every rank's name. Exit status 1 on any difference.
//! - `--bench` (what `benches/allreduce.rs` runs): times `--iterations` back-to-back allreduces of
//!   each `--bytes` size and rank 0 prints one JSON line per size with the algorithm and bus
//!   bandwidth (nccl-tests: algbw = bytes / time, busbw = algbw × 2(n−1)/n).
//!
//! Ranks come from `--rank` or a launcher's environment (mpirun, Slurm), like `hora-client sync`;
//! every worker needs the same secret (`HORA_SYNC_SECRET` or `--session-secret`).

use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use hora_collective::{form_world, CommOptions, Communicator, LaunchRank, Meeting, Reduce, Wire};

#[derive(Parser)]
struct Args {
    /// Ring addresses by rank, `host:port,…`.
    #[arg(long, value_delimiter = ',', required = true)]
    peers: Vec<String>,
    /// The secret every worker shares (16 characters at least).
    #[arg(long, env = "HORA_SYNC_SECRET", hide_env_values = true)]
    session_secret: Option<String>,
    #[arg(long)]
    rank: Option<u32>,
    /// Check results (sizes in elements).
    #[arg(long, conflicts_with = "bench")]
    check: bool,
    #[arg(long, value_delimiter = ',', default_value = "1,7,1000,4099")]
    elements: Vec<usize>,
    /// Time allreduces (sizes in bytes).
    #[arg(long)]
    bench: bool,
    #[arg(long, value_delimiter = ',', default_value = "4194304")]
    bytes: Vec<usize>,
    #[arg(long, default_value_t = 5)]
    iterations: u32,
    #[arg(long, default_value_t = 2)]
    warmup: u32,
    /// Where the buffer starts: this many bytes past a page boundary (a multiple of 4; the
    /// default 0 is page-aligned). Buffers that numpy, Python's allocator or malloc hand out
    /// start 16 or 32 bytes past one.
    #[arg(long, default_value_t = 0)]
    offset: usize,
    /// Half precision on the wire.
    #[arg(long)]
    fp16: bool,
    #[arg(long, default_value_t = 256)]
    sub_chunk_kib: usize,
    /// TCP only, even between workers on this host (no shared-memory slots).
    #[arg(long)]
    tcp_only: bool,
    /// Frames unsealed (no AES-256-GCM after the handshake), as `--ring-unsealed`.
    #[arg(long)]
    unsealed: bool,
    /// Seconds a silent neighbour is given.
    #[arg(long, default_value_t = 30)]
    timeout: u64,
    /// This rank passes one element more than the others in its first allreduce (a test of
    /// the mismatch error).
    #[arg(long)]
    mismatch_rank: Option<u32>,
}

fn value(rank: u32, i: usize) -> f32 {
    ((i * 7 + rank as usize * 13) % 101) as f32 * 0.25 - rank as f32
}

fn data(rank: u32, len: usize) -> Vec<f32> {
    (0..len).map(|i| value(rank, i)).collect()
}

fn check(comm: &mut Communicator, args: &Args) -> Result<()> {
    let (rank, n) = (comm.rank(), comm.size());
    let tolerance = if args.fp16 { 2e-3 } else { 1e-6 };
    for (k, &len) in args.elements.iter().enumerate() {
        let mut buf = data(rank, len);
        if args.mismatch_rank == Some(rank) && k == 0 {
            buf.push(0.0);
        }
        comm.allreduce(&mut buf[..], Reduce::Average, 0)?;
        let mut worst = 0f64;
        for (i, got) in buf.iter().enumerate() {
            let want = (0..n).map(|r| f64::from(value(r, i))).sum::<f64>() / f64::from(n);
            let err = (f64::from(*got) - want).abs() / want.abs().max(1.0);
            if err.is_nan() || err > tolerance {
                bail!("allreduce of {len} elements on {n} ranks: element {i} is {got}, the mean is {want}");
            }
            worst = worst.max(err);
        }
        let root = (k as u32) % n;
        let mut own = data(rank, len);
        comm.broadcast(&mut own[..], root, 0)?;
        if own != data(root, len) {
            bail!("broadcast of {len} elements from rank {root}: rank {rank} holds other values");
        }
        let names = comm.allgather(format!("rank {rank}").as_bytes())?;
        let expected: Vec<Vec<u8>> = (0..n).map(|r| format!("rank {r}").into_bytes()).collect();
        if names != expected {
            bail!("allgather on rank {rank} returned {names:?}");
        }
        println!("ok elements={len} ranks={n} max_relative_error={worst:.2e}");
    }
    Ok(())
}

fn bench(comm: &mut Communicator, args: &Args) -> Result<()> {
    let n = comm.size();
    if args.offset % 4 != 0 {
        bail!(
            "--offset {} is not a multiple of 4 (an f32's size)",
            args.offset
        );
    }
    for &bytes in &args.bytes {
        let mut backing = data(comm.rank(), bytes / 4 + 2048);
        let page = (4096 - backing.as_ptr() as usize % 4096) % 4096;
        let at = (page + args.offset % 4096) / 4;
        let buf = &mut backing[at..at + bytes / 4];
        for _ in 0..args.warmup {
            comm.allreduce(&mut *buf, Reduce::Sum, 0)?;
        }
        // Start together: a one-element allreduce is a barrier.
        comm.allreduce(&mut [0f32][..], Reduce::Sum, 1)?;
        let start = Instant::now();
        for _ in 0..args.iterations {
            comm.allreduce(&mut *buf, Reduce::Average, 0)?;
        }
        comm.allreduce(&mut [0f32][..], Reduce::Sum, 1)?;
        let seconds = start.elapsed().as_secs_f64() / f64::from(args.iterations);
        if comm.rank() == 0 {
            let algbw = bytes as f64 / seconds;
            let busbw = algbw * 2.0 * f64::from(n - 1) / f64::from(n);
            println!(
                "{}",
                serde_json::json!({"ranks": n, "bytes": bytes, "seconds": seconds, "algbw": algbw, "busbw": busbw, "fp16": args.fp16, "tcp_only": args.tcp_only, "sealed": !args.unsealed, "offset": args.offset})
            );
        }
    }
    Ok(())
}

fn run(args: &Args) -> Result<()> {
    let launch = LaunchRank::detect(args.rank, None, |k| std::env::var(k).ok())?;
    let options = CommOptions {
        sub_chunk_bytes: args.sub_chunk_kib.max(1) << 10,
        wire: if args.fp16 { Wire::F16 } else { Wire::F32 },
        timeout: Duration::from_secs(args.timeout.clamp(1, 86_400)),
        shared_memory: !args.tcp_only,
        seal_frames: !args.unsealed,
    };
    let mut comm = form_world(
        Meeting::Peers {
            peers: args.peers.clone(),
            secret: args.session_secret.clone(),
        },
        &launch,
        "",
        None,
        options,
    )
    .context("forming the world")?;
    if args.bench {
        bench(&mut comm, args)
    } else if args.check {
        check(&mut comm, args)
    } else {
        bail!("give --check or --bench")
    }
}

fn main() -> ExitCode {
    use hora_common::logging::{init, LogFormat};
    init(LogFormat::from_env(), "warn");
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
