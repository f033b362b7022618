//! The status view: `GET /admin/status`, its stream, the `/status` page,
//! the operator's cancel and `edgeway status`, against a gateway with the
//! fake engine.

mod common;
mod mqtt_support;

use std::time::Duration;

use common::*;
use futures::StreamExt;
use serde_json::{json, Value};

async fn setup(knobs: Knobs) -> (FakeEngine, TestGateway) {
    let fake = FakeEngine::start_with(knobs).await;
    let gw = TestGateway::with_engine(&fake.url(), "openai", "").await;
    gw.wait_ready().await;
    (fake, gw)
}

async fn status(gw: &TestGateway) -> Value {
    let r = client().get(format!("{}/admin/status", gw.base_url)).bearer_auth(OPS_KEY).send().await.unwrap();
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

/// Submits a task (`POST /v1/tasks` as `demo`) and returns its id.
async fn submit(gw: &TestGateway) -> String {
    let r = client().post(format!("{}/v1/tasks", gw.base_url)).bearer_auth(DEMO_KEY).json(&chat_body(true));
    let v: Value = r.send().await.unwrap().json().await.unwrap();
    v["task_id"].as_str().expect("task id").to_string()
}

/// Snapshots until `pred` holds (30 s at most): the status is polled, as
/// its users do.
async fn status_until(gw: &TestGateway, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
    let wait = async {
        loop {
            let s = status(gw).await;
            if pred(&s) {
                return s;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(30), wait).await.unwrap_or_else(|_| panic!("never saw: {what}"))
}

fn task<'a>(s: &'a Value, id: &str) -> Option<&'a Value> {
    s["tasks"].as_array().unwrap().iter().find(|t| t["task_id"] == id)
}

#[tokio::test]
async fn a_running_task_appears_with_its_age_tokens_and_client_kind_and_an_operator_cancel_ends_it() {
    let (_fake, gw) = setup(Knobs::slow(200, 50)).await;
    let id = submit(&gw).await;
    let s =
        status_until(&gw, "the task with tokens", |s| task(s, &id).is_some_and(|t| t["tokens"].as_u64() >= Some(2)))
            .await;
    let t = task(&s, &id).unwrap();
    assert_eq!(t["ingress"], "http", "{t}");
    assert_eq!(t["application"], "demo");
    assert_eq!(t["model"], "general-chat");
    assert_eq!(t["priority"], "P2");
    assert!(matches!(t["state"].as_str(), Some("RUNNING") | Some("STREAMING")), "{t}");
    assert!(t["age_ms"].as_u64().unwrap() >= 50, "{t}");
    assert_eq!(s["tasks_total"], 1);
    // The engine and queue of the model are there, healthy and with it.
    let e = &s["engines"][0];
    assert_eq!((e["name"].as_str(), e["up"].as_bool(), e["running"].as_u64()), (Some("fake"), Some(true), Some(1)));
    assert_eq!(e["breaker"], "CLOSED");
    assert_eq!(s["queues"][0]["model"], "general-chat");
    assert_eq!(s["devices"], Value::Null, "MQTT is off");
    assert_eq!(s["degradation_level"], 0);
    // Its age grows.
    let later = status_until(&gw, "an older task", |l| {
        task(l, &id).is_some_and(|l| l["age_ms"].as_u64() > t["age_ms"].as_u64())
    })
    .await;
    assert!(task(&later, &id).unwrap()["tokens"].as_u64() >= t["tokens"].as_u64());

    // The page's cancel: an admin application's key only.
    let url = format!("{}/admin/tasks/{id}", gw.base_url);
    let r = client().delete(&url).bearer_auth(DEMO_KEY).send().await.unwrap();
    assert_eq!(r.status(), 403, "not for a plain application");
    let r = client().delete(&url).bearer_auth(OPS_KEY).send().await.unwrap();
    assert_eq!(r.status(), 202);
    gw.wait_for_state(&id, TaskState::Cancelled).await;
    let s = status_until(&gw, "the cancel among the failures", |s| s["failures"][0]["task_id"] == id.as_str()).await;
    assert!(task(&s, &id).is_none(), "an ended task is not live");
    let f = &s["failures"][0];
    assert_eq!((f["code"].as_str(), f["state"].as_str()), (Some("REQUEST_CANCELLED"), Some("CANCELLED")), "{f}");
    assert_eq!(f["application"], "demo");
    assert!(f.get("tenant").is_none(), "not shown");
    let r = client().delete(&url).bearer_auth(OPS_KEY).send().await.unwrap();
    assert_eq!(r.status(), 409, "already ended");
}

#[tokio::test]
async fn a_failure_appears_with_its_code_and_the_traffic_counts_it() {
    let (fake, gw) = setup(Knobs { fail_status: Some(500), ..Knobs::default() }).await;
    let r = post_chat(&gw, DEMO_KEY, &chat_body(false)).await;
    let task_id = r.headers()["x-task-id"].to_str().unwrap().to_string();
    let body: Value = r.json().await.unwrap();
    let code = error_code(&body).to_string();
    assert_ne!(code, "<none>", "{body}");
    let s = status_until(&gw, "the failure", |s| s["failures"][0]["task_id"] == task_id.as_str()).await;
    let f = &s["failures"][0];
    assert_eq!(f["code"], code.as_str(), "{f}");
    assert_eq!(f["state"], "FAILED");
    assert_eq!(f["logical_model"], "general-chat");
    assert_eq!(f["ingress"], "http");
    let now = s["traffic"].as_array().unwrap().last().unwrap().clone();
    assert!(now["failed"].as_u64() >= Some(1), "{now}");
    // A refusal at admission is a failure too.
    fake.set(|k| k.fail_status = None);
    let r =
        post_chat(&gw, DEMO_KEY, &json!({"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}))
            .await;
    let body: Value = r.json().await.unwrap();
    let refused = error_code(&body).to_string();
    let s = status_until(&gw, "the refusal", |s| s["failures"][0]["logical_model"] == "no-such-model").await;
    assert_eq!(s["failures"][0]["code"], refused.as_str());
    assert_eq!(s["failures"][0]["state"], "REJECTED");
    // A success ends in the traffic, and its first token counts.
    let r = post_chat(&gw, DEMO_KEY, &chat_body(false)).await;
    assert_eq!(r.status(), 200);
    let s = status_until(&gw, "a first token", |s| {
        s["traffic"].as_array().unwrap().last().unwrap()["ttft_count"].as_u64() >= Some(1)
    })
    .await;
    assert!(s["traffic"].as_array().unwrap().last().unwrap()["ttft_mean_ms"].as_f64().is_some());
}

#[tokio::test]
async fn the_status_and_its_stream_need_an_admin_key_and_the_page_holds_no_data() {
    let (_fake, gw) = setup(Knobs::default()).await;
    for path in ["/admin/status", "/admin/status/stream"] {
        let url = format!("{}{path}", gw.base_url);
        let r = client().get(&url).send().await.unwrap();
        assert_eq!(r.status(), 401, "{path} without a key");
        let r = client().get(&url).bearer_auth(DEMO_KEY).send().await.unwrap();
        assert_eq!(r.status(), 403, "{path} for a plain application");
        let v: Value = r.json().await.unwrap();
        assert_eq!(error_code(&v), "PERMISSION_DENIED");
    }
    let r = client().get(format!("{}/status", gw.base_url)).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.headers()["content-type"].to_str().unwrap().starts_with("text/html"));
    let csp = r.headers()["content-security-policy"].to_str().unwrap().to_string();
    assert!(csp.contains("default-src 'none'") && csp.contains("connect-src 'self'"), "{csp}");
    let page = r.text().await.unwrap();
    // Scripts: only the page's own, by its digest (review 15 L7), never
    // any inline script.
    let script_src = csp.split(';').map(str::trim).find(|d| d.starts_with("script-src")).expect("script-src");
    assert!(!script_src.contains("unsafe-inline"), "{csp}");
    let script = page.split("<script>").nth(1).and_then(|s| s.split("</script>").next()).expect("inline script");
    let digest = {
        use base64::Engine as _;
        use sha2::Digest as _;
        base64::engine::general_purpose::STANDARD.encode(sha2::Sha256::digest(script.as_bytes()))
    };
    assert_eq!(script_src, format!("script-src 'sha256-{digest}'"), "{csp}");
    assert_eq!(page.matches("<script").count(), 1, "one inline script, the one the policy names");
    assert!(page.contains("admin/status/stream") && page.contains("sessionStorage"));
    // Self-contained: nothing loaded from elsewhere.
    for external in ["src=\"http", "href=\"http", "@import", "url(http", "<link"] {
        assert!(!page.contains(external), "the page loads {external}");
    }
}

#[tokio::test]
async fn the_stream_sends_a_snapshot_at_once_and_then_every_second() {
    let (_fake, gw) = setup(Knobs::default()).await;
    let r = client().get(format!("{}/admin/status/stream", gw.base_url)).bearer_auth(OPS_KEY).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "text/event-stream");
    let mut body = r.bytes_stream();
    let mut buf = String::new();
    let mut snapshots = Vec::new();
    let read = async {
        while snapshots.len() < 3 {
            buf.push_str(&String::from_utf8_lossy(&body.next().await.expect("stream goes on").unwrap()));
            while let Some(pos) = buf.find("\n\n") {
                let frame: String = buf.drain(..pos + 2).collect();
                assert!(frame.starts_with("event: status\n"), "{frame}");
                let data = frame.lines().find_map(|l| l.strip_prefix("data: ")).unwrap();
                snapshots.push(serde_json::from_str::<Value>(data).unwrap());
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(20), read).await.expect("three snapshots");
    let at: Vec<i64> = snapshots.iter().map(|s| s["at_ms"].as_i64().unwrap()).collect();
    assert!(at[1] - at[0] >= 500 && at[2] - at[1] >= 500, "about one a second: {at:?}");
    assert!(snapshots.iter().all(|s| s["engines"][0]["name"] == "fake"));
}

#[tokio::test]
async fn edgeway_status_prints_the_picture_as_text() {
    let (_fake, gw) = setup(Knobs::slow(200, 50)).await;
    let id = submit(&gw).await;
    status_until(&gw, "the task running", |s| task(s, &id).is_some_and(|t| t["tokens"].as_u64() >= Some(1))).await;
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_edgeway"))
        .args(["status", "--url", &gw.base_url])
        .env("EDGEWAY_ADMIN_KEY", OPS_KEY)
        .output()
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("TASKS (1 live)"), "{text}");
    let line = text.lines().find(|l| l.contains(&id)).unwrap_or_else(|| panic!("the task: {text}"));
    assert!(line.contains("http") && line.contains("demo") && line.contains("general-chat"), "{line}");
    assert!(text.lines().any(|l| l.trim_start().starts_with("fake") && l.contains("up")), "{text}");
    assert!(text.contains("QUEUES") && text.contains("RECENT FAILURES") && text.contains("ttft ms"), "{text}");
    // A plain application's key: refused, said on stderr, exit 1.
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_edgeway"))
        .args(["status", "--url", &gw.base_url, "--key", DEMO_KEY])
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("PERMISSION_DENIED"));
}

#[tokio::test]
async fn connected_devices_are_counted_and_listed() {
    let (_fake, gw, addr) = mqtt_support::start(Knobs::default(), "").await;
    let s = status(&gw).await;
    assert_eq!(s["devices"], json!({"connected": 0, "ids": []}), "MQTT on, nobody connected");
    let d = mqtt_support::device(addr, mqtt_support::V::V4, mqtt_support::D1).await;
    let s = status_until(&gw, "the device", |s| s["devices"]["connected"] == 1).await;
    assert_eq!(s["devices"]["ids"], json!([mqtt_support::D1.0]));
    drop(d);
    status_until(&gw, "the device gone", |s| s["devices"]["connected"] == 0).await;
}

/// Review 15 M1: the stream judges its credential again at each snapshot,
/// so an application that stops being an admin at a reload (or whose key is
/// removed) stops receiving the tenant's tasks and devices.
#[tokio::test]
async fn the_stream_ends_when_its_key_stops_being_an_admins_at_a_reload() {
    const KEY: &str = "sk-edgeway-second-admin";
    let fake = FakeEngine::start_with(Knobs::default()).await;
    let dir = edgeway::testing::TempDir::new("edgeway-status-reload");
    let file = dir.0.join("edgeway.toml");
    let second = |admin: bool| {
        let hash = hex::encode(edgeway::config::hash_api_key(KEY));
        format!("\n[applications.watch]\ntenant = \"demo\"\napi_key_sha256 = [\"{hash}\"]\nadmin = {admin}\n")
    };
    let write = |admin: bool| {
        std::fs::write(&file, edgeway::testing::config_toml(&fake.url(), "openai", &dir.0, &second(admin))).unwrap()
    };
    write(true);
    let gw = TestGateway::start(edgeway::config::Config::load(&file).expect("valid config")).await;
    gw.wait_ready().await;
    let r = client().get(format!("{}/admin/status/stream", gw.base_url)).bearer_auth(KEY).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let mut body = r.bytes_stream();
    body.next().await.expect("the first snapshot").unwrap();

    write(false);
    let reload = client().post(format!("{}/admin/reload", gw.base_url)).bearer_auth(OPS_KEY).send().await.unwrap();
    assert_eq!(reload.status(), 200, "{}", reload.text().await.unwrap());
    // At most one snapshot already on its way, then the end.
    let end = async {
        let mut after = 0;
        while let Some(chunk) = body.next().await {
            chunk.unwrap();
            after += 1;
        }
        after
    };
    let after = tokio::time::timeout(Duration::from_secs(10), end).await.expect("the stream ends after the reload");
    assert!(after <= 1, "{after} snapshots after the key lost admin");
    gw.stop().await;
}
