//! Replicas on one PostgreSQL database (a real server the test starts) with their blobs in one
//! shared directory (`--blobs file://…`): the first `hora-server` process leads, a second stands
//! by without listening. The leader is SIGKILLed with a round half done: the standby takes the
//! lease within the lease's length and two seconds, and the round publishes with every
//! acknowledged update, FedAvg of all of them. `hora-server status` shows who leads at each
//! step, and a clean stop hands the lease back at once.

mod support;

/// The PostgreSQL server the store's unit tests start, this same file.
#[allow(dead_code)]
#[path = "../src/store/postgres/test_server.rs"]
mod test_server;

use std::path::Path;
use std::time::{Duration, Instant};

use hora_common::model::Model;
use reqwest::Method;
use serde_json::{json, Value};
use support::Server;

const LEASE_SECS: u64 = 3;

/// `hora-server status --json` of the database.
fn status(store: &str) -> Value {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_hora-server"))
        .args(["status", "--json", "--store", store])
        .output()
        .expect("hora-server status runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON")
}

/// Polls `status` until `check` holds (ten seconds at most).
fn status_until(store: &str, what: &str, check: impl Fn(&Value) -> bool) -> Value {
    let started = Instant::now();
    loop {
        let s = status(store);
        if check(&s) {
            return s;
        }
        assert!(started.elapsed() < Duration::from_secs(10), "{what}: {s:#}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn replica(store: &str, data: &Path, blobs: &str, certs: &Path) -> Server {
    Server::start_with(
        data,
        &[
            "--store",
            store,
            "--blobs",
            blobs,
            "--lease-secs",
            &LEASE_SECS.to_string(),
            "--certs-dir",
            certs.to_str().unwrap(),
        ],
    )
}

fn model(values: [f32; 4]) -> Model {
    Model::from_tensors([("w", vec![4], values.to_vec())]).unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_standby_takes_over_a_killed_leader_and_its_round_publishes_with_every_acknowledged_update(
) {
    let postgres = test_server::TestServer::start();
    let store = postgres.url();
    let (shared, a_dir, b_dir) = (
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
    );
    let blobs = format!("file://{}", shared.path().display());
    let certs = a_dir.path().join("certs");
    let a = replica(&store, a_dir.path(), &blobs, &certs);
    let standby = {
        let (store, blobs, certs) = (store.clone(), blobs.clone(), certs.clone());
        let dir = b_dir.path().to_path_buf();
        std::thread::spawn(move || replica(&store, &dir, &blobs, &certs))
    };
    let both = status_until(&store, "a leads, b stands by", |s| {
        s["replicas"].as_array().map(Vec::len) == Some(2)
    });
    assert_eq!(both["lease"]["epoch"], 1, "{both:#}");
    assert_eq!(both["replicas"][0]["role"], "leader", "{both:#}");
    assert_eq!(both["replicas"][1]["role"], "standby", "{both:#}");
    let a_id = both["lease"]["holder"].as_str().unwrap().to_string();
    assert!(!standby.is_finished(), "the standby does not listen");

    // A round of four: two acknowledged by a, which then dies.
    let admin = a.admin();
    let digest = admin.upload_model(&model([1.0, 2.0, 3.0, 4.0])).await;
    admin
        .call(
            Method::POST,
            "/admin/v1/tasks",
            Some(json!({
                "id": "ha", "initial_model": digest,
                "model": {"kind": "builtin", "name": "mlp"},
                "rounds": 2, "min_clients": 4, "target_clients": 4, "round_deadline_secs": 600,
            })),
        )
        .await;
    let mut clients = Vec::new();
    for _ in 0..4 {
        clients.push(admin.enrol().await);
    }
    let mut offers = Vec::new();
    for c in &clients {
        offers.push(c.join("ha").await);
    }
    let deltas = [
        model([1.0, 0.0, 0.0, 0.0]),
        model([0.0, 2.0, 0.0, 0.0]),
        model([0.0, 0.0, 3.0, 0.0]),
        model([0.0, 0.0, 0.0, 4.0]),
    ];
    for i in 0..2 {
        clients[i]
            .upload("ha", &offers[i], i as u64 + 1, &deltas[i])
            .await;
    }
    a.kill();
    let killed = Instant::now();
    let mut b = standby.join().expect("the standby leads");
    let takeover = killed.elapsed();
    println!("takeover after the leader's SIGKILL: {takeover:?} (lease {LEASE_SECS} s)");
    assert!(
        takeover < Duration::from_secs(LEASE_SECS + 2),
        "the standby served {takeover:?} after the leader died (lease {LEASE_SECS} s)"
    );
    let led = status(&store);
    assert_eq!(led["lease"]["epoch"], 2, "{led:#}");
    assert_ne!(led["lease"]["holder"], a_id.as_str(), "{led:#}");

    // The other two upload to b: the round holds all four, weighted by examples.
    b.ca = certs.join("ca.pem");
    let admin = b.admin();
    let info = admin.task("ha").await;
    assert_eq!(info.open_round.expect("round 1 is open").accepted, 2);
    for (i, c) in clients.iter_mut().enumerate().skip(2) {
        c.api = support::Api {
            url: b.url.clone(),
            http: b.http(),
            token: c.api.token.clone(),
        };
        c.upload("ha", &offers[i], i as u64 + 1, &deltas[i]).await;
    }
    admin.wait_published("ha", 1).await;
    let published = admin.round_model("ha", 1).await;
    // Σ nᵢ·δᵢ / Σ nᵢ with n = 1, 2, 3, 4.
    let want = [
        1.0 + 1.0 / 10.0,
        2.0 + 4.0 / 10.0,
        3.0 + 9.0 / 10.0,
        4.0 + 16.0 / 10.0,
    ];
    for (got, want) in published.data().iter().zip(want) {
        assert!((got - want).abs() < 1e-6, "{got} != {want}");
    }

    // A clean stop hands the lease back at once and leaves the replica list.
    assert!(b.terminate().success());
    let left = status(&store);
    assert!(
        left["lease"]["expires_in_secs"].as_f64().unwrap() <= 0.0,
        "{left:#}"
    );
    assert!(
        left["replicas"]
            .as_array()
            .unwrap()
            .iter()
            .all(|r| r["id"] != led["lease"]["holder"]),
        "{left:#}"
    );
}
