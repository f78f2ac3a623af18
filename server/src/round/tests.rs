//! The round engine's phase transitions, driven through the coordinator's own verbs (no HTTP)
//! against the in-memory store: collecting → closing → published, abandoned at the deadline and
//! retried, refused once closed, held while paused, abandoned when the task stops.

use std::sync::Arc;
use std::time::Duration;

use hora_common::envelope::{self, Binding};
use hora_common::model::{Model, ModelDigest};
use hora_common::wire::{self, ErrorCode, RoundOffer, RoundOutcome, TaskState, UpdateMeta};

use super::{Coordinator, CoordinatorConfig, Phase, Round, Task, UpdateBody};
use crate::error::ServerError;
use crate::metrics::ServerMetrics;
use crate::store::MemoryStore;
use crate::store::Store;

struct Engine {
    coordinator: Arc<Coordinator>,
    initial: Model,
    digest: ModelDigest,
}

fn engine() -> Engine {
    let store: Arc<Store> = Arc::new(MemoryStore::new().unwrap());
    let initial = Model::from_tensors([("w", vec![3], vec![1.0, 2.0, 3.0])]).unwrap();
    let digest = store.put_model(&initial).unwrap();
    let coordinator = Coordinator::open(
        store,
        CoordinatorConfig::default(),
        Arc::new(ServerMetrics::default()),
    )
    .unwrap();
    coordinator.start();
    Engine {
        coordinator,
        initial,
        digest,
    }
}

impl Engine {
    fn create(&self, id: &str, min: u32, target: u32, deadline_secs: u64) -> Arc<Task> {
        let config: wire::CreateTask = serde_json::from_value(serde_json::json!({
            "id": id, "initial_model": self.digest,
            "model": {"kind": "builtin", "name": "mlp"},
            "rounds": 5, "min_clients": min, "target_clients": target,
            "round_deadline_secs": deadline_secs,
        }))
        .unwrap();
        self.coordinator.create_task(config).unwrap();
        self.coordinator.task(id).unwrap()
    }

    async fn join(&self, task: &Arc<Task>, client: &str) -> RoundOffer {
        self.coordinator
            .join(task, client)
            .await
            .unwrap()
            .offer
            .expect("selected")
    }

    async fn upload(
        &self,
        task: &Arc<Task>,
        client: &str,
        offer: &RoundOffer,
        examples: u64,
        delta: [f32; 3],
    ) -> Result<wire::UpdateReceipt, ServerError> {
        let delta = Model::from_tensors([("w", vec![3], delta.to_vec())]).unwrap();
        let binding = Binding {
            task: &task.id,
            round: offer.round,
            client,
            base_model: &offer.model,
        };
        let sealed = envelope::seal(&delta.to_safetensors(), &offer.round_key, &binding).unwrap();
        let meta = UpdateMeta {
            num_examples: examples,
            metrics: Default::default(),
            contributors: None,
        };
        self.coordinator
            .upload(
                task.clone(),
                client.into(),
                offer.round,
                meta,
                UpdateBody::Sealed(sealed),
                (),
            )
            .await
    }

    async fn set_state(&self, task: &Arc<Task>, to: TaskState) {
        self.coordinator.set_state(task.clone(), to).await.unwrap();
    }

    /// A task whose round has `a`'s update in it: the task and its round.
    async fn with_one_update(
        &self,
        min: u32,
        target: u32,
        deadline_secs: u64,
    ) -> (Arc<Task>, Arc<Round>) {
        let task = self.create("t", min, target, deadline_secs);
        let round = task.current().unwrap();
        let offer = self.join(&task, "a").await;
        self.upload(&task, "a", &offer, 1, [1.0, 0.0, 0.0])
            .await
            .unwrap();
        (task, round)
    }

    fn global(&self, task: &Task) -> Vec<f32> {
        let store = self.coordinator.store();
        store
            .read_model(&task.global_model())
            .unwrap()
            .data()
            .to_vec()
    }
}

/// An enrolled client's record, with no strikes.
fn enrolled() -> crate::store::ClientRecord {
    crate::store::ClientRecord {
        aggregator: false,
        max_contributors: None,
        secret_hash: String::new(),
        label: None,
        enrolled_unix_ms: 0,
        revoked: false,
        identity_key: None,
        tasks: None,
        strikes: 0,
        quarantined: None,
    }
}

/// Waits until `task`'s open round is no longer `round` (it closed and the next one opened).
async fn next_round(task: &Task, round: &Arc<Round>) -> Arc<Round> {
    for _ in 0..500 {
        if let Some(now) = task.current().filter(|r| !Arc::ptr_eq(r, round)) {
            return now;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("round {} never closed", round.number);
}

#[tokio::test]
async fn a_full_round_goes_from_collecting_through_closing_to_published() {
    let e = engine();
    let task = e.create("t", 2, 2, 600);
    let round = task.current().unwrap();
    assert_eq!(round.phase(), Phase::Collecting);
    let offer = e.join(&task, "a").await;
    e.join(&task, "b").await;
    e.upload(&task, "a", &offer, 1, [3.0, 0.0, 0.0])
        .await
        .unwrap();
    assert_eq!(round.phase(), Phase::Collecting, "one of two is in");
    e.upload(&task, "b", &offer, 2, [0.0, 0.0, 3.0])
        .await
        .unwrap();
    let next = next_round(&task, &round).await;
    assert_eq!(round.phase(), Phase::Published);
    assert_eq!((next.number, next.attempt), (2, 0));
    assert_eq!(next.phase(), Phase::Collecting);
    // FedAvg weighted by examples: (1·a + 2·b) / 3.
    assert_eq!(e.global(&task), vec![2.0, 2.0, 5.0]);
    let history = e.coordinator.history(&task).unwrap();
    assert_eq!(history.len(), 1);
    assert_eq!(history[0].outcome, RoundOutcome::Published);
    assert_eq!(history[0].participants, ["a", "b"]);
    assert_ne!(e.initial.data(), e.global(&task));
}

#[tokio::test]
async fn a_round_short_at_its_deadline_is_abandoned_and_retried_with_a_fresh_key() {
    let e = engine();
    let store = e.coordinator.store();
    for client in ["a", "b"] {
        store.put_client(client, &enrolled()).unwrap();
    }
    let task = e.create("t", 2, 3, 1);
    let round = task.current().unwrap();
    let offer = e.join(&task, "a").await;
    e.join(&task, "b").await;
    e.upload(&task, "a", &offer, 1, [1.0, 1.0, 1.0])
        .await
        .unwrap();
    let retry = next_round(&task, &round).await;
    let Phase::Abandoned(reason) = round.phase() else {
        panic!("{:?}", round.phase());
    };
    assert!(reason.contains("1 of the required 2"), "{reason}");
    // b took a place and sent nothing: the short round is traced to it (a strike), not to a.
    let strikes = |c: &str| store.client(c).unwrap().unwrap().strikes;
    for _ in 0..500 {
        if strikes("b") == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!((strikes("a"), strikes("b")), (0, 1));
    assert_eq!((retry.number, retry.attempt), (1, 1));
    // A poll of a client that dealt with attempt 0 is answered at once: the retry wants its
    // update again.
    let poll = tokio::time::timeout(
        Duration::from_secs(5),
        e.coordinator.poll(
            task.clone(),
            "a",
            (Some(1), Some(0)),
            None,
            Duration::from_secs(20),
        ),
    )
    .await
    .expect("answered at once, not after the 20 s wait");
    assert_eq!(
        (poll.open_round, poll.attempt, poll.contributed),
        (Some(1), Some(1), false)
    );
    assert!(poll.wants_update(Some((1, 0))));
    let again = e.join(&task, "a").await;
    assert_eq!(again.attempt, 1);
    assert_ne!(again.round_key, offer.round_key, "a retry gets a fresh key");
    assert_eq!(e.global(&task), e.initial.data(), "nothing was published");
}

#[tokio::test]
async fn a_join_is_answered_once_a_record_lists_the_client() {
    let e = engine();
    let task = e.create("t", 2, 2, 60);
    for client in ["a", "b"] {
        e.join(&task, client).await;
        let stored = e.coordinator.store().open_round("t").unwrap().unwrap();
        assert!(stored.selected.iter().any(|s| s == client), "{client}");
    }
    // A repeat join of a selected client is answered without waking pollers.
    let changes = task.subscribe();
    e.join(&task, "a").await;
    assert!(!changes.has_changed().unwrap());
}

#[tokio::test]
async fn a_closed_round_refuses_late_uploads_and_joins_go_to_the_next() {
    let e = engine();
    let task = e.create("t", 1, 1, 600);
    let round = task.current().unwrap();
    let offer = e.join(&task, "a").await;
    e.upload(&task, "a", &offer, 1, [1.0, 0.0, 0.0])
        .await
        .unwrap();
    next_round(&task, &round).await;
    let late = e.upload(&task, "b", &offer, 1, [1.0, 0.0, 0.0]).await;
    let Err(err) = late else {
        panic!("a late upload was taken")
    };
    assert_eq!(err.code(), ErrorCode::RoundClosed, "{err}");
    assert_eq!(e.join(&task, "b").await.round, 2);
}

#[tokio::test]
async fn a_paused_round_does_not_close_and_a_resumed_one_gets_a_whole_deadline() {
    let e = engine();
    let (task, round) = e.with_one_update(1, 2, 1).await;
    e.set_state(&task, TaskState::Paused).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(round.phase(), Phase::Collecting, "closed while paused");
    e.set_state(&task, TaskState::Running).await;
    assert!(
        round.deadline() > super::now_ms() + 500,
        "the resumed round has a whole deadline"
    );
    next_round(&task, &round).await;
    assert_eq!(round.phase(), Phase::Published);
}

#[tokio::test]
async fn stopping_the_task_abandons_its_round_and_opens_none() {
    let e = engine();
    let (task, round) = e.with_one_update(2, 2, 600).await;
    e.set_state(&task, TaskState::Stopped).await;
    assert_eq!(round.phase(), Phase::Abandoned("task stopped".into()));
    assert!(task.current().is_none());
    let refused = e.coordinator.join(&task, "b").await.expect_err("refused");
    assert_eq!(refused.code(), ErrorCode::TaskEnded, "{refused}");
}

impl Engine {
    fn create_async(&self, id: &str, buffer_size: u32, max_staleness: u64) -> Arc<Task> {
        let config: wire::CreateTask = serde_json::from_value(serde_json::json!({
            "id": id, "initial_model": self.digest,
            "model": {"kind": "builtin", "name": "mlp"},
            "rounds": 10, "min_clients": 1, "target_clients": 1, "round_deadline_secs": 600,
            "asynchronous": {"buffer_size": buffer_size, "max_staleness": max_staleness,
                             "concurrency": 4, "staleness": {"kind": "polynomial", "exponent": 1.0}},
        }))
        .unwrap();
        self.coordinator.create_task(config).unwrap();
        self.coordinator.task(id).unwrap()
    }
}

#[tokio::test]
async fn asynchronous_versions_fold_stale_updates_down_weighted_and_refuse_too_stale_ones() {
    let e = engine();
    let task = e.create_async("t", 2, 1);
    let v1 = task.current().unwrap();
    let mut offers = Vec::new();
    for x in ["a", "b", "c", "d"] {
        offers.push(e.join(&task, x).await);
    }
    let [a, b, c, d] = offers.try_into().ok().unwrap();
    assert!(
        e.coordinator
            .join(&task, "e")
            .await
            .unwrap()
            .offer
            .is_none(),
        "four of four slots are taken: pace steering holds the fifth back"
    );
    let stored = e.coordinator.store().open_round("t").unwrap().unwrap();
    let held: Vec<_> = stored.slots.iter().map(|s| s.client.as_str()).collect();
    assert_eq!(
        held,
        ["a", "b", "c", "d"],
        "a slot is durable before its holder hears of it"
    );
    let without = e.upload(&task, "e", &a, 1, [1.0, 0.0, 0.0]).await;
    assert_eq!(
        without.unwrap_err().code(),
        ErrorCode::NotSelected,
        "no training slot, no upload"
    );
    let open = e.coordinator.info(&task).open_round.expect("open");
    assert_eq!(
        (open.selected, open.accepted),
        (4, 0),
        "four training, none in"
    );
    e.upload(&task, "a", &a, 1, [2.0, 0.0, 0.0]).await.unwrap();
    e.upload(&task, "b", &b, 1, [0.0, 2.0, 0.0]).await.unwrap();
    let v2 = next_round(&task, &v1).await;
    assert_eq!(e.global(&task), vec![2.0, 3.0, 3.0], "(a + b) / 2");
    // c trained from version 1: one version stale, weighted (1 + 1)^-1.
    e.upload(&task, "c", &c, 3, [4.0, 0.0, 0.0]).await.unwrap();
    let again = e.join(&task, "a").await;
    assert_eq!(again.round, 2, "a trains again from the current version");
    let dup = e.upload(&task, "a", &a, 1, [2.0, 0.0, 0.0]).await;
    assert_eq!(dup.unwrap_err().code(), ErrorCode::AlreadyContributed);
    e.upload(&task, "a", &again, 1, [0.0, 0.0, 8.0])
        .await
        .unwrap();
    let v3 = next_round(&task, &v2).await;
    // (3 · ½ · c + 1 · a') / (3 + 1)
    assert_eq!(e.global(&task), vec![3.5, 3.0, 5.0]);
    // d trained from version 1, two versions ago: more than max_staleness 1.
    let stale = e.upload(&task, "d", &d, 1, [1.0, 1.0, 1.0]).await;
    assert_eq!(stale.unwrap_err().code(), ErrorCode::TooStale);
    assert_eq!(v3.number, 3);
    let history = e.coordinator.history(&task).unwrap();
    let s = history[1]
        .staleness
        .as_ref()
        .expect("staleness of version 2");
    assert_eq!(
        (s.bases.clone(), s.histogram.clone()),
        (vec![1, 2], vec![1, 1])
    );
    assert_eq!(history[1].participants, ["c", "a"]);
}

#[tokio::test]
async fn a_poll_of_a_paused_task_is_held_until_it_is_resumed() {
    let e = engine();
    let task = e.create("t", 1, 1, 600);
    e.set_state(&task, TaskState::Paused).await;
    let (c, t) = (e.coordinator.clone(), task.clone());
    let poll = tokio::spawn(async move {
        c.poll(t, "a", (None, None), None, Duration::from_secs(20))
            .await
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!poll.is_finished(), "answered while the task is paused");
    let resumed = std::time::Instant::now();
    e.set_state(&task, TaskState::Running).await;
    let answer = poll.await.unwrap();
    assert_eq!(answer.state, TaskState::Running);
    assert_eq!(answer.open_round, Some(1));
    assert!(
        resumed.elapsed() < Duration::from_secs(10),
        "held past the resume"
    );
}

#[tokio::test]
async fn an_abandoned_asynchronous_version_does_not_hold_its_clients_back() {
    let e = engine();
    let task = e.create_async("t", 2, 4);
    let v1 = task.current().unwrap();
    let big = [f32::MAX, 0.0, 0.0];
    for c in ["a", "b"] {
        let offer = e.join(&task, c).await;
        e.upload(&task, c, &offer, 1, big).await.unwrap();
    }
    let v2 = next_round(&task, &v1).await;
    // Version 2's sum would overflow: the version is abandoned and retried.
    let first = e.join(&task, "a").await;
    e.upload(&task, "a", &first, 1, big).await.unwrap();
    let offer = e.join(&task, "b").await;
    let abandoned = e.upload(&task, "b", &offer, 1, big).await;
    assert_eq!(abandoned.unwrap_err().code(), ErrorCode::RoundAbandoned);
    let retry = next_round(&task, &v2).await;
    assert!(
        matches!(v2.phase(), Phase::Abandoned(_)),
        "{:?}",
        v2.phase()
    );
    assert_eq!((retry.number, retry.attempt), (2, 1));
    // Their abandoned updates never counted: both train from version 2 again, sealed to the
    // key the version kept.
    let again = e.join(&task, "a").await;
    assert_eq!((again.round, again.round_key), (2, first.round_key));
    e.upload(&task, "a", &again, 1, [0.0, 1.0, 0.0])
        .await
        .unwrap();
    assert_eq!(e.join(&task, "b").await.round, 2);
}

#[tokio::test]
async fn a_module_digest_that_is_not_64_hex_digits_is_refused_before_it_becomes_a_path() {
    let e = engine();
    for digest in [
        "../../../etc/passwd".to_string(),
        "ab".repeat(31),
        "zz".repeat(32),
        "AB".repeat(32),
    ] {
        let config: wire::CreateTask = serde_json::from_value(serde_json::json!({
            "id": "ts", "initial_model": e.digest,
            "model": {"kind": "torch_script", "module_digest": digest},
            "rounds": 1, "min_clients": 1, "target_clients": 1, "round_deadline_secs": 60,
        }))
        .unwrap();
        let refused = e.coordinator.create_task(config).unwrap_err();
        assert!(
            refused.to_string().contains("64 lowercase hex digits"),
            "{digest}: {refused}"
        );
    }
}

#[tokio::test]
async fn after_its_warm_up_the_adaptive_bound_clips_a_poisoned_update_to_ten_medians() {
    let e = engine();
    // Default bounds: no max_norm, the adaptive factor 10.
    let task = e.create("t", 9, 9, 60);
    let round = task.current().unwrap();
    for client in ["a", "b", "c", "d", "e", "f", "g", "h"] {
        let offer = e.join(&task, client).await;
        e.upload(&task, client, &offer, 1, [1.0, 0.0, 0.0])
            .await
            .unwrap();
    }
    // Eight updates of norm 1 are in: the ninth, of norm ~5e38, is clipped to norm 10.
    let offer = e.join(&task, "z").await;
    e.upload(&task, "z", &offer, 1, [3e38, 3e38, 3e38])
        .await
        .unwrap();
    next_round(&task, &round).await;
    let c = 10.0 / 3f64.sqrt();
    let want = [1.0 + (8.0 + c) / 9.0, 2.0 + c / 9.0, 3.0 + c / 9.0];
    let got = e.global(&task);
    for (g, w) in got.iter().zip(want) {
        assert!((f64::from(*g) - w).abs() < 1e-5, "{got:?} vs {want:?}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_checkpoint_whose_record_may_have_landed_is_kept_until_a_later_one_lands() {
    // A real PostgreSQL server that goes away while a checkpoint's record is written: the
    // checkpoint file stays (the record naming it might have been committed), and goes once
    // the next checkpoint's record lands.
    let mut postgres = crate::store::postgres::test_server::TestServer::start();
    let dir = tempfile::tempdir().unwrap();
    let store: Arc<Store> = Arc::new(
        crate::store::PostgresStore::open(&postgres.url().parse().unwrap(), dir.path()).unwrap(),
    );
    let initial = Model::from_tensors([("w", vec![3], vec![1.0, 2.0, 3.0])]).unwrap();
    let digest = store.put_model(&initial).unwrap();
    let coordinator = Coordinator::open(
        store,
        CoordinatorConfig {
            // Room to stop the database between an upload's fold and its checkpoint.
            commit_window: Duration::from_secs(2),
            ..CoordinatorConfig::default()
        },
        Arc::new(ServerMetrics::default()),
    )
    .unwrap();
    coordinator.start();
    let engine = Engine {
        coordinator,
        initial,
        digest,
    };
    let task = engine.create("t", 3, 3, 600);
    let (a, b) = (engine.join(&task, "a").await, engine.join(&task, "b").await);
    engine
        .upload(&task, "a", &a, 1, [1.0, 0.0, 0.0])
        .await
        .unwrap();
    let checkpoints = || -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir.path().join("checkpoints"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".ckpt"))
            .collect();
        names.sort();
        names
    };
    assert_eq!(checkpoints().len(), 1);

    let uploading = {
        let (engine_task, b) = (task.clone(), b.clone());
        let coordinator = engine.coordinator.clone();
        tokio::spawn(async move {
            let delta = Model::from_tensors([("w", vec![3], vec![0.0, 1.0, 0.0])]).unwrap();
            let binding = Binding {
                task: "t",
                round: b.round,
                client: "b",
                base_model: &b.model,
            };
            let sealed = envelope::seal(&delta.to_safetensors(), &b.round_key, &binding).unwrap();
            let meta = UpdateMeta {
                num_examples: 1,
                metrics: Default::default(),
                contributors: None,
            };
            coordinator
                .upload(
                    engine_task,
                    "b".into(),
                    b.round,
                    meta,
                    UpdateBody::Sealed(sealed),
                    (),
                )
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    postgres.stop();
    let refused = uploading.await.unwrap().unwrap_err();
    assert_eq!(refused.code(), ErrorCode::StoreUnavailable, "{refused}");
    let unsettled = checkpoints();
    assert_eq!(
        unsettled.len(),
        2,
        "the new checkpoint is kept: {unsettled:?}"
    );

    postgres.restart();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        match engine.upload(&task, "b", &b, 1, [0.0, 1.0, 0.0]).await {
            Ok(receipt) => {
                assert_eq!(receipt.accepted, 2);
                break;
            }
            Err(e) => assert!(std::time::Instant::now() < deadline, "{e}"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let settled = checkpoints();
    assert_eq!(settled.len(), 1, "{settled:?}");
    assert!(
        !unsettled.contains(&settled[0]),
        "a new checkpoint, and neither of the others: {unsettled:?} → {settled:?}"
    );
}

impl Engine {
    /// A task of one client per round (or, with `asynchronous`, per version) whose published
    /// models `evaluation` asks clients to evaluate.
    fn create_evaluated(
        &self,
        id: &str,
        evaluation: serde_json::Value,
        asynchronous: bool,
    ) -> Arc<Task> {
        let mut config = serde_json::json!({
            "id": id, "initial_model": self.digest,
            "model": {"kind": "builtin", "name": "mlp"},
            "rounds": 5, "min_clients": 1, "target_clients": 1, "round_deadline_secs": 600,
            "update_bounds": {"max_weight": 100},
            "evaluation": evaluation,
        });
        if asynchronous {
            config["asynchronous"] = serde_json::json!({"buffer_size": 1, "concurrency": 2});
        }
        self.coordinator
            .create_task(serde_json::from_value(config).unwrap())
            .unwrap();
        self.coordinator.task(id).unwrap()
    }

    /// `client` trains the open round (version) alone, which publishes it.
    async fn publish_by(&self, task: &Arc<Task>, client: &str) {
        let round = task.current().unwrap();
        let offer = self.join(task, client).await;
        self.upload(task, client, &offer, 1, [1.0, 0.0, 0.0])
            .await
            .unwrap();
        next_round(task, &round).await;
    }

    fn report(
        &self,
        task: &Task,
        client: &str,
        round: u64,
        (examples, loss, accuracy): (u64, Option<f64>, Option<f64>),
    ) -> Result<wire::EvaluationReceipt, ServerError> {
        let report = wire::EvaluationReport {
            num_examples: examples,
            loss,
            accuracy,
        };
        self.coordinator
            .report_evaluation(task, client, round, &report)
    }
}

fn evaluation_of(e: &Engine, task: &Task, round: u64) -> Option<wire::EvaluationSummary> {
    let attempts = e
        .coordinator
        .store()
        .round_attempts(&task.id, round)
        .unwrap();
    attempts.last().and_then(|r| r.evaluation)
}

#[tokio::test(flavor = "multi_thread")]
async fn an_evaluation_counts_the_clients_it_asks_and_ends_in_its_rounds_history() {
    let e = engine();
    let task = e.create_evaluated(
        "t",
        serde_json::json!({"clients": 2, "held_out": true}),
        false,
    );
    e.publish_by(&task, "a").await;
    // Held out: the client that trained round 1 is not asked; another is.
    assert_eq!(e.coordinator.evaluation_offer(&task, "a"), None);
    let offer = e
        .coordinator
        .evaluation_offer(&task, "b")
        .expect("b is asked");
    assert_eq!((offer.round, offer.model), (1, task.global_model()));
    let refused = e.report(&task, "a", 1, (10, Some(1.0), None)).unwrap_err();
    assert!(
        matches!(refused, ServerError::Forbidden(ref m) if m.contains("trained")),
        "{refused}"
    );
    for bad in [
        (0, Some(1.0), None),
        (5, None, Some(2.0)),
        (5, Some(-1.0), None),
        (5, None, None),
    ] {
        let refused = e.report(&task, "b", 1, bad).unwrap_err();
        assert!(
            matches!(refused, ServerError::BadRequest(_)),
            "{bad:?}: {refused}"
        );
    }
    let wrong = e.report(&task, "b", 2, (10, Some(1.0), None)).unwrap_err();
    assert_eq!(wrong.code(), ErrorCode::EvaluationClosed);
    assert_eq!(
        e.report(&task, "b", 1, (10, Some(1.0), Some(0.5)))
            .unwrap()
            .reports,
        1
    );
    // A repeat (its answer lost) is acknowledged, not counted again; b is asked no more.
    assert_eq!(
        e.report(&task, "b", 1, (10, Some(1.0), Some(0.5)))
            .unwrap()
            .reports,
        1
    );
    assert_eq!(e.coordinator.evaluation_offer(&task, "b"), None);
    assert!(
        evaluation_of(&e, &task, 1).is_none(),
        "open: not in the history yet"
    );
    // The second report completes it: examples past the task's max_weight count as it.
    assert_eq!(
        e.report(&task, "c", 1, (300, Some(2.0), None))
            .unwrap()
            .reports,
        2
    );
    let summary = evaluation_of(&e, &task, 1).expect("ended into round 1's entry");
    assert_eq!((summary.clients, summary.examples), (2, 110));
    assert!((summary.loss.unwrap() - (10.0 + 200.0) / 110.0).abs() < 1e-12);
    assert_eq!(summary.accuracy, Some(0.5), "only b's had one");
    assert!(task.record().evaluating.is_none());
    let late = e.report(&task, "d", 1, (10, Some(1.0), None)).unwrap_err();
    assert_eq!(late.code(), ErrorCode::EvaluationClosed);
    assert_eq!(e.coordinator.evaluation_offer(&task, "d"), None);

    // Round 2's evaluation takes one report, then round 3's publication ends it.
    e.publish_by(&task, "a").await;
    e.report(&task, "b", 2, (4, None, Some(1.0))).unwrap();
    e.publish_by(&task, "a").await;
    let summary = evaluation_of(&e, &task, 2).expect("ended by the next");
    assert_eq!(
        (summary.clients, summary.accuracy, summary.loss),
        (1, Some(1.0), None)
    );
    assert_eq!(task.record().evaluating.map(|e| e.round), Some(3));
}

#[tokio::test(flavor = "multi_thread")]
async fn an_asynchronous_version_is_evaluated_and_an_evaluation_ends_at_its_deadline() {
    let e = engine();
    let evaluation = serde_json::json!({"clients": 5, "deadline_secs": 1, "fraction": 1.0});
    let task = e.create_evaluated("v", evaluation, true);
    e.publish_by(&task, "a").await;
    // Not held out: the client whose update made the version may evaluate it too.
    assert_eq!(
        e.report(&task, "a", 1, (8, Some(0.25), Some(0.75)))
            .unwrap()
            .reports,
        1
    );
    for _ in 0..500 {
        if task.record().evaluating.is_none() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let summary = evaluation_of(&e, &task, 1).expect("ended at its deadline");
    assert_eq!((summary.clients, summary.examples), (1, 8));
    assert_eq!((summary.loss, summary.accuracy), (Some(0.25), Some(0.75)));
    let late = e.report(&task, "b", 1, (10, Some(1.0), None)).unwrap_err();
    assert_eq!(late.code(), ErrorCode::EvaluationClosed);
}
