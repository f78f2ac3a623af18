//! Joining a sync job at the Hora server: the collective stack's [`Rendezvous`] over this
//! client's HTTPS transport (its TLS configuration, client certificate and retries).

use std::path::Path;
use std::time::Duration;

use hora_collective::{CollectiveError, Rendezvous};
use hora_common::tls::Identity;
use hora_common::wire::{ErrorCode, SyncJoinRequest, SyncStatus, SyncWorld, CLIENT_API};
use reqwest::{Method, RequestBuilder};
use tokio::runtime::Runtime;

use crate::error::ClientError;
use crate::transport::{check, Connection, RetryPolicy};

/// Where and how to join at the server.
#[derive(Clone)]
pub struct ServerRendezvous<'a> {
    pub server: &'a str,
    pub ca: &'a Path,
    pub identity: Option<&'a Identity>,
    pub job: &'a str,
    /// The job's token (printed when the job was created).
    pub token: &'a str,
    /// How long to wait for the other workers.
    pub timeout: Duration,
    /// How long to keep retrying while the server cannot be reached.
    pub retry_for: Duration,
}

impl std::fmt::Debug for ServerRendezvous<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerRendezvous")
            .field("server", &hora_common::config::mask_password(self.server))
            .field("ca", &self.ca)
            .field("identity", &self.identity)
            .field("job", &self.job)
            .field("token", &hora_common::wire::Redacted)
            .field("timeout", &self.timeout)
            .field("retry_for", &self.retry_for)
            .finish()
    }
}

impl ServerRendezvous<'_> {
    /// A fresh connection (with this rendezvous's TLS settings, retrying for `retry_for`) and
    /// a runtime of its own to call the server on, since the collective stack's callers are
    /// synchronous.
    fn connect(&self, retry_for: Duration) -> Result<(Connection, Runtime), ClientError> {
        let retry = RetryPolicy {
            budget: retry_for,
            ..Default::default()
        };
        let conn = Connection::new(self.server, self.ca, self.identity, retry)?
            .with_token(self.token.to_string());
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| ClientError::Protocol(format!("starting the rendezvous runtime: {e}")))?;
        Ok((conn, runtime))
    }

    /// `method` on the job's `path`, with `body` as JSON.
    fn request(
        &self,
        conn: &Connection,
        method: &Method,
        path: &str,
        body: Option<&SyncJoinRequest>,
        timeout: Duration,
    ) -> RequestBuilder {
        let path = format!("{CLIENT_API}/sync/{}/{path}", self.job);
        let request = conn.request(method.clone(), &path, timeout);
        match body {
            Some(body) => request.json(body),
            None => request,
        }
    }

    /// One call whose answer is JSON.
    fn call<T: serde::de::DeserializeOwned>(
        &self,
        what: &str,
        method: Method,
        path: &str,
        body: Option<&SyncJoinRequest>,
        retry_for: Duration,
        timeout: Duration,
    ) -> Result<T, ClientError> {
        let (conn, runtime) = self.connect(retry_for)?;
        runtime.block_on(conn.json(what, || self.request(&conn, &method, path, body, timeout)))
    }
}

impl Rendezvous for ServerRendezvous<'_> {
    fn send(&self, request: &SyncJoinRequest) -> hora_collective::Result<SyncWorld> {
        // The server holds a join up to its `timeout_s`; the request waits a little longer.
        let held = Duration::from_secs(request.timeout_s.map_or(600, u64::from) + 5);
        self.call(
            "joining the sync job",
            Method::POST,
            "join",
            Some(request),
            self.retry_for,
            held.max(self.timeout),
        )
        .map_err(|e| match e.code() {
            Some(ErrorCode::JobFinished) => CollectiveError::JobFinished(e.to_string()),
            _ => CollectiveError::Rendezvous(e.to_string()),
        })
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }

    fn status(&self) -> Result<SyncStatus, String> {
        // A running world waits for this answer at its commit: one try, well within the ring's
        // timeout; a failure is "nobody waits".
        let limit = (self.timeout / 3).min(Duration::from_secs(5));
        self.call(
            "asking for the sync job's status",
            Method::GET,
            "status",
            None,
            Duration::ZERO,
            limit,
        )
        .map_err(|e| e.to_string())
    }

    fn finish(&self) -> Result<(), String> {
        let what = "saying the sync job finished";
        let timeout = self.timeout.min(Duration::from_secs(10));
        let finished = self
            .connect(self.retry_for.min(Duration::from_secs(30)))
            .and_then(|(conn, runtime)| {
                runtime.block_on(async {
                    let (resp, _) = conn
                        .send(what, || {
                            self.request(&conn, &Method::POST, "finish", None, timeout)
                        })
                        .await?;
                    // (204: no body.)
                    check(resp).await.map(|_| ())
                })
            });
        finished.map_err(|e| e.to_string())
    }
}
