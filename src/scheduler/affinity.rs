//! KV-cache affinity (issue 12): a session's next turn goes to the
//! instance, and on a llama-server with `slot_affinity` the slot, that
//! served its previous turn, so the engine reuses the cached prefix and
//! the turn pays only for its new tokens.
//!
//! Affinity never outranks priority or load: the policy first chooses the
//! task to start (priority, fairness) and the instance the router would
//! pick; only then is the session's instance taken instead, and only when
//! it has a free slot, the task may run there, and it is no more loaded
//! than the router's pick. Within an instance the session's slot is taken
//! when it is free, else the lowest free one. A busy instance or slot means
//! the normal choice, never a wait.
//!
//! Slots: on an instance with `slot_affinity`, edgeway numbers the slots
//! (0..max_concurrency, which must equal llama-server's `--parallel`) and
//! gives every task one, sent as `id_slot` with `cache_prompt: true`, so
//! that its count of free slots is the engine's.
//!
//! Owns: which session last ran where, which slots are taken, the
//! preference. Does not own: slot accounting of the instance as a whole
//! (`super::policy`), the instance ranking (`crate::router::pick`) or the
//! request fields (`crate::engine::openai`).

use std::collections::HashMap;

/// Sessions remembered; past it the oldest half is forgotten (a forgotten
/// session's next turn is placed as any task: correct, only colder).
const MAX_REMEMBERED: usize = 100_000;

#[derive(Debug, Default)]
pub struct Affinity {
    /// Per instance, its slots when it has slot affinity (taken or not).
    slots: Vec<Option<Vec<bool>>>,
    /// Session → (instance, slot) of its last turn, with an age.
    last: HashMap<String, (usize, Option<u32>, u64)>,
    /// Running task → (instance, slot) it holds.
    held: HashMap<String, (usize, Option<u32>)>,
    tick: u64,
}

impl Affinity {
    /// `slots[i]`: instance `i`'s slot count when it has slot affinity.
    pub fn new(slots: impl IntoIterator<Item = Option<usize>>) -> Affinity {
        Affinity { slots: slots.into_iter().map(|n| n.map(|n| vec![false; n])).collect(), ..Default::default() }
    }

    /// An instance a reload added, after the others.
    pub fn add(&mut self, slots: Option<usize>) {
        self.slots.push(slots.map(|n| vec![false; n]));
    }

    /// The instance to run a task of `session` on instead of `picked`,
    /// when its last turn ran elsewhere and `usable` (free slot, the task
    /// may run there, no more loaded than `picked`) says that one will do.
    pub fn prefer(&self, session: Option<&str>, picked: usize, usable: impl Fn(usize) -> bool) -> Option<usize> {
        let (i, _, _) = *self.last.get(session?)?;
        (i != picked && usable(i)).then_some(i)
    }

    /// Records that `task_id` (of `session`, if any) starts on `instance`:
    /// the slot it takes there (`None` without slot affinity).
    pub fn start(&mut self, task_id: &str, session: Option<&str>, instance: usize) -> Option<u32> {
        let slot = self.slots.get_mut(instance).and_then(Option::as_mut).and_then(|slots| {
            let wanted = session
                .and_then(|s| self.last.get(s))
                .filter(|(i, _, _)| *i == instance)
                .and_then(|(_, s, _)| *s)
                .filter(|&s| slots.get(s as usize) == Some(&false));
            let s = wanted.or_else(|| slots.iter().position(|taken| !taken).map(|s| s as u32))?;
            slots[s as usize] = true;
            Some(s)
        });
        self.held.insert(task_id.to_string(), (instance, slot));
        if let Some(s) = session {
            self.tick += 1;
            self.last.insert(s.to_string(), (instance, slot, self.tick));
            if self.last.len() > MAX_REMEMBERED {
                let mut ages: Vec<u64> = self.last.values().map(|v| v.2).collect();
                ages.sort_unstable();
                let cut = ages[ages.len() / 2];
                self.last.retain(|_, v| v.2 > cut);
            }
        }
        slot
    }

    /// `task_id` gave its slot back.
    pub fn end(&mut self, task_id: &str) {
        if let Some((i, Some(s))) = self.held.remove(task_id) {
            if let Some(Some(slots)) = self.slots.get_mut(i) {
                slots[s as usize] = false;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_returns_to_its_instance_and_slot_when_free() {
        let mut a = Affinity::new([Some(2), Some(2)]);
        assert_eq!(a.prefer(Some("s"), 0, |_| true), None, "nothing known yet");
        assert_eq!(a.start("other", None, 1), Some(0));
        assert_eq!(a.start("t1", Some("s"), 1), Some(1));
        a.end("t1");
        // The next turn: instance 1 when usable, slot 1 again.
        assert_eq!(a.prefer(Some("s"), 0, |_| true), Some(1));
        assert_eq!(a.prefer(Some("s"), 0, |_| false), None, "busy or more loaded: the normal choice");
        assert_eq!(a.prefer(Some("s"), 1, |_| true), None, "already there");
        assert_eq!(a.start("t2", Some("s"), 1), Some(1));
        a.end("t2");
        // Its slot taken meanwhile: another free one.
        a.end("other");
        assert_eq!(a.start("x", None, 1), Some(0));
        assert_eq!(a.start("y", None, 1), Some(1));
        a.end("x");
        assert_eq!(a.start("t3", Some("s"), 1), Some(0));
        // Without slot affinity: no slot.
        let mut b = Affinity::new([None]);
        assert_eq!(b.start("t", Some("s"), 0), None);
        b.end("t");
    }
}
