//! Review findings on the patched broker after issue 16 (shared groups,
//! retained messages and the client's Receive Maximum, kept sessions), as
//! a device sees them on real sockets with raw packets.
//!
//! Each test failed with the broker before the patch it names
//! (`patches/rumqttd/PATCHES.md` 30 and following).

mod mqtt_support;

use std::time::Duration;

use mqtt_support::raw;
use mqtt_support::*;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

/// Instances of device 1 (one namespace): the session under test and a
/// publisher.
const SUB: &str = "demo-device-1:sub";
const PUB: &str = "demo-device-1:pub";

/// Connects `id` (MQTT 5) with Clean Start and `props`. Panics unless
/// accepted.
async fn connect(addr: std::net::SocketAddr, id: &str, props: &[u8]) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.expect("connects");
    s.write_all(&raw::connect_v5_props(id, D1, true, props)).await.unwrap();
    let ack = raw::packet(&mut s).await.expect("a CONNACK");
    assert_eq!((ack[0], ack[3]), (0x20, 0), "accepted: {ack:02x?}");
    s
}

/// Subscribes `filter` at QoS 1 and waits for the SUBACK granting it.
async fn subscribe(s: &mut TcpStream, filter: &str) {
    s.write_all(&raw::subscribe_qos(true, 1, filter, 1)).await.unwrap();
    let ack = raw::packet(s).await.expect("a SUBACK");
    assert_eq!((ack[0], raw::reason(&ack)), (0x90, 1), "granted QoS 1: {ack:02x?}");
}

/// An MQTT 5 PUBLISH at QoS 1 with packet id `pkid` and `props` (already
/// encoded, without their length).
fn publish_props(topic: &str, payload: &[u8], retain: bool, pkid: u16, props: &[u8]) -> Vec<u8> {
    let mut body = (topic.len() as u16).to_be_bytes().to_vec();
    body.extend_from_slice(topic.as_bytes());
    body.extend_from_slice(&pkid.to_be_bytes());
    body.push(props.len() as u8);
    body.extend_from_slice(props);
    body.extend_from_slice(payload);
    let mut p = vec![0x32 | u8::from(retain), body.len() as u8];
    assert!(body.len() < 128, "one-byte remaining length");
    p.extend_from_slice(&body);
    p
}

/// Publishes `payload` on `topic` at QoS 1 with `props` from `p` and
/// waits for its PUBACK.
async fn publish(p: &mut TcpStream, topic: &str, payload: &str, retain: bool, pkid: u16, props: &[u8]) {
    p.write_all(&publish_props(topic, payload.as_bytes(), retain, pkid, props)).await.unwrap();
    let ack = raw::packet(p).await.expect("a PUBACK");
    assert_eq!((ack[0], raw::reason(&ack)), (0x40, 0), "published: {ack:02x?}");
}

fn payload(p: &[u8]) -> String {
    String::from_utf8_lossy(&raw::publish_v5_payload(p)).into_owned()
}

/// Review H2: a shared-group member whose next message expired while it
/// had no free slot still gets the messages after it. Failed before: the
/// group's cursor stayed on the expired message, the router thread re-read
/// it for ever (100 % CPU) and m3 never came.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_group_moves_past_an_expired_message() {
    let (_fake, gw, addr) = start(Knobs::default(), "").await;
    let mut s = connect(addr, SUB, &raw::prop_u16(0x21, 1)).await;
    subscribe(&mut s, "$share/g/t/#").await;
    let mut p = connect(addr, PUB, &[]).await;
    publish(&mut p, "t/a", "m1", false, 1, &[]).await;
    let m1 = raw::packet_within(&mut s, Duration::from_secs(2)).await.expect("m1");
    assert_eq!(payload(&m1), "m1");
    // m2 expires while m1 holds the only slot.
    publish(&mut p, "t/a", "m2", false, 2, &raw::prop_u32(0x02, 1)).await;
    tokio::time::sleep(Duration::from_secs(2)).await; // the expiry itself: time is the subject
    publish(&mut p, "t/a", "m3", false, 3, &[]).await;
    s.write_all(&raw::puback(raw::publish_pkid(&m1))).await.unwrap();
    let next = raw::packet_within(&mut s, Duration::from_secs(2)).await.expect("m3 after the expired m2");
    assert_eq!(payload(&next), "m3");
    gw.stop().await;
}

/// Review M1: a client with Receive Maximum 2 subscribing to 5 retained
/// messages gets all 5 as it acknowledges them. Failed before: 2 (the
/// ones over the free slots were dropped).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retained_messages_beyond_the_receive_maximum_wait_for_slots() {
    let (_fake, gw, addr) = start(Knobs::default(), "").await;
    let mut p = connect(addr, PUB, &[]).await;
    for i in 1..=5u16 {
        publish(&mut p, &format!("r/{i}"), &format!("m{i}"), true, i, &[]).await;
    }
    let mut s = connect(addr, SUB, &raw::prop_u16(0x21, 2)).await;
    subscribe(&mut s, "r/#").await;
    let mut got = Vec::new();
    while let Some(m) = raw::packet_within(&mut s, Duration::from_secs(1)).await {
        assert_eq!(m[0] & 0xF0, 0x30, "a PUBLISH: {m:02x?}");
        s.write_all(&raw::puback(raw::publish_pkid(&m))).await.unwrap();
        got.push(payload(&m));
    }
    got.sort();
    assert_eq!(got, ["m1", "m2", "m3", "m4", "m5"], "every retained message");
    gw.stop().await;
}

/// Review M3: an MQTT 3.1.1 clean session is not continued by a takeover
/// without clean session (MQTT-3.1.2-6: its state must not be reused):
/// Session Present 0 and none of its subscriptions. Failed before:
/// Session Present 1 and the old subscription's message came. (An MQTT 5
/// session with expiry 0 still is continued:
/// `a_takeover_continues_a_session_that_ends_with_its_connection`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_does_not_continue_a_3_1_1_clean_session() {
    let (_fake, gw, addr) = start(Knobs::default(), "").await;
    let (mut old, ack) = raw::connack(addr, &raw::connect(SUB, Some(D1))).await.expect("connects");
    assert_eq!(ack, raw::ACCEPTED);
    old.write_all(&raw::subscribe(1, "t/x")).await.unwrap();
    let suback = raw::packet(&mut old).await.expect("a SUBACK");
    assert_eq!(suback[0], 0x90, "{suback:02x?}");
    let (mut s, ack) =
        raw::connack(addr, &raw::without_clean_start(raw::connect(SUB, Some(D1)))).await.expect("connects");
    assert_eq!((ack[0], ack[3]), (0x20, 0), "accepted: {ack:02x?}");
    assert_eq!(ack[2], 0, "Session Present 0: the clean session ended with its connection");
    let mut p = connect(addr, PUB, &[]).await;
    publish(&mut p, "t/x", "m1", false, 1, &[]).await;
    let got = raw::packet_within(&mut s, Duration::from_secs(1)).await;
    assert!(got.is_none(), "nothing from the old session's subscription: {got:02x?}");
    drop(old);
    gw.stop().await;
}

/// An MQTT 5 SUBSCRIBE of `filter` at QoS 0 with packet id `pkid` and, if
/// any, Subscription Identifier `id` (under 128).
fn subscribe_id(pkid: u16, filter: &str, id: Option<u8>) -> Vec<u8> {
    let mut body = pkid.to_be_bytes().to_vec();
    match id {
        Some(id) => body.extend_from_slice(&[2, 0x0B, id]),
        None => body.push(0),
    }
    body.extend_from_slice(&(filter.len() as u16).to_be_bytes());
    body.extend_from_slice(filter.as_bytes());
    body.push(0);
    let mut p = vec![0x82, body.len() as u8];
    p.extend_from_slice(&body);
    p
}

/// The property bytes of an MQTT 5 QoS 0 PUBLISH (one-byte lengths).
fn publish_props_of(p: &[u8]) -> Vec<u8> {
    let mut i = 1;
    while p[i] & 0x80 != 0 {
        i += 1;
    }
    let len = u16::from_be_bytes([p[i + 1], p[i + 2]]) as usize;
    let at = i + 3 + len;
    p[at + 1..at + 1 + p[at] as usize].to_vec()
}

/// Review L5a: a re-SUBSCRIBE without a Subscription Identifier drops the
/// one the first SUBSCRIBE gave (MQTT-3.8.4-3: the new subscription
/// replaces the old). Failed before: messages still carried identifier 7.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resubscribe_without_an_identifier_drops_the_old_one() {
    let (_fake, gw, addr) = start(Knobs::default(), "").await;
    let mut s = connect(addr, SUB, &[]).await;
    for (pkid, id) in [(1, Some(7)), (2, None)] {
        s.write_all(&subscribe_id(pkid, "l/t", id)).await.unwrap();
        let ack = raw::packet(&mut s).await.expect("a SUBACK");
        assert_eq!((ack[0], raw::reason(&ack)), (0x90, 0), "granted: {ack:02x?}");
    }
    let mut p = connect(addr, PUB, &[]).await;
    publish(&mut p, "l/t", "m1", false, 1, &[]).await;
    let m = raw::packet_within(&mut s, Duration::from_secs(2)).await.expect("m1");
    assert_eq!(payload(&m), "m1");
    let props = publish_props_of(&m);
    assert!(!props.contains(&0x0B), "no Subscription Identifier: {props:02x?}");
    gw.stop().await;
}

/// The payloads of the PUBLISHes that arrive within `within` of each other;
/// acknowledged only if `ack`.
async fn publishes(s: &mut TcpStream, within: Duration, ack: bool) -> Vec<String> {
    let mut got = Vec::new();
    while let Some(p) = raw::packet_within(s, within).await {
        assert_eq!(p[0] & 0xF0, 0x30, "a PUBLISH: {p:02x?}");
        if ack && p[0] & 0x06 != 0 {
            s.write_all(&raw::puback(raw::publish_pkid(&p))).await.unwrap();
        }
        got.push(String::from_utf8_lossy(&raw::publish_v5_payload(&p)).into_owned());
    }
    got
}

/// Review M4 (b): QoS 0 messages are not part of the session state (MQTT 5
/// §4.1): at a resume the unacknowledged QoS 1 messages come again, the
/// QoS 0 one delivered between them does not. Failed before: m1, m2, m3
/// (the resume re-read the log from the first unacknowledged message).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resumed_session_gets_its_unacknowledged_messages_again_but_no_qos0_one() {
    let (_fake, gw, addr) = start(Knobs::default(), "").await;
    let mut s = connect(addr, SUB, &raw::prop_u32(0x11, 60)).await;
    subscribe(&mut s, "s/t").await;
    let mut p = connect(addr, PUB, &[]).await;
    publish(&mut p, "s/t", "m1", false, 1, &[]).await;
    p.write_all(&raw::publish_with(true, "s/t", b"m2", 0, false, 0)).await.unwrap();
    publish(&mut p, "s/t", "m3", false, 2, &[]).await;
    assert_eq!(publishes(&mut s, Duration::from_secs(1), false).await, ["m1", "m2", "m3"], "none acknowledged");
    s.write_all(&raw::disconnect_v5(0, &[])).await.unwrap();
    assert!(raw::closed(&mut s).await);

    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(&raw::connect_v5_props(SUB, D1, false, &raw::prop_u32(0x11, 60))).await.unwrap();
    let ack = raw::packet(&mut s).await.expect("a CONNACK");
    assert_eq!((ack[0], ack[2], ack[3]), (0x20, 1, 0), "the session resumed: {ack:02x?}");
    assert_eq!(publishes(&mut s, Duration::from_secs(1), true).await, ["m1", "m3"], "m2 was QoS 0");
    // What comes next is delivered as usual, QoS 0 included.
    p.write_all(&raw::publish_with(true, "s/t", b"m4", 0, false, 0)).await.unwrap();
    assert_eq!(publishes(&mut s, Duration::from_secs(1), true).await, ["m4"]);
    gw.stop().await;
}

/// Review (smaller points): a client may complete a QoS 2 delivery before
/// it acknowledges an earlier QoS 1 one (they are different flows,
/// MQTT-4.6.0); rumqttd took acknowledgements in the order it sent and
/// disconnected the client. Now PUBREC 2, PUBCOMP 2, then PUBACK 1 are
/// each taken, and the connection goes on. Failed before: the connection
/// was closed after the PUBREC (no PUBREL).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_qos2_flow_may_complete_before_an_earlier_qos1_acknowledgement() {
    let (_fake, gw, addr) = start(Knobs::default(), "").await;
    let mut s = connect(addr, SUB, &[]).await;
    s.write_all(&raw::subscribe_qos(true, 1, "s/t", 2)).await.unwrap();
    let ack = raw::packet(&mut s).await.expect("a SUBACK");
    assert_eq!((ack[0], raw::reason(&ack)), (0x90, 2), "granted QoS 2: {ack:02x?}");
    let mut p = connect(addr, PUB, &[]).await;
    publish(&mut p, "s/t", "m1", false, 1, &[]).await;
    p.write_all(&raw::publish_with(true, "s/t", b"m2", 2, false, 2)).await.unwrap();
    assert_eq!(raw::packet(&mut p).await.expect("a PUBREC")[0], 0x50);
    p.write_all(&raw::pubrel(2)).await.unwrap();
    assert_eq!(raw::packet(&mut p).await.expect("a PUBCOMP")[0], 0x70);

    let m1 = raw::packet(&mut s).await.expect("m1");
    let m2 = raw::packet(&mut s).await.expect("m2");
    assert_eq!((m1[0] & 0x06, m2[0] & 0x06), (0x02, 0x04), "QoS 1 then QoS 2");
    let (id1, id2) = (raw::publish_pkid(&m1), raw::publish_pkid(&m2));
    let [h, l] = id2.to_be_bytes();
    s.write_all(&[0x50, 2, h, l]).await.unwrap(); // PUBREC m2 first
    let rel = raw::packet_within(&mut s, Duration::from_secs(2)).await.expect("a PUBREL, not a close");
    assert_eq!(rel[0], 0x62, "PUBREL: {rel:02x?}");
    s.write_all(&[0x70, 2, h, l]).await.unwrap(); // PUBCOMP
    s.write_all(&raw::puback(id1)).await.unwrap(); // and only now PUBACK m1
    publish(&mut p, "s/t", "m3", false, 3, &[]).await;
    let m3 = raw::packet_within(&mut s, Duration::from_secs(2)).await.expect("m3: still connected");
    assert_eq!(raw::publish_v5_payload(&m3), b"m3");
    gw.stop().await;
}

/// Review M4 (a): a connection's plain and `$share` subscriptions on one
/// filter shared one redelivery cursor: when the connection ended with a
/// plain delivery unacknowledged, the share group's cursor was rewound to
/// it, and the group's other member got the group's messages again. Here
/// the group delivers at QoS 0 (nothing of the group is in flight), so the
/// group must not move back. Failed before: the other member got m1..m3
/// again with m4.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_subscriptions_redelivery_does_not_rewind_the_share_group() {
    let (_fake, gw, addr) = start(Knobs::default(), "").await;
    let mut s = connect(addr, SUB, &raw::prop_u32(0x11, 60)).await;
    subscribe(&mut s, "s/t").await;
    s.write_all(&raw::subscribe_qos(true, 2, "$share/g/s/t", 0)).await.unwrap();
    assert_eq!(raw::packet(&mut s).await.expect("a SUBACK")[0], 0x90);
    let mut other = connect(addr, "demo-device-1:other", &[]).await;
    other.write_all(&raw::subscribe_qos(true, 1, "$share/g/s/t", 0)).await.unwrap();
    assert_eq!(raw::packet(&mut other).await.expect("a SUBACK")[0], 0x90);
    let mut p = connect(addr, PUB, &[]).await;
    for (i, m) in ["m1", "m2", "m3"].iter().enumerate() {
        publish(&mut p, "s/t", m, false, i as u16 + 1, &[]).await;
    }
    // s: m1..m3 plainly (unacknowledged) and its turns of the group; the
    // other member: its turns.
    let got = publishes(&mut s, Duration::from_millis(500), false).await;
    let theirs = publishes(&mut other, Duration::from_millis(500), false).await;
    assert_eq!(got.len() + theirs.len(), 6, "3 plain and 3 shared: {got:?} {theirs:?}");
    s.write_all(&raw::disconnect_v5(0, &[])).await.unwrap();
    assert!(raw::closed(&mut s).await);
    publish(&mut p, "s/t", "m4", false, 4, &[]).await;
    assert_eq!(publishes(&mut other, Duration::from_secs(1), false).await, ["m4"], "nothing of the group again");
    gw.stop().await;
}
