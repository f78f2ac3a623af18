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
    // A second server on the same database stands by while the first leads, until told to
    // stop.
    let (other, url) = (tempfile::tempdir().unwrap(), postgres.url());
    let second = tokio::task::spawn_blocking(move || {
        let asked = std::time::Instant::now();
        Server::build_unless(config(other.path(), Some(&url), None), &|| {
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
