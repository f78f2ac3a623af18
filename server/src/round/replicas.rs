//! Serving replicas: every replica of a deployment whose store they share (PostgreSQL and a
//! shared blob store) takes the joins, uploads and stage messages of every round mode; one of
//! them leads.
//!
//! - **Joins.** A client is selected in the store ([`crate::store::RoundLog::select_client`]),
//!   one row per client under a per-task lock, so the attempt's capacity holds across replicas
//!   and the selection is durable before the join is answered.
//! - **Uploads.** Before its body is read, an update is claimed in the store for the replica
//!   that takes it ([`crate::store::RoundLog::claim_update`]), so a retry sent to another
//!   replica after a lost acknowledgement is never folded twice (answered 409 once the first
//!   replica recorded it, 503 while it may still). A claim is taken over only from a replica
//!   whose heartbeat stopped, and only if none of its partials holds the update; a partial
//!   records only updates whose claims are still its replica's (a replica that lost one ends
//!   the round there: see [`Coordinator::checkpoint_partial`]). The replica folds it into its
//!   own running sum of the attempt; a replica that does not lead (a *follower*) makes that sum
//!   durable as its partial ([`Coordinator::checkpoint_partial`]: the sum's blob, then its row,
//!   written only while the attempt is open and not sealed) before it acknowledges. The leader
//!   checkpoints its own sum into the open round's record, as a single server does.
//! - **The close.** The leader seals the attempt in the store, which waits for partials being
//!   written and stops any later one, and merges every partial into its sum
//!   ([`Coordinator::merge_partials`]); the sealed partials are all there will ever be, so every
//!   acknowledged update is in the round, whichever replica took it, whichever died since. The
//!   round's record lists the partials merged (a close that fails and is tried again, or resumed
//!   by another leader, never merges one twice).
//! - **Following.** A follower loads the tasks and their open rounds as the leader stored them
//!   and follows the store's change feed ([`Coordinator::follow_store`]): a new attempt replaces
//!   its round (uploads it had not made durable are answered as the round's end), a changed task
//!   record replaces its copy, a new task is served. The leader follows the feed too, to count
//!   the partials of its open rounds: a round full across replicas closes before its deadline.
//!
//! - **Asynchronous (FedBuff) tasks.** A version is an attempt like any other: every replica
//!   folds the updates it takes into its partial of the open version, staleness-weighted
//!   against that version, and the leader publishes when the buffer is full across replicas.
//!   Training slots are rows in the store ([`crate::store::RoundLog::take_slot`]), so the
//!   task's concurrency holds across replicas and a client may upload where it did not join; a
//!   claim needs the client's slot, and the durable update spends it. An update goes only into
//!   the version it was claimed for: one that closed before the replica recorded it is answered
//!   503, and its client sends it again for the next. A client contributes at most one update
//!   to a version across replicas (on one server, one per version it trained from).
//!
//! - **Secure aggregation.** Every replica takes any stage's messages and folds the masked inputs
//!   it takes into a masked partial sum of its own; the leader alone moves the stages on (see
//!   [`crate::secagg`]'s `shared`).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Instant;

use hora_common::kernel::WeightedSum;
use hora_common::wire::ErrorCode;

use super::collection::{send_again, Joined, Step};
use super::upload::Admission;
use super::{
    capacity, lock, plain, Accumulator, Checkpointed, Coordinator, Durability, Phase, Round, Task,
};
use crate::error::ServerError;
use crate::store::{
    OpenRoundRecord, ReplicaPartial, SharedSelection, StoreChange, StoreError, TaskRecord,
};

/// What a replica does in its deployment.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Role {
    /// It makes the rounds' decisions: the only server of its store, or the replica holding
    /// the lease of a store replicas share.
    #[default]
    Leader,
    /// It serves clients without leading: it folds the uploads (or masked inputs) it takes into
    /// partials of its own, which the leader merges.
    Follower,
}

impl Coordinator {
    /// Whether this replica serves without leading.
    pub(crate) fn follows(&self) -> bool {
        self.config.role == Role::Follower
    }

    /// How this replica shares secure-aggregation attempts with the others (None: its store
    /// is its own).
    pub(crate) fn sharing(&self) -> Option<crate::secagg::Sharing> {
        self.store.shared().then(|| crate::secagg::Sharing {
            replica: self.config.replica.clone(),
            leads: !self.follows(),
        })
    }

    /// Selects `client` for `round` in the store if there is room (the plain mode's join on a
    /// store replicas share): durable once this returns, so the join is answered at once.
    /// Blocking.
    pub(crate) fn select_shared(
        &self,
        task: &Task,
        record: &TaskRecord,
        round: &Arc<Round>,
        client: &str,
    ) -> Result<Joined, ServerError> {
        let selected = |round: &Arc<Round>| Joined::offered(round, record, round.deadline(), 0);
        let capacity = capacity(&record.config);
        {
            let acc = lock(&round.acc);
            if acc.contributions.iter().any(|c| c.client == client) {
                return Err(plain::already_contributed(client, round.number));
            }
            if acc.selected.contains(client) {
                return Ok(selected(round));
            }
            if !acc.phase.is_collecting()
                || !task.strategy.admits(client, acc.selected.len(), capacity)
            {
                return Ok(Joined::Wait);
            }
        }
        // (The store's transaction is not held under the round's lock.)
        let outcome =
            self.store
                .select_client(&task.id, round.number, round.attempt, client, capacity)?;
        match outcome {
            SharedSelection::Selected => {
                learn_selected(round, &mut lock(&round.acc), client);
                task.bump();
                Ok(selected(round))
            }
            SharedSelection::Full | SharedSelection::Closed => Ok(Joined::Wait),
        }
    }

    /// The upload checks of a round that spans replicas, after the mode's own: a client this
    /// replica has not seen selected may have joined at another (the store says), and a fresh
    /// update is claimed for this replica, unless another took it already. Blocking.
    pub(crate) fn check_shared(
        &self,
        task: &Task,
        round: &Arc<Round>,
        client: &str,
        number: u64,
        checked: Result<Admission, ServerError>,
    ) -> Result<Admission, ServerError> {
        let claim = |from: Option<&str>| {
            self.store.claim_update(
                &task.id,
                round.number,
                round.attempt,
                client,
                &self.config.replica,
                from,
                round.collection.spends_slots(),
            )
        };
        let checked = match checked {
            Err(e)
                if e.code() == ErrorCode::NotSelected
                    && round
                        .collection
                        .selected_elsewhere(self, task, round, client)? =>
            {
                round.collection.check_upload(task, round, client, number)?
            }
            // A slot is spent by the update it was given for: the retry of one that another
            // replica recorded (its answer lost) is told it is in.
            Err(e) if e.code() == ErrorCode::NotSelected && round.collection.spends_slots() => {
                let holder =
                    self.store
                        .claim_holder(&task.id, round.number, round.attempt, client)?;
                return match holder {
                    Some(holder) if self.taken_by(task, round, &holder, client)? => {
                        Err(plain::already_contributed(client, round.number))
                    }
                    _ => Err(e),
                };
            }
            other => other?,
        };
        if let Admission::Fresh(..) = checked {
            let claimed = match claim(None) {
                // An asynchronous update is not lost with its version: it goes into the next.
                Err(StoreError::AttemptSealed { round: number, .. })
                    if round.collection.carries_over() =>
                {
                    return Err(send_again(number, "is closing"));
                }
                other => other?,
            };
            if let Some(holder) = claimed {
                // A replica that died (or a serving of this one that ended) without making it
                // durable: its claim is taken over, once.
                let stale = !holder.alive
                    || holder.replica.split('#').next() == self.config.replica.split('#').next();
                let still = match stale && !self.taken_by(task, round, &holder.replica, client)? {
                    true => claim(Some(&holder.replica))?,
                    false => Some(holder),
                };
                if let Some(holder) = still {
                    if self.taken_by(task, round, &holder.replica, client)? {
                        return Err(plain::already_contributed(client, round.number));
                    }
                    return Err(ServerError::unavailable(
                        ErrorCode::NotDurableYet,
                        format!("an earlier upload of this update is being taken by replica {}; retry the same upload to get its receipt", holder.replica),
                    ));
                }
            }
        }
        Ok(checked)
    }

    /// Whether the store lists `client` as selected for `round` (it joined at another
    /// replica); if so, this replica's copy of the selections learns it. Blocking.
    pub(crate) fn selected_in_store(
        &self,
        task: &Task,
        round: &Round,
        client: &str,
    ) -> Result<bool, ServerError> {
        let Some(open) = self.store.open_round(&task.id)? else {
            return Ok(false);
        };
        if (open.round, open.attempt) != (round.number, round.attempt)
            || !open.selected.iter().any(|c| c == client)
        {
            return Ok(false);
        }
        learn_selected(round, &mut lock(&round.acc), client);
        Ok(true)
    }

    /// Whether replica `holder`'s durable share of `round` (its partial, or the leader's
    /// checkpoint) holds `client`'s update.
    fn taken_by(
        &self,
        task: &Task,
        round: &Round,
        holder: &str,
        client: &str,
    ) -> Result<bool, ServerError> {
        let is_round = |r: u64, a: u32| (r, a) == (round.number, round.attempt);
        let in_partial = self.store.partials(&task.id)?.into_iter().any(|p| {
            p.replica == holder
                && is_round(p.round, p.attempt)
                && p.contributions.iter().any(|c| c.client == client)
        });
        if in_partial {
            return Ok(true);
        }
        Ok(self.store.open_round(&task.id)?.is_some_and(|open| {
            is_round(open.round, open.attempt)
                && open
                    .checkpoint
                    .is_some_and(|c| c.contributions.iter().any(|c| c.client == client))
        }))
    }

    /// A follower's group commit: its running sum's blob, then its partial's row, and only
    /// then are the uploads it holds acknowledged. An attempt sealed meanwhile (the leader is
    /// closing it) takes nothing more: the uploads not yet durable are told the round closed,
    /// and the round stops collecting here. Blocking, under the round's lock.
    pub(crate) fn checkpoint_partial(
        &self,
        task: &Task,
        round: &Round,
        acc: &mut Accumulator,
    ) -> Result<(), ServerError> {
        let started = Instant::now();
        let file = self.store.write_checkpoint(acc.sum.sum())?;
        let partial = ReplicaPartial {
            replica: self.config.replica.clone(),
            round: round.number,
            attempt: round.attempt,
            file: file.clone(),
            total_weight: acc.sum.total_weight(),
            contributions: acc.contributions.clone(),
        };
        let fresh: Vec<String> = acc.contributions[acc.durable..]
            .iter()
            .map(|c| c.client.clone())
            .collect();
        match self.store.put_partial(&task.id, &partial, &fresh) {
            Ok(()) => {}
            Err(e @ (StoreError::AttemptSealed { .. } | StoreError::ClaimLost { .. })) => {
                self.store.remove_checkpoint(&file);
                self.sealed(task, round, acc, &e.to_string());
                return Ok(());
            }
            Err(e) => {
                match e.may_have_landed() {
                    true => task.unsettled(super::task::Unsettled::Checkpoint(file)),
                    false => self.store.remove_checkpoint(&file),
                }
                return Err(e.into());
            }
        }
        let old = acc.checkpoint.replace(Checkpointed {
            file,
            total_weight: partial.total_weight,
            noised: false,
        });
        if let Some(old) = old {
            self.store.remove_checkpoint(&old.file);
        }
        for settled in task.settled(false) {
            if let super::task::Unsettled::Checkpoint(file) = settled {
                self.store.remove_checkpoint(&file);
            }
        }
        acc.durable = acc.contributions.len();
        round.durability.send_replace(Durability::Upto(acc.durable));
        self.metrics
            .store_commit_seconds
            .observe(started.elapsed().as_secs_f64());
        tracing::debug!(task = %task.id, round = round.number, durable = acc.durable, ms = started.elapsed().as_millis() as u64, "partial recorded");
        Ok(())
    }

    /// `round`, a follower's, ended for this replica (`why`): the leader sealed or replaced it,
    /// or another replica took over an update this one held (its sum can no longer be
    /// recorded). It takes nothing more, and the uploads it holds that are not durable are told
    /// the round closed here (their clients poll for the next round); those in its last partial
    /// are acknowledged, and the leader merges and removes that partial.
    fn sealed(&self, task: &Task, round: &Round, acc: &mut Accumulator, why: &str) {
        if acc.phase.is_ended() {
            return;
        }
        if acc.phase.begin_close().is_ok() {
            let _ = acc.phase.closed(Err(why.to_string()));
        }
        round
            .selection
            .send_replace(super::SelectionDurability::Closed);
        if acc.durable < acc.contributions.len() {
            tracing::info!(task = %task.id, round = round.number, lost = acc.contributions.len() - acc.durable, why, "the round ended here before this replica recorded some uploads: their clients are told it closed");
        }
        round.durability.send_replace(Durability::Ended {
            upto: acc.durable,
            why: why.to_string(),
        });
        task.bump();
    }

    /// The leader's close of a round on a store replicas share: seals the attempt and merges
    /// every replica's partial that the sum does not hold yet (their clients count as this
    /// attempt's contributions, durable already), where the mode [merges
    /// partials](super::collection::Collection::merges_partials); and learns every replica's
    /// selections. Blocking, under the round's lock.
    pub(crate) fn merge_partials(
        &self,
        task: &Task,
        round: &Round,
        acc: &mut Accumulator,
    ) -> Result<(), ServerError> {
        let partials = match round.collection.merges_partials() {
            true => self
                .store
                .seal_partials(&task.id, round.number, round.attempt)?,
            false => Vec::new(),
        };
        let spec = acc.sum.spec().clone();
        for partial in partials {
            // (Every sealed partial's blob goes once the close lands, those an earlier close
            // merged included.)
            if !acc.partial_files.contains(&partial.file) {
                acc.partial_files.push(partial.file.clone());
            }
            if acc.merged.contains(&partial.replica) {
                continue;
            }
            let values = self.store.read_checkpoint(&partial.file, spec.numel())?;
            let n = partial.contributions.len() as u64;
            let sum = WeightedSum::from_parts(spec.clone(), values, partial.total_weight, n)
                .map_err(ServerError::internal)?;
            acc.sum.merge(&sum).map_err(ServerError::internal)?;
            round.collection.merged(round, &partial.contributions);
            let mut roster = lock(&round.roster);
            for c in partial.contributions {
                acc.behind = acc.behind.saturating_add(c.contributors.saturating_sub(1));
                roster.contributed(&c.client);
                acc.selected.insert(c.client.clone());
                acc.contributions.push(c);
            }
            drop(roster);
            tracing::debug!(task = %task.id, round = round.number, replica = %partial.replica, updates = n, "merged a replica's partial");
            acc.merged.push(partial.replica);
        }
        // (They are in the sum now: a close that fails counts them there, not twice.)
        acc.elsewhere = 0;
        // Every selection, whichever replica took it, for the history's list of dropouts.
        if let Some(open) = self.store.open_round(&task.id)? {
            if (open.round, open.attempt) == (round.number, round.attempt) {
                acc.selected.extend(open.selected);
                acc.selected_durable = acc.selected.len();
            }
        }
        Ok(())
    }

    /// Follows the store's change feed (a store replicas share): a follower keeps its tasks and
    /// rounds as the leader stored them; the leader counts its rounds' partials. Runs until the
    /// coordinator stops.
    pub(crate) fn follow_store(self: &Arc<Self>) {
        let Some(mut feed) = self.store.changes().filter(|_| self.store.shared()) else {
            return;
        };
        let me = self.clone();
        self.background.spawn(async move {
            loop {
                let first = tokio::select! {
                    change = feed.recv() => change,
                    () = me.stopping.cancelled() => return,
                };
                // Everything that came meanwhile, once each.
                let mut changed = BTreeSet::new();
                let mut all = false;
                let mut note = |change| match change {
                    Ok(StoreChange::Task(id)) => {
                        changed.insert(id);
                    }
                    Ok(StoreChange::Missed)
                    | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => all = true,
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => {}
                };
                note(first);
                while let Ok(change) = feed.try_recv() {
                    note(Ok(change));
                }
                let m = me.clone();
                let followed = crate::blocking(move || {
                    let ids: Vec<String> = match all {
                        true => match m.store.tasks() {
                            Ok(tasks) => tasks.into_iter().map(|(id, _)| id).collect(),
                            Err(e) => {
                                tracing::warn!(error = %e, "reading the tasks after the change feed's gap failed; trying again at the next change");
                                return Ok(());
                            }
                        },
                        false => changed.into_iter().collect(),
                    };
                    for id in ids {
                        if let Err(e) = m.follow_task(&id) {
                            tracing::warn!(task = %id, error = %e, "following the task's change failed; it is read again at its next change");
                        }
                    }
                    Ok(())
                })
                .await;
                match followed {
                    Ok(()) => {}
                    // (A panic, which `crate::blocking` reports as an internal error, must not
                    // end the following: the next change is read again.)
                    Err(e) if !me.stopping.is_cancelled() => {
                        tracing::error!(error = %e, "following the store's changes failed; carrying on");
                    }
                    Err(_) => return, // the runtime is shutting down
                }
            }
        });
    }

    /// What a change of task `id` in the store means here. Blocking.
    fn follow_task(self: &Arc<Self>, id: &str) -> Result<(), ServerError> {
        if !self.follows() {
            return self.count_partials(id);
        }
        let Some(record) = self.store.task(id)? else {
            // Deleted: nothing more to serve.
            if let Some(task) = self.tasks.write().expect("tasks lock").remove(id) {
                if let Some(round) = task.current() {
                    let mut acc = lock(&round.acc);
                    self.sealed(&task, &round, &mut acc, "the task was deleted");
                }
            }
            return Ok(());
        };
        let open = self.store.open_round(id)?;
        let task = self.tasks.read().expect("tasks lock").get(id).cloned();
        let Some(task) = task else {
            let round = open
                .map(|open| self.follower_round(&record, open))
                .transpose()?;
            let strategy = crate::strategy::from_config(&record.config.strategy);
            let task = Arc::new(Task::new(
                id.to_string(),
                record,
                round,
                strategy,
                self.changes.clone(),
            ));
            self.tasks
                .write()
                .expect("tasks lock")
                .insert(id.to_string(), task.clone());
            self.commit_for(task.clone());
            task.bump();
            return Ok(());
        };
        let current = task.current();
        let same =
            |r: &Round, open: &OpenRoundRecord| (r.number, r.attempt) == (open.round, open.attempt);
        match (&current, open) {
            (Some(r), Some(open)) if same(r, &open) => {
                {
                    let mut acc = lock(&r.acc);
                    for client in &open.selected {
                        learn_selected(r, &mut acc, client);
                    }
                }
                // (A follower's step is always to go on: the leader decides.)
                r.collection.followed(&*self.store)?;
            }
            (_, open) => {
                let next = open
                    .map(|open| self.follower_round(&record, open))
                    .transpose()?;
                if let Some(old) = &current {
                    let mut acc = lock(&old.acc);
                    self.sealed(&task, old, &mut acc, "the leader closed it");
                }
                *lock(&task.round) = next;
            }
        }
        *lock(&task.record) = record;
        task.bump();
        Ok(())
    }

    /// A follower's round for the attempt `open` describes: the leader's key, model and
    /// selections, and a running sum of its own, empty.
    pub(crate) fn follower_round(
        &self,
        record: &TaskRecord,
        open: OpenRoundRecord,
    ) -> Result<Arc<Round>, ServerError> {
        let open = OpenRoundRecord {
            checkpoint: None,
            merged: Vec::new(),
            ..open
        };
        self.resume_round(record, open)
    }

    /// A leader's first look at task `id`'s open round, resumed from the store, if it spans
    /// replicas: the partials recorded meanwhile count, and an attempt that a leader which died
    /// (or lost its lease) had sealed closes now. No replica can add to a sealed attempt, and an
    /// asynchronous version has no deadline to close it. Blocking.
    pub(crate) fn catch_up(self: &Arc<Self>, id: &str) -> Result<(), ServerError> {
        self.count_partials(id)?;
        let Some(round) = self.task(id).ok().and_then(|t| t.current()) else {
            return Ok(());
        };
        if !self.store.shared()
            || !round.collection.merges_partials()
            || !self.store.sealed(id, round.number, round.attempt)?
        {
            return Ok(());
        }
        tracing::info!(task = %id, round = round.number, attempt = round.attempt, "the attempt was sealed by a leader that did not finish closing it: closing it now");
        lock(&round.acc).close_requested = true;
        round.wake.notify_one();
        Ok(())
    }

    /// The leader's count of the updates other replicas hold for task `id`'s open round: a
    /// round full across replicas closes now (a mode with stages may move on). Blocking.
    fn count_partials(self: &Arc<Self>, id: &str) -> Result<(), ServerError> {
        let Ok(task) = self.task(id) else {
            return Ok(());
        };
        let Some(round) = task.current() else {
            return Ok(());
        };
        if !self.store.shared() {
            return Ok(());
        }
        match round.collection.followed(&*self.store)? {
            Step::Continue if round.collection.merges_partials() => {}
            Step::Continue => return Ok(()),
            step => return self.step(&task, &round, step),
        }
        let elsewhere = self
            .store
            .partials(id)?
            .into_iter()
            .filter(|p| (p.round, p.attempt) == (round.number, round.attempt))
            .flat_map(|p| p.contributions)
            .fold(0u64, |n, c| n.saturating_add(c.contributors));
        {
            let mut acc = lock(&round.acc);
            if acc.elsewhere == elsewhere || !matches!(acc.phase, Phase::Collecting) {
                return Ok(());
            }
            acc.elsewhere = elsewhere;
        }
        task.bump();
        self.close_if_full(&task, &round);
        Ok(())
    }
}

/// `client` holds a place in `round` (the store says so): this replica's copy of the
/// selections, which are durable as they are made, learns it.
pub(crate) fn learn_selected(round: &Round, acc: &mut Accumulator, client: &str) {
    if acc.selected.insert(client.to_string()) {
        acc.selected_durable += 1;
        lock(&round.roster).selected.insert(client.to_string());
    }
}
