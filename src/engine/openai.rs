//! Adapter for OpenAI-compatible servers: llama.cpp's `llama-server`, vLLM,
//! SGLang and cloud APIs. Streams with `stream_options.include_usage` so the
//! engine reports token usage on its last chunk.
//!
//! Load comes from the engine's own endpoints where it has them: busy slots
//! from llama.cpp's `/slots`, KV-cache usage from the Prometheus `/metrics`
//! of vLLM and llama.cpp. An engine without them (a 4xx, or no gauge) is
//! asked again only after a growing pause.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::metrics::{self, Backoff};
use super::wire::{decode_lines, LineDecoder};
use super::{
    truncate, Capabilities, Engine, EngineChunk, EngineError, EngineHealth, EngineLoad, EngineRequest, EngineStream,
};
use crate::config::{EngineConfig, EngineKind};
use crate::task::{ChatMessage, Operation, SamplingParams, ToolCallDelta};

/// Limit of one `/slots` or `/metrics` request: a probe must not hang on
/// an engine that is slow to report.
const LOAD_TIMEOUT: Duration = Duration::from_secs(2);

pub struct OpenAiEngine {
    cfg: EngineConfig,
    client: reqwest::Client,
    url: String,
    /// Legacy text completions (`/v1/completions`).
    completions_url: String,
    slots: Mutex<Backoff>,
    metrics: Mutex<Backoff>,
}

impl OpenAiEngine {
    pub fn new(cfg: EngineConfig, client: reqwest::Client) -> Self {
        let url = format!("{}/v1/chat/completions", cfg.base_url);
        let completions_url = format!("{}/v1/completions", cfg.base_url);
        OpenAiEngine { cfg, client, url, completions_url, slots: Mutex::default(), metrics: Mutex::default() }
    }

    /// GETs an optional load endpoint (`/slots`, `/metrics`) and reads it
    /// with `read`. `None` when it is paused after misses, fails, or has
    /// nothing to read; a 4xx answer or nothing readable counts as a miss.
    async fn read_optional<T>(
        &self,
        path: &str,
        gate: &Mutex<Backoff>,
        read: impl FnOnce(String) -> Option<T>,
    ) -> Option<T> {
        if !gate.lock().expect("backoff").ready(Instant::now()) {
            return None;
        }
        let mut rb = self.client.get(format!("{}{path}", self.cfg.base_url)).timeout(LOAD_TIMEOUT);
        if let Some(key) = &self.cfg.api_key {
            rb = rb.bearer_auth(key);
        }
        // Unreachable or timed out: says nothing about the endpoint.
        let r = rb.send().await.ok()?;
        let status = r.status();
        // llama-server answers 501 for /slots and /metrics unless started
        // with --slots / --metrics; others answer 404.
        if status.is_client_error() || status == reqwest::StatusCode::NOT_IMPLEMENTED {
            gate.lock().expect("backoff").miss(Instant::now());
            return None;
        }
        if !status.is_success() {
            return None;
        }
        let value = r.text().await.ok().and_then(read);
        let mut gate = gate.lock().expect("backoff");
        match value {
            Some(_) => gate.hit(),
            None => gate.miss(Instant::now()),
        }
        value
    }

    fn post(&self, url: &str, body: &WireRequest<'_>, traceparent: Option<&str>) -> reqwest::RequestBuilder {
        let mut rb = super::traced(self.client.post(url).json(body), traceparent);
        if let Some(key) = &self.cfg.api_key {
            rb = rb.bearer_auth(key);
        }
        rb
    }
}

/// llama-server's tokenizer (issue 12, `[engines.X] tokenize`): the
/// number of tokens of `text` by `POST /tokenize`; `special`: with the
/// model's special tokens added (BOS) and parsed (a templated prompt's
/// markers), as the engine does with a prompt. Bounded by `limit`: a
/// caller falls back to an estimate rather than wait.
pub async fn tokenize(
    client: &reqwest::Client,
    cfg: &EngineConfig,
    text: &str,
    special: bool,
    limit: Duration,
) -> Result<u32, EngineError> {
    #[derive(Deserialize)]
    struct Tokens {
        tokens: Vec<Value>,
    }
    let body = serde_json::json!({"content": text, "add_special": special, "parse_special": special});
    let t: Tokens = post_json(client, cfg, "/tokenize", &body, limit).await?;
    Ok(t.tokens.len() as u32)
}

/// llama-server's chat template applied to `messages` (`POST
/// /apply-template`): the prompt text the engine would generate from, for
/// measuring the template's own tokens.
pub async fn apply_template(
    client: &reqwest::Client,
    cfg: &EngineConfig,
    messages: &[ChatMessage],
    limit: Duration,
) -> Result<String, EngineError> {
    #[derive(Deserialize)]
    struct Prompt {
        prompt: String,
    }
    let p: Prompt =
        post_json(client, cfg, "/apply-template", &serde_json::json!({"messages": messages}), limit).await?;
    Ok(p.prompt)
}

async fn post_json<T: serde::de::DeserializeOwned>(
    client: &reqwest::Client,
    cfg: &EngineConfig,
    path: &str,
    body: &Value,
    limit: Duration,
) -> Result<T, EngineError> {
    let mut rb = client.post(format!("{}{path}", cfg.base_url)).json(body).timeout(limit);
    if let Some(key) = &cfg.api_key {
        rb = rb.bearer_auth(key);
    }
    let r = super::send(rb).await?;
    let status = r.status();
    if !status.is_success() {
        let body = r.text().await.unwrap_or_default();
        return Err(EngineError::Status { status: status.as_u16(), body: truncate(&body, 200) });
    }
    r.json().await.map_err(|e| EngineError::Protocol(format!("{path}: {e}")))
}

#[derive(Serialize)]
struct WireRequest<'a> {
    model: &'a str,
    /// Empty for a legacy completion (the driver sends it no messages).
    #[serde(skip_serializing_if = "<[ChatMessage]>::is_empty")]
    messages: &'a [ChatMessage],
    /// A legacy completion's prompt, instead of `messages`.
    #[serde(skip_serializing_if = "Option::is_none")]
    prompt: Option<&'a str>,
    stream: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    stream_options: Option<StreamOptions>,
    max_tokens: u32,
    #[serde(flatten)]
    params: &'a SamplingParams,
    #[serde(skip_serializing_if = "Option::is_none")]
    tools: Option<&'a [Value]>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_choice: Option<&'a Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    parallel_tool_calls: Option<bool>,
    /// llama-server: the slot to run in, and keep its KV cache for the
    /// next request with the same prefix (slot affinity, issue 12).
    #[serde(skip_serializing_if = "Option::is_none")]
    id_slot: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    cache_prompt: Option<bool>,
}

#[derive(Serialize)]
struct StreamOptions {
    include_usage: bool,
}

#[derive(Deserialize)]
struct WireUsage {
    #[serde(default)]
    prompt_tokens: u32,
    #[serde(default)]
    completion_tokens: u32,
}

#[derive(Deserialize)]
struct WireChunk {
    #[serde(default)]
    choices: Vec<WireChoice>,
    usage: Option<WireUsage>,
    error: Option<Value>,
}

#[derive(Deserialize)]
struct WireChoice {
    #[serde(default)]
    delta: Option<WireMessage>,
    #[serde(default)]
    message: Option<WireMessage>,
    /// A legacy completion's text (`/v1/completions`).
    #[serde(default)]
    text: Option<String>,
    finish_reason: Option<String>,
}

#[derive(Deserialize)]
struct WireMessage {
    content: Option<String>,
    #[serde(default)]
    tool_calls: Option<Vec<WireToolCall>>,
}

/// A tool call of a message (whole) or of a delta (a piece). A whole
/// message's calls may lack `index`: their position is it.
#[derive(Deserialize)]
struct WireToolCall {
    index: Option<u32>,
    id: Option<String>,
    function: Option<WireFunction>,
}

#[derive(Deserialize)]
struct WireFunction {
    name: Option<String>,
    arguments: Option<String>,
}

impl TryFrom<WireChunk> for Vec<EngineChunk> {
    type Error = EngineError;

    fn try_from(c: WireChunk) -> Result<Self, EngineError> {
        if let Some(err) = c.error {
            let msg = err.get("message").and_then(Value::as_str).map(str::to_string).unwrap_or_else(|| err.to_string());
            return Err(EngineError::Remote(truncate(&msg, 300)));
        }
        let mut out = Vec::new();
        if let Some(choice) = c.choices.into_iter().next() {
            let (text, calls) = match choice.delta.or(choice.message) {
                Some(m) => (m.content, m.tool_calls.unwrap_or_default()),
                None => (None, Vec::new()),
            };
            // Legacy completions answer in `text`, not in a message.
            let text = text.or(choice.text);
            if let Some(t) = text.filter(|t| !t.is_empty()) {
                out.push(EngineChunk::Delta(t));
            }
            for (i, call) in calls.into_iter().enumerate() {
                let (name, arguments) = match call.function {
                    Some(f) => (f.name.filter(|n| !n.is_empty()), f.arguments.unwrap_or_default()),
                    None => (None, String::new()),
                };
                let index = call.index.unwrap_or(i as u32);
                out.push(EngineChunk::ToolCall(ToolCallDelta {
                    index,
                    id: call.id.filter(|id| !id.is_empty()),
                    name,
                    arguments,
                }));
            }
            if let Some(r) = choice.finish_reason {
                out.push(EngineChunk::Finish(r));
            }
        }
        if let Some(u) = c.usage {
            out.push(EngineChunk::Usage { input_tokens: u.prompt_tokens, output_tokens: u.completion_tokens });
        }
        Ok(out)
    }
}

/// SSE decoder. The answer is complete at `data: [DONE]`. A `Finish`
/// without `[DONE]` is held until the usage chunk or `[DONE]` arrives.
#[derive(Default)]
struct SseDecoder {
    finish: Option<String>,
}

impl LineDecoder for SseDecoder {
    fn line(&mut self, line: &str, out: &mut VecDeque<EngineChunk>) -> Result<bool, EngineError> {
        let Some(data) = line.strip_prefix("data:") else {
            // Comments (": ping"), `event:`/`id:` fields and blank separators.
            return Ok(false);
        };
        let data = data.trim();
        if data == "[DONE]" {
            if let Some(f) = self.finish.take() {
                out.push_back(EngineChunk::Finish(f));
            }
            return Ok(true);
        }
        if data.is_empty() {
            return Ok(false);
        }
        let chunk: WireChunk = serde_json::from_str(data)
            .map_err(|e| EngineError::Protocol(format!("bad SSE chunk ({e}): {}", truncate(data, 120))))?;
        for c in Vec::<EngineChunk>::try_from(chunk)? {
            match c {
                EngineChunk::Finish(f) => self.finish = Some(f),
                other => out.push_back(other),
            }
        }
        Ok(false)
    }

    /// Some servers close after the finishing chunk without `[DONE]`.
    fn eof(&mut self, out: &mut VecDeque<EngineChunk>) -> bool {
        match self.finish.take() {
            Some(f) => {
                out.push_back(EngineChunk::Finish(f));
                true
            }
            None => false,
        }
    }
}

#[async_trait]
impl Engine for OpenAiEngine {
    fn name(&self) -> &str {
        &self.cfg.name
    }

    fn kind(&self) -> EngineKind {
        EngineKind::OpenAi
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
                    super::embed::openai(&self.client, &self.cfg, &req.model, input, *dimensions, tp).await
                }
            }
        };
        let stream = self.cfg.stream;
        let body = WireRequest {
            model: &req.model,
            messages: &req.messages,
            prompt,
            stream,
            stream_options: stream.then_some(StreamOptions { include_usage: true }),
            max_tokens: req.max_output_tokens,
            params: &req.params,
            tools: req.tools.as_ref().map(|t| t.tools.as_slice()),
            tool_choice: req.tools.as_ref().and_then(|t| t.tool_choice.as_ref()),
            parallel_tool_calls: req.tools.as_ref().and_then(|t| t.parallel_tool_calls),
            id_slot: req.slot,
            cache_prompt: req.slot.map(|_| true),
        };
        let url = if prompt.is_some() { &self.completions_url } else { &self.url };
        let resp = super::send(self.post(url, &body, req.traceparent.as_deref())).await?;
        let status = resp.status();
        if !status.is_success() {
            let text = resp.text().await.unwrap_or_default();
            return Err(EngineError::Status { status: status.as_u16(), body: truncate(&text, 300) });
        }
        if stream {
            return Ok(decode_lines(resp.bytes_stream(), SseDecoder::default()));
        }
        let fut = async move {
            let bytes = resp.bytes().await.map_err(|_| EngineError::Truncated)?;
            let chunk: WireChunk = serde_json::from_slice(&bytes)
                .map_err(|e| EngineError::Protocol(format!("bad completion body: {e}")))?;
            if chunk.choices.is_empty() && chunk.error.is_none() {
                return Err(EngineError::Protocol("completion without choices".into()));
            }
            let mut chunks = Vec::<EngineChunk>::try_from(chunk)?;
            // Keep the documented order: deltas, usage, then finish last.
            chunks.sort_by_key(|c| matches!(c, EngineChunk::Finish(_)));
            Ok::<_, EngineError>(chunks)
        };
        Ok(futures::stream::once(fut)
            .flat_map(|r| match r {
                Ok(v) => futures::stream::iter(v.into_iter().map(Ok).collect::<Vec<_>>()),
                Err(e) => futures::stream::iter(vec![Err(e)]),
            })
            .boxed())
    }

    async fn load(&self) -> EngineLoad {
        let slots = self.read_optional("/slots", &self.slots, |body| {
            let v: Value = serde_json::from_str(&body).ok()?;
            Some(v.as_array()?.iter().filter(|s| s.get("is_processing").and_then(Value::as_bool) == Some(true)).count())
        });
        let kv = self.read_optional("/metrics", &self.metrics, |body| metrics::kv_cache_usage(&body));
        let (busy_slots, kv_cache_usage) = tokio::join!(slots, kv);
        EngineLoad { busy_slots, kv_cache_usage, takes_from: None }
    }

    // Residency (`model_api = "llama-router"`): llama-server in router
    // mode, see `residency` for the endpoints.
    async fn model_state(&self) -> Option<Result<super::residency::ModelState, EngineError>> {
        if self.cfg.model_api != crate::config::ModelApi::LlamaRouter {
            return None;
        }
        Some(self.router_state().await)
    }

    async fn load_model(&self) -> Result<(), EngineError> {
        if self.cfg.model_api != crate::config::ModelApi::LlamaRouter {
            return Ok(());
        }
        match self.router_state().await? {
            super::residency::ModelState::Loaded => return Ok(()),
            super::residency::ModelState::Loading => {}
            _ => self.router_post("/models/load").await?,
        }
        super::residency::await_loaded(|| self.router_state()).await
    }

    async fn unload_model(&self) -> Result<(), EngineError> {
        if self.cfg.model_api != crate::config::ModelApi::LlamaRouter {
            return Ok(());
        }
        match self.router_post("/models/unload").await {
            // "model is not running": nothing to unload.
            Err(EngineError::Status { status: 400, .. }) => return Ok(()),
            Err(e) => return Err(e),
            Ok(()) => {}
        }
        // The router answers at once and stops the model's process in the
        // background; `/models` says `loaded` until it is gone. Returning
        // earlier would let a probe read the model back as loaded (the
        // real llama-server did, in tests/e2e/test_residency.py).
        for _ in 0..600 {
            if self.router_state().await? != super::residency::ModelState::Loaded {
                return Ok(());
            }
            tokio::time::sleep(super::residency::LOAD_POLL).await;
        }
        Err(EngineError::Remote("the engine did not unload the model".into()))
    }

    async fn health(&self) -> EngineHealth {
        if self.cfg.model_api == crate::config::ModelApi::LlamaRouter {
            // The router's model list is its health check and says whether
            // the model is in memory (the scheduler counts its weights by
            // it).
            return match self.router_state().await {
                Ok(s) => EngineHealth {
                    up: true,
                    detail: "ok".into(),
                    model_resident: match s {
                        super::residency::ModelState::Loaded => Some(true),
                        super::residency::ModelState::Loading => None,
                        _ => Some(false),
                    },
                },
                Err(e) => EngineHealth { up: false, detail: e.class(), model_resident: None },
            };
        }
        let url = format!("{}{}", self.cfg.base_url, self.cfg.health_path);
        let mut rb = self.client.get(url).timeout(self.cfg.health_interval.max(std::time::Duration::from_secs(1)));
        if let Some(key) = &self.cfg.api_key {
            rb = rb.bearer_auth(key);
        }
        match rb.send().await {
            Ok(r) if r.status().is_success() => EngineHealth { up: true, detail: "ok".into(), model_resident: None },
            // llama-server answers 503 while it loads the model.
            Ok(r) => EngineHealth { up: false, detail: format!("HTTP {}", r.status().as_u16()), model_resident: None },
            Err(e) => {
                EngineHealth { up: false, detail: format!("unreachable: {}", e.without_url()), model_resident: None }
            }
        }
    }
}

impl OpenAiEngine {
    /// The model's status in llama-server's router list (`GET /models`).
    async fn router_state(&self) -> Result<super::residency::ModelState, EngineError> {
        use super::residency::ModelState;
        let r = super::send(self.client.get(format!("{}/models", self.cfg.base_url)).timeout(LOAD_TIMEOUT)).await?;
        let status = r.status();
        if !status.is_success() {
            return Err(EngineError::Status { status: status.as_u16(), body: String::new() });
        }
        let v: Value = r.json().await.map_err(|e| EngineError::Protocol(format!("model list: {e}")))?;
        let entry = v
            .get("data")
            .and_then(Value::as_array)
            .and_then(|a| a.iter().find(|m| m.get("id").and_then(Value::as_str) == Some(self.cfg.model.as_str())))
            .ok_or_else(|| EngineError::Protocol(format!("model {} is not in the engine's list", self.cfg.model)))?;
        let st = entry.get("status").unwrap_or(&Value::Null);
        Ok(match st.get("value").and_then(Value::as_str) {
            // A sleeping model wakes at the next request.
            Some("loaded") | Some("sleeping") => ModelState::Loaded,
            Some("loading") | Some("downloading") => ModelState::Loading,
            _ if st.get("failed").and_then(Value::as_bool) == Some(true) => ModelState::Failed,
            _ => ModelState::Unloaded,
        })
    }

    async fn router_post(&self, path: &str) -> Result<(), EngineError> {
        let body = serde_json::json!({"model": self.cfg.model});
        let r = super::send(self.client.post(format!("{}{path}", self.cfg.base_url)).json(&body)).await?;
        let status = r.status();
        if !status.is_success() {
            let text = r.text().await.unwrap_or_default();
            return Err(EngineError::Status { status: status.as_u16(), body: truncate(&text, 300) });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(lines: &[&str]) -> (Vec<EngineChunk>, bool) {
        let mut d = SseDecoder::default();
        let mut out = VecDeque::new();
        let mut done = false;
        for l in lines {
            done = d.line(l, &mut out).unwrap();
        }
        (out.into_iter().collect(), done)
    }

    #[test]
    fn finish_comes_after_usage() {
        let (chunks, done) = decode(&[
            r#"data: {"choices":[{"delta":{"role":"assistant","content":""}}]}"#,
            r#"data: {"choices":[{"delta":{"content":"Hi"},"finish_reason":null}]}"#,
            r#"data: {"choices":[{"delta":{},"finish_reason":"length"}]}"#,
            r#"data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":1,"total_tokens":6}}"#,
            "",
            "data: [DONE]",
        ]);
        assert!(done);
        assert_eq!(
            chunks,
            vec![
                EngineChunk::Delta("Hi".into()),
                EngineChunk::Usage { input_tokens: 5, output_tokens: 1 },
                EngineChunk::Finish("length".into())
            ]
        );
    }

    #[test]
    fn tool_call_pieces_are_decoded_in_order() {
        let (chunks, _) = decode(&[
            r#"data: {"choices":[{"delta":{"role":"assistant","content":null,"tool_calls":[{"index":0,"id":"call_1","type":"function","function":{"name":"get_weather","arguments":""}}]}}]}"#,
            r#"data: {"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\"city\":"}}]}}]}"#,
            r#"data: {"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"arguments":"\"Oslo\"}"}}]},"finish_reason":"tool_calls"}]}"#,
            "data: [DONE]",
        ]);
        let piece = |id: Option<&str>, name: Option<&str>, a: &str| {
            EngineChunk::ToolCall(ToolCallDelta {
                index: 0,
                id: id.map(str::to_string),
                name: name.map(str::to_string),
                arguments: a.into(),
            })
        };
        assert_eq!(
            chunks,
            vec![
                piece(Some("call_1"), Some("get_weather"), ""),
                piece(None, None, "{\"city\":"),
                piece(None, None, "\"Oslo\"}"),
                EngineChunk::Finish("tool_calls".into())
            ]
        );
    }

    #[test]
    fn error_objects_become_remote_errors() {
        let mut d = SseDecoder::default();
        let mut out = VecDeque::new();
        let e = d.line(r#"data: {"error":{"message":"context overflow"}}"#, &mut out).unwrap_err();
        assert!(matches!(e, EngineError::Remote(m) if m == "context overflow"));
    }
}
