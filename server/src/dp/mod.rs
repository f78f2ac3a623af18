//! Central differential privacy on the plain (sealed-upload) path.
//!
//! **What is guaranteed.** With `differential_privacy` set on a task, the sequence of global
//! models the task publishes is (ε, δ)-differentially private with respect to adding or removing
//! *one client's entire contribution* (user-level DP, add/remove adjacency): whatever one client
//! sent, in every round it took part in, changes the distribution of the published models by at
//! most the reported ε and δ. The round history reports ε after every round
//! ([`PrivacySpent`]), `/metrics` exposes it as `hora_dp_epsilon{task}`, and a task with an
//! `epsilon_budget` finishes before it publishes a round that would take ε above the budget.
//!
//! **The mechanism** is DP-FedAvg (McMahan, Ramage, Talwar, Zhang 2018) with a trusted server:
//! 1. Each update is clipped to L2 norm `C` and folded with weight 1 ([`clip`]): one client moves
//!    the round's sum by at most `C`.
//! 2. When the round closes, Gaussian noise of standard deviation `z·C` (`z`: the noise
//!    multiplier) is added once to every coordinate of the sum ([`noise`]), before the strategy
//!    turns the sum into the next model. It is a *discrete* Gaussian on a power-of-two grid 2^28
//!    times finer than the noise, drawn with integer arithmetic, onto which the sum is rounded
//!    first: no floating-point sampler whose low bits could betray the sum (Mironov 2012).
//! 3. The sum is divided by the *expected* number of updates, `target_clients`, not by the number
//!    that arrived: the published model is then a function of the noised sum and of public
//!    settings alone (post-processing keeps the guarantee), while dividing by the actual count
//!    would release a count that one client changes by 1. A round closed at its deadline with
//!    fewer updates moves the model proportionally less.
//! 4. The round is accounted as one run of the sampled Gaussian mechanism ([`accountant`]) with
//!    sampling rate `q` and multiplier `z`; ε at `delta` follows from the running RDP totals.
//!    With adaptive clipping, the noised count that steers `C` is part of the same budget.
//!
//! **The sampling rate and its assumption.** The server accounts each round with
//! `q = clients selected for the round / clients eligible for the task` (enrolled, not revoked,
//! and not bound by their enrolment to other tasks), counted when the round closes. The
//! amplification by subsampling behind small ε (Mironov, Talwar, Zhang 2019) holds when every
//! eligible client is in a round independently with probability `q`. The server selects the
//! first clients to join a round, so the guarantee means what it says only if *who* joins first
//! is independent of the clients' data: clients poll at jittered times and every eligible client
//! is online and willing in every round. A fleet where the same few devices always win the race,
//! or where availability depends on the data, gets less privacy than reported; if in doubt,
//! account as if `q = 1` by enrolling only the clients that take part.
//!
//! **What is not protected.** The server is trusted: it sees every decrypted update before
//! noise (central, not local, DP). The admin API's round history (participants, example counts,
//! reported metrics) is operator information and carries no DP guarantee; only the models are
//! private. Central DP needs the plain path: a secure-aggregation round sums masked vectors the
//! server cannot clip, so the two cannot be combined yet.
//!
//! **Retries.** A close that fails (storage trouble) is retried; the noise goes into the sum the
//! first time and the accumulator remembers it (in its checkpoints too), so a retried close
//! publishes the same noised sum — never an un-noised one, never noise twice. The accountant's
//! totals live in the task record and advance in the same transaction that publishes the round,
//! so a restart continues counting from the last published round. (The noise on the count that
//! steers an adaptive clip is drawn again by a retried close; only the published draw ever
//! leaves the server.)

pub mod accountant;
pub mod clip;
pub mod noise;

use hora_common::kernel::WeightedSum;
use hora_common::wire::{CreateTask, DpClip, DpConfig, PrivacySpent};
use serde::{Deserialize, Serialize};

use crate::store::{Contribution, Store, StoreError};
use accountant::RdpAccountant;
use clip::AdaptiveClip;

/// A task's privacy state, persisted in its record.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DpState {
    /// RDP totals of the rounds published so far.
    pub accountant: RdpAccountant,
    /// The clip norm C of the open round.
    pub clip: f64,
    /// Rounds accounted.
    pub rounds: u64,
}

impl DpState {
    pub fn new(config: &DpConfig) -> Self {
        DpState {
            accountant: RdpAccountant::default(),
            clip: match config.clip {
                DpClip::Fixed { norm } => norm,
                DpClip::Adaptive { initial_norm, .. } => initial_norm,
            },
            rounds: 0,
        }
    }

    /// ε spent so far at the task's δ.
    pub fn epsilon(&self, config: &DpConfig) -> f64 {
        self.accountant.epsilon(config.delta).epsilon
    }

    /// How an update of L2 norm `norm` is folded: the factor that clips it to C, and whether it
    /// came in unclipped (the bit adaptive clipping counts).
    pub fn clip_update(&self, norm: f64) -> (f64, bool) {
        (clip::clip_factor(norm, self.clip), norm <= self.clip)
    }
}

/// Why `differential_privacy` is refused at task creation (the sentence for the 400).
pub fn validate(config: &DpConfig, task: &CreateTask) -> Result<(), String> {
    let positive = |v: f64| v.is_finite() && v > 0.0;
    if task.secure_aggregation.is_some() {
        return Err("differential_privacy: central DP needs the plain path, and cannot be combined with secure_aggregation yet (the server would have to clip and noise a sum it never sees in the clear); drop one of the two".into());
    }
    let z = config.noise_multiplier;
    if !(z.is_finite() && (0.01..=1000.0).contains(&z)) {
        return Err(format!("differential_privacy.noise_multiplier must be between 0.01 and 1000 (got {z}); 0.5 to 2 is usual"));
    }
    if !(config.delta > 0.0 && config.delta < 1.0) {
        return Err(format!("differential_privacy.delta must be between 0 and 1, exclusive (got {}); choose it well below 1/(number of clients), e.g. 1e-5", config.delta));
    }
    if let Some(budget) = config.epsilon_budget.filter(|b| !positive(*b)) {
        return Err(format!(
            "differential_privacy.epsilon_budget must be a positive number (got {budget})"
        ));
    }
    let norm_ok = |n: f64| (clip::CLIP_RANGE.0..=clip::CLIP_RANGE.1).contains(&n);
    match &config.clip {
        DpClip::Fixed { norm } if !norm_ok(*norm) => Err(format!(
            "differential_privacy.clip.norm must be a positive number between 1e-12 and 1e12 (got {norm})"
        )),
        DpClip::Fixed { .. } => Ok(()),
        DpClip::Adaptive {
            initial_norm,
            target_quantile,
            learning_rate,
            count_noise,
        } => {
            if !norm_ok(*initial_norm) {
                return Err(format!("differential_privacy.clip.initial_norm must be a positive number between 1e-12 and 1e12 (got {initial_norm})"));
            }
            if !(0.0..=1.0).contains(target_quantile) {
                return Err(format!("differential_privacy.clip.target_quantile must be between 0 and 1 (got {target_quantile})"));
            }
            if !(0.0..=10.0).contains(learning_rate) {
                return Err(format!("differential_privacy.clip.learning_rate must be between 0 and 10 (got {learning_rate}); 0.2 is the paper's"));
            }
            if let Some(s) = count_noise.filter(|s| !positive(*s)) {
                return Err(format!(
                    "differential_privacy.clip.count_noise must be a positive number (got {s})"
                ));
            }
            let sigma_b = count_noise.unwrap_or(clip::default_count_noise(task.target_clients));
            if clip::sum_noise_multiplier(z, sigma_b).is_none() {
                return Err(format!("differential_privacy.clip.count_noise (σ_b = {sigma_b}) must exceed noise_multiplier / 2 = {}: the clipped-count query would take all the noise and leave none for the sum. Raise count_noise (its default is target_clients / 20) or the noise multiplier", z / 2.0));
            }
            Ok(())
        }
    }
}

/// Why the sum's noise could not be drawn for a model of `coordinates` values (the sentence for
/// the 400 at task creation, after [`validate`]): the grid's σ in steps grows with
/// `z · √coordinates` (plus up to 2^29 for the standard deviation itself, by its mantissa: the
/// clip norm's only say) and must stay below 2^31; checked for the worst clip norm.
pub fn validate_for_model(
    config: &DpConfig,
    task: &CreateTask,
    coordinates: usize,
) -> Result<(), String> {
    let z = config.noise_multiplier;
    let z_sum = match &config.clip {
        DpClip::Fixed { .. } => Some(z),
        DpClip::Adaptive { count_noise, .. } => clip::sum_noise_multiplier(
            z,
            count_noise.unwrap_or(clip::default_count_noise(task.target_clients)),
        ),
    };
    let Some(z_sum) = z_sum else {
        return Ok(()); // refused by `validate` already
    };
    // The worst case over clip norms: a standard deviation whose mantissa is just below 2
    // puts the most grid steps in it (the grid step is a power of two).
    let stddev = 2.0 - f64::EPSILON;
    noise::Grid::for_sum(stddev, stddev / z_sum, coordinates).map(|_| ()).map_err(|e| {
        format!("differential_privacy: the noise for a model of {coordinates} values with a sum noise multiplier of {z_sum:.4} cannot be drawn exactly ({e}); lower the noise multiplier (or, with an adaptive clip, raise count_noise)")
    })
}

/// What a closing round tells the privacy step.
#[derive(Debug, Clone, Copy)]
pub struct RoundFacts {
    pub round: u64,
    /// Clients selected for the attempt (at least the ones that contributed).
    pub selected: usize,
    pub updates: usize,
    /// Updates whose norm was at most C.
    pub unclipped: usize,
    /// Clients eligible for the task now.
    pub eligible: usize,
}

impl RoundFacts {
    /// The facts of round `round` of `task`, which selected `selected` clients and holds
    /// `contributions`; the eligible clients are counted now.
    pub fn of(
        store: &Store,
        task: &str,
        round: u64,
        selected: usize,
        contributions: &[Contribution],
    ) -> Result<Self, StoreError> {
        Ok(RoundFacts {
            round,
            selected,
            updates: contributions.len(),
            unclipped: contributions
                .iter()
                .filter(|c| c.unclipped == Some(true))
                .count(),
            eligible: eligible_clients(store, task)?,
        })
    }
}

/// What the privacy step decided about a closing round.
#[derive(Debug)]
pub enum Closing {
    /// Publish: the sum is noised and its denominator fixed.
    Publish(Box<Publication>),
    /// Do not publish: the round would take ε past the budget; the task ends, with this reason.
    BudgetReached(String),
}

#[derive(Debug)]
pub struct Publication {
    /// The task's privacy state once the round is published.
    pub state: DpState,
    /// For the round's history record.
    pub spent: PrivacySpent,
    /// Set when the next round would exceed the budget: the task ends with this reason.
    pub budget_reached: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum DpError {
    #[error(transparent)]
    Noise(#[from] noise::NoiseError),
    #[error("the round's sum: {0}")]
    Sum(#[from] hora_common::kernel::KernelError),
    #[error("the task's differential-privacy settings are inconsistent: {0}")]
    Config(String),
}

/// `q`: clients selected over clients eligible, at most 1.
pub fn sampling_rate(selected: usize, eligible: usize) -> f64 {
    if eligible == 0 {
        return 1.0;
    }
    (selected as f64 / eligible as f64).min(1.0)
}

/// The privacy step of closing a round of `task`: refuses a round that would exceed the budget; else
/// noises `sum` (unless `noised` says an earlier try of this close did), divides it by the
/// expected count, moves an adaptive clip, and accounts the round. `state` is not changed: the
/// caller stores [`Publication::state`] with the published round, so an unpublished round
/// costs nothing.
pub fn close_round(
    task: &CreateTask,
    state: &DpState,
    sum: &mut WeightedSum,
    noised: &mut bool,
    facts: RoundFacts,
) -> Result<Closing, DpError> {
    let config = task
        .differential_privacy
        .as_ref()
        .ok_or_else(|| DpError::Config("the task has no differential_privacy".into()))?;
    let z = config.noise_multiplier;
    let q = sampling_rate(facts.selected.max(facts.updates), facts.eligible);
    let step = state.accountant.step_rdp(q, z);
    let mut accountant = state.accountant.clone();
    accountant.compose_rdp(&step, 1);
    let before = state.epsilon(config);
    let epsilon = accountant.epsilon(config.delta).epsilon;
    if let Some(budget) = config.epsilon_budget.filter(|b| epsilon > *b) {
        return Ok(Closing::BudgetReached(format!(
            "privacy budget ε={budget} (δ={}) reached: publishing round {} would bring ε from {before:.4} to {epsilon:.4}; the round was not published",
            config.delta, facts.round
        )));
    }

    let expected = f64::from(task.target_clients);
    let (z_sum, adaptive) = match &config.clip {
        DpClip::Fixed { .. } => (z, None),
        DpClip::Adaptive {
            target_quantile,
            learning_rate,
            count_noise,
            ..
        } => {
            let sigma_b = count_noise.unwrap_or(clip::default_count_noise(task.target_clients));
            let z_sum = clip::sum_noise_multiplier(z, sigma_b).ok_or_else(|| {
                DpError::Config("the count noise leaves no noise for the sum".into())
            })?;
            let rule = AdaptiveClip {
                target_quantile: *target_quantile,
                learning_rate: *learning_rate,
            };
            (z_sum, Some((rule, sigma_b)))
        }
    };
    let noise_stddev = z_sum * state.clip;
    if !*noised {
        noise::add_gaussian_noise(sum.sum_mut(), noise_stddev, state.clip)?;
        *noised = true;
    } else {
        // Noised by a close that failed afterwards: the updates folded since are not on the
        // grid, and what is published must be (the noise covers the whole sum already).
        noise::snap_to_grid(sum.sum_mut(), noise_stddev, state.clip)?;
    }
    sum.set_total_weight(expected)?;
    let next_clip = match adaptive {
        None => state.clip,
        Some((rule, sigma_b)) => {
            let fraction = AdaptiveClip::noised_fraction(
                facts.unclipped,
                facts.updates,
                expected,
                noise::gaussian(sigma_b)?,
            );
            rule.next_clip(state.clip, fraction)
        }
    };

    // Would the next round, selecting as many clients as it may, still fit?
    let capacity = (f64::from(task.target_clients) * (1.0 + task.over_selection)).ceil() as usize;
    let next_q = sampling_rate(capacity, facts.eligible);
    let mut next = accountant.clone();
    match next_q == q {
        true => next.compose_rdp(&step, 1),
        false => next.compose(next_q, z, 1),
    }
    let next_epsilon = next.epsilon(config.delta).epsilon;
    let budget_reached = config
        .epsilon_budget
        .filter(|b| next_epsilon > *b && facts.round < task.rounds)
        .map(|budget| {
            format!(
                "privacy budget ε={budget} (δ={}) reached: ε is {epsilon:.4} after round {}, and round {} would bring it to {next_epsilon:.4}",
                config.delta,
                facts.round,
                facts.round + 1
            )
        });
    let rounds = state.rounds + 1;
    Ok(Closing::Publish(Box::new(Publication {
        state: DpState {
            accountant,
            clip: next_clip,
            rounds,
        },
        spent: PrivacySpent {
            epsilon,
            delta: config.delta,
            rounds,
            sampling_rate: q,
            clip: state.clip,
            noise_stddev,
        },
        budget_reached,
    })))
}

/// Clients that may take part in `task`: enrolled, not revoked, and not bound to other tasks.
pub fn eligible_clients(store: &Store, task: &str) -> Result<usize, StoreError> {
    Ok(store
        .clients()?
        .iter()
        .filter(|(_, c)| !c.revoked && c.tasks.as_ref().is_none_or(|t| t.iter().any(|t| t == task)))
        .count())
}

#[cfg(test)]
mod tests {
    use super::*;
    use hora_common::model::Model;

    fn task(target: u32) -> CreateTask {
        serde_json::from_value(serde_json::json!({
            "id": "t", "initial_model": "00".repeat(32), "model": {"kind": "builtin", "name": "mlp"},
            "rounds": 100, "min_clients": 1, "target_clients": target, "round_deadline_secs": 60,
        }))
        .unwrap()
    }

    fn fixed(z: f64, norm: f64, budget: Option<f64>) -> DpConfig {
        DpConfig {
            noise_multiplier: z,
            clip: DpClip::Fixed { norm },
            delta: 1e-5,
            epsilon_budget: budget,
        }
    }

    fn facts(round: u64, updates: usize, eligible: usize) -> RoundFacts {
        RoundFacts {
            round,
            selected: updates,
            updates,
            unclipped: updates,
            eligible,
        }
    }

    /// [`close_round`] for `t` with `config`.
    fn close(
        config: &DpConfig,
        t: &CreateTask,
        state: &DpState,
        sum: &mut WeightedSum,
        noised: &mut bool,
        facts: RoundFacts,
    ) -> Result<Closing, DpError> {
        let mut t = t.clone();
        t.differential_privacy = Some(config.clone());
        close_round(&t, state, sum, noised, facts)
    }

    /// A sum of `updates` zero updates over `n` parameters.
    fn zero_sum(n: usize, updates: usize) -> WeightedSum {
        let model = Model::from_tensors([("w", vec![n], vec![0.0; n])]).unwrap();
        let mut sum = WeightedSum::new(model.spec());
        for _ in 0..updates {
            sum.add_flat(1.0, model.data()).unwrap();
        }
        sum
    }

    #[test]
    fn configurations_are_checked_with_reasons() {
        let t = task(10);
        assert_eq!(validate(&fixed(1.0, 1.0, Some(3.0)), &t), Ok(()));
        let mut with_secagg = t.clone();
        with_secagg.secure_aggregation = Some(Default::default());
        let e = validate(&fixed(1.0, 1.0, None), &with_secagg).unwrap_err();
        assert!(e.contains("central DP needs the plain path"), "{e}");
        for (config, words) in [
            (fixed(0.0, 1.0, None), "noise_multiplier"),
            (fixed(f64::NAN, 1.0, None), "noise_multiplier"),
            (fixed(1.0, 0.0, None), "clip.norm"),
            (fixed(1.0, f64::INFINITY, None), "clip.norm"),
            (fixed(1.0, 1.0, Some(-1.0)), "epsilon_budget"),
            (
                DpConfig {
                    delta: 1.0,
                    ..fixed(1.0, 1.0, None)
                },
                "delta",
            ),
            (
                DpConfig {
                    delta: 0.0,
                    ..fixed(1.0, 1.0, None)
                },
                "delta",
            ),
        ] {
            let e = validate(&config, &t).unwrap_err();
            assert!(e.contains(words), "{e}");
        }
        let adaptive = |quantile: f64, rate: f64, count_noise: Option<f64>| DpConfig {
            clip: DpClip::Adaptive {
                initial_norm: 0.1,
                target_quantile: quantile,
                learning_rate: rate,
                count_noise,
            },
            ..fixed(1.0, 1.0, None)
        };
        // A count noise a hair above z/2 leaves the sum a multiplier of ~5·10⁶, whose noise
        // cannot be drawn on a grid for a million values; usual settings can.
        let e =
            validate_for_model(&adaptive(0.5, 0.2, Some(0.5 + 1e-14)), &t, 1_000_000).unwrap_err();
        assert!(
            e.contains("1000000 values") && e.contains("count_noise"),
            "{e}"
        );
        for config in [adaptive(0.5, 0.2, Some(2.0)), fixed(1000.0, 1.0, None)] {
            assert_eq!(validate_for_model(&config, &t, 100_000_000), Ok(()));
        }
        // 10 clients: the paper's σ_b = 10/20 = 0.5 is not above z/2 = 0.5.
        let e = validate(&adaptive(0.5, 0.2, None), &t).unwrap_err();
        assert!(
            e.contains("count_noise") && e.contains("target_clients / 20"),
            "{e}"
        );
        assert_eq!(validate(&adaptive(0.5, 0.2, None), &task(100)), Ok(()));
        assert_eq!(validate(&adaptive(0.5, 0.2, Some(2.0)), &t), Ok(()));
        assert!(validate(&adaptive(1.5, 0.2, Some(2.0)), &t)
            .unwrap_err()
            .contains("target_quantile"));
        assert!(validate(&adaptive(0.5, -1.0, Some(2.0)), &t)
            .unwrap_err()
            .contains("learning_rate"));
        assert!(validate(&adaptive(0.5, 0.2, Some(0.0)), &t)
            .unwrap_err()
            .contains("count_noise"));
    }

    /// The noise goes in once, with standard deviation z·C, and the denominator becomes the
    /// expected count; a retried close (noised already) publishes the same sum.
    #[test]
    fn a_round_is_noised_once_and_accounted() {
        let (z, c, n) = (1.2, 0.5, 1 << 17);
        let config = fixed(z, c, None);
        let t = task(8);
        let state = DpState::new(&config);
        let mut sum = zero_sum(n, 5);
        let mut noised = false;
        let Closing::Publish(p) =
            close(&config, &t, &state, &mut sum, &mut noised, facts(1, 5, 40)).unwrap()
        else {
            panic!("no budget: the round is published");
        };
        assert!(noised);
        assert_eq!(sum.total_weight(), 8.0, "divided by target_clients");
        let s = z * c;
        let values = sum.sum();
        let mean = values.iter().sum::<f64>() / n as f64;
        let std = (values.iter().map(|v| v * v).sum::<f64>() / n as f64).sqrt();
        // 5 standard errors (see noise.rs for the bounds).
        assert!(mean.abs() < 5.0 * s / (n as f64).sqrt(), "{mean}");
        assert!(
            (std / s - 1.0).abs() < 5.0 / (2.0 * n as f64).sqrt(),
            "{std}"
        );
        let want = RdpAccountant::default()
            .after(5.0 / 40.0, z, 1)
            .epsilon(1e-5)
            .epsilon;
        assert_eq!(p.spent.epsilon, want);
        assert_eq!(
            (p.spent.rounds, p.spent.sampling_rate, p.spent.clip),
            (1, 0.125, c)
        );
        assert_eq!(p.spent.noise_stddev, s);
        assert_eq!(p.state.rounds, 1);
        assert_eq!(state.rounds, 0, "the caller stores the new state");
        assert_eq!(p.budget_reached, None);

        let before = sum.sum().to_vec();
        let again = close(&config, &t, &state, &mut sum, &mut noised, facts(1, 5, 40));
        assert!(matches!(again, Ok(Closing::Publish(_))));
        assert_eq!(
            sum.sum(),
            &before[..],
            "a retried close adds no second noise"
        );
    }

    #[test]
    fn the_budget_stops_before_a_round_that_would_exceed_it() {
        let t = task(2);
        let z = 1.0;
        let one = RdpAccountant::default().after(0.2, z, 1);
        let (e1, e2) = (
            one.epsilon(1e-5).epsilon,
            one.after(0.2, z, 1).epsilon(1e-5).epsilon,
        );
        // Budget below one round: nothing is published, nothing noised.
        let config = fixed(z, 1.0, Some(e1 * 0.9));
        let mut sum = zero_sum(10, 2);
        let mut noised = false;
        let closing = close(
            &config,
            &t,
            &DpState::new(&config),
            &mut sum,
            &mut noised,
            facts(1, 2, 10),
        )
        .unwrap();
        let Closing::BudgetReached(reason) = closing else {
            panic!("over budget");
        };
        assert!(
            reason.contains("privacy budget") && reason.contains("round 1"),
            "{reason}"
        );
        assert!(!noised && sum.sum().iter().all(|v| *v == 0.0));
        // Budget between one and two rounds: round 1 is published and says the task must end.
        let config = fixed(z, 1.0, Some((e1 + e2) / 2.0));
        let closing = close(
            &config,
            &t,
            &DpState::new(&config),
            &mut sum,
            &mut noised,
            facts(1, 2, 10),
        )
        .unwrap();
        let Closing::Publish(p) = closing else {
            panic!("within budget");
        };
        let reason = p.budget_reached.expect("round 2 would exceed the budget");
        assert!(reason.contains("round 2"), "{reason}");
        assert_eq!(p.spent.epsilon, e1);
    }

    #[test]
    fn adaptive_clipping_takes_its_share_and_moves_the_clip() {
        let z = 1.0;
        let config = DpConfig {
            clip: DpClip::Adaptive {
                initial_norm: 2.0,
                target_quantile: 0.5,
                learning_rate: 0.2,
                count_noise: None,
            },
            ..fixed(z, 1.0, None)
        };
        let t = task(1000); // σ_b = 50
        assert_eq!(validate(&config, &t), Ok(()));
        let state = DpState::new(&config);
        assert_eq!(state.clip, 2.0);
        let mut sum = zero_sum(4, 1000);
        let mut noised = false;
        // Every update unclipped: b̃ ≈ 1 ± 0.05, so C shrinks by about e^{−0.1}.
        let Closing::Publish(p) = close(
            &config,
            &t,
            &state,
            &mut sum,
            &mut noised,
            facts(1, 1000, 10_000),
        )
        .unwrap() else {
            panic!("no budget");
        };
        let z_sum = clip::sum_noise_multiplier(z, 50.0).unwrap();
        assert_eq!(p.spent.noise_stddev, z_sum * 2.0);
        assert!(
            p.state.clip < 2.0 * (-0.2f64 * 0.25).exp(),
            "{}",
            p.state.clip
        );
        assert!(
            p.state.clip >= 2.0 * (-0.2f64 * 0.5).exp(),
            "{}",
            p.state.clip
        );
        // The update rule of the upload path.
        assert_eq!(state.clip_update(1.0), (1.0, true));
        assert_eq!(state.clip_update(4.0), (0.5, false));
    }

    #[test]
    fn sampling_rate_is_a_fraction_of_the_eligible() {
        assert_eq!(sampling_rate(2, 10), 0.2);
        assert_eq!(sampling_rate(12, 10), 1.0);
        assert_eq!(sampling_rate(3, 0), 1.0);
    }
}
