//! What must survive a crash beyond the task records: idempotency keys
//! (with the outcome a repeat gets back) and the requests of idempotent
//! tasks that have not started yet (so they can be queued again after a
//! restart). Runs on the store thread, like every other write.

use rusqlite::{params, Connection, OptionalExtension};
use serde::{Deserialize, Serialize};

use super::exec;
use crate::task::{ChatMessage, ResultMeta, Routing, SamplingParams, TaskState};

pub const SCHEMA: &str = r#"
CREATE TABLE IF NOT EXISTS idempotency (
    tenant         TEXT NOT NULL,
    application    TEXT NOT NULL,
    key            TEXT NOT NULL,
    task_id        TEXT NOT NULL,
    prompt_sha256  TEXT NOT NULL,
    created_at_ms  INTEGER NOT NULL,
    expires_at_ms  INTEGER NOT NULL,
    -- The answer text, kept for the key's lifetime only, so that a repeat
    -- gets the original result (the caller opted in by sending a key).
    result_text    TEXT,
    PRIMARY KEY (tenant, application, key)
);
CREATE TABLE IF NOT EXISTS pending_requests (
    task_id       TEXT PRIMARY KEY,
    request_json  TEXT NOT NULL
);
-- API keys revoked at run time (POST /admin/keys/revoke): refused across
-- restarts until reinstated.
CREATE TABLE IF NOT EXISTS revoked_keys (
    key_sha256     TEXT PRIMARY KEY,
    revoked_at_ms  INTEGER NOT NULL,
    revoked_by     TEXT NOT NULL
);
"#;

/// Records (or, with `revoked` false, removes) a key revocation.
pub fn set_revoked(c: &Connection, key_sha256: &str, by: &str, revoked: bool, now: i64) -> rusqlite::Result<()> {
    if revoked {
        exec(
            c,
            "INSERT OR REPLACE INTO revoked_keys (key_sha256, revoked_at_ms, revoked_by) VALUES (?1, ?2, ?3)",
            params![key_sha256, now, by],
        )?;
    } else {
        exec(c, "DELETE FROM revoked_keys WHERE key_sha256 = ?1", params![key_sha256])?;
    }
    Ok(())
}

/// Digests (hex) of every revoked key.
pub fn revoked_keys(c: &Connection) -> rusqlite::Result<Vec<String>> {
    let mut st = c.prepare_cached("SELECT key_sha256 FROM revoked_keys")?;
    let rows = st.query_map([], |r| r.get::<_, String>(0))?;
    rows.collect()
}

/// Enough of a task's request to queue it again after a restart.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StoredRequest {
    pub task_id: String,
    pub request_id: String,
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
}

/// What a repeat of an idempotency key finds.
#[derive(Debug, Clone)]
pub struct IdempotentRecord {
    pub task_id: String,
    pub request_id: String,
    pub prompt_sha256: String,
    pub state: TaskState,
    pub error_code: Option<String>,
    pub result: Option<ResultMeta>,
    pub result_text: Option<String>,
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

pub fn remember_key(c: &Connection, r: &StoredRequest, ttl_ms: i64, now: i64) -> rusqlite::Result<()> {
    let Some(key) = &r.idempotency_key else { return Ok(()) };
    // An expired key may be reused.
    exec(
        c,
        "DELETE FROM idempotency WHERE tenant = ?1 AND application = ?2 AND key = ?3 AND expires_at_ms <= ?4",
        params![r.tenant, r.application, key, now],
    )?;
    exec(c,
        "INSERT OR IGNORE INTO idempotency (tenant, application, key, task_id, prompt_sha256, created_at_ms, expires_at_ms) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
        params![r.tenant, r.application, key, r.task_id, r.prompt_sha256, now, now + ttl_ms],
    )?;
    exec(
        c,
        "INSERT OR REPLACE INTO pending_requests (task_id, request_json) VALUES (?1, ?2)",
        params![r.task_id, serde_json::to_string(r).unwrap_or_default()],
    )?;
    Ok(())
}

/// The task started (or ended): it can no longer be re-queued.
pub fn started(c: &Connection, task_id: &str) -> rusqlite::Result<()> {
    exec(c, "DELETE FROM pending_requests WHERE task_id = ?1", params![task_id])?;
    Ok(())
}

pub fn forget(c: &Connection, tenant: &str, app: &str, key: &str, task_id: &str) -> rusqlite::Result<()> {
    exec(
        c,
        "DELETE FROM idempotency WHERE tenant = ?1 AND application = ?2 AND key = ?3 AND task_id = ?4",
        params![tenant, app, key, task_id],
    )?;
    exec(c, "DELETE FROM pending_requests WHERE task_id = ?1", params![task_id])?;
    Ok(())
}

pub fn keep_result(c: &Connection, task_id: &str, text: &str) -> rusqlite::Result<()> {
    exec(c, "UPDATE idempotency SET result_text = ?2 WHERE task_id = ?1", params![task_id, text])?;
    Ok(())
}

pub fn lookup(
    c: &Connection,
    tenant: &str,
    app: &str,
    key: &str,
    now: i64,
) -> rusqlite::Result<Option<IdempotentRecord>> {
    c.prepare_cached(
        "SELECT i.task_id, t.request_id, i.prompt_sha256, t.state, t.error_code, t.result_json, i.result_text \
         FROM idempotency i JOIN tasks t ON t.task_id = i.task_id \
         WHERE i.tenant = ?1 AND i.application = ?2 AND i.key = ?3 AND i.expires_at_ms > ?4",
    )?
    .query_row(params![tenant, app, key, now], |row| {
        let state: String = row.get(3)?;
        let result: Option<String> = row.get(5)?;
        Ok(IdempotentRecord {
            task_id: row.get(0)?,
            request_id: row.get(1)?,
            prompt_sha256: row.get(2)?,
            state: TaskState::parse(&state).unwrap_or(TaskState::Failed),
            error_code: row.get(4)?,
            result: result.and_then(|j| serde_json::from_str(&j).ok()),
            result_text: row.get(6)?,
        })
    })
    .optional()
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

/// Drops expired keys (and their kept answers).
pub fn expire(c: &Connection, now: i64) -> rusqlite::Result<usize> {
    exec(c, "DELETE FROM idempotency WHERE expires_at_ms <= ?1", params![now])
}
