//! Forwarding between the nodes of a pool (issue 15) on loopback: a real
//! `nats-server` with JetStream (the node registry), two edgeway nodes with
//! fake engines. Node A's own engine is down and its `pool` instance
//! forwards to node B: the answer streams back to A's client, both records
//! name the other node, a client that leaves A cancels B's engine request,
//! a class above B's `max_data_class` (or `local_only`) is never forwarded,
//! and a forward not signed with the pool's key is refused. A node killed
//! with SIGKILL mid-task: its running forward ends with a clear error, the
//! one it had only queued runs on a third node, and nothing runs twice.

mod common;

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
/// `pool`: with a pool instance after it in `general-chat`'s instances.
fn node_config(tmp: &TempDir, nats: &str, id: &str, max_class: &str, fake: &FakeEngine, pool: bool) -> String {
    let pool_engine = if pool {
        "[engines.pool]\ntype = \"pool\"\nmodel = \"general-chat\"\nmax_concurrency = 4\nhealth_interval_ms = 100\n"
    } else {
        ""
    };
    let extra = format!(
        "[nats]\nurl = \"{nats}\"\nkeepalive_ms = 200\n[nats.jetstream]\nstorage = \"memory\"\n\
         [cluster]\nzone = \"site-1\"\nmax_data_class = \"{max_class}\"\nheartbeat_ms = 200\nkey_env = \"{KEY_ENV}\"\n\
         {pool_engine}"
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
    let tmp = TempDir::new("edgeway-fwd");
    let text = node_config(&tmp, nats, id, max_class, fake, pool);
    let env = vec![(KEY_ENV.to_string(), KEY.to_string())];
    let config = Config::from_toml_str(&text, env, Path::new(".")).unwrap_or_else(|e| panic!("{e}\n{text}"));
    let gw = TestGateway::start(config).await;
    if !pool {
        gw.wait_ready().await;
    }
    (tmp, gw)
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
    let text = node_config(&tb, &nats.url(), "node-b", "sensitive", &fb, false)
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
