//! The real `hora-server` binary on loopback with real TLS: rounds with sealed uploads, a
//! SIGKILL in the middle of a round, bad input of every kind, and the operational routes.

mod support;

use std::time::Duration;

use hora_common::model::Model;
use hora_common::wire::{ErrorCode, PollResponse, RoundOutcome, RoundRecord, TaskInfo, TaskState};
use reqwest::{Method, StatusCode};
use support::*;

#[tokio::test(flavor = "multi_thread")]
async fn rounds_publish_the_example_weighted_average() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let admin = server.api(ADMIN_TOKEN);
    let initial = small_model();
    let digest = admin.upload_model(&initial).await;
    let info = admin.create_task(&task("mnist", digest, 3, 2, 4, 60)).await;
    assert_eq!(info.open_round.as_ref().map(|r| r.round), Some(1));

    let mut clients = Vec::new();
    for _ in 0..4 {
        clients.push(admin.enrol().await);
    }
    let mut expected = initial.clone();
    for round in 1..=3u64 {
        let mut updates = Vec::new();
        for (i, c) in clients.iter().enumerate() {
            let offer = c.join("mnist").await;
            assert_eq!(offer.round, round);
            let (global, etag) = c.global("mnist").await;
            assert_eq!(global, expected, "clients train from the published model");
            assert_eq!(etag, offer.model.to_hex());
            let examples = 10 + 25 * i as u64 + round;
            let d = delta(&global, round * 100 + i as u64);
            let receipt = c.upload("mnist", &offer, examples, &d).await;
            assert_eq!(receipt.accepted, i as u32 + 1);
            updates.push((examples, d));
        }
        expected = fedavg(&expected, &updates);
        let published = admin.round_model("mnist", round).await;
        assert_close(&published, &expected);
        expected = published;
    }

    let info: TaskInfo = admin
        .ok(admin.request(Method::GET, "/admin/v1/tasks/mnist"))
        .await;
    assert_eq!(
        (info.state, info.published_rounds, info.open_round),
        (TaskState::Finished, 3, None)
    );
    let history: Vec<RoundRecord> = admin
        .ok(admin.request(Method::GET, "/admin/v1/tasks/mnist/rounds"))
        .await;
    assert_eq!(history.len(), 3);
    assert!(history.iter().all(|r| r.outcome == RoundOutcome::Published
        && r.participants.len() == 4
        && r.dropped.is_empty()));
    assert_eq!(
        history[0].examples,
        (0..4).map(|i| 11 + 25 * i).sum::<u64>()
    );
    assert!((history[0].metrics.accuracy.unwrap() - 0.75).abs() < 1e-12);

    // The model is cached by digest: a conditional GET is answered 304.
    let c = &clients[0];
    let resp = c
        .api
        .request(Method::GET, "/v1/tasks/mnist/model")
        .header(
            "if-none-match",
            format!("\"{}\"", info.global_model.to_hex()),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::NOT_MODIFIED);

    // The server binary does not link libtorch.
    let bin = std::fs::read(binary("hora-server")).unwrap();
    assert!(
        !bin.windows(11).any(|w| w == b"libtorch_cp"),
        "hora-server links libtorch"
    );
}

/// Runs one round of four uploads; with `crash`, SIGKILLs the server after the first two are
/// acknowledged and finishes the round on a restarted server. Returns the published model.
async fn one_round(crash: bool) -> Model {
    let dir = tempfile::tempdir().unwrap();
    let mut server = Server::start(dir.path());
    let admin = server.api(ADMIN_TOKEN);
    let initial = small_model();
    let digest = admin.upload_model(&initial).await;
    admin.create_task(&task("t", digest, 1, 4, 4, 600)).await;
    let mut clients = Vec::new();
    for _ in 0..4 {
        clients.push(admin.enrol().await);
    }
    for i in 0..clients.len() {
        if crash && i == 2 {
            server.kill();
            server = Server::start(dir.path());
            for c in &mut clients {
                c.api.url = server.url.clone();
            }
        }
        let c = &clients[i];
        let offer = c.join("t").await;
        c.upload("t", &offer, 7 + i as u64 * 3, &delta(&initial, i as u64))
            .await;
    }
    let admin = server.api(ADMIN_TOKEN);
    let info: TaskInfo = admin
        .ok(admin.request(Method::GET, "/admin/v1/tasks/t"))
        .await;
    assert_eq!(info.state, TaskState::Finished);
    admin.round_model("t", 1).await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_sigkill_mid_round_loses_no_acknowledged_upload() {
    let (uncrashed, crashed) = (one_round(false).await, one_round(true).await);
    // Same uploads in the same order: the very same model, bit for bit.
    assert_eq!(crashed.digest(), uncrashed.digest());
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_input_gets_a_clear_refusal_and_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    // One client sends every kind of bad update here: no quarantine (tests/hardening.rs has it).
    let server = Server::start_with(dir.path(), &["--quarantine-after", "0"]);
    let admin = server.api(ADMIN_TOKEN);
    let initial = small_model();
    let digest = admin.upload_model(&initial).await;
    admin.create_task(&task("t", digest, 2, 1, 3, 600)).await;
    let (a, b, c) = (
        admin.enrol().await,
        admin.enrol().await,
        admin.enrol().await,
    );

    // Credentials.
    let anon = admin.with_token("");
    anon.refused(
        anon.request(Method::GET, "/admin/v1/tasks"),
        StatusCode::UNAUTHORIZED,
        "missing_credentials",
    )
    .await;
    let wrong = admin.with_token("not-the-token");
    wrong
        .refused(
            wrong.request(Method::GET, "/admin/v1/tasks"),
            StatusCode::UNAUTHORIZED,
            "unauthorized",
        )
        .await;
    a.api
        .refused(
            a.api.request(Method::GET, "/admin/v1/tasks"),
            StatusCode::FORBIDDEN,
            "forbidden",
        )
        .await;
    let forged = a.api.with_token(&format!("{}.{}", a.id, "0".repeat(64)));
    forged
        .refused(
            forged.request(Method::POST, "/v1/tasks/t/join"),
            StatusCode::UNAUTHORIZED,
            "unauthorized",
        )
        .await;
    let enrolling = admin.enrolling().await;
    anon.ok::<serde_json::Value>(
        enrolling
            .request(Method::POST, "/v1/enrol")
            .json(&serde_json::json!({})),
    )
    .await;
    anon.refused(
        enrolling
            .request(Method::POST, "/v1/enrol")
            .json(&serde_json::json!({})),
        StatusCode::UNAUTHORIZED,
        "unauthorized",
    )
    .await;
    // A client that brings its own secret can repeat an enrolment whose answer it lost: the
    // same token and secret get the same credentials, another secret nothing.
    let enrolling = admin.enrolling().await;
    let secret = "ab".repeat(32);
    let enrol = |secret: &str| {
        enrolling
            .request(Method::POST, "/v1/enrol")
            .json(&serde_json::json!({ "secret": secret }))
    };
    let first: hora_common::wire::Credentials = anon.ok(enrol(&secret)).await;
    let again: hora_common::wire::Credentials = anon.ok(enrol(&secret)).await;
    assert_eq!(first, again);
    assert_eq!(first.secret, secret);
    // A repeat that changes what it asked for is refused, not silently half-applied.
    anon.refused(
        enrolling
            .request(Method::POST, "/v1/enrol")
            .json(&serde_json::json!({ "secret": secret, "label": "another" })),
        StatusCode::BAD_REQUEST,
        "bad_request",
    )
    .await;
    anon.refused(
        enrol(&"cd".repeat(32)),
        StatusCode::UNAUTHORIZED,
        "unauthorized",
    )
    .await;
    // The credentials work.
    anon.with_token(&format!("{}.{}", first.client_id, first.secret))
        .ok::<serde_json::Value>(
            anon.with_token(&format!("{}.{}", first.client_id, first.secret))
                .request(Method::GET, "/v1/tasks/t/poll?wait_ms=0"),
        )
        .await;

    // Malformed JSON, unknown task.
    admin
        .refused(
            admin
                .request(Method::POST, "/admin/v1/tasks")
                .header("content-type", "application/json")
                .body("{\"id\": "),
            StatusCode::BAD_REQUEST,
            "bad_request",
        )
        .await;
    a.api
        .refused(
            a.api.request(Method::POST, "/v1/tasks/nope/join"),
            StatusCode::NOT_FOUND,
            "not_found",
        )
        .await;

    let offer = a.join("t").await;
    let good = delta(&initial, 1);
    let upload = |client: &Client, body: Vec<u8>| client.upload_request("t", offer.round, 5, body);

    // Wrong names, shapes, dtypes; NaN and Inf.
    let renamed = Model::from_tensors(
        initial
            .tensors()
            .iter()
            .map(|t| (format!("x.{}", t.name), t.shape.clone(), vec![0.0; t.len])),
    )
    .unwrap();
    let mut reshaped_parts: Vec<_> = initial
        .tensors()
        .iter()
        .map(|t| (t.name.clone(), t.shape.clone(), vec![0.0f32; t.len]))
        .collect();
    let matrix = reshaped_parts.iter().position(|p| p.1.len() == 2).unwrap();
    reshaped_parts[matrix].1 = vec![reshaped_parts[matrix].1.iter().product()];
    let reshaped = Model::from_tensors(reshaped_parts).unwrap();
    let mut nan = good.clone();
    nan.data_mut()[3] = f32::NAN;
    let mut inf = good.clone();
    inf.data_mut()[100] = f32::INFINITY;
    for (what, model) in [
        ("names", renamed),
        ("shapes", reshaped),
        ("nan", nan),
        ("inf", inf),
    ] {
        let msg = a
            .api
            .refused(
                upload(&a, a.seal("t", &offer, &model)),
                StatusCode::BAD_REQUEST,
                "invalid_update",
            )
            .await;
        eprintln!("{what}: {msg}");
    }
    let half = {
        // The same tensors stored as f16 on the wire: the task's spec says f32.
        let views: Vec<(String, Vec<usize>, Vec<u8>)> = initial
            .tensors()
            .iter()
            .map(|t| (t.name.clone(), t.shape.clone(), vec![0u8; t.len * 2]))
            .collect();
        let st: Vec<_> = views
            .iter()
            .map(|(n, s, b)| {
                (
                    n.clone(),
                    safetensors::tensor::TensorView::new(safetensors::Dtype::F16, s.clone(), b)
                        .unwrap(),
                )
            })
            .collect();
        safetensors::serialize(st, None).unwrap()
    };
    let binding = hora_common::envelope::Binding {
        task: "t",
        round: offer.round,
        client: &a.id,
        base_model: &offer.model,
    };
    let sealed_half = hora_common::envelope::seal(&half, &offer.round_key, &binding).unwrap();
    let msg = a
        .api
        .refused(
            upload(&a, sealed_half),
            StatusCode::BAD_REQUEST,
            "invalid_update",
        )
        .await;
    assert!(msg.contains("dtype"), "{msg}");

    // Tampered and truncated envelopes; an envelope sealed by another client.
    let mut tampered = a.seal("t", &offer, &good);
    let mid = tampered.len() / 2;
    tampered[mid] ^= 0x40;
    a.api
        .refused(
            upload(&a, tampered),
            StatusCode::BAD_REQUEST,
            "invalid_update",
        )
        .await;
    let mut truncated = a.seal("t", &offer, &good);
    truncated.truncate(truncated.len() - 20);
    a.api
        .refused(
            upload(&a, truncated),
            StatusCode::BAD_REQUEST,
            "invalid_update",
        )
        .await;
    b.join("t").await;
    a.api
        .refused(
            upload(&b, a.seal("t", &offer, &good)),
            StatusCode::BAD_REQUEST,
            "invalid_update",
        )
        .await;

    // Oversized: refused from Content-Length alone, without reading the body.
    let limit = hora_server::round::upload_limit(&initial.spec(), None);
    let endless = futures_stream(limit + 1);
    let req = a
        .api
        .request(Method::POST, "/v1/tasks/t/rounds/1/update")
        .header("x-hora-update", "{\"num_examples\":1}")
        .header("content-length", (limit + 1).to_string())
        .body(reqwest::Body::wrap_stream(endless));
    // The server answers 413 and resets the stream it will not read. Which of the two the
    // client sees first is a race of the transport: either is a prompt refusal; a hang is not.
    let answer = tokio::time::timeout(Duration::from_secs(20), req.send())
        .await
        .expect("a 413 must come before the body is read");
    match answer {
        Ok(resp) => {
            assert_eq!(resp.status(), StatusCode::PAYLOAD_TOO_LARGE);
            let err: hora_common::wire::ApiError = resp.json().await.expect("ApiError body");
            assert_eq!(err.code, ErrorCode::PayloadTooLarge, "{}", err.message);
        }
        Err(e) => assert!(
            format!("{e:?}").contains("Reset"),
            "neither a 413 nor a stream reset: {e:?}"
        ),
    }

    // Not selected, wrong round, then the good upload, its replay, and a closed round.
    c.api
        .refused(
            upload(&c, c.seal("t", &offer, &good)),
            StatusCode::CONFLICT,
            "not_selected",
        )
        .await;
    a.api
        .refused(
            a.upload_request("t", 2, 5, a.seal("t", &offer, &good)),
            StatusCode::CONFLICT,
            "wrong_round",
        )
        .await;
    a.api
        .refused(
            a.upload_request("t", 1, 0, a.seal("t", &offer, &good)),
            StatusCode::BAD_REQUEST,
            "invalid_update",
        )
        .await;
    let accepted = a.seal("t", &offer, &good);
    a.api
        .ok::<serde_json::Value>(upload(&a, accepted.clone()))
        .await;
    a.api
        .refused(
            upload(&a, accepted.clone()),
            StatusCode::CONFLICT,
            "already_contributed",
        )
        .await;

    // Nothing refused above disturbed the round: it holds exactly a's update.
    let info: TaskInfo = admin
        .ok(admin.request(Method::GET, "/admin/v1/tasks/t"))
        .await;
    assert_eq!(info.open_round.as_ref().map(|r| r.accepted), Some(1));
    let offer_b = b.join("t").await;
    let d_b = delta(&initial, 2);
    b.upload("t", &offer_b, 15, &d_b).await;
    c.join("t").await;
    let d_c = delta(&initial, 3);
    let offer_c = c.join("t").await;
    c.upload("t", &offer_c, 30, &d_c).await;
    let published = admin.round_model("t", 1).await;
    assert_close(
        &published,
        &fedavg(&initial, &[(5, good), (15, d_b), (30, d_c)]),
    );

    // Round 1 is closed now; its envelope replayed into round 2 fails authentication.
    a.api
        .refused(
            upload(&a, accepted.clone()),
            StatusCode::CONFLICT,
            "round_closed",
        )
        .await;
    a.join("t").await;
    a.api
        .refused(
            a.upload_request("t", 2, 5, accepted),
            StatusCode::BAD_REQUEST,
            "invalid_update",
        )
        .await;
}

/// A body stream that sends one chunk and then never finishes.
fn futures_stream(
    _declared: u64,
) -> impl futures_core::Stream<Item = Result<Vec<u8>, std::io::Error>> + Send + 'static {
    struct Endless(bool);
    impl futures_core::Stream for Endless {
        type Item = Result<Vec<u8>, std::io::Error>;
        fn poll_next(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Self::Item>> {
            if self.0 {
                std::task::Poll::Pending
            } else {
                self.0 = true;
                std::task::Poll::Ready(Some(Ok(vec![0u8; 65536])))
            }
        }
    }
    Endless(false)
}

#[tokio::test(flavor = "multi_thread")]
async fn operations_routes_and_long_poll() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let admin = server.api(ADMIN_TOKEN);
    let anon = admin.with_token("");
    let health = anon.request(Method::GET, "/healthz").send().await.unwrap();
    assert_eq!(
        (health.status(), health.text().await.unwrap()),
        (StatusCode::OK, "ok".to_string())
    );

    let doc: serde_json::Value = anon.ok(anon.request(Method::GET, "/openapi.json")).await;
    let paths = doc["paths"].as_object().unwrap();
    for p in [
        "/v1/enrol",
        "/v1/tasks/{task}/poll",
        "/v1/tasks/{task}/join",
        "/v1/tasks/{task}/model",
        "/v1/tasks/{task}/module",
        "/v1/tasks/{task}/rounds/{round}/update",
        "/v1/tasks/{task}/evaluations/{round}",
        "/admin/v1/models",
        "/admin/v1/modules",
        "/admin/v1/tasks",
        "/admin/v1/tasks/{task}",
        "/admin/v1/tasks/{task}/pause",
        "/admin/v1/tasks/{task}/resume",
        "/admin/v1/tasks/{task}/stop",
        "/admin/v1/tasks/{task}/rounds",
        "/admin/v1/tasks/{task}/rounds/{round}/model",
        "/admin/v1/enrolments",
        "/admin/v1/clients",
        "/admin/v1/clients/{client}/revoke",
        "/healthz",
        "/metrics",
        "/openapi.json",
    ] {
        assert!(paths.contains_key(p), "openapi.json lacks {p}");
    }

    let initial = small_model();
    let digest = admin.upload_model(&initial).await;
    admin.create_task(&task("lp", digest, 2, 1, 1, 600)).await;
    let a = admin.enrol().await;
    let b = admin.enrol().await;
    // b long-polls for a round after 1; a's upload publishes round 1 and opens round 2.
    let poll_b = {
        let api = b.api.clone();
        tokio::spawn(async move {
            let started = std::time::Instant::now();
            let p: PollResponse = api
                .ok(api.request(Method::GET, "/v1/tasks/lp/poll?after=1&wait_ms=20000"))
                .await;
            (p, started.elapsed())
        })
    };
    let offer = a.join("lp").await;
    a.upload("lp", &offer, 3, &delta(&initial, 9)).await;
    let (p, waited) = poll_b.await.unwrap();
    assert_eq!(p.open_round, Some(2));
    assert!(
        waited < Duration::from_secs(15),
        "the long poll must be answered when the round opens"
    );

    // Pause, resume, revoke.
    let paused: TaskInfo = admin
        .ok(admin.request(Method::POST, "/admin/v1/tasks/lp/pause"))
        .await;
    assert_eq!(paused.state, TaskState::Paused);
    let j: hora_common::wire::JoinResponse = b
        .api
        .ok(b.api.request(Method::POST, "/v1/tasks/lp/join"))
        .await;
    assert!(j.offer.is_none() && j.retry_after_ms > 0);
    let resumed: TaskInfo = admin
        .ok(admin.request(Method::POST, "/admin/v1/tasks/lp/resume"))
        .await;
    assert_eq!(resumed.state, TaskState::Running);
    admin
        .ok::<serde_json::Value>(
            admin.request(Method::POST, &format!("/admin/v1/clients/{}/revoke", b.id)),
        )
        .await;
    b.api
        .refused(
            b.api.request(Method::POST, "/v1/tasks/lp/join"),
            StatusCode::UNAUTHORIZED,
            "unauthorized",
        )
        .await;
    let stopped: TaskInfo = admin
        .ok(admin.request(Method::POST, "/admin/v1/tasks/lp/stop"))
        .await;
    assert_eq!(
        (stopped.state, stopped.open_round),
        (TaskState::Stopped, None)
    );
    let history: Vec<RoundRecord> = admin
        .ok(admin.request(Method::GET, "/admin/v1/tasks/lp/rounds"))
        .await;
    assert!(
        matches!(&history.last().unwrap().outcome, RoundOutcome::Abandoned { reason } if reason == "task stopped")
    );

    let unknown = anon
        .request(Method::GET, "/no/such/route")
        .send()
        .await
        .unwrap();
    assert_eq!(unknown.status(), StatusCode::NOT_FOUND);
    let metrics = anon
        .request(Method::GET, "/metrics")
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for m in [
        "hora_rounds_published_total",
        "hora_uploads_accepted_total",
        "hora_upload_bytes_total",
        "hora_ingest_seconds",
        "hora_aggregation_seconds",
        // Per route (by template, not by the path asked for), and the process's own.
        "hora_http_requests_total{route=\"/admin/v1/tasks/{task}/stop\",method=\"POST\",status=\"200\"} 1",
        "hora_http_request_duration_seconds_count{route=\"/v1/tasks/{task}/poll\",method=\"GET\"}",
        // What no route answered, under one label whatever the path.
        "hora_http_requests_total{route=\"(none)\",method=\"GET\",status=\"404\"} 1",
        "\nprocess_resident_memory_bytes ",
        "\nprocess_cpu_seconds_total ",
        "\nprocess_open_fds ",
    ] {
        assert!(metrics.contains(m), "/metrics lacks {m}:\n{metrics}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_round_short_of_min_clients_at_its_deadline_is_abandoned_and_retried() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let admin = server.api(ADMIN_TOKEN);
    let initial = small_model();
    let digest = admin.upload_model(&initial).await;
    admin.create_task(&task("d", digest, 1, 2, 3, 1)).await;
    let a = admin.enrol().await;
    let offer = a.join("d").await;
    a.upload("d", &offer, 4, &delta(&initial, 1)).await;
    // Wait (bounded) for the deadline to pass and the attempt to be recorded.
    let mut history: Vec<RoundRecord> = Vec::new();
    for _ in 0..100 {
        history = admin
            .ok(admin.request(Method::GET, "/admin/v1/tasks/d/rounds"))
            .await;
        if !history.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    match &history
        .first()
        .expect("the round was not closed at its deadline")
        .outcome
    {
        RoundOutcome::Abandoned { reason } => {
            assert!(reason.contains("1 of the required 2"), "{reason}")
        }
        other => panic!("expected an abandoned round, got {other:?}"),
    }
    assert_eq!(history[0].participants, vec![a.id.clone()]);
    // The history in pages: after round 0 (the first page), after round 1 (nothing yet).
    let page: Vec<RoundRecord> = admin
        .ok(admin.request(Method::GET, "/admin/v1/tasks/d/rounds?after=0&limit=1"))
        .await;
    assert_eq!(page, history[..1]);
    let page: Vec<RoundRecord> = admin
        .ok(admin.request(Method::GET, "/admin/v1/tasks/d/rounds?after=1&limit=10"))
        .await;
    assert!(page.is_empty());
    let page: Vec<RoundRecord> = admin
        .ok(admin.request(Method::GET, "/admin/v1/tasks/d/rounds?limit=0"))
        .await;
    assert!(page.is_empty());
    // The history is durable a moment before the close installs the retry in memory (status
    // readers never wait on a close): wait, bounded, for the retry.
    let mut info: TaskInfo = admin
        .ok(admin.request(Method::GET, "/admin/v1/tasks/d"))
        .await;
    for _ in 0..100 {
        if info.open_round.as_ref().is_some_and(|o| o.attempt >= 1) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        info = admin
            .ok(admin.request(Method::GET, "/admin/v1/tasks/d"))
            .await;
    }
    let open = info.open_round.unwrap();
    // Retried as the same round under a new attempt (more may have lapsed meanwhile), empty.
    assert_eq!(
        (open.round, open.accepted, info.published_rounds),
        (1, 0, 0)
    );
    assert!(open.attempt >= 1);
    // The abandoned attempt's envelope does not open under the retry's key.
    let retry = a.join("d").await;
    assert_ne!(retry.round_key, offer.round_key);
}

#[test]
fn a_short_admin_token_is_refused_at_start() {
    let stderr = refused_at_start("text");
    assert!(stderr.starts_with("error: "), "{stderr}");
    assert!(stderr.contains("at least 16"), "{stderr}");
    // With JSON logs, the reason is an event too, for the log collector.
    let stderr = refused_at_start("json");
    let event: serde_json::Value = stderr
        .lines()
        .find_map(|line| serde_json::from_str(line).ok())
        .unwrap_or_else(|| panic!("no JSON event in:\n{stderr}"));
    assert_eq!(event["level"], "ERROR", "{event}");
    assert_eq!(event["fields"]["message"], "stopped", "{event}");
    assert!(
        event["fields"]["error"]
            .as_str()
            .is_some_and(|e| e.contains("at least 16")),
        "{event}"
    );
    assert!(event["timestamp"].is_string(), "{event}");
}

#[test]
fn a_taken_port_stops_the_embedded_server_at_once_saying_so() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(binary("hora-server"))
        .args(["serve", "--listen", &addr, "--admin-token", ADMIN_TOKEN])
        .arg("--data-dir")
        .arg(dir.path())
        .env("HORA_LOG", "warn")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains(&format!("listening on {addr}")), "{stderr}");
    // No standby and no lease to hand back: it does not try again.
    assert!(!stderr.contains("handing the lease back"), "{stderr}");
}

/// The standard error of `hora-server serve` with a 7-character admin token, logging as
/// `log_format` says; it must exit by itself, failed.
fn refused_at_start(log_format: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let mut child = std::process::Command::new(binary("hora-server"))
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--admin-token",
            "hunter2",
            "--log-format",
            log_format,
        ])
        .arg("--data-dir")
        .arg(dir.path())
        .env("HORA_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // It must stop by itself, not serve (bounded: killed after 30 s).
    let started = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            panic!("hora-server started with a 7-character admin token");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(!status.success(), "{stderr}");
    stderr
}

/// An HTTPS client for `server` that speaks only HTTP/1.1, or only HTTP/2.
fn http_client(server: &Server, http2: bool) -> reqwest::Client {
    let mut tls = hora_common::tls::client_config(&server.ca, None).unwrap();
    tls.alpn_protocols = vec![if http2 {
        b"h2".to_vec()
    } else {
        b"http/1.1".to_vec()
    }];
    let builder = reqwest::Client::builder().use_preconfigured_tls(tls);
    match http2 {
        true => builder.http2_prior_knowledge(),
        false => builder.http1_only(),
    }
    .build()
    .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn requests_held_past_the_idle_timeout_are_answered_over_http1_and_http2() {
    let dir = tempfile::tempdir().unwrap();
    // Connections idle out after 2 s; polls are capped at four fifths of that.
    let server = Server::start_with(dir.path(), &["--idle-timeout-secs", "2"]);
    let admin = server.api(ADMIN_TOKEN);
    let digest = admin.upload_model(&small_model()).await;
    admin.create_task(&task("t", digest, 1, 1, 1, 600)).await;
    let client = admin.enrol().await;
    for (http2, version) in [
        (false, reqwest::Version::HTTP_11),
        (true, reqwest::Version::HTTP_2),
    ] {
        let http = http_client(&server, http2);
        // Round 1 is open: a poll for a later one waits, for 30 s if the server let it.
        let started = std::time::Instant::now();
        let resp = http
            .get(format!(
                "{}/v1/tasks/t/poll?after=1&wait_ms=30000",
                server.url
            ))
            .bearer_auth(&client.api.token)
            .send()
            .await
            .unwrap_or_else(|e| panic!("{version:?} poll: {e:?}"));
        assert_eq!((resp.version(), resp.status()), (version, StatusCode::OK));
        let poll: PollResponse = resp.json().await.unwrap();
        assert_eq!(poll.max_wait_ms, 1600, "the cap is reported");
        assert!(started.elapsed() >= Duration::from_millis(1600));
        assert_eq!((poll.open_round, poll.attempt), (Some(1), Some(0)));

        // A sync join waits for the job's second worker: 3 s, longer than the idle timeout,
        // with no byte moving.
        let job = format!("held-{}", u8::from(http2));
        let info: serde_json::Value = admin
            .ok(admin
                .request(Method::POST, "/admin/v1/sync-jobs")
                .json(&serde_json::json!({"id": job, "world_size": 2})))
            .await;
        let token = info["token"].as_str().unwrap().to_string();
        let join = |http: reqwest::Client, port: u16| {
            let (url, token) = (format!("{}/v1/sync/{job}/join", server.url), token.clone());
            async move {
                http.post(url)
                    .bearer_auth(token)
                    .json(&serde_json::json!({"address": format!("127.0.0.1:{port}"), "world_size": 2, "timeout_s": 30}))
                    .send()
                    .await
            }
        };
        let first = tokio::spawn(join(http.clone(), 9001));
        tokio::time::sleep(Duration::from_secs(3)).await;
        let second = join(admin.http.clone(), 9002).await.unwrap();
        assert_eq!(second.status(), StatusCode::OK);
        let first = first
            .await
            .unwrap()
            .unwrap_or_else(|e| panic!("{version:?} join held past the idle timeout: {e:?}"));
        assert_eq!((first.version(), first.status()), (version, StatusCode::OK));
    }
}

/// Runs `hora-server admin … <args>` against `server` and returns its JSON output.
fn admin_cli(server: &Server, args: &[&str]) -> serde_json::Value {
    let out = std::process::Command::new(binary("hora-server"))
        .args([
            "admin",
            "--server",
            &server.url,
            "--token",
            ADMIN_TOKEN,
            "--ca",
        ])
        .arg(&server.ca)
        .args(args)
        .output()
        .expect("run hora-server admin");
    assert!(
        out.status.success(),
        "admin {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "admin {args:?}: {e}: {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

#[tokio::test(flavor = "multi_thread")]
async fn the_admin_cli_drives_a_task_from_model_upload_to_published_model() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let initial = small_model();
    let model_file = dir.path().join("initial.safetensors");
    initial.write_file(&model_file).unwrap();
    let uploaded = admin_cli(&server, &["upload-model", model_file.to_str().unwrap()]);
    assert_eq!(
        uploaded["digest"],
        serde_json::json!(initial.digest().to_hex())
    );
    let task_file = dir.path().join("task.json");
    std::fs::write(
        &task_file,
        serde_json::to_vec(&task("cli", initial.digest(), 1, 1, 1, 600)).unwrap(),
    )
    .unwrap();
    assert_eq!(
        admin_cli(&server, &["create-task", task_file.to_str().unwrap()])["state"],
        "running"
    );
    assert_eq!(admin_cli(&server, &["tasks"]).as_array().unwrap().len(), 1);
    assert_eq!(admin_cli(&server, &["pause", "cli"])["state"], "paused");
    assert_eq!(admin_cli(&server, &["resume", "cli"])["state"], "running");

    // A client enrols with a token the CLI made, and finishes the round.
    let token = admin_cli(&server, &["enrol", "--ttl-secs", "60"]);
    let enrolling = server.api(token["token"].as_str().unwrap());
    let creds: hora_common::wire::Credentials = enrolling
        .ok(enrolling
            .request(Method::POST, "/v1/enrol")
            .json(&serde_json::json!({})))
        .await;
    let client = Client {
        api: enrolling.with_token(&format!("{}.{}", creds.client_id, creds.secret)),
        id: creds.client_id.clone(),
    };
    let offer = client.join("cli").await;
    let d = delta(&initial, 4);
    client.upload("cli", &offer, 12, &d).await;

    assert_eq!(admin_cli(&server, &["task", "cli"])["state"], "finished");
    assert_eq!(
        admin_cli(&server, &["rounds", "cli"])[0]["participants"],
        serde_json::json!([creds.client_id])
    );
    let out = dir.path().join("round1.safetensors");
    admin_cli(
        &server,
        &["download-model", "cli", "1", "-o", out.to_str().unwrap()],
    );
    assert_close(
        &Model::read_file(&out, &Default::default()).unwrap(),
        &fedavg(&initial, &[(12, d)]),
    );
    // A task that trains part of its model: its frozen base comes down on its own.
    let mut part = task("cli-part", initial.digest(), 1, 1, 1, 600);
    part.trainable = Some(vec!["*.bias".into()]);
    std::fs::write(&task_file, serde_json::to_vec(&part).unwrap()).unwrap();
    admin_cli(&server, &["create-task", task_file.to_str().unwrap()]);
    let base = dir.path().join("base.safetensors");
    admin_cli(
        &server,
        &["download-base", "cli-part", "-o", base.to_str().unwrap()],
    );
    let (_, frozen) = initial.split(|name| name.ends_with(".bias"));
    assert_eq!(
        Model::read_file(&base, &Default::default()).unwrap(),
        frozen
    );
    assert_eq!(
        admin_cli(&server, &["clients"]).as_array().unwrap().len(),
        1
    );
    assert_eq!(
        admin_cli(&server, &["revoke", &creds.client_id])["revoked"],
        true
    );
    // Errors come back as the server's message and a non-zero exit.
    let out = std::process::Command::new(binary("hora-server"))
        .args([
            "admin",
            "--server",
            &server.url,
            "--token",
            ADMIN_TOKEN,
            "--ca",
        ])
        .arg(&server.ca)
        .args(["stop", "cli"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("409") && stderr.contains("finished"),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn mutual_tls_refuses_clients_without_a_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let certs = dir.path().join("certs");
    let out = std::process::Command::new(binary("hora-server"))
        .args(["certs", "--client", "worker-1", "--dir"])
        .arg(&certs)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ca = certs.join("ca.pem");
    let server = Server::start_with(
        &dir.path().join("data"),
        &[
            "--tls-cert",
            certs.join("server.pem").to_str().unwrap(),
            "--tls-key",
            certs.join("server-key.pem").to_str().unwrap(),
            "--client-ca",
            ca.to_str().unwrap(),
        ],
    );
    let without = hora_server::tls::https_client(&ca, None).unwrap();
    assert!(
        without
            .get(format!("{}/healthz", server.url))
            .send()
            .await
            .is_err(),
        "a client without a certificate must be refused"
    );
    let identity = hora_server::tls::CertPaths {
        cert: certs.join("worker-1.pem"),
        key: certs.join("worker-1-key.pem"),
    };
    let with = hora_server::tls::https_client(&ca, Some(&identity)).unwrap();
    let resp = with
        .get(format!("{}/healthz", server.url))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(
        resp.version(),
        reqwest::Version::HTTP_2,
        "HTTP/2 is negotiated by ALPN"
    );
    // The admin CLI presents one with --cert/--key, and is refused without.
    let admin = |with_cert: bool| {
        let mut cmd = std::process::Command::new(binary("hora-server"));
        cmd.args([
            "admin",
            "--server",
            &server.url,
            "--token",
            ADMIN_TOKEN,
            "--ca",
        ])
        .arg(&ca);
        if with_cert {
            cmd.arg("--cert")
                .arg(&identity.cert)
                .arg("--key")
                .arg(&identity.key);
        }
        cmd.arg("tasks").output().unwrap()
    };
    let out = admin(true);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!admin(false).status.success());
}

/// Every option of `serve` is honoured from the file, the environment and the flags, in that
/// order of precedence; the option list is the declaration's own.
#[test]
fn every_serve_option_is_layered_flags_over_environment_over_file() {
    support::check_layering(
        "hora-server",
        &["config", "check"],
        &[
            ("admin_allow", "10.0.0.0/8", "192.168.0.7"),
            (
                "admin_token",
                "a-admin-token-0123456789abcdef",
                "b-admin-token-0123456789",
            ),
            (
                "admin_token_file",
                "secret-file:admin-a",
                "secret-file:admin-b",
            ),
            ("blobs", "s3://bucket-a/p", "s3://bucket-b/q"),
            (
                "blobs_endpoint",
                "http://127.0.0.1:9000",
                "http://127.0.0.1:9001",
            ),
            ("blobs_retries", "2", "5"),
            ("blobs_retry_secs", "30", "60"),
            ("body_wait_secs", "11", "12"),
            ("certs_dir", "/srv/a/certs", "/srv/b/certs"),
            ("client_ca", "/srv/a/ca.pem", "/srv/b/ca.pem"),
            ("commit_window_ms", "3", "4"),
            (
                "dashboard_secret",
                "a-dashboard-secret-0123456789abcdef",
                "b-dashboard-secret-0123456789abcdefgh",
            ),
            (
                "dashboard_secret_file",
                "secret-file:dashboard-a",
                "secret-file:dashboard-b",
            ),
            ("data_dir", "/srv/a", "/srv/b"),
            ("durability_timeout_secs", "61", "62"),
            ("header_timeout_secs", "11", "12"),
            ("history_detail_rounds", "7", "8"),
            ("hosts", "a.example", "b.example"),
            ("idle_timeout_secs", "16", "17"),
            ("lease_secs", "5", "6"),
            ("listen", "127.0.0.1:9001", "[::1]:9002"),
            ("max_concurrent_uploads", "2", "3"),
            ("max_connections", "100", "200"),
            ("max_connections_per_source", "10", "20"),
            ("max_model_bytes", "1000", "2000"),
            ("max_unauthenticated_per_source", "4", "5"),
            ("max_upload_share", "0.5", "0.75"),
            ("metrics_require_token", "true", "false"),
            ("min_upload_rate", "100", "200"),
            ("parent", "https://a.example:8443", "https://b.example:8443"),
            ("parent_ca", "/srv/a/parent-ca.pem", "/srv/b/parent-ca.pem"),
            (
                "parent_enrolment_token",
                "a-parent-token-0123",
                "b-parent-token-0123456789",
            ),
            ("quarantine_after", "2", "3"),
            ("request_timeout_secs", "31", "32"),
            ("retain_rounds_every", "2", "3"),
            ("retain_rounds_last", "4", "5"),
            (
                "store",
                "postgres://u:pw@db-a/fl",
                "postgres://u:pw@db-b/fl",
            ),
            ("spool_bytes", "1000000000", "2000000000"),
            ("tls_cert", "/srv/a/cert.pem", "/srv/b/cert.pem"),
            ("tls_key", "/srv/a/key.pem", "/srv/b/key.pem"),
            ("upload_buffer_bytes", "1000000", "2000000"),
            ("upload_chunk_bytes", "1048576", "2097152"),
            ("upload_grace_secs", "11", "12"),
        ],
        &[
            ("admin_token", "admin_token_file"),
            ("dashboard_secret", "dashboard_secret_file"),
        ],
    );
}

/// The example configuration beside the systemd unit is one `serve` takes.
#[test]
fn the_systemd_example_configuration_checks() {
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("admin-token");
    std::fs::write(&token, "an-admin-token-of-the-example-0123456789\n").unwrap();
    let example = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/systemd/hora.toml");
    let out = std::process::Command::new(support::binary("hora-server"))
        .args(["config", "check", "--json", "--config"])
        .arg(&example)
        .arg("--admin-token-file")
        .arg(&token)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["listen"]["value"], "0.0.0.0:8443");
    assert_eq!(report["listen"]["source"], "file");
    assert_eq!(report["admin_token_file"]["source"], "flag");
}

/// Both programs say which commit they are, and write completions and man pages.
#[test]
fn version_completions_and_man_pages() {
    let dir = tempfile::tempdir().unwrap();
    let head = std::process::Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    for program in ["hora-server", "hora-client"] {
        let run = |args: &[&str]| {
            let out = std::process::Command::new(support::binary(program))
                .args(args)
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{program} {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            String::from_utf8(out.stdout).unwrap()
        };
        let version = run(&["--version"]);
        assert!(version.starts_with(&format!("{program} 0.")), "{version}");
        if let Some(head) = &head {
            assert!(
                version.contains(&format!("(commit {head})")),
                "{version} is not at {head}"
            );
        }
        assert!(
            run(&["completions", "bash"]).contains(&format!("_{}()", program.replace('-', "__")))
        );
        assert!(run(&["completions", "zsh"]).contains(&format!("#compdef {program}")));
        let man = dir.path().join(program);
        let pages = run(&["man", "--dir", man.to_str().unwrap()]);
        let page = std::fs::read_to_string(man.join(format!("{program}.1"))).unwrap();
        assert!(page.starts_with(".ie") || page.contains(".TH"), "{page}");
        assert!(pages.lines().count() > 5, "{pages}");
    }
    let serve =
        std::fs::read_to_string(dir.path().join("hora-server/hora-server-serve.1")).unwrap();
    assert!(
        serve.contains("HORA_LISTEN"),
        "the page of serve names its variables"
    );
}

/// The two-level tree: a parent and two regional servers (`--parent`), three clients on each
/// region and one on the parent itself. Each region's round starts from the parent's open
/// round's model and forwards its partial as one update standing for its three clients; the
/// parent's published models equal the flat federation's (FedAvg of all seven updates, each by
/// its examples), and its history counts seven contributors and every example. In the second
/// round the parent is SIGKILLed before the regions' rounds close, and a region holding its
/// partial is SIGKILLed and restarted too: once the parent is back, both partials arrive and the
/// round publishes the flat FedAvg all the same. The parent takes updates in chunks of 64 KiB
/// and the model is larger, so the partials travel as chunked uploads (counted by the parent's
/// `hora_upload_chunks_total`); restarted without chunks, it takes them in one body. A client not enrolled as an aggregator cannot claim to stand for
/// several clients.
#[tokio::test(flavor = "multi_thread")]
async fn a_parent_with_two_regional_servers_publishes_the_flat_federations_models_through_crashes()
{
    let dirs: Vec<_> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let listen = format!("127.0.0.1:{}", free_port());
    let chunked = ["--upload-chunk-bytes", "65536"];
    let parent = Server::start_on(dirs[0].path(), &listen, &chunked);
    let admin = parent.api(ADMIN_TOKEN);
    // 20,692 parameters: a partial of about 81 KiB, two of the parent's chunks.
    let small = small_model();
    let mut tensors: Vec<_> = small
        .tensors()
        .iter()
        .map(|t| {
            (
                t.name.clone(),
                t.shape.clone(),
                small.data()[t.offset..][..t.len].to_vec(),
            )
        })
        .collect();
    tensors.push((
        "embedding.weight".into(),
        vec![160, 128],
        // (Away from zero: a partial travels as f32 values, and the suite's tolerance is
        // relative to the value.)
        (0..160 * 128)
            .map(|i| 0.15 + (i as f32 * 0.07).sin() * 0.05)
            .collect(),
    ));
    let initial = Model::from_tensors(tensors).unwrap();
    let digest = admin.upload_model(&initial).await;
    admin.create_task(&task("tree", digest, 2, 7, 7, 600)).await;
    let mut flags = Vec::new();
    let mut regions = Vec::new();
    let (parent_url, parent_ca) = (parent.url.clone(), parent.ca.clone());
    let mut parent = Some(parent);
    for (i, dir) in dirs[1..].iter().enumerate() {
        let token: serde_json::Value = admin
            .ok(admin
                .request(Method::POST, "/admin/v1/enrolments")
                .json(&serde_json::json!({"aggregator": true, "tasks": ["tree"]})))
            .await;
        let region_flags: Vec<String> = vec![
            "--parent".into(),
            parent_url.clone(),
            "--parent-ca".into(),
            parent_ca.to_str().unwrap().into(),
            "--parent-enrolment-token".into(),
            token["token"].as_str().unwrap().into(),
        ];
        let flag_refs: Vec<&str> = region_flags.iter().map(String::as_str).collect();
        let region = Server::start_with(dir.path(), &flag_refs);
        let api = region.api(ADMIN_TOKEN);
        assert_eq!(api.upload_model(&initial).await, digest);
        let mut config = task(&format!("tree-{i}"), digest, 2, 3, 3, 600);
        config.parent = Some(hora_common::wire::ParentTask {
            task: "tree".into(),
        });
        api.create_task(&config).await;
        let mut clients = Vec::new();
        for _ in 0..3 {
            clients.push(api.enrol().await);
        }
        flags.push(region_flags);
        regions.push((region, clients));
    }
    let direct = admin.enrol().await;

    let mut expected = initial.clone();
    for round in 1..=2u64 {
        // Every client's offer first: a region opens its round once it joined the parent's.
        let mut offers = Vec::new();
        for (r, (_, clients)) in regions.iter().enumerate() {
            for c in clients {
                let offer = wait_for_offer(c, &format!("tree-{r}")).await;
                assert_eq!(
                    offer.model,
                    expected.digest(),
                    "trained from the parent's model"
                );
                offers.push(offer);
            }
        }
        let direct_offer = direct.join("tree").await;
        assert_eq!(direct_offer.round, round);
        // Each server holds its open round's running sum (f64 a parameter).
        let sum_bytes = initial.numel() as f64 * 8.0;
        for (r, (region, _)) in regions.iter().enumerate() {
            let series = format!("hora_round_sum_bytes{{task=\"tree-{r}\"}}");
            assert_eq!(region.api(ADMIN_TOKEN).metric(&series).await, sum_bytes);
        }
        assert_eq!(
            admin.metric(r#"hora_round_sum_bytes{task="tree"}"#).await,
            sum_bytes
        );
        let down = round == 2;
        if down {
            parent.take().expect("the parent runs").kill();
        }
        let mut updates = Vec::new();
        for (r, (_, clients)) in regions.iter().enumerate() {
            for (i, c) in clients.iter().enumerate() {
                let k = 3 * r + i;
                let examples = 10 + 7 * k as u64 + round;
                let d = delta(&expected, round * 100 + k as u64);
                c.upload(&format!("tree-{r}"), &offers[k], examples, &d)
                    .await;
                updates.push((examples, d));
            }
        }
        if round == 2 {
            // Region 0 keeps its partial (the parent is down): killed, and started again.
            let region = regions.remove(0).0;
            wait_for_kept_partial(&region.api(ADMIN_TOKEN), "tree-0").await;
            region.kill();
            let flag_refs: Vec<&str> = flags[0].iter().map(String::as_str).collect();
            let region = Server::start_with(dirs[1].path(), &flag_refs);
            regions.insert(0, (region, Vec::new()));
        }
        if down {
            // Back without chunked uploads: the regions' kept offers say chunks, and the
            // partials go in one body when the parent refuses the session.
            let one_body = ["--upload-chunk-bytes", "0"];
            parent = Some(Server::start_on(dirs[0].path(), &listen, &one_body));
        }
        let d = delta(&expected, round * 100 + 99);
        direct.upload("tree", &direct_offer, 5, &d).await;
        updates.push((5, d));

        let model = admin.round_model("tree", round).await;
        assert_close(&model, &fedavg(&expected, &updates));
        let history: Vec<RoundRecord> = admin
            .ok(admin.request(Method::GET, "/admin/v1/tasks/tree/rounds"))
            .await;
        let entry = history
            .iter()
            .find(|h| h.round == round && h.outcome == RoundOutcome::Published)
            .expect("the round's entry");
        assert_eq!(entry.contributors, Some(7));
        assert_eq!(entry.participants.len(), 3, "two regions and one client");
        assert_eq!(entry.examples, updates.iter().map(|(n, _)| n).sum::<u64>());
        // Round 1: both partials came in two chunks each. Round 2: the restarted parent (its
        // count begins again) took none, and both in one body.
        assert_eq!(
            admin.metric("hora_upload_chunks_total").await,
            if down { 0.0 } else { 4.0 },
            "round {round}: the partials' chunks"
        );
        for (r, (region, _)) in regions.iter().enumerate() {
            let api = region.api(ADMIN_TOKEN);
            let local: Vec<RoundRecord> = api
                .ok(api.request(Method::GET, &format!("/admin/v1/tasks/tree-{r}/rounds")))
                .await;
            let entry = local.iter().find(|h| h.round == round).expect("forwarded");
            assert_eq!(entry.forwarded_to, Some(round));
            assert_eq!(entry.contributors, Some(3));
        }
        expected = model;
    }
    let info: TaskInfo = admin
        .ok(admin.request(Method::GET, "/admin/v1/tasks/tree"))
        .await;
    assert_eq!(info.state, TaskState::Finished);
    assert_eq!(
        admin.metric(r#"hora_round_sum_bytes{task="tree"}"#).await,
        0.0,
        "no round open, no sum held"
    );

    // Standing for several clients is an aggregator's right only.
    admin
        .create_task(&task("single", digest, 1, 1, 2, 600))
        .await;
    let offer = direct.join("single").await;
    let body = direct.seal("single", &offer, &delta(&initial, 1));
    let meta = serde_json::json!({"num_examples": 10, "contributors": 3});
    let refused = direct
        .api
        .request(Method::POST, "/v1/tasks/single/rounds/1/update")
        .header("x-hora-update", meta.to_string())
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), StatusCode::FORBIDDEN);
    let text = refused.text().await.unwrap();
    assert!(
        text.contains("not enrolled as a regional aggregator"),
        "{text}"
    );
    // And an aggregator's enrolment may cap it: above the cap refused before the body is read,
    // at the cap taken.
    let uncapped = admin
        .request(Method::POST, "/admin/v1/enrolments")
        .json(&serde_json::json!({"max_contributors": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(uncapped.status(), StatusCode::BAD_REQUEST);
    let capped = admin
        .enrol_with(serde_json::json!({"aggregator": true, "max_contributors": 2}))
        .await;
    let clients: Vec<serde_json::Value> = admin
        .ok(admin.request(Method::GET, "/admin/v1/clients"))
        .await;
    let shown = clients
        .iter()
        .find(|c| c["client_id"] == capped.id.as_str());
    assert_eq!(shown.map(|c| c["max_contributors"].clone()), Some(2.into()));
    let offer = capped.join("single").await;
    let upload = |contributors: u64| {
        let meta = serde_json::json!({"num_examples": 10, "contributors": contributors});
        capped
            .api
            .request(Method::POST, "/v1/tasks/single/rounds/1/update")
            .header("x-hora-update", meta.to_string())
            .body(capped.seal("single", &offer, &delta(&initial, 2)))
            .send()
    };
    let refused = upload(3).await.unwrap();
    assert_eq!(refused.status(), StatusCode::FORBIDDEN);
    let text = refused.text().await.unwrap();
    assert!(text.contains("at most 2 clients"), "{text}");
    assert_eq!(upload(2).await.unwrap().status(), StatusCode::OK);
}

/// Waits until regional task `task` has closed its open round (keeping its partial).
async fn wait_for_kept_partial(api: &Api, task: &str) {
    let started = std::time::Instant::now();
    loop {
        let info: TaskInfo = api
            .ok(api.request(Method::GET, &format!("/admin/v1/tasks/{task}")))
            .await;
        if info.open_round.is_none() {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{task} kept no partial"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Joins `task` until its round is open (a regional task opens it once its parent's is).
async fn wait_for_offer(client: &Client, task: &str) -> hora_common::wire::RoundOffer {
    let started = std::time::Instant::now();
    loop {
        if let Some(offer) = client.try_join(task).await {
            return offer;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "no round of {task} opened"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
