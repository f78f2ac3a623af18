//! The stable codes of [`ApiError`](super::ApiError), as one type the server answers with and the
//! client matches on, so a renamed or misspelt code is a compile error rather than a refusal that
//! silently stops being recognised.
//!
//! On the wire a code is its snake_case name (`RoundClosed` is `"round_closed"`). A code this
//! build does not know, from a newer server, parses as [`ErrorCode::Other`] with its text: an
//! older client reads the answer and treats it as a refusal it has no special handling for.
//!
//! Which HTTP status each code answers with is the server's business (`hora-server`'s
//! `api::error`); what a code means, and what a client should do about it, is written here.

use std::borrow::Cow;
use std::fmt;

use serde::{Deserialize, Serialize};
use utoipa::openapi::schema::{ObjectBuilder, Schema, Type};
use utoipa::openapi::RefOr;
use utoipa::{PartialSchema, ToSchema};

/// Declares [`ErrorCode`] once: each variant with its wire string and its documentation, and
/// [`ErrorCode::KNOWN`], the list the OpenAPI document and the tests read, so neither can miss one.
macro_rules! error_codes {
    ($( $(#[doc = $doc:literal])+ $variant:ident => $code:literal, )+) => {
        /// The machine-readable reason of a refusal, the `code` of [`ApiError`](super::ApiError).
        #[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
        #[serde(rename_all = "snake_case")]
        pub enum ErrorCode {
            $( $(#[doc = $doc])+ $variant, )+
            /// A code this build does not know (a newer server's), kept as the server wrote it.
            /// Treat it as a refusal with no special meaning: report the message.
            #[serde(untagged)]
            Other(String),
        }

        impl ErrorCode {
            /// Every code this build knows, in declaration order ([`ErrorCode::Other`] aside).
            pub const KNOWN: &'static [ErrorCode] = &[$(ErrorCode::$variant),+];

            /// The code as it travels on the wire.
            pub fn as_str(&self) -> &str {
                match self {
                    $(ErrorCode::$variant => $code,)+
                    ErrorCode::Other(code) => code,
                }
            }
        }
    };
}

error_codes! {
    // Malformed requests and bad credentials, answered on every route.

    /// The request is malformed: its body, path, query or a header does not parse, or a value is
    /// out of range. A bug or a version mismatch on the caller's side: do not retry as is.
    BadRequest => "bad_request",
    /// The update's envelope, tensor names, shapes, dtypes or values are not what the task takes.
    /// Do not retry the same update; check the model matches the task's.
    InvalidUpdate => "invalid_update",
    /// No `Authorization: Bearer <token>` header, or an empty one. Send the credentials.
    MissingCredentials => "missing_credentials",
    /// The credentials are unknown, wrong, expired or revoked. Enrol again with a fresh token.
    Unauthorized => "unauthorized",
    /// The credentials are valid but not for this API (a client token on the admin API).
    Forbidden => "forbidden",
    /// The server quarantined this client after repeated refused updates (not finite, out of
    /// bounds, malformed): it is refused everything until the operator releases it
    /// (`POST /admin/v1/clients/{id}/release`). Find out why its updates were refused first.
    Quarantined => "quarantined",
    /// No such task, round model, module, sync job or route, or a task the client's enrolment
    /// does not allow. Check the id.
    NotFound => "not_found",
    /// A known path asked with a method it does not serve; the `Allow` header lists those it does.
    MethodNotAllowed => "method_not_allowed",
    /// The body is longer than the route's limit (`Content-Length` or the bytes read). Do not
    /// retry the same body.
    PayloadTooLarge => "payload_too_large",
    /// An upload without a `Content-Length` header. Send one.
    LengthRequired => "length_required",
    /// The upload's body arrived below the server's minimum rate. Check the connection; retry.
    UploadTooSlow => "upload_too_slow",
    /// The same client already has an upload to this task in flight. Wait for its answer rather
    /// than sending a second copy.
    UploadInProgress => "upload_in_progress",
    /// The server holds no chunked upload of this update (it completed, expired, or the server
    /// restarted). Start it again with `POST …/uploads`.
    UploadUnknown => "upload_unknown",
    /// A chunk other than the one the upload session expects next (replayed, reordered or
    /// skipped). Ask `POST …/uploads` where the upload stands and go on from its `next_chunk`.
    ChunkOutOfOrder => "chunk_out_of_order",

    // The server's own state: worth retrying.

    /// The request took longer than the server's limit. Retry later.
    RequestTimeout => "request_timeout",
    /// The server's memory budget for bodies stayed full for as long as a request may wait for
    /// it (slow senders hold it), or another body too large to share it was being read. Retry
    /// after the `Retry-After` header's seconds, or later.
    Busy => "busy",
    /// Too many requests from the caller's address are in flight before their credentials were
    /// checked (answered 429). Retry after the `Retry-After` header's seconds.
    TooManyRequests => "too_many_requests",
    /// The server is shutting down. Retry the same request (an upload gets its receipt then).
    ShuttingDown => "shutting_down",
    /// This server is a standby replica: another replica of the deployment leads and serves.
    /// Send the request to another of its servers (a client given several moves on by itself),
    /// or retry after the `Retry-After` header's seconds, by when this one may lead.
    Standby => "standby",
    /// The update (or a join's selection) was accepted but is not durable yet (storage is slow).
    /// Retry the same upload to get its receipt, or the same join to get its offer; neither is
    /// counted twice.
    NotDurableYet => "not_durable_yet",
    /// The server cannot reach its database (PostgreSQL, for a server that keeps its records
    /// there) right now. Retry after the `Retry-After` header's seconds, or later.
    StoreUnavailable => "store_unavailable",
    /// The task's stored state is damaged, so the server cannot serve it. The operator has the
    /// detail in the server log; retrying does not help until they act.
    TaskUnavailable => "task_unavailable",
    /// Something the server got wrong. The message carries only a reference the operator finds in
    /// the server log.
    Internal => "internal",

    // Tasks and rounds.

    /// A task with this id exists already (admin). Pick another id.
    TaskExists => "task_exists",
    /// The task is stopped or finished: nothing more to do for it.
    TaskEnded => "task_ended",
    /// The round asked about is over or closing, or no round is open. Poll for the next one.
    RoundClosed => "round_closed",
    /// A round or attempt number ahead of the open one. Poll for the open round.
    WrongRound => "wrong_round",
    /// The round's attempt was abandoned (too few updates by the deadline, a shutdown). Poll and
    /// join the retry; the update of the abandoned attempt will not count.
    RoundAbandoned => "round_abandoned",
    /// The client is not among the round's selected participants. Wait for the next round.
    NotSelected => "not_selected",
    /// The client has already contributed to this round (or attempt). Nothing to resend; wait for
    /// the next round.
    AlreadyContributed => "already_contributed",
    /// An asynchronous task's update trained from a version more than the task's
    /// `max_staleness` behind the current one. Pull the current model and train again.
    TooStale => "too_stale",
    /// The update's L2 norm is over the task's bound and the task refuses, rather than clips,
    /// such updates. Clip the update or lower the learning rate.
    UpdateNormExceeded => "update_norm_exceeded",
    /// The round's model was removed by the server's retention policy. Ask for a later round.
    ModelPruned => "model_pruned",
    /// The evaluation reported on has ended (it had its reports, its deadline passed, or the
    /// next one began), or was never asked for. Nothing to resend; poll.
    EvaluationClosed => "evaluation_closed",

    // Secure aggregation.

    /// A sealed upload to a task that uses secure aggregation: send the update through the
    /// task's secure-aggregation stages instead.
    SecureAggregation => "secure_aggregation",
    /// A secure-aggregation message to a task that does not use it. Upload a sealed update.
    NotSecureAggregation => "not_secure_aggregation",
    /// Secure aggregation needs an identity key registered at enrolment, and this client has
    /// none. Enrol again with a current client.
    NoIdentityKey => "no_identity_key",
    /// The message belongs to a stage of the attempt that is closed (or not yet open). This
    /// attempt is over for the client; poll for what comes next.
    StageClosed => "stage_closed",
    /// The client missed a stage of this attempt and is no longer part of it. Poll for the next
    /// round or the retry.
    DroppedOut => "dropped_out",
    /// The client has already advertised other keys for this attempt. A retry of the same keys
    /// is acknowledged; a different set is refused.
    AlreadyAdvertised => "already_advertised",
    /// The client has already sent other share bundles for this attempt.
    AlreadyShared => "already_shared",
    /// The client has already revealed other shares for this attempt.
    AlreadyRevealed => "already_revealed",
    /// The advertised keys are not signed by the identity key registered at enrolment. A bug or
    /// a mismatched state directory; do not retry as is.
    BadSignature => "bad_signature",
    /// A secure-aggregation message that is forged or misdirected.
    ForgedMessage => "forged_message",
    /// A key that is a low-order point, which would make the shared secret predictable.
    LowOrderKey => "low_order_key",
    /// Shares addressed to a client that is not a neighbour of the sender in this attempt.
    NotANeighbour => "not_a_neighbour",
    /// A secure-aggregation message that is malformed, repeated or incomplete.
    InvalidSecaggMessage => "invalid_secagg_message",
    /// A masked input whose length is not the task's.
    ShapeMismatch => "shape_mismatch",

    // Sync jobs (the rendezvous of distributed workers).

    /// A sync job with this id exists already (admin). Delete it first or pick another id.
    SyncJobExists => "sync_job_exists",
    /// The world size the worker was started with is not the job's. Fix the worker's settings.
    WorldSizeMismatch => "world_size_mismatch",
    /// The rank asked for is not below the job's world size.
    RankOutOfRange => "rank_out_of_range",
    /// The rank asked for was given to a worker that joined without one. Give every worker of a
    /// job its rank, or none.
    RankTaken => "rank_taken",
    /// The worker's address is not a `host:port` its ring neighbour can connect to.
    InvalidAddress => "invalid_address",
    /// A newer worker joined this rank; this one should stop.
    Replaced => "replaced",
    /// The world was still incomplete at the rendezvous timeout; the message names the ranks
    /// that did not join. Start the missing workers and join again.
    RendezvousTimeout => "rendezvous_timeout",
    /// The sync job was deleted while this worker waited: nothing to join any more.
    JobDeleted => "job_deleted",
    /// The job's training finished (its workers said so): there is no world to join. A worker
    /// started late, or retried by its launcher after the others finished, has nothing to do.
    JobFinished => "job_finished",
}

impl ErrorCode {
    /// A code from its wire string: a known one, or [`ErrorCode::Other`].
    pub fn parse(code: &str) -> ErrorCode {
        ErrorCode::KNOWN
            .iter()
            .find(|known| known.as_str() == code)
            .cloned()
            .unwrap_or_else(|| ErrorCode::Other(code.to_string()))
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A string whose documented values are the codes this build answers with. The schema does not
/// restrict the value to them: a client should expect codes a newer server adds.
impl PartialSchema for ErrorCode {
    fn schema() -> RefOr<Schema> {
        let known: Vec<&str> = ErrorCode::KNOWN.iter().map(ErrorCode::as_str).collect();
        ObjectBuilder::new()
            .schema_type(Type::String)
            .description(Some(format!(
                "A stable machine-readable reason; a client should treat a code it does not know \
                 as a refusal with no special meaning. This server answers with: {}.",
                known.join(", ")
            )))
            .examples(["round_closed"])
            .into()
    }
}

impl ToSchema for ErrorCode {
    fn name() -> Cow<'static, str> {
        Cow::Borrowed("ErrorCode")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `RoundClosed` → `round_closed`, as `rename_all = "snake_case"` spells it.
    fn snake_case(variant: &str) -> String {
        let mut out = String::new();
        for (i, c) in variant.chars().enumerate() {
            if c.is_ascii_uppercase() {
                if i > 0 {
                    out.push('_');
                }
                out.push(c.to_ascii_lowercase());
            } else {
                out.push(c);
            }
        }
        out
    }

    #[test]
    fn every_code_round_trips_through_json_as_its_snake_case_name() {
        assert!(ErrorCode::KNOWN.len() > 40, "is the list complete?");
        for code in ErrorCode::KNOWN {
            let wire = serde_json::to_string(code).unwrap();
            assert_eq!(wire, format!("\"{}\"", code.as_str()));
            assert_eq!(code.as_str(), snake_case(&format!("{code:?}")), "{code:?}");
            assert_eq!(serde_json::from_str::<ErrorCode>(&wire).unwrap(), *code);
            assert_eq!(ErrorCode::parse(code.as_str()), *code);
            assert_eq!(code.to_string(), code.as_str());
        }
    }

    #[test]
    fn the_known_codes_are_distinct() {
        let mut seen = std::collections::HashSet::new();
        for code in ErrorCode::KNOWN {
            assert!(seen.insert(code.as_str()), "{code} twice");
        }
    }

    #[test]
    fn an_unknown_code_parses_to_other_and_keeps_its_text() {
        let code: ErrorCode = serde_json::from_str("\"quota_exceeded\"").unwrap();
        assert_eq!(code, ErrorCode::Other("quota_exceeded".into()));
        assert_eq!(code.as_str(), "quota_exceeded");
        assert_eq!(serde_json::to_string(&code).unwrap(), "\"quota_exceeded\"");
        assert_eq!(
            ErrorCode::parse("quota_exceeded"),
            ErrorCode::Other("quota_exceeded".into())
        );
        assert!(serde_json::from_str::<ErrorCode>("17").is_err());
    }

    #[test]
    fn an_api_error_from_a_newer_server_still_parses() {
        let e: super::super::ApiError =
            serde_json::from_str(r#"{"code":"quota_exceeded","message":"later"}"#).unwrap();
        assert_eq!(e.code, ErrorCode::Other("quota_exceeded".into()));
        let e: super::super::ApiError =
            serde_json::from_str(r#"{"code":"round_closed","message":"no round is open"}"#)
                .unwrap();
        assert_eq!(e.code, ErrorCode::RoundClosed);
        assert_eq!(
            serde_json::to_string(&e).unwrap(),
            r#"{"code":"round_closed","message":"no round is open"}"#
        );
    }
}
