//! What edgeway adds, measured against the same engine without it.
//!
//! Overhead mode (default): an in-process fake engine with zero delays and
//! the release `edgeway` binary in its own process in front of it. An
//! open-loop load generator sends requests on a fixed schedule (latency is
//! measured from each request's scheduled send time, so a slow server cannot
//! slow the load down) straight to the fake and through edgeway, for
//! non-streaming answers (whole response) and streaming answers (time to the
//! first chunk with content). Reports p50/p90/p99/max, the difference
//! (added latency) and edgeway's CPU and memory.
//!
//! With `--litellm PATH` (the `litellm` executable that
//! `bench/setup-litellm.sh` installs), LiteLLM's proxy (one worker, in its
//! own process, pointed at the same fake engine) is measured by the same
//! load generator in the same run, as a third column: the comparison a user
//! makes. Its rows' "proxy" CPU and RSS columns are LiteLLM's process.
//!
//! Cancel mode (`--cancel`): a real llama-server and edgeway in front of it.
//! A raw TCP client starts a streaming answer, reads a few tokens, closes
//! the socket and polls `GET /slots` until the engine's slot is idle again;
//! once straight to llama-server, once through edgeway.
//!
//! ```text
//! cargo bench --bench overhead -- --rates 500,2000 --seconds 10
//! cargo bench --bench overhead -- --cancel --iterations 20
//! cargo bench --bench overhead -- --soak --rates 1000 --seconds 600
//! bench/setup-litellm.sh && cargo bench --bench overhead -- --rates 100,500 \
//!     --litellm ~/.cache/edgeway/litellm-venv/bin/litellm
//! ```
//!
//! Soak mode (`--soak`): only the non-streaming phase through edgeway, as
//! long as `--seconds`, with edgeway's RSS sampled every second and a table
//! per minute.
//!
//! Results are printed as Markdown and written to `bench/results/`.

mod common;

use std::fmt::Write as _;
use std::io::{Read as _, Seek as _, SeekFrom};
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};
use bytes::Bytes;
use clap::Parser;
use common::pct;
use edgeway::testing::{config_toml, FakeEngine, Knobs, TempDir, DEMO_KEY};
use futures::StreamExt;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::time::MissedTickBehavior;

#[derive(Parser, Debug)]
#[command(about = "edgeway overhead and cancel-latency benchmark")]
struct Args {
    /// Request rates (requests/s) of the open-loop load, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "500,2000")]
    rates: Vec<u32>,
    /// Measured seconds per phase.
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// Warm-up seconds per phase (same rate, not recorded).
    #[arg(long, default_value_t = 2)]
    warmup: u64,
    /// Tokens per answer from the fake engine.
    #[arg(long, default_value_t = 8)]
    tokens: u32,
    /// Measure cancel latency against llama-server instead of overhead.
    #[arg(long)]
    cancel: bool,
    /// Cancel-mode iterations (each: once direct, once through edgeway).
    #[arg(long, default_value_t = 20)]
    iterations: usize,
    /// Content tokens to read before disconnecting, in cancel mode.
    #[arg(long, default_value_t = 3)]
    tokens_before_cancel: usize,
    /// The edgeway binary (default: <target dir>/release/edgeway, built first).
    #[arg(long)]
    edgeway_bin: Option<PathBuf>,
    /// LiteLLM's `litellm` executable: measure its proxy too (overhead mode).
    #[arg(long)]
    litellm: Option<PathBuf>,
    /// Do not run `cargo build --release --bin edgeway` first.
    #[arg(long)]
    no_build: bool,
    /// Print p50/p99/max per second of each phase (always in the JSON).
    #[arg(long)]
    timeline: bool,
    /// A soak run instead: only the non-streaming phase through edgeway,
    /// `--seconds` long at each rate, with edgeway's RSS sampled every
    /// second and a table per minute (memory flat over a long run).
    #[arg(long)]
    soak: bool,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

fn main() -> Result<()> {
    let args = Args::parse();
    edgeway::tls::install_default_provider();
    let bin = edgeway_binary(&args)?;
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let mut report = String::new();
    writeln!(report, "# edgeway overhead benchmark\n")?;
    let machine = common::machine_line("Load generator, engine and edgeway share these cores.");
    writeln!(report, "{machine}\n")?;
    let mut json_out = json!({ "machine": machine });
    if args.cancel {
        rt.block_on(cancel_mode(&args, &bin, &mut report, &mut json_out))?;
    } else {
        rt.block_on(overhead_mode(&args, &bin, &mut report, &mut json_out))?;
    }
    json_out["command_args"] = json!(std::env::args().skip(1).collect::<Vec<_>>());
    common::save_results(if args.cancel { "cancel" } else { "overhead" }, &report, &json_out)?;
    Ok(())
}

// ---------------------------------------------------------------------------
// Overhead mode

/// One request shape sent by the load generator.
struct Target {
    url: String,
    auth: Option<String>,
    body: Bytes,
    stream: bool,
}

/// Latencies (µs) of the successful requests of one phase, and errors.
struct PhaseResult {
    name: String,
    sent: usize,
    lat_us: Vec<u64>,
    /// How late each request started after its scheduled time (µs, sorted):
    /// the load generator's own timer and scheduling delay, part of every
    /// latency.
    lag_us: Vec<u64>,
    errors: Vec<String>,
    wall: Duration,
    /// Per second of scheduled send time: (requests, p50, p99, max) in µs.
    timeline: Vec<(usize, u64, u64, u64)>,
    /// Cores used by edgeway / by this process / by the whole machine.
    edgeway_cores: Option<f64>,
    bench_cores: f64,
    machine_cores: f64,
    rss_kb: Option<u64>,
    /// edgeway's RSS (KiB), sampled once a second during the phase.
    rss_samples_kb: Vec<u64>,
}

impl PhaseResult {
    /// edgeway's CPU time (user + system, from /proc/<pid>/stat) per request
    /// sent, in µs: the overhead figure that load from other programs on
    /// the machine moves least (latency percentiles move with it).
    fn edgeway_cpu_us_per_request(&self) -> Option<f64> {
        let cores = self.edgeway_cores?;
        (self.sent > 0).then(|| cores * self.wall.as_secs_f64() * 1e6 / self.sent as f64)
    }
}

async fn overhead_mode(args: &Args, bin: &Path, report: &mut String, json_out: &mut Value) -> Result<()> {
    let fake = FakeEngine::start_with(Knobs { tokens: args.tokens, record: false, ..Knobs::default() }).await;
    let tmp = TempDir::new("edgeway-bench");
    let port = free_port()?;
    let extra = "queue_capacity = 100000\n\n[log]\nlevel = \"warn\"\n";
    let text = config_toml(&fake.url(), "openai", &tmp.0, extra)
        .replace("max_concurrency = 2", "max_concurrency = 512")
        .replace("listen = \"127.0.0.1:0\"", &format!("listen = \"127.0.0.1:{port}\""));
    let cfg_path = tmp.0.join("edgeway.toml");
    std::fs::write(&cfg_path, text)?;
    let gw_url = format!("http://127.0.0.1:{port}");
    let mut cmd = Command::new(bin);
    cmd.arg("serve").arg("--config").arg(&cfg_path);
    let gw = Proc::spawn("edgeway", cmd, &tmp.0.join("edgeway.log"))?;
    wait_http_ok(&format!("{gw_url}/ready"), Duration::from_secs(30), &gw).await?;
    eprintln!("edgeway (pid {}) ready at {gw_url}", gw.pid());
    let litellm = match &args.litellm {
        Some(exe) => Some(start_litellm(exe, &fake.url(), &tmp.0).await?),
        None => None,
    };

    let client = reqwest::Client::builder()
        .http1_only()
        .tcp_nodelay(true)
        .pool_max_idle_per_host(10_000)
        .pool_idle_timeout(Duration::from_secs(90))
        .timeout(Duration::from_secs(10))
        .build()?;
    let body = |model: &str, stream: bool| {
        Bytes::from(
            json!({
                "model": model,
                "messages": [{"role": "user", "content": "Say hello"}],
                "stream": stream,
                "max_tokens": args.tokens,
            })
            .to_string(),
        )
    };
    let target = |via: Via, stream: bool| {
        let (url, auth, model) = match via {
            Via::Direct => (format!("{}/v1/chat/completions", fake.url()), None, "fake-model"),
            Via::Edgeway => (format!("{gw_url}/v1/chat/completions"), Some(DEMO_KEY.to_string()), "general-chat"),
            Via::LiteLlm => {
                let l = litellm.as_ref().expect("LiteLLM phases run only with --litellm");
                (format!("{}/v1/chat/completions", l.url), Some(LITELLM_KEY.to_string()), "fake-model")
            }
        };
        Arc::new(Target { url, auth, body: body(model, stream), stream })
    };

    writeln!(
        report,
        "Overhead: fake engine ({} tokens, zero delays) in the bench process; \
         release edgeway in its own process; open-loop load, {} s measured \
         after {} s warm-up per phase. Latency in ms from the scheduled send \
         time; streaming = time to first content chunk.\n",
        args.tokens, args.seconds, args.warmup
    )?;
    writeln!(
        report,
        "| rate (req/s) | phase | ok | errors | p50 | p90 | p99 | max | send lag p50 / p99 | proxy CPU (cores) | proxy CPU per request (µs) | bench CPU (cores) | other CPU (cores) | proxy RSS (MiB) |"
    )?;
    writeln!(report, "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")?;
    let mut all = Vec::new();
    let mut soak_tables = Vec::new();
    for &rate in &args.rates {
        let mut phases = vec![
            ("non-stream direct", Via::Direct, false),
            ("non-stream via edgeway", Via::Edgeway, false),
            ("TTFT direct", Via::Direct, true),
            ("TTFT via edgeway", Via::Edgeway, true),
        ];
        if args.soak {
            phases.retain(|p| p.0 == "non-stream via edgeway");
        }
        if litellm.is_some() {
            phases.push(("non-stream via LiteLLM", Via::LiteLlm, false));
            phases.push(("TTFT via LiteLLM", Via::LiteLlm, true));
        }
        let mut results = Vec::new();
        for (name, via, stream) in phases {
            let t = target(via, stream);
            let pid = match via {
                Via::Direct => None,
                Via::Edgeway => Some(gw.pid()),
                Via::LiteLlm => litellm.as_ref().map(|l| l.proc.pid()),
            };
            eprintln!("rate {rate}/s: {name} …");
            let _ = run_phase(&client, &t, rate, secs(args.warmup), None, name).await;
            tokio::time::sleep(Duration::from_millis(500)).await;
            let r = run_phase(&client, &t, rate, secs(args.seconds), pid, name).await;
            if args.timeline {
                for (i, (n, p50, p99, max)) in r.timeline.iter().enumerate() {
                    eprintln!("  second {i}: {n} ok, p50 {} p99 {} max {} ms", ms(*p50), ms(*p99), ms(*max));
                }
            }
            if args.soak {
                eprintln!("{}", soak_table(&r));
                soak_tables.push(format!("Soak at {rate} req/s, per minute:\n\n{}", soak_table(&r)));
            }
            gw.check_alive()?;
            if let Some(l) = &litellm {
                l.proc.check_alive()?;
            }
            writeln!(report, "{}", phase_row(rate, &r))?;
            results.push(r);
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        all.push((rate, results));
    }
    for t in &soak_tables {
        writeln!(report, "\n{t}")?;
    }
    let hwm = proc_status_kb(gw.pid(), "VmHWM");
    let litellm_hwm = litellm.as_ref().and_then(|l| proc_status_kb(l.proc.pid(), "VmHWM"));
    let mib = |k: Option<u64>| k.map(|k| format!("{:.1} MiB", k as f64 / 1024.0)).unwrap_or_else(|| "n/a".into());
    writeln!(
        report,
        "\nAdded latency (via edgeway minus direct, ms), edgeway peak RSS over the whole run: {}{}\n",
        mib(hwm),
        if litellm.is_some() { format!("; LiteLLM's: {}", mib(litellm_hwm)) } else { String::new() }
    )?;
    if !args.soak {
        writeln!(
            report,
            "| rate (req/s) | measure | direct p50 | via p50 | added p50 | direct p99 | via p99 | added p99 |"
        )?;
        writeln!(report, "|---|---|---|---|---|---|---|---|")?;
    }
    let mut jrates = Vec::new();
    for (rate, results) in &all {
        let mut pairs = match results.len() >= 4 {
            true => vec![("non-stream", &results[0], &results[1]), ("TTFT", &results[2], &results[3])],
            false => Vec::new(),
        };
        if results.len() == 6 {
            pairs.push(("non-stream, LiteLLM", &results[0], &results[4]));
            pairs.push(("TTFT, LiteLLM", &results[2], &results[5]));
        }
        for (label, d, v) in pairs {
            let (d50, v50) = (pct(&d.lat_us, 0.50), pct(&v.lat_us, 0.50));
            let (d99, v99) = (pct(&d.lat_us, 0.99), pct(&v.lat_us, 0.99));
            writeln!(
                report,
                "| {rate} | {label} | {} | {} | {} | {} | {} | {} |",
                ms(d50),
                ms(v50),
                ms_signed(v50 as i64 - d50 as i64),
                ms(d99),
                ms(v99),
                ms_signed(v99 as i64 - d99 as i64),
            )?;
        }
        jrates.push(json!({
            "rate": rate,
            "phases": results.iter().map(phase_json).collect::<Vec<_>>(),
        }));
    }
    if let Some(l) = &litellm {
        writeln!(report, "\n{}", litellm_ratio_table(&all))?;
        json_out["litellm_version"] = json!(l.version);
    }
    json_out["overhead"] = json!({
        "seconds": args.seconds, "warmup": args.warmup, "tokens": args.tokens,
        "edgeway_vm_hwm_kb": hwm, "litellm_vm_hwm_kb": litellm_hwm, "rates": jrates,
    });
    drop(litellm);
    drop(gw);
    drop(fake);
    Ok(())
}

/// Where a phase's requests go.
#[derive(Clone, Copy)]
enum Via {
    Direct,
    Edgeway,
    LiteLlm,
}

/// LiteLLM's master key in the bench (it refuses to start without one).
const LITELLM_KEY: &str = "sk-bench-litellm-0123456789abcdef0123456789";

struct LiteLlm {
    proc: Proc,
    url: String,
    version: String,
}

/// Starts LiteLLM's proxy with one worker in front of the fake engine (an
/// OpenAI-compatible server, as edgeway's `openai` adapter sees it) and
/// waits until it answers. Offline: its model cost map is the local copy.
async fn start_litellm(exe: &Path, engine_url: &str, dir: &Path) -> Result<LiteLlm> {
    let port = free_port()?;
    let cfg = dir.join("litellm.yaml");
    std::fs::write(
        &cfg,
        format!(
            "model_list:\n  - model_name: fake-model\n    litellm_params:\n      model: openai/fake-model\n      \
             api_base: {engine_url}/v1\n      api_key: none\n"
        ),
    )?;
    let mut cmd = Command::new(exe);
    cmd.arg("--config").arg(&cfg).args(["--host", "127.0.0.1", "--port"]).arg(port.to_string());
    cmd.args(["--num_workers", "1"]);
    cmd.env("LITELLM_MASTER_KEY", LITELLM_KEY).env("LITELLM_LOCAL_MODEL_COST_MAP", "True");
    cmd.env("LITELLM_LOG", "ERROR");
    let proc = Proc::spawn("litellm", cmd, &dir.join("litellm.log"))?;
    let url = format!("http://127.0.0.1:{port}");
    wait_http_ok(&format!("{url}/health/liveliness"), Duration::from_secs(180), &proc).await?;
    let version = exe
        .parent()
        .map(|bin| bin.join("python3"))
        .and_then(|py| {
            Command::new(py).args(["-c", "import importlib.metadata as m; print(m.version('litellm'))"]).output().ok()
        })
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    eprintln!("LiteLLM {version} (pid {}) ready at {url}", proc.pid());
    Ok(LiteLlm { proc, url, version })
}

/// Per rate: added latency and CPU per request of edgeway and of LiteLLM,
/// and LiteLLM's figure over edgeway's (results in phase order: direct,
/// edgeway, direct, edgeway, LiteLLM, LiteLLM).
fn litellm_ratio_table(all: &[(u32, Vec<PhaseResult>)]) -> String {
    let mut t = String::from(
        "edgeway against LiteLLM (same fake engine, same load generator, same run):\n\n\
         | rate (req/s) | measure | edgeway added p50 / p99 (ms) | LiteLLM added p50 / p99 (ms) | edgeway CPU per request (µs) | LiteLLM CPU per request (µs) | LiteLLM errors |\n\
         |---|---|---|---|---|---|---|\n",
    );
    for (rate, r) in all {
        if r.len() < 6 {
            continue;
        }
        for (label, d, e, l) in [("non-stream", &r[0], &r[1], &r[4]), ("TTFT", &r[2], &r[3], &r[5])] {
            let added = |x: &PhaseResult, q: f64| ms_signed(pct(&x.lat_us, q) as i64 - pct(&d.lat_us, q) as i64);
            let cpu = |x: &PhaseResult| {
                x.edgeway_cpu_us_per_request().map(|c| format!("{c:.0}")).unwrap_or_else(|| "–".into())
            };
            let _ = writeln!(
                t,
                "| {rate} | {label} | {} / {} | {} / {} | {} | {} | {} |",
                added(e, 0.5),
                added(e, 0.99),
                added(l, 0.5),
                added(l, 0.99),
                cpu(e),
                cpu(l),
                error_summary(&l.errors),
            );
        }
    }
    t
}

async fn run_phase(
    client: &reqwest::Client,
    target: &Arc<Target>,
    rate: u32,
    dur: Duration,
    pid: Option<u32>,
    name: &str,
) -> PhaseResult {
    let n = (rate as f64 * dur.as_secs_f64()).round() as usize;
    let period = Duration::from_secs_f64(1.0 / rate as f64);
    let gw_before = pid.and_then(cpu_ticks);
    let self_before = cpu_ticks(std::process::id()).unwrap_or(0);
    let machine_before = machine_busy_ticks();
    let start = Instant::now();
    let sampling = tokio_util::sync::CancellationToken::new();
    let sampler = tokio::spawn({
        let stop = sampling.clone();
        async move {
            let mut samples = Vec::new();
            let Some(pid) = pid else { return samples };
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return samples,
                    _ = tick.tick() => samples.extend(proc_status_kb(pid, "VmRSS")),
                }
            }
        }
    });
    // Each request hands its result to a collector as it ends. A
    // JoinHandle kept per request until the run's end kept every finished
    // task's cell alive; with the fake engine keeping every request body
    // (`Knobs::record`), the load generator grew by about 3 KB a request
    // (3 GiB over a 10-minute soak at 2000 req/s), faulting in fresh pages
    // all through the run beside the proxy it measures.
    let (done_tx, mut done_rx) =
        tokio::sync::mpsc::unbounded_channel::<(usize, Result<(Duration, Duration), String>)>();
    let collector = tokio::spawn(async move {
        let mut lat_us = Vec::with_capacity(n);
        let mut lag_us = Vec::with_capacity(n);
        let mut errors = Vec::new();
        let mut per_second: Vec<Vec<u64>> = vec![Vec::new(); dur.as_secs() as usize + 1];
        while let Some((second, res)) = done_rx.recv().await {
            match res {
                Ok((lag, d)) => {
                    lag_us.push(lag.as_micros() as u64);
                    let us = d.as_micros() as u64;
                    lat_us.push(us);
                    if let Some(b) = per_second.get_mut(second) {
                        b.push(us);
                    }
                }
                Err(e) => errors.push(e),
            }
        }
        // A task that panicked dropped its sender without a result.
        let ended = lat_us.len() + errors.len();
        if ended < n {
            errors.extend(std::iter::repeat_n("task: ended without a result".to_string(), n - ended));
        }
        (lat_us, lag_us, errors, per_second)
    });
    let mut iv = tokio::time::interval(period);
    iv.set_missed_tick_behavior(MissedTickBehavior::Burst);
    for _ in 0..n {
        let scheduled = iv.tick().await.into_std();
        let second = scheduled.saturating_duration_since(start).as_secs() as usize;
        let (client, target, done) = (client.clone(), target.clone(), done_tx.clone());
        tokio::spawn(async move {
            let res = one_request(client, target, scheduled).await;
            let _ = done.send((second, res));
        });
    }
    drop(done_tx);
    let (mut lat_us, mut lag_us, errors, per_second) = collector.await.expect("the collector does not panic");
    let wall = start.elapsed();
    sampling.cancel();
    let rss_samples_kb = sampler.await.unwrap_or_default();
    let ticks = |after: Option<u64>, before: Option<u64>| match (after, before) {
        (Some(a), Some(b)) => Some(a.saturating_sub(b) as f64 / clk_tck() / wall.as_secs_f64()),
        _ => None,
    };
    let edgeway_cores = ticks(pid.and_then(cpu_ticks), gw_before);
    let bench_cores = ticks(cpu_ticks(std::process::id()), Some(self_before)).unwrap_or(0.0);
    let machine_cores = ticks(machine_busy_ticks(), machine_before).unwrap_or(0.0);
    lat_us.sort_unstable();
    lag_us.sort_unstable();
    let timeline = per_second
        .into_iter()
        .filter(|b| !b.is_empty())
        .map(|mut b| {
            b.sort_unstable();
            (b.len(), pct(&b, 0.50), pct(&b, 0.99), b[b.len() - 1])
        })
        .collect();
    PhaseResult {
        name: name.to_string(),
        sent: n,
        lat_us,
        lag_us,
        errors,
        wall,
        timeline,
        edgeway_cores,
        bench_cores,
        machine_cores,
        rss_kb: pid.and_then(|p| proc_status_kb(p, "VmRSS")),
        rss_samples_kb,
    }
}

/// A soak phase per minute: requests, latency percentiles and edgeway's RSS
/// at the minute's end (and its least and most within it).
fn soak_table(r: &PhaseResult) -> String {
    let mut t = String::from(
        "| minute | ok | p50 | p99 | max | worst second's p99 | RSS at its end (MiB) | RSS min–max in it (MiB) |\n|---|---|---|---|---|---|---|---|\n",
    );
    let mib = |k: u64| format!("{:.1}", k as f64 / 1024.0);
    for (m, secs) in r.timeline.chunks(60).enumerate() {
        let ok: usize = secs.iter().map(|s| s.0).sum();
        // Per-second percentiles, weighted by requests: close enough for a
        // trend (the whole phase's exact ones are in the main table).
        let w = |f: fn(&(usize, u64, u64, u64)) -> u64| {
            secs.iter().map(|s| f(s) as f64 * s.0 as f64).sum::<f64>() / ok.max(1) as f64
        };
        let worst = secs.iter().map(|s| s.2).max().unwrap_or(0);
        let max = secs.iter().map(|s| s.3).max().unwrap_or(0);
        let rss: &[u64] = r.rss_samples_kb.get(m * 60..((m + 1) * 60).min(r.rss_samples_kb.len())).unwrap_or(&[]);
        let _ = writeln!(
            t,
            "| {} | {ok} | {} | {} | {} | {} | {} | {} |",
            m + 1,
            ms(w(|s| s.1) as u64),
            ms(w(|s| s.2) as u64),
            ms(max),
            ms(worst),
            rss.last().map(|k| mib(*k)).unwrap_or_else(|| "–".into()),
            match (rss.iter().min(), rss.iter().max()) {
                (Some(a), Some(b)) => format!("{}–{}", mib(*a), mib(*b)),
                _ => "–".into(),
            },
        );
    }
    t
}

/// Sends one request at (or as soon as possible after) `scheduled`; returns
/// the latency from `scheduled` to the whole answer (non-streaming) or to
/// the first chunk with content (streaming), with how late it started.
async fn one_request(
    client: reqwest::Client,
    t: Arc<Target>,
    scheduled: Instant,
) -> Result<(Duration, Duration), String> {
    let lag = scheduled.elapsed();
    let mut rb = client.post(&t.url).header(reqwest::header::CONTENT_TYPE, "application/json").body(t.body.clone());
    if let Some(k) = &t.auth {
        rb = rb.bearer_auth(k);
    }
    let resp = rb.send().await.map_err(|e| err_kind(&e))?;
    let status = resp.status();
    if status != reqwest::StatusCode::OK {
        let _ = resp.bytes().await;
        return Err(format!("HTTP {}", status.as_u16()));
    }
    if !t.stream {
        resp.bytes().await.map_err(|e| err_kind(&e))?;
        return Ok((lag, scheduled.elapsed()));
    }
    let mut ttft = None;
    let mut buf = Vec::new();
    let mut body = resp.bytes_stream();
    while let Some(chunk) = body.next().await {
        let chunk = chunk.map_err(|e| err_kind(&e))?;
        if ttft.is_some() {
            continue; // drain to the end so the connection is reused
        }
        buf.extend_from_slice(&chunk);
        while let Some(nl) = buf.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = buf.drain(..=nl).collect();
            if sse_content(&line).is_some_and(|c| !c.is_empty()) {
                ttft = Some(scheduled.elapsed());
                buf.clear();
                break;
            }
        }
    }
    ttft.map(|d| (lag, d)).ok_or_else(|| "stream without content".to_string())
}

fn err_kind(e: &reqwest::Error) -> String {
    if e.is_timeout() {
        "timeout".into()
    } else if e.is_connect() {
        "connect".into()
    } else if e.is_body() || e.is_decode() {
        "body".into()
    } else {
        "request".into()
    }
}

/// The delta content of an SSE `data:` line, if it has one.
fn sse_content(line: &[u8]) -> Option<String> {
    let s = std::str::from_utf8(line).ok()?.trim();
    let data = s.strip_prefix("data:")?.trim();
    if data == "[DONE]" {
        return None;
    }
    let v: Value = serde_json::from_str(data).ok()?;
    v["choices"][0]["delta"]["content"].as_str().map(str::to_string)
}

fn phase_row(rate: u32, r: &PhaseResult) -> String {
    let l = &r.lat_us;
    // Everything else on the machine: other programs, the kernel's share
    // not charged to either process.
    let others = (r.machine_cores - r.bench_cores - r.edgeway_cores.unwrap_or(0.0)).max(0.0);
    format!(
        "| {rate} | {} | {} | {} | {} | {} | {} | {} | {} / {} | {} | {} | {:.2} | {:.2} | {} |",
        r.name,
        l.len(),
        error_summary(&r.errors),
        ms(pct(l, 0.50)),
        ms(pct(l, 0.90)),
        ms(pct(l, 0.99)),
        ms(l.last().copied().unwrap_or(0)),
        ms(pct(&r.lag_us, 0.50)),
        ms(pct(&r.lag_us, 0.99)),
        r.edgeway_cores.map(|c| format!("{c:.2}")).unwrap_or_else(|| "–".into()),
        r.edgeway_cpu_us_per_request().map(|c| format!("{c:.0}")).unwrap_or_else(|| "–".into()),
        r.bench_cores,
        others,
        r.rss_kb.map(|k| format!("{:.1}", k as f64 / 1024.0)).unwrap_or_else(|| "–".into()),
    )
}

fn phase_json(r: &PhaseResult) -> Value {
    let l = &r.lat_us;
    json!({
        "phase": r.name, "sent": r.sent, "ok": l.len(), "errors": r.errors.len(),
        "error_kinds": error_summary(&r.errors), "wall_s": r.wall.as_secs_f64(),
        "p50_us": pct(l, 0.50), "p90_us": pct(l, 0.90), "p99_us": pct(l, 0.99),
        "max_us": l.last().copied().unwrap_or(0),
        "send_lag_p50_us": pct(&r.lag_us, 0.50), "send_lag_p99_us": pct(&r.lag_us, 0.99),
        "edgeway_cores": r.edgeway_cores, "edgeway_cpu_us_per_request": r.edgeway_cpu_us_per_request(),
        "bench_cores": r.bench_cores,
        "machine_cores": r.machine_cores, "edgeway_rss_kb": r.rss_kb,
        "edgeway_rss_per_second_kb": r.rss_samples_kb,
        "timeline_per_second": r.timeline.iter()
            .map(|(n, p50, p99, max)| json!({"n": n, "p50_us": p50, "p99_us": p99, "max_us": max}))
            .collect::<Vec<_>>(),
    })
}

fn error_summary(errors: &[String]) -> String {
    if errors.is_empty() {
        return "0".into();
    }
    let mut kinds: std::collections::BTreeMap<&str, usize> = Default::default();
    for e in errors {
        *kinds.entry(e.as_str()).or_default() += 1;
    }
    let detail: Vec<String> = kinds.iter().map(|(k, n)| format!("{n}× {k}")).collect();
    format!("{} ({})", errors.len(), detail.join(", "))
}

// ---------------------------------------------------------------------------
// Cancel mode

async fn cancel_mode(args: &Args, bin: &Path, report: &mut String, json_out: &mut Value) -> Result<()> {
    let cache = std::env::var_os("EDGEWAY_CACHE").map(PathBuf::from).unwrap_or_else(|| home().join(".cache/edgeway"));
    let server = cache.join("bin/llama-server");
    let model = cache.join("models/gemma-3-270m-q4_k_m.gguf");
    for p in [&server, &model] {
        if !p.exists() {
            bail!("{} is missing: run scripts/setup-deps.sh (or set EDGEWAY_CACHE)", p.display());
        }
    }
    let tmp = TempDir::new("edgeway-bench-cancel");
    let llama_port = free_port()?;
    let mut cmd = Command::new(&server);
    cmd.arg("-m").arg(&model);
    cmd.args(["--alias", "gemma-3-270m", "--host", "127.0.0.1", "--port"]);
    cmd.arg(llama_port.to_string());
    cmd.args(["--parallel", "2", "--ctx-size", "8192", "--threads", "2"]);
    cmd.args(["--slots", "--no-webui"]);
    let llama = Proc::spawn("llama-server", cmd, &tmp.0.join("llama.log"))?;
    let llama_url = format!("http://127.0.0.1:{llama_port}");
    wait_http_ok(&format!("{llama_url}/health"), Duration::from_secs(180), &llama).await?;
    eprintln!("llama-server (pid {}) ready at {llama_url}", llama.pid());

    let gw_port = free_port()?;
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut cmd = Command::new(bin);
    cmd.arg("serve")
        .arg("--config")
        .arg(manifest.join("config/edgeway.toml"))
        .env("EDGEWAY__HTTP__LISTEN", format!("127.0.0.1:{gw_port}"))
        .env("EDGEWAY__STORE__DATA_DIR", tmp.0.join("data"))
        .env("EDGEWAY__ENGINES__LLAMA_LOCAL__BASE_URL", &llama_url)
        // /ready waits for every model of the config; the embeddings
        // engine is not measured here, and a chat llama-server answers its
        // health probe just the same.
        .env("EDGEWAY__ENGINES__LLAMA_EMBED__BASE_URL", &llama_url)
        .env("EDGEWAY__LOG__LEVEL", "warn")
        // edgeway takes an engine out of dispatch when, a grace period after
        // it cancelled a request, the engine runs more generations than
        // edgeway gave it. Here the direct client's runs are such
        // generations (edgeway expects to own the engine), so keep that
        // check out of the way; it does not touch the cancel path itself.
        .env("EDGEWAY__RESOURCES__CANCEL_GRACE_PERIOD_MS", "3600000");
    let gw = Proc::spawn("edgeway", cmd, &tmp.0.join("edgeway.log"))?;
    let gw_url = format!("http://127.0.0.1:{gw_port}");
    wait_http_ok(&format!("{gw_url}/ready"), Duration::from_secs(30), &gw).await?;
    eprintln!("edgeway (pid {}) ready at {gw_url}", gw.pid());

    let client = reqwest::Client::builder().http1_only().tcp_nodelay(true).timeout(Duration::from_secs(10)).build()?;
    let slots_url = format!("{llama_url}/slots");
    let body = |model: &str| {
        json!({
            "model": model,
            "messages": [{"role": "user", "content": "Tell me a long story about a dragon who learns to sail."}],
            "stream": true,
            "max_tokens": 500,
        })
        .to_string()
    };
    let direct =
        RawTarget { addr: SocketAddr::from(([127, 0, 0, 1], llama_port)), auth: None, body: body("gemma-3-270m") };
    let via = RawTarget {
        addr: SocketAddr::from(([127, 0, 0, 1], gw_port)),
        auth: Some(DEMO_KEY.to_string()),
        body: body("general-chat"),
    };
    // One unrecorded round each: loads the prompt cache, opens edgeway's
    // engine connection pool.
    for t in [&direct, &via] {
        wait_slots_idle(&client, &slots_url, Duration::from_secs(60)).await?;
        cancel_once(t, args.tokens_before_cancel, &client, &slots_url).await?;
    }
    let (mut d_ms, mut v_ms) = (Vec::new(), Vec::new());
    // Iterations where both clients got a figure: (direct, via) in µs.
    let mut pairs: Vec<(u64, u64)> = Vec::new();
    let pids = [llama.pid(), gw.pid(), std::process::id()];
    let ticks_before = pids.map(cpu_ticks);
    let machine_before = machine_busy_ticks();
    let started = Instant::now();
    let (mut d_err, mut v_err) = (Vec::new(), Vec::new());
    for i in 0..args.iterations {
        let mut pair = [None, None];
        for (k, (t, label)) in [(&direct, "direct"), (&via, "edgeway")].into_iter().enumerate() {
            wait_slots_idle(&client, &slots_url, Duration::from_secs(60)).await?;
            tokio::time::sleep(Duration::from_millis(300)).await;
            match cancel_once(t, args.tokens_before_cancel, &client, &slots_url).await {
                Ok(d) => {
                    eprintln!("iteration {}: {label} close → idle {:.1} ms", i + 1, d.as_secs_f64() * 1e3);
                    pair[k] = Some(d.as_micros() as u64);
                }
                Err(e) => {
                    let e = format!("{e:#}");
                    eprintln!("iteration {}: {label} failed: {e}", i + 1);
                    if k == 0 { &mut d_err } else { &mut v_err }.push(e);
                    tokio::time::sleep(Duration::from_secs(2)).await;
                }
            }
        }
        d_ms.extend(pair[0]);
        v_ms.extend(pair[1]);
        if let [Some(d), Some(v)] = pair {
            pairs.push((d, v));
        }
        if d_err.len() + v_err.len() > args.iterations / 2 + 1 {
            bail!("too many failed iterations: direct {d_err:?}, edgeway {v_err:?}");
        }
        gw.check_alive()?;
        llama.check_alive()?;
    }
    let secs_run = started.elapsed().as_secs_f64();
    let cores = |after: Option<u64>, before: Option<u64>| match (after, before) {
        (Some(a), Some(b)) => a.saturating_sub(b) as f64 / clk_tck() / secs_run,
        _ => 0.0,
    };
    let [llama_c, gw_c, bench_c] = [0, 1, 2].map(|i| cores(cpu_ticks(pids[i]), ticks_before[i]));
    let other_c = (cores(machine_busy_ticks(), machine_before) - llama_c - gw_c - bench_c).max(0.0);
    let (raw_d, raw_v) = (d_ms.clone(), v_ms.clone());
    let mut diffs: Vec<i64> = pairs.iter().map(|&(d, v)| v as i64 - d as i64).collect();
    diffs.sort_unstable();
    d_ms.sort_unstable();
    v_ms.sort_unstable();
    writeln!(
        report,
        "Cancel latency: client closes its TCP connection after {} content tokens of a \
         streaming answer; time until llama-server's `GET /slots` shows no slot \
         processing (polled every 2 ms). {} iterations, direct and via edgeway \
         alternating. ms. Average CPU over the {:.0} s of iterations: llama-server {:.2} \
         cores, edgeway {:.2}, bench {:.2}, everything else {:.2}.\n",
        args.tokens_before_cancel, args.iterations, secs_run, llama_c, gw_c, bench_c, other_c
    )?;
    writeln!(report, "| client | n | failed | p50 | p90 | p99 | max | mean |")?;
    writeln!(report, "|---|---|---|---|---|---|---|---|")?;
    for (label, l, errs) in [("straight to llama-server", &d_ms, &d_err), ("through edgeway", &v_ms, &v_err)] {
        writeln!(
            report,
            "| {label} | {} | {} | {} | {} | {} | {} | {} |",
            l.len(),
            error_summary(errs),
            ms(pct(l, 0.50)),
            ms(pct(l, 0.90)),
            ms(pct(l, 0.99)),
            ms(l.last().copied().unwrap_or(0)),
            ms(mean(l)),
        )?;
    }
    writeln!(
        report,
        "\nAdded by edgeway: p50 {} ms, p99 {} ms, mean {} ms",
        ms_signed(pct(&v_ms, 0.50) as i64 - pct(&d_ms, 0.50) as i64),
        ms_signed(pct(&v_ms, 0.99) as i64 - pct(&d_ms, 0.99) as i64),
        ms_signed(mean(&v_ms) as i64 - mean(&d_ms) as i64),
    )?;
    if !diffs.is_empty() {
        writeln!(
            report,
            "Per iteration (edgeway minus the direct run just before it, {} pairs): median {} ms, min {} ms, max {} ms",
            diffs.len(),
            ms_signed(diffs[(diffs.len() - 1) / 2]),
            ms_signed(diffs[0]),
            ms_signed(diffs[diffs.len() - 1]),
        )?;
    }
    for e in d_err.iter().chain(&v_err) {
        writeln!(report, "\nFailed iteration: `{}`", e.replace('\n', " ").replace('\r', ""))?;
    }
    json_out["cancel"] = json!({
        "iterations": args.iterations,
        "tokens_before_cancel": args.tokens_before_cancel,
        "direct_us": raw_d, "via_edgeway_us": raw_v, "pairs_us": pairs,
        "direct_errors": d_err, "via_edgeway_errors": v_err,
        "cores": {"llama_server": llama_c, "edgeway": gw_c, "bench": bench_c, "other": other_c},
    });
    drop(gw);
    drop(llama);
    Ok(())
}

struct RawTarget {
    addr: SocketAddr,
    auth: Option<String>,
    body: String,
}

/// Starts a streaming answer on a fresh TCP connection, reads until
/// `tokens` content deltas arrived, closes the socket and returns how long
/// the engine took to show every slot idle.
async fn cancel_once(t: &RawTarget, tokens: usize, client: &reqwest::Client, slots_url: &str) -> Result<Duration> {
    let mut sock = tokio::net::TcpStream::connect(t.addr).await?;
    sock.set_nodelay(true)?;
    let mut req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\n\
         Accept: text/event-stream\r\nContent-Length: {}\r\n",
        t.addr,
        t.body.len()
    );
    if let Some(k) = &t.auth {
        write!(req, "Authorization: Bearer {k}\r\n")?;
    }
    req.push_str("\r\n");
    req.push_str(&t.body);
    sock.write_all(req.as_bytes()).await?;

    // The body is chunked; SSE events are written one per chunk by both
    // servers, so `data:` lines arrive whole between chunk-size lines.
    let mut acc: Vec<u8> = Vec::new();
    let mut seen = 0;
    let mut checked_status = false;
    let mut buf = [0u8; 8192];
    let deadline = Instant::now() + Duration::from_secs(60);
    while seen < tokens {
        let left = deadline.saturating_duration_since(Instant::now());
        let n = tokio::time::timeout(left, sock.read(&mut buf)).await.context("no tokens within 60 s")??;
        if n == 0 {
            bail!("connection closed before {tokens} tokens: {}", String::from_utf8_lossy(&acc));
        }
        acc.extend_from_slice(&buf[..n]);
        if !checked_status {
            let Some(end) = acc.windows(2).position(|w| w == b"\r\n") else {
                continue;
            };
            let line = String::from_utf8_lossy(&acc[..end]).to_string();
            if !line.contains(" 200 ") {
                // Read what else arrives quickly, to show the error body.
                let _ = tokio::time::timeout(Duration::from_millis(200), sock.read_to_end(&mut acc)).await;
                let text = String::from_utf8_lossy(&acc).to_string();
                let body = text.split("\r\n\r\n").nth(1).unwrap_or("").trim();
                bail!("{line}: {}", body.chars().take(300).collect::<String>());
            }
            checked_status = true;
        }
        while let Some(nl) = acc.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = acc.drain(..=nl).collect();
            if sse_content(&line).is_some_and(|c| !c.is_empty()) {
                seen += 1;
            }
        }
    }
    let closed = Instant::now();
    drop(sock);
    let limit = closed + Duration::from_secs(30);
    loop {
        if !any_slot_processing(client, slots_url).await? {
            return Ok(closed.elapsed());
        }
        if Instant::now() > limit {
            bail!("slot still processing 30 s after the client closed");
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

async fn any_slot_processing(client: &reqwest::Client, url: &str) -> Result<bool> {
    let v: Value = client.get(url).send().await?.json().await?;
    let slots = v.as_array().context("GET /slots is not an array")?;
    Ok(slots.iter().any(|s| s["is_processing"].as_bool() == Some(true)))
}

async fn wait_slots_idle(client: &reqwest::Client, url: &str, limit: Duration) -> Result<()> {
    let deadline = Instant::now() + limit;
    while any_slot_processing(client, url).await? {
        if Instant::now() > deadline {
            bail!("llama-server slots still busy after {limit:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Processes, /proc, helpers

/// A child process killed when dropped, its output in a log file.
struct Proc {
    name: &'static str,
    child: std::process::Child,
    log: PathBuf,
}

impl Proc {
    fn spawn(name: &'static str, mut cmd: Command, log: &Path) -> Result<Proc> {
        let out = std::fs::File::create(log)?;
        cmd.env_remove("RUST_LOG").stdin(Stdio::null()).stdout(out.try_clone()?).stderr(out);
        let child = cmd.spawn().with_context(|| format!("cannot start {name} ({:?})", cmd.get_program()))?;
        Ok(Proc { name, child, log: log.to_path_buf() })
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn check_alive(&self) -> Result<()> {
        if !std::path::Path::new(&format!("/proc/{}", self.pid())).exists() || proc_state(self.pid()) == Some('Z') {
            bail!("{} exited; log:\n{}", self.name, tail(&self.log, 4000));
        }
        Ok(())
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn wait_http_ok(url: &str, limit: Duration, p: &Proc) -> Result<()> {
    let client = reqwest::Client::builder().timeout(Duration::from_secs(2)).build()?;
    let deadline = Instant::now() + limit;
    loop {
        if let Ok(r) = client.get(url).send().await {
            if r.status() == reqwest::StatusCode::OK {
                return Ok(());
            }
        }
        p.check_alive()?;
        if Instant::now() > deadline {
            bail!("{url} not ready after {limit:?}; {} log:\n{}", p.name, tail(&p.log, 4000));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn tail(path: &Path, n: u64) -> String {
    let Ok(mut f) = std::fs::File::open(path) else {
        return String::new();
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = f.seek(SeekFrom::Start(len.saturating_sub(n)));
    let mut s = String::new();
    let _ = f.read_to_string(&mut s);
    s
}

/// Builds edgeway in release (unless `--no-build`) and returns its path.
fn edgeway_binary(args: &Args) -> Result<PathBuf> {
    if let Some(b) = &args.edgeway_bin {
        return Ok(b.clone());
    }
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let target = std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| manifest.join("target"));
    let bin = target.join("release/edgeway");
    if !args.no_build {
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        eprintln!("cargo build --release --bin edgeway …");
        let ok = Command::new(cargo)
            .args(["build", "--release", "--bin", "edgeway"])
            .current_dir(manifest)
            .status()
            .context("cannot run cargo")?
            .success();
        if !ok {
            bail!("cargo build --release --bin edgeway failed");
        }
    }
    if !bin.exists() {
        bail!("{} not found", bin.display());
    }
    Ok(bin)
}

fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn home() -> PathBuf {
    std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("/root"))
}

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

/// Fields after the command name in /proc/<pid>/stat (field 3 first).
fn proc_stat_fields(pid: u32) -> Option<Vec<String>> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &s[s.rfind(')')? + 1..];
    Some(rest.split_whitespace().map(str::to_string).collect())
}

/// utime + stime of a process, in clock ticks.
fn cpu_ticks(pid: u32) -> Option<u64> {
    let f = proc_stat_fields(pid)?;
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

fn proc_state(pid: u32) -> Option<char> {
    proc_stat_fields(pid)?.first()?.chars().next()
}

/// Busy clock ticks of the whole machine (all CPUs), from /proc/stat.
fn machine_busy_ticks() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/stat").ok()?;
    let cpu = s.lines().next()?.strip_prefix("cpu ")?;
    let v: Vec<u64> = cpu.split_whitespace().filter_map(|x| x.parse().ok()).collect();
    // user nice system idle iowait irq softirq steal (guest is in user)
    let total: u64 = v.iter().take(8).sum();
    Some(total - v.get(3)? - v.get(4)?)
}

fn proc_status_kb(pid: u32, field: &str) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = s.lines().find(|l| l.starts_with(&format!("{field}:")))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

fn clk_tck() -> f64 {
    static TCK: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *TCK.get_or_init(|| {
        Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(100.0)
    })
}

fn mean(v: &[u64]) -> u64 {
    if v.is_empty() {
        0
    } else {
        v.iter().sum::<u64>() / v.len() as u64
    }
}

fn ms(us: u64) -> String {
    format!("{:.3}", us as f64 / 1000.0)
}

fn ms_signed(us: i64) -> String {
    format!("{:+.3}", us as f64 / 1000.0)
}
