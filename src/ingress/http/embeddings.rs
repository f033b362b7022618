//! `POST /v1/embeddings`: OpenAI's shape (`input` a string or a list of
//! strings, `encoding_format` float or base64), answered with
//! `{"object": "list", "data": [{"object": "embedding", "index", "embedding"}],
//! "model", "usage"}` plus the `edge` metadata.
//!
//! Owns: the response format, base64 included (little-endian `f32` bytes,
//! as OpenAI sends them). Does not own: reading the body or admission (the
//! facade, [`parse_embeddings`]), the task (an embedding is a task like a
//! chat: the same scheduler, lane by priority, record and retries).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine as _;
use serde_json::{json, Value};

use super::caller::{id_headers, Credential};
use super::chat::submit_options;
use super::errors::ApiError;
use crate::error::{ErrorCode, GatewayError};
use crate::gateway::{parse_embeddings, Caller, EncodingFormat, Gateway};
use crate::task::{Ingress, TaskEvent};

/// One vector as the client asked for it.
fn encode(vector: &[f32], format: EncodingFormat) -> Value {
    match format {
        EncodingFormat::Float => json!(vector),
        EncodingFormat::Base64 => {
            let bytes: Vec<u8> = vector.iter().flat_map(|x| x.to_le_bytes()).collect();
            Value::String(base64::engine::general_purpose::STANDARD.encode(bytes))
        }
    }
}

/// Waits for the whole answer. If the client disconnects, hyper drops this
/// future, the task stream is dropped and the task is cancelled.
pub async fn embeddings(
    State(gw): State<Arc<Gateway>>,
    Credential(cred): Credential,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let (call, format) = gw.prepare_as(
        Caller::Credential(cred.as_deref()),
        &body,
        Ingress::Http,
        submit_options(&headers),
        parse_embeddings,
    )?;
    let model = call.body().model.clone();
    let mut task = gw.submit_call(call).await?;
    let mut data = Vec::new();
    while let Some((_, ev)) = task.recv().await {
        match ev {
            TaskEvent::Accepted { .. }
            | TaskEvent::Queued { .. }
            | TaskEvent::Delta { .. }
            | TaskEvent::ToolCallDelta(_) => {}
            TaskEvent::Embedding { index, vector } => {
                data.push(json!({ "object": "embedding", "index": index, "embedding": encode(&vector, format) }));
            }
            TaskEvent::Done(meta) => {
                let body = json!({
                    "object": "list",
                    "data": data,
                    "model": model,
                    "usage": {
                        "prompt_tokens": meta.usage.input_tokens,
                        "total_tokens": meta.usage.input_tokens,
                    },
                    "edge": serde_json::to_value(&*meta).unwrap_or(Value::Null),
                });
                let mut resp = (StatusCode::OK, Json(body)).into_response();
                id_headers(resp.headers_mut(), &meta.request_id, &meta.task_id, meta.trace_id.as_deref());
                return Ok(resp);
            }
            TaskEvent::Error { error, meta } => return Err(ApiError::Gateway(error, Some(meta))),
        }
    }
    Err(GatewayError::new(ErrorCode::InternalError, "the task ended without a result").into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_is_little_endian_f32() {
        let v = encode(&[1.0, -2.5], EncodingFormat::Base64);
        let bytes = base64::engine::general_purpose::STANDARD.decode(v.as_str().unwrap()).unwrap();
        assert_eq!(bytes, [1.0f32.to_le_bytes(), (-2.5f32).to_le_bytes()].concat());
        assert_eq!(encode(&[0.5], EncodingFormat::Float), json!([0.5]));
    }
}
