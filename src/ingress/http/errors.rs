//! The one place where a [`GatewayError`] becomes an HTTP response.

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
    o
}

/// `{"error": {...}, "edge": {...}}` with the status, `Retry-After` and the
/// id headers.
pub fn error_response(e: &GatewayError, meta: Option<&ResultMeta>) -> Response {
    let mut body = json!({ "error": error_object(e) });
    if let Some(m) = meta {
        body["edge"] = serde_json::to_value(m).unwrap_or(Value::Null);
    }
    let status = StatusCode::from_u16(e.code.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut resp = (status, Json(body)).into_response();
    let h = resp.headers_mut();
    if let Some(ms) = e.retry_after_ms {
        let secs = ms.div_ceil(1000).max(1);
        h.insert(header::RETRY_AFTER, HeaderValue::from(secs));
    }
    if let Some(m) = meta {
        super::chat::id_headers(h, &m.request_id, &m.task_id);
    }
    resp
}
