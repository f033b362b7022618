//! What the task store file keeps of a call, read from the real SQLite file
//! (and its WAL) of a whole gateway: the README's statements about what is
//! stored, checked byte for byte.

mod common;
mod mqtt_support;

use std::path::Path;

use common::{client, contains, file_bytes, DEMO_KEY};
use edgeway::config::Config;
use edgeway::testing::{FakeEngine, Knobs, TempDir, TestGateway};
use mqtt_support::{check_stream, device, mqtt_toml, request, D1, V};
use serde_json::json;

/// The fake engine's answer.
const ANSWER: &str = "tok tok tok tok tok ";

async fn gateway(store_prompts: bool) -> (FakeEngine, TestGateway) {
    let fake = FakeEngine::start_with(Knobs::default()).await;
    let gw = TestGateway::with_engine_edit(&fake.url(), "openai", &mqtt_toml("coalesce_ms = 0"), |t| {
        t.replace("[store]\n", &format!("[store]\nstore_prompts = {store_prompts}\n"))
    })
    .await;
    gw.wait_ready().await;
    (fake, gw)
}

/// A device never chose to have its answers kept: its requests carry an
/// idempotency key all the same (derived from its request id), and without
/// `store_prompts` the answer a repeat is replayed with stays in memory
/// (the scheduler's replay window), never in the file.
#[tokio::test]
async fn a_device_answer_is_not_written_to_the_file_without_store_prompts() {
    let (fake, gw) = gateway(false).await;
    let addr = gw.running.as_ref().unwrap().mqtt.expect("mqtt").mqtt;
    let mut d = device(addr, V::V4, D1).await;
    d.subscribe(&d.topic("res/#")).await;
    for _ in 0..2 {
        // The repeat is answered from memory, with the text, and runs nothing.
        d.publish(&d.topic("req"), request("keep-1").to_string()).await;
        let events = d.stream(&d.topic("res/keep-1")).await;
        assert_eq!(check_stream(&events), ANSWER);
    }
    assert_eq!(fake.stats.requests.load(std::sync::atomic::Ordering::SeqCst), 1);
    gw.store().flush().await;
    let db = gw.db_path();
    let c = rusqlite::Connection::open(&db).unwrap();
    let (keys, texts): (i64, i64) = c
        .query_row("SELECT COUNT(*), COUNT(result_text) FROM idempotency", [], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap();
    assert_eq!((keys, texts), (1, 0), "the key and outcome are kept, not the answer");
    drop(c);
    assert!(!contains(&file_bytes(&db), "tok tok"), "the answer text is in the database file");
    gw.stop().await;
}

/// With `store_prompts`, and for an HTTP caller that sends its own
/// `Idempotency-Key` (it asks for the replay), the answer is kept with the
/// key for the key's lifetime.
#[tokio::test]
async fn the_answer_is_kept_with_the_key_when_the_policy_or_the_caller_asks() {
    let (_fake, gw) = gateway(true).await;
    let addr = gw.running.as_ref().unwrap().mqtt.expect("mqtt").mqtt;
    let mut d = device(addr, V::V4, D1).await;
    d.subscribe(&d.topic("res/#")).await;
    d.publish(&d.topic("req"), request("keep-2").to_string()).await;
    assert_eq!(check_stream(&d.stream(&d.topic("res/keep-2")).await), ANSWER);
    gw.store().flush().await;
    let c = rusqlite::Connection::open(gw.db_path()).unwrap();
    let texts: i64 = c.query_row("SELECT COUNT(result_text) FROM idempotency", [], |r| r.get(0)).unwrap();
    assert_eq!(texts, 1);
    gw.stop().await;

    let (_fake, gw) = gateway(false).await;
    let body = json!({"model": "general-chat", "messages": [{"role": "user", "content": "Say hello"}]});
    let r = client()
        .post(format!("{}/v1/chat/completions", gw.base_url))
        .bearer_auth(DEMO_KEY)
        .header("Idempotency-Key", "caller-chose-this")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    gw.store().flush().await;
    let c = rusqlite::Connection::open(gw.db_path()).unwrap();
    let text: Option<String> = c.query_row("SELECT result_text FROM idempotency", [], |r| r.get(0)).unwrap();
    assert_eq!(text.as_deref(), Some(ANSWER));
    gw.stop().await;
}

/// Review 15 L4: what decides is whether the device chose its key, not that
/// it came over MQTT. A device that sends its own `idempotency_key` asks
/// for the replay, as an HTTP caller does: the answer is kept with it.
#[tokio::test]
async fn a_device_that_sends_its_own_key_gets_its_answer_kept() {
    let (_fake, gw) = gateway(false).await;
    let addr = gw.running.as_ref().unwrap().mqtt.expect("mqtt").mqtt;
    let mut d = device(addr, V::V4, D1).await;
    d.subscribe(&d.topic("res/#")).await;
    let mut req = request("own-key-1");
    req["idempotency_key"] = json!("device-chose-this");
    d.publish(&d.topic("req"), req.to_string()).await;
    assert_eq!(check_stream(&d.stream(&d.topic("res/own-key-1")).await), ANSWER);
    gw.store().flush().await;
    let c = rusqlite::Connection::open(gw.db_path()).unwrap();
    let text: Option<String> = c.query_row("SELECT result_text FROM idempotency", [], |r| r.get(0)).unwrap();
    assert_eq!(text.as_deref(), Some(ANSWER));
    gw.stop().await;
}

/// Review 15 L4: once the in-memory replay is gone (here: after a
/// restart), a device's repeat of a derived key gets the outcome without
/// the text, and its `done` says so (`result.text_not_kept`), so an empty
/// answer and a missing one differ. Nothing runs twice.
#[tokio::test]
async fn a_devices_repeat_after_a_restart_says_the_text_was_not_kept() {
    let dir = TempDir::new("edgeway-retention");
    let fake = FakeEngine::start_with(Knobs::default()).await;
    let text = edgeway::testing::config_toml(&fake.url(), "openai", &dir.0, &mqtt_toml("coalesce_ms = 0"));
    let load = || Config::from_toml_str(&text, std::iter::empty(), Path::new(".")).unwrap();
    let gw = TestGateway::start(load()).await;
    gw.wait_ready().await;
    let addr = gw.running.as_ref().unwrap().mqtt.expect("mqtt").mqtt;
    let mut d = device(addr, V::V4, D1).await;
    d.subscribe(&d.topic("res/#")).await;
    d.publish(&d.topic("req"), request("late-1").to_string()).await;
    let first = d.stream(&d.topic("res/late-1")).await;
    assert_eq!(check_stream(&first), ANSWER);
    assert_eq!(first.last().unwrap()["result"].get("text_not_kept"), None, "the first answer is whole");
    d.kill();
    gw.stop().await;

    let gw = TestGateway::start(load()).await;
    gw.wait_ready().await;
    let addr = gw.running.as_ref().unwrap().mqtt.expect("mqtt").mqtt;
    let mut d = device(addr, V::V4, D1).await;
    d.subscribe(&d.topic("res/#")).await;
    d.publish(&d.topic("req"), request("late-1").to_string()).await;
    let again = d.stream(&d.topic("res/late-1")).await;
    assert_eq!(check_stream(&again), "", "{again:#?}");
    let done = again.last().unwrap();
    assert_eq!((&done["type"], &done["result"]["status"]), (&json!("done"), &json!("SUCCEEDED")), "{done}");
    assert_eq!(done["result"]["text_not_kept"], true, "{done}");
    assert_eq!(fake.stats.requests.load(std::sync::atomic::Ordering::SeqCst), 1, "nothing ran twice");
    gw.stop().await;
}
