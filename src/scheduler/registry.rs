//! The registry of live and recently ended tasks, and each task's event
//! log.
//!
//! Every event a task emits is appended to its [`TaskLog`] with a contiguous
//! sequence number from 0. Any number of [`Subscription`]s read a log from
//! any sequence number, so a client can re-attach to a live stream (an
//! idempotent retry, a device that reconnects, `Last-Event-ID`) and get what
//! it missed, then the live tail. Logs of ended tasks are kept for a
//! retention time and within a byte budget, then dropped.
//!
//! Owns: the index of tasks by id, request id and idempotency key, and when
//! an ended task is forgotten. Does not own: the log mechanics and retention
//! rules ([`crate::task::log`], shared with MQTT's response streams) or what
//! a task does (the driver).
//!
//! # Cancel safety
//! [`Subscription::recv`] can be dropped at any point without losing an
//! event: the position only advances when an event is returned.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::CancelHandle;
use crate::task::log::{EndedQueue, Reader, RetainedLog};
use crate::task::{Ingress, TaskEvent};

/// The events of one task, in order; `Done` or `Error` ends it. Kept whole
/// (no budget of its own): the registry bounds ended logs as a whole.
/// Clones share the log (and the count of its text deltas).
#[derive(Clone)]
pub struct TaskLog(Arc<RetainedLog<TaskEvent>>, Arc<AtomicU64>);

impl Default for TaskLog {
    fn default() -> Self {
        TaskLog(Arc::new(RetainedLog::new(event_bytes)), Arc::default())
    }
}

/// Heap bytes an event holds (the enum, its strings, boxed metadata).
fn event_bytes(e: &TaskEvent) -> usize {
    std::mem::size_of::<TaskEvent>()
        + match e {
            TaskEvent::Accepted { task_id, .. } => task_id.capacity(),
            TaskEvent::Queued { .. } => 0,
            TaskEvent::Delta { text } => text.capacity(),
            TaskEvent::ToolCallDelta(d) => {
                d.arguments.capacity()
                    + d.id.as_ref().map_or(0, String::capacity)
                    + d.name.as_ref().map_or(0, String::capacity)
            }
            TaskEvent::Embedding { vector, .. } => vector.capacity() * std::mem::size_of::<f32>(),
            TaskEvent::Done(_) => RESULT_META_BYTES,
            TaskEvent::Error { error, .. } => error.message.capacity() + RESULT_META_BYTES,
        }
}

/// A boxed `ResultMeta` with its strings and its route (one hop),
/// roughly.
const RESULT_META_BYTES: usize = 960;

/// What a registry entry costs beyond its events: the entry, its ids, the
/// index maps' keys and the log's bookkeeping.
const ENTRY_OVERHEAD_BYTES: usize = 1024;

impl TaskLog {
    /// Appends an event and returns its sequence number. `Done` and `Error`
    /// end the log.
    pub fn push(&self, e: TaskEvent) -> u64 {
        if matches!(e, TaskEvent::Delta { .. } | TaskEvent::ToolCallDelta(_)) {
            self.1.fetch_add(1, Ordering::Relaxed);
        }
        if matches!(e, TaskEvent::Done(_) | TaskEvent::Error { .. }) {
            self.0.push_last(e)
        } else {
            self.0.push(e)
        }
    }

    pub fn len(&self) -> u64 {
        self.0.range().next
    }

    /// Output deltas (text or tool-call pieces) pushed so far: the tokens
    /// streamed so far for engines that send one token per chunk
    /// (llama.cpp, vLLM), for the status page.
    pub fn deltas(&self) -> u64 {
        self.1.load(Ordering::Relaxed)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn is_ended(&self) -> bool {
        self.0.is_ended()
    }

    pub fn bytes(&self) -> usize {
        self.0.bytes()
    }

    /// The last event, if the task has ended.
    pub fn terminal(&self) -> Option<TaskEvent> {
        self.0.last()
    }

    pub fn subscribe(&self, from_seq: u64) -> Subscription {
        Subscription(self.0.reader(from_seq))
    }

    /// Takes back the events from `from_seq` on if no subscription exists
    /// and none was given any of them (see
    /// [`RetainedLog::retract_unread`]).
    pub fn retract_unread(&self, from_seq: u64) -> bool {
        self.0.retract_unread(from_seq)
    }
}

/// A reader of one task's log.
pub struct Subscription(Reader<TaskEvent>);

impl Subscription {
    /// The next event and its sequence number; `None` after the terminal
    /// event has been returned.
    pub async fn recv(&mut self) -> Option<(u64, TaskEvent)> {
        self.0.recv().await
    }

    /// The sequence number the next `recv` returns.
    pub fn position(&self) -> u64 {
        self.0.position()
    }
}

/// A task the gateway knows about: running, or ended within the retention.
pub struct TaskEntry {
    pub task_id: String,
    pub request_id: String,
    pub trace_id: String,
    pub tenant: String,
    pub application: String,
    /// Where it came from: a cancel by request id reaches only the tasks
    /// of its own ingress (request ids are the caller's, and guessable).
    pub ingress: Ingress,
    pub idempotency_key: Option<String>,
    /// To tell a true retry from a different request reusing the key.
    pub prompt_sha256: String,
    pub priority: crate::task::Priority,
    /// The logical model it asked for (the status page).
    pub logical_model: String,
    /// When the scheduler took it, for its age on the status page.
    pub created: Instant,
    /// Digest of the API key that submitted it.
    pub credential: Option<[u8; 32]>,
    pub log: TaskLog,
    pub cancel: CancelHandle,
}

/// Owner key of request ids and idempotency keys: unique per tenant and
/// application.
type OwnerKey = (String, String, String);

/// Owner key of request ids: per tenant, application and ingress.
type RequestKey = (String, String, Ingress, String);

struct RegistryInner {
    tasks: HashMap<String, Arc<TaskEntry>>,
    by_request: HashMap<RequestKey, String>,
    by_idempotency: HashMap<OwnerKey, String>,
    /// Ended tasks by id, with what each costs while kept.
    ended: EndedQueue<String>,
}

/// Live and recently ended tasks, by id, request id and idempotency key.
pub struct Registry {
    inner: Mutex<RegistryInner>,
}

impl Registry {
    pub fn new(retention: Duration, max_bytes: usize) -> Registry {
        Registry {
            inner: Mutex::new(RegistryInner {
                tasks: HashMap::new(),
                by_request: HashMap::new(),
                by_idempotency: HashMap::new(),
                ended: EndedQueue::new(retention, max_bytes),
            }),
        }
    }

    /// Registers a new task, unless a known task of the same owner has the
    /// same idempotency key: then that task is returned instead (checked and
    /// inserted under one lock, so two racing retries start one task). A
    /// known task that ended in a way a repeat runs again
    /// ([`ErrorCode::runs_again_on_repeat`]) gives its key up to the new one.
    ///
    /// [`ErrorCode::runs_again_on_repeat`]: crate::error::ErrorCode::runs_again_on_repeat
    pub fn insert_or_get(&self, e: Arc<TaskEntry>) -> Result<(), Arc<TaskEntry>> {
        let mut g = self.inner.lock().expect("registry");
        if let Some(k) = &e.idempotency_key {
            let key = (e.tenant.clone(), e.application.clone(), k.clone());
            if let Some(existing) = g.by_idempotency.get(&key).and_then(|id| g.tasks.get(id)) {
                let runs_again = matches!(existing.log.terminal(), Some(TaskEvent::Error { error, .. }) if error.code.runs_again_on_repeat());
                if !runs_again {
                    return Err(existing.clone());
                }
            }
        }
        Self::insert_locked(&mut g, e);
        Ok(())
    }

    /// Forgets a task that never started (refused by the scheduler).
    pub fn remove(&self, task_id: &str) {
        let mut g = self.inner.lock().expect("registry");
        if let Some(e) = g.tasks.remove(task_id) {
            Self::unindex(&mut g, &e);
        }
    }

    fn unindex(g: &mut RegistryInner, e: &TaskEntry) {
        let owner = |k: &str| (e.tenant.clone(), e.application.clone(), k.to_string());
        let request = (e.tenant.clone(), e.application.clone(), e.ingress, e.request_id.clone());
        if g.by_request.get(&request) == Some(&e.task_id) {
            g.by_request.remove(&request);
        }
        if let Some(k) = &e.idempotency_key {
            if g.by_idempotency.get(&owner(k)) == Some(&e.task_id) {
                g.by_idempotency.remove(&owner(k));
            }
        }
    }

    pub fn insert(&self, e: Arc<TaskEntry>) {
        let mut g = self.inner.lock().expect("registry");
        Self::insert_locked(&mut g, e);
    }

    fn insert_locked(g: &mut RegistryInner, e: Arc<TaskEntry>) {
        let owner = |k: &str| (e.tenant.clone(), e.application.clone(), k.to_string());
        g.by_request
            .insert((e.tenant.clone(), e.application.clone(), e.ingress, e.request_id.clone()), e.task_id.clone());
        if let Some(k) = &e.idempotency_key {
            g.by_idempotency.insert(owner(k), e.task_id.clone());
        }
        g.tasks.insert(e.task_id.clone(), e);
    }

    pub fn get(&self, task_id: &str) -> Option<Arc<TaskEntry>> {
        self.inner.lock().expect("registry").tasks.get(task_id).cloned()
    }

    pub fn by_request(&self, tenant: &str, app: &str, ingress: Ingress, request_id: &str) -> Option<Arc<TaskEntry>> {
        let g = self.inner.lock().expect("registry");
        let id = g.by_request.get(&(tenant.into(), app.into(), ingress, request_id.into()))?;
        g.tasks.get(id).cloned()
    }

    pub fn by_idempotency_key(&self, tenant: &str, app: &str, key: &str) -> Option<Arc<TaskEntry>> {
        let g = self.inner.lock().expect("registry");
        let id = g.by_idempotency.get(&(tenant.into(), app.into(), key.into()))?;
        g.tasks.get(id).cloned()
    }

    /// Marks a task ended; it stays attachable for the retention time.
    /// Also drops what is past retention or over the byte budget.
    pub fn ended(&self, task_id: &str) {
        let now = Instant::now();
        let mut g = self.inner.lock().expect("registry");
        if let Some(e) = g.tasks.get(task_id) {
            let b = e.log.bytes() + ENTRY_OVERHEAD_BYTES;
            g.ended.push(now, task_id.to_string(), b);
        }
        while let Some(id) = g.ended.pop_expired(now) {
            if let Some(e) = g.tasks.remove(&id) {
                Self::unindex(&mut g, &e);
            }
        }
    }

    pub fn len(&self) -> usize {
        self.inner.lock().expect("registry").tasks.len()
    }

    /// Live (not ended) tasks that `pred` selects.
    pub fn live_where(&self, pred: impl Fn(&TaskEntry) -> bool) -> Vec<Arc<TaskEntry>> {
        let g = self.inner.lock().expect("registry");
        g.tasks.values().filter(|e| !e.log.is_ended() && pred(e)).cloned().collect()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn late_subscribers_replay_then_follow_the_live_tail() {
        let log = TaskLog::default();
        log.push(TaskEvent::Delta { text: "a".into() });
        let mut early = log.subscribe(0);
        let mut late = log.subscribe(1);
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            while let Some((seq, e)) = early.recv().await {
                got.push((seq, e));
            }
            got
        });
        log.push(TaskEvent::Delta { text: "b".into() });
        assert_eq!(late.recv().await.unwrap(), (1, TaskEvent::Delta { text: "b".into() }));
        log.push(TaskEvent::Error {
            error: crate::error::GatewayError::internal("x"),
            meta: Box::new(crate::task::ResultMeta::bare("", "", crate::task::TaskState::Failed, "", "")),
        });
        let got = reader.await.unwrap();
        assert_eq!(got.iter().map(|(s, _)| *s).collect::<Vec<_>>(), [0, 1, 2]);
        assert!(late.recv().await.is_some());
        assert!(late.recv().await.is_none());
        assert!(log.is_ended());
    }

    fn entry(task_id: &str, key: Option<&str>) -> Arc<TaskEntry> {
        Arc::new(TaskEntry {
            task_id: task_id.into(),
            request_id: format!("r-{task_id}"),
            trace_id: String::new(),
            tenant: "t".into(),
            application: "a".into(),
            ingress: Ingress::Http,
            idempotency_key: key.map(Into::into),
            prompt_sha256: String::new(),
            priority: crate::task::Priority::P2,
            logical_model: "m".into(),
            created: Instant::now(),
            credential: None,
            log: TaskLog::default(),
            cancel: CancelHandle::new(tokio_util::sync::CancellationToken::new()),
        })
    }

    fn end(r: &Registry, e: &TaskEntry) {
        e.log.push(TaskEvent::Error {
            error: crate::error::GatewayError::internal("x"),
            meta: Box::new(crate::task::ResultMeta::bare("", "", crate::task::TaskState::Failed, "", "")),
        });
        r.ended(&e.task_id);
    }

    #[test]
    fn ended_tasks_stay_findable_within_the_budget_and_are_forgotten_past_it() {
        // Room for about two ended tasks.
        let r = Registry::new(Duration::from_secs(3600), 2 * ENTRY_OVERHEAD_BYTES + 2 * (RESULT_META_BYTES + 200));
        let (a, b, c) = (entry("a", Some("ka")), entry("b", None), entry("c", None));
        for e in [&a, &b, &c] {
            r.insert_or_get(e.clone()).map_err(|_| "duplicate").unwrap();
        }
        end(&r, &a);
        end(&r, &b);
        assert_eq!(r.len(), 3);
        assert!(r.by_idempotency_key("t", "a", "ka").is_some());
        // A live task is never dropped; the third ended one pushes out the
        // oldest, with its indexes.
        end(&r, &c);
        assert_eq!(r.len(), 2);
        assert!(r.get("a").is_none() && r.by_request("t", "a", Ingress::Http, "r-a").is_none());
        assert!(r.by_idempotency_key("t", "a", "ka").is_none());
        assert!(r.get("b").is_some() && r.get("c").is_some());
        // The same key is free again for a new task.
        assert!(r.insert_or_get(entry("a2", Some("ka"))).is_ok());
    }

    #[test]
    fn ended_tasks_are_forgotten_after_the_retention() {
        let r = Registry::new(Duration::ZERO, usize::MAX);
        let (a, b) = (entry("a", None), entry("b", None));
        r.insert(a.clone());
        r.insert(b.clone());
        end(&r, &a);
        assert!(r.get("a").is_none());
        assert_eq!(r.live_where(|_| true).len(), 1);
    }
}
