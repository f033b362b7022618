//! The task model shared by every ingress: what a call asks for
//! ([`TaskRequest`]), the states it moves through ([`TaskState`]), what its
//! client sees while it runs ([`TaskEvent`]) and the result metadata
//! ([`ResultMeta`]).
//!
//! Owns: the types and their wire names. Does not own: parsing of any one
//! ingress's format (see `ingress::*`) or the rules that decide transitions
//! (see `scheduler`).

pub mod log;
pub mod tools;

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::error::GatewayError;
pub use tools::{ToolCall, ToolCallDelta, ToolSet};

/// P0 (alarms) is the most urgent, P4 (batch) the least. `Ord` follows
/// urgency: `P0 < P4`, so the smallest value runs first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Priority {
    P0,
    P1,
    P2,
    P3,
    P4,
}

impl Priority {
    pub const ALL: [Priority; 5] = [Priority::P0, Priority::P1, Priority::P2, Priority::P3, Priority::P4];

    pub fn as_str(self) -> &'static str {
        match self {
            Priority::P0 => "P0",
            Priority::P1 => "P1",
            Priority::P2 => "P2",
            Priority::P3 => "P3",
            Priority::P4 => "P4",
        }
    }

    pub fn index(self) -> usize {
        self as usize
    }

    pub fn parse(s: &str) -> Option<Priority> {
        match s.trim().to_ascii_uppercase().as_str() {
            "P0" => Some(Priority::P0),
            "P1" => Some(Priority::P1),
            "P2" => Some(Priority::P2),
            "P3" => Some(Priority::P3),
            "P4" => Some(Priority::P4),
            _ => None,
        }
    }
}

/// Life-cycle states of DESIGN.md. Wire form is SCREAMING_SNAKE_CASE.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum TaskState {
    Received,
    Validating,
    Rejected,
    Queued,
    Dispatching,
    Running,
    Streaming,
    Succeeded,
    Failed,
    Cancelled,
    TimedOut,
}

impl TaskState {
    pub fn as_str(self) -> &'static str {
        match self {
            TaskState::Received => "RECEIVED",
            TaskState::Validating => "VALIDATING",
            TaskState::Rejected => "REJECTED",
            TaskState::Queued => "QUEUED",
            TaskState::Dispatching => "DISPATCHING",
            TaskState::Running => "RUNNING",
            TaskState::Streaming => "STREAMING",
            TaskState::Succeeded => "SUCCEEDED",
            TaskState::Failed => "FAILED",
            TaskState::Cancelled => "CANCELLED",
            TaskState::TimedOut => "TIMED_OUT",
        }
    }

    pub fn parse(s: &str) -> Option<TaskState> {
        serde_json::from_value(Value::String(s.to_string())).ok()
    }

    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            TaskState::Rejected | TaskState::Succeeded | TaskState::Failed | TaskState::Cancelled | TaskState::TimedOut
        )
    }

    /// The transitions DESIGN.md allows, enforced where they are recorded
    /// (`telemetry::lifecycle::Recorder`). `Streaming` may also end `Failed`
    /// (engine broke mid-stream) and `TimedOut` (idle, inference, total).
    /// Beyond DESIGN.md's diagram, each because the gateway does it and
    /// clients already see it:
    /// - `Queued → Failed`: a waiting task is withdrawn with
    ///   `MODEL_UNAVAILABLE` when no healthy instance of its model is left,
    ///   or when the scheduler stops.
    /// - `Queued → Queued`: a task that never started is queued again after
    ///   a gateway restart (queues live in memory; the restart emptied it),
    ///   or, holding its slot, waits for its model to be loaded (reason
    ///   `loading: …`).
    /// - `Dispatching → Queued`, `Running → Queued`: an engine attempt
    ///   failed before its first token and the task waits for another
    ///   (a retry), or a P0 task preempted it before any output went out.
    ///   `Streaming → Queued`: a P0 task preempted it when the output it
    ///   had produced could be taken back (nobody was reading it).
    /// - `Received → Failed`, `Validating → Failed`: a restart ends a task
    ///   that was not queued yet and cannot be queued again `FAILED`
    ///   (`INTERNAL_ERROR`), like any other task it cannot resume.
    pub fn can_move_to(self, next: TaskState) -> bool {
        use TaskState::*;
        matches!(
            (self, next),
            (Received, Validating)
                | (Received, Rejected)
                | (Received, Failed)
                | (Validating, Rejected)
                | (Validating, Queued)
                | (Validating, Failed)
                | (Queued, Queued)
                | (Queued, Dispatching)
                | (Queued, TimedOut)
                | (Queued, Cancelled)
                | (Queued, Failed)
                | (Dispatching, Queued)
                | (Dispatching, Running)
                | (Dispatching, Failed)
                | (Dispatching, Cancelled)
                | (Dispatching, TimedOut)
                | (Running, Queued)
                | (Running, Streaming)
                | (Running, TimedOut)
                | (Running, Failed)
                | (Running, Cancelled)
                | (Running, Succeeded)
                | (Streaming, Queued)
                | (Streaming, Succeeded)
                | (Streaming, Failed)
                | (Streaming, Cancelled)
                | (Streaming, TimedOut)
        )
    }
}

/// Which door a task came in by. Recorded and used as a metric label only;
/// the scheduler never looks at it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Ingress {
    Http,
    Mqtt,
    Nats,
    /// The WebSocket channel (`/v1/ws`).
    Ws,
}

impl Ingress {
    pub fn as_str(self) -> &'static str {
        match self {
            Ingress::Http => "http",
            Ingress::Mqtt => "mqtt",
            Ingress::Nats => "nats",
            Ingress::Ws => "ws",
        }
    }
}

/// Who is calling, as established by admission (API key or JWT).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub tenant: String,
    pub application: String,
    /// From the JWT `sub`, or the request's `metadata.user_id` for API keys.
    pub user_id: Option<String>,
    /// The most urgent priority this caller may use (P0 allows all).
    pub max_priority: Priority,
    /// Used when the request names no priority.
    pub default_priority: Priority,
    pub is_admin: bool,
    /// SHA-256 of the API key used, so revoking the key can stop its tasks.
    pub credential: Option<[u8; 32]>,
    /// A data class the credential itself imposes (a device's), on top of
    /// its application's and tenant's.
    pub data_class: Option<DataClass>,
}

/// One chat message. `content` is kept as JSON (string or content parts) so
/// engines receive what the client sent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    #[serde(default)]
    pub content: Value,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl ChatMessage {
    pub fn text_len(&self) -> usize {
        match &self.content {
            Value::String(s) => s.len(),
            Value::Array(parts) => {
                parts.iter().filter_map(|p| p.get("text").and_then(Value::as_str)).map(str::len).sum()
            }
            _ => 0,
        }
    }
}

/// Sampling parameters forwarded to the engine as they came.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stop: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seed: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub presence_penalty: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub frequency_penalty: Option<f64>,
}

/// Resolved time limits of one task (config defaults, lowered by the request).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    pub queue: Duration,
    pub first_token: Duration,
    pub inference: Duration,
    pub idle: Duration,
    pub total: Duration,
}

/// How far a call's data may travel (the ladder L0–L3). `Ord` follows
/// strictness: `Public < Secret`, so the strictest of several declarations
/// is their `max`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DataClass {
    /// L0: may go to cloud and third parties.
    Public,
    /// L1: may go to a cloud instance the operator authorised for it
    /// (`max_data_class = "personal"`).
    #[default]
    Personal,
    /// L2: prefers the box; another edge node of the operator may take it.
    Sensitive,
    /// L3: never leaves the box.
    Secret,
}

impl DataClass {
    pub const ALL: [DataClass; 4] = [DataClass::Public, DataClass::Personal, DataClass::Sensitive, DataClass::Secret];

    pub fn as_str(self) -> &'static str {
        match self {
            DataClass::Public => "public",
            DataClass::Personal => "personal",
            DataClass::Sensitive => "sensitive",
            DataClass::Secret => "secret",
        }
    }

    pub fn parse(s: &str) -> Option<DataClass> {
        DataClass::ALL.into_iter().find(|c| c.as_str() == s.trim().to_ascii_lowercase())
    }
}

/// Where an engine instance runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Location {
    /// On this machine.
    Local,
    /// On another edge node of the same operator.
    EdgeNode,
    /// A cloud API: data leaves the operator's machines.
    Cloud,
}

impl Location {
    pub fn as_str(self) -> &'static str {
        match self {
            Location::Local => "local",
            Location::EdgeNode => "edge-node",
            Location::Cloud => "cloud",
        }
    }

    /// The most sensitive class an instance here may ever receive: secret
    /// data never leaves the box, and no cloud instance takes more than
    /// personal data.
    pub fn class_ceiling(self) -> DataClass {
        match self {
            Location::Local => DataClass::Secret,
            Location::EdgeNode => DataClass::Sensitive,
            Location::Cloud => DataClass::Personal,
        }
    }

    /// What an instance here receives when its config says nothing.
    pub fn default_class(self) -> DataClass {
        match self {
            Location::Local => DataClass::Secret,
            Location::EdgeNode => DataClass::Sensitive,
            Location::Cloud => DataClass::Public,
        }
    }
}

/// Routing wishes of the caller.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Routing {
    /// Never leave the box: the same as `data_class = "secret"` for routing.
    #[serde(default)]
    pub local_only: bool,
    /// A smaller or quantized local model may answer when the requested
    /// one cannot.
    #[serde(default)]
    pub allow_smaller_model: bool,
    /// The caller's class for this call's data; the application, tenant or
    /// device may impose a stricter one.
    #[serde(default)]
    pub data_class: Option<DataClass>,
    /// The node that forwarded this task here (`engine::pool`): set by the
    /// NATS ingress for a signed forward only (a request body naming it is
    /// refused). Such a task is never forwarded again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forwarded_from: Option<String>,
}

/// A step of a logical model's fallback chain, in the order they are tried.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FallbackStep {
    /// Instances of the requested model on this box.
    SameModel,
    /// A smaller or quantized local model (`fallback_models`), when the
    /// request or its application allows it.
    SmallerModel,
    /// Instances of the requested model on another edge node.
    EdgeNode,
    /// The response cache's answer to the same call, up to `[cache]
    /// stale_ttl_s` old, when no engine step could answer (before the
    /// canned answer). A fresh cache hit is recorded with this step too,
    /// but is not degraded.
    Cached,
    /// The model's configured canned answer.
    Canned,
    /// Cloud instances of the requested model, where the data class allows.
    Cloud,
    /// Nothing could take it: an explicit busy answer.
    Busy,
}

impl FallbackStep {
    pub const ALL: [FallbackStep; 7] = [
        FallbackStep::SameModel,
        FallbackStep::SmallerModel,
        FallbackStep::EdgeNode,
        FallbackStep::Cached,
        FallbackStep::Canned,
        FallbackStep::Cloud,
        FallbackStep::Busy,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            FallbackStep::SameModel => "same-model",
            FallbackStep::SmallerModel => "smaller-model",
            FallbackStep::EdgeNode => "edge-node",
            FallbackStep::Cached => "cached",
            FallbackStep::Canned => "canned",
            FallbackStep::Cloud => "cloud",
            FallbackStep::Busy => "busy",
        }
    }
}

/// One routing decision of a task: a step of the chain taken (or an
/// attempt retried), where, and why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RouteHop {
    pub step: FallbackStep,
    /// The logical model the hop used.
    pub model: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance: Option<String>,
    /// Why this step: the previous one's failure or state, or what decided
    /// the pick among instances.
    pub reason: String,
}

/// How a task was routed, as its client and its record see it
/// (`edge.route`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Route {
    /// The logical model the request named.
    pub requested_model: String,
    /// The logical model that answered (a smaller one after a fallback).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// The instance that answered, if any did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance: Option<String>,
    /// Engine attempts made (0 when no engine was asked).
    pub attempts: u32,
    /// The data class the call was routed under.
    pub data_class: DataClass,
    /// Steps taken and attempts made, in order.
    pub hops: Vec<RouteHop>,
    /// Whether the answer came from anything but the requested model on
    /// this box.
    pub degraded: bool,
}

/// What a task asks of its engine. A chat is what every ingress sends; the
/// others come from their own HTTP endpoints (`/v1/completions`,
/// `/v1/embeddings`) and run through the same pipeline.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Operation {
    /// Chat completion of `messages`, the engine applying its chat template.
    #[default]
    Chat,
    /// Legacy text completion: `prompt` goes to the engine as it is, never
    /// wrapped into a chat template.
    Completion { prompt: String },
    /// One vector per input, in one engine call.
    Embedding {
        input: Vec<String>,
        /// Output size asked for, where the model supports it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        dimensions: Option<u32>,
    },
}

/// A validated call, the same whatever ingress it came from.
#[derive(Debug, Clone)]
pub struct TaskRequest {
    pub task_id: String,
    pub request_id: String,
    /// The W3C trace id (32 hex digits) that joins this task's logs,
    /// record, events and engine calls: the caller's (`traceparent`, a
    /// `trace_id` field) or a new one (see `telemetry::trace`).
    pub trace_id: String,
    /// This task's span in its trace: the parent of its engine calls (their
    /// `traceparent`) and its span in an OTLP export. 16 hex digits.
    pub span_id: String,
    /// The caller's span (from its `traceparent`), the parent of this one.
    pub parent_span_id: Option<String>,
    pub identity: Identity,
    pub ingress: Ingress,
    pub logical_model: String,
    pub messages: Vec<ChatMessage>,
    pub params: SamplingParams,
    pub priority: Priority,
    pub max_output_tokens: u32,
    pub timeouts: Timeouts,
    pub session_id: Option<String>,
    pub idempotency_key: Option<String>,
    pub routing: Routing,
    /// The strictest of the request's, application's, tenant's and
    /// device's data classes (`local_only` counts as secret).
    pub data_class: DataClass,
    /// The request or its application allows a smaller model.
    pub allow_smaller_model: bool,
    /// `metadata` of the request (application, user_id, trace_id, …).
    pub metadata: Map<String, Value>,
    /// Estimated prompt size in tokens, from `context::estimate_tokens`.
    pub input_tokens_estimate: u32,
    /// SHA-256 of the messages' JSON, hex. Stored instead of the prompt.
    pub prompt_sha256: String,
    pub received_at: Instant,
    pub received_wall: SystemTime,
    /// Set when admission served less than asked (e.g. output budget cut to
    /// fit the context); reported as `degraded` in the result.
    pub degrade_reason: Option<String>,
    /// The tools the request declares (passed to the engine, and what the
    /// model's calls are checked against).
    pub tools: Option<ToolSet>,
    /// What the engine is asked to do (a chat unless an endpoint of its own
    /// says otherwise). For the others, `messages` holds their text as user
    /// messages, for estimates and recovery.
    pub operation: Operation,
    /// What prompt assembly did (`None`: the messages went as they came).
    pub context: Option<Box<ContextMeta>>,
}

/// What prompt assembly did for a task (`edge.context` of its result, and
/// in its record): tokens per segment kind, the budget, the ladder steps
/// taken, whether a session summary was used and whether the counts are
/// the engine's (`exact`) or edgeway's estimate; with the SHA-256 of the
/// assembled prompt and the assembly rules' version. Made by
/// `context::assembly`; absent for a call whose messages went as they came.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ContextMeta {
    pub version: u32,
    /// SHA-256 (hex) of the assembled messages' JSON, as sent.
    pub prompt_sha256: String,
    /// Tokens per segment kind (`safety_rules`, `system_prompt`, …).
    pub tokens: Map<String, Value>,
    /// `window`, `margin`, `prompt`, `output_reserve`, `knowledge_max`,
    /// `tool_results_max`.
    pub budget: Map<String, Value>,
    pub steps: Vec<String>,
    pub summary_used: bool,
    pub exact: bool,
    /// The segment plan in order: kind, source, trust, permission, tokens.
    #[serde(default)]
    pub segments: Vec<Value>,
}

/// Token counts. `estimated` is true when the engine did not report them
/// and edgeway counted on its own.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub input_tokens: u32,
    pub output_tokens: u32,
    pub total_tokens: u32,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub estimated: bool,
}

/// Milliseconds spent in each phase. Phases a task never reached are `None`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Timing {
    pub queue_ms: Option<u64>,
    pub first_token_ms: Option<u64>,
    pub inference_ms: Option<u64>,
    pub total_ms: u64,
}

/// The result metadata of DESIGN.md, the same on every ingress.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResultMeta {
    pub request_id: String,
    pub task_id: String,
    /// The task's trace id. Absent in results recorded before trace ids.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace_id: Option<String>,
    pub session_id: Option<String>,
    pub status: TaskState,
    pub logical_model: String,
    pub actual_model: Option<String>,
    pub node_id: String,
    pub usage: Usage,
    pub timing: Timing,
    pub finish_reason: Option<String>,
    pub degraded: bool,
    pub degrade_reason: Option<String>,
    /// How the task was routed. Absent in results recorded before routing
    /// was reported.
    #[serde(default)]
    pub route: Route,
    /// The tool calls of the answer, each with its verdict. Absent when
    /// the model called none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// Whether every tool call is valid (declared tool, arguments that
    /// match its schema, allowed by `tool_choice` / `parallel_tool_calls`);
    /// absent when the model called none, except `false` when the request's
    /// `tool_choice` required a call and the model made none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls_valid: Option<bool>,
    /// What prompt assembly did; absent when it did nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context: Option<Box<ContextMeta>>,
    /// A repeat answered from the store (past the replay window or after a
    /// restart) when the answer's text was not kept (a device's derived
    /// key under `store_prompts = false`, a class whose `store_text` is
    /// false, a user's deleted data): the outcome only, so that a missing
    /// answer is not taken for an empty one (review 15 L4), on every
    /// ingress.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub text_not_kept: bool,
    /// What the call cost: the input and output tokens of `usage` at the
    /// price of the instance that answered (`[engines.X] price_*`, per
    /// million tokens, in the operator's currency); 0 when no engine
    /// answered. Absent where edgeway does not know it (a result recorded
    /// before costs, a task ended by recovery).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost: Option<f64>,
    /// Answered from the response cache (absent otherwise).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub cache_hit: bool,
    /// How old the cached answer was, ms (with `cache_hit`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_age_ms: Option<u64>,
    /// The cached answer was past `[cache] ttl_s`: served by the routing
    /// chain's cached step because no engine step could answer.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub cache_stale: bool,
}

impl ResultMeta {
    /// Metadata of a task that ran nowhere (or of which only the outcome
    /// is known): no usage, no timing, not degraded.
    pub fn bare(request_id: &str, task_id: &str, status: TaskState, logical_model: &str, node_id: &str) -> ResultMeta {
        ResultMeta {
            request_id: request_id.to_string(),
            task_id: task_id.to_string(),
            trace_id: None,
            session_id: None,
            status,
            logical_model: logical_model.to_string(),
            actual_model: None,
            node_id: node_id.to_string(),
            usage: Usage::default(),
            timing: Timing::default(),
            finish_reason: None,
            degraded: false,
            degrade_reason: None,
            route: Route { requested_model: logical_model.to_string(), ..Route::default() },
            tool_calls: Vec::new(),
            tool_calls_valid: None,
            context: None,
            text_not_kept: false,
            cost: None,
            cache_hit: false,
            cache_age_ms: None,
            cache_stale: false,
        }
    }
}

/// What the client of a task receives, in order. Exactly one of `Done` and
/// `Error` ends the stream.
#[derive(Debug, Clone, PartialEq)]
pub enum TaskEvent {
    Accepted {
        task_id: String,
        queue_position: usize,
    },
    /// The task still waits; `position` tasks of its model are ahead of it
    /// (sent when it changed, at most once per `scheduler.queue_update_ms`).
    /// `loading_ms`: it has its slot and waits for its model to be loaded
    /// into the engine (position 0), which has taken this long so far.
    Queued {
        position: usize,
        loading_ms: Option<u64>,
    },
    Delta {
        text: String,
    },
    /// A piece of a tool call the model makes (the first piece of each call
    /// carries its id and name).
    ToolCallDelta(ToolCallDelta),
    /// The vector of input `index` of an embedding task (all of them come
    /// before `Done`, in input order).
    Embedding {
        index: u32,
        vector: Vec<f32>,
    },
    Done(Box<ResultMeta>),
    Error {
        error: GatewayError,
        meta: Box<ResultMeta>,
    },
}

pub fn unix_ms(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0)
}

pub fn now_ms() -> i64 {
    unix_ms(SystemTime::now())
}

/// A new task id: a UUIDv7 (time-ordered), so ids sort by creation.
/// Test support: a chat request of the demo application (tenant and
/// application `demo`, P2, 60 s timeouts, 16 output tokens), for the unit
/// tests of the layers above that need a `TaskRequest` (one builder, not
/// one per test module), and for benchmarks (`testing` feature).
#[cfg(any(test, feature = "testing"))]
impl TaskRequest {
    pub fn sample(messages: Vec<ChatMessage>) -> TaskRequest {
        let t = Duration::from_secs(60);
        TaskRequest {
            task_id: new_task_id(),
            request_id: "r1".into(),
            trace_id: "4bf92f3577b34da6a3ce929d0e0e4736".into(),
            span_id: "00f067aa0ba902b7".into(),
            parent_span_id: None,
            identity: Identity {
                tenant: "demo".into(),
                application: "demo".into(),
                user_id: None,
                max_priority: Priority::P0,
                default_priority: Priority::P2,
                is_admin: false,
                credential: None,
                data_class: None,
            },
            ingress: Ingress::Http,
            logical_model: "general-chat".into(),
            messages,
            params: SamplingParams::default(),
            priority: Priority::P2,
            max_output_tokens: 16,
            timeouts: Timeouts { queue: t, first_token: t, inference: t, idle: t, total: t },
            session_id: None,
            idempotency_key: None,
            routing: Routing::default(),
            data_class: Default::default(),
            allow_smaller_model: false,
            metadata: Default::default(),
            input_tokens_estimate: 1,
            prompt_sha256: String::new(),
            received_at: Instant::now(),
            received_wall: SystemTime::now(),
            degrade_reason: None,
            tools: None,
            operation: Default::default(),
            context: None,
        }
    }
}

pub fn new_task_id() -> String {
    uuid::Uuid::now_v7().simple().to_string()
}

/// Idempotency keys with this prefix are the MQTT ingress's (one per device
/// and request); other callers' keys may not start with it.
pub const DEVICE_KEY_PREFIX: &str = "mqtt-";

/// Of the device keys, those made from a key the device sent itself: it
/// asked for the replay, as an HTTP caller with `Idempotency-Key` does. The
/// others the ingress derived from the request id (the device chose none).
pub const DEVICE_OWN_KEY_PREFIX: &str = "mqtt-own-";

/// A key the MQTT ingress derived for a device request that named none:
/// its answer is kept with it only where the policy keeps text.
pub fn is_derived_device_key(key: &str) -> bool {
    key.starts_with(DEVICE_KEY_PREFIX) && !key.starts_with(DEVICE_OWN_KEY_PREFIX)
}

/// User ids under this prefix are the platform's own (a session summary
/// runs as `edgeway:summary`): admission refuses them from callers, they
/// are held to their application's limits but not to per-user ones, and an
/// audit record names no device after them.
pub const PLATFORM_USER_PREFIX: &str = "edgeway:";

/// Whether `user_id` is one of the platform's own ([`PLATFORM_USER_PREFIX`]).
pub fn is_platform_user(user_id: &str) -> bool {
    user_id.starts_with(PLATFORM_USER_PREFIX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn priority_order_is_urgency() {
        assert!(Priority::P0 < Priority::P1 && Priority::P3 < Priority::P4);
        assert_eq!(Priority::parse("p2"), Some(Priority::P2));
        assert_eq!(Priority::parse("P5"), None);
    }

    #[test]
    fn every_terminal_state_is_reachable_and_final() {
        use TaskState::*;
        let all = [
            Received,
            Validating,
            Rejected,
            Queued,
            Dispatching,
            Running,
            Streaming,
            Succeeded,
            Failed,
            Cancelled,
            TimedOut,
        ];
        for s in all {
            if s.is_terminal() {
                assert!(all.iter().all(|n| !s.can_move_to(*n)), "{s:?} must be final");
                assert!(all.iter().any(|p| p.can_move_to(s)), "{s:?} must be reachable");
            }
            assert_eq!(TaskState::parse(s.as_str()), Some(s));
        }
    }
}
