//! The scheduler: the one owner of queues and engine slots.
//!
//! It is an actor ([`run`]) fed by [`Cmd`] messages through a
//! [`SchedulerHandle`]. Ingresses submit a [`TaskRequest`] and get a
//! [`TaskStream`] of events; they never touch queues. Each accepted task is
//! carried by its own driver task ([`driver`]) that waits for a slot, runs
//! the engine request under the layered timeouts and reports the events.
//!
//! Owns: the per-model bounded queues (priority, then arrival), the slots of
//! every engine instance (`max_concurrency`), instance health as reported
//! by the probes, and the life of each task from QUEUED to its end. Does not
//! own: validation and identity (admission) or wire formats (ingress).
//!
//! # Cancel safety
//! A slot is a [`SlotLease`]: whoever drops it frees the slot, so a driver
//! that is cancelled, times out or panics can never leak one. Dropping a
//! [`TaskStream`] cancels its task (unless it was detached).

mod driver;
pub mod events;
pub mod queue;

use std::collections::HashMap;
use std::sync::Arc;

use tokio::sync::{mpsc, oneshot, Notify};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::Config;
use crate::engine::Engine;
use crate::error::{ErrorCode, GatewayError};
use crate::router::{self, InstanceView};
use crate::task::{TaskEvent, TaskRequest, TaskState};
use crate::telemetry::lifecycle::Recorder;
use crate::telemetry::Metrics;
use events::{Registry, Subscription, TaskEntry, TaskLog};
use queue::{ModelQueue, QueueEntry};

/// An engine instance as the scheduler sees it.
pub struct Instance {
    pub name: String,
    pub engine: Arc<dyn Engine>,
    /// The engine's own name for the model.
    pub engine_model: String,
    pub max_concurrency: usize,
}

/// Permission to run one task on one instance. Dropping it frees the slot.
pub struct SlotLease {
    pub instance: usize,
    pub instance_name: String,
    pub engine: Arc<dyn Engine>,
    pub engine_model: String,
    tx: mpsc::UnboundedSender<Cmd>,
    armed: bool,
}

impl Drop for SlotLease {
    fn drop(&mut self) {
        if self.armed {
            let _ = self.tx.send(Cmd::Release { instance: self.instance });
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

enum Cmd {
    Enqueue { entry: QueueEntry, model: String, reply: oneshot::Sender<Result<usize, GatewayError>> },
    Withdraw { task_id: String, model: String },
    Release { instance: usize },
    Health { instance: usize, up: bool, detail: String },
    Snapshot { reply: oneshot::Sender<Snapshot> },
}

/// A view of the scheduler for `/ready` and tests.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Snapshot {
    pub instances: Vec<InstanceSnapshot>,
    pub queues: Vec<QueueSnapshot>,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct InstanceSnapshot {
    pub name: String,
    pub up: bool,
    pub detail: String,
    pub running: usize,
    pub max_concurrency: usize,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct QueueSnapshot {
    pub model: String,
    pub waiting: usize,
    pub capacity: usize,
}

struct Shared {
    config: Arc<Config>,
    recorder: Recorder,
    metrics: Arc<Metrics>,
    tracker: TaskTracker,
    shutdown: CancellationToken,
    /// Probes wait on these to re-check an instance at once (after an
    /// engine request failed to connect).
    recheck: Vec<Notify>,
    /// Live and recently ended tasks.
    registry: Registry,
}

/// The way into the scheduler. Cheap to clone.
#[derive(Clone)]
pub struct SchedulerHandle {
    tx: mpsc::UnboundedSender<Cmd>,
    shared: Arc<Shared>,
}

/// Starts the scheduler actor. Drivers are spawned on `tracker`; all stop
/// when `shutdown` is cancelled.
pub fn start(
    config: Arc<Config>,
    instances: Vec<Instance>,
    recorder: Recorder,
    metrics: Arc<Metrics>,
    tracker: TaskTracker,
    shutdown: CancellationToken,
) -> SchedulerHandle {
    let (tx, rx) = mpsc::unbounded_channel();
    let index: HashMap<&str, usize> = instances.iter().enumerate().map(|(i, x)| (x.name.as_str(), i)).collect();
    let queues: Vec<ModelQueue> = config
        .models
        .values()
        .map(|m| {
            ModelQueue::new(m.name.clone(), m.queue_capacity, m.instances.iter().map(|n| index[n.as_str()]).collect())
        })
        .collect();
    let shared = Arc::new(Shared {
        config: config.clone(),
        recorder,
        metrics: metrics.clone(),
        tracker: tracker.clone(),
        shutdown: shutdown.clone(),
        recheck: instances.iter().map(|_| Notify::new()).collect(),
        registry: Registry::new(config.scheduler.replay_retention, config.scheduler.replay_max_bytes),
    });
    let actor = Actor {
        views: instances
            .iter()
            .map(|i| InstanceView { up: true, running: 0, max_concurrency: i.max_concurrency })
            .collect(),
        details: instances.iter().map(|_| "not checked yet".to_string()).collect(),
        instances,
        queues,
        tx: tx.clone(),
        metrics,
        busy_retry_after_ms: config.scheduler.busy_retry_after_ms,
    };
    tracker.spawn(actor.run(rx, shutdown));
    SchedulerHandle { tx, shared }
}

impl SchedulerHandle {
    /// Queues a validated task. Answers at once: `QUEUE_FULL` or
    /// `MODEL_UNAVAILABLE` when it cannot be queued, else a stream of its
    /// events (starting with `Accepted`).
    ///
    /// A task whose idempotency key (per tenant and application) is already
    /// known is not started again: the stream joins the existing task from
    /// its first event (`joined` is true).
    pub async fn submit(&self, req: TaskRequest) -> Result<TaskStream, GatewayError> {
        let cancel = CancelHandle::new(self.shared.shutdown.child_token());
        let log = Arc::new(TaskLog::default());
        let entry = Arc::new(TaskEntry {
            task_id: req.task_id.clone(),
            request_id: req.request_id.clone(),
            tenant: req.identity.tenant.clone(),
            application: req.identity.application.clone(),
            idempotency_key: req.idempotency_key.clone(),
            prompt_sha256: req.prompt_sha256.clone(),
            log: log.clone(),
            cancel: cancel.clone(),
        });
        if let Err(existing) = self.shared.registry.insert_or_get(entry) {
            if existing.prompt_sha256 != req.prompt_sha256 {
                return Err(GatewayError::invalid("this idempotency key was already used for a different request"));
            }
            return Ok(Self::join(&existing, 0));
        }

        let (grant_tx, grant_rx) = oneshot::channel();
        let (reply_tx, reply_rx) = oneshot::channel();
        let entry = QueueEntry { task_id: req.task_id.clone(), priority: req.priority, seq: 0, grant: grant_tx };
        let closed =
            || GatewayError::new(ErrorCode::ModelUnavailable, "the gateway is shutting down").with_retry_after(1000);
        let queued = match self.tx.send(Cmd::Enqueue { entry, model: req.logical_model.clone(), reply: reply_tx }) {
            Ok(()) => reply_rx.await.map_err(|_| closed()).and_then(|r| r),
            Err(_) => Err(closed()),
        };
        let queue_position = match queued {
            Ok(p) => p,
            Err(e) => {
                self.shared.registry.remove(&req.task_id);
                return Err(e);
            }
        };
        let stream = TaskStream {
            task_id: req.task_id.clone(),
            request_id: req.request_id.clone(),
            queue_position,
            joined: false,
            events: log.subscribe(0),
            cancel: cancel.clone(),
            owner: true,
        };
        let keep_text = self.shared.recorder.store().stores_prompts();
        let d = driver::Driver {
            req,
            shared: self.shared.clone(),
            tx: self.tx.clone(),
            log,
            cancel,
            queue_position,
            keep_text,
        };
        self.shared.tracker.spawn(d.run(grant_rx));
        Ok(stream)
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
            queue_position: 0,
            joined: true,
            events: e.log.subscribe(from_seq),
            cancel: e.cancel.clone(),
            owner: false,
        }
    }

    /// A known task of this tenant and application by its request id.
    pub fn find_by_request(&self, tenant: &str, app: &str, request_id: &str) -> Option<Arc<TaskEntry>> {
        self.shared.registry.by_request(tenant, app, request_id)
    }

    /// A known task of this tenant and application by its idempotency key.
    pub fn find_by_idempotency_key(&self, tenant: &str, app: &str, key: &str) -> Option<Arc<TaskEntry>> {
        self.shared.registry.by_idempotency_key(tenant, app, key)
    }

    /// A known task (live or recently ended) by id.
    pub fn get(&self, task_id: &str) -> Option<Arc<TaskEntry>> {
        self.shared.registry.get(task_id)
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

    pub(crate) fn set_instance_health(&self, instance: usize, up: bool, detail: String) {
        let _ = self.tx.send(Cmd::Health { instance, up, detail });
    }

    /// Resolves when someone asks for an early health check of `instance`.
    pub(crate) async fn recheck_requested(&self, instance: usize) {
        self.shared.recheck[instance].notified().await
    }
}

struct Actor {
    instances: Vec<Instance>,
    views: Vec<InstanceView>,
    details: Vec<String>,
    queues: Vec<ModelQueue>,
    tx: mpsc::UnboundedSender<Cmd>,
    metrics: Arc<Metrics>,
    busy_retry_after_ms: u64,
}

impl Actor {
    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Cmd>, shutdown: CancellationToken) {
        let mut seq: u64 = 0;
        loop {
            let cmd = tokio::select! {
                _ = shutdown.cancelled() => break,
                c = rx.recv() => match c { Some(c) => c, None => break },
            };
            match cmd {
                Cmd::Enqueue { mut entry, model, reply } => {
                    seq += 1;
                    entry.seq = seq;
                    let _ = reply.send(self.enqueue(entry, &model));
                }
                Cmd::Withdraw { task_id, model } => {
                    if let Some(q) = self.queues.iter_mut().find(|q| q.name == model) {
                        if let Some(e) = q.remove(&task_id) {
                            self.metrics.queue_depth.with_label_values(&[&model, e.priority.as_str()]).dec();
                        }
                    }
                }
                Cmd::Release { instance } => {
                    let v = &mut self.views[instance];
                    v.running = v.running.saturating_sub(1);
                    self.metrics.running.with_label_values(&[&self.instances[instance].name]).dec();
                }
                Cmd::Health { instance, up, detail } => {
                    self.views[instance].up = up;
                    self.details[instance] = detail;
                }
                Cmd::Snapshot { reply } => {
                    let _ = reply.send(self.snapshot());
                }
            }
            self.dispatch();
        }
        // Queued drivers see their grant sender dropped and end their tasks.
    }

    fn enqueue(&mut self, entry: QueueEntry, model: &str) -> Result<usize, GatewayError> {
        let Some(qi) = self.queues.iter().position(|q| q.name == model) else {
            return Err(GatewayError::invalid(format!("unknown model '{model}'")));
        };
        let q = &self.queues[qi];
        if !router::any_up(&q.instances, &self.views) {
            return Err(GatewayError::new(
                ErrorCode::ModelUnavailable,
                format!("no instance of model '{model}' is healthy"),
            )
            .with_retry_after(self.busy_retry_after_ms.max(2000)));
        }
        if q.is_full() {
            return Err(GatewayError::new(
                ErrorCode::QueueFull,
                format!("the queue of model '{model}' is full ({} waiting)", q.len()),
            )
            .with_retry_after(self.busy_retry_after_ms));
        }
        let task_id = entry.task_id.clone();
        self.metrics.queue_depth.with_label_values(&[model, entry.priority.as_str()]).inc();
        self.queues[qi].push(entry);
        self.dispatch();
        Ok(self.queues[qi].position(&task_id).unwrap_or(0))
    }

    /// Grants free slots to the most urgent waiting tasks until no slot or
    /// no task is left.
    fn dispatch(&mut self) {
        loop {
            // The most urgent head among queues that have a free instance.
            let mut best: Option<(queue::QueueKey, usize, usize)> = None;
            for (qi, q) in self.queues.iter().enumerate() {
                let Some(key) = q.peek_key() else { continue };
                if best.is_some_and(|(b, _, _)| b <= key) {
                    continue;
                }
                if let Some(inst) = router::pick(&q.instances, &self.views) {
                    best = Some((key, qi, inst));
                }
            }
            let Some((_, qi, inst)) = best else { return };
            let entry = self.queues[qi].pop().expect("peeked");
            let model = self.queues[qi].name.clone();
            self.metrics.queue_depth.with_label_values(&[&model, entry.priority.as_str()]).dec();
            let i = &self.instances[inst];
            let lease = SlotLease {
                instance: inst,
                instance_name: i.name.clone(),
                engine: i.engine.clone(),
                engine_model: i.engine_model.clone(),
                tx: self.tx.clone(),
                armed: true,
            };
            match entry.grant.send(lease) {
                Ok(()) => {
                    self.views[inst].running += 1;
                    self.metrics.running.with_label_values(&[&i.name]).inc();
                }
                // The driver is gone (cancelled or timed out meanwhile).
                Err(mut lease) => lease.armed = false,
            }
        }
    }

    fn snapshot(&self) -> Snapshot {
        Snapshot {
            instances: self
                .instances
                .iter()
                .zip(&self.views)
                .zip(&self.details)
                .map(|((i, v), d)| InstanceSnapshot {
                    name: i.name.clone(),
                    up: v.up,
                    detail: d.clone(),
                    running: v.running,
                    max_concurrency: v.max_concurrency,
                })
                .collect(),
            queues: self
                .queues
                .iter()
                .map(|q| QueueSnapshot { model: q.name.clone(), waiting: q.len(), capacity: q.capacity })
                .collect(),
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
