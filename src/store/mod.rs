//! The task store: SQLite (WAL) on a dedicated thread.
//!
//! Owns: the database file, its schema and every write to it. Callers send
//! operations over a channel and never wait for a write on the request path;
//! writes are batched into one transaction per burst. Reads (and `flush`)
//! answer through a oneshot. A write a caller must know is durable (a key
//! revocation) is answered once committed, or with the failure.
//!
//! A failing disk is a state, not a silence: a transaction that cannot
//! commit (disk full, read-only, I/O error) leaves the store degraded
//! ([`StoreHealth`], which `/ready`, metrics and the facade read), its
//! writes stay in memory (bounded) and are written again until a commit
//! succeeds. A full disk is met with the store's reserve (`reserve.rs`):
//! the space set aside is given back, so that what running tasks record is
//! committed at once rather than held in memory, where a stop before the
//! disk has room again would lose it; new work stays refused until the
//! reserve can be set aside again. The writer also purges what is past the
//! retention (`retention.rs`).
//!
//! The task and transition tables are here; each other table has its own
//! file: `idempotency.rs` (keys), `pending_requests.rs` (to re-queue after
//! a crash), `revoked_keys.rs` and `sessions.rs` (sessions, their history
//! and memory), `budget.rs` (what tenants and applications spent, written
//! with each task's end).
//!
//! Does not own: the decisions recorded (scheduler), prompt policy (the
//! caller decides whether text is passed in at all) or metrics: it counts
//! its failed writes in [`WriteFailures`], which telemetry exports.

pub mod audit;
pub mod budget;
mod idempotency;
mod pending_requests;
mod reserve;
mod responses;
mod retention;
mod revoked_keys;
pub mod sessions;
mod user_data;

pub use audit::{AuditEntry, AuditQuery, AuditRecord, ChainBroken, VerifyError};
pub use idempotency::IdempotentRecord;
pub use pending_requests::{StoredRequest, Unfinished};
pub use user_data::{UserDataDeleted, UserDataForgotten};

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rusqlite::{params, Connection, OptionalExtension};
use tokio::sync::oneshot;

pub use crate::config::ClassRetention;
use crate::error::GatewayError;
use crate::task::{DataClass, Identity, Ingress, ResultMeta, TaskRequest, TaskState};

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
    /// Writes fail (disk full, read-only, I/O error): the store is degraded.
    #[error("task store cannot write: {0}")]
    Unavailable(String),
    /// As many audit queries run as the store allows at once.
    #[error("too many audit queries at once")]
    Busy,
}

/// Audit queries at once (each holds a connection and a blocking thread
/// while it scans).
pub const AUDIT_QUERIES_AT_ONCE: usize = 4;

/// What the idempotency key of a finished task keeps for a repeat.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyedResult {
    /// The task has no key.
    None,
    /// The outcome (state, error code, result metadata) but not the answer
    /// text: a caller that did not choose its key (an MQTT device) under a
    /// policy that keeps no text (`store_prompts = false`). The text of a
    /// repeat then comes from the scheduler's replay, in memory only.
    Outcome,
    /// The outcome and the answer text, for the key's lifetime: the caller
    /// sent the key (it asks for the replay), or the policy keeps text.
    OutcomeAndText,
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
    /// The task's trace id; `None` for tasks recorded before trace ids.
    pub trace_id: Option<String>,
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
    /// The Response object kept for `GET /v1/responses/{id}` (see
    /// `responses.rs`), if this task is a stored response.
    pub response: Option<String>,
    /// The conversation that Response answered (a JSON list of chat
    /// messages), for `previous_response_id`.
    pub response_conversation: Option<String>,
}

/// A write: applied in the writer's transaction, and kept (in memory,
/// bounded) until a transaction that holds it commits.
enum WriteOp {
    NewTask {
        row: Box<NewTaskRow>,
        prompt_text: Option<String>,
    },
    Transition {
        task_id: String,
        t: Transition,
    },
    /// The terminal transition and the result in one op, so no batch
    /// commits the terminal state without its error code and result.
    Finish {
        t: Box<Transition>,
        meta: Box<ResultMeta>,
        error_code: Option<String>,
        result_text: Option<String>,
        /// The task has an idempotency key: a repeat is answered from what
        /// this write records.
        keyed: bool,
        /// The answer kept with the task's idempotency key, where it may be
        /// kept ([`KeyedResult`]).
        idempotent_text: Option<String>,
        /// For the task's audit record (see `audit.rs`).
        key_id: Option<String>,
    },
    Rejected {
        row: Box<RejectedCall>,
    },
    /// A validated task refused before it ran (the scheduler refused it,
    /// or its caller went away before it was queued): the terminal
    /// transition, the error code and the audit record in one op, so no
    /// batch commits the REJECTED state without its record (review 15 H4).
    Refused {
        t: Box<Transition>,
        code: String,
        entry: Box<AuditEntry>,
    },
    Remember {
        req: Box<StoredRequest>,
        ttl_ms: i64,
        /// The task that held the key before, when this one runs the
        /// request again after a transient end (the key moves over).
        replaces: Option<String>,
    },
    Started(String),
    Forget {
        tenant: String,
        app: String,
        key: String,
        task_id: String,
    },
    /// The key of a call that lost the race to another task with the same
    /// key goes to that task (whichever `Remember` landed first).
    Handover {
        tenant: String,
        app: String,
        key: String,
        from: String,
        to: String,
    },
    /// A Response object to keep with its task.
    KeepResponse {
        task_id: String,
        body: String,
        conversation: Option<String>,
    },
    ForgetResponse(String),
    /// A session's row (created, or its counts after a turn).
    SessionRow(Box<sessions::SessionRow>),
    SessionMessage(Box<sessions::MessageRow>),
    SessionMemory(Box<sessions::MemoryRow>),
    SessionMemoryClear(String),
    SessionDelete(String),
    SetRevoked {
        key_sha256: String,
        by: String,
        revoked: bool,
    },
}

/// How soon a write is committed ([`WriteOp::urgency`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Urgency {
    /// Within the write-behind window ([`StoreOptions::commit_window`]).
    Behind,
    /// Within [`StoreOptions::new_task_window`].
    Soon,
    /// At once ([`WriteOp::commits_at_once`]).
    AtOnce,
}

impl WriteOp {
    /// How soon the write is committed: a new task's row without an
    /// idempotency key within `new_task_window` (a crash within it loses
    /// the task whole: without a key it could not be queued again anyway,
    /// and its caller never gets an answer from the run that crashed; each
    /// new task committing by itself was most of the store's writes,
    /// BENCHMARKS.md sessions 21 and 22);
    /// what crash recovery stands on at once; the rest behind.
    fn urgency(&self) -> Urgency {
        match self {
            WriteOp::NewTask { row, .. } if row.idempotency_key.is_none() => Urgency::Soon,
            w if w.commits_at_once() => Urgency::AtOnce,
            _ => Urgency::Behind,
        }
    }

    /// Writes that end the write-behind window (commit at once): a new
    /// task's row with an idempotency key, and its kept request (a client
    /// may see the task acknowledged next, and after a crash it must be in
    /// the store to be queued again or answered), and
    /// `Started` (after a crash, a task that had reached an engine must not
    /// be queued again). Transitions and results may wait: losing the last
    /// of them to a crash leaves the task in an earlier state, which
    /// recovery ends as FAILED. Not so what an idempotency key answers
    /// with (review 14 H1): the result of a task with a key (every device
    /// request has one), and a key forgotten or handed over. Lost to a
    /// crash, a repeat of the key after the restart would find the task
    /// FAILED (or the key on a refused task) and run the request again,
    /// though its client may already hold the answer.
    fn commits_at_once(&self) -> bool {
        matches!(
            self,
            WriteOp::NewTask { .. }
                | WriteOp::Remember { .. }
                | WriteOp::Started(_)
                | WriteOp::Finish { keyed: true, .. }
                | WriteOp::Forget { .. }
                | WriteOp::Handover { .. }
        )
    }
}

/// The writer's channel. A write that may wait for the write-behind
/// window does not wake the writer while it waits out that window (it
/// gathers what came when the window ends); anything sooner does. Woken
/// by every write (about eight a task), the writer cost the runtime's
/// workers more in wake-ups than gathering the writes saved it
/// (BENCHMARKS.md, session 22).
#[derive(Clone)]
struct Inbox {
    tx: mpsc::Sender<Op>,
    writer: std::thread::Thread,
}

impl Inbox {
    /// Fails only once the writer thread is gone (the op is dropped).
    fn send(&self, op: Op) -> Result<(), WriterGone> {
        let behind = matches!(&op, Op::Write(w) if w.urgency() == Urgency::Behind);
        self.tx.send(op).map_err(|_| WriterGone)?;
        if !behind {
            // Ends the writer's wait for the window (`Writer::run`). The
            // channel itself wakes a writer waiting for a first write.
            self.writer.unpark();
        }
        Ok(())
    }
}

/// The writer thread has stopped ([`Inbox::send`]).
struct WriterGone;

enum Op {
    Write(WriteOp),
    /// A write whose caller waits: answered once it is committed, or with
    /// the failure (the write itself stays buffered and is retried).
    Durable(WriteOp, oneshot::Sender<Result<(), StoreError>>),
    Unfinished(oneshot::Sender<Vec<Unfinished>>),
    RevokedKeys(oneshot::Sender<Vec<String>>),
    Sessions(oneshot::Sender<Vec<sessions::StoredSession>>),
    Flush(oneshot::Sender<()>),
    Get(String, oneshot::Sender<Result<Option<TaskRecord>, StoreError>>),
    /// Deletes a user's data with its audit record (`user_data.rs`).
    ForgetUser(Box<ForgetUser>),
    /// Answered once no write is buffered (every write sent before it is
    /// committed): the last thing a stop waits for.
    Settled(oneshot::Sender<()>),
    /// Test support: runs a pragma on the writer's connection (a tiny
    /// `max_page_count` for a full disk, `query_only` for a read-only one).
    #[cfg(any(test, feature = "testing"))]
    Pragma(&'static str, i64, oneshot::Sender<()>),
    /// Test support: the writer thread returns at once, as a dead one.
    #[cfg(any(test, feature = "testing"))]
    Exit(oneshot::Sender<()>),
    /// Test support: the next retention pass runs now (after the writes
    /// sent before it); answered once it ran.
    #[cfg(any(test, feature = "testing"))]
    PurgeNow(oneshot::Sender<()>),
}

/// A user's data to delete, and the audit record that says so.
struct ForgetUser {
    tenant: String,
    user: String,
    entry: AuditEntry,
    reply: oneshot::Sender<Result<UserDataForgotten, StoreError>>,
}

/// Why the store is degraded once its writer thread is gone.
const WRITER_GONE: &str = "the writer thread stopped";

/// What the reader thread answers.
enum ReadOp {
    Lookup { tenant: String, app: String, key: String, reply: oneshot::Sender<Option<IdempotentRecord>> },
}

/// A call refused at admission, before it had a validated task.
struct RejectedCall {
    task_id: String,
    trace_id: String,
    tenant: String,
    application: String,
    user_id: Option<String>,
    ingress: &'static str,
    model: String,
    code: &'static str,
    message: String,
    at_ms: i64,
    node_id: String,
    key_id: Option<String>,
    data_class: Option<crate::task::DataClass>,
}

/// Handle to the store thread. Cheap to clone.
#[derive(Clone)]
pub struct Store {
    tx: Inbox,
    /// The reader thread: lookups on the request path that must not wait
    /// behind the writer's batches and WAL checkpoints.
    reads: mpsc::Sender<ReadOp>,
    node_id: Arc<str>,
    store_prompts: bool,
    /// By [`DataClass`] order: whether the class's text may reach the file
    /// (`[store.retention.<class>] store_text`).
    text_allowed: [bool; 4],
    failures: WriteFailures,
    health: StoreHealth,
    /// The database file (audit queries open their own connection).
    path: Arc<Path>,
    /// Audit records as they are committed (the NATS publisher reads it;
    /// a slow reader loses records, the table keeps them).
    audit_tx: tokio::sync::broadcast::Sender<Arc<AuditRecord>>,
    /// Bounds the audit queries running at once ([`AUDIT_QUERIES_AT_ONCE`]).
    audit_queries: Arc<tokio::sync::Semaphore>,
    /// What tenants and applications spent (read back at open).
    budgets: budget::Budgets,
}

/// What the store needs to know beyond its file (from `[store]`).
#[derive(Debug, Clone)]
pub struct StoreOptions {
    /// Writes kept in memory while the disk refuses them; past it, new
    /// writes are dropped (and counted).
    pub max_buffered_writes: usize,
    /// Finished tasks (and their transitions) older than this are purged;
    /// `None` keeps them.
    pub retention_tasks: Option<Duration>,
    /// Refused calls (REJECTED) older than this are purged; `None` keeps
    /// them.
    pub retention_rejected: Option<Duration>,
    /// Audit records older than this are purged, oldest first (the chain
    /// stays verifiable from an anchor); `None` keeps them.
    pub retention_audit: Option<Duration>,
    /// How often the writer purges (each pass bounded by `purge_batch`).
    pub purge_interval: Duration,
    /// Tasks purged per pass at most, so that a pass never holds the writer
    /// for long (2000 tasks of 7 transitions took about 150 ms in a debug
    /// build on 2 busy cores, see `retention::timing`).
    pub purge_batch: usize,
    /// How often a failed batch is written again while degraded (and a
    /// released reserve is tried again).
    pub retry_interval: Duration,
    /// Space set aside next to the database and given back when the disk
    /// fills up (`reserve.rs`); 0: none.
    pub reserve_bytes: u64,
    /// Per data class (`[store.retention.<class>]`): whether its text may be
    /// stored, its tasks' and keys' ages. `None`: every class as the
    /// options above, text allowed (`store_prompts` decides).
    pub classes: Option<[ClassRetention; 4]>,
    /// Write-behind: how long plain writes wait for the rest of their burst
    /// before the transaction that holds them commits (0: commit each
    /// burst as soon as the channel is empty). One task sends about seven
    /// writes spread over its life; committed one by one they cost a WAL
    /// append of every touched page each time (about 50 `pwrite` and 20
    /// `fcntl` calls per task, measured with `bench/instructions.py`).
    /// Reads, flushes and durable writes never wait, nor do the writes that
    /// crash recovery stands on ([`WriteOp::commits_at_once`]): they commit
    /// at once, with whatever waits. A crash (`kill -9`) loses at most this
    /// much of the latest transitions and results (see the README's
    /// recovery item).
    pub commit_window: Duration,
    /// How long a new task's row without an idempotency key waits for
    /// the writes of the tasks around it (see [`WriteOp::urgency`]): at
    /// 2000 requests a second a transaction then holds about 50 writes
    /// (300 commits a second) instead of 13 (1,230).
    pub new_task_window: Duration,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            max_buffered_writes: 100_000,
            retention_tasks: None,
            retention_rejected: None,
            retention_audit: None,
            purge_interval: Duration::from_secs(60),
            purge_batch: 1000,
            retry_interval: Duration::from_secs(1),
            // The config's default is 8 MiB; a store opened without options
            // (tools, unit tests) leaves no file beside the database.
            reserve_bytes: 0,
            classes: None,
            commit_window: DEFAULT_COMMIT_WINDOW,
            new_task_window: DEFAULT_NEW_TASK_WINDOW,
        }
    }
}

/// See [`StoreOptions::commit_window`]: long enough to gather a task's
/// writes (a fast task takes about a millisecond) and those of the tasks
/// around it, short against anything a reader waits for (reads commit at
/// once) and against what a crash may lose.
pub const DEFAULT_COMMIT_WINDOW: Duration = Duration::from_millis(10);

/// See [`StoreOptions::new_task_window`].
pub const DEFAULT_NEW_TASK_WINDOW: Duration = Duration::from_millis(2);

/// Whether the store can write. Shared: the writer sets it, `/ready`, the
/// facade (which refuses new work while degraded) and telemetry read it.
#[derive(Debug, Clone, Default)]
pub struct StoreHealth(Arc<HealthInner>);

#[derive(Debug, Default)]
struct HealthInner {
    degraded: AtomicBool,
    /// Why, while degraded (the SQLite error of the last failed commit).
    reason: Mutex<Option<String>>,
    /// Writes waiting in memory for the disk.
    buffered: AtomicUsize,
    /// Writes dropped because the buffer was full.
    dropped: AtomicU64,
    /// Transactions committed, and the writes they held.
    commits: AtomicU64,
    committed_writes: AtomicU64,
    /// Retention passes run, rows they purged, and the time they held the
    /// writer (total and longest), in nanoseconds.
    purge_passes: AtomicU64,
    purged_rows: AtomicU64,
    purge_ns_total: AtomicU64,
    purge_ns_max: AtomicU64,
}

/// What the retention purge has done since the store opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PurgeStats {
    pub passes: u64,
    /// Task rows, keys, sessions and audit records purged.
    pub rows: u64,
    /// Time the passes held the writer, all together.
    pub total: Duration,
    /// The longest pass.
    pub longest: Duration,
}

impl StoreHealth {
    /// Why writes fail, while they do.
    pub fn degraded(&self) -> Option<String> {
        if !self.is_degraded() {
            return None;
        }
        self.0.reason.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub fn is_degraded(&self) -> bool {
        self.0.degraded.load(Ordering::Acquire)
    }

    /// Writes kept in memory until the disk takes them.
    pub fn buffered_writes(&self) -> usize {
        self.0.buffered.load(Ordering::Relaxed)
    }

    /// Transactions committed so far (each holds one or more writes).
    pub fn commits(&self) -> u64 {
        self.0.commits.load(Ordering::Relaxed)
    }

    /// Writes committed so far (over [`Self::commits`]: how many each
    /// transaction gathered).
    pub fn committed_writes(&self) -> u64 {
        self.0.committed_writes.load(Ordering::Relaxed)
    }

    /// Writes lost because the buffer was full while degraded.
    pub fn dropped_writes(&self) -> u64 {
        self.0.dropped.load(Ordering::Relaxed)
    }

    /// What the retention purge has done (see `bench/purge.rs`).
    pub fn purge_stats(&self) -> PurgeStats {
        let i = &self.0;
        PurgeStats {
            passes: i.purge_passes.load(Ordering::Relaxed),
            rows: i.purged_rows.load(Ordering::Relaxed),
            total: Duration::from_nanos(i.purge_ns_total.load(Ordering::Relaxed)),
            longest: Duration::from_nanos(i.purge_ns_max.load(Ordering::Relaxed)),
        }
    }

    fn record_purge(&self, rows: usize, took: Duration) {
        let i = &self.0;
        let ns = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        i.purge_passes.fetch_add(1, Ordering::Relaxed);
        i.purged_rows.fetch_add(rows as u64, Ordering::Relaxed);
        i.purge_ns_total.fetch_add(ns, Ordering::Relaxed);
        i.purge_ns_max.fetch_max(ns, Ordering::Relaxed);
    }

    fn set_degraded(&self, reason: String) {
        *self.0.reason.lock().unwrap_or_else(|e| e.into_inner()) = Some(reason);
        self.0.degraded.store(true, Ordering::Release);
    }

    fn set_ok(&self) {
        self.0.degraded.store(false, Ordering::Release);
        *self.0.reason.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }
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
-- The retention purge: refused calls by age. (An index on `state` alone
-- would be a prefix of this one: every state change would write both.)
CREATE INDEX IF NOT EXISTS tasks_by_state_updated ON tasks(state, updated_at_ms);
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
    /// Opens (creating if needed) the database and starts the writer thread,
    /// with the default [`StoreOptions`] (nothing purged).
    pub fn open(path: &Path, node_id: &str, store_prompts: bool) -> Result<Store, StoreError> {
        Self::open_with(path, node_id, store_prompts, StoreOptions::default())
    }

    /// Opens (creating if needed) the database and starts the writer thread.
    pub fn open_with(path: &Path, node_id: &str, store_prompts: bool, opts: StoreOptions) -> Result<Store, StoreError> {
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
        // Deleted content (a purged task, a user's deleted text, a row's
        // older version) is overwritten with zeros, not left in free space
        // of the file where it could be read back.
        conn.pragma_update(None, "secure_delete", "ON").map_err(open_err)?;
        conn.execute_batch(SCHEMA).map_err(open_err)?;
        for schema in [
            idempotency::SCHEMA,
            pending_requests::SCHEMA,
            revoked_keys::SCHEMA,
            responses::SCHEMA,
            sessions::SCHEMA,
            audit::SCHEMA,
            budget::SCHEMA,
        ] {
            conn.execute_batch(schema).map_err(open_err)?;
        }
        sessions::migrate(&conn).map_err(open_err)?;
        migrate(&conn).map_err(open_err)?;
        let budgets = budget::Budgets::default();
        budgets.load(&conn).map_err(open_err)?;
        audit::migrate(&conn).map_err(open_err)?;
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
        let health = StoreHealth::default();
        let mut reserve = reserve::Reserve::new(path, opts.reserve_bytes);
        if let Err(e) = reserve.take(0) {
            // Started on a full disk: degraded (new work refused) until the
            // reserve can be set aside; the writer tries again.
            tracing::error!(error = %e, bytes = opts.reserve_bytes, "cannot set aside the task store's reserve");
            health.set_degraded(format!("cannot set aside the store's reserve of {} bytes: {e}", opts.reserve_bytes));
        }
        let (audit_tx, _) = tokio::sync::broadcast::channel(1024);
        let text_allowed = retention::Policy::new(&opts).text_by_class();
        let mut writer = Writer::new(conn, failures.clone(), health.clone(), opts, reserve);
        writer.audit_tx = Some(audit_tx.clone());
        let spawn_err = |e| StoreError::Dir { path: path.to_path_buf(), source: e };
        let thread = std::thread::Builder::new()
            .name("edgeway-store".into())
            .spawn(move || writer.run(rx))
            .map_err(spawn_err)?;
        let tx = Inbox { tx, writer: thread.thread().clone() };
        let (reads, read_rx) = mpsc::channel();
        std::thread::Builder::new()
            .name("edgeway-store-read".into())
            .spawn(move || reader_loop(reader, read_rx))
            .map_err(spawn_err)?;
        let path = Arc::from(path);
        let audit_queries = Arc::new(tokio::sync::Semaphore::new(AUDIT_QUERIES_AT_ONCE));
        Ok(Store {
            tx,
            reads,
            node_id: node_id.into(),
            store_prompts,
            text_allowed,
            failures,
            health,
            path,
            audit_tx,
            audit_queries,
            budgets,
        })
    }

    /// What tenants and applications spent, and their budgets' limits
    /// (set by [`budget::Budgets::configure`]).
    pub fn budgets(&self) -> &budget::Budgets {
        &self.budgets
    }

    /// Whether writes succeed (shared: it follows the writer).
    pub fn health(&self) -> StoreHealth {
        self.health.clone()
    }

    /// Shorthand for `health().is_degraded()`.
    pub fn is_degraded(&self) -> bool {
        self.health.is_degraded()
    }

    fn write(&self, op: WriteOp) {
        if self.tx.send(Op::Write(op)).is_err() {
            self.writer_gone();
        }
    }

    /// The writer thread has stopped (it panicked or returned): nothing can
    /// be written any more, which is the degraded state for good.
    fn writer_gone(&self) {
        self.failures.inc();
        if !self.health.is_degraded() {
            tracing::error!("the task store's writer thread stopped; nothing more can be written");
        }
        self.health.set_degraded(WRITER_GONE.to_string());
    }

    /// The counter of failed writes (shared: it keeps counting).
    pub fn write_failures(&self) -> WriteFailures {
        self.failures.clone()
    }

    pub fn node_id(&self) -> &str {
        &self.node_id
    }

    /// Whether the store keeps the text of every call: `store_prompts`, and
    /// no data class forbids text (`store_text = false`). What is not
    /// tied to one call's class (a session, which calls of any class may
    /// join) is written only then.
    pub fn stores_prompts(&self) -> bool {
        self.store_prompts && self.text_allowed.iter().all(|a| *a)
    }

    /// Whether text of class `c` may reach the file at all.
    pub fn may_store_text(&self, c: DataClass) -> bool {
        self.text_allowed[c as usize]
    }

    /// Whether the prompt and answer text of a call of class `c` are kept
    /// with its task (`store_prompts`, unless the class forbids text).
    pub fn stores_text(&self, c: DataClass) -> bool {
        self.store_prompts && self.may_store_text(c)
    }

    /// Writes a new task row (state RECEIVED). Task rows and transitions are
    /// written as told: record them through `telemetry::lifecycle::Recorder`,
    /// which checks each against the task state machine first.
    pub fn new_task(&self, req: &TaskRequest) {
        let prompt_text =
            self.stores_text(req.data_class).then(|| serde_json::to_string(&req.messages).unwrap_or_default());
        // Only the columns: the prompt itself is not copied unless stored.
        let row = NewTaskRow {
            task_id: req.task_id.clone(),
            request_id: req.request_id.clone(),
            trace_id: req.trace_id.clone(),
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
            data_class: req.data_class.as_str(),
        };
        self.write(WriteOp::NewTask { row: Box::new(row), prompt_text });
    }

    /// Appends a transition and sets the task's state (unchecked: see
    /// [`Self::new_task`]).
    pub fn transition(&self, task_id: &str, state: TaskState, reason: &str, instance: Option<&str>, actor: &str) {
        let t = self.new_transition(state, reason, instance, actor);
        self.write(WriteOp::Transition { task_id: task_id.to_string(), t });
    }

    fn new_transition(&self, state: TaskState, reason: &str, instance: Option<&str>, actor: &str) -> Transition {
        Transition {
            state,
            at_ms: crate::task::now_ms(),
            reason: reason.to_string(),
            node_id: self.node_id.to_string(),
            instance: instance.map(str::to_string),
            actor: actor.to_string(),
        }
    }

    /// Records a call that admission refused, as a task that went
    /// RECEIVED → VALIDATING → REJECTED.
    pub fn rejected(&self, who: &Identity, ingress: Ingress, model: &str, trace_id: &str, e: &GatewayError) -> String {
        let task_id = crate::task::new_task_id();
        let row = RejectedCall {
            task_id: task_id.clone(),
            trace_id: trace_id.to_string(),
            tenant: who.tenant.clone(),
            application: who.application.clone(),
            user_id: who.user_id.clone(),
            ingress: ingress.as_str(),
            model: model.chars().take(128).collect(),
            code: e.code.as_str(),
            message: e.message.chars().take(500).collect(),
            at_ms: crate::task::now_ms(),
            node_id: self.node_id.to_string(),
            key_id: audit::key_id(who.credential.as_ref()),
            data_class: who.data_class,
        };
        self.write(WriteOp::Rejected { row: Box::new(row) });
        task_id
    }

    /// Ends a validated task REJECTED with `code` (refused by the
    /// scheduler, or its caller went away before it was queued): the
    /// transition, the code and the task's audit record are written
    /// together (`credential`: as for [`Self::finish`]).
    pub fn refuse(&self, req: &TaskRequest, reason: &str, actor: &str, code: &str) {
        let t = self.new_transition(TaskState::Rejected, reason, None, actor);
        let user_id = req.identity.user_id.clone();
        let entry = AuditEntry {
            at_ms: t.at_ms,
            task_id: req.task_id.clone(),
            request_id: req.request_id.clone(),
            trace_id: (!req.trace_id.is_empty()).then(|| req.trace_id.clone()),
            tenant: req.identity.tenant.clone(),
            application: req.identity.application.clone(),
            device: audit::device_of(req.ingress.as_str(), user_id.as_deref()),
            user_id,
            key_id: audit::key_id(req.identity.credential.as_ref()),
            ingress: req.ingress.as_str().to_string(),
            requested_model: req.logical_model.clone(),
            data_class: Some(req.data_class),
            ..AuditEntry::refused(code)
        };
        self.write(WriteOp::Refused { t: Box::new(t), code: code.to_string(), entry: Box::new(entry) });
    }

    /// Records the terminal transition (to `meta.status`) and the final
    /// metadata together: a reader never sees the terminal state without
    /// its error code. `result_text` is dropped unless prompts are stored.
    /// `keyed` says whether the text is also kept with the task's
    /// idempotency key (for the key's lifetime). The
    /// task's audit record is written with it (`credential`: the digest of
    /// the caller's API key or token id, named by its first digits).
    #[allow(clippy::too_many_arguments)]
    pub fn finish(
        &self,
        meta: &ResultMeta,
        reason: &str,
        instance: Option<&str>,
        actor: &str,
        error_code: Option<&str>,
        result_text: Option<String>,
        keyed: KeyedResult,
        credential: Option<&[u8; 32]>,
    ) {
        let idempotent_text = if keyed == KeyedResult::OutcomeAndText { result_text.clone() } else { None };
        self.write(WriteOp::Finish {
            t: Box::new(self.new_transition(meta.status, reason, instance, actor)),
            meta: Box::new(meta.clone()),
            error_code: error_code.map(str::to_string),
            result_text: result_text.filter(|_| self.store_prompts),
            keyed: keyed != KeyedResult::None,
            idempotent_text,
            key_id: audit::key_id(credential),
        });
    }

    /// Resolves once everything sent before it is written.
    pub async fn flush(&self) {
        let (tx, rx) = oneshot::channel();
        if self.tx.send(Op::Flush(tx)).is_err() || rx.await.is_err() {
            self.writer_gone();
        }
    }

    /// Resolves once no write is buffered: at once while the disk takes
    /// writes, else when a retry commits them (bound it with a timeout).
    pub async fn settled(&self) {
        let (tx, rx) = oneshot::channel();
        if self.tx.send(Op::Settled(tx)).is_err() || rx.await.is_err() {
            self.writer_gone();
        }
    }

    /// Test support: the writer thread returns as if it had died.
    #[cfg(any(test, feature = "testing"))]
    pub async fn stop_writer(&self) {
        let (tx, rx) = oneshot::channel();
        if self.tx.send(Op::Exit(tx)).is_ok() {
            let _ = rx.await;
        }
    }

    /// Records an idempotency key and the request needed to queue the task
    /// again after a restart (until it starts). With `replaces`, the key
    /// moves from that task (which ended in a way a repeat runs again) to
    /// this one.
    pub fn remember(&self, req: StoredRequest, ttl_ms: i64, replaces: Option<&str>) {
        self.write(WriteOp::Remember { req: Box::new(req), ttl_ms, replaces: replaces.map(str::to_string) });
    }

    /// Keeps the Response object of `task_id` until the task is purged
    /// (`GET /v1/responses/{id}`).
    pub fn keep_response(&self, task_id: &str, body: String, conversation: Option<String>) {
        self.write(WriteOp::KeepResponse { task_id: task_id.to_string(), body, conversation });
    }

    /// Deletes the Response object of `task_id` (`DELETE /v1/responses/{id}`).
    pub fn forget_response(&self, task_id: &str) {
        self.write(WriteOp::ForgetResponse(task_id.to_string()));
    }

    /// The task has started on an engine: it will not be re-queued.
    pub fn started(&self, task_id: &str) {
        self.write(WriteOp::Started(task_id.to_string()));
    }

    /// Forgets a key whose task was refused, so a retry may start afresh.
    pub fn forget_key(&self, tenant: &str, app: &str, key: &str, task_id: &str) {
        self.write(WriteOp::Forget {
            tenant: tenant.into(),
            app: app.into(),
            key: key.into(),
            task_id: task_id.into(),
        });
    }

    /// The call `from` found task `to` already holding its key (a race of
    /// repeats): the key is `to`'s, whichever was recorded first.
    pub fn hand_over_key(&self, tenant: &str, app: &str, key: &str, from: &str, to: &str) {
        self.write(WriteOp::Handover {
            tenant: tenant.into(),
            app: app.into(),
            key: key.into(),
            from: from.into(),
            to: to.into(),
        });
    }

    /// Records that an API key (its SHA-256, hex) is revoked, or no longer.
    /// Resolves once it is committed; an error when the store cannot write
    /// (the change stays buffered and lands when the disk is back, but the
    /// caller must not report it as done).
    pub async fn set_revoked(&self, key_sha256: &str, by: &str, revoked: bool) -> Result<(), StoreError> {
        let op = WriteOp::SetRevoked { key_sha256: key_sha256.into(), by: by.into(), revoked };
        let (ack, rx) = oneshot::channel();
        self.tx.send(Op::Durable(op, ack)).map_err(|_| StoreError::Closed)?;
        rx.await.map_err(|_| StoreError::Closed)?
    }

    /// Test support: runs the writer's retention pass now instead of at its
    /// next interval, as the writer runs it (a minute apart otherwise).
    #[cfg(any(test, feature = "testing"))]
    pub async fn purge_now(&self) {
        let (tx, rx) = oneshot::channel();
        if self.tx.send(Op::PurgeNow(tx)).is_ok() {
            let _ = rx.await;
        }
    }

    /// Test support: sets a pragma on the writer's connection, e.g.
    /// `max_page_count` (0: the current size, so the file cannot grow) or
    /// `query_only` (1: every write fails as on a read-only file).
    #[cfg(any(test, feature = "testing"))]
    pub async fn set_writer_pragma(&self, name: &'static str, value: i64) {
        let (tx, rx) = oneshot::channel();
        if self.tx.send(Op::Pragma(name, value, tx)).is_ok() {
            let _ = rx.await;
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

    /// Writes a session's row: at creation, and with its new counts after
    /// each turn. Only for sessions the store may keep (see
    /// `crate::context::sessions`).
    pub fn session_row(&self, row: sessions::SessionRow) {
        self.write(WriteOp::SessionRow(Box::new(row)));
    }

    pub fn session_message(&self, m: sessions::MessageRow) {
        self.write(WriteOp::SessionMessage(Box::new(m)));
    }

    pub fn session_memory(&self, m: sessions::MemoryRow) {
        self.write(WriteOp::SessionMemory(Box::new(m)));
    }

    pub fn clear_session_memory(&self, session_id: &str) {
        self.write(WriteOp::SessionMemoryClear(session_id.to_string()));
    }

    /// Deletes a session, its history and its memory.
    pub fn delete_session(&self, session_id: &str) {
        self.write(WriteOp::SessionDelete(session_id.to_string()));
    }

    /// The stored sessions that have not expired (at start-up).
    pub async fn sessions(&self) -> Vec<sessions::StoredSession> {
        let (tx, rx) = oneshot::channel();
        if self.tx.send(Op::Sessions(tx)).is_err() {
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

    /// Audit records as they are committed (best effort: a receiver that
    /// lags loses records; the table has them all).
    pub fn audit_feed(&self) -> tokio::sync::broadcast::Receiver<Arc<AuditRecord>> {
        self.audit_tx.subscribe()
    }

    /// Committed audit records, oldest first (a record committed moments
    /// ago may not be visible yet: `flush` first to see it). On a
    /// connection of its own, off the reader thread: a page that scans far
    /// (a rare tenant) must not hold up idempotency lookups.
    /// At most [`AUDIT_QUERIES_AT_ONCE`] run at once; one more is refused
    /// ([`StoreError::Busy`]) rather than queued behind them.
    pub async fn audit(&self, q: AuditQuery) -> Result<Vec<AuditRecord>, StoreError> {
        let path = self.path.clone();
        let permit = self.audit_queries.clone().try_acquire_owned().map_err(|_| StoreError::Busy)?;
        tokio::task::spawn_blocking(move || {
            // Held until the scan ends, even if its caller went away.
            let _permit = permit;
            let c = audit::open_read_only(&path)?;
            Ok(audit::query(&c, &q)?)
        })
        .await
        .map_err(|_| StoreError::Closed)?
    }

    /// Deletes the text, Responses, kept requests and sessions of `user`
    /// of `tenant` (see `user_data.rs`) and appends `entry`, completed with
    /// the counts, to the audit trail, in one transaction; then truncates
    /// the WAL. Answered once committed; an error while the store cannot
    /// write (nothing is deleted then).
    pub async fn forget_user(
        &self,
        tenant: &str,
        user: &str,
        entry: AuditEntry,
    ) -> Result<UserDataForgotten, StoreError> {
        let (reply, rx) = oneshot::channel();
        let op = ForgetUser { tenant: tenant.into(), user: user.into(), entry, reply };
        self.tx.send(Op::ForgetUser(Box::new(op))).map_err(|_| StoreError::Closed)?;
        rx.await.map_err(|_| StoreError::Closed)?
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

/// Takes up to this many operations off the channel per transaction (a
/// transaction holds more while writes are buffered for a failing disk).
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

/// Whether a write failed because the database cannot be written at all
/// (disk full, read-only, I/O error, locked, corrupt) rather than because
/// of that one write: the whole batch is then kept and written again.
fn is_storage_failure(e: &rusqlite::Error) -> bool {
    use rusqlite::ErrorCode as C;
    match e.sqlite_error_code() {
        Some(c) => matches!(
            c,
            C::DiskFull
                | C::ReadOnly
                | C::SystemIoFailure
                | C::CannotOpen
                | C::DatabaseBusy
                | C::DatabaseLocked
                | C::DatabaseCorrupt
                | C::NotADatabase
                | C::OutOfMemory
                | C::PermissionDenied
                | C::FileLockingProtocolFailed
        ),
        None => false,
    }
}

/// The writer thread: applies writes in one transaction per burst. A
/// transaction that cannot commit (see [`is_storage_failure`]) leaves the
/// store degraded: its writes stay in memory (bounded by
/// `max_buffered_writes`), new ones join them, and the whole lot is written
/// again every `retry_interval` until a commit succeeds. Nothing is dropped
/// while the buffer has room. Reads are answered from what is committed.
///
/// A commit that fails for a full disk (SQLITE_FULL) while the reserve is
/// held releases it and is tried again at once: the writes of running
/// tasks go to disk, the store stays degraded (new work refused), and
/// every `retry_interval` the reserve is set aside again with as much room
/// to spare; once it is, the store is healthy.
struct Writer {
    conn: Connection,
    /// Writes not yet committed, oldest first.
    pending: VecDeque<WriteOp>,
    /// Callers waiting for their writes to be committed.
    acks: Vec<oneshot::Sender<Result<(), StoreError>>>,
    replies: Vec<Reply>,
    failures: WriteFailures,
    health: StoreHealth,
    opts: StoreOptions,
    next_purge: Instant,
    /// When the last commit failed (while degraded): the next attempt waits
    /// `retry_interval`, so that a large buffer is not rewritten for every
    /// new write.
    failed_at: Option<Instant>,
    reserve: reserve::Reserve,
    /// The per-class rules on text and ages.
    policy: retention::Policy,
    /// When a reserve not held is tried again.
    reserve_retry_at: Option<Instant>,
    /// Callers waiting until nothing is buffered.
    settled: Vec<oneshot::Sender<()>>,
    /// When the writes held must be committed, if sooner than the
    /// write-behind window: now for a write that commits at once, a new
    /// task's `new_task_window` after it came ([`WriteOp::urgency`]).
    due_by: Option<Instant>,
    /// Where committed audit records are offered (none in unit tests).
    audit_tx: Option<tokio::sync::broadcast::Sender<Arc<AuditRecord>>>,
    /// The audit chain's head as committed (see [`audit::ChainHead`]).
    audit_head: audit::ChainHead,
    /// Test support: asked to stop as a dead writer would.
    #[cfg(any(test, feature = "testing"))]
    exit: Option<oneshot::Sender<()>>,
    /// Test support: callers waiting for a retention pass run now.
    #[cfg(any(test, feature = "testing"))]
    purge_waiters: Vec<oneshot::Sender<()>>,
}

impl Writer {
    fn new(
        conn: Connection,
        failures: WriteFailures,
        health: StoreHealth,
        opts: StoreOptions,
        reserve: reserve::Reserve,
    ) -> Writer {
        let next_purge = Instant::now() + opts.purge_interval;
        let reserve_retry_at = (!reserve.is_held()).then(|| Instant::now() + opts.retry_interval);
        let policy = retention::Policy::new(&opts);
        Writer {
            policy,
            conn,
            pending: VecDeque::new(),
            acks: Vec::new(),
            replies: Vec::new(),
            failures,
            health,
            opts,
            next_purge,
            failed_at: None,
            reserve,
            reserve_retry_at,
            settled: Vec::new(),
            due_by: None,
            audit_tx: None,
            audit_head: audit::ChainHead::default(),
            #[cfg(any(test, feature = "testing"))]
            exit: None,
            #[cfg(any(test, feature = "testing"))]
            purge_waiters: Vec::new(),
        }
    }

    /// Whether a caller waits for the next commit (a read, a flush, a
    /// durable write), or a write is held that is due (one that recovery
    /// needs, a new task whose window is over): then the commit happens
    /// now, without the rest of the write-behind.
    fn someone_waits(&self) -> bool {
        let exiting = {
            #[cfg(any(test, feature = "testing"))]
            {
                self.exit.is_some()
            }
            #[cfg(not(any(test, feature = "testing")))]
            {
                false
            }
        };
        let due = self.due_by.is_some_and(|d| d <= Instant::now());
        due || !self.replies.is_empty() || !self.acks.is_empty() || !self.settled.is_empty() || exiting
    }

    /// Whether a commit may be tried now (always while healthy).
    fn due(&self) -> bool {
        self.failed_at.is_none_or(|t| t.elapsed() >= self.opts.retry_interval)
    }

    fn run(mut self, rx: mpsc::Receiver<Op>) {
        loop {
            let next = match self.failed_at {
                Some(t) => t + self.opts.retry_interval,
                None => self.next_purge,
            };
            let next = self.reserve_retry_at.map_or(next, |r| r.min(next));
            let wait = next.saturating_duration_since(Instant::now());
            match rx.recv_timeout(wait) {
                Ok(first) => {
                    self.take(first);
                    let mut n = 1;
                    while n < BATCH {
                        match rx.try_recv() {
                            Ok(op) => self.take(op),
                            Err(_) => break,
                        }
                        n += 1;
                    }
                    // Write-behind: while only plain writes are held and the
                    // disk takes them, wait for the rest of the burst.
                    let until = Instant::now() + self.opts.commit_window;
                    while n < BATCH && self.failed_at.is_none() && !self.someone_waits() {
                        let until = self.due_by.map_or(until, |d| d.min(until));
                        let left = until.saturating_duration_since(Instant::now());
                        if left.is_zero() {
                            break;
                        }
                        match rx.try_recv() {
                            Ok(op) => self.take(op),
                            // Nothing yet: sleep until the window ends or
                            // something that may not wait comes (`Inbox`
                            // wakes the writer for it; a write that may
                            // wait does not).
                            Err(mpsc::TryRecvError::Empty) => {
                                std::thread::park_timeout(left);
                                continue;
                            }
                            // A closed channel is seen (and committed) by
                            // the next receive above.
                            Err(mpsc::TryRecvError::Disconnected) => break,
                        }
                        n += 1;
                    }
                    // What came while the writer slept joins this commit.
                    while n < BATCH {
                        match rx.try_recv() {
                            Ok(op) => self.take(op),
                            Err(_) => break,
                        }
                        n += 1;
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    // Every handle is gone: a last try for what is buffered.
                    self.failed_at = None;
                    self.commit();
                    if !self.pending.is_empty() {
                        tracing::error!(lost = self.pending.len(), "task store closed with writes it could not make");
                    }
                    return;
                }
            }
            #[cfg(any(test, feature = "testing"))]
            if let Some(tx) = self.exit.take() {
                drop(rx);
                let _ = tx.send(());
                return;
            }
            self.due_by = None;
            if self.due() {
                self.commit();
            } else {
                // Degraded, and the last attempt was moments ago: the new
                // writes wait with the others; a caller waiting for one
                // is told now.
                let why = self.health.degraded().unwrap_or_default();
                self.ack(|| Err(StoreError::Unavailable(why.clone())));
                self.health.0.buffered.store(self.pending.len(), Ordering::Relaxed);
            }
            self.mend_reserve();
            self.answer();
            if self.pending.is_empty() {
                for s in self.settled.drain(..) {
                    let _ = s.send(());
                }
            }
            if !self.health.is_degraded() && Instant::now() >= self.next_purge {
                self.purge();
            }
            #[cfg(any(test, feature = "testing"))]
            for tx in self.purge_waiters.drain(..) {
                let _ = tx.send(());
            }
        }
    }

    /// Takes an operation off the channel: writes join the pending ones,
    /// reads wait for the commit.
    fn take(&mut self, op: Op) {
        match op {
            Op::Write(w) => {
                let by = match w.urgency() {
                    Urgency::Behind => None,
                    Urgency::Soon => Some(Instant::now() + self.opts.new_task_window),
                    Urgency::AtOnce => Some(Instant::now()),
                };
                self.due_by = match (self.due_by, by) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
                self.buffer(w)
            }
            Op::Durable(w, ack) => {
                // Always kept, even over the bound: the caller is told.
                self.pending.push_back(w);
                self.acks.push(ack);
            }
            Op::Unfinished(tx) => self.replies.push(Reply::Unfinished(tx)),
            Op::RevokedKeys(tx) => self.replies.push(Reply::RevokedKeys(tx)),
            Op::Sessions(tx) => self.replies.push(Reply::Sessions(tx)),
            Op::Flush(tx) => self.replies.push(Reply::Flush(tx)),
            Op::Get(id, tx) => self.replies.push(Reply::Get(id, tx)),
            Op::ForgetUser(f) => self.replies.push(Reply::ForgetUser(f)),
            Op::Settled(tx) => self.settled.push(tx),
            #[cfg(any(test, feature = "testing"))]
            Op::Pragma(name, value, tx) => {
                let value = match (name, value) {
                    ("max_page_count", 0) => {
                        self.conn.query_row("PRAGMA page_count", [], |r| r.get::<_, i64>(0)).unwrap_or(1)
                    }
                    (_, v) => v,
                };
                if let Err(e) = self.conn.pragma_update(None, name, value) {
                    tracing::error!(error = %e, name, "test pragma failed");
                }
                // The "disk" changed: the next write tries at once.
                self.failed_at = None;
                self.reserve_retry_at = self.reserve_retry_at.map(|_| Instant::now());
                let _ = tx.send(());
            }
            #[cfg(any(test, feature = "testing"))]
            Op::Exit(tx) => self.exit = Some(tx),
            #[cfg(any(test, feature = "testing"))]
            Op::PurgeNow(tx) => {
                self.next_purge = Instant::now();
                self.purge_waiters.push(tx);
            }
        }
    }

    fn buffer(&mut self, w: WriteOp) {
        if self.pending.len() >= self.opts.max_buffered_writes {
            self.failures.inc();
            let dropped = self.health.0.dropped.fetch_add(1, Ordering::Relaxed) + 1;
            if dropped.is_power_of_two() {
                tracing::error!(dropped, "task store write buffer full while the disk refuses writes; writes dropped");
            }
            return;
        }
        self.pending.push_back(w);
    }

    /// Writes every pending operation in one transaction. On success the
    /// buffer is empty and the store healthy; on a storage failure nothing
    /// is written, everything stays pending and the store is degraded.
    fn commit(&mut self) {
        if self.pending.is_empty() {
            self.ack(|| Ok(()));
            return;
        }
        let mut res = self.write_pending();
        if let Err(e) = &res {
            if e.sqlite_error_code() == Some(rusqlite::ErrorCode::DiskFull) && self.reserve.release() {
                tracing::error!(
                    error = %e,
                    buffered = self.pending.len(),
                    reserve_bytes = self.reserve.bytes(),
                    "task store disk full: reserve released for the writes of running tasks; new work refused until there is room again"
                );
                self.health
                    .set_degraded(format!("{e}; writing into the store's reserve until the disk has room again"));
                self.reserve_retry_at = Some(Instant::now() + self.opts.retry_interval);
                res = self.write_pending();
            }
        }
        match res {
            Ok(audited) => {
                if let Some(tx) = self.audit_tx.as_ref().filter(|tx| tx.receiver_count() > 0) {
                    for r in audited {
                        let _ = tx.send(Arc::new(r));
                    }
                }
                let written = self.pending.len();
                self.pending.clear();
                self.health.0.commits.fetch_add(1, Ordering::Relaxed);
                self.health.0.committed_writes.fetch_add(written as u64, Ordering::Relaxed);
                if !self.reserve.is_held() {
                    // Living on the reserve: a checkpoint after each commit
                    // lets the next one reuse the WAL from its start instead
                    // of growing it (up to the 4 MiB autocheckpoint).
                    if let Err(e) = self.conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(())) {
                        tracing::debug!(error = %e, "checkpoint on the reserve failed");
                    }
                } else if self.health.is_degraded() {
                    tracing::warn!(written, "task store writes succeed again; buffered writes committed");
                    self.health.set_ok();
                }
                self.failed_at = None;
                self.ack(|| Ok(()));
            }
            Err(e) => {
                self.failures.inc();
                let reason = e.to_string();
                if !self.health.is_degraded() {
                    tracing::error!(error = %reason, buffered = self.pending.len(), "task store cannot write; degraded, retrying");
                }
                self.health.set_degraded(reason.clone());
                self.failed_at = Some(Instant::now());
                self.ack(|| Err(StoreError::Unavailable(reason.clone())));
            }
        }
        self.health.0.buffered.store(self.pending.len(), Ordering::Relaxed);
    }

    /// Sets a released (or never taken) reserve aside again, when due and
    /// while commits succeed, with as much room again to spare: only then
    /// does the disk have room, and the store is healthy.
    fn mend_reserve(&mut self) {
        let Some(at) = self.reserve_retry_at else { return };
        if Instant::now() < at || self.failed_at.is_some() || !self.pending.is_empty() {
            return;
        }
        match self.reserve.take(self.reserve.bytes()) {
            Ok(()) => {
                self.reserve_retry_at = None;
                if self.health.is_degraded() {
                    tracing::warn!(
                        reserve_bytes = self.reserve.bytes(),
                        "task store disk has room again; reserve set aside, new work admitted"
                    );
                    self.health.set_ok();
                }
            }
            Err(_) => self.reserve_retry_at = Some(Instant::now() + self.opts.retry_interval),
        }
    }

    /// Writes every pending operation in one transaction (nothing of it on
    /// a storage failure). A write that fails by itself (a constraint, a
    /// bug) must leave nothing of itself and must not take the others with
    /// it. That needs a savepoint around each write of several statements,
    /// which costs two more statements and a copy of every page the write
    /// touches into the statement journal (perf: the store thread's
    /// largest single cost, `memmove` under `subjournalPageIfRequired`).
    /// Almost no batch has such a write, so the batch is written first
    /// without savepoints; only if one of its writes fails is the
    /// transaction rolled back and the batch written again with each write
    /// in its own savepoint, where the failing one is left out.
    fn write_pending(&mut self) -> rusqlite::Result<Vec<AuditRecord>> {
        match self.write_batch(false)? {
            Some(audited) => Ok(audited),
            None => Ok(self.write_batch(true)?.unwrap_or_default()),
        }
    }

    /// One try of [`Self::write_pending`]. `isolate`: each write of several
    /// statements in a savepoint, a failing write logged and left out;
    /// without it, the first failing write rolls back the transaction and
    /// the answer is `None`.
    fn write_batch(&mut self, isolate: bool) -> rusqlite::Result<Option<Vec<AuditRecord>>> {
        let failures = &self.failures;
        let pending = &self.pending;
        let policy = &self.policy;
        let txn = self.conn.transaction()?;
        let later = state_set_later(pending);
        let mut audited = Vec::new();
        // The committed head moves only once the transaction commits.
        let mut head = self.audit_head.clone();
        // What the batch's finished tasks spent, written once per budget
        // row at its end (in the same transaction). Isolated, each op
        // writes its own with its end: both or neither.
        let mut charges = (!isolate).then(Vec::new);
        for (op, set_later) in pending.iter().zip(later) {
            // Each op of several statements in a savepoint: one that fails
            // part way (a terminal state written, its audit record refused)
            // leaves nothing of itself, so a state never commits without
            // its record. One statement is all or nothing by itself.
            let before = audited.len();
            let head_before = head.seq();
            let res = if !isolate || one_statement(op, set_later) {
                apply(&txn, op, set_later, policy, &mut head, &mut audited, charges.as_mut())
            } else {
                in_savepoint(&txn, || apply(&txn, op, set_later, policy, &mut head, &mut audited, None))
            };
            if let Err(e) = res {
                if is_storage_failure(&e) {
                    return Err(e);
                }
                if !isolate {
                    // Dropped: the transaction rolls back.
                    return Ok(None);
                }
                audited.truncate(before);
                if head.seq() != head_before {
                    // Appended, then rolled back with the rest of the op.
                    head.forget();
                }
                // One bad write must not roll back the others.
                failures.inc();
                tracing::error!(error = %e, "task store write failed");
            }
        }
        if let Some(charges) = charges.filter(|c| !c.is_empty()) {
            if let Err(e) = budget::persist_all(&txn, &charges) {
                if is_storage_failure(&e) {
                    return Err(e);
                }
                // Rolled back: the batch is written again op by op.
                return Ok(None);
            }
        }
        txn.commit()?;
        self.audit_head = head;
        Ok(Some(audited))
    }

    fn ack(&mut self, r: impl Fn() -> Result<(), StoreError>) {
        for a in self.acks.drain(..) {
            let _ = a.send(r());
        }
    }

    fn answer(&mut self) {
        for r in std::mem::take(&mut self.replies) {
            let conn = &self.conn;
            match r {
                Reply::Flush(tx) => {
                    let _ = tx.send(());
                }
                Reply::Get(id, tx) => {
                    let _ = tx.send(read_task(conn, &id));
                }
                Reply::ForgetUser(f) => {
                    // Only on a store that writes: after every write sent
                    // before it, never half done.
                    let r = if self.pending.is_empty() {
                        forget_user(conn, &f.tenant, &f.user, f.entry, &mut self.audit_head, self.audit_tx.as_ref())
                    } else {
                        Err(StoreError::Unavailable(self.health.degraded().unwrap_or_default()))
                    };
                    if r.is_err() {
                        self.failures.inc();
                    }
                    let _ = f.reply.send(r);
                }
                Reply::RevokedKeys(tx) => {
                    let _ = tx.send(revoked_keys::revoked_keys(conn).unwrap_or_else(|e| {
                        tracing::error!(error = %e, "reading revoked keys failed");
                        Vec::new()
                    }));
                }
                Reply::Sessions(tx) => {
                    let _ = tx.send(sessions::load(conn, crate::task::now_ms()).unwrap_or_else(|e| {
                        tracing::error!(error = %e, "reading stored sessions failed");
                        Vec::new()
                    }));
                }
                Reply::Unfinished(tx) => {
                    let _ = tx.send(pending_requests::unfinished(conn).unwrap_or_else(|e| {
                        tracing::error!(error = %e, "reading unfinished tasks failed");
                        Vec::new()
                    }));
                }
            }
        }
    }

    /// One bounded retention pass; when it hit its bound, the next comes
    /// soon (not after a whole interval) so a backlog drains in steps.
    fn purge(&mut self) {
        let now = crate::task::now_ms();
        let ms = |d: Duration| i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
        let ages = self.policy.ages(now, self.opts.retention_rejected);
        let audit_before = self.opts.retention_audit.map(|d| now.saturating_sub(ms(d)));
        let batch = self.opts.purge_batch;
        let started = Instant::now();
        let res = (|| -> rusqlite::Result<usize> {
            let txn = self.conn.transaction()?;
            let mut n = retention::purge(&txn, now, &ages, batch)?;
            // Expired sessions: each row knows when it expires.
            n += sessions::purge_expired(&txn, now, batch)?;
            // Budget windows that can no longer count.
            n += budget::purge(&txn, now, batch)?;
            if let Some(before) = audit_before {
                n += audit::purge(&txn, before, batch)?;
            }
            txn.commit()?;
            Ok(n)
        })();
        let full = match res {
            Ok(n) => {
                self.health.record_purge(n, started.elapsed());
                if n > 0 {
                    tracing::debug!(purged = n, "task store retention pass");
                }
                n >= batch
            }
            Err(e) => {
                self.failures.inc();
                tracing::error!(error = %e, "task store retention pass failed");
                false
            }
        };
        let next = if full { Duration::from_secs(1).min(self.opts.purge_interval) } else { self.opts.purge_interval };
        self.next_purge = Instant::now() + next;
    }
}

/// For each write of a batch: whether a later write of the same batch sets
/// the same task's state (a transition or its finish). The task row's
/// state then needs no update of its own: a task's seven or so
/// transitions, committed together, update its row (and its two state
/// indexes) once instead of seven times. The transitions themselves are
/// all appended.
fn state_set_later(pending: &VecDeque<WriteOp>) -> Vec<bool> {
    let mut seen = std::collections::HashSet::new();
    let mut later = vec![false; pending.len()];
    for (i, op) in pending.iter().enumerate().rev() {
        let task = match op {
            WriteOp::Transition { task_id, .. } => task_id.as_str(),
            WriteOp::Finish { meta, .. } => meta.task_id.as_str(),
            WriteOp::Refused { entry, .. } => entry.task_id.as_str(),
            _ => continue,
        };
        later[i] = !seen.insert(task);
    }
    later
}

/// Whether [`apply`] writes `op` with one statement: the frequent ones (a
/// transition whose task's state a later write sets, a started task's
/// kept request dropped), which need no savepoint of their own.
fn one_statement(op: &WriteOp, state_set_later: bool) -> bool {
    match op {
        WriteOp::Transition { .. } => state_set_later,
        WriteOp::Started(_) => true,
        _ => false,
    }
}

/// Runs `f` in a savepoint: on an error, what it wrote is rolled back and
/// the error returned. The three statements go through the statement
/// cache: rusqlite's `Savepoint` runs each through `execute_batch`, which
/// parses its SQL every time (two parses per write: a tenth of a request's
/// instructions, review of issue 13's cost).
fn in_savepoint(c: &Connection, f: impl FnOnce() -> rusqlite::Result<()>) -> rusqlite::Result<()> {
    exec(c, "SAVEPOINT op", [])?;
    match f() {
        Ok(()) => exec(c, "RELEASE op", []).map(drop),
        Err(e) => {
            // Both needed: ROLLBACK TO keeps the savepoint open.
            let _ = exec(c, "ROLLBACK TO op", []);
            let _ = exec(c, "RELEASE op", []);
            Err(e)
        }
    }
}

/// Applies one write. `state_set_later`: a later write of the batch sets
/// this task's state (see [`state_set_later`]).
/// `policy`: a class whose text may not be stored loses it here, whatever
/// the caller passed (the one place every text goes through).
fn apply(
    txn: &Connection,
    op: &WriteOp,
    state_set_later: bool,
    policy: &retention::Policy,
    head: &mut audit::ChainHead,
    audited: &mut Vec<AuditRecord>,
    charges: Option<&mut Vec<budget::Charge>>,
) -> rusqlite::Result<()> {
    let text_allowed = |task_id: &str| -> rusqlite::Result<bool> {
        Ok(policy.text_allowed(retention::task_class(txn, task_id)?.as_deref()))
    };
    match op {
        WriteOp::NewTask { row, prompt_text } => {
            let prompt_text = prompt_text.as_deref().filter(|_| policy.text_allowed(Some(row.data_class)));
            insert_task(txn, row, prompt_text)
        }
        WriteOp::Transition { task_id, t } => {
            append_transition(txn, task_id, t)?;
            if state_set_later {
                return Ok(());
            }
            set_state(txn, task_id, t)
        }
        WriteOp::Finish { t, meta, error_code, result_text, idempotent_text, key_id, .. } => {
            // The task row read once: who (for the audit record) and its
            // class (whether its text may be kept).
            let (entry, class) = audit::finished_entry(txn, meta, error_code.as_deref(), key_id.clone(), t.at_ms)?;
            let allowed = policy.text_allowed(class.as_deref());
            // finish_task sets the state with the result.
            append_transition(txn, &meta.task_id, t)?;
            // The tool calls' arguments are answer text as well.
            let stripped = if allowed { None } else { retention::without_text(meta) };
            let meta_kept = stripped.as_ref().unwrap_or(meta);
            finish_task(txn, meta_kept, error_code.as_deref(), result_text.as_deref().filter(|_| allowed))?;
            pending_requests::drop_request(txn, &meta.task_id)?;
            if let Some(t) = idempotent_text.as_ref().filter(|_| allowed) {
                idempotency::keep_result(txn, &meta.task_id, t)?;
            }
            // In the same transaction as the terminal state: both or neither.
            // What the task spent, with its end: a restart reads it back
            // (`budget.rs`).
            let tokens = u64::from(meta.usage.input_tokens) + u64::from(meta.usage.output_tokens);
            let cost = meta.cost.unwrap_or(0.0);
            if !entry.tenant.is_empty() && (tokens > 0 || cost > 0.0) {
                match charges {
                    Some(batch) => batch.push(budget::Charge {
                        tenant: entry.tenant.clone(),
                        application: entry.application.clone(),
                        tokens,
                        cost,
                        at_ms: t.at_ms,
                    }),
                    None => budget::persist(txn, &entry.tenant, &entry.application, tokens, cost, t.at_ms)?,
                }
            }
            audited.push(audit::append(txn, head, entry)?);
            Ok(())
        }
        WriteOp::Rejected { row } => {
            insert_rejected(txn, row)?;
            audited.push(audit::append(txn, head, rejected_entry(row))?);
            Ok(())
        }
        WriteOp::Refused { t, code, entry } => {
            // Sets the state whatever a later write does: a refused task
            // has no later transition.
            append_transition(txn, &entry.task_id, t)?;
            exec(
                txn,
                "UPDATE tasks SET state = ?2, updated_at_ms = ?3, error_code = ?4 WHERE task_id = ?1",
                params![entry.task_id, t.state.as_str(), t.at_ms, code],
            )?;
            pending_requests::drop_request(txn, &entry.task_id)?;
            audited.push(audit::append(txn, head, (**entry).clone())?);
            Ok(())
        }
        WriteOp::Remember { req, ttl_ms, replaces } => {
            let class = req.routing.data_class;
            let ttl_ms = policy.key_ttl_ms(class, *ttl_ms);
            // The request (its messages) is kept for a re-queue after a
            // crash only where its class's text may be stored; otherwise a
            // crash before it starts ends it FAILED (recovery).
            let keep_request = policy.text_allowed(class.map(DataClass::as_str));
            remember(txn, req, ttl_ms, replaces.as_deref(), keep_request, crate::task::now_ms())
        }
        WriteOp::Started(id) => pending_requests::drop_request(txn, id),
        WriteOp::Forget { tenant, app, key, task_id } => {
            idempotency::forget(txn, tenant, app, key, task_id)?;
            pending_requests::drop_request(txn, task_id)
        }
        WriteOp::Handover { tenant, app, key, from, to } => {
            idempotency::hand_over(txn, tenant, app, key, from, to)?;
            pending_requests::drop_request(txn, from)
        }
        // A Response holds its answer's text: not kept for a class whose
        // text may not be stored (GET /v1/responses/{id} answers 404).
        WriteOp::KeepResponse { task_id, body, conversation } => match text_allowed(task_id)? {
            true => responses::keep(txn, task_id, body, conversation.as_deref()),
            false => Ok(()),
        },
        WriteOp::ForgetResponse(task_id) => responses::forget(txn, task_id),
        WriteOp::SessionRow(r) => sessions::upsert(txn, r),
        WriteOp::SessionMessage(m) => sessions::add_message(txn, m),
        WriteOp::SessionMemory(m) => sessions::put_memory(txn, m),
        WriteOp::SessionMemoryClear(id) => sessions::clear_memory(txn, id),
        WriteOp::SessionDelete(id) => sessions::delete(txn, id),
        WriteOp::SetRevoked { key_sha256, by, revoked } => {
            revoked_keys::set_revoked(txn, key_sha256, by, *revoked, crate::task::now_ms())
        }
    }
}

enum Reply {
    ForgetUser(Box<ForgetUser>),
    Unfinished(oneshot::Sender<Vec<Unfinished>>),
    RevokedKeys(oneshot::Sender<Vec<String>>),
    Sessions(oneshot::Sender<Vec<sessions::StoredSession>>),
    Flush(oneshot::Sender<()>),
    Get(String, oneshot::Sender<Result<Option<TaskRecord>, StoreError>>),
}

/// A user's data deletion in its own transaction with its audit record
/// (offered to the audit feed once committed), then a WAL truncation.
fn forget_user(
    conn: &Connection,
    tenant: &str,
    user: &str,
    mut entry: AuditEntry,
    committed_head: &mut audit::ChainHead,
    audit_tx: Option<&tokio::sync::broadcast::Sender<Arc<AuditRecord>>>,
) -> Result<UserDataForgotten, StoreError> {
    let txn = conn.unchecked_transaction()?;
    let (deleted, task_ids) = user_data::forget(&txn, tenant, user)?;
    entry.user_data_deleted = Some(deleted.clone());
    let mut head = committed_head.clone();
    let record = audit::append(&txn, &mut head, entry)?;
    txn.commit()?;
    *committed_head = head;
    let wal_truncated = user_data::checkpoint(conn).unwrap_or_else(|e| {
        tracing::warn!(error = %e, "WAL checkpoint after a user's data deletion failed");
        false
    });
    let audit_seq = record.seq;
    if let Some(tx) = audit_tx.filter(|tx| tx.receiver_count() > 0) {
        let _ = tx.send(Arc::new(record));
    }
    Ok(UserDataForgotten { deleted, task_ids, audit_seq, wal_truncated })
}

/// Records an idempotency key and the request needed to queue its task
/// again after a restart (nothing without a key).
fn remember(
    c: &Connection,
    r: &StoredRequest,
    ttl_ms: i64,
    replaces: Option<&str>,
    keep_request: bool,
    now: i64,
) -> rusqlite::Result<()> {
    let Some(key) = &r.idempotency_key else { return Ok(()) };
    if let Some(old) = replaces {
        idempotency::forget(c, &r.tenant, &r.application, key, old)?;
    }
    idempotency::remember(c, &r.tenant, &r.application, key, &r.task_id, &r.prompt_sha256, ttl_ms, now)?;
    if keep_request {
        pending_requests::keep(c, r)?;
    }
    Ok(())
}

/// The columns of a new task row.
struct NewTaskRow {
    task_id: String,
    request_id: String,
    trace_id: String,
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
    data_class: &'static str,
}

/// Columns added to `tasks` after its first release, for databases made
/// before them (a new database gets them here too, so there is one path).
fn migrate(c: &Connection) -> rusqlite::Result<()> {
    // `tasks_by_state` was a prefix of `tasks_by_state_updated`: one more
    // b-tree written on every state change, used by no query the other
    // cannot answer.
    c.execute_batch("DROP INDEX IF EXISTS tasks_by_state")?;
    // `tasks_by_request` (tenant, application, request_id) answered no
    // query (a request id is looked up among the live tasks, in memory),
    // and request ids are random: each new task wrote a page of it at a
    // random place, the largest part of what a task cost the store after
    // its commits (BENCHMARKS.md, session 22).
    c.execute_batch("DROP INDEX IF EXISTS tasks_by_request")?;
    let has: bool = c.prepare("SELECT 1 FROM pragma_table_info('tasks') WHERE name = 'trace_id'")?.exists([])?;
    if !has {
        c.execute_batch("ALTER TABLE tasks ADD COLUMN trace_id TEXT")?;
    }
    // What the task cost (`edge.cost`), a column of its own for sums by
    // tenant and time without reading the result JSON.
    let has: bool = c.prepare("SELECT 1 FROM pragma_table_info('tasks') WHERE name = 'cost'")?.exists([])?;
    if !has {
        c.execute_batch("ALTER TABLE tasks ADD COLUMN cost REAL")?;
    }
    // The call's data class, for the retention of its class (NULL in rows
    // written before it: purged by the strictest class's age).
    let has: bool = c.prepare("SELECT 1 FROM pragma_table_info('tasks') WHERE name = 'data_class'")?.exists([])?;
    if !has {
        c.execute_batch("ALTER TABLE tasks ADD COLUMN data_class TEXT")?;
    }
    c.execute_batch(
        "CREATE INDEX IF NOT EXISTS tasks_by_class_state_updated ON tasks(data_class, state, updated_at_ms)",
    )?;
    Ok(())
}

fn insert_task(c: &Connection, r: &NewTaskRow, prompt_text: Option<&str>) -> rusqlite::Result<()> {
    let now = r.created_at_ms;
    exec(
        c,
        "INSERT OR IGNORE INTO tasks (task_id, request_id, tenant, application, user_id, ingress, logical_model, \
         priority, state, created_at_ms, updated_at_ms, prompt_sha256, prompt_text, session_id, idempotency_key, \
         trace_id, data_class) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, 'RECEIVED', ?9, ?9, ?10, ?11, ?12, ?13, ?14, ?15)",
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
            r.trace_id,
            r.data_class,
        ],
    )?;
    Ok(())
}

fn insert_rejected(c: &Connection, r: &RejectedCall) -> rusqlite::Result<()> {
    exec(
        c,
        "INSERT INTO tasks (task_id, request_id, tenant, application, user_id, ingress, logical_model, priority, \
         state, created_at_ms, updated_at_ms, prompt_sha256, error_code, trace_id, data_class) \
         VALUES (?1, '', ?2, ?3, ?4, ?5, ?6, '', 'REJECTED', ?7, ?7, '', ?8, ?9, ?10)",
        params![
            r.task_id,
            r.tenant,
            r.application,
            r.user_id,
            r.ingress,
            r.model,
            r.at_ms,
            r.code,
            r.trace_id,
            r.data_class.map(DataClass::as_str)
        ],
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

/// The audit entry of a refused call.
fn rejected_entry(r: &RejectedCall) -> AuditEntry {
    AuditEntry {
        at_ms: r.at_ms,
        task_id: r.task_id.clone(),
        trace_id: (!r.trace_id.is_empty()).then(|| r.trace_id.clone()),
        tenant: r.tenant.clone(),
        application: r.application.clone(),
        user_id: r.user_id.clone(),
        key_id: r.key_id.clone(),
        device: audit::device_of(r.ingress, r.user_id.as_deref()),
        ingress: r.ingress.to_string(),
        requested_model: r.model.clone(),
        data_class: r.data_class,
        ..AuditEntry::refused(r.code)
    }
}

fn append_transition(c: &Connection, task_id: &str, t: &Transition) -> rusqlite::Result<()> {
    exec(c,
        "INSERT INTO task_transitions (task_id, seq, state, at_ms, reason, node_id, instance, actor) \
         VALUES (?1, (SELECT COALESCE(MAX(seq), -1) + 1 FROM task_transitions WHERE task_id = ?1), ?2, ?3, ?4, ?5, ?6, ?7)",
        params![task_id, t.state.as_str(), t.at_ms, t.reason, t.node_id, t.instance, t.actor],
    )?;
    Ok(())
}

/// The task row's state (and age) after a transition.
fn set_state(c: &Connection, task_id: &str, t: &Transition) -> rusqlite::Result<()> {
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
    error_code: Option<&str>,
    result_text: Option<&str>,
) -> rusqlite::Result<()> {
    let json = serde_json::to_string(m).unwrap_or_default();
    exec(
        c,
        "UPDATE tasks SET state = ?2, error_code = ?3, result_json = ?4, result_text = ?5, updated_at_ms = ?6, \
         cost = ?7 WHERE task_id = ?1",
        params![m.task_id, m.status.as_str(), error_code, json, result_text, crate::task::now_ms(), m.cost],
    )?;
    Ok(())
}

fn read_task(c: &Connection, id: &str) -> Result<Option<TaskRecord>, StoreError> {
    let rec = c
        .query_row(
            "SELECT task_id, request_id, tenant, application, user_id, ingress, logical_model, priority, state, \
             created_at_ms, prompt_sha256, prompt_text, result_text, error_code, result_json, trace_id \
             FROM tasks WHERE task_id = ?1",
            params![id],
            |row| {
                let state: String = row.get(8)?;
                let result_json: Option<String> = row.get(14)?;
                Ok(TaskRecord {
                    task_id: row.get(0)?,
                    request_id: row.get(1)?,
                    trace_id: row.get(15)?,
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
                    response: None,
                    response_conversation: None,
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
    rec.response = responses::get(c, id)?;
    rec.response_conversation = responses::conversation(c, id)?;
    Ok(Some(rec))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Review 15 L6: a finish whose audit record cannot be written (an
    /// error that is not the disk's: here a trigger refuses it) leaves the
    /// task as it was, not ended without its record; the batch's other
    /// writes commit. (The batch is first written without savepoints: the
    /// failure rolls it back and it is written again with one per write,
    /// where the failing write is left out and counted once.)
    #[tokio::test]
    async fn a_finish_whose_record_fails_commits_neither() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("edgeway.db");
        let store = Store::open_with(&path, "n1", false, StoreOptions::default()).unwrap();
        let (a, b) = (TaskRequest::sample(vec![]), TaskRequest::sample(vec![]));
        for r in [&a, &b] {
            store.new_task(r);
            store.transition(&r.task_id, TaskState::Received, "r", None, "client");
        }
        store.flush().await;
        let refuse = format!(
            "CREATE TRIGGER refuse_audit BEFORE INSERT ON audit_log WHEN NEW.record LIKE '%{}%' \
             BEGIN SELECT RAISE(ABORT, 'refused'); END;",
            a.task_id
        );
        Connection::open(&path).unwrap().execute_batch(&refuse).unwrap();
        let failures = store.write_failures().get();
        for r in [&a, &b] {
            let meta = ResultMeta::bare(&r.request_id, &r.task_id, TaskState::Succeeded, "m", "n1");
            store.finish(&meta, "done", None, "engine", None, None, KeyedResult::None, None);
        }
        store.flush().await;
        assert_eq!(store.write_failures().get(), failures + 1);
        let a = store.get(&a.task_id).await.unwrap().unwrap();
        assert_eq!((a.state, a.transitions.len()), (TaskState::Received, 1), "not ended without its record");
        assert_eq!(store.get(&b.task_id).await.unwrap().unwrap().state, TaskState::Succeeded);
        let c = Connection::open(&path).unwrap();
        let records: i64 = c.query_row("SELECT COUNT(*) FROM audit_log", [], |r| r.get(0)).unwrap();
        assert_eq!(records, 1, "b's record only");
    }

    /// Review 15 L6: no more than `AUDIT_QUERIES_AT_ONCE` audit scans at
    /// once; one more is refused at once, not queued.
    #[tokio::test]
    async fn audit_queries_beyond_the_bound_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open_with(&dir.path().join("edgeway.db"), "n1", false, StoreOptions::default()).unwrap();
        let q = || AuditQuery { limit: 10, ..AuditQuery::default() };
        assert!(store.audit(q()).await.is_ok());
        let running: Vec<_> =
            (0..AUDIT_QUERIES_AT_ONCE).map(|_| store.audit_queries.clone().try_acquire_owned().unwrap()).collect();
        assert!(matches!(store.audit(q()).await, Err(StoreError::Busy)));
        drop(running);
        assert!(store.audit(q()).await.is_ok(), "free again once one ends");
    }

    fn transitions(path: &Path) -> i64 {
        let c = Connection::open(path).unwrap();
        c.query_row("SELECT COUNT(*) FROM task_transitions", [], |r| r.get(0)).unwrap()
    }

    /// A task's writes come over its life, a millisecond or so apart. The
    /// write-behind (`commit_window`) commits them together instead of one
    /// transaction each (each a WAL append of every page it touches), and a
    /// read still sees all of them at once.
    #[tokio::test]
    async fn a_tasks_writes_a_millisecond_apart_are_one_transaction() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open_with(&dir.path().join("edgeway.db"), "n1", false, StoreOptions::default()).unwrap();
        let req = TaskRequest::sample(vec![]);
        store.new_task(&req); // commits within 2 ms (see the next tests)
        store.flush().await;
        let before = store.health().commits();
        for state in [TaskState::Received, TaskState::Validating, TaskState::Queued, TaskState::Dispatching] {
            tokio::time::sleep(Duration::from_millis(1)).await;
            store.transition(&req.task_id, state, "step", None, "scheduler");
        }
        let rec = store.get(&req.task_id).await.unwrap().expect("the task is readable at once");
        assert_eq!(rec.transitions.len(), 4);
        let commits = store.health().commits() - before;
        // Two when a sleep overran the window on a loaded machine; committed
        // as they came (before the write-behind) it was four.
        assert!(commits <= 2, "{commits} transactions for one task's four transitions");
    }

    /// What crash recovery stands on is not held back by the write-behind:
    /// a new task's row with an idempotency key (a client may see it
    /// acknowledged next, and it is queued again after a crash) and
    /// `started` (a task that reached an engine is not queued again after
    /// a crash) commit at once, even with windows of a minute; a
    /// transition and a new task without a key wait for their windows (or
    /// for a read).
    #[tokio::test]
    async fn a_new_task_and_its_start_commit_at_once_despite_the_window() {
        let dir = tempfile::tempdir().unwrap();
        let minute = Duration::from_secs(60);
        let opts = StoreOptions { commit_window: minute, new_task_window: minute, ..StoreOptions::default() };
        let store = Store::open_with(&dir.path().join("edgeway.db"), "n1", false, opts).unwrap();
        let committed_after = |before: u64| {
            let health = store.health();
            async move {
                let deadline = Instant::now() + Duration::from_secs(10);
                while health.commits() == before && Instant::now() < deadline {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                health.commits() > before
            }
        };
        let mut req = TaskRequest::sample(vec![]);
        let before = store.health().commits();
        store.new_task(&req);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(store.health().commits(), before, "a new task without a key waits for its window");
        store.flush().await;
        req.task_id = "keyed".into();
        req.idempotency_key = Some("k".into());
        let before = store.health().commits();
        store.new_task(&req);
        assert!(committed_after(before).await, "the new task with a key was held back");
        let before = store.health().commits();
        store.transition(&req.task_id, TaskState::Received, "r", None, "client");
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(store.health().commits(), before, "a transition waits for the window");
        store.started(&req.task_id);
        assert!(committed_after(before).await, "started was held back");

        // What a repeat of an idempotency key is answered from (review 14
        // H1): the result of a task with a key, a key forgotten.
        let meta = ResultMeta::bare("r", &req.task_id, TaskState::Succeeded, "m", "n1");
        let before = store.health().commits();
        store.finish(&meta, "done", None, "engine", None, Some("answer".into()), KeyedResult::OutcomeAndText, None);
        assert!(committed_after(before).await, "an idempotent result was held back");
        let before = store.health().commits();
        store.forget_key("t", "a", "k", &req.task_id);
        assert!(committed_after(before).await, "a forgotten key was held back");
        // A result without a key may wait.
        let other = TaskRequest::sample(vec![]);
        store.new_task(&other);
        store.flush().await;
        let before = store.health().commits();
        let meta = ResultMeta::bare("r2", &other.task_id, TaskState::Succeeded, "m", "n1");
        store.finish(&meta, "done", None, "engine", None, None, KeyedResult::None, None);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(store.health().commits(), before, "a result without a key waits for the window");
    }

    /// New tasks without a key that come within `new_task_window` of the
    /// first are one transaction, committed once that window is over (not
    /// the write-behind's), with the plain writes that came meanwhile.
    #[tokio::test]
    async fn new_tasks_within_their_window_are_one_transaction() {
        let dir = tempfile::tempdir().unwrap();
        let opts = StoreOptions {
            commit_window: Duration::from_secs(60),
            new_task_window: Duration::from_millis(300),
            ..StoreOptions::default()
        };
        let store = Store::open_with(&dir.path().join("edgeway.db"), "n1", false, opts).unwrap();
        let (before, writes_before) = (store.health().commits(), store.health().committed_writes());
        let started = Instant::now();
        let ids: Vec<String> = (0..3).map(|i| format!("t{i}")).collect();
        for id in &ids {
            let mut req = TaskRequest::sample(vec![]);
            req.task_id = id.clone();
            store.new_task(&req);
            store.transition(id, TaskState::Received, "r", None, "client");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while store.health().commits() == before && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let waited = started.elapsed();
        assert_eq!(store.health().commits() - before, 1, "one transaction for the three tasks");
        assert_eq!(store.health().committed_writes() - writes_before, 6, "three rows and their transitions");
        assert!(waited >= Duration::from_millis(290), "committed before the window was over ({waited:?})");
        assert!(waited < Duration::from_secs(5), "waited for the write-behind instead ({waited:?})");
        for id in &ids {
            let rec = store.get(id).await.unwrap().expect("the task was committed");
            assert_eq!(rec.transitions.len(), 1);
        }
    }

    /// A disk that fills up (the file may not grow: SQLite's own
    /// `max_page_count`, which fails writes with SQLITE_FULL as a full disk
    /// does) degrades the store; the writes of the failed batches stay in
    /// memory and are all written once there is room again. A write the
    /// caller waits for is answered with the failure, never as done.
    #[tokio::test]
    async fn a_full_disk_degrades_the_store_and_loses_no_write() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("edgeway.db");
        let opts = StoreOptions { retry_interval: Duration::from_millis(20), ..StoreOptions::default() };
        let store = Store::open_with(&path, "n1", false, opts).unwrap();
        store.transition("t0", TaskState::Received, "before", None, "client");
        store.flush().await;
        assert!(!store.is_degraded());

        store.set_writer_pragma("max_page_count", 0).await;
        // Each write needs new pages (12 kB reasons).
        let big = "x".repeat(12_000);
        for i in 0..5 {
            store.transition(&format!("t{i}"), TaskState::Validating, &big, None, "gateway");
        }
        store.flush().await;
        let why = store.health().degraded().expect("degraded");
        assert!(why.contains("full"), "{why}");
        assert_eq!(store.health().buffered_writes(), 5);
        let revoked = store.set_revoked(&"ab".repeat(32), "ops", true).await;
        assert!(matches!(revoked, Err(StoreError::Unavailable(_))), "{revoked:?}");
        assert_eq!(transitions(&path), 1, "nothing of the failed batches is half written");
        assert!(store.write_failures().get() >= 1);

        // Room again: the next attempt writes everything, the revocation too.
        store.set_writer_pragma("max_page_count", 1 << 30).await;
        store.flush().await;
        assert!(!store.is_degraded());
        assert_eq!(store.health().buffered_writes(), 0);
        assert_eq!(transitions(&path), 6);
        assert_eq!(store.revoked_keys().await, vec!["ab".repeat(32)]);
        assert!(store.set_revoked(&"cd".repeat(32), "ops", true).await.is_ok());
    }

    /// The writer keeps the audit chain's head (`audit::ChainHead`): the
    /// records of batches that could not commit (a full disk) are chained
    /// again from the head as committed, not from the one the failed
    /// attempts had reached, and the chain verifies without a gap.
    #[tokio::test]
    async fn audit_records_of_failed_batches_chain_from_the_committed_head() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("edgeway.db");
        let opts = StoreOptions { retry_interval: Duration::from_millis(20), ..StoreOptions::default() };
        let store = Store::open_with(&path, "n1", false, opts).unwrap();
        let who = TaskRequest::sample(vec![]).identity;
        let refuse = || {
            store.rejected(&who, Ingress::Http, "m", "", &GatewayError::invalid("no ".repeat(160)));
        };
        refuse();
        store.flush().await;
        store.set_writer_pragma("max_page_count", 0).await;
        for _ in 0..3 {
            for _ in 0..40 {
                refuse();
            }
            store.flush().await;
            assert!(store.is_degraded(), "the batch needs new pages");
        }
        store.set_writer_pragma("max_page_count", 1 << 30).await;
        refuse();
        store.flush().await;
        assert!(!store.is_degraded());
        let c = audit::open_read_only(&path).unwrap();
        assert_eq!(audit::verify(&c).unwrap(), 122);
    }

    /// Writes beyond `max_buffered_writes` while degraded are dropped and
    /// counted, so a long outage cannot take all memory.
    #[tokio::test]
    async fn the_buffer_of_a_degraded_store_is_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("edgeway.db");
        let opts = StoreOptions { max_buffered_writes: 3, ..StoreOptions::default() };
        let store = Store::open_with(&path, "n1", false, opts).unwrap();
        store.set_writer_pragma("query_only", 1).await;
        for i in 0..5 {
            store.transition(&format!("t{i}"), TaskState::Received, "r", None, "client");
            store.flush().await;
        }
        assert!(store.is_degraded());
        assert_eq!(store.health().buffered_writes(), 3);
        assert_eq!(store.health().dropped_writes(), 2);
        store.set_writer_pragma("query_only", 0).await;
        store.flush().await;
        assert!(!store.is_degraded());
        assert_eq!(transitions(&path), 3);
    }

    /// The writer purges on its own, every interval, what is past the
    /// retention (see `retention.rs` for what is kept).
    #[tokio::test]
    async fn the_writer_purges_old_finished_tasks() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("edgeway.db");
        let opts = StoreOptions {
            retention_tasks: Some(Duration::ZERO),
            retention_rejected: Some(Duration::ZERO),
            purge_interval: Duration::from_millis(10),
            ..StoreOptions::default()
        };
        let store = Store::open_with(&path, "n1", false, opts).unwrap();
        let who = Identity {
            tenant: "t".into(),
            application: "a".into(),
            user_id: None,
            max_priority: crate::task::Priority::P0,
            default_priority: crate::task::Priority::P2,
            is_admin: false,
            credential: None,
            data_class: None,
        };
        let id =
            store.rejected(&who, Ingress::Http, "m", "4bf92f3577b34da6a3ce929d0e0e4736", &GatewayError::invalid("no"));
        store.flush().await;
        // Purged by a later pass of the writer (no write needed to wake it).
        let gone = async {
            loop {
                if store.get(&id).await.unwrap().is_none() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(10), gone).await.expect("purged");
        assert_eq!(transitions(&path), 0);
    }

    /// The writer's passes also delete budget rows of windows that can no
    /// longer count (`budget::purge`); this window's stay. Failed before:
    /// nothing deleted them.
    #[tokio::test]
    async fn the_writer_purges_budget_rows_of_old_windows() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("edgeway.db");
        let opts = StoreOptions { purge_interval: Duration::from_millis(10), ..StoreOptions::default() };
        let store = Store::open_with(&path, "n1", false, opts).unwrap();
        let c = Connection::open(&path).unwrap();
        c.pragma_update(None, "busy_timeout", 5000).unwrap();
        let now = crate::task::now_ms();
        budget::persist(&c, "gone", "gone-app", 5, 0.0, now - 100 * 86_400_000).unwrap();
        budget::persist(&c, "kept", "kept-app", 5, 0.0, now).unwrap();
        let names = || -> Vec<String> {
            let mut st = c.prepare("SELECT DISTINCT name FROM budget_spent ORDER BY name").unwrap();
            st.query_map([], |r| r.get(0)).unwrap().map(Result::unwrap).collect()
        };
        let gone = async {
            while names().len() != 2 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(10), gone).await.expect("purged");
        assert_eq!(names(), ["kept", "kept-app"]);
        drop(store);
    }

    /// A batch's charges summed per row and window write what the tasks'
    /// own writes, one by one, would have: across midnight too.
    #[test]
    fn a_batch_of_charges_writes_what_its_tasks_would_one_by_one() {
        let dir = tempfile::tempdir().unwrap();
        let day = 86_400_000;
        let midnight = budget::Period::Daily.start(crate::task::now_ms()) + 2 * day;
        let charge = |tenant: &str, app: &str, tokens: u64, cost: f64, at_ms: i64| budget::Charge {
            tenant: tenant.into(),
            application: app.into(),
            tokens,
            cost,
            at_ms,
        };
        let charges = [
            charge("t", "a", 10, 0.5, midnight - 2),
            charge("t", "b", 7, 0.0, midnight - 1),
            charge("t", "a", 5, 0.25, midnight + 1),
            charge("u", "c", 3, 1.0, midnight - 1),
            charge("t", "a", 1, 0.0, midnight - 1),
        ];
        let rows = |path: &Path| -> Vec<(String, String, String, i64, i64, f64)> {
            let c = Connection::open(path).unwrap();
            let mut st = c
                .prepare(
                    "SELECT scope, name, period, window_start_ms, tokens, cost FROM budget_spent \
                     ORDER BY scope, name, period",
                )
                .unwrap();
            st.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?, r.get(5)?)))
                .unwrap()
                .map(Result::unwrap)
                .collect()
        };
        let (one, all) = (dir.path().join("one.db"), dir.path().join("all.db"));
        for path in [&one, &all] {
            drop(Store::open(path, "n1", false).unwrap());
        }
        let c = Connection::open(&one).unwrap();
        for ch in &charges {
            budget::persist(&c, &ch.tenant, &ch.application, ch.tokens, ch.cost, ch.at_ms).unwrap();
        }
        budget::persist_all(&Connection::open(&all).unwrap(), &charges).unwrap();
        let written = rows(&all);
        assert_eq!(written, rows(&one));
        // The new day's row of tenant t holds only what came after midnight.
        let daily_t = written.iter().find(|r| r.0 == "tenant" && r.1 == "t" && r.2 == "daily").unwrap();
        assert_eq!((daily_t.3, daily_t.4), (midnight, 5));
    }
}
