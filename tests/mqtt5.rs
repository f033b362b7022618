//! MQTT 5 delivery semantics of the embedded broker, through the whole
//! gateway on real sockets (raw packets, so that QoS, packet ids and the
//! RETAIN flag of what a device receives can be read exactly): delivery
//! QoS, the subscribe options No Local, Retain As Published and Retain
//! Handling, and shared subscriptions (`$share/{group}/{filter}`) among a
//! device's own instances. Each test failed with rumqttd 0.20 as it was
//! (see `patches/rumqttd/PATCHES.md` 13–15).

mod mqtt_support;

use std::collections::HashSet;
use std::net::SocketAddr;

use mqtt_support::*;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

/// A PUBLISH as a device received it.
#[derive(Debug)]
struct Got {
    topic: String,
    qos: u8,
    retain: bool,
    pkid: Option<u16>,
    payload: Vec<u8>,
}

impl Got {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.payload).into_owned()
    }
}

fn varint(b: &[u8], i: &mut usize) -> usize {
    let (mut n, mut mult) = (0usize, 1usize);
    loop {
        let x = b[*i];
        *i += 1;
        n += (x & 0x7F) as usize * mult;
        mult *= 128;
        if x & 0x80 == 0 {
            return n;
        }
    }
}

/// Reads a PUBLISH's bytes (`v5`: with a property length).
fn parse(v5: bool, p: &[u8]) -> Got {
    let qos = (p[0] >> 1) & 3;
    let mut i = 1;
    varint(p, &mut i);
    let len = u16::from_be_bytes([p[i], p[i + 1]]) as usize;
    let topic = String::from_utf8_lossy(&p[i + 2..i + 2 + len]).into_owned();
    i += 2 + len;
    let pkid = (qos > 0).then(|| {
        i += 2;
        u16::from_be_bytes([p[i - 2], p[i - 1]])
    });
    if v5 {
        let props = varint(p, &mut i);
        i += props;
    }
    Got { topic, qos, retain: p[0] & 1 == 1, pkid, payload: p[i..].to_vec() }
}

/// The next PUBLISH on `s`, skipping acknowledgements; panics after 5 s
/// without one.
async fn next_publish(s: &mut TcpStream, v5: bool) -> Got {
    loop {
        let p = raw::packet(s).await.expect("a PUBLISH within 5 s");
        if p[0] & 0xF0 == 0x30 {
            return parse(v5, &p);
        }
    }
}

fn frame(first: u8, body: &[u8]) -> Vec<u8> {
    let mut p = vec![first];
    let mut n = body.len();
    loop {
        let mut b = (n % 128) as u8;
        n /= 128;
        if n > 0 {
            b |= 0x80;
        }
        p.push(b);
        if n == 0 {
            break;
        }
    }
    p.extend_from_slice(body);
    p
}

/// An MQTT 5 SUBSCRIBE of one filter with its options byte (QoS in bits
/// 0-1, No Local 0x04, Retain As Published 0x08, Retain Handling << 4).
fn subscribe_opts(pkid: u16, filter: &str, options: u8) -> Vec<u8> {
    let mut body = pkid.to_be_bytes().to_vec();
    body.push(0);
    body.extend_from_slice(&(filter.len() as u16).to_be_bytes());
    body.extend_from_slice(filter.as_bytes());
    body.push(options);
    frame(0x82, &body)
}

/// An MQTT 3.1.1 SUBSCRIBE of one filter at `qos`.
fn subscribe_v4(pkid: u16, filter: &str, qos: u8) -> Vec<u8> {
    let mut body = pkid.to_be_bytes().to_vec();
    body.extend_from_slice(&(filter.len() as u16).to_be_bytes());
    body.extend_from_slice(filter.as_bytes());
    body.push(qos);
    frame(0x82, &body)
}

/// Writes `packet` and waits for the answer of type `kind` (the first
/// byte's high nibble), skipping anything else; returns its reason code.
async fn ask(s: &mut TcpStream, packet: &[u8], kind: u8) -> u8 {
    s.write_all(packet).await.unwrap();
    loop {
        let p = raw::packet(s).await.unwrap_or_else(|| panic!("an answer {kind:#x} within 5 s"));
        if p[0] & 0xF0 == kind {
            return raw::reason(&p);
        }
    }
}

async fn publish(s: &mut TcpStream, topic: &str, payload: &str, qos: u8, retain: bool, pkid: u16) {
    let p = raw::publish_with(true, topic, payload.as_bytes(), qos, retain, pkid);
    match qos {
        0 => s.write_all(&p).await.unwrap(),
        1 => assert_eq!(ask(s, &p, 0x40).await, 0, "PUBACK"),
        _ => {
            assert_eq!(ask(s, &p, 0x50).await, 0, "PUBREC");
            assert_eq!(ask(s, &raw::pubrel(pkid), 0x70).await, 0, "PUBCOMP");
        }
    }
}

async fn instance(addr: SocketAddr, v5: bool, device: (&str, &str), name: &str) -> TcpStream {
    raw::session(addr, v5, &format!("{}:{name}", device.0), device).await.0
}

/// Item 1: a message is delivered at the lower of its publish QoS and the
/// subscription's, retained ones included. Before, rumqttd sent everything
/// at the subscription's QoS (QoS 0 messages arrived as QoS 2, each taking
/// a packet id and waiting for an acknowledgement).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delivery_qos_is_the_lower_of_publish_and_subscription_qos() {
    let (_fake, gw, addr) = start(Knobs::default(), "").await;
    let mut publisher = instance(addr, true, D1, "pub").await;
    publish(&mut publisher, "r/0", "r0", 0, true, 0).await;
    publish(&mut publisher, "r/1", "r1", 1, true, 1).await;
    publish(&mut publisher, "r/2", "r2", 2, true, 2).await;

    let mut sub = instance(addr, true, D1, "sub").await;
    let mut v4 = instance(addr, false, D1, "v4").await;
    assert_eq!(ask(&mut sub, &subscribe_opts(1, "r/#", 2), 0x90).await, 2);
    let mut retained: Vec<Got> = Vec::new();
    for _ in 0..3 {
        retained.push(next_publish(&mut sub, true).await);
    }
    retained.sort_by(|a, b| a.topic.cmp(&b.topic));
    let seen: Vec<(&str, u8, bool)> = retained.iter().map(|g| (g.topic.as_str(), g.qos, g.retain)).collect();
    assert_eq!(seen, [("r/0", 0, true), ("r/1", 1, true), ("r/2", 2, true)], "retained, at QoS 2: {retained:?}");
    assert_eq!(retained[0].pkid, None);
    let mut ids: Vec<u16> = retained.iter().filter_map(|g| g.pkid).collect();
    ids.sort();
    assert_eq!(ids, [1, 2], "a QoS 0 delivery takes no packet id");

    assert_eq!(ask(&mut sub, &subscribe_opts(2, "q/#", 2), 0x90).await, 2);
    assert_eq!(ask(&mut v4, &subscribe_v4(1, "q/#", 1), 0x90).await, 1);
    publish(&mut publisher, "q/a", "q0", 0, false, 0).await;
    publish(&mut publisher, "q/a", "q1", 1, false, 3).await;
    publish(&mut publisher, "q/a", "q2", 2, false, 4).await;
    let mut got = Vec::new();
    for _ in 0..3 {
        let g = next_publish(&mut sub, true).await;
        got.push((g.text(), g.qos, g.pkid));
    }
    let want = [("q0".to_string(), 0, None), ("q1".to_string(), 1, Some(3)), ("q2".to_string(), 2, Some(4))];
    assert_eq!(got, want, "QoS 2 subscription (MQTT 5)");
    let mut got = Vec::new();
    for _ in 0..3 {
        let g = next_publish(&mut v4, false).await;
        got.push((g.text(), g.qos));
    }
    assert_eq!(got, [("q0".to_string(), 0), ("q1".to_string(), 1), ("q2".to_string(), 1)], "QoS 1 (3.1.1)");
    gw.stop().await;
}

/// Item 1, edgeway's own messages: a response stream still arrives at the
/// QoS the device subscribed with (the topic contract), now that the
/// router delivers at the lower of publish and subscription QoS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_arrive_at_the_subscriptions_qos() {
    let (_fake, gw, addr) = start(Knobs::default(), "coalesce_ms = 0").await;
    let (mut d, _) = raw::session(addr, true, D1.0, D1).await;
    let (mut v4, _) = raw::session(addr, false, &format!("{}:v4", D1.0), D1).await;
    let res = format!("ai/v1/{}/res/#", D1.0);
    assert_eq!(ask(&mut d, &subscribe_opts(1, &res, 1), 0x90).await, 1);
    assert_eq!(ask(&mut v4, &subscribe_v4(1, &res, 2), 0x90).await, 2);
    let req = request("q1").to_string();
    publish(&mut d, &format!("ai/v1/{}/req", D1.0), &req, 0, false, 0).await;
    for (s, v5, qos) in [(&mut d, true, 1), (&mut v4, false, 2)] {
        for _ in 0..3 {
            let g = next_publish(s, v5).await;
            assert_eq!(g.qos, qos, "{}: {}", g.topic, g.text());
        }
    }
    gw.stop().await;
}

/// Item 1, the bookkeeping: QoS 0 messages to a QoS 2 subscriber that
/// acknowledges nothing are never held back for acknowledgements. Before,
/// each took a place in the outgoing window of 100 and the 101st waited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qos0_messages_on_a_qos2_subscription_wait_for_no_acknowledgement() {
    let (_fake, gw, addr) = start(Knobs::default(), "").await;
    let mut sub = instance(addr, true, D1, "sub").await;
    assert_eq!(ask(&mut sub, &subscribe_opts(1, "f/#", 2), 0x90).await, 2);
    let mut publisher = instance(addr, true, D1, "pub").await;
    for i in 0..150 {
        publish(&mut publisher, "f/x", &format!("m{i}"), 0, false, 0).await;
    }
    for i in 0..150 {
        let g = next_publish(&mut sub, true).await;
        assert_eq!((g.text(), g.qos, g.pkid), (format!("m{i}"), 0, None));
    }
    gw.stop().await;
}

/// Reads the next `n` publishes from whichever of `a` and `b` has one;
/// returns (payload, which) in arrival order.
async fn from_either(a: &mut TcpStream, b: &mut TcpStream, n: usize) -> Vec<(String, char)> {
    let mut out = Vec::new();
    while out.len() < n {
        let (p, who) = tokio::select! {
            p = raw::packet(a) => (p, 'a'),
            p = raw::packet(b) => (p, 'b'),
        };
        let p = p.unwrap_or_else(|| panic!("{n} messages between the two within 5 s, got {out:?}"));
        if p[0] & 0xF0 == 0x30 {
            out.push((parse(true, &p).text(), who));
        }
    }
    out
}

/// Item 5: `$share/{group}/{filter}` is a shared subscription among the
/// instances of one device (each message to one of them), kept apart per
/// filter and per device. Before, edgeway mounted it as a plain
/// subscription (both instances got every message), and rumqttd keyed
/// groups by name alone (one rotation and one read position for `g` over
/// every filter and device).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_subscriptions_split_messages_among_one_devices_instances() {
    let (_fake, gw, addr) = start(Knobs::default(), "").await;
    let mut a = instance(addr, true, D1, "a").await;
    let mut b = instance(addr, true, D1, "b").await;
    let mut other = instance(addr, true, D2, "x").await;
    let mut p1 = instance(addr, true, D1, "pub").await;
    let mut p2 = instance(addr, true, D2, "pub").await;
    assert_eq!(ask(&mut a, &subscribe_opts(1, "$share/g/t/s", 0), 0x90).await, 0);
    assert_eq!(ask(&mut b, &subscribe_opts(1, "$share/g/t/s", 0), 0x90).await, 0);
    assert_eq!(ask(&mut other, &subscribe_opts(1, "$share/g/t/s", 0), 0x90).await, 0);

    // Two rounds: a copy left over from round 1 would come before round
    // 2's messages (one log, in order).
    for round in 0..2 {
        let sent: Vec<String> = (0..10).map(|i| format!("r{round}-{i}")).collect();
        for m in &sent {
            publish(&mut p1, "t/s", m, 0, false, 0).await;
        }
        let got = from_either(&mut a, &mut b, 10).await;
        let payloads: HashSet<&str> = got.iter().map(|(m, _)| m.as_str()).collect();
        assert_eq!(payloads, sent.iter().map(String::as_str).collect(), "each message once: {got:?}");
        assert!(got.iter().any(|g| g.1 == 'a') && got.iter().any(|g| g.1 == 'b'), "both get some: {got:?}");
    }

    // The other device's group of the same name shares nothing with it.
    publish(&mut p2, "t/s", "device 2", 0, false, 0).await;
    assert_eq!(next_publish(&mut other, true).await.text(), "device 2", "nothing of device 1 first");

    // Unsubscribing leaves the group to the other instance.
    let mut unsub = 1u16.to_be_bytes().to_vec();
    unsub.push(0);
    unsub.extend_from_slice(&(12u16).to_be_bytes());
    unsub.extend_from_slice(b"$share/g/t/s");
    assert_eq!(ask(&mut a, &frame(0xA2, &unsub), 0xB0).await, 0, "UNSUBACK success");
    for i in 0..6 {
        publish(&mut p1, "t/s", &format!("after-{i}"), 0, false, 0).await;
    }
    for i in 0..6 {
        assert_eq!(next_publish(&mut b, true).await.text(), format!("after-{i}"));
    }
    // Device 2 got none of it: its next message is its own.
    publish(&mut p2, "t/s", "device 2 again", 0, false, 0).await;
    assert_eq!(next_publish(&mut other, true).await.text(), "device 2 again");
    gw.stop().await;
}

/// Item 5, in rumqttd: one group name on two filters is two groups.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_group_name_on_two_filters_is_two_groups() {
    let (_fake, gw, addr) = start(Knobs::default(), "").await;
    let mut a = instance(addr, true, D1, "a").await;
    let mut b = instance(addr, true, D1, "b").await;
    let mut publisher = instance(addr, true, D1, "pub").await;
    assert_eq!(ask(&mut a, &subscribe_opts(1, "$share/g/t/one", 0), 0x90).await, 0);
    assert_eq!(ask(&mut b, &subscribe_opts(1, "$share/g/t/two", 0), 0x90).await, 0);
    for i in 0..5 {
        publish(&mut publisher, "t/one", &format!("one-{i}"), 0, false, 0).await;
        publish(&mut publisher, "t/two", &format!("two-{i}"), 0, false, 0).await;
    }
    for i in 0..5 {
        assert_eq!(next_publish(&mut a, true).await.text(), format!("one-{i}"));
        assert_eq!(next_publish(&mut b, true).await.text(), format!("two-{i}"));
    }
    gw.stop().await;
}

/// Item 4, No Local: a subscription with No Local never gets what its own
/// client id published. Before, it did (the option was parsed and never
/// read). Instances of one device are different clients.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_local_subscriptions_never_get_their_own_publishes() {
    let (_fake, gw, addr) = start(Knobs::default(), "").await;
    let mut a = instance(addr, true, D1, "a").await;
    let mut b = instance(addr, true, D1, "b").await;
    assert_eq!(ask(&mut a, &subscribe_opts(1, "n/#", 0x04), 0x90).await, 0);
    assert_eq!(ask(&mut b, &subscribe_opts(1, "n/#", 0x04), 0x90).await, 0);
    publish(&mut a, "n/x", "from a", 0, false, 0).await;
    publish(&mut b, "n/x", "from b", 0, false, 0).await;
    // Log order is "from a", "from b": each one's first is the other's.
    assert_eq!(next_publish(&mut a, true).await.text(), "from b");
    assert_eq!(next_publish(&mut b, true).await.text(), "from a");
    gw.stop().await;
}

/// Item 4, Retain As Published: with it the RETAIN flag of a forwarded
/// message is the publisher's; without it 0 (MQTT-3.3.1-13). Messages
/// sent for a new subscription have RETAIN 1, on 3.1.1 too. Before, the
/// flag was always cleared on forwarding.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retain_as_published_keeps_the_publishers_flag() {
    let (_fake, gw, addr) = start(Knobs::default(), "").await;
    let mut a = instance(addr, true, D1, "a").await;
    let mut publisher = instance(addr, true, D1, "pub").await;
    assert_eq!(ask(&mut a, &subscribe_opts(1, "rap/1", 0x08), 0x90).await, 0);
    assert_eq!(ask(&mut a, &subscribe_opts(2, "rap/0", 0), 0x90).await, 0);
    publish(&mut publisher, "rap/1", "k1", 0, true, 0).await;
    publish(&mut publisher, "rap/0", "k0", 0, true, 0).await;
    publish(&mut publisher, "rap/1", "p1", 0, false, 0).await;
    let mut got = Vec::new();
    for _ in 0..3 {
        let g = next_publish(&mut a, true).await;
        got.push((g.text(), g.retain));
    }
    got.sort();
    let want = [("k0".to_string(), false), ("k1".to_string(), true), ("p1".to_string(), false)];
    assert_eq!(got, want);

    // MQTT 3.1.1: retained messages for a new subscription have RETAIN 1,
    // forwarded ones 0, as before.
    let mut v4 = instance(addr, false, D1, "v4").await;
    assert_eq!(ask(&mut v4, &subscribe_v4(1, "rap/1", 0), 0x90).await, 0);
    let g = next_publish(&mut v4, false).await;
    assert_eq!((g.text(), g.retain), ("k1".to_string(), true));
    publish(&mut publisher, "rap/1", "k2", 0, true, 0).await;
    let g = next_publish(&mut v4, false).await;
    assert_eq!((g.text(), g.retain), ("k2".to_string(), false));
    gw.stop().await;
}

/// Item 4, Retain Handling: 0 sends the retained messages at every
/// SUBSCRIBE (a repeated one too), 1 only for a new subscription, 2 never.
/// Before, they were sent for every new subscription and never again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retain_handling_decides_when_retained_messages_are_sent() {
    let (_fake, gw, addr) = start(Knobs::default(), "").await;
    let mut publisher = instance(addr, true, D1, "pub").await;
    publish(&mut publisher, "rh/x", "kept", 0, true, 0).await;
    let mut never = instance(addr, true, D1, "never").await;
    let mut if_new = instance(addr, true, D1, "new").await;
    let mut always = instance(addr, true, D1, "always").await;
    assert_eq!(ask(&mut never, &subscribe_opts(1, "rh/x", 0x20), 0x90).await, 0);
    assert_eq!(ask(&mut if_new, &subscribe_opts(1, "rh/x", 0x10), 0x90).await, 0);
    assert_eq!(ask(&mut always, &subscribe_opts(1, "rh/x", 0), 0x90).await, 0);
    for s in [&mut if_new, &mut always] {
        let g = next_publish(s, true).await;
        assert_eq!((g.text(), g.retain), ("kept".to_string(), true));
    }
    assert_eq!(ask(&mut if_new, &subscribe_opts(2, "rh/x", 0x10), 0x90).await, 0);
    assert_eq!(ask(&mut always, &subscribe_opts(2, "rh/x", 0), 0x90).await, 0);
    let g = next_publish(&mut always, true).await;
    assert_eq!((g.text(), g.retain), ("kept".to_string(), true), "again on a repeated SUBSCRIBE");
    publish(&mut publisher, "rh/x", "live", 0, false, 0).await;
    for s in [&mut never, &mut if_new, &mut always] {
        let g = next_publish(s, true).await;
        assert_eq!((g.text(), g.retain), ("live".to_string(), false));
    }
    gw.stop().await;
}

/// Item 5, a session that outlives its connection: a client whose shared
/// subscription had an unacknowledged message when it went away used to
/// panic the router (the group was dropped with its last member, then
/// looked up with `expect`): every connection was lost. Now the session
/// resumes in its group.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_session_with_an_unacknowledged_shared_message_resumes() {
    let (_fake, gw, addr) = start(Knobs::default(), "").await;
    let id = format!("{}:keep", D1.0);
    let keep = || raw::without_clean_start(raw::connect(&id, Some(D1)));
    let (mut s, ack) = raw::connack(addr, &keep()).await.expect("a CONNACK");
    assert_eq!(ack, raw::ACCEPTED);
    assert_eq!(ask(&mut s, &subscribe_v4(1, "$share/g/t/p", 1), 0x90).await, 1);
    let mut publisher = instance(addr, true, D1, "pub").await;
    publish(&mut publisher, "t/p", "unacknowledged", 1, false, 1).await;
    let g = next_publish(&mut s, false).await;
    assert_eq!((g.text(), g.qos), ("unacknowledged".to_string(), 1));
    drop(s);
    // The same client id again: its old connection is gone or taken over.
    let (mut s, ack) = raw::connack(addr, &keep()).await.expect("a CONNACK: the router is alive");
    assert_eq!(ack, [0x20, 2, 1, 0], "session present");
    publish(&mut publisher, "t/p", "after", 1, false, 2).await;
    loop {
        let g = next_publish(&mut s, false).await;
        if g.text() == "after" {
            break;
        }
        assert_eq!(g.text(), "unacknowledged", "only the resent one before");
    }
    gw.stop().await;
}

/// Item 5: after UNSUBSCRIBE of a shared subscription nothing more of it
/// arrives, even from a group left empty. Before, the request stayed
/// parked in the filter's log (looked up by `$share/…`, a filter with no
/// log), woke with the next message and, its group gone, forwarded it as
/// a plain subscription.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unsubscribed_shared_subscription_gets_nothing_more() {
    let (_fake, gw, addr) = start(Knobs::default(), "").await;
    let mut a = instance(addr, true, D1, "a").await;
    let mut publisher = instance(addr, true, D1, "pub").await;
    assert_eq!(ask(&mut a, &subscribe_opts(1, "$share/g/t/alone", 0), 0x90).await, 0);
    assert_eq!(ask(&mut a, &subscribe_opts(2, "t/marker", 0), 0x90).await, 0);
    publish(&mut publisher, "t/alone", "before", 0, false, 0).await;
    assert_eq!(next_publish(&mut a, true).await.text(), "before");
    let mut unsub = 3u16.to_be_bytes().to_vec();
    unsub.push(0);
    unsub.extend_from_slice(&(16u16).to_be_bytes());
    unsub.extend_from_slice(b"$share/g/t/alone");
    assert_eq!(ask(&mut a, &frame(0xA2, &unsub), 0xB0).await, 0, "UNSUBACK success");
    publish(&mut publisher, "t/alone", "after", 0, false, 0).await;
    publish(&mut publisher, "t/marker", "marker", 0, false, 0).await;
    assert_eq!(next_publish(&mut a, true).await.text(), "marker");
    gw.stop().await;
}

/// Item 4, No Local with more of the client's own messages in the log than
/// one read takes: a read that left out everything is not "caught up".
/// Before, the subscription stopped there (parked until some later
/// message) and the other client's message after them never arrived. The
/// read is made one window at a time by holding 100 QoS 1 messages
/// unacknowledged first (Receive Maximum 100).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_local_skips_many_own_messages_and_still_delivers_the_next() {
    let (_fake, gw, addr) = start(Knobs::default(), "").await;
    let id = format!("{}:nl", D1.0);
    let mut body = vec![0, 4, b'M', b'Q', b'T', b'T', 5, 0xC2, 0, 60, 3, 0x21, 0, 100];
    for s in [id.as_bytes(), D1.0.as_bytes(), D1.1.as_bytes()] {
        body.extend_from_slice(&(s.len() as u16).to_be_bytes());
        body.extend_from_slice(s);
    }
    let mut a = TcpStream::connect(addr).await.unwrap();
    a.write_all(&frame(0x10, &body)).await.unwrap();
    let ack = raw::packet(&mut a).await.expect("a CONNACK");
    assert_eq!((ack[0], ack[3]), (0x20, 0), "accepted");
    let mut b = instance(addr, true, D1, "b").await;
    assert_eq!(ask(&mut a, &subscribe_opts(1, "z/#", 1), 0x90).await, 1);
    assert_eq!(ask(&mut a, &subscribe_opts(2, "n/#", 0x05), 0x90).await, 1);
    assert_eq!(ask(&mut b, &subscribe_opts(1, "n/x", 0), 0x90).await, 0);
    for i in 1..=100u16 {
        publish(&mut b, "z/x", "filler", 1, false, i).await;
    }
    let mut ids = Vec::new();
    for _ in 0..100 {
        ids.push(next_publish(&mut a, true).await.pkid.expect("QoS 1"));
    }
    for i in 0..250 {
        publish(&mut a, "n/x", &format!("own {i}"), 0, false, 0).await;
    }
    publish(&mut a, "n/x", "own last", 0, false, 0).await;
    // b sees them all in the log before it publishes (a gets no PUBACK
    // while its window is full).
    while next_publish(&mut b, true).await.text() != "own last" {}
    publish(&mut b, "n/x", "other", 0, false, 0).await;
    for pkid in ids {
        let [hi, lo] = pkid.to_be_bytes();
        a.write_all(&[0x40, 2, hi, lo]).await.unwrap();
    }
    assert_eq!(next_publish(&mut a, true).await.text(), "other");
    gw.stop().await;
}

/// Wills, which edgeway publishes itself (`src/ingress/mqtt/wills.rs`):
/// delivered at the lower of the will's QoS and the subscription's, live
/// and retained. Before, every will was handed to the router at QoS 2, so
/// a QoS 0 will reached a QoS 1 subscription at QoS 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wills_arrive_at_the_lower_of_will_and_subscription_qos() {
    let (_fake, gw, addr) = start(Knobs::default(), "").await;
    let mut watch = instance(addr, true, D1, "watch").await;
    assert_eq!(ask(&mut watch, &subscribe_opts(1, "w/#", 1), 0x90).await, 1);
    for (qos, retain) in [(0u8, false), (1, false), (2, false), (0, true)] {
        let topic = format!("w/{qos}{}", if retain { "r" } else { "" });
        let connect = raw::connect_with_will(&format!("{}:dead{qos}{retain}", D1.0), D1, &topic, b"gone", retain);
        let mut dead = TcpStream::connect(addr).await.unwrap();
        dead.write_all(&raw::with_will_qos(connect, qos)).await.unwrap();
        assert_eq!(raw::packet(&mut dead).await.map(|a| a[3]), Some(0), "accepted");
        // Gone without DISCONNECT (3.1.1: the will goes at once).
        drop(dead);
        let g = next_publish(&mut watch, true).await;
        assert_eq!((g.topic.as_str(), g.qos, g.text().as_str()), (topic.as_str(), qos.min(1), "gone"), "{g:?}");
        if let Some(pkid) = g.pkid {
            watch.write_all(&raw::puback(pkid)).await.unwrap();
        }
    }
    // The retained QoS 0 will, to a later QoS 1 subscription: QoS 0,
    // retained.
    let mut late = instance(addr, true, D1, "late").await;
    assert_eq!(ask(&mut late, &subscribe_opts(1, "w/#", 1), 0x90).await, 1);
    let g = next_publish(&mut late, true).await;
    assert_eq!((g.topic.as_str(), g.qos, g.retain), ("w/0r", 0, true), "{g:?}");
    gw.stop().await;
}
