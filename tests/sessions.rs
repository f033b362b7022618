//! Sessions (`/v1/sessions`) end to end against the fake engine, over real
//! sockets and a real SQLite file: the API, isolation between tenants,
//! applications and users (404, never 403), a turn appended after it ends
//! well and the next turn's prompt (as the engine received it) holding it,
//! a failed turn not appended, each limit with its own error code, what
//! the database file holds (deletion, `persist = false`, redaction, the
//! data policy) and a persisted session across a restart.

mod common;

use std::time::Duration;

use common::*;
use edgeway::config::Config;
use edgeway::testing::{config_toml, TempDir};
use serde_json::{json, Value};

const OTHER_KEY: &str = "sk-other-tenant";
const CARD: &str = "4111-1111-1111-1111";

/// `[applications.other]` in tenant `t2`, a redaction rule for `demo`,
/// the store keeping text, and `sessions` as the `[sessions]` keys.
fn edit(sessions: &str, store_prompts: bool) -> impl FnOnce(String) -> String {
    let other = hex::encode(edgeway::config::hash_api_key(OTHER_KEY));
    let sessions = sessions.to_string();
    move |t: String| {
        let t = t.replace("[store]\n", &format!("[store]\nstore_prompts = {store_prompts}\n"));
        let t =
            t.replace("[applications.demo]\n", "[applications.demo]\nredact = ['\\b\\d{4}-\\d{4}-\\d{4}-\\d{4}\\b']\n");
        format!(
            "{t}\n[applications.other]\ntenant = \"t2\"\napi_key_sha256 = [\"{other}\"]\n\
             max_priority = \"P1\"\ndefault_priority = \"P2\"\n[sessions]\n{sessions}\n"
        )
    }
}

async fn gateway(sessions: &str, store_prompts: bool) -> (FakeEngine, TestGateway) {
    let fake = FakeEngine::start().await;
    let gw = TestGateway::with_engine_edit(&fake.url(), "openai", "", edit(sessions, store_prompts)).await;
    gw.wait_ready().await;
    (fake, gw)
}

/// A call to the session API as `key`, acting for `user` (`x-user-id`).
async fn call(
    gw: &TestGateway,
    method: reqwest::Method,
    path: &str,
    key: &str,
    user: Option<&str>,
    body: Option<Value>,
) -> (u16, Value) {
    let mut req = client().request(method, format!("{}{path}", gw.base_url)).bearer_auth(key);
    if let Some(u) = user {
        req = req.header("x-user-id", u);
    }
    if let Some(b) = body {
        req = req.json(&b);
    }
    let resp = req.send().await.unwrap();
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(Value::Null))
}

async fn create(gw: &TestGateway, key: &str, user: Option<&str>, body: Value) -> String {
    let (status, v) = call(gw, reqwest::Method::POST, "/v1/sessions", key, user, Some(body)).await;
    assert_eq!(status, 201, "{v}");
    v["id"].as_str().unwrap().to_string()
}

async fn get(gw: &TestGateway, key: &str, user: Option<&str>, id: &str) -> (u16, Value) {
    call(gw, reqwest::Method::GET, &format!("/v1/sessions/{id}"), key, user, None).await
}

/// A chat turn of session `id` as `key` for `user` (`metadata.user_id`).
async fn turn(gw: &TestGateway, key: &str, user: Option<&str>, id: &str, messages: Value) -> (u16, Value) {
    let mut body = json!({"model": "general-chat", "messages": messages, "session_id": id, "max_tokens": 20});
    if let Some(u) = user {
        body["metadata"] = json!({"user_id": u});
    }
    let resp = post_chat(gw, key, &body).await;
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap())
}

fn user_msg(text: &str) -> Value {
    json!([{"role": "user", "content": text}])
}

/// Rows of `table` for session `id` in the database file.
async fn rows(gw: &TestGateway, table: &str, id: &str) -> i64 {
    gw.store().flush().await;
    let conn = rusqlite::Connection::open(gw.db_path()).unwrap();
    conn.query_row(&format!("SELECT COUNT(*) FROM {table} WHERE session_id = ?1"), [id], |r| r.get(0)).unwrap()
}

/// Every text column of the session tables, joined (for what the file holds).
async fn stored_text(gw: &TestGateway) -> String {
    gw.store().flush().await;
    let conn = rusqlite::Connection::open(gw.db_path()).unwrap();
    let mut out = String::new();
    for q in ["SELECT content FROM session_messages", "SELECT content FROM session_memory"] {
        let mut st = conn.prepare(q).unwrap();
        for r in st.query_map([], |r| r.get::<_, String>(0)).unwrap() {
            out.push_str(&r.unwrap());
            out.push('\n');
        }
    }
    out
}

#[tokio::test]
async fn a_session_is_created_shown_listed_and_deleted() {
    let (_fake, gw) = gateway("", true).await;
    let id = create(&gw, DEMO_KEY, None, json!({"metadata": {"topic": "pumps"}, "limits": {"max_messages": 10}})).await;
    assert!(id.starts_with("sess_"), "{id}");
    let (status, v) = get(&gw, DEMO_KEY, None, &id).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "session");
    assert_eq!(v["message_count"], 0);
    assert_eq!(v["tokens"], 0);
    assert_eq!(v["summary_version"], Value::Null);
    assert_eq!(v["metadata"], json!({"topic": "pumps"}));
    assert_eq!(v["limits"]["max_messages"], 10);
    assert_eq!(v["persist"], true);

    let (status, list) = call(&gw, reqwest::Method::GET, "/v1/sessions", DEMO_KEY, None, None).await;
    assert_eq!(status, 200);
    let ids: Vec<&str> = list["data"].as_array().unwrap().iter().map(|s| s["id"].as_str().unwrap()).collect();
    assert_eq!(ids, vec![id.as_str()]);

    let (status, v) = call(&gw, reqwest::Method::DELETE, &format!("/v1/sessions/{id}"), DEMO_KEY, None, None).await;
    assert_eq!(status, 200, "{v}");
    let (status, v) = get(&gw, DEMO_KEY, None, &id).await;
    assert_eq!((status, error_code(&v)), (404, "SESSION_NOT_FOUND"), "{v}");
    gw.stop().await;
}

#[tokio::test]
async fn a_turn_is_appended_and_the_next_prompt_holds_it() {
    let (fake, gw) = gateway("", true).await;
    let id = create(&gw, DEMO_KEY, None, json!({})).await;
    let (status, v) = turn(&gw, DEMO_KEY, None, &id, user_msg("first question")).await;
    assert_eq!(status, 200, "{v}");
    let answer = v["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    assert!(!answer.is_empty());

    // At once: the turn is appended before the next one of the session
    // may begin.
    let messages = json!([{"role": "system", "content": "be brief"}, {"role": "user", "content": "second question"}]);
    let (status, v) = turn(&gw, DEMO_KEY, None, &id, messages).await;
    assert_eq!(status, 200, "{v}");
    let sent = fake.last_request().unwrap();
    let got: Vec<(String, String)> = sent["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (m["role"].as_str().unwrap().to_string(), m["content"].as_str().unwrap().to_string()))
        .collect();
    let want: Vec<(String, String)> = [
        ("system", "be brief"),
        ("user", "first question"),
        ("assistant", answer.as_str()),
        ("user", "second question"),
    ]
    .iter()
    .map(|(r, c)| (r.to_string(), c.to_string()))
    .collect();
    assert_eq!(got, want);

    let (_, v) = get(&gw, DEMO_KEY, None, &id).await;
    assert_eq!(v["message_count"], 4, "{v}");
    assert!(v["tokens"].as_u64().unwrap() > 0);
    assert_eq!(rows(&gw, "session_messages", &id).await, 4);
    gw.stop().await;
}

#[tokio::test]
async fn sessions_do_not_cross_tenants_applications_or_users() {
    let (fake, gw) = gateway("", true).await;
    let id = create(&gw, DEMO_KEY, Some("alice"), json!({})).await;
    let (status, v) = call(
        &gw,
        reqwest::Method::POST,
        &format!("/v1/sessions/{id}/memory"),
        DEMO_KEY,
        Some("alice"),
        Some(json!({"key": "pump", "tags": ["device"], "content": "alice's pump is P-7"})),
    )
    .await;
    assert_eq!(status, 201, "{v}");
    assert_eq!(v["source"], "demo/alice");
    let (status, _) = turn(&gw, DEMO_KEY, Some("alice"), &id, user_msg("alice asks")).await;
    assert_eq!(status, 200);
    let engine_calls = fake.requests();

    // Another user of the same application, the admin application of the
    // same tenant, and another tenant: none of them sees it, and none is
    // told it exists.
    for (key, user) in [(DEMO_KEY, Some("bob")), (DEMO_KEY, None), (OPS_KEY, Some("alice")), (OTHER_KEY, Some("alice"))]
    {
        let who = format!("{key} as {user:?}");
        let (status, v) = get(&gw, key, user, &id).await;
        assert_eq!((status, error_code(&v)), (404, "SESSION_NOT_FOUND"), "{who}: {v}");
        let path = format!("/v1/sessions/{id}/memory");
        let (status, v) = call(&gw, reqwest::Method::GET, &path, key, user, None).await;
        assert_eq!((status, error_code(&v)), (404, "SESSION_NOT_FOUND"), "{who}: {v}");
        let (status, v) = call(&gw, reqwest::Method::DELETE, &path, key, user, None).await;
        assert_eq!(status, 404, "{who}: {v}");
        let (status, v) = call(&gw, reqwest::Method::DELETE, &format!("/v1/sessions/{id}"), key, user, None).await;
        assert_eq!(status, 404, "{who}: {v}");
        let (status, list) = call(&gw, reqwest::Method::GET, "/v1/sessions", key, user, None).await;
        assert_eq!((status, list["data"].as_array().unwrap().len()), (200, 0), "{who}: {list}");
        let (status, v) = turn(&gw, key, user, &id, user_msg("let me in")).await;
        assert_eq!((status, error_code(&v)), (404, "SESSION_NOT_FOUND"), "{who}: {v}");
    }
    assert_eq!(fake.requests(), engine_calls, "no foreign turn reached the engine");

    // Alice's session is untouched.
    let (status, v) = get(&gw, DEMO_KEY, Some("alice"), &id).await;
    assert_eq!((status, v["message_count"].as_u64(), v["memory_entries"].as_u64()), (200, Some(2), Some(1)), "{v}");
    let path = format!("/v1/sessions/{id}/memory?tag=device");
    let (_, mem) = call(&gw, reqwest::Method::GET, &path, DEMO_KEY, Some("alice"), None).await;
    assert_eq!(mem["data"][0]["content"], "alice's pump is P-7", "{mem}");
    gw.stop().await;
}

#[tokio::test]
async fn a_failed_turn_is_not_appended() {
    let (fake, gw) = gateway("", true).await;
    let id = create(&gw, DEMO_KEY, None, json!({})).await;
    fake.set(|k| k.fail_status = Some(400));
    let (status, v) = turn(&gw, DEMO_KEY, None, &id, user_msg("this one fails")).await;
    assert_ne!(status, 200, "{v}");
    let (_, v) = get(&gw, DEMO_KEY, None, &id).await;
    assert_eq!(v["message_count"], 0, "{v}");
    assert_eq!(rows(&gw, "session_messages", &id).await, 0);

    fake.set(|k| k.fail_status = None);
    let (status, _) = turn(&gw, DEMO_KEY, None, &id, user_msg("this one works")).await;
    assert_eq!(status, 200);
    let sent = fake.last_request().unwrap();
    assert_eq!(sent["messages"].as_array().unwrap().len(), 1, "the failed turn is not in the prompt: {sent}");
    gw.stop().await;
}

#[tokio::test]
async fn each_limit_has_its_own_error() {
    let (_fake, gw) = gateway("max_per_user = 3\nmax_messages = 50", true).await;
    // Above the configured maxima.
    let (status, v) =
        call(&gw, reqwest::Method::POST, "/v1/sessions", DEMO_KEY, None, Some(json!({"limits": {"max_messages": 51}})))
            .await;
    assert_eq!((status, error_code(&v)), (400, "INVALID_REQUEST"), "{v}");

    let few = create(&gw, DEMO_KEY, None, json!({"limits": {"max_messages": 2}})).await;
    assert_eq!(turn(&gw, DEMO_KEY, None, &few, user_msg("one")).await.0, 200);
    let (status, v) = turn(&gw, DEMO_KEY, None, &few, user_msg("two")).await;
    assert_eq!((status, error_code(&v)), (409, "SESSION_MESSAGE_LIMIT"), "{v}");

    let small = create(&gw, DEMO_KEY, None, json!({"limits": {"max_tokens": 30}})).await;
    let (status, v) = turn(&gw, DEMO_KEY, None, &small, user_msg(&"words ".repeat(40))).await;
    assert_eq!((status, error_code(&v)), (409, "SESSION_TOKEN_LIMIT"), "{v}");

    let short = create(&gw, DEMO_KEY, None, json!({"limits": {"max_lifetime_s": 1}})).await;
    // The limit under test is a wall-clock one: let it pass.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let (status, v) = turn(&gw, DEMO_KEY, None, &short, user_msg("too late")).await;
    assert_eq!((status, error_code(&v)), (410, "SESSION_EXPIRED"), "{v}");
    let (status, v) = get(&gw, DEMO_KEY, None, &short).await;
    assert_eq!((status, error_code(&v)), (404, "SESSION_NOT_FOUND"), "an expired session is gone: {v}");

    // Three live sessions (the expired one is gone): one more, then the
    // user's limit.
    create(&gw, DEMO_KEY, None, json!({})).await;
    let (status, v) = call(&gw, reqwest::Method::POST, "/v1/sessions", DEMO_KEY, None, Some(json!({}))).await;
    assert_eq!((status, error_code(&v)), (409, "SESSION_LIMIT"), "{v}");
    // Another user has limits of its own.
    create(&gw, DEMO_KEY, Some("carol"), json!({})).await;
    gw.stop().await;
}

#[tokio::test]
async fn redaction_applies_before_storage_and_delete_removes_every_row() {
    let (fake, gw) = gateway("", true).await;
    let id = create(&gw, DEMO_KEY, None, json!({})).await;
    let (status, _) = turn(&gw, DEMO_KEY, None, &id, user_msg(&format!("my card is {CARD}"))).await;
    assert_eq!(status, 200);
    // The current call goes to the engine as it came; only what is kept
    // is redacted.
    assert!(fake.last_request().unwrap().to_string().contains(CARD));
    let path = format!("/v1/sessions/{id}/memory");
    let memory = json!({"key": "card", "content": format!("card {CARD} on file")});
    assert_eq!(call(&gw, reqwest::Method::POST, &path, DEMO_KEY, None, Some(memory)).await.0, 201);

    let text = stored_text(&gw).await;
    assert!(!text.contains(CARD), "{text}");
    assert_eq!(text.matches("[REDACTED]").count(), 2, "{text}");
    turn(&gw, DEMO_KEY, None, &id, user_msg("again")).await;
    let sent = fake.last_request().unwrap().to_string();
    assert!(sent.contains("my card is [REDACTED]") && !sent.contains(CARD), "{sent}");

    assert_eq!(rows(&gw, "sessions", &id).await, 1);
    let (status, _) = call(&gw, reqwest::Method::DELETE, &format!("/v1/sessions/{id}"), DEMO_KEY, None, None).await;
    assert_eq!(status, 200);
    for table in ["sessions", "session_messages", "session_memory"] {
        assert_eq!(rows(&gw, table, &id).await, 0, "{table}");
    }
    gw.stop().await;
}

#[tokio::test]
async fn a_session_that_does_not_persist_leaves_nothing_in_the_database() {
    let (_fake, gw) = gateway("", true).await;
    let id = create(&gw, DEMO_KEY, None, json!({"persist": false})).await;
    assert_eq!(turn(&gw, DEMO_KEY, None, &id, user_msg("off the record")).await.0, 200);
    let (_, v) = get(&gw, DEMO_KEY, None, &id).await;
    assert_eq!((v["persist"].as_bool(), v["message_count"].as_u64()), (Some(false), Some(2)), "{v}");
    for table in ["sessions", "session_messages", "session_memory"] {
        assert_eq!(rows(&gw, table, &id).await, 0, "{table}");
    }
    gw.stop().await;
}

#[tokio::test]
async fn without_store_prompts_a_session_lives_in_memory_only() {
    let (fake, gw) = gateway("", false).await;
    let id = create(&gw, DEMO_KEY, None, json!({"persist": true})).await;
    let (_, v) = get(&gw, DEMO_KEY, None, &id).await;
    assert_eq!(v["persist"], false, "the data policy keeps no text: {v}");
    assert_eq!(turn(&gw, DEMO_KEY, None, &id, user_msg("first")).await.0, 200);
    assert_eq!(turn(&gw, DEMO_KEY, None, &id, user_msg("second")).await.0, 200);
    assert_eq!(fake.last_request().unwrap()["messages"].as_array().unwrap().len(), 3);
    assert_eq!(rows(&gw, "sessions", &id).await, 0);
    assert_eq!(rows(&gw, "session_messages", &id).await, 0);
    gw.stop().await;
}

#[tokio::test]
async fn a_persisted_session_survives_a_restart() {
    let fake = FakeEngine::start().await;
    let dir = TempDir::new("edgeway-sessions");
    let text = edit("", true)(config_toml(&fake.url(), "openai", &dir.0, ""));
    let load = || Config::from_toml_str(&text, std::iter::empty(), std::path::Path::new(".")).unwrap();

    let gw = TestGateway::start(load()).await;
    gw.wait_ready().await;
    let id = create(&gw, DEMO_KEY, Some("dana"), json!({"metadata": {"k": 1}})).await;
    let gone = create(&gw, DEMO_KEY, Some("dana"), json!({"persist": false})).await;
    assert_eq!(turn(&gw, DEMO_KEY, Some("dana"), &id, user_msg("before the restart")).await.0, 200);
    let path = format!("/v1/sessions/{id}/memory");
    let memory = json!({"key": "site", "tags": ["loc"], "content": "hall 3"});
    assert_eq!(call(&gw, reqwest::Method::POST, &path, DEMO_KEY, Some("dana"), Some(memory)).await.0, 201);
    gw.stop().await;

    let gw = TestGateway::start(load()).await;
    gw.wait_ready().await;
    let (status, v) = get(&gw, DEMO_KEY, Some("dana"), &id).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!((v["message_count"].as_u64(), v["memory_entries"].as_u64()), (Some(2), Some(1)), "{v}");
    assert_eq!(v["metadata"], json!({"k": 1}));
    let (status, v) = get(&gw, DEMO_KEY, Some("dana"), &gone).await;
    assert_eq!(status, 404, "a session that did not persist is gone: {v}");
    assert_eq!(turn(&gw, DEMO_KEY, Some("dana"), &id, user_msg("after it")).await.0, 200);
    let sent = fake.last_request().unwrap().to_string();
    assert!(sent.contains("before the restart") && sent.contains("after it"), "{sent}");
    let (_, v) = get(&gw, DEMO_KEY, Some("dana"), &id).await;
    assert_eq!(v["message_count"], 4, "{v}");
    gw.stop().await;
}

#[tokio::test]
async fn turns_of_one_session_at_once_run_one_after_the_other() {
    let (fake, gw) = gateway("", true).await;
    fake.set(|k| k.token_delay = Duration::from_millis(20));
    let id = create(&gw, DEMO_KEY, None, json!({})).await;
    let (a, b) = tokio::join!(
        turn(&gw, DEMO_KEY, None, &id, user_msg("left")),
        turn(&gw, DEMO_KEY, None, &id, user_msg("right"))
    );
    assert_eq!((a.0, b.0), (200, 200), "{} {}", a.1, b.1);
    // The second turn saw the first one whole.
    let sent = fake.last_request().unwrap();
    assert_eq!(sent["messages"].as_array().unwrap().len(), 3, "{sent}");
    let (_, v) = get(&gw, DEMO_KEY, None, &id).await;
    assert_eq!(v["message_count"], 4, "{v}");
    gw.stop().await;
}

/// A turn after the first (the prompt holds history) repeated with the same
/// `Idempotency-Key` joins the first call's task: the same task id, one
/// engine call, the turn appended once. The key is judged on the caller's
/// own request, not on the assembled prompt (which the repeat would
/// assemble again, with the first call's answer in it).
#[tokio::test]
async fn a_repeated_turn_with_its_idempotency_key_joins_the_first() {
    let (fake, gw) = gateway("", true).await;
    let id = create(&gw, DEMO_KEY, None, json!({})).await;
    let (status, v) = turn(&gw, DEMO_KEY, None, &id, user_msg("first question")).await;
    assert_eq!(status, 200, "{v}");

    let body =
        json!({"model": "general-chat", "messages": user_msg("second question"), "session_id": id, "max_tokens": 20});
    let send = || {
        client()
            .post(format!("{}/v1/chat/completions", gw.base_url))
            .bearer_auth(DEMO_KEY)
            .header("Idempotency-Key", "turn-2")
            .json(&body)
            .send()
    };
    let before = fake.requests();
    let first = send().await.unwrap();
    assert_eq!(first.status().as_u16(), 200);
    let first: Value = first.json().await.unwrap();
    let again = send().await.unwrap();
    let status = again.status().as_u16();
    let again: Value = again.json().await.unwrap();
    assert_eq!(status, 200, "{again}");
    assert_eq!(first["edge"]["task_id"], again["edge"]["task_id"], "{first}\n{again}");
    assert_eq!(fake.requests() - before, 1, "the engine saw one call for the turn");
    let (_, v) = get(&gw, DEMO_KEY, None, &id).await;
    assert_eq!(v["message_count"], 4, "{v}");
    gw.stop().await;
}

/// A turn that ends in tool calls keeps the calls with its answer, and the
/// next call's tool result is kept after them: the engine's prompt of the
/// turn after holds user → assistant{tool_calls} → tool → assistant → user,
/// here and after a restart (the calls and the result's id are stored).
#[tokio::test]
async fn a_turn_ending_in_tool_calls_keeps_the_calls_and_the_next_tool_result() {
    const ARGS: &str = r#"{"city":"Oslo"}"#;
    let knobs = Knobs { tool_calls: vec![("get_weather".into(), ARGS.into())], ..Knobs::default() };
    let fake = FakeEngine::start_with(knobs).await;
    let dir = TempDir::new("edgeway-sessions");
    let text = edit("", true)(config_toml(&fake.url(), "openai", &dir.0, ""))
        .replace("health_interval_ms = 100\n", "health_interval_ms = 100\ntools = true\n");
    let load = || Config::from_toml_str(&text, std::iter::empty(), std::path::Path::new(".")).unwrap();
    let gw = TestGateway::start(load()).await;
    gw.wait_ready().await;
    let id = create(&gw, DEMO_KEY, None, json!({})).await;
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]);
    let body = json!({"model": "general-chat", "session_id": id, "max_tokens": 20, "tools": tools,
        "messages": user_msg("Weather in Oslo?")});
    let resp = post_chat(&gw, DEMO_KEY, &body).await;
    let status = resp.status().as_u16();
    let v: Value = resp.json().await.unwrap();
    assert_eq!(status, 200, "{v}");
    let call_id = v["choices"][0]["message"]["tool_calls"][0]["id"].as_str().unwrap().to_string();

    let result = json!([{"role": "tool", "tool_call_id": call_id, "content": "sunny"}]);
    let (status, v) = turn(&gw, DEMO_KEY, None, &id, result).await;
    assert_eq!(status, 200, "{v}");
    let answer = v["choices"][0]["message"]["content"].as_str().unwrap().to_string();

    let want = json!([
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": null, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "sunny"},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "thanks"},
    ]);
    // The tool's output is untrusted content (review 14 L5): in the
    // prompt, fenced where it stands, with the fence notice in a system
    // message before the turns; kept as it came in the history.
    let sent_turns = |sent: &Value| {
        let sent = sent.as_array().unwrap();
        assert_eq!(sent[0]["role"], "system", "{sent:?}");
        assert!(sent[0]["content"].as_str().unwrap().contains("untrusted data"), "{sent:?}");
        let mut turns = sent[1..].to_vec();
        let tool = turns[2]["content"].as_str().unwrap().to_string();
        assert!(
            tool.starts_with("<untrusted-data id=\"")
                && tool.contains(&format!("kind=\"tool_message\" source=\"{call_id}\">\nsunny\n</untrusted-data")),
            "{tool}"
        );
        turns[2]["content"] = json!("sunny");
        turns
    };
    let (status, v) = turn(&gw, DEMO_KEY, None, &id, user_msg("thanks")).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(Value::Array(sent_turns(&fake.last_request().unwrap()["messages"])), want);
    gw.stop().await;

    // The same history after a restart, read back from the file.
    let gw = TestGateway::start(load()).await;
    gw.wait_ready().await;
    let (status, v) = turn(&gw, DEMO_KEY, None, &id, user_msg("thanks")).await;
    assert_eq!(status, 200, "{v}");
    let sent = sent_turns(&fake.last_request().unwrap()["messages"]);
    assert_eq!(sent[..4], want.as_array().unwrap()[..4]);
    gw.stop().await;
}

/// However many users an application names, it holds at most
/// `max_per_application` sessions, and the gateway `max_sessions` in all.
#[tokio::test]
async fn sessions_are_bounded_per_application_and_in_all() {
    let (_fake, gw) = gateway("max_per_application = 3\nmax_sessions = 4", true).await;
    for u in ["u1", "u2", "u3"] {
        create(&gw, DEMO_KEY, Some(u), json!({})).await;
    }
    let (status, v) = call(&gw, reqwest::Method::POST, "/v1/sessions", DEMO_KEY, Some("u4"), Some(json!({}))).await;
    assert_eq!((status, error_code(&v)), (409, "SESSION_LIMIT"), "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("application"), "{v}");

    create(&gw, OTHER_KEY, Some("u1"), json!({})).await;
    let (status, v) = call(&gw, reqwest::Method::POST, "/v1/sessions", OTHER_KEY, Some("u2"), Some(json!({}))).await;
    assert_eq!((status, error_code(&v)), (409, "SESSION_LIMIT"), "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("gateway"), "{v}");
    gw.stop().await;
}

/// A canned answer (every engine down) is not the model's turn: it reaches
/// the caller but is not appended, even with `append_failed_turns`.
#[tokio::test]
async fn a_canned_answer_is_not_appended() {
    let fake = FakeEngine::start().await;
    let gw = TestGateway::with_engine_edit(
        &fake.url(),
        "openai",
        "canned_answer = \"Busy; call the desk.\"",
        edit("append_failed_turns = true", true),
    )
    .await;
    gw.wait_ready().await;
    let id = create(&gw, DEMO_KEY, None, json!({})).await;
    assert_eq!(turn(&gw, DEMO_KEY, None, &id, user_msg("first")).await.0, 200);
    fake.set(|k| k.healthy = false);
    instance_up(&gw, false).await;
    let (status, v) = turn(&gw, DEMO_KEY, None, &id, user_msg("second")).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], "Busy; call the desk.");
    // The next turn of the session waits for this one to end: once it
    // has answered, the canned turn has been judged.
    fake.set(|k| k.healthy = true);
    instance_up(&gw, true).await;
    assert_eq!(turn(&gw, DEMO_KEY, None, &id, user_msg("third")).await.0, 200);
    let (_, v) = get(&gw, DEMO_KEY, None, &id).await;
    assert_eq!(v["message_count"], 4, "{v}");
    assert!(!stored_text(&gw).await.contains("Busy"), "the canned text is not kept");
    gw.stop().await;
}

/// Waits until the scheduler has the instance `fake` in dispatch (`up`) or
/// out of it (its health checks run every 100 ms).
async fn instance_up(gw: &TestGateway, up: bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !gw.scheduler().snapshot().await.unwrap().instances.iter().any(|i| i.name == "fake" && i.up == up) {
        assert!(tokio::time::Instant::now() < deadline, "fake never became up={up}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A call that waits past its `queue_ms` for another turn of its session
/// is refused `SESSION_BUSY` (it never was in a queue).
#[tokio::test]
async fn a_turn_waiting_past_its_queue_timeout_for_another_is_session_busy() {
    let (fake, gw) = gateway("", true).await;
    fake.set(|k| k.token_delay = Duration::from_millis(100));
    let id = create(&gw, DEMO_KEY, None, json!({})).await;
    let slow = turn(&gw, DEMO_KEY, None, &id, user_msg("slow"));
    let busy = async {
        // The first turn holds the session once its engine call runs.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while fake.active() == 0 {
            assert!(tokio::time::Instant::now() < deadline, "the first turn never ran");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let body = json!({"model": "general-chat", "messages": user_msg("impatient"), "session_id": id,
            "max_tokens": 20, "timeouts": {"queue_ms": 50}});
        let resp = post_chat(&gw, DEMO_KEY, &body).await;
        let status = resp.status().as_u16();
        (status, resp.json::<Value>().await.unwrap())
    };
    let (a, b) = tokio::join!(slow, busy);
    assert_eq!(a.0, 200, "{}", a.1);
    assert_eq!((b.0, error_code(&b.1)), (409, "SESSION_BUSY"), "{}", b.1);
    gw.stop().await;
}

/// `[sessions]` keys for summaries by `general-chat` itself: the recent
/// turns may take 10 % of its 2048-token window, and a summary is due once
/// 4 messages are left out of that and not yet covered.
const SUMMARIES: &str = "summary_model = \"general-chat\"\nsummary_after_messages = 4\nsummary_history_share_pct = 10";

/// A question of about 200 tokens (estimated): one fills the 10 % share.
fn long_question(i: usize) -> Value {
    user_msg(&format!("question {i}: {}", "pump pressure reading ".repeat(32)))
}

/// The summary tasks in the task store: (request id, priority, state).
async fn summary_tasks(gw: &TestGateway) -> Vec<(String, String, String)> {
    gw.store().flush().await;
    let conn = rusqlite::Connection::open(gw.db_path()).unwrap();
    let mut st = conn
        .prepare(
            "SELECT request_id, priority, state FROM tasks WHERE request_id LIKE 'summary/%' ORDER BY created_at_ms",
        )
        .unwrap();
    st.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?))).unwrap().map(Result::unwrap).collect()
}

/// Waits (at most 10 s) until session `id` shows `want` as its summary
/// version: the summary is made after its turn has ended, beside the
/// session's next turns.
async fn summary_version(gw: &TestGateway, id: &str, want: u64) -> Value {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let (_, v) = get(gw, DEMO_KEY, None, id).await;
        if v["summary_version"].as_u64() == Some(want) || tokio::time::Instant::now() > deadline {
            return v;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits (at most 10 s) until the summary tasks have all ended.
async fn summary_tasks_ended(gw: &TestGateway, n: usize) -> Vec<(String, String, String)> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let t = summary_tasks(gw).await;
        let ended = t.iter().filter(|(_, _, s)| matches!(s.as_str(), "SUCCEEDED" | "FAILED" | "TIMED_OUT")).count();
        if ended >= n || tokio::time::Instant::now() > deadline {
            return t;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn summary_prompts(fake: &FakeEngine) -> Vec<String> {
    fake.bodies()
        .iter()
        .filter(|b| b["messages"][0]["content"] == edgeway::context::summary::SUMMARY_INSTRUCTION)
        .map(|b| b["messages"][1]["content"].as_str().unwrap().to_string())
        .collect()
}

#[tokio::test]
async fn older_turns_are_summarised_at_low_priority_reused_and_replaced_as_history_grows() {
    let (fake, gw) = gateway(SUMMARIES, true).await;
    let id = create(&gw, DEMO_KEY, None, json!({})).await;
    // Turn 1: two messages left out of the share; not yet due.
    let (status, v) = turn(&gw, DEMO_KEY, None, &id, long_question(1)).await;
    assert_eq!(status, 200, "{v}");
    let (status, _) = turn(&gw, DEMO_KEY, None, &id, long_question(2)).await;
    assert_eq!(status, 200);
    // Turn 2: four left out: the first summary, of those four.
    let v = summary_version(&gw, &id, 1).await;
    assert_eq!(v["summary_version"], 1, "{v}");
    assert_eq!((v["summary_model"].as_str(), v["summary_covers"].as_u64()), (Some("general-chat"), Some(4)), "{v}");
    assert!(v["summary_at_ms"].as_i64().unwrap() > 0);
    let prompts = summary_prompts(&fake);
    assert_eq!(prompts.len(), 1, "{prompts:?}");
    assert!(prompts[0].starts_with("Conversation:\nuser: question 1:"), "{}", prompts[0]);
    assert!(prompts[0].contains("user: question 2:"), "{}", prompts[0]);
    let tasks = summary_tasks(&gw).await;
    assert_eq!(tasks.len(), 1, "{tasks:?}");
    assert_eq!((tasks[0].1.as_str(), tasks[0].2.as_str()), ("P4", "SUCCEEDED"), "{tasks:?}");

    // Turn 3: two more messages out, not enough: the summary is reused.
    let (status, _) = turn(&gw, DEMO_KEY, None, &id, long_question(3)).await;
    assert_eq!(status, 200);
    // Turn 4: four past the summary: version 2, made from version 1 and
    // the turns after it only.
    let (status, _) = turn(&gw, DEMO_KEY, None, &id, long_question(4)).await;
    assert_eq!(status, 200);
    let v = summary_version(&gw, &id, 2).await;
    assert_eq!((v["summary_version"].as_u64(), v["summary_covers"].as_u64()), (Some(2), Some(8)), "{v}");
    let prompts = summary_prompts(&fake);
    assert_eq!(prompts.len(), 2, "turn 3 made none: {prompts:?}");
    assert!(prompts[1].starts_with("Summary so far:\n"), "{}", prompts[1]);
    assert!(!prompts[1].contains("question 2:") && prompts[1].contains("question 3:"), "{}", prompts[1]);

    // Kept in the store with the session.
    gw.store().flush().await;
    let conn = rusqlite::Connection::open(gw.db_path()).unwrap();
    let (version, covers, model, text): (u32, u32, String, String) = conn
        .query_row(
            "SELECT summary_version, summary_covers, summary_model, summary_text FROM sessions WHERE session_id = ?1",
            [&id],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
        )
        .unwrap();
    assert_eq!((version, covers, model.as_str()), (2, 8, "general-chat"));
    assert!(!text.is_empty());
    gw.stop().await;
}

#[tokio::test]
async fn a_failed_summary_leaves_the_session_working_and_is_tried_again() {
    let (fake, gw) = gateway(SUMMARIES, true).await;
    let id = create(&gw, DEMO_KEY, None, json!({})).await;
    fake.set(|k| k.fail_matching = Some(("running summary".into(), 400)));
    for i in 1..=2 {
        let (status, v) = turn(&gw, DEMO_KEY, None, &id, long_question(i)).await;
        assert_eq!(status, 200, "{v}");
    }
    let tasks = summary_tasks_ended(&gw, 1).await;
    assert_eq!(tasks.len(), 1, "{tasks:?}");
    assert_eq!(tasks[0].2, "FAILED", "{tasks:?}");
    let (_, v) = get(&gw, DEMO_KEY, None, &id).await;
    assert_eq!((v["message_count"].as_u64(), v["summary_version"].as_u64()), (Some(4), None), "{v}");

    // The session goes on; the next turn's summary is made.
    fake.set(|k| k.fail_matching = None);
    let (status, v) = turn(&gw, DEMO_KEY, None, &id, long_question(3)).await;
    assert_eq!(status, 200, "{v}");
    let v = summary_version(&gw, &id, 1).await;
    assert_eq!((v["summary_version"].as_u64(), v["summary_covers"].as_u64()), (Some(1), Some(6)), "{v}");
    // Both attempts are counted by outcome (the failed one ended before the
    // next could start: one summary task per session at a time).
    let outcomes = |o: &str| gw.metrics().context_summaries.with_label_values(&[o]).get();
    assert_eq!((outcomes("failed"), outcomes("made"), outcomes("empty")), (1, 1, 0));
    gw.stop().await;
}

#[tokio::test]
async fn without_a_summary_model_no_summary_is_made() {
    let (fake, gw) = gateway("", true).await;
    let id = create(&gw, DEMO_KEY, None, json!({})).await;
    for i in 1..=3 {
        let (status, _) = turn(&gw, DEMO_KEY, None, &id, long_question(i)).await;
        assert_eq!(status, 200);
    }
    assert_eq!(fake.requests(), 3);
    let (_, v) = get(&gw, DEMO_KEY, None, &id).await;
    assert!(v["summary_version"].is_null(), "{v}");
    gw.stop().await;
}

#[tokio::test]
async fn a_summary_survives_a_restart() {
    let fake = FakeEngine::start().await;
    let dir = TempDir::new("edgeway-summary");
    let text = edit(SUMMARIES, true)(config_toml(&fake.url(), "openai", &dir.0, ""));
    let load = || Config::from_toml_str(&text, std::iter::empty(), std::path::Path::new(".")).unwrap();
    let gw = TestGateway::start(load()).await;
    gw.wait_ready().await;
    let id = create(&gw, DEMO_KEY, None, json!({})).await;
    for i in 1..=2 {
        assert_eq!(turn(&gw, DEMO_KEY, None, &id, long_question(i)).await.0, 200);
    }
    let before = summary_version(&gw, &id, 1).await;
    assert_eq!(before["summary_version"], 1, "{before}");
    gw.stop().await;

    let gw = TestGateway::start(load()).await;
    gw.wait_ready().await;
    let (status, after) = get(&gw, DEMO_KEY, None, &id).await;
    assert_eq!(status, 200, "{after}");
    for k in ["summary_version", "summary_model", "summary_at_ms", "summary_covers"] {
        assert_eq!(after[k], before[k], "{k}: {after}");
    }
    // Reused, not made again: the next summary extends it.
    assert_eq!(turn(&gw, DEMO_KEY, None, &id, long_question(3)).await.0, 200);
    assert_eq!(turn(&gw, DEMO_KEY, None, &id, long_question(4)).await.0, 200);
    let v = summary_version(&gw, &id, 2).await;
    assert_eq!(v["summary_covers"], 8, "{v}");
    assert!(summary_prompts(&fake).last().unwrap().starts_with("Summary so far:\n"));
    gw.stop().await;
}

/// Review L5: a session turn queued when the gateway stopped runs after the
/// restart and is appended when it ends, as any turn.
#[tokio::test]
async fn a_turn_requeued_after_a_restart_is_appended_when_it_ends() {
    let fake = FakeEngine::start_with(edgeway::testing::Knobs::slow(100_000, 20)).await;
    let dir = TempDir::new("edgeway-turn-restart");
    let text = edit("", true)(config_toml(&fake.url(), "openai", &dir.0, ""))
        .replace("max_concurrency = 2", "max_concurrency = 1");
    let load = || Config::from_toml_str(&text, std::iter::empty(), std::path::Path::new(".")).unwrap();
    let gw = TestGateway::start(load()).await;
    gw.wait_ready().await;
    let id = create(&gw, DEMO_KEY, None, json!({})).await;
    let submit = |body: Value| {
        let url = format!("{}/v1/tasks", gw.base_url);
        async move {
            let v: Value =
                client().post(url).bearer_auth(DEMO_KEY).json(&body).send().await.unwrap().json().await.unwrap();
            v["task_id"].as_str().unwrap_or_else(|| panic!("{v}")).to_string()
        }
    };
    // The only slot is taken: the turn waits in the queue, kept (it has an
    // idempotency key) when the gateway stops.
    let blocker = submit(json!({"model": "general-chat", "messages": [{"role": "user", "content": "block"}]})).await;
    gw.wait_for_state(&blocker, edgeway::task::TaskState::Streaming).await;
    let turn = submit(json!({"model": "general-chat", "session_id": id, "idempotency_key": "turn-1", "max_tokens": 20,
        "messages": [{"role": "user", "content": "asked before the restart"}]}))
    .await;
    gw.wait_for_state(&turn, edgeway::task::TaskState::Queued).await;
    gw.stop().await;

    fake.set(|k| *k = edgeway::testing::Knobs::default());
    let gw = TestGateway::start(load()).await;
    gw.wait_ready().await;
    gw.wait_for_state(&turn, edgeway::task::TaskState::Succeeded).await;
    // The next turn waits for the re-queued one to be appended, and sees it.
    let (status, v) = turn_of(&gw, &id, "after it").await;
    assert_eq!(status, 200, "{v}");
    let sent = fake.last_request().unwrap().to_string();
    assert!(sent.contains("asked before the restart") && sent.contains("after it"), "{sent}");
    let (_, v) = get(&gw, DEMO_KEY, None, &id).await;
    assert_eq!(v["message_count"], 4, "{v}");
    gw.stop().await;
}

async fn turn_of(gw: &TestGateway, id: &str, text: &str) -> (u16, Value) {
    turn(gw, DEMO_KEY, None, id, user_msg(text)).await
}

/// The summary tasks (P4) in the task store once all have ended:
/// (request id, user id, state).
async fn ended_summary_tasks(gw: &TestGateway, n: usize) -> Vec<(String, Option<String>, String)> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        gw.store().flush().await;
        let conn = rusqlite::Connection::open(gw.db_path()).unwrap();
        let mut st = conn
            .prepare("SELECT request_id, user_id, state FROM tasks WHERE priority = 'P4' ORDER BY created_at_ms")
            .unwrap();
        let t: Vec<(String, Option<String>, String)> =
            st.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?))).unwrap().map(Result::unwrap).collect();
        let ended = t
            .iter()
            .filter(|(_, _, s)| matches!(s.as_str(), "SUCCEEDED" | "FAILED" | "TIMED_OUT" | "REJECTED" | "CANCELLED"))
            .count();
        if ended >= n || tokio::time::Instant::now() > deadline {
            return t;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Review 14 L8: a summary runs under the platform's own user, not the
/// caller's, so it never spends the user's limits (here a token rate the
/// user's two turns nearly use up, which the summary would pass); its
/// request id names its session and version and is unique, in a form no
/// client request id can take (admission refuses it), so it never
/// collides with one.
#[tokio::test]
async fn a_summary_spends_no_user_limit_and_its_request_id_is_its_own() {
    let fake = FakeEngine::start().await;
    let edit = edit(SUMMARIES, true);
    let edit = move |t: String| {
        edit(t).replace("[applications.demo]\n", "[applications.demo]\nuser_tokens_per_minute = 1100\n")
    };
    let gw = TestGateway::with_engine_edit(&fake.url(), "openai", "", edit).await;
    gw.wait_ready().await;
    let id = create(&gw, DEMO_KEY, Some("alice"), json!({})).await;
    for i in 1..=2 {
        let (status, v) = turn(&gw, DEMO_KEY, Some("alice"), &id, long_question(i)).await;
        assert_eq!(status, 200, "{v}");
    }
    let tasks = ended_summary_tasks(&gw, 1).await;
    assert_eq!(tasks.len(), 1, "{tasks:?}");
    let (request_id, user, state) = &tasks[0];
    assert_eq!(state, "SUCCEEDED", "{tasks:?}");
    assert_eq!(user.as_deref(), Some("edgeway:summary"), "{tasks:?}");
    assert!(request_id.starts_with(&format!("summary/{id}/v1/")), "{request_id}");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let v = loop {
        let (_, v) = get(&gw, DEMO_KEY, Some("alice"), &id).await;
        if v["summary_version"] == 1 || tokio::time::Instant::now() > deadline {
            break v;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert_eq!(v["summary_version"], 1, "{v}");

    // No client may take that request id.
    let body = json!({"model": "general-chat", "request_id": request_id, "messages": user_msg("hi")});
    let resp = post_chat(&gw, DEMO_KEY, &body).await;
    assert_eq!(resp.status(), 400);
    gw.stop().await;
}

/// Isolation of summaries (issue 12 "## Tests"): two users of one
/// application and a user of another tenant, each with a session whose
/// older turns are summarised; each summary is made from its own
/// session's turns only, and a later turn's prompt holds nothing of
/// another's session, turns or summary. (Not a regression: this held
/// before; kept so that it stays so.)
#[tokio::test]
async fn summaries_do_not_cross_users_or_tenants() {
    let (fake, gw) = gateway(SUMMARIES, true).await;
    let q =
        |who: &str, i: usize| user_msg(&format!("{who}-marker question {i}: {}", "pump pressure reading ".repeat(32)));
    let callers = [("alice", DEMO_KEY), ("bob", DEMO_KEY), ("carol", OTHER_KEY)];
    let mut ids = Vec::new();
    for (who, key) in callers {
        let id = create(&gw, key, Some(who), json!({})).await;
        for i in 1..=2 {
            let (status, v) = turn(&gw, key, Some(who), &id, q(who, i)).await;
            assert_eq!(status, 200, "{who}: {v}");
        }
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let (_, v) = get(&gw, key, Some(who), &id).await;
            if v["summary_version"] == 1 {
                break;
            }
            assert!(tokio::time::Instant::now() < deadline, "{who}: no summary: {v}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        ids.push(id);
    }
    let prompts = summary_prompts(&fake);
    assert_eq!(prompts.len(), 3, "{prompts:?}");
    for (p, (who, _)) in prompts.iter().zip(callers) {
        let others: Vec<&str> = callers.iter().map(|c| c.0).filter(|w| *w != who).collect();
        assert!(p.contains(&format!("{who}-marker")), "{who}: {p}");
        assert!(others.iter().all(|o| !p.contains(&format!("{o}-marker"))), "{who}: {p}");
    }
    // A third turn each: its prompt holds its own summary and turns only.
    for ((who, key), id) in callers.iter().zip(&ids) {
        let (status, v) = turn(&gw, key, Some(who), id, q(who, 3)).await;
        assert_eq!(status, 200, "{who}: {v}");
        let sent = fake.last_request().unwrap()["messages"].to_string();
        assert!(sent.contains(&format!("{who}-marker")), "{who}: {sent}");
        for (o, _) in callers.iter().filter(|c| c.0 != *who) {
            assert!(!sent.contains(&format!("{o}-marker")), "{who} sees {o}: {sent}");
        }
        // Nobody else reads it.
        for (o, okey) in callers.iter().filter(|c| c.0 != *who) {
            let (status, _) = get(&gw, okey, Some(o), id).await;
            assert_eq!(status, 404, "{o} reads {who}'s session");
        }
    }
    gw.stop().await;
}
