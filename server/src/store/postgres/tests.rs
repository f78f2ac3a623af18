use std::time::{Duration, Instant};

use axum::response::IntoResponse;
use tokio::sync::broadcast::error::TryRecvError;

use super::test_server::TestServer;
use super::*;
use crate::error::ServerError;
use crate::store::conformance::{client, model, open_round, published, task};

fn target(server: &TestServer) -> Target {
    server.url().parse().unwrap()
}

/// Runs `sql` on `target`'s database; the first column of each row it returns, as text.
fn sql(target: &Target, sql: impl Into<String>) -> Vec<String> {
    let sql = sql.into();
    let driver = Driver::start(target).unwrap();
    driver
        .with(move |client| async move {
            let rows = client.simple_query(&sql).await?;
            Ok(rows
                .iter()
                .filter_map(|m| match m {
                    tokio_postgres::SimpleQueryMessage::Row(row) => {
                        Some(row.get(0).unwrap_or_default().to_string())
                    }
                    _ => None,
                })
                .collect())
        })
        .unwrap()
}

/// The next change the feed says, within ten seconds.
fn next(feed: &mut broadcast::Receiver<StoreChange>) -> StoreChange {
    let started = Instant::now();
    loop {
        match feed.try_recv() {
            Ok(change) => return change,
            Err(TryRecvError::Empty) if started.elapsed() < Duration::from_secs(10) => {
                std::thread::sleep(Duration::from_millis(5))
            }
            Err(e) => panic!("no change heard: {e}"),
        }
    }
}

#[test]
fn replicas_opening_together_migrate_once_and_a_changed_or_newer_schema_is_refused() {
    let server = TestServer::start();
    let target = target(&server);
    let dirs: Vec<_> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    std::thread::scope(|s| {
        let opening: Vec<_> = dirs
            .iter()
            .map(|d| s.spawn(|| PostgresStore::open(&target, d.path())))
            .collect();
        for store in opening {
            store.join().unwrap().expect("every replica opens");
        }
    });
    assert_eq!(
        sql(&target, "SELECT name FROM hora_migrations ORDER BY version"),
        [
            "0001_initial",
            "0002_leases",
            "0003_part_of_a_model",
            "0004_federated_evaluation",
            "0005_serving_replicas",
            "0006_training_slots",
            "0007_followers_in_status",
            "0008_secagg_changes"
        ]
    );
    assert!(migrate(&target).unwrap().is_empty(), "up to date");

    // A migration edited after it was applied.
    sql(
        &target,
        "UPDATE hora_migrations SET checksum = 'edited' WHERE version = 1",
    );
    let refused = PostgresStore::open(&target, dirs[0].path())
        .err()
        .expect("refused");
    assert!(
        matches!(&refused, StoreError::MigrationChanged { version: 1, name } if name == "0001_initial"),
        "{refused}"
    );

    // A database a newer hora-server migrated: refused, and left as it is.
    let checksum = migrate::MIGRATIONS[0].checksum();
    sql(
        &target,
        format!("UPDATE hora_migrations SET checksum = '{checksum}' WHERE version = 1"),
    );
    sql(
        &target,
        "INSERT INTO hora_migrations (version, name, checksum) VALUES (9, '0009_later', 'x')",
    );
    let refused = migrate(&target).expect_err("refused");
    assert!(
        refused.to_string().contains("newer hora-server"),
        "{refused}"
    );
    assert_eq!(
        sql(&target, "SELECT name FROM hora_migrations ORDER BY version"),
        [
            "0001_initial",
            "0002_leases",
            "0003_part_of_a_model",
            "0004_federated_evaluation",
            "0005_serving_replicas",
            "0006_training_slots",
            "0007_followers_in_status",
            "0008_secagg_changes",
            "0009_later"
        ]
    );
}

#[test]
fn writes_through_one_store_reach_the_change_feed_of_another() {
    let server = TestServer::start();
    let target = target(&server);
    let (dir_a, dir_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let a = PostgresStore::open(&target, dir_a.path()).unwrap();
    let b = PostgresStore::open(&target, dir_b.path()).unwrap();
    let mut feed = b.changes().expect("a feed");
    let mut own = a.changes().expect("a feed");
    let m = model([1.0; 3]).digest();

    assert!(a.create_task("t1", &task(m, 0)).unwrap());
    assert_eq!(next(&mut feed), StoreChange::Task("t1".into()));
    // One transaction that writes the task, its history and its open round: heard once.
    a.finish_round(
        "t1",
        &task(m, 1),
        &published(1, 0, Some(m)),
        0,
        Some(&open_round(2, None)),
    )
    .unwrap();
    assert_eq!(next(&mut feed), StoreChange::Task("t1".into()));
    // A client is nothing the feed watches; the next open round is.
    a.put_client("c1", &client("one")).unwrap();
    a.put_open_round("t2", &open_round(1, None)).unwrap();
    assert_eq!(next(&mut feed), StoreChange::Task("t2".into()));
    // The writer's own feed hears its writes too; the embedded stores have none.
    for id in ["t1", "t1", "t2"] {
        assert_eq!(next(&mut own), StoreChange::Task(id.into()));
    }
    assert!(crate::store::MemoryStore::new()
        .unwrap()
        .changes()
        .is_none());
}

#[test]
fn a_database_that_goes_away_is_unavailable_and_the_store_and_its_feed_come_back_with_it() {
    // Nothing listening at all: opening says so, and what to check.
    let nowhere: Target = format!("postgres://hora@127.0.0.1:{}/postgres", unused_port())
        .parse()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let refused = PostgresStore::open(&nowhere, dir.path())
        .err()
        .expect("refused");
    assert!(
        matches!(refused, StoreError::Unavailable { .. }),
        "{refused}"
    );
    assert!(refused.to_string().contains("--store"), "{refused}");

    let mut server = TestServer::start();
    let store = PostgresStore::open(&target(&server), dir.path()).unwrap();
    let mut feed = store.changes().unwrap();
    store.put_meta("k", "v").unwrap();
    server.stop();
    for _ in 0..2 {
        let down = store.meta("k").expect_err("unavailable");
        assert!(matches!(down, StoreError::Unavailable { .. }), "{down}");
        // Which the API answers as a refusal worth retrying, not an internal error.
        let answer = ServerError::from(down).into_response();
        assert_eq!(answer.status(), 503);
        assert_eq!(answer.headers()["retry-after"], "2");
    }
    server.restart();
    assert_eq!(store.meta("k").unwrap().as_deref(), Some("v"));
    // The feed connects again by itself, says that it may have missed changes, and hears on.
    assert_eq!(next(&mut feed), StoreChange::Missed);
    store
        .put_task("t", &task(model([0.0; 3]).digest(), 0))
        .unwrap();
    assert_eq!(next(&mut feed), StoreChange::Task("t".into()));
}

/// A loopback port nothing listens on (bound, read, released).
fn unused_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[test]
fn a_target_is_shown_without_its_password() {
    for (url, shown) in [
        ("postgres://u:pw@db:5433/fl", "db:5433/fl"),
        (
            "postgresql://u:pw@%2Fvar%2Frun%2Fpostgresql/fl",
            "/var/run/postgresql:5432/fl",
        ),
        ("postgres://u:pw@/fl?hostaddr=10.0.0.2", "10.0.0.2:5432/fl"),
    ] {
        let target: Target = url.parse().unwrap();
        assert_eq!(target.to_string(), shown);
        assert!(!format!("{target:?}").contains("pw"), "{target:?}");
    }
    let nowhere = "postgres://u@/fl".parse::<Target>().unwrap_err();
    assert!(nowhere.contains("names no host"), "{nowhere}");
}

fn leading(name: &str, ttl: Duration) -> LeaseSettings {
    LeaseSettings {
        replica: Replica {
            id: name.into(),
            address: format!("{name} 127.0.0.1:0"),
            following: Default::default(),
        },
        ttl,
        shared_blobs: true,
    }
}

#[test]
fn one_replica_leads_a_standby_takes_over_a_lapsed_lease_and_the_old_leaders_writes_are_fenced() {
    let server = TestServer::start();
    let target = target(&server);
    let dirs: Vec<_> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let open = |i: usize| PostgresStore::open(&target, dirs[i].path()).unwrap();
    // Standing by ends, failing the test, rather than hanging it.
    let within = |limit: Duration| {
        let asked = Instant::now();
        move || {
            assert!(asked.elapsed() < limit, "still standing by after {limit:?}");
            false
        }
    };
    // a renews rarely (every 20 s): the test lets its lease lapse by hand.
    let a = open(0)
        .claim(
            &leading("a", Duration::from_secs(60)),
            &within(Duration::from_secs(20)),
        )
        .unwrap();
    let lease_a = a.lease().expect("a leads");
    assert_eq!(lease_a.epoch, 1);
    a.put_meta("k", "from a").unwrap();

    // While a holds its lease, b stands by, and stops standing by when told to.
    let ttl = Duration::from_secs(2);
    let asked = Instant::now();
    let stopped = open(1)
        .claim(&leading("b", ttl), &|| {
            asked.elapsed() > Duration::from_secs(2)
        })
        .err()
        .expect("b stood by");
    assert!(matches!(stopped, StoreError::Stopped), "{stopped}");
    assert_eq!(
        sql(&target, "SELECT holder || ' ' || epoch FROM leases"),
        ["a 1"]
    );
    assert_eq!(
        sql(&target, "SELECT id FROM replicas ORDER BY id"),
        ["a", "b"]
    );

    // a is cut off (its lease lapses without a renewal that lands): b takes over under the next
    // epoch, and a's writes are refused from then on; a learns that it lost the lease.
    let b = open(1);
    sql(&target, "UPDATE leases SET expires_at = clock_timestamp()");
    let b = b
        .claim(&leading("b", ttl), &within(Duration::from_secs(20)))
        .unwrap();
    assert_eq!(b.lease().expect("b leads").epoch, 2);
    let fenced = a.put_meta("k", "from a, too late").expect_err("fenced");
    assert!(
        matches!(fenced, StoreError::Fenced { epoch: 1 }),
        "{fenced}"
    );
    assert!(fenced.keeps_new_blobs());
    let fenced = a
        .finish_round(
            "t",
            &task(model([1.0; 3]).digest(), 1),
            &published(1, 0, None),
            0,
            None,
        )
        .expect_err("a cannot publish");
    assert!(matches!(fenced, StoreError::Fenced { .. }), "{fenced}");
    assert!(a.history("t").unwrap().is_empty());
    assert!(lease_a.lost.borrow().is_some());
    assert!(matches!(a.ready(), Err(StoreError::Fenced { .. })));
    // Which the API answers as a refusal to retry elsewhere.
    let answer = ServerError::from(fenced).into_response();
    assert_eq!(answer.status(), 503);
    assert_eq!(answer.headers()["retry-after"], "1");
    b.put_meta("k", "from b").unwrap();
    assert_eq!(b.meta("k").unwrap().as_deref(), Some("from b"));

    // b renews (its lease outlives several of its lengths) and, stepping down, hands it over at
    // once: c leads under epoch 3 without waiting for it to lapse; b writes nothing more.
    std::thread::sleep(2 * ttl);
    assert!(b.ready().is_ok());
    let c = open(2);
    let stepped = Instant::now();
    b.step_down().unwrap();
    let c = c
        .claim(&leading("c", ttl), &within(Duration::from_secs(20)))
        .unwrap();
    assert!(stepped.elapsed() < ttl, "{:?}", stepped.elapsed());
    assert_eq!(c.lease().expect("c leads").epoch, 3);
    assert!(matches!(
        b.put_meta("k", "late"),
        Err(StoreError::Fenced { epoch: 2 })
    ));
    assert_eq!(
        sql(&target, "SELECT id FROM replicas ORDER BY id"),
        ["a", "c"],
        "b left the list as it stepped down"
    );
    // A replica on another host whose blobs are its own files is refused: the records would
    // name files it does not have.
    let local = LeaseSettings {
        shared_blobs: false,
        ..leading("elsewhere:1:beef", ttl)
    };
    let refused = open(0)
        .claim(&local, &within(Duration::from_secs(20)))
        .err()
        .expect("refused");
    assert!(
        matches!(&refused, StoreError::Unshared { host } if host == "c"),
        "{refused}"
    );
    // A leader whose renewals do not land (the row held FOR UPDATE by another session, as a
    // database cut off would) counts its lease lost by itself, before it lapses.
    let held = c.lease().unwrap();
    let blocked = Instant::now();
    let holding = {
        let target = target.clone();
        std::thread::spawn(move || {
            sql(
                &target,
                "BEGIN; SELECT 1 FROM leases FOR UPDATE; SELECT pg_sleep(3); COMMIT",
            )
        })
    };
    while held.lost.borrow().is_none() {
        assert!(
            blocked.elapsed() < ttl,
            "c still thinks it leads after its lease"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        held.lost
            .borrow()
            .as_deref()
            .unwrap_or_default()
            .contains("could not renew"),
        "{:?}",
        held.lost.borrow()
    );
    holding.join().unwrap();
    // And one whose lease another replica took counts it lost at its next renewal.
    let c = open(2)
        .claim(&leading("c", ttl), &within(Duration::from_secs(20)))
        .unwrap();
    let held = c.lease().unwrap();
    sql(
        &target,
        "UPDATE leases SET holder = 'c, renamed by hand', expires_at = clock_timestamp() + interval '1 hour'",
    );
    let deadline = Instant::now() + 3 * ttl;
    while held.lost.borrow().is_none() {
        assert!(Instant::now() < deadline, "c still thinks it leads");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn over_tls_the_store_verifies_the_database_and_plain_or_unverifiable_connections_are_refused() {
    let certs = tempfile::tempdir().unwrap();
    let paths = crate::tls::make_dev_certs(certs.path(), &[]).unwrap();
    let server = TestServer::start_tls(&paths.cert, &paths.key);
    let ca = certs.path().join(crate::tls::CA_CERT);
    let dir = tempfile::tempdir().unwrap();

    // This database takes TLS only: a plain connection is refused, and `require` without a CA
    // to verify it against is refused before connecting.
    let plain = PostgresStore::open(&target(&server), dir.path())
        .err()
        .expect("refused");
    assert!(plain.to_string().contains("no encryption"), "{plain}");
    let unverifiable = format!("{}?sslmode=require", server.url())
        .parse::<Target>()
        .expect_err("refused");
    assert!(unverifiable.contains("sslrootcert"), "{unverifiable}");

    // With the CA: over TLS, verified, the change feed included.
    for mode in ["sslmode=require&", ""] {
        let url = format!("{}?{mode}sslrootcert={}", server.url(), ca.display());
        let tls: Target = url.parse().unwrap();
        assert!(tls.uses_tls());
        let store = PostgresStore::open(&tls, dir.path()).unwrap();
        let mut feed = store.changes().unwrap();
        store
            .put_task("t", &task(model([0.0; 3]).digest(), 0))
            .unwrap();
        assert_eq!(next(&mut feed), StoreChange::Task("t".into()));
        assert_eq!(
            sql(
                &tls,
                "SELECT CASE WHEN ssl THEN 'tls' ELSE 'plain' END FROM pg_stat_ssl
                 WHERE pid = pg_backend_pid()"
            ),
            ["tls"]
        );
    }

    // A CA that did not sign the database's certificate: refused, saying why.
    let other = tempfile::tempdir().unwrap();
    crate::tls::make_dev_certs(other.path(), &[]).unwrap();
    let url = format!(
        "{}?sslmode=require&sslrootcert={}",
        server.url(),
        other.path().join(crate::tls::CA_CERT).display()
    );
    let refused = PostgresStore::open(&url.parse().unwrap(), dir.path())
        .err()
        .expect("refused");
    assert!(refused.to_string().contains("certificate"), "{refused}");
    // And a CA file that is not there, when the URL is read.
    let missing = format!("{}?sslrootcert=/nonexistent/ca.pem", server.url())
        .parse::<Target>()
        .expect_err("refused");
    assert!(missing.contains("/nonexistent/ca.pem"), "{missing}");
}

#[test]
fn replicas_share_an_attempts_selections_claims_and_partials_until_the_leader_seals_it() {
    let server = TestServer::start();
    let target = target(&server);
    let (dir_a, dir_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let a = PostgresStore::open(&target, dir_a.path()).unwrap();
    let b = PostgresStore::open(&target, dir_b.path()).unwrap();
    let m = model([1.0; 3]).digest();
    assert!(a.create_task("t", &task(m, 0)).unwrap());
    let open = OpenRoundRecord {
        selected: Vec::new(),
        ..open_round(1, None)
    };
    a.put_open_round("t", &open).unwrap();

    // Selections: a capacity of two holds across both stores; a client keeps its place; an
    // attempt that is not the open one takes nobody; the record lists every selection.
    use SharedSelection::*;
    assert_eq!(a.select_client("t", 1, 0, "c1", 2).unwrap(), Selected);
    assert_eq!(b.select_client("t", 1, 0, "c2", 2).unwrap(), Selected);
    assert_eq!(b.select_client("t", 1, 0, "c3", 2).unwrap(), Full);
    assert_eq!(a.select_client("t", 1, 0, "c1", 2).unwrap(), Selected);
    assert_eq!(a.select_client("t", 1, 1, "c4", 9).unwrap(), Closed);
    assert_eq!(b.open_round("t").unwrap().unwrap().selected, ["c1", "c2"]);

    // Claims: the first replica's; another finds it (its process has no heartbeat: not alive)
    // and may take it over, once.
    assert_eq!(
        a.claim_update("t", 1, 0, "c1", "ra#1", None, false)
            .unwrap(),
        None
    );
    assert_eq!(
        a.claim_update("t", 1, 0, "c1", "ra#1", None, false)
            .unwrap(),
        None
    );
    let theirs = b
        .claim_update("t", 1, 0, "c1", "rb#1", None, false)
        .unwrap();
    assert_eq!(
        theirs,
        Some(Claim {
            replica: "ra#1".into(),
            alive: false
        })
    );
    assert_eq!(
        b.claim_update("t", 1, 0, "c1", "rb#1", Some("ra#1"), false)
            .unwrap(),
        None
    );
    assert_eq!(
        a.claim_update("t", 1, 0, "c1", "ra#1", Some("ra#1"), false)
            .unwrap()
            .map(|c| c.replica),
        Some("rb#1".into())
    );

    assert_eq!(
        a.claim_holder("t", 1, 0, "c1").unwrap().as_deref(),
        Some("rb#1")
    );
    assert_eq!(a.claim_holder("t", 1, 0, "c2").unwrap(), None);

    // Partials: each replica's latest, until the leader seals the attempt; then none is
    // recorded, nobody is selected and no update claimed for it.
    let mut partial = ReplicaPartial {
        replica: "rb#1".into(),
        round: 1,
        attempt: 0,
        file: "p1.ckpt".into(),
        total_weight: 0.0,
        contributions: Vec::new(),
    };
    b.put_partial("t", &partial, &[]).unwrap();
    partial.file = "p2.ckpt".into();
    partial.total_weight = 5.0;
    // (c1's update, which rb#1 claimed.)
    partial.contributions = open_round(1, Some("x")).checkpoint.unwrap().contributions;
    let fresh = ["c1".to_string()];
    // A partial with an update whose claim is another's is refused (ra#1 lost c1's).
    let lost = ReplicaPartial {
        replica: "ra#1".into(),
        ..partial.clone()
    };
    assert!(matches!(
        a.put_partial("t", &lost, &fresh),
        Err(StoreError::ClaimLost { client, .. }) if client == "c1"
    ));
    b.put_partial("t", &partial, &fresh).unwrap();
    assert_eq!(a.partials("t").unwrap(), [partial.clone()]);
    // Once rb#1's partial holds c1's update, its claim is not taken over, gone or not.
    assert_eq!(
        a.claim_update("t", 1, 0, "c1", "ra#1", Some("rb#1"), false)
            .unwrap()
            .map(|c| c.replica),
        Some("rb#1".into())
    );
    let stale = ReplicaPartial {
        attempt: 1,
        ..partial.clone()
    };
    assert!(matches!(
        b.put_partial("t", &stale, &[]),
        Err(StoreError::AttemptSealed { attempt: 1, .. })
    ));
    assert_eq!(a.seal_partials("t", 1, 0).unwrap(), [partial.clone()]);
    assert!(matches!(
        b.put_partial("t", &partial, &[]),
        Err(StoreError::AttemptSealed { round: 1, .. })
    ));
    assert_eq!(b.select_client("t", 1, 0, "c9", 9).unwrap(), Closed);
    assert!(b
        .claim_update("t", 1, 0, "c2", "rb#1", None, false)
        .is_err());

    // The close's transaction forgets the attempt; the next one starts from nothing.
    a.finish_round(
        "t",
        &task(m, 1),
        &published(1, 0, Some(m)),
        0,
        Some(&open_round(2, None)),
    )
    .unwrap();
    assert!(a.partials("t").unwrap().is_empty());
    assert_eq!(b.select_client("t", 2, 0, "c2", 2).unwrap(), Selected);
    assert_eq!(a.open_round("t").unwrap().unwrap().selected, ["c1", "c2"]);
    // The seal outlives the close: a write that still read the closed attempt as open is
    // refused by it (here the open record is put back to round 1 by hand).
    a.put_open_round("t", &open).unwrap();
    assert!(matches!(
        b.put_partial("t", &partial, &[]),
        Err(StoreError::AttemptSealed { round: 1, .. })
    ));
    assert_eq!(b.select_client("t", 1, 0, "c5", 9).unwrap(), Closed);

    // Training slots (an asynchronous task's): a concurrency of two holds across both stores;
    // a client keeps its slot; one whose update of the open attempt is claimed waits for the
    // next; a claim of a client without a slot is refused, and a durable update spends it.
    a.put_open_round(
        "t",
        &OpenRoundRecord {
            selected: Vec::new(),
            ..open_round(3, None)
        },
    )
    .unwrap();
    let held = |t: SlotTaken| matches!(t, SlotTaken::Held { until_unix_ms } if until_unix_ms > 0);
    assert!(held(a.take_slot("t", 3, 0, "s1", 60_000, 2).unwrap()));
    assert!(held(b.take_slot("t", 3, 0, "s2", 60_000, 2).unwrap()));
    assert_eq!(
        a.take_slot("t", 3, 0, "s3", 60_000, 2).unwrap(),
        SlotTaken::Full
    );
    let first = b.training_slot("t", "s1").unwrap().expect("s1's slot");
    assert_eq!(
        b.take_slot("t", 3, 0, "s1", 60_000, 2).unwrap(),
        SlotTaken::Held {
            until_unix_ms: first
        }
    );
    assert_eq!(
        a.take_slot("t", 3, 1, "s1", 60_000, 2).unwrap(),
        SlotTaken::Closed
    );
    assert!(matches!(
        a.claim_update("t", 3, 0, "s3", "ra#1", None, true),
        Err(StoreError::NoTrainingSlot { client, .. }) if client == "s3"
    ));
    assert_eq!(
        a.claim_update("t", 3, 0, "s1", "ra#1", None, true).unwrap(),
        None
    );
    assert_eq!(
        b.take_slot("t", 3, 0, "s1", 60_000, 2).unwrap(),
        SlotTaken::Contributed
    );
    // (Still held, until the update is durable: a retry of one never recorded needs it.)
    assert_eq!(a.training_slot("t", "s1").unwrap(), Some(first));
    let mut slotted = partial.clone();
    slotted.replica = "ra#1".into();
    slotted.round = 3;
    slotted.contributions[0].client = "s1".into();
    a.put_partial("t", &slotted, &["s1".to_string()]).unwrap();
    assert_eq!(a.training_slot("t", "s1").unwrap(), None);
    assert!(held(a.take_slot("t", 3, 0, "s3", 60_000, 2).unwrap()));
    // The leader's checkpoint spends the slots of the asynchronous updates it holds.
    let mut checkpointed = OpenRoundRecord {
        selected: Vec::new(),
        ..open_round(3, Some("x"))
    };
    if let Some(c) = checkpointed.checkpoint.as_mut() {
        c.contributions[0].client = "s3".into();
    }
    a.put_open_round("t", &checkpointed).unwrap();
    assert_eq!(a.training_slot("t", "s3").unwrap(), None);
    // A slot lapses at its time, and frees its place.
    assert!(held(a.take_slot("t", 3, 0, "s4", 1, 2).unwrap()));
    std::thread::sleep(std::time::Duration::from_millis(20));
    assert_eq!(a.training_slot("t", "s4").unwrap(), None);
    assert!(held(b.take_slot("t", 3, 0, "s5", 60_000, 2).unwrap()));
    // A client whose slot lapsed takes a new one (its row is replaced).
    assert!(held(a.take_slot("t", 3, 0, "s4", 60_000, 3).unwrap()));
    assert!(a.training_slot("t", "s4").unwrap().is_some());
    // The seal of round 1 covers it and not round 3; the close of an asynchronous version
    // spends its participants' slots, and the task's last close every slot.
    assert!(a.sealed("t", 1, 0).unwrap());
    assert!(!a.sealed("t", 3, 0).unwrap());
    let version = hora_common::wire::RoundRecord {
        participants: vec!["s5".into()],
        staleness: Some(hora_common::wire::VersionStaleness::of(3, vec![3])),
        ..published(3, 0, Some(m))
    };
    a.finish_round("t", &task(m, 3), &version, 0, Some(&open_round(4, None)))
        .unwrap();
    assert_eq!(a.training_slot("t", "s5").unwrap(), None);
    assert!(a.training_slot("t", "s2").unwrap().is_some());
    a.finish_round("t", &task(m, 4), &published(4, 0, Some(m)), 0, None)
        .unwrap();
    assert_eq!(a.training_slot("t", "s2").unwrap(), None);

    // A store one server uses shares nothing.
    let memory = crate::store::MemoryStore::new().unwrap();
    assert!(!memory.shared());
    assert!(matches!(
        memory.select_client("t", 1, 0, "c1", 1),
        Err(StoreError::NotShared(_))
    ));
    assert!(memory.partials("t").unwrap().is_empty());
}
