//! [`PostgresStore`]: records in PostgreSQL (`--store postgres://…`), blobs in a
//! [`BlobStore`]: files under the data directory as the sled store keeps them, or an object
//! store replicas share (`--blobs`, see `blobs`).
//!
//! The tables are in `server/migrations/` (applied at open, see `migrate`): each record is the
//! JSON the sled store keeps, under real key columns; a round's history entry has its round,
//! attempt, model digest and pruned flag as columns, so a page of history is a range scan and
//! whether a model is still used one index lookup. Every write commits before it returns
//! (PostgreSQL makes a commit durable), so [`flush`](Durable::flush) has nothing left to do;
//! every step the sled store takes in one transaction is one SQL transaction here. Writes to a
//! task, its open round or its history notify the change feed (`feed`), which
//! [`RoundLog::changes`] subscribes to.
//!
//! A database that cannot be reached answers [`StoreError::Unavailable`] (the API's 503
//! `store_unavailable`, worth retrying), not a crash; the pool connects again when it is back.

mod driver;
mod feed;
mod lease;
mod migrate;
#[cfg(test)]
pub(crate) mod test_server;

use std::path::Path;
use std::sync::Arc;

use deadpool_postgres::GenericClient;
use hora_common::model::ModelDigest;
use hora_common::wire::{EvaluationSummary, RoundRecord};
use serde::de::DeserializeOwned;
use tokio::sync::broadcast;
use tokio_postgres::types::{FromSql, ToSql};
use tokio_postgres::Row;

use self::driver::Driver;
pub use self::driver::Target;
use self::lease::Held;
pub use self::lease::{LeaseSettings, Replica};
use super::blobs::{self, BlobStore, Blobs, DirBlobs};
use super::{
    decode, json, referenced, remove_unused_models, Claim, ClientRecord, Durable, EnrolmentRecord,
    Gated, Housekeeping, OpenRoundRecord, Registry, ReplicaPartial, Retention, RoundLog, SecaggLog,
    SharedSelection, SlotTaken, StoreChange, StoreError, SyncJobRecord, SyncJobs, TaskRead,
    TaskRecord,
};

/// Notifications a subscriber may fall behind by before it is told it lagged.
const FEED_CAPACITY: usize = 1024;

pub struct PostgresStore {
    blobs: Arc<dyn BlobStore>,
    driver: Driver,
    changes: broadcast::Sender<StoreChange>,
    /// The lease this replica leads under, once [`claim`](PostgresStore::claim)ed: every write
    /// is fenced by it. A store never claimed (tests, `migrate`) writes unfenced.
    leading: std::sync::OnceLock<Leading>,
    /// How recent a replica's heartbeat must be for it to count as alive (twice the lease).
    alive_within: std::time::Duration,
}

struct Leading {
    held: Arc<Held>,
    settings: LeaseSettings,
    /// The task that renews the lease and records the heartbeat ([`lease::keep`]): stepping
    /// down waits for it, so that no renewal or heartbeat in flight lands after the lease is
    /// handed back and the replica has left the list.
    keeper: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
}

/// A query parameter, owned (a query runs on the store's runtime, not the caller's stack).
type Param = Box<dyn ToSql + Send + Sync>;

macro_rules! params {
    ($($p:expr),* $(,)?) => {
        vec![$(Box::new($p) as Param),*]
    };
}

mod serving;

fn refs(params: &[Param]) -> Vec<&(dyn ToSql + Sync)> {
    params.iter().map(|p| p.as_ref() as _).collect()
}

/// Column `i` of `row`, or an error (a schema someone changed by hand) rather than a panic.
fn col<'a, T: FromSql<'a>>(row: &'a Row, i: usize) -> Result<T, StoreError> {
    row.try_get(i)
        .map_err(|e| StoreError::Postgres(format!("reading column {i}: {e}")))
}

/// A round number, attempt or count as PostgreSQL's bigint.
fn int(n: u64) -> Result<i64, StoreError> {
    i64::try_from(n).map_err(|_| StoreError::Postgres(format!("{n} is over PostgreSQL's bigint")))
}

/// Key `bytes`'s upper bound for a prefix scan: the smallest key above every key that starts
/// with them (None: there is none, scan to the end).
fn prefix_end(prefix: &[u8]) -> Option<Vec<u8>> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < u8::MAX {
            end.push(last + 1);
            return Some(end);
        }
    }
    None
}

/// Opens `target`'s database and brings its schema up to this binary's (see `migrate`);
/// returns the migrations it applied. What `hora-server migrate` does.
pub fn migrate(target: &Target) -> Result<Vec<&'static str>, StoreError> {
    let driver = Driver::start(target)?;
    driver
        .with(|mut client| async move { migrate::migrate(&mut client, migrate::MIGRATIONS).await })
}

/// Writes a task's record, whether or not it exists.
const PUT_TASK: &str = "INSERT INTO tasks (task, record) VALUES ($1, $2)
    ON CONFLICT (task) DO UPDATE SET record = excluded.record";

/// A transaction on `client`, fenced by `held` (see `lease`) when this replica leads under a
/// lease.
async fn fenced<'a>(
    client: &'a mut deadpool_postgres::Object,
    held: Option<&Held>,
) -> Result<deadpool_postgres::Transaction<'a>, driver::Failure> {
    let tx = client.transaction().await?;
    if let Some(held) = held {
        lease::fence(&*tx, held).await?;
    }
    Ok(tx)
}

/// What `hora-server status` shows of a database that replicas share.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Status {
    pub database: String,
    /// The lease, once any replica took it.
    pub lease: Option<LeaseStatus>,
    /// Every replica on the replica list, the leader first.
    pub replicas: Vec<ReplicaStatus>,
    pub tasks: i64,
    pub open_rounds: i64,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct LeaseStatus {
    pub holder: String,
    pub address: String,
    pub epoch: i64,
    pub renewed_secs_ago: f64,
    /// Negative: it has lapsed (its holder is gone, and nobody took it yet).
    pub expires_in_secs: f64,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct ReplicaStatus {
    pub id: String,
    pub address: String,
    /// `leader` (it holds the lease, unlapsed), `follower` (it serves clients without
    /// leading), `standby` (it only waits to lead), or `silent` (no heartbeat for three lease
    /// lengths: stopped without leaving, or cut off).
    pub role: String,
    pub version: String,
    pub seen_secs_ago: f64,
}

/// Reads `target`'s lease, replica list and task counts (nothing is written).
pub fn status(target: &Target) -> Result<Status, StoreError> {
    let driver = Driver::start(target)?;
    let database = target.to_string();
    driver.with(move |client| async move {
        let lease = client
            .query_opt(
                "SELECT holder, address, epoch,
                     EXTRACT(EPOCH FROM clock_timestamp() - renewed_at)::float8,
                     EXTRACT(EPOCH FROM expires_at - clock_timestamp())::float8,
                     ttl_ms::float8 / 1000.0
                 FROM leases WHERE scope = $1",
                &[&lease::SCOPE],
            )
            .await?;
        let (lease, ttl) = match lease {
            None => (None, 10.0),
            Some(row) => (
                Some(LeaseStatus {
                    holder: col(&row, 0)?,
                    address: col(&row, 1)?,
                    epoch: col(&row, 2)?,
                    renewed_secs_ago: col(&row, 3)?,
                    expires_in_secs: col(&row, 4)?,
                }),
                col::<f64>(&row, 5)?,
            ),
        };
        let mut replicas = Vec::new();
        for row in client
            .query(
                "SELECT id, address, version,
                     EXTRACT(EPOCH FROM clock_timestamp() - seen_at)::float8,
                     coalesce((to_jsonb(r) ->> 'following')::boolean, false)
                 FROM replicas r ORDER BY id",
                &[],
            )
            .await?
        {
            let id: String = col(&row, 0)?;
            let seen_secs_ago: f64 = col(&row, 3)?;
            let leads = lease
                .as_ref()
                .is_some_and(|l| l.holder == id && l.expires_in_secs > 0.0);
            // (A database not yet migrated to 0007 has no such column: nobody follows there.)
            let following: bool = col(&row, 4)?;
            let role = match (leads, seen_secs_ago > 3.0 * ttl, following) {
                (true, _, _) => "leader",
                (false, true, _) => "silent",
                (false, false, true) => "follower",
                (false, false, false) => "standby",
            };
            replicas.push(ReplicaStatus {
                id,
                address: col(&row, 1)?,
                role: role.into(),
                version: col(&row, 2)?,
                seen_secs_ago,
            });
        }
        replicas.sort_by_key(|r| r.role != "leader");
        let counts = client
            .query_one(
                "SELECT (SELECT count(*) FROM tasks), (SELECT count(*) FROM open_rounds)",
                &[],
            )
            .await?;
        Ok(Status {
            database,
            lease,
            replicas,
            tasks: col(&counts, 0)?,
            open_rounds: col(&counts, 1)?,
        })
    })
}

impl PostgresStore {
    /// Opens the store: records in `target`'s database (its schema brought up to date), blobs
    /// under `data_dir` (created, private to this user, if needed), and the change feed
    /// listening.
    pub fn open(target: &Target, data_dir: &Path) -> Result<Self, StoreError> {
        Self::open_with(target, Arc::new(DirBlobs::open(data_dir)?))
    }

    /// Opens the store: records in `target`'s database, blobs in `blobs`.
    pub fn open_with(target: &Target, blobs: Arc<dyn BlobStore>) -> Result<Self, StoreError> {
        let driver = Driver::start(target)?;
        let applied = driver.with(|mut client| async move {
            migrate::migrate(&mut client, migrate::MIGRATIONS).await
        })?;
        for name in applied {
            tracing::info!(database = %target, migration = name, "applied a schema migration");
        }
        let (changes, _) = broadcast::channel(FEED_CAPACITY);
        let listening = {
            let (target, changes) = (target.clone(), changes.clone());
            driver.run(async move { Ok(feed::listen(&target, changes).await?) })?
        };
        driver.spawn(feed::keep(target.clone(), listening, changes.clone()));
        Ok(PostgresStore {
            blobs,
            driver,
            changes,
            leading: std::sync::OnceLock::new(),
            alive_within: std::time::Duration::from_secs(20),
        })
    }

    /// The store for replicas whose lease lasts `lease` (a replica's heartbeat counts as alive
    /// for two leases).
    pub fn with_lease(self, lease: std::time::Duration) -> Self {
        PostgresStore {
            alive_within: lease * 2,
            ..self
        }
    }

    /// Waits until this replica leads: takes the database's lease (see `lease`) as soon as it
    /// is free or its holder's has lapsed, standing by meanwhile (the holder named in the log),
    /// then renews it in the background. Every write from then on is fenced by the lease. Ends
    /// [`StoreError::Stopped`] once `give_up` says so (the server was asked to stop).
    pub fn claim(
        mut self,
        settings: &LeaseSettings,
        give_up: &dyn Fn() -> bool,
    ) -> Result<Self, StoreError> {
        self.alive_within = settings.ttl * 2;
        let mut told: Option<String> = None;
        loop {
            let sent = std::time::Instant::now();
            let attempt = {
                let settings = settings.clone();
                self.driver.with(move |mut client| async move {
                    lease::take(&mut client, &settings).await
                })
            };
            match attempt {
                Ok(Ok(held)) => {
                    tracing::info!(database = %self.driver.target(), replica = %settings.replica.id, epoch = held.epoch, "this replica leads: it holds the database's lease");
                    let held = Arc::new(held);
                    let keeper = self.driver.spawn(lease::keep(
                        self.driver.target().clone(),
                        held.clone(),
                        settings.clone(),
                        sent,
                    ));
                    let _ = self.leading.set(Leading {
                        held,
                        settings: settings.clone(),
                        keeper: std::sync::Mutex::new(Some(keeper)),
                    });
                    return Ok(self);
                }
                Ok(Err(holder)) if told.as_deref() != Some(&holder.holder) => {
                    tracing::info!(database = %self.driver.target(), leader = %holder.holder, at = %holder.address, epoch = holder.epoch, expires_in_secs = holder.expires_in.max(0.0), "standing by: another replica leads; this one takes over when its lease lapses");
                    told = Some(holder.holder);
                }
                Ok(Err(_)) => {}
                Err(e @ StoreError::Unavailable { .. }) => {
                    if told.as_deref() != Some("") {
                        tracing::warn!(error = %e, "standing by: the database does not answer; trying again");
                        told = Some(String::new());
                    }
                }
                Err(e) => return Err(e),
            }
            let until = std::time::Instant::now() + settings.poll();
            while std::time::Instant::now() < until {
                if give_up() {
                    return Err(StoreError::Stopped);
                }
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
        }
    }

    /// The lease this replica leads under, if claimed.
    fn held(&self) -> Option<Arc<Held>> {
        self.leading.get().map(|l| l.held.clone())
    }

    /// The rows `sql` selects.
    fn query(&self, sql: &'static str, params: Vec<Param>) -> Result<Vec<Row>, StoreError> {
        self.driver.with(move |client| async move {
            let statement = client.prepare_cached(sql).await?;
            Ok(client.query(&statement, &refs(&params)).await?)
        })
    }

    /// Runs `sql`, a write; the number of rows it changed. Fenced by the lease when this
    /// replica leads under one.
    fn execute(&self, sql: &'static str, params: Vec<Param>) -> Result<u64, StoreError> {
        let held = self.held();
        self.driver.with(move |mut client| async move {
            let statement = client.prepare_cached(sql).await?;
            let Some(held) = held else {
                return Ok(client.execute(&statement, &refs(&params)).await?);
            };
            held.check()?;
            // The fence's execution and the write's go out together (both statements prepared
            // already, the fence's first): the database runs them in that order, and a failed
            // fence rolls the write back with the transaction.
            let fence = client.prepare_cached(lease::FENCE).await?;
            let tx = client.transaction().await?;
            let params = refs(&params);
            let (fenced, changed) = tokio::join!(
                lease::fence_with(&*tx, &fence, &held),
                tx.execute(&statement, &params)
            );
            // Refused as fenced first; else the write's own error, not the abort it caused.
            match (fenced, changed) {
                (Err(e @ driver::Failure::Store(StoreError::Fenced { .. })), _) => Err(e),
                (_, Err(e)) => Err(e.into()),
                (Err(e), Ok(_)) => Err(e),
                (Ok(()), Ok(changed)) => {
                    tx.commit().await?;
                    Ok(changed)
                }
            }
        })
    }

    /// The one record (column 0) `sql` selects by `key`, decoded.
    fn record<T: DeserializeOwned>(
        &self,
        sql: &'static str,
        key: &str,
    ) -> Result<Option<T>, StoreError> {
        match self.query(sql, params![key.to_string()])?.first() {
            None => Ok(None),
            Some(row) => decode(key, col(row, 0)?).map(Some),
        }
    }

    /// Every (key, record) `sql` selects, decoded.
    fn records<T: DeserializeOwned>(
        &self,
        sql: &'static str,
        params: Vec<Param>,
    ) -> Result<Vec<(String, T)>, StoreError> {
        self.query(sql, params)?
            .iter()
            .map(|row| {
                let key: String = col(row, 0)?;
                let value = decode(&key, col(row, 1)?)?;
                Ok((key, value))
            })
            .collect()
    }
}

impl Blobs for PostgresStore {
    fn blobs(&self) -> &dyn BlobStore {
        &*self.blobs
    }
}

/// Every write commits before it returns.
impl Durable for PostgresStore {
    fn flush(&self) -> Result<(), StoreError> {
        Ok(())
    }
}

impl RoundLog for PostgresStore {
    fn task(&self, id: &str) -> Result<Option<TaskRecord>, StoreError> {
        self.record("SELECT record FROM tasks WHERE task = $1", id)
    }

    fn tasks_each(&self) -> Result<Vec<TaskRead>, StoreError> {
        self.query("SELECT task, record FROM tasks ORDER BY task", params![])?
            .iter()
            .map(|row| {
                let id: String = col(row, 0)?;
                let record = col(row, 1).and_then(|bytes: &[u8]| decode(&id, bytes));
                Ok((id, record))
            })
            .collect()
    }

    fn create_task(&self, id: &str, task: &TaskRecord) -> Result<bool, StoreError> {
        let created = self.execute(
            "INSERT INTO tasks (task, record) VALUES ($1, $2) ON CONFLICT DO NOTHING",
            params![id.to_string(), json(task)],
        )?;
        Ok(created == 1)
    }

    fn put_task(&self, id: &str, task: &TaskRecord) -> Result<(), StoreError> {
        self.execute(PUT_TASK, params![id.to_string(), json(task)])?;
        Ok(())
    }

    fn open_round(&self, task: &str) -> Result<Option<OpenRoundRecord>, StoreError> {
        let open: Option<OpenRoundRecord> =
            self.record("SELECT record FROM open_rounds WHERE task = $1", task)?;
        open.map(|mut open| {
            self.selections(task, &mut open)?;
            Ok(open)
        })
        .transpose()
    }

    fn put_open_round(&self, task: &str, round: &OpenRoundRecord) -> Result<(), StoreError> {
        self.execute(
            "INSERT INTO open_rounds (task, record) VALUES ($1, $2)
             ON CONFLICT (task) DO UPDATE SET record = excluded.record",
            params![task.to_string(), json(round)],
        )?;
        // The training slots of the asynchronous updates it makes durable are spent (a client
        // whose update of the open version is claimed takes no new one meanwhile). Were this
        // lost, they would lapse at their time, and the next checkpoint spends them anyway.
        let spent: Vec<String> = round
            .checkpoint
            .iter()
            .flat_map(|c| &c.contributions)
            .filter(|c| c.base.is_some())
            .map(|c| c.client.clone())
            .collect();
        if !spent.is_empty() {
            self.execute(
                "DELETE FROM training_slots WHERE task = $1 AND client = ANY($2)",
                params![task.to_string(), spent],
            )?;
        }
        Ok(())
    }

    fn finish_round(
        &self,
        task_id: &str,
        task: &TaskRecord,
        record: &RoundRecord,
        attempt: u32,
        next: Option<&OpenRoundRecord>,
    ) -> Result<(), StoreError> {
        let id = task_id.to_string();
        let task = json(task);
        let round = int(record.round)?;
        let model = record.model.map(|d| d.0.to_vec());
        let pruned = record.pruned;
        let entry = json(record);
        let next = next.map(json);
        // An asynchronous version's updates spent their clients' training slots.
        let spent = match record.staleness {
            Some(_) => record.participants.clone(),
            None => Vec::new(),
        };
        let held = self.held();
        self.driver.with(move |mut client| async move {
            let tx = fenced(&mut client, held.as_deref()).await?;
            tx.execute(PUT_TASK, &[&id, &task]).await?;
            tx.execute(
                "INSERT INTO history (task, round, attempt, model, pruned, record)
                 VALUES ($1, $2, $3, $4, $5, $6)
                 ON CONFLICT (task, round, attempt) DO UPDATE SET
                     model = excluded.model, pruned = excluded.pruned, record = excluded.record",
                &[&id, &round, &i64::from(attempt), &model, &pruned, &entry],
            )
            .await?;
            let ended = next.is_none();
            match next {
                Some(next) => {
                    tx.execute(
                        "INSERT INTO open_rounds (task, record) VALUES ($1, $2)
                         ON CONFLICT (task) DO UPDATE SET record = excluded.record",
                        &[&id, &next],
                    )
                    .await?
                }
                None => {
                    tx.execute("DELETE FROM open_rounds WHERE task = $1", &[&id])
                        .await?
                }
            };
            serving::forget(&*tx, &id, ended, &spent).await?;
            tx.commit().await?;
            Ok(())
        })
    }

    fn end_evaluation(
        &self,
        task_id: &str,
        task: &TaskRecord,
        round: u64,
        attempt: u32,
        evaluation: &EvaluationSummary,
    ) -> Result<(), StoreError> {
        let id = task_id.to_string();
        let task = json(task);
        let round = int(round)?;
        let attempt = i64::from(attempt);
        let evaluation = *evaluation;
        let held = self.held();
        self.driver.with(move |mut client| async move {
            let tx = fenced(&mut client, held.as_deref()).await?;
            tx.execute(PUT_TASK, &[&id, &task]).await?;
            // (No entry: the task is written all the same, the evaluation is over.)
            let row = tx
                .query_opt(
                    "SELECT record FROM history
                     WHERE task = $1 AND round = $2 AND attempt = $3 FOR UPDATE",
                    &[&id, &round, &attempt],
                )
                .await?;
            if let Some(row) = row {
                let mut entry: RoundRecord = decode(&id, col(&row, 0)?)?;
                entry.evaluation = Some(evaluation);
                tx.execute(
                    "UPDATE history SET record = $4
                     WHERE task = $1 AND round = $2 AND attempt = $3",
                    &[&id, &round, &attempt, &json(&entry)],
                )
                .await?;
            }
            tx.commit().await?;
            Ok(())
        })
    }

    fn history_page(
        &self,
        task: &str,
        after: u64,
        limit: usize,
    ) -> Result<Vec<RoundRecord>, StoreError> {
        // No round is numbered past bigint: a page after that is empty.
        let Some(first) = after.checked_add(1).and_then(|f| i64::try_from(f).ok()) else {
            return Ok(Vec::new());
        };
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        self.query(
            "SELECT record FROM history WHERE task = $1 AND round >= $2
             ORDER BY round, attempt LIMIT $3",
            params![task.to_string(), first, limit],
        )?
        .iter()
        .map(|row| decode(task, col(row, 0)?))
        .collect()
    }

    fn round_attempts(&self, task: &str, round: u64) -> Result<Vec<RoundRecord>, StoreError> {
        let Ok(round) = i64::try_from(round) else {
            return Ok(Vec::new());
        };
        self.query(
            "SELECT record FROM history WHERE task = $1 AND round = $2 ORDER BY attempt",
            params![task.to_string(), round],
        )?
        .iter()
        .map(|row| decode(task, col(row, 0)?))
        .collect()
    }

    fn model_in_history(&self, digest: &ModelDigest) -> Result<bool, StoreError> {
        let rows = self.query(
            "SELECT EXISTS (SELECT 1 FROM history WHERE model = $1 AND NOT pruned)",
            params![digest.0.to_vec()],
        )?;
        match rows.first() {
            Some(row) => col(row, 0),
            None => Ok(false),
        }
    }

    /// As the sled store's: looks only at the rounds that can have fallen out of `retention`
    /// since the last prune under the same retention, and compacts only the entries that fell
    /// out of its detail window since the last compaction (`prune_marks` says how far each
    /// went), all in one transaction with the marks it moves.
    fn prune_models(
        &self,
        task: &str,
        retention: Retention,
        published: u64,
    ) -> Result<usize, StoreError> {
        let keeps_all = retention.last == 0 && retention.every == 0;
        // Rounds up to `upto` are out of the window of the last rounds.
        let upto = match keeps_all {
            true => 0,
            false => published.saturating_sub(retention.last),
        };
        let compact_upto = int(retention.compacted_upto(published))?;
        let id = task.to_string();
        let (last, every, below) = (
            int(retention.last)?,
            int(retention.every)?,
            int(upto.saturating_add(1))?,
        );
        let upto = int(upto)?;
        let held = self.held();
        let dropped = self.driver.with(move |mut client| async move {
            let tx = fenced(&mut client, held.as_deref()).await?;
            let mark = tx
                .query_opt(
                    "SELECT retain_last, retain_every, below, compacted_below FROM prune_marks
                     WHERE task = $1 FOR UPDATE",
                    &[&id],
                )
                .await?;
            let (mut from, mut compacted_from) = (0, 0);
            if let Some(m) = mark {
                compacted_from = col::<i64>(&m, 3)?;
                if (col::<i64>(&m, 0)?, col::<i64>(&m, 1)?) == (last, every) {
                    from = col::<i64>(&m, 2)?;
                }
            }
            let mut dropped = Vec::new();
            if !keeps_all && from <= upto {
                let rows = tx
                    .query(
                        "SELECT round, attempt, record FROM history
                         WHERE task = $1 AND round >= $2 AND round <= $3
                             AND model IS NOT NULL AND NOT pruned
                         ORDER BY round, attempt FOR UPDATE",
                        &[&id, &from, &upto],
                    )
                    .await?;
                for row in &rows {
                    let (round, attempt): (i64, i64) = (col(row, 0)?, col(row, 1)?);
                    let mut r: RoundRecord = decode(&id, col(row, 2)?)?;
                    let Some(model) = r.model.filter(|_| !r.pruned) else {
                        continue;
                    };
                    if retention.keeps(r.round, published) {
                        continue;
                    }
                    r.pruned = true;
                    tx.execute(
                        "UPDATE history SET pruned = true, record = $4
                         WHERE task = $1 AND round = $2 AND attempt = $3",
                        &[&id, &round, &attempt, &json(&r)],
                    )
                    .await?;
                    dropped.push(model);
                }
            }
            // Then the entries that fall out of the detail window lose their per-client lists.
            if compact_upto >= compacted_from.max(1) {
                let rows = tx
                    .query(
                        "SELECT round, attempt, record FROM history
                         WHERE task = $1 AND round >= $2 AND round <= $3
                         ORDER BY round, attempt FOR UPDATE",
                        &[&id, &compacted_from, &compact_upto],
                    )
                    .await?;
                for row in &rows {
                    let (round, attempt): (i64, i64) = (col(row, 0)?, col(row, 1)?);
                    let mut r: RoundRecord = decode(&id, col(row, 2)?)?;
                    if r.compact() {
                        tx.execute(
                            "UPDATE history SET record = $4
                             WHERE task = $1 AND round = $2 AND attempt = $3",
                            &[&id, &round, &attempt, &json(&r)],
                        )
                        .await?;
                    }
                }
            }
            let compacted_below = compacted_from.max(compact_upto.saturating_add(1));
            tx.execute(
                "INSERT INTO prune_marks (task, retain_last, retain_every, below, compacted_below)
                 VALUES ($1, $2, $3, $4, $5)
                 ON CONFLICT (task) DO UPDATE SET retain_last = excluded.retain_last,
                     retain_every = excluded.retain_every, below = excluded.below,
                     compacted_below = excluded.compacted_below",
                &[&id, &last, &every, &below, &compacted_below],
            )
            .await?;
            tx.commit().await?;
            Ok(dropped)
        })?;
        remove_unused_models(self, dropped)
    }

    fn changes(&self) -> Option<broadcast::Receiver<StoreChange>> {
        Some(self.changes.subscribe())
    }

    fn shared(&self) -> bool {
        true
    }

    fn select_client(
        &self,
        task: &str,
        round: u64,
        attempt: u32,
        client: &str,
        capacity: usize,
    ) -> Result<SharedSelection, StoreError> {
        self.select_shared(task, round, attempt, client, capacity)
    }

    fn take_slot(
        &self,
        task: &str,
        round: u64,
        attempt: u32,
        client: &str,
        slot_ms: u64,
        concurrency: u32,
    ) -> Result<SlotTaken, StoreError> {
        self.take_slot_shared(task, round, attempt, client, slot_ms, concurrency)
    }

    fn training_slot(&self, task: &str, client: &str) -> Result<Option<u64>, StoreError> {
        self.training_slot_of(task, client)
    }

    fn claim_update(
        &self,
        task: &str,
        round: u64,
        attempt: u32,
        client: &str,
        replica: &str,
        from: Option<&str>,
        slotted: bool,
    ) -> Result<Option<Claim>, StoreError> {
        self.claim_shared(task, round, attempt, client, replica, from, slotted)
    }

    fn claim_holder(
        &self,
        task: &str,
        round: u64,
        attempt: u32,
        client: &str,
    ) -> Result<Option<String>, StoreError> {
        let rows = self.query(
            "SELECT replica FROM round_claims
             WHERE task = $1 AND round = $2 AND attempt = $3 AND client = $4",
            params![
                task.to_string(),
                int(round)?,
                i64::from(attempt),
                client.to_string()
            ],
        )?;
        rows.first().map(|row| col(row, 0)).transpose()
    }

    fn put_partial(
        &self,
        task: &str,
        partial: &ReplicaPartial,
        fresh: &[String],
    ) -> Result<(), StoreError> {
        self.put_partial_shared(task, partial, fresh)
    }

    fn seal_partials(
        &self,
        task: &str,
        round: u64,
        attempt: u32,
    ) -> Result<Vec<ReplicaPartial>, StoreError> {
        self.seal_shared(task, round, attempt)
    }

    fn sealed(&self, task: &str, round: u64, attempt: u32) -> Result<bool, StoreError> {
        let rows = self.query(
            "SELECT 1 FROM round_seals WHERE task = $1 AND (round, attempt) >= ($2, $3)",
            params![task.to_string(), int(round)?, i64::from(attempt)],
        )?;
        Ok(!rows.is_empty())
    }

    fn partials(&self, task: &str) -> Result<Vec<ReplicaPartial>, StoreError> {
        self.partials_of(task)
    }
}

impl Registry for PostgresStore {
    fn client(&self, id: &str) -> Result<Option<ClientRecord>, StoreError> {
        self.record("SELECT record FROM clients WHERE id = $1", id)
    }

    fn clients(&self) -> Result<Vec<(String, ClientRecord)>, StoreError> {
        self.records("SELECT id, record FROM clients ORDER BY id", params![])
    }

    fn put_client(&self, id: &str, c: &ClientRecord) -> Result<(), StoreError> {
        self.execute(
            "INSERT INTO clients (id, record) VALUES ($1, $2)
             ON CONFLICT (id) DO UPDATE SET record = excluded.record",
            params![id.to_string(), json(c)],
        )?;
        Ok(())
    }

    /// Compare and swap: the record is written back only if nobody changed it since it was read
    /// (else it is read and changed again).
    fn update_client(
        &self,
        id: &str,
        change: &mut dyn FnMut(&mut ClientRecord),
    ) -> Result<Option<ClientRecord>, StoreError> {
        loop {
            let rows = self.query(
                "SELECT record FROM clients WHERE id = $1",
                params![id.to_string()],
            )?;
            let Some(row) = rows.first() else {
                return Ok(None);
            };
            let old: Vec<u8> = col(row, 0)?;
            let mut client: ClientRecord = decode(id, &old)?;
            change(&mut client);
            let swapped = self.execute(
                "UPDATE clients SET record = $2 WHERE id = $1 AND record = $3",
                params![id.to_string(), json(&client), old],
            )?;
            if swapped == 1 {
                return Ok(Some(client));
            }
        }
    }

    fn put_enrolment(&self, token_hash: &str, e: &EnrolmentRecord) -> Result<(), StoreError> {
        self.execute(
            "INSERT INTO enrolments (token_hash, record) VALUES ($1, $2)
             ON CONFLICT (token_hash) DO UPDATE SET record = excluded.record",
            params![token_hash.to_string(), json(e)],
        )?;
        Ok(())
    }

    fn enrolment(&self, token_hash: &str) -> Result<Option<EnrolmentRecord>, StoreError> {
        self.record(
            "SELECT record FROM enrolments WHERE token_hash = $1",
            token_hash,
        )
    }

    /// The token's row is deleted and the client's inserted in one transaction; either failing
    /// (the token spent meanwhile, the id taken) rolls both back.
    fn enrol(
        &self,
        token_hash: &str,
        id: &str,
        client: &ClientRecord,
    ) -> Result<Option<EnrolmentRecord>, StoreError> {
        let (token_hash, id, record) = (token_hash.to_string(), id.to_string(), json(client));
        let held = self.held();
        let spent = self.driver.with(move |mut client| async move {
            let tx = fenced(&mut client, held.as_deref()).await?;
            let Some(spent) = tx
                .query_opt(
                    "DELETE FROM enrolments WHERE token_hash = $1 RETURNING record",
                    &[&token_hash],
                )
                .await?
            else {
                return Ok(None);
            };
            let created = tx
                .execute(
                    "INSERT INTO clients (id, record) VALUES ($1, $2) ON CONFLICT DO NOTHING",
                    &[&id, &record],
                )
                .await?;
            if created == 0 {
                return Ok(None); // never replace a client (dropped: rolled back, token unspent)
            }
            let spent: Vec<u8> = col(&spent, 0)?;
            tx.commit().await?;
            Ok(Some(spent))
        })?;
        spent.map(|v| decode("enrolment", &v)).transpose()
    }
}

impl SyncJobs for PostgresStore {
    fn sync_jobs(&self) -> Result<Vec<SyncJobRecord>, StoreError> {
        Ok(self
            .records("SELECT id, record FROM sync_jobs ORDER BY id", params![])?
            .into_iter()
            .map(|(_, job)| job)
            .collect())
    }

    fn create_sync_job(&self, job: &SyncJobRecord) -> Result<bool, StoreError> {
        let created = self.execute(
            "INSERT INTO sync_jobs (id, record) VALUES ($1, $2) ON CONFLICT DO NOTHING",
            params![job.id.clone(), json(job)],
        )?;
        Ok(created == 1)
    }

    fn put_sync_job(&self, job: &SyncJobRecord) -> Result<(), StoreError> {
        self.execute(
            "INSERT INTO sync_jobs (id, record) VALUES ($1, $2)
             ON CONFLICT (id) DO UPDATE SET record = excluded.record",
            params![job.id.clone(), json(job)],
        )?;
        Ok(())
    }

    fn remove_sync_job(&self, id: &str) -> Result<bool, StoreError> {
        let removed = self.execute(
            "DELETE FROM sync_jobs WHERE id = $1",
            params![id.to_string()],
        )?;
        Ok(removed > 0)
    }
}

impl SecaggLog for PostgresStore {
    fn secagg_get_bytes(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let rows = self.query(
            "SELECT value FROM secagg WHERE key = $1",
            params![key.as_bytes().to_vec()],
        )?;
        rows.first().map(|row| col(row, 0)).transpose()
    }

    fn secagg_put_bytes(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.execute(
            "INSERT INTO secagg (key, value) VALUES ($1, $2)
             ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            params![key.as_bytes().to_vec(), value.to_vec()],
        )?;
        Ok(())
    }

    fn secagg_scan_bytes(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
        let start = prefix.as_bytes().to_vec();
        let rows = match prefix_end(&start) {
            Some(end) => self.query(
                "SELECT key, value FROM secagg WHERE key >= $1 AND key < $2 ORDER BY key",
                params![start, end],
            )?,
            None => self.query(
                "SELECT key, value FROM secagg WHERE key >= $1 ORDER BY key",
                params![start],
            )?,
        };
        rows.iter()
            .map(|row| {
                let key: &[u8] = col(row, 0)?;
                let rest = key.get(prefix.len()..).unwrap_or_default();
                Ok((String::from_utf8_lossy(rest).into_owned(), col(row, 1)?))
            })
            .collect()
    }

    /// One transaction (fenced when this replica leads): the gate read `FOR SHARE` (a leader's
    /// write of it waits for this one to commit, and one after it reads the new gate), the
    /// claim inserted unless present, then the writes.
    fn secagg_put_gated(
        &self,
        gate: &str,
        open: &[u8],
        claim: (&str, &[u8]),
        writes: &[(&str, &[u8])],
    ) -> Result<Gated, StoreError> {
        let (gate, open) = (gate.as_bytes().to_vec(), open.to_vec());
        let claim = (claim.0.as_bytes().to_vec(), claim.1.to_vec());
        let writes: Vec<(Vec<u8>, Vec<u8>)> = writes
            .iter()
            .map(|(k, v)| (k.as_bytes().to_vec(), v.to_vec()))
            .collect();
        let leading = self.held();
        self.driver.with(move |mut db| async move {
            let tx = fenced(&mut db, leading.as_deref()).await?;
            let held = tx
                .query_opt(
                    "SELECT value FROM secagg WHERE key = $1 FOR SHARE",
                    &[&gate],
                )
                .await?;
            if held.map(|row| row.try_get::<_, Vec<u8>>(0)).transpose()? != Some(open) {
                return Ok(Gated::Closed);
            }
            let inserted = tx
                .execute(
                    "INSERT INTO secagg (key, value) VALUES ($1, $2) ON CONFLICT (key) DO NOTHING",
                    &[&claim.0, &claim.1],
                )
                .await?;
            if inserted == 0 {
                let held: Vec<u8> = tx
                    .query_one("SELECT value FROM secagg WHERE key = $1", &[&claim.0])
                    .await?
                    .try_get(0)?;
                if held != claim.1 {
                    return Ok(Gated::Taken(held));
                }
            }
            for (key, value) in &writes {
                tx.execute(
                    "INSERT INTO secagg (key, value) VALUES ($1, $2)
                     ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                    &[key, value],
                )
                .await?;
            }
            tx.commit().await?;
            Ok(Gated::Written)
        })
    }

    /// One transaction: the task's gate (see `secagg::shared`) locked first, which waits for the
    /// messages a replica has in flight under it, then everything deleted (the delete reads
    /// after they committed: none of them outlives the clear).
    fn secagg_clear(&self, task: &str) -> Result<(), StoreError> {
        let gate = format!("{task}\0gate\0").into_bytes();
        let start = format!("{task}\0").into_bytes();
        let end = format!("{task}\u{1}").into_bytes();
        let held = self.held();
        self.driver.with(move |mut db| async move {
            let tx = fenced(&mut db, held.as_deref()).await?;
            tx.execute("SELECT 1 FROM secagg WHERE key = $1 FOR UPDATE", &[&gate])
                .await?;
            tx.execute(
                "DELETE FROM secagg WHERE key >= $1 AND key < $2",
                &[&start, &end],
            )
            .await?;
            tx.commit().await?;
            Ok(())
        })
    }
}

impl Housekeeping for PostgresStore {
    fn meta(&self, key: &str) -> Result<Option<String>, StoreError> {
        let rows = self.query(
            "SELECT value FROM meta WHERE key = $1",
            params![key.to_string()],
        )?;
        rows.first().map(|row| col(row, 0)).transpose()
    }

    fn put_meta(&self, key: &str, value: &str) -> Result<(), StoreError> {
        self.execute(
            "INSERT INTO meta (key, value) VALUES ($1, $2)
             ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            params![key.to_string(), value.to_string()],
        )?;
        Ok(())
    }

    fn sweep_orphans(&self) -> Result<usize, StoreError> {
        blobs::sweep(
            &*self.blobs,
            referenced(self)?.as_ref(),
            std::time::SystemTime::now(),
        )
    }

    /// The database answers, and this replica still leads if it did.
    fn ready(&self) -> Result<(), StoreError> {
        self.query("SELECT 1", params![])?;
        match self.held() {
            Some(held) if held.is_lost() => Err(StoreError::Fenced { epoch: held.epoch }),
            _ => Ok(()),
        }
    }

    fn lease(&self) -> Option<super::LeaseWatch> {
        self.held().map(|held| super::LeaseWatch {
            epoch: held.epoch,
            lost: held.watch(),
        })
    }

    /// Gives the lease back, so a standby takes over at once, and leaves the replica list.
    fn step_down(&self) -> Result<(), StoreError> {
        let Some(leading) = self.leading.get() else {
            return Ok(());
        };
        let (held, replica) = (leading.held.clone(), leading.settings.replica.clone());
        if held.is_lost() {
            return Ok(());
        }
        held.lose("it stepped down".into());
        let keeper = leading
            .keeper
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        if let Some(mut keeper) = keeper {
            // The keeper ends at once between renewals; one in flight ends within its deadline.
            // A keeper still running past that is cut off (its heartbeat only updates, so a
            // late one cannot put this replica back on the list).
            let wait = leading.settings.ttl.min(std::time::Duration::from_secs(5));
            let _ = self.driver.run(async move {
                if tokio::time::timeout(wait, &mut keeper).await.is_err() {
                    keeper.abort();
                    let _ = keeper.await;
                }
                Ok(())
            });
        }
        self.driver.with(move |client| async move {
            lease::release(&**client, &held).await?;
            lease::leave(&**client, &replica).await?;
            Ok(())
        })
    }
}

/// What only the PostgreSQL store has: migrations, the change feed, a database that goes away.
/// The contracts every store keeps are in `conformance/`.
#[cfg(test)]
mod tests;
