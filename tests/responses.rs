//! `POST /v1/responses` end to end against the fake engine: the request
//! is translated onto the chat pipeline (instructions, message items,
//! function tools), the Response object and its stream of events in
//! OpenAI's shape, errors (unsupported fields, engine failure, a bad key),
//! tool calls as `function_call` items, and cancellation when the client
//! goes away.

mod common;

use common::*;
use futures::StreamExt;
use serde_json::{json, Value};

const ARGS: &str = r#"{"city": "Oslo"}"#;

async fn post(gw: &TestGateway, key: &str, body: &Value) -> reqwest::Response {
    client().post(format!("{}/v1/responses", gw.base_url)).bearer_auth(key).json(body).send().await.unwrap()
}

async fn gateway(knobs: Knobs) -> (FakeEngine, TestGateway) {
    let fake = FakeEngine::start_with(knobs).await;
    let gw = TestGateway::with_engine_edit(&fake.url(), "openai", "", |t| {
        t.replace("health_interval_ms = 100", "health_interval_ms = 100\ntools = true")
    })
    .await;
    gw.wait_ready().await;
    (fake, gw)
}

/// Every event's `type`, in order.
fn types(events: &[Value]) -> Vec<&str> {
    events.iter().map(|e| e["type"].as_str().unwrap()).collect()
}

#[tokio::test]
async fn a_text_input_with_instructions_gets_a_response_object() {
    let (fake, gw) = gateway(Knobs::default()).await;
    let body = json!({
        "model": "general-chat", "input": "Say hello", "instructions": "Be brief",
        "max_output_tokens": 50, "temperature": 0.5, "metadata": {"k": "v"}, "store": false,
    });
    let resp = post(&gw, DEMO_KEY, &body).await;
    assert_eq!(resp.status(), 200);
    let task_id = resp.headers()["x-task-id"].to_str().unwrap().to_string();
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["object"], "response");
    assert_eq!(v["id"], format!("resp_{task_id}"));
    assert_eq!(v["status"], "completed", "{v}");
    assert_eq!(v["model"], "general-chat");
    assert_eq!(v["instructions"], "Be brief");
    assert_eq!(v["metadata"], json!({"k": "v"}));
    let out = v["output"].as_array().unwrap();
    assert_eq!(out.len(), 1, "{v}");
    assert_eq!(out[0]["type"], "message");
    assert_eq!(out[0]["role"], "assistant");
    assert_eq!(out[0]["status"], "completed");
    assert_eq!(out[0]["content"][0]["type"], "output_text");
    assert_eq!(out[0]["content"][0]["text"], "tok tok tok tok tok ");
    assert_eq!(v["usage"]["output_tokens"], 5);
    assert_eq!(v["usage"]["total_tokens"].as_u64().unwrap(), v["usage"]["input_tokens"].as_u64().unwrap() + 5);
    assert_eq!(v["edge"]["task_id"], task_id.as_str());
    // What the engine was asked: the chat form of the same request.
    let seen = fake.stats.last_request.lock().unwrap().clone().unwrap();
    assert_eq!(
        seen["messages"],
        json!([{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Say hello"}])
    );
    assert_eq!(seen["temperature"], 0.5);
    assert_eq!(stored_states(&gw, &task_id).await.last().map(String::as_str), Some("SUCCEEDED"));
    gw.stop().await;
}

#[tokio::test]
async fn message_items_and_a_tool_turn_become_chat_messages() {
    let (fake, gw) = gateway(Knobs::default()).await;
    let body = json!({
        "model": "general-chat",
        "input": [
            {"role": "developer", "content": "Use tools"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in "}, {"type": "input_text", "text": "Oslo?"}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": ARGS},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        ],
        "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "get_weather"},
    });
    let resp = post(&gw, DEMO_KEY, &body).await;
    assert_eq!(resp.status(), 200, "{}", resp.text().await.unwrap());
    let seen = fake.stats.last_request.lock().unwrap().clone().unwrap();
    assert_eq!(
        seen["messages"],
        json!([
            {"role": "system", "content": "Use tools"},
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ])
    );
    assert_eq!(
        seen["tools"],
        json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}])
    );
    assert_eq!(seen["tool_choice"], json!({"type": "function", "function": {"name": "get_weather"}}));
    gw.stop().await;
}

#[tokio::test]
async fn a_streamed_response_sends_openais_events_in_order() {
    let (_fake, gw) = gateway(Knobs::default()).await;
    let resp = post(&gw, DEMO_KEY, &json!({"model": "general-chat", "input": "Say hello", "stream": true})).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let (events, _) = read_sse(resp).await;
    let t = types(&events);
    assert_eq!(
        t[..4],
        ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    );
    assert_eq!(
        t[t.len() - 4..],
        ["response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"]
    );
    for (i, e) in events.iter().enumerate() {
        assert_eq!(e["sequence_number"], i, "{e}");
    }
    let deltas: String = events
        .iter()
        .filter(|e| e["type"] == "response.output_text.delta")
        .map(|e| e["delta"].as_str().unwrap())
        .collect();
    assert_eq!(deltas, "tok tok tok tok tok ");
    assert_eq!(events[t.len() - 4]["text"], deltas.as_str());
    let done = events.last().unwrap();
    assert_eq!(done["response"]["status"], "completed");
    assert_eq!(done["response"]["output"][0]["content"][0]["text"], deltas.as_str());
    assert_eq!(done["response"]["usage"]["output_tokens"], 5);
    assert_eq!(events[0]["response"]["id"], done["response"]["id"]);
    gw.stop().await;
}

#[tokio::test]
async fn a_tool_call_is_a_function_call_item_streamed_or_not() {
    let knobs = Knobs { tool_calls: vec![("get_weather".into(), ARGS.into())], ..Knobs::default() };
    let (_fake, gw) = gateway(knobs).await;
    let tools = json!([{"type": "function", "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]);
    let body = json!({"model": "general-chat", "input": "Weather?", "tools": tools});
    let v: Value = post(&gw, DEMO_KEY, &body).await.json().await.unwrap();
    let call = &v["output"][0];
    assert_eq!(call["type"], "function_call", "{v}");
    assert_eq!(call["name"], "get_weather");
    assert_eq!(call["call_id"], "call_fake_0");
    assert_eq!(call["arguments"], ARGS);
    assert_eq!(v["edge"]["tool_calls_valid"], true);
    assert_eq!(v["tools"], tools, "echoed in the Responses shape");

    let mut body = body;
    body["stream"] = true.into();
    let (events, _) = read_sse(post(&gw, DEMO_KEY, &body).await).await;
    let added = events.iter().find(|e| e["type"] == "response.output_item.added").unwrap();
    assert_eq!(added["item"]["type"], "function_call");
    assert_eq!(added["item"]["name"], "get_weather");
    let args: String = events
        .iter()
        .filter(|e| e["type"] == "response.function_call_arguments.delta")
        .map(|e| e["delta"].as_str().unwrap())
        .collect();
    assert_eq!(args, ARGS);
    let done = events.iter().find(|e| e["type"] == "response.function_call_arguments.done").unwrap();
    assert_eq!(done["arguments"], ARGS);
    let last = events.last().unwrap();
    assert_eq!(last["type"], "response.completed");
    assert_eq!(last["response"]["output"][0]["arguments"], ARGS);
    gw.stop().await;
}

#[tokio::test]
async fn unsupported_fields_are_refused_by_name() {
    let (fake, gw) = gateway(Knobs::default()).await;
    let cases = [
        (json!({"conversation": "conv_x"}), "sessions"),
        (json!({"previous_response_id": 3}), "'previous_response_id'"),
        (json!({"reasoning": {"effort": "low"}}), "'reasoning'"),
        (json!({"background": true}), "'background'"),
        (json!({"tools": [{"type": "web_search"}]}), "web_search"),
        (json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}), "input_image"),
        (json!({"input": 3}), "'input'"),
    ];
    for (extra, says) in cases {
        let mut body = json!({"model": "general-chat", "input": "hi"});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let resp = post(&gw, DEMO_KEY, &body).await;
        assert_eq!(resp.status(), 400, "{body}");
        let v: Value = resp.json().await.unwrap();
        assert_eq!(error_code(&v), "INVALID_REQUEST", "{v}");
        assert!(v["error"]["message"].as_str().unwrap().contains(says), "{says}: {v}");
    }
    let body = json!({"model": "general-chat", "input": "hi", "truncation": "sometimes"});
    let resp = post(&gw, DEMO_KEY, &body).await;
    assert_eq!(resp.status(), 400);
    let v: Value = resp.json().await.unwrap();
    assert!(v["error"]["message"].as_str().unwrap().contains("'truncation'"), "{v}");
    // Defaults that mean nothing unsupported are fine.
    let body = json!({"model": "general-chat", "input": "hi", "background": false, "truncation": "disabled",
        "text": {"format": {"type": "text"}}, "user": "u1"});
    let resp = post(&gw, DEMO_KEY, &body).await;
    assert_eq!(resp.status(), 200);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["truncation"], "disabled", "as asked: {v}");
    assert_eq!(fake.requests(), 1, "refused calls never reach the engine");
    gw.stop().await;
}

#[tokio::test]
async fn a_bad_key_is_refused_before_the_body_is_read() {
    let (_fake, gw) = gateway(Knobs::default()).await;
    let resp = post(&gw, "wrong-key", &json!({"reasoning": {}})).await;
    assert_eq!(resp.status(), 401);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(error_code(&v), "AUTH_FAILED", "{v}");
    gw.stop().await;
}

#[tokio::test]
async fn an_engine_failure_ends_the_stream_with_response_failed() {
    let (_fake, gw) = gateway(Knobs { fail_status: Some(500), ..Knobs::default() }).await;
    let resp = post(&gw, DEMO_KEY, &json!({"model": "general-chat", "input": "hi", "stream": true})).await;
    let (events, _) = read_sse(resp).await;
    let last = events.last().unwrap();
    assert_eq!(last["type"], "response.failed", "{events:#?}");
    assert_eq!(last["response"]["status"], "failed");
    let code = last["response"]["error"]["code"].as_str().unwrap();
    assert!(code.chars().all(|c| c.is_ascii_uppercase() || c == '_'), "a gateway code: {code}");
    assert!(!last["response"]["error"]["message"].as_str().unwrap().contains("secret"), "{last}");
    // Not streamed: the gateway's error body and status.
    let resp = post(&gw, DEMO_KEY, &json!({"model": "general-chat", "input": "hi"})).await;
    assert!(resp.status().is_server_error(), "{}", resp.status());
    let v: Value = resp.json().await.unwrap();
    assert_eq!(error_code(&v), code);
    gw.stop().await;
}

#[tokio::test]
async fn a_client_that_goes_away_cancels_its_response() {
    let (_fake, gw) = gateway(Knobs::slow(1000, 20)).await;
    let resp = post(&gw, DEMO_KEY, &json!({"model": "general-chat", "input": "hi", "stream": true})).await;
    let task_id = resp.headers()["x-task-id"].to_str().unwrap().to_string();
    let mut body = resp.bytes_stream();
    // Wait for the first delta, then hang up.
    let mut seen = String::new();
    while !seen.contains("response.output_text.delta") {
        seen.push_str(&String::from_utf8_lossy(&body.next().await.unwrap().unwrap()));
    }
    drop(body);
    gw.wait_for_state(&task_id, TaskState::Cancelled).await;
    gw.stop().await;
}

#[tokio::test]
async fn an_idempotency_key_header_returns_the_same_response() {
    let (fake, gw) = gateway(Knobs::default()).await;
    let call = || {
        client()
            .post(format!("{}/v1/responses", gw.base_url))
            .bearer_auth(DEMO_KEY)
            .header("Idempotency-Key", "resp-idem-1")
            .json(&json!({"model": "general-chat", "input": "hi"}))
            .send()
    };
    let a: Value = call().await.unwrap().json().await.unwrap();
    let b: Value = call().await.unwrap().json().await.unwrap();
    assert_eq!(a["id"], b["id"], "{a}\n{b}");
    assert_eq!(b["output"][0]["content"][0]["text"], a["output"][0]["content"][0]["text"]);
    assert_eq!(fake.requests(), 1, "one inference");
    gw.stop().await;
}

/// The key of `other`, a second application of the same tenant.
const OTHER_KEY: &str = "sk-edgeway-other";

/// [`gateway`] with a second, non-admin application of the demo tenant,
/// and `store` appended to the `[store]` section.
async fn gateway_with_other(store: &str) -> (FakeEngine, TestGateway) {
    let fake = FakeEngine::start_with(Knobs::default()).await;
    let other = hex::encode(edgeway::config::hash_api_key(OTHER_KEY));
    let gw = TestGateway::with_engine_edit(&fake.url(), "openai", "", |t| {
        format!(
            "{}\n[applications.other]\ntenant = \"demo\"\napi_key_sha256 = [\"{other}\"]\n\
             max_priority = \"P1\"\ndefault_priority = \"P2\"\n",
            t.replacen("[store]\n", &format!("[store]\n{store}\n"), 1)
        )
    })
    .await;
    gw.wait_ready().await;
    (fake, gw)
}

async fn get_response(gw: &TestGateway, key: &str, id: &str) -> reqwest::Response {
    client().get(format!("{}/v1/responses/{id}", gw.base_url)).bearer_auth(key).send().await.unwrap()
}

async fn delete_response(gw: &TestGateway, key: &str, id: &str) -> reqwest::Response {
    client().delete(format!("{}/v1/responses/{id}", gw.base_url)).bearer_auth(key).send().await.unwrap()
}

/// A stored Response comes back as its create returned it, streamed or
/// not, to the application that created it only: another application
/// (an admin one too: it is answer text) gets 404, never the body.
/// DELETE forgets it.
#[tokio::test]
async fn a_stored_response_is_retrieved_by_its_application_only() {
    let (_fake, gw) = gateway_with_other("").await;
    let body = json!({"model": "general-chat", "input": "Say hello", "instructions": "Be brief", "store": true,
        "metadata": {"k": "v"}});
    let created: Value = post(&gw, DEMO_KEY, &body).await.json().await.unwrap();
    assert_eq!(created["store"], true, "{created}");
    let id = created["id"].as_str().unwrap();
    let got = get_response(&gw, DEMO_KEY, id).await;
    assert_eq!(got.status(), 200);
    let got: Value = got.json().await.unwrap();
    assert_eq!(got, created, "the very object the create returned");
    assert_eq!(got["output"][0]["content"][0]["text"], "tok tok tok tok tok ");
    for key in [OTHER_KEY, OPS_KEY] {
        let r = get_response(&gw, key, id).await;
        assert_eq!(r.status(), 404, "{key}");
        assert!(!r.text().await.unwrap().contains("tok tok"), "{key}");
        assert_eq!(delete_response(&gw, key, id).await.status(), 404, "{key}");
    }

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (events, _) = read_sse(post(&gw, DEMO_KEY, &streamed).await).await;
    let done = &events.last().unwrap()["response"];
    assert_eq!(done["status"], "completed", "{done}");
    let got: Value = get_response(&gw, DEMO_KEY, done["id"].as_str().unwrap()).await.json().await.unwrap();
    assert_eq!(&got, done);

    let r = delete_response(&gw, DEMO_KEY, id).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Value>().await.unwrap(), json!({"id": id, "object": "response", "deleted": true}));
    assert_eq!(get_response(&gw, DEMO_KEY, id).await.status(), 404);
    assert_eq!(delete_response(&gw, DEMO_KEY, id).await.status(), 404);
    assert_eq!(get_response(&gw, DEMO_KEY, "resp_no-such-task").await.status(), 404);
    assert_eq!(get_response(&gw, DEMO_KEY, "no-prefix").await.status(), 404);
    gw.stop().await;
}

/// `store: false` is never kept; a request that says nothing follows the
/// data policy (`[store] store_prompts`), and the Response's `store` says
/// which it was.
#[tokio::test]
async fn a_response_is_kept_only_when_asked_or_the_data_policy_keeps_answers() {
    for (policy, omitted_kept) in [("", false), ("store_prompts = true", true)] {
        let (_fake, gw) = gateway_with_other(policy).await;
        for (store, kept) in [(json!(false), false), (Value::Null, omitted_kept), (json!(true), true)] {
            let body = json!({"model": "general-chat", "input": "Say hello", "store": store});
            let created: Value = post(&gw, DEMO_KEY, &body).await.json().await.unwrap();
            assert_eq!(created["store"], kept, "{policy:?} {store}: {created}");
            let status = get_response(&gw, DEMO_KEY, created["id"].as_str().unwrap()).await.status();
            assert_eq!(status, if kept { 200 } else { 404 }, "{policy:?} {store}");
        }
        let bad = post(&gw, DEMO_KEY, &json!({"model": "general-chat", "input": "x", "store": "yes"})).await;
        assert_eq!(bad.status(), 400);
        gw.stop().await;
    }
}

/// The chat messages the engine was sent last, as (role, text) pairs.
fn sent_messages(fake: &FakeEngine) -> Vec<(String, String)> {
    let body = fake.last_request().unwrap();
    body["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (m["role"].as_str().unwrap().to_string(), m["content"].as_str().unwrap_or("").to_string()))
        .collect()
}

fn msg(role: &str, text: &str) -> (String, String) {
    (role.to_string(), text.to_string())
}

/// `previous_response_id`: a stored Response is continued with its input
/// chain and its output before the new input, across any number of
/// links; the previous `instructions` are not carried over (OpenAI's
/// rule), the request's own are.
#[tokio::test]
async fn previous_response_id_continues_a_stored_conversation_across_links() {
    let (fake, gw) = gateway_with_other("").await;
    let answer = "tok tok tok tok tok ";
    let first: Value = post(
        &gw,
        DEMO_KEY,
        &json!({"model": "general-chat", "input": "one", "instructions": "Be brief", "store": true}),
    )
    .await
    .json()
    .await
    .unwrap();
    assert_eq!(first["previous_response_id"], Value::Null, "{first}");
    let second = post(
        &gw,
        DEMO_KEY,
        &json!({"model": "general-chat", "input": "two", "previous_response_id": first["id"], "store": true}),
    )
    .await;
    assert_eq!(second.status(), 200);
    let second: Value = second.json().await.unwrap();
    assert_eq!(second["previous_response_id"], first["id"]);
    assert_eq!(sent_messages(&fake), vec![msg("user", "one"), msg("assistant", answer), msg("user", "two")]);

    // A third link, streamed, with instructions of its own and a message item.
    let third = json!({"model": "general-chat", "previous_response_id": second["id"], "stream": true,
        "instructions": "Answer in French", "store": true,
        "input": [{"type": "message", "role": "user", "content": "three"}]});
    let (events, _) = read_sse(post(&gw, DEMO_KEY, &third).await).await;
    assert_eq!(events.last().unwrap()["type"], "response.completed", "{events:?}");
    let want = vec![
        msg("system", "Answer in French"),
        msg("user", "one"),
        msg("assistant", answer),
        msg("user", "two"),
        msg("assistant", answer),
        msg("user", "three"),
    ];
    assert_eq!(sent_messages(&fake), want);
    // And a fourth, from the streamed one.
    let third_id = events.last().unwrap()["response"]["id"].clone();
    let r =
        post(&gw, DEMO_KEY, &json!({"model": "general-chat", "input": "four", "previous_response_id": third_id})).await;
    assert_eq!(r.status(), 200);
    let mut want = want[1..].to_vec();
    want.extend([msg("assistant", answer), msg("user", "four")]);
    assert_eq!(sent_messages(&fake), want);
    gw.stop().await;
}

/// A previous response that is unknown, not kept (`store: false`), deleted
/// or another application's is answered 404, and nothing reaches the engine.
#[tokio::test]
async fn previous_response_id_of_an_unknown_unstored_or_foreign_response_is_not_found() {
    let (fake, gw) = gateway_with_other("").await;
    let create = |store: bool| json!({"model": "general-chat", "input": "hi", "store": store});
    let kept: Value = post(&gw, DEMO_KEY, &create(true)).await.json().await.unwrap();
    let unkept: Value = post(&gw, DEMO_KEY, &create(false)).await.json().await.unwrap();
    let deleted: Value = post(&gw, DEMO_KEY, &create(true)).await.json().await.unwrap();
    let deleted_id = deleted["id"].as_str().unwrap();
    assert_eq!(delete_response(&gw, DEMO_KEY, deleted_id).await.status(), 200);
    let sent = fake.requests();
    let cases = [
        (DEMO_KEY, json!("resp_no-such-task")),
        (DEMO_KEY, json!("not-a-response-id")),
        (DEMO_KEY, unkept["id"].clone()),
        (DEMO_KEY, json!(deleted_id)),
        (OTHER_KEY, kept["id"].clone()),
        (OPS_KEY, kept["id"].clone()),
    ];
    for (key, id) in cases {
        let body = json!({"model": "general-chat", "input": "next", "previous_response_id": id});
        let r = post(&gw, key, &body).await;
        assert_eq!(r.status(), 404, "{key} {id}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(error_code(&v), "INVALID_REQUEST", "{v}");
        assert!(v["error"]["message"].as_str().unwrap().contains("previous_response_id"), "{v}");
        assert!(!v.to_string().contains("tok tok"), "{v}");
    }
    assert_eq!(fake.requests(), sent, "nothing refused reached the engine");
    // The owner continues it.
    let body = json!({"model": "general-chat", "input": "next", "previous_response_id": kept["id"]});
    assert_eq!(post(&gw, DEMO_KEY, &body).await.status(), 200);
    gw.stop().await;
}

/// Review L6: a stored Response is continued by its own user only (the
/// credential's, else `user` / `metadata.user_id`), as a session is.
#[tokio::test]
async fn previous_response_id_of_another_user_of_the_same_application_is_not_found() {
    let (fake, gw) = gateway_with_other("").await;
    let first: Value = post(
        &gw,
        DEMO_KEY,
        &json!({"model": "general-chat", "input": "alice's secret", "user": "alice", "store": true}),
    )
    .await
    .json()
    .await
    .unwrap();
    let sent = fake.requests();
    for other in [json!({"user": "bob"}), json!({"metadata": {"user_id": "bob"}}), json!({})] {
        let mut body = json!({"model": "general-chat", "input": "next", "previous_response_id": first["id"]});
        body.as_object_mut().unwrap().extend(other.as_object().unwrap().clone());
        let r = post(&gw, DEMO_KEY, &body).await;
        assert_eq!(r.status(), 404, "{body}");
        let v: Value = r.json().await.unwrap();
        assert!(!v.to_string().contains("secret"), "{v}");
    }
    assert_eq!(fake.requests(), sent, "nothing reached the engine");
    let body = json!({"model": "general-chat", "input": "next", "previous_response_id": first["id"],
        "metadata": {"user_id": "alice"}});
    assert_eq!(post(&gw, DEMO_KEY, &body).await.status(), 200);
    assert!(fake.last_request().unwrap().to_string().contains("alice's secret"));
    gw.stop().await;
}

/// The conversation rows of the database file.
async fn conversation_rows(gw: &TestGateway) -> i64 {
    gw.store().flush().await;
    let conn = rusqlite::Connection::open(gw.db_path()).unwrap();
    conn.query_row("SELECT COUNT(*) FROM response_conversations", [], |r| r.get(0)).unwrap()
}

/// Review L7: the input conversation of a Response is written to the store
/// only under `store_prompts`; otherwise it is kept in memory, and the
/// chain still continues.
#[tokio::test]
async fn a_conversation_is_stored_only_where_the_data_policy_keeps_prompts() {
    for store_prompts in [false, true] {
        let (fake, gw) = gateway_with_other(&format!("store_prompts = {store_prompts}")).await;
        let body = json!({"model": "general-chat", "input": "the pump code is 7781", "store": true});
        let first: Value = post(&gw, DEMO_KEY, &body).await.json().await.unwrap();
        assert_eq!(conversation_rows(&gw).await, i64::from(store_prompts), "store_prompts = {store_prompts}");
        let next = json!({"model": "general-chat", "input": "and now?", "previous_response_id": first["id"]});
        assert_eq!(post(&gw, DEMO_KEY, &next).await.status(), 200);
        let sent = fake.last_request().unwrap().to_string();
        assert!(sent.contains("the pump code is 7781") && sent.contains("and now?"), "{sent}");
        gw.stop().await;
    }
}

/// Review L7: a chain is bounded; past the bound it is refused with its
/// own code, and nothing reaches the engine.
#[tokio::test]
async fn a_chain_past_its_bound_is_context_too_large() {
    let fake = FakeEngine::start_with(Knobs::default()).await;
    let gw = TestGateway::with_engine_edit(&fake.url(), "openai", "", |t| {
        t.replace("context_tokens = 2048", "context_tokens = 200000")
    })
    .await;
    gw.wait_ready().await;
    let items = |n: usize| (0..n).map(|i| json!({"role": "user", "content": format!("m{i}")})).collect::<Vec<_>>();
    let first: Value = post(&gw, DEMO_KEY, &json!({"model": "general-chat", "input": items(600), "store": true}))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(first["status"], "completed", "{first}");
    let sent = fake.requests();
    let body = json!({"model": "general-chat", "input": items(400), "previous_response_id": first["id"]});
    let r = post(&gw, DEMO_KEY, &body).await;
    assert_eq!(r.status(), 413);
    let v: Value = r.json().await.unwrap();
    assert_eq!(error_code(&v), "CONTEXT_TOO_LARGE", "{v}");
    assert_eq!(fake.requests(), sent);
    gw.stop().await;
}

/// A `previous_response_id` chain goes through the same ladder as a
/// session's history: once it outgrows the model's window its oldest
/// links are left out of the prompt (a step recorded in `edge.context`),
/// and the call is answered, not refused; the newest input is always
/// there. The chain kept with the Response stays whole.
#[tokio::test]
async fn a_chain_longer_than_the_window_is_trimmed_not_refused() {
    let fake = FakeEngine::start_with(Knobs::default()).await;
    let gw = TestGateway::with_engine_edit(&fake.url(), "openai", "", |t| {
        t.replace("context_tokens = 2048", "context_tokens = 1024")
    })
    .await;
    gw.wait_ready().await;
    // About 100 tokens each (estimated): the window holds some 9 of them.
    let text = |i: usize| format!("link {i}: {}", "pressure ".repeat(36));
    let mut prev = Value::Null;
    for i in 0..12 {
        let mut body = json!({"model": "general-chat", "input": text(i), "max_output_tokens": 16, "store": true});
        if !prev.is_null() {
            body["previous_response_id"] = prev.clone();
        }
        let r = post(&gw, DEMO_KEY, &body).await;
        let status = r.status();
        let v: Value = r.json().await.unwrap();
        assert_eq!(status, 200, "link {i}: {v}");
        assert_eq!(v["status"], "completed", "link {i}: {v}");
        prev = v["id"].clone();
        let sent = sent_messages(&fake);
        assert_eq!(sent.last().unwrap(), &msg("user", &text(i)), "link {i}: the newest input is there");
        // The policy it ran under, as OpenAI names it (review: it said
        // "disabled" while the chain was trimmed).
        assert_eq!(v["truncation"], "auto", "link {i}: {v}");
        if i == 11 {
            assert!(sent.len() < 2 * 12 - 1, "older links left out: {} messages", sent.len());
            assert_eq!(sent[0].0, "user", "never an answer without its question: {sent:?}");
            let steps = v["edge"]["context"]["steps"].to_string();
            assert!(steps.contains("oldest messages"), "{v}");
        }
    }
    // `truncation: "disabled"`: no link may go, so the call is refused,
    // as OpenAI refuses it; "auto" said so is the default's behaviour.
    let calls = fake.requests();
    let body = json!({"model": "general-chat", "input": "and now?", "max_output_tokens": 16,
                      "previous_response_id": prev, "truncation": "disabled"});
    let resp = post(&gw, DEMO_KEY, &body).await;
    assert_eq!(resp.status(), 413);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(error_code(&v), "CONTEXT_TOO_LARGE", "{v}");
    assert_eq!(fake.requests(), calls);
    let body = json!({"model": "general-chat", "input": "and now?", "max_output_tokens": 16,
                      "previous_response_id": prev, "truncation": "auto"});
    let v: Value = post(&gw, DEMO_KEY, &body).await.json().await.unwrap();
    assert_eq!((&v["status"], &v["truncation"]), (&json!("completed"), &json!("auto")), "{v}");
    gw.stop().await;
}
