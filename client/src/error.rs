//! What can go wrong on a client, as types a program can match on and sentences a person can act
//! on. The server's 4xx answers are never retried blindly: each becomes a variant that says what
//! the server refused and what to do about it. Transient failures (connection errors, timeouts,
//! 5xx, 429) are retried by the transport; once the retry budget is spent they surface as
//! [`ClientError::Unavailable`] when the server never answered, or [`ClientError::Failing`] when
//! it answered with refusals, so the person reading knows which side to look at.

use std::path::PathBuf;

use hora_common::wire::{ApiError, ErrorCode};
use thiserror::Error;

use crate::data::DataError;
#[cfg(feature = "torch")]
use crate::device::DeviceError;

#[derive(Debug, Error)]
pub enum ClientError {
    /// 401/403: the credentials are missing, wrong or revoked, or the enrolment token is bad.
    #[error("the server refused our credentials ({status} {}): {}; {}", .error.code, .error.message,
        "enrol again with a fresh token from the operator (`hora-server admin enrol`), or check --state-dir")]
    Unauthorized { status: u16, error: ApiError },
    /// 404: the task (or its module) does not exist.
    #[error("not found on the server: {}; check the task id (`hora-server admin tasks` lists them)", .error.message)]
    NotFound { error: ApiError },
    /// 409: the round moved on, we were not selected, or we already contributed.
    #[error("the server refused the request as conflicting ({}): {}", .error.code, .error.message)]
    Conflict { error: ApiError },
    /// Any other 4xx: the request itself was wrong (a bug or a version mismatch).
    #[error("the server rejected the request ({status} {}): {}", .error.code, .error.message)]
    Rejected { status: u16, error: ApiError },
    /// No answer (no connection, or connections that broke off before an answer) for the whole
    /// retry budget.
    #[error("the server at {url} is unreachable: no answer in {attempts} attempts over {secs} s (last: {last}); check the URL, the network, and that the server is running")]
    Unavailable {
        url: String,
        attempts: u32,
        secs: u64,
        last: String,
    },
    /// The server answered, but only with a transient refusal (5xx, 429), for the whole retry
    /// budget: it is up and cannot serve the request.
    #[error("the server at {url} is up but kept refusing {what} ({attempts} attempts over {secs} s; last answer {status} {}: {}); the server's operator finds the cause in its logs and `/healthz`", .error.code, .error.message)]
    Failing {
        url: String,
        what: String,
        attempts: u32,
        secs: u64,
        status: u16,
        error: ApiError,
    },
    #[error("TLS setup: {0}")]
    Tls(#[from] hora_common::tls::TlsError),
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("client state in {}: {message}; move the directory aside to start afresh (the client will need a new enrolment token)", dir.display())]
    State { dir: PathBuf, message: String },
    #[error("the server sent an unusable answer: {0}")]
    Protocol(String),
    #[error("model: {0}")]
    Model(#[from] hora_common::model::ModelError),
    #[error("sealing the update: {0}")]
    Envelope(#[from] hora_common::envelope::EnvelopeError),
    #[error("compressing the update: {0}")]
    Codec(#[from] hora_common::codec::CodecError),
    #[error(transparent)]
    Data(#[from] DataError),
    #[cfg(feature = "torch")]
    #[error(transparent)]
    Device(#[from] DeviceError),
    #[error("training: {0}")]
    Training(String),
    /// The round moved on while we were fetching its model.
    #[error("the round moved on: {0}")]
    RoundMovedOn(String),
    /// The task stopped or finished: nothing more to do.
    #[error("task `{task}` is {state}")]
    TaskEnded { task: String, state: String },
    /// Secure aggregation refused what the server relayed (a forged key, a misdirected share, a
    /// request for both shares of one peer, a threshold below a majority).
    #[error("secure aggregation: {0}")]
    SecureAggregation(#[from] hora_common::secagg::SecAggError),
    /// The fault drill `drop_out_after` took this client out of the round.
    #[error("dropped out of the secure-aggregation round after the {0:?} stage (fault drill)")]
    DroppedOut(hora_common::secagg::Stage),
}

impl ClientError {
    /// The server's error code, for refusals.
    pub fn code(&self) -> Option<&ErrorCode> {
        match self {
            ClientError::Unauthorized { error, .. }
            | ClientError::NotFound { error }
            | ClientError::Conflict { error }
            | ClientError::Rejected { error, .. }
            | ClientError::Failing { error, .. } => Some(&error.code),
            _ => None,
        }
    }

    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ClientError::Io {
            path: path.into(),
            source,
        }
    }
}

#[cfg(feature = "torch")]
impl From<tch::TchError> for ClientError {
    fn from(e: tch::TchError) -> Self {
        ClientError::Training(format!("libtorch: {e}"))
    }
}

pub type Result<T, E = ClientError> = std::result::Result<T, E>;
