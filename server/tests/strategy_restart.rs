//! Stateful strategies survive a crash: FedAdam and FedYogi tasks run two rounds on the real
//! server binary, the server is SIGKILLed between rounds and restarted on the same data
//! directory (with aggressive model pruning, and stale state files planted for the start-up
//! sweep), and two more rounds run. Every published model must equal four rounds of the update
//! rule computed here with uninterrupted optimizer state — and must not equal what an optimizer
//! reset by the restart would give.

mod support;

use hora_common::model::Model;
use reqwest::Method;
use serde_json::{json, Value};
use support::{Client, Server};

/// An adaptive rule, written out independently of the server's code (f64 throughout).
#[derive(Clone, Copy)]
enum Rule {
    Adam,
    Yogi,
}

const ETA: f64 = 0.05;
const BETA_1: f64 = 0.9;
const BETA_2: f64 = 0.99;
const TAU: f64 = 1e-3;

/// The global model after each round, from `initial` and each round's pseudo-gradient; with
/// `reset_after`, the optimizer state starts over after that many rounds.
fn reference(
    rule: Rule,
    initial: &Model,
    deltas: &[Vec<f64>],
    reset_after: Option<usize>,
) -> Vec<Vec<f64>> {
    let n = initial.numel();
    let mut x: Vec<f64> = initial.data().iter().map(|&v| f64::from(v)).collect();
    let (mut m, mut v) = (vec![0.0; n], vec![TAU * TAU; n]);
    let mut out = Vec::new();
    for (round, delta) in deltas.iter().enumerate() {
        if reset_after == Some(round) {
            (m, v) = (vec![0.0; n], vec![TAU * TAU; n]);
        }
        for i in 0..n {
            let d = delta[i];
            m[i] = BETA_1 * m[i] + (1.0 - BETA_1) * d;
            v[i] = match rule {
                Rule::Adam => BETA_2 * v[i] + (1.0 - BETA_2) * d * d,
                Rule::Yogi => {
                    let s = if v[i] > d * d {
                        1.0
                    } else if v[i] < d * d {
                        -1.0
                    } else {
                        0.0
                    };
                    v[i] - (1.0 - BETA_2) * d * d * s
                }
            };
            x[i] += ETA * m[i] / (v[i].sqrt() + TAU);
        }
        out.push(x.clone());
    }
    out
}

fn initial_model() -> Model {
    Model::from_tensors([
        (
            "fc1.weight",
            vec![8, 6],
            (0..48).map(|i| (i as f32 * 0.37).sin() * 0.2).collect(),
        ),
        ("fc1.bias", vec![8], vec![0.0; 8]),
        (
            "fc2.weight",
            vec![3, 8],
            (0..24).map(|i| (i as f32 * 0.11).cos() * 0.2).collect(),
        ),
    ])
    .expect("model")
}

/// Client `client`'s delta for `round` of `task`: deterministic, of a size that varies by round.
fn delta(like: &Model, task: u64, round: u64, client: u64) -> Model {
    let scale = [0.05f32, 0.002, 0.03, 0.01][(round as usize - 1) % 4];
    let mut state = (task * 1000 + round * 10 + client).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut m = Model::zeros(&like.spec());
    for v in m.data_mut() {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        *v = ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0 * scale;
    }
    m
}

fn examples(round: u64, client: u64) -> u64 {
    5 + 17 * client + 3 * round
}

/// Every client uploads its delta to the open round of each task, in order; returns each
/// task's pseudo-gradient Δ = Σ nᵢ·δᵢ / Σ nᵢ, computed here.
async fn run_round(
    clients: &[Client],
    tasks: &[(&str, u64)],
    round: u64,
    like: &Model,
) -> Vec<Vec<f64>> {
    let mut out = Vec::new();
    for &(task, seed) in tasks {
        let mut sum = vec![0.0f64; like.numel()];
        let mut total = 0.0;
        for (c, client) in clients.iter().enumerate() {
            let offer = client.join(task).await;
            assert_eq!(offer.round, round, "{task}");
            let d = delta(like, seed, round, c as u64);
            let n = examples(round, c as u64);
            client.upload(task, &offer, n, &d).await;
            for (s, v) in sum.iter_mut().zip(d.data()) {
                *s += n as f64 * f64::from(*v);
            }
            total += n as f64;
        }
        out.push(sum.into_iter().map(|s| s / total).collect());
    }
    out
}

/// The largest error of `got` against `want`, relative to |want| (at least 1e-2).
fn error(got: &Model, want: &[f64]) -> f64 {
    got.data()
        .iter()
        .zip(want)
        .map(|(g, w)| (f64::from(*g) - w).abs() / w.abs().max(1e-2))
        .fold(0.0, f64::max)
}

fn state_files(data: &std::path::Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(data.join("blobs/strategy"))
        .expect("the state directory")
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    names
}

#[tokio::test(flavor = "multi_thread")]
async fn fed_adam_and_fed_yogi_keep_their_state_across_a_sigkill() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let server = Server::start(&data);
    let admin = server.admin();
    let initial = initial_model();
    let digest = admin.upload_model(&initial).await;
    let create = |id: &str, strategy: Value| {
        json!({
            "id": id,
            "initial_model": digest,
            "model": {"kind": "builtin", "name": "mlp"},
            "strategy": strategy,
            "rounds": 4, "min_clients": 3, "target_clients": 3, "round_deadline_secs": 600,
        })
    };

    // Bad parameters are refused at creation, naming the field.
    let resp = server
        .http()
        .post(format!("{}/admin/v1/tasks", server.url))
        .bearer_auth(support::ADMIN_TOKEN)
        .json(&create("bad", json!({"name": "fed_adam", "tau": 0.0})))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    let body: Value = resp.json().await.unwrap();
    assert!(
        body["message"].as_str().unwrap().contains("strategy.tau"),
        "{body}"
    );

    // η given, the rest by default: the defaults are the constants above.
    for (id, name) in [("adam", "fed_adam"), ("yogi", "fed_yogi")] {
        admin
            .call(
                Method::POST,
                "/admin/v1/tasks",
                Some(create(id, json!({"name": name, "eta": ETA}))),
            )
            .await;
        let info = admin.task(id).await;
        assert_eq!(
            serde_json::to_value(&info.config.strategy).unwrap(),
            json!({"name": name, "eta": ETA, "beta_1": BETA_1, "beta_2": BETA_2, "tau": TAU})
        );
    }
    let tasks = [("adam", 1), ("yogi", 2)];
    let mut clients = Vec::new();
    for _ in 0..3 {
        clients.push(admin.enrol().await);
    }

    let mut deltas: Vec<Vec<Vec<f64>>> = vec![Vec::new(); tasks.len()];
    let mut published: Vec<Vec<Model>> = vec![Vec::new(); tasks.len()];
    for round in 1..=2 {
        for (t, d) in run_round(&clients, &tasks, round, &initial)
            .await
            .into_iter()
            .enumerate()
        {
            deltas[t].push(d);
            admin.wait_published(tasks[t].0, round).await;
            published[t].push(admin.round_model(tasks[t].0, round).await);
        }
    }
    assert_eq!(state_files(&data).len(), 2, "one state file per task");

    // SIGKILL between rounds; leftovers of a crash for the sweep: a stale state file and a torn
    // temporary one.
    server.kill();
    let stale = format!("{}.state", "ab".repeat(32));
    std::fs::write(data.join("blobs/strategy").join(&stale), b"stale").unwrap();
    std::fs::write(data.join("blobs/strategy/.tmp-state-1-2"), b"torn").unwrap();
    let server = Server::start_with(
        &data,
        &["--retain-rounds-last", "1", "--retain-rounds-every", "0"],
    );
    let admin = server.admin();
    let current = state_files(&data);
    assert_eq!(
        current.len(),
        2,
        "the sweep keeps exactly the current states: {current:?}"
    );
    assert!(!current.contains(&stale));
    for c in &mut clients {
        c.api.url = server.url.clone();
    }

    for round in 3..=4 {
        for (t, d) in run_round(&clients, &tasks, round, &initial)
            .await
            .into_iter()
            .enumerate()
        {
            deltas[t].push(d);
            admin.wait_published(tasks[t].0, round).await;
            // Fetched at once: the retention policy prunes it when the next round publishes.
            published[t].push(admin.round_model(tasks[t].0, round).await);
        }
    }

    for (t, rule) in [Rule::Adam, Rule::Yogi].into_iter().enumerate() {
        let uninterrupted = reference(rule, &initial, &deltas[t], None);
        let reset = reference(rule, &initial, &deltas[t], Some(2));
        for round in 0..4 {
            let e = error(&published[t][round], &uninterrupted[round]);
            assert!(
                e <= 1e-5,
                "{}: round {}: relative error {e:e} against uninterrupted state",
                tasks[t].0,
                round + 1
            );
        }
        // A reset optimizer would have published something else: this test can fail.
        for round in 2..4 {
            let e = error(&published[t][round], &reset[round]);
            assert!(
                e > 1e-3,
                "{}: round {}: the published model is also what a reset optimizer gives ({e:e})",
                tasks[t].0,
                round + 1
            );
        }
    }
    // Pruning removed old round models, never the state; each task still has exactly one,
    // and the states read at the restart were replaced.
    assert_eq!(state_files(&data).len(), 2);
    assert!(state_files(&data).iter().all(|n| !current.contains(n)));
}
