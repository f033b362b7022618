//! What the benchmarks share: the machine line, percentiles, time to the
//! first SSE content chunk, the latency table rows, and writing results to
//! `bench/results/`. Each bench includes this with `mod common;` and uses
//! part of it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context as _, Result};
use futures::StreamExt;
use serde_json::{json, Value};

/// Arguments of a time-to-first-delta phase (flattened into a bench's own).
#[derive(clap::Args, Debug)]
pub struct FirstDeltaArgs {
    /// Measured requests per path in the time-to-first-delta phase.
    #[arg(long, default_value_t = 2000)]
    pub requests: usize,
    /// Unrecorded requests per path first.
    #[arg(long, default_value_t = 200)]
    pub warmup: usize,
    /// Tokens per answer from the fake engine.
    #[arg(long, default_value_t = 8)]
    pub tokens: u32,
}

/// The CPU, core count and load average at start, then `shares` (which
/// processes share these cores).
pub fn machine_line(shares: &str) -> String {
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0);
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let load: Vec<&str> = load.split_whitespace().take(3).collect();
    format!("Machine: {cores} cores ({cpu}); load average at start {}. {shares}", load.join(" "))
}

/// A report's title and machine line, and the JSON results they start
/// (machine line and arguments).
pub fn report_start(title: &str, shares: &str, args: &impl std::fmt::Debug) -> (String, Value) {
    let machine = machine_line(shares);
    let report = format!("# {title}\n\n{machine}\n\n");
    (report, json!({ "machine": machine, "args": format!("{args:?}") }))
}

/// The streamed chat request of the time-to-first-delta phases: "Say
/// hello" to `model`, at most 64 tokens.
pub fn chat_request(model: &str) -> Value {
    json!({"model": model, "stream": true, "max_tokens": 64,
        "messages": [{"role": "user", "content": "Say hello"}]})
}

/// Percentile `q` of sorted values (nearest rank); 0 when empty.
pub fn pct(sorted: &[u64], q: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Microseconds from sending a streamed chat request until the first SSE
/// chunk with content; the rest of the stream is read and dropped.
pub async fn sse_first_content(http: &reqwest::Client, url: &str, key: Option<&str>, body: &str) -> Result<u64> {
    let t0 = Instant::now();
    let mut req = http.post(url).header("content-type", "application/json").body(body.to_string());
    if let Some(k) = key {
        req = req.bearer_auth(k);
    }
    let resp = req.send().await?;
    if !resp.status().is_success() {
        bail!("{url}: {}", resp.status());
    }
    let mut stream = resp.bytes_stream();
    let mut first = None;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk?;
        if first.is_none() && contains(&chunk, b"\"content\":\"tok") {
            first = Some(t0.elapsed().as_micros() as u64);
        }
    }
    first.context("no content chunk")
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// The header of a latency table of [`latency_row`]s (µs).
pub const LATENCY_HEADER: &str =
    "| path | p50 µs | p90 µs | p99 µs | max µs | p50 added | p99 added |\n|---|---|---|---|---|---|---|";

/// A row of sorted latencies (µs): p50, p90, p99, max, and p50/p99 minus
/// those of `base` (the direct path).
pub fn latency_row(name: &str, v: &[u64], base: &[u64]) -> String {
    format!(
        "| {name} | {} | {} | {} | {} | {} | {} |",
        pct(v, 0.5),
        pct(v, 0.9),
        pct(v, 0.99),
        v.last().copied().unwrap_or(0),
        pct(v, 0.5) as i64 - pct(base, 0.5) as i64,
        pct(v, 0.99) as i64 - pct(base, 0.99) as i64,
    )
}

/// p50/p90/p99/max of sorted latencies, for the JSON results.
pub fn latency_json(v: &[u64]) -> Value {
    json!({"p50": pct(v, 0.5), "p90": pct(v, 0.9), "p99": pct(v, 0.99), "max": v.last().copied().unwrap_or(0)})
}

/// Prints the report, writes it and the JSON to
/// `bench/results/{kind}-{unix seconds}.{md,json}` and says where.
pub fn save_results(kind: &str, report: &str, json_out: &Value) -> Result<PathBuf> {
    println!("\n{report}");
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("bench/results");
    std::fs::create_dir_all(&dir)?;
    let stem = format!("{kind}-{}", SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs());
    std::fs::write(dir.join(format!("{stem}.json")), serde_json::to_string_pretty(json_out)?)?;
    let md = dir.join(format!("{stem}.md"));
    std::fs::write(&md, report)?;
    println!("results written to {}", md.display());
    Ok(md)
}
