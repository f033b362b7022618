//! One streaming renderer for the OpenAI-style SSE answers: chat
//! completions, legacy completions and the Responses API.
//!
//! Owns: the stream's life (one body per task that ends after the
//! terminal event, an `error` frame when the task ends without a result,
//! the task cancelled when the client goes away: the body owns the task
//! stream, hyper drops it) and, for the two chunk APIs, the chunk sequence
//! (role piece or `: accepted`, queue comments, deltas, the final chunk,
//! the usage chunk, `[DONE]`). Does not own: each API's chunk shape (a
//! [`ChunkFn`] in its own file), the Responses events (`responses.rs`
//! implements [`Render`]), the headers ([`event_stream`]).

use std::convert::Infallible;

use axum::body::{Body, Bytes};
use axum::response::Response;
use serde_json::{json, Value};

use super::caller::event_stream;
use axum::response::IntoResponse;

use super::errors::{error_object, ApiError};
use crate::error::GatewayError;
use crate::gateway::TaskStream;
use crate::task::{ResultMeta, TaskEvent, ToolCallDelta};

/// What one SSE answer makes of the task's events.
pub(super) trait Render: Send + 'static {
    /// The bytes for one event (may be empty). The stream ends after a
    /// terminal event (`Done` or `Error`).
    fn event(&mut self, ev: TaskEvent) -> Bytes;
    /// The bytes when the task stream ended without a terminal event (the
    /// driver always sends one; this is the safety net).
    fn lost(&mut self, e: &GatewayError) -> Bytes;
}

/// Streams `task` rendered by `r` as the response body, with the SSE
/// headers and the call's ids.
pub(super) fn respond<R: Render>(task: TaskStream, r: R) -> Response {
    let (request_id, task_id, trace_id) = (task.request_id.clone(), task.task_id.clone(), task.trace_id.clone());
    let body = futures::stream::unfold((task, r, false), |(mut task, mut r, finished)| async move {
        if finished {
            return None;
        }
        let Some((_, ev)) = task.recv().await else {
            let out = r.lost(&GatewayError::internal("the task ended without a result"));
            return Some((Ok::<_, Infallible>(out), (task, r, true)));
        };
        let finished = matches!(ev, TaskEvent::Done(_) | TaskEvent::Error { .. });
        let out = r.event(ev);
        Some((Ok(out), (task, r, finished)))
    });
    event_stream(Body::from_stream(body), &request_id, &task_id, &trace_id)
}

/// The whole text of a chunk API's answer and its result, for a call that
/// is not streamed (chat and legacy completions); the error response if the
/// task failed or ended without a result. Tool calls are not gathered: the
/// whole calls are in the result, checked. If the client disconnects, hyper
/// drops the caller's future, the task stream with it, and the task is
/// cancelled.
pub(super) async fn whole_text(mut task: TaskStream) -> Result<(String, Box<ResultMeta>), Response> {
    let mut text = String::new();
    while let Some((_, ev)) = task.recv().await {
        match ev {
            TaskEvent::Accepted { .. }
            | TaskEvent::Queued { .. }
            | TaskEvent::ToolCallDelta(_)
            | TaskEvent::Embedding { .. } => {}
            TaskEvent::Delta { text: t } => text.push_str(&t),
            TaskEvent::Done(meta) => return Ok((text, meta)),
            TaskEvent::Error { error, meta } => return Err(ApiError::Gateway(error, Some(meta)).into_response()),
        }
    }
    Err(ApiError::from(GatewayError::internal("the task ended without a result")).into_response())
}

/// `data: <json>` and the blank line.
pub(super) fn sse(v: &Value) -> Bytes {
    let mut s = String::with_capacity(128);
    s.push_str("data: ");
    s.push_str(&v.to_string());
    s.push_str("\n\n");
    Bytes::from(s)
}

/// OpenAI's `usage` of a chunk API.
pub(super) fn usage_json(m: &ResultMeta) -> Value {
    json!({
        "prompt_tokens": m.usage.input_tokens,
        "completion_tokens": m.usage.output_tokens,
        "total_tokens": m.usage.total_tokens,
    })
}

/// What every chunk of one answer repeats.
pub(super) struct Head {
    pub id: String,
    pub created: i64,
    pub model: String,
}

/// The pieces of a chunk API's answer.
pub(super) enum Piece<'a> {
    /// The first chunk, once the task is accepted.
    Role,
    /// Owned, so the text moves into the chunk without a copy.
    Text(String),
    ToolCall(&'a ToolCallDelta),
    /// The last chunk with choices: no content, the finish reason.
    Finish(Option<&'a str>),
    /// The chunk with no choices and the usage (`include_usage`).
    Usage(&'a ResultMeta),
}

/// An API's chunk for a piece; `None` where the API has no such piece
/// (no role chunk: the acceptance is an SSE comment; no tool calls: the
/// piece is dropped).
pub(super) type ChunkFn = fn(&Head, Piece<'_>) -> Option<Value>;

/// The chunk stream of chat and legacy completions.
pub(super) struct Chunks {
    head: Head,
    chunk: ChunkFn,
    include_usage: bool,
}

impl Chunks {
    pub(super) fn new(head: Head, include_usage: bool, chunk: ChunkFn) -> Chunks {
        Chunks { head, chunk, include_usage }
    }

    fn piece(&self, p: Piece<'_>) -> Option<Value> {
        (self.chunk)(&self.head, p)
    }
}

impl Render for Chunks {
    fn event(&mut self, ev: TaskEvent) -> Bytes {
        match ev {
            TaskEvent::Accepted { .. } => match self.piece(Piece::Role) {
                Some(v) => sse(&v),
                // An SSE comment: OpenAI clients skip it; it shows the call
                // was accepted and keeps idle-closing proxies away.
                None => Bytes::from_static(b": accepted\n\n"),
            },
            // Likewise: it shows the wait.
            TaskEvent::Queued { position, loading_ms } => {
                Bytes::from(crate::ingress::render::queued_comment(position, loading_ms))
            }
            TaskEvent::Delta { text } => self.piece(Piece::Text(text)).map_or_else(Bytes::new, |v| sse(&v)),
            TaskEvent::ToolCallDelta(d) => self.piece(Piece::ToolCall(&d)).map_or_else(Bytes::new, |v| sse(&v)),
            // Chat and completion tasks have none (embeddings have their own
            // endpoint).
            TaskEvent::Embedding { .. } => Bytes::new(),
            TaskEvent::Done(meta) => {
                let edge = serde_json::to_value(&*meta).unwrap_or(Value::Null);
                let mut last = self.piece(Piece::Finish(meta.finish_reason.as_deref())).unwrap_or(Value::Null);
                let mut out = Vec::with_capacity(512);
                if self.include_usage {
                    out.extend_from_slice(&sse(&last));
                    last = self.piece(Piece::Usage(&meta)).unwrap_or(Value::Null);
                }
                last["edge"] = edge;
                out.extend_from_slice(&sse(&last));
                out.extend_from_slice(b"data: [DONE]\n\n");
                Bytes::from(out)
            }
            TaskEvent::Error { error, meta } => {
                let edge = serde_json::to_value(&*meta).unwrap_or(Value::Null);
                sse(&json!({ "error": error_object(&error), "edge": edge }))
            }
        }
    }

    fn lost(&mut self, e: &GatewayError) -> Bytes {
        sse(&json!({ "error": error_object(e) }))
    }
}
