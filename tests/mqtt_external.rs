//! `[mqtt] mode = "external"`: edgeway as a client of a real Mosquitto
//! broker (started here on a free port), devices as rumqttc clients of the
//! same broker, fake engines behind edgeway.

mod mqtt_support;

use std::path::Path;
use std::sync::atomic::Ordering::SeqCst;
use std::time::Duration;

use edgeway::config::Config;
use edgeway::testing::{config_toml, Mosquitto, TempDir};
use mqtt_support::*;
use serde_json::{json, Value};

/// edgeway's own password on the broker (the environment variable its
/// `password_env` names, handed to the config loader).
const EDGEWAY_PASSWORD: &str = "edgeway-broker-pass";
const PASSWORD_ENV: &str = "EDGEWAY_TEST_BROKER_PASSWORD";

/// `[mqtt]` in external mode on `port`, and the demo devices (with their
/// plain passwords in the environment for `edgeway mqtt-acl`).
fn external_toml(port: u16, client_id: &str) -> String {
    let hash = |p: &str| hex::encode(edgeway::config::hash_api_key(p));
    format!(
        r#"
[mqtt]
mode = "external"
coalesce_ms = 0
[mqtt.external]
host = "127.0.0.1"
port = {port}
client_id = "{client_id}"
username = "edgeway"
password_env = "{PASSWORD_ENV}"
[devices.demo-device-1]
tenant = "demo"
application = "demo"
password_sha256 = "{}"
mqtt_password_env = "EDGEWAY_TEST_D1"
[devices.demo-device-2]
tenant = "demo"
application = "demo"
password_sha256 = "{}"
mqtt_password_env = "EDGEWAY_TEST_D2"
"#,
        hash(D1.1),
        hash(D2.1)
    )
}

fn env() -> Vec<(String, String)> {
    vec![
        (PASSWORD_ENV.to_string(), EDGEWAY_PASSWORD.to_string()),
        ("EDGEWAY_TEST_D1".to_string(), D1.1.to_string()),
        ("EDGEWAY_TEST_D2".to_string(), D2.1.to_string()),
    ]
}

fn config(engine_url: &str, data: &Path, port: u16, node: &str) -> Config {
    let text = config_toml(engine_url, "openai", data, &external_toml(port, &format!("edgeway-{node}")))
        .replace("node_id = \"test-node\"", &format!("node_id = \"{node}\""));
    Config::from_toml_str(&text, env(), Path::new(".")).unwrap_or_else(|e| panic!("test config: {e}\n{text}"))
}

/// A gateway of node `node` on the broker at `port`, with its data
/// directory; returns once the broker has granted all its subscriptions.
async fn gateway(engine_url: &str, port: u16, node: &str) -> (TestGateway, TempDir) {
    let tmp = TempDir::new("edgeway-ext");
    let gw = TestGateway::start(config(engine_url, &tmp.0, port, node)).await;
    gw.wait_ready().await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let r = gw.gateway().readiness().await.unwrap();
        let m = r.mqtt_bus.expect("the external broker is reported");
        if m["subscribed"] == true {
            assert_eq!(m["state"], "connected");
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "edgeway never subscribed on the broker: {m}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    (gw, tmp)
}

#[tokio::test]
async fn a_device_gets_a_streamed_answer_through_mosquitto() {
    let broker = Mosquitto::anonymous().await;
    let fake = FakeEngine::start_with(Knobs::slow(5, 5)).await;
    let (gw, _tmp) = gateway(&fake.url(), broker.port, "a").await;
    assert!(gw.running.as_ref().unwrap().mqtt.is_none(), "no embedded broker in external mode");

    let mut d = device(broker.addr(), V::V5, D1).await;
    d.subscribe(&d.topic("res/#")).await;
    d.publish(&d.topic("req"), request("ext-1").to_string()).await;
    let events = d.stream(&d.topic("res/ext-1")).await;
    assert_eq!(events[0]["type"], "accepted", "{events:#?}");
    let text = check_stream(&events);
    assert_eq!(text, "tok tok tok tok tok ");
    let done = events.last().unwrap();
    assert_eq!(done["type"], "done", "{done}");
    assert_eq!(done["result"]["node_id"], "a", "{done}");

    // The retained model catalogue is on the broker too.
    d.subscribe("ai/v1/shared/models").await;
    let catalogue = d.msg().await.json();
    assert_eq!(catalogue["node_id"], "a");

    // The connection is reported in /ready and the metrics.
    assert_eq!(metric(&gw, "mqtt_broker_connected"), Some(1.0));
    gw.stop().await;
}

#[tokio::test]
async fn a_cancel_through_the_broker_stops_the_engine() {
    let broker = Mosquitto::anonymous().await;
    let fake = FakeEngine::start_with(Knobs::slow(1000, 20)).await;
    let (gw, _tmp) = gateway(&fake.url(), broker.port, "a").await;
    let mut d = device(broker.addr(), V::V5, D1).await;
    d.subscribe(&d.topic("res/#")).await;
    d.publish(&d.topic("req"), request("to-cancel").to_string()).await;
    let mut events = vec![d.msg().await.json(), d.msg().await.json()];
    assert_eq!(events[1]["type"], "delta", "{events:#?}");
    d.publish(&d.topic("cancel"), json!({"request_id": "to-cancel"}).to_string()).await;
    events.extend(d.stream(&d.topic("res/to-cancel")).await);
    check_stream(&events);
    let last: &Value = events.last().unwrap();
    assert_eq!(last["code"], "REQUEST_CANCELLED", "{last}");
    assert!(fake.wait_for(Duration::from_secs(10), |s| s.active.load(SeqCst) == 0).await);
    assert_eq!(fake.stats.aborted.load(SeqCst), 1);
    gw.stop().await;
}

#[tokio::test]
async fn a_device_the_registry_does_not_list_is_refused() {
    let broker = Mosquitto::anonymous().await;
    let fake = FakeEngine::start().await;
    let (gw, _tmp) = gateway(&fake.url(), broker.port, "a").await;
    let mut stranger = connect(broker.addr(), V::V5, "stranger", "stranger", "x").await.unwrap();
    stranger.subscribe("ai/v1/stranger/res/#").await;
    stranger.publish("ai/v1/stranger/req", request("s-1").to_string()).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while metric(&gw, "mqtt_rejected_total{code=\"AUTH_FAILED\"}") != Some(1.0) {
        assert!(tokio::time::Instant::now() < deadline, "the stranger's request was not refused");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(fake.requests(), 0);
    assert!(stranger.drain().is_empty());
    gw.stop().await;
}
