//! hora-server: the Hora aggregation server.
//!
//! It hands out the current global model of each federated task over HTTPS, takes sealed weight
//! deltas from clients, folds each into its round's running weighted sum the moment it arrives
//! (memory O(model), never O(clients × model)), keeps its state in sled with large blobs in
//! content-addressed files, and is driven by operators through a REST admin API.
//!
//! Reading order, following a request:
//! - [`serve`] wires everything together: [`store`] (sled + blob files), [`coordinator`] (tasks,
//!   rounds, group commit), [`api`] (axum routes: client `/v1`, admin `/admin/v1`, ops), [`tls`]
//!   (rustls with ring; development certificates), [`shutdown`] on SIGINT/SIGTERM.
//! - An upload: [`api::client`] authenticates ([`auth`]) and size-checks it, the coordinator opens
//!   the envelope, validates and folds it (hora-common), and acknowledges it once a checkpoint
//!   holding it is durable; [`strategy`] turns the round's sum into the next global model
//!   (FedAvg, FedAvgM, FedAdam, FedYogi, FedAdagrad; the stateful ones persist their state with
//!   the task, published in the same record as the model).
//! - [`dp`]: central differential privacy for tasks that ask for it — clipping at upload, noise
//!   once per round at close, and a Rényi-DP accountant of the ε spent.
//! - A sync job's workers: [`rendezvous`] holds each join until the job's world is complete, then
//!   tells every worker its rank and its peers; the allreduce itself never touches the server.
//! - [`conn`] guards connections (idle and half-open ones are closed, a cap with eviction of the
//!   idlest, the open-file limit raised); [`api::body`] reads bodies at a minimum rate under a
//!   byte budget, so a hostile client holds no slot anyone else needs.
//! - [`config`] merges flags, environment and a TOML file; [`admin_cli`] is `hora-server admin`.
//!
//! The server never links libtorch: all its arithmetic is hora-common's CPU kernel.

pub mod admin_cli;
pub mod api;
pub mod auth;
pub mod config;
pub mod conn;
pub mod coordinator;
pub mod dp;
pub mod error;
pub mod metrics;
pub mod rendezvous;
pub mod secagg;
pub mod shutdown;
pub mod store;
pub mod strategy;
pub mod tls;

use std::sync::Arc;

use anyhow::{Context, Result};

use crate::config::ServeConfig;
use crate::coordinator::{Coordinator, CoordinatorConfig};

const HTTP2_STREAM_WINDOW: u32 = 128 << 10;
const HTTP2_CONNECTION_WINDOW: u32 = 256 << 10;

/// Runs the server until SIGINT/SIGTERM.
pub async fn serve(config: ServeConfig) -> Result<()> {
    // Everything the server writes (database, blobs, certificates and keys) is its user's alone.
    #[cfg(unix)]
    // SAFETY: umask only sets the process's file-creation mask; it cannot fail.
    unsafe {
        libc::umask(0o077);
    }
    let fd_limit = conn::raise_fd_limit();
    let store: Arc<store::Store> =
        Arc::new(store::SledStore::open(&config.data_dir).with_context(|| {
            format!("opening the data directory {}", config.data_dir.display())
        })?);
    let swept = store.sweep_orphans().context("sweeping orphaned files")?;
    if swept > 0 {
        tracing::info!(files = swept, "removed orphaned files");
    }

    let admin_token_hash = match &config.admin_token {
        Some(token) => {
            let hash = auth::hash_secret(token);
            store.put_meta("admin_token_hash", &hash)?;
            hash
        }
        None => match store.meta("admin_token_hash")? {
            Some(hash) => hash,
            None => {
                let token = auth::new_secret().map_err(|e| anyhow::anyhow!("{e}"))?;
                let hash = auth::hash_secret(&token);
                store.put_meta("admin_token_hash", &hash)?;
                store.flush()?;
                println!("admin token: {token}");
                println!("  (shown once; only its hash is stored. Pass --admin-token or HORA_ADMIN_TOKEN to set your own.)");
                hash
            }
        },
    };

    let cert_paths = match (&config.tls_cert, &config.tls_key) {
        (Some(cert), Some(key)) => tls::CertPaths {
            cert: cert.clone(),
            key: key.clone(),
        },
        (None, None) => {
            let dir = config
                .certs_dir
                .clone()
                .unwrap_or_else(|| config.data_dir.join("certs"));
            let paths = if dir.join(tls::SERVER_CERT).exists() && dir.join(tls::SERVER_KEY).exists()
            {
                tls::CertPaths {
                    cert: dir.join(tls::SERVER_CERT),
                    key: dir.join(tls::SERVER_KEY),
                }
            } else {
                tls::make_dev_certs(&dir, &config.hosts)?
            };
            println!(
                "development TLS: clients trust {}",
                dir.join(tls::CA_CERT).display()
            );
            paths
        }
        _ => anyhow::bail!(
            "give both --tls-cert and --tls-key, or neither (for development certificates)"
        ),
    };
    let tls_config = tls::server_config(&cert_paths, config.client_ca.as_deref())?;

    let metrics = Arc::new(metrics::ServerMetrics::default());
    let coordinator = Coordinator::open(
        store.clone(),
        CoordinatorConfig {
            commit_window: config.commit_window(),
            durability_timeout: config.durability_timeout,
            retention: config.retention,
            ..Default::default()
        },
        metrics.clone(),
    )
    .map_err(|e| anyhow::anyhow!("loading state: {e}"))?;
    let rendezvous = rendezvous::Rendezvous::open(store.clone(), metrics.clone())
        .context("loading the sync jobs")?;
    coordinator.start();
    let state = api::AppState::new(
        coordinator,
        admin_token_hash,
        api::HttpLimits {
            max_model_bytes: config.max_model_bytes,
            body_rate: api::BodyRate {
                min_bytes_per_sec: config.min_upload_rate,
                grace: config.upload_grace,
            },
            upload_buffer_bytes: config.upload_buffer_bytes,
            request_timeout: config.request_timeout,
            metrics_require_token: config.metrics_require_token,
            max_concurrent_uploads: config.max_concurrent_uploads,
            ..Default::default()
        },
        rendezvous,
    );
    let app = api::router(state);

    let max_connections = config
        .max_connections
        .unwrap_or_else(|| conn::default_max_connections(fd_limit));
    tracing::info!(
        max_connections,
        open_file_limit = fd_limit,
        idle_timeout_secs = config.idle_timeout.as_secs(),
        "connection limits"
    );
    let connections = conn::Connections::new(
        conn::ConnectionLimits {
            max_connections,
            idle_timeout: config.idle_timeout,
        },
        metrics,
    );

    let handle = axum_server::Handle::new();
    tokio::spawn(shutdown::on_signal(handle.clone()));
    let tls = axum_server::tls_rustls::RustlsAcceptor::new(
        axum_server::tls_rustls::RustlsConfig::from_config(Arc::new(tls_config)),
    )
    .handshake_timeout(config.header_timeout)
    .acceptor(conn::GuardAcceptor::new(connections));
    let mut server = axum_server::bind(config.listen)
        .acceptor(tls)
        .handle(handle.clone());
    // Slow senders of headers are cut off (HTTP/1.1; HTTP/2 headers are frames on a
    // connection the guard already watches).
    server
        .http_builder()
        .http1()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(config.header_timeout);
    // HTTP/2 buffers up to the flow-control window of body data per stream that nobody reads
    // yet. Uploads wait for room in the upload budget before their body is read, so with many uploaders
    // the windows, not the bodies, decide memory: keep them small (data then waits in kernel
    // socket buffers and on the clients). 128 KiB still fills a loopback or LAN link; raise it
    // for high-latency WAN clients at the cost of that much memory per waiting upload.
    server
        .http_builder()
        .http2()
        .initial_stream_window_size(HTTP2_STREAM_WINDOW)
        .initial_connection_window_size(HTTP2_CONNECTION_WINDOW)
        .max_concurrent_streams(64);
    let server = server.serve(app.into_make_service());
    let announce = async {
        if let Some(addr) = handle.listening().await {
            // Tests and scripts read this line to learn the port (with --listen 127.0.0.1:0).
            println!("hora-server listening on https://{addr}");
        }
    };
    let (result, ()) = tokio::join!(server, announce);
    result.context("serving")?;
    store.flush()?;
    tracing::info!("stopped");
    Ok(())
}
