//! What a pool of edgeway nodes gives and costs (issue 15): forwarding over
//! NATS between nodes that each have one engine of fixed capacity.
//!
//! Everything runs in this process on a multi-threaded runtime: a real
//! `nats-server` with JetStream (the node registry, child process), fake
//! engines and up to three gateways (`TestGateway`), each with `[cluster]`.
//!
//! 1. What a forward adds: time to the first delta, one request at a time,
//!    interleaved: straight to node B over HTTP/SSE (B's own engine), and
//!    through node A, whose own engine is down, forwarded to B over NATS.
//!    p50/p90/p99/max and the difference.
//! 2. Throughput with 1, 2 and 3 nodes: every client calls node A (the
//!    entry); each node's engine has `--slots` slots answering
//!    `--tokens` tokens `--token-ms` apart; A queues at most `--queue`
//!    tasks on its own engine and forwards the rest (its pool instance)
//!    to the others, least loaded first. `--workers` closed-loop clients
//!    for `--seconds`; a refused call (every step full) waits 20 ms before
//!    the next. Tasks completed per second, the ratio to one node, where
//!    they ran, and refusals.
//!
//! ```text
//! cargo bench --bench pool -- --requests 500 --seconds 10
//! ```
//!
//! Results are printed as Markdown and written to `bench/results/`.

mod common;

use std::fmt::Write as _;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use clap::Parser;
use edgeway::config::Config;
use edgeway::testing::{config_toml, FakeEngine, Knobs, NatsServer, TempDir, TestGateway, DEMO_KEY, OPS_KEY};
use serde_json::{json, Value};

#[derive(Parser, Debug)]
#[command(about = "edgeway pool benchmark: what a forward adds, throughput on 1, 2 and 3 nodes")]
struct Args {
    /// Measured requests per path in the first phase.
    #[arg(long, default_value_t = 500)]
    requests: usize,
    /// Unrecorded requests per path first.
    #[arg(long, default_value_t = 50)]
    warmup: usize,
    /// Seconds of each throughput run.
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// Closed-loop clients of the throughput runs.
    #[arg(long, default_value_t = 24)]
    workers: usize,
    /// Engine slots per node.
    #[arg(long, default_value_t = 2)]
    slots: usize,
    /// Tokens per answer, and the time between them (ms).
    #[arg(long, default_value_t = 8)]
    tokens: u32,
    #[arg(long, default_value_t = 20)]
    token_ms: u64,
    /// Tasks node A queues on its own engine before it forwards.
    #[arg(long, default_value_t = 2)]
    queue: usize,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

const SHARES: &str = "nats-server, the fake engines, every edgeway node and the load generator share these cores.";
const KEY_ENV: &str = "EDGEWAY_BENCH_POOL_KEY";
const KEY: &str = "a-benchmark-key-of-the-pool-0123456789";

fn main() -> Result<()> {
    let args = Args::parse();
    edgeway::tls::install_default_provider();
    if NatsServer::binary().is_none() {
        bail!("nats-server not found: run scripts/setup-deps.sh");
    }
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let (report, json_out) = rt.block_on(run(&args))?;
    common::save_results("pool", &report, &json_out)?;
    Ok(())
}

/// Node `id`: its engine `fake` with `slots` slots; `pool`: a pool
/// instance after it, and at most `queue` tasks queued on its own engine.
async fn node(nats: &str, id: &str, fake: &FakeEngine, slots: usize, pool: Option<usize>) -> (TempDir, TestGateway) {
    let tmp = TempDir::new("edgeway-bench-pool");
    let pool_engine = if pool.is_some() {
        "[engines.pool]\ntype = \"pool\"\nmodel = \"general-chat\"\nmax_concurrency = 64\nhealth_interval_ms = 100\n"
    } else {
        ""
    };
    let extra = format!(
        "[log]\nlevel = \"warn\"\n[nats]\nurl = \"{nats}\"\n[nats.jetstream]\nstorage = \"memory\"\n\
         [cluster]\nzone = \"site-1\"\nheartbeat_ms = 200\nkey_env = \"{KEY_ENV}\"\n{pool_engine}"
    );
    let mut text = config_toml(&fake.url(), "openai", &tmp.0, &extra)
        .replace("node_id = \"test-node\"", &format!("node_id = \"{id}\""))
        .replace("max_concurrency = 2", &format!("max_concurrency = {slots}"));
    if let Some(queue) = pool {
        text = text
            .replace("instances = [\"fake\"]", &format!("instances = [\"fake\", \"pool\"]\nqueue_capacity = {queue}"));
    }
    let env = [(KEY_ENV.to_string(), KEY.to_string())];
    let config = Config::from_toml_str(&text, env, Path::new(".")).expect("bench config");
    (tmp, TestGateway::start(config).await)
}

/// Waits until `gw` sees `peers` in the pool and its pool instance is up.
async fn sees(http: &reqwest::Client, gw: &TestGateway, peers: &[&str]) -> Result<()> {
    let start = Instant::now();
    loop {
        let get = |path: &str| http.get(format!("{}{path}", gw.base_url)).bearer_auth(OPS_KEY).send();
        let nodes: Value = get("/v1/nodes").await?.json().await?;
        let ready: Value = get("/ready").await?.json().await?;
        let list = nodes["data"].as_array().cloned().unwrap_or_default();
        if peers.iter().all(|p| list.iter().any(|n| n["node_id"] == *p)) && ready.to_string().contains("node(s) serve")
        {
            return Ok(());
        }
        if start.elapsed() > Duration::from_secs(30) {
            bail!("the pool never formed: {nodes}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn run(args: &Args) -> Result<(String, Value)> {
    let nats = NatsServer::start(true).await;
    let http = reqwest::Client::builder().http1_only().tcp_nodelay(true).build()?;
    let (mut report, mut out) = common::report_start("edgeway pool benchmark", SHARES, args);

    // 1. What a forward adds.
    {
        let down = FakeEngine::start_with(Knobs { healthy: false, ..Knobs::default() }).await;
        let fb = FakeEngine::start_with(Knobs { tokens: args.tokens, record: false, ..Knobs::default() }).await;
        let (_tb, b) = node(&nats.url(), "node-b", &fb, 64, None).await;
        b.wait_ready().await;
        let (_ta, a) = node(&nats.url(), "node-a", &down, 2, Some(1)).await;
        sees(&http, &a, &["node-b"]).await?;
        let body = common::chat_request("general-chat").to_string();
        let (mut direct, mut forwarded) = (Vec::new(), Vec::new());
        for i in 0..args.warmup + args.requests {
            let url = |gw: &TestGateway| format!("{}/v1/chat/completions", gw.base_url);
            let d = common::sse_first_content(&http, &url(&b), Some(DEMO_KEY), &body).await?;
            let f = common::sse_first_content(&http, &url(&a), Some(DEMO_KEY), &body).await?;
            if i >= args.warmup {
                direct.push(d);
                forwarded.push(f);
            }
        }
        if down.requests() != 0 {
            bail!("node A's own engine was asked");
        }
        direct.sort_unstable();
        forwarded.sort_unstable();
        writeln!(
            report,
            "## What a forward adds: time to first delta ({} requests per path, one at a time, {} tokens)\n",
            args.requests, args.tokens
        )?;
        writeln!(report, "{}", common::LATENCY_HEADER)?;
        writeln!(report, "{}", common::latency_row("node B, its own engine (HTTP/SSE)", &direct, &direct))?;
        writeln!(report, "{}", common::latency_row("node A, forwarded to node B over NATS", &forwarded, &direct))?;
        out["first_delta_us"] =
            json!({"direct": common::latency_json(&direct), "forwarded": common::latency_json(&forwarded)});
    }

    // 2. Throughput on 1, 2 and 3 nodes.
    writeln!(
        report,
        "\n## Throughput, every client calling node A ({} clients, {} s; per node {} engine slots, {} tokens {} ms apart; A queues {} before forwarding)\n",
        args.workers, args.seconds, args.slots, args.tokens, args.token_ms, args.queue
    )?;
    writeln!(report, "| nodes | tasks/s | ratio to 1 node | ran on A / B / C | refused calls | p50 ms | p99 ms |")?;
    writeln!(report, "|---|---|---|---|---|---|---|")?;
    let mut one = 0.0;
    for n in 1..=3usize {
        let knobs = || Knobs::slow(args.tokens, args.token_ms);
        let fakes = [
            FakeEngine::start_with(knobs()).await,
            FakeEngine::start_with(knobs()).await,
            FakeEngine::start_with(knobs()).await,
        ];
        let ids = ["node-a", "node-b", "node-c"];
        let mut nodes = Vec::new();
        for i in 1..n {
            let (t, gw) = node(&nats.url(), &format!("{}-{n}", ids[i]), &fakes[i], args.slots, None).await;
            gw.wait_ready().await;
            nodes.push((t, gw));
        }
        let pool = (n > 1).then_some(args.queue);
        let (ta, a) = node(&nats.url(), &format!("node-a-{n}"), &fakes[0], args.slots, pool).await;
        if n == 1 {
            a.wait_ready().await;
        } else {
            let peers: Vec<String> = (1..n).map(|i| format!("{}-{n}", ids[i])).collect();
            let peers: Vec<&str> = peers.iter().map(String::as_str).collect();
            sees(&http, &a, &peers).await?;
        }
        let url = format!("{}/v1/chat/completions", a.base_url);
        let body = json!({"model": "general-chat", "messages": [{"role": "user", "content": "Hi"}]}).to_string();
        let stop = Arc::new(AtomicBool::new(false));
        let (done, refused) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let lat = Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut workers = Vec::new();
        let t0 = Instant::now();
        for _ in 0..args.workers {
            let (http, url, body) = (http.clone(), url.clone(), body.clone());
            let (stop, done, refused, lat) = (stop.clone(), done.clone(), refused.clone(), lat.clone());
            workers.push(tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let t = Instant::now();
                    let r = http.post(&url).bearer_auth(DEMO_KEY).header("content-type", "application/json");
                    match r.body(body.clone()).send().await {
                        Ok(resp) if resp.status().is_success() => {
                            let _ = resp.bytes().await;
                            done.fetch_add(1, Ordering::Relaxed);
                            lat.lock().unwrap().push(t.elapsed().as_millis() as u64);
                        }
                        _ => {
                            refused.fetch_add(1, Ordering::Relaxed);
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                    }
                }
            }));
        }
        tokio::time::sleep(Duration::from_secs(args.seconds)).await;
        stop.store(true, Ordering::Relaxed);
        for w in workers {
            w.await?;
        }
        let secs = t0.elapsed().as_secs_f64();
        let rate = done.load(Ordering::Relaxed) as f64 / secs;
        if n == 1 {
            one = rate;
        }
        let ran: Vec<String> = fakes.iter().take(n).map(|f| f.requests().to_string()).collect();
        let mut l = lat.lock().unwrap().clone();
        l.sort_unstable();
        writeln!(
            report,
            "| {n} | {rate:.1} | {:.2} | {} | {} | {} | {} |",
            rate / one,
            ran.join(" / "),
            refused.load(Ordering::Relaxed),
            common::pct(&l, 0.5),
            common::pct(&l, 0.99)
        )?;
        out["throughput"][n.to_string()] = json!({"tasks_per_s": rate, "ratio": rate / one, "ran": ran,
            "refused": refused.load(Ordering::Relaxed), "p50_ms": common::pct(&l, 0.5), "p99_ms": common::pct(&l, 0.99)});
        drop((ta, a));
        drop(nodes);
        // The next run's nodes have other ids; the records of these go.
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    Ok((report, out))
}
