//! Stored Responses (`POST /v1/responses` with `store`): the Response
//! object as its create call returned it, kept beside its task so that
//! `GET /v1/responses/{id}` can return it again. Runs on the store thread.
//!
//! Does not own: whether a response is kept (the HTTP ingress decides, by
//! the request's `store` and the data policy) or who may read it (the
//! task's owner: the facade checks). A response lives as long as its task
//! row: the retention purge deletes both.

use rusqlite::{params, Connection, OptionalExtension};

use super::exec;

pub const SCHEMA: &str = r#"
CREATE TABLE IF NOT EXISTS responses (
    task_id  TEXT PRIMARY KEY,
    body     TEXT NOT NULL
);
"#;

/// Keeps (or replaces) the Response of `task_id`.
pub fn keep(c: &Connection, task_id: &str, body: &str) -> rusqlite::Result<()> {
    exec(c, "INSERT OR REPLACE INTO responses (task_id, body) VALUES (?1, ?2)", params![task_id, body])?;
    Ok(())
}

/// Deletes the Response of `task_id`, if any.
pub fn forget(c: &Connection, task_id: &str) -> rusqlite::Result<()> {
    exec(c, "DELETE FROM responses WHERE task_id = ?1", params![task_id])?;
    Ok(())
}

/// The Response of `task_id`, if one is kept.
pub fn get(c: &Connection, task_id: &str) -> rusqlite::Result<Option<String>> {
    c.prepare_cached("SELECT body FROM responses WHERE task_id = ?1")?
        .query_row(params![task_id], |r| r.get(0))
        .optional()
}
