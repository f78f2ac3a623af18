//! Settings of an asynchronous (FedBuff) task: clients train on whatever version of the model
//! they pulled and upload when done; the server folds each update into a buffer at once,
//! weighted down by its staleness (how many versions were published since its base), and
//! publishes a new version every `buffer_size` updates (Nguyen et al., "Federated Learning with
//! Buffered Asynchronous Aggregation", AISTATS 2022).

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// How an update's weight falls with its staleness `s` (versions published since its base).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Staleness {
    /// Every update weighs the same, however stale.
    Constant,
    /// `(1 + s)^-exponent`: FedBuff's choice, with exponent 0.5 (at most 10).
    Polynomial {
        #[serde(default = "half")]
        exponent: f64,
    },
    /// Full weight up to `after` versions, then `1 / (slope·(s − after) + 1)` (Xie et al.,
    /// FedAsync; `slope` at most 1e6).
    Hinge {
        #[serde(default = "ten")]
        slope: f64,
        #[serde(default = "four")]
        after: u64,
    },
}

fn half() -> f64 {
    0.5
}

fn ten() -> f64 {
    10.0
}

fn four() -> u64 {
    4
}

impl Default for Staleness {
    fn default() -> Self {
        Staleness::Polynomial { exponent: 0.5 }
    }
}

impl Staleness {
    /// The factor an update `staleness` versions old is weighted by, in (0, 1].
    pub fn weight(&self, staleness: u64) -> f64 {
        let s = staleness as f64;
        match *self {
            Staleness::Constant => 1.0,
            Staleness::Polynomial { exponent } => (1.0 + s).powf(-exponent),
            Staleness::Hinge { slope, after } if staleness > after => {
                1.0 / (slope * (staleness - after) as f64 + 1.0)
            }
            Staleness::Hinge { .. } => 1.0,
        }
    }

    /// Why these parameters are refused, if they are.
    pub fn check(&self) -> Result<(), String> {
        match *self {
            Staleness::Constant => Ok(()),
            Staleness::Polynomial { exponent } if (0.0..=10.0).contains(&exponent) => Ok(()),
            Staleness::Polynomial { .. } => {
                Err("staleness.exponent must be between 0 and 10".into())
            }
            Staleness::Hinge { slope, .. } if (0.0..=1e6).contains(&slope) => Ok(()),
            Staleness::Hinge { .. } => Err("staleness.slope must be between 0 and 1e6".into()),
        }
    }
}

/// The asynchronous mode of a task.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AsynchronousConfig {
    /// Updates per published version (FedBuff's K).
    #[serde(default = "defaults::buffer_size")]
    #[schema(minimum = 1)]
    pub buffer_size: u32,
    /// Updates older than this many versions are refused (409 `too_stale`).
    #[serde(default = "defaults::max_staleness")]
    pub max_staleness: u64,
    /// Clients training at once (pace steering holds the others back).
    #[serde(default = "defaults::concurrency")]
    #[schema(minimum = 1)]
    pub concurrency: u32,
    #[serde(default)]
    pub staleness: Staleness,
}

mod defaults {
    pub fn buffer_size() -> u32 {
        10
    }
    pub fn max_staleness() -> u64 {
        100
    }
    pub fn concurrency() -> u32 {
        100
    }
}

impl AsynchronousConfig {
    /// Why this configuration is refused, if it is.
    pub fn check(&self) -> Result<(), String> {
        if self.buffer_size == 0 {
            return Err("asynchronous.buffer_size must be at least 1".into());
        }
        if self.concurrency < self.buffer_size {
            return Err(format!(
                "asynchronous.concurrency ({}) must be at least buffer_size ({}): fewer clients training than a buffer holds would never fill it",
                self.concurrency, self.buffer_size
            ));
        }
        self.staleness.check()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_follow_each_rule() {
        assert_eq!(Staleness::Constant.weight(7), 1.0);
        let poly = Staleness::default();
        assert_eq!(poly.weight(0), 1.0);
        assert!((poly.weight(3) - 0.5).abs() < 1e-12, "(1+3)^-0.5");
        let hinge = Staleness::Hinge {
            slope: 10.0,
            after: 4,
        };
        assert_eq!(hinge.weight(4), 1.0);
        assert!((hinge.weight(5) - 1.0 / 11.0).abs() < 1e-12);
        for s in 0..1000 {
            for rule in [poly, hinge, Staleness::Constant] {
                let w = rule.weight(s);
                assert!(
                    w > 0.0 && w <= 1.0 && w >= rule.weight(s + 1),
                    "{rule:?} {s}"
                );
            }
        }
    }

    #[test]
    fn configurations_parse_with_defaults_and_bad_ones_say_why() {
        let c: AsynchronousConfig = serde_json::from_str(r#"{"buffer_size": 4}"#).unwrap();
        assert_eq!(c.max_staleness, 100);
        assert_eq!(c.staleness, Staleness::Polynomial { exponent: 0.5 });
        c.check().unwrap();
        let c: AsynchronousConfig =
            serde_json::from_str(r#"{"staleness": {"kind": "hinge", "after": 2}}"#).unwrap();
        assert_eq!(
            c.staleness,
            Staleness::Hinge {
                slope: 10.0,
                after: 2
            }
        );
        let bad: AsynchronousConfig =
            serde_json::from_str(r#"{"buffer_size": 20, "concurrency": 5}"#).unwrap();
        assert!(bad.check().unwrap_err().contains("concurrency"));
        let bad: AsynchronousConfig =
            serde_json::from_str(r#"{"staleness": {"kind": "polynomial", "exponent": -1}}"#)
                .unwrap();
        assert!(bad.check().unwrap_err().contains("exponent"));
        assert!(serde_json::from_str::<AsynchronousConfig>(r#"{"buffer": 3}"#).is_err());
    }
}
