//! SecAgg+'s sparse communication graph (Bell et al., CCS 2020).
//!
//! Instead of every client sharing with every other (n² shares and n masks per client), each
//! client has `k` neighbours, `k` about 3·log₂ n: the clients are placed on a ring in a random
//! order (a permutation seeded by the server's public per-attempt seed) and each is joined to
//! the `k/2` nearest on either side — a Harary graph, k-regular and k-connected. Masks and shares
//! exist only along edges, so the cost per client is O(k) instead of O(n).

use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha20Rng;

/// The default number of neighbours for a round of `n` clients: the smallest even number at
/// least 3·log₂ n (1.5·log₂ n on each side), or everyone when that is most of the round.
pub fn default_degree(n: usize) -> usize {
    if n <= 1 {
        return 0;
    }
    let half = (1.5 * (n as f64).log2()).ceil() as usize;
    (2 * half).min(n - 1)
}

/// The default threshold for `k` neighbours: a strict majority, so no minority of a client's
/// neighbours can reconstruct its secrets, and up to `k − t` of them may drop out.
pub fn default_threshold(k: usize) -> usize {
    k / 2 + 1
}

/// The neighbours of each of `n` clients (indices into the round's sorted client list) for
/// degree `k` (raised to even; ≥ n − 1 means everyone).
pub fn neighbours(n: usize, k: usize, seed: &[u8; 32]) -> Vec<Vec<usize>> {
    if n == 0 {
        return Vec::new();
    }
    let k = k + (k % 2);
    if k >= n - 1 {
        return (0..n)
            .map(|i| (0..n).filter(|&j| j != i).collect())
            .collect();
    }
    // Fisher–Yates with a keyed ChaCha20 stream: the order on the ring.
    let mut rng = ChaCha20Rng::from_seed(*seed);
    let mut ring: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = (rng.next_u64() % (i as u64 + 1)) as usize;
        ring.swap(i, j);
    }
    let mut position = vec![0; n];
    for (p, &node) in ring.iter().enumerate() {
        position[node] = p;
    }
    (0..n)
        .map(|node| {
            let p = position[node];
            let mut list: Vec<usize> = (1..=k / 2)
                .flat_map(|d| [ring[(p + d) % n], ring[(p + n - d) % n]])
                .collect();
            list.sort_unstable();
            list
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_graph_is_regular_symmetric_and_seeded() {
        for (n, k) in [(20, 14), (100, 20), (7, 4), (10, 3)] {
            let g = neighbours(n, k, &[5; 32]);
            let k = k + k % 2;
            for (i, list) in g.iter().enumerate() {
                assert_eq!(list.len(), k, "node {i} of {n}");
                assert!(!list.contains(&i));
                for &j in list {
                    assert!(g[j].contains(&i), "{i}-{j} not symmetric");
                }
            }
            assert_ne!(g, neighbours(n, k, &[6; 32]));
            assert_eq!(g, neighbours(n, k, &[5; 32]));
        }
        let complete = neighbours(5, 8, &[0; 32]);
        assert!(complete.iter().all(|l| l.len() == 4));
    }

    #[test]
    fn defaults_grow_with_the_logarithm() {
        assert_eq!(default_degree(3), 2);
        assert_eq!(default_degree(20), 14);
        assert_eq!(default_degree(100), 20);
        assert_eq!(default_degree(500), 28);
        assert_eq!(default_threshold(14), 8);
        assert_eq!(default_threshold(2), 2);
    }
}
