//! The upload path every round mode that takes sealed updates shares.
//!
//! An upload, top to bottom: [`Coordinator::check_upload`] (before the body is read: the task,
//! its open round, then the mode's own checks — the client's selection or training slot, a retry
//! of an update already in), then on a blocking thread [`open_update`] (envelope → safetensors
//! under the spec's limits → names, shapes, dtypes → finite values), the task's update bounds and
//! central-DP clipping, after which the ingest slot is released; then, among at most
//! [`super::LOCK_WAITERS`] of the task's requests on blocking threads, the mode folds the update
//! ([`super::Collection::fold`]) under the round's lock, and the upload waits for the group
//! commit that makes it durable ([`super::commit`]).

use std::sync::Arc;
use std::time::Instant;

use hora_common::codec::{Compression, Update};
use hora_common::envelope::{self, Binding, RoundSecretKey};
use hora_common::model::{frozen_tensor_in, ModelDigest, ModelSpec};
use hora_common::wire::{self, ErrorCode, TaskState, UpdateMeta};

use super::collection::Opened;
use super::{lock, Coordinator, Round, Task};
use crate::error::ServerError;
use crate::store::Contribution;

/// The most clients one update may stand for.
pub const MAX_CONTRIBUTORS: u64 = 1 << 24;

/// Whether task `task` (configured as `config`) takes an update that stands for `contributors`
/// clients: one always; several (a regional aggregator's partial) only in a plain round without
/// central DP, which clips and weighs each client's update itself.
fn check_contributors(
    task: &str,
    config: &wire::CreateTask,
    contributors: u64,
) -> Result<(), ServerError> {
    if contributors == 0 || contributors > MAX_CONTRIBUTORS {
        return Err(ServerError::BadRequest(format!(
            "contributors is {contributors}; an update stands for 1 to {MAX_CONTRIBUTORS} clients"
        )));
    }
    if contributors == 1 {
        return Ok(());
    }
    let mode = match () {
        _ if config.secure_aggregation.is_some() => Some("secure aggregation"),
        _ if config.asynchronous.is_some() => Some("asynchronous aggregation"),
        _ if config.differential_privacy.is_some() => Some("central differential privacy"),
        _ => None,
    };
    match mode {
        None => Ok(()),
        Some(mode) => Err(ServerError::BadRequest(format!(
            "task `{task}` uses {mode}, which takes each client's update itself: a regional aggregator's partial ({contributors} clients) cannot take part; connect those clients to this server"
        ))),
    }
}

/// Whether an upload is worth reading.
pub enum Admission {
    /// No such update from this client in the round yet; it is sealed as `.1` says.
    Fresh(Arc<Round>, Sealing),
    /// Its update is the round's contribution `.1`, folded but not yet durable.
    Pending(Arc<Round>, usize),
}

/// An update as the upload path takes it.
pub enum UpdateBody {
    /// One sealed envelope, opened in place.
    Sealed(Vec<u8>),
    /// A plaintext whose chunks were opened, each under the key [`Coordinator::check_upload`]
    /// admitted it with, as they arrived (a chunked upload's spool).
    Opened(Box<dyn AsRef<[u8]> + Send + Sync>),
}

impl UpdateBody {
    fn bytes(&self) -> &[u8] {
        match self {
            UpdateBody::Sealed(body) => body,
            UpdateBody::Opened(plaintext) => (**plaintext).as_ref(),
        }
    }
}

/// Which version's key an update is sealed to.
pub enum Sealing {
    /// The round's own.
    Current,
    /// An earlier version's, in an asynchronous task.
    Earlier {
        round: u64,
        key: Arc<RoundSecretKey>,
        base: ModelDigest,
    },
}

impl Sealing {
    /// The key that opens the update, and the round number and base model its binding names.
    pub fn key<'r>(&'r self, round: &'r Round) -> (&'r RoundSecretKey, u64, ModelDigest) {
        match self {
            Sealing::Current => (&round.key, round.number, round.base),
            Sealing::Earlier { round, key, base } => (&**key, *round, *base),
        }
    }
}

/// What an upload holds from the HTTP layer while the round engine works on it: an ingest slot
/// (the CPU work of opening an update) and the body's share of the byte budget.
pub trait Ingest: Send + 'static {
    /// The update is open and checked: the slot's work is done. The fold that follows may wait
    /// for the round's lock (held while a checkpoint or a close writes), and must not keep the
    /// slot that uploads to other tasks need meanwhile; the body's memory stays held.
    fn opened(&mut self);
}

/// Nothing held (the round engine's own tests).
impl Ingest for () {
    fn opened(&mut self) {}
}

impl Coordinator {
    /// The upload path: checks the round, opens the envelope, validates, folds, and returns
    /// once the update is durable. `body` is the sealed envelope, decrypted in place, or the
    /// plaintext of a chunked upload.
    /// `permit`'s ingest slot is released once the update is open ([`Ingest::opened`]), and the
    /// rest of it (the body's share of the byte budget) as soon as the update is folded, before
    /// the wait for durability, so the next body can be read meanwhile.
    pub async fn upload(
        self: &Arc<Self>,
        task: Arc<Task>,
        client: String,
        round_number: u64,
        meta: UpdateMeta,
        mut body: UpdateBody,
        mut permit: impl Ingest,
    ) -> Result<wire::UpdateReceipt, ServerError> {
        let admission = self
            .check_upload_blocking(&task, &client, round_number)
            .await?;
        let (round, sealing) = match admission {
            Admission::Fresh(round, sealing) => (round, sealing),
            Admission::Pending(round, index) => {
                // (Its checkpoint may have failed: a retry is a reason to try again now.)
                task.commit_wanted.notify_one();
                return self.receipt(&round, index).await;
            }
        };
        if meta.num_examples == 0 {
            return Err(ServerError::InvalidUpdate(
                "num_examples must be at least 1".into(),
            ));
        }
        for (name, v) in [
            ("loss", meta.metrics.loss),
            ("accuracy", meta.metrics.accuracy),
        ] {
            if v.is_some_and(|v| !v.is_finite()) {
                return Err(ServerError::InvalidUpdate(format!(
                    "metric `{name}` must be a finite number"
                )));
            }
        }
        let record = task.record();
        let contributors = meta.contributors();
        check_contributors(&task.id, &record.config, contributors)?;
        let spec = record.spec;
        let frozen = record.part.map(|p| p.base_spec);
        let bounds = record.config.update_bounds;
        let dp = record.dp;
        // Example counts above the task's bound count as the bound, and so do those above the
        // adaptive bound (a multiple of the median weight of recent accepted updates). A
        // regional aggregator's partial is bounded as its clients were, each (it bounded them
        // itself): by the bound times their number, and by no one client's median.
        let mut weight = meta
            .num_examples
            .min(bounds.max_weight.max(1).saturating_mul(contributors));
        if let Some(cap) = bounds
            .adaptive_weight_factor
            .filter(|_| contributors == 1)
            .and_then(|f| lock(&task.recent).weights.bound(f))
        {
            weight = weight.min(cap.ceil() as u64).max(1);
        }
        // First, on a blocking thread: open and check the update, and work out how it folds;
        // then the ingest slot goes.
        let compression = record.config.compression;
        let reading = (spec.clone(), compression.clone());
        let (t, client_id) = (task.clone(), client.clone());
        let (body, plaintext, folding, permit) =
            tokio::task::spawn_blocking(move || -> Result<_, ServerError> {
                let task = t;
                let started = Instant::now();
                let (key, sealed, base) = sealing.key(&round);
                let binding = Binding {
                    task: &task.id,
                    round: sealed,
                    client: &client_id,
                    base_model: &base,
                };
                let reading = Reading {
                    spec: &spec,
                    compression: compression.as_ref(),
                    frozen: frozen.as_ref(),
                };
                let (plaintext, view) = match &mut body {
                    UpdateBody::Sealed(body) => open_update_at(body, key, &binding, &reading)?,
                    UpdateBody::Opened(plaintext) => {
                        let bytes = (**plaintext).as_ref();
                        (0..bytes.len(), reading.open(bytes)?)
                    }
                };
                // The task's bound: the configured one, else the adaptive one (a multiple of
                // the median norm of recent accepted updates, once there are enough of them).
                let adaptive = bounds.max_norm.is_none() && bounds.adaptive_norm_factor.is_some();
                let bound = bounds.max_norm.or_else(|| {
                    bounds
                        .adaptive_norm_factor
                        .and_then(|f| lock(&task.recent).norms.bound(f))
                });
                let norm = match bounds.max_norm.is_some() || adaptive || dp.is_some() {
                    true => view.l2_norm(),
                    false => 0.0,
                };
                let scale = match bound {
                    None => 1.0,
                    Some(bound) => {
                        match bounds.on_norm_exceeded {
                            _ if norm <= bound => 1.0,
                            wire::NormPolicy::Clip => bound / norm,
                            wire::NormPolicy::Refuse => {
                                return Err(ServerError::invalid(
                                    ErrorCode::UpdateNormExceeded,
                                    format!("the update's L2 norm {norm:.6e} exceeds the task's bound of {bound:.6e}: clip it or lower the learning rate"),
                                ))
                            }
                        }
                    }
                };
                // Under central DP every update is clipped to the round's norm and weighs 1.
                let (fold_weight, scale, unclipped) = match &dp {
                    Some(state) => {
                        let (factor, unclipped) = state.clip_update(norm);
                        (1.0, scale.min(factor), Some(unclipped))
                    }
                    None => (weight as f64, scale, None),
                };
                permit.opened();
                let folding = Folding {
                    round,
                    sealed,
                    fold_weight,
                    scale,
                    unclipped,
                    accepted_norm: adaptive.then_some(norm * scale),
                    started,
                };
                Ok((body, plaintext, folding, permit))
            })
            .await
            .map_err(ServerError::internal)??;
        // Then the fold, which takes the round's lock: at most LOCK_WAITERS of the task's
        // requests wait for it on blocking threads, the others here (their bodies held in the
        // byte budget), so a close that holds the lock long cannot take the blocking pool.
        let waiting = task.lock_waiter().await;
        let (me, t) = (self.clone(), task.clone());
        let folded = tokio::task::spawn_blocking(move || -> Result<_, ServerError> {
            let (task, _waiting) = (t, waiting);
            let view = reparse(&body.bytes()[plaintext], &reading.0, reading.1.as_ref())?;
            let round = folding.round;
            let contributor = client.clone();
            let opened = Opened {
                update: Contribution {
                    client,
                    examples: weight,
                    metrics: meta.metrics,
                    unclipped: folding.unclipped,
                    base: None,
                    contributors,
                },
                sealed: folding.sealed,
                weight: folding.fold_weight,
                scale: folding.scale,
                view: &view,
            };
            let folded = round.collection.fold(&me, &task, &round, opened)?;
            // (The permit also holds the body's share of the byte budget: kept until the
            // folded body can go.)
            drop(permit);
            if folded.now {
                // (A partial's weight and the norm of a mean are no one client's: they would
                // move the adaptive bounds' medians.)
                if contributors == 1 {
                    task.accepted(folding.accepted_norm, weight);
                }
                me.clients_seen.contributed(&contributor);
                me.metrics
                    .ingest_seconds
                    .observe(folding.started.elapsed().as_secs_f64());
                me.close_if_full(&task, &folded.round);
            }
            Ok(folded)
        })
        .await
        .map_err(ServerError::internal)??;
        task.commit_wanted.notify_one();
        self.receipt(&folded.round, folded.index).await
    }

    /// The checks an upload must pass before its body is worth reading: the task takes updates,
    /// a round is open, and the round's mode admits this one. A client whose update is folded
    /// but not yet durable (a retry after a lost answer) is admitted as
    /// [`Admission::Pending`]: it waits for durability like the first request. Blocking.
    pub fn check_upload(
        &self,
        task: &Task,
        client: &str,
        round_number: u64,
    ) -> Result<Admission, ServerError> {
        let state = task.state();
        if matches!(state, TaskState::Stopped | TaskState::Finished) {
            return Err(ServerError::conflict(
                ErrorCode::RoundClosed,
                format!(
                    "task `{}` is {} and takes no more updates",
                    task.id,
                    format!("{state:?}").to_lowercase()
                ),
            ));
        }
        let round = task
            .current()
            .ok_or_else(|| ServerError::conflict(ErrorCode::RoundClosed, "no round is open"))?;
        // A follower's copy of the round ended while the round is still open and not sealed
        // (this replica lost a claim and can record nothing more of it): a fresh update is sent
        // to another replica, which may still take it. (A retry of one it took gets its answer
        // here; a round the leader is closing gets the mode's answer for that.)
        let ended_here = {
            let acc = lock(&round.acc);
            self.follows()
                && acc.phase.is_ended()
                && !acc.contributions.iter().any(|c| c.client == client)
        };
        if ended_here && !self.store.sealed(&task.id, round.number, round.attempt)? {
            return Err(ServerError::unavailable(
                ErrorCode::Standby,
                format!(
                    "round {} takes no more updates at this replica; send the update to another of the deployment's servers",
                    round.number
                ),
            ));
        }
        let checked = round
            .collection
            .check_upload(task, &round, client, round_number);
        match self.store.shared() {
            true => self.check_shared(task, &round, client, round_number, checked),
            false => checked,
        }
    }

    /// The receipt of `client`'s update to the open round if it is folded but not yet durable
    /// (so a retry need not send its body again).
    pub async fn pending_receipt(
        self: &Arc<Self>,
        task: &Arc<Task>,
        client: &str,
        round_number: u64,
    ) -> Result<Option<wire::UpdateReceipt>, ServerError> {
        match self
            .check_upload_blocking(task, client, round_number)
            .await?
        {
            Admission::Fresh(..) => Ok(None),
            Admission::Pending(round, index) => self.receipt(&round, index).await.map(Some),
        }
    }

    /// [`Coordinator::check_upload`] on a blocking thread: it waits for the round's lock, which a
    /// round's publication holds while it writes (and an asynchronous task's uploads keep
    /// arriving meanwhile).
    pub async fn check_upload_blocking(
        self: &Arc<Self>,
        task: &Arc<Task>,
        client: &str,
        round_number: u64,
    ) -> Result<Admission, ServerError> {
        let (me, t, client) = (self.clone(), task.clone(), client.to_string());
        let waiting = task.lock_waiter().await;
        crate::blocking(move || {
            let _waiting = waiting;
            me.check_upload(&t, &client, round_number)
        })
        .await
    }
}

/// The upload path's checks, in order: open the envelope in place (authenticity and binding),
/// parse the update under the spec's limits in the format the task takes (`compression`),
/// check names, shapes and dtypes against the spec (or the codec's), and check every value it
/// decodes to is finite. What comes back can be folded as it is.
pub fn open_update<'a>(
    body: &'a mut [u8],
    key: &RoundSecretKey,
    binding: &Binding<'_>,
    spec: &ModelSpec,
    compression: Option<&Compression>,
) -> Result<Update<'a>, ServerError> {
    let reading = Reading {
        spec,
        compression,
        frozen: None,
    };
    open_update_at(body, key, binding, &reading).map(|(_, view)| view)
}

/// What an opened update is checked against: the task's spec (the trainable part's, for a task
/// that trains part of its model), the format it takes and the tensors it keeps frozen.
struct Reading<'s> {
    spec: &'s ModelSpec,
    compression: Option<&'s Compression>,
    frozen: Option<&'s ModelSpec>,
}

impl Reading<'_> {
    /// [`Update::open`]; a refusal of an update that carries a tensor of the frozen base says
    /// so, by name.
    fn open<'a>(&self, plaintext: &'a [u8]) -> Result<Update<'a>, ServerError> {
        Update::open(plaintext, self.spec, self.compression).map_err(|e| {
            match self
                .frozen
                .and_then(|frozen| frozen_tensor_in(plaintext, self.spec, frozen))
            {
                Some(name) => ServerError::InvalidUpdate(format!(
                    "tensor `{name}` is frozen in this task (no `trainable` pattern names it): an update carries only the {} trainable tensors of the round's model",
                    self.spec.tensors().len()
                )),
                None => ServerError::InvalidUpdate(e.to_string()),
            }
        })
    }
}

/// [`open_update`], saying too where in `body` the checked update lies (for [`reparse`] once
/// the view's borrow is over).
fn open_update_at<'a>(
    body: &'a mut [u8],
    key: &RoundSecretKey,
    binding: &Binding<'_>,
    reading: &Reading<'_>,
) -> Result<(std::ops::Range<usize>, Update<'a>), ServerError> {
    let base = body.as_ptr() as usize;
    let plaintext = envelope::open(body, key, binding)
        .map_err(|e| ServerError::InvalidUpdate(e.to_string()))?;
    let at = plaintext.as_ptr() as usize - base;
    let at = at..at + plaintext.len();
    Ok((at, reading.open(plaintext)?))
}

/// The view of an update [`open_update_at`] checked: its header parsed again (the values are
/// not decoded again; an encoded update's codes and positions are checked again).
fn reparse<'a>(
    plaintext: &'a [u8],
    spec: &ModelSpec,
    compression: Option<&Compression>,
) -> Result<Update<'a>, ServerError> {
    Update::parse(plaintext, spec, compression)
        .map_err(|e| ServerError::InvalidUpdate(e.to_string()))
}

/// How an opened update folds, worked out before the fold waits for the round's lock.
struct Folding {
    round: Arc<Round>,
    /// The version whose key sealed it.
    sealed: u64,
    fold_weight: f64,
    scale: f64,
    unclipped: Option<bool>,
    /// Its norm after scaling, for the adaptive bound's record (None: no adaptive bound).
    accepted_norm: Option<f64>,
    started: Instant,
}

/// What the refusal of an update as too large adds for a task that trains part of its model.
pub fn too_large_hint(record: &crate::store::TaskRecord) -> &'static str {
    match record.part {
        Some(_) => ": this task trains part of its model, and an update carries the round's model's tensors only (its trainable ones), none of its frozen base",
        None => "",
    }
}

/// The largest sealed upload a task of this spec and compression takes, for the upload route's
/// size limit (a plain update is read as far as the refusal that names the format the task
/// takes).
pub fn upload_limit(spec: &ModelSpec, compression: Option<&Compression>) -> u64 {
    let encoded = compression.map_or(0, |c| c.limits(spec).max_bytes);
    spec.limits().max_bytes.max(encoded) + envelope::OVERHEAD as u64
}
