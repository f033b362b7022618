//! The Prometheus figures of FR-10.1 (issue 13) against a fake engine on
//! real sockets: what a call, a stream and a client that goes away leave
//! in `/metrics`, that every label value comes from the configuration or a
//! fixed enum (never from a request), and the host's resources.

mod common;

use common::*;
use edgeway::error::ErrorCode;
use edgeway::task::{Ingress, Priority};
use serde_json::json;

/// `/metrics` as an operator's Prometheus scrapes it (admin key).
async fn scrape(gw: &TestGateway) -> String {
    let r = client().get(format!("{}/metrics", gw.base_url)).bearer_auth(OPS_KEY).send().await.unwrap();
    assert_eq!(r.status(), 200);
    r.text().await.unwrap()
}

/// The value of the series `series` (name and labels as Prometheus writes
/// them, labels sorted), if it exists.
fn value(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')).map(|v| v.trim().parse().unwrap())
}

/// Every (label, value) pair of every sample in `text`.
fn label_pairs(text: &str) -> Vec<(String, String, String)> {
    let mut out = Vec::new();
    for l in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((name, rest)) = l.split_once('{') else { continue };
        let labels = &rest[..rest.rfind('}').unwrap()];
        // Label values here never hold `",` (closed sets), so a split is
        // enough to read them.
        for pair in labels.split("\",").filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once("=\"").unwrap();
            out.push((name.to_string(), k.to_string(), v.trim_end_matches('"').to_string()));
        }
    }
    out
}

#[tokio::test]
async fn a_call_a_stream_and_a_client_that_leaves_show_in_the_request_figures() {
    let fake = FakeEngine::start_with(Knobs::slow(5, 20)).await;
    let gw = TestGateway::with_engine(&fake.url(), "openai", "").await;
    gw.wait_ready().await;

    // A whole answer: five tokens, 20 ms apart.
    let r = post_chat(&gw, DEMO_KEY, &chat_body(false)).await;
    assert_eq!(r.status(), 200);
    let text = scrape(&gw).await;
    let tpot = "edgeway_time_per_output_token_seconds";
    assert_eq!(value(&text, &format!("{tpot}_count{{model=\"general-chat\"}}")), Some(1.0), "{text}");
    let per_token = value(&text, &format!("{tpot}_sum{{model=\"general-chat\"}}")).unwrap();
    assert!((0.015..1.0).contains(&per_token), "about 20 ms a token: {per_token}");
    assert_eq!(value(&text, "edgeway_tasks_running{application=\"demo\",model=\"general-chat\"}"), Some(0.0));

    // A stream the client leaves while tokens flow: running while it
    // streams, then a cancel by the client.
    fake.set(|k| k.tokens = 1000);
    let mut events = gw.recorder().subscribe();
    let resp = post_chat(&gw, DEMO_KEY, &chat_body(true)).await;
    assert_eq!(resp.status(), 200);
    let streaming = next_event(&mut events, "streaming", |e| e.state == TaskState::Streaming).await;
    let text = scrape(&gw).await;
    assert_eq!(value(&text, "edgeway_tasks_running{application=\"demo\",model=\"general-chat\"}"), Some(1.0), "{text}");
    drop(resp);
    next_event(&mut events, "cancelled", |e| e.task_id == streaming.task_id && e.state == TaskState::Cancelled).await;
    let text = scrape(&gw).await;
    assert_eq!(value(&text, "edgeway_cancellations_total{by=\"client\",model=\"general-chat\"}"), Some(1.0), "{text}");
    assert_eq!(value(&text, "edgeway_tasks_running{application=\"demo\",model=\"general-chat\"}"), Some(0.0));
    assert_eq!(value(&text, "edgeway_requests_total{ingress=\"http\",outcome=\"REQUEST_CANCELLED\"}"), Some(1.0));
    assert_eq!(value(&text, "edgeway_first_token_seconds_count{model=\"general-chat\",priority=\"P2\"}"), Some(2.0));
    gw.stop().await;
}

#[tokio::test]
async fn label_values_come_from_the_configuration_and_fixed_sets_never_from_requests() {
    let fake = FakeEngine::start().await;
    let gw = TestGateway::with_engine(&fake.url(), "openai", "").await;
    gw.wait_ready().await;
    // Names a caller chose: a model, a request id, an unknown key, a user.
    let mut odd = chat_body(false);
    odd["model"] = json!("caller-made-model");
    odd["user"] = json!("caller-made-user");
    assert!(post_chat(&gw, DEMO_KEY, &odd).await.status().is_client_error());
    assert_eq!(post_chat(&gw, "sk-caller-made-key", &chat_body(false)).await.status(), 401);
    let mut ok = chat_body(false);
    ok["user"] = json!("caller-made-user");
    assert_eq!(post_chat(&gw, DEMO_KEY, &ok).await.status(), 200);

    let text = scrape(&gw).await;
    assert!(!text.contains("caller-made"), "a caller's word in /metrics:\n{text}");
    let codes: Vec<&str> = ErrorCode::ALL.iter().map(|c| c.as_str()).collect();
    for (name, label, v) in label_pairs(&text) {
        let allowed = match label.as_str() {
            "model" => v == "general-chat",
            "application" => ["demo", "ops"].contains(&v.as_str()),
            "engine" | "instance" => v == "fake",
            "priority" => Priority::ALL.iter().any(|p| p.as_str() == v),
            "ingress" => [Ingress::Http, Ingress::Mqtt, Ingress::Nats, Ingress::Ws].iter().any(|i| i.as_str() == v),
            "outcome" if name == "edgeway_requests_total" => v == "ok" || codes.contains(&v.as_str()),
            "code" => codes.contains(&v.as_str()),
            // Histogram buckets, listener names and the fixed enums of the
            // other families (states, reasons, directions) are no request's.
            _ => true,
        };
        assert!(allowed, "{name}: {label}=\"{v}\" is not from a closed set");
    }
    gw.stop().await;
}

#[tokio::test]
async fn the_hosts_cpu_memory_disk_and_network_are_exported_and_no_gpu_is_made_up() {
    let fake = FakeEngine::start().await;
    let gw = TestGateway::with_engine(&fake.url(), "openai", "").await;
    let text = scrape(&gw).await;
    let get = |name: &str| value(&text, name).unwrap_or_else(|| panic!("{name} missing:\n{text}"));
    assert!((0.0..=1.0).contains(&get("edgeway_host_cpu_usage_ratio")));
    assert!(get("edgeway_host_memory_total_bytes") >= get("edgeway_host_memory_available_bytes"));
    assert!(get("edgeway_host_memory_available_bytes") > 0.0);
    // The disk is the store's: the gateway's data directory.
    assert!(get("edgeway_host_disk_total_bytes") >= get("edgeway_host_disk_available_bytes"));
    assert!(get("edgeway_host_network_receive_bytes_total") >= 0.0);
    assert!(get("edgeway_host_network_transmit_bytes_total") >= 0.0);
    // This machine has no NVIDIA driver: no GPU figure, not even a 0.
    if !std::path::Path::new("/proc/driver/nvidia").exists() {
        assert!(!text.lines().any(|l| l.starts_with("edgeway_gpu_")), "{text}");
    }
    gw.stop().await;
}
