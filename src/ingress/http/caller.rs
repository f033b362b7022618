//! Who is calling, as axum extractors: [`Credential`] reads the bearer
//! credential; [`Caller`] has the facade authenticate it, so a handler that
//! takes a `Caller` runs only for a known identity.
//!
//! Owns: where HTTP carries a credential (`Authorization: Bearer …`, what
//! the OpenAI SDKs send, or `x-api-key`) and the id headers of a response.
//! Does not own: authentication itself (the gateway facade).

use std::sync::Arc;

use axum::body::Body;
use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, HeaderValue};
use axum::response::Response;

use super::errors::ApiError;
use crate::gateway::{Gateway, RequestHeaders};
use crate::task::Identity;

/// The bearer credential of a request, not yet checked. Submissions pass it
/// to [`Gateway::submit`], which authenticates and counts a refusal once.
pub struct Credential(pub Option<String>);

/// An authenticated caller.
pub struct Caller(pub Identity);

fn bearer(h: &HeaderMap) -> Option<&str> {
    if let Some(v) = h.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()) {
        let v = v.trim();
        return Some(v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")).unwrap_or(v));
    }
    h.get("x-api-key").and_then(|v| v.to_str().ok())
}

impl<S: Send + Sync> FromRequestParts<S> for Credential {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        Ok(Credential(bearer(&parts.headers).map(str::to_string)))
    }
}

impl FromRequestParts<Arc<Gateway>> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, gw: &Arc<Gateway>) -> Result<Self, Self::Rejection> {
        Ok(Caller(gw.authenticate_with(bearer(&parts.headers), &request_headers(&parts.headers))?))
    }
}

/// The response header with a task's trace id (W3C's `traceresponse` is
/// still a draft; a `traceparent` on a response would name a span the
/// caller never saw).
pub const TRACE_ID_HEADER: &str = "x-edgeway-trace-id";

/// `x-request-id`, `x-task-id` and `x-edgeway-trace-id` on a response
/// about a task.
pub fn id_headers(h: &mut HeaderMap, request_id: &str, task_id: &str, trace_id: Option<&str>) {
    if let Some(v) = trace_id.filter(|t| !t.is_empty()).and_then(|t| HeaderValue::from_str(t).ok()) {
        h.insert(TRACE_ID_HEADER, v);
    }
    if let Ok(v) = HeaderValue::from_str(request_id) {
        h.insert("x-request-id", v);
    }
    if let Ok(v) = HeaderValue::from_str(task_id) {
        h.insert("x-task-id", v);
    }
}

/// A streamed answer: server-sent events, never cached or buffered by a
/// proxy (`x-accel-buffering: no` for nginx), with the call's ids.
pub fn event_stream(body: Body, request_id: &str, task_id: &str, trace_id: &str) -> Response {
    let mut resp = Response::new(body);
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    id_headers(h, request_id, task_id, Some(trace_id));
    resp
}

/// The request's headers for the facade (an application's `user_header`).
pub fn request_headers(h: &HeaderMap) -> RequestHeaders {
    let h = h.clone();
    RequestHeaders::new(move |name| header_text(&h, name))
}

/// A header's value as text, if it is present and readable.
pub fn header_text(h: &HeaderMap, name: &str) -> Option<String> {
    h.get(name).and_then(|v| v.to_str().ok()).map(str::to_string)
}
