//! Lifecycle events of MQTT tasks on the NATS bus: a device asks over the
//! embedded broker, an internal service watches `ai.v1.events.>` on a real
//! `nats-server`. (Apart from `tests/nats.rs` so that it builds on the MQTT
//! test helpers.)

mod mqtt_support;

use std::time::Duration;

use edgeway::ingress::nats::BusState;
use edgeway::testing::NatsServer;
use futures::StreamExt;
use mqtt_support::*;
use serde_json::Value;

#[tokio::test]
async fn lifecycle_events_of_mqtt_tasks_are_published_on_nats() {
    let nats = NatsServer::start(false).await;
    let fake = FakeEngine::start_with(Knobs::default()).await;
    let extra = format!("{}\n[nats]\nurl = \"{}\"\n", mqtt_toml(""), nats.url());
    let gw = TestGateway::with_engine(&fake.url(), "openai", &extra).await;
    gw.wait_ready().await;
    gw.nats().wait_for(BusState::Connected).await;
    let addr = gw.running.as_ref().unwrap().mqtt.expect("mqtt is configured").mqtt;

    let client = async_nats::connect(nats.url()).await.unwrap();
    let mut sub = client.subscribe("ai.v1.events.demo.>").await.unwrap();
    client.flush().await.unwrap();

    let mut d = device(addr, V::V5, D1).await;
    d.subscribe(&d.topic("res/#")).await;
    d.publish(&d.topic("req"), request("mqtt-to-nats").to_string()).await;
    let events = d.stream(&d.topic("res/mqtt-to-nats")).await;
    let task_id = events[0]["task_id"].as_str().unwrap().to_string();
    assert_eq!(events.last().unwrap()["type"], "done");

    let mut states = Vec::new();
    while states.last().map(String::as_str) != Some("SUCCEEDED") {
        let m = tokio::time::timeout(Duration::from_secs(20), sub.next()).await.expect("events").unwrap();
        assert!(!String::from_utf8_lossy(&m.payload).contains("Say hello"), "no prompt text");
        let v: Value = serde_json::from_slice(&m.payload).unwrap();
        validate("lifecycle-event", &v);
        if v["task_id"] == task_id.as_str() {
            assert_eq!(v["ingress"], "mqtt");
            assert_eq!(v["request_id"], "mqtt-to-nats");
            assert_eq!(
                m.subject.as_str(),
                format!("ai.v1.events.demo.{}", v["state"].as_str().unwrap().to_lowercase())
            );
            states.push(v["state"].as_str().unwrap().to_string());
        }
    }
    assert_eq!(states, ["RECEIVED", "VALIDATING", "QUEUED", "DISPATCHING", "RUNNING", "STREAMING", "SUCCEEDED"]);
    gw.stop().await;
}
