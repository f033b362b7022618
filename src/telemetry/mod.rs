//! Metrics (Prometheus) and structured logs.
//!
//! Owns: the metric registry and its families, and the log subscriber.
//! Every label comes from a closed set (ingress, priority, error code,
//! state, configured model and engine names), never from user input.
//! Does not own: what lower layers count themselves (the store's failed
//! writes): those are read at scrape time, so they need not know metrics.

pub mod gpu;
pub mod host;
pub mod lifecycle;
pub mod otlp;
pub mod trace;

use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{
    Encoder, GaugeVec, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
    TextEncoder,
};

use crate::config::{LogConfig, LogFormat};
use crate::store::{StoreHealth, WriteFailures};

/// Latency buckets in seconds, from 0.5 ms (gateway overhead) to 10 min.
const LATENCY_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
    600.0,
];

/// Time per output token buckets in seconds: 1 ms (a fast GPU) to 2.5 s (a
/// CPU swapping).
const TOKEN_BUCKETS: &[f64] = &[0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5];

pub struct Metrics {
    pub registry: Registry,
    /// Calls by ingress and outcome (`ok` or an error code).
    pub requests: IntCounterVec,
    /// Tasks that reached a terminal state, by model and state.
    pub tasks_finished: IntCounterVec,
    /// Tokens by model and direction (`input`/`output`).
    pub tokens: IntCounterVec,
    /// Tool calls models made, by model, `valid` (declared tool, arguments
    /// match its schema) and `high_risk` (needs confirmation).
    pub tool_calls: IntCounterVec,
    pub queue_wait: HistogramVec,
    pub first_token: HistogramVec,
    pub task_duration: HistogramVec,
    /// Tasks waiting, by model and priority.
    pub queue_depth: IntGaugeVec,
    /// Tasks holding an engine slot, by engine instance.
    pub running: IntGaugeVec,
    pub engine_up: IntGaugeVec,
    /// 1 while an exclusive engine instance is out of dispatch because it
    /// kept generating for a cancelled task past `cancel_grace`.
    pub engine_unreleased: IntGaugeVec,
    /// The queue bound of each model (`queue_capacity`), so that queue use
    /// is `queue_depth / queue_capacity` in a rule.
    pub queue_capacity: IntGaugeVec,
    /// KV-cache usage (0..=1) that an engine instance reports itself, by
    /// instance; absent while it reports none.
    pub engine_kv_cache_usage: GaugeVec,
    /// Task state transitions refused by the recorder, by `from` (`NONE`
    /// for a task that is not live) and `to`.
    pub illegal_transitions: IntCounterVec,
    /// Time between output tokens of a task, by requested model: from its
    /// first token to its end over the tokens after the first (tasks with
    /// at least two output tokens).
    pub time_per_output_token: HistogramVec,
    /// Tasks in an engine attempt now, by requested model and application
    /// (both names from the configuration).
    pub tasks_running: IntGaugeVec,
    /// Tasks that ended cancelled, by requested model and who cancelled
    /// (`client`: the caller cancelled or went away; `gateway`: the danger
    /// watch or a drain; `shutdown`).
    pub cancellations: IntCounterVec,
    /// Steps the context assembly took to fit a prompt, by kind
    /// (`crate::context::assembly::STEP_KINDS`, or `other`).
    pub context_trims: IntCounterVec,
    /// Session summary attempts, by outcome (`made`, `empty`, `failed`,
    /// `too_large`).
    pub context_summaries: IntCounterVec,
    /// Per GPU index (from NVML, when present; absent otherwise).
    pub gpu_temperature: IntGaugeVec,
    pub gpu_memory_used: IntGaugeVec,
    pub gpu_memory_total: IntGaugeVec,
    /// GPU busy share over NVML's last sample period (0..1).
    pub gpu_utilization: GaugeVec,
    pub gpu_power: GaugeVec,
    /// 1 while the GPU slows its clocks for heat or power.
    pub gpu_throttled: IntGaugeVec,
    /// 1 while the NATS bus is connected (0 when off or down).
    pub nats_connected: IntGauge,
    /// NATS connection events (`connected`, `disconnected`, `lame_duck`,
    /// `slow_consumer`, `server_error`, `client_error`).
    pub nats_connection_events: IntCounterVec,
    /// Lifecycle events published on `{prefix}.events.…`.
    pub nats_events_published: IntCounterVec,
    /// Lifecycle events lost, by reason (`lagged`, `queue_full`,
    /// `publish_error`, `shutdown`).
    pub nats_events_dropped: IntCounterVec,
    /// Nodes in the registry's pool as this node sees it (itself included;
    /// 0 without `[cluster]`).
    pub cluster_nodes: IntGauge,
    /// Registry writes (this node's record, its bucket) that failed, by
    /// operation (`bucket`, `put`, `purge`).
    pub cluster_publish_failures: IntCounterVec,
    /// The pool's work queue (store and forward), by `outcome`: `queued`
    /// (this node put a task there), and for what this node pulled:
    /// `taken` (it runs the task), `duplicate` (another node had taken that
    /// delivery), `requeued` (no room after all: offered again), `expired`
    /// (past its deadline), `abandoned` (nobody waits for it any more),
    /// `refused` (not this pool's, or not allowed).
    pub pool_work: IntCounterVec,
    /// NATS reply streams whose caller was gone (task cancelled), by how it
    /// was noticed (`no_responders`, `bus_unavailable`).
    pub nats_callers_lost: IntCounterVec,
    /// What finished tasks cost (`edge.cost`), by tenant and application
    /// (configured names, else `other`).
    pub cost: prometheus::CounterVec,
    /// The used share of each budget window after its last charge, by
    /// tenant, application (`*` for the tenant's own budget) and window
    /// (`daily`, `monthly`).
    pub budget_used: GaugeVec,
    /// When the first of an application's API keys expires (Unix
    /// seconds), by tenant and application (configured names): set at
    /// load and reload ([`Metrics::set_key_expiries`]); absent for an
    /// application whose keys carry no expiry.
    api_key_expiry: GaugeVec,
    /// Budget warnings (a charge crossed `warn_percent`), by tenant,
    /// application (`*`) and window.
    pub budget_warnings: IntCounterVec,
    /// Steps of a fallback chain taken, by requested model, step and
    /// reason (`unavailable`, `breaker_open`, `no_room`, `no_class`,
    /// `went_down`).
    pub fallbacks: IntCounterVec,
    /// Engine attempts retried before the first token, by model and reason
    /// (`unreachable`, `engine_5xx`, `engine_429`, `truncated`,
    /// `first_token_timeout`), and retries the budget refused.
    pub retries: IntCounterVec,
    pub retries_refused: IntCounterVec,
    /// Circuit breaker state per instance (0 closed, 1 half-open, 2 open)
    /// and its changes, by instance and new state.
    pub breaker_state: IntGaugeVec,
    pub breaker_transitions: IntCounterVec,
    /// The node's degradation level (0 normal … 3 busy answers only).
    pub degradation_level: IntGauge,
    /// Running tasks preempted for P0 work, by model and priority.
    pub preemptions: IntCounterVec,
    /// Task spans not exported to the OTLP collector (queue full, send
    /// failed).
    pub otlp_spans_dropped: prometheus::IntCounter,
    /// Log lines the writer thread dropped because its queue was full
    /// (read from [`log_lines_dropped`] at each scrape).
    log_lines_dropped: prometheus::IntCounter,
    /// Where task spans go: set once at start when `log.otlp_endpoint` is
    /// configured, off otherwise.
    pub otlp: std::sync::OnceLock<otlp::SpanExporter>,
}

impl Metrics {
    pub fn new() -> Metrics {
        let registry = Registry::new_custom(Some("edgeway".into()), None).expect("valid prefix");
        let counter = |name: &str, help: &str, labels: &[&str]| {
            let c = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric");
            registry.register(Box::new(c.clone())).expect("unique metric");
            c
        };
        let gauge = |name: &str, help: &str, labels: &[&str]| {
            let g = IntGaugeVec::new(Opts::new(name, help), labels).expect("valid metric");
            registry.register(Box::new(g.clone())).expect("unique metric");
            g
        };
        let hist = |name: &str, help: &str, labels: &[&str]| {
            let h = HistogramVec::new(HistogramOpts::new(name, help).buckets(LATENCY_BUCKETS.to_vec()), labels)
                .expect("valid metric");
            registry.register(Box::new(h.clone())).expect("unique metric");
            h
        };
        let fallbacks = counter(
            "fallbacks_total",
            "Fallback steps taken, by requested model, step and reason",
            &["model", "step", "reason"],
        );
        let retries = counter(
            "retries_total",
            "Engine attempts retried before the first token, by model and reason",
            &["model", "reason"],
        );
        let retries_refused =
            counter("retries_refused_total", "Retries refused by the global retry budget, by model", &["model"]);
        let breaker_state =
            gauge("breaker_state", "Circuit breaker state per instance: 0 closed, 1 half-open, 2 open", &["instance"]);
        let breaker_transitions = counter(
            "breaker_transitions_total",
            "Circuit breaker state changes, by instance and new state",
            &["instance", "state"],
        );
        let preemptions = counter(
            "preemptions_total",
            "Running tasks preempted for P0 work, by model and priority",
            &["model", "priority"],
        );
        let float_gauge = |name: &str, help: &str, labels: &[&str]| {
            let g = GaugeVec::new(Opts::new(name, help), labels).expect("valid metric");
            registry.register(Box::new(g.clone())).expect("unique metric");
            g
        };
        let time_per_output_token = {
            let h = HistogramVec::new(
                HistogramOpts::new(
                    "time_per_output_token_seconds",
                    "Time per output token after the first, by requested model",
                )
                .buckets(TOKEN_BUCKETS.to_vec()),
                &["model"],
            )
            .expect("valid metric");
            registry.register(Box::new(h.clone())).expect("unique metric");
            h
        };
        let tasks_running = gauge(
            "tasks_running",
            "Tasks in an engine attempt, by requested model and application",
            &["model", "application"],
        );
        let cancellations =
            counter("cancellations_total", "Tasks ended cancelled, by requested model and by whom", &["model", "by"]);
        let gpu_memory_total = gauge("gpu_memory_total_bytes", "GPU memory (NVML)", &["gpu"]);
        let gpu_utilization =
            float_gauge("gpu_utilization_ratio", "GPU busy share over NVML's sample period (0..1)", &["gpu"]);
        let gpu_power = float_gauge("gpu_power_watts", "GPU power draw (NVML)", &["gpu"]);
        let gpu_throttled =
            gauge("gpu_throttled", "1 while the GPU slows its clocks for heat or power (NVML)", &["gpu"]);
        let engine_unreleased = gauge(
            "engine_unreleased",
            "1 while the engine instance is out of dispatch: it kept generating for a cancelled task past cancel_grace",
            &["engine"],
        );
        let queue_capacity = gauge("queue_capacity", "Tasks a model's queue holds at most", &["model"]);
        let degradation_level = IntGauge::new(
            "degradation_level",
            "Degradation level of the node: 0 normal, 1 alternates, 2 smaller or canned answers only, 3 busy",
        )
        .expect("valid metric");
        registry.register(Box::new(degradation_level.clone())).expect("unique metric");
        Metrics {
            engine_unreleased,
            queue_capacity,
            time_per_output_token,
            tasks_running,
            cancellations,
            gpu_memory_total,
            gpu_utilization,
            gpu_power,
            gpu_throttled,
            fallbacks,
            retries,
            retries_refused,
            breaker_state,
            breaker_transitions,
            degradation_level,
            preemptions,
            requests: counter("requests_total", "Calls received, by ingress and outcome", &["ingress", "outcome"]),
            context_trims: counter(
                "context_trims_total",
                "Steps the context assembly took to fit a prompt into its model's window, by kind",
                &["step"],
            ),
            context_summaries: counter("context_summaries_total", "Session summary attempts, by outcome", &["outcome"]),
            tasks_finished: counter(
                "tasks_finished_total",
                "Tasks ended, by model and final state",
                &["model", "state"],
            ),
            tokens: counter("tokens_total", "Tokens processed, by model and direction", &["model", "direction"]),
            tool_calls: counter(
                "tool_calls_total",
                "Tool calls made by models, by model, validity and whether the tool is high-risk",
                &["model", "valid", "high_risk"],
            ),
            queue_wait: hist("queue_wait_seconds", "Time from admission to dispatch", &["model", "priority"]),
            first_token: hist("first_token_seconds", "Time from receipt to the first token", &["model", "priority"]),
            task_duration: hist("task_duration_seconds", "Time from receipt to the end", &["model", "state"]),
            queue_depth: gauge("queue_depth", "Tasks waiting for a slot", &["model", "priority"]),
            running: gauge("running_tasks", "Tasks holding an engine slot", &["engine"]),
            engine_up: gauge("engine_up", "1 when the engine instance passes health checks", &["engine"]),
            engine_kv_cache_usage: {
                let g = GaugeVec::new(
                    Opts::new("engine_kv_cache_usage_ratio", "KV-cache usage the engine instance reports (0..1)"),
                    &["engine"],
                )
                .expect("valid metric");
                registry.register(Box::new(g.clone())).expect("unique metric");
                g
            },
            otlp_spans_dropped: {
                let c = prometheus::IntCounter::new(
                    "otlp_spans_dropped_total",
                    "Task spans not exported to the OTLP collector (queue full or send failed)",
                )
                .expect("valid metric");
                registry.register(Box::new(c.clone())).expect("unique metric");
                c
            },
            otlp: std::sync::OnceLock::new(),
            log_lines_dropped: {
                let c = prometheus::IntCounter::new(
                    "log_lines_dropped_total",
                    "Log lines dropped because the log writer's queue was full (a slow stderr consumer)",
                )
                .expect("valid metric");
                registry.register(Box::new(c.clone())).expect("unique metric");
                c
            },
            illegal_transitions: counter(
                "illegal_transitions_total",
                "Task state transitions refused because the state machine does not allow them, by from and to state",
                &["from", "to"],
            ),
            gpu_temperature: gauge("gpu_temperature_celsius", "GPU temperature (NVML)", &["gpu"]),
            gpu_memory_used: gauge("gpu_memory_used_bytes", "GPU memory in use (NVML)", &["gpu"]),
            nats_connected: {
                let g = IntGauge::new("nats_connected", "1 while the NATS bus is connected").expect("valid metric");
                registry.register(Box::new(g.clone())).expect("unique metric");
                g
            },
            nats_connection_events: counter(
                "nats_connection_events_total",
                "NATS connection events, by event",
                &["event"],
            ),
            nats_events_published: counter(
                "nats_events_published_total",
                "Lifecycle events published on NATS, by state",
                &["state"],
            ),
            nats_events_dropped: counter(
                "nats_events_dropped_total",
                "Lifecycle events not published on NATS, by reason",
                &["reason"],
            ),
            cluster_nodes: {
                let g = IntGauge::new("cluster_nodes", "Nodes in the registry's pool, this one included")
                    .expect("valid metric");
                registry.register(Box::new(g.clone())).expect("unique metric");
                g
            },
            cluster_publish_failures: counter(
                "cluster_publish_failures_total",
                "Node registry writes that failed, by operation",
                &["op"],
            ),
            pool_work: counter(
                "pool_work_total",
                "Tasks through the pool's work queue (store and forward), by outcome",
                &["outcome"],
            ),
            cost: {
                let c = prometheus::CounterVec::new(
                    Opts::new("cost_total", "Cost of finished tasks, by tenant and application"),
                    &["tenant", "application"],
                )
                .expect("valid metric");
                registry.register(Box::new(c.clone())).expect("unique metric");
                c
            },
            budget_used: float_gauge(
                "budget_used_ratio",
                "Used share of a budget window after its last charge, by tenant, application and window",
                &["tenant", "application", "window"],
            ),
            api_key_expiry: float_gauge(
                "api_key_expiry_timestamp_seconds",
                "When the first of an application's API keys that had not expired at load expires, Unix seconds",
                &["tenant", "application"],
            ),
            budget_warnings: counter(
                "budget_warnings_total",
                "Budget warnings (warn_percent crossed), by tenant, application and window",
                &["tenant", "application", "window"],
            ),
            nats_callers_lost: counter(
                "nats_callers_lost_total",
                "NATS reply streams cancelled because the caller was gone, by reason",
                &["reason"],
            ),
            registry,
        }
    }

    /// Exports the store's failed writes as `edgeway_store_errors` (read at
    /// each scrape). Call once, with the store the gateway uses.
    /// Starts exporting task spans to `endpoint` (on the current runtime).
    pub fn start_otlp(&self, endpoint: &str, node_id: &str) {
        let _ = self.otlp.set(otlp::SpanExporter::start(endpoint, node_id, self.otlp_spans_dropped.clone()));
    }

    /// The span exporter (off unless [`Self::start_otlp`] ran).
    pub fn spans(&self) -> Option<&otlp::SpanExporter> {
        self.otlp.get()
    }

    pub fn export_store_errors(&self, failures: WriteFailures) {
        let gauge = IntGauge::new("store_errors", "Task store writes that failed").expect("valid metric");
        self.registry.register(Box::new(StoreErrors { failures, gauge })).expect("unique metric");
    }

    /// Exports whether the store can write as `edgeway_store_degraded`
    /// (1 while writes fail) and `edgeway_store_buffered_writes` (writes
    /// kept in memory until they succeed), and what it committed
    /// (`edgeway_store_commits_total`, `edgeway_store_writes_total`), read
    /// at each scrape.
    pub fn export_store_health(&self, health: StoreHealth) {
        let degraded = IntGauge::new("store_degraded", "1 while the task store cannot write").expect("valid metric");
        let buffered =
            IntGauge::new("store_buffered_writes", "Task store writes kept in memory until the disk takes them")
                .expect("valid metric");
        let commits =
            IntCounter::new("store_commits_total", "Task store transactions committed").expect("valid metric");
        let writes =
            IntCounter::new("store_writes_total", "Task store writes committed (each transaction holds one or more)")
                .expect("valid metric");
        self.registry
            .register(Box::new(StoreHealthGauges { health, degraded, buffered, commits, writes }))
            .expect("unique metric");
    }

    /// Sets `edgeway_queue_capacity` from `config` (at start and at each
    /// reload: a reload may change the bounds).
    pub fn set_queue_capacities(&self, config: &crate::config::Config) {
        for (name, m) in &config.models {
            self.queue_capacity
                .with_label_values(&[name.as_str()])
                .set(i64::try_from(m.queue_capacity).unwrap_or(i64::MAX));
        }
    }

    /// Sets `edgeway_api_key_expiry_timestamp_seconds` from `config` at
    /// `now_ms` (at start and at each reload, which may add, remove or
    /// change keys): a series per application with an expiring key.
    pub fn set_key_expiries(&self, config: &crate::config::Config, now_ms: i64) {
        self.api_key_expiry.reset();
        for app in config.applications.values() {
            if let Some(at) = first_expiry(app.key_expires_ms.values().copied(), now_ms) {
                self.api_key_expiry
                    .with_label_values(&[app.tenant.as_str(), app.name.as_str()])
                    .set(at as f64 / 1000.0);
            }
        }
    }

    pub fn render(&self) -> String {
        let dropped = log_lines_dropped();
        let counted = self.log_lines_dropped.get();
        if dropped > counted {
            self.log_lines_dropped.inc_by(dropped - counted);
        }
        let mut buf = Vec::new();
        TextEncoder::new().encode(&self.registry.gather(), &mut buf).expect("text encoding cannot fail");
        String::from_utf8(buf).expect("prometheus text is UTF-8")
    }
}

/// What the key-expiry gauge shows of an application's key expiries (Unix
/// ms) at `now_ms`: the first that is still ahead (the next key to
/// lapse), else the last that passed (the application's expiring keys
/// have all lapsed; an alert on `… - time()` keeps firing until the
/// configuration drops them); `None` without any.
fn first_expiry(expiries: impl Iterator<Item = i64>, now_ms: i64) -> Option<i64> {
    let (ahead, passed): (Vec<i64>, Vec<i64>) = expiries.partition(|&at| at > now_ms);
    ahead.into_iter().min().or_else(|| passed.into_iter().max())
}

/// One task counted in a gauge while this lives (an engine attempt in
/// `edgeway_tasks_running`): the gauge goes down however the attempt ends,
/// a panic or a dropped future included. The handle is resolved once, so
/// holding it costs two atomic operations.
pub struct GaugeGuard(IntGauge);

impl GaugeGuard {
    pub fn inc(gauge: IntGauge) -> GaugeGuard {
        gauge.inc();
        GaugeGuard(gauge)
    }
}

impl Drop for GaugeGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// Store writes that could not be made (the task itself went on): a gauge
/// set from the store's own counter whenever the registry is gathered.
struct StoreErrors {
    failures: WriteFailures,
    gauge: IntGauge,
}

impl Collector for StoreErrors {
    fn desc(&self) -> Vec<&Desc> {
        self.gauge.desc()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        self.gauge.set(i64::try_from(self.failures.get()).unwrap_or(i64::MAX));
        self.gauge.collect()
    }
}

/// The store's health as two gauges, set whenever the registry is gathered.
struct StoreHealthGauges {
    health: StoreHealth,
    degraded: IntGauge,
    buffered: IntGauge,
    commits: IntCounter,
    writes: IntCounter,
}

impl Collector for StoreHealthGauges {
    fn desc(&self) -> Vec<&Desc> {
        [&self.degraded, &self.buffered]
            .into_iter()
            .flat_map(|g| g.desc())
            .chain(self.commits.desc())
            .chain(self.writes.desc())
            .collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        self.degraded.set(i64::from(self.health.is_degraded()));
        self.buffered.set(i64::try_from(self.health.buffered_writes()).unwrap_or(i64::MAX));
        let mut out = self.degraded.collect();
        out.extend(self.buffered.collect());
        // The store's own counts, as read now (the counters only lend
        // their names and type: nothing kept here to catch up).
        for (counter, value) in [(&self.commits, self.health.commits()), (&self.writes, self.health.committed_writes())]
        {
            let mut fams = counter.collect();
            for m in fams.iter_mut().flat_map(|f| f.mut_metric().iter_mut()) {
                let mut c = prometheus::proto::Counter::default();
                c.set_value(value as f64);
                m.set_counter(c);
            }
            out.extend(fams);
        }
        out
    }
}

/// Lines the log writer may hold before it drops new ones.
const LOG_QUEUE_LINES: usize = 8192;

static LOG_DROPS: std::sync::OnceLock<tracing_appender::non_blocking::ErrorCounter> = std::sync::OnceLock::new();

/// Log lines dropped so far because the writer's queue was full.
pub fn log_lines_dropped() -> u64 {
    LOG_DROPS.get().map_or(0, |c| c.dropped_lines() as u64)
}

/// Installs the global log subscriber (once; later calls are ignored, which
/// lets tests start several gateways). `RUST_LOG` overrides `log.level`.
///
/// Lines go to stderr from a thread of their own through a bounded queue:
/// a task's stage lines never make a runtime worker wait on a slow
/// consumer of stderr (journald, a full pipe); when the queue is full a
/// line is dropped and counted (`edgeway_log_lines_dropped_total`). Keep
/// the guard until exit: dropping it writes what is still queued.
#[must_use = "dropping the guard stops the log writer"]
pub fn init_logging(cfg: &LogConfig) -> tracing_appender::non_blocking::WorkerGuard {
    let (writer, guard) = tracing_appender::non_blocking::NonBlockingBuilder::default()
        .lossy(true)
        .buffered_lines_limit(LOG_QUEUE_LINES)
        .thread_name("edgeway-log")
        .finish(std::io::stderr());
    let _ = LOG_DROPS.set(writer.error_counter());
    init_logging_to(cfg, writer);
    guard
}

/// [`init_logging`] writing to `writer` (tests read the lines edgeway
/// writes, in the format it writes them).
pub fn init_logging_to<W>(cfg: &LogConfig, writer: W)
where
    W: for<'w> tracing_subscriber::fmt::MakeWriter<'w> + Send + Sync + 'static,
{
    use tracing_subscriber::util::SubscriberInitExt;
    let _ = log_subscriber(cfg, writer).try_init();
}

/// The subscriber [`init_logging_to`] installs, not installed (a test sets
/// it as its thread's default to read the text format).
pub fn log_subscriber<W>(cfg: &LogConfig, writer: W) -> Box<dyn tracing::Subscriber + Send + Sync>
where
    W: for<'w> tracing_subscriber::fmt::MakeWriter<'w> + Send + Sync + 'static,
{
    use tracing_subscriber::EnvFilter;
    // rumqttd and hyper report vanished clients at ERROR/WARN; they are not
    // our errors.
    let base = std::env::var("RUST_LOG").unwrap_or_else(|_| cfg.level.clone());
    // rumqttd logs every dropped device connection at ERROR: off unless
    // RUST_LOG names it.
    let rumqttd = if base.contains("rumqttd") { "" } else { ",rumqttd=off" };
    let filter =
        EnvFilter::try_new(format!("{base},hyper=warn,h2=warn{rumqttd}")).unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(writer);
    // Colours only for a person at a terminal: journald, a file or a pipe
    // would keep the escape codes, and writing them is a tenth of an info
    // line's instructions. (`NO_COLOR` still turns them off at a terminal.)
    let builder = if std::io::IsTerminal::is_terminal(&std::io::stderr()) { builder } else { builder.with_ansi(false) };
    match cfg.format {
        LogFormat::Json => Box::new(builder.json().flatten_event(true).finish()),
        LogFormat::Text => Box::new(builder.fmt_fields(TextFields).finish()),
    }
}

/// The fields of a text line: as tracing-subscriber's own (`name=value`,
/// the message bare, strings quoted), with control characters escaped in
/// every value (review 15 L2): a field logged with `%` (Display) is
/// written as it is by the default, so a caller's model name or session
/// id, or an engine's error text, holding `\n` would start a forged line.
/// (JSON lines escape them already.)
struct TextFields;

impl<'w> tracing_subscriber::fmt::FormatFields<'w> for TextFields {
    fn format_fields<R: tracing_subscriber::field::RecordFields>(
        &self,
        writer: tracing_subscriber::fmt::format::Writer<'w>,
        fields: R,
    ) -> std::fmt::Result {
        let mut v = TextVisitor { out: Escaped(writer), first: true, result: Ok(()) };
        fields.record(&mut v);
        v.result
    }
}

struct TextVisitor<'w> {
    out: Escaped<'w>,
    first: bool,
    result: std::fmt::Result,
}

impl tracing::field::Visit for TextVisitor<'_> {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        use std::fmt::Write as _;
        // What `log` records bring along (target, file, line): in the
        // line's own columns already.
        if self.result.is_err() || field.name().starts_with("log.") {
            return;
        }
        let sep = if self.first { "" } else { " " };
        self.first = false;
        self.result = match field.name() {
            "message" => write!(self.out, "{sep}{value:?}"),
            name => write!(self.out, "{sep}{}={value:?}", name.strip_prefix("r#").unwrap_or(name)),
        };
    }
}

/// A writer that writes control characters escaped (`\n`, `\u{1b}`).
struct Escaped<'w>(tracing_subscriber::fmt::format::Writer<'w>);

impl std::fmt::Write for Escaped<'_> {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        // The common case, no control character: one write. Found by a
        // scan of the bytes (half the instructions of decoding chars, issue
        // 13's cost at info): the C0 controls and DEL are those bytes, the
        // C1 controls (U+0080..=U+009F) start with 0xC2, as do a few
        // printable Latin-1 signs, which take the exact path below.
        if !s.bytes().any(|b| b < 0x20 || b == 0x7f || b == 0xc2) {
            return self.0.write_str(s);
        }
        for c in s.chars() {
            if c.is_control() {
                for e in c.escape_default() {
                    self.0.write_char(e)?;
                }
            } else {
                self.0.write_char(c)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Store;
    use crate::task::TaskState;

    /// The byte scan lets through exactly what has no control character:
    /// every char up to U+02FF (C0, DEL, C1 and the Latin-1 signs that
    /// share C1's first byte) alone and amid text, against `char::is_control`.
    #[test]
    fn text_fields_escape_every_control_character_and_nothing_else() {
        use std::fmt::Write as _;
        let escaped = |s: &str| {
            let mut out = String::new();
            Escaped(tracing_subscriber::fmt::format::Writer::new(&mut out)).write_str(s).unwrap();
            out
        };
        let reference = |s: &str| -> String {
            s.chars().map(|c| if c.is_control() { c.escape_default().to_string() } else { c.to_string() }).collect()
        };
        for c in (0..=0x2ff).filter_map(char::from_u32) {
            for s in [c.to_string(), format!("model {c} name"), format!("{c}{c}é")] {
                assert_eq!(escaped(&s), reference(&s), "{:?}", c as u32);
            }
        }
        assert_eq!(escaped("a\nb \u{1b}[31m \u{9b}"), "a\\nb \\u{1b}[31m \\u{9b}");
        assert_eq!(escaped("10 °C, ©"), "10 °C, ©");
    }

    #[tokio::test]
    async fn store_errors_are_read_from_the_store_at_each_scrape() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("edgeway.db");
        let store = Store::open(&path, "n1", false).unwrap();
        let metrics = Metrics::new();
        metrics.export_store_errors(store.write_failures());
        let text = metrics.render();
        assert!(text.contains("# TYPE edgeway_store_errors gauge"), "{text}");
        assert!(text.contains("edgeway_store_errors 0"), "{text}");

        // Make the next transition write fail: its table is gone.
        rusqlite::Connection::open(&path).unwrap().execute_batch("DROP TABLE task_transitions").unwrap();
        store.transition("t1", TaskState::Received, "http", None, "client");
        store.flush().await;
        assert_eq!(store.write_failures().get(), 1);
        assert!(metrics.render().contains("edgeway_store_errors 1"));
    }

    /// What the store committed is read at each scrape: transactions and
    /// the writes they held (several writes of a burst in one).
    #[tokio::test]
    async fn store_commits_and_writes_are_counted_at_each_scrape() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("edgeway.db"), "n1", false).unwrap();
        let metrics = Metrics::new();
        metrics.export_store_health(store.health());
        let value = |text: &str, name: &str| -> u64 {
            let line =
                text.lines().find(|l| l.starts_with(&format!("{name} "))).unwrap_or_else(|| panic!("{name} in {text}"));
            line.rsplit(' ').next().unwrap().parse().unwrap()
        };
        let text = metrics.render();
        assert!(text.contains("# TYPE edgeway_store_commits_total counter"), "{text}");
        let (commits, writes) =
            (value(&text, "edgeway_store_commits_total"), value(&text, "edgeway_store_writes_total"));
        for id in ["t1", "t2", "t3"] {
            store.transition(id, TaskState::Received, "http", None, "client");
        }
        store.flush().await;
        let text = metrics.render();
        let (c, w) = (value(&text, "edgeway_store_commits_total"), value(&text, "edgeway_store_writes_total"));
        assert!(c > commits, "a commit is counted: {commits} -> {c}");
        assert_eq!(w - writes, 3, "the three writes");
        assert!(c - commits <= 3, "in at most three transactions");
        // A scrape without commits in between reads the same.
        assert_eq!(value(&metrics.render(), "edgeway_store_commits_total"), c);
    }

    /// The key-expiry gauge: the next key to lapse, else the last that
    /// lapsed; nothing without an expiring key.
    #[test]
    fn the_key_expiry_is_the_next_to_lapse_else_the_last_that_did() {
        assert_eq!(first_expiry([5000, 9000, 2000].into_iter(), 3000), Some(5000));
        assert_eq!(first_expiry([1000, 2000].into_iter(), 3000), Some(2000), "all lapsed: the last");
        assert_eq!(first_expiry(std::iter::empty(), 3000), None);
    }
}
