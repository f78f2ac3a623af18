//! Every refusal the server makes, as one type: what went wrong, with the stable code clients
//! match on ([`ErrorCode`]) and a message for people. Handlers return `Result<_, ServerError>`;
//! nothing from outside can make the server panic.
//!
//! This is the domain's word on a refusal, not HTTP's: which status each variant answers with,
//! and how it renders as `hora_common::wire::ApiError` JSON, is decided in one place, `api::error`.

use hora_common::wire::ErrorCode;

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("{0}")]
    BadRequest(String),
    /// A malformed request whose cause has its own stable code (for example
    /// [`ErrorCode::WorldSizeMismatch`]), so a client can tell a misconfiguration from a malformed
    /// request without parsing the message.
    #[error("{message}")]
    Invalid { code: ErrorCode, message: String },
    #[error("{0}")]
    InvalidUpdate(String),
    #[error("missing or malformed credentials: send `Authorization: Bearer <token>`")]
    MissingCredentials,
    #[error("{0}")]
    Unauthorized(String),
    #[error("{0}")]
    Forbidden(String),
    /// The client is quarantined (see [`crate::api::client`]'s strikes).
    #[error("{0}")]
    Quarantined(String),
    #[error("{0}")]
    NotFound(String),
    /// The thing existed but is gone for good (a sync job deleted while its workers waited).
    #[error("{message}")]
    Gone { code: ErrorCode, message: String },
    /// A held request (a rendezvous) waited as long as it was allowed to.
    #[error("{message}")]
    Timeout { code: ErrorCode, message: String },
    /// Wrong, closed or abandoned round; duplicate upload; task not running.
    #[error("{message}")]
    Conflict { code: ErrorCode, message: String },
    /// `hint`: what the refusal adds (empty, or `: ` and why a body may be this large).
    #[error("body of {got} bytes exceeds the limit of {limit} bytes for this route{hint}")]
    PayloadTooLarge {
        got: u64,
        limit: u64,
        hint: &'static str,
    },
    #[error("a Content-Length header is required for uploads")]
    LengthRequired,
    /// Too many requests of the caller's address are in flight before their credentials passed.
    /// Worth retrying in a moment.
    #[error("{0}")]
    TooManyRequests(String),
    /// Not now: shutting down, a task whose state cannot be loaded, a request that ran over its
    /// time, an upload not yet durable. Worth retrying.
    #[error("{message}")]
    Unavailable { code: ErrorCode, message: String },
    /// Something the server got wrong. Its detail (paths, library messages) goes to the log
    /// under a reference; the body says only the reference.
    #[error("internal error: {0}")]
    Internal(String),
}

impl ServerError {
    /// A refusal as too large with `hint` added to its message; any other error as it is.
    pub fn hinted(self, hint: &'static str) -> Self {
        match self {
            ServerError::PayloadTooLarge { got, limit, .. } => {
                ServerError::PayloadTooLarge { got, limit, hint }
            }
            e => e,
        }
    }

    pub fn conflict(code: ErrorCode, message: impl Into<String>) -> Self {
        ServerError::Conflict {
            code,
            message: message.into(),
        }
    }

    pub fn invalid(code: ErrorCode, message: impl Into<String>) -> Self {
        ServerError::Invalid {
            code,
            message: message.into(),
        }
    }

    pub fn unavailable(code: ErrorCode, message: impl Into<String>) -> Self {
        ServerError::Unavailable {
            code,
            message: message.into(),
        }
    }

    pub fn internal(e: impl std::fmt::Display) -> Self {
        ServerError::Internal(e.to_string())
    }

    /// The stable code clients and metrics use.
    pub fn code(&self) -> ErrorCode {
        match self {
            ServerError::BadRequest(_) => ErrorCode::BadRequest,
            ServerError::Invalid { code, .. } => code.clone(),
            ServerError::InvalidUpdate(_) => ErrorCode::InvalidUpdate,
            ServerError::MissingCredentials => ErrorCode::MissingCredentials,
            ServerError::Unauthorized(_) => ErrorCode::Unauthorized,
            ServerError::Forbidden(_) => ErrorCode::Forbidden,
            ServerError::Quarantined(_) => ErrorCode::Quarantined,
            ServerError::NotFound(_) => ErrorCode::NotFound,
            ServerError::Gone { code, .. } | ServerError::Timeout { code, .. } => code.clone(),
            ServerError::Conflict { code, .. } => code.clone(),
            ServerError::PayloadTooLarge { .. } => ErrorCode::PayloadTooLarge,
            ServerError::LengthRequired => ErrorCode::LengthRequired,
            ServerError::TooManyRequests(_) => ErrorCode::TooManyRequests,
            ServerError::Unavailable { code, .. } => code.clone(),
            ServerError::Internal(_) => ErrorCode::Internal,
        }
    }
}

impl From<crate::store::StoreError> for ServerError {
    /// A database that cannot be reached is the server's trouble for now, not a fault: 503
    /// `store_unavailable`, worth retrying (the detail, which names the database, goes to the
    /// log only). Anything else the store fails at is internal.
    fn from(e: crate::store::StoreError) -> Self {
        match e {
            crate::store::StoreError::Unavailable { .. } => {
                tracing::warn!(error = %e, "the store is unavailable");
                ServerError::unavailable(
                    ErrorCode::StoreUnavailable,
                    "the server cannot reach its database right now; retry in a moment",
                )
            }
            crate::store::StoreError::Fenced { .. } => {
                tracing::warn!(error = %e, "a write was fenced");
                ServerError::unavailable(
                    ErrorCode::ShuttingDown,
                    "this replica no longer leads and is stepping down; retry on another replica",
                )
            }
            crate::store::StoreError::Blobs { .. } => {
                tracing::warn!(error = %e, "the blob store failed a request");
                ServerError::unavailable(
                    ErrorCode::StoreUnavailable,
                    "the server cannot reach its blob store right now; retry in a moment",
                )
            }
            crate::store::StoreError::AttemptSealed { round, .. } => ServerError::conflict(
                ErrorCode::RoundClosed,
                format!("round {round} is closing; poll for the next"),
            ),
            e @ crate::store::StoreError::NoTrainingSlot { .. } => {
                ServerError::conflict(ErrorCode::NotSelected, e.to_string())
            }
            e => ServerError::Internal(e.to_string()),
        }
    }
}
