//! The contracts every [`Storage`] keeps, written once and run against [`SledStore`] (in a
//! temporary directory) and [`MemoryStore`]: `suite!` at the bottom makes one test per case and
//! implementation.

use std::collections::HashSet;
use std::fs;
use std::time::{Duration, SystemTime};

use hora_common::model::{Model, ModelDigest};
use hora_common::wire::{RoundOutcome, RoundRecord, TaskState};
use serde::{Deserialize, Serialize};

use super::*;

/// A store under test, and the way to close and reopen it on the same data.
trait Fixture {
    fn store(&self) -> &dyn Storage;
    /// Closes the store and opens what it wrote (the same store for one kept in memory).
    fn reopen(&mut self);
}

struct Sled {
    dir: tempfile::TempDir,
    store: Option<SledStore>,
}

impl Sled {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let store = Some(SledStore::open(dir.path()).unwrap());
        Sled { dir, store }
    }
}

impl Fixture for Sled {
    fn store(&self) -> &dyn Storage {
        self.store.as_ref().unwrap()
    }

    fn reopen(&mut self) {
        self.store.take().unwrap().flush().unwrap(); // sled allows one opener at a time
        self.store = Some(SledStore::open(self.dir.path()).unwrap());
    }
}

struct Memory(MemoryStore);

impl Fixture for Memory {
    fn store(&self) -> &dyn Storage {
        &self.0
    }

    fn reopen(&mut self) {}
}

fn model(values: [f32; 3]) -> Model {
    Model::from_tensors([("w", vec![3], values.to_vec())]).unwrap()
}

fn task(initial: ModelDigest, published: u64) -> TaskRecord {
    let config = serde_json::from_value(serde_json::json!({
        "id": "t",
        "initial_model": initial.to_hex(),
        "model": {"kind": "builtin", "name": "logreg"},
        "rounds": 10,
        "min_clients": 1,
        "target_clients": 2,
        "round_deadline_secs": 60,
    }))
    .unwrap();
    TaskRecord {
        config,
        spec: model([0.0; 3]).spec(),
        state: TaskState::Running,
        published,
        global_model: initial,
        created_unix_ms: 1,
        strategy_state: None,
        dp: None,
        ended_reason: None,
    }
}

fn open_round(round: u64, checkpoint: Option<&str>) -> OpenRoundRecord {
    OpenRoundRecord {
        round,
        attempt: 0,
        secret: "00".into(),
        base_model: model([0.0; 3]).digest(),
        opened_unix_ms: 2,
        deadline_unix_ms: 3,
        selected: vec!["c1".into()],
        checkpoint: checkpoint.map(|file| CheckpointRecord {
            file: file.into(),
            contributions: vec![Contribution {
                client: "c1".into(),
                examples: 5,
                metrics: Default::default(),
                unclipped: None,
            }],
            total_weight: 5.0,
            noised: false,
        }),
    }
}

fn published(round: u64, attempt: u32, model: Option<ModelDigest>) -> RoundRecord {
    RoundRecord {
        round,
        attempt,
        outcome: RoundOutcome::Published,
        participants: vec!["c1".into()],
        dropped: vec![],
        examples: 5,
        metrics: Default::default(),
        duration_ms: 4,
        model,
        pruned: false,
        privacy: None,
    }
}

fn client(label: &str) -> ClientRecord {
    ClientRecord {
        secret_hash: "h".into(),
        label: Some(label.into()),
        enrolled_unix_ms: 1,
        revoked: false,
        identity_key: None,
        tasks: Some(vec!["t".into()]),
    }
}

fn job(id: &str, generations: u64) -> SyncJobRecord {
    SyncJobRecord {
        id: id.into(),
        world_size: 4,
        token_hash: "h".into(),
        generations,
    }
}

/// What secure aggregation keeps per attempt, as far as the store cares.
#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct SecaggState {
    stage: String,
    sum_file: Option<String>,
}

fn secagg_state(sum_file: Option<&str>) -> SecaggState {
    SecaggState {
        stage: "masked".into(),
        sum_file: sum_file.map(Into::into),
    }
}

// -- cases ---------------------------------------------------------------------------------

fn tasks_are_created_once_and_listed_in_id_order(f: &mut dyn Fixture) {
    let s = f.store();
    let initial = model([1.0; 3]).digest();
    assert!(s.task("b").unwrap().is_none());
    assert!(s.create_task("b", &task(initial, 0)).unwrap());
    assert!(!s.create_task("b", &task(initial, 7)).unwrap());
    assert_eq!(
        s.task("b").unwrap().unwrap().published,
        0,
        "create kept the first"
    );
    s.put_task("b", &task(initial, 3)).unwrap();
    s.put_task("a", &task(initial, 1)).unwrap();
    assert_eq!(s.task("b").unwrap().unwrap().published, 3);
    let published: Vec<(String, u64)> = s
        .tasks()
        .unwrap()
        .into_iter()
        .map(|(id, t)| (id, t.published))
        .collect();
    assert_eq!(published, vec![("a".into(), 1), ("b".into(), 3)]);
    let each = s.tasks_each().unwrap();
    assert_eq!(each.len(), 2);
    assert!(each.iter().all(|(_, t)| t.is_ok()));
    assert_eq!(each[0].0, "a");
}

fn open_rounds_are_kept_per_task(f: &mut dyn Fixture) {
    let s = f.store();
    assert!(s.open_round("t").unwrap().is_none());
    s.put_open_round("t", &open_round(1, None)).unwrap();
    s.put_open_round("t", &open_round(2, Some("x.ckpt")))
        .unwrap();
    let open = s.open_round("t").unwrap().unwrap();
    assert_eq!(open.round, 2);
    assert_eq!(open.checkpoint.unwrap().contributions[0].examples, 5);
    assert!(s.open_round("u").unwrap().is_none());
}

fn finish_round_records_the_round_and_moves_the_task_on(f: &mut dyn Fixture) {
    let s = f.store();
    let m = model([1.0; 3]).digest();
    s.create_task("t", &task(m, 0)).unwrap();
    s.create_task("t2", &task(m, 0)).unwrap();
    s.put_open_round("t", &open_round(1, None)).unwrap();
    s.finish_round(
        "t",
        &task(m, 1),
        &published(1, 0, Some(m)),
        0,
        Some(&open_round(2, None)),
    )
    .unwrap();
    assert_eq!(s.task("t").unwrap().unwrap().published, 1);
    assert_eq!(s.open_round("t").unwrap().unwrap().round, 2);
    assert_eq!(s.history("t").unwrap(), vec![published(1, 0, Some(m))]);
    // History sorts by round then attempt, numerically; each task has its own.
    let abandoned = RoundRecord {
        outcome: RoundOutcome::Abandoned {
            reason: "too few".into(),
        },
        model: None,
        ..published(10, 1, None)
    };
    s.finish_round("t", &task(m, 1), &abandoned, 1, Some(&open_round(10, None)))
        .unwrap();
    s.finish_round(
        "t",
        &task(m, 2),
        &published(2, 0, Some(m)),
        0,
        Some(&open_round(10, None)),
    )
    .unwrap();
    s.finish_round("t", &task(m, 3), &published(10, 2, Some(m)), 2, None)
        .unwrap();
    let rounds: Vec<_> = s
        .history("t")
        .unwrap()
        .iter()
        .map(|r| (r.round, r.attempt))
        .collect();
    assert_eq!(rounds, vec![(1, 0), (2, 0), (10, 1), (10, 2)]);
    assert!(
        s.open_round("t").unwrap().is_none(),
        "no next round: removed"
    );
    assert_eq!(s.task("t").unwrap().unwrap().published, 3);
    assert!(s.history("t2").unwrap().is_empty());
    assert!(s.history("").unwrap().is_empty());
}

fn pruning_drops_models_out_of_retention_unless_still_used(f: &mut dyn Fixture) {
    let s = f.store();
    let initial = s.put_model(&model([0.0; 3])).unwrap();
    let models: Vec<_> = (1..=6)
        .map(|i| s.put_model(&model([i as f32; 3])).unwrap())
        .collect();
    // Another task's global model is round 1's: that file must stay.
    s.put_task("other", &task(models[0], 0)).unwrap();
    // Rounds 1 to 5 publish a model each; round 6 goes back to the initial model.
    let mut t = task(initial, 0);
    for (i, m) in models.iter().enumerate().take(5) {
        t.published = i as u64 + 1;
        t.global_model = *m;
        s.finish_round("t", &t, &published(i as u64 + 1, 0, Some(*m)), 0, None)
            .unwrap();
    }
    t.published = 6;
    t.global_model = initial;
    s.finish_round("t", &t, &published(6, 0, Some(initial)), 0, None)
        .unwrap();
    let keep_two = Retention { last: 2, every: 0 };
    // Rounds 1 to 4 fall out; round 1's model is the other task's, so 2, 3 and 4 go.
    assert_eq!(s.prune_models("t", keep_two, 6).unwrap(), 3);
    let pruned: Vec<_> = s.history("t").unwrap().iter().map(|r| r.pruned).collect();
    assert_eq!(pruned, vec![true, true, true, true, false, false]);
    for (i, m) in models.iter().enumerate() {
        assert_eq!(
            s.model_path(m).exists(),
            ![1, 2, 3].contains(&i),
            "round {}",
            i + 1
        );
    }
    assert!(s.model_path(&initial).exists());
    // Already pruned rounds are not counted again.
    assert_eq!(s.prune_models("t", keep_two, 6).unwrap(), 0);
    // Retention that keeps everything prunes nothing.
    assert_eq!(
        s.prune_models("other", Retention { last: 0, every: 0 }, 6)
            .unwrap(),
        0
    );
}

fn clients_are_read_back_in_id_order(f: &mut dyn Fixture) {
    let s = f.store();
    assert!(s.client("c").unwrap().is_none());
    s.put_client("c2", &client("two")).unwrap();
    s.put_client("c1", &client("one")).unwrap();
    let mut revoked = client("one");
    revoked.revoked = true;
    s.put_client("c1", &revoked).unwrap();
    assert!(s.client("c1").unwrap().unwrap().revoked);
    let all: Vec<_> = s
        .clients()
        .unwrap()
        .into_iter()
        .map(|(id, c)| (id, c.label.unwrap()))
        .collect();
    assert_eq!(
        all,
        vec![("c1".into(), "one".into()), ("c2".into(), "two".into())]
    );
}

fn enrolment_tokens_work_once(f: &mut dyn Fixture) {
    let s = f.store();
    let enrolment = EnrolmentRecord {
        expires_unix_ms: 5,
        tasks: Some(vec!["t".into()]),
    };
    s.put_enrolment("h", &enrolment).unwrap();
    s.put_enrolment("other", &enrolment).unwrap();
    let taken = s.take_enrolment("h").unwrap().unwrap();
    assert_eq!(
        (taken.expires_unix_ms, taken.tasks),
        (5, Some(vec!["t".into()]))
    );
    assert!(s.take_enrolment("h").unwrap().is_none());
    assert!(s.take_enrolment("never").unwrap().is_none());
    assert!(s.take_enrolment("other").unwrap().is_some());
}

fn sync_jobs_are_created_once_updated_and_removed(f: &mut dyn Fixture) {
    let s = f.store();
    let mut ring = job("ring", 0);
    assert!(s.create_sync_job(&ring).unwrap());
    assert!(!s.create_sync_job(&job("ring", 9)).unwrap());
    assert_eq!(
        s.sync_jobs().unwrap(),
        vec![ring.clone()],
        "create kept the first"
    );
    ring.generations = 3;
    s.put_sync_job(&ring).unwrap();
    s.put_sync_job(&job("a", 1)).unwrap();
    assert_eq!(s.sync_jobs().unwrap(), vec![job("a", 1), ring]);
    assert!(s.remove_sync_job("ring").unwrap());
    assert!(!s.remove_sync_job("ring").unwrap());
    assert!(s.remove_sync_job("a").unwrap());
    assert!(s.sync_jobs().unwrap().is_empty());
}

fn secagg_records_are_scanned_by_prefix_and_cleared_per_task(f: &mut dyn Fixture) {
    let s = f.store();
    assert!(s.secagg_get::<SecaggState>("t\0state\0").unwrap().is_none());
    s.secagg_put("t\0state\0", &secagg_state(None)).unwrap();
    s.secagg_put("t\0adv\0c2", &2u32).unwrap();
    s.secagg_put("t\0adv\0c1", &1u32).unwrap();
    s.secagg_put("t\0mail\0c1", &3u32).unwrap();
    s.secagg_put("t2\0adv\0c1", &4u32).unwrap();
    assert_eq!(
        s.secagg_get::<SecaggState>("t\0state\0").unwrap(),
        Some(secagg_state(None))
    );
    assert_eq!(
        s.secagg_scan::<u32>("t\0adv\0").unwrap(),
        vec![("c1".into(), 1), ("c2".into(), 2)]
    );
    assert_eq!(
        s.secagg_scan_bytes("t\0mail\0").unwrap(),
        vec![("c1".into(), b"3".to_vec())]
    );
    // A record that is not what the reader expects is corrupt, not a panic.
    s.secagg_put_bytes("t\0unmask\0c1", b"not json").unwrap();
    assert!(matches!(
        s.secagg_scan::<u32>("t\0unmask\0"),
        Err(StoreError::Corrupt { .. })
    ));
    assert!(matches!(
        s.secagg_get::<SecaggState>("t\0adv\0c1"),
        Err(StoreError::Corrupt { .. })
    ));
    // Clearing `t` leaves `t2` (whose id `t` is a prefix of).
    s.secagg_clear("t").unwrap();
    assert!(s.secagg_scan_bytes("t\0").unwrap().is_empty());
    assert_eq!(
        s.secagg_scan::<u32>("t2\0adv\0").unwrap(),
        vec![("c1".into(), 4)]
    );
}

fn meta_is_kept(f: &mut dyn Fixture) {
    let s = f.store();
    assert!(s.meta("admin_token_hash").unwrap().is_none());
    s.put_meta("admin_token_hash", "h1").unwrap();
    s.put_meta("admin_token_hash", "h2").unwrap();
    assert_eq!(s.meta("admin_token_hash").unwrap().as_deref(), Some("h2"));
}

fn models_and_modules_are_content_addressed(f: &mut dyn Fixture) {
    let s = f.store();
    let m = model([1.0, 2.0, 3.0]);
    let d = s.put_model(&m).unwrap();
    assert_eq!(d, m.digest());
    assert_eq!(s.put_model(&m).unwrap(), d, "storing again is a no-op");
    assert_eq!(s.read_model(&d).unwrap(), m);
    assert_eq!(s.model_bytes(&d).unwrap(), m.to_safetensors());
    assert_eq!(fs::read(s.model_path(&d)).unwrap(), m.to_safetensors());
    let other = model([4.0; 3]);
    s.put_model_bytes(&other.digest(), &other.to_safetensors())
        .unwrap();
    assert_eq!(s.read_model(&other.digest()).unwrap(), other);
    assert!(s.model_bytes(&model([9.0; 3]).digest()).is_err());
    assert!(s.read_model(&model([9.0; 3]).digest()).is_err());

    let module = b"torchscript archive".as_slice();
    let hex = s.put_module(module).unwrap();
    assert_eq!(hex, hora_common::sha256_hex(module));
    assert_eq!(s.put_module(module).unwrap(), hex);
    assert_eq!(fs::read(s.module_path(&hex)).unwrap(), module);
    assert!(!s.module_path(&"0".repeat(64)).exists());
}

fn checkpoints_and_masked_sums_round_trip(f: &mut dyn Fixture) {
    let s = f.store();
    let sum = [1.5, -2.0, 1e300];
    let ckpt = s.write_checkpoint(&sum).unwrap();
    assert!(ckpt.ends_with(".ckpt"));
    assert_eq!(
        s.write_checkpoint(&sum).unwrap(),
        ckpt,
        "equal contents, equal names"
    );
    assert_ne!(s.write_checkpoint(&[1.5, -2.0, 0.0]).unwrap(), ckpt);
    assert_eq!(s.read_checkpoint(&ckpt, 3).unwrap(), sum);
    assert!(matches!(
        s.read_checkpoint(&ckpt, 4),
        Err(StoreError::Corrupt { .. })
    ));
    let empty = s.write_checkpoint(&[]).unwrap();
    assert!(s.read_checkpoint(&empty, 0).unwrap().is_empty());
    // A large sum crosses the pieces it is written and read in.
    let big: Vec<f64> = (0..300_000).map(|i| i as f64 / 7.0).collect();
    let big_file = s.write_checkpoint(&big).unwrap();
    assert_eq!(s.read_checkpoint(&big_file, big.len()).unwrap(), big);
    s.remove_checkpoint(&ckpt);
    assert!(s.read_checkpoint(&ckpt, 3).is_err());
    s.remove_checkpoint(&ckpt); // twice: nothing to do

    let masked = [0, 1, u32::MAX];
    let msum = s.write_masked_sum(&masked).unwrap();
    assert!(msum.ends_with(".msum"));
    assert_eq!(s.write_masked_sum(&masked).unwrap(), msum);
    assert_eq!(s.read_masked_sum(&msum, 3).unwrap(), masked);
    assert!(matches!(
        s.read_masked_sum(&msum, 2),
        Err(StoreError::Corrupt { .. })
    ));
    s.remove_checkpoint(&msum);
    assert!(s.read_masked_sum(&msum, 3).is_err());
}

fn strategy_states_are_removed_by_valid_name_only(f: &mut dyn Fixture) {
    let s = f.store();
    let dir = s.strategy_state_dir();
    let name = format!("{}.state", "a".repeat(64));
    fs::write(dir.join(&name), b"state").unwrap();
    fs::write(dir.join("notes.txt"), b"operator's").unwrap();
    s.remove_strategy_state("notes.txt");
    s.remove_strategy_state("../notes.txt");
    assert!(dir.join("notes.txt").exists());
    s.remove_strategy_state(&name);
    assert!(!dir.join(&name).exists());
    s.remove_strategy_state(&name); // twice: nothing to do
}

fn the_sweep_removes_what_no_record_refers_to(f: &mut dyn Fixture) {
    let s = f.store();
    // Referred to: the task's initial and global models, a retained round's model, its
    // module, its strategy state, its open round's checkpoint, its secagg attempt's sum.
    let initial = s.put_model(&model([0.0; 3])).unwrap();
    let global = s.put_model(&model([1.0; 3])).unwrap();
    let retained = s.put_model(&model([2.0; 3])).unwrap();
    let module = s.put_module(b"module").unwrap();
    let state = format!("{}.state", "b".repeat(64));
    fs::write(s.strategy_state_dir().join(&state), b"state").unwrap();
    let ckpt = s.write_checkpoint(&[1.0]).unwrap();
    let msum = s.write_masked_sum(&[1]).unwrap();
    let mut t = task(initial, 2);
    t.global_model = global;
    t.strategy_state = Some(state.clone());
    t.config.model = hora_common::wire::ModelKind::TorchScript {
        module_digest: module.clone(),
    };
    s.put_task("t", &t).unwrap();
    s.finish_round(
        "t",
        &t,
        &published(1, 0, Some(retained)),
        0,
        Some(&open_round(3, Some(&ckpt))),
    )
    .unwrap();
    s.secagg_put("t\0state\0", &secagg_state(Some(&msum)))
        .unwrap();
    // Not referred to: a pruned round's model (stale), an unused model an admin uploaded
    // today (kept for a day), another that is stale, a stale module, an older state, a
    // checkpoint and masked sum of nothing, and a temporary file.
    let pruned = s.put_model(&model([3.0; 3])).unwrap();
    let mut pruned_round = published(2, 0, Some(pruned));
    pruned_round.pruned = true;
    s.finish_round("t", &t, &pruned_round, 0, Some(&open_round(3, Some(&ckpt))))
        .unwrap();
    let fresh = s.put_model(&model([4.0; 3])).unwrap();
    let stale = s.put_model(&model([5.0; 3])).unwrap();
    let stale_module = s.put_module(b"old module").unwrap();
    let yesterday = SystemTime::now() - Duration::from_secs(2 * 86_400);
    for path in [
        s.model_path(&pruned),
        s.model_path(&stale),
        s.module_path(&stale_module),
    ] {
        fs::File::options()
            .write(true)
            .open(path)
            .unwrap()
            .set_modified(yesterday)
            .unwrap();
    }
    let old_state = format!("{}.state", "c".repeat(64));
    fs::write(s.strategy_state_dir().join(&old_state), b"old").unwrap();
    fs::write(s.strategy_state_dir().join(".tmp-1-2"), b"torn").unwrap();
    let orphan_ckpt = s.write_checkpoint(&[2.0]).unwrap();
    let orphan_msum = s.write_masked_sum(&[2]).unwrap();

    assert_eq!(s.sweep_orphans().unwrap(), 7);
    for kept in [initial, global, retained, fresh] {
        assert!(s.model_path(&kept).exists());
    }
    for gone in [pruned, stale] {
        assert!(!s.model_path(&gone).exists());
    }
    assert!(s.module_path(&module).exists());
    assert!(!s.module_path(&stale_module).exists());
    let states: HashSet<_> = fs::read_dir(s.strategy_state_dir())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(states, HashSet::from([state]));
    assert!(s.read_checkpoint(&ckpt, 1).is_ok());
    assert!(s.read_masked_sum(&msum, 1).is_ok());
    assert!(s.read_checkpoint(&orphan_ckpt, 1).is_err());
    assert!(s.read_masked_sum(&orphan_msum, 1).is_err());
    assert_eq!(s.sweep_orphans().unwrap(), 0, "nothing left to sweep");
}

fn everything_written_is_there_after_reopening(f: &mut dyn Fixture) {
    let s = f.store();
    let m = s.put_model(&model([1.0; 3])).unwrap();
    let module = s.put_module(b"module").unwrap();
    let ckpt = s.write_checkpoint(&[0.5, 0.25]).unwrap();
    let msum = s.write_masked_sum(&[7, 8]).unwrap();
    s.put_task("t", &task(m, 0)).unwrap();
    s.finish_round(
        "t",
        &task(m, 1),
        &published(1, 0, Some(m)),
        0,
        Some(&open_round(2, Some(&ckpt))),
    )
    .unwrap();
    s.put_client("c1", &client("one")).unwrap();
    s.put_enrolment(
        "h",
        &EnrolmentRecord {
            expires_unix_ms: 9,
            tasks: None,
        },
    )
    .unwrap();
    s.put_sync_job(&job("ring", 2)).unwrap();
    s.secagg_put("t\0state\0", &secagg_state(Some(&msum)))
        .unwrap();
    s.put_meta("admin_token_hash", "h").unwrap();
    s.flush().unwrap();

    f.reopen();
    let s = f.store();
    assert_eq!(s.task("t").unwrap().unwrap().published, 1);
    assert_eq!(s.history("t").unwrap(), vec![published(1, 0, Some(m))]);
    let open = s.open_round("t").unwrap().unwrap();
    assert_eq!(open.checkpoint.unwrap().file, ckpt);
    assert_eq!(s.read_checkpoint(&ckpt, 2).unwrap(), [0.5, 0.25]);
    assert_eq!(s.read_masked_sum(&msum, 2).unwrap(), [7, 8]);
    assert_eq!(s.read_model(&m).unwrap(), model([1.0; 3]));
    assert!(s.module_path(&module).exists());
    assert_eq!(
        s.client("c1").unwrap().unwrap().label.as_deref(),
        Some("one")
    );
    assert_eq!(s.take_enrolment("h").unwrap().unwrap().expires_unix_ms, 9);
    assert_eq!(s.sync_jobs().unwrap(), vec![job("ring", 2)]);
    assert_eq!(
        s.secagg_get::<SecaggState>("t\0state\0").unwrap(),
        Some(secagg_state(Some(&msum)))
    );
    assert_eq!(s.meta("admin_token_hash").unwrap().as_deref(), Some("h"));
    // A taken enrolment stays taken.
    f.reopen();
    assert!(f.store().take_enrolment("h").unwrap().is_none());
}

fn stores_are_shared_across_threads(f: &mut dyn Fixture) {
    let s = f.store();
    std::thread::scope(|scope| {
        for i in 0..4 {
            scope.spawn(move || {
                for j in 0..25 {
                    s.put_client(&format!("c{i}-{j:02}"), &client("x")).unwrap();
                    s.create_sync_job(&job("once", i)).unwrap();
                }
            });
        }
    });
    assert_eq!(s.clients().unwrap().len(), 100);
    assert_eq!(s.sync_jobs().unwrap().len(), 1);
}

macro_rules! suite {
    ($($case:ident),* $(,)?) => {
        mod sled_store {
            $(#[test]
            fn $case() {
                super::$case(&mut super::Sled::new())
            })*
        }

        mod memory_store {
            $(#[test]
            fn $case() {
                super::$case(&mut super::Memory(super::MemoryStore::new().unwrap()))
            })*
        }
    };
}

suite!(
    tasks_are_created_once_and_listed_in_id_order,
    open_rounds_are_kept_per_task,
    finish_round_records_the_round_and_moves_the_task_on,
    pruning_drops_models_out_of_retention_unless_still_used,
    clients_are_read_back_in_id_order,
    enrolment_tokens_work_once,
    sync_jobs_are_created_once_updated_and_removed,
    secagg_records_are_scanned_by_prefix_and_cleared_per_task,
    meta_is_kept,
    models_and_modules_are_content_addressed,
    checkpoints_and_masked_sums_round_trip,
    strategy_states_are_removed_by_valid_name_only,
    the_sweep_removes_what_no_record_refers_to,
    everything_written_is_there_after_reopening,
    stores_are_shared_across_threads,
);
