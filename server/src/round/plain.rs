//! The plain round mode: clients upload their delta sealed to the round's key, and each is
//! opened, validated and folded into the round's running sum the moment it arrives.
//!
//! An upload, top to bottom: [`Coordinator::check_upload`] (before the body is read: the round,
//! the client's selection, a retry of an update already in), then on a blocking thread
//! [`open_update`] (envelope → safetensors under the spec's limits → names, shapes, dtypes →
//! finite values), the task's update bounds and central-DP clipping, the fold under the round's
//! lock; the ingest slot is released, and the upload waits for the group commit that makes it
//! durable ([`super::commit`]).

use std::sync::Arc;
use std::time::Instant;

use hora_common::envelope::{self, Binding, RoundSecretKey};
use hora_common::model::{ModelDigest, ModelSpec, ModelView};
use hora_common::wire::{self, ErrorCode, TaskState, UpdateMeta};

use super::collection::{Collection, Step};
use super::{lock, Coordinator, Ending, Round, Task};
use crate::error::ServerError;
use crate::store::{Contribution, Store};

/// Sealed uploads, folded as they arrive.
pub struct PlainCollection;

impl Collection for PlainCollection {
    fn mode(&self) -> &'static str {
        "plain"
    }

    fn next_deadline(&self, round: &Round) -> u64 {
        round.deadline()
    }

    fn at_deadline(&self, _: &Store) -> Result<Step, ServerError> {
        // Published if it has the minimum, abandoned otherwise: the close decides.
        Ok(Step::End(Ending::Publish))
    }

    fn retry_after_failed_close(&self, _: Ending) -> Option<Ending> {
        None // the sum can take more updates; the watcher closes it again
    }

    fn restarts_on_resume(&self) -> bool {
        true
    }
}

/// Whether an upload is worth reading.
pub enum Admission {
    /// No such update from this client in the round yet; it is sealed as `.1` says.
    Fresh(Arc<Round>, Sealing),
    /// Its update is the round's contribution `.1`, folded but not yet durable.
    Pending(Arc<Round>, usize),
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

impl Coordinator {
    /// The upload path: checks the round, opens the envelope, validates, folds, and returns
    /// once the update is durable. `body` is the sealed envelope, decrypted in place.
    /// `permit` (the HTTP layer's ingest slot) is dropped as soon as the update is folded, before the wait
    /// for durability, so the next body can be read meanwhile.
    pub async fn upload(
        self: &Arc<Self>,
        task: Arc<Task>,
        client: String,
        round_number: u64,
        meta: UpdateMeta,
        mut body: Vec<u8>,
        permit: impl Send + 'static,
    ) -> Result<wire::UpdateReceipt, ServerError> {
        let admission = self
            .check_upload_blocking(&task, &client, round_number)
            .await?;
        let (round, sealing) = match admission {
            Admission::Fresh(round, sealing) => (round, sealing),
            Admission::Pending(round, index) => return self.receipt(&round, index).await,
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
        let spec = record.spec;
        let bounds = record.config.update_bounds;
        let dp = record.dp;
        // Example counts above the task's bound count as the bound, and so do those above the
        // adaptive bound (a multiple of the median weight of recent accepted updates).
        let mut weight = meta.num_examples.min(bounds.max_weight.max(1));
        if let Some(cap) = bounds
            .adaptive_weight_factor
            .and_then(|f| lock(&task.recent).weights.bound(f))
        {
            weight = weight.min(cap.ceil() as u64).max(1);
        }
        let (me, waker) = (self.clone(), task.clone());
        let (round, index, _folded) = tokio::task::spawn_blocking(move || -> Result<_, ServerError> {
            let started = Instant::now();
            let (key, sealed_round, base) = match &sealing {
                Sealing::Current => (&round.key, round.number, round.base),
                Sealing::Earlier { round, key, base } => (&**key, *round, *base),
            };
            let binding = Binding {
                task: &task.id,
                round: sealed_round,
                client: &client,
                base_model: &base,
            };
            let view = open_update(&mut body, key, &binding, &spec)?;
            // The task's bound: the configured one, else the adaptive one (a multiple of the
            // median norm of recent accepted updates, once there are enough of them).
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
            if let Some(buffer) = round.collection.asynchronous() {
                let update = Contribution {
                    client,
                    examples: weight,
                    metrics: meta.metrics,
                    unclipped: None,
                    base: Some(sealed_round),
                };
                let (round, index, folded) = buffer.fold(&task, update, scale, &view)?;
                if folded {
                    task.accepted(adaptive.then_some(norm * scale), weight);
                    me.metrics.ingest_seconds.observe(started.elapsed().as_secs_f64());
                    me.metrics.update_staleness(&task.id, round.number - sealed_round);
                    me.metrics.async_training(&task.id, buffer.training());
                    me.close_if_full(&task, &round);
                }
                return Ok((round, index, folded));
            }
            let index = {
                let mut acc = lock(&round.acc);
                // Re-check under the lock: the round may have closed, or a duplicate raced us.
                if !acc.phase.is_collecting() {
                    return Err(ServerError::conflict(
                        ErrorCode::RoundClosed,
                        format!(
                            "round {} closed while the update was being checked",
                            round.number
                        ),
                    ));
                }
                if let Some(index) = acc.contributions.iter().position(|c| c.client == client) {
                    // A retry raced its own first attempt: answer as the first is answered.
                    return Ok((round.clone(), index, false));
                }
                acc.sum
                    .add_view_scaled(fold_weight, scale, &view)
                    .map_err(|e| ServerError::InvalidUpdate(e.to_string()))?;
                lock(&round.roster).contributed(&client);
                acc.contributions.push(Contribution {
                    client,
                    examples: weight,
                    metrics: meta.metrics,
                    unclipped,
                    base: None,
                });
                acc.contributions.len() - 1
            };
            task.accepted(adaptive.then_some(norm * scale), weight);
            me.metrics
                .ingest_seconds
                .observe(started.elapsed().as_secs_f64());
            me.close_if_full(&task, &round);
            Ok((round, index, true))
        })
        .await
        .map_err(ServerError::internal)??;
        drop(permit);
        waker.commit_wanted.notify_one();
        self.receipt(&round, index).await
    }

    /// The checks an upload must pass before its body is worth reading. A client whose update
    /// is folded but not yet durable (a retry after a lost answer) is admitted as
    /// [`Admission::Pending`]: it waits for durability like the first request.
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
        round.collection.check_sealed_upload(&task.id)?;
        if let Some(buffer) = round.collection.asynchronous() {
            return buffer.check_upload(&round, client, round_number);
        }
        if round_number != round.number {
            let code = if round_number < round.number {
                ErrorCode::RoundClosed
            } else {
                ErrorCode::WrongRound
            };
            return Err(ServerError::conflict(
                code,
                format!(
                    "round {round_number} is not open; the open round is {}",
                    round.number
                ),
            ));
        }
        let acc = lock(&round.acc);
        if !acc.phase.is_collecting() {
            return Err(ServerError::conflict(
                ErrorCode::RoundClosed,
                format!("round {} is closing", round.number),
            ));
        }
        if !acc.selected.contains(client) {
            return Err(ServerError::conflict(
                ErrorCode::NotSelected,
                format!(
                    "client `{client}` is not selected for round {}: join it first",
                    round.number
                ),
            ));
        }
        match acc.contributions.iter().position(|c| c.client == client) {
            Some(index) if index < acc.durable => Err(already_contributed(client, round.number)),
            Some(index) => Ok(Admission::Pending(round.clone(), index)),
            None => Ok(Admission::Fresh(round.clone(), Sealing::Current)),
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
    async fn check_upload_blocking(
        self: &Arc<Self>,
        task: &Arc<Task>,
        client: &str,
        round_number: u64,
    ) -> Result<Admission, ServerError> {
        let (me, t, client) = (self.clone(), task.clone(), client.to_string());
        let _waiting = task.lock_waiters.acquire().await;
        crate::blocking(move || me.check_upload(&t, &client, round_number)).await
    }
}

/// The upload path's checks, in order: open the envelope in place (authenticity and binding),
/// parse the safetensors under the spec's limits, check names, shapes and dtypes against the
/// spec, and check every value is finite. What comes back can be folded as it is.
pub fn open_update<'a>(
    body: &'a mut [u8],
    key: &RoundSecretKey,
    binding: &Binding<'_>,
    spec: &ModelSpec,
) -> Result<ModelView<'a>, ServerError> {
    let invalid = |e: &dyn std::fmt::Display| ServerError::InvalidUpdate(e.to_string());
    let plaintext = envelope::open(body, key, binding).map_err(|e| invalid(&e))?;
    let view = ModelView::parse(plaintext, &spec.limits()).map_err(|e| invalid(&e))?;
    spec.check_spec(&view.spec()).map_err(|e| invalid(&e))?;
    view.check_finite().map_err(|e| invalid(&e))?;
    Ok(view)
}

pub(crate) fn already_contributed(client: &str, round: u64) -> ServerError {
    ServerError::conflict(
        ErrorCode::AlreadyContributed,
        format!("client `{client}` has already uploaded its update for round {round}"),
    )
}

/// The largest sealed upload a task of this spec takes, for the upload route's size limit.
pub fn upload_limit(spec: &ModelSpec) -> u64 {
    spec.limits().max_bytes + envelope::OVERHEAD as u64
}
