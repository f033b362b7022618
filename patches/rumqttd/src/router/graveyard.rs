use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use super::{
    scheduler::{PauseReason, Tracker},
    ConnectionEvents,
};

pub struct Graveyard {
    connections: HashMap<String, SavedState>,
    /// When saved sessions expire, soonest first: one entry per session
    /// kept for a time, removed when the session is taken back or
    /// replaced, so reconnects do not pile them up (edgeway patches 20
    /// and 34, see PATCHES.md)
    expiries: BTreeSet<(Instant, String)>,
}

impl Graveyard {
    pub fn new() -> Graveyard {
        Graveyard {
            connections: HashMap::new(),
            expiries: BTreeSet::new(),
        }
    }

    /// Add a new connection.
    /// Return tracker of previous connection if connection id already exists
    /// (a session past its expiry is not returned: it is gone, even if
    /// [`Graveyard::expire`] has not run since).
    pub fn retrieve(&mut self, id: &str) -> Option<SavedState> {
        let mut saved = self.connections.remove(id)?;
        self.forget_expiry(id, &saved);
        if saved.expires_at.is_some_and(|at| at <= Instant::now()) {
            saved.session_state = None;
        }
        Some(saved)
    }

    /// Save connection tracker. `expiry`: how long the session is kept
    /// (`None`: until the client id connects again, as for MQTT 3.1.1
    /// `cleansession = 0`). (edgeway patch: the expiry)
    pub fn save_state(
        &mut self,
        mut tracker: Tracker,
        subscriptions: HashSet<String>,
        metrics: ConnectionEvents,
        unacked_pubrels: VecDeque<u16>,
        expiry: Option<Duration>,
    ) {
        tracker.pause(PauseReason::Busy);
        let id = tracker.id.clone();

        let session_state = SessionState {
            tracker,
            subscriptions,
            unacked_pubrels,
        };

        // A deadline too far to represent never comes.
        let expires_at = expiry.and_then(|e| Instant::now().checked_add(e));
        if let Some(at) = expires_at {
            self.expiries.insert((at, id.clone()));
        }
        let saved = SavedState {
            session_state: Some(session_state),
            metrics,
            expires_at,
        };
        if let Some(old) = self.connections.insert(id.clone(), saved) {
            self.forget_expiry(&id, &old);
        }
    }

    /// Drops the expiry entry of `saved`, the state of `id` just taken out
    /// or replaced (edgeway patch 34).
    fn forget_expiry(&mut self, id: &str, saved: &SavedState) {
        if let Some(at) = saved.expires_at {
            self.expiries.remove(&(at, id.to_string()));
        }
    }

    /// Save only metrics for connection
    pub fn save_metrics(&mut self, id: String, metrics: ConnectionEvents) {
        let saved = SavedState {
            session_state: None,
            metrics,
            expires_at: None,
        };
        if let Some(old) = self.connections.insert(id.clone(), saved) {
            self.forget_expiry(&id, &old);
        }
    }

    /// The next session expiry, if any session is kept for a time.
    pub fn next_expiry(&self) -> Option<Instant> {
        self.expiries.first().map(|(at, _)| *at)
    }

    /// Removes the sessions whose expiry is `now` or past (their
    /// subscriptions, cursors into the filter logs and packet ids awaiting
    /// PUBCOMP): the client id starts afresh. Returns the client ids.
    pub fn expire(&mut self, now: Instant) -> Vec<String> {
        let mut gone = Vec::new();
        while let Some((at, _)) = self.expiries.first() {
            if *at > now {
                break;
            }
            let Some((at, id)) = self.expiries.pop_first() else {
                break;
            };
            // Only if it is still the session saved with this deadline.
            if self
                .connections
                .get(&id)
                .is_some_and(|s| s.expires_at == Some(at))
            {
                self.connections.remove(&id);
                gone.push(id);
            }
        }
        gone
    }

    /// Sessions (and metrics-only entries) kept.
    pub fn len(&self) -> usize {
        self.connections.len()
    }

    /// Expiry entries held: at most one per session kept for a time
    /// (edgeway patch 34).
    #[cfg(test)]
    pub fn expiries_len(&self) -> usize {
        self.expiries.len()
    }
}

#[derive(Debug)]
pub struct SavedState {
    pub session_state: Option<SessionState>,
    pub metrics: ConnectionEvents,
    /// When the session ends (`None`: it does not end by itself).
    pub expires_at: Option<Instant>,
}

#[derive(Debug)]
pub struct SessionState {
    pub tracker: Tracker,
    pub subscriptions: HashSet<String>,
    // used for pubrel in qos2
    pub unacked_pubrels: VecDeque<u16>,
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn a_session_is_removed_at_its_expiry_and_not_before() {
        let mut g = Graveyard::new();
        let t0 = Instant::now();
        let save = |g: &mut Graveyard, id: &str, expiry| {
            g.save_state(
                Tracker::new(id.to_string()),
                HashSet::from(["a/b".to_string()]),
                ConnectionEvents::default(),
                VecDeque::new(),
                expiry,
            )
        };
        save(&mut g, "short", Some(Duration::from_secs(5)));
        save(&mut g, "long", Some(Duration::from_secs(50)));
        save(&mut g, "forever", None);
        assert!(g.expire(t0).is_empty());
        assert_eq!(g.expire(t0 + Duration::from_secs(6)), vec!["short".to_string()]);
        // Taken back and saved again with a longer expiry: the old deadline
        // does not remove it.
        assert!(g.retrieve("long").unwrap().session_state.is_some());
        save(&mut g, "long", Some(Duration::from_secs(500)));
        assert!(g.expire(t0 + Duration::from_secs(60)).is_empty());
        assert_eq!(g.expire(t0 + Duration::from_secs(501)), vec!["long".to_string()]);
        assert_eq!(g.len(), 1, "the 3.1.1 session stays");
        assert!(g.next_expiry().is_none());
    }

    #[test]
    fn reconnects_of_a_kept_session_leave_one_expiry_entry() {
        let mut g = Graveyard::new();
        for _ in 0..1000 {
            let _ = g.retrieve("k");
            g.save_state(
                Tracker::new("k".to_string()),
                HashSet::new(),
                ConnectionEvents::default(),
                VecDeque::new(),
                Some(Duration::from_secs(u32::MAX as u64 - 1)),
            );
        }
        assert_eq!(g.expiries_len(), 1);
        let _ = g.retrieve("k");
        assert_eq!(g.expiries_len(), 0);
    }

    #[test]
    fn a_session_past_its_expiry_is_not_restored_before_the_sweep() {
        let mut g = Graveyard::new();
        g.save_state(
            Tracker::new("x".to_string()),
            HashSet::new(),
            ConnectionEvents::default(),
            VecDeque::new(),
            Some(Duration::ZERO),
        );
        assert!(g.retrieve("x").unwrap().session_state.is_none());
    }
}
