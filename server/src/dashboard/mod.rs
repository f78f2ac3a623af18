//! The operators' dashboard at `/dashboard`, on the server's own TLS port: a page and its
//! assets, built from `dashboard/` (see its README) and embedded in the binary, so nothing is
//! fetched from elsewhere at run time; sign-in and sign-out ([`session`]); and the live feed of
//! the tasks (server-sent events). Everything else the pages show or change they ask of the
//! admin API (`/admin/v1`), which takes a session's cookie where it takes the admin token, and
//! its CSRF token on every state-changing call.

pub mod session;

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Mutex;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE, LOCATION, SET_COOKIE};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::Stream;
use hora_common::wire::{ApiError, DashboardSession, SignIn, SignInLink};
use ring::rand::{SecureRandom, SystemRandom};
use subtle::ConstantTimeEq;

use crate::api::{AdminAuth, Shared};
use crate::error::ServerError;
use crate::round::now_ms;

pub use session::Sessions;

/// The page, its script and its styles, as `dashboard/build.mjs` wrote them.
const INDEX: &str = include_str!("../../../dashboard/dist/index.html");
const APP_JS: &str = include_str!("../../../dashboard/dist/app.js");
const APP_CSS: &str = include_str!("../../../dashboard/dist/app.css");

/// What the page may load and where it may connect: only this server.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
                   connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'";

/// The least time between two events of one feed: a burst of changes (uploads arriving) is
/// one event, so open dashboards cost the server at most a few task listings per second each.
const EVENT_EVERY: Duration = Duration::from_millis(250);
/// How long one feed lasts before the browser reconnects (it does so by itself, after
/// [`RECONNECT`]): a server that shuts down or a load balancer that moves it loses no page.
const FEED_FOR: Duration = Duration::from_secs(300);
const RECONNECT: Duration = Duration::from_secs(2);
/// How long a sign-in link is good for, and how many may be outstanding at once.
const LINK_TTL: Duration = Duration::from_secs(600);
const MAX_LINKS: usize = 64;

pub fn routes() -> Router<Shared> {
    Router::new()
        .route("/dashboard", get(index))
        .route("/dashboard/", get(index))
        .route("/dashboard/assets/app.js", get(app_js))
        .route("/dashboard/assets/app.css", get(app_css))
        .route(
            "/dashboard/api/session",
            post(sign_in).get(current).delete(sign_out),
        )
        .route("/dashboard/api/events", get(events))
        .route("/dashboard/sign-in", get(sign_in_by_link))
        .route("/admin/v1/dashboard/sign-in-links", post(create_link))
}

/// The dashboard's state on the server: its sessions and its one-time sign-in links.
pub struct Dashboard {
    pub sessions: Sessions,
    /// SHA-256 of each outstanding link's code, with its expiry.
    links: Mutex<HashMap<String, u64>>,
}

impl Dashboard {
    pub fn new(secret: Option<&[u8]>) -> Result<Dashboard, ServerError> {
        Ok(Dashboard {
            sessions: Sessions::new(secret)?,
            links: Mutex::default(),
        })
    }

    fn new_link(&self) -> Result<(String, u64), ServerError> {
        let mut code = [0u8; 32];
        SystemRandom::new()
            .fill(&mut code)
            .map_err(|_| ServerError::internal("the system RNG failed"))?;
        let code = hex::encode(code);
        let (now, expires) = (now_ms(), now_ms() + LINK_TTL.as_millis() as u64);
        let mut links = self.links.lock().unwrap_or_else(|p| p.into_inner());
        links.retain(|_, expiry| *expiry > now);
        if links.len() >= MAX_LINKS {
            return Err(ServerError::unavailable(
                hora_common::wire::ErrorCode::Busy,
                format!("{MAX_LINKS} sign-in links are outstanding; use one or wait for them to expire (10 minutes)"),
            ));
        }
        links.insert(hora_common::sha256_hex(code.as_bytes()), expires);
        Ok((code, expires))
    }

    /// Whether `code` is an outstanding link's; it is used up either way.
    fn use_link(&self, code: &str) -> bool {
        let hash = hora_common::sha256_hex(code.as_bytes());
        let mut links = self.links.lock().unwrap_or_else(|p| p.into_inner());
        let now = now_ms();
        let found = links
            .keys()
            .find(|k| bool::from(k.as_bytes().ct_eq(hash.as_bytes())))
            .cloned();
        found
            .and_then(|k| links.remove(&k))
            .is_some_and(|expiry| expiry > now)
    }
}

fn page(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (CONTENT_TYPE, HeaderValue::from_static(content_type)),
            (CACHE_CONTROL, HeaderValue::from_static("no-cache")),
            (
                axum::http::header::CONTENT_SECURITY_POLICY,
                HeaderValue::from_static(CSP),
            ),
            (
                axum::http::header::X_CONTENT_TYPE_OPTIONS,
                HeaderValue::from_static("nosniff"),
            ),
            (
                axum::http::header::REFERRER_POLICY,
                HeaderValue::from_static("no-referrer"),
            ),
        ],
        body,
    )
        .into_response()
}

async fn index() -> Response {
    page("text/html; charset=utf-8", INDEX)
}

async fn app_js() -> Response {
    page("text/javascript; charset=utf-8", APP_JS)
}

async fn app_css() -> Response {
    page("text/css; charset=utf-8", APP_CSS)
}

fn signed_in(
    dashboard: &Dashboard,
    session: &session::Session,
    cookie: Option<HeaderValue>,
) -> Response {
    let body = Json(DashboardSession {
        csrf: dashboard.sessions.csrf(session),
        expires_unix_ms: session.expires_unix_ms,
    });
    let mut response = body.into_response();
    if let Some(cookie) = cookie {
        response.headers_mut().insert(SET_COOKIE, cookie);
    }
    response
        .headers_mut()
        .insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

/// `POST /dashboard/api/session` `{"token": …}`: the admin token exchanged for a session.
async fn sign_in(State(state): State<Shared>, request: Request) -> Result<Response, ServerError> {
    let (parts, body) = request.into_parts();
    crate::api::admin_source_allowed(&state, &parts)?;
    let SignIn { token } = crate::api::json_body(&state, &parts.headers, body).await?;
    crate::api::check_admin_token(&state, token.trim(), &parts).await?;
    let (session, cookie) = state.dashboard.sessions.start()?;
    tracing::info!(session = %&session.id[..8], "dashboard sign-in");
    Ok(signed_in(&state.dashboard, &session, Some(cookie)))
}

/// `GET /dashboard/api/session`: the signed-in session's CSRF token and expiry (a page that
/// was reloaded asks for them again: they are never kept in the browser's storage).
async fn current(State(state): State<Shared>, headers: HeaderMap) -> Result<Response, ServerError> {
    let session = state
        .dashboard
        .sessions
        .of(&headers)?
        .ok_or_else(|| ServerError::Unauthorized("not signed in".into()))?;
    Ok(signed_in(&state.dashboard, &session, None))
}

/// `DELETE /dashboard/api/session` (with the CSRF token): signs out.
async fn sign_out(State(state): State<Shared>, request: Request) -> Result<Response, ServerError> {
    let (parts, _) = request.into_parts();
    let sessions = &state.dashboard.sessions;
    let session = sessions
        .of(&parts.headers)?
        .ok_or_else(|| ServerError::Unauthorized("not signed in".into()))?;
    sessions.check_csrf(&session, &parts.method, &parts.headers)?;
    sessions.revoke(&session);
    tracing::info!(session = %&session.id[..8], "dashboard sign-out");
    Ok((StatusCode::NO_CONTENT, [(SET_COOKIE, Sessions::cleared())]).into_response())
}

/// `POST /admin/v1/dashboard/sign-in-links` (admin): a link that signs a browser in once,
/// within ten minutes, without the admin token being typed or kept (`make demo` prints one).
#[utoipa::path(post, path = "/admin/v1/dashboard/sign-in-links", tag = "admin", security(("admin_token" = [])),
    responses((status = 201, body = SignInLink, description = "the link's path and query (append it to the server's URL); shown once"),
        (status = 503, body = ApiError, description = "`busy`: 64 links are outstanding")))]
pub async fn create_link(
    State(state): State<Shared>,
    _a: AdminAuth,
) -> Result<(StatusCode, Json<SignInLink>), ServerError> {
    let (code, expires_unix_ms) = state.dashboard.new_link()?;
    Ok((
        StatusCode::CREATED,
        Json(SignInLink {
            path: format!("/dashboard/sign-in?code={code}"),
            expires_unix_ms,
        }),
    ))
}

#[derive(serde::Deserialize)]
struct LinkQuery {
    code: String,
}

/// `GET /dashboard/sign-in?code=…`: a sign-in link, used up; on to the dashboard.
async fn sign_in_by_link(
    State(state): State<Shared>,
    request: Request,
) -> Result<Response, ServerError> {
    let (parts, _) = request.into_parts();
    crate::api::admin_source_allowed(&state, &parts)?;
    let axum::extract::Query(LinkQuery { code }) =
        axum::extract::Query::try_from_uri(&parts.uri)
            .map_err(|e| ServerError::BadRequest(format!("malformed query: {}", e.body_text())))?;
    if !state.dashboard.use_link(&code) {
        return Ok(redirect("/dashboard/#expired-link", None));
    }
    let (session, cookie) = state.dashboard.sessions.start()?;
    tracing::info!(session = %&session.id[..8], "dashboard sign-in by link");
    Ok(redirect("/dashboard/", Some(cookie)))
}

fn redirect(to: &'static str, cookie: Option<HeaderValue>) -> Response {
    let mut response = (
        StatusCode::SEE_OTHER,
        [(LOCATION, HeaderValue::from_static(to))],
    )
        .into_response();
    if let Some(cookie) = cookie {
        response.headers_mut().insert(SET_COOKIE, cookie);
    }
    response
        .headers_mut()
        .insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

/// What a `tasks` event carries.
#[derive(serde::Serialize)]
struct Feed {
    /// Every task, as `GET /admin/v1/tasks` gives them.
    tasks: Vec<hora_common::wire::TaskInfo>,
    /// Tasks whose stored state could not be loaded (they answer 503; the reason is in the
    /// server's log).
    broken: Vec<String>,
}

/// `GET /dashboard/api/events`: server-sent events, a `tasks` event ([`Feed`]) at once and whenever a task changes (a round opens,
/// takes an update, publishes, a state changes), at most one per [`EVENT_EVERY`].
async fn events(
    State(state): State<Shared>,
    _a: AdminAuth,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let changes = state.coordinator.watch_changes();
    let ends = tokio::time::Instant::now() + FEED_FOR;
    let stopping = state.coordinator.stopping.clone();
    let feed = futures_util::stream::unfold(
        (state, changes, true),
        move |(state, mut changes, first)| {
            let stopping = stopping.clone();
            async move {
                if !first {
                    tokio::select! {
                        changed = changes.changed() => changed.ok()?,
                        () = tokio::time::sleep_until(ends) => return None,
                        () = stopping.cancelled() => return None,
                    }
                    tokio::time::sleep(EVENT_EVERY).await;
                    changes.borrow_and_update();
                }
                let feed = Feed {
                    tasks: state.coordinator.list(),
                    broken: state
                        .coordinator
                        .broken_tasks()
                        .into_iter()
                        .map(|(id, _)| id)
                        .collect(),
                };
                let mut event = Event::default().event("tasks");
                if first {
                    event = event.retry(RECONNECT);
                }
                let event = match serde_json::to_string(&feed) {
                    Ok(json) => event.data(json),
                    Err(e) => Event::default().comment(format!("listing the tasks failed: {e}")),
                };
                Some((Ok(event), (state, changes, false)))
            }
        },
    );
    Sse::new(feed).keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
}
