//! A secure-aggregation round as the field plays it. Each virtual client runs the protocol's
//! client side, [`ClientSession`], as `hora-client` does, and its messages go to the engine's
//! stages ([`SecAggRound`]) as the API's handlers hand them over:
//!
//! 1. every client that joins advertises its keys and shares them with its neighbours (these
//!    stages need everyone, so a deployed client runs them before it trains);
//! 2. those that neither drop out nor miss the deadline train on the workers and send their
//!    quantised, masked updates in order of arrival;
//! 3. the survivors reveal the shares the engine asks for, and the engine publishes the
//!    unmasked sum: the survivors' FedAvg.
//!
//! A profile's dropouts therefore happen after the keys are shared, the protocol's hard case:
//! the engine reconstructs the masks the dropped clients agreed with their neighbours. A stage
//! that is still waiting for clients that left is closed through the engine
//! ([`Coordinator::expire_round`](crate::round::Coordinator::expire_round)), as its deadline
//! would close it in the field.

use std::collections::VecDeque;
use std::sync::Arc;

use hora_common::model::Model;
use hora_common::secagg::{ClientSession, Context, Identity, Quantiser};
use hora_common::simulation::{client_seed, Job};
use hora_common::wire::{self, SecAggOffer, SecAggReceipt};
use rand::{RngCore, SeedableRng};
use rand_chacha::{ChaCha12Rng, ChaCha20Rng};
use tokio::sync::oneshot;

use super::{client_id, off_runtime, Field, Traffic, ENGINE_WAIT};
use crate::error::ServerError;
use crate::round::Round;
use crate::secagg::{Outcome, SecAggRound, Stage};
use crate::simulation::workers::Answer;
use crate::simulation::SimulationError;
use crate::store::{ClientRecord, Store};

/// Domain tags of the seeds: clients' identity keys, and the stochastic rounding of updates.
const IDENTITIES: u64 = 0x5A3D_0005;
const ROUNDING: u64 = 0x5A3D_0006;

/// A client in the attempt: its protocol state and arrival.
struct Member {
    client: u64,
    session: ClientSession,
    /// When its update would arrive (simulated seconds into the round); None: it drops out
    /// after sharing its keys, or would miss the deadline.
    arrives_s: Option<f64>,
    offer: wire::RoundOffer,
}

impl Field<'_> {
    /// One attempt of a secure-aggregation round (see the module).
    pub(super) async fn secure_round(
        &mut self,
        round: Arc<Round>,
        on_row: &mut (dyn FnMut(&super::Row) + Send),
    ) -> Result<(), SimulationError> {
        let (number, attempt) = (round.number, round.attempt);
        let candidates = self.candidates(&round).await?;
        self.enrol(candidates.iter().map(|c| c.0).collect()).await?;
        let mut traffic = Traffic::default();
        let mut members = Vec::new();
        for s in self.select(&round, candidates, &mut traffic).await? {
            let ctx = Context::new(&self.task.id, number, attempt);
            let arrives = !s.drops_out && s.examples > 0 && s.took_s <= self.deadline_s;
            members.push(Member {
                client: s.client,
                session: ClientSession::new(ctx, &client_id(s.client)).map_err(secagg)?,
                arrives_s: arrives.then_some(s.took_s),
                offer: s.offer,
            });
        }
        let offer = members
            .first()
            .and_then(|m| m.offer.secure_aggregation.clone());
        let took = match offer {
            Some(offer) => self.stages(&round, members, &offer, &mut traffic).await?,
            None => {
                // Nobody joined: the deadline passes on an empty round.
                self.expire(&round).await?;
                self.deadline_s
            }
        };
        self.attempt_ended(number, attempt, took, traffic, on_row)
            .await
    }

    /// The four stages for `members`; how long the round took (simulated seconds).
    async fn stages(
        &mut self,
        round: &Arc<Round>,
        members: Vec<Member>,
        offer: &SecAggOffer,
        traffic: &mut Traffic,
    ) -> Result<f64, SimulationError> {
        let s = round.collection.secure_aggregation(&self.task.id)?;
        let seed = self.sim.seed;
        // Stage 0: keys.
        let members = self
            .each(members, move |s, store, m| {
                let identity = identity(seed, m.client)?;
                let keys = m.session.advertise(&identity);
                s.advertise(store, &client_id(m.client), &hex_key(&identity), keys)
            })
            .await?;
        if !self.closed(round, &s, Stage::Advertise).await? {
            return Ok(self.deadline_s);
        }
        // Stage 1: shares, to each client's neighbours.
        let members = self
            .each(members, |s, store, m| {
                let id = client_id(m.client);
                let roster = s.roster(&id)?.ok_or_else(|| not_ready("roster"))?;
                let bundles = m.session.share_keys(&roster).map_err(secagg)?;
                s.share(store, &id, bundles)
            })
            .await?;
        if !self.closed(round, &s, Stage::ShareKeys).await? {
            return Ok(self.deadline_s);
        }
        // Stage 2: training, then masked inputs in order of arrival.
        self.prepare(round.base).await?;
        let shared = members.len();
        let mut arriving: Vec<Member> = members
            .into_iter()
            .filter(|m| m.arrives_s.is_some())
            .collect();
        arriving.sort_by(|a, b| {
            let (x, y) = (a.arrives_s.unwrap_or(0.0), b.arrives_s.unwrap_or(0.0));
            x.total_cmp(&y).then(a.client.cmp(&b.client))
        });
        let (mut survivors, mut last_s) = (Vec::new(), 0.0_f64);
        let window = 2 * self.sim.workers.max(1);
        let mut flying = VecDeque::new();
        let mut planned = arriving.into_iter();
        loop {
            while flying.len() < window {
                let Some(m) = planned.next() else { break };
                let answer = self.train(m.client, &m.offer);
                let evaluation = self.carried_evaluation(&m, offer);
                flying.push_back((m, answer, evaluation));
            }
            let Some((m, answer, evaluation)) = flying.pop_front() else {
                break;
            };
            let at = m.arrives_s.unwrap_or(0.0);
            let sent = self.masked(&s, m, offer, answer, evaluation, traffic);
            if let Some(m) = sent.await? {
                last_s = last_s.max(at);
                survivors.push(m);
            }
        }
        let everyone = survivors.len() == shared;
        // (As the plain path counts them: every update the engine took.)
        self.updates += survivors.len() as u64;
        if !self.closed(round, &s, Stage::MaskedInput).await? {
            return Ok(self.deadline_s);
        }
        // Stage 3: the survivors reveal what unmasking needs; the last answer publishes.
        let answered = self
            .each(survivors, |s, store, m| {
                let id = client_id(m.client);
                let request = s.unmask_request(&id)?.ok_or_else(|| not_ready("unmask"))?;
                let answer = m.session.unmask(&request).map_err(secagg)?;
                s.unmask(store, &id, answer)
            })
            .await?;
        self.closed(round, &s, Stage::Unmask).await?;
        tracing::debug!(
            answered = answered.len(),
            "the survivors revealed their shares"
        );
        Ok(if everyone { last_s } else { self.deadline_s })
    }

    /// Registers the identity keys of `clients` that have none yet, as enrolment does.
    async fn enrol(&self, clients: Vec<u64>) -> Result<(), SimulationError> {
        let (store, seed) = (self.store.clone(), self.sim.seed);
        off_runtime(move || {
            for client in clients {
                let key = hex_key(&identity(seed, client)?);
                let id = client_id(client);
                let known = store.update_client(&id, &mut |c| {
                    c.identity_key.get_or_insert_with(|| key.clone());
                })?;
                if known.is_none() {
                    store.put_client(&id, &enrolled(key))?;
                }
            }
            Ok(())
        })
        .await
    }

    /// Sends each member's message of a stage (`message` makes it and hands it to the stage, as
    /// the API's handler does) and acts on what it did; the members the engine took.
    async fn each<F>(
        &self,
        members: Vec<Member>,
        message: F,
    ) -> Result<Vec<Member>, SimulationError>
    where
        F: Fn(&SecAggRound, &Store, &mut Member) -> Result<(SecAggReceipt, Outcome), ServerError>
            + Send
            + 'static,
    {
        let (coordinator, task) = (self.coordinator.clone(), self.task.clone());
        off_runtime(move || {
            let mut kept = Vec::with_capacity(members.len());
            for mut m in members {
                let id = client_id(m.client);
                let (number, attempt) = (m.offer.round, m.offer.attempt);
                let (round, s) = match coordinator.secagg_round(&task, &id, number, attempt) {
                    Ok(found) => found,
                    Err(e) if left(&e) => continue, // the attempt ended, or went on without it
                    Err(e) => return Err(e.into()),
                };
                match message(&s, coordinator.store(), &mut m) {
                    Ok((_, outcome)) => {
                        coordinator.secagg_outcome(&task, &round, outcome)?;
                        kept.push(m);
                    }
                    // Left out of the stage (too few neighbours, the stage moved on): this
                    // client's part in the attempt is over, as a deployed one's would be.
                    Err(e) if left(&e) => {
                        tracing::debug!(client = m.client, error = %e, "a virtual client left the secure-aggregation attempt");
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            Ok(kept)
        })
        .await
    }

    /// Quantises and masks `m`'s trained update and sends it; `m` if the engine took it.
    async fn masked(
        &mut self,
        s: &Arc<SecAggRound>,
        m: Member,
        offer: &SecAggOffer,
        answer: oneshot::Receiver<Answer>,
        evaluation: Option<(oneshot::Receiver<Answer>, Job)>,
        traffic: &mut Traffic,
    ) -> Result<Option<Member>, SimulationError> {
        let (round, client) = (m.offer.round, m.client);
        let Some((num_examples, _, payload)) = self.trained(client, round, answer, traffic).await?
        else {
            return Ok(None);
        };
        let report = match evaluation {
            Some((rx, job)) => self.evaluation_report(client, job, rx).await?,
            None => None,
        };
        // (No compression under secure aggregation: the update is the delta's float32s.)
        let delta = Model::from_safetensors(&payload, &Default::default())
            .map_err(|e| SimulationError::Workers(format!("client {client}'s update: {e}")))?;
        let quantiser = Quantiser::offered(offer);
        quantiser.check(1).map_err(secagg)?;
        let nonce = round << 16 | u64::from(offer.attempt);
        let mut rng =
            ChaCha20Rng::seed_from_u64(client_seed(self.sim.seed ^ ROUNDING, client, nonce));
        let input = quantiser.input(offer, delta.data(), num_examples, report.as_ref(), &mut rng);
        drop(delta);
        let kept = self
            .each(vec![m], move |s, store, m| {
                let id = client_id(m.client);
                let inbox = s.inbox(&id)?.ok_or_else(|| not_ready("inbox"))?;
                let masked = m.session.masked_input(&inbox, &input).map_err(secagg)?;
                let bytes: Vec<u8> = masked.iter().flat_map(|v| v.to_le_bytes()).collect();
                s.masked(store, &id, &bytes)
            })
            .await?;
        if !kept.is_empty() {
            self.failing = 0;
            traffic.taken += 1;
            traffic.bytes_up += s.masked_len();
        }
        Ok(kept.into_iter().next())
    }

    /// Closes the stage `round` is in through the engine (off the runtime: it takes the stage's
    /// lock, which is held across store writes).
    async fn expire(&self, round: &Arc<Round>) -> Result<(), SimulationError> {
        let (coordinator, task, round) =
            (self.coordinator.clone(), self.task.clone(), round.clone());
        off_runtime(move || {
            coordinator.expire_round(&task, &round);
            Ok(())
        })
        .await
    }

    /// When the round carries federated evaluation: `m`'s evaluation of the model it trains
    /// from, asked of the workers beside its training (it goes into its masked input, as a
    /// deployed client's does).
    fn carried_evaluation(
        &self,
        m: &Member,
        offer: &SecAggOffer,
    ) -> Option<(oneshot::Receiver<Answer>, Job)> {
        offer.evaluation.and_then(|e| e.round)?;
        let job = Job::Evaluate {
            model: m.offer.model,
            frozen_base: m.offer.frozen_base,
            model_kind: m.offer.model_kind.clone(),
            clients: vec![m.client],
        };
        Some((self.pool.submit(job.clone()), job))
    }

    /// Waits for `stage` to close, closing it through the engine if clients it waits for have
    /// left; whether the attempt goes on.
    async fn closed(
        &self,
        round: &Arc<Round>,
        s: &Arc<SecAggRound>,
        stage: Stage,
    ) -> Result<bool, SimulationError> {
        let mut changes = s.changed.subscribe();
        let mut moved = self.task.subscribe();
        let current = |me: &Self| me.task.current().is_some_and(|r| Arc::ptr_eq(&r, round));
        if s.stage_now() == stage && current(self) {
            self.expire(round).await?;
        }
        let waited = tokio::time::timeout(ENGINE_WAIT, async {
            while s.stage_now() == stage && current(self) {
                tokio::select! {
                    _ = changes.changed() => {}
                    _ = moved.changed() => {}
                }
            }
        });
        waited.await.map_err(|_| {
            SimulationError::Setup(format!(
                "the engine did not close the {stage:?} stage within {} s",
                ENGINE_WAIT.as_secs()
            ))
        })?;
        Ok(current(self) && s.stage_now() != Stage::Ended)
    }
}

/// Client `client`'s identity key, made from the simulation's seed.
fn identity(seed: u64, client: u64) -> Result<Identity, ServerError> {
    let mut secret = [0u8; 32];
    ChaCha12Rng::seed_from_u64(client_seed(seed ^ IDENTITIES, client, 0)).fill_bytes(&mut secret);
    Identity::from_seed(&secret).map_err(ServerError::internal)
}

fn hex_key(identity: &Identity) -> String {
    hex::encode(identity.public_key())
}

/// A virtual client's record, as enrolment leaves it (it authenticates to nothing: nothing
/// crosses a network).
fn enrolled(identity_key: String) -> ClientRecord {
    ClientRecord {
        secret_hash: String::new(),
        label: None,
        enrolled_unix_ms: 0,
        revoked: false,
        identity_key: Some(identity_key),
        tasks: None,
        aggregator: false,
        max_contributors: None,
        strikes: 0,
        quarantined: None,
    }
}

/// A refusal that ends a client's part in the attempt (left out of a stage, the attempt over,
/// or its own session refusing to go on), as it ends a deployed client's; anything else is a
/// fault of the simulation's.
fn left(e: &ServerError) -> bool {
    matches!(e, ServerError::Conflict { .. })
}

/// A client-side refusal: the client leaves the attempt, as a deployed one does.
fn secagg(e: hora_common::secagg::SecAggError) -> ServerError {
    ServerError::conflict(
        wire::ErrorCode::InvalidSecaggMessage,
        format!("a virtual client left the attempt: {e}"),
    )
}

/// A stage's answer that is not there although the stage has closed.
fn not_ready(what: &str) -> ServerError {
    ServerError::internal(format!(
        "the secure-aggregation {what} was not ready after its stage closed"
    ))
}
