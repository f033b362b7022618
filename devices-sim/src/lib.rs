//! devices-sim: many MQTT devices on bad links against edgeway.
//!
//! Every device connects (rumqttc, MQTT 3.1.1) through a built-in TCP proxy
//! that injects latency, jitter, a bandwidth limit, stalls (what packet
//! loss looks like to TCP: nothing for a while) and dropped connections.
//! Each device sends requests one after the other, cancels some, and after
//! every reconnect resumes its unfinished request from the `seq` it
//! expects next (or sends the request again if it got nothing of it yet).
//! It checks that it receives every `seq` of each stream exactly once and
//! exactly one terminal event.
//!
//! With `compact`, the requests ask for compact streams (edgeway's
//! topics/README.md "Compact streams"): the device reads each stream's
//! topic off its `accepted`, counts the seqs that are not written, and
//! when a written seq disagrees with its count, drops what it counted
//! since the last written seq it matched and resumes from there.
//!
//! [`run`] returns a [`Summary`]: completion rate, resumes, duplicates,
//! lost events, time to first delta, bytes on the wire per delivered
//! output byte. Used by edgeway's tests (small N) and benchmarks (large N).

pub mod proxy;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use rumqttc::{AsyncClient, Event, MqttOptions, Packet, QoS};
use serde::Serialize;
use serde_json::{json, Value};

pub use proxy::{LinkProfile, Proxy};

/// What to simulate.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// edgeway's MQTT listener.
    pub broker: SocketAddr,
    /// Device ids and passwords.
    pub devices: Vec<(String, String)>,
    pub requests_per_device: usize,
    pub model: String,
    pub prompt: String,
    pub max_tokens: u32,
    /// Share of requests the device cancels after the first delta.
    pub cancel_ratio: f64,
    /// Per-request coalescing asked of edgeway (`None`: its default).
    pub coalesce_ms: Option<u64>,
    pub max_chunk_bytes: Option<usize>,
    /// Ask for compact streams.
    pub compact: bool,
    pub link: LinkProfile,
    /// A request without a terminal event after this long is lost.
    pub request_timeout: Duration,
    /// Pause between a device's requests.
    pub think: Duration,
    /// Devices connecting at once (ramp-up).
    pub connect_concurrency: usize,
    pub keep_alive: Duration,
    pub seed: u64,
    /// The topic prefix of edgeway (`ai/v1`).
    pub prefix: String,
    /// Part of every request id (`{device}-{run}-{k}`), so that runs
    /// against the same gateway do not repeat ids (a repeated id is an
    /// idempotent retry: edgeway replays the earlier answer).
    pub run: String,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            broker: SocketAddr::from(([127, 0, 0, 1], 1883)),
            devices: vec![("demo-device-1".into(), "demo-pass-1".into())],
            requests_per_device: 3,
            model: "general-chat".into(),
            prompt: "Tell me about the sea.".into(),
            max_tokens: 32,
            cancel_ratio: 0.0,
            coalesce_ms: None,
            max_chunk_bytes: None,
            compact: false,
            link: LinkProfile::default(),
            request_timeout: Duration::from_secs(120),
            think: Duration::from_millis(0),
            connect_concurrency: 64,
            keep_alive: Duration::from_secs(5),
            seed: 1,
            prefix: "ai/v1".into(),
            run: format!(
                "{:x}",
                std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_micros())
            ),
        }
    }
}

/// What the devices saw, all together.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Summary {
    pub devices: usize,
    pub requests: usize,
    /// Requests whose stream ended with exactly one terminal event.
    pub completed: usize,
    pub completion_rate: f64,
    /// Of the completed: ended `done`.
    pub done: usize,
    /// Of the completed: ended `REQUEST_CANCELLED` (the device cancelled).
    pub cancelled: usize,
    /// Of the completed: other errors (by code, in `error_codes`).
    pub errors: usize,
    pub error_codes: std::collections::BTreeMap<String, usize>,
    /// Requests with no terminal event within the timeout.
    pub incomplete: usize,
    /// Events of incomplete requests that never arrived (at least one each).
    pub lost_events: usize,
    /// Messages whose `seq` the device already had.
    pub duplicates: usize,
    /// Messages past a gap (dropped; the device resumed).
    pub gap_discards: usize,
    /// Compact streams: written seqs that disagreed with the device's
    /// count of the messages before them (what it counted since the last
    /// written seq it matched was dropped and asked for again).
    pub recounts: usize,
    pub resumes: usize,
    /// Requests sent again after a reconnect (nothing of them had arrived).
    pub re_requests: usize,
    pub reconnects: usize,
    pub connection_drops_injected: usize,
    pub messages: usize,
    pub delta_messages: usize,
    /// Time from publishing a request to its first delta.
    pub ttfd_p50_ms: f64,
    pub ttfd_p99_ms: f64,
    /// Bytes on the wire (both directions, through the proxy).
    pub wire_bytes: u64,
    /// Text bytes of the deltas the devices kept.
    pub output_bytes: u64,
    pub wire_bytes_per_output_byte: f64,
    pub elapsed_s: f64,
}

impl Summary {
    pub fn ok(&self) -> bool {
        self.requests > 0 && self.completed == self.requests && self.lost_events == 0 && self.duplicates == 0
    }

    pub fn render(&self) -> String {
        format!(
            "devices {}  requests {}  completed {} ({:.1} %: {} done, {} cancelled, {} other errors {:?})\n\
             incomplete {}  lost events {}  duplicates {}  gap discards {}  recounts {}\n\
             resumes {}  re-sent requests {}  reconnects {}  connection drops injected {}\n\
             messages {} ({} deltas)  time to first delta p50 {:.1} ms  p99 {:.1} ms\n\
             wire bytes {}  output bytes {}  wire bytes per output byte {:.2}  elapsed {:.1} s",
            self.devices,
            self.requests,
            self.completed,
            self.completion_rate * 100.0,
            self.done,
            self.cancelled,
            self.errors,
            self.error_codes,
            self.incomplete,
            self.lost_events,
            self.duplicates,
            self.gap_discards,
            self.recounts,
            self.resumes,
            self.re_requests,
            self.reconnects,
            self.connection_drops_injected,
            self.messages,
            self.delta_messages,
            self.ttfd_p50_ms,
            self.ttfd_p99_ms,
            self.wire_bytes,
            self.output_bytes,
            self.wire_bytes_per_output_byte,
            self.elapsed_s,
        )
    }
}

#[derive(Default)]
struct Tally {
    s: Summary,
    ttfd: Vec<f64>,
}

/// One request as the device tracks it.
struct Req {
    rid: String,
    body: String,
    /// The next `seq` the device expects.
    next: u64,
    sent_at: Instant,
    first_delta: Option<Duration>,
    cancel: bool,
    cancel_sent: bool,
    /// The `seq` a resume was last asked for (to ask once per gap).
    resumed_at: Option<u64>,
    terminal: Option<String>,
    /// Compact streams: the next `seq` after the last message whose seq
    /// was written and matched, with the output bytes and delta messages
    /// counted up to it (what a recount goes back to).
    checked: (u64, u64, usize),
}

/// A compact stream message as the JSON form's fields (`seq`, `type`,
/// `text`, `request_id`, `code`), and whether its seq was written; `prev`:
/// the seq of the previous message on its topic. `None`: not readable.
fn parse_compact(payload: &[u8], prev: Option<u64>) -> Option<(Value, bool)> {
    let text = std::str::from_utf8(payload).ok()?;
    let digits = payload.iter().take_while(|b| b.is_ascii_digit()).count();
    if digits == 0 {
        let delta = text.strip_prefix(':').unwrap_or(text);
        return Some((json!({"seq": prev? + 1, "type": "delta", "text": delta}), false));
    }
    let seq: u64 = text[..digits].parse().ok()?;
    let rest = text.get(digits + 1..)?;
    let v = match payload.get(digits)? {
        b':' => json!({"seq": seq, "type": "delta", "text": rest}),
        b'+' => json!({"seq": seq, "type": "accepted", "request_id": rest.split(' ').next()?}),
        b'.' => json!({"seq": seq, "type": "done"}),
        b'{' => {
            let mut v: Value = serde_json::from_str(&text[digits..]).ok()?;
            v["seq"] = seq.into();
            v
        }
        _ => return None,
    };
    Some((v, true))
}

/// Runs the simulation to its end.
pub async fn run(cfg: SimConfig) -> anyhow::Result<Summary> {
    let proxy = Proxy::start(cfg.broker, cfg.link.clone(), cfg.seed).await?;
    let tally = Arc::new(Mutex::new(Tally::default()));
    let gate = Arc::new(tokio::sync::Semaphore::new(cfg.connect_concurrency.max(1)));
    let started = Instant::now();
    let cfg = Arc::new(cfg);
    let mut tasks = Vec::new();
    for (i, (id, pw)) in cfg.devices.iter().enumerate() {
        let (cfg, tally, gate) = (cfg.clone(), tally.clone(), gate.clone());
        let (id, pw, addr) = (id.clone(), pw.clone(), proxy.addr);
        tasks.push(tokio::spawn(async move { device(cfg, i, id, pw, addr, tally, gate).await }));
    }
    for t in tasks {
        t.await?;
    }
    let mut t = std::mem::take(&mut *tally.lock().expect("tally"));
    let s = &mut t.s;
    s.devices = cfg.devices.len();
    s.completion_rate = if s.requests == 0 { 0.0 } else { s.completed as f64 / s.requests as f64 };
    t.ttfd.sort_by(|a, b| a.total_cmp(b));
    let pct = |p: f64| -> f64 {
        if t.ttfd.is_empty() {
            return 0.0;
        }
        t.ttfd[((t.ttfd.len() as f64 - 1.0) * p).round() as usize]
    };
    s.ttfd_p50_ms = pct(0.5);
    s.ttfd_p99_ms = pct(0.99);
    s.wire_bytes = proxy.stats.bytes();
    s.connection_drops_injected = proxy.stats.drops();
    s.wire_bytes_per_output_byte = if s.output_bytes == 0 { 0.0 } else { s.wire_bytes as f64 / s.output_bytes as f64 };
    s.elapsed_s = started.elapsed().as_secs_f64();
    proxy.stop();
    Ok(t.s)
}

async fn device(
    cfg: Arc<SimConfig>,
    index: usize,
    id: String,
    password: String,
    addr: SocketAddr,
    tally: Arc<Mutex<Tally>>,
    gate: Arc<tokio::sync::Semaphore>,
) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(cfg.seed.wrapping_mul(7919).wrapping_add(index as u64));
    let mut opts = MqttOptions::new(&id, addr.ip().to_string(), addr.port());
    opts.set_credentials(&id, &password)
        .set_keep_alive(cfg.keep_alive)
        .set_clean_session(true)
        .set_max_packet_size(1 << 21, 1 << 21);
    let (client, mut el) = AsyncClient::new(opts, 256);
    // The event loop runs on its own: `EventLoop::poll` must not be
    // dropped half-way (a connect in progress would be abandoned).
    let (ev_tx, mut events) = tokio::sync::mpsc::unbounded_channel();
    let backoff_seed = cfg.seed ^ index as u64;
    let el_task = tokio::spawn(async move {
        let mut rng = rand::rngs::StdRng::seed_from_u64(backoff_seed);
        loop {
            let e = el.poll().await;
            let failed = e.is_err();
            if ev_tx.send(e).is_err() {
                return;
            }
            if failed {
                // The link dropped: rumqttc reconnects on the next poll.
                tokio::time::sleep(Duration::from_millis(rng.random_range(50..250))).await;
            }
        }
    });
    let res_filter = format!("{}/{id}/res/#", cfg.prefix);
    let req_topic = format!("{}/{id}/req", cfg.prefix);
    let cancel_topic = format!("{}/{id}/cancel", cfg.prefix);
    let resume_topic = format!("{}/{id}/resume", cfg.prefix);

    let mut local = Tally::default();
    let mut permit = Some(gate.acquire_owned().await.expect("gate"));
    let mut first_connect = true;
    let mut subscribed = false;
    let mut done_requests = 0usize;
    let mut current: Option<Req> = None;
    let mut next_request_at = tokio::time::Instant::now();
    let mut deadline = tokio::time::Instant::now() + cfg.request_timeout;

    let new_req = |k: usize, rng: &mut rand::rngs::StdRng| -> Req {
        let rid = format!("{id}-{}-{k}", cfg.run);
        let mut body = json!({
            "model": cfg.model, "request_id": rid, "max_tokens": cfg.max_tokens,
            "messages": [{"role": "user", "content": cfg.prompt}],
        });
        if let Some(c) = cfg.coalesce_ms {
            body["coalesce_ms"] = c.into();
        }
        if let Some(b) = cfg.max_chunk_bytes {
            body["max_chunk_bytes"] = b.into();
        }
        if cfg.compact {
            body["compact"] = true.into();
        }
        Req {
            rid,
            body: body.to_string(),
            next: 0,
            sent_at: Instant::now(),
            first_delta: None,
            cancel: rng.random_bool(cfg.cancel_ratio.clamp(0.0, 1.0)),
            cancel_sent: false,
            resumed_at: None,
            terminal: None,
            checked: (0, 0, 0),
        }
    };
    let stream_filter = format!("{}/{id}/s/#", cfg.prefix);
    let stream_prefix = format!("{}/{id}/s/", cfg.prefix);
    // Compact streams: the request id and the last seq of each stream topic.
    let mut stream_rid: std::collections::HashMap<String, String> = Default::default();
    let mut stream_prev: std::collections::HashMap<String, u64> = Default::default();

    loop {
        if done_requests >= cfg.requests_per_device && current.is_none() {
            break;
        }
        // Start the next request when subscribed and its time has come.
        if subscribed && current.is_none() && tokio::time::Instant::now() >= next_request_at {
            let mut r = new_req(done_requests, &mut rng);
            r.checked = (0, local.s.output_bytes, local.s.delta_messages);
            let _ = client.try_publish(&req_topic, QoS::AtLeastOnce, false, r.body.clone());
            local.s.requests += 1;
            deadline = tokio::time::Instant::now() + cfg.request_timeout;
            current = Some(r);
        }
        let wake = match (&current, subscribed) {
            (Some(_), _) => deadline,
            (None, true) => next_request_at.max(tokio::time::Instant::now()),
            // Waiting for the (re)connection.
            (None, false) => tokio::time::Instant::now() + cfg.request_timeout,
        };
        let ev = tokio::select! {
            e = events.recv() => match e { Some(e) => e, None => break },
            _ = tokio::time::sleep_until(wake) => {
                if let Some(r) = current.take() {
                    if tokio::time::Instant::now() >= deadline && r.terminal.is_none() {
                        local.s.incomplete += 1;
                        local.s.lost_events += 1;
                        done_requests += 1;
                    } else {
                        current = Some(r);
                    }
                }
                continue;
            }
        };
        match ev {
            Ok(Event::Incoming(Packet::ConnAck(_))) => {
                permit.take();
                if !first_connect {
                    local.s.reconnects += 1;
                }
                first_connect = false;
                subscribed = false;
                let mut filters = vec![rumqttc::SubscribeFilter::new(res_filter.clone(), QoS::AtLeastOnce)];
                if cfg.compact {
                    filters.push(rumqttc::SubscribeFilter::new(stream_filter.clone(), QoS::AtLeastOnce));
                }
                let _ = client.try_subscribe_many(filters);
            }
            Ok(Event::Incoming(Packet::SubAck(_))) => {
                subscribed = true;
                // After a reconnect: resume what is missing, or ask again
                // when nothing of the request had arrived.
                if let Some(r) = current.as_mut() {
                    if r.next == 0 {
                        local.s.re_requests += 1;
                        let _ = client.try_publish(&req_topic, QoS::AtLeastOnce, false, r.body.clone());
                    } else {
                        local.s.resumes += 1;
                        r.resumed_at = Some(r.next);
                        let m = json!({"request_id": r.rid, "from_seq": r.next}).to_string();
                        let _ = client.try_publish(&resume_topic, QoS::AtLeastOnce, false, m);
                    }
                }
            }
            Ok(Event::Incoming(Packet::Publish(p))) => {
                let (v, written) = match p.topic.starts_with(&stream_prefix) {
                    true => {
                        let Some((mut v, written)) = parse_compact(&p.payload, stream_prev.get(&p.topic).copied())
                        else {
                            local.s.messages += 1;
                            local.s.duplicates += 1;
                            continue;
                        };
                        stream_prev.insert(p.topic.clone(), v["seq"].as_u64().unwrap_or(0));
                        if v["type"] == "accepted" {
                            stream_rid.insert(p.topic.clone(), v["request_id"].as_str().unwrap_or("").to_string());
                        }
                        v["request_id"] = stream_rid.get(&p.topic).cloned().unwrap_or_default().into();
                        (v, written)
                    }
                    false => match serde_json::from_slice::<Value>(&p.payload) {
                        Ok(v) => (v, true),
                        Err(_) => continue,
                    },
                };
                local.s.messages += 1;
                let Some(r) = current.as_mut() else {
                    local.s.duplicates += 1;
                    continue;
                };
                if v["request_id"].as_str() != Some(r.rid.as_str()) {
                    // A late message of an earlier request.
                    local.s.duplicates += 1;
                    continue;
                }
                let seq = v["seq"].as_u64().unwrap_or(u64::MAX);
                if seq < r.next {
                    local.s.duplicates += 1;
                    continue;
                }
                if seq > r.next {
                    local.s.gap_discards += 1;
                    if cfg.compact && written && r.checked.0 < r.next {
                        // Counted messages since the last check may have
                        // been counted wrong: drop them, ask again.
                        local.s.recounts += 1;
                        local.s.output_bytes = r.checked.1;
                        local.s.delta_messages = r.checked.2;
                        r.next = r.checked.0;
                    }
                    if r.resumed_at != Some(r.next) {
                        local.s.resumes += 1;
                        r.resumed_at = Some(r.next);
                        let m = json!({"request_id": r.rid, "from_seq": r.next}).to_string();
                        let _ = client.try_publish(&resume_topic, QoS::AtLeastOnce, false, m);
                    }
                    continue;
                }
                r.next += 1;
                match v["type"].as_str() {
                    Some("delta") => {
                        local.s.delta_messages += 1;
                        local.s.output_bytes += v["text"].as_str().map_or(0, str::len) as u64;
                        if r.first_delta.is_none() {
                            r.first_delta = Some(r.sent_at.elapsed());
                        }
                        if r.cancel && !r.cancel_sent {
                            r.cancel_sent = true;
                            let m = json!({"request_id": r.rid}).to_string();
                            let _ = client.try_publish(&cancel_topic, QoS::AtLeastOnce, false, m);
                        }
                    }
                    Some("done") => r.terminal = Some("done".into()),
                    Some("error") => r.terminal = Some(v["code"].as_str().unwrap_or("?").to_string()),
                    _ => {}
                }
                if written {
                    r.checked = (r.next, local.s.output_bytes, local.s.delta_messages);
                }
                if let Some(t) = r.terminal.clone() {
                    local.s.completed += 1;
                    match t.as_str() {
                        "done" => local.s.done += 1,
                        "REQUEST_CANCELLED" => local.s.cancelled += 1,
                        other => {
                            local.s.errors += 1;
                            *local.s.error_codes.entry(other.to_string()).or_default() += 1;
                        }
                    }
                    if let Some(d) = r.first_delta {
                        local.ttfd.push(d.as_secs_f64() * 1000.0);
                    }
                    current = None;
                    done_requests += 1;
                    next_request_at = tokio::time::Instant::now() + cfg.think;
                }
            }
            Ok(_) => {}
            Err(e) => {
                if std::env::var_os("DEVICES_SIM_DEBUG").is_some() {
                    eprintln!("{id}: connection error: {e}");
                }
                permit.take();
                subscribed = false;
            }
        }
    }
    let _ = client.try_disconnect();
    // Let the DISCONNECT out.
    let _ = tokio::time::timeout(Duration::from_millis(200), events.recv()).await;
    el_task.abort();
    let mut t = tally.lock().expect("tally");
    let s = &mut t.s;
    let l = &local.s;
    s.requests += l.requests;
    s.completed += l.completed;
    s.done += l.done;
    s.cancelled += l.cancelled;
    s.errors += l.errors;
    for (k, v) in &l.error_codes {
        *s.error_codes.entry(k.clone()).or_default() += v;
    }
    s.incomplete += l.incomplete;
    s.lost_events += l.lost_events;
    s.duplicates += l.duplicates;
    s.gap_discards += l.gap_discards;
    s.recounts += l.recounts;
    s.resumes += l.resumes;
    s.re_requests += l.re_requests;
    s.reconnects += l.reconnects;
    s.messages += l.messages;
    s.delta_messages += l.delta_messages;
    s.output_bytes += l.output_bytes;
    t.ttfd.extend(local.ttfd);
}

/// A `[devices.ID]` section of edgeway's config for a simulated device
/// (the password's SHA-256, as edgeway stores it).
pub fn device_config(id: &str, password: &str, tenant: &str, application: &str) -> String {
    use sha2::Digest;
    let hash: String = sha2::Sha256::digest(password.as_bytes()).iter().map(|b| format!("{b:02x}")).collect();
    format!("[devices.{id}]\ntenant = \"{tenant}\"\napplication = \"{application}\"\npassword_sha256 = \"{hash}\"\n")
}
