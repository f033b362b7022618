//! `POST /v1/completions` end to end (issue 17) against fake engines on
//! real sockets: the prompt goes to the engine's own completion endpoint
//! (never a chat template), whole and streamed `text_completion` answers,
//! fields edgeway cannot honour refused, a client that goes away stops the
//! engine, and an idempotency key runs the completion once.

mod common;

use std::time::Duration;

use common::*;
use futures::StreamExt;
use serde_json::{json, Value};

async fn post(gw: &TestGateway, body: &Value, key: Option<&str>) -> reqwest::Response {
    let mut rb = client().post(format!("{}/v1/completions", gw.base_url)).bearer_auth(DEMO_KEY).json(body);
    if let Some(k) = key {
        rb = rb.header("idempotency-key", k);
    }
    rb.send().await.unwrap()
}

#[tokio::test]
async fn a_prompt_goes_to_the_completion_endpoint_and_comes_back_as_text() {
    let fake = FakeEngine::start().await;
    let gw = TestGateway::with_engine(&fake.url(), "openai", "").await;
    let resp =
        post(&gw, &json!({"model": "general-chat", "prompt": "Once upon", "max_tokens": 3, "seed": 7}), None).await;
    assert_eq!(resp.status(), 200);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["model"], "general-chat");
    assert_eq!(v["choices"][0]["text"], "tok tok tok ");
    assert_eq!(v["choices"][0]["index"], 0);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 3);
    assert_eq!(v["edge"]["status"], "SUCCEEDED");
    assert_eq!(fake.posts(), vec!["/v1/completions"]);
    let sent = fake.last_request().unwrap();
    assert_eq!(sent["prompt"], "Once upon", "the prompt as it is: {sent}");
    assert!(sent.get("messages").is_none(), "no chat template around it: {sent}");
    assert_eq!((sent["max_tokens"].as_u64(), sent["seed"].as_i64()), (Some(3), Some(7)));
    gw.stop().await;
}

#[tokio::test]
async fn a_streamed_completion_is_text_completion_chunks_then_done() {
    let fake = FakeEngine::start().await;
    let gw = TestGateway::with_engine(&fake.url(), "openai", "").await;
    let body = json!({"model": "general-chat", "prompt": ["Once"], "stream": true,
        "stream_options": {"include_usage": true}});
    let resp = post(&gw, &body, None).await;
    assert_eq!(resp.status(), 200);
    let (chunks, done) = read_sse(resp).await;
    assert!(done, "[DONE] ends it");
    let text: String = chunks.iter().filter_map(|c| c["choices"][0]["text"].as_str()).collect();
    assert_eq!(text, "tok ".repeat(5));
    assert!(chunks.iter().all(|c| c["object"] == "text_completion"), "{chunks:?}");
    let finish: Vec<_> = chunks.iter().filter_map(|c| c["choices"][0]["finish_reason"].as_str()).collect();
    assert_eq!(finish, vec!["stop"]);
    let last = chunks.last().unwrap();
    assert_eq!(last["usage"]["completion_tokens"], 5);
    assert_eq!(last["edge"]["status"], "SUCCEEDED");
    gw.stop().await;
}

#[tokio::test]
async fn ollama_completions_use_api_generate_raw() {
    let fake = FakeEngine::start().await;
    let gw = TestGateway::with_engine(&fake.url(), "ollama", "").await;
    gw.wait_ready().await;
    let resp =
        post(&gw, &json!({"model": "general-chat", "prompt": "Once", "max_tokens": 2, "stream": true}), None).await;
    let (chunks, done) = read_sse(resp).await;
    assert!(done);
    let text: String = chunks.iter().filter_map(|c| c["choices"][0]["text"].as_str()).collect();
    assert_eq!(text, "tok tok ");
    assert_eq!(fake.posts(), vec!["/api/generate"]);
    let sent = fake.last_request().unwrap();
    assert_eq!((sent["prompt"].as_str(), sent["raw"].as_bool()), (Some("Once"), Some(true)), "{sent}");
    assert_eq!(sent["options"]["num_predict"], 2);
    gw.stop().await;
}

#[tokio::test]
async fn what_cannot_be_honoured_is_refused_clearly() {
    let fake = FakeEngine::start().await;
    let gw = TestGateway::with_engine(&fake.url(), "openai", "").await;
    for (body, says) in [
        (json!({"model": "general-chat", "prompt": "a", "echo": true}), "'echo'"),
        (json!({"model": "general-chat", "prompt": "a", "logprobs": 1}), "'logprobs'"),
        (json!({"model": "general-chat", "prompt": "a", "best_of": 3}), "best_of"),
        (json!({"model": "general-chat", "prompt": "a", "n": 2}), "n = 1"),
        (json!({"model": "general-chat", "prompt": ["a", "b"]}), "one per request"),
        (json!({"model": "general-chat", "prompt": "a", "max_tokens": 0}), "at least 1"),
        (json!({"model": "nope", "prompt": "a"}), "unknown model 'nope'"),
        // Review L3: tool calling is a chat feature.
        (
            json!({"model": "general-chat", "prompt": "a", "tools": [{"type": "function", "function": {"name": "f"}}]}),
            "'tools' is not supported by /v1/completions",
        ),
        (json!({"model": "general-chat", "prompt": "a", "tool_choice": "auto"}), "'tool_choice'"),
        (json!({"model": "general-chat", "prompt": "a", "parallel_tool_calls": false}), "'parallel_tool_calls'"),
    ] {
        let resp = post(&gw, &body, None).await;
        let status = resp.status().as_u16();
        let v: Value = resp.json().await.unwrap();
        assert_eq!((status, error_code(&v)), (400, "INVALID_REQUEST"), "{body}: {v}");
        assert!(v["error"]["message"].as_str().unwrap().contains(says), "{body}: {v}");
    }
    assert_eq!(fake.requests(), 0);
    gw.stop().await;
}

#[tokio::test]
async fn a_client_that_goes_away_stops_the_engine() {
    let fake = FakeEngine::start_with(Knobs::slow(1000, 10)).await;
    let gw = TestGateway::with_engine(&fake.url(), "openai", "").await;
    let resp = post(&gw, &json!({"model": "general-chat", "prompt": "Once", "stream": true}), None).await;
    let task_id = resp.headers()["x-task-id"].to_str().unwrap().to_string();
    let mut body = resp.bytes_stream();
    // Read until the first text arrives, then hang up.
    let mut seen = String::new();
    while !seen.contains("\"text\":\"tok") {
        seen.push_str(&String::from_utf8_lossy(&body.next().await.unwrap().unwrap()));
    }
    drop(body);
    gw.wait_for_state(&task_id, TaskState::Cancelled).await;
    assert!(
        fake.wait_for(Duration::from_secs(10), |s| s.aborted.load(std::sync::atomic::Ordering::SeqCst) == 1).await,
        "the engine saw the client go"
    );
    gw.stop().await;
}

#[tokio::test]
async fn an_idempotency_key_runs_the_completion_once() {
    let fake = FakeEngine::start().await;
    let gw = TestGateway::with_engine(&fake.url(), "openai", "").await;
    let body = json!({"model": "general-chat", "prompt": "Once", "max_tokens": 2});
    let a: Value = post(&gw, &body, Some("c-key-1")).await.json().await.unwrap();
    let b: Value = post(&gw, &body, Some("c-key-1")).await.json().await.unwrap();
    assert_eq!(a["edge"]["task_id"], b["edge"]["task_id"], "{a}\n{b}");
    assert_eq!(b["choices"][0]["text"], a["choices"][0]["text"]);
    assert_eq!(fake.requests(), 1);
    // A chat of the same text under the same key is another request.
    let chat = json!({"model": "general-chat", "messages": [{"role": "user", "content": "Once"}], "max_tokens": 2});
    let resp = client()
        .post(format!("{}/v1/chat/completions", gw.base_url))
        .bearer_auth(DEMO_KEY)
        .header("idempotency-key", "c-key-1")
        .json(&chat)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    let v: Value = resp.json().await.unwrap();
    assert!(v["error"]["message"].as_str().unwrap().contains("already used for a different request"), "{v}");
    gw.stop().await;
}
