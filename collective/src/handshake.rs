//! Proving membership of a ring: what two neighbours exchange before either trusts the other.
//!
//! Every member of a world knows its session and nobody else does: at a server it is 128 random
//! bits handed (over TLS) only to workers holding the job's token, fresh for every world; with
//! `--peers` it is derived from the operator's shared secret and the peer list
//! ([`crate::World::from_peers`]). The session itself never crosses the ring. Instead, when a
//! worker accepts a connection it sends a fresh random nonce; the connecting side answers with
//! its own nonce and an HMAC-SHA256 over the transcript — both nonces, the protocol version, the
//! world's generation and size, and the two ranks — under a key derived from the session with
//! HKDF; the accepting side checks it in constant time and only then answers with its own HMAC
//! over the same transcript, so the connecting side knows in turn that it reached a member and
//! not whoever listens at its neighbour's address.
//!
//! The two proofs are made under different labels, so one side's proof can never be reflected
//! back as the other's; the nonces make every proof good for one connection only. A stranger
//! learns a random nonce and, at most, that it was refused.
//!
//! The same transcript keys what follows: every frame after the proofs is sealed with
//! AES-256-GCM under a key of its own connection and direction, derived from the session with
//! HKDF over both nonces and the terms (see `sealed`), so nothing after the handshake can be
//! read, altered or injected by whoever sits between two workers.
//!
//! What this does not do: a proof captured by whoever can impersonate a neighbour's address is a
//! guess-checker for the session: at a server the session is random, but a `--peers` secret
//! must be long and random for the same reason. And there is no forward secrecy: whoever learns
//! the session later can read a recorded ring's traffic.

use ring::rand::{SecureRandom, SystemRandom};
use ring::{aead, hkdf, hmac};

use crate::sealed::DirectionKey;
use crate::{CollectiveError, Result};

/// Bytes of each side's nonce.
pub(crate) const NONCE_LEN: usize = 32;
/// Bytes of a proof (an HMAC-SHA256 tag).
pub(crate) const PROOF_LEN: usize = 32;

/// HKDF salt and purpose: this key authenticates ring handshakes and nothing else.
const SALT: &[u8] = b"hora sync ring";
const PURPOSE: &[u8] = b"hora sync ring handshake key v2";
/// HKDF purpose of the keys that seal the frames after the handshake.
const FRAMES: &[u8] = b"hora sync ring frame key v3";

/// Which end of a connection a proof comes from; each end proves under its own label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    /// The side that connects to its right neighbour (and sends to it afterwards).
    Connector,
    /// The side that accepts its left neighbour (and receives from it afterwards).
    Acceptor,
}

impl Role {
    fn label(self) -> &'static [u8] {
        match self {
            Role::Connector => b"connector proves",
            Role::Acceptor => b"acceptor proves",
        }
    }
}

/// What both ends of one ring connection must agree on, besides the session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LinkTerms {
    pub version: u32,
    pub generation: u64,
    pub size: u32,
    /// The connecting (sending) rank.
    pub from: u32,
    /// The accepting (receiving) rank.
    pub to: u32,
    /// Whether the frames after the handshake are sealed (proved, so nobody on the way can turn
    /// it off).
    pub sealed: bool,
}

/// The two nonces of one connection.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Nonces {
    pub acceptor: [u8; NONCE_LEN],
    pub connector: [u8; NONCE_LEN],
}

/// The keys of one connection's frames, one per direction.
pub(crate) struct FrameKeys {
    /// What the connecting side sends (collective headers, data, aborts).
    pub to_acceptor: DirectionKey,
    /// What the accepting side sends back (slot credits).
    pub to_connector: DirectionKey,
}

/// The key a world's members prove membership with, and the secret the frame keys come from.
#[derive(Clone)]
pub(crate) struct RingKey {
    proofs: hmac::Key,
    /// HKDF-SHA256's pseudo-random key of the session.
    prk: hkdf::Prk,
}

impl std::fmt::Debug for RingKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RingKey(..)")
    }
}

impl RingKey {
    /// HKDF-SHA256 of the session, for this purpose only.
    pub fn derive(session: &str) -> RingKey {
        let prk = hkdf::Salt::new(hkdf::HKDF_SHA256, SALT).extract(session.as_bytes());
        let okm = prk
            .expand(&[PURPOSE], hmac::HMAC_SHA256)
            // Cannot fail: HKDF-SHA256 gives up to 8160 bytes and an HMAC key takes 32.
            .expect("an HMAC-SHA256 key is within HKDF-SHA256's output limit");
        RingKey {
            proofs: hmac::Key::from(okm),
            prk,
        }
    }

    /// `role`'s proof for one connection.
    pub fn prove(&self, role: Role, terms: &LinkTerms, nonces: &Nonces) -> [u8; PROOF_LEN] {
        let tag = hmac::sign(&self.proofs, &transcript(role, terms, nonces));
        let mut proof = [0u8; PROOF_LEN];
        proof.copy_from_slice(tag.as_ref());
        proof
    }

    /// Whether `proof` is `role`'s proof for this connection (compared in constant time).
    pub fn verify(&self, role: Role, terms: &LinkTerms, nonces: &Nonces, proof: &[u8]) -> bool {
        hmac::verify(&self.proofs, &transcript(role, terms, nonces), proof).is_ok()
    }

    /// The AES-256-GCM keys of one connection's frames: HKDF-SHA256 of the session over the
    /// connection's transcript and the direction, so that every connection and direction has
    /// keys of its own (the nonces are fresh for each connection).
    pub fn frame_keys(&self, terms: &LinkTerms, nonces: &Nonces) -> FrameKeys {
        let fields = fields(terms, nonces);
        let key = |direction: &[u8]| {
            let info = [FRAMES, direction, &fields];
            let okm = self
                .prk
                .expand(&info, &aead::AES_256_GCM)
                // Cannot fail: an AES-256 key is 32 bytes, far within HKDF-SHA256's limit.
                .expect("an AES-256-GCM key is within HKDF-SHA256's output limit");
            DirectionKey(aead::UnboundKey::from(okm))
        };
        FrameKeys {
            to_acceptor: key(b"connector to acceptor"),
            to_connector: key(b"acceptor to connector"),
        }
    }
}

/// What a proof covers: fixed-width fields, so no two transcripts read alike.
fn transcript(role: Role, terms: &LinkTerms, nonces: &Nonces) -> Vec<u8> {
    let label = role.label();
    let mut t = Vec::with_capacity(1 + label.len() + 24 + 2 * NONCE_LEN);
    t.push(label.len() as u8);
    t.extend_from_slice(label);
    t.extend_from_slice(&fields(terms, nonces));
    t
}

/// The connection's terms and nonces, at fixed widths.
fn fields(terms: &LinkTerms, nonces: &Nonces) -> Vec<u8> {
    let mut t = Vec::with_capacity(24 + 2 * NONCE_LEN);
    t.extend_from_slice(&terms.version.to_le_bytes());
    t.extend_from_slice(&terms.generation.to_le_bytes());
    t.extend_from_slice(&terms.size.to_le_bytes());
    t.extend_from_slice(&terms.from.to_le_bytes());
    t.extend_from_slice(&terms.to.to_le_bytes());
    t.push(u8::from(terms.sealed));
    t.extend_from_slice(&nonces.acceptor);
    t.extend_from_slice(&nonces.connector);
    t
}

/// A fresh random nonce.
pub(crate) fn nonce() -> Result<[u8; NONCE_LEN]> {
    let mut n = [0u8; NONCE_LEN];
    SystemRandom::new().fill(&mut n).map_err(|_| {
        CollectiveError::Config("the system's random number generator failed".into())
    })?;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn terms() -> LinkTerms {
        LinkTerms {
            version: 2,
            generation: 7,
            size: 4,
            from: 3,
            to: 0,
            sealed: true,
        }
    }

    #[test]
    fn a_proof_holds_only_for_its_session_role_terms_and_nonces() {
        let key = RingKey::derive("session-a");
        let nonces = Nonces {
            acceptor: nonce().unwrap(),
            connector: nonce().unwrap(),
        };
        let proof = key.prove(Role::Connector, &terms(), &nonces);
        assert!(key.verify(Role::Connector, &terms(), &nonces, &proof));
        // Another session, the other role (a reflected proof), other terms, other nonces.
        assert!(!RingKey::derive("session-b").verify(Role::Connector, &terms(), &nonces, &proof));
        assert!(!key.verify(Role::Acceptor, &terms(), &nonces, &proof));
        for other in [
            LinkTerms {
                generation: 8,
                ..terms()
            },
            LinkTerms { from: 2, ..terms() },
            LinkTerms { to: 1, ..terms() },
            LinkTerms { size: 5, ..terms() },
            LinkTerms {
                sealed: false,
                ..terms()
            },
            LinkTerms {
                version: 1,
                ..terms()
            },
        ] {
            assert!(!key.verify(Role::Connector, &other, &nonces, &proof));
        }
        let fresh = Nonces {
            acceptor: nonce().unwrap(),
            ..nonces
        };
        assert!(!key.verify(Role::Connector, &terms(), &fresh, &proof));
        assert!(!key.verify(Role::Connector, &terms(), &nonces, &proof[..31]));
    }

    #[test]
    fn frame_keys_are_the_connections_and_the_directions_own() {
        use crate::sealed::{Opener, Sealer};
        let nonces = Nonces {
            acceptor: nonce().unwrap(),
            connector: nonce().unwrap(),
        };
        let key = RingKey::derive("session-a");
        let mut sealer = Sealer::new(key.frame_keys(&terms(), &nonces).to_acceptor);
        let (mut body, mut tag) = (b"gradients".to_vec(), [0u8; 16]);
        sealer.seal(&mut body, &mut tag).unwrap();
        // The other end of the same connection opens it...
        let mut same = body.clone();
        Opener::new(key.frame_keys(&terms(), &nonces).to_acceptor)
            .open(&mut same, &tag)
            .unwrap();
        assert_eq!(same, b"gradients");
        // ...and nothing else does: the other direction, another connection, another session.
        let fresh = Nonces {
            connector: nonce().unwrap(),
            ..nonces
        };
        for other in [
            key.frame_keys(&terms(), &nonces).to_connector,
            key.frame_keys(&terms(), &fresh).to_acceptor,
            RingKey::derive("session-b")
                .frame_keys(&terms(), &nonces)
                .to_acceptor,
        ] {
            assert!(Opener::new(other).open(&mut body.clone(), &tag).is_err());
        }
    }

    #[test]
    fn the_key_is_not_the_session() {
        let key = RingKey::derive("0123456789abcdef0123456789abcdef");
        assert_eq!(format!("{key:?}"), "RingKey(..)");
        let nonces = Nonces {
            acceptor: [0; NONCE_LEN],
            connector: [0; NONCE_LEN],
        };
        // The plain HMAC under the session itself differs from the derived key's.
        let raw = hmac::Key::new(hmac::HMAC_SHA256, b"0123456789abcdef0123456789abcdef");
        let t = transcript(Role::Acceptor, &terms(), &nonces);
        assert_ne!(
            hmac::sign(&raw, &t).as_ref(),
            key.prove(Role::Acceptor, &terms(), &nonces)
        );
    }
}
