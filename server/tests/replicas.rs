//! Replicas on one PostgreSQL database (a real server the test starts) with their blobs in one
//! shared directory (`--blobs file://…`): the first `hora-server` process leads, a second stands
//! by, its port answering 503 `standby` to all but its liveness probe. The leader is SIGKILLed
//! with a round half done: the standby takes the lease within the lease's length and two
//! seconds, and the round publishes with every acknowledged update, FedAvg of all of them,
//! though PostgreSQL itself is stopped and started again while it is open. `hora-server status`
//! shows who leads at each step, and a clean stop hands the lease back at once. A leader cut off
//! from the database (through a relay the test cuts) stops acknowledging, and steps down when it
//! is back, while the standby carries on.

mod support;

/// The PostgreSQL server the store's unit tests start, this same file.
#[allow(dead_code)]
#[path = "../src/store/postgres/test_server.rs"]
mod test_server;

/// The S3-compatible server the store's unit tests start, this same file.
#[allow(dead_code)]
#[path = "../src/store/blobs/test_s3.rs"]
mod test_s3;

/// Where `test_s3` finds what it needs of the crate.
mod store {
    pub(crate) mod postgres {
        pub(crate) use crate::test_server;
    }
}

use std::time::{Duration, Instant};

use hora_common::model::Model;
use hora_common::wire::RoundOffer;
use reqwest::Method;
use serde_json::{json, Value};
use support::{Server, Starting};

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

/// The directories of two replicas: a data directory each, and a blob directory and development
/// certificates they share.
struct Dirs {
    shared: tempfile::TempDir,
    data: [tempfile::TempDir; 2],
}

impl Dirs {
    fn new() -> Dirs {
        let dir = || tempfile::tempdir().unwrap();
        Dirs {
            shared: dir(),
            data: [dir(), dir()],
        }
    }

    /// Replica `i` (0 or 1) on `store`, serving (once it leads) on a port of its own.
    fn replica(&self, i: usize, store: &str) -> Starting {
        self.replica_on(i, store, &free_listen())
    }

    /// [`replica`](Self::replica) on `listen`.
    fn replica_on(&self, i: usize, store: &str, listen: &str) -> Starting {
        let blobs = format!("file://{}", self.shared.path().join("blobs").display());
        let certs = self.shared.path().join("certs");
        let mut starting = Server::spawn_on(
            self.data[i].path(),
            listen,
            &[
                "--store",
                store,
                "--blobs",
                &blobs,
                "--lease-secs",
                &LEASE_SECS.to_string(),
                "--certs-dir",
                certs.to_str().unwrap(),
            ],
        );
        starting.ca = certs.join("ca.pem");
        starting
    }
}

/// A loopback address nothing listens on now.
fn free_listen() -> String {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    format!("127.0.0.1:{port}")
}

/// What `url`'s `/readyz` says: `ready`, the code of its refusal, or None without an answer.
async fn readiness(http: &reqwest::Client, url: &str) -> Option<String> {
    let response = http.get(format!("{url}/readyz")).send().await.ok()?;
    if response.status().is_success() {
        return Some("ready".into());
    }
    let error: Value = response.json().await.ok()?;
    error["code"].as_str().map(str::to_string)
}

fn model(values: [f32; 4]) -> Model {
    Model::from_tensors([("w", vec![4], values.to_vec())]).unwrap()
}

/// Creates task `id` (from `initial`, rounds of `n` clients), enrols `n` clients and has each
/// join its first round: the clients and their offers.
async fn round_of(
    admin: &support::Api,
    id: &str,
    initial: Model,
    n: usize,
) -> (Vec<support::Client>, Vec<RoundOffer>) {
    let digest = admin.upload_model(&initial).await;
    admin
        .call(
            Method::POST,
            "/admin/v1/tasks",
            Some(json!({
                "id": id, "initial_model": digest,
                "model": {"kind": "builtin", "name": "mlp"},
                "rounds": 2, "min_clients": n, "target_clients": n, "round_deadline_secs": 600,
            })),
        )
        .await;
    let mut clients = Vec::new();
    for _ in 0..n {
        clients.push(admin.enrol().await);
    }
    let mut offers = Vec::new();
    for c in &clients {
        offers.push(c.join(id).await);
    }
    (clients, offers)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_standby_takes_over_a_killed_leader_and_its_round_publishes_with_every_acknowledged_update(
) {
    let mut postgres = test_server::TestServer::start();
    let store = postgres.url();
    let dirs = Dirs::new();
    let a = dirs.replica(0, &store).listening();
    // On a port the system chooses: the standby says which, and `status` shows it.
    let mut standby = dirs.replica_on(1, &store, "127.0.0.1:0");
    let b_url = standby.standing_by();
    let b_listen = b_url
        .strip_prefix("https://")
        .expect("an https URL")
        .to_string();
    let both = status_until(&store, "a leads, b stands by", |s| {
        s["replicas"].as_array().map(Vec::len) == Some(2)
    });
    assert!(
        both["replicas"][1]["address"]
            .as_str()
            .is_some_and(|a| a.ends_with(&format!(" {b_listen}"))),
        "{both:#}"
    );
    assert_eq!(both["lease"]["epoch"], 1, "{both:#}");
    assert_eq!(both["replicas"][0]["role"], "leader", "{both:#}");
    assert_eq!(both["replicas"][1]["role"], "standby", "{both:#}");
    let a_id = both["lease"]["holder"].as_str().unwrap().to_string();
    assert!(!standby.exited(), "the standby waits");
    // The standby's port answers meanwhile: alive, not ready, and every other request refused
    // with 503 `standby`, worth sending elsewhere or retrying.
    let at_standby = |path: &str| {
        let (http, url) = (a.http(), format!("https://{b_listen}{path}"));
        async move {
            let response = http
                .get(url)
                .bearer_auth(support::ADMIN_TOKEN)
                .send()
                .await?;
            let retry_after = response.headers().get("retry-after").cloned();
            let status = response.status().as_u16();
            Ok::<_, reqwest::Error>((status, retry_after, response.text().await?))
        }
    };
    let probing = Instant::now();
    let (status_code, _, body) = loop {
        match at_standby("/healthz").await {
            Ok(answer) => break answer,
            Err(e) => {
                assert!(
                    probing.elapsed() < Duration::from_secs(10),
                    "the standby does not answer: {e}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    assert_eq!((status_code, body.as_str()), (200, "ok"));
    for path in ["/readyz", "/admin/v1/tasks"] {
        let (status_code, retry_after, body) = at_standby(path).await.unwrap();
        assert_eq!(status_code, 503, "{path}: {body}");
        assert_eq!(retry_after.as_ref().map(|v| v.as_bytes()), Some(&b"1"[..]));
        let error: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(error["code"], "standby", "{path}: {body}");
    }

    // A round of four: two acknowledged by a, which then dies.
    let admin = a.admin();
    let (mut clients, offers) = round_of(&admin, "ha", model([1.0, 2.0, 3.0, 4.0]), 4).await;
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
    let b = standby.listening();
    let takeover = killed.elapsed();
    assert_eq!(b.url, b_url, "it leads on the port it stood by on");
    println!("takeover after the leader's SIGKILL: {takeover:?} (lease {LEASE_SECS} s)");
    assert!(
        takeover < Duration::from_secs(LEASE_SECS + 2),
        "the standby served {takeover:?} after the leader died (lease {LEASE_SECS} s)"
    );
    let led = status(&store);
    assert_eq!(led["lease"]["epoch"], 2, "{led:#}");
    assert_ne!(led["lease"]["holder"], a_id.as_str(), "{led:#}");

    // The other two upload to b: the round holds all four, weighted by examples.
    let admin = b.admin();
    let info = admin.task("ha").await;
    assert_eq!(info.open_round.expect("round 1 is open").accepted, 2);
    for c in clients.iter_mut().skip(2) {
        c.api = support::Api {
            url: b.url.clone(),
            http: b.http(),
            token: c.api.token.clone(),
        };
    }
    clients[2].upload("ha", &offers[2], 3, &deltas[2]).await;
    // PostgreSQL goes away with the round at three of four: the last upload is refused, worth
    // retrying, until it is back; then it is taken, and nothing acknowledged is lost.
    postgres.stop();
    let refused = clients[3].try_upload("ha", &offers[3], 4, &deltas[3]).await;
    assert_eq!(refused, 503);
    postgres.restart();
    let back = Instant::now();
    while clients[3].try_upload("ha", &offers[3], 4, &deltas[3]).await != 200 {
        assert!(
            back.elapsed() < Duration::from_secs(20),
            "the replica did not recover"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
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
    // No checkpoint is left behind by either leader.
    let checkpoints = dirs.shared.path().join("blobs/checkpoints");
    let left: Vec<_> = std::fs::read_dir(&checkpoints)
        .map(|d| d.map(|e| e.unwrap().file_name()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "checkpoints left: {left:?}");

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

/// A TCP relay on loopback to PostgreSQL (or the blob store), standing for the network between
/// one replica and the database: [`cut`](Relay::cut) closes every connection through it and
/// refuses new ones until [`restore`](Relay::restore).
struct Relay {
    port: u16,
    /// Whether it is cut, and the links through it; one lock, so no link outlives a cut.
    state: std::sync::Arc<std::sync::Mutex<(bool, Vec<tokio::task::JoinHandle<()>>)>>,
}

impl Relay {
    async fn to(port: u16) -> Relay {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let relay = Relay {
            port: listener.local_addr().unwrap().port(),
            state: Default::default(),
        };
        let state = relay.state.clone();
        tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                let mut state = state.lock().unwrap();
                if state.0 {
                    continue; // dropped: the connection is refused
                }
                let link = tokio::spawn(async move {
                    if let Ok(mut outbound) =
                        tokio::net::TcpStream::connect(("127.0.0.1", port)).await
                    {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
                state.1.push(link);
            }
        });
        relay
    }

    /// Cuts every link, and returns once each is closed.
    async fn cut(&self) {
        let links: Vec<_> = {
            let mut state = self.state.lock().unwrap();
            state.0 = true;
            state.1.drain(..).collect()
        };
        for link in links {
            link.abort();
            let _ = link.await;
        }
    }

    fn restore(&self) {
        self.state.lock().unwrap().0 = false;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_leader_cut_off_from_the_database_stops_acknowledging_and_steps_down_while_the_standby_carries_on(
) {
    let postgres = test_server::TestServer::start();
    let store = postgres.url();
    let port: u16 = store
        .rsplit(':')
        .next()
        .and_then(|p| p.split('/').next())
        .and_then(|p| p.parse().ok())
        .expect("the server's port");
    let relay = Relay::to(port).await;
    let relayed = store.replace(&format!(":{port}/"), &format!(":{}/", relay.port));
    let dirs = Dirs::new();
    let a = dirs.replica(0, &relayed).listening();
    let standby = dirs.replica(1, &store);
    let both = status_until(&store, "a leads, b stands by", |s| {
        s["replicas"].as_array().map(Vec::len) == Some(2)
    });
    let a_id = both["lease"]["holder"].as_str().unwrap().to_string();

    let admin = a.admin();
    let (clients, offers) = round_of(&admin, "cut", model([0.0; 4]), 3).await;
    let deltas = [
        model([3.0, 0.0, 0.0, 0.0]),
        model([0.0, 3.0, 0.0, 0.0]),
        model([0.0, 0.0, 3.0, 0.0]),
    ];
    clients[0].upload("cut", &offers[0], 1, &deltas[0]).await;

    // a loses the database: an upload it takes now is never acknowledged (folded, its
    // checkpoint pending), and once a whole lease passes without a renewal a stops serving by
    // itself, before the standby can take the lease.
    relay.cut().await;
    let refused = clients[1]
        .try_upload("cut", &offers[1], 1, &deltas[1])
        .await;
    assert_eq!(refused, 503, "a cut-off leader acknowledged an upload");
    let http = a.http();
    let cut = Instant::now();
    while readiness(&http, &a.url).await.as_deref() != Some("standby") {
        assert!(
            cut.elapsed() < Duration::from_secs(LEASE_SECS + 10),
            "the cut-off leader still serves"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let b = standby.listening();
    assert_eq!(status(&store)["lease"]["epoch"], 2);

    // The network comes back: a stands by (it does not take the lease back), and its
    // checkpoint of the unacknowledged upload never lands.
    relay.restore();
    status_until(&store, "a stands by again", |s| {
        s["replicas"].as_array().unwrap().iter().any(|r| {
            r["id"] == a_id.as_str()
                && r["role"] == "standby"
                && r["seen_secs_ago"].as_f64().unwrap() < 2.0
        })
    });
    assert_eq!(status(&store)["lease"]["epoch"], 2);

    // b dies too: a leads again, on what the database holds: the one acknowledged upload.
    b.kill();
    let admin = a.admin();
    let back = Instant::now();
    let info = loop {
        if readiness(&http, &a.url).await.as_deref() == Some("ready") {
            break admin.task("cut").await;
        }
        assert!(
            back.elapsed() < Duration::from_secs(LEASE_SECS + 10),
            "a did not lead again"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(info.open_round.expect("round 1 is open").accepted, 1);
    assert_eq!(status(&store)["lease"]["epoch"], 3);

    // The others upload there, and the published model counts each once.
    for i in 1..3 {
        clients[i].upload("cut", &offers[i], 1, &deltas[i]).await;
    }
    admin.wait_published("cut", 1).await;
    let published = admin.round_model("cut", 1).await;
    for got in &published.data()[..3] {
        assert!((got - 1.0).abs() < 1e-6, "{:?}", published.data());
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_blob_store_outage_is_answered_503_and_loses_nothing_acknowledged() {
    let s3 = test_s3::TestS3::start();
    let port: u16 = s3
        .endpoint()
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("the S3 server's port");
    let relay = Relay::to(port).await;
    let data = tempfile::tempdir().unwrap();
    let endpoint = format!("http://127.0.0.1:{}", relay.port);
    let bucket = format!("s3://{}/outage", test_s3::BUCKET);
    let server = Server::spawn_with(
        data.path(),
        "127.0.0.1:0",
        // (A durability wait far longer than the test: the upload's 503 must come from the
        // failed checkpoint itself.)
        &[
            "--blobs",
            &bucket,
            "--blobs-endpoint",
            &endpoint,
            "--durability-timeout-secs",
            "600",
        ],
        &[
            ("AWS_ACCESS_KEY_ID", test_s3::ACCESS_KEY),
            ("AWS_SECRET_ACCESS_KEY", test_s3::SECRET_KEY),
            ("AWS_REGION", "us-east-1"),
        ],
    )
    .listening();
    let admin = server.admin();
    let (clients, offers) = round_of(&admin, "s3", model([0.0; 4]), 2).await;
    clients[0]
        .upload("s3", &offers[0], 1, &model([2.0, 0.0, 0.0, 0.0]))
        .await;

    // The blob store goes away: the model's download, readiness and the next upload (whose
    // checkpoint cannot be written) are answered 503, worth retrying, within seconds.
    relay.cut().await;
    let http = server.http();
    let asked = Instant::now();
    let download = http
        .get(format!("{}/v1/tasks/s3/model", server.url))
        .bearer_auth(&clients[1].api.token)
        .send()
        .await
        .unwrap();
    assert_eq!(download.status(), 503);
    let error: Value = download.json().await.unwrap();
    assert_eq!(error["code"], "store_unavailable", "{error}");
    assert_eq!(
        readiness(&http, &server.url).await.as_deref(),
        Some("store_unavailable")
    );
    let refused = clients[1]
        .try_upload("s3", &offers[1], 3, &model([0.0, 2.0, 0.0, 0.0]))
        .await;
    assert_eq!(
        refused, 503,
        "an upload was acknowledged without its checkpoint"
    );
    println!("answered within {:?} of the outage", asked.elapsed());
    assert!(asked.elapsed() < Duration::from_secs(30));

    // It comes back: the upload is taken, and the round publishes both, nothing lost.
    relay.restore();
    let back = Instant::now();
    while clients[1]
        .try_upload("s3", &offers[1], 3, &model([0.0, 2.0, 0.0, 0.0]))
        .await
        != 200
    {
        assert!(back.elapsed() < Duration::from_secs(30), "no recovery");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    admin.wait_published("s3", 1).await;
    let published = admin.round_model("s3", 1).await;
    // (1·2 + 3·0)/4 and (1·0 + 3·2)/4.
    assert_eq!(&published.data()[..2], &[0.5, 1.5]);
}
