//! The Synthetic(α, β) and Synthetic-IID benchmarks of the FedProx paper
//! (Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020).
//!
//! Throughout, `N(m, s²)` denotes a normal distribution with mean `m` and
//! **variance** `s²`; in particular `N(0, α)` has standard deviation `√α`, and
//! a variance of 0 gives the constant `m`, so `α = 0` and `β = 0` are valid.
//!
//! **Synthetic(α, β)** (non-IID). For client `k`:
//!
//! * `u_k ~ N(0, α)` and `B_k ~ N(0, β)`;
//! * the entries of `W_k` (`classes × dim`) and `b_k` (`classes`) are drawn
//!   from `N(u_k, 1)`;
//! * the entries of `v_k` (`dim`) are drawn from `N(B_k, 1)`;
//! * each sample is `x ~ N(v_k, Σ)` with `Σ` diagonal, `Σ_jj = j^(-1.2)` for
//!   1-based `j` (a variance: the standard deviation is `j^(-0.6)`);
//! * its label is `y = argmax(softmax(W_k x + b_k)) = argmax(W_k x + b_k)`.
//!
//! `α` controls how much the clients' labelling functions differ and `β` how
//! much their input distributions differ.
//!
//! **Synthetic-IID**. One `W` and `b` with `N(0, 1)` entries are shared by all
//! clients, and every client draws `x ~ N(0, Σ)`.
//!
//! The number of samples of client `k` follows a power law (a Pareto
//! distribution): `n_k = min(max_samples, floor(min_samples · U^(-1/exponent)))`
//! with `U` uniform in `(0, 1]`. Each client's data is split into train and
//! test parts with [`Dataset::split`].
//!
//! Everything is deterministic: the shared IID parameters come from a ChaCha8
//! generator seeded by `seed` alone (stream 0), and everything belonging to
//! client `k` from the same seed on stream `k + 1`. So [`shard`] builds client
//! `k`'s data without generating any other client's.

use std::fmt;
use std::str::FromStr;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::StandardNormal;

use super::{DataError, Dataset, MAX_CLASSES};

/// The most f32 values a single generated array (a client's features, or a
/// labelling matrix) may hold: 2^28, i.e. 1 GiB.
pub const MAX_VALUES: usize = 1 << 28;

/// Parameters of the synthetic benchmark.
#[derive(Debug, Clone, PartialEq)]
pub struct SyntheticConfig {
    /// Variance of the per-client mean of the labelling parameters (`u_k`).
    /// Ignored when `iid`.
    pub alpha: f64,
    /// Variance of the per-client mean of the input means (`B_k`).
    /// Ignored when `iid`.
    pub beta: f64,
    /// Synthetic-IID instead of Synthetic(α, β).
    pub iid: bool,
    /// Number of clients.
    pub clients: usize,
    /// Seed from which all data is derived.
    pub seed: u64,
    /// Number of features per sample (60 in the paper).
    pub dim: usize,
    /// Number of classes (10 in the paper).
    pub classes: usize,
    /// Smallest number of samples per client (before the train/test split).
    pub min_samples: usize,
    /// Largest number of samples per client: the power law is capped here.
    pub max_samples: usize,
    /// Exponent of the power law of the sample counts; larger values give
    /// less skewed counts.
    pub power_law_exponent: f64,
    /// Fraction of each client's samples used for training, in `(0, 1]`.
    pub train_fraction: f64,
}

impl SyntheticConfig {
    /// Synthetic(α, β) with the paper's sizes (60 features, 10 classes).
    pub fn non_iid(alpha: f64, beta: f64, clients: usize, seed: u64) -> Self {
        Self {
            alpha,
            beta,
            iid: false,
            clients,
            seed,
            dim: 60,
            classes: 10,
            min_samples: 50,
            max_samples: 1000,
            power_law_exponent: 1.5,
            train_fraction: 0.8,
        }
    }

    /// Synthetic-IID with the paper's sizes (`alpha` and `beta` are 0).
    pub fn iid(clients: usize, seed: u64) -> Self {
        Self {
            iid: true,
            ..Self::non_iid(0.0, 0.0, clients, seed)
        }
    }

    /// Checks that the configuration describes a valid benchmark.
    pub fn validate(&self) -> Result<(), DataError> {
        let invalid = |message: String| Err(DataError::Invalid(message));
        for (name, value) in [("alpha", self.alpha), ("beta", self.beta)] {
            if !(value.is_finite() && value >= 0.0) {
                return invalid(format!(
                    "synthetic data: {name} is a variance and must be finite and at least 0, got {value}"
                ));
            }
        }
        if self.clients == 0 {
            return invalid("synthetic data: clients must be at least 1".to_string());
        }
        if self.dim == 0 {
            return invalid("synthetic data: dim must be at least 1".to_string());
        }
        if self.classes == 0 || self.classes > MAX_CLASSES {
            return invalid(format!(
                "synthetic data: classes must be in 1..={MAX_CLASSES}, got {}",
                self.classes
            ));
        }
        if self.min_samples == 0 {
            return invalid("synthetic data: min_samples must be at least 1".to_string());
        }
        if self.min_samples > self.max_samples {
            return invalid(format!(
                "synthetic data: min_samples ({}) must not exceed max_samples ({})",
                self.min_samples, self.max_samples
            ));
        }
        for (what, a, b) in [
            ("max_samples * dim", self.max_samples, self.dim),
            ("classes * dim", self.classes, self.dim),
        ] {
            if a.checked_mul(b).is_none_or(|n| n > MAX_VALUES) {
                return invalid(format!(
                    "synthetic data: {what} = {a} * {b} exceeds the limit of {MAX_VALUES} values"
                ));
            }
        }
        if !(self.power_law_exponent.is_finite() && self.power_law_exponent > 0.0) {
            return invalid(format!(
                "synthetic data: power_law_exponent must be finite and greater than 0, got {}",
                self.power_law_exponent
            ));
        }
        if !(self.train_fraction > 0.0 && self.train_fraction <= 1.0) {
            return invalid(format!(
                "synthetic data: train_fraction must be in (0, 1], got {}",
                self.train_fraction
            ));
        }
        Ok(())
    }
}

impl Default for SyntheticConfig {
    /// Synthetic(1, 1) with 10 clients and seed 0.
    fn default() -> Self {
        Self::non_iid(1.0, 1.0, 10, 0)
    }
}

/// One client's data.
#[derive(Debug, Clone, PartialEq)]
pub struct Shard {
    /// The part the client trains on.
    pub train: Dataset,
    /// The part the client evaluates on.
    pub test: Dataset,
}

/// Client `k`'s shard (`0 <= k < clients`), generated without generating the
/// others: deterministic from `(seed, k)` (and the sizes in `config`) alone.
pub fn shard(config: &SyntheticConfig, k: usize) -> Result<Shard, DataError> {
    config.validate()?;
    if k >= config.clients {
        return Err(DataError::Invalid(format!(
            "synthetic data: client index {k} is out of range; the configuration has {} clients \
             (0..{})",
            config.clients, config.clients
        )));
    }
    generate(config, k)
}

/// All shards, in client order.
pub fn shards(config: &SyntheticConfig) -> Result<Vec<Shard>, DataError> {
    config.validate()?;
    (0..config.clients).map(|k| generate(config, k)).collect()
}

/// A linear labelling function and input mean.
struct Model {
    /// `classes × dim`, row-major.
    w: Vec<f64>,
    b: Vec<f64>,
    /// Mean of the inputs (`v_k`).
    mean: Vec<f64>,
}

impl Model {
    /// `argmax(W x + b)`; the first maximal class on ties.
    fn label(&self, x: &[f32]) -> i64 {
        let mut best = 0usize;
        let mut best_logit = f64::NEG_INFINITY;
        for (c, (row, &bias)) in self.w.chunks_exact(x.len()).zip(&self.b).enumerate() {
            let logit = row
                .iter()
                .zip(x)
                .map(|(&w, &xi)| w * f64::from(xi))
                .sum::<f64>()
                + bias;
            if logit > best_logit {
                best = c;
                best_logit = logit;
            }
        }
        best as i64
    }
}

/// A draw from `N(mean, std²)`.
fn normal(rng: &mut ChaCha8Rng, mean: f64, std: f64) -> f64 {
    let z: f64 = rng.sample(StandardNormal);
    mean + std * z
}

fn normals(rng: &mut ChaCha8Rng, n: usize, mean: f64, std: f64) -> Vec<f64> {
    (0..n).map(|_| normal(rng, mean, std)).collect()
}

/// The generator for client `k` (stream `k + 1`); stream 0 is shared.
fn client_rng(seed: u64, k: usize) -> ChaCha8Rng {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(k as u64 + 1);
    rng
}

/// The labelling function shared by all Synthetic-IID clients.
fn iid_model(config: &SyntheticConfig) -> Model {
    let mut rng = ChaCha8Rng::seed_from_u64(config.seed);
    Model {
        w: normals(&mut rng, config.classes * config.dim, 0.0, 1.0),
        b: normals(&mut rng, config.classes, 0.0, 1.0),
        mean: vec![0.0; config.dim],
    }
}

/// Client `k`'s own labelling function and input mean (non-IID).
fn client_model(config: &SyntheticConfig, rng: &mut ChaCha8Rng) -> Model {
    let u = normal(rng, 0.0, config.alpha.sqrt());
    let big_b = normal(rng, 0.0, config.beta.sqrt());
    Model {
        w: normals(rng, config.classes * config.dim, u, 1.0),
        b: normals(rng, config.classes, u, 1.0),
        mean: normals(rng, config.dim, big_b, 1.0),
    }
}

/// The power-law sample count drawn from client `k`'s stream.
fn sample_count(config: &SyntheticConfig, rng: &mut ChaCha8Rng) -> usize {
    // `random` is uniform in [0, 1), so this is uniform in (0, 1].
    let u = 1.0 - rng.random::<f64>();
    let n = (config.min_samples as f64 * u.powf(-1.0 / config.power_law_exponent)).floor();
    if n.is_finite() && n < config.max_samples as f64 {
        (n as usize).max(config.min_samples)
    } else {
        config.max_samples
    }
}

/// Generates client `k`'s shard; `config` must be valid and `k < clients`.
fn generate(config: &SyntheticConfig, k: usize) -> Result<Shard, DataError> {
    let mut rng = client_rng(config.seed, k);
    let n = sample_count(config, &mut rng);
    let model = if config.iid {
        iid_model(config)
    } else {
        client_model(config, &mut rng)
    };
    let stds: Vec<f64> = (1..=config.dim).map(|j| (j as f64).powf(-0.6)).collect();
    let mut features = Vec::with_capacity(n * config.dim);
    let mut labels = Vec::with_capacity(n);
    for _ in 0..n {
        let start = features.len();
        features.extend(
            model
                .mean
                .iter()
                .zip(&stds)
                .map(|(&m, &s)| normal(&mut rng, m, s) as f32),
        );
        // Label the stored (f32) sample so features and labels agree exactly.
        labels.push(model.label(&features[start..]));
    }
    let split_seed: u64 = rng.random();
    let data = Dataset::new(features, labels, vec![config.dim], config.classes).map_err(|e| {
        DataError::Invalid(format!(
            "synthetic data for client {k}: {e} (alpha or beta too large?)"
        ))
    })?;
    let (train, test) = data.split(config.train_fraction, split_seed)?;
    Ok(Shard { train, test })
}

impl FromStr for SyntheticConfig {
    type Err = DataError;

    /// Parses `synthetic:alpha=1,beta=1,clients=10,seed=7` or
    /// `synthetic-iid:clients=10,seed=7`. Any subset of the keys `alpha`,
    /// `beta` (not for `synthetic-iid`), `clients`, `seed`, `dim`, `classes`,
    /// `min_samples`, `max_samples`, `power_law_exponent` and `train_fraction`
    /// may be given; the rest keep the defaults of
    /// [`SyntheticConfig::default`] / [`SyntheticConfig::iid`]`(10, 0)`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let invalid = |message: String| DataError::Invalid(format!("{s:?}: {message}"));
        let spec = s.trim();
        let (kind, params) = spec.split_once(':').unwrap_or((spec, ""));
        let mut config = match kind.trim() {
            "synthetic" => Self::default(),
            "synthetic-iid" => Self::iid(10, 0),
            other => {
                return Err(invalid(format!(
                    "unknown dataset {other:?}; expected \"synthetic:key=value,...\" or \
                     \"synthetic-iid:key=value,...\""
                )))
            }
        };
        let mut seen: Vec<&str> = Vec::new();
        for item in params.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let (key, value) = item
                .split_once('=')
                .map(|(k, v)| (k.trim(), v.trim()))
                .ok_or_else(|| invalid(format!("expected key=value, got {item:?}")))?;
            if seen.contains(&key) {
                return Err(invalid(format!("key {key:?} is given more than once")));
            }
            seen.push(key);
            let float = || {
                value
                    .parse::<f64>()
                    .map_err(|_| invalid(format!("{key} must be a number, got {value:?}")))
            };
            let int = || {
                value.parse::<usize>().map_err(|_| {
                    invalid(format!(
                        "{key} must be a non-negative integer, got {value:?}"
                    ))
                })
            };
            match key {
                "alpha" | "beta" if config.iid => {
                    return Err(invalid(format!(
                        "{key} does not apply to synthetic-iid; use \"synthetic:\" for \
                         Synthetic(alpha, beta)"
                    )))
                }
                "alpha" => config.alpha = float()?,
                "beta" => config.beta = float()?,
                "clients" => config.clients = int()?,
                "seed" => {
                    config.seed = value.parse().map_err(|_| {
                        invalid(format!("seed must be an integer in 0..2^64, got {value:?}"))
                    })?
                }
                "dim" => config.dim = int()?,
                "classes" => config.classes = int()?,
                "min_samples" => config.min_samples = int()?,
                "max_samples" => config.max_samples = int()?,
                "power_law_exponent" => config.power_law_exponent = float()?,
                "train_fraction" => config.train_fraction = float()?,
                unknown => {
                    return Err(invalid(format!(
                        "unknown key {unknown:?}; known keys are alpha, beta, clients, seed, dim, \
                         classes, min_samples, max_samples, power_law_exponent, train_fraction"
                    )))
                }
            }
        }
        config.validate()?;
        Ok(config)
    }
}

impl fmt::Display for SyntheticConfig {
    /// The form [`SyntheticConfig::from_str`] parses, with every key.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.iid {
            write!(f, "synthetic-iid:")?;
        } else {
            write!(f, "synthetic:alpha={},beta={},", self.alpha, self.beta)?;
        }
        write!(
            f,
            "clients={},seed={},dim={},classes={},min_samples={},max_samples={},\
             power_law_exponent={},train_fraction={}",
            self.clients,
            self.seed,
            self.dim,
            self.classes,
            self.min_samples,
            self.max_samples,
            self.power_law_exponent,
            self.train_fraction
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pooled(shard: &Shard) -> Dataset {
        Dataset::concat(&[&shard.train, &shard.test]).expect("same shape")
    }

    /// Label distribution of a dataset.
    fn histogram(d: &Dataset) -> Vec<f64> {
        let n = d.len() as f64;
        d.class_counts().iter().map(|&c| c as f64 / n).collect()
    }

    /// Total variation distance between two distributions.
    fn tv(p: &[f64], q: &[f64]) -> f64 {
        p.iter().zip(q).map(|(a, b)| (a - b).abs()).sum::<f64>() / 2.0
    }

    #[test]
    fn shards_are_deterministic() {
        let config = SyntheticConfig::non_iid(0.5, 0.5, 4, 7);
        let a = shards(&config).expect("generate");
        assert_eq!(a, shards(&config).expect("generate"));
        let other = shards(&SyntheticConfig {
            seed: 8,
            ..config.clone()
        })
        .expect("generate");
        assert_eq!(other.len(), 4);
        for (x, y) in a.iter().zip(&other) {
            assert_ne!(x, y);
        }
        let iid = SyntheticConfig::iid(3, 7);
        assert_eq!(shards(&iid).expect("iid"), shards(&iid).expect("iid"));
        assert_ne!(
            shards(&iid).expect("iid"),
            shards(&SyntheticConfig::iid(3, 9)).expect("iid")
        );
    }

    #[test]
    fn shard_k_equals_shards_k() {
        for config in [
            SyntheticConfig::non_iid(1.0, 1.0, 5, 3),
            SyntheticConfig::iid(5, 3),
        ] {
            let all = shards(&config).expect("generate");
            assert_eq!(all.len(), 5);
            for (k, expected) in all.iter().enumerate() {
                assert_eq!(&shard(&config, k).expect("shard"), expected);
            }
            // A client's shard does not depend on how many clients there are.
            let more = SyntheticConfig {
                clients: 9,
                ..config.clone()
            };
            assert_eq!(&shard(&more, 4).expect("shard"), &all[4]);
            assert!(shard(&config, 5)
                .expect_err("out of range")
                .to_string()
                .contains("client index 5"));
        }
    }

    #[test]
    fn shapes_labels_and_counts() {
        let config = SyntheticConfig {
            min_samples: 20,
            max_samples: 300,
            ..SyntheticConfig::non_iid(1.0, 1.0, 30, 11)
        };
        let all = shards(&config).expect("generate");
        let mut counts = Vec::new();
        for s in &all {
            for d in [&s.train, &s.test] {
                assert_eq!(d.sample_shape, vec![60]);
                assert_eq!(d.num_classes, 10);
                assert!(d.labels.iter().all(|&l| (0..10).contains(&l)));
                assert_eq!(d.features.len(), d.len() * 60);
            }
            let n = s.train.len() + s.test.len();
            assert!((20..=300).contains(&n), "{n} samples");
            assert_eq!(s.train.len(), (0.8 * n as f64).round() as usize);
            counts.push(n);
        }
        counts.sort_unstable();
        counts.dedup();
        assert!(counts.len() >= 10, "sample counts should vary: {counts:?}");
        // A heavy tail: some client is much larger than the smallest.
        assert!(counts[counts.len() - 1] >= 2 * counts[0], "{counts:?}");

        // Fixed-size clients when min == max.
        let fixed = SyntheticConfig {
            min_samples: 40,
            max_samples: 40,
            ..config
        };
        for s in shards(&fixed).expect("generate") {
            assert_eq!((s.train.len(), s.test.len()), (32, 8));
        }
    }

    #[test]
    fn degenerate_variances_and_small_sizes_work() {
        let config = SyntheticConfig {
            dim: 3,
            classes: 2,
            min_samples: 5,
            max_samples: 10,
            train_fraction: 1.0,
            ..SyntheticConfig::non_iid(0.0, 0.0, 3, 1)
        };
        for s in shards(&config).expect("generate") {
            assert!(s.test.is_empty());
            assert!((5..=10).contains(&s.train.len()));
            assert_eq!(s.train.sample_shape, vec![3]);
        }
        let one_class = SyntheticConfig {
            classes: 1,
            ..config
        };
        for s in shards(&one_class).expect("generate") {
            assert!(s.train.labels.iter().all(|&l| l == 0));
        }
    }

    /// Fixed-size clients, so label histograms are comparable.
    fn big(config: SyntheticConfig) -> SyntheticConfig {
        SyntheticConfig {
            min_samples: 500,
            max_samples: 500,
            ..config
        }
    }

    #[test]
    fn iid_clients_share_the_labelling_function() {
        let config = big(SyntheticConfig::iid(6, 5));
        let model = iid_model(&config);
        let all = shards(&config).expect("generate");
        let total =
            Dataset::concat(&all.iter().map(|s| &s.train).collect::<Vec<_>>()).expect("concat");
        let overall = histogram(&total);
        for s in &all {
            for d in [&s.train, &s.test] {
                for i in 0..d.len() {
                    let (x, y) = d.sample(i).expect("in range");
                    assert_eq!(model.label(x), y);
                }
            }
            let distance = tv(&histogram(&pooled(s)), &overall);
            assert!(distance < 0.15, "IID client differs by {distance}");
        }
    }

    #[test]
    fn non_iid_clients_differ() {
        let config = big(SyntheticConfig::non_iid(1.0, 1.0, 10, 5));
        let all: Vec<Dataset> = shards(&config)
            .expect("generate")
            .iter()
            .map(pooled)
            .collect();
        let hists: Vec<Vec<f64>> = all.iter().map(histogram).collect();
        let mut max_tv: f64 = 0.0;
        let mut sum_tv = 0.0;
        let mut pairs = 0.0;
        for i in 0..hists.len() {
            for j in i + 1..hists.len() {
                let d = tv(&hists[i], &hists[j]);
                max_tv = max_tv.max(d);
                sum_tv += d;
                pairs += 1.0;
            }
        }
        assert!(max_tv > 0.8, "max pairwise TV {max_tv}");
        assert!(sum_tv / pairs > 0.4, "mean pairwise TV {}", sum_tv / pairs);

        // Each client has its own labelling function: client 0's model
        // disagrees with client 1's labels on much of client 1's data.
        let mut rng = client_rng(config.seed, 0);
        sample_count(&config, &mut rng);
        let model0 = client_model(&config, &mut rng);
        let d1 = &all[1];
        let agree = (0..d1.len())
            .filter(|&i| {
                let (x, y) = d1.sample(i).expect("in range");
                model0.label(x) == y
            })
            .count();
        assert!(agree < d1.len() * 3 / 4, "{agree} of {} agree", d1.len());
    }

    #[test]
    fn parses_specs() {
        let c: SyntheticConfig = "synthetic:alpha=0.5,beta=1,clients=30,seed=7"
            .parse()
            .expect("parse");
        assert_eq!(
            c,
            SyntheticConfig::non_iid(0.5, 1.0, 30, 7),
            "other keys keep defaults"
        );
        let c: SyntheticConfig = " synthetic-iid: clients = 4 , seed=9, dim=10,classes=3,\
                                   min_samples=5,max_samples=50,train_fraction=0.5,\
                                   power_law_exponent=2 "
            .parse()
            .expect("parse");
        assert_eq!(
            c,
            SyntheticConfig {
                dim: 10,
                classes: 3,
                min_samples: 5,
                max_samples: 50,
                train_fraction: 0.5,
                power_law_exponent: 2.0,
                ..SyntheticConfig::iid(4, 9)
            }
        );
        assert_eq!(
            "synthetic".parse::<SyntheticConfig>().expect("parse"),
            SyntheticConfig::default()
        );
        for config in [
            SyntheticConfig::non_iid(0.25, 3.5, 12, u64::MAX),
            SyntheticConfig::iid(2, 1),
        ] {
            assert_eq!(
                config
                    .to_string()
                    .parse::<SyntheticConfig>()
                    .expect("round trip"),
                config
            );
        }
    }

    #[test]
    fn rejects_bad_specs_and_configs() {
        let err = |s: &str| {
            s.parse::<SyntheticConfig>()
                .expect_err("should fail")
                .to_string()
        };
        let msg = err("synthetic:alpha=1,gamma=2");
        assert!(msg.contains("unknown key \"gamma\""), "{msg}");
        assert!(err("synthetic-iid:alpha=1").contains("does not apply"));
        assert!(err("mnist:clients=3").contains("unknown dataset"));
        assert!(err("synthetic:clients=3,clients=4").contains("more than once"));
        assert!(err("synthetic:clients").contains("key=value"));
        assert!(err("synthetic:clients=-1").contains("non-negative integer"));
        assert!(err("synthetic:alpha=x").contains("must be a number"));
        assert!(err("synthetic:alpha=-1").contains("alpha"));
        assert!(err("synthetic:beta=inf").contains("beta"));
        assert!(err("synthetic:clients=0").contains("clients"));
        assert!(err("synthetic:min_samples=10,max_samples=5").contains("min_samples"));
        assert!(err("synthetic:train_fraction=0").contains("train_fraction"));
        assert!(err("synthetic:train_fraction=1.5").contains("train_fraction"));
        assert!(err("synthetic:dim=0").contains("dim"));
        assert!(err("synthetic:classes=0").contains("classes"));
        assert!(err("synthetic:power_law_exponent=0").contains("power_law_exponent"));
        assert!(err("synthetic:dim=100000,max_samples=100000").contains("exceeds"));
        let bad = SyntheticConfig {
            alpha: f64::NAN,
            ..SyntheticConfig::default()
        };
        assert!(shard(&bad, 0).is_err());
        assert!(shards(&bad).is_err());
    }
}
