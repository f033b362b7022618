//! The bounded wait queue of one logical model, ordered by priority, then
//! arrival.

use std::collections::{BTreeMap, HashMap};

use tokio::sync::oneshot;

use super::SlotLease;
use crate::task::Priority;

/// The order of waiting tasks: smaller runs first.
pub type QueueKey = (Priority, u64);

pub struct QueueEntry {
    pub task_id: String,
    pub priority: Priority,
    /// Arrival number, unique across all queues of the scheduler.
    pub seq: u64,
    pub grant: oneshot::Sender<SlotLease>,
}

pub struct ModelQueue {
    pub name: String,
    pub capacity: usize,
    /// Instances that serve this model (indices into the scheduler's list).
    pub instances: Vec<usize>,
    entries: BTreeMap<QueueKey, QueueEntry>,
    by_task: HashMap<String, QueueKey>,
}

impl ModelQueue {
    pub fn new(name: String, capacity: usize, instances: Vec<usize>) -> Self {
        ModelQueue { name, capacity, instances, entries: BTreeMap::new(), by_task: HashMap::new() }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn is_full(&self) -> bool {
        self.entries.len() >= self.capacity
    }

    pub fn push(&mut self, e: QueueEntry) {
        let key = (e.priority, e.seq);
        self.by_task.insert(e.task_id.clone(), key);
        self.entries.insert(key, e);
    }

    /// The next task to run, without taking it.
    pub fn peek_key(&self) -> Option<QueueKey> {
        self.entries.keys().next().copied()
    }

    pub fn pop(&mut self) -> Option<QueueEntry> {
        let (_, e) = self.entries.pop_first()?;
        self.by_task.remove(&e.task_id);
        Some(e)
    }

    pub fn remove(&mut self, task_id: &str) -> Option<QueueEntry> {
        let key = self.by_task.remove(task_id)?;
        self.entries.remove(&key)
    }

    /// How many tasks run before `task_id` (0: it is next).
    pub fn position(&self, task_id: &str) -> Option<usize> {
        let key = self.by_task.get(task_id)?;
        Some(self.entries.range(..*key).count())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(id: &str, p: Priority, seq: u64) -> QueueEntry {
        QueueEntry { task_id: id.into(), priority: p, seq, grant: oneshot::channel().0 }
    }

    #[test]
    fn priority_then_arrival() {
        let mut q = ModelQueue::new("m".into(), 10, vec![0]);
        q.push(entry("a", Priority::P3, 1));
        q.push(entry("b", Priority::P1, 2));
        q.push(entry("c", Priority::P3, 3));
        q.push(entry("d", Priority::P0, 4));
        assert_eq!(q.position("c"), Some(3));
        assert_eq!(q.position("d"), Some(0));
        assert!(q.remove("b").is_some());
        let order: Vec<String> = std::iter::from_fn(|| q.pop()).map(|e| e.task_id).collect();
        assert_eq!(order, ["d", "a", "c"]);
        assert!(q.is_empty());
    }
}
