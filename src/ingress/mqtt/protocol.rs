//! [`DeviceProtocol`]: the codec every device connection goes through. It
//! wraps rumqttd's MQTT 3.1.1 and 5 codecs (rumqttd clones it once per
//! connection, and its `read_mut` sees every packet before the router
//! does), which is where edgeway enforces what rumqttd lacks:
//!
//! - **One port, both versions**: the protocol level of CONNECT picks the
//!   codec.
//! - **Authentication with a CONNACK**: the device id, user name and
//!   password (or JWT) are checked here. A refused CONNECT is replaced by a
//!   harmless placeholder (unique id, no will, clean session) so that
//!   rumqttd answers it, and its CONNACK is rewritten to the refusal code
//!   (rumqttd's own auth hook would close the socket without a CONNACK, and
//!   a device could not tell bad credentials from a bad network).
//! - **Isolation by construction**: every topic, filter and will topic of
//!   the device is mounted under `d/{device}/` (see [`super::topics`]), and
//!   unmounted on the way out. A device subscribing to `#` only ever
//!   matches its own subtree.
//! - **Presence**: authenticated connections report when they start and,
//!   when the codec is dropped with the connection, when they end.
//! - rumqttd quirks: `keep_alive = 0` (refused by rumqttd) becomes the
//!   longest keep-alive; broker-side topic aliases (rumqttd assigns them per
//!   filter, not per topic) are never enabled; MQTT 5 properties never
//!   reach a 3.1.1 codec; the MQTT 5 message expiry of a request is carried
//!   to edgeway as an absolute time instead of letting the router drop the
//!   message silently.
//! - **Reconnects and wills**: rumqttd's router numbers connections by
//!   reusable slots, and a link that ends by itself reports "closed" for
//!   its slot afterwards. When the same client id reconnects at once, the
//!   router has already dropped the old connection (on its DISCONNECT, or
//!   as a duplicate id) and given the slot to the new one, so the late
//!   report removes the *new* connection: its subscriptions vanish and its
//!   SUBSCRIBE gets no SUBACK (about 1 immediate reconnect in 20 here). So
//!   (a) DISCONNECT never reaches the router: the codec ends the link (one
//!   removal), and (b) a connection whose client id still has an *ending*
//!   connection (its codec ended the link; rumqttd has yet to take its
//!   report) gets a broker id of its own (`{id}~c{n}`: no duplicate, no
//!   slot handover). A reconnect while the old connection is alive is a
//!   plain MQTT takeover (same id: the old connection is closed, the
//!   session continues). A second CONNECT on a connection closes it. Wills are
//!   therefore kept here, not in the router: taken out of CONNECT, dropped
//!   on a clean DISCONNECT (kept with MQTT 5's reason 0x04), and handed to
//!   edgeway to publish (QoS 0, in the device's subtree) when the
//!   connection ends any other way, after the MQTT 5 will delay unless the
//!   client id connects again first, or at once when the session ends with
//!   the connection (MQTT 5 Session Expiry 0, and 3.1.1). A reconnect under
//!   its own broker id starts a fresh broker session (edgeway's streams
//!   resume by `seq`). What remains: a client that closes its socket
//!   without DISCONNECT and is back before rumqttd has noticed can still
//!   meet the slot race (the codec never sees the socket close).
//! - rumqttd's listener keeps a per-client-id map for will handling; a
//!   connection that fails between CONNECT and the first read (its CONNACK
//!   could not be written: the peer vanished) leaves a dead entry behind,
//!   and the next connection with that client id panics on it and poisons
//!   the map for every later connection. So the client id rumqttd sees is
//!   the device's own until that happens once; from then on that client id
//!   connects under a fresh alias (`{id}~{n}`). Refused connections use a
//!   small pool of placeholder ids the same way.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::{Buf, BytesMut};
use rumqttd::protocol::v4::V4;
use rumqttd::protocol::v5::V5;
use rumqttd::protocol::{
    ConnAckProperties, Connect, ConnectReturnCode, DisconnectReasonCode, Error, LastWill, LastWillProperties, Packet,
    Protocol, PublishProperties,
};
use tokio::sync::mpsc::UnboundedSender;
use tokio_util::sync::CancellationToken;

use super::auth::{DeviceDirectory, Refusal};
use super::requests::{Change, Sessions};
use super::topics::{mount_filter, mount_topic, unmount, Topics};
use crate::task::Identity;

/// User property that carries a request's MQTT 5 message expiry to edgeway
/// as unix milliseconds.
pub const EXPIRES_AT_PROPERTY: &str = "edgeway-expires-at-ms";

/// A device connection starting or ending.
#[derive(Debug, Clone)]
pub enum Presence {
    Connected { device: String, client_id: String, conn: u64, identity: Identity },
    Disconnected { device: String, conn: u64 },
}

/// A will to publish for a connection that ended without a clean
/// DISCONNECT: its topic is already mounted in the device's subtree.
#[derive(Debug)]
pub struct PendingWill {
    pub client_id: String,
    /// Tells this will from a later one of the same client id.
    pub generation: u64,
    pub topic: String,
    pub payload: bytes::Bytes,
    pub retain: bool,
    pub props: Option<PublishProperties>,
    pub delay: std::time::Duration,
    /// Cancelled when the same client id connects again before the delay
    /// is over.
    pub cancel: CancellationToken,
}

/// What all connections share.
pub struct ProtocolShared {
    pub directory: DeviceDirectory,
    pub topics: Topics,
    /// Updated at once (before the router sees the connection), then the
    /// event is sent on `presence`.
    pub sessions: Arc<Sessions>,
    pub presence: UnboundedSender<Change>,
    /// Wills of connections that ended without a clean DISCONNECT.
    wills: UnboundedSender<PendingWill>,
    /// Wills not yet published, by client id, with their generation.
    pending_wills: Mutex<HashMap<String, (u64, CancellationToken)>>,
    next_conn: AtomicU64,
    /// Client ids whose rumqttd-side id is spoiled, and how many times.
    spoiled: Mutex<HashMap<String, u32>>,
    /// Open connections per client id (authenticated, codec not dropped):
    /// connection number → whether it is ending (its codec has ended the
    /// link; rumqttd is about to report it closed).
    open: Mutex<HashMap<String, HashMap<u64, bool>>>,
    /// Placeholder ids for refused connections: next one and spoiled ones.
    placeholders: Mutex<(u64, HashSet<u64>)>,
}

impl ProtocolShared {
    pub fn new(
        directory: DeviceDirectory,
        topics: Topics,
        sessions: Arc<Sessions>,
        presence: UnboundedSender<Change>,
        wills: UnboundedSender<PendingWill>,
    ) -> Self {
        ProtocolShared {
            directory,
            topics,
            sessions,
            presence,
            wills,
            pending_wills: Mutex::default(),
            next_conn: AtomicU64::new(1),
            spoiled: Mutex::default(),
            open: Mutex::default(),
            placeholders: Mutex::default(),
        }
    }

    /// The id rumqttd sees for connection `conn` of a client id, which is
    /// now counted as open.
    ///
    /// A reconnect while the old connection is alive is a normal MQTT
    /// session takeover: same id, rumqttd drops the old connection and the
    /// new one gets its session. But while an old connection is *ending*
    /// (its codec ended the link, e.g. on DISCONNECT, and rumqttd has yet
    /// to process its "closed" report), the new one gets an id of its own:
    /// rumqttd would otherwise drop the old connection at once, give its
    /// slot to the new one, and then apply the late report to the new one.
    ///
    /// The codec cannot see an old connection whose socket was simply
    /// closed (rumqttd reads EOF below it) until rumqttd drops it, right
    /// after sending its "closed" report. So while another connection of
    /// the client id is open, this waits a little (up to
    /// `TAKEOVER_WAIT`) for it to go: a closed one is gone within a
    /// millisecond or two, and its report is then ahead of this CONNECT in
    /// the router's queue; one still open after the wait is alive (a
    /// half-open link) and taken over.
    fn broker_id(&self, client_id: &str, conn: u64) -> String {
        let started = std::time::Instant::now();
        let ending = loop {
            let mut open = self.open.lock().expect("open");
            let conns = open.entry(client_id.to_string()).or_default();
            let others = conns.len();
            let ending = conns.values().any(|&e| e);
            if others == 0 || ending || started.elapsed() >= TAKEOVER_WAIT || !can_block() {
                conns.insert(conn, false);
                break ending;
            }
            drop(open);
            tokio::task::block_in_place(|| std::thread::sleep(std::time::Duration::from_millis(1)));
        };
        if ending {
            return format!("{client_id}~c{conn}");
        }
        match self.spoiled.lock().expect("spoiled").get(client_id) {
            None => client_id.to_string(),
            Some(n) => format!("{client_id}~{n}"),
        }
    }

    /// The codec of `conn` ended its link.
    fn ending(&self, client_id: &str, conn: u64) {
        if let Some(e) = self.open.lock().expect("open").get_mut(client_id).and_then(|c| c.get_mut(&conn)) {
            *e = true;
        }
    }

    fn closed(&self, client_id: &str, conn: u64) {
        let mut open = self.open.lock().expect("open");
        if let Some(conns) = open.get_mut(client_id) {
            conns.remove(&conn);
            if conns.is_empty() {
                open.remove(client_id);
            }
        }
    }

    /// A placeholder id not spoiled yet: one of the reused pool, or a fresh
    /// one past it when the whole pool is spoiled.
    fn placeholder(&self) -> u64 {
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

    fn report(&self, p: Presence) {
        let change = self.sessions.apply(&p);
        let _ = self.presence.send(change);
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Version {
    Unknown,
    V4,
    V5,
}

/// The codec of one device connection (the prototype given to rumqttd's
/// `Server` is never used for a connection itself).
pub struct DeviceProtocol {
    shared: Arc<ProtocolShared>,
    version: Version,
    /// The authenticated device and this connection's number.
    device: Option<(String, u64)>,
    /// The broker knows this connection under an id of its own (see
    /// `ProtocolShared::broker_id`).
    own_broker_id: bool,
    /// MQTT 5 Session Expiry Interval from CONNECT, seconds (0: the session
    /// ends with the connection).
    session_expiry: u32,
    /// The connection's will (topic mounted), until a clean DISCONNECT.
    will: Option<(LastWill, Option<LastWillProperties>)>,
    refused: Option<Refusal>,
    /// Device-view request topic, for the expiry rewrite.
    request_topic: String,
    /// The client id as sent and, for refusals, the placeholder used.
    client_id: Option<String>,
    placeholder: Option<u64>,
    /// CONNECT was handed to rumqttd, and rumqttd read again after it (so
    /// the connection got past its CONNACK).
    connect_returned: bool,
    established: bool,
}

impl DeviceProtocol {
    pub fn new(shared: Arc<ProtocolShared>) -> Self {
        DeviceProtocol {
            shared,
            version: Version::Unknown,
            device: None,
            own_broker_id: false,
            session_expiry: 0,
            will: None,
            refused: None,
            request_topic: String::new(),
            client_id: None,
            placeholder: None,
            connect_returned: false,
            established: false,
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
        if self.connect_returned && !self.established {
            // Ended between CONNECT and its first read: rumqttd's id is
            // spoiled (see the module docs).
            if let Some(k) = self.placeholder {
                self.shared.placeholders.lock().expect("placeholders").1.insert(k);
            } else if let (Some(id), false) = (&self.client_id, self.own_broker_id) {
                // (An id of its own is never used again anyway.)
                *self.shared.spoiled.lock().expect("spoiled").entry(id.clone()).or_insert(0) += 1;
            }
        }
        if let Some((device, conn)) = self.device.take() {
            if let Some(client_id) = &self.client_id {
                self.shared.closed(client_id, conn);
                if let Some((will, props)) = self.will.take() {
                    self.shared.arm_will(client_id, will, props, self.session_expiry);
                }
            }
            self.shared.report(Presence::Disconnected { device, conn });
        }
    }
}

impl ProtocolShared {
    /// `session_expiry`: the MQTT 5 Session Expiry Interval of the
    /// connection (0 for 3.1.1): the will goes at the end of the delay or of
    /// the session, whichever comes first.
    fn arm_will(&self, client_id: &str, will: LastWill, props: Option<LastWillProperties>, session_expiry: u32) {
        let cancel = CancellationToken::new();
        let generation = self.next_conn.fetch_add(1, Ordering::Relaxed);
        let old = self.pending_wills.lock().expect("wills").insert(client_id.to_string(), (generation, cancel.clone()));
        if let Some((_, old)) = old {
            old.cancel();
        }
        let delay = props.as_ref().and_then(|p| p.delay_interval).unwrap_or(0).min(session_expiry);
        let delay = std::time::Duration::from_secs(delay.into());
        let props = props.map(|p| PublishProperties {
            payload_format_indicator: p.payload_format_indicator,
            message_expiry_interval: p.message_expiry_interval,
            content_type: p.content_type,
            // As the device sent it, like a PUBLISH's (only topic names
            // are mounted).
            response_topic: p.response_topic,
            correlation_data: p.correlation_data,
            user_properties: p.user_properties,
            ..Default::default()
        });
        let _ = self.wills.send(PendingWill {
            client_id: client_id.to_string(),
            generation,
            topic: String::from_utf8_lossy(&will.topic).into_owned(),
            payload: will.message,
            retain: will.retain,
            props,
            delay,
            cancel,
        });
    }

    /// A client id connected: a delayed will of its last connection is not
    /// published.
    fn cancel_will(&self, client_id: &str) {
        if let Some((_, t)) = self.pending_wills.lock().expect("wills").remove(client_id) {
            t.cancel();
        }
    }

    /// A will was published or cancelled: forget it, unless a newer one of
    /// the same client id took its place.
    pub fn will_done(&self, w: &PendingWill) {
        let mut g = self.pending_wills.lock().expect("wills");
        if g.get(&w.client_id).is_some_and(|(gen, _)| *gen == w.generation) {
            g.remove(&w.client_id);
        }
    }
}

/// How long a CONNECT waits for an open connection of its client id to go
/// (see `ProtocolShared::broker_id`).
const TAKEOVER_WAIT: std::time::Duration = std::time::Duration::from_millis(100);

/// Whether this thread may block briefly: a worker of a multi-threaded
/// runtime (`block_in_place` hands its other tasks to other workers).
fn can_block() -> bool {
    tokio::runtime::Handle::try_current()
        .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread)
}

/// Placeholder ids for refused connections (rumqttd keeps a little state
/// per id ever used, so they are reused).
const PLACEHOLDERS: u64 = 256;

/// The protocol level of a framed CONNECT at the start of `stream`.
fn connect_level(stream: &BytesMut, max_size: usize) -> Result<(usize, u8, bool), Error> {
    let fh = rumqttd::protocol::v4::check(stream.iter(), max_size)?;
    if stream[0] >> 4 != 1 {
        // The first packet must be CONNECT.
        return Err(Error::IncorrectPacketFormat);
    }
    let body = &stream[fh.fixed_header_len..fh.frame_length()];
    if body.len() < 2 {
        return Err(Error::MalformedPacket);
    }
    let name_len = u16::from_be_bytes([body[0], body[1]]) as usize;
    let level = *body.get(2 + name_len).ok_or(Error::MalformedPacket)?;
    let is_mqtt = &body[2..2 + name_len] == b"MQTT";
    Ok((fh.frame_length(), level, is_mqtt))
}

impl DeviceProtocol {
    fn placeholder_connect(&mut self, why: Refusal) -> Packet {
        self.refused = Some(why);
        let k = self.shared.placeholder();
        self.placeholder = Some(k);
        // '@' is not a device id character: no collision with a device.
        let connect = Connect { keep_alive: 1, client_id: format!("@refused-{k}"), clean_session: true };
        Packet::Connect(connect, None, None, None, None)
    }

    /// Ends the link (rumqttd closes the connection on a codec error), and
    /// says so for `ProtocolShared::broker_id`.
    fn end_link(&mut self) -> Result<Packet, Error> {
        if let (Some((_, conn)), Some(client_id)) = (&self.device, &self.client_id) {
            self.shared.ending(client_id, *conn);
        }
        Err(Error::InvalidProtocol)
    }

    fn mounted_device(&self) -> Result<&str, Error> {
        self.device.as_ref().map(|(d, _)| d.as_str()).ok_or(Error::InvalidProtocol)
    }

    /// Device → router.
    fn inbound(&mut self, packet: Packet) -> Result<Packet, Error> {
        match packet {
            Packet::Connect(..) if self.device.is_some() => {
                // A second CONNECT is a protocol violation: the server closes
                // the connection (MQTT-3.1.0-2).
                self.end_link()
            }
            Packet::Connect(mut connect, props, will, will_props, login) => {
                let (user, password) = match &login {
                    Some(l) => (Some(l.username.as_str()), l.password.as_str()),
                    None => (None, ""),
                };
                let (device, identity) = match self.shared.directory.authenticate(&connect.client_id, user, password) {
                    Ok((device, id)) => (device.to_string(), id),
                    Err(why) => {
                        tracing::info!(client_id = %connect.client_id, reason = why.reason(), "MQTT CONNECT refused");
                        return Ok(self.placeholder_connect(why));
                    }
                };
                let conn = self.shared.next_conn.fetch_add(1, Ordering::Relaxed);
                self.request_topic = format!("{}req", self.shared.topics.device_space(&device));
                // edgeway keeps the will (see the module docs).
                self.will = will.map(|mut w| {
                    w.topic = mount_topic(&device, &String::from_utf8_lossy(&w.topic)).into();
                    (w, will_props)
                });
                self.session_expiry = props.as_ref().and_then(|p| p.session_expiry_interval).unwrap_or(0);
                let props = props.map(|mut p| {
                    p.topic_alias_max = None;
                    p
                });
                if connect.keep_alive == 0 {
                    connect.keep_alive = u16::MAX;
                }
                let client_id = connect.client_id.clone();
                self.shared.cancel_will(&client_id);
                connect.client_id = self.shared.broker_id(&client_id, conn);
                self.own_broker_id = connect.client_id.ends_with(&format!("~c{conn}"));
                self.client_id = Some(client_id.clone());
                self.shared.report(Presence::Connected { device: device.clone(), client_id, conn, identity });
                self.device = Some((device, conn));
                Ok(Packet::Connect(connect, props, None, None, login))
            }
            Packet::Disconnect(d, _) => {
                self.mounted_device()?;
                if d.reason_code != DisconnectReasonCode::DisconnectWithWillMessage {
                    self.will = None;
                }
                // Ends the link here: the router then removes the
                // connection once, when the link reports it closed.
                self.end_link()
            }
            Packet::Publish(mut publish, mut props) => {
                let device = self.mounted_device()?.to_string();
                if !publish.topic.is_empty() {
                    let topic = std::str::from_utf8(&publish.topic).map_err(|_| Error::TopicNotUtf8)?;
                    if topic.contains(['+', '#']) {
                        return Err(Error::MalformedPacket);
                    }
                    if topic == self.request_topic {
                        if let Some(p) = props.as_mut() {
                            expiry_to_property(p);
                        }
                    }
                    publish.topic = mount_topic(&device, topic).into();
                }
                Ok(Packet::Publish(publish, props))
            }
            Packet::Subscribe(mut sub, props) => {
                let device = self.mounted_device()?;
                let shared = self.shared.topics.shared_prefix();
                for f in &mut sub.filters {
                    f.path = mount_filter(device, &shared, &f.path);
                }
                Ok(Packet::Subscribe(sub, props))
            }
            Packet::Unsubscribe(mut unsub, props) => {
                let device = self.mounted_device()?;
                let shared = self.shared.topics.shared_prefix();
                for f in &mut unsub.filters {
                    *f = mount_filter(device, &shared, f);
                }
                Ok(Packet::Unsubscribe(unsub, props))
            }
            other => {
                self.mounted_device()?;
                Ok(other)
            }
        }
    }

    /// Router → device.
    fn outbound(&self, packet: Packet) -> Result<Packet, Error> {
        let v5 = self.version == Version::V5;
        Ok(match packet {
            Packet::ConnAck(mut ack, props) => match self.refused {
                Some(why) => {
                    ack.session_present = false;
                    ack.code = match (why, v5) {
                        (Refusal::ClientIdNotValid, _) => ConnectReturnCode::ClientIdentifierNotValid,
                        (Refusal::BadCredentials, _) => ConnectReturnCode::BadUserNamePassword,
                        (Refusal::ProtocolVersion, false) => ConnectReturnCode::RefusedProtocolVersion,
                        (Refusal::ProtocolVersion, true) => ConnectReturnCode::UnsupportedProtocolVersion,
                    };
                    let props = v5.then(|| ConnAckProperties {
                        reason_string: Some(why.reason().to_string()),
                        ..Default::default()
                    });
                    Packet::ConnAck(ack, props)
                }
                None => Packet::ConnAck(ack, if v5 { props } else { None }),
            },
            Packet::Publish(mut publish, props) => {
                let device = self.mounted_device()?;
                let internal = std::str::from_utf8(&publish.topic).map_err(|_| Error::TopicNotUtf8)?;
                // The mounting rules make this impossible; fail closed.
                let topic = unmount(device, internal).ok_or(Error::InvalidProtocol)?.to_string();
                publish.topic = topic.into();
                let props = if v5 {
                    props.map(|mut p| {
                        p.topic_alias = None;
                        p
                    })
                } else {
                    None
                };
                Packet::Publish(publish, props)
            }
            other if v5 => other,
            Packet::PubAck(p, _) => Packet::PubAck(p, None),
            Packet::SubAck(p, _) => Packet::SubAck(p, None),
            Packet::UnsubAck(p, _) => Packet::UnsubAck(p, None),
            Packet::PubRec(p, _) => Packet::PubRec(p, None),
            Packet::PubRel(p, _) => Packet::PubRel(p, None),
            Packet::PubComp(p, _) => Packet::PubComp(p, None),
            Packet::Disconnect(p, _) => Packet::Disconnect(p, None),
            other => other,
        })
    }
}

/// Replaces a relative MQTT 5 message expiry by an absolute one in a user
/// property, so that edgeway, not the router, decides what happens to a
/// stale request.
fn expiry_to_property(p: &mut PublishProperties) {
    if let Some(secs) = p.message_expiry_interval.take() {
        p.user_properties.retain(|(k, _)| k != EXPIRES_AT_PROPERTY);
        let at = crate::task::now_ms() + i64::from(secs) * 1000;
        p.user_properties.push((EXPIRES_AT_PROPERTY.to_string(), at.to_string()));
    }
}

impl Protocol for DeviceProtocol {
    fn read_mut(&mut self, stream: &mut BytesMut, max_size: usize) -> Result<Packet, Error> {
        self.established |= self.connect_returned;
        if self.refused.is_some() {
            // Nothing after a refused CONNECT: the connection ends.
            return Err(Error::InvalidProtocol);
        }
        if self.version == Version::Unknown {
            let (frame, level, is_mqtt) = connect_level(stream, max_size)?;
            match (is_mqtt, level) {
                (true, 4) => self.version = Version::V4,
                (true, 5) => self.version = Version::V5,
                _ => {
                    // MQTT 3.1 ("MQIsdp") and unknown levels: a 3.1.1 refusal.
                    stream.advance(frame);
                    self.version = Version::V4;
                    self.connect_returned = true;
                    return Ok(self.placeholder_connect(Refusal::ProtocolVersion));
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
                let _ = self.end_link();
                return Err(e);
            }
        };
        let is_connect = matches!(packet, Packet::Connect(..));
        let packet = match self.inbound(packet) {
            Ok(p) => p,
            Err(e) => {
                let _ = self.end_link();
                return Err(e);
            }
        };
        self.connect_returned |= is_connect;
        Ok(packet)
    }

    fn write(&self, packet: Packet, write: &mut BytesMut) -> Result<usize, Error> {
        let packet = self.outbound(packet)?;
        match self.version {
            Version::V4 => V4.write(packet, write),
            Version::V5 => V5.write(packet, write),
            Version::Unknown => Err(Error::InvalidProtocol),
        }
    }
}
