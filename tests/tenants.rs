//! Two tenants on one gateway, end to end: `demo` (applications `demo` and
//! `ops`, its admin; device `demo-device-1`) and `acme` (applications
//! `acme` and `acme-ops`, its admin; device `acme-device-1`). Nothing a
//! tenant's calls leave (tasks, their events, idempotency keys, sessions,
//! audit records, NATS cancels, the status snapshot and its admin actions)
//! is visible to the other, also under concurrent HTTP, MQTT and NATS load
//! where every answer, event and stored row is searched for the other
//! tenant's marker. A whole gateway on port 0, a fake engine that echoes
//! the prompt, the embedded broker, a real `nats-server` and the real
//! SQLite file (prompts stored, so that there is text to search).

mod common;
mod mqtt_support;

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use async_nats::{HeaderMap, StatusCode, Subscriber};
use common::{client, error_code, get_json, read_sse, DEMO_KEY, OPS_KEY};
use edgeway::ingress::nats::BusState;
use edgeway::testing::{FakeEngine, Knobs, NatsServer, TestGateway};
use futures::StreamExt;
use mqtt_support::{device, mqtt_toml, Device, D1, V};
use serde_json::{json, Value};

const LIMIT: Duration = Duration::from_secs(30);
const ACME_KEY: &str = "sk-tenants-acme";
const ACME_OPS_KEY: &str = "sk-tenants-acme-ops";
const ACME_DEVICE: (&str, &str) = ("acme-device-1", "acme-pass-1");

/// A tenant as the tests use it: its keys, device and marker.
#[derive(Clone, Copy)]
struct Tenant {
    name: &'static str,
    key: &'static str,
    admin: &'static str,
    device: (&'static str, &'static str),
    /// In every prompt and request id of the tenant's calls.
    marker: &'static str,
}

const DEMO: Tenant = Tenant { name: "demo", key: DEMO_KEY, admin: OPS_KEY, device: D1, marker: "ALPHAMARK" };
const ACME: Tenant =
    Tenant { name: "acme", key: ACME_KEY, admin: ACME_OPS_KEY, device: ACME_DEVICE, marker: "OMEGAMARK" };

impl Tenant {
    fn other(&self) -> Tenant {
        if self.name == "demo" {
            ACME
        } else {
            DEMO
        }
    }
}

fn digest(key: &str) -> String {
    hex::encode(edgeway::config::hash_api_key(key))
}

async fn gateway(knobs: Knobs) -> (FakeEngine, NatsServer, TestGateway, async_nats::Client) {
    let nats = NatsServer::start(false).await;
    let fake = FakeEngine::start_with(Knobs { echo: true, ..knobs }).await;
    let extra = format!(
        r#"
[applications.acme]
tenant = "acme"
api_key_sha256 = ["{acme}"]
[applications.acme-ops]
tenant = "acme"
api_key_sha256 = ["{acme_ops}"]
max_priority = "P0"
default_priority = "P1"
admin = true
[devices.acme-device-1]
tenant = "acme"
application = "acme"
password_sha256 = "{device}"
{mqtt}
[nats]
url = "{nats}"
"#,
        acme = digest(ACME_KEY),
        acme_ops = digest(ACME_OPS_KEY),
        device = digest(ACME_DEVICE.1),
        mqtt = mqtt_toml("coalesce_ms = 0"),
        nats = nats.url(),
    );
    let gw = TestGateway::with_engine_edit(&fake.url(), "openai", &extra, |t| {
        t.replace("[store]\n", "[store]\nstore_prompts = true\n")
    })
    .await;
    gw.wait_ready().await;
    gw.nats().wait_for(BusState::Connected).await;
    let bus = async_nats::connect(nats.url()).await.unwrap();
    (fake, nats, gw, bus)
}

fn chat(t: Tenant, what: &str, stream: bool) -> Value {
    json!({
        "model": "general-chat",
        "messages": [{"role": "user", "content": format!("{} {what}", t.marker)}],
        "request_id": format!("{}-{what}", t.marker),
        "stream": stream,
        "max_tokens": 3,
    })
}

fn bearer(key: &str) -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert("Authorization", format!("Bearer {key}").as_str());
    h
}

async fn post(gw: &TestGateway, key: &str, path: &str, body: &Value, idempotency: Option<&str>) -> reqwest::Response {
    let mut rb = client().post(format!("{}{path}", gw.base_url)).bearer_auth(key).json(body);
    if let Some(k) = idempotency {
        rb = rb.header("Idempotency-Key", k);
    }
    rb.send().await.unwrap()
}

async fn status_of(gw: &TestGateway, key: &str, method: reqwest::Method, path: &str) -> u16 {
    client().request(method, format!("{}{path}", gw.base_url)).bearer_auth(key).send().await.unwrap().status().as_u16()
}

/// A NATS chat call's reply stream, once the service answered it.
async fn nats_start(bus: &async_nats::Client, key: &str, body: &Value) -> (Subscriber, async_nats::Message) {
    let payload = serde_json::to_vec(body).unwrap();
    for _ in 0..200 {
        let inbox = bus.new_inbox();
        let mut sub = bus.subscribe(inbox.clone()).await.unwrap();
        bus.publish_with_reply_and_headers("ai.v1.chat", inbox, bearer(key), payload.clone().into()).await.unwrap();
        let first = tokio::time::timeout(LIMIT, sub.next()).await.expect("an answer in time").expect("open");
        if first.status == Some(StatusCode::NO_RESPONDERS) {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        }
        return (sub, first);
    }
    panic!("the edgeway service never answered");
}

/// Every event of a NATS chat call to its terminal one (keepalives
/// skipped), as JSON.
async fn nats_call(bus: &async_nats::Client, key: &str, body: &Value) -> Vec<Value> {
    let (mut sub, first) = nats_start(bus, key, body).await;
    let mut next = Some(first);
    let mut out = Vec::new();
    loop {
        let m = match next.take() {
            Some(m) => m,
            None => tokio::time::timeout(LIMIT, sub.next()).await.expect("next event in time").expect("open"),
        };
        if m.payload.is_empty() {
            continue;
        }
        let v: Value = serde_json::from_slice(&m.payload).unwrap();
        let end = matches!(v["type"].as_str(), Some("done" | "error"));
        out.push(v);
        if end {
            return out;
        }
    }
}

async fn nats_cancel(bus: &async_nats::Client, key: &str, request_id: &str) -> Value {
    let body = serde_json::to_vec(&json!({ "request_id": request_id })).unwrap().into();
    let m = bus.request_with_headers("ai.v1.cancel", bearer(key), body).await.expect("cancel answered");
    serde_json::from_slice(&m.payload).unwrap()
}

async fn admin_status(gw: &TestGateway, admin: &str) -> Value {
    let r = client().get(format!("{}/admin/status", gw.base_url)).bearer_auth(admin).send().await.unwrap();
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

/// Snapshots of `admin`'s status until `pred` holds: the status is polled,
/// as its users do.
async fn status_until(gw: &TestGateway, admin: &str, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
    let wait = async {
        loop {
            let s = admin_status(gw, admin).await;
            if pred(&s) {
                return s;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::time::timeout(LIMIT, wait).await.unwrap_or_else(|_| panic!("never saw: {what}"))
}

fn has_task(s: &Value, id: &str) -> bool {
    s["tasks"].as_array().unwrap().iter().any(|t| t["task_id"] == id)
}

#[tokio::test]
async fn a_tenant_sees_none_of_the_others_tasks_keys_sessions_audit_cancels_or_status() {
    // Slow tokens: a call without `max_tokens` runs long enough to be
    // seen running and cancelled; the others ask for 3.
    let (_fake, _nats, gw, bus) = gateway(Knobs::slow(100_000, 100)).await;

    // Tasks: demo's task is not acme's to read, follow or cancel.
    let r = post(&gw, DEMO_KEY, "/v1/tasks", &chat(DEMO, "task", true), None).await;
    assert_eq!(r.status(), 202);
    let task: Value = r.json().await.unwrap();
    let task_id = task["task_id"].as_str().unwrap().to_string();
    gw.wait_for_state(&task_id, edgeway::task::TaskState::Succeeded).await;
    assert_eq!(status_of(&gw, DEMO_KEY, reqwest::Method::GET, &format!("/v1/tasks/{task_id}")).await, 200);
    for (method, path) in [
        (reqwest::Method::GET, format!("/v1/tasks/{task_id}")),
        (reqwest::Method::GET, format!("/v1/tasks/{task_id}/events")),
        (reqwest::Method::DELETE, format!("/v1/tasks/{task_id}")),
    ] {
        assert_eq!(status_of(&gw, ACME_KEY, method.clone(), &path).await, 404, "{method} {path}");
        assert_eq!(status_of(&gw, ACME_OPS_KEY, method.clone(), &path).await, 404, "{method} {path} (admin)");
    }

    // Idempotency keys: the same key in both tenants is two tasks, each
    // answering its own prompt; a repeat in one tenant joins its own.
    let mut ids = Vec::new();
    for t in [DEMO, ACME, DEMO] {
        let r = post(&gw, t.key, "/v1/chat/completions", &chat(t, "idem", false), Some("shared-key-1")).await;
        assert_eq!(r.status(), 200);
        let id = r.headers()["x-task-id"].to_str().unwrap().to_string();
        let v: Value = r.json().await.unwrap();
        let text = v["choices"][0]["message"]["content"].as_str().unwrap().to_string();
        assert!(text.contains(t.marker) && !text.contains(t.other().marker), "{}: {text}", t.name);
        ids.push(id);
    }
    assert_ne!(ids[0], ids[1], "one key, two tenants, two tasks");
    assert_eq!(ids[0], ids[2], "a repeat within the tenant joins its task");

    // Sessions: demo's session is not found for acme, nor usable in a call.
    let r = post(&gw, DEMO_KEY, "/v1/sessions", &json!({}), None).await;
    assert_eq!(r.status(), 201);
    let session = r.json::<Value>().await.unwrap()["id"].as_str().unwrap().to_string();
    assert_eq!(status_of(&gw, DEMO_KEY, reqwest::Method::GET, &format!("/v1/sessions/{session}")).await, 200);
    assert_eq!(status_of(&gw, ACME_KEY, reqwest::Method::GET, &format!("/v1/sessions/{session}")).await, 404);
    let mut body = chat(ACME, "in-their-session", false);
    body["session_id"] = json!(session);
    let r = post(&gw, ACME_KEY, "/v1/chat/completions", &body, None).await;
    assert_eq!(r.status(), 404);
    assert_eq!(error_code(&r.json::<Value>().await.unwrap()), "SESSION_NOT_FOUND");
    let listed = get_json(&gw, ACME_KEY, "/v1/sessions").await;
    assert!(!listed.to_string().contains(&session), "{listed}");

    // A failure of demo's (a refused call) for the status snapshots below.
    let mut bad = chat(DEMO, "refused", false);
    bad["model"] = json!("no-such-model");
    assert_eq!(post(&gw, DEMO_KEY, "/v1/chat/completions", &bad, None).await.status(), 400);

    // NATS cancels: demo's running call, by its request id, is out of
    // acme's reach; demo's admin sees it running, acme's does not.
    let mut long = chat(DEMO, "long", true);
    long.as_object_mut().unwrap().remove("max_tokens");
    let (mut sub, first) = nats_start(&bus, DEMO_KEY, &long).await;
    let accepted: Value = serde_json::from_slice(&first.payload).unwrap();
    assert_eq!(accepted["type"], "accepted", "{accepted}");
    let long_id = accepted["task_id"].as_str().unwrap().to_string();
    let theirs = nats_cancel(&bus, ACME_KEY, "ALPHAMARK-long").await;
    assert_eq!(theirs["code"], "INVALID_REQUEST", "acme cannot find demo's request: {theirs}");
    let s = status_until(&gw, OPS_KEY, "demo's running call", |s| has_task(s, &long_id)).await;
    assert!(s["failures"].to_string().contains("no-such-model"), "demo's admin sees demo's failure: {s}");
    // Acme's device connected, and demo's: each admin lists its own.
    let addr = gw.running.as_ref().unwrap().mqtt.expect("mqtt").mqtt;
    let _d1 = device(addr, V::V4, D1).await;
    let _d2 = device(addr, V::V4, ACME_DEVICE).await;
    let s = status_until(&gw, OPS_KEY, "both devices", |s| s["devices"]["connected"] == 2).await;
    assert_eq!(s["devices"]["ids"], json!([D1.0]));
    let s = admin_status(&gw, ACME_OPS_KEY).await;
    assert_eq!(s["devices"]["ids"], json!([ACME_DEVICE.0]), "{s}");
    assert!(!has_task(&s, &long_id), "acme's admin sees no demo task: {s}");
    assert_eq!(s["tasks_total"], 0, "{s}");
    // Acme's own refusal (the session call above) is there; demo's is not.
    assert!(!s["failures"].to_string().contains("no-such-model"), "acme's admin sees no demo failure: {s}");
    let text = s.to_string();
    assert!(!text.contains(DEMO.marker) && !text.contains(D1.0) && !text.contains(&long_id), "{text}");
    // An admin action on another tenant's task: as if there were none.
    assert_eq!(status_of(&gw, ACME_OPS_KEY, reqwest::Method::DELETE, &format!("/admin/tasks/{long_id}")).await, 404);
    assert!(has_task(&admin_status(&gw, OPS_KEY).await, &long_id), "still running");
    let ours = nats_cancel(&bus, DEMO_KEY, "ALPHAMARK-long").await;
    assert_eq!(ours["cancelled"], true, "{ours}");
    loop {
        let m = tokio::time::timeout(LIMIT, sub.next()).await.expect("the end in time").expect("open");
        let kind = m.headers.as_ref().and_then(|h| h.get("Edgeway-Event")).map(|v| v.as_str().to_string());
        if kind.as_deref() == Some("error") {
            break;
        }
    }

    // Audit: each admin reads its own tenant's records only.
    gw.store().flush().await;
    for t in [DEMO, ACME] {
        let page = get_json(&gw, t.admin, "/admin/audit?limit=1000").await;
        let records = page["records"].as_array().unwrap_or_else(|| panic!("{page}"));
        assert!(!records.is_empty(), "{}", t.name);
        assert!(records.iter().all(|r| r["tenant"] == t.name), "{}: {page}", t.name);
        assert!(!page.to_string().contains(t.other().marker), "{}: {page}", t.name);
        let other = client()
            .get(format!("{}/admin/audit?tenant={}", gw.base_url, t.other().name))
            .bearer_auth(t.admin)
            .send()
            .await
            .unwrap();
        assert_eq!(other.status(), 403, "{} asks for the other tenant's records", t.name);
    }
    assert!(
        !get_json(&gw, ACME_OPS_KEY, "/admin/audit?limit=1000").await.to_string().contains(&task_id),
        "demo's task is in no acme record"
    );
    gw.stop().await;
}

/// One tenant's share of the load: HTTP calls (half streamed), MQTT
/// requests of its device, NATS calls; every answer must hold its own
/// marker and none of the other's. Returns its task ids.
async fn load(gw: &TestGateway, bus: &async_nats::Client, addr: std::net::SocketAddr, t: Tenant) -> Vec<String> {
    let http = futures::future::join_all((0..12).map(|i| async move {
        let stream = i % 2 == 0;
        let r = post(gw, t.key, "/v1/chat/completions", &chat(t, &format!("http-{i}"), stream), None).await;
        assert_eq!(r.status(), 200);
        let id = r.headers()["x-task-id"].to_str().unwrap().to_string();
        let text = if stream {
            let (events, done) = read_sse(r).await;
            assert!(done);
            serde_json::to_string(&events).unwrap()
        } else {
            r.text().await.unwrap()
        };
        assert!(text.contains(t.marker) && !text.contains(t.other().marker), "{}: {text}", t.name);
        id
    }));
    let nats = futures::future::join_all((0..8).map(|i| async move {
        let events = nats_call(bus, t.key, &chat(t, &format!("nats-{i}"), true)).await;
        let text = serde_json::to_string(&events).unwrap();
        assert_eq!(events.last().unwrap()["type"], "done", "{text}");
        assert!(text.contains(t.marker) && !text.contains(t.other().marker), "{}: {text}", t.name);
        events[0]["task_id"].as_str().unwrap().to_string()
    }));
    let mqtt = async move {
        let mut d: Device = device(addr, V::V5, t.device).await;
        d.subscribe(&d.topic("res/#")).await;
        let mut ids = Vec::new();
        for i in 0..8 {
            let mut req = chat(t, &format!("mqtt-{i}"), true);
            req.as_object_mut().unwrap().remove("stream");
            let rid = req["request_id"].as_str().unwrap().to_string();
            d.publish(&d.topic("req"), req.to_string()).await;
            let events = d.stream(&d.topic(&format!("res/{rid}"))).await;
            let text = serde_json::to_string(&events).unwrap();
            assert_eq!(events.last().unwrap()["type"], "done", "{text}");
            assert!(text.contains(t.marker) && !text.contains(t.other().marker), "{}: {text}", t.name);
            ids.push(events[0]["task_id"].as_str().unwrap().to_string());
        }
        ids
    };
    let (http, nats, mqtt) = tokio::join!(http, nats, mqtt);
    [http, nats, mqtt].concat()
}

/// Every row of every table of the SQLite file, as text, with the tenant
/// it belongs to (its `tenant` column, else its task's), where known.
fn rows_by_tenant(db: &std::path::Path) -> Vec<(Option<String>, String, String)> {
    let conn = rusqlite::Connection::open(db).unwrap();
    let tables: Vec<String> = conn
        .prepare("SELECT name FROM sqlite_master WHERE type = 'table'")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    let task_tenant: HashMap<String, String> = conn
        .prepare("SELECT task_id, tenant FROM tasks")
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    let mut out = Vec::new();
    for table in tables {
        let mut stmt = conn.prepare(&format!("SELECT * FROM \"{table}\"")).unwrap();
        let names: Vec<String> = stmt.column_names().iter().map(|s| s.to_string()).collect();
        let mut rows = stmt.query([]).unwrap();
        while let Some(row) = rows.next().unwrap() {
            let mut cells = BTreeMap::new();
            for (i, n) in names.iter().enumerate() {
                let v = match row.get_ref(i).unwrap() {
                    rusqlite::types::ValueRef::Text(t) | rusqlite::types::ValueRef::Blob(t) => {
                        String::from_utf8_lossy(t).into_owned()
                    }
                    rusqlite::types::ValueRef::Integer(n) => n.to_string(),
                    rusqlite::types::ValueRef::Real(f) => f.to_string(),
                    rusqlite::types::ValueRef::Null => String::new(),
                };
                cells.insert(n.clone(), v);
            }
            let tenant = cells
                .get("tenant")
                .filter(|t| !t.is_empty())
                .cloned()
                .or_else(|| cells.get("task_id").and_then(|id| task_tenant.get(id)).cloned());
            let text = cells.values().cloned().collect::<Vec<_>>().join("\u{1f}");
            out.push((tenant, table.clone(), text));
        }
    }
    out
}

#[tokio::test]
async fn under_concurrent_load_on_three_ingresses_no_byte_of_one_tenant_reaches_the_other() {
    let (_fake, _nats, gw, bus) = gateway(Knobs::default()).await;
    let addr = gw.running.as_ref().unwrap().mqtt.expect("mqtt").mqtt;
    let mut events = bus.subscribe("ai.v1.events.>").await.unwrap();
    bus.flush().await.unwrap();

    let (demo_ids, acme_ids) = tokio::join!(load(&gw, &bus, addr, DEMO), load(&gw, &bus, addr, ACME));
    assert_eq!((demo_ids.len(), acme_ids.len()), (28, 28));

    // Lifecycle events: on the subject of their own tenant, naming it, and
    // carrying nothing of the other; every task's end is among them.
    let mut ended: Vec<String> = Vec::new();
    while ended.len() < 56 {
        let m = tokio::time::timeout(LIMIT, events.next()).await.expect("lifecycle events").unwrap();
        let v: Value = serde_json::from_slice(&m.payload).unwrap();
        let tenant = v["tenant"].as_str().unwrap();
        let t = if tenant == "demo" { DEMO } else { ACME };
        assert_eq!(tenant, t.name);
        assert!(m.subject.as_str().starts_with(&format!("ai.v1.events.{tenant}.")), "{}", m.subject);
        let text = String::from_utf8_lossy(&m.payload);
        assert!(!text.contains(t.other().marker), "{}: {text}", m.subject);
        let id = v["task_id"].as_str().unwrap().to_string();
        let own = if t.name == "demo" { &demo_ids } else { &acme_ids };
        if v["state"] == "SUCCEEDED" {
            assert!(own.contains(&id), "{id} ended on {}", m.subject);
            ended.push(id);
        }
    }

    // Audit pages: each admin's holds its tenant's 28 calls, nothing else.
    gw.store().flush().await;
    for (t, ids) in [(DEMO, &demo_ids), (ACME, &acme_ids)] {
        let page = get_json(&gw, t.admin, "/admin/audit?limit=1000").await;
        let records = page["records"].as_array().unwrap_or_else(|| panic!("{page}"));
        let mut seen: Vec<String> = records.iter().map(|r| r["task_id"].as_str().unwrap().to_string()).collect();
        seen.sort();
        let mut want = ids.clone();
        want.sort();
        assert_eq!(seen, want, "{}", t.name);
        assert!(!page.to_string().contains(t.other().marker), "{}", t.name);
    }

    // The store file: no row of one tenant holds a byte of the other's
    // marker, and the markers are there (the search is not vacuous).
    let rows = rows_by_tenant(&gw.db_path());
    let mut own_hits = BTreeMap::new();
    for (tenant, table, text) in &rows {
        let Some(tenant) = tenant else { continue };
        let t = if tenant == "demo" { DEMO } else { ACME };
        assert_eq!(tenant, t.name, "{table}: {text}");
        assert!(!text.contains(t.other().marker), "a {tenant} row of {table} holds the other's marker: {text}");
        if text.contains(t.marker) {
            *own_hits.entry((tenant.clone(), table.clone())).or_insert(0) += 1;
        }
    }
    for t in ["demo", "acme"] {
        assert!(own_hits.get(&(t.to_string(), "tasks".to_string())).is_some_and(|n| *n >= 28), "{own_hits:?}");
    }
    gw.stop().await;
}

/// The example configuration has the second tenant too: its own
/// application, published key and device, none shared with `demo`.
#[test]
fn the_example_config_has_a_second_tenant_with_its_own_application_key_and_device() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config/edgeway.toml");
    let text = std::fs::read_to_string(&path).unwrap();
    let env = [("HOME".to_string(), "/home/edge".to_string())];
    let cfg = edgeway::config::Config::from_toml_str(&text, env, path.parent().unwrap()).unwrap();
    let key = edgeway::config::hash_api_key("sk-edgeway-acme");
    let owners: Vec<(&str, &str)> = cfg
        .applications
        .values()
        .filter(|a| a.api_key_sha256.contains(&key))
        .map(|a| (a.name.as_str(), a.tenant.as_str()))
        .collect();
    assert_eq!(owners, [("acme", "acme")], "the published key sk-edgeway-acme is acme's");
    let demo = edgeway::config::hash_api_key(DEMO_KEY);
    assert!(cfg.applications.values().all(|a| a.tenant == "demo" || !a.api_key_sha256.contains(&demo)));
    let devices: Vec<(&String, &str)> =
        cfg.devices.iter().filter(|(_, d)| d.tenant == "acme").map(|(n, d)| (n, d.application.as_str())).collect();
    assert_eq!(devices.len(), 1, "{devices:?}");
    assert_eq!((devices[0].0.as_str(), devices[0].1), ("acme-device-1", "acme"));
    assert!(cfg.tenant_weights.contains_key("acme"));
}
