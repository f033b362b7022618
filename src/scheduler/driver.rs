//! The driver of one task: waits for a slot, has the router open the engine
//! request, keeps the layered timeouts, forwards the events, records every
//! transition and ends the task in exactly one terminal state.
//!
//! Owns: deadlines and the task's life cycle. Does not own: the engine
//! request, resends, or what an engine failure means for the client (the
//! router's [`Router::open`](crate::router::Router::open) and
//! [`DispatchError`]).

use std::sync::Arc;
use std::time::Instant;

use futures::StreamExt;
use tokio::sync::{mpsc, oneshot};
use tokio::time::sleep_until;

use super::registry::TaskLog;
use super::{terminal_state_for, CancelHandle, Cmd, Shared, SlotGrant};
use crate::engine::{EngineChunk, EngineRequest};
use crate::error::{ErrorCode, GatewayError};
use crate::router::DispatchError;
use crate::task::{ResultMeta, TaskEvent, TaskRequest, TaskState, Timing, Usage};

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
    pub queued_reason: &'static str,
}

/// How a run ended, before it is turned into a terminal state.
struct Outcome {
    error: Option<(GatewayError, &'static str)>,
    reason: String,
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
    /// The instance the task ran on (the router's index), for the
    /// post-cancel grace check.
    instance_index: Option<usize>,
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
        let outcome = self.run_phases(grant, &mut p).await;
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
        self.shared.recorder.transition(&self.req, TaskState::Queued, self.queued_reason, None, "scheduler");
    }

    async fn run_phases(&self, grant: oneshot::Receiver<SlotGrant>, p: &mut Progress) -> Outcome {
        let r = &self.req;
        let t = r.timeouts;
        let total_deadline = tokio::time::Instant::from_std(r.received_at + t.total);
        let queue_raw = tokio::time::Instant::now() + t.queue;
        let queue_deadline = queue_raw.min(total_deadline);
        let timeout_of = |code: ErrorCode, what: &str| Outcome {
            error: Some((GatewayError::new(code, format!("{what} exceeded")), "gateway")),
            reason: format!("{} ({what})", code.as_str()),
        };

        // Phase 1: wait in the queue for a slot.
        let mut lease = tokio::select! {
            biased;
            _ = self.cancel.token.cancelled() => {
                self.withdraw();
                return self.cancelled();
            }
            g = grant => match g {
                Ok(Ok(lease)) => lease,
                // Withdrawn by the scheduler (no healthy instance left).
                Ok(Err(e)) => {
                    let reason = e.message.clone();
                    return Outcome { error: Some((e, "scheduler")), reason };
                }
                Err(_) => {
                    return Outcome {
                        error: Some((GatewayError::new(ErrorCode::ModelUnavailable, "the gateway is shutting down").with_retry_after(1000), "gateway")),
                        reason: "scheduler stopped".into(),
                    };
                }
            },
            _ = sleep_until(queue_deadline) => {
                self.withdraw();
                return if queue_deadline == total_deadline && queue_raw != total_deadline {
                    timeout_of(ErrorCode::TotalTimeout, "total time limit")
                } else {
                    timeout_of(ErrorCode::QueueTimeout, "queue wait limit")
                };
            }
        };

        // Phase 2: dispatch to the engine.
        let now = Instant::now();
        p.dispatched_at = Some(now);
        p.instance = Some(lease.instance_name.clone());
        p.instance_index = Some(lease.instance);
        p.actual_model = Some(format!("{}/{}", lease.instance_name, lease.engine_model));
        let labels = [r.logical_model.as_str(), r.priority.as_str()];
        self.shared.metrics.queue_wait.with_label_values(&labels).observe(r.received_at.elapsed().as_secs_f64());
        self.shared.recorder.transition(
            r,
            TaskState::Dispatching,
            "slot granted",
            Some(&lease.instance_name),
            "scheduler",
        );
        if r.idempotency_key.is_some() {
            self.shared.recorder.store().started(&r.task_id);
        }
        let now_t = tokio::time::Instant::from_std(now);
        let inference_raw = now_t + t.inference;
        let first_token_raw = now_t + t.first_token;
        let inference_deadline = inference_raw.min(total_deadline);
        let first_token_deadline = first_token_raw.min(inference_deadline);
        // Names the limit that a deadline `d` came from; the total limit wins
        // ties because it is the one the caller can least extend.
        let deadline_code = |d: tokio::time::Instant, first: bool| {
            if d == total_deadline {
                timeout_of(ErrorCode::TotalTimeout, "total time limit")
            } else if first && d == first_token_raw {
                timeout_of(ErrorCode::FirstTokenTimeout, "first token time limit")
            } else if d == inference_raw {
                timeout_of(ErrorCode::InferenceTimeout, "inference time limit")
            } else {
                timeout_of(ErrorCode::IdleTimeout, "time limit between tokens")
            }
        };

        let engine_req = EngineRequest {
            model: lease.engine_model.clone(),
            messages: r.messages.clone(),
            params: r.params.clone(),
            max_output_tokens: r.max_output_tokens,
        };
        let mut stream = tokio::select! {
            biased;
            _ = self.cancel.token.cancelled() => return self.cancelled(),
            _ = sleep_until(first_token_deadline) => return deadline_code(first_token_deadline, true),
            s = self.shared.router.open(lease.instance, &engine_req) => match s {
                Ok(s) => s,
                Err(e) => return self.engine_failed(&lease.instance_name, e),
            },
        };
        self.shared.recorder.transition(r, TaskState::Running, "engine accepted", Some(&lease.instance_name), "engine");

        // Phase 3: stream tokens until the engine finishes.
        let mut last_token = now_t;
        loop {
            let (deadline, first) = match p.first_token_at {
                None => (first_token_deadline, true),
                Some(_) => ((last_token + t.idle).min(inference_deadline), false),
            };
            let chunk = tokio::select! {
                biased;
                _ = self.cancel.token.cancelled() => {
                    drop(stream);
                    return self.cancelled();
                }
                _ = sleep_until(deadline) => {
                    drop(stream);
                    return deadline_code(deadline, first);
                }
                c = stream.next() => c,
            };
            match chunk {
                Some(Ok(EngineChunk::Delta(text))) => {
                    last_token = tokio::time::Instant::now();
                    if p.first_token_at.is_none() {
                        p.first_token_at = Some(Instant::now());
                        self.shared
                            .metrics
                            .first_token
                            .with_label_values(&labels)
                            .observe(r.received_at.elapsed().as_secs_f64());
                        self.shared.recorder.transition(
                            r,
                            TaskState::Streaming,
                            "first token",
                            Some(&lease.instance_name),
                            "engine",
                        );
                    }
                    p.deltas += 1;
                    lease.output_tokens += 1;
                    if self.keep_text {
                        p.text.push_str(&text);
                    }
                    self.log.push(TaskEvent::Delta { text });
                }
                Some(Ok(EngineChunk::Usage { input_tokens, output_tokens })) => {
                    p.usage = Some((input_tokens, output_tokens));
                    lease.output_tokens = u64::from(output_tokens);
                }
                Some(Ok(EngineChunk::Finish(reason))) => p.finish_reason = Some(reason),
                Some(Err(e)) => {
                    drop(stream);
                    let mid_stream = p.first_token_at.is_some();
                    return self.engine_failed(
                        &lease.instance_name,
                        self.shared.router.stream_failed(lease.instance, e, mid_stream),
                    );
                }
                None => break,
            }
        }
        drop(stream);
        drop(lease);
        Outcome { error: None, reason: format!("finished ({})", p.finish_reason.as_deref().unwrap_or("stop")) }
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
            Some((i, o)) => Usage { input_tokens: i, output_tokens: o, total_tokens: i + o, estimated: false },
            None if p.dispatched_at.is_some() => {
                // Engine did not report: count what we saw, and say so.
                let i = r.input_tokens_estimate;
                Usage { input_tokens: i, output_tokens: p.deltas, total_tokens: i + p.deltas, estimated: true }
            }
            None => Usage::default(),
        };
        let meta = ResultMeta {
            request_id: r.request_id.clone(),
            task_id: r.task_id.clone(),
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
                TaskState::Succeeded => Some(p.finish_reason.clone().unwrap_or_else(|| "stop".into())),
                _ => None,
            },
            degraded: r.degrade_reason.is_some(),
            degrade_reason: r.degrade_reason.clone(),
        };
        let error_code = outcome.error.as_ref().map(|(e, _)| e.code.as_str());
        self.shared.recorder.finished(
            r,
            &meta,
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
        m.tokens.with_label_values(&[&r.logical_model, "input"]).inc_by(u64::from(usage.input_tokens));
        m.tokens.with_label_values(&[&r.logical_model, "output"]).inc_by(u64::from(usage.output_tokens));
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
