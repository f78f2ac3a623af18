//! A client's part in a secure-aggregation round (see `hora_common::secagg`): the four stages
//! around local training, over the `/v1/tasks/{task}/secagg/{round}/{attempt}/…` routes.
//!
//! Advertising and sharing keys come first (they need every participant, so they should not
//! wait for training), then the client trains, quantises its weighted delta, masks it and
//! uploads it, and finally reveals the shares the server asks for. The secrets live only in
//! this process's memory: a client that restarts mid-round has dropped out of that attempt,
//! which the protocol tolerates.

use std::time::{Duration, Instant};

use hora_common::secagg::{ClientSession, Context, Quantiser, Stage};
use hora_common::wire::{
    DeadlinePolicy, ErrorCode, Metrics, RoundOffer, SecAggOffer, SecAggReceipt, SecAggRoster,
    SecAggShareBundles, SecAggUnmaskRequest,
};
use rand_chacha::rand_core::SeedableRng;
use reqwest::{Method, StatusCode};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::client::{
    evaluation_report, now_ms, now_unix_us, receipt, train_until, Client, RoundOutcome,
    RoundReport, RoundTimings,
};
use crate::error::{ClientError, Result};
use crate::trainer::{EvaluateRequest, Progress, Trainer};
use crate::transport::check;

/// Server refusals that mean this attempt is over for us, not that something is broken.
fn attempt_over(e: &ClientError) -> Option<RoundOutcome> {
    let code = e.code()?;
    let reason = match e {
        ClientError::Conflict { error } => error.message.clone(),
        _ => return None,
    };
    match code {
        ErrorCode::RoundAbandoned => Some(RoundOutcome::Abandoned { reason }),
        ErrorCode::RoundClosed
        | ErrorCode::DroppedOut
        | ErrorCode::StageClosed
        | ErrorCode::NotSelected
        | ErrorCode::AlreadyAdvertised
        | ErrorCode::AlreadyShared
        | ErrorCode::AlreadyRevealed => Some(RoundOutcome::Missed { reason }),
        _ => None,
    }
}

impl Client {
    fn drill(&self, completed: Stage) -> Result<()> {
        if self.config.drop_out_after == Some(completed) {
            tracing::warn!(stage = ?completed, "fault drill: dropping out of the round");
            return Err(ClientError::DroppedOut(completed));
        }
        Ok(())
    }

    async fn post<T: Serialize>(&self, what: &str, path: &str, body: &T) -> Result<SecAggReceipt> {
        self.conn
            .json(what, || {
                self.conn
                    .request(Method::POST, path, Duration::ZERO)
                    .json(body)
            })
            .await
    }

    /// Long-polls `path` until the stage it waits for has closed (the server answers 204 while
    /// it has not), or `deadline` passes.
    async fn wait<T: DeserializeOwned>(&self, what: &str, path: &str, deadline: u64) -> Result<T> {
        loop {
            let wait = self.config.poll_wait.min(Duration::from_secs(30));
            let url = format!("{path}?wait_ms={}", wait.as_millis());
            let (resp, _) = self
                .conn
                .send(what, || self.conn.request(Method::GET, &url, wait))
                .await?;
            let resp = check(resp).await?;
            if resp.status() == StatusCode::NO_CONTENT {
                // Stages close by their deadlines at the latest; allow the server a minute's
                // slack past the last one before giving up on it.
                if now_ms() > deadline + 60_000 {
                    return Err(ClientError::Protocol(format!(
                        "{what}: the stage is still open long after its deadline"
                    )));
                }
                continue;
            }
            let bytes = resp
                .bytes()
                .await
                .map_err(|e| ClientError::Protocol(format!("{what}: reading the answer: {e}")))?;
            return serde_json::from_slice(&bytes)
                .map_err(|e| ClientError::Protocol(format!("{what}: decoding the answer: {e}")));
        }
    }

    /// Trains and takes part in the secure aggregation of the round `offer` describes.
    pub(crate) async fn contribute_secure<T: Trainer + ?Sized>(
        &self,
        task: &str,
        offer: &RoundOffer,
        secure: &SecAggOffer,
        trainer: &mut T,
        progress: &mut (dyn FnMut(Progress) + Send),
    ) -> Result<RoundReport> {
        let started = Instant::now();
        let mut report = RoundReport {
            round: offer.round,
            attempt: offer.attempt,
            outcome: RoundOutcome::Skipped,
            num_examples: 0,
            metrics: Metrics::default(),
            train_time: Duration::ZERO,
            timings: RoundTimings::default(),
        };
        let result = self
            .secure_stages(task, offer, secure, trainer, progress, &mut report)
            .await;
        report.train_time = started.elapsed();
        let t = &mut report.timings;
        t.upload = report
            .train_time
            .saturating_sub(t.download + t.train + t.record);
        if matches!(result, Ok(RoundOutcome::Uploaded { .. })) {
            t.acked_unix_us = now_unix_us();
        }
        match result {
            Ok(outcome) => report.outcome = outcome,
            Err(ClientError::RoundMovedOn(reason)) => {
                report.outcome = RoundOutcome::Missed { reason }
            }
            // Too few neighbours left to mask or unmask safely: this attempt goes on (or is
            // abandoned and retried) without us.
            Err(ClientError::SecureAggregation(
                e @ hora_common::secagg::SecAggError::Threshold(_),
            )) => {
                tracing::warn!(round = offer.round, error = %e, "leaving the secure-aggregation attempt");
                report.outcome = RoundOutcome::Abandoned {
                    reason: e.to_string(),
                };
            }
            // A forged or misdirected message: refuse to go on with this attempt, loudly, but
            // do not let one misbehaving peer stop this client for good.
            Err(ClientError::SecureAggregation(e)) => {
                tracing::error!(round = offer.round, error = %e, "leaving the secure-aggregation attempt: a relayed message failed its checks");
                report.outcome = RoundOutcome::Missed {
                    reason: e.to_string(),
                };
            }
            Err(e) => match attempt_over(&e) {
                Some(outcome) => report.outcome = outcome,
                None => return Err(e),
            },
        }
        Ok(report)
    }

    async fn secure_stages<T: Trainer + ?Sized>(
        &self,
        task: &str,
        offer: &RoundOffer,
        secure: &SecAggOffer,
        trainer: &mut T,
        progress: &mut (dyn FnMut(Progress) + Send),
        report: &mut RoundReport,
    ) -> Result<RoundOutcome> {
        let identity = self.state.identity()?.ok_or_else(|| ClientError::State {
            dir: self.config.state_dir.clone(),
            message: "has no identity key, which secure aggregation needs: enrol this client again with a new token".into(),
        })?;
        let quantiser = Quantiser::offered(secure);
        quantiser.check(1)?;
        let downloading = Instant::now();
        let (start, module) = self.round_inputs(task, offer).await?;
        report.timings.download = downloading.elapsed();
        // Federated evaluation of the model this round trains from, when the task asks, before
        // the stages' deadlines run: it travels in the masked input, so the server learns only
        // the sum of the evaluations. One that fails is left out (zeros), never the round.
        let evaluation = match secure.evaluation.and_then(|e| e.round) {
            Some(evaluated) => {
                let request = EvaluateRequest {
                    task,
                    round: evaluated,
                    model_kind: &offer.model_kind,
                    module: module.clone(),
                };
                match evaluation_report(trainer, start.model(), request) {
                    Ok(report) => report,
                    Err(e) => {
                        tracing::warn!(round = evaluated, error = %e, "federated evaluation of the round's model failed; contributing without it");
                        None
                    }
                }
            }
            None => None,
        };

        let base = format!("/v1/tasks/{task}/secagg/{}/{}", offer.round, secure.attempt);
        let mut deadline = offer.deadline_unix_ms;
        let mut session =
            ClientSession::new(Context::new(task, offer.round, secure.attempt), &self.id)?;

        // Stage 0 and 1: keys and shares, before training.
        self.post(
            "advertising keys",
            &format!("{base}/advertise"),
            &session.advertise(&identity),
        )
        .await?;
        self.drill(Stage::Advertised)?;
        let roster: SecAggRoster = self
            .wait(
                "waiting for the neighbours",
                &format!("{base}/neighbours"),
                deadline,
            )
            .await?;
        deadline = roster.input_deadline_unix_ms;
        let bundles = session.share_keys(&roster)?;
        self.post("sending shares", &format!("{base}/shares"), &bundles)
            .await?;
        tracing::info!(
            round = offer.round,
            attempt = secure.attempt,
            neighbours = roster.neighbours.len(),
            threshold = roster.threshold,
            "secure aggregation: keys shared"
        );
        self.drill(Stage::SharedKeys)?;

        // Training, until the masked inputs are due (less a margin for masking and upload).
        let training = Instant::now();
        let outcome = train_until(trainer, task, offer, &start, module, deadline, progress)?;
        report.timings.train = training.elapsed();
        if outcome.num_examples == 0
            || (outcome.stopped_early && offer.training.on_deadline == DeadlinePolicy::Skip)
        {
            tracing::warn!(round = offer.round, "no update to contribute before the deadline; leaving the round (the others unmask without us)");
            return Ok(RoundOutcome::Skipped);
        }
        let recording = Instant::now();
        let delta = start.delta(&outcome.weights)?;
        report.timings.record = recording.elapsed();
        report.num_examples = outcome.num_examples;
        report.metrics = outcome.metrics;
        let mut rng = rand_chacha::ChaCha20Rng::from_rng(&mut rand::rng());
        let input = quantiser.input(
            secure,
            delta.data(),
            outcome.num_examples,
            evaluation.as_ref(),
            &mut rng,
        );
        let clipped = delta
            .data()
            .iter()
            .filter(|v| f64::from(v.abs()) > quantiser.clip)
            .count();
        if clipped > 0 {
            tracing::warn!(
                clipped,
                clip = quantiser.clip,
                "delta coordinates were clipped for secure aggregation"
            );
        }

        // Stage 2: masked input.
        let inbox: SecAggShareBundles = self
            .wait(
                "waiting for the neighbours' shares",
                &format!("{base}/shares"),
                deadline,
            )
            .await?;
        let masked = session.masked_input(&inbox, &input)?;
        drop(input);
        let bytes: Vec<u8> = masked.iter().flat_map(|v| v.to_le_bytes()).collect();
        let path = format!("{base}/masked");
        let (resp, attempts) = self
            .conn
            .send("uploading the masked update", || {
                self.conn
                    .request(Method::POST, &path, Duration::ZERO)
                    .header(reqwest::header::CONTENT_TYPE, "application/octet-stream")
                    .body(bytes.clone())
            })
            .await?;
        // `None`: an earlier attempt got through and its acknowledgement was lost.
        let accepted = receipt::<SecAggReceipt>(resp, attempts)
            .await?
            .map_or(0, |r| r.accepted);
        tracing::info!(
            round = offer.round,
            accepted,
            "secure aggregation: masked update uploaded"
        );
        self.drill(Stage::MaskedInput)?;

        // Stage 3: unmask.
        let request: SecAggUnmaskRequest = self
            .wait(
                "waiting for the unmask request",
                &format!("{base}/unmask"),
                deadline,
            )
            .await?;
        let answer = session.unmask(&request)?;
        self.post("revealing shares", &format!("{base}/unmask"), &answer)
            .await?;
        tracing::info!(
            round = offer.round,
            survivors = request.survivors.len(),
            dropped = request.dropped.len(),
            "secure aggregation: shares revealed"
        );
        Ok(RoundOutcome::Uploaded {
            accepted: (accepted > 0).then_some(accepted),
        })
    }
}
