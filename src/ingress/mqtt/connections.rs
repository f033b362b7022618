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
//! and per source IP address ([`Connections::auth_allowed`], token
//! buckets: beyond either a CONNECT is refused before its password is
//! checked; the per-address one, by /64 for IPv6, slows an attacker who
//! rotates device ids).
//!
//! What a device leaves in rumqttd's router ([`DeviceQuotas`]): retained
//! messages (count and bytes), and topic names and filters (the router
//! caches every topic published and keeps a log per filter subscribed, for
//! as long as it runs). The codec asks before a PUBLISH or SUBSCRIBE
//! reaches the router and refuses one over a limit with a reason code.
//!
//! Owns: connection numbers and states, the instance table, the failure
//! buckets, the per-device quotas. Does not own: packets
//! ([`super::codec`]), wills ([`super::wills`]), presence
//! ([`super::presence`]).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::hash::{BuildHasher, Hash, RandomState};
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rumqttd::protocol::{LastWill, LastWillProperties};

use super::codec::Refused;

/// An authenticated device connection.
#[derive(Debug)]
pub struct Session {
    pub device: String,
    /// This connection's number.
    pub conn: u64,
    /// The router's client id, `{tenant}:{device}|{client id as sent}`
    /// ([`super::topics::router_client_id`]): what the router, the
    /// instance count, the session filters and the wills know it by.
    pub client_id: String,
    /// MQTT 5 Session Expiry Interval from CONNECT, or from DISCONNECT if
    /// it changed it, seconds (0: the session ends with the connection; 0
    /// for 3.1.1).
    pub session_expiry: u32,
    /// An MQTT 5 connection.
    pub v5: bool,
    /// Clean Start (5) or clean session (3.1.1) in CONNECT.
    pub clean: bool,
    /// The keep-alive applied instead of the client's, told to MQTT 5
    /// clients in the CONNACK.
    pub server_keep_alive: Option<u16>,
    /// The Session Expiry Interval the server applies instead of the
    /// client's longer one (`mqtt.max_session_expiry_s`), told in CONNACK.
    pub server_session_expiry: Option<u32>,
    /// The connection's will (topic mounted), until a clean DISCONNECT.
    pub will: Option<(LastWill, Option<LastWillProperties>)>,
    /// Device view of its request topic, for the expiry rewrite.
    pub request_topic: String,
}

impl Session {
    /// How long the session outlives the connection now.
    pub fn lifetime(&self) -> Lifetime {
        Lifetime::of(self.v5, self.clean, self.session_expiry)
    }
}

/// How long the broker keeps a session after its connection ends (patched
/// rumqttd's `Connection::session_expiry`, which this mirrors): MQTT 5 by
/// its Session Expiry Interval, whatever Clean Start says; MQTT 3.1.1 for
/// good unless `cleansession = 1`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lifetime {
    EndsWithConnection,
    For(Duration),
    /// 3.1.1 `cleansession = 0`, or MQTT 5 expiry 0xFFFFFFFF.
    Forever,
}

impl Lifetime {
    pub fn of(v5: bool, clean: bool, session_expiry: u32) -> Lifetime {
        match (v5, clean, session_expiry) {
            (false, true, _) | (true, _, 0) => Lifetime::EndsWithConnection,
            (false, false, _) | (true, _, u32::MAX) => Lifetime::Forever,
            (true, _, s) => Lifetime::For(Duration::from_secs(s.into())),
        }
    }
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

/// Failure buckets kept at most; past it, the least recently used goes.
const MAX_BUCKETS: usize = 10_000;

/// What every codec shares about connections.
pub struct Connections {
    next_conn: AtomicU64,
    /// Most client ids open at once per device.
    max_instances: usize,
    /// Device → client id → its open connections (a takeover briefly has
    /// two of one client id).
    open: Mutex<HashMap<String, HashMap<String, usize>>>,
    /// Failed authentications per device id.
    failures: Buckets<String>,
    /// Failed authentications per source address.
    ip_failures: Buckets<IpAddr>,
}

impl Default for Connections {
    fn default() -> Self {
        Connections::new(8, 2.0, 10.0)
    }
}

impl Connections {
    /// `auth_failures_per_s` per device id, `per_ip_per_s` per source
    /// address (each bucket holds `5 ×` its rate).
    pub fn new(max_instances: usize, auth_failures_per_s: f64, per_ip_per_s: f64) -> Self {
        Connections {
            next_conn: AtomicU64::new(1),
            max_instances,
            open: Mutex::default(),
            failures: Buckets::new(auth_failures_per_s),
            ip_failures: Buckets::new(per_ip_per_s),
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

    /// How many devices have a connection open (all tenants), and up to
    /// `max` ids of those of `tenant`, sorted (the status page). Devices
    /// are counted by their mount, `{tenant}/{device}`.
    pub fn devices(&self, tenant: &str, max: usize) -> (usize, Vec<String>) {
        let open = self.open.lock().expect("open");
        // The tenant's part of a device's mount name: the tenant as it is,
        // or its digest where it is not plain (review 15 L3).
        let prefix = super::topics::mount_name(tenant, "");
        let mut ids: Vec<String> = open.keys().filter_map(|m| m.strip_prefix(&prefix)).map(str::to_string).collect();
        ids.sort_unstable();
        ids.truncate(max);
        (open.len(), ids)
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

    /// Whether a CONNECT of `device` (when the client id names one) from
    /// `peer` (when known) may be authenticated now: false while the
    /// failures of either are over their rate.
    pub fn auth_allowed(&self, device: Option<&str>, peer: Option<IpAddr>, now: Instant) -> bool {
        device.is_none_or(|d| self.failures.allowed(&d.to_string(), now))
            && peer.is_none_or(|ip| self.ip_failures.allowed(&address_key(ip), now))
    }

    /// An authentication of `device` from `peer` failed.
    pub fn auth_failed(&self, device: Option<&str>, peer: Option<IpAddr>, now: Instant) {
        if let Some(d) = device {
            self.failures.failed(&d.to_string(), now);
        }
        if let Some(ip) = peer {
            self.ip_failures.failed(&address_key(ip), now);
        }
    }
}

/// Token buckets of failures per key, at most [`MAX_BUCKETS`] of them: a
/// new key in a full table takes the place of the least recently used one
/// (O(log n); a full table never stops tracking new keys).
struct Buckets<K> {
    /// Failures per second allowed (the bucket holds `5 ×` that).
    rate: f64,
    map: Mutex<BucketMap<K>>,
}

struct BucketMap<K> {
    /// Key → (tokens, when last refilled, its stamp in `by_use`).
    buckets: HashMap<K, (f64, Instant, u64)>,
    /// Stamp of last use → key, oldest first.
    by_use: BTreeMap<u64, K>,
    next_stamp: u64,
}

impl<K> Default for BucketMap<K> {
    fn default() -> Self {
        BucketMap { buckets: HashMap::new(), by_use: BTreeMap::new(), next_stamp: 0 }
    }
}

#[cfg(test)]
impl<K: Hash + Eq> BucketMap<K> {
    fn len(&self) -> usize {
        self.buckets.len()
    }

    fn contains_key(&self, key: &K) -> bool {
        self.buckets.contains_key(key)
    }
}

impl<K: Hash + Eq + Clone> Buckets<K> {
    fn new(rate: f64) -> Self {
        Buckets { rate, map: Mutex::default() }
    }

    fn capacity(&self) -> f64 {
        (self.rate * 5.0).max(1.0)
    }

    fn allowed(&self, key: &K, now: Instant) -> bool {
        let mut f = self.map.lock().expect("failures");
        let cap = self.capacity();
        match f.buckets.get_mut(key) {
            None => true,
            Some((tokens, at, _)) => {
                *tokens = (*tokens + now.duration_since(*at).as_secs_f64() * self.rate).min(cap);
                *at = now;
                *tokens >= 1.0
            }
        }
    }

    fn failed(&self, key: &K, now: Instant) {
        let mut guard = self.map.lock().expect("failures");
        let f = &mut *guard;
        let (cap, rate) = (self.capacity(), self.rate);
        let stamp = f.next_stamp;
        f.next_stamp += 1;
        if !f.buckets.contains_key(key) && f.buckets.len() >= MAX_BUCKETS {
            if let Some((_, oldest)) = f.by_use.pop_first() {
                f.buckets.remove(&oldest);
            }
        }
        let (tokens, at, used) = f.buckets.entry(key.clone()).or_insert((cap, now, stamp));
        if *used != stamp {
            f.by_use.remove(used);
        }
        *tokens = (*tokens + now.duration_since(*at).as_secs_f64() * rate).min(cap) - 1.0;
        *at = now;
        *used = stamp;
        f.by_use.insert(stamp, key.clone());
    }
}

/// The key of a source address for the failed-login limit: an IPv6 address
/// by its /64 (one subscriber's prefix; rotating addresses within it is
/// free), an IPv4 address as it is.
fn address_key(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => IpAddr::V6((u128::from(v6) & !u128::from(u64::MAX)).into()),
        v4 => v4,
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_devices_of_a_tenant_whose_name_is_not_plain_are_listed() {
        let c = Connections::new(4, 10.0, 10.0);
        for (tenant, device) in [("Acme Corp", "d1"), ("demo", "d2"), ("Acme Corp", "d3")] {
            assert!(c.open(&super::super::topics::mount_name(tenant, device), "c"));
        }
        assert_eq!(c.devices("Acme Corp", 10), (3, vec!["d1".to_string(), "d3".to_string()]));
        assert_eq!(c.devices("demo", 10), (3, vec!["d2".to_string()]));
    }

    use std::time::Duration;

    use super::*;

    #[test]
    fn instances_per_device_are_limited_but_a_takeover_is_not() {
        let c = Connections::new(2, 1.0, 1.0);
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
        let c = Connections::new(8, 2.0, 1000.0);
        let t0 = Instant::now();
        for _ in 0..10 {
            assert!(c.auth_allowed(Some("d"), None, t0));
            c.auth_failed(Some("d"), None, t0);
        }
        assert!(!c.auth_allowed(Some("d"), None, t0), "10 failures at once: the burst is spent");
        assert!(c.auth_allowed(Some("e"), None, t0), "another device is not limited");
        assert!(c.auth_allowed(Some("d"), None, t0 + Duration::from_secs(1)), "2 per second come back");
    }

    #[test]
    fn failed_authentications_are_rate_limited_per_address_whatever_the_device() {
        let c = Connections::new(8, 1000.0, 2.0);
        let (a, b): (IpAddr, IpAddr) = ("127.0.0.1".parse().unwrap(), "127.0.0.2".parse().unwrap());
        let t0 = Instant::now();
        for i in 0..10 {
            let d = format!("d{i}");
            assert!(c.auth_allowed(Some(&d), Some(a), t0));
            c.auth_failed(Some(&d), Some(a), t0);
        }
        assert!(!c.auth_allowed(Some("fresh"), Some(a), t0), "a fresh device id from the same address");
        assert!(!c.auth_allowed(None, Some(a), t0), "no device id at all");
        assert!(c.auth_allowed(Some("fresh"), Some(b), t0), "another address");
        assert!(c.auth_allowed(Some("fresh"), Some(a), t0 + Duration::from_secs(1)), "2 per second come back");
    }

    #[test]
    fn failure_buckets_are_bounded_and_the_oldest_goes_first() {
        let b: Buckets<IpAddr> = Buckets::new(1.0);
        let t0 = Instant::now();
        for i in 0..(MAX_BUCKETS as u32 + 100) {
            b.failed(&IpAddr::from(i.to_be_bytes()), t0);
        }
        assert_eq!(b.map.lock().unwrap().len(), MAX_BUCKETS);
        // A full table still tracks a new address (before: not tracked at
        // all, so it was never limited): the least recently used goes.
        let fresh = IpAddr::from([10, 0, 0, 1]);
        for _ in 0..5 {
            assert!(b.allowed(&fresh, t0));
            b.failed(&fresh, t0);
        }
        assert!(!b.allowed(&fresh, t0), "a new address is limited in a full table");
        assert_eq!(b.map.lock().unwrap().len(), MAX_BUCKETS);
        assert!(b.map.lock().unwrap().contains_key(&IpAddr::from((MAX_BUCKETS as u32 + 99).to_be_bytes())));
        assert!(!b.map.lock().unwrap().contains_key(&IpAddr::from(100u32.to_be_bytes())), "the oldest went");
    }

    #[test]
    fn failed_authentications_are_limited_per_ipv6_64_prefix() {
        let c = Connections::new(8, 1000.0, 2.0);
        let t0 = Instant::now();
        let ip = |last: u16| IpAddr::from([0x2001, 0xdb8, 0, 1, 0xdead, 0xbeef, 0, last]);
        for i in 0..10 {
            assert!(c.auth_allowed(None, Some(ip(i)), t0));
            c.auth_failed(None, Some(ip(i)), t0);
        }
        assert!(!c.auth_allowed(None, Some(ip(999)), t0), "another address of the same /64");
        let other = IpAddr::from([0x2001, 0xdb8, 0, 2, 0, 0, 0, 1]);
        assert!(c.auth_allowed(None, Some(other), t0), "another /64");
    }
}

/// The filters each client id holds in the router, counted against
/// `max_subscriptions_per_connection`. Kept per client id, not per
/// connection, because the router restores the subscriptions of a session
/// resumed with Clean Start 0; kept as long as the router keeps the session
/// ([`Lifetime`]: MQTT 5 until its expiry after the connection, 3.1.1
/// `cleansession = 0` for good, and at most `max_kept_sessions_per_device`
/// per device, the oldest forgotten first, as the router discards them). A
/// clean start, the end of a session that ends with its connection, or the
/// expiry forgets them, as the router does.
pub struct SessionFilters {
    inner: Mutex<HeldSessions>,
    /// `mqtt.max_kept_sessions_per_device`.
    cap: usize,
}

impl Default for SessionFilters {
    fn default() -> Self {
        SessionFilters::new(usize::MAX)
    }
}

#[derive(Default)]
struct HeldSessions {
    /// By the router's client id.
    held: HashMap<String, Held>,
    /// The kept sessions (connection ended) per device (the router's
    /// client id up to its `|`), oldest first: the router's order.
    kept: HashMap<String, BTreeSet<(u64, String)>>,
    /// The order of the last session kept.
    seq: u64,
}

impl HeldSessions {
    /// Removes `client_id`'s session.
    fn forget(&mut self, client_id: &str) {
        if let Some(h) = self.held.remove(client_id) {
            self.unkeep(client_id, h.kept);
        }
    }

    /// Takes `client_id`'s kept entry (of order `kept`) out of its device's.
    fn unkeep(&mut self, client_id: &str, kept: Option<u64>) {
        let (Some(seq), Some((device, _))) = (kept, client_id.split_once('|')) else { return };
        if let Some(k) = self.kept.get_mut(device) {
            k.remove(&(seq, client_id.to_string()));
            if k.is_empty() {
                self.kept.remove(device);
            }
        }
    }
}

/// What one client id holds.
struct Held {
    /// The connection that holds them now (a takeover hands them on).
    conn: u64,
    /// How long the session outlives that connection.
    lifetime: Lifetime,
    /// When the session ends, once its connection has (`None`: open, or
    /// kept for good).
    ends_at: Option<Instant>,
    /// MQTT 5: a takeover continues even a session that ends with its
    /// connection; a 3.1.1 clean session is never reused (MQTT-3.1.2-6).
    v5: bool,
    filters: HashSet<u64>,
    /// Its order among its device's kept sessions, once its connection
    /// ended and it was kept.
    kept: Option<u64>,
}

impl SessionFilters {
    /// `cap`: `mqtt.max_kept_sessions_per_device`.
    pub fn new(cap: usize) -> Self {
        SessionFilters { inner: Mutex::default(), cap }
    }

    /// Connection `conn` of `client_id` starts: it resumes what the client
    /// id held unless it starts clean or that session has ended (a session
    /// that ends with its connection is still here only while that
    /// connection is open: a takeover continues it, as the broker does,
    /// unless it is an MQTT 3.1.1 clean session).
    /// Expired sessions are forgotten.
    pub fn connected(&self, client_id: &str, conn: u64, v5: bool, clean: bool, lifetime: Lifetime, now: Instant) {
        let mut inner = self.inner.lock().expect("filters");
        let expired: Vec<String> = inner
            .held
            .iter()
            .filter(|(_, h)| h.ends_at.is_some_and(|at| at <= now))
            .map(|(id, _)| id.clone())
            .collect();
        for id in expired {
            inner.forget(&id);
        }
        let resumed = match inner.held.get_mut(client_id) {
            Some(h) if !clean && (h.v5 || h.lifetime != Lifetime::EndsWithConnection) => {
                (h.conn, h.lifetime, h.ends_at, h.v5) = (conn, lifetime, None, v5);
                Some(h.kept.take())
            }
            _ => None,
        };
        match resumed {
            Some(kept) => inner.unkeep(client_id, kept),
            None => {
                inner.forget(client_id);
                let h = Held { conn, lifetime, ends_at: None, v5, filters: HashSet::new(), kept: None };
                inner.held.insert(client_id.to_string(), h);
            }
        }
    }

    /// Connection `conn` of `client_id` ended (unless a newer connection
    /// already took the client id over): its session ends now or after
    /// `lifetime` (the DISCONNECT may have changed it); past the device's
    /// cap of kept sessions, its oldest is forgotten.
    pub fn closed(&self, client_id: &str, conn: u64, lifetime: Lifetime, now: Instant) {
        let mut inner = self.inner.lock().expect("filters");
        let Some(h) = inner.held.get_mut(client_id).filter(|h| h.conn == conn) else { return };
        h.lifetime = lifetime;
        match lifetime {
            Lifetime::EndsWithConnection => return inner.forget(client_id),
            // A deadline too far to represent never comes.
            Lifetime::For(d) => h.ends_at = now.checked_add(d),
            Lifetime::Forever => {}
        }
        let Some((device, _)) = client_id.split_once('|') else { return };
        if self.cap == 0 {
            return inner.forget(client_id);
        }
        inner.seq += 1;
        let seq = inner.seq;
        if let Some(h) = inner.held.get_mut(client_id) {
            h.kept = Some(seq);
        }
        let kept = inner.kept.entry(device.to_string()).or_default();
        kept.insert((seq, client_id.to_string()));
        let mut oldest = Vec::new();
        while kept.len() > self.cap {
            oldest.extend(kept.pop_first().map(|(_, id)| id));
        }
        for id in oldest {
            inner.held.remove(&id);
        }
    }

    /// The filters (keys) of a SUBSCRIBE of `client_id`: counted if the
    /// client id holds at most `max` then and `also` agrees, else nothing
    /// is.
    pub fn subscribe(
        &self,
        client_id: &str,
        keys: &[u64],
        max: usize,
        also: impl FnOnce() -> Result<(), Quota>,
    ) -> Result<(), Quota> {
        let mut inner = self.inner.lock().expect("filters");
        let Some(h) = inner.held.get_mut(client_id) else { return Err(Quota::Subscriptions) };
        let new: HashSet<u64> = keys.iter().filter(|k| !h.filters.contains(k)).copied().collect();
        if h.filters.len() + new.len() > max {
            return Err(Quota::Subscriptions);
        }
        also()?;
        h.filters.extend(new);
        Ok(())
    }

    /// The filters (keys) of an UNSUBSCRIBE of `client_id`.
    pub fn unsubscribe(&self, client_id: &str, keys: impl IntoIterator<Item = u64>) {
        if let Some(h) = self.inner.lock().expect("filters").held.get_mut(client_id) {
            for k in keys {
                h.filters.remove(&k);
            }
        }
    }
}

/// Bytes of QoS 2 publishes awaiting PUBREL per device, over all its
/// connections (the router keeps each whole until its PUBREL or the end of
/// its connection), against `max_inflight_bytes_per_device`.
pub struct InflightBytes {
    limit: usize,
    held: Mutex<HashMap<String, usize>>,
}

impl InflightBytes {
    pub fn new(limit: usize) -> Self {
        InflightBytes { limit, held: Mutex::default() }
    }

    /// A pending publish of `old` bytes (0: a new one) becomes `new`
    /// bytes: counted if the device stays within the limit, else nothing
    /// changes.
    pub fn replace(&self, device: &str, old: usize, new: usize) -> bool {
        self.change(device, old, new, true)
    }

    /// Undoes a [`InflightBytes::replace`] of `old` by `new` (the publish
    /// was refused after all).
    pub fn undo(&self, device: &str, old: usize, new: usize) {
        self.change(device, new, old, false);
    }

    fn change(&self, device: &str, old: usize, new: usize, limit: bool) -> bool {
        let mut held = self.held.lock().expect("inflight");
        let n = held.entry(device.to_string()).or_default();
        let total = *n - old.min(*n) + new;
        if limit && new > old && total > self.limit {
            return false;
        }
        *n = total;
        if *n == 0 {
            held.remove(device);
        }
        true
    }

    /// `bytes` of the device are no longer pending (a PUBREL, or the end of
    /// the connection that held them).
    pub fn release(&self, device: &str, bytes: usize) {
        let mut held = self.held.lock().expect("inflight");
        if let Some(n) = held.get_mut(device) {
            *n -= bytes.min(*n);
            if *n == 0 {
                held.remove(device);
            }
        }
    }
}

/// Which per-device limit a packet would exceed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Quota {
    /// `max_retained_per_device`.
    Retained,
    /// `max_retained_bytes_per_device`.
    RetainedBytes,
    /// `max_topics_per_device`.
    Topics,
    /// `max_subscriptions_per_connection`.
    Subscriptions,
    /// `max_inflight_bytes_per_device`.
    InflightBytes,
}

impl Quota {
    /// The reason string an MQTT 5 device is told.
    pub fn reason(self) -> &'static str {
        match self {
            Quota::Retained => "too many retained messages for this device",
            Quota::RetainedBytes => "too many bytes of retained messages for this device",
            Quota::Topics => "too many distinct topic names and filters for this device",
            Quota::Subscriptions => "too many subscriptions on this connection",
            Quota::InflightBytes => "too many bytes of QoS 2 publishes awaiting PUBREL for this device",
        }
    }
}

/// The per-device limits of [`DeviceQuotas`].
#[derive(Debug, Clone, Copy)]
pub struct QuotaLimits {
    pub retained: usize,
    pub retained_bytes: usize,
    pub topics: usize,
}

/// What one device keeps in the router. Topics and filters are kept as
/// keyed 64-bit hashes (a name may be 64 KiB; a collision only counts two
/// names as one).
#[derive(Default)]
struct Book {
    /// Retained topic → its bytes (topic and payload).
    retained: HashMap<u64, usize>,
    retained_bytes: usize,
    /// Every topic name published and filter subscribed.
    topics: HashSet<u64>,
}

/// What every device keeps in the router, counted against
/// [`QuotaLimits`]. Mirrors the router: a retained message is kept per
/// topic until a publish with an empty payload to that topic (rumqttd
/// deletes on any empty payload), and topics and filters are never
/// forgotten while edgeway runs. A retained message that the router drops
/// at its MQTT 5 message expiry stays counted until the device deletes it.
pub struct DeviceQuotas {
    limits: QuotaLimits,
    hasher: RandomState,
    books: Mutex<HashMap<String, Book>>,
}

impl std::fmt::Debug for DeviceQuotas {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceQuotas").field("limits", &self.limits).finish_non_exhaustive()
    }
}

impl DeviceQuotas {
    pub fn new(limits: QuotaLimits) -> Self {
        DeviceQuotas { limits, hasher: RandomState::new(), books: Mutex::default() }
    }

    /// The key of a topic name or filter (also for per-connection sets).
    pub fn key(&self, name: &[u8]) -> u64 {
        self.hasher.hash_one(name)
    }

    /// A PUBLISH of `device` (its mount) to `topic` (mounted): counted if
    /// it is within the limits, else which one it would exceed (nothing
    /// counted).
    pub fn publish(&self, device: &str, topic: &[u8], retain: bool, payload_len: usize) -> Result<(), Quota> {
        self.apply(device, topic, retain, payload_len, true)
    }

    /// A QoS 2 PUBLISH counted by [`DeviceQuotas::publish`] is released
    /// (its PUBREL): the router applies it only now, so it is applied to the
    /// book again, whatever the limits (the broker keeps it; something the
    /// device published in between, e.g. an empty payload to the topic, may
    /// have changed the book). A device over a limit this way is refused
    /// until it frees enough.
    pub fn release(&self, device: &str, topic: &[u8], retain: bool, payload_len: usize) {
        // Cannot fail without limits.
        let _ = self.apply(device, topic, retain, payload_len, false);
    }

    fn apply(&self, device: &str, topic: &[u8], retain: bool, payload_len: usize, limit: bool) -> Result<(), Quota> {
        let key = self.key(topic);
        let mut books = self.books.lock().expect("quotas");
        let book = books.entry(device.to_string()).or_default();
        let new_topic = !book.topics.contains(&key);
        if limit && new_topic && book.topics.len() >= self.limits.topics {
            return Err(Quota::Topics);
        }
        if payload_len == 0 {
            if let Some(freed) = book.retained.remove(&key) {
                book.retained_bytes -= freed;
            }
        } else if retain {
            let old = book.retained.get(&key).copied();
            if limit && old.is_none() && book.retained.len() >= self.limits.retained {
                return Err(Quota::Retained);
            }
            let size = topic.len() + payload_len;
            let total = book.retained_bytes - old.unwrap_or(0) + size;
            if limit && total > self.limits.retained_bytes {
                return Err(Quota::RetainedBytes);
            }
            book.retained.insert(key, size);
            book.retained_bytes = total;
        }
        if new_topic {
            book.topics.insert(key);
        }
        Ok(())
    }

    /// The filters (mounted) of a SUBSCRIBE of `device`: counted if the
    /// device stays within `max_topics_per_device`, else nothing is.
    pub fn subscribe(&self, device: &str, filters: &[u64]) -> Result<(), Quota> {
        let mut books = self.books.lock().expect("quotas");
        let book = books.entry(device.to_string()).or_default();
        let new: HashSet<u64> = filters.iter().filter(|k| !book.topics.contains(k)).copied().collect();
        if book.topics.len() + new.len() > self.limits.topics {
            return Err(Quota::Topics);
        }
        book.topics.extend(new);
        Ok(())
    }

    /// Retained messages and their bytes kept for `device`.
    pub fn retained(&self, device: &str) -> (usize, usize) {
        let books = self.books.lock().expect("quotas");
        books.get(device).map_or((0, 0), |b| (b.retained.len(), b.retained_bytes))
    }
}

#[cfg(test)]
mod quota_tests {
    use super::*;

    #[test]
    fn session_filters_last_as_long_as_the_broker_keeps_the_session() {
        use std::time::Duration;
        let f = SessionFilters::default();
        let t0 = Instant::now();
        let ok = || Ok(());
        let five = Lifetime::of(true, true, 5);
        assert_eq!(five, Lifetime::For(Duration::from_secs(5)));
        // Clean Start 1 with an expiry: kept after the connection...
        f.connected("d:a", 1, true, true, five, t0);
        assert_eq!(f.subscribe("d:a", &[1], 1, ok), Ok(()));
        f.closed("d:a", 1, five, t0);
        f.connected("d:a", 2, true, false, five, t0 + Duration::from_secs(1));
        assert_eq!(f.subscribe("d:a", &[2], 1, ok), Err(Quota::Subscriptions), "resumed: holds 1");
        // ...until the expiry.
        f.closed("d:a", 2, five, t0 + Duration::from_secs(1));
        f.connected("d:a", 3, true, false, five, t0 + Duration::from_secs(7));
        assert_eq!(f.subscribe("d:a", &[2], 1, ok), Ok(()), "expired: afresh");
        // Expiry 0 (or a DISCONNECT's 0) ends it with the connection.
        f.closed("d:a", 3, Lifetime::of(true, false, 0), t0 + Duration::from_secs(8));
        f.connected("d:a", 4, true, false, five, t0 + Duration::from_secs(8));
        assert_eq!(f.subscribe("d:a", &[1], 1, ok), Ok(()));
        // 3.1.1 without clean session: for good.
        let v4 = Lifetime::of(false, false, 0);
        assert_eq!(v4, Lifetime::Forever);
        f.connected("d:b", 5, false, false, v4, t0);
        assert_eq!(f.subscribe("d:b", &[1], 1, ok), Ok(()));
        f.closed("d:b", 5, v4, t0);
        f.connected("d:b", 6, false, false, v4, t0 + Duration::from_secs(100_000));
        assert_eq!(f.subscribe("d:b", &[2], 1, ok), Err(Quota::Subscriptions));
        // A takeover continues an open MQTT 5 expiry-0 session, not a
        // 3.1.1 clean session (MQTT-3.1.2-6).
        let ends = Lifetime::EndsWithConnection;
        f.connected("d:c", 7, true, true, ends, t0);
        assert_eq!(f.subscribe("d:c", &[1], 1, ok), Ok(()));
        f.connected("d:c", 8, true, false, ends, t0);
        assert_eq!(f.subscribe("d:c", &[2], 1, ok), Err(Quota::Subscriptions), "MQTT 5: continued");
        f.connected("d:e", 9, false, true, ends, t0);
        assert_eq!(f.subscribe("d:e", &[1], 1, ok), Ok(()));
        f.connected("d:e", 10, false, false, v4, t0);
        assert_eq!(f.subscribe("d:e", &[2], 1, ok), Ok(()), "3.1.1 clean: afresh");
    }

    /// `max_kept_sessions_per_device`: the oldest kept session of a device
    /// is forgotten past the cap, as the router discards it; other devices
    /// and sessions taken back are not counted.
    #[test]
    fn session_filters_keep_at_most_the_cap_per_device() {
        use std::time::Duration;
        let f = SessionFilters::new(2);
        let t0 = Instant::now();
        let ok = || Ok(());
        let kept = Lifetime::For(Duration::from_secs(60));
        for (conn, id) in [(1, "t:d|d:a"), (2, "t:d|d:b"), (3, "t:e|e:a"), (4, "t:d|d:c")] {
            f.connected(id, conn, true, true, kept, t0);
            assert_eq!(f.subscribe(id, &[1], 1, ok), Ok(()));
            f.closed(id, conn, kept, t0);
        }
        let resumed = |id: &str, conn| {
            f.connected(id, conn, true, false, kept, t0);
            f.subscribe(id, &[2], 1, ok).is_err()
        };
        assert!(!resumed("t:d|d:a", 5), "the oldest of device d was forgotten");
        assert!(resumed("t:d|d:b", 6) && resumed("t:d|d:c", 7), "its two newest kept");
        assert!(resumed("t:e|e:a", 8), "another device's are its own");
        let none = SessionFilters::new(0);
        none.connected("t:d|d:a", 1, true, true, kept, t0);
        assert_eq!(none.subscribe("t:d|d:a", &[1], 1, ok), Ok(()));
        none.closed("t:d|d:a", 1, kept, t0);
        none.connected("t:d|d:a", 2, true, false, kept, t0);
        assert_eq!(none.subscribe("t:d|d:a", &[2], 1, ok), Ok(()), "a cap of 0 keeps none");
    }

    fn quotas() -> DeviceQuotas {
        DeviceQuotas::new(QuotaLimits { retained: 2, retained_bytes: 100, topics: 4 })
    }

    #[test]
    fn retained_messages_are_limited_per_device_and_an_empty_payload_frees_one() {
        let q = quotas();
        assert_eq!(q.publish("d", b"a", true, 10), Ok(()));
        assert_eq!(q.publish("d", b"b", true, 10), Ok(()));
        assert_eq!(q.publish("d", b"c", true, 10), Err(Quota::Retained));
        assert_eq!(q.publish("d", b"a", true, 20), Ok(()), "a replacement is not one more");
        assert_eq!(q.publish("d", b"c", false, 10), Ok(()), "not retained");
        assert_eq!(q.publish("e", b"c", true, 10), Ok(()), "another device");
        assert_eq!(q.retained("d"), (2, 11 + 21));
        assert_eq!(q.publish("d", b"a", false, 0), Ok(()), "an empty payload deletes");
        assert_eq!(q.retained("d"), (1, 11));
        assert_eq!(q.publish("d", b"c", true, 90), Err(Quota::RetainedBytes));
        assert_eq!(q.publish("d", b"c", true, 80), Ok(()));
        assert_eq!(q.retained("d"), (2, 92));
    }

    #[test]
    fn a_released_qos2_publish_is_applied_again_whatever_the_limits() {
        let q = quotas();
        assert_eq!(q.publish("d", b"a", true, 80), Ok(()), "the QoS 2 PUBLISH");
        assert_eq!(q.publish("d", b"a", true, 0), Ok(()), "an empty one frees it");
        q.release("d", b"a", true, 80);
        assert_eq!(q.retained("d"), (1, 81), "the broker applied it at the PUBREL");
        assert_eq!(q.publish("d", b"b", true, 30), Err(Quota::RetainedBytes));
        q.release("d", b"b", true, 30);
        assert_eq!(q.retained("d"), (2, 112), "over the limit: counted as the broker keeps it");
    }

    #[test]
    fn topics_and_filters_are_limited_per_device() {
        let q = quotas();
        for t in [&b"a"[..], b"b", b"c"] {
            assert_eq!(q.publish("d", t, false, 1), Ok(()));
        }
        assert_eq!(q.publish("d", b"a", false, 1), Ok(()), "a known topic");
        assert_eq!(q.subscribe("d", &[q.key(b"f"), q.key(b"g")]), Err(Quota::Topics));
        assert_eq!(q.subscribe("d", &[q.key(b"f"), q.key(b"a")]), Ok(()));
        assert_eq!(q.publish("d", b"x", false, 1), Err(Quota::Topics));
        assert_eq!(q.publish("d", b"x", true, 1), Err(Quota::Topics), "and nothing retained");
        assert_eq!(q.retained("d"), (0, 0));
        assert_eq!(q.publish("e", b"x", false, 1), Ok(()), "another device");
    }
}
