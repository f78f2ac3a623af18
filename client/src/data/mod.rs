//! Local training data for a Hora client.
//!
//! Every dataset the client trains on is held in memory as a [`Dataset`]: a
//! flat, row-major `Vec<f32>` of features (each sample has the shape
//! [`Dataset::sample_shape`]) and one `i64` class label per sample in
//! `0..num_classes`. Keeping the representation flat makes it cheap to hand
//! batches to any tensor backend without this module depending on one.
//!
//! Data gets into a [`Dataset`] in one of three ways:
//!
//! * [`csv::load`] reads a delimited text file with numeric feature columns and
//!   one integer label column (by position, by header name, or the last one).
//! * [`idx::load_mnist`] / [`idx::load_mnist_dir`] read MNIST's big-endian IDX
//!   files, plain or gzip-compressed.
//! * [`synthetic::shard`] / [`synthetic::shards`] generate the Synthetic(α, β)
//!   and Synthetic-IID benchmarks of the FedProx paper (Li et al., MLSys 2020),
//!   one client's shard at a time and deterministically from a seed, so every
//!   simulated client can build its own shard without seeing anyone else's.
//!
//! A simulated federation splits one dataset among its virtual clients with
//! [`partition`]: IID, Dirichlet label skew, k-class shards, quantity skew.
//!
//! All loaders validate their input and report problems as [`DataError`]s that
//! name the file and the line or byte offset at fault; malformed files never
//! cause a panic.
//!
//! In federated learning the data never leaves the device: nothing in this
//! module performs any network I/O, and only model updates computed from a
//! [`Dataset`] are ever sent to the server.

pub mod csv;
pub mod idx;
pub mod partition;
pub mod source;
pub mod synthetic;

pub use source::DataSource;

use std::path::PathBuf;

use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// The largest number of classes a [`Dataset`] may declare.
///
/// This bounds the memory that downstream code (per-class counts, one-hot
/// targets, output layers) may allocate because of a label read from a file.
pub const MAX_CLASSES: usize = 1 << 24;

/// Everything that can go wrong while loading or generating data.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// A problem at a particular (1-based) line of a text file.
    #[error("{file}: line {line}: {message}")]
    Line {
        file: PathBuf,
        line: u64,
        message: String,
    },
    /// A problem at a particular byte offset of a binary file.
    #[error("{file}: byte offset {offset}: {message}")]
    Offset {
        file: PathBuf,
        offset: u64,
        message: String,
    },
    /// The file could not be opened or read.
    #[error("{file}: {source}")]
    Io {
        file: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// Invalid arguments or inconsistent data not tied to a file position.
    #[error("{0}")]
    Invalid(String),
}

/// A labelled dataset held in memory: `len()` samples, each `sample_shape`
/// f32 values (row-major), and a class label in `0..num_classes`.
#[derive(Debug, Clone, PartialEq)]
pub struct Dataset {
    /// `len() * sample_len()` feature values, sample after sample.
    pub features: Vec<f32>,
    /// One class label per sample, each in `0..num_classes`.
    pub labels: Vec<i64>,
    /// Shape of a single sample, e.g. `[1, 28, 28]` for MNIST or `[60]` for
    /// the synthetic benchmark. An empty shape means one scalar per sample.
    pub sample_shape: Vec<usize>,
    /// Number of classes of the task (at least 1).
    pub num_classes: usize,
}

impl Dataset {
    /// Builds a dataset, checking that the pieces agree: `num_classes` is in
    /// `1..=MAX_CLASSES`, the sample shape has no zero dimension,
    /// `features.len() == labels.len() * sample_len`, every label is in
    /// `0..num_classes`, and no feature is NaN or infinite.
    pub fn new(
        features: Vec<f32>,
        labels: Vec<i64>,
        sample_shape: Vec<usize>,
        num_classes: usize,
    ) -> Result<Self, DataError> {
        if num_classes == 0 {
            return Err(DataError::Invalid(
                "num_classes must be at least 1".to_string(),
            ));
        }
        if num_classes > MAX_CLASSES {
            return Err(DataError::Invalid(format!(
                "num_classes is {num_classes}, more than the supported maximum of {MAX_CLASSES}"
            )));
        }
        let sample_len = shape_len(&sample_shape)?;
        if sample_len == 0 {
            return Err(DataError::Invalid(format!(
                "sample_shape {sample_shape:?} has a zero dimension; every sample needs at least one value"
            )));
        }
        let expected = labels.len().checked_mul(sample_len).ok_or_else(|| {
            DataError::Invalid(format!(
                "{} samples of shape {sample_shape:?} overflow the addressable size",
                labels.len()
            ))
        })?;
        if features.len() != expected {
            return Err(DataError::Invalid(format!(
                "{} labels of sample shape {sample_shape:?} need {expected} feature values, but {} were given",
                labels.len(),
                features.len()
            )));
        }
        if let Some((i, label)) = labels
            .iter()
            .enumerate()
            .find(|(_, &l)| l < 0 || l as u64 >= num_classes as u64)
        {
            return Err(DataError::Invalid(format!(
                "label {label} of sample {i} is outside 0..{num_classes}"
            )));
        }
        if let Some((i, value)) = features.iter().enumerate().find(|(_, v)| !v.is_finite()) {
            return Err(DataError::Invalid(format!(
                "feature value {value} of sample {} (offset {} within the sample) is not finite",
                i / sample_len,
                i % sample_len
            )));
        }
        Ok(Self {
            features,
            labels,
            sample_shape,
            num_classes,
        })
    }

    /// Number of samples.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// Whether the dataset has no samples.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Number of f32 values per sample: the product of `sample_shape`.
    pub fn sample_len(&self) -> usize {
        self.sample_shape.iter().product()
    }

    /// The features of sample `index`, or `None` when out of range.
    pub fn sample(&self, index: usize) -> Option<(&[f32], i64)> {
        let label = *self.labels.get(index)?;
        let n = self.sample_len();
        let start = index.checked_mul(n)?;
        let features = self.features.get(start..start.checked_add(n)?)?;
        Some((features, label))
    }

    /// How many samples carry each label: a vector of length `num_classes`.
    pub fn class_counts(&self) -> Vec<usize> {
        let mut counts = vec![0usize; self.num_classes];
        for &label in &self.labels {
            if let Some(c) = usize::try_from(label).ok().and_then(|l| counts.get_mut(l)) {
                *c += 1;
            }
        }
        counts
    }

    /// Deterministic shuffle (seeded, ChaCha8) then split: the first
    /// `round(fraction * len)` samples train, the rest test.
    ///
    /// `train_fraction` must be in `(0, 1]`. When `0 < train_fraction < 1` and
    /// the dataset has at least two samples, both parts are non-empty (the
    /// rounded count is clamped to `1..=len-1`). Both parts keep
    /// `sample_shape` and `num_classes`.
    pub fn split(&self, train_fraction: f64, seed: u64) -> Result<(Dataset, Dataset), DataError> {
        if !(train_fraction > 0.0 && train_fraction <= 1.0) {
            return Err(DataError::Invalid(format!(
                "train fraction must be in (0, 1], got {train_fraction}"
            )));
        }
        let n = self.len();
        let mut n_train = ((train_fraction * n as f64).round() as usize).min(n);
        if train_fraction < 1.0 && n >= 2 {
            n_train = n_train.clamp(1, n - 1);
        }
        let mut order: Vec<usize> = (0..n).collect();
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        order.shuffle(&mut rng);
        let (train, test) = order.split_at(n_train);
        Ok((self.subset(train), self.subset(test)))
    }

    /// Concatenation (pooled data), in the order given.
    ///
    /// All parts must share `sample_shape`; the result's `num_classes` is the
    /// largest of the parts'. At least one part is required.
    pub fn concat(parts: &[&Dataset]) -> Result<Dataset, DataError> {
        let first = parts.first().ok_or_else(|| {
            DataError::Invalid("cannot concatenate an empty list of datasets".to_string())
        })?;
        if let Some((i, part)) = parts
            .iter()
            .enumerate()
            .find(|(_, p)| p.sample_shape != first.sample_shape)
        {
            return Err(DataError::Invalid(format!(
                "dataset {i} has sample shape {:?} but dataset 0 has {:?}; only datasets of the same shape can be pooled",
                part.sample_shape, first.sample_shape
            )));
        }
        let total_features: usize = parts.iter().map(|p| p.features.len()).sum();
        let total_labels: usize = parts.iter().map(|p| p.labels.len()).sum();
        let mut features = Vec::with_capacity(total_features);
        let mut labels = Vec::with_capacity(total_labels);
        for part in parts {
            features.extend_from_slice(&part.features);
            labels.extend_from_slice(&part.labels);
        }
        Ok(Dataset {
            features,
            labels,
            sample_shape: first.sample_shape.clone(),
            num_classes: parts.iter().map(|p| p.num_classes).max().unwrap_or(1),
        })
    }

    /// The samples at `indices`, in that order (repeats allowed).
    ///
    /// Intended for internal use with indices known to be in range; an
    /// out-of-range index panics.
    pub fn subset(&self, indices: &[usize]) -> Dataset {
        let n = self.sample_len();
        let mut features = Vec::with_capacity(indices.len() * n);
        let mut labels = Vec::with_capacity(indices.len());
        for &i in indices {
            features.extend_from_slice(&self.features[i * n..(i + 1) * n]);
            labels.push(self.labels[i]);
        }
        Dataset {
            features,
            labels,
            sample_shape: self.sample_shape.clone(),
            num_classes: self.num_classes,
        }
    }
}

/// Product of a shape's dimensions, with overflow reported as an error.
fn shape_len(shape: &[usize]) -> Result<usize, DataError> {
    shape.iter().try_fold(1usize, |acc, &d| {
        acc.checked_mul(d)
            .ok_or_else(|| DataError::Invalid(format!("sample_shape {shape:?} is too large")))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// `n` samples of shape [2]: sample i is `[i, -i]` with label `i % classes`.
    fn numbered(n: usize, classes: usize) -> Dataset {
        let features = (0..n).flat_map(|i| [i as f32, -(i as f32)]).collect();
        let labels = (0..n).map(|i| (i % classes) as i64).collect();
        Dataset::new(features, labels, vec![2], classes).expect("valid dataset")
    }

    #[test]
    fn new_accepts_consistent_data() {
        let d = numbered(5, 3);
        assert_eq!(d.len(), 5);
        assert!(!d.is_empty());
        assert_eq!(d.sample_len(), 2);
        assert_eq!(d.sample(4), Some((&[4.0f32, -4.0][..], 1)));
        assert_eq!(d.sample(5), None);
        assert_eq!(d.class_counts(), vec![2, 2, 1]);
    }

    #[test]
    fn new_rejects_inconsistent_data() {
        let err = |r: Result<Dataset, DataError>| r.expect_err("should fail").to_string();
        assert!(err(Dataset::new(vec![0.0; 3], vec![0, 1], vec![2], 2)).contains("need 4"));
        assert!(err(Dataset::new(vec![0.0; 4], vec![0, 2], vec![2], 2)).contains("label 2"));
        assert!(err(Dataset::new(vec![0.0; 4], vec![0, -1], vec![2], 2)).contains("label -1"));
        assert!(err(Dataset::new(vec![0.0; 4], vec![0, 0], vec![2], 0)).contains("num_classes"));
        assert!(err(Dataset::new(vec![], vec![], vec![0], 1)).contains("zero dimension"));
        assert!(err(Dataset::new(vec![0.0, f32::NAN], vec![0], vec![2], 1)).contains("not finite"));
        assert!(err(Dataset::new(vec![f32::INFINITY], vec![0], vec![], 1)).contains("not finite"));
        assert!(err(Dataset::new(vec![], vec![], vec![usize::MAX, 2], 1)).contains("too large"));
    }

    #[test]
    fn split_is_deterministic_and_partitions() {
        let d = numbered(10, 3);
        let (train, test) = d.split(0.8, 42).expect("split");
        assert_eq!((train.len(), test.len()), (8, 2));
        assert_eq!(
            d.split(0.8, 42).expect("split"),
            (train.clone(), test.clone())
        );
        assert_ne!(d.split(0.8, 43).expect("split").0, train);
        assert_eq!(train.num_classes, 3);
        assert_eq!(test.sample_shape, vec![2]);
        // Every sample appears exactly once, intact.
        let pooled = Dataset::concat(&[&train, &test]).expect("concat");
        let mut seen: Vec<usize> = (0..pooled.len())
            .map(|i| {
                let (x, y) = pooled.sample(i).expect("in range");
                let id = x[0] as usize;
                assert_eq!(x[1], -(id as f32));
                assert_eq!(y, (id % 3) as i64);
                id
            })
            .collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..10).collect::<Vec<_>>());
    }

    #[test]
    fn split_edge_cases() {
        let d = numbered(2, 2);
        let (a, b) = d.split(0.01, 1).expect("split");
        assert_eq!((a.len(), b.len()), (1, 1));
        let (a, b) = d.split(0.99, 1).expect("split");
        assert_eq!((a.len(), b.len()), (1, 1));
        let (a, b) = d.split(1.0, 1).expect("split");
        assert_eq!((a.len(), b.len()), (2, 0));
        let empty = numbered(0, 2);
        let (a, b) = empty.split(0.5, 1).expect("split");
        assert!(a.is_empty() && b.is_empty());
        for bad in [0.0, -0.5, 1.5, f64::NAN, f64::INFINITY] {
            assert!(
                d.split(bad, 1).is_err(),
                "fraction {bad} should be rejected"
            );
        }
    }

    #[test]
    fn concat_pools_and_checks_shapes() {
        let a = numbered(3, 2);
        let b = numbered(2, 5);
        let c = Dataset::concat(&[&a, &b]).expect("concat");
        assert_eq!(c.len(), 5);
        assert_eq!(c.num_classes, 5);
        assert_eq!(c.labels, vec![0, 1, 0, 0, 1]);
        assert_eq!(&c.features[6..], &[0.0, -0.0, 1.0, -1.0]);
        let other = Dataset::new(vec![1.0; 3], vec![0], vec![3], 1).expect("valid");
        let err = Dataset::concat(&[&a, &other]).expect_err("shape mismatch");
        assert!(err.to_string().contains("sample shape [3]"));
        assert!(Dataset::concat(&[]).is_err());
    }

    #[test]
    fn subset_selects_in_order() {
        let d = numbered(4, 4);
        let s = d.subset(&[3, 0, 3]);
        assert_eq!(s.labels, vec![3, 0, 3]);
        assert_eq!(s.features, vec![3.0, -3.0, 0.0, -0.0, 3.0, -3.0]);
    }

    proptest! {
        #[test]
        fn split_sizes(n in 0usize..300, fraction in 0.001f64..=1.0, seed in any::<u64>()) {
            let d = numbered(n, 7);
            let (train, test) = d.split(fraction, seed).expect("valid fraction");
            prop_assert_eq!(train.len() + test.len(), n);
            prop_assert_eq!(train.features.len(), train.len() * 2);
            prop_assert_eq!(test.features.len(), test.len() * 2);
            let rounded = ((fraction * n as f64).round() as usize).min(n);
            if fraction < 1.0 && n >= 2 {
                prop_assert!(!train.is_empty() && !test.is_empty());
                prop_assert_eq!(train.len(), rounded.clamp(1, n - 1));
            } else {
                prop_assert_eq!(train.len(), rounded);
            }
            let mut ids: Vec<usize> = train.features.iter().chain(&test.features)
                .step_by(2).map(|&x| x as usize).collect();
            ids.sort_unstable();
            prop_assert_eq!(ids, (0..n).collect::<Vec<_>>());
        }
    }
}
