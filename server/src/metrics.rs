//! Prometheus metrics (`GET /metrics`): rounds published and abandoned, uploads accepted and
//! rejected by reason, bytes received, ingest, aggregation and group-commit latency; sync-job worlds formed and
//! rendezvous joins that timed out; connections open and closed by the guard, by reason, and
//! requests refused for their address's unauthenticated requests in flight; tasks
//! whose stored state could not be loaded; the privacy each task with differential privacy has
//! spent (ε at the task's δ); for asynchronous tasks, the updates in each open buffer, the
//! clients holding a training slot and the staleness of folded updates (versions per second are
//! the rate of `hora_rounds_published_total`); every route's requests by method and status and
//! their time to a response (`hora_http_*`); and the process's own CPU time, memory, threads and
//! open files (`process_*`, the names every Prometheus exporter uses).

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

/// A request as `hora_http_requests_total` counts it: its route's template
/// (`/v1/tasks/{task}/poll`, never the path a client chose), method and answer.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabel {
    pub route: String,
    pub method: String,
    pub status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouteLabel {
    pub route: String,
    pub method: String,
}

fn latency_histogram() -> Histogram {
    Histogram::new(exponential_buckets(1e-4, 2.0, 20))
}

pub struct ServerMetrics {
    registry: Registry,
    rounds_published: Family<TaskLabel, Counter>,
    rounds_abandoned: Family<TaskLabel, Counter>,
    pub uploads_accepted: Counter,
    uploads_rejected: Family<ReasonLabel, Counter>,
    pub upload_bytes: Counter,
    /// Chunks of chunked uploads taken (each opened and spooled).
    pub upload_chunks: Counter,
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
    round_sum_bytes: Family<TaskLabel, Gauge>,
    async_training: Family<TaskLabel, Gauge>,
    update_staleness: Family<TaskLabel, Histogram, fn() -> Histogram>,
    evaluation_reports: Family<TaskLabel, Counter>,
    evaluation_round: Family<TaskLabel, Gauge>,
    evaluation_clients: Family<TaskLabel, Gauge>,
    evaluation_loss: Family<TaskLabel, Gauge<f64, AtomicU64>>,
    evaluation_accuracy: Family<TaskLabel, Gauge<f64, AtomicU64>>,
    http_requests: Family<RequestLabel, Counter>,
    http_seconds: Family<RouteLabel, Histogram, fn() -> Histogram>,
}

fn staleness_histogram() -> Histogram {
    Histogram::new(std::iter::once(0.0).chain(exponential_buckets(1.0, 2.0, 11)))
}

impl Default for ServerMetrics {
    fn default() -> Self {
        let mut root = Registry::default();
        root.register_collector(Box::new(ProcessCollector));
        let registry = root.sub_registry_with_prefix("hora");
        let m = ServerMetrics {
            http_requests: Family::default(),
            http_seconds: Family::new_with_constructor(latency_histogram),
            rounds_published: Family::default(),
            rounds_abandoned: Family::default(),
            uploads_accepted: Counter::default(),
            uploads_rejected: Family::default(),
            upload_bytes: Counter::default(),
            upload_chunks: Counter::default(),
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
            round_sum_bytes: Family::default(),
            async_training: Family::default(),
            update_staleness: Family::new_with_constructor(staleness_histogram),
            evaluation_reports: Family::default(),
            evaluation_round: Family::default(),
            evaluation_clients: Family::default(),
            evaluation_loss: Family::default(),
            evaluation_accuracy: Family::default(),
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
            "upload_chunks",
            "Chunks of chunked uploads taken (opened and spooled)",
            m.upload_chunks.clone(),
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
            "round_sum_bytes",
            "Bytes of the open round's running sum that this replica holds in memory (its partial sum; a regional server's is the partial it forwards), 0 while the task has no round open here",
            m.round_sum_bytes.clone(),
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
        registry.register(
            "evaluation_reports",
            "Federated-evaluation reports counted, per task",
            m.evaluation_reports.clone(),
        );
        registry.register(
            "evaluation_round",
            "The round (version) of each task's last ended federated evaluation",
            m.evaluation_round.clone(),
        );
        registry.register(
            "evaluation_clients",
            "Clients whose reports the last ended federated evaluation counted",
            m.evaluation_clients.clone(),
        );
        registry.register(
            "evaluation_loss",
            "Example-weighted mean loss of the last ended federated evaluation (absent until one had a loss)",
            m.evaluation_loss.clone(),
        );
        registry.register(
            "evaluation_accuracy",
            "Example-weighted accuracy of the last ended federated evaluation (absent until one had an accuracy)",
            m.evaluation_accuracy.clone(),
        );
        registry.register(
            "http_requests",
            "Requests answered, by route (its template), method and status",
            m.http_requests.clone(),
        );
        registry.register(
            "http_request_duration_seconds",
            "Time from a request's arrival to its response's head, by route and method (a long poll's includes its wait; a download's excludes its body)",
            m.http_seconds.clone(),
        );
        ServerMetrics {
            registry: root,
            ..m
        }
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

    pub fn evaluation_reported(&self, task: &str, reports: u32) {
        self.evaluation_reports
            .get_or_create(&TaskLabel { task: task.into() })
            .inc_by(u64::from(reports));
    }

    pub fn evaluation_ended(
        &self,
        task: &str,
        round: u64,
        summary: &hora_common::wire::EvaluationSummary,
    ) {
        let label = TaskLabel { task: task.into() };
        self.evaluation_round
            .get_or_create(&label)
            .set(i64::try_from(round).unwrap_or(i64::MAX));
        self.evaluation_clients
            .get_or_create(&label)
            .set(i64::from(summary.clients));
        if let Some(loss) = summary.loss {
            self.evaluation_loss.get_or_create(&label).set(loss);
        }
        if let Some(accuracy) = summary.accuracy {
            self.evaluation_accuracy.get_or_create(&label).set(accuracy);
        }
    }

    /// The open round of `task` holds a running sum of `bytes` (0: none open).
    pub fn round_sum_bytes(&self, task: &str, bytes: u64) {
        self.round_sum_bytes
            .get_or_create(&TaskLabel { task: task.into() })
            .set(i64::try_from(bytes).unwrap_or(i64::MAX));
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

    /// One answered request of `route` (its template).
    pub fn request(&self, route: &str, method: &str, status: u16, seconds: f64) {
        self.http_requests
            .get_or_create(&RequestLabel {
                route: route.into(),
                method: method.into(),
                status,
            })
            .inc();
        self.http_seconds
            .get_or_create(&RouteLabel {
                route: route.into(),
                method: method.into(),
            })
            .observe(seconds);
    }

    /// The metrics in OpenMetrics text; reads `/proc` for the process's (call it off the async
    /// runtime's threads).
    pub fn render(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String cannot fail");
        out
    }
}

/// The process's CPU time, resident memory (and its peak), threads, open files and start time, read from
/// `/proc/self` at each scrape under the conventional `process_*` names; nothing where there is
/// no `/proc`.
#[derive(Debug)]
struct ProcessCollector;

/// One reading of `/proc/self`.
#[derive(Debug, PartialEq)]
struct ProcessSample {
    cpu_seconds: f64,
    resident_bytes: f64,
    /// The most resident memory the process has had (`VmHWM`; the current figure where the
    /// kernel does not say).
    peak_resident_bytes: f64,
    virtual_bytes: f64,
    threads: f64,
    start_time_seconds: f64,
    open_fds: f64,
    max_fds: f64,
}

impl ProcessSample {
    fn read() -> Option<ProcessSample> {
        let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let boot = std::fs::read_to_string("/proc/stat").ok()?;
        let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
        let open_fds = std::fs::read_dir("/proc/self/fd").ok()?.count();
        // SAFETY: sysconf only reads a configuration value.
        let (ticks, page) = unsafe {
            (
                libc::sysconf(libc::_SC_CLK_TCK),
                libc::sysconf(libc::_SC_PAGESIZE),
            )
        };
        Self::parse(
            &stat,
            &status,
            &boot,
            &limits,
            open_fds,
            ticks as f64,
            page as f64,
        )
    }

    fn parse(
        stat: &str,
        status: &str,
        boot: &str,
        limits: &str,
        open_fds: usize,
        ticks: f64,
        page: f64,
    ) -> Option<ProcessSample> {
        if ticks <= 0.0 || page <= 0.0 {
            return None;
        }
        // After the command's closing parenthesis (the command may hold spaces and parentheses),
        // fields from the 3rd (state) on.
        let fields: Vec<&str> = stat
            .get(stat.rfind(')')? + 1..)?
            .split_whitespace()
            .collect();
        let field = |n: usize| fields.get(n - 3)?.parse::<f64>().ok();
        let boot_time: f64 = boot
            .lines()
            .find_map(|l| l.strip_prefix("btime "))?
            .trim()
            .parse()
            .ok()?;
        let max_fds = limits
            .lines()
            .find(|l| l.starts_with("Max open files"))
            .and_then(|l| l.split_whitespace().nth(3))
            .and_then(|v| v.parse().ok())
            .unwrap_or(f64::INFINITY);
        let resident_bytes = field(24)? * page;
        let peak_kib = status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().strip_suffix("kB"))
            .and_then(|v| v.trim().parse::<f64>().ok());
        Some(ProcessSample {
            cpu_seconds: (field(14)? + field(15)?) / ticks,
            peak_resident_bytes: peak_kib.map_or(resident_bytes, |k| k * 1024.0),
            threads: field(20)?,
            start_time_seconds: boot_time + field(22)? / ticks,
            virtual_bytes: field(23)?,
            resident_bytes,
            open_fds: open_fds as f64,
            max_fds,
        })
    }
}

impl prometheus_client::collector::Collector for ProcessCollector {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeMetric;
        use prometheus_client::metrics::counter::ConstCounter;
        use prometheus_client::metrics::gauge::ConstGauge;
        let Some(s) = ProcessSample::read() else {
            return Ok(());
        };
        let cpu = ConstCounter::new(s.cpu_seconds);
        cpu.encode(encoder.encode_descriptor(
            "process_cpu_seconds",
            "User and system CPU time spent, in seconds",
            None,
            cpu.metric_type(),
        )?)?;
        for (name, help, value) in [
            (
                "process_resident_memory_bytes",
                "Resident memory, in bytes",
                s.resident_bytes,
            ),
            (
                "process_resident_memory_peak_bytes",
                "The most resident memory the process has had, in bytes",
                s.peak_resident_bytes,
            ),
            (
                "process_virtual_memory_bytes",
                "Virtual memory, in bytes",
                s.virtual_bytes,
            ),
            ("process_threads", "Operating-system threads", s.threads),
            (
                "process_open_fds",
                "Open file descriptors (connections among them)",
                s.open_fds,
            ),
            (
                "process_max_fds",
                "The limit on open file descriptors",
                s.max_fds,
            ),
            (
                "process_start_time_seconds",
                "When the process started, in seconds since the Unix epoch",
                s.start_time_seconds,
            ),
        ] {
            let gauge = ConstGauge::new(value);
            gauge.encode(encoder.encode_descriptor(name, help, None, gauge.metric_type())?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_readings_are_parsed_whatever_the_command_is_called() {
        let stat = "4242 (hora (serve) x) S 1 4242 4242 0 -1 4194560 1000 0 0 0 250 50 0 0 20 0 7 0 12345 104857600 2560 18446744073709551615";
        let limits = "Limit                     Soft Limit           Hard Limit           Units\nMax open files            1024                 524288               files\n";
        let status =
            "Name:\thora-server\nVmPeak:\t  204800 kB\nVmHWM:\t   20480 kB\nVmRSS:\t   10240 kB\n";
        let s = ProcessSample::parse(
            stat,
            status,
            "cpu 1 2 3\nbtime 1700000000\n",
            limits,
            12,
            100.0,
            4096.0,
        )
        .unwrap();
        assert_eq!(
            s,
            ProcessSample {
                cpu_seconds: 3.0,
                resident_bytes: 2560.0 * 4096.0,
                peak_resident_bytes: 20480.0 * 1024.0,
                virtual_bytes: 104857600.0,
                threads: 7.0,
                start_time_seconds: 1700000000.0 + 123.45,
                open_fds: 12.0,
                max_fds: 1024.0,
            }
        );
        // No VmHWM: the current figure.
        let s = ProcessSample::parse(stat, "", "btime 1\n", limits, 12, 100.0, 4096.0).unwrap();
        assert_eq!(s.peak_resident_bytes, s.resident_bytes);
        assert_eq!(
            ProcessSample::parse("garbage", "", "", "", 0, 100.0, 4096.0),
            None
        );
    }

    #[test]
    fn the_scrape_holds_the_process_and_route_metrics() {
        let m = ServerMetrics::default();
        m.request("/v1/tasks/{task}/poll", "GET", 200, 0.25);
        let text = m.render();
        assert!(
            text.contains(
                "hora_http_requests_total{route=\"/v1/tasks/{task}/poll\",method=\"GET\",status=\"200\"} 1"
            ),
            "{text}"
        );
        assert!(
            text.contains("hora_http_request_duration_seconds_count"),
            "{text}"
        );
        if std::path::Path::new("/proc/self/stat").exists() {
            for name in [
                "process_cpu_seconds_total",
                "process_resident_memory_bytes",
                "process_resident_memory_peak_bytes",
                "process_open_fds",
            ] {
                assert!(text.contains(&format!("\n{name} ")), "{name}: {text}");
            }
        }
        assert_eq!(text.matches("# EOF").count(), 1);
    }

    /// The Grafana dashboard (deploy/grafana/hora.json) asks only for metrics the server has.
    #[test]
    fn the_dashboard_asks_for_exported_metrics_only() {
        let m = ServerMetrics::default();
        // A series in every family (an empty family is not exported).
        m.round_published("t", 0.1);
        m.round_abandoned("t");
        m.dp_epsilon("t", 1.0);
        m.async_buffered("t", 1);
        m.round_sum_bytes("t", 8);
        m.async_training("t", 1);
        m.update_staleness("t", 1);
        m.upload_rejected("invalid_update");
        m.sync_world_formed("j");
        m.sync_join_timed_out("j");
        m.connections_closed("idle");
        m.request("/healthz", "GET", 200, 0.001);
        let text = m.render();
        let families: std::collections::BTreeSet<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .filter_map(|l| l.split_whitespace().next())
            .collect();
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/grafana/hora.json");
        let dashboard: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let mut asked = std::collections::BTreeSet::new();
        for panel in dashboard["panels"].as_array().unwrap() {
            for target in panel["targets"].as_array().into_iter().flatten() {
                let expr = target["expr"].as_str().unwrap();
                for word in expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
                    if !(word.starts_with("hora_") || word.starts_with("process_")) {
                        continue;
                    }
                    let family = ["_total", "_bucket", "_count", "_sum"]
                        .iter()
                        .find_map(|suffix| word.strip_suffix(suffix))
                        .unwrap_or(word);
                    assert!(
                        families.contains(family),
                        "the dashboard's panel {} asks for {word}, which the server does not export:\n{text}",
                        panel["title"]
                    );
                    asked.insert(family);
                }
            }
        }
        // And it shows every family but the start time.
        let shown: Vec<_> = families
            .iter()
            .filter(|f| !asked.contains(*f) && **f != "process_start_time_seconds")
            .collect();
        assert!(shown.is_empty(), "not on the dashboard: {shown:?}");
    }
}
