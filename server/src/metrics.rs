//! Prometheus metrics (`GET /metrics`): rounds published and abandoned, uploads accepted and
//! rejected by reason, bytes received, ingest, aggregation and group-commit latency; sync-job worlds formed and
//! rendezvous joins that timed out; connections open and closed by the guard, by reason, and
//! requests refused for their address's unauthenticated requests in flight; tasks
//! whose stored state could not be loaded; the privacy each task with differential privacy has
//! spent (ε at the task's δ); for asynchronous tasks, the updates in each open buffer, the
//! clients holding a training slot and the staleness of folded updates (versions per second are
//! the rate of `hora_rounds_published_total`).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TaskLabel {
    pub task: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct JobLabel {
    pub job: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    pub reason: String,
}

pub struct ServerMetrics {
    registry: Registry,
    rounds_published: Family<TaskLabel, Counter>,
    rounds_abandoned: Family<TaskLabel, Counter>,
    pub uploads_accepted: Counter,
    uploads_rejected: Family<ReasonLabel, Counter>,
    pub upload_bytes: Counter,
    pub ingest_seconds: Histogram,
    aggregation_seconds: Histogram,
    pub store_commit_seconds: Histogram,
    sync_worlds_formed: Family<JobLabel, Counter>,
    sync_join_timeouts: Family<JobLabel, Counter>,
    pub connections_open: Gauge,
    connections_closed: Family<ReasonLabel, Counter>,
    pub unauthenticated_refused: Counter,
    pub tasks_broken: Gauge,
    /// 1 while this replica holds its database's lease (PostgreSQL store), else 0.
    pub lease_held: Gauge,
    /// The epoch (fencing token) of the lease it holds or last held.
    pub lease_epoch: Gauge,
    pub clients_quarantined: Counter,
    dp_epsilon: Family<TaskLabel, Gauge<f64, AtomicU64>>,
    async_buffered: Family<TaskLabel, Gauge>,
    async_training: Family<TaskLabel, Gauge>,
    update_staleness: Family<TaskLabel, Histogram, fn() -> Histogram>,
}

fn staleness_histogram() -> Histogram {
    Histogram::new(std::iter::once(0.0).chain(exponential_buckets(1.0, 2.0, 11)))
}

impl Default for ServerMetrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("hora");
        let m = ServerMetrics {
            rounds_published: Family::default(),
            rounds_abandoned: Family::default(),
            uploads_accepted: Counter::default(),
            uploads_rejected: Family::default(),
            upload_bytes: Counter::default(),
            ingest_seconds: Histogram::new(exponential_buckets(1e-4, 2.0, 20)),
            aggregation_seconds: Histogram::new(exponential_buckets(1e-4, 2.0, 20)),
            store_commit_seconds: Histogram::new(exponential_buckets(1e-4, 2.0, 20)),
            sync_worlds_formed: Family::default(),
            sync_join_timeouts: Family::default(),
            connections_open: Gauge::default(),
            connections_closed: Family::default(),
            unauthenticated_refused: Counter::default(),
            tasks_broken: Gauge::default(),
            lease_held: Gauge::default(),
            lease_epoch: Gauge::default(),
            clients_quarantined: Counter::default(),
            dp_epsilon: Family::default(),
            async_buffered: Family::default(),
            async_training: Family::default(),
            update_staleness: Family::new_with_constructor(staleness_histogram),
            registry: Registry::default(),
        };
        registry.register(
            "rounds_published",
            "Rounds published",
            m.rounds_published.clone(),
        );
        registry.register(
            "rounds_abandoned",
            "Round attempts abandoned",
            m.rounds_abandoned.clone(),
        );
        registry.register(
            "uploads_accepted",
            "Updates accepted and durable",
            m.uploads_accepted.clone(),
        );
        registry.register(
            "uploads_rejected",
            "Updates refused, by reason",
            m.uploads_rejected.clone(),
        );
        registry.register(
            "upload_bytes",
            "Bytes of sealed updates received",
            m.upload_bytes.clone(),
        );
        registry.register(
            "ingest_seconds",
            "Open + validate + fold time of one update",
            m.ingest_seconds.clone(),
        );
        registry.register(
            "aggregation_seconds",
            "Time to aggregate and publish a round",
            m.aggregation_seconds.clone(),
        );
        registry.register(
            "store_commit_seconds",
            "Time of one group commit that makes uploads durable (the sum's checkpoint, the open round's record and the store's flush): the store's latency as rounds see it",
            m.store_commit_seconds.clone(),
        );
        registry.register(
            "sync_worlds_formed",
            "Complete worlds formed by sync-job rendezvous",
            m.sync_worlds_formed.clone(),
        );
        registry.register(
            "sync_join_timeouts",
            "Sync-job joins answered 408 because the world stayed incomplete",
            m.sync_join_timeouts.clone(),
        );
        registry.register(
            "lease_held",
            "1 while this replica holds its database's lease and leads (PostgreSQL store), 0 once it lost it or gave it back",
            m.lease_held.clone(),
        );
        registry.register(
            "lease_epoch",
            "The epoch (fencing token) of the lease this replica holds or last held",
            m.lease_epoch.clone(),
        );
        registry.register(
            "connections_open",
            "TCP connections open now",
            m.connections_open.clone(),
        );
        registry.register(
            "connections_closed",
            "Connections the server closed or refused, by reason (idle_timeout, evicted_at_cap, evicted_stalled_at_cap: every request on it waited for a body quiet for the idle timeout, refused_at_cap, and the same at a source's cap)",
            m.connections_closed.clone(),
        );
        registry.register(
            "unauthenticated_refused",
            "Requests refused 429 because their address had --max-unauthenticated-per-source requests in flight before their credentials passed",
            m.unauthenticated_refused.clone(),
        );
        registry.register(
            "clients_quarantined",
            "Clients quarantined after repeated refused updates (--quarantine-after)",
            m.clients_quarantined.clone(),
        );
        registry.register(
            "tasks_broken",
            "Tasks whose stored state could not be loaded (they answer 503 until repaired)",
            m.tasks_broken.clone(),
        );
        registry.register(
            "dp_epsilon",
            "Privacy spent by each task with differential privacy: ε at the task's δ over its published rounds",
            m.dp_epsilon.clone(),
        );
        registry.register(
            "async_buffered_updates",
            "Updates in the open buffer of each asynchronous task",
            m.async_buffered.clone(),
        );
        registry.register(
            "async_training_clients",
            "Clients holding a training slot of each asynchronous task",
            m.async_training.clone(),
        );
        registry.register(
            "async_update_staleness",
            "Versions published between an asynchronous update's base and the version it went into",
            m.update_staleness.clone(),
        );
        ServerMetrics { registry, ..m }
    }
}

impl ServerMetrics {
    pub fn round_published(&self, task: &str, seconds: f64) {
        self.rounds_published
            .get_or_create(&TaskLabel { task: task.into() })
            .inc();
        self.aggregation_seconds.observe(seconds);
    }

    pub fn round_abandoned(&self, task: &str) {
        self.rounds_abandoned
            .get_or_create(&TaskLabel { task: task.into() })
            .inc();
    }

    pub fn dp_epsilon(&self, task: &str, epsilon: f64) {
        self.dp_epsilon
            .get_or_create(&TaskLabel { task: task.into() })
            .set(epsilon);
    }

    pub fn async_buffered(&self, task: &str, updates: usize) {
        self.async_buffered
            .get_or_create(&TaskLabel { task: task.into() })
            .set(updates as i64);
    }

    pub fn async_training(&self, task: &str, clients: usize) {
        self.async_training
            .get_or_create(&TaskLabel { task: task.into() })
            .set(clients as i64);
    }

    pub fn update_staleness(&self, task: &str, staleness: u64) {
        self.update_staleness
            .get_or_create(&TaskLabel { task: task.into() })
            .observe(staleness as f64);
    }

    pub fn upload_rejected(&self, reason: &str) {
        self.uploads_rejected
            .get_or_create(&ReasonLabel {
                reason: reason.into(),
            })
            .inc();
    }

    pub fn sync_world_formed(&self, job: &str) {
        self.sync_worlds_formed
            .get_or_create(&JobLabel { job: job.into() })
            .inc();
    }

    pub fn sync_join_timed_out(&self, job: &str) {
        self.sync_join_timeouts
            .get_or_create(&JobLabel { job: job.into() })
            .inc();
    }

    pub fn connections_closed(&self, reason: &str) {
        self.connections_closed
            .get_or_create(&ReasonLabel {
                reason: reason.into(),
            })
            .inc();
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String cannot fail");
        out
    }
}
