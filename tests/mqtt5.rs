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
