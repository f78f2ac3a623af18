//! The rendezvous of synchronous allreduce jobs.
//!
//! A sync job is a world of workers (ranks `0..world_size`; an elastic job's worlds are of any
//! size from its minimum, below) that average among themselves, neighbour to neighbour around a
//! ring, with the server nowhere in the data path.
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
//! **Elastic jobs** (`min_world_size`) form worlds of any size from the minimum to
//! `world_size`: a world forms with every worker waiting once `world_size` have joined, or once at
//! least the minimum have and nobody joined for `settle_ms`. The server assigns ranks: first the
//! workers that were in a world (`rejoin`), the one with the newest committed state as rank 0
//! (it broadcasts that state to the others), then newcomers in the order they came. Newcomers
//! alone never form a world while the last one is alive (its members rejoin, or it asks for
//! [`Rendezvous::status`] at its commits, within [`stale_after`]): they wait for the running
//! world to take them in at its next commit. A join that times out below the minimum is told
//! which ranks of the last world never came back.
//!
//! One lock guards every job's forming world; everything done under it is a few memory
//! operations (and, when a world forms, one in-memory sled insert). The flush that makes a new
//! generation count durable happens after the lock is released and before anyone is answered.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use hora_common::wire::{
    self, CreateSyncJob, ErrorCode, SyncJobInfo, SyncJoinRequest, SyncRejoin, SyncStatus, SyncWorld,
};
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::auth;
use crate::error::ServerError;
use crate::metrics::ServerMetrics;
use crate::store::{ElasticSyncJob, Store, StoreError, SyncJobRecord};

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
/// An elastic job's quiet time before a world smaller than the largest forms, by default.
pub const DEFAULT_SETTLE_MS: u32 = 1000;
/// The range of quiet times accepted.
pub const SETTLE_MS: std::ops::RangeInclusive<u32> = 10..=60_000;

/// How long an elastic job's last world may go unheard of (no member rejoined, no status asked:
/// its rank 0 asks at every commit) before newcomers alone may form the next one, as when every
/// worker of the job was restarted: ten quiet times, at least a minute.
fn stale_after(elastic: ElasticSyncJob) -> Duration {
    Duration::from_millis(u64::from(elastic.settle_ms) * 10).max(Duration::from_secs(60))
}

/// A formed world, shared by all its members until each answer is written out: the peer list is
/// held once, not once per worker (a world of 4096 would otherwise copy 4096² addresses).
#[derive(Clone)]
struct FormedWorld {
    generation: u64,
    session: Arc<str>,
    world_size: u32,
    peers: Arc<[String]>,
}

impl std::fmt::Debug for FormedWorld {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FormedWorld")
            .field("generation", &self.generation)
            .field("session", &hora_common::wire::Redacted)
            .field("world_size", &self.world_size)
            .field("peers", &self.peers)
            .finish()
    }
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

/// A formed world and the rank in it of the worker answered.
type Answer = Result<(FormedWorld, u32), ServerError>;

/// A worker whose join is being held.
struct Waiter {
    /// Tells this join apart from a later join of the same rank.
    id: u64,
    address: String,
    /// The server chose the rank (the worker gave none).
    assigned: bool,
    /// An elastic job's worker that was in a world.
    rejoin: Option<SyncRejoin>,
    /// When it joined (an elastic world forms a quiet time after the latest join still held).
    joined: Instant,
    answer: oneshot::Sender<Answer>,
}

struct Job {
    record: SyncJobRecord,
    /// The world being formed: who holds each rank (an elastic job's final ranks are given when
    /// it forms; until then a slot is only a place).
    slots: Vec<Option<Waiter>>,
    /// The last world formed since this server started (for the admin's view).
    formed: Option<wire::SyncWorldInfo>,
    /// When the last world formed was last heard of: formed, a member rejoining, or a status
    /// asked for.
    last_heard: Option<Instant>,
}

impl Job {
    fn new(record: SyncJobRecord) -> Self {
        // An elastic job's running world may re-form while as many newcomers again wait: those
        // the world has no room for keep their places for the next.
        let places = match record.elastic {
            Some(_) => record.world_size * 2,
            None => record.world_size,
        };
        let slots = (0..places).map(|_| None).collect();
        Job {
            record,
            slots,
            formed: None,
            last_heard: None,
        }
    }

    /// Whether the world being formed is complete without waiting any longer: every rank of a
    /// fixed job; an elastic job's first world at its largest, or every member of its last
    /// world back (it re-forms to take newcomers in).
    fn complete_now(&self) -> bool {
        let Some(_) = self.record.elastic else {
            return self.slots.iter().all(Option::is_some);
        };
        let current = self.record.generations;
        if current == 0 {
            return self.waiting() >= self.record.world_size;
        }
        let Some(formed) = self.formed.as_ref().filter(|f| f.generation == current) else {
            return false;
        };
        // Every rank of the last world, each counted once.
        let back: std::collections::BTreeSet<u32> = self
            .slots
            .iter()
            .flatten()
            .filter_map(|w| w.rejoin.filter(|r| r.generation == current).map(|r| r.rank))
            .filter(|&rank| (rank as usize) < formed.members.len())
            .collect();
        back.len() >= formed.members.len()
    }

    /// When an elastic world of the waiting workers may form, if it may at all: after the quiet
    /// time, with at least the minimum waiting, and with one of the last world's members among
    /// them unless that world is gone quiet (or there was none).
    fn settles_at(&self, now: Instant) -> Option<Instant> {
        let elastic = self.record.elastic?;
        if self.waiting() < elastic.min_world_size {
            return None;
        }
        let last_join = self.slots.iter().flatten().map(|w| w.joined).max()?;
        let settled = last_join + Duration::from_millis(u64::from(elastic.settle_ms));
        let current = self.record.generations;
        let member_back = self.slots.iter().flatten().any(|w| {
            w.rejoin
                .is_some_and(|r| r.generation == current && current > 0)
        });
        let stale = match self.last_heard {
            None => settled,
            Some(heard) => heard + stale_after(elastic),
        };
        let at = if current == 0 || member_back {
            settled
        } else {
            settled.max(stale)
        };
        Some(at.max(now))
    }

    /// The last world's ranks that have not joined again (an elastic job's lost workers).
    fn not_back(&self) -> Vec<u32> {
        let current = self.record.generations;
        let Some(formed) = self.formed.as_ref().filter(|f| f.generation == current) else {
            return Vec::new();
        };
        let back: Vec<u32> = self
            .slots
            .iter()
            .flatten()
            .filter_map(|w| w.rejoin.filter(|r| r.generation == current).map(|r| r.rank))
            .collect();
        formed
            .members
            .iter()
            .map(|m| m.rank)
            .filter(|r| !back.contains(r))
            .collect()
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
            min_world_size: self.record.elastic.map(|e| e.min_world_size),
            settle_ms: self.record.elastic.map(|e| e.settle_ms),
            token: None,
            generations: self.record.generations,
            waiting: self.waiting(),
            members: self
                .slots
                .iter()
                .enumerate()
                .filter_map(|(rank, w)| {
                    w.as_ref().map(|w| wire::SyncMember {
                        rank: rank as u32,
                        address: w.address.clone(),
                    })
                })
                .collect(),
            formed: self.formed.clone(),
            finished: self.record.finished,
        }
    }
}

/// A world that has just become complete, to be made durable and announced outside the lock.
struct Completed {
    job: String,
    world: FormedWorld,
    waiters: Vec<Waiter>,
    /// The job's record with the new generation count, to be written.
    record: SyncJobRecord,
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
    /// The generation each job's stored record has, held while one is written (on a blocking
    /// thread): generations are recorded in order, never an older count over a newer one.
    recorded: Arc<Mutex<BTreeMap<String, u64>>>,
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
            recorded: Arc::default(),
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
        let elastic = match (req.min_world_size, req.settle_ms) {
            (None, None) => None,
            (None, Some(_)) => {
                return Err(ServerError::BadRequest(
                    "settle_ms is for elastic jobs: give min_world_size too".into(),
                ))
            }
            (Some(min), settle) => {
                if !(1..=req.world_size).contains(&min) {
                    return Err(ServerError::BadRequest(format!(
                        "min_world_size must be between 1 and the world size {}, not {min}",
                        req.world_size
                    )));
                }
                let settle_ms = settle.unwrap_or(DEFAULT_SETTLE_MS);
                if !SETTLE_MS.contains(&settle_ms) {
                    return Err(ServerError::BadRequest(format!(
                        "settle_ms must be between {} and {}, not {settle_ms}",
                        SETTLE_MS.start(),
                        SETTLE_MS.end()
                    )));
                }
                Some(ElasticSyncJob {
                    min_world_size: min,
                    settle_ms,
                })
            }
        };
        let token = auth::new_secret()?;
        let record = SyncJobRecord {
            id: req.id,
            world_size: req.world_size,
            token_hash: auth::hash_secret(&token),
            generations: 0,
            elastic,
            finished: false,
        };
        {
            let mut jobs = self.jobs();
            if jobs.contains_key(&record.id) || !self.store.create_sync_job(&record)? {
                return Err(ServerError::conflict(
                    ErrorCode::SyncJobExists,
                    format!(
                        "sync job `{}` exists already: delete it first or pick another id",
                        record.id
                    ),
                ));
            }
            jobs.insert(record.id.clone(), Job::new(record.clone()));
        }
        // (A job of this id deleted before counts its generations from 0 again.)
        self.recorded
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&record.id);
        self.store.flush()?;
        tracing::info!(job = %record.id, world_size = record.world_size, elastic = ?record.elastic, "sync job created");
        Ok(SyncJobInfo {
            id: record.id,
            world_size: record.world_size,
            min_world_size: record.elastic.map(|e| e.min_world_size),
            settle_ms: record.elastic.map(|e| e.settle_ms),
            token: Some(token),
            generations: 0,
            waiting: 0,
            members: Vec::new(),
            formed: None,
            finished: false,
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
            // (Under the recording lock: a world formed just before, whose announcement is
            // still to write its record, must not bring the job back.)
            let mut recorded = self.recorded.lock().unwrap_or_else(PoisonError::into_inner);
            match self.store.remove_sync_job(id) {
                Ok(_) => {
                    recorded.insert(id.to_string(), u64::MAX);
                    job.take_waiters()
                }
                Err(e) => {
                    jobs.insert(id.to_string(), job);
                    return Err(e.into());
                }
            }
        };
        let waiting = waiters.len();
        for waiter in waiters {
            let _ = waiter.answer.send(Err(ServerError::Gone {
                code: ErrorCode::JobDeleted,
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
        let deadline = Instant::now() + Duration::from_secs(u64::from(timeout_s));
        let answer = loop {
            // An elastic world forms when its quiet time has passed: whichever waiter wakes
            // then forms it (the others find it formed, or a later join moved the time on).
            let wake = self.settles_at(job).map_or(deadline, |at| at.min(deadline));
            tokio::select! {
                answer = &mut answer => break answer,
                () = tokio::time::sleep_until(wake) => {}
            }
            if Instant::now() >= deadline {
                match self.time_out(job, rank, waiter, timeout_s) {
                    Some(refusal) => return Err(refusal),
                    // The world formed, or this worker was replaced, just as its time ran out:
                    // the answer was (or is being) sent.
                    None => break answer.await,
                }
            }
            if let Some(completed) = self.settle(job) {
                self.announce(completed);
            }
        };
        let (world, rank) = answer.map_err(|_| {
            ServerError::internal("the rendezvous dropped a waiting worker without an answer")
        })??;
        Ok(world.for_rank(rank))
    }

    /// Makes a formed world durable and answers its members, on a blocking thread and to its
    /// end (answering every member) even if the request that formed it is dropped meanwhile.
    fn announce(&self, completed: Completed) {
        let (store, metrics) = (self.store.clone(), self.metrics.clone());
        let recorded = self.recorded.clone();
        tokio::task::spawn_blocking(move || announce(&*store, &metrics, &recorded, completed));
    }

    /// When the world `job_id` is forming may form without another join (elastic jobs).
    fn settles_at(&self, job_id: &str) -> Option<Instant> {
        self.jobs()
            .get(job_id)
            .and_then(|job| job.settles_at(Instant::now()))
    }

    /// Forms an elastic job's world if its quiet time has passed.
    fn settle(&self, job_id: &str) -> Option<Completed> {
        let mut jobs = self.jobs();
        let job = jobs.get_mut(job_id)?;
        let now = Instant::now();
        job.settles_at(now)
            .filter(|&at| at <= now)
            .map(|_| self.complete(job))
    }

    /// An elastic job's generation and waiting workers, for a running world at its commit;
    /// asking keeps the world counted as alive (see [`stale_after`]).
    pub fn status(&self, job_id: &str) -> Result<SyncStatus, ServerError> {
        let mut jobs = self.jobs();
        let job = jobs
            .get_mut(job_id)
            .ok_or_else(|| unknown_job_or_token(job_id))?;
        job.last_heard = Some(Instant::now());
        Ok(SyncStatus {
            generation: job.record.generations,
            waiting: job.waiting(),
            finished: job.record.finished,
        })
    }

    /// Marks `job_id`'s training finished (its rank 0 says so once every rank is done): it
    /// forms no more worlds, the workers waiting to join are answered 410 `job_finished`, and
    /// so is every later join (a worker its launcher retried after the others finished has
    /// nothing to wait for). Durable before it returns; saying it again changes nothing.
    pub fn finish(&self, job_id: &str) -> Result<(), ServerError> {
        let (record, waiters) = {
            let mut jobs = self.jobs();
            let job = jobs
                .get_mut(job_id)
                .ok_or_else(|| unknown_job_or_token(job_id))?;
            if job.record.finished {
                return Ok(());
            }
            let mut record = job.record.clone();
            record.finished = true;
            // (Under the recording lock, as a deletion: a world formed just before, whose
            // announcement is still to write its record, must not write over this one. Durable
            // before anything changes here, so a failed write is tried again by a retry; like a
            // deletion, it holds the jobs lock, once in a job's life.)
            let mut recorded = self.recorded.lock().unwrap_or_else(PoisonError::into_inner);
            self.store
                .put_sync_job(&record)
                .and_then(|()| self.store.flush())?;
            recorded.insert(job_id.to_string(), u64::MAX);
            job.record = record.clone();
            (record, job.take_waiters())
        };
        let waiting = waiters.len();
        for waiter in waiters {
            let _ = waiter.answer.send(Err(finished(job_id)));
        }
        tracing::info!(job = %job_id, generations = record.generations, waiting, "sync job finished");
        Ok(())
    }

    /// Whether `token` is the token of sync job `job_id`. An unknown job is refused exactly as
    /// a wrong token is (401), so the refusal does not reveal which job ids exist.
    pub fn authenticate(&self, job_id: &str, token: &str) -> Result<(), ServerError> {
        let jobs = self.jobs();
        let known = jobs.get(job_id).map(|job| job.record.token_hash.as_str());
        // An unknown job costs the same hash and compare as a wrong token (no timing tell).
        let unknown = "0".repeat(64);
        match auth::verify_secret(token, known.unwrap_or(&unknown)) && known.is_some() {
            true => Ok(()),
            false => Err(unknown_job_or_token(job_id)),
        }
    }

    /// Checks a join and takes a rank for it; completes the world if it was the last one.
    fn enter(
        &self,
        job_id: &str,
        token: &str,
        req: SyncJoinRequest,
    ) -> Result<Entered, ServerError> {
        let mut jobs = self.jobs();
        let job = match jobs.get_mut(job_id) {
            Some(job) if auth::verify_secret(token, &job.record.token_hash) => job,
            _ => return Err(unknown_job_or_token(job_id)),
        };
        let world_size = job.record.world_size;
        if req.world_size != world_size {
            return Err(ServerError::invalid(
                ErrorCode::WorldSizeMismatch,
                format!(
                    "this worker was launched for a world of {} but sync job `{job_id}` has a \
                     world of {world_size}: launch every worker with world size {world_size}",
                    req.world_size
                ),
            ));
        }
        check_address(&req.address)?;
        match (job.record.elastic, req.rank, req.rejoin) {
            (Some(_), _, _) if !req.elastic => {
                return Err(ServerError::BadRequest(format!(
                    "sync job `{job_id}` is elastic: its workers must run the elastic loop \
                     (`hora-client sync --elastic`)"
                )))
            }
            (None, _, _) if req.elastic => {
                return Err(ServerError::BadRequest(format!(
                    "sync job `{job_id}` is not elastic: run its workers without --elastic, or \
                     create the job with --min-world-size"
                )))
            }
            (Some(_), Some(rank), _) => {
                return Err(ServerError::BadRequest(format!(
                    "sync job `{job_id}` is elastic: the server gives ranks, so join without \
                     one (this worker asked for rank {rank})"
                )))
            }
            (None, _, Some(_)) => {
                return Err(ServerError::BadRequest(format!(
                    "sync job `{job_id}` is not elastic: a worker joins its world again \
                     without `rejoin`"
                )))
            }
            _ => {}
        }
        // (After the request's own checks: a malformed join is told what is wrong with it.)
        if job.record.finished {
            return Err(finished(job_id));
        }
        let rank = match req.rank {
            Some(rank) if rank >= world_size => {
                return Err(ServerError::invalid(
                    ErrorCode::RankOutOfRange,
                    format!(
                        "rank {rank} is out of range: sync job `{job_id}` has ranks 0 to {}",
                        world_size - 1
                    ),
                ))
            }
            Some(rank) => match &job.slots[rank as usize] {
                Some(holder) if holder.assigned => {
                    return Err(ServerError::conflict(
                        ErrorCode::RankTaken,
                        format!(
                            "rank {rank} of sync job `{job_id}` was given to a worker that joined \
                             without a rank: give every worker of a job its rank, or none"
                        ),
                    ))
                }
                _ => rank,
            },
            // A fixed job always has a free slot: a world whose last slot fills is formed and
            // emptied before the lock is released. An elastic job's places can all be taken.
            None => match job.slots.iter().position(Option::is_none) {
                Some(place) => place as u32,
                None if job.record.elastic.is_some() => {
                    return Err(ServerError::Unavailable {
                        code: ErrorCode::Busy,
                        message: format!(
                            "{} workers wait to join elastic job `{job_id}` already, twice its \
                             largest world: try again once a world has formed",
                            job.waiting()
                        ),
                    })
                }
                None => return Err(ServerError::internal("a complete world was left unformed")),
            },
        };
        let (send, answer) = oneshot::channel();
        let waiter = self.next_waiter.fetch_add(1, Ordering::Relaxed);
        let replaced = job.slots[rank as usize].replace(Waiter {
            id: waiter,
            address: req.address,
            assigned: req.rank.is_none(),
            rejoin: req.rejoin,
            joined: Instant::now(),
            answer: send,
        });
        let now = Instant::now();
        if req
            .rejoin
            .is_some_and(|r| r.generation == job.record.generations)
        {
            job.last_heard = Some(now);
        }
        if let Some(old) = replaced {
            tracing::info!(job = %job_id, rank, "rank joined again: the earlier worker is replaced");
            let _ = old.answer.send(Err(ServerError::conflict(
                ErrorCode::Replaced,
                format!("rank {rank} was joined again by a newer worker"),
            )));
        }
        tracing::debug!(job = %job_id, rank, waiting = job.waiting(), world_size, "worker joined");
        let completed = job.complete_now().then(|| self.complete(job));
        Ok(Entered {
            rank,
            waiter,
            answer,
            completed,
        })
    }

    /// Forms the world of the workers waiting (a fixed job's every rank; an elastic job's
    /// whoever came, up to its largest world) and empties their slots. The store
    /// write happens in [`announce`], on a blocking thread, not under this lock on a worker.
    fn complete(&self, job: &mut Job) -> Completed {
        let waiters = match job.record.elastic {
            None => job.take_waiters(),
            Some(_) => {
                let mut placed: Vec<(usize, Waiter)> = job
                    .slots
                    .iter_mut()
                    .enumerate()
                    .filter_map(|(place, slot)| slot.take().map(|w| (place, w)))
                    .collect();
                // The workers with the newest committed state first (rank 0 broadcasts its
                // state), then the rest of the last world by their old rank, then newcomers as
                // they came.
                placed.sort_by_key(|(_, w)| match w.rejoin {
                    Some(r) => (
                        0,
                        std::cmp::Reverse(r.committed),
                        std::cmp::Reverse(r.generation),
                        u64::from(r.rank),
                    ),
                    None => (1, std::cmp::Reverse(0), std::cmp::Reverse(0), w.id),
                });
                // Newcomers past the largest world keep their places (the ones their joins
                // hold) for the next world.
                let kept = placed.split_off(placed.len().min(job.record.world_size as usize));
                for (place, waiter) in kept {
                    job.slots[place] = Some(waiter);
                }
                placed.into_iter().map(|(_, w)| w).collect()
            }
        };
        job.record.generations += 1;
        job.last_heard = Some(Instant::now());
        let world = FormedWorld {
            generation: job.record.generations,
            session: format!("{:032x}", rand::random::<u128>()).into(),
            world_size: waiters.len() as u32,
            peers: waiters.iter().map(|w| w.address.clone()).collect(),
        };
        job.formed = Some(wire::SyncWorldInfo {
            generation: world.generation,
            formed_unix_ms: crate::round::now_ms(),
            members: world
                .peers
                .iter()
                .enumerate()
                .map(|(rank, address)| wire::SyncMember {
                    rank: rank as u32,
                    address: address.clone(),
                })
                .collect(),
        });
        Completed {
            job: job.record.id.clone(),
            world,
            waiters,
            record: job.record.clone(),
        }
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
        let (joined, world_size, missing, elastic) = {
            let mut jobs = self.jobs();
            let job = jobs.get_mut(job_id)?;
            if !job.holds(rank, waiter) {
                return None;
            }
            let elastic = job
                .record
                .elastic
                .map(|e| (e.min_world_size, job.record.generations, job.not_back()));
            let missing = match elastic {
                None => job.missing(),
                Some(_) => Vec::new(),
            };
            let summary = (job.waiting(), job.record.world_size, missing, elastic);
            job.slots[rank as usize] = None;
            summary
        };
        self.metrics.sync_join_timed_out(job_id);
        tracing::info!(job = %job_id, rank, joined, world_size, "rendezvous timed out");
        let message = match elastic {
            None => format!(
                "the world of job {job_id} is incomplete after {timeout_s} s: {joined} of \
                 {world_size} workers joined; {} not joined",
                name_ranks(&missing)
            ),
            Some((min, generation, lost)) if !lost.is_empty() => format!(
                "elastic job {job_id} is below its minimum world of {min} after {timeout_s} s: \
                 {joined} workers joined; of world {generation}, {} not come back",
                name_ranks(&lost)
            ),
            Some((min, _, _)) => format!(
                "elastic job {job_id} is below its minimum world of {min} after {timeout_s} s: \
                 {joined} workers joined"
            ),
        };
        Some(ServerError::Timeout {
            code: ErrorCode::RendezvousTimeout,
            message,
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
            ErrorCode::InvalidAddress,
            format!(
                "address `{address}` {why}: give the `host:port` where this worker's ring \
                 neighbour can reach it (IPv6 in brackets: `[::1]:29500`)"
            ),
        ))
    };
    if address.len() > MAX_ADDRESS_LEN {
        return Err(ServerError::invalid(
            ErrorCode::InvalidAddress,
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

/// The refusal of a join to a job whose training finished.
fn finished(job_id: &str) -> ServerError {
    ServerError::Gone {
        code: ErrorCode::JobFinished,
        message: format!(
            "sync job `{job_id}` has finished training: there is no world to join (create a new job to train again)"
        ),
    }
}

/// The one refusal for a join whose job does not exist or whose token is wrong.
fn unknown_job_or_token(job_id: &str) -> ServerError {
    ServerError::Unauthorized(format!(
        "sync job {job_id:?} does not accept this token: check the job id and use the token \
         printed when the job was created (hora-server admin sync-create)"
    ))
}

/// Makes a formed world's generation durable, then answers its members. Synchronous (on a
/// blocking thread), so that no dropped future can come between taking the waiters and
/// answering them. A generation whose job has a later one recorded already is durable with it.
fn announce(
    store: &Store,
    metrics: &ServerMetrics,
    recorded: &Mutex<BTreeMap<String, u64>>,
    completed: Completed,
) {
    let Completed {
        job,
        world,
        waiters,
        record,
    } = completed;
    let written = {
        let mut recorded = recorded.lock().unwrap_or_else(PoisonError::into_inner);
        let stored = recorded.get(&job).copied().unwrap_or(0);
        if stored >= record.generations {
            Ok(())
        } else {
            let written = store.put_sync_job(&record).and_then(|()| store.flush());
            if written.is_ok() {
                recorded.insert(job.clone(), record.generations);
            }
            written
        }
    };
    if let Err(e) = written {
        tracing::error!(job = %job, error = %e, "could not record a new generation");
        for waiter in waiters {
            let _ = waiter.answer.send(Err(ServerError::internal(format!(
                "recording generation {} of sync job `{job}` failed: {e}",
                world.generation
            ))));
        }
        return;
    }
    for (rank, waiter) in waiters.into_iter().enumerate() {
        let _ = waiter.answer.send(Ok((world.clone(), rank as u32)));
    }
    metrics.sync_world_formed(&job);
    tracing::info!(job = %job, generation = world.generation, world_size = world.world_size, "world formed");
}

#[cfg(test)]
mod tests;
