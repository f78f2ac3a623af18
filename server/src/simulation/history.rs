//! What a simulation reports: one [`Row`] per round (an asynchronous task's version), printed
//! as a table while it runs and written as CSV or JSON.

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

/// One round (or asynchronous version) of a simulated federation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Row {
    pub round: u64,
    pub attempt: u32,
    /// `published` or `abandoned`.
    pub outcome: String,
    /// The simulated clock when the round closed, seconds since the federation started.
    pub sim_time_s: f64,
    /// Wall-clock seconds since the simulation started, when the round closed.
    pub wall_time_s: f64,
    /// Clients whose updates the round holds.
    pub participants: u64,
    /// Clients selected (or started, asynchronously) that sent nothing the round took: they
    /// dropped out, were too slow for the deadline, or their worker failed.
    pub dropouts: u64,
    pub examples: u64,
    /// The participants' example-weighted training loss.
    pub loss: Option<f64>,
    /// The published model on the evaluation clients' pooled held-out data.
    pub eval_loss: Option<f64>,
    pub eval_accuracy: Option<f64>,
    /// The task's federated evaluation of the published model (`evaluation` in the task): the
    /// reporting clients' example-weighted loss and accuracy on their own held-out data.
    #[serde(default)]
    pub federated_loss: Option<f64>,
    #[serde(default)]
    pub federated_accuracy: Option<f64>,
    /// Under central differential privacy: ε spent once this round was published.
    pub epsilon: Option<f64>,
    /// Bytes the round's clients downloaded (the model) and uploaded (their updates).
    pub bytes_down: u64,
    pub bytes_up: u64,
}

/// The table's header line.
pub fn header() -> String {
    format!(
        "{:>6} {:>4} {:>10} {:>11} {:>9} {:>6} {:>6} {:>9} {:>8} {:>8} {:>9} {:>8}",
        "round",
        "try",
        "outcome",
        "sim time s",
        "wall s",
        "in",
        "out",
        "examples",
        "loss",
        "accuracy",
        "eval loss",
        "epsilon"
    )
}

fn opt(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{v:.digits$}"))
}

impl Row {
    /// The row as the table prints it.
    pub fn line(&self) -> String {
        format!(
            "{:>6} {:>4} {:>10} {:>11.1} {:>9.2} {:>6} {:>6} {:>9} {:>8} {:>8} {:>9} {:>8}",
            self.round,
            self.attempt,
            self.outcome,
            self.sim_time_s,
            self.wall_time_s,
            self.participants,
            self.dropouts,
            self.examples,
            opt(self.loss, 4),
            opt(self.eval_accuracy, 4),
            opt(self.eval_loss, 4),
            opt(self.epsilon, 3),
        )
    }
}

/// `rows` as CSV, with a header line.
pub fn csv(rows: &[Row]) -> String {
    let mut out = String::from("round,attempt,outcome,sim_time_s,wall_time_s,participants,dropouts,examples,loss,eval_loss,eval_accuracy,epsilon,bytes_down,bytes_up,federated_loss,federated_accuracy\n");
    let cell = |v: Option<f64>| v.map_or_else(String::new, |v| v.to_string());
    for r in rows {
        let _ = writeln!(
            out,
            "{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{}",
            r.round,
            r.attempt,
            r.outcome,
            r.sim_time_s,
            r.wall_time_s,
            r.participants,
            r.dropouts,
            r.examples,
            cell(r.loss),
            cell(r.eval_loss),
            cell(r.eval_accuracy),
            cell(r.epsilon),
            r.bytes_down,
            r.bytes_up,
            cell(r.federated_loss),
            cell(r.federated_accuracy)
        );
    }
    out
}

/// The simulated time at which a published round's evaluation first reached `accuracy`.
pub fn time_to_accuracy(rows: &[Row], accuracy: f64) -> Option<f64> {
    rows.iter()
        .find(|r| r.eval_accuracy.is_some_and(|a| a >= accuracy))
        .map(|r| r.sim_time_s)
}
