//! How a refusal travels over HTTP: the one place that gives each kind of [`ServerError`] its
//! status and renders it as an [`ApiError`] body. The domain (`crate::error`) says what went wrong
//! and with which [`ErrorCode`]; this module says how HTTP expresses it.

use axum::http::header::RETRY_AFTER;
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use hora_common::wire::{ApiError, ErrorCode};

use crate::error::ServerError;

impl ServerError {
    /// The HTTP status this refusal answers with.
    pub fn status(&self) -> StatusCode {
        match self {
            ServerError::BadRequest(_)
            | ServerError::Invalid { .. }
            | ServerError::InvalidUpdate(_) => StatusCode::BAD_REQUEST,
            ServerError::MissingCredentials | ServerError::Unauthorized(_) => {
                StatusCode::UNAUTHORIZED
            }
            ServerError::Forbidden(_) | ServerError::Quarantined(_) => StatusCode::FORBIDDEN,
            ServerError::NotFound(_) => StatusCode::NOT_FOUND,
            ServerError::Gone { .. } => StatusCode::GONE,
            ServerError::Timeout { .. } => StatusCode::REQUEST_TIMEOUT,
            ServerError::Conflict { .. } => StatusCode::CONFLICT,
            ServerError::PayloadTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ServerError::LengthRequired => StatusCode::LENGTH_REQUIRED,
            ServerError::TooManyRequests(_) => StatusCode::TOO_MANY_REQUESTS,
            ServerError::Unavailable { .. } => StatusCode::SERVICE_UNAVAILABLE,
            ServerError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// Seconds after which a retry may find room, for the `Retry-After` header: for refusals
    /// that say the server (or this address's share of it) is full right now, or its database
    /// unreachable.
    fn retry_after(&self) -> Option<u64> {
        match self.code() {
            ErrorCode::Busy
            | ErrorCode::TooManyRequests
            | ErrorCode::ShuttingDown
            | ErrorCode::Standby => Some(1),
            ErrorCode::StoreUnavailable => Some(2),
            _ => None,
        }
    }
}

impl IntoResponse for ServerError {
    fn into_response(self) -> Response {
        let message = match &self {
            ServerError::Internal(e) => {
                let reference = format!("{:016x}", rand::random::<u64>());
                tracing::error!(error = %e, reference, "internal error");
                format!("internal error (reference {reference}; the operator finds the detail in the server log)")
            }
            other => other.to_string(),
        };
        let mut response = answer(self.status(), self.code(), message);
        if let Some(secs) = self.retry_after() {
            response
                .headers_mut()
                .insert(RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}

/// An [`ApiError`] answer, for the refusals the router gives itself (a method a path does not
/// serve) as well as for every [`ServerError`].
pub fn answer(status: StatusCode, code: ErrorCode, message: String) -> Response {
    (status, Json(ApiError { code, message })).into_response()
}
