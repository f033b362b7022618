//! Forwarding between the nodes of a pool (issue 15) on loopback: a real
//! `nats-server` with JetStream (the node registry), two edgeway nodes with
//! fake engines. Node A's own engine is down and its `pool` instance
//! forwards to node B: the answer streams back to A's client, both records
//! name the other node, a client that leaves A cancels B's engine request,
//! a class above B's `max_data_class` (or `local_only`) is never forwarded,
//! and a forward not signed with the pool's key is refused. A node killed
//! with SIGKILL mid-task: its running forward ends with a clear error, the
//! one it had only queued runs on a third node, and nothing runs twice.
//! Store and forward: with every engine of the pool down, a device's P4
//! requests wait in the pool's work queue and run exactly once each (a
//! redelivered and a duplicated message included, and one claimed by a node
//! that left; one nobody waits for runs never) when an engine returns,
//! and the device that was away meanwhile reads every answer.

mod common;
mod mqtt_support;

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering::SeqCst;
use std::time::{Duration, Instant};

use common::*;
use edgeway::config::Config;
use edgeway::testing::{config_toml, NatsServer, TempDir};
use futures::StreamExt;
use serde_json::{json, Value};

const KEY_ENV: &str = "EDGEWAY_TEST_POOL_KEY";
const KEY: &str = "a-test-key-of-the-pool-0123456789abcdef";

/// The configuration of node `id` on `nats`, with `fake` as its engine;
/// `pool`: with a pool instance after it in `general-chat`'s instances;
/// `more` TOML at its end.
fn node_config(
    tmp: &TempDir,
    nats: &str,
    id: &str,
    max_class: &str,
    fake: &FakeEngine,
    pool: bool,
    more: &str,
) -> String {
    let pool_engine = if pool {
        "[engines.pool]\ntype = \"pool\"\nmodel = \"general-chat\"\nmax_concurrency = 4\nhealth_interval_ms = 100\n"
    } else {
        ""
    };
    let extra = format!(
        "[nats]\nurl = \"{nats}\"\nkeepalive_ms = 200\n[nats.jetstream]\nstorage = \"memory\"\n\
         [cluster]\nzone = \"site-1\"\nmax_data_class = \"{max_class}\"\nheartbeat_ms = 200\nkey_env = \"{KEY_ENV}\"\n\
         work_ack_wait_ms = 1000\n{pool_engine}{more}"
    );
    let mut text = config_toml(&fake.url(), "openai", &tmp.0, &extra)
        .replace("node_id = \"test-node\"", &format!("node_id = \"{id}\""));
    if pool {
        text = text.replace("instances = [\"fake\"]", "instances = [\"fake\", \"pool\"]");
    }
    text
}

/// Node `id` in this process (see [`node_config`]).
async fn node(nats: &str, id: &str, max_class: &str, fake: &FakeEngine, pool: bool) -> (TempDir, TestGateway) {
    let (tmp, gw) = node_with(nats, id, max_class, fake, pool, "").await;
    if !pool {
        gw.wait_ready().await;
    }
    (tmp, gw)
}

/// Node `id` in this process with `more` TOML, not waited for.
async fn node_with(
    nats: &str,
    id: &str,
    max_class: &str,
    fake: &FakeEngine,
    pool: bool,
    more: &str,
) -> (TempDir, TestGateway) {
    let tmp = TempDir::new("edgeway-fwd");
    let text = node_config(&tmp, nats, id, max_class, fake, pool, more);
    let env = vec![(KEY_ENV.to_string(), KEY.to_string())];
    let config = Config::from_toml_str(&text, env, Path::new(".")).unwrap_or_else(|e| panic!("{e}\n{text}"));
    (tmp, TestGateway::start(config).await)
}

/// Waits until `gw` sees `peer` in the pool and its pool instance is up.
async fn sees(gw: &TestGateway, peer: &str) {
    let start = Instant::now();
    loop {
        let v = get_json(gw, OPS_KEY, "/v1/nodes").await;
        let there = v["data"].as_array().is_some_and(|l| l.iter().any(|n| n["node_id"] == peer));
        let ready = get_json(gw, OPS_KEY, "/ready").await;
        let up = ready.to_string().contains("node(s) serve");
        if there && up {
            return;
        }
        assert!(start.elapsed() < Duration::from_secs(20), "{peer} never seen: {v} {ready}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn body(extra: Value) -> Value {
    let mut b = json!({"model": "general-chat", "messages": [{"role": "user", "content": "ping"}]});
    b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    b
}

async fn reasons(gw: &TestGateway, task_id: &str) -> Vec<String> {
    gw.store().flush().await;
    let rec = gw.store().get(task_id).await.unwrap().unwrap_or_else(|| panic!("task {task_id} not stored"));
    rec.transitions.iter().map(|t| format!("{} {}", t.state.as_str(), t.reason)).collect()
}

/// The task id on B that A's record names ("forwarded to node B, task X").
fn remote_task(reasons: &[String], node: &str) -> String {
    let marker = format!("forwarded to node {node}, task ");
    let r = reasons.iter().find_map(|r| r.split(&marker).nth(1)).unwrap_or_else(|| panic!("no forward in {reasons:?}"));
    r.split(|c: char| c == ';' || c.is_whitespace()).next().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_task_is_forwarded_streamed_back_and_cancelled_across_nodes() {
    let nats = NatsServer::start(true).await;
    let fa = FakeEngine::start_with(Knobs { healthy: false, ..Knobs::default() }).await;
    let fb = FakeEngine::start_with(Knobs { echo: true, tokens: 3, ..Knobs::default() }).await;
    let (_tb, b) = node(&nats.url(), "node-b", "sensitive", &fb, false).await;
    let (_ta, a) = node(&nats.url(), "node-a", "sensitive", &fa, true).await;
    sees(&a, "node-b").await;
    // A's record offers no slots of its own: its pool instance's are B's.
    let me = get_json(&a, OPS_KEY, "/v1/nodes").await["data"][0].clone();
    assert_eq!((me["self"].as_bool(), me["free_slots"].as_u64()), (Some(true), Some(0)), "{me}");

    // A whole answer: B's engine answered A's client, with A's prompt.
    let resp = post_chat(&a, DEMO_KEY, &body(json!({}))).await;
    assert_eq!(resp.status(), 200);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], "ping ping ping ", "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 3, "{v}");
    assert_eq!((fa.requests(), fb.requests()), (0, 1));
    assert_eq!(v["edge"]["route"]["instance"], "pool", "{v}");

    // Both records name the other node.
    let a_task = v["edge"]["task_id"].as_str().unwrap().to_string();
    let on_a = reasons(&a, &a_task).await;
    let b_task = remote_task(&on_a, "node-b");
    let on_b = reasons(&b, &b_task).await;
    assert!(on_b.iter().any(|r| r.contains(&format!("forwarded from node node-a, task {a_task}"))), "{on_b:?}");
    let rec = b.store().get(&b_task).await.unwrap().unwrap();
    assert_eq!((rec.request_id.as_str(), rec.application.as_str()), (a_task.as_str(), "demo"));
    // The tenant's tokens are charged once in the pool: on node A, which
    // its caller called.
    let spent = |gw: &TestGateway| {
        let views = gw.store().budgets().view("demo", edgeway::task::now_ms());
        views.iter().find(|v| v.scope == "tenant" && v.window == "daily").map_or(0, |v| v.spent_tokens)
    };
    assert!(spent(&a) > 0);
    assert_eq!(spent(&b), 0);

    // A stream, then the client leaves A: B's engine request is cancelled.
    fb.set(|k| {
        k.tokens = 400;
        k.token_delay = Duration::from_millis(20);
    });
    let resp = post_chat(&a, DEMO_KEY, &body(json!({"stream": true}))).await;
    assert_eq!(resp.status(), 200);
    let mut stream = resp.bytes_stream();
    let mut seen = String::new();
    while !seen.contains("ping") {
        seen.push_str(&String::from_utf8_lossy(&stream.next().await.unwrap().unwrap()));
    }
    let left = Instant::now();
    drop(stream);
    assert!(fb.wait_for(Duration::from_secs(5), |s| s.aborted.load(SeqCst) >= 1).await);
    eprintln!("client left node A; node B's engine request ended {:?} later", left.elapsed());
    assert!(fb.wait_for(Duration::from_secs(5), |s| s.active.load(SeqCst) == 0).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn data_goes_only_where_its_class_may_and_only_signed_forwards_run() {
    let nats = NatsServer::start(true).await;
    let fa = FakeEngine::start_with(Knobs { healthy: false, ..Knobs::default() }).await;
    let fb = FakeEngine::start().await;
    // B may receive personal data at most.
    let (_tb, _b) = node(&nats.url(), "node-b", "personal", &fb, false).await;
    let (_ta, a) = node(&nats.url(), "node-a", "sensitive", &fa, true).await;
    sees(&a, "node-b").await;

    // Sensitive, secret and local-only calls are never forwarded to B.
    for extra in [
        json!({"routing": {"data_class": "sensitive"}}),
        json!({"routing": {"data_class": "secret"}}),
        json!({"routing": {"local_only": true, "data_class": "public"}}),
    ] {
        let resp = post_chat(&a, DEMO_KEY, &body(extra.clone())).await;
        let status = resp.status();
        let v: Value = resp.json().await.unwrap();
        assert!(!status.is_success(), "{extra}: {v}");
        assert_eq!(error_code(&v), "MODEL_UNAVAILABLE", "{extra}: {v}");
    }
    assert_eq!(fb.requests(), 0, "nothing above B's class reached it");
    // Personal data may go.
    let resp = post_chat(&a, DEMO_KEY, &body(json!({"routing": {"data_class": "personal"}}))).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(fb.requests(), 1);

    // A client may not claim a forward.
    let resp = post_chat(&a, DEMO_KEY, &body(json!({"routing": {"forwarded_from": "node-x"}}))).await;
    assert_eq!(resp.status(), 400);

    // A bus client without the pool's key cannot make B run anything.
    let client = async_nats::connect(nats.url()).await.unwrap();
    let mut h = async_nats::HeaderMap::new();
    for (k, v) in [
        ("Edgeway-Origin-Node", "node-x"),
        ("Edgeway-Origin-Task", "t1"),
        ("Edgeway-Tenant", "demo"),
        ("Edgeway-App", "ops"),
        ("Edgeway-Time", "0"),
        ("Edgeway-Signature", "00"),
    ] {
        h.insert(k, v);
    }
    let payload = serde_json::to_vec(&body(json!({"routing": {"data_class": "public"}}))).unwrap();
    let msg = client.request_with_headers("ai.v1.node.node-b.chat", h, payload.into()).await.unwrap();
    let answer: Value = serde_json::from_slice(&msg.payload).unwrap();
    assert_eq!(answer["code"], "AUTH_FAILED", "{answer}");
    assert_eq!(fb.requests(), 1, "the forged forward ran nothing");
}

/// Kills the child on drop (a test that fails midway leaves no node).
struct Proc(std::process::Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `queue_depth` of `peer` as `gw` sees it.
async fn queue_depth(gw: &TestGateway, peer: &str) -> u64 {
    let v = get_json(gw, OPS_KEY, "/v1/nodes").await;
    let list = v["data"].as_array().cloned().unwrap_or_default();
    list.iter().find(|n| n["node_id"] == peer).and_then(|n| n["queue_depth"].as_u64()).unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_killed_mid_task_ends_its_running_forward_and_its_queued_one_runs_elsewhere() {
    let nats = NatsServer::start(true).await;
    let fa = FakeEngine::start_with(Knobs { healthy: false, ..Knobs::default() }).await;
    let fb = FakeEngine::start_with(Knobs::slow(2000, 20)).await;
    let fc = FakeEngine::start().await;
    // Node B: a real process, one engine slot (a second task queues there).
    let tb = TempDir::new("edgeway-fwd-b");
    let text = node_config(&tb, &nats.url(), "node-b", "sensitive", &fb, false, "")
        .replace("max_concurrency = 2", "max_concurrency = 1");
    let path = tb.0.join("node-b.toml");
    std::fs::write(&path, text).unwrap();
    let mut b = Proc(
        Command::new(env!("CARGO_BIN_EXE_edgeway"))
            .args(["serve", "--config"])
            .arg(&path)
            .env(KEY_ENV, KEY)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let (_ta, a) = node(&nats.url(), "node-a", "sensitive", &fa, true).await;
    sees(&a, "node-b").await;

    // R1 runs on B (its first token reached A's client); R2 waits in B's queue.
    let resp = post_chat(&a, DEMO_KEY, &body(json!({"stream": true}))).await;
    assert_eq!(resp.status(), 200);
    let mut r1 = resp.bytes_stream();
    let mut r1_text = String::new();
    while !r1_text.contains("tok") {
        r1_text.push_str(&String::from_utf8_lossy(&r1.next().await.unwrap().unwrap()));
    }
    let a2 = a.base_url.clone();
    let r2 = tokio::spawn(async move {
        let resp = client()
            .post(format!("{a2}/v1/chat/completions"))
            .bearer_auth(DEMO_KEY)
            .json(&body(json!({})))
            .send()
            .await
            .unwrap();
        (resp.status(), resp.json::<Value>().await.unwrap())
    });
    let start = Instant::now();
    while queue_depth(&a, "node-b").await < 1 {
        assert!(start.elapsed() < Duration::from_secs(10), "R2 never queued on node B");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Node C joins; then B dies without a word.
    let (_tc, _c) = node(&nats.url(), "node-c", "sensitive", &fc, false).await;
    sees(&a, "node-c").await;
    let killed = Instant::now();
    b.0.kill().unwrap();
    b.0.wait().unwrap();

    // R1: a clear error on A's stream, the output so far kept.
    while let Some(chunk) = r1.next().await {
        r1_text.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
    }
    eprintln!("node B killed; R1's stream ended {:?} later", killed.elapsed());
    assert!(r1_text.contains("the node this task was forwarded to failed or vanished"), "{r1_text}");
    assert!(r1_text.contains("INTERNAL_ERROR"), "{r1_text}");
    // R2: never started on B, it ran on C, once.
    let (status, v) = r2.await.unwrap();
    eprintln!("R2 answered {:?} after B was killed", killed.elapsed());
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], "tok tok tok tok tok ", "{v}");
    assert_eq!((fb.requests(), fc.requests()), (1, 1), "each task reached one engine once");
    let on_a = reasons(&a, v["edge"]["task_id"].as_str().unwrap()).await;
    assert!(on_a.iter().any(|r| r.contains("node-c")), "{on_a:?}");
}

/// Waits until `gw`'s pool instance only queues (no node serves the model)
/// and, when given, `gw` sees node `peer`.
async fn queues_only(gw: &TestGateway, peer: Option<&str>) {
    let start = Instant::now();
    loop {
        let nodes = get_json(gw, OPS_KEY, "/v1/nodes").await;
        let ready = get_json(gw, OPS_KEY, "/ready").await.to_string();
        let seen = peer.is_none_or(|p| nodes["data"].as_array().is_some_and(|l| l.iter().any(|n| n["node_id"] == p)));
        if seen && ready.contains("waits in the pool's work queue") {
            return;
        }
        assert!(start.elapsed() < Duration::from_secs(20), "{nodes} {ready}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Store and forward, through a device on node A's embedded broker.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn device_work_waits_in_the_pool_queue_and_runs_exactly_once_when_an_engine_returns() {
    use async_nats::jetstream::{self, consumer::pull};
    use mqtt_support::{device, D1, V};

    let nats = NatsServer::start(true).await;
    let fa = FakeEngine::start_with(Knobs { healthy: false, ..Knobs::default() }).await;
    let fb = FakeEngine::start_with(Knobs { healthy: false, echo: true, tokens: 3, ..Knobs::default() }).await;
    // B's engine is down long enough to open its breaker: a short
    // cool-down lets it take work soon after it is back.
    let (_tb, b) =
        node_with(&nats.url(), "node-b", "sensitive", &fb, false, "[routing.breaker]\ncooldown_ms = 1000\n").await;
    let mqtt = mqtt_support::mqtt_toml("coalesce_ms = 0\ndisconnect_grace_ms = 60000");
    let (_ta, a) = node_with(&nats.url(), "node-a", "sensitive", &fa, true, &mqtt).await;
    // A sees B, which serves nothing now; A's pool instance only queues.
    queues_only(&a, Some("node-b")).await;

    let addr = a.running.as_ref().unwrap().mqtt.expect("mqtt").mqtt;
    let mut d = device(addr, V::V5, D1).await;
    d.subscribe(&d.topic("res/#")).await;
    let queued = || mqtt_support::metric(&a, "pool_work_total{outcome=\"queued\"}").unwrap_or(0.0);
    let bus = async_nats::connect(nats.url()).await.unwrap();
    let js = jetstream::new(bus);
    // A device that cancels a waiting request takes it out of the queue.
    let mut req = mqtt_support::request("changed-my-mind");
    req["priority"] = json!("P4");
    req["timeouts"] = json!({"queue_ms": 60000, "first_token_ms": 60000, "total_ms": 120000});
    d.publish(&d.topic("req"), req.to_string()).await;
    let start = Instant::now();
    while queued() < 1.0 {
        assert!(start.elapsed() < Duration::from_secs(20), "queued {}", queued());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut stream = js.get_stream("edgeway_work").await.unwrap();
    let first = stream.info().await.unwrap().state.first_sequence;
    let orphan = stream.get_raw_message(first).await.unwrap();
    d.publish(&d.topic("cancel"), json!({"request_id": "changed-my-mind"}).to_string()).await;
    let events = d.stream(&d.topic("res/changed-my-mind")).await;
    assert_eq!(events.last().unwrap()["code"], "REQUEST_CANCELLED", "{events:?}");
    let start = Instant::now();
    while stream.info().await.unwrap().state.messages != 0 {
        assert!(start.elapsed() < Duration::from_secs(10), "the cancelled request stayed in the queue");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A request whose own (lowered) first-token limit passes while it waits
    // in the queue times out, without a retry, and leaves the queue.
    let mut req = mqtt_support::request("too-late");
    req["priority"] = json!("P4");
    req["timeouts"] = json!({"queue_ms": 1000, "first_token_ms": 1000, "total_ms": 120000});
    d.publish(&d.topic("req"), req.to_string()).await;
    let events = d.stream(&d.topic("res/too-late")).await;
    assert_eq!(events.last().unwrap()["code"], "FIRST_TOKEN_TIMEOUT", "{events:?}");
    let start = Instant::now();
    while stream.info().await.unwrap().state.messages != 0 {
        assert!(start.elapsed() < Duration::from_secs(10), "the timed-out request stayed in the queue");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let too_late = events[0]["task_id"].as_str().unwrap().to_string();
    let attempts = reasons(&a, &too_late).await.iter().filter(|r| r.starts_with("DISPATCHING")).count();
    assert_eq!(attempts, 1, "{:?}", reasons(&a, &too_late).await);
    // The device asks four P4 questions; each is accepted by node A.
    let ids: Vec<String> = (0..4).map(|i| format!("batch-{i}")).collect();
    for id in &ids {
        let mut req = mqtt_support::request(id);
        req["priority"] = json!("P4");
        req["timeouts"] = json!({"queue_ms": 60000, "first_token_ms": 60000, "total_ms": 120000});
        d.publish(&d.topic("req"), req.to_string()).await;
    }
    let mut accepted = 0;
    while accepted < ids.len() {
        let v = d.msg().await.json();
        assert_ne!(v["type"], "error", "{v}");
        accepted += usize::from(v["type"] == "accepted");
    }
    // The device goes away; its work waits in the stream meanwhile.
    d.kill();
    let start = Instant::now();
    while queued() < 6.0 {
        assert!(start.elapsed() < Duration::from_secs(20), "queued {}", queued());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(stream.info().await.unwrap().state.messages, 4);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!((fa.requests(), fb.requests()), (0, 0), "no engine serves");

    // At-least-once delivery, twice over: a copy of one message published
    // again (as after a lost publish acknowledgement), and another message
    // pulled by a puller that then died without acknowledging it (it is
    // delivered again after work_ack_wait_ms).
    let first = stream.info().await.unwrap().state.first_sequence;
    let m = stream.get_raw_message(first).await.unwrap();
    let mut headers = m.headers.clone();
    headers.insert("Nats-Msg-Id", "a-copy");
    js.publish_with_headers(m.subject.to_string(), headers, m.payload.clone()).await.unwrap().await.unwrap();
    let consumer: jetstream::consumer::PullConsumer = stream
        .get_or_create_consumer(
            "work_general-chat_personal",
            pull::Config {
                durable_name: Some("work_general-chat_personal".into()),
                filter_subject: "ai.v1.work.general-chat.personal".into(),
                ack_wait: Duration::from_secs(1),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let mut dead = consumer.fetch().max_messages(1).messages().await.unwrap();
    let held = dead.next().await.unwrap().unwrap();
    assert!(held.subject.as_str().starts_with("ai.v1.work."));
    drop(dead);
    // And a third message claimed by a node that left the pool before it
    // told anyone: its origin still waits, so the claim is taken over.
    let third = stream.get_raw_message(first + 1).await.unwrap();
    let signature = third.headers.get("Edgeway-Signature").unwrap().as_str().to_string();
    let claims = js.get_key_value("edgeway_nodes_claims").await.unwrap();
    claims.create(&signature, "node-gone".into()).await.unwrap();
    // And a copy of the cancelled request's message, which nobody waits
    // for any more (as after its origin crashed): it must not run.
    let mut headers = orphan.headers.clone();
    headers.insert("Nats-Msg-Id", "an-orphan");
    js.publish_with_headers(orphan.subject.to_string(), headers, orphan.payload.clone()).await.unwrap().await.unwrap();

    // B's engine comes back: B pulls the work, and each request runs once.
    let back = Instant::now();
    fb.set(|k| k.healthy = true);
    let start = Instant::now();
    let b_metric = |o: &str| mqtt_support::metric(&b, &format!("pool_work_total{{outcome=\"{o}\"}}")).unwrap_or(0.0);
    while fb.requests() < 4 || b_metric("duplicate") < 1.0 || b_metric("abandoned") < 1.0 {
        assert!(start.elapsed() < Duration::from_secs(30), "engine saw {}", fb.requests());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!("engine back; the four queued tasks reached it within {:?}", back.elapsed());
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!((fa.requests(), fb.requests()), (0, 4), "each queued task ran once");
    assert_eq!((b_metric("taken"), b_metric("duplicate"), b_metric("abandoned")), (4.0, 1.0, 1.0));
    assert_eq!(claims.get(&signature).await.unwrap().as_deref(), Some(&b"node-b"[..]), "taken over");
    assert_eq!(stream.info().await.unwrap().state.messages, 0, "the queue is empty");

    // The device comes back and reads every answer, whole.
    let mut d = device(addr, V::V5, D1).await;
    d.subscribe(&d.topic("res/#")).await;
    for id in &ids {
        d.publish(&d.topic("resume"), json!({"request_id": id, "from_seq": 0}).to_string()).await;
        let events = d.stream(&d.topic(&format!("res/{id}"))).await;
        let done = events.last().unwrap();
        assert_eq!(
            (done["type"].as_str(), done["result"]["status"].as_str()),
            (Some("done"), Some("SUCCEEDED")),
            "{events:?}"
        );
        let text = mqtt_support::check_stream(&events);
        assert!(text.contains("Say hello"), "{text}");
        let on_a = reasons(&a, done["result"]["task_id"].as_str().unwrap()).await;
        assert!(on_a.iter().any(|r| r.contains("forwarded to node node-b")), "{on_a:?}");
    }
}

/// Waiting in the pool's work queue is no verdict on the pool instance: a
/// task whose first-token limit passes there is queued again by its retry,
/// and the instance's breaker stays closed however often that happens (a
/// long outage must not close the queue).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn time_out_in_the_queue_retries_without_opening_the_pool_instances_breaker() {
    let nats = NatsServer::start(true).await;
    let fa = FakeEngine::start_with(Knobs { healthy: false, ..Knobs::default() }).await;
    let more = "[timeouts]\nfirst_token_ms = 600\n[routing.breaker]\nconsecutive_failures = 2\n";
    let (_ta, a) = node_with(&nats.url(), "node-a", "sensitive", &fa, true, more).await;
    queues_only(&a, None).await;
    let resp = post_chat(&a, DEMO_KEY, &body(json!({"priority": "P4"}))).await;
    let v: Value = resp.json().await.unwrap();
    assert_eq!(error_code(&v), "FIRST_TOKEN_TIMEOUT", "{v}");
    let queued = mqtt_support::metric(&a, "pool_work_total{outcome=\"queued\"}").unwrap_or(0.0);
    assert!(queued >= 3.0, "each attempt waited in the queue: {queued}");
    let ready = get_json(&a, OPS_KEY, "/ready").await;
    let pool = ready["instances"].as_array().unwrap().iter().find(|i| i["name"] == "pool").unwrap().clone();
    assert_eq!(pool["breaker"], "CLOSED", "{pool}");
    assert_eq!(fa.requests(), 0);
}
