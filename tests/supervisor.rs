//! Supervised engine processes (`[engines.NAME.process]`), with real
//! processes: the Python fake engine (scripts/faults/fake_engine.py) run by
//! edgeway, killed with `kill -9`, a binary that exits at once, and an
//! `edgeway serve` child killed with `kill -9` and started again.

mod common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::*;
use edgeway::engine::supervisor::ProcessState;
use edgeway::testing::{config_toml, TempDir};
use serde_json::{json, Value};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn fake_engine_script() -> String {
    format!("{}/scripts/faults/fake_engine.py", env!("CARGO_MANIFEST_DIR"))
}

/// `[engines.fake.process]` running `command` with `args` (TOML arrays as
/// written), fast restarts.
fn process_section(command: &str, args: &str, extra: &str) -> String {
    format!(
        "\n[engines.fake.process]\ncommand = {command:?}\nargs = {args}\nready_timeout_ms = 20000\n\
         restart_backoff_ms = 100\nrestart_backoff_max_ms = 400\nstop_grace_ms = 2000\n{extra}\n"
    )
}

/// The fake engine on `port`, logging each request's nonce to `log`.
fn fake_args(port: u16, log: &Path) -> String {
    format!(
        "[{:?}, \"--port\", \"{port}\", \"--log\", {:?}, \"--tokens\", \"5\", \"--delay-ms\", \"5\"]",
        fake_engine_script(),
        log.display().to_string()
    )
}

async fn gateway_with_process(port: u16, section: &str) -> TestGateway {
    let url = format!("http://127.0.0.1:{port}");
    let section = section.to_string();
    TestGateway::with_engine_edit(&url, "openai", "", move |t| t + &section).await
}

/// Live (not zombie) processes of process group `pgid`.
fn group_members(pgid: u32) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return false };
            let f: Vec<&str> = stat[stat.rfind(')').unwrap() + 1..].split_whitespace().collect();
            f[0] != "Z" && f[2].parse::<u32>().ok() == Some(pgid)
        })
        .collect()
}

fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|s| s[s.rfind(')').unwrap() + 1..].split_whitespace().next() != Some("Z"))
}

/// Polls `cond` every 20 ms for up to `secs` (what is awaited is another
/// process's state, which sends no event).
async fn eventually(secs: u64, mut cond: impl FnMut() -> bool) -> bool {
    for _ in 0..secs * 50 {
        if cond() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    cond()
}

fn kill9(pid: u32) {
    // SAFETY: plain syscall on a pid this test started (through edgeway).
    unsafe {
        libc::kill(pid as i32, libc::SIGKILL);
    }
}

async fn ready_body(base: &str) -> (u16, Value) {
    let r = client().get(format!("{base}/ready")).bearer_auth(OPS_KEY).send().await.unwrap();
    (r.status().as_u16(), r.json().await.unwrap())
}

fn nonce_body(nonce: &str) -> Value {
    json!({"model": "general-chat", "messages": [{"role": "user", "content": format!("hi nonce={nonce}")}]})
}

#[tokio::test]
async fn an_engine_killed_with_9_is_restarted_and_work_meanwhile_falls_back_and_is_not_lost() {
    let dir = TempDir::new("edgeway-sup-kill");
    let log = dir.0.join("requests.log");
    let port = free_port();
    // `fake` is run by edgeway; `backup`, in this process, is its fallback.
    let backup = FakeEngine::start().await;
    // No retry budget to spare, and probes (1 s) too slow to see the kill before
    // the requests do: an attempt that meets the dead process must neither
    // spend the budget nor count as a failure (it reached no engine). The
    // test failed before with MODEL_UNAVAILABLE "not retried: the retry
    // budget is spent", as it did once under load with the default budget.
    let section = process_section("python3", &fake_args(port, &log), "")
        + &format!(
            "[engines.backup]\ntype = \"openai\"\nbase_url = \"{}\"\nmodel = \"fake-model\"\nmax_concurrency = 2\nhealth_interval_ms = 100\n\
             [routing]\nretry_budget_percent = 0.0\nretry_budget_min = 0\n",
            backup.url()
        );
    let url = format!("http://127.0.0.1:{port}");
    let gw = TestGateway::with_engine_edit(&url, "openai", "", move |t| {
        t.replace("instances = [\"fake\"]", "instances = [\"fake\", \"backup\"]")
            .replace("health_interval_ms = 100\n[models", "health_interval_ms = 1000\n[models")
            + &section
    })
    .await;
    let status = gw.running.as_ref().unwrap().internals.processes.status("fake").unwrap();
    assert!(status.wait_for(ProcessState::Ready, Duration::from_secs(20)).await, "{:?}", status.report());
    gw.wait_ready().await;
    let r = post_chat(&gw, DEMO_KEY, &nonce_body("before")).await;
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());

    let first = status.report();
    assert_eq!((first.restarts, first.state), (0, ProcessState::Ready));
    let pid = first.pid.unwrap();
    kill9(pid);
    // Sent at once, while edgeway notices the exit and restarts the engine:
    // each is answered (by the backup, or by a retry there), none is lost.
    let during: Vec<_> = (0..6)
        .map(|i| {
            let base = gw.base_url.clone();
            tokio::spawn(async move {
                let r = client()
                    .post(format!("{base}/v1/chat/completions"))
                    .bearer_auth(DEMO_KEY)
                    .json(&nonce_body(&format!("during{i}")))
                    .send()
                    .await
                    .unwrap();
                (r.status().as_u16(), r.text().await.unwrap())
            })
        })
        .collect();
    for d in during {
        let (code, body) = d.await.unwrap();
        assert_eq!(code, 200, "{body}");
    }
    assert!(status.wait_for(ProcessState::Ready, Duration::from_secs(20)).await);
    let after = status.report();
    assert_eq!(after.restarts, 1, "{after:?}");
    assert_ne!(after.pid, Some(pid));
    assert!(!alive(pid));
    // Back in dispatch once ready, with its breaker closed (a planned
    // restart is not counted as engine failures).
    gw.wait_ready().await;
    let (code, ready) = ready_body(&gw.base_url).await;
    assert_eq!(code, 200, "{ready}");
    let p = &ready["engine_processes"][0];
    assert_eq!(
        (p["instance"].as_str(), p["state"].as_str(), p["restarts"].as_u64()),
        (Some("fake"), Some("ready"), Some(1))
    );
    assert!(p["uptime_s"].as_f64().is_some());
    let inst = ready["instances"].as_array().unwrap().iter().find(|i| i["name"] == "fake").unwrap().clone();
    assert_eq!((inst["up"].as_bool(), inst["breaker"].as_str()), (Some(true), Some("CLOSED")), "{ready}");
    let metrics = gw.metrics().render();
    assert!(metrics.contains("edgeway_engine_process_restarts_total{engine=\"fake\"} 1"), "{metrics}");
    assert!(metrics.contains("edgeway_engine_process_up{engine=\"fake\"} 1"), "{metrics}");

    // Shutdown stops the engine's whole process group.
    let pid = after.pid.unwrap();
    gw.stop().await;
    assert!(group_members(pid).is_empty(), "engine group {pid} still has {:?}", group_members(pid));
}

#[tokio::test]
async fn work_for_the_only_instance_of_a_killed_engine_queues_until_it_is_back() {
    // One instance, no fallback: while its process restarts, requests queue
    // (within their queue deadline, 30 s by default) and run on the
    // restarted engine. Before,
    // they failed MODEL_UNAVAILABLE ("no instance of model ... is healthy").
    let dir = TempDir::new("edgeway-sup-only");
    let log = dir.0.join("requests.log");
    let port = free_port();
    let section = process_section("python3", &fake_args(port, &log), "");
    let url = format!("http://127.0.0.1:{port}");
    let gw = TestGateway::with_engine_edit(&url, "openai", "", move |t| t + &section).await;
    let status = gw.running.as_ref().unwrap().internals.processes.status("fake").unwrap();
    assert!(status.wait_for(ProcessState::Ready, Duration::from_secs(20)).await, "{:?}", status.report());
    gw.wait_ready().await;
    let pid = status.report().pid.unwrap();
    kill9(pid);
    let send = |nonce: String| {
        let base = gw.base_url.clone();
        tokio::spawn(async move {
            let r = client()
                .post(format!("{base}/v1/chat/completions"))
                .bearer_auth(DEMO_KEY)
                .json(&nonce_body(&nonce))
                .send()
                .await
                .unwrap();
            (r.status().as_u16(), r.text().await.unwrap())
        })
    };
    // Some meet the dying process, some arrive while it restarts.
    let mut during: Vec<_> = (0..3).map(|i| send(format!("only{i}"))).collect();
    assert!(status.wait_for(ProcessState::Restarting, Duration::from_secs(20)).await, "{:?}", status.report());
    during.extend((3..6).map(|i| send(format!("only{i}"))));
    for d in during {
        let (code, body) = d.await.unwrap();
        assert_eq!(code, 200, "{body}");
    }
    let after = status.report();
    assert_eq!((after.state, after.restarts), (ProcessState::Ready, 1), "{after:?}");
    assert_ne!(after.pid, Some(pid));
    // Each ran once, on the restarted engine.
    let seen = std::fs::read_to_string(&log).unwrap();
    for i in 0..6 {
        assert_eq!(seen.lines().filter(|l| *l == format!("only{i}")).count(), 1, "{seen}");
    }
    gw.stop().await;
}

#[tokio::test]
async fn an_engine_that_exits_at_once_is_given_up_after_the_limit_and_ready_says_why() {
    let port = free_port();
    let section = process_section("/bin/false", "[]", "max_restarts = 2\nrestart_window_s = 60");
    let gw = gateway_with_process(port, &section).await;
    let status = gw.running.as_ref().unwrap().internals.processes.status("fake").unwrap();
    assert!(status.wait_for(ProcessState::Failed, Duration::from_secs(20)).await, "{:?}", status.report());
    let (code, ready) = ready_body(&gw.base_url).await;
    assert_eq!(code, 503, "{ready}");
    let p = &ready["engine_processes"][0];
    assert_eq!(p["state"], "failed", "{ready}");
    assert_eq!(p["restarts"], 2, "{ready}");
    let reason = p["reason"].as_str().unwrap();
    assert!(reason.contains("exited with status 1") && reason.contains("not restarted again"), "{reason}");
    let not_ready = ready["not_ready"].to_string();
    assert!(not_ready.contains("engine process fake failed"), "{not_ready}");
    let inst = &ready["instances"][0];
    assert_eq!(inst["up"], false, "{ready}");
    assert!(inst["detail"].as_str().unwrap().starts_with("engine process"), "{ready}");
    let metrics = gw.metrics().render();
    assert!(metrics.contains("edgeway_engine_process_restarts_total{engine=\"fake\"} 2"), "{metrics}");
    assert!(metrics.contains("edgeway_engine_process_up{engine=\"fake\"} 0"), "{metrics}");
    // Its work is refused as for any engine outage, not sent to a dead port.
    let r =
        post_chat(&gw, DEMO_KEY, &json!({"model": "general-chat", "messages": [{"role": "user", "content": "hi"}]}))
            .await;
    assert_ne!(r.status(), 200);
    gw.stop().await;
}

#[tokio::test]
async fn an_engine_already_answering_at_its_address_is_used_as_external_and_not_started() {
    // Something else answers on the engine's address (an engine started by
    // hand): its answers must not pass for our process's ready check, and
    // it is not counted as failed starts either (review L4: before, it
    // ended `failed`, the instance down and /ready 503 with a healthy
    // engine there). It is used as an external engine.
    let other = FakeEngine::start().await;
    let section = process_section("python3", "[\"-c\", \"import time; time.sleep(60)\"]", "max_restarts = 1");
    let gw = TestGateway::with_engine_edit(&other.url(), "openai", "", move |t| t + &section).await;
    let status = gw.running.as_ref().unwrap().internals.processes.status("fake").unwrap();
    assert!(status.wait_for(ProcessState::External, Duration::from_secs(20)).await, "{:?}", status.report());
    let r = status.report();
    assert!(r.reason.as_deref().unwrap().contains("another process already answers"), "{r:?}");
    assert_eq!((r.pid, r.restarts), (None, 0), "{r:?}");
    gw.wait_ready().await;
    let (code, ready) = ready_body(&gw.base_url).await;
    assert_eq!(code, 200, "{ready}");
    assert_eq!(ready["engine_processes"][0]["state"], "external", "{ready}");
    let r = post_chat(&gw, DEMO_KEY, &nonce_body("external")).await;
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    assert_eq!(status.state(), ProcessState::External);
    gw.stop().await;
}

#[tokio::test]
async fn a_second_edgeway_with_the_same_data_dir_refuses_to_start_engines_even_during_a_restart() {
    // Review L2: the pidfile is removed during every restart backoff, so a
    // second edgeway started then ran its own engine beside ours.
    let section = process_section("/bin/false", "[]", "max_restarts = 1000");
    let gw = gateway_with_process(free_port(), &section).await;
    let status = gw.running.as_ref().unwrap().internals.processes.status("fake").unwrap();
    assert!(status.wait_for(ProcessState::Restarting, Duration::from_secs(20)).await, "{:?}", status.report());
    let config = gw.running.as_ref().unwrap().gateway.config().clone();
    let metrics = edgeway::telemetry::Metrics::new();
    let err = edgeway::engine::supervisor::Processes::start(&config, &metrics).await.err().expect("refused");
    assert!(err.to_string().contains("another edgeway runs engines with this data directory"), "{err}");
    gw.stop().await;
    // Once the first has stopped, the data directory is free again.
    let again = edgeway::engine::supervisor::Processes::start(&config, &metrics).await.expect("starts");
    again.stop().await;
}

#[test]
fn config_refuses_bad_process_keys_by_path() {
    let dir = TempDir::new("edgeway-sup-cfg");
    let text = config_toml("http://127.0.0.1:1", "openai", &dir.0, "")
        + "\n[engines.fake.process]\nargs = [\"${EDGEWAY_TEST_NOT_SET}\"]\nrestart_window_s = 0\nbogus = 1\n";
    let e = edgeway::config::Config::from_toml_str(&text, std::iter::empty(), Path::new(".")).unwrap_err().to_string();
    assert!(e.contains("bogus"), "{e}");
    let text = config_toml("http://127.0.0.1:1", "openai", &dir.0, "")
        + "\n[engines.fake.process]\nargs = [\"${EDGEWAY_TEST_NOT_SET}\"]\nrestart_window_s = 0\n";
    let e = edgeway::config::Config::from_toml_str(&text, std::iter::empty(), Path::new(".")).unwrap_err().to_string();
    assert!(e.contains("engines.fake.process.command"), "{e}");
    assert!(e.contains("engines.fake.process.args[0]") && e.contains("EDGEWAY_TEST_NOT_SET is not set"), "{e}");
    assert!(e.contains("engines.fake.process.restart_window_s"), "{e}");
}

struct Proc(Child);

impl Drop for Proc {
    /// A test that fails midway must not leave engines behind: a graceful
    /// stop (SIGTERM) first, which stops them, and SIGKILL only if that
    /// hangs.
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            // SAFETY: plain syscall on the child this test started.
            unsafe {
                libc::kill(self.0.id() as i32, libc::SIGTERM);
            }
            for _ in 0..500 {
                if !matches!(self.0.try_wait(), Ok(None)) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn_edgeway(config: &Path) -> Proc {
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

async fn wait_http_ready(base: &str) {
    for _ in 0..1000 {
        if let Ok(r) = client().get(format!("{base}/ready")).send().await {
            if r.status() == 200 {
                return;
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("edgeway at {base} never became ready");
}

fn pidfile_pid(path: &Path) -> u32 {
    let text = std::fs::read_to_string(path).unwrap();
    text.lines().find_map(|l| l.strip_prefix("pid=")).unwrap().parse().unwrap()
}

#[tokio::test]
async fn edgeway_killed_with_9_and_started_again_leaves_no_second_engine() {
    let dir = TempDir::new("edgeway-sup-kill9");
    let log = dir.0.join("requests.log");
    let engine_port = free_port();
    let port = free_port();
    // The engine behind a shell that waits for it: PR_SET_PDEATHSIG reaches
    // only the shell, so the engine outlives a killed edgeway and only the
    // pidfile check can clean it up.
    let script = format!(
        "python3 {} --port {engine_port} --log {} --tokens 3 --delay-ms 5 & wait",
        fake_engine_script(),
        log.display()
    );
    let text = config_toml(&format!("http://127.0.0.1:{engine_port}"), "openai", &dir.0, "")
        .replace("127.0.0.1:0", &format!("127.0.0.1:{port}"))
        + &process_section("sh", &format!("[\"-c\", {script:?}]"), "");
    let cfg = dir.0.join("edgeway.toml");
    std::fs::write(&cfg, text).unwrap();
    let base = format!("http://127.0.0.1:{port}");
    let pidfile = dir.0.join("engines").join("fake.pid");

    let mut first = spawn_edgeway(&cfg);
    wait_http_ready(&base).await;
    let pgid = pidfile_pid(&pidfile);
    let old: Vec<u32> = group_members(pgid);
    assert!(old.len() >= 2, "shell and engine in group {pgid}: {old:?}");
    first.0.kill().unwrap(); // SIGKILL
    first.0.wait().unwrap();
    // The shell died with edgeway; the engine it started did not.
    assert!(eventually(5, || !alive(pgid)).await, "the shell outlived edgeway");
    let orphans: Vec<u32> = old.iter().copied().filter(|&p| alive(p)).collect();
    assert!(!orphans.is_empty(), "expected the engine to outlive the shell");

    let mut second = spawn_edgeway(&cfg);
    wait_http_ready(&base).await;
    for p in &orphans {
        assert!(!alive(*p), "engine {p} left by the killed edgeway still runs");
    }
    let new_pgid = pidfile_pid(&pidfile);
    assert_ne!(new_pgid, pgid);
    let r = client()
        .post(format!("{base}/v1/chat/completions"))
        .bearer_auth(DEMO_KEY)
        .json(&nonce_body("second"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);

    // A third edgeway on the same data directory while the second runs must
    // not take the second's engine for a leftover: it refuses to start.
    let members = group_members(new_pgid);
    assert!(!members.is_empty());
    let third = Command::new(env!("CARGO_BIN_EXE_edgeway"))
        .args(["serve", "--config"])
        .arg(&cfg)
        .env("RUST_LOG", "error")
        .output()
        .unwrap();
    assert!(!third.status.success());
    let err = String::from_utf8_lossy(&third.stderr);
    // Refused on the data directory's lock, before any pidfile is read.
    assert!(err.contains("another edgeway runs engines with this data directory"), "{err}");
    for p in &members {
        assert!(alive(*p), "the running edgeway's engine {p} was killed by a second start");
    }

    // A graceful stop (SIGTERM) stops the engine's group and removes the pidfile.
    // SAFETY: plain syscall on the child this test started.
    unsafe {
        libc::kill(second.0.id() as i32, libc::SIGTERM);
    }
    let st = second.0.wait().unwrap();
    assert!(st.success(), "{st:?}");
    for p in members {
        assert!(!alive(p), "engine process {p} outlived edgeway's stop");
    }
    assert!(!pidfile.exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_outlives_the_runtime_thread_that_started_it() {
    // Linux's PR_SET_PDEATHSIG fires when the *thread* that forked the
    // child exits. `block_in_place` (the Argon2 check on MQTT CONNECT) hands
    // a worker's core to a new thread; the old one goes to the blocking pool
    // and exits after tokio's 10 s keep-alive. An engine forked from such a
    // worker must not be killed then.
    let dir = TempDir::new("edgeway-sup-thread");
    let log = dir.0.join("requests.log");
    let port = free_port();
    let gw = gateway_with_process(port, &process_section("python3", &fake_args(port, &log), "")).await;
    let status = gw.running.as_ref().unwrap().internals.processes.status("fake").unwrap();
    assert!(status.wait_for(ProcessState::Ready, Duration::from_secs(20)).await, "{:?}", status.report());
    let pid = status.report().pid.unwrap();
    let blockers: Vec<_> = (0..50)
        .map(|_| tokio::spawn(async { tokio::task::block_in_place(|| std::thread::sleep(Duration::from_millis(50))) }))
        .collect();
    for b in blockers {
        b.await.unwrap();
    }
    // Waits for the displaced worker threads to exit (tokio's blocking
    // keep-alive is 10 s): no event tells when they have.
    tokio::time::sleep(Duration::from_secs(12)).await;
    let r = status.report();
    assert!(alive(pid), "engine {pid} was killed: {r:?}");
    assert_eq!((r.pid, r.restarts, r.state), (Some(pid), 0, ProcessState::Ready), "{r:?}");
    gw.stop().await;
}
