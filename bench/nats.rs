//! What the NATS ingress and the lifecycle publisher cost.
//!
//! Everything runs in this process on a multi-threaded runtime: a real
//! `nats-server` (child process, free port), the fake engine with zero
//! delays, and a gateway (`TestGateway`) with `[nats]` on.
//!
//! 1. Time to first delta, one request at a time (closed loop), requests
//!    interleaved: straight to the fake engine over HTTP (its time to the
//!    first content chunk), through edgeway over HTTP/SSE, and through
//!    edgeway over NATS (publish on `ai.v1.chat` → first `delta` message on
//!    the caller's inbox). p50/p90/p99/max and the difference to direct.
//! 2. Lifecycle events of real tasks: `--workers` concurrent callers submit
//!    tasks straight into the gateway (no ingress in between) for
//!    `--seconds`; every task publishes 7 transitions. Reports tasks/s,
//!    events published/s, events a NATS subscriber received/s, drops.
//! 3. The publisher alone: the 7 transitions of synthetic tasks (no
//!    scheduler, no engine; the recorder refuses any order the task state
//!    machine does not allow) fed into the recorder as fast as the
//!    publisher keeps up (the producer waits when more than 2048 are in
//!    flight, so nothing is dropped), for `--seconds`.
//!
//! ```text
//! cargo bench --bench nats -- --requests 2000 --seconds 5
//! ```
//!
//! Results are printed as Markdown and written to `bench/results/`.

mod common;

use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};
use async_nats::HeaderMap;
use clap::Parser;
use edgeway::admission::request::parse_body;
use edgeway::gateway::Caller;
use edgeway::ingress::nats::BusState;
use edgeway::task::{Ingress, ResultMeta, TaskState};
use edgeway::testing::{FakeEngine, Knobs, NatsServer, TestGateway, DEMO_KEY};
use futures::StreamExt;
use prometheus::core::Collector as _;
use serde_json::{json, Value};

#[derive(Parser, Debug)]
#[command(about = "edgeway NATS benchmark: request → first delta, lifecycle event rate")]
struct Args {
    #[command(flatten)]
    first: common::FirstDeltaArgs,
    /// Seconds of each event-rate phase.
    #[arg(long, default_value_t = 5)]
    seconds: u64,
    /// Concurrent task submitters in the event-rate phase.
    #[arg(long, default_value_t = 32)]
    workers: usize,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

/// Who shares the machine's cores, for the machine line.
const SHARES: &str = "nats-server, fake engine, edgeway and the load generator share these cores.";

fn main() -> Result<()> {
    let args = Args::parse();
    edgeway::tls::install_default_provider();
    if NatsServer::binary().is_none() {
        bail!("nats-server not found: run scripts/setup-deps.sh");
    }
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let (report, json_out) = rt.block_on(run(&args))?;
    common::save_results("nats", &report, &json_out)?;
    Ok(())
}

async fn run(args: &Args) -> Result<(String, Value)> {
    let nats = NatsServer::start(false).await;
    let fake = FakeEngine::start_with(Knobs { tokens: args.first.tokens, record: false, ..Knobs::default() }).await;
    let extra = format!(
        "queue_capacity = 100000\n[log]\nlevel = \"warn\"\n[nats]\nurl = \"{}\"\nevents_queue_capacity = 65536\n",
        nats.url()
    );
    let gw = TestGateway::with_engine_edit(&fake.url(), "openai", &extra, |t| {
        t.replace("max_concurrency = 2", "max_concurrency = 1024")
    })
    .await;
    gw.wait_ready().await;
    gw.nats().wait_for(BusState::Connected).await;
    let client = async_nats::connect(nats.url()).await?;

    let (mut report, mut out) = common::report_start("edgeway NATS benchmark", SHARES, args);

    // 1. Time to first delta.
    let http = reqwest::Client::builder().http1_only().tcp_nodelay(true).build()?;
    let direct_body = common::chat_request("fake-model").to_string();
    let gw_body = common::chat_request("general-chat").to_string();
    let mut auth = HeaderMap::new();
    auth.insert("Authorization", format!("Bearer {DEMO_KEY}").as_str());
    let (mut direct, mut via_http, mut via_nats) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..args.first.warmup + args.first.requests {
        let d = common::sse_first_content(&http, &format!("{}/v1/chat/completions", fake.url()), None, &direct_body)
            .await?;
        let h =
            common::sse_first_content(&http, &format!("{}/v1/chat/completions", gw.base_url), Some(DEMO_KEY), &gw_body)
                .await?;
        let n = nats_first_delta(&client, &auth, &gw_body).await?;
        if i >= args.first.warmup {
            direct.push(d);
            via_http.push(h);
            via_nats.push(n);
        }
    }
    writeln!(
        report,
        "## Time to first delta ({} requests per path, one at a time, {} tokens)\n",
        args.first.requests, args.first.tokens
    )?;
    writeln!(report, "{}", common::LATENCY_HEADER)?;
    for v in [&mut direct, &mut via_http, &mut via_nats] {
        v.sort_unstable();
    }
    writeln!(report, "{}", common::latency_row("fake engine, direct (HTTP/SSE)", &direct, &direct))?;
    writeln!(report, "{}", common::latency_row("edgeway HTTP/SSE", &via_http, &direct))?;
    writeln!(report, "{}", common::latency_row("edgeway NATS (`ai.v1.chat`)", &via_nats, &direct))?;
    for (k, v) in [("direct", &direct), ("edgeway_http", &via_http), ("edgeway_nats", &via_nats)] {
        out["first_delta_us"][k] = common::latency_json(v);
    }

    // 2. Lifecycle events of real tasks.
    let m = gw.metrics().clone();
    let published = || {
        m.nats_events_published.collect()[0].get_metric().iter().map(|x| x.get_counter().get_value()).sum::<f64>()
            as u64
    };
    let dropped = || {
        m.nats_events_dropped.collect()[0].get_metric().iter().map(|x| x.get_counter().get_value()).sum::<f64>() as u64
    };
    let received = Arc::new(AtomicU64::new(0));
    let listener = async_nats::connect(nats.url()).await?;
    let mut sub = listener.subscribe("ai.v1.events.>").await?;
    listener.flush().await?;
    let r = received.clone();
    tokio::spawn(async move {
        while sub.next().await.is_some() {
            r.fetch_add(1, Ordering::Relaxed);
        }
    });
    let (p0, d0, r0) = (published(), dropped(), received.load(Ordering::Relaxed));
    let stop = Arc::new(AtomicBool::new(false));
    let tasks = Arc::new(AtomicU64::new(0));
    let t0 = Instant::now();
    let mut workers = Vec::new();
    let body =
        json!({"model": "general-chat", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}).to_string();
    for _ in 0..args.workers {
        let (gw, stop, tasks, body) = (gw.gateway().clone(), stop.clone(), tasks.clone(), body.clone());
        workers.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let caller = Caller::Credential(Some(DEMO_KEY));
                if let Ok(mut s) = gw.submit(caller, body.as_bytes(), Ingress::Nats, Default::default()).await {
                    while s.recv().await.is_some() {}
                    tasks.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_secs(args.seconds)).await;
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.await?;
    }
    let elapsed = t0.elapsed().as_secs_f64();
    settle(&received).await;
    let (p1, d1) = (published(), dropped());
    let got = received.load(Ordering::Relaxed) - r0;
    let n_tasks = tasks.load(Ordering::Relaxed);
    writeln!(report, "\n## Lifecycle events of real tasks ({} submitters, {} s)\n", args.workers, args.seconds)?;
    writeln!(report, "| tasks/s | events published/s | events received by a subscriber/s | dropped |")?;
    writeln!(report, "|---|---|---|---|")?;
    writeln!(
        report,
        "| {:.0} | {:.0} | {:.0} | {} |",
        n_tasks as f64 / elapsed,
        (p1 - p0) as f64 / elapsed,
        got as f64 / elapsed,
        d1 - d0
    )?;
    out["tasks"] = json!({"tasks_per_s": n_tasks as f64 / elapsed, "published_per_s": (p1 - p0) as f64 / elapsed,
        "received_per_s": got as f64 / elapsed, "dropped": d1 - d0});

    // 3. The publisher alone.
    let who = gw.gateway().authenticate(Some(DEMO_KEY)).expect("demo key");
    let req = edgeway::admission::admit(
        &gw.gateway().config(),
        who,
        parse_body(body.as_bytes()).expect("body"),
        Ingress::Nats,
        None,
    )
    .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    let recorder = gw.recorder().clone();
    let (p0, d0, r0) = (published(), dropped(), received.load(Ordering::Relaxed));
    let t0 = Instant::now();
    let mut produced = 0u64;
    while t0.elapsed() < Duration::from_secs(args.seconds) {
        for _ in 0..36 {
            let mut r = req.clone();
            r.task_id = edgeway::task::new_task_id();
            recorder.received(&r);
            use TaskState::*;
            for s in [Validating, Queued, Dispatching, Running, Streaming] {
                recorder.transition(&r, s, "bench", None, "bench");
            }
            let meta = ResultMeta::bare(&r.request_id, &r.task_id, Succeeded, &r.logical_model, "bench");
            recorder.finished(&r, &meta, "bench", None, "bench", None, None);
        }
        produced += 36 * 7;
        while produced - (published() - p0) - (dropped() - d0) > 2048 {
            tokio::task::yield_now().await;
        }
    }
    while published() - p0 + dropped() - d0 < produced && t0.elapsed() < Duration::from_secs(args.seconds + 10) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let elapsed = t0.elapsed().as_secs_f64();
    let (p1, d1) = (published(), dropped());
    settle(&received).await;
    let got = received.load(Ordering::Relaxed) - r0;
    writeln!(report, "\n## The lifecycle publisher alone ({} s, synthetic transitions)\n", args.seconds)?;
    writeln!(report, "| events produced | published/s | received by a subscriber/s | dropped |")?;
    writeln!(report, "|---|---|---|---|")?;
    writeln!(report, "| {produced} | {:.0} | {:.0} | {} |", (p1 - p0) as f64 / elapsed, got as f64 / elapsed, d1 - d0)?;
    out["publisher"] = json!({"produced": produced, "published_per_s": (p1 - p0) as f64 / elapsed,
        "received_per_s": got as f64 / elapsed, "dropped": d1 - d0});
    gw.stop().await;
    Ok((report, out))
}

/// Waits until the subscriber's count stops growing.
async fn settle(received: &AtomicU64) {
    let mut last = u64::MAX;
    while received.load(Ordering::Relaxed) != last {
        last = received.load(Ordering::Relaxed);
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// Microseconds from publishing on `ai.v1.chat` until the first `delta`
/// message on the caller's inbox; the rest of the stream is read and dropped.
async fn nats_first_delta(client: &async_nats::Client, auth: &HeaderMap, body: &str) -> Result<u64> {
    let inbox = client.new_inbox();
    let mut sub = client.subscribe(inbox.clone()).await?;
    let t0 = Instant::now();
    client.publish_with_reply_and_headers("ai.v1.chat", inbox, auth.clone(), body.to_string().into()).await?;
    let mut first = None;
    loop {
        let m = tokio::time::timeout(Duration::from_secs(10), sub.next()).await?.context("inbox closed")?;
        let kind = m.headers.as_ref().and_then(|h| h.get("Edgeway-Event")).map(|v| v.as_str().to_string());
        match kind.as_deref() {
            Some("delta") if first.is_none() => first = Some(t0.elapsed().as_micros() as u64),
            Some("done") => break,
            Some("error") => bail!("error event: {}", String::from_utf8_lossy(&m.payload)),
            None => bail!("not an edgeway event: {:?}", m.status),
            _ => {}
        }
    }
    first.context("no delta")
}
