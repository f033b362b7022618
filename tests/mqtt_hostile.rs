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
use tokio::io::AsyncWriteExt;

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
