//! Model residency (FR-4.7): which engine instance has its model in memory,
//! loading and unloading it through the engine's own API, and the state
//! `/ready` and `/v1/models` show.
//!
//! Owns: one state per engine instance (an instance serves one engine
//! model): `loaded`, `loading`, `unloaded` or `forbidden`; the load on
//! first use (one load at a time per instance, whoever waits for it), the
//! unload after `idle_unload_s` without work, the unload of the least
//! recently used idle model of the same engine server when a load would
//! pass the engine's memory budget (`memory_budget_mb` against the models'
//! `weights_mb`; the loads of one server make room and load one at a
//! time, so two never wait for each other's memory), the load of `always`
//! models at start (and again when the engine dropped one), and the
//! `edgeway_model_*` metrics and log lines.
//!
//! # Eviction by priority
//! A load that needs memory unloads idle models of the same server, chosen
//! by the priority of their work against the priority of the work the load
//! is for (the most urgent task waiting on it): a model with queued work
//! more urgent than that is never unloaded for it (the load waits for
//! memory, within the task's first-token deadline, or the task takes its
//! next routing step); among the others, the model whose work is least
//! urgent goes first (its queued work, else the priority of its last
//! use), then the least recently used. Residency does not see the
//! scheduler's queues: the scheduler keeps a [`WaitingWork`] current (the
//! tasks waiting, per logical model and priority), which this reads.
//!
//! Does not own: which work may use a model (`restricted`, `forbidden`:
//! the scheduler's policy drops those instances from a task's routing
//! steps), the decision to wait for a load or take the next step (the
//! router's dispatch asks [`Residency::acquire`] with the task's
//! first-token deadline), or the wire calls (the adapters'
//! [`Engine::load_model`] and friends).
//!
//! # Two memory counts, one configuration
//! edgeway counts engine memory in two places, from the same keys
//! (`[engines.X] memory_budget_mb`, `[models.Y] weights_mb`, and for the
//! scheduler also `kv_bytes_per_token` and `memory_margin`):
//! - **The scheduler** (`scheduler::policy`, per instance = per engine
//!   section): weights of the instance's model (the largest `weights_mb`
//!   among the models naming it, counted once from the first grant there or
//!   from a probe that says the model is loaded, and dropped when a probe
//!   says it is not and nothing runs there) plus the KV estimate of every
//!   running task. A slot is granted only when that stays within the
//!   section's budget; admission shrinks the output budget to fit it.
//! - **Residency** (this file, per engine *server* = all sections with one
//!   `base_url`, i.e. one llama-server router or one Ollama): only weights,
//!   of the models `loaded` or `loading` there; before a load, idle models
//!   of the server are unloaded (least recently used first) until the sum
//!   plus the new model fits the budget of the section being loaded.
//!   Residency never counts KV: on a router-mode llama-server each model is
//!   its own process, whose KV cache the scheduler's per-section count
//!   covers.
//!
//! They meet in one direction only: the scheduler learns of loads and
//! unloads from the health probes (`model_resident`), so after an unload
//! it may count the weights until the next probe (over-counting delays a
//! grant, never over-commits). They are not one mechanism because the
//! scheduler's check is a synchronous decision in its actor, over one
//! section, while eviction spans sections and waits on engine calls;
//! making one would move residency into the actor (a rewrite), left for
//! later (issue 11). Give the sections of one server the same budget.
//!
//! # The engines' APIs (checked against the pinned llama.cpp)
//! - **llama-server router mode** (`--models-dir DIR`, one model per
//!   `NAME.gguf`, named `NAME`; `--models-max N` caps the models loaded,
//!   evicting the least recently used itself; `--no-models-autoload` makes
//!   a request for an unloaded model fail with 400 "model is not loaded"
//!   instead of loading it): `GET /models` lists `{"data": [{"id",
//!   "status": {"value": "loaded" | "loading" | "unloaded" | "sleeping" |
//!   "downloading", "failed"?, "exit_code"?}}]}`; `POST /models/load
//!   {"model"}` answers `{"success": true}` at once and the load runs in
//!   the background (poll `/models`; a failed load is `unloaded` with
//!   `failed: true`); `POST /models/unload {"model"}` answers the same, or
//!   400 "model is not running". A chat request names the model in its
//!   `model` field (the engine's `model` key); while it loads, 503
//!   "Loading model".
//! - **Ollama**: `GET /api/ps` lists the models in memory; `POST
//!   /api/generate {"model"}` without a prompt loads one and answers when it
//!   is loaded; `keep_alive: 0` unloads it.
//! - **vLLM** sleep / wake-up is not used: an engine with `model_api =
//!   "none"` keeps its model, which counts as loaded while it is healthy.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::{Engine, EngineError};
use crate::config::{Config, ModelApi, ResidencyClass};
use crate::task::Priority;
use crate::telemetry::Metrics;

/// The tasks waiting in the scheduler's queues, per logical model and
/// priority: the scheduler's view that eviction reads (it counts as a
/// queue-depth gauge does, at each enqueue, grant and withdrawal).
#[derive(Debug, Default)]
pub struct WaitingWork {
    counts: Mutex<std::collections::HashMap<String, [usize; 5]>>,
}

impl WaitingWork {
    fn slot(p: Priority) -> usize {
        Priority::ALL.iter().position(|&q| q == p).unwrap_or(4)
    }

    /// A task of `model` at priority `p` is queued.
    pub fn add(&self, model: &str, p: Priority) {
        let mut c = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        c.entry(model.to_string()).or_default()[Self::slot(p)] += 1;
    }

    /// A task of `model` at priority `p` left its queue (granted,
    /// withdrawn, refused).
    pub fn remove(&self, model: &str, p: Priority) {
        let mut c = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = c.get_mut(model) {
            let k = &mut n[Self::slot(p)];
            *k = k.saturating_sub(1);
        }
    }

    /// The most urgent priority queued for any of `models`.
    pub fn best<'a>(&self, models: impl IntoIterator<Item = &'a String>) -> Option<Priority> {
        let c = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        models
            .into_iter()
            .filter_map(|m| c.get(m))
            .filter_map(|n| n.iter().position(|&k| k > 0).map(|p| Priority::ALL[p]))
            .min()
    }
}

/// The longest a load may take before it counts as failed.
const LOAD_TIMEOUT: Duration = Duration::from_secs(300);
/// How often an engine whose load API answers at once is asked whether the
/// load is done (llama-server router mode).
pub const LOAD_POLL: Duration = Duration::from_millis(100);
/// Wait before an `always` model whose load failed is tried again.
const ALWAYS_RETRY: Duration = Duration::from_secs(2);

/// What an engine says of its model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelState {
    Loaded,
    Loading,
    Unloaded,
    /// The engine tried to load it and gave up (llama-server: `failed`).
    Failed,
}

/// A model's state on an instance, as `/v1/models` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    Loaded,
    Loading,
    Unloaded,
    Forbidden,
}

impl State {
    pub fn as_str(self) -> &'static str {
        match self {
            State::Loaded => "loaded",
            State::Loading => "loading",
            State::Unloaded => "unloaded",
            State::Forbidden => "forbidden",
        }
    }
}

/// Why a task may not use an instance now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refused {
    /// The model is loading (or about to) and the load would not be done
    /// before the task's first-token deadline; `loading_for`: how long the
    /// load has run so far.
    WouldMissDeadline { loading_for: Duration, expected: Duration },
    /// The load failed (the engine's words are in the log only).
    LoadFailed(String),
    /// Never loaded on this node.
    Forbidden,
}

/// One instance's model.
struct Slot {
    instance: String,
    /// The logical model naming the instance (metrics label).
    model: String,
    /// Every logical model naming it (their queued work protects it).
    models: Vec<String>,
    engine: Arc<dyn Engine>,
    api: ModelApi,
    class: ResidencyClass,
    idle_unload: Option<Duration>,
    /// Instances of one engine server share its memory.
    server: String,
    budget: Option<u64>,
    weights: u64,
    st: Mutex<SlotState>,
    /// The state after every change (loads are awaited on it).
    tx: watch::Sender<State>,
    /// A reload removed or replaced the instance: `/ready` no longer
    /// waits for its model.
    retired: std::sync::atomic::AtomicBool,
}

struct SlotState {
    state: State,
    /// Tasks holding a [`Lease`].
    users: usize,
    last_used: Instant,
    loading_since: Option<Instant>,
    /// How long the last successful load took (the estimate for the next).
    last_load: Option<Duration>,
    /// Bumped at every use, so an idle timer set before it does nothing.
    epoch: u64,
    /// Why the last load failed.
    failure: Option<String>,
    /// When `state` last changed: an engine's report read before it is
    /// stale.
    changed_at: Instant,
    /// An unload call is under way: the engine may list the model as
    /// loaded until it is done (llama-server stops the model's process in
    /// the background), which is no news.
    unloading: bool,
    /// The most urgent task waiting for the load under way (what memory
    /// is made for).
    need: Option<Priority>,
    /// The priority of the last task that used the model.
    last_priority: Option<Priority>,
    /// A load under way that has its memory (past `make_room`): counted
    /// as used by other loads. A `loading` slot still waiting for its
    /// server's turn is not (two such loads would each wait for the
    /// other's memory: review 15 M3).
    reserved: bool,
}

impl SlotState {
    /// A slot in `state` that nothing has used yet.
    fn new(state: State) -> SlotState {
        let now = Instant::now();
        SlotState {
            state,
            users: 0,
            last_used: now,
            loading_since: None,
            last_load: None,
            epoch: 0,
            failure: None,
            changed_at: now,
            unloading: false,
            need: None,
            last_priority: None,
            reserved: false,
        }
    }
}

struct Inner {
    /// By instance index; a reload appends the instances it adds.
    slots: super::AppendOnly<Slot>,
    metrics: Mutex<Option<ResidencyMetrics>>,
    /// Told whenever a model's last user leaves (a load waiting for
    /// memory looks again).
    freed: tokio::sync::Notify,
    tracker: TaskTracker,
    shutdown: CancellationToken,
    /// The scheduler's queued work, for eviction.
    waiting: Arc<WaitingWork>,
    /// One load at a time per engine server (by `base_url`) makes room
    /// and loads: two at once could each count the other's model.
    turns: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

/// The residency of every engine instance, shared by the router (which
/// loads before dispatch), the gateway (`/ready`, `/v1/models`) and the
/// health probes (which pass on what the engine says).
#[derive(Clone)]
pub struct Residency {
    inner: Arc<Inner>,
}

#[derive(Clone)]
struct ResidencyMetrics {
    load_seconds: HistogramVec,
    loads: IntCounterVec,
    unloads: IntCounterVec,
    resident: IntGaugeVec,
}

impl ResidencyMetrics {
    fn register(m: &Metrics) -> Option<ResidencyMetrics> {
        // The registry adds the `edgeway_` prefix.
        let o = |n: &str, h: &str| Opts::new(n, h);
        let labels = ["model", "engine"];
        let r = ResidencyMetrics {
            load_seconds: HistogramVec::new(
                HistogramOpts::new("model_load_seconds", "Time to load a model into an engine, successful loads")
                    .buckets(vec![0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 300.0]),
                &labels,
            )
            .ok()?,
            loads: IntCounterVec::new(
                o("model_loads_total", "Model loads, by result (ok, failed)"),
                &["model", "engine", "result"],
            )
            .ok()?,
            unloads: IntCounterVec::new(
                o("model_unloads_total", "Model unloads, by reason (idle, memory, engine, forbidden)"),
                &["model", "engine", "reason"],
            )
            .ok()?,
            resident: IntGaugeVec::new(o("model_resident", "1 while the model is loaded in the engine"), &labels)
                .ok()?,
        };
        // A second gateway in one process (tests) shares no registry, so
        // this only fails on a programming error; metrics are then left out.
        m.registry.register(Box::new(r.load_seconds.clone())).ok()?;
        m.registry.register(Box::new(r.loads.clone())).ok()?;
        m.registry.register(Box::new(r.unloads.clone())).ok()?;
        m.registry.register(Box::new(r.resident.clone())).ok()?;
        Some(r)
    }
}

/// Holds an instance's model in use: while any lease lives, the model is
/// not unloaded. Dropping the last one starts its idle timer.
pub struct Lease {
    residency: Option<(Residency, usize)>,
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some((r, i)) = self.residency.take() {
            r.release(i);
        }
    }
}

impl Residency {
    /// Instances whose engines keep their models themselves (no model API,
    /// class `always`): what a router built without a configuration has.
    pub fn unmanaged(engines: &[(String, Arc<dyn Engine>)]) -> Residency {
        let slots = engines
            .iter()
            .map(|(name, engine)| Slot {
                instance: name.clone(),
                model: String::new(),
                models: Vec::new(),
                engine: engine.clone(),
                api: ModelApi::None,
                class: ResidencyClass::Always,
                idle_unload: None,
                server: String::new(),
                budget: None,
                weights: 0,
                st: Mutex::new(SlotState::new(State::Loaded)),
                tx: watch::channel(State::Loaded).0,
                retired: false.into(),
            })
            .collect();
        Residency::with_slots(slots)
    }

    fn with_slots(slots: Vec<Slot>) -> Residency {
        Residency {
            inner: Arc::new(Inner {
                slots: super::AppendOnly::with_room(slots, super::RELOAD_ROOM),
                metrics: Mutex::new(None),
                freed: tokio::sync::Notify::new(),
                tracker: TaskTracker::new(),
                shutdown: CancellationToken::new(),
                waiting: Arc::default(),
                turns: Mutex::default(),
            }),
        }
    }

    /// One slot per engine instance, in `engines`' order (the router's
    /// instance order), each with the class of the models naming it.
    pub fn new(config: &Config, engines: &[(String, Arc<dyn Engine>)]) -> Residency {
        let slots = engines.iter().map(|(name, engine)| Self::make_slot(config, name, engine.clone())).collect();
        Residency::with_slots(slots)
    }

    /// The slot of instance `name` of `config`, with the class of the
    /// models naming it.
    fn make_slot(config: &Config, name: &str, engine: Arc<dyn Engine>) -> Slot {
        let e = &config.engines[name];
        let models: Vec<_> = config.models.values().filter(|m| m.instances.iter().any(|n| n == name)).collect();
        // A class is about this node: an edge-node or cloud
        // instance is never loaded or refused here.
        let residency = match models.first() {
            Some(m) if e.is_local() => m.residency.clone(),
            _ => Default::default(),
        };
        let api = if e.is_local() { e.model_api } else { ModelApi::None };
        let state = match residency.class {
            ResidencyClass::Forbidden => State::Forbidden,
            // Until the engine says otherwise: an engine without a
            // model API keeps its model; one with it is asked.
            _ if api == ModelApi::None => State::Loaded,
            _ => State::Unloaded,
        };
        Slot {
            instance: name.to_string(),
            model: models.first().map(|m| m.name.clone()).unwrap_or_default(),
            models: models.iter().map(|m| m.name.clone()).collect(),
            engine,
            api,
            class: residency.class,
            idle_unload: residency.idle_unload,
            server: e.base_url.clone(),
            budget: e.memory_budget_bytes,
            weights: models.iter().map(|m| m.weights_bytes).max().unwrap_or(0),
            st: Mutex::new(SlotState::new(state)),
            tx: watch::channel(state).0,
            retired: false.into(),
        }
    }

    /// Adds the slot of an instance a reload added (the router's next
    /// index) and, once started, begins its work as [`Residency::start`]
    /// does for the others. Returns its index.
    pub fn add(&self, config: &Config, name: &str, engine: Arc<dyn Engine>) -> usize {
        let Ok(i) = self.inner.slots.push(Self::make_slot(config, name, engine)) else {
            // The router checks the room of the instance list, which has
            // the same.
            unreachable!("the router checked the room");
        };
        if self.inner.metrics.lock().unwrap_or_else(|e| e.into_inner()).is_some() {
            self.begin(i);
        }
        i
    }

    /// The view of the scheduler's queues that eviction reads; the
    /// scheduler keeps it current.
    pub fn waiting_work(&self) -> Arc<WaitingWork> {
        self.inner.waiting.clone()
    }

    /// Instance `i` was removed or replaced by a reload: `/ready` no longer
    /// waits for its model.
    ///
    /// It is drained (no users), and its model is no longer its own: a
    /// changed engine's new instance serves the same model on the same
    /// server. So it counts as unloaded from here, without asking the
    /// engine: eviction neither counts its weights a second time nor
    /// unloads the model under the new instance's work (review 15 H3).
    pub fn retire(&self, i: usize) {
        self.slot(i).retired.store(true, std::sync::atomic::Ordering::Relaxed);
        let mut st = self.lock(i);
        // Its idle timer would unload the model its successor now serves.
        st.epoch += 1;
        if st.state != State::Forbidden && self.slot(i).api != ModelApi::None {
            st.state = State::Unloaded;
            st.changed_at = Instant::now();
            self.slot(i).tx.send_replace(State::Unloaded);
        }
        // Its `edgeway_model_resident` series is the successor's (same
        // model and engine name): left as it is.
    }

    fn is_retired(&self, i: usize) -> bool {
        self.slot(i).retired.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Starts the residency work: `always` models are loaded, `forbidden`
    /// ones that an engine has loaded are unloaded; loads, unloads and idle
    /// timers run on `tracker` and stop with `shutdown`.
    pub fn start(&self, tracker: &TaskTracker, shutdown: &CancellationToken, metrics: &Metrics) {
        *self.inner.metrics.lock().unwrap_or_else(|e| e.into_inner()) = ResidencyMetrics::register(metrics);
        let stop = self.inner.shutdown.clone();
        let parent = shutdown.clone();
        tracker.spawn(async move {
            parent.cancelled().await;
            stop.cancel();
        });
        let inner_tracker = self.inner.tracker.clone();
        let shutdown = shutdown.clone();
        tracker.spawn(async move {
            shutdown.cancelled().await;
            inner_tracker.close();
            inner_tracker.wait().await;
        });
        for i in 0..self.inner.slots.len() {
            self.begin(i);
        }
    }

    /// Shows instance `i`'s state and starts what its class asks at start:
    /// an `always` model is loaded, a `forbidden` one an engine has loaded
    /// is unloaded.
    fn begin(&self, i: usize) {
        self.show(i);
        let s = self.slot(i);
        if s.api == ModelApi::None {
            return;
        }
        match s.class {
            ResidencyClass::Always => self.begin_load(i, "start"),
            ResidencyClass::Forbidden => {
                let me = self.clone();
                self.spawn(async move {
                    if matches!(me.slot(i).engine.model_state().await, Some(Ok(ModelState::Loaded))) {
                        me.unload(i, "forbidden").await;
                    }
                });
            }
            _ => {}
        }
    }

    fn slot(&self, i: usize) -> &Slot {
        self.inner.slots.get(i)
    }

    fn lock(&self, i: usize) -> std::sync::MutexGuard<'_, SlotState> {
        // Every change is finished before the lock is released.
        self.slot(i).st.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn spawn(&self, f: impl std::future::Future<Output = ()> + Send + 'static) {
        let stop = self.inner.shutdown.clone();
        self.inner.tracker.spawn(async move {
            tokio::select! {
                _ = stop.cancelled() => {}
                _ = f => {}
            }
        });
    }

    /// The state of instance `i`'s model.
    pub fn state(&self, i: usize) -> State {
        self.lock(i).state
    }

    /// The state of the instance named `instance`, if there is one.
    pub fn state_of(&self, instance: &str) -> Option<State> {
        // The last: a changed engine's instance replaces the earlier one.
        let i = self.inner.slots.iter().enumerate().filter(|(_, s)| s.instance == instance).last()?.0;
        Some(self.state(i))
    }

    /// `always` models that are not loaded yet (for `/ready`).
    pub fn not_ready(&self) -> Vec<String> {
        (0..self.inner.slots.len())
            .filter(|&i| {
                let s = self.slot(i);
                s.class == ResidencyClass::Always && !self.is_retired(i) && self.state(i) != State::Loaded
            })
            .map(|i| {
                let s = self.slot(i);
                let why = self.lock(i).failure.clone();
                match why {
                    Some(w) => format!("model {} is not loaded on {} (last load failed: {w})", s.model, s.instance),
                    None => format!("model {} is not loaded on {} yet", s.model, s.instance),
                }
            })
            .collect()
    }

    /// Takes instance `i`'s model for one task: at once when it is
    /// loaded; else it is loaded (or its load is joined) and awaited,
    /// unless the load would not be done by `deadline` (estimated from
    /// the last load): then the load still goes on, for the tasks after,
    /// and the task is told to take the next step.
    ///
    /// # Cancel safety
    /// The load runs on its own task: dropping this future only stops
    /// waiting for it.
    /// `priority`: the task's, for the choice of what to unload when the
    /// load needs memory.
    pub async fn acquire(&self, i: usize, deadline: Option<Instant>, priority: Priority) -> Result<Lease, Refused> {
        let s = self.slot(i);
        if s.api == ModelApi::None {
            return match s.class {
                ResidencyClass::Forbidden => Err(Refused::Forbidden),
                _ => Ok(Lease { residency: None }),
            };
        }
        let mut rx = s.tx.subscribe();
        {
            let mut st = self.lock(i);
            let now = Instant::now();
            match st.state {
                State::Forbidden => return Err(Refused::Forbidden),
                State::Loaded => {
                    st.users += 1;
                    st.epoch += 1;
                    st.last_used = now;
                    st.last_priority = Some(priority);
                    return Ok(Lease { residency: Some((self.clone(), i)) });
                }
                State::Loading | State::Unloaded => {
                    st.need = Some(st.need.map_or(priority, |n| n.min(priority)));
                    let loading_for = st.loading_since.map_or(Duration::ZERO, |t| now - t);
                    if let (Some(d), Some(expected)) = (deadline, st.last_load) {
                        if now + expected.saturating_sub(loading_for) > d {
                            drop(st);
                            self.begin_load(i, "first use");
                            return Err(Refused::WouldMissDeadline { loading_for, expected });
                        }
                    }
                }
            }
        }
        self.begin_load(i, "first use");
        // `begin_load` left it loading (or loaded, by a load that was
        // already done): what comes after loading is the outcome.
        let _ = rx.wait_for(|s| *s != State::Loading).await;
        // Loaded, or back to unloaded with a failure: look again under the
        // lock (an unload may have come in between).
        let mut st = self.lock(i);
        if st.state == State::Loaded {
            st.users += 1;
            st.epoch += 1;
            st.last_used = Instant::now();
            st.last_priority = Some(priority);
            return Ok(Lease { residency: Some((self.clone(), i)) });
        }
        Err(Refused::LoadFailed(st.failure.clone().unwrap_or_else(|| "unloaded while loading".into())))
    }

    /// For a task's record when it is given instance `i` and the model is
    /// not loaded: "model loading (for N ms so far)" or "model not loaded,
    /// loading it".
    pub fn loading_note(&self, i: usize) -> Option<String> {
        if self.slot(i).api == ModelApi::None {
            return None;
        }
        let st = self.lock(i);
        match (st.state, st.loading_since) {
            (State::Loading, Some(since)) => Some(format!("model loading ({} ms so far)", since.elapsed().as_millis())),
            (State::Unloaded, _) => Some("model not loaded, loading it".into()),
            _ => None,
        }
    }

    /// How long instance `i`'s model has been loading, while it is.
    pub fn loading_for(&self, i: usize) -> Option<Duration> {
        self.lock(i).loading_since.map(|t| t.elapsed())
    }

    fn release(&self, i: usize) {
        let (epoch, idle) = {
            let mut st = self.lock(i);
            st.users = st.users.saturating_sub(1);
            st.last_used = Instant::now();
            if st.users > 0 {
                return;
            }
            (st.epoch, self.slot(i).idle_unload)
        };
        self.inner.freed.notify_waiters();
        let Some(idle) = idle else { return };
        if !matches!(self.slot(i).class, ResidencyClass::OnDemand | ResidencyClass::Restricted) {
            return;
        }
        if tokio::runtime::Handle::try_current().is_err() {
            return;
        }
        let me = self.clone();
        self.spawn(async move {
            tokio::time::sleep(idle).await;
            let still_idle = {
                let st = me.lock(i);
                st.epoch == epoch && st.users == 0 && st.state == State::Loaded
            };
            if still_idle {
                me.unload(i, "idle").await;
            }
        });
    }

    /// Starts loading instance `i`'s model unless it is loaded or loading.
    fn begin_load(&self, i: usize, why: &'static str) {
        {
            let mut st = self.lock(i);
            if st.state != State::Unloaded || self.is_retired(i) {
                return;
            }
            st.state = State::Loading;
            st.loading_since = Some(Instant::now());
            st.changed_at = Instant::now();
            self.slot(i).tx.send_replace(State::Loading);
        }
        let me = self.clone();
        self.spawn(async move { me.load(i, why).await });
    }

    async fn load(&self, i: usize, why: &'static str) {
        let s = self.slot(i);
        let started = Instant::now();
        tracing::info!(model = %s.model, engine = %s.instance, why, "loading model");
        // The server's turn, for a load that has a budget to respect.
        let turn = match s.budget {
            Some(_) => {
                let t = self
                    .inner
                    .turns
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .entry(s.server.clone())
                    .or_default()
                    .clone();
                Some(t.lock_owned().await)
            }
            None => None,
        };
        let room = self.make_room(i).await;
        if room.is_ok() {
            self.lock(i).reserved = true;
        }
        let result = match room {
            Err(e) => Err(e),
            Ok(()) => match tokio::time::timeout(LOAD_TIMEOUT, async {
                // An unload of this model still under way would make the
                // engine answer "loaded" and then drop it: let it end.
                while self.lock(i).unloading {
                    tokio::time::sleep(LOAD_POLL).await;
                }
                s.engine.load_model().await
            })
            .await
            {
                Ok(Ok(())) => Ok(()),
                Ok(Err(e)) => Err(e.class()),
                Err(_) => Err(format!("not loaded after {} s", LOAD_TIMEOUT.as_secs())),
            },
        };
        let took = started.elapsed();
        let metrics = self.metrics();
        {
            let mut st = self.lock(i);
            st.loading_since = None;
            st.need = None;
            st.reserved = false;
            st.changed_at = Instant::now();
            match &result {
                Ok(()) => {
                    st.state = State::Loaded;
                    st.last_load = Some(took);
                    st.failure = None;
                    // A fresh load is a use: its idle time starts now.
                    st.last_used = Instant::now();
                }
                Err(e) => {
                    st.state = State::Unloaded;
                    st.failure = Some(e.clone());
                }
            }
            s.tx.send_replace(st.state);
        }
        // Loaded (counted as such) or failed: the next load's turn.
        drop(turn);
        match &result {
            Ok(()) => {
                tracing::info!(model = %s.model, engine = %s.instance, seconds = took.as_secs_f64(), "model loaded");
                if let Some(m) = &metrics {
                    m.load_seconds.with_label_values(&[&s.model, &s.instance]).observe(took.as_secs_f64());
                    m.loads.with_label_values(&[&s.model, &s.instance, "ok"]).inc();
                }
            }
            Err(e) => {
                tracing::warn!(model = %s.model, engine = %s.instance, error = %e, "model load failed");
                if let Some(m) = &metrics {
                    m.loads.with_label_values(&[&s.model, &s.instance, "failed"]).inc();
                }
            }
        }
        self.show(i);
        if result.is_ok() {
            // Nobody may come: an on-demand model loaded for a task that
            // left still goes idle.
            let users = self.lock(i).users;
            if users == 0 {
                self.lock(i).users = 1;
                self.release(i);
            }
        } else if s.class == ResidencyClass::Always {
            let me = self.clone();
            self.spawn(async move {
                tokio::time::sleep(ALWAYS_RETRY).await;
                me.begin_load(i, "retry");
            });
        }
    }

    /// Unloads idle models of instance `i`'s engine server until `i`'s
    /// model fits its memory budget: never one with queued work more
    /// urgent than the work the load is for; first the one whose work is
    /// least urgent, then the least recently used (see the module doc).
    async fn make_room(&self, i: usize) -> Result<(), String> {
        let me = self.slot(i);
        let Some(budget) = me.budget else { return Ok(()) };
        let waiting_since = Instant::now();
        loop {
            let freed = self.inner.freed.notified();
            // The load is for the most urgent of its waiting tasks, or of
            // the model's queued ones; with neither (an `always` load),
            // for the least urgent work.
            let need = [self.lock(i).need, self.inner.waiting.best(&me.models)]
                .into_iter()
                .flatten()
                .min()
                .unwrap_or(Priority::P4);
            let mut busy = false;
            let mut used = 0u64;
            // (index, work priority, last use): the least urgent, then the
            // oldest, is unloaded first.
            let mut victim: Option<(usize, Priority, Instant)> = None;
            for (j, s) in self.inner.slots.iter().enumerate() {
                // A retired slot's model is unloaded or its successor's.
                if j == i || s.server != me.server || s.api == ModelApi::None || self.is_retired(j) {
                    continue;
                }
                let queued = self.inner.waiting.best(&s.models);
                let st = self.lock(j);
                // A load that waits for its turn has no memory yet.
                if st.state == State::Loaded || (st.state == State::Loading && st.reserved) {
                    used += s.weights;
                    let unloadable = s.class != ResidencyClass::Always;
                    // Queued work more urgent than ours keeps it.
                    let protected = queued.is_some_and(|q| q < need);
                    let idle = st.state == State::Loaded && st.users == 0 && unloadable;
                    busy |= unloadable && (protected || !idle);
                    if !idle || protected {
                        continue;
                    }
                    // A model used by none of our tasks yet counts as
                    // least urgent.
                    let work = [queued, st.last_priority].into_iter().flatten().min().unwrap_or(Priority::P4);
                    let better = victim
                        .is_none_or(|(_, w, t)| (work, std::cmp::Reverse(st.last_used)) > (w, std::cmp::Reverse(t)));
                    if better {
                        victim = Some((j, work, st.last_used));
                    }
                }
            }
            if used + me.weights <= budget {
                return Ok(());
            }
            match victim {
                Some((j, work, _)) => {
                    tracing::info!(
                        model = %self.slot(j).model,
                        work = work.as_str(),
                        for_model = %me.model,
                        for_work = need.as_str(),
                        "unloading a model to make room"
                    );
                    self.unload(j, "memory").await
                }
                // Models in use (or loading, or kept by more urgent queued
                // work) free their memory when their work ends: wait for
                // that, within the load's own limit.
                None if busy && waiting_since.elapsed() < LOAD_TIMEOUT => {
                    let _ = tokio::time::timeout(LOAD_POLL * 10, freed).await;
                }
                None => return Err("no memory: the engine's other models are always loaded or in use".into()),
            }
        }
    }

    /// Unloads instance `i`'s model (if it is loaded and unused).
    async fn unload(&self, i: usize, reason: &'static str) {
        let s = self.slot(i);
        {
            let mut st = self.lock(i);
            if st.state != State::Loaded || st.users > 0 {
                return;
            }
            // Out of dispatch from here: a task that comes now loads it
            // again after the unload.
            st.state = State::Unloaded;
            st.epoch += 1;
            st.changed_at = Instant::now();
            st.unloading = true;
            s.tx.send_replace(State::Unloaded);
        }
        let result = s.engine.unload_model().await;
        // The engine's reports from before the unload call returned are
        // stale.
        {
            let mut st = self.lock(i);
            st.unloading = false;
            st.changed_at = Instant::now();
        }
        match result {
            Ok(()) => tracing::info!(model = %s.model, engine = %s.instance, reason, "model unloaded"),
            Err(e) => tracing::warn!(model = %s.model, engine = %s.instance, reason, error = %e, "model unload failed"),
        }
        if let Some(m) = self.metrics() {
            m.unloads.with_label_values(&[&s.model, &s.instance, reason]).inc();
        }
        if s.class == ResidencyClass::Forbidden {
            self.lock(i).state = State::Forbidden;
        }
        self.show(i);
    }

    /// What a health probe read from the engine about instance `i`'s
    /// model: a model the engine dropped (llama-server's own
    /// `--models-max` eviction, Ollama's `keep_alive`, a crash) is
    /// unloaded here too, and an `always` one is loaded again; one the
    /// engine has loaded by itself counts as loaded.
    /// `probed_at`: when the probe asked (a report older than the last
    /// change is ignored).
    pub fn observe(&self, i: usize, resident: bool, probed_at: Instant) {
        let s = self.slot(i);
        if s.api == ModelApi::None || self.is_retired(i) {
            return;
        }
        let changed = {
            let mut st = self.lock(i);
            if probed_at < st.changed_at || st.unloading {
                return;
            }
            st.changed_at = Instant::now();
            match (st.state, resident) {
                (State::Loaded, false) if st.users == 0 => {
                    st.state = State::Unloaded;
                    st.epoch += 1;
                    true
                }
                (State::Unloaded, true) => {
                    st.state = State::Loaded;
                    st.last_used = Instant::now();
                    true
                }
                _ => false,
            }
        };
        if !changed {
            return;
        }
        let now = self.state(i);
        s.tx.send_replace(now);
        tracing::info!(model = %s.model, engine = %s.instance, state = now.as_str(), "the engine changed the model's residency");
        if now == State::Unloaded {
            if let Some(m) = self.metrics() {
                m.unloads.with_label_values(&[&s.model, &s.instance, "engine"]).inc();
            }
        }
        self.show(i);
        match (now, s.class) {
            (State::Unloaded, ResidencyClass::Always) => self.begin_load(i, "dropped by the engine"),
            (State::Loaded, ResidencyClass::Forbidden) => {}
            (State::Loaded, _) => {
                // Loaded by someone else: it goes idle like our own.
                self.lock(i).users += 1;
                self.release(i);
            }
            _ => {}
        }
    }

    fn metrics(&self) -> Option<ResidencyMetrics> {
        self.inner.metrics.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn show(&self, i: usize) {
        let s = self.slot(i);
        if let Some(m) = self.metrics() {
            m.resident.with_label_values(&[&s.model, &s.instance]).set(i64::from(self.state(i) == State::Loaded));
        }
    }

    /// The class of the models on instance `i`.
    pub fn class(&self, i: usize) -> ResidencyClass {
        self.slot(i).class
    }

    /// Stops on `Ok(())` once instance `i`'s model is loaded (tests,
    /// readiness); `false` if `timeout` passes first.
    pub async fn wait_loaded(&self, i: usize, timeout: Duration) -> bool {
        let mut rx = self.slot(i).tx.subscribe();
        tokio::time::timeout(timeout, rx.wait_for(|s| *s == State::Loaded)).await.is_ok_and(|r| r.is_ok())
    }
}

/// Polls `state` until it says loaded (`Ok`), failed or unloaded after
/// having started (`Err`), for engines whose load call returns at once.
pub(crate) async fn await_loaded<F, Fut>(mut state: F) -> Result<(), EngineError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<ModelState, EngineError>>,
{
    let mut seen_loading = false;
    let mut unloaded_polls = 0u32;
    loop {
        match state().await? {
            ModelState::Loaded => return Ok(()),
            ModelState::Failed if seen_loading => {
                return Err(EngineError::Remote("the engine could not load the model".into()))
            }
            ModelState::Loading => seen_loading = true,
            // Right after the load call the engine may not show it as
            // loading yet; unloaded after loading is a failed load.
            ModelState::Unloaded if seen_loading => {
                return Err(EngineError::Remote("the engine stopped loading the model".into()))
            }
            // (Failed: an earlier load's outcome, until this one starts.)
            ModelState::Unloaded | ModelState::Failed => {
                unloaded_polls += 1;
                if unloaded_polls > 50 {
                    return Err(EngineError::Remote("the engine did not start loading the model".into()));
                }
            }
        }
        tokio::time::sleep(LOAD_POLL).await;
    }
}
