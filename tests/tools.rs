//! Tool calling end to end against fake engines: `tools` pass through to
//! the engine, tool-call deltas come back in OpenAI's chunk format (and
//! whole in a non-streamed message), arguments are checked against the
//! declared schema, applications' allowed and high-risk tools, engines
//! without tool support, and the same calls as events on MQTT and NATS.

mod common;
mod mqtt_support;

use std::time::Duration;

use common::*;
use edgeway::ingress::nats::BusState;
use edgeway::testing::NatsServer;
use futures::StreamExt;
use serde_json::{json, Value};

const ARGS: &str = r#"{"city": "Oslo", "days": 3}"#;

fn weather_tool() -> Value {
    json!({
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather at a place",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
                "required": ["city"],
            },
        },
    })
}

fn ping_tool() -> Value {
    json!({"type": "function", "function": {"name": "ping"}})
}

/// A fake that answers requests with tools by calling `calls`.
fn calling(calls: &[(&str, &str)]) -> Knobs {
    Knobs { tool_calls: calls.iter().map(|(n, a)| (n.to_string(), a.to_string())).collect(), ..Knobs::default() }
}

/// The engine declared able to do tools, and `app_extra` added to the
/// `demo` application.
fn tools_on(app_extra: &'static str) -> impl FnOnce(String) -> String {
    move |t| {
        t.replace("health_interval_ms = 100", "health_interval_ms = 100\ntools = true")
            .replace("default_priority = \"P2\"", &format!("default_priority = \"P2\"\n{app_extra}"))
    }
}

async fn gateway(knobs: Knobs, kind: &str, app_extra: &'static str) -> (FakeEngine, TestGateway) {
    let fake = FakeEngine::start_with(knobs).await;
    let gw = TestGateway::with_engine_edit(&fake.url(), kind, "", tools_on(app_extra)).await;
    gw.wait_ready().await;
    (fake, gw)
}

fn body_with_tools(stream: bool) -> Value {
    let mut body = chat_body(stream);
    body["tools"] = json!([weather_tool(), ping_tool()]);
    body["tool_choice"] = json!("auto");
    body["parallel_tool_calls"] = json!(true);
    body
}

/// What `/v1/models` says of `general-chat`'s `tools`.
async fn models_say_tools(gw: &TestGateway) -> Value {
    let v: Value = client()
        .get(format!("{}/v1/models", gw.base_url))
        .bearer_auth(DEMO_KEY)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    v["data"].as_array().unwrap().iter().find(|m| m["id"] == "general-chat").unwrap()["tools"].clone()
}

fn metric(gw: &TestGateway, sample: &str) -> Option<f64> {
    mqtt_support::metric(gw, sample)
}

#[tokio::test]
async fn tools_are_passed_to_the_engine_not_refused() {
    let (fake, gw) = gateway(Knobs::default(), "openai", "").await;
    assert_eq!(models_say_tools(&gw).await, true, "/v1/models says it takes tools");
    let mut body = body_with_tools(false);
    body["parallel_tool_calls"] = json!(false);
    let resp = post_chat(&gw, DEMO_KEY, &body).await;
    let status = resp.status();
    let v: Value = resp.json().await.unwrap();
    assert_eq!(status, 200, "{v}");
    let seen = fake.stats.last_request.lock().unwrap().clone().unwrap();
    assert_eq!(seen["tools"], json!([weather_tool(), ping_tool()]));
    assert_eq!(seen["tool_choice"], "auto");
    assert_eq!(seen["parallel_tool_calls"], false);
    // The model answered with text: no tool calls anywhere.
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert!(v["choices"][0]["message"].get("tool_calls").is_none(), "{v}");
    assert!(v["edge"].get("tool_calls_valid").is_none(), "{v}");
    gw.stop().await;
}

#[tokio::test]
async fn non_streamed_tool_call_is_in_the_message_and_checked() {
    for kind in ["openai", "ollama"] {
        let (_fake, gw) = gateway(calling(&[("get_weather", ARGS)]), kind, "").await;
        let resp = post_chat(&gw, DEMO_KEY, &body_with_tools(false)).await;
        assert_eq!(resp.status(), 200);
        let v: Value = resp.json().await.unwrap();
        let choice = &v["choices"][0];
        assert_eq!(choice["finish_reason"], "tool_calls", "{kind}: {v}");
        let msg = &choice["message"];
        assert_eq!(msg["content"], Value::Null, "{kind}: {v}");
        let call = &msg["tool_calls"][0];
        assert_eq!(call["type"], "function");
        assert_eq!(call["function"]["name"], "get_weather");
        let args: Value = serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
        assert_eq!(args, json!({"city": "Oslo", "days": 3}));
        assert!(call["id"].as_str().is_some_and(|id| !id.is_empty()), "{kind}: {v}");
        assert_eq!(msg["tool_calls"].as_array().unwrap().len(), 1);
        assert_eq!(v["edge"]["tool_calls_valid"], true, "{kind}: {v}");
        assert_eq!(v["edge"]["tool_calls"][0]["valid"], true);
        assert_eq!(v["edge"]["tool_calls"][0]["id"], call["id"]);
        assert_eq!(v["edge"]["finish_reason"], "tool_calls");
        gw.stop().await;
    }
}

#[tokio::test]
async fn streamed_tool_call_arrives_in_openai_chunks() {
    let (_fake, gw) = gateway(calling(&[("get_weather", ARGS)]), "openai", "").await;
    let mut body = body_with_tools(true);
    body["stream_options"] = json!({"include_usage": true});
    let resp = post_chat(&gw, DEMO_KEY, &body).await;
    assert_eq!(resp.status(), 200);
    let (events, done) = read_sse(resp).await;
    assert!(done, "ends with [DONE]");
    let pieces: Vec<&Value> =
        events.iter().filter_map(|e| e["choices"][0]["delta"]["tool_calls"].as_array()).flatten().collect();
    assert!(pieces.len() > 2, "arguments arrive in pieces: {events:#?}");
    // The first piece of the call: what openai-python's accumulation needs.
    let first = pieces[0];
    assert_eq!(first["index"], 0);
    assert_eq!(first["type"], "function");
    assert_eq!(first["function"]["name"], "get_weather");
    assert_eq!(first["function"]["arguments"], "");
    assert_eq!(first["id"], "call_fake_0");
    for p in &pieces[1..] {
        assert_eq!(p["index"], 0);
        assert!(p.get("id").is_none() && p["function"].get("name").is_none(), "later pieces: {p}");
    }
    let args: String = pieces.iter().map(|p| p["function"]["arguments"].as_str().unwrap()).collect();
    assert_eq!(args, ARGS);
    let finishes: Vec<&Value> =
        events.iter().map(|e| &e["choices"][0]["finish_reason"]).filter(|f| !f.is_null()).collect();
    assert_eq!(finishes, [&json!("tool_calls")]);
    let last = events.last().unwrap();
    assert_eq!(last["edge"]["tool_calls_valid"], true, "{last}");
    assert_eq!(last["edge"]["tool_calls"][0]["arguments"], ARGS);
    assert_eq!(last["usage"]["completion_tokens"], pieces.len() as u64);
    assert_eq!(metric(&gw, r#"tool_calls_total{high_risk="false",model="general-chat",valid="true"}"#), Some(1.0));
    gw.stop().await;
}

#[tokio::test]
async fn a_tool_result_turn_reaches_the_engine_as_sent() {
    let (fake, gw) = gateway(Knobs::default(), "openai", "").await;
    let turn = json!([
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": null, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 4}"},
    ]);
    let mut body = body_with_tools(false);
    body["messages"] = turn.clone();
    let resp = post_chat(&gw, DEMO_KEY, &body).await;
    assert_eq!(resp.status(), 200);
    let seen = fake.stats.last_request.lock().unwrap().clone().unwrap();
    assert_eq!(seen["messages"], turn);

    // Ollama: the same turn in its own form (arguments as an object, the
    // tool result naming its tool).
    let (fake, gw2) = gateway(Knobs::default(), "ollama", "").await;
    let resp = post_chat(&gw2, DEMO_KEY, &body).await;
    assert_eq!(resp.status(), 200);
    let seen = fake.stats.last_request.lock().unwrap().clone().unwrap();
    assert_eq!(seen["tools"], json!([weather_tool(), ping_tool()]));
    let call = &seen["messages"][1]["tool_calls"][0]["function"];
    assert_eq!(call["name"], "get_weather");
    assert_eq!(call["arguments"], json!({"city": "Oslo", "days": 3}));
    assert_eq!(seen["messages"][2]["role"], "tool");
    assert_eq!(seen["messages"][2]["tool_name"], "get_weather");
    assert_eq!(seen["messages"][2]["content"], "{\"temp\": 4}");

    // A tool result without the call it answers is refused.
    body["messages"][2].as_object_mut().unwrap().remove("tool_call_id");
    let resp = post_chat(&gw, DEMO_KEY, &body).await;
    assert_eq!(resp.status(), 400);
    let v: Value = resp.json().await.unwrap();
    assert!(v["error"]["message"].as_str().unwrap().contains("tool_call_id"), "{v}");
    gw.stop().await;
    gw2.stop().await;
}

#[tokio::test]
async fn schema_violations_and_unknown_tools_are_marked_invalid() {
    let calls = [("get_weather", r#"{"city": 5}"#), ("launch_rocket", "{}"), ("get_weather", "{\"city\": ")];
    let (_fake, gw) = gateway(calling(&calls), "openai", "").await;
    for stream in [false, true] {
        let resp = post_chat(&gw, DEMO_KEY, &body_with_tools(stream)).await;
        assert_eq!(resp.status(), 200);
        let edge = if stream {
            let (events, _) = read_sse(resp).await;
            events.last().unwrap()["edge"].clone()
        } else {
            let v: Value = resp.json().await.unwrap();
            // Invalid calls are still given to the client, marked.
            assert_eq!(v["choices"][0]["message"]["tool_calls"].as_array().unwrap().len(), 3, "{v}");
            v["edge"].clone()
        };
        assert_eq!(edge["tool_calls_valid"], false, "{edge}");
        let calls = edge["tool_calls"].as_array().unwrap();
        assert_eq!(calls[0]["error"], "schema_mismatch", "{edge}");
        assert!(calls[0]["error_detail"].as_str().unwrap().starts_with("arguments/city"), "{edge}");
        assert_eq!(calls[1]["error"], "unknown_tool");
        assert_eq!(calls[2]["error"], "invalid_json");
        assert!(calls.iter().all(|c| c["valid"] == false));
    }
    assert_eq!(metric(&gw, r#"tool_calls_total{high_risk="false",model="general-chat",valid="false"}"#), Some(6.0));
    gw.stop().await;
}

/// Review M4: the stored record (this gateway keeps no answer text) holds
/// no argument value, not even inside the verdict's detail, and the
/// model's name of an undeclared tool only escaped and cut.
#[tokio::test]
async fn the_record_of_an_invalid_call_holds_no_argument_value() {
    let bad_name = format!("launch\nrocket-{}", "y".repeat(300));
    let calls = [("get_weather", r#"{"city": "x", "days": "Oslo-secret"}"#), (bad_name.as_str(), "{}")];
    let (_fake, gw) = gateway(calling(&calls), "openai", "").await;
    let resp = post_chat(&gw, DEMO_KEY, &body_with_tools(false)).await;
    assert_eq!(resp.status(), 200);
    let task_id = resp.headers()["x-task-id"].to_str().unwrap().to_string();
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["edge"]["tool_calls"][0]["error"], "schema_mismatch", "{v}");
    gw.store().flush().await;
    let rec = gw.store().get(&task_id).await.unwrap().unwrap();
    let result = serde_json::to_value(rec.result.unwrap()).unwrap();
    let calls = &result["tool_calls"];
    assert!(!calls.to_string().contains("Oslo-secret"), "{calls}");
    assert_eq!(calls[0]["error_detail"], "arguments/days: fails 'type' (schema /properties/days/type)", "{calls}");
    let name = calls[1]["name"].as_str().unwrap();
    assert!(!name.contains('\n') && name.len() < 70 && name.starts_with("launch\\nrocket-"), "{name:?}");
    assert!(!calls[1]["error_detail"].as_str().unwrap().contains("rocket"), "{calls}");
    gw.stop().await;
}

/// Review M5: `tool_choice` and `parallel_tool_calls` are held to: a call
/// they forbid is marked `tool_choice_violation`, and a required call the
/// model did not make leaves `tool_calls_valid` false.
#[tokio::test]
async fn calls_that_break_tool_choice_are_marked_invalid() {
    let (fake, gw) = gateway(calling(&[("get_weather", ARGS), ("ping", "")]), "openai", "").await;
    let cases = [
        (json!("none"), true, [false, false]),
        (json!({"type": "function", "function": {"name": "ping"}}), true, [false, true]),
        (json!("auto"), false, [true, false]),
        (json!("required"), true, [true, true]),
    ];
    for (choice, parallel, valid) in cases {
        let mut body = body_with_tools(false);
        body["tool_choice"] = choice.clone();
        body["parallel_tool_calls"] = json!(parallel);
        let v: Value = post_chat(&gw, DEMO_KEY, &body).await.json().await.unwrap();
        let calls = v["edge"]["tool_calls"].as_array().unwrap_or_else(|| panic!("{v}"));
        for (c, want) in calls.iter().zip(valid) {
            assert_eq!(c["valid"], want, "{choice} {parallel}: {v}");
            if !want {
                assert_eq!(c["error"], "tool_choice_violation", "{choice}: {v}");
            }
        }
        assert_eq!(v["edge"]["tool_calls_valid"], valid.iter().all(|x| *x), "{choice}: {v}");
    }
    // "required", and the model answers with text only.
    fake.set(|k| *k = Knobs::default());
    let mut body = body_with_tools(false);
    body["tool_choice"] = json!("required");
    let v: Value = post_chat(&gw, DEMO_KEY, &body).await.json().await.unwrap();
    assert_eq!(v["edge"]["tool_calls_valid"], false, "{v}");
    gw.stop().await;
}

/// Review M5: Ollama's API has no `tool_choice` nor `parallel_tool_calls`;
/// a request that sets them to anything but the default is refused naming
/// the model, not run with them dropped.
#[tokio::test]
async fn an_ollama_model_refuses_a_tool_choice_it_would_drop() {
    let (fake, gw) = gateway(calling(&[("get_weather", ARGS)]), "ollama", "").await;
    for (field, value) in
        [("tool_choice", json!("required")), ("tool_choice", json!("none")), ("parallel_tool_calls", json!(false))]
    {
        let mut body = body_with_tools(false);
        body[field] = value.clone();
        let resp = post_chat(&gw, DEMO_KEY, &body).await;
        assert_eq!(resp.status(), 400, "{field}={value}");
        let v: Value = resp.json().await.unwrap();
        assert_eq!(error_code(&v), "INVALID_REQUEST");
        assert!(v["error"]["message"].as_str().unwrap().contains("model 'general-chat'"), "{v}");
    }
    assert_eq!(fake.requests(), 0);
    // The defaults pass.
    assert_eq!(post_chat(&gw, DEMO_KEY, &body_with_tools(false)).await.status(), 200);
    gw.stop().await;
}

#[tokio::test]
async fn an_application_may_declare_only_its_allowed_tools() {
    let (fake, gw) = gateway(Knobs::default(), "openai", "allowed_tools = [\"get_weather\"]").await;
    let resp = post_chat(&gw, DEMO_KEY, &body_with_tools(false)).await;
    assert_eq!(resp.status(), 403);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(error_code(&v), "PERMISSION_DENIED");
    assert!(v["error"]["message"].as_str().unwrap().contains("'ping'"), "{v}");
    assert_eq!(fake.requests(), 0, "never reached the engine");
    let mut body = body_with_tools(false);
    body["tools"] = json!([weather_tool()]);
    assert_eq!(post_chat(&gw, DEMO_KEY, &body).await.status(), 200);
    // Another application of the config has no list: any tool.
    assert_eq!(post_chat(&gw, OPS_KEY, &body_with_tools(false)).await.status(), 200);
    gw.stop().await;
}

#[tokio::test]
async fn high_risk_calls_come_back_marked_for_confirmation() {
    let knobs = calling(&[("get_weather", ARGS), ("ping", "")]);
    let (_fake, gw) = gateway(knobs, "openai", "high_risk_tools = [\"ping\"]").await;
    let resp = post_chat(&gw, DEMO_KEY, &body_with_tools(false)).await;
    assert_eq!(resp.status(), 200);
    let task_id = resp.headers()["x-task-id"].to_str().unwrap().to_string();
    let v: Value = resp.json().await.unwrap();
    let calls = v["edge"]["tool_calls"].as_array().unwrap();
    assert!(calls[0].get("requires_confirmation").is_none(), "{v}");
    assert_eq!(calls[1]["name"], "ping");
    assert_eq!(calls[1]["requires_confirmation"], true, "{v}");
    assert_eq!(v["edge"]["tool_calls_valid"], true);
    assert_eq!(metric(&gw, r#"tool_calls_total{high_risk="true",model="general-chat",valid="true"}"#), Some(1.0));
    // The task's record says so (the audit of what the model asked for).
    let rec = gw.store().get(&task_id).await.unwrap().unwrap();
    let last = rec.transitions.last().unwrap();
    assert!(last.reason.contains("1 high-risk (requires confirmation)"), "{:?}", last.reason);
    gw.stop().await;
}

#[tokio::test]
async fn a_model_without_tool_support_refuses_tools_by_name() {
    let fake = FakeEngine::start_with(calling(&[("get_weather", ARGS)])).await;
    // `tools` is off by default.
    let gw = TestGateway::with_engine(&fake.url(), "openai", "").await;
    gw.wait_ready().await;
    assert_eq!(models_say_tools(&gw).await, false);
    let resp = post_chat(&gw, DEMO_KEY, &body_with_tools(true)).await;
    assert_eq!(resp.status(), 400);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(error_code(&v), "INVALID_REQUEST");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("'general-chat'") && msg.contains("'fake'"), "{msg}");
    assert_eq!(fake.requests(), 0);
    // Without tools the same model answers.
    assert_eq!(post_chat(&gw, DEMO_KEY, &chat_body(false)).await.status(), 200);
    gw.stop().await;

    // One instance of two without tools: never routed there, so refused.
    let other = FakeEngine::start().await;
    let gw = TestGateway::with_engine_edit(&fake.url(), "openai", "", |t| {
        tools_on("")(t).replace("instances = [\"fake\"]", "instances = [\"fake\", \"plain\"]")
            + &format!("[engines.plain]\ntype = \"openai\"\nbase_url = \"{}\"\nmodel = \"m\"\n", other.url())
    })
    .await;
    assert_eq!(models_say_tools(&gw).await, false, "one instance without tools: not advertised");
    let resp = post_chat(&gw, DEMO_KEY, &body_with_tools(false)).await;
    assert_eq!(resp.status(), 400);
    let v: Value = resp.json().await.unwrap();
    assert!(v["error"]["message"].as_str().unwrap().contains("'plain'"), "{v}");
    gw.stop().await;
}

#[tokio::test]
async fn bad_tool_declarations_are_invalid_requests() {
    let (fake, gw) = gateway(Knobs::default(), "openai", "").await;
    let cases = [
        (json!({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}), "tools[0].function.name"),
        (
            json!({"tools": [{"type": "function", "function": {"name": "a", "parameters": {"type": "nope"}}}]}),
            "JSON schema",
        ),
        (
            json!({"tools": [ping_tool()], "tool_choice": {"type": "function", "function": {"name": "other"}}}),
            "does not declare",
        ),
        (json!({"tools": [ping_tool()], "parallel_tool_calls": "yes"}), "parallel_tool_calls"),
        (json!({"functions": [{"name": "a"}]}), "'functions'"),
    ];
    for (extra, want) in cases {
        let mut body = chat_body(false);
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let resp = post_chat(&gw, DEMO_KEY, &body).await;
        assert_eq!(resp.status(), 400, "{extra}");
        let v: Value = resp.json().await.unwrap();
        assert_eq!(error_code(&v), "INVALID_REQUEST");
        assert!(v["error"]["message"].as_str().unwrap().contains(want), "{extra}: {v}");
    }
    assert_eq!(fake.requests(), 0);
    gw.stop().await;
}

/// The task's event log carries the pieces: a client that follows the task
/// later (`GET /v1/tasks/{id}/events`) gets them in order, as MQTT/NATS do.
#[tokio::test]
async fn the_task_event_log_replays_tool_call_pieces() {
    let (_fake, gw) = gateway(calling(&[("get_weather", ARGS)]), "openai", "").await;
    let resp = post_chat(&gw, DEMO_KEY, &body_with_tools(false)).await;
    let task_id = resp.headers()["x-task-id"].to_str().unwrap().to_string();
    assert_eq!(resp.status(), 200);
    let resp =
        client().get(format!("{}/v1/tasks/{task_id}/events", gw.base_url)).bearer_auth(DEMO_KEY).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    let (events, _) = read_sse(resp).await;
    let pieces: Vec<&Value> = events.iter().filter(|e| e["type"] == "tool_call").collect();
    for e in &events {
        mqtt_support::validate(&format!("event-{}", e["type"].as_str().unwrap()), e);
    }
    assert_eq!(pieces[0]["name"], "get_weather");
    let args: String = pieces.iter().map(|p| p["arguments"].as_str().unwrap()).collect();
    assert_eq!(args, ARGS);
    gw.stop().await;
}

#[tokio::test]
async fn mqtt_devices_get_tool_call_events_and_the_checked_calls() {
    use mqtt_support::{check_stream, device, mqtt_toml, request, D1, V};
    let fake = FakeEngine::start_with(calling(&[("get_weather", r#"{"city": 1}"#)])).await;
    let gw = TestGateway::with_engine_edit(&fake.url(), "openai", &mqtt_toml("coalesce_ms = 0"), tools_on("")).await;
    gw.wait_ready().await;
    let addr = gw.running.as_ref().unwrap().mqtt.expect("mqtt is configured").mqtt;
    let mut d = device(addr, V::V5, D1).await;
    d.subscribe(&d.topic("res/#")).await;
    let mut req = request("tools-1");
    req["tools"] = json!([weather_tool()]);
    mqtt_support::validate("request", &req);
    d.publish(&d.topic("req"), req.to_string()).await;
    // Every message is checked against topics/schemas on arrival.
    let events = d.stream(&d.topic("res/tools-1")).await;
    check_stream(&events);
    let pieces: Vec<&Value> = events.iter().filter(|e| e["type"] == "tool_call").collect();
    assert!(pieces.len() > 1, "{events:#?}");
    assert_eq!((pieces[0]["id"].as_str(), pieces[0]["name"].as_str()), (Some("call_fake_0"), Some("get_weather")));
    let args: String = pieces.iter().map(|p| p["arguments"].as_str().unwrap()).collect();
    assert_eq!(args, r#"{"city": 1}"#);
    let done = events.last().unwrap();
    assert_eq!(done["type"], "done");
    assert_eq!(done["result"]["tool_calls_valid"], false);
    assert_eq!(done["result"]["tool_calls"][0]["error"], "schema_mismatch");
    assert_eq!(done["result"]["finish_reason"], "tool_calls");
    gw.stop().await;
}

/// Review L5: on MQTT the pieces of a tool call coalesce like text
/// (`coalesce_ms`): the first piece goes out at once, the rest of a call's
/// arguments in as few messages as the window allows, never mixing two
/// calls, each call's id and name once, in its first message.
#[tokio::test]
async fn mqtt_coalesces_the_pieces_of_each_tool_call() {
    use mqtt_support::{check_stream, device, mqtt_toml, request, D1, V};
    let long = r#"{"city": "Llanfairpwllgwyngyll", "unit": "celsius"}"#;
    let fake = FakeEngine::start_with(calling(&[("get_weather", long), ("ping", "{}")])).await;
    // A window far longer than the answer takes: only a change of call
    // (or the end) sends what is held.
    let gw = TestGateway::with_engine_edit(&fake.url(), "openai", &mqtt_toml("coalesce_ms = 5000"), tools_on("")).await;
    gw.wait_ready().await;
    let addr = gw.running.as_ref().unwrap().mqtt.expect("mqtt is configured").mqtt;
    let mut d = device(addr, V::V5, D1).await;
    d.subscribe(&d.topic("res/#")).await;
    let mut req = request("tools-coalesced");
    req["tools"] = json!([weather_tool(), ping_tool()]);
    d.publish(&d.topic("req"), req.to_string()).await;
    let events = d.stream(&d.topic("res/tools-coalesced")).await;
    check_stream(&events);
    let pieces: Vec<&Value> = events.iter().filter(|e| e["type"] == "tool_call").collect();
    // The engine sent 1 + 11 pieces for the first call and 1 + 1 for the
    // second: at most 2 messages per call now.
    assert!(pieces.len() <= 4, "{} messages: {pieces:#?}", pieces.len());
    for (i, (id, name, args)) in
        [("call_fake_0", "get_weather", long), ("call_fake_1", "ping", "{}")].iter().enumerate()
    {
        let of: Vec<&&Value> = pieces.iter().filter(|p| p["index"] == i).collect();
        assert_eq!((of[0]["id"].as_str(), of[0]["name"].as_str()), (Some(*id), Some(*name)), "{of:#?}");
        assert!(of[1..].iter().all(|p| p.get("id").is_none() && p.get("name").is_none()), "{of:#?}");
        let joined: String = of.iter().map(|p| p["arguments"].as_str().unwrap()).collect();
        assert_eq!(&joined, args);
    }
    // Calls do not interleave.
    let order: Vec<u64> = pieces.iter().map(|p| p["index"].as_u64().unwrap()).collect();
    assert!(order.windows(2).all(|w| w[0] <= w[1]), "{order:?}");
    assert_eq!(events.last().unwrap()["type"], "done");
    gw.stop().await;
}

#[tokio::test]
async fn nats_callers_get_tool_call_events_and_the_checked_calls() {
    let nats = NatsServer::start(false).await;
    let fake = FakeEngine::start_with(calling(&[("get_weather", ARGS)])).await;
    let extra = format!("\n[nats]\nurl = \"{}\"\n", nats.url());
    let gw = TestGateway::with_engine_edit(&fake.url(), "openai", &extra, tools_on("")).await;
    gw.wait_ready().await;
    gw.nats().wait_for(BusState::Connected).await;
    let client = async_nats::connect(nats.url()).await.unwrap();
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Authorization", format!("Bearer {DEMO_KEY}").as_str());
    let mut req = mqtt_support::request("nats-tools-1");
    req["tools"] = json!([weather_tool()]);
    let mut events = Vec::new();
    'call: for _ in 0..200 {
        let inbox = client.new_inbox();
        let mut sub = client.subscribe(inbox.clone()).await.unwrap();
        let payload = serde_json::to_vec(&req).unwrap().into();
        client.publish_with_reply_and_headers("ai.v1.chat", inbox, headers.clone(), payload).await.unwrap();
        loop {
            let m = tokio::time::timeout(Duration::from_secs(20), sub.next()).await.expect("an answer").unwrap();
            if m.status == Some(async_nats::StatusCode::NO_RESPONDERS) {
                // Not subscribed yet right after the connect: ask again.
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue 'call;
            }
            let kind = m.headers.as_ref().and_then(|h| h.get("Edgeway-Event")).map(|v| v.as_str().to_string());
            if kind.as_deref() == Some("keepalive") {
                continue;
            }
            let v: Value = serde_json::from_slice(&m.payload).unwrap();
            assert_eq!(kind.as_deref(), v["type"].as_str(), "the header names the event");
            mqtt_support::validate(&format!("event-{}", v["type"].as_str().unwrap()), &v);
            let end = v["type"] == "done" || v["type"] == "error";
            events.push(v);
            if end {
                break 'call;
            }
        }
    }
    mqtt_support::check_stream(&events);
    let pieces: Vec<&Value> = events.iter().filter(|e| e["type"] == "tool_call").collect();
    let args: String = pieces.iter().map(|p| p["arguments"].as_str().unwrap()).collect();
    assert_eq!(args, ARGS);
    let done = events.last().unwrap();
    assert_eq!(done["result"]["tool_calls_valid"], true, "{done}");
    assert_eq!(done["result"]["tool_calls"][0]["arguments"], ARGS);
    gw.stop().await;
}

/// A queued idempotent task keeps its tools across a restart (they are in
/// its stored request) and runs with them; if the restarted gateway's
/// engine no longer does tools, the task ends failed instead of running
/// without them.
#[tokio::test]
async fn a_queued_task_keeps_its_tools_across_a_restart() {
    use edgeway::config::Config;
    use edgeway::testing::{config_toml, TempDir};
    for tools_after in [true, false] {
        let fake = FakeEngine::start_with(Knobs::slow(100_000, 20)).await;
        let dir = TempDir::new("edgeway-tools-restart");
        let text = tools_on("")(config_toml(&fake.url(), "openai", &dir.0, ""))
            .replace("max_concurrency = 2", "max_concurrency = 1");
        let after = if tools_after { text.clone() } else { text.replace("tools = true", "tools = false") };
        let load = |t: &str| Config::from_toml_str(t, std::iter::empty(), std::path::Path::new(".")).unwrap();
        let gw = TestGateway::start(load(&text)).await;
        gw.wait_ready().await;
        let submit = |body: Value| {
            let url = format!("{}/v1/tasks", gw.base_url);
            async move {
                let v: Value =
                    client().post(url).bearer_auth(DEMO_KEY).json(&body).send().await.unwrap().json().await.unwrap();
                v["task_id"].as_str().unwrap_or_else(|| panic!("{v}")).to_string()
            }
        };
        let running = submit(chat_body(false)).await;
        gw.wait_for_state(&running, TaskState::Streaming).await;
        let mut keyed = body_with_tools(false);
        keyed["idempotency_key"] = json!("tools-after-restart");
        let queued = submit(keyed).await;
        gw.wait_for_state(&queued, TaskState::Queued).await;
        gw.stop().await;

        fake.set(|k| *k = calling(&[("get_weather", ARGS)]));
        let gw = TestGateway::start(load(&after)).await;
        if tools_after {
            gw.wait_for_state(&queued, TaskState::Succeeded).await;
            let seen = fake.stats.last_request.lock().unwrap().clone().unwrap();
            assert_eq!(seen["tools"], json!([weather_tool(), ping_tool()]));
            gw.store().flush().await;
            let rec = gw.store().get(&queued).await.unwrap().unwrap();
            let result = serde_json::to_value(rec.result.unwrap()).unwrap();
            assert_eq!(result["tool_calls_valid"], true, "{result}");
        } else {
            gw.wait_for_state(&queued, TaskState::Failed).await;
            assert_eq!(fake.requests(), 1, "only the first, cancelled task reached the engine");
        }
        gw.stop().await;
    }
}

/// Review M3: a task queued with tools is held, after a restart, to
/// admission's rules under the config of the new run: it never runs on a
/// fallback model whose engine does no tools (admission would have kept
/// it off smaller models), and a tool its application may no longer
/// declare ends it FAILED saying why.
#[tokio::test]
async fn a_recovered_task_with_tools_keeps_admissions_rules() {
    use edgeway::config::Config;
    use edgeway::testing::{config_toml, TempDir};
    for case in ["fallback", "allowed"] {
        let fake = FakeEngine::start_with(Knobs::slow(100_000, 20)).await;
        let small = FakeEngine::start().await;
        let dir = TempDir::new("edgeway-tools-recover");
        let text = tools_on("")(config_toml(&fake.url(), "openai", &dir.0, ""))
            .replace("max_concurrency = 2", "max_concurrency = 1");
        let after = match case {
            // A smaller model whose engine does no tools (tools = false by default).
            "fallback" => format!(
                "{}fallback_models = [\"small-chat\"]\n[engines.small]\ntype = \"openai\"\nbase_url = \"{}\"\n\
                 model = \"small-model\"\n[models.small-chat]\ninstances = [\"small\"]\ncontext_tokens = 2048\n\
                 max_output_tokens = 256\n",
                text.replace("default_priority = \"P2\"", "default_priority = \"P2\"\nallow_smaller_model = true"),
                small.url()
            ),
            _ => text
                .replace("default_priority = \"P2\"", "default_priority = \"P2\"\nallowed_tools = [\"get_weather\"]"),
        };
        let load = |t: &str| Config::from_toml_str(t, std::iter::empty(), std::path::Path::new(".")).unwrap();
        let gw = TestGateway::start(load(&text)).await;
        gw.wait_ready().await;
        let submit = |body: Value| {
            let url = format!("{}/v1/tasks", gw.base_url);
            async move {
                let v: Value =
                    client().post(url).bearer_auth(DEMO_KEY).json(&body).send().await.unwrap().json().await.unwrap();
                v["task_id"].as_str().unwrap_or_else(|| panic!("{v}")).to_string()
            }
        };
        let running = submit(chat_body(false)).await;
        gw.wait_for_state(&running, TaskState::Streaming).await;
        let mut keyed = body_with_tools(false);
        keyed["idempotency_key"] = json!("tools-recovered");
        let queued = submit(keyed).await;
        gw.wait_for_state(&queued, TaskState::Queued).await;
        gw.stop().await;

        // The big model's engine is down and fails every call: only a
        // smaller model could answer.
        if case == "fallback" {
            fake.set(|k| *k = Knobs { healthy: false, fail_status: Some(500), ..Knobs::default() });
        }
        let gw = TestGateway::start(load(&after)).await;
        gw.wait_for_state(&queued, TaskState::Failed).await;
        assert_eq!(small.requests(), 0, "{case}: the tools never went to an engine without tool support");
        if case == "allowed" {
            assert_eq!(fake.requests(), 1, "only the first, cancelled task reached the engine");
            let rec = gw.store().get(&queued).await.unwrap().unwrap();
            let last = rec.transitions.last().unwrap();
            assert!(last.reason.contains("may no longer declare tool 'ping'"), "{:?}", last.reason);
        }
        gw.stop().await;
    }
}

/// Review L7: the tool calls of earlier assistant turns and the tool
/// results are checked: their shape, and their names against the
/// application's `allowed_tools` (a history naming a forbidden tool is as
/// much a use of it as declaring it).
#[tokio::test]
async fn earlier_tool_calls_and_results_are_checked() {
    let (fake, gw) = gateway(Knobs::default(), "openai", "allowed_tools = [\"get_weather\"]").await;
    let call = |name: &str| json!({"id": "c1", "type": "function", "function": {"name": name, "arguments": "{}"}});
    let with = |messages: Value| {
        let mut body = chat_body(false);
        body["tools"] = json!([weather_tool()]);
        body["messages"] = messages;
        body
    };
    let user = json!({"role": "user", "content": "hi"});
    let result = json!({"role": "tool", "tool_call_id": "c1", "content": "sunny"});
    let cases = [
        (
            json!([user, {"role": "assistant", "content": null, "tool_calls": [call("launch_rocket")]}, result]),
            403,
            "'launch_rocket'",
        ),
        (
            json!([user, {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function"}]}, result]),
            400,
            "tool_calls[0].function",
        ),
        (
            json!([user, {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "x"}}}]}, result]),
            400,
            "arguments",
        ),
        (
            json!([user, {"role": "assistant", "content": null, "tool_calls": [{"id": 5, "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]}, result]),
            400,
            "tool_calls[0].id",
        ),
        (json!([{"role": "user", "content": "hi", "tool_calls": [call("get_weather")]}]), 400, "only an assistant"),
        (
            json!([user, {"role": "assistant", "content": null, "tool_calls": [call("get_weather")]}, {"role": "tool", "tool_call_id": "c1", "name": "launch_rocket", "content": "x"}]),
            403,
            "'launch_rocket'",
        ),
    ];
    for (messages, status, says) in cases {
        let resp = post_chat(&gw, DEMO_KEY, &with(messages.clone())).await;
        assert_eq!(resp.status(), status, "{messages}");
        let v: Value = resp.json().await.unwrap();
        assert!(v["error"]["message"].as_str().unwrap().contains(says), "{says}: {v}");
    }
    assert_eq!(fake.requests(), 0);
    let ok = json!([user, {"role": "assistant", "content": null, "tool_calls": [call("get_weather")]}, result]);
    assert_eq!(post_chat(&gw, DEMO_KEY, &with(ok)).await.status(), 200);
    gw.stop().await;
}

/// Review L6: client schemas that refer to themselves without end, or nest
/// past any use, are refused at admission (before they are compiled or a
/// call is checked against them), and the gateway goes on serving.
#[tokio::test]
async fn self_referencing_and_deep_schemas_are_refused() {
    let (fake, gw) = gateway(calling(&[("get_weather", ARGS)]), "openai", "").await;
    let mut deep = json!({"type": "object"});
    for _ in 0..40 {
        deep = json!({"type": "object", "properties": {"a": deep}});
    }
    let schemas = [
        json!({"$ref": "#"}),
        json!({"$ref": ""}),
        json!({"type": "object", "$defs": {"a": {"$ref": "#/$defs/a"}}, "properties": {"city": {"$ref": "#/$defs/a"}}}),
        json!({"allOf": [{"$ref": "#"}]}),
        deep,
    ];
    for schema in schemas {
        let mut body = chat_body(false);
        body["tools"] = json!([{"type": "function", "function": {"name": "get_weather", "parameters": schema}}]);
        let resp = post_chat(&gw, DEMO_KEY, &body).await;
        let status = resp.status();
        let v: Value = resp.json().await.unwrap();
        assert_eq!(status, 400, "{v}");
        assert!(v["error"]["message"].as_str().unwrap().contains("tools[0].function.parameters"), "{v}");
    }
    assert_eq!(fake.requests(), 0);
    // A recursive schema that consumes the arguments as it recurses is fine.
    let tree = json!({"type": "object", "properties": {"city": {"type": "string"}, "next": {"$ref": "#"}}});
    let mut body = chat_body(false);
    body["tools"] = json!([{"type": "function", "function": {"name": "get_weather", "parameters": tree}}]);
    let v: Value = post_chat(&gw, DEMO_KEY, &body).await.json().await.unwrap();
    assert_eq!(v["edge"]["tool_calls_valid"], true, "{v}");
    gw.stop().await;
}

/// Review L2: a repeated idempotency key replays the calls as they were
/// made, arguments included: a keyed task keeps its answer text (and so
/// its calls' arguments) whatever `store_prompts` says, so no call comes
/// back with `arguments: ""` marked valid. Passed before the review's fix
/// list: kept as the proof (a keyed task that stopped keeping its text
/// would fail it).
#[tokio::test]
async fn an_idempotent_repeat_replays_the_calls_with_their_arguments() {
    let (fake, gw) = gateway(calling(&[("get_weather", ARGS)]), "openai", "").await;
    let mut body = body_with_tools(false);
    body["idempotency_key"] = json!("tools-replay");
    let first: Value = post_chat(&gw, DEMO_KEY, &body).await.json().await.unwrap();
    gw.store().flush().await;
    for stream in [false, true] {
        body["stream"] = json!(stream);
        let resp = post_chat(&gw, DEMO_KEY, &body).await;
        assert_eq!(resp.status(), 200);
        let edge = if stream {
            read_sse(resp).await.0.last().unwrap()["edge"].clone()
        } else {
            let v: Value = resp.json().await.unwrap();
            assert_eq!(v["choices"][0]["message"]["tool_calls"], first["choices"][0]["message"]["tool_calls"], "{v}");
            v["edge"].clone()
        };
        assert_eq!(edge["tool_calls"][0]["arguments"], ARGS, "{edge}");
        assert_eq!(edge["tool_calls"][0]["valid"], true, "{edge}");
    }
    assert_eq!(fake.requests(), 1, "the repeats were replayed, not run");
    gw.stop().await;
}
