//! The workers' side of sync jobs (`/v1/sync`): the rendezvous, and an elastic job's status. A
//! worker presents its job's token (not client credentials: the workers of a job are one
//! launcher's processes, not enrolled devices) and is held until its world is complete; see
//! [`crate::rendezvous`].

use axum::body::Body;
use axum::extract::State;
use axum::http::header::AUTHORIZATION;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::{get, post};
use axum::{Json, Router};
use hora_common::wire::{ApiError, SyncJoinRequest, SyncStatus, SyncWorld};

use super::{json_body, ApiPath, Shared, Unverified};
use crate::auth;
use crate::error::ServerError;

pub fn routes() -> axum::Router<Shared> {
    Router::new()
        .route("/v1/sync/{job}/join", post(join))
        .route("/v1/sync/{job}/status", get(status))
        .route("/v1/sync/{job}/finish", post(finish))
}

#[utoipa::path(post, path = "/v1/sync/{job}/finish", tag = "sync", params(("job" = String, Path)),
    security(("sync_job_token" = [])),
    responses(
        (status = 204, description = "the job's training finished (said by its rank 0 once every rank is done): it forms no more worlds, and its waiting and later joins are answered 410 `job_finished`; saying it again changes nothing"),
        (status = 401, body = ApiError, description = "missing or wrong job token, or no such job")))]
pub async fn finish(
    State(state): State<Shared>,
    ApiPath(job): ApiPath<String>,
    unverified: Unverified,
    headers: HeaderMap,
) -> Result<StatusCode, ServerError> {
    let token = auth::bearer(headers.get(AUTHORIZATION))?;
    state.rendezvous.authenticate(&job, token)?;
    unverified.passed();
    crate::blocking(move || state.rendezvous.finish(&job)).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(get, path = "/v1/sync/{job}/status", tag = "sync", params(("job" = String, Path)),
    security(("sync_job_token" = [])),
    responses(
        (status = 200, body = SyncStatus, description = "the job's generation and the workers waiting to join; an elastic job's running world asks at its commits, re-forms to take waiting workers in, and is counted alive while it asks"),
        (status = 401, body = ApiError, description = "missing or wrong job token, or no such job")))]
pub async fn status(
    State(state): State<Shared>,
    ApiPath(job): ApiPath<String>,
    unverified: Unverified,
    headers: HeaderMap,
) -> Result<Json<SyncStatus>, ServerError> {
    let token = auth::bearer(headers.get(AUTHORIZATION))?;
    state.rendezvous.authenticate(&job, token)?;
    unverified.passed();
    state.rendezvous.status(&job).map(Json)
}

#[utoipa::path(post, path = "/v1/sync/{job}/join", tag = "sync", params(("job" = String, Path)),
    request_body = SyncJoinRequest, security(("sync_job_token" = [])),
    responses(
        (status = 200, body = SyncWorld, description = "the world is complete: this worker's rank, and every peer's address by rank"),
        (status = 400, body = ApiError, description = "`world_size_mismatch`, `rank_out_of_range`, `invalid_address`, or a malformed body"),
        (status = 401, body = ApiError, description = "missing or wrong job token, or no such job (the same answer, checked before the body is read)"),
        (status = 408, body = ApiError, description = "`rendezvous_timeout`: the world was still incomplete at the timeout; the message names the ranks that did not join"),
        (status = 409, body = ApiError, description = "`replaced`: a newer worker joined this rank; `rank_taken`: the rank was given to a worker that joined without one"),
        (status = 410, body = ApiError, description = "`job_deleted`: the job was deleted while this worker waited; `job_finished`: its training finished (the job forms no more worlds)")))]
pub async fn join(
    State(state): State<Shared>,
    ApiPath(job): ApiPath<String>,
    unverified: Unverified,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<SyncWorld>, ServerError> {
    let result = async {
        // The job's token, from the headers, before a byte of the body is read.
        let token = auth::bearer(headers.get(AUTHORIZATION))?;
        state.rendezvous.authenticate(&job, token)?;
        unverified.passed();
        let req: SyncJoinRequest = json_body(&state, &headers, body).await?;
        state.rendezvous.join(&job, token, req).await
    }
    .await;
    if let Err(e) = &result {
        // The job id is the caller's text: logged escaped.
        tracing::info!(job = ?job, code = e.code().as_str(), error = ?e.to_string(), "sync join refused");
    }
    result.map(Json)
}

#[cfg(test)]
mod tests {
    //! The routes over the real router, served with real TLS on loopback.

    use std::sync::Arc;
    use std::time::Duration;

    use hora_common::wire::{ErrorCode, SyncJobInfo};
    use reqwest::{Method, StatusCode};

    use super::*;
    use crate::api::{router, AppState, HttpLimits};
    use crate::metrics::ServerMetrics;
    use crate::rendezvous::Rendezvous;
    use crate::round::{Coordinator, CoordinatorConfig};
    use crate::store::SledStore;
    use crate::tls;

    const ADMIN_TOKEN: &str = "test-admin-token";

    struct Server {
        _dir: tempfile::TempDir,
        base: String,
        ca: std::path::PathBuf,
        http: reqwest::Client,
        handle: axum_server::Handle<std::net::SocketAddr>,
    }

    impl Drop for Server {
        fn drop(&mut self) {
            self.handle.shutdown();
        }
    }

    async fn start() -> Server {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(SledStore::open(&dir.path().join("data")).unwrap());
        let metrics = Arc::new(ServerMetrics::default());
        let coordinator =
            Coordinator::open(store.clone(), CoordinatorConfig::default(), metrics.clone())
                .unwrap();
        let state = AppState::new(
            coordinator,
            auth::hash_secret(ADMIN_TOKEN),
            HttpLimits::default(),
            Rendezvous::open(store, metrics).unwrap(),
            crate::dashboard::Dashboard::new(None, "").unwrap(),
        );
        let certs_dir = dir.path().join("certs");
        let certs = tls::make_dev_certs(&certs_dir, &[]).unwrap();
        let tls_config = tls::server_config(&certs, None).unwrap();
        let handle: axum_server::Handle<std::net::SocketAddr> = axum_server::Handle::new();
        let server = axum_server::bind_rustls(
            "127.0.0.1:0".parse().unwrap(),
            axum_server::tls_rustls::RustlsConfig::from_config(Arc::new(tls_config)),
        )
        .handle(handle.clone())
        .serve(router(state).into_make_service());
        tokio::spawn(server);
        let addr = handle.listening().await.expect("the server listens");
        Server {
            http: tls::https_client(&certs_dir.join(tls::CA_CERT), None).unwrap(),
            base: format!("https://localhost:{}", addr.port()),
            ca: certs_dir.join(tls::CA_CERT),
            _dir: dir,
            handle,
        }
    }

    impl Server {
        fn request(&self, method: Method, path: &str, token: &str) -> reqwest::RequestBuilder {
            self.http
                .request(method, format!("{}{path}", self.base))
                .bearer_auth(token)
        }

        async fn create(&self, id: &str, world_size: u32) -> SyncJobInfo {
            let resp = self
                .request(Method::POST, "/admin/v1/sync-jobs", ADMIN_TOKEN)
                .json(&serde_json::json!({ "id": id, "world_size": world_size }))
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status(), StatusCode::CREATED);
            resp.json().await.unwrap()
        }

        async fn jobs(&self) -> Vec<SyncJobInfo> {
            let resp = self
                .request(Method::GET, "/admin/v1/sync-jobs", ADMIN_TOKEN)
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status(), StatusCode::OK);
            resp.json().await.unwrap()
        }

        /// Waits until the (only) job has `n` workers waiting.
        async fn until_waiting(&self, n: u32) {
            let mut waiting = None;
            for _ in 0..250 {
                waiting = self.jobs().await.first().map(|j| j.waiting);
                if waiting == Some(n) {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            panic!("expected {n} workers waiting, not {waiting:?}");
        }

        fn join(&self, job: &str, token: &str, body: serde_json::Value) -> reqwest::RequestBuilder {
            self.request(Method::POST, &format!("/v1/sync/{job}/join"), token)
                .json(&body)
        }
    }

    impl Server {
        /// A join that must be refused: its status and error.
        async fn refused_join(
            &self,
            job: &str,
            token: &str,
            body: serde_json::Value,
        ) -> (StatusCode, ApiError) {
            refusal(self.join(job, token, body).send().await.unwrap()).await
        }
    }

    async fn refusal(resp: reqwest::Response) -> (StatusCode, ApiError) {
        let status = resp.status();
        (status, resp.json().await.unwrap())
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn three_workers_meet_and_learn_one_world() {
        let server = start().await;
        let job = server.create("ring", 3).await;
        let token = job.token.clone().unwrap();
        assert_eq!((job.world_size, job.generations, job.waiting), (3, 0, 0));

        let joins = (0..3).map(|i| {
            let body = serde_json::json!({
                "address": format!("127.0.0.1:{}", 29500 + i),
                "world_size": 3,
            });
            let req = server.join("ring", &token, body);
            async move {
                let resp = req.send().await.unwrap();
                assert_eq!(resp.status(), StatusCode::OK);
                resp.json::<SyncWorld>().await.unwrap()
            }
        });
        let worlds =
            tokio::time::timeout(Duration::from_secs(20), futures_join_all(joins.collect()))
                .await
                .expect("the world formed");
        let mut ranks: Vec<u32> = worlds.iter().map(|w| w.rank).collect();
        ranks.sort_unstable();
        assert_eq!(ranks, [0, 1, 2]);
        for w in &worlds {
            assert_eq!(w.generation, 1);
            assert_eq!(w.world_size, 3);
            assert_eq!(w.session, worlds[0].session);
            assert_eq!(w.peers, worlds[0].peers);
        }
        let mut peers = worlds[0].peers.clone();
        peers.sort();
        assert_eq!(
            peers,
            ["127.0.0.1:29500", "127.0.0.1:29501", "127.0.0.1:29502"]
        );

        let jobs = server.jobs().await;
        assert_eq!(jobs.len(), 1);
        assert_eq!((jobs[0].generations, jobs[0].waiting), (1, 0));
        assert_eq!(jobs[0].token, None, "the token is shown only once");
    }

    /// Awaits every future, concurrently (what `futures::future::join_all` does, without the
    /// dependency).
    async fn futures_join_all<F: std::future::Future + Send + 'static>(
        futures: Vec<F>,
    ) -> Vec<F::Output>
    where
        F::Output: Send + 'static,
    {
        let handles: Vec<_> = futures.into_iter().map(tokio::spawn).collect();
        let mut out = Vec::new();
        for h in handles {
            out.push(h.await.unwrap());
        }
        out
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn bad_joins_and_admin_requests_are_refused() {
        let server = start().await;
        let token = server.create("ring", 4).await.token.unwrap();
        let body = serde_json::json!({ "address": "127.0.0.1:29500", "world_size": 4 });

        let (status, e) = server.refused_join("ring", "wrong", body.clone()).await;
        assert_eq!(
            (status, e.code.as_str()),
            (StatusCode::UNAUTHORIZED, "unauthorized")
        );
        assert!(
            e.message.contains("token printed when the job was created"),
            "{}",
            e.message
        );
        let resp = server
            .http
            .post(format!("{}/v1/sync/ring/join", server.base))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(refusal(resp).await.1.code, ErrorCode::MissingCredentials);

        let wrong_size = serde_json::json!({ "address": "127.0.0.1:29500", "world_size": 2 });
        let (status, e) = server.refused_join("ring", &token, wrong_size).await;
        assert_eq!(
            (status, e.code.as_str()),
            (StatusCode::BAD_REQUEST, "world_size_mismatch")
        );
        assert!(
            e.message.contains("world of 2") && e.message.contains("world of 4"),
            "{}",
            e.message
        );

        // An unknown job answers as a wrong token does (no probing for job ids).
        let (status, e) = server.refused_join("nope", &token, body.clone()).await;
        assert_eq!(
            (status, e.code.as_str()),
            (StatusCode::UNAUTHORIZED, "unauthorized")
        );

        let typo = serde_json::json!({ "adress": "127.0.0.1:29500", "world_size": 4 });
        let (status, _) = server.refused_join("ring", &token, typo).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);

        // The job token is not an admin token.
        let resp = server
            .request(Method::GET, "/admin/v1/sync-jobs", &token)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);
        let resp = server
            .request(Method::POST, "/admin/v1/sync-jobs", ADMIN_TOKEN)
            .json(&serde_json::json!({ "id": "ring", "world_size": 2 }))
            .send()
            .await
            .unwrap();
        assert_eq!(
            refusal(resp).await,
            (
                StatusCode::CONFLICT,
                ApiError {
                    code: ErrorCode::SyncJobExists,
                    message: "sync job `ring` exists already: delete it first or pick another id"
                        .into()
                }
            )
        );
        let resp = server
            .request(Method::POST, "/admin/v1/sync-jobs", ADMIN_TOKEN)
            .json(&serde_json::json!({ "id": "big", "world_size": 5000 }))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn a_worker_that_hangs_up_frees_its_rank_and_delete_ends_waits() {
        let server = start().await;
        let token = server.create("ring", 2).await.token.unwrap();
        let body = serde_json::json!({ "address": "127.0.0.1:29500", "world_size": 2, "rank": 1 });

        // A worker that hangs up mid-wait, over HTTP/2 (a reset stream) and HTTP/1.1 (a closed
        // connection): the server notices and frees the rank.
        let http1 = reqwest::Client::builder()
            .use_preconfigured_tls(hora_common::tls::client_config(&server.ca, None).unwrap())
            .http1_only()
            .build()
            .unwrap();
        for client in [server.http.clone(), http1] {
            let request = client
                .post(format!("{}/v1/sync/ring/join", server.base))
                .bearer_auth(&token)
                .json(&body)
                .send();
            let worker = tokio::spawn(request);
            server.until_waiting(1).await;
            worker.abort();
            assert!(worker.await.unwrap_err().is_cancelled());
            server.until_waiting(0).await;
        }

        let waiter = tokio::spawn(server.join("ring", &token, body).send());
        server.until_waiting(1).await;
        let resp = server
            .request(Method::DELETE, "/admin/v1/sync-jobs/ring", ADMIN_TOKEN)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), StatusCode::NO_CONTENT);
        let (status, e) = refusal(waiter.await.unwrap().unwrap()).await;
        assert_eq!((status, e.code.as_str()), (StatusCode::GONE, "job_deleted"));
        assert!(server.jobs().await.is_empty());
        let resp = server
            .request(Method::DELETE, "/admin/v1/sync-jobs/ring", ADMIN_TOKEN)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), StatusCode::NOT_FOUND);
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn the_openapi_document_describes_the_sync_routes() {
        let server = start().await;
        let doc: serde_json::Value = server
            .http
            .get(format!("{}/openapi.json", server.base))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let paths = &doc["paths"];
        assert!(paths["/v1/sync/{job}/join"]["post"].is_object());
        assert!(paths["/admin/v1/sync-jobs"]["post"].is_object());
        assert!(paths["/admin/v1/sync-jobs"]["get"].is_object());
        assert!(paths["/admin/v1/sync-jobs/{id}"]["delete"].is_object());
        for schema in [
            "CreateSyncJob",
            "SyncJobInfo",
            "SyncJoinRequest",
            "SyncWorld",
        ] {
            assert!(doc["components"]["schemas"][schema].is_object(), "{schema}");
        }
    }
}
