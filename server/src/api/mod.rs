//! The HTTP surface: the client API (`/v1`, [`client`]), the sync-job workers' rendezvous
//! (`/v1/sync`, [`sync`]), the secure-aggregation stages ([`secagg`]), the admin API (`/admin/v1`, [`admin`]), and the operational routes
//! (`/healthz`, `/metrics`, `/openapi.json`).
//!
//! Every handler returns `Result<_, ServerError>`, so every refusal is a 4xx with an
//! `ApiError` JSON body. Bodies are size-checked from `Content-Length` before they are read, and
//! read into a buffer of exactly that size.

pub mod admin;
pub mod client;
pub mod doc;
pub mod secagg;
mod strict_json;
pub mod sync;

pub use doc::ApiDoc;

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Body;
use axum::extract::rejection::JsonRejection;
use axum::extract::{FromRequest, FromRequestParts, Request, State};
use axum::http::header::{AUTHORIZATION, CONTENT_LENGTH, CONTENT_TYPE};
use axum::http::request::Parts;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Json;
use axum::Router;
use hora_common::wire::ApiError;
use http_body_util::BodyExt;
use serde::de::DeserializeOwned;
use tokio::sync::Semaphore;
use utoipa::OpenApi;

use crate::auth;
use crate::coordinator::Coordinator;
use crate::error::ServerError;
use crate::rendezvous::Rendezvous;

/// Limits on what the HTTP layer accepts.
#[derive(Debug, Clone)]
pub struct HttpLimits {
    /// JSON bodies.
    pub max_json_bytes: usize,
    /// Models and TorchScript modules uploaded by the admin.
    pub max_model_bytes: u64,
}

impl Default for HttpLimits {
    fn default() -> Self {
        HttpLimits {
            max_json_bytes: 1 << 20,
            max_model_bytes: 4 << 30,
        }
    }
}

pub struct AppState {
    pub coordinator: Arc<Coordinator>,
    pub admin_token_hash: String,
    pub limits: HttpLimits,
    /// Update bodies being read and folded at once: bounds memory whatever the client count.
    pub ingest: Arc<Semaphore>,
    /// Sync jobs and the worlds their workers are forming.
    pub rendezvous: Rendezvous,
}

pub type Shared = Arc<AppState>;

/// Proof that the request carries the admin token.
pub struct AdminAuth;

impl FromRequestParts<Shared> for AdminAuth {
    type Rejection = ServerError;

    async fn from_request_parts(parts: &mut Parts, state: &Shared) -> Result<Self, ServerError> {
        let token = auth::bearer(parts.headers.get(AUTHORIZATION))?;
        if auth::verify_secret(token, &state.admin_token_hash) {
            return Ok(AdminAuth);
        }
        if authenticate_client(state, token).is_ok() {
            return Err(ServerError::Forbidden(
                "client credentials cannot use the admin API".into(),
            ));
        }
        Err(ServerError::Unauthorized("invalid admin token".into()))
    }
}

/// An authenticated, enrolled, unrevoked client.
pub struct ClientAuth {
    pub id: String,
}

fn authenticate_client(state: &Shared, token: &str) -> Result<String, ServerError> {
    let (id, secret) = auth::client_token(token)?;
    let invalid = || {
        ServerError::Unauthorized(
            "invalid client credentials: enrol again or check the stored credentials".into(),
        )
    };
    let record = state.coordinator.store().client(id)?.ok_or_else(invalid)?;
    if !auth::verify_secret(secret, &record.secret_hash) {
        return Err(invalid());
    }
    if record.revoked {
        return Err(ServerError::Unauthorized(format!(
            "client `{id}` has been revoked by the operator"
        )));
    }
    Ok(id.to_string())
}

impl FromRequestParts<Shared> for ClientAuth {
    type Rejection = ServerError;

    async fn from_request_parts(parts: &mut Parts, state: &Shared) -> Result<Self, ServerError> {
        let token = auth::bearer(parts.headers.get(AUTHORIZATION))?;
        authenticate_client(state, token).map(|id| ClientAuth { id })
    }
}

/// `axum::Json` whose rejections are `ApiError` bodies, read as the document's JSON Schema reads
/// JSON (see [`strict_json`]).
pub struct ApiJson<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for ApiJson<T> {
    type Rejection = ServerError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ServerError> {
        match axum::Json::<serde_json::Value>::from_request(req, state).await {
            Ok(axum::Json(v)) => strict_json::from_value(v)
                .map(ApiJson)
                .map_err(|e| ServerError::BadRequest(format!("malformed JSON body: {e}"))),
            Err(JsonRejection::MissingJsonContentType(_)) => Err(ServerError::BadRequest(
                "send the body as JSON with `Content-Type: application/json`".into(),
            )),
            Err(e) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => {
                Err(ServerError::PayloadTooLarge { got: 0, limit: 0 })
            }
            Err(e) => Err(ServerError::BadRequest(format!(
                "malformed JSON body: {}",
                e.body_text()
            ))),
        }
    }
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

/// Reads a body of at most `limit` bytes into a buffer of exactly its declared length. Refuses
/// (413) from the `Content-Length` header alone, before reading anything.
pub async fn read_body(
    headers: &HeaderMap,
    body: Body,
    limit: u64,
) -> Result<Vec<u8>, ServerError> {
    let declared: u64 = headers
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .ok_or(ServerError::LengthRequired)?;
    if declared > limit {
        return Err(ServerError::PayloadTooLarge {
            got: declared,
            limit,
        });
    }
    let mut buf = Vec::with_capacity(declared as usize);
    let mut body = body;
    while let Some(frame) = body.frame().await {
        let frame =
            frame.map_err(|e| ServerError::BadRequest(format!("reading the body failed: {e}")))?;
        if let Ok(data) = frame.into_data() {
            if buf.len() + data.len() > declared as usize {
                return Err(ServerError::BadRequest(
                    "body is longer than its Content-Length".into(),
                ));
            }
            buf.extend_from_slice(&data);
        }
    }
    if buf.len() as u64 != declared {
        return Err(ServerError::BadRequest(format!(
            "body ended after {} of {declared} bytes",
            buf.len()
        )));
    }
    Ok(buf)
}

/// Takes one of the server's ingest slots (bounding the upload bodies held at once, whatever
/// the number of clients), then reads a body of at most `limit` bytes. The slot is released
/// when the caller drops the permit.
pub async fn read_upload(
    state: &Shared,
    headers: &HeaderMap,
    body: Body,
    limit: u64,
) -> Result<(Vec<u8>, tokio::sync::OwnedSemaphorePermit), ServerError> {
    let permit = state
        .ingest
        .clone()
        .acquire_owned()
        .await
        .map_err(ServerError::internal)?;
    Ok((read_body(headers, body, limit).await?, permit))
}

/// A safetensors (or other binary) response with the digest as strong ETag.
pub fn binary(bytes: Vec<u8>, etag: &str) -> Response {
    (
        [
            (CONTENT_TYPE, "application/octet-stream".to_string()),
            (axum::http::header::ETAG, format!("\"{etag}\"")),
        ],
        bytes,
    )
        .into_response()
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

#[utoipa::path(get, path = "/metrics", tag = "ops",
    security((), ("admin_token" = [])),
    responses(
        (status = 200, description = "Prometheus text format", body = inline(doc::Text), content_type = "application/openmetrics-text"),
        (status = 401, body = ApiError, description = "the operator requires the admin token for metrics, and the request lacks it")))]
async fn metrics(State(state): State<Shared>) -> Response {
    (
        [(
            CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.coordinator.metrics.render(),
    )
        .into_response()
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

/// A known path asked with a method it does not serve. The router adds the `Allow` header.
async fn method_not_allowed(method: axum::http::Method) -> Response {
    (
        StatusCode::METHOD_NOT_ALLOWED,
        Json(ApiError {
            code: "method_not_allowed".into(),
            message: format!(
                "this route does not answer {method}: see the `Allow` header or GET /openapi.json"
            ),
        }),
    )
        .into_response()
}

pub fn router(state: Shared) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics))
        .route("/openapi.json", get(openapi))
        .merge(client::routes())
        .merge(secagg::routes())
        .merge(sync::routes())
        .merge(admin::routes())
        .fallback(fallback)
        // After every route is in place: it is set on the routes registered so far.
        .method_not_allowed_fallback(method_not_allowed)
        // Bodies are bounded per route (read_body, ApiJson's limit below).
        .layer(axum::extract::DefaultBodyLimit::max(
            state.limits.max_json_bytes,
        ))
        .layer(axum::middleware::from_fn(close_when_body_unread))
        .with_state(state)
}
