//! Cost and budgets end to end (issue 14): a whole gateway (HTTP, the MQTT
//! broker, a real `nats-server`), a fake engine, the real SQLite file.
//! Every call's result carries its cost on every ingress and in the
//! records; a spent tenant budget refuses `QUOTA_EXCEEDED` with its reset
//! time on every ingress while another tenant goes on; the warning fires
//! once; a restart on the same file keeps what was spent.

mod common;
mod mqtt_support;

use std::time::Duration;

use async_nats::{HeaderMap, StatusCode};
use common::{chat_body, client, error_code, get_json, next_event, post_chat, read_sse, DEMO_KEY, OPS_KEY};
use edgeway::config::Config;
use edgeway::ingress::nats::BusState;
use edgeway::testing::{config_toml, FakeEngine, Knobs, NatsServer, TempDir, TestGateway};
use futures::StreamExt;
use mqtt_support::{device, metric, mqtt_toml, request, validate, D1, V};
use serde_json::{json, Value};

const LIMIT: Duration = Duration::from_secs(20);
const OTHER_KEY: &str = "sk-edgeway-other-tenant";

/// One token in costs 1, one token out 2 (prices per million tokens).
const PRICES: &str = "price_input_per_mtok = 1000000\nprice_output_per_mtok = 2000000\n";

/// The example's engine with [`PRICES`], a second tenant with its own
/// (admin) application, and `extra` (TOML sections).
fn config_text(engine_url: &str, dir: &std::path::Path, extra: &str) -> String {
    let other = format!(
        "\n[applications.other]\ntenant = \"other\"\napi_key_sha256 = [\"{}\"]\nadmin = true\n",
        hex::encode(edgeway::config::hash_api_key(OTHER_KEY))
    );
    config_toml(engine_url, "openai", dir, &format!("{other}{extra}"))
        .replace("health_interval_ms = 100\n", &format!("health_interval_ms = 100\n{PRICES}"))
}

async fn start(engine_url: &str, dir: &std::path::Path, extra: &str) -> TestGateway {
    let text = config_text(engine_url, dir, extra);
    let config = Config::from_toml_str(&text, std::iter::empty(), std::path::Path::new("."))
        .unwrap_or_else(|e| panic!("test config: {e}\n{text}"));
    let gw = TestGateway::start(config).await;
    gw.wait_ready().await;
    gw
}

/// What `usage` costs at [`PRICES`].
fn priced(usage: &Value) -> f64 {
    let (i, o) = (usage["input_tokens"].as_f64().unwrap(), usage["output_tokens"].as_f64().unwrap());
    assert!(i > 0.0 && o > 0.0, "the engine reported usage: {usage}");
    i + 2.0 * o
}

/// One NATS chat call: its terminal event's JSON (retried while the
/// service is not subscribed yet).
async fn nats_call(bus: &async_nats::Client, key: &str) -> Value {
    let mut headers = HeaderMap::new();
    headers.insert("Authorization", format!("Bearer {key}").as_str());
    let body = serde_json::to_vec(&chat_body(true)).unwrap();
    for _ in 0..200 {
        let inbox = bus.new_inbox();
        let mut sub = bus.subscribe(inbox.clone()).await.unwrap();
        bus.publish_with_reply_and_headers("ai.v1.chat", inbox, headers.clone(), body.clone().into()).await.unwrap();
        loop {
            let m = tokio::time::timeout(LIMIT, sub.next()).await.expect("an answer in time").expect("open");
            if m.status == Some(StatusCode::NO_RESPONDERS) {
                break;
            }
            let v: Value = serde_json::from_slice(&m.payload).unwrap_or(Value::Null);
            if matches!(v["type"].as_str(), Some("done" | "error")) {
                return v;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the edgeway service never answered");
}

/// One MQTT device request: its terminal event.
async fn mqtt_call(gw: &TestGateway, rid: &str) -> Value {
    let addr = gw.running.as_ref().unwrap().mqtt.expect("mqtt").mqtt;
    let mut d = device(addr, V::V4, D1).await;
    d.subscribe(&d.topic("res/#")).await;
    d.publish(&d.topic("req"), request(rid).to_string()).await;
    let events = d.stream(&d.topic(&format!("res/{rid}"))).await;
    let last = events.last().unwrap().clone();
    validate(if last["type"] == "done" { "event-done" } else { "event-error" }, &last);
    d.disconnect().await;
    last
}

#[tokio::test]
async fn every_result_carries_its_cost_on_every_ingress_and_in_the_records() {
    let nats = NatsServer::start(false).await;
    let fake = FakeEngine::start_with(Knobs::default()).await;
    let dir = TempDir::new("edgeway-cost");
    let extra = format!("{}\n[nats]\nurl = \"{}\"\n", mqtt_toml("coalesce_ms = 0"), nats.url());
    let gw = start(&fake.url(), &dir.0, &extra).await;
    gw.nats().wait_for(BusState::Connected).await;
    let bus = async_nats::connect(nats.url()).await.unwrap();
    let mut total = 0.0;

    // HTTP, a whole answer.
    let r = post_chat(&gw, DEMO_KEY, &chat_body(false)).await;
    assert_eq!(r.status(), 200);
    let task_id = r.headers()["x-task-id"].to_str().unwrap().to_string();
    let v: Value = r.json().await.unwrap();
    let cost = priced(&v["edge"]["usage"]);
    assert_eq!(v["edge"]["cost"].as_f64(), Some(cost), "edge.cost: {v}");
    total += cost;
    // HTTP, streamed: the final chunk's edge block.
    let (chunks, done) = read_sse(post_chat(&gw, DEMO_KEY, &chat_body(true)).await).await;
    assert!(done);
    let edge = &chunks.last().unwrap()["edge"];
    assert_eq!(edge["cost"].as_f64(), Some(priced(&edge["usage"])), "{edge}");
    total += priced(&edge["usage"]);
    // MQTT.
    let done = mqtt_call(&gw, "cost-mqtt").await;
    assert_eq!(done["type"], "done", "{done}");
    assert_eq!(done["result"]["cost"].as_f64(), Some(priced(&done["result"]["usage"])), "{done}");
    total += priced(&done["result"]["usage"]);
    // NATS.
    let done = nats_call(&bus, DEMO_KEY).await;
    assert_eq!(done["type"], "done", "{done}");
    assert_eq!(done["result"]["cost"].as_f64(), Some(priced(&done["result"]["usage"])), "{done}");
    total += priced(&done["result"]["usage"]);

    // The task API, the task row and the audit record.
    gw.store().flush().await;
    let t = get_json(&gw, DEMO_KEY, &format!("/v1/tasks/{task_id}")).await;
    assert_eq!(t["edge"]["cost"].as_f64(), Some(cost), "{t}");
    let conn = rusqlite::Connection::open(gw.db_path()).unwrap();
    let row: Option<f64> =
        conn.query_row("SELECT cost FROM tasks WHERE task_id = ?1", [&task_id], |r| r.get(0)).unwrap();
    assert_eq!(row, Some(cost));
    let page = get_json(&gw, OPS_KEY, "/admin/audit").await;
    let rec = page["records"].as_array().unwrap().iter().find(|r| r["task_id"] == task_id.as_str()).unwrap().clone();
    assert_eq!(rec["cost"].as_f64(), Some(cost), "{rec}");

    // The metric, by tenant and application.
    let sum = metric(&gw, "cost_total{application=\"demo\",tenant=\"demo\"}").expect("edgeway_cost_total");
    assert_eq!(sum, total);
    gw.stop().await;
}

#[tokio::test]
async fn a_spent_tenant_budget_is_quota_exceeded_with_its_reset_time_on_every_ingress() {
    let nats = NatsServer::start(false).await;
    let fake = FakeEngine::start_with(Knobs::default()).await;
    let dir = TempDir::new("edgeway-budget");
    // One call is 7 tokens in and 5 out with the fake: 12 of 20 (60 %,
    // past the 50 % warning), then 24 (spent).
    let extra = format!(
        "{}\n[nats]\nurl = \"{}\"\n[tenants.demo.budget]\ndaily_tokens = 20\nwarn_percent = 50\n",
        mqtt_toml("coalesce_ms = 0"),
        nats.url()
    );
    let gw = start(&fake.url(), &dir.0, &extra).await;
    gw.nats().wait_for(BusState::Connected).await;
    let bus = async_nats::connect(nats.url()).await.unwrap();
    let mut events = gw.recorder().subscribe();

    let r = post_chat(&gw, DEMO_KEY, &chat_body(false)).await;
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["edge"]["usage"]["total_tokens"], 12, "the fake's usage this test counts on: {v}");
    let first = v["edge"]["task_id"].as_str().unwrap().to_string();
    // The warning: on the terminal event of the task that crossed it.
    let ended = next_event(&mut events, "the first task's end", |e| e.task_id == first && e.state.is_terminal()).await;
    assert_eq!(ended.budget_warnings.len(), 1, "{ended:?}");
    let w = serde_json::to_value(&ended.budget_warnings[0]).unwrap();
    assert_eq!(
        (&w["scope"], &w["name"], &w["window"], &w["warn_percent"]),
        (&json!("tenant"), &json!("demo"), &json!("daily"), &json!(50))
    );
    validate("lifecycle-event", &serde_json::to_value(&*ended).unwrap());
    // Still under 20: the second call runs, and warns no more.
    let r = post_chat(&gw, DEMO_KEY, &chat_body(false)).await;
    assert_eq!(r.status(), 200);
    let second = r.headers()["x-task-id"].to_str().unwrap().to_string();
    let ended =
        next_event(&mut events, "the second task's end", |e| e.task_id == second && e.state.is_terminal()).await;
    assert!(ended.budget_warnings.is_empty(), "once per window: {ended:?}");
    assert_eq!(metric(&gw, "budget_warnings_total{application=\"*\",tenant=\"demo\",window=\"daily\"}"), Some(1.0));

    // 24 of 20: spent. HTTP: 429 with the reset time.
    let now_ms = edgeway::task::now_ms();
    let next_midnight = (now_ms / 86_400_000 + 1) * 86_400_000;
    let r = post_chat(&gw, DEMO_KEY, &chat_body(false)).await;
    assert_eq!(r.status(), 429);
    assert!(r.headers().contains_key("retry-after"));
    let v: Value = r.json().await.unwrap();
    assert_eq!(error_code(&v), "QUOTA_EXCEEDED", "{v}");
    let resets_at = v["error"]["resets_at"].as_str().unwrap_or_else(|| panic!("resets_at: {v}")).to_string();
    assert_eq!(edgeway::gateway::parse_time(&resets_at), Some(next_midnight), "{resets_at}");
    let wait = v["error"]["retry_after_ms"].as_i64().unwrap();
    assert!(wait > 0 && (next_midnight - now_ms - wait).abs() < 60_000, "{wait}");
    // MQTT and NATS: the same refusal.
    let e = mqtt_call(&gw, "budget-mqtt").await;
    assert_eq!((&e["type"], &e["code"]), (&json!("error"), &json!("QUOTA_EXCEEDED")), "{e}");
    assert_eq!(e["resets_at"], resets_at.as_str());
    assert!(e["retry_after_ms"].as_u64().is_some(), "{e}");
    let e = nats_call(&bus, DEMO_KEY).await;
    assert_eq!((&e["type"], &e["code"]), (&json!("error"), &json!("QUOTA_EXCEEDED")), "{e}");
    assert_eq!(e["resets_at"], resets_at.as_str());

    // Another tenant is not touched.
    assert_eq!(post_chat(&gw, OTHER_KEY, &chat_body(false)).await.status(), 200);

    // Each refused call left a REJECTED audit record.
    gw.store().flush().await;
    let page = get_json(&gw, OPS_KEY, "/admin/audit").await;
    let refused: Vec<&str> = page["records"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["result"] == "REJECTED" && r["error_code"] == "QUOTA_EXCEEDED")
        .map(|r| r["ingress"].as_str().unwrap())
        .collect();
    assert_eq!(refused, ["http", "mqtt", "nats"], "{page}");

    // The admin view: spent, limit, reset.
    let view = get_json(&gw, OPS_KEY, "/admin/budgets").await;
    let daily = view["budgets"]
        .as_array()
        .unwrap_or_else(|| panic!("{view}"))
        .iter()
        .find(|b| b["scope"] == "tenant" && b["window"] == "daily")
        .unwrap()
        .clone();
    assert_eq!(
        (&daily["name"], &daily["spent_tokens"], &daily["limit_tokens"]),
        (&json!("demo"), &json!(24), &json!(20))
    );
    assert_eq!(daily["resets_at"], resets_at.as_str());
    assert_eq!(daily["spent_cost"].as_f64(), Some(2.0 * (7.0 + 2.0 * 5.0)));
    let r =
        client().get(format!("{}/admin/budgets?tenant=other", gw.base_url)).bearer_auth(OPS_KEY).send().await.unwrap();
    assert_eq!(r.status(), 403, "another tenant's budgets");
    let r = client().get(format!("{}/admin/budgets", gw.base_url)).bearer_auth(DEMO_KEY).send().await.unwrap();
    assert_eq!(r.status(), 403, "admin applications only");
    let other = get_json(&gw, OTHER_KEY, "/admin/budgets").await;
    assert_eq!(other["budgets"][0]["name"], "other");
    assert_eq!(other["budgets"][0]["limit_tokens"], Value::Null);
    gw.stop().await;
}

#[tokio::test]
async fn a_restart_on_the_same_file_keeps_what_was_spent() {
    let fake = FakeEngine::start_with(Knobs::default()).await;
    let dir = TempDir::new("edgeway-budget-restart");
    let extra = "[applications.demo.budget]\nmonthly_cost = 30\n";
    let gw = start(&fake.url(), &dir.0, extra).await;
    // 17 per call at these prices: 17, then 34 of 30.
    for _ in 0..2 {
        assert_eq!(post_chat(&gw, DEMO_KEY, &chat_body(false)).await.status(), 200);
    }
    let r = post_chat(&gw, DEMO_KEY, &chat_body(false)).await;
    assert_eq!(r.status(), 429);
    gw.stop().await;

    let gw = start(&fake.url(), &dir.0, extra).await;
    let r = post_chat(&gw, DEMO_KEY, &chat_body(false)).await;
    assert_eq!(r.status(), 429, "the spent amount is read back");
    let v: Value = r.json().await.unwrap();
    assert_eq!(error_code(&v), "QUOTA_EXCEEDED");
    let now = edgeway::task::now_ms();
    let resets = edgeway::gateway::parse_time(v["error"]["resets_at"].as_str().unwrap()).unwrap();
    assert!(resets > now && resets - now <= 31 * 86_400_000, "the month's end: {v}");
    let view = get_json(&gw, OPS_KEY, "/admin/budgets").await;
    let monthly = view["budgets"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["scope"] == "application" && b["name"] == "demo" && b["window"] == "monthly")
        .unwrap_or_else(|| panic!("{view}"))
        .clone();
    assert_eq!(monthly["spent_cost"].as_f64(), Some(34.0), "{monthly}");
    // The ops application of the same tenant has no budget of its own.
    assert_eq!(post_chat(&gw, OPS_KEY, &chat_body(false)).await.status(), 200);
    gw.stop().await;
}
