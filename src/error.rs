//! The one public error code enum and the error every ingress answers with.
//!
//! Owns: the closed set of codes of DESIGN.md, and everything derived from a
//! code (HTTP status, retryability, metric label). Does not own: the leaf
//! error types of each component (engine, store, config), which are
//! translated into a [`GatewayError`] once, at the edge that sees them.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Stable error codes shared by every ingress. The wire form is the
/// SCREAMING_SNAKE_CASE name; never rename a variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ErrorCode {
    AuthFailed,
    PermissionDenied,
    RateLimited,
    QuotaExceeded,
    InvalidRequest,
    ContextTooLarge,
    QueueFull,
    QueueTimeout,
    FirstTokenTimeout,
    InferenceTimeout,
    IdleTimeout,
    TotalTimeout,
    RequestCancelled,
    ModelUnavailable,
    ResourceExhausted,
    PolicyBlocked,
    InternalError,
    /// The task store cannot write: new work is refused rather than run
    /// unrecorded, until writes succeed again.
    StoreUnavailable,
    /// The gateway is draining before it stops: new work is refused.
    ShuttingDown,
    /// No such session for this caller (unknown, deleted, purged, or
    /// another tenant's, application's or user's: existence is not told).
    SessionNotFound,
    /// The session passed its maximum lifetime or idle expiry.
    SessionExpired,
    /// The session holds its maximum number of messages.
    SessionMessageLimit,
    /// The session holds its maximum number of tokens.
    SessionTokenLimit,
    /// The caller holds its maximum number of sessions.
    SessionLimit,
    /// Another turn of the session was still running when the call's
    /// queue timeout passed (turns of a session run one at a time).
    SessionBusy,
    /// A configuration reload was refused (invalid file, or a change that
    /// needs a restart); the configuration in force stays.
    ConfigInvalid,
}

impl ErrorCode {
    pub const ALL: [ErrorCode; 26] = [
        ErrorCode::AuthFailed,
        ErrorCode::PermissionDenied,
        ErrorCode::RateLimited,
        ErrorCode::QuotaExceeded,
        ErrorCode::InvalidRequest,
        ErrorCode::ContextTooLarge,
        ErrorCode::QueueFull,
        ErrorCode::QueueTimeout,
        ErrorCode::FirstTokenTimeout,
        ErrorCode::InferenceTimeout,
        ErrorCode::IdleTimeout,
        ErrorCode::TotalTimeout,
        ErrorCode::RequestCancelled,
        ErrorCode::ModelUnavailable,
        ErrorCode::ResourceExhausted,
        ErrorCode::PolicyBlocked,
        ErrorCode::InternalError,
        ErrorCode::StoreUnavailable,
        ErrorCode::ShuttingDown,
        ErrorCode::SessionNotFound,
        ErrorCode::SessionExpired,
        ErrorCode::SessionMessageLimit,
        ErrorCode::SessionTokenLimit,
        ErrorCode::SessionLimit,
        ErrorCode::SessionBusy,
        ErrorCode::ConfigInvalid,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::AuthFailed => "AUTH_FAILED",
            ErrorCode::PermissionDenied => "PERMISSION_DENIED",
            ErrorCode::RateLimited => "RATE_LIMITED",
            ErrorCode::QuotaExceeded => "QUOTA_EXCEEDED",
            ErrorCode::InvalidRequest => "INVALID_REQUEST",
            ErrorCode::ContextTooLarge => "CONTEXT_TOO_LARGE",
            ErrorCode::QueueFull => "QUEUE_FULL",
            ErrorCode::QueueTimeout => "QUEUE_TIMEOUT",
            ErrorCode::FirstTokenTimeout => "FIRST_TOKEN_TIMEOUT",
            ErrorCode::InferenceTimeout => "INFERENCE_TIMEOUT",
            ErrorCode::IdleTimeout => "IDLE_TIMEOUT",
            ErrorCode::TotalTimeout => "TOTAL_TIMEOUT",
            ErrorCode::RequestCancelled => "REQUEST_CANCELLED",
            ErrorCode::ModelUnavailable => "MODEL_UNAVAILABLE",
            ErrorCode::ResourceExhausted => "RESOURCE_EXHAUSTED",
            ErrorCode::PolicyBlocked => "POLICY_BLOCKED",
            ErrorCode::InternalError => "INTERNAL_ERROR",
            ErrorCode::StoreUnavailable => "STORE_UNAVAILABLE",
            ErrorCode::ShuttingDown => "SHUTTING_DOWN",
            ErrorCode::SessionNotFound => "SESSION_NOT_FOUND",
            ErrorCode::SessionExpired => "SESSION_EXPIRED",
            ErrorCode::SessionMessageLimit => "SESSION_MESSAGE_LIMIT",
            ErrorCode::SessionTokenLimit => "SESSION_TOKEN_LIMIT",
            ErrorCode::SessionLimit => "SESSION_LIMIT",
            ErrorCode::SessionBusy => "SESSION_BUSY",
            ErrorCode::ConfigInvalid => "CONFIG_INVALID",
        }
    }

    /// HTTP status for this code. 499 is the de-facto "client closed
    /// request" status; a client that cancelled rarely reads it.
    pub fn http_status(self) -> u16 {
        match self {
            ErrorCode::AuthFailed => 401,
            ErrorCode::PermissionDenied | ErrorCode::PolicyBlocked => 403,
            ErrorCode::RateLimited | ErrorCode::QuotaExceeded => 429,
            ErrorCode::InvalidRequest => 400,
            ErrorCode::ConfigInvalid => 422,
            ErrorCode::ContextTooLarge => 413,
            ErrorCode::QueueFull
            | ErrorCode::QueueTimeout
            | ErrorCode::ModelUnavailable
            | ErrorCode::ResourceExhausted
            | ErrorCode::StoreUnavailable
            | ErrorCode::ShuttingDown => 503,
            ErrorCode::FirstTokenTimeout
            | ErrorCode::InferenceTimeout
            | ErrorCode::IdleTimeout
            | ErrorCode::TotalTimeout => 504,
            ErrorCode::RequestCancelled => 499,
            ErrorCode::InternalError => 500,
            ErrorCode::SessionNotFound => 404,
            ErrorCode::SessionExpired => 410,
            ErrorCode::SessionMessageLimit
            | ErrorCode::SessionTokenLimit
            | ErrorCode::SessionLimit
            | ErrorCode::SessionBusy => 409,
        }
    }

    /// OpenAI-style `error.type` for the HTTP body.
    pub fn error_type(self) -> &'static str {
        match self {
            ErrorCode::AuthFailed => "authentication_error",
            ErrorCode::PermissionDenied | ErrorCode::PolicyBlocked => "permission_error",
            ErrorCode::RateLimited | ErrorCode::QuotaExceeded => "rate_limit_error",
            ErrorCode::InvalidRequest
            | ErrorCode::ContextTooLarge
            | ErrorCode::SessionNotFound
            | ErrorCode::SessionExpired
            | ErrorCode::SessionMessageLimit
            | ErrorCode::SessionTokenLimit
            | ErrorCode::SessionLimit
            | ErrorCode::SessionBusy
            | ErrorCode::ConfigInvalid => "invalid_request_error",
            ErrorCode::QueueFull
            | ErrorCode::QueueTimeout
            | ErrorCode::ModelUnavailable
            | ErrorCode::ResourceExhausted
            | ErrorCode::ShuttingDown => "overloaded_error",
            ErrorCode::FirstTokenTimeout
            | ErrorCode::InferenceTimeout
            | ErrorCode::IdleTimeout
            | ErrorCode::TotalTimeout => "timeout_error",
            ErrorCode::RequestCancelled => "cancelled",
            ErrorCode::InternalError | ErrorCode::StoreUnavailable => "server_error",
        }
    }

    /// Whether the same request may succeed if sent again later unchanged.
    pub fn retryable(self) -> bool {
        matches!(
            self,
            ErrorCode::RateLimited
                | ErrorCode::QueueFull
                | ErrorCode::QueueTimeout
                | ErrorCode::SessionBusy
                | ErrorCode::ModelUnavailable
                | ErrorCode::ResourceExhausted
                | ErrorCode::FirstTokenTimeout
                | ErrorCode::InternalError
                | ErrorCode::StoreUnavailable
                | ErrorCode::ShuttingDown
        )
    }

    /// Whether a repeat of an idempotency key whose task ended with this
    /// code runs the request again (once: concurrent repeats join the new
    /// run) instead of replaying the end. The one rule, used by the gateway
    /// and the scheduler's registry: a transient end ([`Self::retryable`],
    /// the router's retryable engine failures end `INTERNAL_ERROR`,
    /// `MODEL_UNAVAILABLE` or `FIRST_TOKEN_TIMEOUT`) or a cancellation (the
    /// caller went away, a shutdown), which says nothing about the request.
    pub fn runs_again_on_repeat(self) -> bool {
        self.retryable() || self == ErrorCode::RequestCancelled
    }

    /// Whether a task that ends with this code ends `TIMED_OUT` (rather than
    /// `FAILED` or `CANCELLED`).
    pub fn is_timeout(self) -> bool {
        matches!(
            self,
            ErrorCode::QueueTimeout
                | ErrorCode::FirstTokenTimeout
                | ErrorCode::InferenceTimeout
                | ErrorCode::IdleTimeout
                | ErrorCode::TotalTimeout
        )
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a client is told when its call fails. The message is ours, written
/// for the client: engine error text never goes into it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct GatewayError {
    pub code: ErrorCode,
    pub message: String,
    /// Set on busy answers: when a retry has a fair chance.
    pub retry_after_ms: Option<u64>,
    /// Set on `QUOTA_EXCEEDED` for a spent budget: when its window resets
    /// (RFC 3339, UTC), the moment `retry_after_ms` points at.
    pub resets_at: Option<String>,
    /// The engine failed after output reached the client: what it got is
    /// partial, and edgeway did not retry (a retry would repeat it).
    pub partial: bool,
}

impl GatewayError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        GatewayError { code, message: message.into(), retry_after_ms: None, resets_at: None, partial: false }
    }

    /// Marks an error that ended output already sent.
    pub fn with_partial(mut self) -> Self {
        self.partial = true;
        self
    }

    pub fn with_retry_after(mut self, ms: u64) -> Self {
        self.retry_after_ms = Some(ms);
        self
    }

    /// When the spent budget that refused the call resets (RFC 3339).
    pub fn with_resets_at(mut self, at: String) -> Self {
        self.resets_at = Some(at);
        self
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::InvalidRequest, message)
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::InternalError, message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_names_round_trip() {
        for code in ErrorCode::ALL {
            let json = serde_json::to_string(&code).unwrap();
            assert_eq!(json, format!("\"{}\"", code.as_str()));
            let back: ErrorCode = serde_json::from_str(&json).unwrap();
            assert_eq!(back, code);
        }
    }

    #[test]
    fn timeouts_are_gateway_timeouts() {
        for code in ErrorCode::ALL {
            if code.is_timeout() && code != ErrorCode::QueueTimeout {
                assert_eq!(code.http_status(), 504, "{code}");
            }
        }
    }
}
