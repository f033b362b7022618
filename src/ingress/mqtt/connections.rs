//! Device connections: where each one is ([`Conn`], an explicit state
//! machine kept by its codec) and the table of open connections per client
//! id ([`Connections`]), which decides the id rumqttd's router knows a new
//! connection by.
//!
//! Why the broker id is not always the client id (see also
//! [`super::protocol`]):
//! - rumqttd's router numbers connections by reusable slots, and a link
//!   that ends by itself reports "closed" for its slot afterwards. A
//!   reconnect of the same client id while the old connection is *ending*
//!   (its codec ended the link; rumqttd has yet to take its report) would
//!   get the old slot and then lose it to the late report. Such a
//!   connection gets an id of its own, `{id}~c{n}`.
//! - A reconnect while the old connection is alive is a plain MQTT
//!   takeover: same id, the router closes the old one and the session
//!   continues. But the codec cannot see a connection whose socket was just
//!   closed (rumqttd reads EOF below it) until rumqttd drops it, right
//!   after sending its "closed" report. So a CONNECT whose client id still
//!   has an open connection waits, up to [`TAKEOVER_WAIT`], for the signal
//!   that connection sends when it starts ending or is gone. One still open
//!   after the wait is alive (a half-open link) and taken over.
//! - rumqttd's listener keeps a per-client-id map for will handling; a
//!   connection that fails between CONNECT and its CONNACK leaves a dead
//!   entry behind, and the next connection with that client id panics on
//!   it. Such a client id is *spoiled*: from then on it connects under a
//!   fresh alias `{id}~{n}`. Refused connections use a small pool of
//!   placeholder ids, spoiled the same way.
//!
//! Owns: connection numbers, the open-connection table and its signals,
//! broker ids, spoiled ids and placeholders. Does not own: packets
//! ([`super::codec`]), wills ([`super::wills`]), presence
//! ([`super::presence`]).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use rumqttd::protocol::{LastWill, LastWillProperties};

use super::auth::Refusal;

/// How long a CONNECT waits for an open connection of its client id to
/// start ending or go. A closed one goes within a millisecond or two; the
/// limit is there for a half-open link, which nothing signals, and is large
/// enough that a loaded machine still sees a closed one go.
pub const TAKEOVER_WAIT: Duration = Duration::from_millis(100);

/// Placeholder ids for refused connections (rumqttd keeps a little state
/// per id ever used, so they are reused).
const PLACEHOLDERS: u64 = 256;

/// Whether rumqttd got past the CONNACK of the CONNECT it was handed: it
/// reads again only once it has written it. A connection that ends while it
/// is pending spoils its broker id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Connack {
    Pending,
    Written,
}

/// An authenticated device connection.
#[derive(Debug)]
pub struct Session {
    pub device: String,
    /// This connection's number.
    pub conn: u64,
    /// The client id as sent.
    pub client_id: String,
    /// The broker knows this connection under an id of its own
    /// (`{id}~c{n}`), never used again.
    pub own_broker_id: bool,
    /// MQTT 5 Session Expiry Interval from CONNECT, seconds (0: the session
    /// ends with the connection).
    pub session_expiry: u32,
    /// The connection's will (topic mounted), until a clean DISCONNECT.
    pub will: Option<(LastWill, Option<LastWillProperties>)>,
    /// Device view of its request topic, for the expiry rewrite.
    pub request_topic: String,
    pub connack: Connack,
}

/// Where one connection is.
#[derive(Debug)]
pub enum Conn {
    /// Nothing read yet.
    AwaitingConnect,
    /// The CONNECT was refused: rumqttd got a placeholder in its place, and
    /// its CONNACK carries the refusal. Nothing after it is read.
    Refused { why: Refusal, placeholder: u64, connack: Connack },
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

    /// rumqttd reads again: it has written the CONNACK.
    pub fn connack_written(&mut self) {
        match self {
            Conn::Refused { connack, .. }
            | Conn::Open(Session { connack, .. })
            | Conn::Ending(Session { connack, .. }) => *connack = Connack::Written,
            Conn::AwaitingConnect => {}
        }
    }
}

/// What the table knows of an open connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Link {
    Open,
    /// Its codec ended the link; rumqttd is about to report it closed.
    Ending,
}

/// The open connections of one client id.
#[derive(Default)]
struct ClientLinks {
    links: HashMap<u64, Link>,
    /// Signalled (under the table's lock) when one of `links` starts ending
    /// or is gone, for a CONNECT waiting to take over.
    changed: Arc<Condvar>,
    /// CONNECTs waiting on `changed` (what tests wait for).
    waiting: usize,
}

/// The connection table every codec shares.
pub struct Connections {
    next_conn: AtomicU64,
    /// Authenticated connections whose codec is not dropped yet.
    open: Mutex<HashMap<String, ClientLinks>>,
    /// Client ids whose rumqttd-side id is spoiled, and how many times.
    spoiled: Mutex<HashMap<String, u32>>,
    /// Placeholder ids for refused connections: next one and spoiled ones.
    placeholders: Mutex<(u64, HashSet<u64>)>,
    takeover_wait: Duration,
}

impl Default for Connections {
    fn default() -> Self {
        Connections::with_takeover_wait(TAKEOVER_WAIT)
    }
}

impl Connections {
    fn with_takeover_wait(takeover_wait: Duration) -> Self {
        Connections {
            next_conn: AtomicU64::new(1),
            open: Mutex::default(),
            spoiled: Mutex::default(),
            placeholders: Mutex::default(),
            takeover_wait,
        }
    }

    /// A number for a new authenticated connection.
    pub fn next_conn(&self) -> u64 {
        self.next_conn.fetch_add(1, Ordering::Relaxed)
    }

    /// Counts connection `conn` of `client_id` as open, and returns the id
    /// rumqttd is to know it by, and whether that id is its own
    /// (`{id}~c{n}`). May wait for an open connection of the client id to
    /// go (see the module docs), on a multi-threaded runtime only: a
    /// current-thread runtime would be blocked whole, so there it takes over
    /// at once.
    pub fn connect(&self, client_id: &str, conn: u64) -> (String, bool) {
        let deadline = Instant::now() + self.takeover_wait;
        let mut open = self.open.lock().expect("open");
        let ending = loop {
            let c = open.entry(client_id.to_string()).or_default();
            let ending = c.links.values().any(|l| *l == Link::Ending);
            let now = Instant::now();
            if c.links.is_empty() || ending || now >= deadline || !can_block() {
                c.links.insert(conn, Link::Open);
                break ending;
            }
            let changed = c.changed.clone();
            c.waiting += 1;
            // `block_in_place` hands this worker's other tasks to other
            // workers while it waits.
            open = tokio::task::block_in_place(|| changed.wait_timeout(open, deadline - now)).expect("open").0;
            if let Some(c) = open.get_mut(client_id) {
                c.waiting = c.waiting.saturating_sub(1);
            }
        };
        drop(open);
        if ending {
            return (format!("{client_id}~c{conn}"), true);
        }
        match self.spoiled.lock().expect("spoiled").get(client_id) {
            None => (client_id.to_string(), false),
            Some(n) => (format!("{client_id}~{n}"), false),
        }
    }

    /// The codec of `conn` ended its link.
    pub fn ending(&self, client_id: &str, conn: u64) {
        let mut open = self.open.lock().expect("open");
        if let Some(c) = open.get_mut(client_id) {
            if let Some(l) = c.links.get_mut(&conn) {
                *l = Link::Ending;
                c.changed.notify_all();
            }
        }
    }

    /// The codec of `conn` is dropped: the connection is gone.
    pub fn closed(&self, client_id: &str, conn: u64) {
        let mut open = self.open.lock().expect("open");
        if let Some(c) = open.get_mut(client_id) {
            c.links.remove(&conn);
            c.changed.notify_all();
            if c.links.is_empty() {
                open.remove(client_id);
            }
        }
    }

    /// The broker id of `client_id` is spoiled (see the module docs).
    pub fn spoil(&self, client_id: &str) {
        *self.spoiled.lock().expect("spoiled").entry(client_id.to_string()).or_insert(0) += 1;
    }

    /// A placeholder id not spoiled yet: one of the reused pool, or a fresh
    /// one past it when the whole pool is spoiled.
    pub fn placeholder(&self) -> u64 {
        let mut g = self.placeholders.lock().expect("placeholders");
        for _ in 0..PLACEHOLDERS {
            g.0 += 1;
            let k = g.0 % PLACEHOLDERS;
            if !g.1.contains(&k) {
                return k;
            }
        }
        g.0 += 1;
        PLACEHOLDERS + g.0
    }

    pub fn spoil_placeholder(&self, k: u64) {
        self.placeholders.lock().expect("placeholders").1.insert(k);
    }

    #[cfg(test)]
    fn waiting(&self, client_id: &str) -> usize {
        self.open.lock().expect("open").get(client_id).map_or(0, |c| c.waiting)
    }
}

/// Whether this thread may block briefly: a worker of a multi-threaded
/// runtime (`block_in_place` hands its other tasks to other workers).
fn can_block() -> bool {
    tokio::runtime::Handle::try_current()
        .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_plain_own_while_ending_and_aliased_once_spoiled() {
        let t = Connections::default();
        assert_eq!(t.connect("dev1", 1), ("dev1".into(), false));
        t.ending("dev1", 1);
        assert_eq!(t.connect("dev1", 2), ("dev1~c2".into(), true));
        t.closed("dev1", 1);
        t.closed("dev1", 2);
        t.spoil("dev1");
        assert_eq!(t.connect("dev1", 3), ("dev1~1".into(), false));
        assert_eq!(t.connect("dev2", 4), ("dev2".into(), false));
    }

    #[test]
    fn without_a_multi_threaded_runtime_a_takeover_does_not_wait() {
        let t = Connections::with_takeover_wait(Duration::from_secs(3600));
        t.connect("dev1", 1);
        // Outside any runtime (and on a current-thread one) blocking would
        // stall everything: the takeover is immediate.
        assert_eq!(t.connect("dev1", 2), ("dev1".into(), false));
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        assert_eq!(rt.block_on(async { t.connect("dev1", 3) }), ("dev1".into(), false));
    }

    /// With a limit of 20 s, a CONNECT back within 10 s was woken by the
    /// signal of the old connection (without it, the test fails after 10 s).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_takeover_waits_for_the_signal_of_the_old_connection() {
        let t = Arc::new(Connections::with_takeover_wait(Duration::from_secs(20)));
        // The old connection goes: the new one gets the plain id.
        t.connect("dev1", 1);
        let waiting = tokio::spawn({
            let t = t.clone();
            async move { t.connect("dev1", 2) }
        });
        until_waiting(&t).await;
        t.closed("dev1", 1);
        assert_eq!(in_time(waiting).await, ("dev1".into(), false));

        // The old connection starts ending: the new one gets its own id.
        let waiting = tokio::spawn({
            let t = t.clone();
            async move { t.connect("dev1", 3) }
        });
        until_waiting(&t).await;
        t.ending("dev1", 2);
        assert_eq!(in_time(waiting).await, ("dev1~c3".into(), true));
    }

    async fn until_waiting(t: &Connections) {
        while t.waiting("dev1") == 0 {
            tokio::task::yield_now().await;
        }
    }

    async fn in_time<T>(h: tokio::task::JoinHandle<T>) -> T {
        tokio::time::timeout(Duration::from_secs(10), h).await.expect("woken by the signal").unwrap()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_live_connection_is_taken_over_after_the_limit() {
        let t = Connections::with_takeover_wait(Duration::from_millis(20));
        t.connect("dev1", 1);
        let started = Instant::now();
        assert_eq!(t.connect("dev1", 2), ("dev1".into(), false));
        assert!(started.elapsed() >= Duration::from_millis(20));
    }

    #[test]
    fn placeholders_are_reused_until_spoiled() {
        let t = Connections::default();
        let k = t.placeholder();
        t.spoil_placeholder(k);
        let seen: HashSet<u64> = (0..PLACEHOLDERS).map(|_| t.placeholder()).collect();
        assert!(!seen.contains(&k));
        for k in 0..PLACEHOLDERS {
            t.spoil_placeholder(k);
        }
        assert!(t.placeholder() > PLACEHOLDERS);
    }
}
