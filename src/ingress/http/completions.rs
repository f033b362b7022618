//! `POST /v1/completions`, the legacy text completion: a prompt in, text
//! out, streamed (SSE `text_completion` chunks, then `[DONE]`) or whole.
//!
//! Owns: the response format. Does not own: reading the body or admission
//! (the facade, [`parse_completion`]) or the prompt's way to the engine (it
//! goes as it is to the engine's own completion endpoint, never through a
//! chat template: see `engine`). Same task pipeline as a chat: a client
//! that goes away cancels the task.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::caller::{id_headers, Credential};
use super::chat::submit_options;
use super::errors::ApiError;
use super::sse::{self, usage_json, Chunks, Head, Piece};
use crate::gateway::{parse_completion, Caller, Gateway, TaskStream};
use crate::task::Ingress;

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

/// The legacy completion's chunk for each piece of the answer (see
/// [`sse::Chunks`]): no role chunk, no tool calls.
fn chunk(h: &Head, piece: Piece<'_>) -> Option<Value> {
    let (text, finish) = match piece {
        Piece::Role | Piece::ToolCall(_) => return None,
        Piece::Text(text) => (Value::String(text), None),
        Piece::Finish(finish) => (Value::from(""), finish),
        Piece::Usage(meta) => {
            return Some(json!({
                "id": h.id, "object": "text_completion", "created": h.created,
                "model": h.model, "choices": [], "usage": usage_json(meta),
            }))
        }
    };
    Some(json!({
        "id": h.id,
        "object": "text_completion",
        "created": h.created,
        "model": h.model,
        "choices": [{ "text": text, "index": 0, "logprobs": null, "finish_reason": finish }],
    }))
}

fn sse_response(task: TaskStream, model: String, include_usage: bool) -> Response {
    let head = Head { id: format!("cmpl-{}", task.task_id), created: crate::task::now_ms() / 1000, model };
    sse::respond(task, Chunks::new(head, include_usage, chunk))
}

/// Waits for the whole answer ([`sse::whole_text`]).
async fn whole_response(task: TaskStream, model: String) -> Response {
    let created = crate::task::now_ms() / 1000;
    let (text, meta) = match sse::whole_text(task).await {
        Ok(done) => done,
        Err(resp) => return resp,
    };
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
    id_headers(resp.headers_mut(), &meta.request_id, &meta.task_id, meta.trace_id.as_deref());
    resp
}
