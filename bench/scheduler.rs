//! The scheduler under pressure, with the release `edgeway` binary in its
//! own process in front of an in-process fake engine that behaves like the
//! local llama.cpp (2 slots, 30 ms per token):
//!
//! 1. P0 time to first token while P4 work saturates every slot, against
//!    the same with idle slots (with `reserved_realtime_slots` 0 and 1).
//! 2. 10× overload: requests offered at ten times what the slots can serve;
//!    latency of the refusals, share refused, edgeway's memory.
//! 3. Fairness: two applications of equal weight, one sending three times as
//!    many requests, both backlogged; share of the slots each got.
//!
//! ```text
//! cargo bench --bench scheduler
//! ```

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use edgeway::testing::{config_toml, FakeEngine, Knobs, TempDir, DEMO_KEY, OPS_KEY};
use futures::StreamExt;
use serde_json::{json, Value};

const TOKEN_DELAY: Duration = Duration::from_millis(30);

struct Edgeway {
    child: Child,
    base: String,
    _dir: TempDir,
}

impl Drop for Edgeway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Edgeway {
    fn rss_kb(&self, field: &str) -> u64 {
        let s = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap_or_default();
        s.lines()
            .find(|l| l.starts_with(field))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn binary() -> PathBuf {
    let status = Command::new(env!("CARGO")).args(["build", "--release", "--bin", "edgeway"]).status().unwrap();
    assert!(status.success(), "release build failed");
    let target = std::env::var("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| Path::new(env!("CARGO_MANIFEST_DIR")).join("target"));
    target.join("release").join("edgeway")
}

async fn start(bin: &Path, fake: &FakeEngine, reserved: usize, model_extra: &str) -> Edgeway {
    let dir = TempDir::new("edgeway-bench-sched");
    let port = free_port();
    let text = config_toml(&fake.url(), "openai", &dir.0, model_extra)
        .replace("127.0.0.1:0", &format!("127.0.0.1:{port}"))
        .replace("max_concurrency = 2", &format!("max_concurrency = 2\nreserved_realtime_slots = {reserved}"))
        + "\n[log]\nlevel = \"warn\"\n[resources]\ngpu = false\n";
    let cfg = dir.0.join("edgeway.toml");
    std::fs::write(&cfg, text).unwrap();
    let child = Command::new(bin)
        .args(["serve", "--config"])
        .arg(&cfg)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let e = Edgeway { child, base: format!("http://127.0.0.1:{port}"), _dir: dir };
    let c = reqwest::Client::new();
    for _ in 0..400 {
        if let Ok(r) = c.get(format!("{}/ready", e.base)).send().await {
            if r.status() == 200 {
                return e;
            }
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("edgeway did not become ready");
}

fn pct(v: &mut [Duration], q: f64) -> Duration {
    v.sort();
    if v.is_empty() {
        return Duration::ZERO;
    }
    v[((v.len() - 1) as f64 * q).round() as usize]
}

fn ms(d: Duration) -> String {
    format!("{:.1}", d.as_secs_f64() * 1000.0)
}

fn body(prio: &str, tokens: u32, user: &str) -> Value {
    json!({
        "model": "general-chat", "priority": prio, "max_tokens": tokens, "stream": true,
        "metadata": {"user_id": user},
        "messages": [{"role": "user", "content": "hello"}],
    })
}

/// Time to the first content chunk of a streamed request.
async fn ttft(c: &reqwest::Client, base: &str, key: &str, b: &Value) -> Option<Duration> {
    let t0 = Instant::now();
    let r = c.post(format!("{base}/v1/chat/completions")).bearer_auth(key).json(b).send().await.ok()?;
    if r.status() != 200 {
        return None;
    }
    let mut s = r.bytes_stream();
    while let Some(Ok(chunk)) = s.next().await {
        if chunk.windows(10).any(|w| w == b"\"content\":") && !chunk.windows(12).any(|w| w == b"\"content\":\"\"") {
            return Some(t0.elapsed());
        }
    }
    None
}

async fn submit(c: &reqwest::Client, base: &str, key: &str, b: &Value) -> reqwest::StatusCode {
    let mut b = b.clone();
    b["stream"] = json!(false);
    c.post(format!("{base}/v1/tasks")).bearer_auth(key).json(&b).send().await.map(|r| r.status()).unwrap_or_default()
}

async fn p0_under_backlog(bin: &Path, out: &mut String) {
    let _ = writeln!(out, "\n### P0 time to first token: idle vs. saturating P4 backlog\n");
    let _ = writeln!(
        out,
        "| reserved_realtime_slots | P0 TTFT idle p50 / p99 (ms) | P0 TTFT with backlog p50 / p99 (ms) | ratio p50 |"
    );
    let _ = writeln!(out, "|---|---|---|---|");
    for reserved in [0usize, 1] {
        let fake = FakeEngine::start_with(Knobs { tokens: 10_000, token_delay: TOKEN_DELAY, ..Knobs::default() }).await;
        let e = start(bin, &fake, reserved, "queue_capacity = 1000").await;
        let c = reqwest::Client::new();
        let mut idle = Vec::new();
        for _ in 0..30 {
            idle.extend(ttft(&c, &e.base, OPS_KEY, &body("P0", 4, "alarm")).await);
        }
        // Backlog: long P4 tasks, more than the slots can take.
        for i in 0..40 {
            submit(&c, &e.base, DEMO_KEY, &body("P4", 60, &format!("batch{i}"))).await;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        let mut loaded = Vec::new();
        for _ in 0..30 {
            loaded.extend(ttft(&c, &e.base, OPS_KEY, &body("P0", 4, "alarm")).await);
        }
        let (i50, i99) = (pct(&mut idle, 0.5), pct(&mut idle, 0.99));
        let (l50, l99) = (pct(&mut loaded, 0.5), pct(&mut loaded, 0.99));
        let ratio = l50.as_secs_f64() / i50.as_secs_f64().max(1e-9);
        let _ = writeln!(out, "| {reserved} | {} / {} | {} / {} | {ratio:.1}× |", ms(i50), ms(i99), ms(l50), ms(l99));
    }
}

async fn overload(bin: &Path, out: &mut String) {
    // 8 tokens × 30 ms: about 240 ms a task, 2 slots: ~8 tasks/s served.
    let fake = FakeEngine::start_with(Knobs { tokens: 8, token_delay: TOKEN_DELAY, ..Knobs::default() }).await;
    let e = start(bin, &fake, 0, "queue_capacity = 64").await;
    let rss_before = e.rss_kb("VmRSS:");
    let served_rate = 2.0 / (8.0 * TOKEN_DELAY.as_secs_f64());
    let offered = (served_rate * 10.0).round() as u64;
    let secs = 15u64;
    let c = reqwest::Client::builder().pool_max_idle_per_host(512).build().unwrap();
    let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 / offered));
    let mut handles = Vec::new();
    let start_t = Instant::now();
    let mut n = 0u64;
    while start_t.elapsed() < Duration::from_secs(secs) {
        tick.tick().await;
        n += 1;
        let (c, base) = (c.clone(), e.base.clone());
        // A realistic mix: mostly P2, some P3/P4 batch, a few P1.
        let prio = ["P2", "P2", "P2", "P3", "P4", "P1", "P2", "P3", "P2", "P4"][(n % 10) as usize];
        let b = json!({"model": "general-chat", "priority": prio, "max_tokens": 8,
            "metadata": {"user_id": format!("u{}", n % 50)},
            "messages": [{"role": "user", "content": "hello"}]});
        handles.push(tokio::spawn(async move {
            let t0 = Instant::now();
            let r = c.post(format!("{base}/v1/chat/completions")).bearer_auth(DEMO_KEY).json(&b).send().await;
            let status = r.as_ref().map(|r| r.status().as_u16()).unwrap_or(0);
            let code = match r {
                Ok(r) => r.json::<Value>().await.ok().and_then(|v| v["error"]["code"].as_str().map(str::to_string)),
                Err(_) => Some("CLIENT_ERROR".into()),
            };
            (status, code, t0.elapsed())
        }));
    }
    let mut ok = 0;
    let mut refused = Vec::new();
    let mut codes: std::collections::BTreeMap<String, usize> = Default::default();
    let mut ok_lat = Vec::new();
    for h in handles {
        let (status, code, lat) = h.await.unwrap();
        if status == 200 {
            ok += 1;
            ok_lat.push(lat);
        } else {
            *codes.entry(code.unwrap_or_else(|| status.to_string())).or_default() += 1;
            if status == 503 || status == 429 {
                refused.push(lat);
            }
        }
    }
    let total = n as usize;
    let _ = writeln!(out, "\n### 10× overload\n");
    let _ = writeln!(
        out,
        "Offered {offered} requests/s for {secs} s ({total} requests) to slots that serve about {served_rate:.0}/s; queue capacity 64.\n"
    );
    let _ = writeln!(out, "| | value |\n|---|---|");
    let _ = writeln!(out, "| served (200) | {ok} ({:.0} %) |", ok as f64 * 100.0 / total as f64);
    let _ = writeln!(out, "| refused, by code | {codes:?} |");
    let _ = writeln!(
        out,
        "| refusal latency p50 / p99 / max (ms) | {} / {} / {} |",
        ms(pct(&mut refused, 0.5)),
        ms(pct(&mut refused, 0.99)),
        ms(pct(&mut refused, 1.0))
    );
    let _ = writeln!(
        out,
        "| served latency p50 / p99 (ms) | {} / {} |",
        ms(pct(&mut ok_lat, 0.5)),
        ms(pct(&mut ok_lat, 0.99))
    );
    let _ = writeln!(
        out,
        "| edgeway RSS before / after / peak (MiB) | {:.1} / {:.1} / {:.1} |",
        rss_before as f64 / 1024.0,
        e.rss_kb("VmRSS:") as f64 / 1024.0,
        e.rss_kb("VmHWM:") as f64 / 1024.0
    );
}

async fn fairness(bin: &Path, out: &mut String) {
    let fake = FakeEngine::start_with(Knobs { tokens: 4, token_delay: TOKEN_DELAY, ..Knobs::default() }).await;
    let e = start(bin, &fake, 0, "queue_capacity = 1000").await;
    let c = Arc::new(reqwest::Client::new());
    // Both applications backlogged at P3: `demo` queues 3× as many tasks.
    let mut ids: Vec<(String, &str)> = Vec::new();
    for i in 0..300 {
        let (key, app) = if i % 4 == 3 { (OPS_KEY, "ops") } else { (DEMO_KEY, "demo") };
        let mut b = body("P3", 4, "u");
        b["stream"] = json!(false);
        let r: Value = c
            .post(format!("{}/v1/tasks", e.base))
            .bearer_auth(key)
            .json(&b)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        if let Some(id) = r["task_id"].as_str() {
            ids.push((id.to_string(), app));
        }
    }
    // The first 80 tasks to start: who got them?
    tokio::time::sleep(Duration::from_secs(12)).await;
    let mut started: Vec<(i64, &str)> = Vec::new();
    for (id, app) in &ids {
        let key = if *app == "ops" { OPS_KEY } else { DEMO_KEY };
        let t: Value =
            c.get(format!("{}/v1/tasks/{id}", e.base)).bearer_auth(key).send().await.unwrap().json().await.unwrap();
        if let Some(at) = t["transitions"]
            .as_array()
            .and_then(|a| a.iter().find(|x| x["state"] == "DISPATCHING").and_then(|x| x["at_ms"].as_i64()))
        {
            started.push((at, app));
        }
    }
    started.sort();
    let window = started.len().min(80);
    let ops = started[..window].iter().filter(|(_, a)| *a == "ops").count();
    let _ = writeln!(out, "\n### Fairness between two applications of equal weight\n");
    let _ = writeln!(
        out,
        "`demo` queued 225 P3 tasks and `ops` 75 (interleaved 3:1), both weight 1. Of the first {window} tasks to get a slot, `demo` got {} ({:.0} %) and `ops` {ops} ({:.0} %): while both are backlogged each gets half the slots, whatever its arrival rate; after `ops` runs out, `demo` takes all.",
        window - ops,
        (window - ops) as f64 * 100.0 / window as f64,
        ops as f64 * 100.0 / window as f64
    );
}

fn main() {
    edgeway::tls::install_default_provider();
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    let bin = binary();
    let mut out = String::from("## Scheduler (cargo bench --bench scheduler)\n");
    rt.block_on(async {
        p0_under_backlog(&bin, &mut out).await;
        overload(&bin, &mut out).await;
        fairness(&bin, &mut out).await;
    });
    println!("{out}");
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("bench/results");
    let _ = std::fs::create_dir_all(&dir);
    let _ = std::fs::write(dir.join("scheduler.md"), &out);
}
