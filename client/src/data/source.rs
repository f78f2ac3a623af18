//! Where a client's data comes from, as the user writes it on the command line:
//! `FILE.csv[?label=COLUMN]` (or `csv:FILE…`), `mnist:DIR`, `synthetic:alpha=1,beta=1,…` and
//! `synthetic-iid:…` (one client's shard, chosen by its index).

use std::path::PathBuf;
use std::str::FromStr;

use super::csv::{CsvOptions, LabelColumn};
use super::synthetic::{self, SyntheticConfig};
use super::{idx, DataError, Dataset};

/// A data source.
#[derive(Debug, Clone, PartialEq)]
pub enum DataSource {
    Csv {
        path: PathBuf,
        label: LabelColumn,
    },
    /// A directory with MNIST's IDX files (train-* for training, t10k-* held out).
    Mnist {
        dir: PathBuf,
    },
    Synthetic(SyntheticConfig),
}

impl FromStr for DataSource {
    type Err = DataError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.starts_with("synthetic:") || s.starts_with("synthetic-iid:") {
            return Ok(DataSource::Synthetic(s.parse()?));
        }
        if let Some(dir) = s.strip_prefix("mnist:") {
            return Ok(DataSource::Mnist { dir: dir.into() });
        }
        let csv = s.strip_prefix("csv:").unwrap_or(s);
        let (path, query) = csv.split_once('?').unwrap_or((csv, ""));
        if !s.starts_with("csv:") && !path.ends_with(".csv") {
            return Err(DataError::Invalid(format!(
                "unknown data source `{s}`: use FILE.csv[?label=COLUMN], mnist:DIR, synthetic:alpha=1,beta=1,clients=10 or synthetic-iid:clients=10"
            )));
        }
        let mut label = LabelColumn::Last;
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            match pair.split_once('=') {
                Some(("label", v)) => {
                    label = v
                        .parse()
                        .map(LabelColumn::Index)
                        .unwrap_or_else(|_| LabelColumn::Name(v.to_string()))
                }
                _ => {
                    return Err(DataError::Invalid(format!(
                        "unknown CSV option `{pair}` in `{s}`: the only one is label=COLUMN (a name or a 0-based index)"
                    )))
                }
            }
        }
        Ok(DataSource::Csv {
            path: path.into(),
            label,
        })
    }
}

impl DataSource {
    /// The training split and the held-out split: a synthetic source gives shard
    /// `client_index`'s own split; a CSV file is split `1 − holdout` / `holdout`; MNIST uses its
    /// test files.
    pub fn load(
        &self,
        client_index: Option<usize>,
        holdout: f64,
    ) -> Result<(Dataset, Option<Dataset>), DataError> {
        match self {
            DataSource::Synthetic(config) => {
                let k = client_index.ok_or_else(|| {
                    DataError::Invalid(
                        "a synthetic data source needs --client-index (this client's shard)".into(),
                    )
                })?;
                let shard = synthetic::shard(config, k)?;
                Ok((shard.train, Some(shard.test)))
            }
            DataSource::Csv { path, label } => {
                let options = CsvOptions {
                    label: label.clone(),
                    ..Default::default()
                };
                let data = super::csv::load(path, &options)?;
                if holdout <= 0.0 {
                    return Ok((data, None));
                }
                if !(0.0..1.0).contains(&holdout) {
                    return Err(DataError::Invalid(format!(
                        "the held-out fraction must be in [0, 1), not {holdout}"
                    )));
                }
                let (train, test) = data.split(1.0 - holdout, 0)?;
                Ok((train, Some(test)))
            }
            DataSource::Mnist { dir } => Ok((
                idx::load_mnist_dir(dir, "train")?,
                Some(idx::load_mnist_dir(dir, "test")?),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_what_users_type() {
        let parse = |s: &str| s.parse::<DataSource>().unwrap();
        assert_eq!(
            parse("data/x.csv?label=y"),
            DataSource::Csv {
                path: "data/x.csv".into(),
                label: LabelColumn::Name("y".into())
            }
        );
        assert_eq!(
            parse("csv:plain?label=3"),
            DataSource::Csv {
                path: "plain".into(),
                label: LabelColumn::Index(3)
            }
        );
        assert_eq!(
            parse("mnist:/data/mnist"),
            DataSource::Mnist {
                dir: "/data/mnist".into()
            }
        );
        assert!(matches!(
            "synthetic:alpha=0.5,beta=0.5,clients=30,seed=1".parse(),
            Ok(DataSource::Synthetic(_))
        ));
        assert!("x.parquet".parse::<DataSource>().is_err());
        assert!("x.csv?labels=3".parse::<DataSource>().is_err());
    }

    #[test]
    fn synthetic_needs_a_client_index() {
        let s: DataSource = "synthetic-iid:clients=3,seed=1".parse().unwrap();
        assert!(s.load(None, 0.2).is_err());
        let (train, test) = s.load(Some(2), 0.2).unwrap();
        assert!(!train.is_empty() && !test.unwrap().is_empty());
    }
}
