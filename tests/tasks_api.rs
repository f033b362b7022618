//! The task API: submit and walk away, look up, cancel, follow events with
//! resume, ownership.

mod common;

use std::sync::atomic::Ordering::SeqCst;
use std::time::Duration;

use common::*;
use futures::StreamExt;
use serde_json::Value;

async fn setup(knobs: Knobs) -> (FakeEngine, TestGateway) {
    let fake = FakeEngine::start_with(knobs).await;
    let gw = TestGateway::with_engine(&fake.url(), "openai", "").await;
    gw.wait_ready().await;
    (fake, gw)
}

async fn create(gw: &TestGateway, key: &str, body: &Value) -> reqwest::Response {
    client().post(format!("{}/v1/tasks", gw.base_url)).bearer_auth(key).json(body).send().await.unwrap()
}

async fn get(gw: &TestGateway, key: &str, id: &str) -> reqwest::Response {
    client().get(format!("{}/v1/tasks/{id}", gw.base_url)).bearer_auth(key).send().await.unwrap()
}

/// The task as `GET /v1/tasks/{id}` shows it once it has been recorded in
/// `want`.
async fn wait_status(gw: &TestGateway, id: &str, want: TaskState) -> Value {
    gw.wait_for_state(id, want).await;
    let v: Value = get(gw, DEMO_KEY, id).await.json().await.unwrap();
    assert_eq!(v["status"], want.as_str(), "{v}");
    v
}

/// Reads SSE frames `(id, event, data)` until `n` frames or the end.
async fn sse_frames(resp: reqwest::Response, n: usize) -> Vec<(u64, String, Value)> {
    let mut out = Vec::new();
    let mut buf = String::new();
    let mut body = resp.bytes_stream();
    while out.len() < n {
        let Some(chunk) = body.next().await else { break };
        buf.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
        while let Some(pos) = buf.find("\n\n") {
            let frame: String = buf.drain(..pos + 2).collect();
            let (mut id, mut ev, mut data) = (0, String::new(), Value::Null);
            for line in frame.lines() {
                if let Some(v) = line.strip_prefix("id: ") {
                    id = v.parse().unwrap();
                } else if let Some(v) = line.strip_prefix("event: ") {
                    ev = v.to_string();
                } else if let Some(v) = line.strip_prefix("data: ") {
                    data = serde_json::from_str(v).unwrap();
                }
            }
            out.push((id, ev, data));
        }
    }
    out
}

#[tokio::test]
async fn a_submitted_task_runs_without_a_connection_and_can_be_looked_up() {
    let (_fake, gw) = setup(Knobs::default()).await;
    let resp = create(&gw, DEMO_KEY, &chat_body(false)).await;
    assert_eq!(resp.status(), 202);
    let v: Value = resp.json().await.unwrap();
    let id = v["task_id"].as_str().unwrap().to_string();
    assert_eq!(v["links"]["events"], format!("/v1/tasks/{id}/events"));
    let t = wait_status(&gw, &id, TaskState::Succeeded).await;
    assert_eq!(t["edge"]["usage"]["output_tokens"], 5);
    let states: Vec<&str> = t["transitions"].as_array().unwrap().iter().map(|t| t["state"].as_str().unwrap()).collect();
    assert_eq!(states, ["RECEIVED", "VALIDATING", "QUEUED", "DISPATCHING", "RUNNING", "STREAMING", "SUCCEEDED"]);
    assert!(t["transitions"][0]["at_ms"].is_i64());
    assert_eq!(t["result_text"], Value::Null, "the default data policy stores no text");
    gw.stop().await;
}

#[tokio::test]
async fn only_the_owner_sees_or_cancels_a_task() {
    let knobs = Knobs::slow(1000, 20);
    let (fake, gw) = setup(knobs).await;
    // `demo` submits; `ops` is an admin of the same tenant; a third key is
    // unknown.
    let v: Value = create(&gw, DEMO_KEY, &chat_body(false)).await.json().await.unwrap();
    let id = v["task_id"].as_str().unwrap().to_string();
    assert_eq!(get(&gw, "sk-wrong", &id).await.status(), 401);
    assert_eq!(get(&gw, OPS_KEY, &id).await.status(), 200, "admin of the tenant");
    assert!(fake.wait_for(Duration::from_secs(5), |s| s.active.load(SeqCst) == 1).await);
    let del = client().delete(format!("{}/v1/tasks/{id}", gw.base_url)).bearer_auth(DEMO_KEY).send().await.unwrap();
    assert_eq!(del.status(), 202);
    assert!(fake.wait_for(Duration::from_secs(5), |s| s.aborted.load(SeqCst) == 1).await, "engine stopped");
    let t = wait_status(&gw, &id, TaskState::Cancelled).await;
    assert_eq!(t["error_code"], "REQUEST_CANCELLED");
    let again = client().delete(format!("{}/v1/tasks/{id}", gw.base_url)).bearer_auth(DEMO_KEY).send().await.unwrap();
    assert_eq!(again.status(), 409, "already ended");
    assert_eq!(get(&gw, DEMO_KEY, "no-such-task").await.status(), 404);
    gw.stop().await;
}

#[tokio::test]
async fn cancelling_a_queued_task_never_reaches_the_engine() {
    let knobs = Knobs::slow(1000, 20);
    let (fake, gw) = setup(knobs).await;
    let mut ids = Vec::new();
    for _ in 0..3 {
        let v: Value = create(&gw, DEMO_KEY, &chat_body(false)).await.json().await.unwrap();
        ids.push(v["task_id"].as_str().unwrap().to_string());
    }
    assert!(fake.wait_for(Duration::from_secs(5), |s| s.active.load(SeqCst) == 2).await);
    let del =
        client().delete(format!("{}/v1/tasks/{}", gw.base_url, ids[2])).bearer_auth(DEMO_KEY).send().await.unwrap();
    assert_eq!(del.status(), 202);
    let t = wait_status(&gw, &ids[2], TaskState::Cancelled).await;
    let states: Vec<&str> = t["transitions"].as_array().unwrap().iter().map(|t| t["state"].as_str().unwrap()).collect();
    assert_eq!(states, ["RECEIVED", "VALIDATING", "QUEUED", "CANCELLED"]);
    assert_eq!(fake.stats.requests.load(SeqCst), 2);
    for id in &ids[..2] {
        client().delete(format!("{}/v1/tasks/{id}", gw.base_url)).bearer_auth(DEMO_KEY).send().await.unwrap();
    }
    gw.stop().await;
}

#[tokio::test]
async fn events_resume_from_last_event_id() {
    let knobs = Knobs::slow(8, 30);
    let (_fake, gw) = setup(knobs).await;
    let v: Value = create(&gw, DEMO_KEY, &chat_body(false)).await.json().await.unwrap();
    let id = v["task_id"].as_str().unwrap().to_string();
    let url = format!("{}/v1/tasks/{id}/events", gw.base_url);
    // Read three events, then drop the connection (the task goes on).
    let first = sse_frames(client().get(&url).bearer_auth(DEMO_KEY).send().await.unwrap(), 3).await;
    assert_eq!(first.iter().map(|f| f.0).collect::<Vec<_>>(), [0, 1, 2]);
    assert_eq!(first[0].1, "accepted");
    assert_eq!(first[1].1, "delta");
    let rest = sse_frames(
        client().get(&url).bearer_auth(DEMO_KEY).header("Last-Event-ID", "2").send().await.unwrap(),
        usize::MAX,
    )
    .await;
    let seqs: Vec<u64> = rest.iter().map(|f| f.0).collect();
    assert_eq!(seqs, (3..=9).collect::<Vec<_>>(), "contiguous after 2, through the end");
    let last = rest.last().unwrap();
    assert_eq!(last.1, "done");
    assert_eq!(last.2["result"]["status"], "SUCCEEDED");
    assert_eq!(last.2["result"]["usage"]["output_tokens"], 8);
    // Another application cannot follow it.
    let denied = client().get(&url).bearer_auth("sk-wrong").send().await.unwrap();
    assert_eq!(denied.status(), 401);
    let bad = client().get(&url).bearer_auth(DEMO_KEY).header("Last-Event-ID", "x").send().await.unwrap();
    assert_eq!(bad.status(), 400);
    gw.stop().await;
}

#[tokio::test]
async fn a_p0_task_overtakes_a_p4_backlog_when_a_slot_frees() {
    let knobs = Knobs::slow(10, 30);
    let (_fake, gw) = setup(knobs).await;
    let mut p4 = chat_body(false);
    p4["priority"] = serde_json::json!("P4");
    let mut ids = Vec::new();
    for _ in 0..6 {
        let v: Value = create(&gw, DEMO_KEY, &p4).await.json().await.unwrap();
        ids.push(v["task_id"].as_str().unwrap().to_string());
    }
    let mut p0 = chat_body(false);
    p0["priority"] = serde_json::json!("P0");
    let v: Value = create(&gw, OPS_KEY, &p0).await.json().await.unwrap();
    let alarm = v["task_id"].as_str().unwrap().to_string();
    gw.wait_for_state(&alarm, TaskState::Succeeded).await;
    let t: Value = get(&gw, OPS_KEY, &alarm).await.json().await.unwrap();
    assert_eq!(t["status"], "SUCCEEDED", "{t}");
    gw.stop().await;
}

/// A caller that goes away while its call is being queued (the submit
/// future dropped at its one wait, for the scheduler's answer) leaves
/// nothing behind: its record ends REJECTED, nothing waits in a queue, the
/// registry has forgotten it, and the engine never sees it.
#[tokio::test]
async fn a_submit_dropped_while_queueing_leaves_nothing_behind() {
    use edgeway::gateway::{Caller, SubmitOptions};
    use edgeway::task::Ingress;
    let (fake, gw) = setup(Knobs::default()).await;
    let body = serde_json::json!({
        "model": "general-chat",
        "request_id": "gone-1",
        "messages": [{"role": "user", "content": "hi"}],
    });
    let bytes = serde_json::to_vec(&body).unwrap();
    let mut lifecycle = gw.recorder().subscribe();
    {
        let submit =
            gw.gateway().submit(Caller::Credential(Some(DEMO_KEY)), &bytes, Ingress::Http, SubmitOptions::default());
        tokio::pin!(submit);
        // The test runtime has one thread: the scheduler's actor cannot
        // answer during this poll, so the call stops at that wait.
        assert!(futures::poll!(&mut submit).is_pending());
    }
    let end =
        next_event(&mut lifecycle, "the dropped call's end", |e| e.request_id == "gone-1" && e.state.is_terminal())
            .await;
    assert_eq!(end.state, TaskState::Rejected);
    assert!(end.reason.contains("went away"), "{}", end.reason);
    let snapshot = gw.scheduler().snapshot().await.unwrap();
    assert!(snapshot.queues.iter().all(|q| q.waiting == 0), "{snapshot:?}");
    assert!(snapshot.instances.iter().all(|i| i.running == 0), "{snapshot:?}");
    assert!(gw.scheduler().find_by_request("demo", "demo", Ingress::Http, "gone-1").is_none());
    assert_eq!(fake.stats.requests.load(SeqCst), 0);
    gw.stop().await;
}

/// The test gateway is the suite's net for illegal transitions (the
/// recorder's debug assertion fires inside spawned tasks, which alone fails
/// no test): one counted means the test fails at `stop`.
#[tokio::test]
#[should_panic(expected = "illegal task state transitions were tried")]
async fn a_gateway_that_counted_an_illegal_transition_fails_its_test() {
    let (_fake, gw) = setup(Knobs::default()).await;
    gw.metrics().illegal_transitions.with_label_values(&["RECEIVED", "RUNNING"]).inc();
    gw.stop().await;
}

#[tokio::test]
async fn an_engines_error_text_is_neither_stored_nor_shown_only_its_status() {
    // Engines echo the prompt and their internals in error bodies.
    let (_fake, gw) = setup(Knobs {
        fail_status: Some(500),
        fail_message: "cannot continue 'my secret prompt' (model /srv/models/x.gguf)".into(),
        ..Knobs::default()
    })
    .await;
    let mut body = chat_body(false);
    body["messages"][0]["content"] = "my secret prompt".into();
    let v: Value = create(&gw, DEMO_KEY, &body).await.json().await.unwrap();
    let id = v["task_id"].as_str().unwrap().to_string();
    let t = wait_status(&gw, &id, TaskState::Failed).await;
    let reasons: Vec<&str> = t["transitions"].as_array().unwrap().iter().filter_map(|t| t["reason"].as_str()).collect();
    assert!(reasons.iter().any(|r| r.contains("engine answered 500")), "{reasons:?}");
    let events = client().get(format!("{}/v1/tasks/{id}/events", gw.base_url)).bearer_auth(DEMO_KEY).send().await;
    let events = events.unwrap().text().await.unwrap();
    for shown in [t.to_string(), events] {
        assert!(!shown.contains("secret") && !shown.contains("/srv/models"), "{shown}");
    }
    // Nor in the store file.
    gw.store().flush().await;
    let conn = rusqlite::Connection::open(gw.db_path()).unwrap();
    let stored: Vec<String> = conn
        .prepare("SELECT COALESCE(reason, '') FROM task_transitions WHERE task_id = ?1")
        .unwrap()
        .query_map([&id], |r| r.get(0))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    assert!(stored.iter().all(|r| !r.contains("secret") && !r.contains("/srv/models")), "{stored:?}");
    gw.stop().await;
}

#[tokio::test]
async fn an_engines_odd_finish_reason_is_not_shown_verbatim() {
    // An engine's own text (long, with newlines) where a finish reason
    // belongs: callers see one of the known reasons, never the text.
    let odd = format!("internal: {}\nsecret=42", "x".repeat(5000));
    let (_fake, gw) = setup(Knobs { finish_reason: Some(odd), ..Knobs::default() }).await;
    let resp = create(&gw, DEMO_KEY, &chat_body(false)).await;
    assert_eq!(resp.status(), 202);
    let id = resp.json::<Value>().await.unwrap()["task_id"].as_str().unwrap().to_string();
    let t = wait_status(&gw, &id, TaskState::Succeeded).await;
    assert_eq!(t["edge"]["finish_reason"], "other", "{}", t["edge"]);
    let text = t.to_string();
    assert!(
        !text.contains("secret") && !text.contains("xxxxxxxx"),
        "the engine's text leaked: {}",
        &text[..text.len().min(500)]
    );
    // A known reason is kept as it is.
    let (_fake2, gw2) = setup(Knobs { finish_reason: Some("tool_calls".into()), ..Knobs::default() }).await;
    let id = create(&gw2, DEMO_KEY, &chat_body(false)).await.json::<Value>().await.unwrap()["task_id"]
        .as_str()
        .unwrap()
        .to_string();
    let t = wait_status(&gw2, &id, TaskState::Succeeded).await;
    assert_eq!(t["edge"]["finish_reason"], "tool_calls");
    gw.stop().await;
    gw2.stop().await;
}
