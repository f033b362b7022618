//! Validation of the raw file into the typed [`Config`], one function per
//! section. Each reports every problem it finds into one [`Problems`] list,
//! by key path (`engines.vllm.max_concurrency`), and none stops the others:
//! one load names every mistake in the file. Nothing here panics.
//!
//! Owns: the rules on values, within a section and between sections
//! (a model's instances are engines; someone must be able to call).
//! Does not own: the syntax, accepted spellings and defaults (`raw.rs`),
//! and the rules of `[nats]`, `[mqtt]` and `[devices]` (their own files).
//!
//! A section function returns `None` only after it reported a problem, and
//! a map of entries holds `None` for an entry that had one; the [`Config`]
//! is built only when no problem was reported at all.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::raw::{
    optional, Field, RawApplication, RawArchitecture, RawAuth, RawConfig, RawEngine, RawHttp, RawJwt, RawLog, RawModel,
    RawResources, RawRouting, RawScheduler, RawStore, RawTenant, RawTimeouts,
};
use super::*;

/// Entries of a table section (`[engines.NAME]`, …) by name; `None` for an
/// entry with a problem, so later sections still see that the name exists.
pub(super) type Entries<T> = BTreeMap<String, Option<T>>;

/// The value of environment variable `name` among those the load was given.
pub(super) fn env_var<'a>(env: &'a [(String, String)], name: &str) -> Option<&'a str> {
    env.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
}

/// `f` as written if absolute, else relative to the config file's folder.
pub(super) fn resolve(base_dir: &Path, f: &Path) -> PathBuf {
    if f.is_absolute() {
        f.to_path_buf()
    } else {
        base_dir.join(f)
    }
}

/// Parses a `sha256:`-optional hex SHA-256 digest.
pub(super) fn sha256_hex(s: &str) -> Option<[u8; 32]> {
    hex::decode(s.trim().trim_start_matches("sha256:")).ok()?.try_into().ok()
}

/// All entries, or `None` when one of them had a problem.
fn all<T>(entries: Entries<T>) -> Option<BTreeMap<String, T>> {
    entries.into_iter().map(|(name, e)| e.map(|e| (name, e))).collect()
}

/// Resources as they land in [`Config`]: the watch's thresholds and two
/// values the scheduler reads.
struct Resources {
    watch: ResourceConfig,
    cancel_grace: Duration,
    kv_cache_high_water: f64,
}

impl RawConfig {
    pub fn validate(self, env: &[(String, String)], base_dir: &Path) -> Result<Config, ConfigErrors> {
        let mut p = Problems::default();

        if self.node_id.trim().is_empty() {
            p.add("node_id", "must not be empty");
        }
        let http = http(self.http, &mut p);
        let store = store(self.store, &mut p);
        let server = ServerConfig { drain_timeout: Duration::from_secs(self.server.drain_timeout_s) };
        if self.server.drain_timeout_s > 3600 {
            p.add("server.drain_timeout_s", "must be at most 3600");
        }
        let sessions = sessions(self.sessions, &self.models, &mut p);
        let context = context(self.context, &mut p);
        let log = log(self.log, &mut p);
        let timeouts = timeouts(self.timeouts, &mut p);
        let default_queue_capacity = self.scheduler.queue_capacity;
        let scheduler = scheduler(self.scheduler, &mut p);
        let resources = resources(self.resources, &mut p);
        let (tenant_weights, tenant_data_class, tenant_budgets) = tenants(self.tenants, &mut p);
        let routing = routing(self.routing, &mut p);
        let auth = auth(self.auth, env, base_dir, &mut p);
        let model_names: BTreeSet<String> = self.models.keys().cloned().collect();
        let applications = applications(self.applications, &model_names, &mut p);
        let engine_names: BTreeSet<String> = self.engines.keys().cloned().collect();
        let allow_cloud = routing.as_ref().is_some_and(|r| r.allow_cloud);
        let engines = engines(self.engines, env, allow_cloud, base_dir, &mut p);
        let models = models(self.models, &engine_names, &model_names, default_queue_capacity, &mut p);
        super::residency::cross_check(&engines, &models, &mut p);
        let nobody_could_call = applications.is_empty() && auth.as_ref().is_some_and(|a| a.jwt.is_none());
        if nobody_could_call {
            p.add("applications", "define at least one application or [auth.jwt]; nobody could call");
        }
        let jetstream = self.nats.as_ref().is_some_and(|n| n.jetstream.is_some());
        let cluster = optional_section(self.cluster.map(|c| super::cluster::validate(c, jetstream, env, &mut p)));
        // A pool instance reaches the other nodes with the pool's key.
        let pool_key = matches!(&cluster, Some(Some(c)) if c.key.is_some());
        for (name, e) in &engines {
            if e.as_ref().is_some_and(|e| e.kind == EngineKind::Pool) && !pool_key {
                p.add(
                    format!("engines.{name}.type"),
                    "a pool instance needs [cluster] with key_env (the pool's shared key)",
                );
            }
        }
        let nats = optional_section(self.nats.map(|n| super::nats::validate(n, env, base_dir, &self.node_id, &mut p)));
        let mqtt = optional_section(self.mqtt.map(|m| super::mqtt::validate(m, env, base_dir, &self.node_id, &mut p)));
        let devices = super::mqtt::validate_devices(self.devices, &applications, &mut p);
        let cache = super::cache::validate(self.cache, &mut p);

        let config = (|| {
            let resources = resources?;
            Some(Config {
                node_id: self.node_id,
                http: http?,
                store,
                server,
                sessions,
                context,
                log: log?,
                timeouts,
                scheduler,
                auth: auth?,
                applications: all(applications)?,
                engines: all(engines)?,
                models: all(models)?,
                tenant_weights,
                tenant_data_class,
                tenant_budgets,
                routing: routing?,
                resources: resources.watch,
                cancel_grace: resources.cancel_grace,
                kv_cache_high_water: resources.kv_cache_high_water,
                nats: nats?,
                cluster: cluster?,
                mqtt: mqtt?,
                devices: all(devices)?,
                cache,
                // Set by the loader, which sees the whole text.
                version: String::new(),
                source: None,
            })
        })();
        match config {
            Some(config) if p.is_empty() => Ok(config),
            _ => {
                debug_assert!(!p.is_empty(), "a section returned None without reporting why");
                if p.is_empty() {
                    p.add("", "invalid configuration");
                }
                Err(ConfigErrors(p.0))
            }
        }
    }
}

fn sessions(
    s: super::raw::RawSessions,
    models: &BTreeMap<String, RawModel>,
    p: &mut Problems,
) -> super::SessionsConfig {
    const YEAR_S: u64 = 366 * 24 * 3600;
    for (key, v) in [("max_lifetime_s", s.max_lifetime_s), ("idle_expiry_s", s.idle_expiry_s)] {
        if v == 0 || v > YEAR_S {
            p.add(format!("sessions.{key}"), format!("must be 1..{YEAR_S} seconds"));
        }
    }
    if s.max_messages < 2 {
        p.add("sessions.max_messages", "must be at least 2 (one turn)");
    }
    for (key, v) in [
        ("max_tokens", s.max_tokens),
        ("max_per_user", s.max_per_user as u64),
        ("max_per_application", s.max_per_application as u64),
        ("max_sessions", s.max_sessions as u64),
        ("max_memory_entries", s.max_memory_entries as u64),
    ] {
        if v == 0 {
            p.add(format!("sessions.{key}"), "must be at least 1");
        }
    }
    super::SessionsConfig {
        max_lifetime: Duration::from_secs(s.max_lifetime_s),
        idle_expiry: Duration::from_secs(s.idle_expiry_s),
        max_messages: s.max_messages,
        max_tokens: s.max_tokens,
        max_per_user: s.max_per_user,
        max_per_application: s.max_per_application,
        max_sessions: s.max_sessions,
        max_memory_entries: s.max_memory_entries,
        append_failed_turns: s.append_failed_turns,
        summary: summary(&s, models, p),
    }
}

fn context(c: super::raw::RawContext, p: &mut Problems) -> super::ContextConfig {
    for (i, pat) in c.secret_patterns.iter().enumerate() {
        if let Err(e) = regex::Regex::new(pat) {
            p.add(format!("context.secret_patterns[{i}]"), format!("not a regular expression: {e}"));
        }
    }
    super::ContextConfig {
        safety_rules: c.safety_rules.filter(|r| !r.trim().is_empty()),
        secret_patterns: c.secret_patterns,
    }
}

/// The least room a summary model's window must leave beside
/// `summary_max_tokens` for the summary prompt: its instruction (about 80
/// tokens) and at least one short turn (`crate::context::summary` checks
/// the instruction against it).
pub const SUMMARY_PROMPT_MIN_TOKENS: u32 = 128;

/// `[sessions] summary_*`: checked whether or not a model is named, so a
/// wrong value is reported before someone turns summaries on.
fn summary(
    s: &super::raw::RawSessions,
    models: &BTreeMap<String, RawModel>,
    p: &mut Problems,
) -> Option<super::SummaryConfig> {
    let priority = crate::task::Priority::parse(&s.summary_priority);
    if priority.is_none() {
        p.add("sessions.summary_priority", "must be one of P0..P4");
    }
    if !(16..=8192).contains(&s.summary_max_tokens) {
        p.add("sessions.summary_max_tokens", "must be 16..8192");
    }
    if !(1000..=3_600_000).contains(&s.summary_deadline_ms) {
        p.add("sessions.summary_deadline_ms", "must be 1000..3600000");
    }
    if !(2..=1000).contains(&s.summary_after_messages) {
        p.add("sessions.summary_after_messages", "must be 2..1000");
    }
    if !(10..=90).contains(&s.summary_history_share_pct) {
        p.add("sessions.summary_history_share_pct", "must be 10..90");
    }
    let model = s.summary_model.as_ref()?;
    match models.get(model) {
        None => p.add("sessions.summary_model", format!("no model named {model:?} in [models]")),
        Some(m) if matches!(&m.kind, Some(Field::Valid(k)) if *k != ModelKind::Chat) => {
            p.add("sessions.summary_model", format!("{model:?} is not a chat model"))
        }
        // The summary's output budget comes off the summary model's window:
        // what is left must hold the summary prompt, or every turn would
        // find no room and only warn (review 14 L8 b).
        Some(m) if m.context_tokens < s.summary_max_tokens.saturating_add(SUMMARY_PROMPT_MIN_TOKENS) => p.add(
            "sessions.summary_max_tokens",
            format!(
                "{} leaves {} tokens of summary model {model:?}'s window (context_tokens = {}) for the summary \
                 prompt; it needs at least {SUMMARY_PROMPT_MIN_TOKENS}: lower it or name a model with a larger window",
                s.summary_max_tokens,
                m.context_tokens.saturating_sub(s.summary_max_tokens),
                m.context_tokens
            ),
        ),
        Some(_) => {}
    }
    Some(super::SummaryConfig {
        model: model.clone(),
        priority: priority.unwrap_or(crate::task::Priority::P4),
        max_tokens: s.summary_max_tokens,
        deadline: Duration::from_millis(s.summary_deadline_ms),
        after_messages: s.summary_after_messages,
        history_share_pct: s.summary_history_share_pct,
    })
}

/// `Some(None)` for an absent optional section, `None` for one with a problem.
fn optional_section<T>(section: Option<Option<T>>) -> Option<Option<T>> {
    match section {
        None => Some(None),
        Some(s) => s.map(Some),
    }
}

fn http(raw: RawHttp, p: &mut Problems) -> Option<HttpConfig> {
    let listen = raw.listen.get("http.listen", p);
    let admin_listen = optional(raw.admin_listen, "http.admin_listen", p);
    if raw.max_body_bytes < 1024 {
        p.add("http.max_body_bytes", "must be at least 1024");
    }
    for (key, n) in
        [("http.max_connections", raw.max_connections), ("http.admin_max_connections", raw.admin_max_connections)]
    {
        if n == 0 {
            p.add(key, "must be at least 1");
        }
    }
    for (key, ms) in
        [("http.header_read_timeout_ms", raw.header_read_timeout_ms), ("http.idle_timeout_ms", raw.idle_timeout_ms)]
    {
        if !(100..=3_600_000).contains(&ms) {
            p.add(key, "must be between 100 and 3600000 (one hour)");
        }
    }
    if !(1..=1024).contains(&raw.ws_max_in_flight) {
        p.add("http.ws_max_in_flight", "must be between 1 and 1024");
    }
    if !(1_000..=86_400_000).contains(&raw.max_connection_age_ms) {
        p.add("http.max_connection_age_ms", "must be between 1000 and 86400000 (one day)");
    }
    Some(HttpConfig {
        listen: listen?,
        admin_listen: admin_listen?,
        max_body_bytes: raw.max_body_bytes,
        max_connections: raw.max_connections,
        admin_max_connections: raw.admin_max_connections,
        header_read_timeout: Duration::from_millis(raw.header_read_timeout_ms),
        idle_timeout: Duration::from_millis(raw.idle_timeout_ms),
        max_connection_age: Duration::from_millis(raw.max_connection_age_ms),
        ws_max_in_flight: raw.ws_max_in_flight,
    })
}

fn store(raw: RawStore, p: &mut Problems) -> StoreConfig {
    if raw.max_buffered_writes < 1000 {
        p.add("store.max_buffered_writes", "must be at least 1000");
    }
    if raw.reserve_bytes != 0 && !(64 << 10..=1 << 30).contains(&raw.reserve_bytes) {
        p.add("store.reserve_bytes", "must be 0 (none) or from 65536 (64 KiB) to 1073741824 (1 GiB)");
    }
    let hours = |h: u64| (h > 0).then(|| Duration::from_secs(h.saturating_mul(3600)));
    for (key, h) in [
        ("retention_tasks_hours", raw.retention_tasks_hours),
        ("retention_rejected_hours", raw.retention_rejected_hours),
        ("retention_audit_hours", raw.retention_audit_hours),
    ] {
        if h > MAX_RETENTION_HOURS {
            p.add(format!("store.{key}"), format!("must be at most {MAX_RETENTION_HOURS} (100 years); 0 keeps"));
        }
    }
    let r = raw.retention;
    let classes = [r.public, r.personal, r.sensitive, r.secret];
    let retention_classes: [ClassRetention; 4] = std::array::from_fn(|i| {
        let c = classes[i].as_ref();
        let name = DataClass::ALL[i].as_str();
        let mut age = |key: &str, own: Option<u64>, default: u64| {
            let h = own.unwrap_or(default);
            if h > MAX_RETENTION_HOURS {
                p.add(
                    format!("store.retention.{name}.{key}"),
                    format!("must be at most {MAX_RETENTION_HOURS}; 0 keeps"),
                );
            }
            hours(h)
        };
        ClassRetention {
            store_text: c.and_then(|c| c.store_text).unwrap_or(true),
            tasks: age("tasks_hours", c.and_then(|c| c.tasks_hours), raw.retention_tasks_hours),
            audit: age("audit_hours", c.and_then(|c| c.audit_hours), raw.retention_audit_hours),
            idempotency: age("idempotency_hours", c.and_then(|c| c.idempotency_hours), 0),
            sessions: age("sessions_hours", c.and_then(|c| c.sessions_hours), 0),
        }
    });
    // The chain is purged from its oldest end only: by the strictest age.
    let retention_audit = retention_classes.iter().filter_map(|c| c.audit).min();
    StoreConfig {
        data_dir: raw.data_dir,
        store_prompts: raw.store_prompts,
        max_buffered_writes: raw.max_buffered_writes,
        retention_tasks: hours(raw.retention_tasks_hours),
        retention_rejected: hours(raw.retention_rejected_hours),
        retention_audit,
        reserve_bytes: raw.reserve_bytes,
        retention_classes,
    }
}

/// The longest retention age in hours (100 years): longer is a typo, and
/// milliseconds of it must fit the store's clock arithmetic.
const MAX_RETENTION_HOURS: u64 = 100 * 365 * 24;

fn log(raw: RawLog, p: &mut Problems) -> Option<LogConfig> {
    let format = raw.format.get("log.format", p);
    if tracing_subscriber::EnvFilter::try_new(&raw.level).is_err() {
        p.add("log.level", format!("{:?} is not a valid filter", raw.level));
    }
    let otlp_endpoint = raw.otlp_endpoint.filter(|e| !e.trim().is_empty());
    if let Some(e) = &otlp_endpoint {
        if !(e.starts_with("http://") || e.starts_with("https://")) || reqwest::Url::parse(e).is_err() {
            p.add(
                "log.otlp_endpoint",
                format!("{e:?} is not an http:// or https:// URL (an OTLP/HTTP collector, e.g. http://127.0.0.1:4318)"),
            );
        }
    }
    Some(LogConfig { format: format?, level: raw.level, otlp_endpoint })
}

fn timeouts(t: RawTimeouts, p: &mut Problems) -> Timeouts {
    for (name, v) in [
        ("queue_ms", t.queue_ms),
        ("first_token_ms", t.first_token_ms),
        ("inference_ms", t.inference_ms),
        ("idle_ms", t.idle_ms),
        ("total_ms", t.total_ms),
    ] {
        if v == 0 {
            p.add(format!("timeouts.{name}"), "must be greater than 0");
        }
    }
    Timeouts {
        queue: Duration::from_millis(t.queue_ms),
        first_token: Duration::from_millis(t.first_token_ms),
        inference: Duration::from_millis(t.inference_ms),
        idle: Duration::from_millis(t.idle_ms),
        total: Duration::from_millis(t.total_ms),
    }
}

fn scheduler(s: RawScheduler, p: &mut Problems) -> SchedulerConfig {
    // `try_from_secs_f64` refuses what `from_secs_f64` would panic on
    // (negative, NaN, too large).
    let priority_aging = match Duration::try_from_secs_f64(s.priority_aging_seconds) {
        Ok(_) if s.priority_aging_seconds == 0.0 => None,
        Ok(d) => Some(d),
        Err(_) => {
            p.add("scheduler.priority_aging_seconds", "must be 0 (off) or a positive number");
            None
        }
    };
    if s.queue_capacity == 0 {
        p.add("scheduler.queue_capacity", "must be at least 1");
    }
    if s.max_tracked_users < 100 {
        p.add("scheduler.max_tracked_users", "must be at least 100");
    }
    SchedulerConfig {
        queue_capacity: s.queue_capacity,
        busy_retry_after_ms: s.busy_retry_after_ms,
        queue_updates: (s.queue_update_ms > 0).then(|| Duration::from_millis(s.queue_update_ms)),
        replay_retention: Duration::from_millis(s.replay_retention_ms),
        replay_max_bytes: s.replay_max_bytes,
        max_queued: s.max_queued,
        max_running: s.max_running,
        priority_aging,
        overload_max_output_tokens: s.overload_max_output_tokens,
        idempotency_ttl: Duration::from_secs(s.idempotency_ttl_seconds),
        preemption: s.preemption,
        max_tracked_users: s.max_tracked_users,
    }
}

/// The shortest NVML poll period; polling faster only loads the driver.
const MIN_POLL_INTERVAL_MS: u64 = 100;

fn resources(r: RawResources, p: &mut Problems) -> Option<Resources> {
    let cancel_from_priority = r.cancel_from_priority.get("resources.cancel_from_priority", p);
    if r.poll_interval_ms < MIN_POLL_INTERVAL_MS {
        p.add("resources.poll_interval_ms", format!("must be at least {MIN_POLL_INTERVAL_MS}"));
    }
    if !(0.0..=100.0).contains(&r.danger_gpu_memory_percent) {
        p.add("resources.danger_gpu_memory_percent", "must be between 0 and 100");
    }
    let hw = r.kv_cache_high_water;
    if !(hw > 0.0 && hw <= 1.0) {
        p.add("resources.kv_cache_high_water", "must be a fraction above 0 and at most 1");
    }
    Some(Resources {
        watch: ResourceConfig {
            gpu: r.gpu,
            poll_interval: Duration::from_millis(r.poll_interval_ms),
            danger_gpu_temperature_c: r.danger_gpu_temperature_c,
            danger_gpu_memory_percent: r.danger_gpu_memory_percent,
            cancel_from_priority: cancel_from_priority?.0,
        },
        cancel_grace: Duration::from_millis(r.cancel_grace_period_ms),
        kv_cache_high_water: hw,
    })
}

type TenantSettings =
    (HashMap<String, f64>, HashMap<String, crate::task::DataClass>, BTreeMap<String, super::BudgetConfig>);

fn tenants(raw: BTreeMap<String, RawTenant>, p: &mut Problems) -> TenantSettings {
    let mut weights = HashMap::new();
    let mut classes = HashMap::new();
    let mut budgets = BTreeMap::new();
    for (name, t) in raw {
        if !(t.weight > 0.0 && t.weight.is_finite()) {
            p.add(format!("tenants.{name}.weight"), "must be a positive number");
        }
        if let Some(Some(c)) = optional(t.data_class, &format!("tenants.{name}.data_class"), p) {
            classes.insert(name.clone(), c);
        }
        if let Some(b) = t.budget.map(|b| budget(&format!("tenants.{name}.budget"), b, p)) {
            budgets.insert(name.clone(), b);
        }
        weights.insert(name, t.weight);
    }
    (weights, classes, budgets)
}

/// A `budget` table: costs finite and not negative, `warn_percent`
/// 1..=100 (default [`super::DEFAULT_BUDGET_WARN_PERCENT`]).
fn budget(path: &str, b: super::raw::RawBudget, p: &mut Problems) -> super::BudgetConfig {
    for (key, v) in [("daily_cost", b.daily_cost), ("monthly_cost", b.monthly_cost)] {
        if v.is_some_and(|v| !(v.is_finite() && v >= 0.0)) {
            p.add(format!("{path}.{key}"), "must be a number, 0 or more");
        }
    }
    let warn_percent = b.warn_percent.unwrap_or(super::DEFAULT_BUDGET_WARN_PERCENT);
    if !(1..=100).contains(&warn_percent) {
        p.add(format!("{path}.warn_percent"), "must be 1..100");
    }
    super::BudgetConfig {
        daily_tokens: b.daily_tokens,
        monthly_tokens: b.monthly_tokens,
        daily_cost: b.daily_cost,
        monthly_cost: b.monthly_cost,
        warn_percent,
    }
}

fn routing(r: RawRouting, p: &mut Problems) -> Option<RoutingConfig> {
    let default_data_class = r.default_data_class.get("routing.default_data_class", p);
    if r.max_attempts == 0 {
        p.add("routing.max_attempts", "must be at least 1 (the first attempt)");
    }
    if !(0.0..=100.0).contains(&r.retry_budget_percent) {
        p.add("routing.retry_budget_percent", "must be a percentage between 0 and 100");
    }
    if r.retry_budget_window_s == 0 {
        p.add("routing.retry_budget_window_s", "must be at least 1");
    }
    let b = r.breaker;
    if b.consecutive_failures == 0 {
        p.add("routing.breaker.consecutive_failures", "must be at least 1");
    }
    if !(b.error_rate_percent > 0.0 && b.error_rate_percent <= 100.0) {
        p.add("routing.breaker.error_rate_percent", "must be a percentage above 0, at most 100");
    }
    if b.window_s == 0 {
        p.add("routing.breaker.window_s", "must be at least 1");
    }
    if b.ttft_p95_ms == Some(0) {
        p.add("routing.breaker.ttft_p95_ms", "must be greater than 0 (leave it out to turn the check off)");
    }
    let d = r.degradation;
    let l1 = d.level_1_admit.get("routing.degradation.level_1_admit", p).map(|n| n.0);
    let l2 = d.level_2_admit.get("routing.degradation.level_2_admit", p).map(|n| n.0);
    if let (Some(l1), Some(l2)) = (l1, l2) {
        if l2 > l1 {
            p.add("routing.degradation", "a higher level must not admit less urgent work than a lower one");
        }
    }
    Some(RoutingConfig {
        allow_cloud: r.allow_cloud,
        default_data_class: default_data_class?,
        max_attempts: r.max_attempts,
        retry_backoff: Duration::from_millis(r.retry_backoff_ms),
        retry_budget: RetryBudgetConfig {
            ratio: r.retry_budget_percent / 100.0,
            window: Duration::from_secs(r.retry_budget_window_s),
            min_per_window: r.retry_budget_min,
        },
        breaker: BreakerConfig {
            consecutive_failures: b.consecutive_failures,
            error_rate: b.error_rate_percent / 100.0,
            min_requests: b.min_requests,
            window: Duration::from_secs(b.window_s),
            ttft_p95: b.ttft_p95_ms.map(Duration::from_millis),
            cooldown: Duration::from_millis(b.cooldown_ms),
        },
        admit_at_level: [l1?, l2?],
    })
}

fn auth(raw: RawAuth, env: &[(String, String)], base_dir: &Path, p: &mut Problems) -> Option<AuthConfig> {
    let jwt = match raw.jwt {
        None => None,
        Some(j) => Some(jwt(j, env, base_dir, p)?),
    };
    Some(AuthConfig { jwt })
}

fn jwt(j: RawJwt, env: &[(String, String)], base_dir: &Path, p: &mut Problems) -> Option<JwtConfig> {
    let start = p.0.len();
    let hs256_secret = j.hs256_secret_env.as_deref().and_then(|var| match env_var(env, var) {
        // 256 bits: HS256 is as strong as its secret (RFC 7518 §3.2).
        Some(v) if v.len() >= 32 => Some(v.as_bytes().to_vec()),
        Some(_) => {
            p.add("auth.jwt.hs256_secret_env", format!("${var} must hold at least 32 bytes"));
            None
        }
        None => {
            p.add("auth.jwt.hs256_secret_env", format!("environment variable {var} is not set"));
            None
        }
    });
    let rs256_public_key_pem = j.rs256_public_key_file.as_deref().and_then(|f| {
        let path = resolve(base_dir, f);
        match std::fs::read(&path) {
            Ok(pem) if jsonwebtoken::DecodingKey::from_rsa_pem(&pem).is_ok() => Some(pem),
            Ok(_) => {
                p.add("auth.jwt.rs256_public_key_file", format!("{} is not an RSA public key in PEM", path.display()));
                None
            }
            Err(e) => {
                p.add("auth.jwt.rs256_public_key_file", format!("cannot read {}: {e}", path.display()));
                None
            }
        }
    });
    if j.hs256_secret_env.is_none() && j.rs256_public_key_file.is_none() {
        p.add("auth.jwt", "needs hs256_secret_env or rs256_public_key_file");
    }
    // A key named but unusable is a problem, never a JWT config without it.
    (p.0.len() == start).then_some(JwtConfig {
        hs256_secret,
        rs256_public_key_pem,
        issuer: j.issuer,
        audience: j.audience,
        tenant_claim: j.tenant_claim,
        application_claim: j.application_claim,
        leeway_s: j.leeway_s,
    })
}

fn applications(
    raw: BTreeMap<String, RawApplication>,
    models: &BTreeSet<String>,
    p: &mut Problems,
) -> Entries<ApplicationConfig> {
    // An API key names one application; which one it is must not depend on
    // the order of the file.
    let mut key_owner: BTreeMap<[u8; 32], String> = BTreeMap::new();
    let mut out = BTreeMap::new();
    for (name, a) in raw {
        let app = application(&name, a, models, &mut key_owner, p);
        out.insert(name, app);
    }
    out
}

fn application(
    name: &str,
    a: RawApplication,
    models: &BTreeSet<String>,
    key_owner: &mut BTreeMap<[u8; 32], String>,
    p: &mut Problems,
) -> Option<ApplicationConfig> {
    let path = format!("applications.{name}");
    let tenant = a.tenant.get(&format!("{path}.tenant"), p);
    if tenant.as_ref().is_some_and(|t| t.trim().is_empty()) {
        p.add(format!("{path}.tenant"), "must not be empty");
    }
    let mut keys = Vec::new();
    for (i, k) in a.api_key_sha256.iter().enumerate() {
        let Some(digest) = sha256_hex(k) else {
            p.add(
                format!("{path}.api_key_sha256[{i}]"),
                "must be a SHA-256 digest in hex (64 characters); `edgeway hash-key KEY` prints one",
            );
            continue;
        };
        if let Some(other) = key_owner.insert(digest, name.to_string()) {
            p.add(format!("{path}.api_key_sha256[{i}]"), format!("the same key is also used by application {other}"));
        }
        keys.push(digest);
    }
    let mut key_expires_ms = BTreeMap::new();
    for (i, k) in a.api_keys.iter().enumerate() {
        if let Some((digest, expires)) = expiring_key(&format!("{path}.api_keys[{i}]"), k, p) {
            if let Some(other) = key_owner.insert(digest, name.to_string()) {
                p.add(format!("{path}.api_keys[{i}]"), format!("the same key is also used by application {other}"));
            }
            keys.push(digest);
            key_expires_ms.insert(digest, expires);
        }
    }
    let max_priority = a.max_priority.get(&format!("{path}.max_priority"), p).map(|n| n.0);
    let default_priority = a.default_priority.get(&format!("{path}.default_priority"), p).map(|n| n.0);
    if let (Some(max), Some(default)) = (max_priority, default_priority) {
        if default < max {
            p.add(
                format!("{path}.default_priority"),
                format!("{} is more urgent than max_priority {}", default.as_str(), max.as_str()),
            );
        }
    }
    let allowed_priorities = a.allowed_priorities.map(|list| {
        let mut out = Vec::new();
        for (i, s) in list.iter().enumerate() {
            match (crate::task::Priority::parse(s), max_priority) {
                (Some(pr), Some(max)) if pr < max => p.add(
                    format!("{path}.allowed_priorities[{i}]"),
                    format!("{} is more urgent than max_priority {}", pr.as_str(), max.as_str()),
                ),
                (Some(pr), _) => out.push(pr),
                (None, _) => p.add(format!("{path}.allowed_priorities[{i}]"), format!("must be P0..P4, not {s:?}")),
            }
        }
        if list.is_empty() {
            p.add(format!("{path}.allowed_priorities"), "must name at least one priority (or be left out)");
        } else if let Some(d) = default_priority.filter(|d| out.len() == list.len() && !out.contains(d)) {
            p.add(format!("{path}.default_priority"), format!("{} is not in allowed_priorities", d.as_str()));
        }
        out
    });
    for (i, m) in a.allowed_models.iter().flatten().enumerate() {
        if !models.contains(m) {
            p.add(format!("{path}.allowed_models[{i}]"), format!("no model named {m:?} in [models]"));
        }
    }
    let allowed_ingresses = a.allowed_ingresses.map(|list| {
        use crate::task::Ingress;
        let mut out = Vec::new();
        for (i, s) in list.iter().enumerate() {
            match [Ingress::Http, Ingress::Ws, Ingress::Mqtt, Ingress::Nats].into_iter().find(|g| g.as_str() == s) {
                Some(g) => out.push(g),
                None => p.add(
                    format!("{path}.allowed_ingresses[{i}]"),
                    format!("must be \"http\", \"ws\", \"mqtt\" or \"nats\", not {s:?}"),
                ),
            }
        }
        out
    });
    let user_header = a.user_header.map(|h| h.trim().to_ascii_lowercase());
    if let Some(h) = &user_header {
        // A header that carries the credential or the body's framing is
        // the caller's, not the proxy's.
        let reserved = ["authorization", "x-api-key", "cookie", "host", "content-type", "content-length"];
        if h.is_empty() || h.len() > 64 || !h.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-') {
            p.add(format!("{path}.user_header"), "must be a header name: 1..64 characters of a-z 0-9 -");
        } else if reserved.contains(&h.as_str()) {
            p.add(format!("{path}.user_header"), format!("{h:?} is not a header a proxy sets for the user"));
        }
    }
    if !(a.weight > 0.0 && a.weight.is_finite()) {
        p.add(format!("{path}.weight"), "must be a positive number");
    }
    let data_class = optional(a.data_class, &format!("{path}.data_class"), p);
    let preemptible = a.preemptible.get(&format!("{path}.preemptible"), p);
    for (key, names) in
        [("allowed_tools", a.allowed_tools.as_deref().unwrap_or_default()), ("high_risk_tools", &a.high_risk_tools[..])]
    {
        for (i, n) in names.iter().enumerate() {
            if !crate::task::tools::valid_tool_name(n) {
                p.add(format!("{path}.{key}[{i}]"), "must be a tool name: 1..64 characters of a-z A-Z 0-9 _ -");
            }
        }
    }
    for (i, pat) in a.redact.iter().enumerate() {
        if let Err(e) = regex::Regex::new(pat) {
            p.add(format!("{path}.redact[{i}]"), format!("not a regular expression: {e}"));
        }
    }
    Some(ApplicationConfig {
        name: name.to_string(),
        tenant: tenant?,
        api_key_sha256: keys,
        max_priority: max_priority?,
        default_priority: default_priority?,
        admin: a.admin,
        limits: AppLimits {
            weight: a.weight,
            max_running: a.max_running,
            max_queued: a.max_queued,
            user_max_running: a.user_max_running,
            user_max_queued: a.user_max_queued,
            user_requests_per_minute: a.user_requests_per_minute,
            user_tokens_per_minute: a.user_tokens_per_minute,
            preemptible_from: preemptible?.0,
        },
        data_class: data_class?,
        allow_smaller_model: a.allow_smaller_model,
        allowed_tools: a.allowed_tools,
        high_risk_tools: a.high_risk_tools,
        redact: a.redact,
        system_prompt: a.system_prompt.filter(|t| !t.trim().is_empty()),
        output_constraints: a.output_constraints.filter(|t| !t.trim().is_empty()),
        debug_prompts: a.debug_prompts.and_then(|d| debug_prompts(&format!("{path}.debug_prompts"), &d, p)),
        context_policy: match a.context_policy.as_deref().map(|c| (c, super::ContextPolicy::parse(c))) {
            None => super::ContextPolicy::Auto,
            Some((_, Some(c))) => c,
            Some((c, None)) => {
                p.add(format!("{path}.context_policy"), format!("must be \"auto\" or \"disabled\", not {c:?}"));
                return None;
            }
        },
        budget: a.budget.map(|b| budget(&format!("{path}.budget"), b, p)),
        cache: a.cache,
        allowed_models: a.allowed_models,
        allowed_priorities,
        allowed_ingresses,
        user_header,
        key_expires_ms,
    })
}

/// One of `applications.*.api_keys`: `{ sha256 = "<hex>", expires =
/// <TOML date-time with offset> }`; the digest and the expiry (Unix ms).
fn expiring_key(path: &str, v: &toml::Value, p: &mut Problems) -> Option<([u8; 32], i64)> {
    let Some(t) = v.as_table() else {
        p.add(path, "must be a table { sha256 = \"<hex>\", expires = 2027-01-01T00:00:00Z }");
        return None;
    };
    for k in t.keys().filter(|k| !matches!(k.as_str(), "sha256" | "expires")) {
        p.add(format!("{path}.{k}"), "unknown key (expected 'sha256' or 'expires')");
    }
    let digest = t.get("sha256").and_then(toml::Value::as_str).and_then(sha256_hex);
    if digest.is_none() {
        p.add(
            format!("{path}.sha256"),
            "must be a SHA-256 digest in hex (64 characters); `edgeway hash-key KEY` prints one",
        );
    }
    // As `debug_prompts.until`: a date-time, or its text (serde may hand
    // it on in its private wrapper).
    let expires = t.get("expires").and_then(|u| match u {
        toml::Value::Datetime(d) => Some(*d),
        toml::Value::String(s) => s.parse().ok(),
        toml::Value::Table(t) if t.len() == 1 => t.values().next().and_then(|v| v.as_str()?.parse().ok()),
        _ => None,
    });
    let expires = expires.as_ref().and_then(datetime_ms);
    if expires.is_none() {
        p.add(format!("{path}.expires"), "must be a TOML date-time with an offset, e.g. 2027-01-01T00:00:00Z");
    }
    Some((digest?, expires?))
}

/// `applications.*.debug_prompts`: `until` (a TOML date-time with its
/// offset, at most [`DEBUG_PROMPTS_MAX_AHEAD_MS`] ahead; one in the past is
/// allowed and means off) and `sample_rate` (0 < r <= 1, default 0.1).
fn debug_prompts(path: &str, v: &toml::Value, p: &mut Problems) -> Option<super::DebugPrompts> {
    let Some(t) = v.as_table() else {
        p.add(path, "must be a table with 'until' and 'sample_rate'");
        return None;
    };
    for k in t.keys().filter(|k| !matches!(k.as_str(), "until" | "sample_rate")) {
        p.add(format!("{path}.{k}"), "unknown key (expected 'until' or 'sample_rate')");
    }
    let until = match t.get("until") {
        None => {
            p.add(format!("{path}.until"), "is required: the date-time after which prompts are no longer logged");
            None
        }
        Some(u) => {
            // A TOML date-time, or its text: the raw config passes through
            // serde, which may hand it on in its private wrapper.
            let dt = match u {
                toml::Value::Datetime(d) => Some(*d),
                toml::Value::String(s) => s.parse().ok(),
                toml::Value::Table(t) if t.len() == 1 => t.values().next().and_then(|v| v.as_str()?.parse().ok()),
                _ => None,
            };
            let ms = dt.as_ref().and_then(datetime_ms);
            if ms.is_none() {
                p.add(format!("{path}.until"), "must be a TOML date-time with an offset, e.g. 2026-12-02T18:00:00Z");
            }
            ms
        }
    };
    if until.is_some_and(|u| u > crate::task::now_ms() + super::DEBUG_PROMPTS_MAX_AHEAD_MS) {
        p.add(format!("{path}.until"), "must be at most 7 days ahead: prompt debug logging is short-lived");
    }
    let sample_rate = match t.get("sample_rate") {
        None => Some(0.1),
        Some(r) => {
            let r = r.as_float().or_else(|| r.as_integer().map(|i| i as f64)).filter(|r| *r > 0.0 && *r <= 1.0);
            if r.is_none() {
                p.add(format!("{path}.sample_rate"), "must be a number above 0 and at most 1");
            }
            r
        }
    };
    Some(super::DebugPrompts { until_ms: until?, sample_rate: sample_rate? })
}

/// Unix ms of a TOML offset date-time (a local one, without an offset,
/// is refused: the end of a debug window must not depend on the box's
/// time zone).
fn datetime_ms(d: &toml::value::Datetime) -> Option<i64> {
    let (date, time, offset) = (d.date?, d.time?, d.offset?);
    let offset_min = match offset {
        toml::value::Offset::Z => 0,
        toml::value::Offset::Custom { minutes } => i64::from(minutes),
    };
    // Days since 1970-01-01 of a proleptic Gregorian date (Howard
    // Hinnant's days_from_civil).
    let (y, m, dd) = (i64::from(date.year), i64::from(date.month), i64::from(date.day));
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * ((m + 9) % 12) + 2) / 5 + dd - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let secs = days * 86_400 + i64::from(time.hour) * 3600 + i64::from(time.minute) * 60 + i64::from(time.second)
        - offset_min * 60;
    Some(secs * 1000 + i64::from(time.nanosecond / 1_000_000))
}

fn engines(
    raw: BTreeMap<String, RawEngine>,
    env: &[(String, String)],
    allow_cloud: bool,
    base_dir: &Path,
    p: &mut Problems,
) -> Entries<EngineConfig> {
    raw.into_iter()
        .map(|(name, e)| {
            let engine = engine(&name, e, env, allow_cloud, base_dir, p);
            (name, engine)
        })
        .collect()
}

fn engine(
    name: &str,
    e: RawEngine,
    env: &[(String, String)],
    allow_cloud: bool,
    base_dir: &Path,
    p: &mut Problems,
) -> Option<EngineConfig> {
    let path = format!("engines.{name}");
    let process = match e.process {
        None => Some(None),
        Some(raw) => {
            let enabled = raw.enabled;
            super::process::validate(&format!("{path}.process"), raw, env, base_dir, p).map(|c| enabled.then_some(c))
        }
    };
    let kind = e.kind.get(&format!("{path}.type"), p);
    // A pool instance is the other nodes of the pool, reached over NATS.
    let pool = kind == Some(EngineKind::Pool);
    let base_url = if pool {
        if !matches!(e.base_url, Field::Missing) {
            p.add(format!("{path}.base_url"), "a pool instance has none: it reaches the other nodes over NATS");
        }
        if matches!(process, Some(Some(_))) || e.model_api.is_some() {
            p.add(path.clone(), "a pool instance has no process or model_api: the other nodes run their engines");
        }
        Some(String::new())
    } else {
        e.base_url.get(&format!("{path}.base_url"), p)
    };
    if let Some(url) = base_url.as_ref().filter(|_| !pool) {
        match reqwest::Url::parse(url) {
            Ok(u) if u.scheme() == "http" || u.scheme() == "https" => {}
            _ => p.add(format!("{path}.base_url"), format!("{url:?} is not an http(s) URL")),
        }
    }
    let model = e.model.get(&format!("{path}.model"), p);
    if model.as_ref().is_some_and(|m| m.trim().is_empty()) {
        p.add(format!("{path}.model"), "must not be empty");
    }
    if e.max_concurrency == 0 {
        p.add(format!("{path}.max_concurrency"), "must be at least 1");
    } else if e.reserved_realtime_slots >= e.max_concurrency {
        p.add(format!("{path}.reserved_realtime_slots"), "must be less than max_concurrency");
    }
    if e.slot_affinity && !matches!(kind, Some(EngineKind::OpenAi)) {
        p.add(format!("{path}.slot_affinity"), "applies to llama-server (type = \"openai\") only");
    }
    if e.tokenize && !matches!(kind, Some(EngineKind::OpenAi)) {
        p.add(format!("{path}.tokenize"), "applies to llama-server (type = \"openai\") only");
    }
    // Slots are numbered 0..max_concurrency: a llama-server edgeway runs
    // must have that many (`--parallel`), or an `id_slot` it does not have
    // fails the task (review 14 L1). An engine run by something else
    // cannot be checked here; the README says to keep them equal.
    if let (true, Some(Some(c))) = (e.slot_affinity, &process) {
        let parallel = c
            .args
            .iter()
            .position(|a| a == "--parallel" || a == "-np")
            .and_then(|i| c.args.get(i + 1))
            .and_then(|v| v.parse::<usize>().ok());
        if parallel != Some(e.max_concurrency) {
            p.add(
                format!("{path}.slot_affinity"),
                format!(
                    "needs the process's `--parallel` equal to max_concurrency ({}); it is {}",
                    e.max_concurrency,
                    parallel.map_or("not given".to_string(), |n| n.to_string())
                ),
            );
        }
    }
    // Default: a quarter of the cap, so that up to four long prompts share it.
    let long_prompt_tokens = e.long_prompt_tokens.unwrap_or(e.max_prefill_tokens.unwrap_or(0) / 4);
    match (e.max_prefill_tokens, e.long_prompt_tokens) {
        (Some(0), _) => p.add(format!("{path}.max_prefill_tokens"), "must be at least 1"),
        (None, Some(_)) => p.add(format!("{path}.long_prompt_tokens"), "needs max_prefill_tokens"),
        (Some(cap), Some(long)) if long == 0 || long > cap => {
            p.add(format!("{path}.long_prompt_tokens"), "must be from 1 to max_prefill_tokens")
        }
        _ => {}
    }
    if e.health_interval_ms < 50 {
        p.add(format!("{path}.health_interval_ms"), "must be at least 50");
    }
    let api_key = match e.api_key_env.as_deref() {
        None => Some(None),
        Some(var) => match env_var(env, var) {
            Some(v) => Some(Some(v.to_string())),
            None => {
                p.add(format!("{path}.api_key_env"), format!("environment variable {var} is not set"));
                None
            }
        },
    };
    if e.keep_alive.is_some() && kind.is_some_and(|k| k != EngineKind::Ollama) {
        p.add(format!("{path}.keep_alive"), "only applies to type = \"ollama\"");
    }
    let health_path = match (e.health_path, kind) {
        (Some(h), _) => Some(h),
        (None, Some(EngineKind::OpenAi)) => Some("/v1/models".to_string()),
        (None, Some(EngineKind::Ollama)) => Some("/api/tags".to_string()),
        (None, Some(EngineKind::Pool)) => Some(String::new()),
        (None, None) => None,
    };
    if health_path.as_ref().is_some_and(|h| !h.starts_with('/') && !pool) {
        p.add(format!("{path}.health_path"), "must start with '/'");
    }
    let location = match (optional(e.location, &format!("{path}.location"), p), e.local) {
        (Some(Some(_)), Some(_)) => {
            p.add(format!("{path}.local"), "give location or the older local, not both");
            None
        }
        (Some(Some(l)), None) => Some(l),
        (Some(None), Some(false)) => Some(Location::Cloud),
        (Some(None), _) if pool => Some(Location::EdgeNode),
        (Some(None), _) => Some(Location::Local),
        (None, _) => None,
    };
    if pool && location.is_some_and(|l| l != Location::EdgeNode) {
        p.add(format!("{path}.location"), "a pool instance is at location \"edge-node\"");
    }
    let max_data_class = optional(e.max_data_class, &format!("{path}.max_data_class"), p);
    let max_data_class = match (location, max_data_class) {
        (Some(l), Some(c)) => {
            let c = c.unwrap_or(l.default_class());
            if c > l.class_ceiling() {
                p.add(
                    format!("{path}.max_data_class"),
                    format!(
                        "an instance at location {:?} may receive at most {:?} data",
                        l.as_str(),
                        l.class_ceiling().as_str()
                    ),
                );
            }
            Some(c)
        }
        _ => None,
    };
    if location == Some(Location::Cloud) && !allow_cloud {
        p.add(
            format!("{path}.location"),
            "a cloud instance needs routing.allow_cloud = true (data leaves the machine)",
        );
    }
    if !(e.cost_per_1k_tokens.is_finite() && e.cost_per_1k_tokens >= 0.0) {
        p.add(format!("{path}.cost_per_1k_tokens"), "must be a number, 0 or more");
    }
    for (key, v) in
        [("price_input_per_mtok", e.price_input_per_mtok), ("price_output_per_mtok", e.price_output_per_mtok)]
    {
        if !(v.is_finite() && v >= 0.0) {
            p.add(format!("{path}.{key}"), "must be a number, 0 or more");
        }
    }
    let model_api = super::residency::model_api(
        &format!("{path}.model_api"),
        e.model_api.as_deref(),
        kind.map(|k| k == EngineKind::OpenAi),
        p,
    );
    let memory_budget_bytes = match e.memory_budget_mb {
        None => Some(None),
        Some(mb) => mebibytes(&format!("{path}.memory_budget_mb"), mb, p).map(Some),
    };
    Some(EngineConfig {
        name: name.to_string(),
        kind: kind?,
        base_url: base_url?.trim_end_matches('/').to_string(),
        model: model?,
        max_concurrency: e.max_concurrency,
        api_key: api_key?,
        health_path: health_path?,
        health_interval: Duration::from_millis(e.health_interval_ms),
        connect_timeout: Duration::from_millis(e.connect_timeout_ms),
        stream: e.stream,
        keep_alive: e.keep_alive,
        location: location?,
        max_data_class: max_data_class?,
        cost_per_1k_tokens: e.cost_per_1k_tokens,
        price: super::Price { input_per_mtok: e.price_input_per_mtok, output_per_mtok: e.price_output_per_mtok },
        reserved_realtime_slots: e.reserved_realtime_slots,
        max_prefill_tokens: e.max_prefill_tokens,
        long_prompt_tokens,
        slot_affinity: e.slot_affinity,
        tokenize: e.tokenize,
        exclusive: e.exclusive,
        memory_budget_bytes: memory_budget_bytes?,
        tools: e.tools,
        process: process?,
        model_api: model_api?,
    })
}

fn models(
    raw: BTreeMap<String, RawModel>,
    engine_names: &BTreeSet<String>,
    model_names: &BTreeSet<String>,
    default_queue_capacity: usize,
    p: &mut Problems,
) -> Entries<ModelConfig> {
    if raw.is_empty() {
        p.add("models", "define at least one logical model");
    }
    // Kinds as written (a wrong one is reported where the model is read),
    // for the fallback check: a fallback serves what its model serves.
    let kinds: BTreeMap<String, ModelKind> = raw
        .iter()
        .map(|(n, m)| {
            (
                n.clone(),
                match &m.kind {
                    Some(Field::Valid(k)) => *k,
                    _ => ModelKind::Chat,
                },
            )
        })
        .collect();
    // The larger-window alternative (issue 12): another chat model, with a
    // larger window, so a chain of them ends.
    for (name, m) in &raw {
        let Some(alt) = &m.larger_window_model else { continue };
        let path = format!("models.{name}.larger_window_model");
        match raw.get(alt) {
            None => p.add(path, format!("no model named {alt:?} in [models]")),
            Some(_) if alt == name => p.add(path, "a model cannot be its own larger-window model"),
            Some(a) if a.context_tokens <= m.context_tokens => p.add(
                path,
                format!(
                    "{alt:?} has a window of {} tokens, not larger than this model's {}",
                    a.context_tokens, m.context_tokens
                ),
            ),
            Some(_) if kinds.get(name) != Some(&ModelKind::Chat) || kinds.get(alt) != Some(&ModelKind::Chat) => {
                p.add(path, "applies to chat models only")
            }
            Some(_) => {}
        }
    }
    raw.into_iter()
        .map(|(name, m)| {
            let model = model(&name, m, engine_names, model_names, &kinds, default_queue_capacity, p);
            (name, model)
        })
        .collect()
}

fn model(
    name: &str,
    m: RawModel,
    engine_names: &BTreeSet<String>,
    model_names: &BTreeSet<String>,
    kinds: &BTreeMap<String, ModelKind>,
    default_queue_capacity: usize,
    p: &mut Problems,
) -> Option<ModelConfig> {
    let path = format!("models.{name}");
    let kind = optional(m.kind, &format!("{path}.kind"), p).map(Option::unwrap_or_default);
    let instances = m.instances.get(&format!("{path}.instances"), p);
    if let Some(instances) = &instances {
        if instances.is_empty() {
            p.add(format!("{path}.instances"), "must name at least one engine");
        }
        for (i, inst) in instances.iter().enumerate() {
            if !engine_names.contains(inst) {
                p.add(format!("{path}.instances[{i}]"), format!("no engine named {inst:?} in [engines]"));
            }
        }
    }
    if m.context_tokens < 16 {
        p.add(format!("{path}.context_tokens"), "must be at least 16");
    }
    // An embedding model generates nothing: its output budget is not read.
    let embedding = kind == Some(ModelKind::Embedding);
    if !embedding && (m.max_output_tokens == 0 || m.max_output_tokens >= m.context_tokens) {
        p.add(format!("{path}.max_output_tokens"), "must be between 1 and context_tokens - 1");
    }
    if m.queue_capacity == Some(0) {
        p.add(format!("{path}.queue_capacity"), "must be at least 1");
    }
    if !(5..=10).contains(&m.context_margin_percent) {
        p.add(format!("{path}.context_margin_percent"), "must be 5..10 (percent of the window)");
    }
    for (key, v) in [
        ("knowledge_budget_percent", m.knowledge_budget_percent),
        ("tool_results_budget_percent", m.tool_results_budget_percent),
    ] {
        if v > 100 {
            p.add(format!("{path}.{key}"), "must be 0..100 (percent of the prompt budget)");
        }
    }
    if !(m.memory_margin_percent.is_finite() && m.memory_margin_percent >= 0.0) {
        p.add(format!("{path}.memory_margin_percent"), "must be a number of percent, 0 or more");
    }
    let kv_bytes_per_token = match (m.kv_bytes_per_token, m.architecture) {
        (Some(_), Some(_)) => {
            p.add(format!("{path}.architecture"), "give kv_bytes_per_token or architecture, not both");
            None
        }
        (Some(n), None) => Some(n),
        (None, Some(a)) => kv_bytes_per_token(&format!("{path}.architecture"), a, p),
        // No memory admission for this model.
        (None, None) => Some(0),
    };
    let weights_bytes = mebibytes(&format!("{path}.weights_mb"), m.weights_mb, p);
    for (i, f) in m.fallback_models.iter().enumerate() {
        if f == name {
            p.add(format!("{path}.fallback_models[{i}]"), "a model cannot be its own fallback");
        } else if !model_names.contains(f) {
            p.add(format!("{path}.fallback_models[{i}]"), format!("no model named {f:?} in [models]"));
        }
    }
    if m.dimensions.is_some_and(|d| !(1..=65536).contains(&d)) {
        p.add(format!("{path}.dimensions"), "must be from 1 to 65536");
    }
    let max_batch = m.max_batch_inputs.unwrap_or(super::DEFAULT_MAX_BATCH_INPUTS);
    // 2048: the most inputs a request may have (admission).
    if !(1..=2048).contains(&max_batch) {
        p.add(format!("{path}.max_batch_inputs"), "must be from 1 to 2048");
    }
    if m.canned_answer.as_ref().is_some_and(|a| a.trim().is_empty()) {
        p.add(format!("{path}.canned_answer"), "must not be empty (leave it out for none)");
    }
    if let Some(kind) = kind {
        for (i, f) in m.fallback_models.iter().enumerate() {
            if kinds.get(f).is_some_and(|k| *k != kind) {
                p.add(format!("{path}.fallback_models[{i}]"), format!("{f:?} is not a {} model", kind.as_str()));
            }
        }
        if kind == ModelKind::Embedding && m.canned_answer.is_some() {
            p.add(format!("{path}.canned_answer"), "an embedding model has no canned answer");
        }
        if kind == ModelKind::Chat && m.supports_dimensions {
            p.add(format!("{path}.supports_dimensions"), "only for kind = \"embedding\"");
        }
        if kind == ModelKind::Chat && m.dimensions.is_some() {
            p.add(format!("{path}.dimensions"), "only for kind = \"embedding\"");
        }
        if kind == ModelKind::Chat && m.max_batch_inputs.is_some() {
            p.add(format!("{path}.max_batch_inputs"), "only for kind = \"embedding\"");
        }
    }
    let residency = super::residency::residency(&path, m.residency.as_deref(), m.idle_unload_s, m.restricted_to, p);
    Some(ModelConfig {
        name: name.to_string(),
        instances: instances?,
        context_tokens: m.context_tokens,
        // One token of budget: what admission charges an embedding task.
        max_output_tokens: if embedding { 1 } else { m.max_output_tokens },
        queue_capacity: m.queue_capacity.unwrap_or(default_queue_capacity),
        description: m.description,
        max_running: m.max_running,
        kv_bytes_per_token: kv_bytes_per_token?,
        weights_bytes: weights_bytes?,
        memory_margin: m.memory_margin_percent / 100.0,
        context_budget: super::ContextBudget {
            margin: f64::from(m.context_margin_percent) / 100.0,
            knowledge_share: f64::from(m.knowledge_budget_percent) / 100.0,
            tool_results_share: f64::from(m.tool_results_budget_percent) / 100.0,
        },
        fallback_models: m.fallback_models,
        larger_window_model: m.larger_window_model,
        canned_answer: m.canned_answer,
        kind: kind?,
        supports_dimensions: m.supports_dimensions,
        dimensions: m.dimensions,
        max_batch_inputs: if embedding { max_batch as usize } else { 0 },
        residency: residency?,
    })
}

fn kv_bytes_per_token(path: &str, a: RawArchitecture, p: &mut Problems) -> Option<u64> {
    let layers = a.layers.get(&format!("{path}.layers"), p);
    let kv_heads = a.kv_heads.get(&format!("{path}.kv_heads"), p);
    let head_dim = a.head_dim.get(&format!("{path}.head_dim"), p);
    let (layers, kv_heads, head_dim) = (layers?, kv_heads?, head_dim?);
    let valid = layers > 0 && kv_heads > 0 && head_dim > 0 && a.bytes_per_value.is_finite() && a.bytes_per_value > 0.0;
    if !valid {
        p.add(path, "layers, kv_heads, head_dim and bytes_per_value must be positive");
        return None;
    }
    let Some(values) = layers.checked_mul(kv_heads).and_then(|n| n.checked_mul(head_dim)) else {
        p.add(path, "layers × kv_heads × head_dim is too large");
        return None;
    };
    // K and V per layer.
    Some((2.0 * values as f64 * a.bytes_per_value).ceil() as u64)
}

/// `mb` MiB in bytes; a size that does not fit is reported, not wrapped.
fn mebibytes(path: &str, mb: u64, p: &mut Problems) -> Option<u64> {
    let bytes = mb.checked_mul(1024 * 1024);
    if bytes.is_none() {
        p.add(path, "is too large");
    }
    bytes
}
