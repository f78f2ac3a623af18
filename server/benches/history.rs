//! What a publication costs the store as the round history grows: the round's record, then the
//! retention's prune (which judges the rounds falling out of the window and deletes their
//! models unless some record still names them), at the 10th and at the 100,000th version of a
//! task, measured in the same run. Before the model index and the incremental prune, the second
//! read every history entry of every task at every publication.
//!
//! `make bench` (or `cargo bench -p hora-server --bench history`).

use std::time::{Duration, Instant};

use hora_common::model::{Model, ModelDigest, ModelSpec};
use hora_common::wire::{
    CreateTask, ModelKind, RoundOutcome, RoundRecord, StrategyConfig, TaskState, TrainingConfig,
};
use hora_server::store::{Blobs, Retention, RoundLog, SledStore, TaskRecord};

fn record(round: u64, model: ModelDigest) -> RoundRecord {
    RoundRecord {
        contributors: None,
        forwarded_to: None,
        round,
        attempt: 0,
        outcome: RoundOutcome::Published,
        participants: vec!["c-0123456789abcdef".into(); 10],
        dropped: vec![],
        examples: 100,
        metrics: Default::default(),
        duration_ms: 5,
        model: Some(model),
        pruned: false,
        privacy: None,
        staleness: None,
        compacted: None,
        evaluation: None,
    }
}

/// Task `t`'s record after round `published`, whose model is `global`.
fn task(global: ModelDigest, spec: ModelSpec, published: u64) -> TaskRecord {
    TaskRecord {
        parent: None,
        config: CreateTask {
            parent: None,
            trainable: None,
            evaluation: None,
            compression: None,
            id: "t".into(),
            initial_model: global,
            model: ModelKind::Builtin {
                name: "mlp".into(),
                params: Default::default(),
            },
            strategy: StrategyConfig::FedAvg,
            rounds: 1_000_000,
            min_clients: 1,
            target_clients: 1,
            over_selection: 0.0,
            round_deadline_secs: 60,
            training: TrainingConfig::default(),
            secure_aggregation: None,
            update_bounds: Default::default(),
            differential_privacy: None,
            asynchronous: None,
        },
        spec,
        state: TaskState::Running,
        published,
        global_model: global,
        created_unix_ms: 0,
        strategy_state: None,
        dp: None,
        ended_reason: None,
        part: None,
        evaluating: None,
    }
}

/// Records round `round` of task `t`, published with model `digest`.
fn finish(store: &SledStore, round: u64, digest: ModelDigest, spec: ModelSpec) {
    store
        .finish_round(
            "t",
            &task(digest, spec, round),
            &record(round, digest),
            0,
            None,
        )
        .expect("finish");
}

/// Publishes rounds `from..=to` of task `t`, each with its own small model, and prunes after
/// each; the mean time of one publication's record and prune.
fn publish(store: &SledStore, from: u64, to: u64) -> Duration {
    let mut spent = Duration::ZERO;
    for round in from..=to {
        let model = Model::from_tensors([("w", vec![4], vec![round as f32; 4])]).expect("model");
        let digest = store.put_model(&model).expect("model file");
        let started = Instant::now();
        finish(store, round, digest, model.spec());
        store.prune_models("t", RETENTION, round).expect("prune");
        spent += started.elapsed();
    }
    spent / (to - from + 1) as u32
}

/// Keeps the last 5 models: from the 6th publication on, each prunes one (and deletes its file)
/// and compacts one history entry (the last 5 keep their participants).
const RETENTION: Retention = Retention {
    last: 5,
    every: 0,
    detail: 5,
};

fn main() {
    // `cargo test`/`nextest` list and run bench targets without `--bench`: nothing to do then.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let store = SledStore::open(dir.path()).expect("store");
    publish(&store, 1, 5);
    let early = publish(&store, 6, 10);
    // The history up to version 99,985, recorded as rounds are (model files aside: the
    // records name them, and pruning finds them gone), then one prune that catches up with all
    // of it, as the first publication after a restart with a new retention does.
    let filled = Instant::now();
    let spec = Model::from_tensors([("w", vec![4], vec![0.0; 4])])
        .expect("model")
        .spec();
    for round in 11..=99_985u64 {
        let digest = ModelDigest::from_hex(&format!("{round:064x}")).expect("a digest");
        finish(&store, round, digest, spec.clone());
    }
    let caught_up = Instant::now();
    store.prune_models("t", RETENTION, 99_985).expect("prune");
    // The last five with their model files, which the timed publications prune.
    publish(&store, 99_986, 99_990);
    println!(
        "history: 99,975 versions recorded in {:.1} s; the catch-up prune over all of them {:.0} ms",
        filled.elapsed().as_secs_f64(),
        caught_up.elapsed().as_secs_f64() * 1e3
    );
    let late = publish(&store, 99_991, 100_000);
    println!(
        "history: a publication's record and prune (one model out of the last 5) at versions 6-10: {:.1} µs; at 99,991-100,000: {:.1} µs; ratio {:.2} (target: about 1; a prune that reads the whole history costs about the catch-up's time)",
        early.as_secs_f64() * 1e6,
        late.as_secs_f64() * 1e6,
        late.as_secs_f64() / early.as_secs_f64()
    );
    // What an entry costs the store with its detail (10 participants here) and compacted.
    let size = |round| {
        let entries = store.round_attempts("t", round).expect("history");
        serde_json::to_vec(&entries[0]).expect("json").len()
    };
    println!(
        "history: an entry with its 10 participants {} bytes, compacted {} bytes",
        size(100_000),
        size(99_990)
    );
}
