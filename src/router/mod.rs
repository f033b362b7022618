//! The router: from a granted slot to a running engine request.
//!
//! Owns: the engine instances (their adapters, as built from the config);
//! their health probes (`health.rs`), which decide when an instance is up
//! or down and pass that, with what the engine says of its load, to the
//! scheduler that dispatches on it; a circuit breaker per instance
//! ([`breaker`]), fed by every attempt's outcome and by the probes, whose
//! state changes go to the scheduler the same way; the global retry budget
//! ([`budget`]); the choice of instance for a task ([`pick`], called by the
//! scheduler's policy); and dispatch (`dispatch.rs`): opening the engine
//! stream, sending a request once more when its connection broke before
//! any answer, telling which failures may be retried elsewhere, and turning
//! an engine's failure into the public error code a client sees.
//! Residency joins the instance state here: dispatch takes the model of
//! an instance through [`engine::residency::Residency::acquire`] (loading
//! it first, or sending the task on when the load would break its
//! first-token deadline), and the probes pass on what the engine says of
//! its model.
//!
//! Does not own: queues and slots (the scheduler grants a slot on an
//! instance, then calls [`Router::open`]), deadlines and the task's life
//! cycle (the scheduler's driver), or wire formats (the engine adapters).
//! The router knows nothing of the scheduler: instance changes go out
//! through the sink the scheduler hands to [`Router::start_probes`].

pub mod breaker;
pub mod budget;
mod dispatch;
mod health;
mod pick;

use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::{Config, RoutingConfig};
use crate::engine::{self, Engine, EngineLoad};
use crate::telemetry::Metrics;
use breaker::{Attempt, Breaker, BreakerState, Transition};
use budget::RetryBudget;

pub use dispatch::{DispatchError, ENGINE_RESTARTING};
pub use pick::{may_stand_in, pick, InstanceView};

/// One engine instance: an adapter and what the config says about it.
pub struct Instance {
    pub name: String,
    pub engine: Arc<dyn Engine>,
    /// The engine's own name for the model.
    pub engine_model: String,
    pub max_concurrency: usize,
    /// edgeway is the engine's only client, so a busy slot the engine
    /// reports after a cancel is one edgeway asked to stop.
    pub exclusive: bool,
    /// Time between health probes.
    pub health_interval: Duration,
    /// What its tokens cost (`[engines.X] price_*`): a reload that changes
    /// it replaces the instance, so a task is priced by the instance that
    /// answered it as it was then.
    pub price: crate::config::Price,
}

/// A change the scheduler must know about, sent through the sink given to
/// [`Router::start_probes`].
#[derive(Debug, Clone, PartialEq)]
pub enum InstanceEvent {
    /// The instance went up or down (only changes are sent), with the
    /// probe's detail (short, for logs and `/ready`, never for clients of
    /// tasks).
    /// `restarting`: down only while a supervised engine process is
    /// (re)started; it will be up again (see
    /// [`Engine::process_restarting`]).
    Health { instance: usize, up: bool, restarting: bool, detail: String },
    /// What a healthy engine said about itself at a probe: its load and,
    /// where it tells, whether its model is in memory; with what its
    /// breaker measured of recent attempts (failure ratio, p95 time to
    /// first token), for the routing decision.
    Load { instance: usize, load: EngineLoad, model_resident: Option<bool>, error_rate: f64, ttft_p95_ms: Option<u64> },
    /// The instance's circuit breaker changed state, and why.
    Breaker { instance: usize, state: BreakerState, reason: String },
}

/// Where instance events go (the scheduler's actor).
pub type InstanceSink = Arc<dyn Fn(InstanceEvent) + Send + Sync>;

pub struct Router {
    /// The instances, in the config's order, then those reloads added (an
    /// instance's index is its identity: a removed one stays, retired).
    entries: engine::AppendOnly<Entry>,
    /// The breaker settings of instances added at reload.
    breaker_config: crate::config::BreakerConfig,
    /// One [`Router::add_instance`] at a time: the residency's slots are
    /// pushed in the same order as the instances.
    adding: Mutex<()>,
    budget: RetryBudget,
    /// Engine attempts per task, the first included, and the first back-off
    /// before the same instance is tried again.
    pub max_attempts: u32,
    pub retry_backoff: Duration,
    /// Where breaker changes go, with what runs their cool-down timers;
    /// set by [`Router::start_probes`].
    wiring: OnceLock<Wiring>,
    /// The router itself, for the cool-down timers it spawns.
    me: OnceLock<std::sync::Weak<Router>>,
    /// Which instance has its model in memory; dispatch loads it first.
    residency: engine::residency::Residency,
}

/// One instance with its probe's wake-up, its breaker and what stops its
/// probe (a reload retired it).
struct Entry {
    inst: Instance,
    /// Probes wait on it to re-check the instance at once (after an engine
    /// request failed to connect).
    recheck: Notify,
    breaker: Mutex<Breaker>,
    /// Stops its probe (a child of the shutdown token, set when the probe
    /// starts).
    probe: OnceLock<CancellationToken>,
}

struct Wiring {
    sink: InstanceSink,
    metrics: Arc<Metrics>,
    tracker: TaskTracker,
    shutdown: CancellationToken,
}

impl Router {
    /// Builds an adapter for every configured engine, in the config's
    /// order (an instance's index is its position there).
    pub fn from_config(config: &Config) -> anyhow::Result<Router> {
        Router::from_config_with(config, &engine::supervisor::Processes::default())
    }

    /// [`Router::from_config`] with the adapters of supervised instances
    /// wrapped by `processes` (a process that is not ready is a down
    /// instance).
    pub fn from_config_with(config: &Config, processes: &engine::supervisor::Processes) -> anyhow::Result<Router> {
        let mut instances = Vec::with_capacity(config.engines.len());
        for e in config.engines.values() {
            instances.push(Self::build_instance(e, processes)?);
        }
        let mut router = Router::with_routing(instances, &config.routing);
        router.residency = engine::residency::Residency::new(config, &router.engines());
        Ok(router)
    }

    /// The instance of engine `e`, its adapter wrapped by `processes`
    /// when edgeway runs it.
    pub fn build_instance(
        e: &crate::config::EngineConfig,
        processes: &engine::supervisor::Processes,
    ) -> anyhow::Result<Instance> {
        let adapter =
            engine::build_with(e, processes.peers()).map_err(|err| anyhow::anyhow!("engine {}: {err}", e.name))?;
        Ok(Instance {
            name: e.name.clone(),
            engine: processes.wrap(e, adapter),
            engine_model: e.model.clone(),
            max_concurrency: e.max_concurrency,
            exclusive: e.exclusive,
            health_interval: e.health_interval,
            price: e.price,
        })
    }

    /// Adds `inst` (an engine a reload added or changed, of `config`) after
    /// the others, with its model's residency, and returns its index; its
    /// probe starts with [`Router::start_probe`], once the scheduler knows
    /// it. `None` when there is no room ([`Router::room`]).
    pub fn add_instance(&self, config: &Config, inst: Instance) -> Option<usize> {
        let _one = self.adding.lock().unwrap_or_else(|e| e.into_inner());
        let (name, engine) = (inst.name.clone(), inst.engine.clone());
        let i = self.entries.push(self.entry(inst)).ok()?;
        let slot = self.residency.add(config, &name, engine);
        debug_assert_eq!(slot, i, "residency slots follow the instances");
        Some(i)
    }

    /// Starts the probe of instance `i` that a reload added: it is down for
    /// dispatch until its first probe passes (a supervised one until its
    /// process is ready).
    pub fn start_probe(&self, i: usize) {
        if let (Some(w), Some(me)) = (self.wiring.get(), self.self_ref().and_then(|w| w.upgrade())) {
            let name = &self.instance(i).name;
            w.metrics.breaker_state.with_label_values(&[name]).set(BreakerState::Closed.gauge());
            let cancel = self.entries.get(i).probe.get_or_init(|| w.shutdown.child_token()).clone();
            w.tracker.spawn(health::probe_loop(me, i, w.metrics.clone(), w.sink.clone(), cancel));
        }
    }

    /// How many more instances reloads may add.
    pub fn room(&self) -> usize {
        self.entries.room()
    }

    /// Instance `i` was removed from the configuration (or replaced by a
    /// changed one) and drained: its probe stops, and `/ready` no longer
    /// waits for its model. The scheduler already gives it no new work.
    pub fn retire(&self, i: usize) {
        if let Some(probe) = self.entries.get(i).probe.get() {
            probe.cancel();
        }
        self.residency.retire(i);
    }

    fn entry(&self, inst: Instance) -> Entry {
        Entry {
            inst,
            recheck: Notify::new(),
            breaker: Mutex::new(Breaker::new(self.breaker_config.clone())),
            probe: OnceLock::new(),
        }
    }

    fn engines(&self) -> Vec<(String, Arc<dyn Engine>)> {
        self.instances().iter().map(|i| (i.name.clone(), i.engine.clone())).collect()
    }

    /// The residency of the instances' models (for `/ready` and
    /// `/v1/models`).
    pub fn residency(&self) -> &engine::residency::Residency {
        &self.residency
    }

    /// A router with the default `[routing]` settings.
    pub fn new(instances: Vec<Instance>) -> Router {
        Router::with_routing(instances, &RoutingConfig::default())
    }

    pub fn with_routing(instances: Vec<Instance>, r: &RoutingConfig) -> Router {
        let engines: Vec<_> = instances.iter().map(|i| (i.name.clone(), i.engine.clone())).collect();
        let entry = |inst| Entry {
            inst,
            recheck: Notify::new(),
            breaker: Mutex::new(Breaker::new(r.breaker.clone())),
            probe: OnceLock::new(),
        };
        Router {
            residency: engine::residency::Residency::unmanaged(&engines),
            entries: engine::AppendOnly::with_room(instances.into_iter().map(entry).collect(), engine::RELOAD_ROOM),
            breaker_config: r.breaker.clone(),
            adding: Mutex::new(()),
            budget: RetryBudget::new(r.retry_budget.clone()),
            max_attempts: r.max_attempts,
            retry_backoff: r.retry_backoff,
            wiring: OnceLock::new(),
            me: OnceLock::new(),
        }
    }

    /// Every instance, by index (retired ones too).
    pub fn instances(&self) -> Vec<&Instance> {
        self.entries.iter().map(|e| &e.inst).collect()
    }

    pub fn instance(&self, i: usize) -> &Instance {
        &self.entries.get(i).inst
    }

    /// Instance `i`'s probe wakes on it.
    fn recheck(&self, i: usize) -> &Notify {
        &self.entries.get(i).recheck
    }

    /// Asks the probe of instance `i` to check it now rather than at its
    /// next tick.
    pub fn request_recheck(&self, i: usize) {
        self.recheck(i).notify_one();
    }

    /// The generations instance `i`'s engine says it runs (for any client),
    /// where it tells.
    pub async fn busy_slots(&self, i: usize) -> Option<usize> {
        self.instance(i).engine.load().await.busy_slots
    }

    /// Counts a task's first attempt (the retry budget is a share of
    /// them).
    pub fn on_request(&self) {
        self.budget.on_request(Instant::now());
    }

    /// Takes one retry from the global budget, if any is left.
    pub fn try_retry(&self) -> bool {
        self.budget.try_retry(Instant::now())
    }

    /// The breaker's state of instance `i`.
    pub fn breaker_state(&self, i: usize) -> BreakerState {
        self.breaker(i).state()
    }

    /// An attempt is about to be sent to instance `i`: a half-open breaker
    /// lets it through as its one trial (the scheduler grants a half-open
    /// instance to one task at a time).
    pub fn attempt_started(&self, i: usize) {
        let mut b = self.breaker(i);
        if b.state() == BreakerState::HalfOpen {
            b.try_trial();
        }
    }

    /// An attempt on instance `i` ended before it could tell anything (the
    /// task was cancelled or preempted before the first token): a trial it
    /// held is given back.
    pub fn attempt_abandoned(&self, i: usize) {
        self.breaker(i).end_trial();
    }

    /// What an attempt on instance `i` came to, for its breaker.
    pub fn attempt_ended(&self, i: usize, attempt: Attempt) {
        self.feed(i, |b| b.record(Instant::now(), attempt));
    }

    /// A health probe's verdict on instance `i`, for its breaker.
    fn probe_verdict(&self, i: usize, up: bool) {
        self.feed(i, |b| b.probe(Instant::now(), up));
    }

    /// Applies `change` to instance `i`'s breaker and passes any state
    /// change on while still holding the breaker, so the scheduler gets
    /// the changes of one instance in the order they happened (the sink
    /// only queues a message). An open breaker (newly, or whose cool-down a
    /// failed probe restarted) gets a timer that half-opens it when the
    /// cool-down is over, so traffic returns without an operator.
    fn feed(&self, i: usize, change: impl FnOnce(&mut Breaker) -> Option<Transition>) {
        let mut b = self.breaker(i);
        let before = b.reopens_at();
        let t = change(&mut b);
        let after = b.reopens_at();
        if let Some(t) = t {
            self.breaker_changed(i, t);
        }
        if let Some(at) = after.filter(|a| Some(*a) != before) {
            self.half_open_at(i, at);
        }
    }

    /// Recent failure ratio and p95 time to first token (ms) of instance
    /// `i`.
    fn measured(&self, i: usize) -> (f64, Option<u64>) {
        let now = Instant::now();
        let b = self.breaker(i);
        (b.error_rate(now), b.ttft_p95(now).map(|d| d.as_millis() as u64))
    }

    fn breaker(&self, i: usize) -> std::sync::MutexGuard<'_, Breaker> {
        // A panic while holding it cannot leave a half-made state: every
        // method finishes its change before it returns.
        self.entries.get(i).breaker.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Logs, counts and passes on a breaker's change.
    fn breaker_changed(&self, i: usize, t: Transition) {
        let name = &self.instance(i).name;
        match t.to {
            BreakerState::Open => {
                tracing::warn!(engine = %name, from = t.from.as_str(), reason = %t.reason, "circuit breaker opened")
            }
            _ => {
                tracing::info!(engine = %name, from = t.from.as_str(), to = t.to.as_str(), reason = %t.reason, "circuit breaker changed")
            }
        }
        let Some(w) = self.wiring.get() else { return };
        w.metrics.breaker_state.with_label_values(&[name]).set(t.to.gauge());
        w.metrics.breaker_transitions.with_label_values(&[name, t.to.as_str()]).inc();
        (w.sink)(InstanceEvent::Breaker { instance: i, state: t.to, reason: t.reason });
    }

    /// Polls instance `i`'s breaker at `at` (the end of its cool-down).
    fn half_open_at(&self, i: usize, at: Instant) {
        let Some(w) = self.wiring.get() else { return };
        let me = self.self_ref();
        let shutdown = w.shutdown.clone();
        w.tracker.spawn(async move {
            tokio::select! {
                _ = shutdown.cancelled() => {}
                _ = tokio::time::sleep_until(tokio::time::Instant::from_std(at)) => {
                    if let Some(me) = me.and_then(|w| w.upgrade()) {
                        me.feed(i, |b| b.poll(Instant::now()));
                    }
                }
            }
        });
    }

    fn self_ref(&self) -> Option<std::sync::Weak<Router>> {
        self.me.get().cloned()
    }

    /// Starts one health probe per instance on `tracker`; each stops with
    /// `shutdown`. Changes (health, load, breakers) go to `sink`.
    pub fn start_probes(
        self: &Arc<Self>,
        tracker: &TaskTracker,
        shutdown: &CancellationToken,
        metrics: Arc<Metrics>,
        sink: InstanceSink,
    ) {
        let _ = self.me.set(Arc::downgrade(self));
        let _ = self.wiring.set(Wiring {
            sink: sink.clone(),
            metrics: metrics.clone(),
            tracker: tracker.clone(),
            shutdown: shutdown.clone(),
        });
        for inst in self.instances() {
            metrics.breaker_state.with_label_values(&[&inst.name]).set(BreakerState::Closed.gauge());
        }
        self.residency.start(tracker, shutdown, &metrics);
        for i in 0..self.entries.len() {
            let cancel = self.entries.get(i).probe.get_or_init(|| shutdown.child_token()).clone();
            tracker.spawn(health::probe_loop(self.clone(), i, metrics.clone(), sink.clone(), cancel));
        }
    }
}

/// An engine that answers from a script, for the router's unit tests.
#[cfg(test)]
mod test_engine {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;

    use async_trait::async_trait;

    use crate::config::EngineKind;
    use crate::engine::{Capabilities, Engine, EngineError, EngineHealth, EngineLoad, EngineRequest, EngineStream};

    /// One scripted answer to `stream()`: refused, or these items.
    pub(crate) type Answer = Result<Vec<Result<crate::engine::EngineChunk, EngineError>>, EngineError>;

    pub(crate) struct Scripted {
        /// Health probe answers in order (then the last one repeats).
        pub ups: Vec<bool>,
        pub probes: AtomicUsize,
        /// Answers to `stream()` in order: an error, or a stream of these
        /// items.
        pub streams: Mutex<Vec<Answer>>,
        pub sent: AtomicUsize,
    }

    /// A router over one instance of `engine`, probed every
    /// `health_interval`.
    pub(crate) fn router(engine: std::sync::Arc<Scripted>, health_interval: std::time::Duration) -> super::Router {
        super::Router::new(vec![super::Instance {
            name: "scripted".into(),
            engine,
            engine_model: "m".into(),
            max_concurrency: 1,
            exclusive: true,
            health_interval,
            price: Default::default(),
        }])
    }

    impl Scripted {
        pub fn probes(ups: Vec<bool>) -> Scripted {
            Scripted { ups, probes: AtomicUsize::new(0), streams: Mutex::new(Vec::new()), sent: AtomicUsize::new(0) }
        }

        pub fn streams(answers: Vec<Answer>) -> Scripted {
            Scripted {
                ups: vec![true],
                probes: AtomicUsize::new(0),
                streams: Mutex::new(answers),
                sent: AtomicUsize::new(0),
            }
        }
    }

    #[async_trait]
    impl Engine for Scripted {
        fn name(&self) -> &str {
            "scripted"
        }
        fn kind(&self) -> EngineKind {
            EngineKind::OpenAi
        }
        fn capabilities(&self) -> Capabilities {
            Capabilities { streaming: true, reports_usage: true, cancel_on_disconnect: true }
        }
        async fn stream(&self, _req: &EngineRequest) -> Result<EngineStream, EngineError> {
            use futures::StreamExt;
            self.sent.fetch_add(1, Ordering::SeqCst);
            let mut answers = self.streams.lock().unwrap();
            assert!(!answers.is_empty(), "stream() called more often than scripted");
            answers.remove(0).map(|items| futures::stream::iter(items).boxed())
        }
        async fn health(&self) -> EngineHealth {
            let n = self.probes.fetch_add(1, Ordering::SeqCst);
            let up = *self.ups.get(n).or(self.ups.last()).unwrap();
            EngineHealth {
                up,
                detail: format!("probe {n}: {}", if up { "ok" } else { "refused" }),
                model_resident: None,
            }
        }
        async fn load(&self) -> EngineLoad {
            EngineLoad { busy_slots: Some(1), kv_cache_usage: None, takes_from: None }
        }
    }
}
