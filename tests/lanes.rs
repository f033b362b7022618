//! The long-prompt lane (issue 11, FR-4.3 and FR-4.6) through the whole
//! gateway against a fake engine: with `[engines.*] max_prefill_tokens`,
//! long prompts wait for the lane (and their QUEUED record says so) while
//! short ones start past them, and a long prompt's first token makes room
//! for the next one while it still generates.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::*;
use serde_json::json;

/// About 430 estimated tokens (3.5 bytes a token): long, over
/// `long_prompt_tokens = 200`; two do not fit `max_prefill_tokens = 600`.
fn long_text() -> String {
    "word ".repeat(300)
}

#[tokio::test]
async fn long_prompts_wait_for_the_lane_while_short_ones_run() {
    let fake = FakeEngine::start_with(Knobs {
        tokens: 4,
        first_token_delay: Duration::from_millis(400),
        token_delay: Duration::from_millis(500),
        ..Knobs::default()
    })
    .await;
    let gw = TestGateway::with_engine_edit(&fake.url(), "openai", "", |t| {
        t.replace("max_concurrency = 2", "max_concurrency = 6\nmax_prefill_tokens = 600\nlong_prompt_tokens = 200")
    })
    .await;
    gw.wait_ready().await;
    let mut events = gw.recorder().subscribe();
    let send = |id: &str, text: String| {
        let url = gw.base_url.clone();
        let body = json!({"model": "general-chat", "max_tokens": 4, "request_id": id,
            "messages": [{"role": "user", "content": text}]});
        tokio::spawn(async move {
            client()
                .post(format!("{url}/v1/chat/completions"))
                .bearer_auth(DEMO_KEY)
                .json(&body)
                .send()
                .await
                .unwrap()
                .status()
        })
    };
    let mut calls = vec![send("long1", long_text())];
    next_event(&mut events, "long1 starts", |e| e.request_id == "long1" && e.state == TaskState::Dispatching).await;
    for id in ["long2", "long3"] {
        calls.push(send(id, long_text()));
        let queued =
            next_event(&mut events, "a long prompt queued", |e| e.request_id == id && e.state == TaskState::Queued)
                .await;
        assert!(queued.reason.contains("waits for the long-prompt lane"), "{}", queued.reason);
    }
    for id in ["short1", "short2"] {
        calls.push(send(id, "Say hello".into()));
    }
    // Everything that happens until long1 ends, in order.
    let mut seen: Vec<(String, TaskState)> = Vec::new();
    while !seen.iter().any(|(id, s)| id == "long1" && s.is_terminal()) {
        let e = next_event(&mut events, "progress", |_| true).await;
        seen.push((e.request_id.clone(), e.state));
    }
    let at = |id: &str, state: TaskState| seen.iter().position(|(i, s)| i == id && *s == state);
    let long1_first_token = at("long1", TaskState::Streaming).expect("long1 streamed");
    for id in ["short1", "short2"] {
        let started = at(id, TaskState::Dispatching).unwrap_or_else(|| panic!("{id} never started: {seen:?}"));
        assert!(started < long1_first_token, "{id} started at once, past the waiting long prompts: {seen:?}");
    }
    // long1's first token freed its prefill: one more long prompt starts
    // while long1 still generates; the last one only after that one's
    // first token (430 + 430 > 600).
    let mut longs: Vec<(usize, &str)> =
        ["long2", "long3"].iter().filter_map(|id| at(id, TaskState::Dispatching).map(|i| (i, *id))).collect();
    longs.sort();
    assert!(!longs.is_empty() && longs[0].0 > long1_first_token, "{seen:?}");
    if let [(_, first), (second_start, _)] = longs[..] {
        let first_token = at(first, TaskState::Streaming).expect("streamed");
        assert!(second_start > first_token, "{seen:?}");
    }
    let mut statuses = HashMap::new();
    for (i, c) in calls.into_iter().enumerate() {
        statuses.insert(i, c.await.unwrap().as_u16());
    }
    assert!(statuses.values().all(|&s| s == 200), "{statuses:?}");
    gw.stop().await;
}

/// Review 13 MEDIUM-4: an embedding list retried after its second call
/// failed is charged its prefill again at its new grant, and used to keep
/// that share of the lane until the whole list ended (its release was sent
/// only at the task's very first vector). Now each attempt's first vector
/// releases it, so a second long list starts while the first still runs.
#[tokio::test]
async fn a_retried_embedding_list_frees_the_lane_at_its_retrys_first_vector() {
    let chat = FakeEngine::start().await;
    let emb = FakeEngine::start_with(Knobs {
        fail_requests: vec![2],
        first_token_delay: Duration::from_millis(300),
        ..Knobs::default()
    })
    .await;
    let section = format!(
        r#"
[engines.emb]
type = "openai"
base_url = "{}"
model = "fake-embed"
max_concurrency = 4
max_prefill_tokens = 600
long_prompt_tokens = 200
health_interval_ms = 100
[models.embed]
kind = "embedding"
instances = ["emb"]
context_tokens = 8192
max_batch_inputs = 2
"#,
        emb.url()
    );
    let gw = TestGateway::with_engine(&chat.url(), "openai", &section).await;
    gw.wait_ready().await;
    let mut events = gw.recorder().subscribe();
    // Ten inputs of about 43 estimated tokens: about 430, long; two lists
    // do not fit 600.
    let inputs: Vec<String> = (0..10).map(|i| format!("{i} {}", "word ".repeat(29))).collect();
    let send = |id: &str| {
        let url = gw.base_url.clone();
        let body = json!({"model": "embed", "input": inputs});
        let id = id.to_string();
        tokio::spawn(async move {
            let r = client()
                .post(format!("{url}/v1/embeddings"))
                .bearer_auth(DEMO_KEY)
                .header("x-request-id", id)
                .json(&body)
                .send()
                .await
                .unwrap();
            r.status().as_u16()
        })
    };
    let first = send("list-a");
    // Call 2 failed, its retry answered (call 3 of the list is under way).
    assert!(emb.wait_for(Duration::from_secs(20), |s| s.requests.load(std::sync::atomic::Ordering::SeqCst) >= 4).await);
    let second = send("list-b");
    let mut seen: Vec<(String, TaskState)> = Vec::new();
    while !seen.iter().any(|(id, s)| id == "list-b" && *s == TaskState::Dispatching) {
        let e = next_event(&mut events, "list-b starts", |_| true).await;
        seen.push((e.request_id.clone(), e.state));
    }
    assert!(
        !seen.iter().any(|(id, s)| id == "list-a" && s.is_terminal()),
        "list-b waited for the whole of list-a: {seen:?}"
    );
    assert_eq!((first.await.unwrap(), second.await.unwrap()), (200, 200));
    gw.stop().await;
}
