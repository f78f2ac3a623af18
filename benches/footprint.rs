//! Footprint on the device: what one `hora-client` costs the machine it trains on, next to
//! Flower's Python client on the same rounds, in one run.
//!
//! Two workloads, each a task of `HORA_FOOTPRINT_ROUNDS` rounds (3) with one client:
//! - the demo's: logistic regression (60 → 10) on one client's shard of Synthetic(1,1);
//! - the MNIST MLP of the FedAvg paper (784-200-200-10, 199,210 parameters) on one client's
//!   MNIST-shaped data: IDX files of 28×28 images, `HORA_FOOTPRINT_MNIST` of them to train on
//!   (600, FedAvg's share of 100 clients) and a sixth as many held out (pixels drawn at random
//!   around a per-class pattern: this machine cannot download MNIST, and neither memory nor
//!   traffic depends on the pixels' values).
//!
//! Each client talks to its server through a relay on loopback that counts the bytes on the
//! wire each way (TLS, HTTP or gRPC framing and all). Hora: the release `hora-server` and one
//! `hora-client train` process (one thread, CPU) from the client's release tarball, unpacked
//! into a temporary directory: the client as a device runs it, CPU only (the development build
//! also loads libtorch_cuda and its CUDA libraries, which cost hundreds of MB of RSS). Flower: `benches/flower_round.py` (flwr from
//! `scripts/setup-flower.sh`), one client process with the same data, model, epoch, batch and
//! optimiser, over TLS with Hora's certificates.
//!
//! Printed per workload and client: peak resident memory (the process's own high-water mark,
//! `VmHWM` of /proc/PID/status, read every 10 ms while it runs: not `ru_maxrss`, which a program
//! inherits from the process that started it, here one with libtorch loaded), start-up (from starting the process to holding the first round's model, ready to
//! train), bytes sent and received per round (everything on the wire over all rounds, divided by
//! the rounds), and the artefact sizes (the release binaries, and `make dist`'s tarballs when
//! `dist/` holds them). Ends with `RESULT` lines: the MNIST client's peak RSS against the 300 MB
//! target, and Hora/Flower ratios.
//!
//! `make dist && cargo bench -p hora --bench footprint`
//! (`HORA_BENCH_FLOWER=0`: Hora alone.)

#[path = "common/flower.rs"]
mod flower;
#[path = "common/harness.rs"]
mod harness;
#[path = "common/mnist.rs"]
mod mnist;
#[path = "../tests/support/mod.rs"]
mod support;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use hora_client::data::synthetic::SyntheticConfig;
use hora_client::network::{Architecture, Network};
use reqwest::Method;
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const MIB: f64 = 1024.0 * 1024.0;

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

fn main() {
    harness::main(run);
}

/// A TCP relay on loopback that counts the bytes it passes each way.
struct Relay {
    port: u16,
    /// Client → server.
    sent: Arc<AtomicU64>,
    /// Server → client.
    received: Arc<AtomicU64>,
    /// Pumps still running (two per connection).
    open: Arc<AtomicUsize>,
}

impl Relay {
    async fn start(upstream: SocketAddr) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("relay bind");
        let port = listener.local_addr().expect("relay address").port();
        let sent = Arc::new(AtomicU64::new(0));
        let received = Arc::new(AtomicU64::new(0));
        let open = Arc::new(AtomicUsize::new(0));
        let (s, r, o) = (sent.clone(), received.clone(), open.clone());
        tokio::spawn(async move {
            while let Ok((down, _)) = listener.accept().await {
                let Ok(up) = TcpStream::connect(upstream).await else {
                    continue;
                };
                let _ = down.set_nodelay(true);
                let _ = up.set_nodelay(true);
                let (down_r, down_w) = down.into_split();
                let (up_r, up_w) = up.into_split();
                o.fetch_add(2, Ordering::SeqCst);
                tokio::spawn(pump(down_r, up_w, s.clone(), o.clone()));
                tokio::spawn(pump(up_r, down_w, r.clone(), o.clone()));
            }
        });
        Relay {
            port,
            sent,
            received,
            open,
        }
    }

    /// Bytes sent and received, once every connection has closed (the client has exited: its
    /// connections' last bytes may still be on their way; at most 5 s).
    async fn bytes(&self) -> (u64, u64) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.open.load(Ordering::SeqCst) > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        (
            self.sent.load(Ordering::SeqCst),
            self.received.load(Ordering::SeqCst),
        )
    }
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    count: Arc<AtomicU64>,
    open: Arc<AtomicUsize>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                count.fetch_add(n as u64, Ordering::Relaxed);
                if to.write_all(&buf[..n]).await.is_err() {
                    break;
                }
            }
        }
    }
    let _ = to.shutdown().await;
    open.fetch_sub(1, Ordering::SeqCst);
}

/// A free loopback port (bound, then released for the program that will listen on it).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port()
}

/// The process's own peak resident memory so far, in bytes (`VmHWM`), if it still runs.
fn high_water(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse::<u64>()
        .ok()?;
    Some(kb * 1024)
}

/// Runs `cmd` to its end (10 minutes at most); its exit status and peak resident memory in
/// bytes, the last `VmHWM` read before it exited (read every 10 ms: the mark only rises).
async fn run_measured(mut cmd: Command) -> (std::process::ExitStatus, u64) {
    let mut child = cmd.spawn().expect("start the client");
    let started = Instant::now();
    let mut peak = 0;
    loop {
        if let Some(hwm) = high_water(child.id()) {
            peak = peak.max(hwm);
        }
        if let Some(status) = child.try_wait().expect("client status") {
            return (status, peak);
        }
        if started.elapsed() > Duration::from_secs(600) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the client did not finish in 10 minutes");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// One workload: a model and one client's data, for both systems.
struct Workload {
    name: &'static str,
    arch: Architecture,
    /// Hora's `--data`.
    data: String,
    /// flower_round.py's data arguments.
    flower_data: Vec<String>,
    /// Further `hora-client train` flags.
    client_args: Vec<String>,
    samples: usize,
}

/// What one client process cost.
#[derive(Default)]
struct Cost {
    rss: u64,
    startup_ms: f64,
    sent: u64,
    received: u64,
    rounds: u64,
}

impl Cost {
    fn line(&self, who: &str) -> String {
        format!(
            "{who:<7} peak RSS {:7.1} MiB   start-up {:7.0} ms   sent {:9.1} KiB/round   received {:9.1} KiB/round",
            self.rss as f64 / MIB,
            self.startup_ms,
            self.sent as f64 / 1024.0 / self.rounds as f64,
            self.received as f64 / 1024.0 / self.rounds as f64,
        )
    }
}

/// The client of this machine's release tarball (`make dist`), unpacked under `dir`.
fn shipped_client(dir: &Path) -> PathBuf {
    let name = format!(
        "hora-client-{}-{}-linux",
        env!("CARGO_PKG_VERSION"),
        std::env::consts::ARCH
    );
    let tarball = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("dist/{name}.tar.gz"));
    assert!(
        tarball.exists(),
        "{} is missing: run `make dist` first (this benchmark measures the client as shipped)",
        tarball.display()
    );
    let status = Command::new("tar")
        .arg("-C")
        .arg(dir)
        .arg("-xzf")
        .arg(&tarball)
        .status()
        .expect("run tar");
    assert!(status.success(), "unpacking {} failed", tarball.display());
    dir.join(name).join("bin/hora-client")
}

/// One Hora client process through a relay: its cost.
async fn hora(server: &Server, client: &Path, dir: &Path, w: &Workload, rounds: u64) -> Cost {
    let admin = server.api(ADMIN_TOKEN);
    tch::manual_seed(0);
    let initial = Network::builtin(&w.arch, tch::Device::Cpu)
        .and_then(|n| n.weights())
        .expect("initial weights");
    let digest = admin.upload_model(&initial).await;
    admin
        .create_task(&harness::fedavg_task(
            w.name,
            digest,
            w.arch.to_kind(),
            rounds,
            1,
            600,
        ))
        .await;
    let token: serde_json::Value = admin
        .ok(admin
            .request(Method::POST, "/admin/v1/enrolments")
            .json(&serde_json::json!({})))
        .await;
    let upstream: SocketAddr = server
        .url
        .trim_start_matches("https://")
        .trim_end_matches('/')
        .parse()
        .expect("server address");
    let relay = Relay::start(upstream).await;
    let timings = dir.join(format!("{}-timings.jsonl", w.name));
    let log = std::fs::File::create(dir.join(format!("{}-client.log", w.name))).expect("log");
    let mut cmd = Command::new(client);
    cmd.args(["train", "--server"])
        .arg(format!("https://127.0.0.1:{}", relay.port))
        .args(["--task", w.name, "--token"])
        .arg(token["token"].as_str().expect("token"))
        .arg("--ca")
        .arg(&server.ca)
        .arg("--state-dir")
        .arg(dir.join(format!("{}-state", w.name)))
        .args(["--data", &w.data, "--rounds", &rounds.to_string()])
        .args(&w.client_args)
        .args(["--threads", "1", "--device", "cpu", "--no-progress"])
        .arg("--timings")
        .arg(&timings)
        .env("HORA_LOG", "warn")
        .stdout(log.try_clone().expect("log"))
        .stderr(log);
    let spawned_us = now_us();
    let (status, rss) = run_measured(cmd).await;
    assert!(
        status.success(),
        "the hora client failed ({status}); see {}",
        dir.join(format!("{}-client.log", w.name)).display()
    );
    let first: serde_json::Value = std::fs::read_to_string(&timings)
        .expect("timings")
        .lines()
        .next()
        .and_then(|l| serde_json::from_str(l).ok())
        .expect("a timings line");
    let ready_us = first["seen_unix_us"].as_f64().expect("seen")
        + (first["join_ms"].as_f64().expect("join") + first["download_ms"].as_f64().expect("dl"))
            * 1e3;
    let (sent, received) = relay.bytes().await;
    Cost {
        rss,
        startup_ms: (ready_us - spawned_us as f64) / 1e3,
        sent,
        received,
        rounds,
    }
}

/// One Flower client process (and its server) through a relay: the client's cost.
async fn flower(python: &str, certs: &Path, dir: &Path, w: &Workload, rounds: u64) -> Cost {
    let port = free_port();
    let relay = Relay::start(SocketAddr::from(([127, 0, 0, 1], port))).await;
    let (inputs, hidden, classes) = match &w.arch {
        Architecture::Mlp {
            inputs,
            hidden,
            classes,
        } => (*inputs, hidden.clone(), *classes),
        Architecture::Logreg { inputs, classes } => (*inputs, Vec::new(), *classes),
        other => panic!("no Flower model for {other:?}"),
    };
    let t = harness::sgd_training();
    let mut args: Vec<String> = vec!["--data".into(), dir.display().to_string()];
    args.extend(w.flower_data.iter().cloned());
    for (flag, value) in [
        ("--clients", "1".to_string()),
        ("--rounds", rounds.to_string()),
        ("--inputs", inputs.to_string()),
        (
            "--hidden",
            hidden
                .iter()
                .map(|h| h.to_string())
                .collect::<Vec<_>>()
                .join(","),
        ),
        ("--classes", classes.to_string()),
        ("--epochs", t.epochs.to_string()),
        ("--batch-size", t.batch_size.to_string()),
        ("--lr", t.learning_rate.to_string()),
        ("--momentum", "0".into()),
        ("--port", port.to_string()),
        ("--client-port", relay.port.to_string()),
        ("--tls", certs.display().to_string()),
    ] {
        args.extend([flag.to_string(), value]);
    }
    let python = python.to_string();
    let result = tokio::task::spawn_blocking(move || flower::run(&python, &args))
        .await
        .expect("flower run");
    let client = &result["clients"][0];
    let first_fit = client["first_fit_unix"].as_f64().expect("first fit");
    let spawned = client["spawned_unix"].as_f64().expect("spawned");
    let (sent, received) = relay.bytes().await;
    Cost {
        rss: client["peak_rss_kb"].as_u64().expect("peak_rss_kb") * 1024,
        startup_ms: (first_fit - spawned) * 1e3,
        sent,
        received,
        rounds,
    }
}

fn file_size(path: &Path) -> Option<u64> {
    std::fs::metadata(path).ok().map(|m| m.len())
}

/// The release binaries' sizes, and `make dist`'s tarballs when they are there.
fn artefacts() {
    println!("artefacts:");
    if let Some(size) = file_size(&binary("hora-server")) {
        println!(
            "  {:<58} {:8.1} MiB (release binary, unstripped)",
            "hora-server",
            size as f64 / MIB
        );
    }
    let dist = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("dist");
    let mut found = false;
    if let Ok(entries) = std::fs::read_dir(&dist) {
        let mut names: Vec<_> = entries.flatten().map(|e| e.path()).collect();
        names.sort();
        for path in names {
            let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
            let Some(name) = name.filter(|n| n.ends_with(".tar.gz") || n.ends_with(".whl")) else {
                continue;
            };
            if let Some(size) = file_size(&path) {
                found = true;
                println!("  {name:<58} {:8.1} MiB", size as f64 / MIB);
            }
        }
    }
    if !found {
        println!(
            "  (no tarballs in dist/: `make dist` builds them, and this benchmark then lists them)"
        );
    }
}

async fn run() {
    let rounds = harness::env_or("HORA_FOOTPRINT_ROUNDS", 3).max(1) as u64;
    let mnist_samples = harness::env_or("HORA_FOOTPRINT_MNIST", 600).max(10);
    let python = flower::wanted();
    let dir = tempfile::Builder::new()
        .prefix("hora-footprint-")
        .tempdir()
        .expect("tempdir");
    let demo = SyntheticConfig::non_iid(1.0, 1.0, 10, 0);
    flower::write_shards(dir.path(), &demo);
    let demo_samples = hora_client::data::synthetic::shards(&demo).expect("shards")[0]
        .train
        .len();
    let mnist = dir.path().join("mnist");
    mnist::write(&mnist, mnist_samples, 127);
    let workloads = [
        Workload {
            name: "demo-logreg",
            arch: Architecture::Logreg {
                inputs: 60,
                classes: 10,
            },
            data: demo.to_string(),
            flower_data: Vec::new(),
            // Shard 0: the one flower_round.py's client 0 reads.
            client_args: vec!["--client-index".into(), "0".into()],
            samples: demo_samples,
        },
        Workload {
            name: "mnist-mlp",
            arch: Architecture::Mlp {
                inputs: 784,
                hidden: vec![200, 200],
                classes: 10,
            },
            data: format!("mnist:{}", mnist.display()),
            flower_data: vec!["--mnist".into(), mnist.display().to_string()],
            client_args: Vec::new(),
            samples: mnist_samples,
        },
    ];

    artefacts();
    let client = shipped_client(dir.path());
    let server = Server::start_with(&dir.path().join("server"), &[]);
    let certs = server.data_dir.join("certs");
    let mut results = Vec::new();
    for w in &workloads {
        let hora = hora(&server, &client, dir.path(), w, rounds).await;
        let flower = match &python {
            Some(python) => Some(flower(python, &certs, dir.path(), w, rounds).await),
            None => None,
        };
        println!(
            "\n{}: one client, {rounds} rounds, {} training samples",
            w.name, w.samples
        );
        println!("  {}", hora.line("hora"));
        if let Some(f) = &flower {
            println!("  {}", f.line("flower"));
        }
        results.push((w.name, hora, flower));
    }
    println!();
    for (name, hora, flower) in &results {
        if *name == "mnist-mlp" {
            let mb = hora.rss as f64 / 1e6;
            println!(
                "RESULT footprint {name} hora peak RSS = {mb:.0} MB (target < 300: {})",
                if mb < 300.0 { "reached" } else { "NOT reached" }
            );
        }
        if let Some(f) = flower {
            println!(
                "RESULT footprint {name} hora/flower: peak RSS = {:.2}, start-up = {:.2}, bytes sent = {:.2}, bytes received = {:.2}",
                hora.rss as f64 / f.rss as f64,
                hora.startup_ms / f.startup_ms,
                hora.sent as f64 / f.sent as f64,
                hora.received as f64 / f.received as f64,
            );
        }
    }
}
