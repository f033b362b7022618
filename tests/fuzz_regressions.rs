//! Regression tests for what the fuzz targets (`fuzz/`, `scripts/fuzz.sh`)
//! found: one test per finding, named after it, with the input that found
//! it (kept in `fuzz/crashes/<target>/`).

mod mqtt_support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use edgeway::ingress::mqtt::auth::DeviceDirectory;
use edgeway::ingress::mqtt::presence::PresenceReporter;
use edgeway::ingress::mqtt::protocol::{DeviceProtocol, ProtocolShared};
use edgeway::ingress::mqtt::requests::Sessions;
use edgeway::ingress::mqtt::topics::Topics;
use edgeway::ingress::mqtt::wills::Wills;
use mqtt_support::*;
use rumqttd::protocol::Protocol;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// An MQTT 5 CONNECT of demo-device-1 (no properties).
fn connect_v5() -> Vec<u8> {
    let mut body = vec![0, 4, b'M', b'Q', b'T', b'T', 5, 0xC2, 0, 60, 0];
    for s in [D1.0, D1.0, D1.1] {
        body.extend_from_slice(&(s.len() as u16).to_be_bytes());
        body.extend_from_slice(s.as_bytes());
    }
    let mut p = vec![0x10, body.len() as u8];
    p.extend_from_slice(&body);
    p
}

/// Packets only a server sends, which rumqttd's MQTT 5 parser has no arm
/// for: CONNACK (session present 0, success, no properties) and UNSUBACK
/// (packet id 1, no properties, one reason code).
const SERVER_ONLY_V5: [&[u8]; 2] = [&[0x20, 3, 0, 0, 0], &[0xB0, 4, 0, 1, 0, 0]];

/// Found by `mqtt_packets` (fuzz/crashes/mqtt_packets/rumqttd_0.20.0_src_protocol_v5_mod.rs_429_18):
/// after an accepted MQTT 5 CONNECT, a CONNACK or UNSUBACK from the device
/// reaches `unreachable!()` in rumqttd's v5 `read_mut`
/// (protocol/v5/mod.rs:429), a panic in the connection's codec. It must be
/// a protocol error that closes the connection.
#[tokio::test(flavor = "multi_thread")]
async fn the_codec_refuses_server_only_packets_from_an_mqtt5_device_without_panicking() {
    let dir = edgeway::testing::TempDir::new("fuzz-regression");
    let cfg = edgeway::config::Config::from_toml_str(
        &edgeway::testing::config_toml("http://127.0.0.1:9", "openai", &dir.0, &mqtt_toml("")),
        [],
        &dir.0,
    )
    .expect("config");
    let mqtt = cfg.mqtt.clone().expect("[mqtt]");
    // The device directory checks tokens through a gateway.
    let gw = edgeway::testing::TestGateway::start(cfg).await;
    let (ctx, _crx) = tokio::sync::mpsc::unbounded_channel();
    let (wtx, _wrx) = tokio::sync::mpsc::unbounded_channel();
    let shared = Arc::new(
        ProtocolShared::new(
            DeviceDirectory::new(gw.gateway().clone()),
            Topics::new("ai/v1"),
            PresenceReporter::new(Arc::new(Sessions::new(1 << 20, 64 * 1024)), ctx),
            Arc::new(Wills::new(wtx)),
        )
        .with_config(&mqtt),
    );
    for bad in SERVER_ONLY_V5 {
        let mut codec = DeviceProtocol::new(shared.clone());
        let mut stream = BytesMut::from(&connect_v5()[..]);
        stream.extend_from_slice(bad);
        codec.read_mut(&mut stream, 1 << 20).expect("the CONNECT");
        let next = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| codec.read_mut(&mut stream, 1 << 20)));
        let next = next.unwrap_or_else(|_| panic!("the codec panicked on {bad:02x?}"));
        assert!(next.is_err(), "{bad:02x?} must close the connection: {next:?}");
    }
    gw.stop().await;
}

/// The same over a real socket: the connection is closed, nothing in the
/// process panics, other devices are not affected and the device connects
/// and subscribes again. Today the codec's panic leaves rumqttd's will
/// entry of the client id behind; the next CONNECT of that id panics on it
/// (server/broker.rs:544) while holding the will map's lock, which poisons
/// it: from then on every CONNECT of every device panics at
/// server/broker.rs:538 and is dropped without a CONNACK, until a restart.
/// Five bytes from one authenticated device lock all devices out.
#[tokio::test]
async fn an_mqtt5_device_sending_server_only_packets_is_disconnected_and_nothing_panics() {
    static PANICS: AtomicUsize = AtomicUsize::new(0);
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        PANICS.fetch_add(1, Ordering::SeqCst);
        default(info);
    }));
    let (_fake, gw, addr) = start(Knobs::default(), "").await;
    for bad in SERVER_ONLY_V5 {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(&connect_v5()).await.unwrap();
        let mut ack = [0u8; 2];
        s.read_exact(&mut ack).await.unwrap();
        assert_eq!(ack[0], 0x20, "CONNACK");
        s.write_all(bad).await.unwrap();
        let mut rest = Vec::new();
        let closed = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut rest)).await;
        assert!(closed.is_ok(), "{bad:02x?}: the connection stays open");
        assert!(until_devices_connected(&gw, 0).await, "connected: {:?}", devices_connected(&gw));
        // Another device is not affected…
        let mut other = device(addr, V::V4, D2).await;
        other.subscribe(&other.topic("x")).await;
        other.disconnect_and_wait().await;
        // …and this one connects again.
        let mut d = device(addr, V::V5, D1).await;
        d.subscribe(&d.topic("x")).await;
        d.disconnect_and_wait().await;
    }
    assert_eq!(PANICS.load(Ordering::SeqCst), 0, "a panic in the process (see the test output)");
    gw.stop().await;
}
