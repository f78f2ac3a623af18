//! The secure-aggregation stages of the client API, under
//! `/v1/tasks/{task}/secagg/{round}/{attempt}/…` (see [`crate::secagg`] for the protocol):
//!
//! | stage | client sends | client then fetches (long poll; 204 while not ready) |
//! |---|---|---|
//! | 0 | `POST advertise` (signed keys) | `GET neighbours` (roster) |
//! | 1 | `POST shares` (encrypted bundles) | `GET shares` (bundles addressed to it) |
//! | 2 | `POST masked` (u32 LE vector) | `GET unmask` (which shares to reveal) |
//! | 3 | `POST unmask` (revealed shares) | — the round publishes |
//!
//! Every POST answers once what it carried is durable; repeating an identical POST is
//! harmless (a lost acknowledgement), a different one for the same stage is a 409.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use hora_common::wire::{
    ApiError, ErrorCode, SecAggAdvertise, SecAggReceipt, SecAggRoster, SecAggShareBundles,
    SecAggUnmask, SecAggUnmaskRequest,
};
use serde::{Deserialize, Serialize};

use super::{read_upload, ApiJson, ApiPath, ApiQuery, ClientAuth, Shared};
use crate::error::ServerError;
use crate::round::Round;
use crate::secagg::{Outcome, SecAggRound};

pub fn routes() -> Router<Shared> {
    let base = "/v1/tasks/{task}/secagg/{round}/{attempt}";
    Router::new()
        .route(&format!("{base}/advertise"), post(advertise))
        .route(&format!("{base}/neighbours"), get(neighbours))
        .route(&format!("{base}/shares"), post(share).get(inbox))
        .route(&format!("{base}/masked"), post(masked))
        .route(&format!("{base}/unmask"), get(unmask_request).post(unmask))
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct WaitQuery {
    /// How long to hold the request open for the stage to close (capped at 30 s).
    #[serde(default)]
    wait_ms: u64,
}

type AttemptPath = ApiPath<(String, u64, u32)>;

/// Runs a stage's message on a blocking thread (it writes and flushes the store, and the last
/// answer of the unmask stage removes every mask), then acts on the outcome.
async fn submit<F>(
    state: &Shared,
    client: &str,
    (task, round, attempt): (String, u64, u32),
    stage: F,
) -> Result<Json<SecAggReceipt>, ServerError>
where
    F: FnOnce(&SecAggRound, &crate::store::Store) -> Result<(SecAggReceipt, Outcome), ServerError>
        + Send
        + 'static,
{
    let coordinator = state.coordinator.clone();
    let task = coordinator.task(&task)?;
    let (round, s) = coordinator
        .secagg_attempt(&task, client, round, attempt)
        .await?;
    let result = tokio::task::spawn_blocking(move || {
        let (receipt, outcome) = stage(&s, coordinator.store())?;
        coordinator.secagg_outcome(&task, &round, outcome)?;
        Ok::<_, ServerError>(receipt)
    })
    .await
    .map_err(ServerError::internal)?;
    if let Err(e) = &result {
        tracing::info!(client, code = e.code().as_str(), error = ?e.to_string(), "secure-aggregation message refused");
    }
    result.map(Json)
}

/// Holds the request until `read` has an answer for `client` (the stage closed), the attempt
/// ends, or the wait runs out (204). `read` runs on a blocking thread: the stage's lock is held
/// across the store's writes by the messages that change it.
async fn wait_for<T: Serialize + Send + 'static>(
    state: &Shared,
    client: &str,
    (task, round, attempt): (String, u64, u32),
    wait_ms: u64,
    read: fn(&SecAggRound, &str) -> Result<Option<T>, ServerError>,
) -> Result<Response, ServerError> {
    let task = state.coordinator.task(&task)?;
    let until = tokio::time::Instant::now() + Duration::from_millis(wait_ms.min(30_000));
    loop {
        let (_, s): (Arc<Round>, Arc<SecAggRound>) = state
            .coordinator
            .secagg_attempt(&task, client, round, attempt)
            .await?;
        let mut changed = s.changed.subscribe();
        let who = client.to_string();
        if let Some(answer) = crate::blocking(move || read(&s, &who)).await? {
            return Ok(Json(answer).into_response());
        }
        let mut moved = task.subscribe();
        tokio::select! {
            _ = tokio::time::sleep_until(until) => return Ok(StatusCode::NO_CONTENT.into_response()),
            _ = changed.changed() => {}
            _ = moved.changed() => {}
        }
    }
}

#[utoipa::path(post, path = "/v1/tasks/{task}/secagg/{round}/{attempt}/advertise", tag = "secure aggregation",
    params(("task" = String, Path), ("round" = u64, Path), ("attempt" = u32, Path)), request_body = SecAggAdvertise,
    security(("client_credentials" = [])),
    responses((status = 200, body = SecAggReceipt), (status = 400, body = ApiError, description = "bad signature, low-order key, malformed"),
        (status = 409, body = ApiError, description = "no round open, not secure aggregation, not selected, stage closed, attempt abandoned, other keys advertised, no identity key")))]
pub async fn advertise(
    State(state): State<Shared>,
    auth: ClientAuth,
    ApiPath(at): AttemptPath,
    ApiJson(keys): ApiJson<SecAggAdvertise>,
) -> Result<Json<SecAggReceipt>, ServerError> {
    let client = auth.id.clone();
    submit(&state, &auth.id, at, move |s, store| {
        // (On the blocking thread: a database's store answers over the network.)
        let identity = store
            .client(&client)?
            .and_then(|c| c.identity_key)
            .ok_or_else(|| {
                ServerError::conflict(
                    ErrorCode::NoIdentityKey,
                    format!(
                        "client `{client}` registered no identity key at enrolment: enrol it again"
                    ),
                )
            })?;
        s.advertise(store, &client, &identity, keys)
    })
    .await
}

#[utoipa::path(get, path = "/v1/tasks/{task}/secagg/{round}/{attempt}/neighbours", tag = "secure aggregation",
    params(("task" = String, Path), ("round" = u64, Path), ("attempt" = u32, Path), WaitQuery),
    security(("client_credentials" = [])),
    responses((status = 200, body = SecAggRoster), (status = 204, description = "advertising has not closed yet"),
        (status = 409, body = ApiError, description = "no round open, not selected, dropped out, attempt abandoned")))]
pub async fn neighbours(
    State(state): State<Shared>,
    auth: ClientAuth,
    ApiPath(at): AttemptPath,
    ApiQuery(q): ApiQuery<WaitQuery>,
) -> Result<Response, ServerError> {
    wait_for(&state, &auth.id, at, q.wait_ms, SecAggRound::roster).await
}

#[utoipa::path(post, path = "/v1/tasks/{task}/secagg/{round}/{attempt}/shares", tag = "secure aggregation",
    params(("task" = String, Path), ("round" = u64, Path), ("attempt" = u32, Path)), request_body = SecAggShareBundles,
    security(("client_credentials" = [])),
    responses((status = 200, body = SecAggReceipt), (status = 400, body = ApiError, description = "a bundle for a non-neighbour, a neighbour missing"),
        (status = 409, body = ApiError, description = "no round open, not selected, stage closed, dropped out, other bundles sent")))]
pub async fn share(
    State(state): State<Shared>,
    auth: ClientAuth,
    ApiPath(at): AttemptPath,
    ApiJson(bundles): ApiJson<SecAggShareBundles>,
) -> Result<Json<SecAggReceipt>, ServerError> {
    let client = auth.id.clone();
    submit(&state, &auth.id, at, move |s, store| {
        s.share(store, &client, bundles)
    })
    .await
}

#[utoipa::path(get, path = "/v1/tasks/{task}/secagg/{round}/{attempt}/shares", tag = "secure aggregation",
    params(("task" = String, Path), ("round" = u64, Path), ("attempt" = u32, Path), WaitQuery),
    security(("client_credentials" = [])),
    responses((status = 200, body = SecAggShareBundles, description = "the bundles addressed to this client"),
        (status = 204, description = "sharing has not closed yet"),
        (status = 409, body = ApiError, description = "no round open, not selected, dropped out, attempt abandoned")))]
pub async fn inbox(
    State(state): State<Shared>,
    auth: ClientAuth,
    ApiPath(at): AttemptPath,
    ApiQuery(q): ApiQuery<WaitQuery>,
) -> Result<Response, ServerError> {
    wait_for(&state, &auth.id, at, q.wait_ms, SecAggRound::inbox).await
}

#[utoipa::path(post, path = "/v1/tasks/{task}/secagg/{round}/{attempt}/masked", tag = "secure aggregation",
    params(("task" = String, Path), ("round" = u64, Path), ("attempt" = u32, Path)),
    request_body(content = inline(super::doc::Binary), content_type = "application/octet-stream", description = "the masked input: numel + 1 u32 values, little-endian"),
    security(("client_credentials" = [])),
    responses((status = 200, body = SecAggReceipt, description = "folded into the sum and durable"),
        (status = 400, body = ApiError, description = "a malformed path; the wrong length"),
        (status = 408, body = ApiError, description = "`upload_too_slow`: the body arrived too slowly"),
        (status = 409, body = ApiError, description = "no round open, not selected, already uploaded, stage closed, dropped out; `upload_in_progress`: another masked upload of this client is being read"),
        (status = 411, body = ApiError, description = "`length_required`: no `Content-Length`"),
        (status = 413, body = ApiError, description = "`payload_too_large`: longer than the masked input"),
        (status = 503, body = ApiError, description = "`not_durable_yet`: the masked input could not be made durable in time (retry); `busy`: no room to read the body within the body wait (retry later); `request_timeout`: the server gave up on the request")))]
pub async fn masked(
    State(state): State<Shared>,
    auth: ClientAuth,
    ApiPath(at): AttemptPath,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<SecAggReceipt>, ServerError> {
    let task = state.coordinator.task(&at.0)?;
    let (_, s) = state
        .coordinator
        .secagg_attempt(&task, &auth.id, at.1, at.2)
        .await?;
    let _in_flight = state.uploads.begin(&task.id, &auth.id)?;
    let within = std::time::Duration::from_secs(task.record().config.round_deadline_secs);
    let (body, permit) = read_upload(&state, &headers, body, s.masked_len(), within).await?;
    let client = auth.id.clone();
    let receipt = submit(&state, &auth.id, at, move |s, store| {
        s.masked(store, &client, &body)
    })
    .await;
    drop(permit);
    receipt
}

#[utoipa::path(get, path = "/v1/tasks/{task}/secagg/{round}/{attempt}/unmask", tag = "secure aggregation",
    params(("task" = String, Path), ("round" = u64, Path), ("attempt" = u32, Path), WaitQuery),
    security(("client_credentials" = [])),
    responses((status = 200, body = SecAggUnmaskRequest), (status = 204, description = "masked inputs are still due"),
        (status = 409, body = ApiError, description = "no round open, not selected, dropped out, attempt abandoned")))]
pub async fn unmask_request(
    State(state): State<Shared>,
    auth: ClientAuth,
    ApiPath(at): AttemptPath,
    ApiQuery(q): ApiQuery<WaitQuery>,
) -> Result<Response, ServerError> {
    wait_for(&state, &auth.id, at, q.wait_ms, SecAggRound::unmask_request).await
}

#[utoipa::path(post, path = "/v1/tasks/{task}/secagg/{round}/{attempt}/unmask", tag = "secure aggregation",
    params(("task" = String, Path), ("round" = u64, Path), ("attempt" = u32, Path)), request_body = SecAggUnmask,
    security(("client_credentials" = [])),
    responses((status = 200, body = SecAggReceipt), (status = 400, body = ApiError, description = "a share not asked for, of the wrong kind, or two for one peer"),
        (status = 409, body = ApiError, description = "no round open, not selected, stage closed, dropped out, other shares sent")))]
pub async fn unmask(
    State(state): State<Shared>,
    auth: ClientAuth,
    ApiPath(at): AttemptPath,
    ApiJson(answer): ApiJson<SecAggUnmask>,
) -> Result<Json<SecAggReceipt>, ServerError> {
    let client = auth.id.clone();
    submit(&state, &auth.id, at, move |s, store| {
        s.unmask(store, &client, answer)
    })
    .await
}
