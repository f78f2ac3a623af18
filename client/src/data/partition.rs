//! Splitting one dataset among the virtual clients of a simulated federation, the ways
//! federated-learning studies split them: IID, label skew by Dirichlet(α), pathological
//! k-classes-per-client shards, and quantity skew (log-normal sizes).
//!
//! A [`Plan`] is made once per dataset from `(partitioner, seed, clients)`: the order of the
//! samples and where each client's run of them starts, O(samples + clients × classes) numbers.
//! A client's samples ([`Plan::indices`]) are then read off it when that client trains, never
//! all clients' at once; the same inputs give the same split in every process.

use std::str::FromStr;

use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha12Rng;
use rand_distr::{Distribution, Gamma, LogNormal};

use super::DataError;

/// How a dataset is split among clients.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Partitioner {
    /// Every client a uniform random share of equal size.
    Iid,
    /// Label skew: for each class, the clients' shares of its samples are drawn from
    /// Dirichlet(α, …, α) (Hsu et al. 2019). Small α: each client sees few classes.
    Dirichlet { alpha: f64 },
    /// Pathological non-IID (McMahan et al. 2017): the samples sorted by label, cut into
    /// `clients × k` shards of equal size, `k` shards a client.
    Shards { k: usize },
    /// Quantity skew: IID labels, sizes in proportion to log-normal(0, σ) draws.
    Quantity { sigma: f64 },
}

impl FromStr for Partitioner {
    type Err = DataError;

    /// `iid`, `dirichlet:alpha=0.5`, `shards:k=2` or `quantity:sigma=1`.
    fn from_str(s: &str) -> Result<Self, DataError> {
        let invalid = |m: &str| {
            DataError::Invalid(format!(
                "partitioner `{s}`: {m} (use iid, dirichlet:alpha=A, shards:k=K or quantity:sigma=S)"
            ))
        };
        let (kind, params) = s.split_once(':').unwrap_or((s, ""));
        let value = |key: &str| -> Result<f64, DataError> {
            let found = params
                .split(',')
                .filter_map(|p| p.split_once('='))
                .find(|(k, _)| k.trim() == key)
                .ok_or_else(|| invalid(&format!("{key}= is missing")))?;
            found
                .1
                .trim()
                .parse::<f64>()
                .map_err(|_| invalid(&format!("{key} must be a number")))
        };
        match kind {
            "iid" => Ok(Partitioner::Iid),
            "dirichlet" => match value("alpha")? {
                a if a.is_finite() && a > 0.0 => Ok(Partitioner::Dirichlet { alpha: a }),
                _ => Err(invalid("alpha must be above 0")),
            },
            "shards" => match value("k")? {
                k if k >= 1.0 && k.fract() == 0.0 && k <= 1e6 => {
                    Ok(Partitioner::Shards { k: k as usize })
                }
                _ => Err(invalid("k must be a whole number of at least 1")),
            },
            "quantity" => match value("sigma")? {
                s if s.is_finite() && s >= 0.0 => Ok(Partitioner::Quantity { sigma: s }),
                _ => Err(invalid("sigma must be at least 0")),
            },
            _ => Err(invalid("unknown kind")),
        }
    }
}

/// A dataset's split among `clients`: client `k`'s samples are `order[starts[k]..starts[k+1]]`,
/// or, for label skew, its run of each class's order.
#[derive(Debug, Clone)]
pub struct Plan {
    clients: usize,
    split: Split,
}

#[derive(Debug, Clone)]
enum Split {
    /// One order, cut into runs.
    Runs { order: Vec<u32>, starts: Vec<u32> },
    /// Per class: its samples' order, cut into one run per client.
    PerClass {
        orders: Vec<Vec<u32>>,
        starts: Vec<Vec<u32>>,
    },
}

impl Plan {
    /// The split of a dataset with `labels` (in `0..classes`) among `clients`.
    pub fn new(
        partitioner: Partitioner,
        labels: &[i64],
        classes: usize,
        clients: usize,
        seed: u64,
    ) -> Result<Plan, DataError> {
        let n = labels.len();
        if clients == 0 || n < clients {
            return Err(DataError::Invalid(format!(
                "{n} samples cannot be split among {clients} clients: a dataset needs at least as many samples as clients"
            )));
        }
        if n > u32::MAX as usize {
            return Err(DataError::Invalid(format!(
                "{n} samples are more than a partition plan indexes (2^32)"
            )));
        }
        let mut rng = ChaCha12Rng::seed_from_u64(seed);
        let mut order: Vec<u32> = (0..n as u32).collect();
        order.shuffle(&mut rng);
        let split = match partitioner {
            Partitioner::Iid => Split::Runs {
                starts: cuts(n, &vec![1.0; clients]),
                order,
            },
            Partitioner::Quantity { sigma } => {
                let sizes = LogNormal::new(0.0, sigma)
                    .map_err(|e| DataError::Invalid(format!("quantity skew: {e}")))?;
                let weights: Vec<f64> = (0..clients).map(|_| sizes.sample(&mut rng)).collect();
                Split::Runs {
                    starts: cuts(n, &weights),
                    order,
                }
            }
            Partitioner::Shards { k } => {
                let shards = clients.checked_mul(k).filter(|&s| s <= n).ok_or_else(|| {
                    DataError::Invalid(format!(
                        "{n} samples cannot make {clients} × {k} shards of at least one sample"
                    ))
                })?;
                // Sorted by label (the shuffle above orders each class), cut into equal shards,
                // the shards dealt out in a random order.
                order.sort_by_key(|&i| labels[i as usize]);
                let bounds = cuts(n, &vec![1.0; shards]);
                let mut dealt: Vec<usize> = (0..shards).collect();
                dealt.shuffle(&mut rng);
                let (mut dealt_order, mut starts) = (Vec::with_capacity(n), vec![0u32]);
                for client in dealt.chunks(k) {
                    for &s in client {
                        let run = bounds[s] as usize..bounds[s + 1] as usize;
                        dealt_order.extend_from_slice(&order[run]);
                    }
                    starts.push(dealt_order.len() as u32);
                }
                Split::Runs {
                    order: dealt_order,
                    starts,
                }
            }
            Partitioner::Dirichlet { alpha } => {
                let gamma = Gamma::new(alpha, 1.0)
                    .map_err(|e| DataError::Invalid(format!("Dirichlet label skew: {e}")))?;
                let mut orders = vec![Vec::new(); classes.max(1)];
                for &i in &order {
                    let c = usize::try_from(labels[i as usize]).unwrap_or(usize::MAX);
                    orders
                        .get_mut(c)
                        .ok_or_else(|| {
                            DataError::Invalid(format!(
                                "label {} is not in 0..{classes}",
                                labels[i as usize]
                            ))
                        })?
                        .push(i);
                }
                // Dirichlet(α, …, α) as normalised Gamma(α) draws.
                let starts = orders
                    .iter()
                    .map(|o| {
                        let shares: Vec<f64> =
                            (0..clients).map(|_| gamma.sample(&mut rng)).collect();
                        cuts(o.len(), &shares)
                    })
                    .collect();
                Split::PerClass { orders, starts }
            }
        };
        Ok(Plan { clients, split })
    }

    /// Client `client`'s samples (indices into the dataset).
    pub fn indices(&self, client: usize) -> Vec<usize> {
        if client >= self.clients {
            return Vec::new();
        }
        let run = |order: &[u32], starts: &[u32]| {
            let (a, b) = (starts[client] as usize, starts[client + 1] as usize);
            order[a..b].iter().map(|&i| i as usize).collect::<Vec<_>>()
        };
        match &self.split {
            Split::Runs { order, starts } => run(order, starts),
            Split::PerClass { orders, starts } => orders
                .iter()
                .zip(starts)
                .flat_map(|(o, s)| run(o, s))
                .collect(),
        }
    }
}

/// Where each of `weights.len()` runs of `n` items starts (and, last, `n`), in proportion to the
/// weights (all 0: equal).
fn cuts(n: usize, weights: &[f64]) -> Vec<u32> {
    let total: f64 = weights.iter().sum();
    let equal = !(total.is_finite() && total > 0.0);
    let mut starts = Vec::with_capacity(weights.len() + 1);
    let mut acc = 0.0;
    for (i, w) in weights.iter().enumerate() {
        let at = match equal {
            true => (n as f64 * i as f64 / weights.len() as f64).round(),
            false => (n as f64 * acc / total).round(),
        };
        starts.push((at as usize).min(n) as u32);
        acc += w;
    }
    starts.push(n as u32);
    starts
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 10,000 samples of 10 classes, 1,000 each, interleaved.
    fn labels() -> Vec<i64> {
        (0..10_000).map(|i| (i % 10) as i64).collect()
    }

    fn every_sample_once(plan: &Plan, clients: usize, n: usize) -> Vec<Vec<usize>> {
        let parts: Vec<Vec<usize>> = (0..clients).map(|k| plan.indices(k)).collect();
        let mut all: Vec<usize> = parts.iter().flatten().copied().collect();
        all.sort_unstable();
        assert_eq!(all, (0..n).collect::<Vec<_>>(), "not a partition");
        parts
    }

    #[test]
    fn iid_gives_equal_shares_of_every_class() {
        let labels = labels();
        let plan = Plan::new(Partitioner::Iid, &labels, 10, 20, 1).unwrap();
        for part in every_sample_once(&plan, 20, labels.len()) {
            assert_eq!(part.len(), 500);
            // A class's count in a random 500 of 10,000 (hypergeometric, mean 50, sd ≈ 6.5).
            for c in 0..10 {
                let count = part.iter().filter(|&&i| labels[i] == c).count();
                assert!((20..=80).contains(&count), "class {c}: {count}");
            }
        }
    }

    #[test]
    fn dirichlet_shares_vary_as_the_distribution_says() {
        let labels = labels();
        let (clients, alpha) = (50usize, 0.5);
        let plan = Plan::new(Partitioner::Dirichlet { alpha }, &labels, 10, clients, 3).unwrap();
        let parts = every_sample_once(&plan, clients, labels.len());
        // Client k's share of class c: Dirichlet(α) marginals, Beta(α, (N−1)α), of variance
        // (1/N)(1 − 1/N)/(Nα + 1). Checked over all 500 (client, class) shares (their mean is
        // 1/N by construction).
        let n = clients as f64;
        let labels_ = &labels;
        let shares: Vec<f64> = parts
            .iter()
            .flat_map(|p| {
                (0..10)
                    .map(move |c| p.iter().filter(|&&i| labels_[i] == c).count() as f64 / 1_000.0)
            })
            .collect();
        let mean = shares.iter().sum::<f64>() / shares.len() as f64;
        let var = shares.iter().map(|s| (s - mean).powi(2)).sum::<f64>() / shares.len() as f64;
        let expected = (1.0 / n) * (1.0 - 1.0 / n) / (n * alpha + 1.0);
        assert!(
            (var / expected - 1.0).abs() < 0.3,
            "variance {var}, expected {expected}"
        );
        // A larger α is closer to IID.
        let even = Plan::new(
            Partitioner::Dirichlet { alpha: 100.0 },
            &labels,
            10,
            clients,
            3,
        )
        .unwrap();
        let spread = |p: &Plan| {
            (0..clients)
                .map(|k| p.indices(k).len() as f64)
                .map(|len| (len - 200.0).powi(2))
                .sum::<f64>()
        };
        assert!(spread(&even) < spread(&plan) / 10.0);
    }

    #[test]
    fn shards_give_each_client_at_most_k_classes_in_equal_sizes() {
        let labels = labels();
        let plan = Plan::new(Partitioner::Shards { k: 2 }, &labels, 10, 100, 5).unwrap();
        let mut classes_seen = 0;
        for part in every_sample_once(&plan, 100, labels.len()) {
            assert_eq!(part.len(), 100);
            let mut classes: Vec<i64> = part.iter().map(|&i| labels[i]).collect();
            classes.sort_unstable();
            classes.dedup();
            // 200 shards of 50: each within one class (1,000 a class), two a client.
            assert!((1..=2).contains(&classes.len()), "{classes:?}");
            classes_seen += classes.len();
        }
        assert!(
            classes_seen > 150,
            "shards of one class dealt to the same client too often"
        );
        assert!(Plan::new(Partitioner::Shards { k: 200 }, &labels, 10, 100, 5).is_err());
    }

    #[test]
    fn quantity_skew_spreads_sizes_log_normally() {
        let labels = labels();
        let plan = Plan::new(Partitioner::Quantity { sigma: 1.0 }, &labels, 10, 100, 9).unwrap();
        let sizes: Vec<f64> = every_sample_once(&plan, 100, labels.len())
            .iter()
            .map(|p| p.len() as f64)
            .collect();
        let logs: Vec<f64> = sizes.iter().filter(|&&s| s > 0.0).map(|s| s.ln()).collect();
        let mean = logs.iter().sum::<f64>() / logs.len() as f64;
        let sd = (logs.iter().map(|l| (l - mean).powi(2)).sum::<f64>() / logs.len() as f64).sqrt();
        // The sizes' logarithms have the draws' spread (σ = 1), up to rounding and sampling.
        assert!((0.75..1.25).contains(&sd), "sd of log sizes {sd}");
    }

    #[test]
    fn the_same_inputs_give_the_same_split_and_bad_ones_are_refused() {
        let labels = labels();
        let a = Plan::new(Partitioner::Dirichlet { alpha: 0.3 }, &labels, 10, 7, 1).unwrap();
        let b = Plan::new(Partitioner::Dirichlet { alpha: 0.3 }, &labels, 10, 7, 1).unwrap();
        let c = Plan::new(Partitioner::Dirichlet { alpha: 0.3 }, &labels, 10, 7, 2).unwrap();
        assert_eq!(a.indices(3), b.indices(3));
        assert_ne!(a.indices(3), c.indices(3));
        assert!(Plan::new(Partitioner::Iid, &labels[..5], 10, 6, 0).is_err());
        assert!("dirichlet:alpha=0".parse::<Partitioner>().is_err());
        assert!("shards".parse::<Partitioner>().is_err());
        assert_eq!(
            "quantity:sigma=0.5".parse::<Partitioner>().unwrap(),
            Partitioner::Quantity { sigma: 0.5 }
        );
    }
}
