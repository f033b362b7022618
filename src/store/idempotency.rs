//! Idempotency keys: per tenant and application, the task a key started and
//! (for the key's lifetime) the answer a repeat gets back. Runs on the store
//! thread, like every other write.
//!
//! Does not own: the request kept to re-queue a task after a restart
//! ([`super::pending_requests`]) or the decision to join or replay (gateway).

use rusqlite::{params, Connection, OptionalExtension};

use super::exec;
use crate::task::{ResultMeta, TaskState};

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
-- Answers are kept, and the retention purge checks keys, by task.
CREATE INDEX IF NOT EXISTS idempotency_by_task ON idempotency(task_id);
"#;

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

/// Records the key of task `task_id` for `ttl_ms` (a live key is kept: the
/// first task to use it wins).
#[allow(clippy::too_many_arguments)]
pub fn remember(
    c: &Connection,
    tenant: &str,
    app: &str,
    key: &str,
    task_id: &str,
    prompt_sha256: &str,
    ttl_ms: i64,
    now: i64,
) -> rusqlite::Result<()> {
    // An expired key may be reused.
    exec(
        c,
        "DELETE FROM idempotency WHERE tenant = ?1 AND application = ?2 AND key = ?3 AND expires_at_ms <= ?4",
        params![tenant, app, key, now],
    )?;
    exec(c,
        "INSERT OR IGNORE INTO idempotency (tenant, application, key, task_id, prompt_sha256, created_at_ms, expires_at_ms) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
        params![tenant, app, key, task_id, prompt_sha256, now, now + ttl_ms],
    )?;
    Ok(())
}

/// Forgets the key if it still belongs to `task_id`.
pub fn forget(c: &Connection, tenant: &str, app: &str, key: &str, task_id: &str) -> rusqlite::Result<()> {
    exec(
        c,
        "DELETE FROM idempotency WHERE tenant = ?1 AND application = ?2 AND key = ?3 AND task_id = ?4",
        params![tenant, app, key, task_id],
    )?;
    Ok(())
}

/// Moves the key from task `from` to task `to` if `from` holds it.
pub fn hand_over(c: &Connection, tenant: &str, app: &str, key: &str, from: &str, to: &str) -> rusqlite::Result<()> {
    exec(
        c,
        "UPDATE idempotency SET task_id = ?5 WHERE tenant = ?1 AND application = ?2 AND key = ?3 AND task_id = ?4",
        params![tenant, app, key, from, to],
    )?;
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

/// Drops expired keys (and their kept answers).
pub fn expire(c: &Connection, now: i64) -> rusqlite::Result<usize> {
    exec(c, "DELETE FROM idempotency WHERE expires_at_ms <= ?1", params![now])
}
