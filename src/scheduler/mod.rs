//! The scheduler: the one owner of queues and engine slots.
//!
//! It is an actor (`Actor::run`) fed by `Cmd` messages through a
//! [`SchedulerHandle`]. Ingresses submit a [`TaskRequest`] and get a
//! [`TaskStream`] of events; they never touch queues. Each accepted task is
//! carried by its own driver task (`driver.rs`) that waits for a slot, runs
//! the engine request under the layered timeouts and reports the events.
//!
//! Owns: the per-model bounded queues (priority, then arrival), the slots of
//! every engine instance (`max_concurrency`), what instance health and engine
//! self-reports (busy slots, KV-cache usage, model residency) mean for
//! dispatch as the router's probes and breakers pass them on, where a task
//! may run (its fallback chain under its data class, see `policy.rs`),
//! preemption of low-priority work for P0 tasks (`preempt.rs`), and the
//! life of each task from QUEUED to its end (deadlines, attempts and
//! retries before the first token, events, the record). Does not own:
//! validation and identity (admission), the engine request itself and what an
//! engine failure means for the client (the router), or wire formats
//! (ingress).
//!
//! # Cancel safety
//! A slot is a [`SlotLease`]: whoever drops it frees the slot, so a driver
//! that is cancelled, times out or panics can never leak one. Dropping a
//! [`TaskStream`] cancels its task (unless it was detached).

pub mod affinity;
pub mod cache;
mod driver;
pub mod policy;
mod preempt;
pub mod registry;

use std::collections::HashMap;
use std::sync::Arc;

use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::Config;
use crate::engine::EngineLoad;
use crate::error::{ErrorCode, GatewayError};
use crate::router::breaker::BreakerState;
use crate::router::{InstanceEvent, Router};
use crate::task::{FallbackStep, Priority, TaskEvent, TaskRequest, TaskState};
use crate::telemetry::lifecycle::Recorder;
use crate::telemetry::Metrics;
use policy::{Admission, Backpressure, InstancePolicy, ModelPolicy, Passed, Policy, PolicyConfig, TaskInfo};
use preempt::Preempt;
use registry::{Registry, Subscription, TaskEntry, TaskLog};

/// Permission to run one task on one instance. Dropping it frees the slot.
pub struct SlotLease {
    pub task_id: String,
    /// The router's index of the instance.
    pub instance: usize,
    pub instance_name: String,
    pub engine_model: String,
    /// The logical model the task runs as (a smaller one after a fallback).
    pub model: String,
    /// The step of the fallback chain the slot belongs to.
    pub step: FallbackStep,
    /// What decided the instance among the step's candidates.
    pub decided_by: &'static str,
    /// The output budget on this step.
    pub max_output_tokens: u32,
    /// Steps the task was moved past while it waited.
    pub passed: Vec<Passed>,
    /// The engine slot to use (`id_slot`), on an instance with slot
    /// affinity (`affinity.rs`).
    pub slot: Option<u32>,
    /// Output tokens the task produced (refunds its token-rate charge).
    pub output_tokens: u64,
    tx: mpsc::UnboundedSender<Cmd>,
    armed: bool,
}

impl SlotLease {
    /// The slot is given back another way (a re-queue frees it).
    fn disarm(&mut self) {
        self.armed = false;
    }
}

impl Drop for SlotLease {
    fn drop(&mut self) {
        if self.armed {
            let _ = self
                .tx
                .send(Cmd::Release { task_id: std::mem::take(&mut self.task_id), output_tokens: self.output_tokens });
        }
    }
}

/// Why a task is being cancelled; the first reason given wins.
#[derive(Clone, Default)]
pub struct CancelHandle {
    token: CancellationToken,
    reason: Arc<std::sync::OnceLock<(String, &'static str)>>,
}

impl CancelHandle {
    fn new(token: CancellationToken) -> Self {
        CancelHandle { token, reason: Default::default() }
    }

    /// Cancels with a reason for the record and the actor that caused it.
    pub fn cancel(&self, reason: impl Into<String>, actor: &'static str) {
        let _ = self.reason.set((reason.into(), actor));
        self.token.cancel();
    }

    pub fn is_cancelled(&self) -> bool {
        self.token.is_cancelled()
    }

    fn reason(&self) -> (String, &'static str) {
        self.reason.get().cloned().unwrap_or_else(|| ("client went away".into(), "client"))
    }
}

/// What a client holds while its task lives: the events, in order, and
/// (for the submitter) the power to cancel by dropping.
pub struct TaskStream {
    pub task_id: String,
    pub request_id: String,
    /// The task's trace id (empty for the replay of a task recorded
    /// before trace ids).
    pub trace_id: String,
    pub queue_position: usize,
    /// True when this stream joined a task that an earlier call started
    /// (same idempotency key or request id).
    pub joined: bool,
    events: Subscription,
    cancel: CancelHandle,
    /// Dropping the stream cancels the task.
    owner: bool,
}

impl TaskStream {
    /// The next event with its sequence number; `None` after the terminal
    /// event.
    ///
    /// # Cancel safety
    /// Cancel safe: no event is lost if the future is dropped.
    pub async fn recv(&mut self) -> Option<(u64, TaskEvent)> {
        self.events.recv().await
    }

    /// Keeps the task running after this stream is dropped.
    pub fn detach(&mut self) {
        self.owner = false;
    }

    /// Whether dropping this stream cancels the task (not after
    /// [`TaskStream::detach`], nor for a stream attached to a running task).
    pub fn cancels_on_drop(&self) -> bool {
        self.owner
    }

    pub fn cancel_handle(&self) -> CancelHandle {
        self.cancel.clone()
    }
}

impl Drop for TaskStream {
    fn drop(&mut self) {
        if self.owner {
            self.cancel.cancel("client went away", "client");
        }
    }
}

/// What [`SchedulerHandle::submit`] did with a task.
pub enum Submitted {
    /// Queued: its events, starting with `Accepted`.
    New(TaskStream),
    /// Not queued: a known task has the same idempotency key (same tenant
    /// and application).
    Known(Arc<TaskEntry>),
}

/// Undoes a submit whose caller went away before the actor answered: the
/// registry forgets the task and the actor withdraws it (the Withdraw
/// follows the Enqueue on the same channel; a grant already made finds its
/// receiver gone and frees the slot).
struct Unqueued<'a> {
    handle: &'a SchedulerHandle,
    /// `None` once the actor has answered.
    task_id: Option<String>,
}

impl Drop for Unqueued<'_> {
    fn drop(&mut self) {
        if let Some(task_id) = self.task_id.take() {
            self.handle.shared.registry.remove(&task_id);
            let _ = self.handle.tx.send(Cmd::Withdraw { task_id });
        }
    }
}

/// What a waiting task's driver receives.
enum SlotGrant {
    Slot(SlotLease),
    /// No engine step can take it any more: the model's canned answer, with
    /// the steps passed over.
    Canned(Vec<Passed>),
    /// The reason it will never get a slot.
    Refused(GatewayError),
    /// The gateway is stopping: the task leaves the queue unrecorded, to be
    /// queued again at the next start (it is idempotent and never started;
    /// the store still holds its request).
    Parked,
}

enum Cmd {
    Enqueue {
        info: TaskInfo,
        /// The logical model's name (`info.model` is resolved from it).
        model: String,
        grant: oneshot::Sender<SlotGrant>,
        reply: oneshot::Sender<Result<Admission, GatewayError>>,
        /// Where its `queued` position updates go.
        log: TaskLog,
        preempt: Arc<Preempt>,
        /// It may be parked at shutdown (idempotent, never started).
        parkable: bool,
    },
    /// The gateway is stopping: every waiting task that can be queued
    /// again at the next start leaves the queue ([`SlotGrant::Parked`]),
    /// or with `park: false` is only named; answers their ids.
    Park {
        park: bool,
        reply: oneshot::Sender<Vec<String>>,
    },
    /// A running task goes back to the front of its queue: an attempt
    /// failed before any output (`avoid`: the instance it failed on), or
    /// it was preempted.
    Requeue {
        task_id: String,
        avoid: Option<usize>,
        /// An embedding list that has answered inputs already: a failed
        /// attempt is not moved to another model of the chain (its vectors
        /// would mix two vector spaces), only to another instance of its
        /// model or the same one again.
        pinned: bool,
        grant: oneshot::Sender<SlotGrant>,
        log: TaskLog,
        preempt: Arc<Preempt>,
    },
    /// A running task asked to give up its slot for a P0 task declined:
    /// its output had been seen.
    PreemptDeclined {
        task_id: String,
    },
    /// A running task has its first token: its prompt left prefill (the
    /// long-prompt lane).
    Prefilled {
        task_id: String,
    },
    Withdraw {
        task_id: String,
    },
    Release {
        task_id: String,
        output_tokens: u64,
    },
    Health {
        instance: usize,
        up: bool,
        /// Down only while its engine process restarts: work waits for it.
        restarting: bool,
        detail: String,
    },
    Danger {
        reason: Option<String>,
    },
    /// The limits and routes of a reloaded configuration; `retired`: the
    /// instances it no longer has (no new work, kept down).
    Limits {
        limits: policy::Limits,
        retired: Vec<usize>,
        /// Every model the policy knows, by index, and whether the
        /// configuration in force still has it.
        models: Vec<(String, bool)>,
    },
    /// Answer once the instance runs no task.
    WhenIdle {
        instance: usize,
        reply: oneshot::Sender<()>,
    },
    /// What a healthy engine says about itself (from the probe).
    EngineState {
        instance: usize,
        load: EngineLoad,
        model_resident: Option<bool>,
        error_rate: f64,
        ttft_p95_ms: Option<u64>,
    },
    Breaker {
        instance: usize,
        state: BreakerState,
        reason: String,
    },
    /// A cancelled request's grace period is over: is the engine still busy?
    GraceCheck {
        instance: usize,
        busy: usize,
    },
    Snapshot {
        reply: oneshot::Sender<Snapshot>,
    },
}

/// A view of the scheduler for `/ready` and tests.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Snapshot {
    pub instances: Vec<InstanceSnapshot>,
    pub queues: Vec<QueueSnapshot>,
    /// 0 normal; 1 a primary instance is unavailable and alternates serve;
    /// 2 only smaller models or canned answers remain for some model; 3
    /// some model gets busy answers only.
    pub degradation_level: u8,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct InstanceSnapshot {
    pub name: String,
    pub up: bool,
    pub detail: String,
    pub running: usize,
    pub max_concurrency: usize,
    /// KV-cache usage (0..=1) the engine last reported, if it reports one.
    pub kv_cache_usage: Option<f64>,
    /// Whether that usage is at the high-water mark: new work then waits
    /// while the instance runs any of ours.
    pub kv_cache_full: bool,
    pub location: &'static str,
    /// Its circuit breaker: `CLOSED`, `OPEN` or `HALF_OPEN`, and why it is
    /// in that state.
    pub breaker: BreakerState,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub breaker_reason: Option<String>,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct QueueSnapshot {
    pub model: String,
    pub waiting: usize,
    pub capacity: usize,
}

struct Shared {
    config: Arc<Config>,
    /// `[timeouts] first_token` of the configuration in force, ms (a
    /// reload changes it: [`SchedulerHandle::set_limits`]): the driver
    /// tells the gateway's own first-token limit from a caller's by it.
    first_token_default_ms: std::sync::atomic::AtomicU64,
    router: Arc<Router>,
    recorder: Recorder,
    metrics: Arc<Metrics>,
    tracker: TaskTracker,
    shutdown: CancellationToken,
    /// Live and recently ended tasks.
    registry: Registry,
    /// The policy's models by index: those of the start, then those
    /// reloads added (a removed one keeps its index).
    model_names: std::sync::Mutex<Vec<String>>,
    /// The instance in force for each engine of the configuration in
    /// force, by name (a changed engine's new one).
    live: std::sync::Mutex<HashMap<String, usize>>,
    /// Answers of deterministic calls, served again to their repeats.
    cache: cache::ResponseCache,
}

/// What the policy knows of a model of `config`; `instances` and `models`
/// give the index of an engine and of a model by name.
fn model_policy(
    m: &crate::config::ModelConfig,
    config: &Config,
    instances: &HashMap<&str, usize>,
    models: &[String],
) -> ModelPolicy {
    ModelPolicy {
        name: m.name.clone(),
        queue_capacity: m.queue_capacity,
        max_running: m.max_running,
        instances: m.instances.iter().filter_map(|n| instances.get(n.as_str()).copied()).collect(),
        kv_bytes_per_token: m.kv_bytes_per_token,
        weights_bytes: m.weights_bytes,
        memory_margin: m.memory_margin,
        fallback_models: m
            .fallback_models
            .iter()
            .filter(|f| config.models.contains_key(*f))
            .filter_map(|f| models.iter().position(|k| k == f))
            .collect(),
        canned: m.canned_answer.is_some(),
        context_tokens: m.context_tokens,
        max_output_tokens: m.max_output_tokens,
        residency: m.residency.clone(),
    }
}

/// What the policy knows of an engine instance.
fn instance_policy(e: &crate::config::EngineConfig) -> InstancePolicy {
    InstancePolicy {
        name: e.name.clone(),
        max_concurrency: e.max_concurrency,
        reserved_realtime_slots: e.reserved_realtime_slots,
        memory_budget_bytes: e.memory_budget_bytes,
        location: e.location,
        max_data_class: e.max_data_class,
        cost: e.cost_per_1k_tokens,
        max_prefill_tokens: e.max_prefill_tokens.map(u64::from),
        long_prompt_tokens: e.long_prompt_tokens,
        slot_affinity: e.slot_affinity,
    }
}

impl Shared {
    /// `[timeouts] first_token` in force now.
    fn first_token_default(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.first_token_default_ms.load(std::sync::atomic::Ordering::Relaxed))
    }
}

/// The way into the scheduler. Cheap to clone.
#[derive(Clone)]
pub struct SchedulerHandle {
    tx: mpsc::UnboundedSender<Cmd>,
    shared: Arc<Shared>,
}

/// Starts the scheduler actor and the router's health probes, which feed
/// it. Drivers are spawned on `tracker`; all stop when `shutdown` is
/// cancelled.
pub fn start(
    config: Arc<Config>,
    router: Arc<Router>,
    recorder: Recorder,
    metrics: Arc<Metrics>,
    tracker: TaskTracker,
    shutdown: CancellationToken,
) -> SchedulerHandle {
    let (tx, rx) = mpsc::unbounded_channel();
    let instances = router.instances();
    let index: HashMap<&str, usize> = instances.iter().enumerate().map(|(i, x)| (x.name.as_str(), i)).collect();
    let model_names: Vec<String> = config.models.keys().cloned().collect();
    let models: Vec<ModelPolicy> =
        config.models.values().map(|m| model_policy(m, &config, &index, &model_names)).collect();
    let policy = Policy::new(PolicyConfig {
        instances: instances.iter().map(|i| instance_policy(&config.engines[&i.name])).collect(),
        apps: config.applications.values().map(|a| (a.name.clone(), a.limits.clone())).collect(),
        tenant_weights: config.tenant_weights.clone(),
        max_queued: config.scheduler.max_queued,
        max_running: config.scheduler.max_running,
        aging: config.scheduler.priority_aging,
        backpressure: Backpressure {
            capped_output_tokens: config.scheduler.overload_max_output_tokens,
            ..Backpressure::default()
        },
        busy_retry_after_ms: config.scheduler.busy_retry_after_ms,
        kv_cache_high_water: config.kv_cache_high_water,
        allow_cloud: config.routing.allow_cloud,
        preemption: config.scheduler.preemption,
        admit_at_level: config.routing.admit_at_level,
        max_tracked_users: config.scheduler.max_tracked_users,
        models,
    });
    let shared = Arc::new(Shared {
        config: config.clone(),
        first_token_default_ms: (config.timeouts.first_token.as_millis() as u64).into(),
        router: router.clone(),
        recorder,
        metrics: metrics.clone(),
        tracker: tracker.clone(),
        shutdown: shutdown.clone(),
        registry: Registry::new(config.scheduler.replay_retention, config.scheduler.replay_max_bytes),
        model_names: std::sync::Mutex::new(model_names),
        live: std::sync::Mutex::new(index.iter().map(|(n, &i)| (n.to_string(), i)).collect()),
        cache: cache::ResponseCache::new(&metrics.registry),
    });
    let actor = Actor {
        model_index: config.models.keys().enumerate().map(|(i, n)| (n.clone(), i)).collect(),
        details: instances.iter().map(|_| "not checked yet".to_string()).collect(),
        breaker_reasons: instances.iter().map(|_| None).collect(),
        running: HashMap::new(),
        router: router.clone(),
        policy,
        grants: HashMap::new(),
        queue_updates: config.scheduler.queue_updates,
        tx: tx.clone(),
        metrics: metrics.clone(),
        epoch: std::time::Instant::now(),
        retired: Default::default(),
        idle_waiters: Vec::new(),
        waiting_work: router.residency().waiting_work(),
        granted: HashMap::new(),
    };
    tracker.spawn(actor.run(rx, shutdown.clone()));
    for inst in router.instances() {
        metrics.running.with_label_values(&[&inst.name]).set(0);
        metrics.engine_unreleased.with_label_values(&[&inst.name]).set(0);
    }
    let probe_tx = tx.clone();
    let sink = Arc::new(move |e: InstanceEvent| {
        let _ = probe_tx.send(match e {
            InstanceEvent::Health { instance, up, restarting, detail } => {
                Cmd::Health { instance, up, restarting, detail }
            }
            InstanceEvent::Load { instance, load, model_resident, error_rate, ttft_p95_ms } => {
                Cmd::EngineState { instance, load, model_resident, error_rate, ttft_p95_ms }
            }
            InstanceEvent::Breaker { instance, state, reason } => Cmd::Breaker { instance, state, reason },
        });
    });
    router.start_probes(&tracker, &shutdown, metrics.clone(), sink);
    SchedulerHandle { tx, shared }
}

impl SchedulerHandle {
    /// Queues a validated task. Answers at once: `QUEUE_FULL` or
    /// `MODEL_UNAVAILABLE` when it cannot be queued, else a stream of its
    /// events (starting with `Accepted`).
    ///
    /// A task whose idempotency key (per tenant and application) is already
    /// known is not started again: the known task is handed back
    /// ([`Submitted::Known`]) for the gateway to judge, as it judges every
    /// repeat. The check and the insert are one step under the registry's
    /// lock, so two racing first calls start one task.
    ///
    /// # Cancel safety
    /// Dropping the future before it answers leaves nothing behind: the
    /// task leaves the registry and is withdrawn from its queue (its driver
    /// never starts, so nothing is recorded past what the caller recorded).
    pub async fn submit(&self, req: TaskRequest) -> Result<Submitted, GatewayError> {
        self.submit_with(req, "admitted", cache::Lookup::Off).await
    }

    /// [`SchedulerHandle::submit`] with what the facade found out about the
    /// call for the response cache: a fresh answer for its key is served at
    /// once, without a queue or an engine (recorded and streamed as any
    /// answer); otherwise the key goes with the task, so that its answer
    /// is stored and the routing chain's cached step can find an older one.
    pub async fn submit_cached(&self, req: TaskRequest, lookup: cache::Lookup) -> Result<Submitted, GatewayError> {
        self.submit_with(req, "admitted", lookup).await
    }

    /// Queues a task again that was waiting when the gateway stopped (see
    /// `gateway::recover`). Nobody holds its stream until a client attaches.
    pub async fn resubmit(&self, req: TaskRequest) -> Result<(), GatewayError> {
        match self.submit_with(req, "re-queued after a gateway restart", cache::Lookup::Off).await? {
            Submitted::New(mut s) => {
                s.detach();
                Ok(())
            }
            Submitted::Known(e) => {
                Err(GatewayError::invalid(format!("its idempotency key belongs to task {} already", e.task_id)))
            }
        }
    }

    /// Drops the response cache's answers stored by `tenant`'s `user`
    /// (a deletion of the user's data); how many went.
    pub fn forget_cached_answers_of(&self, tenant: &str, user: &str) -> usize {
        self.shared.cache.forget_user(tenant, user)
    }

    /// A stream that replays a finished task's outcome (from the store,
    /// after its live events are gone).
    pub fn replay(&self, task_id: &str, request_id: &str, trace_id: &str, events: Vec<TaskEvent>) -> TaskStream {
        let log = TaskLog::default();
        for e in events {
            log.push(e);
        }
        TaskStream {
            task_id: task_id.to_string(),
            request_id: request_id.to_string(),
            trace_id: trace_id.to_string(),
            queue_position: 0,
            joined: true,
            events: log.subscribe(0),
            cancel: CancelHandle::default(),
            owner: false,
        }
    }

    async fn submit_with(
        &self,
        req: TaskRequest,
        queued_reason: &str,
        lookup: cache::Lookup,
    ) -> Result<Submitted, GatewayError> {
        // A forwarded task's record names the node it came from, and its
        // task there (the request id a forward carries).
        let forwarded;
        let queued_reason = match &req.routing.forwarded_from {
            Some(node) => {
                forwarded = format!("{queued_reason}; forwarded from node {node}, task {}", req.request_id);
                forwarded.as_str()
            }
            None => queued_reason,
        };
        let cancel = CancelHandle::new(self.shared.shutdown.child_token());
        let log = TaskLog::default();
        let entry = Arc::new(TaskEntry {
            task_id: req.task_id.clone(),
            request_id: req.request_id.clone(),
            trace_id: req.trace_id.clone(),
            tenant: req.identity.tenant.clone(),
            application: req.identity.application.clone(),
            ingress: req.ingress,
            idempotency_key: req.idempotency_key.clone(),
            prompt_sha256: req.prompt_sha256.clone(),
            priority: req.priority,
            logical_model: req.logical_model.clone(),
            created: std::time::Instant::now(),
            credential: req.identity.credential,
            log: log.clone(),
            cancel: cancel.clone(),
        });
        if let Err(existing) = self.shared.registry.insert_or_get(entry) {
            return Ok(Submitted::Known(existing));
        }
        let cache_key = match lookup {
            cache::Lookup::Off => None,
            cache::Lookup::Bypass(why) => {
                self.shared.cache.bypassed(why);
                None
            }
            cache::Lookup::Key(k) => Some(k),
        };
        // A fresh answer: no queue, no slot, no policy (nothing runs).
        if let Some(hit) = cache_key.as_ref().and_then(|k| self.shared.cache.fresh(k)) {
            return Ok(self.answer_from_cache(req, log, cancel, cache_key, hit, queued_reason));
        }
        let mut unqueued = Unqueued { handle: self, task_id: Some(req.task_id.clone()) };

        let (grant_tx, grant_rx) = oneshot::channel();
        let (reply_tx, reply_rx) = oneshot::channel();
        let info = TaskInfo {
            task_id: req.task_id.clone(),
            model: usize::MAX, // resolved by the actor from the name below
            requested: usize::MAX,
            priority: req.priority,
            tenant: req.identity.tenant.clone(),
            app: req.identity.application.clone(),
            user: req.identity.user_id.clone().unwrap_or_default(),
            input_tokens: req.input_tokens_estimate,
            max_output_tokens: req.max_output_tokens,
            class: req.data_class,
            allow_smaller: req.allow_smaller_model,
            affinity: req.session_id.clone(),
            forwarded: req.routing.forwarded_from.is_some(),
        };
        let closed =
            || GatewayError::new(ErrorCode::ModelUnavailable, "the gateway is shutting down").with_retry_after(1000);
        let preempt = Arc::new(Preempt::default());
        let cmd = Cmd::Enqueue {
            info,
            model: req.logical_model.clone(),
            grant: grant_tx,
            reply: reply_tx,
            log: log.clone(),
            preempt: preempt.clone(),
            parkable: req.idempotency_key.is_some(),
        };
        let queued = match self.tx.send(cmd) {
            Ok(()) => reply_rx.await.map_err(|_| closed()).and_then(|r| r),
            Err(_) => Err(closed()),
        };
        unqueued.task_id = None;
        let admission = match queued {
            Ok(a) => a,
            // No engine step can take it now: the routing chain's cached
            // step, when the cache has an answer however old (within
            // `stale_ttl_s`).
            Err(e) if e.code == ErrorCode::ModelUnavailable && cache_key.is_some() => {
                match cache_key.as_ref().and_then(|k| self.shared.cache.stale(k)) {
                    Some(hit) => {
                        let why = format!("{queued_reason}; no engine step can take it: {}", e.message);
                        return Ok(self.answer_from_cache(req, log, cancel, cache_key, hit, &why));
                    }
                    None => {
                        self.shared.registry.remove(&req.task_id);
                        return Err(e);
                    }
                }
            }
            Err(e) => {
                self.shared.registry.remove(&req.task_id);
                return Err(e);
            }
        };
        let queue_position = admission.position;
        let mut req = req;
        req.max_output_tokens = admission.max_output_tokens;
        if let Some(why) = admission.degrade_reason {
            req.degrade_reason = Some(why);
        }
        if let Some(f) = admission.queue_wait_factor {
            req.timeouts.queue = req.timeouts.queue.mul_f64(f);
        }
        let stream = TaskStream {
            task_id: req.task_id.clone(),
            request_id: req.request_id.clone(),
            trace_id: req.trace_id.clone(),
            queue_position,
            joined: false,
            events: log.subscribe(0),
            cancel: cancel.clone(),
            owner: true,
        };
        // Per the call's class (review 16 M5: one class with `store_text =
        // false` made every class lose its answer text).
        let keep_text = self.shared.recorder.store().stores_text(req.data_class) || req.idempotency_key.is_some();
        let model_name = &self.shared.config.models.keys().nth(admission.model).cloned().unwrap_or_default();
        let mut reason = queued_reason.to_string();
        if admission.step != FallbackStep::SameModel {
            reason = format!("{reason}; fallback step {} ({})", admission.step.as_str(), model_name);
        }
        for p in &admission.passed {
            reason.push_str(&format!("; passed {}: {}", p.step.as_str(), p.detail));
        }
        if let Some(lane) = &admission.lane {
            reason.push_str(&format!("; {lane}"));
        }
        if admission.step != FallbackStep::SameModel {
            let passed: Vec<&str> = admission.passed.iter().map(|p| p.step.as_str()).collect();
            tracing::info!(
                stage = "fallback",
                step = admission.step.as_str(),
                model = %model_name,
                passed = %passed.join(","),
                "fallback step taken at admission"
            );
        }
        if let Some(last) = admission.passed.last() {
            if admission.step != FallbackStep::SameModel {
                self.shared
                    .metrics
                    .fallbacks
                    .with_label_values(&[&req.logical_model, admission.step.as_str(), last.why])
                    .inc();
            }
        }
        let d = driver::Driver {
            req,
            shared: self.shared.clone(),
            tx: self.tx.clone(),
            log,
            cancel,
            keep_text,
            queued_reason: reason,
            admission: driver::Admitted { step: admission.step, passed: admission.passed },
            preempt,
            parked: Default::default(),
            cache_key,
            cached: None,
        };
        d.accept();
        let span = crate::telemetry::trace::task_span(&d.req.trace_id, Some(&d.req.task_id), Some(&d.req.request_id));
        self.shared.tracker.spawn(tracing::Instrument::instrument(d.run(grant_rx), span));
        Ok(Submitted::New(stream))
    }

    /// Starts the driver of a task answered from the cache (`hit`): it
    /// never queues, so it is `Accepted` at position 0 here and its driver
    /// streams the answer at once. `reason` is recorded with QUEUED.
    fn answer_from_cache(
        &self,
        req: TaskRequest,
        log: TaskLog,
        cancel: CancelHandle,
        cache_key: Option<cache::CacheKey>,
        hit: cache::Hit,
        reason: &str,
    ) -> Submitted {
        log.push(TaskEvent::Accepted { task_id: req.task_id.clone(), queue_position: 0 });
        let stream = TaskStream {
            task_id: req.task_id.clone(),
            request_id: req.request_id.clone(),
            trace_id: req.trace_id.clone(),
            queue_position: 0,
            joined: false,
            events: log.subscribe(0),
            cancel: cancel.clone(),
            owner: true,
        };
        // Per the call's class (review 16 M5: one class with `store_text =
        // false` made every class lose its answer text).
        let keep_text = self.shared.recorder.store().stores_text(req.data_class) || req.idempotency_key.is_some();
        let kind = if hit.stale { "stale" } else { "fresh" };
        let d = driver::Driver {
            req,
            shared: self.shared.clone(),
            tx: self.tx.clone(),
            log,
            cancel,
            keep_text,
            queued_reason: format!("{reason}; answered from the response cache ({kind})"),
            admission: driver::Admitted { step: FallbackStep::Cached, passed: Vec::new() },
            preempt: Arc::new(Preempt::default()),
            parked: Default::default(),
            cache_key,
            cached: Some(hit),
        };
        d.accept();
        let span = crate::telemetry::trace::task_span(&d.req.trace_id, Some(&d.req.task_id), Some(&d.req.request_id));
        // No slot will be granted: the sender is dropped at once, and the
        // driver never waits on it.
        let (_, grant_rx) = oneshot::channel();
        self.shared.tracker.spawn(tracing::Instrument::instrument(d.run(grant_rx), span));
        Submitted::New(stream)
    }

    /// Attaches to a known task from event `from_seq` on, without owning it
    /// (dropping the stream does not cancel the task).
    pub fn attach(&self, task_id: &str, from_seq: u64) -> Option<TaskStream> {
        let e = self.shared.registry.get(task_id)?;
        Some(Self::join(&e, from_seq))
    }

    fn join(e: &TaskEntry, from_seq: u64) -> TaskStream {
        TaskStream {
            task_id: e.task_id.clone(),
            request_id: e.request_id.clone(),
            trace_id: e.trace_id.clone(),
            queue_position: 0,
            joined: true,
            events: e.log.subscribe(from_seq),
            cancel: e.cancel.clone(),
            owner: false,
        }
    }

    /// A known task of this tenant and application that came through
    /// `ingress`, by its request id.
    pub fn find_by_request(
        &self,
        tenant: &str,
        app: &str,
        ingress: crate::task::Ingress,
        request_id: &str,
    ) -> Option<Arc<TaskEntry>> {
        self.shared.registry.by_request(tenant, app, ingress, request_id)
    }

    /// A known task of this tenant and application by its idempotency key.
    pub fn find_by_idempotency_key(&self, tenant: &str, app: &str, key: &str) -> Option<Arc<TaskEntry>> {
        self.shared.registry.by_idempotency_key(tenant, app, key)
    }

    /// Every live (not ended) task, for the status page.
    pub fn live_tasks(&self) -> Vec<Arc<TaskEntry>> {
        self.shared.registry.live_where(|_| true)
    }

    /// A known task (live or recently ended) by id.
    pub fn get(&self, task_id: &str) -> Option<Arc<TaskEntry>> {
        self.shared.registry.get(task_id)
    }

    /// Cancels every live task that `pred` selects (danger state, admin
    /// action); returns how many.
    pub fn cancel_where(&self, pred: impl Fn(&TaskEntry) -> bool, reason: &str) -> usize {
        let hit = self.shared.registry.live_where(pred);
        for e in &hit {
            e.cancel.cancel(reason, "gateway");
        }
        hit.len()
    }

    /// Cancels every live task with `reason` and `actor` (the end of a
    /// drain); returns how many.
    pub fn cancel_all(&self, reason: &str, actor: &'static str) -> usize {
        let hit = self.shared.registry.live_where(|_| true);
        for e in &hit {
            e.cancel.cancel(reason, actor);
        }
        hit.len()
    }

    /// Streams of every live task (not owned: dropping them cancels
    /// nothing), to wait for their ends.
    pub fn follow_live(&self) -> Vec<TaskStream> {
        self.shared.registry.live_where(|_| true).iter().map(|e| Self::join(e, 0)).collect()
    }

    /// Takes every waiting task that can be queued again at the next start
    /// (idempotent, never started) out of its queue: its stream ends with
    /// `SHUTTING_DOWN`, and nothing is recorded, so the store keeps it
    /// QUEUED with its request, as after a crash. Returns how many.
    pub async fn park_waiting(&self) -> usize {
        let (tx, rx) = oneshot::channel();
        if self.tx.send(Cmd::Park { park: true, reply: tx }).is_err() {
            return 0;
        }
        rx.await.map(|ids| ids.len()).unwrap_or(0)
    }

    /// Cancels, with `reason` and actor `shutdown`, every waiting task that
    /// [`Self::park_waiting`] would park: for a stop that cannot keep its
    /// promise to run them at the next start (a store that cannot write).
    /// Returns how many.
    pub async fn cancel_parkable(&self, reason: &str) -> usize {
        let (tx, rx) = oneshot::channel();
        if self.tx.send(Cmd::Park { park: false, reply: tx }).is_err() {
            return 0;
        }
        let ids = rx.await.unwrap_or_default();
        ids.iter().filter(|id| self.cancel(id, reason, "shutdown")).count()
    }

    /// Cancels a live task by id. Returns false if it is not running here.
    pub fn cancel(&self, task_id: &str, reason: &str, actor: &'static str) -> bool {
        match self.shared.registry.get(task_id) {
            Some(e) if !e.log.is_ended() => {
                e.cancel.cancel(reason, actor);
                true
            }
            _ => false,
        }
    }

    pub async fn snapshot(&self) -> Option<Snapshot> {
        let (tx, rx) = oneshot::channel();
        self.tx.send(Cmd::Snapshot { reply: tx }).ok()?;
        rx.await.ok()
    }

    /// Takes the limits of a reloaded configuration (applications, users,
    /// tenants, models, the global bounds and aging) for the next
    /// admissions and grants; see [`policy::Policy::set_limits`].
    /// `added` are the instances the router added for this configuration
    /// (engines added or changed), with their index. Engines that left
    /// the configuration, and the instances a changed engine replaced, get
    /// no new work from now on (see [`SchedulerHandle::when_idle_at`]);
    /// models that left it take no new work, and their queued and running
    /// work finishes. Returns the instances retired, by name and index.
    pub fn set_limits(&self, config: &Config, added: &[(String, usize)]) -> Vec<(String, usize)> {
        let mut live = self.shared.live.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut names = self.shared.model_names.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut index: HashMap<String, usize> = HashMap::new();
        for name in config.engines.keys() {
            let i = added.iter().find(|(n, _)| n == name).map(|(_, i)| *i).or_else(|| live.get(name).copied());
            if let Some(i) = i {
                index.insert(name.clone(), i);
            }
        }
        let retired: Vec<(String, usize)> =
            live.iter().filter(|(n, i)| index.get(*n) != Some(*i)).map(|(n, i)| (n.clone(), *i)).collect();
        for name in config.models.keys() {
            if !names.contains(name) {
                names.push(name.clone());
            }
        }
        let by_name: HashMap<&str, usize> = index.iter().map(|(n, &i)| (n.as_str(), i)).collect();
        let mut added_instances: Vec<(usize, InstancePolicy)> =
            added.iter().map(|(n, i)| (*i, instance_policy(&config.engines[n]))).collect();
        added_instances.sort_by_key(|(i, _)| *i);
        let limits = policy::Limits {
            added_instances,
            models: names
                .iter()
                .map(|n| config.models.get(n).map(|m| model_policy(m, config, &by_name, &names)))
                .collect(),
            apps: config.applications.values().map(|a| (a.name.clone(), a.limits.clone())).collect(),
            tenant_weights: config.tenant_weights.clone(),
            max_queued: config.scheduler.max_queued,
            max_running: config.scheduler.max_running,
            aging: config.scheduler.priority_aging,
            busy_retry_after_ms: config.scheduler.busy_retry_after_ms,
        };
        let models: Vec<(String, bool)> = names.iter().map(|n| (n.clone(), config.models.contains_key(n))).collect();
        let _ = self.tx.send(Cmd::Limits { limits, retired: retired.iter().map(|(_, i)| *i).collect(), models });
        *live = index;
        self.shared
            .first_token_default_ms
            .store(config.timeouts.first_token.as_millis() as u64, std::sync::atomic::Ordering::Relaxed);
        retired
    }

    /// The router the scheduler dispatches to (a reload adds instances to
    /// it before [`SchedulerHandle::set_limits`]).
    pub fn router(&self) -> &Arc<Router> {
        &self.shared.router
    }

    /// The instance in force for engine `name`.
    pub fn instance_of(&self, name: &str) -> Option<usize> {
        self.shared.live.lock().unwrap_or_else(std::sync::PoisonError::into_inner).get(name).copied()
    }

    /// Returns once instance `i` runs no task (at once if it runs none):
    /// an engine removed or replaced at reload has drained. `None` when
    /// the scheduler stopped first.
    pub async fn when_idle_at(&self, i: usize) -> Option<()> {
        let (tx, rx) = oneshot::channel();
        self.tx.send(Cmd::WhenIdle { instance: i, reply: tx }).ok()?;
        rx.await.ok()
    }

    /// Returns once the (first) instance named `instance` runs no task (at
    /// once if it runs none): an engine removed at reload has drained.
    /// `None` when the scheduler stopped first.
    pub async fn when_idle(&self, instance: &str) -> Option<()> {
        let i = self.shared.router.instances().iter().position(|x| x.name == instance)?;
        let (tx, rx) = oneshot::channel();
        self.tx.send(Cmd::WhenIdle { instance: i, reply: tx }).ok()?;
        rx.await.ok()
    }

    /// Enters (`Some(reason)`) or leaves (`None`) a danger state in which
    /// no new work is admitted.
    pub fn set_danger(&self, reason: Option<String>) {
        let _ = self.tx.send(Cmd::Danger { reason });
    }
}

/// A task waiting for a slot, as the actor knows it.
struct Waiter {
    grant: oneshot::Sender<SlotGrant>,
    /// Model index and priority: the queue-depth metric's labels.
    model: usize,
    priority: Priority,
    log: TaskLog,
    /// The position the task was last told.
    position: usize,
    preempt: Arc<Preempt>,
    /// Idempotent and never started: may be parked at shutdown.
    parkable: bool,
}

struct Actor {
    router: Arc<Router>,
    /// What `/ready` says of each instance: the probe's detail with the
    /// verdict it came with, or why the scheduler holds the instance out
    /// of dispatch (a cancelled request the engine did not stop).
    details: Vec<String>,
    /// Why each instance's breaker is in its state (none while closed
    /// from the start).
    breaker_reasons: Vec<Option<String>>,
    /// Running tasks' preemption handles, by id.
    running: HashMap<String, Arc<Preempt>>,
    policy: Policy,
    model_index: HashMap<String, usize>,
    /// Waiting tasks, by id.
    grants: HashMap<String, Waiter>,
    /// Period of `queued` position updates.
    queue_updates: Option<std::time::Duration>,
    tx: mpsc::UnboundedSender<Cmd>,
    metrics: Arc<Metrics>,
    /// The policy's clock starts here.
    epoch: std::time::Instant,
    /// Instances a reload removed: down for good, whatever probes say.
    retired: std::collections::HashSet<usize>,
    /// [`Cmd::WhenIdle`] callers, answered when their instance runs nothing.
    idle_waiters: Vec<(usize, oneshot::Sender<()>)>,
    /// The queued tasks per model and priority, as residency's eviction
    /// reads them (kept with the queue-depth gauge).
    waiting_work: Arc<crate::engine::residency::WaitingWork>,
    /// Granted tasks still counted in `waiting_work`: (model, priority).
    granted: HashMap<String, (String, Priority)>,
}

impl Actor {
    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Cmd>, shutdown: CancellationToken) {
        let period = self.queue_updates.unwrap_or(std::time::Duration::from_secs(3600));
        let mut updates = tokio::time::interval(period);
        updates.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let cmd = tokio::select! {
                _ = shutdown.cancelled() => break,
                c = rx.recv() => match c { Some(c) => c, None => break },
                _ = updates.tick(), if self.queue_updates.is_some() => {
                    self.send_positions();
                    continue;
                }
            };
            self.handle(cmd);
            // Drain what else is pending before dispatching once.
            while let Ok(cmd) = rx.try_recv() {
                self.handle(cmd);
            }
            self.dispatch();
            self.answer_idle_waiters();
        }
        // Waiting drivers see their grant sender dropped and end their tasks.
    }

    fn now(&self) -> std::time::Duration {
        self.epoch.elapsed()
    }

    fn handle(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Enqueue { mut info, model, grant, reply, log, preempt, parkable } => {
                let Some(&m) = self.model_index.get(&model) else {
                    let _ = reply.send(Err(GatewayError::invalid(format!("unknown model '{model}'"))));
                    return;
                };
                info.model = m;
                let (task_id, priority) = (info.task_id.clone(), info.priority);
                let now = self.now();
                let result = self.policy.enqueue(info, now);
                if let Ok(a) = &result {
                    // First in the log, before any `queued` update can be.
                    log.push(TaskEvent::Accepted { task_id: task_id.clone(), queue_position: a.position });
                    // A canned answer waits for no slot: its driver answers.
                    if a.step != FallbackStep::Canned {
                        self.inc_depth(a.model, priority);
                        let w =
                            Waiter { grant, model: a.model, priority, log, position: a.position, preempt, parkable };
                        self.grants.insert(task_id, w);
                    }
                }
                let _ = reply.send(result);
            }
            Cmd::Requeue { task_id, avoid, pinned, grant, log, preempt } => {
                let now = self.now();
                self.running.remove(&task_id);
                self.ungrant(&task_id);
                // A preemption asked after the driver gave its slot up
                // (before this message arrived) is void: the next grant
                // starts clean.
                preempt.reset();
                let Some((instance, mut m, priority)) = self.policy.requeue(&task_id, avoid, now) else {
                    // The grant sender drops: the driver ends the task.
                    return;
                };
                self.metrics.running.with_label_values(&[&self.router.instance(instance).name]).dec();
                // A failed attempt with no other instance of its step left
                // to try: the next step of the chain, if one can take it
                // (else the same instance again, after the driver's back-off).
                if avoid.is_some() && !pinned && !self.policy.has_fresh_candidate(&task_id) {
                    let detail = "an attempt failed before its first token and no other instance of the step serves";
                    let requested = self.policy.waiting_requested(&task_id).map(|r| self.model_name(r).to_string());
                    if let Some(a) = self.policy.reroute(&task_id, now, "failed", detail) {
                        let requested = requested.unwrap_or_default();
                        self.metrics.fallbacks.with_label_values(&[&requested, a.step.as_str(), "failed"]).inc();
                        if a.step == FallbackStep::Canned {
                            let _ = grant.send(SlotGrant::Canned(a.passed));
                            return;
                        }
                        m = a.model;
                    }
                }
                self.inc_depth(m, priority);
                // It ran already: a restart must not run it again.
                let parkable = false;
                self.grants.insert(task_id, Waiter { grant, model: m, priority, log, position: 0, preempt, parkable });
            }
            Cmd::Withdraw { task_id } => {
                if self.policy.withdraw(&task_id) {
                    if let Some(w) = self.grants.remove(&task_id) {
                        self.dec_depth(w.model, w.priority);
                    }
                }
            }
            Cmd::PreemptDeclined { task_id } => self.policy.preemption_answered(&task_id),
            Cmd::Prefilled { task_id } => self.policy.prefilled(&task_id),
            Cmd::Release { task_id, output_tokens } => {
                self.running.remove(&task_id);
                self.ungrant(&task_id);
                if let Some(i) = self.policy.release(&task_id, output_tokens) {
                    self.metrics.running.with_label_values(&[&self.router.instance(i).name]).dec();
                }
            }
            // An instance removed by a reload stays down whatever its
            // probe says.
            Cmd::Health { instance, .. } if self.retired.contains(&instance) => {}
            Cmd::Health { instance, up, restarting, detail } => {
                self.policy.set_instance_up(instance, up);
                self.policy.set_instance_restarting(instance, !up && restarting);
                if !self.policy.instance_paused(instance) {
                    self.details[instance] = detail;
                }
                if !up {
                    self.reroute_stranded();
                }
                self.show_degradation();
            }
            Cmd::Breaker { instance, state, reason } => {
                self.policy.set_breaker(instance, state);
                self.breaker_reasons[instance] = Some(reason);
                if state == BreakerState::Open {
                    self.reroute_stranded();
                }
                self.show_degradation();
            }
            Cmd::GraceCheck { instance, busy } => {
                let ours = self.policy.running_on(instance);
                if busy > ours && !self.policy.instance_paused(instance) {
                    let name = &self.router.instance(instance).name;
                    tracing::warn!(engine = %name, busy, ours, "engine did not stop a cancelled request within the grace period; out of dispatch until it does");
                    self.details[instance] =
                        format!("still running {busy} generation(s) for {ours} task(s) after a cancel");
                    self.policy.set_instance_paused(instance, true);
                    self.metrics.engine_unreleased.with_label_values(&[name]).set(1);
                }
            }
            Cmd::EngineState { instance, load, model_resident, error_rate, ttft_p95_ms } => {
                self.policy.set_measured(instance, error_rate, ttft_p95_ms);
                if self.policy.takes_from(instance) != load.takes_from {
                    self.policy.set_takes_from(instance, load.takes_from);
                    self.show_degradation();
                }
                let name = &self.router.instance(instance).name;
                if let Some(busy) = load.busy_slots {
                    if self.policy.instance_paused(instance) && busy <= self.policy.running_on(instance) {
                        tracing::info!(engine = %name, "engine stopped the cancelled work; back in dispatch");
                        self.details[instance] = "ok".into();
                        self.policy.set_instance_paused(instance, false);
                        self.metrics.engine_unreleased.with_label_values(&[name]).set(0);
                    }
                }
                let was_full = self.policy.kv_cache_full(instance);
                self.policy.set_kv_cache_usage(instance, load.kv_cache_usage);
                match (was_full, self.policy.kv_cache_full(instance)) {
                    (false, true) => {
                        tracing::info!(engine = %name, usage = ?load.kv_cache_usage, "engine KV cache at its high-water mark; new work waits")
                    }
                    (true, false) => {
                        tracing::info!(engine = %name, usage = ?load.kv_cache_usage, "engine KV cache has room again")
                    }
                    _ => {}
                }
                if let Some(resident) = model_resident {
                    self.policy.set_engine_resident(instance, resident);
                }
            }
            Cmd::Danger { reason } => self.policy.set_danger(reason),
            Cmd::Limits { limits, retired, models } => {
                let added: Vec<(usize, String)> =
                    limits.added_instances.iter().map(|(i, inst)| (*i, inst.name.clone())).collect();
                for (_, inst) in &limits.added_instances {
                    self.details.push("added by a reload: not checked yet".to_string());
                    self.breaker_reasons.push(None);
                    // The gauges are by engine name: a changed engine's old
                    // instance still counts its running tasks there (their
                    // end decrements it), so only a new name starts at 0.
                    if !self.policy.config().instances.iter().any(|i| i.name == inst.name) {
                        self.metrics.running.with_label_values(&[&inst.name]).set(0);
                        self.metrics.engine_unreleased.with_label_values(&[&inst.name]).set(0);
                    }
                }
                self.policy.set_limits(limits);
                // A model the file no longer has is unknown to new work;
                // its queued and running tasks finish.
                for (m, (name, kept)) in models.into_iter().enumerate() {
                    if kept {
                        self.model_index.insert(name, m);
                    } else {
                        self.model_index.remove(&name);
                    }
                }
                for i in retired {
                    if self.retired.insert(i) {
                        self.policy.set_instance_up(i, false);
                        self.policy.set_instance_restarting(i, false);
                        self.details[i] = "removed from the configuration: draining, then stopped".to_string();
                        // A changed engine: its queued work is its new
                        // instance's, waited for rather than rerouted.
                        let name = &self.policy.config().instances[i].name;
                        if let Some(&(new, _)) = added.iter().find(|(_, n)| n == name) {
                            self.policy.replace_instance(i, new);
                        }
                    }
                }
                // Waiting tasks whose only instances left go elsewhere now.
                self.reroute_stranded();
            }
            Cmd::WhenIdle { instance, reply } => self.idle_waiters.push((instance, reply)),
            Cmd::Snapshot { reply } => {
                let _ = reply.send(self.snapshot());
            }
            Cmd::Park { park, reply } => {
                let ids: Vec<String> =
                    self.grants.iter().filter(|(_, w)| w.parkable).map(|(id, _)| id.clone()).collect();
                for id in ids.iter().filter(|_| park) {
                    self.policy.withdraw(id);
                    if let Some(w) = self.grants.remove(id) {
                        self.dec_depth(w.model, w.priority);
                        let _ = w.grant.send(SlotGrant::Parked);
                    }
                }
                let _ = reply.send(ids);
            }
        }
    }

    fn dec_depth(&self, m: usize, p: Priority) {
        let name = &self.policy.config().models[m].name;
        self.metrics.queue_depth.with_label_values(&[name, p.as_str()]).dec();
        self.waiting_work.remove(name, p);
    }

    /// A granted task's work stops counting for eviction (its slot was
    /// released, or it went back to a queue, which counts it again).
    fn ungrant(&mut self, task_id: &str) {
        if let Some((name, p)) = self.granted.remove(task_id) {
            self.waiting_work.remove(&name, p);
        }
    }

    /// The degradation level follows instance health and breakers only:
    /// set when either changes, not on every message.
    fn show_degradation(&self) {
        self.metrics.degradation_level.set(i64::from(self.policy.degradation()));
    }

    fn model_name(&self, m: usize) -> &str {
        &self.policy.config().models[m].name
    }

    fn inc_depth(&self, m: usize, p: Priority) {
        let name = &self.policy.config().models[m].name;
        self.metrics.queue_depth.with_label_values(&[name, p.as_str()]).inc();
        self.waiting_work.add(name, p);
    }

    /// Waiting tasks whose instances all went down, or whose breakers all
    /// opened, move to the next step of their chain that can take them. If
    /// none can, those with no instance up end `MODEL_UNAVAILABLE`, as new
    /// requests for them are answered, rather than waiting for their queue
    /// timeout; those whose breakers are open wait for the cool-down.
    /// Answers [`Cmd::WhenIdle`] for instances that run nothing now.
    fn answer_idle_waiters(&mut self) {
        if self.idle_waiters.is_empty() {
            return;
        }
        let waiters = std::mem::take(&mut self.idle_waiters);
        for (i, reply) in waiters {
            if self.policy.running_on(i) == 0 {
                let _ = reply.send(());
            } else {
                self.idle_waiters.push((i, reply));
            }
        }
    }

    fn reroute_stranded(&mut self) {
        let now = self.now();
        let mut fail = Vec::new();
        for (id, any_up) in self.policy.stranded() {
            let from = self.policy.waiting_requested(&id);
            let detail = "its instances went down or their breakers opened while it waited";
            match self.policy.reroute(&id, now, "went_down", detail) {
                Some(a) if a.step == FallbackStep::Canned => {
                    if let Some(w) = self.grants.remove(&id) {
                        self.dec_depth(w.model, w.priority);
                        if let Some(from) = from {
                            let requested = self.model_name(from).to_string();
                            self.metrics.fallbacks.with_label_values(&[&requested, "canned", "went_down"]).inc();
                        }
                        let _ = w.grant.send(SlotGrant::Canned(a.passed));
                    }
                }
                Some(a) => {
                    if let Some(w) = self.grants.get_mut(&id) {
                        let priority = w.priority;
                        let old = std::mem::replace(&mut w.model, a.model);
                        if let Some(from) = from {
                            let requested = &self.policy.config().models[from].name;
                            self.metrics.fallbacks.with_label_values(&[requested, a.step.as_str(), "went_down"]).inc();
                        }
                        self.dec_depth(old, priority);
                        self.inc_depth(a.model, priority);
                    }
                }
                None if !any_up => fail.push(id),
                None => {}
            }
        }
        for id in fail {
            self.policy.withdraw(&id);
            if let Some(w) = self.grants.remove(&id) {
                self.dec_depth(w.model, w.priority);
                let name = &self.policy.config().models[w.model].name;
                let e = GatewayError::new(
                    ErrorCode::ModelUnavailable,
                    format!("no instance of model '{name}' is healthy any more"),
                )
                .with_retry_after(self.policy.config().busy_retry_after_ms.max(2000));
                let _ = w.grant.send(SlotGrant::Refused(e));
            }
        }
    }

    /// Tells each waiting task whose position changed since it was last
    /// told (at admission or by an earlier update) where it stands now.
    fn send_positions(&mut self) {
        if self.grants.is_empty() {
            return;
        }
        let now = self.now();
        for (id, position) in self.policy.positions(now) {
            if let Some(w) = self.grants.get_mut(id) {
                if w.position != position {
                    w.position = position;
                    w.log.push(TaskEvent::Queued { position, loading_ms: None });
                }
            }
        }
    }

    /// Grants free slots to the tasks the policy picks until none can start.
    fn dispatch(&mut self) {
        let now = self.now();
        while let Some(g) = self.policy.next_grant(now) {
            let Some(Waiter { grant, model, priority, preempt, .. }) = self.grants.remove(&g.task_id) else {
                // Cannot happen: every waiting task has a grant channel.
                self.policy.release(&g.task_id, 0);
                continue;
            };
            // Out of the queue, but its work still keeps its model in
            // memory until it holds the model (or ends): counted as
            // waiting until its slot is released.
            let name = self.policy.config().models[model].name.clone();
            self.metrics.queue_depth.with_label_values(&[&name, priority.as_str()]).dec();
            self.granted.insert(g.task_id.clone(), (name, priority));
            let i = self.router.instance(g.instance);
            let lease = SlotLease {
                task_id: g.task_id.clone(),
                instance: g.instance,
                instance_name: i.name.clone(),
                engine_model: i.engine_model.clone(),
                model: self.policy.config().models[g.model].name.clone(),
                step: g.step,
                decided_by: g.decided_by,
                max_output_tokens: g.max_output_tokens,
                passed: g.passed,
                slot: g.slot,
                output_tokens: 0,
                tx: self.tx.clone(),
                armed: true,
            };
            match grant.send(SlotGrant::Slot(lease)) {
                Ok(()) => {
                    self.metrics.running.with_label_values(&[&i.name]).inc();
                    self.running.insert(g.task_id.clone(), preempt);
                }
                // The driver is gone (cancelled or timed out meanwhile).
                Err(lease) => {
                    self.ungrant(&g.task_id);
                    if let SlotGrant::Slot(mut lease) = lease {
                        lease.armed = false;
                    }
                    self.policy.release(&g.task_id, 0);
                }
            }
        }
        // P0 work that found no slot: ask the running tasks the policy
        // names to give theirs up.
        for (p0, victim) in self.policy.preemption_victims() {
            let asked = self.running.get(&victim).is_some_and(|p| p.request(&p0));
            if !asked {
                self.policy.preemption_answered(&victim);
            }
        }
    }

    fn snapshot(&self) -> Snapshot {
        let cfg = self.policy.config();
        Snapshot {
            // The policy's instances: the router may have one more a
            // reload is adding, that the actor is not told of yet.
            // A retired instance is listed while it drains, not after.
            instances: (0..cfg.instances.len())
                .filter(|&i| !self.retired.contains(&i) || self.policy.running_on(i) > 0)
                .map(|i| (i, self.router.instance(i)))
                .map(|(i, inst)| InstanceSnapshot {
                    name: inst.name.clone(),
                    up: self.policy.instance_dispatchable(i),
                    detail: self.details[i].clone(),
                    running: self.policy.running_on(i),
                    max_concurrency: inst.max_concurrency,
                    kv_cache_usage: self.policy.kv_cache_usage(i),
                    kv_cache_full: self.policy.kv_cache_full(i),
                    location: cfg.instances[i].location.as_str(),
                    breaker: self.policy.breaker(i),
                    breaker_reason: self.breaker_reasons[i].clone(),
                })
                .collect(),
            queues: cfg
                .models
                .iter()
                .enumerate()
                // A model a reload removed: listed while tasks wait for it.
                .filter(|(m, q)| self.model_index.contains_key(&q.name) || self.policy.waiting(*m) > 0)
                .map(|(m, q)| QueueSnapshot {
                    model: q.name.clone(),
                    waiting: self.policy.waiting(m),
                    capacity: q.queue_capacity,
                })
                .collect(),
            degradation_level: self.policy.degradation(),
        }
    }
}

/// The state a task ends in when it fails with `code`.
pub fn terminal_state_for(code: ErrorCode) -> TaskState {
    if code == ErrorCode::RequestCancelled {
        TaskState::Cancelled
    } else if code.is_timeout() {
        TaskState::TimedOut
    } else {
        TaskState::Failed
    }
}
