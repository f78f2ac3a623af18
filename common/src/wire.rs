//! Wire types of the v1 HTTP APIs: the client API under `/v1/…` and the admin API under
//! `/admin/v1/…`, serialised as JSON (model bytes travel as safetensors, deltas as sealed
//! envelopes; both are raw bodies, not JSON).
//!
//! Requests reject unknown fields, so a misspelt option is an error rather than a silent default;
//! responses accept them, so an older client keeps working against a newer server. Every error
//! answer has the body [`ApiError`].

use std::fmt;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

pub use crate::codec::{Compression, ValueCodec};
use crate::envelope::RoundPublicKey;
use crate::model::{ModelDigest, ModelSpec};

mod asynchronous;
mod error_code;
mod evaluation;

pub use asynchronous::{AsynchronousConfig, Staleness};
pub use error_code::ErrorCode;
pub use evaluation::{
    EvaluationConfig, EvaluationOffer, EvaluationReceipt, EvaluationReport, EvaluationSummary,
    EvaluationSums, MAX_EVALUATION_CLIENTS, MAX_LOSS,
};

/// Stands in for a secret in `{:?}`: says that one is there, never what it is. Types that carry
/// tokens or secrets write their `Debug` with it, so that a log line or a panic message that
/// formats one cannot leak it.
pub struct Redacted;

impl fmt::Debug for Redacted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

/// `Some(Redacted)` for a secret that is set, `None` for one that is not.
pub fn redacted<T>(secret: &Option<T>) -> Option<Redacted> {
    secret.as_ref().map(|_| Redacted)
}

/// Path prefix of the client API.
pub const CLIENT_API: &str = "/v1";
/// Path prefix of the admin API.
pub const ADMIN_API: &str = "/admin/v1";

/// The body of every 4xx/5xx answer: a stable machine-readable `code` and a sentence for people.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct ApiError {
    /// e.g. `unauthorized`, `round_closed`, `shape_mismatch`, `payload_too_large`.
    pub code: ErrorCode,
    pub message: String,
}

impl fmt::Display for ApiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.message, self.code)
    }
}

/// What [`valid_id`] accepts, as the OpenAPI document's `pattern` (ECMA-262) for every id.
pub const ID_PATTERN: &str = "^[A-Za-z0-9_.-]{1,64}$";

/// A task or client identifier: 1–64 of `[A-Za-z0-9_.-]`, so it is safe in paths, file names and
/// logs.
pub fn valid_id(id: &str) -> bool {
    (1..=64).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b))
}

// ---------------------------------------------------------------------------------------------
// Tasks (admin API)

/// The model a task trains.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum ModelKind {
    /// A model built into the client (`logreg`, `mlp`, `cnn`), with its architecture parameters.
    Builtin {
        name: String,
        #[serde(default)]
        #[schema(value_type = Object)]
        params: serde_json::Map<String, serde_json::Value>,
    },
    /// A TorchScript module the server hands out with the weights (its digest, hex SHA-256).
    TorchScript {
        #[schema(pattern = "^[0-9a-fA-F]{64}$")]
        module_digest: String,
    },
}

/// How the round's updates become the next global model. Every strategy starts from the
/// round's pseudo-gradient Δ, the example-weighted mean of the clients' deltas; the stateful ones
/// keep per-parameter state across rounds, persisted with the task. Omitted parameters take the
/// defaults shown (`{"name":"fed_adam"}` is FedAdam with all of them).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default, ToSchema)]
#[serde(tag = "name", rename_all = "snake_case", deny_unknown_fields)]
pub enum StrategyConfig {
    /// FedAvg (McMahan et al. 2017): x ← x + Δ.
    #[default]
    FedAvg,
    /// FedAvgM, server momentum (Hsu et al. 2019): m ← β·m + Δ; x ← x + η·m.
    FedAvgM {
        /// Server learning rate η.
        #[serde(default = "defaults::fed_avg_m_eta")]
        #[schema(exclusive_minimum = 0.0, maximum = 1000.0, default = 1.0)]
        eta: f64,
        /// Momentum β, in [0, 1).
        #[serde(default = "defaults::momentum")]
        #[schema(minimum = 0.0, exclusive_maximum = 1.0, default = 0.9)]
        momentum: f64,
    },
    /// FedAdam (Reddi et al. 2021): m ← β₁·m + (1−β₁)·Δ; v ← β₂·v + (1−β₂)·Δ²;
    /// x ← x + η·m/(√v + τ).
    FedAdam {
        /// Server learning rate η.
        #[serde(default = "defaults::fed_adam_eta")]
        #[schema(exclusive_minimum = 0.0, maximum = 1000.0, default = 0.1)]
        eta: f64,
        /// First-moment decay β₁, in [0, 1).
        #[serde(default = "defaults::beta_1")]
        #[schema(minimum = 0.0, exclusive_maximum = 1.0, default = 0.9)]
        beta_1: f64,
        /// Second-moment decay β₂, in [0, 1).
        #[serde(default = "defaults::beta_2")]
        #[schema(minimum = 0.0, exclusive_maximum = 1.0, default = 0.99)]
        beta_2: f64,
        /// Adaptivity τ: added to √v, so coordinates with little signal take small steps.
        #[serde(default = "defaults::tau")]
        #[schema(minimum = 1e-9, maximum = 1000.0, default = 0.001)]
        tau: f64,
    },
    /// FedYogi (Reddi et al. 2021): as FedAdam, with v ← v − (1−β₂)·Δ²·sign(v − Δ²), so v
    /// grows as fast as FedAdam's but shrinks slowly.
    FedYogi {
        /// Server learning rate η.
        #[serde(default = "defaults::fed_yogi_eta")]
        #[schema(exclusive_minimum = 0.0, maximum = 1000.0, default = 0.1)]
        eta: f64,
        /// First-moment decay β₁, in [0, 1).
        #[serde(default = "defaults::beta_1")]
        #[schema(minimum = 0.0, exclusive_maximum = 1.0, default = 0.9)]
        beta_1: f64,
        /// Second-moment rate β₂, in [0, 1).
        #[serde(default = "defaults::beta_2")]
        #[schema(minimum = 0.0, exclusive_maximum = 1.0, default = 0.99)]
        beta_2: f64,
        /// Adaptivity τ: added to √v, so coordinates with little signal take small steps.
        #[serde(default = "defaults::tau")]
        #[schema(minimum = 1e-9, maximum = 1000.0, default = 0.001)]
        tau: f64,
    },
    /// FedAdagrad (Reddi et al. 2021): m as FedAdam's; v ← v + Δ²; x ← x + η·m/(√v + τ).
    FedAdagrad {
        /// Server learning rate η.
        #[serde(default = "defaults::fed_adagrad_eta")]
        #[schema(exclusive_minimum = 0.0, maximum = 1000.0, default = 0.1)]
        eta: f64,
        /// First-moment decay β₁, in [0, 1) (0: no momentum).
        #[serde(default = "defaults::beta_1")]
        #[schema(minimum = 0.0, exclusive_maximum = 1.0, default = 0.9)]
        beta_1: f64,
        /// Adaptivity τ: added to √v, so coordinates with little signal take small steps.
        #[serde(default = "defaults::tau")]
        #[schema(minimum = 1e-9, maximum = 1000.0, default = 0.001)]
        tau: f64,
    },
}

impl StrategyConfig {
    /// FedAvgM with its default parameters.
    pub fn fed_avg_m() -> Self {
        StrategyConfig::FedAvgM {
            eta: defaults::fed_avg_m_eta(),
            momentum: defaults::momentum(),
        }
    }

    /// FedAdam with its default parameters.
    pub fn fed_adam() -> Self {
        StrategyConfig::FedAdam {
            eta: defaults::fed_adam_eta(),
            beta_1: defaults::beta_1(),
            beta_2: defaults::beta_2(),
            tau: defaults::tau(),
        }
    }

    /// FedYogi with its default parameters.
    pub fn fed_yogi() -> Self {
        StrategyConfig::FedYogi {
            eta: defaults::fed_yogi_eta(),
            beta_1: defaults::beta_1(),
            beta_2: defaults::beta_2(),
            tau: defaults::tau(),
        }
    }

    /// FedAdagrad with its default parameters.
    pub fn fed_adagrad() -> Self {
        StrategyConfig::FedAdagrad {
            eta: defaults::fed_adagrad_eta(),
            beta_1: defaults::beta_1(),
            tau: defaults::tau(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "name", rename_all = "snake_case", deny_unknown_fields)]
pub enum OptimizerConfig {
    Sgd {
        #[serde(default)]
        momentum: f64,
    },
    Adam,
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        OptimizerConfig::Sgd { momentum: 0.0 }
    }
}

/// What a client does when the round deadline arrives while it is still training.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum DeadlinePolicy {
    /// Stop training and upload what it has.
    #[default]
    UploadPartial,
    /// Abandon the round.
    Skip,
}

/// Local training configuration handed to clients with each round.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TrainingConfig {
    #[serde(default = "defaults::epochs")]
    #[schema(minimum = 1)]
    pub epochs: u32,
    #[serde(default = "defaults::batch_size")]
    #[schema(minimum = 1)]
    pub batch_size: u32,
    #[serde(default = "defaults::learning_rate")]
    #[schema(exclusive_minimum = 0)]
    pub learning_rate: f64,
    #[serde(default)]
    pub optimizer: OptimizerConfig,
    /// FedProx's proximal coefficient μ (loss + μ/2·‖w − w_global‖²); 0 is plain FedAvg.
    #[serde(default)]
    #[schema(minimum = 0)]
    pub proximal_mu: f64,
    #[serde(default)]
    pub on_deadline: DeadlinePolicy,
}

impl Default for TrainingConfig {
    fn default() -> Self {
        TrainingConfig {
            epochs: defaults::epochs(),
            batch_size: defaults::batch_size(),
            learning_rate: defaults::learning_rate(),
            optimizer: OptimizerConfig::default(),
            proximal_mu: 0.0,
            on_deadline: DeadlinePolicy::default(),
        }
    }
}

/// `POST /admin/v1/tasks` (JSON part; the initial weights are uploaded as safetensors).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateTask {
    #[schema(pattern = "^[A-Za-z0-9_.-]{1,64}$")]
    pub id: String,
    /// Digest of the initial weights, uploaded first with `POST /admin/v1/models`.
    pub initial_model: ModelDigest,
    pub model: ModelKind,
    #[serde(default)]
    pub strategy: StrategyConfig,
    #[schema(minimum = 1)]
    pub rounds: u64,
    /// At least 1 (3 with secure aggregation), at most `target_clients`.
    #[schema(minimum = 1)]
    pub min_clients: u32,
    #[schema(minimum = 1)]
    pub target_clients: u32,
    /// Extra clients selected beyond `target_clients`, as a fraction, to absorb stragglers.
    #[serde(default)]
    #[schema(minimum = 0, maximum = 10)]
    pub over_selection: f64,
    /// At most a week.
    #[schema(minimum = 1, maximum = 604800)]
    pub round_deadline_secs: u64,
    #[serde(default)]
    pub training: TrainingConfig,
    /// Secure aggregation (SecAgg+): the server learns only the sum of the round's updates.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secure_aggregation: Option<SecureAggregationConfig>,
    /// Bounds on each plain (sealed) update: its weight and its L2 norm.
    #[serde(default)]
    pub update_bounds: UpdateBounds,
    /// Central differential privacy (plain path only): each update clipped to an L2 norm and
    /// weighted 1, Gaussian noise added once to each round's sum, ε accounted over rounds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub differential_privacy: Option<DpConfig>,
    /// Asynchronous buffered aggregation (FedBuff): no rounds that wait for the slowest client.
    /// Clients pull the current version whenever they are free and upload when done; every
    /// `buffer_size` updates (weighted down by their staleness) make the next version. In this
    /// mode `buffer_size` takes the place of `target_clients` (`min_clients` must not exceed it),
    /// `rounds` counts versions, and `round_deadline_secs` is how long a client may hold its
    /// training slot before the slot goes to another (its update is still taken afterwards).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub asynchronous: Option<AsynchronousConfig>,
    /// How clients compress their updates before sealing them (plain and asynchronous tasks;
    /// secure aggregation quantises on its own): f16, bf16, int8 or int4 values, optionally only
    /// the top-k fraction of each tensor with error feedback. Absent: plain float32.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compression: Option<Compression>,
    /// The tensors clients train, by name or by pattern (`*` stands for any run of characters,
    /// dots included: `["*lora_*"]`). The others are a frozen base that clients download once
    /// and keep by its digest; the task's model, its rounds' models and every update are the
    /// trainable tensors only. Absent: every tensor is trained.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trainable: Option<Vec<String>>,
    /// Federated evaluation: clients evaluate published models on their held-out data and the
    /// example-weighted result goes into each evaluated round's history entry. Absent: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub evaluation: Option<EvaluationConfig>,
    /// Makes this server a regional aggregator for a task of its parent (the server runs with
    /// `--parent`): each round starts from the parent's open round's model, and instead of
    /// publishing a model it forwards its partial (the example-weighted mean delta of its
    /// clients' updates, with their example count and number) to the parent's round, sealed to
    /// that round's key. The parent's strategy applies; this task's `rounds` bounds how many of
    /// the parent's rounds it takes part in. Plain rounds only, under a parent task that is plain
    /// without central DP (secure aggregation, asynchronous tasks and central DP take each
    /// client's update themselves); the parent's federated evaluation does not reach the
    /// region's clients.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<ParentTask>,
}

/// The parent's task a regional task forwards its rounds to ([`CreateTask::parent`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ParentTask {
    /// The task's id on the parent server.
    #[schema(pattern = "^[A-Za-z0-9_.-]{1,64}$")]
    pub task: String,
}

/// What one client's update may weigh in a round (the plain path; secure aggregation has its
/// own `clip` and `max_weight`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct UpdateBounds {
    /// The largest example count an update is weighted by; larger counts count as this.
    #[serde(default = "defaults::update_max_weight")]
    #[schema(minimum = 1)]
    pub max_weight: u64,
    /// Bound on the L2 norm of each delta (over all its tensors); None: the adaptive bound.
    #[serde(default)]
    #[schema(exclusive_minimum = 0.0)]
    pub max_norm: Option<f64>,
    /// Without `max_norm`: the bound is this many times the median L2 norm of the task's last
    /// [`ADAPTIVE_NORM_WINDOW`] accepted updates, once [`ADAPTIVE_NORM_WARMUP`] were accepted
    /// (since the server started), so one poisoned update cannot outweigh the round. None: no
    /// bound at all.
    #[serde(default = "defaults::adaptive_norm_factor")]
    #[schema(exclusive_minimum = 1.0)]
    pub adaptive_norm_factor: Option<f64>,
    /// Example counts above this many times the median weight of the task's last
    /// [`ADAPTIVE_NORM_WINDOW`] accepted updates count as that (after the same warm-up), so one
    /// client claiming a huge count cannot outweigh the round. None: only `max_weight`. Raise
    /// it (or set None) where clients' data sizes legitimately differ by more, as across silos.
    #[serde(default = "defaults::adaptive_weight_factor")]
    #[schema(exclusive_minimum = 1.0)]
    pub adaptive_weight_factor: Option<f64>,
    /// What happens to a delta whose norm exceeds the bound: scaled down to it, or refused.
    #[serde(default)]
    pub on_norm_exceeded: NormPolicy,
}

/// How many accepted update norms the adaptive bound takes its median of.
pub const ADAPTIVE_NORM_WINDOW: usize = 64;
/// How many accepted updates the adaptive bound waits for before it applies.
pub const ADAPTIVE_NORM_WARMUP: usize = 8;

impl Default for UpdateBounds {
    fn default() -> Self {
        UpdateBounds {
            max_weight: defaults::update_max_weight(),
            max_norm: None,
            adaptive_norm_factor: defaults::adaptive_norm_factor(),
            adaptive_weight_factor: defaults::adaptive_weight_factor(),
            on_norm_exceeded: NormPolicy::default(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum NormPolicy {
    /// Scale the delta down to the bound (and fold it).
    #[default]
    Clip,
    /// Refuse the update (400 `update_norm_exceeded`).
    Refuse,
}

/// Central differential privacy for a task (user-level: one client's whole update is what is
/// protected). The server clips each update to the L2 norm `C`, weights every update 1, adds
/// Gaussian noise of standard deviation `noise_multiplier × C` to every coordinate of the round's
/// sum once, divides by `target_clients`, and accounts the round with a Rényi-DP accountant for
/// the subsampled Gaussian mechanism. Cannot be combined with `secure_aggregation` yet.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DpConfig {
    /// z: the noise's standard deviation in units of the clip norm. With adaptive clipping this
    /// is the total multiplier of the sum and the clipped-count query together.
    #[schema(minimum = 0.01, maximum = 1000)]
    pub noise_multiplier: f64,
    pub clip: DpClip,
    /// δ of the reported (ε, δ): keep it well below 1 / (number of clients).
    #[serde(default = "defaults::dp_delta")]
    #[schema(exclusive_minimum = 0, exclusive_maximum = 1)]
    pub delta: f64,
    /// The task finishes before a round that would take ε (at `delta`) above this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(exclusive_minimum = 0)]
    pub epsilon_budget: Option<f64>,
}

/// How updates are clipped under differential privacy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "mode", rename_all = "snake_case", deny_unknown_fields)]
pub enum DpClip {
    /// Every update is scaled down to L2 norm at most `norm`.
    Fixed {
        #[schema(exclusive_minimum = 0)]
        norm: f64,
    },
    /// The norm follows a quantile of the updates' norms (Andrew et al. 2021): after each round
    /// `C ← C·exp(−learning_rate·(b̃ − target_quantile))`, where b̃ is the noised fraction of
    /// updates whose norm was at most `C`.
    Adaptive {
        #[schema(exclusive_minimum = 0)]
        initial_norm: f64,
        /// γ: the fraction of updates that should come in unclipped.
        #[serde(default = "defaults::dp_target_quantile")]
        #[schema(minimum = 0, maximum = 1)]
        target_quantile: f64,
        /// η_C of the geometric update.
        #[serde(default = "defaults::dp_clip_learning_rate")]
        #[schema(minimum = 0, maximum = 10)]
        learning_rate: f64,
        /// σ_b: standard deviation of the noise on the count of unclipped updates; it must
        /// exceed `noise_multiplier / 2`. Default: `target_clients / 20`, the paper's choice.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        #[schema(exclusive_minimum = 0)]
        count_noise: Option<f64>,
    },
}

/// The privacy a task has spent once a round is published under differential privacy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct PrivacySpent {
    /// ε of the (ε, δ) guarantee of every model published so far, this round's included.
    pub epsilon: f64,
    pub delta: f64,
    /// Rounds accounted so far.
    pub rounds: u64,
    /// q this round was accounted with: clients selected / clients eligible for the task.
    pub sampling_rate: f64,
    /// The L2 norm the round's updates were clipped to.
    pub clip: f64,
    /// Standard deviation of the noise added to each coordinate of the round's sum.
    pub noise_stddev: f64,
}

/// A task's secure-aggregation settings. Each delta is clipped to `[-clip, clip]`, weighted by
/// its example count (at most `max_weight`) and stochastically rounded into Z_2^32 at a scale
/// the server derives so that the sum of a full round cannot wrap.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SecureAggregationConfig {
    /// Bound on every coordinate of a delta (values beyond it are clipped).
    #[serde(default = "defaults::clip")]
    #[schema(exclusive_minimum = 0)]
    pub clip: f64,
    /// The largest example count a client is weighted by (larger counts count as this).
    #[serde(default = "defaults::max_weight")]
    #[schema(minimum = 1)]
    pub max_weight: u32,
    /// Neighbours per client (SecAgg+'s k); default: the smallest even number ≥ 3·log₂ n.
    #[serde(default)]
    #[schema(minimum = 2)]
    pub degree: Option<u32>,
    /// Shares needed to recover a client's secrets (t); default: a majority of its neighbours.
    #[serde(default)]
    #[schema(minimum = 2)]
    pub threshold: Option<u32>,
    /// Deadline of each key-exchange stage (advertise, share keys, unmask), in seconds (at most
    /// a day); the masked-input stage has `round_deadline_secs` for training.
    #[serde(default = "defaults::stage_secs")]
    #[schema(minimum = 1, maximum = 86400)]
    pub stage_secs: u64,
}

impl Default for SecureAggregationConfig {
    fn default() -> Self {
        SecureAggregationConfig {
            clip: defaults::clip(),
            max_weight: defaults::max_weight(),
            degree: None,
            threshold: None,
            stage_secs: defaults::stage_secs(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum TaskState {
    Running,
    Paused,
    Stopped,
    Finished,
}

/// A task as the admin API reports it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct TaskInfo {
    pub config: CreateTask,
    pub state: TaskState,
    pub spec: ModelSpec,
    /// Rounds published so far.
    pub published_rounds: u64,
    pub global_model: ModelDigest,
    pub open_round: Option<OpenRoundStatus>,
    /// Why the task ended before its rounds were done (e.g. its privacy budget was reached).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended_reason: Option<String>,
    /// For a task that trains part of its model (`trainable`): the frozen base, whose tensors
    /// the task never changes. `spec` and `global_model` are then the trainable part's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frozen_base: Option<FrozenBase>,
}

/// The tensors of a task's model that its clients do not train.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct FrozenBase {
    /// Its digest: `GET /v1/tasks/{task}/model?digest=…` (clients),
    /// `GET /admin/v1/tasks/{task}/base` (operators).
    pub model: ModelDigest,
    pub spec: ModelSpec,
}

/// The round a task has open.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct OpenRoundStatus {
    pub round: u64,
    /// Retries of this round after abandoned attempts (0 for the first).
    pub attempt: u32,
    /// Clients selected for the round; in an asynchronous task, clients holding a training slot.
    pub selected: u32,
    /// Updates in the round so far; in an asynchronous task, in the open buffer.
    pub accepted: u32,
    pub deadline_unix_ms: u64,
    /// A secure-aggregation round's stage: `advertise`, `share_keys`, `masked_input`, `unmask`,
    /// `ended` (closing).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stage: Option<String>,
}

/// `POST /admin/v1/models` → the stored model's digest and spec.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ModelUploaded {
    pub digest: ModelDigest,
    pub spec: ModelSpec,
}

/// `POST /admin/v1/modules` → the TorchScript module's digest (hex SHA-256).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct ModuleUploaded {
    pub digest: String,
}

/// `POST /admin/v1/enrolments`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema, Default)]
#[serde(deny_unknown_fields)]
pub struct CreateEnrolment {
    /// How long the token stays valid (default one day; clamped to between 1 s and a year).
    #[serde(default)]
    pub ttl_secs: Option<u64>,
    /// The tasks the client enrolled with this token may use (absent: every task). For any
    /// other task it is answered 404, as if the task did not exist.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(schema_with = id_list_schema)]
    pub tasks: Option<Vec<String>>,
    /// The client enrolled with this token is a regional aggregator (another `hora-server`
    /// running with `--parent`): its updates may each stand for several clients
    /// ([`UpdateMeta::contributors`]). Default false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub aggregator: bool,
    /// For an aggregator: the most clients one of its updates may stand for (absent: up to
    /// 2^24). An update that says more is refused (403) before its body is read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 2, maximum = 16777216)]
    pub max_contributors: Option<u64>,
}

/// The schema of an optional list of ids (see [`valid_id`]).
fn id_list_schema() -> utoipa::openapi::schema::Array {
    use utoipa::openapi::schema::{ArrayBuilder, ObjectBuilder, Type};
    ArrayBuilder::new()
        .description(Some(
            "The tasks the client enrolled with this token may use (absent: every task). For any \
             other task it is answered 404, as if the task did not exist.",
        ))
        .schema_type(utoipa::openapi::schema::SchemaType::from_iter([
            Type::Array,
            Type::Null,
        ]))
        .items(
            ObjectBuilder::new()
                .schema_type(Type::String)
                .pattern(Some(ID_PATTERN)),
        )
        .max_items(Some(1024))
        .build()
}

/// An enrolled client, for the admin.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct ClientInfo {
    pub client_id: String,
    pub label: Option<String>,
    pub enrolled_unix_ms: u64,
    pub revoked: bool,
    /// Its updates refused in a row (invalid or out of bounds) since its last accepted one.
    #[serde(default)]
    pub strikes: u32,
    /// Why the server quarantined it (refused everything until the operator releases it).
    #[serde(default)]
    pub quarantined: Option<String>,
    /// The tasks its enrolment allows (absent: every task).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tasks: Option<Vec<String>>,
    /// A regional aggregator (enrolled with `aggregator: true`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub aggregator: bool,
    /// The most clients one of its updates may stand for, if its enrolment capped it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_contributors: Option<u64>,
    /// When the server that answers last saw a request with its credentials (absent: not since
    /// that server started).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_seen_unix_ms: Option<u64>,
    /// Updates of it that server accepted since it started.
    #[serde(default)]
    pub contributions: u64,
}

/// `POST /dashboard/api/session`: sign in to the dashboard with the admin token, or with a
/// sign-in link's code.
#[derive(Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SignIn {
    #[serde(default)]
    pub token: Option<String>,
    #[serde(default)]
    pub link: Option<String>,
}

impl fmt::Debug for SignIn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SignIn")
            .field("token", &redacted(&self.token))
            .field("link", &redacted(&self.link))
            .finish()
    }
}

/// A signed-in dashboard session (its cookie is HttpOnly: the page never sees it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DashboardSession {
    /// Sent in `X-CSRF-Token` with every state-changing request of the session.
    pub csrf: String,
    pub expires_unix_ms: u64,
}

/// `POST /admin/v1/dashboard/sign-in-links` → a one-time sign-in link.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct SignInLink {
    /// Path and fragment (`/dashboard/#sign-in=…`), to append to the server's URL
    /// (`https://host:port`).
    pub path: String,
    pub expires_unix_ms: u64,
}

/// One finished (or abandoned) round, for the admin's history.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct RoundRecord {
    pub round: u64,
    pub attempt: u32,
    pub outcome: RoundOutcome,
    pub participants: Vec<String>,
    pub dropped: Vec<String>,
    pub examples: u64,
    /// Example-weighted mean of the clients' reported metrics.
    pub metrics: Metrics,
    pub duration_ms: u64,
    /// The global model the round published (absent if it was abandoned). For a regional task
    /// (one with a `parent`), the partial the round kept for its parent: the example-weighted
    /// mean delta of its updates (what `…/rounds/{round}/model` then serves).
    pub model: Option<ModelDigest>,
    /// How many clients' updates the round holds, those behind each regional aggregator among
    /// its participants counted (absent in entries written before servers counted them: then
    /// one a participant).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub contributors: Option<u64>,
    /// For a regional task: the parent's round this round's partial was forwarded to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forwarded_to: Option<u64>,
    /// The model's file was removed by the server's retention policy (the digest stays).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub pruned: bool,
    /// Under differential privacy: the privacy spent once this round was published.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub privacy: Option<PrivacySpent>,
    /// For an asynchronous task: how stale the version's updates were.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub staleness: Option<VersionStaleness>,
    /// Set once the entry is older than the server's `--history-detail-rounds`: its per-client
    /// lists (`participants`, `dropped`, staleness `bases`) are gone and these are their
    /// lengths; everything else is kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compacted: Option<Compacted>,
    /// The federated evaluation of the round's model, once it ended (see
    /// [`CreateTask::evaluation`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub evaluation: Option<EvaluationSummary>,
}

/// What an entry compacted out of its per-client lists keeps of them: how long they were.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Compacted {
    pub participants: u64,
    pub dropped: u64,
}

impl RoundRecord {
    /// Drops the per-client lists (which make an entry grow with its participants) and keeps
    /// their lengths; false if the entry was compacted already.
    pub fn compact(&mut self) -> bool {
        if self.compacted.is_some() {
            return false;
        }
        self.compacted = Some(Compacted {
            participants: self.participants.len() as u64,
            dropped: self.dropped.len() as u64,
        });
        self.participants = Vec::new();
        self.dropped = Vec::new();
        if let Some(s) = &mut self.staleness {
            s.bases = Vec::new();
        }
        true
    }
}

/// How stale the updates of an asynchronous task's version were: an update's staleness is the
/// number of versions published between the one it was trained from and this one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct VersionStaleness {
    /// The version each update was trained from, in the order of `participants`.
    pub bases: Vec<u64>,
    /// `histogram[s]`: how many updates were `s` versions stale.
    pub histogram: Vec<u32>,
    pub mean: f64,
    pub max: u64,
}

impl VersionStaleness {
    /// The statistics of the updates trained from `bases` that make version `version`.
    pub fn of(version: u64, bases: Vec<u64>) -> Self {
        let stale: Vec<u64> = bases.iter().map(|b| version.saturating_sub(*b)).collect();
        let max = stale.iter().copied().max().unwrap_or(0);
        let mut histogram = vec![
            0u32;
            if bases.is_empty() {
                0
            } else {
                max as usize + 1
            }
        ];
        for s in &stale {
            histogram[*s as usize] += 1;
        }
        let mean = match stale.len() {
            0 => 0.0,
            n => stale.iter().sum::<u64>() as f64 / n as f64,
        };
        VersionStaleness {
            bases,
            histogram,
            mean,
            max,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum RoundOutcome {
    Published,
    /// Closed without enough updates; the round is retried.
    Abandoned {
        reason: String,
    },
}

/// `POST /admin/v1/enrolments` → a one-time token a client exchanges for credentials.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct EnrolmentToken {
    pub token: String,
    pub expires_unix_ms: u64,
}

// ---------------------------------------------------------------------------------------------
// Clients (client API)

/// `POST /v1/enrol`, with the one-time enrolment token as its bearer credentials
/// (`Authorization: Bearer <token>`), checked before the body is read.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct EnrolRequest {
    /// The secret the client chose for itself (64 hex digits, from a cryptographic RNG; the
    /// server keeps only its hash). With it, enrolment is idempotent: a repeat with the same
    /// token and secret (the first answer was lost) gets the same credentials. Without it the
    /// server draws one, and a lost answer loses the enrolment.
    #[serde(default)]
    #[schema(pattern = "^[0-9a-f]{64}$")]
    pub secret: Option<String>,
    /// A label for operators (host name, site); not an identity. At most 256 bytes of UTF-8.
    #[serde(default)]
    #[schema(max_length = 256)]
    pub label: Option<String>,
    /// The client's Ed25519 identity key (hex), which signs its secure-aggregation keys.
    #[serde(default)]
    #[schema(pattern = "^[0-9a-fA-F]{64}$")]
    pub identity_key: Option<String>,
}

/// The client's credentials: shown once; the server keeps only a hash of the secret.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Credentials {
    pub client_id: String,
    pub secret: String,
}

impl fmt::Debug for EnrolmentToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EnrolmentToken")
            .field("token", &Redacted)
            .field("expires_unix_ms", &self.expires_unix_ms)
            .finish()
    }
}

impl fmt::Debug for EnrolRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EnrolRequest")
            .field("secret", &redacted(&self.secret))
            .field("label", &self.label)
            .field("identity_key", &self.identity_key)
            .finish()
    }
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credentials")
            .field("client_id", &self.client_id)
            .field("secret", &Redacted)
            .finish()
    }
}

/// `GET /v1/tasks/{task}/poll?after=N&attempt=A&wait_ms=W`: the task's state, answered as soon
/// as a round later than `after` is open — or, with `attempt`, a later attempt of round `after`
/// (the retry of an abandoned attempt, which wants this client's update again) — or the task
/// stops; else after `wait_ms`, capped at [`PollResponse::max_wait_ms`] (a long poll).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct PollResponse {
    pub task: String,
    pub state: TaskState,
    /// The round open now, if any.
    pub open_round: Option<u64>,
    /// The attempt of that round (0 first; an abandoned attempt is retried as the next one).
    /// Absent from servers older than attempts in polls.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt: Option<u32>,
    /// Whether this client is selected for that attempt already.
    pub selected: bool,
    /// Whether this client's update is in that attempt already. False in a retried attempt
    /// whose earlier attempt took the client's update: the retry wants it again.
    pub contributed: bool,
    /// When to come back if there is nothing to do (pace steering, jittered).
    pub retry_after_ms: u64,
    /// The longest this server holds a poll (below its idle and request timeouts, so a poll is
    /// answered before any timeout of the server's can end it). A longer `wait_ms` is cut to it.
    #[serde(default)]
    pub max_wait_ms: u64,
    /// A published model this client is asked to evaluate (`POST
    /// /v1/tasks/{task}/evaluations/{round}`), in a task with `evaluation`. A poll with
    /// `evaluated=R` is not answered early for an evaluation of round R or before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub evaluation: Option<EvaluationOffer>,
}

impl PollResponse {
    /// Whether the open attempt wants this client's update, given the last attempt the client
    /// dealt with (`done`: round and attempt): a later round, or a later attempt of the same
    /// round, that the client has not contributed to.
    pub fn wants_update(&self, done: Option<(u64, u32)>) -> bool {
        let Some(open) = self.open_round else {
            return false;
        };
        if self.state != TaskState::Running || self.contributed {
            return false;
        }
        match done {
            None => true,
            Some((round, attempt)) => {
                open > round || (open == round && self.attempt.is_some_and(|a| a > attempt))
            }
        }
    }
}

/// `POST /v1/tasks/{task}/join`: an offer, or when to come back.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct JoinResponse {
    pub offer: Option<RoundOffer>,
    pub retry_after_ms: u64,
}

/// A round this client is selected for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct RoundOffer {
    pub round: u64,
    /// The attempt of the round (0 first; an abandoned attempt is retried as the next one).
    #[serde(default)]
    pub attempt: u32,
    /// Digest of the global model to train from (also its ETag).
    pub model: ModelDigest,
    /// What the weights are: a built-in architecture or the task's TorchScript module.
    pub model_kind: ModelKind,
    /// The round key deltas are sealed to.
    pub round_key: RoundPublicKey,
    pub deadline_unix_ms: u64,
    pub training: TrainingConfig,
    /// Present when the round runs secure aggregation: the deltas go through its stages
    /// (`/v1/tasks/{task}/secagg/{round}/{attempt}/…`) instead of the sealed upload.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secure_aggregation: Option<SecAggOffer>,
    /// How the update must be encoded (update format [`crate::codec::UPDATE_FORMAT`], which a client must speak); absent: plain float32.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compression: Option<Compression>,
    /// Present when the server takes updates in chunks (an upload session:
    /// `POST /v1/tasks/{task}/rounds/{round}/uploads`): an update whose plaintext is larger than
    /// this many bytes goes that way, in chunks of this size, and resumes after a cut
    /// connection; absent: one sealed body only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upload_chunk_bytes: Option<u64>,
    /// Present when the task trains part of its model: the frozen base's digest. The client
    /// trains from the base's tensors and `model`'s together (it downloads the base with
    /// `GET /v1/tasks/{task}/model?digest=…` and keeps it: it never changes), and its update
    /// carries `model`'s tensors only: one with a tensor of the base is refused (400
    /// `invalid_update` naming it, or 413 when the base's tensors make it too large).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frozen_base: Option<ModelDigest>,
}

impl RoundOffer {
    /// What an update (or a chunk of one) of `client` to `task`, trained for this offer, is
    /// sealed to: its task, round, client and base model.
    pub fn binding<'a>(&'a self, task: &'a str, client: &'a str) -> crate::envelope::Binding<'a> {
        crate::envelope::Binding {
            task,
            round: self.round,
            client,
            base_model: &self.model,
        }
    }
}

/// How a client takes part in a secure-aggregation round attempt.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct SecAggOffer {
    /// The attempt of the round (a round abandoned below threshold is retried as attempt + 1).
    pub attempt: u32,
    /// Coordinates are clipped to `[-clip, clip]`.
    pub clip: f64,
    /// Quantisation: a weighted coordinate `w·x` travels as `round(w·x·scale)` in Z_2^32.
    pub scale: f64,
    pub max_weight: u32,
    /// Present when the task has federated evaluation: masked inputs carry the evaluation
    /// slots (`secagg::quantise::EVALUATION_SLOTS`) before the weight.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub evaluation: Option<SecAggEvaluation>,
}

/// How a secure round carries federated evaluation: inside the masked inputs, so the server
/// learns only the sum of its clients' evaluations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct SecAggEvaluation {
    /// The round that published the model this round trains from, when that model is
    /// evaluated: the client evaluates it on its held-out data and fills the slots. Absent:
    /// the slots are zero.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub round: Option<u64>,
}

/// Stage 0 (`POST …/advertise`): the client's two X25519 public keys for this attempt, signed
/// with its Ed25519 identity key (all hex).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SecAggAdvertise {
    /// Key agreed with neighbours for the pairwise masks.
    #[schema(pattern = "^[0-9a-fA-F]{64}$")]
    pub mask_key: String,
    /// Key agreed with neighbours to encrypt the Shamir shares.
    #[schema(pattern = "^[0-9a-fA-F]{64}$")]
    pub share_key: String,
    /// Ed25519 signature (64 bytes) by the identity key.
    #[schema(pattern = "^[0-9a-fA-F]{128}$")]
    pub signature: String,
}

/// A neighbour's advertised keys, as the server forwards them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct SecAggNeighbour {
    pub client: String,
    /// The neighbour's Shamir point (its 1-based index in the attempt).
    pub index: u32,
    /// The neighbour's Ed25519 identity key registered at enrolment (hex).
    pub identity_key: String,
    pub keys: SecAggAdvertise,
}

/// Stage 1 (`GET …/neighbours`): who this client shares with, once advertising has closed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct SecAggRoster {
    /// This client's own Shamir point.
    pub index: u32,
    /// Shares needed to recover a secret.
    pub threshold: u32,
    /// When masked inputs are due: the end of local training.
    pub input_deadline_unix_ms: u64,
    pub neighbours: Vec<SecAggNeighbour>,
}

/// One encrypted bundle of shares (of the sender's self-mask seed and mask key).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SecAggSealedShares {
    /// The addressee (when sent) or the sender (when delivered).
    pub peer: String,
    /// AES-256-GCM under a key only sender and addressee can derive (hex).
    pub ciphertext: String,
}

/// Stage 1 (`POST …/shares`, one bundle per neighbour) and stage 2 (`GET …/shares`, the
/// bundles addressed to this client).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SecAggShareBundles {
    pub shares: Vec<SecAggSealedShares>,
}

/// Stage 3 (`GET …/unmask`): which of this client's neighbours survived (uploaded a masked
/// input) and which dropped after sharing. The two lists never overlap.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct SecAggUnmaskRequest {
    pub survivors: Vec<String>,
    pub dropped: Vec<String>,
}

/// Which secret a share in the unmask stage is of.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, ToSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum SecAggShareKind {
    /// Of a survivor's self-mask seed.
    SelfMask,
    /// Of a dropped client's mask key.
    MaskKey,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SecAggRevealedShare {
    pub peer: String,
    pub kind: SecAggShareKind,
    /// The share's value (hex; its point is the sender's index).
    pub share: String,
}

/// Stage 3 (`POST …/unmask`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SecAggUnmask {
    pub shares: Vec<SecAggRevealedShare>,
}

/// The answer to every accepted secure-aggregation message: it is durable.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct SecAggReceipt {
    pub round: u64,
    pub attempt: u32,
    /// Clients whose message of this stage the server holds, this one included.
    pub accepted: u32,
}

/// Training metrics a client reports with its update.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, Default, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Metrics {
    pub loss: Option<f64>,
    pub accuracy: Option<f64>,
}

/// Sent alongside a sealed delta (`POST /v1/tasks/{task}/rounds/{round}/update`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct UpdateMeta {
    pub num_examples: u64,
    #[serde(default)]
    pub metrics: Metrics,
    /// How many clients' updates this one holds: a regional aggregator's partial of its own
    /// round (the example-weighted mean of its clients' deltas, `num_examples` their examples)
    /// counts as that many towards the round's `min_clients` and `target_clients`, and its weight
    /// is bounded by `max_weight` times this. Only a client enrolled as an aggregator
    /// ([`CreateEnrolment::aggregator`]) may send more than 1. Absent: 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1)]
    pub contributors: Option<u64>,
}

impl UpdateMeta {
    /// How many clients the update stands for (1 unless an aggregator says more).
    pub fn contributors(&self) -> u64 {
        self.contributors.unwrap_or(1)
    }
}

/// Starts (or resumes) a chunked upload (`POST /v1/tasks/{task}/rounds/{round}/uploads`): the
/// update's plaintext is `length` bytes with this SHA-256. A session for the same plaintext
/// resumes where it stopped; another one of the same client and task takes its place.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct UploadStart {
    /// SHA-256 of the whole plaintext (64 hex digits): the upload's id, bound into every chunk.
    #[schema(pattern = "^[0-9a-f]{64}$")]
    pub digest: String,
    pub length: u64,
}

/// Where a chunked upload stands. Chunk `next_chunk` is the one to send
/// (`PUT …/uploads/{digest}/chunks/{index}`, sealed with [`crate::envelope::seal_chunk`]); once
/// `received` equals the length, `POST …/uploads/{digest}/complete` folds the update.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct UploadSession {
    pub digest: String,
    pub length: u64,
    /// Bytes of plaintext per chunk (the last chunk holds the rest).
    pub chunk_bytes: u64,
    /// Plaintext bytes the server holds (on its disk, not yet folded; a restarted server holds
    /// none).
    pub received: u64,
    pub next_chunk: u64,
    pub chunks: u64,
}

/// The smallest chunk a server cuts uploads into (the floor of its `--upload-chunk-bytes`): a
/// session answered with smaller ones is not a Hora server's.
pub const MIN_UPLOAD_CHUNK_BYTES: u64 = 64 << 10;

/// The server's acknowledgement: the update is durable and counted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct UpdateReceipt {
    pub round: u64,
    /// Updates the round has accepted so far, this one included.
    pub accepted: u32,
}

mod defaults {
    pub fn epochs() -> u32 {
        1
    }
    pub fn batch_size() -> u32 {
        32
    }
    pub fn learning_rate() -> f64 {
        0.01
    }
    pub fn clip() -> f64 {
        1.0
    }
    pub fn adaptive_norm_factor() -> Option<f64> {
        Some(10.0)
    }
    pub fn adaptive_weight_factor() -> Option<f64> {
        Some(10.0)
    }

    pub fn update_max_weight() -> u64 {
        1_000_000
    }
    pub fn max_weight() -> u32 {
        10_000
    }
    pub fn stage_secs() -> u64 {
        30
    }
    // Strategy defaults; `hora-server`'s `strategy` module says where each comes from.
    pub fn fed_avg_m_eta() -> f64 {
        1.0
    }
    pub fn momentum() -> f64 {
        0.9
    }
    pub fn fed_adam_eta() -> f64 {
        0.1
    }
    pub fn fed_yogi_eta() -> f64 {
        0.1
    }
    pub fn fed_adagrad_eta() -> f64 {
        0.1
    }
    pub fn beta_1() -> f64 {
        0.9
    }
    pub fn beta_2() -> f64 {
        0.99
    }
    pub fn tau() -> f64 {
        1e-3
    }
    pub fn dp_delta() -> f64 {
        1e-5
    }
    pub fn dp_target_quantile() -> f64 {
        0.5
    }
    pub fn dp_clip_learning_rate() -> f64 {
        0.2
    }
}

// ---------------------------------------------------------------------------------------------
// Synchronous allreduce jobs (rendezvous)

/// Create a synchronous allreduce job (admin API): a world of workers that meet at
/// `/v1/sync/{id}/join` and then talk to each other directly.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateSyncJob {
    #[schema(pattern = "^[A-Za-z0-9_.-]{1,64}$")]
    pub id: String,
    /// Number of workers (ranks 0..world_size); the most an elastic job's world may have.
    #[schema(minimum = 1, maximum = 4096)]
    pub world_size: u32,
    /// Makes the job elastic: a world forms with whoever joined once at least this many have
    /// and nobody joined for `settle_ms` (or `world_size` have), so the survivors of a lost
    /// worker, and workers that join later, form the next world; the server assigns ranks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1, maximum = 4096)]
    pub min_world_size: Option<u32>,
    /// An elastic job's quiet time before a world of fewer than `world_size` forms (default
    /// 1000 ms).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 10, maximum = 60000)]
    pub settle_ms: Option<u32>,
}

/// A sync job as the admin API shows it. `token` is present only in the answer that created the
/// job (it is shown once; only its hash is stored).
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct SyncJobInfo {
    pub id: String,
    pub world_size: u32,
    /// An elastic job's smallest world (absent: every world has `world_size` workers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_world_size: Option<u32>,
    /// An elastic job's quiet time before a world of fewer than `world_size` forms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub settle_ms: Option<u32>,
    /// The bearer token every worker of the job presents at `/v1/sync/{id}/join`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
    /// Generations formed so far (a restarted job forms a new one).
    pub generations: u64,
    /// Workers waiting in the world being formed now.
    pub waiting: u32,
    /// Who waits in the world being formed, by rank.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub members: Vec<SyncMember>,
    /// The last world formed since the answering server started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub formed: Option<SyncWorldInfo>,
    /// Its training finished: it forms no more worlds, and joins are answered 410
    /// `job_finished`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub finished: bool,
}

/// A worker of a sync job's world: its rank and the address its ring neighbour connects to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct SyncMember {
    pub rank: u32,
    pub address: String,
}

/// A world a sync job formed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct SyncWorldInfo {
    pub generation: u64,
    pub formed_unix_ms: u64,
    /// Every rank, in order.
    pub members: Vec<SyncMember>,
}

impl fmt::Debug for SyncJobInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SyncJobInfo")
            .field("id", &self.id)
            .field("world_size", &self.world_size)
            .field("min_world_size", &self.min_world_size)
            .field("settle_ms", &self.settle_ms)
            .field("token", &redacted(&self.token))
            .field("generations", &self.generations)
            .field("waiting", &self.waiting)
            .field("members", &self.members)
            .field("formed", &self.formed)
            .field("finished", &self.finished)
            .finish()
    }
}

/// A worker joins its job's rendezvous (bearer: the job token). The request is held until the
/// world is complete (or `timeout_s` passes: 408 naming the ranks that did not join).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SyncJoinRequest {
    /// `host:port` where this worker accepts its ring neighbour's connection.
    #[schema(max_length = 255)]
    pub address: String,
    /// The rank given by the launcher (mpirun, Slurm, `--rank`); `None`: the server assigns one.
    #[serde(default)]
    pub rank: Option<u32>,
    /// Must equal the job's world size (a misconfigured launcher is refused, not hung).
    pub world_size: u32,
    /// How long to wait for the others, in seconds (the server caps it).
    #[serde(default)]
    pub timeout_s: Option<u32>,
    /// An elastic job's worker that was in a world says which, and how far its committed state
    /// is: the server gives rank 0 of the next world to a worker with the newest state (which
    /// then broadcasts it), and names the ranks that never came back.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rejoin: Option<SyncRejoin>,
    /// The worker runs an elastic job's loop (commits, rejoins); a worker that does not is
    /// refused by an elastic job, and one that does by a fixed job, before either can break
    /// the other's world.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub elastic: bool,
}

/// Where an elastic job's worker comes from when it joins again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SyncRejoin {
    /// The generation of the world this worker was in.
    pub generation: u64,
    /// Its rank there.
    pub rank: u32,
    /// The training step of its last committed state.
    pub committed: u64,
}

/// An elastic job's state as a running world asks for it at a commit
/// (`GET /v1/sync/{job}/status`, bearer: the job token).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct SyncStatus {
    /// Worlds formed so far.
    pub generation: u64,
    /// Workers waiting to join: the running world re-forms at its next commit to take them in.
    pub waiting: u32,
    /// The job's training finished (`POST /v1/sync/{job}/finish`): it forms no more worlds.
    #[serde(default)]
    pub finished: bool,
}

/// The complete world, the same for every worker of one generation.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct SyncWorld {
    /// Counts the worlds this job has formed; a restart forms a new one.
    pub generation: u64,
    /// Random hex secret shared by the members of this generation. It never crosses the ring:
    /// workers prove knowledge of it to each other (a challenge-response under a key derived
    /// from it), so strangers and stray workers of another generation are refused.
    pub session: String,
    pub rank: u32,
    pub world_size: u32,
    /// Ring addresses by rank.
    pub peers: Vec<String>,
}

impl fmt::Debug for SyncWorld {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SyncWorld")
            .field("generation", &self.generation)
            .field("session", &Redacted)
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("peers", &self.peers)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_never_shows_a_token_or_a_secret() {
        let shown = [
            format!(
                "{:?}",
                EnrolmentToken {
                    token: "enrol-SECRET".into(),
                    expires_unix_ms: 7,
                }
            ),
            format!(
                "{:?}",
                EnrolRequest {
                    secret: Some("client-SECRET".into()),
                    label: Some("site-a".into()),
                    identity_key: None,
                }
            ),
            format!(
                "{:?}",
                Credentials {
                    client_id: "c-1".into(),
                    secret: "client-SECRET".into(),
                }
            ),
            format!(
                "{:?}",
                SyncJobInfo {
                    id: "job".into(),
                    world_size: 2,
                    min_world_size: None,
                    settle_ms: None,
                    token: Some("job-SECRET".into()),
                    generations: 0,
                    waiting: 0,
                    members: Vec::new(),
                    formed: None,
                    finished: false,
                }
            ),
        ];
        for line in &shown {
            assert!(!line.contains("SECRET"), "{line}");
            assert!(line.contains("<redacted>"), "{line}");
        }
        // What is not secret is still there to debug with.
        assert!(shown[0].contains("expires_unix_ms: 7"), "{}", shown[0]);
        assert!(shown[1].contains("site-a"), "{}", shown[1]);
        assert!(shown[2].contains("c-1"), "{}", shown[2]);
        let unset = format!(
            "{:?}",
            SyncJobInfo {
                id: "job".into(),
                world_size: 2,
                min_world_size: None,
                settle_ms: None,
                token: None,
                generations: 0,
                waiting: 0,
                members: Vec::new(),
                formed: None,
                finished: false,
            }
        );
        assert!(unset.contains("token: None"), "{unset}");
        let world = format!(
            "{:?}",
            SyncWorld {
                generation: 1,
                session: "session-SECRET".into(),
                rank: 0,
                world_size: 2,
                peers: vec!["h:1".into(), "h:2".into()],
            }
        );
        assert!(
            !world.contains("SECRET") && world.contains("<redacted>"),
            "{world}"
        );
    }

    #[test]
    fn create_task_applies_defaults_and_rejects_typos() {
        let json = r#"{"id":"mnist","initial_model":"0000000000000000000000000000000000000000000000000000000000000000",
            "model":{"kind":"builtin","name":"mlp"},"rounds":20,
            "min_clients":2,"target_clients":10,"round_deadline_secs":60}"#;
        let task: CreateTask = serde_json::from_str(json).unwrap();
        assert_eq!(task.strategy, StrategyConfig::FedAvg);
        assert_eq!(task.training, TrainingConfig::default());
        assert_eq!(
            task.training.optimizer,
            OptimizerConfig::Sgd { momentum: 0.0 }
        );
        let back: CreateTask =
            serde_json::from_str(&serde_json::to_string(&task).unwrap()).unwrap();
        assert_eq!(back, task);

        let typo = json.replace("\"rounds\"", "\"roundz\"");
        let err = serde_json::from_str::<CreateTask>(&typo)
            .unwrap_err()
            .to_string();
        assert!(err.contains("roundz"), "{err}");
        let bad_opt = json.replace(
            "\"round_deadline_secs\":60",
            r#""round_deadline_secs":60,"training":{"optimizer":{"name":"lbfgs"}}"#,
        );
        assert!(serde_json::from_str::<CreateTask>(&bad_opt).is_err());
    }

    #[test]
    fn strategies_take_defaults_and_fed_avg_stays_as_it_was() {
        // FedAvg's JSON is what clients and tests have always sent.
        let avg: StrategyConfig = serde_json::from_str(r#"{"name":"fed_avg"}"#).unwrap();
        assert_eq!(avg, StrategyConfig::FedAvg);
        assert_eq!(
            serde_json::to_string(&avg).unwrap(),
            r#"{"name":"fed_avg"}"#
        );

        for (json, defaults) in [
            (r#"{"name":"fed_avg_m"}"#, StrategyConfig::fed_avg_m()),
            (r#"{"name":"fed_adam"}"#, StrategyConfig::fed_adam()),
            (r#"{"name":"fed_yogi"}"#, StrategyConfig::fed_yogi()),
            (r#"{"name":"fed_adagrad"}"#, StrategyConfig::fed_adagrad()),
        ] {
            let parsed: StrategyConfig = serde_json::from_str(json).unwrap();
            assert_eq!(parsed, defaults, "{json}");
            let back = serde_json::to_string(&parsed).unwrap();
            assert_eq!(
                serde_json::from_str::<StrategyConfig>(&back).unwrap(),
                parsed
            );
        }
        assert_eq!(
            StrategyConfig::fed_adam(),
            StrategyConfig::FedAdam {
                eta: 0.1,
                beta_1: 0.9,
                beta_2: 0.99,
                tau: 1e-3
            }
        );
        assert_eq!(
            StrategyConfig::fed_avg_m(),
            StrategyConfig::FedAvgM {
                eta: 1.0,
                momentum: 0.9
            }
        );

        // One parameter given, the others default.
        let yogi: StrategyConfig =
            serde_json::from_str(r#"{"name":"fed_yogi","tau":0.01}"#).unwrap();
        assert_eq!(
            yogi,
            StrategyConfig::FedYogi {
                eta: 0.1,
                beta_1: 0.9,
                beta_2: 0.99,
                tau: 0.01
            }
        );
        // A misspelt parameter, a parameter of another strategy, an unknown strategy: refused.
        // (Not `{"name":"fed_avg","eta":1}`: serde ignores fields beside the tag of a unit
        // variant, and FedAvg stays a unit variant so its Rust and JSON forms stay as they were.)
        for bad in [
            r#"{"name":"fed_adam","etta":0.1}"#,
            r#"{"name":"fed_adagrad","beta_2":0.9}"#,
            r#"{"name":"fed_avg_m","beta_1":0.9}"#,
            r#"{"name":"fed_lion"}"#,
        ] {
            assert!(
                serde_json::from_str::<StrategyConfig>(bad).is_err(),
                "{bad}"
            );
        }
    }

    #[test]
    fn differential_privacy_is_optional_with_defaults() {
        let json = r#"{"id":"t","initial_model":"0000000000000000000000000000000000000000000000000000000000000000",
            "model":{"kind":"builtin","name":"mlp"},"rounds":20,
            "min_clients":2,"target_clients":10,"round_deadline_secs":60}"#;
        let plain: CreateTask = serde_json::from_str(json).unwrap();
        assert_eq!(plain.differential_privacy, None);
        // The JSON of a task without DP is what it was before the option existed.
        let out = serde_json::to_string(&plain).unwrap();
        assert!(!out.contains("differential_privacy"), "{out}");

        let with_dp = json.replace(
            "\"rounds\":20",
            r#""rounds":20,"differential_privacy":{"noise_multiplier":1.1,"clip":{"mode":"adaptive","initial_norm":0.1}}"#,
        );
        let task: CreateTask = serde_json::from_str(&with_dp).unwrap();
        assert_eq!(
            task.differential_privacy,
            Some(DpConfig {
                noise_multiplier: 1.1,
                clip: DpClip::Adaptive {
                    initial_norm: 0.1,
                    target_quantile: 0.5,
                    learning_rate: 0.2,
                    count_noise: None,
                },
                delta: 1e-5,
                epsilon_budget: None,
            })
        );
        let back: CreateTask =
            serde_json::from_str(&serde_json::to_string(&task).unwrap()).unwrap();
        assert_eq!(back, task);
        let typo = with_dp.replace("initial_norm", "initial_nrom");
        assert!(serde_json::from_str::<CreateTask>(&typo).is_err());
        let fixed = json.replace(
            "\"rounds\":20",
            r#""rounds":20,"differential_privacy":{"noise_multiplier":1,"clip":{"mode":"fixed","norm":1},"delta":1e-6,"epsilon_budget":3}"#,
        );
        let task: CreateTask = serde_json::from_str(&fixed).unwrap();
        let dp = task.differential_privacy.unwrap();
        assert_eq!(
            (dp.clip, dp.delta, dp.epsilon_budget),
            (DpClip::Fixed { norm: 1.0 }, 1e-6, Some(3.0))
        );
    }

    #[test]
    fn join_response_round_trips() {
        let key = crate::envelope::RoundSecretKey::generate()
            .unwrap()
            .public_key();
        let poll = JoinResponse {
            offer: Some(RoundOffer {
                round: 4,
                attempt: 1,
                model: ModelDigest([9; 32]),
                model_kind: ModelKind::Builtin {
                    name: "mlp".into(),
                    params: Default::default(),
                },
                round_key: key,
                deadline_unix_ms: 1_700_000_000_000,
                training: TrainingConfig {
                    optimizer: OptimizerConfig::Adam,
                    ..Default::default()
                },
                secure_aggregation: None,
                compression: Some(Compression {
                    values: ValueCodec::Int8,
                    block_size: 256,
                    top_k: Some(0.01),
                }),
                upload_chunk_bytes: Some(8 << 20),
                frozen_base: Some(ModelDigest([3; 32])),
            }),
            retry_after_ms: 250,
        };
        let json = serde_json::to_string(&poll).unwrap();
        assert!(json.contains(r#""name":"adam""#), "{json}");
        assert!(json.contains(r#""values":"int8""#), "{json}");
        assert_eq!(serde_json::from_str::<JoinResponse>(&json).unwrap(), poll);
    }

    #[test]
    fn ids_are_restricted() {
        assert!(valid_id("mnist-v2.1_a"));
        for bad in ["", "a/b", "..\\x", "a b", &"x".repeat(65), "é"] {
            assert!(!valid_id(bad), "{bad:?}");
        }
    }

    #[test]
    fn round_outcome_is_tagged() {
        let r = RoundOutcome::Abandoned {
            reason: "2 of 3 required updates".into(),
        };
        assert_eq!(
            serde_json::to_string(&r).unwrap(),
            r#"{"status":"abandoned","reason":"2 of 3 required updates"}"#
        );
    }
}
