//! Blobs' cases, the orphan sweep, and reopening.

use std::collections::HashSet;
use std::io::{Read, Write};

use futures_util::TryStreamExt;

use super::*;

/// The names of the blobs of `kind`.
fn names(s: &dyn Storage, kind: BlobKind) -> HashSet<String> {
    s.blobs()
        .list(kind)
        .unwrap()
        .into_iter()
        .map(|(name, _)| name)
        .collect()
}

/// Writes blob `name` of `kind` with `bytes` as it is (not through a typed helper).
fn plant(s: &dyn Storage, kind: BlobKind, name: &str, bytes: &[u8]) {
    let mut w = s.blobs().writer(kind, name).unwrap();
    w.write_all(bytes).unwrap();
    w.commit().unwrap();
}

fn read(
    s: &dyn Storage,
    kind: BlobKind,
    name: &str,
    range: Option<std::ops::Range<u64>>,
) -> Vec<u8> {
    let mut bytes = Vec::new();
    s.blobs()
        .reader(kind, name, range)
        .unwrap()
        .read_to_end(&mut bytes)
        .unwrap();
    bytes
}

pub(super) fn models_and_modules_are_content_addressed(f: &mut dyn Fixture) {
    let s = f.store();
    let m = model([1.0, 2.0, 3.0]);
    let d = s.put_model(&m).unwrap();
    assert_eq!(d, m.digest());
    assert_eq!(s.put_model(&m).unwrap(), d, "storing again is a no-op");
    assert_eq!(s.read_model(&d).unwrap(), m);
    assert_eq!(s.model_bytes(&d).unwrap(), m.to_safetensors());
    assert!(s.has_model(&d).unwrap());
    assert!(!s.has_model(&model([9.0; 3]).digest()).unwrap());
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
    assert_eq!(
        read(s, BlobKind::Module, &format!("{hex}.pt"), None),
        module
    );
    assert!(s.has_module(&hex).unwrap());
    assert!(!s.has_module(&"0".repeat(64)).unwrap());
    assert!(
        !s.has_module("../../blobs/models/x").unwrap(),
        "no way out of the folder"
    );
}

pub(super) fn checkpoints_and_masked_sums_round_trip(f: &mut dyn Fixture) {
    let s = f.store();
    let sum = [1.5, -2.0, 1e300];
    let ckpt = s.write_checkpoint(&sum).unwrap();
    assert!(ckpt.ends_with(".ckpt"));
    let again = s.write_checkpoint(&sum).unwrap();
    assert_ne!(again, ckpt, "every checkpoint has a name of its own");
    assert_eq!(s.read_checkpoint(&again, 3).unwrap(), sum);
    s.remove_checkpoint(&again);
    assert_eq!(s.read_checkpoint(&ckpt, 3).unwrap(), sum, "not the other's");
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
    // A replica's partial of the same sum: a name of each write's own, read as a masked sum;
    // removing one leaves the other.
    let (p1, p2) = (
        s.write_masked_partial(&masked).unwrap(),
        s.write_masked_partial(&masked).unwrap(),
    );
    assert!(p1 != p2 && p1.ends_with(".msum"), "{p1} {p2}");
    assert!(matches!(
        s.read_masked_sum(&p1, 2),
        Err(StoreError::Corrupt { .. })
    ));
    s.remove_checkpoint(&p1);
    assert!(s.read_masked_sum(&p1, 3).is_err());
    assert_eq!(s.read_masked_sum(&p2, 3).unwrap(), masked);
}

pub(super) fn strategy_states_are_removed_by_valid_name_only(f: &mut dyn Fixture) {
    let s = f.store();
    let name = format!("{}.state", "a".repeat(64));
    plant(s, BlobKind::StrategyState, &name, b"state");
    plant(s, BlobKind::StrategyState, "notes.txt", b"operator's");
    s.remove_strategy_state("notes.txt");
    s.remove_strategy_state("../notes.txt");
    assert!(s
        .blobs()
        .head(BlobKind::StrategyState, "notes.txt")
        .unwrap()
        .is_some());
    s.remove_strategy_state(&name);
    assert!(s
        .blobs()
        .head(BlobKind::StrategyState, &name)
        .unwrap()
        .is_none());
    s.remove_strategy_state(&name); // twice: nothing to do
}

pub(super) fn the_sweep_removes_what_no_record_refers_to(f: &mut dyn Fixture) {
    let s = f.store();
    // Referred to: the task's initial and global models, a retained round's model, its
    // module, its strategy state, its open round's checkpoint, its secagg attempt's sums.
    let initial = s.put_model(&model([0.0; 3])).unwrap();
    let global = s.put_model(&model([1.0; 3])).unwrap();
    let retained = s.put_model(&model([2.0; 3])).unwrap();
    let module = s.put_module(b"module").unwrap();
    let state = format!("{}.state", "b".repeat(64));
    plant(s, BlobKind::StrategyState, &state, b"state");
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
    // (A replica's masked partial sum of the attempt: a record of the same shape.)
    let part = s.write_masked_sum(&[3]).unwrap();
    s.secagg_put("t\0part\0r1", &secagg_state(Some(&part)))
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
    let old_state = format!("{}.state", "c".repeat(64));
    plant(s, BlobKind::StrategyState, &old_state, b"old");
    plant(s, BlobKind::StrategyState, ".tmp-1-2", b"torn");
    let orphan_ckpt = s.write_checkpoint(&[2.0]).unwrap();
    let orphan_msum = s.write_masked_sum(&[2]).unwrap();
    // Everything but the fresh upload was written two days ago (a store other servers share
    // spares any blob written in the last hour: one may be about to record it).
    for kind in BlobKind::ALL {
        for name in names(s, kind) {
            if name != format!("{}.safetensors", fresh.to_hex()) {
                f.backdate(kind, &name);
            }
        }
    }

    assert_eq!(s.sweep_orphans().unwrap(), 7);
    for kept in [initial, global, retained, fresh] {
        assert!(s.has_model(&kept).unwrap());
    }
    for gone in [pruned, stale] {
        assert!(!s.has_model(&gone).unwrap());
    }
    assert!(s.has_module(&module).unwrap());
    assert!(!s.has_module(&stale_module).unwrap());
    assert_eq!(names(s, BlobKind::StrategyState), HashSet::from([state]));
    assert!(s.read_checkpoint(&ckpt, 1).is_ok());
    assert!(s.read_masked_sum(&msum, 1).is_ok());
    assert!(s.read_masked_sum(&part, 1).is_ok());
    assert!(s.read_checkpoint(&orphan_ckpt, 1).is_err());
    assert!(s.read_masked_sum(&orphan_msum, 1).is_err());
    assert_eq!(s.sweep_orphans().unwrap(), 0, "nothing left to sweep");
    // A checkpoint of nothing written just now: an object store spares it for an hour (a write
    // whose record is about to follow), a store of this server's own does not.
    let young = s.write_checkpoint(&[3.0]).unwrap();
    let shared = s.blobs().shared();
    assert_eq!(s.sweep_orphans().unwrap(), usize::from(!shared));
    assert_eq!(s.read_checkpoint(&young, 1).is_ok(), shared);
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
            aggregator: false,
            max_contributors: None,
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
    assert!(s.has_module(&module).unwrap());
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

pub(super) fn blobs_stream_in_ranges_and_large_ones_in_parts(f: &mut dyn Fixture) {
    let s = f.store();
    // Past an object store's single put (8 MiB): a multipart upload of several parts, written
    // in pieces of odd sizes.
    let big: Vec<u8> = (0..20_000_003u32).map(|i| (i % 251) as u8).collect();
    let name = format!("{}.safetensors", hora_common::sha256_hex(&big));
    let mut w = s.blobs().writer(BlobKind::Model, &name).unwrap();
    for piece in big.chunks(3_000_017) {
        w.write_all(piece).unwrap();
    }
    w.commit().unwrap();
    let meta = s.blobs().head(BlobKind::Model, &name).unwrap().unwrap();
    assert_eq!(meta.len, big.len() as u64);
    assert!(
        read(s, BlobKind::Model, &name, None) == big,
        "read back whole"
    );
    assert_eq!(
        read(s, BlobKind::Model, &name, Some(9_000_000..9_000_100)),
        big[9_000_000..9_000_100]
    );
    // The same as a stream, as a download reads it (polled on a runtime of its own).
    let blob = s
        .blobs()
        .stream(BlobKind::Model, &name, Some(100..8_400_000))
        .unwrap();
    assert_eq!((blob.len, blob.total), (8_399_900, big.len() as u64));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let chunks: Vec<bytes::Bytes> = runtime.block_on(blob.stream.try_collect()).unwrap();
    assert!(chunks.concat() == big[100..8_400_000], "streamed range");
    // A blob is under its name once committed, not before.
    let mut w = s
        .blobs()
        .writer(BlobKind::StrategyState, "late.state")
        .unwrap();
    w.write_all(&big[..10_000_000]).unwrap();
    assert!(s
        .blobs()
        .head(BlobKind::StrategyState, "late.state")
        .unwrap()
        .is_none());
    w.commit().unwrap();
    assert_eq!(
        read(s, BlobKind::StrategyState, "late.state", Some(0..10)),
        big[..10]
    );
    assert_eq!(
        names(s, BlobKind::StrategyState),
        HashSet::from(["late.state".to_string()])
    );
    // Nothing outside a kind's folder is reachable.
    assert!(s
        .blobs()
        .reader(BlobKind::Model, "../checkpoints/x", None)
        .is_err());
    assert!(s.blobs().head(BlobKind::Model, "a/b").unwrap().is_none());
    assert!(s
        .blobs()
        .reader(BlobKind::Model, "missing.safetensors", None)
        .is_err());
}

pub(super) fn a_blob_is_created_once(f: &mut dyn Fixture) {
    let s = f.store();
    // Servers creating one blob at once: exactly one writes it, and it is that one's.
    let racers = if f.creates_atomically() { 4 } else { 1 };
    let created: Vec<(bool, u8)> = std::thread::scope(|scope| {
        let racers: Vec<_> = (0..racers)
            .map(|i| {
                scope.spawn(move || {
                    let wrote = s.blobs().create(BlobKind::Meta, "once", &[i; 64]).unwrap();
                    (wrote, i)
                })
            })
            .collect();
        racers.into_iter().map(|r| r.join().unwrap()).collect()
    });
    let winners: Vec<u8> = created.iter().filter(|c| c.0).map(|c| c.1).collect();
    assert_eq!(winners.len(), 1, "{created:?}");
    assert_eq!(read(s, BlobKind::Meta, "once", None), [winners[0]; 64]);
    assert!(!s.blobs().create(BlobKind::Meta, "once", b"late").unwrap());
    assert_eq!(read(s, BlobKind::Meta, "once", None), [winners[0]; 64]);
    assert!(s.blobs().remove(BlobKind::Meta, "once").unwrap());
}

pub(super) fn an_uncommitted_blob_leaves_nothing(f: &mut dyn Fixture) {
    let s = f.store();
    for size in [10, 9_000_000] {
        let mut w = s
            .blobs()
            .writer(BlobKind::Checkpoint, "never.ckpt")
            .unwrap();
        w.write_all(&vec![7u8; size]).unwrap();
        drop(w);
        let mut w = s
            .blobs()
            .writer(BlobKind::Model, "never.safetensors")
            .unwrap();
        w.write_all(&vec![7u8; size]).unwrap();
        drop(w);
    }
    // (An aborted upload is cleaned up in the background: give it a moment.)
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !names(s, BlobKind::Checkpoint).is_empty() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert_eq!(names(s, BlobKind::Checkpoint), HashSet::new());
    assert_eq!(names(s, BlobKind::Model), HashSet::new());
    assert!(s
        .blobs()
        .head(BlobKind::Model, "never.safetensors")
        .unwrap()
        .is_none());
}
