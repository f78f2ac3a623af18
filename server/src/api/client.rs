//! The client API (`/v1`): enrol, poll (long poll), join a round, download the model (and the
//! TorchScript module), upload a sealed update.

use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::header::{
    ACCEPT_RANGES, AUTHORIZATION, CONTENT_LENGTH, CONTENT_RANGE, CONTENT_TYPE, ETAG, IF_RANGE,
    RANGE,
};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use hora_common::wire::{
    ApiError, Credentials, EnrolRequest, ErrorCode, EvaluationReceipt, EvaluationReport,
    JoinResponse, PollResponse, UpdateMeta, UpdateReceipt,
};
use serde::Deserialize;

use super::{
    declared_length, json_body, not_modified, read_upload, ApiPath, ApiQuery, ClientAuth, Shared,
    Unverified,
};
use crate::auth;
use crate::error::ServerError;
use crate::round::{now_ms, too_large_hint, upload_limit, UpdateBody};
use crate::store::ClientRecord;

/// Header carrying an update's [`UpdateMeta`] as JSON (the body is the sealed envelope).
pub const UPDATE_META_HEADER: &str = "x-hora-update";

pub fn routes() -> axum::Router<Shared> {
    Router::new()
        .route("/v1/enrol", post(enrol))
        .route("/v1/tasks/{task}/poll", get(poll))
        .route("/v1/tasks/{task}/join", post(join))
        .route("/v1/tasks/{task}/model", get(model))
        .route("/v1/tasks/{task}/module", get(module))
        .route("/v1/tasks/{task}/rounds/{round}/update", post(update))
}

/// Evaluation reports: the leader's alone (they change the task's record).
pub fn evaluation_routes() -> Router<Shared> {
    Router::new().route("/v1/tasks/{task}/evaluations/{round}", post(evaluation))
}

#[utoipa::path(post, path = "/v1/enrol", tag = "client", request_body = EnrolRequest,
    security(("enrolment_token" = [])),
    responses((status = 200, body = Credentials),
        (status = 400, body = ApiError, description = "`bad_request`: a malformed body, a label over 256 bytes, an identity key that is not 32 bytes of hex"),
        (status = 401, body = ApiError, description = "`missing_credentials` or `unauthorized`: no, an unknown, a used or an expired enrolment token (checked before the body is read)")))]
pub async fn enrol(
    State(state): State<Shared>,
    unverified: Unverified,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<Credentials>, ServerError> {
    let token = auth::bearer(headers.get(AUTHORIZATION))?;
    let token_hash = auth::hash_secret(token);
    // The id a client that brings its own secret gets: derived from the token, so that a repeat
    // of a lost answer finds the client the first request made.
    let derived_id = format!(
        "c-{}",
        &hora_common::sha256_hex(format!("hora-client-id\0{token}").as_bytes())[..16]
    );
    // The token is checked before a byte of the body is read, and spent only in the transaction
    // that creates the client: a malformed request, a crash or a lost answer before then leaves
    // it usable.
    let (me, hash, id) = (state.clone(), token_hash.clone(), derived_id.clone());
    let (enrolment, enrolled) = tokio::task::spawn_blocking(move || {
        let store = me.coordinator.store();
        let enrolment = store.enrolment(&hash)?;
        let enrolled = match enrolment {
            Some(_) => None,
            None => store.client(&id)?,
        };
        Ok::<_, ServerError>((enrolment, enrolled))
    })
    .await
    .map_err(ServerError::internal)??;
    let spent = || {
        ServerError::Unauthorized(
            "unknown or already used enrolment token: ask the operator for a new one".into(),
        )
    };
    // A spent token reads a body again only for a repeat soon after its enrolment.
    let enrolled = enrolled.filter(|c| {
        !c.revoked && now_ms().saturating_sub(c.enrolled_unix_ms) < REPEAT_ENROLMENT_MS
    });
    if enrolment.is_none() && enrolled.is_none() {
        return Err(spent());
    }
    if enrolment
        .as_ref()
        .is_some_and(|e| e.expires_unix_ms < now_ms())
    {
        return Err(ServerError::Unauthorized(
            "the enrolment token has expired: ask the operator for a new one".into(),
        ));
    }
    // A live token, or the spent token of a recent enrolment whose repeat the body may be.
    unverified.passed();
    let req: EnrolRequest = json_body(&state, &headers, body).await?;
    if let Some(secret) = &req.secret {
        if secret.len() != 64
            || !secret
                .bytes()
                .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        {
            return Err(ServerError::BadRequest(
                "secret must be 64 lowercase hex digits (32 bytes from a cryptographic RNG)".into(),
            ));
        }
    }
    if let Some(client) = enrolled {
        return repeat(&state, &req, derived_id, client).await;
    }
    let record = enrolment.ok_or_else(spent)?;
    if req.label.as_ref().is_some_and(|l| l.len() > 256) {
        return Err(ServerError::BadRequest(
            "label must be at most 256 bytes".into(),
        ));
    }
    if let Some(key) = &req.identity_key {
        hora_common::secagg::hex_array::<32>("identity_key", key)
            .map_err(|e| ServerError::BadRequest(e.to_string()))?;
    }
    let (client_id, secret) = match req.secret {
        Some(secret) => (derived_id, secret),
        None => (
            format!("c-{}", &auth::new_secret()?[..16]),
            auth::new_secret()?,
        ),
    };
    let client = ClientRecord {
        secret_hash: auth::hash_secret(&secret),
        label: req.label,
        enrolled_unix_ms: now_ms(),
        revoked: false,
        identity_key: req.identity_key,
        tasks: record.tasks,
        aggregator: record.aggregator,
        max_contributors: record.max_contributors,
        strikes: 0,
        quarantined: None,
    };
    let asked = (client.label.clone(), client.identity_key.clone());
    let (me, id) = (state.clone(), client_id.clone());
    let spent_now = tokio::task::spawn_blocking(move || {
        let store = me.coordinator.store();
        let spent = store.enrol(&token_hash, &id, &client)?;
        store.flush()?;
        Ok::<_, ServerError>(spent)
    })
    .await
    .map_err(ServerError::internal)??;
    if spent_now.is_none() {
        // Spent meanwhile: by a concurrent repeat of this very enrolment (answer it as one), or
        // by another request.
        let (me, id) = (state.clone(), client_id.clone());
        let made = tokio::task::spawn_blocking(move || me.coordinator.store().client(&id))
            .await
            .map_err(ServerError::internal)??;
        return match made {
            Some(made) => {
                let req = EnrolRequest {
                    secret: Some(secret),
                    label: asked.0,
                    identity_key: asked.1,
                };
                repeat(&state, &req, client_id, made).await
            }
            None => Err(ServerError::Unauthorized(
                "the enrolment token was used by another request meanwhile: ask the operator for a new one".into(),
            )),
        };
    }
    tracing::info!(client = %client_id, "client enrolled");
    Ok(Json(Credentials { client_id, secret }))
}

/// How long after an enrolment a repeat of it (its answer was lost) is answered.
const REPEAT_ENROLMENT_MS: u64 = 60 * 60 * 1000;

/// A repeat of the enrolment that made `client` (`id`, derived from the token): the same
/// secret, label and identity key get the same credentials, once they are durable; anything
/// else is refused.
async fn repeat(
    state: &Shared,
    req: &EnrolRequest,
    id: String,
    client: ClientRecord,
) -> Result<Json<Credentials>, ServerError> {
    let Some(secret) = req
        .secret
        .clone()
        .filter(|s| auth::verify_secret(s, &client.secret_hash))
    else {
        return Err(ServerError::Unauthorized(
            "unknown or already used enrolment token: ask the operator for a new one".into(),
        ));
    };
    if req.label != client.label || req.identity_key != client.identity_key {
        return Err(ServerError::BadRequest(format!(
            "this enrolment already made client `{id}` with another label or identity key: repeat it unchanged, or ask the operator for a new token"
        )));
    }
    // The first request may still be flushing (or have failed to): durable before answering.
    let me = state.clone();
    tokio::task::spawn_blocking(move || me.coordinator.store().flush())
        .await
        .map_err(ServerError::internal)??;
    Ok(Json(Credentials {
        client_id: id,
        secret,
    }))
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct PollQuery {
    /// Answer as soon as a round later than this one is open.
    after: Option<u64>,
    /// With `after`: answer as soon as an attempt of round `after` later than this one is open
    /// too (the client dealt with this attempt; a retry of the round wants its update again).
    attempt: Option<u32>,
    /// The last round whose evaluation the client dealt with: an evaluation of a later round
    /// answers the poll at once too (absent: evaluations never do).
    evaluated: Option<u64>,
    /// How long to hold the request open (capped by the server: the answer's `max_wait_ms`).
    #[serde(default)]
    wait_ms: u64,
}

#[utoipa::path(get, path = "/v1/tasks/{task}/poll", tag = "client", params(("task" = String, Path), PollQuery),
    security(("client_credentials" = [])),
    responses((status = 200, body = PollResponse, description = "the task's state, once a round later than `after` is open, an evaluation of a round later than `evaluated` asks this client, the task stops, or `wait_ms` passes")))]
pub async fn poll(
    State(state): State<Shared>,
    auth: ClientAuth,
    ApiPath(task): ApiPath<String>,
    ApiQuery(q): ApiQuery<PollQuery>,
) -> Result<Json<PollResponse>, ServerError> {
    let task = state.coordinator.task(&task)?;
    Ok(Json(
        state
            .coordinator
            .poll(
                task,
                &auth.id,
                (q.after, q.attempt),
                q.evaluated,
                Duration::from_millis(q.wait_ms),
            )
            .await,
    ))
}

#[utoipa::path(post, path = "/v1/tasks/{task}/join", tag = "client", params(("task" = String, Path)),
    security(("client_credentials" = [])),
    responses((status = 200, body = JoinResponse, description = "an offer, or when to come back"),
        (status = 409, body = ApiError, description = "`task_ended`: the task is stopped or finished; or the round cannot take this client"),
        (status = 503, body = ApiError, description = "`not_durable_yet` or `request_timeout`: the selection could not be made durable in time (join again)")))]
pub async fn join(
    State(state): State<Shared>,
    auth: ClientAuth,
    ApiPath(task): ApiPath<String>,
) -> Result<Json<JoinResponse>, ServerError> {
    let task = state.coordinator.task(&task)?;
    let mut joined = state.coordinator.join(&task, &auth.id).await?;
    // Sealed updates may come in chunks when the server takes them (secure aggregation's
    // stages have their own bodies).
    if let Some(offer) = joined.offer.as_mut() {
        if offer.secure_aggregation.is_none() {
            offer.upload_chunk_bytes = state.limits.chunking.as_ref().map(|c| c.chunk_bytes);
        }
    }
    Ok(Json(joined))
}

#[utoipa::path(post, path = "/v1/tasks/{task}/evaluations/{round}", tag = "client",
    params(("task" = String, Path), ("round" = u64, Path, description = "the round (version) whose published model was evaluated")),
    request_body = EvaluationReport, security(("client_credentials" = [])),
    responses((status = 200, body = EvaluationReceipt, description = "the report is durable and counted (a repeat of one counted already is answered the same)"),
        (status = 400, body = ApiError, description = "`bad_request`: no examples, a loss outside 0 to 1e9, an accuracy outside 0 to 1, or neither"),
        (status = 403, body = ApiError, description = "`forbidden`: this client is not asked (it trained the round and the task evaluates on held-out clients, or it was not drawn)"),
        (status = 409, body = ApiError, description = "`evaluation_closed`: that round's evaluation is not taking reports (complete, past its deadline, the next one began, or never asked for)")))]
pub async fn evaluation(
    State(state): State<Shared>,
    auth: ClientAuth,
    ApiPath((task, round)): ApiPath<(String, u64)>,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<EvaluationReceipt>, ServerError> {
    let task = state.coordinator.task(&task)?;
    let report: EvaluationReport = json_body(&state, &headers, body).await?;
    // Refusals from the record in memory (never held across I/O), before a report takes one
    // of the task's few places on blocking threads, where it may wait for a close.
    crate::round::evaluation::admission(&task.id, &task.record(), &auth.id, round)?;
    let coordinator = state.coordinator.clone();
    let waiting = task.lock_waiter().await;
    let receipt = crate::blocking(move || {
        let _waiting = waiting;
        coordinator.report_evaluation(&task, &auth.id, round, &report)
    })
    .await?;
    Ok(Json(receipt))
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ModelQuery {
    /// The digest (hex) of the model the client's offer names: the current global model, or in
    /// an asynchronous task one of the versions updates may still be trained from.
    #[param(pattern = "^[0-9a-f]{64}$")]
    digest: Option<String>,
}

#[utoipa::path(get, path = "/v1/tasks/{task}/model", tag = "client", params(("task" = String, Path), ModelQuery),
    security(("client_credentials" = [])),
    responses((status = 200, body = inline(super::doc::Binary), content_type = "application/octet-stream",
            description = "the global model (safetensors), or the one `digest` names; ETag is its digest"),
        (status = 206, body = inline(super::doc::Binary), content_type = "application/octet-stream",
            description = "the bytes `Range: bytes=FIRST-[LAST]` asks for, when they are within the model and `If-Range`, if sent, names its digest: the rest of a download that broke off"),
        (status = 304, description = "unchanged: `If-None-Match` names the digest"),
        (status = 409, body = ApiError, description = "`round_closed`: the model `digest` names is no longer handed out (the task moved on); poll and join again"),
        (status = 410, body = ApiError, description = "`model_pruned`: the model `digest` names was removed by the retention policy")))]
pub async fn model(
    State(state): State<Shared>,
    _auth: ClientAuth,
    ApiPath(task): ApiPath<String>,
    ApiQuery(q): ApiQuery<ModelQuery>,
    headers: HeaderMap,
) -> Result<Response, ServerError> {
    let task = state.coordinator.task(&task)?;
    let digest = match q.digest {
        None => task.global_model(),
        Some(hex) => {
            // Whether the model is still stored is a head request: off the runtime's workers.
            let me = state.clone();
            crate::blocking(move || me.coordinator.served_model(&task, &hex)).await?
        }
    };
    model_response(&state, digest, &headers).await
}

pub(crate) async fn model_response(
    state: &Shared,
    digest: hora_common::model::ModelDigest,
    headers: &HeaderMap,
) -> Result<Response, ServerError> {
    let me = state.clone();
    blob_response(&digest.to_hex(), headers, true, move |range| {
        Ok(me.coordinator.store().model_stream(&digest, range)?)
    })
    .await
}

/// A blob as the response, streamed from the blob store (concurrent downloads cost a buffer
/// each, not a blob each), with `etag` as its strong ETag; 304 when the client has it. `open`
/// opens the stream, on a blocking thread (a request to an object store, or a file to open),
/// given the byte range the request asks for ([`requested_range`]) when it serves `ranges`:
/// what it opens is partial (206, with its `Content-Range`) when the range was within the
/// blob, else whole (200).
async fn blob_response(
    etag: &str,
    headers: &HeaderMap,
    ranges: bool,
    open: impl FnOnce(Option<(u64, Option<u64>)>) -> Result<crate::store::blobs::BlobStream, ServerError>
        + Send
        + 'static,
) -> Result<Response, ServerError> {
    if not_modified(headers, etag) {
        return Ok(StatusCode::NOT_MODIFIED.into_response());
    }
    let range = requested_range(headers, etag).filter(|_| ranges);
    let blob = crate::blocking(move || open(range)).await?;
    let mut response = (
        [
            (CONTENT_TYPE, "application/octet-stream".to_string()),
            (ETAG, format!("\"{etag}\"")),
            (CONTENT_LENGTH, blob.len.to_string()),
            (
                ACCEPT_RANGES,
                if ranges { "bytes" } else { "none" }.to_string(),
            ),
        ],
        Body::from_stream(blob.stream),
    )
        .into_response();
    if let Some((start, _)) = range.filter(|_| blob.len < blob.total) {
        *response.status_mut() = StatusCode::PARTIAL_CONTENT;
        let end = start + blob.len.saturating_sub(1);
        let value = format!("bytes {start}-{end}/{}", blob.total);
        if let Ok(value) = axum::http::HeaderValue::from_str(&value) {
            response.headers_mut().insert(CONTENT_RANGE, value);
        }
    }
    Ok(response)
}

/// The byte range `Range: bytes=FIRST-[LAST]` asks for, if the request has one range of that
/// form and its `If-Range`, if any, names `etag` (the blob the client has the start of). Any
/// other range is ignored: the answer is the whole blob.
fn requested_range(headers: &HeaderMap, etag: &str) -> Option<(u64, Option<u64>)> {
    let if_range = headers.get(IF_RANGE).map(|v| v.to_str().unwrap_or(""));
    if if_range.is_some_and(|v| v.trim().trim_matches('"') != etag) {
        return None;
    }
    let spec = headers
        .get(RANGE)?
        .to_str()
        .ok()?
        .trim()
        .strip_prefix("bytes=")?;
    let (first, last) = spec.split_once('-')?;
    let first = first.trim().parse().ok()?;
    let last = match last.trim() {
        "" => None,
        last => Some(last.parse().ok()?),
    };
    Some((first, last))
}

#[utoipa::path(get, path = "/v1/tasks/{task}/module", tag = "client", params(("task" = String, Path)),
    security(("client_credentials" = [])),
    responses((status = 200, body = inline(super::doc::Binary), content_type = "application/octet-stream",
            description = "the task's TorchScript module; ETag is its digest"),
        (status = 304, description = "unchanged: `If-None-Match` names the module's digest"),
        (status = 404, body = ApiError, description = "`not_found`: no such task, or the task uses a built-in model")))]
pub async fn module(
    State(state): State<Shared>,
    _auth: ClientAuth,
    ApiPath(task): ApiPath<String>,
    headers: HeaderMap,
) -> Result<Response, ServerError> {
    let task = state.coordinator.task(&task)?;
    let digest = task.module_digest().ok_or_else(|| {
        ServerError::NotFound(format!(
            "task `{}` uses a built-in model, not a TorchScript module",
            task.id
        ))
    })?;
    let me = state.clone();
    let hex = digest.clone();
    blob_response(&digest, &headers, false, move |_| {
        Ok(me.coordinator.store().module_stream(&hex)?)
    })
    .await
}

#[utoipa::path(post, path = "/v1/tasks/{task}/rounds/{round}/update", tag = "client",
    params(("task" = String, Path), ("round" = u64, Path), ("x-hora-update" = String, Header, description = "UpdateMeta as JSON")),
    request_body(content = inline(super::doc::Binary), content_type = "application/octet-stream", description = "the sealed envelope of the safetensors delta"),
    security(("client_credentials" = [])),
    responses(
        (status = 200, body = UpdateReceipt, description = "folded and durable"),
        (status = 400, body = ApiError, description = "a malformed path or `x-hora-update` header; `invalid_update`: a bad envelope, names, shapes, dtypes or values"),
        (status = 403, body = ApiError, description = "`forbidden`: the `x-hora-update` header says the update stands for several clients (`contributors`) and this client is not enrolled as a regional aggregator, or for more than its enrolment's `max_contributors`"),
        (status = 408, body = ApiError, description = "`upload_too_slow`: the body arrived too slowly"),
        (status = 409, body = ApiError, description = "wrong, closed or abandoned round; not selected; already uploaded; `too_stale`: an asynchronous task's update trained from a version more than `max_staleness` behind; `upload_in_progress`: another upload of this client to this round is being read"),
        (status = 411, body = ApiError, description = "`length_required`: no `Content-Length`"),
        (status = 413, body = ApiError, description = "`payload_too_large`: over the task's update size"),
        (status = 503, body = ApiError, description = "`not_durable_yet`: the update could not be made durable in time, or `shutting_down`: the server is shutting down (retry the upload); `store_unavailable`: the update was taken but its checkpoint cannot be written now, or the store is down (retry the same upload); `standby`: this replica stands by (send it to another); `busy`: no room to read the body within the body wait (retry later); `request_timeout`: the server gave up on the request")))]
pub async fn update(
    State(state): State<Shared>,
    auth: ClientAuth,
    ApiPath((task, round)): ApiPath<(String, u64)>,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<UpdateReceipt>, ServerError> {
    let result: Result<UpdateReceipt, ServerError> = async {
        let task = state.coordinator.task(&task)?;
        let meta = update_meta(&headers, &auth)?;
        // Cheap checks before the body is read at all. The length comes before the claim on
        // this client's upload slot: a body refused unread is dropped (its stream reset) at
        // once, and the client, told so, may send its next upload before this handler ends.
        let record = task.record();
        let limit = upload_limit(&record.spec, record.config.compression.as_ref());
        declared_length(&headers, limit).map_err(|e| e.hinted(too_large_hint(&record)))?;
        // A retry of an update that is folded but not yet durable gets its receipt once it is,
        // without sending the body again.
        let _in_flight = state.uploads.begin(&task.id, &auth.id)?;
        if let Some(receipt) = state
            .coordinator
            .pending_receipt(&task, &auth.id, round)
            .await?
        {
            return Ok(receipt);
        }
        let within = Duration::from_secs(task.record().config.round_deadline_secs);
        let (body, permit) = read_upload(&state, &headers, body, limit, within).await?;
        let len = body.len() as u64;
        let receipt = state
            .coordinator
            .upload(
                task,
                auth.id.clone(),
                round,
                meta,
                UpdateBody::Sealed(body),
                permit,
            )
            .await?;
        state.coordinator.metrics.upload_bytes.inc_by(len);
        Ok(receipt)
    }
    .await;
    settled(&state, &auth.id, round, result).await.map(Json)
}

/// The [`UpdateMeta`] of the `x-hora-update` header, which may say the update stands for
/// several clients only if `auth` is a regional aggregator.
pub(crate) fn update_meta(
    headers: &HeaderMap,
    auth: &ClientAuth,
) -> Result<UpdateMeta, ServerError> {
    let meta: UpdateMeta = headers
        .get(UPDATE_META_HEADER)
        .and_then(|v| v.to_str().ok())
        .ok_or_else(|| {
            ServerError::BadRequest(format!(
                "missing the `{UPDATE_META_HEADER}` header (UpdateMeta as JSON)"
            ))
        })
        .and_then(|v| {
            serde_json::from_str(v).map_err(|e| {
                ServerError::BadRequest(format!("malformed `{UPDATE_META_HEADER}` header: {e}"))
            })
        })?;
    let claimed = meta.contributors();
    if claimed > 1 && !auth.aggregator {
        return Err(ServerError::Forbidden(format!(
            "client `{}` is not enrolled as a regional aggregator, so its update stands for one client (contributors {claimed}): enrol the aggregating server with an aggregator enrolment (`hora-server admin enrol --aggregator`)",
            auth.id,
        )));
    }
    if let Some(cap) = auth.max_contributors.filter(|&cap| claimed > cap) {
        return Err(ServerError::Forbidden(format!(
            "client `{}` aggregates for at most {cap} clients (its enrolment's max_contributors), but this update says it stands for {claimed}: enrol the aggregating server again with a larger --max-contributors if its region grew",
            auth.id,
        )));
    }
    Ok(meta)
}

/// An upload's outcome, counted: the metrics, the log line of a refusal, and the client's
/// strikes (an invalid or out-of-bounds update counts one, an accepted one starts again).
pub(crate) async fn settled(
    state: &Shared,
    client: &str,
    round: u64,
    result: Result<UpdateReceipt, ServerError>,
) -> Result<UpdateReceipt, ServerError> {
    match &result {
        Ok(_) => {
            state.coordinator.metrics.uploads_accepted.inc();
            // (A refusal may have been counted since this request was authenticated.)
            strikes(state, client, None).await;
        }
        Err(e) => {
            state.coordinator.metrics.upload_rejected(e.code().as_str());
            tracing::info!(client, round, code = e.code().as_str(), error = ?e.to_string(), "update refused");
            if matches!(
                e.code(),
                ErrorCode::InvalidUpdate | ErrorCode::UpdateNormExceeded
            ) {
                strikes(state, client, Some(e)).await;
            }
        }
    }
    result
}

/// Counts an update refused as invalid or out of bounds against its client (`refused`), or
/// starts the count again after an accepted one (None): see [`crate::round::strikes`].
pub(crate) async fn strikes(state: &Shared, client: &str, refused: Option<&ServerError>) {
    let (me, id) = (state.coordinator.clone(), client.to_string());
    let why = refused.map(|e| format!("update refused: {e}"));
    let _ = crate::blocking(move || {
        me.strike(&id, why.as_deref());
        Ok(())
    })
    .await;
}
