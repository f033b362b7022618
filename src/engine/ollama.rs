//! Adapter for Ollama's native API: `/api/chat` (NDJSON stream), `/api/tags`
//! (installed models) and `/api/ps` (models in memory), with `keep_alive`.

use std::collections::VecDeque;
use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::wire::{decode_lines, LineDecoder};
use super::{truncate, Capabilities, Engine, EngineChunk, EngineError, EngineHealth, EngineRequest, EngineStream};
use crate::config::{EngineConfig, EngineKind};
use crate::task::{ChatMessage, Operation};

pub struct OllamaEngine {
    cfg: EngineConfig,
    client: reqwest::Client,
}

impl OllamaEngine {
    pub fn new(cfg: EngineConfig, client: reqwest::Client) -> Self {
        OllamaEngine { cfg, client }
    }

    fn url(&self, path: &str) -> String {
        format!("{}{}", self.cfg.base_url, path)
    }

    async fn get_json(&self, path: &str) -> Result<Value, String> {
        let r = self
            .client
            .get(self.url(path))
            .timeout(self.cfg.health_interval.max(Duration::from_secs(1)))
            .send()
            .await
            .map_err(|e| format!("unreachable: {}", e.without_url()))?;
        if !r.status().is_success() {
            return Err(format!("HTTP {}", r.status().as_u16()));
        }
        r.json::<Value>().await.map_err(|e| format!("bad body: {e}"))
    }

    /// Ollama names models `name:tag`; a bare name means `:latest`.
    fn same_model(&self, listed: &str) -> bool {
        let want = &self.cfg.model;
        listed == want || (!want.contains(':') && listed == format!("{want}:latest"))
    }
}

#[derive(Serialize)]
struct WireMessage<'a> {
    role: &'a str,
    content: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    images: Option<&'a Value>,
}

#[derive(Serialize)]
struct WireRequest<'a> {
    model: &'a str,
    /// Empty for a legacy completion (the driver sends it no messages).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    messages: Vec<WireMessage<'a>>,
    /// A legacy completion's prompt (`/api/generate`), sent `raw`: no chat
    /// template around it.
    #[serde(skip_serializing_if = "Option::is_none")]
    prompt: Option<&'a str>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    raw: bool,
    stream: bool,
    options: Map<String, Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    keep_alive: Option<&'a str>,
}

#[derive(Deserialize)]
struct WireLine {
    message: Option<WireContent>,
    /// `/api/generate`'s text.
    response: Option<String>,
    #[serde(default)]
    done: bool,
    done_reason: Option<String>,
    prompt_eval_count: Option<u32>,
    eval_count: Option<u32>,
    error: Option<String>,
}

#[derive(Deserialize)]
struct WireContent {
    #[serde(default)]
    content: String,
}

impl TryFrom<WireLine> for Vec<EngineChunk> {
    type Error = EngineError;

    fn try_from(l: WireLine) -> Result<Self, EngineError> {
        if let Some(e) = l.error {
            return Err(EngineError::Remote(truncate(&e, 300)));
        }
        let mut out = Vec::new();
        if let Some(m) = l.message.filter(|m| !m.content.is_empty()) {
            out.push(EngineChunk::Delta(m.content));
        }
        if let Some(t) = l.response.filter(|t| !t.is_empty()) {
            out.push(EngineChunk::Delta(t));
        }
        if l.done {
            if l.prompt_eval_count.is_some() || l.eval_count.is_some() {
                out.push(EngineChunk::Usage {
                    input_tokens: l.prompt_eval_count.unwrap_or(0),
                    output_tokens: l.eval_count.unwrap_or(0),
                });
            }
            out.push(EngineChunk::Finish(l.done_reason.unwrap_or_else(|| "stop".into())));
        }
        Ok(out)
    }
}

/// Flattens OpenAI content parts to Ollama's plain text content.
fn content_text(m: &ChatMessage) -> String {
    match &m.content {
        Value::String(s) => s.clone(),
        Value::Array(parts) => {
            parts.iter().filter_map(|p| p.get("text").and_then(Value::as_str)).collect::<Vec<_>>().join("\n")
        }
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

struct NdjsonDecoder;

impl LineDecoder for NdjsonDecoder {
    fn line(&mut self, line: &str, out: &mut VecDeque<EngineChunk>) -> Result<bool, EngineError> {
        let line = line.trim();
        if line.is_empty() {
            return Ok(false);
        }
        let l: WireLine = serde_json::from_str(line)
            .map_err(|e| EngineError::Protocol(format!("bad NDJSON line ({e}): {}", truncate(line, 120))))?;
        let done = l.done;
        out.extend(Vec::<EngineChunk>::try_from(l)?);
        Ok(done)
    }
}

#[async_trait]
impl Engine for OllamaEngine {
    fn name(&self) -> &str {
        &self.cfg.name
    }

    fn kind(&self) -> EngineKind {
        EngineKind::Ollama
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities { streaming: self.cfg.stream, reports_usage: true, cancel_on_disconnect: true }
    }

    async fn stream(&self, req: &EngineRequest) -> Result<EngineStream, EngineError> {
        let prompt = match &req.operation {
            Operation::Chat => None,
            Operation::Completion { prompt } => Some(prompt.as_str()),
            Operation::Embedding { input, dimensions } => {
                return super::embed::ollama(&self.client, &self.cfg, &req.model, input, *dimensions).await
            }
        };
        let mut options = Map::new();
        options.insert("num_predict".into(), req.max_output_tokens.into());
        let p = serde_json::to_value(&req.params).unwrap_or_default();
        if let Value::Object(map) = p {
            for (k, v) in map {
                options.insert(k, v);
            }
        }
        let body = WireRequest {
            model: &req.model,
            messages: req
                .messages
                .iter()
                .map(|m| WireMessage { role: &m.role, content: content_text(m), images: m.extra.get("images") })
                .collect(),
            prompt,
            raw: prompt.is_some(),
            stream: self.cfg.stream,
            options,
            keep_alive: self.cfg.keep_alive.as_deref(),
        };
        let path = if prompt.is_some() { "/api/generate" } else { "/api/chat" };
        let resp = super::send(self.client.post(self.url(path)).json(&body)).await?;
        let status = resp.status();
        if !status.is_success() {
            let text = resp.text().await.unwrap_or_default();
            return Err(EngineError::Status { status: status.as_u16(), body: truncate(&text, 300) });
        }
        // A non-streamed answer is one NDJSON line with `done: true`.
        Ok(decode_lines(resp.bytes_stream(), NdjsonDecoder))
    }

    async fn health(&self) -> EngineHealth {
        let tags = match self.get_json(&self.cfg.health_path).await {
            Ok(v) => v,
            Err(detail) => return EngineHealth { up: false, detail, model_resident: None },
        };
        let names = |v: &Value| -> Vec<String> {
            v.get("models")
                .and_then(Value::as_array)
                .map(|a| {
                    a.iter()
                        .filter_map(|m| m.get("name").or_else(|| m.get("model")).and_then(Value::as_str))
                        .map(str::to_string)
                        .collect()
                })
                .unwrap_or_default()
        };
        if self.cfg.health_path == "/api/tags" && !names(&tags).iter().any(|n| self.same_model(n)) {
            return EngineHealth {
                up: false,
                detail: format!("model {} is not installed (ollama pull it)", self.cfg.model),
                model_resident: Some(false),
            };
        }
        let resident = self.get_json("/api/ps").await.ok().map(|ps| names(&ps).iter().any(|n| self.same_model(n)));
        EngineHealth { up: true, detail: "ok".into(), model_resident: resident }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn final_line_carries_usage_and_reason() {
        let mut d = NdjsonDecoder;
        let mut out = VecDeque::new();
        assert!(!d.line(r#"{"message":{"role":"assistant","content":"Hel"},"done":false}"#, &mut out).unwrap());
        assert!(d
            .line(r#"{"message":{"role":"assistant","content":""},"done":true,"done_reason":"length","prompt_eval_count":7,"eval_count":3}"#, &mut out)
            .unwrap());
        assert_eq!(
            out.into_iter().collect::<Vec<_>>(),
            vec![
                EngineChunk::Delta("Hel".into()),
                EngineChunk::Usage { input_tokens: 7, output_tokens: 3 },
                EngineChunk::Finish("length".into())
            ]
        );
    }
}
