//! What survives a restart and what a failure leaves behind: idempotency
//! keys across a clean restart and after a transient failure, recovery of
//! unfinished tasks after `kill -9` of the real binary, and the drain of a
//! graceful stop.

mod common;
mod mqtt_support;

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

/// The task of a finished call (its `edge` object or its error's).
fn task_of(v: &Value) -> String {
    v["edge"]["task_id"].as_str().or_else(|| v["error"]["task_id"].as_str()).unwrap_or_default().to_string()
}

/// A key whose task ended in a transient way (here: the engine failed mid
/// stream, `INTERNAL_ERROR`) is not burnt: a repeat runs the request again,
/// once however many repeats race, and the new task's record names the old
/// one. A later repeat gets the new result.
#[tokio::test]
async fn a_repeat_after_a_transient_failure_runs_again_once() {
    let fake = FakeEngine::start_with(Knobs { drop_after: Some(1), ..Knobs::default() }).await;
    let (_dir, load) = restartable(&fake);
    let gw = TestGateway::start(load()).await;
    gw.wait_ready().await;
    let mut body = chat_body(false);
    body["idempotency_key"] = json!("sensor-report-9");
    let first = post_chat(&gw, DEMO_KEY, &body).await;
    assert_eq!(first.status(), 500);
    let first: Value = first.json().await.unwrap();
    assert_eq!(error_code(&first), "INTERNAL_ERROR", "{first}");
    assert_eq!(fake.stats.requests.load(SeqCst), 1);
    let old_task = stored_task_by_key(&gw, "sensor-report-9").await;

    // The engine is back; three repeats at once.
    fake.set(|k| k.drop_after = None);
    let repeats = futures::future::join_all((0..3).map(|_| post_chat(&gw, DEMO_KEY, &body))).await;
    let mut ids = std::collections::HashSet::new();
    for r in repeats {
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["edge"]["status"], "SUCCEEDED", "{v}");
        ids.insert(task_of(&v));
    }
    assert_eq!(ids.len(), 1, "the repeats joined one new run: {ids:?}");
    let new_task = ids.into_iter().next().unwrap();
    assert_ne!(new_task, old_task);
    assert_eq!(fake.stats.requests.load(SeqCst), 2, "one new inference");
    let rec = gw.gateway().task(&demo_identity(&gw), &new_task).await.unwrap().unwrap();
    let linked = rec.transitions.iter().any(|t| t.reason.contains(&old_task));
    assert!(linked, "the new task's record names the old one: {:?}", rec.transitions);

    // A success is kept: the next repeat gets it, with no inference.
    let again: Value = post_chat(&gw, DEMO_KEY, &body).await.json().await.unwrap();
    assert_eq!(task_of(&again), new_task);
    assert_eq!(fake.stats.requests.load(SeqCst), 2);
    gw.stop().await;
    // Also from the store after a restart.
    let gw = TestGateway::start(load()).await;
    gw.wait_ready().await;
    let again: Value = post_chat(&gw, DEMO_KEY, &body).await.json().await.unwrap();
    assert_eq!(task_of(&again), new_task, "{again}");
    assert_eq!(fake.stats.requests.load(SeqCst), 2);
    gw.stop().await;
}

/// The same after a restart, when only the store knows the failed task:
/// an engine that failed every attempt before answering
/// (`MODEL_UNAVAILABLE`/`INTERNAL_ERROR`), then recovered.
#[tokio::test]
async fn a_repeat_after_a_restart_runs_a_transiently_failed_task_again() {
    let fake = FakeEngine::start_with(Knobs { fail_status: Some(503), ..Knobs::default() }).await;
    let (_dir, load) = restartable(&fake);
    let mut body = chat_body(false);
    body["idempotency_key"] = json!("nightly-9");
    let gw = TestGateway::start(load()).await;
    gw.wait_ready().await;
    let first: Value = post_chat(&gw, DEMO_KEY, &body).await.json().await.unwrap();
    let code = error_code(&first).to_string();
    assert!(["MODEL_UNAVAILABLE", "INTERNAL_ERROR"].contains(&code.as_str()), "{first}");
    let old_task = stored_task_by_key(&gw, "nightly-9").await;
    gw.stop().await;

    fake.set(|k| k.fail_status = None);
    let before = fake.stats.requests.load(SeqCst);
    let gw = TestGateway::start(load()).await;
    gw.wait_ready().await;
    let again: Value = post_chat(&gw, DEMO_KEY, &body).await.json().await.unwrap();
    assert_eq!(again["edge"]["status"], "SUCCEEDED", "{again}");
    assert_ne!(task_of(&again), old_task);
    assert_eq!(fake.stats.requests.load(SeqCst), before + 1);
    gw.stop().await;
}

/// The task the store holds for an idempotency key of `demo`.
async fn stored_task_by_key(gw: &TestGateway, key: &str) -> String {
    gw.store().flush().await;
    let conn = rusqlite::Connection::open(gw.db_path()).unwrap();
    conn.query_row(
        "SELECT task_id FROM idempotency WHERE tenant = 'demo' AND application = 'demo' AND key = ?1",
        [key],
        |r| r.get(0),
    )
    .unwrap()
}

fn demo_identity(gw: &TestGateway) -> edgeway::task::Identity {
    gw.gateway().authenticate(Some(DEMO_KEY)).unwrap()
}

/// State, reason and actor of a task's last transition, from the file.
fn last_transition(db: &std::path::Path, task_id: &str) -> (String, String, String) {
    let conn = rusqlite::Connection::open(db).unwrap();
    conn.query_row(
        "SELECT state, reason, actor FROM task_transitions WHERE task_id = ?1 ORDER BY seq DESC LIMIT 1",
        [task_id],
        |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
    )
    .unwrap()
}

/// Submits a task that outlives its connection; its id.
async fn submit_task(gw: &TestGateway, body: &Value) -> String {
    let url = format!("{}/v1/tasks", gw.base_url);
    let v: Value = client().post(url).bearer_auth(DEMO_KEY).json(body).send().await.unwrap().json().await.unwrap();
    v["task_id"].as_str().unwrap_or_else(|| panic!("{v}")).to_string()
}

/// A stop (SIGTERM, `TestGateway::stop`) keeps a queued idempotent task for
/// the next start, as a `kill -9` would: it stays QUEUED with its request
/// and runs after the restart. What cannot be kept is cancelled, recorded
/// as the gateway's doing (actor `shutdown`, "gateway shutting down"),
/// never as a client that went away.
#[tokio::test]
async fn a_queued_idempotent_task_survives_a_graceful_stop_and_runs_after_restart() {
    let fake = FakeEngine::start_with(Knobs::slow(100_000, 20)).await;
    let dir = TempDir::new("edgeway-drain");
    let text = config_toml(&fake.url(), "openai", &dir.0, "").replace("max_concurrency = 2", "max_concurrency = 1");
    let load = || Config::from_toml_str(&text, std::iter::empty(), std::path::Path::new(".")).unwrap();
    let gw = TestGateway::start(load()).await;
    gw.wait_ready().await;
    let db = gw.db_path();
    let running = submit_task(&gw, &chat_body(false)).await;
    gw.wait_for_state(&running, TaskState::Streaming).await;
    let mut keyed = chat_body(false);
    keyed["idempotency_key"] = json!("nightly-report");
    let queued_keyed = submit_task(&gw, &keyed).await;
    let queued_plain = submit_task(&gw, &chat_body(false)).await;
    gw.wait_for_state(&queued_plain, TaskState::Queued).await;
    gw.stop().await;

    for id in [&running, &queued_plain] {
        let (state, reason, actor) = last_transition(&db, id);
        assert_eq!(
            (state.as_str(), reason.as_str(), actor.as_str()),
            ("CANCELLED", "gateway shutting down", "shutdown")
        );
    }
    assert_eq!(last_transition(&db, &queued_keyed).0, "QUEUED", "kept for the next start");

    fake.set(|k| *k = Knobs::default());
    let gw = TestGateway::start(load()).await;
    gw.wait_ready().await;
    gw.wait_for_state(&queued_keyed, TaskState::Succeeded).await;
    // Its client, repeating the key, gets that task's result.
    let again: Value = post_chat(&gw, DEMO_KEY, &keyed).await.json().await.unwrap();
    assert_eq!(again["edge"]["task_id"], queued_keyed.as_str(), "{again}");
    gw.stop().await;
}

/// The drain of a graceful stop: `/ready` 503 and `SHUTTING_DOWN` for new
/// calls at once, running tasks finish within the drain time, and one that
/// would not is cancelled by `shutdown` when it is over.
#[tokio::test]
async fn a_graceful_stop_lets_running_work_finish_within_the_drain_time() {
    // 50 ms a token: the short task needs 0.5 s, the long one 12.5 s.
    let fake = FakeEngine::start_with(Knobs::slow(100_000, 50)).await;
    let mut gw = TestGateway::with_engine(&fake.url(), "openai", "").await;
    gw.wait_ready().await;
    let db = gw.db_path();
    let mut short_body = chat_body(false);
    short_body["max_tokens"] = json!(10);
    let short = submit_task(&gw, &short_body).await;
    let mut long_body = chat_body(false);
    long_body["max_tokens"] = json!(250);
    let long = submit_task(&gw, &long_body).await;
    gw.wait_for_state(&short, TaskState::Streaming).await;
    gw.wait_for_state(&long, TaskState::Streaming).await;

    let running = gw.running.take().unwrap();
    let base = gw.base_url.clone();
    let drain = Duration::from_secs(5);
    let (_, (ready, refused)) = tokio::join!(running.drain_and_shutdown(drain, Duration::from_secs(5)), async {
        // At once: not ready, and new work is refused.
        let mut status = 0;
        for _ in 0..200 {
            status = client().get(format!("{base}/ready")).send().await.unwrap().status().as_u16();
            if status == 503 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let url = format!("{base}/v1/chat/completions");
        let r = client().post(url).bearer_auth(DEMO_KEY).json(&chat_body(false)).send().await.unwrap();
        (status, (r.status().as_u16(), r.json::<Value>().await.unwrap()))
    });
    assert_eq!(ready, 503);
    assert_eq!(refused.0, 503);
    assert_eq!(error_code(&refused.1), "SHUTTING_DOWN", "{}", refused.1);
    assert!(refused.1["error"]["retry_after_ms"].as_u64().is_some(), "{}", refused.1);
    assert_eq!(last_transition(&db, &short).0, "SUCCEEDED", "finished within the drain");
    let (state, reason, actor) = last_transition(&db, &long);
    assert_eq!((state.as_str(), reason.as_str(), actor.as_str()), ("CANCELLED", "gateway shutting down", "shutdown"));
}

/// Everything a task's followers got, to its end.
async fn events_to_end(mut s: edgeway::gateway::TaskStream) -> Vec<edgeway::task::TaskEvent> {
    let mut out = Vec::new();
    while let Some((_, e)) = tokio::time::timeout(Duration::from_secs(30), s.recv()).await.expect("the task ends") {
        out.push(e);
    }
    out
}

fn terminals(events: &[edgeway::task::TaskEvent]) -> usize {
    use edgeway::task::TaskEvent;
    events.iter().filter(|e| matches!(e, TaskEvent::Done(_) | TaskEvent::Error { .. })).count()
}

/// A repeat of an idempotency key during a drain joins the task that holds
/// the key and gets its answer (the task has one terminal event): only a
/// call that would start a task is refused with `SHUTTING_DOWN`. (Failed
/// before: the repeat was refused `SHUTTING_DOWN` while its task went on to
/// succeed, so an MQTT device saw an error and then `done` for one request.)
#[tokio::test]
async fn an_idempotent_repeat_during_a_drain_joins_the_running_task() {
    let fake = FakeEngine::start_with(Knobs::slow(100_000, 50)).await;
    let mut gw = TestGateway::with_engine(&fake.url(), "openai", "").await;
    gw.wait_ready().await;
    let db = gw.db_path();
    let mut keyed = chat_body(false);
    keyed["max_tokens"] = json!(20);
    keyed["idempotency_key"] = json!("r1");
    let task = submit_task(&gw, &keyed).await;
    gw.wait_for_state(&task, TaskState::Streaming).await;
    let followed = gw.scheduler().attach(&task, 0).expect("live");

    let running = gw.running.take().unwrap();
    let base = gw.base_url.clone();
    let (_, (repeat, fresh), events) = tokio::join!(
        running.drain_and_shutdown(Duration::from_secs(5), Duration::from_secs(5)),
        async {
            for _ in 0..200 {
                if client().get(format!("{base}/ready")).send().await.unwrap().status() == 503 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            let url = format!("{base}/v1/chat/completions");
            let post = |body: Value| {
                let url = url.clone();
                async move {
                    let r = client().post(url).bearer_auth(DEMO_KEY).json(&body).send().await.unwrap();
                    (r.status().as_u16(), r.json::<Value>().await.unwrap())
                }
            };
            let mut other = keyed.clone();
            other["idempotency_key"] = json!("r2");
            tokio::join!(post(keyed.clone()), post(other))
        },
        events_to_end(followed)
    );
    assert_eq!(repeat.0, 200, "the repeat joined: {}", repeat.1);
    assert_eq!(repeat.1["edge"]["task_id"], task.as_str(), "{}", repeat.1);
    assert_eq!(repeat.1["edge"]["status"], "SUCCEEDED", "{}", repeat.1);
    assert_eq!((fresh.0, error_code(&fresh.1)), (503, "SHUTTING_DOWN"), "a new key is refused: {}", fresh.1);
    assert_eq!(terminals(&events), 1, "{events:?}");
    assert_eq!(last_transition(&db, &task).0, "SUCCEEDED");
    assert_eq!(fake.stats.requests.load(SeqCst), 1, "ran once");
}

/// A stop while the store cannot write does not park a queued idempotent
/// task (its stored request may be among the writes the exit loses, so
/// "runs after the restart" would be a promise nobody keeps): it is
/// cancelled by `shutdown` and its caller is told so. (Failed before: the
/// caller was told `SHUTTING_DOWN`, "stays queued and runs after the
/// restart".)
#[tokio::test]
async fn a_stop_with_a_store_that_cannot_write_cancels_queued_tasks_instead_of_parking_them() {
    let fake = FakeEngine::start_with(Knobs::slow(100_000, 20)).await;
    let gw = TestGateway::with_engine_edit(&fake.url(), "openai", "", |t| {
        t.replace("max_concurrency = 2", "max_concurrency = 1")
    })
    .await;
    gw.wait_ready().await;
    let running = submit_task(&gw, &chat_body(false)).await;
    gw.wait_for_state(&running, TaskState::Streaming).await;
    let mut keyed = chat_body(false);
    keyed["idempotency_key"] = json!("nightly-report");
    let queued = submit_task(&gw, &keyed).await;
    gw.wait_for_state(&queued, TaskState::Queued).await;
    let followed = gw.scheduler().attach(&queued, 0).expect("live");
    gw.store().set_writer_pragma("query_only", 1).await;
    // A refused call is recorded: the write that finds the disk read-only.
    let mut bad = chat_body(false);
    bad["model"] = json!("no-such-model");
    // (503 if a write of the running task found it first.)
    assert!([400, 503].contains(&post_chat(&gw, DEMO_KEY, &bad).await.status().as_u16()));
    gw.store().flush().await;
    assert!(gw.store().is_degraded());
    gw.stop().await;

    let events = events_to_end(followed).await;
    match events.last() {
        Some(edgeway::task::TaskEvent::Error { error, .. }) => {
            assert_eq!(error.code.as_str(), "REQUEST_CANCELLED", "not parked: {error:?}");
            assert!(!error.message.contains("after the restart"), "{error:?}");
        }
        other => panic!("{other:?}"),
    }
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

/// SIGTERM to the real binary: the running task finishes within
/// `[server] drain_timeout_s`, the queued idempotent task is kept and runs
/// at the next start, and the process exits cleanly.
#[tokio::test]
async fn sigterm_drains_the_real_binary() {
    let fake = FakeEngine::start_with(Knobs::slow(20, 50)).await;
    let dir = TempDir::new("edgeway-sigterm");
    let port = free_port();
    let text = config_toml(&fake.url(), "openai", &dir.0, "\n[server]\ndrain_timeout_s = 20\n")
        .replace("127.0.0.1:0", &format!("127.0.0.1:{port}"))
        .replace("max_concurrency = 2", "max_concurrency = 1");
    let cfg_path = dir.0.join("edgeway.toml");
    std::fs::write(&cfg_path, text).unwrap();
    let base = format!("http://127.0.0.1:{port}");

    let mut child = spawn_edgeway(&cfg_path);
    wait_ready(&base).await;
    let submit = |body: Value| {
        let base = base.clone();
        async move {
            let r = client().post(format!("{base}/v1/tasks")).bearer_auth(DEMO_KEY).json(&body).send().await.unwrap();
            r.json::<Value>().await.unwrap()["task_id"].as_str().unwrap().to_string()
        }
    };
    let running = submit(chat_body(false)).await;
    assert!(fake.wait_for(Duration::from_secs(10), |s| s.active.load(SeqCst) == 1).await);
    let mut keyed = chat_body(false);
    keyed["idempotency_key"] = json!("sigterm-report");
    let queued = submit(keyed).await;
    for _ in 0..100 {
        if task_status(&base, &queued).await["status"] == "QUEUED" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let pid = child.0.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    let status = tokio::task::spawn_blocking(move || {
        let s = child.0.wait();
        (child, s)
    });
    let (_child, status) = tokio::time::timeout(Duration::from_secs(30), status).await.expect("exits").unwrap();
    assert!(status.unwrap().success());
    assert_eq!(fake.stats.requests.load(SeqCst), 1, "the queued task did not start");
    let db = dir.0.join("edgeway.db");
    assert_eq!(last_transition(&db, &running).0, "SUCCEEDED", "finished within the drain");
    assert_eq!(last_transition(&db, &queued).0, "QUEUED", "kept for the next start");

    let _child = spawn_edgeway(&cfg_path);
    wait_ready(&base).await;
    let mut k = Value::Null;
    for _ in 0..200 {
        k = task_status(&base, &queued).await;
        if k["status"] == "SUCCEEDED" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(k["status"], "SUCCEEDED", "{k}");
}

/// The task of `request_id` in the file (a running binary's store, read
/// beside it), with its state.
fn stored_task(db: &std::path::Path, request_id: &str) -> Option<(String, String)> {
    let conn = rusqlite::Connection::open_with_flags(db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY).ok()?;
    conn.query_row("SELECT task_id, state FROM tasks WHERE request_id = ?1", [request_id], |r| {
        Ok((r.get(0)?, r.get(1)?))
    })
    .ok()
}

/// Waits until the task of `request_id` is stored in `state`; its id.
async fn wait_stored(db: &std::path::Path, request_id: &str, state: &str) -> String {
    for _ in 0..1000 {
        if let Some((id, s)) = stored_task(db, request_id) {
            if s == state {
                return id;
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("{request_id} never stored {state}: {:?}", stored_task(db, request_id));
}

/// One NATS chat call with its own inbox: publishes `body` (retrying while
/// the service is not subscribed yet) and returns the reply stream's
/// events, to the terminal one, as `(Edgeway-Event, JSON)`.
async fn nats_call(client: &async_nats::Client, body: &Value) -> Vec<(String, Value)> {
    use futures::StreamExt;
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Authorization", format!("Bearer {DEMO_KEY}").as_str());
    'publish: for _ in 0..200 {
        let inbox = client.new_inbox();
        let mut sub = client.subscribe(inbox.clone()).await.unwrap();
        let payload = serde_json::to_vec(body).unwrap().into();
        client.publish_with_reply_and_headers("ai.v1.chat", inbox, headers.clone(), payload).await.unwrap();
        let mut out = Vec::new();
        loop {
            let m = tokio::time::timeout(Duration::from_secs(20), sub.next()).await.expect("an answer").unwrap();
            if m.status == Some(async_nats::StatusCode::NO_RESPONDERS) {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue 'publish;
            }
            let kind = m.headers.as_ref().and_then(|h| h.get("Edgeway-Event")).map(|v| v.as_str().to_string());
            let kind = kind.unwrap_or_default();
            if kind == "keepalive" {
                continue;
            }
            let end = kind == "done" || kind == "error";
            out.push((kind, serde_json::from_slice(&m.payload).unwrap()));
            if end {
                return out;
            }
        }
    }
    panic!("the edgeway service never answered");
}

/// After `kill -9`, a device that publishes its request again (same
/// `request_id`, after reconnecting) and a NATS caller that repeats its
/// call (same `idempotency_key`) get the outcome of the task recovery
/// re-queued for them, and the engine runs each request once: the repeat
/// neither runs it a second time nor is refused. (Passed before: kept as
/// the proof the issue asks for.)
#[tokio::test]
async fn after_kill_9_a_device_and_a_nats_caller_that_repeat_get_the_recovered_task() {
    use mqtt_support::{device, mqtt_toml, request, D1, V};
    let nats = edgeway::testing::NatsServer::start(false).await;
    let fake = FakeEngine::start_with(Knobs::slow(1000, 20)).await;
    let dir = TempDir::new("edgeway-kill9-repeat");
    let (port, mqtt_port) = (free_port(), free_port());
    let extra = format!(
        "{}\n[nats]\nurl = \"{}\"\n",
        mqtt_toml("").replace("127.0.0.1:0", &format!("127.0.0.1:{mqtt_port}")),
        nats.url()
    );
    let text = config_toml(&fake.url(), "openai", &dir.0, &extra)
        .replace("127.0.0.1:0", &format!("127.0.0.1:{port}"))
        .replace("max_concurrency = 2", "max_concurrency = 1");
    let cfg_path = dir.0.join("edgeway.toml");
    std::fs::write(&cfg_path, text).unwrap();
    let (base, db) = (format!("http://127.0.0.1:{port}"), dir.0.join("edgeway.db"));
    let mqtt: std::net::SocketAddr = format!("127.0.0.1:{mqtt_port}").parse().unwrap();

    let child = spawn_edgeway(&cfg_path);
    wait_ready(&base).await;
    // The engine's one slot is taken: what follows waits in the queue.
    let mut hog = chat_body(false);
    hog["request_id"] = json!("hog");
    let url = format!("{base}/v1/tasks");
    client().post(url).bearer_auth(DEMO_KEY).json(&hog).send().await.unwrap();
    assert!(fake.wait_for(Duration::from_secs(10), |s| s.active.load(SeqCst) == 1).await);

    let mut d = device(mqtt, V::V5, D1).await;
    d.subscribe(&d.topic("res/#")).await;
    d.publish(&d.topic("req"), request("dev-r1").to_string()).await;
    let bus = async_nats::connect(nats.url()).await.unwrap();
    let mut nats_body = chat_body(true);
    nats_body["request_id"] = json!("nats-r1");
    nats_body["idempotency_key"] = json!("nats-k1");
    let waiting = tokio::spawn({
        let (bus, body) = (bus.clone(), nats_body.clone());
        async move { nats_call(&bus, &body).await }
    });
    let dev_task = wait_stored(&db, "dev-r1", "QUEUED").await;
    let nats_task = wait_stored(&db, "nats-r1", "QUEUED").await;
    drop(child); // SIGKILL
    waiting.abort();
    drop(d);
    assert!(fake.wait_for(Duration::from_secs(5), |s| s.active.load(SeqCst) == 0).await, "engine freed by the crash");
    assert_eq!(fake.stats.requests.load(SeqCst), 1, "only the hog ran before the kill");

    fake.set(|k| {
        k.tokens = 3;
        k.token_delay = Duration::ZERO;
    });
    let _child = spawn_edgeway(&cfg_path);
    wait_ready(&base).await;
    // Recovery ran both again, once each.
    assert_eq!(wait_stored(&db, "dev-r1", "SUCCEEDED").await, dev_task);
    assert_eq!(wait_stored(&db, "nats-r1", "SUCCEEDED").await, nats_task);
    assert_eq!(fake.stats.requests.load(SeqCst), 3);

    // The device is back and asks again: it gets the recovered task's stream.
    let mut d = device(mqtt, V::V5, D1).await;
    d.subscribe(&d.topic("res/#")).await;
    d.publish(&d.topic("req"), request("dev-r1").to_string()).await;
    let events = d.stream(&d.topic("res/dev-r1")).await;
    assert_eq!(events.last().unwrap()["type"], "done", "{events:?}");
    assert_eq!(events[0]["task_id"], dev_task.as_str(), "{events:?}");
    assert_eq!(events.last().unwrap()["result"]["task_id"], dev_task.as_str(), "{events:?}");
    // So does the NATS caller.
    let events = nats_call(&bus, &nats_body).await;
    let (kind, last) = events.last().unwrap();
    assert_eq!(kind, "done", "{events:?}");
    assert_eq!(last["result"]["task_id"], nats_task.as_str(), "{last}");
    assert_eq!(fake.stats.requests.load(SeqCst), 3, "no request ran twice");
}
