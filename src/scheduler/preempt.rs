//! The handshake by which a running task gives up its slot to a P0 task.
//!
//! Owns: the request (from the scheduler's actor) and its wake-up of the
//! task's driver. The driver decides: it gives the slot up while no
//! output of the attempt has gone out, or when the output it produced can
//! be taken back because nobody can have seen it (no reader of the task's
//! log exists and none was given any of it: a detached task nobody is
//! streaming; see `RetainedLog::retract_unread`). Otherwise it declines
//! and runs to its end. Does not own: which task is asked (the policy's
//! `preemption_victims`) or what the driver does once preempted (re-queues
//! itself at the front of its priority).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use tokio::sync::Notify;

/// Shared by a task's driver and the scheduler's actor.
#[derive(Default)]
pub struct Preempt {
    wanted: AtomicBool,
    notify: Notify,
    /// The P0 task the slot is asked for, for the record.
    by: Mutex<Option<String>>,
}

impl Preempt {
    /// Asks the task to give up its slot for task `by`. False when it was
    /// asked already and has not answered.
    pub fn request(&self, by: &str) -> bool {
        let mut who = self.by.lock().unwrap_or_else(|e| e.into_inner());
        if self.wanted.swap(true, Ordering::AcqRel) {
            return false;
        }
        *who = Some(by.to_string());
        self.notify.notify_one();
        true
    }

    pub fn is_wanted(&self) -> bool {
        self.wanted.load(Ordering::Acquire)
    }

    /// Resolves once the task is asked to give up its slot.
    ///
    /// # Cancel safety
    /// Cancel safe: the flag, not the wake-up, says whether it happened.
    pub async fn wanted(&self) {
        loop {
            let notified = self.notify.notified();
            if self.is_wanted() {
                return;
            }
            notified.await;
        }
    }

    /// The task the slot is asked for.
    pub fn by(&self) -> Option<String> {
        self.by.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The request is answered (the task re-queued, or declined): a later
    /// one may come.
    pub fn reset(&self) {
        let mut who = self.by.lock().unwrap_or_else(|e| e.into_inner());
        *who = None;
        self.wanted.store(false, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_request_at_a_time_until_answered() {
        let p = Preempt::default();
        assert!(p.request("p0"));
        assert!(!p.request("other"), "asked once until answered");
        assert_eq!(p.by().as_deref(), Some("p0"));
        p.reset();
        assert!(!p.is_wanted());
        assert!(p.request("other"));
    }

    #[tokio::test]
    async fn a_request_before_the_wait_is_not_missed() {
        let p = Preempt::default();
        assert!(p.request("p0"));
        tokio::time::timeout(std::time::Duration::from_secs(1), p.wanted()).await.unwrap();
    }
}
