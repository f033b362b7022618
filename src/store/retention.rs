//! The retention purge: finished tasks with their transitions and stored
//! Responses, refused calls, and expired idempotency keys, deleted once
//! older than the configured ages (`[store] retention_…`). Run by the writer thread every
//! purge interval, each pass bounded so that it never holds the writer for
//! long.
//!
//! Does not own: when a pass runs (the writer) or the ages (config). A
//! task whose idempotency key is still live is kept whatever its age: a
//! repeat must still find its outcome.

use rusqlite::{params, Connection};

use super::exec;

/// Deletes up to `batch` finished tasks updated before `tasks_before`,
/// refused calls before `rejected_before` (each `None`: kept), with their
/// transitions, and up to `batch` expired idempotency keys. Returns how
/// many task rows and keys went.
pub fn purge(
    c: &Connection,
    now: i64,
    tasks_before: Option<i64>,
    rejected_before: Option<i64>,
    batch: usize,
) -> rusqlite::Result<usize> {
    let limit = i64::try_from(batch).unwrap_or(i64::MAX);
    let mut ids: Vec<String> = Vec::new();
    if let Some(before) = rejected_before {
        let mut st = c.prepare_cached(
            "SELECT task_id FROM tasks WHERE state = 'REJECTED' AND updated_at_ms < ?1 \
             AND NOT EXISTS (SELECT 1 FROM idempotency i WHERE i.task_id = tasks.task_id) LIMIT ?2",
        )?;
        let rows = st.query_map(params![before, limit], |r| r.get::<_, String>(0))?;
        for id in rows {
            ids.push(id?);
        }
    }
    if let Some(before) = tasks_before {
        let room = limit - ids.len() as i64;
        if room > 0 {
            let mut st = c.prepare_cached(
                "SELECT task_id FROM tasks WHERE state IN ('SUCCEEDED', 'FAILED', 'CANCELLED', 'TIMED_OUT') \
                 AND updated_at_ms < ?1 \
                 AND NOT EXISTS (SELECT 1 FROM idempotency i WHERE i.task_id = tasks.task_id) LIMIT ?2",
            )?;
            let rows = st.query_map(params![before, room], |r| r.get::<_, String>(0))?;
            for id in rows {
                ids.push(id?);
            }
        }
    }
    for id in &ids {
        exec(c, "DELETE FROM task_transitions WHERE task_id = ?1", params![id])?;
        exec(c, "DELETE FROM pending_requests WHERE task_id = ?1", params![id])?;
        super::responses::forget(c, id)?;
        exec(c, "DELETE FROM tasks WHERE task_id = ?1", params![id])?;
    }
    let keys = exec(
        c,
        "DELETE FROM idempotency WHERE rowid IN \
         (SELECT rowid FROM idempotency WHERE expires_at_ms <= ?1 LIMIT ?2)",
        params![now, limit],
    )?;
    Ok(ids.len() + keys)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn db() -> Connection {
        let c = Connection::open_in_memory().unwrap();
        c.execute_batch(super::super::SCHEMA).unwrap();
        for s in
            [super::super::idempotency::SCHEMA, super::super::pending_requests::SCHEMA, super::super::responses::SCHEMA]
        {
            c.execute_batch(s).unwrap();
        }
        c
    }

    fn task(c: &Connection, id: &str, state: &str, updated: i64) {
        c.execute(
            "INSERT INTO tasks (task_id, request_id, tenant, application, ingress, logical_model, priority, state, \
             created_at_ms, updated_at_ms, prompt_sha256) VALUES (?1, 'r', 't', 'a', 'http', 'm', 'P2', ?2, ?3, ?3, '')",
            params![id, state, updated],
        )
        .unwrap();
        c.execute(
            "INSERT INTO task_transitions (task_id, seq, state, at_ms, reason, node_id, actor) \
             VALUES (?1, 0, 'RECEIVED', ?2, '', 'n', 'client')",
            params![id, updated],
        )
        .unwrap();
    }

    fn ids(c: &Connection) -> Vec<String> {
        let mut st = c.prepare("SELECT task_id FROM tasks ORDER BY task_id").unwrap();
        st.query_map([], |r| r.get(0)).unwrap().map(Result::unwrap).collect()
    }

    #[test]
    fn old_finished_tasks_and_refused_calls_go_and_live_keys_keep_theirs() {
        let c = db();
        task(&c, "old-done", "SUCCEEDED", 100);
        task(&c, "old-failed", "FAILED", 100);
        task(&c, "old-rejected", "REJECTED", 100);
        task(&c, "old-running", "STREAMING", 100);
        task(&c, "old-keyed", "SUCCEEDED", 100);
        task(&c, "new-done", "SUCCEEDED", 5000);
        c.execute(
            "INSERT INTO idempotency (tenant, application, key, task_id, prompt_sha256, created_at_ms, expires_at_ms) \
             VALUES ('t', 'a', 'k', 'old-keyed', '', 0, 10000)",
            [],
        )
        .unwrap();
        // Refused calls kept, finished tasks older than 1000 go.
        assert_eq!(purge(&c, 6000, Some(1000), None, 100).unwrap(), 2);
        assert_eq!(ids(&c), ["new-done", "old-keyed", "old-rejected", "old-running"]);
        let left: i64 = c.query_row("SELECT COUNT(*) FROM task_transitions", [], |r| r.get(0)).unwrap();
        assert_eq!(left, 4, "transitions go with their tasks");
        // Refused calls too, and the expired key; then the task it kept.
        assert_eq!(purge(&c, 20_000, Some(1000), Some(1000), 100).unwrap(), 2);
        assert_eq!(ids(&c), ["new-done", "old-keyed", "old-running"]);
        assert_eq!(purge(&c, 20_000, Some(1000), Some(1000), 100).unwrap(), 1);
        assert_eq!(ids(&c), ["new-done", "old-running"]);
    }

    /// A stored Response lives as long as its task (`GET /v1/responses/{id}`
    /// must not outlive the retention rules).
    #[test]
    fn a_stored_response_goes_with_its_task() {
        let c = db();
        task(&c, "old-done", "SUCCEEDED", 100);
        task(&c, "new-done", "SUCCEEDED", 5000);
        for id in ["old-done", "new-done"] {
            super::super::responses::keep(&c, id, "{}", Some("[]")).unwrap();
        }
        assert_eq!(purge(&c, 6000, Some(1000), None, 100).unwrap(), 1);
        assert_eq!(super::super::responses::get(&c, "old-done").unwrap(), None);
        assert_eq!(super::super::responses::conversation(&c, "old-done").unwrap(), None);
        assert_eq!(super::super::responses::get(&c, "new-done").unwrap().as_deref(), Some("{}"));
    }

    #[test]
    fn a_pass_is_bounded() {
        let c = db();
        for i in 0..10 {
            task(&c, &format!("t{i}"), "CANCELLED", 1);
        }
        assert_eq!(purge(&c, 100, Some(50), None, 4).unwrap(), 4);
        assert_eq!(ids(&c).len(), 6);
    }
}

/// How long one bounded pass takes on a large store (run by hand:
/// `cargo test --lib retention::timing -- --ignored --nocapture`).
#[cfg(test)]
mod timing {
    use super::*;

    #[test]
    #[ignore = "a measurement, not a check"]
    fn one_pass_over_a_large_store() {
        let dir = tempfile::tempdir().unwrap();
        let c = Connection::open(dir.path().join("t.db")).unwrap();
        c.pragma_update(None, "journal_mode", "WAL").unwrap();
        c.pragma_update(None, "synchronous", "NORMAL").unwrap();
        c.execute_batch(super::super::SCHEMA).unwrap();
        for s in
            [super::super::idempotency::SCHEMA, super::super::pending_requests::SCHEMA, super::super::responses::SCHEMA]
        {
            c.execute_batch(s).unwrap();
        }
        let n = 100_000;
        let t = c.unchecked_transaction().unwrap();
        for i in 0..n {
            let id = format!("{i:032x}");
            t.execute(
                "INSERT INTO tasks (task_id, request_id, tenant, application, ingress, logical_model, priority, \
                 state, created_at_ms, updated_at_ms, prompt_sha256) \
                 VALUES (?1, 'r', 't', 'a', 'http', 'm', 'P2', 'SUCCEEDED', ?2, ?2, '')",
                params![id, i],
            )
            .unwrap();
            for seq in 0..7 {
                t.execute(
                    "INSERT INTO task_transitions (task_id, seq, state, at_ms, reason, node_id, actor) \
                     VALUES (?1, ?2, 'QUEUED', 0, 'reason text of a transition', 'node', 'scheduler')",
                    params![id, seq],
                )
                .unwrap();
            }
        }
        t.commit().unwrap();
        for batch in [2000, 2000, 500] {
            let start = std::time::Instant::now();
            let t = c.unchecked_transaction().unwrap();
            let purged = purge(&t, n, Some(n), None, batch).unwrap();
            t.commit().unwrap();
            println!("{n} finished tasks × 7 transitions: a pass of {batch} purged {purged} in {:?}", start.elapsed());
        }
    }
}
