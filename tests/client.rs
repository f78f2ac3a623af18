//! The client against the real server (loopback, real TLS, real sled): it survives a server
//! restart in the middle of a round, retries while the server is down, resumes an update it
//! trained before it was restarted, and stops with a clear message when the server refuses it.

mod support;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hora_client::data::synthetic::{self, SyntheticConfig};
use hora_client::network::{Architecture, Network};
use hora_client::state::RoundState;
use hora_client::{
    Client, ClientConfig, ClientError, RoundOutcome, SupervisedTrainer, TrainOutcome, TrainRequest,
    Trainer,
};
use hora_common::model::Model;
use hora_common::wire::{self, ErrorCode, Metrics, RoundRecord, TaskInfo, TaskState, UpdateMeta};
use reqwest::Method;
use support::*;

const IID: &str = "synthetic-iid:clients=2,seed=5";

fn arch() -> Architecture {
    Architecture::Logreg {
        inputs: 60,
        classes: 10,
    }
}

/// A task training logistic regression on Synthetic-IID.
async fn create_task(admin: &Api, id: &str, rounds: u64, min: u32, target: u32) -> Model {
    let (initial, digest) = upload_initial(admin).await;
    admin
        .create_task(&logreg_task(id, digest, rounds, min, target))
        .await;
    initial
}

/// Fresh logistic-regression weights, uploaded.
async fn upload_initial(admin: &Api) -> (Model, hora_common::model::ModelDigest) {
    let initial = Network::builtin(&arch(), tch::Device::Cpu)
        .unwrap()
        .weights()
        .unwrap();
    let digest = admin.upload_model(&initial).await;
    (initial, digest)
}

fn logreg_task(
    id: &str,
    digest: hora_common::model::ModelDigest,
    rounds: u64,
    min: u32,
    target: u32,
) -> hora_common::wire::CreateTask {
    let mut t = task(id, digest, rounds, min, target, 120);
    t.model = arch().to_kind();
    t
}

/// `hora-client train` against `url`, on shard `k` of the Synthetic-IID data.
fn client_command(url: &str, ca: &Path, state: &Path, task: &str, k: usize) -> Command {
    data_client_command(url, ca, state, task, IID, k)
}

/// `hora-client train` against `url`, on shard `k` of `data`.
fn data_client_command(
    url: &str,
    ca: &Path,
    state: &Path,
    task: &str,
    data: &str,
    k: usize,
) -> Command {
    let mut cmd = Command::new(binary("hora-client"));
    cmd.args(["train", "--server", url, "--task", task, "--data", data])
        .args([
            "--client-index",
            &k.to_string(),
            "--threads",
            "1",
            "--no-progress",
        ])
        .arg("--ca")
        .arg(ca)
        .arg("--state-dir")
        .arg(state)
        .env("HORA_LOG", "warn");
    cmd
}

fn spawn(mut cmd: Command) -> Child {
    cmd.stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start hora-client")
}

fn finish(child: Child) -> Output {
    let out = child.wait_with_output().expect("hora-client output");
    assert!(
        out.status.success(),
        "hora-client failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

async fn task_info(admin: &Api, id: &str) -> TaskInfo {
    admin
        .ok(admin.request(Method::GET, &format!("/admin/v1/tasks/{id}")))
        .await
}

async fn wait_for(what: &str, timeout: Duration, mut f: impl AsyncFnMut() -> bool) {
    let start = Instant::now();
    while !f().await {
        assert!(start.elapsed() < timeout, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_survives_a_server_restart_mid_round() {
    let dir = tempfile::tempdir().unwrap();
    let listen = format!("127.0.0.1:{}", free_port());
    let server = Server::start_on(&dir.path().join("server"), &listen, &[]);
    let (url, ca) = (server.url.clone(), server.ca.clone());
    let admin = server.api(ADMIN_TOKEN);
    create_task(&admin, "t", 3, 2, 2).await;
    let (token_a, token_b) = (admin.enrolment_token().await, admin.enrolment_token().await);

    let mut a = client_command(&url, &ca, &dir.path().join("a"), "t", 0);
    a.args(["--token", &token_a]);
    let mut a = spawn(a);
    // A prints its round line once the server acknowledged the update, i.e. once it is durable;
    // the round then waits for a second client.
    let (lines, a_lines) = std::sync::mpsc::channel();
    let a_stdout = BufReader::new(a.stdout.take().unwrap());
    let reader = std::thread::spawn(move || {
        for line in a_stdout.lines().map_while(Result::ok) {
            let _ = lines.send(line);
        }
    });
    let first = a_lines
        .recv_timeout(Duration::from_secs(120))
        .expect("A's first round line");
    assert!(first.contains("t round 1 ·"), "{first}");
    assert_eq!(
        task_info(&admin, "t").await.open_round.map(|r| r.round),
        Some(1)
    );
    server.kill();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let server = Server::start_on(&dir.path().join("server"), &listen, &[]);
    let admin = server.api(ADMIN_TOKEN);

    let mut b = client_command(&url, &ca, &dir.path().join("b"), "t", 1);
    b.args(["--token", &token_b]);
    let b = spawn(b);
    finish(a);
    let out_b = finish(b);
    reader.join().unwrap();
    let a_stdout = std::iter::once(first)
        .chain(a_lines.try_iter())
        .collect::<Vec<_>>()
        .join("\n");
    let info = task_info(&admin, "t").await;
    assert_eq!(
        (info.state, info.published_rounds),
        (TaskState::Finished, 3)
    );
    let history: Vec<RoundRecord> = admin
        .ok(admin.request(Method::GET, "/admin/v1/tasks/t/rounds"))
        .await;
    assert!(history.iter().all(|r| r.participants.len() == 2));
    for stdout in [a_stdout, String::from_utf8_lossy(&out_b.stdout).to_string()] {
        for round in 1..=3 {
            assert_eq!(
                stdout.matches(&format!("t round {round} ·")).count(),
                1,
                "round {round} once:\n{stdout}"
            );
        }
        assert!(stdout.contains("the task is Finished"), "{stdout}");
    }
}

/// Clients in the federations below: `min_clients` = `target_clients` = all of them.
const FLEET: usize = 10;
const FLEET_DATA: &str = "synthetic-iid:clients=10,seed=5";

/// A federation of [`FLEET`] `hora-client` processes, seeded so that every run trains the same
/// updates from the same `initial` model, for `rounds` rounds. With `kills`, the server is
/// SIGKILLed that many times at random moments 0.05–1.5 s apart from the moment the clients
/// start (while they join, train and upload), each time restarted on the same port and data
/// directory. Returns the round history and the last round's model.
async fn federation(initial: &Model, rounds: u64, kills: usize) -> (Vec<RoundRecord>, Model) {
    use rand::{Rng, SeedableRng};
    // Printed, so that a failing schedule can be replayed (HORA_KILL_SEED).
    let seed = std::env::var("HORA_KILL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random::<u64>);
    let mut schedule = rand::rngs::StdRng::seed_from_u64(seed);
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("server");
    let listen = format!("127.0.0.1:{}", free_port());
    let mut server = Server::start_on(&data, &listen, &[]);
    let (url, ca) = (server.url.clone(), server.ca.clone());
    let admin = server.api(ADMIN_TOKEN);
    let digest = admin.upload_model(initial).await;
    let mut config = logreg_task("t", digest, rounds, FLEET as u32, FLEET as u32);
    config.round_deadline_secs = 30;
    admin.create_task(&config).await;
    let mut clients = Vec::new();
    for k in 0..FLEET {
        let state = dir.path().join(format!("client-{k}"));
        let mut cmd = data_client_command(&url, &ca, &state, "t", FLEET_DATA, k);
        // Local training of 0.5 to 1.4 s: rounds last long enough for the kills to fall while
        // they are open, and the uploads of a round arrive spread out.
        let train_secs = format!("{:.1}", 0.5 + 0.1 * k as f64);
        cmd.args([
            "--token",
            &admin.enrolment_token().await,
            "--seed",
            &k.to_string(),
        ])
        .args(["--min-train-secs", &train_secs]);
        clients.push(spawn(cmd));
    }
    for kill in 0..kills {
        let pause = schedule.random_range(50..=1500);
        tokio::time::sleep(Duration::from_millis(pause)).await;
        // Where the federation stood a moment before (the server may be starting still).
        let open = admin
            .request(Method::GET, "/admin/v1/tasks/t")
            .send()
            .await
            .ok()
            .filter(|r| r.status().is_success());
        let stood = match open {
            Some(r) => match r.json::<TaskInfo>().await.ok().and_then(|i| i.open_round) {
                Some(o) => format!(
                    "round {} attempt {}, {} accepted",
                    o.round, o.attempt, o.accepted
                ),
                None => "no round open".into(),
            },
            None => "not answering yet".into(),
        };
        server.kill();
        server = Server::start_on(&data, &listen, &[]);
        eprintln!(
            "kill {} of schedule {seed} after {pause} ms ({stood})",
            kill + 1
        );
    }
    let admin = server.api(ADMIN_TOKEN);
    wait_for(
        "the federation to finish",
        Duration::from_secs(600),
        async || {
            // A client that failed would stall the federation (every round needs the whole
            // fleet): say why at once rather than at the timeout.
            if let Some(k) = clients
                .iter_mut()
                .position(|c| c.try_wait().ok().flatten().is_some_and(|s| !s.success()))
            {
                finish(clients.swap_remove(k));
            }
            task_info(&admin, "t").await.state == TaskState::Finished
        },
    )
    .await;
    for child in clients {
        finish(child);
    }
    let history: Vec<RoundRecord> = admin
        .ok(admin.request(Method::GET, "/admin/v1/tasks/t/rounds"))
        .await;
    (history, admin.round_model("t", rounds).await)
}

/// Every round published once, each with the whole fleet; abandoned attempts are allowed.
fn assert_every_round_has_the_fleet(history: &[RoundRecord], rounds: u64) {
    for round in 1..=rounds {
        let published: Vec<_> = history
            .iter()
            .filter(|r| r.round == round && r.outcome == wire::RoundOutcome::Published)
            .collect();
        assert_eq!(published.len(), 1, "round {round}: {history:#?}");
        let participants: std::collections::BTreeSet<_> =
            published[0].participants.iter().collect();
        assert_eq!(
            participants.len(),
            FLEET,
            "round {round}: {:?}",
            published[0]
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_federation_whose_server_is_killed_again_and_again_ends_as_if_it_never_was() {
    const ROUNDS: u64 = 6;
    let initial = Network::builtin(&arch(), tch::Device::Cpu)
        .unwrap()
        .weights()
        .unwrap();
    let (calm, want) = federation(&initial, ROUNDS, 0).await;
    assert_every_round_has_the_fleet(&calm, ROUNDS);
    // Twice, with different random kill schedules.
    for run in 1..=2 {
        let (history, got) = federation(&initial, ROUNDS, 15).await;
        assert_every_round_has_the_fleet(&history, ROUNDS);
        let abandoned = history.len() as u64 - ROUNDS;
        let scale = want.data().iter().fold(1f32, |m, v| m.max(v.abs()));
        let worst = got
            .data()
            .iter()
            .zip(want.data())
            .fold(0f32, |m, (g, w)| m.max((g - w).abs()));
        eprintln!(
            "crashed run {run}: {abandoned} abandoned attempts; final model {} (largest difference {worst:e})",
            if got.digest() == want.digest() { "bit-identical to the uncrashed run's" } else { "differs" }
        );
        // Equal up to the order in which the server folded the same updates.
        assert!(worst <= 1e-6 * scale, "largest difference {worst:e}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn an_abandoned_attempts_contributors_all_rejoin_its_retry() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("server"));
    let admin = server.api(ADMIN_TOKEN);
    let (_, digest) = upload_initial(&admin).await;
    let mut config = logreg_task("t", digest, 2, 3, 3);
    config.round_deadline_secs = 15;
    admin.create_task(&config).await;
    let start = |k: usize, token: String| {
        let state = dir.path().join(format!("c{k}"));
        let data = "synthetic-iid:clients=3,seed=5";
        let mut cmd = data_client_command(&server.url, &server.ca, &state, "t", data, k);
        cmd.args(["--token", &token]);
        spawn(cmd)
    };
    // Two of the three upload to attempt 0, which is abandoned at its deadline.
    let early = [
        start(0, admin.enrolment_token().await),
        start(1, admin.enrolment_token().await),
    ];
    wait_for(
        "attempt 0 to be abandoned",
        Duration::from_secs(120),
        async || {
            task_info(&admin, "t")
                .await
                .open_round
                .is_some_and(|r| r.attempt >= 1)
        },
    )
    .await;
    let late = start(2, admin.enrolment_token().await);
    wait_for("the task to finish", Duration::from_secs(300), async || {
        task_info(&admin, "t").await.state == TaskState::Finished
    })
    .await;
    let outputs: Vec<_> = early.into_iter().chain([late]).map(finish).collect();
    let history: Vec<RoundRecord> = admin
        .ok(admin.request(Method::GET, "/admin/v1/tasks/t/rounds"))
        .await;
    let first = &history[0];
    assert_eq!((first.round, first.attempt), (1, 0));
    assert!(
        matches!(first.outcome, wire::RoundOutcome::Abandoned { .. }),
        "{first:?}"
    );
    assert!(!first.participants.is_empty(), "{first:?}");
    let published = history
        .iter()
        .find(|r| r.round == 1 && r.outcome == wire::RoundOutcome::Published)
        .expect("round 1 published");
    for c in &first.participants {
        assert!(
            published.participants.contains(c),
            "{c} is missing from {published:?}"
        );
    }
    assert_eq!(published.participants.len(), 3);
    // The early clients that were in attempt 0 report its retry with the update they trained
    // for it (no second training).
    for out in outputs[..2]
        .iter()
        .filter(|o| String::from_utf8_lossy(&o.stdout).contains("t round 1 ·"))
    {
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            stdout.contains(&format!("t round 1 (attempt {}) ·", published.attempt))
                && stdout.contains("an update trained earlier"),
            "{stdout}"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_retries_while_the_server_is_down() {
    let dir = tempfile::tempdir().unwrap();
    let listen = format!("127.0.0.1:{}", free_port());
    let server = Server::start_on(&dir.path().join("server"), &listen, &[]);
    let (url, ca) = (server.url.clone(), server.ca.clone());
    let admin = server.api(ADMIN_TOKEN);
    create_task(&admin, "t", 1, 1, 1).await;
    let token = admin.enrolment_token().await;
    server.kill();

    // The client starts while nothing listens: its enrolment is refused at the TCP level and
    // retried with backoff until the server is back.
    let mut cmd = client_command(&url, &ca, &dir.path().join("c"), "t", 0);
    cmd.args(["--token", &token]).env("HORA_LOG", "warn");
    let child = spawn(cmd);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let server = Server::start_on(&dir.path().join("server"), &listen, &[]);
    let out = finish(child);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("retrying in"), "{stderr}");
    let info = task_info(&server.api(ADMIN_TOKEN), "t").await;
    assert_eq!(
        (info.state, info.published_rounds),
        (TaskState::Finished, 1)
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_given_several_servers_fails_over_to_one_that_answers() {
    let dir = tempfile::tempdir().unwrap();
    // Replicas on PostgreSQL: one leads, one stands by on a port of its own (without shared
    // blobs it cannot follow, so it serves no client).
    let mut replicas = Replicas::on_one_data_dir(&format!("127.0.0.1:{}", free_port()));
    let server = replicas.spawn().listening();
    let standby_listen = format!("127.0.0.1:{}", free_port());
    let _standby = replicas.spawn_on(&standby_listen);
    let admin = server.api(ADMIN_TOKEN);
    let (_, digest) = upload_initial(&admin).await;
    admin
        .create_task(&wire::CreateTask {
            asynchronous: Some(wire::AsynchronousConfig {
                buffer_size: 1,
                max_staleness: 1,
                concurrency: 1,
                staleness: Default::default(),
            }),
            ..logreg_task("t", digest, 1, 1, 1)
        })
        .await;
    let token = admin.enrolment_token().await;
    // The first URL is a port nothing listens on (a server that died), the second the standby
    // (it answers 503 `standby` once its port is up): the client moves on to the leader.
    let http = hora_server::tls::https_client(&server.ca, None).expect("an HTTPS client");
    let asked = Instant::now();
    let standing_by = || async {
        let answer = http
            .get(format!("https://{standby_listen}/healthz"))
            .send()
            .await
            .ok()?;
        Some(answer.status().is_success())
    };
    while standing_by().await != Some(true) {
        assert!(
            asked.elapsed().as_secs() < 30,
            "the standby does not answer"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let urls = format!(
        "https://127.0.0.1:{},https://{standby_listen},{}",
        free_port(),
        server.url
    );
    let mut cmd = client_command(&urls, &server.ca, &dir.path().join("c"), "t", 0);
    cmd.args(["--token", &token, "--log-format", "json"])
        .env("HORA_LOG", "warn");
    let out = finish(spawn(cmd));
    let stderr = String::from_utf8_lossy(&out.stderr);
    // (Its logs are JSON events, one per line.)
    let warnings: Vec<String> = stderr
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|event| event["level"] == "WARN")
        .filter_map(|event| event["fields"]["message"].as_str().map(str::to_string))
        .collect();
    for moved in [
        "does not answer; trying",
        "stands by (another replica leads); trying",
    ] {
        assert!(
            warnings.iter().any(|w| w.contains(moved)),
            "no `{moved}` warning among {warnings:?}:\n{stderr}"
        );
    }
    let info = task_info(&admin, "t").await;
    assert_eq!(
        (info.state, info.published_rounds),
        (TaskState::Finished, 1)
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn refusals_stop_the_client_with_a_clear_message() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("server"));
    let admin = server.api(ADMIN_TOKEN);
    create_task(&admin, "t", 2, 1, 1).await;
    let run = |state: &str, task: &str, extra: &[&str]| {
        let mut cmd = client_command(&server.url, &server.ca, &dir.path().join(state), task, 0);
        cmd.args(extra).env("HORA_RETRY_FOR", "5");
        cmd.output().expect("run hora-client")
    };
    let expect = |out: &Output, needles: &[&str]| {
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        for n in needles {
            assert!(stderr.contains(n), "`{n}` missing from:\n{stderr}");
        }
    };

    // 401: a made-up enrolment token.
    let out = run("bad-token", "t", &["--token", "not-a-token"]);
    expect(&out, &["refused our credentials", "401", "enrol again"]);
    // 401: credentials of a client the operator revoked.
    let out = run(
        "revoked",
        "t",
        &["--token", &admin.enrolment_token().await, "--rounds", "1"],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let clients: Vec<hora_common::wire::ClientInfo> = admin
        .ok(admin.request(Method::GET, "/admin/v1/clients"))
        .await;
    let id = &clients[0].client_id;
    let _: serde_json::Value = admin
        .ok(admin.request(Method::POST, &format!("/admin/v1/clients/{id}/revoke")))
        .await;
    let out = run("revoked", "t", &[]);
    expect(&out, &["refused our credentials", "enrol again"]);
    // 404: a task that does not exist.
    let out = run(
        "unknown-task",
        "nope",
        &["--token", &admin.enrolment_token().await],
    );
    expect(&out, &["not found", "check the task id"]);
    // No credentials and no token: told what to pass.
    let out = run("empty", "t", &[]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("pass --token"));
}

async fn sdk_client(server: &Server, admin: &Api, state: &Path) -> Client {
    let config = ClientConfig::new(&server.url, &server.ca, state);
    Client::connect(config, Some(&admin.enrolment_token().await))
        .await
        .expect("enrol")
}

#[tokio::test(flavor = "multi_thread")]
async fn conflicts_are_typed_and_a_late_update_is_a_missed_round() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("server"));
    let admin = server.api(ADMIN_TOKEN);
    let (initial, digest) = upload_initial(&admin).await;
    let mut t = logreg_task("t", digest, 3, 2, 2);
    t.over_selection = 1.0; // four selected; the second update closes the round
    admin.create_task(&t).await;
    let early = sdk_client(&server, &admin, &dir.path().join("early")).await;
    let second = sdk_client(&server, &admin, &dir.path().join("second")).await;
    let late = sdk_client(&server, &admin, &dir.path().join("late")).await;
    let late_offer = late.join("t").await.unwrap().offer.expect("selected");
    let offer = early.join("t").await.unwrap().offer.expect("selected");
    let second_offer = second.join("t").await.unwrap().offer.expect("selected");

    // Non-zero, so the published model moves on and the late client cannot even fetch its base.
    let delta = delta(&initial, 3);
    let meta = UpdateMeta {
        num_examples: 10,
        metrics: Metrics::default(),
        contributors: None,
    };
    let receipt = early.upload("t", &offer, &delta, &meta).await.unwrap();
    assert_eq!(receipt.map(|r| r.accepted), Some(1));
    // A replay of an acknowledged upload is a typed conflict, not retried.
    let err = early.upload("t", &offer, &delta, &meta).await.unwrap_err();
    assert!(
        matches!(&err, ClientError::Conflict { error } if error.code == ErrorCode::AlreadyContributed),
        "{err}"
    );
    let receipt = second
        .upload("t", &second_offer, &delta, &meta)
        .await
        .unwrap();
    assert_eq!(receipt.map(|r| r.accepted), Some(2));
    // The late client's round closed: the SDK reports a missed round and carries on.
    let shard = synthetic::shard(
        &"synthetic-iid:clients=2,seed=5"
            .parse::<SyntheticConfig>()
            .unwrap(),
        0,
    )
    .unwrap();
    let mut trainer = SupervisedTrainer::new(shard.train, None, tch::Device::Cpu).unwrap();
    let report = late
        .contribute("t", &late_offer, &mut trainer, &mut |_| {})
        .await
        .unwrap();
    assert!(
        matches!(&report.outcome, RoundOutcome::Missed { reason } if reason.contains("round")),
        "{report:?}"
    );
}

/// A trainer that must not be called.
struct MustNotTrain;

impl Trainer for MustNotTrain {
    fn train(&mut self, _: &Model, _: TrainRequest<'_>) -> hora_client::Result<TrainOutcome> {
        panic!("the client trained again instead of resuming its saved update")
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_restarted_client_uploads_the_update_it_trained_before() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("server"));
    let admin = server.api(ADMIN_TOKEN);
    let initial = create_task(&admin, "t", 2, 1, 1).await;
    let state = dir.path().join("client");
    let client = sdk_client(&server, &admin, &state).await;
    let offer = client.join("t").await.unwrap().offer.expect("selected");
    // What a client killed between training and uploading leaves behind.
    let delta = delta(&initial, 7);
    let record = RoundState {
        round: offer.round,
        attempt: offer.attempt,
        base: offer.model,
        num_examples: 42,
        metrics: Metrics::default(),
        uploaded: false,
    };
    client.state().save_trained("t", &record, &delta).unwrap();
    drop(client);

    let config = ClientConfig::new(&server.url, &server.ca, &state);
    let restarted = Client::connect(config, None)
        .await
        .expect("stored credentials");
    let report = restarted
        .participate("t", &mut MustNotTrain, &mut |_| {})
        .await
        .unwrap()
        .expect("a round");
    assert_eq!(report.outcome, RoundOutcome::Resumed { accepted: Some(1) });
    assert_eq!(report.num_examples, 42);
    // One client: the published model is the initial model plus exactly that delta.
    assert_close(
        &admin.round_model("t", 1).await,
        &fedavg(&initial, &[(42, delta)]),
    );
    assert!(restarted.state().round("t").unwrap().unwrap().uploaded);
}

/// A trainer that runs out of time: it reports stopping early with whatever it has.
struct OutOfTime;

impl Trainer for OutOfTime {
    fn train(&mut self, global: &Model, _: TrainRequest<'_>) -> hora_client::Result<TrainOutcome> {
        let mut weights = global.clone();
        weights.data_mut()[0] += 0.5;
        Ok(TrainOutcome {
            weights,
            num_examples: 3,
            metrics: Metrics::default(),
            stopped_early: true,
        })
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_deadline_policy_decides_whether_a_partial_update_is_sent() {
    use hora_common::wire::DeadlinePolicy;
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("server"));
    let admin = server.api(ADMIN_TOKEN);
    let (_, digest) = upload_initial(&admin).await;
    for (id, policy) in [
        ("skip", DeadlinePolicy::Skip),
        ("partial", DeadlinePolicy::UploadPartial),
    ] {
        let mut t = logreg_task(id, digest, 1, 1, 1);
        t.training.on_deadline = policy;
        admin.create_task(&t).await;
        let client = sdk_client(&server, &admin, &dir.path().join(id)).await;
        let offer = client.join(id).await.unwrap().offer.expect("selected");
        let report = client
            .contribute(id, &offer, &mut OutOfTime, &mut |_| {})
            .await
            .unwrap();
        let accepted = task_info(&admin, id).await.open_round.map(|r| r.accepted);
        match policy {
            DeadlinePolicy::Skip => {
                assert_eq!(report.outcome, RoundOutcome::Skipped);
                assert_eq!(accepted, Some(0), "nothing was uploaded");
            }
            DeadlinePolicy::UploadPartial => {
                assert!(
                    matches!(report.outcome, RoundOutcome::Uploaded { .. }),
                    "{report:?}"
                );
                assert_eq!(report.num_examples, 3);
                // The one update closes the task's only round.
                wait_for("the task to finish", Duration::from_secs(30), async || {
                    task_info(&admin, id).await.state == TaskState::Finished
                })
                .await;
            }
        }
    }
}

/// A hostile server: answers every request with an endless chunked body (no Content-Length).
/// Returns its URL, its CA, and the count of body bytes it got out.
async fn endless_server(dir: &Path) -> (String, std::path::PathBuf, Arc<AtomicU64>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let certs = hora_server::tls::make_dev_certs(dir, &[]).unwrap();
    let mut config = hora_server::tls::server_config(&certs, None).unwrap();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!(
        "https://localhost:{}",
        listener.local_addr().unwrap().port()
    );
    let sent = Arc::new(AtomicU64::new(0));
    let counter = sent.clone();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let (acceptor, counter) = (acceptor.clone(), counter.clone());
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let mut head = [0u8; 4096];
                let _ = tls.read(&mut head).await;
                let _ = tls
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\ntransfer-encoding: chunked\r\n\r\n")
                    .await;
                let chunk = [7u8; 1 << 16];
                // Bounded: 256 MiB at most, far past the client's limit.
                for _ in 0..4096 {
                    let frame =
                        [format!("{:x}\r\n", chunk.len()).as_bytes(), &chunk, b"\r\n"].concat();
                    if tls.write_all(&frame).await.is_err() {
                        return;
                    }
                    counter.fetch_add(chunk.len() as u64, Ordering::SeqCst);
                }
            });
        }
    });
    (url, dir.join(hora_server::tls::CA_CERT), sent)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_download_without_content_length_is_cut_off_at_the_clients_limit() {
    let dir = tempfile::tempdir().unwrap();
    let (url, ca, sent) = endless_server(&dir.path().join("certs")).await;
    let state = dir.path().join("client");
    // Stored credentials: no enrolment needed.
    hora_client::state::StateDir::open(&state)
        .unwrap()
        .save_credentials(&hora_common::wire::Credentials {
            client_id: "c-1".into(),
            secret: "s".into(),
        })
        .unwrap();
    let mut config = ClientConfig::new(&url, &ca, &state);
    config.limits.max_bytes = 1 << 20;
    let client = Client::connect(config, None).await.unwrap();
    let err = client
        .model("t", &hora_common::model::ModelDigest([0; 32]))
        .await
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("exceeds the client's limit of 1048576 bytes"),
        "{err}"
    );
    // Cut off near the limit (socket buffers aside), not after reading all 256 MiB.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let sent = sent.load(Ordering::SeqCst);
    assert!(sent < 32 << 20, "the client read {sent} bytes");
}

/// Every option of `train` and `sync` is honoured from the file, the environment and the
/// flags, in that order of precedence; the option lists are the declarations' own.
#[test]
fn every_client_option_is_layered_flags_over_environment_over_file() {
    let tls: [support::Sample; 3] = [
        ("ca", "/srv/a/ca.pem", "/srv/b/ca.pem"),
        ("cert", "/srv/a/cert.pem", "/srv/b/cert.pem"),
        ("key", "/srv/a/key.pem", "/srv/b/key.pem"),
    ];
    let common: [support::Sample; 9] = [
        ("data", "a.csv", "mnist:b"),
        ("device", "cpu", "cuda:1"),
        ("holdout", "0.1", "0.3"),
        ("no_progress", "true", "false"),
        ("retry_for", "60", "70"),
        ("server", "https://a.example:1", "https://b.example:2"),
        ("threads", "2", "3"),
        ("token", "token-a", "token-b-longer"),
        ("token_file", "secret-file:token-a", "secret-file:token-b"),
    ];
    let train: [support::Sample; 11] = [
        ("client_index", "1", "2"),
        ("label", "site-a", "site-b"),
        ("min_train_secs", "0.5", "1.5"),
        ("rounds", "3", "4"),
        ("seed", "5", "6"),
        ("state_dir", "/srv/a/state", "/srv/b/state"),
        ("task", "task-a", "task-b"),
        ("timings", "/srv/a/t.jsonl", "/srv/b/t.jsonl"),
        ("token_file", "secret-file:token-a", "secret-file:token-b"),
        ("token", "token-a", "token-b-longer"),
        ("server", "https://a.example:1", "https://b.example:2"),
    ];
    let samples: Vec<support::Sample> = tls
        .iter()
        .chain(&common)
        .chain(train.iter().filter(|s| !common.iter().any(|c| c.0 == s.0)))
        .copied()
        .collect();
    support::check_layering(
        "hora-client",
        &["config", "check", "train"],
        &samples,
        &[("token", "token_file")],
    );
    let sync: [support::Sample; 29] = [
        ("advertise", "10.0.0.1", "10.0.0.2"),
        ("backward_passes_per_step", "2", "3"),
        ("batch_size", "16", "64"),
        ("checkpoint_dir", "/srv/a/ckpt", "/srv/b/ckpt"),
        ("checkpoint_every", "5", "6"),
        ("commit_every", "10", "30"),
        ("elastic", "true", "false"),
        ("epochs", "2", "3"),
        ("fp16", "true", "false"),
        ("fusion_mib", "8", "16"),
        ("job", "job-a", "job-b"),
        ("learning_rate", "0.1", "0.2"),
        ("lr_scaling", "none", "linear"),
        ("model", "mlp", "logreg"),
        ("momentum", "0.5", "0.6"),
        ("nccl", "off", "on"),
        ("optimizer", "adam", "sgd"),
        (
            "params",
            "{\"inputs\":4,\"hidden\":[8],\"classes\":3}",
            "{\"inputs\":5,\"classes\":3}",
        ),
        ("peers", "127.0.0.1:7001,127.0.0.1:7002", "127.0.0.1:7003"),
        ("rank", "0", "1"),
        ("ring_listen", "127.0.0.1:7001", "127.0.0.1:7002"),
        ("ring_unsealed", "true", "false"),
        ("save", "/srv/a/w.safetensors", "/srv/b/w.safetensors"),
        ("seed", "5", "6"),
        (
            "session_secret",
            "a-session-secret-0123456789",
            "b-session-secret-01234",
        ),
        ("sub_chunk_kib", "128", "512"),
        ("timeout", "10", "20"),
        ("weight_decay", "0.01", "0.02"),
        ("world_size", "2", "3"),
    ];
    let samples: Vec<support::Sample> = tls.iter().chain(&common).chain(&sync).copied().collect();
    support::check_layering(
        "hora-client",
        &["config", "check", "sync"],
        &samples,
        &[("token", "token_file"), ("server", "peers")],
    );
}

/// A trainer that moves every weight by the same fixed delta.
struct Shift(Model);

impl Trainer for Shift {
    fn train(&mut self, global: &Model, _: TrainRequest<'_>) -> hora_client::Result<TrainOutcome> {
        let mut weights = global.clone();
        weights
            .data_mut()
            .iter_mut()
            .zip(self.0.data())
            .for_each(|(w, d)| *w += d);
        Ok(TrainOutcome {
            weights,
            num_examples: 5,
            metrics: Metrics::default(),
            stopped_early: false,
        })
    }
}

/// Every value of `a − b` within 1e-6 of `want`'s.
fn assert_difference(a: &Model, b: &Model, want: &Model, what: &str) {
    for (i, ((a, b), w)) in a.data().iter().zip(b.data()).zip(want.data()).enumerate() {
        assert!(
            ((a - b) - w).abs() <= 1e-6 * (1.0 + w.abs()),
            "{what}, value {i}: {a} − {b} = {} != {w}",
            a - b
        );
    }
}

/// Top-k with error feedback across a SIGKILL: the `hora-client` process, killed between rounds
/// (its round-1 update acknowledged), leaves on its disk exactly what its upload left out
/// (trained delta − residual = what the server folded); restarted from that directory, the
/// client adds that residual to its round-2 update, and keeps the new remainder.
#[tokio::test(flavor = "multi_thread")]
async fn a_top_k_clients_residual_survives_a_sigkill_between_rounds() {
    use hora_client::state::StateDir;
    use hora_common::codec::{Compression, ValueCodec};
    use hora_common::model::Limits;

    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("server"));
    let admin = server.api(ADMIN_TOKEN);
    let (initial, digest) = upload_initial(&admin).await;
    // Two clients wanted, one enough: each round waits for the second until its deadline, so
    // the first client is between rounds meanwhile.
    let mut task = logreg_task("t", digest, 2, 1, 2);
    task.round_deadline_secs = 3;
    task.compression = Some(Compression {
        values: ValueCodec::F32,
        block_size: 256,
        top_k: Some(0.1),
    });
    admin.create_task(&task).await;
    let state_dir = dir.path().join("a");
    let mut a = client_command(&server.url, &server.ca, &state_dir, "t", 0);
    a.args(["--token", &admin.enrolment_token().await]);
    let mut a = spawn(a);
    let mut a_stdout = BufReader::new(a.stdout.take().unwrap()).lines();
    let first = a_stdout.next().expect("A's round line").unwrap();
    assert!(first.contains("t round 1 ·"), "{first}");
    a.kill().unwrap(); // SIGKILL
    a.wait().unwrap();

    let limits = Limits::default();
    let state = StateDir::open(&state_dir).unwrap();
    let record = state.round("t").unwrap().expect("a round record");
    assert_eq!((record.round, record.uploaded), (1, true));
    let trained = state
        .trained_delta("t", &limits)
        .expect("the trained delta");
    let residual = state.carried("t", &limits).expect("the residual");
    let sent = residual.data().iter().filter(|r| **r == 0.0).count();
    let k: usize = residual.tensors().iter().map(|t| t.len.div_ceil(10)).sum();
    assert!(
        sent >= k && sent < residual.numel() / 5,
        "{sent} of {} values sent",
        residual.numel()
    );
    // Round 1 publishes at its deadline with A's update alone: the model moved by what it sent.
    wait_for("round 1 to publish", Duration::from_secs(60), async || {
        task_info(&admin, "t").await.published_rounds >= 1
    })
    .await;
    let first_model = admin.round_model("t", 1).await;
    assert_difference(
        &trained,
        &residual,
        &{
            let mut moved = first_model.clone();
            moved
                .data_mut()
                .iter_mut()
                .zip(initial.data())
                .for_each(|(m, i)| *m -= i);
            moved
        },
        "round 1: trained − residual vs the published move",
    );

    // Restarted on the same directory, with a trainer whose delta is known.
    let config = ClientConfig::new(&server.url, &server.ca, &state_dir);
    let restarted = Client::connect(config, None)
        .await
        .expect("stored credentials");
    let shift = delta(&initial, 3);
    let report = restarted
        .participate("t", &mut Shift(shift.clone()), &mut |_| {})
        .await
        .unwrap()
        .expect("round 2");
    assert_eq!(
        (report.round, report.outcome),
        (2, RoundOutcome::Uploaded { accepted: Some(1) })
    );
    let second = state.trained_delta("t", &limits).expect("round 2's delta");
    // Its update carried the residual from before the kill...
    assert_difference(
        &second,
        &residual,
        &shift,
        "round 2's update − round 1's residual",
    );
    // ...and what it did not send now is the new residual.
    let remainder = state.carried("t", &limits).expect("round 2's residual");
    wait_for("round 2 to publish", Duration::from_secs(60), async || {
        task_info(&admin, "t").await.published_rounds >= 2
    })
    .await;
    let second_model = admin.round_model("t", 2).await;
    let mut moved = second_model.clone();
    moved
        .data_mut()
        .iter_mut()
        .zip(first_model.data())
        .for_each(|(m, f)| *m -= f);
    assert_difference(
        &second,
        &remainder,
        &moved,
        "round 2: trained − residual vs the move",
    );
}

/// An update larger than the server's chunk goes as an upload session. A connection cut at
/// half of it resumes from the chunk the server expects next, so what comes through in all is
/// the update once and less than one chunk more than over an unbroken link, and the round
/// publishes exactly what the same update sent unbroken does.
#[tokio::test(flavor = "multi_thread")]
async fn a_chunked_upload_cut_at_half_resumes_and_publishes_what_an_unbroken_one_does() {
    let dir = tempfile::tempdir().unwrap();
    let chunk = 65_536;
    let server = Server::start_with(
        &dir.path().join("server"),
        &["--upload-chunk-bytes", &chunk.to_string()],
    );
    let admin = server.api(ADMIN_TOKEN);
    let n = 500_000;
    let initial = Model::from_tensors([(
        "w",
        vec![n],
        (0..n).map(|i| (i % 977) as f32 * 1e-3).collect(),
    )])
    .unwrap();
    let digest = admin.upload_model(&initial).await;
    for id in ["cut", "unbroken"] {
        admin.create_task(&task(id, digest, 1, 1, 1, 60)).await;
    }
    let update = delta(&initial, 7);
    let size = update.to_safetensors().len() as u64;
    let upstream: std::net::SocketAddr = server.url.trim_start_matches("https://").parse().unwrap();
    let meta = UpdateMeta {
        num_examples: 10,
        metrics: Metrics::default(),
        contributors: None,
    };
    let mut sent = Vec::new();
    for (id, cut) in [("cut", size / 2), ("unbroken", u64::MAX)] {
        let (port, forth) = cutting_relay(upstream, Cut::Forth(cut)).await;
        let config = ClientConfig::new(
            format!("https://127.0.0.1:{port}"),
            &server.ca,
            dir.path().join(id),
        );
        let client = Client::connect(config, Some(&admin.enrolment_token().await))
            .await
            .expect("enrol");
        let offer = client.join(id).await.unwrap().offer.expect("selected");
        assert_eq!(offer.upload_chunk_bytes, Some(chunk));
        let receipt = client.upload(id, &offer, &update, &meta).await;
        assert_eq!(receipt.expect(id).map(|r| r.accepted), Some(1), "{id}");
        sent.push(forth.load(Ordering::SeqCst));
    }
    let (cut, unbroken) = (sent[0], sent[1]);
    assert!(
        unbroken > size,
        "{unbroken} bytes went up for an update of {size}"
    );
    assert!(
        cut < unbroken + chunk,
        "the cut upload sent {cut} bytes, the unbroken one {unbroken}: more than a chunk ({chunk}) again"
    );
    eprintln!(
        "update of {size} bytes in chunks of {chunk}, cut at {}: {cut} bytes up in all, {} more than unbroken",
        size / 2,
        cut - unbroken
    );
    let published = admin.round_model("cut", 1).await;
    assert_eq!(published, admin.round_model("unbroken", 1).await);
    assert_ne!(published, initial);
}

/// A chunk is taken only as the chunk its session expects next, sealed as that chunk of that
/// upload: replayed, reordered, skipped or taken from another upload, it is refused, and the
/// upload goes on from where it stood. A completion before every chunk is in, or of chunks that
/// are not the plaintext announced, is refused too.
#[tokio::test(flavor = "multi_thread")]
async fn chunks_replayed_reordered_or_from_another_upload_are_refused() {
    use hora_common::envelope::{seal_chunk, Binding, Chunk};
    use hora_common::wire::{UpdateReceipt, UploadSession};
    let dir = tempfile::tempdir().unwrap();
    // Room in the spool for one upload of 200 KB at a time.
    let server = Server::start_with(
        &dir.path().join("server"),
        &["--upload-chunk-bytes", "65536", "--spool-bytes", "300000"],
    );
    let admin = server.api(ADMIN_TOKEN);
    let n = 50_000;
    let initial = Model::from_tensors([("w", vec![n], vec![0.5; n])]).unwrap();
    let digest = admin.upload_model(&initial).await;
    admin.create_task(&task("t", digest, 1, 2, 2, 60)).await;
    let (a, b) = (admin.enrol().await, admin.enrol().await);
    let (offer_a, offer_b) = (a.join("t").await, b.join("t").await);
    let (update, other) = (delta(&initial, 1), delta(&initial, 2));
    let (plain, other_plain) = (update.to_safetensors(), other.to_safetensors());
    assert_eq!(plain.len(), other_plain.len());
    let sha = |p: &[u8]| -> [u8; 32] {
        ring::digest::digest(&ring::digest::SHA256, p)
            .as_ref()
            .try_into()
            .unwrap()
    };
    let (id, other_id) = (sha(&plain), sha(&other_plain));
    let length = plain.len() as u64;
    // Chunk `index` of `from`, sealed by `client` as chunk `as_index` of upload `upload`.
    let seal = |client: &support::Client,
                offer: &wire::RoundOffer,
                from: &[u8],
                upload: &[u8; 32],
                index: u64,
                as_index: u64| {
        let at = |index| Chunk {
            upload,
            length,
            chunk_bytes: 65_536,
            index,
        };
        let range = at(index).range().unwrap();
        let binding = Binding {
            task: "t",
            round: offer.round,
            client: &client.id,
            base_model: &offer.model,
        };
        seal_chunk(
            &from[range.start as usize..range.end as usize],
            &offer.round_key,
            &binding,
            &at(as_index),
        )
        .unwrap()
    };
    let uploads = format!("/v1/tasks/t/rounds/{}/uploads", offer_a.round);
    let start = |client: &support::Client, upload: &[u8; 32]| {
        client
            .api
            .request(Method::POST, &uploads)
            .json(&serde_json::json!({
                "digest": hex::encode(upload),
                "length": length,
            }))
    };
    let put = |client: &support::Client, upload: &[u8; 32], index: u64, body: Vec<u8>| {
        client
            .api
            .request(
                Method::PUT,
                &format!("{uploads}/{}/chunks/{index}", hex::encode(upload)),
            )
            .body(body)
    };
    let complete = |client: &support::Client, upload: &[u8; 32]| {
        client
            .api
            .request(
                Method::POST,
                &format!("{uploads}/{}/complete", hex::encode(upload)),
            )
            .header("x-hora-update", r#"{"num_examples": 10}"#)
    };
    // Chunks `indices` of `from`, each sealed as itself, taken.
    let send = async |client: &support::Client,
                      offer: &wire::RoundOffer,
                      from: &[u8],
                      upload: &[u8; 32],
                      indices: std::ops::Range<u64>| {
        for index in indices {
            let body = seal(client, offer, from, upload, index, index);
            let _: UploadSession = client.api.ok(put(client, upload, index, body)).await;
        }
    };
    let refused = |client: &support::Client,
                   req: reqwest::RequestBuilder,
                   status: u16,
                   code: &'static str| {
        let api = client.api.clone();
        let status = reqwest::StatusCode::from_u16(status).unwrap();
        async move { api.refused(req, status, code).await }
    };

    let session: UploadSession = a.api.ok(start(&a, &id)).await;
    assert_eq!(
        (session.next_chunk, session.chunks, session.received),
        (0, 4, 0)
    );
    // The spool holds a's upload: b's waits (503 busy) until a's ends.
    refused(&b, start(&b, &other_id), 503, "busy").await;
    // Skipped ahead: the session expects chunk 0.
    refused(
        &a,
        put(&a, &id, 1, seal(&a, &offer_a, &plain, &id, 1, 1)),
        409,
        "chunk_out_of_order",
    )
    .await;
    // Chunk 1 sent as chunk 0 (reordered), another upload's chunk 0, another client's.
    refused(
        &a,
        put(&a, &id, 0, seal(&a, &offer_a, &plain, &id, 0, 1)),
        400,
        "invalid_update",
    )
    .await;
    refused(
        &a,
        put(
            &a,
            &id,
            0,
            seal(&a, &offer_a, &other_plain, &other_id, 0, 0),
        ),
        400,
        "invalid_update",
    )
    .await;
    refused(
        &a,
        put(&a, &id, 0, seal(&b, &offer_b, &plain, &id, 0, 0)),
        400,
        "invalid_update",
    )
    .await;
    let session: UploadSession = a
        .api
        .ok(put(&a, &id, 0, seal(&a, &offer_a, &plain, &id, 0, 0)))
        .await;
    assert_eq!((session.next_chunk, session.received), (1, 65_536));
    // Chunk 0 again (a replay), and a completion with chunks missing.
    refused(
        &a,
        put(&a, &id, 0, seal(&a, &offer_a, &plain, &id, 0, 0)),
        409,
        "chunk_out_of_order",
    )
    .await;
    refused(&a, complete(&a, &id), 409, "chunk_out_of_order").await;
    send(&a, &offer_a, &plain, &id, 1..3).await;
    // Started again, the same upload resumes where it stood.
    let session: UploadSession = a.api.ok(start(&a, &id)).await;
    assert_eq!(session.next_chunk, 3);
    let session: UploadSession = a
        .api
        .ok(put(&a, &id, 3, seal(&a, &offer_a, &plain, &id, 3, 3)))
        .await;
    assert_eq!((session.next_chunk, session.received), (4, length));
    let receipt: UpdateReceipt = a.api.ok(complete(&a, &id)).await;
    assert_eq!(receipt.accepted, 1);
    // Chunks of one plaintext sent as another's upload: each opens, the whole is refused.
    let _: UploadSession = b.api.ok(start(&b, &other_id)).await;
    send(&b, &offer_b, &plain, &other_id, 0..4).await;
    refused(&b, complete(&b, &other_id), 400, "invalid_update").await;
    refused(
        &b,
        put(&b, &other_id, 4, vec![0; 100]),
        410,
        "upload_unknown",
    )
    .await;
    // And nothing taken was lost: b's own update completes the round.
    let _: UploadSession = b.api.ok(start(&b, &other_id)).await;
    send(&b, &offer_b, &other_plain, &other_id, 0..4).await;
    let receipt: UpdateReceipt = b.api.ok(complete(&b, &other_id)).await;
    assert_eq!(receipt.accepted, 2);
    let published = admin.round_model("t", 1).await;
    let expected: Vec<f32> = initial
        .data()
        .iter()
        .zip(update.data().iter().zip(other.data()))
        .map(|(g, (x, y))| g + (x + y) / 2.0)
        .collect();
    for (p, e) in published.data().iter().zip(&expected) {
        assert!((p - e).abs() < 1e-6, "{p} vs {e}");
    }
}

/// A model download cut at half its length resumes where it broke off: the client asks for the
/// rest with `Range` and `If-Range` (the model's digest), and what comes back in all is the
/// model once, not once and a half. The server answers a range as HTTP says: 206 with its
/// `Content-Range`, the whole model when `If-Range` names another or the range lies past it.
#[tokio::test(flavor = "multi_thread")]
async fn a_model_download_cut_at_half_resumes_where_it_broke_off() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("server"));
    let admin = server.api(ADMIN_TOKEN);
    let n = 2_000_000;
    let initial = Model::from_tensors([(
        "w",
        vec![n],
        (0..n).map(|i| (i % 1000) as f32 * 1e-3).collect(),
    )])
    .unwrap();
    let digest = admin.upload_model(&initial).await;
    admin.create_task(&task("t", digest, 1, 1, 1, 60)).await;
    let size = initial.to_safetensors().len() as u64;

    // The server's ranges, straight.
    let client = admin.enrol().await;
    let path = format!("/v1/tasks/t/model?digest={}", digest.to_hex());
    let etag = format!("\"{}\"", digest.to_hex());
    let get = |range: &str, if_range: &str| {
        let mut req = client
            .api
            .request(Method::GET, &path)
            .header("range", range);
        if !if_range.is_empty() {
            req = req.header("if-range", if_range);
        }
        req.send()
    };
    let resp = get("bytes=1000-", &etag).await.unwrap();
    assert_eq!(resp.status(), 206);
    let range = resp.headers()["content-range"]
        .to_str()
        .unwrap()
        .to_string();
    assert_eq!(range, format!("bytes 1000-{}/{size}", size - 1));
    assert_eq!(
        resp.bytes().await.unwrap(),
        initial.to_safetensors()[1000..]
    );
    let resp = get("bytes=10-19", "").await.unwrap();
    assert_eq!(resp.status(), 206);
    assert_eq!(
        resp.bytes().await.unwrap(),
        initial.to_safetensors()[10..20]
    );
    for (range, if_range) in [
        ("bytes=1000-", "\"another\""),
        (&*format!("bytes={size}-"), ""),
    ] {
        let resp = get(range, if_range).await.unwrap();
        assert_eq!(resp.status(), 200, "{range} {if_range}");
        assert_eq!(resp.bytes().await.unwrap().len() as u64, size);
    }

    // The SDK client through a link that drops at half the model.
    let upstream: std::net::SocketAddr = server.url.trim_start_matches("https://").parse().unwrap();
    let (port, back) = cutting_relay(upstream, Cut::Back(size / 2)).await;
    let config = ClientConfig::new(
        format!("https://127.0.0.1:{port}"),
        &server.ca,
        dir.path().join("client"),
    );
    let sdk = Client::connect(config, Some(&admin.enrolment_token().await))
        .await
        .expect("enrol");
    let model = sdk.model("t", &digest).await.expect("the model, resumed");
    assert_eq!(model, initial);
    let passed = back.load(Ordering::SeqCst);
    assert!(
        passed < size + size / 10,
        "{passed} bytes came back for a model of {size}: the download started again"
    );
    eprintln!(
        "model of {size} bytes cut at {}: {passed} bytes in all, {} re-sent or overhead",
        size / 2,
        passed - size
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_task_that_trains_part_of_its_model_keeps_the_rest_frozen_and_downloaded_once() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("server"));
    let admin = server.api(ADMIN_TOKEN);
    let (initial, digest) = upload_initial(&admin).await;
    let mut t = logreg_task("part", digest, 2, 1, 1);
    // A pattern that names nothing is refused, and says what the tensors are called.
    t.trainable = Some(vec!["*.bias".into(), "head.*".into()]);
    let req = admin.request(Method::POST, "/admin/v1/tasks").json(&t);
    let message = admin
        .refused(req, reqwest::StatusCode::BAD_REQUEST, "bad_request")
        .await;
    assert!(message.contains("`head.*` names no tensor") && message.contains("linear.weight"));
    t.trainable = Some(vec!["*.bias".into()]);
    let info = admin.create_task(&t).await;
    let (part, base) = initial.split(|name| name == "linear.bias");
    let frozen = info.frozen_base.expect("a frozen base");
    assert_eq!((frozen.model, &frozen.spec), (base.digest(), &base.spec()));
    assert_eq!(
        (info.global_model, &info.spec),
        (part.digest(), &part.spec())
    );

    // A round trained by the SDK changes the trainable tensors only.
    let client = sdk_client(&server, &admin, &dir.path().join("c")).await;
    let shard = synthetic::shard(&IID.parse::<SyntheticConfig>().unwrap(), 0).unwrap();
    let mut trainer = SupervisedTrainer::new(shard.train, None, tch::Device::Cpu).unwrap();
    let report = client
        .participate("part", &mut trainer, &mut |_| {})
        .await
        .unwrap()
        .expect("a round");
    assert!(
        matches!(report.outcome, RoundOutcome::Uploaded { .. }),
        "{report:?}"
    );
    let trained = admin.round_model("part", 1).await;
    assert_eq!(trained.spec(), part.spec());
    assert_ne!(trained, part, "the bias trained");
    let resp = admin
        .request(Method::GET, "/admin/v1/tasks/part/base")
        .send()
        .await
        .unwrap();
    let bytes = resp.bytes().await.unwrap();
    let limits = hora_common::model::Limits::default();
    assert_eq!(Model::from_safetensors(&bytes, &limits).unwrap(), base);

    // An update that carries a frozen tensor is refused, by name; one without goes in.
    let offer = client.join("part").await.unwrap().offer.expect("selected");
    assert_eq!(offer.frozen_base, Some(base.digest()));
    let meta = UpdateMeta {
        num_examples: 10,
        metrics: Metrics::default(),
        contributors: None,
    };
    let err = client
        .upload("part", &offer, &delta(&initial, 1), &meta)
        .await
        .unwrap_err();
    assert!(
        matches!(&err, ClientError::Rejected { status: 400, error } if error.code == ErrorCode::InvalidUpdate
            && error.message.contains("tensor `linear.weight` is frozen in this task")),
        "{err}"
    );
    // One that frozen tensors make larger than any update of the task is refused unread, and
    // told why it may be.
    let frozen = Model::from_tensors([("embedding", vec![20_000], vec![0.0; 20_000])]).unwrap();
    let large = Model::merge(&frozen, &delta(&part, 2)).unwrap();
    let err = client
        .upload("part", &offer, &large, &meta)
        .await
        .unwrap_err();
    assert!(
        matches!(&err, ClientError::Rejected { status: 413, error }
            if error.message.contains("none of its frozen base")),
        "{err}"
    );
    let report = client
        .contribute("part", &offer, &mut trainer, &mut |_| {})
        .await
        .unwrap();
    assert!(
        matches!(report.outcome, RoundOutcome::Uploaded { .. }),
        "{report:?}"
    );
    assert_eq!(admin.round_model("part", 2).await.spec(), part.spec());
    // The base was downloaded once and kept: three downloads for two rounds, not four.
    let downloads =
        r#"hora_http_requests_total{route="/v1/tasks/{task}/model",method="GET",status="200"}"#;
    assert_eq!(admin.metric(downloads).await, 3.0);
}

#[tokio::test(flavor = "multi_thread")]
async fn federated_evaluation_is_the_example_weighted_mean_of_the_clients_own_evaluations() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("server"));
    let admin = server.api(ADMIN_TOKEN);
    let (_, digest) = upload_initial(&admin).await;
    let mut t = logreg_task("eval", digest, 2, 3, 3);
    t.evaluation = Some(wire::EvaluationConfig {
        every: 1,
        clients: 3,
        fraction: None,
        held_out: false,
        deadline_secs: None,
    });
    admin.create_task(&t).await;
    // Three clients train every round and evaluate each published model on their held-out
    // split, the built-in trainer's way, through the SDK's loop.
    let data: SyntheticConfig = "synthetic-iid:clients=3,seed=9".parse().unwrap();
    let mut clients = Vec::new();
    let mut tests = Vec::new();
    for k in 0..3 {
        let shard = synthetic::shard(&data, k).unwrap();
        tests.push(shard.test.clone());
        let client = sdk_client(&server, &admin, &dir.path().join(format!("c{k}"))).await;
        clients.push(tokio::spawn(async move {
            let mut trainer =
                SupervisedTrainer::new(shard.train, Some(shard.test), tch::Device::Cpu).unwrap();
            client
                .run("eval", &mut trainer, None, &mut |_| {}, &mut |_| {})
                .await
                .unwrap()
        }));
    }
    for c in clients {
        assert_eq!(c.await.unwrap().final_state, TaskState::Finished);
    }

    // The server's figure for each round equals one computed here from each client's own
    // evaluation of the published model, weighted by its held-out examples.
    let history: Vec<RoundRecord> = admin
        .ok(admin.request(Method::GET, "/admin/v1/tasks/eval/rounds"))
        .await;
    assert_eq!(history.len(), 2);
    for entry in &history {
        let model = admin.round_model("eval", entry.round).await;
        let (mut n, mut loss, mut correct) = (0u64, 0.0, 0.0);
        for test in &tests {
            let mut net = Network::builtin(&arch(), tch::Device::Cpu).unwrap();
            net.set_weights(&model).unwrap();
            let data = hora_client::supervised::DeviceData::new(test, tch::Device::Cpu).unwrap();
            let own = hora_client::supervised::evaluate(&mut net, &data, 1024).unwrap();
            n += own.examples;
            loss += own.examples as f64 * own.loss;
            correct += own.examples as f64 * own.accuracy;
        }
        let summary = entry.evaluation.expect("every round evaluated");
        assert_eq!(
            (summary.clients, summary.examples),
            (3, n),
            "round {}",
            entry.round
        );
        let (l, a) = (summary.loss.unwrap(), summary.accuracy.unwrap());
        assert!(
            (l - loss / n as f64).abs() < 1e-6 * l.max(1.0),
            "round {}: {l} vs {}",
            entry.round,
            loss / n as f64
        );
        assert!(
            (a - correct / n as f64).abs() < 1e-9,
            "round {}: {a}",
            entry.round
        );
        eprintln!(
            "round {}: federated evaluation loss {l:.4}, accuracy {a:.4} over {n} examples",
            entry.round
        );
    }
    assert_eq!(
        admin.metric(r#"hora_evaluation_round{task="eval"}"#).await,
        2.0
    );
    assert_eq!(
        admin
            .metric(r#"hora_evaluation_reports_total{task="eval"}"#)
            .await,
        6.0
    );
    // Over: a further report is refused as such.
    let late = admin.enrol().await;
    let report = wire::EvaluationReport {
        num_examples: 5,
        loss: Some(1.0),
        accuracy: None,
    };
    let req = late
        .api
        .request(Method::POST, "/v1/tasks/eval/evaluations/2")
        .json(&report);
    let message = late
        .api
        .refused(req, reqwest::StatusCode::CONFLICT, "evaluation_closed")
        .await;
    assert!(message.contains("round 2"), "{message}");
}
