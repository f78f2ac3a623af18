//! The server's arithmetic in the unmask stage: which shares to ask each client for, checking
//! what comes back, and — once every needed secret has `t` shares — recovering the survivors'
//! self-mask seeds and the dropped clients' mask keys and taking the masks out of the sum.
//!
//! The stage's inputs are fixed before it starts: the participants of the attempt (with their
//! advertised mask keys and neighbours), who shared keys (U2) and who uploaded a masked input
//! (U3). A survivor's self-mask and a dropped client's mask key are the only secrets ever
//! reconstructed, and the two sets are disjoint by construction, so the server never holds both
//! secrets of one client.

use std::collections::{BTreeMap, BTreeSet};

use rayon::prelude::*;
use x25519_dalek::{PublicKey, StaticSecret};

use super::masks::{apply_all, Mask};
use super::shamir::{self, Share};
use super::{Context, SecAggError};
use crate::wire::{SecAggShareKind, SecAggUnmask, SecAggUnmaskRequest};

/// A participant of the attempt as the server fixed it when advertising closed.
#[derive(Debug, Clone)]
pub struct Participant {
    pub id: String,
    /// Its Shamir point.
    pub index: u32,
    pub mask_key: [u8; 32],
    /// Indices into the participant list.
    pub neighbours: Vec<usize>,
}

pub struct Unmasker<'a> {
    ctx: Context,
    participants: &'a [Participant],
    threshold: usize,
    shared: BTreeSet<usize>,
    survivors: BTreeSet<usize>,
    /// Shares received, by peer, of its self-mask seed (survivors) or mask key (dropped).
    shares: BTreeMap<usize, Vec<Share>>,
    answered: BTreeSet<usize>,
}

impl<'a> Unmasker<'a> {
    /// `shared` (U2) and `survivors` (U3 ⊆ U2) are indices into `participants`.
    pub fn new(
        ctx: Context,
        participants: &'a [Participant],
        threshold: usize,
        shared: BTreeSet<usize>,
        survivors: BTreeSet<usize>,
    ) -> Self {
        Unmasker {
            ctx,
            participants,
            threshold,
            shared,
            survivors,
            shares: BTreeMap::new(),
            answered: BTreeSet::new(),
        }
    }

    fn is_survivor(&self, p: usize) -> bool {
        self.survivors.contains(&p)
    }

    /// The secrets the server needs: every survivor's seed, and the key of every client that
    /// shared keys but uploaded nothing and has a surviving neighbour (whose mask it must undo).
    pub fn needed(&self) -> Vec<usize> {
        self.shared
            .iter()
            .copied()
            .filter(|&p| {
                self.is_survivor(p)
                    || self.participants[p]
                        .neighbours
                        .iter()
                        .any(|n| self.is_survivor(*n))
            })
            .collect()
    }

    /// What survivor `client` is asked to reveal: one share of each neighbour that shared.
    pub fn request_for(&self, client: usize) -> SecAggUnmaskRequest {
        let (mut survivors, mut dropped) = (Vec::new(), Vec::new());
        for &n in &self.participants[client].neighbours {
            if !self.shared.contains(&n) {
                continue;
            }
            let id = self.participants[n].id.clone();
            if self.is_survivor(n) {
                survivors.push(id);
            } else {
                dropped.push(id);
            }
        }
        SecAggUnmaskRequest { survivors, dropped }
    }

    /// Takes survivor `from`'s answer; all or nothing.
    pub fn accept(&mut self, from: usize, answer: &SecAggUnmask) -> Result<(), SecAggError> {
        if !self.is_survivor(from) {
            return Err(SecAggError::Stage(format!(
                "`{}` uploaded no masked input, so it takes no part in unmasking",
                self.participants[from].id
            )));
        }
        if self.answered.contains(&from) {
            return Err(SecAggError::Stage(format!(
                "`{}` has already revealed its shares",
                self.participants[from].id
            )));
        }
        let request = self.request_for(from);
        let wanted: BTreeMap<&str, SecAggShareKind> = request
            .survivors
            .iter()
            .map(|s| (s.as_str(), SecAggShareKind::SelfMask))
            .chain(
                request
                    .dropped
                    .iter()
                    .map(|d| (d.as_str(), SecAggShareKind::MaskKey)),
            )
            .collect();
        let mut parsed = Vec::with_capacity(answer.shares.len());
        let mut seen = BTreeSet::new();
        for s in &answer.shares {
            if !seen.insert(s.peer.as_str()) {
                return Err(SecAggError::Forged(format!(
                    "two shares for `{}`: a client reveals one share per peer, never both",
                    s.peer
                )));
            }
            match wanted.get(s.peer.as_str()) {
                None => {
                    return Err(SecAggError::Forged(format!(
                        "a share for `{}`, which was not asked of this client",
                        s.peer
                    )))
                }
                Some(kind) if *kind != s.kind => {
                    return Err(SecAggError::Forged(format!(
                        "a {:?} share for `{}`, whose {:?} share was asked for",
                        s.kind, s.peer, kind
                    )))
                }
                Some(_) => {}
            }
            let bytes = hex::decode(&s.share)
                .map_err(|_| SecAggError::Malformed("a share must be hex".into()))?;
            let share = Share::from_bytes(self.participants[from].index, &bytes)?;
            let peer = self
                .participants
                .iter()
                .position(|p| p.id == s.peer)
                .ok_or_else(|| SecAggError::Forged(format!("unknown peer `{}`", s.peer)))?;
            parsed.push((peer, share));
        }
        if seen.len() != wanted.len() {
            return Err(SecAggError::Malformed(format!(
                "{} shares revealed, {} asked for",
                seen.len(),
                wanted.len()
            )));
        }
        for (peer, share) in parsed {
            self.shares.entry(peer).or_default().push(share);
        }
        self.answered.insert(from);
        Ok(())
    }

    pub fn answered(&self) -> &BTreeSet<usize> {
        &self.answered
    }

    /// Whether every survivor has answered.
    pub fn complete(&self) -> bool {
        self.answered.len() == self.survivors.len()
    }

    /// The needed secrets that have fewer than `t` shares, with how many they have.
    pub fn short(&self) -> Vec<(String, usize)> {
        self.needed()
            .into_iter()
            .filter_map(|p| {
                let have = self.shares.get(&p).map_or(0, Vec::len);
                (have < self.threshold).then(|| (self.participants[p].id.clone(), have))
            })
            .collect()
    }

    /// Before anyone answers: the needed secrets that fewer than `t` surviving neighbours hold
    /// shares of, so that no answers could ever be enough.
    pub fn short_of_survivors(&self) -> Vec<(String, usize)> {
        self.needed()
            .into_iter()
            .filter_map(|p| {
                let holders = self.participants[p]
                    .neighbours
                    .iter()
                    .filter(|n| self.is_survivor(**n))
                    .count();
                (holders < self.threshold).then(|| (self.participants[p].id.clone(), holders))
            })
            .collect()
    }

    fn recover(&self, p: usize) -> Result<zeroize::Zeroizing<[u8; 32]>, SecAggError> {
        let shares = self.shares.get(&p).map(Vec::as_slice).unwrap_or_default();
        let secret = shamir::combine(shares, self.threshold)?;
        // With spare shares, a second subset must agree: a corrupted share is caught here.
        if shares.len() > self.threshold
            && *shamir::combine(&shares[shares.len() - self.threshold..], self.threshold)?
                != *secret
        {
            return Err(SecAggError::Inconsistent(format!(
                "the shares of `{}` disagree",
                self.participants[p].id
            )));
        }
        Ok(secret)
    }

    /// Removes the masks from `sum` (the sum of the survivors' masked inputs).
    pub fn finish(&self, sum: &mut [u32]) -> Result<(), SecAggError> {
        if let Some((id, have)) = self.short().into_iter().next() {
            return Err(SecAggError::Threshold(format!(
                "`{id}` has {have} of the {} shares its secret needs",
                self.threshold
            )));
        }
        let needed = self.needed();
        let masks: Vec<Vec<Mask>> = needed
            .par_iter()
            .map(|&p| -> Result<Vec<Mask>, SecAggError> {
                let me = &self.participants[p];
                let secret = self.recover(p)?;
                if self.is_survivor(p) {
                    return Ok(vec![Mask::own(&self.ctx, &me.id, &secret)?.negated()]);
                }
                let key = StaticSecret::from(*secret);
                if PublicKey::from(&key).to_bytes() != me.mask_key {
                    return Err(SecAggError::Inconsistent(format!(
                        "the shares of `{}` do not give the mask key it advertised",
                        me.id
                    )));
                }
                // Each surviving neighbour applied the opposite of what `p` would have.
                me.neighbours
                    .iter()
                    .filter(|n| self.is_survivor(**n))
                    .map(|&n| {
                        let v = &self.participants[n];
                        Mask::pairwise(&self.ctx, &me.id, &key, &v.id, &v.mask_key)
                    })
                    .collect()
            })
            .collect::<Result<_, _>>()?;
        let masks: Vec<Mask> = masks.into_iter().flatten().collect();
        apply_all(sum, &masks);
        Ok(())
    }
}
