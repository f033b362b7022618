//! A task for an identity: look it up, cancel it, follow its events. Only
//! the owning application (or an admin application of its tenant) sees a
//! task; to anyone else it does not exist. The ownership check is made
//! here, once, for every ingress.
//!
//! Owns: ownership, and the choice between the live registry and the
//! store. Does not own: how an answer is rendered (ingress).

use crate::error::GatewayError;
use crate::store::TaskRecord;
use crate::task::{Identity, Ingress, ResultMeta, TaskEvent, TaskState};

use super::{Gateway, TaskStream};

/// Whether `who` may see and cancel a task of `tenant`/`app`.
fn owns(who: &Identity, tenant: &str, app: &str) -> bool {
    who.tenant == tenant && (who.is_admin || who.application == app)
}

/// A task as stored, for its owner.
pub type TaskView = TaskRecord;

/// What a cancel by task id found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CancelOutcome {
    /// The task is known here; `cancelled` is false when it had already
    /// ended (within the retention).
    Live { cancelled: bool },
    /// The task ended before the retention; only its record is left.
    Ended { state: TaskState },
}

/// A task whose events the caller may follow. Only [`Gateway::lookup`]
/// makes one, after the ownership check.
pub struct LiveTask {
    task_id: String,
    request_id: String,
}

impl LiveTask {
    pub fn task_id(&self) -> &str {
        &self.task_id
    }

    pub fn request_id(&self) -> &str {
        &self.request_id
    }
}

/// What a request to follow a task's events found.
pub enum TaskLookup {
    /// Unknown, or not the caller's.
    NotFound,
    /// Known only from the store: its events are no longer retained.
    Gone {
        result: Option<Box<ResultMeta>>,
    },
    Live(LiveTask),
}

/// What a cancel by request id did (NATS `ai.v1.cancel`).
#[derive(Debug, Clone)]
pub struct RequestCancel {
    pub task_id: String,
    pub cancelled: bool,
    /// The final state of a task that had already ended.
    pub status: Option<TaskState>,
}

impl Gateway {
    /// The stored record of a task (state, transitions, result) for its
    /// owner; `None` when unknown or not the caller's.
    pub async fn task(&self, who: &Identity, task_id: &str) -> Result<Option<TaskView>, GatewayError> {
        self.store.flush().await;
        let rec = self.store.get(task_id).await.map_err(|e| {
            tracing::error!(error = %e, "task store read failed");
            GatewayError::internal("the task store is not available")
        })?;
        Ok(rec.filter(|r| owns(who, &r.tenant, &r.application)))
    }

    /// The Response object kept for a task (`GET /v1/responses/{id}`):
    /// for the application that created it only (not even an admin
    /// application: it is answer text), while its task is kept; and where
    /// the caller's credential names a user (a JWT's `sub`), for that user
    /// only (review 14 L2). A bare application key acts for all its users.
    pub async fn response(&self, who: &Identity, task_id: &str) -> Result<Option<String>, GatewayError> {
        let rec = self.task(who, task_id).await?;
        Ok(rec
            .filter(|r| r.application == who.application)
            .filter(|r| who.user_id.is_none() || r.user_id == who.user_id)
            .and_then(|r| r.response))
    }

    /// The Response object kept for a task and the conversation it
    /// answered (`previous_response_id`), on the same terms as
    /// [`Gateway::response`].
    /// `user` is the caller's user (its credential's, else the one it
    /// declares): a Response of another user of the same application is
    /// not found (review L6), as a session of another user is not.
    pub async fn response_with_conversation(
        &self,
        who: &Identity,
        user: Option<&str>,
        task_id: &str,
    ) -> Result<Option<(String, Option<String>)>, GatewayError> {
        let rec = self.task(who, task_id).await?;
        Ok(rec
            .filter(|r| r.application == who.application && r.user_id.as_deref() == user)
            .and_then(|r| r.response.map(|body| (body, r.response_conversation))))
    }

    /// Keeps the Response object of `task_id` with its task, and the
    /// conversation it answered.
    pub fn keep_response(&self, task_id: &str, body: String, conversation: Option<String>) {
        self.store.keep_response(task_id, body, conversation);
    }

    /// Deletes a kept Response for the application that created it;
    /// whether there was one.
    pub async fn forget_response(&self, who: &Identity, task_id: &str) -> Result<bool, GatewayError> {
        if self.response(who, task_id).await?.is_none() {
            return Ok(false);
        }
        self.store.forget_response(task_id);
        self.store.flush().await;
        Ok(true)
    }

    /// Cancels a task for its owner; `None` when unknown or not the
    /// caller's. `reason` is recorded with the cancellation.
    pub async fn cancel(&self, who: &Identity, task_id: &str, reason: &str) -> Option<CancelOutcome> {
        let Some(entry) = self.scheduler.get(task_id) else {
            // Not live here: maybe ended long ago.
            return match self.store.get(task_id).await {
                Ok(Some(rec)) if owns(who, &rec.tenant, &rec.application) => {
                    Some(CancelOutcome::Ended { state: rec.state })
                }
                _ => None,
            };
        };
        if !owns(who, &entry.tenant, &entry.application) {
            return None;
        }
        let actor = if who.application == entry.application { "client" } else { "admin" };
        Some(CancelOutcome::Live { cancelled: self.scheduler.cancel(task_id, reason, actor) })
    }

    /// Cancels a task of the caller's own application that came through
    /// the same `ingress` (NATS `ai.v1.cancel`: only NATS tasks), by its
    /// request id; `None` when no such task is known here. Request ids are
    /// chosen by callers and guessable: a device's task (MQTT) or a web
    /// app's (HTTP) is out of reach of a bus client of the same
    /// application.
    pub fn cancel_request(
        &self,
        who: &Identity,
        ingress: Ingress,
        request_id: &str,
        reason: &str,
    ) -> Option<RequestCancel> {
        let task = self.scheduler.find_by_request(&who.tenant, &who.application, ingress, request_id)?;
        let cancelled = self.scheduler.cancel(&task.task_id, reason, "client");
        let status = task.log.terminal().and_then(|e| match e {
            TaskEvent::Done(m) | TaskEvent::Error { meta: m, .. } => Some(m.status),
            _ => None,
        });
        Some(RequestCancel { task_id: task.task_id.clone(), cancelled, status })
    }

    /// A live (or recently ended) task of the caller's own application that
    /// came through `ingress`, by its request id: for the WebSocket, whose
    /// clients resume by request id on a new socket. Like
    /// [`Gateway::cancel_request`], only tasks of that ingress.
    pub fn find_request(&self, who: &Identity, ingress: Ingress, request_id: &str) -> Option<LiveTask> {
        let t = self.scheduler.find_by_request(&who.tenant, &who.application, ingress, request_id)?;
        Some(LiveTask { task_id: t.task_id.clone(), request_id: t.request_id.clone() })
    }

    /// Whether the caller may follow a task's events, and where they are.
    pub async fn lookup(&self, who: &Identity, task_id: &str) -> TaskLookup {
        let Some(entry) = self.scheduler.get(task_id) else {
            return match self.store.get(task_id).await {
                Ok(Some(rec)) if owns(who, &rec.tenant, &rec.application) => {
                    TaskLookup::Gone { result: rec.result.map(Box::new) }
                }
                _ => TaskLookup::NotFound,
            };
        };
        if !owns(who, &entry.tenant, &entry.application) {
            return TaskLookup::NotFound;
        }
        TaskLookup::Live(LiveTask { task_id: entry.task_id.clone(), request_id: entry.request_id.clone() })
    }

    /// The events of a task the caller may follow (see [`Gateway::lookup`])
    /// from `from_seq` on. Dropping the stream does not cancel the task.
    /// `None` when the task is no longer retained.
    pub fn attach(&self, task: &LiveTask, from_seq: u64) -> Option<TaskStream> {
        self.scheduler.attach(&task.task_id, from_seq)
    }
}
