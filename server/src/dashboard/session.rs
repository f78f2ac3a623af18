//! The dashboard's sessions: the admin token, checked once at sign-in, exchanged for a cookie
//! the server signs (HMAC-SHA-256), so that the token itself never reaches the browser's
//! storage. The signing key is derived from the session secret and the admin token's hash, so a
//! new admin token ends every session. A cookie names a random session id and its expiry; the
//! CSRF token of a session is derived from its id with the same key, so nothing per session is
//! stored: every replica given the same `--dashboard-secret` (and admin token) accepts the
//! sessions of the others, and a server started with another secret (or none: a random one per
//! process) refuses them. Signing out revokes the id, in the memory of the replica that
//! answered, until the session would have expired anyway, and clears the browser's cookie.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::http::{HeaderMap, HeaderValue, Method};
use ring::hmac;
use ring::rand::{SecureRandom, SystemRandom};

use crate::error::ServerError;
use crate::round::now_ms;

/// The cookie's name: `__Host-` makes the browser refuse it unless it is `Secure`, for the
/// whole site (`Path=/`) and set by this host itself (no `Domain`), so a sibling domain cannot
/// plant one.
pub const COOKIE: &str = "__Host-hora_session";
/// The header a state-changing request of a session carries its CSRF token in.
pub const CSRF_HEADER: &str = "x-csrf-token";
/// How long a session lasts from sign-in.
pub const SESSION_TTL: Duration = Duration::from_secs(8 * 3600);
/// Fewest bytes of a configured session secret.
pub const MIN_SECRET_BYTES: usize = 32;
/// Most sessions signed out before their expiry that one server remembers; past it, the one
/// closest to its expiry is forgotten first (a script holding the admin token could otherwise
/// grow the set for 8 hours).
const MAX_REVOKED: usize = 10_000;
/// How often expired revocations are dropped.
const PRUNE_EVERY: Duration = Duration::from_secs(60);

/// A signed-in session, as its cookie proves it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Session {
    pub id: String,
    pub expires_unix_ms: u64,
}

/// Signs and checks the cookies of the dashboard's sessions.
pub struct Sessions {
    key: hmac::Key,
    revoked: Mutex<Revoked>,
}

/// Ids signed out before their expiry, with that expiry (pruned as they pass it).
struct Revoked {
    ids: HashMap<String, u64>,
    pruned: Instant,
}

impl Sessions {
    /// Sessions signed with a key derived from `secret` (or a random one of this process:
    /// sessions then end when it does) and `admin_token_hash`.
    pub fn new(secret: Option<&[u8]>, admin_token_hash: &str) -> Result<Sessions, ServerError> {
        let secret = match secret {
            Some(secret) if secret.len() < MIN_SECRET_BYTES => {
                return Err(ServerError::internal(format!(
                    "the dashboard's session secret is {} bytes; give at least {MIN_SECRET_BYTES} (e.g. `openssl rand -hex 32`)",
                    secret.len()
                )));
            }
            Some(secret) => secret.to_vec(),
            None => {
                let mut random = [0u8; 32];
                SystemRandom::new()
                    .fill(&mut random)
                    .map_err(|_| ServerError::internal("the system RNG failed"))?;
                random.to_vec()
            }
        };
        let derived = hmac::sign(
            &hmac::Key::new(hmac::HMAC_SHA256, &secret),
            format!("hora-dashboard-key v1|{admin_token_hash}").as_bytes(),
        );
        Ok(Sessions {
            key: hmac::Key::new(hmac::HMAC_SHA256, derived.as_ref()),
            revoked: Mutex::new(Revoked {
                ids: HashMap::new(),
                pruned: Instant::now(),
            }),
        })
    }

    /// A new session and the `Set-Cookie` value that hands it to the browser.
    pub fn start(&self) -> Result<(Session, HeaderValue), ServerError> {
        let mut id = [0u8; 16];
        SystemRandom::new()
            .fill(&mut id)
            .map_err(|_| ServerError::internal("the system RNG failed"))?;
        let session = Session {
            id: hex::encode(id),
            expires_unix_ms: now_ms() + SESSION_TTL.as_millis() as u64,
        };
        let tag = hmac::sign(&self.key, &signed(&session));
        let value = format!(
            "{COOKIE}=v1.{}.{}.{}; Path=/; Max-Age={}; HttpOnly; Secure; SameSite=Strict",
            session.id,
            session.expires_unix_ms,
            hex::encode(tag.as_ref()),
            SESSION_TTL.as_secs()
        );
        let cookie = HeaderValue::from_str(&value).map_err(ServerError::internal)?;
        Ok((session, cookie))
    }

    /// The `Set-Cookie` value that removes the session's cookie from the browser.
    pub fn cleared() -> HeaderValue {
        HeaderValue::from_static(
            "__Host-hora_session=; Path=/; Max-Age=0; HttpOnly; Secure; SameSite=Strict",
        )
    }

    /// The session the request's cookie proves, if it carries one: `Ok(None)` without the
    /// cookie, 401 for a cookie that is forged, expired, signed by another secret or signed
    /// out.
    pub fn of(&self, headers: &HeaderMap) -> Result<Option<Session>, ServerError> {
        let Some(value) = cookie(headers) else {
            return Ok(None);
        };
        let refused = |why: &str| {
            ServerError::Unauthorized(format!(
                "the dashboard session {why}: sign in again with the admin token"
            ))
        };
        let mut parts = value.split('.');
        let (Some("v1"), Some(id), Some(expires), Some(tag), None) = (
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
        ) else {
            return Err(refused("cookie is malformed"));
        };
        let (Ok(expires_unix_ms), Ok(tag)) = (expires.parse::<u64>(), hex::decode(tag)) else {
            return Err(refused("cookie is malformed"));
        };
        if id.len() != 32 || !id.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(refused("cookie is malformed"));
        }
        let session = Session {
            id: id.to_string(),
            expires_unix_ms,
        };
        hmac::verify(&self.key, &signed(&session), &tag)
            .map_err(|_| refused("was not signed by this server's secret"))?;
        let now = now_ms();
        if expires_unix_ms <= now {
            return Err(refused("has expired"));
        }
        let revoked = self.revoked.lock().unwrap_or_else(|p| p.into_inner());
        if revoked.ids.contains_key(&session.id) {
            return Err(refused("was signed out"));
        }
        Ok(Some(session))
    }

    /// The session's CSRF token: what its pages send in [`CSRF_HEADER`].
    pub fn csrf(&self, session: &Session) -> String {
        hex::encode(hmac::sign(&self.key, &csrf_message(session)).as_ref())
    }

    /// Refuses (403) a state-changing request of `session` that does not carry its CSRF token.
    pub fn check_csrf(
        &self,
        session: &Session,
        method: &Method,
        headers: &HeaderMap,
    ) -> Result<(), ServerError> {
        if matches!(*method, Method::GET | Method::HEAD) {
            return Ok(());
        }
        let given = headers
            .get(CSRF_HEADER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| hex::decode(v).ok());
        let passed = given
            .is_some_and(|given| hmac::verify(&self.key, &csrf_message(session), &given).is_ok());
        if passed {
            Ok(())
        } else {
            Err(ServerError::Forbidden(format!(
                "a state-changing request of a dashboard session needs the session's CSRF token in `{CSRF_HEADER}` (GET /dashboard/api/session gives it)"
            )))
        }
    }

    /// Signs `session` out on this server.
    pub fn revoke(&self, session: &Session) {
        let mut revoked = self.revoked.lock().unwrap_or_else(|p| p.into_inner());
        if revoked.pruned.elapsed() >= PRUNE_EVERY {
            let now = now_ms();
            revoked.ids.retain(|_, expiry| *expiry > now);
            revoked.pruned = Instant::now();
        }
        if revoked.ids.len() >= MAX_REVOKED {
            let soonest = revoked
                .ids
                .iter()
                .min_by_key(|(_, expiry)| **expiry)
                .map(|(id, _)| id.clone());
            if let Some(id) = soonest {
                revoked.ids.remove(&id);
            }
        }
        revoked
            .ids
            .insert(session.id.clone(), session.expires_unix_ms);
    }
}

fn signed(session: &Session) -> Vec<u8> {
    format!("hora-session v1|{}|{}", session.id, session.expires_unix_ms).into_bytes()
}

fn csrf_message(session: &Session) -> Vec<u8> {
    format!("hora-csrf v1|{}", session.id).into_bytes()
}

/// The value of the session cookie among the request's cookies.
fn cookie(headers: &HeaderMap) -> Option<&str> {
    headers
        .get_all(axum::http::header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(name, _)| *name == COOKIE)
        .map(|(_, value)| value)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_cookie(set_cookie: &HeaderValue) -> HeaderMap {
        let pair = set_cookie.to_str().unwrap().split(';').next().unwrap();
        let mut headers = HeaderMap::new();
        headers.insert(
            axum::http::header::COOKIE,
            HeaderValue::from_str(&format!("other=1; {pair}")).unwrap(),
        );
        headers
    }

    #[test]
    fn a_cookie_is_good_on_the_server_that_signed_it_until_signed_out() {
        let sessions = Sessions::new(Some(&[7u8; 32]), "hash").unwrap();
        let (session, set) = sessions.start().unwrap();
        let headers = with_cookie(&set);
        assert_eq!(sessions.of(&headers).unwrap(), Some(session.clone()));
        // Another replica with the same secret takes it; a server with another does not.
        let replica = Sessions::new(Some(&[7u8; 32]), "hash").unwrap();
        assert_eq!(replica.of(&headers).unwrap(), Some(session.clone()));
        let other = Sessions::new(None, "hash").unwrap();
        assert!(
            matches!(other.of(&headers), Err(ServerError::Unauthorized(m)) if m.contains("secret"))
        );
        sessions.revoke(&session);
        assert!(
            matches!(sessions.of(&headers), Err(ServerError::Unauthorized(m)) if m.contains("signed out"))
        );
        assert_eq!(sessions.of(&HeaderMap::new()).unwrap(), None);
    }

    #[test]
    fn a_changed_expiry_or_id_breaks_the_signature() {
        let sessions = Sessions::new(None, "hash").unwrap();
        let (session, _) = sessions.start().unwrap();
        let tag = hex::encode(hmac::sign(&sessions.key, &signed(&session)).as_ref());
        for forged in [
            format!("v1.{}.{}.{tag}", session.id, session.expires_unix_ms + 1),
            format!("v1.{}.{}.{tag}", "0".repeat(32), session.expires_unix_ms),
            format!("v1.{}.{}", session.id, session.expires_unix_ms),
            "v1.zz.1.00".to_string(),
        ] {
            let mut headers = HeaderMap::new();
            headers.insert(
                axum::http::header::COOKIE,
                HeaderValue::from_str(&format!("{COOKIE}={forged}")).unwrap(),
            );
            assert!(sessions.of(&headers).is_err(), "{forged}");
        }
    }

    #[test]
    fn state_changing_requests_need_the_sessions_csrf_token() {
        let sessions = Sessions::new(None, "hash").unwrap();
        let (session, _) = sessions.start().unwrap();
        let (other, _) = sessions.start().unwrap();
        let mut headers = HeaderMap::new();
        assert!(sessions
            .check_csrf(&session, &Method::GET, &headers)
            .is_ok());
        assert!(matches!(
            sessions.check_csrf(&session, &Method::POST, &headers),
            Err(ServerError::Forbidden(_))
        ));
        headers.insert(CSRF_HEADER, sessions.csrf(&other).parse().unwrap());
        assert!(sessions
            .check_csrf(&session, &Method::POST, &headers)
            .is_err());
        headers.insert(CSRF_HEADER, sessions.csrf(&session).parse().unwrap());
        assert!(sessions
            .check_csrf(&session, &Method::POST, &headers)
            .is_ok());
    }

    #[test]
    fn a_short_secret_is_refused() {
        assert!(Sessions::new(Some(b"short"), "hash").is_err());
    }
}
