//! Configuration reload (`POST /admin/reload`, `SIGHUP`): a gateway started
//! from a file on disk, the file rewritten, the reload asked for; what
//! changes for new work, what stays for work already running, and what a
//! refused file leaves in force.

mod common;
mod mqtt_support;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::*;
use edgeway::config::Config;
use edgeway::testing::{config_toml, TempDir};
use serde_json::{json, Value};

const NEW_KEY: &str = "sk-edgeway-added-at-reload";

/// A `[applications.added]` section with [`NEW_KEY`], for `extra`.
fn added_app() -> String {
    format!(
        "[applications.added]\ntenant = \"demo\"\napi_key_sha256 = [\"{}\"]\n",
        hex::encode(edgeway::config::hash_api_key(NEW_KEY))
    )
}

/// A gateway started from a config file it can read again.
struct Reloadable {
    gw: TestGateway,
    engine: FakeEngine,
    file: PathBuf,
    dir: TempDir,
}

impl Reloadable {
    async fn start(knobs: Knobs, extra: &str) -> Reloadable {
        Self::start_edited(knobs, extra, |t| t).await
    }

    /// Like [`Self::start`], with the file's text edited first.
    async fn start_edited(knobs: Knobs, extra: &str, edit: impl FnOnce(String) -> String) -> Reloadable {
        let dir = TempDir::new("edgeway-reload");
        let engine = FakeEngine::start_with(knobs).await;
        let file = dir.0.join("edgeway.toml");
        std::fs::write(&file, edit(config_toml(&engine.url(), "openai", &dir.0, extra))).unwrap();
        let gw = TestGateway::start(Config::load(&file).expect("valid config")).await;
        gw.wait_ready().await;
        Reloadable { gw, engine, file, dir }
    }

    /// Writes the file again with `extra` (see [`config_toml`]).
    fn rewrite(&self, extra: &str) {
        self.write(&config_toml(&self.engine.url(), "openai", &self.dir.0, extra));
    }

    fn write(&self, text: &str) {
        std::fs::write(&self.file, text).unwrap();
    }

    async fn reload(&self, key: &str) -> (u16, Value) {
        let r = client().post(format!("{}/admin/reload", self.gw.base_url)).bearer_auth(key).send().await.unwrap();
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    }

    async fn ready(&self) -> Value {
        let r = client().get(format!("{}/ready", self.gw.base_url)).bearer_auth(OPS_KEY).send().await.unwrap();
        r.json().await.unwrap()
    }

    async fn chat(&self, key: &str) -> (u16, Value) {
        let body = json!({"model": "general-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
        let r = post_chat(&self.gw, key, &body).await;
        let status = r.status().as_u16();
        (status, r.json().await.unwrap())
    }

    fn reloads(&self, result: &str) -> f64 {
        let text = self.gw.gateway().render_metrics();
        let line = format!("edgeway_config_reloads_total{{result=\"{result}\"}} ");
        text.lines().find_map(|l| l.strip_prefix(&line)).map_or(0.0, |v| v.trim().parse().unwrap())
    }
}

/// A stream that started before the reload; its events when it ends.
fn stream_in_background(gw: &TestGateway, key: &'static str) -> tokio::task::JoinHandle<(Vec<Value>, bool)> {
    let (base, body) = (gw.base_url.clone(), chat_body(true));
    tokio::spawn(async move {
        let r = client().post(format!("{base}/v1/chat/completions")).bearer_auth(key).json(&body).send().await.unwrap();
        assert_eq!(r.status(), 200);
        read_sse(r).await
    })
}

/// The stream ended normally: text, a finish reason, `[DONE]`, no error.
fn assert_completed(events: &[Value], done: bool) {
    assert!(done, "the stream ended without [DONE]: {events:?}");
    assert!(events.iter().all(|e| e.get("error").is_none()), "the stream ended with an error: {events:?}");
    let finish = events.iter().rev().find_map(|e| e["choices"][0]["finish_reason"].as_str());
    assert_eq!(finish, Some("stop"), "{events:?}");
    let text: String = events.iter().filter_map(|e| e["choices"][0]["delta"]["content"].as_str()).collect();
    assert!(!text.is_empty());
}

#[tokio::test]
async fn a_key_added_at_reload_works_at_once_while_an_earlier_stream_completes() {
    let r = Reloadable::start(Knobs::slow(40, 50), "").await;
    let before = r.ready().await["config_version"].as_str().unwrap().to_string();
    assert_eq!(before.len(), 16, "config_version is a hash: {before}");
    assert_eq!(r.ready().await["config_reloaded_at_ms"], Value::Null);
    assert_eq!(r.chat(NEW_KEY).await.0, 401, "not a key yet");

    let mut rx = r.gw.recorder().subscribe();
    let stream = stream_in_background(&r.gw, DEMO_KEY);
    next_event(&mut rx, "the stream's first token", |e| e.state == TaskState::Streaming).await;

    r.rewrite(&added_app());
    let (status, body) = r.reload(OPS_KEY).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["changes"]["applications"], json!({"added": 1, "removed": 0, "changed": 0}));
    assert_eq!(body["changes"]["api_keys"], json!({"added": 1, "removed": 0, "changed": 0}));
    assert_eq!(body["previous_version"], before.as_str());
    let after = body["config_version"].as_str().unwrap().to_string();
    assert_ne!(after, before);

    let (status, answer) = r.chat(NEW_KEY).await;
    assert_eq!(status, 200, "the new key answers without a restart: {answer}");
    assert!(!stream.is_finished(), "the earlier stream was still running across the reload");
    let (events, done) = stream.await.unwrap();
    assert_completed(&events, done);

    let ready = r.ready().await;
    assert_eq!(ready["config_version"], after.as_str());
    assert!(ready["config_reloaded_at_ms"].as_u64().is_some(), "{ready}");
    assert_eq!(r.reloads("ok"), 1.0);
    assert_eq!(r.chat(DEMO_KEY).await.0, 200, "the old key still works");
    r.gw.stop().await;
}

#[tokio::test]
async fn a_broken_file_is_refused_by_key_path_and_the_old_configuration_stays() {
    let r = Reloadable::start(Knobs::default(), "").await;
    let before = r.ready().await["config_version"].as_str().unwrap().to_string();

    // Two mistakes and a new key: nothing of it may take effect.
    let text = config_toml(&r.engine.url(), "openai", &r.dir.0, &added_app())
        .replace("max_concurrency = 2", "max_concurrency = 0")
        .replace("max_output_tokens = 256", "max_output_tokens = 0");
    r.write(&text);
    let (status, body) = r.reload(OPS_KEY).await;
    assert_eq!(status, 422, "{body}");
    assert_eq!(error_code(&body), "CONFIG_INVALID");
    let paths: Vec<&str> =
        body["error"]["errors"].as_array().unwrap().iter().filter_map(|e| e["path"].as_str()).collect();
    assert!(paths.contains(&"engines.fake.max_concurrency"), "{body}");
    assert!(paths.contains(&"models.general-chat.max_output_tokens"), "{body}");

    // Not TOML at all.
    r.write("[applications.demo\n");
    let (status, body) = r.reload(OPS_KEY).await;
    assert_eq!((status, error_code(&body)), (422, "CONFIG_INVALID"), "{body}");

    // Valid, but it changes what needs a restart (and adds the key, and
    // changes a model, which alone would be taken).
    let text = config_toml(&r.engine.url(), "openai", &r.dir.0, &added_app())
        .replace("context_tokens = 2048", "context_tokens = 1024")
        .replace("node_id = \"test-node\"", "node_id = \"another\"");
    r.write(&text);
    let (status, body) = r.reload(OPS_KEY).await;
    assert_eq!(status, 422, "{body}");
    let paths: Vec<&str> =
        body["error"]["errors"].as_array().unwrap().iter().filter_map(|e| e["path"].as_str()).collect();
    assert_eq!(paths, ["node_id"], "{body}");

    // Only an admin application may reload.
    r.rewrite(&added_app());
    let (status, body) = r.reload(DEMO_KEY).await;
    assert_eq!((status, error_code(&body)), (403, "PERMISSION_DENIED"), "{body}");

    assert_eq!(r.chat(NEW_KEY).await.0, 401, "no key of a refused file works");
    assert_eq!(r.chat(DEMO_KEY).await.0, 200, "the old key still works");
    assert_eq!(r.ready().await["config_version"], before.as_str());
    assert_eq!(r.reloads("refused"), 3.0);
    assert_eq!(r.reloads("ok"), 0.0);
    r.gw.stop().await;
}

#[tokio::test]
async fn a_limit_lowered_at_reload_applies_to_new_work_only() {
    let r = Reloadable::start(Knobs::slow(40, 50), "").await;
    let mut rx = r.gw.recorder().subscribe();
    let running = stream_in_background(&r.gw, DEMO_KEY);
    next_event(&mut rx, "the stream's first token", |e| e.state == TaskState::Streaming).await;

    // One request a minute per user of `demo`, from now on.
    let text = config_toml(&r.engine.url(), "openai", &r.dir.0, "")
        .replace("default_priority = \"P2\"\n", "default_priority = \"P2\"\nuser_requests_per_minute = 1\n");
    r.write(&text);
    let (status, body) = r.reload(OPS_KEY).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["changes"]["applications"]["changed"], 1, "{body}");

    assert_eq!(r.chat(DEMO_KEY).await.0, 200, "the first request of the minute passes");
    let (status, refused) = r.chat(DEMO_KEY).await;
    assert_eq!((status, error_code(&refused)), (429, "RATE_LIMITED"), "{refused}");
    assert_eq!(r.chat(OPS_KEY).await.0, 200, "other applications keep their limits");
    let (events, done) = running.await.unwrap();
    assert_completed(&events, done);
    r.gw.stop().await;
}

/// `text` without the `[engines.fake]` section of [`config_toml`].
fn without_engine_fake(text: &str) -> String {
    let (a, b) = (text.find("[engines.fake]").unwrap(), text.find("[models.general-chat]").unwrap());
    format!("{}{}", &text[..a], &text[b..])
}

#[tokio::test]
async fn an_engine_removed_at_reload_drains_its_stream_and_gets_no_new_work() {
    let second = FakeEngine::start_with(Knobs::slow(40, 50)).await;
    let engine_b = format!(
        "[engines.b]\ntype = \"openai\"\nbase_url = \"{}\"\nmodel = \"fake-model\"\nhealth_interval_ms = 100\n",
        second.url()
    );
    let two =
        |text: String| format!("{text}\n{engine_b}").replace("instances = [\"fake\"]", "instances = [\"fake\", \"b\"]");
    let r = Reloadable::start_edited(Knobs::slow(40, 50), "", two).await;
    let mut rx = r.gw.recorder().subscribe();
    let stream = stream_in_background(&r.gw, DEMO_KEY);
    let on = next_event(&mut rx, "the stream's first token", |e| e.state == TaskState::Streaming).await;
    let on = on.instance.clone().expect("the streaming task names its instance");

    // The file without the stream's engine.
    let base = config_toml(&r.engine.url(), "openai", &r.dir.0, "");
    let (text, removed, kept) = if on == "b" {
        (base, &second, "fake")
    } else {
        (format!("{}\n{engine_b}", without_engine_fake(&base)).replace("[\"fake\"]", "[\"b\"]"), &r.engine, "b")
    };
    r.write(&text);
    let (status, body) = r.reload(OPS_KEY).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["changes"]["engines"], json!({"added": 0, "removed": 1, "changed": 0}), "{body}");
    assert_eq!(body["changes"]["models"]["changed"], 1, "its model's instances changed: {body}");

    let before = removed.requests();
    for _ in 0..3 {
        let (status, answer) = r.chat(DEMO_KEY).await;
        assert_eq!(status, 200, "new work goes to {kept}: {answer}");
    }
    assert_eq!(removed.requests(), before, "the removed engine {on} got no new work");
    let ready = r.ready().await;
    let inst = ready["instances"].as_array().unwrap().iter().find(|i| i["name"] == on.as_str()).unwrap().clone();
    assert_eq!(inst["up"], false, "{ready}");
    assert!(inst["detail"].as_str().unwrap().contains("removed from the configuration"), "{ready}");
    assert!(!stream.is_finished(), "the stream on the removed engine ran across the reload");
    let (events, done) = stream.await.unwrap();
    assert_completed(&events, done);
    r.gw.scheduler().when_idle(&on).await.expect("the removed engine drained");
    r.gw.stop().await;
}

/// Issue 11: an engine and a model added at reload take work at once;
/// before, the reload was refused as restart-only (422, `engines.second`).
#[tokio::test]
async fn an_engine_and_a_model_added_at_reload_take_work_at_once() {
    let second = FakeEngine::start().await;
    let r = Reloadable::start(Knobs::default(), "").await;
    let before = r.ready().await["config_version"].clone();
    let text = format!(
        "{}\n[engines.second]\ntype = \"openai\"\nbase_url = \"{}\"\nmodel = \"fake-model\"\nhealth_interval_ms = 100\n\
         [models.second-chat]\ninstances = [\"second\"]\n{}",
        config_toml(&r.engine.url(), "openai", &r.dir.0, ""),
        second.url(),
        added_app()
    );
    r.write(&text);
    let (status, body) = r.reload(OPS_KEY).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["changes"]["engines"], json!({"added": 1, "removed": 0, "changed": 0}), "{body}");
    assert_eq!(body["changes"]["models"], json!({"added": 1, "removed": 0, "changed": 0}), "{body}");
    // Asked at once: the new instance is waited for until its first probe.
    let chat = json!({"model": "second-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    let answer = post_chat(&r.gw, NEW_KEY, &chat).await;
    assert_eq!(answer.status(), 200, "{}", answer.text().await.unwrap());
    assert_eq!(second.requests(), 1, "the added model ran on the added engine");
    assert_eq!(r.chat(DEMO_KEY).await.0, 200, "the old model still answers");
    let ready = r.ready().await;
    assert_ne!(ready["config_version"], before);
    let names: Vec<&str> = ready["instances"].as_array().unwrap().iter().filter_map(|i| i["name"].as_str()).collect();
    assert_eq!(names, ["fake", "second"], "{ready}");
    r.gw.stop().await;
}

/// `config_toml`'s text with `general-chat` renamed `other`.
fn rename_model(text: &str) -> String {
    text.replace("[models.general-chat]", "[models.other]")
}

/// Issue 11: a model removed at reload: new requests get the stable
/// unknown-model error, the stream already running on it completes.
/// Before, the reload was refused (422, `models.general-chat`).
#[tokio::test]
async fn a_model_removed_at_reload_refuses_new_work_while_its_stream_completes() {
    let r = Reloadable::start(Knobs::slow(40, 50), "").await;
    let mut rx = r.gw.recorder().subscribe();
    let stream = stream_in_background(&r.gw, DEMO_KEY);
    next_event(&mut rx, "the stream's first token", |e| e.state == TaskState::Streaming).await;
    r.write(&rename_model(&config_toml(&r.engine.url(), "openai", &r.dir.0, "")));
    let (status, body) = r.reload(OPS_KEY).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["changes"]["models"], json!({"added": 1, "removed": 1, "changed": 0}), "{body}");
    let (status, v) = r.chat(DEMO_KEY).await;
    assert_eq!((status, error_code(&v)), (400, "INVALID_REQUEST"), "{v}");
    assert!(v.to_string().contains("unknown model"), "{v}");
    let other = json!({"model": "other", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    assert_eq!(post_chat(&r.gw, DEMO_KEY, &other).await.status(), 200, "the added model answers");
    assert!(!stream.is_finished(), "the stream ran across the reload");
    let queues = |ready: &Value| -> Vec<String> {
        ready["queues"].as_array().unwrap().iter().map(|q| q["model"].as_str().unwrap().to_string()).collect()
    };
    let (events, done) = stream.await.unwrap();
    assert_completed(&events, done);
    // Review 15 L5: a removed model's empty queue is no longer listed.
    assert_eq!(queues(&r.ready().await), ["other"]);
    r.gw.stop().await;
}

/// Issue 11: an engine whose settings changed: its old instance drains
/// (the running stream completes there), new work goes to the new one.
/// Before, the reload was refused (422, `engines.fake`).
#[tokio::test]
async fn an_engine_changed_at_reload_drains_its_old_instance_and_new_work_goes_to_the_new_one() {
    let next = FakeEngine::start().await;
    let r = Reloadable::start(Knobs::slow(40, 50), "").await;
    let mut rx = r.gw.recorder().subscribe();
    let stream = stream_in_background(&r.gw, DEMO_KEY);
    next_event(&mut rx, "the stream's first token", |e| e.state == TaskState::Streaming).await;
    // The same engine, moved to another server.
    r.write(&config_toml(&next.url(), "openai", &r.dir.0, ""));
    let (status, body) = r.reload(OPS_KEY).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["changes"]["engines"], json!({"added": 0, "removed": 0, "changed": 1}), "{body}");
    for _ in 0..2 {
        let (status, answer) = r.chat(DEMO_KEY).await;
        assert_eq!(status, 200, "{answer}");
    }
    assert_eq!(next.requests(), 2, "new work went to the new instance");
    assert_eq!(r.engine.requests(), 1, "the old instance got no new work");
    let ready = r.ready().await;
    let fakes: Vec<&Value> = ready["instances"].as_array().unwrap().iter().filter(|i| i["name"] == "fake").collect();
    assert_eq!(fakes.len(), 2, "{ready}");
    assert_eq!((fakes[0]["up"].clone(), fakes[1]["up"].clone()), (json!(false), json!(true)), "{ready}");
    // Review 15 L5: the gauge counts the old instance's stream (it was
    // reset to 0 by the reload, and went to -1 at the stream's end).
    assert_eq!(running_gauge(&r, "fake"), 1.0, "the stream still holds a slot of engine fake");
    assert!(!stream.is_finished(), "the stream on the old instance ran across the reload");
    let (events, done) = stream.await.unwrap();
    assert_completed(&events, done);
    r.gw.scheduler().when_idle_at(0).await.expect("the old instance drains");
    let ready = r.ready().await;
    let fakes: Vec<&Value> = ready["instances"].as_array().unwrap().iter().filter(|i| i["name"] == "fake").collect();
    assert_eq!(fakes.len(), 1, "a drained retired instance is no longer listed: {ready}");
    assert_eq!(running_gauge(&r, "fake"), 0.0);
    r.gw.stop().await;
}

/// `edgeway_running_tasks{engine}`.
fn running_gauge(r: &Reloadable, engine: &str) -> f64 {
    let text = r.gw.gateway().render_metrics();
    let line = format!("edgeway_running_tasks{{engine=\"{engine}\"}} ");
    text.lines().find_map(|l| l.strip_prefix(&line)).map_or(0.0, |v| v.trim().parse().unwrap())
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

#[tokio::test]
async fn sighup_reloads_the_file_and_a_broken_one_leaves_edgeway_running() {
    let engine = FakeEngine::start().await;
    let dir = TempDir::new("edgeway-sighup");
    let file = dir.0.join("edgeway.toml");
    let port = free_port();
    let text = |extra: &str| {
        config_toml(&engine.url(), "openai", &dir.0, extra)
            .replace("listen = \"127.0.0.1:0\"", &format!("listen = \"127.0.0.1:{port}\""))
    };
    std::fs::write(&file, text("")).unwrap();
    let child = Proc(
        Command::new(env!("CARGO_BIN_EXE_edgeway"))
            .args(["serve", "--config"])
            .arg(&file)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let base = format!("http://127.0.0.1:{port}");
    let version = || async {
        let r = client().get(format!("{base}/ready")).bearer_auth(OPS_KEY).send().await.ok()?;
        if r.status() != 200 {
            return None;
        }
        r.json::<Value>().await.ok()?["config_version"].as_str().map(str::to_string)
    };
    // A child process: nothing to await but its port.
    let mut before = None;
    for _ in 0..1000 {
        before = version().await;
        if before.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let before = before.expect("edgeway became ready");
    let hup = || unsafe { libc::kill(child.0.id() as i32, libc::SIGHUP) };
    let chat = |key: &'static str| {
        let base = base.clone();
        async move {
            let body =
                json!({"model": "general-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
            let r = client().post(format!("{base}/v1/chat/completions")).bearer_auth(key).json(&body).send().await;
            r.unwrap().status().as_u16()
        }
    };

    // A broken file: refused, logged, and edgeway goes on with the old one.
    let reloads = |result: &'static str| {
        let base = base.clone();
        async move {
            let r = client().get(format!("{base}/metrics")).bearer_auth(OPS_KEY).send().await.unwrap();
            let line = format!("edgeway_config_reloads_total{{result=\"{result}\"}} ");
            let text = r.text().await.unwrap();
            text.lines().find_map(|l| l.strip_prefix(&line)).map_or(0.0, |v| v.trim().parse::<f64>().unwrap())
        }
    };
    std::fs::write(&file, "[applications.demo\n").unwrap();
    assert_eq!(hup(), 0);
    for _ in 0..500 {
        if reloads("refused").await == 1.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(reloads("refused").await, 1.0, "SIGHUP tried the broken file");
    assert_eq!(version().await.as_ref(), Some(&before), "and left the configuration in force");
    std::fs::write(&file, text(&added_app())).unwrap();
    assert_eq!(hup(), 0);
    let mut after = before.clone();
    for _ in 0..500 {
        after = version().await.expect("edgeway is still running after SIGHUP");
        if after != before {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_ne!(after, before, "SIGHUP reloaded the file");
    assert_eq!(chat(NEW_KEY).await, 200);
    assert_eq!(chat(DEMO_KEY).await, 200);
    assert_eq!((reloads("ok").await, reloads("refused").await), (1.0, 1.0));
    drop(child);
}

#[tokio::test]
async fn the_process_of_an_engine_removed_at_reload_is_stopped_once_drained() {
    use edgeway::engine::supervisor::ProcessState;
    let dir = TempDir::new("edgeway-reload-process");
    let port = free_port();
    let backup = FakeEngine::start().await;
    let engine_b = format!(
        "[engines.b]\ntype = \"openai\"\nbase_url = \"{}\"\nmodel = \"fake-model\"\nhealth_interval_ms = 100\n",
        backup.url()
    );
    // `fake` is the Python fake engine, run by edgeway.
    let process = format!(
        "[engines.fake.process]\ncommand = \"python3\"\nargs = [{:?}, \"--port\", \"{port}\", \"--log\", {:?}, \"--tokens\", \"3\", \"--delay-ms\", \"5\"]\n\
         ready_timeout_ms = 20000\nstop_grace_ms = 2000\n",
        format!("{}/scripts/faults/fake_engine.py", env!("CARGO_MANIFEST_DIR")),
        dir.0.join("requests.log").display().to_string()
    );
    let base = config_toml(&format!("http://127.0.0.1:{port}"), "openai", &dir.0, "");
    let file = dir.0.join("edgeway.toml");
    std::fs::write(
        &file,
        format!("{base}\n{engine_b}\n{process}").replace("instances = [\"fake\"]", "instances = [\"fake\", \"b\"]"),
    )
    .unwrap();
    let gw = TestGateway::start(Config::load(&file).expect("valid config")).await;
    let status = gw.running.as_ref().unwrap().internals.processes.status("fake").expect("supervised");
    assert!(status.wait_for(ProcessState::Ready, Duration::from_secs(30)).await, "{:?}", status.report());
    let pid = status.report().pid.expect("a pid while ready");

    std::fs::write(&file, format!("{}\n{engine_b}", without_engine_fake(&base)).replace("[\"fake\"]", "[\"b\"]"))
        .unwrap();
    let r = client().post(format!("{}/admin/reload", gw.base_url)).bearer_auth(OPS_KEY).send().await.unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    assert!(
        status.wait_for(ProcessState::Stopped, Duration::from_secs(30)).await,
        "the removed engine's process was stopped: {:?}",
        status.report()
    );
    let gone = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map_or(true, |s| s[s.rfind(')').unwrap() + 1..].split_whitespace().next() == Some("Z"));
    assert!(gone, "process {pid} still runs");
    let body = json!({"model": "general-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    assert_eq!(post_chat(&gw, DEMO_KEY, &body).await.status(), 200, "the model answers from b");
    gw.stop().await;
}

/// `[sessions]` and an application's `redact` rules changed at reload
/// apply from the next write on: a turn after the reload is kept
/// redacted, and the lowered `max_per_user` refuses the next session.
#[tokio::test]
async fn sessions_limits_and_redaction_changed_at_reload_apply_at_once() {
    const CARD: &str = "4111-1111-1111-1111";
    let keep_text = |t: String| t.replace("[store]\n", "[store]\nstore_prompts = true\n");
    let r = Reloadable::start_edited(Knobs::default(), "", keep_text).await;
    let session = |user: &'static str| {
        let base = r.gw.base_url.clone();
        async move {
            let resp = client()
                .post(format!("{base}/v1/sessions"))
                .bearer_auth(DEMO_KEY)
                .header("x-user-id", user)
                .json(&json!({}))
                .send()
                .await
                .unwrap();
            let status = resp.status().as_u16();
            (status, resp.json::<Value>().await.unwrap())
        }
    };
    let (status, v) = session("u1").await;
    assert_eq!(status, 201, "{v}");
    let id = v["id"].as_str().unwrap().to_string();

    let text = config_toml(&r.engine.url(), "openai", &r.dir.0, "\n[sessions]\nmax_per_user = 1\n")
        .replace("[store]\n", "[store]\nstore_prompts = true\n")
        .replace("[applications.demo]\n", "[applications.demo]\nredact = ['\\b\\d{4}-\\d{4}-\\d{4}-\\d{4}\\b']\n");
    r.write(&text);
    let (status, body) = r.reload(OPS_KEY).await;
    assert_eq!(status, 200, "{body}");
    let sections = body["changes"]["sections"].as_array().unwrap();
    assert!(sections.iter().any(|s| s == "sessions"), "{body}");

    let chat = json!({"model": "general-chat", "session_id": id, "max_tokens": 4,
        "metadata": {"user_id": "u1"}, "messages": [{"role": "user", "content": format!("my card is {CARD}")}]});
    let resp = post_chat(&r.gw, DEMO_KEY, &chat).await;
    assert_eq!(resp.status().as_u16(), 200);
    r.gw.store().flush().await;
    let conn = rusqlite::Connection::open(r.gw.db_path()).unwrap();
    let kept: Vec<String> = conn
        .prepare("SELECT content FROM session_messages")
        .unwrap()
        .query_map([], |row| row.get(0))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    assert!(!kept.is_empty(), "the turn was appended");
    assert!(kept.iter().all(|c| !c.contains(CARD)), "{kept:?}");
    assert!(kept.iter().any(|c| c.contains("[REDACTED]")), "{kept:?}");

    let (status, v) = session("u1").await;
    assert_eq!((status, error_code(&v)), (409, "SESSION_LIMIT"), "{v}");
    r.gw.stop().await;
}

const SECOND_KEY: &str = "sk-edgeway-second-app";
const THIRD_KEY: &str = "sk-edgeway-second-app-new";

/// `[applications.second]` with one key, for `extra`.
fn second_app(key: &str) -> String {
    format!(
        "[applications.second]\ntenant = \"demo\"\napi_key_sha256 = [\"{}\"]\n",
        hex::encode(edgeway::config::hash_api_key(key))
    )
}

type Ws = tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

async fn ws_open(gw: &TestGateway, key: &str) -> Ws {
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    let mut req = format!("{}/v1/ws", gw.base_url.replace("http://", "ws://")).into_client_request().unwrap();
    req.headers_mut().insert("authorization", format!("Bearer {key}").parse().unwrap());
    tokio_tungstenite::connect_async(req).await.expect("upgrade").0
}

/// Sends a request frame and returns the first event of that request.
async fn ws_request(ws: &mut Ws, rid: &str) -> Value {
    use futures::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::Message;
    let frame = json!({"type": "request", "request_id": rid, "model": "general-chat",
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    ws.send(Message::text(frame.to_string())).await.unwrap();
    let wait = async {
        loop {
            match ws.next().await.expect("socket open").expect("frame") {
                Message::Text(t) => {
                    let v: Value = serde_json::from_str(t.as_str()).unwrap();
                    if v["request_id"] == rid {
                        return v;
                    }
                }
                Message::Ping(_) | Message::Pong(_) => {}
                m => panic!("unexpected frame {m:?}"),
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(30), wait).await.expect("an event within 30 s")
}

/// Review 13 HIGH-3: a socket opened with a key of an application a reload
/// removed, or with a key a reload removed from its application, used to
/// keep submitting (with no limits and no tool policy: admission found no
/// application and applied none).
#[tokio::test]
async fn a_websocket_whose_key_or_application_a_reload_removed_is_refused_at_its_next_request() {
    let r = Reloadable::start(Knobs::default(), &format!("{}{}", added_app(), second_app(SECOND_KEY))).await;
    let mut gone_app = ws_open(&r.gw, NEW_KEY).await;
    let mut gone_key = ws_open(&r.gw, SECOND_KEY).await;
    let mut kept = ws_open(&r.gw, DEMO_KEY).await;
    assert_eq!(ws_request(&mut gone_app, "a0").await["type"], "accepted");
    assert_eq!(ws_request(&mut gone_key, "b0").await["type"], "accepted");

    // "added" is gone; "second" stays with another key.
    r.rewrite(&second_app(THIRD_KEY));
    let (status, body) = r.reload(OPS_KEY).await;
    assert_eq!(status, 200, "{body}");

    let refused = ws_request(&mut gone_app, "a1").await;
    assert_eq!((refused["type"].as_str(), refused["code"].as_str()), (Some("error"), Some("AUTH_FAILED")), "{refused}");
    let refused = ws_request(&mut gone_key, "b1").await;
    assert_eq!((refused["type"].as_str(), refused["code"].as_str()), (Some("error"), Some("AUTH_FAILED")), "{refused}");
    assert_eq!(ws_request(&mut kept, "c1").await["type"], "accepted", "a key the file still has goes on");
    r.gw.stop().await;
}

/// Review 13 HIGH-3: an MQTT device a reload removed used to stay
/// connected and keep submitting with the identity of its CONNECT.
#[tokio::test]
async fn an_mqtt_device_removed_at_reload_is_disconnected_and_its_requests_never_run() {
    use mqtt_support::{connect, mqtt_toml, request, D1, D2, V};
    let both = mqtt_toml("coalesce_ms = 0");
    let r = Reloadable::start(Knobs::default(), &both).await;
    let addr = r.gw.running.as_ref().unwrap().mqtt.expect("mqtt is configured").mqtt;
    let mut kept = connect(addr, V::V5, D1.0, D1.0, D1.1).await.unwrap();
    kept.subscribe(&kept.topic("res/#")).await;
    let mut removed = connect(addr, V::V5, D2.0, D2.0, D2.1).await.unwrap();
    removed.subscribe(&removed.topic("res/#")).await;
    let runs = || r.engine.stats.requests.load(std::sync::atomic::Ordering::SeqCst);

    let d2 = both.find("[devices.demo-device-2]").expect("the demo device 2 section");
    r.rewrite(&both[..d2]);
    let (status, body) = r.reload(OPS_KEY).await;
    assert_eq!(status, 200, "{body}");
    let before = runs();

    removed.try_publish(&removed.topic("req"), request("after").to_string()).await;
    let (msgs, why) = removed.until_closed().await;
    println!("the removed device's connection ended: {why}");
    assert!(msgs.iter().all(|m| m.json()["type"] != "done"), "{msgs:?}");
    assert!(connect(addr, V::V5, D2.0, D2.0, D2.1).await.is_err(), "the removed device cannot connect again");
    kept.publish(&kept.topic("req"), request("k1").to_string()).await;
    assert_eq!(kept.stream(&kept.topic("res/k1")).await.last().unwrap()["type"], "done");
    assert_eq!(runs(), before + 1, "only the kept device's request ran");
    r.gw.stop().await;
}

/// `general-chat` on two instances of the one fake engine.
fn two_instances(t: String) -> String {
    let fake = t.find("[engines.fake]").unwrap();
    let end = t.find("[models.general-chat]").unwrap();
    let second = t[fake..end].replace("[engines.fake]", "[engines.fake2]");
    let t = format!("{}{second}{}", &t[..end], &t[end..]);
    t.replace("instances = [\"fake\"]", "instances = [\"fake\", \"fake2\"]")
}

/// Review 13 MEDIUM-1: the driver told the gateway's own first-token
/// limit from a caller's by the start-up default; after a reload lowered
/// the default, every first-token timeout counted as the caller's own
/// short limit, so a hung engine was never retried elsewhere (nor its
/// breaker told).
#[tokio::test]
async fn a_first_token_default_lowered_at_reload_still_retries_a_hung_engine_elsewhere() {
    let knobs = Knobs { first_token_delay: Duration::from_secs(2), ..Knobs::default() };
    let r = Reloadable::start_edited(knobs, "[timeouts]\nfirst_token_ms = 30000\n", two_instances).await;
    r.write(&two_instances(config_toml(&r.engine.url(), "openai", &r.dir.0, "[timeouts]\nfirst_token_ms = 300\n")));
    let (status, body) = r.reload(OPS_KEY).await;
    assert_eq!(status, 200, "{body}");
    let (status, v) = r.chat(DEMO_KEY).await;
    assert_ne!(status, 200);
    assert_eq!(error_code(&v), "FIRST_TOKEN_TIMEOUT", "{v}");
    let sent = r.engine.stats.requests.load(std::sync::atomic::Ordering::SeqCst);
    assert!(sent >= 2, "the timed-out attempt was retried (on the other instance): {sent} engine request(s)");
    r.gw.stop().await;
}

/// Review 13 MEDIUM-5: MQTT took `[auth.jwt]` once at start, so tokens
/// added by a reload were refused at CONNECT until a restart.
#[tokio::test]
async fn jwt_logins_added_at_reload_are_accepted_at_the_next_mqtt_connect() {
    use jsonwebtoken::{encode, Algorithm, EncodingKey, Header};
    use mqtt_support::{connect, mqtt_toml, V};
    let mqtt = mqtt_toml("coalesce_ms = 0");
    let r = Reloadable::start(Knobs::default(), &mqtt).await;
    let addr = r.gw.running.as_ref().unwrap().mqtt.expect("mqtt is configured").mqtt;
    let pem = std::fs::read(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/jwt-test-private.pem")).unwrap();
    let exp = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() + 600;
    let claims = json!({"sub": "cam-j", "app": "demo", "tenant": "demo", "exp": exp});
    let token = encode(&Header::new(Algorithm::RS256), &claims, &EncodingKey::from_rsa_pem(&pem).unwrap()).unwrap();
    assert!(connect(addr, V::V5, "cam-j", "cam-j", &token).await.is_err(), "no [auth.jwt] yet");

    let public = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/jwt-test-public.pem");
    r.rewrite(&format!("{mqtt}[auth.jwt]\nrs256_public_key_file = {public:?}\nleeway_s = 0\n"));
    let (status, body) = r.reload(OPS_KEY).await;
    assert_eq!(status, 200, "{body}");
    let mut d = connect(addr, V::V5, "cam-j", "cam-j", &token).await.expect("the token is accepted after the reload");
    d.subscribe(&d.topic("res/#")).await;
    r.gw.stop().await;
}

/// The Python fake engine run by edgeway on `port`, answering `tokens`
/// tokens: an `[engines.NAME.process]` section.
fn python_engine(name: &str, port: u16, dir: &std::path::Path, tokens: u32) -> String {
    format!(
        "[engines.{name}]\ntype = \"openai\"\nbase_url = \"http://127.0.0.1:{port}\"\nmodel = \"fake-model\"\nhealth_interval_ms = 100\n\
         [engines.{name}.process]\ncommand = \"python3\"\nargs = [{:?}, \"--port\", \"{port}\", \"--log\", {:?}, \"--tokens\", \"{tokens}\", \"--delay-ms\", \"5\"]\n\
         ready_timeout_ms = 20000\nstop_grace_ms = 2000\n[models.py-chat]\ninstances = [\"{name}\"]\n",
        format!("{}/scripts/faults/fake_engine.py", env!("CARGO_MANIFEST_DIR")),
        dir.join("requests.log").display().to_string()
    )
}

/// Issue 11: a supervised engine added at reload is started by edgeway and
/// takes work only once ready (a request sent at once waits for it); its
/// args changed at a later reload restart it with the new ones. Before,
/// both reloads were refused (422).
#[tokio::test]
async fn a_supervised_engine_added_at_reload_is_started_and_restarted_when_its_args_change() {
    use edgeway::engine::supervisor::ProcessState;
    let port = free_port();
    let r = Reloadable::start(Knobs::default(), "").await;
    let base = config_toml(&r.engine.url(), "openai", &r.dir.0, "");
    r.write(&format!("{base}\n{}", python_engine("py", port, &r.dir.0, 3)));
    let (status, body) = r.reload(OPS_KEY).await;
    assert_eq!(status, 200, "{body}");
    let processes = r.gw.running.as_ref().unwrap().internals.processes.clone();
    let status = processes.status("py").expect("supervised");
    let chat = json!({"model": "py-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10});
    let answer = post_chat(&r.gw, DEMO_KEY, &chat).await;
    assert_eq!(answer.status(), 200, "the request waited for the new engine to be ready");
    let v: Value = answer.json().await.unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 3, "{v}");
    let pid = status.report().pid.expect("ready, with a pid");

    // The same engine with other args: restarted with them.
    r.write(&format!("{base}\n{}", python_engine("py", port, &r.dir.0, 5)));
    let (code, body) = r.reload(OPS_KEY).await;
    assert_eq!(code, 200, "{body}");
    let answer = post_chat(&r.gw, DEMO_KEY, &chat).await;
    assert_eq!(answer.status(), 200);
    let v: Value = answer.json().await.unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 5, "the new args are in force: {v}");
    let now = processes.status("py").unwrap();
    assert_eq!(now.state(), ProcessState::Ready);
    assert_ne!(now.report().pid, Some(pid), "a new process");
    assert_eq!(status.state(), ProcessState::Stopped, "the old process was stopped");
    r.gw.stop().await;
}

/// `extra` for [`config_toml`]: `general-chat` may fall back to
/// `small-chat` on engine `small` at `url`.
fn with_small_fallback(url: &str) -> String {
    format!(
        "fallback_models = [\"small-chat\"]\n[engines.small]\ntype = \"openai\"\nbase_url = \"{url}\"\nmodel = \"small-model\"\nhealth_interval_ms = 100\n\
         [models.small-chat]\ninstances = [\"small\"]\ncontext_tokens = 2048\nmax_output_tokens = 256\n"
    )
}

/// Review 15 H1: a call queued for an engine that a reload changes waits
/// for the engine's new instance and runs there, with no fallback hop
/// (a smaller model is allowed and free) and no `MODEL_UNAVAILABLE`.
/// Before, it was moved to the smaller model (or, with none, refused).
#[tokio::test]
async fn a_call_queued_for_an_engine_changed_at_reload_runs_on_the_new_instance() {
    let small = FakeEngine::start().await;
    let extra = with_small_fallback(&small.url());
    let one = |t: String| t.replacen("max_concurrency = 2", "max_concurrency = 1", 1);
    let r = Reloadable::start_edited(Knobs::slow(40, 50), &extra, one).await;
    let mut rx = r.gw.recorder().subscribe();
    let stream = stream_in_background(&r.gw, DEMO_KEY);
    next_event(&mut rx, "the stream's first token", |e| e.state == TaskState::Streaming).await;
    let queued = tokio::spawn({
        let url = format!("{}/v1/chat/completions", r.gw.base_url);
        let mut b = chat_body(false);
        b["routing"] = json!({"allow_smaller_model": true});
        async move {
            let resp = client().post(url).bearer_auth(DEMO_KEY).json(&b).send().await.unwrap();
            (resp.status().as_u16(), resp.json::<Value>().await.unwrap())
        }
    });
    next_event(&mut rx, "the second call queued", |e| e.state == TaskState::Queued).await;
    // The same engine with a higher max_concurrency: a new instance.
    r.rewrite(&extra);
    let (status, body) = r.reload(OPS_KEY).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["changes"]["engines"], json!({"added": 0, "removed": 0, "changed": 1}), "{body}");
    let (status, v) = queued.await.unwrap();
    assert_eq!(status, 200, "{v}");
    let route = &v["edge"]["route"];
    assert_eq!(route["model"], "general-chat", "{route}");
    assert_eq!(route["instance"], "fake", "{route}");
    assert_eq!(route["degraded"], false, "{route}");
    assert_eq!(small.requests(), 0, "nothing fell back to the smaller model");
    assert_eq!(r.engine.requests(), 2);
    let (events, done) = stream.await.unwrap();
    assert_completed(&events, done);
    r.gw.stop().await;
}

/// Review 15 H3: a changed engine's old residency slot, retired once
/// drained, no longer counts its model's memory nor is an eviction
/// victim: its model is the new instance's too. Two 80 MB models fit a
/// 200 MB budget; before, the retired slot counted demo-a a second time,
/// so loading demo-b unloaded demo-a under the new instance
/// ("unload demo-a" reached the engine).
#[tokio::test]
async fn a_retired_slot_neither_counts_its_model_nor_is_unloaded_to_make_room() {
    use edgeway::engine::residency::State;
    let knobs = Knobs { router_models: vec!["demo-a".into(), "demo-b".into()], ..Knobs::default() };
    let budget = "memory_budget_mb = 200";
    let keys = "residency = \"on_demand\"\nweights_mb = 80\n";
    let section = |c: &str| {
        format!(
            "{keys}[engines.fake-b]\ntype = \"openai\"\nbase_url = \"URL\"\nmodel = \"demo-b\"\nmodel_api = \"llama-router\"\n\
             health_interval_ms = 100\n{budget}\n[models.chat-b]\ninstances = [\"fake-b\"]\ncontext_tokens = 2048\n\
             max_output_tokens = 256\nresidency = \"on_demand\"\nweights_mb = 80\n# {c}\n"
        )
    };
    let edit = |t: String, url: &str, concurrency: &str| {
        t.replace("URL", url)
            .replacen(
                "model = \"fake-model\"",
                &format!("model = \"demo-a\"\nmodel_api = \"llama-router\"\n{budget}"),
                1,
            )
            .replacen("max_concurrency = 2", &format!("max_concurrency = {concurrency}"), 1)
    };
    let engine = FakeEngine::start_with(knobs).await;
    let (dir, url) = (TempDir::new("edgeway-reload-retired"), engine.url());
    let file = dir.0.join("edgeway.toml");
    std::fs::write(&file, edit(config_toml(&url, "openai", &dir.0, &section("before")), &url, "2")).unwrap();
    let gw = TestGateway::start(Config::load(&file).expect("valid config")).await;
    gw.wait_ready().await;
    let chat = |model: &str| {
        let mut b = chat_body(false);
        b["model"] = json!(model);
        b
    };
    assert_eq!(post_chat(&gw, DEMO_KEY, &chat("general-chat")).await.status(), 200);
    // `fake` changed: instance 0 drains (nothing runs) and is retired.
    std::fs::write(&file, edit(config_toml(&url, "openai", &dir.0, &section("after")), &url, "3")).unwrap();
    let resp = client().post(format!("{}/admin/reload", gw.base_url)).bearer_auth(OPS_KEY).send().await.unwrap();
    assert_eq!(resp.status(), 200, "{}", resp.text().await.unwrap());
    let residency = gw.scheduler().router().residency();
    // The drain task retires it at once; bounded, as a broken retire
    // never says so.
    for _ in 0..200 {
        if residency.state(0) != State::Loaded {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(post_chat(&gw, DEMO_KEY, &chat("general-chat")).await.status(), 200, "the new instance serves demo-a");
    assert_eq!(post_chat(&gw, DEMO_KEY, &chat("chat-b")).await.status(), 200);
    assert!(
        !engine.model_events().iter().any(|e| e == "unload demo-a"),
        "demo-a was unloaded under the new instance: {:?}",
        engine.model_events()
    );
    assert_eq!(residency.state(0), State::Unloaded, "a retired slot is marked unloaded");
    gw.stop().await;
}

/// Review 15 H2: a reload that touches an engine whose previous instance
/// still drains (here: changed twice during one stream) is refused with
/// the engine's key path, and nothing changes; once the drain ended, the
/// same file is taken. Before, the second change was accepted (and for a
/// supervised engine stopped the process the stream ran on).
#[tokio::test]
async fn a_reload_touching_an_engine_that_still_drains_is_refused_until_the_drain_ends() {
    let r = Reloadable::start(Knobs::slow(40, 50), "").await;
    let mut rx = r.gw.recorder().subscribe();
    let stream = stream_in_background(&r.gw, DEMO_KEY);
    next_event(&mut rx, "the stream's first token", |e| e.state == TaskState::Streaming).await;
    let concurrency = |n: &str| {
        config_toml(&r.engine.url(), "openai", &r.dir.0, "").replacen(
            "max_concurrency = 2",
            &format!("max_concurrency = {n}"),
            1,
        )
    };
    r.write(&concurrency("3"));
    let (status, body) = r.reload(OPS_KEY).await;
    assert_eq!(status, 200, "{body}");
    let version = r.ready().await["config_version"].clone();
    r.write(&concurrency("4"));
    let (status, body) = r.reload(OPS_KEY).await;
    assert_eq!((status, error_code(&body)), (422, "CONFIG_INVALID"), "{body}");
    let errors = body["error"]["errors"].as_array().unwrap();
    assert_eq!(errors[0]["path"], "engines.fake", "{body}");
    assert!(errors[0]["message"].as_str().unwrap().contains("draining"), "{body}");
    assert_eq!(r.ready().await["config_version"], version, "nothing changed");
    assert_eq!(r.chat(DEMO_KEY).await.0, 200, "new work still runs");
    let (events, done) = stream.await.unwrap();
    assert_completed(&events, done);
    // The drain ends with the stream; its end is not observable from
    // outside, so the reload is asked again (bounded) until taken.
    let mut taken = None;
    for _ in 0..100 {
        let (status, body) = r.reload(OPS_KEY).await;
        if status == 200 {
            taken = Some(body);
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let body = taken.expect("the reload was taken once the old instance drained");
    assert_eq!(body["changes"]["engines"], json!({"added": 0, "removed": 0, "changed": 1}), "{body}");
    r.gw.stop().await;
}

/// Review 15 M5: a reload refused after it prepared a supervised engine's
/// process (here: the second of two added engines cannot be prepared, as
/// another live edgeway owns its pidfile) leaves no prepared process and
/// no `starting` status behind; the first engine, added alone later,
/// starts and answers. Before, `pya` kept a never-launched status.
#[tokio::test]
async fn a_reload_refused_after_preparing_a_process_leaves_no_status_behind() {
    use edgeway::engine::supervisor::ProcessState;
    let r = Reloadable::start(Knobs::default(), "").await;
    // A live process stands for "another edgeway" owning pyb's pidfile.
    let owner = Proc(Command::new("sleep").arg("60").spawn().unwrap());
    let pid = owner.0.id();
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let start = stat[stat.rfind(')').unwrap() + 1..].split_whitespace().nth(19).unwrap().to_string();
    std::fs::create_dir_all(r.dir.0.join("engines")).unwrap();
    std::fs::write(
        r.dir.0.join("engines/pyb.pid"),
        format!("pid={pid}\nstart_time={start}\ntoken=t\nowner_pid={pid}\nowner_start_time={start}\n"),
    )
    .unwrap();
    let (pa, pb) = (free_port(), free_port());
    let base = config_toml(&r.engine.url(), "openai", &r.dir.0, "");
    let pyb = python_engine("pyb", pb, &r.dir.0, 3).replace("[models.py-chat]", "[models.pyb-chat]");
    r.write(&format!("{base}\n{}\n{pyb}", python_engine("pya", pa, &r.dir.0, 3)));
    let (status, body) = r.reload(OPS_KEY).await;
    assert_eq!((status, error_code(&body)), (422, "CONFIG_INVALID"), "{body}");
    assert_eq!(body["error"]["errors"][0]["path"], "engines.pyb", "{body}");
    let processes = r.gw.running.as_ref().unwrap().internals.processes.clone();
    assert!(processes.status("pya").is_none(), "{:?}", processes.reports());
    assert!(processes.reports().is_empty(), "{:?}", processes.reports());

    r.write(&format!("{base}\n{}", python_engine("pya", pa, &r.dir.0, 3)));
    let (status, body) = r.reload(OPS_KEY).await;
    assert_eq!(status, 200, "{body}");
    let chat = json!({"model": "py-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10});
    assert_eq!(post_chat(&r.gw, DEMO_KEY, &chat).await.status(), 200, "pya started and answers");
    assert_eq!(processes.status("pya").unwrap().state(), ProcessState::Ready);
    drop(owner);
    r.gw.stop().await;
}
