//! Device connections: where each one is ([`Conn`], an explicit state
//! machine kept by its codec) and their numbers ([`Connections`]).
//!
//! A connection is known to rumqttd's router by its client id as sent: the
//! patched rumqttd (`patches/rumqttd/PATCHES.md`) reports a connection that
//! fails at its CONNACK, survives a dead will-map entry and never lets a
//! late "closed" report remove a newer connection of the same client id, so
//! a reconnect is a plain MQTT takeover.
//!
//! Owns: connection numbers and states. Does not own: packets
//! ([`super::codec`]), wills ([`super::wills`]), presence
//! ([`super::presence`]).

use std::sync::atomic::{AtomicU64, Ordering};

use rumqttd::protocol::{LastWill, LastWillProperties};

use super::auth::Refusal;

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
    Refused(Refusal),
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

/// What every codec shares about connections.
pub struct Connections {
    next_conn: AtomicU64,
}

impl Default for Connections {
    fn default() -> Self {
        Connections { next_conn: AtomicU64::new(1) }
    }
}

impl Connections {
    /// A number for a new authenticated connection.
    pub fn next_conn(&self) -> u64 {
        self.next_conn.fetch_add(1, Ordering::Relaxed)
    }
}
