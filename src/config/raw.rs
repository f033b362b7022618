//! The file format as written, with `deny_unknown_fields`, and its
//! validation into the typed [`Config`](super::Config).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use super::*;
use crate::admission::gpu_watch::ResourceConfig;
use crate::scheduler::policy::AppPolicy;
use crate::task::{Priority, Timeouts};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    #[serde(default = "default_node_id")]
    pub node_id: String,
    #[serde(default)]
    pub http: RawHttp,
    #[serde(default)]
    pub store: RawStore,
    #[serde(default)]
    pub log: RawLog,
    #[serde(default)]
    pub timeouts: RawTimeouts,
    #[serde(default)]
    pub scheduler: RawScheduler,
    #[serde(default)]
    pub auth: RawAuth,
    #[serde(default)]
    pub applications: BTreeMap<String, RawApplication>,
    #[serde(default)]
    pub tenants: BTreeMap<String, RawTenant>,
    #[serde(default)]
    pub resources: RawResources,
    #[serde(default)]
    pub engines: BTreeMap<String, RawEngine>,
    #[serde(default)]
    pub models: BTreeMap<String, RawModel>,
    pub nats: Option<super::nats::RawNats>,
    pub mqtt: Option<super::mqtt::RawMqtt>,
    #[serde(default)]
    pub devices: BTreeMap<String, super::mqtt::RawDevice>,
}

fn default_node_id() -> String {
    "edge-1".into()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawHttp {
    #[serde(default = "default_listen")]
    pub listen: String,
    pub admin_listen: Option<String>,
    #[serde(default = "default_max_body")]
    pub max_body_bytes: usize,
}

fn default_listen() -> String {
    "127.0.0.1:8080".into()
}
fn default_max_body() -> usize {
    4 * 1024 * 1024
}

impl Default for RawHttp {
    fn default() -> Self {
        RawHttp { listen: default_listen(), admin_listen: None, max_body_bytes: default_max_body() }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawStore {
    #[serde(default = "default_data_dir")]
    pub data_dir: String,
    #[serde(default)]
    pub store_prompts: bool,
}

fn default_data_dir() -> String {
    "data".into()
}

impl Default for RawStore {
    fn default() -> Self {
        RawStore { data_dir: default_data_dir(), store_prompts: false }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawLog {
    #[serde(default = "default_log_format")]
    pub format: String,
    #[serde(default = "default_log_level")]
    pub level: String,
}

fn default_log_format() -> String {
    "text".into()
}
fn default_log_level() -> String {
    "info".into()
}

impl Default for RawLog {
    fn default() -> Self {
        RawLog { format: default_log_format(), level: default_log_level() }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTimeouts {
    #[serde(default = "d_queue")]
    pub queue_ms: u64,
    #[serde(default = "d_first")]
    pub first_token_ms: u64,
    #[serde(default = "d_inference")]
    pub inference_ms: u64,
    #[serde(default = "d_idle")]
    pub idle_ms: u64,
    #[serde(default = "d_total")]
    pub total_ms: u64,
}

fn d_queue() -> u64 {
    30_000
}
fn d_first() -> u64 {
    60_000
}
fn d_inference() -> u64 {
    300_000
}
fn d_idle() -> u64 {
    30_000
}
fn d_total() -> u64 {
    600_000
}

impl Default for RawTimeouts {
    fn default() -> Self {
        RawTimeouts {
            queue_ms: d_queue(),
            first_token_ms: d_first(),
            inference_ms: d_inference(),
            idle_ms: d_idle(),
            total_ms: d_total(),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawScheduler {
    #[serde(default = "d_queue_cap")]
    pub queue_capacity: usize,
    #[serde(default = "d_busy_retry")]
    pub busy_retry_after_ms: u64,
    /// How often waiting tasks are told their new queue position (`queued`
    /// events, only when it changed); 0 = never.
    #[serde(default = "d_queue_updates")]
    pub queue_update_ms: u64,
    #[serde(default = "d_replay_retention")]
    pub replay_retention_ms: u64,
    #[serde(default = "d_replay_bytes")]
    pub replay_max_bytes: usize,
    /// Cap on waiting tasks over all models.
    pub max_queued: Option<usize>,
    /// Cap on running tasks over all engines.
    pub max_running: Option<usize>,
    /// A waiting task gains one priority level per this many seconds (never
    /// above P1); 0 turns aging off.
    #[serde(default = "d_aging")]
    pub priority_aging_seconds: f64,
    /// Output budget of P2-P4 work when queues are 80 % full.
    #[serde(default = "d_overload_tokens")]
    pub overload_max_output_tokens: u32,
    /// How long an idempotency key (and the answer it returns) is kept.
    #[serde(default = "d_idem_ttl")]
    pub idempotency_ttl_seconds: u64,
}

fn d_margin() -> f64 {
    10.0
}

fn d_idem_ttl() -> u64 {
    86_400
}

fn d_aging() -> f64 {
    30.0
}
fn d_overload_tokens() -> u32 {
    128
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawResources {
    /// Watch NVIDIA GPUs through NVML (a machine without one just logs it).
    #[serde(default = "d_true")]
    pub gpu: bool,
    #[serde(default = "d_res_poll")]
    pub poll_interval_ms: u64,
    #[serde(default = "d_danger_temp")]
    pub danger_gpu_temperature_c: u32,
    #[serde(default = "d_danger_mem")]
    pub danger_gpu_memory_percent: f64,
    /// On entering danger, cancel tasks of this priority and below.
    #[serde(default = "d_danger_cancel")]
    pub cancel_from_priority: String,
    /// How long a cancelled request may keep an engine slot busy before the
    /// instance is taken out of dispatch.
    #[serde(default = "d_cancel_grace")]
    pub cancel_grace_period_ms: u64,
    /// KV-cache usage (a fraction, as vLLM and llama.cpp report it) at
    /// which an engine instance gets no new task while it runs any.
    #[serde(default = "d_kv_high_water")]
    pub kv_cache_high_water: f64,
}

fn d_res_poll() -> u64 {
    1000
}
fn d_danger_temp() -> u32 {
    90
}
fn d_danger_mem() -> f64 {
    98.0
}
fn d_danger_cancel() -> String {
    "P3".into()
}
fn d_cancel_grace() -> u64 {
    3000
}
fn d_kv_high_water() -> f64 {
    0.95
}

impl Default for RawResources {
    fn default() -> Self {
        RawResources {
            gpu: true,
            poll_interval_ms: d_res_poll(),
            danger_gpu_temperature_c: d_danger_temp(),
            danger_gpu_memory_percent: d_danger_mem(),
            cancel_from_priority: d_danger_cancel(),
            cancel_grace_period_ms: d_cancel_grace(),
            kv_cache_high_water: d_kv_high_water(),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTenant {
    #[serde(default = "d_weight")]
    pub weight: f64,
}

fn d_weight() -> f64 {
    1.0
}

fn d_replay_retention() -> u64 {
    300_000
}
fn d_replay_bytes() -> usize {
    64 * 1024 * 1024
}

fn d_queue_cap() -> usize {
    256
}
fn d_busy_retry() -> u64 {
    1_000
}

fn d_queue_updates() -> u64 {
    1_000
}

impl Default for RawScheduler {
    fn default() -> Self {
        RawScheduler {
            queue_capacity: d_queue_cap(),
            busy_retry_after_ms: d_busy_retry(),
            queue_update_ms: d_queue_updates(),
            replay_retention_ms: d_replay_retention(),
            replay_max_bytes: d_replay_bytes(),
            max_queued: None,
            max_running: None,
            priority_aging_seconds: d_aging(),
            overload_max_output_tokens: d_overload_tokens(),
            idempotency_ttl_seconds: d_idem_ttl(),
        }
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawAuth {
    pub jwt: Option<RawJwt>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawJwt {
    /// Name of the environment variable that holds the HS256 secret.
    pub hs256_secret_env: Option<String>,
    pub rs256_public_key_file: Option<String>,
    pub issuer: Option<String>,
    pub audience: Option<String>,
    #[serde(default = "d_tenant_claim")]
    pub tenant_claim: String,
    #[serde(default = "d_app_claim")]
    pub application_claim: String,
    #[serde(default = "d_leeway")]
    pub leeway_s: u64,
}

fn d_tenant_claim() -> String {
    "tenant".into()
}
fn d_app_claim() -> String {
    "app".into()
}
fn d_leeway() -> u64 {
    30
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawApplication {
    pub tenant: String,
    #[serde(default)]
    pub api_key_sha256: Vec<String>,
    #[serde(default = "d_max_prio")]
    pub max_priority: String,
    #[serde(default = "d_default_prio")]
    pub default_priority: String,
    #[serde(default)]
    pub admin: bool,
    /// Share of slots against other applications at the same priority.
    #[serde(default = "d_weight")]
    pub weight: f64,
    pub max_running: Option<usize>,
    pub max_queued: Option<usize>,
    pub user_max_running: Option<usize>,
    pub user_max_queued: Option<usize>,
    pub user_requests_per_minute: Option<u32>,
    pub user_tokens_per_minute: Option<u64>,
}

fn d_max_prio() -> String {
    "P1".into()
}
fn d_default_prio() -> String {
    "P2".into()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawEngine {
    #[serde(rename = "type")]
    pub kind: String,
    pub base_url: String,
    pub model: String,
    #[serde(default = "d_concurrency")]
    pub max_concurrency: usize,
    pub api_key_env: Option<String>,
    pub health_path: Option<String>,
    #[serde(default = "d_health_interval")]
    pub health_interval_ms: u64,
    #[serde(default = "d_connect_timeout")]
    pub connect_timeout_ms: u64,
    #[serde(default = "d_true")]
    pub stream: bool,
    pub keep_alive: Option<String>,
    #[serde(default = "d_true")]
    pub local: bool,
    /// Slots held back for P0/P1 work.
    #[serde(default)]
    pub reserved_realtime_slots: usize,
    /// Only edgeway sends work to this engine. Then an engine that reports
    /// more busy slots than edgeway runs after a cancel's grace period is
    /// taken out of dispatch; set false when other clients share it.
    #[serde(default = "d_true")]
    pub exclusive: bool,
    /// Memory the engine has for its tasks' KV cache, when there is no GPU
    /// to ask (or to cap what edgeway may use of it).
    pub memory_budget_mb: Option<u64>,
}

fn d_concurrency() -> usize {
    1
}
fn d_health_interval() -> u64 {
    2_000
}
fn d_connect_timeout() -> u64 {
    2_000
}
fn d_true() -> bool {
    true
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawModel {
    pub instances: Vec<String>,
    #[serde(default = "d_context")]
    pub context_tokens: u32,
    #[serde(default = "d_max_out")]
    pub max_output_tokens: u32,
    pub queue_capacity: Option<usize>,
    pub description: Option<String>,
    pub max_running: Option<usize>,
    /// KV-cache bytes per token of context (for memory admission); or
    /// give `architecture` and edgeway computes it.
    pub kv_bytes_per_token: Option<u64>,
    pub architecture: Option<RawArchitecture>,
    /// Size of the model's weights, counted on an instance until it is
    /// loaded there.
    #[serde(default)]
    pub weights_mb: u64,
    /// Safety margin added to KV estimates.
    #[serde(default = "d_margin")]
    pub memory_margin_percent: f64,
}

/// The numbers that fix a model's KV-cache size per token: K and V for
/// each layer, `kv_heads` × `head_dim` values each, `bytes_per_value` bytes
/// per value (2 for f16, 1 for q8_0 roughly).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawArchitecture {
    pub layers: u64,
    pub kv_heads: u64,
    pub head_dim: u64,
    #[serde(default = "d_bytes_per_value")]
    pub bytes_per_value: f64,
}

fn d_bytes_per_value() -> f64 {
    2.0
}

fn d_context() -> u32 {
    4096
}
fn d_max_out() -> u32 {
    1024
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

impl RawConfig {
    pub fn validate(self, env: &[(String, String)], base_dir: &Path) -> Result<Config, ConfigErrors> {
        let mut errs: Vec<ConfigError> = Vec::new();
        let mut err = |path: String, message: String| errs.push(ConfigError { path, message });
        let getenv = |name: &str| env.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone());

        if self.node_id.trim().is_empty() {
            err("node_id".into(), "must not be empty".into());
        }

        let listen = parse_addr(&self.http.listen).unwrap_or_else(|m| {
            err("http.listen".into(), m);
            SocketAddr::from(([127, 0, 0, 1], 8080))
        });
        let admin_listen = match &self.http.admin_listen {
            Some(a) => match parse_addr(a) {
                Ok(a) => Some(a),
                Err(m) => {
                    err("http.admin_listen".into(), m);
                    None
                }
            },
            None => None,
        };
        if self.http.max_body_bytes < 1024 {
            err("http.max_body_bytes".into(), "must be at least 1024".into());
        }

        let format = match self.log.format.as_str() {
            "text" => LogFormat::Text,
            "json" => LogFormat::Json,
            other => {
                err("log.format".into(), format!("must be \"text\" or \"json\", not {other:?}"));
                LogFormat::Text
            }
        };
        if tracing_subscriber::EnvFilter::try_new(&self.log.level).is_err() {
            err("log.level".into(), format!("{:?} is not a valid filter", self.log.level));
        }

        let t = &self.timeouts;
        for (name, v) in [
            ("queue_ms", t.queue_ms),
            ("first_token_ms", t.first_token_ms),
            ("inference_ms", t.inference_ms),
            ("idle_ms", t.idle_ms),
            ("total_ms", t.total_ms),
        ] {
            if v == 0 {
                err(format!("timeouts.{name}"), "must be greater than 0".into());
            }
        }
        let timeouts = Timeouts {
            queue: Duration::from_millis(t.queue_ms),
            first_token: Duration::from_millis(t.first_token_ms),
            inference: Duration::from_millis(t.inference_ms),
            idle: Duration::from_millis(t.idle_ms),
            total: Duration::from_millis(t.total_ms),
        };
        if !(self.scheduler.priority_aging_seconds >= 0.0 && self.scheduler.priority_aging_seconds.is_finite()) {
            err("scheduler.priority_aging_seconds".into(), "must be 0 (off) or a positive number".into());
        }
        if Priority::parse(&self.resources.cancel_from_priority).is_none() {
            err("resources.cancel_from_priority".into(), "must be P0..P4".into());
        }
        if !(0.0..=100.0).contains(&self.resources.danger_gpu_memory_percent) {
            err("resources.danger_gpu_memory_percent".into(), "must be between 0 and 100".into());
        }
        let hw = self.resources.kv_cache_high_water;
        if !(hw > 0.0 && hw <= 1.0) {
            err("resources.kv_cache_high_water".into(), "must be a fraction above 0 and at most 1".into());
        }
        for (name, t) in &self.tenants {
            if !(t.weight > 0.0 && t.weight.is_finite()) {
                err(format!("tenants.{name}.weight"), "must be a positive number".into());
            }
        }
        if self.scheduler.queue_capacity == 0 {
            err("scheduler.queue_capacity".into(), "must be at least 1".into());
        }

        let jwt = match self.auth.jwt {
            None => None,
            Some(j) => {
                let hs = match &j.hs256_secret_env {
                    Some(var) => match getenv(var) {
                        Some(v) if v.len() >= 16 => Some(v.into_bytes()),
                        Some(_) => {
                            err("auth.jwt.hs256_secret_env".into(), format!("${var} must hold at least 16 bytes"));
                            None
                        }
                        None => {
                            err("auth.jwt.hs256_secret_env".into(), format!("environment variable {var} is not set"));
                            None
                        }
                    },
                    None => None,
                };
                let rs = match &j.rs256_public_key_file {
                    Some(f) => {
                        let p = resolve(base_dir, f);
                        match std::fs::read(&p) {
                            Ok(pem) => {
                                if jsonwebtoken::DecodingKey::from_rsa_pem(&pem).is_err() {
                                    err(
                                        "auth.jwt.rs256_public_key_file".into(),
                                        format!("{} is not an RSA public key in PEM", p.display()),
                                    );
                                }
                                Some(pem)
                            }
                            Err(e) => {
                                err(
                                    "auth.jwt.rs256_public_key_file".into(),
                                    format!("cannot read {}: {e}", p.display()),
                                );
                                None
                            }
                        }
                    }
                    None => None,
                };
                if j.hs256_secret_env.is_none() && j.rs256_public_key_file.is_none() {
                    err("auth.jwt".into(), "needs hs256_secret_env or rs256_public_key_file".into());
                }
                Some(JwtConfig {
                    hs256_secret: hs,
                    rs256_public_key_pem: rs,
                    issuer: j.issuer,
                    audience: j.audience,
                    tenant_claim: j.tenant_claim,
                    application_claim: j.application_claim,
                    leeway_s: j.leeway_s,
                })
            }
        };

        let mut applications = BTreeMap::new();
        let mut seen_keys: BTreeMap<[u8; 32], String> = BTreeMap::new();
        for (name, a) in self.applications {
            let p = format!("applications.{name}");
            if a.tenant.trim().is_empty() {
                err(format!("{p}.tenant"), "must not be empty".into());
            }
            let mut keys = Vec::new();
            for (i, k) in a.api_key_sha256.iter().enumerate() {
                let k = k.trim().trim_start_matches("sha256:");
                match hex::decode(k) {
                    Ok(b) if b.len() == 32 => {
                        let arr: [u8; 32] = b.try_into().expect("32 bytes");
                        if let Some(other) = seen_keys.insert(arr, name.clone()) {
                            err(
                                format!("{p}.api_key_sha256[{i}]"),
                                format!("the same key is also used by application {other}"),
                            );
                        }
                        keys.push(arr);
                    }
                    _ => err(
                        format!("{p}.api_key_sha256[{i}]"),
                        "must be a SHA-256 digest in hex (64 characters); `edgeway hash-key KEY` prints one".into(),
                    ),
                }
            }
            let max_priority = Priority::parse(&a.max_priority).unwrap_or_else(|| {
                err(format!("{p}.max_priority"), format!("must be P0..P4, not {:?}", a.max_priority));
                Priority::P4
            });
            let default_priority = Priority::parse(&a.default_priority).unwrap_or_else(|| {
                err(format!("{p}.default_priority"), format!("must be P0..P4, not {:?}", a.default_priority));
                Priority::P4
            });
            if default_priority < max_priority {
                err(
                    format!("{p}.default_priority"),
                    format!("{} is more urgent than max_priority {}", default_priority.as_str(), max_priority.as_str()),
                );
            }
            if !(a.weight > 0.0 && a.weight.is_finite()) {
                err(format!("{p}.weight"), "must be a positive number".into());
            }
            applications.insert(
                name.clone(),
                ApplicationConfig {
                    name,
                    tenant: a.tenant,
                    api_key_sha256: keys,
                    max_priority,
                    default_priority,
                    admin: a.admin,
                    limits: AppPolicy {
                        weight: a.weight,
                        max_running: a.max_running,
                        max_queued: a.max_queued,
                        user_max_running: a.user_max_running,
                        user_max_queued: a.user_max_queued,
                        user_requests_per_minute: a.user_requests_per_minute,
                        user_tokens_per_minute: a.user_tokens_per_minute,
                    },
                },
            );
        }

        let mut engines = BTreeMap::new();
        for (name, e) in self.engines {
            let p = format!("engines.{name}");
            let kind = match e.kind.as_str() {
                "openai" => EngineKind::OpenAi,
                "ollama" => EngineKind::Ollama,
                other => {
                    err(format!("{p}.type"), format!("must be \"openai\" or \"ollama\", not {other:?}"));
                    EngineKind::OpenAi
                }
            };
            match reqwest::Url::parse(&e.base_url) {
                Ok(u) if u.scheme() == "http" || u.scheme() == "https" => {}
                _ => err(format!("{p}.base_url"), format!("{:?} is not an http(s) URL", e.base_url)),
            }
            if e.model.trim().is_empty() {
                err(format!("{p}.model"), "must not be empty".into());
            }
            if e.max_concurrency == 0 {
                err(format!("{p}.max_concurrency"), "must be at least 1".into());
            }
            if e.max_concurrency > 0 && e.reserved_realtime_slots >= e.max_concurrency {
                err(format!("{p}.reserved_realtime_slots"), "must be less than max_concurrency".into());
            }
            if e.health_interval_ms < 50 {
                err(format!("{p}.health_interval_ms"), "must be at least 50".into());
            }
            let api_key = match &e.api_key_env {
                Some(var) => match getenv(var) {
                    Some(v) => Some(v),
                    None => {
                        err(format!("{p}.api_key_env"), format!("environment variable {var} is not set"));
                        None
                    }
                },
                None => None,
            };
            if e.keep_alive.is_some() && kind != EngineKind::Ollama {
                err(format!("{p}.keep_alive"), "only applies to type = \"ollama\"".into());
            }
            let health_path = e.health_path.unwrap_or_else(|| match kind {
                EngineKind::OpenAi => "/v1/models".into(),
                EngineKind::Ollama => "/api/tags".into(),
            });
            if !health_path.starts_with('/') {
                err(format!("{p}.health_path"), "must start with '/'".into());
            }
            engines.insert(
                name.clone(),
                EngineConfig {
                    name,
                    kind,
                    base_url: e.base_url.trim_end_matches('/').to_string(),
                    model: e.model,
                    max_concurrency: e.max_concurrency,
                    api_key,
                    health_path,
                    health_interval: Duration::from_millis(e.health_interval_ms),
                    connect_timeout: Duration::from_millis(e.connect_timeout_ms),
                    stream: e.stream,
                    keep_alive: e.keep_alive,
                    local: e.local,
                    reserved_realtime_slots: e.reserved_realtime_slots,
                    exclusive: e.exclusive,
                    memory_budget_bytes: e.memory_budget_mb.map(|mb| mb * 1024 * 1024),
                },
            );
        }

        let mut models = BTreeMap::new();
        for (name, m) in self.models {
            let p = format!("models.{name}");
            if m.instances.is_empty() {
                err(format!("{p}.instances"), "must name at least one engine".into());
            }
            for (i, inst) in m.instances.iter().enumerate() {
                if !engines.contains_key(inst) {
                    err(format!("{p}.instances[{i}]"), format!("no engine named {inst:?} in [engines]"));
                }
            }
            if m.context_tokens < 16 {
                err(format!("{p}.context_tokens"), "must be at least 16".into());
            }
            if m.max_output_tokens == 0 || m.max_output_tokens >= m.context_tokens {
                err(format!("{p}.max_output_tokens"), "must be between 1 and context_tokens - 1".into());
            }
            if m.queue_capacity == Some(0) {
                err(format!("{p}.queue_capacity"), "must be at least 1".into());
            }
            if !(m.memory_margin_percent.is_finite() && m.memory_margin_percent >= 0.0) {
                err(format!("{p}.memory_margin_percent"), "must be a number of percent, 0 or more".into());
            }
            let kv_bytes_per_token = match (m.kv_bytes_per_token, &m.architecture) {
                (Some(_), Some(_)) => {
                    err(format!("{p}.architecture"), "give kv_bytes_per_token or architecture, not both".into());
                    0
                }
                (Some(n), None) => n,
                (None, Some(a)) => {
                    let valid = a.layers > 0
                        && a.kv_heads > 0
                        && a.head_dim > 0
                        && a.bytes_per_value.is_finite()
                        && a.bytes_per_value > 0.0;
                    if !valid {
                        err(
                            format!("{p}.architecture"),
                            "layers, kv_heads, head_dim and bytes_per_value must be positive".into(),
                        );
                    }
                    // K and V per layer.
                    (2.0 * (a.layers * a.kv_heads * a.head_dim) as f64 * a.bytes_per_value).ceil() as u64
                }
                (None, None) => 0,
            };
            models.insert(
                name.clone(),
                ModelConfig {
                    name,
                    instances: m.instances,
                    context_tokens: m.context_tokens,
                    max_output_tokens: m.max_output_tokens,
                    queue_capacity: m.queue_capacity.unwrap_or(self.scheduler.queue_capacity),
                    description: m.description,
                    max_running: m.max_running,
                    kv_bytes_per_token,
                    weights_bytes: m.weights_mb * 1024 * 1024,
                    memory_margin: m.memory_margin_percent / 100.0,
                },
            );
        }
        if models.is_empty() {
            err("models".into(), "define at least one logical model".into());
        }
        if applications.is_empty() && jwt.is_none() {
            err("applications".into(), "define at least one application or [auth.jwt]; nobody could call".into());
        }
        let nats = self.nats.map(|n| super::nats::validate(n, env, base_dir, &self.node_id, &mut err));
        let mqtt = self.mqtt.map(|m| super::mqtt::validate(m, base_dir, &mut err));
        let devices = super::mqtt::validate_devices(self.devices, &applications, &mut err);

        if !errs.is_empty() {
            return Err(ConfigErrors(errs));
        }
        Ok(Config {
            node_id: self.node_id,
            http: HttpConfig { listen, admin_listen, max_body_bytes: self.http.max_body_bytes },
            store: StoreConfig {
                data_dir: PathBuf::from(self.store.data_dir),
                store_prompts: self.store.store_prompts,
            },
            log: LogConfig { format, level: self.log.level },
            timeouts,
            scheduler: SchedulerConfig {
                queue_capacity: self.scheduler.queue_capacity,
                busy_retry_after_ms: self.scheduler.busy_retry_after_ms,
                queue_updates: (self.scheduler.queue_update_ms > 0)
                    .then(|| Duration::from_millis(self.scheduler.queue_update_ms)),
                replay_retention: Duration::from_millis(self.scheduler.replay_retention_ms),
                replay_max_bytes: self.scheduler.replay_max_bytes,
                max_queued: self.scheduler.max_queued,
                max_running: self.scheduler.max_running,
                priority_aging: (self.scheduler.priority_aging_seconds > 0.0)
                    .then(|| Duration::from_secs_f64(self.scheduler.priority_aging_seconds)),
                overload_max_output_tokens: self.scheduler.overload_max_output_tokens,
                idempotency_ttl: Duration::from_secs(self.scheduler.idempotency_ttl_seconds),
            },
            tenant_weights: self.tenants.iter().map(|(k, t)| (k.clone(), t.weight)).collect(),
            resources: ResourceConfig {
                gpu: self.resources.gpu,
                poll_interval: Duration::from_millis(self.resources.poll_interval_ms.max(100)),
                danger_gpu_temperature_c: self.resources.danger_gpu_temperature_c,
                danger_gpu_memory_percent: self.resources.danger_gpu_memory_percent,
                cancel_from_priority: Priority::parse(&self.resources.cancel_from_priority).unwrap_or(Priority::P3),
            },
            cancel_grace: Duration::from_millis(self.resources.cancel_grace_period_ms),
            kv_cache_high_water: self.resources.kv_cache_high_water,
            auth: AuthConfig { jwt },
            applications,
            engines,
            models,
            nats,
            mqtt,
            devices,
        })
    }
}

fn parse_addr(s: &str) -> Result<SocketAddr, String> {
    s.parse::<SocketAddr>().map_err(|_| format!("{s:?} is not an address like 127.0.0.1:8080"))
}

fn resolve(base: &Path, f: &str) -> PathBuf {
    let p = PathBuf::from(f);
    if p.is_absolute() {
        p
    } else {
        base.join(p)
    }
}
