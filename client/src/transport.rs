//! HTTPS to the server: reqwest over hora-common's rustls configuration, with the retry rule the
//! whole client follows. Connection failures, timeouts, 5xx and 429 are transient and retried with
//! exponential backoff and full jitter (so a fleet that lost its server does not come back as one
//! wave) until the retry budget is spent; every other answer is final, and a 4xx becomes a typed
//! [`ClientError`] carrying the server's [`ApiError`].

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hora_common::config::mask_password;
use hora_common::tls::{client_config, Identity};
use hora_common::wire::{ApiError, ErrorCode};
use rand::Rng;
use reqwest::{Method, RequestBuilder, Response, StatusCode};

use crate::error::{ClientError, Result};

/// How transient failures are retried.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetryPolicy {
    /// The first backoff; each further one doubles, up to `max_delay`.
    pub initial_delay: Duration,
    pub max_delay: Duration,
    /// Give up once this much time has passed since the first attempt.
    pub budget: Duration,
    /// Timeout of one request (long polls add their own wait to it).
    pub request_timeout: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            initial_delay: Duration::from_millis(200),
            max_delay: Duration::from_secs(15),
            budget: Duration::from_secs(600),
            request_timeout: Duration::from_secs(120),
        }
    }
}

impl RetryPolicy {
    /// The wait before retry number `attempt` (1-based): uniform in [0, min(max, initial·2^(n−1))].
    pub fn backoff(&self, attempt: u32) -> Duration {
        let cap = self
            .initial_delay
            .saturating_mul(1u32 << attempt.saturating_sub(1).min(20))
            .min(self.max_delay);
        cap.mul_f64(rand::rng().random::<f64>())
    }

    /// The wait before retry number `attempt` after a refusal that said when to come back
    /// (`Retry-After`): never sooner than the server asked, spread over half as long again so
    /// that a fleet told the same moment does not come back as one; the backoff where it is
    /// longer.
    pub fn after_refusal(&self, attempt: u32, retry_after: Option<Duration>) -> Duration {
        let backoff = self.backoff(attempt);
        match retry_after {
            Some(asked) => backoff.max(asked + (asked / 2).mul_f64(rand::rng().random::<f64>())),
            None => backoff,
        }
    }
}

/// The longest `Retry-After` the client honours: a server asking for longer (misconfigured, or
/// not ours) is retried after this; the retry budget bounds the whole anyway.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(300);

/// A refusal's `Retry-After` in seconds (the form Hora's server sends; an HTTP date is ignored
/// and the backoff applies), capped at [`MAX_RETRY_AFTER`].
fn retry_after(headers: &reqwest::header::HeaderMap) -> Option<Duration> {
    let seconds: u64 = headers
        .get(reqwest::header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()?;
    Some(Duration::from_secs(seconds).min(MAX_RETRY_AFTER))
}

/// An authenticated connection to a server, given as one URL or several (servers sharing one
/// deployment's state, or a standby): requests go to one of them, and to the next when it
/// cannot be reached or says it is shutting down.
#[derive(Clone)]
pub struct Connection {
    http: reqwest::Client,
    bases: Arc<[String]>,
    /// Which of `bases` requests go to now; shared by the connection's clones.
    current: Arc<AtomicUsize>,
    token: Option<String>,
    retry: RetryPolicy,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let bases: Vec<String> = self.bases.iter().map(|b| mask_password(b)).collect();
        f.debug_struct("Connection")
            .field("bases", &bases)
            .field("current", &self.current)
            .field("token", &hora_common::wire::redacted(&self.token))
            .field("retry", &self.retry)
            .finish_non_exhaustive()
    }
}

/// Whether an answer is worth another attempt.
fn transient(status: StatusCode) -> bool {
    status.is_server_error() || status == StatusCode::TOO_MANY_REQUESTS
}

/// Whether a failure to get an answer is worth another attempt: a refused or dropped
/// connection or a timeout is; a certificate the CA does not vouch for is not (retrying cannot
/// fix it, and hanging for the whole retry budget would hide the cause).
fn transient_error(e: &reqwest::Error) -> bool {
    // The causes only: the request's URL (a host or task name) must not decide.
    let mut causes = String::new();
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        causes.push_str(&cause.to_string());
        causes.push_str(": ");
        source = cause.source();
    }
    !tls_refusal(&causes) && (e.is_connect() || e.is_timeout() || e.is_request() || e.is_body())
}

/// Whether a failure's error chain is a TLS refusal that retrying cannot fix: a certificate
/// the CA does not vouch for, a client certificate the server requires, a handshake the two
/// sides cannot agree on. A handshake cut short (the server went away in the middle of it: end
/// of file, reset) is not: the server is restarting, and the next attempt may reach it.
fn tls_refusal(chain: &str) -> bool {
    let certificate = ["certificate", "Certificate", "UnknownIssuer"]
        .iter()
        .any(|needle| chain.contains(needle));
    let lower = chain.to_ascii_lowercase();
    let cut_short = ["eof", "reset", "broken pipe", "aborted"]
        .iter()
        .any(|needle| lower.contains(needle));
    certificate || (lower.contains("handshake") && !cut_short)
}

impl Connection {
    /// A connection to `server` (an `https://host:port` URL) trusting `ca`.
    pub fn new(
        server: &str,
        ca: &Path,
        identity: Option<&Identity>,
        retry: RetryPolicy,
    ) -> Result<Self> {
        let bases: Vec<String> = server
            .split(',')
            .map(|url| url.trim().trim_end_matches('/').to_string())
            .filter(|url| !url.is_empty())
            .collect();
        if bases.is_empty() {
            return Err(ClientError::Protocol(
                "no server URL given: pass --server https://host:port (several, comma-separated, fail over in turn)".into(),
            ));
        }
        if let Some(plain) = bases.iter().find(|url| !url.starts_with("https://")) {
            return Err(ClientError::Protocol(format!(
                "server URL `{plain}` must start with https:// (Hora always uses TLS)"
            )));
        }
        let http = reqwest::Client::builder()
            .use_preconfigured_tls(client_config(ca, identity)?)
            .connect_timeout(Duration::from_secs(10))
            .build()
            .map_err(|e| ClientError::Protocol(format!("building the HTTPS client: {e}")))?;
        Ok(Connection {
            http,
            bases: bases.into(),
            current: Arc::default(),
            token: None,
            retry,
        })
    }

    pub fn with_token(mut self, token: String) -> Self {
        self.token = Some(token);
        self
    }

    /// The URL requests go to now.
    pub fn base_url(&self) -> &str {
        &self.bases[self.current.load(Ordering::Relaxed) % self.bases.len()]
    }

    /// After a request to `bases[used]` found no server that serves (`why` not): the next URL,
    /// unless another request moved on already.
    fn fail_over(&self, used: usize, why: &str) {
        if self.bases.len() > 1 {
            let next = (used + 1) % self.bases.len();
            if self
                .current
                .compare_exchange(used, next, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
            {
                tracing::warn!(
                    "{} {why}; trying {}",
                    mask_password(&self.bases[used]),
                    mask_password(&self.bases[next])
                );
            }
        }
    }

    pub fn retry_policy(&self) -> &RetryPolicy {
        &self.retry
    }

    /// A request builder for `path` with credentials and the per-request timeout.
    pub fn request(&self, method: Method, path: &str, extra_wait: Duration) -> RequestBuilder {
        let req = self
            .http
            .request(method, format!("{}{path}", self.base_url()))
            .timeout(self.retry.request_timeout + extra_wait);
        match &self.token {
            Some(t) => req.bearer_auth(t),
            None => req,
        }
    }

    /// Sends what `make` builds until the answer is final: success or a non-transient status.
    /// Every request of the client may be sent twice without harm (reads, joins and uploads:
    /// the server refuses a duplicate; enrolment: a repeat with the same secret gets the same
    /// credentials). Returns the final answer and the number of attempts it took.
    pub async fn send(
        &self,
        what: &str,
        make: impl Fn() -> RequestBuilder,
    ) -> Result<(Response, u32)> {
        let start = Instant::now();
        let mut attempt = 0u32;
        // The server's last refusal, if any attempt got an answer at all: then it is up, and
        // failing, whatever became of the other attempts' connections.
        let mut answered = None;
        loop {
            attempt += 1;
            let mut asked = None;
            let used = self.current.load(Ordering::Relaxed) % self.bases.len();
            let last = match make().send().await {
                Ok(resp) if !transient(resp.status()) => return Ok((resp, attempt)),
                Ok(resp) => {
                    let status = resp.status();
                    asked = retry_after(resp.headers());
                    let body = resp.text().await.unwrap_or_default();
                    let error =
                        serde_json::from_str::<ApiError>(&body).unwrap_or_else(|_| ApiError {
                            code: ErrorCode::Other("unknown".into()),
                            message: body.chars().take(200).collect(),
                        });
                    let last = format!("{status}: {} ({})", error.message, error.code);
                    match error.code {
                        ErrorCode::ShuttingDown => self.fail_over(used, "is shutting down"),
                        ErrorCode::Standby => {
                            self.fail_over(used, "stands by (another replica leads)")
                        }
                        _ => {}
                    }
                    answered = Some((status.as_u16(), error));
                    last
                }
                Err(e) => {
                    let chain = error_chain(&e);
                    if !transient_error(&e) {
                        let hint = if chain.contains("CertificateRequired") {
                            "the server requires a client certificate (mutual TLS): give one \
                             signed by its --client-ca with --cert and --key (cert= and key= \
                             in Python; HORA_CLIENT_CERT and HORA_CLIENT_KEY)"
                        } else {
                            "check --server, --ca and the network"
                        };
                        return Err(ClientError::Protocol(format!(
                            "{what}: {chain} (not retried: {hint})"
                        )));
                    }
                    if e.is_connect() {
                        self.fail_over(used, "does not answer");
                    }
                    chain
                }
            };
            let delay = self.retry.after_refusal(attempt, asked);
            if start.elapsed() + delay > self.retry.budget {
                let (url, attempts, secs) =
                    (self.bases.join(","), attempt, start.elapsed().as_secs());
                return Err(match answered {
                    Some((status, error)) => ClientError::Failing {
                        url,
                        what: what.to_string(),
                        attempts,
                        secs,
                        status,
                        error,
                    },
                    None => ClientError::Unavailable {
                        url,
                        attempts,
                        secs,
                        last,
                    },
                });
            }
            tracing::warn!(
                "{what}: {last}; retrying in {:.1} s (attempt {attempt})",
                delay.as_secs_f64()
            );
            tokio::time::sleep(delay).await;
        }
    }

    /// [`Connection::send`], then a 2xx body decoded as JSON (anything else becomes an error).
    pub async fn json<T: serde::de::DeserializeOwned>(
        &self,
        what: &str,
        make: impl Fn() -> RequestBuilder,
    ) -> Result<T> {
        let (resp, _) = self.send(what, make).await?;
        let resp = check(resp).await?;
        let bytes = resp
            .bytes()
            .await
            .map_err(|e| ClientError::Protocol(format!("{what}: reading the answer: {e}")))?;
        serde_json::from_slice(&bytes)
            .map_err(|e| ClientError::Protocol(format!("{what}: decoding the answer: {e}")))
    }
}

/// A 2xx/3xx answer passes; a 4xx becomes the matching [`ClientError`].
pub async fn check(resp: Response) -> Result<Response> {
    let status = resp.status();
    if status.is_success() || status.is_redirection() {
        return Ok(resp);
    }
    let text = resp.text().await.unwrap_or_default();
    let error = serde_json::from_str::<ApiError>(&text).unwrap_or_else(|_| ApiError {
        // Not an `ApiError` body (a proxy's page, a truncated answer): no code to go by.
        code: ErrorCode::Other("unknown".into()),
        message: if text.is_empty() {
            status.to_string()
        } else {
            text.chars().take(500).collect()
        },
    });
    Err(match status {
        StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => ClientError::Unauthorized {
            status: status.as_u16(),
            error,
        },
        StatusCode::NOT_FOUND => ClientError::NotFound { error },
        StatusCode::CONFLICT => ClientError::Conflict { error },
        _ => ClientError::Rejected {
            status: status.as_u16(),
            error,
        },
    })
}

/// reqwest's error with its causes ("error sending request: connection refused").
fn error_chain(e: &reqwest::Error) -> String {
    let mut s = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        s.push_str(": ");
        s.push_str(&cause.to_string());
        source = cause.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_handshake_cut_short_is_retried_a_certificate_refusal_is_not() {
        let url = "error sending request for url (https://127.0.0.1:1/v1/enrol)";
        for (cause, refusal) in [
            ("client error (Connect): tls handshake eof", false),
            (
                "client error (Connect): Connection reset by peer (os error 104)",
                false,
            ),
            (
                "client error (Connect): tcp connect error: Connection refused (os error 111)",
                false,
            ),
            (
                "client error (Connect): invalid peer certificate: UnknownIssuer",
                true,
            ),
            (
                "client error (Connect): received fatal alert: CertificateRequired",
                true,
            ),
            (
                "client error (Connect): received fatal alert: HandshakeFailure",
                true,
            ),
        ] {
            assert_eq!(tls_refusal(&format!("{url}: {cause}")), refusal, "{cause}");
        }
    }

    #[test]
    fn backoff_grows_and_is_capped_and_jittered() {
        let p = RetryPolicy {
            initial_delay: Duration::from_millis(100),
            max_delay: Duration::from_secs(1),
            ..Default::default()
        };
        for attempt in 1..40 {
            let cap = Duration::from_millis(100 * (1u64 << (attempt - 1).min(20))).min(p.max_delay);
            let d = p.backoff(attempt);
            assert!(d <= cap, "attempt {attempt}: {d:?} > {cap:?}");
        }
        // Jittered: 50 draws at the cap are not all equal.
        let draws: Vec<_> = (0..50).map(|_| p.backoff(10)).collect();
        assert!(draws.iter().any(|d| *d != draws[0]));
    }

    #[test]
    fn a_refusal_is_retried_no_sooner_than_its_retry_after_says() {
        let p = RetryPolicy::default();
        let headers = |value: &str| {
            let mut h = reqwest::header::HeaderMap::new();
            h.insert(reqwest::header::RETRY_AFTER, value.parse().unwrap());
            h
        };
        assert_eq!(retry_after(&headers("2")), Some(Duration::from_secs(2)));
        assert_eq!(retry_after(&headers(" 7 ")), Some(Duration::from_secs(7)));
        assert_eq!(retry_after(&headers("86400")), Some(MAX_RETRY_AFTER));
        for odd in ["soon", "-1", "1.5", "Wed, 21 Oct 2015 07:28:00 GMT"] {
            assert_eq!(retry_after(&headers(odd)), None, "{odd}");
        }
        assert_eq!(retry_after(&reqwest::header::HeaderMap::new()), None);
        // The first retries' backoffs are well under 2 s; told 2 s, the client waits 2 to 3 s,
        // spread (a fleet told one moment does not come back as one).
        let asked = Some(Duration::from_secs(2));
        let waits: Vec<_> = (0..50).map(|_| p.after_refusal(1, asked)).collect();
        for w in &waits {
            assert!(
                (Duration::from_secs(2)..=Duration::from_secs(3)).contains(w),
                "{w:?}"
            );
        }
        assert!(waits.iter().any(|w| *w != waits[0]));
        assert!(p.after_refusal(1, None) <= p.initial_delay);
    }

    #[test]
    fn only_failures_of_the_server_are_transient() {
        for s in [500, 502, 503, 504, 429] {
            assert!(transient(StatusCode::from_u16(s).unwrap()), "{s}");
        }
        for s in [200, 304, 400, 401, 403, 404, 409, 413] {
            assert!(!transient(StatusCode::from_u16(s).unwrap()), "{s}");
        }
    }

    #[test]
    fn plain_http_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let err = Connection::new(
            "http://127.0.0.1:1",
            &dir.path().join("ca.pem"),
            None,
            RetryPolicy::default(),
        )
        .unwrap_err();
        assert!(err.to_string().contains("https://"), "{err}");
    }
}
