//! The keys of secure aggregation and what is derived from them.
//!
//! - **Identity** (Ed25519, ring): made by the client at enrolment, its public half registered
//!   with the server. It signs the round keys the client advertises, so neither the server nor
//!   another client can substitute keys in a client's name.
//! - **Round keys** (X25519, x25519-dalek static secrets): per round attempt, `c` for the
//!   pairwise masks and `s` for encrypting Shamir shares to neighbours. They must be *static*
//!   (used for several agreements, and `c` is reconstructed by the server when its owner drops
//!   out), which ring's single-use X25519 keys cannot be.
//! - **Derived secrets**: every Diffie–Hellman result goes through HKDF-SHA256 with the round's
//!   [`Context`] and a purpose label, so keys of different rounds, attempts and purposes never
//!   coincide. An agreement with a low-order point (an all-zero shared secret) is refused.

use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, NONCE_LEN};
use ring::hkdf;
use ring::rand::{SecureRandom, SystemRandom};
use ring::signature::{self, Ed25519KeyPair, KeyPair};
use x25519_dalek::{PublicKey, StaticSecret};
use zeroize::Zeroizing;

use super::{Context, SecAggError};

const HKDF_SALT: &[u8] = b"hora-secagg-v1";
/// Bytes AES-GCM adds to an encrypted share bundle.
pub const SEAL_OVERHEAD: usize = 16;

/// A client's long-term signing key (Ed25519), stored by the client as PKCS#8.
pub struct Identity(Ed25519KeyPair);

impl Identity {
    /// A new identity; returns it and its PKCS#8 document (what the client stores).
    pub fn generate() -> Result<(Identity, Zeroizing<Vec<u8>>), SecAggError> {
        let rng = SystemRandom::new();
        let pkcs8 = Ed25519KeyPair::generate_pkcs8(&rng).map_err(|_| SecAggError::Rng)?;
        let doc = Zeroizing::new(pkcs8.as_ref().to_vec());
        Ok((Identity::from_pkcs8(&doc)?, doc))
    }

    pub fn from_pkcs8(doc: &[u8]) -> Result<Identity, SecAggError> {
        Ed25519KeyPair::from_pkcs8(doc)
            .map(Identity)
            .map_err(|e| SecAggError::Malformed(format!("not an Ed25519 PKCS#8 key: {e}")))
    }

    /// The identity whose Ed25519 private key is `seed` (a simulated client's, made from the
    /// simulation's seed; a deployed client's comes from [`Identity::generate`]).
    pub fn from_seed(seed: &[u8; 32]) -> Result<Identity, SecAggError> {
        Ed25519KeyPair::from_seed_unchecked(seed)
            .map(Identity)
            .map_err(|e| SecAggError::Malformed(format!("not an Ed25519 seed: {e}")))
    }

    /// The public key registered with the server (32 bytes).
    pub fn public_key(&self) -> [u8; 32] {
        let mut out = [0u8; 32];
        out.copy_from_slice(self.0.public_key().as_ref());
        out
    }

    pub(crate) fn sign(&self, message: &[u8]) -> [u8; 64] {
        let mut out = [0u8; 64];
        out.copy_from_slice(self.0.sign(message).as_ref());
        out
    }
}

/// Checks an Ed25519 `signature` of `message` by `public_key`.
pub(crate) fn verify(public_key: &[u8; 32], message: &[u8], signature: &[u8; 64]) -> bool {
    signature::UnparsedPublicKey::new(&signature::ED25519, public_key)
        .verify(message, signature)
        .is_ok()
}

/// What an advertisement's signature covers.
pub(crate) fn advert_message(ctx: &Context, client: &str, c: &[u8; 32], s: &[u8; 32]) -> Vec<u8> {
    let mut m = b"hora-secagg-v1 advertise".to_vec();
    ctx.encode_into(&mut m);
    put_str(&mut m, client);
    m.extend_from_slice(c);
    m.extend_from_slice(s);
    m
}

pub(crate) fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u32).to_be_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// A fresh X25519 static secret.
pub(crate) fn new_secret(rng: &SystemRandom) -> Result<StaticSecret, SecAggError> {
    let mut bytes = Zeroizing::new([0u8; 32]);
    rng.fill(bytes.as_mut()).map_err(|_| SecAggError::Rng)?;
    Ok(StaticSecret::from(*bytes))
}

/// X25519 with `theirs`, refusing low-order points (whose shared secret is all zeros).
pub(crate) fn agree(
    ours: &StaticSecret,
    theirs: &[u8; 32],
) -> Result<Zeroizing<[u8; 32]>, SecAggError> {
    let shared = ours.diffie_hellman(&PublicKey::from(*theirs));
    if !shared.was_contributory() {
        return Err(SecAggError::LowOrderKey);
    }
    Ok(Zeroizing::new(shared.to_bytes()))
}

struct Len(usize);

impl hkdf::KeyType for Len {
    fn len(&self) -> usize {
        self.0
    }
}

/// HKDF-SHA256(salt, `ikm`, info = context ‖ `label` ‖ `parts`) → 32 bytes.
pub(crate) fn derive(
    ikm: &[u8],
    ctx: &Context,
    label: &str,
    parts: &[&str],
) -> Result<Zeroizing<[u8; 32]>, SecAggError> {
    let mut info = Vec::new();
    ctx.encode_into(&mut info);
    put_str(&mut info, label);
    for p in parts {
        put_str(&mut info, p);
    }
    let prk = hkdf::Salt::new(hkdf::HKDF_SHA256, HKDF_SALT).extract(ikm);
    let mut out = Zeroizing::new([0u8; 32]);
    prk.expand(&[&info], Len(32))
        .and_then(|okm| okm.fill(out.as_mut()))
        .map_err(|_| SecAggError::Rng)?;
    Ok(out)
}

/// The AES-256-GCM key for shares `from` → `to`: its own key per direction, so the fixed
/// nonce is never used twice with one key. The associated data repeats the addressing.
fn share_key(
    ours: &StaticSecret,
    theirs: &[u8; 32],
    ctx: &Context,
    from: &str,
    to: &str,
) -> Result<(LessSafeKey, Vec<u8>), SecAggError> {
    let shared = agree(ours, theirs)?;
    let key = derive(shared.as_ref(), ctx, "share encryption", &[from, to])?;
    let unbound = UnboundKey::new(&AES_256_GCM, key.as_ref()).map_err(|_| SecAggError::Rng)?;
    let mut aad = Vec::new();
    ctx.encode_into(&mut aad);
    put_str(&mut aad, from);
    put_str(&mut aad, to);
    Ok((LessSafeKey::new(unbound), aad))
}

/// Encrypts `plaintext` from `from` (secret `ours`) to `to` (public `theirs`).
pub(crate) fn seal_to(
    ours: &StaticSecret,
    theirs: &[u8; 32],
    ctx: &Context,
    from: &str,
    to: &str,
    plaintext: &[u8],
) -> Result<Vec<u8>, SecAggError> {
    let (key, aad) = share_key(ours, theirs, ctx, from, to)?;
    let mut buf = plaintext.to_vec();
    key.seal_in_place_append_tag(
        Nonce::assume_unique_for_key([0u8; NONCE_LEN]),
        Aad::from(aad),
        &mut buf,
    )
    .map_err(|_| SecAggError::Rng)?;
    Ok(buf)
}

/// Opens what `from` (public `theirs`) encrypted to `to` (secret `ours`).
pub(crate) fn open_from(
    ours: &StaticSecret,
    theirs: &[u8; 32],
    ctx: &Context,
    from: &str,
    to: &str,
    ciphertext: &[u8],
) -> Result<Zeroizing<Vec<u8>>, SecAggError> {
    let (key, aad) = share_key(ours, theirs, ctx, from, to)?;
    let mut buf = Zeroizing::new(ciphertext.to_vec());
    let len = key
        .open_in_place(
            Nonce::assume_unique_for_key([0u8; NONCE_LEN]),
            Aad::from(aad),
            &mut buf,
        )
        .map_err(|_| {
            SecAggError::Forged(format!(
                "the shares `{from}` sent to `{to}` do not open: they were not encrypted by `{from}` for `{to}` in this round"
            ))
        })?
        .len();
    buf.truncate(len);
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx() -> Context {
        Context::new("t", 3, 1)
    }

    #[test]
    fn agreement_is_symmetric_and_refuses_low_order_points() {
        let rng = SystemRandom::new();
        let (a, b) = (new_secret(&rng).unwrap(), new_secret(&rng).unwrap());
        let (pa, pb) = (
            PublicKey::from(&a).to_bytes(),
            PublicKey::from(&b).to_bytes(),
        );
        assert_eq!(*agree(&a, &pb).unwrap(), *agree(&b, &pa).unwrap());
        // The identity point and a point of order 8 give an all-zero secret.
        let mut order8 = [0u8; 32];
        hex_decode(
            "e0eb7a7c3b41b8ae1656e3faf19fc46ada098deb9c32b1fd866205165f49b800",
            &mut order8,
        );
        for low in [[0u8; 32], order8] {
            assert!(matches!(agree(&a, &low), Err(SecAggError::LowOrderKey)));
        }
    }

    fn hex_decode(s: &str, out: &mut [u8]) {
        hex::decode_to_slice(s, out).unwrap();
    }

    #[test]
    fn shares_open_only_for_their_addressee_in_their_round() {
        let rng = SystemRandom::new();
        let (u, v, w) = (
            new_secret(&rng).unwrap(),
            new_secret(&rng).unwrap(),
            new_secret(&rng).unwrap(),
        );
        let pv = PublicKey::from(&v).to_bytes();
        let pu = PublicKey::from(&u).to_bytes();
        let pw = PublicKey::from(&w).to_bytes();
        let sealed = seal_to(&u, &pv, &ctx(), "u", "v", b"secret shares").unwrap();
        assert_eq!(
            &open_from(&v, &pu, &ctx(), "u", "v", &sealed).unwrap()[..],
            b"secret shares"
        );
        // Another recipient, another round, another claimed sender: refused.
        assert!(open_from(&w, &pu, &ctx(), "u", "w", &sealed).is_err());
        assert!(open_from(&v, &pu, &Context::new("t", 3, 2), "u", "v", &sealed).is_err());
        assert!(open_from(&v, &pw, &ctx(), "w", "v", &sealed).is_err());
        let mut flipped = sealed.clone();
        flipped[0] ^= 1;
        assert!(open_from(&v, &pu, &ctx(), "u", "v", &flipped).is_err());
    }

    #[test]
    fn signatures_bind_the_keys_and_the_round() {
        let (id, doc) = Identity::generate().unwrap();
        let again = Identity::from_pkcs8(&doc).unwrap();
        assert_eq!(id.public_key(), again.public_key());
        let m = advert_message(&ctx(), "c1", &[1; 32], &[2; 32]);
        let sig = id.sign(&m);
        assert!(verify(&id.public_key(), &m, &sig));
        let other_round = advert_message(&Context::new("t", 4, 1), "c1", &[1; 32], &[2; 32]);
        assert!(!verify(&id.public_key(), &other_round, &sig));
        let other_key = advert_message(&ctx(), "c1", &[1; 32], &[3; 32]);
        assert!(!verify(&id.public_key(), &other_key, &sig));
        assert!(Identity::from_pkcs8(b"not a key").is_err());
    }
}
