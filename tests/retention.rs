//! What the task store file keeps of a call, read from the real SQLite file
//! (and its WAL) of a whole gateway: the README's statements about what is
//! stored, checked byte for byte.

mod common;
mod mqtt_support;

use std::path::Path;

use common::{client, DEMO_KEY};
use edgeway::testing::{FakeEngine, Knobs, TestGateway};
use mqtt_support::{check_stream, device, mqtt_toml, request, D1, V};
use serde_json::json;

/// The fake engine's answer.
const ANSWER: &str = "tok tok tok tok tok ";

/// The database file and its WAL, as bytes.
fn file_bytes(db: &Path) -> Vec<u8> {
    let mut out = Vec::new();
    for ext in ["", "-wal"] {
        if let Ok(b) = std::fs::read(format!("{}{ext}", db.display())) {
            out.extend(b);
        }
    }
    out
}

fn contains(hay: &[u8], needle: &str) -> bool {
    hay.windows(needle.len()).any(|w| w == needle.as_bytes())
}

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
