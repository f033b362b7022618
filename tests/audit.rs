//! The audit trail end to end: a whole gateway (HTTP, the MQTT broker, a
//! real `nats-server`), a fake engine, the real SQLite file and the real
//! `edgeway audit` command.

mod common;
mod mqtt_support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use async_nats::{HeaderMap, StatusCode};
use common::{chat_body, client, error_code, get_json, post_chat, DEMO_KEY, OPS_KEY};
use edgeway::ingress::nats::BusState;
use edgeway::testing::{FakeEngine, Knobs, NatsServer, TempDir, TestGateway};
use futures::StreamExt;
use mqtt_support::{device, mqtt_toml, request, D1, V};
use serde_json::{json, Value};

const LIMIT: Duration = Duration::from_secs(20);
const OTHER_KEY: &str = "sk-edgeway-other-tenant";

/// A second tenant with its own (admin) application, as extra TOML.
fn other_tenant() -> String {
    format!(
        "\n[applications.other]\ntenant = \"other\"\napi_key_sha256 = [\"{}\"]\nadmin = true\n",
        hex::encode(edgeway::config::hash_api_key(OTHER_KEY))
    )
}

async fn gateway(extra: &str) -> (FakeEngine, TestGateway) {
    let fake = FakeEngine::start_with(Knobs::default()).await;
    let gw = TestGateway::with_engine(&fake.url(), "openai", &format!("{extra}{}", other_tenant())).await;
    gw.wait_ready().await;
    (fake, gw)
}

/// Every audit record of the admin's tenant, through the admin API.
async fn audit_page(gw: &TestGateway, key: &str, query: &str) -> Value {
    gw.store().flush().await;
    get_json(gw, key, &format!("/admin/audit{query}")).await
}

/// One NATS chat call to its terminal event (retried while the service is
/// not subscribed yet).
async fn nats_call(client: &async_nats::Client, key: &str) -> String {
    let mut headers = HeaderMap::new();
    headers.insert("Authorization", format!("Bearer {key}").as_str());
    let body = serde_json::to_vec(&chat_body(true)).unwrap();
    for _ in 0..200 {
        let inbox = client.new_inbox();
        let mut sub = client.subscribe(inbox.clone()).await.unwrap();
        client.publish_with_reply_and_headers("ai.v1.chat", inbox, headers.clone(), body.clone().into()).await.unwrap();
        loop {
            let m = tokio::time::timeout(LIMIT, sub.next()).await.expect("an answer in time").expect("open");
            if m.status == Some(StatusCode::NO_RESPONDERS) {
                break;
            }
            let kind = m.headers.as_ref().and_then(|h| h.get("Edgeway-Event")).map(|v| v.as_str().to_string());
            if matches!(kind.as_deref(), Some("done" | "error")) {
                return kind.unwrap();
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the edgeway service never answered");
}

#[tokio::test]
async fn http_mqtt_nats_and_refused_calls_each_leave_one_record_also_published_on_nats() {
    let nats = NatsServer::start(false).await;
    let extra = format!("{}\n[nats]\nurl = \"{}\"\n", mqtt_toml("coalesce_ms = 0"), nats.url());
    let (_fake, gw) = gateway(&extra).await;
    gw.nats().wait_for(BusState::Connected).await;
    let bus = async_nats::connect(nats.url()).await.unwrap();
    let mut published = bus.subscribe("ai.v1.audit.>").await.unwrap();
    bus.flush().await.unwrap();

    // HTTP, a success.
    let r = post_chat(&gw, DEMO_KEY, &chat_body(false)).await;
    assert_eq!(r.status(), 200);
    let http_task = r.headers()["x-task-id"].to_str().unwrap().to_string();
    let http_trace = r.headers()["x-edgeway-trace-id"].to_str().unwrap().to_string();
    // HTTP, refused at admission.
    let r = post_chat(&gw, DEMO_KEY, &json!({"model": "nope", "messages": [{"role": "user", "content": "Say hello"}]}))
        .await;
    assert!(r.status().is_client_error(), "{}", r.status());
    // MQTT, a device.
    let addr = gw.running.as_ref().unwrap().mqtt.expect("mqtt").mqtt;
    let mut d = device(addr, V::V4, D1).await;
    d.subscribe(&d.topic("res/#")).await;
    d.publish(&d.topic("req"), request("audit-mqtt").to_string()).await;
    let events = d.stream(&d.topic("res/audit-mqtt")).await;
    assert_eq!(events.last().unwrap()["type"], "done");
    // NATS.
    assert_eq!(nats_call(&bus, DEMO_KEY).await, "done");

    let page = audit_page(&gw, OPS_KEY, "").await;
    let records = page["records"].as_array().unwrap_or_else(|| panic!("{page}"));
    assert_eq!(records.len(), 4, "one record per call: {page}");
    let by_ingress: BTreeMap<(String, String), &Value> = records
        .iter()
        .map(|r| ((r["ingress"].as_str().unwrap().to_string(), r["result"].as_str().unwrap().to_string()), r))
        .collect();
    let keys: Vec<_> = by_ingress.keys().cloned().collect();
    let k = |a: &str, b: &str| (a.to_string(), b.to_string());
    assert_eq!(keys, [k("http", "REJECTED"), k("http", "SUCCEEDED"), k("mqtt", "SUCCEEDED"), k("nats", "SUCCEEDED")]);
    let demo_key_id = &hex::encode(edgeway::config::hash_api_key(DEMO_KEY))[..16];

    let http = by_ingress[&k("http", "SUCCEEDED")];
    assert_eq!(http["task_id"], http_task.as_str());
    assert_eq!(http["trace_id"], http_trace.as_str(), "the record joins the task's trace");
    assert_eq!((&http["tenant"], &http["application"]), (&json!("demo"), &json!("demo")));
    assert_eq!(http["key_id"], demo_key_id);
    assert_eq!(http["device"], Value::Null);
    assert_eq!(
        (&http["requested_model"], &http["model"], &http["instance"]),
        (&json!("general-chat"), &json!("general-chat"), &json!("fake"))
    );
    assert!(!http["route"].as_array().unwrap().is_empty(), "route steps with reasons: {http}");
    assert!(http["route"][0]["reason"].is_string());
    assert_eq!(http["data_class"], "personal", "the default class");
    assert_eq!(http["output_tokens"], 5);
    // No price configured: the call cost 0 (tests/budgets.rs prices them).
    assert_eq!((&http["cost"], &http["cache_hit"]), (&json!(0.0), &json!(false)));
    assert!(http["total_ms"].is_u64() && http["queue_ms"].is_u64() && http["ttft_ms"].is_u64(), "{http}");

    let refused = by_ingress[&k("http", "REJECTED")];
    assert_eq!(refused["requested_model"], "nope");
    assert!(refused["error_code"].is_string(), "{refused}");
    assert_eq!(refused["key_id"], demo_key_id);
    assert_eq!(refused["trace_id"].as_str().map(str::len), Some(32), "a refused call's trace id: {refused}");

    let mqtt = by_ingress[&k("mqtt", "SUCCEEDED")];
    assert_eq!(mqtt["device"], D1.0);
    assert_eq!(mqtt["key_id"], Value::Null);
    assert_eq!(by_ingress[&k("nats", "SUCCEEDED")]["key_id"], demo_key_id);

    // Never prompt or answer text.
    let all = page.to_string();
    assert!(!all.contains("Say hello") && !all.contains("tok tok"), "{all}");

    // Each committed record is published on ai.v1.audit.{tenant}.
    let mut seen = Vec::new();
    while seen.len() < 4 {
        let m = tokio::time::timeout(LIMIT, published.next()).await.expect("audit records on the bus").unwrap();
        assert_eq!(m.subject.as_str(), "ai.v1.audit.demo");
        let v: Value = serde_json::from_slice(&m.payload).unwrap();
        seen.push(v["seq"].as_i64().unwrap());
    }
    seen.sort();
    let stored: Vec<i64> = records.iter().map(|r| r["seq"].as_i64().unwrap()).collect();
    assert_eq!(seen, stored);
    gw.stop().await;
}

#[tokio::test]
async fn the_admin_query_needs_an_admin_of_the_tenant_and_is_bounded() {
    let (_fake, gw) = gateway("").await;
    for _ in 0..3 {
        assert_eq!(post_chat(&gw, DEMO_KEY, &chat_body(false)).await.status(), 200);
    }
    assert_eq!(post_chat(&gw, OTHER_KEY, &chat_body(false)).await.status(), 200);
    gw.store().flush().await;
    let url = format!("{}/admin/audit", gw.base_url);
    assert_eq!(client().get(&url).send().await.unwrap().status(), 401);
    let r = client().get(&url).bearer_auth(DEMO_KEY).send().await.unwrap();
    assert_eq!(r.status(), 403);
    assert_eq!(error_code(&r.json().await.unwrap()), "PERMISSION_DENIED");
    let r = client().get(format!("{url}?tenant=other")).bearer_auth(OPS_KEY).send().await.unwrap();
    assert_eq!(r.status(), 403, "another tenant's records");
    let r = client().get(format!("{url}?since=yesterday")).bearer_auth(OPS_KEY).send().await.unwrap();
    assert_eq!(r.status(), 400);

    // Each admin sees its own tenant's records only.
    let demo = audit_page(&gw, OPS_KEY, "").await;
    assert_eq!(demo["records"].as_array().unwrap().len(), 3, "{demo}");
    let other = audit_page(&gw, OTHER_KEY, "?tenant=other").await;
    assert_eq!(other["records"].as_array().unwrap().len(), 1, "{other}");
    assert_eq!(other["records"][0]["tenant"], "other");

    // Pages.
    let p1 = audit_page(&gw, OPS_KEY, "?limit=2").await;
    assert_eq!(p1["records"].as_array().unwrap().len(), 2);
    let after = p1["next_after"].as_i64().expect("a next page");
    let p2 = audit_page(&gw, OPS_KEY, &format!("?limit=2&after={after}")).await;
    assert_eq!(p2["records"].as_array().unwrap().len(), 1);
    assert_eq!(p2["next_after"], Value::Null);
    // Time bounds.
    let first_at = demo["records"][0]["at_ms"].as_i64().unwrap();
    let none = audit_page(&gw, OPS_KEY, &format!("?until={first_at}")).await;
    assert_eq!(none["records"].as_array().unwrap().len(), 0);
    let all = audit_page(&gw, OPS_KEY, &format!("?since={first_at}&until=2999-01-01")).await;
    assert_eq!(all["records"].as_array().unwrap().len(), 3);
    gw.stop().await;
}

/// The records of `page` as (result, error_code) pairs, in order.
fn outcomes(page: &Value) -> Vec<(String, Option<String>)> {
    let records = page["records"].as_array().unwrap_or_else(|| panic!("{page}"));
    records
        .iter()
        .map(|r| (r["result"].as_str().unwrap().to_string(), r["error_code"].as_str().map(str::to_string)))
        .collect()
}

#[tokio::test]
async fn a_call_the_scheduler_rate_limits_leaves_a_rejected_record() {
    let fake = FakeEngine::start_with(Knobs::default()).await;
    let gw = TestGateway::with_engine_edit(&fake.url(), "openai", "", |t| {
        t.replacen("default_priority = \"P2\"\n", "default_priority = \"P2\"\nuser_requests_per_minute = 1\n", 1)
    })
    .await;
    gw.wait_ready().await;
    assert_eq!(post_chat(&gw, DEMO_KEY, &chat_body(false)).await.status(), 200);
    let r = post_chat(&gw, DEMO_KEY, &chat_body(false)).await;
    assert_eq!(r.status(), 429);
    let refused_task = r.headers().get("x-task-id").map(|v| v.to_str().unwrap().to_string());
    assert_eq!(error_code(&r.json().await.unwrap()), "RATE_LIMITED");

    let page = audit_page(&gw, OPS_KEY, "").await;
    let rate = ("REJECTED".to_string(), Some("RATE_LIMITED".to_string()));
    assert_eq!(outcomes(&page), [("SUCCEEDED".to_string(), None), rate], "{page}");
    let rec = &page["records"][1];
    assert_eq!(
        (&rec["tenant"], &rec["application"], &rec["ingress"]),
        (&json!("demo"), &json!("demo"), &json!("http"))
    );
    assert_eq!(rec["requested_model"], "general-chat");
    if let Some(id) = refused_task {
        assert_eq!(rec["task_id"], id.as_str());
    }
    // The task row ends with the same code.
    let task = gw.store().get(rec["task_id"].as_str().unwrap()).await.unwrap().expect("the refused task's row");
    assert_eq!((task.state, task.error_code.as_deref()), (edgeway::task::TaskState::Rejected, Some("RATE_LIMITED")));
    gw.stop().await;
}

#[tokio::test]
async fn a_call_refused_by_a_full_queue_leaves_a_rejected_record() {
    let fake = FakeEngine::start_with(Knobs::slow(1000, 50)).await;
    let gw = TestGateway::with_engine_edit(&fake.url(), "openai", "queue_capacity = 1", |t| {
        t.replace("max_concurrency = 2", "max_concurrency = 1")
    })
    .await;
    gw.wait_ready().await;
    let mut rx = gw.recorder().subscribe();
    // One call runs, a second waits in the queue, a third finds it full.
    let mut running = post_chat(&gw, DEMO_KEY, &chat_body(true)).await;
    assert_eq!(running.status(), 200);
    running.chunk().await.unwrap().expect("first chunk");
    let queued = tokio::spawn({
        let (body, url) = (chat_body(false), gw.base_url.clone());
        async move { client().post(format!("{url}/v1/chat/completions")).bearer_auth(DEMO_KEY).json(&body).send().await }
    });
    common::next_event(&mut rx, "the second call queued", |e| e.state == edgeway::task::TaskState::Queued).await;
    let r = post_chat(&gw, DEMO_KEY, &chat_body(false)).await;
    assert_eq!(r.status(), 503);
    assert_eq!(error_code(&r.json().await.unwrap()), "QUEUE_FULL");
    queued.abort();
    drop(running);

    let page = audit_page(&gw, OPS_KEY, "").await;
    let full = ("REJECTED".to_string(), Some("QUEUE_FULL".to_string()));
    assert!(outcomes(&page).contains(&full), "{page}");
    assert_eq!(outcomes(&page).iter().filter(|o| o.0 == "REJECTED").count(), 1, "{page}");
    gw.stop().await;
}

#[tokio::test]
async fn a_caller_cannot_claim_the_platforms_user() {
    let (_fake, gw) = gateway("").await;
    let mut as_user = chat_body(false);
    as_user["user"] = json!("edgeway:summary");
    let mut as_metadata = chat_body(false);
    as_metadata["metadata"] = json!({"user_id": "edgeway:anything"});
    for body in [as_user, as_metadata] {
        let r = post_chat(&gw, DEMO_KEY, &body).await;
        assert_eq!(r.status(), 400);
        let v: Value = r.json().await.unwrap();
        assert_eq!(error_code(&v), "INVALID_REQUEST", "{v}");
        assert!(v["error"]["message"].as_str().unwrap().contains("'edgeway:'"), "{v}");
    }
    let mut plain = chat_body(false);
    plain["user"] = json!("edgeway-fan");
    assert_eq!(post_chat(&gw, DEMO_KEY, &plain).await.status(), 200, "only the prefix is reserved");
    let page = audit_page(&gw, OPS_KEY, "").await;
    let users: Vec<&Value> = page["records"].as_array().unwrap().iter().map(|r| &r["user_id"]).collect();
    assert_eq!(users, [&Value::Null, &Value::Null, &json!("edgeway-fan")], "no record names the platform's user");
    gw.stop().await;
}

fn edgeway(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_edgeway")).args(args).output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

/// A store with records of two tenants: a copy of its database (with its
/// WAL, once everything is committed and nothing more is written), in a
/// directory the caller keeps.
async fn stopped_store(dir: &Path) -> PathBuf {
    let (_fake, gw) = gateway("").await;
    for key in [DEMO_KEY, DEMO_KEY, OTHER_KEY] {
        assert_eq!(post_chat(&gw, key, &chat_body(false)).await.status(), 200);
    }
    let r = post_chat(&gw, DEMO_KEY, &json!({"model": "nope", "messages": [{"role": "user", "content": "hi"}]})).await;
    assert!(r.status().is_client_error());
    gw.store().flush().await;
    let copy = copy_db(&gw.db_path(), dir);
    gw.stop().await;
    copy
}

fn copy_db(from: &Path, dir: &Path) -> PathBuf {
    // Without the shared-memory index: SQLite rebuilds it from the WAL.
    for ext in ["", "-wal"] {
        let f = PathBuf::from(format!("{}{ext}", from.display()));
        if f.exists() {
            std::fs::copy(&f, dir.join(format!("t.db{ext}"))).unwrap();
        }
    }
    dir.join("t.db")
}

#[tokio::test]
async fn verify_names_the_first_edited_deleted_or_reordered_record() {
    let dir = TempDir::new("edgeway-audit");
    let db = stopped_store(&dir.0).await;
    let (code, out, err) = edgeway(&["audit", "verify", "--db", db.to_str().unwrap()]);
    assert_eq!((code, out.trim()), (0, "audit chain intact: 4 records"), "{err}");

    let tampers: [(&str, &str, &str); 4] = [
        (
            "edit",
            "UPDATE audit_log SET record = replace(record, '\"output_tokens\":5', '\"output_tokens\":1') WHERE seq = 2",
            "audit record 2",
        ),
        ("delete", "DELETE FROM audit_log WHERE seq = 2", "audit record 3"),
        (
            "reorder",
            "UPDATE audit_log SET seq = -1 WHERE seq = 1; UPDATE audit_log SET seq = 1 WHERE seq = 3; \
             UPDATE audit_log SET seq = 3 WHERE seq = -1",
            "audit record 1",
        ),
        // The indexed columns are copies of the chained record, for queries.
        ("edit the tenant column", "UPDATE audit_log SET tenant = 'demo' WHERE seq = 3", "audit record 3"),
    ];
    for (what, sql, named) in tampers {
        let t = TempDir::new("edgeway-audit-t");
        let copy = copy_db(&db, &t.0);
        rusqlite::Connection::open(&copy).unwrap().execute_batch(sql).unwrap();
        let (code, _, err) = edgeway(&["audit", "verify", "--db", copy.to_str().unwrap()]);
        assert_eq!(code, 1, "{what}: {err}");
        assert!(err.contains(named), "{what}: {err}");
    }
    let (code, _, err) = edgeway(&["audit", "verify", "--db", dir.0.join("missing.db").to_str().unwrap()]);
    assert_eq!(code, 2, "{err}");
}

#[tokio::test]
async fn export_writes_json_lines_filtered_by_tenant_and_time() {
    let dir = TempDir::new("edgeway-audit");
    let db = stopped_store(&dir.0).await;
    let db = db.to_str().unwrap();
    let lines = |args: &[&str]| -> Vec<Value> {
        let mut a = vec!["audit", "export", "--db", db];
        a.extend_from_slice(args);
        let (code, out, err) = edgeway(&a);
        assert_eq!(code, 0, "{err}");
        out.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
    };
    let all = lines(&[]);
    assert_eq!(all.len(), 4);
    let seqs: Vec<i64> = all.iter().map(|r| r["seq"].as_i64().unwrap()).collect();
    assert_eq!(seqs, [1, 2, 3, 4]);
    let demo = lines(&["--tenant", "demo", "--since", "1970-01-01"]);
    assert_eq!(demo.len(), 3);
    assert!(demo.iter().all(|r| r["tenant"] == "demo"));
    let other = lines(&["--tenant", "other"]);
    assert_eq!(other.len(), 1);
    let third_at = all[2]["at_ms"].as_i64().unwrap().to_string();
    let since = lines(&["--since", &third_at]);
    assert!(since.iter().any(|r| r["seq"] == 3) && since.iter().any(|r| r["seq"] == 4), "{since:?}");
    assert!(since.iter().all(|r| r["at_ms"].as_i64().unwrap() >= all[2]["at_ms"].as_i64().unwrap()));
    assert!(lines(&["--since", "2999-01-01T00:00:00Z"]).is_empty());
    let (code, _, err) = edgeway(&["audit", "export", "--db", db, "--since", "last tuesday"]);
    assert_eq!(code, 2, "{err}");
}
