//! The rendezvous against a real store in a temp dir: worlds form, ranks free, bad joins are
//! refused with what to fix.

use super::*;

use std::future::Future;

use crate::store::SledStore;

struct Fixture {
    _dir: tempfile::TempDir,
    store: Arc<Store>,
    rendezvous: Arc<Rendezvous>,
}

fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let store: Arc<Store> = Arc::new(SledStore::open(dir.path()).unwrap());
    let rendezvous =
        Arc::new(Rendezvous::open(store.clone(), Arc::new(ServerMetrics::default())).unwrap());
    Fixture {
        _dir: dir,
        store,
        rendezvous,
    }
}

impl Fixture {
    /// Creates a job; its token.
    fn job(&self, id: &str, world_size: u32) -> String {
        self.rendezvous
            .create(CreateSyncJob {
                id: id.into(),
                world_size,
                min_world_size: None,
                settle_ms: None,
            })
            .unwrap()
            .token
            .unwrap()
    }

    fn waiting(&self, id: &str) -> u32 {
        self.rendezvous
            .list()
            .into_iter()
            .find(|j| j.id == id)
            .map_or(0, |j| j.waiting)
    }

    /// Starts a join in the background and returns once it holds a rank.
    async fn spawn_join(
        &self,
        id: &str,
        token: &str,
        req: SyncJoinRequest,
    ) -> tokio::task::JoinHandle<Result<SyncWorld, ServerError>> {
        let before = self.waiting(id);
        let handle = self.join(id, token, req);
        self.until(|| self.waiting(id) > before).await;
        handle
    }

    fn join(
        &self,
        id: &str,
        token: &str,
        req: SyncJoinRequest,
    ) -> tokio::task::JoinHandle<Result<SyncWorld, ServerError>> {
        let rendezvous = self.rendezvous.clone();
        let (id, token) = (id.to_string(), token.to_string());
        tokio::spawn(async move { rendezvous.join(&id, &token, req).await })
    }

    async fn until(&self, condition: impl Fn() -> bool) {
        for _ in 0..500 {
            if condition() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("condition not met within 5 s");
    }
}

fn req(address: &str, rank: Option<u32>, world_size: u32) -> SyncJoinRequest {
    SyncJoinRequest {
        address: address.into(),
        rank,
        world_size,
        timeout_s: None,
        rejoin: None,
        elastic: false,
    }
}

async fn answer(
    handle: impl Future<Output = Result<Result<SyncWorld, ServerError>, tokio::task::JoinError>>,
) -> Result<SyncWorld, ServerError> {
    tokio::time::timeout(Duration::from_secs(10), handle)
        .await
        .expect("the join was answered")
        .expect("the join task did not panic")
}

/// Every member got the same world, with its own rank.
fn check_world(worlds: &[SyncWorld], peers: &[&str], generation: u64) {
    for w in worlds {
        assert_eq!(w.generation, generation);
        assert_eq!(w.session, worlds[0].session);
        assert_eq!(w.session.len(), 32);
        assert_eq!(w.world_size, peers.len() as u32);
        assert_eq!(w.peers, peers);
        assert_eq!(w.peers[w.rank as usize], peers[w.rank as usize]);
    }
    let mut ranks: Vec<u32> = worlds.iter().map(|w| w.rank).collect();
    ranks.sort_unstable();
    assert_eq!(ranks, (0..peers.len() as u32).collect::<Vec<_>>());
}

#[tokio::test]
async fn explicit_ranks_in_any_order_form_one_world() {
    let f = fixture();
    let token = f.job("ring", 4);
    let mut handles = Vec::new();
    for rank in [2, 0, 3] {
        let address = format!("worker-{rank}:2950{rank}");
        handles.push(
            f.spawn_join("ring", &token, req(&address, Some(rank), 4))
                .await,
        );
    }
    assert_eq!(f.waiting("ring"), 3);
    handles.push(f.join("ring", &token, req("worker-1:29501", Some(1), 4)));
    let mut worlds = Vec::new();
    for (h, rank) in handles.into_iter().zip([2, 0, 3, 1]) {
        let world = answer(h).await.unwrap();
        assert_eq!(world.rank, rank);
        worlds.push(world);
    }
    check_world(
        &worlds,
        &[
            "worker-0:29500",
            "worker-1:29501",
            "worker-2:29502",
            "worker-3:29503",
        ],
        1,
    );
    assert_eq!(f.waiting("ring"), 0);
}

#[tokio::test]
async fn joins_without_a_rank_take_the_lowest_free_one() {
    let f = fixture();
    let token = f.job("auto", 3);
    let a = f
        .spawn_join("auto", &token, req("10.0.0.1:1", None, 3))
        .await;
    let b = f
        .spawn_join("auto", &token, req("10.0.0.2:1", None, 3))
        .await;
    let c = f.join("auto", &token, req("10.0.0.3:1", None, 3));
    let worlds = [answer(a).await, answer(b).await, answer(c).await].map(Result::unwrap);
    assert_eq!(worlds.each_ref().map(|w| w.rank), [0, 1, 2]);
    check_world(&worlds, &["10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"], 1);
}

#[tokio::test]
async fn explicit_and_assigned_ranks_mix_but_never_collide() {
    let f = fixture();
    let token = f.job("mixed", 3);
    let one = f.spawn_join("mixed", &token, req("h1:9", Some(1), 3)).await;
    let zero = f.spawn_join("mixed", &token, req("h0:9", None, 3)).await;
    // Rank 0 was assigned by the server: a worker that wants it is refused, not swapped in.
    let err = f
        .rendezvous
        .join("mixed", &token, req("h9:9", Some(0), 3))
        .await
        .unwrap_err();
    assert_eq!(err.code(), ErrorCode::RankTaken);
    assert_eq!(err.status(), axum::http::StatusCode::CONFLICT);
    assert_eq!(f.waiting("mixed"), 2);
    let two = f.join("mixed", &token, req("h2:9", None, 3));
    let worlds = [answer(one).await, answer(zero).await, answer(two).await].map(Result::unwrap);
    assert_eq!(worlds.each_ref().map(|w| w.rank), [1, 0, 2]);
    check_world(&worlds, &["h0:9", "h1:9", "h2:9"], 1);
}

#[tokio::test]
async fn a_newer_join_of_a_rank_replaces_the_waiting_one() {
    let f = fixture();
    let token = f.job("again", 2);
    let old = f
        .spawn_join("again", &token, req("old:1", Some(0), 2))
        .await;
    let new = f.join("again", &token, req("new:1", Some(0), 2));
    let err = answer(old).await.unwrap_err();
    assert_eq!(err.code(), ErrorCode::Replaced);
    assert_eq!(err.status(), axum::http::StatusCode::CONFLICT);
    assert_eq!(err.to_string(), "rank 0 was joined again by a newer worker");
    assert_eq!(f.waiting("again"), 1);
    let other = f.join("again", &token, req("other:1", Some(1), 2));
    let worlds = [answer(new).await, answer(other).await].map(Result::unwrap);
    check_world(&worlds, &["new:1", "other:1"], 1);
}

#[tokio::test]
async fn a_timeout_frees_the_rank_and_names_the_missing_ones() {
    let f = fixture();
    let token = f.job("slow", 4);
    let patient = f.spawn_join("slow", &token, req("a:1", Some(0), 4)).await;
    let started = std::time::Instant::now();
    let err = f
        .rendezvous
        .join(
            "slow",
            &token,
            SyncJoinRequest {
                timeout_s: Some(0), // raised to the 1 s minimum
                rejoin: None,
                ..req("b:1", Some(1), 4)
            },
        )
        .await
        .unwrap_err();
    assert!(started.elapsed() >= Duration::from_secs(1));
    assert_eq!(err.status(), axum::http::StatusCode::REQUEST_TIMEOUT);
    assert_eq!(err.code(), ErrorCode::RendezvousTimeout);
    assert_eq!(
        err.to_string(),
        "the world of job slow is incomplete after 1 s: 2 of 4 workers joined; \
         ranks [2, 3] have not joined"
    );
    assert_eq!(f.waiting("slow"), 1, "the timed-out rank is free again");

    // Deleting the job answers the worker still waiting.
    f.rendezvous.delete("slow").unwrap();
    let err = answer(patient).await.unwrap_err();
    assert_eq!(
        (err.status(), err.code()),
        (axum::http::StatusCode::GONE, ErrorCode::JobDeleted)
    );
    assert!(f.rendezvous.list().is_empty());
    assert!(f.store.sync_jobs().unwrap().is_empty());
}

#[tokio::test]
async fn a_dropped_join_frees_its_rank() {
    let f = fixture();
    let token = f.job("gone", 2);
    let dead = f.spawn_join("gone", &token, req("dead:1", None, 2)).await;
    dead.abort();
    assert!(dead.await.unwrap_err().is_cancelled());
    assert_eq!(f.waiting("gone"), 0);
    // The next worker without a rank gets rank 0, and the world does not include the dead one.
    let a = f.spawn_join("gone", &token, req("alive:1", None, 2)).await;
    let b = f.join("gone", &token, req("alive:2", None, 2));
    let worlds = [answer(a).await, answer(b).await].map(Result::unwrap);
    check_world(&worlds, &["alive:1", "alive:2"], 1);
}

#[tokio::test]
async fn a_complete_world_resets_and_the_next_joins_form_the_next_generation() {
    let f = fixture();
    let token = f.job("gen", 2);
    let mut sessions = Vec::new();
    for generation in 1..=2 {
        let a = f.spawn_join("gen", &token, req("a:1", Some(1), 2)).await;
        let b = f.join("gen", &token, req("b:1", Some(0), 2));
        let worlds = [answer(a).await, answer(b).await].map(Result::unwrap);
        check_world(&worlds, &["b:1", "a:1"], generation);
        sessions.push(worlds[0].session.clone());
    }
    assert_ne!(sessions[0], sessions[1]);
    // A world of one forms at once.
    let solo_token = f.job("solo", 1);
    let solo = f
        .rendezvous
        .join("solo", &solo_token, req("s:1", None, 1))
        .await
        .unwrap();
    assert_eq!((solo.rank, solo.peers.len()), (0, 1));
    // The generation count survives a restart; the token still works.
    let reopened = Rendezvous::open(f.store.clone(), Arc::new(ServerMetrics::default())).unwrap();
    let jobs = reopened.list();
    assert_eq!(
        jobs.iter()
            .map(|j| (j.id.as_str(), j.generations, j.token.is_none()))
            .collect::<Vec<_>>(),
        [("gen", 2, true), ("solo", 1, true)]
    );
    let world = reopened
        .join("solo", &solo_token, req("s:1", None, 1))
        .await
        .unwrap();
    assert_eq!(world.generation, 2);
}

#[tokio::test]
async fn bad_joins_are_refused_with_what_to_fix() {
    let f = fixture();
    let token = f.job("j", 4);
    let refuse = |id: &'static str, token: &str, r: SyncJoinRequest| {
        let rendezvous = f.rendezvous.clone();
        let token = token.to_string();
        async move { rendezvous.join(id, &token, r).await.unwrap_err() }
    };
    // An unknown job answers as a wrong token does: no way to probe for job ids.
    let e = refuse("nope", &token, req("a:1", None, 4)).await;
    assert_eq!(
        (e.status().as_u16(), e.code()),
        (401, ErrorCode::Unauthorized)
    );
    let e = refuse("j", "wrong", req("a:1", None, 4)).await;
    assert_eq!(
        (e.status().as_u16(), e.code()),
        (401, ErrorCode::Unauthorized)
    );
    assert!(
        e.to_string()
            .contains("token printed when the job was created"),
        "{e}"
    );
    let e = refuse("j", &token, req("a:1", None, 8)).await;
    assert_eq!(
        (e.status().as_u16(), e.code()),
        (400, ErrorCode::WorldSizeMismatch)
    );
    assert!(
        e.to_string().contains(" 8 ") && e.to_string().contains(" 4"),
        "{e}"
    );
    let e = refuse("j", &token, req("a:1", Some(4), 4)).await;
    assert_eq!(
        (e.status().as_u16(), e.code()),
        (400, ErrorCode::RankOutOfRange)
    );
    for address in [
        "",
        "a",
        "a:",
        "a:0",
        "a:70000",
        "0.0.0.0:80",
        "[::]:80",
        "::1:80",
        "-a:1",
        "a b:1",
        "a..b:1",
    ] {
        let e = refuse("j", &token, req(address, None, 4)).await;
        assert_eq!(
            (e.status().as_u16(), e.code()),
            (400, ErrorCode::InvalidAddress),
            "{address:?}"
        );
    }
    let long = format!("{}:1", "a".repeat(MAX_ADDRESS_LEN));
    assert_eq!(
        refuse("j", &token, req(&long, None, 4)).await.code(),
        ErrorCode::InvalidAddress
    );
    assert_eq!(f.waiting("j"), 0, "no refused join holds a rank");
    for address in [
        "127.0.0.1:29500",
        "[::1]:29500",
        "node-7.cluster.local:29500",
        "gpu_3:1",
    ] {
        check_address(address).unwrap();
    }
}

#[test]
fn job_definitions_are_checked() {
    let f = fixture();
    let create = |id: &str, world_size| {
        f.rendezvous.create(CreateSyncJob {
            id: id.into(),
            world_size,
            min_world_size: None,
            settle_ms: None,
        })
    };
    for (id, size) in [("ok", 0), ("ok", MAX_WORLD_SIZE + 1), ("a/b", 2), ("", 2)] {
        assert_eq!(
            create(id, size).unwrap_err().code(),
            ErrorCode::BadRequest,
            "{id} {size}"
        );
    }
    let info = create("big", MAX_WORLD_SIZE).unwrap();
    assert_eq!(info.token.as_ref().map(String::len), Some(64));
    assert_eq!(
        create("big", 2).unwrap_err().code(),
        ErrorCode::SyncJobExists
    );
    assert_eq!(
        f.rendezvous.delete("none").unwrap_err().code(),
        ErrorCode::NotFound
    );
}

#[test]
fn long_lists_of_missing_ranks_are_cut_short() {
    assert_eq!(name_ranks(&[3]), "rank [3] has");
    let many: Vec<u32> = (0..40).collect();
    let named = name_ranks(&many);
    assert!(named.starts_with("ranks [0, 1, 2,"), "{named}");
    assert!(named.ends_with("31, … and 8 more] have"), "{named}");
}

/// An elastic job's worlds: one forms at the minimum after the quiet time, the survivors of a
/// lost worker form the next one with the newest state at rank 0, newcomers alone wait while
/// that world is alive and are taken in when it re-forms, a full world forms at once, and a
/// world that stays below the minimum is told which ranks never came back.
#[tokio::test]
async fn elastic_worlds_form_from_survivors_and_newcomers_with_the_newest_state_at_rank_0() {
    let f = fixture();
    let create = |min, settle| {
        f.rendezvous.create(CreateSyncJob {
            id: "elastic".into(),
            world_size: 4,
            min_world_size: min,
            settle_ms: settle,
        })
    };
    for (min, settle) in [
        (Some(0), None),
        (Some(5), None),
        (None, Some(100)),
        (Some(2), Some(5)),
    ] {
        let err = create(min, settle).unwrap_err();
        assert!(matches!(err, ServerError::BadRequest(_)), "{err}");
    }
    let info = create(Some(2), Some(100)).unwrap();
    assert_eq!((info.min_world_size, info.settle_ms), (Some(2), Some(100)));
    let token = info.token.unwrap();
    let elastic = |address: &str, world_size| SyncJoinRequest {
        elastic: true,
        ..req(address, None, world_size)
    };
    let rejoin = |address: &str, generation, rank, committed| SyncJoinRequest {
        rejoin: Some(SyncRejoin {
            generation,
            rank,
            committed,
        }),
        ..elastic(address, 4)
    };
    let ranked = SyncJoinRequest {
        rank: Some(0),
        ..elastic("a:1", 4)
    };
    let err = answer(f.join("elastic", &token, ranked)).await.unwrap_err();
    assert!(err.to_string().contains("server gives ranks"), "{err}");
    let err = answer(f.join("elastic", &token, req("a:1", None, 4)))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("--elastic"), "{err}");

    // Three workers start; a world of three forms after the quiet time.
    let started = Instant::now();
    let first: Vec<_> = ["a:1", "b:1", "c:1"]
        .iter()
        .map(|a| f.join("elastic", &token, elastic(a, 4)))
        .collect();
    let mut worlds = Vec::new();
    for h in first {
        worlds.push(answer(h).await.unwrap());
    }
    assert!(started.elapsed() >= Duration::from_millis(100));
    assert!(worlds
        .iter()
        .all(|w| w.generation == 1 && w.world_size == 3));

    // Newcomers alone (two: the minimum) wait while world 1 is alive (it asks for the status).
    let newcomers = [
        f.spawn_join("elastic", &token, elastic("d:1", 4)).await,
        f.spawn_join("elastic", &token, elastic("e:1", 4)).await,
    ];
    let status = f.rendezvous.status("elastic").unwrap();
    assert_eq!((status.generation, status.waiting), (1, 2));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        newcomers.iter().all(|h| !h.is_finished()),
        "newcomers alone do not form a world"
    );

    // World 1's rank 1 died: ranks 0 and 2 come back (rank 2 with the newer state) and form
    // world 2 with the newcomers after the quiet time, rank 2's state at rank 0.
    let back = [
        f.join("elastic", &token, rejoin("a:2", 1, 0, 40)),
        f.join("elastic", &token, rejoin("c:2", 1, 2, 50)),
    ];
    let mut worlds = Vec::new();
    for h in newcomers.into_iter().chain(back) {
        worlds.push(answer(h).await.unwrap());
    }
    check_world(&worlds, &["c:2", "a:2", "d:1", "e:1"], 2);
    assert_eq!(
        (worlds[0].rank, worlds[1].rank),
        (2, 3),
        "newcomers come last, in order"
    );

    // World 2's ranks 0 and 1 come back without the newcomers: a world of two after the
    // quiet time.
    let back = [
        f.join("elastic", &token, rejoin("c:3", 2, 0, 60)),
        f.join("elastic", &token, rejoin("a:3", 2, 1, 60)),
    ];
    let mut worlds = Vec::new();
    for h in back {
        worlds.push(answer(h).await.unwrap());
    }
    check_world(&worlds, &["c:3", "a:3"], 3);

    // World 3's members both come back while three newcomers wait: world 4 forms at once, of
    // the largest size, and the newcomer it has no room for keeps waiting.
    let mut newcomers = Vec::new();
    for address in ["f:1", "g:1", "h:1"] {
        newcomers.push(f.spawn_join("elastic", &token, elastic(address, 4)).await);
    }
    let back = [
        f.join("elastic", &token, rejoin("a:4", 3, 1, 70)),
        f.join("elastic", &token, rejoin("c:4", 3, 0, 70)),
    ];
    let mut worlds = Vec::new();
    for h in back.into_iter().chain(newcomers.drain(..2)) {
        worlds.push(answer(h).await.unwrap());
    }
    check_world(&worlds, &["c:4", "a:4", "f:1", "g:1"], 4);
    assert_eq!(f.rendezvous.status("elastic").unwrap().waiting, 1);
    assert!(!newcomers[0].is_finished());
    // It holds its own place: leaving frees it.
    newcomers[0].abort();
    f.until(|| f.waiting("elastic") == 0).await;

    // A full first world forms at once, whatever the quiet time.
    let job = f.rendezvous.create(CreateSyncJob {
        id: "full".into(),
        world_size: 2,
        min_world_size: Some(1),
        settle_ms: Some(60_000),
    });
    let full = job.unwrap().token.unwrap();
    let pair = [
        f.join("full", &full, elastic("a:1", 2)),
        f.join("full", &full, elastic("b:1", 2)),
    ];
    for h in pair {
        assert_eq!(answer(h).await.unwrap().world_size, 2);
    }

    // Below the minimum: the one survivor of a world of three times out naming the lost ranks.
    let job = f.rendezvous.create(CreateSyncJob {
        id: "small".into(),
        world_size: 4,
        min_world_size: Some(3),
        settle_ms: Some(100),
    });
    let small = job.unwrap().token.unwrap();
    let three: Vec<_> = ["a:1", "b:1", "c:1"]
        .iter()
        .map(|a| f.join("small", &small, elastic(a, 4)))
        .collect();
    for h in three {
        answer(h).await.unwrap();
    }
    let alone = SyncJoinRequest {
        timeout_s: Some(1),
        ..rejoin("a:2", 1, 0, 10)
    };
    let err = answer(f.join("small", &small, alone)).await.unwrap_err();
    let message = err.to_string();
    assert!(
        message.contains("below its minimum world of 3")
            && message.contains("of world 1, ranks [1, 2] have not come back"),
        "{message}"
    );
}

#[tokio::test]
async fn a_finished_job_answers_its_waiting_and_later_joins_that_it_finished() {
    let f = fixture();
    let info = f
        .rendezvous
        .create(CreateSyncJob {
            id: "done".into(),
            world_size: 2,
            min_world_size: Some(1),
            settle_ms: Some(100),
        })
        .unwrap();
    let token = info.token.unwrap();
    let elastic = |address: &str| SyncJoinRequest {
        elastic: true,
        ..req(address, None, 2)
    };
    let pair = [
        f.join("done", &token, elastic("a:1")),
        f.join("done", &token, elastic("b:1")),
    ];
    for h in pair {
        answer(h).await.unwrap();
    }
    // A newcomer waits for the running world's next commit; the world finishes instead.
    let late = f.spawn_join("done", &token, elastic("c:1")).await;
    assert!(!f.rendezvous.status("done").unwrap().finished);
    f.rendezvous.finish("done").unwrap();
    for err in [
        answer(late).await.unwrap_err(),
        answer(f.join("done", &token, elastic("d:1")))
            .await
            .unwrap_err(),
    ] {
        assert_eq!(
            (err.status(), err.code()),
            (axum::http::StatusCode::GONE, ErrorCode::JobFinished)
        );
        assert!(err.to_string().contains("finished training"), "{err}");
    }
    // Durable, shown, and idempotent.
    f.rendezvous.finish("done").unwrap();
    let status = f.rendezvous.status("done").unwrap();
    assert!(status.finished && status.generation == 1);
    assert!(f.rendezvous.list()[0].finished);
    let stored = f.store.sync_jobs().unwrap();
    assert!(stored[0].finished && stored[0].generations == 1);
    let reopened = Rendezvous::open(f.store.clone(), Arc::new(ServerMetrics::default())).unwrap();
    assert!(reopened.status("done").unwrap().finished);
    assert!(f.rendezvous.finish("nope").is_err());
}
