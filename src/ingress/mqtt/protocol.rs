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
//! - [`super::connections`] for connection states and numbers, and the
//!   per-device quotas that [`Protocol::screen`] (a hook of the patched
//!   rumqttd) applies to every PUBLISH and SUBSCRIBE before the router sees
//!   it: retained messages, topic names and filters per device,
//!   subscriptions per client id (a resumed session keeps its own), and QoS 2 publishes awaiting PUBREL per
//!   connection (at most the Receive Maximum told in the CONNACK,
//!   `mqtt.max_inflight`) and their bytes per device over all its
//!   connections (`mqtt.max_inflight_bytes_per_device`);
//! - [`super::wills`] and [`super::presence`] when a connection starts and
//!   when it ends (the codec is dropped with the connection).
//!
//! **Authentication with a CONNACK**: a refused CONNECT is handed to
//! rumqttd as one it answers itself and never registers with its router (an
//! empty client id without a clean session, MQTT-3.1.3-8), and its CONNACK
//! is rewritten to the refusal code (rumqttd's own auth hook would close the
//! socket without a CONNACK, and a device could not tell bad credentials
//! from a bad network).
//!
//! **Client ids**: the router knows a connection by
//! `{tenant}:{device}|{client id}`
//! ([`super::topics::router_client_id`]), so sessions, takeovers, wills
//! and subscription counts are per tenant and device; the device never sees
//! that id.
//!
//! **Reconnects and wills**: a reconnect of a client id is a plain MQTT
//! takeover by rumqttd's router (the patched rumqttd makes that safe, see
//! `patches/rumqttd/PATCHES.md`). DISCONNECT goes to the router (it
//! applies the Session Expiry Interval a DISCONNECT may carry: the broker
//! keeps MQTT 5 sessions for their expiry, patch 20) and ends the link; the
//! codec drops the will (unless reason 0x04); wills are kept by edgeway, not the router
//! ([`super::wills`]), because edgeway mounts their topics and follows MQTT
//! 5's will delay and session expiry, which rumqttd does not. A second
//! CONNECT on a connection closes it.
//!
//! Owns: the per-connection glue. Does not own: any rule above (each is in
//! its own module).

use std::collections::HashMap;
use std::sync::Arc;

use bytes::{Buf, Bytes, BytesMut};
use rumqttd::protocol::v4::V4;
use rumqttd::protocol::v5::V5;
use rumqttd::protocol::{DisconnectReasonCode, Error, Packet, Protocol, QoS, Verdict};

use super::auth::{DeviceDirectory, Refusal};
use super::codec::{self, Detected, Refused, Version};
use super::connections::{
    Conn, Connections, DeviceQuotas, InflightBytes, Lifetime, Quota, QuotaLimits, Session, SessionFilters,
};
use super::presence::{Presence, PresenceReporter};
use super::topics::Topics;
use super::wills::Wills;
use crate::config::MqttConfig;

/// What all connections share.
pub struct ProtocolShared {
    pub directory: DeviceDirectory,
    pub topics: Topics,
    /// Device view of the shared topics (`Topics::shared_prefix`), made once.
    shared_prefix: String,
    presence: PresenceReporter,
    wills: Arc<Wills>,
    connections: Connections,
    /// `mqtt.max_keep_alive_s`.
    max_keep_alive: u16,
    /// `mqtt.max_will_bytes`.
    max_will_bytes: usize,
    /// `mqtt.max_will_delay_s`.
    max_will_delay_s: u32,
    /// `mqtt.max_session_expiry_s`.
    max_session_expiry_s: u32,
    /// Retained messages, topics and filters per device (shared with the
    /// wills, which count when they are published).
    quotas: Arc<DeviceQuotas>,
    /// `mqtt.max_subscriptions_per_connection`.
    max_subscriptions: usize,
    /// The filters each client id holds, across resumed sessions.
    filters: SessionFilters,
    /// Bytes of QoS 2 publishes awaiting PUBREL per device
    /// (`mqtt.max_inflight_bytes_per_device`).
    inflight_bytes: InflightBytes,
    /// The Receive Maximum told to MQTT 5 devices (`mqtt.max_inflight`):
    /// QoS 2 publishes awaiting PUBREL per connection.
    receive_max: u16,
}

/// The status view's list of connected devices.
impl crate::gateway::DeviceList for ProtocolShared {
    fn connected(&self, tenant: &str, max: usize) -> (usize, Vec<String>) {
        self.connections.devices(tenant, max)
    }
}

impl ProtocolShared {
    pub fn new(directory: DeviceDirectory, topics: Topics, presence: PresenceReporter, wills: Arc<Wills>) -> Self {
        let shared_prefix = topics.shared_prefix();
        ProtocolShared {
            directory,
            topics,
            shared_prefix,
            presence,
            wills,
            connections: Connections::default(),
            max_keep_alive: crate::config::mqtt::DEFAULT_MQTT_MAX_KEEP_ALIVE_S,
            max_will_bytes: usize::MAX,
            max_will_delay_s: u32::MAX,
            max_session_expiry_s: u32::MAX,
            quotas: Arc::new(DeviceQuotas::new(QuotaLimits {
                retained: usize::MAX,
                retained_bytes: usize::MAX,
                topics: usize::MAX,
            })),
            max_subscriptions: usize::MAX,
            filters: SessionFilters::default(),
            inflight_bytes: InflightBytes::new(usize::MAX),
            receive_max: u16::MAX,
        }
    }

    /// With the limits of `[mqtt]`.
    pub fn with_config(mut self, cfg: &MqttConfig) -> Self {
        self.max_keep_alive = cfg.max_keep_alive_s;
        self.max_will_bytes = cfg.max_will_bytes;
        self.max_will_delay_s = cfg.max_will_delay_s;
        self.max_session_expiry_s = cfg.max_session_expiry_s;
        self.filters = SessionFilters::new(cfg.max_kept_sessions_per_device);
        self.connections =
            Connections::new(cfg.max_instances_per_device, cfg.auth_failures_per_s, cfg.auth_failures_per_ip_per_s);
        self.quotas = Arc::new(DeviceQuotas::new(QuotaLimits {
            retained: cfg.max_retained_per_device,
            retained_bytes: cfg.max_retained_bytes_per_device,
            topics: cfg.max_topics_per_device,
        }));
        self.max_subscriptions = cfg.max_subscriptions_per_connection;
        self.inflight_bytes = InflightBytes::new(cfg.max_inflight_bytes_per_device);
        self.receive_max = u16::try_from(cfg.max_inflight).unwrap_or(u16::MAX).max(1);
        self
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
    /// What the login rests on, checked at every read and after every
    /// reload ([`super::auth::DeviceDirectory::withdrawn`]).
    grant: Option<super::auth::Grant>,
    /// QoS 2 publishes awaiting their PUBREL, by packet id: what the router
    /// applies at the PUBREL, counted again then ([`DeviceQuotas::release`]).
    awaiting_pubrel: HashMap<u16, Pending>,
    /// MQTT 5 topic aliases the device set (device view), resolved by the
    /// codec ([`codec::resolve_alias`]).
    aliases: HashMap<u16, Bytes>,
    /// The topic aliases edgeway sets in what it sends to an MQTT 5 device
    /// that allows them (`write` has `&self`; only the link's writer
    /// locks it).
    out_aliases: std::sync::Mutex<Option<codec::OutAliases>>,
    /// The device's Maximum Packet Size: a PUBLISH over it is left out by
    /// the link, and so must not set an alias.
    max_packet_size: Option<u32>,
    /// The source address of the socket (patched rumqttd's
    /// `Protocol::peer`), for the failed-login limit per address.
    peer: Option<std::net::IpAddr>,
}

/// A QoS 2 publish awaiting its PUBREL, as the quotas count it.
struct Pending {
    topic: Bytes,
    retain: bool,
    len: usize,
}

impl Pending {
    /// What the router keeps of it.
    fn bytes(&self) -> usize {
        self.topic.len() + self.len
    }
}

impl DeviceProtocol {
    pub fn new(shared: Arc<ProtocolShared>) -> Self {
        DeviceProtocol {
            shared,
            version: Version::Unknown,
            state: Conn::AwaitingConnect,
            expires_at: None,
            credential: None,
            grant: None,
            awaiting_pubrel: HashMap::new(),
            aliases: HashMap::new(),
            out_aliases: std::sync::Mutex::new(None),
            max_packet_size: None,
            peer: None,
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
        if let Conn::Open(s) | Conn::Ending(s) = std::mem::replace(&mut self.state, Conn::AwaitingConnect) {
            shared.connections.close(&s.device, &s.client_id);
            shared.filters.closed(&s.client_id, s.conn, s.lifetime(), std::time::Instant::now());
            // The router drops what the connection left awaiting PUBREL.
            let pending: usize = self.awaiting_pubrel.values().map(Pending::bytes).sum();
            shared.inflight_bytes.release(&s.device, pending);
            if let Some((will, props)) = s.will {
                // The will waits the delay or the session, whichever is
                // first, and never more than `max_will_delay_s`; it counts
                // against the device's quotas when it goes (`wills`).
                let expiry = s.session_expiry.min(shared.max_will_delay_s);
                shared.wills.arm(&s.client_id, (&s.device, &shared.quotas), will, props, expiry);
            }
            shared.presence.report(Presence::Disconnected { device: s.device, conn: s.conn });
        }
    }
}

impl DeviceProtocol {
    fn refuse(&mut self, why: Refused) -> Packet {
        self.state = Conn::Refused(why);
        codec::refused_connect()
    }

    /// Ends the link (rumqttd closes the connection on a codec error).
    fn end_link(&mut self) -> Error {
        self.state = match std::mem::replace(&mut self.state, Conn::AwaitingConnect) {
            Conn::Open(s) => Conn::Ending(s),
            other => other,
        };
        Error::InvalidProtocol
    }

    /// `Some` when the connection may not go on: its token expired or was
    /// revoked, or a reload removed its device or application. Nothing it
    /// sent now is let through; the link ends with the packet in `Some`, the
    /// DISCONNECT that [`Protocol::ending`] would have sent (an MQTT 5 device
    /// is told why; 3.1.1 has no server DISCONNECT). A packet that arrives
    /// just after the expiry (a PUBACK of the stream) used to end the link
    /// without it.
    fn lapse(&mut self) -> Option<Option<Packet>> {
        let expired = super::auth::expired(self.expires_at);
        let revoked = !expired
            && (self.shared.directory.lapsed(None, self.credential)
                || self.grant.as_ref().is_some_and(|g| self.shared.directory.withdrawn(g)));
        if !expired && !revoked {
            return None;
        }
        tracing::info!(device = ?self.state.session().map(|s| &s.device), "MQTT: token expired or revoked, or device removed, connection closed");
        self.end_link();
        let last = if expired { super::auth::expired_disconnect() } else { super::auth::revoked_disconnect() };
        Some((self.version == Version::V5).then_some(last))
    }

    /// An authenticated CONNECT (or what stands for a refused one) for
    /// rumqttd.
    fn connect(&mut self, packet: Packet) -> Packet {
        let Packet::Connect(mut connect, mut props, will, will_props, login) = packet else {
            unreachable!("called with a CONNECT")
        };
        let (user, password) = match &login {
            Some(l) => (Some(l.username.as_str()), l.password.as_str()),
            None => (None, ""),
        };
        let now = std::time::Instant::now();
        let claimed = DeviceDirectory::device_of(&connect.client_id);
        let connections = &self.shared.connections;
        // Too many failures of this device id, or from this address,
        // lately: refused before the password is checked.
        let authenticated = if !connections.auth_allowed(claimed, self.peer, now) {
            Err(Refused::RateLimited)
        } else {
            self.shared.directory.authenticate(&connect.client_id, user, password).map_err(|why| {
                if why == Refusal::BadCredentials {
                    connections.auth_failed(claimed, self.peer, now);
                }
                Refused::from(why)
            })
        };
        let authenticated = authenticated.and_then(|login| {
            // Everything below the device view is per tenant: the session,
            // presence and the router topics use the mount
            // `{tenant}/{device}`, and the router's client id is scoped by
            // it (review L1: a device of another tenant with the same
            // client id took the session over).
            let mount = super::topics::mount_name(&login.identity.tenant, login.device);
            let router_id = super::topics::router_client_id(&mount, &connect.client_id);
            if will.as_ref().is_some_and(|w| w.message.len() > self.shared.max_will_bytes) {
                Err(Refused::WillTooLarge)
            } else if !connections.open(&mount, &router_id) {
                // Counted under the mount, the key the connection's end
                // closes (`Drop`), and per tenant.
                Err(Refused::TooManyInstances)
            } else {
                let grant = super::auth::DeviceDirectory::grant(&login);
                Ok((login.device.to_string(), mount, router_id, login.identity, login.expires_at, grant))
            }
        });
        let (device, mount, router_id, identity) = match authenticated {
            Ok((device, mount, router_id, identity, expires_at, grant)) => {
                self.expires_at = expires_at;
                self.credential = identity.credential;
                self.grant = Some(grant);
                (device, mount, router_id, identity)
            }
            Err(why) => {
                let client_id = codec::loggable(&connect.client_id);
                tracing::info!(%client_id, reason = why.reason(), "MQTT CONNECT refused");
                return self.refuse(why);
            }
        };
        let shared = &self.shared;
        let conn = shared.connections.next_conn();
        let terms =
            codec::rewrite_connect(&mut connect, &mut props, shared.max_keep_alive, shared.max_session_expiry_s);
        connect.client_id = router_id;
        let client_id = connect.client_id.clone();
        let v5 = self.version == Version::V5;
        if v5 {
            *self.out_aliases.get_mut().unwrap_or_else(std::sync::PoisonError::into_inner) =
                codec::OutAliases::new(terms.topic_alias_max);
            self.max_packet_size = terms.max_packet_size;
        }
        let lifetime = Lifetime::of(v5, connect.clean_session, terms.session_expiry);
        shared.filters.connected(&client_id, conn, v5, connect.clean_session, lifetime, now);
        shared.wills.cancel(&client_id);
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
            session_expiry: terms.session_expiry,
            v5,
            clean: connect.clean_session,
            server_keep_alive: terms.server_keep_alive,
            server_session_expiry: terms.server_session_expiry,
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
            Conn::AwaitingConnect | Conn::Refused(_) | Conn::Ending(_) => return Err(Error::InvalidProtocol),
        };
        match packet {
            // A second CONNECT is a protocol violation: the server closes
            // the connection (MQTT-3.1.0-2).
            Packet::Connect(..) => Err(self.end_link()),
            // Passed to the router (its Session Expiry may change the
            // session's): see `screen_disconnect`.
            Packet::Disconnect(..) => Ok(packet),
            other => {
                let other = codec::resolve_alias(&mut self.aliases, other);
                codec::mount_inbound(&session.device, &self.shared.shared_prefix, &session.request_topic, other)
            }
        }
    }
}

impl DeviceProtocol {
    /// A PUBLISH (mounted) within the device's quotas and the Receive
    /// Maximum goes on; else its refusal.
    fn screen_publish(&mut self, device: &str, packet: Packet) -> Verdict {
        let Packet::Publish(publish, _) = &packet else { unreachable!("called with a PUBLISH") };
        let (qos, pkid) = (publish.qos(), publish.pkid());
        if publish.topic.is_empty() {
            tracing::info!(device, "MQTT: topic alias invalid, connection closed");
            self.end_link();
            return codec::topic_alias_invalid(self.version);
        }
        let awaiting = qos == QoS::ExactlyOnce && !self.awaiting_pubrel.contains_key(&pkid);
        if awaiting && self.awaiting_pubrel.len() >= usize::from(self.shared.receive_max) {
            tracing::info!(
                device,
                "MQTT: more QoS 2 publishes awaiting PUBREL than the Receive Maximum, connection closed"
            );
            self.end_link();
            return codec::receive_maximum_exceeded(self.version);
        }
        // Bytes of this QoS 2 publish in place of a pending one of its id.
        let bytes = (qos == QoS::ExactlyOnce).then(|| {
            (self.awaiting_pubrel.get(&pkid).map_or(0, Pending::bytes), publish.topic.len() + publish.payload.len())
        });
        if let Some((old, new)) = bytes {
            if !self.shared.inflight_bytes.replace(device, old, new) {
                tracing::info!(device, "MQTT: too many bytes awaiting PUBREL, connection closed");
                self.end_link();
                return codec::quota_disconnect(self.version, Quota::InflightBytes);
            }
        }
        let counted = self.shared.quotas.publish(device, &publish.topic, publish.retain, publish.payload.len());
        match counted {
            Ok(()) => {
                if qos == QoS::ExactlyOnce {
                    // A resend replaces (the router keeps one per id).
                    let pending =
                        Pending { topic: publish.topic.clone(), retain: publish.retain, len: publish.payload.len() };
                    self.awaiting_pubrel.insert(pkid, pending);
                }
                Verdict::Forward(packet)
            }
            Err(quota) => {
                if let Some((old, new)) = bytes {
                    self.shared.inflight_bytes.undo(device, old, new);
                }
                tracing::debug!(device, reason = quota.reason(), "MQTT: PUBLISH refused");
                let verdict = codec::refuse_publish(self.version, qos, pkid, quota);
                if matches!(verdict, Verdict::Close(_)) {
                    tracing::info!(device, reason = quota.reason(), "MQTT: PUBLISH refused, connection closed");
                    self.end_link();
                }
                verdict
            }
        }
    }

    /// A DISCONNECT ends the connection: the router gets it (it applies
    /// the Session Expiry Interval the DISCONNECT may carry, and ends the
    /// link), and nothing more is read. The will is dropped unless the
    /// reason is 0x04. Changing the expiry from 0 is a protocol error
    /// (MQTT-3.14.2-2): DISCONNECT 0x82, and since the DISCONNECT is not a
    /// valid one the will stays.
    fn screen_disconnect(&mut self, packet: Packet) -> Verdict {
        let Packet::Disconnect(d, mut props) = packet else { unreachable!("called with a DISCONNECT") };
        // No longer than `mqtt.max_session_expiry_s`, as at CONNECT.
        let max = self.shared.max_session_expiry_s;
        if let Some(e) = props.as_mut().and_then(|p| p.session_expiry_interval.as_mut()) {
            *e = (*e).min(max);
        }
        let asked = props.as_ref().and_then(|p| p.session_expiry_interval);
        let Conn::Open(session) = &mut self.state else { return Verdict::Close(None) };
        if session.v5 && session.session_expiry == 0 && asked.is_some_and(|e| e != 0) {
            tracing::info!(device = %session.device, "MQTT: DISCONNECT set a session expiry from 0, connection closed");
            self.end_link();
            return Verdict::Close(Some(codec::session_expiry_protocol_error()));
        }
        if d.reason_code != DisconnectReasonCode::DisconnectWithWillMessage {
            session.will = None;
        }
        if let Some(expiry) = asked.filter(|_| session.v5) {
            session.session_expiry = expiry;
        }
        self.end_link();
        Verdict::Forward(Packet::Disconnect(d, props))
    }

    /// A SUBSCRIBE (mounted) within the connection's subscriptions and the
    /// device's topics goes on; else it is refused whole.
    fn screen_subscribe(&mut self, device: &str, packet: Packet) -> Verdict {
        let Packet::Subscribe(subscribe, _) = &packet else { unreachable!("called with a SUBSCRIBE") };
        let Some(client_id) = self.state.session().map(|s| s.client_id.as_str()) else {
            unreachable!("screened after CONNECT")
        };
        let shared = &self.shared;
        let keys: Vec<u64> = subscribe.filters.iter().map(|f| shared.quotas.key(f.path.as_bytes())).collect();
        let counted = shared
            .filters
            .subscribe(client_id, &keys, shared.max_subscriptions, || shared.quotas.subscribe(device, &keys));
        match counted {
            Ok(()) => Verdict::Forward(packet),
            Err(quota) => {
                tracing::debug!(device, reason = quota.reason(), "MQTT: SUBSCRIBE refused");
                Verdict::Answer(codec::refuse_subscribe(self.version, subscribe.pkid, keys.len(), quota))
            }
        }
    }
}

impl Protocol for DeviceProtocol {
    /// Ends the connection at its token's expiry (MQTT 5 DISCONNECT 0xA0)
    /// or as soon as its token is revoked or a reload removes its device
    /// or application (0x87), even if the device only listens: patched
    /// rumqttd's link waits on this next to the socket.
    /// Revocations are announced (`DeviceDirectory::revocations`), not
    /// polled; 3.1.1 has no server DISCONNECT: the socket is closed.
    fn ending(&self) -> Option<rumqttd::protocol::Ending> {
        let (expires_at, credential) = (self.expires_at, self.credential);
        let grant = self.grant.clone()?;
        let mut changes = self.shared.directory.revocations();
        let shared = self.shared.clone();
        let device = self.state.session().map(|s| s.device.clone());
        let v5 = self.version == Version::V5;
        Some(Box::pin(async move {
            let expiry = async {
                match expires_at {
                    Some(at) => {
                        let wait = u64::try_from(at - crate::task::now_ms()).unwrap_or(0);
                        tokio::time::sleep(std::time::Duration::from_millis(wait)).await;
                    }
                    None => std::future::pending().await,
                }
            };
            let revoked = async {
                // A revocation between the CONNECT and now is seen here;
                // later ones are announced.
                while !shared.directory.lapsed(None, credential) && !shared.directory.withdrawn(&grant) {
                    if changes.changed().await.is_err() {
                        return std::future::pending().await;
                    }
                }
            };
            let last = tokio::select! {
                _ = expiry => super::auth::expired_disconnect(),
                _ = revoked => super::auth::revoked_disconnect(),
            };
            tracing::info!(?device, "MQTT: token expired or revoked, connection closed");
            v5.then_some(last)
        }))
    }

    fn peer(&mut self, addr: std::net::SocketAddr) {
        // An IPv4 client of a dual-stack listener is one address, however
        // it is written.
        self.peer = Some(addr.ip().to_canonical());
    }

    /// Every packet after CONNECT, mounted, before the router sees it: the
    /// limits that rumqttd does not have.
    fn screen(&mut self, packet: Packet) -> Verdict {
        let Some(device) = self.state.session().map(|s| s.device.clone()) else {
            return Verdict::Forward(packet);
        };
        if let Some(last) = self.lapse() {
            return Verdict::Close(last);
        }
        match packet {
            Packet::Publish(..) => self.screen_publish(&device, packet),
            Packet::Subscribe(..) => self.screen_subscribe(&device, packet),
            Packet::Disconnect(..) => self.screen_disconnect(packet),
            Packet::Unsubscribe(ref unsub, _) => {
                if let Some(s) = self.state.session() {
                    let keys = unsub.filters.iter().map(|f| self.shared.quotas.key(f.as_bytes()));
                    self.shared.filters.unsubscribe(&s.client_id, keys);
                }
                Verdict::Forward(packet)
            }
            Packet::PubRel(ref rel, _) => {
                if let Some(p) = self.awaiting_pubrel.remove(&rel.pkid) {
                    self.shared.quotas.release(&device, &p.topic, p.retain, p.len);
                    self.shared.inflight_bytes.release(&device, p.bytes());
                }
                Verdict::Forward(packet)
            }
            other => Verdict::Forward(other),
        }
    }

    fn read_mut(&mut self, stream: &mut BytesMut, max_size: usize) -> Result<Packet, Error> {
        // A lapsed credential is screened (see `lapse`), so that an MQTT 5
        // device that sends something after it is told why too.
        if self.version == Version::Unknown {
            match codec::detect_version(stream, max_size)? {
                Detected::Supported(v) => self.version = v,
                Detected::Unsupported { frame } => {
                    // MQTT 3.1 ("MQIsdp") and unknown levels: a 3.1.1 refusal.
                    stream.advance(frame);
                    self.version = Version::V4;
                    return Ok(self.refuse(Refusal::ProtocolVersion.into()));
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
            Conn::Refused(why) => Some(*why),
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
        let packet = codec::with_server_keep_alive(packet, self.state.session().and_then(|s| s.server_keep_alive));
        let packet =
            codec::with_server_session_expiry(packet, self.state.session().and_then(|s| s.server_session_expiry));
        let packet = match refused {
            None => codec::with_topic_alias_max(codec::with_receive_maximum(packet, self.shared.receive_max)),
            Some(_) => packet,
        };
        match self.version {
            Version::V4 => V4.write(packet, write),
            Version::V5 => self.write_v5(packet, write),
            Version::Unknown => Err(Error::InvalidProtocol),
        }
    }
}

impl DeviceProtocol {
    /// An MQTT 5 packet, a PUBLISH with a topic alias where the device
    /// allows them ([`codec::OutAliases`]).
    fn write_v5(&self, packet: Packet, write: &mut BytesMut) -> Result<usize, Error> {
        let mut aliases = self.out_aliases.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let (Some(aliases), Packet::Publish(publish, _)) = (aliases.as_mut(), &packet) else {
            return V5.write(packet, write);
        };
        let topic = publish.topic.clone();
        let plan = aliases.plan(&topic);
        let start = write.len();
        let n = V5.write(codec::with_alias(packet, &plan), write)?;
        // The link leaves out a PUBLISH over the device's maximum
        // (MQTT-3.1.2-24): then the device never learnt the alias.
        if self.max_packet_size.is_none_or(|max| write.len() - start <= max as usize) {
            aliases.commit(&plan, topic);
        }
        Ok(n)
    }
}
