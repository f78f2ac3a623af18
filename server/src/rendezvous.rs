//! The rendezvous of synchronous allreduce jobs.
//!
//! A sync job is a fixed-size world of workers (ranks `0..world_size`) that average among
//! themselves, neighbour to neighbour around a ring, with the server nowhere in the data path.
//! The server's only part is the introduction: each worker joins its job here with the address
//! where it accepts its ring neighbour, its request is held until every rank has joined, and then
//! every worker learns the same world — a generation number, a random session string, its own
//! rank and every peer's address by rank — and talks to the others directly.
//!
//! Job definitions (id, world size, the hash of the job's token, how many worlds it has formed)
//! persist in sled. The world being formed lives in memory only: it is made of held HTTP
//! requests, which a restart ends anyway, and a worker whose join failed simply joins again.
//!
//! A rank's slot is freed whenever its request ends without a world: at its timeout (answered
//! 408, naming the ranks that never came), when a newer worker joins the same rank (the older
//! one is answered 409 `replaced`), when the job is deleted (410), and when the worker's
//! connection closes — the handler's future is dropped and [`SlotGuard`] frees the slot — so a
//! dead worker never holds a rank. Once the last rank joins, the forming world is emptied, so the
//! next set of joins (the job restarted after a failure) forms the next generation.
//!
//! One lock guards every job's forming world; everything done under it is a few memory
//! operations (and, when a world forms, one in-memory sled insert). The flush that makes a new
//! generation count durable happens after the lock is released and before anyone is answered.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use hora_common::wire::{self, CreateSyncJob, SyncJobInfo, SyncJoinRequest, SyncWorld};
use tokio::sync::oneshot;

use crate::auth;
use crate::error::ServerError;
use crate::metrics::ServerMetrics;
use crate::store::{Store, StoreError, SyncJobRecord};

/// The largest world a job may have.
pub const MAX_WORLD_SIZE: u32 = 4096;
/// How long a join waits for the rest of the world when the worker does not say.
pub const DEFAULT_JOIN_TIMEOUT_S: u32 = 30;
/// The longest a join is held, whatever the worker asks for.
pub const MAX_JOIN_TIMEOUT_S: u32 = 600;
/// The longest `host:port` a worker may give (a DNS name is at most 253 bytes).
pub const MAX_ADDRESS_LEN: usize = 255;
/// Missing ranks named in a timeout message; the rest are counted.
const MAX_RANKS_NAMED: usize = 32;

/// A formed world, shared by all its members until each answer is written out: the peer list is
/// held once, not once per worker (a world of 4096 would otherwise copy 4096² addresses).
#[derive(Debug, Clone)]
struct FormedWorld {
    generation: u64,
    session: Arc<str>,
    world_size: u32,
    peers: Arc<[String]>,
}

impl FormedWorld {
    fn for_rank(&self, rank: u32) -> SyncWorld {
        SyncWorld {
            generation: self.generation,
            session: self.session.to_string(),
            rank,
            world_size: self.world_size,
            peers: self.peers.to_vec(),
        }
    }
}

type Answer = Result<FormedWorld, ServerError>;

/// A worker whose join is being held.
struct Waiter {
    /// Tells this join apart from a later join of the same rank.
    id: u64,
    address: String,
    /// The server chose the rank (the worker gave none).
    assigned: bool,
    answer: oneshot::Sender<Answer>,
}

struct Job {
    record: SyncJobRecord,
    /// The world being formed: who holds each rank.
    slots: Vec<Option<Waiter>>,
}

impl Job {
    fn new(record: SyncJobRecord) -> Self {
        let slots = (0..record.world_size).map(|_| None).collect();
        Job { record, slots }
    }

    fn waiting(&self) -> u32 {
        self.slots.iter().filter(|s| s.is_some()).count() as u32
    }

    fn missing(&self) -> Vec<u32> {
        (0..self.record.world_size)
            .filter(|&r| self.slots[r as usize].is_none())
            .collect()
    }

    /// Whether the join `waiter` still holds `rank`.
    fn holds(&self, rank: u32, waiter: u64) -> bool {
        self.slots
            .get(rank as usize)
            .and_then(Option::as_ref)
            .is_some_and(|w| w.id == waiter)
    }

    /// Empties the forming world; the waiters in rank order.
    fn take_waiters(&mut self) -> Vec<Waiter> {
        self.slots.iter_mut().filter_map(Option::take).collect()
    }

    fn info(&self) -> SyncJobInfo {
        SyncJobInfo {
            id: self.record.id.clone(),
            world_size: self.record.world_size,
            token: None,
            generations: self.record.generations,
            waiting: self.waiting(),
        }
    }
}

/// A world that has just become complete, to be made durable and announced outside the lock.
struct Completed {
    job: String,
    world: FormedWorld,
    waiters: Vec<Waiter>,
    /// Whether the new generation count reached sled.
    recorded: Result<(), StoreError>,
}

/// What a join learns from the forming world as it enters.
struct Entered {
    rank: u32,
    waiter: u64,
    answer: oneshot::Receiver<Answer>,
    completed: Option<Completed>,
}

/// The sync jobs and the worlds they are forming.
pub struct Rendezvous {
    store: Arc<Store>,
    metrics: Arc<ServerMetrics>,
    jobs: Mutex<BTreeMap<String, Job>>,
    next_waiter: AtomicU64,
}

impl Rendezvous {
    /// Loads the job definitions; every job starts with an empty world.
    pub fn open(store: Arc<Store>, metrics: Arc<ServerMetrics>) -> Result<Self, StoreError> {
        let jobs = store
            .sync_jobs()?
            .into_iter()
            .map(|record| (record.id.clone(), Job::new(record)))
            .collect();
        Ok(Rendezvous {
            store,
            metrics,
            jobs: Mutex::new(jobs),
            next_waiter: AtomicU64::new(0),
        })
    }

    /// Every critical section leaves the map consistent, so a panic elsewhere while holding the
    /// lock leaves nothing half-done behind; carrying on beats failing every later join (and a
    /// panic inside [`SlotGuard`]'s drop, which may run while unwinding, would abort).
    fn jobs(&self) -> MutexGuard<'_, BTreeMap<String, Job>> {
        self.jobs.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Creates a job; the answer carries its token, which is never shown again.
    pub fn create(&self, req: CreateSyncJob) -> Result<SyncJobInfo, ServerError> {
        if !wire::valid_id(&req.id) {
            return Err(ServerError::BadRequest(format!(
                "sync job id `{}` must be 1-64 of [A-Za-z0-9_.-]",
                req.id
            )));
        }
        if !(1..=MAX_WORLD_SIZE).contains(&req.world_size) {
            return Err(ServerError::BadRequest(format!(
                "world_size must be between 1 and {MAX_WORLD_SIZE}, not {}",
                req.world_size
            )));
        }
        let token = auth::new_secret()?;
        let record = SyncJobRecord {
            id: req.id,
            world_size: req.world_size,
            token_hash: auth::hash_secret(&token),
            generations: 0,
        };
        {
            let mut jobs = self.jobs();
            if jobs.contains_key(&record.id) || !self.store.create_sync_job(&record)? {
                return Err(ServerError::conflict(
                    "sync_job_exists",
                    format!(
                        "sync job `{}` exists already: delete it first or pick another id",
                        record.id
                    ),
                ));
            }
            jobs.insert(record.id.clone(), Job::new(record.clone()));
        }
        self.store.flush()?;
        tracing::info!(job = %record.id, world_size = record.world_size, "sync job created");
        Ok(SyncJobInfo {
            id: record.id,
            world_size: record.world_size,
            token: Some(token),
            generations: 0,
            waiting: 0,
        })
    }

    /// Every job, by id (no tokens).
    pub fn list(&self) -> Vec<SyncJobInfo> {
        self.jobs().values().map(Job::info).collect()
    }

    /// Deletes a job; workers waiting in its world are answered 410 `job_deleted`.
    pub fn delete(&self, id: &str) -> Result<(), ServerError> {
        let waiters = {
            let mut jobs = self.jobs();
            let Some(mut job) = jobs.remove(id) else {
                return Err(ServerError::NotFound(format!("no sync job `{id}`")));
            };
            match self.store.remove_sync_job(id) {
                Ok(_) => job.take_waiters(),
                Err(e) => {
                    jobs.insert(id.to_string(), job);
                    return Err(e.into());
                }
            }
        };
        let waiting = waiters.len();
        for waiter in waiters {
            let _ = waiter.answer.send(Err(ServerError::Gone {
                code: "job_deleted",
                message: format!("sync job `{id}` was deleted while this worker waited"),
            }));
        }
        self.store.flush()?;
        tracing::info!(job = %id, waiting, "sync job deleted");
        Ok(())
    }

    /// Joins the world `job` is forming and waits until it is complete (the answer), the
    /// worker's timeout passes (408), it is replaced by a newer join of its rank (409) or the job
    /// is deleted (410). Dropping the future frees the worker's rank.
    pub async fn join(
        &self,
        job: &str,
        token: &str,
        req: SyncJoinRequest,
    ) -> Result<SyncWorld, ServerError> {
        let timeout_s = req
            .timeout_s
            .unwrap_or(DEFAULT_JOIN_TIMEOUT_S)
            .clamp(1, MAX_JOIN_TIMEOUT_S);
        let Entered {
            rank,
            waiter,
            mut answer,
            completed,
        } = self.enter(job, token, req)?;
        let _guard = SlotGuard {
            rendezvous: self,
            job,
            rank,
            waiter,
        };
        if let Some(completed) = completed {
            self.announce(completed);
        }
        let timeout = Duration::from_secs(u64::from(timeout_s));
        let answer = match tokio::time::timeout(timeout, &mut answer).await {
            Ok(answer) => answer,
            Err(_elapsed) => match self.time_out(job, rank, waiter, timeout_s) {
                Some(refusal) => return Err(refusal),
                // The world formed, or this worker was replaced, just as its time ran out: the
                // answer was (or is being) sent.
                None => answer.await,
            },
        };
        let world = answer.map_err(|_| {
            ServerError::internal("the rendezvous dropped a waiting worker without an answer")
        })??;
        Ok(world.for_rank(rank))
    }

    /// Checks a join and takes a rank for it; completes the world if it was the last one.
    fn enter(
        &self,
        job_id: &str,
        token: &str,
        req: SyncJoinRequest,
    ) -> Result<Entered, ServerError> {
        let mut jobs = self.jobs();
        let job = jobs
            .get_mut(job_id)
            .ok_or_else(|| ServerError::NotFound(format!("no sync job `{job_id}`")))?;
        if !auth::verify_secret(token, &job.record.token_hash) {
            return Err(ServerError::Unauthorized(format!(
                "invalid token for sync job `{job_id}`: use the token printed when the job was \
                 created (hora-server admin sync-create)"
            )));
        }
        let world_size = job.record.world_size;
        if req.world_size != world_size {
            return Err(ServerError::invalid(
                "world_size_mismatch",
                format!(
                    "this worker was launched for a world of {} but sync job `{job_id}` has a \
                     world of {world_size}: launch every worker with world size {world_size}",
                    req.world_size
                ),
            ));
        }
        check_address(&req.address)?;
        let rank = match req.rank {
            Some(rank) if rank >= world_size => {
                return Err(ServerError::invalid(
                    "rank_out_of_range",
                    format!(
                        "rank {rank} is out of range: sync job `{job_id}` has ranks 0 to {}",
                        world_size - 1
                    ),
                ))
            }
            Some(rank) => match &job.slots[rank as usize] {
                Some(holder) if holder.assigned => {
                    return Err(ServerError::conflict(
                        "rank_taken",
                        format!(
                            "rank {rank} of sync job `{job_id}` was given to a worker that joined \
                             without a rank: give every worker of a job its rank, or none"
                        ),
                    ))
                }
                _ => rank,
            },
            // A free slot always exists: a world whose last slot fills is formed and emptied
            // before the lock is released.
            None => job
                .slots
                .iter()
                .position(Option::is_none)
                .ok_or_else(|| ServerError::internal("a complete world was left unformed"))?
                as u32,
        };
        let (send, answer) = oneshot::channel();
        let waiter = self.next_waiter.fetch_add(1, Ordering::Relaxed);
        let replaced = job.slots[rank as usize].replace(Waiter {
            id: waiter,
            address: req.address,
            assigned: req.rank.is_none(),
            answer: send,
        });
        if let Some(old) = replaced {
            tracing::info!(job = %job_id, rank, "rank joined again: the earlier worker is replaced");
            let _ = old.answer.send(Err(ServerError::conflict(
                "replaced",
                format!("rank {rank} was joined again by a newer worker"),
            )));
        }
        tracing::debug!(job = %job_id, rank, waiting = job.waiting(), world_size, "worker joined");
        let completed = job
            .slots
            .iter()
            .all(Option::is_some)
            .then(|| self.complete(job));
        Ok(Entered {
            rank,
            waiter,
            answer,
            completed,
        })
    }

    /// Forms the world of a job whose every rank has joined and empties its slots. The sled write
    /// happens here, under the lock, so two generations of one job are recorded in order.
    fn complete(&self, job: &mut Job) -> Completed {
        let waiters = job.take_waiters();
        job.record.generations += 1;
        let recorded = self.store.put_sync_job(&job.record);
        let world = FormedWorld {
            generation: job.record.generations,
            session: format!("{:032x}", rand::random::<u128>()).into(),
            world_size: job.record.world_size,
            peers: waiters.iter().map(|w| w.address.clone()).collect(),
        };
        Completed {
            job: job.record.id.clone(),
            world,
            waiters,
            recorded,
        }
    }

    /// Makes a formed world's generation durable, then answers its members. Synchronous, so
    /// that no dropped future can come between taking the waiters and answering them.
    fn announce(&self, completed: Completed) {
        let Completed {
            job,
            world,
            waiters,
            recorded,
        } = completed;
        if let Err(e) = recorded.and_then(|()| self.store.flush()) {
            tracing::error!(job = %job, error = %e, "could not record a new generation");
            for waiter in waiters {
                let _ = waiter.answer.send(Err(ServerError::internal(format!(
                    "recording generation {} of sync job `{job}` failed: {e}",
                    world.generation
                ))));
            }
            return;
        }
        for waiter in waiters {
            let _ = waiter.answer.send(Ok(world.clone()));
        }
        self.metrics.sync_world_formed(&job);
        tracing::info!(job = %job, generation = world.generation, world_size = world.world_size, "world formed");
    }

    /// Frees the rank of a join whose time ran out and says what was missing; `None` if the join
    /// no longer holds its rank (it has been answered meanwhile).
    fn time_out(
        &self,
        job_id: &str,
        rank: u32,
        waiter: u64,
        timeout_s: u32,
    ) -> Option<ServerError> {
        let (joined, world_size, missing) = {
            let mut jobs = self.jobs();
            let job = jobs.get_mut(job_id)?;
            if !job.holds(rank, waiter) {
                return None;
            }
            let summary = (job.waiting(), job.record.world_size, job.missing());
            job.slots[rank as usize] = None;
            summary
        };
        self.metrics.sync_join_timed_out(job_id);
        tracing::info!(job = %job_id, rank, joined, world_size, "rendezvous timed out");
        Some(ServerError::Timeout {
            code: "rendezvous_timeout",
            message: format!(
                "the world of job {job_id} is incomplete after {timeout_s} s: {joined} of \
                 {world_size} workers joined; {} not joined",
                name_ranks(&missing)
            ),
        })
    }
}

/// Frees a join's rank when its request ends without a world — above all when the worker's
/// connection closes and the handler's future is dropped mid-wait. A join that was answered no
/// longer holds its rank, and then this does nothing.
struct SlotGuard<'a> {
    rendezvous: &'a Rendezvous,
    job: &'a str,
    rank: u32,
    waiter: u64,
}

impl Drop for SlotGuard<'_> {
    fn drop(&mut self) {
        let mut jobs = self.rendezvous.jobs();
        if let Some(job) = jobs.get_mut(self.job) {
            if job.holds(self.rank, self.waiter) {
                job.slots[self.rank as usize] = None;
                tracing::info!(job = %self.job, rank = self.rank, "a worker left before its world was complete; its rank is free again");
            }
        }
    }
}

/// "ranks [2, 3] have" / "rank [5] has", naming at most [`MAX_RANKS_NAMED`].
fn name_ranks(ranks: &[u32]) -> String {
    let noun = if ranks.len() == 1 { "rank" } else { "ranks" };
    let verb = if ranks.len() == 1 { "has" } else { "have" };
    if ranks.len() <= MAX_RANKS_NAMED {
        return format!("{noun} {ranks:?} {verb}");
    }
    let named: Vec<String> = ranks[..MAX_RANKS_NAMED]
        .iter()
        .map(u32::to_string)
        .collect();
    format!(
        "{noun} [{}, … and {} more] {verb}",
        named.join(", "),
        ranks.len() - MAX_RANKS_NAMED
    )
}

/// Checks that a worker's address is something its peers can connect to: `ip:port` (IPv6 in
/// brackets) or `hostname:port`, with a port other than 0 and not the unspecified address.
fn check_address(address: &str) -> Result<(), ServerError> {
    let bad = |why: &str| {
        Err(ServerError::invalid(
            "invalid_address",
            format!(
                "address `{address}` {why}: give the `host:port` where this worker's ring \
                 neighbour can reach it (IPv6 in brackets: `[::1]:29500`)"
            ),
        ))
    };
    if address.len() > MAX_ADDRESS_LEN {
        return Err(ServerError::invalid(
            "invalid_address",
            format!(
                "the address is {} bytes long; at most {MAX_ADDRESS_LEN} are allowed",
                address.len()
            ),
        ));
    }
    if let Ok(socket) = address.parse::<SocketAddr>() {
        if socket.ip().is_unspecified() {
            return bad(
                "is the unspecified address, where a worker listens but no peer can connect",
            );
        }
        if socket.port() == 0 {
            return bad("has port 0");
        }
        return Ok(());
    }
    let Some((host, port)) = address.rsplit_once(':') else {
        return bad("has no port");
    };
    match port.parse::<u16>() {
        Ok(0) => return bad("has port 0"),
        Ok(_) => {}
        Err(_) => return bad("does not end in a port number"),
    }
    let label_ok = |l: &str| {
        (1..=63).contains(&l.len())
            && l.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    if host.is_empty() || host.len() > 253 || !host.split('.').all(label_ok) {
        return bad("is neither an IP address with a port nor a host name with a port");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
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
        let store = Arc::new(SledStore::open(dir.path()).unwrap());
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
        assert_eq!(err.code(), "rank_taken");
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
        assert_eq!(err.code(), "replaced");
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
                    ..req("b:1", Some(1), 4)
                },
            )
            .await
            .unwrap_err();
        assert!(started.elapsed() >= Duration::from_secs(1));
        assert_eq!(err.status(), axum::http::StatusCode::REQUEST_TIMEOUT);
        assert_eq!(err.code(), "rendezvous_timeout");
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
            (axum::http::StatusCode::GONE, "job_deleted")
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
        let reopened =
            Rendezvous::open(f.store.clone(), Arc::new(ServerMetrics::default())).unwrap();
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
        let e = refuse("nope", &token, req("a:1", None, 4)).await;
        assert_eq!((e.status().as_u16(), e.code()), (404, "not_found"));
        let e = refuse("j", "wrong", req("a:1", None, 4)).await;
        assert_eq!((e.status().as_u16(), e.code()), (401, "unauthorized"));
        assert!(
            e.to_string()
                .contains("token printed when the job was created"),
            "{e}"
        );
        let e = refuse("j", &token, req("a:1", None, 8)).await;
        assert_eq!(
            (e.status().as_u16(), e.code()),
            (400, "world_size_mismatch")
        );
        assert!(
            e.to_string().contains(" 8 ") && e.to_string().contains(" 4"),
            "{e}"
        );
        let e = refuse("j", &token, req("a:1", Some(4), 4)).await;
        assert_eq!((e.status().as_u16(), e.code()), (400, "rank_out_of_range"));
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
                (400, "invalid_address"),
                "{address:?}"
            );
        }
        let long = format!("{}:1", "a".repeat(MAX_ADDRESS_LEN));
        assert_eq!(
            refuse("j", &token, req(&long, None, 4)).await.code(),
            "invalid_address"
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
            })
        };
        for (id, size) in [("ok", 0), ("ok", MAX_WORLD_SIZE + 1), ("a/b", 2), ("", 2)] {
            assert_eq!(
                create(id, size).unwrap_err().code(),
                "bad_request",
                "{id} {size}"
            );
        }
        let info = create("big", MAX_WORLD_SIZE).unwrap();
        assert_eq!(info.token.as_ref().map(String::len), Some(64));
        assert_eq!(create("big", 2).unwrap_err().code(), "sync_job_exists");
        assert_eq!(f.rendezvous.delete("none").unwrap_err().code(), "not_found");
    }

    #[test]
    fn long_lists_of_missing_ranks_are_cut_short() {
        assert_eq!(name_ranks(&[3]), "rank [3] has");
        let many: Vec<u32> = (0..40).collect();
        let named = name_ranks(&many);
        assert!(named.starts_with("ranks [0, 1, 2,"), "{named}");
        assert!(named.ends_with("31, … and 8 more] have"), "{named}");
    }
}
