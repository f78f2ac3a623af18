//! The clients' messages of each stage: keys advertised, shares sent and fetched, masked
//! inputs folded into the sum, and unmask shares revealed. Each is durable before it is
//! acknowledged; an identical repeat is harmless, a different one for the same stage a 409.

use std::collections::BTreeSet;

use hora_common::secagg::client::check_advert;
use hora_common::secagg::{SecAggError, Unmasker};
use hora_common::wire::{
    ErrorCode, SecAggAdvertise, SecAggNeighbour, SecAggReceipt, SecAggRoster, SecAggSealedShares,
    SecAggShareBundles, SecAggUnmask, SecAggUnmaskRequest,
};

use super::*;

fn already_advertised(client: &str) -> String {
    format!("client `{client}` has already advertised other keys for this attempt")
}

fn already_shared(client: &str) -> String {
    format!("client `{client}` has already sent its shares for this attempt")
}

fn already_revealed(client: &str) -> String {
    format!("client `{client}` has already revealed its shares for this attempt")
}

impl SecAggRound {
    /// Stage 0: a selected client's signed keys, checked against its registered identity.
    pub fn advertise(
        &self,
        store: &Store,
        client: &str,
        identity_key: &str,
        keys: SecAggAdvertise,
    ) -> Result<(SecAggReceipt, Outcome), ServerError> {
        let identity =
            hex_array::<32>("identity_key", identity_key).map_err(ServerError::internal)?;
        check_advert(&self.ctx, client, &identity, &keys).map_err(|e| match e {
            SecAggError::Forged(_) => ServerError::Invalid {
                code: ErrorCode::BadSignature,
                message: format!(
                    "the advertised keys are not signed by the identity key `{client}` registered at enrolment"
                ),
            },
            e => secagg_error(e),
        })?;
        let mut inner = lock(&self.inner);
        self.require(store, &mut inner, Stage::Advertise)?;
        if let Some(existing) = inner.adverts.get(client) {
            return self.repeated(
                existing.keys == keys,
                inner.adverts.len(),
                ErrorCode::AlreadyAdvertised,
                already_advertised(client),
            );
        }
        let record = AdvertRecord {
            identity_key: identity_key.to_string(),
            keys,
        };
        self.record(store, &inner, "adv", client, &record, || {
            ServerError::conflict(ErrorCode::AlreadyAdvertised, already_advertised(client))
        })?;
        inner.adverts.insert(client.to_string(), record);
        let accepted = inner.adverts.len();
        // (Across replicas the leader does this when it counts the first advertisement.)
        if accepted == 1 && !self.follows() {
            self.first_advertised(store, &mut inner)?;
        }
        self.progress(store, &mut inner, accepted, self.capacity)
    }

    /// The attempt's first advertisement is in (here, or at another replica): the others have
    /// `stage_secs` from now.
    pub(super) fn first_advertised(
        &self,
        store: &Store,
        inner: &mut Inner,
    ) -> Result<(), ServerError> {
        inner.deadline_unix_ms = inner
            .deadline_unix_ms
            .min(now_ms() + self.config.stage_secs * 1000);
        self.save_state(store, inner)?;
        store.flush()?;
        self.changed.send_modify(|v| *v += 1);
        Ok(())
    }

    /// Stage 1, read side: the roster, once advertising has closed.
    pub fn roster(&self, client: &str) -> Result<Option<SecAggRoster>, ServerError> {
        let Some((inner, me)) = self.ready(client, Stage::Advertise)? else {
            return Ok(None);
        };
        let neighbours = inner.participants[me]
            .neighbours
            .iter()
            .map(|&n| {
                let p = &inner.participants[n];
                // (A replica that read the participants before another attempt cleared the
                // records may lack one: the attempt is over for this client then.)
                let advert = inner.adverts.get(&p.id).ok_or_else(|| {
                    ServerError::conflict(
                        ErrorCode::RoundAbandoned,
                        "this attempt has ended; poll for what comes next",
                    )
                })?;
                Ok(SecAggNeighbour {
                    client: p.id.clone(),
                    index: p.index,
                    identity_key: advert.identity_key.clone(),
                    keys: advert.keys.clone(),
                })
            })
            .collect::<Result<_, ServerError>>()?;
        Ok(Some(SecAggRoster {
            index: inner.participants[me].index,
            threshold: inner.threshold as u32,
            input_deadline_unix_ms: inner.input_deadline_unix_ms,
            neighbours,
        }))
    }

    /// Stage 1: a participant's encrypted shares, one bundle for each of its neighbours.
    pub fn share(
        &self,
        store: &Store,
        client: &str,
        bundles: SecAggShareBundles,
    ) -> Result<(SecAggReceipt, Outcome), ServerError> {
        let mut inner = lock(&self.inner);
        self.require(store, &mut inner, Stage::ShareKeys)?;
        let me = self.participant(&inner, client, "advertise")?;
        if let Some(existing) = inner.mail.get(client) {
            return self.repeated(
                *existing == bundles,
                inner.mail.len(),
                ErrorCode::AlreadyShared,
                already_shared(client),
            );
        }
        let neighbours: BTreeSet<&str> = inner.participants[me]
            .neighbours
            .iter()
            .map(|&n| inner.participants[n].id.as_str())
            .collect();
        let mut addressed = BTreeSet::new();
        for b in &bundles.shares {
            if !neighbours.contains(b.peer.as_str()) {
                return Err(ServerError::Invalid {
                    code: ErrorCode::NotANeighbour,
                    message: format!(
                        "shares addressed to `{}`, which is not a neighbour of `{client}` in this attempt",
                        b.peer
                    ),
                });
            }
            if !addressed.insert(b.peer.as_str())
                || b.ciphertext.len() > 4096
                || hex::decode(&b.ciphertext).is_err()
            {
                return Err(ServerError::Invalid {
                    code: ErrorCode::InvalidSecaggMessage,
                    message: format!(
                        "the bundle for `{}` is repeated, too long or not hex",
                        b.peer
                    ),
                });
            }
        }
        if addressed.len() != neighbours.len() {
            return Err(ServerError::Invalid {
                code: ErrorCode::InvalidSecaggMessage,
                message: format!(
                    "shares for {} of the {} neighbours: send one bundle to each",
                    addressed.len(),
                    neighbours.len()
                ),
            });
        }
        self.record(store, &inner, "mail", client, &bundles, || {
            ServerError::conflict(ErrorCode::AlreadyShared, already_shared(client))
        })?;
        inner.mail.insert(client.to_string(), bundles);
        let (accepted, expected) = (inner.mail.len(), inner.participants.len());
        self.progress(store, &mut inner, accepted, expected)
    }

    /// Stage 2, read side: the bundles addressed to `client` by neighbours that shared.
    pub fn inbox(&self, client: &str) -> Result<Option<SecAggShareBundles>, ServerError> {
        let Some((inner, me)) = self.ready(client, Stage::ShareKeys)? else {
            return Ok(None);
        };
        if !inner.shared.contains(&me) {
            return Err(dropped_out(client, "share-keys"));
        }
        let shares = inner.participants[me]
            .neighbours
            .iter()
            .filter(|n| inner.shared.contains(n))
            .filter_map(|&n| {
                let from = &inner.participants[n].id;
                inner
                    .mail
                    .get(from)?
                    .shares
                    .iter()
                    .find(|b| b.peer == client)
                    .map(|b| SecAggSealedShares {
                        peer: from.clone(),
                        ciphertext: b.ciphertext.clone(),
                    })
            })
            .collect();
        Ok(Some(SecAggShareBundles { shares }))
    }

    /// The byte length of a masked input.
    pub fn masked_len(&self) -> u64 {
        self.vector_len as u64 * 4
    }

    /// Stage 2: a masked input (little-endian u32s), folded into the sum and made durable.
    pub fn masked(
        &self,
        store: &Store,
        client: &str,
        body: &[u8],
    ) -> Result<(SecAggReceipt, Outcome), ServerError> {
        if body.len() as u64 != self.masked_len() {
            return Err(ServerError::Invalid {
                code: ErrorCode::ShapeMismatch,
                message: format!(
                    "a masked input of this task is {} bytes ({} values), not {}",
                    self.masked_len(),
                    self.vector_len,
                    body.len()
                ),
            });
        }
        let mut inner = lock(&self.inner);
        self.require(store, &mut inner, Stage::MaskedInput)?;
        let me = self.participant(&inner, client, "advertise")?;
        if !inner.shared.contains(&me) {
            return Err(dropped_out(client, "share-keys"));
        }
        if inner.survivors.contains(&me) {
            return Err(ServerError::conflict(
                ErrorCode::AlreadyContributed,
                format!("client `{client}` has already uploaded its masked input for this attempt"),
            ));
        }
        if self.sharing.is_some() {
            self.fold_shared(store, &mut inner, me, client, body)?;
            let (accepted, expected) = (inner.survivors.len(), inner.shared.len());
            return self.progress(store, &mut inner, accepted, expected);
        }
        inner.fold(body, self.vector_len, true);
        inner.survivors.insert(me);
        let old = inner.sum_file.clone();
        let saved = store
            .write_masked_sum(&inner.sum)
            .map_err(ServerError::from)
            .and_then(|file| {
                inner.sum_file = Some(file);
                self.save_state(store, &inner)?;
                store.flush().map_err(ServerError::from)
            });
        if let Err(e) = saved {
            // Not durable: take it back out; the client retries.
            inner.fold(body, self.vector_len, false);
            inner.survivors.remove(&me);
            // (Kept when the write may have committed, or another replica may have recorded the
            // same sum: see `StoreError::keeps_new_blobs`.)
            let keep = matches!(
                e.code(),
                hora_common::wire::ErrorCode::StoreUnavailable
                    | hora_common::wire::ErrorCode::ShuttingDown
            );
            if let Some(new) = inner
                .sum_file
                .take()
                .filter(|n| !keep && Some(n) != old.as_ref())
            {
                store.remove_checkpoint(&new);
            }
            inner.sum_file = old;
            return Err(e);
        }
        if let Some(old) = old.filter(|o| Some(o) != inner.sum_file.as_ref()) {
            store.remove_checkpoint(&old);
        }
        let (accepted, expected) = (inner.survivors.len(), inner.shared.len());
        self.progress(store, &mut inner, accepted, expected)
    }

    /// Stage 3, read side: which shares `client` is to reveal.
    pub fn unmask_request(&self, client: &str) -> Result<Option<SecAggUnmaskRequest>, ServerError> {
        let Some((inner, me)) = self.ready(client, Stage::MaskedInput)? else {
            return Ok(None);
        };
        if !inner.survivors.contains(&me) {
            return Err(dropped_out(client, "masked-input"));
        }
        Ok(Some(self.unmasker(&inner).request_for(me)))
    }

    pub(super) fn unmasker<'a>(&self, inner: &'a Inner) -> Unmasker<'a> {
        Unmasker::new(
            self.ctx.clone(),
            &inner.participants,
            inner.threshold,
            inner.shared.clone(),
            inner.survivors.clone(),
        )
    }

    /// Rebuilds the unmasker with every stored answer (they were all checked when they came).
    pub(super) fn unmasker_with_answers<'a>(
        &self,
        inner: &'a Inner,
    ) -> Result<Unmasker<'a>, ServerError> {
        let mut u = self.unmasker(inner);
        for (client, answer) in &inner.answers {
            let i = self.participant(inner, client, "masked-input")?;
            u.accept(i, answer).map_err(ServerError::internal)?;
        }
        Ok(u)
    }

    /// Stage 3: a survivor's revealed shares.
    pub fn unmask(
        &self,
        store: &Store,
        client: &str,
        answer: SecAggUnmask,
    ) -> Result<(SecAggReceipt, Outcome), ServerError> {
        let mut inner = lock(&self.inner);
        self.require(store, &mut inner, Stage::Unmask)?;
        let me = self.participant(&inner, client, "advertise")?;
        if let Some(existing) = inner.answers.get(client) {
            return self.repeated(
                *existing == answer,
                inner.answers.len(),
                ErrorCode::AlreadyRevealed,
                already_revealed(client),
            );
        }
        let mut u = self.unmasker_with_answers(&inner)?;
        u.accept(me, &answer).map_err(|e| match e {
            SecAggError::Stage(m) => ServerError::conflict(ErrorCode::DroppedOut, m),
            e => secagg_error(e),
        })?;
        drop(u);
        self.record(store, &inner, "unmask", client, &answer, || {
            ServerError::conflict(ErrorCode::AlreadyRevealed, already_revealed(client))
        })?;
        inner.answers.insert(client.to_string(), answer);
        // Only survivors answer: all have once there are as many answers as survivors.
        let (accepted, expected) = (inner.answers.len(), inner.survivors.len());
        self.progress(store, &mut inner, accepted, expected)
    }
}
