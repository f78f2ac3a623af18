//! What the OpenAPI document promises about refusals, checked against the real server without
//! the fuzzer (which needs Python): every refusal is an `ApiError` JSON body, a path or query
//! parameter that does not parse is a 400, a method a path does not serve is a 405 with `Allow`,
//! and an HTTP/1.1 client may go on using its connection after a refusal.

mod support;

use reqwest::header::{ALLOW, CONTENT_TYPE};
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};
use support::{Server, ADMIN_TOKEN};

/// Sends `req` and returns the status and the `ApiError` body, checking that it is one.
async fn refusal(req: reqwest::RequestBuilder) -> (StatusCode, reqwest::header::HeaderMap, Value) {
    let resp = req.send().await.expect("an answer");
    let (status, headers) = (resp.status(), resp.headers().clone());
    assert_eq!(
        headers.get(CONTENT_TYPE).map(|v| v.to_str().unwrap()),
        Some("application/json"),
        "{status}"
    );
    let body: Value = resp.json().await.expect("a JSON body");
    assert!(
        body["code"].is_string() && body["message"].is_string(),
        "{status}: {body}"
    );
    (status, headers, body)
}

#[tokio::test(flavor = "multi_thread")]
async fn malformed_parameters_and_wrong_methods_answer_api_errors() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("data"));
    let http = server.http();
    let url = |path: &str| format!("{}{path}", server.url);

    // Client credentials: a well-formed token, so the refusal comes from the path or query.
    let enrolment: Value = http
        .post(url("/admin/v1/enrolments"))
        .bearer_auth(ADMIN_TOKEN)
        .json(&json!({}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let credentials: Value = http
        .post(url("/v1/enrol"))
        .bearer_auth(enrolment["token"].as_str().unwrap())
        .json(&json!({}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let client = format!(
        "{}.{}",
        credentials["client_id"].as_str().unwrap(),
        credentials["secret"].as_str().unwrap()
    );

    let (status, _, body) = refusal(
        http.post(url("/v1/tasks/x/rounds/notanumber/update"))
            .bearer_auth(&client)
            .body("x"),
    )
    .await;
    assert_eq!(
        (status, body["code"].as_str()),
        (StatusCode::BAD_REQUEST, Some("bad_request"))
    );
    assert!(
        body["message"].as_str().unwrap().contains("notanumber"),
        "{body}"
    );

    let (status, _, body) = refusal(
        http.get(url("/admin/v1/tasks/x/rounds/-1/model"))
            .bearer_auth(ADMIN_TOKEN),
    )
    .await;
    assert_eq!(
        (status, body["code"].as_str()),
        (StatusCode::BAD_REQUEST, Some("bad_request"))
    );

    let (status, _, body) = refusal(
        http.get(url("/v1/tasks/x/secagg/1/0/neighbours?wait_ms=soon"))
            .bearer_auth(&client),
    )
    .await;
    assert_eq!(
        (status, body["code"].as_str()),
        (StatusCode::BAD_REQUEST, Some("bad_request"))
    );
    assert!(
        body["message"].as_str().unwrap().contains("wait_ms"),
        "{body}"
    );

    // A struct is an object, not the array of its fields.
    let (status, _, body) = refusal(
        http.post(url("/admin/v1/enrolments"))
            .bearer_auth(ADMIN_TOKEN)
            .json(&json!([null, null])),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");

    let (status, headers, body) = refusal(
        http.request(Method::PUT, url("/admin/v1/tasks"))
            .bearer_auth(ADMIN_TOKEN),
    )
    .await;
    assert_eq!(
        (status, body["code"].as_str()),
        (StatusCode::METHOD_NOT_ALLOWED, Some("method_not_allowed"))
    );
    let mut allowed: Vec<&str> = headers
        .get(ALLOW)
        .unwrap()
        .to_str()
        .unwrap()
        .split(',')
        .collect();
    allowed.sort_unstable();
    assert_eq!(allowed, ["GET", "HEAD", "POST"]);

    let (status, _, body) = refusal(http.get(url("/v2/nothing"))).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (StatusCode::NOT_FOUND, Some("not_found"))
    );
}

/// Sends `request` over a fresh TLS connection speaking HTTP/1.1 and returns all the server
/// wrote before it closed the connection or 2 s passed.
fn raw_http1(server: &Server, request: &[u8]) -> String {
    use std::io::{Read, Write};
    let mut config = hora_common::tls::client_config(&server.ca, None).unwrap();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let name = rustls_pki_types::ServerName::try_from("127.0.0.1").unwrap();
    let conn = rustls::ClientConnection::new(std::sync::Arc::new(config), name).unwrap();
    let addr = server.url.trim_start_matches("https://");
    let tcp = std::net::TcpStream::connect(addr).unwrap();
    tcp.set_read_timeout(Some(std::time::Duration::from_secs(2)))
        .unwrap();
    let mut tls = rustls::StreamOwned::new(conn, tcp);
    tls.write_all(request).unwrap();
    let mut answer = Vec::new();
    // A connection the server ends without TLS close_notify reads as an error: what came
    // before it is the answer.
    let _ = tls.read_to_end(&mut answer);
    String::from_utf8_lossy(&answer).into_owned()
}

/// A refusal given before the body was read ends the HTTP/1.1 connection, and says so: without
/// `Connection: close` a client reusing the connection saw it drop instead of an answer.
#[test]
fn an_early_refusal_over_http1_says_the_connection_closes() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("data"));
    let body = r#"{"id":"j","world_size":2}"#;
    let request = |token: &str| {
        format!(
            "POST /admin/v1/sync-jobs HTTP/1.1\r\nhost: 127.0.0.1\r\nauthorization: Bearer {token}\r\n\
             content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
    };
    let refused = raw_http1(&server, request("wrong").as_bytes());
    assert!(refused.starts_with("HTTP/1.1 401"), "{refused}");
    assert!(refused.contains("\r\nconnection: close\r\n"), "{refused}");

    // A body that was read leaves the connection open: the server answers and waits for the
    // next request (until the read times out).
    let created = raw_http1(&server, request(ADMIN_TOKEN).as_bytes());
    assert!(created.starts_with("HTTP/1.1 201"), "{created}");
    assert!(!created.contains("connection: close"), "{created}");
}
