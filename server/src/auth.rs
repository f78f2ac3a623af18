//! Credentials. Secrets are 32 random bytes shown once; the server stores only their SHA-256
//! (high-entropy secrets need no slow hash) and compares hashes in constant time. The admin token
//! may be the operator's own choice, so it is stored salted and stretched (PBKDF2-HMAC-SHA256),
//! and failed checks of it draw on a small budget ([`AdminKey`]).
//!
//! - Admin: `Authorization: Bearer <admin token>`.
//! - Client: `Authorization: Bearer <client id>.<secret>`, from enrolment.
//! - Enrolment tokens: one-time, expiring, created by the admin.

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

/// Slow checks of the admin token a server makes at most: a burst, then this many a second.
const ADMIN_CHECKS_BURST: f64 = 10.0;
const ADMIN_CHECKS_PER_SEC: f64 = 2.0;

/// The admin token's check. The first request with the right token pays the slow check; the
/// SHA-256 of the token that passed is then kept in memory and compared in constant time. A
/// token that is not that one takes a slow check, and slow checks draw on a budget (a burst of
/// 10, then 2 a second, for the whole server), so guessing is slow and cannot take the CPU.
pub struct AdminKey {
    stored: String,
    passed: Mutex<Option<String>>,
    /// Slow checks left, and when that was counted.
    budget: Mutex<(f64, Instant)>,
}

impl AdminKey {
    pub fn new(stored: String) -> AdminKey {
        AdminKey {
            stored,
            passed: Mutex::new(None),
            budget: Mutex::new((ADMIN_CHECKS_BURST, Instant::now())),
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

    /// Whether `token` is the admin token; 503 `busy` when the budget of slow checks is spent.
    pub async fn verify(&self, token: &str) -> Result<bool, ServerError> {
        if self.passed(token) {
            return Ok(true);
        }
        let quick = hash_secret(token);
        {
            let mut budget = self.budget.lock().unwrap_or_else(|p| p.into_inner());
            let (left, at) = *budget;
            let now = Instant::now();
            let left = (left + now.duration_since(at).as_secs_f64() * ADMIN_CHECKS_PER_SEC)
                .min(ADMIN_CHECKS_BURST);
            if left < 1.0 {
                *budget = (left, now);
                return Err(ServerError::unavailable(
                    hora_common::wire::ErrorCode::Busy,
                    "too many admin token checks failed recently; retry in a few seconds",
                ));
            }
            *budget = (left - 1.0, now);
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

    #[tokio::test]
    async fn failed_admin_checks_are_rationed_and_the_right_token_still_passes() {
        let key = AdminKey::new(hash_admin_token("the right admin token").unwrap());
        assert!(key.verify("the right admin token").await.unwrap());
        let mut refused = 0;
        for i in 0..15 {
            match key.verify(&format!("guess {i}")).await {
                Ok(ok) => assert!(!ok),
                Err(e) => {
                    assert_eq!(e.code(), hora_common::wire::ErrorCode::Busy);
                    refused += 1;
                }
            }
        }
        assert!(refused >= 4, "{refused} of 15 guesses rationed");
        // The right token, checked once, passes without a slow check.
        assert!(key.verify("the right admin token").await.unwrap());
    }

    #[test]
    fn client_tokens_split_on_the_last_dot() {
        assert_eq!(client_token("c.1.abc").unwrap(), ("c.1", "abc"));
        assert!(client_token("nodot").is_err());
        assert!(client_token("a/b.x").is_err());
        assert!(client_token("id.").is_err());
    }
}
