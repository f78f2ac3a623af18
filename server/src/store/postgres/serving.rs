//! What serving replicas share of an open attempt (`migrations/0005_serving_replicas.sql`):
//! selections, claims on updates, and each replica's durable partial sum, which the leader
//! seals and merges when it closes the attempt.
//!
//! Every write here first reads the task's open round row `FOR KEY SHARE` and checks, in the
//! same transaction, that the attempt it names is the open one and that no seal covers it. The
//! seal locks that row `FOR UPDATE`, which waits for those transactions to commit, so the
//! partials it returns are every partial that will ever be recorded for the attempt: an upload a
//! replica acknowledged (after its partial committed) is in the leader's merge. The leader's own
//! writes of the row (`UPDATE`, an upsert) take a lock that does not conflict with `KEY SHARE`,
//! so checkpoints and replicas' writes never wait on each other; a write may therefore still read
//! a closed attempt as open (its snapshot of the row predates the close's commit), and what stops
//! it is the seal, committed before the close began and kept until the next seal replaces it
//! with a later attempt's (a seal covers its attempt and every earlier one).
//!
//! A partial records only updates whose claims are still its replica's (read `FOR SHARE` in its
//! transaction), and a claim is taken over from a replica only in a transaction that finds the
//! update in none of that replica's partials (after its `UPDATE` locked the claim, so a partial
//! in flight commits first): an update is never in two partials.

use tokio_postgres::GenericClient;

use super::driver::Failure;
use super::{int, Param, PostgresStore};
use crate::store::{
    decode, json, Claim, OpenRoundRecord, ReplicaPartial, SharedSelection, SlotTaken, StoreError,
};

/// The database's clock, Unix ms, as SQL (for `concat!`): training slots are given and checked
/// by one clock, whichever replica's clock is off.
macro_rules! now_ms {
    () => {
        "(extract(epoch FROM clock_timestamp()) * 1000)::bigint"
    };
}

/// The attempt a write of a serving replica is for.
struct Attempt {
    task: String,
    round: i64,
    attempt: i64,
}

impl Attempt {
    fn new(task: &str, round: u64, attempt: u32) -> Result<Attempt, StoreError> {
        Ok(Attempt {
            task: task.to_string(),
            round: int(round)?,
            attempt: i64::from(attempt),
        })
    }

    /// A transaction on `db` in which the attempt is open and not sealed (see [`Attempt::open`]);
    /// [`StoreError::AttemptSealed`] otherwise.
    async fn begin<'a>(
        &self,
        db: &'a mut deadpool_postgres::Object,
    ) -> Result<deadpool_postgres::Transaction<'a>, Failure> {
        let tx = db.transaction().await?;
        if !self.open(&*tx).await? {
            return Err(self.sealed().into());
        }
        Ok(tx)
    }

    /// [`Attempt::open`], with the task's writes of kind `what` (selections, training slots)
    /// serialised by an advisory lock until the transaction ends.
    async fn open_alone(&self, tx: &impl GenericClient, what: &str) -> Result<bool, Failure> {
        tx.execute(
            "SELECT pg_advisory_xact_lock(hashtextextended($1 || $2, 0))",
            &[&what, &self.task],
        )
        .await?;
        self.open(tx).await
    }

    /// Whether the attempt is the task's open one and not sealed, with the open round's row
    /// locked `FOR KEY SHARE` (held until the transaction ends).
    async fn open(&self, tx: &impl GenericClient) -> Result<bool, Failure> {
        let Some(row) = tx
            .query_opt(
                "SELECT record FROM open_rounds WHERE task = $1 FOR KEY SHARE",
                &[&self.task],
            )
            .await?
        else {
            return Ok(false);
        };
        let record: OpenRoundRecord = decode(&self.task, row.try_get(0)?)?;
        if (int(record.round)?, i64::from(record.attempt)) != (self.round, self.attempt) {
            return Ok(false);
        }
        let sealed = tx
            .query_opt(
                "SELECT 1 FROM round_seals
                 WHERE task = $1 AND (round, attempt) >= ($2, $3)",
                &[&self.task, &self.round, &self.attempt],
            )
            .await?;
        Ok(sealed.is_none())
    }

    fn sealed(&self) -> StoreError {
        StoreError::AttemptSealed {
            task: self.task.clone(),
            round: self.round as u64,
            attempt: self.attempt as u32,
        }
    }
}

impl PostgresStore {
    pub(super) fn select_shared(
        &self,
        task: &str,
        round: u64,
        attempt: u32,
        client: &str,
        capacity: usize,
    ) -> Result<SharedSelection, StoreError> {
        let at = Attempt::new(task, round, attempt)?;
        let (client, capacity) = (client.to_string(), int(capacity as u64)?);
        self.driver.with(move |mut db| async move {
            let tx = db.transaction().await?;
            // One task's selections one at a time, so that its capacity holds.
            if !at.open_alone(&*tx, "hora select ").await? {
                return Ok(SharedSelection::Closed);
            }
            let key: [&(dyn tokio_postgres::types::ToSql + Sync); 4] =
                [&at.task, &at.round, &at.attempt, &client];
            let known = tx
                .query_opt(
                    "SELECT 1 FROM round_selections
                     WHERE task = $1 AND round = $2 AND attempt = $3 AND client = $4",
                    &key,
                )
                .await?;
            if known.is_some() {
                return Ok(SharedSelection::Selected);
            }
            let taken: i64 = tx
                .query_one(
                    "SELECT count(*) FROM round_selections
                     WHERE task = $1 AND round = $2 AND attempt = $3",
                    &key[..3],
                )
                .await?
                .try_get(0)?;
            if taken >= capacity {
                return Ok(SharedSelection::Full);
            }
            tx.execute(
                "INSERT INTO round_selections (task, round, attempt, client)
                 VALUES ($1, $2, $3, $4)",
                &key,
            )
            .await?;
            tx.commit().await?;
            Ok(SharedSelection::Selected)
        })
    }

    /// The clients selected in the store for `open`'s attempt (beside those its record lists).
    pub(super) fn selections(
        &self,
        task: &str,
        open: &mut OpenRoundRecord,
    ) -> Result<(), StoreError> {
        let rows = self.query(
            "SELECT client FROM round_selections
             WHERE task = $1 AND round = $2 AND attempt = $3 ORDER BY client",
            params![task.to_string(), int(open.round)?, i64::from(open.attempt)],
        )?;
        let listed: std::collections::HashSet<String> = open.selected.iter().cloned().collect();
        for row in &rows {
            let client: String = super::col(row, 0)?;
            if !listed.contains(&client) {
                open.selected.push(client);
            }
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn take_slot_shared(
        &self,
        task: &str,
        round: u64,
        attempt: u32,
        client: &str,
        slot_ms: u64,
        concurrency: u32,
    ) -> Result<SlotTaken, StoreError> {
        let at = Attempt::new(task, round, attempt)?;
        let client = client.to_string();
        let (slot_ms, concurrency) = (int(slot_ms)?, i64::from(concurrency));
        self.driver.with(move |mut db| async move {
            let tx = db.transaction().await?;
            // One task's slots one at a time, so that its concurrency holds.
            if !at.open_alone(&*tx, "hora slots ").await? {
                return Ok(SlotTaken::Closed);
            }
            let claimed = tx
                .query_opt(
                    "SELECT 1 FROM round_claims
                     WHERE task = $1 AND round = $2 AND attempt = $3 AND client = $4",
                    &[&at.task, &at.round, &at.attempt, &client],
                )
                .await?;
            if claimed.is_some() {
                return Ok(SlotTaken::Contributed);
            }
            let now: i64 = tx
                .query_one(concat!("SELECT ", now_ms!()), &[])
                .await?
                .try_get(0)?;
            // (Lapsed slots are not deleted here, only passed over: this transaction locks no
            // row but its client's, so it never deadlocks with the writes that spend slots.)
            let held = tx
                .query_opt(
                    "SELECT until_ms FROM training_slots
                     WHERE task = $1 AND client = $2 AND until_ms > $3",
                    &[&at.task, &client, &now],
                )
                .await?;
            let taken = match held {
                Some(row) => SlotTaken::Held {
                    until_unix_ms: row.try_get::<_, i64>(0)?.max(0) as u64,
                },
                None => {
                    let holding: i64 = tx
                        .query_one(
                            "SELECT count(*) FROM training_slots
                             WHERE task = $1 AND until_ms > $2",
                            &[&at.task, &now],
                        )
                        .await?
                        .try_get(0)?;
                    match holding >= concurrency {
                        true => SlotTaken::Full,
                        false => {
                            let until = now.saturating_add(slot_ms);
                            tx.execute(
                                "INSERT INTO training_slots (task, client, until_ms)
                                 VALUES ($1, $2, $3)
                                 ON CONFLICT (task, client) DO UPDATE SET until_ms = excluded.until_ms",
                                &[&at.task, &client, &until],
                            )
                            .await?;
                            SlotTaken::Held {
                                until_unix_ms: until.max(0) as u64,
                            }
                        }
                    }
                }
            };
            tx.commit().await?;
            Ok(taken)
        })
    }

    pub(super) fn training_slot_of(
        &self,
        task: &str,
        client: &str,
    ) -> Result<Option<u64>, StoreError> {
        let rows = self.query(
            concat!(
                "SELECT until_ms FROM training_slots
                 WHERE task = $1 AND client = $2 AND until_ms > ",
                now_ms!()
            ),
            params![task.to_string(), client.to_string()],
        )?;
        match rows.first() {
            Some(row) => Ok(Some(super::col::<i64>(row, 0)?.max(0) as u64)),
            None => Ok(None),
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn claim_shared(
        &self,
        task: &str,
        round: u64,
        attempt: u32,
        client: &str,
        replica: &str,
        from: Option<&str>,
        slotted: bool,
    ) -> Result<Option<Claim>, StoreError> {
        let at = Attempt::new(task, round, attempt)?;
        let (client, replica) = (client.to_string(), replica.to_string());
        let from = from.map(str::to_string);
        // A process is alive while its heartbeat is younger than this (a standby's comes every
        // second at most, a leader's every third of its lease).
        let alive_secs = self.alive_within.as_secs_f64();
        self.driver.with(move |mut db| async move {
            let tx = at.begin(&mut db).await?;
            let (task, round) = (&at.task, &at.round);
            if let Some(from) = &from {
                let moved = tx
                    .execute(
                        "UPDATE round_claims SET replica = $5
                         WHERE task = $1 AND round = $2 AND attempt = $3 AND client = $4
                             AND replica = $6",
                        &[task, round, &at.attempt, &client, &replica, from],
                    )
                    .await?;
                // Not if `from` recorded the update meanwhile (its partial's transaction holds
                // the claim until it commits: the UPDATE waited for it).
                let theirs = tx
                    .query_opt(
                        "SELECT record FROM round_partials
                         WHERE task = $1 AND round = $2 AND attempt = $3 AND replica = $4",
                        &[task, round, &at.attempt, from],
                    )
                    .await?;
                if let (1, Some(row)) = (moved, theirs) {
                    let partial: ReplicaPartial = decode(from, row.try_get(0)?)?;
                    if partial.contributions.iter().any(|c| c.client == client) {
                        return Ok(Some(Claim {
                            replica: from.clone(),
                            alive: false,
                        }));
                    }
                }
            }
            let new = tx
                .execute(
                    "INSERT INTO round_claims (task, round, attempt, client, replica)
                     VALUES ($1, $2, $3, $4, $5) ON CONFLICT DO NOTHING",
                    &[task, round, &at.attempt, &client, &replica],
                )
                .await?;
            if new == 1 && slotted {
                // (Checked, not spent: the update spends it once it is durable, so a retry of
                // one that was never recorded still holds it.)
                let slot = tx
                    .query_opt(
                        concat!(
                            "SELECT 1 FROM training_slots
                             WHERE task = $1 AND client = $2 AND until_ms > ",
                            now_ms!()
                        ),
                        &[task, &client],
                    )
                    .await?;
                if slot.is_none() {
                    return Err(StoreError::NoTrainingSlot {
                        task: task.clone(),
                        client: client.clone(),
                    }
                    .into());
                }
            }
            let row = tx
                .query_one(
                    "SELECT c.replica, EXISTS (
                         SELECT 1 FROM replicas r
                         WHERE r.id = split_part(c.replica, '#', 1)
                             AND r.seen_at > clock_timestamp() - make_interval(secs => $5))
                     FROM round_claims c
                     WHERE task = $1 AND round = $2 AND attempt = $3 AND client = $4",
                    &[task, round, &at.attempt, &client, &alive_secs],
                )
                .await?;
            let holder: String = row.try_get(0)?;
            let alive: bool = row.try_get(1)?;
            tx.commit().await?;
            Ok((holder != replica).then_some(Claim {
                replica: holder,
                alive,
            }))
        })
    }

    pub(super) fn put_partial_shared(
        &self,
        task: &str,
        partial: &ReplicaPartial,
        fresh: &[String],
    ) -> Result<(), StoreError> {
        let at = Attempt::new(task, partial.round, partial.attempt)?;
        let (replica, record) = (partial.replica.clone(), json(partial));
        let fresh = fresh.to_vec();
        let slotted = partial.contributions.iter().any(|c| c.base.is_some());
        self.driver.with(move |mut db| async move {
            let tx = at.begin(&mut db).await?;
            // The fresh updates' claims are still this replica's, and stay so until it commits.
            let claims = tx
                .query(
                    "SELECT client, replica FROM round_claims
                     WHERE task = $1 AND round = $2 AND attempt = $3 AND client = ANY($4)
                     FOR SHARE",
                    &[&at.task, &at.round, &at.attempt, &fresh],
                )
                .await?;
            let mut ours = std::collections::HashSet::new();
            for row in &claims {
                let (client, holder): (String, String) = (row.try_get(0)?, row.try_get(1)?);
                if holder == replica {
                    ours.insert(client);
                }
            }
            if let Some(lost) = fresh.iter().find(|c| !ours.contains(*c)) {
                return Err(StoreError::ClaimLost {
                    task: at.task.clone(),
                    round: at.round as u64,
                    client: lost.clone(),
                }
                .into());
            }
            // The training slots of the fresh updates (an asynchronous task's) are spent.
            if slotted {
                tx.execute(
                    "DELETE FROM training_slots WHERE task = $1 AND client = ANY($2)",
                    &[&at.task, &fresh],
                )
                .await?;
            }
            tx.execute(
                "INSERT INTO round_partials (task, round, attempt, replica, record)
                 VALUES ($1, $2, $3, $4, $5)
                 ON CONFLICT (task, round, attempt, replica) DO UPDATE SET record = excluded.record",
                &[&at.task, &at.round, &at.attempt, &replica, &record],
            )
            .await?;
            tx.commit().await?;
            Ok(())
        })
    }

    pub(super) fn seal_shared(
        &self,
        task: &str,
        round: u64,
        attempt: u32,
    ) -> Result<Vec<ReplicaPartial>, StoreError> {
        let task = task.to_string();
        let round = int(round)?;
        let attempt = i64::from(attempt);
        let held = self.held();
        self.driver.with(move |mut db| async move {
            let tx = super::fenced(&mut db, held.as_deref()).await?;
            // A replica's write stuck in flight holds the close up for seconds at most: the
            // close fails then, and is tried again.
            tx.batch_execute("SET LOCAL lock_timeout = '5s'").await?;
            // Waits for every replica's write of the attempt in flight (they hold KEY SHARE).
            tx.query_opt(
                "SELECT 1 FROM open_rounds WHERE task = $1 FOR UPDATE",
                &[&task],
            )
            .await?;
            tx.execute(
                "INSERT INTO round_seals (task, round, attempt) VALUES ($1, $2, $3)
                 ON CONFLICT (task) DO UPDATE SET round = excluded.round, attempt = excluded.attempt",
                &[&task, &round, &attempt],
            )
            .await?;
            let rows = tx
                .query(
                    "SELECT replica, record FROM round_partials
                     WHERE task = $1 AND round = $2 AND attempt = $3 ORDER BY replica",
                    &[&task, &round, &attempt],
                )
                .await?;
            let partials = rows
                .iter()
                .map(|row| {
                    let replica: String = row.try_get(0)?;
                    Ok(decode(&replica, row.try_get(1)?)?)
                })
                .collect::<Result<Vec<ReplicaPartial>, Failure>>()?;
            tx.commit().await?;
            Ok(partials)
        })
    }

    pub(super) fn partials_of(&self, task: &str) -> Result<Vec<ReplicaPartial>, StoreError> {
        Ok(self
            .records::<ReplicaPartial>(
                "SELECT replica, record FROM round_partials WHERE task = $1
                 ORDER BY round, attempt, replica",
                params![task.to_string()],
            )?
            .into_iter()
            .map(|(_, p)| p)
            .collect())
    }
}

/// Deletes what serving replicas shared of `task`'s attempts: in the transaction that records
/// the close (the attempt was sealed before; a later one has written nothing yet). The seal
/// stays while the task has a next attempt (a write that read the closed attempt as open must
/// still find it sealed), and goes with the task's last, as do the training slots (they span
/// versions). The slots of the clients in `spent` go now (the close made their updates
/// durable), and so do lapsed ones.
pub(super) async fn forget(
    tx: &impl GenericClient,
    task: &str,
    ended: bool,
    spent: &[String],
) -> Result<(), Failure> {
    for table in [
        "DELETE FROM round_selections WHERE task = $1",
        "DELETE FROM round_claims WHERE task = $1",
        "DELETE FROM round_partials WHERE task = $1",
    ] {
        tx.execute(table, &[&task]).await?;
    }
    // (No partial of the task is being written meanwhile: the attempt was sealed.)
    tx.execute(
        concat!(
            "DELETE FROM training_slots WHERE task = $1 AND (client = ANY($2) OR until_ms <= ",
            now_ms!(),
            ")"
        ),
        &[&task, &spent],
    )
    .await?;
    if ended {
        for table in [
            "DELETE FROM round_seals WHERE task = $1",
            "DELETE FROM training_slots WHERE task = $1",
        ] {
            tx.execute(table, &[&task]).await?;
        }
    }
    Ok(())
}
