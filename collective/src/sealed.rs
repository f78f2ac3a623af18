//! Ring frames sealed with AES-256-GCM once neighbours have proved themselves.
//!
//! The handshake (`handshake`) proves that both ends of a connection know the world's session;
//! what follows it — headers and payloads, control and data, credits and aborts — would otherwise
//! cross the network as it is, so anyone who could inject TCP segments between two workers could
//! rewrite a reduction or a broadcast object. Each direction of each connection therefore gets
//! its own AES-256-GCM key, derived with HKDF from the session over the handshake's transcript
//! (both fresh nonces, the protocol version, the generation, the world size and both ranks; see
//! [`crate::handshake::RingKey::frame_keys`]), so no key is ever used on two connections or in
//! two directions. The nonce is a counter that starts at zero and goes up by one per record and
//! is never sent: a record that is altered, replayed, dropped, reordered or injected fails its
//! tag, and from then on the connection opens nothing more (it fails closed, and the ring stops
//! with an error naming the rank at the other end).
//!
//! A frame is two records: its 16-byte header (kind, auxiliary word, payload length), sealed on
//! its own so that the length is authenticated before anything is allocated for the payload, and
//! then, if the payload is not empty, the payload. Each record carries a 16-byte tag.
//!
//! A world may turn sealing off (`CommOptions::seal_frames`, for a network where nobody else can
//! reach the workers and every byte of bandwidth counts): its frames are then plain, with no
//! tags, as they were before sealing existed. Both ends of a connection must agree, and the
//! choice is part of what the handshake proves, so nobody on the way can turn it off.

use ring::aead::{self, Aad, LessSafeKey, Nonce, Tag, UnboundKey};

/// Bytes of a record's tag.
pub(crate) const TAG_LEN: usize = 16;

/// The key of one direction of one connection.
pub(crate) struct DirectionKey(pub(crate) UnboundKey);

/// Why a record could not be sealed or opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SealError {
    /// The tag did not match: the record was altered, replayed, dropped, reordered or injected
    /// (or an earlier one was, and the connection opens nothing since).
    Forged,
    /// 2^64 records under one key: never in practice, but never a repeated nonce either.
    Exhausted,
}

/// The counter nonce of record `n`: four zero bytes, then `n` little-endian.
fn nonce(n: u64) -> Nonce {
    let mut bytes = [0u8; aead::NONCE_LEN];
    bytes[4..].copy_from_slice(&n.to_le_bytes());
    Nonce::assume_unique_for_key(bytes)
}

/// The sending half of one direction: seals records in order (or, unsealed, passes them).
pub(crate) struct Sealer {
    /// `None`: this world's frames are plain.
    key: Option<LessSafeKey>,
    next: u64,
}

impl Sealer {
    pub fn new(key: DirectionKey) -> Sealer {
        Sealer {
            key: Some(LessSafeKey::new(key.0)),
            next: 0,
        }
    }

    /// Records as they are, with no tags.
    pub fn plain() -> Sealer {
        Sealer { key: None, next: 0 }
    }

    /// Bytes of each record's tag: `TAG_LEN`, or 0 when unsealed.
    pub fn tag_len(&self) -> usize {
        if self.key.is_some() {
            TAG_LEN
        } else {
            0
        }
    }

    /// Encrypts `in_out` in place and writes its tag into `tag` (`tag_len()` bytes).
    pub fn seal(&mut self, in_out: &mut [u8], tag: &mut [u8]) -> Result<(), SealError> {
        let Some(key) = &self.key else {
            return Ok(());
        };
        let n = self.next;
        self.next = n.checked_add(1).ok_or(SealError::Exhausted)?;
        let sealed = key
            .seal_in_place_separate_tag(nonce(n), Aad::empty(), in_out)
            .map_err(|_| SealError::Exhausted)?;
        tag.copy_from_slice(sealed.as_ref());
        Ok(())
    }
}

/// The receiving half of one direction: opens records in order, and nothing after a failure.
pub(crate) struct Opener {
    /// `None`: this world's frames are plain.
    key: Option<LessSafeKey>,
    /// The next record's counter; `None` once a record failed.
    next: Option<u64>,
}

impl Opener {
    pub fn new(key: DirectionKey) -> Opener {
        Opener {
            key: Some(LessSafeKey::new(key.0)),
            next: Some(0),
        }
    }

    /// Records as they are, with no tags.
    pub fn plain() -> Opener {
        Opener {
            key: None,
            next: Some(0),
        }
    }

    /// Bytes of each record's tag: `TAG_LEN`, or 0 when unsealed.
    pub fn tag_len(&self) -> usize {
        if self.key.is_some() {
            TAG_LEN
        } else {
            0
        }
    }

    /// Decrypts `in_out` in place if `tag` is its tag as the next record in order.
    pub fn open(&mut self, in_out: &mut [u8], tag: &[u8]) -> Result<(), SealError> {
        let Some(key) = &self.key else {
            return Ok(());
        };
        let n = self.next.take().ok_or(SealError::Forged)?;
        let tag = Tag::try_from(tag).map_err(|_| SealError::Forged)?;
        key.open_in_place_separate_tag(nonce(n), Aad::empty(), tag, in_out, 0..)
            .map_err(|_| SealError::Forged)?;
        self.next = Some(n.checked_add(1).ok_or(SealError::Exhausted)?);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair() -> (Sealer, Opener) {
        let key = || DirectionKey(UnboundKey::new(&aead::AES_256_GCM, &[9; 32]).unwrap());
        (Sealer::new(key()), Opener::new(key()))
    }

    fn sealed(sealer: &mut Sealer, text: &[u8]) -> (Vec<u8>, [u8; TAG_LEN]) {
        let (mut body, mut tag) = (text.to_vec(), [0; TAG_LEN]);
        sealer.seal(&mut body, &mut tag).unwrap();
        (body, tag)
    }

    #[test]
    fn records_open_in_order_and_are_not_readable_on_the_way() {
        let (mut sealer, mut opener) = pair();
        for text in [&b"op header"[..], b"", &[0u8; 4096]] {
            let (mut body, tag) = sealed(&mut sealer, text);
            if !text.is_empty() {
                assert_ne!(body, text);
            }
            opener.open(&mut body, &tag).unwrap();
            assert_eq!(body, text);
        }
    }

    #[test]
    fn an_altered_dropped_replayed_or_reordered_record_fails_and_so_does_everything_after() {
        // Altered: one bit of the body, or of the tag.
        for flip in [0usize, 20] {
            let (mut sealer, mut opener) = pair();
            let (mut body, mut tag) = sealed(&mut sealer, &[1; 16]);
            if flip < 16 {
                body[flip] ^= 1;
            } else {
                tag[flip - 16] ^= 1;
            }
            assert_eq!(opener.open(&mut body, &tag), Err(SealError::Forged));
            // Fails closed: the next genuine record is refused too.
            let (mut next, next_tag) = sealed(&mut sealer, &[2; 16]);
            assert_eq!(opener.open(&mut next, &next_tag), Err(SealError::Forged));
        }
        // Dropped (a counter gap): record 1 arrives where record 0 was due.
        let (mut sealer, mut opener) = pair();
        let _first = sealed(&mut sealer, b"first");
        let (mut second, tag) = sealed(&mut sealer, b"second");
        assert_eq!(opener.open(&mut second, &tag), Err(SealError::Forged));
        // Replayed: record 0 again where record 1 was due.
        let (mut sealer, mut opener) = pair();
        let (first, tag) = sealed(&mut sealer, b"first");
        opener.open(&mut first.clone(), &tag).unwrap();
        assert_eq!(
            opener.open(&mut first.clone(), &tag),
            Err(SealError::Forged)
        );
    }

    #[test]
    fn another_key_opens_nothing() {
        let (mut sealer, _) = pair();
        let other = DirectionKey(UnboundKey::new(&aead::AES_256_GCM, &[8; 32]).unwrap());
        let (mut body, tag) = sealed(&mut sealer, b"weights");
        assert_eq!(
            Opener::new(other).open(&mut body, &tag),
            Err(SealError::Forged)
        );
    }
}
