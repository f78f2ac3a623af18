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
