//! Joining a sync job at the Hora server: the collective stack's [`Rendezvous`] over this
//! client's HTTPS transport (its TLS configuration, client certificate and retries).

use std::path::Path;
use std::time::Duration;

use hora_collective::{CollectiveError, Rendezvous};
use hora_common::tls::Identity;
use hora_common::wire::{ErrorCode, SyncJoinRequest, SyncStatus, SyncWorld, CLIENT_API};
use reqwest::Method;

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
    /// One call to the server: a fresh connection (with this rendezvous's TLS settings and
    /// retries) on a runtime of its own, since the collective stack's callers are synchronous.
    /// The body of its successful answer.
    fn call(
        &self,
        what: &str,
        method: Method,
        path: &str,
        body: Option<&SyncJoinRequest>,
        retry_for: Duration,
        timeout: Duration,
    ) -> Result<Vec<u8>, ClientError> {
        let retry = RetryPolicy {
            budget: retry_for,
            ..Default::default()
        };
        let conn = Connection::new(self.server, self.ca, self.identity, retry)?
            .with_token(self.token.to_string());
        let path = format!("{CLIENT_API}/sync/{}/{path}", self.job);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| ClientError::Protocol(format!("starting the rendezvous runtime: {e}")))?;
        runtime.block_on(async {
            let (resp, _) = conn
                .send(what, || {
                    let request = conn.request(method.clone(), &path, timeout);
                    match body {
                        Some(body) => request.json(body),
                        None => request,
                    }
                })
                .await?;
            let bytes =
                check(resp).await?.bytes().await.map_err(|e| {
                    ClientError::Protocol(format!("{what}: reading the answer: {e}"))
                })?;
            Ok(bytes.to_vec())
        })
    }
}

/// A JSON answer of [`ServerRendezvous::call`].
fn decode<T: serde::de::DeserializeOwned>(what: &str, body: &[u8]) -> Result<T, ClientError> {
    serde_json::from_slice(body)
        .map_err(|e| ClientError::Protocol(format!("{what}: decoding the answer: {e}")))
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
        .and_then(|body| decode("joining the sync job", &body))
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
        .and_then(|body| decode("asking for the sync job's status", &body))
        .map_err(|e| e.to_string())
    }

    fn finish(&self) -> Result<(), String> {
        self.call(
            "saying the sync job finished",
            Method::POST,
            "finish",
            None,
            self.retry_for.min(Duration::from_secs(30)),
            self.timeout.min(Duration::from_secs(10)),
        )
        .map(|_| ())
        .map_err(|e| e.to_string())
    }
}
