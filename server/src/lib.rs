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
//!   holding it is durable; [`strategy`] turns the round's sum into the next global model.
//! - A sync job's workers: [`rendezvous`] holds each join until the job's world is complete, then
//!   tells every worker its rank and its peers; the allreduce itself never touches the server.
//! - [`config`] merges flags, environment and a TOML file; [`admin_cli`] is `hora-server admin`.
//!
//! The server never links libtorch: all its arithmetic is hora-common's CPU kernel.

pub mod admin_cli;
pub mod api;
pub mod auth;
pub mod config;
pub mod coordinator;
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
    let store =
        Arc::new(store::Store::open(&config.data_dir).with_context(|| {
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
            ..Default::default()
        },
        metrics.clone(),
    )
    .map_err(|e| anyhow::anyhow!("loading state: {e}"))?;
    let rendezvous =
        rendezvous::Rendezvous::open(store.clone(), metrics).context("loading the sync jobs")?;
    coordinator.start();
    let state = Arc::new(api::AppState {
        coordinator,
        admin_token_hash,
        limits: api::HttpLimits {
            max_model_bytes: config.max_model_bytes,
            ..Default::default()
        },
        ingest: Arc::new(tokio::sync::Semaphore::new(
            config.max_concurrent_uploads.max(1),
        )),
        rendezvous,
    });
    let app = api::router(state);

    let handle = axum_server::Handle::new();
    tokio::spawn(shutdown::on_signal(handle.clone()));
    let mut server = axum_server::bind_rustls(
        config.listen,
        axum_server::tls_rustls::RustlsConfig::from_config(Arc::new(tls_config)),
    )
    .handle(handle.clone());
    // HTTP/2 buffers up to the flow-control window of body data per stream that nobody reads
    // yet. Uploads wait for an ingest slot before their body is read, so with many uploaders
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
