//! Device connections: where each one is ([`Conn`], an explicit state
//! machine kept by its codec) and their numbers ([`Connections`]).
//!
//! A connection is known to rumqttd's router by its client id as sent: the
//! patched rumqttd (`patches/rumqttd/PATCHES.md`) reports a connection that
//! fails at its CONNACK, survives a dead will-map entry and never lets a
//! late "closed" report remove a newer connection of the same client id, so
//! a reconnect is a plain MQTT takeover.
//!
//! Limits per device: distinct client ids (`{device}:{instance}`) open at
//! once ([`Connections::open`]), and failed authentications per device id
//! ([`Connections::auth_allowed`], a token bucket: beyond it a CONNECT is
//! refused before its password is checked).
//!
//! Owns: connection numbers and states, the instance table, the failure
//! buckets. Does not own: packets
//! ([`super::codec`]), wills ([`super::wills`]), presence
//! ([`super::presence`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use rumqttd::protocol::{LastWill, LastWillProperties};

use super::codec::Refused;

/// An authenticated device connection.
#[derive(Debug)]
pub struct Session {
    pub device: String,
    /// This connection's number.
    pub conn: u64,
    /// The client id as sent.
    pub client_id: String,
    /// MQTT 5 Session Expiry Interval from CONNECT, seconds (0: the session
    /// ends with the connection).
    pub session_expiry: u32,
    /// The keep-alive applied instead of the client's, told to MQTT 5
    /// clients in the CONNACK.
    pub server_keep_alive: Option<u16>,
    /// The connection's will (topic mounted), until a clean DISCONNECT.
    pub will: Option<(LastWill, Option<LastWillProperties>)>,
    /// Device view of its request topic, for the expiry rewrite.
    pub request_topic: String,
}

/// Where one connection is.
#[derive(Debug)]
pub enum Conn {
    /// Nothing read yet.
    AwaitingConnect,
    /// The CONNECT was refused: rumqttd answers it with a CONNACK that
    /// carries the refusal, and closes the connection.
    Refused(Refused),
    /// An authenticated device.
    Open(Session),
    /// The codec ended the link (a DISCONNECT, a second CONNECT, a bad
    /// packet): rumqttd is about to drop it. Nothing more is read.
    Ending(Session),
}

impl Conn {
    /// The authenticated session, open or ending.
    pub fn session(&self) -> Option<&Session> {
        match self {
            Conn::Open(s) | Conn::Ending(s) => Some(s),
            _ => None,
        }
    }
}

/// Failure buckets kept at most; past it, full buckets are forgotten.
const MAX_BUCKETS: usize = 10_000;

/// What every codec shares about connections.
pub struct Connections {
    next_conn: AtomicU64,
    /// Most client ids open at once per device.
    max_instances: usize,
    /// Failed authentications per second allowed per device id (the
    /// bucket holds `5 ×` that).
    auth_failures_per_s: f64,
    /// Device → client id → its open connections (a takeover briefly has
    /// two of one client id).
    open: Mutex<HashMap<String, HashMap<String, usize>>>,
    /// Device id → (tokens, when last refilled).
    failures: Mutex<HashMap<String, (f64, Instant)>>,
}

impl Default for Connections {
    fn default() -> Self {
        Connections::new(8, 2.0)
    }
}

impl Connections {
    pub fn new(max_instances: usize, auth_failures_per_s: f64) -> Self {
        Connections {
            next_conn: AtomicU64::new(1),
            max_instances,
            auth_failures_per_s,
            open: Mutex::default(),
            failures: Mutex::default(),
        }
    }

    /// A number for a new authenticated connection.
    pub fn next_conn(&self) -> u64 {
        self.next_conn.fetch_add(1, Ordering::Relaxed)
    }

    /// Counts a connection of `client_id` of `device` open, unless that
    /// would make more than `max_instances` client ids of the device (a
    /// client id already open, a takeover, always may).
    pub fn open(&self, device: &str, client_id: &str) -> bool {
        let mut open = self.open.lock().expect("open");
        let ids = open.entry(device.to_string()).or_default();
        if !ids.contains_key(client_id) && ids.len() >= self.max_instances {
            return false;
        }
        *ids.entry(client_id.to_string()).or_insert(0) += 1;
        true
    }

    /// A connection counted by [`Connections::open`] ended.
    pub fn close(&self, device: &str, client_id: &str) {
        let mut open = self.open.lock().expect("open");
        if let Some(ids) = open.get_mut(device) {
            if let Some(n) = ids.get_mut(client_id) {
                *n -= 1;
                if *n == 0 {
                    ids.remove(client_id);
                }
            }
            if ids.is_empty() {
                open.remove(device);
            }
        }
    }

    fn capacity(&self) -> f64 {
        (self.auth_failures_per_s * 5.0).max(1.0)
    }

    /// Whether a CONNECT of `device` may be authenticated now: false while
    /// its failures are over the rate.
    pub fn auth_allowed(&self, device: &str, now: Instant) -> bool {
        let mut f = self.failures.lock().expect("failures");
        let cap = self.capacity();
        match f.get_mut(device) {
            None => true,
            Some((tokens, at)) => {
                *tokens = (*tokens + now.duration_since(*at).as_secs_f64() * self.auth_failures_per_s).min(cap);
                *at = now;
                *tokens >= 1.0
            }
        }
    }

    /// An authentication of `device` failed.
    pub fn auth_failed(&self, device: &str, now: Instant) {
        let mut f = self.failures.lock().expect("failures");
        let (cap, rate) = (self.capacity(), self.auth_failures_per_s);
        if f.len() >= MAX_BUCKETS && !f.contains_key(device) {
            // Forget the buckets that refilled: they limit nothing.
            f.retain(|_, (t, at)| *t + now.duration_since(*at).as_secs_f64() * rate < cap);
            if f.len() >= MAX_BUCKETS {
                return;
            }
        }
        let (tokens, at) = f.entry(device.to_string()).or_insert((cap, now));
        *tokens = (*tokens + now.duration_since(*at).as_secs_f64() * rate).min(cap) - 1.0;
        *at = now;
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn instances_per_device_are_limited_but_a_takeover_is_not() {
        let c = Connections::new(2, 1.0);
        assert!(c.open("d", "d:a") && c.open("d", "d:b"));
        assert!(!c.open("d", "d:c"), "a third client id");
        assert!(c.open("d", "d:a"), "a takeover of an open client id");
        assert!(c.open("e", "e"), "another device");
        c.close("d", "d:a");
        assert!(!c.open("d", "d:c"), "d:a still has a connection");
        c.close("d", "d:a");
        assert!(c.open("d", "d:c"));
    }

    #[test]
    fn failed_authentications_are_rate_limited_per_device() {
        let c = Connections::new(8, 2.0);
        let t0 = Instant::now();
        for _ in 0..10 {
            assert!(c.auth_allowed("d", t0));
            c.auth_failed("d", t0);
        }
        assert!(!c.auth_allowed("d", t0), "10 failures at once: the burst is spent");
        assert!(c.auth_allowed("e", t0), "another device is not limited");
        assert!(c.auth_allowed("d", t0 + Duration::from_secs(1)), "2 per second come back");
    }
}
