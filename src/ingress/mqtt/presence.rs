//! Device presence: authenticated connections report when they start (at
//! CONNECT, before rumqttd's router sees them) and when they end (when
//! their codec is dropped with the connection).
//!
//! Owns: the [`Presence`] events and their delivery: the device sessions
//! are updated at once, under the codec's call, so a request that follows
//! the CONNECT finds its device online; what that changed goes to the
//! ingress on a channel. Does not own: what the ingress does with it
//! (`requests::DeviceIngress::on_presence`).

use std::sync::Arc;

use tokio::sync::mpsc::UnboundedSender;

use super::requests::{Change, Sessions};
use crate::task::Identity;

/// A device connection starting or ending.
#[derive(Debug, Clone)]
pub enum Presence {
    Connected { device: String, client_id: String, conn: u64, identity: Identity },
    Disconnected { device: String, conn: u64 },
}

/// Where the codecs report presence.
pub struct PresenceReporter {
    pub sessions: Arc<Sessions>,
    changes: UnboundedSender<Change>,
}

impl PresenceReporter {
    pub fn new(sessions: Arc<Sessions>, changes: UnboundedSender<Change>) -> Self {
        PresenceReporter { sessions, changes }
    }

    pub fn report(&self, p: Presence) {
        let change = self.sessions.apply(&p);
        let _ = self.changes.send(change);
    }
}
