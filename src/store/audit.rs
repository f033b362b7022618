//! The audit trail: one record per call, refused calls included, in an
//! append-only, hash-chained table (`audit_log`).
//!
//! A record is written by the store's writer in the same transaction (and
//! savepoint) as the task's terminal state (a finished task, or a
//! validated one the scheduler refused or its caller left before it was
//! queued) or its REJECTED row (a call refused at admission), so it
//! survives a crash (`kill -9`) exactly as that state does: a keyed task's
//! result commits at once, any other end may be lost to a crash within the
//! write-behind window (`commit_window`), and then its audit record with
//! it, never one without the other.
//!
//! Each record holds its canonical bytes (the JSON of [`AuditEntry`], as
//! written; never prompt or answer text), the SHA-256 of the record before
//! it, and its own: SHA-256 over `seq`, the previous hash and the canonical
//! bytes. [`verify`] walks the chain and names the first record that does
//! not hold (an edited, deleted or reordered record). Retention deletes the
//! oldest records only, and keeps the last deleted record's number and
//! hash in `audit_anchor`, so the chain stays verifiable from the first
//! record that remains, and that record's time: `edgeway audit verify`
//! warns when the anchor is younger than the audit retention allows
//! ([`anchor_warning`]; an anchor forged with an old time is not caught).
//! Deleting the newest records is not detectable from the table alone: the
//! copies published on NATS or exported are the check for that (and for a
//! forged anchor).
//!
//! Does not own: which calls are audited (the lifecycle recorder and the
//! facade decide), the query API (gateway, HTTP), publishing (NATS
//! ingress) or the retention age (config).

use rusqlite::{params, Connection, OptionalExtension};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::exec;
use crate::task::{DataClass, ResultMeta, RouteHop};

pub const SCHEMA: &str = r#"
CREATE TABLE IF NOT EXISTS audit_log (
    seq          INTEGER PRIMARY KEY,
    at_ms        INTEGER NOT NULL,
    tenant       TEXT NOT NULL,
    record       TEXT NOT NULL,
    prev_sha256  TEXT NOT NULL,
    sha256       TEXT NOT NULL
);
-- A tenant's page in chain order without walking other tenants' records
-- (review 15 L6). Created on open in an existing file too. The only index:
-- every other read (a page of all tenants, verify, export, the purge) walks
-- the table in `seq` order, and a time bound is checked on the rows walked
-- (see `migrate` for the two that were dropped).
CREATE INDEX IF NOT EXISTS audit_by_tenant_seq ON audit_log(tenant, seq);
-- The last record retention deleted: where the remaining chain starts, and
-- that record's time (`at_ms`, added to older files by `migrate`).
CREATE TABLE IF NOT EXISTS audit_anchor (
    id      INTEGER PRIMARY KEY CHECK (id = 1),
    seq     INTEGER NOT NULL,
    sha256  TEXT NOT NULL,
    at_ms   INTEGER
);
"#;

/// Adds `audit_anchor.at_ms` to a store made before it (its anchor, if
/// any, then has no time: [`anchor_warning`] says so), and drops the
/// indexes by time and by tenant and time of stores made before session 12:
/// no query used them (a page's time bounds are `?2 IS NULL OR at_ms >= ?2`,
/// which no index serves; SQLite walks `seq` or `audit_by_tenant_seq`), and
/// each record paid for both (two more B-tree inserts and their WAL pages,
/// issue 13's cost).
pub fn migrate(c: &Connection) -> rusqlite::Result<()> {
    if !has_anchor_time(c)? {
        c.execute_batch("ALTER TABLE audit_anchor ADD COLUMN at_ms INTEGER")?;
    }
    c.execute_batch("DROP INDEX IF EXISTS audit_by_tenant_time; DROP INDEX IF EXISTS audit_by_time;")
}

fn has_anchor_time(c: &Connection) -> rusqlite::Result<bool> {
    c.prepare("SELECT 1 FROM pragma_table_info('audit_anchor') WHERE name = 'at_ms'")?.exists([])
}

/// The hash the first record of a new chain points back to.
pub const GENESIS: &str = "0000000000000000000000000000000000000000000000000000000000000000";

/// What one call left behind. Field order is the canonical order (the JSON
/// is hashed as written). Never prompt or answer text.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AuditEntry {
    pub at_ms: i64,
    pub task_id: String,
    pub request_id: String,
    /// The task's W3C trace id (absent in records written before trace ids
    /// existed; `verify` hashes the stored JSON, so those stay valid).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace_id: Option<String>,
    pub tenant: String,
    pub application: String,
    pub user_id: Option<String>,
    /// The first 16 hex digits of the SHA-256 of the API key (or JWT id)
    /// used: enough to name the key, not to use it.
    pub key_id: Option<String>,
    /// The MQTT client id, for calls made by a device.
    pub device: Option<String>,
    pub ingress: String,
    pub requested_model: String,
    pub model: Option<String>,
    pub instance: Option<String>,
    /// Route steps taken, each with its reason.
    pub route: Vec<RouteHop>,
    pub data_class: Option<DataClass>,
    /// The terminal state (`SUCCEEDED`, `FAILED`, `REJECTED`, …).
    pub result: String,
    pub error_code: Option<String>,
    pub input_tokens: u32,
    pub output_tokens: u32,
    /// What the call cost (`edge.cost`); null for a refused call and for a
    /// task whose cost is not known (ended by recovery).
    pub cost: Option<f64>,
    /// Answered from the response cache.
    pub cache_hit: bool,
    /// `edge.context.prompt_sha256`, when prompt assembly ran.
    pub context_sha256: Option<String>,
    pub queue_ms: Option<u64>,
    pub ttft_ms: Option<u64>,
    pub total_ms: Option<u64>,
    /// The record of a user's data deletion (`DELETE /admin/users/{user}/data`,
    /// `result` = `USER_DATA_DELETED`, `user_id` the user, `application` and
    /// `key_id` who asked): what it removed. Absent in every other record
    /// (and in records written before it: `verify` hashes the stored JSON).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_data_deleted: Option<super::UserDataDeleted>,
}

impl AuditEntry {
    /// The entry of a call refused with `code` before anything ran (no
    /// model, instance, route, tokens or timings); the caller fills in who
    /// and what with struct update syntax.
    pub fn refused(code: &str) -> AuditEntry {
        AuditEntry {
            at_ms: 0,
            task_id: String::new(),
            request_id: String::new(),
            trace_id: None,
            tenant: String::new(),
            application: String::new(),
            user_id: None,
            key_id: None,
            device: None,
            ingress: String::new(),
            requested_model: String::new(),
            model: None,
            instance: None,
            route: Vec::new(),
            data_class: None,
            result: crate::task::TaskState::Rejected.as_str().to_string(),
            error_code: Some(code.to_string()),
            input_tokens: 0,
            output_tokens: 0,
            cost: None,
            cache_hit: false,
            context_sha256: None,
            queue_ms: None,
            ttft_ms: None,
            total_ms: None,
            user_data_deleted: None,
        }
    }
}

/// A stored record: the entry with its place in the chain.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AuditRecord {
    pub seq: i64,
    pub prev_sha256: String,
    pub sha256: String,
    #[serde(flatten)]
    pub entry: AuditEntry,
}

/// What a caller of a finished task was, beyond the task row.
pub fn key_id(credential: Option<&[u8; 32]>) -> Option<String> {
    credential.map(|d| hex::encode(&d[..8]))
}

/// The entry of a finished task, from its row and result, and the task's
/// data class as stored (`None`: no row, or a row from before classes), so
/// that the writer reads the row once per finish.
pub fn finished_entry(
    c: &Connection,
    meta: &ResultMeta,
    error_code: Option<&str>,
    key_id: Option<String>,
    at_ms: i64,
) -> rusqlite::Result<(AuditEntry, Option<String>)> {
    let row = c
        .prepare_cached("SELECT tenant, application, user_id, ingress, data_class FROM tasks WHERE task_id = ?1")?
        .query_row(params![meta.task_id], |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, Option<String>>(2)?,
                r.get::<_, String>(3)?,
                r.get::<_, Option<String>>(4)?,
            ))
        })
        .optional()?;
    let (tenant, application, user_id, ingress, class) = row.unwrap_or_default();
    let device = device_of(&ingress, user_id.as_deref());
    let entry = AuditEntry {
        at_ms,
        task_id: meta.task_id.clone(),
        request_id: meta.request_id.clone(),
        trace_id: meta.trace_id.clone(),
        tenant,
        application,
        user_id,
        key_id,
        device,
        ingress,
        requested_model: meta.route.requested_model.clone(),
        model: meta.route.model.clone().or_else(|| meta.actual_model.clone()),
        instance: meta.route.instance.clone(),
        route: meta.route.hops.clone(),
        data_class: Some(meta.route.data_class),
        result: meta.status.as_str().to_string(),
        error_code: error_code.map(str::to_string),
        input_tokens: meta.usage.input_tokens,
        output_tokens: meta.usage.output_tokens,
        cost: meta.cost,
        cache_hit: meta.cache_hit,
        context_sha256: meta.context.as_ref().map(|c| c.prompt_sha256.clone()),
        queue_ms: meta.timing.queue_ms,
        ttft_ms: meta.timing.first_token_ms,
        total_ms: Some(meta.timing.total_ms),
        user_data_deleted: None,
    };
    Ok((entry, class))
}

/// A device's calls come over MQTT, where the user is the client id.
/// A platform task (a summary made after a device's turn) names no device.
pub fn device_of(ingress: &str, user_id: Option<&str>) -> Option<String> {
    let user = user_id.filter(|u| !crate::task::is_platform_user(u));
    (ingress == "mqtt").then(|| user.map(str::to_string)).flatten()
}

fn chain_hash(seq: i64, prev: &str, record: &str) -> String {
    let mut h = Sha256::new();
    h.update(seq.to_string().as_bytes());
    h.update(b"\n");
    h.update(prev.as_bytes());
    h.update(b"\n");
    h.update(record.as_bytes());
    hex::encode(h.finalize())
}

/// Where the chain continues: the newest record, else the anchor left by
/// retention, else the genesis.
fn head(c: &Connection) -> rusqlite::Result<(i64, String)> {
    let last = c
        .prepare_cached("SELECT seq, sha256 FROM audit_log ORDER BY seq DESC LIMIT 1")?
        .query_row([], |r| Ok((r.get(0)?, r.get(1)?)))
        .optional()?;
    if let Some(l) = last {
        return Ok(l);
    }
    Ok(anchor(c)?.unwrap_or((0, GENESIS.to_string())))
}

/// The chain's head (the newest record's number and hash) as its writer
/// knows it, so that an append does not read it back from the table (a
/// query of about 17 k instructions per record, issue 13's cost). Unknown
/// (`None`) until the first append reads it; the writer keeps one for
/// what is committed and works on a copy inside a transaction, so that a
/// rolled-back batch or write leaves the committed head as it was
/// ([`ChainHead::forget`] where it cannot tell). Retention does not move
/// the head: it deletes the oldest records only, and the anchor it leaves
/// when it deletes them all is the newest one's number and hash.
#[derive(Debug, Clone, Default)]
pub struct ChainHead(Option<(i64, String)>);

impl ChainHead {
    /// The record number the head is at, if known.
    pub fn seq(&self) -> Option<i64> {
        self.0.as_ref().map(|(seq, _)| *seq)
    }

    /// Read again from the table at the next append.
    pub fn forget(&mut self) {
        self.0 = None;
    }
}

fn anchor(c: &Connection) -> rusqlite::Result<Option<(i64, String)>> {
    c.prepare_cached("SELECT seq, sha256 FROM audit_anchor WHERE id = 1")?
        .query_row([], |r| Ok((r.get(0)?, r.get(1)?)))
        .optional()
}

/// Appends one record to the chain (inside the writer's transaction: a
/// rolled-back batch takes its records with it, and the retry chains them
/// again). `head` is where the chain continues ([`ChainHead`]): read from
/// the table when not known, moved to the new record once it is inserted.
pub fn append(c: &Connection, head: &mut ChainHead, entry: AuditEntry) -> rusqlite::Result<AuditRecord> {
    let (last, prev) = match head.0.take() {
        Some(h) => h,
        None => self::head(c)?,
    };
    let seq = last + 1;
    let record = serde_json::to_string(&entry).map_err(|e| rusqlite::Error::ToSqlConversionFailure(Box::new(e)))?;
    let sha = chain_hash(seq, &prev, &record);
    let inserted = exec(
        c,
        "INSERT INTO audit_log (seq, at_ms, tenant, record, prev_sha256, sha256) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
        params![seq, entry.at_ms, entry.tenant, record, prev, sha],
    );
    match inserted {
        Ok(_) => head.0 = Some((seq, sha.clone())),
        // Not inserted: the head stays where it was.
        Err(e) => {
            head.0 = Some((last, prev));
            return Err(e);
        }
    }
    Ok(AuditRecord { seq, prev_sha256: prev, sha256: sha, entry })
}

/// Which records a query wants; each bound optional.
#[derive(Debug, Clone, Default)]
pub struct AuditQuery {
    pub tenant: Option<String>,
    /// Inclusive, unix milliseconds.
    pub since_ms: Option<i64>,
    /// Exclusive, unix milliseconds.
    pub until_ms: Option<i64>,
    /// Only records after this one (paging).
    pub after_seq: Option<i64>,
    pub limit: usize,
}

/// The records of a query, oldest first. A query for one tenant has its
/// own statement: `(?1 IS NULL OR tenant = ?1)` would keep SQLite from
/// using `audit_by_tenant_seq`.
pub fn query(c: &Connection, q: &AuditQuery) -> rusqlite::Result<Vec<AuditRecord>> {
    let mut st = c.prepare_cached(if q.tenant.is_some() { TENANT_PAGE } else { PAGE })?;
    let limit = i64::try_from(q.limit).unwrap_or(i64::MAX);
    let rows = st.query_map(params![q.tenant, q.since_ms, q.until_ms, q.after_seq.unwrap_or(0), limit], |r| {
        let record: String = r.get(1)?;
        let entry = serde_json::from_str(&record)
            .map_err(|e| rusqlite::Error::FromSqlConversionFailure(1, rusqlite::types::Type::Text, Box::new(e)))?;
        Ok(AuditRecord { seq: r.get(0)?, prev_sha256: r.get(2)?, sha256: r.get(3)?, entry })
    })?;
    rows.collect()
}

const TENANT_PAGE: &str = "SELECT seq, record, prev_sha256, sha256 FROM audit_log \
     WHERE tenant = ?1 AND (?2 IS NULL OR at_ms >= ?2) AND (?3 IS NULL OR at_ms < ?3) \
     AND seq > ?4 ORDER BY seq LIMIT ?5";
const PAGE: &str = "SELECT seq, record, prev_sha256, sha256 FROM audit_log \
     WHERE ?1 IS NULL AND (?2 IS NULL OR at_ms >= ?2) AND (?3 IS NULL OR at_ms < ?3) \
     AND seq > ?4 ORDER BY seq LIMIT ?5";

/// Why the chain does not hold, at the first record where it breaks.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("audit record {seq}: {why}")]
pub struct ChainBroken {
    pub seq: i64,
    pub why: String,
}

/// Walks the whole chain from its start (the anchor, else the genesis).
/// Returns how many records hold, or the first that does not.
pub fn verify(c: &Connection) -> Result<u64, VerifyError> {
    let (mut expect_seq, mut prev) = anchor(c)?.unwrap_or((0, GENESIS.to_string()));
    let mut st = c.prepare("SELECT seq, record, prev_sha256, sha256, tenant, at_ms FROM audit_log ORDER BY seq")?;
    let mut rows = st.query([])?;
    let mut n = 0u64;
    while let Some(r) = rows.next()? {
        let (seq, record, stored_prev, sha): (i64, String, String, String) =
            (r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?);
        let (tenant, at_ms): (String, i64) = (r.get(4)?, r.get(5)?);
        expect_seq += 1;
        let broken = |why: String| VerifyError::Broken(ChainBroken { seq, why });
        if seq != expect_seq {
            return Err(broken(format!("expected record {expect_seq} here (a record was deleted or moved)")));
        }
        if stored_prev != prev {
            return Err(broken(
                "its previous-record hash does not match the record before it (that record was edited, deleted or moved)"
                    .into(),
            ));
        }
        if chain_hash(seq, &stored_prev, &record) != sha {
            return Err(broken("its hash does not match its contents (the record was edited)".into()));
        }
        // The indexed columns are copies of the record, for queries: an
        // edited one would hide a record from its tenant's export.
        let columns_match =
            serde_json::from_str::<AuditEntry>(&record).is_ok_and(|e| e.tenant == tenant && e.at_ms == at_ms);
        if !columns_match {
            return Err(broken("its tenant or time column does not match its record (edited)".into()));
        }
        prev = sha;
        n += 1;
    }
    Ok(n)
}

/// Review 15 L6(a): the chain cannot tell retention from someone who
/// deleted the oldest records and wrote the anchor (the anchor is the last
/// deleted record's number and hash, both in the table). What it can check
/// is the anchor's time: retention only ever deletes records older than
/// `retention` (the strictest class's audit age), so an anchor younger than
/// `now_ms - retention`, an anchor while nothing is purged (`None`), or one
/// without a time (written before edgeway recorded it, or not by edgeway)
/// is named here. A forger who also writes an old time is not caught: the
/// copies published on NATS or exported are the check for that, as for the
/// newest records.
pub fn anchor_warning(
    c: &Connection,
    now_ms: i64,
    retention: Option<std::time::Duration>,
) -> rusqlite::Result<Option<String>> {
    let Some((seq, _)) = anchor(c)? else { return Ok(None) };
    let at_ms: Option<i64> = if has_anchor_time(c)? {
        c.query_row("SELECT at_ms FROM audit_anchor WHERE id = 1", [], |r| r.get(0))?
    } else {
        None
    };
    let Some(at_ms) = at_ms else {
        return Ok(Some(format!(
            "records 1..={seq} are gone and the anchor has no time (written before edgeway recorded it, \
             or not by edgeway): it cannot be checked against the retention"
        )));
    };
    let Some(retention) = retention else {
        return Ok(Some(format!(
            "records 1..={seq} (the newest of them at {at_ms} ms) are gone though the audit retention keeps \
             records: they were deleted by something else"
        )));
    };
    let cut = now_ms.saturating_sub(i64::try_from(retention.as_millis()).unwrap_or(i64::MAX));
    Ok((at_ms >= cut).then(|| {
        format!(
            "records 1..={seq} are gone, the newest of them at {at_ms} ms, {} s younger than the audit \
             retention ({} h) lets the purge delete: deleted by hand, or the anchor is forged",
            (at_ms - cut) / 1000,
            retention.as_secs() / 3600
        )
    }))
}

#[derive(Debug, thiserror::Error)]
pub enum VerifyError {
    #[error("{0}")]
    Broken(ChainBroken),
    #[error("cannot read the audit log: {0}")]
    Query(#[from] rusqlite::Error),
}

/// Retention: deletes up to `batch` of the oldest records written before
/// `before`, and moves the anchor to the last one deleted, so the chain
/// stays verifiable from the first record that remains. Only ever from the
/// oldest end: a record is never deleted while an older one remains.
pub fn purge(c: &Connection, before: i64, batch: usize) -> rusqlite::Result<usize> {
    let limit = i64::try_from(batch).unwrap_or(i64::MAX);
    // The oldest records in chain order, while they are old enough: `at_ms`
    // follows `seq` but nothing forces it to, so the walk stops at the
    // first young one (and reads at most `batch` rows).
    let mut last: Option<(i64, String, i64)> = None;
    {
        let mut st = c.prepare_cached("SELECT seq, sha256, at_ms FROM audit_log ORDER BY seq LIMIT ?1")?;
        let mut rows = st.query(params![limit])?;
        while let Some(r) = rows.next()? {
            let at_ms: i64 = r.get(2)?;
            if at_ms >= before {
                break;
            }
            last = Some((r.get(0)?, r.get(1)?, at_ms));
        }
    }
    let Some((seq, sha, at_ms)) = last else { return Ok(0) };
    let n = exec(c, "DELETE FROM audit_log WHERE seq <= ?1", params![seq])?;
    exec(
        c,
        "INSERT INTO audit_anchor (id, seq, sha256, at_ms) VALUES (1, ?1, ?2, ?3) \
         ON CONFLICT(id) DO UPDATE SET seq = excluded.seq, sha256 = excluded.sha256, at_ms = excluded.at_ms",
        params![seq, sha, at_ms],
    )?;
    Ok(n)
}

/// Opens a store file read-only, for `edgeway audit verify|export`
/// (a running gateway may be writing it: WAL lets both go on).
pub fn open_read_only(path: &std::path::Path) -> rusqlite::Result<Connection> {
    let c = Connection::open_with_flags(
        path,
        rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY | rusqlite::OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )?;
    c.pragma_update(None, "busy_timeout", 5000)?;
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tenants_page_uses_its_index() {
        let c = db();
        let plan = |sql: &str| -> String {
            let mut st = c.prepare(&format!("EXPLAIN QUERY PLAN {sql}")).unwrap();
            let rows = st.query_map(params!["t", None::<i64>, None::<i64>, 0, 10], |r| r.get::<_, String>(3)).unwrap();
            rows.map(Result::unwrap).collect::<Vec<_>>().join("; ")
        };
        let p = plan(TENANT_PAGE);
        assert!(p.contains("audit_by_tenant_seq"), "{p}");
        assert!(!p.contains("TEMP B-TREE"), "no sort: {p}");
    }

    /// Every query over the audit log, with and without its bounds, walks
    /// the chain's own order or `audit_by_tenant_seq`: the log has no other
    /// index to keep up per record. Failed before: the store also had
    /// `audit_by_tenant_time` and `audit_by_time`, which no plan used.
    #[test]
    fn the_queries_need_one_index_and_the_log_has_only_that() {
        // A store made before: both old indexes, dropped on open.
        let c = Connection::open_in_memory().unwrap();
        c.execute_batch(
            "CREATE TABLE audit_log (seq INTEGER PRIMARY KEY, at_ms INTEGER NOT NULL, tenant TEXT NOT NULL, \
             record TEXT NOT NULL, prev_sha256 TEXT NOT NULL, sha256 TEXT NOT NULL); \
             CREATE INDEX audit_by_tenant_time ON audit_log(tenant, at_ms); \
             CREATE INDEX audit_by_time ON audit_log(at_ms);",
        )
        .unwrap();
        c.execute_batch(SCHEMA).unwrap();
        migrate(&c).unwrap();
        let indexes: Vec<String> = c
            .prepare("SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'audit_log' ORDER BY name")
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .map(Result::unwrap)
            .collect();
        assert_eq!(indexes, ["audit_by_tenant_seq"]);
        // The plans of every read, bounds set or not: no sort, no scan of
        // a dropped index.
        let plan = |sql: &str, p: &[&dyn rusqlite::ToSql]| -> String {
            let mut st = c.prepare(&format!("EXPLAIN QUERY PLAN {sql}")).unwrap();
            let rows = st.query_map(p, |r| r.get::<_, String>(3)).unwrap();
            rows.map(Result::unwrap).collect::<Vec<_>>().join("; ")
        };
        for (tenant, since, until) in [(None, None, None), (Some("t"), Some(5), Some(9)), (None, Some(5), None)] {
            let sql = if tenant.is_some() { TENANT_PAGE } else { PAGE };
            let p = plan(sql, params![tenant, since, until, 0, 10]);
            assert!(!p.contains("TEMP B-TREE"), "{p}");
        }
        let p = plan("SELECT seq, sha256, at_ms FROM audit_log ORDER BY seq LIMIT ?1", params![10]);
        assert!(!p.contains("TEMP B-TREE"), "{p}");
    }

    #[test]
    fn a_platform_task_names_no_device() {
        assert_eq!(device_of("mqtt", Some("sensor-1")).as_deref(), Some("sensor-1"));
        assert_eq!(device_of("mqtt", Some("edgeway:summary")), None, "a summary after a device's turn");
        assert_eq!(device_of("http", Some("alice")), None);
    }

    fn db() -> Connection {
        let c = Connection::open_in_memory().unwrap();
        c.execute_batch(SCHEMA).unwrap();
        c
    }

    fn entry(tenant: &str, at_ms: i64) -> AuditEntry {
        AuditEntry {
            at_ms,
            task_id: format!("t{at_ms}"),
            request_id: "r".into(),
            trace_id: None,
            tenant: tenant.into(),
            application: "a".into(),
            user_id: None,
            key_id: None,
            device: None,
            ingress: "http".into(),
            requested_model: "m".into(),
            model: None,
            instance: None,
            route: Vec::new(),
            data_class: None,
            result: "SUCCEEDED".into(),
            error_code: None,
            input_tokens: 1,
            output_tokens: 2,
            cost: None,
            cache_hit: false,
            context_sha256: None,
            queue_ms: None,
            ttft_ms: None,
            total_ms: Some(3),
            user_data_deleted: None,
        }
    }

    fn chain(c: &Connection, n: i64) {
        for i in 1..=n {
            append(c, &mut ChainHead::default(), entry(if i % 2 == 0 { "b" } else { "a" }, i * 100)).unwrap();
        }
    }

    fn broken_at(c: &Connection) -> i64 {
        match verify(c) {
            Err(VerifyError::Broken(b)) => b.seq,
            other => panic!("expected a broken chain, got {other:?}"),
        }
    }

    #[test]
    fn an_intact_chain_verifies() {
        let c = db();
        chain(&c, 5);
        assert_eq!(verify(&c).unwrap(), 5);
    }

    #[test]
    fn an_edited_record_is_named() {
        let c = db();
        chain(&c, 5);
        c.execute(
            "UPDATE audit_log SET record = replace(record, '\"output_tokens\":2', '\"output_tokens\":9') WHERE seq = 3",
            [],
        )
        .unwrap();
        assert_eq!(broken_at(&c), 3);
    }

    #[test]
    fn an_edited_record_with_its_hash_recomputed_breaks_the_next() {
        let c = db();
        chain(&c, 5);
        let (prev, rec): (String, String) = c
            .query_row("SELECT prev_sha256, record FROM audit_log WHERE seq = 3", [], |r| Ok((r.get(0)?, r.get(1)?)))
            .unwrap();
        let rec = rec.replace("\"output_tokens\":2", "\"output_tokens\":9");
        let sha = chain_hash(3, &prev, &rec);
        c.execute("UPDATE audit_log SET record = ?1, sha256 = ?2 WHERE seq = 3", params![rec, sha]).unwrap();
        assert_eq!(broken_at(&c), 4);
    }

    #[test]
    fn a_deleted_record_is_named() {
        let c = db();
        chain(&c, 5);
        c.execute("DELETE FROM audit_log WHERE seq = 2", []).unwrap();
        assert_eq!(broken_at(&c), 3);
        let c = db();
        chain(&c, 5);
        c.execute("DELETE FROM audit_log WHERE seq = 1", []).unwrap();
        assert_eq!(broken_at(&c), 2, "the first record too: the chain starts at the genesis or the anchor");
    }

    #[test]
    fn an_edited_query_column_is_named() {
        let c = db();
        chain(&c, 3);
        c.execute("UPDATE audit_log SET tenant = 'a' WHERE seq = 2", []).unwrap();
        assert_eq!(broken_at(&c), 2);
    }

    #[test]
    fn reordered_records_are_named() {
        let c = db();
        chain(&c, 5);
        // Swap the contents of records 2 and 4 (keeping the numbers).
        c.execute_batch(
            "UPDATE audit_log SET seq = -2 WHERE seq = 2; UPDATE audit_log SET seq = 2 WHERE seq = 4; \
             UPDATE audit_log SET seq = 4 WHERE seq = -2;",
        )
        .unwrap();
        assert_eq!(broken_at(&c), 2);
    }

    #[test]
    fn purging_the_oldest_keeps_the_rest_verifiable_and_the_chain_going() {
        let c = db();
        chain(&c, 6);
        assert_eq!(purge(&c, 350, 100).unwrap(), 3);
        assert_eq!(verify(&c).unwrap(), 3);
        assert_eq!(purge(&c, 350, 100).unwrap(), 0);
        append(&c, &mut ChainHead::default(), entry("a", 700)).unwrap();
        assert_eq!(verify(&c).unwrap(), 4);
        // Bounded, and everything can go: the next record still chains.
        assert_eq!(purge(&c, 10_000, 2).unwrap(), 2);
        assert_eq!(purge(&c, 10_000, 100).unwrap(), 2);
        assert_eq!(verify(&c).unwrap(), 0);
        let r = append(&c, &mut ChainHead::default(), entry("a", 800)).unwrap();
        assert_eq!(r.seq, 8);
        assert_eq!(verify(&c).unwrap(), 1);
        // Deleting past the anchor is still seen.
        append(&c, &mut ChainHead::default(), entry("a", 900)).unwrap();
        c.execute("DELETE FROM audit_log WHERE seq = 8", []).unwrap();
        assert_eq!(broken_at(&c), 9);
    }

    /// The writer keeps the head ([`ChainHead`]) instead of reading it per
    /// record: retention passes (one of them deleting every record) do not
    /// move it, and an insert that fails leaves it where it was.
    #[test]
    fn a_kept_head_stays_right_across_purges_and_a_failed_insert() {
        let c = db();
        let mut head = ChainHead::default();
        for i in 1..=4 {
            append(&c, &mut head, entry("a", i * 100)).unwrap();
        }
        assert_eq!(purge(&c, 250, 100).unwrap(), 2);
        assert_eq!(append(&c, &mut head, entry("a", 500)).unwrap().seq, 5);
        assert_eq!(purge(&c, 10_000, 100).unwrap(), 3);
        assert_eq!(append(&c, &mut head, entry("a", 600)).unwrap().seq, 6);
        assert_eq!(verify(&c).unwrap(), 1);
        c.execute_batch(
            "CREATE TRIGGER refuse BEFORE INSERT ON audit_log WHEN NEW.at_ms = 700 \
             BEGIN SELECT RAISE(ABORT, 'refused'); END;",
        )
        .unwrap();
        assert!(append(&c, &mut head, entry("a", 700)).is_err());
        assert_eq!(head.seq(), Some(6));
        assert_eq!(append(&c, &mut head, entry("a", 800)).unwrap().seq, 7);
        assert_eq!(verify(&c).unwrap(), 2);
    }

    /// Review 15 L6(a). Failed before: a forged anchor (the oldest records
    /// deleted, the anchor written by hand) verified like retention, with
    /// nothing said. The chain still verifies (it cannot tell), but the
    /// anchor's time is younger than the retention allows: named.
    #[test]
    fn an_anchor_younger_than_the_retention_is_named() {
        let hour = std::time::Duration::from_secs(3600);
        let now = 100 * 3_600_000;
        // Records an hour apart, the newest now.
        let c = db();
        for i in 0..6 {
            append(&c, &mut ChainHead::default(), entry("a", now - (5 - i) * 3_600_000)).unwrap();
        }
        // Retention of 2 h: the purge takes records older than that (1..=3).
        assert_eq!(purge(&c, now - 2 * 3_600_000, 100).unwrap(), 3);
        assert_eq!(verify(&c).unwrap(), 3);
        assert_eq!(anchor_warning(&c, now, Some(2 * hour)).unwrap(), None, "a real purge");
        assert!(anchor_warning(&c, now, None).unwrap().is_some(), "an anchor while nothing is purged");

        // Forged: the two oldest remaining records deleted, the anchor
        // moved onto the second of them (number, hash and its real time).
        let (seq, sha, at): (i64, String, i64) = c
            .query_row("SELECT seq, sha256, at_ms FROM audit_log WHERE seq = 5", [], |r| {
                Ok((r.get(0)?, r.get(1)?, r.get(2)?))
            })
            .unwrap();
        c.execute("DELETE FROM audit_log WHERE seq <= 5", []).unwrap();
        c.execute("UPDATE audit_anchor SET seq = ?1, sha256 = ?2, at_ms = ?3", params![seq, sha, at]).unwrap();
        assert_eq!(verify(&c).unwrap(), 1, "the chain itself cannot tell");
        let w = anchor_warning(&c, now, Some(2 * hour)).unwrap().expect("named");
        assert!(w.contains("records 1..=5") && w.contains("forged"), "{w}");
        // Forged without a time (as an anchor written before the column).
        c.execute("UPDATE audit_anchor SET at_ms = NULL", []).unwrap();
        assert!(anchor_warning(&c, now, Some(2 * hour)).unwrap().unwrap().contains("no time"));
    }

    /// An anchor table made before `at_ms` gets the column on open.
    #[test]
    fn an_old_anchor_table_gets_its_time_column() {
        let c = Connection::open_in_memory().unwrap();
        c.execute_batch("CREATE TABLE audit_anchor (id INTEGER PRIMARY KEY CHECK (id = 1), seq INTEGER NOT NULL, sha256 TEXT NOT NULL); INSERT INTO audit_anchor VALUES (1, 3, 'x');").unwrap();
        c.execute_batch(SCHEMA).unwrap();
        assert!(!has_anchor_time(&c).unwrap());
        migrate(&c).unwrap();
        migrate(&c).unwrap();
        assert!(anchor_warning(&c, 0, None).unwrap().unwrap().contains("no time"));
    }

    /// The writer's periodic pass purges records past `retention_audit`,
    /// and the chain goes on verifiably from its anchor.
    #[tokio::test]
    async fn the_writer_purges_old_records_and_the_chain_goes_on() {
        use crate::task::{Ingress, TaskRequest};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.db");
        let opts = super::super::StoreOptions {
            retention_audit: Some(std::time::Duration::from_millis(1)),
            purge_interval: std::time::Duration::from_millis(10),
            ..Default::default()
        };
        let store = super::super::Store::open_with(&path, "n", false, opts).unwrap();
        let who = TaskRequest::sample(vec![]).identity;
        let refuse = || store.rejected(&who, Ingress::Http, "m", "", &crate::error::GatewayError::invalid("no"));
        for _ in 0..3 {
            refuse();
        }
        store.flush().await;
        let reader = open_read_only(&path).unwrap();
        let anchored = || anchor(&reader).unwrap().map(|(seq, _)| seq);
        // The pass runs on the writer's own clock: wait for its result.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while anchored() != Some(3) {
            assert!(std::time::Instant::now() < deadline, "the writer never purged the audit log");
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        refuse();
        store.flush().await;
        assert!(verify(&reader).unwrap() <= 1, "verifies from the anchor");
        let newest: i64 = reader
            .query_row("SELECT COALESCE((SELECT MAX(seq) FROM audit_log), (SELECT seq FROM audit_anchor))", [], |r| {
                r.get(0)
            })
            .unwrap();
        assert_eq!(newest, 4, "numbering goes on after a purge");
    }

    #[test]
    fn queries_filter_by_tenant_and_time_and_page() {
        let c = db();
        chain(&c, 6);
        let q = |tenant: Option<&str>, since, until, after, limit| {
            query(
                &c,
                &AuditQuery {
                    tenant: tenant.map(str::to_string),
                    since_ms: since,
                    until_ms: until,
                    after_seq: after,
                    limit,
                },
            )
            .unwrap()
            .iter()
            .map(|r| r.seq)
            .collect::<Vec<_>>()
        };
        assert_eq!(q(None, None, None, None, 100), [1, 2, 3, 4, 5, 6]);
        assert_eq!(q(Some("a"), None, None, None, 100), [1, 3, 5]);
        assert_eq!(q(Some("b"), Some(300), Some(600), None, 100), [4]);
        assert_eq!(q(None, None, None, Some(2), 2), [3, 4]);
    }
}

/// What the audit log costs on a large store (run by hand:
/// `cargo test --lib store::audit::timing -- --ignored --nocapture`).
#[cfg(test)]
mod timing {
    use super::*;

    #[test]
    #[ignore = "a measurement, not a check"]
    fn append_verify_query_and_purge_on_a_large_log() {
        let dir = tempfile::tempdir().unwrap();
        let c = Connection::open(dir.path().join("t.db")).unwrap();
        c.pragma_update(None, "journal_mode", "WAL").unwrap();
        c.pragma_update(None, "synchronous", "NORMAL").unwrap();
        c.execute_batch(SCHEMA).unwrap();
        let n: i64 = 200_000;
        let entry = |i: i64| AuditEntry {
            at_ms: i,
            task_id: format!("{i:032x}"),
            request_id: format!("req-{i}"),
            trace_id: Some(format!("{i:032x}")),
            tenant: if i % 100 == 0 { "rare".into() } else { "demo".into() },
            application: "demo".into(),
            user_id: Some("user-1".into()),
            key_id: Some("0123456789abcdef".into()),
            device: None,
            ingress: "http".into(),
            requested_model: "general-chat".into(),
            model: Some("general-chat".into()),
            instance: Some("fake".into()),
            route: Vec::new(),
            data_class: Some(DataClass::Personal),
            result: "SUCCEEDED".into(),
            error_code: None,
            input_tokens: 20,
            output_tokens: 5,
            cost: None,
            cache_hit: false,
            context_sha256: None,
            queue_ms: Some(1),
            ttft_ms: Some(2),
            total_ms: Some(3),
            user_data_deleted: None,
        };
        let start = std::time::Instant::now();
        let mut head = ChainHead::default();
        for chunk in 0..n / 1000 {
            let t = c.unchecked_transaction().unwrap();
            for i in chunk * 1000..(chunk + 1) * 1000 {
                append(&t, &mut head, entry(i + 1)).unwrap();
            }
            t.commit().unwrap();
        }
        println!("{n} records appended (1000 a transaction) in {:?}", start.elapsed());
        let start = std::time::Instant::now();
        assert_eq!(verify(&c).unwrap(), n as u64);
        println!("verify of {n} records: {:?}", start.elapsed());
        let start = std::time::Instant::now();
        let q = AuditQuery { tenant: Some("rare".into()), since_ms: Some(n / 2), limit: 100, ..Default::default() };
        assert_eq!(query(&c, &q).unwrap().len(), 100);
        println!("a page of 100 records of a tenant with 1 % of them, from the middle: {:?}", start.elapsed());
        for batch in [1000, 1000, 5000] {
            let start = std::time::Instant::now();
            let t = c.unchecked_transaction().unwrap();
            let purged = purge(&t, n + 1, batch).unwrap();
            t.commit().unwrap();
            println!("a purge pass of {batch} over {n} records purged {purged} in {:?}", start.elapsed());
        }
        let start = std::time::Instant::now();
        assert_eq!(verify(&c).unwrap(), n as u64 - 7000);
        println!("verify from the anchor: {:?}", start.elapsed());
    }
}
