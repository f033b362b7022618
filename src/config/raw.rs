//! The file format as written: raw serde structs with `deny_unknown_fields`,
//! one per section, whose `Default` impls are the documented defaults, and
//! the `EDGEWAY__…` environment overrides applied to the parsed TOML.
//!
//! Owns: key names, accepted spellings and defaults. Does not own: the rules
//! on values (see `validate.rs`) or the `[nats]`, `[mqtt]` and `[devices]`
//! sections (their own files).
//!
//! A key whose value has a type (an address, an enum, a priority) is read
//! into a [`Field`], which keeps serde's error instead of ending the parse,
//! so a wrong value is reported by its key path together with every other
//! problem of the file. A key without a default is a `Field` too: absent,
//! it is reported as required, also with the others.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;

use serde::de::{DeserializeOwned, Deserializer, Error as _};
use serde::Deserialize;

use super::{ConfigError, ConfigErrors, EngineKind, LogFormat, ModelKind, Problems};
use crate::task::{DataClass, Location, Priority};

/// One typed key of the file.
#[derive(Debug, Default)]
pub enum Field<T> {
    /// Absent, and the key has no default.
    #[default]
    Missing,
    Valid(T),
    /// Present but not a `T`: serde's message, naming the value.
    Invalid(String),
}

impl<T> Field<T> {
    /// The value, or `None` after reporting why there is none at `path`.
    pub(super) fn get(self, path: &str, problems: &mut Problems) -> Option<T> {
        match self {
            Field::Valid(v) => Some(v),
            Field::Missing => {
                problems.add(path, "is required");
                None
            }
            Field::Invalid(message) => {
                problems.add(path, message);
                None
            }
        }
    }
}

/// An optional key without a default: `Some(None)` when absent, `None` after
/// reporting a wrong value at `path`.
pub(super) fn optional<T>(field: Option<Field<T>>, path: &str, problems: &mut Problems) -> Option<Option<T>> {
    match field {
        None => Some(None),
        Some(f) => f.get(path, problems).map(Some),
    }
}

impl<'de, T: DeserializeOwned> Deserialize<'de> for Field<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        // Any TOML value is accepted here; whether it is a `T` is decided
        // below, so a wrong one does not hide the rest of the file.
        let value = toml::Value::deserialize(d)?;
        Ok(match T::deserialize(value.clone()) {
            Ok(v) => Field::Valid(v),
            Err(e) => Field::Invalid(naming_the_value(e.to_string().trim_end(), &value)),
        })
    }
}

/// Serde's messages for a bad string (`invalid socket address syntax`) do
/// not always quote it; the user should see what they wrote.
fn naming_the_value(message: &str, value: &toml::Value) -> String {
    match value {
        toml::Value::String(s) if !message.contains(s.as_str()) => format!("{s:?}: {message}"),
        _ => message.to_string(),
    }
}

/// A priority as the file writes it: `P0`..`P4`, in either case, blanks
/// around it ignored (as [`Priority::parse`] reads it everywhere).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PriorityName(pub Priority);

impl<'de> Deserialize<'de> for PriorityName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Priority::parse(&s).map(PriorityName).ok_or_else(|| D::Error::custom(format!("must be P0..P4, not {s:?}")))
    }
}

const MIB: usize = 1024 * 1024;

#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawConfig {
    pub node_id: String,
    pub http: RawHttp,
    pub store: RawStore,
    pub server: RawServer,
    pub sessions: RawSessions,
    pub context: RawContext,
    pub log: RawLog,
    pub timeouts: RawTimeouts,
    pub scheduler: RawScheduler,
    pub auth: RawAuth,
    pub applications: BTreeMap<String, RawApplication>,
    pub tenants: BTreeMap<String, RawTenant>,
    pub resources: RawResources,
    pub engines: BTreeMap<String, RawEngine>,
    pub models: BTreeMap<String, RawModel>,
    pub routing: RawRouting,
    pub nats: Option<super::nats::RawNats>,
    pub cluster: Option<super::cluster::RawCluster>,
    pub mqtt: Option<super::mqtt::RawMqtt>,
    pub devices: BTreeMap<String, super::mqtt::RawDevice>,
    pub cache: super::cache::RawCache,
}

impl Default for RawConfig {
    fn default() -> Self {
        RawConfig {
            node_id: "edge-1".into(),
            http: RawHttp::default(),
            store: RawStore::default(),
            server: RawServer::default(),
            sessions: RawSessions::default(),
            context: RawContext::default(),
            log: RawLog::default(),
            timeouts: RawTimeouts::default(),
            scheduler: RawScheduler::default(),
            auth: RawAuth::default(),
            applications: BTreeMap::new(),
            tenants: BTreeMap::new(),
            resources: RawResources::default(),
            engines: BTreeMap::new(),
            models: BTreeMap::new(),
            routing: RawRouting::default(),
            nats: None,
            cluster: None,
            mqtt: None,
            devices: BTreeMap::new(),
            cache: super::cache::RawCache::default(),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawHttp {
    pub listen: Field<SocketAddr>,
    pub admin_listen: Option<Field<SocketAddr>>,
    pub max_body_bytes: usize,
    pub max_connections: usize,
    pub admin_max_connections: usize,
    pub header_read_timeout_ms: u64,
    pub idle_timeout_ms: u64,
    pub max_connection_age_ms: u64,
    pub ws_max_in_flight: usize,
}

impl Default for RawHttp {
    fn default() -> Self {
        RawHttp {
            listen: Field::Valid(SocketAddr::from(([127, 0, 0, 1], 8080))),
            admin_listen: None,
            max_body_bytes: 4 * MIB,
            max_connections: 1024,
            admin_max_connections: 64,
            header_read_timeout_ms: 10_000,
            idle_timeout_ms: 60_000,
            max_connection_age_ms: 600_000,
            ws_max_in_flight: 16,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawStore {
    pub data_dir: PathBuf,
    pub store_prompts: bool,
    /// Writes kept in memory while the disk refuses them.
    pub max_buffered_writes: usize,
    /// Finished tasks (with their transitions) are purged after this; 0 keeps them.
    pub retention_tasks_hours: u64,
    /// Refused calls are purged after this; 0 keeps them.
    pub retention_rejected_hours: u64,
    /// Audit records are purged after this, oldest first; 0 keeps them.
    pub retention_audit_hours: u64,
    /// Space set aside next to the database for a full disk; 0: none.
    pub reserve_bytes: u64,
    /// `[store.retention.<class>]`: what each data class may leave in the
    /// store, and for how long (each key defaults to the `[store]` one).
    pub retention: RawRetention,
}

/// `[store.retention]`: one table per data class, each optional.
#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawRetention {
    pub public: Option<RawClassRetention>,
    pub personal: Option<RawClassRetention>,
    pub sensitive: Option<RawClassRetention>,
    pub secret: Option<RawClassRetention>,
}

/// `[store.retention.<class>]`; a key left out takes the `[store]` one.
#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawClassRetention {
    /// false: no prompt or answer text of this class reaches the file.
    pub store_text: Option<bool>,
    pub tasks_hours: Option<u64>,
    pub audit_hours: Option<u64>,
    /// Caps `[scheduler] idempotency_ttl_seconds` for this class; 0: no cap.
    pub idempotency_hours: Option<u64>,
    /// Caps the idle expiry of a session that holds a turn of this class
    /// (or was created by a caller of it); 0: no cap (`[sessions]` alone).
    pub sessions_hours: Option<u64>,
}

impl Default for RawStore {
    fn default() -> Self {
        RawStore {
            data_dir: PathBuf::from("data"),
            store_prompts: false,
            max_buffered_writes: 100_000,
            retention_tasks_hours: 30 * 24,
            retention_rejected_hours: 7 * 24,
            retention_audit_hours: 365 * 24,
            reserve_bytes: 8 << 20,
            retention: RawRetention::default(),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawServer {
    /// How long a graceful stop lets running tasks finish.
    pub drain_timeout_s: u64,
}

impl Default for RawServer {
    fn default() -> Self {
        RawServer { drain_timeout_s: 30 }
    }
}

/// `[sessions]`: the ceilings of every session (a session may ask for
/// lower ones when it is created).
#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawSessions {
    pub max_lifetime_s: u64,
    pub idle_expiry_s: u64,
    pub max_messages: u32,
    pub max_tokens: u64,
    pub max_per_user: usize,
    pub max_per_application: usize,
    pub max_sessions: usize,
    pub max_memory_entries: usize,
    pub append_failed_turns: bool,
    pub summary_model: Option<String>,
    pub summary_priority: String,
    pub summary_max_tokens: u32,
    pub summary_deadline_ms: u64,
    pub summary_after_messages: u32,
    pub summary_history_share_pct: u32,
}

impl Default for RawSessions {
    fn default() -> Self {
        RawSessions {
            max_lifetime_s: 7 * 24 * 3600,
            idle_expiry_s: 24 * 3600,
            max_messages: 200,
            max_tokens: 200_000,
            max_per_user: 100,
            max_per_application: 10_000,
            max_sessions: 100_000,
            max_memory_entries: 100,
            append_failed_turns: false,
            summary_model: None,
            summary_priority: "P4".into(),
            summary_max_tokens: 256,
            summary_deadline_ms: 60_000,
            summary_after_messages: 6,
            summary_history_share_pct: 50,
        }
    }
}

/// `[context]`: what prompt assembly adds to every chat call and filters
/// from untrusted content (see `context::assembly`).
#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawContext {
    /// The platform's safety rules, first in every assembled prompt.
    pub safety_rules: Option<String>,
    /// Regular expressions filtered from untrusted content before it is
    /// sent (beside the built-in API-key patterns).
    pub secret_patterns: Vec<String>,
}

#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawLog {
    pub format: Field<LogFormat>,
    /// A `tracing` filter directive; checked in validation.
    pub level: String,
    /// An OTLP/HTTP collector to send task spans to; checked in validation.
    pub otlp_endpoint: Option<String>,
}

impl Default for RawLog {
    fn default() -> Self {
        RawLog { format: Field::Valid(LogFormat::Text), level: "info".into(), otlp_endpoint: None }
    }
}

#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawTimeouts {
    pub queue_ms: u64,
    pub first_token_ms: u64,
    pub inference_ms: u64,
    pub idle_ms: u64,
    pub total_ms: u64,
}

impl Default for RawTimeouts {
    fn default() -> Self {
        RawTimeouts {
            queue_ms: 30_000,
            first_token_ms: 60_000,
            inference_ms: 300_000,
            idle_ms: 30_000,
            total_ms: 600_000,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawScheduler {
    pub queue_capacity: usize,
    pub busy_retry_after_ms: u64,
    /// How often waiting tasks are told their new queue position (`queued`
    /// events, only when it changed); 0 = never.
    pub queue_update_ms: u64,
    pub replay_retention_ms: u64,
    pub replay_max_bytes: usize,
    /// Cap on waiting tasks over all models.
    pub max_queued: Option<usize>,
    /// Cap on running tasks over all engines.
    pub max_running: Option<usize>,
    /// A waiting task gains one priority level per this many seconds (never
    /// above P1); 0 turns aging off.
    pub priority_aging_seconds: f64,
    /// Output budget of P2-P4 work when queues are 80 % full.
    pub overload_max_output_tokens: u32,
    /// How long an idempotency key (and the answer it returns) is kept.
    pub idempotency_ttl_seconds: u64,
    /// A P0 task that finds no free slot may stop a P3/P4 task that is safe
    /// to restart and take its slot (see `applications.*.preemptible`).
    pub preemption: bool,
    /// Users whose per-user rate buckets are kept at once; past it those
    /// closest to full are forgotten.
    pub max_tracked_users: usize,
}

impl Default for RawScheduler {
    fn default() -> Self {
        RawScheduler {
            queue_capacity: 256,
            busy_retry_after_ms: 1_000,
            queue_update_ms: 1_000,
            replay_retention_ms: 300_000,
            replay_max_bytes: 64 * MIB,
            max_queued: None,
            max_running: None,
            priority_aging_seconds: 30.0,
            overload_max_output_tokens: 128,
            idempotency_ttl_seconds: 86_400,
            preemption: true,
            max_tracked_users: 100_000,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawResources {
    /// Watch NVIDIA GPUs through NVML (a machine without one just logs it).
    pub gpu: bool,
    pub poll_interval_ms: u64,
    pub danger_gpu_temperature_c: u32,
    pub danger_gpu_memory_percent: f64,
    /// On entering danger, cancel tasks of this priority and below.
    pub cancel_from_priority: Field<PriorityName>,
    /// How long a cancelled request may keep an engine slot busy before the
    /// instance is taken out of dispatch.
    pub cancel_grace_period_ms: u64,
    /// KV-cache usage (a fraction, as vLLM and llama.cpp report it) at
    /// which an engine instance gets no new task while it runs any.
    pub kv_cache_high_water: f64,
}

impl Default for RawResources {
    fn default() -> Self {
        RawResources {
            gpu: true,
            poll_interval_ms: 1000,
            danger_gpu_temperature_c: 90,
            danger_gpu_memory_percent: 98.0,
            cancel_from_priority: Field::Valid(PriorityName(Priority::P3)),
            cancel_grace_period_ms: 3000,
            kv_cache_high_water: 0.95,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawTenant {
    pub weight: f64,
    /// The least strict data class of every call of the tenant.
    pub data_class: Option<Field<DataClass>>,
    /// What the tenant's applications may spend together.
    pub budget: Option<RawBudget>,
}

impl Default for RawTenant {
    fn default() -> Self {
        RawTenant { weight: 1.0, data_class: None, budget: None }
    }
}

/// `[tenants.X.budget]`, `[applications.X.budget]`: every key optional.
#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawBudget {
    pub daily_tokens: Option<u64>,
    pub monthly_tokens: Option<u64>,
    pub daily_cost: Option<f64>,
    pub monthly_cost: Option<f64>,
    pub warn_percent: Option<u32>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawAuth {
    pub jwt: Option<RawJwt>,
}

#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawJwt {
    /// Name of the environment variable that holds the HS256 secret.
    pub hs256_secret_env: Option<String>,
    pub rs256_public_key_file: Option<PathBuf>,
    pub issuer: Option<String>,
    pub audience: Option<String>,
    pub tenant_claim: String,
    pub application_claim: String,
    pub leeway_s: u64,
}

impl Default for RawJwt {
    fn default() -> Self {
        RawJwt {
            hs256_secret_env: None,
            rs256_public_key_file: None,
            issuer: None,
            audience: None,
            tenant_claim: "tenant".into(),
            application_claim: "app".into(),
            leeway_s: 30,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawApplication {
    pub tenant: Field<String>,
    pub api_key_sha256: Vec<String>,
    pub max_priority: Field<PriorityName>,
    pub default_priority: Field<PriorityName>,
    pub admin: bool,
    /// Share of slots against other applications at the same priority.
    pub weight: f64,
    pub max_running: Option<usize>,
    pub max_queued: Option<usize>,
    pub user_max_running: Option<usize>,
    pub user_max_queued: Option<usize>,
    pub user_requests_per_minute: Option<u32>,
    pub user_tokens_per_minute: Option<u64>,
    /// The least strict data class of every call of the application.
    pub data_class: Option<Field<DataClass>>,
    /// Its calls may be answered by a smaller model (as if every request
    /// set `routing.allow_smaller_model`).
    pub allow_smaller_model: bool,
    /// Which of its tasks a P0 task may preempt: "P3" (P3 and P4), "P4",
    /// or "never".
    pub preemptible: Field<Preemptible>,
    /// The tools its requests may declare; absent: any.
    pub allowed_tools: Option<Vec<String>>,
    /// Tools whose calls come back marked `requires_confirmation`.
    pub high_risk_tools: Vec<String>,
    /// Patterns (regular expressions) replaced before anything of its
    /// sessions is kept.
    pub redact: Vec<String>,
    /// The application's system prompt, second in every assembled prompt
    /// of its calls (after the platform's safety rules).
    pub system_prompt: Option<String>,
    /// Output constraints, last in every assembled prompt of its calls.
    pub output_constraints: Option<String>,
    /// Prompt debug logging (`until`, `sample_rate`), checked by hand for
    /// errors with their paths.
    pub debug_prompts: Option<toml::Value>,
    /// `auto` or `disabled`: whether a conversation that does not fit may
    /// lose its oldest messages (a request's `context_policy` overrides).
    pub context_policy: Option<String>,
    /// What the application may spend per day and month.
    pub budget: Option<RawBudget>,
    /// Its calls may be answered from the response cache (`[cache]`).
    pub cache: bool,
    /// The logical models its calls may name; absent: any.
    pub allowed_models: Option<Vec<String>>,
    /// The priorities its calls may use ("P0".."P4"); absent: any from
    /// `max_priority` to P4.
    pub allowed_priorities: Option<Vec<String>>,
    /// The ingresses it may call through ("http", "ws", "mqtt", "nats");
    /// absent: all.
    pub allowed_ingresses: Option<Vec<String>>,
    /// A request header (HTTP, NATS) that names the end user, set by a
    /// trusted proxy in front of the application: honoured for its API
    /// keys, and the body's user fields are then ignored.
    pub user_header: Option<String>,
    /// API keys with an expiry, `{ sha256 = "…", expires = <date-time> }`,
    /// beside `api_key_sha256`; checked by hand for errors with their paths.
    pub api_keys: Vec<toml::Value>,
}

/// `applications.*.preemptible`: the most urgent priority of the
/// application's tasks that a P0 task may preempt, or `None` for never.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Preemptible(pub Option<Priority>);

impl<'de> Deserialize<'de> for Preemptible {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        match s.trim().to_ascii_uppercase().as_str() {
            "NEVER" => Ok(Preemptible(None)),
            "P3" => Ok(Preemptible(Some(Priority::P3))),
            "P4" => Ok(Preemptible(Some(Priority::P4))),
            _ => Err(D::Error::custom(format!("must be \"P3\", \"P4\" or \"never\", not {s:?}"))),
        }
    }
}

impl Default for RawApplication {
    fn default() -> Self {
        RawApplication {
            tenant: Field::Missing,
            api_key_sha256: Vec::new(),
            max_priority: Field::Valid(PriorityName(Priority::P1)),
            default_priority: Field::Valid(PriorityName(Priority::P2)),
            admin: false,
            weight: 1.0,
            max_running: None,
            max_queued: None,
            user_max_running: None,
            user_max_queued: None,
            user_requests_per_minute: None,
            user_tokens_per_minute: None,
            data_class: None,
            allow_smaller_model: false,
            preemptible: Field::Valid(Preemptible(Some(Priority::P3))),
            allowed_tools: None,
            high_risk_tools: Vec::new(),
            redact: Vec::new(),
            system_prompt: None,
            output_constraints: None,
            debug_prompts: None,
            context_policy: None,
            budget: None,
            cache: true,
            allowed_models: None,
            allowed_priorities: None,
            allowed_ingresses: None,
            user_header: None,
            api_keys: Vec::new(),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawEngine {
    #[serde(rename = "type")]
    pub kind: Field<EngineKind>,
    pub base_url: Field<String>,
    pub model: Field<String>,
    pub max_concurrency: usize,
    pub api_key_env: Option<String>,
    /// Default: the kind's model list (`/v1/models`, `/api/tags`).
    pub health_path: Option<String>,
    pub health_interval_ms: u64,
    pub connect_timeout_ms: u64,
    pub stream: bool,
    pub keep_alive: Option<String>,
    /// Where the engine runs: "local" (default), "edge-node" or "cloud".
    pub location: Option<Field<Location>>,
    /// Older spelling: `local = false` is `location = "cloud"`.
    pub local: Option<bool>,
    /// The most sensitive data class the instance may receive. Default: by
    /// location (local: secret, edge-node: sensitive, cloud: public).
    pub max_data_class: Option<Field<DataClass>>,
    /// What a thousand tokens (input and output) cost on this instance, in
    /// any unit; among equally loaded instances the cheaper one is picked.
    pub cost_per_1k_tokens: f64,
    /// What a million input (prompt) tokens cost on this instance, in the
    /// operator's currency: `edge.cost` and budgets. Default 0.
    pub price_input_per_mtok: f64,
    /// What a million output (answer) tokens cost. Default 0.
    pub price_output_per_mtok: f64,
    /// Slots held back for P0/P1 work.
    pub reserved_realtime_slots: usize,
    /// Prompt tokens of long prompts that may be in prefill at once on
    /// this engine (none: no long-prompt lane).
    pub max_prefill_tokens: Option<u32>,
    /// A prompt of more tokens than this is long (with `max_prefill_tokens`).
    pub long_prompt_tokens: Option<u32>,
    /// llama-server KV-cache slot affinity (`id_slot`, `cache_prompt`).
    pub slot_affinity: bool,
    /// llama-server: prompt assembly counts tokens with its `/tokenize`
    /// and `/apply-template`.
    pub tokenize: bool,
    /// Only edgeway sends work to this engine. Then an engine that reports
    /// more busy slots than edgeway runs after a cancel's grace period is
    /// taken out of dispatch; set false when other clients share it.
    pub exclusive: bool,
    /// Memory the engine has for its tasks' KV cache, when there is no GPU
    /// to ask (or to cap what edgeway may use of it).
    pub memory_budget_mb: Option<u64>,
    /// The engine takes `tools` (llama-server started with `--jinja`, vLLM
    /// with `--enable-auto-tool-choice`, an Ollama model with tools).
    pub tools: bool,
    /// `[engines.NAME.process]`: edgeway runs the engine itself.
    pub process: Option<super::process::RawProcess>,
    /// How edgeway loads and unloads models there: `none` (default),
    /// `llama-router`, `ollama` (see `config::residency`).
    pub model_api: Option<String>,
}

impl Default for RawEngine {
    fn default() -> Self {
        RawEngine {
            kind: Field::Missing,
            base_url: Field::Missing,
            model: Field::Missing,
            max_concurrency: 1,
            api_key_env: None,
            health_path: None,
            health_interval_ms: 2_000,
            connect_timeout_ms: 2_000,
            stream: true,
            keep_alive: None,
            location: None,
            local: None,
            max_data_class: None,
            cost_per_1k_tokens: 0.0,
            price_input_per_mtok: 0.0,
            price_output_per_mtok: 0.0,
            reserved_realtime_slots: 0,
            max_prefill_tokens: None,
            long_prompt_tokens: None,
            slot_affinity: false,
            tokenize: false,
            exclusive: true,
            memory_budget_mb: None,
            tools: false,
            process: None,
            model_api: None,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawModel {
    pub instances: Field<Vec<String>>,
    pub context_tokens: u32,
    pub max_output_tokens: u32,
    /// Default: `scheduler.queue_capacity`.
    pub queue_capacity: Option<usize>,
    pub description: Option<String>,
    pub max_running: Option<usize>,
    /// KV-cache bytes per token of context (for memory admission); or
    /// give `architecture` and edgeway computes it.
    pub kv_bytes_per_token: Option<u64>,
    pub architecture: Option<RawArchitecture>,
    /// Size of the model's weights, counted on an instance until it is
    /// loaded there.
    pub weights_mb: u64,
    /// Safety margin added to KV estimates.
    pub memory_margin_percent: f64,
    /// The part of the window prompt assembly leaves unused (5..=10), for
    /// the error of its token estimate.
    pub context_margin_percent: u32,
    /// The most of the prompt budget knowledge passages may take (0..=100).
    pub knowledge_budget_percent: u32,
    /// The most of the prompt budget tool results may take (0..=100).
    pub tool_results_budget_percent: u32,
    /// Smaller or quantized logical models that may answer instead (their
    /// local instances), in order, when the request or its application
    /// allows a smaller model.
    pub fallback_models: Vec<String>,
    /// A chat model with a larger window that takes a prompt this one's
    /// window cannot hold after trimming.
    pub larger_window_model: Option<String>,
    /// A fixed answer given when no engine step of the chain can take a
    /// request (marked degraded).
    pub canned_answer: Option<String>,
    /// `chat` (default) or `embedding`.
    pub kind: Option<Field<ModelKind>>,
    /// The engine honours an embedding request's `dimensions`.
    pub supports_dimensions: bool,
    /// The length of the model's vectors (embedding models), for `/v1/models`.
    pub dimensions: Option<u32>,
    /// Inputs per engine call of an embedding request (embedding models).
    pub max_batch_inputs: Option<u32>,
    /// `always` (default), `on_demand`, `restricted`, `forbidden`.
    pub residency: Option<String>,
    pub idle_unload_s: Option<u64>,
    pub restricted_to: Option<super::residency::RawRestriction>,
}

impl Default for RawModel {
    fn default() -> Self {
        RawModel {
            instances: Field::Missing,
            context_tokens: 4096,
            max_output_tokens: 1024,
            queue_capacity: None,
            description: None,
            max_running: None,
            kv_bytes_per_token: None,
            architecture: None,
            weights_mb: 0,
            memory_margin_percent: 10.0,
            context_margin_percent: 5,
            knowledge_budget_percent: 40,
            tool_results_budget_percent: 40,
            fallback_models: Vec::new(),
            larger_window_model: None,
            canned_answer: None,
            kind: None,
            supports_dimensions: false,
            dimensions: None,
            max_batch_inputs: None,
            residency: None,
            idle_unload_s: None,
            restricted_to: None,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawRouting {
    /// Cloud instances may be used at all (for data classes they accept).
    pub allow_cloud: bool,
    /// The class of a call nobody declared one for.
    pub default_data_class: Field<DataClass>,
    /// Engine attempts per task, the first included (retries happen only
    /// before the first token).
    pub max_attempts: u32,
    /// First back-off before retrying the same instance; doubles each time,
    /// with jitter.
    pub retry_backoff_ms: u64,
    /// Retries may be at most this share of requests over the window ...
    pub retry_budget_percent: f64,
    pub retry_budget_window_s: u64,
    /// ... plus this many per window.
    pub retry_budget_min: u32,
    pub breaker: RawBreaker,
    pub degradation: RawDegradation,
}

impl Default for RawRouting {
    fn default() -> Self {
        RawRouting {
            allow_cloud: false,
            default_data_class: Field::Valid(DataClass::Personal),
            max_attempts: 3,
            retry_backoff_ms: 50,
            retry_budget_percent: 10.0,
            retry_budget_window_s: 60,
            retry_budget_min: 3,
            breaker: RawBreaker::default(),
            degradation: RawDegradation::default(),
        }
    }
}

/// The circuit breaker of every engine instance.
#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawBreaker {
    /// Opens after this many failures in a row.
    pub consecutive_failures: u32,
    /// Opens when this share of the window's requests failed ...
    pub error_rate_percent: f64,
    /// ... and the window holds at least this many.
    pub min_requests: u32,
    pub window_s: u64,
    /// Opens when the window's p95 time to first token exceeds this.
    pub ttft_p95_ms: Option<u64>,
    /// An open breaker lets one trial request through after this long.
    pub cooldown_ms: u64,
}

impl Default for RawBreaker {
    fn default() -> Self {
        RawBreaker {
            consecutive_failures: 5,
            error_rate_percent: 50.0,
            min_requests: 10,
            window_s: 30,
            ttft_p95_ms: None,
            cooldown_ms: 10_000,
        }
    }
}

/// The least urgent priority admitted at each degradation level.
#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawDegradation {
    pub level_1_admit: Field<PriorityName>,
    pub level_2_admit: Field<PriorityName>,
}

impl Default for RawDegradation {
    fn default() -> Self {
        RawDegradation {
            level_1_admit: Field::Valid(PriorityName(Priority::P4)),
            level_2_admit: Field::Valid(PriorityName(Priority::P2)),
        }
    }
}

/// The numbers that fix a model's KV-cache size per token: K and V for
/// each layer, `kv_heads` × `head_dim` values each, `bytes_per_value` bytes
/// per value (2 for f16, 1 for q8_0 roughly).
#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawArchitecture {
    pub layers: Field<u64>,
    pub kv_heads: Field<u64>,
    pub head_dim: Field<u64>,
    pub bytes_per_value: f64,
}

impl Default for RawArchitecture {
    fn default() -> Self {
        RawArchitecture {
            layers: Field::Missing,
            kv_heads: Field::Missing,
            head_dim: Field::Missing,
            bytes_per_value: 2.0,
        }
    }
}

/// Applies `EDGEWAY__SECTION__KEY=value` variables to the parsed TOML. Key
/// segments match existing keys case-insensitively, with `_` also matching
/// `-` (so `EDGEWAY__ENGINES__LLAMA_LOCAL__BASE_URL` reaches
/// `engines.llama-local.base_url`). Values are read as TOML when they parse
/// as a TOML value (numbers, booleans, arrays), else as strings.
pub fn apply_env_overrides(
    root: &mut toml::Value,
    env: impl Iterator<Item = (String, String)>,
) -> Result<(), ConfigErrors> {
    let mut errors = Vec::new();
    let mut vars: Vec<(String, String)> =
        env.filter(|(k, _)| k.starts_with("EDGEWAY__") && k.len() > "EDGEWAY__".len()).collect();
    vars.sort();
    for (key, raw_value) in vars {
        let segments: Vec<&str> = key["EDGEWAY__".len()..].split("__").collect();
        if segments.iter().any(|s| s.is_empty()) {
            errors.push(ConfigError { path: key.clone(), message: "empty key segment".into() });
            continue;
        }
        let value = parse_env_value(&raw_value);
        let mut node = &mut *root;
        let last = segments.len() - 1;
        for (i, seg) in segments.iter().enumerate() {
            let Some(table) = node.as_table_mut() else {
                errors.push(ConfigError { path: key.clone(), message: "overrides a value that is not a table".into() });
                break;
            };
            let wanted = seg.to_ascii_lowercase();
            let existing = table.keys().find(|k| k.to_ascii_lowercase().replace('-', "_") == wanted).cloned();
            let name = existing.unwrap_or(wanted);
            if i == last {
                table.insert(name, value.clone());
                break;
            }
            node = table.entry(name).or_insert_with(|| toml::Value::Table(Default::default()));
        }
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(ConfigErrors(errors))
    }
}

fn parse_env_value(s: &str) -> toml::Value {
    #[derive(Deserialize)]
    struct Probe {
        v: toml::Value,
    }
    match toml::from_str::<Probe>(&format!("v = {s}")) {
        Ok(p) => p.v,
        Err(_) => toml::Value::String(s.to_string()),
    }
}
