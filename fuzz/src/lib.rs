//! The fuzz targets of edgeway's hostile-input paths, as plain functions of
//! the input bytes: the libFuzzer drivers in `fuzz_targets/` call them
//! (coverage-guided, `scripts/fuzz.sh`), and `tests/corpus.rs` replays the
//! kept corpus through them in an ordinary `cargo test`.
//!
//! - [`mqtt_packets`]: the raw bytes of one device connection through
//!   edgeway's [`DeviceProtocol`] (version detection, rumqttd's MQTT 3.1.1
//!   and 5 parsers, CONNECT authentication, topic mounting), with the
//!   router's answers written back through it (unmounting, CONNACK rewrite).
//! - [`device_payload`]: what a device publishes to `req`, `cancel` and
//!   `resume`: the shared request parsing and admission, the MQTT-only
//!   fields and the request-id salvage of a broken payload.
//! - [`request_body`]: an HTTP chat-completions / `/v1/tasks` body through
//!   parsing, admission and the context-window estimate.
//! - [`nats_message`]: a NATS request's headers (credential extraction, API
//!   key and JWT authentication) and payload (chat and cancel).
//!
//! Each function panics only where edgeway would: a panic is a finding.
//! Owns: the fuzz entry points and their fixed setup. Does not own: any
//! rule it exercises (all in the `edgeway` crate), nor the parts that need
//! a running gateway (queues, streams, the store).

use std::path::Path;
use std::sync::{Arc, OnceLock};

use bytes::BytesMut;
use edgeway::admission::auth::Authenticator;
use edgeway::admission::request::{admit, parse_body};
use edgeway::config::Config;
use edgeway::context::{estimate_tokens, fit};
use edgeway::ingress::mqtt::auth::DeviceDirectory;
use edgeway::ingress::mqtt::presence::PresenceReporter;
use edgeway::ingress::mqtt::protocol::{DeviceProtocol, ProtocolShared};
use edgeway::ingress::mqtt::requests::{fuzzing, Change, Sessions};
use edgeway::ingress::mqtt::topics::{mount_topic, unmount, Topics};
use edgeway::ingress::mqtt::wills::{PendingWill, Wills};
use edgeway::task::{Identity, Ingress};
use rumqttd::protocol::{
    ConnAck, ConnectReturnCode, Error, Packet, PingResp, PubAck, PubAckReason, SubAck, SubscribeReasonCode,
};
use serde_json::Value;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

/// The API key of application `demo` in the fuzz config.
pub const DEMO_KEY: &str = "sk-fuzz-demo";
/// The HS256 secret of the fuzz config's `[auth.jwt]`.
pub const JWT_SECRET: &str = "fuzz-secret-0123456789abcdef-0123456789";
/// A device of the fuzz config (the README's demo device) and its password.
pub const DEVICE: &str = "demo-device-1";
pub const DEVICE_PASSWORD: &str = "demo-pass-1";

/// The shipped example config, with a known API key for `demo` and JWTs on.
pub fn config() -> &'static Config {
    static CFG: OnceLock<Config> = OnceLock::new();
    CFG.get_or_init(|| {
        let base = include_str!("../../config/edgeway.toml");
        let key = hex_sha256(DEMO_KEY);
        let text = format!(
            "{base}\n[applications.fuzz]\ntenant = \"demo\"\napi_key_sha256 = [\"{key}\"]\n\
             [auth.jwt]\nhs256_secret_env = \"FUZZ_JWT_SECRET\"\n"
        );
        let env = [("FUZZ_JWT_SECRET".to_string(), JWT_SECRET.to_string())];
        Config::from_toml_str(&text, env, Path::new(".")).unwrap_or_else(|e| panic!("fuzz config: {e}"))
    })
}

fn hex_sha256(s: &str) -> String {
    edgeway::config::hash_api_key(s).iter().map(|b| format!("{b:02x}")).collect()
}

fn authenticator() -> &'static Authenticator {
    static A: OnceLock<Authenticator> = OnceLock::new();
    A.get_or_init(|| Authenticator::new(config()))
}

fn demo_identity() -> Identity {
    authenticator().authenticate(Some(DEMO_KEY)).expect("the fuzz config's demo key")
}

/// A gateway started once from the fuzz config (no listeners that could
/// collide: HTTP on an ephemeral port, no broker, no bus, its store in a
/// directory of its own), on a runtime of its own: the device directory
/// checks JWTs and revocations through it, as in edgeway.
fn gateway() -> Arc<edgeway::gateway::Gateway> {
    static G: OnceLock<Arc<edgeway::gateway::Gateway>> = OnceLock::new();
    G.get_or_init(|| {
        let mut cfg = config().clone();
        cfg.http.listen = "127.0.0.1:0".parse().expect("address");
        cfg.http.admin_listen = None;
        cfg.mqtt = None;
        cfg.nats = None;
        cfg.store.data_dir = std::env::temp_dir().join(format!("edgeway-fuzz-{}", std::process::id()));
        let rt = Box::leak(Box::new(
            tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().expect("runtime"),
        ));
        let running = rt.block_on(edgeway::server::start(cfg)).expect("the fuzz gateway starts");
        let gw = running.gateway.clone();
        // Runs until the process ends.
        std::mem::forget(running);
        gw
    })
    .clone()
}

fn device_identity() -> Identity {
    DeviceDirectory::new(gateway()).authenticate(DEVICE, Some(DEVICE), DEVICE_PASSWORD).expect("the demo device").identity
}

/// What the codecs of all connections share, and the receiving ends of
/// what they report (drained after each input so nothing accumulates there).
struct Mqtt {
    shared: Arc<ProtocolShared>,
    changes: std::sync::Mutex<UnboundedReceiver<Change>>,
    wills: std::sync::Mutex<UnboundedReceiver<PendingWill>>,
}

fn mqtt() -> &'static Mqtt {
    static M: OnceLock<Mqtt> = OnceLock::new();
    M.get_or_init(|| {
        let cfg = config();
        let prefix = cfg.mqtt.as_ref().map(|m| m.topic_prefix.clone()).unwrap_or_else(|| "ai/v1".into());
        let (ctx, crx) = unbounded_channel();
        let (wtx, wrx) = unbounded_channel();
        let presence = PresenceReporter::new(Arc::new(Sessions::new(1 << 20, 64 * 1024)), ctx);
        let shared =
            ProtocolShared::new(DeviceDirectory::new(gateway()), Topics::new(&prefix), presence, Arc::new(Wills::new(wtx)))
                .with_config(cfg.mqtt.as_ref().expect("[mqtt] in the fuzz config"));
        Mqtt { shared: Arc::new(shared), changes: crx.into(), wills: wrx.into() }
    })
}

/// The bytes one device sends on one connection. The first byte picks the
/// packet size limit (small limits reach the "too large" paths); the rest
/// is the stream. Every packet the codec lets through gets the answer the
/// router would give, written back through the codec, and a PUBLISH is
/// also delivered back to the device (as its own subscription would).
pub fn mqtt_packets(data: &[u8]) {
    let Some((&limit, stream)) = data.split_first() else { return };
    let max_size = match limit % 4 {
        0 => 1024 * 1024,
        1 => 64 * 1024,
        2 => 256,
        _ => 16,
    };
    let m = mqtt();
    let mut codec = DeviceProtocol::new(m.shared.clone());
    let mut stream = BytesMut::from(stream);
    let mut out = BytesMut::new();
    // A bound on packets per input (a stream of empty PINGREQs is 2 bytes
    // each); rumqttd reads at most this many per batch too.
    for _ in 0..200 {
        let packet = match rumqttd::protocol::Protocol::read_mut(&mut codec, &mut stream, max_size) {
            Ok(p) => p,
            Err(Error::InsufficientBytes(_)) => break,
            Err(_) => break,
        };
        let answers = match packet {
            Packet::Connect(..) => {
                vec![Packet::ConnAck(ConnAck { session_present: false, code: ConnectReturnCode::Success }, None)]
            }
            Packet::Publish(publish, props) => {
                let topic = String::from_utf8_lossy(&publish.topic).into_owned();
                // Mounting is reversible: what the device published under
                // its subtree comes back to it under the same name.
                if let Some(rest) = topic.strip_prefix("d/") {
                    if let Some((device, _)) = rest.split_once('/') {
                        let original = unmount(device, &topic).expect("a mounted topic unmounts");
                        assert_eq!(mount_topic(device, original), topic, "mounting round trip");
                    }
                }
                // (rumqttd keeps the packet id private: any id will do
                // for the codec.)
                vec![
                    Packet::PubAck(PubAck { pkid: 1, reason: PubAckReason::Success }, None),
                    Packet::Publish(publish, props),
                ]
            }
            Packet::Subscribe(sub, _) => {
                let codes = sub.filters.iter().map(|f| SubscribeReasonCode::Success(f.qos)).collect();
                vec![Packet::SubAck(SubAck { pkid: sub.pkid, return_codes: codes }, None)]
            }
            Packet::PingReq(_) => vec![Packet::PingResp(PingResp)],
            _ => Vec::new(),
        };
        for a in answers {
            let _ = rumqttd::protocol::Protocol::write(&codec, a, &mut out);
        }
        out.clear();
    }
    drop(codec);
    while m.changes.lock().unwrap().try_recv().is_ok() {}
    while m.wills.lock().unwrap().try_recv().is_ok() {}
}

/// A device payload: the first byte picks the topic (`req`, `cancel`,
/// `resume`), the rest is the payload.
pub fn device_payload(data: &[u8]) {
    let Some((&kind, payload)) = data.split_first() else { return };
    let cfg = config();
    let mqtt_cfg = cfg.mqtt.as_ref().expect("the example config enables MQTT");
    // The salvage runs on every refused payload, whatever the topic.
    let _ = fuzzing::salvage_request_id(payload);
    match kind % 3 {
        0 => {
            let Ok(body) = parse_body(payload) else { return };
            let _ = fuzzing::mqtt_fields(&body.extra, mqtt_cfg);
            if let Some(rid) = &body.request_id {
                let _ = fuzzing::device_key(DEVICE, rid);
            }
            admit_and_fit(cfg, device_identity(), body, Ingress::Mqtt);
        }
        1 => {
            // `cancel`: {"request_id": "…"}
            let _ = serde_json::from_slice::<Value>(payload)
                .ok()
                .and_then(|v| v.get("request_id").and_then(Value::as_str).map(str::to_string));
        }
        _ => {
            // `resume`: {"request_id": "…", "from_seq": n}
            let v: Value = serde_json::from_slice(payload).unwrap_or(Value::Null);
            let _ = v.get("request_id").and_then(Value::as_str);
            let _ = v.get("from_seq").and_then(Value::as_u64);
        }
    }
}

fn admit_and_fit(
    cfg: &Config,
    identity: Identity,
    body: edgeway::admission::request::ChatRequestBody,
    ingress: Ingress,
) {
    let model = cfg.models.get(&body.model).cloned();
    let input = estimate_tokens(&body.messages);
    if let Ok(req) = admit(cfg, identity, body, ingress, None) {
        if let Some(m) = model {
            let _ = fit(input, req.max_output_tokens, m.context_tokens);
        }
        // What the store and the lifecycle events record of it.
        let _ = serde_json::to_string(&req.metadata);
    }
}

/// An HTTP chat-completions or `/v1/tasks` body (both go through the same
/// parser and admission), from the `demo` application.
pub fn request_body(data: &[u8]) {
    let cfg = config();
    let Ok(body) = parse_body(data) else { return };
    admit_and_fit(cfg, demo_identity(), body, Ingress::Http);
}

/// A NATS request: `header lines` NUL `payload`. Header lines are
/// `Name: value`; the first byte of the payload picks chat or cancel.
pub fn nats_message(data: &[u8]) {
    let (head, payload) = match data.iter().position(|&b| b == 0) {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (&data[..0], data),
    };
    let mut headers = async_nats::HeaderMap::new();
    for line in String::from_utf8_lossy(head).lines() {
        let Some((name, value)) = line.split_once(':') else { continue };
        // Names and values the NATS client itself would refuse are not
        // delivered to edgeway.
        let Ok(name) = name.trim().parse::<async_nats::HeaderName>() else { continue };
        let Ok(value) = value.trim().parse::<async_nats::HeaderValue>() else { continue };
        headers.append(name, value);
    }
    let credential = edgeway::ingress::nats::service::credential(Some(&headers));
    let Ok(identity) = authenticator().authenticate(credential.as_deref()) else { return };
    let Some((&kind, payload)) = payload.split_first() else { return };
    if kind % 2 == 0 {
        let Ok(body) = parse_body(payload) else { return };
        admit_and_fit(config(), identity, body, Ingress::Nats);
    } else {
        // `ai.v1.cancel`: {"request_id": "…"}
        let _ = serde_json::from_slice::<Value>(payload).ok().and_then(|v| v.get("request_id").cloned());
    }
}
