//! `POST /v1/chat/completions`, streamed (SSE, OpenAI chunks, `[DONE]`) and
//! not.

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::errors::{error_object, error_response};
use crate::admission::request::parse_body;
use crate::admission::ChatRequestBody;
use crate::error::{ErrorCode, GatewayError};
use crate::gateway::Gateway;
use crate::scheduler::TaskStream;
use crate::task::{Ingress, ResultMeta, TaskEvent};

/// The bearer credential: `Authorization: Bearer …` (what the OpenAI SDKs
/// send) or `x-api-key`.
pub fn bearer(h: &HeaderMap) -> Option<&str> {
    if let Some(v) = h.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()) {
        let v = v.trim();
        return Some(v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")).unwrap_or(v));
    }
    h.get("x-api-key").and_then(|v| v.to_str().ok())
}

pub fn id_headers(h: &mut HeaderMap, request_id: &str, task_id: &str) {
    if let Ok(v) = HeaderValue::from_str(request_id) {
        h.insert("x-request-id", v);
    }
    if let Ok(v) = HeaderValue::from_str(task_id) {
        h.insert("x-task-id", v);
    }
}

/// The caller, the request body and the `x-request-id` hint of a chat
/// call (`POST /v1/chat/completions` or `POST /v1/tasks`); the
/// `Idempotency-Key` header fills in a missing `idempotency_key`.
pub fn read_call(
    gw: &Gateway,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<(crate::task::Identity, ChatRequestBody, Option<String>), Box<Response>> {
    let refuse = |e: GatewayError| {
        gw.count_rejection(Ingress::Http, &e);
        Box::new(error_response(&e, None))
    };
    let identity = gw.auth.authenticate(bearer(headers)).map_err(refuse)?;
    let mut req = parse_body(body).map_err(refuse)?;
    if req.idempotency_key.is_none() {
        req.idempotency_key = headers.get("idempotency-key").and_then(|v| v.to_str().ok()).map(str::to_string);
    }
    let hint = headers.get("x-request-id").and_then(|v| v.to_str().ok()).map(str::to_string);
    Ok((identity, req, hint))
}

pub async fn chat_completions(State(gw): State<Arc<Gateway>>, headers: HeaderMap, body: Bytes) -> Response {
    let (identity, req, hint) = match read_call(&gw, &headers, &body) {
        Ok(c) => c,
        Err(resp) => return *resp,
    };
    let stream = req.stream;
    let include_usage = req.stream_options.as_ref().is_some_and(|o| o.include_usage);
    let model = req.model.clone();
    let task = match gw.submit(identity, req, Ingress::Http, hint).await {
        Ok(t) => t,
        Err(e) => return error_response(&e, None),
    };
    if stream {
        sse_response(task, model, include_usage)
    } else {
        whole_response(task, model).await
    }
}

fn chunk(id: &str, created: i64, model: &str, delta: Value, finish: Option<&str>) -> Value {
    json!({
        "id": id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "system_fingerprint": null,
        "choices": [{ "index": 0, "delta": delta, "logprobs": null, "finish_reason": finish }],
    })
}

fn usage_json(m: &ResultMeta) -> Value {
    json!({
        "prompt_tokens": m.usage.input_tokens,
        "completion_tokens": m.usage.output_tokens,
        "total_tokens": m.usage.total_tokens,
    })
}

fn sse(v: &Value) -> Bytes {
    let mut s = String::with_capacity(128);
    s.push_str("data: ");
    s.push_str(&v.to_string());
    s.push_str("\n\n");
    Bytes::from(s)
}

/// State of one SSE response. Owns the task stream: when the client goes
/// away, hyper drops the body, this is dropped, and the task is cancelled.
struct SseState {
    task: TaskStream,
    id: String,
    created: i64,
    model: String,
    include_usage: bool,
    sent_role: bool,
    finished: bool,
}

fn sse_response(task: TaskStream, model: String, include_usage: bool) -> Response {
    let (request_id, task_id) = (task.request_id.clone(), task.task_id.clone());
    let st = SseState {
        id: format!("chatcmpl-{}", task.task_id),
        task,
        created: crate::task::now_ms() / 1000,
        model,
        include_usage,
        sent_role: false,
        finished: false,
    };
    let body = futures::stream::unfold(st, |mut st| async move {
        {
            if st.finished {
                return None;
            }
            let Some((_, ev)) = st.task.recv().await else {
                // The driver always sends a final event; be safe anyway.
                st.finished = true;
                let e = GatewayError::internal("the task ended without a result");
                return Some((Ok::<_, std::convert::Infallible>(sse(&json!({ "error": error_object(&e) }))), st));
            };
            let out = match ev {
                TaskEvent::Accepted { .. } => {
                    st.sent_role = true;
                    sse(&chunk(&st.id, st.created, &st.model, json!({"role": "assistant", "content": ""}), None))
                }
                // An SSE comment: OpenAI clients skip it; it shows the wait
                // and keeps idle-closing proxies from dropping the stream.
                TaskEvent::Queued { position } => Bytes::from(format!(": queued position {position}\n\n")),
                TaskEvent::Delta { text } => {
                    sse(&chunk(&st.id, st.created, &st.model, json!({ "content": text }), None))
                }
                TaskEvent::Done(meta) => {
                    st.finished = true;
                    let edge = serde_json::to_value(&*meta).unwrap_or(Value::Null);
                    let mut last = chunk(&st.id, st.created, &st.model, json!({}), meta.finish_reason.as_deref());
                    let mut out = Vec::with_capacity(512);
                    if st.include_usage {
                        out.extend_from_slice(&sse(&last));
                        last = json!({
                            "id": st.id, "object": "chat.completion.chunk", "created": st.created,
                            "model": st.model, "system_fingerprint": null, "choices": [],
                            "usage": usage_json(&meta),
                        });
                    }
                    last["edge"] = edge;
                    out.extend_from_slice(&sse(&last));
                    out.extend_from_slice(b"data: [DONE]\n\n");
                    Bytes::from(out)
                }
                TaskEvent::Error { error, meta } => {
                    st.finished = true;
                    let edge = serde_json::to_value(&*meta).unwrap_or(Value::Null);
                    sse(&json!({ "error": error_object(&error), "edge": edge }))
                }
            };
            Some((Ok(out), st))
        }
    });
    let mut resp = Response::new(Body::from_stream(body));
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    id_headers(h, &request_id, &task_id);
    resp
}

/// Waits for the whole answer. If the client disconnects, hyper drops this
/// future, the task stream is dropped and the task is cancelled.
async fn whole_response(mut task: TaskStream, model: String) -> Response {
    let mut text = String::new();
    let created = crate::task::now_ms() / 1000;
    while let Some((_, ev)) = task.recv().await {
        match ev {
            TaskEvent::Accepted { .. } | TaskEvent::Queued { .. } => {}
            TaskEvent::Delta { text: t } => text.push_str(&t),
            TaskEvent::Done(meta) => {
                let body = json!({
                    "id": format!("chatcmpl-{}", meta.task_id),
                    "object": "chat.completion",
                    "created": created,
                    "model": model,
                    "system_fingerprint": null,
                    "choices": [{
                        "index": 0,
                        "message": { "role": "assistant", "content": text, "refusal": null },
                        "logprobs": null,
                        "finish_reason": meta.finish_reason,
                    }],
                    "usage": usage_json(&meta),
                    "edge": serde_json::to_value(&*meta).unwrap_or(Value::Null),
                });
                let mut resp = (StatusCode::OK, Json(body)).into_response();
                id_headers(resp.headers_mut(), &meta.request_id, &meta.task_id);
                return resp;
            }
            TaskEvent::Error { error, meta } => return error_response(&error, Some(&meta)),
        }
    }
    error_response(&GatewayError::new(ErrorCode::InternalError, "the task ended without a result"), None)
}
