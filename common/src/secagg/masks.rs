//! Masks: ChaCha20 keystreams keyed by HKDF outputs, added to vectors in Z_2^32.
//!
//! A pairwise mask is keyed by the X25519 agreement of two neighbours' `c` keys, so both derive
//! it without talking; the client whose id sorts first adds it and the other subtracts it, and
//! in the sum of both they cancel. A self-mask is keyed by the client's own random seed `b`.
//! Expanding many masks is the costly part of the protocol on both sides; it runs on rayon's
//! pool, each thread folding keystreams into its own accumulator.

use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha20Rng;
use rayon::prelude::*;
use x25519_dalek::StaticSecret;
use zeroize::Zeroizing;

use super::keys::{agree, derive};
use super::{Context, SecAggError};

/// Whether a mask is added to or subtracted from the vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sign {
    Plus,
    Minus,
}

/// One keystream to apply: its ChaCha20 key and sign.
pub struct Mask {
    key: Zeroizing<[u8; 32]>,
    sign: Sign,
}

impl Mask {
    /// The self-mask of `client` from its seed `b`.
    pub fn own(ctx: &Context, client: &str, seed: &[u8; 32]) -> Result<Mask, SecAggError> {
        Ok(Mask {
            key: derive(seed, ctx, "self mask", &[client])?,
            sign: Sign::Plus,
        })
    }

    /// The pairwise mask `me` applies for `peer`: added if `me` sorts before `peer`.
    pub fn pairwise(
        ctx: &Context,
        me: &str,
        mine: &StaticSecret,
        peer: &str,
        theirs: &[u8; 32],
    ) -> Result<Mask, SecAggError> {
        let shared = agree(mine, theirs)?;
        let (lo, hi) = if me < peer { (me, peer) } else { (peer, me) };
        Ok(Mask {
            key: derive(shared.as_ref(), ctx, "pairwise mask", &[lo, hi])?,
            sign: if me < peer { Sign::Plus } else { Sign::Minus },
        })
    }

    /// The same keystream with the opposite sign (to take a mask back out).
    pub fn negated(self) -> Mask {
        Mask {
            key: self.key,
            sign: match self.sign {
                Sign::Plus => Sign::Minus,
                Sign::Minus => Sign::Plus,
            },
        }
    }

    fn apply(&self, values: &mut [u32]) {
        let mut rng = ChaCha20Rng::from_seed(*self.key);
        let mut block = [0u8; 4096];
        for chunk in values.chunks_mut(block.len() / 4) {
            let bytes = &mut block[..chunk.len() * 4];
            rng.fill_bytes(bytes);
            let words = bytes
                .chunks_exact(4)
                .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
            match self.sign {
                Sign::Plus => chunk
                    .iter_mut()
                    .zip(words)
                    .for_each(|(v, w)| *v = v.wrapping_add(w)),
                Sign::Minus => chunk
                    .iter_mut()
                    .zip(words)
                    .for_each(|(v, w)| *v = v.wrapping_sub(w)),
            }
        }
    }
}

/// Adds every mask (with its sign) to `values`, spreading the keystreams over rayon's threads.
pub fn apply_all(values: &mut [u32], masks: &[Mask]) {
    match masks {
        [] => {}
        [one] => one.apply(values),
        _ => {
            let len = values.len();
            let total = masks
                .par_iter()
                .fold(
                    || vec![0u32; len],
                    |mut acc, m| {
                        m.apply(&mut acc);
                        acc
                    },
                )
                .reduce_with(|mut a, b| {
                    a.iter_mut()
                        .zip(&b)
                        .for_each(|(x, y)| *x = x.wrapping_add(*y));
                    a
                });
            if let Some(total) = total {
                values
                    .iter_mut()
                    .zip(&total)
                    .for_each(|(v, t)| *v = v.wrapping_add(*t));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::secagg::keys::new_secret;
    use ring::rand::SystemRandom;
    use x25519_dalek::PublicKey;

    #[test]
    fn pairwise_masks_cancel_and_self_masks_come_off() {
        let rng = SystemRandom::new();
        let ctx = Context::new("t", 1, 0);
        let (a, b) = (new_secret(&rng).unwrap(), new_secret(&rng).unwrap());
        let (pa, pb) = (
            PublicKey::from(&a).to_bytes(),
            PublicKey::from(&b).to_bytes(),
        );
        let mut sum = vec![7u32; 10_001];
        apply_all(
            &mut sum,
            &[Mask::pairwise(&ctx, "a", &a, "b", &pb).unwrap()],
        );
        assert_ne!(sum, vec![7u32; 10_001]);
        apply_all(
            &mut sum,
            &[Mask::pairwise(&ctx, "b", &b, "a", &pa).unwrap()],
        );
        assert_eq!(sum, vec![7u32; 10_001]);

        let seed = [9u8; 32];
        let masks = [
            Mask::own(&ctx, "a", &seed).unwrap(),
            Mask::own(&ctx, "b", &[1; 32]).unwrap(),
        ];
        apply_all(&mut sum, &masks);
        let undo: Vec<Mask> = masks.into_iter().map(Mask::negated).collect();
        apply_all(&mut sum, &undo);
        assert_eq!(sum, vec![7u32; 10_001]);
    }

    #[test]
    fn masks_differ_by_round_attempt_and_pair() {
        let expand = |ctx: &Context, who: &str| {
            let mut v = vec![0u32; 64];
            apply_all(&mut v, &[Mask::own(ctx, who, &[3; 32]).unwrap()]);
            v
        };
        let base = expand(&Context::new("t", 1, 0), "a");
        assert_ne!(base, expand(&Context::new("t", 1, 1), "a"));
        assert_ne!(base, expand(&Context::new("t", 2, 0), "a"));
        assert_ne!(base, expand(&Context::new("u", 1, 0), "a"));
        assert_ne!(base, expand(&Context::new("t", 1, 0), "b"));
        assert_eq!(base, expand(&Context::new("t", 1, 0), "a"));
    }
}
