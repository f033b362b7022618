//! A task store that cannot write (a full disk, a read-only file): the
//! gateway says so (`/ready` 503 with the reason, a metric), refuses new
//! work with `STORE_UNAVAILABLE` rather than run it unrecorded, never
//! reports an admin change as done when it is not durable, and loses
//! nothing it acknowledged: what running tasks record is kept and written
//! once the store can write again.
//!
//! The failure is made inside SQLite, on the real file: the writer's
//! connection is switched to `query_only` (every write fails as on a
//! read-only file); the store's unit tests do the same with a file that may
//! not grow (a full disk).

mod common;

use std::sync::atomic::Ordering::SeqCst;

use common::*;
use edgeway::config::Config;
use edgeway::testing::{config_toml, TempDir};
use serde_json::{json, Value};

async fn ready(gw: &TestGateway) -> (u16, Value) {
    let r = client().get(format!("{}/ready", gw.base_url)).send().await.unwrap();
    (r.status().as_u16(), r.json().await.unwrap())
}

async fn revoke(gw: &TestGateway, key: &str) -> reqwest::Response {
    let url = format!("{}/admin/keys/revoke", gw.base_url);
    client().post(url).bearer_auth(OPS_KEY).json(&json!({ "api_key": key })).send().await.unwrap()
}

#[tokio::test]
async fn a_store_that_cannot_write_is_reported_refuses_new_work_and_loses_nothing() {
    let fake = FakeEngine::start_with(Knobs::slow(6, 40)).await;
    let gw = TestGateway::with_engine(&fake.url(), "openai", "").await;
    gw.wait_ready().await;
    assert_eq!(ready(&gw).await.0, 200);

    // A task is running when the disk goes read-only.
    let mut events = gw.recorder().subscribe();
    let running = tokio::spawn({
        let (base, body) = (gw.base_url.clone(), chat_body(false));
        async move {
            let url = format!("{base}/v1/chat/completions");
            client().post(url).bearer_auth(DEMO_KEY).json(&body).send().await.unwrap().json::<Value>().await.unwrap()
        }
    });
    let streaming = next_event(&mut events, "the task streaming", |e| e.state == TaskState::Streaming).await;
    gw.store().set_writer_pragma("query_only", 1).await;

    // It finishes for its caller; its end cannot be written.
    let done = running.await.unwrap();
    assert_eq!(done["edge"]["status"], "SUCCEEDED", "{done}");
    gw.store().flush().await;
    let (status, body) = ready(&gw).await;
    assert_eq!(status, 503, "{body}");
    let store = body["store"].as_str().unwrap();
    assert!(store.starts_with("degraded") && store.contains("readonly"), "{body}");
    assert!(body["not_ready"].as_array().unwrap().iter().any(|r| r.as_str().unwrap().contains("store")), "{body}");
    assert!(gw.gateway().render_metrics().contains("edgeway_store_degraded 1"));

    // New work is refused, with a code of its own and a retry hint.
    let requests = fake.stats.requests.load(SeqCst);
    let r = post_chat(&gw, DEMO_KEY, &chat_body(false)).await;
    assert_eq!(r.status(), 503);
    let v: Value = r.json().await.unwrap();
    assert_eq!(error_code(&v), "STORE_UNAVAILABLE", "{v}");
    assert!(v["error"]["retry_after_ms"].as_u64().is_some_and(|ms| ms > 0), "{v}");
    assert_eq!(fake.stats.requests.load(SeqCst), requests, "nothing ran unrecorded");

    // The disk is back: ready again, and what was acknowledged is there.
    gw.store().set_writer_pragma("query_only", 0).await;
    gw.store().flush().await;
    let (status, body) = ready(&gw).await;
    assert_eq!(status, 200, "{body}");
    assert!(gw.gateway().render_metrics().contains("edgeway_store_degraded 0"));
    let states = stored_states(&gw, &streaming.task_id).await;
    assert_eq!(states.last().map(String::as_str), Some("SUCCEEDED"), "{states:?}");
    let r = post_chat(&gw, DEMO_KEY, &chat_body(false)).await;
    assert_eq!(r.status(), 200);
    gw.stop().await;
}

/// A revocation answers only once it is durable: while the store cannot
/// write it is refused with `STORE_UNAVAILABLE` (not `revoked: true` for a
/// key that would come back after a restart); asked again once the store
/// writes, it is done and survives a restart.
#[tokio::test]
async fn a_revocation_is_reported_done_only_once_it_is_durable() {
    let fake = FakeEngine::start().await;
    let dir = TempDir::new("edgeway-revoke");
    let text = config_toml(&fake.url(), "openai", &dir.0, "");
    let load = || Config::from_toml_str(&text, std::iter::empty(), std::path::Path::new(".")).unwrap();
    let gw = TestGateway::start(load()).await;
    gw.wait_ready().await;
    gw.store().set_writer_pragma("query_only", 1).await;
    let r = revoke(&gw, DEMO_KEY).await;
    assert_eq!(r.status(), 503, "not reported as done");
    let v: Value = r.json().await.unwrap();
    assert_eq!(error_code(&v), "STORE_UNAVAILABLE", "{v}");
    assert!(v["error"]["retry_after_ms"].as_u64().is_some_and(|ms| ms > 0), "{v}");

    gw.store().set_writer_pragma("query_only", 0).await;
    let r = revoke(&gw, DEMO_KEY).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Value>().await.unwrap()["revoked"], true);
    gw.stop().await;
    let gw = TestGateway::start(load()).await;
    gw.wait_ready().await;
    assert_eq!(post_chat(&gw, DEMO_KEY, &chat_body(false)).await.status(), 401, "still revoked");
    gw.stop().await;
}
