//! KV-cache affinity against two fake llama-servers with `slot_affinity`
//! (issue 12): every request carries its slot (`id_slot`) and
//! `cache_prompt: true`; a session's next turn goes back to the instance
//! and slot of its last one when that is free and no busier, even where the
//! router alone would pick the other; a busier one gives way to the normal
//! choice.

mod common;

use std::time::Duration;

use common::*;
use edgeway::testing::Knobs;
use serde_json::{json, Value};

async fn gateway(a: &FakeEngine, b: &FakeEngine) -> TestGateway {
    let second = b.url();
    let gw = TestGateway::with_engine_edit(&a.url(), "openai", "", move |t: String| {
        let t = t.replace("instances = [\"fake\"]", "instances = [\"fake\", \"fake2\"]");
        let t = t.replace("health_interval_ms = 100\n", "health_interval_ms = 100\nslot_affinity = true\n");
        format!(
            "{t}\n[engines.fake2]\ntype = \"openai\"\nbase_url = \"{second}\"\nmodel = \"fake-model\"\n\
             max_concurrency = 2\nhealth_interval_ms = 100\nslot_affinity = true\n"
        )
    })
    .await;
    gw.wait_ready().await;
    gw
}

async fn session(gw: &TestGateway) -> String {
    let resp = client().post(format!("{}/v1/sessions", gw.base_url)).bearer_auth(DEMO_KEY).json(&json!({})).send();
    let v: Value = resp.await.unwrap().json().await.unwrap();
    v["id"].as_str().unwrap().to_string()
}

async fn turn(gw: &TestGateway, id: &str, text: &str) {
    let body = json!({"model": "general-chat", "session_id": id, "max_tokens": 8,
        "messages": [{"role": "user", "content": text}]});
    let resp = post_chat(gw, DEMO_KEY, &body).await;
    assert_eq!(resp.status(), 200, "{}", resp.text().await.unwrap());
}

/// A call outside the session, running until `engine` is done with it.
fn blocker(gw: &TestGateway) -> tokio::task::JoinHandle<u16> {
    let (url, body) = (format!("{}/v1/chat/completions", gw.base_url), chat_body(false));
    tokio::spawn(
        async move { client().post(url).bearer_auth(DEMO_KEY).json(&body).send().await.unwrap().status().as_u16() },
    )
}

async fn active_total(a: &FakeEngine, b: &FakeEngine, n: i64) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    // Either engine's change wakes the waiter: wait on each in turn, briefly.
    while a.active() + b.active() != n {
        assert!(tokio::time::Instant::now() < deadline, "never {n} active");
        let step = Duration::from_millis(20);
        let _ = tokio::join!(a.wait_for(step, |_| false), b.wait_for(step, |_| false));
    }
}

fn slot_of(body: &Value) -> (Option<u64>, Option<bool>) {
    (body["id_slot"].as_u64(), body["cache_prompt"].as_bool())
}

fn last_text(e: &FakeEngine) -> Value {
    e.last_request().unwrap()["messages"].as_array().unwrap().last().unwrap()["content"].clone()
}

#[tokio::test]
async fn a_session_turn_returns_to_its_instance_and_slot_unless_that_one_is_busier() {
    let one = FakeEngine::start_with(Knobs::slow(40, 25)).await;
    let two = FakeEngine::start_with(Knobs::slow(40, 25)).await;
    let gw = gateway(&one, &two).await;
    let id = session(&gw).await;

    // A call outside the session keeps one engine (x) busy: turn 1 goes to
    // the idle other (y, by load), in its slot 0.
    let held = blocker(&gw);
    active_total(&one, &two, 1).await;
    let (x, y) = if one.active() == 1 { (&one, &two) } else { (&two, &one) };
    y.set(|k| *k = Knobs::default());
    turn(&gw, &id, "turn one").await;
    assert_eq!(last_text(y), "turn one");
    assert_eq!(slot_of(&y.last_request().unwrap()), (Some(0), Some(true)));
    assert_eq!(slot_of(&x.last_request().unwrap()), (Some(0), Some(true)), "every task has its slot");
    assert_eq!(held.await.unwrap(), 200);

    // Both idle: the session goes back to y, slot 0, whatever the router's
    // own order (the policy's unit test covers the case where it differs).
    x.set(|k| *k = Knobs::default());
    turn(&gw, &id, "turn two").await;
    assert_eq!(last_text(y), "turn two");
    assert_eq!(slot_of(&y.last_request().unwrap()), (Some(0), Some(true)));

    // y busier than x: the normal choice. Two calls outside the session,
    // one on each (by load); x's ends first.
    x.set(|k| *k = Knobs::slow(40, 25));
    y.set(|k| *k = Knobs::slow(200, 25));
    let h1 = blocker(&gw);
    active_total(&one, &two, 1).await;
    let h2 = blocker(&gw);
    active_total(&one, &two, 2).await;
    x.set(|k| *k = Knobs::default());
    assert!(x.wait_for(Duration::from_secs(10), |s| s.active.load(std::sync::atomic::Ordering::SeqCst) == 0).await);
    assert_eq!(y.active(), 1);
    turn(&gw, &id, "turn three").await;
    assert_eq!(last_text(x), "turn three", "y was busier: x took it");
    for h in [h1, h2] {
        assert_eq!(h.await.unwrap(), 200);
    }
    gw.stop().await;
}
