//! Federated evaluation: after a round (or an asynchronous task's version) is published, some
//! clients evaluate that model on their own held-out data and report loss, accuracy and how
//! many examples they evaluated; the server folds the reports at once into example-weighted
//! sums and records only the result, in the round's history entry. Individual reports are never
//! kept: the server learns of a client's evaluation what a plain round's training metrics
//! already tell it of its training.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::ModelKind;
use crate::model::ModelDigest;

/// `CreateTask.evaluation`: which published models are evaluated, and by whom.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct EvaluationConfig {
    /// Every how many published rounds (versions) the model is evaluated; the last round's
    /// model always is.
    #[serde(default = "defaults::every")]
    #[schema(minimum = 1)]
    pub every: u64,
    /// The reports that complete an evaluation: the first clients to report are counted, later
    /// ones are told the evaluation is complete.
    #[schema(minimum = 1, maximum = 1000)]
    pub clients: u32,
    /// Each client is offered each evaluation with this probability (a fixed draw per client
    /// and version), so about this fraction of the federation evaluates; absent: every client
    /// is offered it until `clients` have reported.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(exclusive_minimum = 0, maximum = 1)]
    pub fraction: Option<f64>,
    /// Only clients that did not train the round (contribute to the version) evaluate its
    /// model: data the model has not just been fitted to.
    #[serde(default)]
    pub held_out: bool,
    /// How long after publication reports are taken (default: the task's round deadline). An
    /// evaluation ends at its deadline, once `clients` have reported, or when the next
    /// evaluation begins, whichever is first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1, maximum = 604800)]
    pub deadline_secs: Option<u64>,
}

mod defaults {
    pub fn every() -> u64 {
        1
    }
}

/// The most reports one evaluation may ask for (who reported is written with every report).
pub const MAX_EVALUATION_CLIENTS: u32 = 1_000;

/// The largest mean loss a report may carry.
pub const MAX_LOSS: f64 = 1e9;

impl EvaluationConfig {
    /// Why this configuration is refused, if it is.
    pub fn check(&self) -> Result<(), String> {
        if self.every == 0 {
            return Err("evaluation.every must be at least 1".into());
        }
        if self.clients == 0 || self.clients > MAX_EVALUATION_CLIENTS {
            return Err(format!(
                "evaluation.clients must be between 1 and {MAX_EVALUATION_CLIENTS}"
            ));
        }
        if self
            .fraction
            .is_some_and(|f| !(f.is_finite() && f > 0.0 && f <= 1.0))
        {
            return Err("evaluation.fraction must be above 0 and at most 1 (leave it out to offer every client)".into());
        }
        if self.deadline_secs.is_some_and(|d| d == 0 || d > 7 * 86_400) {
            return Err("evaluation.deadline_secs must be between 1 and 604800".into());
        }
        Ok(())
    }

    /// Whether the model of round (version) `round` of a task of `rounds` is evaluated.
    pub fn evaluates(&self, round: u64, rounds: u64) -> bool {
        round > 0 && (round % self.every.max(1) == 0 || round >= rounds)
    }
}

/// In a poll's answer: an evaluation this client is asked for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct EvaluationOffer {
    /// The round (version) whose published model is to be evaluated.
    pub round: u64,
    /// That model's digest (`GET /v1/tasks/{task}/model?digest=…`).
    pub model: ModelDigest,
    pub model_kind: ModelKind,
    /// For a task that trains part of its model: its frozen base, which the model is evaluated
    /// with (as in a round's offer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frozen_base: Option<ModelDigest>,
    /// Reports are taken until then.
    pub deadline_unix_ms: u64,
}

/// `POST /v1/tasks/{task}/evaluations/{round}`: one client's evaluation of that round's model.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct EvaluationReport {
    /// Held-out examples evaluated (at least 1); counted up to the task's
    /// `update_bounds.max_weight`, as an update's are.
    #[schema(minimum = 1)]
    pub num_examples: u64,
    /// Mean loss over them (0 to 1e9).
    #[schema(minimum = 0, maximum = 1e9)]
    pub loss: Option<f64>,
    /// Fraction of them classified right (0 to 1). A report has a loss, an accuracy or both.
    #[schema(minimum = 0, maximum = 1)]
    pub accuracy: Option<f64>,
}

impl EvaluationReport {
    /// Why this report is refused, if it is.
    pub fn check(&self) -> Result<(), String> {
        if self.num_examples == 0 {
            return Err("an evaluation needs num_examples of at least 1".into());
        }
        if self
            .loss
            .is_some_and(|l| !(l.is_finite() && (0.0..=MAX_LOSS).contains(&l)))
        {
            return Err(format!("loss must be a number between 0 and {MAX_LOSS:e}"));
        }
        if self
            .accuracy
            .is_some_and(|a| !(a.is_finite() && (0.0..=1.0).contains(&a)))
        {
            return Err("accuracy must be between 0 and 1".into());
        }
        if self.loss.is_none() && self.accuracy.is_none() {
            return Err("an evaluation reports a loss, an accuracy or both".into());
        }
        Ok(())
    }
}

/// The server's acknowledgement: the report is durable and counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct EvaluationReceipt {
    pub round: u64,
    /// Reports counted so far, this one included.
    pub reports: u32,
}

/// A round's federated evaluation, in its history entry: example-weighted means of the
/// clients' reports.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, ToSchema, Default)]
pub struct EvaluationSummary {
    /// Clients whose reports were counted.
    pub clients: u32,
    /// Examples they evaluated (each report's counted up to the task's bound).
    pub examples: u64,
    /// Mean loss, weighted by the examples of the reports that had one.
    pub loss: Option<f64>,
    /// Accuracy, weighted likewise.
    pub accuracy: Option<f64>,
}

/// The running sums of an evaluation: what the server keeps instead of the reports.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, Default)]
pub struct EvaluationSums {
    pub clients: u32,
    pub examples: u64,
    /// Σ examples·loss over the reports with a loss, and Σ of their examples.
    pub loss: f64,
    pub loss_examples: u64,
    /// Σ examples·accuracy over the reports with an accuracy, and Σ of their examples.
    pub accuracy: f64,
    pub accuracy_examples: u64,
}

impl EvaluationSums {
    /// Folds one (checked) report, weighted by `examples`.
    pub fn add(&mut self, report: &EvaluationReport, examples: u64) {
        self.clients += 1;
        self.examples = self.examples.saturating_add(examples);
        if let Some(loss) = report.loss {
            self.loss += examples as f64 * loss;
            self.loss_examples = self.loss_examples.saturating_add(examples);
        }
        if let Some(accuracy) = report.accuracy {
            self.accuracy += examples as f64 * accuracy;
            self.accuracy_examples = self.accuracy_examples.saturating_add(examples);
        }
    }

    /// The weighted means.
    pub fn summary(&self) -> EvaluationSummary {
        let mean = |sum: f64, n: u64| (n > 0).then(|| sum / n as f64);
        EvaluationSummary {
            clients: self.clients,
            examples: self.examples,
            loss: mean(self.loss, self.loss_examples),
            accuracy: mean(self.accuracy, self.accuracy_examples),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configurations_parse_with_defaults_and_bad_ones_say_why() {
        let c: EvaluationConfig = serde_json::from_str(r#"{"clients": 3}"#).unwrap();
        assert_eq!((c.every, c.fraction, c.held_out), (1, None, false));
        c.check().unwrap();
        assert!(c.evaluates(1, 5) && !c.evaluates(0, 5));
        let every3 = EvaluationConfig {
            every: 3,
            ..c.clone()
        };
        let evaluated: Vec<u64> = (1..=7).filter(|r| every3.evaluates(*r, 7)).collect();
        assert_eq!(evaluated, [3, 6, 7], "every third, and the last");
        for (bad, word) in [
            (r#"{"clients": 0}"#, "clients"),
            (r#"{"clients": 2, "every": 0}"#, "every"),
            (r#"{"clients": 2, "fraction": 0}"#, "fraction"),
            (r#"{"clients": 2, "fraction": 1.5}"#, "fraction"),
            (r#"{"clients": 2, "deadline_secs": 0}"#, "deadline_secs"),
        ] {
            let c: EvaluationConfig = serde_json::from_str(bad).unwrap();
            assert!(c.check().unwrap_err().contains(word), "{bad}");
        }
        assert!(serde_json::from_str::<EvaluationConfig>(r#"{"clients": 1, "x": 1}"#).is_err());
    }

    #[test]
    fn reports_are_checked_and_folded_by_their_examples() {
        let report = |n, loss, accuracy| EvaluationReport {
            num_examples: n,
            loss,
            accuracy,
        };
        for bad in [
            report(0, Some(1.0), None),
            report(5, Some(f64::NAN), None),
            report(5, Some(-1.0), None),
            report(5, Some(2e9), None),
            report(5, None, Some(1.5)),
            report(5, None, Some(f64::INFINITY)),
            report(5, None, None),
        ] {
            assert!(bad.check().is_err(), "{bad:?}");
        }
        let mut sums = EvaluationSums::default();
        assert_eq!(sums.summary().loss, None);
        sums.add(&report(10, Some(1.0), Some(0.5)), 10);
        sums.add(&report(30, Some(2.0), None), 30);
        let s = sums.summary();
        assert_eq!((s.clients, s.examples), (2, 40));
        assert!((s.loss.unwrap() - 1.75).abs() < 1e-12, "(10·1 + 30·2) / 40");
        assert!(
            (s.accuracy.unwrap() - 0.5).abs() < 1e-12,
            "only the first had one"
        );
    }
}
