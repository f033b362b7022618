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
    lossy_links(false).await;
}

/// The same with compact streams, whose seqs the devices mostly count
/// (topics/README.md "Compact streams"): the counts must hold across
/// every drop and resume.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compact_devices_on_lossy_links_get_every_event_exactly_once() {
    lossy_links(true).await;
}

async fn lossy_links(compact: bool) {
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
        compact,
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
    assert_eq!(s.recounts, 0, "no written seq disagreed with a device's count: {s:#?}");
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

/// BENCHMARKS.md "Session 12: compact device streams" (run with
/// `--ignored --nocapture`; `RESPONSES=n` per row, default 3): what one
/// device's stream costs on the wire, counted by devices-sim's proxy
/// (MQTT framing, topic, packet id, properties and payload of every packet),
/// per byte of answer text, against a fake engine at the real demo
/// engine's pace (28 ms a token, about 36 tokens/s; 3-byte tokens, against
/// the real one's 3.2 bytes on average), 256 and 64 tokens. Rows: the JSON
/// form and the compact form at 100 ms (the default) and 500 ms coalescing,
/// as an MQTT 5 device that allows topic aliases and as an MQTT 3.1.1
/// device. Request ids are short (`r12`), as in issue 18's figure. "to the
/// device" counts what edgeway sent (the stream, and the PUBACK of the
/// request); "both ways" adds the request and the device's PUBACKs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: prints figures"]
async fn bench_compact_streams_wire_bytes() {
    let responses: usize = std::env::var("RESPONSES").ok().and_then(|v| v.parse().ok()).unwrap_or(3);
    // A real engine (an OpenAI-compatible server such as the quick start's
    // llama-server) instead of the fake: its own pace and text.
    let engine = std::env::var("ENGINE_URL").ok();
    let mut n = 0;
    println!(
        "| tokens | device | form | coalescing | messages per response | output bytes per response | \
         bytes to the device per response | to the device per output byte (min–max) | both ways per output byte |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for tokens in [256, 64] {
        let (_fake, gw, addr) = match &engine {
            Some(url) => {
                let gw = TestGateway::with_engine(url, "openai", &mqtt_toml("")).await;
                gw.wait_ready().await;
                let addr = gw.running.as_ref().unwrap().mqtt.expect("mqtt is configured").mqtt;
                (None, gw, addr)
            }
            None => {
                let knobs = Knobs {
                    tokens,
                    token_text: "ok ".into(),
                    token_delay: Duration::from_millis(28),
                    ..Knobs::default()
                };
                let (fake, gw, addr) = start(knobs, "").await;
                (Some(fake), gw, addr)
            }
        };
        for (client, v5, qos1) in [
            ("MQTT 5, topic aliases, QoS 1", true, true),
            ("MQTT 5, topic aliases, QoS 0", true, false),
            ("MQTT 3.1.1, QoS 1", false, true),
        ] {
            for (form, coalesce_ms) in
                [(Form::Json, 100), (Form::Json, 500), (Form::Compact, 100), (Form::Compact, 500)]
            {
                let proxy = devices_sim::Proxy::start(addr, LinkProfile::default(), 1).await.expect("proxy");
                let mut d = match v5 {
                    true => device_with_aliases(proxy.addr, D1, 16).await,
                    false => device(proxy.addr, V::V4, D1).await,
                };
                form.subscribe_at(&mut d, qos1).await;
                let (mut messages, mut output, mut down, mut all) = (0, 0, 0, 0);
                let mut ratios = Vec::new();
                for _ in 0..responses {
                    n += 1;
                    let rid = format!("r{n}");
                    let mut req = form.request(&rid);
                    req["coalesce_ms"] = coalesce_ms.into();
                    req["max_tokens"] = tokens.into();
                    if engine.is_some() {
                        req["temperature"] = 0.into();
                        req["messages"][0]["content"] =
                            "Tell me a long story about a lighthouse keeper and the ships he saw.".into();
                    }
                    let (down0, all0) = (proxy.stats.down_bytes(), proxy.stats.bytes());
                    d.publish(&d.topic("req"), req.to_string()).await;
                    let events = StreamReader::new(form, &rid).until_end(&mut d).await;
                    // The proxy counts a chunk just after writing it.
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    let text = check_stream(&events);
                    let done = events.last().unwrap();
                    let usage = match form {
                        Form::Json => &done["result"]["usage"],
                        Form::Compact => &done["usage"],
                    };
                    assert_eq!(usage["output_tokens"], tokens, "a whole answer of {tokens} tokens: {done}");
                    if engine.is_none() {
                        assert_eq!(text.len(), 3 * tokens as usize);
                    }
                    let (dn, al) = (proxy.stats.down_bytes() - down0, proxy.stats.bytes() - all0);
                    messages += events.len();
                    output += text.len();
                    down += dn;
                    all += al;
                    ratios.push(dn as f64 / text.len() as f64);
                }
                let r = responses as f64;
                let (lo, hi) = ratios.iter().fold((f64::MAX, 0f64), |(l, h), x| (l.min(*x), h.max(*x)));
                println!(
                    "| {tokens} | {client} | {form:?} | {coalesce_ms} ms | {:.1} | {:.0} | {:.0} | {:.2} ({lo:.2}–{hi:.2}) | {:.2} |",
                    messages as f64 / r,
                    output as f64 / r,
                    down as f64 / r,
                    down as f64 / output as f64,
                    all as f64 / output as f64,
                );
                d.disconnect_and_wait().await;
                proxy.stop();
            }
        }
        gw.stop().await;
    }
}
