//! Hostile-load benchmark: honest clients run rounds against the real release `hora-server` on
//! loopback TLS, first alone, then while attackers hold idle and half-open connections, stall
//! upload bodies and send poisoned (NaN and huge-norm) updates. Prints the honest round latency
//! both ways and their ratio, what happened to each kind of attack, the attackers' connections
//! still held at the end, and the server's peak RSS. Then, in the same run: unauthenticated
//! stalled bodies over HTTP/1.1 and HTTP/2 (the server's RSS growth, connections held at the
//! end), honest rounds beside a client uploading at the rate floor and beside a join flood (their
//! latency against the calm run's), and `/healthz` while a 1 GiB model is published.
//!
//! `cargo build --release -p hora-server && cargo bench -p hora --bench hostile`
//! (`HORA_BENCH_ROUNDS`, `HORA_BENCH_IDLE_CONNECTIONS`, `HORA_BENCH_UNAUTHENTICATED`,
//! `HORA_BENCH_PUBLISH_MIB` change the sizes).

#[path = "../tests/support/mod.rs"]
mod support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hora_common::model::Model;
use hora_common::wire::{NormPolicy, PollResponse, UpdateBounds};
use reqwest::{Method, StatusCode};
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const HONEST: usize = 10;
const STALLERS: usize = 5;
const POISONERS: usize = 5;
const IDLE_TIMEOUT_SECS: u64 = 4;

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[derive(Default)]
struct Attacks {
    idle_opened: AtomicUsize,
    stalled_cut: AtomicUsize,
    /// Other answers to stalled bodies, by status line.
    stalled_other: std::sync::Mutex<std::collections::BTreeMap<String, usize>>,
    poisoned_refused: AtomicUsize,
    poisoned_accepted: AtomicUsize,
}

/// Runs rounds of the honest clients, `rounds` at least and for `at_least` at least; returns
/// each round's latency: from the first join to the next round being open (every honest update
/// durable and the round published).
async fn honest_rounds(
    task: &str,
    honest: &[Client],
    model: &Model,
    first: u64,
    (rounds, at_least): (u64, Duration),
    during_round: impl Fn(u64) -> Vec<tokio::task::JoinHandle<()>>,
) -> Vec<Duration> {
    let mut latencies = Vec::new();
    let phase = Instant::now();
    for round in first.. {
        if round >= first + rounds && phase.elapsed() >= at_least {
            break;
        }
        let started = Instant::now();
        let attacks = during_round(round);
        let mut uploads = Vec::new();
        for (i, c) in honest.iter().enumerate() {
            let (c, model, task) = (
                Client {
                    api: c.api.clone(),
                    id: c.id.clone(),
                },
                model.clone(),
                task.to_string(),
            );
            uploads.push(tokio::spawn(async move {
                let offer = c.join(&task).await;
                assert_eq!(offer.round, round, "honest client {i} joined another round");
                c.upload(&task, &offer, 10, &delta(&model, round * 100 + i as u64))
                    .await;
            }));
        }
        for u in uploads {
            u.await.expect("honest upload");
        }
        // The next round is open: this one is published.
        let p: PollResponse = honest[0]
            .api
            .ok(honest[0].api.request(
                Method::GET,
                &format!("/v1/tasks/{task}/poll?after={round}&wait_ms=10000"),
            ))
            .await;
        assert_eq!(p.open_round, Some(round + 1), "round {round} not published");
        latencies.push(started.elapsed());
        for a in attacks {
            a.abort();
        }
    }
    latencies
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn summary(latencies: &[Duration]) -> (Duration, Duration, Duration) {
    let mut s = latencies.to_vec();
    s.sort();
    (
        percentile(&s, 0.5),
        percentile(&s, 0.95),
        *s.last().expect("rounds"),
    )
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// A row of the latency table: `phase`, its rounds, their p50, p95 and max.
fn row(phase: &str, latencies: &[Duration]) {
    let (p50, p95, max) = summary(latencies);
    println!(
        "| {phase} | {} | {:.1} | {:.1} | {:.1} |",
        latencies.len(),
        ms(p50),
        ms(p95),
        ms(max)
    );
}

/// The RESULT line of a phase's honest round latency against the calm run's.
fn ratios(phase: &str, latencies: &[Duration], calm: &[Duration], note: &str) {
    let ((p50, p95, _), (c50, c95, _)) = (summary(latencies), summary(calm));
    println!(
        "RESULT honest round latency {phase} / alone: p50 {:.2}, p95 {:.2}{note}",
        ms(p50) / ms(c50),
        ms(p95) / ms(c95)
    );
}

fn peak_rss_mib(pid: u32) -> f64 {
    peak_rss(pid).map_or(f64::NAN, |bytes| bytes as f64 / (1 << 20) as f64)
}

fn main() {
    // `cargo test`/`nextest` list and run bench targets without `--bench`: nothing to do then.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime")
        .block_on(run());
}

async fn run() {
    let rounds = env_or("HORA_BENCH_ROUNDS", 20) as u64;
    let idle = env_or("HORA_BENCH_IDLE_CONNECTIONS", 400);
    let dir = tempfile::tempdir().expect("tempdir");
    let server = Server::start_with(
        dir.path(),
        &[
            "--idle-timeout-secs",
            &IDLE_TIMEOUT_SECS.to_string(),
            "--header-timeout-secs",
            "4",
            "--upload-grace-secs",
            "3",
            "--request-timeout-secs",
            "120",
            "--durability-timeout-secs",
            "120",
        ],
    );
    let admin = server.api(ADMIN_TOKEN);
    let model = small_model();
    let digest = admin.upload_model(&model).await;
    let mut config = task(
        "hostile",
        digest,
        1_000_000,
        HONEST as u32,
        HONEST as u32,
        60,
    );
    // Room for the attackers among the selected, so they are in the same rounds as the honest.
    // Over-norm updates are refused rather than clipped: a clipped update is accepted and
    // counts towards the round's target, which would close rounds on the attackers' updates
    // and leave honest clients out; the round latency measured here is that of the honest ten.
    config.over_selection = (STALLERS + POISONERS) as f64 / HONEST as f64;
    config.update_bounds = UpdateBounds {
        max_norm: Some(10.0),
        on_norm_exceeded: NormPolicy::Refuse,
        ..Default::default()
    };
    admin.create_task(&config).await;
    let mut honest = Vec::new();
    for _ in 0..HONEST {
        honest.push(admin.enrol().await);
    }
    let mut stallers = Vec::new();
    for _ in 0..STALLERS {
        stallers.push(Arc::new(admin.enrol().await));
    }
    let mut poisoners = Vec::new();
    for _ in 0..POISONERS {
        poisoners.push(Arc::new(admin.enrol().await));
    }

    // Warm-up round, then the baseline.
    honest_rounds("hostile", &honest, &model, 1, (1, Duration::ZERO), |_| {
        Vec::new()
    })
    .await;
    let calm = honest_rounds(
        "hostile",
        &honest,
        &model,
        2,
        (rounds, Duration::ZERO),
        |_| Vec::new(),
    )
    .await;

    // The attack: idle and half-open connections held (and reopened when the server closes
    // them) for the whole phase, and in every round stalled bodies and poisoned updates.
    let attacks = Arc::new(Attacks::default());
    let stop_idle = Arc::new(tokio::sync::Notify::new());
    let server = Arc::new(server);
    let mut idlers = Vec::new();
    for i in 0..idle {
        let (server, attacks, stop) = (server.clone(), attacks.clone(), stop_idle.clone());
        idlers.push(tokio::spawn(async move {
            let mut held = Vec::new();
            loop {
                let mut conn = raw_tls(&server).await;
                attacks.idle_opened.fetch_add(1, Ordering::Relaxed);
                if i % 2 == 0 {
                    let _ = conn.write_all(b"POST /v1/enrol HTT").await;
                    let _ = conn.flush().await;
                }
                let mut buf = [0u8; 512];
                tokio::select! {
                    // Closed by the server: open another.
                    _ = conn.read(&mut buf) => {}
                    _ = stop.notified() => { held.push(conn); return held; }
                }
            }
        }));
    }
    // Stallers, throughout the phase: each joins the open round, sends an upload's head and four
    // bytes of its body, and waits for the answer; then does it again.
    let mut stalling = Vec::new();
    for s in &stallers {
        let (s, server, model, attacks) =
            (s.clone(), server.clone(), model.clone(), attacks.clone());
        stalling.push(tokio::spawn(async move {
            loop {
                let offer = s.try_join("hostile").await;
                let Some(offer) = offer else {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                };
                let body = s.seal("hostile", &offer, &delta(&model, offer.round));
                let mut conn = raw_tls(&server).await;
                let head = upload_head(&s, "hostile", offer.round, body.len());
                let _ = conn.write_all(head.as_bytes()).await;
                let _ = conn.write_all(&body[..4]).await;
                let _ = conn.flush().await;
                let mut got = Vec::new();
                let mut buf = [0u8; 1024];
                while let Ok(n) = conn.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                    got.extend_from_slice(&buf[..n]);
                    if String::from_utf8_lossy(&got).contains('}') {
                        break;
                    }
                }
                let text = String::from_utf8_lossy(&got);
                if text.starts_with("HTTP/1.1 408") && text.contains("upload_too_slow") {
                    attacks.stalled_cut.fetch_add(1, Ordering::Relaxed);
                } else {
                    let code = text
                        .split("\"code\":\"")
                        .nth(1)
                        .and_then(|c| c.split('"').next())
                        .unwrap_or("");
                    let status = format!(
                        "{} {code}",
                        text.lines().next().unwrap_or("connection closed")
                    );
                    *attacks
                        .stalled_other
                        .lock()
                        .expect("lock")
                        .entry(status)
                        .or_default() += 1;
                }
            }
        }));
    }
    let rounds_under_attack = {
        let (poisoners, model, attacks) = (poisoners.clone(), model.clone(), attacks.clone());
        move |_round: u64| {
            let mut tasks = Vec::new();
            for (k, p) in poisoners.iter().enumerate() {
                let (p, model, attacks) = (p.clone(), model.clone(), attacks.clone());
                tasks.push(tokio::spawn(async move {
                    let Some(offer) = p.try_join("hostile").await else {
                        return;
                    };
                    let mut bad = Model::zeros(&model.spec());
                    if k % 2 == 0 {
                        bad.data_mut()[k] = f32::NAN;
                    } else {
                        bad.data_mut().fill(3e38);
                    }
                    let resp = p
                        .upload_request(
                            "hostile",
                            offer.round,
                            u64::MAX,
                            p.seal("hostile", &offer, &bad),
                        )
                        .send()
                        .await;
                    match resp.map(|r| r.status()) {
                        Ok(StatusCode::BAD_REQUEST) => {
                            attacks.poisoned_refused.fetch_add(1, Ordering::Relaxed);
                        }
                        Ok(StatusCode::OK) => {
                            attacks.poisoned_accepted.fetch_add(1, Ordering::Relaxed);
                        }
                        _ => {}
                    }
                }));
            }
            tasks
        }
    };
    // Let the idle connections build up first.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let first = 2 + rounds;
    // Long enough for the server to close idle connections (which the attackers reopen) and to
    // cut stalled bodies off, several times over.
    let attack_phase = Duration::from_secs(3 * IDLE_TIMEOUT_SECS);
    let attacked = honest_rounds(
        "hostile",
        &honest,
        &model,
        first,
        (rounds, attack_phase),
        rounds_under_attack,
    )
    .await;
    for s in stalling {
        s.abort();
    }
    let mut next = first + attacked.len() as u64;

    // Stop reopening; every attacker connection still held must be closed by the server
    // within the idle timeout.
    stop_idle.notify_waiters();
    let mut held = Vec::new();
    for i in idlers {
        held.extend(i.await.unwrap_or_default());
    }
    tokio::time::sleep(Duration::from_secs(IDLE_TIMEOUT_SECS + 2)).await;
    let mut still_open = 0;
    for conn in &mut held {
        let mut buf = [0u8; 64];
        match tokio::time::timeout(Duration::from_millis(50), conn.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => {}
            _ => still_open += 1,
        }
    }
    let published: serde_json::Value = admin
        .ok(admin.request(Method::GET, "/admin/v1/tasks/hostile"))
        .await;
    let published = published["published_rounds"].as_u64().unwrap_or(0);
    let finite = admin
        .round_model("hostile", published)
        .await
        .data()
        .iter()
        .all(|v| v.is_finite());
    let rss = peak_rss_mib(server.pid());
    let clients: Vec<serde_json::Value> = admin
        .ok(admin.request(Method::GET, "/admin/v1/clients"))
        .await;
    let quarantined = clients
        .iter()
        .filter(|c| !c["quarantined"].is_null())
        .count();

    // Unauthenticated stalled bodies.
    let unauthenticated = env_or("HORA_BENCH_UNAUTHENTICATED", 150);
    let unauth = unauthenticated_stalls(&server, unauthenticated).await;

    // Honest rounds beside a client uploading a larger model at the rate floor.
    let large = Model::from_tensors([("w", vec![2 << 20], vec![0.0f32; 2 << 20])]).expect("model");
    let large_digest = admin.upload_model(&large).await;
    admin
        .create_task(&task("floor", large_digest, 1, 1, 1, 60))
        .await;
    let slow = floor_rate_uploader(server.clone(), admin.enrol().await, "floor", large, 60);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let floored = honest_rounds(
        "hostile",
        &honest,
        &model,
        next,
        (rounds, Duration::ZERO),
        |_| Vec::new(),
    )
    .await;
    let slow_still_sending = !slow.is_finished();
    slow.abort();
    next += floored.len() as u64;

    // Honest rounds beside a join flood on another task.
    admin
        .create_task(&task("flooded", digest, 1_000_000, 1, 1, 60))
        .await;
    let mut flooders = Vec::new();
    for _ in 0..20 {
        flooders.push(admin.enrol().await);
    }
    let (flood, joins) = join_flood(flooders, "flooded");
    let flood_started = Instant::now();
    let flooded = honest_rounds(
        "hostile",
        &honest,
        &model,
        next,
        (rounds, Duration::ZERO),
        |_| Vec::new(),
    )
    .await;
    let join_rate = joins.load(Ordering::Relaxed) as f64 / flood_started.elapsed().as_secs_f64();
    for f in flood {
        f.abort();
    }

    // `/healthz` calm, then while a large model is published.
    let mut calm_healthz = Vec::new();
    let count = Arc::new(AtomicUsize::new(0));
    calm_healthz
        .extend(healthz_while(&server, || count.fetch_add(1, Ordering::Relaxed) >= 40).await);
    let mib = env_or("HORA_BENCH_PUBLISH_MIB", 1024);
    let (mut during, publication) = publish_large(&admin, &server, &honest[0], mib).await;
    calm_healthz.sort();
    during.sort();

    println!("hostile-load benchmark: {HONEST} honest clients, small MLP (356 parameters), release hora-server on loopback TLS");
    println!("attack: {STALLERS} clients stalling upload bodies (4 bytes of a whole update) and {idle} idle/half-open TLS connections throughout (reopened when closed), {POISONERS} poisoned updates per round (NaN, 3e38 everywhere, num_examples = u64::MAX); attack phase at least {} s", 3 * IDLE_TIMEOUT_SECS);
    println!();
    println!("| phase | rounds | p50 ms | p95 ms | max ms |");
    println!("|---|---|---|---|---|");
    row("honest alone", &calm);
    row("under attack", &attacked);
    println!();
    ratios("under attack", &attacked, &calm, "");
    println!(
        "idle/half-open connections opened by attackers: {} ({idle} at a time; each closed by the server is reopened)",
        attacks.idle_opened.load(Ordering::Relaxed)
    );
    println!(
        "stalled bodies: {} cut off with 408 upload_too_slow, otherwise: {:?} (those still stalling when the phase ended are not counted)",
        attacks.stalled_cut.load(Ordering::Relaxed),
        attacks.stalled_other.lock().expect("lock")
    );
    println!(
        "poisoned updates: {} refused (400), {} accepted; published model finite: {finite}",
        attacks.poisoned_refused.load(Ordering::Relaxed),
        attacks.poisoned_accepted.load(Ordering::Relaxed)
    );
    println!(
        "RESULT attacker connections held at the end: {still_open} of {} ({} s after the attack stopped)",
        held.len(),
        IDLE_TIMEOUT_SECS + 2
    );
    println!("RESULT server peak RSS: {rss:.1} MiB");
    println!(
        "poisoners quarantined (after 5 refused updates in a row): {quarantined} of {POISONERS}"
    );
    println!();
    println!("second-pass attacks, in the same run:");
    println!(
        "RESULT unauthenticated stalled bodies ({unauthenticated} over HTTP/1.1 and {unauthenticated} HTTP/2 streams, 1 MiB declared, 1 MiB - 1 sent, no token): server RSS growth {:.1} MiB, answered 401 {} of {}, attacker connections held at the end {} (HTTP/1.1) + {} (HTTP/2 streams unanswered)",
        unauth.rss_growth_mib,
        unauth.answered,
        2 * unauthenticated,
        unauth.held_h1,
        unauth.unanswered_h2
    );
    println!("| phase | rounds | p50 ms | p95 ms | max ms |");
    println!("|---|---|---|---|---|");
    row("honest alone", &calm);
    row(&format!("beside a floor-rate uploader (8 MiB model, deadline 60 s; still sending at the end: {slow_still_sending})"), &floored);
    row(
        &format!("beside a join flood (20 clients, {join_rate:.0} joins/s answered)"),
        &flooded,
    );
    ratios(
        "beside a floor-rate uploader",
        &floored,
        &calm,
        " (target p95 <= 2)",
    );
    ratios("beside a join flood", &flooded, &calm, "");
    println!(
        "RESULT /healthz p99 while a {mib} MiB model is uploaded, checkpointed and published ({:.1} s, {} requests): {:.1} ms; calm: {:.1} ms",
        publication.as_secs_f64(),
        during.len(),
        ms(percentile(&during, 0.99)),
        ms(percentile(&calm_healthz, 0.99))
    );
}

// -- The second pass's attacks (issue 21), each in its own phase of the same run ------------

/// The server's resident set now (VmRSS), in MiB.
fn rss_now_mib(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        })
        .map_or(f64::NAN, |kib| kib / 1024.0)
}

/// A request body that sends `len` bytes of a JSON object and then never finishes.
fn nearly_complete(len: usize) -> reqwest::Body {
    struct Stall(Option<Vec<u8>>);
    impl futures_core::Stream for Stall {
        type Item = Result<Vec<u8>, std::io::Error>;
        fn poll_next(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Self::Item>> {
            match self.0.take() {
                Some(body) => std::task::Poll::Ready(Some(Ok(body))),
                None => std::task::Poll::Pending,
            }
        }
    }
    let mut body = b"{\"rank\":0,\"address\":\"".to_vec();
    body.resize(len, b'a');
    reqwest::Body::wrap_stream(Stall(Some(body)))
}

/// What became of unauthenticated stalled bodies.
struct Unauthenticated {
    rss_growth_mib: f64,
    answered: usize,
    held_h1: usize,
    unanswered_h2: usize,
}

/// `n` HTTP/1.1 connections and `n` HTTP/2 streams (from another loopback address) each send
/// a sync join for a job that does not exist with no token and a nearly complete 1 MiB body,
/// then stall. Nothing may be buffered for them, and nothing held once the idle timeout passed.
async fn unauthenticated_stalls(server: &Server, n: usize) -> Unauthenticated {
    const MIB: usize = 1 << 20;
    let before = rss_now_mib(server.pid());
    let answered = Arc::new(AtomicUsize::new(0));
    let mut h1 = Vec::new();
    for _ in 0..n {
        let mut conn = raw_tls_from(server, "127.0.0.3").await;
        let head = format!("POST /v1/sync/nojob/join HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: {MIB}\r\n\r\n");
        let mut body = head.into_bytes();
        body.extend(std::iter::repeat_n(b'a', MIB - 1));
        // The server may answer (and stop reading) before the body is in: do not wait on it.
        let _ = tokio::time::timeout(Duration::from_secs(2), conn.write_all(&body)).await;
        h1.push(conn);
    }
    let mut tls = hora_common::tls::client_config(&server.ca, None).expect("tls config");
    tls.alpn_protocols = vec![b"h2".to_vec()];
    let h2 = reqwest::Client::builder()
        .use_preconfigured_tls(tls)
        .http2_prior_knowledge()
        .local_address(Some(
            "127.0.0.3".parse::<std::net::IpAddr>().expect("an address"),
        ))
        .build()
        .expect("an HTTP/2 client");
    let mut streams = Vec::new();
    for _ in 0..n {
        let (h2, url, answered) = (h2.clone(), server.url.clone(), answered.clone());
        streams.push(tokio::spawn(async move {
            let sent = h2
                .post(format!("{url}/v1/sync/nojob/join"))
                .header("content-type", "application/json")
                .header("content-length", (1 << 20).to_string())
                .body(nearly_complete((1 << 20) - 1))
                .send()
                .await;
            if sent.is_ok_and(|r| r.status() == StatusCode::UNAUTHORIZED) {
                answered.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let rss_growth_mib = rss_now_mib(server.pid()) - before;
    tokio::time::sleep(Duration::from_secs(IDLE_TIMEOUT_SECS + 2)).await;
    let mut held_h1 = 0;
    for conn in &mut h1 {
        let mut buf = [0u8; 4096];
        let answer = async {
            loop {
                match conn.read(&mut buf).await {
                    Ok(0) | Err(_) => return true, // closed
                    Ok(_) => {}                    // the 401, then the close
                }
            }
        };
        if tokio::time::timeout(Duration::from_millis(100), answer)
            .await
            .is_err()
        {
            held_h1 += 1;
        }
    }
    let unanswered_h2 = streams.iter().filter(|s| !s.is_finished()).count();
    for s in streams {
        s.abort();
    }
    let h1_answered = h1.len() - held_h1;
    Unauthenticated {
        rss_growth_mib,
        answered: answered.load(Ordering::Relaxed) + h1_answered,
        held_h1,
        unanswered_h2,
    }
}

/// A client selected for a task of a larger model uploads it at just above the rate floor (its
/// body would take the whole round deadline), for as long as it is let to.
fn floor_rate_uploader(
    server: Arc<Server>,
    client: Client,
    task: &'static str,
    model: Model,
    deadline_secs: u64,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let offer = client.join(task).await;
        let body = client.seal(task, &offer, &delta(&model, 9));
        let rate = (body.len() as f64 / deadline_secs as f64).max(16.0 * 1024.0) * 1.1;
        let mut conn = raw_tls(&server).await;
        let head = upload_head(&client, task, offer.round, body.len());
        let _ = conn.write_all(head.as_bytes()).await;
        let chunk = (rate / 10.0) as usize;
        for piece in body.chunks(chunk.max(1)) {
            if conn.write_all(piece).await.is_err() {
                return;
            }
            let _ = conn.flush().await;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
}

/// `clients` clients joining task `task` again and again, as fast as they are answered.
fn join_flood(
    clients: Vec<Client>,
    task: &'static str,
) -> (Vec<tokio::task::JoinHandle<()>>, Arc<AtomicUsize>) {
    let joins = Arc::new(AtomicUsize::new(0));
    let flood = clients
        .into_iter()
        .map(|c| {
            let joins = joins.clone();
            tokio::spawn(async move {
                loop {
                    let _ = c
                        .api
                        .request(Method::POST, &format!("/v1/tasks/{task}/join"))
                        .send()
                        .await;
                    joins.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    (flood, joins)
}

/// `/healthz` latencies, one every 50 ms, until `until` says stop.
async fn healthz_while(server: &Server, until: impl Fn() -> bool) -> Vec<Duration> {
    let http = hora_server::tls::https_client(&server.ca, None).expect("client");
    let mut took = Vec::new();
    while !until() {
        let asked = Instant::now();
        let ok = http
            .get(format!("{}/healthz", server.url))
            .timeout(Duration::from_secs(30))
            .send()
            .await
            .is_ok_and(|r| r.status() == StatusCode::OK);
        assert!(ok, "/healthz did not answer");
        took.push(asked.elapsed());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    took
}

/// One round of a task with a model of `mib` MiB, its delta uploaded by `writer`: `/healthz`
/// latencies while it is uploaded, checkpointed and published, and how long that took.
async fn publish_large(
    admin: &Api,
    server: &Server,
    writer: &Client,
    mib: usize,
) -> (Vec<Duration>, Duration) {
    let params = mib << 18;
    let big = Model::from_tensors([("w", vec![params], vec![0.0f32; params])]).expect("model");
    let digest = admin.upload_model(&big).await;
    admin
        .create_task(&task("large-publish", digest, 1, 1, 1, 600))
        .await;
    let offer = writer.join("large-publish").await;
    let sealed = writer.seal("large-publish", &offer, &delta(&big, 3));
    drop(big);
    let started = Instant::now();
    let upload = writer
        .upload_request("large-publish", offer.round, 10, sealed)
        .timeout(Duration::from_secs(600))
        .send();
    let published = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watch = {
        let (admin, published) = (admin.clone(), published.clone());
        tokio::spawn(async move {
            let receipt = upload.await.expect("the large upload");
            assert_eq!(receipt.status(), StatusCode::OK, "the large upload");
            loop {
                let info: serde_json::Value = admin
                    .ok(admin.request(Method::GET, "/admin/v1/tasks/large-publish"))
                    .await;
                if info["published_rounds"].as_u64() == Some(1) {
                    published.store(true, Ordering::SeqCst);
                    return;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    let healthz = healthz_while(server, || published.load(Ordering::SeqCst)).await;
    watch.await.expect("the publication");
    (healthz, started.elapsed())
}
