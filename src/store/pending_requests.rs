//! Requests kept to queue a task again after a crash: the request of each
//! idempotent task that has not started on an engine yet, and the query
//! that lists every task the last run left unfinished (read once at
//! start-up by recovery). Runs on the store thread, like every other write.
//!
//! Does not own: the idempotency key itself ([`super::idempotency`]) or the
//! decision to re-queue or end a task (gateway recovery).

use rusqlite::{params, Connection};
use serde::{Deserialize, Serialize};

use super::exec;
use crate::task::{ChatMessage, Operation, Routing, SamplingParams, TaskState};

pub const SCHEMA: &str = r#"
CREATE TABLE IF NOT EXISTS pending_requests (
    task_id       TEXT PRIMARY KEY,
    request_json  TEXT NOT NULL
);
"#;

/// Enough of a task's request to queue it again after a restart.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StoredRequest {
    pub task_id: String,
    pub request_id: String,
    /// Empty in requests kept before trace ids.
    #[serde(default)]
    pub trace_id: String,
    pub tenant: String,
    pub application: String,
    pub user_id: Option<String>,
    pub ingress: String,
    pub logical_model: String,
    pub messages: Vec<ChatMessage>,
    pub params: SamplingParams,
    pub priority: String,
    pub max_output_tokens: u32,
    pub session_id: Option<String>,
    pub idempotency_key: Option<String>,
    pub routing: Routing,
    pub metadata: serde_json::Map<String, serde_json::Value>,
    pub prompt_sha256: String,
    pub input_tokens_estimate: u32,
    pub degrade_reason: Option<String>,
    /// The request's tools (absent in requests kept before tool calling).
    #[serde(default)]
    pub tools: Option<crate::task::ToolSet>,
    /// A chat in requests kept before operations were.
    #[serde(default)]
    pub operation: Operation,
}

/// A task that was not terminal when the gateway stopped.
#[derive(Debug, Clone)]
pub struct Unfinished {
    pub task_id: String,
    pub request_id: String,
    pub tenant: String,
    pub application: String,
    pub logical_model: String,
    pub session_id: Option<String>,
    pub state: TaskState,
    pub request: Option<StoredRequest>,
}

pub fn keep(c: &Connection, r: &StoredRequest) -> rusqlite::Result<()> {
    exec(
        c,
        "INSERT OR REPLACE INTO pending_requests (task_id, request_json) VALUES (?1, ?2)",
        params![r.task_id, serde_json::to_string(r).unwrap_or_default()],
    )?;
    Ok(())
}

/// The task started (or ended, or was refused): it can no longer be
/// re-queued.
pub fn drop_request(c: &Connection, task_id: &str) -> rusqlite::Result<()> {
    exec(c, "DELETE FROM pending_requests WHERE task_id = ?1", params![task_id])?;
    Ok(())
}

/// Every task not in a terminal state (read at start-up, before new work).
pub fn unfinished(c: &Connection) -> rusqlite::Result<Vec<Unfinished>> {
    let mut stmt = c.prepare(
        "SELECT t.task_id, t.request_id, t.tenant, t.application, t.logical_model, t.session_id, t.state, p.request_json \
         FROM tasks t LEFT JOIN pending_requests p ON p.task_id = t.task_id \
         WHERE t.state NOT IN ('SUCCEEDED', 'FAILED', 'CANCELLED', 'TIMED_OUT', 'REJECTED') ORDER BY t.created_at_ms",
    )?;
    let rows = stmt.query_map([], |row| {
        let state: String = row.get(6)?;
        let req: Option<String> = row.get(7)?;
        Ok(Unfinished {
            task_id: row.get(0)?,
            request_id: row.get(1)?,
            tenant: row.get(2)?,
            application: row.get(3)?,
            logical_model: row.get(4)?,
            session_id: row.get(5)?,
            state: TaskState::parse(&state).unwrap_or(TaskState::Received),
            request: req.and_then(|j| serde_json::from_str(&j).ok()),
        })
    })?;
    rows.collect()
}
