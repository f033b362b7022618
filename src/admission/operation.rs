//! The two OpenAI request shapes besides chat: legacy text completions
//! (`POST /v1/completions`) and embeddings (`POST /v1/embeddings`).
//!
//! Owns: reading those bodies into the shared [`ChatRequestBody`] (so the
//! edge fields, rights, limits and timeouts are admitted exactly as for a
//! chat, by [`super::admit`]) with the [`Operation`] that says what the
//! engine is asked; refusing what edgeway cannot honour with a clear
//! `INVALID_REQUEST`; and the checks `admit` makes per operation (the
//! model's kind, embedding inputs against the context window, the request
//! digest). Does not own: the response shapes (the HTTP ingress) or the
//! engine calls (the adapters).

use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};

use super::request::{parse_body, ChatRequestBody};
use crate::config::{ModelConfig, ModelKind};
use crate::context;
use crate::error::{ErrorCode, GatewayError};
use crate::task::{ChatMessage, Operation, Priority};

/// Inputs one embedding request may carry (OpenAI's own limit).
pub const MAX_EMBEDDING_INPUTS: usize = 2048;

/// The priority of an embedding request that names none: the batch lane,
/// whatever its application's default.
pub const EMBEDDING_PRIORITY: Priority = Priority::P4;

/// How the client wants its vectors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EncodingFormat {
    Float,
    /// Little-endian `f32` bytes, base64 (what the OpenAI SDKs ask for by
    /// default).
    Base64,
}

fn object(bytes: &[u8]) -> Result<Map<String, Value>, GatewayError> {
    match serde_json::from_slice::<Value>(bytes) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(GatewayError::invalid("the body must be a JSON object")),
        Err(e) => Err(GatewayError::invalid(format!("body is not valid JSON: {e}"))),
    }
}

/// Fields OpenAI defines that edgeway cannot honour: refused, never
/// silently dropped.
fn refuse_present(m: &Map<String, Value>, fields: &[(&str, &str)]) -> Result<(), GatewayError> {
    for (field, why) in fields {
        if m.get(*field).is_some_and(|v| !v.is_null() && *v != Value::Bool(false)) {
            return Err(GatewayError::invalid(format!("'{field}' is not supported: {why}")));
        }
    }
    Ok(())
}

/// A `POST /v1/completions` body: `prompt` (a string, or a list of one),
/// `max_tokens`, `temperature`, `top_p`, `stop`, `stream`, `seed`, `user`
/// and the edge fields.
pub fn parse_completion(bytes: &[u8]) -> Result<ChatRequestBody, GatewayError> {
    let mut m = object(bytes)?;
    refuse_present(
        &m,
        &[
            ("echo", "the prompt is not sent back"),
            ("logprobs", "no log probabilities are reported"),
            ("suffix", "no insertion mode"),
            ("messages", "send chat to /v1/chat/completions"),
        ],
    )?;
    // Tool calling is a chat feature: a legacy completion has no messages
    // to carry the calls back, so any of its fields is refused (even
    // `parallel_tool_calls: false`, which `refuse_present` would pass).
    for field in ["tools", "tool_choice", "parallel_tool_calls", "functions", "function_call"] {
        if m.get(field).is_some_and(|v| !v.is_null()) {
            return Err(GatewayError::invalid(format!(
                "'{field}' is not supported by /v1/completions: tool calling is a chat feature \
                 (POST /v1/chat/completions)"
            )));
        }
    }
    for (field, what) in [("best_of", "best_of"), ("n", "n")] {
        match m.get(field) {
            None | Some(Value::Null) => {}
            Some(v) if v.as_u64() == Some(1) => {}
            Some(_) => return Err(GatewayError::invalid(format!("only {what} = 1 is supported"))),
        }
    }
    let prompt = match m.remove("prompt") {
        Some(Value::String(s)) => s,
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => a[0].as_str().unwrap_or_default().to_string(),
        Some(Value::Array(a)) if a.iter().all(Value::is_string) => {
            return Err(GatewayError::invalid(format!(
                "'prompt' is a list of {} prompts; send one per request",
                a.len()
            )))
        }
        Some(Value::Array(_)) => {
            return Err(GatewayError::invalid("'prompt' as token ids is not supported; send the text"))
        }
        None | Some(Value::Null) => return Err(GatewayError::invalid("'prompt' is required")),
        Some(_) => return Err(GatewayError::invalid("'prompt' must be a string")),
    };
    if prompt.is_empty() {
        return Err(GatewayError::invalid("'prompt' must not be empty"));
    }
    m.insert("messages".into(), json!([{ "role": "user", "content": prompt }]));
    let mut body = parse_body(&serde_json::to_vec(&m).unwrap_or_default())?;
    body.operation = Operation::Completion { prompt };
    Ok(body)
}

/// A `POST /v1/embeddings` body: `input` (a string or a list of strings),
/// `model`, `encoding_format`, `dimensions`, `user` and the edge fields.
pub fn parse_embeddings(bytes: &[u8]) -> Result<(ChatRequestBody, EncodingFormat), GatewayError> {
    let mut m = object(bytes)?;
    refuse_present(&m, &[("stream", "embeddings come whole"), ("messages", "send the text as 'input'")])?;
    let format = match m.remove("encoding_format") {
        None | Some(Value::Null) => EncodingFormat::Float,
        Some(Value::String(s)) if s == "float" => EncodingFormat::Float,
        Some(Value::String(s)) if s == "base64" => EncodingFormat::Base64,
        Some(v) => {
            return Err(GatewayError::invalid(format!("'encoding_format' must be \"float\" or \"base64\", not {v}")))
        }
    };
    let dimensions = match m.remove("dimensions") {
        None | Some(Value::Null) => None,
        Some(v) => match v.as_u64() {
            Some(d) if (1..=65536).contains(&d) => Some(d as u32),
            _ => return Err(GatewayError::invalid("'dimensions' must be a whole number from 1 to 65536")),
        },
    };
    let token_ids = || GatewayError::invalid("'input' as token ids is not supported; send the text");
    let input: Vec<String> = match m.remove("input") {
        Some(Value::String(s)) => vec![s],
        Some(Value::Array(a)) if a.is_empty() => return Err(GatewayError::invalid("'input' must not be empty")),
        Some(Value::Array(a)) => a
            .into_iter()
            .map(|v| if let Value::String(s) = v { Ok(s) } else { Err(token_ids()) })
            .collect::<Result<_, _>>()?,
        None | Some(Value::Null) => return Err(GatewayError::invalid("'input' is required")),
        Some(Value::Number(_)) => return Err(token_ids()),
        Some(_) => return Err(GatewayError::invalid("'input' must be a string or a list of strings")),
    };
    if input.len() > MAX_EMBEDDING_INPUTS {
        return Err(GatewayError::invalid(format!(
            "'input' has {} items; at most {MAX_EMBEDDING_INPUTS} per request",
            input.len()
        )));
    }
    if let Some(i) = input.iter().position(String::is_empty) {
        return Err(GatewayError::invalid(format!("input[{i}] is empty")));
    }
    // One user message per input: what the context estimate, the record
    // and recovery read. The engine gets the inputs themselves.
    let messages: Vec<Value> = input.iter().map(|t| json!({ "role": "user", "content": t })).collect();
    m.insert("messages".into(), Value::Array(messages));
    // Nothing is generated: one token of budget keeps the output
    // accounting (rates, memory estimates) at its least.
    for k in ["max_tokens", "max_completion_tokens"] {
        m.remove(k);
    }
    m.insert("max_output_tokens".into(), 1.into());
    // The batch lane: bulk indexing waits behind every chat unless the
    // request names a priority (a query embedded while a user waits may).
    if m.get("priority").is_none_or(Value::is_null) {
        m.insert("priority".into(), EMBEDDING_PRIORITY.as_str().into());
    }
    let mut body = parse_body(&serde_json::to_vec(&m).unwrap_or_default())?;
    body.operation = Operation::Embedding { input, dimensions };
    Ok((body, format))
}

/// Refuses a model that does not serve `op` (a chat model asked for
/// embeddings or the other way round) and what the model cannot do
/// (`dimensions`), naming the model.
pub fn check_model(model: &ModelConfig, op: &Operation, idempotency_key: Option<&str>) -> Result<(), GatewayError> {
    let wants = match op {
        Operation::Embedding { .. } => ModelKind::Embedding,
        Operation::Chat | Operation::Completion { .. } => ModelKind::Chat,
    };
    if model.kind != wants {
        let what = match op {
            Operation::Chat => "chat",
            Operation::Completion { .. } => "text completions",
            Operation::Embedding { .. } => "embeddings",
        };
        return Err(GatewayError::invalid(format!(
            "model '{}' is a {} model and does not serve {what}; GET /v1/models lists each model's kind",
            model.name,
            model.kind.as_str()
        )));
    }
    if let Operation::Embedding { dimensions: Some(_), .. } = op {
        if !model.supports_dimensions {
            return Err(GatewayError::invalid(format!(
                "model '{}' does not support 'dimensions'; leave it out for the model's own size",
                model.name
            )));
        }
    }
    // A finished task's repeat is answered from the stored text, which an
    // embedding does not have; they are deterministic, so a plain retry
    // gives the same vectors.
    if matches!(op, Operation::Embedding { .. }) && idempotency_key.is_some() {
        return Err(GatewayError::invalid(
            "idempotency keys are not supported for embeddings (they are deterministic: send the request again)",
        ));
    }
    Ok(())
}

/// Each input of an embedding request is embedded on its own, so each must
/// fit the model's context window (the whole list need not).
pub fn embedding_inputs_fit(model: &ModelConfig, messages: &[ChatMessage]) -> Result<(), GatewayError> {
    for (i, m) in messages.iter().enumerate() {
        let n = context::estimate_tokens(std::slice::from_ref(m));
        if n > model.context_tokens {
            return Err(GatewayError::new(
                ErrorCode::ContextTooLarge,
                format!(
                    "input[{i}] is about {n} tokens; model '{}' takes at most {}",
                    model.name, model.context_tokens
                ),
            ));
        }
    }
    Ok(())
}

/// The request digest of an operation other than chat: over the operation
/// itself, so that a completion and a chat of the same text never pass
/// for repeats of each other under one idempotency key.
pub fn digest(op: &Operation) -> String {
    hex::encode(Sha256::digest(serde_json::to_vec(op).unwrap_or_default()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn completion_prompts_are_one_string() {
        let b = parse_completion(br#"{"model":"m","prompt":["Once"],"max_tokens":3}"#).unwrap();
        assert_eq!(b.operation, Operation::Completion { prompt: "Once".into() });
        assert_eq!(b.max_tokens, Some(3));
        for (bad, says) in [
            (r#"{"model":"m","prompt":["a","b"]}"#, "send one per request"),
            (r#"{"model":"m","prompt":[1,2]}"#, "token ids"),
            (r#"{"model":"m","prompt":"a","echo":true}"#, "'echo'"),
            (r#"{"model":"m","prompt":"a","logprobs":2}"#, "'logprobs'"),
            (r#"{"model":"m","prompt":"a","best_of":2}"#, "best_of = 1"),
            (r#"{"model":"m","prompt":"a","n":3}"#, "n = 1"),
            (r#"{"model":"m"}"#, "'prompt' is required"),
        ] {
            let e = parse_completion(bad.as_bytes()).unwrap_err();
            assert_eq!(e.code, ErrorCode::InvalidRequest, "{bad}");
            assert!(e.message.contains(says), "{bad}: {}", e.message);
        }
        // `echo: false`, `n: 1` are what some clients always send.
        parse_completion(br#"{"model":"m","prompt":"a","echo":false,"n":1,"best_of":1}"#).unwrap();
    }

    #[test]
    fn embedding_inputs_and_formats() {
        let (b, f) = parse_embeddings(br#"{"model":"e","input":["a","b"],"encoding_format":"base64"}"#).unwrap();
        assert_eq!(f, EncodingFormat::Base64);
        assert_eq!(b.messages.len(), 2);
        assert_eq!(b.operation, Operation::Embedding { input: vec!["a".into(), "b".into()], dimensions: None });
        assert_eq!(b.priority.as_deref(), Some("P4"), "the batch lane by default");
        let (b, f) = parse_embeddings(br#"{"model":"e","input":"a","dimensions":8,"priority":"P2"}"#).unwrap();
        assert_eq!(b.priority.as_deref(), Some("P2"), "a priority it names is kept");
        assert_eq!(f, EncodingFormat::Float);
        assert_eq!(b.operation, Operation::Embedding { input: vec!["a".into()], dimensions: Some(8) });
        for (bad, says) in [
            (r#"{"model":"e","input":[[1,2]]}"#, "token ids"),
            (r#"{"model":"e","input":[]}"#, "must not be empty"),
            (r#"{"model":"e","input":["a",""]}"#, "input[1] is empty"),
            (r#"{"model":"e","input":"a","encoding_format":"int8"}"#, "encoding_format"),
            (r#"{"model":"e","input":"a","dimensions":0}"#, "dimensions"),
            (r#"{"model":"e"}"#, "'input' is required"),
        ] {
            let e = parse_embeddings(bad.as_bytes()).unwrap_err();
            assert_eq!(e.code, ErrorCode::InvalidRequest, "{bad}");
            assert!(e.message.contains(says), "{bad}: {}", e.message);
        }
    }
}
