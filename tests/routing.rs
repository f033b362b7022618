//! Routing end to end (issue 9) against fake engines on real sockets: retry
//! before the first token, the partial error after it, circuit breakers,
//! the data policy with a counting fake "cloud", fallback to a smaller
//! model and to a canned answer, the global retry budget, preemption for
//! P0 work and the degradation level. Each test checks what the client
//! sees and what the record and the metrics say.

mod common;

use std::sync::atomic::Ordering::SeqCst;
use std::time::Duration;

use common::*;
use edgeway::store::Transition;
use serde_json::{json, Value};

/// An engine section for the test config (OpenAI protocol). `extra` adds
/// keys (location, max_data_class, max_concurrency, health interval).
fn engine(name: &str, url: &str, model: &str, extra: &str) -> String {
    format!("\n[engines.{name}]\ntype = \"openai\"\nbase_url = \"{url}\"\nmodel = \"{model}\"\n{extra}\n")
}

/// A gateway whose `general-chat` model is served by engine `fake` at
/// `url` (the first instance) plus whatever `extra` adds: bare keys go
/// into `[models.general-chat]`, later sections add engines, models and
/// settings. `edit` changes the generated text (e.g. the instance list).
async fn gateway(url: &str, extra: &str, edit: impl FnOnce(String) -> String) -> TestGateway {
    TestGateway::with_engine_edit(url, "openai", extra, edit).await
}

/// `general-chat` served by `fake` then `fake2`, in that order (the order
/// decides between two idle instances).
fn two_instances(t: String) -> String {
    t.replace("instances = [\"fake\"]", "instances = [\"fake\", \"fake2\"]")
}

fn body(stream: bool, routing: Value) -> Value {
    let mut b = chat_body(stream);
    b["routing"] = routing;
    b
}

async fn call(gw: &TestGateway, key: &str, b: &Value) -> (u16, Value) {
    let resp = post_chat(gw, key, b).await;
    let status = resp.status().as_u16();
    let text = resp.text().await.unwrap();
    (status, serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}")))
}

async fn metrics_text(gw: &TestGateway) -> String {
    client().get(format!("{}/metrics", gw.base_url)).bearer_auth(OPS_KEY).send().await.unwrap().text().await.unwrap()
}

/// The sum of the samples of metric `name` whose labels include all of
/// `labels` (0 when there is none).
fn metric(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} ")))
        .filter(|l| labels.iter().all(|(k, v)| l.contains(&format!("{k}=\"{v}\""))))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
        .sum()
}

async fn ready(gw: &TestGateway) -> Value {
    client().get(format!("{}/ready", gw.base_url)).bearer_auth(OPS_KEY).send().await.unwrap().json().await.unwrap()
}

/// The `/ready` entry of instance `name`.
fn instance<'a>(ready: &'a Value, name: &str) -> &'a Value {
    ready["instances"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["name"] == name)
        .unwrap_or_else(|| panic!("no instance {name} in {ready}"))
}

async fn transitions(gw: &TestGateway, task_id: &str) -> Vec<Transition> {
    gw.store().flush().await;
    gw.store().get(task_id).await.unwrap().expect("task stored").transitions
}

/// Polls `cond` every 20 ms for up to 10 s.
async fn until<F: std::future::Future<Output = bool>>(what: &str, mut cond: impl FnMut() -> F) {
    for _ in 0..500 {
        if cond().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("never saw: {what}");
}

async fn until_down(gw: &TestGateway, name: &str) {
    until(&format!("{name} out of dispatch"), || async {
        gw.scheduler().snapshot().await.unwrap().instances.iter().any(|i| i.name == name && !i.up)
    })
    .await;
}

fn hop_steps(route: &Value) -> Vec<String> {
    route["hops"].as_array().unwrap().iter().map(|h| h["step"].as_str().unwrap().to_string()).collect()
}

fn hop_instances(route: &Value) -> Vec<String> {
    route["hops"].as_array().unwrap().iter().filter_map(|h| h["instance"].as_str().map(String::from)).collect()
}

// 1. Retry before the first token.

/// Checks a call that failed on `fake` and was answered by `fake2`.
async fn assert_retried_on_second(gw: &TestGateway, status: u16, v: &Value, failed: &FakeEngine, good: &FakeEngine) {
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], "tok tok tok tok tok ");
    let route = &v["edge"]["route"];
    assert_eq!(route["attempts"], 2, "{route}");
    assert_eq!(route["instance"], "fake2", "{route}");
    let hops = hop_instances(route);
    assert!(hops.contains(&"fake".to_string()) && hops.contains(&"fake2".to_string()), "{route}");
    assert_eq!(good.requests(), 1);
    // The failed one had its single attempt (a stopped one counts nothing).
    assert!(failed.requests() <= 1);
    let task_id = v["edge"]["task_id"].as_str().unwrap();
    let ts = transitions(gw, task_id).await;
    let retry = ts
        .iter()
        .find(|t| t.state == TaskState::Queued && t.reason.starts_with("retry after attempt 1"))
        .unwrap_or_else(|| panic!("no retry transition in {ts:?}"));
    assert!(retry.reason.contains("fake"), "{}", retry.reason);
    assert_eq!(ts.last().unwrap().state, TaskState::Succeeded);
    let m = metrics_text(gw).await;
    assert_eq!(metric(&m, "edgeway_retries_total", &[("model", "general-chat")]), 1.0, "{m}");
}

#[tokio::test]
async fn a_500_before_the_first_token_is_retried_on_the_other_instance() {
    let bad = FakeEngine::start_with(Knobs { fail_status: Some(500), ..Knobs::default() }).await;
    let good = FakeEngine::start().await;
    let gw = gateway(&bad.url(), &engine("fake2", &good.url(), "fake-model", ""), two_instances).await;
    gw.wait_ready().await;
    let (status, v) = call(&gw, DEMO_KEY, &chat_body(false)).await;
    assert_eq!(bad.requests(), 1, "the first attempt went to the first instance");
    assert_retried_on_second(&gw, status, &v, &bad, &good).await;
    gw.stop().await;
}

#[tokio::test]
async fn a_streamed_call_retried_before_its_first_token_streams_whole() {
    let bad = FakeEngine::start_with(Knobs { fail_status: Some(503), ..Knobs::default() }).await;
    let good = FakeEngine::start().await;
    let gw = gateway(&bad.url(), &engine("fake2", &good.url(), "fake-model", ""), two_instances).await;
    gw.wait_ready().await;
    let (events, done) = read_sse(post_chat(&gw, DEMO_KEY, &chat_body(true)).await).await;
    assert!(done, "{events:?}");
    assert!(events.iter().all(|e| e.get("error").is_none()), "{events:?}");
    let text: String = events.iter().filter_map(|e| e["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(text, "tok tok tok tok tok ");
    let edge = events.iter().rev().find(|e| e.get("edge").is_some()).expect("edge chunk");
    let route = &edge["edge"]["route"];
    assert_eq!(route["attempts"], 2, "{route}");
    assert_eq!(route["instance"], "fake2", "{route}");
    assert_eq!((bad.requests(), good.requests()), (1, 1));
    let m = metrics_text(&gw).await;
    assert_eq!(metric(&m, "edgeway_retries_total", &[("model", "general-chat")]), 1.0, "{m}");
    gw.stop().await;
}

#[tokio::test]
async fn a_refused_connection_is_retried_on_the_other_instance() {
    let dead = FakeEngine::start().await;
    let good = FakeEngine::start().await;
    // Probes every minute: the gateway still thinks `fake` is up when its
    // process is gone, so the refusal reaches dispatch.
    let gw = gateway(&dead.url(), &engine("fake2", &good.url(), "fake-model", ""), |t| {
        two_instances(t).replace("health_interval_ms = 100", "health_interval_ms = 60000")
    })
    .await;
    gw.wait_ready().await;
    dead.stop().await;
    let (status, v) = call(&gw, DEMO_KEY, &chat_body(false)).await;
    assert_retried_on_second(&gw, status, &v, &dead, &good).await;
    gw.stop().await;
}

#[tokio::test]
async fn a_429_before_the_first_token_is_retried_on_the_other_instance() {
    let bad = FakeEngine::start_with(Knobs { fail_status: Some(429), ..Knobs::default() }).await;
    let good = FakeEngine::start().await;
    let gw = gateway(&bad.url(), &engine("fake2", &good.url(), "fake-model", ""), two_instances).await;
    gw.wait_ready().await;
    let (status, v) = call(&gw, DEMO_KEY, &chat_body(false)).await;
    assert_eq!(bad.requests(), 1);
    assert_retried_on_second(&gw, status, &v, &bad, &good).await;
    gw.stop().await;
}

#[tokio::test]
async fn a_first_token_timeout_is_retried_on_the_other_instance() {
    let slow = FakeEngine::start_with(Knobs { first_token_delay: Duration::from_secs(20), ..Knobs::default() }).await;
    let good = FakeEngine::start().await;
    // The gateway's own limit (a caller's lower one says nothing of the
    // engine: see the next test).
    let extra = format!(
        "{}
[timeouts]
first_token_ms = 300
",
        engine("fake2", &good.url(), "fake-model", "")
    );
    let gw = gateway(&slow.url(), &extra, two_instances).await;
    gw.wait_ready().await;
    let (status, v) = call(&gw, DEMO_KEY, &chat_body(false)).await;
    assert_eq!(slow.requests(), 1);
    assert_retried_on_second(&gw, status, &v, &slow, &good).await;
    assert!(
        slow.wait_for(Duration::from_secs(5), |s| s.active.load(SeqCst) == 0).await,
        "the slow attempt was cancelled"
    );
    gw.stop().await;
}

#[tokio::test]
async fn a_callers_own_short_first_token_limit_neither_retries_nor_opens_breakers() {
    let slow = FakeEngine::start_with(Knobs { first_token_delay: Duration::from_secs(20), ..Knobs::default() }).await;
    let good = FakeEngine::start_with(Knobs { first_token_delay: Duration::from_secs(20), ..Knobs::default() }).await;
    let extra = format!(
        "{}
[routing.breaker]
consecutive_failures = 2
",
        engine("fake2", &good.url(), "fake-model", "")
    );
    let gw = gateway(&slow.url(), &extra, two_instances).await;
    gw.wait_ready().await;
    let mut b = chat_body(false);
    b["timeouts"] = json!({"first_token_ms": 50});
    // Enough calls to open both breakers if they counted.
    for _ in 0..6 {
        let (status, v) = call(&gw, DEMO_KEY, &b).await;
        assert_eq!(status, 504, "{v}");
        assert_eq!(v["error"]["code"], "FIRST_TOKEN_TIMEOUT", "{v}");
        assert_eq!(v["edge"]["route"]["attempts"], 1, "not retried: {v}");
    }
    let r = ready(&gw).await;
    assert_eq!(instance(&r, "fake")["breaker"], "CLOSED", "{r}");
    assert_eq!(instance(&r, "fake2")["breaker"], "CLOSED", "{r}");
    let m = metrics_text(&gw).await;
    assert_eq!(metric(&m, "edgeway_retries_total", &[]), 0.0, "{m}");
    gw.stop().await;
}

#[tokio::test]
async fn a_4xx_from_the_engine_is_not_retried() {
    let bad = FakeEngine::start_with(Knobs { fail_status: Some(400), ..Knobs::default() }).await;
    let good = FakeEngine::start().await;
    let gw = gateway(&bad.url(), &engine("fake2", &good.url(), "fake-model", ""), two_instances).await;
    gw.wait_ready().await;
    let (status, v) = call(&gw, DEMO_KEY, &chat_body(false)).await;
    assert_ne!(status, 200, "{v}");
    assert_eq!(v["edge"]["route"]["attempts"], 1, "{v}");
    assert_eq!((bad.requests(), good.requests()), (1, 0));
    let m = metrics_text(&gw).await;
    assert_eq!(metric(&m, "edgeway_retries_total", &[]), 0.0, "{m}");
    gw.stop().await;
}

#[tokio::test]
async fn the_only_instance_is_tried_again_after_a_back_off() {
    let fake = FakeEngine::start_with(Knobs { fail_next: 1, ..Knobs::default() }).await;
    let gw = gateway(&fake.url(), "", |t| t).await;
    gw.wait_ready().await;
    let (status, v) = call(&gw, DEMO_KEY, &chat_body(false)).await;
    assert_eq!(status, 200, "{v}");
    let route = &v["edge"]["route"];
    assert_eq!(route["attempts"], 2, "{route}");
    assert_eq!(route["instance"], "fake", "{route}");
    assert_eq!(fake.requests(), 2);
    let ts = transitions(&gw, v["edge"]["task_id"].as_str().unwrap()).await;
    assert!(ts.iter().any(|t| t.state == TaskState::Queued && t.reason.starts_with("retry after attempt 1")), "{ts:?}");
    gw.stop().await;
}

#[tokio::test]
async fn attempts_stop_at_max_attempts() {
    let a = FakeEngine::start_with(Knobs { fail_status: Some(500), ..Knobs::default() }).await;
    let b = FakeEngine::start_with(Knobs { fail_status: Some(502), ..Knobs::default() }).await;
    let gw = gateway(&a.url(), &engine("fake2", &b.url(), "fake-model", ""), two_instances).await;
    gw.wait_ready().await;
    let (status, v) = call(&gw, DEMO_KEY, &chat_body(false)).await;
    assert_ne!(status, 200, "{v}");
    assert_eq!(v["edge"]["status"], "FAILED", "{v}");
    assert_eq!(v["edge"]["route"]["attempts"], 3, "{v}");
    assert_eq!(a.requests() + b.requests(), 3);
    assert!(a.requests() >= 1 && b.requests() >= 1, "both instances were tried");
    let ts = transitions(&gw, v["edge"]["task_id"].as_str().unwrap()).await;
    let retries = ts.iter().filter(|t| t.state == TaskState::Queued && t.reason.starts_with("retry after")).count();
    assert_eq!(retries, 2, "{ts:?}");
    assert_eq!(ts.last().unwrap().state, TaskState::Failed);
    assert!(ts.last().unwrap().reason.contains("no attempts left"), "{ts:?}");
    gw.stop().await;
}

// 2. After the first token nothing is retried.

#[tokio::test]
async fn an_engine_dying_after_three_tokens_gives_a_partial_error_and_no_second_attempt() {
    let dying = FakeEngine::start_with(Knobs { tokens: 10, drop_after: Some(3), ..Knobs::default() }).await;
    let other = FakeEngine::start().await;
    let gw = gateway(&dying.url(), &engine("fake2", &other.url(), "fake-model", ""), two_instances).await;
    gw.wait_ready().await;
    let (events, done) = read_sse(post_chat(&gw, DEMO_KEY, &chat_body(true)).await).await;
    assert!(!done, "{events:?}");
    let text: String = events.iter().filter_map(|e| e["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(text, "tok tok tok ", "the three tokens reached the client");
    let last = events.last().unwrap();
    assert_eq!(error_code(last), "INTERNAL_ERROR", "{last}");
    assert_eq!(last["error"]["partial"], true, "{last}");
    assert_eq!(last["edge"]["status"], "FAILED");
    assert_eq!(last["edge"]["route"]["attempts"], 1, "{last}");
    assert_eq!(dying.requests(), 1);
    assert_eq!(other.requests(), 0, "no second attempt");
    let task_id = last["edge"]["task_id"].as_str().unwrap();
    let ts = transitions(&gw, task_id).await;
    assert!(!ts.iter().any(|t| t.reason.starts_with("retry")), "{ts:?}");
    assert_eq!(ts.last().unwrap().state, TaskState::Failed);
    let m = metrics_text(&gw).await;
    assert_eq!(metric(&m, "edgeway_retries_total", &[]), 0.0);
    gw.stop().await;
}

// 3. Circuit breaker.

#[tokio::test]
async fn consecutive_failures_open_the_breaker_the_cooldown_half_opens_it_and_a_good_call_closes_it() {
    let fake = FakeEngine::start_with(Knobs { fail_status: Some(500), ..Knobs::default() }).await;
    // One attempt per call; probes only at start, so attempts alone move the
    // breaker.
    // A cool-down long enough that a slow machine still sees it open.
    let extra = "\n[routing]\nmax_attempts = 1\n[routing.breaker]\nconsecutive_failures = 3\ncooldown_ms = 1000\n";
    let gw = gateway(&fake.url(), extra, |t| t.replace("health_interval_ms = 100", "health_interval_ms = 60000")).await;
    gw.wait_ready().await;
    assert_eq!(instance(&ready(&gw).await, "fake")["breaker"], "CLOSED");
    for n in 1..=3 {
        let (status, v) = call(&gw, DEMO_KEY, &chat_body(false)).await;
        assert_eq!(status, 500, "call {n}: {v}");
        assert_eq!(v["edge"]["route"]["attempts"], 1, "{v}");
        assert_eq!(fake.requests(), n);
    }
    let r = ready(&gw).await;
    assert_eq!(instance(&r, "fake")["breaker"], "OPEN", "{r}");
    let m = metrics_text(&gw).await;
    assert_eq!(metric(&m, "edgeway_breaker_state", &[("instance", "fake")]), 2.0, "{m}");
    assert_eq!(metric(&m, "edgeway_breaker_transitions_total", &[("instance", "fake"), ("state", "open")]), 1.0);
    // While it is open (well within the cool-down) work does not reach it.
    let (status, v) = call(&gw, DEMO_KEY, &chat_body(false)).await;
    assert_eq!(status, 503, "{v}");
    assert_eq!(error_code(&v), "MODEL_UNAVAILABLE", "{v}");
    assert!(v["error"]["retry_after_ms"].as_u64().is_some(), "{v}");
    assert_eq!(fake.requests(), 3);

    fake.set(|k| k.fail_status = None);
    until("the breaker half-open", || async { instance(&ready(&gw).await, "fake")["breaker"] == "HALF_OPEN" }).await;
    let m = metrics_text(&gw).await;
    assert_eq!(metric(&m, "edgeway_breaker_state", &[("instance", "fake")]), 1.0, "{m}");
    assert_eq!(fake.requests(), 3, "nothing reached the engine while the breaker was open");

    let (status, v) = call(&gw, DEMO_KEY, &chat_body(false)).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["edge"]["route"]["instance"], "fake");
    let r = ready(&gw).await;
    assert_eq!(instance(&r, "fake")["breaker"], "CLOSED", "{r}");
    let m = metrics_text(&gw).await;
    assert_eq!(metric(&m, "edgeway_breaker_state", &[("instance", "fake")]), 0.0, "{m}");
    for state in ["open", "half_open", "closed"] {
        assert_eq!(
            metric(&m, "edgeway_breaker_transitions_total", &[("instance", "fake"), ("state", state)]),
            1.0,
            "{state}: {m}"
        );
    }
    gw.stop().await;
}

#[tokio::test]
async fn an_open_breaker_sends_work_to_the_other_instance() {
    let bad = FakeEngine::start_with(Knobs { fail_status: Some(500), ..Knobs::default() }).await;
    let good = FakeEngine::start().await;
    let extra = format!(
        "{}\n[routing.breaker]\nconsecutive_failures = 1\ncooldown_ms = 60000\n",
        engine("fake2", &good.url(), "fake-model", "")
    );
    let gw = gateway(&bad.url(), &extra, two_instances).await;
    gw.wait_ready().await;
    // A call that goes to `fake` first fails there, opens its breaker and is
    // answered by `fake2`. One failure opens it: after a failure the picker
    // prefers the instance with fewer recent errors, so a second failure on
    // `fake` would depend on when that error reaches the picker. (Which
    // instance an idle gateway tries first also depends on the probes'
    // recent latency, so calls go on until one has gone to `fake`.)
    let mut opened = false;
    for _ in 0..20 {
        let (status, v) = call(&gw, DEMO_KEY, &chat_body(false)).await;
        assert_eq!(status, 200, "{v}");
        if instance(&ready(&gw).await, "fake")["breaker"] == "OPEN" {
            opened = true;
            break;
        }
    }
    assert!(opened, "a failure on fake never opened its breaker: {} requests, {}", bad.requests(), ready(&gw).await);
    assert_eq!(bad.requests(), 1, "the breaker opened on the first failure");
    let before = bad.requests();
    for _ in 0..3 {
        let (status, v) = call(&gw, DEMO_KEY, &chat_body(false)).await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["edge"]["route"]["attempts"], 1, "{v}");
        assert_eq!(v["edge"]["route"]["instance"], "fake2");
    }
    assert_eq!(bad.requests(), before, "an open breaker keeps work away");
    gw.stop().await;
}

#[tokio::test]
async fn a_failed_trial_while_half_open_opens_the_breaker_again() {
    let fake = FakeEngine::start_with(Knobs { fail_status: Some(500), ..Knobs::default() }).await;
    // A cool-down long enough that a loaded machine still makes the call
    // after the failed trial before the breaker half-opens again.
    let extra = "\n[routing]\nmax_attempts = 1\n[routing.breaker]\nconsecutive_failures = 2\ncooldown_ms = 3000\n";
    let gw = gateway(&fake.url(), extra, |t| t.replace("health_interval_ms = 100", "health_interval_ms = 60000")).await;
    gw.wait_ready().await;
    for _ in 0..2 {
        assert_eq!(call(&gw, DEMO_KEY, &chat_body(false)).await.0, 500);
    }
    until("the breaker half-open", || async { instance(&ready(&gw).await, "fake")["breaker"] == "HALF_OPEN" }).await;
    // The one trial fails: open again, and work stays away.
    assert_eq!(call(&gw, DEMO_KEY, &chat_body(false)).await.0, 500);
    assert_eq!(fake.requests(), 3);
    let r = ready(&gw).await;
    assert_eq!(instance(&r, "fake")["breaker"], "OPEN", "{r}");
    let (status, v) = call(&gw, DEMO_KEY, &chat_body(false)).await;
    assert_eq!(status, 503, "{v}");
    assert_eq!(fake.requests(), 3);
    let m = metrics_text(&gw).await;
    assert_eq!(metric(&m, "edgeway_breaker_transitions_total", &[("instance", "fake"), ("state", "open")]), 2.0, "{m}");
    assert_eq!(metric(&m, "edgeway_breaker_state", &[("instance", "fake")]), 2.0, "{m}");
    gw.stop().await;
}

#[tokio::test]
async fn a_half_open_breaker_lets_one_trial_through_at_a_time() {
    let fake = FakeEngine::start_with(Knobs { fail_status: Some(500), ..Knobs::default() }).await;
    let extra = "\n[routing]\nmax_attempts = 1\n[routing.breaker]\nconsecutive_failures = 2\ncooldown_ms = 300\n";
    let gw = gateway(&fake.url(), extra, |t| t.replace("health_interval_ms = 100", "health_interval_ms = 60000")).await;
    gw.wait_ready().await;
    for _ in 0..2 {
        assert_eq!(call(&gw, DEMO_KEY, &chat_body(false)).await.0, 500);
    }
    until("the breaker half-open", || async { instance(&ready(&gw).await, "fake")["breaker"] == "HALF_OPEN" }).await;
    fake.set(|k| {
        k.fail_status = None;
        k.first_token_delay = Duration::from_millis(1000);
    });
    let first = spawn_call(&gw, DEMO_KEY, chat_body(false));
    let second = spawn_call(&gw, DEMO_KEY, chat_body(false));
    // Both calls are in: one runs (the trial), the other waits for its verdict.
    until("both calls in", || async {
        let s = gw.scheduler().snapshot().await.unwrap();
        s.queues[0].waiting + s.instances[0].running == 2
    })
    .await;
    let s = gw.scheduler().snapshot().await.unwrap();
    assert_eq!((s.instances[0].running, s.queues[0].waiting), (1, 1), "{s:?}");
    assert_eq!(fake.requests(), 3);
    for call in [first, second] {
        let (status, v) = call.await.unwrap();
        assert_eq!(status, 200, "{v}");
    }
    assert_eq!(instance(&ready(&gw).await, "fake")["breaker"], "CLOSED");
    gw.stop().await;
}

#[tokio::test]
async fn an_out_of_memory_answer_opens_the_breaker_at_once() {
    let bad = FakeEngine::start_with(Knobs {
        fail_status: Some(500),
        fail_message: "CUDA error: out of memory".into(),
        ..Knobs::default()
    })
    .await;
    let good = FakeEngine::start().await;
    let gw = gateway(&bad.url(), &engine("fake2", &good.url(), "fake-model", ""), two_instances).await;
    gw.wait_ready().await;
    let (status, v) = call(&gw, DEMO_KEY, &chat_body(false)).await;
    assert_retried_on_second(&gw, status, &v, &bad, &good).await;
    let r = ready(&gw).await;
    let fake = instance(&r, "fake");
    assert_eq!(fake["breaker"], "OPEN", "one failure, default threshold 5: {r}");
    assert!(fake["breaker_reason"].as_str().unwrap_or_default().contains("out of memory"), "{r}");
    assert_eq!(instance(&r, "fake2")["breaker"], "CLOSED");
    gw.stop().await;
}

#[tokio::test]
async fn an_error_that_only_contains_the_letters_oom_is_an_ordinary_failure() {
    let fake = FakeEngine::start_with(Knobs {
        fail_status: Some(500),
        fail_message: "no room left in the request queue".into(),
        ..Knobs::default()
    })
    .await;
    let gw = gateway(&fake.url(), "\n[routing]\nmax_attempts = 1\n", |t| t).await;
    gw.wait_ready().await;
    assert_eq!(call(&gw, DEMO_KEY, &chat_body(false)).await.0, 500);
    let r = ready(&gw).await;
    assert_eq!(instance(&r, "fake")["breaker"], "CLOSED", "one ordinary failure of 5: {r}");
    gw.stop().await;
}

#[tokio::test]
async fn a_high_error_rate_opens_the_breaker() {
    let fake = FakeEngine::start().await;
    let extra = "\n[routing]\nmax_attempts = 1\n[routing.breaker]\nconsecutive_failures = 100\nerror_rate_percent = 40\nmin_requests = 6\ncooldown_ms = 60000\n";
    let gw = gateway(&fake.url(), extra, |t| t.replace("health_interval_ms = 100", "health_interval_ms = 60000")).await;
    gw.wait_ready().await;
    // Fail, succeed, fail, ...: never two failures in a row, half of them.
    for n in 0..6 {
        if n % 2 == 0 {
            fake.set(|k| k.fail_next = 1);
        }
        let (status, v) = call(&gw, DEMO_KEY, &chat_body(false)).await;
        assert_eq!(status, if n % 2 == 0 { 500 } else { 200 }, "call {n}: {v}");
        if n < 5 {
            assert_eq!(instance(&ready(&gw).await, "fake")["breaker"], "CLOSED", "after call {n}");
        }
    }
    let r = ready(&gw).await;
    assert_eq!(instance(&r, "fake")["breaker"], "OPEN", "{r}");
    let (status, v) = call(&gw, DEMO_KEY, &chat_body(false)).await;
    assert_eq!(status, 503, "{v}");
    assert_eq!(fake.requests(), 6);
    gw.stop().await;
}

#[tokio::test]
async fn failing_health_probes_open_the_breaker_and_recovery_brings_traffic_back() {
    let a = FakeEngine::start().await;
    let b = FakeEngine::start().await;
    let extra = format!(
        "{}\n[routing.breaker]\nconsecutive_failures = 3\ncooldown_ms = 300\n",
        engine("fake2", &b.url(), "fake-model", "health_interval_ms = 100")
    );
    let gw = gateway(&a.url(), &extra, two_instances).await;
    gw.wait_ready().await;
    a.set(|k| k.healthy = false);
    until("fake's breaker open", || async { instance(&ready(&gw).await, "fake")["breaker"] == "OPEN" }).await;
    for _ in 0..3 {
        let (status, v) = call(&gw, DEMO_KEY, &chat_body(false)).await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["edge"]["route"]["instance"], "fake2", "{v}");
        assert_eq!(v["edge"]["route"]["attempts"], 1, "{v}");
    }
    assert_eq!(a.requests(), 0);
    a.set(|k| k.healthy = true);
    // No operator: once it is up, traffic comes back (two idle instances:
    // the first in order is picked).
    until("a call answered by fake again", || async {
        call(&gw, DEMO_KEY, &chat_body(false)).await.1["edge"]["route"]["instance"] == "fake"
    })
    .await;
    until("fake's breaker closed", || async { instance(&ready(&gw).await, "fake")["breaker"] == "CLOSED" }).await;
    let m = metrics_text(&gw).await;
    assert_eq!(metric(&m, "edgeway_breaker_state", &[("instance", "fake")]), 0.0, "{m}");
    gw.stop().await;
}

#[tokio::test]
async fn a_client_gone_while_its_task_waits_to_retry_cancels_it_and_stops_the_retries() {
    let fake = FakeEngine::start_with(Knobs { fail_status: Some(500), ..Knobs::default() }).await;
    let gw = gateway(&fake.url(), "\n[routing]\nretry_backoff_ms = 3000\n", |t| t).await;
    gw.wait_ready().await;
    let mut rx = gw.recorder().subscribe();
    let pending = spawn_call(&gw, DEMO_KEY, chat_body(false));
    let retry =
        next_event(&mut rx, "the retry", |e| e.state == TaskState::Queued && e.reason.starts_with("retry")).await;
    pending.abort();
    gw.wait_for_state(&retry.task_id, TaskState::Cancelled).await;
    let ts = transitions(&gw, &retry.task_id).await;
    assert_eq!(ts.last().unwrap().state, TaskState::Cancelled, "{ts:?}");
    assert_eq!(fake.requests(), 1, "no attempt after the client left");
    gw.stop().await;
}

#[tokio::test]
async fn a_slow_first_token_p95_opens_the_breaker() {
    let fake =
        FakeEngine::start_with(Knobs { first_token_delay: Duration::from_millis(300), ..Knobs::default() }).await;
    let extra = "\n[routing.breaker]\nttft_p95_ms = 100\nmin_requests = 3\ncooldown_ms = 60000\n";
    let gw = gateway(&fake.url(), extra, |t| t.replace("health_interval_ms = 100", "health_interval_ms = 60000")).await;
    gw.wait_ready().await;
    for n in 0..3 {
        let (status, v) = call(&gw, DEMO_KEY, &chat_body(false)).await;
        assert_eq!(status, 200, "call {n}: {v}");
    }
    let r = ready(&gw).await;
    assert_eq!(instance(&r, "fake")["breaker"], "OPEN", "{r}");
    assert!(instance(&r, "fake")["breaker_reason"].as_str().unwrap_or_default().contains("first token"), "{r}");
    gw.stop().await;
}

// 4. Data policy.

/// `general-chat` on local `fake` and a `cloud` instance that may receive
/// public data only, with cloud allowed.
async fn local_and_cloud() -> (FakeEngine, FakeEngine, TestGateway) {
    let local = FakeEngine::start().await;
    let cloud = FakeEngine::start().await;
    let extra = format!(
        "{}\n[routing]\nallow_cloud = true\n",
        engine("cloud", &cloud.url(), "cloud-model", "location = \"cloud\"\nmax_data_class = \"public\"")
    );
    let gw =
        gateway(&local.url(), &extra, |t| t.replace("instances = [\"fake\"]", "instances = [\"fake\", \"cloud\"]"))
            .await;
    gw.wait_ready().await;
    (local, cloud, gw)
}

#[tokio::test]
async fn public_work_goes_to_the_cloud_only_after_the_local_step() {
    let (local, cloud, gw) = local_and_cloud().await;
    let public = body(false, json!({"data_class": "public"}));
    // Local up and free: local answers, several times in a row.
    for _ in 0..3 {
        let (status, v) = call(&gw, DEMO_KEY, &public).await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["edge"]["route"]["instance"], "fake", "{v}");
        assert_eq!(v["edge"]["route"]["degraded"], false, "{v}");
    }
    assert_eq!(cloud.requests(), 0);
    assert_eq!(local.requests(), 3);

    local.set(|k| k.healthy = false);
    until_down(&gw, "fake").await;
    let (status, v) = call(&gw, DEMO_KEY, &public).await;
    assert_eq!(status, 200, "{v}");
    let route = &v["edge"]["route"];
    assert_eq!(route["instance"], "cloud", "{route}");
    assert_eq!(route["data_class"], "public", "{route}");
    assert_eq!(route["degraded"], true, "{route}");
    let steps = hop_steps(route);
    let same = steps.iter().position(|s| s == "same-model").unwrap_or_else(|| panic!("no same-model hop: {route}"));
    let cloud_at = steps.iter().position(|s| s == "cloud").unwrap_or_else(|| panic!("no cloud hop: {route}"));
    assert!(same < cloud_at, "{route}");
    assert_eq!(cloud.requests(), 1);
    let m = metrics_text(&gw).await;
    assert_eq!(metric(&m, "edgeway_fallbacks_total", &[("model", "general-chat"), ("step", "cloud")]), 1.0, "{m}");
    gw.stop().await;
}

#[tokio::test]
async fn public_work_waits_for_a_busy_local_instance_rather_than_going_to_the_cloud() {
    let local = FakeEngine::start_with(Knobs::slow(8, 100)).await;
    let cloud = FakeEngine::start().await;
    let extra = format!(
        "{}\n[routing]\nallow_cloud = true\n",
        engine("cloud", &cloud.url(), "cloud-model", "location = \"cloud\"\nmax_data_class = \"public\"")
    );
    let gw = gateway(&local.url(), &extra, |t| {
        t.replace("instances = [\"fake\"]", "instances = [\"fake\", \"cloud\"]").replacen(
            "max_concurrency = 2",
            "max_concurrency = 1",
            1,
        )
    })
    .await;
    gw.wait_ready().await;
    let public = body(false, json!({"data_class": "public"}));
    let first = spawn_call(&gw, DEMO_KEY, public.clone());
    assert!(local.wait_for(Duration::from_secs(10), |s| s.active.load(SeqCst) == 1).await);
    // The local slot is busy, not down: the second call waits for it.
    let (status, v) = call(&gw, DEMO_KEY, &public).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["edge"]["route"]["instance"], "fake", "{v}");
    assert_eq!(v["edge"]["route"]["degraded"], false, "{v}");
    assert_eq!(first.await.unwrap().0, 200);
    assert_eq!(cloud.requests(), 0, "the cloud is a fallback step, not a peer");
    assert_eq!(local.requests(), 2);
    gw.stop().await;
}

#[tokio::test]
async fn sensitive_secret_and_local_only_work_never_reaches_the_cloud() {
    let (local, cloud, gw) = local_and_cloud().await;
    local.set(|k| k.healthy = false);
    until_down(&gw, "fake").await;
    let cases = [
        json!({"data_class": "secret"}),
        json!({"data_class": "sensitive"}),
        json!({"data_class": "personal"}),
        json!({"local_only": true}),
        json!({"local_only": true, "data_class": "public"}),
        // No class: the configured default (personal) is above the cloud's.
        json!({}),
    ];
    for routing in cases {
        for stream in [false, true] {
            let (status, v) = call(&gw, DEMO_KEY, &body(stream, routing.clone())).await;
            assert_eq!(status, 503, "{routing}: {v}");
            let code = error_code(&v);
            assert!(["MODEL_UNAVAILABLE", "POLICY_BLOCKED"].contains(&code), "{routing}: {v}");
            assert!(v["error"]["retry_after_ms"].as_u64().is_some_and(|ms| ms > 0), "{routing}: {v}");
        }
    }
    assert_eq!(cloud.requests(), 0, "nothing above public reached the cloud");
    assert_eq!(local.requests(), 0);
    gw.stop().await;
}

#[tokio::test]
async fn the_applications_class_is_stricter_than_the_requests() {
    let local = FakeEngine::start().await;
    let cloud = FakeEngine::start().await;
    let extra = format!(
        "{}\n[routing]\nallow_cloud = true\n",
        engine("cloud", &cloud.url(), "cloud-model", "location = \"cloud\"\nmax_data_class = \"public\"")
    );
    let gw = gateway(&local.url(), &extra, |t| {
        t.replace("instances = [\"fake\"]", "instances = [\"fake\", \"cloud\"]")
            .replace("default_priority = \"P2\"", "default_priority = \"P2\"\ndata_class = \"sensitive\"")
    })
    .await;
    gw.wait_ready().await;
    local.set(|k| k.healthy = false);
    until_down(&gw, "fake").await;
    let public = body(false, json!({"data_class": "public"}));
    // `demo` declares sensitive data: its "public" call stays local.
    let (status, v) = call(&gw, DEMO_KEY, &public).await;
    assert_eq!(status, 503, "{v}");
    assert!(["MODEL_UNAVAILABLE", "POLICY_BLOCKED"].contains(&error_code(&v)), "{v}");
    assert_eq!(cloud.requests(), 0);
    // `ops` declares nothing: its public call may go to the cloud.
    let (status, v) = call(&gw, OPS_KEY, &public).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["edge"]["route"]["instance"], "cloud", "{v}");
    assert_eq!(cloud.requests(), 1);
    gw.stop().await;
}

#[tokio::test]
async fn the_tenants_class_binds_all_its_applications() {
    let local = FakeEngine::start().await;
    let cloud = FakeEngine::start().await;
    let extra = format!(
        "{}\n[routing]\nallow_cloud = true\n[tenants.demo]\ndata_class = \"secret\"\n",
        engine("cloud", &cloud.url(), "cloud-model", "location = \"cloud\"\nmax_data_class = \"public\"")
    );
    let gw =
        gateway(&local.url(), &extra, |t| t.replace("instances = [\"fake\"]", "instances = [\"fake\", \"cloud\"]"))
            .await;
    gw.wait_ready().await;
    local.set(|k| k.healthy = false);
    until_down(&gw, "fake").await;
    for key in [DEMO_KEY, OPS_KEY] {
        let (status, v) = call(&gw, key, &body(false, json!({"data_class": "public"}))).await;
        assert_eq!(status, 503, "{v}");
        assert!(["MODEL_UNAVAILABLE", "POLICY_BLOCKED"].contains(&error_code(&v)), "{v}");
    }
    assert_eq!(cloud.requests(), 0);
    gw.stop().await;
}

#[tokio::test]
async fn an_unknown_data_class_is_an_invalid_request() {
    let fake = FakeEngine::start().await;
    let gw = gateway(&fake.url(), "", |t| t).await;
    gw.wait_ready().await;
    let (status, v) = call(&gw, DEMO_KEY, &body(false, json!({"data_class": "top-secret"}))).await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(error_code(&v), "INVALID_REQUEST", "{v}");
    assert_eq!(fake.requests(), 0);
    gw.stop().await;
}

#[tokio::test]
async fn waiting_public_work_moves_to_the_cloud_when_local_goes_down_and_personal_work_does_not() {
    let local = FakeEngine::start_with(Knobs::slow(1000, 50)).await;
    let cloud = FakeEngine::start().await;
    let extra = format!(
        "{}\n[routing]\nallow_cloud = true\n",
        engine("cloud", &cloud.url(), "cloud-model", "location = \"cloud\"\nmax_data_class = \"public\"")
    );
    let gw = gateway(&local.url(), &extra, |t| {
        t.replace("instances = [\"fake\"]", "instances = [\"fake\", \"cloud\"]").replacen(
            "max_concurrency = 2",
            "max_concurrency = 1",
            1,
        )
    })
    .await;
    gw.wait_ready().await;
    let mut holder = post_chat(&gw, DEMO_KEY, &chat_body(true)).await;
    assert_eq!(holder.status(), 200);
    holder.chunk().await.unwrap().expect("first chunk");
    assert!(local.wait_for(Duration::from_secs(10), |s| s.active.load(SeqCst) == 1).await);
    let public = spawn_call(&gw, DEMO_KEY, body(false, json!({"data_class": "public"})));
    let personal = spawn_call(&gw, DEMO_KEY, body(false, json!({"data_class": "personal"})));
    until("2 waiting", || async { gw.scheduler().snapshot().await.unwrap().queues[0].waiting == 2 }).await;
    assert_eq!(cloud.requests(), 0, "waiting, not sent to the cloud");
    local.set(|k| k.healthy = false);
    let (status, v) = tokio::time::timeout(Duration::from_secs(10), public).await.expect("answered").unwrap();
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["edge"]["route"]["instance"], "cloud", "{v}");
    assert!(hop_steps(&v["edge"]["route"]).contains(&"cloud".to_string()), "{v}");
    let (status, v) = tokio::time::timeout(Duration::from_secs(10), personal).await.expect("answered").unwrap();
    assert_eq!(status, 503, "{v}");
    assert!(["MODEL_UNAVAILABLE", "POLICY_BLOCKED"].contains(&error_code(&v)), "{v}");
    assert_eq!(cloud.requests(), 1, "only the public call reached the cloud");
    drop(holder);
    gw.stop().await;
}

#[tokio::test]
async fn a_cloud_instance_without_allow_cloud_is_refused_by_validation() {
    let tmp = edgeway::testing::TempDir::new("edgeway-routing");
    let extra =
        engine("cloud", "http://127.0.0.1:9", "cloud-model", "location = \"cloud\"\nmax_data_class = \"public\"");
    let text = edgeway::testing::config_toml("http://127.0.0.1:9", "openai", &tmp.0, &extra)
        .replace("instances = [\"fake\"]", "instances = [\"fake\", \"cloud\"]");
    let Err(errors) = edgeway::config::Config::from_toml_str(&text, std::iter::empty(), std::path::Path::new("."))
    else {
        panic!("a cloud instance without routing.allow_cloud was accepted");
    };
    assert!(
        errors.0.iter().any(|e| e.path == "engines.cloud.location" && e.message.contains("allow_cloud")),
        "{errors}"
    );
    // The same with cloud allowed is accepted.
    let allowed = format!("{text}\n[routing]\nallow_cloud = true\n");
    edgeway::config::Config::from_toml_str(&allowed, std::iter::empty(), std::path::Path::new("."))
        .unwrap_or_else(|e| panic!("{e}"));
    // A cloud instance may not be declared fit for sensitive data.
    let too_high = allowed.replace("max_data_class = \"public\"", "max_data_class = \"sensitive\"");
    let Err(errors) = edgeway::config::Config::from_toml_str(&too_high, std::iter::empty(), std::path::Path::new("."))
    else {
        panic!("a cloud instance taking sensitive data was accepted");
    };
    assert!(errors.0.iter().any(|e| e.path == "engines.cloud.max_data_class"), "{errors}");
}

// 5. Smaller-model fallback.

#[tokio::test]
async fn a_full_queue_falls_back_to_the_smaller_model_when_allowed() {
    let main = FakeEngine::start_with(Knobs::slow(1000, 50)).await;
    let small = FakeEngine::start().await;
    let extra = format!(
        "queue_capacity = 1\nfallback_models = [\"small-chat\"]\n{}\n[models.small-chat]\ninstances = [\"small\"]\ncontext_tokens = 2048\nmax_output_tokens = 256\n",
        engine("small", &small.url(), "small-model", "")
    );
    let gw = gateway(&main.url(), &extra, |t| t.replacen("max_concurrency = 2", "max_concurrency = 1", 1)).await;
    gw.wait_ready().await;
    // One call holds the slot, one waits: the queue is full.
    let mut holder = post_chat(&gw, DEMO_KEY, &chat_body(true)).await;
    assert_eq!(holder.status(), 200);
    holder.chunk().await.unwrap().expect("first chunk");
    let waiting = tokio::spawn({
        let url = format!("{}/v1/chat/completions", gw.base_url);
        async move { client().post(url).bearer_auth(DEMO_KEY).json(&chat_body(false)).send().await }
    });
    until("1 waiting", || async { gw.scheduler().snapshot().await.unwrap().queues[0].waiting == 1 }).await;

    let (status, v) = call(&gw, DEMO_KEY, &body(false, json!({"allow_smaller_model": true}))).await;
    assert_eq!(status, 200, "{v}");
    let route = &v["edge"]["route"];
    assert_eq!(route["requested_model"], "general-chat", "{route}");
    assert_eq!(route["model"], "small-chat", "{route}");
    assert_eq!(route["instance"], "small", "{route}");
    assert_eq!(route["degraded"], true, "{route}");
    assert!(hop_steps(route).contains(&"smaller-model".to_string()), "{route}");
    assert_eq!(small.requests(), 1);

    let (status, v) = call(&gw, DEMO_KEY, &chat_body(false)).await;
    assert_eq!(status, 503, "{v}");
    assert_eq!(error_code(&v), "QUEUE_FULL", "{v}");
    assert_eq!(small.requests(), 1, "not allowed: the smaller model was not asked");
    assert_eq!(main.requests(), 1, "only the holder reached the main engine");
    let m = metrics_text(&gw).await;
    assert_eq!(
        metric(&m, "edgeway_fallbacks_total", &[("model", "general-chat"), ("step", "smaller-model")]),
        1.0,
        "{m}"
    );
    waiting.abort();
    drop(holder);
    gw.stop().await;
}

#[tokio::test]
async fn an_application_that_allows_smaller_models_gets_one_without_asking() {
    let main = FakeEngine::start().await;
    let small = FakeEngine::start().await;
    let extra = format!(
        "fallback_models = [\"small-chat\"]\n{}\n[models.small-chat]\ninstances = [\"small\"]\ncontext_tokens = 2048\nmax_output_tokens = 256\n",
        engine("small", &small.url(), "small-model", "")
    );
    let gw = gateway(&main.url(), &extra, |t| {
        t.replace("default_priority = \"P2\"", "default_priority = \"P2\"\nallow_smaller_model = true")
    })
    .await;
    gw.wait_ready().await;
    main.set(|k| k.healthy = false);
    until_down(&gw, "fake").await;
    let (status, v) = call(&gw, DEMO_KEY, &chat_body(false)).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["edge"]["route"]["model"], "small-chat", "{v}");
    // `ops` does not allow it and did not ask.
    let (status, v) = call(&gw, OPS_KEY, &chat_body(false)).await;
    assert_eq!(status, 503, "{v}");
    assert_eq!(error_code(&v), "MODEL_UNAVAILABLE", "{v}");
    assert_eq!(small.requests(), 1);
    gw.stop().await;
}

// 6. Retry budget.

#[tokio::test]
async fn an_engine_failing_every_request_gets_at_most_the_budgeted_retries() {
    let fake = FakeEngine::start_with(Knobs { fail_status: Some(500), ..Knobs::default() }).await;
    // The breaker never opens here, so only the budget limits retries.
    let extra =
        "\n[routing]\nmax_attempts = 3\nretry_backoff_ms = 1\nretry_budget_min = 2\nretry_budget_percent = 10\n\
                 [routing.breaker]\nconsecutive_failures = 1000\nmin_requests = 1000\n";
    let gw = gateway(&fake.url(), extra, |t| t).await;
    gw.wait_ready().await;
    const N: u64 = 10;
    for n in 0..N {
        let (status, v) = call(&gw, DEMO_KEY, &chat_body(false)).await;
        assert_ne!(status, 200, "call {n}: {v}");
    }
    // 2 per window plus 10 % of the 10 first attempts.
    let budget = 2 + N / 10;
    let requests = fake.requests();
    assert!(requests > N, "some retries were made: {requests}");
    assert!(requests <= N + budget, "{requests} engine requests for {N} calls, budget {budget}");
    let m = metrics_text(&gw).await;
    assert_eq!(metric(&m, "edgeway_retries_total", &[("model", "general-chat")]), (requests - N) as f64, "{m}");
    assert!(metric(&m, "edgeway_retries_refused_total", &[("model", "general-chat")]) > 0.0, "{m}");
    let (status, v) = call(&gw, DEMO_KEY, &chat_body(false)).await;
    assert_eq!(status, 500, "{v}");
    assert_eq!(v["edge"]["route"]["attempts"], 1, "the budget is spent: {v}");
    let ts = transitions(&gw, v["edge"]["task_id"].as_str().unwrap()).await;
    assert!(ts.last().unwrap().reason.contains("retry budget"), "{ts:?}");
    gw.stop().await;
}

// 7. Canned answer.

#[tokio::test]
async fn a_model_whose_only_instance_is_down_gives_its_canned_answer() {
    let fake = FakeEngine::start().await;
    let gw = gateway(&fake.url(), "canned_answer = \"The assistant is busy; call the desk.\"", |t| t).await;
    gw.wait_ready().await;
    fake.set(|k| k.healthy = false);
    until_down(&gw, "fake").await;
    let (status, v) = call(&gw, DEMO_KEY, &chat_body(false)).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], "The assistant is busy; call the desk.");
    let route = &v["edge"]["route"];
    assert_eq!(route["degraded"], true, "{route}");
    assert_eq!(route["attempts"], 0, "{route}");
    assert!(hop_steps(route).contains(&"canned".to_string()), "{route}");
    assert_eq!(fake.requests(), 0);
    // Streamed, the same text.
    let (events, done) = read_sse(post_chat(&gw, DEMO_KEY, &chat_body(true)).await).await;
    assert!(done, "{events:?}");
    let text: String = events.iter().filter_map(|e| e["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(text, "The assistant is busy; call the desk.");
    let m = metrics_text(&gw).await;
    assert_eq!(metric(&m, "edgeway_fallbacks_total", &[("model", "general-chat"), ("step", "canned")]), 2.0, "{m}");
    gw.stop().await;
}

// 8. Preemption.

async fn one_slot(fake: &FakeEngine) -> TestGateway {
    let gw = gateway(&fake.url(), "", |t| t.replace("max_concurrency = 2", "max_concurrency = 1")).await;
    gw.wait_ready().await;
    gw
}

fn spawn_call(gw: &TestGateway, key: &'static str, b: Value) -> tokio::task::JoinHandle<(u16, Value)> {
    let url = format!("{}/v1/chat/completions", gw.base_url);
    tokio::spawn(async move {
        let r = client().post(url).bearer_auth(key).json(&b).send().await.unwrap();
        (r.status().as_u16(), r.json().await.unwrap())
    })
}

#[tokio::test]
async fn a_p0_call_preempts_a_p4_task_that_has_sent_nothing() {
    let fake = FakeEngine::start_with(Knobs { first_token_delay: Duration::from_secs(20), ..Knobs::default() }).await;
    let gw = one_slot(&fake).await;
    let mut low = chat_body(false);
    low["priority"] = json!("P4");
    let low = spawn_call(&gw, DEMO_KEY, low);
    assert!(fake.wait_for(Duration::from_secs(10), |s| s.active.load(SeqCst) == 1).await);
    // Later requests answer at once; the P4 one keeps its 20 s delay.
    fake.set(|k| k.first_token_delay = Duration::ZERO);
    let started = std::time::Instant::now();
    let mut high = chat_body(false);
    high["priority"] = json!("P0");
    let (status, v) = call(&gw, OPS_KEY, &high).await;
    assert_eq!(status, 200, "{v}");
    // Generous: without preemption it would wait out the P4's 20 s.
    assert!(started.elapsed() < Duration::from_secs(10), "P0 waited {:?}", started.elapsed());
    assert_eq!(v["edge"]["route"]["attempts"], 1);

    let (status, lv) = tokio::time::timeout(Duration::from_secs(15), low).await.expect("P4 finished").unwrap();
    assert_eq!(status, 200, "{lv}");
    assert_eq!(lv["edge"]["status"], "SUCCEEDED");
    assert_eq!(lv["edge"]["route"]["attempts"], 2, "{lv}");
    assert_eq!(fake.stats.aborted.load(SeqCst), 1, "the P4's first engine request was cancelled");
    let ts = transitions(&gw, lv["edge"]["task_id"].as_str().unwrap()).await;
    let pre = ts
        .iter()
        .find(|t| t.state == TaskState::Queued && t.reason.starts_with("preempted"))
        .unwrap_or_else(|| panic!("no preemption in {ts:?}"));
    // The P0 task may be another tenant's: its id stays in the logs.
    assert!(!pre.reason.contains(v["edge"]["task_id"].as_str().unwrap()), "names the P0 task: {}", pre.reason);
    assert!(pre.reason.contains("for a P0 task"), "{}", pre.reason);
    assert_eq!(ts.last().unwrap().state, TaskState::Succeeded);
    let m = metrics_text(&gw).await;
    assert_eq!(metric(&m, "edgeway_preemptions_total", &[("model", "general-chat"), ("priority", "P4")]), 1.0, "{m}");
    gw.stop().await;
}

#[tokio::test]
async fn a_p4_task_already_streaming_to_its_client_is_not_preempted() {
    let fake = FakeEngine::start_with(Knobs::slow(15, 100)).await;
    let gw = one_slot(&fake).await;
    let mut low = chat_body(true);
    low["priority"] = json!("P4");
    let mut stream = post_chat(&gw, DEMO_KEY, &low).await;
    assert_eq!(stream.status(), 200);
    // Until a token reached the client (the first bytes may be the role
    // chunk or a queue comment).
    let mut seen = String::new();
    while !seen.contains("\"content\":\"tok") {
        let chunk = stream.chunk().await.unwrap().expect("a token before the end");
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    let mut high = chat_body(false);
    high["priority"] = json!("P0");
    let high = spawn_call(&gw, OPS_KEY, high);
    until("the P0 waiting", || async { gw.scheduler().snapshot().await.unwrap().queues[0].waiting == 1 }).await;
    let (events, done) = read_sse(stream).await;
    assert!(done, "the P4 stream ran to its end: {events:?}");
    let text: String = events.iter().filter_map(|e| e["choices"][0]["delta"]["content"].as_str()).collect();
    let early = seen.matches("\"content\":\"tok ").count();
    assert_eq!(early + text.matches("tok ").count(), 15, "each token once: {seen} {text:?}");
    let edge = events.iter().rev().find(|e| e.get("edge").is_some()).expect("edge chunk");
    assert_eq!(edge["edge"]["route"]["attempts"], 1, "{edge}");
    let (status, v) = tokio::time::timeout(Duration::from_secs(15), high).await.expect("P0 answered").unwrap();
    assert_eq!(status, 200, "{v}");
    // The P0 waited for the whole P4 stream.
    assert!(v["edge"]["timing"]["queue_ms"].as_u64().unwrap() >= 500, "{v}");
    assert_eq!(fake.stats.aborted.load(SeqCst), 0);
    let m = metrics_text(&gw).await;
    assert_eq!(metric(&m, "edgeway_preemptions_total", &[]), 0.0, "{m}");
    gw.stop().await;
}

/// A P4 (or P3) task of `demo` holds the only slot, still before its first
/// token; a P0 call comes. With `preemptible` set on `demo` (or `extra`
/// appended to the config), the P0 call must wait: the low task runs once,
/// to its end, and nothing is preempted or aborted.
async fn p0_waits_for(low_priority: &str, preemptible: Option<&str>, extra: &str) {
    let fake =
        FakeEngine::start_with(Knobs { first_token_delay: Duration::from_millis(1500), ..Knobs::default() }).await;
    let gw = gateway(&fake.url(), extra, |t| {
        let t = t.replace("max_concurrency = 2", "max_concurrency = 1");
        match preemptible {
            Some(p) => {
                t.replace("default_priority = \"P2\"", &format!("default_priority = \"P2\"\npreemptible = \"{p}\""))
            }
            None => t,
        }
    })
    .await;
    gw.wait_ready().await;
    let mut low = chat_body(false);
    low["priority"] = json!(low_priority);
    let low = spawn_call(&gw, DEMO_KEY, low);
    assert!(fake.wait_for(Duration::from_secs(10), |s| s.active.load(SeqCst) == 1).await);
    fake.set(|k| k.first_token_delay = Duration::ZERO);
    let mut high = chat_body(false);
    high["priority"] = json!("P0");
    let (status, v) = call(&gw, OPS_KEY, &high).await;
    assert_eq!(status, 200, "{v}");
    let (status, lv) = low.await.unwrap();
    assert_eq!(status, 200, "{lv}");
    assert_eq!(lv["edge"]["route"]["attempts"], 1, "{lv}");
    assert_eq!(fake.stats.aborted.load(SeqCst), 0);
    assert_eq!(fake.requests(), 2);
    let m = metrics_text(&gw).await;
    assert_eq!(metric(&m, "edgeway_preemptions_total", &[]), 0.0, "{m}");
    gw.stop().await;
}

#[tokio::test]
async fn an_application_that_is_never_preemptible_makes_p0_wait() {
    p0_waits_for("P4", Some("never"), "").await;
}

#[tokio::test]
async fn without_preemption_p0_waits() {
    p0_waits_for("P4", None, "\n[scheduler]\npreemption = false\n").await;
}

#[tokio::test]
async fn a_streamed_p4_call_preempted_before_its_first_token_streams_each_token_once() {
    let fake = FakeEngine::start_with(Knobs { first_token_delay: Duration::from_secs(20), ..Knobs::default() }).await;
    let gw = one_slot(&fake).await;
    let mut low = chat_body(true);
    low["priority"] = json!("P4");
    let stream = post_chat(&gw, DEMO_KEY, &low).await;
    assert_eq!(stream.status(), 200);
    assert!(fake.wait_for(Duration::from_secs(10), |s| s.active.load(SeqCst) == 1).await);
    fake.set(|k| k.first_token_delay = Duration::ZERO);
    let mut high = chat_body(false);
    high["priority"] = json!("P0");
    let (status, v) = call(&gw, OPS_KEY, &high).await;
    assert_eq!(status, 200, "{v}");
    let (events, done) = tokio::time::timeout(Duration::from_secs(15), read_sse(stream)).await.expect("P4 ended");
    assert!(done, "{events:?}");
    let text: String = events.iter().filter_map(|e| e["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(text, "tok tok tok tok tok ", "each token once");
    let edge = events.iter().rev().find(|e| e.get("edge").is_some()).expect("edge chunk");
    assert_eq!(edge["edge"]["route"]["attempts"], 2, "{edge}");
    assert_eq!(edge["edge"]["status"], "SUCCEEDED");
    let m = metrics_text(&gw).await;
    assert_eq!(metric(&m, "edgeway_preemptions_total", &[("priority", "P4")]), 1.0, "{m}");
    gw.stop().await;
}

#[tokio::test]
async fn p0_preempts_the_most_recently_started_p4_task() {
    let fake = FakeEngine::start_with(Knobs { first_token_delay: Duration::from_secs(20), ..Knobs::default() }).await;
    let gw = gateway(&fake.url(), "", |t| t).await;
    gw.wait_ready().await;
    let mut low = chat_body(false);
    low["priority"] = json!("P4");
    let older = spawn_call(&gw, DEMO_KEY, low.clone());
    assert!(fake.wait_for(Duration::from_secs(10), |s| s.active.load(SeqCst) == 1).await);
    let newer = spawn_call(&gw, DEMO_KEY, low);
    assert!(fake.wait_for(Duration::from_secs(10), |s| s.active.load(SeqCst) == 2).await);
    fake.set(|k| k.first_token_delay = Duration::ZERO);
    let mut high = chat_body(false);
    high["priority"] = json!("P0");
    let (status, v) = call(&gw, OPS_KEY, &high).await;
    assert_eq!(status, 200, "{v}");
    let (status, nv) = tokio::time::timeout(Duration::from_secs(15), newer).await.expect("newer P4 ended").unwrap();
    assert_eq!(status, 200, "{nv}");
    assert_eq!(nv["edge"]["route"]["attempts"], 2, "the newer P4 was preempted: {nv}");
    assert!(!older.is_finished(), "the older P4 still waits for its first token");
    assert_eq!(fake.stats.aborted.load(SeqCst), 1);
    older.abort();
    let m = metrics_text(&gw).await;
    assert_eq!(metric(&m, "edgeway_preemptions_total", &[]), 1.0, "{m}");
    gw.stop().await;
}

#[tokio::test]
async fn an_application_preemptible_from_p4_keeps_its_p3_work() {
    p0_waits_for("P3", Some("P4"), "").await;
}

// 9. Degradation level.

/// `general-chat` on `fake` and `fake2`, falling back to `small-chat` on
/// `small`.
async fn degradable() -> (FakeEngine, FakeEngine, FakeEngine, TestGateway) {
    let (a, b, small) = (FakeEngine::start().await, FakeEngine::start().await, FakeEngine::start().await);
    let extra = format!(
        "fallback_models = [\"small-chat\"]\n{}{}\n[models.small-chat]\ninstances = [\"small\"]\ncontext_tokens = 2048\nmax_output_tokens = 256\n",
        engine("fake2", &b.url(), "fake-model", "health_interval_ms = 100"),
        engine("small", &small.url(), "small-model", "health_interval_ms = 100"),
    );
    let gw = gateway(&a.url(), &extra, two_instances).await;
    gw.wait_ready().await;
    (a, b, small, gw)
}

async fn degradation_metric(gw: &TestGateway) -> f64 {
    metric(&metrics_text(gw).await, "edgeway_degradation_level", &[])
}

#[tokio::test]
async fn the_degradation_level_metric_follows_the_instances() {
    let (a, b, small, gw) = degradable().await;
    assert_eq!(degradation_metric(&gw).await, 0.0);
    a.set(|k| k.healthy = false);
    until("level 1", || async { degradation_metric(&gw).await == 1.0 }).await;
    b.set(|k| k.healthy = false);
    until("level 2", || async { degradation_metric(&gw).await == 2.0 }).await;
    small.set(|k| k.healthy = false);
    until("level 3", || async { degradation_metric(&gw).await == 3.0 }).await;
    small.set(|k| k.healthy = true);
    until("level 2 again", || async { degradation_metric(&gw).await == 2.0 }).await;
    a.set(|k| k.healthy = true);
    b.set(|k| k.healthy = true);
    until("level 0 again", || async { degradation_metric(&gw).await == 0.0 }).await;
    gw.stop().await;
}

#[tokio::test]
async fn ready_shows_the_degradation_level() {
    let (a, b, _small, gw) = degradable().await;
    assert_eq!(ready(&gw).await["degradation_level"], 0);
    a.set(|k| k.healthy = false);
    until_down(&gw, "fake").await;
    until("level 1 in /ready", || async { ready(&gw).await["degradation_level"] == 1 }).await;
    assert_eq!(degradation_metric(&gw).await, 1.0);
    b.set(|k| k.healthy = false);
    until_down(&gw, "fake2").await;
    until("level 2 in /ready", || async { ready(&gw).await["degradation_level"] == 2 }).await;
    assert_eq!(degradation_metric(&gw).await, 2.0);
    gw.stop().await;
}

#[tokio::test]
async fn at_level_2_low_priority_work_is_deferred_and_urgent_work_takes_the_smaller_model() {
    let (a, b, small, gw) = degradable().await;
    a.set(|k| k.healthy = false);
    b.set(|k| k.healthy = false);
    until("level 2", || async { degradation_metric(&gw).await == 2.0 }).await;
    let mut low = body(false, json!({"allow_smaller_model": true}));
    low["priority"] = json!("P3");
    let (status, v) = call(&gw, DEMO_KEY, &low).await;
    assert_eq!(status, 503, "{v}");
    assert_eq!(error_code(&v), "QUEUE_FULL", "{v}");
    assert!(v["error"]["retry_after_ms"].as_u64().is_some(), "{v}");
    let mut urgent = body(false, json!({"allow_smaller_model": true}));
    urgent["priority"] = json!("P2");
    let (status, v) = call(&gw, DEMO_KEY, &urgent).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["edge"]["route"]["model"], "small-chat", "{v}");
    assert_eq!(small.requests(), 1, "only the P2 call reached the smaller model");
    gw.stop().await;
}

// A failed attempt is a reason to take the next step of the chain.

#[tokio::test]
async fn attempts_failing_on_the_only_instance_end_in_the_canned_answer() {
    let fake = FakeEngine::start_with(Knobs { fail_status: Some(500), ..Knobs::default() }).await;
    let gw = gateway(&fake.url(), "canned_answer = \"Busy; call the desk.\"", |t| t).await;
    gw.wait_ready().await;
    let (status, v) = call(&gw, DEMO_KEY, &chat_body(false)).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], "Busy; call the desk.", "{v}");
    let route = &v["edge"]["route"];
    assert_eq!(route["degraded"], true, "{route}");
    assert!(hop_steps(route).contains(&"canned".to_string()), "{route}");
    assert!(fake.requests() >= 1);
    gw.stop().await;
}

#[tokio::test]
async fn attempts_failing_on_the_main_model_fall_back_to_the_smaller_one() {
    let main = FakeEngine::start_with(Knobs { fail_status: Some(500), ..Knobs::default() }).await;
    let small = FakeEngine::start().await;
    let extra = format!(
        "fallback_models = [\"small-chat\"]\n{}\n[models.small-chat]\ninstances = [\"small\"]\ncontext_tokens = 2048\nmax_output_tokens = 256\n",
        engine("small", &small.url(), "small-model", "")
    );
    let gw = gateway(&main.url(), &extra, |t| t).await;
    gw.wait_ready().await;
    let (status, v) = call(&gw, DEMO_KEY, &body(false, json!({"allow_smaller_model": true}))).await;
    assert_eq!(status, 200, "{v}");
    let route = &v["edge"]["route"];
    assert_eq!(route["model"], "small-chat", "{route}");
    assert!(hop_steps(route).contains(&"smaller-model".to_string()), "{route}");
    assert_eq!(small.requests(), 1);
    gw.stop().await;
}

#[tokio::test]
async fn attempts_failing_locally_send_public_work_to_the_cloud() {
    let local = FakeEngine::start_with(Knobs { fail_status: Some(500), ..Knobs::default() }).await;
    let cloud = FakeEngine::start().await;
    let extra = format!(
        "{}\n[routing]\nallow_cloud = true\n",
        engine("cloud", &cloud.url(), "cloud-model", "location = \"cloud\"\nmax_data_class = \"public\"")
    );
    let gw =
        gateway(&local.url(), &extra, |t| t.replace("instances = [\"fake\"]", "instances = [\"fake\", \"cloud\"]"))
            .await;
    gw.wait_ready().await;
    let (status, v) = call(&gw, DEMO_KEY, &body(false, json!({"data_class": "public"}))).await;
    assert_eq!(status, 200, "{v}");
    let route = &v["edge"]["route"];
    assert_eq!(route["instance"], "cloud", "{route}");
    assert!(hop_steps(route).contains(&"cloud".to_string()), "{route}");
    assert_eq!(cloud.requests(), 1);
    gw.stop().await;
}

#[tokio::test]
async fn attempts_failing_locally_never_send_personal_work_to_the_cloud() {
    let local = FakeEngine::start_with(Knobs { fail_status: Some(500), ..Knobs::default() }).await;
    let cloud = FakeEngine::start().await;
    let extra = format!(
        "{}\n[routing]\nallow_cloud = true\n",
        engine("cloud", &cloud.url(), "cloud-model", "location = \"cloud\"\nmax_data_class = \"personal\"")
    );
    let gw =
        gateway(&local.url(), &extra, |t| t.replace("instances = [\"fake\"]", "instances = [\"fake\", \"cloud\"]"))
            .await;
    gw.wait_ready().await;
    for routing in [json!({"data_class": "sensitive"}), json!({"data_class": "secret"}), json!({"local_only": true})] {
        let (status, v) = call(&gw, DEMO_KEY, &body(false, routing.clone())).await;
        assert_ne!(status, 200, "{routing}: {v}");
        // Failing attempts (then the open breaker) end it locally.
        assert_ne!(v["edge"]["route"]["instance"], "cloud", "{routing}: {v}");
    }
    assert_eq!(cloud.requests(), 0, "nothing above the cloud's class reached it");
    assert!(local.requests() >= 3, "every call was tried locally");
    gw.stop().await;
}
