//! The deadline side of the protocol: a stage that is over closes with whoever is in, and
//! either the next stage opens or the attempt ends (published sum, or abandoned with a reason).

use hora_common::secagg::graph;

use super::*;

/// An unmasked sum, decoded: `Σ w·x` per coordinate, `Σ w`, and the evaluation its slots carry.
type Decoded = (Vec<f64>, u64, Option<(u64, EvaluationSums)>);

impl SecAggRound {
    /// Checks and decodes the unmasked sum of `survivors` inputs, taking out the evaluation
    /// slots of a task with federated evaluation (their sums count when this round's clients
    /// evaluated the model it trains from).
    fn decode(&self, sum: &mut Vec<u32>, survivors: usize) -> Result<Decoded, SecAggError> {
        self.quantiser.check_sum(sum, survivors)?;
        let evaluation = match self.evaluation {
            Some(e) => match self.quantiser.take_evaluation(sum, survivors)? {
                Ok(sums) => e.round.map(|round| (round, sums)),
                Err(why) => {
                    tracing::warn!(task = %self.ctx.task, round = self.ctx.round, reason = %why, "the round's federated evaluation is dropped; its update sum is not affected");
                    None
                }
            },
            None => None,
        };
        let (values, total_weight) = self.quantiser.decode(sum)?;
        Ok((values, total_weight, evaluation))
    }

    /// The deadline check: closes the stage if its deadline has passed.
    pub fn tick(&self, store: &Store) -> Result<Outcome, ServerError> {
        let mut inner = lock(&self.inner);
        if inner.stage == Stage::Ended || inner.deadline_unix_ms > now_ms() {
            return Ok(Outcome::Continue);
        }
        self.close_stage(store, &mut inner)
    }

    /// Brings the current stage's deadline to now; the round's watcher closes it.
    pub fn expire_stage(&self) {
        let mut inner = lock(&self.inner);
        if inner.stage == Stage::Ended {
            return;
        }
        inner.deadline_unix_ms = inner.deadline_unix_ms.min(now_ms());
        drop(inner);
        self.changed.send_modify(|v| *v += 1);
    }

    /// Ends the current stage with whoever is in, and opens the next (or ends the attempt).
    pub(super) fn close_stage(
        &self,
        store: &Store,
        inner: &mut Inner,
    ) -> Result<Outcome, ServerError> {
        let stage_ms = self.config.stage_secs * 1000;
        // Across replicas: what every replica took of the stage, the stage's gate closed.
        match self.seal(store, inner)? {
            Ok(()) => {}
            Err(why) => {
                self.set_stage(inner, Stage::Ended);
                return Ok(Outcome::Abandon(why));
            }
        }
        let outcome = match inner.stage {
            Stage::Advertise => {
                let n = inner.adverts.len();
                if n < self.min_clients {
                    Outcome::Abandon(format!(
                        "{n} of the required {} clients advertised keys",
                        self.min_clients
                    ))
                } else {
                    let k = self
                        .config
                        .degree
                        .map_or_else(|| graph::default_degree(n), |k| k as usize)
                        .min(n - 1);
                    let k = if k + k % 2 >= n - 1 { n - 1 } else { k + k % 2 };
                    let t = self
                        .config
                        .threshold
                        .map_or_else(|| graph::default_threshold(k), |t| t as usize);
                    if t > k || t <= k / 2 {
                        Outcome::Abandon(format!(
                            "{n} clients give {k} neighbours each, too few for the threshold {t} (it must be a majority of the neighbours)"
                        ))
                    } else {
                        let ids: Vec<String> = inner.adverts.keys().cloned().collect();
                        self.fix_participants(inner, &ids, k, t)?;
                        self.set_stage(inner, Stage::ShareKeys);
                        let now = now_ms();
                        inner.deadline_unix_ms = now + stage_ms;
                        inner.input_deadline_unix_ms = now + stage_ms + self.round_deadline_ms;
                        Outcome::Continue
                    }
                }
            }
            Stage::ShareKeys => {
                inner.shared = (0..inner.participants.len())
                    .filter(|&i| inner.mail.contains_key(&inner.participants[i].id))
                    .collect();
                // A client with fewer than t neighbours that shared cannot mask (it would
                // refuse): leave it out, and with it the masks its neighbours would have
                // needed, until everyone left has t.
                loop {
                    let short: Vec<usize> = inner
                        .shared
                        .iter()
                        .copied()
                        .filter(|&i| {
                            inner.participants[i]
                                .neighbours
                                .iter()
                                .filter(|n| inner.shared.contains(n))
                                .count()
                                < inner.threshold
                        })
                        .collect();
                    if short.is_empty() {
                        break;
                    }
                    for i in short {
                        inner.shared.remove(&i);
                    }
                }
                if inner.shared.len() < self.min_clients {
                    Outcome::Abandon(format!(
                        "{} of the required {} clients shared their keys with at least {} neighbours that shared theirs",
                        inner.shared.len(),
                        self.min_clients,
                        inner.threshold
                    ))
                } else {
                    self.set_stage(inner, Stage::MaskedInput);
                    inner.deadline_unix_ms = inner.input_deadline_unix_ms;
                    inner.sum = vec![0; self.vector_len];
                    Outcome::Continue
                }
            }
            Stage::MaskedInput => {
                let u = self.unmasker(inner);
                let short = u.short_of_survivors();
                if inner.survivors.len() < self.min_clients {
                    Outcome::Abandon(format!(
                        "{} of the required {} masked inputs by the deadline",
                        inner.survivors.len(),
                        self.min_clients
                    ))
                } else if let Some((id, have)) = short.first() {
                    Outcome::Abandon(format!(
                        "too many clients dropped: `{id}` has {have} surviving neighbours, and its secret needs {} shares",
                        inner.threshold
                    ))
                } else {
                    self.set_stage(inner, Stage::Unmask);
                    inner.deadline_unix_ms = now_ms() + stage_ms;
                    Outcome::Continue
                }
            }
            Stage::Unmask => {
                let u = self.unmasker_with_answers(inner)?;
                let mut sum = inner.sum.clone();
                let short = u.short();
                if let Some((id, have)) = short.first() {
                    Outcome::Abandon(format!(
                        "too few survivors revealed their shares: `{id}` has {have} of the {} its secret needs",
                        inner.threshold
                    ))
                } else {
                    match u.finish(&mut sum) {
                        Err(e) => Outcome::Abandon(format!("unmasking failed: {e}")),
                        Ok(()) => match self.decode(&mut sum, inner.survivors.len()) {
                            Err(e) => Outcome::Abandon(format!("unmasking failed: {e}")),
                            Ok((values, total_weight, evaluation)) => Outcome::Publish {
                                values,
                                total_weight,
                                survivors: inner
                                    .survivors
                                    .iter()
                                    .map(|&i| inner.participants[i].id.clone())
                                    .collect(),
                                evaluation,
                            },
                        },
                    }
                }
            }
            Stage::Ended => Outcome::Continue,
        };
        match &outcome {
            Outcome::Continue => {
                self.save_state(store, inner)?;
                store.flush()?;
                // (The replicas' partial sums are in the attempt's, recorded now.)
                for file in std::mem::take(&mut inner.spent) {
                    store.remove_checkpoint(&file);
                }
                tracing::info!(task = %self.ctx.task, round = self.ctx.round, attempt = self.ctx.attempt, stage = ?inner.stage,
                    participants = inner.participants.len(), shared = inner.shared.len(), survivors = inner.survivors.len(), "secure aggregation stage opened");
            }
            // Waiters are woken by the coordinator once it has published or installed the retry,
            // so that nobody rejoins in between.
            _ => {
                // (`spent` goes once the attempt's end is recorded: a leader that dies first
                // leaves it to the next, which closes the stage again.)
                self.set_stage(inner, Stage::Ended);
                return Ok(outcome);
            }
        }
        self.changed.send_modify(|v| *v += 1);
        Ok(outcome)
    }
}
