//! The task store: SQLite (WAL) on a dedicated thread.
//!
//! Owns: the database file, its schema and every write to it. Callers send
//! operations over a channel and never wait for a write on the request path;
//! writes are batched into one transaction per burst. Reads (and `flush`)
//! answer through a oneshot.
//!
//! The task and transition tables are here; each other table has its own
//! file: `idempotency.rs` (keys), `pending_requests.rs` (to re-queue after
//! a crash) and `revoked_keys.rs`.
//!
//! Does not own: the decisions recorded (scheduler), prompt policy (the
//! caller decides whether text is passed in at all) or metrics: it counts
//! its failed writes in [`WriteFailures`], which telemetry exports.

mod idempotency;
mod pending_requests;
mod revoked_keys;

pub use idempotency::IdempotentRecord;
pub use pending_requests::{StoredRequest, Unfinished};

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::Arc;

use rusqlite::{params, Connection, OptionalExtension};
use tokio::sync::oneshot;

use crate::error::GatewayError;
use crate::task::{Identity, Ingress, ResultMeta, TaskRequest, TaskState};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("cannot open task store {path}: {source}")]
    Open { path: PathBuf, source: rusqlite::Error },
    #[error("cannot create data directory {path}: {source}")]
    Dir { path: PathBuf, source: std::io::Error },
    #[error("task store is closed")]
    Closed,
    #[error("task store query failed: {0}")]
    Query(#[from] rusqlite::Error),
}

/// One recorded state change.
#[derive(Debug, Clone, PartialEq)]
pub struct Transition {
    pub state: TaskState,
    pub at_ms: i64,
    pub reason: String,
    pub node_id: String,
    pub instance: Option<String>,
    /// Who caused it: `client`, `scheduler`, `engine`, `admin`, `gateway`.
    pub actor: String,
}

/// A task as stored.
#[derive(Debug, Clone, PartialEq)]
pub struct TaskRecord {
    pub task_id: String,
    pub request_id: String,
    pub tenant: String,
    pub application: String,
    pub user_id: Option<String>,
    pub ingress: String,
    pub logical_model: String,
    pub priority: String,
    pub state: TaskState,
    pub created_at_ms: i64,
    pub prompt_sha256: String,
    pub prompt_text: Option<String>,
    pub result_text: Option<String>,
    pub error_code: Option<String>,
    pub result: Option<ResultMeta>,
    pub transitions: Vec<Transition>,
}

enum Op {
    NewTask {
        row: Box<NewTaskRow>,
        prompt_text: Option<String>,
    },
    Transition {
        task_id: String,
        t: Transition,
    },
    Finish {
        meta: Box<ResultMeta>,
        error_code: Option<String>,
        result_text: Option<String>,
        /// The answer kept with the task's idempotency key, if it has one.
        idempotent_text: Option<String>,
    },
    Rejected {
        row: Box<RejectedCall>,
    },
    Remember {
        req: Box<StoredRequest>,
        ttl_ms: i64,
    },
    Started(String),
    Forget {
        tenant: String,
        app: String,
        key: String,
        task_id: String,
    },
    Unfinished(oneshot::Sender<Vec<Unfinished>>),
    SetRevoked {
        key_sha256: String,
        by: String,
        revoked: bool,
    },
    RevokedKeys(oneshot::Sender<Vec<String>>),
    Flush(oneshot::Sender<()>),
    Get(String, oneshot::Sender<Result<Option<TaskRecord>, StoreError>>),
}

/// What the reader thread answers.
enum ReadOp {
    Lookup { tenant: String, app: String, key: String, reply: oneshot::Sender<Option<IdempotentRecord>> },
}

/// A call refused at admission, before it had a validated task.
struct RejectedCall {
    task_id: String,
    tenant: String,
    application: String,
    user_id: Option<String>,
    ingress: &'static str,
    model: String,
    code: &'static str,
    message: String,
    at_ms: i64,
    node_id: String,
}

/// Handle to the store thread. Cheap to clone.
#[derive(Clone)]
pub struct Store {
    tx: mpsc::Sender<Op>,
    /// The reader thread: lookups on the request path that must not wait
    /// behind the writer's batches and WAL checkpoints.
    reads: mpsc::Sender<ReadOp>,
    node_id: Arc<str>,
    store_prompts: bool,
    failures: WriteFailures,
}

/// How many writes (or batch commits) failed since the store opened; the
/// task itself went on. The store counts, telemetry exports it, so the store
/// needs no metrics of its own.
#[derive(Debug, Clone, Default)]
pub struct WriteFailures(Arc<AtomicU64>);

impl WriteFailures {
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }

    fn inc(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
}

const SCHEMA: &str = r#"
CREATE TABLE IF NOT EXISTS tasks (
    task_id        TEXT PRIMARY KEY,
    request_id     TEXT NOT NULL,
    tenant         TEXT NOT NULL,
    application    TEXT NOT NULL,
    user_id        TEXT,
    ingress        TEXT NOT NULL,
    logical_model  TEXT NOT NULL,
    priority       TEXT NOT NULL,
    state          TEXT NOT NULL,
    created_at_ms  INTEGER NOT NULL,
    updated_at_ms  INTEGER NOT NULL,
    prompt_sha256  TEXT NOT NULL,
    prompt_text    TEXT,
    result_text    TEXT,
    session_id     TEXT,
    idempotency_key TEXT,
    error_code     TEXT,
    result_json    TEXT
);
CREATE INDEX IF NOT EXISTS tasks_by_request ON tasks(tenant, application, request_id);
CREATE INDEX IF NOT EXISTS tasks_by_state ON tasks(state);
CREATE TABLE IF NOT EXISTS task_transitions (
    task_id   TEXT NOT NULL,
    seq       INTEGER NOT NULL,
    state     TEXT NOT NULL,
    at_ms     INTEGER NOT NULL,
    reason    TEXT NOT NULL,
    node_id   TEXT NOT NULL,
    instance  TEXT,
    actor     TEXT NOT NULL,
    PRIMARY KEY (task_id, seq)
);
"#;

impl Store {
    /// Opens (creating if needed) the database and starts the writer thread.
    pub fn open(path: &Path, node_id: &str, store_prompts: bool) -> Result<Store, StoreError> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|source| StoreError::Dir { path: dir.to_path_buf(), source })?;
        }
        let open_err = |source| StoreError::Open { path: path.to_path_buf(), source };
        let conn = Connection::open(path).map_err(open_err)?;
        conn.set_prepared_statement_cache_capacity(64);
        conn.pragma_update(None, "journal_mode", "WAL").map_err(open_err)?;
        // NORMAL in WAL mode is durable against a process crash (kill -9);
        // only an OS crash can lose the last transactions.
        conn.pragma_update(None, "synchronous", "NORMAL").map_err(open_err)?;
        conn.pragma_update(None, "busy_timeout", 5000).map_err(open_err)?;
        conn.execute_batch(SCHEMA).map_err(open_err)?;
        for schema in [idempotency::SCHEMA, pending_requests::SCHEMA, revoked_keys::SCHEMA] {
            conn.execute_batch(schema).map_err(open_err)?;
        }
        let expired = idempotency::expire(&conn, crate::task::now_ms()).map_err(open_err)?;
        if expired > 0 {
            tracing::info!(expired, "dropped expired idempotency keys");
        }
        // WAL lets a second connection read committed data while the writer
        // writes or checkpoints.
        let reader = Connection::open_with_flags(
            path,
            rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY | rusqlite::OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
        .map_err(open_err)?;
        reader.pragma_update(None, "busy_timeout", 5000).map_err(open_err)?;
        let (tx, rx) = mpsc::channel();
        let failures = WriteFailures::default();
        let writer_failures = failures.clone();
        let spawn_err = |e| StoreError::Dir { path: path.to_path_buf(), source: e };
        std::thread::Builder::new()
            .name("edgeway-store".into())
            .spawn(move || writer_loop(conn, rx, writer_failures))
            .map_err(spawn_err)?;
        let (reads, read_rx) = mpsc::channel();
        std::thread::Builder::new()
            .name("edgeway-store-read".into())
            .spawn(move || reader_loop(reader, read_rx))
            .map_err(spawn_err)?;
        Ok(Store { tx, reads, node_id: node_id.into(), store_prompts, failures })
    }

    /// The counter of failed writes (shared: it keeps counting).
    pub fn write_failures(&self) -> WriteFailures {
        self.failures.clone()
    }

    pub fn node_id(&self) -> &str {
        &self.node_id
    }

    pub fn stores_prompts(&self) -> bool {
        self.store_prompts
    }

    /// Writes a new task row (state RECEIVED). Task rows and transitions are
    /// written as told: record them through `telemetry::lifecycle::Recorder`,
    /// which checks each against the task state machine first.
    pub fn new_task(&self, req: &TaskRequest) {
        let prompt_text = self.store_prompts.then(|| serde_json::to_string(&req.messages).unwrap_or_default());
        // Only the columns: the prompt itself is not copied unless stored.
        let row = NewTaskRow {
            task_id: req.task_id.clone(),
            request_id: req.request_id.clone(),
            tenant: req.identity.tenant.clone(),
            application: req.identity.application.clone(),
            user_id: req.identity.user_id.clone(),
            ingress: req.ingress.as_str(),
            logical_model: req.logical_model.clone(),
            priority: req.priority.as_str(),
            created_at_ms: crate::task::unix_ms(req.received_wall),
            prompt_sha256: req.prompt_sha256.clone(),
            session_id: req.session_id.clone(),
            idempotency_key: req.idempotency_key.clone(),
        };
        let _ = self.tx.send(Op::NewTask { row: Box::new(row), prompt_text });
    }

    /// Appends a transition and sets the task's state (unchecked: see
    /// [`Self::new_task`]).
    pub fn transition(&self, task_id: &str, state: TaskState, reason: &str, instance: Option<&str>, actor: &str) {
        let t = Transition {
            state,
            at_ms: crate::task::now_ms(),
            reason: reason.to_string(),
            node_id: self.node_id.to_string(),
            instance: instance.map(str::to_string),
            actor: actor.to_string(),
        };
        let _ = self.tx.send(Op::Transition { task_id: task_id.to_string(), t });
    }

    /// Records a call that admission refused, as a task that went
    /// RECEIVED → VALIDATING → REJECTED.
    pub fn rejected(&self, who: &Identity, ingress: Ingress, model: &str, e: &GatewayError) -> String {
        let task_id = crate::task::new_task_id();
        let row = RejectedCall {
            task_id: task_id.clone(),
            tenant: who.tenant.clone(),
            application: who.application.clone(),
            user_id: who.user_id.clone(),
            ingress: ingress.as_str(),
            model: model.chars().take(128).collect(),
            code: e.code.as_str(),
            message: e.message.chars().take(500).collect(),
            at_ms: crate::task::now_ms(),
            node_id: self.node_id.to_string(),
        };
        let _ = self.tx.send(Op::Rejected { row: Box::new(row) });
        task_id
    }

    /// Records the final metadata. `result_text` is dropped unless prompts
    /// are stored.
    /// With `idempotent`, the text is also kept with the task's idempotency
    /// key (for the key's lifetime), whatever the prompt policy.
    pub fn finish(&self, meta: &ResultMeta, error_code: Option<&str>, result_text: Option<String>, idempotent: bool) {
        let idempotent_text = if idempotent { result_text.clone() } else { None };
        let _ = self.tx.send(Op::Finish {
            meta: Box::new(meta.clone()),
            error_code: error_code.map(str::to_string),
            result_text: result_text.filter(|_| self.store_prompts),
            idempotent_text,
        });
    }

    /// Resolves once everything sent before it is written.
    pub async fn flush(&self) {
        let (tx, rx) = oneshot::channel();
        if self.tx.send(Op::Flush(tx)).is_ok() {
            let _ = rx.await;
        }
    }

    /// Records an idempotency key and the request needed to queue the task
    /// again after a restart (until it starts).
    pub fn remember(&self, req: StoredRequest, ttl_ms: i64) {
        let _ = self.tx.send(Op::Remember { req: Box::new(req), ttl_ms });
    }

    /// The task has started on an engine: it will not be re-queued.
    pub fn started(&self, task_id: &str) {
        let _ = self.tx.send(Op::Started(task_id.to_string()));
    }

    /// Forgets a key whose task was refused, so a retry may start afresh.
    pub fn forget_key(&self, tenant: &str, app: &str, key: &str, task_id: &str) {
        let op = Op::Forget { tenant: tenant.into(), app: app.into(), key: key.into(), task_id: task_id.into() };
        let _ = self.tx.send(op);
    }

    /// Records that an API key (its SHA-256, hex) is revoked, or no longer.
    /// Resolves once it is written.
    pub async fn set_revoked(&self, key_sha256: &str, by: &str, revoked: bool) {
        let op = Op::SetRevoked { key_sha256: key_sha256.into(), by: by.into(), revoked };
        if self.tx.send(op).is_ok() {
            self.flush().await;
        }
    }

    /// Digests (hex) of the API keys revoked at run time.
    pub async fn revoked_keys(&self) -> Vec<String> {
        let (tx, rx) = oneshot::channel();
        if self.tx.send(Op::RevokedKeys(tx)).is_err() {
            return Vec::new();
        }
        rx.await.unwrap_or_default()
    }

    /// Tasks that were not terminal when the gateway last stopped.
    pub async fn unfinished(&self) -> Vec<Unfinished> {
        let (tx, rx) = oneshot::channel();
        if self.tx.send(Op::Unfinished(tx)).is_err() {
            return Vec::new();
        }
        rx.await.unwrap_or_default()
    }

    /// A live idempotency key of this tenant and application.
    pub async fn lookup_idempotency(&self, tenant: &str, app: &str, key: &str) -> Option<IdempotentRecord> {
        let (reply, rx) = oneshot::channel();
        let op = ReadOp::Lookup { tenant: tenant.into(), app: app.into(), key: key.into(), reply };
        self.reads.send(op).ok()?;
        rx.await.ok().flatten()
    }

    pub async fn get(&self, task_id: &str) -> Result<Option<TaskRecord>, StoreError> {
        let (tx, rx) = oneshot::channel();
        self.tx.send(Op::Get(task_id.to_string(), tx)).map_err(|_| StoreError::Closed)?;
        rx.await.map_err(|_| StoreError::Closed)?
    }
}

/// Runs a write through the connection's statement cache, so the SQL of
/// the few statements the store uses is parsed once, not on every write.
pub(crate) fn exec(c: &Connection, sql: &str, params: impl rusqlite::Params) -> rusqlite::Result<usize> {
    c.prepare_cached(sql)?.execute(params)
}

/// Writes up to this many operations in one transaction.
const BATCH: usize = 512;

/// Answers lookups from committed data (a key written moments ago may not
/// be visible yet: its task is then still in the live registry, which is
/// asked first).
fn reader_loop(conn: Connection, rx: mpsc::Receiver<ReadOp>) {
    while let Ok(op) = rx.recv() {
        match op {
            ReadOp::Lookup { tenant, app, key, reply } => {
                let r = idempotency::lookup(&conn, &tenant, &app, &key, crate::task::now_ms());
                let _ = reply.send(r.unwrap_or_else(|e| {
                    tracing::error!(error = %e, "idempotency lookup failed");
                    None
                }));
            }
        }
    }
}

fn writer_loop(mut conn: Connection, rx: mpsc::Receiver<Op>, failures: WriteFailures) {
    while let Ok(first) = rx.recv() {
        let mut batch = vec![first];
        while batch.len() < BATCH {
            match rx.try_recv() {
                Ok(op) => batch.push(op),
                Err(_) => break,
            }
        }
        let mut replies = Vec::new();
        let res = (|| -> rusqlite::Result<()> {
            let txn = conn.transaction()?;
            for op in batch {
                // One bad write must not roll back the others of the batch.
                let r = match op {
                    Op::NewTask { row, prompt_text } => insert_task(&txn, &row, prompt_text),
                    Op::Transition { task_id, t } => insert_transition(&txn, &task_id, &t),
                    Op::Finish { meta, error_code, result_text, idempotent_text } => {
                        finish_task(&txn, &meta, error_code, result_text).and_then(|_| {
                            pending_requests::drop_request(&txn, &meta.task_id)?;
                            match idempotent_text {
                                Some(t) => idempotency::keep_result(&txn, &meta.task_id, &t),
                                None => Ok(()),
                            }
                        })
                    }
                    Op::Rejected { row } => insert_rejected(&txn, &row),
                    Op::Remember { req, ttl_ms } => remember(&txn, &req, ttl_ms, crate::task::now_ms()),
                    Op::Started(id) => pending_requests::drop_request(&txn, &id),
                    Op::Forget { tenant, app, key, task_id } => {
                        idempotency::forget(&txn, &tenant, &app, &key, &task_id)
                            .and_then(|_| pending_requests::drop_request(&txn, &task_id))
                    }
                    Op::Unfinished(tx) => {
                        replies.push(Reply::Unfinished(tx));
                        Ok(())
                    }
                    Op::SetRevoked { key_sha256, by, revoked } => {
                        revoked_keys::set_revoked(&txn, &key_sha256, &by, revoked, crate::task::now_ms())
                    }
                    Op::RevokedKeys(tx) => {
                        replies.push(Reply::RevokedKeys(tx));
                        Ok(())
                    }
                    Op::Flush(tx) => {
                        replies.push(Reply::Flush(tx));
                        Ok(())
                    }
                    Op::Get(id, tx) => {
                        replies.push(Reply::Get(id, tx));
                        Ok(())
                    }
                };
                if let Err(e) = r {
                    failures.inc();
                    tracing::error!(error = %e, "task store write failed");
                }
            }
            txn.commit()
        })();
        if let Err(e) = res {
            failures.inc();
            tracing::error!(error = %e, "task store commit failed");
        }
        for r in replies {
            match r {
                Reply::Flush(tx) => {
                    let _ = tx.send(());
                }
                Reply::Get(id, tx) => {
                    let _ = tx.send(read_task(&conn, &id));
                }
                Reply::RevokedKeys(tx) => {
                    let _ = tx.send(revoked_keys::revoked_keys(&conn).unwrap_or_else(|e| {
                        tracing::error!(error = %e, "reading revoked keys failed");
                        Vec::new()
                    }));
                }
                Reply::Unfinished(tx) => {
                    let _ = tx.send(pending_requests::unfinished(&conn).unwrap_or_else(|e| {
                        tracing::error!(error = %e, "reading unfinished tasks failed");
                        Vec::new()
                    }));
                }
            }
        }
    }
}

enum Reply {
    Unfinished(oneshot::Sender<Vec<Unfinished>>),
    RevokedKeys(oneshot::Sender<Vec<String>>),
    Flush(oneshot::Sender<()>),
    Get(String, oneshot::Sender<Result<Option<TaskRecord>, StoreError>>),
}

/// Records an idempotency key and the request needed to queue its task
/// again after a restart (nothing without a key).
fn remember(c: &Connection, r: &StoredRequest, ttl_ms: i64, now: i64) -> rusqlite::Result<()> {
    let Some(key) = &r.idempotency_key else { return Ok(()) };
    idempotency::remember(c, &r.tenant, &r.application, key, &r.task_id, &r.prompt_sha256, ttl_ms, now)?;
    pending_requests::keep(c, r)
}

/// The columns of a new task row.
struct NewTaskRow {
    task_id: String,
    request_id: String,
    tenant: String,
    application: String,
    user_id: Option<String>,
    ingress: &'static str,
    logical_model: String,
    priority: &'static str,
    created_at_ms: i64,
    prompt_sha256: String,
    session_id: Option<String>,
    idempotency_key: Option<String>,
}

fn insert_task(c: &Connection, r: &NewTaskRow, prompt_text: Option<String>) -> rusqlite::Result<()> {
    let now = r.created_at_ms;
    exec(
        c,
        "INSERT OR IGNORE INTO tasks (task_id, request_id, tenant, application, user_id, ingress, logical_model, \
         priority, state, created_at_ms, updated_at_ms, prompt_sha256, prompt_text, session_id, idempotency_key) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, 'RECEIVED', ?9, ?9, ?10, ?11, ?12, ?13)",
        params![
            r.task_id,
            r.request_id,
            r.tenant,
            r.application,
            r.user_id,
            r.ingress,
            r.logical_model,
            r.priority,
            now,
            r.prompt_sha256,
            prompt_text,
            r.session_id,
            r.idempotency_key,
        ],
    )?;
    Ok(())
}

fn insert_rejected(c: &Connection, r: &RejectedCall) -> rusqlite::Result<()> {
    exec(
        c,
        "INSERT INTO tasks (task_id, request_id, tenant, application, user_id, ingress, logical_model, priority, \
         state, created_at_ms, updated_at_ms, prompt_sha256, error_code) \
         VALUES (?1, '', ?2, ?3, ?4, ?5, ?6, '', 'REJECTED', ?7, ?7, '', ?8)",
        params![r.task_id, r.tenant, r.application, r.user_id, r.ingress, r.model, r.at_ms, r.code],
    )?;
    for (state, reason) in [("RECEIVED", r.ingress), ("VALIDATING", ""), ("REJECTED", r.message.as_str())] {
        exec(c,
            "INSERT INTO task_transitions (task_id, seq, state, at_ms, reason, node_id, instance, actor) \
             VALUES (?1, (SELECT COALESCE(MAX(seq), -1) + 1 FROM task_transitions WHERE task_id = ?1), ?2, ?3, ?4, ?5, NULL, 'gateway')",
            params![r.task_id, state, r.at_ms, reason, r.node_id],
        )?;
    }
    Ok(())
}

fn insert_transition(c: &Connection, task_id: &str, t: &Transition) -> rusqlite::Result<()> {
    exec(c,
        "INSERT INTO task_transitions (task_id, seq, state, at_ms, reason, node_id, instance, actor) \
         VALUES (?1, (SELECT COALESCE(MAX(seq), -1) + 1 FROM task_transitions WHERE task_id = ?1), ?2, ?3, ?4, ?5, ?6, ?7)",
        params![task_id, t.state.as_str(), t.at_ms, t.reason, t.node_id, t.instance, t.actor],
    )?;
    exec(
        c,
        "UPDATE tasks SET state = ?2, updated_at_ms = ?3 WHERE task_id = ?1",
        params![task_id, t.state.as_str(), t.at_ms],
    )?;
    Ok(())
}

fn finish_task(
    c: &Connection,
    m: &ResultMeta,
    error_code: Option<String>,
    result_text: Option<String>,
) -> rusqlite::Result<()> {
    let json = serde_json::to_string(m).unwrap_or_default();
    exec(
        c,
        "UPDATE tasks SET state = ?2, error_code = ?3, result_json = ?4, result_text = ?5, updated_at_ms = ?6 \
         WHERE task_id = ?1",
        params![m.task_id, m.status.as_str(), error_code, json, result_text, crate::task::now_ms()],
    )?;
    Ok(())
}

fn read_task(c: &Connection, id: &str) -> Result<Option<TaskRecord>, StoreError> {
    let rec = c
        .query_row(
            "SELECT task_id, request_id, tenant, application, user_id, ingress, logical_model, priority, state, \
             created_at_ms, prompt_sha256, prompt_text, result_text, error_code, result_json FROM tasks WHERE task_id = ?1",
            params![id],
            |row| {
                let state: String = row.get(8)?;
                let result_json: Option<String> = row.get(14)?;
                Ok(TaskRecord {
                    task_id: row.get(0)?,
                    request_id: row.get(1)?,
                    tenant: row.get(2)?,
                    application: row.get(3)?,
                    user_id: row.get(4)?,
                    ingress: row.get(5)?,
                    logical_model: row.get(6)?,
                    priority: row.get(7)?,
                    state: TaskState::parse(&state).unwrap_or(TaskState::Failed),
                    created_at_ms: row.get(9)?,
                    prompt_sha256: row.get(10)?,
                    prompt_text: row.get(11)?,
                    result_text: row.get(12)?,
                    error_code: row.get(13)?,
                    result: result_json.and_then(|j| serde_json::from_str(&j).ok()),
                    transitions: Vec::new(),
                })
            },
        )
        .optional()?;
    let Some(mut rec) = rec else { return Ok(None) };
    let mut stmt = c.prepare(
        "SELECT state, at_ms, reason, node_id, instance, actor FROM task_transitions WHERE task_id = ?1 ORDER BY seq",
    )?;
    let rows = stmt.query_map(params![id], |row| {
        let state: String = row.get(0)?;
        Ok(Transition {
            state: TaskState::parse(&state).unwrap_or(TaskState::Failed),
            at_ms: row.get(1)?,
            reason: row.get(2)?,
            node_id: row.get(3)?,
            instance: row.get(4)?,
            actor: row.get(5)?,
        })
    })?;
    for t in rows {
        rec.transitions.push(t?);
    }
    Ok(Some(rec))
}
