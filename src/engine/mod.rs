//! Engine adapters: one trait ([`Engine`]) in front of every inference
//! server, one file per wire protocol family.
//!
//! Owns: talking to engines (requests, streams, health and load readings)
//! and translating their wire formats into [`EngineChunk`]s and
//! [`EngineError`]s. Does not own: which instance runs a task, whether a
//! failed request is sent again, health probing, or what a client is told
//! (all in `router`, which also turns an [`EngineError`] into a public error
//! code; engine text never reaches a client). Imports nothing of the
//! pipeline above it.
//!
//! # Cancel safety
//! An [`EngineStream`] owns the engine's HTTP response. Dropping it closes
//! the connection, which is how llama.cpp, vLLM and Ollama learn that the
//! client is gone and stop generating. There is no separate cancel call.

mod embed;
mod metrics;
pub mod ollama;
pub mod openai;
pub mod pool;
pub mod residency;
pub mod supervisor;
mod wire;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::stream::BoxStream;

use crate::config::{EngineConfig, EngineKind};
use crate::task::{ChatMessage, Operation, SamplingParams, ToolCallDelta, ToolSet};

/// What an engine is asked to do: the engine-side model name and the chat
/// (or, by `operation`, a text completion or embeddings).
#[derive(Debug, Clone)]
pub struct EngineRequest {
    pub model: String,
    pub messages: Vec<ChatMessage>,
    pub params: SamplingParams,
    pub max_output_tokens: u32,
    /// Tools the model may call (only sent to instances configured with
    /// `tools = true`; admission sees to that).
    pub tools: Option<ToolSet>,
    /// `Chat` uses `messages`; the others carry their own input.
    pub operation: Operation,
    /// llama-server's slot for it (`id_slot`, with `cache_prompt`), when
    /// its instance has slot affinity.
    pub slot: Option<u32>,
    /// The W3C `traceparent` header of this call (the task's trace id, a
    /// span id of its own), sent to the engine as it is.
    pub traceparent: Option<String>,
    /// Who the task is, for a `pool` instance that forwards it to another
    /// node (`None` for every other instance).
    pub origin: Option<Arc<pool::Origin>>,
}

/// One piece of an engine's answer, in the order the engine sent it.
#[derive(Debug, Clone, PartialEq)]
pub enum EngineChunk {
    Delta(String),
    /// A piece of a tool call (OpenAI-style engines stream them; Ollama
    /// sends each call whole, as one piece).
    ToolCall(ToolCallDelta),
    /// Token counts reported by the engine itself.
    Usage {
        input_tokens: u32,
        output_tokens: u32,
    },
    /// Why generation ended (`stop`, `length`, …). The stream ends after it
    /// (possibly after a `Usage`).
    Finish(String),
    /// The vector of input `index` of an embedding request. All of them
    /// come at once, after the engine's whole answer was read, so an
    /// engine that fails never leaves part of them behind.
    Embedding {
        index: u32,
        vector: Vec<f32>,
    },
}

pub type EngineStream = BoxStream<'static, Result<EngineChunk, EngineError>>;

/// What went wrong talking to an engine. Stays inside edgeway: the router
/// maps it to `MODEL_UNAVAILABLE` or `INTERNAL_ERROR` for the client.
#[derive(Debug, Clone, thiserror::Error)]
pub enum EngineError {
    #[error("cannot reach engine: {0}")]
    Unreachable(String),
    /// The connection broke after the request was written and before any
    /// answer (the engine closed a kept-alive connection just as it was
    /// reused: hyper's "connection closed before message completed"). The
    /// engine saw no complete request, so sending it again is safe; the
    /// router does so once.
    #[error("engine connection closed before any answer: {0}")]
    ConnectionLost(String),
    #[error("engine answered HTTP {status}: {body}")]
    Status { status: u16, body: String },
    #[error("engine reported an error: {0}")]
    Remote(String),
    #[error("engine broke the protocol: {0}")]
    Protocol(String),
    #[error("engine stream ended before the answer was complete")]
    Truncated,
}

impl EngineError {
    /// What the failure was, for a task's record and events, without any
    /// of the engine's own text: an engine's error body may echo the
    /// prompt or internal details (paths, addresses, versions), and the
    /// record is returned to callers (`GET /v1/tasks/{id}`, events). The
    /// text itself is logged at debug level only.
    pub fn class(&self) -> String {
        match self {
            EngineError::Unreachable(_) => "engine not reachable".into(),
            EngineError::ConnectionLost(_) => "engine connection closed before any answer".into(),
            EngineError::Status { status, .. } => format!("engine answered {status}"),
            EngineError::Remote(_) => "engine reported an error in its stream".into(),
            EngineError::Protocol(_) => "engine broke the protocol".into(),
            EngineError::Truncated => "engine stream ended before the answer was complete".into(),
        }
    }

    /// Whether the engine itself is likely unusable (so health should be
    /// re-checked), as opposed to this one request failing.
    pub fn is_unreachable(&self) -> bool {
        matches!(self, EngineError::Unreachable(_) | EngineError::ConnectionLost(_))
            || matches!(self, EngineError::Status { status, .. } if *status >= 502)
    }
}

/// The result of a health probe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineHealth {
    pub up: bool,
    /// Short, for logs and `/ready` (not for clients of tasks).
    pub detail: String,
    /// Whether the model is loaded in memory, where the engine tells
    /// (Ollama's `/api/ps`). The scheduler's memory admission follows it.
    pub model_resident: Option<bool>,
}

/// What an engine says about its own load, where it tells. Every field is
/// `None` when the engine does not report it (or the reading failed): a
/// missing reading never blocks dispatch.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineLoad {
    /// Generations the engine runs, for edgeway and any other client
    /// (llama.cpp's `/slots`).
    pub busy_slots: Option<usize>,
    /// Fraction of the engine's KV cache in use, 0..=1 (vLLM's and
    /// llama.cpp's Prometheus `/metrics`).
    pub kv_cache_usage: Option<f64>,
    /// The instance takes only work of this priority or less urgent for
    /// now: a pool instance none of whose nodes can serve the model, whose
    /// work queue holds such work until one can. `None`: all work.
    pub takes_from: Option<crate::task::Priority>,
}

/// What an adapter can do, for the router and `/v1/models`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capabilities {
    pub streaming: bool,
    /// The engine reports token usage itself.
    pub reports_usage: bool,
    /// The engine stops generating when its HTTP connection closes.
    pub cancel_on_disconnect: bool,
}

#[async_trait]
pub trait Engine: Send + Sync + 'static {
    fn name(&self) -> &str;
    fn kind(&self) -> EngineKind;
    fn capabilities(&self) -> Capabilities;
    /// Starts a generation. Resolves once the engine has accepted the
    /// request (HTTP headers received); chunks follow on the stream. Sends
    /// exactly once: a caller that sends again (see
    /// [`EngineError::ConnectionLost`]) passes the same request.
    async fn stream(&self, req: &EngineRequest) -> Result<EngineStream, EngineError>;
    async fn health(&self) -> EngineHealth;
    /// The engine's own view of its load (busy slots, KV-cache usage),
    /// where it tells. Cheap and bounded by a short timeout: the health
    /// probe calls it after every successful probe.
    async fn load(&self) -> EngineLoad {
        EngineLoad::default()
    }
    /// Whether the engine is down because edgeway is starting or
    /// restarting its process ([`supervisor`]): the instance is out of
    /// dispatch at once, but its breaker does not count the outage (a
    /// planned one says nothing of the engine, and an open breaker's
    /// cool-down would keep the restarted engine idle after it is ready).
    fn process_down(&self) -> bool {
        false
    }
    /// Whether the engine is down only until its supervisor has it ready
    /// again (starting or restarting, not given up or stopped): work for
    /// it queues rather than failing when no other instance or step can
    /// take it.
    fn process_restarting(&self) -> bool {
        false
    }
    /// What the engine's model API (`model_api`) says of the model:
    /// `None` for an engine without one (its model is there while it is
    /// healthy).
    async fn model_state(&self) -> Option<Result<residency::ModelState, EngineError>> {
        None
    }
    /// Loads the model through the engine's API; returns once the engine
    /// says it is loaded (or failed). A no-op without a model API.
    async fn load_model(&self) -> Result<(), EngineError> {
        Ok(())
    }
    /// Unloads the model through the engine's API; unloading a model that
    /// is not loaded is no error. A no-op without a model API.
    async fn unload_model(&self) -> Result<(), EngineError> {
        Ok(())
    }
}

/// Builds the adapter for one configured engine instance (a pool
/// instance without a bus: it never connects; see [`build_with`]).
pub fn build(cfg: &EngineConfig) -> Result<Arc<dyn Engine>, EngineError> {
    build_with(cfg, &Arc::default())
}

/// [`build`], a pool instance reaching the other nodes through `peers`.
pub fn build_with(cfg: &EngineConfig, peers: &Arc<pool::PeerSlot>) -> Result<Arc<dyn Engine>, EngineError> {
    if cfg.kind == EngineKind::Pool {
        return Ok(Arc::new(pool::PoolEngine::new(cfg.clone(), peers.clone())));
    }
    let client = http_client(cfg.connect_timeout)?;
    Ok(match cfg.kind {
        EngineKind::OpenAi => Arc::new(openai::OpenAiEngine::new(cfg.clone(), client)),
        EngineKind::Ollama => Arc::new(ollama::OllamaEngine::new(cfg.clone(), client)),
        EngineKind::Pool => unreachable!("built above"),
    })
}

pub fn http_client(connect_timeout: Duration) -> Result<reqwest::Client, EngineError> {
    crate::tls::install_default_provider();
    reqwest::Client::builder()
        .connect_timeout(connect_timeout)
        .tcp_nodelay(true)
        .pool_idle_timeout(Duration::from_secs(60))
        .pool_max_idle_per_host(64)
        .build()
        .map_err(|e| EngineError::Unreachable(format!("cannot build HTTP client: {e}")))
}

/// Sends a generation request once. A request that failed on a connection
/// that was already open, before any answer, is
/// [`EngineError::ConnectionLost`]; a refused or timed-out connect is
/// [`EngineError::Unreachable`].
/// Adds the call's W3C `traceparent` header, when it has one, so an engine
/// that traces (vLLM with OpenTelemetry, a proxy) joins the task's trace.
pub(crate) fn traced(rb: reqwest::RequestBuilder, traceparent: Option<&str>) -> reqwest::RequestBuilder {
    match traceparent {
        Some(tp) => rb.header("traceparent", tp),
        None => rb,
    }
}

pub(crate) async fn send(rb: reqwest::RequestBuilder) -> Result<reqwest::Response, EngineError> {
    match rb.send().await {
        Ok(r) => Ok(r),
        Err(e) if !e.is_connect() && !e.is_timeout() && e.is_request() => Err(EngineError::ConnectionLost(causes(e))),
        Err(e) => Err(EngineError::Unreachable(causes(e))),
    }
}

/// reqwest's own message ("error sending request") with its causes, without
/// the URL.
fn causes(e: reqwest::Error) -> String {
    use std::error::Error as _;
    let e = e.without_url();
    let mut s = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cause = c.source();
    }
    s
}

/// How many engine instances a running edgeway can add after start (each
/// engine added or changed at reload takes one): the instance lists keep
/// their items in place, so their room is set once. A reload past it is
/// refused as needing a restart.
pub const RELOAD_ROOM: usize = 64;

/// A list that only grows and whose items never move, so a reader holds
/// `&T` without a lock while a reload appends (instance lists: an instance's
/// index is its identity for the scheduler, and a reload adds instances
/// but never removes one: a removed one is retired in place).
pub struct AppendOnly<T> {
    items: Box<[std::sync::OnceLock<T>]>,
    len: std::sync::atomic::AtomicUsize,
    /// One push at a time.
    push: std::sync::Mutex<()>,
}

impl<T> AppendOnly<T> {
    /// `items`, with room for `room` more.
    pub fn with_room(items: Vec<T>, room: usize) -> AppendOnly<T> {
        let len = items.len();
        let cells: Vec<std::sync::OnceLock<T>> = items
            .into_iter()
            .map(std::sync::OnceLock::from)
            .chain((0..room).map(|_| std::sync::OnceLock::new()))
            .collect();
        AppendOnly { items: cells.into_boxed_slice(), len: len.into(), push: Default::default() }
    }

    pub fn len(&self) -> usize {
        self.len.load(std::sync::atomic::Ordering::Acquire)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Item `i`; panics past the end, as a slice does.
    pub fn get(&self, i: usize) -> &T {
        self.items[..self.len()][i].get().expect("an item below len is set")
    }

    /// Appends `item` and returns its index, or gives it back when there
    /// is no room left.
    pub fn push(&self, item: T) -> Result<usize, T> {
        let _one = self.push.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let i = self.len();
        let Some(cell) = self.items.get(i) else { return Err(item) };
        assert!(cell.set(item).is_ok(), "cells past len are empty");
        self.len.store(i + 1, std::sync::atomic::Ordering::Release);
        Ok(i)
    }

    /// Room left for pushes.
    pub fn room(&self) -> usize {
        self.items.len() - self.len()
    }

    pub fn iter(&self) -> impl Iterator<Item = &T> + '_ {
        (0..self.len()).map(|i| self.get(i))
    }
}

pub fn truncate(s: &str, n: usize) -> String {
    if s.len() <= n {
        return s.to_string();
    }
    let mut end = n;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}
