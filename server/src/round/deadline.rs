//! One watcher per open round, whatever its mode: it closes the round when it is full, when its
//! deadline passes (for secure aggregation: each stage's deadline), and tries a failed close
//! again every second until it goes through. While the task is paused nothing closes; a resumed
//! plain round gets a whole deadline again.

use std::sync::Arc;
use std::time::Duration;

use hora_common::wire::TaskState;

use super::collection::Step;
use super::{lock, now_ms, Coordinator, Ending, Phase, Round, Task};
use crate::error::ServerError;

/// What the watcher found to do.
enum Due {
    /// Close the round with this ending.
    Close(Ending),
    /// The deadline passed: ask the round's mode what that means.
    Deadline,
}

impl Coordinator {
    /// Has the round's watcher close it now if it holds its target number of updates.
    pub(crate) fn close_if_full(&self, task: &Task, round: &Round) {
        let record = task.record();
        if record.state != TaskState::Running || self.follows() {
            return; // (a follower's rounds are closed by the leader)
        }
        let mut acc = lock(&round.acc);
        let full_at = round.collection.full_at(&record.config);
        round
            .collection
            .report(&self.metrics, &task.id, acc.contributions.len());
        // (An asynchronous buffer counts updates, each of one client: aggregators cannot send
        // to it.)
        if acc.contributors().saturating_add(acc.elsewhere) < full_at as u64 {
            return;
        }
        acc.close_requested = true;
        drop(acc);
        round.wake.notify_one();
    }

    /// Has `task`'s open round reach its deadline now: a plain round closes, published with
    /// the updates it holds if they reach `min_clients`, else abandoned and retried; a round
    /// with stages (secure aggregation) closes the stage it is in, with whoever is in. (A
    /// simulation's clock, not the server's, says when its rounds' deadlines pass.)
    /// Only `round` is expired: if the task has moved on, nothing happens.
    pub fn expire_round(&self, task: &Task, round: &Arc<Round>) {
        if task.current().is_some_and(|r| Arc::ptr_eq(&r, round)) {
            round.collection.expire(round);
        }
    }

    /// Starts the watcher of `round`, the open round of `task`; it ends with the round.
    pub(crate) fn watch(self: &Arc<Self>, task: Arc<Task>, round: Arc<Round>) {
        // (Every round opened or resumed here is watched: its running sum is this replica's.)
        let numel = lock(&task.record).spec.numel() as u64;
        self.metrics.round_sum_bytes(&task.id, numel * 8);
        let me = self.clone();
        let stopping = self.stopping.clone();
        self.background.spawn(async move {
            tokio::select! {
                _ = me.watch_round(task, round) => {}
                _ = stopping.cancelled() => {}
            }
        });
    }

    async fn watch_round(self: Arc<Self>, task: Arc<Task>, round: Arc<Round>) {
        let mut task_changes = task.subscribe();
        let mut mode_changes = round.collection.changes();
        let mut failed = false;
        loop {
            let current = task.current();
            if !current.as_ref().is_some_and(|c| Arc::ptr_eq(c, &round)) {
                return; // closed and replaced
            }
            let state = task.state();
            if matches!(state, TaskState::Stopped | TaskState::Finished) {
                return;
            }
            // The round's lock is held across a checkpoint's write (and a secure round's across
            // its store writes): read on a blocking thread, never on the runtime's workers.
            let r = round.clone();
            let read = crate::blocking(move || {
                let (phase, requested) = {
                    let acc = lock(&r.acc);
                    (acc.phase.clone(), acc.close_requested)
                };
                Ok((phase, requested, r.collection.next_deadline(&r)))
            });
            let (phase, requested, deadline) = match read.await {
                Ok(read) => read,
                Err(e) => {
                    tracing::warn!(task = %task.id, round = round.number, error = %e, "the round's watcher stops (the runtime is shutting down)");
                    return;
                }
            };
            let now = now_ms();
            let due = match phase {
                _ if state != TaskState::Running => None, // paused: nothing closes
                Phase::Retrying(ref ending) => Some(Due::Close(ending.clone())),
                Phase::Collecting if requested => Some(Due::Close(Ending::Publish)),
                Phase::Collecting if deadline <= now => Some(Due::Deadline),
                _ => None,
            };
            let Some(due) = due else {
                // Sleep until the deadline (while collecting and running) or until something
                // changes: the task (a pause, a resume, a join), the mode (a stage closed), or
                // the round (a close requested, or one that failed).
                let wait = match phase {
                    Phase::Collecting if state == TaskState::Running => {
                        Duration::from_millis(deadline.saturating_sub(now))
                    }
                    _ => Duration::from_secs(3600),
                };
                let mode = async {
                    match mode_changes.as_mut() {
                        Some(rx) => {
                            if rx.changed().await.is_err() {
                                std::future::pending::<()>().await
                            }
                        }
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    _ = task_changes.changed() => {}
                    _ = mode => {}
                    _ = round.wake.notified() => {}
                }
                continue;
            };
            if failed {
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            let (me, t, r) = (self.clone(), task.clone(), round.clone());
            let result = tokio::task::spawn_blocking(move || {
                let step = match due {
                    Due::Close(ending) => Step::End(ending),
                    Due::Deadline => r.collection.at_deadline(me.store())?,
                };
                me.step(&t, &r, step)
            })
            .await
            .map_err(ServerError::internal)
            .and_then(|r| r);
            failed = result.is_err();
            if let Err(e) = result {
                tracing::error!(task = %task.id, round = round.number, attempt = round.attempt, mode = round.collection.mode(), error = %e, "closing the round failed; retrying in a second");
            }
        }
    }
}
