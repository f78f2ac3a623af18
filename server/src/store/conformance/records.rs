//! The record-keeping traits' cases: RoundLog, Registry, SyncJobs, SecaggLog, Housekeeping's meta.

use super::*;

pub(super) fn tasks_are_created_once_and_listed_in_id_order(f: &mut dyn Fixture) {
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

pub(super) fn open_rounds_are_kept_per_task(f: &mut dyn Fixture) {
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

pub(super) fn finish_round_records_the_round_and_moves_the_task_on(f: &mut dyn Fixture) {
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
    // Pages: every attempt of the rounds after `after`, oldest first, at most `limit`.
    let page = |after: u64, limit: usize| -> Vec<(u64, u32)> {
        s.history_page("t", after, limit)
            .unwrap()
            .iter()
            .map(|r| (r.round, r.attempt))
            .collect()
    };
    assert_eq!(page(0, 2), vec![(1, 0), (2, 0)]);
    assert_eq!(page(2, 10), vec![(10, 1), (10, 2)]);
    assert_eq!(page(1, 2), vec![(2, 0), (10, 1)]);
    assert!(page(10, 10).is_empty());
    assert!(page(u64::MAX, 10).is_empty());
    assert!(s.history_page("t2", 0, 10).unwrap().is_empty());
    assert!(
        s.open_round("t").unwrap().is_none(),
        "no next round: removed"
    );
    assert_eq!(s.task("t").unwrap().unwrap().published, 3);
    assert!(s.history("t2").unwrap().is_empty());
    assert!(s.history("").unwrap().is_empty());
}

pub(super) fn ending_an_evaluation_writes_the_task_and_its_round_entry_together(
    f: &mut dyn Fixture,
) {
    let s = f.store();
    let m = model([1.0; 3]).digest();
    let mut t = task(m, 1);
    t.evaluating = Some(EvaluationRecord {
        round: 1,
        attempt: 1,
        model: m,
        deadline_unix_ms: 5,
        sums: Default::default(),
        reporters: ["c1".to_string()].into(),
        trainers: vec!["c2".into()],
    });
    let abandoned = RoundRecord {
        outcome: RoundOutcome::Abandoned {
            reason: "too few".into(),
        },
        model: None,
        ..published(1, 0, None)
    };
    s.finish_round("t", &t, &abandoned, 0, None).unwrap();
    s.finish_round("t", &t, &published(1, 1, Some(m)), 1, None)
        .unwrap();
    assert_eq!(s.task("t").unwrap().unwrap().evaluating, t.evaluating);
    let summary = hora_common::wire::EvaluationSummary {
        clients: 3,
        examples: 90,
        loss: Some(0.5),
        accuracy: None,
    };
    t.evaluating = None;
    s.end_evaluation("t", &t, 1, 1, &summary).unwrap();
    assert_eq!(s.task("t").unwrap().unwrap().evaluating, None);
    let attempts = s.round_attempts("t", 1).unwrap();
    assert_eq!(
        attempts[0].evaluation, None,
        "the abandoned attempt is left as it was"
    );
    assert_eq!(
        attempts[1],
        RoundRecord {
            evaluation: Some(summary),
            ..published(1, 1, Some(m))
        }
    );
    // A round without an entry: the task is written all the same.
    t.published = 2;
    s.end_evaluation("t", &t, 9, 0, &summary).unwrap();
    assert_eq!(s.task("t").unwrap().unwrap().published, 2);
    assert!(s.round_attempts("t", 9).unwrap().is_empty());
}

pub(super) fn pruning_drops_models_out_of_retention_unless_still_used(f: &mut dyn Fixture) {
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
    let keep_two = Retention {
        last: 2,
        every: 0,
        detail: 0,
    };
    assert!(s.model_in_history(&models[2]).unwrap());
    assert_eq!(
        s.round_attempts("t", 3).unwrap(),
        vec![published(3, 0, Some(models[2]))]
    );
    assert!(s.round_attempts("t", 9).unwrap().is_empty());
    // Rounds 1 to 4 fall out; round 1's model is the other task's, so 2, 3 and 4 go.
    assert_eq!(s.prune_models("t", keep_two, 6).unwrap(), 3);
    assert!(!s.model_in_history(&models[2]).unwrap());
    assert!(s.model_in_history(&models[4]).unwrap());
    let pruned: Vec<_> = s.history("t").unwrap().iter().map(|r| r.pruned).collect();
    assert_eq!(pruned, vec![true, true, true, true, false, false]);
    for (i, m) in models.iter().enumerate() {
        assert_eq!(
            s.has_model(m).unwrap(),
            ![1, 2, 3].contains(&i),
            "round {}",
            i + 1
        );
    }
    assert!(s.has_model(&initial).unwrap());
    // Already pruned rounds are not counted again.
    assert_eq!(s.prune_models("t", keep_two, 6).unwrap(), 0);
    // Retention that keeps everything prunes nothing.
    assert_eq!(
        s.prune_models(
            "other",
            Retention {
                last: 0,
                every: 0,
                detail: 0,
            },
            6
        )
        .unwrap(),
        0
    );
    // A stricter retention (after a restart with other flags) judges the rounds an earlier
    // prune kept again: round 5 goes now. Round 6's model is the task's own.
    f.reopen();
    let s = f.store();
    assert!(s.model_in_history(&models[4]).unwrap());
    let keep_one = Retention {
        last: 1,
        every: 0,
        detail: 0,
    };
    assert_eq!(s.prune_models("t", keep_one, 6).unwrap(), 1);
    assert!(!s.has_model(&models[4]).unwrap() && s.has_model(&initial).unwrap());
    // Both attempts of a retried round are its attempts.
    let mut abandoned = published(7, 0, None);
    abandoned.outcome = RoundOutcome::Abandoned {
        reason: "short".into(),
    };
    s.finish_round("t", &t, &abandoned, 0, None).unwrap();
    s.finish_round("t", &t, &published(7, 1, Some(models[5])), 1, None)
        .unwrap();
    let attempts: Vec<_> = s
        .round_attempts("t", 7)
        .unwrap()
        .iter()
        .map(|r| (r.attempt, r.model))
        .collect();
    assert_eq!(attempts, vec![(0, None), (1, Some(models[5]))]);
}

pub(super) fn history_entries_out_of_the_detail_window_are_compacted(f: &mut dyn Fixture) {
    let s = f.store();
    let m = s.put_model(&model([1.0; 3])).unwrap();
    let detail = |rounds| Retention {
        last: 0,
        every: 0,
        detail: rounds,
    };
    let whole = |round| {
        let mut r = published(round, 0, Some(m));
        r.participants = vec!["a".into(), "b".into()];
        r.dropped = vec!["c".into()];
        r.staleness = Some(hora_common::wire::VersionStaleness::of(
            round,
            vec![round, 0],
        ));
        r
    };
    for round in 1..=4 {
        s.finish_round("t", &task(m, round), &whole(round), 0, None)
            .unwrap();
    }
    let compacted = |round| {
        let mut r = whole(round);
        assert!(r.compact());
        r
    };
    // Keeping every model, the entries more than two rounds behind lose their lists only.
    assert_eq!(s.prune_models("t", detail(2), 4).unwrap(), 0);
    let expected = vec![compacted(1), compacted(2), whole(3), whole(4)];
    assert_eq!(s.history("t").unwrap(), expected);
    let kept = &s.history("t").unwrap()[0];
    assert_eq!(
        (
            kept.compacted.map(|c| (c.participants, c.dropped)),
            kept.pruned
        ),
        (Some((2, 1)), false)
    );
    assert_eq!(kept.staleness.as_ref().map(|s| s.max), Some(1));
    // Across a reopen, the next publication compacts the next entry and no other.
    f.reopen();
    let s = f.store();
    s.finish_round("t", &task(m, 5), &whole(5), 0, None)
        .unwrap();
    s.prune_models("t", detail(2), 5).unwrap();
    let expected = vec![compacted(1), compacted(2), compacted(3), whole(4), whole(5)];
    assert_eq!(s.history("t").unwrap(), expected);
    // 0 keeps every entry whole from then on (a compacted one stays compacted).
    s.prune_models("t", detail(0), 5).unwrap();
    assert_eq!(s.history("t").unwrap(), expected);
}

pub(super) fn clients_are_read_back_in_id_order(f: &mut dyn Fixture) {
    let s = f.store();
    assert!(s.client("c").unwrap().is_none());
    s.put_client("c2", &client("two")).unwrap();
    s.put_client("c1", &client("one")).unwrap();
    let mut revoked = client("one");
    revoked.revoked = true;
    s.put_client("c1", &revoked).unwrap();
    assert!(s.client("c1").unwrap().unwrap().revoked);
    // An update changes the record in place, keeping what it does not touch.
    let struck = s.update_client("c1", &mut |c| c.strikes += 2).unwrap();
    assert_eq!(struck.map(|c| (c.strikes, c.revoked)), Some((2, true)));
    assert_eq!(s.client("c1").unwrap().unwrap().strikes, 2);
    assert!(s
        .update_client("c9", &mut |c| c.strikes += 1)
        .unwrap()
        .is_none());
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

pub(super) fn enrolment_tokens_work_once(f: &mut dyn Fixture) {
    let s = f.store();
    let enrolment = EnrolmentRecord {
        aggregator: false,
        max_contributors: None,
        expires_unix_ms: 5,
        tasks: Some(vec!["t".into()]),
    };
    s.put_enrolment("h", &enrolment).unwrap();
    s.put_enrolment("other", &enrolment).unwrap();
    // Looking does not spend.
    assert_eq!(s.enrolment("h").unwrap().unwrap().expires_unix_ms, 5);
    assert!(s.enrolment("h").unwrap().is_some());
    // Spending creates the client in the same step, once.
    let taken = s.enrol("h", "c1", &client("one")).unwrap().unwrap();
    assert_eq!(
        (taken.expires_unix_ms, taken.tasks),
        (5, Some(vec!["t".into()]))
    );
    assert_eq!(
        s.client("c1").unwrap().unwrap().label.as_deref(),
        Some("one")
    );
    assert!(s.enrolment("h").unwrap().is_none());
    assert!(s.enrol("h", "c2", &client("two")).unwrap().is_none());
    assert!(
        s.client("c2").unwrap().is_none(),
        "a spent token creates no client"
    );
    assert!(s.enrol("never", "c3", &client("three")).unwrap().is_none());
    // An existing client is never replaced, and the token stays unspent.
    s.put_enrolment("again", &enrolment).unwrap();
    assert!(s
        .enrol("again", "c1", &client("impostor"))
        .unwrap()
        .is_none());
    assert_eq!(
        s.client("c1").unwrap().unwrap().label.as_deref(),
        Some("one")
    );
    assert!(s.enrolment("again").unwrap().is_some());
    assert!(s.enrol("other", "c4", &client("four")).unwrap().is_some());
}

pub(super) fn sync_jobs_are_created_once_updated_and_removed(f: &mut dyn Fixture) {
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

pub(super) fn secagg_messages_go_in_through_an_open_gate_and_a_claim_once(f: &mut dyn Fixture) {
    let s = f.store();
    let put = |claim: (&str, &[u8]), writes: &[(&str, &[u8])]| {
        s.secagg_put_gated("t\0gate\0", b"open", claim, writes)
            .unwrap()
    };
    // No gate, or another one: nothing is written.
    assert_eq!(put(("t\0adv\0c1", b"k1"), &[]), Gated::Closed);
    s.secagg_put_bytes("t\0gate\0", b"closed").unwrap();
    assert_eq!(put(("t\0adv\0c1", b"k1"), &[]), Gated::Closed);
    assert!(s.secagg_scan_bytes("t\0adv\0").unwrap().is_empty());
    // Open: the claim and the writes go in; the same claim again is a repeat, another value
    // is refused with the one held, and nothing of it is written.
    s.secagg_put_bytes("t\0gate\0", b"open").unwrap();
    assert_eq!(
        put(("t\0in\0c1", b"r1"), &[("t\0part\0r1", b"1")]),
        Gated::Written
    );
    assert_eq!(
        put(("t\0in\0c1", b"r1"), &[("t\0part\0r1", b"2")]),
        Gated::Written
    );
    assert_eq!(
        put(("t\0in\0c1", b"r2"), &[("t\0part\0r2", b"3")]),
        Gated::Taken(b"r1".to_vec())
    );
    assert_eq!(
        s.secagg_scan_bytes("t\0part\0").unwrap(),
        vec![("r1".into(), b"2".to_vec())]
    );
    assert_eq!(
        s.secagg_get_bytes("t\0in\0c1").unwrap().as_deref(),
        Some(&b"r1"[..])
    );
}

pub(super) fn secagg_records_are_scanned_by_prefix_and_cleared_per_task(f: &mut dyn Fixture) {
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

pub(super) fn meta_is_kept(f: &mut dyn Fixture) {
    let s = f.store();
    assert!(s.meta("admin_token_hash").unwrap().is_none());
    s.put_meta("admin_token_hash", "h1").unwrap();
    s.put_meta("admin_token_hash", "h2").unwrap();
    assert_eq!(s.meta("admin_token_hash").unwrap().as_deref(), Some("h2"));
}

pub(super) fn stores_are_shared_across_threads(f: &mut dyn Fixture) {
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
