//! The README's metrics table and the live `/metrics` name the same
//! families (issue 13): after a workload over HTTP and MQTT that touches
//! most paths, a family the gateway exports and the table lacks fails, and
//! so does a row marked `always` that the gateway does not export. Rows
//! marked otherwise (`event`, `gpu`, …) appear only once what they count
//! happens; `gpu` rows must be absent on a machine without an NVIDIA
//! driver (never a made-up 0).

mod mqtt_support;
#[path = "common/readme_metrics.rs"]
mod readme_metrics;

use std::collections::{BTreeMap, BTreeSet};

use edgeway::testing::OPS_KEY;
use mqtt_support::*;
use serde_json::json;

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
    if !std::path::Path::new("/proc/driver/nvidia").exists() {
        let faked: Vec<_> =
            rows.iter().filter(|r| r.shown == "gpu").flat_map(|r| &r.names).filter(|n| live.contains_key(*n)).collect();
        assert!(faked.is_empty(), "GPU figures without a GPU: {faked:?}");
    }
    gw.stop().await;
}
