//! `POST /v1/chat/completions`, streamed (SSE, OpenAI chunks, `[DONE]`) and
//! not.

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::caller::{event_stream, header_text, id_headers, Credential};
use super::errors::{error_object, ApiError};
use crate::error::{ErrorCode, GatewayError};
use crate::gateway::{Caller, Gateway, SubmitOptions, TaskStream};
use crate::task::{Ingress, ResultMeta, TaskEvent, ToolCallDelta};

/// The submission options of an HTTP chat call: the `x-request-id` hint,
/// and the `Idempotency-Key` header for a body that names no
/// `idempotency_key`.
pub fn submit_options(headers: &HeaderMap) -> SubmitOptions {
    SubmitOptions {
        request_id_hint: header_text(headers, "x-request-id"),
        idempotency_key: header_text(headers, "idempotency-key"),
    }
}

pub async fn chat_completions(
    State(gw): State<Arc<Gateway>>,
    Credential(cred): Credential,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let call = gw.prepare(Caller::Credential(cred.as_deref()), &body, Ingress::Http, submit_options(&headers))?;
    let stream = call.body().stream;
    let include_usage = call.body().stream_options.as_ref().is_some_and(|o| o.include_usage);
    let model = call.body().model.clone();
    let task = gw.submit_call(call).await?;
    Ok(if stream { sse_response(task, model, include_usage) } else { whole_response(task, model).await })
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

/// One piece of a tool call in OpenAI's chunk form: the first piece of a
/// call (the one with its id) carries `id`, `type` and `function.name`,
/// later ones `index` and an `arguments` fragment, so the SDKs'
/// accumulation by `index` works unchanged. A name that comes after the
/// first piece (the assembler passes it on once) goes out in the piece it
/// came with: the SDKs concatenate name fragments, so the call is named.
fn tool_call_piece(d: &ToolCallDelta) -> Value {
    let mut function = json!({ "arguments": d.arguments });
    if let Some(name) = &d.name {
        function["name"] = json!(name);
    }
    match &d.id {
        Some(id) => {
            if d.name.is_none() {
                function["name"] = json!("");
            }
            json!({ "index": d.index, "id": id, "type": "function", "function": function })
        }
        None => json!({ "index": d.index, "function": function }),
    }
}

pub(super) fn usage_json(m: &ResultMeta) -> Value {
    json!({
        "prompt_tokens": m.usage.input_tokens,
        "completion_tokens": m.usage.output_tokens,
        "total_tokens": m.usage.total_tokens,
    })
}

pub(super) fn sse(v: &Value) -> Bytes {
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
                TaskEvent::ToolCallDelta(d) => {
                    sse(&chunk(&st.id, st.created, &st.model, json!({ "tool_calls": [tool_call_piece(&d)] }), None))
                }
                // A chat task has none (embeddings have their own endpoint).
                TaskEvent::Embedding { .. } => Bytes::new(),
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
    event_stream(Body::from_stream(body), &request_id, &task_id)
}

/// Waits for the whole answer. If the client disconnects, hyper drops this
/// future, the task stream is dropped and the task is cancelled.
async fn whole_response(mut task: TaskStream, model: String) -> Response {
    let mut text = String::new();
    let created = crate::task::now_ms() / 1000;
    while let Some((_, ev)) = task.recv().await {
        match ev {
            // The whole calls are in the result, checked.
            TaskEvent::Accepted { .. }
            | TaskEvent::Queued { .. }
            | TaskEvent::ToolCallDelta(_)
            | TaskEvent::Embedding { .. } => {}
            TaskEvent::Delta { text: t } => text.push_str(&t),
            TaskEvent::Done(meta) => {
                let mut message = json!({ "role": "assistant", "content": text, "refusal": null });
                if !meta.tool_calls.is_empty() {
                    let calls: Vec<Value> = meta
                        .tool_calls
                        .iter()
                        .map(|c| json!({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}))
                        .collect();
                    message["tool_calls"] = Value::Array(calls);
                    // OpenAI's form: no text beside the calls is null.
                    if text.is_empty() {
                        message["content"] = Value::Null;
                    }
                }
                let body = json!({
                    "id": format!("chatcmpl-{}", meta.task_id),
                    "object": "chat.completion",
                    "created": created,
                    "model": model,
                    "system_fingerprint": null,
                    "choices": [{
                        "index": 0,
                        "message": message,
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
            TaskEvent::Error { error, meta } => return ApiError::Gateway(error, Some(meta)).into_response(),
        }
    }
    ApiError::from(GatewayError::new(ErrorCode::InternalError, "the task ended without a result")).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::task::tools::ToolCallAssembler;

    /// Review L1: an engine that names the call only in a later piece (the
    /// assembler keeps the name) must still give the client the name, or
    /// the SDK's accumulation builds a call named "".
    #[test]
    fn a_tool_name_that_comes_late_still_reaches_the_client() {
        let mut a = ToolCallAssembler::default();
        let pieces = [
            ToolCallDelta { index: 0, id: Some("c1".into()), name: None, arguments: "{\"ci".into() },
            ToolCallDelta { index: 0, id: None, name: Some("get_weather".into()), arguments: "ty\": 1}".into() },
            ToolCallDelta { index: 0, id: None, name: Some("get_weather".into()), arguments: String::new() },
        ];
        let out: Vec<Value> = pieces.into_iter().map(|d| tool_call_piece(&a.push(d, "t"))).collect();
        // What openai-python does: concatenate the name fragments by index.
        let name: String = out.iter().filter_map(|p| p["function"]["name"].as_str()).collect();
        assert_eq!(name, "get_weather", "{out:?}");
        assert_eq!(out[0]["id"], "c1");
        assert!(out[1].get("id").is_none(), "{out:?}");
    }
}
