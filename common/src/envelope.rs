//! The sealed envelope: how a client's weight delta travels to the server.
//!
//! A delta is sealed to the *round key* of the round it belongs to: the client makes a fresh
//! X25519 key pair for each envelope, agrees a shared secret with the round's public key, derives
//! an AES-256-GCM key from it with HKDF-SHA256, and encrypts. The associated data binds the
//! envelope to its task, round, client id, the digest of the global model it was computed
//! against, and the round key itself, so a sealed delta cannot be replayed into another round,
//! passed off as another client's, or applied to another model: any of those makes [`open`] fail.
//!
//! ## Why a static round key (x25519-dalek) and not two ephemeral keys (ring alone)
//!
//! ring's X25519 private keys are single-use. Using only ring would force an interactive
//! handshake per client and round (each side sends an ephemeral key, the server stores the
//! derived AES key until the upload arrives). We instead give each round one key pair: the
//! secret is a `x25519_dalek::StaticSecret`, held by the server (and persisted with the round so
//! a restarted server can still open envelopes sealed before the crash), and its public half is
//! handed to clients when they poll. The client side stays ring's ephemeral key, so every
//! envelope still has its own AES key and sealing needs no round trip. When a round closes the
//! server drops the round secret (it is zeroized on drop), after which nobody — the server
//! included — can open that round's envelopes again: forward secrecy per round.
//!
//! ## Format (version 1)
//!
//! ```text
//! "HORA" | version u8 = 1 | client ephemeral public key [32] | nonce [12] | ciphertext | tag [16]
//! ```
//!
//! Key = HKDF-SHA256(salt = "hora-envelope-v1", ikm = X25519 shared secret,
//! info = ephemeral public ‖ round public). AAD = the 49-byte header ‖ the encoded [`Binding`]
//! ‖ round public key. Low-order round keys (all-zero shared secret) are refused on both sides.

use ring::aead::{self, Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, NONCE_LEN};
use ring::agreement::{self, EphemeralPrivateKey, UnparsedPublicKey, X25519};
use ring::hkdf;
use ring::rand::{SecureRandom, SystemRandom};
use serde::{Deserialize, Serialize};
use thiserror::Error;
use zeroize::Zeroizing;

use crate::model::ModelDigest;

const MAGIC: &[u8; 4] = b"HORA";
/// The envelope format this crate writes.
pub const VERSION: u8 = 1;
const KEY_LEN: usize = 32;
const TAG_LEN: usize = 16;
/// Bytes before the ciphertext.
pub const HEADER_LEN: usize = MAGIC.len() + 1 + KEY_LEN + NONCE_LEN;
/// Bytes an envelope adds to its plaintext.
pub const OVERHEAD: usize = HEADER_LEN + TAG_LEN;
const HKDF_SALT: &[u8] = b"hora-envelope-v1";

/// What an envelope is bound to. Every field must match at [`open`] or opening fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Binding<'a> {
    pub task: &'a str,
    pub round: u64,
    pub client: &'a str,
    /// Digest of the global model the delta was computed against.
    pub base_model: &'a ModelDigest,
}

impl Binding<'_> {
    /// Unambiguous encoding: every variable-length field is length-prefixed.
    fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(b"hora-binding-v1\0");
        out.extend_from_slice(&(self.task.len() as u64).to_le_bytes());
        out.extend_from_slice(self.task.as_bytes());
        out.extend_from_slice(&self.round.to_le_bytes());
        out.extend_from_slice(&(self.client.len() as u64).to_le_bytes());
        out.extend_from_slice(self.client.as_bytes());
        out.extend_from_slice(&self.base_model.0);
    }
}

/// Which piece of a chunked upload an envelope holds: chunk `index` (from 0) of the
/// `length`-byte plaintext whose SHA-256 is `upload`, cut into chunks of `chunk_bytes` (the last
/// one shorter).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunk<'a> {
    pub upload: &'a [u8; 32],
    pub length: u64,
    pub chunk_bytes: u64,
    pub index: u64,
}

impl Chunk<'_> {
    fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(b"hora-chunk-v1\0");
        out.extend_from_slice(self.upload);
        for n in [self.length, self.chunk_bytes, self.index] {
            out.extend_from_slice(&n.to_le_bytes());
        }
    }

    /// How many chunks the upload has (at least one: an empty plaintext is one empty chunk).
    pub fn count(length: u64, chunk_bytes: u64) -> u64 {
        length.div_ceil(chunk_bytes.max(1)).max(1)
    }

    /// Where this chunk's plaintext lies in the whole, or None when its index is past the end
    /// (or the chunk size is 0).
    pub fn range(&self) -> Option<std::ops::Range<u64>> {
        chunk_range(self.length, self.chunk_bytes, self.index)
    }
}

/// Where chunk `index` of an upload of `length` bytes cut in chunks of `chunk_bytes` lies in
/// the whole, or None when it is past the end (or the chunk size is 0).
pub fn chunk_range(length: u64, chunk_bytes: u64, index: u64) -> Option<std::ops::Range<u64>> {
    if chunk_bytes == 0 {
        return None;
    }
    let start = index.checked_mul(chunk_bytes)?;
    let count = Chunk::count(length, chunk_bytes);
    (index < count).then(|| start..(start + chunk_bytes).min(length))
}

/// The public half of a round key, handed to clients (hex in JSON).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct RoundPublicKey(pub [u8; KEY_LEN]);

impl std::fmt::Debug for RoundPublicKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RoundPublicKey({})", hex::encode(self.0))
    }
}

impl utoipa::PartialSchema for RoundPublicKey {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        crate::model::hex_schema("X25519 public key of the round, 64 hex digits")
    }
}

impl utoipa::ToSchema for RoundPublicKey {}

impl Serialize for RoundPublicKey {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&hex::encode(self.0))
    }
}

impl<'de> Deserialize<'de> for RoundPublicKey {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        let mut out = [0u8; KEY_LEN];
        hex::decode_to_slice(&s, &mut out)
            .map_err(|_| serde::de::Error::custom("a round public key is 64 hex digits"))?;
        Ok(RoundPublicKey(out))
    }
}

/// A round's secret key. Zeroized when dropped.
pub struct RoundSecretKey(x25519_dalek::StaticSecret);

impl RoundSecretKey {
    /// A fresh key from the operating system's CSPRNG.
    pub fn generate() -> Result<Self, EnvelopeError> {
        let mut bytes = Zeroizing::new([0u8; KEY_LEN]);
        SystemRandom::new()
            .fill(bytes.as_mut())
            .map_err(|_| EnvelopeError::Random)?;
        Ok(RoundSecretKey(x25519_dalek::StaticSecret::from(*bytes)))
    }

    /// Restores a key persisted with [`RoundSecretKey::to_bytes`].
    pub fn from_bytes(bytes: [u8; KEY_LEN]) -> Self {
        RoundSecretKey(x25519_dalek::StaticSecret::from(bytes))
    }

    /// The secret's bytes, for the server's store. Handle with care.
    pub fn to_bytes(&self) -> Zeroizing<[u8; KEY_LEN]> {
        Zeroizing::new(self.0.to_bytes())
    }

    pub fn public_key(&self) -> RoundPublicKey {
        RoundPublicKey(x25519_dalek::PublicKey::from(&self.0).to_bytes())
    }
}

/// Why an envelope could not be sealed or opened.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum EnvelopeError {
    #[error("envelope too short: {0} bytes, at least {OVERHEAD} expected")]
    Truncated(usize),
    #[error("not a Hora envelope (bad magic bytes)")]
    BadMagic,
    #[error("envelope version {0} is not supported (this build reads version {VERSION})")]
    UnsupportedVersion(u8),
    #[error("the round public key is invalid (low-order point); ask the server for the current round key")]
    BadKey,
    #[error(
        "authentication failed: the envelope was altered, or sealed for another task, round, \
         client, model or round key"
    )]
    Rejected,
    #[error("the system random number generator failed")]
    Random,
    #[error("the upload has no chunk {0}")]
    NoSuchChunk(u64),
}

/// Seals `plaintext` to `recipient` (the round's public key), bound to `binding`.
pub fn seal(
    plaintext: &[u8],
    recipient: &RoundPublicKey,
    binding: &Binding<'_>,
) -> Result<Vec<u8>, EnvelopeError> {
    seal_bound(plaintext, recipient, binding, None)
}

/// Seals one chunk of a chunked upload: [`seal`], bound to `chunk` as well.
pub fn seal_chunk(
    plaintext: &[u8],
    recipient: &RoundPublicKey,
    binding: &Binding<'_>,
    chunk: &Chunk<'_>,
) -> Result<Vec<u8>, EnvelopeError> {
    seal_bound(plaintext, recipient, binding, Some(chunk))
}

/// Seals chunk `index` of an upload whose whole plaintext is `plaintext` (its SHA-256 `upload`,
/// cut in chunks of `chunk_bytes`): [`seal_chunk`] of the bytes [`Chunk::range`] names.
pub fn seal_chunk_of(
    plaintext: &[u8],
    upload: &[u8; 32],
    chunk_bytes: u64,
    index: u64,
    recipient: &RoundPublicKey,
    binding: &Binding<'_>,
) -> Result<Vec<u8>, EnvelopeError> {
    let chunk = Chunk {
        upload,
        length: plaintext.len() as u64,
        chunk_bytes,
        index,
    };
    let range = chunk.range().ok_or(EnvelopeError::NoSuchChunk(index))?;
    seal_chunk(
        &plaintext[range.start as usize..range.end as usize],
        recipient,
        binding,
        &chunk,
    )
}

fn seal_bound(
    plaintext: &[u8],
    recipient: &RoundPublicKey,
    binding: &Binding<'_>,
    chunk: Option<&Chunk<'_>>,
) -> Result<Vec<u8>, EnvelopeError> {
    let rng = SystemRandom::new();
    let ephemeral =
        EphemeralPrivateKey::generate(&X25519, &rng).map_err(|_| EnvelopeError::Random)?;
    let ephemeral_public = ephemeral
        .compute_public_key()
        .map_err(|_| EnvelopeError::Random)?;
    let mut nonce = [0u8; NONCE_LEN];
    rng.fill(&mut nonce).map_err(|_| EnvelopeError::Random)?;

    let mut out = Vec::with_capacity(plaintext.len() + OVERHEAD);
    out.extend_from_slice(MAGIC);
    out.push(VERSION);
    out.extend_from_slice(ephemeral_public.as_ref());
    out.extend_from_slice(&nonce);

    // ring refuses an all-zero shared secret, i.e. a low-order recipient key.
    let key = agreement::agree_ephemeral(
        ephemeral,
        &UnparsedPublicKey::new(&X25519, recipient.0),
        |shared| derive_key(shared, ephemeral_public.as_ref(), &recipient.0),
    )
    .map_err(|_| EnvelopeError::BadKey)??;

    let aad = associated_data(&out[..HEADER_LEN], binding, chunk, recipient);
    out.extend_from_slice(plaintext);
    let tag = key
        .seal_in_place_separate_tag(
            Nonce::assume_unique_for_key(nonce),
            Aad::from(&aad),
            &mut out[HEADER_LEN..],
        )
        .map_err(|_| EnvelopeError::Rejected)?;
    out.extend_from_slice(tag.as_ref());
    Ok(out)
}

/// Opens an envelope in place with the round's secret key and returns the plaintext, a slice of
/// `envelope`. Fails without revealing anything if a single byte or any binding field differs.
pub fn open<'e>(
    envelope: &'e mut [u8],
    key: &RoundSecretKey,
    binding: &Binding<'_>,
) -> Result<&'e mut [u8], EnvelopeError> {
    open_bound(envelope, key, binding, None)
}

/// Opens one chunk sealed by [`seal_chunk`]: [`open`], bound to `chunk` as well.
pub fn open_chunk<'e>(
    envelope: &'e mut [u8],
    key: &RoundSecretKey,
    binding: &Binding<'_>,
    chunk: &Chunk<'_>,
) -> Result<&'e mut [u8], EnvelopeError> {
    open_bound(envelope, key, binding, Some(chunk))
}

fn open_bound<'e>(
    envelope: &'e mut [u8],
    key: &RoundSecretKey,
    binding: &Binding<'_>,
    chunk: Option<&Chunk<'_>>,
) -> Result<&'e mut [u8], EnvelopeError> {
    if envelope.len() < OVERHEAD {
        return Err(EnvelopeError::Truncated(envelope.len()));
    }
    if &envelope[..MAGIC.len()] != MAGIC {
        return Err(EnvelopeError::BadMagic);
    }
    if envelope[MAGIC.len()] != VERSION {
        return Err(EnvelopeError::UnsupportedVersion(envelope[MAGIC.len()]));
    }
    let (header, body) = envelope.split_at_mut(HEADER_LEN);
    let mut ephemeral_public = [0u8; KEY_LEN];
    ephemeral_public.copy_from_slice(&header[5..5 + KEY_LEN]);
    let mut nonce = [0u8; NONCE_LEN];
    nonce.copy_from_slice(&header[5 + KEY_LEN..]);

    let recipient = key.public_key();
    let shared = key
        .0
        .diffie_hellman(&x25519_dalek::PublicKey::from(ephemeral_public));
    if !shared.was_contributory() {
        return Err(EnvelopeError::Rejected);
    }
    let aead_key = derive_key(shared.as_bytes(), &ephemeral_public, &recipient.0)?;
    let aad = associated_data(header, binding, chunk, &recipient);
    aead_key
        .open_in_place(Nonce::assume_unique_for_key(nonce), Aad::from(&aad), body)
        .map_err(|_| EnvelopeError::Rejected)
}

fn derive_key(
    shared: &[u8],
    ephemeral_public: &[u8],
    recipient: &[u8; KEY_LEN],
) -> Result<LessSafeKey, EnvelopeError> {
    let info = [ephemeral_public, recipient.as_slice()];
    let prk = hkdf::Salt::new(hkdf::HKDF_SHA256, HKDF_SALT).extract(shared);
    let okm = prk
        .expand(&info, &AES_256_GCM)
        .map_err(|_| EnvelopeError::Rejected)?;
    Ok(LessSafeKey::new(UnboundKey::from(okm)))
}

fn associated_data(
    header: &[u8],
    binding: &Binding<'_>,
    chunk: Option<&Chunk<'_>>,
    recipient: &RoundPublicKey,
) -> Vec<u8> {
    let mut aad = Vec::with_capacity(HEADER_LEN + 192);
    aad.extend_from_slice(header);
    binding.encode(&mut aad);
    if let Some(chunk) = chunk {
        chunk.encode(&mut aad);
    }
    aad.extend_from_slice(&recipient.0);
    aad
}

// Keep the AEAD's tag length and ours in step.
const _: () = assert!(TAG_LEN == aead::MAX_TAG_LEN);

#[cfg(test)]
mod tests {
    use super::*;

    fn digest(byte: u8) -> ModelDigest {
        ModelDigest([byte; 32])
    }

    fn sealed() -> (RoundSecretKey, ModelDigest, Vec<u8>, Vec<u8>) {
        let key = RoundSecretKey::generate().unwrap();
        let d = digest(7);
        let plaintext: Vec<u8> = (0..10_000u32).flat_map(|i| i.to_le_bytes()).collect();
        let b = Binding {
            task: "mnist",
            round: 3,
            client: "c-42",
            base_model: &d,
        };
        let env = seal(&plaintext, &key.public_key(), &b).unwrap();
        (key, d, plaintext, env)
    }

    #[test]
    fn round_trip() {
        let (key, d, plaintext, mut env) = sealed();
        assert_eq!(env.len(), plaintext.len() + OVERHEAD);
        assert_ne!(
            &env[HEADER_LEN..HEADER_LEN + 64],
            &plaintext[..64],
            "payload must be encrypted"
        );
        let b = Binding {
            task: "mnist",
            round: 3,
            client: "c-42",
            base_model: &d,
        };
        assert_eq!(open(&mut env, &key, &b).unwrap(), &plaintext[..]);
    }

    #[test]
    fn a_restored_key_opens_what_the_original_sealed() {
        let (key, d, plaintext, mut env) = sealed();
        let restored = RoundSecretKey::from_bytes(*key.to_bytes());
        assert_eq!(restored.public_key(), key.public_key());
        let b = Binding {
            task: "mnist",
            round: 3,
            client: "c-42",
            base_model: &d,
        };
        assert_eq!(open(&mut env, &restored, &b).unwrap(), &plaintext[..]);
    }

    #[test]
    fn every_tampered_byte_region_is_rejected() {
        let (key, d, _, env) = sealed();
        let b = Binding {
            task: "mnist",
            round: 3,
            client: "c-42",
            base_model: &d,
        };
        let regions = [
            ("ephemeral key", 5),
            ("nonce", 5 + KEY_LEN + 3),
            ("ciphertext", HEADER_LEN + 100),
            ("last ciphertext byte", env.len() - TAG_LEN - 1),
            ("tag", env.len() - 1),
        ];
        for (what, at) in regions {
            let mut t = env.clone();
            t[at] ^= 0x01;
            assert_eq!(
                open(&mut t, &key, &b),
                Err(EnvelopeError::Rejected),
                "{what}"
            );
        }
        let mut t = env.clone();
        t[0] = b'X';
        assert_eq!(open(&mut t, &key, &b), Err(EnvelopeError::BadMagic));
        let mut t = env.clone();
        t[4] = 2;
        assert_eq!(
            open(&mut t, &key, &b),
            Err(EnvelopeError::UnsupportedVersion(2))
        );
        let mut t = env[..OVERHEAD - 1].to_vec();
        assert_eq!(
            open(&mut t, &key, &b),
            Err(EnvelopeError::Truncated(OVERHEAD - 1))
        );
        let mut t = env[..env.len() - 5].to_vec();
        assert_eq!(
            open(&mut t, &key, &b),
            Err(EnvelopeError::Rejected),
            "truncated"
        );
    }

    #[test]
    fn every_binding_field_is_checked() {
        let (key, d, _, env) = sealed();
        let other = digest(8);
        let wrong = [
            (
                "task",
                Binding {
                    task: "mnist2",
                    round: 3,
                    client: "c-42",
                    base_model: &d,
                },
            ),
            (
                "round",
                Binding {
                    task: "mnist",
                    round: 4,
                    client: "c-42",
                    base_model: &d,
                },
            ),
            (
                "client",
                Binding {
                    task: "mnist",
                    round: 3,
                    client: "c-43",
                    base_model: &d,
                },
            ),
            (
                "model",
                Binding {
                    task: "mnist",
                    round: 3,
                    client: "c-42",
                    base_model: &other,
                },
            ),
            // Length prefixes keep field boundaries: moving a character between fields fails too.
            (
                "boundary",
                Binding {
                    task: "mnistc",
                    round: 3,
                    client: "-42",
                    base_model: &d,
                },
            ),
        ];
        for (what, b) in wrong {
            let mut t = env.clone();
            assert_eq!(
                open(&mut t, &key, &b),
                Err(EnvelopeError::Rejected),
                "{what}"
            );
        }
        let other_key = RoundSecretKey::generate().unwrap();
        let mut t = env.clone();
        let b = Binding {
            task: "mnist",
            round: 3,
            client: "c-42",
            base_model: &d,
        };
        assert_eq!(
            open(&mut t, &other_key, &b),
            Err(EnvelopeError::Rejected),
            "other round key"
        );
    }

    #[test]
    fn a_chunk_opens_only_as_the_chunk_it_was_sealed_as() {
        let key = RoundSecretKey::generate().unwrap();
        let d = digest(3);
        let b = Binding {
            task: "t",
            round: 1,
            client: "c",
            base_model: &d,
        };
        let (upload, other) = ([1u8; 32], [2u8; 32]);
        let chunk = Chunk {
            upload: &upload,
            length: 10,
            chunk_bytes: 4,
            index: 1,
        };
        let env = seal_chunk(b"4567", &key.public_key(), &b, &chunk).unwrap();
        assert_eq!(
            open_chunk(&mut env.clone(), &key, &b, &chunk).unwrap(),
            b"4567"
        );
        // Sealed from the whole plaintext, chunk 1 is the same piece; there is no chunk 3.
        let whole = b"0123456789";
        let mut of = seal_chunk_of(whole, &upload, 4, 1, &key.public_key(), &b).unwrap();
        assert_eq!(open_chunk(&mut of, &key, &b, &chunk).unwrap(), b"4567");
        assert_eq!(
            seal_chunk_of(whole, &upload, 4, 3, &key.public_key(), &b),
            Err(EnvelopeError::NoSuchChunk(3))
        );
        let wrong = [
            ("replayed at another index", Chunk { index: 2, ..chunk }),
            (
                "of another upload",
                Chunk {
                    upload: &other,
                    ..chunk
                },
            ),
            (
                "of another length",
                Chunk {
                    length: 11,
                    ..chunk
                },
            ),
            (
                "cut to another size",
                Chunk {
                    chunk_bytes: 5,
                    ..chunk
                },
            ),
        ];
        for (what, c) in wrong {
            assert_eq!(
                open_chunk(&mut env.clone(), &key, &b, &c),
                Err(EnvelopeError::Rejected),
                "{what}"
            );
        }
        // A chunk is no whole envelope, and a whole envelope no chunk.
        assert_eq!(
            open(&mut env.clone(), &key, &b),
            Err(EnvelopeError::Rejected)
        );
        let mut whole = seal(b"4567", &key.public_key(), &b).unwrap();
        assert_eq!(
            open_chunk(&mut whole, &key, &b, &chunk),
            Err(EnvelopeError::Rejected)
        );
        // Where chunks lie.
        assert_eq!(Chunk::count(10, 4), 3);
        assert_eq!(Chunk::count(0, 4), 1);
        assert_eq!(Chunk { index: 2, ..chunk }.range(), Some(8..10));
        assert_eq!(Chunk { index: 3, ..chunk }.range(), None);
        assert_eq!(
            Chunk {
                index: u64::MAX,
                ..chunk
            }
            .range(),
            None
        );
    }

    #[test]
    fn low_order_keys_are_refused() {
        let d = digest(1);
        let b = Binding {
            task: "t",
            round: 0,
            client: "c",
            base_model: &d,
        };
        assert_eq!(
            seal(b"x", &RoundPublicKey([0; 32]), &b),
            Err(EnvelopeError::BadKey)
        );
        // An envelope whose ephemeral key is a low-order point is refused by the opener.
        let key = RoundSecretKey::generate().unwrap();
        let mut env = seal(b"hello", &key.public_key(), &b).unwrap();
        env[5..5 + KEY_LEN].fill(0);
        assert_eq!(open(&mut env, &key, &b), Err(EnvelopeError::Rejected));
    }

    #[test]
    fn empty_plaintext_and_json_public_key() {
        let key = RoundSecretKey::generate().unwrap();
        let d = digest(2);
        let b = Binding {
            task: "t",
            round: 1,
            client: "c",
            base_model: &d,
        };
        let mut env = seal(&[], &key.public_key(), &b).unwrap();
        assert_eq!(open(&mut env, &key, &b).unwrap(), &[] as &[u8]);
        let json = serde_json::to_string(&key.public_key()).unwrap();
        assert_eq!(
            serde_json::from_str::<RoundPublicKey>(&json).unwrap(),
            key.public_key()
        );
        assert!(serde_json::from_str::<RoundPublicKey>("\"abcd\"").is_err());
    }
}
