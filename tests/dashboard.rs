//! The dashboard, tested in a real browser: `dashboard/tests/browser.mjs` drives Debian's
//! Chromium (through playwright-core) against a real `hora-server` while this test runs the
//! federation it watches, one round each time the browser asks; then a session's cookie across
//! restarts, with the same secret and with another. `scripts/setup-dashboard.sh` (which
//! `make test` runs) installs the browser and the npm packages and exports where they are.

mod support;

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};

use hora_common::wire::{
    CreateSyncJob, EvaluationConfig, EvaluationReport, Metrics, SignInLink, SyncJoinRequest,
    TaskInfo,
};
use reqwest::{Method, StatusCode};
use support::{delta, free_port, small_model, task, Client, Server, ADMIN_TOKEN};

/// A tool `scripts/setup-dashboard.sh` installs, from the variable it exports.
fn tool(var: &str) -> PathBuf {
    let path = std::env::var_os(var).map(PathBuf::from).unwrap_or_else(|| {
        panic!("{var} is not set: run `eval \"$(scripts/setup-dashboard.sh --print-env)\"` first (make test does)")
    });
    assert!(path.exists(), "{var}={} does not exist", path.display());
    path
}

fn repository() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn the_committed_dashboard_is_what_its_sources_build() {
    let out = Command::new(tool("HORA_NODE"))
        .arg(repository().join("dashboard/build.mjs"))
        .arg("--check")
        .output()
        .expect("run node");
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Round `r`'s evaluation reports of the two clients: (examples, loss, accuracy).
fn reports(r: u64) -> [(u64, f64, f64); 2] {
    let r = r as f64;
    [
        (100, 1.0 / r, 0.90 - 0.40 / r),
        (300, 1.2 / r, 0.85 - 0.30 / r),
    ]
}

/// Runs round `r`: both clients join and upload, the round publishes, and both evaluate its
/// model. Returns the example-weighted accuracy, computed here from the reports.
async fn round(admin: &support::Api, clients: &[Client; 2], id: &str, r: u64) -> f64 {
    let mut offers = Vec::new();
    for c in clients {
        offers.push(c.join(id).await);
    }
    let (global, _) = clients[0].global(id).await;
    for (k, (c, offer)) in clients.iter().zip(&offers).enumerate() {
        assert_eq!(offer.round, r);
        let body = c.seal(id, offer, &delta(&global, r * 10 + k as u64));
        let metrics = Metrics {
            loss: Some(1.5 / (r as f64 + 1.0) + 0.1 * k as f64),
            accuracy: None,
        };
        let req = c.upload_request_reporting(id, r, 50, body, metrics);
        let _: serde_json::Value = c.api.ok(req).await;
    }
    let mut published = 0;
    for _ in 0..200 {
        let info: TaskInfo = admin
            .ok(admin.request(Method::GET, &format!("/admin/v1/tasks/{id}")))
            .await;
        published = info.published_rounds;
        if published >= r {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(published, r, "round {r} did not publish within 10 s");
    let (mut weighted, mut examples) = (0.0, 0.0);
    for (c, (n, loss, accuracy)) in clients.iter().zip(reports(r)) {
        let report = EvaluationReport {
            num_examples: n,
            loss: Some(loss),
            accuracy: Some(accuracy),
        };
        let req = c
            .api
            .request(Method::POST, &format!("/v1/tasks/{id}/evaluations/{r}"))
            .json(&report);
        let _: serde_json::Value = c.api.ok(req).await;
        weighted += n as f64 * accuracy;
        examples += n as f64;
    }
    weighted / examples
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_in_a_browser_while_a_federation_runs() {
    let (node, chromium) = (tool("HORA_NODE"), tool("HORA_CHROMIUM"));
    // Five rounds here (HORA_DASHBOARD_ROUNDS sets another number).
    let rounds: u64 = std::env::var("HORA_DASHBOARD_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5);
    let shots = support::binary("examples")
        .parent()
        .expect("target dir")
        .join("dashboard-screenshots");
    std::fs::create_dir_all(&shots).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let listen = format!("127.0.0.1:{}", free_port());
    let secret = "a".repeat(64);
    let server = Server::start_on(&data, &listen, &["--dashboard-secret", &secret]);
    let admin = server.api(ADMIN_TOKEN);
    let initial = admin.upload_model(&small_model()).await;
    let mut t = task("fedavg-demo", initial, rounds + 3, 2, 2, 60);
    t.evaluation = Some(EvaluationConfig {
        every: 1,
        clients: 2,
        fraction: None,
        held_out: false,
        deadline_secs: None,
    });
    admin.create_task(&t).await;
    let job = admin
        .create_sync_job(&CreateSyncJob {
            id: "allreduce".into(),
            world_size: 4,
            min_world_size: None,
            settle_ms: None,
        })
        .await;
    // A worker of rank 2 waits in the job's forming world while the browser looks.
    let worker = admin.with_token(job.token.as_deref().expect("the job's token"));
    let waiting = tokio::spawn(
        worker
            .request(Method::POST, "/v1/sync/allreduce/join")
            .json(&SyncJoinRequest {
                address: "10.0.0.7:29503".into(),
                rank: Some(2),
                world_size: 4,
                timeout_s: Some(60),
                rejoin: None,
                elastic: false,
            })
            .send(),
    );
    let clients = [admin.enrol().await, admin.enrol().await];
    let link: SignInLink = admin
        .ok(admin.request(Method::POST, "/admin/v1/dashboard/sign-in-links"))
        .await;

    let mut browser = Command::new(node)
        .arg(repository().join("dashboard/tests/browser.mjs"))
        .env("HORA_URL", &server.url)
        .env("HORA_TOKEN", ADMIN_TOKEN)
        .env("HORA_TASK", &t.id)
        .env("HORA_ROUNDS", rounds.to_string())
        .env("HORA_LINK", format!("{}{}", server.url, link.path))
        .env("HORA_SHOTS", &shots)
        .env("HORA_CHROMIUM", chromium)
        .env("NODE_EXTRA_CA_CERTS", &server.ca)
        .env("NODE_PATH", repository().join("dashboard/node_modules"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start node");
    let mut to_browser = browser.stdin.take().unwrap();
    let (tx, mut lines) = tokio::sync::mpsc::unbounded_channel();
    let from_browser = browser.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(from_browser).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let (mut published, mut done) = (0, false);
    while let Some(line) = lines.recv().await {
        eprintln!("browser: {line}");
        match line.as_str() {
            "HORA publish" => {
                published += 1;
                let accuracy = round(&admin, &clients, &t.id, published).await;
                writeln!(to_browser, "published {published} {accuracy}").unwrap();
            }
            "HORA done" => {
                done = true;
                break;
            }
            _ => {}
        }
    }
    drop(to_browser);
    let status = browser.wait().unwrap();
    assert!(
        status.success() && done,
        "the browser test failed ({status}): see its output above"
    );
    assert_eq!(published, rounds);
    waiting.abort();
    eprintln!("screenshots: {}", shots.display());

    // A session signed in on this server works on one started with the same secret (another
    // replica, or this one restarted) and not on one with another secret.
    let cookie = admin.dashboard_cookie().await;
    let with_cookie = |server: &Server| {
        let api = server.api("");
        let req = api
            .request(Method::GET, "/admin/v1/tasks")
            .header("cookie", cookie.clone());
        async move {
            let r = req.send().await.unwrap();
            (r.status(), r.text().await.unwrap())
        }
    };
    server.kill();
    let same = Server::start_on(&data, &listen, &["--dashboard-secret", &secret]);
    let (status, body) = with_cookie(&same).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    same.kill();
    let other = Server::start_on(&data, &listen, &["--dashboard-secret", &"b".repeat(64)]);
    let (status, body) = with_cookie(&other).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "{body}");
    assert!(body.contains("sign in again"), "{body}");
}
