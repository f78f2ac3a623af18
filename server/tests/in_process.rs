//! The server started in-process — `Server::build(config)` and `run(listener, shutdown)` — as
//! an embedding program or a unit-level test would: it serves a federated round over real TLS on
//! loopback, stops when its shutdown future resolves, and a second server built on the same data
//! directory carries on from what the first made durable. Once with the embedded sled store, once
//! with its records in PostgreSQL (`--store postgres://…`, a real server the test starts), once
//! with its blobs in an object store (`--blobs file://…`).

mod support;

/// The PostgreSQL server the store's unit tests start, this same file.
#[allow(dead_code)]
#[path = "../src/store/postgres/test_server.rs"]
mod test_server;

use std::net::TcpListener;
use std::path::Path;

use hora_common::model::Model;
use hora_server::config::ServeConfig;
use hora_server::Server;
use serde_json::json;
use support::{Api, ADMIN_TOKEN};
use tokio::sync::oneshot;

fn config(data_dir: &Path, store: Option<&str>, blobs: Option<&str>) -> ServeConfig {
    let mut args = vec![
        "--data-dir".into(),
        data_dir.as_os_str().to_owned(),
        "--listen".into(),
        "127.0.0.1:0".into(),
        "--admin-token".into(),
        ADMIN_TOKEN.into(),
    ];
    for (flag, value) in [("--store", store), ("--blobs", blobs)] {
        if let Some(value) = value {
            args.extend([flag.into(), value.into()]);
        }
    }
    ServeConfig::from_args::<_, std::ffi::OsString>(args).expect("a configuration")
}

/// Builds and runs a server on a free loopback port; returns its admin API, the signal that
/// stops it, and the task that ends when it has stopped.
fn start(
    data_dir: &Path,
    store: Option<&str>,
    blobs: Option<&str>,
) -> (
    Api,
    oneshot::Sender<()>,
    tokio::task::JoinHandle<anyhow::Result<hora_server::Stopped>>,
) {
    let server = Server::build(config(data_dir, store, blobs)).expect("a built server");
    assert!(
        server.generated_admin_token.is_none(),
        "the token was given"
    );
    let ca = server.dev_ca.clone().expect("development certificates");
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("https://{}", listener.local_addr().unwrap());
    let (stop, stopped) = oneshot::channel::<()>();
    let running = tokio::spawn(server.run(listener, async {
        let _ = stopped.await;
    }));
    let api = Api {
        http: hora_server::tls::https_client(&ca, None).expect("an HTTPS client"),
        url,
        token: ADMIN_TOKEN.into(),
    };
    (api, stop, running)
}

fn model(values: [f32; 4]) -> Model {
    Model::from_tensors([("w", vec![4], values.to_vec())]).unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn an_in_process_server_runs_rounds_stops_on_its_signal_and_resumes_from_its_data() {
    runs_rounds_stops_and_resumes(None, None).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn an_in_process_server_with_blobs_in_an_object_store_runs_rounds_and_resumes() {
    let blobs = tempfile::tempdir().unwrap();
    let url = format!("file://{}", blobs.path().display());
    runs_rounds_stops_and_resumes(None, Some(&url)).await;
    // Every blob went to the object store: models (uploaded, published), the checkpoint.
    let models = std::fs::read_dir(blobs.path().join("blobs/models")).unwrap();
    assert_eq!(
        models.count(),
        3,
        "the initial model and two published rounds'"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn an_in_process_server_on_postgres_runs_rounds_stops_and_resumes_from_the_database() {
    let postgres = test_server::TestServer::start();
    runs_rounds_stops_and_resumes(Some(&postgres.url()), None).await;
}

/// `/readyz`'s status and body.
async fn readyz(api: &Api) -> (u16, String) {
    let answer = api
        .http
        .get(format!("{}/readyz", api.url))
        .send()
        .await
        .expect("an answer");
    let status = answer.status().as_u16();
    (status, answer.text().await.unwrap_or_default())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_second_server_stands_by_and_readiness_follows_the_database() {
    let mut postgres = test_server::TestServer::start();
    let dir = tempfile::tempdir().unwrap();
    let (admin, stop, running) = start(dir.path(), Some(&postgres.url()), None);
    assert_eq!(readyz(&admin).await.0, 200);
    // A second server on the same database and data directory stands by while the first
    // leads, until told to stop.
    let (same, url) = (dir.path().to_path_buf(), postgres.url());
    let second = tokio::task::spawn_blocking(move || {
        let asked = std::time::Instant::now();
        Server::build_unless(config(&same, Some(&url), None), &|| {
            asked.elapsed() > std::time::Duration::from_secs(2)
        })
        .map(|_| ())
    });
    let stood_by = second
        .await
        .unwrap()
        .expect_err("a second server on one database stands by");
    assert!(
        matches!(
            stood_by.downcast_ref(),
            Some(hora_server::store::StoreError::Stopped)
        ),
        "{stood_by:#}"
    );
    // One with its own data directory and no --blobs could not serve the records' blobs: it
    // is refused at start, not when it would take over.
    let (other, url) = (tempfile::tempdir().unwrap(), postgres.url());
    let refused = tokio::task::spawn_blocking(move || {
        Server::build_unless(config(other.path(), Some(&url), None), &|| false).map(|_| ())
    });
    let refused = format!("{:#}", refused.await.unwrap().expect_err("refused"));
    assert!(
        refused.contains("were written with blobs this data directory does not hold"),
        "{refused}"
    );
    postgres.stop();
    let (status, body) = readyz(&admin).await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("store_unavailable"), "{body}");
    let healthz = admin.http.get(format!("{}/healthz", admin.url)).send();
    assert_eq!(healthz.await.unwrap().status().as_u16(), 200);
    // Back by itself once the database is.
    postgres.restart();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while readyz(&admin).await.0 != 200 {
        assert!(std::time::Instant::now() < deadline, "not ready again");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    stop.send(()).unwrap();
    running.await.unwrap().unwrap();
}

/// Two rounds with two clients; the server is stopped with round 2 half done and a second one
/// on the same data (`store`: the records' PostgreSQL, else sled; `blobs`: where `--blobs`
/// says, else the data directory) finishes it.
async fn runs_rounds_stops_and_resumes(store: Option<&str>, blobs: Option<&str>) {
    let dir = tempfile::tempdir().unwrap();
    let (admin, stop, running) = start(dir.path(), store, blobs);
    assert_eq!(readyz(&admin).await, (200, "ready".to_string()));
    let initial = model([1.0, 2.0, 3.0, 4.0]);
    let digest = admin.upload_model(&initial).await;
    admin
        .call(
            reqwest::Method::POST,
            "/admin/v1/tasks",
            Some(json!({
                "id": "inproc", "initial_model": digest,
                "model": {"kind": "builtin", "name": "mlp"},
                "rounds": 3, "min_clients": 2, "target_clients": 2, "round_deadline_secs": 600,
            })),
        )
        .await;
    let (a, b) = (admin.enrol().await, admin.enrol().await);
    let (da, db) = (model([1.0, 0.0, 0.0, 0.0]), model([0.0, 0.0, 0.0, 3.0]));
    let offer = a.join("inproc").await;
    b.join("inproc").await;
    a.upload("inproc", &offer, 1, &da).await;
    b.upload("inproc", &offer, 2, &db).await;
    admin.wait_published("inproc", 1).await;
    // FedAvg weighted by examples: (1·da + 2·db) / 3.
    let published = admin.round_model("inproc", 1).await;
    let want = [1.0 + 1.0 / 3.0, 2.0, 3.0, 4.0 + 2.0];
    for (got, want) in published.data().iter().zip(want) {
        assert!((got - want).abs() < 1e-6, "{got} != {want}");
    }
    // Round 2: one update acknowledged (durable), then the server is stopped.
    let offer = a.join("inproc").await;
    assert_eq!(offer.round, 2);
    b.join("inproc").await;
    a.upload("inproc", &offer, 1, &da).await;
    stop.send(()).unwrap();
    running
        .await
        .expect("the server task")
        .expect("a clean stop");
    assert!(
        admin
            .http
            .get(format!("{}/healthz", admin.url))
            .send()
            .await
            .is_err(),
        "a stopped server still answers"
    );

    // A new server on the same data: round 2 goes on with a's update in it.
    let (admin, stop, running) = start(dir.path(), store, blobs);
    let info = admin.task("inproc").await;
    assert_eq!(info.published_rounds, 1);
    let open = info.open_round.expect("round 2 is open");
    assert_eq!((open.round, open.accepted), (2, 1));
    let b = support::Client {
        api: Api {
            url: admin.url.clone(),
            http: admin.http.clone(),
            token: b.api.token.clone(),
        },
        id: b.id,
    };
    let offer = b.join("inproc").await;
    b.upload("inproc", &offer, 2, &db).await;
    admin.wait_published("inproc", 2).await;
    let second = admin.round_model("inproc", 2).await;
    for (got, (first, want_delta)) in
        second
            .data()
            .iter()
            .zip(published.data().iter().zip([1.0 / 3.0, 0.0, 0.0, 2.0]))
    {
        assert!((got - (first + want_delta)).abs() < 1e-6, "{got}");
    }
    stop.send(()).unwrap();
    running.await.unwrap().unwrap();
    // The records were where `store` said: the data directory has a sled database only with sled.
    assert_eq!(dir.path().join("db").exists(), store.is_none());
    // And the blobs where `blobs` said: none under the data directory with --blobs.
    assert_eq!(dir.path().join("blobs").exists(), blobs.is_none());
}

/// `POST /admin/v1/tasks` with `config`: the status and the body.
async fn try_create(admin: &Api, config: &serde_json::Value) -> (u16, String) {
    let resp = admin
        .http
        .post(format!("{}/admin/v1/tasks", admin.url))
        .bearer_auth(&admin.token)
        .json(config)
        .send()
        .await
        .expect("an answer");
    let status = resp.status().as_u16();
    (status, resp.text().await.unwrap_or_default())
}

/// A task that takes compressed updates publishes exactly the weighted average of what its
/// updates decode to, computed here from what each encoding left out (delta − residual, not the
/// server's decoder); the norm bound clips on the decoded values. An asynchronous task takes
/// 4-bit updates the same way. A plain update, another codec's, or a compressed update to a
/// plain task is refused with what the task takes, and secure aggregation refuses compression.
#[tokio::test(flavor = "multi_thread")]
async fn a_compressed_federation_publishes_the_average_of_its_decoded_updates() {
    use hora_common::codec::{Compression, ValueCodec};
    use rand::{Rng, SeedableRng};

    let dir = tempfile::tempdir().unwrap();
    let (admin, stop, running) = start(dir.path(), None, None);
    let initial = Model::from_tensors([
        (
            "a.weight",
            vec![20, 10],
            (0..200).map(|i| i as f32 * 0.01).collect(),
        ),
        ("b.bias", vec![37], vec![0.5; 37]),
    ])
    .unwrap();
    let digest = admin.upload_model(&initial).await;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
    // Three clients' deltas, the last one large; their encodings, and what each decodes to.
    let encode = |c: &Compression, scale: f32, rng: &mut rand_chacha::ChaCha8Rng| {
        let mut delta = initial.clone();
        delta
            .data_mut()
            .iter_mut()
            .for_each(|v| *v = scale * rng.random_range(-1.0f32..1.0));
        let mut residual = delta.clone();
        let bytes = c.encode(&mut residual, rng).unwrap();
        let mut decoded = delta;
        decoded
            .data_mut()
            .iter_mut()
            .zip(residual.data())
            .for_each(|(d, r)| *d -= r);
        (bytes, decoded)
    };
    let norm = |m: &Model| {
        m.data()
            .iter()
            .map(|v| f64::from(*v).powi(2))
            .sum::<f64>()
            .sqrt()
    };
    let int8_top = Compression {
        values: ValueCodec::Int8,
        block_size: 16,
        top_k: Some(0.5),
    };
    let updates: Vec<_> = [(0.1, 3u64), (0.2, 1), (5.0, 2)]
        .into_iter()
        .map(|(scale, examples)| {
            let (bytes, decoded) = encode(&int8_top, scale, &mut rng);
            (bytes, decoded, examples)
        })
        .collect();
    let bound = (norm(&updates[1].1) + norm(&updates[2].1)) / 2.0;
    assert!(norm(&updates[2].1) > bound && norm(&updates[1].1) < bound);
    let task = |id: &str, extra: serde_json::Value| {
        let mut config = json!({
            "id": id, "initial_model": digest, "model": {"kind": "builtin", "name": "mlp"},
            "rounds": 2, "min_clients": 3, "target_clients": 3, "round_deadline_secs": 600,
        });
        config
            .as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        config
    };
    // Refused at creation: compression under secure aggregation, a fraction out of range.
    let (status, body) = try_create(
        &admin,
        &task(
            "sa",
            json!({"compression": int8_top, "secure_aggregation": {}}),
        ),
    )
    .await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("secure aggregation"), "{body}");
    let (status, body) = try_create(
        &admin,
        &task(
            "bad",
            json!({"compression": {"values": "int8", "top_k": 1.5}}),
        ),
    )
    .await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("top_k"), "{body}");

    admin
        .call(
            reqwest::Method::POST,
            "/admin/v1/tasks",
            Some(task(
                "packed",
                json!({"compression": int8_top, "update_bounds": {"max_norm": bound}}),
            )),
        )
        .await;
    admin
        .call(
            reqwest::Method::POST,
            "/admin/v1/tasks",
            Some(task("plain", json!({}))),
        )
        .await;
    let info = admin.task("packed").await;
    assert_eq!(info.config.compression.as_ref(), Some(&int8_top));
    let clients = [
        admin.enrol().await,
        admin.enrol().await,
        admin.enrol().await,
    ];
    let mut offers = Vec::new();
    for c in &clients {
        offers.push(c.join("packed").await);
        c.join("plain").await;
    }
    assert_eq!(offers[0].compression.as_ref(), Some(&int8_top));
    // A plain update, and one in another codec, are refused with what the task takes; a
    // compressed update to the plain task too.
    let (status, body) = clients[0]
        .upload_plaintext("packed", &offers[0], 1, &initial.to_safetensors())
        .await;
    assert_eq!(status, 400, "{body}");
    assert!(
        body.contains("top0.5+int8/16") && body.contains("upgrade"),
        "{body}"
    );
    let int4 = Compression {
        values: ValueCodec::Int4,
        ..int8_top.clone()
    };
    let (other, _) = encode(&int4, 0.1, &mut rng);
    let (status, body) = clients[0]
        .upload_plaintext("packed", &offers[0], 1, &other)
        .await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("`top0.5+int4/16`"), "{body}");
    let plain_offer = clients[0].join("plain").await;
    let (status, body) = clients[0]
        .upload_plaintext("plain", &plain_offer, 1, &updates[0].0)
        .await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("plain float32"), "{body}");

    for ((client, offer), (bytes, _, examples)) in clients.iter().zip(&offers).zip(&updates) {
        let (status, body) = client
            .upload_plaintext("packed", offer, *examples, bytes)
            .await;
        assert_eq!(status, 200, "{body}");
    }
    admin.wait_published("packed", 1).await;
    let published = admin.round_model("packed", 1).await;
    let total: f64 = updates.iter().map(|u| u.2 as f64).sum();
    for (i, got) in published.data().iter().enumerate() {
        let sum: f64 = updates
            .iter()
            .map(|(_, decoded, examples)| {
                let clip = (bound / norm(decoded)).min(1.0);
                *examples as f64 * clip * f64::from(decoded.data()[i])
            })
            .sum();
        let want = f64::from(initial.data()[i]) + sum / total;
        assert!(
            (f64::from(*got) - want).abs() < 1e-6,
            "value {i}: published {got}, decoded and averaged {want}"
        );
    }

    // Under central DP, each encoded update is clipped on its decoded norm and counted.
    admin
        .call(
            reqwest::Method::POST,
            "/admin/v1/tasks",
            Some(task(
                "private",
                json!({"compression": int8_top, "differential_privacy": {
                    "noise_multiplier": 0.5, "clip": {"mode": "fixed", "norm": bound}}}),
            )),
        )
        .await;
    for (client, (bytes, _, examples)) in clients.iter().zip(&updates) {
        let offer = client.join("private").await;
        let (status, body) = client
            .upload_plaintext("private", &offer, *examples, bytes)
            .await;
        assert_eq!(status, 200, "{body}");
    }
    admin.wait_published("private", 1).await;
    let history = admin
        .call(reqwest::Method::GET, "/admin/v1/tasks/private/rounds", None)
        .await;
    let privacy = &history[0]["privacy"];
    assert!(
        privacy["epsilon"].as_f64().is_some_and(|e| e > 0.0),
        "{history}"
    );

    // An asynchronous task of 4-bit updates: two updates from version 0 make version 1.
    admin
        .call(
            reqwest::Method::POST,
            "/admin/v1/tasks",
            Some(task(
                "buffered",
                json!({"compression": int4, "min_clients": 1, "target_clients": 1,
                       "asynchronous": {"buffer_size": 2}}),
            )),
        )
        .await;
    let mut decoded = Vec::new();
    for (client, examples) in clients.iter().zip([1u64, 3]) {
        let offer = client.join("buffered").await;
        let (bytes, d) = encode(&int4, 0.3, &mut rng);
        let (status, body) = client
            .upload_plaintext("buffered", &offer, examples, &bytes)
            .await;
        assert_eq!(status, 200, "{body}");
        decoded.push((d, examples as f64));
    }
    admin.wait_published("buffered", 1).await;
    let published = admin.round_model("buffered", 1).await;
    for (i, got) in published.data().iter().enumerate() {
        let want = f64::from(initial.data()[i])
            + decoded
                .iter()
                .map(|(d, w)| w * f64::from(d.data()[i]))
                .sum::<f64>()
                / 4.0;
        assert!((f64::from(*got) - want).abs() < 1e-6, "{got} != {want}");
    }
    stop.send(()).unwrap();
    running.await.unwrap().unwrap();
}
