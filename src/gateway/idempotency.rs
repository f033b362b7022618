//! Idempotency keys: what a repeat of a key finds. A repeat joins the task
//! that is already known (live, or after a restart or once its events are
//! no longer retained, its outcome from the store); the same key with a
//! different prompt is refused. Every ingress goes through this one check
//! (MQTT derives its keys from the device and the request id).
//!
//! A task that ended in a transient way (a retryable code, or cancelled:
//! [`ErrorCode::runs_again_on_repeat`]) does not burn its key: a repeat
//! runs the request again, once (concurrent repeats race for the key in
//! the scheduler's registry and the losers join the winner), and the new
//! task's record names the old one.
//!
//! Owns: the lookup order (live registry, then store), the judgement of a
//! repeat (same prompt joins, another prompt is refused, a transient end
//! runs again), remembering, handing over and forgetting a key in the
//! store. Does not own: the atomic insert that makes
//! two racing first calls one task (the scheduler's registry does that under
//! its lock, and hands the task it found back here to be judged).

use crate::error::{ErrorCode, GatewayError};
use crate::store::{IdempotentRecord, StoredRequest};
use crate::task::{ResultMeta, TaskEvent, TaskRequest, TaskState};

use super::{Gateway, TaskStream};
use crate::scheduler::registry::TaskEntry;

fn reused() -> GatewayError {
    GatewayError::invalid("this idempotency key was already used for a different request")
}

/// What a call with an idempotency key finds.
pub(super) enum Repeat {
    /// A known task with the same key: its stream (live, or its outcome).
    Join(TaskStream),
    /// No task holds the key, or the one that did ended in a way a repeat
    /// runs again ([`ErrorCode::runs_again_on_repeat`]): this call starts
    /// a task. `retry_of` is that earlier task and how it ended.
    Run { retry_of: Option<(String, ErrorCode)> },
}

/// The code a finished task ended with, if a repeat runs it again.
fn runs_again(code: Option<ErrorCode>) -> Option<ErrorCode> {
    code.filter(|c| c.runs_again_on_repeat())
}

/// The error code of a live entry that has ended with an error.
fn ended_with(existing: &TaskEntry) -> Option<ErrorCode> {
    match existing.log.terminal()? {
        TaskEvent::Error { error, .. } => Some(error.code),
        _ => None,
    }
}

impl Gateway {
    /// What this request's idempotency key finds: a task to join, or the
    /// go-ahead to run; an error if the key was used for another prompt.
    pub(super) async fn known_repeat(&self, req: &TaskRequest) -> Result<Repeat, GatewayError> {
        let Some(key) = &req.idempotency_key else { return Ok(Repeat::Run { retry_of: None }) };
        let id = &req.identity;
        if let Some(existing) = self.scheduler.find_by_idempotency_key(&id.tenant, &id.application, key) {
            if existing.prompt_sha256 != req.prompt_sha256 {
                return Err(reused());
            }
            if let Some(code) = runs_again(ended_with(&existing)) {
                return Ok(Repeat::Run { retry_of: Some((existing.task_id.clone(), code)) });
            }
            if let Some(s) = self.join_repeat(&existing, req)? {
                return Ok(Repeat::Join(s));
            }
        }
        let Some(mut rec) = self.store.lookup_idempotency(&id.tenant, &id.application, key).await else {
            return Ok(Repeat::Run { retry_of: None });
        };
        // Not live here yet not ended in the store: its end may still be in
        // the store's write-behind window (review 14 M7). Once committed,
        // read again, rather than replay a task as if it had died.
        if !rec.state.is_terminal() && self.scheduler.get(&rec.task_id).is_none() {
            self.store.flush().await;
            match self.store.lookup_idempotency(&id.tenant, &id.application, key).await {
                Some(again) => rec = again,
                None => return Ok(Repeat::Run { retry_of: None }),
            }
        }
        if rec.state == TaskState::Rejected {
            return Ok(Repeat::Run { retry_of: None });
        }
        if rec.prompt_sha256 != req.prompt_sha256 {
            return Err(reused());
        }
        if rec.state.is_terminal() {
            let code = rec.error_code.as_deref().and_then(parse_code);
            if let Some(code) = runs_again(code) {
                return Ok(Repeat::Run { retry_of: Some((rec.task_id.clone(), code)) });
            }
        }
        if let Some(s) = self.scheduler.attach(&rec.task_id, 0) {
            return Ok(Repeat::Join(s));
        }
        // No answer text kept with the key (a device's derived key under
        // the default policy, a class whose `store_text` is false, a
        // user's deleted data): the repeat says so, on every ingress,
        // rather than look like an empty answer. A kept empty answer is
        // `Some("")`.
        let text_not_kept = rec.result_text.is_none();
        Ok(Repeat::Join(self.replay_stored(rec, text_not_kept)))
    }

    /// A repeat of the live task `existing` (same key): joins it from its
    /// first event if the prompt is the same, is refused if not; `None` once
    /// the task is no longer live here.
    pub(super) fn join_repeat(
        &self,
        existing: &TaskEntry,
        req: &TaskRequest,
    ) -> Result<Option<TaskStream>, GatewayError> {
        if existing.prompt_sha256 != req.prompt_sha256 {
            return Err(reused());
        }
        Ok(self.scheduler.attach(&existing.task_id, 0))
    }

    /// Keeps the key (and what is needed to run the request again after a
    /// crash) for the configured time; with `replaces`, the key moves from
    /// that earlier task to this one.
    pub(super) fn remember_key(&self, req: &TaskRequest, replaces: Option<&str>) {
        if req.idempotency_key.is_some() {
            let ttl = self.config().scheduler.idempotency_ttl.as_millis() as i64;
            self.store.remember(stored_request(req), ttl, replaces);
        }
    }

    /// This call lost the race for its key to task `winner`: the key is the
    /// winner's in the store too, whichever call was recorded first.
    pub(super) fn hand_over_key(&self, req: &TaskRequest, winner: &str) {
        if let Some(key) = &req.idempotency_key {
            let id = &req.identity;
            self.store.hand_over_key(&id.tenant, &id.application, key, &req.task_id, winner);
        }
    }

    /// Frees the key of a request that never became a task, so a retry
    /// can start one.
    pub(super) fn forget_key(&self, req: &TaskRequest) {
        if let Some(key) = &req.idempotency_key {
            let id = &req.identity;
            self.store.forget_key(&id.tenant, &id.application, key, &req.task_id);
        }
    }

    /// The outcome of a finished task as a stream: accepted, the kept
    /// answer text, then done or error.
    fn replay_stored(&self, rec: IdempotentRecord, text_not_kept: bool) -> TaskStream {
        let mut events = vec![TaskEvent::Accepted { task_id: rec.task_id.clone(), queue_position: 0 }];
        if let Some(t) = rec.result_text.filter(|t| !t.is_empty()) {
            events.push(TaskEvent::Delta { text: t });
        }
        let mut meta = rec
            .result
            .unwrap_or_else(|| ResultMeta::bare(&rec.request_id, &rec.task_id, rec.state, "", &self.config().node_id));
        meta.text_not_kept = text_not_kept && rec.state == TaskState::Succeeded;
        // The calls come back whole, one piece each, as they were kept.
        for c in &meta.tool_calls {
            events.push(TaskEvent::ToolCallDelta(crate::task::ToolCallDelta {
                index: c.index,
                id: Some(c.id.clone()),
                name: Some(c.name.clone()),
                arguments: c.arguments.clone(),
            }));
        }
        let code = rec.error_code.as_deref().and_then(parse_code);
        match (rec.state, code) {
            (TaskState::Succeeded, _) => events.push(TaskEvent::Done(Box::new(meta))),
            (_, code) => {
                let code = code.unwrap_or(ErrorCode::InternalError);
                let msg = format!("the original task ended {}", rec.state.as_str());
                events.push(TaskEvent::Error { error: GatewayError::new(code, msg), meta: Box::new(meta) });
            }
        }
        let trace_id = match events.last() {
            Some(TaskEvent::Done(m) | TaskEvent::Error { meta: m, .. }) => m.trace_id.clone().unwrap_or_default(),
            _ => String::new(),
        };
        self.scheduler.replay(&rec.task_id, &rec.request_id, &trace_id, events)
    }
}

fn parse_code(c: &str) -> Option<ErrorCode> {
    serde_json::from_value(serde_json::Value::String(c.into())).ok()
}

fn stored_request(r: &TaskRequest) -> StoredRequest {
    StoredRequest {
        task_id: r.task_id.clone(),
        request_id: r.request_id.clone(),
        trace_id: r.trace_id.clone(),
        tenant: r.identity.tenant.clone(),
        application: r.identity.application.clone(),
        user_id: r.identity.user_id.clone(),
        ingress: r.ingress.as_str().to_string(),
        logical_model: r.logical_model.clone(),
        messages: r.messages.clone(),
        params: r.params.clone(),
        priority: r.priority.as_str().to_string(),
        max_output_tokens: r.max_output_tokens,
        session_id: r.session_id.clone(),
        idempotency_key: r.idempotency_key.clone(),
        routing: r.routing.clone(),
        metadata: r.metadata.clone(),
        prompt_sha256: r.prompt_sha256.clone(),
        input_tokens_estimate: r.input_tokens_estimate,
        degrade_reason: r.degrade_reason.clone(),
        tools: r.tools.clone(),
        operation: r.operation.clone(),
    }
}
