//! Graceful shutdown: on SIGINT or SIGTERM stop accepting connections and give requests in
//! flight a few seconds to finish. Uploads not yet acknowledged are simply retried by clients;
//! acknowledged ones are already durable.

use std::time::Duration;

pub async fn on_signal(handle: axum_server::Handle<std::net::SocketAddr>) {
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
    tracing::info!("shutting down: finishing requests in flight");
    handle.graceful_shutdown(Some(Duration::from_secs(10)));
}
