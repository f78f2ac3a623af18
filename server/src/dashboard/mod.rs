//! The operators' dashboard at `/dashboard`, on the server's own TLS port: a page and its
//! assets, built from `dashboard/` (see `dashboard/README.md`) and embedded in the binary, so nothing is
//! fetched from elsewhere at run time; sign-in and sign-out ([`session`]); and the live feed of
//! the tasks (server-sent events). Everything else the pages show or change they ask of the
//! admin API (`/admin/v1`), which takes a session's cookie where it takes the admin token, and
//! its CSRF token on every state-changing call.

pub mod session;

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE, SET_COOKIE};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::Stream;
use hora_common::wire::{ApiError, DashboardSession, SignIn, SignInLink};
use ring::rand::{SecureRandom, SystemRandom};
use tokio_util::sync::CancellationToken;

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
/// Most event feeds open at once (each is a dashboard's page).
const MAX_FEEDS: usize = 256;
/// The largest sign-in body read: it is read before any credential is known good.
const MAX_SIGN_IN_BYTES: u64 = 1024;

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
        .route("/admin/v1/dashboard/sign-in-links", post(create_link))
}

/// The dashboard's state on the server: its sessions, its one-time sign-in links, its feeds.
pub struct Dashboard {
    pub sessions: Sessions,
    /// SHA-256 of each outstanding link's code, with its expiry.
    links: Mutex<HashMap<String, u64>>,
    /// Places for open event feeds.
    feeds: Arc<tokio::sync::Semaphore>,
    /// Cancelled when the server starts to shut down: the feeds end, so that the requests in
    /// flight can finish within the shutdown's grace.
    pub closing: CancellationToken,
}

impl Dashboard {
    /// `secret`: `--dashboard-secret` (None: a random one); `admin_token_hash`: the admin
    /// token's, which the sessions' key is derived from too.
    pub fn new(secret: Option<&[u8]>, admin_token_hash: &str) -> Result<Dashboard, ServerError> {
        Ok(Dashboard {
            sessions: Sessions::new(secret, admin_token_hash)?,
            links: Mutex::default(),
            feeds: Arc::new(tokio::sync::Semaphore::new(MAX_FEEDS)),
            closing: CancellationToken::new(),
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
    /// (The map holds the codes' hashes, as the store holds enrolment tokens', so a lookup by
    /// hash tells a guesser nothing of a code.)
    fn use_link(&self, code: &str) -> bool {
        let hash = hora_common::sha256_hex(code.as_bytes());
        let mut links = self.links.lock().unwrap_or_else(|p| p.into_inner());
        links.remove(&hash).is_some_and(|expiry| expiry > now_ms())
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

/// `POST /dashboard/api/session` `{"token": …}` (the admin token) or `{"link": …}` (a
/// sign-in link's code), exchanged for a session.
async fn sign_in(State(state): State<Shared>, request: Request) -> Result<Response, ServerError> {
    let (parts, body) = request.into_parts();
    crate::api::admin_source_allowed(&state, &parts)?;
    let sign_in: SignIn =
        crate::api::json_body_within(&state, &parts.headers, body, MAX_SIGN_IN_BYTES).await?;
    match (sign_in.token, sign_in.link) {
        (Some(token), None) => {
            crate::api::check_admin_token(&state, token.trim(), &parts).await?;
        }
        (None, Some(code)) => {
            if !state.dashboard.use_link(code.trim()) {
                return Err(ServerError::Unauthorized(
                    "this sign-in link was used already or has expired (they work once, within 10 minutes, on the server that made them): sign in with the admin token".into(),
                ));
            }
        }
        _ => {
            return Err(ServerError::BadRequest(
                "give either `token` (the admin token) or `link` (a sign-in link's code)".into(),
            ))
        }
    }
    let (session, cookie) = state.dashboard.sessions.start()?;
    tracing::info!(session = %&session.id[..8], "dashboard sign-in");
    Ok(signed_in(&state.dashboard, &session, Some(cookie)))
}

/// `GET /dashboard/api/session`: the signed-in session's CSRF token and expiry (a page that
/// was reloaded asks for them again: they are never kept in the browser's storage).
async fn current(State(state): State<Shared>, request: Request) -> Result<Response, ServerError> {
    let (parts, _) = request.into_parts();
    crate::api::admin_source_allowed(&state, &parts)?;
    let session = state
        .dashboard
        .sessions
        .of(&parts.headers)?
        .ok_or_else(|| ServerError::Unauthorized("not signed in".into()))?;
    Ok(signed_in(&state.dashboard, &session, None))
}

/// `DELETE /dashboard/api/session` (with the CSRF token): signs out.
async fn sign_out(State(state): State<Shared>, request: Request) -> Result<Response, ServerError> {
    let (parts, _) = request.into_parts();
    crate::api::admin_source_allowed(&state, &parts)?;
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
/// The code is in the link's fragment, which browsers never send: the page posts it, so a link
/// scanner that fetches the link does not use it up, and no server log or proxy sees it.
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
            path: format!("/dashboard/#sign-in={code}"),
            expires_unix_ms,
        }),
    ))
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
    headers: HeaderMap,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, ServerError> {
    let place = state
        .dashboard
        .feeds
        .clone()
        .try_acquire_owned()
        .map_err(|_| {
            ServerError::unavailable(
                hora_common::wire::ErrorCode::Busy,
                format!("{MAX_FEEDS} dashboards are open on this server; retry in a moment"),
            )
        })?;
    // A session's feed ends with it (expiry, or a sign-out seen at the next event); one of the
    // admin token's lasts its whole time.
    let session = state.dashboard.sessions.of(&headers)?;
    let mut ends = tokio::time::Instant::now() + FEED_FOR;
    if let Some(s) = &session {
        let left = Duration::from_millis(s.expires_unix_ms.saturating_sub(now_ms()));
        ends = ends.min(tokio::time::Instant::now() + left);
    }
    let changes = state.coordinator.watch_changes();
    let closing = state.dashboard.closing.clone();
    let feed = futures_util::stream::unfold(
        (state, changes, true, place),
        move |(state, mut changes, first, place)| {
            let (closing, signed_in) = (closing.clone(), session.is_some());
            let headers = headers.clone();
            async move {
                if !first {
                    tokio::select! {
                        changed = changes.changed() => changed.ok()?,
                        () = tokio::time::sleep_until(ends) => return None,
                        () = closing.cancelled() => return None,
                    }
                    tokio::select! {
                        () = tokio::time::sleep(EVENT_EVERY) => {}
                        () = closing.cancelled() => return None,
                    }
                    changes.borrow_and_update();
                    if signed_in && !matches!(state.dashboard.sessions.of(&headers), Ok(Some(_))) {
                        return None;
                    }
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
                Some((Ok(event), (state, changes, false, place)))
            }
        },
    );
    Ok(Sse::new(feed).keep_alive(KeepAlive::new().interval(Duration::from_secs(15))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sign_in_link_works_once_and_only_64_wait_at_once() {
        let dashboard = Dashboard::new(None, "hash").unwrap();
        let (code, expires) = dashboard.new_link().unwrap();
        assert!(expires > now_ms());
        assert!(!dashboard.use_link("not-a-code"));
        assert!(dashboard.use_link(&code));
        assert!(!dashboard.use_link(&code), "a link works once");
        for _ in 0..MAX_LINKS {
            dashboard.new_link().unwrap();
        }
        assert!(matches!(
            dashboard.new_link(),
            Err(ServerError::Unavailable { .. })
        ));
        // An expired link is refused (and makes room).
        let (late, _) = {
            let mut links = dashboard.links.lock().unwrap();
            links.clear();
            drop(links);
            dashboard.new_link().unwrap()
        };
        for expiry in dashboard.links.lock().unwrap().values_mut() {
            *expiry = now_ms() - 1;
        }
        assert!(!dashboard.use_link(&late));
    }
}
