//! The retention purge: finished tasks with their transitions and stored
//! Responses, refused calls, and expired idempotency keys, deleted once
//! older than the ages of their data class (`[store.retention.<class>]`,
//! each defaulting to `[store] retention_…`). Run by the writer thread every
//! purge interval, each pass bounded so that it never holds the writer for
//! long. Also the rules on text per class ([`Policy`]): a class whose
//! `store_text` is false leaves no prompt or answer text in the file, and
//! its idempotency keys live at most its `idempotency_hours` (the tool
//! calls' arguments in its result metadata are such text too:
//! [`without_text`]).
//!
//! Does not own: when a pass runs (the writer) or the ages (config). A
//! task whose idempotency key is still live is kept whatever its age: a
//! repeat must still find its outcome. Audit records are purged by
//! `audit.rs`, by the strictest class's age (the chain is cut from its
//! oldest end only).

use rusqlite::{params, Connection, OptionalExtension};

use super::{exec, ClassRetention, StoreOptions};
use crate::task::{DataClass, ResultMeta};

/// The per-class rules the writer applies.
#[derive(Debug, Clone, Copy)]
pub(super) struct Policy {
    classes: [ClassRetention; 4],
}

impl Policy {
    pub(super) fn new(opts: &StoreOptions) -> Policy {
        let uniform = ClassRetention {
            store_text: true,
            tasks: opts.retention_tasks,
            audit: opts.retention_audit,
            idempotency: None,
            sessions: None,
        };
        Policy { classes: opts.classes.unwrap_or([uniform; 4]) }
    }

    /// By [`DataClass`] order: whether the class's text may be stored.
    pub(super) fn text_by_class(&self) -> [bool; 4] {
        self.classes.map(|c| c.store_text)
    }

    fn class(&self, c: DataClass) -> &ClassRetention {
        &self.classes[c as usize]
    }

    /// Whether text of a task of class `class` (its `tasks.data_class`) may
    /// be written. A row without a class (written before classes were
    /// stored) only where every class allows text.
    pub(super) fn text_allowed(&self, class: Option<&str>) -> bool {
        match class.and_then(DataClass::parse) {
            Some(c) => self.class(c).store_text,
            None => self.classes.iter().all(|c| c.store_text),
        }
    }

    /// An idempotency key's lifetime for class `class`: the configured TTL,
    /// capped by the class's `idempotency_hours`.
    pub(super) fn key_ttl_ms(&self, class: Option<DataClass>, ttl_ms: i64) -> i64 {
        let cap = class.and_then(|c| self.class(c).idempotency).map(ms);
        cap.map_or(ttl_ms, |cap| cap.min(ttl_ms))
    }

    /// The cut-off times of a pass at `now`.
    pub(super) fn ages(&self, now: i64, rejected: Option<std::time::Duration>) -> Ages {
        let before = |d: Option<std::time::Duration>| d.map(|d| now.saturating_sub(ms(d)));
        Ages {
            tasks_before: self.classes.map(|c| before(c.tasks)),
            // The strictest age: what a row without a class was is unknown.
            unclassified_before: before(self.classes.iter().filter_map(|c| c.tasks).min()),
            rejected_before: before(rejected),
        }
    }
}

/// The result metadata of a task whose class may not store text, as the
/// file may hold it: the tool calls' arguments are text the model wrote
/// (answer text) and are left out; `None` when there is nothing to leave
/// out (the metadata is stored as it is).
pub(super) fn without_text(meta: &ResultMeta) -> Option<ResultMeta> {
    if meta.tool_calls.iter().all(|c| c.arguments.is_empty()) {
        return None;
    }
    let mut m = meta.clone();
    m.tool_calls = meta.tool_calls.iter().map(|c| c.for_record(false)).collect();
    Some(m)
}

fn ms(d: std::time::Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// The data class of a task row, if it has one.
pub(super) fn task_class(c: &Connection, task_id: &str) -> rusqlite::Result<Option<String>> {
    Ok(c.prepare_cached("SELECT data_class FROM tasks WHERE task_id = ?1")?
        .query_row(params![task_id], |r| r.get::<_, Option<String>>(0))
        .optional()?
        .flatten())
}

/// What a pass deletes: rows last updated before these times (`None`:
/// kept).
#[derive(Debug, Clone, Copy, Default)]
pub struct Ages {
    /// Finished tasks, by [`DataClass`] order.
    pub tasks_before: [Option<i64>; 4],
    /// Finished tasks without a class (rows written before classes were
    /// stored): the strictest class's age.
    pub unclassified_before: Option<i64>,
    /// Refused calls (REJECTED), whatever their class: they hold no text.
    pub rejected_before: Option<i64>,
}

#[cfg(test)]
impl Ages {
    /// The same ages for every class.
    pub fn uniform(tasks_before: Option<i64>, rejected_before: Option<i64>) -> Ages {
        Ages { tasks_before: [tasks_before; 4], unclassified_before: tasks_before, rejected_before }
    }
}

const FINISHED: &str = "state IN ('SUCCEEDED', 'FAILED', 'CANCELLED', 'TIMED_OUT')";
const UNKEYED: &str = "NOT EXISTS (SELECT 1 FROM idempotency i WHERE i.task_id = tasks.task_id)";

/// Deletes up to `batch` finished tasks and refused calls past their ages
/// (with their transitions, kept requests and stored Responses), and up to
/// `batch` expired idempotency keys. Returns how many task rows and keys
/// went.
pub fn purge(c: &Connection, now: i64, ages: &Ages, batch: usize) -> rusqlite::Result<usize> {
    let limit = i64::try_from(batch).unwrap_or(i64::MAX);
    let mut ids: Vec<String> = Vec::new();
    let take = |sql: &str, p: &[&dyn rusqlite::ToSql], ids: &mut Vec<String>| -> rusqlite::Result<()> {
        let room = limit - ids.len() as i64;
        if room <= 0 {
            return Ok(());
        }
        let mut st = c.prepare_cached(sql)?;
        let mut params: Vec<&dyn rusqlite::ToSql> = p.to_vec();
        params.push(&room);
        let rows = st.query_map(params.as_slice(), |r| r.get::<_, String>(0))?;
        for id in rows {
            ids.push(id?);
        }
        Ok(())
    };
    if let Some(before) = ages.rejected_before {
        let sql =
            format!("SELECT task_id FROM tasks WHERE state = 'REJECTED' AND updated_at_ms < ?1 AND {UNKEYED} LIMIT ?2");
        take(&sql, &[&before], &mut ids)?;
    }
    // One query per class, each on `tasks_by_class_state_updated`, so a
    // class kept long is not walked by the pass of a class kept short.
    for (class, before) in DataClass::ALL.iter().zip(ages.tasks_before) {
        if let Some(before) = before {
            let sql = format!(
                "SELECT task_id FROM tasks WHERE data_class = ?1 AND {FINISHED} AND updated_at_ms < ?2 AND {UNKEYED} LIMIT ?3"
            );
            take(&sql, &[&class.as_str(), &before], &mut ids)?;
        }
    }
    if let Some(before) = ages.unclassified_before {
        let sql = format!(
            "SELECT task_id FROM tasks WHERE data_class IS NULL AND {FINISHED} AND updated_at_ms < ?1 AND {UNKEYED} LIMIT ?2"
        );
        take(&sql, &[&before], &mut ids)?;
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
        super::super::migrate(&c).unwrap();
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
        assert_eq!(purge(&c, 6000, &Ages::uniform(Some(1000), None), 100).unwrap(), 2);
        assert_eq!(ids(&c), ["new-done", "old-keyed", "old-rejected", "old-running"]);
        let left: i64 = c.query_row("SELECT COUNT(*) FROM task_transitions", [], |r| r.get(0)).unwrap();
        assert_eq!(left, 4, "transitions go with their tasks");
        // Refused calls too, and the expired key; then the task it kept.
        assert_eq!(purge(&c, 20_000, &Ages::uniform(Some(1000), Some(1000)), 100).unwrap(), 2);
        assert_eq!(ids(&c), ["new-done", "old-keyed", "old-running"]);
        assert_eq!(purge(&c, 20_000, &Ages::uniform(Some(1000), Some(1000)), 100).unwrap(), 1);
        assert_eq!(ids(&c), ["new-done", "old-running"]);
    }

    /// Each purge query walks an index, not the table: the refused calls
    /// `tasks_by_state_updated`, the classes `tasks_by_class_state_updated`;
    /// and the indexes of a store of before that no query used (the
    /// state-only one, the request ids') are migrated away.
    #[test]
    fn purge_queries_use_the_indexes_and_the_redundant_one_is_gone() {
        let c = db();
        c.execute_batch("CREATE INDEX tasks_by_state ON tasks(state)").unwrap();
        c.execute_batch("CREATE INDEX tasks_by_request ON tasks(tenant, application, request_id)").unwrap();
        super::super::migrate(&c).unwrap();
        let names: Vec<String> = c
            .prepare("SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'tasks' ORDER BY name")
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .map(Result::unwrap)
            .collect();
        assert!(!names.iter().any(|n| n == "tasks_by_state" || n == "tasks_by_request"), "{names:?}");
        let plan = |sql: &str| -> String {
            let mut st = c.prepare(&format!("EXPLAIN QUERY PLAN {sql}")).unwrap();
            let rows: Vec<String> = st.query_map([], |r| r.get::<_, String>(3)).unwrap().map(Result::unwrap).collect();
            rows.join("; ")
        };
        let rejected = plan("SELECT task_id FROM tasks WHERE state = 'REJECTED' AND updated_at_ms < 5 LIMIT 10");
        assert!(rejected.contains("tasks_by_state_updated"), "{rejected}");
        let class = plan(&format!(
            "SELECT task_id FROM tasks WHERE data_class = 'public' AND {FINISHED} AND updated_at_ms < 5"
        ));
        assert!(class.contains("tasks_by_class_state_updated"), "{class}");
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
        assert_eq!(purge(&c, 6000, &Ages::uniform(Some(1000), None), 100).unwrap(), 1);
        assert_eq!(super::super::responses::get(&c, "old-done").unwrap(), None);
        assert_eq!(super::super::responses::conversation(&c, "old-done").unwrap(), None);
        assert_eq!(super::super::responses::get(&c, "new-done").unwrap().as_deref(), Some("{}"));
    }

    /// Each class goes at its own age (`[store.retention.<class>]
    /// tasks_hours`); a row without a class (written before classes were
    /// stored) at the strictest one.
    #[test]
    fn each_class_goes_at_its_own_age() {
        let c = db();
        for (id, class) in [("pub", Some("public")), ("sec", Some("secret")), ("old", None)] {
            task(&c, id, "SUCCEEDED", 100);
            c.execute("UPDATE tasks SET data_class = ?2 WHERE task_id = ?1", params![id, class]).unwrap();
        }
        let class = |tasks| ClassRetention { store_text: true, tasks, audit: None, idempotency: None, sessions: None };
        let mut classes = [class(None); 4];
        classes[DataClass::Secret as usize] = class(Some(std::time::Duration::from_secs(1)));
        let policy = Policy::new(&StoreOptions { classes: Some(classes), ..StoreOptions::default() });
        let ages = policy.ages(100 + 2000, None);
        assert_eq!(purge(&c, 2100, &ages, 100).unwrap(), 2);
        assert_eq!(ids(&c), ["pub"], "public is kept (0 hours), secret and the unclassified row went");
        let left: i64 = c.query_row("SELECT COUNT(*) FROM task_transitions", [], |r| r.get(0)).unwrap();
        assert_eq!(left, 1);
    }

    #[test]
    fn a_class_without_text_and_key_lifetimes() {
        let class = |store_text, idempotency| ClassRetention {
            store_text,
            tasks: None,
            audit: None,
            idempotency,
            sessions: None,
        };
        let mut classes = [class(true, None); 4];
        classes[DataClass::Secret as usize] = class(false, Some(std::time::Duration::from_secs(3600)));
        let policy = Policy::new(&StoreOptions { classes: Some(classes), ..StoreOptions::default() });
        assert!(policy.text_allowed(Some("public")));
        assert!(!policy.text_allowed(Some("secret")));
        assert!(!policy.text_allowed(None), "a row without a class: only where every class allows text");
        assert_eq!(policy.key_ttl_ms(Some(DataClass::Secret), 86_400_000), 3_600_000);
        assert_eq!(policy.key_ttl_ms(Some(DataClass::Public), 86_400_000), 86_400_000);
    }

    #[test]
    fn a_pass_is_bounded() {
        let c = db();
        for i in 0..10 {
            task(&c, &format!("t{i}"), "CANCELLED", 1);
        }
        assert_eq!(purge(&c, 100, &Ages::uniform(Some(50), None), 4).unwrap(), 4);
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
            let purged = purge(&t, n, &Ages::uniform(Some(n), None), batch).unwrap();
            t.commit().unwrap();
            println!("{n} finished tasks × 7 transitions: a pass of {batch} purged {purged} in {:?}", start.elapsed());
        }
    }
}
