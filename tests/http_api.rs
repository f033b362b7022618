//! The HTTP bridge end to end against fake engines: a whole gateway on port
//! 0, real sockets, the SQLite file on disk.

mod common;

use std::sync::atomic::Ordering::SeqCst;
use std::time::Duration;

use common::*;
use serde_json::{json, Value};

async fn gateway_with(knobs: Knobs, extra: &str) -> (FakeEngine, TestGateway) {
    let fake = FakeEngine::start_with(knobs).await;
    let gw = TestGateway::with_engine(&fake.url(), "openai", extra).await;
    gw.wait_ready().await;
    (fake, gw)
}

/// A gateway whose engine has one slot, so a second call waits.
async fn one_slot_gateway(knobs: Knobs, extra: &str) -> (FakeEngine, TestGateway) {
    let fake = FakeEngine::start_with(knobs).await;
    let gw = TestGateway::with_engine_edit(&fake.url(), "openai", extra, |t| {
        t.replace("max_concurrency = 2", "max_concurrency = 1")
    })
    .await;
    gw.wait_ready().await;
    (fake, gw)
}

/// Waits until the scheduler's snapshot satisfies `cond`.
async fn until_snapshot(gw: &TestGateway, what: &str, cond: impl Fn(&edgeway::scheduler::Snapshot) -> bool) {
    for _ in 0..500 {
        if cond(&gw.scheduler().snapshot().await.unwrap()) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("never saw: {what}");
}

#[tokio::test]
async fn non_streaming_answer_has_openai_shape_and_edge_metadata() {
    let (_fake, gw) = gateway_with(Knobs::default(), "").await;
    let resp = post_chat(&gw, DEMO_KEY, &chat_body(false)).await;
    assert_eq!(resp.status(), 200);
    let task_id = resp.headers()["x-task-id"].to_str().unwrap().to_string();
    assert!(resp.headers().contains_key("x-request-id"));
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], "general-chat");
    assert_eq!(v["choices"][0]["message"]["content"], "tok tok tok tok tok ");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["usage"]["completion_tokens"], 5);
    let edge = &v["edge"];
    assert_eq!(edge["task_id"], task_id.as_str());
    assert_eq!(edge["status"], "SUCCEEDED");
    assert_eq!(edge["logical_model"], "general-chat");
    assert_eq!(edge["actual_model"], "fake/fake-model");
    assert_eq!(edge["node_id"], "test-node");
    assert_eq!(edge["usage"]["output_tokens"], 5);
    assert_eq!(edge["degraded"], false);
    assert!(edge["timing"]["total_ms"].is_u64());
    assert_eq!(
        stored_states(&gw, &task_id).await,
        ["RECEIVED", "VALIDATING", "QUEUED", "DISPATCHING", "RUNNING", "STREAMING", "SUCCEEDED"]
    );
    gw.stop().await;
}

#[tokio::test]
async fn streaming_answer_sends_chunks_usage_edge_and_done() {
    let (_fake, gw) = gateway_with(Knobs::default(), "").await;
    let mut body = chat_body(true);
    body["stream_options"] = json!({"include_usage": true});
    body["request_id"] = json!("req-stream-1");
    let resp = post_chat(&gw, DEMO_KEY, &body).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    assert_eq!(resp.headers()["x-request-id"], "req-stream-1");
    let (events, done) = read_sse(resp).await;
    assert!(done, "stream ends with [DONE]");
    assert_eq!(events[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = events.iter().filter_map(|e| e["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(text, "tok tok tok tok tok ");
    let finish = events.iter().find(|e| !e["choices"][0]["finish_reason"].is_null()).unwrap();
    assert_eq!(finish["choices"][0]["finish_reason"], "stop");
    let last = events.last().unwrap();
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"]["completion_tokens"], 5);
    assert_eq!(last["edge"]["request_id"], "req-stream-1");
    assert_eq!(last["edge"]["status"], "SUCCEEDED");
    gw.stop().await;
}

#[tokio::test]
async fn missing_or_wrong_credentials_get_auth_failed() {
    let (fake, gw) = gateway_with(Knobs::default(), "").await;
    let resp = post_chat(&gw, "sk-wrong", &chat_body(false)).await;
    assert_eq!(resp.status(), 401);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(error_code(&v), "AUTH_FAILED");
    assert_eq!(v["error"]["type"], "authentication_error");
    let resp =
        client().post(format!("{}/v1/chat/completions", gw.base_url)).json(&chat_body(false)).send().await.unwrap();
    assert_eq!(resp.status(), 401);
    assert_eq!(fake.stats.requests.load(SeqCst), 0, "nothing reached the engine");
    gw.stop().await;
}

#[tokio::test]
async fn bad_bodies_get_invalid_request_with_the_field() {
    let (fake, gw) = gateway_with(Knobs::default(), "").await;
    let c = client();
    let url = format!("{}/v1/chat/completions", gw.base_url);
    let resp = c.post(&url).bearer_auth(DEMO_KEY).body("{not json").send().await.unwrap();
    assert_eq!(resp.status(), 400);
    assert_eq!(error_code(&resp.json().await.unwrap()), "INVALID_REQUEST");
    for (body, needle) in [
        (json!({"model": "general-chat"}), "messages"),
        (json!({"model": "general-chat", "messages": "hi"}), "messages"),
        (json!({"model": "general-chat", "messages": []}), "messages"),
        (
            json!({"model": "general-chat", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}),
            "max_tokens",
        ),
        (
            json!({"model": "general-chat", "messages": [{"role": "user", "content": "x"}], "priority": "P9"}),
            "priority",
        ),
        (
            json!({"model": "general-chat", "messages": [{"role": "user", "content": "x"}], "timeouts": {"queue_ms": 0}}),
            "queue_ms",
        ),
        (json!({"model": "general-chat", "messages": [{"role": "wizard", "content": "x"}]}), "role"),
        // Caller-declared user ids key per-user limits and are stored:
        // bounded and single-line.
        (
            json!({"model": "general-chat", "messages": [{"role": "user", "content": "x"}], "user": "u".repeat(200)}),
            "'user'",
        ),
        (
            json!({"model": "general-chat", "messages": [{"role": "user", "content": "x"}], "metadata": {"user_id": "a\nb"}}),
            "metadata.user_id",
        ),
    ] {
        let resp = c.post(&url).bearer_auth(DEMO_KEY).json(&body).send().await.unwrap();
        assert_eq!(resp.status(), 400, "{body}");
        let v: Value = resp.json().await.unwrap();
        assert_eq!(error_code(&v), "INVALID_REQUEST", "{body}");
        assert!(v["error"]["message"].as_str().unwrap().contains(needle), "{v}");
    }
    assert_eq!(fake.stats.requests.load(SeqCst), 0);
    gw.stop().await;
}

#[tokio::test]
async fn unknown_model_is_refused_and_models_are_listed() {
    let (_fake, gw) = gateway_with(Knobs::default(), "").await;
    let mut body = chat_body(false);
    body["model"] = json!("gpt-17");
    let resp = post_chat(&gw, DEMO_KEY, &body).await;
    assert_eq!(resp.status(), 400);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(error_code(&v), "INVALID_REQUEST");
    assert!(v["error"]["message"].as_str().unwrap().contains("unknown model"));
    let models: Value = client()
        .get(format!("{}/v1/models", gw.base_url))
        .bearer_auth(DEMO_KEY)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["data"][0]["id"], "general-chat");
    gw.stop().await;
}

#[tokio::test]
async fn priority_above_the_application_right_is_permission_denied() {
    let (_fake, gw) = gateway_with(Knobs::default(), "").await;
    let mut body = chat_body(false);
    body["priority"] = json!("P0");
    let resp = post_chat(&gw, DEMO_KEY, &body).await;
    assert_eq!(resp.status(), 403);
    assert_eq!(error_code(&resp.json().await.unwrap()), "PERMISSION_DENIED");
    let resp = post_chat(&gw, OPS_KEY, &body).await;
    assert_eq!(resp.status(), 200, "ops may use P0");
    gw.stop().await;
}

/// Sends a streaming request and waits until its first chunk arrived, so
/// it holds an engine slot.
async fn hold_slot(gw: &TestGateway) -> reqwest::Response {
    let mut resp = post_chat(gw, DEMO_KEY, &chat_body(true)).await;
    assert_eq!(resp.status(), 200);
    resp.chunk().await.unwrap().expect("first chunk");
    resp
}

#[tokio::test]
async fn full_queue_is_refused_at_once_with_retry_after() {
    let knobs = Knobs::slow(1000, 50);
    let (fake, gw) = gateway_with(knobs, "queue_capacity = 1").await;
    let _a = hold_slot(&gw).await;
    let _b = hold_slot(&gw).await;
    assert!(fake.wait_for(Duration::from_secs(5), |s| s.active.load(SeqCst) == 2).await);
    let queued = tokio::spawn({
        let body = chat_body(false);
        let url = gw.base_url.clone();
        async move { client().post(format!("{url}/v1/chat/completions")).bearer_auth(DEMO_KEY).json(&body).send().await }
    });
    until_snapshot(&gw, "the third call queued", |s| s.queues[0].waiting == 1).await;
    let resp = post_chat(&gw, DEMO_KEY, &chat_body(false)).await;
    assert_eq!(resp.status(), 503);
    assert_eq!(resp.headers()["retry-after"], "1");
    let v: Value = resp.json().await.unwrap();
    assert_eq!(error_code(&v), "QUEUE_FULL");
    assert_eq!(v["error"]["retry_after_ms"], 1000);
    queued.abort();
    gw.stop().await;
}

/// Runs one request with `timeouts` against an engine with `knobs` and
/// returns the error code it ended with; checks the engine was released.
async fn timeout_code(knobs: Knobs, timeouts: Value, busy: bool, stream: bool) -> (String, Value) {
    let (fake, gw) = gateway_with(knobs, "").await;
    let mut holders = Vec::new();
    if busy {
        holders.push(hold_slot(&gw).await);
        holders.push(hold_slot(&gw).await);
    }
    let mut body = chat_body(stream);
    body["timeouts"] = timeouts;
    let resp = post_chat(&gw, DEMO_KEY, &body).await;
    let (code, v) = if stream && resp.status() == 200 {
        let (events, done) = read_sse(resp).await;
        assert!(!done, "no [DONE] after an error");
        let last = events.last().unwrap().clone();
        (error_code(&last).to_string(), last)
    } else {
        assert_eq!(resp.status(), 504, "timeouts answer 504 (503 for the queue)");
        let v: Value = resp.json().await.unwrap();
        (error_code(&v).to_string(), v)
    };
    drop(holders);
    assert!(fake.wait_for(Duration::from_secs(5), |s| s.active.load(SeqCst) == 0).await, "engine released");
    let task_id = v["edge"]["task_id"].as_str().unwrap().to_string();
    let states = stored_states(&gw, &task_id).await;
    assert_eq!(states.last().map(String::as_str), Some("TIMED_OUT"), "{states:?}");
    gw.stop().await;
    (code, v)
}

#[tokio::test]
async fn queue_timeout() {
    let knobs = Knobs::slow(1000, 50);
    let (fake, gw) = gateway_with(knobs, "").await;
    let _a = hold_slot(&gw).await;
    let _b = hold_slot(&gw).await;
    let mut body = chat_body(false);
    body["timeouts"] = json!({"queue_ms": 100});
    let resp = post_chat(&gw, DEMO_KEY, &body).await;
    assert_eq!(resp.status(), 503);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(error_code(&v), "QUEUE_TIMEOUT");
    assert_eq!(v["edge"]["status"], "TIMED_OUT");
    assert_eq!(fake.stats.requests.load(SeqCst), 2, "the timed-out task never reached the engine");
    let states = stored_states(&gw, v["edge"]["task_id"].as_str().unwrap()).await;
    assert_eq!(states, ["RECEIVED", "VALIDATING", "QUEUED", "TIMED_OUT"]);
    gw.stop().await;
}

#[tokio::test]
async fn first_token_timeout() {
    let knobs = Knobs { first_token_delay: Duration::from_secs(5), ..Knobs::default() };
    let (code, _) = timeout_code(knobs, json!({"first_token_ms": 150}), false, false).await;
    assert_eq!(code, "FIRST_TOKEN_TIMEOUT");
}

#[tokio::test]
async fn idle_timeout_between_tokens() {
    let knobs = Knobs { tokens: 10, token_delay: Duration::from_secs(3), ..Knobs::default() };
    let (code, v) = timeout_code(knobs, json!({"idle_ms": 150}), false, true).await;
    assert_eq!(code, "IDLE_TIMEOUT");
    assert_eq!(v["edge"]["status"], "TIMED_OUT");
}

#[tokio::test]
async fn inference_timeout() {
    let knobs = Knobs::slow(1000, 20);
    let (code, _) = timeout_code(knobs, json!({"inference_ms": 300}), false, true).await;
    assert_eq!(code, "INFERENCE_TIMEOUT");
}

#[tokio::test]
async fn total_timeout() {
    let knobs = Knobs::slow(1000, 20);
    let (code, _) = timeout_code(knobs, json!({"total_ms": 300}), false, false).await;
    assert_eq!(code, "TOTAL_TIMEOUT");
}

#[tokio::test]
async fn client_disconnect_mid_stream_cancels_the_task_and_the_engine() {
    let knobs = Knobs::slow(1000, 20);
    let (fake, gw) = gateway_with(knobs, "").await;
    let mut resp = post_chat(&gw, DEMO_KEY, &chat_body(true)).await;
    let task_id = resp.headers()["x-task-id"].to_str().unwrap().to_string();
    // Read a few chunks so the engine is generating, then hang up.
    for _ in 0..3 {
        resp.chunk().await.unwrap().unwrap();
    }
    assert_eq!(fake.active(), 1);
    drop(resp);
    assert!(
        fake.wait_for(Duration::from_secs(5), |s| s.aborted.load(SeqCst) == 1 && s.active.load(SeqCst) == 0).await,
        "the engine saw the request go away"
    );
    // The driver records the end right after dropping the engine stream.
    gw.wait_for_state(&task_id, TaskState::Cancelled).await;
    let states = stored_states(&gw, &task_id).await;
    assert_eq!(states.last().map(String::as_str), Some("CANCELLED"), "{states:?}");
    let rec = gw.store().get(&task_id).await.unwrap().unwrap();
    assert_eq!(rec.error_code.as_deref(), Some("REQUEST_CANCELLED"));
    assert_eq!(rec.transitions.last().unwrap().actor, "client");
    gw.stop().await;
}

#[tokio::test]
async fn client_disconnect_while_waiting_for_a_non_streamed_answer_cancels() {
    let knobs = Knobs::slow(1000, 20);
    let (fake, gw) = gateway_with(knobs, "").await;
    let url = format!("{}/v1/chat/completions", gw.base_url);
    let call =
        tokio::spawn(async move { client().post(url).bearer_auth(DEMO_KEY).json(&chat_body(false)).send().await });
    assert!(fake.wait_for(Duration::from_secs(5), |s| s.active.load(SeqCst) == 1).await);
    call.abort();
    assert!(fake.wait_for(Duration::from_secs(5), |s| s.aborted.load(SeqCst) == 1).await, "engine request aborted");
    gw.stop().await;
}

#[tokio::test]
async fn engine_errors_do_not_leak_engine_text() {
    let knobs = Knobs { fail_status: Some(500), ..Knobs::default() };
    let (_fake, gw) = gateway_with(knobs, "").await;
    let resp = post_chat(&gw, DEMO_KEY, &chat_body(false)).await;
    assert_eq!(resp.status(), 500);
    let text = resp.text().await.unwrap();
    assert!(!text.contains("secret internal detail"), "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(error_code(&v), "INTERNAL_ERROR");
    assert_eq!(v["edge"]["status"], "FAILED");
    gw.stop().await;
}

#[tokio::test]
async fn mid_stream_engine_drop_ends_the_stream_with_an_error() {
    let knobs = Knobs { tokens: 10, drop_after: Some(3), ..Knobs::default() };
    let (_fake, gw) = gateway_with(knobs, "").await;
    let (events, done) = read_sse(post_chat(&gw, DEMO_KEY, &chat_body(true)).await).await;
    assert!(!done);
    let last = events.last().unwrap();
    assert_eq!(error_code(last), "INTERNAL_ERROR");
    assert_eq!(last["edge"]["status"], "FAILED");
    gw.stop().await;
}

#[tokio::test]
async fn a_down_engine_makes_the_model_unavailable_until_it_recovers() {
    let (fake, gw) = gateway_with(Knobs::default(), "").await;
    fake.set(|k| k.healthy = false);
    until_snapshot(&gw, "the instance out of dispatch", |s| !s.instances[0].up).await;
    let resp = post_chat(&gw, DEMO_KEY, &chat_body(false)).await;
    assert_eq!(resp.status(), 503);
    assert_eq!(error_code(&resp.json().await.unwrap()), "MODEL_UNAVAILABLE");
    let ready = client().get(format!("{}/ready", gw.base_url)).send().await.unwrap();
    assert_eq!(ready.status(), 503);
    fake.set(|k| k.healthy = true);
    gw.wait_ready().await;
    assert_eq!(post_chat(&gw, DEMO_KEY, &chat_body(false)).await.status(), 200);
    gw.stop().await;
}

#[tokio::test]
async fn waiting_work_ends_model_unavailable_when_the_last_instance_goes_down() {
    let (fake, gw) = one_slot_gateway(Knobs::slow(100, 50), "").await;
    let _blocker = hold_slot(&gw).await;
    let waiting = tokio::spawn({
        let url = format!("{}/v1/chat/completions", gw.base_url);
        async move {
            let r = client().post(url).bearer_auth(DEMO_KEY).json(&chat_body(false)).send().await.unwrap();
            (r.status(), r.json::<Value>().await.unwrap())
        }
    });
    until_snapshot(&gw, "1 waiting", |s| s.queues[0].waiting == 1).await;
    fake.set(|k| k.healthy = false);
    // Well before its 30 s queue timeout.
    let (status, v) = tokio::time::timeout(Duration::from_secs(10), waiting).await.expect("answered").unwrap();
    assert_eq!(status, 503, "{v}");
    assert_eq!(error_code(&v), "MODEL_UNAVAILABLE");
    assert_eq!(fake.stats.requests.load(SeqCst), 1, "only the blocker reached the engine");
    gw.stop().await;
}

#[tokio::test]
async fn higher_priority_waiting_work_runs_first() {
    let (_fake, gw) = one_slot_gateway(Knobs::slow(3, 100), "").await;
    let blocker = hold_slot(&gw).await;
    let send = |key: &'static str, prio: &'static str| {
        let url = format!("{}/v1/chat/completions", gw.base_url);
        let mut body = chat_body(false);
        body["priority"] = json!(prio);
        tokio::spawn(async move {
            let v: Value = client().post(url).bearer_auth(key).json(&body).send().await.unwrap().json().await.unwrap();
            v
        })
    };
    let low = send(DEMO_KEY, "P4");
    until_snapshot(&gw, "1 waiting", |s| s.queues[0].waiting == 1).await;
    let high = send(OPS_KEY, "P0");
    until_snapshot(&gw, "2 waiting", |s| s.queues[0].waiting == 2).await;
    drop(blocker);
    let (low, high) = (low.await.unwrap(), high.await.unwrap());
    let low_dispatch = low["edge"]["timing"]["queue_ms"].as_u64().unwrap();
    let high_dispatch = high["edge"]["timing"]["queue_ms"].as_u64().unwrap();
    // P0 arrived later but was dispatched first, so it waited less.
    assert!(high_dispatch < low_dispatch, "P0 queue {high_dispatch} ms, P4 queue {low_dispatch} ms");
    gw.stop().await;
}

#[tokio::test]
async fn a_streamed_answer_that_waits_shows_its_queue_position_in_sse_comments() {
    let (_fake, gw) = one_slot_gateway(Knobs::slow(10, 50), "[scheduler]\nqueue_update_ms = 20").await;
    let blocker = hold_slot(&gw).await;
    let mut low = chat_body(true);
    low["priority"] = json!("P4");
    let low = post_chat(&gw, DEMO_KEY, &low).await;
    // An alarm arrives: the P4 request is no longer next.
    let mut high = chat_body(false);
    high["priority"] = json!("P0");
    let high = tokio::spawn({
        let url = format!("{}/v1/chat/completions", gw.base_url);
        async move { client().post(url).bearer_auth(OPS_KEY).json(&high).send().await.unwrap().status() }
    });
    until_snapshot(&gw, "the P4 and the P0 request queued", |s| s.queues[0].waiting == 2).await;
    // …and a position update has reached the client (every 20 ms here).
    let mut low = low;
    let mut raw = String::new();
    while !raw.contains("\n\n: queued position 1\n\n") {
        let chunk = low.chunk().await.unwrap().expect("the stream goes on while queued");
        raw.push_str(&String::from_utf8_lossy(&chunk));
    }
    drop(blocker);
    raw.push_str(&low.text().await.unwrap());
    assert!(raw.contains("\n\n: queued position 1\n\n"), "{raw}");
    // The comment changes nothing for an SSE reader.
    let frames: Vec<&str> = raw.split("\n\n").filter(|f| f.starts_with("data: ")).collect();
    assert_eq!(frames.last(), Some(&"data: [DONE]"));
    assert!(frames.iter().filter(|f| f.contains("\"content\":\"tok \"")).count() == 10, "{raw}");
    assert_eq!(high.await.unwrap(), 200);
    gw.stop().await;
}

#[tokio::test]
async fn operational_endpoints() {
    let (_fake, gw) = gateway_with(Knobs::default(), "").await;
    let c = client();
    assert_eq!(post_chat(&gw, DEMO_KEY, &chat_body(false)).await.status(), 200);
    let h: Value = c.get(format!("{}/health", gw.base_url)).send().await.unwrap().json().await.unwrap();
    assert_eq!(h["status"], "ok");
    let r = c.get(format!("{}/ready", gw.base_url)).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let r: Value = r.json().await.unwrap();
    assert_eq!(r["ready"], true);
    let m = c.get(format!("{}/metrics", gw.base_url)).bearer_auth(OPS_KEY).send().await.unwrap().text().await.unwrap();
    for needle in [
        "edgeway_requests_total{ingress=\"http\",outcome=\"ok\"} 1",
        "edgeway_tokens_total{direction=\"output\",model=\"general-chat\"} 5",
        "edgeway_first_token_seconds_bucket",
        "edgeway_queue_wait_seconds_bucket",
        "edgeway_engine_up{engine=\"fake\"} 1",
    ] {
        assert!(m.contains(needle), "metrics lack {needle}:\n{m}");
    }
    let nf = c.get(format!("{}/v2/nothing", gw.base_url)).send().await.unwrap();
    assert_eq!(nf.status(), 404);
    gw.stop().await;
}

#[tokio::test]
async fn output_budget_is_capped_and_reported_as_degraded() {
    let (fake, gw) = gateway_with(Knobs { tokens: 500, ..Knobs::default() }, "").await;
    let mut body = chat_body(false);
    body["max_tokens"] = json!(100_000);
    let v: Value = post_chat(&gw, DEMO_KEY, &body).await.json().await.unwrap();
    assert_eq!(v["edge"]["degraded"], true);
    assert!(v["edge"]["degrade_reason"].as_str().unwrap().contains("256"));
    let sent = fake.stats.last_request.lock().unwrap().clone().unwrap();
    assert_eq!(sent["max_tokens"], 256);
    gw.stop().await;
}

#[tokio::test]
async fn ollama_engines_serve_the_same_api() {
    let fake = FakeEngine::start().await;
    let gw = TestGateway::with_engine(&fake.url(), "ollama", "").await;
    gw.wait_ready().await;
    let v: Value = post_chat(&gw, DEMO_KEY, &chat_body(false)).await.json().await.unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], "tok tok tok tok tok ");
    assert_eq!(v["edge"]["actual_model"], "fake/fake");
    let (events, done) = read_sse(post_chat(&gw, DEMO_KEY, &chat_body(true)).await).await;
    assert!(done);
    assert_eq!(events.last().unwrap()["edge"]["usage"]["output_tokens"], 5);
    gw.stop().await;
}

#[tokio::test]
async fn an_idempotent_repeat_joins_the_first_task_and_never_runs_twice() {
    let knobs = Knobs::slow(6, 30);
    let (fake, gw) = gateway_with(knobs, "").await;
    let mut body = chat_body(false);
    body["idempotency_key"] = json!("order-42");
    let mut events = gw.recorder().subscribe();
    let (a, b) = tokio::join!(post_chat(&gw, DEMO_KEY, &body), async {
        // The repeat arrives while the first call's task runs.
        next_event(&mut events, "the first task running", |e| e.state == TaskState::Running).await;
        post_chat(&gw, DEMO_KEY, &body).await
    });
    let (a, b): (Value, Value) = (a.json().await.unwrap(), b.json().await.unwrap());
    assert_eq!(a["edge"]["task_id"], b["edge"]["task_id"]);
    assert_eq!(a["choices"][0]["message"]["content"], b["choices"][0]["message"]["content"]);
    // A repeat after the end gets the same result too.
    let c: Value = post_chat(&gw, DEMO_KEY, &body).await.json().await.unwrap();
    assert_eq!(c["edge"]["task_id"], a["edge"]["task_id"]);
    assert_eq!(fake.stats.requests.load(SeqCst), 1, "one inference");
    // The same key with another prompt is refused; another application's
    // key space is its own.
    body["messages"] = json!([{"role": "user", "content": "something else"}]);
    let d = post_chat(&gw, DEMO_KEY, &body).await;
    assert_eq!(d.status(), 400);
    assert_eq!(error_code(&d.json().await.unwrap()), "INVALID_REQUEST");
    let e: Value = post_chat(&gw, OPS_KEY, &body).await.json().await.unwrap();
    assert_eq!(e["edge"]["status"], "SUCCEEDED");
    assert_eq!(fake.stats.requests.load(SeqCst), 2);
    gw.stop().await;
}

/// Many first calls with one key at the same instant (a device's retry
/// storm): whichever way each is found (the gateway's look-up, or the
/// scheduler's atomic insert when two pass the look-up together), they are
/// one task and one inference.
#[tokio::test]
async fn simultaneous_first_calls_with_one_key_are_one_task() {
    let (fake, gw) = gateway_with(Knobs::slow(4, 20), "").await;
    let mut body = chat_body(false);
    body["idempotency_key"] = json!("storm-1");
    let calls = (0..8).map(|_| post_chat(&gw, DEMO_KEY, &body));
    let answers = futures::future::join_all(calls).await;
    let mut ids = std::collections::HashSet::new();
    for a in answers {
        assert_eq!(a.status(), 200);
        let v: Value = a.json().await.unwrap();
        assert_eq!(v["edge"]["status"], "SUCCEEDED", "{v}");
        ids.insert(v["edge"]["task_id"].as_str().unwrap().to_string());
    }
    assert_eq!(ids.len(), 1, "{ids:?}");
    assert_eq!(fake.stats.requests.load(SeqCst), 1, "one inference");
    gw.stop().await;
}

#[tokio::test]
async fn an_engine_that_keeps_running_a_cancelled_request_is_taken_out_of_dispatch() {
    let knobs =
        Knobs { tokens: 80, token_delay: Duration::from_millis(25), ignore_disconnect: true, ..Knobs::default() };
    let (fake, gw) = gateway_with(knobs, "[resources]\ncancel_grace_period_ms = 100\ngpu = false").await;
    let mut resp = post_chat(&gw, DEMO_KEY, &chat_body(true)).await;
    resp.chunk().await.unwrap();
    resp.chunk().await.unwrap();
    drop(resp);
    // After the grace period the engine still runs it: out of dispatch.
    let mut down = false;
    for _ in 0..200 {
        let s = gw.scheduler().snapshot().await.unwrap();
        if !s.instances[0].up {
            assert!(s.instances[0].detail.contains("after a cancel"), "{}", s.instances[0].detail);
            down = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(down, "instance stayed in dispatch");
    // New work queues meanwhile (the instance is healthy, only busy) and is
    // sent once the engine has finished the cancelled request.
    let body = chat_body(false);
    let mut events = gw.recorder().subscribe();
    let (resp, meanwhile) = tokio::join!(post_chat(&gw, DEMO_KEY, &body), async {
        next_event(&mut events, "the new task queued", |e| e.state == TaskState::Queued).await;
        // Time itself is tested here: queued, it is not sent for a while.
        tokio::time::sleep(Duration::from_millis(200)).await;
        (fake.stats.active.load(SeqCst), fake.stats.requests.load(SeqCst))
    });
    assert_eq!(meanwhile, (1, 1), "(running, received) while the engine still runs the cancelled request");
    assert_eq!(resp.status(), 200);
    assert_eq!(fake.stats.requests.load(SeqCst), 2);
    gw.stop().await;
}

#[tokio::test]
async fn new_work_waits_while_the_engine_reports_a_full_kv_cache() {
    let knobs = Knobs::slow(1000, 20);
    let (fake, gw) = gateway_with(knobs, "").await;
    // One task of ours runs (for about 20 s), leaving a slot free.
    let mut first = post_chat(&gw, DEMO_KEY, &chat_body(true)).await;
    first.chunk().await.unwrap();
    fake.set(|k| k.metrics = Some(edgeway::testing::vllm_metrics(0.99)));
    until_snapshot(&gw, "the engine's KV cache at its high-water mark", |s| s.instances[0].kv_cache_full).await;
    let m = client()
        .get(format!("{}/metrics", gw.base_url))
        .bearer_auth(OPS_KEY)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let gauge = "edgeway_engine_kv_cache_usage_ratio{engine=\"fake\"} 0.99";
    assert!(m.contains(gauge), "metrics lack {gauge}:\n{m}");
    let ready: Value =
        client().get(format!("{}/ready", gw.base_url)).bearer_auth(OPS_KEY).send().await.unwrap().json().await.unwrap();
    assert_eq!(ready["instances"][0]["kv_cache_usage"], 0.99);

    let mut body = chat_body(false);
    body["max_tokens"] = json!(2);
    let (resp, ()) = tokio::join!(post_chat(&gw, DEMO_KEY, &body), async {
        // The second task queues although a slot is free…
        until_snapshot(&gw, "the second task waiting", |s| s.queues[0].waiting == 1).await;
        // …and stays there over several probes (every 100 ms) while the
        // reading holds: time itself is tested here.
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(fake.stats.requests.load(SeqCst), 1, "sent to an engine that reports a full KV cache");
        assert_eq!(gw.scheduler().snapshot().await.unwrap().queues[0].waiting, 1);
        fake.set(|k| k.metrics = Some(edgeway::testing::vllm_metrics(0.2)));
    });
    assert_eq!(resp.status(), 200);
    assert_eq!(fake.stats.requests.load(SeqCst), 2);
    // It went because the cache had room again, not because ours ended.
    assert_eq!(fake.active(), 1, "the first task still runs");
    drop(first);
    // An engine that stops reporting (no /metrics: 404) sets no limit.
    fake.set(|k| k.metrics = None);
    until_snapshot(&gw, "no KV reading", |s| s.instances[0].kv_cache_usage.is_none()).await;
    let m = client()
        .get(format!("{}/metrics", gw.base_url))
        .bearer_auth(OPS_KEY)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(!m.contains("edgeway_engine_kv_cache_usage_ratio{"), "a stale gauge stays:\n{m}");
    gw.stop().await;
}

#[tokio::test]
async fn a_danger_state_stops_admission_and_cancels_low_priority_work() {
    let knobs = Knobs::slow(1000, 20);
    let (fake, gw) = gateway_with(knobs, "").await;
    let mut low = chat_body(true);
    low["priority"] = json!("P3");
    let mut resp = post_chat(&gw, DEMO_KEY, &low).await;
    resp.chunk().await.unwrap();
    let sched = gw.scheduler();
    // What the GPU watch does on a reading over the limits.
    sched.set_danger(Some("GPU 0 at 95 °C (limit 90 °C)".into()));
    let n = sched.cancel_where(|e| e.priority >= edgeway::task::Priority::P3, "danger state: GPU 0 at 95 °C");
    assert_eq!(n, 1);
    let (events, _) = read_sse(resp).await;
    assert_eq!(error_code(events.last().unwrap()), "REQUEST_CANCELLED");
    assert!(fake.wait_for(Duration::from_secs(5), |s| s.active.load(SeqCst) == 0).await);
    let r = post_chat(&gw, OPS_KEY, &chat_body(false)).await;
    assert_eq!(r.status(), 503);
    let v: Value = r.json().await.unwrap();
    assert_eq!(error_code(&v), "RESOURCE_EXHAUSTED");
    assert!(v["error"]["message"].as_str().unwrap().contains("95 °C"));
    sched.set_danger(None);
    assert_eq!(post_chat(&gw, OPS_KEY, &chat_body(false)).await.status(), 200);
    gw.stop().await;
}

#[tokio::test]
async fn per_user_rates_answer_rate_limited_and_quota_exceeded() {
    let fake = FakeEngine::start().await;
    let gw = TestGateway::with_engine_edit(&fake.url(), "openai", "", |t| {
        t.replace(
            "default_priority = \"P2\"",
            "default_priority = \"P2\"\nuser_requests_per_minute = 2\nuser_tokens_per_minute = 1500",
        )
    })
    .await;
    gw.wait_ready().await;
    let mut body = chat_body(false);
    body["metadata"] = json!({"user_id": "alice"});
    body["max_tokens"] = json!(10);
    for _ in 0..2 {
        assert_eq!(post_chat(&gw, DEMO_KEY, &body).await.status(), 200);
    }
    let r = post_chat(&gw, DEMO_KEY, &body).await;
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["retry-after"], "30");
    assert_eq!(error_code(&r.json().await.unwrap()), "RATE_LIMITED");
    // Bob has his own budget, but not enough tokens for a huge answer.
    body["metadata"] = json!({"user_id": "bob"});
    body["max_tokens"] = json!(250);
    assert_eq!(post_chat(&gw, DEMO_KEY, &body).await.status(), 200);
    let big = json!({"model": "general-chat", "metadata": {"user_id": "bob"}, "max_tokens": 250,
        "messages": [{"role": "user", "content": "x".repeat(6000)}]});
    let r = post_chat(&gw, DEMO_KEY, &big).await;
    assert_eq!(r.status(), 429);
    assert_eq!(error_code(&r.json().await.unwrap()), "QUOTA_EXCEEDED");
    gw.stop().await;
}

#[tokio::test]
async fn revoking_a_key_refuses_it_and_cancels_its_tasks() {
    let knobs = Knobs::slow(1000, 20);
    let (fake, gw) = gateway_with(knobs, "").await;
    let mut resp = post_chat(&gw, DEMO_KEY, &chat_body(true)).await;
    resp.chunk().await.unwrap();
    // Another key's task, which must go on.
    let mut other = post_chat(&gw, OPS_KEY, &chat_body(true)).await;
    other.chunk().await.unwrap();
    let url = format!("{}/admin/keys/revoke", gw.base_url);
    let denied = client().post(&url).bearer_auth(DEMO_KEY).json(&json!({"api_key": OPS_KEY})).send().await.unwrap();
    assert_eq!(denied.status(), 403, "only admins revoke");
    let r: Value = client()
        .post(&url)
        .bearer_auth(OPS_KEY)
        .json(&json!({"api_key": DEMO_KEY}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(r["cancelled_tasks"], 1);
    let (events, _) = read_sse(resp).await;
    let last = events.last().unwrap();
    assert_eq!(error_code(last), "REQUEST_CANCELLED");
    assert!(fake.wait_for(Duration::from_secs(5), |s| s.active.load(SeqCst) == 1).await, "engine stopped it");
    let again = post_chat(&gw, DEMO_KEY, &chat_body(false)).await;
    assert_eq!(again.status(), 401);
    assert!(again.text().await.unwrap().contains("revoked"));
    // The other key's stream still flows.
    for _ in 0..3 {
        let chunk = other.chunk().await.unwrap().expect("the ops task still streams");
        assert!(!String::from_utf8_lossy(&chunk).contains("\"error\""));
    }
    gw.stop().await;
}

#[tokio::test]
async fn revoking_a_token_id_refuses_that_token_cancels_its_tasks_and_survives_a_restart() {
    use jsonwebtoken::{encode, Algorithm, EncodingKey, Header};
    const SECRET: &str = "a-test-hs256-secret-of-32-bytes!";
    let fake = FakeEngine::start_with(Knobs::slow(1000, 20)).await;
    let dir = edgeway::testing::TempDir::new("edgeway-jti");
    let extra = "[auth.jwt]\nhs256_secret_env = \"S\"\nissuer = \"https://auth.test\"\naudience = \"edgeway\"\n";
    let text = edgeway::testing::config_toml(&fake.url(), "openai", &dir.0, extra);
    let load = || {
        let env = [("S".to_string(), SECRET.to_string())];
        edgeway::config::Config::from_toml_str(&text, env, std::path::Path::new(".")).unwrap()
    };
    let token = |jti: &str| {
        let exp = edgeway::task::now_ms() / 1000 + 600;
        let claims = json!({"sub": "alice", "app": "demo", "tenant": "demo", "iss": "https://auth.test",
            "aud": "edgeway", "exp": exp, "jti": jti});
        encode(&Header::new(Algorithm::HS256), &claims, &EncodingKey::from_secret(SECRET.as_bytes()).unwrap()).unwrap()
    };
    let admin = |gw: &TestGateway, what: &str, body: Value| {
        let url = format!("{}/admin/keys/{what}", gw.base_url);
        async move { client().post(url).bearer_auth(OPS_KEY).json(&body).send().await.unwrap() }
    };

    let gw = TestGateway::start(load()).await;
    gw.wait_ready().await;
    let mut running = post_chat(&gw, &token("session-1"), &chat_body(true)).await;
    assert_eq!(running.status(), 200);
    running.chunk().await.unwrap();
    let r = admin(&gw, "revoke", json!({"jti": "session-1"})).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Value>().await.unwrap()["cancelled_tasks"], 1);
    let (events, _) = read_sse(running).await;
    assert_eq!(error_code(events.last().unwrap()), "REQUEST_CANCELLED");
    let refused = post_chat(&gw, &token("session-1"), &chat_body(false)).await;
    assert_eq!(refused.status(), 401);
    let v: Value = refused.json().await.unwrap();
    assert_eq!(error_code(&v), "AUTH_FAILED");
    assert_eq!(v["error"]["message"], "this token has been revoked");
    let other = client().get(format!("{}/v1/models", gw.base_url)).bearer_auth(token("session-2")).send().await;
    assert_eq!(other.unwrap().status(), 200, "another token id is not affected");
    assert_eq!(admin(&gw, "revoke", json!({"jti": ""})).await.status(), 400);
    gw.stop().await;

    let gw = TestGateway::start(load()).await;
    let models = |t: String| {
        let url = format!("{}/v1/models", gw.base_url);
        async move { client().get(url).bearer_auth(t).send().await.unwrap().status() }
    };
    assert_eq!(models(token("session-1")).await, 401, "still revoked after the restart");
    let v: Value = admin(&gw, "reinstate", json!({"jti": "session-1"})).await.json().await.unwrap();
    assert_eq!(v["was_revoked"], true);
    assert_eq!(models(token("session-1")).await, 200);
    gw.stop().await;
}

#[tokio::test]
async fn on_the_business_port_metrics_and_ready_details_need_an_admin_key() {
    let (_fake, gw) = gateway_with(Knobs::default(), "").await;
    let get = |path: &str, key: Option<&str>| {
        let mut r = client().get(format!("{}{path}", gw.base_url));
        if let Some(k) = key {
            r = r.bearer_auth(k);
        }
        async move {
            let r = r.send().await.unwrap();
            (r.status().as_u16(), r.text().await.unwrap())
        }
    };
    // Open for load balancers: liveness and the bare readiness.
    assert_eq!(get("/health", None).await.0, 200);
    let (status, body) = get("/ready", None).await;
    assert_eq!((status, serde_json::from_str::<Value>(&body).unwrap()), (200, json!({"ready": true})));
    // The details and the metrics: admins only.
    let (status, body) = get("/ready", Some(OPS_KEY)).await;
    assert_eq!(status, 200);
    assert!(serde_json::from_str::<Value>(&body).unwrap()["instances"].is_array(), "{body}");
    for (key, want) in [(None, 401), (Some("sk-wrong"), 401), (Some(DEMO_KEY), 403)] {
        let (status, body) = get("/metrics", key).await;
        assert_eq!(status, want, "{key:?}: {body}");
        assert!(!body.contains("edgeway_"), "{body}");
    }
    assert_eq!(get("/ready", Some(DEMO_KEY)).await.0, 403);
    let (status, body) = get("/metrics", Some(OPS_KEY)).await;
    assert_eq!(status, 200);
    assert!(body.contains("edgeway_engine_up"), "{body}");
    gw.stop().await;
}

#[tokio::test]
async fn on_the_admin_port_operational_endpoints_stay_open_and_leave_the_business_port() {
    let fake = FakeEngine::start().await;
    let gw = TestGateway::with_engine_edit(&fake.url(), "openai", "", |t| {
        t.replacen("[http]\n", "[http]\nadmin_listen = \"127.0.0.1:0\"\n", 1)
    })
    .await;
    gw.wait_ready().await;
    let admin = format!("http://{}", gw.running.as_ref().unwrap().admin_addr.unwrap());
    let m = client().get(format!("{admin}/metrics")).send().await.unwrap();
    assert_eq!(m.status(), 200);
    let r: Value = client().get(format!("{admin}/ready")).send().await.unwrap().json().await.unwrap();
    assert!(r["instances"].is_array(), "{r}");
    let m = client().get(format!("{}/metrics", gw.base_url)).bearer_auth(OPS_KEY).send().await.unwrap();
    assert_eq!(m.status(), 404);
    gw.stop().await;
}
