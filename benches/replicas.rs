//! Replicas at scale, on this machine: one round of N clients (10,000 and 20,000) served by one
//! `hora-server` and by three replicas sharing a PostgreSQL database (started for the run) and a
//! blob directory; then the failover after a leader's SIGKILL, and the ingest rate of each
//! replica.
//!
//! Clients are simulated in generator processes (this bench's own binary, run again: one process
//! may open at most 20,000 files here), each client with its own HTTPS connection, speaking the
//! client API as the SDK does (enrol, long poll, join, sealed upload). Client `k` talks to
//! replica `k mod R`. Phases:
//! 1. **connect**: every client enrols and holds a long poll open; `connected` is the number of
//!    client connections the replicas report open at once (`hora_connections_open`, summed);
//! 2. **round**: every client joins, seals its update (a 64-parameter delta) and uploads it; the
//!    round latency runs from the first join to the round's publication (the round is full at N,
//!    so it closes as soon as the last update is durable, whichever replica holds it). A client
//!    retries what the SDK retries (no answer, 429 and 503, after the server's `Retry-After`
//!    or a second, jittered, 30 times at most); errors are the requests that still failed, and
//!    must be 0. `retried` counts the retries.
//!
//! Then, on three replicas: **failover** (the leader SIGKILLed; time until a follower serves as
//! the leader), and **ingest**: 32 clients per replica upload a 1M-parameter update (4 MB)
//! each, all at once; each replica's rate is its bytes over the time from the first upload to
//! its last acknowledgement (sealing, TLS, opening, validation, fold and the group commit of
//! its partial included).
//!
//! `make bench-replicas` (`cargo build --release -p hora-server && cargo bench -p hora --bench
//! replicas`). `HORA_BENCH_CLIENTS=10000,20000`, `HORA_BENCH_REPLICAS=1,3` and
//! `HORA_BENCH_GENERATORS=4` change it. Not part of `make bench` (about ten minutes).

#[path = "../tests/support/mod.rs"]
mod support;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hora_common::envelope::{self, Binding};
use hora_common::model::Model;
use hora_common::wire::{Credentials, JoinResponse, UpdateMeta};
use reqwest::Method;
use serde::{Deserialize, Serialize};

const ADMIN: &str = support::ADMIN_TOKEN;
const LEASE_SECS: u64 = 3;

fn main() {
    if std::env::var_os("HORA_LOAD_GENERATOR").is_some() {
        generator::run();
        return;
    }
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let list = |name: &str, default: &str| -> Vec<usize> {
        std::env::var(name)
            .unwrap_or_else(|_| default.into())
            .split(',')
            .filter_map(|v| v.trim().parse().ok())
            .collect()
    };
    let counts = list("HORA_BENCH_CLIENTS", "10000,20000");
    let replicas = list("HORA_BENCH_REPLICAS", "1,3");
    let generators = list("HORA_BENCH_GENERATORS", "4")
        .first()
        .copied()
        .unwrap_or(4)
        .max(1);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    println!("replicas at scale (one round of N clients; {generators} generator processes)");
    println!(
        "{:>7} {:>8} {:>10} {:>12} {:>10} {:>7} {:>8}",
        "clients", "replicas", "connected", "connect (s)", "round (s)", "errors", "retried"
    );
    let mut rows = Vec::new();
    for &n in &counts {
        for &r in &replicas {
            let row = runtime.block_on(round_at_scale(n, r, generators));
            println!(
                "{:>7} {:>8} {:>10} {:>12.1} {:>10.2} {:>7} {:>8}",
                n, r, row.connected, row.connect_secs, row.round_secs, row.errors, row.retried
            );
            rows.push((n, r, row));
        }
    }
    for &n in &counts {
        let one = rows.iter().find(|(m, r, _)| *m == n && *r == 1);
        let three = rows.iter().find(|(m, r, _)| *m == n && *r == 3);
        if let (Some((_, _, one)), Some((_, _, three))) = (one, three) {
            println!(
                "RESULT clients={n} round latency 3 replicas / 1 replica = {:.2} (errors {} and {})",
                three.round_secs / one.round_secs,
                one.errors,
                three.errors
            );
        }
    }
    runtime.block_on(failover_and_ingest(generators));
}

/// What one run measured.
struct Row {
    connected: u64,
    connect_secs: f64,
    round_secs: f64,
    errors: u64,
    retried: u64,
}

/// `r` replicas on a fresh database and blob directory, and the generators' processes.
struct Deployment {
    _postgres: Option<test_server::TestServer>,
    _dirs: Vec<tempfile::TempDir>,
    replicas: Vec<Option<Child>>,
    urls: Vec<String>,
    ca: std::path::PathBuf,
    /// Lines each replica printed on standard output (its role changes).
    said: std::sync::mpsc::Receiver<(usize, String)>,
}

use support::test_server;

impl Deployment {
    /// One server on sled (`r` = 1), or `r` replicas on PostgreSQL and one blob directory.
    fn start(r: usize) -> Deployment {
        let shared = tempfile::tempdir().expect("a temporary directory");
        let certs = shared.path().join("certs");
        let postgres = Some(test_server::TestServer::start());
        let (tx, said) = std::sync::mpsc::channel();
        let mut dirs = Vec::new();
        let mut replicas = Vec::new();
        let mut urls = Vec::new();
        for i in 0..r {
            let dir = tempfile::tempdir().expect("a temporary directory");
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .expect("a free port")
                .port();
            let listen = format!("127.0.0.1:{port}");
            let mut args: Vec<String> = [
                "serve",
                "--listen",
                &listen,
                "--admin-token",
                ADMIN,
                "--certs-dir",
                certs.to_str().expect("UTF-8"),
                "--max-connections",
                "19500",
                "--max-connections-per-source",
                "19500",
                "--max-unauthenticated-per-source",
                "19500",
                "--data-dir",
                dir.path().to_str().expect("UTF-8"),
            ]
            .map(String::from)
            .into();
            if let Some(pg) = &postgres {
                let blobs = format!("file://{}", shared.path().join("blobs").display());
                args.extend(
                    [
                        "--store",
                        &pg.url(),
                        "--blobs",
                        &blobs,
                        "--lease-secs",
                        &LEASE_SECS.to_string(),
                    ]
                    .map(String::from),
                );
            }
            let mut child = Command::new(support::binary("hora-server"))
                .args(&args)
                .env("HORA_LOG", "warn")
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .expect("start hora-server");
            let stdout = child.stdout.take().expect("piped");
            let tx = tx.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                    let _ = tx.send((i, line));
                }
            });
            // The first leads before the others start (it makes the certificates).
            let want = match i {
                0 => "hora-server listening on ",
                _ => "hora-server following on ",
            };
            loop {
                let (who, line) = said
                    .recv_timeout(Duration::from_secs(120))
                    .expect("a replica did not start");
                if who == i && line.starts_with(want) {
                    break;
                }
            }
            urls.push(format!("https://{listen}"));
            replicas.push(Some(child));
            dirs.push(dir);
        }
        dirs.push(shared);
        Deployment {
            _postgres: postgres,
            _dirs: dirs,
            replicas,
            urls,
            ca: certs.join("ca.pem"),
            said,
        }
    }

    fn admin(&self, url: &str) -> support::Api {
        support::Api {
            http: hora_server::tls::https_client(&self.ca, None).expect("https client"),
            url: url.to_string(),
            token: ADMIN.into(),
        }
    }

    /// Creates task `id` (one round of `n` clients, full at `n`) from a model of `params`.
    async fn task(&self, admin: &support::Api, id: &str, n: usize, params: usize) {
        let initial =
            Model::from_tensors([("w", vec![params], vec![0.0f32; params])]).expect("a model");
        let digest = admin.upload_model(&initial).await;
        admin
            .create_task(&support::task(id, digest, 1, n as u32, n as u32, 3600))
            .await;
    }

    /// `n` one-time enrolment tokens, 64 requests at a time.
    async fn tokens(&self, admin: &support::Api, n: usize) -> Vec<String> {
        let admin = Arc::new(admin.clone());
        let mut tokens = Vec::with_capacity(n);
        let mut pending = tokio::task::JoinSet::new();
        for _ in 0..n {
            if pending.len() >= 64 {
                tokens.push(pending.join_next().await.expect("one").expect("joined"));
            }
            let admin = admin.clone();
            pending.spawn(async move { admin.enrolment_token().await });
        }
        while let Some(token) = pending.join_next().await {
            tokens.push(token.expect("joined"));
        }
        tokens
    }

    /// The client connections every replica has open now.
    async fn connected(&self) -> u64 {
        let mut open = 0.0;
        for (url, replica) in self.urls.iter().zip(&self.replicas) {
            if replica.is_some() {
                open += self.admin(url).metric("hora_connections_open").await;
            }
        }
        open as u64
    }

    /// Starts `g` generators for `task`, sharing `tokens` out; client `k` of them all uses
    /// replica `k mod R`.
    fn generators(&self, g: usize, task: &str, tokens: &[String], params: usize) -> Generators {
        let per = tokens.len().div_ceil(g);
        let dir = tempfile::tempdir().expect("a temporary directory");
        let mut children = Vec::new();
        for (i, chunk) in tokens.chunks(per).enumerate() {
            let file = dir.path().join(format!("tokens-{i}"));
            std::fs::write(&file, chunk.join("\n")).expect("write tokens");
            let plan = generator::Plan {
                urls: self.urls.clone(),
                ca: self.ca.clone(),
                task: task.into(),
                tokens: file,
                first: i * per,
                params,
            };
            let child = Command::new(std::env::current_exe().expect("this bench"))
                .env(
                    "HORA_LOAD_GENERATOR",
                    serde_json::to_string(&plan).expect("JSON"),
                )
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .expect("start a generator");
            children.push(child);
        }
        Generators {
            children,
            _dir: dir,
        }
    }
}

impl Drop for Deployment {
    fn drop(&mut self) {
        for child in self.replicas.iter_mut().flatten() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The generator processes of one phase.
struct Generators {
    children: Vec<Child>,
    _dir: tempfile::TempDir,
}

impl Generators {
    /// Waits for every generator's next line (each says it is done with a phase).
    fn said(&mut self) -> Vec<generator::Report> {
        self.children
            .iter_mut()
            .map(|c| {
                let stdout = c.stdout.as_mut().expect("piped");
                let mut line = String::new();
                // One byte at a time would be slow; a line is short and comes once a phase.
                let mut reader = BufReader::new(stdout);
                reader.read_line(&mut line).expect("a generator's line");
                serde_json::from_str(&line)
                    .unwrap_or_else(|e| panic!("a generator said {line:?}: {e}"))
            })
            .collect()
    }

    /// Tells every generator to go on to the next phase.
    fn go(&mut self) {
        for c in &mut self.children {
            let stdin = c.stdin.as_mut().expect("piped");
            stdin.write_all(b"go\n").expect("tell a generator");
            stdin.flush().expect("tell a generator");
        }
    }
}

impl Drop for Generators {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

async fn round_at_scale(n: usize, r: usize, g: usize) -> Row {
    let deployment = Deployment::start(r);
    let admin = deployment.admin(&deployment.urls[0]);
    deployment.task(&admin, "scale", n, 64).await;
    let tokens = deployment.tokens(&admin, n).await;
    let mut generators = deployment.generators(g, "scale", &tokens, 64);
    let started = Instant::now();
    let connected_reports = generators.said();
    let connect_secs = started.elapsed().as_secs_f64();
    let connected = deployment.connected().await;
    let mut errors: u64 = connected_reports.iter().map(|r| r.errors).sum();
    let round = Instant::now();
    generators.go();
    let reports = generators.said();
    errors += reports.iter().map(|r| r.errors).sum::<u64>();
    let retried = reports.iter().map(|r| r.retried).sum::<u64>();
    if let Some(e) = reports.iter().find_map(|r| r.first_error.clone()) {
        eprintln!("first error: {e}");
    }
    let published = wait_published(&admin, "scale", Duration::from_secs(120)).await;
    let round_secs = round.elapsed().as_secs_f64();
    assert!(
        published || errors > 0,
        "the round of {n} clients on {r} replicas did not publish"
    );
    Row {
        connected,
        connect_secs,
        round_secs,
        errors,
        retried,
    }
}

/// Whether `task` published its round within `timeout`.
async fn wait_published(admin: &support::Api, task: &str, timeout: Duration) -> bool {
    let started = Instant::now();
    while started.elapsed() < timeout {
        let info: hora_common::wire::TaskInfo = admin
            .ok(admin.request(Method::GET, &format!("/admin/v1/tasks/{task}")))
            .await;
        if info.published_rounds >= 1 {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

async fn failover_and_ingest(g: usize) {
    let mut deployment = Deployment::start(3);
    // Ingest: 32 clients a replica, each a 4 MB update, all at once.
    let (per, params) = (32, 1_000_000);
    let n = per * 3;
    let admin = deployment.admin(&deployment.urls[0]);
    deployment.task(&admin, "ingest", n, params).await;
    let tokens = deployment.tokens(&admin, n).await;
    let mut generators = deployment.generators(g.min(3), "ingest", &tokens, params);
    generators.said();
    generators.go();
    assert!(wait_published(&admin, "ingest", Duration::from_secs(600)).await);
    let reports = generators.said();
    let mut bytes = [0u64; 3];
    let mut windows = [(u64::MAX, 0u64); 3];
    for report in &reports {
        for (i, sent) in report.per_replica.iter().enumerate() {
            bytes[i] += sent.bytes;
            windows[i].0 = windows[i].0.min(sent.first_us);
            windows[i].1 = windows[i].1.max(sent.last_us);
        }
    }
    let errors: u64 = reports.iter().map(|r| r.errors).sum();
    for i in 0..3 {
        let secs = windows[i].1.saturating_sub(windows[i].0) as f64 / 1e6;
        println!(
            "ingest: replica {i} ({}) took {:.0} MB in {secs:.2} s: {:.3} GB/s",
            if i == 0 { "leader" } else { "follower" },
            bytes[i] as f64 / 1e6,
            bytes[i] as f64 / 1e9 / secs.max(1e-9)
        );
    }
    let total = bytes.iter().sum::<u64>() as f64;
    let window = (windows.iter().map(|w| w.1).max().unwrap_or(0)
        - windows.iter().map(|w| w.0).min().unwrap_or(0)) as f64
        / 1e6;
    println!(
        "RESULT ingest: 3 replicas took {:.0} MB in {window:.2} s ({:.3} GB/s together, errors {errors})",
        total / 1e6,
        total / 1e9 / window.max(1e-9)
    );
    drop(generators);

    // Failover: the leader SIGKILLed; a follower leads.
    if let Some(mut leader) = deployment.replicas[0].take() {
        let _ = leader.kill();
        let _ = leader.wait();
    }
    let killed = Instant::now();
    loop {
        let (who, line) = deployment
            .said
            .recv_timeout(Duration::from_secs(60))
            .expect("no follower took over within a minute");
        if who != 0 && line.starts_with("hora-server listening on ") {
            println!(
                "RESULT failover: replica {who} leads {:.2} s after the leader's SIGKILL (lease {LEASE_SECS} s)",
                killed.elapsed().as_secs_f64()
            );
            break;
        }
    }
}

/// The generator processes: clients of one task, each with its own connection.
mod generator {
    use super::*;

    /// What a generator is to do (its environment variable's JSON).
    #[derive(Serialize, Deserialize)]
    pub struct Plan {
        pub urls: Vec<String>,
        pub ca: std::path::PathBuf,
        pub task: String,
        /// One enrolment token a line.
        pub tokens: std::path::PathBuf,
        /// The index of its first client among all generators' (client k uses replica k mod R).
        pub first: usize,
        /// The update's parameters.
        pub params: usize,
    }

    /// What a generator says at the end of a phase (one JSON line).
    #[derive(Serialize, Deserialize, Default)]
    pub struct Report {
        pub errors: u64,
        /// Requests tried again (no answer, 429, 503).
        pub retried: u64,
        pub first_error: Option<String>,
        /// The bytes it uploaded to each replica, and when the first upload began and the last
        /// was acknowledged (µs since the Unix epoch).
        pub per_replica: Vec<Sent>,
    }

    #[derive(Serialize, Deserialize, Default, Clone)]
    pub struct Sent {
        pub bytes: u64,
        pub first_us: u64,
        pub last_us: u64,
    }

    fn now_us() -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as u64)
    }

    /// Counts errors, keeping the first.
    #[derive(Default)]
    struct Errors {
        count: AtomicU64,
        retried: AtomicU64,
        first: std::sync::Mutex<Option<String>>,
    }

    impl Errors {
        fn add(&self, what: String) {
            self.count.fetch_add(1, Ordering::Relaxed);
            self.first
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .get_or_insert(what);
        }

        fn report(&self, per_replica: Vec<Sent>) -> Report {
            Report {
                errors: self.count.swap(0, Ordering::Relaxed),
                retried: self.retried.swap(0, Ordering::Relaxed),
                first_error: self
                    .first
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .take(),
                per_replica,
            }
        }
    }

    fn say(report: &Report) {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{}", serde_json::to_string(report).expect("JSON"));
        let _ = out.flush();
    }

    fn wait_for_go() {
        let mut line = String::new();
        let _ = std::io::stdin().read_line(&mut line);
    }

    struct Simulated {
        http: reqwest::Client,
        url: String,
        replica: usize,
        token: String,
        id: String,
    }

    pub fn run() {
        let plan: Plan =
            serde_json::from_str(&std::env::var("HORA_LOAD_GENERATOR").expect("the plan"))
                .expect("a plan");
        raise_fd_limit();
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(generate(plan));
    }

    fn raise_fd_limit() {
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit/setrlimit only read and write `limit`.
        unsafe {
            if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 {
                limit.rlim_cur = limit.rlim_max;
                libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
            }
        }
    }

    async fn generate(plan: Plan) {
        let tokens: Vec<String> = std::fs::read_to_string(&plan.tokens)
            .expect("tokens")
            .lines()
            .map(str::to_string)
            .collect();
        let errors = Arc::new(Errors::default());
        let r = plan.urls.len();
        // Phase 1: enrol and hold a long poll open, each client on its own connection.
        let mut enrolling = tokio::task::JoinSet::new();
        let gate = Arc::new(tokio::sync::Semaphore::new(64));
        for (i, token) in tokens.into_iter().enumerate() {
            let k = plan.first + i;
            let replica = k % r;
            let url = plan.urls[replica].clone();
            let ca = plan.ca.clone();
            let (gate, errors) = (gate.clone(), errors.clone());
            enrolling.spawn(async move {
                let _turn = gate.acquire_owned().await.expect("open");
                let http = hora_server::tls::https_client(&ca, None).expect("https client");
                let answer = retried("enrol", &errors, || {
                    http.post(format!("{url}/v1/enrol"))
                        .bearer_auth(&token)
                        .json(&serde_json::json!({}))
                })
                .await;
                match answer {
                    Ok(a) => {
                        let creds: Credentials = a.json().await.expect("credentials");
                        Some(Simulated {
                            http,
                            url,
                            replica,
                            token: format!("{}.{}", creds.client_id, creds.secret),
                            id: creds.client_id,
                        })
                    }
                    Err(e) => {
                        errors.add(e);
                        None
                    }
                }
            });
        }
        let mut clients = Vec::new();
        while let Some(c) = enrolling.join_next().await {
            if let Some(c) = c.expect("joined") {
                clients.push(Arc::new(c));
            }
        }
        // Each holds a long poll (for a round after the open one) until told to go on.
        let polling = tokio_util::sync::CancellationToken::new();
        let mut polls = tokio::task::JoinSet::new();
        let (held_tx, mut held) = tokio::sync::mpsc::unbounded_channel();
        for c in &clients {
            let (c, task, stop, held_tx) = (
                c.clone(),
                plan.task.clone(),
                polling.clone(),
                held_tx.clone(),
            );
            polls.spawn(async move {
                let poll = c
                    .http
                    .get(format!(
                        "{}/v1/tasks/{task}/poll?after=1&wait_ms=30000",
                        c.url
                    ))
                    .bearer_auth(&c.token)
                    .send();
                // Sent (its connection open) once the request is on its way: a moment later.
                let _ = held_tx.send(());
                tokio::select! {
                    _ = poll => {}
                    () = stop.cancelled() => {}
                }
            });
        }
        drop(held_tx);
        for _ in 0..clients.len() {
            let _ = held.recv().await;
        }
        // Give the requests time to reach the servers.
        tokio::time::sleep(Duration::from_secs(2)).await;
        say(&errors.report(Vec::new()));
        wait_for_go();
        polling.cancel();
        while polls.join_next().await.is_some() {}

        // Phase 2: join, seal, upload.
        let per_replica = Arc::new(std::sync::Mutex::new(vec![Sent::default(); r]));
        let mut rounds = tokio::task::JoinSet::new();
        let delta = Arc::new(
            Model::from_tensors([("w", vec![plan.params], vec![0.001f32; plan.params])])
                .expect("a model")
                .to_safetensors(),
        );
        for c in clients {
            let (task, errors, per_replica, delta) = (
                plan.task.clone(),
                errors.clone(),
                per_replica.clone(),
                delta.clone(),
            );
            rounds.spawn(async move {
                if let Err(e) = one_round(&c, &task, &delta, &per_replica, &errors).await {
                    errors.add(e);
                }
            });
        }
        while rounds.join_next().await.is_some() {}
        let sent = per_replica
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        say(&errors.report(sent));
        wait_for_go();
    }

    /// Sends what `make` builds until it is answered with anything but 429 or 503 (or no
    /// answer), as the SDK retries: after the server's `Retry-After` or a second, jittered, 30
    /// times at most.
    async fn retried(
        what: &str,
        errors: &Errors,
        make: impl Fn() -> reqwest::RequestBuilder,
    ) -> Result<reqwest::Response, String> {
        let mut last = String::new();
        for _ in 0..30 {
            let wait = match make().send().await {
                Ok(r) if r.status().is_success() => return Ok(r),
                Ok(r) if matches!(r.status().as_u16(), 429 | 503) => {
                    let secs = r
                        .headers()
                        .get("retry-after")
                        .and_then(|v| v.to_str().ok())
                        .and_then(|v| v.parse::<f64>().ok())
                        .unwrap_or(1.0);
                    last = format!("{what}: {}", r.status());
                    secs
                }
                Ok(r) => {
                    let status = r.status();
                    let body = r.text().await.unwrap_or_default();
                    return Err(format!("{what}: {status}: {body}"));
                }
                Err(e) => {
                    last = format!("{what}: {e}");
                    1.0
                }
            };
            errors.retried.fetch_add(1, Ordering::Relaxed);
            let jitter = 0.5 + rand::random::<f64>();
            tokio::time::sleep(Duration::from_secs_f64(wait * jitter)).await;
        }
        Err(last)
    }

    async fn one_round(
        c: &Simulated,
        task: &str,
        delta: &[u8],
        per_replica: &std::sync::Mutex<Vec<Sent>>,
        errors: &Errors,
    ) -> Result<(), String> {
        let join = retried("join", errors, || {
            c.http
                .post(format!("{}/v1/tasks/{task}/join", c.url))
                .bearer_auth(&c.token)
        })
        .await?;
        let join: JoinResponse = join.json().await.map_err(|e| format!("join: {e}"))?;
        let offer = join.offer.ok_or_else(|| "join: not selected".to_string())?;
        let binding = Binding {
            task,
            round: offer.round,
            client: &c.id,
            base_model: &offer.model,
        };
        let sealed =
            envelope::seal(delta, &offer.round_key, &binding).map_err(|e| e.to_string())?;
        let bytes = sealed.len() as u64;
        let meta = UpdateMeta {
            num_examples: 10,
            metrics: Default::default(),
            contributors: None,
        };
        let started = now_us();
        let meta = serde_json::to_string(&meta).expect("JSON");
        retried("upload", errors, || {
            c.http
                .post(format!(
                    "{}/v1/tasks/{task}/rounds/{}/update",
                    c.url, offer.round
                ))
                .bearer_auth(&c.token)
                .header("x-hora-update", meta.clone())
                .body(sealed.clone())
                .timeout(Duration::from_secs(600))
        })
        .await?;
        let done = now_us();
        let mut sent = per_replica
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let s = &mut sent[c.replica];
        if s.bytes == 0 {
            s.first_us = started;
        }
        s.bytes += bytes;
        s.first_us = s.first_us.min(started);
        s.last_us = s.last_us.max(done);
        Ok(())
    }
}
