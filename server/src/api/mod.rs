//! The HTTP surface: the client API (`/v1`, [`client`]), the sync-job workers' rendezvous
//! (`/v1/sync`, [`sync`]), the secure-aggregation stages ([`secagg`]), the admin API (`/admin/v1`, [`admin`]), and the operational routes
//! (`/healthz`, `/metrics`, `/openapi.json`).
//!
//! Every handler returns `Result<_, ServerError>`, so every refusal is a 4xx with an
//! `ApiError` JSON body (`error` gives each refusal its status). Bodies are size-checked from `Content-Length` before they are read, and
//! read into a buffer of exactly that size.

pub mod admin;
pub mod body;
pub mod chunked;
pub mod client;
pub mod doc;
mod error;
pub mod secagg;
mod strict_json;
pub mod sync;

pub use doc::ApiDoc;

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{FromRequest, FromRequestParts, Request, State};
use axum::http::header::{AUTHORIZATION, CONTENT_TYPE};
use axum::http::request::Parts;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use hora_common::wire::{ApiError, ErrorCode};
use serde::de::DeserializeOwned;
use tokio::sync::Semaphore;
use utoipa::OpenApi;

use crate::error::ServerError;
use crate::rendezvous::Rendezvous;
use crate::round::Coordinator;
use crate::store::ClientRecord;
use crate::{auth, conn};

pub use body::{declared_length, read_body, read_upload, spool_body, BodyRate};

/// Limits on what the HTTP layer accepts.
#[derive(Debug, Clone)]
pub struct HttpLimits {
    /// JSON bodies.
    pub max_json_bytes: usize,
    /// Models and TorchScript modules uploaded by the admin.
    pub max_model_bytes: u64,
    /// The slowest body accepted.
    pub body_rate: BodyRate,
    /// Bytes of upload bodies held in memory at once while being read.
    pub upload_buffer_bytes: u64,
    /// The largest share of that budget one upload reserves (bodies larger than it are read one
    /// at a time).
    pub max_upload_share: f64,
    /// Time allowed for a request that is neither a long poll nor a body upload.
    pub request_timeout: Duration,
    /// Whether `GET /metrics` needs the admin token.
    pub metrics_require_token: bool,
    /// Updates opened at once (CPU work; their bodies are already in memory; the fold that
    /// follows takes its round's lock without the slot).
    pub max_concurrent_uploads: usize,
    /// The longest a body waits for room in the byte budget before it is answered 503 `busy`.
    pub body_wait: Duration,
    /// Networks the admin API answers (empty: all).
    pub admin_allow: Vec<ipnet::IpNet>,
    /// Where bodies too large for memory are spooled: a chunked upload's chunks, a model or
    /// module upload (emptied when the server starts: [`chunked::prepare_spool`]).
    pub spool_dir: std::path::PathBuf,
    /// Chunked uploads (None: updates come in one body only).
    pub chunking: Option<chunked::Chunking>,
}

impl Default for HttpLimits {
    fn default() -> Self {
        HttpLimits {
            max_json_bytes: 1 << 20,
            max_model_bytes: 4 << 30,
            body_rate: BodyRate::default(),
            upload_buffer_bytes: 64 << 20,
            max_upload_share: 0.25,
            request_timeout: Duration::from_secs(30),
            metrics_require_token: false,
            max_concurrent_uploads: 1,
            body_wait: Duration::from_secs(10),
            admin_allow: Vec::new(),
            spool_dir: std::env::temp_dir(),
            chunking: None,
        }
    }
}

pub struct AppState {
    pub coordinator: Arc<Coordinator>,
    pub admin: auth::AdminKey,
    pub limits: HttpLimits,
    /// Updates being opened and folded at once: bounds the CPU work of ingest.
    pub ingest: Arc<Semaphore>,
    /// Bytes of upload bodies in memory at once: bounds memory whatever the client count.
    pub budget: body::IngestBudget,
    /// Bytes of JSON bodies in memory at once, apart from uploads: slow uploaders never make
    /// the admin API or a secure-aggregation stage wait.
    pub json_budget: body::IngestBudget,
    /// One upload per client and task in flight.
    pub uploads: Arc<body::UploadsInFlight>,
    /// Chunked uploads in progress (None: the server takes updates in one body only).
    pub sessions: Option<chunked::Sessions>,
    /// Sync jobs and the worlds their workers are forming.
    pub rendezvous: Rendezvous,
    pub readiness: Readiness,
    /// The dashboard's sessions and sign-in links.
    pub dashboard: crate::dashboard::Dashboard,
}

impl AppState {
    pub fn new(
        coordinator: Arc<Coordinator>,
        admin_token_hash: String,
        limits: HttpLimits,
        rendezvous: Rendezvous,
        dashboard: crate::dashboard::Dashboard,
    ) -> Shared {
        Arc::new(AppState {
            coordinator,
            admin: auth::AdminKey::new(admin_token_hash),
            ingest: Arc::new(Semaphore::new(limits.max_concurrent_uploads.max(1))),
            budget: body::IngestBudget::new(limits.upload_buffer_bytes, limits.max_upload_share),
            // (Every JSON body is at most 1/JSON_BODIES of its budget already.)
            json_budget: body::IngestBudget::new(limits.max_json_bytes as u64 * JSON_BODIES, 1.0),
            uploads: Arc::default(),
            sessions: limits
                .chunking
                .clone()
                .map(|c| chunked::Sessions::new(c, limits.spool_dir.clone())),
            limits,
            rendezvous,
            readiness: Readiness::default(),
            dashboard,
        })
    }
}

pub type Shared = Arc<AppState>;

/// How many JSON bodies of the largest size fit in their budget at once.
const JSON_BODIES: u64 = 16;

/// Proof that the request carries the admin token, or the cookie of a dashboard session (and,
/// if it changes anything, the session's CSRF token).
pub struct AdminAuth;

impl FromRequestParts<Shared> for AdminAuth {
    type Rejection = ServerError;

    async fn from_request_parts(parts: &mut Parts, state: &Shared) -> Result<Self, ServerError> {
        admin_source_allowed(state, parts)?;
        if parts.headers.get(AUTHORIZATION).is_none() {
            let sessions = &state.dashboard.sessions;
            if let Some(session) = sessions.of(&parts.headers)? {
                sessions.check_csrf(&session, &parts.method, &parts.headers)?;
                credentials_passed(&parts.extensions);
                return Ok(AdminAuth);
            }
        }
        let token = auth::bearer(parts.headers.get(AUTHORIZATION))?;
        check_admin_token(state, token, parts).await?;
        Ok(AdminAuth)
    }
}

/// Refuses (403) a request from an address the admin API does not answer (`--admin-allow`).
/// Asked before any credential is looked at: such an address learns nothing of the token and
/// spends none of its checks. A connection whose source could not be read is refused too:
/// nothing says it is allowed. (Without the connection guard, in-process, there is no source to
/// check.)
pub(crate) fn admin_source_allowed(state: &Shared, parts: &Parts) -> Result<(), ServerError> {
    let allow = &state.limits.admin_allow;
    if !allow.is_empty() && parts.extensions.get::<conn::Peer>().is_some() {
        let source = source_of(parts).map(|source| source.to_canonical());
        if !source.is_some_and(|source| allow.iter().any(|net| net.contains(&source))) {
            return Err(ServerError::Forbidden(
                "the admin API does not answer this address (see the server's --admin-allow)"
                    .into(),
            ));
        }
    }
    Ok(())
}

fn source_of(parts: &Parts) -> Option<std::net::IpAddr> {
    parts
        .extensions
        .get::<conn::Peer>()
        .and_then(conn::Peer::source)
}

/// Whether `token` is the admin token: 401 if not, 403 for a client's credentials, 503 `busy`
/// when the budget of slow checks is spent.
pub(crate) async fn check_admin_token(
    state: &Shared,
    token: &str,
    parts: &Parts,
) -> Result<(), ServerError> {
    if state.admin.passed(token) {
        credentials_passed(&parts.extensions);
        return Ok(());
    }
    // (Before the slow check, which a client's own credentials need not pay for.)
    if authenticate_client(state, token).await.is_ok() {
        return Err(ServerError::Forbidden(
            "client credentials cannot use the admin API".into(),
        ));
    }
    if state.admin.verify(token, source_of(parts)).await? {
        credentials_passed(&parts.extensions);
        return Ok(());
    }
    Err(ServerError::Unauthorized("invalid admin token".into()))
}

/// An authenticated, enrolled, unrevoked client that is not quarantined.
pub struct ClientAuth {
    pub id: String,
    /// Its updates refused in a row so far.
    pub strikes: u32,
    /// Enrolled as a regional aggregator: its updates may stand for several clients.
    pub aggregator: bool,
    /// Its enrolment's cap on the clients one update may stand for.
    pub max_contributors: Option<u64>,
}

/// The client `token` names, if its credentials are good. The record is read on a blocking
/// thread (a database store answers over the network).
async fn authenticate_client(state: &Shared, token: &str) -> Result<ClientRecord, ServerError> {
    let (id, secret) = auth::client_token(token)?;
    let invalid = || {
        ServerError::Unauthorized(
            "invalid client credentials: enrol again or check the stored credentials".into(),
        )
    };
    let (coordinator, key) = (state.coordinator.clone(), id.to_string());
    let record = crate::blocking(move || Ok(coordinator.store().client(&key)?))
        .await?
        .ok_or_else(invalid)?;
    if !auth::verify_secret(secret, &record.secret_hash) {
        return Err(invalid());
    }
    if record.revoked {
        return Err(ServerError::Unauthorized(format!(
            "client `{id}` has been revoked by the operator"
        )));
    }
    if let Some(q) = &record.quarantined {
        return Err(ServerError::Quarantined(format!(
            "client `{id}` is quarantined ({}); the operator can release it with `hora-server admin release {id}` once its training is fixed",
            q.reason
        )));
    }
    Ok(record)
}

/// The task a client route is about (`/v1/tasks/{task}/…`), if any.
fn task_of_path(path: &str) -> Option<&str> {
    path.strip_prefix("/v1/tasks/")?.split('/').next()
}

impl FromRequestParts<Shared> for ClientAuth {
    type Rejection = ServerError;

    /// Authenticates the client and, on `/v1/tasks/{task}/…`, checks the task is one its
    /// enrolment allows: any other answers exactly as a task that does not exist (404), so a
    /// client cannot learn which tasks exist beyond its own.
    async fn from_request_parts(parts: &mut Parts, state: &Shared) -> Result<Self, ServerError> {
        let token = auth::bearer(parts.headers.get(AUTHORIZATION))?;
        let record = authenticate_client(state, token).await?;
        credentials_passed(&parts.extensions);
        let (id, _) = auth::client_token(token)?;
        state.coordinator.clients_seen.seen(id);
        if let (Some(task), Some(allowed)) = (task_of_path(parts.uri.path()), &record.tasks) {
            if !allowed.iter().any(|t| t == task) {
                return Err(ServerError::NotFound(format!("no task `{task}`")));
            }
        }
        Ok(ClientAuth {
            id: id.to_string(),
            strikes: record.strikes,
            aggregator: record.aggregator,
            max_contributors: record.max_contributors,
        })
    }
}

/// Says that the request's credentials passed, so it no longer counts against its source's
/// unauthenticated requests in flight ([`limit_unauthenticated`]). [`AdminAuth`] and
/// [`ClientAuth`] say it themselves; routes that check a token of their own take [`Unverified`].
fn credentials_passed(extensions: &axum::http::Extensions) {
    if let Some(pending) = extensions.get::<conn::Unauthenticated>() {
        pending.passed();
    }
}

/// For routes that check a token of their own (enrolment, sync joins): the request's count
/// among its source's unauthenticated requests in flight, ended by [`Unverified::passed`] once
/// the token is found good, before the body is read. (Nothing is counted where the server runs
/// without the connection guard, as in-process tests do.)
pub struct Unverified(Option<conn::Unauthenticated>);

impl Unverified {
    pub fn passed(&self) {
        if let Some(pending) = &self.0 {
            pending.passed();
        }
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Unverified {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        Ok(Unverified(parts.extensions.get().cloned()))
    }
}

/// A JSON body, read (after the route's credentials, which its handler's earlier extractors
/// check) through [`json_body`]; rejections are `ApiError` bodies.
pub struct ApiJson<T>(pub T);

impl<T: DeserializeOwned> FromRequest<Shared> for ApiJson<T> {
    type Rejection = ServerError;

    async fn from_request(req: Request, state: &Shared) -> Result<Self, ServerError> {
        let (parts, body) = req.into_parts();
        json_body(state, &parts.headers, body).await.map(ApiJson)
    }
}

/// A JSON body read through the byte budget and rate floor every body goes through
/// ([`body::read_small`]), at most `max_json_bytes`, and parsed as the document's JSON Schema
/// reads JSON (see [`strict_json`]).
pub async fn json_body<T: DeserializeOwned>(
    state: &Shared,
    headers: &HeaderMap,
    body: Body,
) -> Result<T, ServerError> {
    json_body_within(state, headers, body, state.limits.max_json_bytes as u64).await
}

/// [`json_body`] of at most `max` bytes.
pub async fn json_body_within<T: DeserializeOwned>(
    state: &Shared,
    headers: &HeaderMap,
    body: Body,
    max: u64,
) -> Result<T, ServerError> {
    let json = headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .map(|v| v.trim().to_ascii_lowercase())
        .is_some_and(|v| {
            v == "application/json" || (v.starts_with("application/") && v.ends_with("+json"))
        });
    if !json {
        return Err(ServerError::BadRequest(
            "send the body as JSON with `Content-Type: application/json`".into(),
        ));
    }
    let bytes = body::read_small(state, headers, body, max).await?;
    let value: serde_json::Value = serde_json::from_slice(&bytes)
        .map_err(|e| ServerError::BadRequest(format!("malformed JSON body: {e}")))?;
    strict_json::from_value(value)
        .map_err(|e| ServerError::BadRequest(format!("malformed JSON body: {e}")))
}

/// `axum::extract::Path` whose rejections are `ApiError` bodies: a path parameter that does not
/// parse (`/v1/tasks/t/rounds/notanumber/update`) is a 400 `bad_request`, as the document says.
pub struct ApiPath<T>(pub T);

impl<T: DeserializeOwned + Send, S: Send + Sync> FromRequestParts<S> for ApiPath<T> {
    type Rejection = ServerError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ServerError> {
        match axum::extract::Path::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Path(v)) => Ok(ApiPath(v)),
            // A route whose handler asks for parameters its path lacks: our bug, not the caller's.
            Err(e) if e.status().is_server_error() => Err(ServerError::internal(e.body_text())),
            Err(e) => Err(ServerError::BadRequest(format!(
                "malformed path: {}",
                e.body_text()
            ))),
        }
    }
}

/// `axum::extract::Query` whose rejections are `ApiError` bodies (400 `bad_request`).
pub struct ApiQuery<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequestParts<S> for ApiQuery<T> {
    type Rejection = ServerError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ServerError> {
        axum::extract::Query::<T>::from_request_parts(parts, state)
            .await
            .map(|axum::extract::Query(v)| ApiQuery(v))
            .map_err(|e| ServerError::BadRequest(format!("malformed query: {}", e.body_text())))
    }
}

/// Whether the request's `If-None-Match` names `etag`.
pub fn not_modified(headers: &HeaderMap, etag: &str) -> bool {
    headers
        .get(axum::http::header::IF_NONE_MATCH)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| {
            v.split(',')
                .any(|t| t.trim().trim_start_matches("W/").trim_matches('"') == etag)
        })
}

#[utoipa::path(get, path = "/healthz", tag = "ops",
    responses((status = 200, description = "The server is up", body = inline(doc::Text), content_type = "text/plain")))]
async fn healthz() -> &'static str {
    "ok"
}

/// How long `/readyz` waits for the store's answer.
const READY_WITHIN: Duration = Duration::from_secs(2);

#[utoipa::path(get, path = "/readyz", tag = "ops",
    responses(
        (status = 200, description = "This server can reach its store (records and blobs) and serve", body = inline(doc::Text), content_type = "text/plain"),
        (status = 503, body = ApiError, description = "`store_unavailable`: the store (its records or its blobs) did not answer (within 2 s); `shutting_down`: the server is shutting down; `standby`: this replica stands by while another leads (it answers every request but `/healthz` so). A load balancer sends this server nothing meanwhile")))]
async fn readyz(State(state): State<Shared>) -> Result<&'static str, ServerError> {
    if state.coordinator.stopping.is_cancelled() {
        return Err(ServerError::unavailable(
            ErrorCode::ShuttingDown,
            "the server is shutting down",
        ));
    }
    state.readiness.check(&state).await.map(|()| "ready")
}

/// How long a readiness answer is reused.
const READY_FOR: Duration = Duration::from_secs(1);

/// `/readyz`'s answers: one check of the store in flight at a time, its answer reused for
/// [`READY_FOR`] and by every probe that comes while it runs. A probe is never counted against
/// its address's limit (a load balancer's must get through), so without this a flood of probes
/// while the store hangs would pin a blocking thread each.
#[derive(Default)]
pub struct Readiness {
    /// Held by the blocking check itself, so a dropped probe does not end it early.
    checking: Arc<tokio::sync::Mutex<()>>,
    last: std::sync::Mutex<Option<(tokio::time::Instant, Result<(), String>)>>,
}

impl Readiness {
    fn keep(&self, answer: Result<(), String>) {
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) =
            Some((tokio::time::Instant::now(), answer));
    }

    fn fresh(&self) -> Option<Result<(), String>> {
        let last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        last.as_ref()
            .filter(|(at, _)| at.elapsed() < READY_FOR)
            .map(|(_, answer)| answer.clone())
    }

    async fn check(&self, state: &Shared) -> Result<(), ServerError> {
        let refused = |why: String| ServerError::unavailable(ErrorCode::StoreUnavailable, why);
        if let Some(answer) = self.fresh() {
            return answer.map_err(refused);
        }
        let Ok(checking) = self.checking.clone().try_lock_owned() else {
            // Another probe is asking the store: its answer, once there, within the bound.
            let waited = tokio::time::timeout(READY_WITHIN, self.checking.lock()).await;
            return match (waited, self.fresh()) {
                (Ok(_), Some(answer)) => answer.map_err(refused),
                _ => Err(refused(format!(
                    "the store did not answer within {} s",
                    READY_WITHIN.as_secs()
                ))),
            };
        };
        let shared = state.clone();
        let asked = crate::blocking(move || {
            let store = shared.coordinator.store();
            let answer = store
                .ready()
                .and_then(|()| crate::store::blobs::reachable(store.blobs()));
            // Kept before the check's place is given up, for the probes waiting on it.
            shared
                .readiness
                .keep(answer.as_ref().map(|_| ()).map_err(|e| e.to_string()));
            drop(checking);
            Ok(answer?)
        });
        match tokio::time::timeout(READY_WITHIN, asked).await {
            Ok(answer) => answer,
            Err(_) => {
                let late = refused(format!(
                    "the store did not answer within {} s",
                    READY_WITHIN.as_secs()
                ));
                self.keep(Err(late.to_string()));
                Err(late)
            }
        }
    }
}

#[utoipa::path(get, path = "/metrics", tag = "ops",
    security((), ("admin_token" = [])),
    responses(
        (status = 200, description = "Prometheus text format", body = inline(doc::Text), content_type = "application/openmetrics-text"),
        (status = 401, body = ApiError, description = "the operator requires the admin token for metrics, and the request lacks it")))]
async fn metrics(State(state): State<Shared>, parts: Parts) -> Result<Response, ServerError> {
    if state.limits.metrics_require_token {
        let mut parts = parts;
        AdminAuth::from_request_parts(&mut parts, &state).await?;
    }
    // The process's figures are read from /proc: off the runtime's threads.
    let coordinator = state.coordinator.clone();
    let text = tokio::task::spawn_blocking(move || coordinator.metrics.render())
        .await
        .map_err(|e| ServerError::Internal(format!("rendering the metrics: {e}")))?;
    Ok((
        [(
            CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        text,
    )
        .into_response())
}

#[utoipa::path(get, path = "/openapi.json", tag = "ops",
    responses((status = 200, description = "This document (OpenAPI 3.1)", body = Object)))]
async fn openapi() -> Response {
    axum::Json(ApiDoc::openapi()).into_response()
}

async fn fallback() -> ServerError {
    ServerError::NotFound("no such route: see GET /openapi.json".into())
}

/// A request body that notes when it has been read to its end.
struct TrackedBody {
    inner: Body,
    read: Arc<AtomicBool>,
}

impl http_body::Body for TrackedBody {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if matches!(polled, Poll::Ready(None)) || self.inner.is_end_stream() {
            self.read.store(true, Ordering::Relaxed);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// An answer given before the request's body was read (a refusal from the credentials or the
/// path alone) leaves an HTTP/1.1 connection unusable: hyper closes it after the answer, but
/// without saying so, and a client that sends its next request on it sees the connection drop
/// instead of an answer. Such answers say `Connection: close`, so the client opens a new one.
/// (HTTP/2 refuses the one stream and keeps the connection.)
async fn close_when_body_unread(req: Request, next: axum::middleware::Next) -> Response {
    use http_body::Body as _;
    if req.version() > axum::http::Version::HTTP_11 || req.body().is_end_stream() {
        return next.run(req).await;
    }
    let read = Arc::new(AtomicBool::new(false));
    let tracked = read.clone();
    let req = req.map(|inner| {
        Body::new(TrackedBody {
            inner,
            read: tracked,
        })
    });
    let mut response = next.run(req).await;
    if !read.load(Ordering::Relaxed) {
        response.headers_mut().insert(
            axum::http::header::CONNECTION,
            axum::http::HeaderValue::from_static("close"),
        );
    }
    response
}

/// Bounds how many requests of one source address are in flight before their credentials pass
/// (`--max-unauthenticated-per-source`): each request counts from its arrival until its route
/// finds its credentials good ([`credentials_passed`]) or it is answered, and one over the limit
/// is answered 429 `too_many_requests` with `Retry-After` at once, before its credentials are
/// looked at or a byte of its body is read.
///
/// "Unauthenticated" is everything before a good credential: requests that carry none, wrong
/// ones, ones still being checked (the admin token's slow check, an enrolment token's lookup),
/// and requests to the open routes (`/openapi.json`, `/metrics` unless it needs the token,
/// unknown paths), which have no credentials to pass and count until they are answered. The
/// health probes (`/healthz`, `/readyz`) are not counted: they are answered from memory at once
/// (readiness within its own 2 s bound), and a load balancer's probes from one address must not
/// be refused while that address's guesses are.
/// An honest request counts for the moment its check takes, so the limit binds only a source
/// that keeps many checks in flight at once: a flood of guesses, or of slow refusals. Its other
/// requests, good credentials or not, are refused meanwhile too (the limit is the address's,
/// as with `--max-connections-per-source`: raise it for many devices behind one NAT gateway).
async fn limit_unauthenticated(mut request: Request, next: axum::middleware::Next) -> Response {
    let Some(peer) = request.extensions().get::<conn::Peer>().cloned() else {
        return next.run(request).await;
    };
    if matches!(request.uri().path(), "/healthz" | "/readyz") {
        return next.run(request).await;
    }
    let Some(pending) = peer.unauthenticated() else {
        if let Some(source) = peer.source() {
            tracing::debug!(%source, "too many unauthenticated requests in flight");
        }
        return ServerError::TooManyRequests(
            "too many requests from this address are in flight before their credentials were checked; retry in a moment".into(),
        )
        .into_response();
    };
    request.extensions_mut().insert(pending.clone());
    let response = next.run(request).await;
    drop(pending);
    response
}

/// A known path asked with a method it does not serve. The router adds the `Allow` header.
async fn method_not_allowed(method: axum::http::Method) -> Response {
    error::answer(
        StatusCode::METHOD_NOT_ALLOWED,
        ErrorCode::MethodNotAllowed,
        format!("this route does not answer {method}: see the `Allow` header or GET /openapi.json"),
    )
}

/// Whether a route may legitimately hold a request longer than the request timeout: long polls
/// (bounded by their own wait), sync-job joins (bounded by the rendezvous), and body uploads
/// (bounded by the minimum body rate and the durability wait).
fn holds_open(method: &axum::http::Method, route: &str) -> bool {
    let long_poll = *method == axum::http::Method::GET
        && (route.ends_with("/poll")
            || route.ends_with("/neighbours")
            || route.ends_with("/shares")
            || route.ends_with("/unmask"));
    let chunk = *method == axum::http::Method::PUT && route.ends_with("/chunks/{index}");
    let upload = *method == axum::http::Method::POST
        && (route.ends_with("/update")
            || route.ends_with("/complete")
            || route.ends_with("/masked")
            || route == "/admin/v1/models"
            || route == "/admin/v1/modules"
            || route == "/v1/sync/{job}/join");
    long_poll || upload || chunk
}

/// Counts each request of a route by its template, method and status, and times it to its
/// response's head (`hora_http_*`).
async fn observe(
    State(state): State<Shared>,
    request: Request,
    next: axum::middleware::Next,
) -> Response {
    let start = std::time::Instant::now();
    let route = request
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .map_or_else(|| UNROUTED.to_string(), |m| m.as_str().to_string());
    let method = request.method().clone();
    let mut response = next.run(request).await;
    state.coordinator.metrics.request(
        &route,
        method.as_str(),
        response.status().as_u16(),
        start.elapsed().as_secs_f64(),
    );
    response.extensions_mut().insert(Observed);
    response
}

/// The route label of requests answered before or without a route (404, 405, 429, 413).
const UNROUTED: &str = "(none)";

/// A response [`observe`] counted.
#[derive(Clone, Copy)]
struct Observed;

/// Counts what no route answered (unknown paths, wrong methods, refusals before routing) under
/// the route `(none)`, its method one of the standard ones or `other`, so that the labels stay
/// few whatever clients send.
async fn observe_unrouted(
    State(state): State<Shared>,
    request: Request,
    next: axum::middleware::Next,
) -> Response {
    let start = std::time::Instant::now();
    let method: &'static str = match request.method().as_str() {
        "GET" => "GET",
        "HEAD" => "HEAD",
        "POST" => "POST",
        "PUT" => "PUT",
        "DELETE" => "DELETE",
        "PATCH" => "PATCH",
        "OPTIONS" => "OPTIONS",
        _ => "other",
    };
    let response = next.run(request).await;
    if response.extensions().get::<Observed>().is_none() {
        state.coordinator.metrics.request(
            UNROUTED,
            method,
            response.status().as_u16(),
            start.elapsed().as_secs_f64(),
        );
    }
    response
}

/// Bounds every other request's time: answered 503 `request_timeout` when it runs over.
async fn request_timeout(
    State(state): State<Shared>,
    request: Request,
    next: axum::middleware::Next,
) -> Response {
    let route = request
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .map(|m| m.as_str().to_string());
    if route
        .as_deref()
        .is_some_and(|r| holds_open(request.method(), r))
    {
        return next.run(request).await;
    }
    let limit = state.limits.request_timeout;
    match tokio::time::timeout(limit, next.run(request)).await {
        Ok(response) => response,
        Err(_) => ServerError::Unavailable {
            code: ErrorCode::RequestTimeout,
            message: format!(
                "the request took longer than the server's limit of {} s; retry later",
                limit.as_secs()
            ),
        }
        .into_response(),
    }
}

/// What a standby replica answers on its port while another replica leads (see
/// `store::postgres::lease`): it is alive (`/healthz`) but not ready (`/readyz`), and refuses
/// every other request with 503 `standby` and `Retry-After`, so that a load balancer routes past
/// it, an orchestrator's liveness probe leaves it running, and a client given several servers
/// moves on. It reads no body and holds nothing: it has nothing to serve until it leads.
pub fn standby_router() -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .fallback(standby)
        .layer(axum::middleware::from_fn(close_when_body_unread))
}

async fn standby() -> ServerError {
    ServerError::unavailable(
        ErrorCode::Standby,
        "this replica stands by: another replica of this deployment leads and serves; send the request to another of its servers (`hora-server status` lists them), or retry",
    )
}

pub fn router(state: Shared) -> Router {
    let routes = Router::new()
        .route("/openapi.json", get(openapi))
        .merge(client::routes())
        .merge(client::evaluation_routes())
        .merge(chunked::routes())
        .merge(secagg::routes())
        .merge(sync::routes())
        .merge(admin::routes())
        .merge(crate::dashboard::routes())
        .fallback(fallback);
    serve(routes, state)
}

/// What a replica that serves without leading answers (see `round::replicas`): its clients'
/// enrolment, polls, joins, model downloads and uploads (one body or in chunks), secure
/// aggregation's messages, its probes and its metrics; everything else (the admin API, the
/// dashboard, evaluation reports, synchronous jobs) is the leader's, answered 503 `standby` as
/// a standby answers it, so that clients given several servers move on.
pub fn follower_router(state: Shared) -> Router {
    let routes = Router::new()
        .merge(client::routes())
        .merge(chunked::routes())
        .merge(secagg::routes())
        .fallback(standby);
    serve(routes, state)
}

/// `routes` with the probes, the metrics and every layer of the server's HTTP handling.
fn serve(routes: Router<Shared>, state: Shared) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .merge(routes)
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            request_timeout,
        ))
        // Outside the timeout: its 503s are counted too.
        .route_layer(axum::middleware::from_fn_with_state(state.clone(), observe))
        // After every route is in place: it is set on the routes registered so far.
        .method_not_allowed_fallback(method_not_allowed)
        // Bodies are bounded per route (read_body, json_body); this catches any other reader.
        .layer(axum::extract::DefaultBodyLimit::max(
            state.limits.max_json_bytes,
        ))
        // Outside the routes, inside the next layer: its refusals close unread HTTP/1.1 bodies.
        .layer(axum::middleware::from_fn(limit_unauthenticated))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            observe_unrouted,
        ))
        .layer(axum::middleware::from_fn(close_when_body_unread))
        .with_state(state)
}
