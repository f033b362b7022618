//! `DELETE /admin/users/{user}/data`: one user's texts, kept answers,
//! sessions and memory leave the real SQLite file (its bytes, and its
//! WAL's), another user's stay, and an audit record says who asked and
//! what went.

mod common;

use common::{client, contains, file_bytes, get_json, post_chat, DEMO_KEY};
use edgeway::testing::{FakeEngine, Knobs, TestGateway, OPS_KEY};
use serde_json::{json, Value};

async fn call(gw: &TestGateway, method: reqwest::Method, path: &str, key: &str, body: Option<Value>) -> (u16, Value) {
    let mut req = client().request(method, format!("{}{path}", gw.base_url)).bearer_auth(key);
    if let Some(b) = body {
        req = req.json(&b);
    }
    let resp = req.send().await.unwrap();
    (resp.status().as_u16(), resp.json().await.unwrap_or(Value::Null))
}

fn chat(user: &str, prompt: &str) -> Value {
    json!({"model": "general-chat", "messages": [{"role": "user", "content": prompt}], "metadata": {"user_id": user}})
}

/// Failed before: the route did not exist (404), and nothing deleted a
/// user's text.
#[tokio::test]
async fn deleting_a_users_data_removes_it_from_the_file_and_leaves_a_record() {
    let fake = FakeEngine::start_with(Knobs::default()).await;
    let gw = TestGateway::with_engine_edit(&fake.url(), "openai", "", |t| {
        format!("{}\n[cache]\nenabled = true\n", t.replace("[store]\n", "[store]\nstore_prompts = true\n"))
    })
    .await;
    gw.wait_ready().await;

    // Alice: a call with a key (its answer kept with it), a session with a
    // turn and a memory entry. Bob: a call.
    let mut keyed = chat("alice", "ALICE-PROMPT-CALL-0a1b");
    keyed["idempotency_key"] = json!("alice-key-1");
    // Deterministic: its answer is kept in the response cache too.
    keyed["temperature"] = json!(0);
    assert_eq!(post_chat(&gw, DEMO_KEY, &keyed).await.status(), 200);
    // A session belongs to the caller's user: Alice's.
    let resp = client()
        .post(format!("{}/v1/sessions", gw.base_url))
        .bearer_auth(DEMO_KEY)
        .header("x-user-id", "alice")
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 201);
    let id = resp.json::<Value>().await.unwrap()["id"].as_str().unwrap().to_string();
    let mut turn = chat("alice", "ALICE-PROMPT-SESSION-2c3d");
    turn["session_id"] = json!(id);
    assert_eq!(post_chat(&gw, DEMO_KEY, &turn).await.status(), 200);
    let memory = json!({"key": "pet", "content": "ALICE-MEMORY-4e5f"});
    let resp = client()
        .post(format!("{}/v1/sessions/{id}/memory", gw.base_url))
        .bearer_auth(DEMO_KEY)
        .header("x-user-id", "alice")
        .json(&memory)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 201);
    assert_eq!(post_chat(&gw, DEMO_KEY, &chat("bob", "BOB-PROMPT-CALL-6a7b")).await.status(), 200);
    gw.store().flush().await;
    let db = gw.db_path();
    let before = file_bytes(&db);
    for t in ["ALICE-PROMPT-CALL-0a1b", "ALICE-PROMPT-SESSION-2c3d", "ALICE-MEMORY-4e5f", "BOB-PROMPT-CALL-6a7b"] {
        assert!(contains(&before, t), "{t} was stored: the check can see it");
    }

    // Only an admin application, for its own tenant.
    let path = "/admin/users/alice/data";
    assert_eq!(call(&gw, reqwest::Method::DELETE, path, DEMO_KEY, None).await.0, 403);
    let other = format!("{path}?tenant=other");
    assert_eq!(call(&gw, reqwest::Method::DELETE, &other, OPS_KEY, None).await.0, 403);
    let (status, v) = call(&gw, reqwest::Method::DELETE, &format!("{path}?tenant=demo"), OPS_KEY, None).await;
    assert_eq!(status, 200, "{v}");
    let d = &v["deleted"];
    assert_eq!(d["task_texts"], 2, "{v}");
    assert_eq!(d["idempotency_answers"], 1, "{v}");
    assert_eq!((&d["sessions"], &d["sessions_in_memory"]), (&json!(1), &json!(1)), "{v}");
    assert_eq!(d["cached_answers"], 1, "her deterministic call's cached answer: {v}");
    assert_eq!(v["wal_truncated"], true, "{v}");

    let after = file_bytes(&db);
    for t in ["ALICE-PROMPT-CALL-0a1b", "ALICE-PROMPT-SESSION-2c3d", "ALICE-MEMORY-4e5f"] {
        assert!(!contains(&after, t), "{t} is still in the database file");
    }
    assert!(contains(&after, "BOB-PROMPT-CALL-6a7b"), "another user's text stays");

    // Her session is gone in memory too; the record of the deletion names
    // who asked, the user and the counts, and the chain holds.
    let resp = client()
        .get(format!("{}/v1/sessions/{id}", gw.base_url))
        .bearer_auth(DEMO_KEY)
        .header("x-user-id", "alice")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 404);
    let page = get_json(&gw, OPS_KEY, "/admin/audit?limit=1000").await;
    let rec = page["records"].as_array().unwrap().last().unwrap().clone();
    assert_eq!(
        (&rec["result"], &rec["user_id"], &rec["application"]),
        (&json!("USER_DATA_DELETED"), &json!("alice"), &json!("ops")),
        "{rec}"
    );
    assert_eq!(rec["seq"], v["audit_seq"]);
    assert_eq!(rec["user_data_deleted"]["task_texts"], 2, "{rec}");
    let c = edgeway::store::audit::open_read_only(&db).unwrap();
    assert!(edgeway::store::audit::verify(&c).is_ok());

    // The same call again (last: it stores its prompt again and leaves a
    // record) is answered by the engine, not from her entry.
    let mut again = chat("alice", "ALICE-PROMPT-CALL-0a1b");
    again["temperature"] = json!(0);
    let resp = post_chat(&gw, DEMO_KEY, &again).await;
    assert_eq!(resp.status(), 200);
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["edge"]["cache_hit"], Value::Null, "not from the cache: {body}");
    gw.stop().await;
}
