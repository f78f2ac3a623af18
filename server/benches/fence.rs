//! What the lease's fence costs a leader's writes on PostgreSQL: the group commit's write (a
//! round's open record, naming its checkpoint and 100 contributions) through a store that
//! writes unfenced, and through one that leads under a lease, so that each write is a
//! transaction checking the lease `FOR KEY SHARE` first. Both on one PostgreSQL server the bench
//! starts (initdb and postgres on a free loopback port, without fsync: the bench times round
//! trips, not the disk), in alternating batches, in the same run.
//!
//! `make bench` (or `cargo bench -p hora-server --bench fence`; PostgreSQL's server programs as
//! the tests find them, see scripts/setup-postgres.sh).

#[allow(dead_code)]
#[path = "../src/store/postgres/test_server.rs"]
mod test_server;

use std::time::{Duration, Instant};

use hora_common::model::ModelDigest;
use hora_server::store::postgres::{LeaseSettings, Replica};
use hora_server::store::{
    CheckpointRecord, Contribution, OpenRoundRecord, PostgresStore, RoundLog,
};

const BATCH: usize = 400;
const BATCHES: usize = 5;

fn record(round: u64) -> OpenRoundRecord {
    let clients: Vec<String> = (0..100).map(|i| format!("c-{i:016x}")).collect();
    OpenRoundRecord {
        round,
        attempt: 0,
        secret: "ab".repeat(32),
        base_model: ModelDigest([7; 32]),
        opened_unix_ms: 1,
        deadline_unix_ms: 2,
        selected: clients.clone(),
        checkpoint: Some(CheckpointRecord {
            file: format!("{}.ckpt", "cd".repeat(32)),
            contributions: clients
                .into_iter()
                .map(|client| Contribution {
                    contributors: 1,
                    client,
                    examples: 50,
                    metrics: Default::default(),
                    unclipped: None,
                    base: None,
                })
                .collect(),
            total_weight: 5000.0,
            noised: false,
        }),
        earlier: Vec::new(),
        slots: Vec::new(),
        merged: Vec::new(),
    }
}

/// The median of `BATCH` writes' times, per write.
fn batch(store: &PostgresStore, task: &str) -> Duration {
    let mut times: Vec<Duration> = (0..BATCH)
        .map(|i| {
            let r = record(i as u64);
            let started = Instant::now();
            store.put_open_round(task, &r).expect("a write");
            started.elapsed()
        })
        .collect();
    times.sort();
    times[BATCH / 2]
}

fn main() {
    // `cargo test`/`nextest` list and run bench targets without `--bench`: nothing to do then.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let server = test_server::TestServer::start();
    let target = server.url().parse().expect("a PostgreSQL URL");
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let unfenced = PostgresStore::open(&target, a.path()).expect("a store");
    let leading = PostgresStore::open(&target, b.path())
        .expect("a store")
        .claim(
            &LeaseSettings {
                replica: Replica::this("bench"),
                ttl: Duration::from_secs(30),
                shared_blobs: true,
            },
            &|| false,
        )
        .expect("the lease");
    // Warm both (connections, prepared statements).
    batch(&unfenced, "u");
    batch(&leading, "l");
    let (mut plain, mut fenced) = (Vec::new(), Vec::new());
    for _ in 0..BATCHES {
        plain.push(batch(&unfenced, "u"));
        fenced.push(batch(&leading, "l"));
    }
    plain.sort();
    fenced.sort();
    let (p, f) = (plain[BATCHES / 2], fenced[BATCHES / 2]);
    println!(
        "put_open_round (100 contributions), median of {BATCHES} batches of {BATCH}: unfenced {:.0} µs, fenced by the lease {:.0} µs ({:.2}x)",
        p.as_secs_f64() * 1e6,
        f.as_secs_f64() * 1e6,
        f.as_secs_f64() / p.as_secs_f64()
    );
}
