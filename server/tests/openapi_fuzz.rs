//! The server keeps the promises of its OpenAPI document. Schemathesis, a property-based API
//! fuzzer, reads `GET /openapi.json` and sends a real `hora-server serve` on loopback (TLS with
//! its development CA) requests the document calls valid and requests that break it, then checks
//! every answer: no 5xx, a status the document lists for that route, the content type and body
//! schema it gives, invalid data refused, valid data not refused with 400, 401 without
//! credentials, 405 with an `Allow` header for a method a path does not serve, …
//!
//! Two runs: one with an enrolled client's credentials, aimed at a real task (so polls, joins and
//! model downloads answer 200 and their bodies are checked too), one with the admin token over
//! random ids. Schemathesis comes from `scripts/setup-schemathesis.sh`; `make test` exports its
//! path as `HORA_SCHEMATHESIS`.
//!
//! What is bounded, and why: examples per operation and the per-request timeout (the whole test
//! stays within a few minutes on two cores); and, in the client run, `wait_ms`, which is pinned to
//! 0 — the server holds a long poll up to 30 s by design, and the fuzzer would find that slow, not
//! wrong. Sync-job joins cannot hold either run: neither run's credentials are a job token.

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use hora_common::model::{DType, Model, ModelSpec, TensorSpec};
use serde_json::{json, Value};
use support::{Server, ADMIN_TOKEN};

/// Generated cases per operation and phase: enough to find a gap in the document, few enough that
/// the runs take about a minute on two cores. `HORA_FUZZ_EXAMPLES` asks for more.
const MAX_EXAMPLES: &str = "50";
/// Fixed, so a failure reproduces; `HORA_FUZZ_SEED` tries another.
const SEED: &str = "1";

/// Operations whose bodies the schema cannot call valid or not: a safetensors file, a TorchScript
/// archive, a sealed envelope, masked words, signed keys and shares, a digest that must name an
/// uploaded model, min_clients ≤ target_clients, a world size that must match the job's, an
/// elastic job's min_world_size ≤ world_size (and settle_ms only with it), an enrolment's
/// max_contributors only with aggregator, an
/// upload session that must exist (410) and a length within the task's limit (413). Valid by the
/// document, such a request may still be refused with 400, 410 or 413, and the document says so.
/// Not a blanket exemption: every other operation must take every request its schema calls
/// valid.
const CONTENT_CHECKED: &[&str] = &[
    "POST /admin/v1/models",
    "POST /admin/v1/modules",
    "POST /admin/v1/tasks",
    "POST /admin/v1/sync-jobs",
    "POST /admin/v1/enrolments",
    "POST /v1/tasks/{task}/rounds/{round}/update",
    "POST /v1/tasks/{task}/rounds/{round}/uploads",
    "PUT /v1/tasks/{task}/rounds/{round}/uploads/{digest}/chunks/{index}",
    "POST /v1/tasks/{task}/rounds/{round}/uploads/{digest}/complete",
    "POST /v1/tasks/{task}/secagg/{round}/{attempt}/advertise",
    "POST /v1/tasks/{task}/secagg/{round}/{attempt}/shares",
    "POST /v1/tasks/{task}/secagg/{round}/{attempt}/masked",
    "POST /v1/tasks/{task}/secagg/{round}/{attempt}/unmask",
    "POST /v1/sync/{job}/join",
];

/// The fuzzer, or `None` where the test cannot run here at all (no Python).
fn schemathesis() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("HORA_SCHEMATHESIS") {
        return Some(PathBuf::from(path));
    }
    if Command::new("python3").arg("--version").output().is_err() {
        println!(
            "SKIPPED: the OpenAPI fuzz test needs schemathesis, which needs Python 3, and there is \
             no python3 here"
        );
        return None;
    }
    panic!(
        "HORA_SCHEMATHESIS is not set: run the tests with `make test`, or install the fuzzer with \
         `eval \"$(scripts/setup-schemathesis.sh --print-env)\"` and run them again"
    );
}

/// One request through the admin or client API, decoded; panics with the server's answer.
async fn call(req: reqwest::RequestBuilder, what: &str) -> Value {
    let resp = req.send().await.unwrap_or_else(|e| panic!("{what}: {e}"));
    let status = resp.status();
    let text = resp.text().await.unwrap_or_default();
    assert!(status.is_success(), "{what}: {status}: {text}");
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{what}: {e}: {text}"))
}

/// What the runs aim at: task `fuzz` (its first round open), an enrolled client, a sync job.
struct Fixtures {
    client_id: String,
    client_token: String,
    job_token: String,
}

/// Uploads a four-weight model and creates task `fuzz` on it, enrols a client, and creates sync
/// job `fuzzjob` (a world of one, so a join completes at once).
fn prepare(server: &Server) -> Fixtures {
    let runtime = tokio::runtime::Runtime::new().expect("a runtime");
    runtime.block_on(async {
        let http = server.http();
        let admin = |path: &str| {
            http.post(format!("{}{path}", server.url))
                .bearer_auth(ADMIN_TOKEN)
        };
        let spec = ModelSpec::new(vec![TensorSpec {
            name: "w".into(),
            shape: vec![4],
            dtype: DType::F32,
        }])
        .expect("a spec");
        let model = Model::from_flat(&spec, vec![0.5; 4]).expect("a model");
        let uploaded = call(
            admin("/admin/v1/models")
                .header("content-type", "application/octet-stream")
                .body(model.to_safetensors()),
            "upload the model",
        )
        .await;
        call(
            admin("/admin/v1/tasks").json(&json!({
                "id": "fuzz",
                "initial_model": uploaded["digest"],
                "model": { "kind": "builtin", "name": "logreg" },
                "rounds": 1000,
                "min_clients": 1,
                "target_clients": 1,
                "round_deadline_secs": 3600,
            })),
            "create the task",
        )
        .await;
        let enrolment = call(
            admin("/admin/v1/enrolments").json(&json!({})),
            "create an enrolment",
        )
        .await;
        let credentials = call(
            http.post(format!("{}/v1/enrol", server.url))
                .bearer_auth(enrolment["token"].as_str().expect("the enrolment token"))
                .json(&json!({ "label": "fuzzer" })),
            "enrol",
        )
        .await;
        let job = call(
            admin("/admin/v1/sync-jobs").json(&json!({ "id": "fuzzjob", "world_size": 1 })),
            "create the sync job",
        )
        .await;
        let client_id = credentials["client_id"].as_str().expect("client_id");
        Fixtures {
            client_id: client_id.to_string(),
            client_token: format!(
                "{client_id}.{}",
                credentials["secret"].as_str().expect("secret")
            ),
            job_token: job["token"].as_str().expect("the job token").to_string(),
        }
    })
}

/// One schemathesis run: whose credentials, which values are pinned for every operation that
/// has the parameter (`"path.task" = "fuzz"`), and which operations it tests.
struct Run<'a> {
    name: &'a str,
    token: &'a str,
    pinned: Vec<(&'a str, Value)>,
    /// A regular expression the tested paths match.
    only_path: Option<&'a str>,
}

/// The run's schemathesis configuration file: the pinned values, and the operations allowed a
/// refusal for data their schema calls valid ([`CONTENT_CHECKED`]).
fn config(dir: &Path, run: &Run) -> PathBuf {
    let mut toml = String::from("[parameters]\n");
    for (key, value) in &run.pinned {
        toml += &format!("{key:?} = {value}\n");
    }
    for operation in CONTENT_CHECKED {
        toml += &format!(
            "\n[[operations]]\ninclude-name = {operation:?}\n\
             checks.positive_data_acceptance.expected-statuses = \
             [\"2xx\", \"3xx\", \"400\", \"401\", \"403\", \"404\", \"409\", \"410\", \"413\"]\n"
        );
    }
    let path = dir.join(format!("{}.toml", run.name.replace(' ', "-")));
    std::fs::write(&path, toml).expect("write the schemathesis config");
    path
}

fn setting(var: &str, default: &str) -> String {
    std::env::var(var).unwrap_or_else(|_| default.to_string())
}

/// Runs schemathesis against the server, prints its summary, and asserts that it found nothing.
fn fuzz(st: &Path, server: &Server, dir: &Path, run: &Run) {
    let work = dir.join("work");
    std::fs::create_dir_all(&work).expect("a working directory");
    let started = Instant::now();
    let mut command = Command::new(st);
    command
        .arg("--config-file")
        .arg(config(dir, run))
        .args(["run", &format!("{}/openapi.json", server.url)])
        .arg("--tls-verify")
        .arg(&server.ca)
        .args(["--header", &format!("Authorization: Bearer {}", run.token)])
        .args(["--checks", "all"])
        .args([
            "--max-examples",
            &setting("HORA_FUZZ_EXAMPLES", MAX_EXAMPLES),
        ])
        .args(["--request-timeout", "10"])
        // One worker: CPython 3.11's parser is not thread-safe where Hypothesis describes its
        // filters, and one worker is fast enough.
        .args(["--workers", "1"])
        .args(["--seed", &setting("HORA_FUZZ_SEED", SEED)])
        .args(["--generation-database", "none"])
        .arg("--no-color")
        // Whatever it writes goes to the temporary directory, not the checkout.
        .current_dir(&work);
    if let Some(path) = run.only_path {
        command.args(["--include-path-regex", path]);
    }
    let output = command.output().expect("run schemathesis");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    let summary = stdout.find("=== SUMMARY ===").map_or(&stdout[..], |at| {
        &stdout[stdout[..at].rfind('\n').unwrap_or(0)..]
    });
    println!(
        "schemathesis, {} run ({:.0?}):{summary}",
        run.name,
        started.elapsed()
    );
    assert!(
        output.status.success(),
        "schemathesis found failures in the {} run ({}):\n{stdout}\n{stderr}",
        run.name,
        output.status
    );
}

#[test]
fn the_server_keeps_its_openapi_document_under_a_fuzzer() {
    let Some(st) = schemathesis() else { return };
    let dir = tempfile::tempdir().expect("a temporary directory");
    let server = Server::start(&dir.path().join("data"));
    let fixtures = prepare(&server);
    let runs = [
        // The client API on a live task, as an enrolled client; the admin API refuses it (403).
        Run {
            name: "client",
            token: &fixtures.client_token,
            pinned: vec![("path.task", json!("fuzz")), ("query.wait_ms", json!(0))],
            only_path: None,
        },
        // A sync-job worker at its job's rendezvous.
        Run {
            name: "sync job",
            token: &fixtures.job_token,
            pinned: vec![("path.job", json!("fuzzjob"))],
            only_path: Some("^/v1/sync/"),
        },
        // The admin API over random ids (and every client route refusing the admin token).
        Run {
            name: "admin",
            token: ADMIN_TOKEN,
            pinned: vec![],
            only_path: None,
        },
        // The admin API on the live task and client (last: it may stop the one, revoke the
        // other).
        Run {
            name: "admin on task fuzz",
            token: ADMIN_TOKEN,
            pinned: vec![
                ("path.task", json!("fuzz")),
                ("path.client", json!(fixtures.client_id)),
            ],
            only_path: Some("^/admin/"),
        },
    ];
    for run in &runs {
        fuzz(&st, &server, dir.path(), run);
    }
}
