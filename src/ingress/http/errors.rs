//! The one place where an error becomes an HTTP response: [`ApiError`],
//! which handlers return with `?`.
//!
//! A [`GatewayError`]'s status comes only from its [`ErrorCode`]
//! ([`ErrorCode::http_status`]); no handler picks one. The two answers that
//! are not gateway errors (a resource that is not there, a task whose
//! events are no longer retained) are variants of their own, with their
//! status fixed here.
//!
//! [`ErrorCode`]: crate::error::ErrorCode
//! [`ErrorCode::http_status`]: crate::error::ErrorCode::http_status

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use crate::error::GatewayError;
use crate::task::ResultMeta;

/// The OpenAI-style error object, with our code and retry hint.
pub fn error_object(e: &GatewayError) -> Value {
    let mut o = json!({
        "code": e.code.as_str(),
        "message": e.message,
        "type": e.code.error_type(),
        "param": null,
    });
    if let Some(ms) = e.retry_after_ms {
        o["retry_after_ms"] = ms.into();
    }
    if let Some(at) = &e.resets_at {
        o["resets_at"] = at.as_str().into();
    }
    if e.partial {
        o["partial"] = true.into();
    }
    o
}

/// Why an HTTP call failed.
#[derive(Debug)]
pub enum ApiError {
    /// A gateway error, with the result metadata of the task it ended (if
    /// it was a task). The status is its code's.
    Gateway(GatewayError, Option<Box<ResultMeta>>),
    /// 404: no such endpoint, or no such task for this caller (the body
    /// carries `INVALID_REQUEST` with `message`).
    NotFound(&'static str),
    /// 410: the task is known but its events are no longer retained.
    Gone(GatewayError, Option<Box<ResultMeta>>),
}

impl From<GatewayError> for ApiError {
    fn from(e: GatewayError) -> Self {
        ApiError::Gateway(e, None)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        match self {
            ApiError::Gateway(e, meta) => {
                let status = StatusCode::from_u16(e.code.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
                render(status, &e, meta.as_deref())
            }
            ApiError::NotFound(what) => render(StatusCode::NOT_FOUND, &GatewayError::invalid(what), None),
            ApiError::Gone(e, meta) => render(StatusCode::GONE, &e, meta.as_deref()),
        }
    }
}

/// `{"error": {...}, "edge": {...}}` with the status, `Retry-After` and the
/// id headers.
fn render(status: StatusCode, e: &GatewayError, meta: Option<&ResultMeta>) -> Response {
    let mut body = json!({ "error": error_object(e) });
    if let Some(m) = meta {
        body["edge"] = serde_json::to_value(m).unwrap_or(Value::Null);
    }
    let mut resp = (status, Json(body)).into_response();
    let h = resp.headers_mut();
    if let Some(ms) = e.retry_after_ms {
        let secs = ms.div_ceil(1000).max(1);
        h.insert(header::RETRY_AFTER, HeaderValue::from(secs));
    }
    if let Some(m) = meta {
        super::caller::id_headers(h, &m.request_id, &m.task_id, m.trace_id.as_deref());
    }
    resp
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorCode;

    #[test]
    fn a_gateway_errors_status_is_its_codes() {
        for code in ErrorCode::ALL {
            let r = ApiError::from(GatewayError::new(code, "x")).into_response();
            assert_eq!(r.status().as_u16(), code.http_status(), "{code}");
        }
    }

    #[test]
    fn busy_answers_carry_retry_after_in_whole_seconds() {
        let e = GatewayError::new(ErrorCode::QueueFull, "full").with_retry_after(1500);
        let r = ApiError::from(e).into_response();
        assert_eq!(r.headers()[header::RETRY_AFTER], "2");
    }
}
