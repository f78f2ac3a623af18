//! A client's side of one secure-aggregation attempt, as a state machine that only moves
//! forward: [`ClientSession::advertise`] → [`ClientSession::share_keys`] →
//! [`ClientSession::masked_input`] → [`ClientSession::unmask`]. Each step checks what the
//! server relayed (signatures, addressing, thresholds, disjoint survivor and dropout lists)
//! before using it, and refuses to run twice or out of order — so a server cannot obtain both
//! shares of one peer from this client by asking twice.

use std::collections::{BTreeMap, BTreeSet};

use ring::rand::{SecureRandom, SystemRandom};
use x25519_dalek::{PublicKey, StaticSecret};
use zeroize::Zeroizing;

use super::keys::{self, advert_message, new_secret, open_from, seal_to, verify, Identity};
use super::masks::{apply_all, Mask};
use super::shamir::{self, Share, SHARE_LEN};
use super::{hex_array, Context, SecAggError};
use crate::wire::{
    SecAggAdvertise, SecAggRevealedShare, SecAggRoster, SecAggSealedShares, SecAggShareBundles,
    SecAggShareKind, SecAggUnmask, SecAggUnmaskRequest,
};

/// Where a session is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Stage {
    Advertised,
    SharedKeys,
    MaskedInput,
    Unmasked,
}

struct Neighbour {
    id: String,
    index: u32,
    mask_key: [u8; 32],
    share_key: [u8; 32],
}

/// The shares a neighbour entrusted to this client.
struct Entrusted {
    self_mask: Share,
    mask_key: Share,
}

pub struct ClientSession {
    ctx: Context,
    id: String,
    c: StaticSecret,
    s: StaticSecret,
    seed: Zeroizing<[u8; 32]>,
    rng: SystemRandom,
    stage: Stage,
    index: u32,
    threshold: usize,
    neighbours: Vec<Neighbour>,
    entrusted: BTreeMap<String, Entrusted>,
}

/// Parses a signed advertisement; the signature must be `identity`'s over these keys in `ctx`.
pub fn check_advert(
    ctx: &Context,
    client: &str,
    identity: &[u8; 32],
    advert: &SecAggAdvertise,
) -> Result<([u8; 32], [u8; 32]), SecAggError> {
    let c = hex_array::<32>("mask_key", &advert.mask_key)?;
    let s = hex_array::<32>("share_key", &advert.share_key)?;
    let sig = hex_array::<64>("signature", &advert.signature)?;
    if !verify(identity, &advert_message(ctx, client, &c, &s), &sig) {
        return Err(SecAggError::Forged(format!(
            "the keys advertised for `{client}` are not signed by its identity key"
        )));
    }
    for key in [&c, &s] {
        if PublicKey::from(*key).to_bytes() == [0u8; 32]
            || !StaticSecret::from([1u8; 32])
                .diffie_hellman(&PublicKey::from(*key))
                .was_contributory()
        {
            return Err(SecAggError::LowOrderKey);
        }
    }
    Ok((c, s))
}

fn share_plaintext(
    from: &str,
    to: &str,
    self_mask: &Share,
    mask_key: &Share,
) -> Zeroizing<Vec<u8>> {
    let mut p = Zeroizing::new(Vec::with_capacity(
        2 * SHARE_LEN + from.len() + to.len() + 8,
    ));
    keys::put_str(&mut p, from);
    keys::put_str(&mut p, to);
    p.extend_from_slice(&self_mask.to_bytes());
    p.extend_from_slice(&mask_key.to_bytes());
    p
}

impl ClientSession {
    /// A session for client `id` in the attempt `ctx`, with fresh keys.
    pub fn new(ctx: Context, id: &str) -> Result<Self, SecAggError> {
        let rng = SystemRandom::new();
        let mut seed = Zeroizing::new([0u8; 32]);
        rng.fill(seed.as_mut()).map_err(|_| SecAggError::Rng)?;
        Ok(ClientSession {
            c: new_secret(&rng)?,
            s: new_secret(&rng)?,
            seed,
            rng,
            ctx,
            id: id.to_string(),
            stage: Stage::Advertised,
            index: 0,
            threshold: 0,
            neighbours: Vec::new(),
            entrusted: BTreeMap::new(),
        })
    }

    pub fn stage(&self) -> Stage {
        self.stage
    }

    pub fn context(&self) -> &Context {
        &self.ctx
    }

    /// Stage 0: the public keys, signed by `identity`.
    pub fn advertise(&self, identity: &Identity) -> SecAggAdvertise {
        let c = PublicKey::from(&self.c).to_bytes();
        let s = PublicKey::from(&self.s).to_bytes();
        SecAggAdvertise {
            mask_key: hex::encode(c),
            share_key: hex::encode(s),
            signature: hex::encode(identity.sign(&advert_message(&self.ctx, &self.id, &c, &s))),
        }
    }

    fn advance(&mut self, from: Stage, to: Stage) -> Result<(), SecAggError> {
        if self.stage != from {
            return Err(SecAggError::Stage(format!(
                "asked to move to {to:?} while at {:?}",
                self.stage
            )));
        }
        self.stage = to;
        Ok(())
    }

    /// Stage 1: checks the roster and returns one encrypted bundle of shares per neighbour.
    pub fn share_keys(&mut self, roster: &SecAggRoster) -> Result<SecAggShareBundles, SecAggError> {
        self.advance(Stage::Advertised, Stage::SharedKeys)?;
        let k = roster.neighbours.len();
        let t = roster.threshold as usize;
        // A threshold at or below half the neighbours would let a minority recover our
        // secrets; above k nobody could.
        if t <= k / 2 || t > k || t < 2 {
            return Err(SecAggError::Threshold(format!(
                "the server asks for {t}-of-{k} sharing; it must be a majority of at least 2 and at most {k}"
            )));
        }
        if roster.index == 0 {
            return Err(SecAggError::Malformed("this client's index is 0".into()));
        }
        let mut seen_ids = BTreeSet::new();
        let mut seen_points = BTreeSet::from([roster.index]);
        let mut neighbours = Vec::with_capacity(k);
        for n in &roster.neighbours {
            if n.client == self.id
                || !seen_ids.insert(n.client.as_str())
                || n.index == 0
                || !seen_points.insert(n.index)
            {
                return Err(SecAggError::Malformed(format!(
                    "neighbour `{}` (index {}) is repeated, is this client, or shares a point",
                    n.client, n.index
                )));
            }
            let identity = hex_array::<32>("identity_key", &n.identity_key)?;
            let (mask_key, share_key) = check_advert(&self.ctx, &n.client, &identity, &n.keys)?;
            neighbours.push(Neighbour {
                id: n.client.clone(),
                index: n.index,
                mask_key,
                share_key,
            });
        }
        let points: Vec<u32> = neighbours.iter().map(|n| n.index).collect();
        let c_secret = Zeroizing::new(self.c.to_bytes());
        let seed_shares = shamir::split(&self.seed, t, &points, &self.rng)?;
        let key_shares = shamir::split(&c_secret, t, &points, &self.rng)?;
        let shares = neighbours
            .iter()
            .zip(seed_shares.iter().zip(&key_shares))
            .map(|(n, (b, c))| {
                let plaintext = share_plaintext(&self.id, &n.id, b, c);
                seal_to(
                    &self.s,
                    &n.share_key,
                    &self.ctx,
                    &self.id,
                    &n.id,
                    &plaintext,
                )
                .map(|ct| SecAggSealedShares {
                    peer: n.id.clone(),
                    ciphertext: hex::encode(ct),
                })
            })
            .collect::<Result<_, _>>()?;
        self.index = roster.index;
        self.threshold = t;
        self.neighbours = neighbours;
        Ok(SecAggShareBundles { shares })
    }

    /// Stage 2: opens the shares neighbours sent and masks `input` (a quantised vector) with
    /// the self-mask and a pairwise mask per neighbour that shared.
    pub fn masked_input(
        &mut self,
        inbox: &SecAggShareBundles,
        input: &[u32],
    ) -> Result<Vec<u32>, SecAggError> {
        self.advance(Stage::SharedKeys, Stage::MaskedInput)?;
        let mut masks = vec![Mask::own(&self.ctx, &self.id, &self.seed)?];
        for bundle in &inbox.shares {
            let Some(n) = self.neighbours.iter().find(|n| n.id == bundle.peer) else {
                return Err(SecAggError::Forged(format!(
                    "shares from `{}`, which is not a neighbour of this client",
                    bundle.peer
                )));
            };
            if self.entrusted.contains_key(&n.id) {
                return Err(SecAggError::Forged(format!("shares from `{}` twice", n.id)));
            }
            let ct = hex::decode(&bundle.ciphertext)
                .map_err(|_| SecAggError::Malformed("ciphertext must be hex".into()))?;
            let plain = open_from(&self.s, &n.share_key, &self.ctx, &n.id, &self.id, &ct)?;
            let expected = share_plaintext(
                &n.id,
                &self.id,
                &Share { x: 1, y: [0; 5] },
                &Share { x: 1, y: [0; 5] },
            );
            let head = expected.len() - 2 * SHARE_LEN;
            if plain.len() != expected.len() || plain[..head] != expected[..head] {
                return Err(SecAggError::Forged(format!(
                    "the shares from `{}` are not addressed from it to this client",
                    n.id
                )));
            }
            let entrusted = Entrusted {
                self_mask: Share::from_bytes(self.index, &plain[head..head + SHARE_LEN])?,
                mask_key: Share::from_bytes(self.index, &plain[head + SHARE_LEN..])?,
            };
            masks.push(Mask::pairwise(
                &self.ctx,
                &self.id,
                &self.c,
                &n.id,
                &n.mask_key,
            )?);
            self.entrusted.insert(n.id.clone(), entrusted);
        }
        if self.entrusted.len() < self.threshold {
            return Err(SecAggError::Threshold(format!(
                "{} of this client's neighbours shared keys; the threshold is {}",
                self.entrusted.len(),
                self.threshold
            )));
        }
        let mut masked = input.to_vec();
        apply_all(&mut masked, &masks);
        Ok(masked)
    }

    /// Stage 3: reveals, for each listed neighbour, the one share the server may have.
    pub fn unmask(&mut self, request: &SecAggUnmaskRequest) -> Result<SecAggUnmask, SecAggError> {
        self.advance(Stage::MaskedInput, Stage::Unmasked)?;
        let survivors: BTreeSet<&str> = request.survivors.iter().map(String::as_str).collect();
        let dropped: BTreeSet<&str> = request.dropped.iter().map(String::as_str).collect();
        if survivors.len() != request.survivors.len() || dropped.len() != request.dropped.len() {
            return Err(SecAggError::Forged("a peer is listed twice".into()));
        }
        if let Some(both) = survivors.intersection(&dropped).next() {
            return Err(SecAggError::Forged(format!(
                "the server asks for both the self-mask and the mask-key share of `{both}`: refused"
            )));
        }
        // Everyone who shared with us must be accounted for exactly once, and no one else.
        let listed: BTreeSet<&str> = survivors.union(&dropped).copied().collect();
        let entrusted: BTreeSet<&str> = self.entrusted.keys().map(String::as_str).collect();
        if listed != entrusted {
            return Err(SecAggError::Forged(format!(
                "the unmask request lists {listed:?}, but the neighbours that shared with this client are {entrusted:?}"
            )));
        }
        // Including ourselves, at least t of the neighbourhood must have survived.
        if survivors.len() + 1 < self.threshold {
            return Err(SecAggError::Threshold(format!(
                "only {} neighbours survived; revealing shares below the threshold {} is refused",
                survivors.len(),
                self.threshold
            )));
        }
        let shares = self
            .entrusted
            .iter()
            .map(|(peer, e)| {
                let (kind, share) = if survivors.contains(peer.as_str()) {
                    (SecAggShareKind::SelfMask, &e.self_mask)
                } else {
                    (SecAggShareKind::MaskKey, &e.mask_key)
                };
                SecAggRevealedShare {
                    peer: peer.clone(),
                    kind,
                    share: hex::encode(share.to_bytes()),
                }
            })
            .collect();
        self.entrusted.clear();
        Ok(SecAggUnmask { shares })
    }
}
