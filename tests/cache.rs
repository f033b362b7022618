//! The response cache end to end (issue 14): a whole gateway on real
//! sockets against a counting fake engine. A repeat of a deterministic call
//! is answered without the engine, streamed like a live answer, recorded
//! and audited as a hit; other tenants and applications, nondeterministic
//! calls, tools, secret data and opted-out calls always reach the engine;
//! entries expire and are evicted by bytes; the routing chain's cached step
//! answers when the engine fails. Over HTTP (JSON and SSE) and MQTT.

mod common;
mod mqtt_support;

use std::time::Duration;

use common::*;
use serde_json::{json, Value};

/// A tenant of its own, and an application of tenant `demo` that opts out.
const ACME_KEY: &str = "sk-edgeway-acme";
const QUIET_KEY: &str = "sk-edgeway-quiet";

/// `[cache]` on, with `cache` keys added, and the extra applications.
fn cache_toml(cache: &str) -> String {
    let hash = |k: &str| hex::encode(edgeway::config::hash_api_key(k));
    format!(
        r#"
[cache]
enabled = true
{cache}
[applications.acme]
tenant = "acme"
api_key_sha256 = ["{acme}"]
max_priority = "P1"
default_priority = "P2"
[applications.quiet]
tenant = "demo"
api_key_sha256 = ["{quiet}"]
max_priority = "P1"
default_priority = "P2"
cache = false
"#,
        acme = hash(ACME_KEY),
        quiet = hash(QUIET_KEY)
    )
}

/// A gateway around `fake` (which takes `tools`); `model` goes into
/// `[models.general-chat]`.
async fn gateway(fake: &FakeEngine, model: &str, cache: &str) -> TestGateway {
    let extra = format!("{model}\n{}", cache_toml(cache));
    let tools = |t: String| t.replace("health_interval_ms = 100", "health_interval_ms = 100\ntools = true");
    let gw = TestGateway::with_engine_edit(&fake.url(), "openai", &extra, tools).await;
    gw.wait_ready().await;
    gw
}

/// A deterministic call (temperature 0).
fn det(stream: bool, text: &str) -> Value {
    json!({
        "model": "general-chat",
        "messages": [{"role": "user", "content": text}],
        "stream": stream,
        "temperature": 0,
    })
}

async fn call(gw: &TestGateway, key: &str, b: &Value) -> Value {
    let resp = post_chat(gw, key, b).await;
    let status = resp.status().as_u16();
    let text = resp.text().await.unwrap();
    assert_eq!(status, 200, "{text}");
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"))
}

fn content(v: &Value) -> &str {
    v["choices"][0]["message"]["content"].as_str().unwrap_or_else(|| panic!("no content: {v}"))
}

fn hit(v: &Value) -> bool {
    v["edge"]["cache_hit"] == true
}

fn hop_steps(v: &Value) -> Vec<String> {
    let hops = v["edge"]["route"]["hops"].as_array().unwrap_or_else(|| panic!("no hops: {v}"));
    hops.iter().map(|h| h["step"].as_str().unwrap().to_string()).collect()
}

async fn metrics_text(gw: &TestGateway) -> String {
    client().get(format!("{}/metrics", gw.base_url)).bearer_auth(OPS_KEY).send().await.unwrap().text().await.unwrap()
}

/// The sample of `name` whose labels include all of `labels` (summed).
fn metric(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} ")))
        .filter(|l| labels.iter().all(|(k, v)| l.contains(&format!("{k}=\"{v}\""))))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
        .sum()
}

#[tokio::test]
async fn a_repeated_deterministic_call_is_answered_once_per_tenant_and_application() {
    let fake = FakeEngine::start().await;
    let gw = gateway(&fake, "", "").await;
    let b = det(false, "What is 2 + 2?");
    let first = call(&gw, DEMO_KEY, &b).await;
    assert!(!hit(&first), "{first}");
    assert_eq!(fake.requests(), 1);
    let second = call(&gw, DEMO_KEY, &b).await;
    assert_eq!(fake.requests(), 1, "the repeat did not reach the engine");
    assert!(hit(&second), "{second}");
    assert_eq!(content(&second), content(&first));
    assert!(second["edge"]["cache_age_ms"].is_u64(), "{second}");
    assert_eq!(second["edge"].get("cache_stale"), None, "fresh: {second}");
    assert_eq!(second["edge"]["route"]["degraded"], false, "a fresh hit is not degraded: {second}");
    assert_eq!(hop_steps(&second), ["cached"], "{second}");
    // Usage of the cached answer.
    assert_eq!(second["usage"]["completion_tokens"], first["usage"]["completion_tokens"]);
    assert_eq!(second["edge"]["usage"]["output_tokens"], 5, "{second}");
    // A task of its own, with its life cycle and audit record.
    let task = second["edge"]["task_id"].as_str().unwrap().to_string();
    assert_ne!(task, first["edge"]["task_id"].as_str().unwrap());
    assert_eq!(
        stored_states(&gw, &task).await,
        ["RECEIVED", "VALIDATING", "QUEUED", "DISPATCHING", "RUNNING", "STREAMING", "SUCCEEDED"]
    );
    gw.store().flush().await;
    let page = get_json(&gw, OPS_KEY, "/admin/audit").await;
    let records = page["records"].as_array().unwrap_or_else(|| panic!("{page}"));
    let rec = |id: &str| records.iter().find(|r| r["task_id"] == id).unwrap_or_else(|| panic!("{id}: {page}")).clone();
    assert_eq!(rec(&task)["cache_hit"], true);
    assert_eq!(rec(&task)["output_tokens"], 5);
    assert_eq!(rec(first["edge"]["task_id"].as_str().unwrap())["cache_hit"], false);

    // Another application of the same tenant, and another tenant: misses.
    let ops = call(&gw, OPS_KEY, &b).await;
    assert!(!hit(&ops), "{ops}");
    assert_eq!(fake.requests(), 2, "another application reaches the engine");
    let acme = call(&gw, ACME_KEY, &b).await;
    assert!(!hit(&acme), "{acme}");
    assert_eq!(fake.requests(), 3, "another tenant reaches the engine");
    // ... each with an entry of its own from now on.
    assert!(hit(&call(&gw, OPS_KEY, &b).await));
    assert!(hit(&call(&gw, ACME_KEY, &b).await));
    assert_eq!(fake.requests(), 3);
    // Another question is another key.
    assert!(!hit(&call(&gw, DEMO_KEY, &det(false, "What is 3 + 3?")).await));
    assert_eq!(fake.requests(), 4);

    let m = metrics_text(&gw).await;
    assert_eq!(metric(&m, "edgeway_cache_hits_total", &[("kind", "fresh")]), 3.0, "{m}");
    assert_eq!(metric(&m, "edgeway_cache_misses_total", &[("reason", "absent")]), 4.0, "{m}");
    assert_eq!(metric(&m, "edgeway_cache_entries", &[]), 4.0, "{m}");
    assert!(metric(&m, "edgeway_cache_bytes", &[]) > 0.0, "{m}");
    gw.stop().await;
}

#[tokio::test]
async fn calls_that_may_not_be_cached_always_reach_the_engine() {
    let fake = FakeEngine::start().await;
    let gw = gateway(&fake, "", "").await;
    let mut warm = det(false, "Tell me a story");
    warm["temperature"] = json!(0.7);
    let mut tools = det(false, "What is the weather?");
    tools["tools"] =
        json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]);
    let mut secret = det(false, "The door code is 1234");
    secret["routing"] = json!({"data_class": "secret"});
    let mut sensitive = det(false, "My diagnosis");
    sensitive["routing"] = json!({"data_class": "sensitive"});
    let mut opted_out = det(false, "Do not keep this");
    opted_out["edge"] = json!({"cache": false});
    let cases: [(&str, &str, &Value); 6] = [
        ("nondeterministic", DEMO_KEY, &warm),
        ("tools", DEMO_KEY, &tools),
        ("data_class", DEMO_KEY, &secret),
        ("data_class", DEMO_KEY, &sensitive),
        ("opted_out", DEMO_KEY, &opted_out),
        ("opted_out", QUIET_KEY, &det(false, "An application that opts out")),
    ];
    let mut expected = 0;
    for (why, key, b) in cases {
        for _ in 0..2 {
            let v = call(&gw, key, b).await;
            expected += 1;
            assert!(!hit(&v), "{why}: {v}");
            assert_eq!(fake.requests(), expected, "{why}: every call reaches the engine");
        }
    }
    let m = metrics_text(&gw).await;
    for (why, n) in [("nondeterministic", 2.0), ("tools", 2.0), ("data_class", 4.0), ("opted_out", 4.0)] {
        assert_eq!(metric(&m, "edgeway_cache_bypassed_total", &[("reason", why)]), n, "{why}: {m}");
    }
    assert_eq!(metric(&m, "edgeway_cache_entries", &[]), 0.0, "nothing was stored: {m}");
    // A fixed seed makes a warm call deterministic.
    warm["seed"] = json!(42);
    call(&gw, DEMO_KEY, &warm).await;
    assert!(hit(&call(&gw, DEMO_KEY, &warm).await));
    assert_eq!(fake.requests(), expected + 1);
    // `edge.cache` must be a boolean.
    let mut bad = det(false, "x");
    bad["edge"] = json!({"cache": "no"});
    let resp = post_chat(&gw, DEMO_KEY, &bad).await;
    assert_eq!(resp.status().as_u16(), 400);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(error_code(&v), "INVALID_REQUEST", "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("edge.cache"), "{v}");
    gw.stop().await;
}

#[tokio::test]
async fn an_entry_expires_after_its_ttl() {
    let fake = FakeEngine::start().await;
    let gw = gateway(&fake, "", "ttl_s = 1").await;
    let b = det(false, "What time is it?");
    call(&gw, DEMO_KEY, &b).await;
    assert!(hit(&call(&gw, DEMO_KEY, &b).await));
    assert_eq!(fake.requests(), 1);
    // The ttl is the behaviour under test: time has to pass.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let v = call(&gw, DEMO_KEY, &b).await;
    assert!(!hit(&v), "past its ttl: {v}");
    assert_eq!(fake.requests(), 2);
    // The new answer is cached again.
    assert!(hit(&call(&gw, DEMO_KEY, &b).await));
    let m = metrics_text(&gw).await;
    assert_eq!(metric(&m, "edgeway_cache_misses_total", &[("reason", "expired")]), 1.0, "{m}");
    gw.stop().await;
}

#[tokio::test]
async fn the_byte_budget_evicts_the_least_recently_used_answer() {
    // 50 tokens of "tok ": 200 bytes of text, two answers fit in 1 KiB,
    // three do not.
    let fake = FakeEngine::start_with(Knobs { tokens: 50, ..Knobs::default() }).await;
    let gw = gateway(&fake, "", "max_bytes = 1024").await;
    let (a, b, c) = (det(false, "a"), det(false, "b"), det(false, "c"));
    call(&gw, DEMO_KEY, &a).await;
    call(&gw, DEMO_KEY, &b).await;
    assert!(hit(&call(&gw, DEMO_KEY, &a).await), "a is used again: b is now the least recently used");
    assert_eq!(fake.requests(), 2);
    call(&gw, DEMO_KEY, &c).await;
    assert_eq!(fake.requests(), 3);
    assert!(hit(&call(&gw, DEMO_KEY, &a).await), "a stayed");
    assert!(hit(&call(&gw, DEMO_KEY, &c).await), "c is in");
    assert!(!hit(&call(&gw, DEMO_KEY, &b).await), "b was evicted");
    assert_eq!(fake.requests(), 4);
    let m = metrics_text(&gw).await;
    assert!(metric(&m, "edgeway_cache_evictions_total", &[("reason", "bytes")]) >= 1.0, "{m}");
    assert!(metric(&m, "edgeway_cache_bytes", &[]) <= 1024.0, "{m}");
    gw.stop().await;
}

/// Waits (polling the scheduler, up to 10 s) until the instance is in
/// dispatch (`up`) or out of it.
async fn until_up(gw: &TestGateway, up: bool) {
    for _ in 0..500 {
        if gw.scheduler().snapshot().await.unwrap().instances.iter().all(|i| i.up == up) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("the instance never became up = {up}");
}

/// Checks an answer of the routing chain's cached step.
fn assert_stale(v: &Value, live: &Value) {
    assert_eq!(content(v), content(live), "{v}");
    assert!(hit(v), "{v}");
    assert_eq!(v["edge"]["cache_stale"], true, "{v}");
    assert!(v["edge"]["cache_age_ms"].as_u64().unwrap() >= 1000, "{v}");
    assert_eq!(v["edge"]["route"]["degraded"], true, "{v}");
    assert_eq!(v["edge"]["degraded"], true, "{v}");
    assert!(hop_steps(v).contains(&"cached".to_string()), "{v}");
}

#[tokio::test]
async fn the_cached_step_answers_past_the_ttl_when_the_engine_fails() {
    let fake = FakeEngine::start().await;
    let gw = gateway(&fake, "", "ttl_s = 1\nstale_ttl_s = 3600").await;
    let b = det(false, "Where is the pump manual?");
    let live = call(&gw, DEMO_KEY, &b).await;
    tokio::time::sleep(Duration::from_millis(1100)).await;
    // Every attempt fails: the stale answer instead of the error.
    fake.set(|k| k.fail_status = Some(500));
    let v = call(&gw, DEMO_KEY, &b).await;
    assert_stale(&v, &live);
    assert!(hop_steps(&v).contains(&"same-model".to_string()), "the failed attempts are in the route: {v}");
    assert!(fake.requests() >= 2, "the engine was tried first");
    // A call the cache has never seen gets the error.
    let resp = post_chat(&gw, DEMO_KEY, &det(false, "Something new")).await;
    assert!(resp.status().is_server_error(), "{}", resp.status());
    // The engine out of dispatch: answered at admission, no engine call.
    fake.set(|k| k.healthy = false);
    until_up(&gw, false).await;
    let before = fake.requests();
    let v = call(&gw, DEMO_KEY, &b).await;
    assert_stale(&v, &live);
    assert_eq!(fake.requests(), before);
    let m = metrics_text(&gw).await;
    assert_eq!(metric(&m, "edgeway_cache_hits_total", &[("kind", "stale")]), 2.0, "{m}");
    gw.stop().await;
}

#[tokio::test]
async fn the_cached_step_comes_before_the_canned_answer() {
    let fake = FakeEngine::start().await;
    let gw = gateway(&fake, "canned_answer = \"Busy; call the desk.\"", "ttl_s = 1\nstale_ttl_s = 3600").await;
    let b = det(false, "Opening hours?");
    let live = call(&gw, DEMO_KEY, &b).await;
    tokio::time::sleep(Duration::from_millis(1100)).await;
    fake.set(|k| k.healthy = false);
    until_up(&gw, false).await;
    let v = call(&gw, DEMO_KEY, &b).await;
    assert_stale(&v, &live);
    assert!(!hop_steps(&v).contains(&"canned".to_string()), "{v}");
    // Not in the cache: the canned answer, as before.
    let v = call(&gw, DEMO_KEY, &det(false, "Something new")).await;
    assert_eq!(content(&v), "Busy; call the desk.");
    assert!(!hit(&v));
    assert_eq!(fake.requests(), 1, "only the first call reached the engine");
    // A canned answer is never cached: the engine back, it answers.
    fake.set(|k| k.healthy = true);
    until_up(&gw, true).await;
    let v = call(&gw, DEMO_KEY, &det(false, "Something new")).await;
    assert!(!hit(&v), "{v}");
    assert_eq!(content(&v), content(&live));
    assert_eq!(fake.requests(), 2);
    gw.stop().await;
}

#[tokio::test]
async fn a_hit_streams_over_sse_like_a_live_answer() {
    let fake = FakeEngine::start().await;
    let gw = gateway(&fake, "", "").await;
    let b = det(true, "Stream me");
    let (live, done) = read_sse(post_chat(&gw, DEMO_KEY, &b).await).await;
    assert!(done);
    let (cached, done) = read_sse(post_chat(&gw, DEMO_KEY, &b).await).await;
    assert!(done, "{cached:?}");
    assert_eq!(fake.requests(), 1);
    let deltas = |events: &[Value]| -> Vec<String> {
        events.iter().filter_map(|e| e["choices"][0]["delta"]["content"].as_str().map(String::from)).collect()
    };
    assert_eq!(deltas(&cached), deltas(&live), "the same text in the same pieces");
    assert!(deltas(&cached).len() > 1, "streamed in pieces: {cached:?}");
    let edge = |events: &[Value]| events.iter().rev().find_map(|e| e.get("edge").cloned()).expect("edge");
    assert_eq!(edge(&cached)["cache_hit"], true, "{cached:?}");
    assert_eq!(edge(&live).get("cache_hit"), None, "{live:?}");
    // A streamed and a non-streamed call are one key: `stream` does not
    // change the answer.
    let v = call(&gw, DEMO_KEY, &det(false, "Stream me")).await;
    assert!(hit(&v), "{v}");
    assert_eq!(content(&v), deltas(&live).concat());
    gw.stop().await;
}

#[tokio::test]
async fn a_hit_streams_over_mqtt_like_a_live_answer() {
    use mqtt_support::{check_stream, device, start, D1, V};
    let (fake, gw, addr) = start(Knobs::default(), "coalesce_ms = 0\n[cache]\nenabled = true").await;
    let mut d = device(addr, V::V5, D1).await;
    d.subscribe(&d.topic("res/#")).await;
    let mut streams = Vec::new();
    for rid in ["m1", "m2"] {
        let mut req = mqtt_support::request(rid);
        req["temperature"] = json!(0);
        d.publish(&d.topic("req"), req.to_string()).await;
        streams.push(d.stream(&d.topic(&format!("res/{rid}"))).await);
    }
    assert_eq!(fake.requests(), 1, "the second device request was answered from the cache");
    let (live, cached) = (&streams[0], &streams[1]);
    assert_eq!(check_stream(cached), check_stream(live));
    let kinds = |s: &[Value]| s.iter().map(|e| e["type"].as_str().unwrap().to_string()).collect::<Vec<_>>();
    assert_eq!(kinds(cached), kinds(live), "the same events");
    let done = cached.last().unwrap();
    assert_eq!(done["result"]["cache_hit"], true, "{done}");
    assert_eq!(done["result"]["status"], "SUCCEEDED");
    assert_eq!(done["result"]["request_id"], "m2");
    assert_eq!(done["result"]["usage"]["output_tokens"], 5);
    assert_eq!(live.last().unwrap()["result"].get("cache_hit"), None);
    gw.stop().await;
}
