//! What survives a restart: idempotency keys across a clean restart, and
//! recovery of unfinished tasks after `kill -9` of the real binary.

mod common;

use std::process::{Child, Command, Stdio};
use std::sync::atomic::Ordering::SeqCst;
use std::time::Duration;

use common::*;
use edgeway::config::Config;
use edgeway::testing::{config_toml, TempDir};
use serde_json::{json, Value};

/// A data directory and the config of gateways that use it in turn around
/// `fake` (each call gives a fresh `Config` for the next start).
fn restartable(fake: &FakeEngine) -> (TempDir, impl Fn() -> Config) {
    let dir = TempDir::new("edgeway-restart");
    let text = config_toml(&fake.url(), "openai", &dir.0, "");
    (dir, move || Config::from_toml_str(&text, std::iter::empty(), std::path::Path::new(".")).unwrap())
}

#[tokio::test]
async fn an_idempotent_repeat_after_a_restart_returns_the_original_result() {
    let fake = FakeEngine::start().await;
    let (_dir, load) = restartable(&fake);
    let mut body = chat_body(false);
    body["idempotency_key"] = json!("invoice-7");

    let gw = TestGateway::start(load()).await;
    gw.wait_ready().await;
    let first: Value = post_chat(&gw, DEMO_KEY, &body).await.json().await.unwrap();
    assert_eq!(first["edge"]["status"], "SUCCEEDED");
    gw.stop().await;

    let gw = TestGateway::start(load()).await;
    gw.wait_ready().await;
    let again: Value = post_chat(&gw, DEMO_KEY, &body).await.json().await.unwrap();
    assert_eq!(again["edge"]["task_id"], first["edge"]["task_id"]);
    assert_eq!(again["choices"][0]["message"]["content"], first["choices"][0]["message"]["content"]);
    assert_eq!(again["edge"]["usage"], first["edge"]["usage"]);
    assert_eq!(fake.stats.requests.load(SeqCst), 1, "no second inference");
    // Streaming repeats get it too.
    body["stream"] = json!(true);
    let (events, done) = read_sse(post_chat(&gw, DEMO_KEY, &body).await).await;
    assert!(done);
    assert_eq!(events.last().unwrap()["edge"]["task_id"], first["edge"]["task_id"]);
    assert_eq!(fake.stats.requests.load(SeqCst), 1);
    gw.stop().await;
}

#[tokio::test]
async fn a_revoked_key_stays_revoked_after_a_restart_until_reinstated() {
    let fake = FakeEngine::start().await;
    let (_dir, load) = restartable(&fake);
    let admin = |gw: &TestGateway, what: &str| {
        let url = format!("{}/admin/keys/{what}", gw.base_url);
        async move { client().post(url).bearer_auth(OPS_KEY).json(&json!({"api_key": DEMO_KEY})).send().await.unwrap() }
    };

    let gw = TestGateway::start(load()).await;
    gw.wait_ready().await;
    assert_eq!(admin(&gw, "revoke").await.status(), 200);
    // An admin cannot lock itself out.
    let url = format!("{}/admin/keys/revoke", gw.base_url);
    let own = client().post(url).bearer_auth(OPS_KEY).json(&json!({"api_key": OPS_KEY})).send().await.unwrap();
    assert_eq!(own.status(), 400);
    gw.stop().await;

    let gw = TestGateway::start(load()).await;
    gw.wait_ready().await;
    let r = post_chat(&gw, DEMO_KEY, &chat_body(false)).await;
    assert_eq!(r.status(), 401, "still revoked after the restart");
    let v: Value = admin(&gw, "reinstate").await.json().await.unwrap();
    assert_eq!(v["was_revoked"], true);
    assert_eq!(post_chat(&gw, DEMO_KEY, &chat_body(false)).await.status(), 200);
    gw.stop().await;

    let gw = TestGateway::start(load()).await;
    gw.wait_ready().await;
    assert_eq!(post_chat(&gw, DEMO_KEY, &chat_body(false)).await.status(), 200, "reinstated for good");
    gw.stop().await;
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn_edgeway(config: &std::path::Path) -> Proc {
    Proc(
        Command::new(env!("CARGO_BIN_EXE_edgeway"))
            .args(["serve", "--config"])
            .arg(config)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    )
}

async fn wait_ready(base: &str) {
    for _ in 0..400 {
        if let Ok(r) = client().get(format!("{base}/ready")).send().await {
            if r.status() == 200 {
                return;
            }
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("edgeway at {base} never became ready");
}

async fn task_status(base: &str, id: &str) -> Value {
    client().get(format!("{base}/v1/tasks/{id}")).bearer_auth(DEMO_KEY).send().await.unwrap().json().await.unwrap()
}

#[tokio::test]
async fn after_kill_9_no_task_stays_unfinished() {
    let fake = FakeEngine::start_with(Knobs::slow(1000, 20)).await;
    let dir = TempDir::new("edgeway-kill9");
    let port = free_port();
    let text = config_toml(&fake.url(), "openai", &dir.0, "")
        .replace("127.0.0.1:0", &format!("127.0.0.1:{port}"))
        .replace("max_concurrency = 2", "max_concurrency = 1");
    let cfg_path = dir.0.join("edgeway.toml");
    std::fs::write(&cfg_path, text).unwrap();
    let base = format!("http://127.0.0.1:{port}");

    let child = spawn_edgeway(&cfg_path);
    wait_ready(&base).await;
    let submit = |body: Value| {
        let base = base.clone();
        async move {
            let v: Value = client()
                .post(format!("{base}/v1/tasks"))
                .bearer_auth(DEMO_KEY)
                .json(&body)
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            v["task_id"].as_str().unwrap().to_string()
        }
    };
    let running = submit(chat_body(false)).await;
    assert!(fake.wait_for(Duration::from_secs(10), |s| s.active.load(SeqCst) == 1).await);
    let mut keyed = chat_body(false);
    keyed["idempotency_key"] = json!("nightly-report");
    let queued_keyed = submit(keyed.clone()).await;
    let queued_plain = submit(chat_body(false)).await;
    // Let the store write the queue transitions (WAL survives SIGKILL).
    for _ in 0..100 {
        if task_status(&base, &queued_plain).await["status"] == "QUEUED" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    drop(child); // SIGKILL
    assert!(fake.wait_for(Duration::from_secs(5), |s| s.active.load(SeqCst) == 0).await, "engine freed by the crash");

    fake.set(|k| {
        k.tokens = 3;
        k.token_delay = Duration::ZERO;
    });
    let _child = spawn_edgeway(&cfg_path);
    wait_ready(&base).await;
    let r = task_status(&base, &running).await;
    assert_eq!(r["status"], "FAILED");
    assert_eq!(r["error_code"], "INTERNAL_ERROR");
    let last = r["transitions"].as_array().unwrap().last().unwrap().clone();
    assert_eq!(last["reason"], "gateway restarted while the task was STREAMING");
    let p = task_status(&base, &queued_plain).await;
    assert_eq!(p["status"], "FAILED", "{p}");
    // The idempotent queued task runs again after the restart.
    let mut k = Value::Null;
    for _ in 0..200 {
        k = task_status(&base, &queued_keyed).await;
        if k["status"] == "SUCCEEDED" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(k["status"], "SUCCEEDED", "{k}");
    let reasons: Vec<&str> =
        k["transitions"].as_array().unwrap().iter().map(|t| t["reason"].as_str().unwrap()).collect();
    assert!(reasons.contains(&"re-queued after a gateway restart"), "{reasons:?}");
    // Its client, retrying with the key, gets that task's result.
    let again: Value = client()
        .post(format!("{base}/v1/chat/completions"))
        .bearer_auth(DEMO_KEY)
        .json(&keyed)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(again["edge"]["task_id"], queued_keyed.as_str());
    assert_eq!(again["edge"]["status"], "SUCCEEDED");
}
