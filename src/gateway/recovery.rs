//! Crash recovery: the tasks that were not terminal when the gateway last
//! stopped, and the sessions the store kept. Runs once, before the
//! listeners open.
//!
//! Owns: the choice between queueing a task again and ending it FAILED.
//! Does not own: what the store kept (store) or queueing (scheduler).

use crate::error::ErrorCode;
use crate::store::StoredRequest;
use crate::task::{Identity, Ingress, Priority, ResultMeta, TaskRequest, TaskState};

use super::Gateway;

impl Gateway {
    /// Ends or re-queues the tasks that were not terminal when the gateway
    /// last stopped (a crash or `kill -9`): tasks that never started and
    /// carry an idempotency key are queued again; every other one ends
    /// FAILED with the reason. Runs before the listeners open.
    pub async fn recover(&self) -> (usize, usize) {
        // The sessions the store kept come back first: a re-queued task
        // of a session holds its turn again and appends it when it ends
        // (`resume_turn`), and a call arriving once the listeners open must
        // find its session.
        let restored = self.sessions.restore().await;
        if restored > 0 {
            tracing::info!(restored, "sessions restored from the store");
        }
        let (mut requeued, mut failed) = (0, 0);
        for u in self.store.unfinished().await {
            // From here on, what is written for the task is checked against
            // the state machine like any transition of this run.
            self.recorder.adopt(&u.task_id, u.state);
            // Re-queued only if it never started: it was waiting (a retry
            // or a preemption also goes back to QUEUED, but a started task
            // has no pending request left, see `Store::started`).
            let waiting = matches!(u.state, TaskState::Validating | TaskState::Queued);
            let rebuilt = match (&u.request, waiting) {
                (Some(r), true) => Some(self.rebuild(r)),
                _ => None,
            };
            let mut why = None;
            match rebuilt {
                Some(Ok(req)) => {
                    let turn = self.resume_turn(&req).await;
                    let task_id = req.task_id.clone();
                    match self.scheduler.resubmit(req).await {
                        Ok(()) => {
                            if let Some(turn) = turn {
                                self.follow_turn(turn, &task_id);
                            }
                            requeued += 1;
                            continue;
                        }
                        Err(e) => tracing::warn!(task_id = %u.task_id, error = %e, "could not re-queue task"),
                    }
                }
                Some(Err(e)) => why = Some(e),
                None => {}
            }
            failed += 1;
            let mut reason = format!("gateway restarted while the task was {}", u.state.as_str());
            if let Some(why) = why {
                reason = format!("{reason}; not queued again: {why}");
            }
            let mut meta = ResultMeta::bare(
                &u.request_id,
                &u.task_id,
                TaskState::Failed,
                &u.logical_model,
                &self.config().node_id,
            );
            meta.session_id = u.session_id.clone();
            self.recorder.end_recovered(&meta, &reason, ErrorCode::InternalError.as_str());
        }
        if requeued + failed > 0 {
            tracing::warn!(requeued, failed, "recovered tasks left unfinished by the last run");
        }
        (requeued, failed)
    }

    /// A task request again from what the store kept, if admission's rules
    /// under the config of this run still let it run: its application and
    /// model exist, the model serves its operation, and its tools are
    /// allowed and reach every model it may be routed to. `Err` says why
    /// not (the task then ends FAILED with it).
    fn rebuild(&self, r: &StoredRequest) -> Result<TaskRequest, String> {
        let config = self.config();
        let app = config
            .applications
            .get(&r.application)
            .ok_or_else(|| format!("application '{}' is no longer configured", r.application))?;
        let model = config
            .models
            .get(&r.logical_model)
            .ok_or_else(|| format!("model '{}' is no longer configured", r.logical_model))?;
        let priority = Priority::parse(&r.priority).ok_or_else(|| format!("unknown priority {:?}", r.priority))?;
        crate::admission::operation::check_model(model, &r.operation, r.idempotency_key.as_deref())
            .map_err(|e| e.message)?;
        // Its tools must still be allowed and reach every instance it may
        // be routed to (the config may have changed since): else it ends
        // failed rather than run without them.
        let class = r.routing.data_class.unwrap_or(self.config().routing.default_data_class);
        let mut allow_smaller_model = r.routing.allow_smaller_model || app.allow_smaller_model;
        if let Some(tools) = &r.tools {
            if let Some(name) = crate::admission::disallowed_tool(Some(app), tools) {
                return Err(format!("application '{}' may no longer declare tool '{name}'", app.name));
            }
            allow_smaller_model &= crate::admission::tools_route(&self.config(), model, tools, class)?;
        }
        let ingress = match r.ingress.as_str() {
            "mqtt" => Ingress::Mqtt,
            "nats" => Ingress::Nats,
            "ws" => Ingress::Ws,
            _ => Ingress::Http,
        };
        Ok(TaskRequest {
            task_id: r.task_id.clone(),
            request_id: r.request_id.clone(),
            // The same trace as before the restart.
            trace_id: if crate::telemetry::trace::valid_trace_id(&r.trace_id) {
                r.trace_id.clone()
            } else {
                crate::telemetry::trace::new_trace_id()
            },
            // A new span: the run before the restart had its own.
            span_id: crate::telemetry::trace::new_span_id(),
            parent_span_id: None,
            identity: Identity {
                tenant: app.tenant.clone(),
                application: app.name.clone(),
                user_id: r.user_id.clone(),
                max_priority: app.max_priority,
                default_priority: app.default_priority,
                is_admin: app.admin,
                credential: None,
                // The class the task was admitted under is in its routing.
                data_class: None,
            },
            ingress,
            logical_model: model.name.clone(),
            messages: r.messages.clone(),
            params: r.params.clone(),
            priority,
            max_output_tokens: r.max_output_tokens.min(model.max_output_tokens),
            timeouts: self.config().timeouts,
            session_id: r.session_id.clone(),
            idempotency_key: r.idempotency_key.clone(),
            routing: r.routing.clone(),
            data_class: crate::admission::data_class(&self.config(), &app.tenant, Some(app), None, &r.routing),
            allow_smaller_model,
            metadata: r.metadata.clone(),
            input_tokens_estimate: r.input_tokens_estimate,
            prompt_sha256: r.prompt_sha256.clone(),
            received_at: std::time::Instant::now(),
            received_wall: std::time::SystemTime::now(),
            degrade_reason: r.degrade_reason.clone(),
            tools: r.tools.clone(),
            operation: r.operation.clone(),
            // The stored messages are the prompt as assembled; what the
            // assembly did is not kept apart (the result says nothing).
            context: None,
        })
    }
}
