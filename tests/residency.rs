//! Model residency (FR-4.7) against the fake engine in llama-server router
//! mode (`GET /models`, `POST /models/load`, `POST /models/unload`, a
//! load that takes a set time): `on_demand` loads on first use and
//! unloads when idle, a one-model memory budget unloads the least recently
//! used model first, `restricted` and `forbidden` take the next routing
//! step or are refused, a load that would break a task's first-token
//! deadline sends it to the next instance, and `always` is loaded before
//! `/ready` answers 200.

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

/// A router-mode engine section serving `model` (the fake's router).
fn router_engine(name: &str, url: &str, model: &str, extra: &str) -> String {
    format!(
        "\n[engines.{name}]\ntype = \"openai\"\nbase_url = \"{url}\"\nmodel = \"{model}\"\nmodel_api = \"llama-router\"\n\
         health_interval_ms = 100\n{extra}\n"
    )
}

/// `general-chat` on the router-mode fake at `url` as `demo-a`, with the
/// model keys `model_keys`; `extra` adds sections.
async fn gateway(url: &str, model_keys: &str, extra: &str) -> TestGateway {
    let text = format!("{model_keys}\n{extra}");
    TestGateway::with_engine_edit(url, "openai", &text, |t| {
        t.replacen("model = \"fake-model\"", "model = \"demo-a\"\nmodel_api = \"llama-router\"", 1)
    })
    .await
}

fn router_fake(models: &[&str], load_ms: u64) -> Knobs {
    Knobs {
        router_models: models.iter().map(|m| m.to_string()).collect(),
        load_delay: Duration::from_millis(load_ms),
        ..Knobs::default()
    }
}

async fn call(gw: &TestGateway, key: &str, b: &Value) -> (u16, Value) {
    let resp = post_chat(gw, key, b).await;
    let status = resp.status().as_u16();
    let text = resp.text().await.unwrap();
    (status, serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}")))
}

fn chat(model: &str) -> Value {
    let mut b = chat_body(false);
    b["model"] = json!(model);
    b
}

async fn models(gw: &TestGateway) -> Value {
    get_json(gw, DEMO_KEY, "/v1/models").await
}

/// `(residency, state)` of `model` in `/v1/models`.
async fn residency_of(gw: &TestGateway, model: &str) -> (String, String) {
    let v = models(gw).await;
    let m = v["data"].as_array().unwrap().iter().find(|m| m["id"] == model).unwrap_or_else(|| panic!("{v}")).clone();
    (m["residency"].as_str().unwrap().to_string(), m["state"].as_str().unwrap().to_string())
}

async fn metrics_text(gw: &TestGateway) -> String {
    client().get(format!("{}/metrics", gw.base_url)).bearer_auth(OPS_KEY).send().await.unwrap().text().await.unwrap()
}

fn metric(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} ")))
        .filter(|l| labels.iter().all(|(k, v)| l.contains(&format!("{k}=\"{v}\""))))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
        .sum()
}

async fn has_event(fake: &FakeEngine, event: &str, within: Duration) -> bool {
    fake.wait_for(within, |s| s.model_events.lock().unwrap().iter().any(|e| e == event)).await
}

#[tokio::test]
async fn an_on_demand_model_loads_at_first_use_and_unloads_when_idle() {
    // The unload finishes in the background, as llama-server's does: the
    // model is listed `loaded` for a while after the unload was answered.
    let fake =
        FakeEngine::start_with(Knobs { unload_delay: Duration::from_millis(500), ..router_fake(&["demo-a"], 200) })
            .await;
    let gw = gateway(&fake.url(), "residency = \"on_demand\"\nidle_unload_s = 1", "").await;
    gw.wait_ready().await;
    assert_eq!(residency_of(&gw, "general-chat").await, ("on_demand".into(), "unloaded".into()));
    assert_eq!(fake.model_status("demo-a"), "unloaded", "not loaded before it is used");

    let (status, v) = call(&gw, DEMO_KEY, &chat("general-chat")).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(fake.model_events(), vec!["load demo-a"]);
    // The task's record says why it waited.
    let id = v["edge"]["task_id"].as_str().unwrap();
    let t: Value = get_json(&gw, DEMO_KEY, &format!("/v1/tasks/{id}")).await;
    let queued = t["transitions"].as_array().unwrap().iter().rev().find(|t| t["state"] == "QUEUED").unwrap();
    assert!(queued["reason"].as_str().unwrap().contains("loading: model not loaded, loading it"), "{t}");
    assert_eq!(fake.requests(), 1, "the generation was sent after the load, once");
    assert_eq!(residency_of(&gw, "general-chat").await.1, "loaded");

    assert!(has_event(&fake, "unload demo-a", Duration::from_secs(5)).await, "{:?}", fake.model_events());
    assert_eq!(fake.model_status("demo-a"), "unloaded");
    assert_eq!(residency_of(&gw, "general-chat").await.1, "unloaded");
    let m = metrics_text(&gw).await;
    assert_eq!(metric(&m, "edgeway_model_loads_total", &[("model", "general-chat"), ("result", "ok")]), 1.0, "{m}");
    assert_eq!(metric(&m, "edgeway_model_unloads_total", &[("model", "general-chat"), ("reason", "idle")]), 1.0, "{m}");
    assert_eq!(metric(&m, "edgeway_model_load_seconds_count", &[("model", "general-chat")]), 1.0, "{m}");
    assert_eq!(metric(&m, "edgeway_model_resident", &[("model", "general-chat")]), 0.0, "{m}");

    // Used again: loaded again (not taken for loaded by a probe that read
    // the list while the unload was still going on).
    let (status, v) = call(&gw, DEMO_KEY, &chat("general-chat")).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(fake.model_events(), vec!["load demo-a", "unload demo-a", "load demo-a"]);
    gw.stop().await;
}

#[tokio::test]
async fn a_task_waiting_for_its_model_to_load_is_queued_with_the_reason_loading() {
    // Before, it waited in DISPATCHING, and only that transition's reason
    // said why; its clients were told nothing.
    let fake = FakeEngine::start_with(router_fake(&["demo-a"], 700)).await;
    let gw = gateway(&fake.url(), "residency = \"on_demand\"\nidle_unload_s = 1", "").await;
    gw.wait_ready().await;
    let mut b = chat("general-chat");
    b["stream"] = json!(true);
    let resp = post_chat(&gw, DEMO_KEY, &b).await;
    assert_eq!(resp.status(), 200);
    let task_id = resp.headers()["x-task-id"].to_str().unwrap().to_string();
    let body = resp.text().await.unwrap();
    // The OpenAI stream shows the wait as a comment.
    assert!(body.contains(": queued position 0 (model loading, "), "{body}");
    assert!(body.contains("data: [DONE]"), "{body}");

    // The record: QUEUED with the reason "loading" after the slot was
    // granted, then DISPATCHING once the model was in.
    let t: Value = get_json(&gw, DEMO_KEY, &format!("/v1/tasks/{task_id}")).await;
    let tr = t["transitions"].as_array().unwrap();
    let states: Vec<&str> = tr.iter().map(|t| t["state"].as_str().unwrap()).collect();
    assert_eq!(
        states,
        ["RECEIVED", "VALIDATING", "QUEUED", "QUEUED", "DISPATCHING", "RUNNING", "STREAMING", "SUCCEEDED"],
        "{t}"
    );
    assert!(tr[3]["reason"].as_str().unwrap().starts_with("loading: model not loaded"), "{t}");
    let dispatching = tr[4]["reason"].as_str().unwrap();
    let ms: u64 = dispatching.strip_prefix("model loaded after ").unwrap().split(' ').next().unwrap().parse().unwrap();
    assert!(ms >= 600, "{dispatching}");

    // The task's events (as MQTT and NATS send them): a `queued` event with
    // the reason and the load time so far, valid against its schema.
    let resp =
        client().get(format!("{}/v1/tasks/{task_id}/events", gw.base_url)).bearer_auth(DEMO_KEY).send().await.unwrap();
    let (events, _) = read_sse(resp).await;
    let queued: Vec<&Value> = events.iter().filter(|e| e["type"] == "queued").collect();
    assert_eq!(queued.len(), 1, "{events:?}");
    assert_eq!((&queued[0]["reason"], &queued[0]["position"]), (&json!("loading"), &json!(0)), "{events:?}");
    assert!(queued[0]["loading_ms"].is_u64(), "{events:?}");
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("topics/schemas/event-queued.json");
    let schema: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    assert!(jsonschema::validator_for(&schema).unwrap().is_valid(queued[0]), "{}", queued[0]);

    // A second task that comes while the load runs joins it: its event
    // says how long the load has run so far, and it waits only the rest.
    assert!(has_event(&fake, "unload demo-a", Duration::from_secs(5)).await, "{:?}", fake.model_events());
    let mut rx = gw.recorder().subscribe();
    let first = tokio::spawn({
        let (base, b) = (gw.base_url.clone(), chat("general-chat"));
        async move {
            client().post(format!("{base}/v1/chat/completions")).bearer_auth(DEMO_KEY).json(&b).send().await.unwrap()
        }
    });
    let load_started = Instant::now();
    loop {
        let ev = rx.recv().await.unwrap();
        if ev.state == TaskState::Queued && ev.reason.starts_with("loading:") {
            break;
        }
    }
    let resp = post_chat(&gw, DEMO_KEY, &b).await;
    let second = resp.headers()["x-task-id"].to_str().unwrap().to_string();
    let body = resp.text().await.unwrap();
    assert!(body.contains(": queued position 0 (model loading, "), "{body}");
    assert_eq!(first.await.unwrap().status(), 200);
    let resp =
        client().get(format!("{}/v1/tasks/{second}/events", gw.base_url)).bearer_auth(DEMO_KEY).send().await.unwrap();
    let (events, _) = read_sse(resp).await;
    let e = events.iter().find(|e| e["type"] == "queued").unwrap();
    let so_far = e["loading_ms"].as_u64().unwrap();
    assert!(so_far as u128 <= load_started.elapsed().as_millis(), "{e}");
    let t: Value = get_json(&gw, DEMO_KEY, &format!("/v1/tasks/{second}")).await;
    let d =
        t["transitions"].as_array().unwrap().iter().find(|t| t["state"] == "DISPATCHING").unwrap()["reason"].clone();
    let waited: u64 =
        d.as_str().unwrap().strip_prefix("model loaded after ").unwrap().split(' ').next().unwrap().parse().unwrap();
    assert!(waited + so_far < 2 * 700, "one load, not two: {d} after {so_far} ms");
    assert_eq!(fake.model_events().iter().filter(|e| e.starts_with("load")).count(), 2, "{:?}", fake.model_events());
    gw.stop().await;
}

/// Review 14 L8 (d): `edgeway_tasks_running` counted a task from the
/// moment its slot was granted, so while it waited in QUEUED for its
/// model's load it was "running" too. Now it counts from DISPATCHING, as
/// the task's state says.
#[tokio::test]
async fn a_task_waiting_for_its_model_to_load_is_not_counted_running() {
    let knobs = Knobs { first_token_delay: Duration::from_millis(1500), ..router_fake(&["demo-a"], 1500) };
    let fake = FakeEngine::start_with(knobs).await;
    let gw = gateway(&fake.url(), "residency = \"on_demand\"", "").await;
    gw.wait_ready().await;
    let mut rx = gw.recorder().subscribe();
    let call = tokio::spawn({
        let (base, b) = (gw.base_url.clone(), chat("general-chat"));
        async move {
            client().post(format!("{base}/v1/chat/completions")).bearer_auth(DEMO_KEY).json(&b).send().await.unwrap()
        }
    });
    loop {
        let ev = rx.recv().await.unwrap();
        if ev.state == TaskState::Queued && ev.reason.starts_with("loading:") {
            break;
        }
    }
    let running = |m: &str| metric(m, "edgeway_tasks_running", &[("model", "general-chat")]);
    let m = metrics_text(&gw).await;
    assert!(fake.model_status("demo-a") != "loaded", "the load is still under way");
    assert_eq!(running(&m), 0.0, "a task waiting in QUEUED for a load is not running: {m}");
    // Counted once the model is in (DISPATCHING), until it ends.
    loop {
        let ev = rx.recv().await.unwrap();
        if ev.state == TaskState::Dispatching {
            assert!(ev.reason.starts_with("model loaded after"), "{}", ev.reason);
            break;
        }
    }
    assert_eq!(running(&metrics_text(&gw).await), 1.0);
    assert_eq!(call.await.unwrap().status(), 200);
    assert_eq!(running(&metrics_text(&gw).await), 0.0);
    gw.stop().await;
}

#[tokio::test]
async fn a_one_model_memory_budget_unloads_the_least_recently_used_model_first() {
    let fake = FakeEngine::start_with(router_fake(&["demo-a", "demo-b", "demo-c"], 50)).await;
    let budget = "memory_budget_mb = 100";
    let keys = "residency = \"on_demand\"\nweights_mb = 80\n";
    let extra = format!(
        "{}{}\n[models.chat-b]\ninstances = [\"fake-b\"]\ncontext_tokens = 2048\nmax_output_tokens = 256\nresidency = \"on_demand\"\nweights_mb = 80\n\
         [models.chat-c]\ninstances = [\"fake-c\"]\ncontext_tokens = 2048\nmax_output_tokens = 256\nresidency = \"on_demand\"\nweights_mb = 80\n",
        router_engine("fake-b", &fake.url(), "demo-b", budget),
        router_engine("fake-c", &fake.url(), "demo-c", budget),
    );
    let gw = TestGateway::with_engine_edit(&fake.url(), "openai", &format!("{keys}{extra}"), |t| {
        t.replacen("model = \"fake-model\"", &format!("model = \"demo-a\"\nmodel_api = \"llama-router\"\n{budget}"), 1)
    })
    .await;
    gw.wait_ready().await;
    for model in ["general-chat", "chat-b", "chat-c"] {
        let (status, v) = call(&gw, DEMO_KEY, &chat(model)).await;
        assert_eq!(status, 200, "{model}: {v}");
    }
    // Each load first unloaded the one model the budget holds.
    assert_eq!(
        fake.model_events(),
        vec!["load demo-a", "unload demo-a", "load demo-b", "unload demo-b", "load demo-c"],
        "the engine's own limit was not used (models_max = 0)"
    );
    let m = metrics_text(&gw).await;
    assert_eq!(metric(&m, "edgeway_model_unloads_total", &[("reason", "memory")]), 2.0, "{m}");
    assert_eq!(residency_of(&gw, "chat-b").await.1, "unloaded");
    assert_eq!(residency_of(&gw, "chat-c").await.1, "loaded");
    gw.stop().await;
}

/// Three router-mode models of 80 MB (`general-chat` as demo-a, `chat-b`,
/// `chat-c`) on one fake whose sections have the budget `budget_mb`;
/// `edit` changes the file's text further.
async fn three_models(fake: &FakeEngine, budget_mb: u32, edit: impl FnOnce(String) -> String) -> TestGateway {
    let budget = format!("memory_budget_mb = {budget_mb}");
    let keys = "residency = \"on_demand\"\nweights_mb = 80\n";
    let extra = format!(
        "{}{}\n[models.chat-b]\ninstances = [\"fake-b\"]\ncontext_tokens = 2048\nmax_output_tokens = 256\nresidency = \"on_demand\"\nweights_mb = 80\n\
         [models.chat-c]\ninstances = [\"fake-c\"]\ncontext_tokens = 2048\nmax_output_tokens = 256\nresidency = \"on_demand\"\nweights_mb = 80\n",
        router_engine("fake-b", &fake.url(), "demo-b", &budget),
        router_engine("fake-c", &fake.url(), "demo-c", &budget),
    );
    let gw = TestGateway::with_engine_edit(&fake.url(), "openai", &format!("{keys}{extra}"), |t| {
        edit(t.replacen(
            "model = \"fake-model\"",
            &format!("model = \"demo-a\"\nmodel_api = \"llama-router\"\n{budget}"),
            1,
        ))
    })
    .await;
    gw.wait_ready().await;
    gw
}

fn chat_at(model: &str, priority: &str) -> Value {
    let mut b = chat(model);
    b["priority"] = json!(priority);
    b
}

/// Issue 11, priority-aware eviction: with room for two models, a load
/// for P1 work unloads the model of P3 work, not the least recently used
/// one (the model of P1 work). Failed before: "unload demo-a" (LRU only).
#[tokio::test]
async fn a_load_for_p1_work_unloads_the_model_of_p3_work_before_an_older_one_of_p1_work() {
    let fake = FakeEngine::start_with(router_fake(&["demo-a", "demo-b", "demo-c"], 50)).await;
    let gw = three_models(&fake, 200, |t| t).await;
    for (model, p) in [("general-chat", "P1"), ("chat-b", "P3"), ("chat-c", "P1")] {
        let (status, v) = call(&gw, DEMO_KEY, &chat_at(model, p)).await;
        assert_eq!(status, 200, "{model}: {v}");
    }
    assert_eq!(fake.model_events(), vec!["load demo-a", "load demo-b", "unload demo-b", "load demo-c"]);
    assert_eq!(residency_of(&gw, "general-chat").await.1, "loaded", "the model of P1 work stays");
    let m = metrics_text(&gw).await;
    assert_eq!(metric(&m, "edgeway_model_unloads_total", &[("reason", "memory")]), 1.0, "{m}");
    gw.stop().await;
}

/// Issue 11, priority-aware eviction: a model with P1 work queued is not
/// unloaded for P3 work, even while it is idle between two P1 tasks (one
/// slot); the P3 task waits and is served after. Failed before: the model
/// went idle after the first P1 task and was unloaded for the P3 load, so
/// the queued P1 task loaded it again.
#[tokio::test]
async fn a_model_with_queued_p1_work_is_not_unloaded_for_p3_work() {
    let knobs = Knobs {
        tokens: 10,
        token_delay: Duration::from_millis(30),
        ..router_fake(&["demo-a", "demo-b", "demo-c"], 50)
    };
    let fake = FakeEngine::start_with(knobs).await;
    let gw = three_models(&fake, 100, |t| t.replacen("max_concurrency = 2", "max_concurrency = 1", 1)).await;
    let (base, p1) = (gw.base_url.clone(), chat_at("general-chat", "P1"));
    let send = |body: Value| {
        let base = base.clone();
        tokio::spawn(async move {
            let r = client()
                .post(format!("{base}/v1/chat/completions"))
                .bearer_auth(DEMO_KEY)
                .json(&body)
                .send()
                .await
                .unwrap();
            r.status().as_u16()
        })
    };
    let first = send(p1.clone());
    assert!(fake.wait_for(Duration::from_secs(10), |s| s.active.load(std::sync::atomic::Ordering::SeqCst) >= 1).await);
    let second = send(p1);
    let queued = Instant::now();
    while metric(&metrics_text(&gw).await, "edgeway_queue_depth", &[("model", "general-chat"), ("priority", "P1")])
        < 1.0
    {
        assert!(queued.elapsed() < Duration::from_secs(10), "the second P1 task queues behind the first");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (status, v) = call(&gw, DEMO_KEY, &chat_at("chat-b", "P3")).await;
    assert_eq!(status, 200, "the P3 task is served after the P1 work: {v}");
    assert_eq!((first.await.unwrap(), second.await.unwrap()), (200, 200));
    assert_eq!(
        fake.model_events(),
        vec!["load demo-a", "unload demo-a", "load demo-b"],
        "demo-a stayed loaded for both P1 tasks"
    );
    gw.stop().await;
}

#[tokio::test]
async fn a_restricted_model_serves_only_the_work_it_is_restricted_to() {
    let fake = FakeEngine::start_with(router_fake(&["demo-a"], 0)).await;
    let keys = "residency = \"restricted\"\nrestricted_to = { applications = [\"ops\"] }";
    let gw = gateway(&fake.url(), keys, "").await;
    gw.wait_ready().await;
    assert_eq!(residency_of(&gw, "general-chat").await, ("restricted".into(), "unloaded".into()));

    let (status, v) = call(&gw, DEMO_KEY, &chat("general-chat")).await;
    assert_eq!(status, 403, "{v}");
    assert_eq!(error_code(&v), "POLICY_BLOCKED", "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("restricted on this node to applications [ops]"), "{v}");
    assert!(fake.model_events().is_empty(), "not loaded for the wrong application");

    let (status, v) = call(&gw, OPS_KEY, &chat("general-chat")).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(fake.model_events(), vec!["load demo-a"]);
    gw.stop().await;
}

#[tokio::test]
async fn a_forbidden_model_is_never_loaded_and_takes_the_next_routing_step() {
    let fake = FakeEngine::start_with(router_fake(&["demo-a"], 0)).await;
    let edge = FakeEngine::start().await;
    let extra = format!(
        "\n[engines.edge]\ntype = \"openai\"\nbase_url = \"{}\"\nmodel = \"fake-model\"\nlocation = \"edge-node\"\n",
        edge.url()
    );
    let gw =
        TestGateway::with_engine_edit(&fake.url(), "openai", &format!("residency = \"forbidden\"\n{extra}"), |t| {
            t.replacen("model = \"fake-model\"", "model = \"demo-a\"\nmodel_api = \"llama-router\"", 1)
                .replace("instances = [\"fake\"]", "instances = [\"fake\", \"edge\"]")
        })
        .await;
    gw.wait_ready().await;
    assert_eq!(residency_of(&gw, "general-chat").await, ("forbidden".into(), "forbidden".into()));
    let (status, v) = call(&gw, DEMO_KEY, &chat("general-chat")).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["edge"]["route"]["instance"], "edge", "{v}");
    assert_eq!(edge.requests(), 1);
    assert_eq!(fake.requests(), 0);
    assert!(fake.model_events().is_empty(), "never loaded here");
    gw.stop().await;

    // With no other step, it is refused with a stable code.
    let gw = gateway(&fake.url(), "residency = \"forbidden\"", "").await;
    gw.wait_ready().await;
    let (status, v) = call(&gw, DEMO_KEY, &chat("general-chat")).await;
    assert_eq!(status, 403, "{v}");
    assert_eq!(error_code(&v), "POLICY_BLOCKED", "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("forbidden on this node"), "{v}");
    assert!(fake.model_events().is_empty(), "never loaded here");
    gw.stop().await;
}

#[tokio::test]
async fn a_load_that_would_break_the_first_token_deadline_sends_the_task_to_the_next_instance() {
    let slow = FakeEngine::start_with(router_fake(&["demo-a"], 1500)).await;
    let quick = FakeEngine::start_with(router_fake(&["demo-b"], 0)).await;
    let extra = router_engine("fake2", &quick.url(), "demo-b", "");
    let gw = TestGateway::with_engine_edit(
        &slow.url(),
        "openai",
        &format!("residency = \"on_demand\"\nidle_unload_s = 1\n{extra}"),
        |t| {
            t.replacen("model = \"fake-model\"", "model = \"demo-a\"\nmodel_api = \"llama-router\"", 1)
                .replace("instances = [\"fake\"]", "instances = [\"fake\", \"fake2\"]")
        },
    )
    .await;
    gw.wait_ready().await;
    // The first load of the slow one is waited for (nothing to estimate
    // from), then it goes idle and is unloaded.
    let (status, v) = call(&gw, DEMO_KEY, &chat("general-chat")).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["edge"]["route"]["instance"], "fake", "{v}");
    assert!(has_event(&slow, "unload demo-a", Duration::from_secs(5)).await, "{:?}", slow.model_events());

    // Its next load takes about 1.5 s again; a task due in 800 ms goes on.
    let mut b = chat("general-chat");
    b["timeouts"] = json!({"first_token_ms": 800});
    let started = std::time::Instant::now();
    let (status, v) = call(&gw, DEMO_KEY, &b).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["edge"]["route"]["instance"], "fake2", "{v}");
    assert!(started.elapsed() < Duration::from_millis(1200), "it did not wait for the load: {:?}", started.elapsed());
    assert_eq!(slow.requests(), 1, "no generation reached the loading engine");
    // The load went on for the tasks after.
    assert!(has_event(&slow, "load demo-a", Duration::from_secs(5)).await);
    assert!(
        slow.wait_for(Duration::from_secs(5), |s| s.model_events.lock().unwrap().len() == 3).await,
        "{:?}",
        slow.model_events()
    );
    gw.stop().await;
}

#[tokio::test]
async fn an_always_model_is_loaded_before_ready_answers_200() {
    let fake = FakeEngine::start_with(router_fake(&["demo-a"], 800)).await;
    let gw = gateway(&fake.url(), "", "").await;
    let ready = |gw: &TestGateway| {
        let url = format!("{}/ready", gw.base_url);
        async move {
            let r = client().get(url).bearer_auth(OPS_KEY).send().await.unwrap();
            (r.status().as_u16(), r.json::<Value>().await.unwrap())
        }
    };
    let (status, v) = ready(&gw).await;
    assert_eq!(status, 503, "not ready while the model loads: {v}");
    assert!(v.to_string().contains("model general-chat is not loaded on fake"), "{v}");
    let mut waited = 0;
    loop {
        let (status, v) = ready(&gw).await;
        if status == 200 {
            assert_eq!(fake.model_status("demo-a"), "loaded", "{v}");
            break;
        }
        waited += 1;
        assert!(waited < 500, "never ready: {v}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(residency_of(&gw, "general-chat").await, ("always".into(), "loaded".into()));

    // The engine dropped it (a crash, an operator): loaded again.
    client().post(format!("{}/models/unload", fake.url())).json(&json!({"model": "demo-a"})).send().await.unwrap();
    assert!(
        fake.wait_for(Duration::from_secs(5), |s| s.model_events.lock().unwrap().len() == 3).await,
        "{:?}",
        fake.model_events()
    );
    assert_eq!(fake.model_events(), vec!["load demo-a", "unload demo-a", "load demo-a"]);
    gw.stop().await;
}

/// The adapter of engine `fake` in a config around `url` of `kind` with
/// `model_api`.
fn adapter(url: &str, kind: &str, api: &str, model: &str) -> std::sync::Arc<dyn edgeway::engine::Engine> {
    let dir = std::path::Path::new("/tmp/edgeway-residency-adapter");
    let text = edgeway::testing::config_toml(url, kind, dir, "").replacen(
        "health_interval_ms = 100",
        &format!("health_interval_ms = 100\nmodel_api = \"{api}\""),
        1,
    );
    let text = text.replacen("model = \"fake-model\"", &format!("model = \"{model}\""), 1);
    let cfg = edgeway::config::Config::from_toml_str(&text, std::iter::empty(), std::path::Path::new(".")).unwrap();
    edgeway::engine::build(&cfg.engines["fake"]).unwrap()
}

#[tokio::test]
async fn the_llama_router_adapter_loads_lists_and_unloads_through_the_engine_api() {
    use edgeway::engine::residency::ModelState;
    let fake = FakeEngine::start_with(router_fake(&["demo-a"], 300)).await;
    let e = adapter(&fake.url(), "openai", "llama-router", "demo-a");
    assert_eq!(e.model_state().await.unwrap().unwrap(), ModelState::Unloaded);
    let h = e.health().await;
    assert!(h.up && h.model_resident == Some(false), "{h:?}");
    let started = std::time::Instant::now();
    e.load_model().await.unwrap();
    assert!(started.elapsed() >= Duration::from_millis(300), "returned once loaded, not when asked");
    assert_eq!(fake.model_status("demo-a"), "loaded");
    assert_eq!(e.health().await.model_resident, Some(true));
    e.load_model().await.expect("a loaded model loads at once");
    e.unload_model().await.unwrap();
    assert_eq!(fake.model_status("demo-a"), "unloaded");
    e.unload_model().await.expect("unloading an unloaded model is no error");
    assert_eq!(fake.model_events(), vec!["load demo-a", "unload demo-a"]);

    fake.set(|k| k.load_fails = true);
    assert!(e.load_model().await.is_err(), "a failed load is an error");
    // A model the router does not have is an error, not "unloaded".
    let missing = adapter(&fake.url(), "openai", "llama-router", "nope");
    assert!(missing.model_state().await.unwrap().is_err());
    // Without model_api the adapter has no say.
    assert!(adapter(&fake.url(), "openai", "none", "demo-a").model_state().await.is_none());
}

#[tokio::test]
async fn the_ollama_adapter_loads_with_an_empty_generate_and_unloads_with_keep_alive_0() {
    use edgeway::engine::residency::ModelState;
    let fake = FakeEngine::start_with(Knobs { resident: false, ..Knobs::default() }).await;
    let e = adapter(&fake.url(), "ollama", "ollama", "fake");
    assert_eq!(e.model_state().await.unwrap().unwrap(), ModelState::Unloaded);
    e.load_model().await.unwrap();
    let sent = fake.stats.last_request.lock().unwrap().clone();
    assert_eq!(e.model_state().await.unwrap().unwrap(), ModelState::Loaded);
    e.unload_model().await.unwrap();
    assert_eq!(e.model_state().await.unwrap().unwrap(), ModelState::Unloaded);
    assert_eq!(fake.model_events(), vec!["load fake", "unload fake"]);
    assert_eq!(fake.requests(), 0, "no generation ran: {sent:?}");
    assert_eq!(*fake.stats.posts.lock().unwrap(), vec!["/api/generate", "/api/generate"]);
}

/// Review 15 M3: with room for one model, two loads asked for at once on
/// one server do not wait on each other: one loads, its task runs, then
/// it is unloaded for the other. Before, each load counted the other
/// (`loading`) as used and in use, and both waited up to the load limit
/// (300 s).
#[tokio::test]
async fn two_loads_at_once_with_room_for_one_take_turns_instead_of_waiting_on_each_other() {
    let fake = FakeEngine::start_with(router_fake(&["demo-a", "demo-b", "demo-c"], 200)).await;
    let gw = three_models(&fake, 100, |t| t).await;
    let (a, b) = (chat("general-chat"), chat("chat-b"));
    let both = async { tokio::join!(call(&gw, DEMO_KEY, &a), call(&gw, DEMO_KEY, &b)) };
    let ((sa, va), (sb, vb)) =
        tokio::time::timeout(Duration::from_secs(20), both).await.expect("both loads were done within 20 s");
    assert_eq!((sa, sb), (200, 200), "{va} {vb}");
    let events = fake.model_events();
    assert_eq!(events.iter().filter(|e| e.starts_with("load")).count(), 2, "{events:?}");
    assert_eq!(events.iter().filter(|e| e.starts_with("unload")).count(), 1, "{events:?}");
    gw.stop().await;
}
