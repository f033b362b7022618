//! The packet rewriting of [`super::protocol::DeviceProtocol`], as pure
//! functions of the packet and what the connection knows (its version, its
//! device, whether it was refused): no sockets, no shared state, so each
//! rule is unit-tested here.
//!
//! - **Version detection**: the protocol level of CONNECT picks rumqttd's
//!   3.1.1 or 5 codec ([`detect_version`]).
//! - **Mounting**: every topic, filter and will topic of a device goes
//!   under its private subtree on the way in and comes out of it on the way
//!   out (the names are [`super::topics`]'s).
//! - **CONNECT**: `keep_alive = 0` (refused by rumqttd, and "no keep-alive"
//!   would hold a dead connection for ever) and keep-alives above
//!   `mqtt.max_keep_alive_s` become that maximum (MQTT 5 clients are told in
//!   the CONNACK's Server Keep Alive); broker-side topic aliases (rumqttd assigns them per filter,
//!   not per topic) are never enabled; the will is taken out (edgeway
//!   keeps it, see [`super::wills`]).
//! - **CONNACK** of a refused CONNECT carries the refusal code (rumqttd
//!   answered the stand-in of [`refused_connect`]).
//! - **Refusals after CONNECT** ([`refuse_publish`], [`refuse_subscribe`],
//!   [`receive_maximum_exceeded`]): what the link writes instead of passing
//!   a packet over a limit to the router (patched rumqttd's
//!   `Protocol::screen`). MQTT 5: PUBACK/PUBREC/SUBACK 0x97 Quota exceeded,
//!   DISCONNECT 0x93 Receive Maximum exceeded, DISCONNECT 0x97 for a QoS 0
//!   publish (which has no acknowledgement). 3.1.1 has no reason code in
//!   PUBACK: a refused publish closes the connection; a refused SUBSCRIBE
//!   gets SUBACK 0x80 Failure.
//! - **Topic aliases** a device sets are resolved here ([`resolve_alias`],
//!   at most [`TOPIC_ALIAS_MAX`] per connection, told in the CONNACK): the
//!   router and the quotas only ever see whole topics (a quota counted by
//!   the topic of the packet would otherwise count every alias-only publish
//!   as one on ""). An alias never set or past the maximum ends the
//!   connection (DISCONNECT 0x94 Topic Alias invalid).
//! - MQTT 5 properties never reach a 3.1.1 device; the MQTT 5 message
//!   expiry of a request is carried to edgeway as an absolute time
//!   ([`EXPIRES_AT_PROPERTY`]) instead of letting the router drop the
//!   message silently.
//!
//! Owns: the byte- and packet-level rules. Does not own: authentication
//! ([`super::auth`]), connection bookkeeping ([`super::connections`]).

use std::collections::HashMap;

use bytes::{Bytes, BytesMut};
use rumqttd::protocol::{
    ConnAckProperties, Connect, ConnectProperties, ConnectReturnCode, Disconnect, DisconnectProperties,
    DisconnectReasonCode, Error, LastWill, Packet, PubAck, PubAckProperties, PubAckReason, PubRec, PubRecProperties,
    PubRecReason, PublishProperties, QoS, SubAck, SubAckProperties, SubscribeReasonCode, Verdict,
};

use super::auth::Refusal;
use super::connections::Quota;
use super::topics::{mount_filter, mount_topic, unmount};

/// User property that carries a request's MQTT 5 message expiry to edgeway
/// as unix milliseconds.
pub const EXPIRES_AT_PROPERTY: &str = "edgeway-expires-at-ms";

/// Why a CONNECT is refused: the device's credentials ([`Refusal`]), or a
/// limit of `[mqtt]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    Auth(Refusal),
    /// The device already has `max_instances_per_device` client ids
    /// connected.
    TooManyInstances,
    /// The will's payload is over `max_will_bytes`.
    WillTooLarge,
    /// Too many failed authentications of this device id
    /// (`auth_failures_per_s`) or from this source address
    /// (`auth_failures_per_ip_per_s`) lately: refused without checking the
    /// password.
    RateLimited,
}

impl From<Refusal> for Refused {
    fn from(r: Refusal) -> Self {
        Refused::Auth(r)
    }
}

impl Refused {
    pub fn reason(self) -> &'static str {
        match self {
            Refused::Auth(r) => r.reason(),
            Refused::TooManyInstances => "too many connections (instances) of this device",
            Refused::WillTooLarge => "the will is too large",
            Refused::RateLimited => "too many failed authentications: retry later",
        }
    }

    /// The CONNACK code: MQTT 5 has one per case; 3.1.1 has "server
    /// unavailable" for a limit and "not authorized" for the rate limit.
    fn code(self, v5: bool) -> ConnectReturnCode {
        match (self, v5) {
            (Refused::Auth(Refusal::ClientIdNotValid), _) => ConnectReturnCode::ClientIdentifierNotValid,
            (Refused::Auth(Refusal::BadCredentials), _) => ConnectReturnCode::BadUserNamePassword,
            (Refused::Auth(Refusal::ProtocolVersion), false) => ConnectReturnCode::RefusedProtocolVersion,
            (Refused::Auth(Refusal::ProtocolVersion), true) => ConnectReturnCode::UnsupportedProtocolVersion,
            (Refused::Auth(Refusal::ServerBusy), false) => ConnectReturnCode::ServiceUnavailable,
            (Refused::Auth(Refusal::ServerBusy), true) => ConnectReturnCode::ServerBusy,
            (Refused::TooManyInstances, true) => ConnectReturnCode::QuotaExceeded,
            (Refused::WillTooLarge, true) => ConnectReturnCode::PacketTooLarge,
            (Refused::TooManyInstances | Refused::WillTooLarge, false) => ConnectReturnCode::ServiceUnavailable,
            (Refused::RateLimited, true) => ConnectReturnCode::ConnectionRateExceeded,
            (Refused::RateLimited, false) => ConnectReturnCode::NotAuthorized,
        }
    }
}

/// The MQTT version of a connection, from the protocol level of its
/// CONNECT.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Version {
    /// Nothing read yet.
    Unknown,
    V4,
    V5,
}

/// What the first frame of a connection says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Detected {
    /// MQTT 3.1.1 or 5.
    Supported(Version),
    /// MQTT 3.1 ("MQIsdp") or an unknown level: the CONNECT (`frame` bytes)
    /// is answered with a 3.1.1 refusal.
    Unsupported { frame: usize },
}

/// The version of a framed CONNECT at the start of `stream`.
/// `Err(InsufficientBytes)` until the whole frame is there; any other
/// error ends the connection (the first packet must be a CONNECT).
pub fn detect_version(stream: &BytesMut, max_size: usize) -> Result<Detected, Error> {
    let fh = rumqttd::protocol::v4::check(stream.iter(), max_size)?;
    if stream[0] >> 4 != 1 {
        return Err(Error::IncorrectPacketFormat);
    }
    let body = &stream[fh.fixed_header_len..fh.frame_length()];
    if body.len() < 2 {
        return Err(Error::MalformedPacket);
    }
    let name_len = u16::from_be_bytes([body[0], body[1]]) as usize;
    let level = *body.get(2 + name_len).ok_or(Error::MalformedPacket)?;
    let is_mqtt = &body[2..2 + name_len] == b"MQTT";
    Ok(match (is_mqtt, level) {
        (true, 4) => Detected::Supported(Version::V4),
        (true, 5) => Detected::Supported(Version::V5),
        _ => Detected::Unsupported { frame: fh.frame_length() },
    })
}

/// The CONNECT rumqttd gets in place of a refused one: an empty client id
/// without a clean session, which rumqttd answers with a CONNACK
/// (`ClientIdentifierNotValid`, rewritten by [`outbound`] to the real
/// refusal) and closes, without registering anything with its router.
pub fn refused_connect() -> Packet {
    let connect = Connect { keep_alive: 1, client_id: String::new(), clean_session: false };
    Packet::Connect(connect, None, None, None, None)
}

/// What [`rewrite_connect`] found in a CONNECT.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectTerms {
    /// MQTT 5 Session Expiry Interval, seconds (0 for 3.1.1).
    pub session_expiry: u32,
    /// The keep-alive the server applies instead of the client's (0 or
    /// above the maximum), for MQTT 5's Server Keep Alive.
    pub server_keep_alive: Option<u16>,
    /// The Session Expiry Interval the server applies instead of the
    /// client's (above the maximum), told in the CONNACK.
    pub server_session_expiry: Option<u32>,
    /// The client's Topic Alias Maximum: aliases edgeway may set in what
    /// it sends (0: none; see [`OutAliases`]).
    pub topic_alias_max: u16,
    /// The client's Maximum Packet Size, if it told one.
    pub max_packet_size: Option<u32>,
}

/// Rewrites an authenticated CONNECT for rumqttd: a keep-alive of 0 or above
/// `max_keep_alive` (seconds) becomes `max_keep_alive`, and an MQTT 5
/// Session Expiry Interval above `max_session_expiry` (seconds; 0xFFFFFFFF,
/// "never", included) becomes `max_session_expiry`, so that no client keeps
/// a session in the broker's memory for longer (MQTT-3.2.2-19 lets the
/// server say so in the CONNACK).
pub fn rewrite_connect(
    connect: &mut Connect,
    props: &mut Option<ConnectProperties>,
    max_keep_alive: u16,
    max_session_expiry: u32,
) -> ConnectTerms {
    let server_keep_alive = (connect.keep_alive == 0 || connect.keep_alive > max_keep_alive).then_some(max_keep_alive);
    if let Some(k) = server_keep_alive {
        connect.keep_alive = k;
    }
    let mut server_session_expiry = None;
    let topic_alias_max = props.as_ref().and_then(|p| p.topic_alias_max).unwrap_or(0);
    let max_packet_size = props.as_ref().and_then(|p| p.max_packet_size);
    if let Some(p) = props.as_mut() {
        // The router must not alias (per filter, not per topic): the codec
        // does, per connection ([`OutAliases`]).
        p.topic_alias_max = None;
        if p.session_expiry_interval.is_some_and(|e| e > max_session_expiry) {
            p.session_expiry_interval = Some(max_session_expiry);
            server_session_expiry = Some(max_session_expiry);
        }
    }
    let session_expiry = props.as_ref().and_then(|p| p.session_expiry_interval).unwrap_or(0);
    ConnectTerms { session_expiry, server_keep_alive, server_session_expiry, topic_alias_max, max_packet_size }
}

/// Sets MQTT 5's Session Expiry Interval on a CONNACK that has properties,
/// where the server shortened the client's.
pub fn with_server_session_expiry(packet: Packet, server_session_expiry: Option<u32>) -> Packet {
    match (packet, server_session_expiry) {
        (Packet::ConnAck(ack, Some(mut p)), Some(e)) => {
            p.session_expiry_interval = Some(e);
            Packet::ConnAck(ack, Some(p))
        }
        (packet, _) => packet,
    }
}

/// A client id (up to 64 KiB of anything) as it may be logged: at most 64
/// characters, escaped (no newlines or control characters reach the log),
/// with the length of what was cut.
pub fn loggable(client_id: &str) -> String {
    const SHOWN: usize = 64;
    let shown: String = client_id.chars().take(SHOWN).flat_map(char::escape_debug).collect();
    match client_id.chars().nth(SHOWN) {
        None => shown,
        Some(_) => format!("{shown}… ({} bytes)", client_id.len()),
    }
}

/// Sets MQTT 5's Server Keep Alive on a CONNACK that has properties.
pub fn with_server_keep_alive(packet: Packet, server_keep_alive: Option<u16>) -> Packet {
    match (packet, server_keep_alive) {
        (Packet::ConnAck(ack, Some(mut p)), Some(k)) => {
            p.server_keep_alive = Some(k);
            Packet::ConnAck(ack, Some(p))
        }
        (packet, _) => packet,
    }
}

/// Sets MQTT 5's Receive Maximum on a CONNACK that has properties: the
/// QoS 1 and 2 publishes a device may have unacknowledged at once.
pub fn with_receive_maximum(packet: Packet, receive_max: u16) -> Packet {
    match packet {
        Packet::ConnAck(ack, Some(mut p)) => {
            p.receive_max = Some(receive_max);
            Packet::ConnAck(ack, Some(p))
        }
        packet => packet,
    }
}

/// Topic aliases an MQTT 5 device may set per connection (its CONNACK's
/// Topic Alias Maximum). Each keeps a topic name: small, so that they stay
/// a small part of a connection's memory.
pub const TOPIC_ALIAS_MAX: u16 = 32;

/// Sets MQTT 5's Topic Alias Maximum on a CONNACK that has properties
/// (instead of rumqttd's 4096: edgeway resolves aliases itself).
pub fn with_topic_alias_max(packet: Packet) -> Packet {
    match packet {
        Packet::ConnAck(ack, Some(mut p)) => {
            p.topic_alias_max = Some(TOPIC_ALIAS_MAX);
            Packet::ConnAck(ack, Some(p))
        }
        packet => packet,
    }
}

/// Topic aliases edgeway sets per MQTT 5 connection at most (fewer if the
/// client's Topic Alias Maximum is lower): a device follows a few streams
/// at once, and each alias keeps a topic name in the connection's memory.
pub const OUT_TOPIC_ALIASES: u16 = 16;

/// The topic aliases edgeway sets in what it sends to one MQTT 5 device
/// (router → device), when its CONNECT allowed any: the first PUBLISH on a
/// topic carries the topic and a new alias, later ones the alias and an
/// empty topic. With every alias taken, the least recently set one is
/// moved to the new topic (MQTT-3.3.2-12 lets the sender change a
/// mapping). A mapping counts only once its PUBLISH has gone out
/// ([`OutAliases::commit`]): one left out for the client's Maximum Packet
/// Size must not leave the device an alias it never learnt.
#[derive(Debug)]
pub struct OutAliases {
    /// Topic of alias `i + 1`.
    topics: Vec<Bytes>,
    max: u16,
    /// The alias to move next when all are taken (the oldest set).
    next: u16,
}

/// What [`OutAliases::plan`] chose for one PUBLISH.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AliasPlan {
    /// The topic has this alias: send the alias and an empty topic.
    Known(u16),
    /// Send the topic with this alias, which then stands for it.
    Set(u16),
}

impl OutAliases {
    /// For a client that allows `client_max` aliases (`None` for 0).
    pub fn new(client_max: u16) -> Option<OutAliases> {
        let max = client_max.min(OUT_TOPIC_ALIASES);
        (max > 0).then(|| OutAliases { topics: Vec::new(), max, next: 1 })
    }

    pub fn plan(&self, topic: &[u8]) -> AliasPlan {
        if let Some(i) = self.topics.iter().position(|t| t == topic) {
            return AliasPlan::Known(i as u16 + 1);
        }
        if self.topics.len() < usize::from(self.max) {
            AliasPlan::Set(self.topics.len() as u16 + 1)
        } else {
            AliasPlan::Set(self.next)
        }
    }

    /// Records a [`AliasPlan::Set`] that went out.
    pub fn commit(&mut self, plan: &AliasPlan, topic: Bytes) {
        let AliasPlan::Set(alias) = *plan else { return };
        let i = usize::from(alias) - 1;
        if i == self.topics.len() {
            self.topics.push(topic);
        } else {
            self.topics[i] = topic;
            self.next = alias % self.max + 1;
        }
    }
}

/// Sets the alias of `plan` in an outgoing PUBLISH (an empty topic for a
/// known one).
pub fn with_alias(packet: Packet, plan: &AliasPlan) -> Packet {
    let Packet::Publish(mut publish, props) = packet else { return packet };
    let mut props = props.unwrap_or_default();
    match *plan {
        AliasPlan::Known(a) => {
            publish.topic = Bytes::new();
            props.topic_alias = Some(a);
        }
        AliasPlan::Set(a) => props.topic_alias = Some(a),
    }
    Packet::Publish(publish, Some(props))
}

/// Device → router, before mounting: an MQTT 5 PUBLISH with a Topic Alias
/// gets its whole topic (a topic with an alias sets it, an empty one uses
/// it) and loses the alias, so that nothing past the codec counts or
/// stores by alias. `aliases` is the connection's (device view). An alias
/// never set, or 0, or past [`TOPIC_ALIAS_MAX`], leaves the topic empty,
/// which [`topic_alias_invalid`] answers.
pub fn resolve_alias(aliases: &mut HashMap<u16, Bytes>, packet: Packet) -> Packet {
    let Packet::Publish(mut publish, Some(mut props)) = packet else { return packet };
    if let Some(alias) = props.topic_alias.take() {
        if alias == 0 || alias > TOPIC_ALIAS_MAX {
            publish.topic = Bytes::new();
        } else if publish.topic.is_empty() {
            publish.topic = aliases.get(&alias).cloned().unwrap_or_default();
        } else {
            aliases.insert(alias, publish.topic.clone());
        }
    }
    Packet::Publish(publish, Some(props))
}

/// A PUBLISH without a topic after [`resolve_alias`]: MQTT 5 DISCONNECT
/// 0x94 Topic Alias invalid; 3.1.1 (an empty topic is malformed) closes.
pub fn topic_alias_invalid(version: Version) -> Verdict {
    match version {
        Version::V5 => Verdict::Close(Some(disconnect(
            DisconnectReasonCode::TopicAliasInvalid,
            "a topic alias not set on this connection, or past the Topic Alias Maximum",
        ))),
        _ => Verdict::Close(None),
    }
}

/// MQTT 5 DISCONNECT with `code` and a reason string.
fn disconnect(code: DisconnectReasonCode, why: &str) -> Packet {
    let props = DisconnectProperties {
        session_expiry_interval: None,
        reason_string: Some(why.to_string()),
        user_properties: Vec::new(),
        server_reference: None,
    };
    Packet::Disconnect(Disconnect { reason_code: code }, Some(props))
}

/// A publish over a quota that ends the connection: MQTT 5 DISCONNECT
/// 0x97 with the quota's reason; 3.1.1 closes.
pub fn quota_disconnect(version: Version, quota: Quota) -> Verdict {
    match version {
        Version::V5 => Verdict::Close(Some(disconnect(DisconnectReasonCode::QuotaExceeded, quota.reason()))),
        _ => Verdict::Close(None),
    }
}

/// What answers a PUBLISH (QoS `qos`, packet id `pkid`) over a quota: MQTT
/// 5 PUBACK or PUBREC 0x97; a QoS 0 publish (no acknowledgement) or any
/// 3.1.1 one closes the connection (MQTT 5 with DISCONNECT 0x97).
pub fn refuse_publish(version: Version, qos: QoS, pkid: u16, quota: Quota) -> Verdict {
    let reason_string = Some(quota.reason().to_string());
    match (version, qos) {
        (Version::V5, QoS::AtLeastOnce) => Verdict::Answer(Packet::PubAck(
            PubAck { pkid, reason: PubAckReason::QuotaExceeded },
            Some(PubAckProperties { reason_string, user_properties: Vec::new() }),
        )),
        (Version::V5, QoS::ExactlyOnce) => Verdict::Answer(Packet::PubRec(
            PubRec { pkid, reason: PubRecReason::QuotaExceeded },
            Some(PubRecProperties { reason_string, user_properties: Vec::new() }),
        )),
        (Version::V5, QoS::AtMostOnce) => {
            Verdict::Close(Some(disconnect(DisconnectReasonCode::QuotaExceeded, quota.reason())))
        }
        _ => Verdict::Close(None),
    }
}

/// The SUBACK of a SUBSCRIBE (`filters` of them) refused whole: 0x97
/// Quota exceeded for each (3.1.1: 0x80 Failure).
pub fn refuse_subscribe(version: Version, pkid: u16, filters: usize, quota: Quota) -> Packet {
    let (code, props) = match version {
        Version::V5 => (
            SubscribeReasonCode::QuotaExceeded,
            Some(SubAckProperties { reason_string: Some(quota.reason().to_string()), user_properties: Vec::new() }),
        ),
        _ => (SubscribeReasonCode::Failure, None),
    };
    Packet::SubAck(SubAck { pkid, return_codes: vec![code; filters] }, props)
}

/// An MQTT 5 DISCONNECT that sets a Session Expiry Interval when CONNECT
/// gave 0 (MQTT-3.14.2-2): DISCONNECT 0x82 Protocol Error.
pub fn session_expiry_protocol_error() -> Packet {
    disconnect(DisconnectReasonCode::ProtocolError, "Session Expiry Interval set in DISCONNECT after 0 in CONNECT")
}

/// A QoS 2 publish beyond the Receive Maximum (more awaiting PUBREL than
/// the CONNACK allowed): MQTT 5 DISCONNECT 0x93; 3.1.1 closes.
pub fn receive_maximum_exceeded(version: Version) -> Verdict {
    match version {
        Version::V5 => Verdict::Close(Some(disconnect(
            DisconnectReasonCode::ReceiveMaximumExceeded,
            "more QoS 2 publishes awaiting PUBREL than the Receive Maximum",
        ))),
        _ => Verdict::Close(None),
    }
}

/// A will with its topic mounted in the device's subtree.
pub fn mount_will(device: &str, mut will: LastWill) -> LastWill {
    will.topic = mount_topic(device, &String::from_utf8_lossy(&will.topic)).into();
    will
}

/// Device → router, after CONNECT: topics and filters go under the
/// device's subtree. `shared_prefix` is the device view of the read-only
/// shared topics; `request_topic` the device view of its request topic
/// (whose MQTT 5 expiry becomes [`EXPIRES_AT_PROPERTY`]).
pub fn mount_inbound(device: &str, shared_prefix: &str, request_topic: &str, packet: Packet) -> Result<Packet, Error> {
    Ok(match packet {
        Packet::Publish(mut publish, mut props) => {
            if !publish.topic.is_empty() {
                let topic = std::str::from_utf8(&publish.topic).map_err(|_| Error::TopicNotUtf8)?;
                if topic.contains(['+', '#']) {
                    return Err(Error::MalformedPacket);
                }
                if topic == request_topic {
                    if let Some(p) = props.as_mut() {
                        expiry_to_property(p, crate::task::now_ms());
                    }
                }
                publish.topic = mount_topic(device, topic).into();
            }
            Packet::Publish(publish, props)
        }
        Packet::Subscribe(mut sub, props) => {
            for f in &mut sub.filters {
                // No Local on a shared subscription is a protocol error
                // (MQTT-3.8.3-4).
                if f.nolocal && f.path.starts_with("$share/") {
                    return Err(Error::InvalidProtocol);
                }
                f.path = mount_filter(device, shared_prefix, &f.path).ok_or(Error::MalformedPacket)?;
            }
            Packet::Subscribe(sub, props)
        }
        Packet::Unsubscribe(mut unsub, props) => {
            for f in &mut unsub.filters {
                *f = mount_filter(device, shared_prefix, f).ok_or(Error::MalformedPacket)?;
            }
            Packet::Unsubscribe(unsub, props)
        }
        other => other,
    })
}

/// Router → device. `refused`: the CONNECT was refused (its CONNACK says
/// why); `device`: the authenticated device, whose topics are unmounted.
pub fn outbound(
    version: Version,
    refused: Option<Refused>,
    device: Option<&str>,
    packet: Packet,
) -> Result<Packet, Error> {
    let v5 = version == Version::V5;
    Ok(match packet {
        Packet::ConnAck(mut ack, props) => match refused {
            Some(why) => {
                ack.session_present = false;
                ack.code = why.code(v5);
                let props = v5
                    .then(|| ConnAckProperties { reason_string: Some(why.reason().to_string()), ..Default::default() });
                Packet::ConnAck(ack, props)
            }
            None => Packet::ConnAck(ack, if v5 { props } else { None }),
        },
        Packet::Publish(mut publish, props) => {
            let device = device.ok_or(Error::InvalidProtocol)?;
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

/// Replaces a relative MQTT 5 message expiry by an absolute one (`now_ms`
/// plus the interval) in a user property, so that edgeway, not the router,
/// decides what happens to a stale request.
pub fn expiry_to_property(p: &mut PublishProperties, now_ms: i64) {
    if let Some(secs) = p.message_expiry_interval.take() {
        p.user_properties.retain(|(k, _)| k != EXPIRES_AT_PROPERTY);
        let at = now_ms + i64::from(secs) * 1000;
        p.user_properties.push((EXPIRES_AT_PROPERTY.to_string(), at.to_string()));
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use rumqttd::protocol::{ConnAck, Filter, Publish, QoS, RetainForwardRule, Subscribe};

    use super::*;

    fn frame(name: &[u8], level: u8) -> BytesMut {
        let mut body = Vec::new();
        body.extend_from_slice(&(name.len() as u16).to_be_bytes());
        body.extend_from_slice(name);
        body.extend_from_slice(&[level, 0x02, 0, 60, 0, 1, b'x']);
        let mut f = vec![0x10, body.len() as u8];
        f.extend_from_slice(&body);
        BytesMut::from(&f[..])
    }

    #[test]
    fn the_connect_level_picks_the_version() {
        assert_eq!(detect_version(&frame(b"MQTT", 4), 1024), Ok(Detected::Supported(Version::V4)));
        assert_eq!(detect_version(&frame(b"MQTT", 5), 1024), Ok(Detected::Supported(Version::V5)));
        let f = frame(b"MQIsdp", 3);
        assert_eq!(detect_version(&f, 1024), Ok(Detected::Unsupported { frame: f.len() }));
        assert_eq!(detect_version(&frame(b"MQTT", 9), 1024), Ok(Detected::Unsupported { frame: 15 }));
        // Half a frame: read more. Not a CONNECT: the connection ends.
        let f = frame(b"MQTT", 4);
        assert!(matches!(detect_version(&BytesMut::from(&f[..5]), 1024), Err(Error::InsufficientBytes(_))));
        let mut sub = f.clone();
        sub[0] = 0x82;
        assert_eq!(detect_version(&sub, 1024), Err(Error::IncorrectPacketFormat));
    }

    #[test]
    fn a_session_expiry_over_the_maximum_is_shortened() {
        let props = |e: Option<u32>| {
            Some(ConnectProperties {
                session_expiry_interval: e,
                receive_maximum: None,
                max_packet_size: None,
                topic_alias_max: None,
                request_response_info: None,
                request_problem_info: None,
                user_properties: vec![],
                authentication_method: None,
                authentication_data: None,
            })
        };
        let mut c = Connect { keep_alive: 20, client_id: "d".into(), clean_session: true };
        for (asked, kept, told) in [
            (Some(u32::MAX), 60, Some(60)),
            (Some(61), 60, Some(60)),
            (Some(60), 60, None),
            (Some(5), 5, None),
            (None, 0, None),
        ] {
            let mut p = props(asked);
            let terms = rewrite_connect(&mut c, &mut p, 600, 60);
            assert_eq!((terms.session_expiry, terms.server_session_expiry), (kept, told), "asked {asked:?}");
            assert_eq!(p.unwrap().session_expiry_interval, asked.map(|a| a.min(60)), "what the router gets");
        }
    }

    #[test]
    fn connect_keep_alive_0_and_topic_aliases_are_rewritten() {
        let mut c = Connect { keep_alive: 0, client_id: "d".into(), clean_session: true };
        let mut props = Some(ConnectProperties {
            session_expiry_interval: Some(30),
            receive_maximum: None,
            max_packet_size: None,
            topic_alias_max: Some(10),
            request_response_info: None,
            request_problem_info: None,
            user_properties: vec![],
            authentication_method: None,
            authentication_data: None,
        });
        // keep_alive 0 is not "for ever" (it was 65 535 s): the maximum.
        assert_eq!(
            rewrite_connect(&mut c, &mut props, 600, 86_400),
            ConnectTerms {
                session_expiry: 30,
                server_keep_alive: Some(600),
                server_session_expiry: None,
                topic_alias_max: 10,
                max_packet_size: None,
            }
        );
        assert_eq!((c.keep_alive, props.unwrap().topic_alias_max), (600, None));
        let mut c = Connect { keep_alive: 20, client_id: "d".into(), clean_session: true };
        let terms = rewrite_connect(&mut c, &mut None, 600, 86_400);
        assert_eq!(
            (terms, c.keep_alive),
            (
                ConnectTerms {
                    session_expiry: 0,
                    server_keep_alive: None,
                    server_session_expiry: None,
                    topic_alias_max: 0,
                    max_packet_size: None
                },
                20
            )
        );
        let mut c = Connect { keep_alive: 3600, client_id: "d".into(), clean_session: true };
        assert_eq!((rewrite_connect(&mut c, &mut None, 600, 86_400).server_keep_alive, c.keep_alive), (Some(600), 600));
        // MQTT 5 clients are told.
        let ack = Packet::ConnAck(
            ConnAck { session_present: false, code: ConnectReturnCode::Success },
            Some(ConnAckProperties::default()),
        );
        let Packet::ConnAck(_, Some(p)) = with_server_keep_alive(ack, Some(600)) else { panic!("a CONNACK") };
        assert_eq!(p.server_keep_alive, Some(600));
        let Packet::ConnAck(_, Some(p)) = with_server_session_expiry(
            Packet::ConnAck(ConnAck { session_present: false, code: ConnectReturnCode::Success }, Some(p)),
            Some(60),
        ) else {
            panic!("a CONNACK")
        };
        assert_eq!(p.session_expiry_interval, Some(60));
        let will = LastWill { topic: "status".into(), message: Bytes::new(), qos: QoS::AtMostOnce, retain: false };
        assert_eq!(mount_will("dev1", will).topic, mount_topic("dev1", "status"));
    }

    #[test]
    fn client_ids_are_logged_bounded_and_escaped() {
        assert_eq!(loggable("demo-device-1"), "demo-device-1");
        let hostile = format!("a\nfake log line\r{}", "x".repeat(65_000));
        let l = loggable(&hostile);
        assert!(!l.contains(['\n', '\r']), "{l}");
        assert!(l.starts_with("a\\nfake log line\\r") && l.ends_with("… (65016 bytes)"), "{l}");
        assert!(l.len() < 120, "{}", l.len());
    }

    #[test]
    fn inbound_topics_and_filters_are_mounted_and_wildcard_topics_refused() {
        let publish = |t: &str| Packet::Publish(Publish::new(t.to_string(), "p".to_string(), false), None);
        let Ok(Packet::Publish(p, _)) = mount_inbound("dev1", "ai/v1/shared/", "ai/v1/dev1/req", publish("a/b")) else {
            panic!("a publish")
        };
        assert_eq!(p.topic, mount_topic("dev1", "a/b").as_bytes());
        assert_eq!(mount_inbound("dev1", "ai/v1/shared/", "", publish("a/+")), Err(Error::MalformedPacket));
        let filter = Filter {
            path: "#".into(),
            qos: QoS::AtMostOnce,
            nolocal: false,
            preserve_retain: false,
            retain_forward_rule: RetainForwardRule::OnEverySubscribe,
        };
        let one = Subscribe { pkid: 1, filters: vec![filter.clone()] };
        let Ok(Packet::Subscribe(s, _)) = mount_inbound("dev1", "ai/v1/shared/", "", Packet::Subscribe(one, None))
        else {
            panic!("a subscribe")
        };
        assert_eq!(Some(&s.filters[0].path), mount_filter("dev1", "ai/v1/shared/", "#").as_ref());
        // Shared subscriptions: malformed ones, and No Local on one, refused.
        let sub = |path: &str, nolocal: bool| {
            let f = Filter { path: path.into(), nolocal, ..filter.clone() };
            Packet::Subscribe(Subscribe { pkid: 1, filters: vec![f] }, None)
        };
        assert!(mount_inbound("dev1", "ai/v1/shared/", "", sub("$share/g/#", false)).is_ok());
        assert_eq!(mount_inbound("dev1", "ai/v1/shared/", "", sub("$share/g/#", true)), Err(Error::InvalidProtocol));
        assert_eq!(mount_inbound("dev1", "ai/v1/shared/", "", sub("$share/g+/#", false)), Err(Error::MalformedPacket));
    }

    #[test]
    fn the_expiry_of_a_request_becomes_an_absolute_time() {
        let mut p = PublishProperties {
            message_expiry_interval: Some(3),
            user_properties: vec![(EXPIRES_AT_PROPERTY.into(), "forged".into())],
            ..Default::default()
        };
        expiry_to_property(&mut p, 1_000);
        assert_eq!(p.message_expiry_interval, None);
        assert_eq!(p.user_properties, [(EXPIRES_AT_PROPERTY.to_string(), "4000".to_string())]);
        // Only on the request topic.
        let props = PublishProperties { message_expiry_interval: Some(3), ..Default::default() };
        let pkt = Packet::Publish(Publish::new("other", "p", false), Some(props));
        let Ok(Packet::Publish(_, Some(p))) = mount_inbound("d", "s/", "req", pkt) else { panic!("a publish") };
        assert_eq!(p.message_expiry_interval, Some(3));
    }

    #[test]
    fn outbound_refusals_unmounting_and_3_1_1_properties() {
        let ack = || Packet::ConnAck(ConnAck { session_present: true, code: ConnectReturnCode::Success }, None);
        let Ok(Packet::ConnAck(a, None)) = outbound(Version::V4, Some(Refusal::BadCredentials.into()), None, ack())
        else {
            panic!("a 3.1.1 CONNACK")
        };
        assert_eq!((a.session_present, a.code), (false, ConnectReturnCode::BadUserNamePassword));
        let Ok(Packet::ConnAck(a, Some(p))) = outbound(Version::V5, Some(Refusal::ProtocolVersion.into()), None, ack())
        else {
            panic!("a 5 CONNACK")
        };
        assert_eq!(a.code, ConnectReturnCode::UnsupportedProtocolVersion);
        assert_eq!(p.reason_string.as_deref(), Some(Refusal::ProtocolVersion.reason()));
        let limits = [
            (Refused::TooManyInstances, ConnectReturnCode::QuotaExceeded),
            (Refused::WillTooLarge, ConnectReturnCode::PacketTooLarge),
            (Refused::RateLimited, ConnectReturnCode::ConnectionRateExceeded),
        ];
        for (why, code) in limits {
            let Ok(Packet::ConnAck(a, _)) = outbound(Version::V5, Some(why), None, ack()) else { panic!("a CONNACK") };
            assert_eq!(a.code, code);
        }
        let Ok(Packet::ConnAck(a, _)) = outbound(Version::V4, Some(Refused::RateLimited), None, ack()) else {
            panic!("a CONNACK")
        };
        assert_eq!(a.code, ConnectReturnCode::NotAuthorized);

        let props = PublishProperties { topic_alias: Some(3), content_type: Some("x".into()), ..Default::default() };
        let pkt = || Packet::Publish(Publish::new(mount_topic("dev1", "a/b"), "p".into(), false), Some(props.clone()));
        let Ok(Packet::Publish(p, None)) = outbound(Version::V4, None, Some("dev1"), pkt()) else {
            panic!("3.1.1: no properties")
        };
        assert_eq!(p.topic, "a/b".as_bytes());
        let Ok(Packet::Publish(_, Some(p))) = outbound(Version::V5, None, Some("dev1"), pkt()) else {
            panic!("5: properties")
        };
        assert_eq!((p.topic_alias, p.content_type.as_deref()), (None, Some("x")));
        // Another device's topic never leaves: fail closed.
        assert_eq!(outbound(Version::V5, None, Some("dev2"), pkt()), Err(Error::InvalidProtocol));
        assert_eq!(outbound(Version::V5, None, None, pkt()), Err(Error::InvalidProtocol));
    }

    /// rumqttd 0.20 wrote an MQTT 5 DISCONNECT with a reason code and no
    /// properties with a remaining length one short (patches/rumqttd,
    /// PATCHES.md 7): what is written must read back as one whole packet.
    #[test]
    fn an_mqtt5_disconnect_without_properties_reads_back_whole() {
        use rumqttd::protocol::v5::V5;
        use rumqttd::protocol::{Disconnect, DisconnectReasonCode, Protocol};
        let mut buf = BytesMut::new();
        let d = Disconnect { reason_code: DisconnectReasonCode::MaximumConnectTime };
        let written = V5.write(Packet::Disconnect(d, None), &mut buf).unwrap();
        assert_eq!(written, buf.len(), "the size returned is what was written");
        match V5.read_mut(&mut buf, 1024).unwrap() {
            Packet::Disconnect(d, None) => assert_eq!(d.reason_code, DisconnectReasonCode::MaximumConnectTime),
            other => panic!("{other:?}"),
        }
        assert!(buf.is_empty(), "left unread: {buf:02x?}");
    }

    #[test]
    fn outgoing_aliases_are_set_once_reused_then_moved_oldest_first() {
        assert!(OutAliases::new(0).is_none(), "a client that allows none gets none");
        let mut a = OutAliases::new(2).expect("allowed");
        let t = |s: &str| Bytes::from(s.to_string());
        assert_eq!(a.plan(b"x/1"), AliasPlan::Set(1));
        // Not sent (left out for the Maximum Packet Size): not known.
        assert_eq!(a.plan(b"x/1"), AliasPlan::Set(1));
        a.commit(&AliasPlan::Set(1), t("x/1"));
        assert_eq!(a.plan(b"x/1"), AliasPlan::Known(1));
        let p = a.plan(b"x/2");
        assert_eq!(p, AliasPlan::Set(2));
        a.commit(&p, t("x/2"));
        // Full: the oldest mapping moves, then the next oldest.
        let p = a.plan(b"x/3");
        assert_eq!(p, AliasPlan::Set(1));
        a.commit(&p, t("x/3"));
        assert_eq!(
            (a.plan(b"x/3"), a.plan(b"x/2"), a.plan(b"x/1")),
            (AliasPlan::Known(1), AliasPlan::Known(2), AliasPlan::Set(2))
        );
        // The client's maximum above edgeway's: edgeway's.
        let mut a = OutAliases::new(u16::MAX).expect("allowed");
        for i in 0..OUT_TOPIC_ALIASES + 1 {
            let topic = format!("x/{i}");
            let p = a.plan(topic.as_bytes());
            let (AliasPlan::Set(n) | AliasPlan::Known(n)) = p;
            assert!((1..=OUT_TOPIC_ALIASES).contains(&n));
            a.commit(&p, t(&topic));
        }
        assert_eq!(a.plan(b"x/0"), AliasPlan::Set(2), "x/0's alias went to the 17th topic");
        let Packet::Publish(p, Some(props)) =
            with_alias(Packet::Publish(Publish::new("x/1", "hi", false), None), &AliasPlan::Known(3))
        else {
            panic!("a PUBLISH")
        };
        assert_eq!((p.topic.len(), props.topic_alias), (0, Some(3)));
    }

    #[test]
    fn topic_aliases_are_resolved_and_dropped() {
        let mut aliases = HashMap::new();
        let publish = |topic: &str, alias: u16| {
            let props = PublishProperties { topic_alias: Some(alias), ..Default::default() };
            Packet::Publish(Publish::new(topic.to_string(), "p".into(), false), Some(props))
        };
        let resolved = |p: Packet| match p {
            Packet::Publish(p, props) => (String::from_utf8(p.topic.to_vec()).unwrap(), props.unwrap().topic_alias),
            other => panic!("{other:?}"),
        };
        assert_eq!(resolved(resolve_alias(&mut aliases, publish("a/b", 3))), ("a/b".into(), None), "sets 3");
        assert_eq!(resolved(resolve_alias(&mut aliases, publish("", 3))), ("a/b".into(), None), "uses 3");
        assert_eq!(resolved(resolve_alias(&mut aliases, publish("c", 3))), ("c".into(), None), "sets 3 again");
        assert_eq!(resolved(resolve_alias(&mut aliases, publish("", 3))), ("c".into(), None));
        assert_eq!(resolved(resolve_alias(&mut aliases, publish("", 4))), (String::new(), None), "never set");
        let past = TOPIC_ALIAS_MAX + 1;
        assert_eq!(resolved(resolve_alias(&mut aliases, publish("d", past))), (String::new(), None), "past the max");
        assert_eq!(resolved(resolve_alias(&mut aliases, publish("d", 0))), (String::new(), None), "0");
        assert_eq!(aliases.len(), 1);
    }
}
