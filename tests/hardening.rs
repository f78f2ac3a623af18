//! A hostile or broken edge fleet against the real `hora-server` binary on loopback TLS: idle
//! and half-open connections, stalled bodies, poisoned and overflowing updates, out-of-scope
//! clients, slow storage, corrupt state. Each test asserts the refusal *and* that honest clients
//! are served meanwhile.

mod support;

use std::time::{Duration, Instant};

use hora_common::model::Model;
use hora_common::wire::{
    ClientInfo, Credentials, NormPolicy, PollResponse, RoundOutcome, RoundRecord, TaskInfo,
    UpdateBounds, UpdateReceipt,
};
use reqwest::{Method, StatusCode};
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The operator's `GET /admin/v1/tasks` sent from `source` over a connection of its own, its
/// answer read up to `until` within `limit`.
async fn admin_tasks_from(server: &Server, source: &str, until: &str, limit: Duration) -> String {
    let mut conn = raw_tls_from(server, source).await;
    let request = format!(
        "GET /admin/v1/tasks HTTP/1.1\r\nhost: localhost\r\nauthorization: Bearer {ADMIN_TOKEN}\r\n\r\n"
    );
    conn.write_all(request.as_bytes()).await.unwrap();
    answer_within(&mut conn, until, limit).await
}

/// Reads what the server answers on `conn` until the text holds `needle` or the connection
/// ends, at most `limit`.
async fn answer_within(conn: &mut RawTls, needle: &str, limit: Duration) -> String {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + limit;
    while !String::from_utf8_lossy(&got).contains(needle) {
        match tokio::time::timeout_at(deadline, conn.read(&mut buf)).await {
            Err(_) | Ok(Ok(0)) | Ok(Err(_)) => break,
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
        }
    }
    String::from_utf8_lossy(&got).into_owned()
}

/// Waits until the server closes `conn` (end of stream or a reset), at most `limit`; returns
/// what it sent before closing, or None if it is still open.
async fn closed_within(conn: &mut RawTls, limit: Duration) -> Option<Vec<u8>> {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        match tokio::time::timeout_at(deadline, conn.read(&mut buf)).await {
            Err(_) => return None,
            Ok(Ok(0)) | Ok(Err(_)) => return Some(got),
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
        }
    }
}

/// GET /healthz on a fresh connection (a pooled one may be the idle connection the server just
/// closed to make room, which is the point of the attack tests).
async fn healthz_ok(server: &Server) -> Duration {
    let started = Instant::now();
    let http = hora_server::tls::https_client(&server.ca, None).expect("client");
    let resp = http
        .get(format!("{}/healthz", server.url))
        .timeout(Duration::from_secs(3))
        .send()
        .await
        .expect("/healthz answers");
    assert_eq!(resp.status(), StatusCode::OK);
    started.elapsed()
}

#[tokio::test]
async fn idle_and_half_open_connections_are_closed_and_healthz_answers_throughout() {
    let dir = tempfile::tempdir().unwrap();
    // A cap of 64 connections: the 150 attackers below are well over it.
    let server = Server::start_with(
        dir.path(),
        &[
            "--idle-timeout-secs",
            "2",
            "--header-timeout-secs",
            "2",
            "--max-connections",
            "64",
        ],
    );
    let admin = server.api(ADMIN_TOKEN);
    healthz_ok(&server).await;

    let mut attackers = Vec::new();
    for i in 0..150 {
        let mut conn = raw_tls(&server).await;
        if i % 2 == 0 {
            // Half a request line, then nothing.
            conn.write_all(b"GET /healthz HT").await.unwrap();
            conn.flush().await.unwrap();
        }
        attackers.push(conn);
        if i % 25 == 0 {
            // Honest requests keep being served while the attack builds up, past the cap.
            healthz_ok(&server).await;
        }
    }
    // And throughout the idle period.
    let mut slowest = Duration::ZERO;
    for _ in 0..10 {
        slowest = slowest.max(healthz_ok(&server).await);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(slowest < Duration::from_secs(2), "healthz took {slowest:?}");

    // Every attacker connection is closed within the idle timeout (plus slack), none answered
    // with anything but a close.
    for (i, conn) in attackers.iter_mut().enumerate() {
        let sent = closed_within(conn, Duration::from_secs(6))
            .await
            .unwrap_or_else(|| panic!("attacker connection {i} is still open"));
        assert!(
            sent.is_empty() || sent.starts_with(b"HTTP/1.1 408"),
            "attacker {i} got {:?}",
            String::from_utf8_lossy(&sent)
        );
    }
    healthz_ok(&server).await;
    let open = admin.metric("hora_connections_open").await;
    assert!(open <= 3.0, "{open} connections still open");
    assert!(admin.metric("hora_connections_closed_total").await >= 150.0);
}

#[tokio::test(flavor = "multi_thread")]
async fn bodies_are_read_only_after_their_credentials_and_job_ids_cannot_be_probed() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_with(dir.path(), &["--upload-grace-secs", "1"]);
    let admin = server.api(ADMIN_TOKEN);
    let job: serde_json::Value = admin
        .ok(admin
            .request(Method::POST, "/admin/v1/sync-jobs")
            .json(&serde_json::json!({"id": "real", "world_size": 2})))
        .await;
    let job_token = job["token"].as_str().unwrap().to_string();
    // Nearly complete 1 MiB JSON bodies that then stall, with no, a wrong, or a client's
    // credentials, to an unknown job, a real job, and the admin API: each is answered 401 from
    // its headers at once (not after its body, which never comes), on a connection the server
    // then closes.
    let heads = [
        ("/v1/sync/nojob/join", None),
        ("/v1/sync/nojob/join", Some(job_token.as_str())),
        ("/v1/sync/real/join", None),
        ("/v1/sync/real/join", Some("not-the-token")),
        ("/admin/v1/sync-jobs", Some("not-the-admin-token")),
        ("/v1/enrol", Some("not-an-enrolment-token")),
    ];
    let started = Instant::now();
    let mut conns = Vec::new();
    for (path, token) in heads {
        let mut conn = raw_tls(&server).await;
        let auth = token
            .map(|t| format!("authorization: Bearer {t}\r\n"))
            .unwrap_or_default();
        let head = format!(
            "POST {path} HTTP/1.1\r\nhost: localhost\r\n{auth}content-type: application/json\r\ncontent-length: 1048576\r\n\r\n{{\"address\": \""
        );
        conn.write_all(head.as_bytes()).await.unwrap();
        conn.write_all(&[b'a'; 4096]).await.unwrap();
        conn.flush().await.unwrap();
        conns.push((path, token, conn));
    }
    for (path, token, conn) in &mut conns {
        let answer = answer_within(conn, "\r\n\r\n", Duration::from_secs(5)).await;
        let status = answer.lines().next().unwrap_or_default().to_string();
        assert!(status.contains(" 401 "), "{path} with {token:?}: {answer}");
        assert!(
            answer.to_ascii_lowercase().contains("connection: close"),
            "{answer}"
        );
        assert!(
            closed_within(conn, Duration::from_secs(5)).await.is_some(),
            "{path}: still open after its refusal"
        );
    }
    assert!(started.elapsed() < Duration::from_secs(5));
    // With the job's token the body is read, under the rate floor: a stalled one is cut off
    // with 408 once it falls behind (after the 1 s grace here), not held.
    let mut conn = raw_tls(&server).await;
    let head = format!(
        "POST /v1/sync/real/join HTTP/1.1\r\nhost: localhost\r\nauthorization: Bearer {job_token}\r\ncontent-type: application/json\r\ncontent-length: 1048576\r\n\r\n{{"
    );
    conn.write_all(head.as_bytes()).await.unwrap();
    conn.flush().await.unwrap();
    let answer = answer_within(&mut conn, "upload_too_slow", Duration::from_secs(6)).await;
    assert!(answer.contains(" 408 "), "{answer}");
    // Honest work meanwhile: the admin API answers.
    healthz_ok(&server).await;
    let jobs: Vec<serde_json::Value> = admin
        .ok(admin.request(Method::GET, "/admin/v1/sync-jobs"))
        .await;
    assert_eq!(jobs.len(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn one_source_cannot_take_every_connection_slot() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_with(dir.path(), &["--max-connections-per-source", "5"]);
    // Another source's connection, idle, older than all of the first source's.
    let mut other = raw_tls_from(&server, "127.0.0.2").await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    let mut held = Vec::new();
    for _ in 0..5 {
        held.push(raw_tls(&server).await);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A sixth from the same source closes that source's idlest connection, not the other
    // source's older one.
    let _sixth = raw_tls(&server).await;
    assert!(
        closed_within(&mut held[0], Duration::from_secs(3))
            .await
            .is_some(),
        "the source's idlest connection is still open"
    );
    assert!(closed_within(&mut other, Duration::from_millis(500))
        .await
        .is_none());
    other
        .write_all(b"GET /healthz HTTP/1.1\r\nhost: localhost\r\n\r\n")
        .await
        .unwrap();
    let answer = answer_within(&mut other, "ok", Duration::from_secs(3)).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let admin = server.api(ADMIN_TOKEN);
    assert!(
        admin
            .metric("hora_connections_closed_total{reason=\"evicted_at_source_cap\"}")
            .await
            >= 1.0
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn at_the_cap_a_stalled_upload_makes_room_and_long_polls_keep_their_connections() {
    let dir = tempfile::tempdir().unwrap();
    // Five connections (all from this address: it may have them all); a 2 s idle timeout (long polls are held 1.6 s); a grace that lets the
    // stalled body stay for a minute before the rate floor would cut it off.
    let server = Server::start_with(
        dir.path(),
        &[
            "--max-connections",
            "5",
            "--max-connections-per-source",
            "10",
            "--idle-timeout-secs",
            "2",
            "--upload-grace-secs",
            "60",
        ],
    );
    let admin = server.api(ADMIN_TOKEN);
    let (model, config) = small_task(&admin, "stalled", 2, 3).await;
    admin.create_task(&config).await;
    let staller = admin.enrol().await;
    let pollers = [admin.enrol().await, admin.enrol().await];
    let offer = staller.join("stalled").await;
    let body = staller.seal("stalled", &offer, &delta(&model, 1));

    // Two clients long-poll for the next round throughout, each on a connection of its own.
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut polling = Vec::new();
    for c in pollers {
        let api = Api {
            http: hora_server::tls::https_client(&server.ca, None).unwrap(),
            ..c.api.clone()
        };
        let (done, path) = (
            done.clone(),
            format!("/v1/tasks/stalled/poll?after={}&wait_ms=10000", offer.round),
        );
        polling.push(tokio::spawn(async move {
            let mut answered = 0;
            while !done.load(std::sync::atomic::Ordering::SeqCst) {
                let _: PollResponse = api.ok(api.request(Method::GET, &path)).await;
                answered += 1;
            }
            answered
        }));
    }
    // The staller announces its update, sends four bytes of it, and goes quiet for longer than
    // the idle timeout (the admin's pooled connection is closed meanwhile, as idle).
    let mut stalled = raw_tls(&server).await;
    let head = upload_head(&staller, "stalled", offer.round, body.len());
    stalled.write_all(head.as_bytes()).await.unwrap();
    stalled.write_all(&body[..4]).await.unwrap();
    stalled.flush().await.unwrap();
    tokio::time::sleep(Duration::from_millis(2500)).await;
    // Two connections that say nothing fill the cap: the stalled upload is the idlest
    // connection, the long polls are busy, and a newcomer is served.
    let _fillers = [raw_tls(&server).await, raw_tls(&server).await];
    healthz_ok(&server).await;
    // Closed without an answer (a refusal would read as final; a closed connection is retried).
    let sent = closed_within(&mut stalled, Duration::from_secs(3))
        .await
        .expect("the stalled upload's connection is still open");
    assert!(sent.is_empty(), "{}", String::from_utf8_lossy(&sent));
    // The long polls were answered throughout, none cut off.
    tokio::time::sleep(Duration::from_millis(500)).await;
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    for p in polling {
        assert!(p.await.expect("every poll answered") >= 2);
    }
    assert_eq!(
        admin
            .metric("hora_connections_closed_total{reason=\"evicted_stalled_at_cap\"}")
            .await,
        1.0,
        "the one stalled connection, counted once"
    );
    // The staller's retry is read and acknowledged.
    staller
        .api
        .ok::<UpdateReceipt>(staller.upload_request("stalled", offer.round, 10, body))
        .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn one_source_keeps_at_most_its_limit_of_unauthenticated_requests_in_flight() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_with(dir.path(), &["--max-unauthenticated-per-source", "4"]);
    let admin = server.api(ADMIN_TOKEN);
    // The admin token's slow check, paid once: the operator's requests are quick from now on.
    let _: Vec<TaskInfo> = admin
        .ok(admin.request(Method::GET, "/admin/v1/tasks"))
        .await;
    // Sixteen guesses of the admin token at once from one address, each a slow check...
    let mut guesses = Vec::new();
    for i in 0..16 {
        let api = admin.with_token(&format!("guess {i} of the admin token"));
        guesses.push(tokio::spawn(async move {
            let resp = api
                .request(Method::GET, "/admin/v1/tasks")
                .send()
                .await
                .expect("an answer");
            let (status, retry) = (resp.status(), resp.headers().get("retry-after").cloned());
            let err: hora_common::wire::ApiError = resp.json().await.expect("an ApiError body");
            (status, retry, err.code)
        }));
    }
    // ...while a load balancer probes the server's health from the same address, and is
    // answered (the probes are not counted against the address)...
    let probes: Vec<_> = (0..8)
        .map(|_| {
            let api = admin.with_token("probes carry no token");
            tokio::spawn(async move {
                let resp = api.request(Method::GET, "/healthz").send().await;
                resp.expect("an answer").status()
            })
        })
        .collect();
    for probe in probes {
        assert_eq!(probe.await.unwrap(), StatusCode::OK);
    }
    // ...and the operator asks from another address, and is answered.
    let answer = admin_tasks_from(&server, "127.0.0.2", "\r\n\r\n", Duration::from_secs(3)).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    // The guesses beyond the limit are refused at once, with when to retry; the others are
    // refused for their token (or, past the server's budget of slow checks, told it is busy).
    let mut refused = 0;
    for g in guesses {
        let (status, retry, code) = g.await.unwrap();
        match status {
            StatusCode::TOO_MANY_REQUESTS => {
                assert_eq!(code.as_str(), "too_many_requests");
                assert_eq!(retry.expect("a Retry-After header"), "1");
                refused += 1;
            }
            StatusCode::UNAUTHORIZED => assert_eq!(code.as_str(), "unauthorized"),
            StatusCode::SERVICE_UNAVAILABLE => assert_eq!(code.as_str(), "busy"),
            other => panic!("a guess was answered {other}"),
        }
    }
    assert!(
        refused >= 4,
        "only {refused} of 16 guesses refused for the limit"
    );
    assert!(admin.metric("hora_unauthenticated_refused_total").await >= refused as f64);
    // Their places are free again: the address's own good credentials are served.
    let _: Vec<TaskInfo> = admin
        .ok(admin.request(Method::GET, "/admin/v1/tasks"))
        .await;
}

/// A task over the small model, its initial weights uploaded.
#[tokio::test(flavor = "multi_thread")]
async fn admin_token_guesses_from_one_address_do_not_lock_the_operator_out_from_another() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_with(dir.path(), &[]);
    // Before the operator's first request: guesses from 127.0.0.1 spend that address's budget
    // of slow checks (10, then 2 a second) and are answered 503 `busy`.
    let guesser = server.api("not-the-admin-token");
    let mut busy = 0;
    for _ in 0..20 {
        let answer = guesser
            .request(Method::GET, "/admin/v1/tasks")
            .send()
            .await
            .unwrap();
        match answer.status() {
            StatusCode::UNAUTHORIZED => {}
            StatusCode::SERVICE_UNAVAILABLE => busy += 1,
            other => panic!("a guess answered {other}"),
        }
    }
    assert!(busy >= 5, "{busy} of 20 guesses rationed");
    // The operator, from 127.0.0.2, still gets its slow check.
    let answer = admin_tasks_from(&server, "127.0.0.2", "[]", Duration::from_secs(5)).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    // And once it passed, the right token needs no slow check from anywhere.
    let admin = server.api(ADMIN_TOKEN);
    let _: serde_json::Value = admin
        .ok(admin.request(Method::GET, "/admin/v1/tasks"))
        .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_admin_api_answers_only_the_networks_it_is_allowed_to() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_with(dir.path(), &["--admin-allow", "10.0.0.0/8,127.0.0.2"]);
    // From 127.0.0.1, the right token and a guess alike are refused before any check, and
    // spend nothing: the health probe is answered.
    for token in [ADMIN_TOKEN, "a guess"] {
        let answer = server
            .api(token)
            .request(Method::GET, "/admin/v1/tasks")
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), StatusCode::FORBIDDEN);
        let err: hora_common::wire::ApiError = answer.json().await.unwrap();
        assert!(err.message.contains("--admin-allow"), "{}", err.message);
    }
    healthz_ok(&server).await;
    // From the allowed address, the operator is served.
    let answer = admin_tasks_from(&server, "127.0.0.2", "[]", Duration::from_secs(5)).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
}

async fn small_task(admin: &Api, id: &str, min: u32, target: u32) -> (Model, CreateTask) {
    let model = small_model();
    let digest = admin.upload_model(&model).await;
    (model, task(id, digest, 50, min, target, 120))
}

use hora_common::wire::CreateTask;

/// A task over a model of `params` zeros, its initial weights uploaded.
async fn zeros_task(admin: &Api, id: &str, params: usize, min: u32, target: u32) -> Model {
    let model = Model::from_tensors([("w", vec![params], vec![0.0f32; params])]).unwrap();
    let digest = admin.upload_model(&model).await;
    admin
        .create_task(&task(id, digest, 50, min, target, 120))
        .await;
    model
}

#[tokio::test(flavor = "multi_thread")]
async fn a_slow_large_body_holds_only_its_share_larger_ones_hear_busy_and_smaller_ones_are_served()
{
    let dir = tempfile::tempdir().unwrap();
    // An 8 KiB body budget, of which one upload reserves at most a quarter (the default); a 1 s
    // body wait, a 3 s grace before the floor.
    let server = Server::start_with(
        dir.path(),
        &[
            "--upload-buffer-bytes",
            "8192",
            "--body-wait-secs",
            "1",
            "--upload-grace-secs",
            "3",
        ],
    );
    let admin = server.api(ADMIN_TOKEN);
    // Updates of 16 KiB (larger than the whole budget) and of a few bytes.
    let model = zeros_task(&admin, "large", 4096, 2, 3).await;
    let tiny = zeros_task(&admin, "tiny", 4, 1, 1).await;
    let (staller, honest, small) = (
        admin.enrol().await,
        admin.enrol().await,
        admin.enrol().await,
    );
    let stalled = staller.join("large").await;
    let body = staller.seal("large", &stalled, &delta(&model, 1));
    assert!(body.len() > 8192, "the body must be larger than the budget");
    let mut conn = raw_tls(&server).await;
    let head = upload_head(&staller, "large", stalled.round, body.len());
    conn.write_all(head.as_bytes()).await.unwrap();
    conn.write_all(&body[..4]).await.unwrap();
    conn.flush().await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    // Another upload as large is not queued behind the stalled body for as long as it takes: it
    // is told the server is busy once the body wait is over, and when to retry.
    let offer = honest.join("large").await;
    let sealed = honest.seal("large", &offer, &delta(&model, 2));
    let asked = Instant::now();
    let resp = honest
        .upload_request("large", offer.round, 5, sealed.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(resp.headers()["retry-after"], "1");
    let err: hora_common::wire::ApiError = resp.json().await.unwrap();
    assert_eq!(err.code.as_str(), "busy");
    assert!(err.message.contains("retry later"), "{}", err.message);
    assert!(
        asked.elapsed() < Duration::from_secs(3),
        "{:?}",
        asked.elapsed()
    );
    // A small upload is read in the rest of the budget meanwhile, and acknowledged at once.
    let offer_tiny = small.join("tiny").await;
    let asked = Instant::now();
    let receipt = small.upload("tiny", &offer_tiny, 3, &delta(&tiny, 3)).await;
    assert_eq!(receipt.accepted, 1);
    assert!(
        asked.elapsed() < Duration::from_millis(900),
        "a small upload waited {:?} behind a large one",
        asked.elapsed()
    );
    // The stalled body is cut off at the floor (408); the retry is read and acknowledged.
    let answer = answer_within(&mut conn, "upload_too_slow", Duration::from_secs(8)).await;
    assert!(answer.contains(" 408 "), "{answer}");
    let receipt: UpdateReceipt = honest
        .api
        .ok(honest.upload_request("large", offer.round, 5, sealed))
        .await;
    assert_eq!(receipt.accepted, 1);
}

#[tokio::test]
async fn a_stalled_upload_body_is_cut_off_and_other_uploads_are_acknowledged_promptly() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_with(
        dir.path(),
        &["--min-upload-rate", "1000", "--upload-grace-secs", "2"],
    );
    let admin = server.api(ADMIN_TOKEN);
    let (model, config) = small_task(&admin, "stall", 2, 3).await;
    admin.create_task(&config).await;
    let attacker = admin.enrol().await;
    let honest = [admin.enrol().await, admin.enrol().await];
    let offer = attacker.join("stall").await;

    // The attacker announces a whole update and sends four bytes of it.
    let body = attacker.seal("stall", &offer, &delta(&model, 9));
    let mut conn = raw_tls(&server).await;
    let head = upload_head(&attacker, "stall", offer.round, body.len());
    conn.write_all(head.as_bytes()).await.unwrap();
    conn.write_all(&body[..4]).await.unwrap();
    conn.flush().await.unwrap();
    let attacked = Instant::now();

    // Honest clients of the same round are acknowledged at once, not after the attacker.
    let mut updates = Vec::new();
    for (i, c) in honest.iter().enumerate() {
        let offer = c.join("stall").await;
        let d = delta(&model, i as u64);
        let started = Instant::now();
        let receipt = c.upload("stall", &offer, 10 + i as u64, &d).await;
        assert_eq!(receipt.round, offer.round);
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "an honest upload waited {:?} behind a stalled one",
            started.elapsed()
        );
        updates.push((10 + i as u64, d));
    }
    assert!(attacked.elapsed() < Duration::from_secs(2));

    // The stalled body is cut off after the grace period with a clear 408.
    let answer = answer_within(&mut conn, "upload_too_slow", Duration::from_secs(6)).await;
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("upload_too_slow"), "{answer}");
    let cut_after = attacked.elapsed();
    assert!(
        cut_after >= Duration::from_secs(2) && cut_after < Duration::from_secs(6),
        "{cut_after:?}"
    );

    // Its retry at a proper rate is accepted; nothing acknowledged before was lost.
    attacker
        .api
        .ok::<UpdateReceipt>(attacker.upload_request("stall", offer.round, 10, body))
        .await;
    updates.push((10, delta(&model, 9)));
    let published = admin.round_model("stall", 1).await;
    let (u0, u1, u2) = (&updates[0], &updates[1], &updates[2]);
    assert_close(
        &published,
        &fedavg(&model, &[u0.clone(), u1.clone(), u2.clone()]),
    );
}

#[tokio::test]
async fn a_second_upload_of_a_client_in_flight_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_with(dir.path(), &["--upload-grace-secs", "3"]);
    let admin = server.api(ADMIN_TOKEN);
    let (model, config) = small_task(&admin, "twice", 1, 2).await;
    admin.create_task(&config).await;
    let c = admin.enrol().await;
    let offer = c.join("twice").await;
    let body = c.seal("twice", &offer, &delta(&model, 1));
    let mut conn = raw_tls(&server).await;
    let head = upload_head(&c, "twice", offer.round, body.len());
    conn.write_all(head.as_bytes()).await.unwrap();
    conn.write_all(&body[..8]).await.unwrap();
    conn.flush().await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    c.api
        .refused(
            c.upload_request("twice", offer.round, 10, body.clone()),
            StatusCode::CONFLICT,
            "upload_in_progress",
        )
        .await;
    // Once the first is cut off, the client's upload goes through.
    let answer = answer_within(&mut conn, "upload_too_slow", Duration::from_secs(8)).await;
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    c.api
        .ok::<UpdateReceipt>(c.upload_request("twice", offer.round, 10, body))
        .await;
}

#[tokio::test]
async fn huge_norm_and_weight_updates_are_bounded_and_a_repeat_offender_is_quarantined() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_with(dir.path(), &["--quarantine-after", "3"]);
    let admin = server.api(ADMIN_TOKEN);
    let (model, mut config) = small_task(&admin, "bounded", 2, 2).await;
    config.update_bounds = UpdateBounds {
        max_weight: 100,
        max_norm: Some(1.0),
        on_norm_exceeded: NormPolicy::Clip,
        ..Default::default()
    };
    admin.create_task(&config).await;
    let (poisoner, honest) = (admin.enrol().await, admin.enrol().await);
    let mut huge = Model::zeros(&model.spec());
    huge.data_mut().fill(3e38);
    let offer = poisoner.join("bounded").await;
    poisoner.upload("bounded", &offer, u64::MAX, &huge).await;
    let d = delta(&model, 3);
    let offer = honest.join("bounded").await;
    honest.upload("bounded", &offer, 40, &d).await;

    let published = admin.round_model("bounded", 1).await;
    assert!(published.data().iter().all(|v| v.is_finite()));
    // Independently: the poisoned delta scaled to norm 1 with weight 100; the honest one (its
    // norm is below 1) as it is.
    let n = (huge.data().len() as f64).sqrt();
    let mut clipped = huge.clone();
    clipped
        .data_mut()
        .iter_mut()
        .for_each(|v| *v = (3e38f64 * (1.0 / (3e38f64 * n))) as f32);
    assert_close(
        &published,
        &fedavg(&model, &[(100, clipped), (40, d.clone())]),
    );
    let history: Vec<RoundRecord> = admin
        .ok(admin.request(Method::GET, "/admin/v1/tasks/bounded/rounds"))
        .await;
    assert_eq!(history[0].examples, 140);

    // With `refuse`, an oversized delta is refused with its own code and nothing is folded.
    let (_, mut strict) = small_task(&admin, "strict", 1, 1).await;
    strict.update_bounds.max_norm = Some(1.0);
    strict.update_bounds.on_norm_exceeded = NormPolicy::Refuse;
    admin.create_task(&strict).await;
    let offer = poisoner.join("strict").await;
    let body = poisoner.seal("strict", &offer, &huge);
    let msg = poisoner
        .api
        .refused(
            poisoner.upload_request("strict", offer.round, 10, body),
            StatusCode::BAD_REQUEST,
            "update_norm_exceeded",
        )
        .await;
    assert!(msg.contains("norm"), "{msg}");
    let info: TaskInfo = admin
        .ok(admin.request(Method::GET, "/admin/v1/tasks/strict"))
        .await;
    assert_eq!(info.open_round.expect("open").accepted, 0);

    // Two more refusals in a row (a non-finite update, then the oversized one again) make
    // three: the poisoner is quarantined, refused everything until the operator releases it,
    // and says so in the admin API and the metrics. The honest client is served meanwhile.
    let mut nan = Model::zeros(&model.spec());
    nan.data_mut()[0] = f32::NAN;
    for (update, code) in [(&nan, "invalid_update"), (&huge, "update_norm_exceeded")] {
        let body = poisoner.seal("strict", &offer, update);
        poisoner
            .api
            .refused(
                poisoner.upload_request("strict", offer.round, 10, body),
                StatusCode::BAD_REQUEST,
                code,
            )
            .await;
    }
    let poll = |who: &Client| {
        who.api
            .request(Method::GET, "/v1/tasks/bounded/poll?wait_ms=0")
    };
    let msg = poisoner
        .api
        .refused(poll(&poisoner), StatusCode::FORBIDDEN, "quarantined")
        .await;
    assert!(msg.contains("release"), "{msg}");
    let _: PollResponse = honest.api.ok(poll(&honest)).await;
    let offer = honest.join("bounded").await;
    assert_eq!(offer.round, 2);
    honest.upload("bounded", &offer, 40, &d).await;
    let clients: Vec<ClientInfo> = admin
        .ok(admin.request(Method::GET, "/admin/v1/clients"))
        .await;
    let listed = |id: &str| clients.iter().find(|c| c.client_id == id).unwrap().clone();
    let quarantined = listed(&poisoner.id);
    assert_eq!(quarantined.strikes, 3);
    assert!(
        quarantined
            .quarantined
            .as_deref()
            .is_some_and(|r| r.contains("3 strikes in a row; the last: update refused")),
        "{quarantined:?}"
    );
    assert_eq!(
        (listed(&honest.id).strikes, listed(&honest.id).quarantined),
        (0, None)
    );
    assert_eq!(admin.metric("hora_clients_quarantined_total").await, 1.0);
    // Released, it is served again, with a clean count.
    let released: ClientInfo = admin
        .ok(admin.request(
            Method::POST,
            &format!("/admin/v1/clients/{}/release", poisoner.id),
        ))
        .await;
    assert_eq!((released.strikes, released.quarantined), (0, None));
    let _: PollResponse = poisoner.api.ok(poll(&poisoner)).await;

    // Weights: once 8 updates are in, a claimed count above 10 times their median counts as
    // that.
    let (_, mut weighed) = small_task(&admin, "weighed", 10, 10).await;
    weighed.rounds = 1;
    admin.create_task(&weighed).await;
    for i in 0..10u64 {
        let who = if i == 8 {
            &poisoner
        } else {
            &admin.enrol().await
        };
        let offer = who.join("weighed").await;
        let claimed = if i == 8 { 1_000_000 } else { 10 };
        who.upload("weighed", &offer, claimed, &delta(&model, 50 + i))
            .await;
    }
    admin.round_model("weighed", 1).await;
    let history: Vec<RoundRecord> = admin
        .ok(admin.request(Method::GET, "/admin/v1/tasks/weighed/rounds"))
        .await;
    assert_eq!(history[0].examples, 9 * 10 + 100);
}

#[tokio::test]
async fn a_round_that_would_publish_a_non_finite_model_is_abandoned_and_retried() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let admin = server.api(ADMIN_TOKEN);
    // Unbounded updates (the default has no norm bound) near f32's limit overflow when added
    // to a model that is near it too.
    let mut model = small_model();
    model.data_mut()[0] = 3e38;
    let digest = admin.upload_model(&model).await;
    admin
        .create_task(&task("overflow", digest, 5, 1, 1, 120))
        .await;
    let c = admin.enrol().await;
    let mut huge = Model::zeros(&model.spec());
    huge.data_mut()[0] = 3e38;
    let offer = c.join("overflow").await;
    // Acknowledged (durable before the close) or told the round was abandoned: either way it
    // is not published.
    let resp = c
        .upload_request(
            "overflow",
            offer.round,
            1,
            c.seal("overflow", &offer, &huge),
        )
        .send()
        .await
        .unwrap();
    let status = resp.status();
    let text = resp.text().await.unwrap();
    assert!(
        status == StatusCode::OK || (status == StatusCode::CONFLICT && text.contains("not finite")),
        "{status}: {text}"
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while admin
        .ok::<Vec<RoundRecord>>(admin.request(Method::GET, "/admin/v1/tasks/overflow/rounds"))
        .await
        .is_empty()
    {
        assert!(Instant::now() < deadline, "round 1 never closed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let history: Vec<RoundRecord> = admin
        .ok(admin.request(Method::GET, "/admin/v1/tasks/overflow/rounds"))
        .await;
    let RoundOutcome::Abandoned { reason } = &history[0].outcome else {
        panic!("published a non-finite model: {history:?}");
    };
    assert!(reason.contains("not finite"), "{reason}");
    assert!(history[0].model.is_none());
    // The task goes on: the retry of round 1 publishes a finite model from a sane update.
    let offer = c.join("overflow").await;
    assert_eq!(offer.round, 1);
    assert_eq!(offer.model, digest);
    let d = delta(&model, 5);
    c.upload("overflow", &offer, 3, &d).await;
    let published = admin.round_model("overflow", 1).await;
    assert!(published.data().iter().all(|v| v.is_finite()));
    assert_close(&published, &fedavg(&model, &[(3, d)]));
}

/// A client enrolled through a token limited to `tasks`.
async fn enrol_for(admin: &Api, tasks: &[&str]) -> Api {
    let token: serde_json::Value = admin
        .ok(admin
            .request(Method::POST, "/admin/v1/enrolments")
            .json(&serde_json::json!({ "tasks": tasks })))
        .await;
    let creds: Credentials = admin
        .ok(admin
            .with_token(token["token"].as_str().unwrap())
            .request(Method::POST, "/v1/enrol")
            .json(&serde_json::json!({})))
        .await;
    admin.with_token(&format!("{}.{}", creds.client_id, creds.secret))
}

#[tokio::test]
async fn a_client_sees_only_its_tasks_and_a_malformed_enrolment_keeps_the_token() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let admin = server.api(ADMIN_TOKEN);
    for id in ["mine", "theirs"] {
        let (_, config) = small_task(&admin, id, 1, 2).await;
        admin.create_task(&config).await;
    }
    // A malformed request is refused before the one-time token is spent.
    let token: serde_json::Value = admin
        .ok(admin
            .request(Method::POST, "/admin/v1/enrolments")
            .json(&serde_json::json!({"tasks": ["mine"]})))
        .await;
    let anonymous = admin.with_token(token["token"].as_str().unwrap());
    anonymous
        .refused(
            anonymous
                .request(Method::POST, "/v1/enrol")
                .json(&serde_json::json!({"identity_key": "zz"})),
            StatusCode::BAD_REQUEST,
            "bad_request",
        )
        .await;
    let creds: Credentials = anonymous
        .ok(anonymous
            .request(Method::POST, "/v1/enrol")
            .json(&serde_json::json!({})))
        .await;
    let client = admin.with_token(&format!("{}.{}", creds.client_id, creds.secret));

    let poll: PollResponse = client
        .ok(client.request(Method::GET, "/v1/tasks/mine/poll?wait_ms=0"))
        .await;
    assert_eq!(poll.task, "mine");
    // Another task answers exactly as one that does not exist.
    let theirs = client
        .refused(
            client.request(Method::GET, "/v1/tasks/theirs/poll?wait_ms=0"),
            StatusCode::NOT_FOUND,
            "not_found",
        )
        .await;
    let missing = client
        .refused(
            client.request(Method::GET, "/v1/tasks/nosuch/poll?wait_ms=0"),
            StatusCode::NOT_FOUND,
            "not_found",
        )
        .await;
    assert_eq!(
        theirs.replace("theirs", "X"),
        missing.replace("nosuch", "X")
    );
    for (method, path) in [
        (Method::POST, "/v1/tasks/theirs/join"),
        (Method::GET, "/v1/tasks/theirs/model"),
        (Method::POST, "/v1/tasks/theirs/rounds/1/update"),
    ] {
        client
            .refused(
                client.request(method, path),
                StatusCode::NOT_FOUND,
                "not_found",
            )
            .await;
    }
    // A client enrolled without a list sees every task.
    let other = admin.enrol().await;
    other
        .api
        .ok::<PollResponse>(
            other
                .api
                .request(Method::GET, "/v1/tasks/theirs/poll?wait_ms=0"),
        )
        .await;
    // A client of both tasks sees both.
    let both = enrol_for(&admin, &["mine", "theirs"]).await;
    both.ok::<PollResponse>(both.request(Method::GET, "/v1/tasks/theirs/poll?wait_ms=0"))
        .await;
    let scoped = enrol_for(&admin, &["mine"]).await;
    scoped
        .refused(
            scoped.request(Method::POST, "/v1/tasks/theirs/join"),
            StatusCode::NOT_FOUND,
            "not_found",
        )
        .await;
}

#[tokio::test]
async fn the_data_dir_is_private_metrics_can_need_the_token_and_500s_say_no_more() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let server = Server::start_with(&data, &["--metrics-require-token"]);
    let admin = server.api(ADMIN_TOKEN);
    let (_, config) = small_task(&admin, "private", 1, 2).await;
    let info = admin.create_task(&config).await;

    use std::os::unix::fs::PermissionsExt;
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&data), 0o700);
    let mut files = 0;
    let mut stack = vec![data.clone()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else {
                assert_eq!(
                    mode(&path) & 0o077,
                    0,
                    "{} is readable by others",
                    path.display()
                );
                files += 1;
            }
        }
    }
    assert!(files >= 4, "only {files} files");

    let anonymous = admin.with_token("");
    anonymous
        .refused(
            anonymous.request(Method::GET, "/metrics"),
            StatusCode::UNAUTHORIZED,
            "missing_credentials",
        )
        .await;
    let resp = admin.request(Method::GET, "/metrics").send().await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert!(resp
        .text()
        .await
        .unwrap()
        .contains("hora_uploads_accepted_total"));

    // A blob gone from under the server is its fault (500), and the body names no path.
    let blob = data
        .join("blobs/models")
        .join(format!("{}.safetensors", info.global_model.to_hex()));
    std::fs::remove_file(&blob).unwrap();
    let c = admin.enrol().await;
    let resp = c
        .api
        .request(Method::GET, "/v1/tasks/private/model")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::INTERNAL_SERVER_ERROR);
    let text = resp.text().await.unwrap();
    assert!(text.contains("reference"), "{text}");
    assert!(!text.contains(dir.path().to_str().unwrap()), "{text}");
    assert!(!text.contains("No such file"), "{text}");
}

#[tokio::test]
async fn a_corrupt_task_leaves_the_others_serving() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let server = Server::start_on(dir.path(), &listen, &[]);
    let admin = server.api(ADMIN_TOKEN);
    let (model, config) = small_task(&admin, "damaged", 2, 3).await;
    admin.create_task(&config).await;
    let (_, config) = small_task(&admin, "healthy", 1, 1).await;
    admin.create_task(&config).await;
    let c = admin.enrol().await;
    let offer = c.join("damaged").await;
    c.upload("damaged", &offer, 5, &delta(&model, 1)).await;
    server.kill();

    // A bit flips in the damaged task's round checkpoint.
    let ckpt = std::fs::read_dir(dir.path().join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "ckpt"))
        .expect("a checkpoint");
    let mut bytes = std::fs::read(&ckpt).unwrap();
    bytes[20] ^= 1;
    std::fs::write(&ckpt, bytes).unwrap();

    let server = Server::start_on(dir.path(), &listen, &[]);
    let admin = server.api(ADMIN_TOKEN);
    // The same client, on fresh connections to the restarted server.
    let c = Client {
        api: admin.with_token(&c.api.token),
        id: c.id,
    };
    let msg = c
        .api
        .refused(
            c.api.request(Method::POST, "/v1/tasks/damaged/join"),
            StatusCode::SERVICE_UNAVAILABLE,
            "task_unavailable",
        )
        .await;
    assert!(!msg.contains(dir.path().to_str().unwrap()), "{msg}");
    assert_eq!(admin.metric("hora_tasks_broken").await, 1.0);
    // The healthy task serves and publishes.
    let offer = c.join("healthy").await;
    let d = delta(&model, 2);
    c.upload("healthy", &offer, 5, &d).await;
    assert_close(
        &admin.round_model("healthy", 1).await,
        &fedavg(&model, &[(5, d)]),
    );
    // Nothing of the damaged task was swept away: its checkpoint is still there to repair.
    assert!(ckpt.exists());
}

#[tokio::test]
async fn an_upload_waits_for_durability_for_a_bounded_time_and_its_retry_gets_the_receipt() {
    let dir = tempfile::tempdir().unwrap();
    // Checkpoints 3 s apart stand in for slow storage; uploads wait at most 2 s for one.
    let server = Server::start_with(
        dir.path(),
        &[
            "--commit-window-ms",
            "3000",
            "--durability-timeout-secs",
            "2",
        ],
    );
    let admin = server.api(ADMIN_TOKEN);
    let (model, config) = small_task(&admin, "slowdisk", 2, 3).await;
    admin.create_task(&config).await;
    let c = admin.enrol().await;
    // A join is answered once its selection is durable: not within 2 s here, so it is told to
    // join again, and the repeat (made while the checkpoint it asked for is written) gets the
    // offer.
    let msg = c
        .api
        .refused(
            c.api.request(Method::POST, "/v1/tasks/slowdisk/join"),
            StatusCode::SERVICE_UNAVAILABLE,
            "not_durable_yet",
        )
        .await;
    assert!(msg.contains("join again"), "{msg}");
    let offer = c.join("slowdisk").await;
    let body = c.seal("slowdisk", &offer, &delta(&model, 4));
    let msg = c
        .api
        .refused(
            c.upload_request("slowdisk", offer.round, 7, body.clone()),
            StatusCode::SERVICE_UNAVAILABLE,
            "not_durable_yet",
        )
        .await;
    assert!(msg.contains("retry"), "{msg}");
    // The retry is not `already_contributed` (that is only for durable updates): it waits for
    // the checkpoint (due 3 s after the first upload, 1 s from now) and gets the receipt, and the
    // update counts once.
    let receipt: UpdateReceipt = c
        .api
        .ok(c.upload_request("slowdisk", offer.round, 7, body.clone()))
        .await;
    assert_eq!(receipt.accepted, 1);
    // Now that it is durable, a repeat is `already_contributed`.
    c.api
        .refused(
            c.upload_request("slowdisk", offer.round, 7, body),
            StatusCode::CONFLICT,
            "already_contributed",
        )
        .await;
    let info: TaskInfo = admin
        .ok(admin.request(Method::GET, "/admin/v1/tasks/slowdisk"))
        .await;
    assert_eq!(info.open_round.expect("open").accepted, 1);
}

#[tokio::test]
async fn old_round_models_are_pruned_and_old_history_compacted_by_the_retention_policy() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_with(
        dir.path(),
        &[
            "--retain-rounds-last",
            "2",
            "--retain-rounds-every",
            "3",
            "--history-detail-rounds",
            "4",
        ],
    );
    let admin = server.api(ADMIN_TOKEN);
    let (model, config) = small_task(&admin, "keep", 1, 1).await;
    admin.create_task(&config).await;
    let c = admin.enrol().await;
    for round in 1..=7u64 {
        let offer = c.join("keep").await;
        assert_eq!(offer.round, round);
        c.upload("keep", &offer, 5, &delta(&model, round)).await;
        // Wait for the round to be published before joining the next.
        c.api
            .ok::<PollResponse>(c.api.request(
                Method::GET,
                &format!("/v1/tasks/keep/poll?after={round}&wait_ms=5000"),
            ))
            .await;
    }
    for round in [0u64, 3, 6, 7] {
        admin.round_model("keep", round).await;
    }
    for round in [1u64, 2, 4, 5] {
        admin
            .refused(
                admin.request(
                    Method::GET,
                    &format!("/admin/v1/tasks/keep/rounds/{round}/model"),
                ),
                StatusCode::GONE,
                "model_pruned",
            )
            .await;
    }
    let history: Vec<RoundRecord> = admin
        .ok(admin.request(Method::GET, "/admin/v1/tasks/keep/rounds"))
        .await;
    let pruned: Vec<u64> = history
        .iter()
        .filter(|r| r.pruned)
        .map(|r| r.round)
        .collect();
    assert_eq!(pruned, vec![1, 2, 4, 5]);
    // Rounds 1 to 3 keep how many took part, not who; the last four keep who.
    let who: Vec<_> = history
        .iter()
        .map(|r| {
            (
                r.round,
                r.participants.len(),
                r.compacted.map(|c| c.participants),
            )
        })
        .collect();
    assert_eq!(
        who,
        vec![
            (1, 0, Some(1)),
            (2, 0, Some(1)),
            (3, 0, Some(1)),
            (4, 1, None),
            (5, 1, None),
            (6, 1, None),
            (7, 1, None)
        ]
    );
    // The current model is served to clients.
    let (current, _) = c.global("keep").await;
    assert_eq!(current, admin.round_model("keep", 7).await);
    let files = std::fs::read_dir(dir.path().join("blobs/models"))
        .unwrap()
        .count();
    assert_eq!(files, 4, "initial + rounds 3, 6, 7");
}

#[tokio::test]
async fn a_failed_round_close_is_retried_until_it_publishes() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let admin = server.api(ADMIN_TOKEN);
    let (model, config) = small_task(&admin, "retry", 1, 1).await;
    admin.create_task(&config).await;
    let c = admin.enrol().await;
    let offer = c.join("retry").await;
    // The model store breaks (a file where its directory was): closing the round fails.
    let models = dir.path().join("blobs/models");
    let aside = dir.path().join("models-aside");
    std::fs::rename(&models, &aside).unwrap();
    std::fs::write(&models, b"not a directory").unwrap();
    let d = delta(&model, 8);
    c.upload("retry", &offer, 5, &d).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let info: TaskInfo = admin
        .ok(admin.request(Method::GET, "/admin/v1/tasks/retry"))
        .await;
    assert_eq!(
        info.published_rounds, 0,
        "published without its model store"
    );
    // Storage comes back: the round is published without anyone asking.
    std::fs::remove_file(&models).unwrap();
    std::fs::rename(&aside, &models).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let info: TaskInfo = admin
            .ok(admin.request(Method::GET, "/admin/v1/tasks/retry"))
            .await;
        if info.published_rounds == 1 {
            break;
        }
        assert!(Instant::now() < deadline, "the close was not retried");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_close(
        &admin.round_model("retry", 1).await,
        &fedavg(&model, &[(5, d)]),
    );
}

/// The `q` quantile of `samples` (sorted in place).
fn quantile(samples: &mut [Duration], q: f64) -> Duration {
    samples.sort();
    samples[((samples.len() - 1) as f64 * q).round() as usize]
}

/// While the round of a task with a 1 GiB model is checkpointed (its 2 GiB f64 sum written
/// and flushed) and published (the model aggregated, written and recorded), and that task's own
/// clients and its operator keep asking about it, the server serves everyone else: `/healthz`,
/// polls of another task and uploads to it keep answering. Their p99 is printed and held to a
/// generous bound; a handler waiting on the big round's lock, or one task's checkpoint ahead of
/// another's acknowledgements, takes seconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn while_a_gigabyte_model_is_published_everyone_else_is_served() {
    const PARAMS: usize = 256 << 20; // 1 GiB of f32
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_with(
        dir.path(),
        &[
            "--max-model-bytes",
            "1100000000",
            "--upload-buffer-bytes",
            "2400000000",
            "--request-timeout-secs",
            "600",
            "--durability-timeout-secs",
            "600",
        ],
    );
    let admin = server.api(ADMIN_TOKEN);
    let big = Model::from_tensors([("w", vec![PARAMS], vec![0.0f32; PARAMS])]).unwrap();
    let big_digest = admin.upload_model(&big).await;
    // A target of two: the one update is acknowledged only once a checkpoint of the 2 GiB sum
    // holds it, and the round publishes at its deadline.
    admin
        .create_task(&task("big", big_digest, 1, 1, 2, 45))
        .await;
    let (small_model, small) = small_task(&admin, "small", 1, 1).await;
    admin
        .create_task(&CreateTask {
            rounds: 10_000,
            ..small
        })
        .await;
    let (writer, other) = (admin.enrol().await, admin.enrol().await);
    let offer = writer.join("big").await;
    let sealed = writer.seal("big", &offer, &delta(&big, 7));
    drop(big);

    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let running = |done: &std::sync::Arc<std::sync::atomic::AtomicBool>| {
        !done.load(std::sync::atomic::Ordering::SeqCst)
    };
    // The big task's own clients and operator keep asking about it throughout.
    let mut askers = Vec::new();
    for i in 0..3 {
        let (done, api) = (done.clone(), admin.enrol().await.api);
        askers.push(tokio::spawn(async move {
            while running(&done) {
                let path = match i {
                    0 => "/admin/v1/tasks/big".to_string(),
                    _ => "/v1/tasks/big/poll?wait_ms=0".to_string(),
                };
                let api = if i == 0 {
                    api.with_token(ADMIN_TOKEN)
                } else {
                    api.clone()
                };
                let _ = api.request(Method::GET, &path).send().await;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }));
    }
    // Uploads to the small task, one round after another.
    let uploads = {
        let done = done.clone();
        tokio::spawn(async move {
            let mut took = Vec::new();
            let mut seed = 100;
            while running(&done) {
                let Some(offer) = other.try_join("small").await else {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                };
                seed += 1;
                let body = other.seal("small", &offer, &delta(&small_model, seed));
                let asked = Instant::now();
                let _: UpdateReceipt = other
                    .api
                    .ok(other.upload_request("small", offer.round, 5, body))
                    .await;
                took.push(asked.elapsed());
            }
            took
        })
    };
    let started = Instant::now();
    let upload = tokio::spawn(async move {
        writer
            .api
            .ok::<UpdateReceipt>(
                writer
                    .upload_request("big", offer.round, 10, sealed)
                    .timeout(Duration::from_secs(600)),
            )
            .await
    });
    let poller = admin.enrol().await;
    let (mut healthz, mut polls) = (Vec::new(), Vec::new());
    loop {
        healthz.push(healthz_ok(&server).await);
        let asked = Instant::now();
        let _: PollResponse = poller
            .api
            .ok(poller
                .api
                .request(Method::GET, "/v1/tasks/small/poll?wait_ms=0"))
            .await;
        polls.push(asked.elapsed());
        let info: TaskInfo = admin
            .ok(admin.request(Method::GET, "/admin/v1/tasks/big"))
            .await;
        if info.published_rounds == 1 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(540),
            "the big round was not published"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let published = started.elapsed();
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    assert_eq!(upload.await.unwrap().accepted, 1);
    for a in askers {
        a.await.unwrap();
    }
    let mut uploads = uploads.await.unwrap();
    assert!(
        healthz.len() >= 5 && uploads.len() >= 3,
        "too few requests overlapped the publication: {} healthz, {} uploads",
        healthz.len(),
        uploads.len()
    );
    let (h, p, u) = (
        quantile(&mut healthz, 0.99),
        quantile(&mut polls, 0.99),
        quantile(&mut uploads, 0.99),
    );
    println!(
        "1 GiB upload to publication: {:.1} s; meanwhile p99 /healthz {} ms ({} requests), other task's poll {} ms ({}), other task's upload to receipt {} ms ({})",
        published.as_secs_f64(),
        h.as_millis(),
        healthz.len(),
        p.as_millis(),
        polls.len(),
        u.as_millis(),
        uploads.len()
    );
    let bound = Duration::from_secs(3);
    assert!(h < bound && p < bound && u < bound, "a p99 above {bound:?}");
}
