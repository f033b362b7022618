//! [`DeviceProtocol`]: the codec every device connection goes through. It
//! wraps rumqttd's MQTT 3.1.1 and 5 codecs (rumqttd clones it once per
//! connection, and its `read_mut` sees every packet before the router
//! does), which is where edgeway enforces what rumqttd lacks. It is a thin
//! wrapper: it moves the connection through its states
//! ([`super::connections::Conn`]) and calls
//! - [`super::codec`] for the packet rules (version, mounting every topic
//!   under `d/{device}/` so that a device only ever matches its own
//!   subtree, rumqttd quirks, refusal CONNACKs);
//! - [`super::auth`] to check the device id, user name and password (or
//!   JWT) at CONNECT;
//! - [`super::connections`] for connection numbers and the id rumqttd
//!   knows a connection by (takeover, reconnects, spoiled ids);
//! - [`super::wills`] and [`super::presence`] when a connection starts and
//!   when it ends (the codec is dropped with the connection).
//!
//! **Authentication with a CONNACK**: a refused CONNECT is replaced by a
//! harmless placeholder (unique id, no will, clean session) so that
//! rumqttd answers it, and its CONNACK is rewritten to the refusal code
//! (rumqttd's own auth hook would close the socket without a CONNACK, and a
//! device could not tell bad credentials from a bad network).
//!
//! **Reconnects and wills**: rumqttd's router numbers connections by
//! reusable slots, and a link that ends by itself reports "closed" for its
//! slot afterwards. When the same client id reconnects at once, the router
//! has already dropped the old connection (on its DISCONNECT, or as a
//! duplicate id) and given the slot to the new one, so the late report
//! removes the *new* connection: its subscriptions vanish and its SUBSCRIBE
//! gets no SUBACK (about 1 immediate reconnect in 20 here). So (a)
//! DISCONNECT never reaches the router: the codec ends the link (one
//! removal), and (b) a connection whose client id still has an *ending*
//! connection gets a broker id of its own (see [`super::connections`]). A
//! second CONNECT on a connection closes it. Wills are therefore kept by
//! edgeway, not the router ([`super::wills`]). A reconnect under its own
//! broker id starts a fresh broker session (edgeway's streams resume by
//! `seq`). What remains: a client that closes its socket without
//! DISCONNECT and is back before rumqttd has noticed can still meet the
//! slot race (the codec never sees the socket close).
//!
//! Owns: the per-connection glue. Does not own: any rule above (each is in
//! its own module).

use std::sync::Arc;

use bytes::{Buf, BytesMut};
use rumqttd::protocol::v4::V4;
use rumqttd::protocol::v5::V5;
use rumqttd::protocol::{DisconnectReasonCode, Error, Packet, Protocol};

use super::auth::{DeviceDirectory, Refusal};
use super::codec::{self, Detected, Version};
use super::connections::{Conn, Connack, Connections, Session};
use super::presence::{Presence, PresenceReporter};
use super::topics::Topics;
use super::wills::Wills;

/// What all connections share.
pub struct ProtocolShared {
    pub directory: DeviceDirectory,
    pub topics: Topics,
    /// Device view of the shared topics (`Topics::shared_prefix`), made once.
    shared_prefix: String,
    presence: PresenceReporter,
    wills: Arc<Wills>,
    connections: Connections,
}

impl ProtocolShared {
    pub fn new(directory: DeviceDirectory, topics: Topics, presence: PresenceReporter, wills: Arc<Wills>) -> Self {
        let shared_prefix = topics.shared_prefix();
        ProtocolShared { directory, topics, shared_prefix, presence, wills, connections: Connections::default() }
    }
}

/// The codec of one device connection (the prototype given to rumqttd's
/// `Server` is never used for a connection itself).
pub struct DeviceProtocol {
    shared: Arc<ProtocolShared>,
    version: Version,
    state: Conn,
    /// When the connection's credential expires (a JWT's `exp`, unix ms):
    /// see [`super::auth::expired`].
    expires_at: Option<i64>,
    /// The login's token id digest, checked for revocation at every read.
    credential: Option<[u8; 32]>,
}

impl DeviceProtocol {
    pub fn new(shared: Arc<ProtocolShared>) -> Self {
        DeviceProtocol {
            shared,
            version: Version::Unknown,
            state: Conn::AwaitingConnect,
            expires_at: None,
            credential: None,
        }
    }
}

impl Clone for DeviceProtocol {
    /// A fresh connection state: rumqttd clones the prototype per
    /// connection.
    fn clone(&self) -> Self {
        DeviceProtocol::new(self.shared.clone())
    }
}

impl Drop for DeviceProtocol {
    fn drop(&mut self) {
        let shared = &self.shared;
        match std::mem::replace(&mut self.state, Conn::AwaitingConnect) {
            Conn::AwaitingConnect => {}
            Conn::Refused { placeholder, connack, .. } => {
                if connack == Connack::Pending {
                    // Ended between CONNECT and its first read: rumqttd's id
                    // is spoiled (see `connections`).
                    shared.connections.spoil_placeholder(placeholder);
                }
            }
            Conn::Open(s) | Conn::Ending(s) => {
                // (An id of its own is never used again anyway.)
                if s.connack == Connack::Pending && !s.own_broker_id {
                    shared.connections.spoil(&s.client_id);
                }
                shared.connections.closed(&s.client_id, s.conn);
                if let Some((will, props)) = s.will {
                    shared.wills.arm(&s.client_id, will, props, s.session_expiry);
                }
                shared.presence.report(Presence::Disconnected { device: s.device, conn: s.conn });
            }
        }
    }
}

impl DeviceProtocol {
    fn refuse(&mut self, why: Refusal) -> Packet {
        let placeholder = self.shared.connections.placeholder();
        self.state = Conn::Refused { why, placeholder, connack: Connack::Pending };
        codec::placeholder_connect(placeholder)
    }

    /// Ends the link (rumqttd closes the connection on a codec error), and
    /// tells the connection table.
    fn end_link(&mut self) -> Error {
        self.state = match std::mem::replace(&mut self.state, Conn::AwaitingConnect) {
            Conn::Open(s) => {
                self.shared.connections.ending(&s.client_id, s.conn);
                Conn::Ending(s)
            }
            other => other,
        };
        Error::InvalidProtocol
    }

    /// An authenticated CONNECT (or a refused one's placeholder) for rumqttd.
    fn connect(&mut self, packet: Packet) -> Packet {
        let Packet::Connect(mut connect, mut props, will, will_props, login) = packet else {
            unreachable!("called with a CONNECT")
        };
        let (user, password) = match &login {
            Some(l) => (Some(l.username.as_str()), l.password.as_str()),
            None => (None, ""),
        };
        let (device, identity) = match self.shared.directory.authenticate(&connect.client_id, user, password) {
            Ok(login) => {
                self.expires_at = login.expires_at;
                self.credential = login.identity.credential;
                (login.device.to_string(), login.identity)
            }
            Err(why) => {
                tracing::info!(client_id = %connect.client_id, reason = why.reason(), "MQTT CONNECT refused");
                return self.refuse(why);
            }
        };
        let shared = &self.shared;
        // Everything below the device view is per tenant: the session,
        // presence and the router topics use the mount `{tenant}/{device}`.
        let mount = super::topics::mount_name(&identity.tenant, &device);
        let conn = shared.connections.next_conn();
        let session_expiry = codec::rewrite_connect(&mut connect, &mut props);
        let client_id = connect.client_id.clone();
        shared.wills.cancel(&client_id);
        let (broker_id, own_broker_id) = shared.connections.connect(&client_id, conn);
        connect.client_id = broker_id;
        shared.presence.report(Presence::Connected {
            device: mount.clone(),
            client_id: client_id.clone(),
            conn,
            identity,
        });
        self.state = Conn::Open(Session {
            request_topic: format!("{}req", shared.topics.device_space(&device)),
            // edgeway keeps the will (see `wills`).
            will: will.map(|w| (codec::mount_will(&mount, w), will_props)),
            device: mount,
            conn,
            client_id,
            own_broker_id,
            session_expiry,
            connack: Connack::Pending,
        });
        Packet::Connect(connect, props, None, None, login)
    }

    /// Device → router.
    fn inbound(&mut self, packet: Packet) -> Result<Packet, Error> {
        let session = match &mut self.state {
            Conn::AwaitingConnect if matches!(packet, Packet::Connect(..)) => return Ok(self.connect(packet)),
            Conn::Open(s) => s,
            // Nothing but a CONNECT before a CONNECT; nothing after the
            // link ended.
            Conn::AwaitingConnect | Conn::Refused { .. } | Conn::Ending(_) => return Err(Error::InvalidProtocol),
        };
        match packet {
            // A second CONNECT is a protocol violation: the server closes
            // the connection (MQTT-3.1.0-2).
            Packet::Connect(..) => Err(self.end_link()),
            Packet::Disconnect(d, _) => {
                if d.reason_code != DisconnectReasonCode::DisconnectWithWillMessage {
                    session.will = None;
                }
                // Ends the link here: the router then removes the
                // connection once, when the link reports it closed.
                Err(self.end_link())
            }
            other => codec::mount_inbound(&session.device, &self.shared.shared_prefix, &session.request_topic, other),
        }
    }
}

impl Protocol for DeviceProtocol {
    fn read_mut(&mut self, stream: &mut BytesMut, max_size: usize) -> Result<Packet, Error> {
        // rumqttd reads again only after it wrote the CONNACK.
        self.state.connack_written();
        if let Conn::Refused { .. } = self.state {
            // Nothing after a refused CONNECT: the connection ends.
            return Err(Error::InvalidProtocol);
        }
        if self.shared.directory.lapsed(self.expires_at, self.credential) {
            tracing::info!(device = ?self.state.session().map(|s| &s.device), "MQTT: token expired or revoked, connection closed");
            return Err(self.end_link());
        }
        if self.version == Version::Unknown {
            match codec::detect_version(stream, max_size)? {
                Detected::Supported(v) => self.version = v,
                Detected::Unsupported { frame } => {
                    // MQTT 3.1 ("MQIsdp") and unknown levels: a 3.1.1 refusal.
                    stream.advance(frame);
                    self.version = Version::V4;
                    return Ok(self.refuse(Refusal::ProtocolVersion));
                }
            }
        }
        let packet = match self.version {
            Version::V4 => V4.read_mut(stream, max_size),
            Version::V5 => V5.read_mut(stream, max_size),
            Version::Unknown => unreachable!("set above"),
        };
        let packet = match packet {
            Ok(p) => p,
            // Not a whole packet yet: rumqttd reads more.
            Err(e @ Error::InsufficientBytes(_)) => return Err(e),
            Err(e) => {
                self.end_link();
                return Err(e);
            }
        };
        self.inbound(packet).inspect_err(|_| {
            self.end_link();
        })
    }

    fn write(&self, packet: Packet, write: &mut BytesMut) -> Result<usize, Error> {
        let refused = match &self.state {
            Conn::Refused { why, .. } => Some(*why),
            _ => None,
        };
        let device = self.state.session().map(|s| s.device.as_str());
        if super::auth::expired(self.expires_at) {
            // Instead of anything more: an MQTT 5 device is told why (0xA0
            // Maximum connect time); the next read ends the link.
            return match self.version {
                Version::V5 => V5.write(super::auth::expired_disconnect(), write),
                _ => Err(Error::InvalidProtocol),
            };
        }
        let packet = codec::outbound(self.version, refused, device, packet)?;
        match self.version {
            Version::V4 => V4.write(packet, write),
            Version::V5 => V5.write(packet, write),
            Version::Unknown => Err(Error::InvalidProtocol),
        }
    }
}
