//! `edgeway_requests_total` counts each call once, whatever its door: a
//! call refused by admission over MQTT used to be counted twice (once by
//! the gateway, again by the MQTT ingress when it answered the device).

mod mqtt_support;

use mqtt_support::*;
use serde_json::json;

/// The value of `edgeway_requests_total{ingress, outcome}` in /metrics
/// text (0 when the series does not exist yet).
fn requests_total(metrics: &str, ingress: &str, outcome: &str) -> u64 {
    let series = format!("edgeway_requests_total{{ingress=\"{ingress}\",outcome=\"{outcome}\"}} ");
    metrics.lines().find_map(|l| l.strip_prefix(&series)).map_or(0, |v| v.trim().parse().unwrap())
}

#[tokio::test]
async fn an_mqtt_request_refused_at_admission_is_counted_once() {
    let (_fake, gw, addr) = start(Knobs::default(), "").await;
    let mut d = device(addr, V::V4, D1).await;
    d.subscribe(&d.topic("res/#")).await;

    // Refused by the gateway's admission: the demo application may not
    // use P0.
    let mut bad = request("r-too-urgent");
    bad["priority"] = json!("P0");
    d.publish(&d.topic("req"), bad.to_string()).await;
    let refused = d.stream(&d.topic("res/r-too-urgent")).await;
    assert_eq!((refused.len(), &refused[0]["code"]), (1, &json!("PERMISSION_DENIED")), "{refused:?}");

    // Refused before admission: not JSON.
    d.publish(&d.topic("req"), r#"{"request_id": "r-broken", "messages": [ oops"#).await;
    let broken = d.stream(&d.topic("res/r-broken")).await;
    assert_eq!(broken[0]["code"], "INVALID_REQUEST");

    let text = gw.gateway().metrics().render();
    assert_eq!(requests_total(&text, "mqtt", "PERMISSION_DENIED"), 1, "counted once:\n{text}");
    assert_eq!(requests_total(&text, "mqtt", "INVALID_REQUEST"), 1, "counted once:\n{text}");
    gw.stop().await;
}

#[tokio::test]
async fn an_http_call_is_counted_once_whatever_refuses_it() {
    let (_fake, gw, _) = start(Knobs::default(), "").await;
    let http = reqwest::Client::new();
    let url = format!("{}/v1/chat/completions", gw.base_url);
    let mut urgent = request("r-http");
    urgent["priority"] = json!("P0");
    let calls = [
        ("sk-wrong", urgent.to_string()),        // the credential
        ("sk-edgeway-demo", "{oops".into()),     // the body
        ("sk-edgeway-demo", urgent.to_string()), // admission
    ];
    for (key, body) in calls {
        let r = http.post(&url).bearer_auth(key).header("content-type", "application/json").body(body);
        assert!(r.send().await.unwrap().status().is_client_error());
    }
    let text = gw.gateway().metrics().render();
    for outcome in ["AUTH_FAILED", "INVALID_REQUEST", "PERMISSION_DENIED"] {
        assert_eq!(requests_total(&text, "http", outcome), 1, "{outcome} counted once:\n{text}");
    }
    gw.stop().await;
}
