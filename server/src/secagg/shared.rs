//! Secure aggregation across replicas that share a store: every replica takes any client's
//! messages of any stage, and the leader alone moves the stages on.
//!
//! - **The gate.** Beside its stage record the leader keeps a *gate* (record `task\0gate\0`):
//!   the attempt and the stage that takes messages. A replica records a client's message only
//!   while the gate is open for that stage ([`crate::store::SecaggLog::secagg_put_gated`]: the
//!   gate is read, locked, in the message's transaction). To close a stage the leader first
//!   closes its gate, which waits for the messages in flight; every message of the stage is
//!   then in the store, and it reads them all before deciding who goes on.
//! - **Messages.** A client's advertisement, share bundles and revealed shares are claimed
//!   records: the first is kept, the same one again is a repeat (a lost acknowledgement, sent
//!   to any replica), another one is refused as at one server.
//! - **Masked inputs.** Each replica folds the inputs it takes into a masked partial sum of its
//!   own and records it (its sum's blob, then record `task\0part\0replica` with the clients in
//!   it, and for each of them a claim `task\0in\0client` naming the replica, in one gated
//!   transaction) before acknowledging. A client's input is in one partial at most, and a
//!   partial lists exactly the inputs its sum holds; the leader's close of the stage adds up
//!   every partial, whichever replica died since.
//! - **Following.** Every write notifies the change feed. The leader counts what the other
//!   replicas took and closes a stage early once everyone is in; a replica that does not lead
//!   reads the leader's record when the stage moves on (or when a client is ahead of it).

use serde::{Deserialize, Serialize};

use super::*;
use crate::store::Gated;

/// How a replica takes part in attempts that replicas share.
#[derive(Debug, Clone)]
pub struct Sharing {
    /// This replica's id: the name of its partial sum and of its claims.
    pub replica: String,
    /// Whether it leads (moves the stages on).
    pub leads: bool,
}

/// The stage the leader lets messages in for (the gate's record: compared byte for byte).
#[derive(Serialize)]
struct Gate {
    round: u64,
    attempt: u32,
    stage: Stage,
    open: bool,
}

/// A replica's masked partial sum of an attempt's inputs.
#[derive(Debug, Serialize, Deserialize)]
struct PartRecord {
    round: u64,
    attempt: u32,
    sum_file: Option<String>,
    /// The clients whose masked inputs `sum_file` holds.
    survivors: Vec<String>,
}

impl SecAggRound {
    /// Whether this replica serves the attempt without leading it.
    pub(super) fn follows(&self) -> bool {
        self.sharing.as_ref().is_some_and(|s| !s.leads)
    }

    fn gate(&self, stage: Stage, open: bool) -> Vec<u8> {
        serde_json::to_vec(&Gate {
            round: self.ctx.round,
            attempt: self.ctx.attempt,
            stage,
            open,
        })
        .expect("a gate serialises")
    }

    /// The leader's write of the gate (it waits for the messages in flight under the old one).
    pub(super) fn set_gate(
        &self,
        store: &Store,
        stage: Stage,
        open: bool,
    ) -> Result<(), ServerError> {
        store.secagg_put_bytes(&key(&self.ctx.task, "gate", ""), &self.gate(stage, open))?;
        Ok(())
    }

    /// Makes `client`'s message `value` of the current stage durable: at one server, a write;
    /// across replicas, a claimed record written while the stage's gate is open (`taken`: the
    /// error for a client that recorded another one, at any replica).
    pub(super) fn record<T: Serialize>(
        &self,
        store: &Store,
        inner: &Inner,
        kind: &str,
        client: &str,
        value: &T,
        taken: impl FnOnce() -> ServerError,
    ) -> Result<(), ServerError> {
        let at = key(&self.ctx.task, kind, client);
        if self.sharing.is_none() {
            store.secagg_put(&at, value)?;
            store.flush()?;
            return Ok(());
        }
        let bytes = serde_json::to_vec(value).map_err(ServerError::internal)?;
        let gate = key(&self.ctx.task, "gate", "");
        match store.secagg_put_gated(&gate, &self.gate(inner.stage, true), (&at, &bytes), &[])? {
            Gated::Written => Ok(()),
            Gated::Closed => Err(closed_meanwhile(inner.stage)),
            Gated::Taken(_) => Err(taken()),
        }
    }

    /// Across replicas: folds `client`'s masked input (participant `me`) into this replica's
    /// partial sum and records the partial, with the client's claim, while masked inputs are
    /// still taken. A refused input leaves nothing in the sum (nor its blob, a name of this
    /// write's alone); one whose record may or may not have landed (the database went away
    /// mid-commit) leaves the partial *unsettled*: it is read back from the store before the
    /// next input is folded.
    pub(super) fn fold_shared(
        &self,
        store: &Store,
        inner: &mut Inner,
        me: usize,
        client: &str,
        body: &[u8],
    ) -> Result<(), ServerError> {
        let Some(sharing) = &self.sharing else {
            return Err(ServerError::internal("a shared fold at one server"));
        };
        let task = &self.ctx.task;
        let own = key(task, "part", &sharing.replica);
        if inner.unsettled {
            self.reread_own(store, inner, &own)?;
            if inner.survivors.contains(&me) {
                return Err(already_in(client, &sharing.replica));
            }
        }
        inner.fold(body, self.vector_len, true);
        inner.mine.insert(me);
        let recorded = store
            .write_masked_partial(&inner.sum)
            .map_err(ServerError::from)
            .and_then(|file| {
                let part = PartRecord {
                    round: self.ctx.round,
                    attempt: self.ctx.attempt,
                    sum_file: Some(file.clone()),
                    survivors: inner
                        .mine
                        .iter()
                        .map(|&i| inner.participants[i].id.clone())
                        .collect(),
                };
                let part = serde_json::to_vec(&part).map_err(ServerError::internal)?;
                let gated = store.secagg_put_gated(
                    &key(task, "gate", ""),
                    &self.gate(Stage::MaskedInput, true),
                    (&key(task, "in", client), sharing.replica.as_bytes()),
                    &[(&own, &part)],
                );
                match gated {
                    Ok(gated) => Ok((file, gated)),
                    Err(e) => {
                        match e.may_have_landed() {
                            true => inner.unsettled = true,
                            false => store.remove_checkpoint(&file),
                        }
                        Err(e.into())
                    }
                }
            });
        let refused = match recorded {
            Ok((file, Gated::Written)) => {
                inner.survivors.insert(me);
                if let Some(old) = inner.sum_file.replace(file.clone()).filter(|o| *o != file) {
                    store.remove_checkpoint(&old);
                }
                return Ok(());
            }
            Ok((file, Gated::Taken(holder))) => {
                store.remove_checkpoint(&file);
                inner.survivors.insert(me);
                already_in(client, &String::from_utf8_lossy(&holder))
            }
            Ok((file, Gated::Closed)) => {
                store.remove_checkpoint(&file);
                closed_meanwhile(Stage::MaskedInput)
            }
            Err(e) => e,
        };
        inner.fold(body, self.vector_len, false);
        inner.mine.remove(&me);
        Err(refused)
    }

    /// This replica's partial sum as the store holds it (record `own`), after a write whose
    /// outcome was unknown.
    fn reread_own(&self, store: &Store, inner: &mut Inner, own: &str) -> Result<(), ServerError> {
        let part = store
            .secagg_get::<PartRecord>(own)?
            .filter(|p| (p.round, p.attempt) == (self.ctx.round, self.ctx.attempt));
        let (sum, mine) = match &part {
            Some(PartRecord {
                sum_file: Some(file),
                survivors,
                ..
            }) => match store.read_masked_sum(file, self.vector_len) {
                Ok(sum) => (sum, self.indices(inner, survivors)?),
                // (The leader closed the stage and removed the partials it merged.)
                Err(e) if lost(&e) => return Err(closed_meanwhile(Stage::MaskedInput)),
                Err(e) => return Err(e.into()),
            },
            _ => (vec![0; self.vector_len], BTreeSet::new()),
        };
        // (The blob of an earlier write, superseded by the one the store names.)
        let stored = part.as_ref().and_then(|p| p.sum_file.as_ref());
        if let Some(old) = inner.sum_file.take().filter(|o| Some(o) != stored) {
            store.remove_checkpoint(&old);
        }
        inner.survivors.extend(mine.iter().copied());
        inner.sum = sum;
        inner.mine = mine;
        inner.sum_file = part.and_then(|p| p.sum_file);
        inner.unsettled = false;
        Ok(())
    }

    /// The leader's read of what every replica took of the current stage.
    pub(super) fn gather(&self, store: &Store, inner: &mut Inner) -> Result<(), ServerError> {
        match inner.stage {
            Stage::Advertise => inner.adverts = self.scan(store, "adv")?,
            Stage::ShareKeys => inner.mail = self.scan(store, "mail")?,
            Stage::MaskedInput => {
                for (_, part) in self.parts(store)? {
                    let survivors = self.indices(inner, &part.survivors)?;
                    inner.survivors.extend(survivors);
                }
            }
            Stage::Unmask => inner.answers = self.scan(store, "unmask")?,
            Stage::Ended => {}
        }
        Ok(())
    }

    /// The replicas' partial sums of this attempt.
    fn parts(&self, store: &Store) -> Result<Vec<(String, PartRecord)>, ServerError> {
        let prefix = format!("{}\0part\0", self.ctx.task);
        Ok(store
            .secagg_scan::<PartRecord>(&prefix)?
            .into_iter()
            .filter(|(_, p)| (p.round, p.attempt) == (self.ctx.round, self.ctx.attempt))
            .collect())
    }

    /// The leader's first step in closing a stage across replicas: the gate closes, and what
    /// every replica took of the stage is read. For the masked inputs, the replicas' partial
    /// sums become the attempt's sum (written as its own blob); their blobs are listed as
    /// `spent`, to go once the stage's close is recorded. `Ok(Err(why))`: a partial sum cannot
    /// be used (its blob is missing or damaged, or it names inputs it cannot hold), and the
    /// attempt cannot be unmasked.
    pub(super) fn seal(
        &self,
        store: &Store,
        inner: &mut Inner,
    ) -> Result<Result<(), String>, ServerError> {
        if self.sharing.is_none() {
            return Ok(Ok(()));
        }
        self.set_gate(store, inner.stage, false)?;
        self.gather(store, inner)?;
        if inner.stage != Stage::MaskedInput {
            return Ok(Ok(()));
        }
        let mut sum = vec![0u32; self.vector_len];
        let mut survivors = BTreeSet::new();
        let parts = self.parts(store)?;
        // (Removed once the attempt moves on, or once its end is recorded.)
        inner
            .spent
            .extend(parts.iter().filter_map(|(_, p)| p.sum_file.clone()));
        for (replica, part) in parts {
            let unusable =
                |why: String| Ok(Err(format!("replica {replica}'s masked partial sum {why}")));
            let ids = match self.indices(inner, &part.survivors) {
                Ok(ids) => ids,
                Err(e) => return unusable(format!("names someone else: {e}")),
            };
            for i in ids {
                if !survivors.insert(i) {
                    let id = &inner.participants[i].id;
                    return unusable(format!(
                        "holds `{id}`'s masked input, which another holds too"
                    ));
                }
            }
            let Some(file) = part.sum_file else { continue };
            let values = match store.read_masked_sum(&file, self.vector_len) {
                Ok(values) => values,
                Err(e) if lost(&e) => return unusable(format!("is lost: {e}")),
                Err(e) => return Err(e.into()),
            };
            for (s, v) in sum.iter_mut().zip(values) {
                *s = s.wrapping_add(v);
            }
        }
        inner.sum_file = Some(store.write_masked_sum(&sum)?);
        inner.sum = sum;
        inner.survivors = survivors;
        inner.mine.clear();
        inner.unsettled = false;
        Ok(Ok(()))
    }

    /// A change of the task's records in the shared store (another replica's message, or the
    /// leader's stage record). The leader counts every replica's messages of the stage and
    /// closes it once everyone is in; another replica catches up with the leader's record.
    pub fn followed(&self, store: &Store) -> Result<Outcome, ServerError> {
        if self.sharing.is_none() {
            return Ok(Outcome::Continue);
        }
        let mut inner = lock(&self.inner);
        if inner.stage == Stage::Ended {
            return Ok(Outcome::Continue);
        }
        if self.follows() {
            self.sync(store, &mut inner)?;
            return Ok(Outcome::Continue);
        }
        let before = inner.adverts.len();
        self.gather(store, &mut inner)?;
        let (accepted, expected) = match inner.stage {
            Stage::Advertise => {
                if before == 0 && !inner.adverts.is_empty() {
                    // (Taken by another replica.)
                    self.first_advertised(store, &mut inner)?;
                }
                (inner.adverts.len(), self.capacity)
            }
            Stage::ShareKeys => (inner.mail.len(), inner.participants.len()),
            Stage::MaskedInput => (inner.survivors.len(), inner.shared.len()),
            Stage::Unmask => (inner.answers.len(), inner.survivors.len()),
            Stage::Ended => return Ok(Outcome::Continue),
        };
        Ok(self.progress(store, &mut inner, accepted, expected)?.1)
    }

    /// The attempt's stage, as the leader last recorded it when this replica follows.
    pub fn stage_caught_up(&self, store: &Store) -> Result<Stage, ServerError> {
        let mut inner = lock(&self.inner);
        if self.follows() {
            self.sync(store, &mut inner)?;
        }
        Ok(inner.stage)
    }

    /// A follower's catch-up: once the leader's record says the stage moved on, everything it
    /// fixed (participants, who shared, who survived) and every message stored are taken in.
    /// The follower's own partial sum stays its own.
    pub(super) fn sync(&self, store: &Store, inner: &mut Inner) -> Result<(), ServerError> {
        let Some(state) = store
            .secagg_get::<StateRecord>(&key(&self.ctx.task, "state", ""))?
            .filter(|s| (s.round, s.attempt) == (self.ctx.round, self.ctx.attempt))
        else {
            return Ok(());
        };
        if state.stage <= inner.stage {
            return Ok(());
        }
        self.load(store, inner, &state, false)?;
        tracing::debug!(task = %self.ctx.task, round = self.ctx.round, attempt = self.ctx.attempt, stage = ?inner.stage, "followed the leader's secure-aggregation stage");
        self.changed.send_modify(|v| *v += 1);
        Ok(())
    }
}

/// Whether a blob read failed because the blob is gone or damaged (not worth another try).
fn lost(e: &crate::store::StoreError) -> bool {
    use crate::store::StoreError;
    match e {
        StoreError::Corrupt { .. } => true,
        StoreError::Io { source, .. } => source.kind() == std::io::ErrorKind::NotFound,
        _ => false,
    }
}

/// A masked input that another replica's partial sum (or this one's) holds already.
fn already_in(client: &str, replica: &str) -> ServerError {
    ServerError::conflict(
        ErrorCode::AlreadyContributed,
        format!("client `{client}`'s masked input for this attempt is in already (replica {replica} took it)"),
    )
}

/// A message the stage's gate refused: the leader closed the stage before it was recorded.
fn closed_meanwhile(stage: Stage) -> ServerError {
    ServerError::conflict(
        ErrorCode::StageClosed,
        format!("the {stage:?} stage closed before this message was recorded").to_lowercase(),
    )
}
