//! Credentials. Secrets are 32 random bytes shown once; the server stores only their SHA-256
//! (high-entropy secrets need no slow hash) and compares hashes in constant time. The admin token
//! may be the operator's own choice, so it is stored salted and stretched (PBKDF2-HMAC-SHA256),
//! and failed checks of it draw on small budgets, per source address and for the server
//! ([`AdminKey`]).
//!
//! - Admin: `Authorization: Bearer <admin token>`.
//! - Client: `Authorization: Bearer <client id>.<secret>`, from enrolment.
//! - Enrolment tokens: one-time, expiring, created by the admin.

use std::collections::HashMap;
use std::net::IpAddr;
use std::num::NonZeroU32;
use std::sync::Mutex;
use std::time::Instant;

use ring::pbkdf2;
use ring::rand::{SecureRandom, SystemRandom};
use subtle::ConstantTimeEq;

use crate::error::ServerError;

/// A fresh random secret, hex-encoded (64 characters).
pub fn new_secret() -> Result<String, ServerError> {
    let mut bytes = [0u8; 32];
    SystemRandom::new()
        .fill(&mut bytes)
        .map_err(|_| ServerError::internal("the system RNG failed"))?;
    Ok(hex::encode(bytes))
}

/// SHA-256 of a secret, hex-encoded: what the store keeps.
pub fn hash_secret(secret: &str) -> String {
    hora_common::sha256_hex(secret.as_bytes())
}

/// Whether `secret` hashes to `stored_hash`, in time independent of where they differ.
pub fn verify_secret(secret: &str, stored_hash: &str) -> bool {
    hash_secret(secret)
        .as_bytes()
        .ct_eq(stored_hash.as_bytes())
        .into()
}

/// PBKDF2 rounds of the stored admin token.
const ADMIN_ROUNDS: u32 = 100_000;

/// The admin token as stored: `pbkdf2-sha256$ROUNDS$SALT$HASH` (hex), salted afresh.
pub fn hash_admin_token(token: &str) -> Result<String, ServerError> {
    let mut salt = [0u8; 16];
    SystemRandom::new()
        .fill(&mut salt)
        .map_err(|_| ServerError::internal("the system RNG failed"))?;
    let rounds = NonZeroU32::new(ADMIN_ROUNDS).expect("a nonzero constant");
    let mut hash = [0u8; 32];
    pbkdf2::derive(
        pbkdf2::PBKDF2_HMAC_SHA256,
        rounds,
        &salt,
        token.as_bytes(),
        &mut hash,
    );
    Ok(format!(
        "pbkdf2-sha256${ADMIN_ROUNDS}${}${}",
        hex::encode(salt),
        hex::encode(hash)
    ))
}

/// Whether `token` is the admin token `stored` describes: the salted form, or the plain SHA-256
/// a store written before it holds. Slow (by design) for the salted form.
pub fn verify_admin_token(token: &str, stored: &str) -> bool {
    let parts: Vec<&str> = stored.split('$').collect();
    match parts.as_slice() {
        ["pbkdf2-sha256", rounds, salt, hash] => {
            let (Some(rounds), Ok(salt), Ok(hash)) = (
                rounds.parse().ok().and_then(NonZeroU32::new),
                hex::decode(salt),
                hex::decode(hash),
            ) else {
                return false;
            };
            pbkdf2::verify(
                pbkdf2::PBKDF2_HMAC_SHA256,
                rounds,
                &salt,
                token.as_bytes(),
                &hash,
            )
            .is_ok()
        }
        _ => verify_secret(token, stored),
    }
}

/// Slow checks of the admin token one source address makes at most: a burst, then this many a
/// second.
const SOURCE_CHECKS: Rate = Rate {
    burst: 10.0,
    per_sec: 2.0,
};
/// And the whole server (each slow check is tens of milliseconds of one core).
const SERVER_CHECKS: Rate = Rate {
    burst: 40.0,
    per_sec: 10.0,
};
/// Sources whose budget is remembered at most; past that, sources with a spent budget are kept
/// and the rest share one budget.
const SOURCES_KEPT: usize = 4096;

#[derive(Clone, Copy)]
struct Rate {
    burst: f64,
    per_sec: f64,
}

/// A token bucket: checks left, and when that was counted.
#[derive(Clone, Copy)]
struct Bucket {
    left: f64,
    at: Instant,
}

impl Bucket {
    fn full(rate: Rate, now: Instant) -> Bucket {
        Bucket {
            left: rate.burst,
            at: now,
        }
    }

    /// The checks left at `now`.
    fn refilled(&self, rate: Rate, now: Instant) -> f64 {
        (self.left + now.duration_since(self.at).as_secs_f64() * rate.per_sec).min(rate.burst)
    }
}

/// The budgets of slow checks: one per source address (IPv6 by /64, what one host is commonly
/// given) and one for the server.
struct Budgets {
    sources: HashMap<IpAddr, Bucket>,
    /// Shared by the sources not kept when `sources` is full.
    others: Bucket,
    server: Bucket,
}

impl Budgets {
    /// Takes one slow check from `source`'s budget and the server's, or says whose is spent.
    fn take(&mut self, source: Option<IpAddr>, now: Instant) -> Result<(), &'static str> {
        if self.server.refilled(SERVER_CHECKS, now) < 1.0 {
            return Err("the server's");
        }
        let source = source.map(crate::conn::source_key);
        if let Some(ip) = source {
            if !self.sources.contains_key(&ip) && self.sources.len() >= SOURCES_KEPT {
                // A budget that refilled says nothing: forget those first.
                self.sources
                    .retain(|_, b| b.refilled(SOURCE_CHECKS, now) < SOURCE_CHECKS.burst);
            }
        }
        let bucket = match source {
            Some(ip) if self.sources.len() < SOURCES_KEPT || self.sources.contains_key(&ip) => self
                .sources
                .entry(ip)
                .or_insert_with(|| Bucket::full(SOURCE_CHECKS, now)),
            // (A request whose address could not be read shares the budget of the many.)
            _ => &mut self.others,
        };
        let left = bucket.refilled(SOURCE_CHECKS, now);
        if left < 1.0 {
            *bucket = Bucket { left, at: now };
            return Err("this address's");
        }
        *bucket = Bucket {
            left: left - 1.0,
            at: now,
        };
        self.server = Bucket {
            left: self.server.refilled(SERVER_CHECKS, now) - 1.0,
            at: now,
        };
        Ok(())
    }
}

/// The admin token's check. The first request with the right token pays the slow check; the
/// SHA-256 of the token that passed is then kept in memory and compared in constant time. A
/// token that is not that one takes a slow check, and slow checks draw on two budgets: its
/// source address's (a burst of 10, then 2 a second) and the server's (40, then 10 a second),
/// so guessing is slow, cannot take the CPU, and one address guessing does not lock the
/// operator out from another.
pub struct AdminKey {
    stored: String,
    passed: Mutex<Option<String>>,
    budgets: Mutex<Budgets>,
}

impl AdminKey {
    pub fn new(stored: String) -> AdminKey {
        let now = Instant::now();
        AdminKey {
            stored,
            passed: Mutex::new(None),
            budgets: Mutex::new(Budgets {
                sources: HashMap::new(),
                others: Bucket::full(SOURCE_CHECKS, now),
                server: Bucket::full(SERVER_CHECKS, now),
            }),
        }
    }

    /// Whether `token` is the admin token that passed a slow check already (fast).
    pub fn passed(&self, token: &str) -> bool {
        let quick = hash_secret(token);
        let passed = self.passed.lock().unwrap_or_else(|p| p.into_inner());
        passed
            .as_ref()
            .is_some_and(|p| bool::from(p.as_bytes().ct_eq(quick.as_bytes())))
    }

    /// Whether `token`, from `source`, is the admin token; 503 `busy` when the source's or the
    /// server's budget of slow checks is spent.
    pub async fn verify(&self, token: &str, source: Option<IpAddr>) -> Result<bool, ServerError> {
        if self.passed(token) {
            return Ok(true);
        }
        let quick = hash_secret(token);
        {
            let mut budgets = self.budgets.lock().unwrap_or_else(|p| p.into_inner());
            if let Err(whose) = budgets.take(source, Instant::now()) {
                return Err(ServerError::unavailable(
                    hora_common::wire::ErrorCode::Busy,
                    format!("too many admin token checks failed recently ({whose} budget is spent); retry in a moment"),
                ));
            }
        }
        let (stored, token) = (self.stored.clone(), token.to_string());
        let ok = crate::blocking(move || Ok(verify_admin_token(&token, &stored))).await?;
        if ok {
            *self.passed.lock().unwrap_or_else(|p| p.into_inner()) = Some(quick);
        }
        Ok(ok)
    }
}

/// The bearer token of an `Authorization` header value.
pub fn bearer(header: Option<&axum::http::HeaderValue>) -> Result<&str, ServerError> {
    header
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .ok_or(ServerError::MissingCredentials)
}

/// Splits a client bearer token into id and secret.
pub fn client_token(token: &str) -> Result<(&str, &str), ServerError> {
    token
        .rsplit_once('.')
        .filter(|(id, secret)| hora_common::wire::valid_id(id) && !secret.is_empty())
        .ok_or_else(|| {
            ServerError::Unauthorized(
                "malformed client credentials: expected `<client id>.<secret>`".into(),
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_verify_only_against_their_hash() {
        let s = new_secret().unwrap();
        assert_eq!(s.len(), 64);
        let h = hash_secret(&s);
        assert!(verify_secret(&s, &h));
        assert!(!verify_secret(&new_secret().unwrap(), &h));
        assert!(!verify_secret("", &h));
    }

    #[test]
    fn admin_tokens_verify_salted_or_as_stored_before() {
        let stored = hash_admin_token("a token of the operator's").unwrap();
        assert!(stored.starts_with("pbkdf2-sha256$100000$"));
        assert_ne!(
            stored,
            hash_admin_token("a token of the operator's").unwrap()
        );
        assert!(verify_admin_token("a token of the operator's", &stored));
        assert!(!verify_admin_token("a token of the operator'", &stored));
        assert!(verify_admin_token("old", &hash_secret("old")));
        assert!(!verify_admin_token("old", "pbkdf2-sha256$0$00$00"));
    }

    const GUESSER: Option<IpAddr> = Some(IpAddr::V4(std::net::Ipv4Addr::new(192, 0, 2, 1)));
    const OPERATOR: Option<IpAddr> = Some(IpAddr::V4(std::net::Ipv4Addr::new(192, 0, 2, 2)));

    /// How many of `n` guesses from `source` are refused `busy`.
    async fn guesses_refused(key: &AdminKey, source: Option<IpAddr>, n: usize) -> usize {
        let mut refused = 0;
        for i in 0..n {
            match key.verify(&format!("guess {i}"), source).await {
                Ok(ok) => assert!(!ok),
                Err(e) => {
                    assert_eq!(e.code(), hora_common::wire::ErrorCode::Busy);
                    refused += 1;
                }
            }
        }
        refused
    }

    #[tokio::test]
    async fn failed_admin_checks_are_rationed_per_source_and_the_right_token_still_passes() {
        let key = AdminKey::new(hash_admin_token("the right admin token").unwrap());
        let refused = guesses_refused(&key, GUESSER, 15).await;
        assert!(refused >= 4, "{refused} of 15 guesses rationed");
        // Another address still has its budget: the operator's first check passes.
        assert!(key.verify("the right admin token", OPERATOR).await.unwrap());
        // Then the right token passes without a slow check, from anywhere.
        assert!(key.verify("the right admin token", GUESSER).await.unwrap());
    }

    #[test]
    fn sources_have_a_budget_each_and_together_the_servers() {
        let key = AdminKey::new(String::new());
        let mut budgets = key.budgets.lock().unwrap();
        let now = Instant::now();
        let host = |h: u8| Some(IpAddr::V4(std::net::Ipv4Addr::new(198, 51, 100, h)));
        // One source: its burst of 10, then refused; a second later, two more.
        let taken = (0..12)
            .filter(|_| budgets.take(host(0), now).is_ok())
            .count();
        assert_eq!(taken, 10);
        assert_eq!(budgets.take(host(0), now), Err("this address's"));
        let later = now + std::time::Duration::from_secs(1);
        let taken = (0..5)
            .filter(|_| budgets.take(host(0), later).is_ok())
            .count();
        assert_eq!(taken, 2);
        // Many sources: the server's budget in all (40, refilled to full in that second, less
        // the 2 just taken).
        let taken: usize = (1..=9)
            .map(|h| {
                (0..5)
                    .filter(|_| budgets.take(host(h), later).is_ok())
                    .count()
            })
            .sum();
        assert_eq!(taken, 40 - 2);
        assert_eq!(budgets.take(host(10), later), Err("the server's"));
    }

    #[test]
    fn ipv6_sources_count_by_their_64_and_mapped_ipv4_as_ipv4() {
        let a: IpAddr = "2001:db8:1:2:aaaa::1".parse().unwrap();
        let b: IpAddr = "2001:db8:1:2:bbbb::2".parse().unwrap();
        let c: IpAddr = "2001:db8:1:3::1".parse().unwrap();
        assert_eq!(crate::conn::source_key(a), crate::conn::source_key(b));
        assert_ne!(crate::conn::source_key(a), crate::conn::source_key(c));
        let mapped: IpAddr = "::ffff:192.0.2.1".parse().unwrap();
        assert_eq!(crate::conn::source_key(mapped), GUESSER.unwrap());
    }

    #[test]
    fn client_tokens_split_on_the_last_dot() {
        assert_eq!(client_token("c.1.abc").unwrap(), ("c.1", "abc"));
        assert!(client_token("nodot").is_err());
        assert!(client_token("a/b.x").is_err());
        assert!(client_token("id.").is_err());
    }
}
