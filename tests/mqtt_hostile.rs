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

use std::time::Duration;

use mqtt_support::raw::{self, bare_rumqttd, bare_rumqttd_with, connects_within};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

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

/// Item 2 of issue 10, MQTT: 1000 sockets that never send CONNECT hold no
/// device out while they are open (a valid device connects beside them),
/// and all are closed once `connect_timeout_ms` is over, counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_sockets_without_connect_are_closed_at_the_deadline() {
    use mqtt_support::*;
    use tokio::io::AsyncReadExt;
    let (_fake, gw, addr) = start(Knobs::default(), "connect_timeout_ms = 2000").await;
    let mut idle = Vec::new();
    for _ in 0..1000 {
        idle.push(tokio::net::TcpStream::connect(addr).await.expect("accepted"));
    }
    let started = std::time::Instant::now();
    let mut d = device(addr, V::V4, D1).await;
    d.subscribe(&d.topic("x")).await;
    // Each idle socket is closed by the broker (EOF), none is left open.
    let closed = futures::future::join_all(idle.iter_mut().map(|s| async move {
        let mut b = [0u8; 1];
        matches!(tokio::time::timeout(Duration::from_secs(30), s.read(&mut b)).await, Ok(Ok(0) | Err(_)))
    }))
    .await;
    let elapsed = started.elapsed();
    assert_eq!(closed.iter().filter(|c| **c).count(), 1000, "closed by the broker");
    assert!(elapsed >= Duration::from_millis(1500), "not before the deadline: {elapsed:?}");
    eprintln!("1000 idle sockets closed {elapsed:?} after they were opened (deadline 2 s)");
    assert_eq!(metric(&gw, r#"mqtt_connect_timeouts_total{listener="mqtt"}"#), Some(1000.0));
    // The gauge follows the sockets' close by a moment.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while metric(&gw, r#"mqtt_sockets_awaiting_connect{listener="mqtt"}"#) != Some(0.0) {
        assert!(tokio::time::Instant::now() < deadline, "no socket left awaiting CONNECT");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    gw.stop().await;
}

/// At the cap of sockets before CONNECT, a new socket is closed at once
/// (not held, not queued) and counted; once the idle ones are gone, devices
/// connect again. Unpatched, rumqttd had no cap at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_cap_of_sockets_before_connect_new_ones_are_closed_at_once() {
    use mqtt_support::*;
    use tokio::io::AsyncReadExt;
    let (_fake, gw, addr) = start(Knobs::default(), "max_pending_connects = 50\nconnect_timeout_ms = 60000").await;
    let mut idle = Vec::new();
    for _ in 0..50 {
        idle.push(tokio::net::TcpStream::connect(addr).await.expect("accepted"));
    }
    // Wait until the listener counts them all (accepting is asynchronous).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while metric(&gw, r#"mqtt_sockets_awaiting_connect{listener="mqtt"}"#) != Some(50.0) {
        assert!(tokio::time::Instant::now() < deadline, "50 sockets awaiting CONNECT");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mut extra = tokio::net::TcpStream::connect(addr).await.expect("the kernel accepts");
    let mut b = [0u8; 1];
    let r = tokio::time::timeout(Duration::from_secs(5), extra.read(&mut b)).await;
    assert!(matches!(r, Ok(Ok(0) | Err(_))), "closed at once, long before the 60 s deadline: {r:?}");
    assert_eq!(metric(&gw, r#"mqtt_sockets_refused_total{listener="mqtt"}"#), Some(1.0));
    drop(idle);
    assert!(
        connects_within(addr, &raw::connect(D1.0, Some((D1.0, D1.1))), Duration::from_secs(10)).await,
        "a device connects once the idle sockets are gone"
    );
    gw.stop().await;
}

/// PATCHES.md #5: a listener caps the sockets that have not sent CONNECT;
/// past the cap a new socket is closed at once (unpatched: no cap, every
/// socket is held until the connection timeout).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rumqttd_past_the_cap_a_new_socket_is_closed_at_once() {
    use tokio::io::AsyncReadExt;
    let addr = bare_rumqttd_with(100, rumqttd::LinkType::Remote, serde_json::json!({"max_awaiting_connect": 5})).await;
    let mut idle = Vec::new();
    for _ in 0..5 {
        idle.push(tokio::net::TcpStream::connect(addr).await.unwrap());
    }
    // The sixth (accepted after the five: the accept loop takes them in
    // order) is closed long before the 5 s connection timeout.
    let mut sixth = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut b = [0u8; 1];
    let r = tokio::time::timeout(Duration::from_secs(3), sixth.read(&mut b)).await;
    assert!(matches!(r, Ok(Ok(0) | Err(_))), "closed at once: {r:?}");
}

/// PATCHES.md #5: a client that opens a socket to a WebSocket listener and
/// never sends its HTTP upgrade does not stop the listener (unpatched, the
/// handshake ran in the accept loop: nobody else got in until it ended).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rumqttd_a_stalled_handshake_does_not_stop_the_listener() {
    let addr = bare_rumqttd_with(100, rumqttd::LinkType::Websocket, serde_json::json!({})).await;
    let _stalled = tokio::net::TcpStream::connect(addr).await.unwrap();
    assert!(raw::websocket_upgrade(addr).await, "another client's upgrade is answered");
}

/// Item 3: instances (client ids `{device}:{instance}`) per device are
/// limited, refused with a reason code (MQTT 5 0x97 Quota exceeded, 3.1.1
/// "server unavailable"); a takeover of an open client id is not a new
/// instance. Before, any number of instances connected (each could hold a
/// will and broker state).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_per_device_are_limited_with_a_reason_code() {
    use mqtt_support::*;
    let (_fake, gw, addr) = start(Knobs::default(), "max_instances_per_device = 2").await;
    let _a = connect(addr, V::V5, "demo-device-1:a", D1.0, D1.1).await.expect("first instance");
    let _b = connect(addr, V::V4, "demo-device-1:b", D1.0, D1.1).await.expect("second instance");
    let e = connect(addr, V::V5, "demo-device-1:c", D1.0, D1.1).await.err().expect("third refused");
    assert!(e.contains("QuotaExceeded"), "{e}");
    let e = connect(addr, V::V4, "demo-device-1:c", D1.0, D1.1).await.err().expect("third refused");
    assert!(e.contains("ServiceUnavailable"), "{e}");
    let _a2 = connect(addr, V::V5, "demo-device-1:a", D1.0, D1.1).await.expect("a takeover is no new instance");
    let _other = device(addr, V::V4, D2).await;
    gw.stop().await;
}

/// Item 3: a will over `max_will_bytes` is refused at CONNECT (MQTT 5 0x95
/// Packet too large). Before, wills up to `max_packet_bytes` (1 MiB) were
/// kept until the session ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_will_over_the_limit_is_refused() {
    use mqtt_support::*;
    let (_fake, gw, addr) = start(Knobs::default(), "max_will_bytes = 1000").await;
    let big = "w".repeat(1001);
    let e = connect_with_will(addr, V::V5, D1.0, D1.0, D1.1, Some(("ai/v1/demo-device-1/status", &big)))
        .await
        .err()
        .expect("refused");
    assert!(e.contains("PacketTooLarge"), "{e}");
    let ok = "w".repeat(1000);
    connect_with_will(addr, V::V5, D1.0, D1.0, D1.1, Some(("ai/v1/demo-device-1/status", &ok)))
        .await
        .expect("a will at the limit");
    gw.stop().await;
}

/// Item 12: failed authentications of a device id are rate limited; beyond
/// the burst even the right password is refused at once (MQTT 5 0x9F
/// Connection rate exceeded, 3.1.1 "not authorized"), without a password
/// check; other devices are not affected. Before, every CONNECT ran the
/// password check, at any rate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_authentications_are_rate_limited_per_device() {
    use mqtt_support::*;
    let (_fake, gw, addr) = start(Knobs::default(), "auth_failures_per_s = 0.1").await;
    // A bucket of 1 (5 × 0.1, at least 1): one failure spends it.
    let e = connect(addr, V::V4, D1.0, D1.0, "wrong").await.err().expect("refused");
    assert!(e.contains("BadUserNamePassword"), "{e}");
    let e = connect(addr, V::V5, D1.0, D1.0, D1.1).await.err().expect("rate limited");
    assert!(e.contains("ConnectionRateExceeded"), "{e}");
    let e = connect(addr, V::V4, D1.0, D1.0, D1.1).await.err().expect("rate limited");
    assert!(e.contains("NotAuthorized"), "{e}");
    let _other = device(addr, V::V4, D2).await;
    gw.stop().await;
}

/// Sends `packet` and returns the next packet's type and reason code
/// (see [`raw::reason`]), `None` when the connection closed first.
async fn answer(s: &mut tokio::net::TcpStream, packet: &[u8]) -> Option<(u8, u8)> {
    s.write_all(packet).await.ok()?;
    raw::packet(s).await.map(|p| (p[0] & 0xF0, raw::reason(&p)))
}

/// Item 3 of issue 10: retained messages per device. Before, every
/// retained publish was acknowledged and kept by the router (one per
/// topic, no limit): a device could fill the broker's memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retained_messages_over_the_device_quota_are_refused_and_not_stored() {
    use mqtt_support::*;
    let (_fake, gw, addr) = start(Knobs::default(), "max_retained_per_device = 3").await;
    let (mut s, _) = raw::session(addr, true, D1.0, D1).await;
    let mut codes = Vec::new();
    for i in 0..6u16 {
        let (kind, code) = answer(&mut s, &raw::publish_with(true, &format!("r/{i}"), b"kept", 1, true, i + 1))
            .await
            .expect("a PUBACK");
        assert_eq!(kind, 0x40);
        codes.push(code);
    }
    assert_eq!(codes, [0, 0, 0, 0x97, 0x97, 0x97], "0x97 Quota exceeded past 3");
    // An empty payload deletes one and frees its place.
    assert_eq!(answer(&mut s, &raw::publish_with(true, "r/0", b"", 1, true, 10)).await, Some((0x40, 0)));
    assert_eq!(answer(&mut s, &raw::publish_with(true, "r/5", b"kept", 1, true, 11)).await, Some((0x40, 0)));

    // What the broker kept: r/1, r/2, r/5 and nothing refused.
    let (mut sub, _) = raw::session(addr, true, &format!("{}:sub", D1.0), D1).await;
    assert_eq!(answer(&mut sub, &raw::subscribe_with(true, 1, "r/#")).await, Some((0x90, 0)));
    s.write_all(&raw::publish_with(true, "r/end", b"marker", 0, false, 0)).await.unwrap();
    let mut retained = Vec::new();
    loop {
        let p = raw::packet(&mut sub).await.expect("the retained messages, then the marker");
        let topic = raw::publish_topic(&p);
        if topic == "r/end" {
            break;
        }
        retained.push(topic);
    }
    retained.sort();
    assert_eq!(retained, ["r/1", "r/2", "r/5"]);

    // 3.1.1 has no reason code in PUBACK: the connection is closed.
    let (mut v4, _) = raw::session(addr, false, &format!("{}:v4", D1.0), D1).await;
    v4.write_all(&raw::publish_with(false, "r/9", b"kept", 1, true, 1)).await.unwrap();
    assert_eq!(raw::packet(&mut v4).await, None, "no PUBACK");
    assert!(raw::closed(&mut v4).await);
    // Another device is not limited by this one.
    let (mut other, _) = raw::session(addr, false, D2.0, D2).await;
    assert_eq!(answer(&mut other, &raw::publish_with(false, "r/0", b"kept", 1, true, 1)).await, Some((0x40, 0)));
    gw.stop().await;
}

/// Item 3 of issue 10: QoS 2 publishes never released. The router keeps
/// each one until its PUBREL; before, a device could leave any number
/// pending. Now MQTT 5 devices are told the Receive Maximum
/// (`max_inflight`) in the CONNACK, and one past it ends the connection
/// (DISCONNECT 0x93; 3.1.1: closed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qos2_publishes_never_released_past_the_receive_maximum_end_the_connection() {
    use mqtt_support::*;
    let (_fake, gw, addr) = start(Knobs::default(), "max_inflight = 4").await;
    let (mut s, ack) = raw::session(addr, true, D1.0, D1).await;
    assert!(ack.windows(3).any(|w| w == [0x21, 0, 4]), "Receive Maximum 4 in the CONNACK: {ack:02x?}");
    for pkid in 1..=4 {
        assert_eq!(answer(&mut s, &raw::publish_with(true, "q", b"x", 2, false, pkid)).await, Some((0x50, 0)));
    }
    // A PUBREL frees its place.
    assert_eq!(answer(&mut s, &raw::pubrel(1)).await, Some((0x70, 0)));
    assert_eq!(answer(&mut s, &raw::publish_with(true, "q", b"x", 2, false, 5)).await, Some((0x50, 0)));
    // A resend of a pending one is not one more.
    assert_eq!(answer(&mut s, &raw::publish_with(true, "q", b"x", 2, false, 5)).await, Some((0x50, 0)));
    assert_eq!(answer(&mut s, &raw::publish_with(true, "q", b"x", 2, false, 6)).await, Some((0xE0, 0x93)));
    assert!(raw::closed(&mut s).await);

    let (mut v4, _) = raw::session(addr, false, D2.0, D2).await;
    for pkid in 1..=4 {
        assert_eq!(answer(&mut v4, &raw::publish_with(false, "q", b"x", 2, false, pkid)).await, Some((0x50, 0)));
    }
    assert_eq!(answer(&mut v4, &raw::publish_with(false, "q", b"x", 2, false, 5)).await, None);
    assert!(raw::closed(&mut v4).await);
    // The device connects again and goes on.
    let (mut again, _) = raw::session(addr, true, D1.0, D1).await;
    assert_eq!(answer(&mut again, &raw::publish_with(true, "q", b"x", 2, false, 1)).await, Some((0x50, 0)));
    gw.stop().await;
}

/// Paho's test_flow_control2: a client past the Receive Maximum is sent
/// DISCONNECT 0x93 while it is still writing (PUBRELs, pings). Before, the
/// server closed the socket at once: the client's next bytes met a closed
/// socket, the answer was a reset, and the client's writes failed (and its
/// unread DISCONNECT with them). Now the server half-closes and reads on
/// for a while, so the client writes on and then reads the DISCONNECT and
/// an orderly end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_still_writing_after_a_server_disconnect_receives_it_intact() {
    use mqtt_support::*;
    let (_fake, gw, addr) = start(Knobs::default(), "max_inflight = 4").await;
    let (mut s, _) = raw::session(addr, true, D1.0, D1).await;
    // Five QoS 2 publishes in one write: the fifth is one past the
    // Receive Maximum. Nothing is read yet, as a busy client would.
    let mut burst = Vec::new();
    for pkid in 1..=5 {
        burst.extend(raw::publish_with(true, "q", b"x", 2, false, pkid));
    }
    s.write_all(&burst).await.unwrap();
    // The client goes on writing for a while (0.3 s, well within the
    // server's lingering) as it would before it reads again.
    for i in 0..30 {
        let write = s.write_all(&[0xC0, 0]).await;
        assert!(write.is_ok(), "ping {i} after the DISCONNECT was written: {write:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Everything the server sent, up to its end: EOF, not a reset.
    let mut bytes = Vec::new();
    let end = tokio::time::timeout(Duration::from_secs(5), async {
        let mut buf = [0u8; 4096];
        loop {
            match s.read(&mut buf).await {
                Ok(0) => return Ok(()),
                Ok(n) => bytes.extend_from_slice(&buf[..n]),
                Err(e) => return Err(e),
            }
        }
    })
    .await
    .expect("the server ends the connection");
    assert!(end.is_ok(), "an orderly end, not a reset: {end:?} after {bytes:02x?}");
    // The DISCONNECT last; before it at most the PUBRECs of the first four
    // (the router's answers to those may not be written before the end).
    let mut packets = Vec::new();
    let mut rest = &bytes[..];
    while rest.len() >= 2 {
        let len = 2 + rest[1] as usize;
        packets.push(rest[..len].to_vec());
        rest = &rest[len..];
    }
    let kinds: Vec<u8> = packets.iter().map(|p| p[0] & 0xF0).collect();
    assert_eq!(kinds.last(), Some(&0xE0), "{bytes:02x?}");
    assert!(kinds[..kinds.len() - 1].iter().all(|k| *k == 0x50), "{bytes:02x?}");
    assert_eq!(raw::reason(packets.last().unwrap()), 0x93, "Receive Maximum exceeded");
    gw.stop().await;
}

/// Item 3 of issue 10: topic names and filters (the router caches each for
/// good) per device, and subscriptions per connection. Before, any number
/// was accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topics_and_subscriptions_over_their_limits_are_refused() {
    use mqtt_support::*;
    let limits = "max_topics_per_device = 5\nmax_subscriptions_per_connection = 3";
    let (_fake, gw, addr) = start(Knobs::default(), limits).await;
    let (mut s, _) = raw::session(addr, true, D1.0, D1).await;
    for i in 0..3u16 {
        assert_eq!(answer(&mut s, &raw::subscribe_with(true, i + 1, &format!("f/{i}"))).await, Some((0x90, 0)));
    }
    // A fourth subscription on this connection.
    assert_eq!(answer(&mut s, &raw::subscribe_with(true, 4, "f/3")).await, Some((0x90, 0x97)));
    assert_eq!(answer(&mut s, &raw::unsubscribe_with(true, 5, "f/0")).await.map(|a| a.0), Some(0xB0));
    assert_eq!(answer(&mut s, &raw::subscribe_with(true, 6, "f/3")).await, Some((0x90, 0)));
    // Four filters and one topic name make the device's five.
    assert_eq!(answer(&mut s, &raw::publish_with(true, "t/0", b"x", 1, false, 7)).await, Some((0x40, 0)));
    assert_eq!(answer(&mut s, &raw::publish_with(true, "t/1", b"x", 1, false, 8)).await, Some((0x40, 0x97)));
    assert_eq!(answer(&mut s, &raw::publish_with(true, "t/0", b"x", 1, false, 9)).await, Some((0x40, 0)));

    // 3.1.1: SUBACK 0x80; a publish to a sixth topic closes.
    let (mut v4, _) = raw::session(addr, false, &format!("{}:v4", D1.0), D1).await;
    assert_eq!(answer(&mut v4, &raw::subscribe_with(false, 1, "f/9")).await, Some((0x90, 0x80)));
    assert_eq!(answer(&mut v4, &raw::subscribe_with(false, 2, "f/1")).await, Some((0x90, 0)), "a known filter");
    v4.write_all(&raw::publish_with(false, "t/9", b"x", 0, false, 0)).await.unwrap();
    assert!(raw::closed(&mut v4).await);
    // Another device is not limited by this one.
    let (mut other, _) = raw::session(addr, true, D2.0, D2).await;
    assert_eq!(answer(&mut other, &raw::subscribe_with(true, 1, "f/9")).await, Some((0x90, 0)));
    assert_eq!(answer(&mut other, &raw::publish_with(true, "t/9", b"x", 1, false, 2)).await, Some((0x40, 0)));
    gw.stop().await;
}

/// Item 12 of issue 10: failed logins were limited per device id only, so
/// an attacker rotating device ids was never slowed. Now per source address
/// too; a device from another address still connects meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_logins_are_rate_limited_per_source_address_whatever_the_device_id() {
    use mqtt_support::*;
    let limits = "auth_failures_per_s = 1000\nauth_failures_per_ip_per_s = 0.2";
    let (_fake, gw, addr) = start(Knobs::default(), limits).await;
    let attacker: std::net::IpAddr = "127.0.0.2".parse().unwrap();
    let other: std::net::IpAddr = "127.0.0.1".parse().unwrap();
    // The burst (5 × 0.2 = 1 failure), then every id is refused unchecked.
    let first = raw::connack_code_from(attacker, addr, &raw::connect("rot-0", Some(("rot-0", "guess")))).await;
    assert_eq!(first, Some(4), "bad user name or password");
    for i in 1..4 {
        let id = format!("rot-{i}");
        let code = raw::connack_code_from(attacker, addr, &raw::connect(&id, Some((&id, "guess")))).await;
        assert_eq!(code, Some(5), "{id}: not authorized, without a password check");
    }
    let code = raw::connack_code_from(attacker, addr, &raw::connect_v5("rot-9", Some(("rot-9", "guess")))).await;
    assert_eq!(code, Some(0x9F), "MQTT 5: Connection rate exceeded");
    // Even good credentials from that address wait for the bucket…
    let code = raw::connack_code_from(attacker, addr, &raw::connect(D1.0, Some(D1))).await;
    assert_eq!(code, Some(5));
    // …while a device from another address connects.
    let code = raw::connack_code_from(other, addr, &raw::connect(D2.0, Some(D2))).await;
    assert_eq!(code, Some(0), "another address is not limited");
    gw.stop().await;
}

/// A retained will is a retained publish of the device: before, edgeway
/// published it for the device with no quota, so reconnecting with wills
/// on new topics kept any number of retained messages. Over the quota it
/// still reaches current subscribers, but is not kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retained_will_over_the_quota_is_delivered_but_not_kept() {
    use mqtt_support::*;
    let (_fake, gw, addr) = start(Knobs::default(), "max_retained_per_device = 1").await;
    let (mut s, _) = raw::session(addr, true, D1.0, D1).await;
    assert_eq!(answer(&mut s, &raw::publish_with(true, "w/0", b"kept", 1, true, 1)).await, Some((0x40, 0)));
    assert_eq!(answer(&mut s, &raw::subscribe_with(true, 2, "w/#")).await, Some((0x90, 0)));
    assert_eq!(raw::packet(&mut s).await.map(|p| raw::publish_topic(&p)).as_deref(), Some("w/0"), "retained");
    // A connection with a retained will goes away: its will is published.
    let will = raw::connect_with_will(&format!("{}:w", D1.0), D1, "w/1", b"gone", true);
    let (mut w, ack) = raw::connack(addr, &will).await.expect("a CONNACK");
    assert_eq!(ack, raw::ACCEPTED);
    let _ = socket2::SockRef::from(&w).set_linger(Some(Duration::ZERO));
    let _ = w.shutdown().await;
    drop(w);
    let p = raw::packet(&mut s).await.expect("the will, to a current subscriber");
    assert_eq!(raw::publish_topic(&p), "w/1");
    // What is kept: only w/0.
    let (mut late, _) = raw::session(addr, true, &format!("{}:late", D1.0), D1).await;
    assert_eq!(answer(&mut late, &raw::subscribe_with(true, 1, "w/#")).await, Some((0x90, 0)));
    s.write_all(&raw::publish_with(true, "w/end", b"marker", 0, false, 0)).await.unwrap();
    let mut kept = Vec::new();
    loop {
        let topic = raw::publish_topic(&raw::packet(&mut late).await.expect("retained, then the marker"));
        if topic == "w/end" {
            break;
        }
        kept.push(topic);
    }
    assert_eq!(kept, ["w/0"]);
    gw.stop().await;
}

/// Review finding H1 (PATCHES.md 12): a QoS 2 PUBLISH that reuses the
/// packet id of one awaiting its PUBREL is a resend, not one more: the
/// broker keeps one message per pending id. Before, rumqttd kept every
/// resend whole (a device looping PUBLISH QoS 2 with id 1 and no PUBREL grew
/// the broker's memory without bound, the Receive Maximum did not count
/// them) and each later PUBREL, whatever its id, delivered one of them:
/// what the subscriber receives here counts what the broker held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qos2_resends_of_one_packet_id_are_kept_once() {
    use mqtt_support::*;
    let (_fake, gw, addr) = start(Knobs::default(), "max_inflight = 4").await;
    let (mut sub, _) = raw::session(addr, true, &format!("{}:sub", D1.0), D1).await;
    assert_eq!(answer(&mut sub, &raw::subscribe_with(true, 1, "h1/#")).await, Some((0x90, 0)));
    let (mut s, _) = raw::session(addr, true, D1.0, D1).await;
    for i in 0..20 {
        let p = raw::publish_with(true, "h1/x", format!("copy {i}").as_bytes(), 2, false, 1);
        assert_eq!(answer(&mut s, &p).await, Some((0x50, 0)), "PUBREC of resend {i}");
    }
    // One PUBREL releases the one message; the others name no pending id
    // (MQTT 5: PUBCOMP 0x92 Packet Identifier not found), and nothing more.
    assert_eq!(answer(&mut s, &raw::pubrel(1)).await, Some((0x70, 0)));
    for _ in 0..3 {
        assert_eq!(answer(&mut s, &raw::pubrel(1)).await, Some((0x70, 0x92)));
    }
    s.write_all(&raw::publish_with(true, "h1/end", b"marker", 0, false, 0)).await.unwrap();
    let mut got = Vec::new();
    loop {
        let p = raw::packet(&mut sub).await.expect("the released messages, then the marker");
        if raw::publish_topic(&p) == "h1/end" {
            break;
        }
        got.push(p);
    }
    assert_eq!(got.len(), 1, "one message held for packet id 1, not one per resend");
    assert!(got[0].ends_with(b"copy 19"), "the last resend is the one kept");
    // The connection goes on: a new QoS 2 publish with that id.
    assert_eq!(answer(&mut s, &raw::publish_with(true, "h1/x", b"again", 2, false, 1)).await, Some((0x50, 0)));
    assert_eq!(answer(&mut s, &raw::pubrel(1)).await, Some((0x70, 0)));
    gw.stop().await;
}

/// Review finding H2a: topic aliases. A device set an alias with a plain
/// publish (one topic counted, nothing retained), then published retained
/// messages by the alias alone, an empty topic: the quota counted them all
/// as one on "", the router stored one per aliased topic. Before, the six
/// retained publishes below were all acknowledged 0x00 and stored. Now the
/// codec resolves aliases itself (the router never sees one), advertises
/// the maximum it keeps, and ends a connection that uses an alias it does
/// not know or past that maximum (DISCONNECT 0x94).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topic_aliases_do_not_bypass_the_retained_quota() {
    use mqtt_support::*;
    let (_fake, gw, addr) = start(Knobs::default(), "max_retained_per_device = 3").await;
    let (mut s, ack) = raw::session(addr, true, D1.0, D1).await;
    let max = ack.windows(3).find(|w| w[0] == 0x22).map(|w| u16::from_be_bytes([w[1], w[2]]));
    assert!(max.is_some_and(|m| (6..=64).contains(&m)), "edgeway's Topic Alias Maximum in the CONNACK: {ack:02x?}");
    let mut codes = Vec::new();
    for i in 0..6u16 {
        s.write_all(&raw::publish_aliased(&format!("r/{i}"), b"set", 0, false, 0, i + 1)).await.unwrap();
        let (kind, code) =
            answer(&mut s, &raw::publish_aliased("", b"kept", 1, true, i + 1, i + 1)).await.expect("a PUBACK");
        assert_eq!(kind, 0x40);
        codes.push(code);
    }
    assert_eq!(codes, [0, 0, 0, 0x97, 0x97, 0x97], "0x97 Quota exceeded past 3");
    let (mut sub, _) = raw::session(addr, true, &format!("{}:sub", D1.0), D1).await;
    assert_eq!(answer(&mut sub, &raw::subscribe_with(true, 1, "r/#")).await, Some((0x90, 0)));
    s.write_all(&raw::publish_with(true, "r/end", b"marker", 0, false, 0)).await.unwrap();
    let mut retained = Vec::new();
    loop {
        let p = raw::packet(&mut sub).await.expect("the retained messages, then the marker");
        let topic = raw::publish_topic(&p);
        if topic == "r/end" {
            break;
        }
        retained.push(topic);
    }
    retained.sort();
    assert_eq!(retained, ["r/0", "r/1", "r/2"]);
    // An alias never set, and one past the maximum, end the connection.
    assert_eq!(answer(&mut s, &raw::publish_aliased("", b"x", 1, false, 9, 40)).await, Some((0xE0, 0x94)));
    assert!(raw::closed(&mut s).await);
    let (mut s, _) = raw::session(addr, true, D1.0, D1).await;
    let past = max.unwrap() + 1;
    assert_eq!(answer(&mut s, &raw::publish_aliased("r/x", b"x", 1, false, 1, past)).await, Some((0xE0, 0x94)));
    assert!(raw::closed(&mut s).await);
    gw.stop().await;
}

/// Review finding H2b: the broker applies a QoS 2 publish at its PUBREL,
/// not at the PUBLISH. A retained QoS 2 publish counted at its PUBLISH,
/// then an empty publish to the same topic (which freed it in the quota),
/// then the PUBREL: the broker kept the message and the quota counted
/// nothing. Before, the retained publish below, past the bytes quota with
/// what the broker held, was acknowledged 0x00 and stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retained_qos2_publish_counts_when_it_is_released() {
    use mqtt_support::*;
    let (_fake, gw, addr) = start(Knobs::default(), "max_retained_bytes_per_device = 1000").await;
    let (mut s, _) = raw::session(addr, true, D1.0, D1).await;
    let big = [b'x'; 900];
    assert_eq!(answer(&mut s, &raw::publish_with(true, "b/a", &big, 2, true, 1)).await, Some((0x50, 0)));
    s.write_all(&raw::publish_with(true, "b/a", b"", 0, true, 0)).await.unwrap();
    assert_eq!(answer(&mut s, &raw::pubrel(1)).await, Some((0x70, 0)));
    // The broker holds 900 bytes on b/a: 900 more do not fit.
    assert_eq!(answer(&mut s, &raw::publish_with(true, "b/b", &big, 1, true, 2)).await, Some((0x40, 0x97)));
    let (mut sub, _) = raw::session(addr, true, &format!("{}:sub", D1.0), D1).await;
    assert_eq!(answer(&mut sub, &raw::subscribe_with(true, 1, "b/#")).await, Some((0x90, 0)));
    s.write_all(&raw::publish_with(true, "b/end", b"marker", 0, false, 0)).await.unwrap();
    let mut retained = Vec::new();
    loop {
        let p = raw::packet(&mut sub).await.expect("the retained messages, then the marker");
        let topic = raw::publish_topic(&p);
        if topic == "b/end" {
            break;
        }
        retained.push(topic);
    }
    assert_eq!(retained, ["b/a"]);
    // Deleting it frees the quota.
    s.write_all(&raw::publish_with(true, "b/a", b"", 0, true, 0)).await.unwrap();
    assert_eq!(answer(&mut s, &raw::publish_with(true, "b/b", &big, 1, true, 3)).await, Some((0x40, 0)));
    gw.stop().await;
}

/// Review finding M2: rumqttd restores the subscriptions of a session
/// resumed with Clean Start 0, so a limit per connection reset on every
/// reconnect let a device pile up subscriptions in the broker. Before, the
/// fourth subscription below, on a resumed session that already held three,
/// got SUBACK 0x00. Now they are counted per client id while its session
/// lasts (a clean start forgets them, as the broker does).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscriptions_are_counted_across_resumed_sessions() {
    use mqtt_support::*;
    let (_fake, gw, addr) = start(Knobs::default(), "max_subscriptions_per_connection = 3").await;
    let resume = || async {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        // Clean Start 0 and a Session Expiry: the broker keeps the session.
        s.write_all(&raw::connect_v5_props(D1.0, D1, false, &raw::prop_u32(0x11, 60))).await.unwrap();
        let ack = raw::packet(&mut s).await.expect("a CONNACK");
        (s, ack)
    };
    let (mut s, ack) = resume().await;
    assert_eq!(ack[3], 0);
    for i in 1..=3u16 {
        assert_eq!(answer(&mut s, &raw::subscribe_with(true, i, &format!("m/{i}"))).await, Some((0x90, 0)));
    }
    s.write_all(&[0xE0, 0]).await.unwrap();
    assert!(raw::closed(&mut s).await);
    let (mut s, ack) = resume().await;
    assert_eq!((ack[2], ack[3]), (1, 0), "the session is resumed");
    assert_eq!(answer(&mut s, &raw::subscribe_with(true, 4, "m/4")).await, Some((0x90, 0x97)));
    assert_eq!(answer(&mut s, &raw::subscribe_with(true, 5, "m/1")).await, Some((0x90, 0)), "one it holds");
    s.write_all(&[0xE0, 0]).await.unwrap();
    assert!(raw::closed(&mut s).await);
    // A clean start ends the session and its subscriptions.
    let (mut s, _) = raw::session(addr, true, D1.0, D1).await;
    assert_eq!(answer(&mut s, &raw::subscribe_with(true, 1, "m/4")).await, Some((0x90, 0)));
    gw.stop().await;
}

/// Review finding H2c: a will counts against the quotas when it is
/// published, not when it is armed: a delayed will cancelled by a reconnect
/// is never published. Before, it was counted when its connection went and
/// stayed counted: here the retained quota of 1 was spent by a will that was
/// never kept, and the device's one retained publish got PUBACK 0x97.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_will_cancelled_by_a_reconnect_does_not_count() {
    use mqtt_support::*;
    let (_fake, gw, addr) = start(Knobs::default(), "max_retained_per_device = 1").await;
    let connect = raw::connect_v5_with_will(D1.0, D1, ("w/1", b"gone", true), 60, 60);
    let mut w = tokio::net::TcpStream::connect(addr).await.unwrap();
    w.write_all(&connect).await.unwrap();
    assert_eq!(raw::packet(&mut w).await.map(|p| (p[0], p[3])), Some((0x20, 0)));
    let _ = socket2::SockRef::from(&w).set_linger(Some(Duration::ZERO));
    drop(w);
    assert!(until_devices_connected(&gw, 0).await, "the connection went (its will armed, 60 s delay)");
    // The device is back before the delay: the will is never published.
    let (mut s, _) = raw::session(addr, true, D1.0, D1).await;
    assert_eq!(answer(&mut s, &raw::publish_with(true, "w/0", b"kept", 1, true, 1)).await, Some((0x40, 0)));
    gw.stop().await;
}

/// Review finding M1: QoS 2 publishes awaiting PUBREL were bounded by
/// count per connection only (`max_inflight` × `max_instances_per_device`
/// × `max_packet_bytes`: 800 MiB per device by default). Now their bytes
/// are bounded per device, over all its connections
/// (`max_inflight_bytes_per_device`; DISCONNECT 0x97). Before, the third
/// publish below was acknowledged PUBREC 0x00.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qos2_bytes_awaiting_pubrel_are_bounded_per_device() {
    use mqtt_support::*;
    let (_fake, gw, addr) = start(Knobs::default(), "max_inflight_bytes_per_device = 3000").await;
    let kb = [b'x'; 1000];
    let (mut a, _) = raw::session(addr, true, D1.0, D1).await;
    for pkid in 1..=2 {
        assert_eq!(answer(&mut a, &raw::publish_with(true, "q", &kb, 2, false, pkid)).await, Some((0x50, 0)));
    }
    // A resend of a pending one replaces it: not more bytes.
    assert_eq!(answer(&mut a, &raw::publish_with(true, "q", &kb, 2, false, 2)).await, Some((0x50, 0)));
    let (mut b, _) = raw::session(addr, true, &format!("{}:b", D1.0), D1).await;
    assert_eq!(answer(&mut b, &raw::publish_with(true, "q", &kb, 2, false, 1)).await, Some((0xE0, 0x97)));
    assert!(raw::closed(&mut b).await);
    // A PUBREL frees its bytes, and so does the end of a connection.
    assert_eq!(answer(&mut a, &raw::pubrel(1)).await, Some((0x70, 0)));
    let (mut b, _) = raw::session(addr, true, &format!("{}:b", D1.0), D1).await;
    assert_eq!(answer(&mut b, &raw::publish_with(true, "q", &kb, 2, false, 1)).await, Some((0x50, 0)));
    assert_eq!(answer(&mut b, &raw::publish_with(true, "q", &kb, 2, false, 2)).await, Some((0xE0, 0x97)));
    drop(a);
    assert!(until_devices_connected(&gw, 0).await);
    let (mut c, _) = raw::session(addr, true, &format!("{}:c", D1.0), D1).await;
    assert_eq!(answer(&mut c, &raw::publish_with(true, "q", &kb, 2, false, 1)).await, Some((0x50, 0)));
    assert_eq!(answer(&mut c, &raw::publish_with(true, "q", &kb, 2, false, 2)).await, Some((0x50, 0)));
    gw.stop().await;
}
