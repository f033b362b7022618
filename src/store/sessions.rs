//! Sessions as stored (`/v1/sessions`): one row per session with its
//! owner, limits and counts, its messages (the raw history) and its memory
//! entries. Runs on the store thread.
//!
//! Does not own: whether a session is written at all (the session
//! registry in `crate::context::sessions` writes only sessions that persist
//! and only where the data policy lets the store keep text), who may see
//! one, or the limits themselves. Each row carries the time it expires
//! (`expires_at_ms`: the earlier of its lifetime and its idle expiry), so the
//! retention pass deletes what has expired without knowing the limits.
//! The summary columns hold the session's summary of its older turns
//! (`crate::context::summary`): its version, model, time and how many of
//! the oldest messages it replaces (`summary_covers`, added to stores made
//! before it by [`migrate`]); its text is written only as the session's
//! messages are, where the store may keep text.

use rusqlite::{params, Connection};

use super::exec;

pub const SCHEMA: &str = r#"
CREATE TABLE IF NOT EXISTS sessions (
    session_id      TEXT PRIMARY KEY,
    tenant          TEXT NOT NULL,
    application     TEXT NOT NULL,
    user_id         TEXT,
    created_at_ms   INTEGER NOT NULL,
    last_used_ms    INTEGER NOT NULL,
    expires_at_ms   INTEGER NOT NULL,
    max_lifetime_ms INTEGER NOT NULL,
    idle_expiry_ms  INTEGER NOT NULL,
    max_messages    INTEGER NOT NULL,
    max_tokens      INTEGER NOT NULL,
    message_count   INTEGER NOT NULL,
    tokens          INTEGER NOT NULL,
    persist         INTEGER NOT NULL,
    metadata        TEXT NOT NULL,
    summary_text    TEXT,
    summary_version INTEGER,
    summary_model   TEXT,
    summary_at_ms   INTEGER,
    summary_covers  INTEGER
);
CREATE INDEX IF NOT EXISTS sessions_by_owner ON sessions(tenant, application, user_id);
CREATE INDEX IF NOT EXISTS sessions_by_expiry ON sessions(expires_at_ms);
CREATE TABLE IF NOT EXISTS session_messages (
    session_id  TEXT NOT NULL,
    seq         INTEGER NOT NULL,
    role        TEXT NOT NULL,
    content     TEXT NOT NULL,
    tokens      INTEGER NOT NULL,
    task_id     TEXT,
    at_ms       INTEGER NOT NULL,
    PRIMARY KEY (session_id, seq)
);
CREATE TABLE IF NOT EXISTS session_memory (
    session_id  TEXT NOT NULL,
    key         TEXT NOT NULL,
    tags        TEXT NOT NULL,
    content     TEXT NOT NULL,
    source      TEXT NOT NULL,
    at_ms       INTEGER NOT NULL,
    PRIMARY KEY (session_id, key)
);
"#;

/// A session's row (everything but its messages and memory).
#[derive(Debug, Clone, PartialEq)]
pub struct SessionRow {
    pub session_id: String,
    pub tenant: String,
    pub application: String,
    pub user_id: Option<String>,
    pub created_at_ms: i64,
    pub last_used_ms: i64,
    pub expires_at_ms: i64,
    pub max_lifetime_ms: i64,
    pub idle_expiry_ms: i64,
    pub max_messages: u32,
    pub max_tokens: u64,
    pub message_count: u32,
    pub tokens: u64,
    /// JSON object given at creation.
    pub metadata: String,
    /// The session's summary, once one is made.
    pub summary: Option<SummaryRow>,
}

/// A session's summary as stored.
#[derive(Debug, Clone, PartialEq)]
pub struct SummaryRow {
    pub text: String,
    pub version: u32,
    pub model: String,
    pub at_ms: i64,
    /// How many of the session's oldest messages it replaces.
    pub covers: u32,
}

/// Adds the columns later versions added to a store made before them
/// (SQLite has no `ADD COLUMN IF NOT EXISTS`).
pub fn migrate(c: &Connection) -> rusqlite::Result<()> {
    let has: bool =
        c.prepare("SELECT 1 FROM pragma_table_info('sessions') WHERE name = 'summary_covers'")?.exists([])?;
    if !has {
        c.execute_batch("ALTER TABLE sessions ADD COLUMN summary_covers INTEGER")?;
    }
    Ok(())
}

/// One message of a session's history. `content` is the message content
/// as JSON text (a string, content parts or null), after redaction; for a
/// message with other fields (an answer's `tool_calls`, a tool result's
/// `tool_call_id`) a JSON object of those fields and `content`.
#[derive(Debug, Clone, PartialEq)]
pub struct MessageRow {
    pub session_id: String,
    pub seq: u32,
    pub role: String,
    pub content: String,
    pub tokens: u32,
    pub task_id: Option<String>,
    pub at_ms: i64,
}

/// A long-term memory entry, written through the API.
#[derive(Debug, Clone, PartialEq)]
pub struct MemoryRow {
    pub session_id: String,
    pub key: String,
    /// JSON array of strings.
    pub tags: String,
    pub content: String,
    /// Who wrote it (`application[/user]`).
    pub source: String,
    pub at_ms: i64,
}

/// A session with its history and memory, as loaded at start-up.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredSession {
    pub row: SessionRow,
    pub messages: Vec<MessageRow>,
    pub memory: Vec<MemoryRow>,
}

/// Writes (or replaces) a session's row.
pub fn upsert(c: &Connection, r: &SessionRow) -> rusqlite::Result<()> {
    exec(
        c,
        "INSERT INTO sessions (session_id, tenant, application, user_id, created_at_ms, last_used_ms, \
         expires_at_ms, max_lifetime_ms, idle_expiry_ms, max_messages, max_tokens, message_count, tokens, \
         persist, metadata, summary_text, summary_version, summary_model, summary_at_ms, summary_covers) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, 1, ?14, ?15, ?16, ?17, ?18, ?19) \
         ON CONFLICT(session_id) DO UPDATE SET last_used_ms = excluded.last_used_ms, \
         expires_at_ms = excluded.expires_at_ms, idle_expiry_ms = excluded.idle_expiry_ms, message_count = excluded.message_count, \
         tokens = excluded.tokens, summary_text = excluded.summary_text, \
         summary_version = excluded.summary_version, summary_model = excluded.summary_model, \
         summary_at_ms = excluded.summary_at_ms, summary_covers = excluded.summary_covers",
        params![
            r.session_id,
            r.tenant,
            r.application,
            r.user_id,
            r.created_at_ms,
            r.last_used_ms,
            r.expires_at_ms,
            r.max_lifetime_ms,
            r.idle_expiry_ms,
            r.max_messages,
            r.max_tokens as i64,
            r.message_count,
            r.tokens as i64,
            r.metadata,
            r.summary.as_ref().map(|m| &m.text),
            r.summary.as_ref().map(|m| m.version),
            r.summary.as_ref().map(|m| &m.model),
            r.summary.as_ref().map(|m| m.at_ms),
            r.summary.as_ref().map(|m| m.covers),
        ],
    )?;
    Ok(())
}

pub fn add_message(c: &Connection, m: &MessageRow) -> rusqlite::Result<()> {
    exec(
        c,
        "INSERT OR REPLACE INTO session_messages (session_id, seq, role, content, tokens, task_id, at_ms) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
        params![m.session_id, m.seq, m.role, m.content, m.tokens, m.task_id, m.at_ms],
    )?;
    Ok(())
}

pub fn put_memory(c: &Connection, m: &MemoryRow) -> rusqlite::Result<()> {
    exec(
        c,
        "INSERT OR REPLACE INTO session_memory (session_id, key, tags, content, source, at_ms) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
        params![m.session_id, m.key, m.tags, m.content, m.source, m.at_ms],
    )?;
    Ok(())
}

pub fn clear_memory(c: &Connection, session_id: &str) -> rusqlite::Result<()> {
    exec(c, "DELETE FROM session_memory WHERE session_id = ?1", params![session_id])?;
    Ok(())
}

/// Deletes a session with its history and memory.
pub fn delete(c: &Connection, session_id: &str) -> rusqlite::Result<()> {
    exec(c, "DELETE FROM session_messages WHERE session_id = ?1", params![session_id])?;
    clear_memory(c, session_id)?;
    exec(c, "DELETE FROM sessions WHERE session_id = ?1", params![session_id])?;
    Ok(())
}

/// Deletes up to `batch` sessions that expired before `now`; how many went.
pub fn purge_expired(c: &Connection, now: i64, batch: usize) -> rusqlite::Result<usize> {
    let limit = i64::try_from(batch).unwrap_or(i64::MAX);
    let ids: Vec<String> = c
        .prepare_cached("SELECT session_id FROM sessions WHERE expires_at_ms < ?1 LIMIT ?2")?
        .query_map(params![now, limit], |r| r.get(0))?
        .collect::<rusqlite::Result<_>>()?;
    for id in &ids {
        delete(c, id)?;
    }
    Ok(ids.len())
}

/// Every session that has not expired at `now`, with its history (in
/// order) and memory.
pub fn load(c: &Connection, now: i64) -> rusqlite::Result<Vec<StoredSession>> {
    let rows: Vec<SessionRow> = c
        .prepare(
            "SELECT session_id, tenant, application, user_id, created_at_ms, last_used_ms, expires_at_ms, \
             max_lifetime_ms, idle_expiry_ms, max_messages, max_tokens, message_count, tokens, metadata, \
             summary_text, summary_version, summary_model, summary_at_ms, summary_covers FROM sessions WHERE expires_at_ms >= ?1",
        )?
        .query_map(params![now], |r| {
            Ok(SessionRow {
                session_id: r.get(0)?,
                tenant: r.get(1)?,
                application: r.get(2)?,
                user_id: r.get(3)?,
                created_at_ms: r.get(4)?,
                last_used_ms: r.get(5)?,
                expires_at_ms: r.get(6)?,
                max_lifetime_ms: r.get(7)?,
                idle_expiry_ms: r.get(8)?,
                max_messages: r.get(9)?,
                max_tokens: r.get::<_, i64>(10)? as u64,
                message_count: r.get(11)?,
                tokens: r.get::<_, i64>(12)? as u64,
                metadata: r.get(13)?,
                summary: match (r.get(14)?, r.get(15)?, r.get(16)?, r.get(17)?, r.get(18)?) {
                    (Some(text), Some(version), Some(model), Some(at_ms), Some(covers)) => {
                        Some(SummaryRow { text, version, model, at_ms, covers })
                    }
                    _ => None,
                },
            })
        })?
        .collect::<rusqlite::Result<_>>()?;
    let mut msgs = c.prepare(
        "SELECT seq, role, content, tokens, task_id, at_ms FROM session_messages WHERE session_id = ?1 ORDER BY seq",
    )?;
    let mut mem = c.prepare(
        "SELECT key, tags, content, source, at_ms FROM session_memory WHERE session_id = ?1 ORDER BY at_ms, key",
    )?;
    let mut out = Vec::with_capacity(rows.len());
    for row in rows {
        let id = row.session_id.clone();
        let messages = msgs
            .query_map(params![id], |r| {
                Ok(MessageRow {
                    session_id: id.clone(),
                    seq: r.get(0)?,
                    role: r.get(1)?,
                    content: r.get(2)?,
                    tokens: r.get(3)?,
                    task_id: r.get(4)?,
                    at_ms: r.get(5)?,
                })
            })?
            .collect::<rusqlite::Result<_>>()?;
        let memory = mem
            .query_map(params![id], |r| {
                Ok(MemoryRow {
                    session_id: id.clone(),
                    key: r.get(0)?,
                    tags: r.get(1)?,
                    content: r.get(2)?,
                    source: r.get(3)?,
                    at_ms: r.get(4)?,
                })
            })?
            .collect::<rusqlite::Result<_>>()?;
        out.push(StoredSession { row, messages, memory });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_store_made_before_summary_covers_gets_the_column_and_keeps_its_rows() {
        let c = Connection::open_in_memory().unwrap();
        let old = SCHEMA.replace(",\n    summary_covers  INTEGER", "");
        assert!(!old.contains("summary_covers"));
        c.execute_batch(&old).unwrap();
        c.execute_batch(
            "INSERT INTO sessions (session_id, tenant, application, created_at_ms, last_used_ms, expires_at_ms, \
             max_lifetime_ms, idle_expiry_ms, max_messages, max_tokens, message_count, tokens, persist, metadata) \
             VALUES ('s', 't', 'a', 1, 1, 9999999999999, 1, 1, 2, 2, 0, 0, 1, '{}')",
        )
        .unwrap();
        c.execute_batch(SCHEMA).unwrap();
        migrate(&c).unwrap();
        migrate(&c).unwrap();
        let rows = load(&c, 0).unwrap();
        assert_eq!((rows.len(), rows[0].row.summary.clone()), (1, None));
        let mut row = rows[0].row.clone();
        row.summary = Some(SummaryRow { text: "t".into(), version: 1, model: "m".into(), at_ms: 5, covers: 4 });
        upsert(&c, &row).unwrap();
        assert_eq!(load(&c, 0).unwrap()[0].row.summary, row.summary);
    }
}
