//! The handshake by which a running task gives up its slot to a P0 task.
//!
//! Owns: the one atomic decision between "the task's first output goes
//! out" and "the task is preempted": whichever happens first wins, so a
//! client never sees output of an attempt that is then run again. Does not
//! own: which task is asked (the policy's `preemption_victims`) or what
//! the driver does once preempted (re-queues itself).

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Mutex;

use tokio::sync::Notify;

/// No output of the current attempt has gone out: it may be preempted.
const RESTARTABLE: u8 = 0;
/// Output went out: the task runs to its end.
const COMMITTED: u8 = 1;
/// Preempted: the driver stops the attempt and re-queues.
const PREEMPTED: u8 = 2;

/// Shared by a task's driver and the scheduler's actor.
#[derive(Default)]
pub struct Preempt {
    state: AtomicU8,
    notify: Notify,
    /// The P0 task the slot is given to, for the record.
    by: Mutex<Option<String>>,
}

impl Preempt {
    /// Asks the task to give up its slot for task `by`. True when it will
    /// (no output has gone out); false when it is too late.
    pub fn request(&self, by: &str) -> bool {
        if self.state.compare_exchange(RESTARTABLE, PREEMPTED, Ordering::AcqRel, Ordering::Acquire).is_ok() {
            *self.by.lock().unwrap_or_else(|e| e.into_inner()) = Some(by.to_string());
            self.notify.notify_one();
            true
        } else {
            false
        }
    }

    /// Called by the driver before its first output goes out: true when it
    /// may go (from now on the task is not preemptible), false when the
    /// task was preempted first.
    pub fn commit(&self) -> bool {
        match self.state.compare_exchange(RESTARTABLE, COMMITTED, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => true,
            Err(s) => s == COMMITTED,
        }
    }

    pub fn is_preempted(&self) -> bool {
        self.state.load(Ordering::Acquire) == PREEMPTED
    }

    /// Resolves once the task is preempted.
    ///
    /// # Cancel safety
    /// Cancel safe: the state, not the wake-up, says whether it happened.
    pub async fn preempted(&self) {
        loop {
            let notified = self.notify.notified();
            if self.is_preempted() {
                return;
            }
            notified.await;
        }
    }

    /// The task that took the slot, once preempted.
    pub fn by(&self) -> Option<String> {
        self.by.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// A re-queued task starts over: restartable again.
    pub fn reset(&self) {
        self.state.store(RESTARTABLE, Ordering::Release);
        *self.by.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_and_preemption_exclude_each_other() {
        let p = Preempt::default();
        assert!(p.commit());
        assert!(!p.request("p0"), "too late once output went out");
        assert!(p.commit(), "committed stays committed");

        let p = Preempt::default();
        assert!(p.request("p0"));
        assert!(!p.commit(), "a preempted attempt sends nothing");
        assert_eq!(p.by().as_deref(), Some("p0"));
        assert!(!p.request("other"), "asked once");
        p.reset();
        assert!(p.commit());
    }

    #[tokio::test]
    async fn a_preemption_before_the_wait_is_not_missed() {
        let p = Preempt::default();
        assert!(p.request("p0"));
        tokio::time::timeout(std::time::Duration::from_secs(1), p.preempted()).await.unwrap();
    }
}
