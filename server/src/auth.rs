//! Credentials. Secrets are 32 random bytes shown once; the server stores only their SHA-256
//! (high-entropy secrets need no slow hash) and compares hashes in constant time.
//!
//! - Admin: `Authorization: Bearer <admin token>`.
//! - Client: `Authorization: Bearer <client id>.<secret>`, from enrolment.
//! - Enrolment tokens: one-time, expiring, created by the admin.

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
    fn client_tokens_split_on_the_last_dot() {
        assert_eq!(client_token("c.1.abc").unwrap(), ("c.1", "abc"));
        assert!(client_token("nodot").is_err());
        assert!(client_token("a/b.x").is_err());
        assert!(client_token("id.").is_err());
    }
}
