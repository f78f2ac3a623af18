//! How the store's synchronous methods talk to PostgreSQL: where it is ([`Target`], what
//! `--store` names), a pool of connections, and the small runtime of the store's own that runs
//! them.
//!
//! The store traits are synchronous (their callers run them on blocking threads), the driver is
//! asynchronous. Each method hands its queries, as one future, to the store's runtime and waits
//! for the answer on a channel ([`Driver::run`]): that works from any thread, a runtime worker
//! of the server's included, where `Runtime::block_on` would panic.

use std::fmt;
use std::future::Future;
use std::str::FromStr;
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Object, Pool, PoolError, RecyclingMethod};
use tokio_postgres::config::{Host, SslMode};
use tokio_postgres::error::SqlState;
use tokio_postgres::NoTls;

use crate::store::StoreError;

/// Connections the pool holds at most: the store's callers are the server's blocking threads,
/// and a handful of connections keeps up with what a few cores can ask of them.
const POOL_SIZE: usize = 16;
/// How long a query waits for a connection, and a connection attempt for the server, before the
/// store answers that the database is unavailable.
const WAIT: Duration = Duration::from_secs(10);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// The longest one store call (its wait for a connection and every query of it) may take; then
/// the database counts as unavailable. Also each statement's limit on the server side.
const CALL_LIMIT: Duration = Duration::from_secs(30);
/// A connection silent this long is probed (TCP keepalive), and one whose data goes
/// unacknowledged this long is dropped: a database behind a dead network path is noticed in
/// seconds, not after the system's two hours.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(15);
const USER_TIMEOUT: Duration = Duration::from_secs(30);
/// The longest a transaction may sit idle on the database (every one of the store's runs its
/// statements back to back; one that sits is a client gone).
const IDLE_IN_TRANSACTION: Duration = Duration::from_secs(5);

/// A PostgreSQL database, as `--store postgres://user:password@host:port/database` names it
/// (with any of the URL parameters `tokio-postgres` reads: `connect_timeout`,
/// `application_name`, `sslmode`, …, and libpq's `sslrootcert`). Shown and debugged without its
/// password.
///
/// TLS: `sslmode=require&sslrootcert=/path/ca.pem` connects only over TLS, verifying that the
/// database's certificate chains to that CA and names the host (libpq's `verify-full`); with
/// `sslrootcert` and the default `sslmode=prefer`, TLS is used when the database offers it, and
/// verified the same way. Without `sslrootcert`, connections are plain (`require` is refused:
/// there would be nothing to verify the database against).
#[derive(Clone)]
pub struct Target {
    config: tokio_postgres::Config,
    /// `host:port/database`, for messages.
    shown: String,
    /// TLS to the database, verified against `sslrootcert`'s CA.
    tls: Option<tokio_postgres_rustls::MakeRustlsConnect>,
}

/// `url` without its `sslrootcert` parameter, and that parameter's value (decoded).
fn take_root_cert(url: &str) -> (String, Option<String>) {
    let Some((base, query)) = url.split_once('?') else {
        return (url.to_string(), None);
    };
    let (mut kept, mut root) = (Vec::new(), None);
    for pair in query.split('&') {
        match pair.strip_prefix("sslrootcert=") {
            Some(value) => {
                root = Some(
                    percent_encoding::percent_decode_str(value)
                        .decode_utf8_lossy()
                        .into_owned(),
                )
            }
            None => kept.push(pair),
        }
    }
    match kept.is_empty() {
        true => (base.to_string(), root),
        false => (format!("{base}?{}", kept.join("&")), root),
    }
}

/// A TLS connector that trusts only the CA in `path` (PEM).
fn tls_to(path: &str) -> Result<tokio_postgres_rustls::MakeRustlsConnect, String> {
    let mut config = hora_common::tls::client_config(std::path::Path::new(path), None)
        .map_err(|e| format!("sslrootcert: {e}"))?;
    // PostgreSQL 17 accepts only its own protocol name, when a client names one.
    config.alpn_protocols = vec![b"postgresql".to_vec()];
    Ok(tokio_postgres_rustls::MakeRustlsConnect::new(config))
}

impl FromStr for Target {
    type Err = String;

    fn from_str(url: &str) -> Result<Self, String> {
        let (url, root) = take_root_cert(url);
        let mut config = tokio_postgres::Config::from_str(&url).map_err(|e| {
            let detail = std::error::Error::source(&e)
                .map(|s| format!(": {s}"))
                .unwrap_or_default();
            format!("not a PostgreSQL connection URL ({e}{detail}); give postgres://user:password@host:port/database")
        })?;
        if config.get_hosts().is_empty() && config.get_hostaddrs().is_empty() {
            return Err("the PostgreSQL URL names no host: give postgres://user:password@host:port/database".into());
        }
        let tls = root.as_deref().map(tls_to).transpose()?;
        match (config.get_ssl_mode(), &tls) {
            (SslMode::Require, None) => {
                return Err("sslmode=require needs sslrootcert=/path/to/ca.pem too (the CA that signed the database's certificate), so that the database's certificate is verified; e.g. postgres://user@db:5432/hora?sslmode=require&sslrootcert=/etc/hora/db-ca.pem".into());
            }
            // Nothing to verify a certificate against: plain, as libpq's `prefer` would end up
            // without a CA it trusts.
            (SslMode::Prefer, None) => {
                config.ssl_mode(SslMode::Disable);
            }
            _ => {}
        }
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(CONNECT_TIMEOUT);
        }
        config.keepalives(true);
        config.keepalives_idle(KEEPALIVE_IDLE);
        config.tcp_user_timeout(USER_TIMEOUT);
        // Session settings, after any the URL gives (which win): a statement's limit, and the
        // database's own watch on this connection. A transaction left open by a replica on a
        // dead network path (holding the lease's fence) ends in seconds, and a dead client is
        // found by keepalive, instead of after the system's two hours.
        let session = format!(
            "-c statement_timeout={} -c idle_in_transaction_session_timeout={} -c tcp_keepalives_idle=5 -c tcp_keepalives_interval=2 -c tcp_keepalives_count=3 -c tcp_user_timeout=10000",
            CALL_LIMIT.as_millis(),
            IDLE_IN_TRANSACTION.as_millis()
        );
        let options = match config.get_options() {
            Some(given) => format!("{session} {given}"),
            None => session,
        };
        config.options(options);
        if config.get_application_name().is_none() {
            config.application_name("hora-server");
        }
        let host = match (config.get_hosts().first(), config.get_hostaddrs().first()) {
            (Some(Host::Tcp(name)), _) => name.clone(),
            (Some(Host::Unix(dir)), _) => dir.display().to_string(),
            (None, Some(addr)) => addr.to_string(),
            (None, None) => String::new(),
        };
        let port = config.get_ports().first().copied().unwrap_or(5432);
        let shown = format!(
            "{host}:{port}/{}",
            config
                .get_dbname()
                .or(config.get_user())
                .unwrap_or_default()
        );
        Ok(Target { config, shown, tls })
    }
}

impl Target {
    pub(super) fn config(&self) -> &tokio_postgres::Config {
        &self.config
    }

    /// The TLS connector, when connections may use TLS (`sslrootcert` given).
    pub(super) fn tls(&self) -> Option<tokio_postgres_rustls::MakeRustlsConnect> {
        self.tls.clone()
    }

    /// A connection of its own, outside the pool (its I/O task spawned on the current runtime).
    pub(super) async fn connect(&self) -> Result<tokio_postgres::Client, tokio_postgres::Error> {
        match self.tls() {
            Some(tls) => {
                let (client, connection) = self.config.connect(tls).await?;
                tokio::spawn(connection);
                Ok(client)
            }
            None => {
                let (client, connection) = self.config.connect(NoTls).await?;
                tokio::spawn(connection);
                Ok(client)
            }
        }
    }

    /// Whether connections use TLS whenever the database offers it.
    pub fn uses_tls(&self) -> bool {
        self.tls.is_some()
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.shown)
    }
}

impl fmt::Debug for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Target({})", self.shown)
    }
}

/// Why a query failed: the driver's error (to be told apart: unreachable or not) or the
/// store's own (a record that does not decode). `?` turns either into one.
pub(super) enum Failure {
    Pg(tokio_postgres::Error),
    Store(StoreError),
}

impl From<tokio_postgres::Error> for Failure {
    fn from(e: tokio_postgres::Error) -> Self {
        Failure::Pg(e)
    }
}

impl From<StoreError> for Failure {
    fn from(e: StoreError) -> Self {
        Failure::Store(e)
    }
}

/// The store's runtime and its pool of connections.
pub(super) struct Driver {
    /// Some until dropped (then shut down without waiting: dropping a runtime where blocking is
    /// not allowed would panic).
    runtime: Option<tokio::runtime::Runtime>,
    pool: Pool,
    target: Target,
}

impl Driver {
    pub(super) fn start(target: &Target) -> Result<Self, StoreError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("hora-postgres")
            .enable_all()
            .build()
            .map_err(|source| StoreError::Io {
                path: "the PostgreSQL store's runtime".into(),
                source,
            })?;
        let manager_config = ManagerConfig {
            // A connection the server closed is found out at its next use: that query fails
            // (503, retried by the client) and the connection is dropped.
            recycling_method: RecyclingMethod::Fast,
        };
        let manager = match target.tls() {
            Some(tls) => Manager::from_config(target.config.clone(), tls, manager_config),
            None => Manager::from_config(target.config.clone(), NoTls, manager_config),
        };
        let pool = Pool::builder(manager)
            .max_size(POOL_SIZE)
            .runtime(deadpool_postgres::Runtime::Tokio1)
            .wait_timeout(Some(WAIT))
            .create_timeout(Some(WAIT))
            .recycle_timeout(Some(WAIT))
            .build()
            .map_err(|e| StoreError::Postgres(format!("building the connection pool: {e}")))?;
        Ok(Driver {
            runtime: Some(runtime),
            pool,
            target: target.clone(),
        })
    }

    fn handle(&self) -> &tokio::runtime::Handle {
        self.runtime
            .as_ref()
            .expect("the runtime lives until the driver is dropped")
            .handle()
    }

    /// Runs `work` on the store's runtime and waits for it, at most [`CALL_LIMIT`]. Called from
    /// the server's blocking threads (or any thread outside the store's own runtime: a call from
    /// one of its workers would wait for a task queued behind itself).
    pub(super) fn run<T, F>(&self, work: F) -> Result<T, StoreError>
    where
        F: Future<Output = Result<T, Failure>> + Send + 'static,
        T: Send + 'static,
    {
        let (answer, answered) = std::sync::mpsc::sync_channel(1);
        let target = self.target.clone();
        self.handle().spawn(async move {
            let answered = match tokio::time::timeout(CALL_LIMIT, work).await {
                Ok(answer) => answer,
                Err(_) => Err(Failure::Store(StoreError::Unavailable {
                    at: target.to_string(),
                    reason: format!("no answer within {} s", CALL_LIMIT.as_secs()),
                })),
            };
            let _ = answer.send(answered);
        });
        match answered.recv() {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(Failure::Store(e))) => Err(e),
            Ok(Err(Failure::Pg(e))) => Err(self.error(e)),
            // The task ended without answering: it panicked (the runtime outlives every call).
            Err(_) => Err(StoreError::Postgres(
                "a query ended without an answer".into(),
            )),
        }
    }

    /// The database it talks to.
    pub(super) fn target(&self) -> &Target {
        &self.target
    }

    /// Runs `work` with a connection from the pool.
    pub(super) fn with<T, F, Fut>(&self, work: F) -> Result<T, StoreError>
    where
        F: FnOnce(Object) -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, Failure>> + Send,
        T: Send + 'static,
    {
        let pool = self.pool.clone();
        let target = self.target.clone();
        self.run(async move {
            let client = pool.get().await.map_err(|e| pool_error(&target, e))?;
            work(client).await
        })
    }

    /// The store's error for a driver's error: unreachable (worth retrying, 503) or not.
    pub(super) fn error(&self, e: tokio_postgres::Error) -> StoreError {
        classify(&self.target, e)
    }

    /// Spawns `work` on the store's runtime (the LISTEN connection's loop); it ends with the
    /// store.
    pub(super) fn spawn(
        &self,
        work: impl Future<Output = ()> + Send + 'static,
    ) -> tokio::task::JoinHandle<()> {
        self.handle().spawn(work)
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

/// Whether a driver's error means the database cannot be reached or cannot serve now, rather
/// than a query it refused.
pub(super) fn classify(target: &Target, e: tokio_postgres::Error) -> StoreError {
    let unavailable = match e.code() {
        Some(code) => {
            let class = &code.code()[..2];
            // Connection exceptions, authentication, no such database, transaction rollback
            // (a serialization failure or deadlock: worth retrying), insufficient resources (too
            // many connections), operator intervention (shutdown, restart, starting up, a
            // statement over its time limit), a lock not had within its timeout.
            matches!(class, "08" | "28" | "40" | "53" | "57")
                || *code == SqlState::INVALID_CATALOG_NAME
                || *code == SqlState::LOCK_NOT_AVAILABLE
        }
        None => {
            e.is_closed()
                || std::error::Error::source(&e).is_some_and(|s| s.is::<std::io::Error>())
                || e.to_string().starts_with("timeout")
        }
    };
    let reason = match e.as_db_error() {
        Some(db) => format!("{}: {}", db.severity(), db.message()),
        None => match std::error::Error::source(&e) {
            Some(source) => format!("{e}: {source}"),
            None => e.to_string(),
        },
    };
    if unavailable {
        StoreError::Unavailable {
            at: target.to_string(),
            reason,
        }
    } else {
        StoreError::Postgres(reason)
    }
}

fn pool_error(target: &Target, e: PoolError) -> Failure {
    match e {
        PoolError::Backend(e) => Failure::Pg(e),
        other => Failure::Store(StoreError::Unavailable {
            at: target.to_string(),
            reason: format!("no connection: {other}"),
        }),
    }
}
