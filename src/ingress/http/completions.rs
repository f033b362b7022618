//! `POST /v1/completions`, the legacy text completion: a prompt in, text
//! out, streamed (SSE `text_completion` chunks, then `[DONE]`) or whole.
//!
//! Owns: the response format. Does not own: reading the body or admission
//! (the facade, [`parse_completion`]) or the prompt's way to the engine (it
//! goes as it is to the engine's own completion endpoint, never through a
//! chat template: see `engine`). Same task pipeline as a chat: a client
//! that goes away cancels the task.

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::caller::{event_stream, id_headers, Credential};
use super::chat::{sse, submit_options, usage_json};
use super::errors::{error_object, ApiError};
use crate::error::{ErrorCode, GatewayError};
use crate::gateway::{parse_completion, Caller, Gateway, TaskStream};
use crate::task::{Ingress, TaskEvent};

/// What the handler needs of the body besides the task.
struct Shape {
    stream: bool,
    include_usage: bool,
}

pub async fn completions(
    State(gw): State<Arc<Gateway>>,
    Credential(cred): Credential,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let (call, shape) =
        gw.prepare_as(Caller::Credential(cred.as_deref()), &body, Ingress::Http, submit_options(&headers), |b| {
            let body = parse_completion(b)?;
            let include_usage = body.stream_options.as_ref().is_some_and(|o| o.include_usage);
            let shape = Shape { stream: body.stream, include_usage };
            Ok((body, shape))
        })?;
    let model = call.body().model.clone();
    let task = gw.submit_call(call).await?;
    Ok(if shape.stream { sse_response(task, model, shape.include_usage) } else { whole_response(task, model).await })
}

fn chunk(id: &str, created: i64, model: &str, text: &str, finish: Option<&str>) -> Value {
    json!({
        "id": id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{ "text": text, "index": 0, "logprobs": null, "finish_reason": finish }],
    })
}

/// State of one SSE response. Owns the task stream: when the client goes
/// away, hyper drops the body, this is dropped, and the task is cancelled.
struct SseState {
    task: TaskStream,
    id: String,
    created: i64,
    model: String,
    include_usage: bool,
    finished: bool,
}

fn sse_response(task: TaskStream, model: String, include_usage: bool) -> Response {
    let (request_id, task_id) = (task.request_id.clone(), task.task_id.clone());
    let st = SseState {
        id: format!("cmpl-{}", task.task_id),
        task,
        created: crate::task::now_ms() / 1000,
        model,
        include_usage,
        finished: false,
    };
    let body = futures::stream::unfold(st, |mut st| async move {
        if st.finished {
            return None;
        }
        let Some((_, ev)) = st.task.recv().await else {
            st.finished = true;
            let e = GatewayError::internal("the task ended without a result");
            return Some((Ok::<_, std::convert::Infallible>(sse(&json!({ "error": error_object(&e) }))), st));
        };
        let out = match ev {
            // SSE comments: OpenAI clients skip them; they show the wait and
            // keep idle-closing proxies from dropping the stream.
            TaskEvent::Accepted { .. } => Bytes::from_static(b": accepted\n\n"),
            TaskEvent::Queued { position } => Bytes::from(format!(": queued position {position}\n\n")),
            TaskEvent::Delta { text } => sse(&chunk(&st.id, st.created, &st.model, &text, None)),
            // A completion task has none (no tools on this endpoint).
            TaskEvent::Embedding { .. } | TaskEvent::ToolCallDelta(_) => Bytes::new(),
            TaskEvent::Done(meta) => {
                st.finished = true;
                let edge = serde_json::to_value(&*meta).unwrap_or(Value::Null);
                let mut last = chunk(&st.id, st.created, &st.model, "", meta.finish_reason.as_deref());
                let mut out = Vec::with_capacity(512);
                if st.include_usage {
                    out.extend_from_slice(&sse(&last));
                    last = json!({
                        "id": st.id, "object": "text_completion", "created": st.created,
                        "model": st.model, "choices": [], "usage": usage_json(&meta),
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
    });
    event_stream(Body::from_stream(body), &request_id, &task_id)
}

/// Waits for the whole answer. If the client disconnects, hyper drops this
/// future, the task stream is dropped and the task is cancelled.
async fn whole_response(mut task: TaskStream, model: String) -> Response {
    let mut text = String::new();
    let created = crate::task::now_ms() / 1000;
    while let Some((_, ev)) = task.recv().await {
        match ev {
            TaskEvent::Accepted { .. }
            | TaskEvent::Queued { .. }
            | TaskEvent::Embedding { .. }
            | TaskEvent::ToolCallDelta(_) => {}
            TaskEvent::Delta { text: t } => text.push_str(&t),
            TaskEvent::Done(meta) => {
                let body = json!({
                    "id": format!("cmpl-{}", meta.task_id),
                    "object": "text_completion",
                    "created": created,
                    "model": model,
                    "choices": [{ "text": text, "index": 0, "logprobs": null, "finish_reason": meta.finish_reason }],
                    "usage": usage_json(&meta),
                    "edge": serde_json::to_value(&*meta).unwrap_or(Value::Null),
                });
                let mut resp = (StatusCode::OK, Json(body)).into_response();
                id_headers(resp.headers_mut(), &meta.request_id, &meta.task_id);
                return resp;
            }
            TaskEvent::Error { error, meta } => return ApiError::Gateway(error, Some(meta)).into_response(),
        }
    }
    ApiError::from(GatewayError::new(ErrorCode::InternalError, "the task ended without a result")).into_response()
}
