//! Per-task event logs and the registry of live and recently ended tasks.
//!
//! Every event a task emits is appended to its [`TaskLog`] with a contiguous
//! sequence number from 0. Any number of [`Subscription`]s read a log from
//! any sequence number, so a client can re-attach to a live stream (an
//! idempotent retry, a device that reconnects, `Last-Event-ID`) and get what
//! it missed, then the live tail. Logs of ended tasks are kept for a
//! retention time and within a byte budget, then dropped.
//!
//! # Cancel safety
//! [`Subscription::recv`] can be dropped at any point without losing an
//! event: the position only advances when an event is returned.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use super::CancelHandle;
use crate::task::TaskEvent;

#[derive(Default)]
struct LogInner {
    events: Vec<TaskEvent>,
    ended: bool,
    bytes: usize,
}

/// The events of one task, in order.
#[derive(Default)]
pub struct TaskLog {
    inner: Mutex<LogInner>,
    notify: Notify,
}

/// Heap bytes an event holds (the enum, its strings, boxed metadata).
fn event_bytes(e: &TaskEvent) -> usize {
    std::mem::size_of::<TaskEvent>()
        + match e {
            TaskEvent::Accepted { task_id, .. } => task_id.capacity(),
            TaskEvent::Queued { .. } => 0,
            TaskEvent::Delta { text } => text.capacity(),
            TaskEvent::Done(_) => RESULT_META_BYTES,
            TaskEvent::Error { error, .. } => error.message.capacity() + RESULT_META_BYTES,
        }
}

/// A boxed `ResultMeta` with its strings, roughly.
const RESULT_META_BYTES: usize = 640;

/// What a registry entry costs beyond its events: the entry, its ids, the
/// index maps' keys and the log's bookkeeping.
const ENTRY_OVERHEAD_BYTES: usize = 1024;

impl TaskLog {
    /// Appends an event and returns its sequence number. `Done` and `Error`
    /// end the log.
    pub fn push(&self, e: TaskEvent) -> u64 {
        let seq = {
            let mut g = self.inner.lock().expect("task log");
            debug_assert!(!g.ended, "event after the terminal event");
            g.ended |= matches!(e, TaskEvent::Done(_) | TaskEvent::Error { .. });
            g.bytes += event_bytes(&e);
            g.events.push(e);
            g.events.len() as u64 - 1
        };
        self.notify.notify_waiters();
        seq
    }

    pub fn len(&self) -> u64 {
        self.inner.lock().expect("task log").events.len() as u64
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn is_ended(&self) -> bool {
        self.inner.lock().expect("task log").ended
    }

    pub fn bytes(&self) -> usize {
        self.inner.lock().expect("task log").bytes
    }

    /// The last event, if the task has ended.
    pub fn terminal(&self) -> Option<TaskEvent> {
        let g = self.inner.lock().expect("task log");
        if g.ended {
            g.events.last().cloned()
        } else {
            None
        }
    }

    pub fn subscribe(self: &Arc<Self>, from_seq: u64) -> Subscription {
        Subscription { log: self.clone(), next: from_seq }
    }
}

/// A reader of one task's log.
pub struct Subscription {
    log: Arc<TaskLog>,
    next: u64,
}

impl Subscription {
    /// The next event and its sequence number; `None` after the terminal
    /// event has been returned.
    pub async fn recv(&mut self) -> Option<(u64, TaskEvent)> {
        loop {
            let notified = self.log.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let g = self.log.inner.lock().expect("task log");
                if let Some(e) = g.events.get(self.next as usize) {
                    let seq = self.next;
                    self.next += 1;
                    return Some((seq, e.clone()));
                }
                if g.ended {
                    return None;
                }
            }
            notified.await;
        }
    }

    /// The sequence number the next `recv` returns.
    pub fn position(&self) -> u64 {
        self.next
    }
}

/// A task the gateway knows about: running, or ended within the retention.
pub struct TaskEntry {
    pub task_id: String,
    pub request_id: String,
    pub tenant: String,
    pub application: String,
    pub idempotency_key: Option<String>,
    /// To tell a true retry from a different request reusing the key.
    pub prompt_sha256: String,
    pub priority: crate::task::Priority,
    /// Digest of the API key that submitted it.
    pub credential: Option<[u8; 32]>,
    pub log: Arc<TaskLog>,
    pub cancel: CancelHandle,
}

/// Owner key of request ids and idempotency keys: unique per tenant and
/// application.
type OwnerKey = (String, String, String);

#[derive(Default)]
struct RegistryInner {
    tasks: HashMap<String, Arc<TaskEntry>>,
    by_request: HashMap<OwnerKey, String>,
    by_idempotency: HashMap<OwnerKey, String>,
    /// Ended tasks, oldest first, with when they ended.
    ended: VecDeque<(Instant, String)>,
    ended_bytes: usize,
}

/// Live and recently ended tasks, by id, request id and idempotency key.
pub struct Registry {
    inner: Mutex<RegistryInner>,
    retention: Duration,
    max_bytes: usize,
}

impl Registry {
    pub fn new(retention: Duration, max_bytes: usize) -> Registry {
        Registry { inner: Mutex::new(RegistryInner::default()), retention, max_bytes }
    }

    /// Registers a new task, unless a known task of the same owner has the
    /// same idempotency key: then that task is returned instead (checked and
    /// inserted under one lock, so two racing retries start one task).
    pub fn insert_or_get(&self, e: Arc<TaskEntry>) -> Result<(), Arc<TaskEntry>> {
        let mut g = self.inner.lock().expect("registry");
        if let Some(k) = &e.idempotency_key {
            let key = (e.tenant.clone(), e.application.clone(), k.clone());
            if let Some(existing) = g.by_idempotency.get(&key).and_then(|id| g.tasks.get(id)) {
                return Err(existing.clone());
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
        if g.by_request.get(&owner(&e.request_id)) == Some(&e.task_id) {
            g.by_request.remove(&owner(&e.request_id));
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
        g.by_request.insert(owner(&e.request_id), e.task_id.clone());
        if let Some(k) = &e.idempotency_key {
            g.by_idempotency.insert(owner(k), e.task_id.clone());
        }
        g.tasks.insert(e.task_id.clone(), e);
    }

    pub fn get(&self, task_id: &str) -> Option<Arc<TaskEntry>> {
        self.inner.lock().expect("registry").tasks.get(task_id).cloned()
    }

    pub fn by_request(&self, tenant: &str, app: &str, request_id: &str) -> Option<Arc<TaskEntry>> {
        let g = self.inner.lock().expect("registry");
        let id = g.by_request.get(&(tenant.into(), app.into(), request_id.into()))?;
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
            g.ended_bytes += b;
            g.ended.push_back((now, task_id.to_string()));
        }
        while let Some((at, id)) = g.ended.front().cloned() {
            if now.duration_since(at) < self.retention && g.ended_bytes <= self.max_bytes {
                break;
            }
            g.ended.pop_front();
            if let Some(e) = g.tasks.remove(&id) {
                g.ended_bytes = g.ended_bytes.saturating_sub(e.log.bytes() + ENTRY_OVERHEAD_BYTES);
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
        let log = Arc::new(TaskLog::default());
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
}
