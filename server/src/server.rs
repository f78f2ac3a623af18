//! The server as a value: [`Server::build`] opens the store (`--store`: sled in the data
//! directory, or PostgreSQL), loads every task and sync job, and prepares TLS; [`Server::run`] serves on a listener until a shutdown future resolves.
//! `hora-server serve` is build, bind, run with SIGINT/SIGTERM as the shutdown ([`crate::serve`]);
//! tests start the same server in-process on `127.0.0.1:0`.

use std::future::Future;
use std::net::TcpListener;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};

use crate::config::ServeConfig;
use crate::round::{Acknowledge, Coordinator, CoordinatorConfig, Role};
use crate::store::Store;
use crate::{api, auth, conn, metrics, rendezvous, store, tls};

const HTTP2_STREAM_WINDOW: u32 = 128 << 10;
const HTTP2_CONNECTION_WINDOW: u32 = 256 << 10;

/// A built server, ready to run.
pub struct Server {
    config: ServeConfig,
    store: Arc<Store>,
    coordinator: Arc<Coordinator>,
    app: axum::Router,
    /// Whether it leads, or serves clients without leading.
    role: Role,
    /// The HTTP layer's state (for its background sweeps).
    state: api::Shared,
    tls: rustls::ServerConfig,
    connections: Arc<conn::Connections>,
    metrics: Arc<metrics::ServerMetrics>,
    /// The admin token made at this start, when none was given and none was stored: it is shown
    /// once (only its hash is kept).
    pub generated_admin_token: Option<String>,
    /// The development CA that clients must trust, when the server made its own certificates.
    pub dev_ca: Option<PathBuf>,
}

impl Server {
    /// Opens the store (sweeping orphaned files), loads every task — resuming open
    /// rounds from their checkpoints — and every sync job, and prepares TLS (development
    /// certificates are made when none are given).
    pub fn build(config: ServeConfig) -> Result<Server> {
        Self::build_unless(config, &|| false)
    }

    /// [`build`](Self::build), which with a PostgreSQL store first waits, standing by, until
    /// this replica leads (see `store::postgres::lease`); it fails with
    /// [`store::StoreError::Stopped`] once `give_up` says so.
    pub fn build_unless(config: ServeConfig, give_up: &dyn Fn() -> bool) -> Result<Server> {
        let replica = store::postgres::Replica::this(&config.listen.to_string());
        Self::build_as(config, replica, give_up)
    }

    /// [`build_unless`](Self::build_unless) as `replica` (the same each time a process stands
    /// by again).
    pub fn build_as(
        config: ServeConfig,
        replica: store::postgres::Replica,
        give_up: &dyn Fn() -> bool,
    ) -> Result<Server> {
        let fd_limit = conn::raise_fd_limit();
        let id = replica.id.clone();
        let lease = store::postgres::LeaseSettings::new(replica, config.lease);
        let store: Arc<Store> = config
            .store
            .open_leading(&config.data_dir, &config.blobs, &lease, give_up)
            .with_context(|| {
                let blobs = match &config.blobs {
                    store::BlobLocation::DataDir => {
                        format!("under {}", config.data_dir.display())
                    }
                    other => format!("in {other}"),
                };
                match &config.store {
                    store::StoreLocation::Sled => format!(
                        "opening the data directory {} (blobs {blobs})",
                        config.data_dir.display()
                    ),
                    store::StoreLocation::Postgres(target) => {
                        format!("opening the PostgreSQL store at {target} (blobs {blobs})")
                    }
                }
            })?;
        // Whatever fails from here, a lease taken is handed back at once, not left to lapse.
        Self::build_on(config, store.clone(), fd_limit, (Role::Leader, id)).inspect_err(|_| {
            if let Err(e) = store.step_down() {
                tracing::warn!(error = %e, "handing the lease back failed; it lapses by itself");
            }
        })
    }

    /// A replica that serves clients without leading (see `round::replicas`),
    /// as `replica`, while another leads: on a PostgreSQL store whose blobs every replica
    /// reaches (`--blobs`), once a replica has led (it tied the blobs, made the admin token and
    /// any development certificates). None for a deployment whose replicas can only stand by.
    pub fn build_follower(config: ServeConfig, replica: &str) -> Result<Option<Server>> {
        let Some(store) = config
            .store
            .open_following(&config.data_dir, &config.blobs, config.lease)
            .context("opening the store to serve without leading")?
        else {
            return Ok(None);
        };
        let fd_limit = conn::raise_fd_limit();
        Self::build_on(
            config,
            store,
            fd_limit,
            (Role::Follower, replica.to_string()),
        )
        .map(Some)
    }

    /// The rest of [`build`](Self::build), on an open store, for a replica of `role` whose id
    /// is `.1`.
    fn build_on(
        config: ServeConfig,
        store: Arc<Store>,
        fd_limit: Option<u64>,
        (role, replica): (Role, String),
    ) -> Result<Server> {
        let leads = role == Role::Leader;
        // Each time it serves, a replica's claims and partials carry an id of their own: a
        // follower that comes to lead must not take its own earlier updates for unseen ones.
        let replica = format!("{replica}#{:016x}", rand::random::<u64>());
        // Housekeeping: a blob store that fails it now (a blip during a restart) costs some
        // space until the next start, not the start. (The leader's alone.)
        match store.sweep_orphans() {
            _ if !leads => {}
            Ok(0) => {}
            Ok(swept) => tracing::info!(files = swept, "removed orphaned files"),
            Err(e) => tracing::warn!(
                "sweeping orphaned files failed ({e}); they stay until the next start's sweep"
            ),
        }
        let (admin_token_hash, generated_admin_token) = match leads {
            true => admin_token(&*store, &config)?,
            false => (
                store
                    .meta("admin_token_hash")?
                    .context("no admin token yet: the first replica to lead makes it")?,
                None,
            ),
        };
        let (cert_paths, dev_ca) = match leads {
            true => certificates(&config)?,
            false => (
                existing_certificates(&config).context("no certificates yet: development certificates are made by the first replica to lead")?,
                None,
            ),
        };
        let tls = tls::server_config(&cert_paths, config.client_ca.as_deref())?;

        let metrics = Arc::new(metrics::ServerMetrics::default());
        if let Some(lease) = store.lease() {
            metrics.lease_held.set(1);
            metrics.lease_epoch.set(lease.epoch);
        }
        let coordinator = Coordinator::open(
            store.clone(),
            CoordinatorConfig {
                commit_window: config.commit_window(),
                durability_timeout: config.durability_timeout,
                retention: config.retention,
                quarantine_after: config.quarantine_after,
                parent: config.parent.clone(),
                role: role.clone(),
                replica,
                max_poll_wait: CoordinatorConfig::poll_cap(
                    CoordinatorConfig::default().max_poll_wait,
                    config.idle_timeout,
                    config.request_timeout,
                ),
                acknowledge: Acknowledge::Durable,
                graph_seed: None,
            },
            metrics.clone(),
        )
        .map_err(|e| anyhow::anyhow!("loading state: {e}"))?;
        let rendezvous = rendezvous::Rendezvous::open(store.clone(), metrics.clone())
            .context("loading the sync jobs")?;
        let spool_dir = config.data_dir.join("spool");
        api::chunked::prepare_spool(&spool_dir).with_context(|| {
            format!(
                "preparing the spool for large uploads in {}",
                spool_dir.display()
            )
        })?;
        let chunking = (config.upload_chunk_bytes > 0).then_some(api::chunked::Chunking {
            chunk_bytes: config.upload_chunk_bytes,
            spool_bytes: config.spool_bytes,
        });
        let dashboard = crate::dashboard::Dashboard::new(
            config.dashboard_secret.as_deref().map(str::as_bytes),
            &admin_token_hash,
        )
        .map_err(|e| anyhow::anyhow!("{e}"))?;
        let state = api::AppState::new(
            coordinator.clone(),
            admin_token_hash,
            api::HttpLimits {
                max_model_bytes: config.max_model_bytes,
                body_rate: api::BodyRate {
                    min_bytes_per_sec: config.min_upload_rate,
                    grace: config.upload_grace,
                },
                upload_buffer_bytes: config.upload_buffer_bytes,
                max_upload_share: config.max_upload_share,
                body_wait: config.body_wait,
                request_timeout: config.request_timeout,
                metrics_require_token: config.metrics_require_token,
                max_concurrent_uploads: config.max_concurrent_uploads,
                admin_allow: config.admin_allow.clone(),
                spool_dir,
                chunking,
                ..Default::default()
            },
            rendezvous,
            dashboard,
        );
        let limits = connection_limits(&config, fd_limit);
        tracing::info!(
            max_connections = limits.max_connections,
            max_connections_per_source = limits.max_per_source,
            max_unauthenticated_per_source = limits.max_unauthenticated_per_source,
            open_file_limit = fd_limit,
            idle_timeout_secs = limits.idle_timeout.as_secs(),
            "connection limits"
        );
        let connections = conn::Connections::new(limits, metrics.clone());
        Ok(Server {
            metrics,
            app: match leads {
                true => api::router(state.clone()),
                false => api::follower_router(state.clone()),
            },
            role,
            state,
            config,
            store,
            coordinator,
            tls,
            connections,
            generated_admin_token,
            dev_ca,
        })
    }

    /// Hands the store's lease back (a server that will not run after all), so that a standby
    /// takes over at once.
    pub async fn hand_back(&self) {
        let store = self.store.clone();
        if let Ok(Err(e)) = tokio::task::spawn_blocking(move || store.step_down()).await {
            tracing::warn!(error = %e, "handing the lease back failed; it lapses by itself");
        }
    }

    /// Binds the configured `--listen` address.
    pub fn bind(&self) -> Result<TcpListener> {
        TcpListener::bind(self.config.listen)
            .with_context(|| format!("listening on {}", self.config.listen))
    }

    /// Serves on `listener` until `shutdown` resolves, or until this replica loses its
    /// database's lease; then stops accepting connections and gives requests in flight up to ten
    /// seconds, and hands the lease back (a standby takes over). Uploads not yet acknowledged
    /// are retried by their clients; acknowledged ones are durable already.
    pub async fn run(
        self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<Stopped> {
        listener.set_nonblocking(true)?;
        self.coordinator.start();
        api::chunked::sweep_idle(&self.state);
        let handle = axum_server::Handle::new();
        let (stopped_tx, mut stopped_rx) = tokio::sync::oneshot::channel();
        {
            let handle = handle.clone();
            let lease = self.store.lease();
            let metrics = self.metrics.clone();
            let dashboard_closing = self.state.dashboard.closing.clone();
            let role_at_stop = self.role.clone();
            tokio::spawn(async move {
                let deposed = async move {
                    let Some(mut lease) = lease else {
                        return std::future::pending().await;
                    };
                    let why = lease
                        .lost
                        .wait_for(Option::is_some)
                        .await
                        .map(|why| why.clone().unwrap_or_default());
                    match why {
                        Ok(why) => why,
                        Err(_) => std::future::pending().await,
                    }
                };
                let stopped = tokio::select! {
                    () = shutdown => {
                        tracing::info!("shutting down: finishing requests in flight");
                        Stopped::Shutdown
                    }
                    why = deposed => {
                        metrics.lease_held.set(0);
                        tracing::error!(why, "this replica lost its database's lease: it stops serving (its writes are refused already) and finishes requests in flight");
                        Stopped::Deposed(why)
                    }
                };
                // Dashboards' feeds end now, so they do not hold the shutdown's grace.
                dashboard_closing.cancel();
                // A follower that is to lead stops at once: its clients' requests in flight are
                // retried (what it acknowledged is durable already), and it leads sooner.
                let grace = match role_at_stop {
                    Role::Leader => Duration::from_secs(10),
                    Role::Follower => Duration::ZERO,
                };
                handle.graceful_shutdown(Some(grace));
                let _ = stopped_tx.send(stopped);
            });
        }
        let serving = serve_tls(
            listener,
            self.tls,
            self.config.header_timeout,
            self.connections,
            handle.clone(),
            self.app,
        )?;
        let role = self.role.clone();
        let announce = async {
            if let Some(addr) = handle.listening().await {
                // Tests and scripts read this line to learn the port (with --listen 127.0.0.1:0).
                match role {
                    Role::Leader => crate::say(&format!("hora-server listening on https://{addr}")),
                    // (It says "listening on" once it leads.)
                    Role::Follower => {
                        tracing::info!("serving clients while another replica leads");
                        crate::say(&format!("hora-server following on https://{addr}"));
                    }
                }
            }
        };
        let (result, ()) = tokio::join!(serving, announce);
        self.coordinator.stop().await;
        // Handed back even when serving failed: a standby takes over at once.
        let store = self.store.clone();
        let stepped = tokio::task::spawn_blocking(move || {
            let flushed = store.flush();
            store.step_down().and(flushed)
        })
        .await;
        self.metrics.lease_held.set(0);
        result.context("serving")?;
        stepped??;
        tracing::info!("stopped");
        // Ended by the lease's loss, or else by `shutdown` (or the listener's end).
        Ok(stopped_rx.try_recv().unwrap_or(Stopped::Shutdown))
    }
}

/// The connection limits of `config`, on a process allowed `fd_limit` open files.
fn connection_limits(config: &ServeConfig, fd_limit: Option<u64>) -> conn::ConnectionLimits {
    let max_connections = config
        .max_connections
        .unwrap_or_else(|| conn::default_max_connections(fd_limit));
    conn::ConnectionLimits {
        max_connections,
        max_per_source: config
            .max_connections_per_source
            .unwrap_or((max_connections / 4).max(1)),
        idle_timeout: config.idle_timeout,
        max_unauthenticated_per_source: config.max_unauthenticated_per_source,
    }
}

/// A replica's port (`--listen`), bound once, before it first stands by: a port in use fails
/// the start, not a takeover. While the replica stands by, the port answers as
/// [`api::standby_router`] says ([`stand_by`](Self::stand_by)), so that liveness probes find
/// it alive, load balancers route past it and clients move on; once it leads,
/// [`listener`](Self::listener) goes to [`Server::run`].
pub struct Port {
    listener: TcpListener,
    config: ServeConfig,
    connections: Arc<conn::Connections>,
    /// Why it last could not serve as a follower (said once).
    told: std::sync::Mutex<Option<String>>,
}

impl Port {
    /// Binds `config`'s `--listen` address. None when the address is
    /// taken or not this machine's yet: the leader's own (replicas on one address, or a floating
    /// address that moves to whoever leads), which this replica binds only once it leads.
    pub fn bind(config: &ServeConfig) -> Result<Option<Port>> {
        let listener = match TcpListener::bind(config.listen) {
            Ok(listener) => listener,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::AddrInUse | std::io::ErrorKind::AddrNotAvailable
                ) =>
            {
                tracing::info!(
                    listen = %config.listen,
                    error = %e,
                    "cannot listen while standing by (another replica's address?): this replica listens once it leads"
                );
                return Ok(None);
            }
            Err(e) => {
                return Err(e).with_context(|| format!("listening on {}", config.listen));
            }
        };
        let limits = connection_limits(config, conn::raise_fd_limit());
        Ok(Some(Port {
            listener,
            config: config.clone(),
            connections: conn::Connections::new(limits, Arc::default()),
            told: Default::default(),
        }))
    }

    /// The address bound.
    pub fn local_addr(&self) -> std::io::Result<std::net::SocketAddr> {
        self.listener.local_addr()
    }

    /// The bound listener, for [`Server::run`].
    pub fn listener(&self) -> Result<TcpListener> {
        self.listener
            .try_clone()
            .context("sharing the listening socket")
    }

    /// Serves clients without leading (see [`Server::build_follower`]) until
    /// [`StandingBy::end`], as `replica`; where this deployment's replicas cannot (their blobs are
    /// not shared, or no replica has led yet), answers as a standby instead
    /// ([`stand_by`](Self::stand_by)). Blocking while it loads the tasks.
    pub fn follow(&self, replica: &str) -> Result<StandingBy> {
        match self.follower(replica)? {
            Some(following) => Ok(following),
            None => self.stand_by(),
        }
    }

    /// Serves clients without leading, as [`follow`](Self::follow) does; None where this
    /// deployment's replicas cannot (yet: the reason is logged once). Blocking.
    pub fn follower(&self, replica: &str) -> Result<Option<StandingBy>> {
        let follower = match Server::build_follower(self.config.clone(), replica) {
            Ok(Some(follower)) => follower,
            Ok(None) => return Ok(None),
            Err(e) => {
                let why = format!("{e:#}");
                let mut told = self
                    .told
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                if told.as_deref() != Some(why.as_str()) {
                    tracing::info!(error = %why, "not serving clients while another replica leads: standing by");
                    *told = Some(why);
                }
                return Ok(None);
            }
        };
        let listener = self.listener()?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let serving = tokio::spawn(async move {
            let stopped = async move {
                let _ = stopped.await;
            };
            if let Err(e) = follower.run(listener, stopped).await {
                tracing::warn!(error = format!("{e:#}"), "serving as a follower failed");
            }
        });
        Ok(Some(StandingBy {
            answering: Answering::Following(stop),
            serving,
        }))
    }

    /// Answers as a standby until [`StandingBy::end`] (while this replica waits for the lease,
    /// and while it loads its state once it has it). It needs the server's certificates: given
    /// ones, or development ones made already (by whichever replica led first, under the
    /// lease, so that replicas sharing a certificates directory never make two at once).
    pub fn stand_by(&self) -> Result<StandingBy> {
        let cert_paths = existing_certificates(&self.config).context(
            "no certificates yet: development certificates are made by the first replica to lead",
        )?;
        let tls = tls::server_config(&cert_paths, self.config.client_ca.as_deref())?;
        let listener = self.listener()?;
        listener.set_nonblocking(true)?;
        let handle = axum_server::Handle::new();
        let serving = serve_tls(
            listener,
            tls,
            self.config.header_timeout,
            self.connections.clone(),
            handle.clone(),
            api::standby_router(),
        )?;
        let announced = handle.clone();
        let serving = tokio::spawn(async move {
            let announce = async {
                if let Some(addr) = announced.listening().await {
                    // Scripts and tests read this line to learn a standby's port (with
                    // --listen 127.0.0.1:0); it says "listening on" once it leads.
                    crate::say(&format!("hora-server standing by on https://{addr}"));
                }
            };
            let (served, ()) = tokio::join!(serving, announce);
            if let Err(e) = served {
                tracing::warn!(error = %e, "answering as a standby failed");
            }
        });
        Ok(StandingBy {
            answering: Answering::Standby(handle),
            serving,
        })
    }
}

/// A [`Port`] answering while its replica does not lead: as a follower, or as a standby.
pub struct StandingBy {
    answering: Answering,
    serving: tokio::task::JoinHandle<()>,
}

enum Answering {
    Standby(axum_server::Handle<std::net::SocketAddr>),
    /// Stops the follower.
    Following(tokio::sync::oneshot::Sender<()>),
}

impl StandingBy {
    /// Whether it only stands by (it does not serve clients).
    pub fn only_stands_by(&self) -> bool {
        matches!(self.answering, Answering::Standby(_))
    }

    /// Stops answering: its connections are closed at once, a handshake in progress included
    /// (clients reconnect, to the leader this replica has become or to another), a follower's
    /// background work is stopped, and the port is left bound.
    pub async fn end(self) {
        match self.answering {
            Answering::Standby(handle) => handle.shutdown(),
            Answering::Following(stop) => {
                let _ = stop.send(());
            }
        }
        if let Err(e) = self.serving.await {
            tracing::warn!(error = %e, "the answering task of a replica that did not lead failed");
        }
    }
}

/// Serves `app` over TLS on `listener` until `handle` shuts it down, behind the connection
/// guard and with the HTTP limits of every port of the server.
fn serve_tls(
    listener: TcpListener,
    tls: rustls::ServerConfig,
    header_timeout: Duration,
    connections: Arc<conn::Connections>,
    handle: axum_server::Handle<std::net::SocketAddr>,
    app: axum::Router,
) -> Result<impl Future<Output = std::io::Result<()>>> {
    let tls = axum_server::tls_rustls::RustlsAcceptor::new(
        axum_server::tls_rustls::RustlsConfig::from_config(Arc::new(tls)),
    )
    .handshake_timeout(header_timeout)
    .acceptor(conn::GuardAcceptor::new(connections));
    let mut server = axum_server::from_tcp(listener)
        .context("listening")?
        .acceptor(tls)
        .handle(handle.clone());
    // Slow senders of headers are cut off (HTTP/1.1; HTTP/2 headers are frames on a
    // connection the guard already watches).
    server
        .http_builder()
        .http1()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(header_timeout);
    // HTTP/2 buffers up to the flow-control window of body data per stream that nobody
    // reads yet. Uploads wait for room in the upload budget before their body is read, so
    // with many uploaders the windows, not the bodies, decide memory: keep them small (data
    // then waits in kernel socket buffers and on the clients). 128 KiB still fills a
    // loopback or LAN link; raise it for high-latency WAN clients at the cost of that much
    // memory per waiting upload.
    server
        .http_builder()
        .http2()
        .initial_stream_window_size(HTTP2_STREAM_WINDOW)
        .initial_connection_window_size(HTTP2_CONNECTION_WINDOW)
        .max_concurrent_streams(64);
    Ok(server.serve(app.into_make_service()))
}

/// Why [`Server::run`] returned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stopped {
    /// Its shutdown future resolved.
    Shutdown,
    /// It lost its database's lease to another replica (why): it no longer leads.
    Deposed(String),
}

/// The shortest admin token the server accepts from its configuration (a generated one is 64).
const MIN_ADMIN_TOKEN_CHARS: usize = 16;

/// The hash of the admin token: the configured token's, else the stored one, else a new token's
/// (returned, to be shown once).
fn admin_token(store: &Store, config: &ServeConfig) -> Result<(String, Option<String>)> {
    if let Some(token) = &config.admin_token {
        if token.chars().count() < MIN_ADMIN_TOKEN_CHARS {
            anyhow::bail!(
                "the admin token is {} characters long; use at least {MIN_ADMIN_TOKEN_CHARS} (for example `openssl rand -hex 32`), or give none and the server makes one",
                token.chars().count()
            );
        }
        // Kept when it is this token's already (salted once); else salted and stored.
        if let Some(stored) = store
            .meta("admin_token_hash")?
            .filter(|s| s.starts_with("pbkdf2-") && auth::verify_admin_token(token, s))
        {
            return Ok((stored, None));
        }
        let hash = auth::hash_admin_token(token).map_err(|e| anyhow::anyhow!("{e}"))?;
        store.put_meta("admin_token_hash", &hash)?;
        return Ok((hash, None));
    }
    if let Some(hash) = store.meta("admin_token_hash")? {
        return Ok((hash, None));
    }
    let token = auth::new_secret().map_err(|e| anyhow::anyhow!("{e}"))?;
    let hash = auth::hash_admin_token(&token).map_err(|e| anyhow::anyhow!("{e}"))?;
    store.put_meta("admin_token_hash", &hash)?;
    store.flush()?;
    Ok((hash, Some(token)))
}

/// The server's certificate and key as they are now: the given ones, or development ones made
/// already; None if those are still to be made.
fn existing_certificates(config: &ServeConfig) -> Option<tls::CertPaths> {
    match (&config.tls_cert, &config.tls_key) {
        (Some(cert), Some(key)) => Some(tls::CertPaths {
            cert: cert.clone(),
            key: key.clone(),
        }),
        _ => {
            let dir = dev_certs_dir(config);
            let paths = tls::CertPaths {
                cert: dir.join(tls::SERVER_CERT),
                key: dir.join(tls::SERVER_KEY),
            };
            (paths.cert.exists() && paths.key.exists()).then_some(paths)
        }
    }
}

/// Where development certificates are kept.
fn dev_certs_dir(config: &ServeConfig) -> PathBuf {
    config
        .certs_dir
        .clone()
        .unwrap_or_else(|| config.data_dir.join("certs"))
}

/// The server's certificate and key, made under the certificates directory when none are given
/// (with the development CA that clients must trust).
fn certificates(config: &ServeConfig) -> Result<(tls::CertPaths, Option<PathBuf>)> {
    if config.tls_cert.is_some() != config.tls_key.is_some() {
        anyhow::bail!(
            "give both --tls-cert and --tls-key, or neither (for development certificates)"
        );
    }
    let dev_ca = config
        .tls_cert
        .is_none()
        .then(|| dev_certs_dir(config).join(tls::CA_CERT));
    let paths = match existing_certificates(config) {
        Some(paths) => paths,
        None => tls::make_dev_certs(&dev_certs_dir(config), &config.hosts)?,
    };
    Ok((paths, dev_ca))
}
