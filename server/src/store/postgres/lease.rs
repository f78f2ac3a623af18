//! Which replica leads, when several `hora-server serve` share one database: a lease row with
//! an expiry (the database's clock, never a replica's) and a fencing token (see
//! `migrations/0002_leases.sql`).
//!
//! A replica that starts takes the lease if it is free or has lapsed, under the next epoch, and
//! serves; the others stand by and try again a few times a lease ([`poll`]). The leader renews
//! the lease every third of its time ([`keep`]) and gives it back when it stops
//! ([`release`]), so a clean stop fails over at the next poll and a dead leader after its lease.
//!
//! Safety does not rest on the renewals or on anyone's clock: every write the leader makes runs
//! in a transaction that first checks, `FOR SHARE`, that the lease is still its own under its
//! epoch ([`fence`]). Taking the lease updates that row, so it waits for those transactions to
//! commit, and the new leader, which loads its state after taking, sees all of them; any write
//! after the take finds another epoch and fails. A leader that lost its lease (cut off from the
//! database long enough for another to take it) can therefore never acknowledge an upload or
//! publish a round; it learns so at its next renewal or write, and steps down.

use std::time::Duration;

use deadpool_postgres::GenericClient;
use deadpool_postgres::Pool;
use tokio::sync::watch;

use super::driver::Failure;
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
}

impl Replica {
    /// This process, serving at `listen`: one id for the life of the process, however often
    /// it stands by and leads again.
    pub fn this(listen: &str) -> Replica {
        static ID: std::sync::OnceLock<String> = std::sync::OnceLock::new();
        let host = hostname();
        let id = ID.get_or_init(|| {
            format!(
                "{host}:{}:{:04x}",
                std::process::id(),
                rand::random::<u16>()
            )
        });
        Replica {
            id: id.clone(),
            address: format!("{host} {listen}"),
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
}

impl LeaseSettings {
    /// How often a standby tries to take the lease: four times a lease, at most once a second
    /// (a dead leader is replaced within its lease and a second).
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

/// Takes the lease if nobody holds it or its holder's has lapsed: the lease under its new
/// epoch, or who holds it.
pub(super) async fn take(
    client: &impl GenericClient,
    settings: &LeaseSettings,
) -> Result<Result<Held, Holder>, Failure> {
    let taken = client
        .query_opt(
            "INSERT INTO leases (scope, holder, epoch, address, taken_at, renewed_at, expires_at)
             VALUES ($1, $2, 1, $3, now(), now(), now() + make_interval(secs => $4))
             ON CONFLICT (scope) DO UPDATE SET holder = excluded.holder,
                 epoch = leases.epoch + 1, address = excluded.address, taken_at = now(),
                 renewed_at = now(), expires_at = excluded.expires_at
             WHERE leases.expires_at <= now()
             RETURNING epoch",
            &[
                &SCOPE,
                &settings.replica.id,
                &settings.replica.address,
                &settings.ttl.as_secs_f64(),
            ],
        )
        .await?;
    if let Some(row) = taken {
        return Ok(Ok(Held::new(settings.replica.id.clone(), row.try_get(0)?)));
    }
    match holder(client).await? {
        Some(holder) => Ok(Err(holder)),
        // Deleted by hand between the two statements: try again at the next poll.
        None => Ok(Err(Holder {
            holder: "nobody".into(),
            address: String::new(),
            epoch: 0,
            expires_in: 0.0,
        })),
    }
}

/// Who holds the lease, if anyone ever took it.
pub(super) async fn holder(client: &impl GenericClient) -> Result<Option<Holder>, Failure> {
    let row = client
        .query_opt(
            "SELECT holder, address, epoch, EXTRACT(EPOCH FROM expires_at - now())::float8
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

/// Checks, first in a write's transaction, that the lease is still `held`'s; the row stays
/// share-locked until the transaction ends, so nobody takes the lease before it commits.
pub(super) async fn fence(client: &impl GenericClient, held: &Held) -> Result<(), Failure> {
    let still = client
        .query_opt(
            "SELECT 1 FROM leases WHERE scope = $1 AND holder = $2 AND epoch = $3 FOR SHARE",
            &[&SCOPE, &held.holder, &held.epoch],
        )
        .await?;
    if still.is_some() {
        return Ok(());
    }
    let error = StoreError::Fenced { epoch: held.epoch };
    held.lose(error.to_string());
    Err(error.into())
}

/// Renews `held`, then records this replica's heartbeat: every third of a lease, until the
/// lease is lost (another replica took it, or this one gave it back). A database that does not
/// answer is tried again at the next beat: the fence, not the renewal, keeps writes safe.
pub(super) async fn keep(pool: Pool, held: std::sync::Arc<Held>, settings: LeaseSettings) {
    let beat = settings.ttl / 3;
    let mut lost = held.watch();
    loop {
        tokio::select! {
            _ = tokio::time::sleep(beat) => {}
            _ = lost.changed() => return,
        }
        if held.is_lost() {
            return;
        }
        let renewed = async {
            let client = pool.get().await.map_err(|e| e.to_string())?;
            let renewed = client
                .execute(
                    "UPDATE leases SET renewed_at = now(),
                         expires_at = now() + make_interval(secs => $4)
                     WHERE scope = $1 AND holder = $2 AND epoch = $3",
                    &[
                        &SCOPE,
                        &held.holder,
                        &held.epoch,
                        &settings.ttl.as_secs_f64(),
                    ],
                )
                .await
                .map_err(|e| e.to_string())?;
            if renewed == 1 {
                heartbeat(&client, &settings.replica, "leader")
                    .await
                    .map_err(|e| e.to_string())?;
            }
            Ok::<_, String>(renewed == 1)
        };
        match tokio::time::timeout(beat, renewed).await {
            Ok(Ok(true)) => {}
            Ok(Ok(false)) => held.lose(format!(
                "its lease (epoch {}) was taken by another replica",
                held.epoch
            )),
            Ok(Err(e)) => tracing::warn!(error = %e, "renewing the lease failed; trying again"),
            Err(_) => tracing::warn!("renewing the lease took longer than a beat; trying again"),
        }
    }
}

/// Gives the lease back (it lapses now), so a standby takes it at its next poll.
pub(super) async fn release(client: &impl GenericClient, held: &Held) -> Result<(), Failure> {
    client
        .execute(
            "UPDATE leases SET expires_at = now()
             WHERE scope = $1 AND holder = $2 AND epoch = $3",
            &[&SCOPE, &held.holder, &held.epoch],
        )
        .await?;
    Ok(())
}

/// Records that `replica` is alive in `role` (`leader`, `standby`); a leader also forgets
/// replicas unseen for a day.
pub(super) async fn heartbeat(
    client: &impl GenericClient,
    replica: &Replica,
    role: &str,
) -> Result<(), tokio_postgres::Error> {
    client
        .execute(
            "INSERT INTO replicas (id, address, role, version, started_at, seen_at)
             VALUES ($1, $2, $3, $4, now(), now())
             ON CONFLICT (id) DO UPDATE SET role = excluded.role, seen_at = now()",
            &[
                &replica.id,
                &replica.address,
                &role,
                &env!("CARGO_PKG_VERSION"),
            ],
        )
        .await?;
    if role == "leader" {
        client
            .execute(
                "DELETE FROM replicas WHERE seen_at < now() - interval '1 day'",
                &[],
            )
            .await?;
    }
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
