//! What the dashboard costs, measured in one run against its baselines:
//!
//! 1. Time to first render of a task's page in Debian's Chromium: a task with 10,000 rounds of
//!    history against one with 10 (the page draws the latest 200 rounds first and loads the
//!    rest in pages of 2,000 behind them). Target: under 1 s.
//! 2. Round latency and the server's CPU time while 20 dashboards are open on a task during its
//!    federation, against the same federation with none before and after. Each dashboard is
//!    what the task page asks of the server: its event feed (`/dashboard/api/events`), and the
//!    latest rounds again at every event. (Twenty real Chromium pages on this two-core machine
//!    would measure the browsers' CPU, not the server's.) Target: round latency within 10%.
//!
//! `make bench-dashboard` (also part of `make bench`): needs `scripts/setup-dashboard.sh`'s
//! HORA_NODE and HORA_CHROMIUM, and the release server (`cargo build --release -p hora-server`).

#[path = "../tests/support/mod.rs"]
mod support;

use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use hora_common::model::ModelDigest;
use hora_common::wire::{
    EvaluationSummary, Metrics, RoundOutcome, RoundRecord, TaskInfo, TaskState,
};
use hora_server::store::{Blobs, RoundLog, SledStore, TaskRecord};
use reqwest::Method;
use support::{delta, small_model, task, Api, Client, Server, ADMIN_TOKEN};

const FIRST_RENDER_REPEAT: usize = 5;
const DASHBOARDS: usize = 20;
const ROUNDS_PER_PHASE: u64 = 300;

fn tool(var: &str) -> String {
    std::env::var(var).unwrap_or_else(|_| {
        panic!("{var} is not set: run `eval \"$(scripts/setup-dashboard.sh --print-env)\"` (make bench-dashboard does)")
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Round `round` of a task's history as a federation with evaluation leaves it.
fn entry(round: u64, model: ModelDigest) -> RoundRecord {
    let r = round as f64;
    RoundRecord {
        contributors: None,
        forwarded_to: None,
        round,
        attempt: 0,
        outcome: RoundOutcome::Published,
        participants: vec!["c-0123456789abcdef".into(); 10],
        dropped: vec![],
        examples: 1000,
        metrics: Metrics {
            loss: Some(1.0 / (1.0 + r / 100.0)),
            accuracy: Some(0.9 - 0.4 / (1.0 + r / 100.0)),
        },
        duration_ms: 900,
        model: Some(model),
        pruned: false,
        privacy: None,
        staleness: None,
        compacted: None,
        evaluation: Some(EvaluationSummary {
            clients: 10,
            examples: 500,
            loss: Some(1.1 / (1.0 + r / 100.0)),
            accuracy: Some(0.88 - 0.4 / (1.0 + r / 100.0)),
        }),
    }
}

/// A data directory with tasks `small` (10 published rounds) and `big` (10,000), written
/// through the store as the rounds would have written them.
fn history(data: &std::path::Path) {
    let store = SledStore::open(data).expect("store");
    let model = small_model();
    let digest = store.put_model(&model).expect("model");
    for (id, rounds) in [("small", 10u64), ("big", 10_000)] {
        let mut config = task(id, digest, rounds + 100, 1, 1, 3600);
        config.evaluation = None;
        let mut record = TaskRecord {
            parent: None,
            config,
            spec: model.spec(),
            state: TaskState::Paused,
            published: 0,
            global_model: digest,
            created_unix_ms: 0,
            strategy_state: None,
            dp: None,
            ended_reason: None,
            part: None,
            evaluating: None,
        };
        assert!(store.create_task(id, &record).expect("task"));
        for round in 1..=rounds {
            record.published = round;
            store
                .finish_round(id, &record, &entry(round, digest), 0, None)
                .expect("round");
        }
    }
}

fn first_render() {
    let dir = tempfile::tempdir().expect("temp dir");
    let data = dir.path().join("data");
    let filled = Instant::now();
    history(&data);
    eprintln!(
        "dashboard: 10,010 rounds of history written in {:.1} s",
        filled.elapsed().as_secs_f64()
    );
    let server = Server::start(&data);
    let out = Command::new(tool("HORA_NODE"))
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/dashboard/bench/first-render.mjs"
        ))
        .env("HORA_URL", &server.url)
        .env("HORA_TOKEN", ADMIN_TOKEN)
        .env("HORA_TASKS", "small,big")
        .env("HORA_REPEAT", FIRST_RENDER_REPEAT.to_string())
        .env("HORA_CHROMIUM", tool("HORA_CHROMIUM"))
        .env(
            "NODE_PATH",
            concat!(env!("CARGO_MANIFEST_DIR"), "/dashboard/node_modules"),
        )
        .output()
        .expect("run node");
    assert!(
        out.status.success(),
        "first-render.mjs failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut figures = std::collections::HashMap::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let v: serde_json::Value = serde_json::from_str(line).expect("a JSON line");
        let ms = |k: &str| -> Vec<f64> {
            v[k].as_array()
                .expect("figures")
                .iter()
                .filter_map(|x| x.as_f64())
                .collect()
        };
        figures.insert(
            v["task"].as_str().expect("task").to_string(),
            (median(ms("rendered")), median(ms("complete"))),
        );
    }
    let (small, big) = (figures["small"], figures["big"]);
    println!(
        "dashboard: task page, first render (median of {FIRST_RENDER_REPEAT} loads): 10 rounds {:.0} ms, 10,000 rounds {:.0} ms, ratio {:.2} (target: under 1,000 ms)",
        small.0,
        big.0,
        big.0 / small.0
    );
    println!(
        "dashboard: task page, whole history in its charts: 10 rounds {:.0} ms, 10,000 rounds {:.0} ms",
        small.1, big.1
    );
}

/// The server's CPU time so far (user + system), from /proc.
fn cpu_secs(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("/proc stat");
    // Fields after the command's closing parenthesis; utime and stime are the 12th and 13th.
    let rest = stat.rsplit_once(')').expect("stat").1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap();
    ticks / 100.0
}

/// Runs `rounds` rounds of `id` with `clients`; each round's latency, from the first join to
/// the publication seen by the operator.
async fn rounds(admin: &Api, clients: &[Client], id: &str, rounds: u64) -> Vec<f64> {
    let mut latencies = Vec::new();
    for _ in 0..rounds {
        let started = Instant::now();
        let mut offers = Vec::new();
        for c in clients {
            offers.push(c.join(id).await);
        }
        let target = offers[0].round;
        let (global, _) = clients[0].global(id).await;
        for (k, (c, offer)) in clients.iter().zip(&offers).enumerate() {
            c.upload(id, offer, 50, &delta(&global, target * 10 + k as u64))
                .await;
        }
        loop {
            let info: TaskInfo = admin
                .ok(admin.request(Method::GET, &format!("/admin/v1/tasks/{id}")))
                .await;
            if info.published_rounds >= target {
                break;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        latencies.push(started.elapsed().as_secs_f64() * 1e3);
    }
    latencies
}

/// One open dashboard on task `id`: its feed, and the latest rounds again at every event (as
/// the task page does). Counts the events it saw.
async fn dashboard(admin: Api, id: String, events: Arc<AtomicU64>) {
    let cookie = admin.dashboard_cookie().await;
    let (server_url, http) = (admin.url.clone(), admin.http.clone());
    let get = |path: String| {
        http.get(format!("{server_url}{path}"))
            .header("cookie", cookie.clone())
            .send()
    };
    let info: TaskInfo = get(format!("/admin/v1/tasks/{id}"))
        .await
        .expect("task")
        .json()
        .await
        .expect("json");
    let after = info.published_rounds.saturating_sub(200);
    let _ = get(format!(
        "/admin/v1/tasks/{id}/rounds?after={after}&limit=2000"
    ))
    .await
    .expect("rounds")
    .bytes()
    .await;
    let feed = get("/dashboard/api/events".into()).await.expect("feed");
    let mut body = feed.bytes_stream();
    while let Some(Ok(chunk)) = body.next().await {
        let text = String::from_utf8_lossy(&chunk);
        if !text.contains("event: tasks") {
            continue;
        }
        events.fetch_add(1, Ordering::Relaxed);
        let published = text
            .split("\"published_rounds\":")
            .nth(1)
            .and_then(|s| s.split(',').next())
            .and_then(|s| s.parse::<u64>().ok())
            .unwrap_or(0);
        let after = published.saturating_sub(3);
        if let Ok(r) = get(format!(
            "/admin/v1/tasks/{id}/rounds?after={after}&limit=2000"
        ))
        .await
        {
            let _ = r.bytes().await;
        }
    }
}

async fn fan_out() {
    let dir = tempfile::tempdir().expect("temp dir");
    let server = Server::start(&dir.path().join("data"));
    let admin = server.api(ADMIN_TOKEN);
    let initial = admin.upload_model(&small_model()).await;
    let id = "federation";
    admin
        .create_task(&task(id, initial, 10 * ROUNDS_PER_PHASE, 2, 2, 60))
        .await;
    let clients = [admin.enrol().await, admin.enrol().await];
    rounds(&admin, &clients, id, 5).await; // warm-up
    let phase = |name: &'static str| {
        let (admin, clients) = (&admin, &clients);
        let pid = server.pid();
        async move {
            let cpu = cpu_secs(pid);
            let latencies = rounds(admin, clients, id, ROUNDS_PER_PHASE).await;
            let cpu = (cpu_secs(pid) - cpu) / ROUNDS_PER_PHASE as f64;
            let mean = latencies.iter().sum::<f64>() / latencies.len() as f64;
            eprintln!(
                "dashboard: {name}: round latency median {:.1} ms, mean {mean:.1} ms; server CPU {:.1} ms per round",
                median(latencies.clone()),
                cpu * 1e3
            );
            let secs = latencies.iter().sum::<f64>() / 1e3;
            (median(latencies), cpu, secs)
        }
    };
    let before = phase("no dashboards").await;
    let events = Arc::new(AtomicU64::new(0));
    let open: Vec<_> = (0..DASHBOARDS)
        .map(|_| {
            tokio::spawn(dashboard(
                admin.with_token(""),
                id.to_string(),
                events.clone(),
            ))
        })
        .collect();
    // Every dashboard has its feed before the measured rounds.
    while events.load(Ordering::Relaxed) < DASHBOARDS as u64 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let seen = events.load(Ordering::Relaxed);
    let with = phase("20 dashboards").await;
    let delivered = events.load(Ordering::Relaxed) - seen;
    for d in open {
        d.abort();
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let after = phase("no dashboards again").await;
    let baseline = (before.0 + after.0) / 2.0;
    let baseline_cpu = (before.1 + after.1) / 2.0;
    println!(
        "dashboard: round latency with {DASHBOARDS} dashboards open {:.1} ms against {baseline:.1} ms without (before {:.1}, after {:.1}), ratio {:.3} (target: at most 1.10)",
        with.0,
        before.0,
        after.0,
        with.0 / baseline
    );
    println!(
        "dashboard: server CPU per round with {DASHBOARDS} dashboards {:.1} ms against {:.1} ms without, ratio {:.2}; {delivered} events delivered to them over {ROUNDS_PER_PHASE} rounds in {:.1} s ({:.1} per dashboard per second; the feed sends at most 4)",
        with.1 * 1e3,
        baseline_cpu * 1e3,
        with.1 / baseline_cpu,
        with.2,
        delivered as f64 / (DASHBOARDS as f64 * with.2)
    );
}

fn main() {
    // `cargo test`/`nextest` list and run bench targets without `--bench`: nothing to do then.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    first_render();
    tokio::runtime::Runtime::new()
        .expect("runtime")
        .block_on(fan_out());
}
