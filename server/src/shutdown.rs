//! The shutdown signal of `hora-server serve`: SIGINT or SIGTERM. [`crate::Server::run`] then
//! stops accepting connections and gives requests in flight a few seconds to finish. Uploads not
//! yet acknowledged are simply retried by clients; acknowledged ones are already durable.

/// Resolves at the first SIGINT or SIGTERM.
pub async fn signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! { _ = ctrl_c => {}, _ = term => {} }
}

/// A stop request every part of `serve` can see: set at the first SIGINT or SIGTERM, it ends a
/// standby's wait for the lease as well as a server that runs.
#[derive(Clone)]
pub struct Stop(tokio::sync::watch::Receiver<bool>);

impl Stop {
    /// Starts listening for the signals (on the current runtime).
    pub fn on_signal() -> Stop {
        let (tx, rx) = tokio::sync::watch::channel(false);
        tokio::spawn(async move {
            signal().await;
            let _ = tx.send(true);
            // Held until the process ends, so the receivers never see the sender gone.
            std::future::pending::<()>().await;
        });
        Stop(rx)
    }

    /// Whether a stop was asked for.
    pub fn requested(&self) -> bool {
        *self.0.borrow()
    }

    /// Resolves once a stop is asked for.
    pub async fn wait(mut self) {
        let _ = self.0.wait_for(|stop| *stop).await;
    }
}
