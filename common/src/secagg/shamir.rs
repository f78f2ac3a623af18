//! Shamir's t-of-k secret sharing over the prime field GF(2^61 − 1).
//!
//! A 32-byte secret (an X25519 secret key, a self-mask seed) is cut into five limbs of at most
//! 56 bits — each below the modulus, so every limb is a field element — and each limb is shared
//! with its own random polynomial of degree `t − 1`. A share is the evaluation of the five
//! polynomials at the receiver's point `x` (its 1-based index in the round, never 0). Any `t`
//! shares give the secret back by Lagrange interpolation at 0; fewer say nothing about it.
//!
//! The Mersenne prime makes reduction a shift and an add, and a 61-bit field leaves room for
//! any number of clients a round can have (`x` is a `u32`).

use ring::rand::{SecureRandom, SystemRandom};
use zeroize::{Zeroize, Zeroizing};

use super::SecAggError;

/// The field's modulus, 2^61 − 1.
pub const P: u64 = (1 << 61) - 1;
/// Limbs of one secret.
pub const LIMBS: usize = 5;
const LIMB_BYTES: usize = 7;
/// Bytes of a share's value (its `x` travels separately).
pub const SHARE_LEN: usize = LIMBS * 8;

/// One share of a 32-byte secret: the polynomials' values at `x`.
#[derive(Clone, PartialEq, Eq, Zeroize)]
pub struct Share {
    pub x: u32,
    pub y: [u64; LIMBS],
}

impl std::fmt::Debug for Share {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Share {{ x: {}, .. }}", self.x)
    }
}

impl Share {
    pub fn to_bytes(&self) -> [u8; SHARE_LEN] {
        let mut out = [0u8; SHARE_LEN];
        for (chunk, y) in out.chunks_exact_mut(8).zip(self.y) {
            chunk.copy_from_slice(&y.to_le_bytes());
        }
        out
    }

    /// Reads a share's value; every limb must be a field element.
    pub fn from_bytes(x: u32, bytes: &[u8]) -> Result<Self, SecAggError> {
        if bytes.len() != SHARE_LEN || x == 0 {
            return Err(SecAggError::Malformed(format!(
                "a share is {SHARE_LEN} bytes at a point x >= 1 (got {} bytes at x = {x})",
                bytes.len()
            )));
        }
        let mut y = [0u64; LIMBS];
        for (v, chunk) in y.iter_mut().zip(bytes.chunks_exact(8)) {
            let mut b = [0u8; 8];
            b.copy_from_slice(chunk);
            *v = u64::from_le_bytes(b);
            if *v >= P {
                return Err(SecAggError::Malformed(
                    "a share's value is not a field element".into(),
                ));
            }
        }
        Ok(Share { x, y })
    }
}

fn reduce(x: u128) -> u64 {
    let folded = (x & u128::from(P)) + (x >> 61);
    let mut r = (folded & u128::from(P)) as u64 + (folded >> 61) as u64;
    if r >= P {
        r -= P;
    }
    r
}

fn add(a: u64, b: u64) -> u64 {
    let s = a + b;
    if s >= P {
        s - P
    } else {
        s
    }
}

fn sub(a: u64, b: u64) -> u64 {
    if a >= b {
        a - b
    } else {
        a + P - b
    }
}

fn mul(a: u64, b: u64) -> u64 {
    reduce(u128::from(a) * u128::from(b))
}

fn pow(mut base: u64, mut exp: u64) -> u64 {
    let mut acc = 1;
    while exp > 0 {
        if exp & 1 == 1 {
            acc = mul(acc, base);
        }
        base = mul(base, base);
        exp >>= 1;
    }
    acc
}

fn inverse(a: u64) -> u64 {
    pow(a, P - 2)
}

fn limbs(secret: &[u8; 32]) -> Zeroizing<[u64; LIMBS]> {
    let mut out = Zeroizing::new([0u64; LIMBS]);
    for (limb, chunk) in out.iter_mut().zip(secret.chunks(LIMB_BYTES)) {
        let mut b = [0u8; 8];
        b[..chunk.len()].copy_from_slice(chunk);
        *limb = u64::from_le_bytes(b);
        b.zeroize();
    }
    out
}

fn random_element(rng: &SystemRandom) -> Result<u64, SecAggError> {
    loop {
        let mut b = [0u8; 8];
        rng.fill(&mut b).map_err(|_| SecAggError::Rng)?;
        let v = u64::from_le_bytes(b) & P;
        if v < P {
            return Ok(v);
        }
    }
}

/// Shares `secret` so that any `threshold` of the shares at `points` recover it.
pub fn split(
    secret: &[u8; 32],
    threshold: usize,
    points: &[u32],
    rng: &SystemRandom,
) -> Result<Vec<Share>, SecAggError> {
    if threshold == 0 || threshold > points.len() {
        return Err(SecAggError::Threshold(format!(
            "cannot share {threshold}-of-{}",
            points.len()
        )));
    }
    if points.contains(&0) {
        return Err(SecAggError::Malformed("share points start at 1".into()));
    }
    // coefficients[limb][degree], the constant term being the limb.
    let secret_limbs = limbs(secret);
    let mut coefficients = Zeroizing::new(vec![[0u64; LIMBS]; threshold]);
    coefficients[0] = *secret_limbs;
    for c in coefficients.iter_mut().skip(1) {
        for v in c.iter_mut() {
            *v = random_element(rng)?;
        }
    }
    Ok(points
        .iter()
        .map(|&x| {
            let x_f = u64::from(x);
            let mut y = [0u64; LIMBS];
            for (limb, y) in y.iter_mut().enumerate() {
                // Horner from the highest degree down.
                let mut acc = 0;
                for c in coefficients.iter().rev() {
                    acc = add(mul(acc, x_f), c[limb]);
                }
                *y = acc;
            }
            Share { x, y }
        })
        .collect())
}

/// Recovers the secret from at least `threshold` shares at distinct points (the first
/// `threshold` are used). Wrong shares give a wrong secret, not an error: callers check the
/// result against what it must match (a public key, for instance).
pub fn combine(shares: &[Share], threshold: usize) -> Result<Zeroizing<[u8; 32]>, SecAggError> {
    if threshold == 0 || shares.len() < threshold {
        return Err(SecAggError::Threshold(format!(
            "{} shares, {threshold} needed",
            shares.len()
        )));
    }
    let shares = &shares[..threshold];
    for (i, s) in shares.iter().enumerate() {
        if s.x == 0 || shares[..i].iter().any(|o| o.x == s.x) {
            return Err(SecAggError::Malformed(format!(
                "shares must be at distinct points >= 1 (x = {} repeats or is 0)",
                s.x
            )));
        }
    }
    // Lagrange basis at 0: l_j = Π_{m≠j} x_m / (x_m − x_j).
    let mut limbs = Zeroizing::new([0u64; LIMBS]);
    for (j, sj) in shares.iter().enumerate() {
        let (mut num, mut den) = (1u64, 1u64);
        for (m, sm) in shares.iter().enumerate() {
            if m != j {
                num = mul(num, u64::from(sm.x));
                den = mul(den, sub(u64::from(sm.x), u64::from(sj.x)));
            }
        }
        let l = mul(num, inverse(den));
        for (acc, y) in limbs.iter_mut().zip(sj.y) {
            *acc = add(*acc, mul(l, y));
        }
    }
    let mut out = Zeroizing::new([0u8; 32]);
    for (chunk, limb) in out.chunks_mut(LIMB_BYTES).zip(limbs.iter()) {
        let bytes = limb.to_le_bytes();
        if bytes[chunk.len()..].iter().any(|&b| b != 0) {
            // Not a limb a 32-byte secret can have: the shares were not of one secret.
            return Err(SecAggError::Inconsistent(
                "the shares do not interpolate to a 32-byte secret".into(),
            ));
        }
        chunk.copy_from_slice(&bytes[..chunk.len()]);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn secret(seed: u8) -> [u8; 32] {
        std::array::from_fn(|i| (i as u8).wrapping_mul(37).wrapping_add(seed))
    }

    #[test]
    fn field_arithmetic_is_modular() {
        assert_eq!(mul(P - 1, P - 1), 1);
        assert_eq!(add(P - 1, 1), 0);
        assert_eq!(sub(0, 1), P - 1);
        for a in [1, 2, 12345, P - 2] {
            assert_eq!(mul(a, inverse(a)), 1);
        }
        assert_eq!(reduce(u128::from(P) * u128::from(P)), 0);
    }

    #[test]
    fn any_t_shares_recover_and_fewer_do_not() {
        let rng = SystemRandom::new();
        let s = secret(7);
        let points: Vec<u32> = (1..=10).collect();
        let shares = split(&s, 4, &points, &rng).unwrap();
        for window in shares.windows(4) {
            assert_eq!(*combine(window, 4).unwrap(), s);
        }
        let picked = [
            shares[9].clone(),
            shares[0].clone(),
            shares[5].clone(),
            shares[2].clone(),
        ];
        assert_eq!(*combine(&picked, 4).unwrap(), s);
        // Three shares of a 4-of-10 interpolate to something else (or to no 32-byte secret).
        match combine(&shares[..3], 3) {
            Ok(other) => assert_ne!(*other, s),
            Err(e) => assert!(matches!(e, SecAggError::Inconsistent(_))),
        }
        assert!(combine(&shares[..3], 4).is_err());
    }

    #[test]
    fn a_tampered_share_changes_the_result() {
        let rng = SystemRandom::new();
        let s = secret(1);
        let mut shares = split(&s, 3, &[1, 2, 3], &rng).unwrap();
        shares[1].y[0] = add(shares[1].y[0], 1);
        assert!(combine(&shares, 3).map(|r| *r != s).unwrap_or(true));
    }

    #[test]
    fn bad_parameters_and_bytes_are_refused() {
        let rng = SystemRandom::new();
        assert!(split(&secret(0), 0, &[1], &rng).is_err());
        assert!(split(&secret(0), 3, &[1, 2], &rng).is_err());
        assert!(split(&secret(0), 1, &[0], &rng).is_err());
        let shares = split(&secret(0), 2, &[1, 2], &rng).unwrap();
        let dup = [shares[0].clone(), shares[0].clone()];
        assert!(combine(&dup, 2).is_err());
        assert!(Share::from_bytes(1, &[0u8; 39]).is_err());
        assert!(Share::from_bytes(0, &[0u8; SHARE_LEN]).is_err());
        assert!(Share::from_bytes(1, &[0xff; SHARE_LEN]).is_err());
        let b = shares[1].to_bytes();
        assert_eq!(Share::from_bytes(2, &b).unwrap(), shares[1]);
    }

    proptest! {
        #[test]
        fn round_trips_for_any_secret_and_threshold(bytes in prop::array::uniform32(any::<u8>()), t in 1usize..8, extra in 0usize..5) {
            let rng = SystemRandom::new();
            let points: Vec<u32> = (1..=(t + extra) as u32).map(|i| i * 3).collect();
            let shares = split(&bytes, t, &points, &rng).unwrap();
            let mut rev = shares.clone();
            rev.reverse();
            prop_assert_eq!(*combine(&rev, t).unwrap(), bytes);
        }
    }
}
