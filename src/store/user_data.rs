//! Deleting one user's data (`DELETE /admin/users/{user}/data`): the
//! prompt and answer text of the user's tasks, the answers kept with their
//! idempotency keys, their stored Responses, the requests kept to re-queue
//! them, and the user's sessions with their history and memory, in one
//! transaction with the audit record that says so.
//!
//! What stays: the task rows and transitions (ids, model, state, usage:
//! the record of what ran, purged by retention as any other) and the audit
//! records (they hold no text). The writer's connection runs with
//! `secure_delete`, so the deleted text is overwritten in the database
//! file, and the WAL is checkpointed and truncated afterwards, so no older
//! copy of a page stays in it (see [`checkpoint`]).
//!
//! Does not own: who may ask (gateway), the user's sessions in memory
//! (`crate::context::sessions`), or the audit chain (`audit.rs`).

use rusqlite::{params, Connection};
use serde::Serialize;

use super::{exec, sessions};

/// What a deletion removed, by kind.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct UserDataDeleted {
    /// Tasks of the user that had prompt or answer text; it is gone.
    pub task_texts: u64,
    /// Answers kept with an idempotency key (a repeat now gets the outcome
    /// without the text).
    pub idempotency_answers: u64,
    /// Stored Responses (`GET /v1/responses/{id}` now answers 404).
    pub responses: u64,
    /// Requests kept to re-queue a task after a crash.
    pub pending_requests: u64,
    /// Sessions, with their history and memory, in the store.
    pub sessions: u64,
}

/// Deletes the data of `user` of `tenant` (see the module doc); returns
/// the counts and the ids of the user's tasks (for what callers keep in
/// memory). The user's tasks are found by a scan of `tasks` (no index on
/// the user: a deletion is rare, every task write would pay for one).
pub fn forget(c: &Connection, tenant: &str, user: &str) -> rusqlite::Result<(UserDataDeleted, Vec<String>)> {
    let mut d = UserDataDeleted::default();
    let ids: Vec<String> = c
        .prepare("SELECT task_id FROM tasks WHERE tenant = ?1 AND user_id = ?2")?
        .query_map(params![tenant, user], |r| r.get(0))?
        .collect::<rusqlite::Result<_>>()?;
    for id in &ids {
        d.task_texts += exec(
            c,
            "UPDATE tasks SET prompt_text = NULL, result_text = NULL \
             WHERE task_id = ?1 AND (prompt_text IS NOT NULL OR result_text IS NOT NULL)",
            params![id],
        )? as u64;
        d.idempotency_answers += exec(
            c,
            "UPDATE idempotency SET result_text = NULL WHERE task_id = ?1 AND result_text IS NOT NULL",
            params![id],
        )? as u64;
        d.responses += exec(c, "DELETE FROM responses WHERE task_id = ?1", params![id])? as u64;
        exec(c, "DELETE FROM response_conversations WHERE task_id = ?1", params![id])?;
        d.pending_requests += exec(c, "DELETE FROM pending_requests WHERE task_id = ?1", params![id])? as u64;
    }
    let sessions_of: Vec<String> = c
        .prepare("SELECT session_id FROM sessions WHERE tenant = ?1 AND user_id = ?2")?
        .query_map(params![tenant, user], |r| r.get(0))?
        .collect::<rusqlite::Result<_>>()?;
    for s in &sessions_of {
        sessions::delete(c, s)?;
    }
    d.sessions = sessions_of.len() as u64;
    Ok((d, ids))
}

/// After a deletion: the WAL is copied into the database and truncated,
/// so the frames that held the text before it (older copies of the
/// pages) are no longer in any file. Returns whether the whole WAL was
/// checkpointed (a reader in the middle of a long read can hold part of
/// it back; the next checkpoint then finishes it).
pub fn checkpoint(c: &Connection) -> rusqlite::Result<bool> {
    let busy: i64 = c.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |r| r.get(0))?;
    Ok(busy == 0)
}

/// What [`super::Store::forget_user`] did.
#[derive(Debug, Clone)]
pub struct UserDataForgotten {
    pub deleted: UserDataDeleted,
    /// The user's tasks (their rows stay, without text).
    pub task_ids: Vec<String>,
    /// The audit record of the deletion.
    pub audit_seq: i64,
    /// Whether the WAL was wholly checkpointed and truncated.
    pub wal_truncated: bool,
}
