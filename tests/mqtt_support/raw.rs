//! Raw MQTT 3.1.1 packets and sockets, for what a well-behaved client
//! library will not do (reset right after CONNECT, never send CONNECT,
//! stop reading), and rumqttd alone (no edgeway) on a free port.

use std::net::SocketAddr;
use std::time::Duration;

use rumqttd::protocol::v4::V4;
use rumqttd::{LinkType, Router, RouterConfig, Server, ServerSettings};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn remaining_length(mut n: usize, out: &mut Vec<u8>) {
    loop {
        let mut b = (n % 128) as u8;
        n /= 128;
        if n > 0 {
            b |= 0x80;
        }
        out.push(b);
        if n == 0 {
            return;
        }
    }
}

fn string(s: &[u8], out: &mut Vec<u8>) {
    out.extend_from_slice(&(s.len() as u16).to_be_bytes());
    out.extend_from_slice(s);
}

/// An MQTT 3.1.1 CONNECT (clean session, keep-alive 60 s).
pub fn connect(id: &str, login: Option<(&str, &str)>) -> Vec<u8> {
    let flags = 0x02 | if login.is_some() { 0xC0 } else { 0 };
    let mut body = vec![0, 4, b'M', b'Q', b'T', b'T', 4, flags, 0, 60];
    string(id.as_bytes(), &mut body);
    if let Some((u, p)) = login {
        string(u.as_bytes(), &mut body);
        string(p.as_bytes(), &mut body);
    }
    let mut p = vec![0x10];
    remaining_length(body.len(), &mut p);
    p.extend_from_slice(&body);
    p
}

/// An MQTT 3.1.1 SUBSCRIBE of one filter at QoS 0.
pub fn subscribe(pkid: u16, filter: &str) -> Vec<u8> {
    let mut body = pkid.to_be_bytes().to_vec();
    string(filter.as_bytes(), &mut body);
    body.push(0);
    let mut p = vec![0x82];
    remaining_length(body.len(), &mut p);
    p.extend_from_slice(&body);
    p
}

/// An MQTT 3.1.1 PUBLISH at QoS 0.
pub fn publish(topic: &str, payload: &[u8]) -> Vec<u8> {
    let mut body = Vec::new();
    string(topic.as_bytes(), &mut body);
    body.extend_from_slice(payload);
    let mut p = vec![0x30];
    remaining_length(body.len(), &mut p);
    p.extend_from_slice(&body);
    p
}

/// Sends `packet` and resets the socket at once (SO_LINGER 0: an RST,
/// not a FIN), before the server can answer.
pub async fn send_and_reset(addr: SocketAddr, packet: &[u8]) {
    let Ok(mut s) = TcpStream::connect(addr).await else { return };
    let _ = s.write_all(packet).await;
    let _ = socket2::SockRef::from(&s).set_linger(Some(Duration::ZERO));
    drop(s);
}

/// Sends a CONNECT and returns the CONNACK's 4 bytes, or `None` when
/// the server closed the socket or said nothing within 5 s.
pub async fn connack(addr: SocketAddr, connect: &[u8]) -> Option<(TcpStream, [u8; 4])> {
    let mut s = TcpStream::connect(addr).await.ok()?;
    s.write_all(connect).await.ok()?;
    let mut ack = [0u8; 4];
    match tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut ack)).await {
        Ok(Ok(_)) => Some((s, ack)),
        _ => None,
    }
}

/// Reads one packet's bytes (fixed header and all), `None` after 5 s or
/// when the socket closed.
pub async fn packet(s: &mut TcpStream) -> Option<Vec<u8>> {
    tokio::time::timeout(Duration::from_secs(5), async {
        let mut p = vec![s.read_u8().await.ok()?];
        let (mut len, mut mult) = (0usize, 1usize);
        loop {
            let b = s.read_u8().await.ok()?;
            p.push(b);
            len += (b & 0x7F) as usize * mult;
            mult *= 128;
            if b & 0x80 == 0 {
                break;
            }
        }
        let mut body = vec![0; len];
        s.read_exact(&mut body).await.ok()?;
        p.extend_from_slice(&body);
        Some(p)
    })
    .await
    .ok()
    .flatten()
}

pub const ACCEPTED: [u8; 4] = [0x20, 2, 0, 0];

/// rumqttd alone: its router and one MQTT 3.1.1 listener on a free port.
pub async fn bare_rumqttd(max_connections: usize) -> SocketAddr {
    bare_rumqttd_with(max_connections, LinkType::Remote, serde_json::json!({})).await
}

/// [`bare_rumqttd`] of a link type, with `listener` merged into the
/// listener's settings (settings the crate does not know are ignored).
pub async fn bare_rumqttd_with(max_connections: usize, link_type: LinkType, listener: serde_json::Value) -> SocketAddr {
    let router = Router::new(
        0,
        RouterConfig {
            max_connections,
            max_outgoing_packet_count: 200,
            max_segment_size: 100 * 1024,
            max_segment_count: 10,
            custom_segment: None,
            initialized_filters: None,
            shared_subscriptions_strategy: Default::default(),
            // Later settings of the patched crate (the kept-session cap).
            ..Default::default()
        },
    );
    let router_tx = router.spawn();
    let listen = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    // From JSON, so that it builds with the unpatched crate too (the
    // patches add settings with defaults).
    let mut settings = serde_json::json!({
        "name": "v4",
        "listen": listen,
        "tls": null,
        "next_connection_delay_ms": 0,
        "connections": {
            "connection_timeout_ms": 5000,
            "max_payload_size": 64 * 1024,
            "max_inflight_count": 100,
            "auth": null,
            "dynamic_filters": true,
        },
    });
    for (k, v) in listener.as_object().expect("an object") {
        settings[k] = v.clone();
    }
    let settings: ServerSettings = serde_json::from_value(settings).expect("listener settings");
    let mut server = Server::new(settings, router_tx, V4);
    let mut accept = Box::pin(async move { server.start(link_type).await });
    // The first poll binds.
    assert!(futures::poll!(accept.as_mut()).is_pending(), "the listener binds");
    tokio::spawn(accept);
    listen
}

/// Whether a well-behaved client gets its CONNACK within `within` (a few
/// connections being torn down may hold slots for a moment; a leak holds
/// them for good).
pub async fn connects_within(addr: SocketAddr, connect: &[u8], within: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        if let Some((_, ack)) = connack(addr, connect).await {
            if ack == ACCEPTED {
                return true;
            }
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Whether a WebSocket upgrade to `addr` is answered (101) within 5 s.
pub async fn websocket_upgrade(addr: SocketAddr) -> bool {
    let Ok(mut s) = TcpStream::connect(addr).await else { return false };
    let request = "GET /mqtt HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
                   Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\
                   Sec-WebSocket-Protocol: mqtt\r\n\r\n";
    if s.write_all(request.as_bytes()).await.is_err() {
        return false;
    }
    let mut head = [0u8; 12];
    matches!(tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut head)).await, Ok(Ok(_)))
        && head.ends_with(b"101")
}

fn frame(first: u8, body: &[u8]) -> Vec<u8> {
    let mut p = vec![first];
    remaining_length(body.len(), &mut p);
    p.extend_from_slice(body);
    p
}

/// An MQTT 5 CONNECT (clean start, keep-alive 60 s, no properties).
pub fn connect_v5(id: &str, login: Option<(&str, &str)>) -> Vec<u8> {
    let flags = 0x02 | if login.is_some() { 0xC0 } else { 0 };
    let mut body = vec![0, 4, b'M', b'Q', b'T', b'T', 5, flags, 0, 60, 0];
    string(id.as_bytes(), &mut body);
    if let Some((u, p)) = login {
        string(u.as_bytes(), &mut body);
        string(p.as_bytes(), &mut body);
    }
    frame(0x10, &body)
}

/// A PUBLISH at `qos` (packet id `pkid` unless QoS 0); MQTT 5 when `v5`
/// (no properties).
pub fn publish_with(v5: bool, topic: &str, payload: &[u8], qos: u8, retain: bool, pkid: u16) -> Vec<u8> {
    let mut body = Vec::new();
    string(topic.as_bytes(), &mut body);
    if qos > 0 {
        body.extend_from_slice(&pkid.to_be_bytes());
    }
    if v5 {
        body.push(0);
    }
    body.extend_from_slice(payload);
    frame(0x30 | (qos << 1) | u8::from(retain), &body)
}

/// A SUBSCRIBE of one filter at QoS 0; MQTT 5 when `v5`.
pub fn subscribe_with(v5: bool, pkid: u16, filter: &str) -> Vec<u8> {
    let mut body = pkid.to_be_bytes().to_vec();
    if v5 {
        body.push(0);
    }
    string(filter.as_bytes(), &mut body);
    body.push(0);
    frame(0x82, &body)
}

/// An UNSUBSCRIBE of one filter; MQTT 5 when `v5`.
pub fn unsubscribe_with(v5: bool, pkid: u16, filter: &str) -> Vec<u8> {
    let mut body = pkid.to_be_bytes().to_vec();
    if v5 {
        body.push(0);
    }
    string(filter.as_bytes(), &mut body);
    frame(0xA2, &body)
}

/// A PUBREL (success, the short form both versions read).
pub fn pubrel(pkid: u16) -> Vec<u8> {
    frame(0x62, &pkid.to_be_bytes())
}

/// An authenticated raw connection (MQTT 5 when `v5`) and its CONNACK;
/// panics unless accepted.
pub async fn session(addr: SocketAddr, v5: bool, id: &str, login: (&str, &str)) -> (TcpStream, Vec<u8>) {
    let connect = if v5 { connect_v5(id, Some(login)) } else { connect(id, Some(login)) };
    let mut s = TcpStream::connect(addr).await.expect("connects");
    s.write_all(&connect).await.unwrap();
    let ack = packet(&mut s).await.expect("a CONNACK");
    assert_eq!((ack[0], ack[3]), (0x20, 0), "accepted: {ack:02x?}");
    (s, ack)
}

/// The reason code of an acknowledgement (PUBACK, PUBREC, PUBCOMP: 0 when
/// left out; SUBACK: its last code), or of a DISCONNECT.
pub fn reason(p: &[u8]) -> u8 {
    match p[0] & 0xF0 {
        0x90 => *p.last().expect("a code"),
        0xE0 => p.get(2).copied().unwrap_or(0),
        _ => p.get(4).copied().unwrap_or(0),
    }
}

/// Whether the server closed `s` (EOF or reset) within 5 s, reading past
/// anything it sent first.
pub async fn closed(s: &mut TcpStream) -> bool {
    let mut buf = [0u8; 4096];
    tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return true,
                Ok(_) => continue,
            }
        }
    })
    .await
    .unwrap_or(false)
}

/// The topic of a PUBLISH's bytes.
pub fn publish_topic(p: &[u8]) -> String {
    let mut i = 1;
    while p[i] & 0x80 != 0 {
        i += 1;
    }
    let len = u16::from_be_bytes([p[i + 1], p[i + 2]]) as usize;
    String::from_utf8_lossy(&p[i + 3..i + 3 + len]).into_owned()
}

/// The CONNACK code of `connect` (3.1.1 or 5) sent from the local address
/// `from` (any of 127.0.0.0/8 on Linux), `None` without a CONNACK.
pub async fn connack_code_from(from: std::net::IpAddr, addr: SocketAddr, connect: &[u8]) -> Option<u8> {
    let socket = tokio::net::TcpSocket::new_v4().ok()?;
    socket.bind(SocketAddr::new(from, 0)).ok()?;
    let mut s = socket.connect(addr).await.ok()?;
    s.write_all(connect).await.ok()?;
    let ack = packet(&mut s).await?;
    (ack[0] == 0x20).then_some(ack[3])
}

/// An MQTT 3.1.1 CONNECT with a will (QoS 0) on `topic`, retained when
/// `retain`.
pub fn connect_with_will(id: &str, login: (&str, &str), topic: &str, message: &[u8], retain: bool) -> Vec<u8> {
    let flags = 0x02 | 0x04 | if retain { 0x20 } else { 0 } | 0xC0;
    let mut body = vec![0, 4, b'M', b'Q', b'T', b'T', 4, flags, 0, 60];
    string(id.as_bytes(), &mut body);
    string(topic.as_bytes(), &mut body);
    string(message, &mut body);
    string(login.0.as_bytes(), &mut body);
    string(login.1.as_bytes(), &mut body);
    frame(0x10, &body)
}

/// An MQTT 5 PUBLISH with a Topic Alias property (`topic` may be empty to
/// use the alias alone).
pub fn publish_aliased(topic: &str, payload: &[u8], qos: u8, retain: bool, pkid: u16, alias: u16) -> Vec<u8> {
    let mut body = Vec::new();
    string(topic.as_bytes(), &mut body);
    if qos > 0 {
        body.extend_from_slice(&pkid.to_be_bytes());
    }
    body.extend_from_slice(&[3, 0x23]);
    body.extend_from_slice(&alias.to_be_bytes());
    body.extend_from_slice(payload);
    frame(0x30 | (qos << 1) | u8::from(retain), &body)
}

/// `connect` (either version) with Clean Start / Clean Session off.
pub fn without_clean_start(mut connect: Vec<u8>) -> Vec<u8> {
    let mut header = 2;
    while connect[header - 1] & 0x80 != 0 {
        header += 1;
    }
    connect[header + 7] &= !0x02;
    connect
}

/// `connect` (either version, with a will) with the will's QoS `qos`.
pub fn with_will_qos(mut connect: Vec<u8>, qos: u8) -> Vec<u8> {
    let mut header = 2;
    while connect[header - 1] & 0x80 != 0 {
        header += 1;
    }
    connect[header + 7] = (connect[header + 7] & !0x18) | (qos << 3);
    connect
}

/// An MQTT 5 CONNECT (clean start) with a Session Expiry Interval and a
/// will (QoS 0, retained when `retain`) with a Will Delay Interval.
pub fn connect_v5_with_will(
    id: &str,
    login: (&str, &str),
    will: (&str, &[u8], bool),
    delay_s: u32,
    session_expiry_s: u32,
) -> Vec<u8> {
    let (topic, message, retain) = will;
    let flags = 0x02 | 0x04 | if retain { 0x20 } else { 0 } | 0xC0;
    let mut body = vec![0, 4, b'M', b'Q', b'T', b'T', 5, flags, 0, 60, 5, 0x11];
    body.extend_from_slice(&session_expiry_s.to_be_bytes());
    string(id.as_bytes(), &mut body);
    body.extend_from_slice(&[5, 0x18]);
    body.extend_from_slice(&delay_s.to_be_bytes());
    string(topic.as_bytes(), &mut body);
    string(message, &mut body);
    string(login.0.as_bytes(), &mut body);
    string(login.1.as_bytes(), &mut body);
    frame(0x10, &body)
}

/// An MQTT 5 CONNECT (keep-alive 60 s) with Clean Start `clean` and the
/// properties `props` (their bytes, see [`prop_u32`], [`prop_u16`]).
pub fn connect_v5_props(id: &str, login: (&str, &str), clean: bool, props: &[u8]) -> Vec<u8> {
    let flags = 0xC0 | if clean { 0x02 } else { 0 };
    let mut body = vec![0, 4, b'M', b'Q', b'T', b'T', 5, flags, 0, 60];
    remaining_length(props.len(), &mut body);
    body.extend_from_slice(props);
    string(id.as_bytes(), &mut body);
    string(login.0.as_bytes(), &mut body);
    string(login.1.as_bytes(), &mut body);
    frame(0x10, &body)
}

/// A four-byte integer property (Session Expiry Interval 0x11, Maximum
/// Packet Size 0x27).
pub fn prop_u32(id: u8, v: u32) -> Vec<u8> {
    let mut p = vec![id];
    p.extend_from_slice(&v.to_be_bytes());
    p
}

/// A two-byte integer property (Receive Maximum 0x21).
pub fn prop_u16(id: u8, v: u16) -> Vec<u8> {
    let mut p = vec![id];
    p.extend_from_slice(&v.to_be_bytes());
    p
}

/// An MQTT 5 DISCONNECT with `reason` and the properties `props`.
pub fn disconnect_v5(reason: u8, props: &[u8]) -> Vec<u8> {
    let mut body = vec![reason];
    remaining_length(props.len(), &mut body);
    body.extend_from_slice(props);
    frame(0xE0, &body)
}

/// A SUBSCRIBE of one filter at `qos`; MQTT 5 when `v5`.
pub fn subscribe_qos(v5: bool, pkid: u16, filter: &str, qos: u8) -> Vec<u8> {
    let mut body = pkid.to_be_bytes().to_vec();
    if v5 {
        body.push(0);
    }
    string(filter.as_bytes(), &mut body);
    body.push(qos);
    frame(0x82, &body)
}

/// A PUBACK (success, the short form both versions read).
pub fn puback(pkid: u16) -> Vec<u8> {
    frame(0x40, &pkid.to_be_bytes())
}

/// The packet id of a QoS 1/2 PUBLISH's bytes.
pub fn publish_pkid(p: &[u8]) -> u16 {
    let mut i = 1;
    while p[i] & 0x80 != 0 {
        i += 1;
    }
    let len = u16::from_be_bytes([p[i + 1], p[i + 2]]) as usize;
    u16::from_be_bytes([p[i + 3 + len], p[i + 4 + len]])
}

/// The payload of an MQTT 5 PUBLISH's bytes.
pub fn publish_v5_payload(p: &[u8]) -> Vec<u8> {
    let mut i = 1;
    while p[i] & 0x80 != 0 {
        i += 1;
    }
    let len = u16::from_be_bytes([p[i + 1], p[i + 2]]) as usize;
    let mut at = i + 3 + len + if p[0] & 0x06 != 0 { 2 } else { 0 };
    let (mut props, mut mult) = (0usize, 1usize);
    loop {
        let b = p[at];
        at += 1;
        props += (b & 0x7F) as usize * mult;
        mult *= 128;
        if b & 0x80 == 0 {
            break;
        }
    }
    p[at + props..].to_vec()
}

/// The next packet on `s` within `within`, if any.
pub async fn packet_within(s: &mut TcpStream, within: Duration) -> Option<Vec<u8>> {
    tokio::time::timeout(within, packet(s)).await.ok().flatten()
}
