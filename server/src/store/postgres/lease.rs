//! Which replica leads, when several `hora-server serve` share one database: a lease row with
//! an expiry (the database's clock, never a replica's) and a fencing token (see
//! `migrations/0002_leases.sql`).
//!
//! A replica that starts takes the lease if it is free or has lapsed, under the next epoch, and
//! serves; the others stand by and try again every quarter of a lease, at least once a second
//! ([`LeaseSettings::poll`]). The leader renews the lease every third of its length on a
//! connection of its own ([`keep`]) and gives it back when it stops ([`release`]), so a clean stop
//! fails over at the next poll and a dead leader after its lease.
//!
//! Safety does not rest on the renewals or on anyone's clock: every write the leader makes runs
//! in a transaction that first checks, `FOR KEY SHARE`, that the lease is still its own under its
//! epoch ([`fence`]). Taking the lease locks the row `FOR UPDATE`, so it waits for those
//! transactions to commit, and the new leader, which loads its state after taking, sees all of
//! them; any write after the take finds another epoch and fails. (Renewals take a lock that
//! does not conflict with the fence's.) A leader that lost its lease (cut off from the database
//! long enough for another to take it) can therefore never acknowledge an upload or publish a
//! round. It also stops by itself: once a whole lease has passed without a renewal that
//! landed, it counts the lease as lost and steps down, before another replica can have taken it.
//!
//! A leader's backend left holding a fence's lock by a dead network path is ended by the
//! database itself (the session settings `driver` gives every connection: an idle transaction
//! times out, and dead clients are found by TCP keepalive), so it holds up a take for seconds.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio_postgres::GenericClient;

use super::driver::{Failure, Target};
use crate::store::StoreError;

/// The lease's scope: the whole database (per-task leases would name their task).
pub(super) const SCOPE: &str = "server";

/// A replica: its id in the lease and the replica list, and where it serves.
#[derive(Debug, Clone)]
pub struct Replica {
    /// `host:pid:random`, new at each start.
    pub id: String,
    /// What `hora-server status` shows of it: its host and `--listen` address.
    pub address: String,
    /// Whether it serves clients while another leads (it follows), as its heartbeat records;
    /// shared by its clones, set by the serving loop.
    pub following: Arc<AtomicBool>,
}

impl Replica {
    /// A new replica of this process, serving at `listen` (`serve` keeps one for the life of
    /// the process, however often it stands by and leads again).
    pub fn this(listen: &str) -> Replica {
        let host = hostname();
        Replica {
            id: format!(
                "{host}:{}:{:04x}",
                std::process::id(),
                rand::random::<u16>()
            ),
            address: format!("{host} {listen}"),
            following: Arc::default(),
        }
    }
}

/// The host's name, for the replica's id (`localhost` when it cannot be read).
fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most `buf.len()` bytes into `buf`.
    let ok = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } == 0;
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    match ok && end > 0 {
        true => String::from_utf8_lossy(&buf[..end]).into_owned(),
        false => "localhost".into(),
    }
}

/// How a replica leads: its name and its lease's length.
#[derive(Debug, Clone)]
pub struct LeaseSettings {
    pub replica: Replica,
    pub ttl: Duration,
    /// Whether its blobs are in a store every replica reaches (`--blobs`). When they are files
    /// under its own data directory, it refuses to take over from a replica on another host:
    /// the records would name files this host does not have.
    pub shared_blobs: bool,
}

impl LeaseSettings {
    /// `replica`'s lease of `ttl`; whether its blobs are shared is for
    /// [`StoreLocation::open_leading`](crate::store::StoreLocation::open_leading) to say, from
    /// where it opens them.
    pub fn new(replica: Replica, ttl: Duration) -> LeaseSettings {
        LeaseSettings {
            replica,
            ttl,
            shared_blobs: false,
        }
    }
}

impl Replica {
    /// The host of the replica whose id is `id`.
    pub(super) fn host_of(id: &str) -> &str {
        id.rsplitn(3, ':').last().unwrap_or(id)
    }
}

impl LeaseSettings {
    /// How often a standby tries to take the lease: every quarter of a lease, and at least
    /// once a second (a dead leader is replaced within its lease and a second).
    pub(super) fn poll(&self) -> Duration {
        (self.ttl / 4).clamp(Duration::from_millis(100), Duration::from_secs(1))
    }
}

/// The lease this replica holds, under its epoch.
pub(super) struct Held {
    pub(super) holder: String,
    pub(super) epoch: i64,
    /// Why it was lost; None while held.
    lost: watch::Sender<Option<String>>,
}

impl Held {
    fn new(holder: String, epoch: i64) -> Held {
        Held {
            holder,
            epoch,
            lost: watch::channel(None).0,
        }
    }

    /// Marks the lease lost (the first reason stays).
    pub(super) fn lose(&self, why: String) {
        self.lost.send_if_modified(|lost| match lost {
            None => {
                *lost = Some(why);
                true
            }
            Some(_) => false,
        });
    }

    pub(super) fn is_lost(&self) -> bool {
        self.lost.borrow().is_some()
    }

    /// Known lost (taken, given back, or not renewed within a lease): refused without a round
    /// trip.
    pub(super) fn check(&self) -> Result<(), StoreError> {
        match self.is_lost() {
            true => Err(StoreError::Fenced { epoch: self.epoch }),
            false => Ok(()),
        }
    }

    pub(super) fn watch(&self) -> watch::Receiver<Option<String>> {
        self.lost.subscribe()
    }
}

/// Who holds the lease now.
#[derive(Debug, Clone)]
pub(super) struct Holder {
    pub holder: String,
    pub address: String,
    pub epoch: i64,
    /// Seconds until it lapses (negative: lapsed).
    pub expires_in: f64,
}

/// The session advisory lock a hora-server from before leases held on its database while it
/// served (it wrote unfenced): while one holds it, no replica may lead.
const OLD_OWNER_LOCK: i64 = 0x686f_7261_0000_0001;

/// How long a take waits for the lease row's lock (a leader's writes in flight hold it for
/// milliseconds; a dead leader's backend until the database ends it).
const TAKE_LOCK_TIMEOUT: &str = "2s";

/// Takes the lease if nobody holds it, its holder's has lapsed, or this replica holds it
/// already (under a new epoch, which fences any older handle of its own), and records this
/// replica's heartbeat, in one transaction: the lease, or who holds it.
pub(super) async fn take(
    client: &mut tokio_postgres::Client,
    settings: &LeaseSettings,
) -> Result<Result<Held, Holder>, Failure> {
    let me = &settings.replica;
    let ttl_ms = i64::try_from(settings.ttl.as_millis()).unwrap_or(i64::MAX);
    let tx = client.transaction().await?;
    tx.batch_execute(&format!("SET LOCAL lock_timeout = '{TAKE_LOCK_TIMEOUT}'"))
        .await?;
    heartbeat(&tx, me).await?;
    // Shared: replicas of this version never exclude each other; an old server's exclusive
    // session lock excludes them all.
    let old_owner = tx
        .query_one(
            "SELECT pg_try_advisory_xact_lock_shared($1)",
            &[&OLD_OWNER_LOCK],
        )
        .await?;
    if !old_owner.try_get::<_, bool>(0)? {
        tx.commit().await?;
        return Ok(Err(Holder {
            holder: "an older hora-server (it holds the database's advisory lock): stop it".into(),
            address: String::new(),
            epoch: 0,
            expires_in: f64::INFINITY,
        }));
    }
    // Read first without a lock: a standby's poll of a held lease never waits on the fence.
    if let Some(holder) = holder(&tx).await? {
        let (theirs, ours) = (Replica::host_of(&holder.holder), Replica::host_of(&me.id));
        if !settings.shared_blobs && theirs != ours {
            return Err(StoreError::Unshared {
                host: theirs.to_string(),
            }
            .into());
        }
        if holder.expires_in > 0.0 && holder.holder != me.id {
            tx.commit().await?;
            return Ok(Err(holder));
        }
    }
    let row = match tx
        .query_opt(
            "SELECT holder, epoch, expires_at <= clock_timestamp() FROM leases
             WHERE scope = $1 FOR UPDATE",
            &[&SCOPE],
        )
        .await
    {
        Ok(row) => row,
        // A write of the holder's (or a dead holder's transaction, until the database ends it)
        // holds the row: not this time; the next poll tries again.
        Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE) => {
            drop(tx);
            return Ok(Err(holder(client).await?.unwrap_or_else(nobody)));
        }
        Err(e) => return Err(e.into()),
    };
    let epoch: i64 = match row {
        None => {
            let inserted = tx
                .query_opt(
                    "INSERT INTO leases
                         (scope, holder, epoch, address, ttl_ms, taken_at, renewed_at, expires_at)
                     VALUES ($1, $2, 1, $3, $4, clock_timestamp(), clock_timestamp(),
                         clock_timestamp() + make_interval(secs => $4::bigint / 1000.0))
                     ON CONFLICT (scope) DO NOTHING RETURNING epoch",
                    &[&SCOPE, &me.id, &me.address, &ttl_ms],
                )
                .await?;
            match inserted {
                Some(row) => row.try_get(0)?,
                // Another replica inserted it first: it leads.
                None => {
                    tx.commit().await?;
                    return Ok(Err(holder(client).await?.unwrap_or_else(nobody)));
                }
            }
        }
        Some(row) => {
            let (holder_id, lapsed): (String, bool) = (row.try_get(0)?, row.try_get(2)?);
            if !lapsed && holder_id != me.id {
                let current = holder(&tx).await?.unwrap_or_else(nobody);
                tx.commit().await?;
                return Ok(Err(current));
            }
            tx.query_one(
                "UPDATE leases SET holder = $2, epoch = epoch + 1, address = $3, ttl_ms = $4,
                     taken_at = clock_timestamp(), renewed_at = clock_timestamp(),
                     expires_at = clock_timestamp() + make_interval(secs => $4::bigint / 1000.0)
                 WHERE scope = $1 RETURNING epoch",
                &[&SCOPE, &me.id, &me.address, &ttl_ms],
            )
            .await?
            .try_get(0)?
        }
    };
    tx.commit().await?;
    Ok(Ok(Held::new(me.id.clone(), epoch)))
}

fn nobody() -> Holder {
    Holder {
        holder: "nobody".into(),
        address: String::new(),
        epoch: 0,
        expires_in: 0.0,
    }
}

/// Who holds the lease, if anyone ever took it.
pub(super) async fn holder(client: &impl GenericClient) -> Result<Option<Holder>, Failure> {
    let row = client
        .query_opt(
            "SELECT holder, address, epoch,
                 EXTRACT(EPOCH FROM expires_at - clock_timestamp())::float8
             FROM leases WHERE scope = $1",
            &[&SCOPE],
        )
        .await?;
    Ok(match row {
        None => None,
        Some(row) => Some(Holder {
            holder: row.try_get(0)?,
            address: row.try_get(1)?,
            epoch: row.try_get(2)?,
            expires_in: row.try_get(3)?,
        }),
    })
}

/// The fence's query (see [`fence`]).
pub(super) const FENCE: &str =
    "SELECT 1 FROM leases WHERE scope = $1 AND holder = $2 AND epoch = $3 FOR KEY SHARE";

/// Checks, first in a write's transaction, that the lease is still `held`'s; the row stays
/// key-share-locked until the transaction ends, so nobody takes the lease before it commits.
pub(super) async fn fence(client: &impl GenericClient, held: &Held) -> Result<(), Failure> {
    let statement = client.prepare(FENCE).await?;
    fence_with(client, &statement, held).await
}

/// [`fence`] with [`FENCE`] prepared already (so that its execution is sent at once).
pub(super) async fn fence_with(
    client: &impl GenericClient,
    statement: &tokio_postgres::Statement,
    held: &Held,
) -> Result<(), Failure> {
    held.check()?;
    let still = client
        .query_opt(statement, &[&SCOPE, &held.holder, &held.epoch])
        .await?;
    if still.is_some() {
        return Ok(());
    }
    let fenced = StoreError::Fenced { epoch: held.epoch };
    held.lose(fenced.to_string());
    Err(fenced.into())
}

/// Renews `held` every third of a lease on a connection of its own, and records this
/// replica's heartbeat, until the lease is lost: another replica took it, this one gave it back,
/// or no renewal landed for a whole lease less a margin. That is counted from when the last
/// renewal that landed (at first, the take, sent at `taken`) was sent: the database's lease runs
/// at least a lease from then, so this replica stops serving before another can take over.
pub(super) async fn keep(
    target: Target,
    held: std::sync::Arc<Held>,
    settings: LeaseSettings,
    taken: std::time::Instant,
) {
    let beat = settings.ttl / 3;
    let margin = settings.ttl / 10;
    let ttl_ms = i64::try_from(settings.ttl.as_millis()).unwrap_or(i64::MAX);
    let mut lost = held.watch();
    let mut renewed = tokio::time::Instant::from_std(taken);
    let mut connection: Option<tokio_postgres::Client> = None;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(beat) => {}
            _ = lost.changed() => return,
        }
        if held.is_lost() {
            return;
        }
        let deadline = renewed + settings.ttl - margin;
        let sent = tokio::time::Instant::now();
        let attempt = async {
            if connection.as_ref().is_none_or(|c| c.is_closed()) {
                let client = target.connect().await?;
                // Held for as long as this connection lives: an older hora-server (which takes
                // this lock exclusively) cannot start to serve beside this leader.
                client
                    .query_one("SELECT pg_try_advisory_lock_shared($1)", &[&OLD_OWNER_LOCK])
                    .await?;
                connection = Some(client);
            }
            let client = connection.as_ref().expect("connected just above");
            let n = client
                .execute(
                    "UPDATE leases SET renewed_at = clock_timestamp(), ttl_ms = $4,
                         expires_at = clock_timestamp() + make_interval(secs => $4::bigint / 1000.0)
                     WHERE scope = $1 AND holder = $2 AND epoch = $3",
                    &[&SCOPE, &held.holder, &held.epoch, &ttl_ms],
                )
                .await?;
            Ok::<_, tokio_postgres::Error>(n == 1)
        };
        match tokio::time::timeout_at(deadline.max(sent), attempt).await {
            Ok(Ok(true)) => {
                renewed = sent;
                // The heartbeat and the list's upkeep are no part of holding the lease.
                let mut stuck = false;
                if let Some(client) = &connection {
                    // An update only, never an insert, and not once the lease is lost: a
                    // heartbeat that lands after stepping down cannot put the replica back on
                    // the list it left.
                    let beat = async {
                        if held.is_lost() {
                            return Ok(0);
                        }
                        client
                            .execute(
                                "UPDATE replicas SET seen_at = clock_timestamp(), following = false
                                 WHERE id = $1",
                                &[&settings.replica.id],
                            )
                            .await?;
                        client
                            .execute(
                                "DELETE FROM replicas
                                 WHERE seen_at < clock_timestamp() - interval '1 day'",
                                &[],
                            )
                            .await
                    };
                    match tokio::time::timeout_at(renewed + settings.ttl - margin, beat).await {
                        Ok(Ok(_)) => {}
                        Ok(Err(e)) => {
                            tracing::debug!(error = %e, "recording the heartbeat failed")
                        }
                        Err(_) => {
                            stuck = true;
                            tracing::debug!("recording the heartbeat did not land in time");
                        }
                    }
                }
                if stuck {
                    connection = None;
                }
            }
            Ok(Ok(false)) => held.lose(format!(
                "its lease (epoch {}) was taken by another replica",
                held.epoch
            )),
            Ok(Err(e)) => {
                connection = None;
                tracing::warn!(error = %e, "renewing the lease failed; trying again");
            }
            Err(_) => {
                connection = None;
                tracing::warn!("renewing the lease did not land in time; trying again");
            }
        }
        if tokio::time::Instant::now() >= renewed + settings.ttl - margin {
            held.lose(format!(
                "it could not renew its lease (epoch {}) for {:.1} s, nearly its whole length: cut off from the database",
                held.epoch,
                renewed.elapsed().as_secs_f64()
            ));
        }
    }
}

/// Gives the lease back (it lapses now), so a standby takes it at its next poll.
pub(super) async fn release(client: &impl GenericClient, held: &Held) -> Result<(), Failure> {
    client
        .execute(
            "UPDATE leases SET expires_at = clock_timestamp()
             WHERE scope = $1 AND holder = $2 AND epoch = $3",
            &[&SCOPE, &held.holder, &held.epoch],
        )
        .await?;
    Ok(())
}

/// Records that `replica` is alive.
pub(super) async fn heartbeat(
    client: &impl GenericClient,
    replica: &Replica,
) -> Result<(), tokio_postgres::Error> {
    client
        .execute(
            "INSERT INTO replicas (id, address, version, started_at, seen_at, following)
             VALUES ($1, $2, $3, clock_timestamp(), clock_timestamp(), $4)
             ON CONFLICT (id) DO UPDATE SET seen_at = clock_timestamp(), following = $4",
            &[
                &replica.id,
                &replica.address,
                &env!("CARGO_PKG_VERSION"),
                &replica.following.load(Ordering::Relaxed),
            ],
        )
        .await?;
    Ok(())
}

/// Removes `replica` from the replica list (it stops).
pub(super) async fn leave(
    client: &impl GenericClient,
    replica: &Replica,
) -> Result<(), tokio_postgres::Error> {
    client
        .execute("DELETE FROM replicas WHERE id = $1", &[&replica.id])
        .await?;
    Ok(())
}
