//! The admin API (`/admin/v1`, bearer admin token): models and modules, tasks and their
//! lifecycle, round history and models, enrolment tokens, clients, and sync jobs (the
//! synchronous allreduce jobs whose workers meet at [`crate::rendezvous`]).

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use hora_common::model::{Limits, ModelView};
use hora_common::wire::{
    ApiError, ClientInfo, CreateEnrolment, CreateSyncJob, CreateTask, EnrolmentToken,
    ModelUploaded, ModuleUploaded, RoundRecord, SyncJobInfo, TaskInfo, TaskState,
};

use super::client::model_response;
use super::{spool_body, AdminAuth, ApiJson, ApiPath, ApiQuery, Shared};
use crate::auth;
use crate::error::ServerError;
use crate::round::now_ms;
use crate::round::upload::MAX_CONTRIBUTORS;
use crate::store::EnrolmentRecord;

pub fn routes() -> axum::Router<Shared> {
    Router::new()
        .route("/admin/v1/models", post(upload_model))
        .route("/admin/v1/modules", post(upload_module))
        .route("/admin/v1/tasks", post(create_task).get(list_tasks))
        .route("/admin/v1/tasks/{task}", get(get_task))
        .route("/admin/v1/tasks/{task}/pause", post(pause))
        .route("/admin/v1/tasks/{task}/resume", post(resume))
        .route("/admin/v1/tasks/{task}/stop", post(stop))
        .route("/admin/v1/tasks/{task}/rounds", get(rounds))
        .route(
            "/admin/v1/tasks/{task}/rounds/{round}/model",
            get(round_model),
        )
        .route("/admin/v1/tasks/{task}/base", get(frozen_base))
        .route("/admin/v1/enrolments", post(create_enrolment))
        .route("/admin/v1/clients", get(list_clients))
        .route("/admin/v1/clients/{client}/revoke", post(revoke_client))
        .route("/admin/v1/clients/{client}/release", post(release_client))
        .route(
            "/admin/v1/sync-jobs",
            post(create_sync_job).get(list_sync_jobs),
        )
        .route("/admin/v1/sync-jobs/{id}", delete(delete_sync_job))
}

#[utoipa::path(post, path = "/admin/v1/models", tag = "admin", security(("admin_token" = [])),
    request_body(content = inline(super::doc::Binary), content_type = "application/octet-stream", description = "safetensors (f32, f16 or bf16)"),
    responses((status = 201, body = ModelUploaded),
        (status = 400, body = ApiError, description = "`bad_request`: not a safetensors file of finite f32, f16 or bf16 tensors"),
        (status = 411, body = ApiError, description = "`length_required`: no `Content-Length`"),
        (status = 413, body = ApiError, description = "`payload_too_large`: over the model size limit")))]
pub async fn upload_model(
    State(state): State<Shared>,
    _a: AdminAuth,
    headers: HeaderMap,
    body: Body,
) -> Result<(StatusCode, Json<ModelUploaded>), ServerError> {
    let file = spool_body(
        &headers,
        body,
        state.limits.max_model_bytes,
        &state.limits.body_rate,
        &state.limits.spool_dir,
    )
    .await?;
    let store = state.coordinator.clone();
    crate::blocking(move || {
        let bytes = map(&file)?;
        let limits = Limits {
            max_bytes: state.limits.max_model_bytes,
            ..Limits::default()
        };
        let view = ModelView::parse(&bytes, &limits)
            .map_err(|e| ServerError::BadRequest(e.to_string()))?;
        view.check_finite()
            .map_err(|e| ServerError::BadRequest(e.to_string()))?;
        // f32 files are stored as sent (no copy); f16/bf16 are widened to f32 once, here.
        let (digest, spec) = match view.digest() {
            Some(digest) => {
                let spec = view.spec();
                drop(view);
                store.store().put_model_bytes(&digest, &bytes)?;
                (digest, spec)
            }
            None => {
                let model = view.to_model();
                (store.store().put_model(&model)?, model.spec())
            }
        };
        Ok((StatusCode::CREATED, Json(ModelUploaded { digest, spec })))
    })
    .await
}

/// A read-only mapping of a spooled body: read as the checks and the blob store's writer need
/// it, never copied into memory whole. Blocking.
fn map(file: &std::fs::File) -> Result<memmap2::Mmap, ServerError> {
    // SAFETY: the file is an unnamed one this request made ([`spool_body`]): nothing else can
    // open it, let alone change it while it is mapped.
    unsafe { memmap2::Mmap::map(file) }
        .map_err(|e| ServerError::internal(format!("mapping a spooled body: {e}")))
}

#[utoipa::path(post, path = "/admin/v1/modules", tag = "admin", security(("admin_token" = [])),
    request_body(content = inline(super::doc::Binary), content_type = "application/octet-stream", description = "a TorchScript module (torch.jit.save)"),
    responses((status = 201, body = ModuleUploaded),
        (status = 400, body = ApiError, description = "`bad_request`: not the zip archive torch.jit.save writes"),
        (status = 411, body = ApiError, description = "`length_required`: no `Content-Length`"),
        (status = 413, body = ApiError, description = "`payload_too_large`: over the model size limit")))]
pub async fn upload_module(
    State(state): State<Shared>,
    _a: AdminAuth,
    headers: HeaderMap,
    body: Body,
) -> Result<(StatusCode, Json<ModuleUploaded>), ServerError> {
    let file = spool_body(
        &headers,
        body,
        state.limits.max_model_bytes,
        &state.limits.body_rate,
        &state.limits.spool_dir,
    )
    .await?;
    // Hashing and writing up to the model size limit: on a blocking thread.
    let me = state.clone();
    let digest = crate::blocking(move || {
        let bytes = map(&file)?;
        // TorchScript archives are zip files.
        if !bytes.starts_with(b"PK\x03\x04") {
            return Err(ServerError::BadRequest(
                "not a TorchScript module (expected the zip archive torch.jit.save writes)".into(),
            ));
        }
        Ok(me.coordinator.store().put_module(&bytes)?)
    })
    .await?;
    Ok((StatusCode::CREATED, Json(ModuleUploaded { digest })))
}

#[utoipa::path(post, path = "/admin/v1/tasks", tag = "admin", security(("admin_token" = [])), request_body = CreateTask,
    responses((status = 201, body = TaskInfo),
        (status = 400, body = ApiError, description = "`bad_request`: a malformed body, settings out of range (min_clients above target_clients, …), or no uploaded model or module with the digest named"),
        (status = 409, body = ApiError, description = "`task_exists`: a task with this id exists")))]
pub async fn create_task(
    State(state): State<Shared>,
    _a: AdminAuth,
    ApiJson(config): ApiJson<CreateTask>,
) -> Result<(StatusCode, Json<TaskInfo>), ServerError> {
    let coordinator = state.coordinator.clone();
    let info = tokio::task::spawn_blocking(move || coordinator.create_task(config))
        .await
        .map_err(ServerError::internal)??;
    Ok((StatusCode::CREATED, Json(info)))
}

#[utoipa::path(get, path = "/admin/v1/tasks", tag = "admin", security(("admin_token" = [])),
    responses((status = 200, body = Vec<TaskInfo>)))]
pub async fn list_tasks(State(state): State<Shared>, _a: AdminAuth) -> Json<Vec<TaskInfo>> {
    Json(state.coordinator.list())
}

#[utoipa::path(get, path = "/admin/v1/tasks/{task}", tag = "admin", security(("admin_token" = [])), params(("task" = String, Path)),
    responses((status = 200, body = TaskInfo)))]
pub async fn get_task(
    State(state): State<Shared>,
    _a: AdminAuth,
    ApiPath(task): ApiPath<String>,
) -> Result<Json<TaskInfo>, ServerError> {
    let task = state.coordinator.task(&task)?;
    Ok(Json(state.coordinator.info(&task)))
}

async fn set_state(
    state: Shared,
    task: String,
    to: TaskState,
) -> Result<Json<TaskInfo>, ServerError> {
    let task = state.coordinator.task(&task)?;
    Ok(Json(state.coordinator.set_state(task, to).await?))
}

#[utoipa::path(post, path = "/admin/v1/tasks/{task}/pause", tag = "admin", security(("admin_token" = [])), params(("task" = String, Path)),
    responses((status = 200, body = TaskInfo, description = "joins wait; uploads to the open round are still taken"),
        (status = 409, body = ApiError, description = "`task_ended`: the task is stopped or finished")))]
pub async fn pause(
    State(state): State<Shared>,
    _a: AdminAuth,
    ApiPath(task): ApiPath<String>,
) -> Result<Json<TaskInfo>, ServerError> {
    set_state(state, task, TaskState::Paused).await
}

#[utoipa::path(post, path = "/admin/v1/tasks/{task}/resume", tag = "admin", security(("admin_token" = [])), params(("task" = String, Path)),
    responses((status = 200, body = TaskInfo), (status = 409, body = ApiError, description = "`task_ended`: the task is stopped or finished")))]
pub async fn resume(
    State(state): State<Shared>,
    _a: AdminAuth,
    ApiPath(task): ApiPath<String>,
) -> Result<Json<TaskInfo>, ServerError> {
    set_state(state, task, TaskState::Running).await
}

#[utoipa::path(post, path = "/admin/v1/tasks/{task}/stop", tag = "admin", security(("admin_token" = [])), params(("task" = String, Path)),
    responses((status = 200, body = TaskInfo, description = "the open round is abandoned; the task ends"),
        (status = 409, body = ApiError, description = "`task_ended`: the task is stopped or finished")))]
pub async fn stop(
    State(state): State<Shared>,
    _a: AdminAuth,
    ApiPath(task): ApiPath<String>,
) -> Result<Json<TaskInfo>, ServerError> {
    set_state(state, task, TaskState::Stopped).await
}

/// The largest page of round history one request gets.
const MAX_ROUNDS_PAGE: u32 = 10_000;

#[derive(Debug, serde::Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct RoundsQuery {
    /// Only rounds after this one (every attempt of each).
    #[serde(default)]
    after: u64,
    /// At most this many entries (at most 10,000), oldest first: a page, read without the rest
    /// of the history. Without it, the whole history.
    limit: Option<u32>,
}

#[utoipa::path(get, path = "/admin/v1/tasks/{task}/rounds", tag = "admin", security(("admin_token" = [])),
    params(("task" = String, Path), RoundsQuery),
    responses((status = 200, body = Vec<RoundRecord>, description = "the round history (every attempt), oldest first; a page with `after` and `limit`")))]
pub async fn rounds(
    State(state): State<Shared>,
    _a: AdminAuth,
    ApiPath(task): ApiPath<String>,
    ApiQuery(q): ApiQuery<RoundsQuery>,
) -> Result<Json<Vec<RoundRecord>>, ServerError> {
    let task = state.coordinator.task(&task)?;
    let limit = q
        .limit
        .map_or(usize::MAX, |l| l.min(MAX_ROUNDS_PAGE) as usize);
    let (me, id) = (state.clone(), task.id.clone());
    let page = tokio::task::spawn_blocking(move || {
        me.coordinator.store().history_page(&id, q.after, limit)
    })
    .await
    .map_err(ServerError::internal)??;
    Ok(Json(page))
}

#[utoipa::path(get, path = "/admin/v1/tasks/{task}/rounds/{round}/model", tag = "admin", security(("admin_token" = [])),
    params(("task" = String, Path), ("round" = u64, Path, description = "0 for the initial model")),
    responses((status = 200, body = inline(super::doc::Binary), content_type = "application/octet-stream", description = "safetensors; ETag is its digest"),
        (status = 304, description = "unchanged: `If-None-Match` names the digest"),
        (status = 404, body = ApiError, description = "`not_found`: no such task, or it has not published that round"),
        (status = 410, body = ApiError, description = "`model_pruned`: the round's model was removed by the retention policy (--retain-rounds-last, --retain-rounds-every)")))]
pub async fn round_model(
    State(state): State<Shared>,
    _a: AdminAuth,
    ApiPath((task, round)): ApiPath<(String, u64)>,
    headers: HeaderMap,
) -> Result<Response, ServerError> {
    let task = state.coordinator.task(&task)?;
    let me = state.clone();
    let digest = crate::blocking(move || me.coordinator.round_model(&task, round)).await?;
    model_response(&state, digest, &headers).await
}

#[utoipa::path(get, path = "/admin/v1/tasks/{task}/base", tag = "admin", security(("admin_token" = [])),
    params(("task" = String, Path)),
    responses((status = 200, body = inline(super::doc::Binary), content_type = "application/octet-stream", description = "safetensors: the tensors of the task's model its clients do not train (its rounds' models hold the others); ETag is its digest"),
        (status = 304, description = "unchanged: `If-None-Match` names the digest"),
        (status = 404, body = ApiError, description = "`not_found`: no such task, or it trains every tensor of its model (no `trainable`)")))]
pub async fn frozen_base(
    State(state): State<Shared>,
    _a: AdminAuth,
    ApiPath(task): ApiPath<String>,
    headers: HeaderMap,
) -> Result<Response, ServerError> {
    let task = state.coordinator.task(&task)?;
    let Some(part) = task.record().part else {
        return Err(ServerError::NotFound(format!(
            "task `{}` trains every tensor of its model: it has no frozen base",
            task.id
        )));
    };
    model_response(&state, part.base, &headers).await
}

#[utoipa::path(post, path = "/admin/v1/enrolments", tag = "admin", security(("admin_token" = [])), request_body = CreateEnrolment,
    responses(
        (status = 201, body = EnrolmentToken),
        (status = 400, body = ApiError, description = "`max_contributors` without `aggregator: true`, or a malformed body")))]
pub async fn create_enrolment(
    State(state): State<Shared>,
    _a: AdminAuth,
    ApiJson(req): ApiJson<CreateEnrolment>,
) -> Result<(StatusCode, Json<EnrolmentToken>), ServerError> {
    let ttl = req.ttl_secs.unwrap_or(86_400).clamp(1, 365 * 86_400);
    if let Some(tasks) = &req.tasks {
        if let Some(bad) = tasks.iter().find(|t| !hora_common::wire::valid_id(t)) {
            return Err(ServerError::BadRequest(format!(
                "task id `{bad}` must be 1-64 of [A-Za-z0-9_.-]"
            )));
        }
        if tasks.len() > 1024 {
            return Err(ServerError::BadRequest(
                "an enrolment names at most 1024 tasks".into(),
            ));
        }
    }
    match req.max_contributors {
        Some(_) if !req.aggregator => {
            return Err(ServerError::BadRequest(
                "max_contributors caps an aggregator's updates: give aggregator: true too".into(),
            ))
        }
        Some(cap) if !(2..=MAX_CONTRIBUTORS).contains(&cap) => {
            return Err(ServerError::BadRequest(format!(
                "max_contributors is {cap}; an aggregator's update stands for 2 to {MAX_CONTRIBUTORS} clients"
            )))
        }
        _ => {}
    }
    let token = auth::new_secret()?;
    let expires_unix_ms = now_ms() + ttl * 1000;
    let (me, hash) = (state.clone(), auth::hash_secret(&token));
    crate::blocking(move || {
        let store = me.coordinator.store();
        let record = EnrolmentRecord {
            expires_unix_ms,
            tasks: req.tasks,
            aggregator: req.aggregator,
            max_contributors: req.max_contributors,
        };
        store.put_enrolment(&hash, &record)?;
        Ok(store.flush()?)
    })
    .await?;
    Ok((
        StatusCode::CREATED,
        Json(EnrolmentToken {
            token,
            expires_unix_ms,
        }),
    ))
}

fn client_info(state: &Shared, id: String, c: crate::store::ClientRecord) -> ClientInfo {
    let (last_seen_unix_ms, contributions) = state.coordinator.clients_seen.of(&id);
    ClientInfo {
        tasks: c.tasks,
        aggregator: c.aggregator,
        max_contributors: c.max_contributors,
        last_seen_unix_ms,
        contributions,
        client_id: id,
        label: c.label,
        enrolled_unix_ms: c.enrolled_unix_ms,
        revoked: c.revoked,
        strikes: c.strikes,
        quarantined: c.quarantined.map(|q| q.reason),
    }
}

#[utoipa::path(get, path = "/admin/v1/clients", tag = "admin", security(("admin_token" = [])),
    responses((status = 200, body = Vec<ClientInfo>)))]
pub async fn list_clients(
    State(state): State<Shared>,
    _a: AdminAuth,
) -> Result<Json<Vec<ClientInfo>>, ServerError> {
    let me = state.clone();
    let clients = crate::blocking(move || Ok(me.coordinator.store().clients()?)).await?;
    Ok(Json(
        clients
            .into_iter()
            .map(|(id, c)| client_info(&state, id, c))
            .collect(),
    ))
}

#[utoipa::path(post, path = "/admin/v1/clients/{client}/revoke", tag = "admin", security(("admin_token" = [])), params(("client" = String, Path)),
    responses((status = 200, body = ClientInfo, description = "revoked (revoking twice is harmless)")))]
pub async fn revoke_client(
    State(state): State<Shared>,
    _a: AdminAuth,
    ApiPath(client): ApiPath<String>,
) -> Result<Json<ClientInfo>, ServerError> {
    let info = change_client(state, client.clone(), |c| c.revoked = true).await?;
    tracing::info!(client = %client, "client revoked");
    Ok(info)
}

/// Changes client `client` in place, durably, atomically with any strike counted meanwhile
/// (404 when there is no such client).
async fn change_client(
    state: Shared,
    client: String,
    change: fn(&mut crate::store::ClientRecord),
) -> Result<Json<ClientInfo>, ServerError> {
    let (id, me) = (client.clone(), state.clone());
    let record = crate::blocking(move || {
        let store = me.coordinator.store();
        let record = store
            .update_client(&id, &mut |c| change(c))?
            .ok_or_else(|| ServerError::NotFound(format!("no client `{id}`")))?;
        store.flush()?;
        Ok(record)
    })
    .await?;
    Ok(Json(client_info(&state, client, record)))
}

#[utoipa::path(post, path = "/admin/v1/clients/{client}/release", tag = "admin", security(("admin_token" = [])), params(("client" = String, Path)),
    responses((status = 200, body = ClientInfo, description = "released from quarantine, its strikes cleared (releasing a client that is not quarantined is harmless)"),
        (status = 404, body = ApiError, description = "`not_found`: no such client")))]
pub async fn release_client(
    State(state): State<Shared>,
    _a: AdminAuth,
    ApiPath(client): ApiPath<String>,
) -> Result<Json<ClientInfo>, ServerError> {
    let info = change_client(state, client.clone(), |c| {
        c.quarantined = None;
        c.strikes = 0;
    })
    .await?;
    tracing::info!(client = %client, "client released from quarantine");
    Ok(info)
}

#[utoipa::path(post, path = "/admin/v1/sync-jobs", tag = "admin", security(("admin_token" = [])), request_body = CreateSyncJob,
    responses((status = 201, body = SyncJobInfo, description = "the job, with its worker token (shown once)"),
        (status = 400, body = ApiError, description = "bad id, world_size not in 1..=4096, min_world_size above world_size, or settle_ms without min_world_size"),
        (status = 409, body = ApiError, description = "`sync_job_exists`")))]
pub async fn create_sync_job(
    State(state): State<Shared>,
    _a: AdminAuth,
    ApiJson(req): ApiJson<CreateSyncJob>,
) -> Result<(StatusCode, Json<SyncJobInfo>), ServerError> {
    let info = crate::blocking(move || state.rendezvous.create(req)).await?;
    Ok((StatusCode::CREATED, Json(info)))
}

#[utoipa::path(get, path = "/admin/v1/sync-jobs", tag = "admin", security(("admin_token" = [])),
    responses((status = 200, body = Vec<SyncJobInfo>, description = "every sync job, without tokens")))]
pub async fn list_sync_jobs(State(state): State<Shared>, _a: AdminAuth) -> Json<Vec<SyncJobInfo>> {
    Json(state.rendezvous.list())
}

#[utoipa::path(delete, path = "/admin/v1/sync-jobs/{id}", tag = "admin", security(("admin_token" = [])), params(("id" = String, Path)),
    responses((status = 204, description = "deleted; its waiting workers are answered 410 `job_deleted`")))]
pub async fn delete_sync_job(
    State(state): State<Shared>,
    _a: AdminAuth,
    ApiPath(id): ApiPath<String>,
) -> Result<StatusCode, ServerError> {
    crate::blocking(move || state.rendezvous.delete(&id)).await?;
    Ok(StatusCode::NO_CONTENT)
}
