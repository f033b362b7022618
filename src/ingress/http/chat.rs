//! `POST /v1/chat/completions`, streamed (SSE, OpenAI chunks, `[DONE]`) and
//! not.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::caller::{header_text, id_headers, request_headers, Credential};
use super::errors::ApiError;
use super::sse::{self, usage_json, Chunks, Head, Piece};
use crate::gateway::{Caller, Gateway, SubmitOptions, TaskStream};
use crate::task::{Ingress, ToolCallDelta};

/// The submission options of an HTTP chat call: the `x-request-id` hint,
/// and the `Idempotency-Key` header for a body that names no
/// `idempotency_key`.
pub fn submit_options(headers: &HeaderMap) -> SubmitOptions {
    SubmitOptions {
        request_id_hint: header_text(headers, "x-request-id"),
        idempotency_key: header_text(headers, "idempotency-key"),
        traceparent: header_text(headers, "traceparent"),
        headers: request_headers(headers),
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

/// Chat's chunk for each piece of the answer (see [`sse::Chunks`]).
fn chunk(h: &Head, piece: Piece<'_>) -> Option<Value> {
    let (delta, finish) = match piece {
        Piece::Role => (json!({"role": "assistant", "content": ""}), None),
        Piece::Text(text) => (json!({ "content": text }), None),
        Piece::ToolCall(d) => (json!({ "tool_calls": [tool_call_piece(d)] }), None),
        Piece::Finish(finish) => (json!({}), finish),
        Piece::Usage(meta) => {
            return Some(json!({
                "id": h.id, "object": "chat.completion.chunk", "created": h.created,
                "model": h.model, "system_fingerprint": null, "choices": [],
                "usage": usage_json(meta),
            }))
        }
    };
    Some(json!({
        "id": h.id,
        "object": "chat.completion.chunk",
        "created": h.created,
        "model": h.model,
        "system_fingerprint": null,
        "choices": [{ "index": 0, "delta": delta, "logprobs": null, "finish_reason": finish }],
    }))
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

fn sse_response(task: TaskStream, model: String, include_usage: bool) -> Response {
    let head = Head { id: format!("chatcmpl-{}", task.task_id), created: crate::task::now_ms() / 1000, model };
    sse::respond(task, Chunks::new(head, include_usage, chunk))
}

/// Waits for the whole answer ([`sse::whole_text`]).
async fn whole_response(task: TaskStream, model: String) -> Response {
    let created = crate::task::now_ms() / 1000;
    let (text, meta) = match sse::whole_text(task).await {
        Ok(done) => done,
        Err(resp) => return resp,
    };
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
    // A repeat of an idempotency key whose answer text was not kept
    // (`edge.text_not_kept`): the text is missing, not empty.
    if meta.text_not_kept {
        message["content"] = Value::Null;
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
    id_headers(resp.headers_mut(), &meta.request_id, &meta.task_id, meta.trace_id.as_deref());
    resp
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
