//! The PostgreSQL schema's versions: the SQL files under `server/migrations/`, built into the
//! binary and applied in order when a store opens (or by `hora-server migrate`).
//!
//! All of them go in one transaction under an advisory lock, so replicas starting together do
//! not race: one applies what is missing, the others then find it done. Each applied migration
//! is recorded in `hora_migrations` with the SHA-256 of its SQL. A database whose record of an
//! applied migration differs from this binary's file (the file was edited after it shipped), or
//! that has a migration this binary does not know (a newer hora-server migrated it), is refused
//! and left as it is: the counterpart of the sled store's `store_format` guard.

use tokio_postgres::Client;

use super::driver::Failure;
use crate::store::StoreError;

/// One versioned step of the schema.
pub(super) struct Migration {
    pub version: i64,
    pub name: &'static str,
    pub sql: &'static str,
}

/// Every migration, oldest first. A shipped file is never edited: a change is a new file.
pub(super) const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "0001_initial",
        sql: include_str!("../../../migrations/0001_initial.sql"),
    },
    Migration {
        version: 2,
        name: "0002_leases",
        sql: include_str!("../../../migrations/0002_leases.sql"),
    },
    Migration {
        version: 3,
        name: "0003_part_of_a_model",
        sql: include_str!("../../../migrations/0003_part_of_a_model.sql"),
    },
    Migration {
        version: 4,
        name: "0004_federated_evaluation",
        sql: include_str!("../../../migrations/0004_federated_evaluation.sql"),
    },
    Migration {
        version: 5,
        name: "0005_serving_replicas",
        sql: include_str!("../../../migrations/0005_serving_replicas.sql"),
    },
    Migration {
        version: 6,
        name: "0006_training_slots",
        sql: include_str!("../../../migrations/0006_training_slots.sql"),
    },
    Migration {
        version: 7,
        name: "0007_followers_in_status",
        sql: include_str!("../../../migrations/0007_followers_in_status.sql"),
    },
    Migration {
        version: 8,
        name: "0008_secagg_changes",
        sql: include_str!("../../../migrations/0008_secagg_changes.sql"),
    },
];

/// The advisory lock key the migrations are applied under (any constant; "hora" in ASCII).
const LOCK: i64 = 0x686f_7261;

impl Migration {
    pub(super) fn checksum(&self) -> String {
        hora_common::sha256_hex(self.sql.as_bytes())
    }
}

/// Brings the database's schema up to this binary's, applying what is missing under the lock;
/// returns the names of the migrations it applied (none when the schema was current).
pub(super) async fn migrate(
    client: &mut Client,
    migrations: &[Migration],
) -> Result<Vec<&'static str>, Failure> {
    let tx = client.transaction().await?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&LOCK])
        .await?;
    // Not a notice at every start that the table is there already.
    tx.batch_execute("SET LOCAL client_min_messages = warning")
        .await?;
    tx.batch_execute(
        "CREATE TABLE IF NOT EXISTS hora_migrations (
            version    bigint PRIMARY KEY,
            name       text NOT NULL,
            checksum   text NOT NULL,
            applied_at timestamptz NOT NULL DEFAULT now()
        )",
    )
    .await?;
    let applied = tx
        .query(
            "SELECT version, name, checksum FROM hora_migrations ORDER BY version",
            &[],
        )
        .await?;
    let known = migrations.last().map_or(0, |m| m.version);
    let mut done = std::collections::HashSet::new();
    for row in &applied {
        let (version, name, checksum): (i64, String, String) = (row.get(0), row.get(1), row.get(2));
        match migrations.iter().find(|m| m.version == version) {
            None if version > known => {
                return Err(StoreError::NewerFormat {
                    found: u32::try_from(version).unwrap_or(u32::MAX),
                    supported: u32::try_from(known).unwrap_or(u32::MAX),
                }
                .into())
            }
            Some(m) if m.checksum() == checksum => {
                done.insert(version);
            }
            _ => {
                return Err(StoreError::MigrationChanged {
                    version: u32::try_from(version).unwrap_or(u32::MAX),
                    name,
                }
                .into())
            }
        }
    }
    let mut newly = Vec::new();
    for m in migrations.iter().filter(|m| !done.contains(&m.version)) {
        tx.batch_execute(m.sql).await?;
        tx.execute(
            "INSERT INTO hora_migrations (version, name, checksum) VALUES ($1, $2, $3)",
            &[&m.version, &m.name, &m.checksum()],
        )
        .await?;
        newly.push(m.name);
    }
    tx.commit().await?;
    Ok(newly)
}
