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
use crate::task::{ChatMessage, Operation, ToolCallDelta};

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
    /// An assistant turn's calls, arguments as objects (Ollama's form).
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_calls: Option<Vec<Value>>,
    /// A tool result's tool, which Ollama matches calls by.
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_name: Option<String>,
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
    /// The same `{"type": "function", …}` declarations as OpenAI's.
    #[serde(skip_serializing_if = "Option::is_none")]
    tools: Option<&'a [Value]>,
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
    /// Whole calls: `{"function": {"name", "arguments": {…}}}` (newer
    /// versions add `id` and `index`).
    #[serde(default)]
    tool_calls: Vec<Value>,
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

/// NDJSON decoder. Counts the tool calls (Ollama sends each whole, without
/// an index in older versions) and reports `tool_calls` as the finish
/// reason of an answer that made some, as OpenAI-style engines do.
#[derive(Default)]
struct NdjsonDecoder {
    calls: u32,
}

impl LineDecoder for NdjsonDecoder {
    fn line(&mut self, line: &str, out: &mut VecDeque<EngineChunk>) -> Result<bool, EngineError> {
        let line = line.trim();
        if line.is_empty() {
            return Ok(false);
        }
        let mut l: WireLine = serde_json::from_str(line)
            .map_err(|e| EngineError::Protocol(format!("bad NDJSON line ({e}): {}", truncate(line, 120))))?;
        let done = l.done;
        let calls = l.message.as_mut().map(|m| std::mem::take(&mut m.tool_calls)).unwrap_or_default();
        let mut chunks = Vec::<EngineChunk>::try_from(l)?;
        // Calls come before the finish (and usage) of the same line.
        let at = chunks.iter().position(|c| !matches!(c, EngineChunk::Delta(_))).unwrap_or(chunks.len());
        let mut pieces = Vec::with_capacity(calls.len());
        for call in calls {
            let f = call.get("function").cloned().unwrap_or(Value::Null);
            let arguments = match f.get("arguments") {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Null) | None => String::new(),
                Some(v) => v.to_string(),
            };
            pieces.push(EngineChunk::ToolCall(ToolCallDelta {
                index: self.calls,
                id: call.get("id").and_then(Value::as_str).filter(|s| !s.is_empty()).map(str::to_string),
                name: f.get("name").and_then(Value::as_str).map(str::to_string),
                arguments,
            }));
            self.calls += 1;
        }
        chunks.splice(at..at, pieces);
        if self.calls > 0 {
            for c in &mut chunks {
                if let EngineChunk::Finish(r) = c {
                    if r == "stop" {
                        *r = "tool_calls".into();
                    }
                }
            }
        }
        out.extend(chunks);
        Ok(done)
    }
}

/// An OpenAI assistant turn's `tool_calls` in Ollama's form: arguments as
/// a JSON object, not a string.
fn ollama_tool_calls(m: &ChatMessage) -> Option<Vec<Value>> {
    let calls = m.extra.get("tool_calls")?.as_array()?;
    Some(
        calls
            .iter()
            .map(|c| {
                let f = c.get("function").cloned().unwrap_or(Value::Null);
                let args = match f.get("arguments") {
                    Some(Value::String(s)) => serde_json::from_str(s).unwrap_or_else(|_| Value::String(s.clone())),
                    Some(v) => v.clone(),
                    None => Value::Object(Map::new()),
                };
                serde_json::json!({"function": {"name": f.get("name").cloned().unwrap_or(Value::Null), "arguments": args}})
            })
            .collect(),
    )
}

/// The tool a `role: "tool"` message answers: the name of the call with its
/// `tool_call_id` in an earlier assistant turn.
fn answered_tool(messages: &[ChatMessage], m: &ChatMessage) -> Option<String> {
    if m.role != "tool" {
        return None;
    }
    let id = m.extra.get("tool_call_id")?.as_str()?;
    messages.iter().filter_map(|a| a.extra.get("tool_calls")?.as_array()).flatten().find_map(|c| {
        (c.get("id")?.as_str()? == id).then(|| c.get("function")?.get("name")?.as_str().map(str::to_string))?
    })
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
                return {
                    let tp = req.traceparent.as_deref();
                    super::embed::ollama(&self.client, &self.cfg, &req.model, input, *dimensions, tp).await
                }
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
                .map(|m| WireMessage {
                    role: &m.role,
                    content: content_text(m),
                    images: m.extra.get("images"),
                    tool_calls: ollama_tool_calls(m),
                    tool_name: answered_tool(&req.messages, m),
                })
                .collect(),
            prompt,
            raw: prompt.is_some(),
            stream: self.cfg.stream,
            options,
            keep_alive: self.cfg.keep_alive.as_deref(),
            tools: req.tools.as_ref().map(|t| t.tools.as_slice()),
        };
        let path = if prompt.is_some() { "/api/generate" } else { "/api/chat" };
        let rb = super::traced(self.client.post(self.url(path)).json(&body), req.traceparent.as_deref());
        let resp = super::send(rb).await?;
        let status = resp.status();
        if !status.is_success() {
            let text = resp.text().await.unwrap_or_default();
            return Err(EngineError::Status { status: status.as_u16(), body: truncate(&text, 300) });
        }
        // A non-streamed answer is one NDJSON line with `done: true`.
        Ok(decode_lines(resp.bytes_stream(), NdjsonDecoder::default()))
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

    // Residency (`model_api = "ollama"`): `/api/ps` lists the models in
    // memory; a generate without a prompt loads one and answers once it
    // is loaded; `keep_alive: 0` unloads it.
    async fn model_state(&self) -> Option<Result<super::residency::ModelState, EngineError>> {
        use super::residency::ModelState;
        if self.cfg.model_api != crate::config::ModelApi::Ollama {
            return None;
        }
        Some(match self.get_json("/api/ps").await {
            Ok(ps) => {
                let listed = ps.get("models").and_then(Value::as_array).is_some_and(|a| {
                    a.iter()
                        .filter_map(|m| m.get("name").or_else(|| m.get("model")).and_then(Value::as_str))
                        .any(|n| self.same_model(n))
                });
                Ok(if listed { ModelState::Loaded } else { ModelState::Unloaded })
            }
            Err(e) => Err(EngineError::Unreachable(e)),
        })
    }

    async fn load_model(&self) -> Result<(), EngineError> {
        if self.cfg.model_api != crate::config::ModelApi::Ollama {
            return Ok(());
        }
        // edgeway unloads it itself: Ollama keeps it until then, unless
        // the engine's own keep_alive says otherwise.
        let keep_alive = self.cfg.keep_alive.clone().unwrap_or_else(|| "-1".into());
        self.generate_control(serde_json::json!({"model": self.cfg.model, "keep_alive": keep_alive})).await
    }

    async fn unload_model(&self) -> Result<(), EngineError> {
        if self.cfg.model_api != crate::config::ModelApi::Ollama {
            return Ok(());
        }
        self.generate_control(serde_json::json!({"model": self.cfg.model, "keep_alive": 0})).await
    }
}

impl OllamaEngine {
    /// A generate without a prompt: Ollama loads or unloads the model by
    /// its `keep_alive` and answers when done.
    async fn generate_control(&self, body: Value) -> Result<(), EngineError> {
        let r = super::send(self.client.post(self.url("/api/generate")).json(&body)).await?;
        let status = r.status();
        let text = r.text().await.unwrap_or_default();
        if !status.is_success() {
            return Err(EngineError::Status { status: status.as_u16(), body: truncate(&text, 300) });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_tool_calls_become_pieces_and_finish_as_tool_calls() {
        let mut d = NdjsonDecoder::default();
        let mut out = VecDeque::new();
        assert!(d
            .line(r#"{"message":{"role":"assistant","content":"","tool_calls":[{"function":{"name":"get_weather","arguments":{"city":"Oslo"}}},{"function":{"name":"ping","arguments":{}}}]},"done":true,"done_reason":"stop","eval_count":9}"#, &mut out)
            .unwrap());
        let out: Vec<_> = out.into_iter().collect();
        assert_eq!(
            out[0],
            EngineChunk::ToolCall(ToolCallDelta {
                index: 0,
                id: None,
                name: Some("get_weather".into()),
                arguments: r#"{"city":"Oslo"}"#.into()
            })
        );
        assert!(matches!(&out[1], EngineChunk::ToolCall(c) if c.index == 1 && c.arguments == "{}"));
        assert_eq!(out.last(), Some(&EngineChunk::Finish("tool_calls".into())));
    }

    #[test]
    fn final_line_carries_usage_and_reason() {
        let mut d = NdjsonDecoder::default();
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
