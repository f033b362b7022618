//! Configuration: one TOML file, overridable by `EDGEWAY__SECTION__KEY`
//! environment variables, parsed into raw serde structs that reject unknown
//! keys, then validated into a typed [`Config`] with every error reported by
//! its key path.
//!
//! Owns: the file format (`raw.rs`, with the defaults), its validation one
//! section at a time (`validate.rs`, `nats.rs`, `cluster.rs`, `mqtt.rs`) and the typed
//! sections every component reads. Does not own: what the values mean at
//! run time (each component reads its own typed section, or converts it into
//! its own types). Plain data: it imports only `task` and `error`.

mod cache;
mod cluster;
pub mod mqtt;
mod nats;
mod process;
mod raw;
pub mod reload;
mod residency;
mod validate;

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use sha2::{Digest, Sha256};

use crate::task::{DataClass, Location, Priority, Timeouts};

pub use cache::CacheConfig;
pub use cluster::{ClusterConfig, WORK_MAX_AGE};
pub use mqtt::{DeviceConfig, ExternalBrokerConfig, ExternalTls, MqttConfig, MqttTlsConfig};
pub use nats::{JetStreamConfig, JetStreamStorage, NatsAuth, NatsConfig, Secret};
pub use process::{expand as expand_vars, ProcessConfig};
pub use raw::RawConfig;
pub use residency::{ModelApi, Residency, ResidencyClass, Restriction};
pub use validate::SUMMARY_PROMPT_MIN_TOKENS;

/// One problem in a configuration, with the key path it is about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub path: String,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.path.is_empty() {
            write!(f, "{}", self.message)
        } else {
            write!(f, "{}: {}", self.path, self.message)
        }
    }
}

/// All problems found in a configuration.
#[derive(Debug, Clone, thiserror::Error)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{} configuration error(s):", self.0.len())?;
        for e in &self.0 {
            writeln!(f, "  - {e}")?;
        }
        Ok(())
    }
}

/// The problems found so far in one load. Every section's check adds to it
/// and none stops at its first problem, so one load names every mistake.
#[derive(Debug, Default)]
struct Problems(Vec<ConfigError>);

impl Problems {
    fn add(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.0.push(ConfigError { path: path.into(), message: message.into() });
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

#[derive(Debug, Clone)]
pub struct Config {
    /// Name of this gateway in results, logs and the task store.
    pub node_id: String,
    pub http: HttpConfig,
    pub store: StoreConfig,
    pub server: ServerConfig,
    pub sessions: SessionsConfig,
    pub context: ContextConfig,
    pub log: LogConfig,
    pub timeouts: Timeouts,
    pub scheduler: SchedulerConfig,
    pub auth: AuthConfig,
    pub applications: BTreeMap<String, ApplicationConfig>,
    pub engines: BTreeMap<String, EngineConfig>,
    pub models: BTreeMap<String, ModelConfig>,
    /// Fair-share weight of each tenant (default 1).
    pub tenant_weights: std::collections::HashMap<String, f64>,
    /// The least strict data class of each tenant's calls, where set.
    pub tenant_data_class: std::collections::HashMap<String, DataClass>,
    /// `[tenants.X.budget]`: what each tenant (all its applications
    /// together) may spend per UTC day and month, where set.
    pub tenant_budgets: BTreeMap<String, BudgetConfig>,
    pub routing: RoutingConfig,
    pub resources: ResourceConfig,
    /// A cancelled request may keep an engine busy this long before the
    /// instance is taken out of dispatch.
    pub cancel_grace: Duration,
    /// Engine-reported KV-cache usage (0..=1) at which an instance that
    /// runs any task gets no new one.
    pub kv_cache_high_water: f64,
    /// The internal service bus; `None` when `[nats]` is not configured.
    pub nats: Option<NatsConfig>,
    /// `[cluster]`: this node's entry in the node registry on the bus;
    /// `None` without it.
    pub cluster: Option<ClusterConfig>,
    /// The embedded MQTT broker and device ingress; `None` without `[mqtt]`.
    pub mqtt: Option<MqttConfig>,
    /// Devices that may connect over MQTT, by id (= MQTT client id).
    pub devices: BTreeMap<String, DeviceConfig>,
    /// `[cache]`: the response cache.
    pub cache: CacheConfig,
    /// A hash of the effective content (the file after the `EDGEWAY__…`
    /// overrides), shown by `/ready` as `config_version`.
    pub version: String,
    /// The file it was loaded from ([`Config::load`]), read again by a
    /// reload; `None` for a configuration built from text.
    pub source: Option<PathBuf>,
}

#[derive(Debug, Clone)]
pub struct HttpConfig {
    pub listen: SocketAddr,
    /// Where `/metrics` and admin endpoints are also served, apart from the
    /// business port. They stay on `listen` too unless `admin_only` is set.
    pub admin_listen: Option<SocketAddr>,
    pub max_body_bytes: usize,
    /// Open connections per listener (`listen`, `admin_listen`); beyond
    /// them a new connection is answered 503 and closed.
    pub max_connections: usize,
    pub admin_max_connections: usize,
    /// Time a client has to send a request's headers (HTTP/1.1 counts the
    /// wait for the next request on a kept-alive connection as well).
    pub header_read_timeout: std::time::Duration,
    /// A connection without request progress (a request arriving, a frame
    /// of a request body or of an answer; HTTP/2 PINGs are none) for this
    /// long is closed: gracefully when nothing is owed, at once when a
    /// request body stopped arriving or the client stopped reading its
    /// answer. An answer edgeway is still working on is never cut by it.
    pub idle_timeout: std::time::Duration,
    /// A connection is closed gracefully (HTTP/2 GOAWAY) at this age;
    /// answers still running may finish until twice this age.
    pub max_connection_age: std::time::Duration,
    /// Requests in flight on one WebSocket (`/v1/ws`); more are refused
    /// with `RATE_LIMITED` until one ends.
    pub ws_max_in_flight: usize,
}

#[derive(Debug, Clone)]
pub struct StoreConfig {
    pub data_dir: PathBuf,
    /// Keep prompt and result text in the task store (off: a hash only).
    pub store_prompts: bool,
    /// Writes kept in memory while the disk refuses them (then dropped).
    pub max_buffered_writes: usize,
    /// Finished tasks and their transitions are purged after this (`None`:
    /// kept). A task whose idempotency key is live is always kept.
    pub retention_tasks: Option<Duration>,
    /// Refused calls are purged after this (`None`: kept).
    pub retention_rejected: Option<Duration>,
    /// Audit records are purged after this, oldest first (`None`: kept).
    pub retention_audit: Option<Duration>,
    /// Space set aside beside the database and given back when the disk
    /// fills up, for the writes of tasks already running; 0: none.
    pub reserve_bytes: u64,
    /// What each data class may leave in the store and for how long
    /// (`[store.retention.<class>]`), by [`DataClass`] order (see
    /// [`StoreConfig::class`]). `retention_tasks` and `retention_audit`
    /// above are the defaults; `retention_audit` is the strictest class's
    /// audit age (the audit chain is purged from its oldest end only).
    pub retention_classes: [ClassRetention; 4],
}

/// What calls of one data class may leave in the task store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClassRetention {
    /// Prompt and answer text may be stored (then `store_prompts`, an
    /// idempotency key or a Responses `store: true` decide whether it is).
    /// false: none of it reaches the file, whatever they say.
    pub store_text: bool,
    /// Finished tasks and their transitions are purged after this (`None`:
    /// kept).
    pub tasks: Option<Duration>,
    /// Audit records of this class are kept at most this long; the chain
    /// is purged by the strictest class's age.
    pub audit: Option<Duration>,
    /// An idempotency key (and the answer kept with it) lives at most this
    /// long; `None`: `[scheduler] idempotency_ttl_seconds`.
    pub idempotency: Option<Duration>,
    /// A session that holds a turn of this class, or was created by a
    /// caller whose calls are at least of it, ends at most this long after
    /// its last turn (its idle expiry is lowered to it, in memory and in
    /// its stored row); `None`: the `[sessions]` limits alone.
    pub sessions: Option<Duration>,
}

/// The process as a whole (`[server]`).
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// On SIGTERM/SIGINT: how long running tasks may finish before the
    /// rest are cancelled.
    pub drain_timeout: Duration,
}

/// `[context]`: what prompt assembly adds to every chat call and filters
/// from untrusted content.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ContextConfig {
    /// The platform's safety rules, first in every assembled prompt.
    pub safety_rules: Option<String>,
    /// Regular expressions (checked to compile) filtered from untrusted
    /// content, beside the built-in API-key patterns.
    pub secret_patterns: Vec<String>,
}

/// The prompt budget of a logical model (`[models.X] context_*`,
/// `*_budget_percent`), read by `context::assembly`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ContextBudget {
    /// Fraction of the window left unused (0.05..=0.10).
    pub margin: f64,
    /// Fractions of the prompt budget knowledge passages and tool results
    /// may take at most.
    pub knowledge_share: f64,
    pub tool_results_share: f64,
}

impl Default for ContextBudget {
    fn default() -> Self {
        ContextBudget { margin: 0.05, knowledge_share: 0.4, tool_results_share: 0.4 }
    }
}

/// `[sessions]`: the ceilings of every session. A session may be created
/// with lower limits, never higher ones.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionsConfig {
    /// A session ends this long after it was created, used or not.
    pub max_lifetime: Duration,
    /// A session ends this long after its last turn (or creation).
    pub idle_expiry: Duration,
    /// Messages a session may hold (each turn adds two: the user's and
    /// the answer).
    pub max_messages: u32,
    /// Estimated tokens of all the messages a session may hold.
    pub max_tokens: u64,
    /// Live sessions one user of one application may hold.
    pub max_per_user: usize,
    /// Live sessions all the users of one application may hold together.
    pub max_per_application: usize,
    /// Live sessions the gateway holds in all (they are all in memory).
    pub max_sessions: usize,
    /// Memory entries one session may hold.
    pub max_memory_entries: usize,
    /// Append a turn that ended failed, cancelled or timed out as well
    /// (with whatever answer text it produced).
    pub append_failed_turns: bool,
    /// Summaries of a session's older turns (none without a summary model).
    pub summary: Option<SummaryConfig>,
}

/// `[sessions] summary_*`: when and how a session's older turns are
/// summarised (see `crate::context::summary`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SummaryConfig {
    /// The logical (chat) model that writes summaries.
    pub model: String,
    /// The priority of a summary task (P4 by default: after every call).
    pub priority: crate::task::Priority,
    /// The output budget of a summary, in tokens.
    pub max_tokens: u32,
    /// A summary task's whole deadline; past it the session goes on
    /// without the summary.
    pub deadline: Duration,
    /// A summary is made once this many history messages are left out of
    /// the window and not yet covered by the summary.
    pub after_messages: u32,
    /// The part of the turn's model window (percent) that recent turns may
    /// take before older ones are left out (the summary's trigger).
    pub history_share_pct: u32,
}

impl Default for SessionsConfig {
    fn default() -> Self {
        SessionsConfig {
            max_lifetime: Duration::from_secs(7 * 24 * 3600),
            idle_expiry: Duration::from_secs(24 * 3600),
            max_messages: 200,
            max_tokens: 200_000,
            max_per_user: 100,
            max_per_application: 10_000,
            max_sessions: 100_000,
            max_memory_entries: 100,
            append_failed_turns: false,
            summary: None,
        }
    }
}

impl StoreConfig {
    pub fn db_path(&self) -> PathBuf {
        self.data_dir.join("edgeway.db")
    }

    /// The retention of one data class.
    pub fn class(&self, c: DataClass) -> &ClassRetention {
        &self.retention_classes[c as usize]
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Clone)]
pub struct LogConfig {
    pub format: LogFormat,
    /// A `tracing` filter directive such as `info` or `edgeway=debug`.
    pub level: String,
    /// The OTLP/HTTP collector (`http://host:4318`) that task spans are
    /// sent to (`{endpoint}/v1/traces`, JSON); none: no export.
    pub otlp_endpoint: Option<String>,
}

#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// Default bound of each logical model's queue.
    pub queue_capacity: usize,
    /// How long a client is told to wait after `QUEUE_FULL`.
    pub busy_retry_after_ms: u64,
    /// Period of `queued` position updates to waiting tasks; `None` = off.
    pub queue_updates: Option<Duration>,
    /// How long the events of an ended task stay available for re-attaching
    /// clients (resumes, idempotent retries).
    pub replay_retention: Duration,
    /// Byte budget of those retained events, over all ended tasks.
    pub replay_max_bytes: usize,
    pub max_queued: Option<usize>,
    pub max_running: Option<usize>,
    /// A waiting task gains one level per period (never above P1).
    pub priority_aging: Option<Duration>,
    pub overload_max_output_tokens: u32,
    pub idempotency_ttl: Duration,
    /// P0 work may preempt preemptible P3/P4 tasks.
    pub preemption: bool,
    /// Users whose per-user rate buckets are kept at once (callers may
    /// name users freely); past it those closest to full are forgotten.
    pub max_tracked_users: usize,
}

/// `[routing]`: data policy, retries, breakers and degradation.
#[derive(Debug, Clone)]
pub struct RoutingConfig {
    /// Cloud instances may be used at all.
    pub allow_cloud: bool,
    /// The class of a call nobody declared one for.
    pub default_data_class: DataClass,
    /// Engine attempts per task, the first included.
    pub max_attempts: u32,
    pub retry_backoff: Duration,
    pub retry_budget: RetryBudgetConfig,
    pub breaker: BreakerConfig,
    /// The least urgent priority a model at degradation level 1, 2 admits
    /// (at level 3 nothing can take its work: busy answers).
    pub admit_at_level: [Priority; 2],
}

impl Default for RoutingConfig {
    fn default() -> Self {
        RoutingConfig {
            allow_cloud: false,
            default_data_class: DataClass::Personal,
            max_attempts: 3,
            retry_backoff: Duration::from_millis(50),
            retry_budget: RetryBudgetConfig::default(),
            breaker: BreakerConfig::default(),
            admit_at_level: [Priority::P4, Priority::P2],
        }
    }
}

/// The global retry budget (`[routing] retry_budget_*`): retries at most
/// `ratio` of first attempts over `window`, plus `min_per_window`.
#[derive(Debug, Clone)]
pub struct RetryBudgetConfig {
    /// Retries allowed per first attempt in the window (0.1 = 10 %).
    pub ratio: f64,
    pub window: Duration,
    /// Retries allowed in any window on top of the ratio.
    pub min_per_window: u32,
}

impl Default for RetryBudgetConfig {
    fn default() -> Self {
        RetryBudgetConfig { ratio: 0.1, window: Duration::from_secs(60), min_per_window: 3 }
    }
}

/// `[routing.breaker]`, the same for every instance (the router's
/// `breaker::Breaker` reads it as it is).
#[derive(Debug, Clone)]
pub struct BreakerConfig {
    /// Open after this many failures in a row (attempts and failed probes).
    pub consecutive_failures: u32,
    /// Open when failures / outcomes in the window reach this (0..=1) ...
    pub error_rate: f64,
    /// ... and the window holds at least this many outcomes; also the
    /// fewest successes a p95 time to first token is judged on.
    pub min_requests: u32,
    /// How far back the error rate and p95 look.
    pub window: Duration,
    /// Open when the window's p95 time to first token exceeds this; `None`
    /// turns the rule off.
    pub ttft_p95: Option<Duration>,
    /// Time from OPEN to HALF_OPEN.
    pub cooldown: Duration,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        BreakerConfig {
            consecutive_failures: 5,
            error_rate: 0.5,
            min_requests: 10,
            window: Duration::from_secs(30),
            ttft_p95: None,
            cooldown: Duration::from_secs(10),
        }
    }
}

#[derive(Debug, Clone, Default)]
pub struct AuthConfig {
    pub jwt: Option<JwtConfig>,
}

#[derive(Debug, Clone)]
pub struct JwtConfig {
    /// HS256 secret, read from the environment variable the config names.
    pub hs256_secret: Option<Vec<u8>>,
    /// RS256 public key, PEM.
    pub rs256_public_key_pem: Option<Vec<u8>>,
    pub issuer: Option<String>,
    pub audience: Option<String>,
    pub tenant_claim: String,
    pub application_claim: String,
    pub leeway_s: u64,
}

#[derive(Debug, Clone)]
pub struct ApplicationConfig {
    pub name: String,
    pub tenant: String,
    /// SHA-256 digests of the application's API keys.
    pub api_key_sha256: Vec<[u8; 32]>,
    pub max_priority: Priority,
    pub default_priority: Priority,
    pub admin: bool,
    pub limits: AppLimits,
    /// The least strict data class of the application's calls.
    pub data_class: Option<DataClass>,
    /// Its calls may be answered by a smaller model.
    pub allow_smaller_model: bool,
    /// The tools its requests may declare; `None`: any.
    pub allowed_tools: Option<Vec<String>>,
    /// Tools whose calls come back marked `requires_confirmation` (and are
    /// logged and counted as high-risk).
    pub high_risk_tools: Vec<String>,
    /// Regular expressions whose matches are replaced by `[REDACTED]`
    /// before anything of the application's sessions is kept (checked to
    /// compile).
    pub redact: Vec<String>,
    /// Its system prompt, put into every assembled prompt of its calls.
    pub system_prompt: Option<String>,
    /// Output constraints, last in every assembled prompt of its calls.
    pub output_constraints: Option<String>,
    /// Prompt debug logging, off unless configured and before its end.
    pub debug_prompts: Option<DebugPrompts>,
    /// What a conversation that does not fit may lose, unless the request
    /// says (`context_policy`).
    pub context_policy: ContextPolicy,
    /// `[applications.X.budget]`: what the application may spend per UTC
    /// day and month (besides its tenant's budget).
    pub budget: Option<BudgetConfig>,
    /// Its calls may be answered from the response cache (`cache`, default
    /// true; `[cache] enabled` decides for all).
    pub cache: bool,
    /// The logical models its calls may name; `None`: any.
    pub allowed_models: Option<Vec<String>>,
    /// The priorities its calls may use; `None`: `max_priority` to P4.
    pub allowed_priorities: Option<Vec<Priority>>,
    /// The ingresses it may call through; `None`: all.
    pub allowed_ingresses: Option<Vec<crate::task::Ingress>>,
    /// The request header (lowercase) that names the end user for its API
    /// keys (a trusted proxy sets it); the body's user fields are then
    /// ignored.
    pub user_header: Option<String>,
    /// When each of its keys that has an expiry expires (Unix ms).
    pub key_expires_ms: BTreeMap<[u8; 32], i64>,
}

/// `context_policy` (an application's default, a request's own; the
/// Responses API's `truncation`): whether prompt assembly may leave a
/// conversation's oldest messages out when it does not fit the window.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ContextPolicy {
    /// The oldest messages go (whole turns, pinned ones kept), after a
    /// larger-window model where the call's own messages do not fit.
    #[default]
    Auto,
    /// No message is left out: a larger-window model, else
    /// `CONTEXT_TOO_LARGE`.
    Disabled,
}

impl ContextPolicy {
    pub fn parse(s: &str) -> Option<ContextPolicy> {
        match s {
            "auto" => Some(ContextPolicy::Auto),
            "disabled" => Some(ContextPolicy::Disabled),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            ContextPolicy::Auto => "auto",
            ContextPolicy::Disabled => "disabled",
        }
    }
}

/// A budget (`[tenants.X.budget]`, `[applications.X.budget]`): tokens
/// (input and output together) and cost (in the currency of the price
/// table, [`Price`]) per UTC calendar day and month; `None`: no limit of
/// that kind. Spending is counted when a task ends; a call made while any
/// limit is reached is refused `QUOTA_EXCEEDED` until the window resets.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BudgetConfig {
    pub daily_tokens: Option<u64>,
    pub monthly_tokens: Option<u64>,
    pub daily_cost: Option<f64>,
    pub monthly_cost: Option<f64>,
    /// The share of a limit (percent, 1..=100) whose crossing emits the
    /// budget warning (once per window).
    pub warn_percent: u32,
}

/// The default `warn_percent` of a budget.
pub const DEFAULT_BUDGET_WARN_PERCENT: u32 = 80;

/// What an instance's tokens cost (`[engines.X] price_input_per_mtok`,
/// `price_output_per_mtok`), per million tokens, in the one currency the
/// operator writes every price and budget in (edgeway converts nothing
/// and names no currency). Absent: 0, also for local engines, which may
/// be given a cost (power, hardware) the same way.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Price {
    pub input_per_mtok: f64,
    pub output_per_mtok: f64,
}

impl Price {
    /// The cost of a call that used `input` and `output` tokens.
    pub fn cost(&self, input: u32, output: u32) -> f64 {
        (f64::from(input) * self.input_per_mtok + f64::from(output) * self.output_per_mtok) / 1_000_000.0
    }
}

impl ApplicationConfig {
    /// Whether its calls may name logical model `model`.
    pub fn may_use_model(&self, model: &str) -> bool {
        self.allowed_models.as_ref().is_none_or(|m| m.iter().any(|a| a == model))
    }

    /// Whether its calls may use priority `p`: not more urgent than
    /// `max_priority`, and in `allowed_priorities` when it has them.
    pub fn may_use_priority(&self, p: Priority) -> bool {
        p >= self.max_priority && self.allowed_priorities.as_ref().is_none_or(|a| a.contains(&p))
    }

    /// Whether it may call through `ingress`.
    pub fn may_use_ingress(&self, ingress: crate::task::Ingress) -> bool {
        self.allowed_ingresses.as_ref().is_none_or(|a| a.contains(&ingress))
    }
}

/// `[applications.X.debug_prompts]`: the application's prompts are logged
/// (secrets filtered) for a sampled share of its calls, until a time after
/// which it is off by itself. Prompts are never logged otherwise.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DebugPrompts {
    /// Unix ms after which no prompt is logged.
    pub until_ms: i64,
    /// Share of calls (0 < rate <= 1) whose prompt is logged.
    pub sample_rate: f64,
}

/// The longest `debug_prompts.until` may lie ahead when the configuration
/// is loaded: the mode is short-lived by construction.
pub const DEBUG_PROMPTS_MAX_AHEAD_MS: i64 = 7 * 24 * 3600 * 1000;

/// Limits of one application against the others (all optional). The
/// scheduler's policy reads them as they are.
#[derive(Debug, Clone)]
pub struct AppLimits {
    /// Share of slots against other flows of the same priority.
    pub weight: f64,
    pub max_running: Option<usize>,
    pub max_queued: Option<usize>,
    pub user_max_running: Option<usize>,
    pub user_max_queued: Option<usize>,
    pub user_requests_per_minute: Option<u32>,
    pub user_tokens_per_minute: Option<u64>,
    /// The most urgent priority of its tasks that a P0 task may preempt
    /// (P3 or P4); `None`: never.
    pub preemptible_from: Option<Priority>,
}

impl Default for AppLimits {
    fn default() -> Self {
        AppLimits {
            weight: 1.0,
            max_running: None,
            max_queued: None,
            user_max_running: None,
            user_max_queued: None,
            user_requests_per_minute: None,
            user_tokens_per_minute: None,
            preemptible_from: Some(Priority::P3),
        }
    }
}

/// The `[resources]` thresholds of the danger zone, read by the resource
/// watch in `admission`.
#[derive(Debug, Clone)]
pub struct ResourceConfig {
    pub gpu: bool,
    pub poll_interval: Duration,
    pub danger_gpu_temperature_c: u32,
    pub danger_gpu_memory_percent: f64,
    /// Running and waiting tasks of this priority and less urgent are
    /// cancelled on entering danger.
    pub cancel_from_priority: Priority,
}

/// Written `type = "openai"`, `type = "ollama"` or `type = "pool"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineKind {
    /// Any OpenAI-compatible server: llama.cpp, vLLM, SGLang, cloud APIs.
    OpenAi,
    Ollama,
    /// The other edgeway nodes of the pool (`[cluster]`): a task this
    /// instance takes is forwarded over NATS to a node that serves its
    /// model (`model`, the logical model's name there) and may receive its
    /// data class (`engine::pool`).
    Pool,
}

/// What a logical model serves, written `kind = "chat"` (the default) or
/// `kind = "embedding"`. An engine started for embeddings (llama-server
/// `--embeddings`) serves no chat, so the two never share a model.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ModelKind {
    /// Chat and legacy text completions.
    #[default]
    Chat,
    /// `POST /v1/embeddings` only.
    Embedding,
}

impl ModelKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ModelKind::Chat => "chat",
            ModelKind::Embedding => "embedding",
        }
    }
}

impl EngineKind {
    pub fn as_str(self) -> &'static str {
        match self {
            EngineKind::OpenAi => "openai",
            EngineKind::Ollama => "ollama",
            EngineKind::Pool => "pool",
        }
    }
}

#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub name: String,
    pub kind: EngineKind,
    pub base_url: String,
    /// The engine's own name for the model it serves.
    pub model: String,
    pub max_concurrency: usize,
    /// Bearer key for cloud APIs, read from the environment variable named in
    /// `api_key_env` (never from the config file itself).
    pub api_key: Option<String>,
    pub health_path: String,
    pub health_interval: Duration,
    pub connect_timeout: Duration,
    /// Stream from the engine (`true`) or ask for one whole answer.
    pub stream: bool,
    /// Ollama `keep_alive` (e.g. "5m", "-1").
    pub keep_alive: Option<String>,
    /// Where the engine runs.
    pub location: Location,
    /// The most sensitive data class it may receive.
    pub max_data_class: DataClass,
    /// Relative cost of a thousand tokens, a tie-breaker between instances.
    pub cost_per_1k_tokens: f64,
    /// What its tokens cost: the `edge.cost` of the calls it answers, and
    /// what budgets count.
    pub price: Price,
    pub reserved_realtime_slots: usize,
    /// The long-prompt lane: long prompts (over `long_prompt_tokens`
    /// estimated tokens) start only while the prompt tokens of long ones
    /// still in prefill here stay within `max_prefill_tokens` (one always
    /// may, alone); short ones are never held by them. `None`: no lane.
    pub max_prefill_tokens: Option<u32>,
    pub long_prompt_tokens: u32,
    /// llama-server only: edgeway numbers the engine's slots (its
    /// `--parallel`, which must equal `max_concurrency`), sends each task's
    /// slot as `id_slot` with `cache_prompt: true`, and puts a session's
    /// next turn in the slot that served its last one when it is free
    /// (`crate::scheduler::affinity`).
    pub slot_affinity: bool,
    /// llama-server only: prompt assembly counts tokens with the engine's
    /// own tokenizer (`/tokenize`, `/apply-template`), cached per text
    /// (`crate::context::tokens`), instead of the estimate.
    pub tokenize: bool,
    pub memory_budget_bytes: Option<u64>,
    /// No other client uses the engine (enables the cancel grace check).
    pub exclusive: bool,
    /// The engine takes `tools` and returns tool calls. Requests with tools
    /// go only to models whose every instance does.
    pub tools: bool,
    /// edgeway runs the engine as a supervised child process
    /// (`[engines.NAME.process]`); `None`: it runs on its own.
    pub process: Option<ProcessConfig>,
    /// How edgeway loads and unloads the model through the engine's API.
    pub model_api: ModelApi,
}

#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub name: String,
    pub instances: Vec<String>,
    pub context_tokens: u32,
    /// Upper bound for a request's output tokens (and the default).
    pub max_output_tokens: u32,
    pub queue_capacity: usize,
    pub description: Option<String>,
    pub max_running: Option<usize>,
    pub kv_bytes_per_token: u64,
    pub weights_bytes: u64,
    /// Safety margin on KV estimates, as a fraction.
    pub memory_margin: f64,
    /// How prompt assembly budgets the window.
    pub context_budget: ContextBudget,
    /// Smaller logical models that may answer instead, in order.
    pub fallback_models: Vec<String>,
    /// A chat model with a larger window that takes a call whose prompt
    /// does not fit this one's after the trimming ladder (issue 12), where
    /// the call's data class may go to one of its instances
    /// (`crate::context::window`).
    pub larger_window_model: Option<String>,
    /// The answer given when no engine step can take a request.
    pub canned_answer: Option<String>,
    /// Chat (and completions) or embeddings.
    pub kind: ModelKind,
    /// The engine honours an embedding request's `dimensions` (vLLM with a
    /// Matryoshka model); otherwise a request naming it is refused.
    pub supports_dimensions: bool,
    /// The length of the model's vectors, where the operator states it
    /// (shown by `/v1/models`; embedding models only).
    pub dimensions: Option<u32>,
    /// Inputs per engine call of an embedding request: a longer list is
    /// split into calls of this many, run one after another in the same
    /// task (embedding models; chat models: 0, not read).
    pub max_batch_inputs: usize,
    /// When the model may be in its engines' memory on this node.
    pub residency: Residency,
}

/// The default `[models.*] max_batch_inputs` of an embedding model: a
/// multiple of llama-server's default slot count (4), small enough that one
/// call of inputs as long as the context (2048 tokens in the example) is a
/// few seconds of a small CPU, so deadlines and cancels act between calls.
pub const DEFAULT_MAX_BATCH_INPUTS: u32 = 32;

impl EngineConfig {
    /// Runs on this machine.
    pub fn is_local(&self) -> bool {
        self.location == Location::Local
    }
}

pub fn hash_api_key(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

impl Config {
    /// Reads, applies environment overrides from the process environment, and
    /// validates.
    pub fn load(path: &Path) -> Result<Config, ConfigErrors> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            ConfigErrors(vec![ConfigError {
                path: String::new(),
                message: format!("cannot read {}: {e}", path.display()),
            }])
        })?;
        let base_dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
        let mut config = Self::from_toml_str(&text, std::env::vars(), &base_dir)?;
        config.source = Some(path.to_path_buf());
        Ok(config)
    }

    /// Parses `text`, applies the `EDGEWAY__…` variables among `env`, and
    /// validates. Relative file paths other than `store.data_dir` are
    /// resolved against `base_dir`.
    pub fn from_toml_str(
        text: &str,
        env: impl IntoIterator<Item = (String, String)>,
        base_dir: &Path,
    ) -> Result<Config, ConfigErrors> {
        let one = |path: &str, message: String| ConfigErrors(vec![ConfigError { path: path.into(), message }]);
        let mut value: toml::Value = toml::from_str(text).map_err(|e| one("", format!("invalid TOML: {e}")))?;
        let env: Vec<(String, String)> = env.into_iter().collect();
        raw::apply_env_overrides(&mut value, env.iter().cloned())?;
        let version = reload::version_of(&value);
        let raw: RawConfig = serde_path_to_error::deserialize(value).map_err(|e| {
            let path = e.path().to_string();
            one(if path == "." { "" } else { &path }, e.into_inner().to_string())
        })?;
        let mut config = raw.validate(&env, base_dir)?;
        config.version = version;
        Ok(config)
    }

    /// A short human summary, printed by `edgeway check-config`.
    pub fn explain(&self) -> String {
        let mut out = String::new();
        use std::fmt::Write;
        let _ = writeln!(out, "node {} — HTTP on {}", self.node_id, self.http.listen);
        if let Some(a) = self.http.admin_listen {
            let _ = writeln!(out, "admin endpoints also on {a}");
        }
        let _ = writeln!(
            out,
            "task store: {} (prompts {})",
            self.store.db_path().display(),
            if self.store.store_prompts { "stored" } else { "hashed only" }
        );
        for (name, m) in &self.models {
            let _ = writeln!(
                out,
                "model {name}: instances [{}], context {} tokens, output ≤ {}, queue ≤ {}",
                m.instances.join(", "),
                m.context_tokens,
                m.max_output_tokens,
                m.queue_capacity
            );
        }
        for (name, e) in &self.engines {
            let _ = writeln!(
                out,
                "engine {name}: {} at {} (model {}), {} slot(s)",
                e.kind.as_str(),
                e.base_url,
                e.model,
                e.max_concurrency
            );
            if let Some(p) = &e.process {
                let _ = writeln!(out, "  run by edgeway: {} {}", p.command, p.args.join(" "));
            }
        }
        for (name, a) in &self.applications {
            let _ = writeln!(
                out,
                "application {name}: tenant {}, {} key(s), priorities {}–P4 (default {}){}",
                a.tenant,
                a.api_key_sha256.len(),
                a.max_priority.as_str(),
                a.default_priority.as_str(),
                if a.admin { ", admin" } else { "" }
            );
        }
        if let Some(j) = &self.auth.jwt {
            let _ = writeln!(
                out,
                "JWT: {}{}",
                match (j.hs256_secret.is_some(), j.rs256_public_key_pem.is_some()) {
                    (true, true) => "HS256 and RS256",
                    (true, false) => "HS256",
                    (false, true) => "RS256",
                    (false, false) => "no key",
                },
                j.issuer.as_deref().map(|i| format!(", issuer {i}")).unwrap_or_default()
            );
        }
        out
    }
}

#[cfg(test)]
mod tests;
