//! What the MQTT ingress adds.
//!
//! Everything runs in this process on a multi-threaded runtime: the fake
//! engine with zero delays and a gateway (`TestGateway`) with `[mqtt]` on a
//! free port and the demo devices of `tests/mqtt_support`.
//!
//! 1. Time to first delta, one request at a time (closed loop), the four
//!    paths interleaved in every iteration: straight to the fake engine over
//!    HTTP (its time to the first content chunk), through edgeway over
//!    HTTP/SSE, through edgeway's broker as an MQTT 5 device
//!    (`demo-device-1`) and as an MQTT 3.1.1 device (`demo-device-2`), and
//!    as the same MQTT 5 device on a Mosquitto broker of which a second
//!    edgeway (`[mqtt] mode = "external"`, same engine) is a client, with
//!    the ACL and password files `edgeway mqtt-acl` writes.
//!    Each device is a rumqttc client (`TCP_NODELAY` on, like the HTTP
//!    client) subscribed once to `ai/v1/{d}/res/#`; per request it publishes
//!    a request with a fresh `request_id` and `coalesce_ms: 0` at QoS 1 on
//!    `ai/v1/{d}/req` and times from the publish call to the first `delta`
//!    of that request, polling the client's event loop itself (no channel
//!    in between). p50/p90/p99/max and the difference to direct. The JSON
//!    keeps every sample, when each iteration started, and when each MQTT
//!    request's PUBACK and `accepted` arrived, to find where stalls are.
//! 2. Messages and bytes a device receives per response of 64 tokens, with
//!    coalescing off (`coalesce_ms: 0`) and at the default (field left
//!    out), with the engine answering at once and with 5 ms per token.
//!    Bytes are topic plus payload of every message of the stream
//!    (`accepted` to `done`), not the MQTT framing.
//!
//! ```text
//! cargo bench --bench mqtt -- --requests 2000 --warmup 200 --tokens 8
//! ```
//!
//! Results are printed as Markdown and written to `bench/results/`.

mod common;
#[path = "../tests/mqtt_support/mod.rs"]
mod mqtt_support;

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};
use bytes::Bytes;
use clap::Parser;
use edgeway::config::Config;
use edgeway::ingress::mqtt::acl;
use edgeway::testing::{config_toml, FakeEngine, Knobs, Mosquitto, TempDir, TestGateway, DEMO_KEY};
use mqtt_support::{D1, D2, V};
use serde_json::{json, Value};

#[derive(Parser, Debug)]
#[command(about = "edgeway MQTT benchmark: request → first delta, messages and bytes per response")]
struct Args {
    #[command(flatten)]
    first: common::FirstDeltaArgs,
    /// Responses per row of the messages-and-bytes phase.
    #[arg(long, default_value_t = 20)]
    responses: usize,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

/// Who shares the machine's cores, for the machine line.
const SHARES: &str =
    "Fake engine, edgeway (with its broker), a second edgeway on Mosquitto, Mosquitto and the clients share these cores.";

/// edgeway's and the devices' passwords on the Mosquitto of the external
/// path (handed to the config loader as its environment).
fn external_env() -> Vec<(String, String)> {
    vec![
        ("BENCH_BROKER_PASSWORD".to_string(), "edgeway-bench-pass".to_string()),
        ("BENCH_D1".to_string(), D1.1.to_string()),
        ("BENCH_D2".to_string(), D2.1.to_string()),
    ]
}

/// A second edgeway, in `[mqtt] mode = "external"`, on a Mosquitto that
/// takes only the users and topics of the files `edgeway mqtt-acl` writes
/// from its config; the same engine and settings as the embedded path.
async fn external_gateway(engine_url: &str, settings: &str) -> Result<(TestGateway, Mosquitto, TempDir)> {
    let hash = |p: &str| hex::encode(edgeway::config::hash_api_key(p));
    let mqtt = |port: u16| {
        format!(
            r#"{settings}
[mqtt]
mode = "external"
[mqtt.external]
host = "127.0.0.1"
port = {port}
username = "edgeway"
password_env = "BENCH_BROKER_PASSWORD"
[devices.demo-device-1]
tenant = "demo"
application = "demo"
password_sha256 = "{}"
mqtt_password_env = "BENCH_D1"
[devices.demo-device-2]
tenant = "demo"
application = "demo"
password_sha256 = "{}"
mqtt_password_env = "BENCH_D2"
"#,
            hash(D1.1),
            hash(D2.1)
        )
    };
    let tmp = TempDir::new("edgeway-bench-ext");
    let config = |port: u16| -> Result<Config> {
        let text = config_toml(engine_url, "openai", &tmp.0, &mqtt(port))
            .replace("max_concurrency = 2", "max_concurrency = 64");
        Config::from_toml_str(&text, external_env(), Path::new("."))
            .map_err(|e| anyhow::anyhow!("external config: {e}"))
    };
    // The files do not depend on the broker's port.
    let env: std::collections::HashMap<_, _> = external_env().into_iter().collect();
    let files = acl::broker_files(&config(1)?, |v| env.get(v).cloned(), true).map_err(|e| anyhow::anyhow!("{e}"))?;
    acl::write_files(&tmp.0, &files)?;
    let broker = Mosquitto::with_acl(&tmp.0.join("mosquitto.passwd"), &tmp.0.join("mosquitto.acl")).await;
    let gw = TestGateway::start(config(broker.port)?).await;
    gw.wait_ready().await;
    // Until the broker has granted edgeway's subscriptions.
    let deadline = Instant::now() + STREAM_LIMIT;
    while !gw.gateway().readiness().await?.mqtt_bus.is_some_and(|m| m["subscribed"] == true) {
        if Instant::now() > deadline {
            bail!("edgeway never subscribed on Mosquitto:\n{}", broker.log());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok((gw, broker, tmp))
}

/// How long one request's stream may take before the run fails.
const STREAM_LIMIT: Duration = Duration::from_secs(10);

fn main() -> Result<()> {
    let args = Args::parse();
    edgeway::tls::install_default_provider();
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let (report, json_out) = rt.block_on(run(&args))?;
    common::save_results("mqtt", &report, &json_out)?;
    Ok(())
}

async fn run(args: &Args) -> Result<(String, Value)> {
    let fake = FakeEngine::start_with(Knobs { tokens: args.first.tokens, record: false, ..Knobs::default() }).await;
    let settings = "queue_capacity = 100000\n[log]\nlevel = \"warn\"\n";
    let extra = format!("{settings}{}", mqtt_support::mqtt_toml(""));
    // More engine slots than requests in flight: nothing queues behind the
    // tail of the previous request.
    let gw = TestGateway::with_engine_edit(&fake.url(), "openai", &extra, |t| {
        t.replace("max_concurrency = 2", "max_concurrency = 64")
    })
    .await;
    gw.wait_ready().await;
    let addr = gw.running.as_ref().context("gateway running")?.mqtt.context("mqtt is configured")?.mqtt;
    let mut dev5 = Device::connect(addr, V::V5, D1).await?;
    let mut dev4 = Device::connect(addr, V::V4, D2).await?;
    let (ext_gw, broker, _ext_tmp) = external_gateway(&fake.url(), settings).await?;
    let mut dev_ext = Device::connect(broker.addr(), V::V5, D1).await?;
    for d in [&mut dev5, &mut dev4, &mut dev_ext] {
        let filter = format!("ai/v1/{}/res/#", d.id);
        d.subscribe(&filter).await?;
    }

    let (mut report, mut out) = common::report_start("edgeway MQTT benchmark", SHARES, args);

    // 1. Time to first delta.
    let http = reqwest::Client::builder().http1_only().tcp_nodelay(true).build()?;
    let direct_body = common::chat_request("fake-model").to_string();
    let gw_body = common::chat_request("general-chat").to_string();
    // MQTT answers always stream; `stream` is left out as devices do.
    let mut mqtt_req = common::chat_request("general-chat");
    mqtt_req.as_object_mut().context("an object")?.remove("stream");
    mqtt_req["coalesce_ms"] = json!(0);
    let direct_url = format!("{}/v1/chat/completions", fake.url());
    let gw_url = format!("{}/v1/chat/completions", gw.base_url);
    // Per path, in iteration order (for the JSON), then sorted.
    let mut samples: [Vec<u64>; 5] = Default::default();
    // For finding stalls in the JSON: when each measured iteration
    // started, and when each MQTT request's PUBACK and `accepted` arrived.
    let (mut started_ms, mut steps_us) = (Vec::new(), [Vec::new(), Vec::new(), Vec::new()]);
    let t_start = Instant::now();
    for i in 0..args.first.warmup + args.first.requests {
        let at = t_start.elapsed().as_secs_f64() * 1e3;
        let d = common::sse_first_content(&http, &direct_url, None, &direct_body).await?;
        let h = common::sse_first_content(&http, &gw_url, Some(DEMO_KEY), &gw_body).await?;
        let m5 = dev5.request(&mqtt_req).await?;
        let m4 = dev4.request(&mqtt_req).await?;
        let mx = dev_ext.request(&mqtt_req).await?;
        if i >= args.first.warmup {
            for (s, v) in samples.iter_mut().zip([d, h, m5.first_delta_us, m4.first_delta_us, mx.first_delta_us]) {
                s.push(v);
            }
            started_ms.push((at * 10.0).round() / 10.0);
            steps_us[0].push([m5.puback_us, m5.accepted_us]);
            steps_us[1].push([m4.puback_us, m4.accepted_us]);
            steps_us[2].push([mx.puback_us, mx.accepted_us]);
        }
    }
    writeln!(
        report,
        "## Time to first delta ({} requests per path after {} warm-up, one at a time, paths interleaved, {} tokens)\n",
        args.first.requests, args.first.warmup, args.first.tokens
    )?;
    writeln!(report, "{}", common::LATENCY_HEADER)?;
    let names = [
        ("direct", "fake engine, direct (HTTP/SSE)"),
        ("edgeway_http", "edgeway HTTP/SSE"),
        ("edgeway_mqtt5", "edgeway MQTT 5 (QoS 1, `coalesce_ms: 0`)"),
        ("edgeway_mqtt311", "edgeway MQTT 3.1.1 (QoS 1, `coalesce_ms: 0`)"),
        ("edgeway_external_mqtt5", "edgeway as a client of Mosquitto, MQTT 5 device (QoS 1, `coalesce_ms: 0`)"),
    ];
    out["samples_us"] = json!({});
    let sorted: Vec<Vec<u64>> = samples
        .iter()
        .map(|s| {
            let mut s = s.clone();
            s.sort_unstable();
            s
        })
        .collect();
    for (((key, name), raw), v) in names.iter().zip(&samples).zip(&sorted) {
        writeln!(report, "{}", common::latency_row(name, v, &sorted[0]))?;
        out["first_delta_us"][key] = common::latency_json(v);
        out["samples_us"][key] = json!(raw);
    }
    out["iteration_started_ms"] = json!(started_ms);
    out["puback_accepted_samples_us"] = json!({"edgeway_mqtt5": steps_us[0], "edgeway_mqtt311": steps_us[1],
        "edgeway_external_mqtt5": steps_us[2]});
    let over: Vec<String> = names
        .iter()
        .zip(&sorted)
        .map(|((_, name), v)| format!("{name} {}", v.iter().filter(|&&x| x > 5_000).count()))
        .collect();
    writeln!(report, "\nSamples above 5 ms: {}.", over.join(", "))?;

    // 2. Messages and bytes per response.
    writeln!(
        report,
        "\n## Messages and bytes per response (64 tokens of 4 bytes, MQTT 5 device, {} responses per row)\n",
        args.responses
    )?;
    writeln!(
        report,
        "| engine | coalescing | messages per response | bytes per response (topic + payload) | bytes per output byte |"
    )?;
    writeln!(report, "|---|---|---|---|---|")?;
    let mut rows = Vec::new();
    for (pace_label, token_delay) in [("answers at once", 0), ("5 ms per token", 5)] {
        fake.set(|k| {
            k.tokens = 64;
            k.token_delay = Duration::from_millis(token_delay);
        });
        for (co_label, coalesce) in [("off (`coalesce_ms: 0`)", Some(0)), ("default (field left out)", None)] {
            let mut req = mqtt_req.clone();
            match coalesce {
                Some(c) => req["coalesce_ms"] = json!(c),
                None => {
                    req.as_object_mut().context("an object")?.remove("coalesce_ms");
                }
            }
            let mut sum = StreamStats::default();
            for _ in 0..args.responses {
                let s = dev5.request(&req).await?;
                if s.text_bytes != 64 * 4 {
                    bail!("expected 256 bytes of text, got {}", s.text_bytes);
                }
                sum.messages += s.messages;
                sum.bytes += s.bytes;
                sum.text_bytes += s.text_bytes;
            }
            let n = args.responses.max(1) as f64;
            writeln!(
                report,
                "| {pace_label} | {co_label} | {:.1} | {:.0} | {:.1} |",
                sum.messages as f64 / n,
                sum.bytes as f64 / n,
                sum.bytes as f64 / sum.text_bytes.max(1) as f64
            )?;
            rows.push(json!({"token_delay_ms": token_delay, "coalesce_ms": coalesce, "responses": args.responses,
                "messages": sum.messages, "bytes": sum.bytes, "text_bytes": sum.text_bytes}));
        }
    }
    out["per_response"] = json!(rows);
    drop((dev5, dev4, dev_ext));
    ext_gw.stop().await;
    drop(broker);
    gw.stop().await;
    Ok((report, out))
}

/// What a device received for one request.
#[derive(Debug, Default)]
struct StreamStats {
    /// From the publish call to the broker's PUBACK of the request.
    puback_us: u64,
    /// From the publish call to the request's `accepted`.
    accepted_us: u64,
    /// From the publish call to the first `delta` of the request.
    first_delta_us: u64,
    /// Messages of the stream, `accepted` to `done`.
    messages: u64,
    /// Topic plus payload bytes of those messages.
    bytes: u64,
    /// Bytes of `text` in the deltas.
    text_bytes: u64,
}

/// A client and its event loop (boxed: the two differ a lot in size).
enum Conn {
    V4(rumqttc::AsyncClient, Box<rumqttc::EventLoop>),
    V5(rumqttc::v5::AsyncClient, Box<rumqttc::v5::EventLoop>),
}

/// What one turn of a client's event loop brought in.
enum Incoming {
    ConnAck,
    SubAck,
    PubAck,
    Publish { topic: String, payload: Bytes },
    Other,
}

/// A device whose event loop is polled by whoever waits for it, so a
/// message is timed when the client decodes it.
struct Device {
    id: String,
    conn: Conn,
}

impl Device {
    async fn connect(addr: SocketAddr, v: V, (id, pass): (&str, &str)) -> Result<Device> {
        let mut net = rumqttc::NetworkOptions::new();
        net.set_tcp_nodelay(true);
        let host = addr.ip().to_string();
        let conn = match v {
            V::V4 => {
                let mut o = rumqttc::MqttOptions::new(id, host, addr.port());
                o.set_credentials(id, pass).set_keep_alive(Duration::from_secs(30));
                let (c, mut el) = rumqttc::AsyncClient::new(o, 64);
                el.set_network_options(net);
                Conn::V4(c, Box::new(el))
            }
            V::V5 => {
                let mut o = rumqttc::v5::MqttOptions::new(id, host, addr.port());
                o.set_credentials(id, pass).set_keep_alive(Duration::from_secs(30)).set_network_options(net);
                let (c, el) = rumqttc::v5::AsyncClient::new(o, 64);
                Conn::V5(c, Box::new(el))
            }
        };
        let mut dev = Device { id: id.to_string(), conn };
        dev.wait_for(|i| matches!(i, Incoming::ConnAck)).await.with_context(|| format!("{id} connects"))?;
        Ok(dev)
    }

    async fn subscribe(&mut self, filter: &str) -> Result<()> {
        match &self.conn {
            Conn::V4(c, _) => c.subscribe(filter, rumqttc::QoS::AtLeastOnce).await?,
            Conn::V5(c, _) => c.subscribe(filter, rumqttc::v5::mqttbytes::QoS::AtLeastOnce).await?,
        }
        self.wait_for(|i| matches!(i, Incoming::SubAck)).await
    }

    async fn wait_for(&mut self, want: impl Fn(&Incoming) -> bool) -> Result<()> {
        tokio::time::timeout(STREAM_LIMIT, async {
            loop {
                if want(&self.poll().await?) {
                    return Ok(());
                }
            }
        })
        .await
        .context("timed out")?
    }

    /// One turn of the event loop (it also sends what the client queued
    /// and acknowledges QoS 1 messages).
    async fn poll(&mut self) -> Result<Incoming> {
        Ok(match &mut self.conn {
            Conn::V4(_, el) => match el.poll().await? {
                rumqttc::Event::Incoming(rumqttc::Packet::ConnAck(_)) => Incoming::ConnAck,
                rumqttc::Event::Incoming(rumqttc::Packet::SubAck(_)) => Incoming::SubAck,
                rumqttc::Event::Incoming(rumqttc::Packet::PubAck(_)) => Incoming::PubAck,
                rumqttc::Event::Incoming(rumqttc::Packet::Publish(p)) => {
                    Incoming::Publish { topic: p.topic, payload: p.payload }
                }
                _ => Incoming::Other,
            },
            Conn::V5(_, el) => {
                use rumqttc::v5::mqttbytes::v5::Packet;
                match el.poll().await? {
                    rumqttc::v5::Event::Incoming(Packet::ConnAck(_)) => Incoming::ConnAck,
                    rumqttc::v5::Event::Incoming(Packet::SubAck(_)) => Incoming::SubAck,
                    rumqttc::v5::Event::Incoming(Packet::PubAck(_)) => Incoming::PubAck,
                    rumqttc::v5::Event::Incoming(Packet::Publish(p)) => {
                        Incoming::Publish { topic: String::from_utf8_lossy(&p.topic).into_owned(), payload: p.payload }
                    }
                    _ => Incoming::Other,
                }
            }
        })
    }

    /// Publishes `req` with a fresh `request_id` (QoS 1) and reads its
    /// stream up to `done`.
    async fn request(&mut self, req: &Value) -> Result<StreamStats> {
        let rid = uuid::Uuid::new_v4().to_string();
        let mut req = req.clone();
        req["request_id"] = json!(rid);
        let payload = serde_json::to_vec(&req)?;
        let (req_topic, res_topic) = (format!("ai/v1/{}/req", self.id), format!("ai/v1/{}/res/{rid}", self.id));
        let t0 = Instant::now();
        match &self.conn {
            Conn::V4(c, _) => c.publish(req_topic, rumqttc::QoS::AtLeastOnce, false, payload).await?,
            Conn::V5(c, _) => c.publish(req_topic, rumqttc::v5::mqttbytes::QoS::AtLeastOnce, false, payload).await?,
        }
        let mut s = StreamStats::default();
        let (mut puback, mut accepted, mut first) = (None, None, None);
        let deadline = tokio::time::Instant::now() + STREAM_LIMIT;
        loop {
            let incoming = tokio::time::timeout_at(deadline, self.poll())
                .await
                .with_context(|| format!("{}: stream of {rid} not done within {STREAM_LIMIT:?}", self.id))??;
            let at = t0.elapsed();
            let (topic, payload) = match incoming {
                Incoming::Publish { topic, payload } => (topic, payload),
                // One request in flight: this PUBACK is its.
                Incoming::PubAck => {
                    puback.get_or_insert(at);
                    continue;
                }
                _ => continue,
            };
            if topic != res_topic {
                continue;
            }
            s.messages += 1;
            s.bytes += (topic.len() + payload.len()) as u64;
            let v: Value = serde_json::from_slice(&payload).context("event is not JSON")?;
            match v["type"].as_str() {
                Some("delta") => {
                    first.get_or_insert(at);
                    s.text_bytes += v["text"].as_str().map_or(0, str::len) as u64;
                }
                Some("accepted") => accepted = Some(at),
                Some("done") => break,
                Some("error") => bail!("error event: {v}"),
                _ => {}
            }
        }
        s.puback_us = puback.map_or(0, |d| d.as_micros() as u64);
        s.accepted_us = accepted.context("no accepted")?.as_micros() as u64;
        s.first_delta_us = first.context("no delta")?.as_micros() as u64;
        Ok(s)
    }
}
