//! hora-server: the Hora aggregation server.
//!
//! It hands out the current global model of each federated task over HTTPS, takes sealed weight
//! deltas from clients, folds each into its round's running weighted sum the moment it arrives
//! (memory O(model), never O(clients × model)), keeps its records in sled (or PostgreSQL) with
//! large blobs in files that prove their contents, and is driven by operators through a REST admin API.
//!
//! Reading order, following a request:
//! - [`Server`] wires everything together ([`Server::build`] from a config, [`Server::run`] on a
//!   listener until a shutdown future resolves; [`serve`] is both, stopped by SIGINT/SIGTERM):
//!   [`store`] (sled or PostgreSQL, and blob files), [`round`] (the round engine: tasks, round phases, the plain
//!   and secure-aggregation collections, group commit, closing, deadlines), [`api`] (axum routes:
//!   client `/v1`, admin `/admin/v1`, ops), [`tls`] (rustls with ring; development certificates),
//!   [`shutdown`].
//! - An upload: [`api::client`] authenticates ([`auth`]) and size-checks it, [`round::plain`]
//!   opens the envelope, validates and folds it (hora-common), and acknowledges it once a
//!   checkpoint holding it is durable; [`strategy`] turns the round's sum into the next global model
//!   (FedAvg, FedAvgM, FedAdam, FedYogi, FedAdagrad; the stateful ones persist their state with
//!   the task, published in the same record as the model).
//! - [`dp`]: central differential privacy for tasks that ask for it — clipping at upload, noise
//!   once per round at close, and a Rényi-DP accountant of the ε spent.
//! - A sync job's workers: [`rendezvous`] holds each join until the job's world is complete, then
//!   tells every worker its rank and its peers; the allreduce itself never touches the server.
//! - [`conn`] guards connections (idle and half-open ones are closed, a cap with eviction of the
//!   idlest, the open-file limit raised); [`api::body`] reads bodies at a minimum rate under a
//!   byte budget, so a hostile client holds no slot anyone else needs.
//! - [`simulation`]: a simulated federation (`hora-server simulate`) — this round engine over
//!   an in-process store, virtual clients trained on worker processes, a simulated clock.
//! - [`config`] merges flags, environment and a TOML file; [`admin_cli`] is `hora-server admin`.
//!
//! The server never links libtorch: all its arithmetic is hora-common's CPU kernel.

pub mod admin_cli;
pub mod api;
pub mod auth;
pub mod config;
pub mod conn;
pub mod dashboard;
pub mod dp;
pub mod error;
pub mod metrics;
pub mod rendezvous;
pub mod round;
pub mod secagg;
pub mod server;
pub mod shutdown;
pub mod simulation;
pub mod store;
pub mod strategy;
pub mod tls;
pub mod upstream;

use std::sync::Arc;

use anyhow::Result;

pub use crate::server::{Server, Stopped};

/// Runs `work` on one of the runtime's blocking threads and waits for it: store writes and
/// flushes, file I/O, hashing, and anything that takes a lock some other thread holds across
/// I/O. The runtime's workers never wait on a disk, so `/healthz`, long polls and the other
/// tasks answer while a large model is written.
pub(crate) async fn blocking<T, F>(work: F) -> Result<T, error::ServerError>
where
    F: FnOnce() -> Result<T, error::ServerError> + Send + 'static,
    T: Send + 'static,
{
    tokio::task::spawn_blocking(work)
        .await
        .map_err(error::ServerError::internal)?
}

/// Runs the server until SIGINT/SIGTERM: [`Server::build`], bind `--listen`, [`Server::run`].
/// With a PostgreSQL store the build first waits, standing by, for the database's lease (its
/// port bound already and answering as a standby: see [`server::Port`]); a replica that loses
/// the lease steps down and stands by again.
pub async fn serve(config: config::ServeConfig) -> Result<()> {
    // Everything the server writes (database, blobs, certificates and keys) is its user's alone.
    #[cfg(unix)]
    // SAFETY: umask only sets the process's file-creation mask; it cannot fail.
    unsafe {
        libc::umask(0o077);
    }
    let stop = shutdown::Stop::on_signal();
    let mut led = false;
    // A replica's port answers while it stands by (an embedded store has no standby).
    let port = match config.store {
        store::StoreLocation::Postgres(_) => server::Port::bind(&config)?,
        store::StoreLocation::Sled => None,
    };
    // What `status` shows of this replica: the address bound (with `--listen …:0`, the port
    // the system chose), else the one asked for.
    let listen = port
        .as_ref()
        .and_then(|port| port.local_addr().ok())
        .unwrap_or(config.listen);
    let replica = store::postgres::Replica::this(&listen.to_string());
    let port = port.map(Arc::new);
    let mut standing_by: Option<server::StandingBy> = None;
    // Leads in a row that found the address taken.
    let mut taken = 0;
    loop {
        let mut building = {
            let (config, stop, replica) = (config.clone(), stop.clone(), replica.clone());
            tokio::task::spawn_blocking(move || {
                Server::build_as(config, replica, &|| stop.requested())
            })
        };
        // Meanwhile the port serves clients as a follower, or else answers as a standby (and
        // tries again every few seconds to follow: a deployment's first replica to lead ties
        // the blobs and makes the admin token a follower needs). A port that cannot answer is
        // no reason not to lead.
        let built = loop {
            if let Some(port) = &port {
                let (port, id) = (port.clone(), replica.id.clone());
                match standing_by.take() {
                    None => {
                        standing_by = tokio::task::spawn_blocking(move || port.follow(&id))
                            .await?
                            .inspect_err(|e| {
                                tracing::info!(
                                    error = format!("{e:#}"),
                                    "not answering while another replica leads"
                                )
                            })
                            .ok();
                    }
                    Some(standby) if standby.only_stands_by() => {
                        match tokio::task::spawn_blocking(move || port.follower(&id)).await? {
                            Ok(Some(following)) => {
                                standby.end().await;
                                standing_by = Some(following);
                            }
                            _ => standing_by = Some(standby),
                        }
                    }
                    following => standing_by = following,
                }
            }
            let retry = standing_by
                .as_ref()
                .is_some_and(server::StandingBy::only_stands_by);
            // (Its next heartbeat says so, for `hora-server status`.)
            replica.following.store(
                standing_by.is_some() && !retry,
                std::sync::atomic::Ordering::Relaxed,
            );
            tokio::select! {
                built = &mut building => break built,
                () = tokio::time::sleep(std::time::Duration::from_secs(3)), if retry => {}
            }
        };
        let server = match built? {
            Ok(server) => {
                // (It leads: its heartbeats say it does not follow.)
                replica
                    .following
                    .store(false, std::sync::atomic::Ordering::Relaxed);
                server
            }
            Err(e) if matches!(e.downcast_ref(), Some(store::StoreError::Stopped)) => {
                tracing::info!("stopped while standing by");
                return Ok(());
            }
            // A replica that stepped down usually did because its database was in trouble:
            // trouble that lasts a while is no reason for it to exit.
            Err(e)
                if led
                    && matches!(
                        e.downcast_ref(),
                        Some(
                            store::StoreError::Unavailable { .. }
                                | store::StoreError::Fenced { .. }
                                | store::StoreError::Blobs { .. }
                        )
                    ) =>
            {
                tracing::warn!(
                    error = format!("{e:#}"),
                    "standing by again failed; trying again in a second"
                );
                tokio::select! {
                    () = tokio::time::sleep(std::time::Duration::from_secs(1)) => continue,
                    () = stop.clone().wait() => return Ok(()),
                }
            }
            Err(e) => return Err(e),
        };
        if let Some(standing_by) = standing_by.take() {
            standing_by.end().await;
        }
        led = true;
        if let Some(token) = &server.generated_admin_token {
            say(&format!("admin token: {token}\n  (shown once; only its hash is stored. Pass --admin-token or HORA_ADMIN_TOKEN to set your own.)"));
        }
        if let Some(ca) = &server.dev_ca {
            say(&format!("development TLS: clients trust {}", ca.display()));
        }
        let listener = match port
            .as_ref()
            .map_or_else(|| server.bind(), |port| port.listener())
        {
            Ok(listener) => listener,
            // Another replica on this address answers there as a standby (both started at
            // once, and it bound the address first): it should lead, so this one hands the
            // lease back and stands by. A few times at most: then the address is taken by
            // something else.
            Err(e)
                if port.is_none()
                    && matches!(config.store, store::StoreLocation::Postgres(_))
                    && taken < 10
                    && e.downcast_ref::<std::io::Error>()
                        .is_some_and(|e| e.kind() == std::io::ErrorKind::AddrInUse) =>
            {
                taken += 1;
                tracing::warn!(error = format!("{e:#}"), "this replica leads but its address is taken (by a standby replica on the same address?): handing the lease back");
                server.hand_back().await;
                tokio::select! {
                    () = tokio::time::sleep(std::time::Duration::from_secs(1)) => continue,
                    () = stop.clone().wait() => return Ok(()),
                }
            }
            Err(e) => {
                server.hand_back().await;
                return Err(e);
            }
        };
        taken = 0;
        match server.run(listener, stop.clone().wait()).await? {
            server::Stopped::Shutdown => return Ok(()),
            server::Stopped::Deposed(why) => {
                tracing::warn!(
                    why,
                    "stepped down (this replica no longer leads); standing by to lead again"
                );
            }
        }
    }
}

/// Prints a line on standard output for the operator (and the scripts that read it); a closed
/// or full standard output is no reason for a server to stop.
pub(crate) fn say(line: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stdout().lock(), "{line}");
}
