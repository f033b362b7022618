//! Task lifecycle recording: every state change of every task, whatever its
//! ingress, goes through the [`Recorder`], which writes it to the task store
//! and offers it to in-process subscribers (the NATS event publisher, tests)
//! on a bounded broadcast channel. A slow subscriber loses events (and
//! counts them) instead of slowing the request path.

use std::sync::Arc;

use serde::Serialize;
use tokio::sync::broadcast;

use crate::error::GatewayError;
use crate::store::Store;
use crate::task::{Identity, Ingress, ResultMeta, TaskRequest, TaskState};

/// One state change, as published to subscribers. Never carries prompt or
/// result text.
#[derive(Debug, Clone, Serialize)]
pub struct LifecycleEvent {
    pub task_id: String,
    pub request_id: String,
    pub tenant: String,
    pub application: String,
    pub user_id: Option<String>,
    pub ingress: &'static str,
    pub logical_model: String,
    pub priority: &'static str,
    pub state: TaskState,
    pub at_ms: i64,
    pub reason: String,
    pub node_id: String,
    pub instance: Option<String>,
    pub actor: &'static str,
    /// Set on terminal states.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error_code: Option<&'static str>,
    /// Set on terminal states of tasks that were queued.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub result: Option<ResultMeta>,
}

#[derive(Clone)]
pub struct Recorder {
    store: Store,
    tx: broadcast::Sender<Arc<LifecycleEvent>>,
}

/// Events buffered per subscriber before the slowest one starts losing them.
const BROADCAST_CAPACITY: usize = 4096;

impl Recorder {
    pub fn new(store: Store) -> Recorder {
        let (tx, _) = broadcast::channel(BROADCAST_CAPACITY);
        Recorder { store, tx }
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    pub fn subscribe(&self) -> broadcast::Receiver<Arc<LifecycleEvent>> {
        self.tx.subscribe()
    }

    /// Records a new task at RECEIVED.
    pub fn received(&self, req: &TaskRequest) {
        self.store.new_task(req);
        self.transition(req, TaskState::Received, req.ingress.as_str(), None, "client");
    }

    pub fn transition(
        &self,
        req: &TaskRequest,
        state: TaskState,
        reason: &str,
        instance: Option<&str>,
        actor: &'static str,
    ) {
        self.store.transition(&req.task_id, state, reason, instance, actor);
        self.publish(req, state, reason, instance, actor, None, None);
    }

    /// Records the terminal state with the result metadata.
    #[allow(clippy::too_many_arguments)]
    pub fn finished(
        &self,
        req: &TaskRequest,
        meta: &ResultMeta,
        reason: &str,
        instance: Option<&str>,
        actor: &'static str,
        error_code: Option<&'static str>,
        result_text: Option<String>,
    ) {
        self.store.transition(&req.task_id, meta.status, reason, instance, actor);
        self.store.finish(meta, error_code, result_text, req.idempotency_key.is_some());
        self.publish(req, meta.status, reason, instance, actor, error_code, Some(meta));
    }

    /// Records a call refused at admission (before it had a validated task).
    pub fn rejected(&self, who: &Identity, ingress: Ingress, model: &str, request_id: Option<&str>, e: &GatewayError) {
        let task_id = self.store.rejected(who, ingress, model, e);
        if self.tx.receiver_count() == 0 {
            return;
        }
        let _ = self.tx.send(Arc::new(LifecycleEvent {
            task_id,
            request_id: request_id.unwrap_or_default().to_string(),
            tenant: who.tenant.clone(),
            application: who.application.clone(),
            user_id: who.user_id.clone(),
            ingress: ingress.as_str(),
            logical_model: model.chars().take(128).collect(),
            priority: "",
            state: TaskState::Rejected,
            at_ms: crate::task::now_ms(),
            reason: e.message.clone(),
            node_id: self.store.node_id().to_string(),
            instance: None,
            actor: "gateway",
            error_code: Some(e.code.as_str()),
            result: None,
        }));
    }

    #[allow(clippy::too_many_arguments)]
    fn publish(
        &self,
        req: &TaskRequest,
        state: TaskState,
        reason: &str,
        instance: Option<&str>,
        actor: &'static str,
        error_code: Option<&'static str>,
        meta: Option<&ResultMeta>,
    ) {
        if self.tx.receiver_count() == 0 {
            return;
        }
        let _ = self.tx.send(Arc::new(LifecycleEvent {
            task_id: req.task_id.clone(),
            request_id: req.request_id.clone(),
            tenant: req.identity.tenant.clone(),
            application: req.identity.application.clone(),
            user_id: req.identity.user_id.clone(),
            ingress: req.ingress.as_str(),
            logical_model: req.logical_model.clone(),
            priority: req.priority.as_str(),
            state,
            at_ms: crate::task::now_ms(),
            reason: reason.to_string(),
            node_id: self.store.node_id().to_string(),
            instance: instance.map(str::to_string),
            actor,
            error_code,
            result: meta.cloned(),
        }));
    }
}
