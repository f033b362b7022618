//! devices-sim in the suite: several devices on lossy links (latency,
//! jitter, a bandwidth limit, stalls and dropped connections) against a
//! gateway with the fake engine. Every request must complete, every `seq`
//! must arrive exactly once.

mod mqtt_support;

use std::time::Duration;

use devices_sim::{LinkProfile, SimConfig};
use mqtt_support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn devices_on_lossy_links_get_every_event_exactly_once() {
    let devices: Vec<(String, String)> = (1..=8).map(|i| (format!("sim-{i}"), format!("sim-pass-{i}"))).collect();
    let sections: String = devices
        .iter()
        .map(|(id, pw)| devices_sim::device_config(id, pw, "demo", "demo"))
        .collect::<Vec<_>>()
        .join("\n");
    let knobs = Knobs::slow(30, 15);
    let (fake, gw, addr) = start(knobs, &format!("coalesce_ms = 40\n{sections}")).await;
    let cfg = SimConfig {
        broker: addr,
        devices,
        requests_per_device: 4,
        cancel_ratio: 0.25,
        link: LinkProfile {
            latency: Duration::from_millis(15),
            jitter: Duration::from_millis(15),
            bandwidth: Some(32 * 1024),
            stall_probability: 0.02,
            stall: Duration::from_millis(300),
            drop_mean: Some(Duration::from_millis(1200)),
        },
        request_timeout: Duration::from_secs(60),
        keep_alive: Duration::from_secs(5),
        seed: 7,
        ..SimConfig::default()
    };
    let mut cfg = cfg;
    if std::env::var_os("SIM_CLEAN").is_some() {
        cfg.link = LinkProfile::default();
        cfg.devices.truncate(1);
    }
    let s = devices_sim::run(cfg).await.expect("simulation runs");
    println!("{}", s.render());
    assert_eq!(s.requests, 32);
    assert_eq!(s.completed, s.requests, "100 % completion: {s:#?}");
    assert_eq!((s.lost_events, s.duplicates, s.incomplete), (0, 0, 0), "{s:#?}");
    assert_eq!(s.errors, 0, "{s:#?}");
    assert!(s.connection_drops_injected > 0, "the links really dropped: {s:#?}");
    assert!(s.reconnects > 0);
    assert!(fake.stats.requests.load(std::sync::atomic::Ordering::SeqCst) <= 32, "no request ran twice");
    gw.stop().await;
}

/// The MQTT figures of BENCHMARKS.md (run with `--ignored --nocapture`):
/// request → first delta against a fake engine that answers at once, and
/// messages and bytes per response with and without coalescing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: prints figures"]
async fn bench_first_delta_and_coalescing() {
    // As many devices as engine slots: the first delta measures edgeway,
    // the broker and the client, not a queue.
    let n = 2;
    let devices: Vec<(String, String)> = (1..=n).map(|i| (format!("sim-{i}"), format!("sim-pass-{i}"))).collect();
    let sections: String = devices
        .iter()
        .map(|(id, pw)| devices_sim::device_config(id, pw, "demo", "demo"))
        .collect::<Vec<_>>()
        .join("\n");
    let knobs = Knobs::slow(64, 5);
    let (_fake, gw, addr) = start(knobs, &format!("max_connections = 100\n{sections}")).await;
    println!("| coalescing | responses | messages per response | wire bytes per response | wire bytes per output byte | first delta p50 | p99 |");
    println!("|---|---|---|---|---|---|---|");
    for (label, coalesce_ms, chunk) in
        [("off (one message per token)", 0, 1), ("50 ms / 512 B", 50, 512), ("100 ms / 512 B (default)", 100, 512)]
    {
        let cfg = SimConfig {
            broker: addr,
            devices: devices.clone(),
            requests_per_device: 50,
            max_tokens: 64,
            coalesce_ms: Some(coalesce_ms),
            max_chunk_bytes: Some(chunk),
            connect_concurrency: n,
            run: format!("c{coalesce_ms}"),
            ..SimConfig::default()
        };
        let s = devices_sim::run(cfg).await.expect("simulation runs");
        assert!(s.ok(), "{s:#?}");
        println!(
            "| {label} | {} | {:.1} | {:.0} | {:.1} | {:.1} ms | {:.1} ms |",
            s.requests,
            s.messages as f64 / s.requests as f64,
            s.wire_bytes as f64 / s.requests as f64,
            s.wire_bytes_per_output_byte,
            s.ttfd_p50_ms,
            s.ttfd_p99_ms
        );
    }
    gw.stop().await;
}
