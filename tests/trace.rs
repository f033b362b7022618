//! Trace ids end to end (FR-10.2): the trace id a caller sends (HTTP
//! `traceparent`, the MQTT request field `trace_id` and v5 user property
//! `traceparent`) comes back on the response, in every lifecycle event, in
//! the store row and `GET /v1/tasks/{id}`, and reaches the engine as a
//! `traceparent` with the same trace id and a span id of its own. The NATS
//! header is tested in `tests/nats.rs`, with that file's client helpers.

mod common;
mod mqtt_support;

use common::*;
use mqtt_support::{device, request, start, D1, D2, V};
use rumqttc::v5::mqttbytes::v5::PublishProperties;
use serde_json::{json, Value};

const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

fn is_trace_id(s: &str) -> bool {
    s.len() == 32 && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// The `trace_id` column of the task's row.
async fn stored_trace_id(gw: &TestGateway, task_id: &str) -> Option<String> {
    gw.store().flush().await;
    let conn = rusqlite::Connection::open(gw.db_path()).unwrap();
    conn.query_row("SELECT trace_id FROM tasks WHERE task_id = ?1", [task_id], |r| r.get(0)).unwrap()
}

/// The trace id of each `traceparent` the engine received, checking that
/// each call had one of its own span.
fn engine_trace_ids(fake: &FakeEngine) -> Vec<String> {
    let tps: Vec<String> =
        fake.traceparents().into_iter().map(|t| t.expect("every engine call has a traceparent")).collect();
    let mut spans = std::collections::HashSet::new();
    tps.iter()
        .map(|tp| {
            let parts: Vec<&str> = tp.split('-').collect();
            assert_eq!(parts.len(), 4, "{tp}");
            assert_eq!(parts[0], "00", "{tp}");
            assert_ne!(parts[2], "00f067aa0ba902b7", "the engine call is a span of its own: {tp}");
            assert!(spans.insert(parts[2].to_string()), "a new span per call: {tp}");
            parts[1].to_string()
        })
        .collect()
}

#[tokio::test]
async fn http_traceparent_joins_response_events_store_record_and_engine_call() {
    let fake = FakeEngine::start().await;
    let gw = TestGateway::with_engine(&fake.url(), "openai", "").await;
    let mut rx = gw.recorder().subscribe();
    let resp = client()
        .post(format!("{}/v1/chat/completions", gw.base_url))
        .bearer_auth(DEMO_KEY)
        .header("traceparent", PARENT)
        .json(&chat_body(false))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-edgeway-trace-id"], TRACE);
    let task_id = resp.headers()["x-task-id"].to_str().unwrap().to_string();
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["edge"]["trace_id"], TRACE, "{body}");

    // Every lifecycle event of the task carries it.
    let mut states = Vec::new();
    loop {
        let ev = next_event(&mut rx, "the task's events", |e| e.task_id == task_id).await;
        assert_eq!(ev.trace_id, TRACE, "{:?}", ev.state);
        let v = serde_json::to_value(&*ev).unwrap();
        assert_eq!(v["trace_id"], TRACE);
        states.push(ev.state);
        if ev.state.is_terminal() {
            assert_eq!(ev.result.as_ref().unwrap().trace_id.as_deref(), Some(TRACE));
            break;
        }
    }
    assert!(states.len() >= 6, "{states:?}");
    assert_eq!(stored_trace_id(&gw, &task_id).await.as_deref(), Some(TRACE));
    let rec = get_json(&gw, DEMO_KEY, &format!("/v1/tasks/{task_id}")).await;
    assert_eq!(rec["trace_id"], TRACE, "{rec}");
    assert_eq!(engine_trace_ids(&fake), [TRACE]);
    gw.stop().await;
}

#[tokio::test]
async fn http_without_a_valid_traceparent_gets_a_new_trace_id_and_no_error() {
    let fake = FakeEngine::start().await;
    let gw = TestGateway::with_engine(&fake.url(), "openai", "").await;
    let mut seen = Vec::new();
    let headers: [Option<&str>; 4] = [
        None,
        Some("garbage"),
        Some("00-00000000000000000000000000000000-00f067aa0ba902b7-01"),
        Some("00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01"),
    ];
    for h in headers {
        let mut rb = client().post(format!("{}/v1/chat/completions", gw.base_url)).bearer_auth(DEMO_KEY);
        if let Some(h) = h {
            rb = rb.header("traceparent", h);
        }
        let resp = rb.json(&chat_body(true)).send().await.unwrap();
        assert_eq!(resp.status(), 200, "{h:?}");
        let id = resp.headers()["x-edgeway-trace-id"].to_str().unwrap().to_string();
        let task_id = resp.headers()["x-task-id"].to_str().unwrap().to_string();
        let (_, done) = read_sse(resp).await;
        assert!(done);
        assert!(is_trace_id(&id) && id != TRACE && id != "0".repeat(32), "{h:?}: {id}");
        assert_eq!(stored_trace_id(&gw, &task_id).await.as_deref(), Some(id.as_str()));
        seen.push(id);
    }
    assert_eq!(engine_trace_ids(&fake), seen);
    seen.dedup();
    assert_eq!(seen.len(), headers.len(), "a new id per call");
    gw.stop().await;
}

#[tokio::test]
async fn a_refused_call_keeps_its_trace_id_in_its_record() {
    let fake = FakeEngine::start().await;
    let gw = TestGateway::with_engine(&fake.url(), "openai", "").await;
    let mut rx = gw.recorder().subscribe();
    let mut body = chat_body(false);
    body["model"] = json!("no-such-model");
    let resp = client()
        .post(format!("{}/v1/chat/completions", gw.base_url))
        .bearer_auth(DEMO_KEY)
        .header("traceparent", PARENT)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    let ev = next_event(&mut rx, "the refusal", |e| e.state == TaskState::Rejected).await;
    assert_eq!(ev.trace_id, TRACE);
    assert_eq!(stored_trace_id(&gw, &ev.task_id).await.as_deref(), Some(TRACE));
    gw.stop().await;
}

#[tokio::test]
async fn mqtt_trace_id_field_and_v5_traceparent_join_events_store_and_engine_call() {
    let (fake, gw, addr) = start(Knobs::default(), "coalesce_ms = 0").await;
    let other = "0af7651916cd43dd8448eb211c80319c";

    // MQTT 3.1.1: the request field.
    let mut d = device(addr, V::V4, D1).await;
    d.subscribe(&d.topic("res/#")).await;
    let mut req = request("r-trace-field");
    req["trace_id"] = json!(TRACE);
    d.publish(&d.topic("req"), req.to_string()).await;
    let events = d.stream(&d.topic("res/r-trace-field")).await;
    let task_id = events[0]["task_id"].as_str().unwrap().to_string();
    check_events(&events, TRACE);
    assert_eq!(stored_trace_id(&gw, &task_id).await.as_deref(), Some(TRACE));

    // MQTT 5: the user property outranks the field.
    let mut d5 = device(addr, V::V5, D2).await;
    d5.subscribe(&d5.topic("res/#")).await;
    let mut req = request("r-trace-prop");
    req["trace_id"] = json!(TRACE);
    let tp = format!("00-{other}-00f067aa0ba902b7-01");
    let props = PublishProperties { user_properties: vec![("traceparent".into(), tp)], ..Default::default() };
    d5.publish_v5(&d5.topic("req"), req.to_string(), props).await;
    let events = d5.stream(&d5.topic("res/r-trace-prop")).await;
    let task_id = events[0]["task_id"].as_str().unwrap().to_string();
    check_events(&events, other);
    assert_eq!(stored_trace_id(&gw, &task_id).await.as_deref(), Some(other));

    // An invalid field is ignored: the request runs under a new id.
    let mut req = request("r-trace-bad");
    req["trace_id"] = json!("not-a-trace");
    d.publish(&d.topic("req"), req.to_string()).await;
    let events = d.stream(&d.topic("res/r-trace-bad")).await;
    let fresh = events[0]["trace_id"].as_str().unwrap().to_string();
    assert!(is_trace_id(&fresh) && fresh != TRACE && fresh != other, "{fresh}");
    check_events(&events, &fresh);

    assert_eq!(engine_trace_ids(&fake), [TRACE, other, fresh.as_str()]);
    gw.stop().await;
}

/// The lifecycle events of a device's stream carry `trace_id` (the answer
/// pieces do not), and the result has it too.
fn check_events(events: &[Value], trace_id: &str) {
    assert_eq!(events[0]["type"], "accepted");
    let done = events.last().unwrap();
    assert_eq!(done["type"], "done", "{done}");
    assert_eq!(done["result"]["trace_id"], trace_id);
    for e in events {
        match e["type"].as_str().unwrap() {
            "accepted" | "queued" | "done" | "error" => assert_eq!(e["trace_id"], trace_id, "{e}"),
            _ => assert!(e.get("trace_id").is_none(), "{e}"),
        }
    }
}

/// The lines edgeway logs in this test binary, in its JSON format (one
/// global subscriber for the binary: tests pick their own lines by id).
#[derive(Clone, Default)]
struct Captured(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'w> tracing_subscriber::fmt::MakeWriter<'w> for Captured {
    type Writer = Captured;

    fn make_writer(&'w self) -> Captured {
        self.clone()
    }
}

fn logs() -> &'static Captured {
    static LOGS: std::sync::OnceLock<Captured> = std::sync::OnceLock::new();
    LOGS.get_or_init(|| {
        let c = Captured::default();
        let cfg = edgeway::config::LogConfig {
            format: edgeway::config::LogFormat::Json,
            level: "info".into(),
            otlp_endpoint: None,
        };
        edgeway::telemetry::init_logging_to(&cfg, c.clone());
        c
    })
}

impl Captured {
    fn lines(&self) -> Vec<(String, Value)> {
        let bytes = self.0.lock().unwrap().clone();
        String::from_utf8(bytes)
            .unwrap()
            .lines()
            .map(|l| (l.to_string(), serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON: {l}: {e}"))))
            .collect()
    }
}

/// The trace id of the line's innermost span.
fn line_trace(v: &Value) -> Option<&str> {
    v["span"]["trace_id"].as_str()
}

#[tokio::test]
async fn every_log_line_of_a_task_carries_its_trace_id_and_each_stage_logs_one_line() {
    let logs = logs();
    // The first attempt fails before the first token: one retry.
    let fake = FakeEngine::start_with(Knobs { fail_next: 1, ..Knobs::default() }).await;
    let gw = TestGateway::with_engine(&fake.url(), "openai", "").await;
    gw.wait_ready().await;
    let trace = "5bf92f3577b34da6a3ce929d0e0e4737";
    let marker = "PROMPT-TEXT-9c1e4b";
    let mut body = chat_body(false);
    body["messages"][0]["content"] = json!(format!("Tell me about {marker}"));
    let resp = client()
        .post(format!("{}/v1/chat/completions", gw.base_url))
        .bearer_auth(DEMO_KEY)
        .header("traceparent", format!("00-{trace}-00f067aa0ba902b7-01"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let task_id = resp.headers()["x-task-id"].to_str().unwrap().to_string();
    let _: Value = resp.json().await.unwrap();

    let lines = logs.lines();
    let mine: Vec<&(String, Value)> = lines.iter().filter(|(l, _)| l.contains(&task_id) || l.contains(trace)).collect();
    for (l, v) in &mine {
        assert_eq!(line_trace(v), Some(trace), "a line of the task without its trace id: {l}");
        assert!(!l.contains(marker), "prompt text in a log line: {l}");
    }
    assert!(lines.iter().all(|(l, _)| !l.contains(marker)), "prompt text logged");
    let stage = |name: &str| -> Vec<&Value> { mine.iter().map(|(_, v)| v).filter(|v| v["stage"] == name).collect() };
    let one = |name: &str| -> &Value {
        let s = stage(name);
        assert_eq!(s.len(), 1, "one {name} line: {s:?}");
        s[0]
    };
    let access = one("access");
    assert_eq!((access["ingress"].as_str(), access["application"].as_str()), (Some("http"), Some("demo")));
    assert_eq!(access["model"], "general-chat");
    assert!(one("context")["tokens"].as_u64().unwrap() > 0);
    let retry = one("retry");
    assert_eq!(retry["attempt"], 1);
    let dispatches = stage("dispatch");
    assert_eq!(dispatches.len(), 2, "one per attempt");
    assert!(dispatches.iter().all(|d| d["instance"].is_string() && d["queue_ms"].is_u64()));
    let inference = one("inference");
    assert_eq!(inference["output_tokens"], 5);
    assert!(inference["ttft_ms"].is_u64());
    let end = one("end");
    assert_eq!(end["state"], "SUCCEEDED");
    // The task's id is in every line logged after admission made it.
    for v in [retry, inference, end] {
        assert_eq!(v["span"]["task_id"], task_id.as_str(), "{v}");
    }
    gw.stop().await;
}

#[tokio::test]
async fn a_cancelled_task_and_a_refused_call_each_log_one_end_line_with_their_trace_id() {
    let logs = logs();
    let fake = FakeEngine::start_with(Knobs::slow(50, 100)).await;
    let gw = TestGateway::with_engine(&fake.url(), "openai", "").await;
    gw.wait_ready().await;
    let trace = "6bf92f3577b34da6a3ce929d0e0e4738";
    let resp = client()
        .post(format!("{}/v1/chat/completions", gw.base_url))
        .bearer_auth(DEMO_KEY)
        .header("traceparent", format!("00-{trace}-00f067aa0ba902b7-01"))
        .json(&chat_body(true))
        .send()
        .await
        .unwrap();
    let task_id = resp.headers()["x-task-id"].to_str().unwrap().to_string();
    gw.wait_for_state(&task_id, TaskState::Streaming).await;
    drop(resp);
    gw.wait_for_state(&task_id, TaskState::Cancelled).await;
    let ends: Vec<Value> = logs
        .lines()
        .into_iter()
        .map(|(_, v)| v)
        .filter(|v| v["stage"] == "end" && line_trace(v) == Some(trace))
        .collect();
    assert_eq!(ends.len(), 1, "{ends:?}");
    assert_eq!(ends[0]["state"], "CANCELLED");
    assert_eq!(ends[0]["actor"], "client");

    let refused = "7bf92f3577b34da6a3ce929d0e0e4739";
    let mut body = chat_body(false);
    body["model"] = json!("no-such-model");
    let resp = client()
        .post(format!("{}/v1/chat/completions", gw.base_url))
        .bearer_auth(DEMO_KEY)
        .header("traceparent", format!("00-{refused}-00f067aa0ba902b7-01"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    let mine: Vec<Value> =
        logs.lines().into_iter().map(|(_, v)| v).filter(|v| line_trace(v) == Some(refused)).collect();
    let stages: Vec<&str> = mine.iter().filter_map(|v| v["stage"].as_str()).collect();
    assert_eq!(stages, ["access", "end"], "{mine:?}");
    assert_eq!(mine[1]["state"], "REJECTED");
    assert_eq!(mine[1]["code"], "INVALID_REQUEST");
    gw.stop().await;
}

/// Text-format log lines cannot be forged (review 15 L2): a caller's model
/// name with a line break (logged with `%`, which the default text format
/// writes as it is) stays in its own line, escaped; every line written is
/// one record (a timestamp, then a level).
#[tokio::test]
async fn a_model_name_with_a_line_break_cannot_forge_a_text_log_line() {
    let text = Captured::default();
    let cfg = edgeway::config::LogConfig {
        format: edgeway::config::LogFormat::Text,
        level: "info".into(),
        otlp_endpoint: None,
    };
    // This test's thread only (a current-thread runtime: the gateway's
    // tasks run here too); other tests keep the binary's JSON subscriber.
    let _text = tracing::subscriber::set_default(edgeway::telemetry::log_subscriber(&cfg, text.clone()));
    let fake = FakeEngine::start().await;
    let gw = TestGateway::with_engine(&fake.url(), "openai", "").await;
    gw.wait_ready().await;
    let mut body = chat_body(false);
    // After the break, what a real line starts with.
    body["model"] = json!("a\n2026-01-01T00:00:00.000000Z  INFO edgeway: forged\u{1b}[2J");
    let resp = client()
        .post(format!("{}/v1/chat/completions", gw.base_url))
        .bearer_auth(DEMO_KEY)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    gw.stop().await;
    let bytes = text.0.lock().unwrap().clone();
    let out = String::from_utf8(bytes).unwrap();
    // The colours tracing-subscriber writes are its own escapes: left out
    // before reading the lines.
    let plain = strip_ansi(&out);
    let lines: Vec<&str> = plain.lines().collect();
    assert!(!lines.is_empty());
    for l in &lines {
        let mut cols = l.split_whitespace();
        let (time, level) = (cols.next().unwrap_or_default(), cols.next().unwrap_or_default());
        assert!(
            time.len() >= 20 && time.as_bytes()[4] == b'-' && time.ends_with('Z'),
            "a line that is not a record of its own: {l:?}\n{plain}"
        );
        assert!(["TRACE", "DEBUG", "INFO", "WARN", "ERROR"].contains(&level), "{l:?}");
    }
    // The one line with the name is the access line, the name escaped in it.
    let with_name: Vec<&&str> = lines.iter().filter(|l| l.contains("forged")).collect();
    assert_eq!(with_name.len(), 1, "{plain}");
    assert!(with_name[0].contains("stage=\"access\""), "{plain}");
    assert!(with_name[0].contains(r"model=a\n2026-01-01T00:00:00.000000Z  INFO edgeway: forged\u{1b}[2J"), "{plain}");
    assert!(!out.contains("forged\u{1b}"), "a caller's escape reached the log");
}

/// `s` without the ANSI colour sequences (`ESC [ … m`).
fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' && chars.peek() == Some(&'[') {
            for d in chars.by_ref() {
                if d.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// `unix_s` as a TOML offset date-time (UTC).
fn toml_datetime(unix_s: i64) -> String {
    // Howard Hinnant's civil_from_days.
    let (days, secs) = (unix_s.div_euclid(86_400), unix_s.rem_euclid(86_400));
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", secs / 3600, secs % 3600 / 60, secs % 60)
}

fn now_s() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() as i64
}

/// Sends a chat with `content` under `trace` and returns the log lines of
/// that trace.
async fn prompt_lines(gw: &TestGateway, trace: &str, content: &str) -> Vec<Value> {
    let mut body = chat_body(false);
    body["messages"][0]["content"] = json!(content);
    let resp = client()
        .post(format!("{}/v1/chat/completions", gw.base_url))
        .bearer_auth(DEMO_KEY)
        .header("traceparent", format!("00-{trace}-00f067aa0ba902b7-01"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let _: Value = resp.json().await.unwrap();
    logs().lines().into_iter().map(|(_, v)| v).filter(|v| line_trace(v) == Some(trace)).collect()
}

#[tokio::test]
async fn debug_prompts_logs_filtered_prompts_only_while_on_and_sampled() {
    let _ = logs();
    let secret = "sk-abcdefghijklmnopqrstuvwxyz0123456789";
    let marker = "PROMPT-DEBUG-4d2a";
    let content = format!("{marker} my key is {secret}");
    let fake = FakeEngine::start().await;

    // On, every call sampled: the prompt is logged once, secrets filtered.
    let until = toml_datetime(now_s() + 3600);
    let extra = format!("[applications.demo.debug_prompts]\nuntil = {until}\nsample_rate = 1.0\n");
    let gw = TestGateway::with_engine(&fake.url(), "openai", &extra).await;
    let lines = prompt_lines(&gw, "8bf92f3577b34da6a3ce929d0e0e473a", &content).await;
    let logged: Vec<&Value> = lines.iter().filter(|v| v["stage"] == "prompt_debug").collect();
    assert_eq!(logged.len(), 1, "{lines:?}");
    let prompt = logged[0]["prompt"].as_str().unwrap();
    assert!(prompt.contains(marker) && prompt.contains("[FILTERED]"), "{prompt}");
    assert!(lines.iter().all(|v| !v.to_string().contains(secret)), "a secret was logged: {lines:?}");
    assert_eq!(logged[0]["filtered"], 1);
    gw.stop().await;

    // Past its end: off by itself, whatever the sample.
    let extra =
        format!("[applications.demo.debug_prompts]\nuntil = {}\nsample_rate = 1.0\n", toml_datetime(now_s() - 1));
    let gw = TestGateway::with_engine(&fake.url(), "openai", &extra).await;
    let lines = prompt_lines(&gw, "9bf92f3577b34da6a3ce929d0e0e473b", &content).await;
    assert!(lines.iter().any(|v| v["stage"] == "end"), "{lines:?}");
    assert!(lines.iter().all(|v| !v.to_string().contains(marker)), "logged after its end: {lines:?}");
    gw.stop().await;

    // Not configured: never.
    let gw = TestGateway::with_engine(&fake.url(), "openai", "").await;
    let lines = prompt_lines(&gw, "abf92f3577b34da6a3ce929d0e0e473c", &content).await;
    assert!(lines.iter().any(|v| v["stage"] == "end"), "{lines:?}");
    assert!(lines.iter().all(|v| !v.to_string().contains(marker)), "logged while off: {lines:?}");
    gw.stop().await;
}

#[test]
fn debug_prompts_settings_are_checked() {
    let dir = std::env::temp_dir();
    let load = |extra: &str| {
        let text = edgeway::testing::config_toml("http://127.0.0.1:9", "openai", &dir, extra);
        edgeway::config::Config::from_toml_str(&text, Vec::new(), &dir)
    };
    let soon_s = now_s() + 600;
    let soon = toml_datetime(soon_s);
    let ok = load(&format!("[applications.demo.debug_prompts]\nuntil = {soon}\n")).expect("valid");
    let d = ok.applications["demo"].debug_prompts.expect("on");
    assert_eq!(d.until_ms, soon_s * 1000);
    assert_eq!(d.sample_rate, 0.1);
    assert!(ok.applications["ops"].debug_prompts.is_none());
    for (bad, path) in [
        ("sample_rate = 0.5".to_string(), "until"),
        ("until = 2026-12-02T10:00:00".to_string(), "until"),
        ("until = \"tomorrow\"".to_string(), "until"),
        (format!("until = {}", toml_datetime(now_s() + 8 * 86_400)), "until"),
        (format!("until = {soon}\nsample_rate = 0"), "sample_rate"),
        (format!("until = {soon}\nsample_rate = 1.5"), "sample_rate"),
        (format!("until = {soon}\nrate = 0.5"), "rate"),
    ] {
        let e = load(&format!("[applications.demo.debug_prompts]\n{bad}\n")).expect_err(&bad);
        let want = format!("applications.demo.debug_prompts.{path}");
        assert!(e.0.iter().any(|e| e.path == want), "{bad}: {e}");
    }
}

/// A collector that takes OTLP/HTTP JSON exports and hands each body over.
async fn collector() -> (String, tokio::sync::mpsc::UnboundedReceiver<Value>) {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let app = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(move |headers: axum::http::HeaderMap, body: axum::body::Bytes| {
            let tx = tx.clone();
            async move {
                assert_eq!(headers["content-type"], "application/json");
                let _ = tx.send(serde_json::from_slice::<Value>(&body).unwrap());
                axum::Json(json!({}))
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (format!("http://{addr}"), rx)
}

#[tokio::test]
async fn task_spans_are_exported_to_the_configured_otlp_collector() {
    let (endpoint, mut exports) = collector().await;
    let fake = FakeEngine::start().await;
    let gw = TestGateway::with_engine(&fake.url(), "openai", &format!("[log]\notlp_endpoint = \"{endpoint}\"\n")).await;
    let marker = "PROMPT-OTLP-5e7f";
    let mut body = chat_body(false);
    body["messages"][0]["content"] = json!(marker);
    let resp = client()
        .post(format!("{}/v1/chat/completions", gw.base_url))
        .bearer_auth(DEMO_KEY)
        .header("traceparent", PARENT)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let task_id = resp.headers()["x-task-id"].to_str().unwrap().to_string();
    let _: Value = resp.json().await.unwrap();

    let export =
        tokio::time::timeout(std::time::Duration::from_secs(20), exports.recv()).await.expect("an export").unwrap();
    assert!(!export.to_string().contains(marker), "prompt text exported: {export}");
    let rs = &export["resourceSpans"][0];
    let resource: Vec<(&str, &str)> = rs["resource"]["attributes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| (a["key"].as_str().unwrap(), a["value"]["stringValue"].as_str().unwrap()))
        .collect();
    assert!(
        resource.contains(&("service.name", "edgeway")) && resource.contains(&("service.instance.id", "test-node"))
    );
    let spans = rs["scopeSpans"][0]["spans"].as_array().unwrap();
    assert_eq!(spans.len(), 1, "{export}");
    let span = &spans[0];
    assert_eq!(span["traceId"], TRACE);
    assert_eq!(span["parentSpanId"], "00f067aa0ba902b7", "a child of the caller's span");
    assert_eq!(span["name"], "task");
    assert_eq!(span["status"]["code"], 1);
    let start: u128 = span["startTimeUnixNano"].as_str().unwrap().parse().unwrap();
    let end: u128 = span["endTimeUnixNano"].as_str().unwrap().parse().unwrap();
    assert!(start > 0 && end >= start);
    let attr = |k: &str| -> Value {
        let a = span["attributes"].as_array().unwrap().iter().find(|a| a["key"] == k);
        a.unwrap_or_else(|| panic!("no {k} in {span}"))["value"].clone()
    };
    assert_eq!(attr("edgeway.task_id")["stringValue"], task_id.as_str());
    assert_eq!(attr("edgeway.state")["stringValue"], "SUCCEEDED");
    assert_eq!(attr("edgeway.output_tokens")["intValue"], "5");
    // The engine call hangs under the task's span.
    let tp = fake.traceparents()[0].clone().unwrap();
    assert_eq!(tp, format!("00-{TRACE}-{}-01", span["spanId"].as_str().unwrap()));
    gw.stop().await;
}

#[test]
fn an_otlp_endpoint_must_be_an_http_url() {
    let dir = std::env::temp_dir();
    for bad in ["localhost:4318", "grpc://127.0.0.1:4317", "http://"] {
        let text = edgeway::testing::config_toml(
            "http://127.0.0.1:9",
            "openai",
            &dir,
            &format!("[log]\notlp_endpoint = \"{bad}\"\n"),
        );
        let e = edgeway::config::Config::from_toml_str(&text, Vec::new(), &dir).expect_err(bad);
        assert!(e.0.iter().any(|e| e.path == "log.otlp_endpoint"), "{bad}: {e}");
    }
}

/// Review 15 M4: with every stage line written to stderr from the runtime's
/// workers, a reader of stderr that stops reading (a stalled journald, a
/// full pipe) stopped every request once the pipe's 64 KiB were full. The
/// real binary, its stderr a pipe nobody reads, `info` logs: 600 calls
/// (several stage lines each: the pipe several times over) all answer; the
/// lines wait in the writer's queue (8192 lines, then dropped and counted
/// in `edgeway_log_lines_dropped_total`), not in the request.
#[tokio::test]
async fn a_stderr_nobody_reads_holds_up_no_request() {
    use std::process::{Command, Stdio};
    let fake = FakeEngine::start_with(Knobs::default()).await;
    let dir = edgeway::testing::TempDir::new("edgeway-stderr");
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let text = edgeway::testing::config_toml(&fake.url(), "openai", &dir.0, "")
        .replace("127.0.0.1:0", &format!("127.0.0.1:{port}"));
    let file = dir.0.join("edgeway.toml");
    std::fs::write(&file, text).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_edgeway"))
        .args(["serve", "--config"])
        .arg(&file)
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Held open and never read.
    let _stderr = child.stderr.take();
    let base = format!("http://127.0.0.1:{port}");
    let ready = async {
        while !matches!(client().get(format!("{base}/ready")).send().await, Ok(r) if r.status() == 200) {
            tokio::time::sleep(std::time::Duration::from_millis(25)).await;
        }
    };
    tokio::time::timeout(std::time::Duration::from_secs(30), ready).await.expect("ready");
    let calls = async {
        for _ in 0..600 {
            let r = client()
                .post(format!("{base}/v1/chat/completions"))
                .bearer_auth(DEMO_KEY)
                .json(&chat_body(false))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
        }
    };
    let answered = tokio::time::timeout(std::time::Duration::from_secs(120), calls).await;
    let metrics =
        client().get(format!("{base}/metrics")).bearer_auth(OPS_KEY).send().await.unwrap().text().await.unwrap();
    let _ = child.kill();
    let _ = child.wait();
    answered.expect("every call answered with stderr unread");
    // Exported as a number (how many were dropped depends on the lines per call).
    let dropped = metrics.lines().find_map(|l| l.strip_prefix("edgeway_log_lines_dropped_total "));
    assert!(dropped.expect("the counter").parse::<f64>().is_ok(), "{metrics}");
}
