//! Retained logs: append-only sequences numbered from 0 that any number of
//! readers follow from any sequence number (replay, then the live tail),
//! and that are kept for a while after they end so that a client that
//! comes back can catch up.
//!
//! Two pieces serve both replay buffers of edgeway, the scheduler's (task
//! events, `scheduler::registry`) and MQTT's coalesced response streams
//! (rendered messages, `ingress::mqtt::streams`, which numbers its
//! messages with the log's own sequence, not the task's):
//! - [`RetainedLog`]: one log, with an optional byte budget of its own
//!   (the oldest items go first, the newest always stays) and a last item
//!   that ends it.
//! - [`EndedQueue`]: the retention of ended logs across a registry: oldest
//!   first, kept for a retention time and within a total byte budget.
//!
//! Owns: numbering, trimming, waking readers, and the retention rules.
//! Does not own: what an item is (the caller gives its size) or the maps
//! that find a log by key (registries keep more than the log per entry, so
//! they keep their own maps and drop what [`EndedQueue`] says).
//!
//! # Cancel safety
//! [`Reader::recv`] and [`Reader::recv_batch`] can be dropped at any
//! await point without losing an item: the position advances only when
//! items are returned (or when the items it points at were trimmed away).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

struct Items<T> {
    items: VecDeque<T>,
    /// Sequence number of `items[0]`.
    first: u64,
    /// Bytes of `items`, by the log's size function.
    bytes: usize,
    /// Sequence number of the last item, once the log has ended.
    last: Option<u64>,
    /// Readers that exist now.
    readers: usize,
    /// One past the highest sequence number any reader was given.
    delivered: u64,
}

impl<T> Items<T> {
    fn next_seq(&self) -> u64 {
        self.first + self.items.len() as u64
    }
}

/// Which sequence numbers a log holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqRange {
    /// The oldest item kept.
    pub first: u64,
    /// The number the next item gets.
    pub next: u64,
    /// The last item, once the log has ended.
    pub last: Option<u64>,
}

/// One append-only log of `T`.
pub struct RetainedLog<T> {
    inner: Mutex<Items<T>>,
    notify: Notify,
    size: fn(&T) -> usize,
    max_bytes: usize,
}

impl<T: Clone> RetainedLog<T> {
    /// A log that keeps every item until it is dropped.
    pub fn new(size: fn(&T) -> usize) -> Self {
        Self::with_budget(size, usize::MAX)
    }

    /// A log that keeps at most `max_bytes` of items (by `size`): the
    /// oldest go first, the newest always stays. Readers that were behind
    /// skip what was trimmed and see the gap in the sequence numbers.
    pub fn with_budget(size: fn(&T) -> usize, max_bytes: usize) -> Self {
        RetainedLog {
            inner: Mutex::new(Items {
                items: VecDeque::new(),
                first: 0,
                bytes: 0,
                last: None,
                readers: 0,
                delivered: 0,
            }),
            notify: Notify::new(),
            size,
            max_bytes,
        }
    }

    /// Appends an item; returns its sequence number.
    pub fn push(&self, item: T) -> u64 {
        self.append(item, false)
    }

    /// Appends the last item, which ends the log; returns its sequence
    /// number.
    pub fn push_last(&self, item: T) -> u64 {
        self.append(item, true)
    }

    fn append(&self, item: T, last: bool) -> u64 {
        let seq = {
            let mut g = self.inner.lock().expect("retained log");
            debug_assert!(g.last.is_none(), "an item after the last one");
            let seq = g.next_seq();
            if last {
                g.last = Some(seq);
            }
            g.bytes += (self.size)(&item);
            g.items.push_back(item);
            while g.bytes > self.max_bytes && g.items.len() > 1 {
                let old = g.items.pop_front().expect("more than one item");
                g.bytes -= (self.size)(&old);
                g.first += 1;
            }
            seq
        };
        self.notify.notify_waiters();
        seq
    }

    pub fn range(&self) -> SeqRange {
        let g = self.inner.lock().expect("retained log");
        SeqRange { first: g.first, next: g.next_seq(), last: g.last }
    }

    /// Bytes of the items kept.
    pub fn bytes(&self) -> usize {
        self.inner.lock().expect("retained log").bytes
    }

    pub fn is_ended(&self) -> bool {
        self.inner.lock().expect("retained log").last.is_some()
    }

    /// The last item, once the log has ended.
    pub fn last(&self) -> Option<T> {
        let g = self.inner.lock().expect("retained log");
        g.last.and_then(|_| g.items.back().cloned())
    }

    /// A reader whose first item is `from_seq` (or the oldest kept, if that
    /// one was trimmed).
    pub fn reader(self: &Arc<Self>, from_seq: u64) -> Reader<T> {
        self.inner.lock().expect("retained log").readers += 1;
        Reader { log: self.clone(), next: from_seq }
    }

    /// Takes back the items from `from_seq` on, if nobody can have seen
    /// them: no reader exists and none was ever given one of them, and the
    /// log has not ended. Returns whether it did. A reader made later
    /// starts from what is left, and the next item pushed gets `from_seq`
    /// again, so the sequence stays contiguous for everyone.
    pub fn retract_unread(&self, from_seq: u64) -> bool {
        let mut g = self.inner.lock().expect("retained log");
        if g.readers > 0 || g.delivered > from_seq || g.last.is_some() || from_seq < g.first {
            return false;
        }
        while g.next_seq() > from_seq {
            let item = g.items.pop_back().expect("items above from_seq");
            g.bytes -= (self.size)(&item);
        }
        true
    }
}

impl<T> Drop for Reader<T> {
    fn drop(&mut self) {
        let mut g = self.log.inner.lock().unwrap_or_else(|e| e.into_inner());
        g.readers -= 1;
    }
}

/// A reader of one log.
pub struct Reader<T> {
    log: Arc<RetainedLog<T>>,
    next: u64,
}

impl<T: Clone> Reader<T> {
    /// The next item and its sequence number; `None` once the last item
    /// has been returned.
    pub async fn recv(&mut self) -> Option<(u64, T)> {
        loop {
            let notified = self.log.notify.notified();
            tokio::pin!(notified);
            // Registered before the check: a push in between still wakes it.
            notified.as_mut().enable();
            {
                let mut g = self.log.inner.lock().expect("retained log");
                if let Some(item) = g.items.get(index(&mut self.next, &g)).cloned() {
                    self.next += 1;
                    g.delivered = g.delivered.max(self.next);
                    return Some((self.next - 1, item));
                }
                if g.last.is_some() {
                    return None;
                }
            }
            notified.await;
        }
    }

    /// Every item available from the position on, with the sequence number
    /// of the first; `None` once the last item has been returned.
    pub async fn recv_batch(&mut self) -> Option<(u64, Vec<T>)> {
        loop {
            let notified = self.log.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut g = self.log.inner.lock().expect("retained log");
                let start = index(&mut self.next, &g);
                if start < g.items.len() {
                    let batch: Vec<T> = g.items.range(start..).cloned().collect();
                    let first = self.next;
                    self.next += batch.len() as u64;
                    g.delivered = g.delivered.max(self.next);
                    return Some((first, batch));
                }
                if g.last.is_some() {
                    return None;
                }
            }
            notified.await;
        }
    }

    /// The sequence number the next item returned will have at the least.
    pub fn position(&self) -> u64 {
        self.next
    }
}

/// The index in `g.items` of sequence number `next`, first moving `next`
/// past trimmed items.
fn index<T>(next: &mut u64, g: &Items<T>) -> usize {
    *next = (*next).max(g.first);
    (*next - g.first) as usize
}

struct Ended<K> {
    at: Instant,
    key: K,
    bytes: usize,
}

/// Ended logs of a registry, oldest first: one leaves the queue when it is
/// older than the retention, or while the queue holds more than its byte
/// budget.
pub struct EndedQueue<K> {
    queue: VecDeque<Ended<K>>,
    bytes: usize,
    retention: Duration,
    max_bytes: usize,
}

impl<K> EndedQueue<K> {
    pub fn new(retention: Duration, max_bytes: usize) -> Self {
        EndedQueue { queue: VecDeque::new(), bytes: 0, retention, max_bytes }
    }

    /// A log ended at `at`, costing `bytes` while it is kept.
    pub fn push(&mut self, at: Instant, key: K, bytes: usize) {
        self.bytes += bytes;
        self.queue.push_back(Ended { at, key, bytes });
    }

    /// The oldest ended log, if it is past the retention at `now` or the
    /// queue is over its byte budget: it leaves the queue, and its owner
    /// drops it. Call until `None`.
    pub fn pop_expired(&mut self, now: Instant) -> Option<K> {
        let front = self.queue.front()?;
        if now.saturating_duration_since(front.at) < self.retention && self.bytes <= self.max_bytes {
            return None;
        }
        let e = self.queue.pop_front().expect("front exists");
        self.bytes -= e.bytes;
        Some(e.key)
    }

    /// Bytes of the ended logs kept.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn len(&self) -> usize {
        self.queue.len()
    }

    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn log(max_bytes: usize) -> Arc<RetainedLog<String>> {
        Arc::new(RetainedLog::with_budget(String::len, max_bytes))
    }

    #[tokio::test]
    async fn readers_from_any_seq_replay_then_follow_the_live_tail() {
        let l = log(usize::MAX);
        assert_eq!(l.push("a".into()), 0);
        let mut early = l.reader(0);
        let mut late = l.reader(1);
        let follower = tokio::spawn(async move {
            let mut got = Vec::new();
            while let Some(x) = early.recv().await {
                got.push(x);
            }
            got
        });
        assert_eq!(l.push("b".into()), 1);
        assert_eq!(late.recv().await, Some((1, "b".to_string())));
        assert_eq!(l.push_last("c".into()), 2);
        let got = follower.await.unwrap();
        assert_eq!(got, [(0, "a".into()), (1, "b".into()), (2, "c".into())]);
        assert_eq!(late.recv().await, Some((2, "c".to_string())));
        assert_eq!(late.recv().await, None);
        assert_eq!(l.range(), SeqRange { first: 0, next: 3, last: Some(2) });
        assert_eq!((l.bytes(), l.last().as_deref()), (3, Some("c")));
        // A reader past the end of an ended log gets nothing.
        assert_eq!(l.reader(7).recv().await, None);
    }

    #[tokio::test]
    async fn only_items_nobody_can_have_seen_are_retracted() {
        let l = log(usize::MAX);
        l.push("accepted".into());
        l.push("a".into());
        l.push("b".into());
        // A reader exists: nothing is taken back, whatever it read.
        let mut r = l.reader(0);
        assert!(!l.retract_unread(1));
        assert_eq!(r.recv().await, Some((0, "accepted".to_string())));
        drop(r);
        // It saw only item 0: items 1.. may go; numbering continues at 1.
        assert!(l.retract_unread(1));
        assert_eq!((l.range().next, l.bytes()), (1, 8));
        assert_eq!(l.push("c".into()), 1);
        // Once a reader was given item 1, it stays.
        let mut r = l.reader(1);
        assert_eq!(r.recv().await, Some((1, "c".to_string())));
        drop(r);
        assert!(!l.retract_unread(1));
        assert!(l.retract_unread(2), "nothing above what was seen: a no-op that is allowed");
        // An ended log is never changed.
        l.push_last("done".into());
        assert!(!l.retract_unread(2));
    }

    #[tokio::test]
    async fn the_byte_budget_trims_the_oldest_and_keeps_the_newest() {
        let l = log(5);
        l.push("aa".into());
        l.push("bb".into());
        assert_eq!(l.range().first, 0);
        l.push("cc".into());
        assert_eq!((l.range(), l.bytes()), (SeqRange { first: 1, next: 3, last: None }, 4));
        // An item larger than the budget stays alone.
        l.push_last("dddddddd".into());
        assert_eq!((l.range(), l.bytes()), (SeqRange { first: 3, next: 4, last: Some(3) }, 8));
        // A reader behind the trim skips to the oldest kept: the gap shows.
        let mut r = l.reader(0);
        assert_eq!(r.recv_batch().await, Some((3, vec!["dddddddd".to_string()])));
        assert_eq!(r.recv_batch().await, None);
        assert_eq!(r.position(), 4);
    }

    #[tokio::test]
    async fn a_batch_reader_waits_for_new_items() {
        let l = log(usize::MAX);
        let mut r = l.reader(0);
        let l2 = l.clone();
        let writer = tokio::spawn(async move {
            tokio::task::yield_now().await;
            l2.push("x".into());
        });
        assert_eq!(r.recv_batch().await, Some((0, vec!["x".to_string()])));
        writer.await.unwrap();
        // Dropping a waiting read loses nothing.
        assert!(tokio::time::timeout(Duration::from_millis(5), r.recv_batch()).await.is_err());
        l.push("y".into());
        l.push_last("z".into());
        assert_eq!(r.recv_batch().await, Some((1, vec!["y".to_string(), "z".to_string()])));
        assert_eq!(r.recv_batch().await, None);
    }

    #[test]
    fn ended_logs_leave_by_age_oldest_first() {
        let t0 = Instant::now();
        let mut q = EndedQueue::new(Duration::from_secs(10), 1000);
        q.push(t0, "a", 10);
        q.push(t0 + Duration::from_secs(5), "b", 10);
        assert_eq!(q.pop_expired(t0 + Duration::from_secs(9)), None);
        assert_eq!(q.pop_expired(t0 + Duration::from_secs(10)), Some("a"));
        assert_eq!(q.pop_expired(t0 + Duration::from_secs(10)), None);
        assert_eq!((q.len(), q.bytes()), (1, 10));
        assert_eq!(q.pop_expired(t0 + Duration::from_secs(15)), Some("b"));
        assert!(q.is_empty());
        assert_eq!(q.bytes(), 0);
    }

    #[test]
    fn ended_logs_leave_oldest_first_while_over_the_byte_budget() {
        let t0 = Instant::now();
        let mut q = EndedQueue::new(Duration::from_secs(3600), 100);
        q.push(t0, "a", 60);
        q.push(t0, "b", 40);
        // At the budget exactly: all kept.
        assert_eq!(q.pop_expired(t0), None);
        q.push(t0, "c", 30);
        assert_eq!(q.pop_expired(t0), Some("a"));
        assert_eq!(q.pop_expired(t0), None);
        assert_eq!(q.bytes(), 70);
        // One larger than the whole budget pushes everything out, itself too.
        q.push(t0, "d", 500);
        let gone: Vec<_> = std::iter::from_fn(|| q.pop_expired(t0)).collect();
        assert_eq!(gone, ["b", "c", "d"]);
    }
}
