//! Asynchronous (FedBuff) tasks against the real `hora-server` binary on loopback TLS: versions
//! are the staleness-weighted average their buffers say, an update too stale is refused, a
//! SIGKILL in the middle of a buffer loses no acknowledged update (and changes no model), nor does
//! the SIGKILL of a leading replica whose standby (on one PostgreSQL database) takes over, only
//! clients holding a training slot upload, and a fleet of fast and slow `hora-client` processes
//! all contribute.

mod support;

use hora_common::model::Model;
use hora_common::wire::{AsynchronousConfig, CreateTask, RoundOffer, RoundRecord, Staleness};
use reqwest::{Method, StatusCode};
use support::*;

const TASK: &str = "buffered";
const MAX_STALENESS: u64 = 2;
const EXPONENT: f64 = 0.5;

fn asynchronous_task(initial: hora_common::model::ModelDigest) -> CreateTask {
    CreateTask {
        asynchronous: Some(AsynchronousConfig {
            buffer_size: 3,
            max_staleness: MAX_STALENESS,
            concurrency: 8,
            staleness: Staleness::Polynomial { exponent: EXPONENT },
        }),
        ..task(TASK, initial, 4, 1, 1, 600)
    }
}

/// One update of the scenario: the model it was trained from, its example count and delta.
struct Update {
    base: u64,
    examples: u64,
    delta: Model,
}

/// `global + Σ nᵢ·(1 + sᵢ)^-½·δᵢ / Σ nᵢ` for version `version`, computed independently in f64.
fn fedbuff(global: &Model, version: u64, updates: &[&Update]) -> Model {
    let total: f64 = updates.iter().map(|u| u.examples as f64).sum();
    let mut out = global.clone();
    for (i, g) in out.data_mut().iter_mut().enumerate() {
        let s: f64 = updates
            .iter()
            .map(|u| {
                let w = (1.0 + (version - u.base) as f64).powf(-EXPONENT);
                u.examples as f64 * w * f64::from(u.delta.data()[i])
            })
            .sum();
        *g = (f64::from(*g) + s / total) as f32;
    }
    out
}

/// How a scenario's server meets its `Crash` steps.
#[derive(Clone, Copy, PartialEq)]
enum Crashes {
    /// It does not crash.
    None,
    /// SIGKILLed and restarted on its data directory (sled).
    Restart,
    /// Replicas on one PostgreSQL database: the leader is SIGKILLed and its standby takes over
    /// (on the same address), and a new standby starts.
    Failover,
}

/// The server of a scenario.
struct Run {
    dir: tempfile::TempDir,
    listen: String,
    server: Option<Server>,
    crashes: Crashes,
    replicas: Option<(Replicas, Option<Starting>)>,
}

impl Run {
    fn start(crashes: Crashes) -> Run {
        let dir = tempfile::tempdir().unwrap();
        let listen = format!("127.0.0.1:{}", free_port());
        let (server, replicas) = match crashes {
            Crashes::Failover => {
                let mut replicas = Replicas::new(&listen);
                let leader = replicas.spawn().listening();
                let standby = replicas.spawn();
                (leader, Some((replicas, Some(standby))))
            }
            _ => (Server::start_on(dir.path(), &listen, &[]), None),
        };
        Run {
            dir,
            listen,
            server: Some(server),
            crashes,
            replicas,
        }
    }

    fn server(&self) -> &Server {
        self.server.as_ref().expect("running")
    }

    /// SIGKILL, and start again or fail over, if this run crashes.
    fn maybe_crash(&mut self) {
        if self.crashes == Crashes::None {
            return;
        }
        self.server.take().expect("running").kill();
        self.server = Some(match &mut self.replicas {
            None => Server::start_on(self.dir.path(), &self.listen, &[]),
            Some((replicas, standby)) => {
                // The standby takes over; only then does the next one start (else either might).
                let leader = standby.take().expect("a standby").listening();
                *standby = Some(replicas.spawn());
                leader
            }
        });
    }
}

/// One step of the scenario.
enum Step {
    /// Client `.0` uploads an update of `.1` examples (delta seed `.2`) from the version it
    /// pulled last.
    Up(usize, u64, u64),
    /// Client `.0` pulls again and gets version `.1`.
    Pull(usize, u64),
    /// Client `.0` sends its last (acknowledged) upload again: refused as already contributed.
    Again(usize),
    /// SIGKILL and restart, in the crashing run.
    Crash,
}

use Step::*;

/// Buffers of three, updates up to two versions stale, seven clients that all pull version 1 and
/// then upload in this order; the crashing run is SIGKILLed twice in the middle of a buffer, the
/// second time with a stale update in it and more to come trained from version 1 (whose key the
/// restarted server must still have).
const SCRIPT: &[Step] = &[
    // Version 1's buffer.
    Up(0, 10, 1),
    Up(1, 20, 2),
    Crash,
    Again(1),
    Up(2, 30, 3),
    // Version 2's: c3 trained from v1, c0 from v2, then c4 from v1.
    Up(3, 10, 4),
    Pull(0, 2),
    Up(0, 10, 5),
    Crash,
    Up(4, 40, 6),
    // Version 3's: c1 from v3, c5 from v1 (two versions stale, the most allowed), c2 from v3.
    Pull(1, 3),
    Up(1, 20, 7),
    Up(5, 10, 8),
    Pull(2, 3),
    Up(2, 5, 9),
];

/// Runs [`SCRIPT`] (with its SIGKILLs when `crash`); then client 6, still on version 1, three
/// versions behind, is refused. Returns the models of versions 0-3, the history, and the
/// updates in the order they were acknowledged.
async fn scenario(crashes: Crashes) -> (Vec<Model>, Vec<RoundRecord>, Vec<Update>) {
    let mut run = Run::start(crashes);
    let admin = run.server().api(ADMIN_TOKEN);
    let initial = small_model();
    let digest = admin.upload_model(&initial).await;
    admin.create_task(&asynchronous_task(digest)).await;
    let mut clients = Vec::new();
    let mut offers: Vec<RoundOffer> = Vec::new();
    for _ in 0..7 {
        let client = admin.enrol().await;
        offers.push(client.join(TASK).await);
        clients.push(client);
    }
    let mut last: Vec<Option<(u64, Vec<u8>)>> = vec![None; clients.len()];
    let mut updates: Vec<Update> = Vec::new();
    for step in SCRIPT {
        match *step {
            Up(k, examples, seed) => {
                let delta = delta(&initial, seed);
                let body = clients[k].seal(TASK, &offers[k], &delta);
                let req = clients[k].upload_request(TASK, offers[k].round, examples, body.clone());
                admin.ok::<serde_json::Value>(req).await;
                last[k] = Some((examples, body));
                updates.push(Update {
                    base: offers[k].round,
                    examples,
                    delta,
                });
            }
            Pull(k, version) => {
                offers[k] = clients[k].join(TASK).await;
                assert_eq!(
                    offers[k].round, version,
                    "client {k} pulls the current version"
                );
            }
            Again(k) => {
                let (examples, body) = last[k].clone().expect("an earlier upload");
                let req = clients[k].upload_request(TASK, offers[k].round, examples, body);
                admin
                    .refused(req, StatusCode::CONFLICT, "already_contributed")
                    .await;
            }
            Crash => run.maybe_crash(),
        }
    }
    let admin = run.server().api(ADMIN_TOKEN);
    let mut models = vec![initial.clone()];
    for version in 1..=3 {
        models.push(admin.round_model(TASK, version).await);
    }
    let body = clients[6].seal(TASK, &offers[6], &delta(&initial, 10));
    let req = clients[6].upload_request(TASK, offers[6].round, 10, body);
    let refused = admin.refused(req, StatusCode::CONFLICT, "too_stale").await;
    assert!(refused.contains("3 versions behind"), "{refused}");
    // Only a client holding a training slot uploads: one that never joined is refused (before
    // its body is read), and so is one whose slot its last upload spent.
    let stranger = admin.enrol().await;
    let current = clients[2].join(TASK).await;
    let body = stranger.seal(TASK, &current, &delta(&initial, 11));
    let req = stranger.upload_request(TASK, current.round, 10, body);
    let refused = admin
        .refused(req, StatusCode::CONFLICT, "not_selected")
        .await;
    assert!(refused.contains("holds no training slot"), "{refused}");
    let body = clients[1].seal(TASK, &current, &delta(&initial, 12));
    let req = clients[1].upload_request(TASK, current.round, 10, body);
    admin
        .refused(req, StatusCode::CONFLICT, "not_selected")
        .await;
    let history: Vec<RoundRecord> = admin
        .ok(admin.request(Method::GET, &format!("/admin/v1/tasks/{TASK}/rounds")))
        .await;
    (models, history, updates)
}

#[tokio::test(flavor = "multi_thread")]
async fn versions_are_the_staleness_weighted_average_of_their_buffers() {
    let (models, history, u) = scenario(Crashes::None).await;
    // Independently: each version from the one before and the updates in its buffer, each
    // weighted by its example count and (1 + staleness)^-½.
    let v1 = fedbuff(&models[0], 1, &[&u[0], &u[1], &u[2]]);
    assert_close(&models[1], &v1);
    let v2 = fedbuff(&models[1], 2, &[&u[3], &u[4], &u[5]]);
    assert_close(&models[2], &v2);
    let v3 = fedbuff(&models[2], 3, &[&u[6], &u[7], &u[8]]);
    assert_close(&models[3], &v3);
    // The chain computed from the initial model alone agrees too.
    let chained = fedbuff(
        &fedbuff(&v1, 2, &[&u[3], &u[4], &u[5]]),
        3,
        &[&u[6], &u[7], &u[8]],
    );
    assert_close(&models[3], &chained);

    let staleness: Vec<_> = history
        .iter()
        .map(|h| {
            let s = h
                .staleness
                .as_ref()
                .expect("an asynchronous version's staleness");
            (h.round, s.bases.clone(), s.histogram.clone())
        })
        .collect();
    assert_eq!(
        staleness,
        [
            (1, vec![1, 1, 1], vec![3]),
            (2, vec![1, 2, 1], vec![1, 2]),
            (3, vec![3, 1, 3], vec![2, 0, 1]),
        ]
    );
    assert_eq!(history[1].examples, 60);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_sigkill_mid_buffer_or_of_the_leading_replica_loses_no_acknowledged_update_and_changes_no_model(
) {
    let (calm, _, _) = scenario(Crashes::None).await;
    for crashes in [Crashes::Restart, Crashes::Failover] {
        let (crashed, history, _) = scenario(crashes).await;
        for (version, (a, b)) in calm.iter().zip(&crashed).enumerate() {
            assert_eq!(
                a.data(),
                b.data(),
                "version {version} differs after the SIGKILLs"
            );
        }
        let contributions: usize = history.iter().map(|h| h.participants.len()).sum();
        assert_eq!(contributions, 9, "every acknowledged update, once");
    }
}

/// Six `hora-client train` processes whose local training takes 0.2 s to 2 s, buffers of four:
/// every client's updates go into versions, stale ones included, and none is refused for its
/// staleness; every acknowledged update is in the history.
#[test]
fn a_fleet_of_fast_and_slow_clients_all_contribute_and_none_is_refused_for_being_late() {
    let (stdout, result) = run_example(
        "asynchronous",
        &[
            "--clients",
            "6",
            "--fast-secs",
            "0.2",
            "--spread",
            "10",
            "--buffer",
            "4",
            "--versions",
            "10",
            "--datasets",
            "iid",
            "--json",
        ],
    );
    println!("{stdout}");
    let run = &result["iid"][0];
    let counts = |key: &str| -> Vec<u64> {
        run[key]
            .as_array()
            .unwrap_or_else(|| panic!("{key}"))
            .iter()
            .map(|v| v.as_u64().expect("count"))
            .collect()
    };
    let acknowledged = counts("acknowledged");
    let in_history = counts("in_history");
    assert_eq!(run["published"], 10);
    assert_eq!(
        acknowledged, in_history,
        "every acknowledged update is in a version"
    );
    assert_eq!(in_history.iter().sum::<u64>(), 40, "ten versions of four");
    assert!(
        in_history.iter().all(|n| *n >= 1),
        "every client contributed, the slowest too: {in_history:?}"
    );
    assert!(
        in_history[0] > in_history[5],
        "the fastest contributed more often than the slowest: {in_history:?}"
    );
    assert_eq!(run["too_stale"], 0);
    assert!(
        run["max_staleness"].as_u64().expect("max staleness") >= 1,
        "stale updates were taken"
    );
    // Only updates still in training when the task finished went unused.
    assert!(run["updates_wasted"].as_u64().expect("wasted") <= 6);
}
