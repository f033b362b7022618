//! Stored Responses (`POST /v1/responses` with `store`): the Response
//! object as its create call returned it, kept beside its task so that
//! `GET /v1/responses/{id}` can return it again, and the conversation that
//! led to it (the chat messages of its `input`, after those of its
//! `previous_response_id` chain, without its `instructions`), so that a
//! later request can continue from it. Runs on the store thread.
//!
//! Does not own: whether a response is kept (the HTTP ingress decides, by
//! the request's `store` and the data policy), who may read it (the
//! task's owner: the facade checks) or how a conversation is continued
//! (the HTTP ingress). A response lives as long as its task row: the
//! retention purge deletes both ([`forget`]).

use rusqlite::{params, Connection, OptionalExtension};

use super::exec;

/// Two tables, so that a database of an earlier version (a `responses`
/// table without conversations) needs no migration: its Responses are
/// continued from their output alone.
pub const SCHEMA: &str = r#"
CREATE TABLE IF NOT EXISTS responses (
    task_id  TEXT PRIMARY KEY,
    body     TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS response_conversations (
    task_id  TEXT PRIMARY KEY,
    messages TEXT NOT NULL
);
"#;

/// Keeps (or replaces) the Response of `task_id`, and the conversation
/// (a JSON list of chat messages) it answered.
pub fn keep(c: &Connection, task_id: &str, body: &str, conversation: Option<&str>) -> rusqlite::Result<()> {
    exec(c, "INSERT OR REPLACE INTO responses (task_id, body) VALUES (?1, ?2)", params![task_id, body])?;
    if let Some(m) = conversation {
        exec(
            c,
            "INSERT OR REPLACE INTO response_conversations (task_id, messages) VALUES (?1, ?2)",
            params![task_id, m],
        )?;
    }
    Ok(())
}

/// Deletes the Response of `task_id` and its conversation, if any.
pub fn forget(c: &Connection, task_id: &str) -> rusqlite::Result<()> {
    exec(c, "DELETE FROM responses WHERE task_id = ?1", params![task_id])?;
    exec(c, "DELETE FROM response_conversations WHERE task_id = ?1", params![task_id])?;
    Ok(())
}

/// The Response of `task_id`, if one is kept.
pub fn get(c: &Connection, task_id: &str) -> rusqlite::Result<Option<String>> {
    c.prepare_cached("SELECT body FROM responses WHERE task_id = ?1")?
        .query_row(params![task_id], |r| r.get(0))
        .optional()
}

/// The conversation the Response of `task_id` answered, if it is kept.
pub fn conversation(c: &Connection, task_id: &str) -> rusqlite::Result<Option<String>> {
    c.prepare_cached("SELECT messages FROM response_conversations WHERE task_id = ?1")?
        .query_row(params![task_id], |r| r.get(0))
        .optional()
}
