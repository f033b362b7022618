//! Hostile MQTT clients on real sockets: resets right after CONNECT,
//! reconnect races, sockets that never send CONNECT, floods of refused
//! CONNECTs, and devices that try to grow the broker's memory.
//!
//! Two levels:
//! - `rumqttd_*` tests run the patched rumqttd alone (its router and a
//!   listener with its own MQTT 3.1.1 codec, no edgeway), so each one shows
//!   a defect of the crate itself (see `patches/rumqttd/PATCHES.md`): they
//!   fail with the crates.io rumqttd 0.20.0.
//! - the others run a whole gateway with its embedded broker and show what a
//!   device sees.

mod mqtt_support;

use std::net::SocketAddr;
use std::time::Duration;

use rumqttd::protocol::v4::V4;
use rumqttd::{ConnectionSettings, LinkType, Router, RouterConfig, Server, ServerSettings};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Raw MQTT packets and sockets, for what a well-behaved client library
/// will not do.
mod raw {
    use super::*;

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
}

/// rumqttd alone: its router and one MQTT 3.1.1 listener on a free port.
async fn bare_rumqttd(max_connections: usize) -> SocketAddr {
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
        },
    );
    let router_tx = router.spawn();
    let listen = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let settings = ServerSettings {
        name: "v4".into(),
        listen,
        tls: None,
        next_connection_delay_ms: 0,
        connections: ConnectionSettings {
            connection_timeout_ms: 5000,
            max_payload_size: 64 * 1024,
            max_inflight_count: 100,
            auth: None,
            external_auth: None,
            dynamic_filters: true,
        },
    };
    let mut server = Server::new(settings, router_tx, V4);
    let mut accept = Box::pin(async move { server.start(LinkType::Remote).await });
    // The first poll binds.
    assert!(futures::poll!(accept.as_mut()).is_pending(), "the listener binds");
    tokio::spawn(accept);
    listen
}

/// Whether a well-behaved client gets its CONNACK within `within` (a few
/// connections being torn down may hold slots for a moment; a leak holds
/// them for good).
async fn connects_within(addr: SocketAddr, connect: &[u8], within: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        if let Some((_, ack)) = raw::connack(addr, connect).await {
            if ack == raw::ACCEPTED {
                return true;
            }
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// PATCHES.md #1: a client that resets its socket right after CONNECT makes
/// the CONNACK write fail; the router must still learn the connection is
/// gone. Unpatched, each such reset can leak a router slot for good, and
/// 300 of them with `max_connections = 20` lock every client out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rumqttd_a_failed_connack_write_frees_the_router_slot() {
    let addr = bare_rumqttd(20).await;
    for i in 0..300 {
        raw::send_and_reset(addr, &raw::connect(&format!("reset-{i}"), None)).await;
    }
    assert!(
        connects_within(addr, &raw::connect("valid", None), Duration::from_secs(10)).await,
        "a valid client connects after 300 resets"
    );
}

/// PATCHES.md #2: a connection that fails before its link starts (here:
/// its CONNACK write) leaves its client id in the listener's will map with
/// nobody listening. Unpatched, the next connection of that client id
/// panics on it while holding the map's lock, which poisons the map: from
/// then on every connection of the listener panics, whatever its id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rumqttd_a_dead_will_entry_neither_panics_nor_poisons_the_listener() {
    let addr = bare_rumqttd(100).await;
    for _ in 0..20 {
        raw::send_and_reset(addr, &raw::connect("same-id", None)).await;
    }
    for id in ["same-id", "another-id", "same-id"] {
        let ack = raw::connack(addr, &raw::connect(id, None)).await.map(|(_, a)| a);
        assert_eq!(ack, Some(raw::ACCEPTED), "{id} connects");
    }
}

/// PATCHES.md #3: a link that ends by itself reports "closed" for its
/// connection id; when the router has already dropped that link (here: a
/// takeover by a new connection of the same client id, while the old link
/// was stuck writing to a client that reads nothing) and given the id to
/// the new connection, the late report must not remove the new one.
/// Unpatched, the new connection is dropped: its SUBSCRIBE gets no SUBACK.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rumqttd_a_late_closed_report_does_not_remove_the_new_connection() {
    let addr = bare_rumqttd(100).await;
    // The old connection subscribes and then reads nothing.
    let (mut old, ack) = raw::connack(addr, &raw::connect("same-id", None)).await.expect("connects");
    assert_eq!(ack, raw::ACCEPTED);
    old.write_all(&raw::subscribe(1, "flood/#")).await.unwrap();
    assert_eq!(raw::packet(&mut old).await.map(|p| p[0]), Some(0x90), "SUBACK");
    // Enough data that its link blocks writing (socket buffers full).
    let (mut publisher, _) = raw::connack(addr, &raw::connect("publisher", None)).await.expect("connects");
    let chunk = raw::publish("flood/x", &[b'x'; 60 * 1024]);
    for _ in 0..400 {
        publisher.write_all(&chunk).await.unwrap();
    }
    // A publish the router handles after all of those: the flood is in.
    let (mut probe, _) = raw::connack(addr, &raw::connect("probe", None)).await.expect("connects");
    probe.write_all(&raw::subscribe(1, "probe")).await.unwrap();
    assert_eq!(raw::packet(&mut probe).await.map(|p| p[0]), Some(0x90));
    publisher.write_all(&raw::publish("probe", b"p")).await.unwrap();
    assert_eq!(raw::packet(&mut probe).await.map(|p| p[0]), Some(0x30));

    // Takeover: the router drops the old link and gives its id to the new.
    let (mut new, ack) = raw::connack(addr, &raw::connect("same-id", None)).await.expect("connects");
    assert_eq!(ack, raw::ACCEPTED);
    // The old link's write fails now: it reports "closed".
    let _ = socket2::SockRef::from(&old).set_linger(Some(Duration::ZERO));
    drop(old);
    // The new connection keeps working, round after round.
    new.write_all(&raw::subscribe(1, "echo")).await.unwrap();
    assert_eq!(raw::packet(&mut new).await.map(|p| p[0]), Some(0x90), "SUBACK");
    for i in 0..50u16 {
        new.write_all(&raw::subscribe(i + 2, &format!("echo/{i}"))).await.unwrap();
        assert_eq!(raw::packet(&mut new).await.map(|p| p[0]), Some(0x90), "SUBACK {i}");
        tokio::task::yield_now().await;
    }
    new.write_all(&raw::publish("echo", b"still here")).await.unwrap();
    let p = raw::packet(&mut new).await.expect("its own message");
    assert!(p.ends_with(b"still here"), "{p:?}");
}

/// Item 1 of issue 10, as a device sees it: CONNECTs followed at once by a
/// TCP reset, refused ones (a wrong password) and accepted ones (an
/// instance of a real device), never lock valid devices out. Checked every
/// 10 resets, so a failure says after how many it happened. Before the
/// rumqttd patches, with `max_connections = 20`, a valid device got no
/// CONNACK after a few dozen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_then_reset_never_locks_devices_out() {
    use mqtt_support::*;
    let (_fake, gw, addr) = start(Knobs::default(), "max_connections = 20").await;
    let valid = raw::connect(D2.0, Some((D2.0, D2.1)));
    for i in 0..300 {
        let id = format!("{}:r{i}", D1.0);
        let password = if i % 2 == 0 { "wrong" } else { D1.1 };
        raw::send_and_reset(addr, &raw::connect(&id, Some((D1.0, password)))).await;
        if i % 10 == 9 {
            let ok = connects_within(addr, &valid, Duration::from_secs(5)).await;
            assert!(ok, "a valid device was locked out after {} resets", i + 1);
        }
    }
    gw.stop().await;
}
