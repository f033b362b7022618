//! Authorisation per application, end to end: the models, priorities and
//! ingresses an application may use (HTTP, MQTT, NATS), the user a trusted
//! header names, and API keys that expire. A whole gateway on port 0, a
//! fake engine, the embedded broker and a real `nats-server`; refusals are
//! read back from the audit trail.

mod common;
mod mqtt_support;

use std::time::Duration;

use async_nats::{HeaderMap, StatusCode};
use common::{chat_body, client, error_code, get_json, post_chat, DEMO_KEY, OPS_KEY};
use edgeway::ingress::nats::BusState;
use edgeway::testing::{FakeEngine, Knobs, NatsServer, TestGateway};
use futures::StreamExt;
use mqtt_support::{device, mqtt_toml, request, V};
use serde_json::{json, Value};

const LIMIT: Duration = Duration::from_secs(20);
/// Application `kiosk`: general-chat only, P3/P4 only, HTTP, MQTT and NATS.
const KIOSK_KEY: &str = "sk-authz-kiosk";
/// Application `batch`: NATS only.
const BATCH_KEY: &str = "sk-authz-batch";
/// Application `portal`: behind a proxy that names the user in `x-user-id`.
const PORTAL_KEY: &str = "sk-authz-portal";
const KIOSK_DEVICE: (&str, &str) = ("kiosk-device", "kiosk-pass");

fn digest(key: &str) -> String {
    hex::encode(edgeway::config::hash_api_key(key))
}

/// A second model on the same engine, the three applications, the kiosk's
/// device, the broker and the bus.
fn authz_toml(nats_url: &str) -> String {
    format!(
        r#"
[models.other-chat]
instances = ["fake"]
[applications.kiosk]
tenant = "demo"
api_key_sha256 = ["{kiosk}"]
max_priority = "P1"
default_priority = "P3"
allowed_models = ["general-chat"]
allowed_priorities = ["P3", "P4"]
allowed_ingresses = ["http", "mqtt", "nats"]
[applications.batch]
tenant = "demo"
api_key_sha256 = ["{batch}"]
allowed_ingresses = ["nats"]
[applications.portal]
tenant = "demo"
api_key_sha256 = ["{portal}"]
user_header = "X-User-Id"
[devices.kiosk-device]
tenant = "demo"
application = "kiosk"
password_sha256 = "{device}"
{mqtt}
[nats]
url = "{nats_url}"
"#,
        kiosk = digest(KIOSK_KEY),
        batch = digest(BATCH_KEY),
        portal = digest(PORTAL_KEY),
        device = digest(KIOSK_DEVICE.1),
        mqtt = mqtt_toml("coalesce_ms = 0"),
    )
}

async fn gateway() -> (FakeEngine, NatsServer, TestGateway, async_nats::Client) {
    let nats = NatsServer::start(false).await;
    let fake = FakeEngine::start_with(Knobs::default()).await;
    let gw = TestGateway::with_engine(&fake.url(), "openai", &authz_toml(&nats.url())).await;
    gw.wait_ready().await;
    gw.nats().wait_for(BusState::Connected).await;
    let bus = async_nats::connect(nats.url()).await.unwrap();
    (fake, nats, gw, bus)
}

fn chat(model: &str, priority: Option<&str>) -> Value {
    let mut b = chat_body(false);
    b["model"] = json!(model);
    if let Some(p) = priority {
        b["priority"] = json!(p);
    }
    b
}

/// One NATS chat call to its terminal event: (`done` or `error`, its JSON).
async fn nats_call(bus: &async_nats::Client, headers: HeaderMap, body: &Value) -> (String, Value) {
    let body = serde_json::to_vec(body).unwrap();
    for _ in 0..200 {
        let inbox = bus.new_inbox();
        let mut sub = bus.subscribe(inbox.clone()).await.unwrap();
        bus.publish_with_reply_and_headers("ai.v1.chat", inbox, headers.clone(), body.clone().into()).await.unwrap();
        loop {
            let m = tokio::time::timeout(LIMIT, sub.next()).await.expect("an answer in time").expect("open");
            if m.status == Some(StatusCode::NO_RESPONDERS) {
                break;
            }
            let kind = m.headers.as_ref().and_then(|h| h.get("Edgeway-Event")).map(|v| v.as_str().to_string());
            if let Some(kind @ ("done" | "error")) = kind.as_deref() {
                return (kind.to_string(), serde_json::from_slice(&m.payload).unwrap());
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the edgeway service never answered");
}

fn bearer(key: &str) -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert("Authorization", format!("Bearer {key}").as_str());
    h
}

/// The demo tenant's audit records (through the admin API).
async fn audit(gw: &TestGateway) -> Vec<Value> {
    gw.store().flush().await;
    let page = get_json(gw, OPS_KEY, "/admin/audit?limit=1000").await;
    page["records"].as_array().unwrap_or_else(|| panic!("{page}")).clone()
}

async fn denied(r: reqwest::Response, names: &str) {
    assert_eq!(r.status(), 403);
    let v: Value = r.json().await.unwrap();
    assert_eq!(error_code(&v), "PERMISSION_DENIED", "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains(names), "the message names {names:?}: {msg}");
}

#[tokio::test]
async fn an_application_uses_only_its_models_priorities_and_ingresses_on_every_ingress() {
    let (_fake, _nats, gw, bus) = gateway().await;

    // HTTP.
    assert_eq!(post_chat(&gw, KIOSK_KEY, &chat("general-chat", None)).await.status(), 200);
    assert_eq!(post_chat(&gw, KIOSK_KEY, &chat("general-chat", Some("P4"))).await.status(), 200);
    denied(post_chat(&gw, KIOSK_KEY, &chat("other-chat", None)).await, "other-chat").await;
    denied(post_chat(&gw, KIOSK_KEY, &chat("general-chat", Some("P2"))).await, "P2").await;
    denied(post_chat(&gw, BATCH_KEY, &chat("general-chat", None)).await, "http").await;
    // An unknown model stays what it was.
    let r = post_chat(&gw, KIOSK_KEY, &chat("no-such-model", None)).await;
    assert_eq!(r.status(), 400);
    // Other applications are not restricted by kiosk's lists.
    assert_eq!(post_chat(&gw, DEMO_KEY, &chat("other-chat", Some("P2"))).await.status(), 200);

    // GET /v1/models lists what the caller may name.
    let ids = |v: Value| -> Vec<String> {
        v["data"].as_array().unwrap().iter().map(|m| m["id"].as_str().unwrap().to_string()).collect()
    };
    assert_eq!(ids(get_json(&gw, KIOSK_KEY, "/v1/models").await), ["general-chat"]);
    assert_eq!(ids(get_json(&gw, DEMO_KEY, "/v1/models").await), ["general-chat", "other-chat"]);

    // MQTT: the kiosk's device.
    let addr = gw.running.as_ref().unwrap().mqtt.expect("mqtt").mqtt;
    let mut d = device(addr, V::V5, KIOSK_DEVICE).await;
    d.subscribe(&d.topic("res/#")).await;
    let mut req = request("m-other");
    req["model"] = json!("other-chat");
    d.publish(&d.topic("req"), req.to_string()).await;
    let end = d.stream(&d.topic("res/m-other")).await.pop().unwrap();
    assert_eq!((end["type"].as_str(), end["code"].as_str()), (Some("error"), Some("PERMISSION_DENIED")), "{end}");
    assert!(end["message"].as_str().unwrap().contains("other-chat"), "{end}");
    let mut req = request("m-p2");
    req["priority"] = json!("P2");
    d.publish(&d.topic("req"), req.to_string()).await;
    let end = d.stream(&d.topic("res/m-p2")).await.pop().unwrap();
    assert_eq!(end["code"], "PERMISSION_DENIED", "{end}");
    d.publish(&d.topic("req"), request("m-ok").to_string()).await;
    assert_eq!(d.stream(&d.topic("res/m-ok")).await.pop().unwrap()["type"], "done");

    // NATS.
    let (kind, v) = nats_call(&bus, bearer(KIOSK_KEY), &chat("other-chat", None)).await;
    assert_eq!((kind.as_str(), v["code"].as_str()), ("error", Some("PERMISSION_DENIED")), "{v}");
    assert!(v["message"].as_str().unwrap().contains("other-chat"), "{v}");
    let (kind, v) = nats_call(&bus, bearer(KIOSK_KEY), &chat("general-chat", Some("P1"))).await;
    assert_eq!((kind.as_str(), v["code"].as_str()), ("error", Some("PERMISSION_DENIED")), "{v}");
    assert_eq!(nats_call(&bus, bearer(BATCH_KEY), &chat("general-chat", None)).await.0, "done");
    assert_eq!(nats_call(&bus, bearer(KIOSK_KEY), &chat("general-chat", None)).await.0, "done");

    // Every refusal is a REJECTED audit record with its code.
    let records = audit(&gw).await;
    let denials: Vec<(String, String)> = records
        .iter()
        .filter(|r| r["error_code"] == "PERMISSION_DENIED")
        .map(|r| {
            assert_eq!(r["result"], "REJECTED", "{r}");
            (r["application"].as_str().unwrap().to_string(), r["ingress"].as_str().unwrap().to_string())
        })
        .collect();
    let want: Vec<(String, String)> = [
        ("kiosk", "http"),
        ("kiosk", "http"),
        ("batch", "http"),
        ("kiosk", "mqtt"),
        ("kiosk", "mqtt"),
        ("kiosk", "nats"),
        ("kiosk", "nats"),
    ]
    .iter()
    .map(|(a, i)| (a.to_string(), i.to_string()))
    .collect();
    assert_eq!(denials, want);
    gw.stop().await;
}

/// The user of a call of `key` with `headers` and a body that declares
/// `body_user`, as its audit record has it (`None`: refused, with the
/// error JSON).
async fn user_of(gw: &TestGateway, key: &str, headers: &[(&str, &str)], body_user: &str) -> Result<Value, Value> {
    let mut b = chat_body(false);
    b["user"] = json!(body_user);
    let mut rb = client().post(format!("{}/v1/chat/completions", gw.base_url)).bearer_auth(key).json(&b);
    for (k, v) in headers {
        rb = rb.header(*k, *v);
    }
    let r = rb.send().await.unwrap();
    if r.status() != 200 {
        return Err(r.json().await.unwrap());
    }
    let task = r.headers()["x-task-id"].to_str().unwrap().to_string();
    let records = audit(gw).await;
    let rec = records.iter().find(|r| r["task_id"] == task.as_str()).expect("the call's record");
    Ok(rec["user_id"].clone())
}

#[tokio::test]
async fn a_trusted_header_names_the_user_for_its_applications_keys_and_the_body_is_then_ignored() {
    let (_fake, _nats, gw, bus) = gateway().await;
    // The proxy's header wins; the body's `user` is the caller's and is ignored.
    assert_eq!(user_of(&gw, PORTAL_KEY, &[("x-user-id", "alice")], "mallory").await, Ok(json!("alice")));
    // Without the header: no user, still not the body's.
    assert_eq!(user_of(&gw, PORTAL_KEY, &[], "mallory").await, Ok(Value::Null));
    // Another application's keys: the header means nothing, the body names the user.
    assert_eq!(user_of(&gw, DEMO_KEY, &[("x-user-id", "bob")], "carol").await, Ok(json!("carol")));
    // A header user is bounded like a declared one.
    let long = "u".repeat(129);
    for bad in [long.as_str(), "tab\there", "edgeway:summary"] {
        let e = user_of(&gw, PORTAL_KEY, &[("x-user-id", bad)], "mallory").await.unwrap_err();
        assert_eq!(error_code(&e), "INVALID_REQUEST", "{bad:?}: {e}");
        assert!(e["error"]["message"].as_str().unwrap().contains("x-user-id"), "{e}");
    }
    // NATS headers too.
    let mut h = bearer(PORTAL_KEY);
    h.insert("X-User-Id", "nats-user");
    let mut body = chat_body(false);
    body["user"] = json!("mallory");
    let (kind, done) = nats_call(&bus, h, &body).await;
    assert_eq!(kind, "done", "{done}");
    let task = done["result"]["task_id"].as_str().unwrap();
    let records = audit(&gw).await;
    assert_eq!(records.iter().find(|r| r["task_id"] == task).unwrap()["user_id"], "nats-user");
    // The refused calls' records hold no user id they were refused for.
    assert!(records.iter().all(|r| r["user_id"] != long.as_str() && r["user_id"] != "tab\there"));
    gw.stop().await;
}

/// `POST /v1/sessions` with `headers` and `body`: the session's `user_id`.
async fn session_user(gw: &TestGateway, key: &str, headers: &[(&str, &str)], body: Value) -> Value {
    let mut rb = client().post(format!("{}/v1/sessions", gw.base_url)).bearer_auth(key).json(&body);
    for (k, v) in headers {
        rb = rb.header(*k, *v);
    }
    let r = rb.send().await.unwrap();
    assert_eq!(r.status(), 201);
    r.json::<Value>().await.unwrap()["user_id"].clone()
}

/// A session is owned as a call is: for an application with a
/// `user_header`, by the header's user only; the body's `user_id` is the
/// caller's and is ignored, and without the header the session has no
/// user (as such a call has none). Failed before: the body's `user_id`
/// owned a session created without the header.
#[tokio::test]
async fn a_session_of_an_application_with_a_user_header_belongs_to_the_headers_user_only() {
    let (_fake, _nats, gw, _bus) = gateway().await;
    let mallory = json!({"user_id": "mallory"});
    assert_eq!(session_user(&gw, PORTAL_KEY, &[("x-user-id", "alice")], mallory.clone()).await, json!("alice"));
    assert_eq!(session_user(&gw, PORTAL_KEY, &[], mallory.clone()).await, Value::Null);
    // Another application's keys: the body (or `x-user-id`) names the user.
    assert_eq!(session_user(&gw, DEMO_KEY, &[], json!({"user_id": "carol"})).await, json!("carol"));
    assert_eq!(session_user(&gw, DEMO_KEY, &[("x-user-id", "dave")], json!({})).await, json!("dave"));
    gw.stop().await;
}

/// Unix ms as a TOML date-time in UTC (days to a civil date: H. Hinnant).
fn utc(ms: i64) -> String {
    let (days, secs) = (ms.div_euclid(86_400_000), ms.rem_euclid(86_400_000) / 1000);
    let z = days + 719_468;
    let (era, doe) = (z.div_euclid(146_097), z.rem_euclid(146_097));
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let (d, m) = (doy - (153 * mp + 2) / 5 + 1, if mp < 10 { mp + 3 } else { mp - 9 });
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", secs / 3600, secs % 3600 / 60, secs % 60)
}

#[tokio::test]
async fn a_key_with_an_expiry_is_refused_from_then_on_and_says_so() {
    let fake = FakeEngine::start_with(Knobs::default()).await;
    // Far enough ahead for the gateway to start on a loaded machine.
    let soon = edgeway::task::now_ms() + 8000;
    let extra = format!(
        r#"
[applications.temp]
tenant = "demo"
api_keys = [
  {{ sha256 = "{}", expires = 2020-01-01T00:00:00Z }},
  {{ sha256 = "{}", expires = 2099-01-01T00:00:00Z }},
  {{ sha256 = "{}", expires = {} }},
]
api_key_sha256 = ["{}"]
"#,
        digest("sk-expired"),
        digest("sk-valid"),
        digest("sk-soon"),
        // Whole seconds: a TOML date-time's fraction is read to the ms, but
        // the message shows seconds.
        utc((soon / 1000 + 1) * 1000),
        digest("sk-plain"),
    );
    let gw = TestGateway::with_engine(&fake.url(), "openai", &extra).await;
    gw.wait_ready().await;
    let r = post_chat(&gw, "sk-expired", &chat_body(false)).await;
    assert_eq!(r.status(), 401);
    let v: Value = r.json().await.unwrap();
    assert_eq!(error_code(&v), "AUTH_FAILED");
    assert_eq!(v["error"]["message"], "this API key expired at 2020-01-01T00:00:00Z");
    for key in ["sk-valid", "sk-plain", "sk-soon"] {
        assert_eq!(post_chat(&gw, key, &chat_body(false)).await.status(), 200, "{key}");
    }
    // Operators see it coming: the gauge holds the next key to lapse (the
    // one that lapsed in 2020 is past), and nothing for an application
    // whose keys carry no expiry.
    let text = client().get(format!("{}/metrics", gw.base_url)).bearer_auth(OPS_KEY).send().await.unwrap();
    let text = text.text().await.unwrap();
    let series: Vec<&str> =
        text.lines().filter(|l| l.starts_with("edgeway_api_key_expiry_timestamp_seconds{")).collect();
    assert_eq!(series.len(), 1, "{series:?}");
    assert!(series[0].contains("application=\"temp\"") && series[0].contains("tenant=\"demo\""), "{series:?}");
    let at: f64 = series[0].rsplit(' ').next().unwrap().parse().unwrap();
    assert_eq!(at, (soon / 1000 + 1) as f64, "{series:?}");
    // Checked on every request, not only at load: once its time has come,
    // the same key is refused. (The clock is what is waited for.)
    let wait = (soon / 1000 + 1) * 1000 - edgeway::task::now_ms() + 50;
    tokio::time::sleep(Duration::from_millis(wait.max(0) as u64)).await;
    let r = post_chat(&gw, "sk-soon", &chat_body(false)).await;
    assert_eq!(r.status(), 401);
    let v: Value = r.json().await.unwrap();
    assert!(v["error"]["message"].as_str().unwrap().starts_with("this API key expired at "), "{v}");
    assert_eq!(post_chat(&gw, "sk-valid", &chat_body(false)).await.status(), 200);
    gw.stop().await;
}

#[test]
fn authorisation_keys_are_validated_with_their_paths() {
    let base = |app: &str| {
        format!(
            "[engines.e]\ntype = \"openai\"\nbase_url = \"http://127.0.0.1:1\"\nmodel = \"m\"\n\
             [models.general-chat]\ninstances = [\"e\"]\n[applications.a]\ntenant = \"t\"\n{app}"
        )
    };
    let err = |app: &str| {
        edgeway::config::Config::from_toml_str(&base(app), std::iter::empty(), std::path::Path::new("."))
            .map(|_| ())
            .unwrap_err()
            .to_string()
    };
    let e = err("allowed_models = [\"nope\"]\n");
    assert!(e.contains("applications.a.allowed_models[0]") && e.contains("nope"), "{e}");
    let e = err("allowed_priorities = [\"P0\"]\nmax_priority = \"P1\"\n");
    assert!(e.contains("applications.a.allowed_priorities[0]"), "{e}");
    let e = err("allowed_priorities = [\"P3\"]\ndefault_priority = \"P2\"\n");
    assert!(e.contains("applications.a.default_priority") && e.contains("allowed_priorities"), "{e}");
    let e = err("allowed_priorities = [\"P9\"]\n");
    assert!(e.contains("applications.a.allowed_priorities[0]"), "{e}");
    let e = err("allowed_ingresses = [\"smtp\"]\n");
    assert!(e.contains("applications.a.allowed_ingresses[0]") && e.contains("smtp"), "{e}");
    let e = err("user_header = \"authorization\"\n");
    assert!(e.contains("applications.a.user_header"), "{e}");
    let e = err("user_header = \"x user\"\n");
    assert!(e.contains("applications.a.user_header"), "{e}");
    let e = err("api_keys = [{ sha256 = \"zz\", expires = 2027-01-01T00:00:00Z }]\n");
    assert!(e.contains("applications.a.api_keys[0].sha256"), "{e}");
    let e = err(&format!("api_keys = [{{ sha256 = \"{}\", expires = \"soon\" }}]\n", digest("k")));
    assert!(e.contains("applications.a.api_keys[0].expires"), "{e}");
    let e = err(&format!("api_keys = [{{ sha256 = \"{}\", expires = 2027-01-01T00:00:00Z, x = 1 }}]\n", digest("k")));
    assert!(e.contains("applications.a.api_keys[0].x"), "{e}");
    let e = err(&format!(
        "api_key_sha256 = [\"{0}\"]\napi_keys = [{{ sha256 = \"{0}\", expires = 2027-01-01T00:00:00Z }}]\n",
        digest("k")
    ));
    assert!(e.contains("applications.a.api_keys[0]") && e.contains("also used"), "{e}");
}
