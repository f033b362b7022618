//! The driver of one task: waits for a slot, has the router open the engine
//! request, keeps the layered timeouts, forwards the events, records every
//! transition and ends the task in exactly one terminal state.
//!
//! Owns: deadlines and the task's life cycle, and splitting an embedding
//! list into engine calls of `[models.*] max_batch_inputs` (one after
//! another on the task's slot, so priority, cancels, deadlines, preemption
//! and retries act between calls; a retry goes on from the failed call's
//! first input). Small embedding requests of different tasks are not
//! merged into one call: each keeps its own deadlines, cancel, tenant and
//! failure, and llama-server already batches concurrent requests over its
//! slots. Does not own: the engine
//! request, resends, or what an engine failure means for the client (the
//! router's [`Router::open`](crate::router::Router::open) and
//! [`DispatchError`]).

use std::sync::Arc;
use std::time::Instant;

use futures::StreamExt;
use tokio::sync::{mpsc, oneshot};
use tokio::time::sleep_until;

use super::cache::{self, CacheKey, Hit};
use super::policy::Passed;
use super::preempt::Preempt;
use super::registry::TaskLog;
use super::{terminal_state_for, CancelHandle, Cmd, Shared, SlotGrant, SlotLease};
use crate::engine::{EngineChunk, EngineRequest};
use crate::error::{ErrorCode, GatewayError};
use crate::router::breaker::Attempt;
use crate::router::DispatchError;
use crate::task::tools::ToolCallAssembler;
use crate::task::{
    FallbackStep, Operation, ResultMeta, Route, RouteHop, TaskEvent, TaskRequest, TaskState, Timing, Usage,
};

/// The outcome of a time limit that passed.
fn timeout_outcome(code: ErrorCode, what: &str) -> Outcome {
    Outcome {
        error: Some((GatewayError::new(code, format!("{what} exceeded")), "gateway")),
        reason: format!("{} ({what})", code.as_str()),
    }
}

pub(super) struct Driver {
    pub req: TaskRequest,
    pub shared: Arc<Shared>,
    pub tx: mpsc::UnboundedSender<Cmd>,
    pub log: TaskLog,
    pub cancel: CancelHandle,
    /// Keep the answer text (for the store's data policy or idempotent
    /// replays after a restart).
    pub keep_text: bool,
    /// The reason recorded with QUEUED.
    pub queued_reason: String,
    /// Where admission put the task in its fallback chain.
    pub admission: Admitted,
    /// How the scheduler asks it to give its slot to a P0 task.
    pub preempt: Arc<Preempt>,
    /// Set when the scheduler parked the waiting task at shutdown
    /// ([`SlotGrant::Parked`]): it ends for its callers, unrecorded.
    pub parked: std::sync::atomic::AtomicBool,
    /// The call's response-cache key: its answer is stored under it, and
    /// the cached step looks it up. `None`: not cacheable, or the cache is
    /// off.
    pub cache_key: Option<CacheKey>,
    /// The answer found at submission (the task never queues).
    pub cached: Option<Hit>,
}

/// The step of the fallback chain admission chose.
pub(super) struct Admitted {
    pub step: FallbackStep,
    /// Steps passed over, and why.
    pub passed: Vec<Passed>,
}

/// How a run ended, before it is turned into a terminal state.
struct Outcome {
    error: Option<(GatewayError, &'static str)>,
    reason: String,
}

/// How one engine attempt ended.
enum AttemptEnd {
    /// The task is over (succeeded, failed for good, cancelled, timed out).
    Over(Outcome),
    /// It failed before any output reached the client, in a way another
    /// attempt may not (see [`DispatchError::retryable`]).
    Retry { error: DispatchError, label: &'static str },
    /// A P0 task took its slot before any output went out.
    Preempted,
}

/// Progress of a task, for timing and the result.
#[derive(Default)]
struct Progress {
    dispatched_at: Option<Instant>,
    first_token_at: Option<Instant>,
    instance: Option<String>,
    actual_model: Option<String>,
    usage: Option<(u32, u32)>,
    deltas: u32,
    finish_reason: Option<String>,
    text: String,
    /// The tool calls the model made, put together from their pieces.
    tool_calls: ToolCallAssembler,
    /// The instance the task ran on (the router's index), for the
    /// post-cancel grace check.
    instance_index: Option<usize>,
    /// Engine attempts made (preempted ones included), those that failed,
    /// and the route so far.
    attempts: u32,
    failures: u32,
    /// Attempts that met a supervised engine process being restarted: the
    /// first is free (it reached no engine); later ones count as failures,
    /// so a request that itself kills the engine cannot retry it down to
    /// its restart limit for free (review 14 H2).
    restarts_met: u32,
    /// Dispatched at least once.
    started: bool,
    /// Inputs of an embedding list answered so far (in order): a retry or
    /// a preempted task goes on from here.
    embeddings_done: usize,
    /// The logical model that answered them: the rest of the list must
    /// come from the same model (one vector space, one dimension).
    embeddings_model: Option<String>,
    hops: Vec<RouteHop>,
    /// The logical model and step that answered (or last tried).
    model: Option<String>,
    step: Option<FallbackStep>,
    /// The response cache's answer it was given, if any.
    cache: Option<Hit>,
}

impl Progress {
    /// Forgets the output of an attempt that was taken back.
    fn restart_output(&mut self) {
        self.first_token_at = None;
        self.usage = None;
        self.deltas = 0;
        self.finish_reason = None;
        self.text.clear();
        self.tool_calls = ToolCallAssembler::default();
    }

    fn hop(&mut self, step: FallbackStep, model: &str, instance: Option<&str>, reason: impl Into<String>) {
        self.hops.push(RouteHop {
            step,
            model: model.to_string(),
            instance: instance.map(str::to_string),
            reason: reason.into(),
        });
    }
}

impl Driver {
    /// Runs the task to its end; `accept` has run before.
    ///
    /// # Cancel safety
    /// Spawned and owned by the scheduler's tracker; it is never dropped
    /// mid-way except at runtime shutdown, where the lease's `Drop` still
    /// frees the slot.
    pub async fn run(self, grant: oneshot::Receiver<SlotGrant>) {
        let id = self.req.task_id.clone();
        let mut p = Progress::default();
        for passed in &self.admission.passed {
            p.hop(passed.step, &self.req.logical_model, None, format!("passed over: {}", passed.detail));
        }
        let outcome = if let Some(hit) = self.cached.clone() {
            self.answer_cached(&mut p, hit, Vec::new(), None)
        } else if self.admission.step == FallbackStep::Canned {
            self.cached_or_canned(&mut p, Vec::new())
        } else {
            let outcome = self.run_phases(grant, &mut p).await;
            self.cached_after_failure(outcome, &mut p)
        };
        if self.parked.load(std::sync::atomic::Ordering::Relaxed) {
            self.park();
            self.shared.registry.ended(&id);
            return;
        }
        let stopped_early =
            outcome.error.as_ref().is_some_and(|(e, _)| e.code == ErrorCode::RequestCancelled || e.code.is_timeout());
        let router = &self.shared.router;
        let exclusive = p.instance_index.is_some_and(|i| router.instance(i).exclusive);
        if let (true, true, Some(instance)) = (stopped_early, exclusive, p.instance_index) {
            // The engine should stop within the grace period; if it says it
            // still runs more than edgeway gave it, the instance is taken
            // out of dispatch until it does.
            let grace = self.shared.config.cancel_grace;
            let tx = self.tx.clone();
            let router = router.clone();
            self.shared.tracker.spawn(async move {
                tokio::time::sleep(grace).await;
                if let Some(busy) = router.busy_slots(instance).await {
                    let _ = tx.send(Cmd::GraceCheck { instance, busy });
                }
            });
        }
        self.finish(outcome, p);
        self.shared.registry.ended(&id);
    }

    /// Records the task as queued (the actor has put `Accepted` first in its
    /// log). Called by `submit` before it answers, so whoever the caller
    /// tells about the task (an HTTP 202, an MQTT `accepted`) finds it
    /// `QUEUED` at least.
    pub fn accept(&self) {
        self.shared.recorder.transition(&self.req, TaskState::Queued, &self.queued_reason, None, "scheduler");
    }

    /// The model's configured answer, when no engine step could take the
    /// task (at admission, or later: `passed` are the steps it was moved
    /// past since): streamed like an engine's, marked degraded.
    fn canned(&self, p: &mut Progress, passed: Vec<Passed>) -> Outcome {
        let r = &self.req;
        let text =
            self.shared.config.models.get(&r.logical_model).and_then(|m| m.canned_answer.clone()).unwrap_or_default();
        let now = Instant::now();
        p.dispatched_at = Some(now);
        p.model = Some(r.logical_model.clone());
        p.step = Some(FallbackStep::Canned);
        // No engine answers it (an earlier attempt's instance is in the hops).
        (p.instance, p.actual_model, p.instance_index) = (None, None, None);
        for x in &passed {
            p.hop(x.step, &r.logical_model, None, format!("passed over: {}", x.detail));
        }
        p.hop(FallbackStep::Canned, &r.logical_model, None, "no engine step could take the request");
        if !passed.is_empty() {
            tracing::info!(stage = "fallback", step = "canned", model = %r.logical_model, "moved to the canned answer");
            let why: Vec<String> = passed.iter().map(|x| format!("{}: {}", x.step.as_str(), x.detail)).collect();
            let reason = format!("moved to the canned answer; {}", why.join("; "));
            self.shared.recorder.transition(r, TaskState::Queued, &reason, None, "scheduler");
        }
        self.shared.recorder.transition(r, TaskState::Dispatching, "canned answer", None, "scheduler");
        self.shared.recorder.transition(r, TaskState::Running, "canned answer", None, "scheduler");
        self.shared.recorder.transition(r, TaskState::Streaming, "canned answer", None, "scheduler");
        p.first_token_at = Some(Instant::now());
        // No engine counted it: about 3.5 bytes per token, as admission
        // estimates prompts, reported as estimated.
        p.deltas = (text.len() as u64 * 2).div_ceil(7) as u32;
        if self.keep_text {
            p.text.push_str(&text);
        }
        self.log.push(TaskEvent::Delta { text });
        p.finish_reason = Some("stop".into());
        Outcome { error: None, reason: "finished (canned answer)".into() }
    }

    /// The routing chain's cached step, where the canned answer would be
    /// taken: the cache's answer to the same call (up to `stale_ttl_s`
    /// old), else the canned answer.
    fn cached_or_canned(&self, p: &mut Progress, passed: Vec<Passed>) -> Outcome {
        match self.cache_key.as_ref().and_then(|k| self.shared.cache.stale(k)) {
            Some(hit) => self.answer_cached(p, hit, passed, Some("no engine step could take the request")),
            None => self.canned(p, passed),
        }
    }

    /// The cached step for a task whose engine steps failed before any
    /// output went out (an engine error, or no healthy instance left) and
    /// whose chain has no canned answer to take: the cache's answer to the
    /// same call, up to `stale_ttl_s` old, instead of the error.
    fn cached_after_failure(&self, outcome: Outcome, p: &mut Progress) -> Outcome {
        let Some((e, actor)) = &outcome.error else { return outcome };
        let engine_failed = *actor == "engine" || e.code == ErrorCode::ModelUnavailable;
        let parked = self.parked.load(std::sync::atomic::Ordering::Relaxed);
        if !engine_failed || parked || p.first_token_at.is_some() || p.cache.is_some() {
            return outcome;
        }
        let Some(hit) = self.cache_key.as_ref().and_then(|k| self.shared.cache.stale(k)) else { return outcome };
        let why = format!("the engine steps failed ({})", e.code.as_str());
        p.restart_output();
        self.answer_cached(p, hit, Vec::new(), Some(&why))
    }

    /// Streams the response cache's answer like an engine's: the text in
    /// word-sized deltas, then the end with the cached answer's usage.
    /// `moved`: why the task left its engine steps for it (the cached
    /// step); `None` for an answer found at submission.
    fn answer_cached(&self, p: &mut Progress, hit: Hit, passed: Vec<Passed>, moved: Option<&str>) -> Outcome {
        let r = &self.req;
        let answer = hit.answer.clone();
        let age_ms = hit.age.as_millis() as u64;
        let kind = if hit.stale { "stale" } else { "fresh" };
        p.dispatched_at = Some(Instant::now());
        p.model = Some(answer.model.clone());
        p.step = Some(FallbackStep::Cached);
        // No engine answers it (an earlier attempt's instance is in the hops).
        (p.instance, p.actual_model, p.instance_index) = (None, None, None);
        for x in &passed {
            p.hop(x.step, &r.logical_model, None, format!("passed over: {}", x.detail));
        }
        let how = format!("answered from the response cache ({kind}, {age_ms} ms old)");
        p.hop(
            FallbackStep::Cached,
            &answer.model,
            None,
            match moved {
                Some(why) => format!("{how}; {why}"),
                None => how.clone(),
            },
        );
        if let Some(why) = moved {
            tracing::info!(stage = "fallback", step = "cached", model = %r.logical_model, age_ms, "moved to the cached answer");
            let mut reason = format!("moved to the cached answer ({kind}, {age_ms} ms old); {why}");
            for x in &passed {
                reason.push_str(&format!("; {}: {}", x.step.as_str(), x.detail));
            }
            self.shared.recorder.transition(r, TaskState::Queued, &reason, None, "scheduler");
        }
        self.shared.recorder.transition(r, TaskState::Dispatching, &how, None, "scheduler");
        self.shared.recorder.transition(r, TaskState::Running, "cached answer", None, "scheduler");
        self.shared.recorder.transition(r, TaskState::Streaming, "cached answer", None, "scheduler");
        p.first_token_at = Some(Instant::now());
        for piece in answer.text.split_inclusive(char::is_whitespace) {
            p.deltas += 1;
            if self.keep_text {
                p.text.push_str(piece);
            }
            self.log.push(TaskEvent::Delta { text: piece.to_string() });
        }
        p.finish_reason = Some(answer.finish_reason.clone());
        p.cache = Some(hit);
        Outcome { error: None, reason: format!("finished (cached answer, {kind})") }
    }

    async fn run_phases(&self, mut grant: oneshot::Receiver<SlotGrant>, p: &mut Progress) -> Outcome {
        let r = &self.req;
        let t = r.timeouts;
        let total_deadline = tokio::time::Instant::from_std(r.received_at + t.total);
        let queue_raw = tokio::time::Instant::now() + t.queue;
        let mut wait_deadline = queue_raw.min(total_deadline);
        let router = self.shared.router.clone();
        router.on_request();
        // The instance each failed attempt ran on, for the back-off.
        let mut failed_on: Vec<usize> = Vec::new();
        loop {
            // Phase 1: wait in the queue for a slot.
            let mut lease = match self.wait_for_slot(p, grant, wait_deadline, queue_raw, total_deadline).await {
                Ok(lease) => lease,
                Err(outcome) => return outcome,
            };
            // A part-answered embedding list is pinned to its model
            // (`Cmd::Requeue::pinned`); should a slot of another model come
            // anyway (a step taken while it waited), the task fails rather
            // than mixing vectors of two models in one answer.
            if p.embeddings_done > 0 && p.embeddings_model.as_deref().is_some_and(|m| m != lease.model) {
                let reason = format!(
                    "{} of the inputs were answered by '{}'; '{}' cannot answer the rest",
                    p.embeddings_done,
                    p.embeddings_model.as_deref().unwrap_or_default(),
                    lease.model
                );
                let e = GatewayError::new(ErrorCode::ModelUnavailable, reason.clone()).with_retry_after(1000);
                return Outcome { error: Some((e, "scheduler")), reason };
            }
            // The same instance again after a failure: back off first.
            let tries_here = failed_on.iter().filter(|&&i| i == lease.instance).count() as u32;
            if tries_here > 0 {
                let base = router.retry_backoff.saturating_mul(1 << tries_here.min(6).saturating_sub(1));
                // Up to half again, so retries of many tasks spread out.
                let jitter = base.mul_f64((uuid::Uuid::new_v4().as_u128() % 1000) as f64 / 2000.0);
                tokio::select! {
                    biased;
                    _ = self.cancel.token.cancelled() => return self.cancelled(),
                    _ = sleep_until(total_deadline) => return timeout_outcome(ErrorCode::TotalTimeout, "total time limit"),
                    _ = tokio::time::sleep(base + jitter) => {}
                }
            }
            p.attempts += 1;
            let instance = lease.instance;
            match self.attempt(&mut lease, p, total_deadline).await {
                AttemptEnd::Over(outcome) => return outcome,
                AttemptEnd::Retry { error, label } => {
                    // Preempted attempts do not count: they did not fail.
                    // Nor does a task's first attempt that met an engine
                    // process being restarted: it reached no engine, and the
                    // task waits for the process (or another instance) in
                    // the queue, within its deadlines.
                    let restarting = label == crate::router::ENGINE_RESTARTING;
                    if restarting {
                        p.restarts_met += 1;
                    }
                    let free = restarting && p.restarts_met == 1;
                    if !free {
                        p.failures += 1;
                    }
                    let exhausted = !free && p.failures >= router.max_attempts;
                    let refused = !free && !exhausted && !router.try_retry();
                    if exhausted || refused {
                        if refused {
                            self.shared.metrics.retries_refused.with_label_values(&[&r.logical_model]).inc();
                        }
                        let why = if refused { "the retry budget is spent" } else { "no attempts left" };
                        let mut e = error;
                        e.reason = format!("{} (not retried: {why})", e.reason);
                        return self.engine_failed(&lease.instance_name, e);
                    }
                    self.shared.metrics.retries.with_label_values(&[&r.logical_model, label]).inc();
                    failed_on.push(instance);
                    // The client's copy says what failed in its own words,
                    // never the engine's.
                    if let Some(h) = p.hops.last_mut() {
                        h.reason = format!("{}; failed before the first token ({label}), retried", h.reason);
                    }
                    let reason = format!(
                        "retry after attempt {} failed on {}: {}",
                        p.attempts, lease.instance_name, error.reason
                    );
                    tracing::info!(stage = "retry", attempt = p.attempts, instance = %lease.instance_name, why = label, error = %error.reason, "engine attempt failed before the first token; retrying");
                    grant = self.requeue(lease, Some(instance), p.embeddings_done > 0, &reason);
                }
                AttemptEnd::Preempted => {
                    // Which task took the slot is for the logs: it may be
                    // another tenant's.
                    let by = self.preempt.by().unwrap_or_default();
                    tracing::info!(stage = "retry", attempt = p.attempts, instance = %lease.instance_name, why = "preempted", for_task = %by, "preempted for a P0 task");
                    let model = lease.model.clone();
                    self.shared.metrics.preemptions.with_label_values(&[&model, r.priority.as_str()]).inc();
                    if let Some(h) = p.hops.last_mut() {
                        h.reason = format!("{}; preempted for a P0 task", h.reason);
                    }
                    let reason = format!("preempted on {} for a P0 task", lease.instance_name);
                    grant = self.requeue(lease, None, p.embeddings_done > 0, &reason);
                }
            }
            // A re-queued task waits within its total time limit only.
            wait_deadline = total_deadline;
        }
    }

    /// Waits for a slot until `deadline`.
    async fn wait_for_slot(
        &self,
        p: &mut Progress,
        grant: oneshot::Receiver<SlotGrant>,
        deadline: tokio::time::Instant,
        queue_raw: tokio::time::Instant,
        total_deadline: tokio::time::Instant,
    ) -> Result<SlotLease, Outcome> {
        tokio::select! {
            biased;
            _ = self.cancel.token.cancelled() => {
                self.withdraw();
                Err(self.cancelled())
            }
            g = grant => match g {
                Ok(SlotGrant::Slot(lease)) => Ok(lease),
                Ok(SlotGrant::Canned(passed)) => Err(self.cached_or_canned(p, passed)),
                // Withdrawn by the scheduler (no healthy instance left).
                Ok(SlotGrant::Refused(e)) => {
                    let reason = e.message.clone();
                    Err(Outcome { error: Some((e, "scheduler")), reason })
                }
                // Not recorded (see `run`): the outcome is never used.
                Ok(SlotGrant::Parked) => {
                    self.parked.store(true, std::sync::atomic::Ordering::Relaxed);
                    Err(Outcome { error: None, reason: "parked".into() })
                }
                Err(_) => Err(Outcome {
                    error: Some((GatewayError::new(ErrorCode::ModelUnavailable, "the gateway is shutting down").with_retry_after(1000), "gateway")),
                    reason: "scheduler stopped".into(),
                }),
            },
            _ = sleep_until(deadline) => {
                self.withdraw();
                Err(if deadline == total_deadline && queue_raw != total_deadline {
                    timeout_outcome(ErrorCode::TotalTimeout, "total time limit")
                } else {
                    timeout_outcome(ErrorCode::QueueTimeout, "queue wait limit")
                })
            }
        }
    }

    /// Gives the slot back and puts the task at the front of its queue
    /// again, recording why; returns where its next slot will come.
    fn requeue(
        &self,
        mut lease: SlotLease,
        avoid: Option<usize>,
        pinned: bool,
        reason: &str,
    ) -> oneshot::Receiver<SlotGrant> {
        let r = &self.req;
        self.shared.recorder.transition(r, TaskState::Queued, reason, Some(&lease.instance_name), "scheduler");
        self.preempt.reset();
        let (tx, rx) = oneshot::channel();
        lease.disarm();
        let _ = self.tx.send(Cmd::Requeue {
            task_id: r.task_id.clone(),
            avoid,
            pinned,
            grant: tx,
            log: self.log.clone(),
            preempt: self.preempt.clone(),
        });
        rx
    }

    /// The attempt begun at `attempt_start` gave its first token (text, a
    /// tool-call piece or an embedding): for the record, the breaker and the
    /// first-token metric.
    fn first_token(&self, p: &mut Progress, lease: &SlotLease, attempt_start: Instant) {
        let r = &self.req;
        p.first_token_at = Some(Instant::now());
        self.shared.router.attempt_ended(lease.instance, Attempt::Success { ttft: attempt_start.elapsed() });
        // Its prompt is no longer in prefill (the long-prompt lane).
        let _ = self.tx.send(Cmd::Prefilled { task_id: r.task_id.clone() });
        self.shared
            .metrics
            .first_token
            .with_label_values(&[r.logical_model.as_str(), r.priority.as_str()])
            .observe(r.received_at.elapsed().as_secs_f64());
        self.shared.recorder.transition(r, TaskState::Streaming, "first token", Some(&lease.instance_name), "engine");
    }

    /// One engine attempt on the slot `lease` names.
    async fn attempt(
        &self,
        lease: &mut SlotLease,
        p: &mut Progress,
        total_deadline: tokio::time::Instant,
    ) -> AttemptEnd {
        let r = &self.req;
        let t = r.timeouts;
        let router = &self.shared.router;
        if self.preempt.is_wanted() {
            return AttemptEnd::Preempted;
        }
        // Where this attempt's output starts in the task's log: a
        // preemption may take it back from here if nobody read it.
        let start_seq = self.log.len();
        // Set once a preemption was declined: the attempt runs to its end.
        let mut declined = false;
        // Phase 2: dispatch to the engine.
        let now = Instant::now();
        if p.dispatched_at.is_none() {
            let labels = [r.logical_model.as_str(), r.priority.as_str()];
            self.shared.metrics.queue_wait.with_label_values(&labels).observe(r.received_at.elapsed().as_secs_f64());
        }
        p.dispatched_at.get_or_insert(now);
        // Counted from DISPATCHING while this attempt lasts, however it
        // ends: a task waiting in QUEUED for its model's load (below) is
        // counted once the model is in (review 14 L8 d).
        let running_gauge = self
            .shared
            .metrics
            .tasks_running
            .with_label_values(&[r.logical_model.as_str(), r.identity.application.as_str()]);
        let mut running: Option<crate::telemetry::GaugeGuard> = None;
        p.instance = Some(lease.instance_name.clone());
        p.instance_index = Some(lease.instance);
        p.actual_model = Some(format!("{}/{}", lease.instance_name, lease.engine_model));
        p.model = Some(lease.model.clone());
        p.step = Some(lease.step);
        // Steps it was moved past while it waited: recorded as it happened
        // to the task (the scheduler only knows queues).
        let moved = std::mem::take(&mut lease.passed);
        if !moved.is_empty() {
            tracing::info!(stage = "fallback", step = lease.step.as_str(), model = %lease.model, "moved to a fallback step while waiting");
            let why: Vec<String> = moved.iter().map(|x| format!("{}: {}", x.step.as_str(), x.detail)).collect();
            let reason = format!(
                "moved to fallback step {} ({}) while waiting; {}",
                lease.step.as_str(),
                lease.model,
                why.join("; ")
            );
            self.shared.recorder.transition(r, TaskState::Queued, &reason, None, "scheduler");
        }
        for passed in moved {
            p.hop(passed.step, &r.logical_model, None, format!("passed over: {}", passed.detail));
        }
        let picked = format!("picked by {}", lease.decided_by);
        p.hop(lease.step, &lease.model, Some(&lease.instance_name), picked.clone());
        let mut dispatch_reason = format!("slot granted ({}, {picked})", lease.step.as_str());
        if p.attempts > 1 {
            dispatch_reason = format!("{dispatch_reason}, attempt {}", p.attempts);
        }
        // Residency: the model is not in the engine's memory yet, so the
        // task waits for its load (or takes the next step) in QUEUED, with
        // the reason "loading" and the time the load took so far; it is
        // DISPATCHING once the model is in.
        let residency = self.shared.router.residency();
        let loading = residency.loading_note(lease.instance).map(|note| {
            let so_far = residency.loading_for(lease.instance).unwrap_or_default();
            let reason = format!("loading: {note}, on {} ({dispatch_reason})", lease.instance_name);
            self.shared.recorder.transition(r, TaskState::Queued, &reason, Some(&lease.instance_name), "scheduler");
            self.log.push(TaskEvent::Queued { position: 0, loading_ms: Some(so_far.as_millis() as u64) });
            Instant::now()
        });
        tracing::info!(
            stage = "dispatch",
            queue_ms = now.saturating_duration_since(r.received_at).as_millis() as u64,
            instance = %lease.instance_name,
            model = %lease.model,
            step = lease.step.as_str(),
            attempt = p.attempts,
            loading = loading.is_some(),
            "dispatched"
        );
        if loading.is_none() {
            running = Some(crate::telemetry::GaugeGuard::inc(running_gauge.clone()));
            self.shared.recorder.transition(
                r,
                TaskState::Dispatching,
                &dispatch_reason,
                Some(&lease.instance_name),
                "scheduler",
            );
        }
        // Its pending request is dropped at the first dispatch: from here a
        // restart must not run it again.
        if r.idempotency_key.is_some() && !p.started {
            self.shared.recorder.store().started(&r.task_id);
        }
        p.started = true;
        let now_t = tokio::time::Instant::from_std(now);
        let inference_raw = now_t + t.inference;
        let inference_deadline = inference_raw.min(total_deadline);
        // The first-token limit of the engine call under way: an embedding
        // list split into several calls gives each call its own (each
        // answers all at once); anything else makes one call.
        let mut first_token_raw = now_t + t.first_token;
        // Names the limit that a deadline `d` came from; the total limit wins
        // ties because it is the one the caller can least extend.
        // `first_raw`: the call's first-token limit, while it gave nothing.
        let deadline_code = |d: tokio::time::Instant, first_raw: Option<tokio::time::Instant>| {
            if d == total_deadline {
                timeout_outcome(ErrorCode::TotalTimeout, "total time limit")
            } else if first_raw == Some(d) {
                timeout_outcome(ErrorCode::FirstTokenTimeout, "first token time limit")
            } else if d == inference_raw {
                timeout_outcome(ErrorCode::InferenceTimeout, "inference time limit")
            } else {
                timeout_outcome(ErrorCode::IdleTimeout, "time limit between tokens")
            }
        };
        // A first-token limit (not the total) that passes before any output
        // is a failure of this attempt that another may not repeat.
        // Only the gateway's own first-token limit says something about the
        // engine: a limit the caller lowered, or the total limit, ends the
        // task without a verdict on the instance (or any caller could open
        // every breaker with a 1 ms limit) and without a retry.
        //
        // An embedding call answers all at once: its "first token" is the
        // whole batch, slow anywhere when the batch is big, so its timeout
        // is no verdict on the instance either, and another instance would
        // time out the same (each retry counted failed would open every
        // embedding instance's breaker).
        let embedding = matches!(r.operation, Operation::Embedding { .. });
        // The default in force now (a reload may have changed it), not the
        // one of the start-up configuration.
        let default_first_token = self.shared.first_token_default();
        let own_limit = t.first_token >= default_first_token && !embedding;
        // `verdict`: whether the time-out says something about the
        // instance at all.
        let first_token_timeout = |d: tokio::time::Instant, raw: tokio::time::Instant, verdict: bool| -> AttemptEnd {
            let outcome = deadline_code(d, Some(raw));
            if own_limit && d == raw && d != total_deadline {
                if verdict {
                    router.attempt_ended(lease.instance, Attempt::Failure);
                } else {
                    router.attempt_abandoned(lease.instance);
                }
                let error = DispatchError {
                    error: outcome.error.clone().map(|(e, _)| e).unwrap_or_else(|| GatewayError::internal("timeout")),
                    reason: outcome.reason.clone(),
                    retryable: Some("first_token_timeout"),
                };
                AttemptEnd::Retry { error, label: "first_token_timeout" }
            } else {
                router.attempt_abandoned(lease.instance);
                AttemptEnd::Over(outcome)
            }
        };
        // Inputs per engine call of an embedding list (the model that
        // answers: a fallback step may have its own).
        let max_batch = self.shared.config.models.get(&lease.model).map_or(0, |m| m.max_batch_inputs).max(1);

        // One engine call per pass: a chat or completion makes one; an
        // embedding list makes one per `max_batch` inputs, one after another
        // on this slot (the engine spreads each call's inputs over its own
        // slots), from the first input no earlier call answered, so a
        // retried or preempted task never sends a finished batch again.
        let mut last_token = now_t;
        let mut calls = 0u32;
        // A pool instance forwards the task: its request says who it is.
        let forwards = router.instance(lease.instance).engine.kind() == crate::config::EngineKind::Pool;
        loop {
            calls += 1;
            let call_start = if calls == 1 { now } else { Instant::now() };
            if calls > 1 {
                first_token_raw = tokio::time::Instant::from_std(call_start) + t.first_token;
            }
            let first_token_deadline = first_token_raw.min(inference_deadline);
            // The inputs of this call, and the index of its first one.
            let (operation, offset, count) = match &r.operation {
                Operation::Embedding { input, dimensions } => {
                    let from = p.embeddings_done.min(input.len());
                    let to = (from + max_batch).min(input.len());
                    let op = Operation::Embedding { input: input[from..to].to_vec(), dimensions: *dimensions };
                    (op, from as u32, to - from)
                }
                op => (op.clone(), 0, 0),
            };
            let engine_req = EngineRequest {
                model: lease.engine_model.clone(),
                // A completion's or embedding's text is in its operation; its
                // messages are only for estimates and recovery.
                messages: if r.operation == Operation::Chat { r.messages.clone() } else { Vec::new() },
                params: r.params.clone(),
                max_output_tokens: lease.max_output_tokens,
                tools: r.tools.clone(),
                operation,
                slot: lease.slot,
                traceparent: Some(crate::telemetry::trace::child_traceparent(&r.trace_id, &r.span_id)),
                origin: forwards.then(|| {
                    Arc::new(crate::engine::pool::Origin {
                        node_id: self.shared.config.node_id.clone(),
                        task_id: r.task_id.clone(),
                        tenant: r.identity.tenant.clone(),
                        application: r.identity.application.clone(),
                        user_id: r.identity.user_id.clone(),
                        priority: r.priority,
                        data_class: r.data_class,
                        first_token_deadline: first_token_deadline.into_std(),
                        total_deadline: inference_deadline.into_std(),
                        forwarded_to: Default::default(),
                        queued: Default::default(),
                    })
                }),
            };
            let mut stream = tokio::select! {
                biased;
                _ = self.cancel.token.cancelled() => {
                    router.attempt_abandoned(lease.instance);
                    return AttemptEnd::Over(self.cancelled());
                }
                _ = self.preempt.wanted() => {
                    router.attempt_abandoned(lease.instance);
                    return AttemptEnd::Preempted;
                }
                _ = sleep_until(first_token_deadline) => {
                    // Still in the pool's work queue: waiting is what the
                    // queue is for, no verdict on the instance (a long
                    // outage would open its breaker and close the queue).
                    // A retry puts the task in the queue again.
                    let queued = engine_req.origin.as_ref().is_some_and(|o| o.queued.load(std::sync::atomic::Ordering::Relaxed));
                    return first_token_timeout(first_token_deadline, first_token_raw, !queued);
                }
                // A model still to be loaded makes the task wait here, or
                // take the next step when the load would pass the deadline.
                s = async {
                    let model = router.acquire_model(lease.instance, Some(first_token_deadline.into_std()), r.priority).await?;
                    if let (Some(waited), 1) = (loading, calls) {
                        running.get_or_insert_with(|| crate::telemetry::GaugeGuard::inc(running_gauge.clone()));
                        let reason = format!("model loaded after {} ms; {dispatch_reason}", waited.elapsed().as_millis());
                        self.shared.recorder.transition(r, TaskState::Dispatching, &reason, Some(&lease.instance_name), "scheduler");
                    }
                    router.open_leased(lease.instance, &engine_req, model).await
                } => match s {
                    Ok(s) => s,
                    Err(e) => return match e.retryable {
                        Some(label) => AttemptEnd::Retry { error: e, label },
                        None => AttemptEnd::Over(self.engine_failed(&lease.instance_name, e)),
                    },
                },
            };
            if calls == 1 {
                // A forward names the node that took it, and its task there.
                let to = engine_req.origin.as_ref().and_then(|o| o.forwarded_to.get());
                let reason: std::borrow::Cow<'_, str> = match to {
                    Some((node, task)) => format!("engine accepted: forwarded to node {node}, task {task}").into(),
                    None => "engine accepted".into(),
                };
                self.shared.recorder.transition(r, TaskState::Running, &reason, Some(&lease.instance_name), "engine");
            }

            // Phase 3: stream tokens until the engine finishes.
            // Whether this engine call gave any output (its breaker verdict
            // is then given).
            let mut answered = false;
            loop {
                let (deadline, first) = if answered {
                    ((last_token + t.idle).min(inference_deadline), false)
                } else {
                    (first_token_deadline, true)
                };
                let chunk = tokio::select! {
                    biased;
                    _ = self.cancel.token.cancelled() => {
                        drop(stream);
                        if first {
                            router.attempt_abandoned(lease.instance);
                        }
                        return AttemptEnd::Over(self.cancelled());
                    }
                    _ = self.preempt.wanted(), if !declined => {
                        if first {
                            // Before this call's output: nothing to take
                            // back (an embedding list keeps its finished
                            // calls and goes on from the next input).
                            drop(stream);
                            router.attempt_abandoned(lease.instance);
                            return AttemptEnd::Preempted;
                        }
                        // Output went out; it can be taken back only if nobody
                        // can have seen it.
                        if !embedding && self.log.retract_unread(start_seq) {
                            drop(stream);
                            p.restart_output();
                            lease.output_tokens = 0;
                            return AttemptEnd::Preempted;
                        }
                        declined = true;
                        self.preempt.reset();
                        let _ = self.tx.send(Cmd::PreemptDeclined { task_id: r.task_id.clone() });
                        continue;
                    }
                    _ = sleep_until(deadline) => {
                        drop(stream);
                        if first {
                            return first_token_timeout(deadline, first_token_raw, true);
                        }
                        // Output went out: what the client has is partial.
                        let mut outcome = deadline_code(deadline, None);
                        if let Some((e, _)) = outcome.error.as_mut() {
                            e.partial = true;
                        }
                        return AttemptEnd::Over(outcome);
                    }
                    c = stream.next() => c,
                };
                match chunk {
                    Some(Ok(piece @ (EngineChunk::Delta(_) | EngineChunk::ToolCall(_)))) => {
                        last_token = tokio::time::Instant::now();
                        if !answered {
                            self.first_token(p, lease, now);
                            answered = true;
                        }
                        p.deltas += 1;
                        lease.output_tokens += 1;
                        match piece {
                            EngineChunk::ToolCall(d) => {
                                // Every call's first piece carries an id and
                                // its name; later pieces only arguments.
                                let d = p.tool_calls.push(d, &r.task_id);
                                self.log.push(TaskEvent::ToolCallDelta(d));
                            }
                            EngineChunk::Delta(text) => {
                                // The cache needs the text even where the
                                // store keeps none.
                                if self.keep_text || self.cache_key.is_some() {
                                    p.text.push_str(&text);
                                }
                                self.log.push(TaskEvent::Delta { text });
                            }
                            _ => {}
                        }
                    }
                    Some(Ok(EngineChunk::Embedding { index, vector })) => {
                        // The whole answer of a call arrives at once: the
                        // task's first vector is its first token, for the
                        // record and metrics; each call's first, its
                        // breaker verdict.
                        last_token = tokio::time::Instant::now();
                        if !answered {
                            if p.first_token_at.is_none() {
                                self.first_token(p, lease, call_start);
                            } else {
                                router.attempt_ended(lease.instance, Attempt::Success { ttft: call_start.elapsed() });
                                if calls == 1 {
                                    // A retried or preempted list was charged
                                    // its prefill again at its new grant (the
                                    // long-prompt lane): released at this
                                    // attempt's first vector, as at the first.
                                    let _ = self.tx.send(Cmd::Prefilled { task_id: r.task_id.clone() });
                                }
                            }
                            answered = true;
                        }
                        // The engine numbers the inputs of its call.
                        self.log.push(TaskEvent::Embedding { index: offset + index, vector });
                    }
                    Some(Ok(EngineChunk::Usage { input_tokens, output_tokens })) => {
                        if embedding {
                            // Summed over the calls of the list.
                            let (i, o) = p.usage.unwrap_or_default();
                            p.usage = Some((i + input_tokens, o + output_tokens));
                        } else {
                            p.usage = Some((input_tokens, output_tokens));
                            lease.output_tokens = u64::from(output_tokens);
                        }
                    }
                    Some(Ok(EngineChunk::Finish(reason))) => p.finish_reason = Some(finish_reason(&reason).to_string()),
                    Some(Err(e)) => {
                        drop(stream);
                        // An embedding call fails whole, before any of its
                        // vectors: earlier calls' vectors are the task's, not
                        // this call's, so it may be retried from its offset.
                        let mid_stream = answered;
                        let d = router.stream_failed(lease.instance, e, mid_stream);
                        return match d.retryable {
                            Some(label) if !mid_stream => AttemptEnd::Retry { error: d, label },
                            _ => AttemptEnd::Over(self.engine_failed(&lease.instance_name, d)),
                        };
                    }
                    None => break,
                }
            }
            drop(stream);
            if !answered {
                // Finished without a token (an empty answer): still a success.
                router.attempt_ended(lease.instance, Attempt::Success { ttft: call_start.elapsed() });
            }
            match &r.operation {
                Operation::Embedding { input, .. } => {
                    p.embeddings_done = offset as usize + count;
                    p.embeddings_model.get_or_insert_with(|| lease.model.clone());
                    if p.embeddings_done >= input.len() {
                        break;
                    }
                    // The next call counts as engine work of its own.
                    if self.preempt.is_wanted() {
                        return AttemptEnd::Preempted;
                    }
                }
                _ => break,
            }
        }
        AttemptEnd::Over(Outcome {
            error: None,
            reason: format!("finished ({})", p.finish_reason.as_deref().unwrap_or("stop")),
        })
    }

    /// Ends a parked task for whoever follows it, without a record: the
    /// store keeps it QUEUED with its request, and the next start queues
    /// it again (a repeat of its idempotency key then joins it).
    fn park(&self) {
        let r = &self.req;
        let mut meta = ResultMeta::bare(
            &r.request_id,
            &r.task_id,
            TaskState::Queued,
            &r.logical_model,
            &self.shared.config.node_id,
        );
        meta.session_id = r.session_id.clone();
        meta.trace_id = Some(r.trace_id.clone());
        let e = GatewayError::new(
            ErrorCode::ShuttingDown,
            "the gateway is shutting down; the task stays queued and runs after the restart (repeat its idempotency key to follow it)",
        )
        .with_retry_after(5000);
        tracing::info!(task_id = %r.task_id, "queued idempotent task kept for the next start");
        self.log.push(TaskEvent::Error { error: e, meta: Box::new(meta) });
    }

    /// The task's span for the OTLP export: ids, what it asked and what
    /// answered, how it ended, its counts. No prompt or answer text.
    fn span(&self, meta: &ResultMeta, error_code: Option<&str>, actor: &str) -> crate::telemetry::otlp::TaskSpan {
        let r = &self.req;
        let mut attributes = vec![
            ("edgeway.task_id", r.task_id.clone()),
            ("edgeway.request_id", r.request_id.clone()),
            ("edgeway.ingress", r.ingress.as_str().to_string()),
            ("edgeway.tenant", r.identity.tenant.clone()),
            ("edgeway.application", r.identity.application.clone()),
            ("edgeway.model", r.logical_model.clone()),
            ("edgeway.priority", r.priority.as_str().to_string()),
            ("edgeway.state", meta.status.as_str().to_string()),
            ("edgeway.actor", actor.to_string()),
        ];
        for (k, v) in [
            ("edgeway.session_id", r.session_id.as_deref()),
            ("edgeway.instance", meta.route.instance.as_deref()),
            ("edgeway.error_code", error_code),
            ("edgeway.finish_reason", meta.finish_reason.as_deref()),
        ] {
            if let Some(v) = v {
                attributes.push((k, v.to_string()));
            }
        }
        let mut counts = vec![
            ("edgeway.input_tokens", i64::from(meta.usage.input_tokens)),
            ("edgeway.output_tokens", i64::from(meta.usage.output_tokens)),
            ("edgeway.attempts", i64::from(meta.route.attempts)),
        ];
        for (k, v) in [("edgeway.queue_ms", meta.timing.queue_ms), ("edgeway.ttft_ms", meta.timing.first_token_ms)] {
            if let Some(v) = v {
                counts.push((k, v as i64));
            }
        }
        crate::telemetry::otlp::TaskSpan {
            trace_id: r.trace_id.clone(),
            span_id: r.span_id.clone(),
            parent_span_id: r.parent_span_id.clone(),
            start: r.received_wall,
            end: std::time::SystemTime::now(),
            ok: meta.status == TaskState::Succeeded,
            attributes,
            counts,
        }
    }

    /// Counts the calls (`edgeway_tool_calls_total`) and logs the
    /// high-risk ones: someone must confirm them before they run.
    fn count_tool_calls(&self, calls: &[crate::task::ToolCall]) {
        let r = &self.req;
        for c in calls {
            // The name is the model's text: escaped and cut for the log.
            let tool = crate::task::tools::safe_name(&c.name);
            let valid = if c.valid { "true" } else { "false" };
            let high_risk = if c.requires_confirmation { "true" } else { "false" };
            self.shared.metrics.tool_calls.with_label_values(&[r.logical_model.as_str(), valid, high_risk]).inc();
            if c.requires_confirmation {
                tracing::warn!(task_id = %r.task_id, application = %r.identity.application, tool = %tool, valid = c.valid, "high-risk tool call: requires confirmation");
            } else if !c.valid {
                tracing::info!(task_id = %r.task_id, tool = %tool, error = c.error.as_deref().unwrap_or(""), "invalid tool call");
            }
        }
    }

    fn withdraw(&self) {
        let _ = self.tx.send(Cmd::Withdraw { task_id: self.req.task_id.clone() });
    }

    fn cancelled(&self) -> Outcome {
        let (reason, actor) = self.cancel.reason();
        Outcome { error: Some((GatewayError::new(ErrorCode::RequestCancelled, reason.clone()), actor)), reason }
    }

    fn engine_failed(&self, instance: &str, e: DispatchError) -> Outcome {
        tracing::warn!(task_id = %self.req.task_id, engine = %instance, error = %e.reason, "engine request failed");
        Outcome { error: Some((e.error, "engine")), reason: e.reason }
    }

    fn finish(&self, outcome: Outcome, p: Progress) {
        let r = &self.req;
        let state = match &outcome.error {
            None => TaskState::Succeeded,
            Some((e, _)) => terminal_state_for(e.code),
        };
        let actor = outcome.error.as_ref().map(|(_, a)| *a).unwrap_or("engine");
        let end = Instant::now();
        let ms = |from: Instant, to: Instant| to.saturating_duration_since(from).as_millis() as u64;
        let usage = match p.usage {
            // The cached answer's own counts: what the call costs an engine.
            _ if p.cache.is_some() => p.cache.as_ref().map(|h| h.answer.usage).unwrap_or_default(),
            Some((i, o)) => Usage { input_tokens: i, output_tokens: o, total_tokens: i + o, estimated: false },
            None if p.dispatched_at.is_some() => {
                // Engine did not report: count what we saw, and say so.
                let i = r.input_tokens_estimate;
                Usage { input_tokens: i, output_tokens: p.deltas, total_tokens: i + p.deltas, estimated: true }
            }
            None => Usage::default(),
        };
        // A fresh cache hit is the requested model's own answer.
        let fresh_hit = p.cache.as_ref().is_some_and(|h| !h.stale);
        let route_degraded = p.step.is_some_and(|s| s != FallbackStep::SameModel) && !fresh_hit;
        let high_risk = self
            .shared
            .config
            .applications
            .get(&r.identity.application)
            .map(|a| a.high_risk_tools.as_slice())
            .unwrap_or_default();
        let tool_calls = p.tool_calls.finish(r.tools.as_ref(), high_risk);
        let mut outcome = outcome;
        if !tool_calls.is_empty() {
            self.count_tool_calls(&tool_calls);
            let invalid = tool_calls.iter().filter(|c| !c.valid).count();
            let confirm = tool_calls.iter().filter(|c| c.requires_confirmation).count();
            // The record says so too: it is the audit of what the model asked for.
            outcome.reason = format!("{}; {} tool call(s), {invalid} invalid", outcome.reason, tool_calls.len());
            if confirm > 0 {
                outcome.reason = format!("{}, {confirm} high-risk (requires confirmation)", outcome.reason);
            }
        }
        // `tool_choice` "required" (or a named tool) and the model answered
        // with text only: the answer breaks the request's rule.
        let missing_call = tool_calls.is_empty()
            && outcome.error.is_none()
            && r.tools.as_ref().is_some_and(crate::task::ToolSet::requires_call);
        if missing_call {
            outcome.reason =
                format!("{}; tool_choice_violation: the request requires a tool call, none made", outcome.reason);
        }
        let mut finish_reason = p.finish_reason.clone();
        // OpenAI's clients look for `tool_calls` to run the calls.
        if !tool_calls.is_empty() && finish_reason.as_deref().is_none_or(|f| f == "stop") {
            finish_reason = Some("tool_calls".into());
        }
        let meta = ResultMeta {
            request_id: r.request_id.clone(),
            task_id: r.task_id.clone(),
            trace_id: Some(r.trace_id.clone()),
            session_id: r.session_id.clone(),
            status: state,
            logical_model: r.logical_model.clone(),
            actual_model: p.actual_model.clone(),
            node_id: self.shared.config.node_id.clone(),
            usage,
            timing: Timing {
                queue_ms: p.dispatched_at.map(|d| ms(r.received_at, d)),
                first_token_ms: p.first_token_at.map(|f| ms(r.received_at, f)),
                inference_ms: p.dispatched_at.map(|d| ms(d, end)),
                total_ms: ms(r.received_at, end),
            },
            finish_reason: match state {
                TaskState::Succeeded => Some(finish_reason.unwrap_or_else(|| "stop".into())),
                _ => None,
            },
            degraded: r.degrade_reason.is_some() || route_degraded,
            degrade_reason: r.degrade_reason.clone().or_else(|| {
                route_degraded.then(|| {
                    format!(
                        "answered by fallback step {} ({})",
                        p.step.map_or("busy", FallbackStep::as_str),
                        p.model.as_deref().unwrap_or(&r.logical_model)
                    )
                })
            }),
            route: Route {
                requested_model: r.logical_model.clone(),
                model: p.model.clone(),
                instance: p.instance.clone(),
                attempts: p.attempts,
                data_class: r.data_class,
                hops: p.hops,
                degraded: route_degraded,
            },
            tool_calls_valid: if missing_call {
                Some(false)
            } else {
                (!tool_calls.is_empty()).then(|| tool_calls.iter().all(|c| c.valid))
            },
            tool_calls,
            context: r.context.clone(),
            text_not_kept: false,
            // The instance that answered, at its price: a retry on another
            // instance forgot the earlier attempt's usage (`restart_output`).
            cost: Some(
                p.instance_index
                    .map(|i| self.shared.router.instance(i).price.cost(usage.input_tokens, usage.output_tokens))
                    .unwrap_or(0.0),
            ),
            cache_hit: p.cache.is_some(),
            cache_age_ms: p.cache.as_ref().map(|h| h.age.as_millis() as u64),
            cache_stale: p.cache.as_ref().is_some_and(|h| h.stale),
        };
        if let Some(key) = self.cache_key.as_ref().filter(|_| p.cache.is_none()) {
            let ok = cache::storable(
                p.step,
                state == TaskState::Succeeded,
                meta.finish_reason.as_deref(),
                r.degrade_reason.is_some(),
                !meta.tool_calls.is_empty(),
            );
            if ok {
                let answer = cache::Answer {
                    text: p.text.clone(),
                    finish_reason: meta.finish_reason.clone().unwrap_or_default(),
                    model: p.model.clone().unwrap_or_else(|| r.logical_model.clone()),
                    usage,
                    owner: r.identity.user_id.clone().map(|u| (r.identity.tenant.clone(), u)),
                };
                self.shared.cache.put(key, answer);
            }
        }
        let error_code = outcome.error.as_ref().map(|(e, _)| e.code.as_str());
        // The arguments are answer text: stored only where the text is;
        // the names as the model wrote them only made safe.
        let mut stored = None;
        if !meta.tool_calls.is_empty() {
            let mut m = meta.clone();
            m.tool_calls = meta.tool_calls.iter().map(|c| c.for_record(self.keep_text)).collect();
            stored = Some(m);
        }
        // One line for the engine's part (when one ran it) and one for the
        // end, before the end is recorded: whoever sees the task ended
        // finds them logged.
        if p.instance.is_some() {
            tracing::info!(
                stage = "inference",
                instance = p.instance.as_deref().unwrap_or_default(),
                ttft_ms = meta.timing.first_token_ms,
                inference_ms = meta.timing.inference_ms,
                input_tokens = usage.input_tokens,
                output_tokens = usage.output_tokens,
                estimated = usage.estimated,
                finish_reason = meta.finish_reason.as_deref().unwrap_or_default(),
                "inference ended"
            );
        }
        tracing::info!(
            stage = "end",
            state = state.as_str(),
            code = error_code.unwrap_or_default(),
            actor,
            total_ms = meta.timing.total_ms,
            attempts = p.attempts,
            reason = %outcome.reason,
            "task ended"
        );
        if let Some(spans) = self.shared.metrics.spans() {
            spans.export(self.span(&meta, error_code, actor));
        }
        self.shared.recorder.finished(
            r,
            stored.as_ref().unwrap_or(&meta),
            &outcome.reason,
            p.instance.as_deref(),
            actor,
            error_code,
            self.keep_text.then_some(p.text),
        );

        let m = &self.shared.metrics;
        m.tasks_finished.with_label_values(&[&r.logical_model, state.as_str()]).inc();
        m.task_duration
            .with_label_values(&[&r.logical_model, state.as_str()])
            .observe(r.received_at.elapsed().as_secs_f64());
        // A cached answer used no engine: no tokens, no decode speed.
        let engine_tokens = if p.cache.is_some() { Usage::default() } else { usage };
        m.tokens.with_label_values(&[&r.logical_model, "input"]).inc_by(u64::from(engine_tokens.input_tokens));
        m.tokens.with_label_values(&[&r.logical_model, "output"]).inc_by(u64::from(engine_tokens.output_tokens));
        // Decode speed: the tokens after the first over the time since it.
        if let (Some(first), true) = (p.first_token_at, engine_tokens.output_tokens > 1) {
            let per_token = end.saturating_duration_since(first).as_secs_f64() / f64::from(usage.output_tokens - 1);
            m.time_per_output_token.with_label_values(&[r.logical_model.as_str()]).observe(per_token);
        }
        if state == TaskState::Cancelled {
            m.cancellations.with_label_values(&[r.logical_model.as_str(), actor]).inc();
        }
        m.requests
            .with_label_values(&[
                r.ingress.as_str(),
                outcome.error.as_ref().map(|(e, _)| e.code.as_str()).unwrap_or("ok"),
            ])
            .inc();

        let event = match outcome.error {
            None => TaskEvent::Done(Box::new(meta)),
            Some((error, _)) => TaskEvent::Error { error, meta: Box::new(meta) },
        };
        self.log.push(event);
    }
}

/// The engine's `finish_reason`, as one of a closed set: it is stored with
/// the task and shown to callers (`GET /v1/tasks/{id}`, the answer), so
/// whatever else an engine says (any length, any text) becomes `other`.
fn finish_reason(engine: &str) -> &'static str {
    match engine {
        "stop" => "stop",
        "length" => "length",
        "tool_calls" => "tool_calls",
        "content_filter" => "content_filter",
        _ => "other",
    }
}
