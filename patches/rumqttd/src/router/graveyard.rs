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
    /// The sessions kept per group of client ids (see [`session_group`]),
    /// oldest first, by the order they were kept in: one entry per kept
    /// session of a group, removed with it (edgeway patch 35)
    groups: HashMap<String, BTreeSet<(u64, String)>>,
    /// The order of the last session kept in a group.
    kept: u64,
}

/// The group of a client id `{group}|{rest}`: the part before its first
/// `|`; `None` without one (edgeway patch 35).
pub fn session_group(client_id: &str) -> Option<&str> {
    client_id.split_once('|').map(|(group, _)| group)
}

impl Graveyard {
    pub fn new() -> Graveyard {
        Graveyard {
            connections: HashMap::new(),
            expiries: BTreeSet::new(),
            groups: HashMap::new(),
            kept: 0,
        }
    }

    /// Add a new connection.
    /// Return tracker of previous connection if connection id already exists
    /// (a session past its expiry is not returned: it is gone, even if
    /// [`Graveyard::expire`] has not run since).
    pub fn retrieve(&mut self, id: &str) -> Option<SavedState> {
        let mut saved = self.connections.remove(id)?;
        self.forget(id, &saved);
        if saved.expires_at.is_some_and(|at| at <= Instant::now()) {
            saved.session_state = None;
        }
        Some(saved)
    }

    /// Save connection tracker. `expiry`: how long the session is kept
    /// (`None`: until the client id connects again, as for MQTT 3.1.1
    /// `cleansession = 0`). `cap`: most sessions kept in the client id's
    /// group ([`session_group`]), this one included; the oldest beyond
    /// are discarded and returned (with a cap of 0, this one). (edgeway
    /// patch: the expiry, 20; the cap, 35)
    pub fn save_state(
        &mut self,
        mut tracker: Tracker,
        subscriptions: HashSet<String>,
        metrics: ConnectionEvents,
        unacked_pubrels: VecDeque<u16>,
        expiry: Option<Duration>,
        cap: Option<usize>,
    ) -> Vec<(String, SessionState)> {
        tracker.pause(PauseReason::Busy);
        let id = tracker.id.clone();

        let session_state = SessionState {
            tracker,
            subscriptions,
            unacked_pubrels,
        };
        let group = session_group(&id).map(str::to_owned);
        let cap = group.as_ref().and(cap);
        if cap == Some(0) {
            self.save_metrics(id.clone(), metrics);
            return vec![(id, session_state)];
        }

        // A deadline too far to represent never comes.
        let expires_at = expiry.and_then(|e| Instant::now().checked_add(e));
        if let Some(at) = expires_at {
            self.expiries.insert((at, id.clone()));
        }
        let kept = group.as_ref().map(|_| {
            self.kept += 1;
            self.kept
        });
        let saved = SavedState {
            session_state: Some(session_state),
            metrics,
            expires_at,
            kept,
        };
        if let Some(old) = self.connections.insert(id.clone(), saved) {
            self.forget(&id, &old);
        }
        let mut discarded = Vec::new();
        if let (Some(group), Some(kept)) = (group, kept) {
            let sessions = self.groups.entry(group.clone()).or_default();
            sessions.insert((kept, id));
            let cap = cap.unwrap_or(usize::MAX);
            let mut oldest = Vec::new();
            while sessions.len() > cap {
                oldest.extend(sessions.pop_first().map(|(_, id)| id));
            }
            for id in oldest {
                if let Some(saved) = self.connections.remove(&id) {
                    self.forget(&id, &saved);
                    discarded.extend(saved.session_state.map(|s| (id, s)));
                }
            }
        }
        discarded
    }

    /// Drops the expiry entry (edgeway patch 34) and the group entry
    /// (patch 35) of `saved`, the state of `id` just taken out or replaced.
    fn forget(&mut self, id: &str, saved: &SavedState) {
        if let Some(at) = saved.expires_at {
            self.expiries.remove(&(at, id.to_string()));
        }
        if let (Some(kept), Some(group)) = (saved.kept, session_group(id)) {
            if let Some(sessions) = self.groups.get_mut(group) {
                sessions.remove(&(kept, id.to_string()));
                if sessions.is_empty() {
                    self.groups.remove(group);
                }
            }
        }
    }

    /// Save only metrics for connection
    pub fn save_metrics(&mut self, id: String, metrics: ConnectionEvents) {
        let saved = SavedState {
            session_state: None,
            metrics,
            expires_at: None,
            kept: None,
        };
        if let Some(old) = self.connections.insert(id.clone(), saved) {
            self.forget(&id, &old);
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
                if let Some(saved) = self.connections.remove(&id) {
                    self.forget(&id, &saved);
                }
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
    /// Its order in its group's kept sessions (edgeway patch 35).
    pub kept: Option<u64>,
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
                None,
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
                None,
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
            None,
        );
        assert!(g.retrieve("x").unwrap().session_state.is_none());
    }

    /// Edgeway patch 35: at most `cap` kept sessions per group, the oldest
    /// discarded first; other groups and ids without a group untouched;
    /// a session taken back no longer counts.
    #[test]
    fn a_group_keeps_at_most_its_cap_oldest_discarded_first() {
        let mut g = Graveyard::new();
        let save = |g: &mut Graveyard, id: &str| {
            g.save_state(
                Tracker::new(id.to_string()),
                HashSet::new(),
                ConnectionEvents::default(),
                VecDeque::new(),
                Some(Duration::from_secs(60)),
                Some(2),
            )
            .into_iter()
            .map(|(id, _)| id)
            .collect::<Vec<_>>()
        };
        assert!(save(&mut g, "d1|a").is_empty());
        assert!(save(&mut g, "d2|a").is_empty());
        assert!(save(&mut g, "d1|b").is_empty());
        assert!(save(&mut g, "plain").is_empty());
        assert_eq!(save(&mut g, "d1|c"), ["d1|a"]);
        assert!(g.retrieve("d1|a").is_none(), "discarded");
        assert!(g.retrieve("d1|b").is_some(), "taken back: no longer counted");
        assert!(save(&mut g, "d1|d").is_empty());
        assert_eq!(save(&mut g, "d1|e"), ["d1|c"]);
        assert!(g.retrieve("d2|a").is_some() && g.retrieve("plain").is_some());
        let none = g.save_state(
            Tracker::new("d3|a".to_string()),
            HashSet::new(),
            ConnectionEvents::default(),
            VecDeque::new(),
            None,
            Some(0),
        );
        assert_eq!(none.len(), 1, "a cap of 0 keeps nothing");
        assert!(g.retrieve("d3|a").unwrap().session_state.is_none());
    }
}
