//! Replicas on one PostgreSQL database (a real server the test starts) with their blobs in one
//! shared directory (`--blobs file://…`): the first `hora-server` process leads, the others
//! follow, serving clients' joins and uploads of plain rounds (and of asynchronous tasks) and
//! answering 503 `standby` to the rest (the admin API). The leader is SIGKILLed with a round half done: a follower takes the
//! lease within the lease's length and two seconds, and the round publishes with every
//! acknowledged update, FedAvg of all of them, though PostgreSQL itself is stopped and started
//! again while it is open. Three replicas serve one round's clients together, each folding the
//! uploads it takes into a durable partial: a follower and then the leader are SIGKILLed, and the
//! round still publishes FedAvg of every acknowledged update, none twice. `hora-server status`
//! shows who leads at each step, and a clean stop hands the lease back at once. A leader cut off
//! from the database (through a relay the test cuts) stops acknowledging, and steps down when it
//! is back, while the other replica carries on. An asynchronous (FedBuff) task's clients join
//! at one replica and upload at another, and every version is the staleness-weighted average of
//! the buffer its history lists.

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

/// The directories of three replicas: a data directory each, and a blob directory and
/// development certificates they share.
struct Dirs {
    shared: tempfile::TempDir,
    data: [tempfile::TempDir; 3],
}

impl Dirs {
    fn new() -> Dirs {
        let dir = || tempfile::tempdir().unwrap();
        Dirs {
            shared: dir(),
            data: [dir(), dir(), dir()],
        }
    }

    /// Replica `i` (0 to 2) on `store`, serving (once it leads) on a port of its own.
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
    // On a port the system chooses: the follower says which, and `status` shows it.
    let mut standby = dirs.replica_on(1, &store, "127.0.0.1:0");
    let b_url = standby.following();
    let b_listen = b_url
        .strip_prefix("https://")
        .expect("an https URL")
        .to_string();
    let both = status_until(&store, "a leads, b follows", |s| {
        s["replicas"].as_array().map(Vec::len) == Some(2) && s["replicas"][1]["role"] == "follower"
    });
    assert!(
        both["replicas"][1]["address"]
            .as_str()
            .is_some_and(|a| a.ends_with(&format!(" {b_listen}"))),
        "{both:#}"
    );
    assert_eq!(both["lease"]["epoch"], 1, "{both:#}");
    assert_eq!(both["replicas"][0]["role"], "leader", "{both:#}");
    let a_id = both["lease"]["holder"].as_str().unwrap().to_string();
    assert!(!standby.exited(), "the follower waits to lead");
    // The follower's port answers meanwhile: alive and ready (it serves clients), and the admin
    // API refused with 503 `standby`, worth sending to the leader or retrying.
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
    let (status_code, _, body) = at_standby("/readyz").await.unwrap();
    assert_eq!(status_code, 200, "{body}");
    for path in ["/admin/v1/tasks", "/dashboard"] {
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

/// Three replicas on one database of their own: a leads, b and c follow on ports of their own.
struct Trio {
    postgres: test_server::TestServer,
    store: String,
    dirs: Dirs,
    a: Server,
    b: Starting,
    c: Starting,
    /// a's, b's and c's.
    urls: [String; 3],
}

impl Trio {
    fn start() -> Trio {
        let postgres = test_server::TestServer::start();
        let store = postgres.url();
        let dirs = Dirs::new();
        let a = dirs.replica(0, &store).listening();
        let mut b = dirs.replica_on(1, &store, "127.0.0.1:0");
        let mut c = dirs.replica_on(2, &store, "127.0.0.1:0");
        let urls = [a.url.clone(), b.following(), c.following()];
        Trio {
            postgres,
            store,
            dirs,
            a,
            b,
            c,
            urls,
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn three_replicas_serve_one_round_and_it_publishes_every_acknowledged_update_through_a_followers_and_the_leaders_sigkill(
) {
    let Trio {
        postgres: _postgres,
        store: _,
        dirs,
        a,
        b,
        c,
        urls,
    } = Trio::start();
    let http = a.http();
    let at = |client: &mut support::Client, url: &str| {
        client.api = support::Api {
            url: url.to_string(),
            http: http.clone(),
            token: client.api.token.clone(),
        };
    };

    // One round of six clients, two on each replica (their joins and uploads there).
    let admin = a.admin();
    let digest = admin.upload_model(&model([1.0, 2.0, 3.0, 4.0])).await;
    admin
        .call(
            Method::POST,
            "/admin/v1/tasks",
            Some(json!({
                "id": "trio", "initial_model": digest,
                "model": {"kind": "builtin", "name": "mlp"},
                "rounds": 1, "min_clients": 6, "target_clients": 6, "over_selection": 0.0,
                "round_deadline_secs": 600,
            })),
        )
        .await;
    let mut clients = Vec::new();
    for i in 0..7 {
        let mut client = admin.enrol().await;
        at(&mut client, &urls[i % 3]);
        clients.push(client);
    }
    let mut offers = Vec::new();
    for client in &clients[..6] {
        offers.push(client.join("trio").await);
    }
    // The round's capacity holds across replicas: a seventh client finds it full at each.
    for url in &urls {
        at(&mut clients[6], url);
        let answer = clients[6]
            .api
            .call(Method::POST, "/v1/tasks/trio/join", None)
            .await;
        assert!(answer["offer"].is_null(), "{url}: {answer}");
    }
    let delta = |i: usize| {
        let i = i as f32;
        model([i + 1.0, -i, 0.5 * i, 1.0 / (i + 1.0)])
    };
    let examples = |i: usize| i as u64 + 1;

    // c's two clients are acknowledged (its partial is durable), and c dies.
    for i in [2, 5] {
        clients[i]
            .upload("trio", &offers[i], examples(i), &delta(i))
            .await;
    }
    drop(c);
    // b's first client and a's first client.
    clients[1]
        .upload("trio", &offers[1], examples(1), &delta(1))
        .await;
    clients[0]
        .upload("trio", &offers[0], examples(0), &delta(0))
        .await;
    // A retry of c's client at a (its receipt lost) is recognised, not folded twice.
    at(&mut clients[2], &urls[0]);
    let again = clients[2]
        .try_upload("trio", &offers[2], examples(2), &delta(2))
        .await;
    assert_eq!(again, 409, "a retry at another replica");

    // The leader dies with the round at four of six: b, which followed, takes the lease.
    a.kill();
    let killed = Instant::now();
    let b = b.listening();
    let takeover = killed.elapsed();
    println!(
        "takeover by a follower after the leader's SIGKILL: {takeover:?} (lease {LEASE_SECS} s)"
    );
    assert!(
        takeover < Duration::from_secs(LEASE_SECS + 2),
        "the follower led {takeover:?} after the leader died (lease {LEASE_SECS} s)"
    );
    // b's own client, retried there now that b leads: its update is in b's partial already.
    let again = clients[1]
        .try_upload("trio", &offers[1], examples(1), &delta(1))
        .await;
    assert_eq!(
        again, 409,
        "a retry at the replica that took it, now leading"
    );
    for i in [3, 4] {
        at(&mut clients[i], &b.url);
        clients[i]
            .upload("trio", &offers[i], examples(i), &delta(i))
            .await;
    }

    // Full across replicas, the round closes before its deadline, and publishes FedAvg of all
    // six: the dead follower's partial, the dead leader's checkpoint, b's partial from when it
    // followed and what it took as the leader.
    let admin = b.admin();
    admin.wait_published("trio", 1).await;
    let published = admin.round_model("trio", 1).await;
    let total: u64 = (0..6).map(examples).sum();
    let initial = [1.0f64, 2.0, 3.0, 4.0];
    for (j, got) in published.data().iter().enumerate() {
        let mean: f64 = (0..6)
            .map(|i| examples(i) as f64 * f64::from(delta(i).data()[j]))
            .sum::<f64>()
            / total as f64;
        let want = initial[j] + mean;
        assert!(
            (f64::from(*got) - want).abs() <= 1e-6 * want.abs().max(1.0),
            "parameter {j}: {got} != {want}"
        );
    }
    let history = admin
        .call(Method::GET, "/admin/v1/tasks/trio/rounds", None)
        .await;
    let entry = &history[0];
    assert_eq!(entry["contributors"], 6, "{entry}");
    assert_eq!(entry["examples"], total, "{entry}");
    assert_eq!(
        entry["participants"].as_array().map(Vec::len),
        Some(6),
        "{entry}"
    );
    assert_eq!(
        entry["dropped"].as_array().map(Vec::len),
        Some(0),
        "{entry}"
    );
    // No partial's or checkpoint's blob is left behind.
    let checkpoints = dirs.shared.path().join("blobs/checkpoints");
    let left: Vec<_> = std::fs::read_dir(&checkpoints)
        .map(|d| d.map(|e| e.unwrap().file_name()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "checkpoints left: {left:?}");
}

/// Waits until each replica at `urls` serves version `version` of `task` (asked with `client`'s
/// credentials), twenty seconds at most.
async fn serving(client: &support::Client, urls: &[String], task: &str, version: u64) {
    for url in urls {
        let api = support::Api {
            url: url.clone(),
            ..client.api.clone()
        };
        let started = Instant::now();
        loop {
            let poll = api
                .call(Method::GET, &format!("/v1/tasks/{task}/poll"), None)
                .await;
            if poll["open_round"] == version {
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "{url} does not serve version {version}: {poll}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// An asynchronous (FedBuff) task whose seven clients each join at one replica and upload at
/// another: buffers of three fill across the replicas, a version is published when its buffer
/// is full wherever its updates were taken, and each version is the staleness-weighted average
/// of its buffer, computed here independently (`n·(1 + s)^-½`, relative 1e-6). A retry at a
/// third replica is refused as in, and an update three versions stale as too stale.
#[tokio::test(flavor = "multi_thread")]
async fn an_asynchronous_task_across_three_replicas_publishes_the_staleness_weighted_versions_of_its_buffers(
) {
    const TASK: &str = "fedbuff";
    let Trio {
        postgres: _postgres,
        store,
        dirs: _dirs,
        a,
        b,
        c,
        urls,
    } = Trio::start();
    let http = a.http();
    let at = |client: &support::Client, replica: usize| support::Client {
        api: support::Api {
            url: urls[replica % 3].clone(),
            http: http.clone(),
            token: client.api.token.clone(),
        },
        id: client.id.clone(),
    };

    let admin = a.admin();
    let initial = model([1.0, -2.0, 0.5, 4.0]);
    let digest = admin.upload_model(&initial).await;
    admin
        .call(
            Method::POST,
            "/admin/v1/tasks",
            Some(json!({
                "id": TASK, "initial_model": digest,
                "model": {"kind": "builtin", "name": "mlp"},
                "rounds": 10, "min_clients": 1, "target_clients": 3, "round_deadline_secs": 600,
                "asynchronous": {
                    "buffer_size": 3, "max_staleness": 2, "concurrency": 8,
                    "staleness": {"kind": "polynomial", "exponent": 0.5},
                },
            })),
        )
        .await;
    // Client k joins at replica k and uploads at replica k + 1 (of three).
    let mut clients = Vec::new();
    let mut offers = Vec::new();
    for k in 0..7 {
        let client = at(&admin.enrol().await, k);
        offers.push(client.join(TASK).await);
        clients.push(client);
    }
    let delta = |seed: u64| {
        let s = seed as f32;
        model([s, -0.5 * s, 1.0 / s, 0.25 * s * s])
    };
    // (client, base version, examples, delta) of each acknowledged update.
    let mut updates: Vec<(String, u64, u64, Model)> = Vec::new();
    // An upload, sent again while it is answered 503 (as the SDK does): a replica that had not
    // recorded it when its version closed asks for it again, for the next version.
    let mut up = |k: usize, examples: u64, seed: u64, offers: &[RoundOffer]| {
        let (client, offer) = (at(&clients[k], k + 1), offers[k].clone());
        updates.push((client.id.clone(), offer.round, examples, delta(seed)));
        async move {
            let started = Instant::now();
            loop {
                match client
                    .try_upload(TASK, &offer, examples, &delta(seed))
                    .await
                {
                    200 => return,
                    503 if started.elapsed() < Duration::from_secs(20) => {
                        tokio::time::sleep(Duration::from_millis(50)).await
                    }
                    status => panic!("client {k}'s upload was answered {status}"),
                }
            }
        }
    };

    // Version 1's buffer, one update at each replica; client 1's retry at a third is in.
    up(0, 10, 1, &offers).await;
    up(1, 20, 2, &offers).await;
    let refused = |k: usize, replica: usize, offer: &RoundOffer, seed: u64| {
        let (client, offer) = (at(&clients[k], replica), offer.clone());
        async move {
            let plaintext = delta(seed).to_safetensors();
            client.upload_plaintext(TASK, &offer, 10, &plaintext).await
        }
    };
    let (status, again) = refused(1, 0, &offers[1], 2).await;
    assert_eq!(status, 409, "a retry at another replica: {again}");
    assert!(again.contains("already_contributed"), "{again}");
    up(2, 30, 3, &offers).await;
    serving(&clients[0], &urls, TASK, 2).await;
    // Version 2's: client 3 trained from version 1, client 0 from version 2, client 4 from 1.
    up(3, 10, 4, &offers).await;
    offers[0] = clients[0].join(TASK).await;
    assert_eq!(offers[0].round, 2);
    up(0, 10, 5, &offers).await;
    up(4, 40, 6, &offers).await;
    serving(&clients[0], &urls, TASK, 3).await;
    // Version 3's: client 1 from version 3, client 5 from version 1 (two versions stale, the
    // most allowed: the key of version 1 is at every replica), client 2 from version 3.
    offers[1] = clients[1].join(TASK).await;
    up(1, 20, 7, &offers).await;
    up(5, 10, 8, &offers).await;
    offers[2] = clients[2].join(TASK).await;
    up(2, 5, 9, &offers).await;
    serving(&clients[0], &urls, TASK, 4).await;
    let history = admin
        .call(Method::GET, &format!("/admin/v1/tasks/{TASK}/rounds"), None)
        .await;
    let bases: Vec<Vec<u64>> = history
        .as_array()
        .expect("the history")
        .iter()
        .map(|h| serde_json::from_value(h["staleness"]["bases"].clone()).expect("bases"))
        .map(|mut bases: Vec<u64>| {
            bases.sort_unstable();
            bases
        })
        .collect();
    assert_eq!(bases, [[1, 1, 1], [1, 1, 2], [1, 3, 3]], "{history}");
    // Version 4's buffer fills at the leader while client 0 uploads at b: b may fold it into
    // version 4 before the leader seals it (a buffer one larger), or after (it asks for the
    // update again, for version 5), or into version 5.
    for k in [0, 3, 4, 5] {
        offers[k] = clients[k].join(TASK).await;
    }
    up(3, 10, 11, &offers).await;
    up(4, 20, 12, &offers).await;
    let (filling, racing) = (up(5, 30, 13, &offers), up(0, 10, 14, &offers));
    tokio::join!(filling, racing);
    // Client 6, still on version 1, is at least three versions behind now.
    let (status, stale) = refused(6, 1, &offers[6], 10).await;
    assert_eq!(status, 409, "an update three versions stale: {stale}");
    assert!(stale.contains("too_stale"), "{stale}");

    // Version 5 fills with what version 4 left of the two racing updates (one of them, unless
    // both made version 4's buffer one larger).
    admin.wait_published(TASK, 4).await;
    let fourth = admin
        .call(Method::GET, &format!("/admin/v1/tasks/{TASK}/rounds"), None)
        .await[3]["participants"]
        .clone();
    let carried: Vec<usize> = [0, 5]
        .into_iter()
        .filter(|k| {
            !fourth
                .as_array()
                .expect("participants")
                .contains(&json!(clients[*k].id))
        })
        .collect();
    serving(&clients[0], &urls, TASK, 5).await;
    let fillers = [3, 4, 5, 0].into_iter().filter(|k| !carried.contains(k));
    for (seed, k) in (15..).zip(fillers.take(3 - carried.len())) {
        offers[k] = clients[k].join(TASK).await;
        up(k, 10, seed, &offers).await;
    }

    // A leader that sealed version 6 (it was closing it) dies before the close is recorded: no
    // replica can add to the version, and it has no deadline, so the replica that takes the
    // lease closes it at once, with the update a follower recorded before it died too.
    admin.wait_published(TASK, 5).await;
    serving(&clients[0], &urls, TASK, 6).await;
    offers[1] = clients[1].join(TASK).await;
    up(1, 10, 20, &offers).await;
    let (db, connection) = tokio_postgres::connect(&store, tokio_postgres::NoTls)
        .await
        .expect("a connection to the test's database");
    tokio::spawn(connection);
    db.execute(
        "INSERT INTO round_seals (task, round, attempt) VALUES ($1, 6, 0)
         ON CONFLICT (task) DO UPDATE SET round = 6, attempt = 0",
        &[&TASK],
    )
    .await
    .expect("a seal");
    // (c, whose partial holds the update, dies first: b alone can take the lease.)
    drop(c);
    a.kill();
    let b = b.listening();
    let admin = b.admin();
    admin.wait_published(TASK, 6).await;

    // Independently: each version from the one before and the updates its history lists, each
    // weighted by its example count and (1 + staleness)^-½; every acknowledged update is in
    // exactly one version.
    let history = admin
        .call(Method::GET, &format!("/admin/v1/tasks/{TASK}/rounds"), None)
        .await;
    let mut global: Vec<f64> = initial.data().iter().map(|v| f64::from(*v)).collect();
    let mut counted = Vec::new();
    for entry in history.as_array().expect("the history") {
        let version = entry["round"].as_u64().expect("a version");
        let participants: Vec<String> =
            serde_json::from_value(entry["participants"].clone()).expect("participants");
        let bases: Vec<u64> =
            serde_json::from_value(entry["staleness"]["bases"].clone()).expect("bases");
        let buffer: Vec<_> = participants
            .iter()
            .zip(&bases)
            .map(|(client, base)| {
                counted.push((client.clone(), *base));
                updates
                    .iter()
                    .find(|(c, b, _, _)| c == client && b == base)
                    .unwrap_or_else(|| panic!("version {version} holds an update never sent"))
            })
            .collect();
        let total: f64 = buffer.iter().map(|(_, _, n, _)| *n as f64).sum();
        for (j, g) in global.iter_mut().enumerate() {
            let sum: f64 = buffer
                .iter()
                .map(|(_, base, n, d)| {
                    let w = (1.0 + (version - base) as f64).powf(-0.5);
                    *n as f64 * w * f64::from(d.data()[j])
                })
                .sum();
            *g += sum / total;
        }
        let published = admin.round_model(TASK, version).await;
        for (j, (got, want)) in published.data().iter().zip(&global).enumerate() {
            assert!(
                (f64::from(*got) - want).abs() <= 1e-6 * want.abs().max(1.0),
                "version {version}, parameter {j}: {got} != {want}"
            );
        }
        // (The next version builds on what was published, as the server's does.)
        global = published.data().iter().map(|v| f64::from(*v)).collect();
    }
    counted.sort();
    let mut sent: Vec<_> = updates.iter().map(|(c, b, _, _)| (c.clone(), *b)).collect();
    sent.sort();
    assert_eq!(counted, sent, "{history}");
    println!("racing updates carried from version 4 into 5: {carried:?}");
    drop(b);
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
    status_until(&store, "a follows again", |s| {
        s["replicas"].as_array().unwrap().iter().any(|r| {
            r["id"] == a_id.as_str()
                && r["role"] == "follower"
                && r["seen_secs_ago"].as_f64().unwrap() < 2.0
        })
    });
    assert_eq!(status(&store)["lease"]["epoch"], 2);

    // b dies too: a leads again (its admin API answers: a follower's refuses), on what the
    // database holds: the one acknowledged upload.
    b.kill();
    let admin = a.admin();
    let back = Instant::now();
    let info = loop {
        let answer = http
            .get(format!("{}/admin/v1/tasks/cut", a.url))
            .bearer_auth(support::ADMIN_TOKEN)
            .send()
            .await;
        if answer.is_ok_and(|r| r.status().is_success()) {
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
