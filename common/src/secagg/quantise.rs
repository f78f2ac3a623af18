//! From f32 deltas to Z_2^32 and back, with the example-count weighting inside the vector.
//!
//! A client with `n` examples (counted at most `max_weight`) sends, for each coordinate `x`
//! clipped to `[-clip, clip]`, `q = ⌊n·x·scale + u⌋` with `u` uniform in [0, 1) (stochastic
//! rounding: unbiased), as a two's-complement `u32`, and then `n` itself as the last element.
//! The sum of the round is then `Σ q` and `Σ n`, from which the server computes the weighted
//! mean `Σ q / (scale · Σ n)`: FedAvg, without ever seeing one client's `n` or `x`.
//!
//! The sum must not wrap: with `N` clients, `N · (max_weight · clip · scale + 1) < 2^31`. The
//! scale is derived from the round's capacity so that this holds; a configuration that leaves
//! fewer than 8 bits for a one-example client's coordinate is refused at task creation.
//!
//! Error: each client's rounding moves its `q` by less than 1, so each coordinate of the mean
//! is within `N / (scale · Σ n)` of the exact weighted mean of the clipped deltas.

use rand_chacha::rand_core::RngCore;

use super::SecAggError;
use crate::wire::{EvaluationReport, EvaluationSums, SecAggOffer};

/// In a task with federated evaluation, each client's input carries its evaluation of the
/// model the round trains from in six slots before the weight, so the server learns only the
/// sum of the evaluations, as of the updates: `[1, n, n_loss, Σ n·loss, n_acc, Σ n·accuracy]`
/// (`n` counted at most `max_weight`; `n_loss`, `n_acc`: `n` when the evaluation has a loss,
/// an accuracy), all zero for a client that did not evaluate. The two sums are coordinates
/// weighted by `n`: accuracy as `accuracy · clip`, loss as `min(loss, LOSS_CAP) / LOSS_CAP ·
/// clip`, so they keep the bound that keeps the sum from wrapping.
pub const EVALUATION_SLOTS: usize = 6;

/// `⌊v + u⌋` with `u` uniform in [0, 1) from 53 random bits: `v` rounded without bias.
fn stochastic_round(v: f64, rng: &mut impl RngCore) -> i64 {
    let u = (rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64);
    (v + u).floor() as i64
}

/// A loss above this is counted as it in a secure evaluation.
pub const LOSS_CAP: f64 = 100.0;

/// The largest sum magnitude the signed interpretation of Z_2^32 holds.
const HALF: f64 = 2_147_483_647.0;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Quantiser {
    pub clip: f64,
    pub scale: f64,
    pub max_weight: u32,
}

impl Quantiser {
    /// The finest scale at which `clients` uploads of weight up to `max_weight` and values up to
    /// `clip` cannot wrap when summed.
    pub fn for_round(clip: f64, max_weight: u32, clients: usize) -> Result<Quantiser, SecAggError> {
        if !(clip.is_finite() && clip > 0.0) || max_weight == 0 || clients == 0 {
            return Err(SecAggError::Parameters(format!(
                "secure aggregation needs clip > 0 (got {clip}), max_weight >= 1 (got {max_weight}) and at least one client"
            )));
        }
        let n = clients as f64;
        let scale = (HALF - n) / (n * f64::from(max_weight) * clip);
        if scale * clip < 256.0 {
            return Err(SecAggError::Parameters(format!(
                "secure aggregation cannot fit the sum of {clients} clients × weight {max_weight} × clip {clip} into 32 bits \
                 with 8 bits of precision per coordinate: lower max_weight or clip, or select fewer clients per round \
                 (target_clients × (1 + over_selection))"
            )));
        }
        Ok(Quantiser {
            clip,
            scale,
            max_weight,
        })
    }

    /// The quantiser a round's offer names (check it before use: [`Quantiser::check`]).
    pub fn offered(offer: &SecAggOffer) -> Quantiser {
        Quantiser {
            clip: offer.clip,
            scale: offer.scale,
            max_weight: offer.max_weight,
        }
    }

    /// A client's input to the round `offer` describes: [`Quantiser::encode`], with the
    /// evaluation slots (zeros without an `evaluation`) when the round carries federated
    /// evaluation.
    pub fn input(
        &self,
        offer: &SecAggOffer,
        delta: &[f32],
        examples: u64,
        evaluation: Option<&EvaluationReport>,
        rng: &mut impl RngCore,
    ) -> Vec<u32> {
        match offer.evaluation {
            Some(_) => self.encode_with_evaluation(delta, examples, evaluation, rng),
            None => self.encode(delta, examples, rng),
        }
    }

    /// Checks parameters received from a server: the per-client bound must keep `clients`
    /// uploads from wrapping.
    pub fn check(&self, clients: usize) -> Result<(), SecAggError> {
        let bound = (f64::from(self.max_weight) * self.clip * self.scale + 1.0) * clients as f64;
        if !(self.clip.is_finite() && self.clip > 0.0 && self.scale.is_finite() && self.scale > 0.0)
            || self.max_weight == 0
            || bound > HALF
        {
            return Err(SecAggError::Parameters(format!(
                "quantisation parameters (clip {}, scale {}, max_weight {}) would wrap with {clients} clients",
                self.clip, self.scale, self.max_weight
            )));
        }
        Ok(())
    }

    /// Length of the vector for a model of `numel` parameters (the weight is the last element).
    pub fn len(numel: usize) -> usize {
        numel + 1
    }

    /// The weight a client with `examples` examples is counted with.
    pub fn weight(&self, examples: u64) -> u32 {
        examples.min(u64::from(self.max_weight)) as u32
    }

    /// Clips, weights and stochastically rounds `delta` (which must be finite).
    pub fn encode(&self, delta: &[f32], examples: u64, rng: &mut impl RngCore) -> Vec<u32> {
        let w = self.weight(examples);
        let factor = f64::from(w) * self.scale;
        let mut out = Vec::with_capacity(delta.len() + 1);
        out.extend(delta.iter().map(|&x| {
            let v = f64::from(x).clamp(-self.clip, self.clip) * factor;
            stochastic_round(v, rng) as i32 as u32
        }));
        out.push(w);
        out
    }

    /// [`Quantiser::encode`] with the evaluation slots before the weight: a client's input in
    /// a task with federated evaluation (`evaluation`: what it evaluated this round, if it did).
    pub fn encode_with_evaluation(
        &self,
        delta: &[f32],
        examples: u64,
        evaluation: Option<&EvaluationReport>,
        rng: &mut impl RngCore,
    ) -> Vec<u32> {
        let mut input = self.encode(delta, examples, rng);
        let weight = input.pop();
        input.extend(self.encode_evaluation(evaluation, rng));
        input.extend(weight);
        input
    }

    /// The evaluation slots of a client's input (see [`EVALUATION_SLOTS`]): its `evaluation`
    /// (checked), or zeros.
    fn encode_evaluation(
        &self,
        evaluation: Option<&EvaluationReport>,
        rng: &mut impl RngCore,
    ) -> [u32; EVALUATION_SLOTS] {
        let Some(e) = evaluation.filter(|e| e.check().is_ok()) else {
            return [0; EVALUATION_SLOTS];
        };
        let n = self.weight(e.num_examples);
        let mut weighted = |x: f64| {
            let v = f64::from(n) * x.clamp(0.0, 1.0) * self.clip * self.scale;
            stochastic_round(v, rng) as u32
        };
        let (n_loss, loss) = match e.loss {
            Some(l) => (n, weighted(l.min(LOSS_CAP) / LOSS_CAP)),
            None => (0, 0),
        };
        let (n_acc, accuracy) = match e.accuracy {
            Some(a) => (n, weighted(a)),
            None => (0, 0),
        };
        [1, n, n_loss, loss, n_acc, accuracy]
    }

    /// Takes the evaluation slots out of an unmasked sum of `clients` inputs that carried them
    /// (its last elements, before the weight): the sums of the evaluations, or why they are
    /// not sums honest inputs can make (a client filled its slots out of range: the evaluation
    /// is dropped; the update sum is not affected).
    pub fn take_evaluation(
        &self,
        sum: &mut Vec<u32>,
        clients: usize,
    ) -> Result<Result<EvaluationSums, String>, SecAggError> {
        if sum.len() < EVALUATION_SLOTS + 1 {
            return Err(SecAggError::Malformed(
                "a sum too short for its evaluation slots".into(),
            ));
        }
        let at = sum.len() - 1 - EVALUATION_SLOTS;
        let slots: Vec<u64> = sum
            .drain(at..at + EVALUATION_SLOTS)
            .map(u64::from)
            .collect();
        let [evaluators, n, n_loss, loss, n_acc, accuracy] = slots[..] else {
            return Err(SecAggError::Malformed("evaluation slots".into()));
        };
        // Each input adds at most 1 evaluator, `max_weight` examples, and to each weighted sum
        // at most its examples' worth of units plus one of rounding; nothing is negative (a
        // negative sum reads as 2^31 or more).
        let unit = self.clip * self.scale;
        let fits = |sum: u64, examples: u64| sum as f64 <= examples as f64 * unit + clients as f64;
        let honest = slots.iter().all(|&v| v <= i32::MAX as u64)
            && evaluators <= clients as u64
            && n <= evaluators * u64::from(self.max_weight)
            && n_loss <= n
            && n_acc <= n
            && fits(loss, n_loss)
            && fits(accuracy, n_acc);
        if !honest {
            return Ok(Err(format!(
                "the evaluation slots of the sum of {clients} inputs are out of range ({slots:?}): some client filled them wrongly"
            )));
        }
        Ok(Ok(EvaluationSums {
            clients: evaluators as u32,
            examples: n,
            loss_examples: n_loss,
            loss: loss as f64 * LOSS_CAP / unit,
            accuracy_examples: n_acc,
            accuracy: accuracy as f64 / unit,
        }))
    }

    /// Checks an unmasked sum of `clients` inputs is one such inputs can have: a wrong share
    /// leaves a mask in it, and a random vector is out of range almost surely.
    pub fn check_sum(&self, sum: &[u32], clients: usize) -> Result<(), SecAggError> {
        let Some((&total, values)) = sum.split_last() else {
            return Err(SecAggError::Malformed("an empty sum".into()));
        };
        let limit = clients as f64 * (f64::from(self.max_weight) * self.clip * self.scale + 1.0);
        if u64::from(total) > clients as u64 * u64::from(self.max_weight)
            || values.iter().any(|&q| f64::from(q as i32).abs() > limit)
        {
            return Err(SecAggError::Inconsistent(format!(
                "the unmasked sum is out of range for {clients} inputs: a revealed share was wrong"
            )));
        }
        Ok(())
    }

    /// The weighted sum `Σ w·x` (per coordinate) and the total weight `Σ w` of an unmasked sum.
    pub fn decode(&self, sum: &[u32]) -> Result<(Vec<f64>, u64), SecAggError> {
        let Some((&total, values)) = sum.split_last() else {
            return Err(SecAggError::Malformed("an empty sum".into()));
        };
        if total == 0 {
            return Err(SecAggError::Inconsistent(
                "the unmasked total weight is 0".into(),
            ));
        }
        Ok((
            values
                .iter()
                .map(|&q| f64::from(q as i32) / self.scale)
                .collect(),
            u64::from(total),
        ))
    }

    /// The bound on |secure mean − exact mean of the clipped deltas| per coordinate.
    pub fn error_bound(&self, clients: usize, total_weight: u64) -> f64 {
        clients as f64 / (self.scale * total_weight as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand_chacha::rand_core::SeedableRng;

    #[test]
    fn the_weighted_mean_comes_back_within_the_stated_bound() {
        let q = Quantiser::for_round(1.0, 1000, 50).unwrap();
        q.check(50).unwrap();
        let mut rng = rand_chacha::ChaCha20Rng::seed_from_u64(1);
        let deltas: Vec<Vec<f32>> = (0..50)
            .map(|c| {
                (0..100)
                    .map(|i| ((c * 7 + i) as f32 * 0.37).sin() * 0.9)
                    .collect()
            })
            .collect();
        let weights: Vec<u64> = (0..50).map(|c| 1 + (c * 37 % 1000) as u64).collect();
        let mut sum = vec![0u32; 101];
        for (d, &w) in deltas.iter().zip(&weights) {
            for (s, v) in sum.iter_mut().zip(q.encode(d, w, &mut rng)) {
                *s = s.wrapping_add(v);
            }
        }
        let (values, total) = q.decode(&sum).unwrap();
        assert_eq!(total, weights.iter().sum::<u64>());
        let bound = q.error_bound(50, total);
        for (i, v) in values.iter().enumerate() {
            let exact: f64 = deltas
                .iter()
                .zip(&weights)
                .map(|(d, &w)| f64::from(d[i]) * w as f64)
                .sum::<f64>()
                / total as f64;
            assert!(
                (v / total as f64 - exact).abs() <= bound,
                "{i}: {} vs {exact}",
                v / total as f64
            );
        }
    }

    #[test]
    fn extremes_do_not_wrap_and_clipping_applies() {
        let q = Quantiser::for_round(0.5, 100, 10).unwrap();
        let mut rng = rand_chacha::ChaCha20Rng::seed_from_u64(2);
        let mut sum = vec![0u32; 3];
        for _ in 0..10 {
            for (s, v) in sum
                .iter_mut()
                .zip(q.encode(&[1e9, -1e9], 1_000_000, &mut rng))
            {
                *s = s.wrapping_add(v);
            }
        }
        let (values, total) = q.decode(&sum).unwrap();
        assert_eq!(total, 1000);
        assert!((values[0] / 1000.0 - 0.5).abs() < 1e-6, "{values:?}");
        assert!((values[1] / 1000.0 + 0.5).abs() < 1e-6);
    }

    #[test]
    fn evaluations_summed_in_their_slots_come_back_as_their_weighted_sums() {
        let q = Quantiser::for_round(0.5, 100, 4).unwrap();
        let mut rng = rand_chacha::ChaCha20Rng::seed_from_u64(3);
        let report = |n, loss, accuracy| EvaluationReport {
            num_examples: n,
            loss,
            accuracy,
        };
        let inputs = [
            Some(report(30, Some(0.5), Some(0.75))),
            Some(report(500, Some(250.0), Some(1.0))), // counted as 100 examples, loss capped
            None,
            Some(report(10, None, Some(0.2))),
        ];
        let mut sum = vec![0u32; 2 + EVALUATION_SLOTS + 1];
        for (k, e) in inputs.iter().enumerate() {
            let input = q.encode_with_evaluation(&[0.1, -0.1], 1 + k as u64, e.as_ref(), &mut rng);
            assert_eq!(input.len(), Quantiser::len(2) + EVALUATION_SLOTS);
            for (s, v) in sum.iter_mut().zip(input) {
                *s = s.wrapping_add(v);
            }
        }
        q.check_sum(&sum, 4).unwrap();
        let sums = q.take_evaluation(&mut sum, 4).unwrap().unwrap();
        let (values, total) = q.decode(&sum).unwrap();
        assert_eq!(
            (values.len(), total),
            (2, 10),
            "the update is as without slots"
        );
        assert_eq!((sums.clients, sums.examples), (3, 140));
        assert_eq!((sums.loss_examples, sums.accuracy_examples), (130, 140));
        let unit = 4.0 / (q.scale * q.clip); // each client's rounding
        assert!((sums.loss - (30.0 * 0.5 + 100.0 * LOSS_CAP)).abs() <= unit * LOSS_CAP);
        assert!((sums.accuracy - (30.0 * 0.75 + 100.0 + 10.0 * 0.2)).abs() <= unit);
        assert_eq!(
            q.encode_evaluation(Some(&report(0, Some(1.0), None)), &mut rng),
            [0; 6]
        );
        // Slots no honest inputs make (here: more evaluators than inputs, a negative sum) are
        // refused, and taken out all the same.
        for bad in [[5, 10, 10, 0, 10, 0], [1, 10, 10, (-3i32) as u32, 0, 0]] {
            let mut sum = vec![0, 0];
            sum.extend(bad);
            sum.push(4);
            assert!(q.take_evaluation(&mut sum, 4).unwrap().is_err(), "{bad:?}");
            assert_eq!(sum, [0, 0, 4]);
        }
    }

    #[test]
    fn impossible_parameters_are_refused_with_advice() {
        let e = Quantiser::for_round(10.0, 1_000_000, 1000)
            .unwrap_err()
            .to_string();
        assert!(e.contains("lower max_weight or clip"), "{e}");
        assert!(Quantiser::for_round(f64::NAN, 1, 1).is_err());
        let q = Quantiser::for_round(1.0, 10, 10).unwrap();
        assert!(q.check(11).is_err());
        assert!(Quantiser {
            scale: f64::INFINITY,
            ..q
        }
        .check(1)
        .is_err());
    }
}
