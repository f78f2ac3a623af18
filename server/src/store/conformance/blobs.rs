//! Blobs' cases, the orphan sweep, and reopening.

use std::collections::HashSet;
use std::fs;
use std::time::{Duration, SystemTime};

use super::*;

pub(super) fn models_and_modules_are_content_addressed(f: &mut dyn Fixture) {
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

pub(super) fn checkpoints_and_masked_sums_round_trip(f: &mut dyn Fixture) {
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

pub(super) fn strategy_states_are_removed_by_valid_name_only(f: &mut dyn Fixture) {
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

pub(super) fn the_sweep_removes_what_no_record_refers_to(f: &mut dyn Fixture) {
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

pub(super) fn everything_written_is_there_after_reopening(f: &mut dyn Fixture) {
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
    assert_eq!(s.enrolment("h").unwrap().unwrap().expires_unix_ms, 9);
    assert!(s.enrol("h", "c9", &client("nine")).unwrap().is_some());
    assert_eq!(s.sync_jobs().unwrap(), vec![job("ring", 2)]);
    assert_eq!(
        s.secagg_get::<SecaggState>("t\0state\0").unwrap(),
        Some(secagg_state(Some(&msum)))
    );
    assert_eq!(s.meta("admin_token_hash").unwrap().as_deref(), Some("h"));
    // A taken enrolment stays taken, and its client stays.
    f.reopen();
    assert!(f.store().enrolment("h").unwrap().is_none());
    assert!(f.store().client("c9").unwrap().is_some());
}
