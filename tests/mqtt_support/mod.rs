//! Helpers for the MQTT tests: a gateway with the broker on a free port, a
//! fake engine, devices as real rumqttc clients (MQTT 3.1.1 and 5) on real
//! sockets, and validation of every message edgeway sends against the JSON
//! Schemas in `topics/schemas`.
#![allow(dead_code)]

pub mod raw;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::OnceLock;
use std::time::Duration;

use bytes::Bytes;
use serde_json::{json, Value};
use tokio::sync::mpsc;

pub use edgeway::testing::{FakeEngine, Knobs, TestGateway};

pub const D1: (&str, &str) = ("demo-device-1", "demo-pass-1");
pub const D2: (&str, &str) = ("demo-device-2", "demo-pass-2");

/// `[mqtt]` and the demo devices, as extra TOML for [`TestGateway`].
pub fn mqtt_toml(mqtt_extra: &str) -> String {
    let hash = |p: &str| hex::encode(edgeway::config::hash_api_key(p));
    format!(
        r#"
[mqtt]
listen = "127.0.0.1:0"
{mqtt_extra}
[devices.demo-device-1]
tenant = "demo"
application = "demo"
password_sha256 = "{}"
[devices.demo-device-2]
tenant = "demo"
application = "demo"
password_sha256 = "{}"
"#,
        hash(D1.1),
        hash(D2.1)
    )
}

pub async fn start(knobs: Knobs, mqtt_extra: &str) -> (FakeEngine, TestGateway, SocketAddr) {
    let fake = FakeEngine::start_with(knobs).await;
    let gw = TestGateway::with_engine(&fake.url(), "openai", &mqtt_toml(mqtt_extra)).await;
    gw.wait_ready().await;
    let addr = gw.running.as_ref().unwrap().mqtt.expect("mqtt is configured").mqtt;
    (fake, gw, addr)
}

/// A message a device received.
#[derive(Debug, Clone)]
pub struct Msg {
    pub topic: String,
    pub payload: Bytes,
    pub correlation: Option<Bytes>,
    /// The MQTT 5 topic alias it came with, and whether its topic was
    /// left out (resolved from the alias here: rumqttc hands out the
    /// packet as it came).
    pub alias: Option<(u16, bool)>,
}

impl Msg {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.payload).unwrap_or_else(|e| panic!("not JSON on {}: {e}", self.topic))
    }
}

#[derive(Debug)]
pub enum Ev {
    Msg(Msg),
    SubAck,
    PubAck,
    Closed(String),
}

enum Client {
    V4(rumqttc::AsyncClient),
    V5(rumqttc::v5::AsyncClient),
}

/// A device: a real MQTT client whose event loop runs in a task.
pub struct Device {
    pub id: String,
    client: Client,
    rx: mpsc::UnboundedReceiver<Ev>,
    task: tokio::task::JoinHandle<()>,
    /// Messages taken out of order while waiting for something else.
    pending: Vec<Ev>,
}

impl Drop for Device {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// MQTT protocol version of a test client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum V {
    V4,
    V5,
}

/// Connects; `Err` holds the refusal (the CONNACK code or the error).
pub async fn connect(addr: SocketAddr, v: V, id: &str, user: &str, pass: &str) -> Result<Device, String> {
    connect_with_will(addr, v, id, user, pass, None).await
}

/// An MQTT 5 demo device that allows `max` topic aliases from the server
/// (Topic Alias Maximum in its CONNECT).
pub async fn device_with_aliases(addr: SocketAddr, creds: (&str, &str), max: u16) -> Device {
    connect_opts(addr, V::V5, creds.0, creds.0, creds.1, None, Some(max)).await.expect("demo device connects")
}

/// [`connect`] with a will: `(topic, payload)`, QoS 1, not retained.
pub async fn connect_with_will(
    addr: SocketAddr,
    v: V,
    id: &str,
    user: &str,
    pass: &str,
    will: Option<(&str, &str)>,
) -> Result<Device, String> {
    connect_opts(addr, v, id, user, pass, will, None).await
}

async fn connect_opts(
    addr: SocketAddr,
    v: V,
    id: &str,
    user: &str,
    pass: &str,
    will: Option<(&str, &str)>,
    topic_alias_max: Option<u16>,
) -> Result<Device, String> {
    let (tx, rx) = mpsc::unbounded_channel();
    let (ok_tx, ok_rx) = tokio::sync::oneshot::channel::<Result<(), String>>();
    let host = addr.ip().to_string();
    let (client, task) = match v {
        V::V4 => {
            let mut o = rumqttc::MqttOptions::new(id, host, addr.port());
            o.set_credentials(user, pass).set_keep_alive(Duration::from_secs(30)).set_max_packet_size(1 << 21, 1 << 21);
            if let Some((t, p)) = will {
                o.set_last_will(rumqttc::LastWill::new(t, p, rumqttc::QoS::AtLeastOnce, false));
            }
            let (c, mut el) = rumqttc::AsyncClient::new(o, 64);
            let task = tokio::spawn(async move {
                let mut ok = Some(ok_tx);
                loop {
                    match el.poll().await {
                        Ok(rumqttc::Event::Incoming(p)) => match p {
                            rumqttc::Packet::ConnAck(_) => {
                                if let Some(o) = ok.take() {
                                    let _ = o.send(Ok(()));
                                }
                            }
                            rumqttc::Packet::Publish(p) => {
                                let m = Msg { topic: p.topic, payload: p.payload, correlation: None, alias: None };
                                let _ = tx.send(Ev::Msg(m));
                            }
                            rumqttc::Packet::SubAck(_) => {
                                let _ = tx.send(Ev::SubAck);
                            }
                            rumqttc::Packet::PubAck(_) => {
                                let _ = tx.send(Ev::PubAck);
                            }
                            _ => {}
                        },
                        Ok(_) => {}
                        Err(e) => {
                            let msg = match &e {
                                rumqttc::ConnectionError::ConnectionRefused(code) => format!("refused: {code:?}"),
                                e => e.to_string(),
                            };
                            if let Some(o) = ok.take() {
                                let _ = o.send(Err(msg.clone()));
                            }
                            let _ = tx.send(Ev::Closed(msg));
                            return;
                        }
                    }
                }
            });
            (Client::V4(c), task)
        }
        V::V5 => {
            let mut o = rumqttc::v5::MqttOptions::new(id, host, addr.port());
            o.set_credentials(user, pass).set_keep_alive(Duration::from_secs(30)).set_max_packet_size(Some(1 << 21));
            o.set_topic_alias_max(topic_alias_max);
            if let Some((t, p)) = will {
                let qos = rumqttc::v5::mqttbytes::QoS::AtLeastOnce;
                o.set_last_will(rumqttc::v5::mqttbytes::v5::LastWill::new(t, p, qos, false, None));
            }
            let (c, mut el) = rumqttc::v5::AsyncClient::new(o, 64);
            let task = tokio::spawn(async move {
                use rumqttc::v5::mqttbytes::v5::Packet;
                let mut ok = Some(ok_tx);
                let mut aliases: HashMap<u16, String> = HashMap::new();
                loop {
                    match el.poll().await {
                        Ok(rumqttc::v5::Event::Incoming(p)) => match p {
                            Packet::ConnAck(_) => {
                                if let Some(o) = ok.take() {
                                    let _ = o.send(Ok(()));
                                }
                            }
                            Packet::Publish(p) => {
                                let correlation = p.properties.as_ref().and_then(|p| p.correlation_data.clone());
                                let mut topic = String::from_utf8_lossy(&p.topic).into_owned();
                                let alias = p.properties.as_ref().and_then(|p| p.topic_alias);
                                if let Some(a) = alias {
                                    if topic.is_empty() {
                                        topic = aliases.get(&a).cloned().unwrap_or_default();
                                    } else {
                                        aliases.insert(a, topic.clone());
                                    }
                                }
                                let alias = alias.map(|a| (a, p.topic.is_empty()));
                                let _ = tx.send(Ev::Msg(Msg { topic, payload: p.payload, correlation, alias }));
                            }
                            Packet::SubAck(_) => {
                                let _ = tx.send(Ev::SubAck);
                            }
                            Packet::PubAck(_) => {
                                let _ = tx.send(Ev::PubAck);
                            }
                            _ => {}
                        },
                        Ok(_) => {}
                        Err(e) => {
                            let msg = match &e {
                                rumqttc::v5::ConnectionError::ConnectionRefused(code) => format!("refused: {code:?}"),
                                e => e.to_string(),
                            };
                            if let Some(o) = ok.take() {
                                let _ = o.send(Err(msg.clone()));
                            }
                            let _ = tx.send(Ev::Closed(msg));
                            return;
                        }
                    }
                }
            });
            (Client::V5(c), task)
        }
    };
    let r = tokio::time::timeout(Duration::from_secs(10), ok_rx)
        .await
        .map_err(|_| "no CONNACK".to_string())?
        .map_err(|_| "event loop ended".to_string())?;
    let dev = Device { id: id.to_string(), client, rx, task, pending: Vec::new() };
    r.map(|_| dev)
}

/// Connects a demo device with its own credentials.
pub async fn device(addr: SocketAddr, v: V, creds: (&str, &str)) -> Device {
    connect(addr, v, creds.0, creds.0, creds.1).await.expect("demo device connects")
}

const WAIT: Duration = Duration::from_secs(20);

impl Device {
    pub fn topic(&self, rest: &str) -> String {
        format!("ai/v1/{}/{rest}", self.id)
    }

    /// Subscribes (QoS 1) and waits for the SUBACK.
    pub async fn subscribe(&mut self, filter: &str) {
        self.subscribe_at(filter, true).await
    }

    /// Subscribes at QoS 1 (`at_least_once`) or 0 and waits for the
    /// SUBACK.
    pub async fn subscribe_at(&mut self, filter: &str, at_least_once: bool) {
        use rumqttc::v5::mqttbytes::QoS as Q5;
        use rumqttc::QoS as Q4;
        match (&self.client, at_least_once) {
            (Client::V4(c), true) => c.subscribe(filter, Q4::AtLeastOnce).await.unwrap(),
            (Client::V4(c), false) => c.subscribe(filter, Q4::AtMostOnce).await.unwrap(),
            (Client::V5(c), true) => c.subscribe(filter, Q5::AtLeastOnce).await.unwrap(),
            (Client::V5(c), false) => c.subscribe(filter, Q5::AtMostOnce).await.unwrap(),
        }
        self.wait_for(|e| matches!(e, Ev::SubAck)).await;
    }

    pub async fn publish(&self, topic: &str, payload: impl Into<Vec<u8>>) {
        let payload: Vec<u8> = payload.into();
        match &self.client {
            Client::V4(c) => c.publish(topic, rumqttc::QoS::AtLeastOnce, false, payload).await.unwrap(),
            Client::V5(c) => c.publish(topic, rumqttc::v5::mqttbytes::QoS::AtLeastOnce, false, payload).await.unwrap(),
        }
    }

    /// [`Self::publish`] that may find the connection already closed
    /// (returns whether the client took the message).
    pub async fn try_publish(&self, topic: &str, payload: impl Into<Vec<u8>>) -> bool {
        let payload: Vec<u8> = payload.into();
        match &self.client {
            Client::V4(c) => c.publish(topic, rumqttc::QoS::AtLeastOnce, false, payload).await.is_ok(),
            Client::V5(c) => c.publish(topic, rumqttc::v5::mqttbytes::QoS::AtLeastOnce, false, payload).await.is_ok(),
        }
    }

    /// MQTT 5 only: publish with properties.
    pub async fn publish_v5(
        &self,
        topic: &str,
        payload: impl Into<Vec<u8>>,
        props: rumqttc::v5::mqttbytes::v5::PublishProperties,
    ) {
        let Client::V5(c) = &self.client else { panic!("not an MQTT 5 client") };
        let payload: Vec<u8> = payload.into();
        c.publish_with_properties(topic, rumqttc::v5::mqttbytes::QoS::AtLeastOnce, false, payload, props)
            .await
            .unwrap();
    }

    pub async fn disconnect(&self) {
        match &self.client {
            Client::V4(c) => {
                let _ = c.disconnect().await;
            }
            Client::V5(c) => {
                let _ = c.disconnect().await;
            }
        }
    }

    /// Sends DISCONNECT and waits until the broker has closed the
    /// connection.
    pub async fn disconnect_and_wait(&mut self) {
        self.disconnect().await;
        loop {
            if let Ev::Closed(_) = self.next_ev().await {
                return;
            }
        }
    }

    /// Drops the connection without DISCONNECT (a network failure, as far
    /// as the broker can tell).
    pub fn kill(self) {
        self.task.abort();
    }

    async fn next_ev(&mut self) -> Ev {
        if !self.pending.is_empty() {
            return self.pending.remove(0);
        }
        tokio::time::timeout(WAIT, self.rx.recv())
            .await
            .unwrap_or_else(|_| panic!("{}: nothing arrived within {WAIT:?}", self.id))
            .unwrap_or_else(|| panic!("{}: event loop ended", self.id))
    }

    async fn wait_for(&mut self, want: impl Fn(&Ev) -> bool) -> Ev {
        let mut skipped = Vec::new();
        loop {
            let e = self.next_ev().await;
            if want(&e) {
                skipped.append(&mut self.pending);
                self.pending = skipped;
                return e;
            }
            if let Ev::Closed(why) = &e {
                panic!("{}: connection closed: {why}", self.id);
            }
            if matches!(e, Ev::Msg(_)) {
                skipped.push(e);
            }
        }
    }

    /// The next message (validated against the schemas when it is an
    /// event).
    pub async fn msg(&mut self) -> Msg {
        match self.wait_for(|e| matches!(e, Ev::Msg(_))).await {
            Ev::Msg(m) => {
                validate_message(&m);
                m
            }
            _ => unreachable!(),
        }
    }

    /// Puts a message back, to be the next [`Self::msg`].
    pub fn pending_front(&mut self, m: Msg) {
        self.pending.insert(0, Ev::Msg(m));
    }

    /// Messages until (and with) the first terminal event on `topic`.
    pub async fn stream(&mut self, topic: &str) -> Vec<Value> {
        let mut out = Vec::new();
        loop {
            let m = self.msg().await;
            assert_eq!(m.topic, topic, "message on an unexpected topic: {}", String::from_utf8_lossy(&m.payload));
            let v = m.json();
            let end = matches!(v["type"].as_str(), Some("done" | "error"));
            out.push(v);
            if end {
                return out;
            }
        }
    }

    /// Messages until the connection ends; returns them and why it ended.
    /// Panics if it is still open after the usual wait.
    pub async fn until_closed(&mut self) -> (Vec<Msg>, String) {
        let mut msgs = Vec::new();
        loop {
            match self.next_ev().await {
                Ev::Msg(m) => msgs.push(m),
                Ev::Closed(why) => return (msgs, why),
                _ => {}
            }
        }
    }

    /// Whatever messages have arrived by now, without waiting.
    pub fn drain(&mut self) -> Vec<Msg> {
        let mut out: Vec<Msg> = std::mem::take(&mut self.pending)
            .into_iter()
            .filter_map(|e| if let Ev::Msg(m) = e { Some(m) } else { None })
            .collect();
        while let Ok(e) = self.rx.try_recv() {
            if let Ev::Msg(m) = e {
                out.push(m);
            }
        }
        out
    }
}

/// The shared request JSON.
pub fn request(rid: &str) -> Value {
    serde_json::json!({
        "model": "general-chat",
        "request_id": rid,
        "messages": [{"role": "user", "content": "Say hello"}],
    })
}

/// Asserts the stream's `seq`s are 0..n, that exactly the last message is
/// terminal, and returns the concatenated delta text.
pub fn check_stream(events: &[Value]) -> String {
    for (i, e) in events.iter().enumerate() {
        assert_eq!(e["seq"], i as u64, "seq must be contiguous: {events:#?}");
        let terminal = matches!(e["type"].as_str(), Some("done" | "error"));
        assert_eq!(terminal, i + 1 == events.len(), "exactly one terminal event, last: {events:#?}");
    }
    events.iter().filter(|e| e["type"] == "delta").map(|e| e["text"].as_str().unwrap()).collect()
}

fn schemas() -> &'static HashMap<String, jsonschema::Validator> {
    static S: OnceLock<HashMap<String, jsonschema::Validator>> = OnceLock::new();
    S.get_or_init(|| {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("topics/schemas");
        let mut m = HashMap::new();
        for e in std::fs::read_dir(&dir).expect("topics/schemas") {
            let p = e.unwrap().path();
            let name = p.file_stem().unwrap().to_string_lossy().into_owned();
            let v: Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
            let validator = jsonschema::validator_for(&v).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            m.insert(name, validator);
        }
        m
    })
}

/// The two forms of a device's streams (topics/README.md "Compact
/// streams"), for tests that run on both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Form {
    Json,
    Compact,
}

pub const FORMS: [Form; 2] = [Form::Json, Form::Compact];

impl Form {
    /// [`request`] in this form.
    pub fn request(self, rid: &str) -> Value {
        let mut r = request(rid);
        if self == Form::Compact {
            r["compact"] = true.into();
        }
        r
    }

    /// What a device of this form subscribes to: `res/#` (and `s/#` for
    /// compact streams; refusals stay on `res/{request_id}`).
    pub async fn subscribe(self, d: &mut Device) {
        self.subscribe_at(d, true).await
    }

    /// [`Form::subscribe`] at QoS 1 (`at_least_once`) or 0.
    pub async fn subscribe_at(self, d: &mut Device, at_least_once: bool) {
        d.subscribe_at(&d.topic("res/#"), at_least_once).await;
        if self == Form::Compact {
            d.subscribe_at(&d.topic("s/#"), at_least_once).await;
        }
    }
}

/// A compact stream message (topics/README.md "Compact streams") as the
/// JSON form's object (`seq`, `type`, `text` for a delta, `request_id` and
/// `queue_position` for `accepted`, `finish_reason` and `usage` for
/// `done`), its JSON part validated against `topics/schemas/compact.json`;
/// `prev`: the seq of the stream's previous message, for a message whose
/// seq is not written.
pub fn parse_compact(payload: &[u8], prev: Option<u64>) -> Value {
    let text = std::str::from_utf8(payload).expect("UTF-8");
    let digits = payload.iter().take_while(|b| b.is_ascii_digit()).count();
    let counted = || prev.map(|p| p + 1).unwrap_or_else(|| panic!("a first message without its seq: {text:?}"));
    if digits == 0 {
        let delta = text.strip_prefix(':').unwrap_or(text);
        return json!({"seq": counted(), "type": "delta", "text": delta});
    }
    let seq: u64 = text[..digits].parse().expect("seq");
    let rest = text.get(digits + 1..).unwrap_or("");
    match payload.get(digits) {
        Some(b':') => json!({"seq": seq, "type": "delta", "text": rest}),
        Some(b'+') => {
            let mut parts = rest.split(' ');
            let rid = parts.next().unwrap();
            let position: u64 = parts.next().map_or(0, |p| p.parse().expect("queue position"));
            assert!(parts.next().is_none(), "accepted: {text:?}");
            json!({"seq": seq, "type": "accepted", "request_id": rid, "queue_position": position})
        }
        Some(b'.') => {
            let parts: Vec<&str> = rest.split(' ').collect();
            assert!(parts.len() >= 3, "done: {text:?}");
            let (input, output): (u64, u64) = (parts[1].parse().expect("input"), parts[2].parse().expect("output"));
            let mut v = json!({
                "seq": seq, "type": "done",
                "finish_reason": if parts[0] == "-" { Value::Null } else { parts[0].into() },
                "usage": {"input_tokens": input, "output_tokens": output, "total_tokens": input + output},
            });
            for flag in &parts[3..] {
                match *flag {
                    "estimated" => v["usage"]["estimated"] = true.into(),
                    "text_not_kept" => v["text_not_kept"] = true.into(),
                    other => panic!("done: unknown flag {other:?} in {text:?}"),
                }
            }
            v
        }
        Some(b'{') => {
            let mut v: Value = serde_json::from_str(&text[digits..]).unwrap_or_else(|e| panic!("{e}: {text}"));
            validate("compact", &v);
            v["seq"] = seq.into();
            v
        }
        _ => panic!("not a compact message: {text:?}"),
    }
}

/// The seq of the previous message of each compact stream topic a device
/// has read, to count the seqs that are not written.
#[derive(Default)]
pub struct CompactSeqs(HashMap<String, u64>);

impl CompactSeqs {
    pub fn parse(&mut self, topic: &str, payload: &[u8]) -> Value {
        let v = parse_compact(payload, self.0.get(topic).copied());
        self.0.insert(topic.to_string(), v["seq"].as_u64().unwrap());
        v
    }
}

/// Reads one request's stream in either form, each message as the JSON
/// form's object. A compact stream's topic is learnt from its `accepted`
/// (or given, after a reconnect).
pub struct StreamReader {
    pub form: Form,
    pub rid: String,
    /// The compact stream's topic, once known.
    pub topic: Option<String>,
    /// The seq of the compact stream's previous message.
    prev: Option<u64>,
}

impl StreamReader {
    pub fn new(form: Form, rid: &str) -> StreamReader {
        StreamReader { form, rid: rid.to_string(), topic: None, prev: None }
    }

    /// The next message of the stream (a refusal on `res/{request_id}`
    /// included).
    pub async fn next(&mut self, d: &mut Device) -> Value {
        let m = d.msg().await;
        let res = d.topic(&format!("res/{}", self.rid));
        if m.topic == res {
            return m.json();
        }
        assert_eq!(self.form, Form::Compact, "message on an unexpected topic {}: {:?}", m.topic, m.payload);
        assert!(m.topic.starts_with(&d.topic("s/")), "message on an unexpected topic {}: {:?}", m.topic, m.payload);
        let v = parse_compact(&m.payload, self.prev);
        self.prev = v["seq"].as_u64();
        match &self.topic {
            Some(t) => assert_eq!(&m.topic, t, "another stream's message: {v}"),
            None => {
                assert_eq!((&v["type"], &v["request_id"]), (&"accepted".into(), &self.rid.as_str().into()), "{v}");
                self.topic = Some(m.topic.clone());
            }
        }
        v
    }

    /// Messages until (and with) the first terminal one.
    pub async fn until_end(&mut self, d: &mut Device) -> Vec<Value> {
        let mut out = Vec::new();
        loop {
            let v = self.next(d).await;
            let end = matches!(v["type"].as_str(), Some("done" | "error"));
            out.push(v);
            if end {
                return out;
            }
        }
    }
}

/// Validates `v` against `topics/schemas/{name}.json`.
pub fn validate(name: &str, v: &Value) {
    let s = schemas().get(name).unwrap_or_else(|| panic!("no schema {name}"));
    let errors: Vec<String> = s.iter_errors(v).map(|e| format!("{} at {}", e, e.instance_path())).collect();
    assert!(errors.is_empty(), "{name} schema violated by {v}:\n{}", errors.join("\n"));
}

/// Every message edgeway sends to a device is checked against its schema.
pub fn validate_message(m: &Msg) {
    let Ok(v) = serde_json::from_slice::<Value>(&m.payload) else { return };
    if m.topic.ends_with("/shared/models") {
        return validate("models", &v);
    }
    if let Some(t) = v["type"].as_str() {
        if ["accepted", "queued", "delta", "tool_call", "done", "error"].contains(&t) {
            validate(&format!("event-{t}"), &v);
        }
    }
}

/// The `edgeway_mqtt_devices_connected` gauge.
pub fn devices_connected(gw: &TestGateway) -> Option<i64> {
    let text = gw.metrics().render();
    text.lines().find_map(|l| l.strip_prefix("edgeway_mqtt_devices_connected ")).and_then(|v| v.trim().parse().ok())
}

/// Waits (up to 10 s) until the ingress counts `n` devices connected.
/// No event tells a test that a connect or disconnect was handled; the
/// gauge is set right after it was, so this polls the gauge.
pub async fn until_devices_connected(gw: &TestGateway, n: i64) -> bool {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while devices_connected(gw) != Some(n) {
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    true
}

/// The recorded end of a task: its terminal lifecycle event, read from a
/// subscription taken before the task started.
pub async fn recorded_end(
    rx: &mut tokio::sync::broadcast::Receiver<std::sync::Arc<edgeway::telemetry::lifecycle::LifecycleEvent>>,
    task_id: &str,
) -> std::sync::Arc<edgeway::telemetry::lifecycle::LifecycleEvent> {
    tokio::time::timeout(WAIT, async {
        loop {
            let e = rx.recv().await.expect("lifecycle events");
            if e.task_id == task_id && e.state.is_terminal() {
                return e;
            }
        }
    })
    .await
    .expect("the task's end was recorded in time")
}

/// The value of one sample of the gateway's metrics, by its name and labels
/// as rendered (`mqtt_sockets_open{listener="mqtt"}`, without the
/// `edgeway_` prefix).
pub fn metric(gw: &TestGateway, sample: &str) -> Option<f64> {
    let text = gw.metrics().render();
    let prefix = format!("edgeway_{sample} ");
    text.lines().find_map(|l| l.strip_prefix(prefix.as_str())).and_then(|v| v.trim().parse().ok())
}
