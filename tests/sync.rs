//! The synchronous allreduce mode with real processes on loopback: collectives across 1–4
//! worker processes for buffers from one element to 64 MiB, mismatched calls, training that
//! matches one worker on the combined batch, a killed worker, ranks from mpirun's and Slurm's
//! environment, rendezvous at the real server, a job resumed from rank 0's checkpoint,
//! strangers at a worker's ring port that learn nothing and hold nothing up, workers that
//! `hora-run` starts, and an elastic job that survives a killed worker, takes in a new one with
//! rank 0's exact state, and fails naming the lost ranks below its minimum.

mod support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use hora_common::model::{Limits, Model};
use support::*;

/// Worker processes, killed by their own ids if a test fails before they exit.
struct Workers(Vec<Child>);

impl Workers {
    /// Waits for every worker, at most `limit`; a worker still running then is a hang.
    fn finish(mut self, limit: Duration) -> Vec<Output> {
        let deadline = Instant::now() + limit;
        while self
            .0
            .iter_mut()
            .any(|c| c.try_wait().ok().flatten().is_none())
        {
            assert!(
                Instant::now() < deadline,
                "workers still running after {limit:?}: a collective hung"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        std::mem::take(&mut self.0)
            .into_iter()
            .map(|c| c.wait_with_output().expect("collect worker output"))
            .collect()
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The ring's shared secret of every `--peers` world here (unused at the server).
const SECRET: &str = "a secret the workers share, 32ch";

fn spawn(program: &Path, args: &[String], env: &[(&str, String)]) -> Child {
    let mut cmd = Command::new(program);
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .env("HORA_LOG", "warn")
        .env("HORA_SYNC_SECRET", SECRET);
    without_launchers(&mut cmd);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.spawn().expect("start a worker")
}

/// A worker (or launcher) must not pick its rank up from the environment this test runs in.
fn without_launchers(cmd: &mut Command) {
    for var in [
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "SLURM_PROCID",
        "SLURM_NTASKS",
        "PMI_RANK",
        "PMI_SIZE",
        "RANK",
        "WORLD_SIZE",
        "TORCHELASTIC_RUN_ID",
    ] {
        cmd.env_remove(var);
    }
}

fn peers(n: usize) -> String {
    (0..n)
        .map(|_| format!("127.0.0.1:{}", free_port()))
        .collect::<Vec<_>>()
        .join(",")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn strings(items: &[&str]) -> Vec<String> {
    items.iter().map(|s| s.to_string()).collect()
}

/// `n` collective workers with `extra` flags, finished within `limit`.
fn collective(n: usize, extra: &[&str], limit: Duration) -> Vec<Output> {
    let peers = peers(n);
    let workers = Workers(
        (0..n)
            .map(|rank| {
                let mut args =
                    strings(&["--check", "--peers", &peers, "--rank", &rank.to_string()]);
                args.extend(strings(extra));
                spawn(&example("collective"), &args, &[])
            })
            .collect(),
    );
    workers.finish(limit)
}

#[test]
fn collectives_across_processes_equal_the_mean_for_1_to_4_workers_up_to_64_mib() {
    // 16,777,216 f32 = 64 MiB; the odd sizes do not divide into 3 or 4 chunks.
    let sizes = "1,2,3,7,1000,4099,1048577,16777216";
    for n in 1..=4 {
        let outputs = collective(n, &["--elements", sizes], Duration::from_secs(240));
        for (rank, out) in outputs.iter().enumerate() {
            let stdout = text(&out.stdout);
            assert!(
                out.status.success(),
                "n={n} rank {rank}: {}\n{stdout}",
                text(&out.stderr)
            );
            assert_eq!(
                stdout.matches("ok elements=").count(),
                8,
                "n={n} rank {rank}: {stdout}"
            );
            assert!(
                stdout.contains(&format!("ok elements=16777216 ranks={n}")),
                "{stdout}"
            );
        }
    }
}

#[test]
fn tcp_only_rings_agree_with_shared_memory_rings() {
    // Same host, so the ring would use shared memory: force TCP and compare.
    for n in [2, 3] {
        let outputs = collective(
            n,
            &["--elements", "1,4099,1048577", "--tcp-only"],
            Duration::from_secs(120),
        );
        for out in &outputs {
            assert!(out.status.success(), "{}", text(&out.stderr));
            assert_eq!(text(&out.stdout).matches("ok elements=").count(), 3);
        }
    }
}

#[test]
fn half_precision_on_the_wire_stays_within_f16_rounding() {
    let outputs = collective(
        3,
        &["--elements", "5,100003", "--fp16", "--sub-chunk-kib", "16"],
        Duration::from_secs(120),
    );
    for out in &outputs {
        assert!(out.status.success(), "{}", text(&out.stderr));
        assert_eq!(text(&out.stdout).matches("ok elements=").count(), 2);
    }
}

#[test]
fn mismatched_calls_fail_every_worker_with_an_explanation() {
    let start = Instant::now();
    let outputs = collective(
        3,
        &[
            "--elements",
            "1000",
            "--mismatch-rank",
            "1",
            "--timeout",
            "60",
        ],
        Duration::from_secs(120),
    );
    // Well inside the 60 s timeout: the mismatch is detected, not waited out.
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "failing took {:?}",
        start.elapsed()
    );
    let mut explained = 0;
    for out in &outputs {
        let stderr = text(&out.stderr);
        assert!(!out.status.success(), "a rank succeeded: {stderr}");
        if stderr.contains("differs between ranks") && stderr.contains("1001 elements") {
            explained += 1;
        }
    }
    assert!(
        explained >= 1,
        "{:?}",
        outputs.iter().map(|o| text(&o.stderr)).collect::<Vec<_>>()
    );
}

const MLP: &str = r#"{"inputs":60,"hidden":[32],"classes":10}"#;
const DATA: &str = "synthetic-iid:clients=1,seed=3,min_samples=4000,max_samples=4000";

/// `hora-client sync` flags shared by the training tests.
fn training(batch: usize, epochs: u64, save: &Path) -> Vec<String> {
    strings(&[
        "sync",
        "--model",
        "mlp",
        "--params",
        MLP,
        "--data",
        DATA,
        "--epochs",
        &epochs.to_string(),
        "--batch-size",
        &batch.to_string(),
        "--learning-rate",
        "0.05",
        "--lr-scaling",
        "none",
        "--optimizer",
        "sgd",
        "--momentum",
        "0.9",
        "--seed",
        "1",
        "--threads",
        "1",
        "--no-progress",
        "--save",
        &save.display().to_string(),
    ])
}

/// Runs `n` workers over `--peers` and returns their outputs.
fn train_world(n: usize, mut args: Vec<String>) -> Vec<Output> {
    let peers = peers(n);
    args.extend(strings(&["--peers", &peers]));
    let workers = Workers(
        (0..n)
            .map(|rank| {
                let mut a = args.clone();
                a.extend(strings(&["--rank", &rank.to_string()]));
                spawn(&binary("hora-client"), &a, &[])
            })
            .collect(),
    );
    let outputs = workers.finish(Duration::from_secs(180));
    for (rank, out) in outputs.iter().enumerate() {
        assert!(
            out.status.success(),
            "rank {rank}: {}{}",
            text(&out.stdout),
            text(&out.stderr)
        );
    }
    outputs
}

fn weights(path: &Path) -> Model {
    Model::read_file(path, &Limits::default()).expect("read saved weights")
}

fn max_difference(a: &Model, b: &Model) -> f32 {
    assert!(a.same_layout(&b.spec()));
    a.data()
        .iter()
        .zip(b.data())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn two_workers_follow_one_worker_on_the_combined_batch() {
    let dir = tempfile::tempdir().unwrap();
    let [one, two, small]: [PathBuf; 3] =
        ["one", "two", "small"].map(|n| dir.path().join(format!("{n}.safetensors")));
    train_world(1, training(20, 2, &one));
    let outputs = train_world(2, training(10, 2, &two));
    // One worker with the per-worker batch follows another trajectory: the test can tell.
    train_world(1, training(10, 2, &small));
    let rank0 = text(&outputs[0].stdout);
    assert!(rank0.contains("epoch 2/2"), "{rank0}");
    let same = max_difference(&weights(&one), &weights(&two));
    let other = max_difference(&weights(&one), &weights(&small));
    assert!(
        same < 1e-4,
        "2 workers × batch 10 vs 1 worker × batch 20: max difference {same}"
    );
    assert!(
        other > 1e-2,
        "batch 10 vs batch 20 should differ clearly: {other}"
    );
}

#[test]
fn a_restarted_job_resumes_from_rank_0s_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let (straight, resumed) = (
        dir.path().join("straight.safetensors"),
        dir.path().join("resumed.safetensors"),
    );
    let checkpoints = dir.path().join("checkpoints");
    train_world(2, training(10, 4, &straight));
    let mut first = training(10, 2, &resumed);
    first.extend(strings(&[
        "--checkpoint-dir",
        &checkpoints.display().to_string(),
    ]));
    let out = train_world(2, first.clone());
    assert!(
        !text(&out[0].stdout).contains("resumed"),
        "a fresh directory starts at step 0"
    );
    // The restart asks for 4 epochs: it resumes after the 2 it has and runs 2 more.
    let mut second = training(10, 4, &resumed);
    second.extend(strings(&[
        "--checkpoint-dir",
        &checkpoints.display().to_string(),
    ]));
    let out = train_world(2, second);
    let rank0 = text(&out[0].stdout);
    assert!(rank0.contains("resumed from step 320"), "{rank0}");
    assert!(
        !rank0.contains("epoch 1/4") && rank0.contains("epoch 3/4") && rank0.contains("epoch 4/4"),
        "{rank0}"
    );
    let rank1 = text(&out[1].stdout);
    assert!(
        rank1.contains("resumed from step 320"),
        "rank 1 learns the step from rank 0: {rank1}"
    );
    let difference = max_difference(&weights(&straight), &weights(&resumed));
    assert!(
        difference < 1e-6,
        "resumed run differs from the uninterrupted one by {difference}"
    );
}

#[test]
fn killing_a_worker_stops_the_others_within_the_timeout_naming_it() {
    // Four workers and the victim is rank 2: rank 1 sends to it, rank 3 receives from it, and
    // rank 0 is not its neighbour at all — every survivor must still name rank 2.
    let dir = tempfile::tempdir().unwrap();
    let peers = peers(4);
    let mut args = training(10, 1000, &dir.path().join("never.safetensors"));
    args.extend(strings(&["--peers", &peers, "--timeout", "10"]));
    let mut children: Vec<Child> = (0..4)
        .map(|rank| {
            let mut a = args.clone();
            a.extend(strings(&["--rank", &rank.to_string()]));
            spawn(&binary("hora-client"), &a, &[])
        })
        .collect();
    // Wait until training is under way: rank 0 reports its first epoch.
    let stdout = children[0].stdout.take().unwrap();
    let mut lines = BufReader::new(stdout).lines();
    let started = lines
        .by_ref()
        .map_while(Result::ok)
        .find(|l| l.starts_with("epoch 1/"));
    assert!(started.is_some(), "rank 0 never finished an epoch");
    let mut victim = Workers(vec![children.remove(2)]);
    victim.0[0].kill().expect("kill rank 2");
    let killed = Instant::now();
    let survivors = Workers(children).finish(Duration::from_secs(60));
    assert!(
        killed.elapsed() < Duration::from_secs(10),
        "the others took {:?} to stop",
        killed.elapsed()
    );
    for (out, rank) in survivors.iter().zip([0, 1, 3]) {
        let stderr = text(&out.stderr);
        assert!(!out.status.success(), "rank {rank} exited successfully");
        assert!(
            stderr.contains("error: rank 2 "),
            "rank {rank} does not name rank 2: {stderr}"
        );
    }
}

#[test]
fn ranks_come_from_slurm_and_mpirun_environments() {
    for (rank_var, size_var, launcher) in [
        ("SLURM_PROCID", "SLURM_NTASKS", "slurm"),
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "mpirun"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let peers = peers(2);
        let mut args = training(10, 1, &dir.path().join("w.safetensors"));
        args.extend(strings(&["--peers", &peers]));
        // Started in reverse order: the rank is the launcher's, not the order of arrival.
        let workers = Workers(
            [1, 0]
                .iter()
                .map(|rank| {
                    spawn(
                        &binary("hora-client"),
                        &args,
                        &[(rank_var, rank.to_string()), (size_var, "2".into())],
                    )
                })
                .collect(),
        );
        let outputs = workers.finish(Duration::from_secs(120));
        for (out, rank) in outputs.iter().zip([1, 0]) {
            let stdout = text(&out.stdout);
            assert!(
                out.status.success(),
                "{launcher} rank {rank}: {}",
                text(&out.stderr)
            );
            assert!(
                stdout.contains(&format!("rank {rank} of 2 (rank from {launcher}")),
                "{launcher}: {stdout}"
            );
        }
        assert!(
            dir.path().join("w.safetensors").exists(),
            "rank 0 saved the weights"
        );
    }
}

/// A sync job of `n` at a fresh server; returns the server and the job's token.
fn server_with_job(dir: &Path, n: u32) -> (Server, String) {
    let server = Server::start(&dir.join("server"));
    let token = create_job(&server, "job", n, None);
    (server, token)
}

/// Creates sync job `id` (elastic down to `min`, with a 300 ms quiet time); its token.
fn create_job(server: &Server, id: &str, n: u32, min: Option<u32>) -> String {
    let api = server.api(ADMIN_TOKEN);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let job = runtime.block_on(api.create_sync_job(&hora_common::wire::CreateSyncJob {
        id: id.into(),
        world_size: n,
        min_world_size: min,
        settle_ms: min.map(|_| 300),
    }));
    job.token.expect("the job's token")
}

fn at_server(server: &Server, token: &str, n: u32, timeout: u64) -> Vec<String> {
    strings(&[
        "--server",
        &server.url,
        "--ca",
        &server.ca.display().to_string(),
        "--job",
        "job",
        "--token",
        token,
        "--world-size",
        &n.to_string(),
        "--timeout",
        &timeout.to_string(),
    ])
}

#[test]
fn workers_meet_at_the_server_with_mpirun_ranks_or_ranks_it_assigns() {
    let dir = tempfile::tempdir().unwrap();
    let (server, token) = server_with_job(dir.path(), 3);
    let mut args = training(10, 1, &dir.path().join("w.safetensors"));
    args.extend(at_server(&server, &token, 3, 60));
    // mpirun's ranks, started in reverse order.
    let workers = Workers(
        [2, 1, 0]
            .iter()
            .map(|rank| {
                let mut env = vec![("OMPI_COMM_WORLD_RANK", rank.to_string())];
                env.push(("OMPI_COMM_WORLD_SIZE", "3".into()));
                let mut a = args.clone();
                a.retain(|x| x != "--world-size" && x != "3");
                spawn(&binary("hora-client"), &a, &env)
            })
            .collect(),
    );
    for (out, rank) in workers
        .finish(Duration::from_secs(120))
        .iter()
        .zip([2, 1, 0])
    {
        let stdout = text(&out.stdout);
        assert!(out.status.success(), "rank {rank}: {}", text(&out.stderr));
        assert!(
            stdout.contains(&format!("rank {rank} of 3 (rank from mpirun")),
            "{stdout}"
        );
    }

    // No launcher: the server hands out ranks 0..3, one each (the job forms its next world).
    let workers = Workers(
        (0..3)
            .map(|_| spawn(&binary("hora-client"), &args, &[]))
            .collect(),
    );
    let mut ranks: Vec<u32> = workers
        .finish(Duration::from_secs(120))
        .iter()
        .map(|out| {
            let stdout = text(&out.stdout);
            assert!(out.status.success(), "{}", text(&out.stderr));
            let line = stdout
                .lines()
                .find(|l| l.contains(" of 3 (rank from the server"))
                .unwrap_or_else(|| panic!("{stdout}"));
            line.split_whitespace()
                .nth(1)
                .and_then(|r| r.parse().ok())
                .expect("a rank")
        })
        .collect();
    ranks.sort();
    assert_eq!(ranks, [0, 1, 2]);
}

#[test]
fn a_worker_that_never_comes_is_named_by_the_rendezvous() {
    let dir = tempfile::tempdir().unwrap();
    let (server, token) = server_with_job(dir.path(), 2);
    let mut args = training(10, 1, &dir.path().join("w.safetensors"));
    args.extend(at_server(&server, &token, 2, 2));
    args.extend(strings(&["--rank", "0"]));
    let start = Instant::now();
    let out =
        Workers(vec![spawn(&binary("hora-client"), &args, &[])]).finish(Duration::from_secs(60));
    let stderr = text(&out[0].stderr);
    assert!(!out[0].status.success());
    assert!(stderr.contains("rank [1] has not joined"), "{stderr}");
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "{:?}",
        start.elapsed()
    );
}

#[test]
fn the_sync_example_trains_the_mlp_with_local_processes() {
    let out = Command::new(example("sync"))
        .args(["--workers", "2", "--epochs", "2", "--hidden", "64"])
        .env("HORA_LOG", "warn")
        .output()
        .expect("run examples/sync");
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
    let accuracy: f64 = stdout
        .lines()
        .find(|l| l.starts_with("epoch 2/2"))
        .and_then(|l| l.split("accuracy ").nth(1))
        .and_then(|a| a.split_whitespace().next())
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("no accuracy in {stdout}"));
    assert!(
        accuracy > 0.7,
        "held-out accuracy after 2 epochs: {accuracy}\n{stdout}"
    );
}

/// What a stranger at a worker's ring port does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stranger {
    /// Connects and says nothing.
    Silent,
    /// Answers the challenge with a hello of the right shape and a made-up proof.
    GuessedProof,
    /// Sends the old (protocol 1) hello, with a guessed session in the clear.
    GuessedSession,
    /// Sends bytes that are no frame at all.
    Garbage,
}

const STRANGERS: [Stranger; 9] = [
    Stranger::Silent,
    Stranger::GuessedProof,
    Stranger::GuessedSession,
    Stranger::Garbage,
    Stranger::Silent,
    Stranger::GuessedProof,
    Stranger::GuessedSession,
    Stranger::Garbage,
    Stranger::Silent,
];

/// A ring frame as workers write it: magic, kind, a zero word, the length, the payload.
fn frame(kind: u8, payload: &[u8]) -> Vec<u8> {
    let mut f = vec![0xA7, kind, 0, 0, 0, 0, 0, 0];
    f.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    f.extend_from_slice(payload);
    f
}

/// What one stranger was sent, and whether the worker closed its connection.
struct Told {
    stranger: Stranger,
    bytes: Vec<u8>,
    closed: bool,
}

/// [`STRANGERS`] at the ring port `port`, connected as soon as it listens (within 60 s), each
/// on its own thread, which returns what the worker sent it until it closed the connection
/// (30 s at most). `guess` is the session the `GuessedSession` strangers try.
fn crowd(port: u16, guess: &str) -> Vec<JoinHandle<Told>> {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut first = loop {
        match TcpStream::connect(("127.0.0.1", port)) {
            Ok(s) => break Some(s),
            Err(_) if Instant::now() < deadline => thread::sleep(Duration::from_millis(5)),
            Err(e) => panic!("no worker listened on port {port} within 60 s: {e}"),
        }
    };
    STRANGERS
        .iter()
        .map(|&stranger| {
            let mut stream = first.take().unwrap_or_else(|| {
                TcpStream::connect(("127.0.0.1", port)).expect("connect a stranger")
            });
            let opening = match stranger {
                Stranger::GuessedSession => frame(1, format!("1 {guess} 0 1 2").as_bytes()),
                Stranger::Garbage => vec![0x5a; 1000],
                Stranger::Silent | Stranger::GuessedProof => Vec::new(),
            };
            let _ = stream.write_all(&opening);
            thread::spawn(move || {
                let _ = stream.set_read_timeout(Some(Duration::from_millis(200)));
                let end = Instant::now() + Duration::from_secs(30);
                let (mut bytes, mut buf, mut closed, mut answered) =
                    (Vec::new(), [0u8; 4096], false, false);
                while Instant::now() < end {
                    match stream.read(&mut buf) {
                        Ok(0) => {
                            closed = true;
                            break;
                        }
                        Ok(n) => bytes.extend_from_slice(&buf[..n]),
                        Err(e)
                            if matches!(
                                e.kind(),
                                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                            ) => {}
                        // Reset: closed with our bytes unread.
                        Err(_) => {
                            closed = true;
                            break;
                        }
                    }
                    // A challenge is a 16-byte header and 37 bytes: version, nonce, sealing.
                    if stranger == Stranger::GuessedProof && !answered && bytes.len() >= 53 {
                        answered = true;
                        // A hello of this version (3), sealed, with a guessed proof.
                        let mut hello = 3u32.to_le_bytes().to_vec();
                        hello.extend_from_slice(&0u64.to_le_bytes());
                        hello.extend_from_slice(&2u32.to_le_bytes());
                        hello.extend_from_slice(&1u32.to_le_bytes());
                        hello.push(1);
                        hello.extend_from_slice(&[7; 32]);
                        hello.extend_from_slice(&[9; 32]);
                        let _ = stream.write_all(&frame(1, &hello));
                    }
                }
                Told {
                    stranger,
                    bytes,
                    closed,
                }
            })
        })
        .collect()
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// The longest run of hex digits in `bytes` (a server's session is 32 of them).
fn longest_hex_run(bytes: &[u8]) -> usize {
    bytes
        .split(|b| !b.is_ascii_hexdigit())
        .map(<[u8]>::len)
        .max()
        .unwrap_or(0)
}

/// Starts rank 0 with `args(0)`, crowds its ring port `port` with strangers, then starts rank
/// 1: the two train to the end. Returns both outputs and what each stranger was told.
fn train_among_strangers(
    port: u16,
    guess: &str,
    args: impl Fn(u32) -> Vec<String>,
) -> (Vec<Output>, Vec<Told>) {
    let mut workers = Workers(vec![spawn(&binary("hora-client"), &args(0), &[])]);
    let crowd = crowd(port, guess);
    workers.0.push(spawn(&binary("hora-client"), &args(1), &[]));
    let outputs = workers.finish(Duration::from_secs(180));
    for (rank, out) in outputs.iter().enumerate() {
        assert!(
            out.status.success(),
            "rank {rank}: {}{}",
            text(&out.stdout),
            text(&out.stderr)
        );
    }
    let told = crowd
        .into_iter()
        .map(|h| h.join().expect("a stranger's thread"))
        .collect();
    (outputs, told)
}

/// Every stranger was let go, told at most that it is not a member, and none of `secrets`.
fn assert_strangers_learned_nothing(told: &[Told], secrets: &[&[u8]], rank0_log: &str) {
    for t in told {
        let what = format!("{:?} was sent {:?}", t.stranger, text(&t.bytes));
        assert!(t.closed, "{what}, and its connection was never closed");
        for secret in secrets {
            assert!(!contains(&t.bytes, secret), "{what}");
        }
        assert!(longest_hex_run(&t.bytes) < 32, "{what}");
        if matches!(
            t.stranger,
            Stranger::GuessedProof | Stranger::GuessedSession
        ) {
            assert!(contains(&t.bytes, b"not a member of this ring"), "{what}");
        }
    }
    // The worker says why it refused them, in its own log only, and without the secrets.
    assert!(
        rank0_log.contains("refused a ring connection"),
        "{rank0_log}"
    );
    for secret in secrets {
        assert!(!contains(rank0_log.as_bytes(), secret), "{rank0_log}");
    }
}

#[test]
fn strangers_at_a_ring_port_learn_nothing_and_the_job_trains_as_without_them() {
    let dir = tempfile::tempdir().unwrap();
    let [alone, among_peers, among_server]: [PathBuf; 3] =
        ["alone", "peers", "server"].map(|n| dir.path().join(format!("{n}.safetensors")));
    train_world(2, training(10, 1, &alone));

    // --peers: the session derives from the shared secret. The strangers guess what the
    // session used to be, a hash of the peer list that anyone could compute.
    let peers = peers(2);
    let list: Vec<String> = peers.split(',').map(String::from).collect();
    let port: u16 = list[0].rsplit(':').next().unwrap().parse().unwrap();
    let session = hora_collective::World::from_peers(list.clone(), 0, Some(SECRET))
        .unwrap()
        .session;
    let old_session = &hora_common::sha256_hex(peers.as_bytes())[..32];
    let (outputs, told) = train_among_strangers(port, old_session, |rank| {
        let mut a = training(10, 1, &among_peers);
        a.extend(strings(&["--peers", &peers, "--rank", &rank.to_string()]));
        a
    });
    let raw_session = hex::decode(&session).unwrap();
    assert_strangers_learned_nothing(
        &told,
        &[SECRET.as_bytes(), session.as_bytes(), &raw_session],
        &text(&outputs[0].stderr),
    );

    // At the server: the session is the server's, random; the strangers must not learn it
    // (no run of 32 hex digits) nor the job's token.
    let (server, token) = server_with_job(dir.path(), 2);
    let ports = [free_port(), free_port()];
    let (outputs, told) = train_among_strangers(ports[0], &"0".repeat(32), |rank| {
        let mut a = training(10, 1, &among_server);
        a.extend(at_server(&server, &token, 2, 30));
        a.extend(strings(&[
            "--rank",
            &rank.to_string(),
            "--ring-listen",
            &format!("127.0.0.1:{}", ports[rank as usize]),
        ]));
        a
    });
    assert_strangers_learned_nothing(&told, &[token.as_bytes()], &text(&outputs[0].stderr));

    for trained in [&among_peers, &among_server] {
        let difference = max_difference(&weights(&alone), &weights(trained));
        assert!(
            difference < 1e-6,
            "{}: strangers changed the result by {difference}",
            trained.display()
        );
    }
}

/// `hora-run` itself, with the launchers' variables of this test's environment removed.
fn launcher(args: &[String]) -> Command {
    let mut cmd = Command::new(binary("hora-run"));
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .env("HORA_LOG", "warn")
        .env_remove("HORA_SYNC_SECRET");
    without_launchers(&mut cmd);
    cmd
}

/// A port base whose `n` ring ports (base + 1 …) were all free a moment ago, below the
/// ephemeral ports that the other tests' `free_port()` and outgoing connections take, so none
/// of them can take one meanwhile.
fn port_base(n: u16) -> String {
    use rand::Rng;
    let below = below_ephemeral();
    for _ in 0..100 {
        let base = rand::rng().random_range(10_000..below - n - 1);
        let free: Vec<_> = (1..=n)
            .map_while(|i| std::net::TcpListener::bind(("127.0.0.1", base + i)).ok())
            .collect();
        if free.len() == usize::from(n) {
            return base.to_string();
        }
    }
    panic!("no {n} free consecutive ports below {below}");
}

#[test]
fn the_launcher_starts_four_workers_that_form_a_world_and_passes_on_a_failing_ranks_code() {
    // Four `hora-client sync` workers form their ring from what hora-run tells them alone (no
    // server, no list, no secret of their own) and train an epoch.
    let dir = tempfile::tempdir().unwrap();
    let save = dir.path().join("trained.safetensors");
    let mut args = strings(&["-np", "4", "--port", &port_base(4), "--", "hora-client"]);
    args[5] = binary("hora-client").display().to_string();
    args.extend(training(32, 1, &save));
    let out = launcher(&args).output().expect("run hora-run");
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(
        out.status.success(),
        "hora-run failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    for rank in 0..4 {
        assert!(
            stdout.contains(&format!("[{rank}] rank {rank} of 4")),
            "rank {rank} did not report its place in the world:\n{stdout}"
        );
    }
    assert!(save.exists(), "rank 0 saved the model");

    // A rank that fails ends the job with its exit code; the others are stopped (not waited
    // for: they would sleep a minute), and each worker was told its place and a secret.
    let script = r#"echo "rank=$RANK of $WORLD_SIZE local=$LOCAL_RANK/$LOCAL_WORLD_SIZE secret=${#HORA_SYNC_SECRET} peers=$HORA_PEERS"; [ "$RANK" != 2 ] || exit 7; sleep 60"#;
    let started = Instant::now();
    let mut args = strings(&["-np", "4", "--grace", "1", "--port", &port_base(4)]);
    args.extend(strings(&["--", "sh", "-c", script]));
    let out = launcher(&args).output().expect("run hora-run");
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(7), "{stdout}\n{stderr}");
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "the others were not stopped"
    );
    assert!(stderr.contains("rank 2 exited"), "{stderr}");
    for rank in 0..4 {
        assert!(
            stdout.contains(&format!(
                "[{rank}] rank={rank} of 4 local={rank}/4 secret=32 peers=127.0.0.1:"
            )),
            "{stdout}"
        );
    }
}

/// A stand-in for ssh in `dir` that runs the remote command here, as sshd's shell would (and
/// notes the host and its arguments): what hora-run sends a remote host is exercised whole,
/// on loopback.
fn fake_ssh(dir: &Path) -> PathBuf {
    let ssh = dir.join("fake-ssh");
    std::fs::write(
        &ssh,
        "#!/bin/sh\n# -T -o BatchMode=yes HOST COMMAND\necho \"$4\" >> \"$0.hosts\"\necho \"$@\" >> \"$0.args\"\nexec sh -c \"$5\"\n",
    )
    .unwrap();
    std::fs::set_permissions(&ssh, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    ssh
}

/// `hora-run` with `args`, through the stand-in ssh, running `sh -c script` in `dir`.
fn remote_job(dir: &Path, args: &[&str], script: &str) -> Output {
    let ssh = fake_ssh(dir);
    let mut args = strings(args);
    args.extend(strings(&[
        "--ssh",
        &ssh.display().to_string(),
        "--",
        "sh",
        "-c",
        script,
    ]));
    launcher(&args)
        .current_dir(dir)
        .output()
        .expect("run hora-run")
}

#[test]
fn a_failing_remote_rank_ends_the_job_with_its_code_and_leaves_no_worker_behind() {
    let dir = tempfile::tempdir().unwrap();
    // Rank 0 records its id and sleeps; rank 1 fails.
    let script = r#"[ "$RANK" = 1 ] && exit 5; echo $$ > "pid.$RANK"; exec sleep 60"#;
    let started = Instant::now();
    let out = remote_job(
        dir.path(),
        &["-np", "2", "-H", "node-a:1,node-b:1", "--grace", "1"],
        script,
    );
    assert_eq!(out.status.code(), Some(5), "{}", text(&out.stderr));
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "rank 0 was not stopped"
    );
    let pid: i32 = std::fs::read_to_string(dir.path().join("pid.0"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    // SAFETY: signal 0 only asks whether the process (rank 0, which this test started through
    // hora-run) still exists.
    let alive = unsafe { libc::kill(pid, 0) } == 0;
    if alive {
        // SAFETY: the worker this test started, by its id.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    assert!(!alive, "rank 0 ({pid}) outlived the job");
}

#[test]
fn the_launcher_reaches_remote_hosts_through_ssh_with_the_secret_on_its_input() {
    let dir = tempfile::tempdir().unwrap();
    let script = r#"echo "rank=$RANK local=$LOCAL_RANK peers=$HORA_PEERS dir=$(pwd)"; echo "secret=$HORA_SYNC_SECRET""#;
    let hosts = ["-np", "3", "-H", "node-a:2,node-b:2", "--port", "40000"];
    let out = remote_job(dir.path(), &hosts, script);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    let here = dir.path().canonicalize().unwrap();
    let peers = "peers=node-a:40001,node-a:40002,node-b:40003";
    for (rank, local) in [(0, 0), (1, 1), (2, 0)] {
        let line = format!(
            "[{rank}] rank={rank} local={local} {peers} dir={}",
            here.display()
        );
        assert!(stdout.contains(&line), "no `{line}` in:\n{stdout}");
    }
    // One secret for the job, the same at every rank, on no command line.
    let secrets: std::collections::BTreeSet<&str> = stdout
        .lines()
        .filter_map(|l| l.split_once("secret=").map(|(_, s)| s))
        .collect();
    let secret = match Vec::from_iter(secrets).as_slice() {
        [one] if one.len() == 32 => one.to_string(),
        other => panic!("not one secret of 32 digits: {other:?}"),
    };
    let args = std::fs::read_to_string(dir.path().join("fake-ssh.args")).unwrap();
    assert!(
        !args.contains(&secret),
        "the secret was on ssh's command line"
    );
    let mut hosts: Vec<String> = std::fs::read_to_string(dir.path().join("fake-ssh.hosts"))
        .unwrap()
        .lines()
        .map(String::from)
        .collect();
    hosts.sort();
    assert_eq!(hosts, ["node-a", "node-a", "node-b"]);
}

#[test]
fn an_interrupted_launcher_stops_every_worker_and_what_they_started() {
    let script = r#"echo up; sleep 60; echo "still here""#;
    let mut args = strings(&["-np", "2", "--port", &port_base(2)]);
    args.extend(strings(&["--", "sh", "-c", script]));
    let started = Instant::now();
    let mut run = launcher(&args).spawn().expect("start hora-run");
    let mut lines = BufReader::new(run.stdout.take().unwrap()).lines();
    for _ in 0..2 {
        let line = lines.next().expect("a worker's line").unwrap();
        assert!(line.ends_with("] up"), "{line}");
    }
    // SAFETY: SIGINT to the launcher this test started, by its id.
    unsafe { libc::kill(run.id() as libc::pid_t, libc::SIGINT) };
    let status = run.wait().unwrap();
    assert_eq!(status.code(), Some(130));
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "the workers were not stopped"
    );
    let rest: Vec<String> = lines.map_while(|l| l.ok()).collect();
    assert!(!rest.iter().any(|l| l.contains("still here")), "{rest:?}");
}

/// Elastic workers whose stdout lines arrive on one channel, tagged with the worker's index.
struct Elastic {
    workers: Vec<Option<Child>>,
    lines: std::sync::mpsc::Receiver<(usize, String)>,
    send: Option<std::sync::mpsc::Sender<(usize, String)>>,
    seen: Vec<Vec<String>>,
    args: Vec<String>,
    /// Every wait of the test ends by then.
    deadline: Instant,
}

impl Elastic {
    fn new(args: Vec<String>) -> Elastic {
        let (send, lines) = std::sync::mpsc::channel();
        Elastic {
            workers: Vec::new(),
            lines,
            send: Some(send),
            seen: Vec::new(),
            args,
            deadline: Instant::now() + Duration::from_secs(150),
        }
    }

    fn start(&mut self) -> usize {
        let index = self.workers.len();
        let mut child = spawn(&binary("hora-client"), &self.args, &[]);
        let stdout = child.stdout.take().expect("the worker's stdout");
        let send = self.send.clone().expect("still reading");
        thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = send.send((index, line));
            }
        });
        self.workers.push(Some(child));
        self.seen.push(Vec::new());
        index
    }

    /// Reads lines until one of worker `who` (any, if `None`) satisfies `until`; that line.
    fn until(&mut self, who: Option<usize>, until: impl Fn(&str) -> bool) -> (usize, String) {
        loop {
            let left = self.deadline.saturating_duration_since(Instant::now());
            let (i, line) = self.lines.recv_timeout(left).unwrap_or_else(|_| {
                panic!(
                    "the workers never said what was awaited: {:?}",
                    self.seen
                        .iter()
                        .map(|l| l.iter().rev().take(5).collect::<Vec<_>>())
                        .collect::<Vec<_>>()
                )
            });
            self.seen[i].push(line.clone());
            if who.is_none_or(|w| w == i) && until(&line) {
                return (i, line);
            }
        }
    }

    /// The worker of rank `rank` in world `generation` (from its "world G: rank R of N" line).
    fn rank_in(&mut self, generation: u64, rank: u32, size: u32) -> usize {
        let wanted = format!("world {generation}: rank {rank} of {size} ");
        if let Some(i) = self
            .seen
            .iter()
            .position(|l| l.iter().any(|l| l.starts_with(&wanted)))
        {
            return i;
        }
        self.until(None, |l| l.starts_with(&wanted)).0
    }

    /// Every world-`generation` line, by worker.
    fn world_lines(&self, generation: u64) -> Vec<(usize, String)> {
        let prefix = format!("world {generation}: ");
        self.seen
            .iter()
            .enumerate()
            .flat_map(|(i, lines)| {
                lines
                    .iter()
                    .filter(|l| l.starts_with(&prefix))
                    .map(move |l| (i, l.clone()))
            })
            .collect()
    }

    fn finish(mut self, indices: &[usize]) -> Vec<(Output, Vec<String>)> {
        let children: Vec<Child> = indices
            .iter()
            .map(|&i| self.workers[i].take().expect("a running worker"))
            .collect();
        let outputs = Workers(children).finish(Duration::from_secs(180));
        self.send = None;
        for (i, line) in self.lines.iter() {
            self.seen[i].push(line);
        }
        outputs
            .into_iter()
            .zip(indices)
            .map(|(out, &i)| (out, self.seen[i].clone()))
            .collect()
    }
}

impl Elastic {
    /// SIGKILL for worker `i`.
    fn kill(&mut self, i: usize) {
        let mut child = self.workers[i].take().expect("a running worker");
        child.kill().expect("kill a worker");
        let _ = child.wait();
    }
}

impl Drop for Elastic {
    fn drop(&mut self) {
        for c in self.workers.iter_mut().flatten() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The state digest a "world G: …" line reports.
fn digest_of(line: &str) -> &str {
    line.split("state ")
        .nth(1)
        .and_then(|s| s.split(')').next())
        .unwrap_or_else(|| panic!("no state in {line}"))
}

/// The last accuracy rank 0 reported.
fn final_accuracy(lines: &[String]) -> f64 {
    lines
        .iter()
        .rev()
        .find_map(|l| l.split("accuracy ").nth(1))
        .and_then(|a| a.split_whitespace().next())
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("no accuracy in {lines:?}"))
}

#[test]
fn an_elastic_job_survives_a_killed_worker_takes_in_a_new_one_and_fails_below_its_minimum() {
    const EPOCHS: u64 = 16;
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("server"));

    // The uninterrupted three-worker run to compare with.
    let base = train_world(
        3,
        training(10, EPOCHS, &dir.path().join("base.safetensors")),
    );
    let base_accuracy = final_accuracy(
        &text(&base[0].stdout)
            .lines()
            .map(String::from)
            .collect::<Vec<_>>(),
    );

    // Four workers of a job of at most four and at least three; rank 2 is killed in epoch 3.
    let token = create_job(&server, "lose", 4, Some(3));
    let mut args = training(10, EPOCHS, &dir.path().join("lose.safetensors"));
    args.extend(at_server(&server, &token, 4, 10));
    args.extend(strings(&["--elastic", "--commit-every", "10"]));
    let at = args.iter().position(|a| a == "--job").expect("--job") + 1;
    args[at] = "lose".into();
    let mut late = Elastic::new(args.clone());
    let mut job = Elastic::new(args);
    for _ in 0..4 {
        job.start();
    }
    let victim = job.rank_in(1, 2, 4);
    job.until(None, |l| l.starts_with("epoch 2/"));
    job.kill(victim);
    let survivors: Vec<usize> = (0..4).filter(|&i| i != victim).collect();
    let outputs = job.finish(&survivors);
    let mut world2 = Vec::new();
    for (out, lines) in &outputs {
        assert!(out.status.success(), "{lines:?}{}", text(&out.stderr));
        let line = lines
            .iter()
            .find(|l| l.starts_with("world 2: "))
            .unwrap_or_else(|| panic!("no second world: {lines:?}"));
        assert!(
            line.contains(" of 3 ") && line.contains("training again"),
            "{line}"
        );
        world2.push(digest_of(line).to_string());
    }
    assert!(world2.iter().all(|d| *d == world2[0]), "{world2:?}");
    let rank0 = outputs
        .iter()
        .find(|(_, lines)| lines.iter().any(|l| l.starts_with("world 2: rank 0 ")))
        .map(|(_, lines)| lines.clone())
        .expect("a rank 0 in world 2");
    assert!(
        rank0
            .iter()
            .any(|l| l.starts_with(&format!("epoch {EPOCHS}/{EPOCHS}"))),
        "{rank0:?}"
    );
    let accuracy = final_accuracy(&rank0);
    assert!(
        (accuracy - base_accuracy).abs() <= 0.02,
        "after losing a worker {accuracy}, uninterrupted with three {base_accuracy}"
    );
    // The last world's rank 0 told the server the job finished: a worker that comes now (a
    // launcher's retry) has nothing to do, at once.
    let started = late.start();
    let outputs = late.finish(&[started]);
    let (out, lines) = &outputs[0];
    assert!(out.status.success(), "{lines:?}{}", text(&out.stderr));
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("nothing to do: ") && l.contains("finished training")),
        "{lines:?}"
    );

    // Two workers of a job of two to three; a third joins at a commit and starts from the
    // others' exact state; then two are killed and the last fails naming them.
    let token = create_job(&server, "grow", 3, Some(2));
    let mut args = training(10, 10_000, &dir.path().join("grow.safetensors"));
    args.extend(at_server(&server, &token, 3, 5));
    args.extend(strings(&["--elastic", "--commit-every", "10"]));
    let at = args.iter().position(|a| a == "--job").expect("--job") + 1;
    args[at] = "grow".into();
    let mut job = Elastic::new(args);
    job.start();
    job.start();
    job.until(None, |l| l.starts_with("epoch 1/"));
    let newcomer = job.start();
    while job.world_lines(2).len() < 3 {
        job.until(None, |l| l.starts_with("world 2: "));
    }
    let world2 = job.world_lines(2);
    assert_eq!(world2.len(), 3, "{world2:?}");
    assert!(world2.iter().any(|(i, _)| *i == newcomer), "{world2:?}");
    for (_, line) in &world2 {
        assert!(line.contains(" of 3 from step "), "{line}");
        assert_eq!(digest_of(line), digest_of(&world2[0].1), "{world2:?}");
    }
    let step = |l: &str| {
        l.split("from step ")
            .nth(1)
            .and_then(|s| s.split(' ').next())
            .map(String::from)
    };
    assert!(step(&world2[0].1).is_some_and(|s| s != "0"), "{world2:?}");
    assert!(world2.iter().all(|(_, l)| step(l) == step(&world2[0].1)));
    let last = job.rank_in(2, 0, 3);
    for i in (0..3).filter(|&i| i != last) {
        job.kill(i);
    }
    let outputs = job.finish(&[last]);
    let (out, _) = &outputs[0];
    let stderr = text(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("below its minimum world of 2")
            && stderr.contains("of world 2, ranks [1, 2] have not come back"),
        "{stderr}"
    );
}
