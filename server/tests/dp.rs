//! Central differential privacy through the real server: a task with a small ε budget publishes
//! rounds whose history reports the ε the accountant computes, keeps counting across a restart,
//! finishes before the round that would exceed its budget (saying why), and publishes models
//! that differ from the noiseless mean by noise of the configured scale; an adaptive clip norm
//! follows the updates' norms. Deltas are sealed here with hora-common (no libtorch).

mod support;

use hora_common::envelope::{self, Binding};
use hora_common::model::{Model, ModelDigest};
use hora_common::wire::{Credentials, JoinResponse, RoundRecord, TaskInfo, TaskState};
use hora_server::dp::accountant::RdpAccountant;
use reqwest::StatusCode;
use serde_json::{json, Value};
use support::{Server, ADMIN_TOKEN};

const TASK: &str = "dp-task";
const PARAMS: usize = 20_000;
const CLIENTS: usize = 10;
const TARGET: usize = 2;
const SIGMA: f64 = 1.0;
const CLIP: f64 = 1.0;
const DELTA: f64 = 1e-5;

/// HTTPS to one server, as admin or as a client.
struct Http {
    http: reqwest::Client,
    url: String,
}

impl Http {
    fn new(server: &Server) -> Http {
        Http {
            http: server.http(),
            url: server.url.clone(),
        }
    }

    async fn send(&self, req: reqwest::RequestBuilder) -> (StatusCode, Body) {
        let resp = req.send().await.expect("an answer");
        let status = resp.status();
        (status, Body(resp.bytes().await.expect("a body").to_vec()))
    }

    async fn admin_get(&self, path: &str) -> (StatusCode, Body) {
        self.send(
            self.http
                .get(format!("{}{path}", self.url))
                .bearer_auth(ADMIN_TOKEN),
        )
        .await
    }

    async fn admin_post(&self, path: &str, body: Value) -> (StatusCode, Body) {
        self.send(
            self.http
                .post(format!("{}{path}", self.url))
                .bearer_auth(ADMIN_TOKEN)
                .json(&body),
        )
        .await
    }
}

/// An answer's body.
struct Body(Vec<u8>);

impl Body {
    fn json<T: serde::de::DeserializeOwned>(&self) -> T {
        serde_json::from_slice(&self.0).unwrap_or_else(|e| panic!("{e}: {}", self.text()))
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0).into_owned()
    }
}

/// A delta of L2 norm `norm` with a pattern of its own.
fn delta(seed: u64, norm: f64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut v: Vec<f64> = (0..PARAMS)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 11) as f64 / (1u64 << 53) as f64 - 0.5
        })
        .collect();
    let n = v.iter().map(|x| x * x).sum::<f64>().sqrt();
    v.iter_mut().for_each(|x| *x *= norm / n);
    v.into_iter().map(|x| x as f32).collect()
}

fn model(values: Vec<f32>) -> Model {
    Model::from_tensors([("w", vec![PARAMS], values)]).expect("a model")
}

fn l2(values: &[f32]) -> f64 {
    values
        .iter()
        .map(|v| f64::from(*v) * f64::from(*v))
        .sum::<f64>()
        .sqrt()
}

/// Uploads the initial model (every parameter 0.25) and returns its digest.
async fn upload_initial(http: &Http) -> ModelDigest {
    let initial = model(vec![0.25; PARAMS]);
    let (status, uploaded) = http
        .send(
            http.http
                .post(format!("{}/admin/v1/models", http.url))
                .bearer_auth(ADMIN_TOKEN)
                .body(initial.to_safetensors()),
        )
        .await;
    assert!(status.is_success(), "{}", uploaded.text());
    serde_json::from_value(uploaded.json::<Value>()["digest"].clone()).expect("a digest")
}

async fn enrol(http: &Http) -> String {
    let (status, token) = http.admin_post("/admin/v1/enrolments", json!({})).await;
    assert!(status.is_success(), "{}", token.text());
    let token: Value = token.json();
    let (status, creds) = http
        .send(
            http.http
                .post(format!("{}/v1/enrol", http.url))
                .bearer_auth(token["token"].as_str().unwrap())
                .json(&json!({})),
        )
        .await;
    assert!(status.is_success(), "{}", creds.text());
    let creds: Credentials = creds.json();
    format!("{}.{}", creds.client_id, creds.secret)
}

/// Joins the open round as `client` and uploads `delta`; returns the round number.
async fn contribute(http: &Http, task: &str, client: &str, delta: &[f32]) -> u64 {
    let (status, join) = http
        .send(
            http.http
                .post(format!("{}/v1/tasks/{task}/join", http.url))
                .bearer_auth(client),
        )
        .await;
    assert!(status.is_success(), "{}", join.text());
    let offer = join.json::<JoinResponse>().offer.expect("selected");
    let id = client.split('.').next().unwrap();
    let binding = Binding {
        task,
        round: offer.round,
        client: id,
        base_model: &offer.model,
    };
    let sealed = envelope::seal(
        &model(delta.to_vec()).to_safetensors(),
        &offer.round_key,
        &binding,
    )
    .expect("seal");
    let (status, receipt) = http
        .send(
            http.http
                .post(format!(
                    "{}/v1/tasks/{task}/rounds/{}/update",
                    http.url, offer.round
                ))
                .bearer_auth(client)
                // Example counts do not weigh under DP: every update counts once.
                .header("x-hora-update", r#"{"num_examples":1000}"#)
                .body(sealed),
        )
        .await;
    assert!(status.is_success(), "{}", receipt.text());
    offer.round
}

async fn round_model(http: &Http, task: &str, round: u64) -> Vec<f32> {
    let (status, body) = http
        .admin_get(&format!("/admin/v1/tasks/{task}/rounds/{round}/model"))
        .await;
    assert_eq!(status, StatusCode::OK, "{}", body.text());
    Model::from_safetensors(&body.0, &Default::default())
        .expect("a model")
        .data()
        .to_vec()
}

async fn history(http: &Http, task: &str) -> Vec<RoundRecord> {
    let (status, body) = http
        .admin_get(&format!("/admin/v1/tasks/{task}/rounds"))
        .await;
    assert_eq!(status, StatusCode::OK, "{}", body.text());
    body.json()
}

async fn published_rounds(http: &Http, task: &str) -> u64 {
    let (_, info) = http.admin_get(&format!("/admin/v1/tasks/{task}")).await;
    info.json::<TaskInfo>().published_rounds
}

/// Waits until `round` is published (the close runs just after the last upload is durable).
async fn wait_published(http: &Http, task: &str, round: u64) {
    for _ in 0..500 {
        if published_rounds(http, task).await >= round {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    panic!("round {round} was not published");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_dp_task_reports_epsilon_and_stops_at_its_budget() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let mut server = Server::start(&data);
    let mut http = Http::new(&server);

    // q = 2 selected of 10 eligible clients per round; the budget sits between the ε after 4
    // rounds and after 5, so the task must publish 4 rounds and finish.
    let q = TARGET as f64 / CLIENTS as f64;
    let mut expected = Vec::new();
    let mut accountant = RdpAccountant::default();
    for _ in 0..6 {
        accountant.compose(q, SIGMA, 1);
        expected.push(accountant.epsilon(DELTA).epsilon);
    }
    let budget = (expected[3] + expected[4]) / 2.0;

    let digest = upload_initial(&http).await;
    let task = |dp: Value, secagg: Option<Value>| {
        let mut t = json!({
            "id": TASK, "initial_model": digest, "model": {"kind": "builtin", "name": "mlp"},
            "rounds": 50, "min_clients": TARGET, "target_clients": TARGET,
            "round_deadline_secs": 600, "differential_privacy": dp,
        });
        if let Some(s) = secagg {
            t["secure_aggregation"] = s;
        }
        t
    };
    let dp = json!({
        "noise_multiplier": SIGMA, "clip": {"mode": "fixed", "norm": CLIP},
        "delta": DELTA, "epsilon_budget": budget,
    });

    // The OpenAPI document describes the option and its constraints.
    let (_, doc) = http.admin_get("/openapi.json").await;
    let doc: Value = doc.json();
    let schemas = &doc["components"]["schemas"];
    assert!(schemas["CreateTask"]["properties"]["differential_privacy"].is_object());
    assert_eq!(
        schemas["DpConfig"]["properties"]["noise_multiplier"]["minimum"],
        0.01
    );
    assert!(schemas["DpClip"].is_object() && schemas["PrivacySpent"].is_object());

    // Refused at creation, with reasons.
    let (status, body) = http
        .admin_post("/admin/v1/tasks", task(dp.clone(), Some(json!({}))))
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(
        body.text().contains("central DP needs the plain path"),
        "{}",
        body.text()
    );
    let mut bad = dp.clone();
    bad["noise_multiplier"] = json!(0.0);
    let (status, body) = http.admin_post("/admin/v1/tasks", task(bad, None)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(body.text().contains("noise_multiplier"), "{}", body.text());

    let (status, body) = http.admin_post("/admin/v1/tasks", task(dp, None)).await;
    assert!(status.is_success(), "{}", body.text());
    let mut clients = Vec::new();
    for _ in 0..CLIENTS {
        clients.push(enrol(&http).await);
    }

    let mut global = vec![0.25f32; PARAMS];
    let mut residuals = Vec::new();
    for round in 1..=4u64 {
        if round == 3 {
            // A restart in the middle: the accountant's totals continue from the task record.
            drop(server);
            server = Server::start(&data);
            http = Http::new(&server);
        }
        // One update inside the clip norm, one far outside it (clipped to C).
        let (small, large) = (delta(round * 2, 0.5), delta(round * 2 + 1, 3.0));
        let pair = [
            &clients[(2 * round as usize) % CLIENTS],
            &clients[(2 * round as usize + 1) % CLIENTS],
        ];
        assert_eq!(contribute(&http, TASK, pair[0], &small).await, round);
        assert_eq!(contribute(&http, TASK, pair[1], &large).await, round);
        wait_published(&http, TASK, round).await;

        let published = round_model(&http, TASK, round).await;
        let scale = (CLIP / l2(&large)).min(1.0);
        // published = global + (small + scale·large + noise) / target_clients
        for i in 0..PARAMS {
            let clean = f64::from(small[i]) + scale * f64::from(large[i]);
            let moved = (f64::from(published[i]) - f64::from(global[i])) * TARGET as f64;
            residuals.push(moved - clean);
        }
        global = published;

        let h = history(&http, TASK).await;
        let last = h.last().expect("a round record");
        let spent = last.privacy.as_ref().expect("privacy in the round record");
        assert_eq!(last.round, round);
        assert_eq!(spent.rounds, round);
        assert_eq!(spent.sampling_rate, q);
        assert_eq!(
            (spent.clip, spent.noise_stddev, spent.delta),
            (CLIP, SIGMA * CLIP, DELTA)
        );
        let want = expected[round as usize - 1];
        assert!(
            (spent.epsilon - want).abs() <= 1e-9 * want,
            "round {round}: ε {} vs {want}",
            spent.epsilon
        );
    }

    // ε grew round by round.
    let epsilons: Vec<f64> = history(&http, TASK)
        .await
        .iter()
        .filter_map(|r| r.privacy.as_ref().map(|p| p.epsilon))
        .collect();
    assert_eq!(epsilons.len(), 4);
    assert!(epsilons.windows(2).all(|w| w[0] < w[1]), "{epsilons:?}");

    // The fifth round would exceed the budget: the task finished after the fourth, saying why.
    let (_, info) = http.admin_get(&format!("/admin/v1/tasks/{TASK}")).await;
    let info: TaskInfo = info.json();
    assert_eq!(info.state, TaskState::Finished);
    assert_eq!(info.published_rounds, 4);
    let reason = info.ended_reason.expect("why the task ended");
    assert!(
        reason.contains("privacy budget") && reason.contains("round 5"),
        "{reason}"
    );
    let (status, body) = http
        .send(
            http.http
                .post(format!("{}/v1/tasks/{TASK}/join", http.url))
                .bearer_auth(&clients[0]),
        )
        .await;
    assert_eq!(status, StatusCode::CONFLICT, "{}", body.text());

    // /metrics shows the same ε.
    let (_, metrics) = http.admin_get("/metrics").await;
    let line = metrics
        .text()
        .lines()
        .find(|l| l.starts_with(&format!("hora_dp_epsilon{{task=\"{TASK}\"}}")))
        .map(str::to_string)
        .expect("hora_dp_epsilon for the task");
    let shown: f64 = line.rsplit(' ').next().unwrap().parse().unwrap();
    assert!((shown - expected[3]).abs() <= 1e-9 * expected[3], "{line}");

    // The published models moved by the clipped mean plus noise of standard deviation σ·C on
    // the sum: over n = 4 × 20000 coordinates the residual's mean is within 5·s/√n of 0 and its
    // standard deviation within 5/√(2n) (relative) of s = σ·C (f32 rounding of the models adds
    // ~1e-7, far below either bound).
    let n = residuals.len() as f64;
    let s = SIGMA * CLIP;
    let mean = residuals.iter().sum::<f64>() / n;
    let std = (residuals
        .iter()
        .map(|r| (r - mean) * (r - mean))
        .sum::<f64>()
        / (n - 1.0))
        .sqrt();
    assert!(mean.abs() <= 5.0 * s / n.sqrt(), "mean {mean}");
    assert!(
        (std / s - 1.0).abs() <= 5.0 / (2.0 * n).sqrt(),
        "std {std} vs {s}"
    );
}

/// Adaptive clipping through the server: with every update well inside the clip norm, the norm
/// shrinks round by round by the geometric rule, the sum's noise follows it with the multiplier
/// the count query leaves, and the rounds are accounted at the total multiplier.
#[tokio::test(flavor = "multi_thread")]
async fn adaptive_clipping_shrinks_the_norm_when_updates_come_in_under_it() {
    const ADAPTIVE: &str = "dp-adaptive";
    const PER_ROUND: usize = 20;
    const ELIGIBLE: usize = 40;
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("data"));
    let http = Http::new(&server);
    let digest = upload_initial(&http).await;
    let (z, count_noise, initial_norm): (f64, f64, f64) = (1.0, 2.0, 10.0);
    let (status, body) = http
        .admin_post(
            "/admin/v1/tasks",
            json!({
                "id": ADAPTIVE, "initial_model": digest, "model": {"kind": "builtin", "name": "mlp"},
                "rounds": 3, "min_clients": PER_ROUND, "target_clients": PER_ROUND,
                "round_deadline_secs": 600,
                "differential_privacy": {
                    "noise_multiplier": z,
                    "clip": {"mode": "adaptive", "initial_norm": initial_norm,
                             "target_quantile": 0.5, "learning_rate": 0.2, "count_noise": count_noise},
                },
            }),
        )
        .await;
    assert!(status.is_success(), "{}", body.text());
    let mut clients = Vec::new();
    for _ in 0..ELIGIBLE {
        clients.push(enrol(&http).await);
    }
    for round in 1..=3u64 {
        for (i, client) in clients.iter().take(PER_ROUND).enumerate() {
            contribute(
                &http,
                ADAPTIVE,
                client,
                &delta(round * 100 + i as u64, 0.01),
            )
            .await;
        }
        wait_published(&http, ADAPTIVE, round).await;
    }
    let spent: Vec<_> = history(&http, ADAPTIVE)
        .await
        .iter()
        .map(|r| r.privacy.clone().expect("privacy"))
        .collect();
    assert_eq!(spent.len(), 3);
    assert_eq!(spent[0].clip, initial_norm);
    // All 20 unclipped: b̃ = (20 − 10 + N(0, 2²))/20 + ½ = 1 + N(0, 0.1²), at most 1, and
    // below ½ only 5 standard deviations out. So C shrinks each round, by at most e^{−0.1}.
    for w in spent.windows(2) {
        let ratio = w[1].clip / w[0].clip;
        assert!(((-0.1f64).exp() - 1e-12..1.0).contains(&ratio), "{ratio}");
    }
    // The sum's noise has the multiplier the count leaves: (z⁻² − (2σ_b)⁻²)^{−1/2}.
    let z_sum = (z.powi(-2) - (2.0 * count_noise).powi(-2)).powf(-0.5);
    for p in &spent {
        assert!(
            (p.noise_stddev - z_sum * p.clip).abs() <= 1e-12 * p.noise_stddev,
            "{p:?}"
        );
    }
    // Accounted at the total multiplier z, with q = 20 of 40.
    let mut accountant = RdpAccountant::default();
    accountant.compose(PER_ROUND as f64 / ELIGIBLE as f64, z, 3);
    let want = accountant.epsilon(DELTA).epsilon;
    assert!(
        (spent[2].epsilon - want).abs() <= 1e-9 * want,
        "{}",
        spent[2].epsilon
    );
}
