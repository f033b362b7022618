//! API keys revoked at run time (`POST /admin/keys/revoke`), by SHA-256:
//! refused across restarts until reinstated. Runs on the store thread.
//!
//! Does not own: checking a credential against them (admission's
//! authenticator loads them at start-up and keeps its own set).

use rusqlite::{params, Connection};

use super::exec;

pub const SCHEMA: &str = r#"
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
