//! Retention per data class (`[store.retention.<class>]`), read from the
//! real SQLite file (and its WAL) of a whole gateway: the text of a class
//! whose `store_text` is false never reaches the file, over HTTP, MQTT and
//! NATS, even with `store_prompts = true`, a caller's idempotency key or a
//! device's derived one; the text of another class does.

mod common;
mod mqtt_support;

use std::path::Path;
use std::time::Duration;

use async_nats::{HeaderMap, StatusCode};
use common::{client, contains, file_bytes, DEMO_KEY};
use edgeway::config::Config;
use edgeway::ingress::nats::BusState;
use edgeway::testing::{FakeEngine, Knobs, NatsServer, TempDir, TestGateway};
use futures::StreamExt;
use mqtt_support::{check_stream, device, mqtt_toml, D1, V};
use serde_json::{json, Value};

/// The fake engine's answer.
const ANSWER: &str = "tok tok tok tok tok ";

fn chat(prompt: &str, class: &str) -> Value {
    json!({
        "model": "general-chat",
        "messages": [{"role": "user", "content": prompt}],
        "routing": {"data_class": class},
    })
}

/// One NATS chat call to its terminal event (retried while the service is
/// not subscribed yet): `done` or `error`, and its JSON.
async fn nats_call(client: &async_nats::Client, body: &Value) -> (String, Value) {
    let mut headers = HeaderMap::new();
    headers.insert("Authorization", format!("Bearer {DEMO_KEY}").as_str());
    let body = serde_json::to_vec(body).unwrap();
    for _ in 0..200 {
        let inbox = client.new_inbox();
        let mut sub = client.subscribe(inbox.clone()).await.unwrap();
        client.publish_with_reply_and_headers("ai.v1.chat", inbox, headers.clone(), body.clone().into()).await.unwrap();
        loop {
            let m = tokio::time::timeout(Duration::from_secs(20), sub.next()).await.expect("in time").expect("open");
            if m.status == Some(StatusCode::NO_RESPONDERS) {
                break;
            }
            let kind = m.headers.as_ref().and_then(|h| h.get("Edgeway-Event")).map(|v| v.as_str().to_string());
            if matches!(kind.as_deref(), Some("done" | "error")) {
                return (kind.unwrap(), serde_json::from_slice(&m.payload).unwrap());
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the edgeway service never answered");
}

/// Failed before (config without `[store.retention]`, and with only
/// `store_prompts = true` every prompt below was in the file).
#[tokio::test]
async fn the_text_of_a_class_that_may_not_be_stored_never_reaches_the_file() {
    let nats = NatsServer::start(false).await;
    let fake = FakeEngine::start_with(Knobs::default()).await;
    let extra = format!("{}\n[nats]\nurl = \"{}\"\n", mqtt_toml("coalesce_ms = 0"), nats.url());
    let gw = TestGateway::with_engine_edit(&fake.url(), "openai", &extra, |t| {
        let t = t.replace("[store]\n", "[store]\nstore_prompts = true\n");
        format!("{t}\n[store.retention.secret]\nstore_text = false\nidempotency_hours = 1\n")
    })
    .await;
    gw.wait_ready().await;
    gw.nats().wait_for(BusState::Connected).await;

    // HTTP, with a caller's key (which asks for the answer to be kept).
    let r = client()
        .post(format!("{}/v1/chat/completions", gw.base_url))
        .bearer_auth(DEMO_KEY)
        .header("Idempotency-Key", "http-secret-key")
        .json(&chat("SECRET-PROMPT-HTTP-51c2", "secret"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    // A control: a personal call's prompt is stored (store_prompts = true).
    let r = client()
        .post(format!("{}/v1/chat/completions", gw.base_url))
        .bearer_auth(DEMO_KEY)
        .json(&chat("CONTROL-PROMPT-HTTP-9e07", "personal"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);

    // MQTT: a device's request always has a (derived) key.
    let addr = gw.running.as_ref().unwrap().mqtt.expect("mqtt").mqtt;
    let mut d = device(addr, V::V4, D1).await;
    d.subscribe(&d.topic("res/#")).await;
    let mut req = chat("SECRET-PROMPT-MQTT-77ab", "secret");
    req["request_id"] = json!("secret-1");
    d.publish(&d.topic("req"), req.to_string()).await;
    assert_eq!(check_stream(&d.stream(&d.topic("res/secret-1")).await), ANSWER);

    // NATS, with a key too.
    let bus = async_nats::connect(nats.url()).await.unwrap();
    let mut req = chat("SECRET-PROMPT-NATS-3d90", "secret");
    req["idempotency_key"] = json!("nats-secret-key");
    assert_eq!(nats_call(&bus, &req).await.0, "done");

    gw.store().flush().await;
    let db = gw.db_path();
    {
        let c = rusqlite::Connection::open(&db).unwrap();
        let count = |sql: &str| -> i64 { c.query_row(sql, [], |r| r.get(0)).unwrap() };
        assert_eq!(count("SELECT COUNT(*) FROM tasks WHERE data_class = 'secret'"), 3, "each task knows its class");
        assert_eq!(count("SELECT COUNT(prompt_text) + COUNT(result_text) FROM tasks WHERE data_class = 'secret'"), 0);
        assert_eq!(count("SELECT COUNT(*) FROM idempotency"), 3, "the keys are kept, for the outcome");
        assert_eq!(count("SELECT COUNT(result_text) FROM idempotency"), 0, "without the answers");
        // `idempotency_hours = 1` caps the TTL (a day by default).
        assert_eq!(count("SELECT MAX(expires_at_ms - created_at_ms) FROM idempotency"), 3_600_000);
        assert_eq!(count("SELECT COUNT(prompt_text) FROM tasks WHERE data_class = 'personal'"), 1);
        // And its answer (review 16 M5: a class that may not store text
        // took the answer text of every class with it).
        assert_eq!(count("SELECT COUNT(result_text) FROM tasks WHERE data_class = 'personal'"), 1);
    }
    let bytes = file_bytes(&db);
    for prompt in ["SECRET-PROMPT-HTTP-51c2", "SECRET-PROMPT-MQTT-77ab", "SECRET-PROMPT-NATS-3d90"] {
        assert!(!contains(&bytes, prompt), "{prompt} is in the database file");
    }
    assert!(contains(&bytes, "CONTROL-PROMPT-HTTP-9e07"), "the control's prompt is stored: the check can see text");
    d.kill();
    gw.stop().await;
}

/// The README's table for the default policy (`store_prompts = false`, no
/// `[store.retention]`), per ingress: no prompt or answer text in the
/// task rows; a call without a key leaves no prompt bytes at all (HTTP,
/// NATS); no answer text reaches the file on any ingress (a device's
/// derived key keeps the outcome only). A device's request is kept to
/// re-queue it until it reaches an engine, then deleted.
#[tokio::test]
async fn the_default_policy_keeps_no_text_per_ingress() {
    let nats = NatsServer::start(false).await;
    let fake = FakeEngine::start_with(Knobs::default()).await;
    let extra = format!("{}\n[nats]\nurl = \"{}\"\n", mqtt_toml("coalesce_ms = 0"), nats.url());
    let gw = TestGateway::with_engine(&fake.url(), "openai", &extra).await;
    gw.wait_ready().await;
    gw.nats().wait_for(BusState::Connected).await;

    let r = client()
        .post(format!("{}/v1/chat/completions", gw.base_url))
        .bearer_auth(DEMO_KEY)
        .json(&chat("DEFAULT-PROMPT-HTTP-a1", "personal"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let addr = gw.running.as_ref().unwrap().mqtt.expect("mqtt").mqtt;
    let mut d = device(addr, V::V4, D1).await;
    d.subscribe(&d.topic("res/#")).await;
    let mut req = chat("DEFAULT-PROMPT-MQTT-b2", "personal");
    req["request_id"] = json!("default-1");
    d.publish(&d.topic("req"), req.to_string()).await;
    assert_eq!(check_stream(&d.stream(&d.topic("res/default-1")).await), ANSWER);
    let bus = async_nats::connect(nats.url()).await.unwrap();
    assert_eq!(nats_call(&bus, &chat("DEFAULT-PROMPT-NATS-c3", "personal")).await.0, "done");

    gw.store().flush().await;
    let db = gw.db_path();
    {
        let c = rusqlite::Connection::open(&db).unwrap();
        let count = |sql: &str| -> i64 { c.query_row(sql, [], |r| r.get(0)).unwrap() };
        assert_eq!(count("SELECT COUNT(*) FROM tasks"), 3);
        assert_eq!(count("SELECT COUNT(prompt_text) + COUNT(result_text) FROM tasks"), 0);
        assert_eq!(count("SELECT COUNT(result_text) FROM idempotency"), 0);
        assert_eq!(count("SELECT COUNT(*) FROM pending_requests"), 0, "deleted once it reached an engine");
    }
    let bytes = file_bytes(&db);
    for prompt in ["DEFAULT-PROMPT-HTTP-a1", "DEFAULT-PROMPT-NATS-c3"] {
        assert!(!contains(&bytes, prompt), "{prompt} is in the database file");
    }
    assert!(!contains(&bytes, "tok tok"), "an answer is in the database file");
    d.kill();
    gw.stop().await;
}

/// A chat call over HTTP with `key` as its `Idempotency-Key`: the status
/// and the body.
async fn keyed_call(gw: &TestGateway, key: &str, body: &Value) -> (u16, Value) {
    let r = client()
        .post(format!("{}/v1/chat/completions", gw.base_url))
        .bearer_auth(DEMO_KEY)
        .header("Idempotency-Key", key)
        .json(body)
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.json().await.unwrap())
}

/// A tool call's arguments are text the model wrote: for a class whose
/// `store_text` is false they stay out of the file (the task's
/// `result_json`), also for a call with its own idempotency key (which
/// keeps the rest of the outcome); another class's are stored. The caller
/// gets them whole either way. Failed before: the secret call's arguments
/// were in `tasks.result_json`.
#[tokio::test]
async fn the_tool_call_arguments_of_a_class_that_may_not_be_stored_never_reach_the_file() {
    let secret_args = r#"{"q": "TOOL-ARGS-SECRET-5b1e"}"#;
    let fake =
        FakeEngine::start_with(Knobs { tool_calls: vec![("lookup".into(), secret_args.into())], ..Knobs::default() })
            .await;
    let gw = TestGateway::with_engine_edit(&fake.url(), "openai", "", |t| {
        let t = t
            .replace("[store]\n", "[store]\nstore_prompts = true\n")
            .replace("health_interval_ms = 100", "health_interval_ms = 100\ntools = true");
        format!("{t}\n[store.retention.secret]\nstore_text = false\n")
    })
    .await;
    gw.wait_ready().await;
    let tools = json!([{"type": "function", "function": {"name": "lookup"}}]);
    let mut body = chat("look it up", "secret");
    body["tools"] = tools.clone();
    let (status, v) = keyed_call(&gw, "tool-secret", &body).await;
    assert_eq!(status, 200, "{v}");
    let call = &v["choices"][0]["message"]["tool_calls"][0];
    assert_eq!((&call["function"]["name"], &call["function"]["arguments"]), (&json!("lookup"), &json!(secret_args)));
    // A control: a personal call's arguments are stored (the check can see them).
    fake.set(|k| k.tool_calls = vec![("lookup".into(), r#"{"q": "TOOL-ARGS-CONTROL-8c2f"}"#.into())]);
    let mut body = chat("look it up", "personal");
    body["tools"] = tools;
    assert_eq!(keyed_call(&gw, "tool-control", &body).await.0, 200);

    gw.store().flush().await;
    let db = gw.db_path();
    {
        let c = rusqlite::Connection::open(&db).unwrap();
        let json: String =
            c.query_row("SELECT result_json FROM tasks WHERE data_class = 'secret'", [], |r| r.get(0)).unwrap();
        let meta: Value = serde_json::from_str(&json).unwrap();
        let stored = &meta["tool_calls"][0];
        assert_eq!((&stored["name"], &stored["arguments"]), (&json!("lookup"), &json!("")), "the outcome, no text");
    }
    let bytes = file_bytes(&db);
    assert!(!contains(&bytes, "TOOL-ARGS-SECRET-5b1e"), "the secret call's arguments are in the database file");
    assert!(contains(&bytes, "TOOL-ARGS-CONTROL-8c2f"), "the control's arguments are stored");
    gw.stop().await;
}

/// A repeat of a call's own idempotency key once the call's events are no
/// longer in memory (here: after a restart), where its answer text could
/// not be kept (`store_text = false`): the outcome, saying the text is
/// missing (`text_not_kept`) on HTTP (`edge.text_not_kept`, `content`
/// null) and NATS (`result.text_not_kept`), as MQTT says it; a repeat
/// whose text was kept gets it back. Nothing runs twice. Failed before:
/// HTTP answered 200 with an empty `content` and no flag, as if the model
/// had answered nothing (NATS likewise).
#[tokio::test]
async fn a_repeat_whose_answer_text_was_not_kept_says_so_on_http_and_nats() {
    let nats = NatsServer::start(false).await;
    let dir = TempDir::new("edgeway-retention-class");
    let fake = FakeEngine::start_with(Knobs::default()).await;
    let extra = format!("[nats]\nurl = \"{}\"\n", nats.url());
    let text = format!(
        "{}\n[store.retention.secret]\nstore_text = false\n",
        edgeway::testing::config_toml(&fake.url(), "openai", &dir.0, &extra)
    );
    let load = || Config::from_toml_str(&text, std::iter::empty(), Path::new(".")).unwrap();
    let nats_req = |key: &str| {
        let mut req = chat("a secret over NATS", "secret");
        req["idempotency_key"] = json!(key);
        req
    };
    let gw = TestGateway::start(load()).await;
    gw.wait_ready().await;
    gw.nats().wait_for(BusState::Connected).await;
    let bus = async_nats::connect(nats.url()).await.unwrap();
    let (status, v) = keyed_call(&gw, "replay-secret", &chat("a secret", "secret")).await;
    assert_eq!((status, &v["choices"][0]["message"]["content"]), (200, &json!(ANSWER)), "{v}");
    assert_eq!(v["edge"].get("text_not_kept"), None, "the first answer is whole: {v}");
    assert_eq!(keyed_call(&gw, "replay-control", &chat("not a secret", "personal")).await.0, 200);
    let (kind, done) = nats_call(&bus, &nats_req("replay-nats")).await;
    assert_eq!(kind, "done", "{done}");
    gw.stop().await;

    let gw = TestGateway::start(load()).await;
    gw.wait_ready().await;
    gw.nats().wait_for(BusState::Connected).await;
    let (status, v) = keyed_call(&gw, "replay-secret", &chat("a secret", "secret")).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["edge"]["status"], "SUCCEEDED", "{v}");
    assert_eq!(v["edge"]["text_not_kept"], true, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], Value::Null, "missing, not empty: {v}");
    let (status, v) = keyed_call(&gw, "replay-control", &chat("not a secret", "personal")).await;
    assert_eq!((status, &v["choices"][0]["message"]["content"]), (200, &json!(ANSWER)), "{v}");
    assert_eq!(v["edge"].get("text_not_kept"), None, "{v}");
    let (kind, done) = nats_call(&bus, &nats_req("replay-nats")).await;
    assert_eq!(kind, "done", "{done}");
    assert_eq!(done["result"]["text_not_kept"], true, "{done}");
    assert_eq!(fake.stats.requests.load(std::sync::atomic::Ordering::SeqCst), 3, "nothing ran twice");
    gw.stop().await;
}

/// `[store.retention.secret] sessions_hours = 1`: a session that held a
/// secret turn ends an hour after its last turn, and the store's retention
/// pass deletes it (row, history, memory) from the file; a session without
/// one lives the `[sessions]` day. The hours pass by moving the stored
/// sessions' times back, with edgeway stopped. Failed before: the key was
/// unknown (the config did not load).
#[tokio::test]
async fn a_session_that_held_a_secret_turn_is_gone_from_the_file_sessions_hours_after_its_last_turn() {
    let dir = TempDir::new("edgeway-retention-class");
    let fake = FakeEngine::start_with(Knobs::default()).await;
    let text = edgeway::testing::config_toml(&fake.url(), "openai", &dir.0, "")
        .replace("[store]\n", "[store]\nstore_prompts = true\n")
        + "\n[store.retention.secret]\nsessions_hours = 1\n";
    let load = || Config::from_toml_str(&text, std::iter::empty(), Path::new(".")).unwrap();
    let session = |gw: &TestGateway, method: reqwest::Method, user: &str, path: &str| {
        client()
            .request(method, format!("{}/v1/sessions{path}", gw.base_url))
            .bearer_auth(DEMO_KEY)
            .header("x-user-id", user)
    };
    let gw = TestGateway::start(load()).await;
    gw.wait_ready().await;
    let mut ids = Vec::new();
    for (user, class, memory) in
        [("alice", "secret", "SECRET-SESSION-MEMORY-1d4e"), ("bob", "personal", "CONTROL-SESSION-MEMORY-9a0b")]
    {
        let r = session(&gw, reqwest::Method::POST, user, "").json(&json!({})).send().await.unwrap();
        assert_eq!(r.status(), 201);
        let id = r.json::<Value>().await.unwrap()["id"].as_str().unwrap().to_string();
        let mut turn = chat("remember this", class);
        turn["session_id"] = json!(id);
        turn["metadata"] = json!({"user_id": user});
        assert_eq!(common::post_chat(&gw, DEMO_KEY, &turn).await.status(), 200);
        let path = format!("/{id}/memory");
        let r = session(&gw, reqwest::Method::POST, user, &path)
            .json(&json!({"key": "k", "content": memory}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 201);
        ids.push((user, id));
    }
    let view = |gw: &TestGateway, i: usize| {
        let (user, id) = &ids[i];
        session(gw, reqwest::Method::GET, user, &format!("/{id}")).send()
    };
    let v: Value = view(&gw, 0).await.unwrap().json().await.unwrap();
    assert_eq!(v["limits"]["idle_expiry_s"], 3600, "the secret turn lowered it: {v}");
    assert_eq!(v["expires_at"], v["last_used_at"].as_i64().unwrap() + 3600, "{v}");
    let v: Value = view(&gw, 1).await.unwrap().json().await.unwrap();
    assert_eq!(v["limits"]["idle_expiry_s"], 24 * 3600, "{v}");
    gw.store().flush().await;
    let db = gw.db_path();
    let before = file_bytes(&db);
    assert!(contains(&before, "SECRET-SESSION-MEMORY-1d4e"), "stored: the check can see it");
    gw.stop().await;

    // Two hours later.
    {
        let c = rusqlite::Connection::open(&db).unwrap();
        c.execute(
            "UPDATE sessions SET created_at_ms = created_at_ms - 7200000, last_used_ms = last_used_ms - 7200000, \
             expires_at_ms = expires_at_ms - 7200000",
            [],
        )
        .unwrap();
    }
    let gw = TestGateway::start(load()).await;
    gw.wait_ready().await;
    assert_eq!(view(&gw, 0).await.unwrap().status(), 404, "alice's session ended");
    assert_eq!(view(&gw, 1).await.unwrap().status(), 200, "bob's lives on");
    gw.store().purge_now().await;
    let c = rusqlite::Connection::open(&db).unwrap();
    let count = |sql: &str| -> i64 { c.query_row(sql, [], |r| r.get(0)).unwrap() };
    assert_eq!(count("SELECT COUNT(*) FROM sessions"), 1);
    assert_eq!(count("SELECT COUNT(*) FROM session_memory"), 1);
    let left: String = c.query_row("SELECT DISTINCT session_id FROM session_messages", [], |r| r.get(0)).unwrap();
    assert_eq!(left, ids[1].1, "bob's history only");
    // Purged rows are overwritten (`secure_delete`); older copies of their
    // pages leave the WAL at a checkpoint.
    let busy: i64 = c.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |r| r.get(0)).unwrap();
    assert_eq!(busy, 0);
    let after = file_bytes(&db);
    assert!(!contains(&after, "SECRET-SESSION-MEMORY-1d4e"), "alice's memory is still in the database file");
    assert!(contains(&after, "CONTROL-SESSION-MEMORY-9a0b"), "bob's stays");
    drop(c);
    gw.stop().await;
}
