//! The README's metrics table and the live `/metrics` name the same
//! families (issue 13): after a workload over HTTP and MQTT that touches
//! most paths, a family the gateway exports and the table lacks fails, and
//! so does a row marked `always` that the gateway does not export. Rows
//! marked otherwise (`event`, `gpu`, …) appear only once what they count
//! happens; `gpu` rows must be absent on a machine without an NVIDIA
//! driver (never a made-up 0). The label names of every exported family
//! are the table's, and every `event` row shows after the workload unless
//! it is one of [`NOT_IN_THIS_WORKLOAD`] (which then must not show: the
//! list stays exact).

mod mqtt_support;
#[path = "common/readme_metrics.rs"]
mod readme_metrics;

use std::collections::{BTreeMap, BTreeSet};

use edgeway::testing::OPS_KEY;
use mqtt_support::*;
use serde_json::json;

/// `event` rows this workload does not trigger (in the table's order), and
/// why. A row added to the table as `event` must show here or be listed.
const NOT_IN_THIS_WORKLOAD: &[&str] = &[
    "edgeway_budget_used_ratio",              // needs a budget (tests/budgets.rs)
    "edgeway_budget_warnings_total",          // needs a budget crossing its warn_percent (tests/budgets.rs)
    "edgeway_context_summaries_total",        // needs a session summary model (tests/sessions.rs)
    "edgeway_tool_calls_total",               // needs a request with tools (tests/tools.rs)
    "edgeway_engine_kv_cache_usage_ratio",    // the fake reports no KV use here
    "edgeway_fallbacks_total",                // one instance, never down (tests/routing.rs)
    "edgeway_retries_total",                  // no engine failure
    "edgeway_retries_refused_total",          // no retry budget spent
    "edgeway_breaker_transitions_total",      // no engine failure
    "edgeway_preemptions_total",              // no P0 work against a full engine
    "edgeway_illegal_transitions_total",      // 0 unless there is a bug
    "edgeway_http_connections_refused_total", // under the connection cap (tests/http_hostile.rs)
    "edgeway_http_connections_closed_total",  // no timeout or age reached (tests/http_hostile.rs)
    "edgeway_http_accept_errors_total",       // accept() does not fail here
    "edgeway_mqtt_rejected_total",            // the device's request is taken
    "edgeway_mqtt_resumes_total",             // no stream resume
];

/// Family name → the label names its samples carry (histogram series
/// folded into their family, `le` left out).
fn live_labels(text: &str, families: &BTreeMap<String, String>) -> BTreeMap<String, BTreeSet<String>> {
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for line in text.lines().filter(|l| !l.starts_with('#') && !l.is_empty()) {
        let name_end = line.find(['{', ' ']).unwrap_or(line.len());
        let series = &line[..name_end];
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| series.strip_suffix(s).filter(|f| families.get(*f).is_some_and(|t| t == "histogram")))
            .unwrap_or(series);
        let labels = out.entry(family.to_string()).or_default();
        let Some(rest) = line[name_end..].strip_prefix('{') else { continue };
        // key="value" pairs; values may hold escaped quotes, commas, braces.
        let mut chars = rest.chars();
        loop {
            let key: String = chars.by_ref().take_while(|c| *c != '=').collect();
            if key.is_empty() || key.starts_with('}') {
                break;
            }
            assert_eq!(chars.next(), Some('"'), "{line}");
            let mut escaped = false;
            for c in chars.by_ref() {
                match (escaped, c) {
                    (false, '\\') => escaped = true,
                    (false, '"') => break,
                    _ => escaped = false,
                }
            }
            if key != "le" {
                labels.insert(key.trim_start_matches(',').to_string());
            }
            if chars.clone().next() == Some(',') {
                chars.next();
            }
        }
    }
    out
}

/// Family name → type, from the `# TYPE` lines of a scrape.
fn live_families(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .map(|l| {
            let (n, t) = l.split_once(' ').unwrap();
            (n.to_string(), t.to_string())
        })
        .collect()
}

#[tokio::test]
async fn the_readme_table_and_the_live_metrics_name_the_same_families() {
    let (fake, gw, addr) = start(Knobs::slow(5, 10), "").await;
    let http = reqwest::Client::new();
    let chat = format!("{}/v1/chat/completions", gw.base_url);
    let body = |stream: bool| json!({"model": "general-chat", "messages": [{"role": "user", "content": "hi"}], "stream": stream});
    // HTTP: an answer, a stream, a refused key, an unknown model.
    for (key, b) in [("sk-edgeway-demo", body(false)), ("sk-edgeway-demo", body(true)), ("sk-wrong", body(false))] {
        let r = http.post(&chat).bearer_auth(key).json(&b).send().await.unwrap();
        let _ = r.bytes().await;
    }
    let mut odd = body(false);
    odd["model"] = json!("no-such-model");
    let _ = http.post(&chat).bearer_auth("sk-edgeway-demo").json(&odd).send().await.unwrap().bytes().await;
    // The same knowledge passage twice: the assembly drops one (a trim).
    let mut twice = body(false);
    let passage = json!({"text": "Pump 3 runs at 60 C.", "source": "wiki/pumps"});
    twice["edge"] = json!({"context": {"knowledge": [passage.clone(), passage]}});
    let r = http.post(&chat).bearer_auth("sk-edgeway-demo").json(&twice).send().await.unwrap();
    assert_eq!(r.status(), 200);
    // A stream the client leaves (a cancel by the client).
    fake.set(|k| k.tokens = 1000);
    let mut events = gw.recorder().subscribe();
    let r = http.post(&chat).bearer_auth("sk-edgeway-demo").json(&body(true)).send().await.unwrap();
    let id = loop {
        let e = events.recv().await.unwrap();
        if e.state == edgeway::task::TaskState::Streaming {
            break e.task_id.clone();
        }
    };
    drop(r);
    gw.wait_for_state(&id, edgeway::task::TaskState::Cancelled).await;
    fake.set(|k| k.tokens = 5);
    // MQTT: a device asks and gets its answer.
    let mut d = device(addr, V::V4, D1).await;
    d.subscribe(&d.topic("res/#")).await;
    d.publish(&d.topic("req"), request("r-metrics").to_string()).await;
    let answer = d.stream(&d.topic("res/r-metrics")).await;
    assert!(!answer.is_empty());

    let scrape = http.get(format!("{}/metrics", gw.base_url)).bearer_auth(OPS_KEY).send().await.unwrap();
    let text = scrape.text().await.unwrap();
    let live = live_families(&text);
    let rows = readme_metrics::rows();
    let mut documented = BTreeSet::new();
    for row in &rows {
        for n in &row.names {
            documented.insert(n.clone());
            if let Some(t) = live.get(n) {
                assert_eq!(t, &row.kind, "{n}: the table says {}, /metrics says {t}", row.kind);
            }
        }
    }
    let undocumented: Vec<_> = live.keys().filter(|n| !documented.contains(*n)).collect();
    assert!(undocumented.is_empty(), "exported but not in the README table: {undocumented:?}");
    let missing: Vec<_> =
        rows.iter().filter(|r| r.shown == "always").flat_map(|r| &r.names).filter(|n| !live.contains_key(*n)).collect();
    assert!(missing.is_empty(), "in the README table as `always` but not exported: {missing:?}\n{text}");
    // The label names: the table's, for every family exported.
    let labels = live_labels(&text, &live);
    for row in &rows {
        let want: BTreeSet<String> = row.labels.iter().cloned().collect();
        for n in row.names.iter().filter(|n| labels.contains_key(*n)) {
            assert_eq!(labels[n], want, "{n}: /metrics has these labels, the table says {want:?}");
        }
    }
    assert!(
        text.contains("edgeway_context_trims_total{step=\"knowledge_deduplicated\"} 1"),
        "the duplicate passage was counted: {text}"
    );
    // `event` rows show once what they count happened: each does after
    // this workload, or is listed as not in it (and then does not show).
    let event_names = rows.iter().filter(|r| r.shown == "event").flat_map(|r| &r.names);
    let absent: Vec<&String> = event_names.filter(|n| !live.contains_key(*n)).collect();
    let listed: Vec<&str> = NOT_IN_THIS_WORKLOAD.to_vec();
    assert_eq!(absent.iter().map(|n| n.as_str()).collect::<Vec<_>>(), listed, "event rows this workload did not show");
    if !std::path::Path::new("/proc/driver/nvidia").exists() {
        let faked: Vec<_> =
            rows.iter().filter(|r| r.shown == "gpu").flat_map(|r| &r.names).filter(|n| live.contains_key(*n)).collect();
        assert!(faked.is_empty(), "GPU figures without a GPU: {faked:?}");
    }
    gw.stop().await;
}
