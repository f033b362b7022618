//! The NATS ingress and lifecycle sink end to end: a whole gateway on port
//! 0, a fake engine, and a real `nats-server` per test on a free port
//! (started, stopped and restarted by the test).

mod common;

use std::collections::HashMap;
use std::sync::atomic::Ordering::SeqCst;
use std::sync::OnceLock;
use std::time::Duration;

use async_nats::{HeaderMap, StatusCode, Subscriber};
use common::*;
use edgeway::ingress::nats::BusState;
use edgeway::testing::NatsServer;
use futures::StreamExt;
use serde_json::{json, Value};

/// A generous bound for things that happen at once when the code is right.
const LIMIT: Duration = Duration::from_secs(20);

async fn setup(knobs: Knobs, nats_extra: &str) -> (FakeEngine, NatsServer, TestGateway) {
    let nats = NatsServer::start(nats_extra.contains("[nats.jetstream]")).await;
    let (fake, gw) = gateway_on(&nats, knobs, nats_extra).await;
    gw.nats().wait_for(BusState::Connected).await;
    (fake, nats, gw)
}

async fn gateway_on(nats: &NatsServer, knobs: Knobs, nats_extra: &str) -> (FakeEngine, TestGateway) {
    let fake = FakeEngine::start_with(knobs).await;
    let extra = format!("\n[nats]\nurl = \"{}\"\n{nats_extra}", nats.url());
    let gw = TestGateway::with_engine(&fake.url(), "openai", &extra).await;
    gw.wait_ready().await;
    (fake, gw)
}

async fn connect(nats: &NatsServer) -> async_nats::Client {
    async_nats::connect(nats.url()).await.expect("test client connects")
}

/// Validates `v` against `topics/schemas/{name}.json`.
fn validate(name: &str, v: &Value) {
    static SCHEMAS: OnceLock<HashMap<String, jsonschema::Validator>> = OnceLock::new();
    let schemas = SCHEMAS.get_or_init(|| {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("topics/schemas");
        let mut m = HashMap::new();
        for e in std::fs::read_dir(&dir).expect("topics/schemas") {
            let p = e.unwrap().path();
            let v: Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
            let name = p.file_stem().unwrap().to_string_lossy().into_owned();
            m.insert(name, jsonschema::validator_for(&v).unwrap_or_else(|e| panic!("{}: {e}", p.display())));
        }
        m
    });
    let s = schemas.get(name).unwrap_or_else(|| panic!("no schema {name}"));
    let errors: Vec<String> = s.iter_errors(v).map(|e| format!("{e} at {}", e.instance_path())).collect();
    assert!(errors.is_empty(), "{name} schema violated by {v}:\n{}", errors.join("\n"));
}

fn auth(key: &str) -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert("Authorization", format!("Bearer {key}").as_str());
    h
}

/// One streamed chat call as a service would make it: its own inbox,
/// subscribed before the request is published.
struct Call {
    sub: Subscriber,
    /// A message already read (the first answer).
    pending: Option<async_nats::Message>,
}

/// One message of a reply stream: the `Edgeway-Event` header and the JSON.
struct Msg {
    kind: String,
    v: Value,
    headers: HeaderMap,
}

impl Call {
    /// Sends the request; retries while the service is not subscribed yet
    /// (right after a (re)connect the server may still answer "no
    /// responders").
    async fn start(client: &async_nats::Client, headers: HeaderMap, body: &Value) -> Call {
        Call::start_on(client, "ai.v1.chat", headers, body).await
    }

    /// [`Call::start`] on `subject`.
    async fn start_on(client: &async_nats::Client, subject: &str, headers: HeaderMap, body: &Value) -> Call {
        for _ in 0..200 {
            let inbox = client.new_inbox();
            let mut sub = client.subscribe(inbox.clone()).await.unwrap();
            let payload = serde_json::to_vec(body).unwrap().into();
            client.publish_with_reply_and_headers(subject.to_string(), inbox, headers.clone(), payload).await.unwrap();
            let first = tokio::time::timeout(LIMIT, sub.next()).await.expect("an answer").expect("open");
            if first.status == Some(StatusCode::NO_RESPONDERS) {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            return Call { sub, pending: Some(first) };
        }
        panic!("the edgeway service never answered");
    }

    async fn raw_next(&mut self) -> async_nats::Message {
        if let Some(m) = self.pending.take() {
            return m;
        }
        tokio::time::timeout(LIMIT, self.sub.next()).await.expect("next message in time").expect("open")
    }

    /// The next event (keepalives skipped).
    async fn next(&mut self) -> Msg {
        loop {
            let m = self.raw_next().await;
            let headers = m.headers.clone().unwrap_or_default();
            let kind = headers.get("Edgeway-Event").map(|v| v.as_str().to_string()).unwrap_or_default();
            if kind == "keepalive" {
                assert!(m.payload.is_empty());
                continue;
            }
            let v: Value = serde_json::from_slice(&m.payload).expect("event JSON");
            validate(&format!("event-{kind}"), &v);
            return Msg { kind, v, headers };
        }
    }

    /// Reads to the terminal event.
    async fn collect(&mut self) -> Vec<Msg> {
        let mut out = Vec::new();
        loop {
            let m = self.next().await;
            let end = m.kind == "done" || m.kind == "error";
            out.push(m);
            if end {
                return out;
            }
        }
    }
}

fn chat(request_id: &str) -> Value {
    let mut b = chat_body(true);
    b["request_id"] = json!(request_id);
    b
}

#[tokio::test]
async fn a_streamed_request_gets_every_event_in_order_and_one_terminal() {
    let (_fake, nats, gw) = setup(Knobs::default(), "").await;
    let client = connect(&nats).await;
    let mut call = Call::start(&client, auth(DEMO_KEY), &chat("nats-1")).await;
    let events = call.collect().await;
    let seqs: Vec<u64> = events.iter().map(|m| m.v["seq"].as_u64().unwrap()).collect();
    assert_eq!(seqs, (0..events.len() as u64).collect::<Vec<_>>(), "contiguous seq from 0");
    let kinds: Vec<&str> = events.iter().map(|m| m.kind.as_str()).collect();
    assert_eq!(kinds, ["accepted", "delta", "delta", "delta", "delta", "delta", "done"]);
    for m in &events {
        assert_eq!(m.v["type"], m.kind.as_str(), "header and type agree");
        assert_eq!(m.v["request_id"], "nats-1");
    }
    let text: String = events.iter().filter_map(|m| m.v["text"].as_str()).collect();
    assert_eq!(text, "tok tok tok tok tok ");
    let done = &events.last().unwrap().v;
    assert_eq!(done["result"]["status"], "SUCCEEDED");
    assert_eq!(done["result"]["usage"]["output_tokens"], 5);
    let task_id = events[0].v["task_id"].as_str().unwrap();
    assert_eq!(done["result"]["task_id"], task_id);
    assert_eq!(
        stored_states(&gw, task_id).await,
        ["RECEIVED", "VALIDATING", "QUEUED", "DISPATCHING", "RUNNING", "STREAMING", "SUCCEEDED"]
    );
    let metrics = gw.metrics().render();
    assert!(metrics.contains("edgeway_requests_total{ingress=\"nats\",outcome=\"ok\"} 1"), "{metrics}");
    gw.stop().await;
}

#[tokio::test]
async fn refusals_are_one_error_event_with_the_shared_codes_and_application_rights() {
    let (_fake, nats, gw) = setup(Knobs::default(), "").await;
    let client = connect(&nats).await;
    let one = |headers: HeaderMap, body: Value| {
        let client = client.clone();
        async move {
            let mut call = Call::start(&client, headers, &body).await;
            let events = call.collect().await;
            assert_eq!(events.len(), 1, "a refusal is the whole stream");
            let m = events.into_iter().next().unwrap();
            assert_eq!(m.kind, "error");
            assert_eq!(m.v["seq"], 0);
            m
        }
    };
    let m = one(HeaderMap::new(), chat("r1")).await;
    assert_eq!(m.v["code"], "AUTH_FAILED");
    assert_eq!(m.headers.get("Nats-Service-Error-Code").unwrap().as_str(), "401");
    let m = one(auth("sk-wrong"), chat("r2")).await;
    assert_eq!(m.v["code"], "AUTH_FAILED");
    let mut h = HeaderMap::new();
    h.insert("X-Api-Key", DEMO_KEY);
    let mut body = chat("r3");
    body["priority"] = json!("P0");
    let m = one(h, body).await;
    assert_eq!(m.v["code"], "PERMISSION_DENIED", "demo may not use P0, as over HTTP");
    assert_eq!(m.v["request_id"], "r3");
    let mut body = chat("r4");
    body["messages"] = json!("not a list");
    let m = one(auth(DEMO_KEY), body).await;
    assert_eq!(m.v["code"], "INVALID_REQUEST");
    assert!(m.v["message"].as_str().unwrap().contains("messages"), "{}", m.v);
    // ops may use P0.
    let mut body = chat("r5");
    body["priority"] = json!("P0");
    let mut call = Call::start(&client, auth(OPS_KEY), &body).await;
    assert_eq!(call.collect().await.last().unwrap().kind, "done");
    gw.stop().await;
}

#[tokio::test]
async fn service_discovery_finds_the_service_its_endpoints_and_stats() {
    let (_fake, nats, gw) = setup(Knobs::default(), "").await;
    let client = connect(&nats).await;
    let ask = |subject: &'static str| {
        let client = client.clone();
        async move {
            for _ in 0..200 {
                match client.request(subject, "".into()).await {
                    Ok(m) => return serde_json::from_slice::<Value>(&m.payload).unwrap(),
                    Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
                }
            }
            panic!("no answer on {subject}");
        }
    };
    let ping = ask("$SRV.PING").await;
    assert_eq!(ping["name"], "edgeway");
    assert_eq!(ping["metadata"]["node_id"], "test-node");
    let info = ask("$SRV.INFO.edgeway").await;
    let subjects: Vec<&str> =
        info["endpoints"].as_array().unwrap().iter().map(|e| e["subject"].as_str().unwrap()).collect();
    assert!(subjects.contains(&"ai.v1.chat") && subjects.contains(&"ai.v1.cancel"), "{info}");
    let mut call = Call::start(&client, auth(DEMO_KEY), &chat("disc-1")).await;
    call.collect().await;
    let stats = ask("$SRV.STATS.edgeway").await;
    let chat_stats = stats["endpoints"].as_array().unwrap().iter().find(|e| e["subject"] == "ai.v1.chat").unwrap();
    assert_eq!(chat_stats["num_requests"], 1, "{stats}");
    gw.stop().await;
}

fn slow() -> Knobs {
    Knobs::slow(100_000, 20)
}

async fn cancel(client: &async_nats::Client, key: &str, request_id: &str) -> Value {
    let body = serde_json::to_vec(&json!({ "request_id": request_id })).unwrap().into();
    let m = client.request_with_headers("ai.v1.cancel", auth(key), body).await.expect("cancel answered");
    let v: Value = serde_json::from_slice(&m.payload).unwrap();
    validate(if v["type"] == "error" { "event-error" } else { "cancel-reply" }, &v);
    v
}

#[tokio::test]
async fn cancel_ends_the_task_and_frees_the_engine_but_only_for_its_own_application() {
    let (fake, nats, gw) = setup(slow(), "").await;
    let client = connect(&nats).await;
    let mut call = Call::start(&client, auth(DEMO_KEY), &chat("to-cancel")).await;
    assert_eq!(call.next().await.kind, "accepted");
    assert_eq!(call.next().await.kind, "delta");
    let other_app = cancel(&client, OPS_KEY, "to-cancel").await;
    assert_eq!(other_app["code"], "INVALID_REQUEST", "another application cannot see the task: {other_app}");
    assert_eq!(cancel(&client, DEMO_KEY, "no-such-request").await["code"], "INVALID_REQUEST");
    let answer = cancel(&client, DEMO_KEY, "to-cancel").await;
    assert_eq!(answer["cancelled"], true, "{answer}");
    let task_id = answer["task_id"].as_str().unwrap().to_string();
    let end = loop {
        let m = call.next().await;
        if m.kind != "delta" {
            break m;
        }
    };
    assert_eq!(end.kind, "error");
    assert_eq!(end.v["code"], "REQUEST_CANCELLED");
    assert_eq!(end.v["result"]["status"], "CANCELLED");
    assert_eq!(end.headers.get("Nats-Service-Error-Code").unwrap().as_str(), "499");
    assert!(fake.wait_for(LIMIT, |s| s.aborted.load(SeqCst) == 1).await, "the engine request was aborted");
    assert_eq!(stored_states(&gw, &task_id).await.last().unwrap(), "CANCELLED");
    // A second cancel finds the ended task.
    let again = cancel(&client, DEMO_KEY, "to-cancel").await;
    assert_eq!((again["cancelled"].clone(), again["status"].clone()), (json!(false), json!("CANCELLED")));
    gw.stop().await;
}

/// Request ids are the caller's, so guessable: a bus client of an
/// application must not reach, by request id, a task the same application
/// started on another ingress (a device's over MQTT, a web app's over
/// HTTP). Its own NATS task with that id it still cancels.
#[tokio::test]
async fn a_nats_cancel_reaches_only_tasks_started_over_nats() {
    use edgeway::gateway::{Caller, SubmitOptions};
    use edgeway::task::Ingress;
    let (_fake, nats, gw) = setup(slow(), "").await;
    let client = connect(&nats).await;
    // A device's task, as the MQTT ingress submits it, and a web app's.
    let mut body = chat_body(true);
    body["request_id"] = json!("dev-1");
    let bytes = serde_json::to_vec(&body).unwrap();
    let device = gw
        .gateway()
        .submit(Caller::Credential(Some(DEMO_KEY)), &bytes, Ingress::Mqtt, SubmitOptions::default())
        .await
        .unwrap();
    body["request_id"] = json!("web-1");
    let url = format!("{}/v1/tasks", gw.base_url);
    let web = common::client().post(url).bearer_auth(DEMO_KEY).json(&body).send().await.unwrap();
    let web: Value = web.json().await.unwrap();
    let web_task = web["task_id"].as_str().unwrap().to_string();

    for rid in ["dev-1", "web-1"] {
        let v = cancel(&client, DEMO_KEY, rid).await;
        assert_eq!(v["code"], "INVALID_REQUEST", "{rid}: {v}");
    }
    for id in [device.task_id.as_str(), web_task.as_str()] {
        let e = gw.scheduler().get(id).expect("known");
        assert!(!e.log.is_ended() && !e.cancel.is_cancelled(), "task {id} untouched");
    }
    // The same request id over NATS is the caller's own.
    let mut call = Call::start(&client, auth(DEMO_KEY), &chat("dev-1")).await;
    assert_eq!(call.next().await.kind, "accepted");
    let answer = cancel(&client, DEMO_KEY, "dev-1").await;
    assert_eq!(answer["cancelled"], true, "{answer}");
    assert_ne!(answer["task_id"], device.task_id.as_str());
    assert!(!gw.scheduler().get(&device.task_id).unwrap().cancel.is_cancelled());
    drop(device);
    gw.stop().await;
}

/// edgeway publishes replies with its own bus rights: a request whose reply
/// subject is not an inbox (here another service's subject, and edgeway's
/// own lifecycle events) is refused and nothing is published there; a
/// cancel naming such a reply subject does nothing either.
#[tokio::test]
async fn a_reply_subject_that_is_not_an_inbox_is_refused() {
    let (fake, nats, gw) = setup(slow(), "").await;
    let client = connect(&nats).await;
    let mut victims = client.subscribe("victim.>").await.unwrap();
    let mut forged = client.subscribe("ai.v1.events.demo.SUCCEEDED").await.unwrap();
    client.flush().await.unwrap();
    let payload = |v: &Value| -> bytes::Bytes { serde_json::to_vec(v).unwrap().into() };
    for reply in ["victim.inbox", "ai.v1.events.demo.SUCCEEDED"] {
        client
            .publish_with_reply_and_headers("ai.v1.chat", reply, auth(DEMO_KEY), payload(&chat("forged")))
            .await
            .unwrap();
    }
    let metric = "edgeway_requests_total{ingress=\"nats\",outcome=\"INVALID_REQUEST\"}";
    wait_metric(&gw, metric, 2).await;
    // A real call still works, with its inbox.
    let mut call = Call::start(&client, auth(DEMO_KEY), &chat("mine")).await;
    assert_eq!(call.next().await.kind, "accepted");
    let body = payload(&json!({ "request_id": "mine" }));
    client.publish_with_reply_and_headers("ai.v1.cancel", "victim.cancel", auth(DEMO_KEY), body).await.unwrap();
    wait_metric(&gw, metric, 3).await;
    assert_eq!(call.next().await.kind, "delta", "the cancel with a forged reply subject did nothing");
    assert_eq!(fake.stats.requests.load(SeqCst), 1, "only the real call ran");
    // Refused before anything was published: nothing arrives.
    let quiet = Duration::from_millis(300);
    assert!(tokio::time::timeout(quiet, victims.next()).await.is_err(), "published to a victim subject");
    assert!(tokio::time::timeout(quiet, forged.next()).await.is_err(), "forged a lifecycle event");
    drop(call);
    gw.stop().await;
}

/// The probe subject each event carries is `{edgeway's inbox}.{token}` with
/// a random 128-bit token (a counter let any bus client guess the next
/// stream's probe), and a request that names edgeway's own inbox as its
/// reply subject is refused: nothing runs, nothing is published there.
#[tokio::test]
async fn probe_tokens_are_random_and_edgeways_own_inbox_is_no_reply_subject() {
    let (fake, nats, gw) = setup(slow(), "").await;
    let client = connect(&nats).await;
    let mut a = Call::start(&client, auth(DEMO_KEY), &chat("a")).await;
    let mut b = Call::start(&client, auth(DEMO_KEY), &chat("b")).await;
    let probe = |m: async_nats::Message| m.reply.expect("a probe subject").to_string();
    let (pa, pb) = (probe(a.raw_next().await), probe(b.raw_next().await));
    let (inbox, ta) = pa.rsplit_once('.').unwrap();
    let (inbox_b, tb) = pb.rsplit_once('.').unwrap();
    assert_eq!(inbox, inbox_b, "one inbox of edgeway's");
    let token = |t: &str| {
        assert_eq!(t.len(), 32, "128 bits in hex: {t}");
        u128::from_str_radix(t, 16).unwrap()
    };
    assert!(token(ta).abs_diff(token(tb)) > 1 << 64, "not a counter: {ta} {tb}");

    let payload = serde_json::to_vec(&chat("forged")).unwrap();
    for reply in [format!("{inbox}.0"), pb.clone(), inbox.to_string()] {
        client
            .publish_with_reply_and_headers("ai.v1.chat", reply, auth(DEMO_KEY), payload.clone().into())
            .await
            .unwrap();
    }
    let metric = "edgeway_requests_total{ingress=\"nats\",outcome=\"INVALID_REQUEST\"}";
    wait_metric(&gw, metric, 3).await;
    assert_eq!(fake.stats.requests.load(SeqCst), 2, "only the two real calls ran");
    assert_eq!(b.next().await.kind, "delta", "the probed stream goes on");
    drop((a, b));
    gw.stop().await;
}

/// Waits for a task's terminal event through the registry.
async fn terminal_of(gw: &TestGateway, task_id: &str) -> edgeway::task::TaskEvent {
    let mut s = gw.scheduler().attach(task_id, 0).expect("known task");
    let mut last = None;
    while let Some((_, e)) = tokio::time::timeout(LIMIT, s.recv()).await.expect("task ends") {
        last = Some(e);
    }
    last.expect("events")
}

fn cancelled_by_client(e: &edgeway::task::TaskEvent) -> bool {
    matches!(e, edgeway::task::TaskEvent::Error { error, .. } if error.code.as_str() == "REQUEST_CANCELLED")
}

#[tokio::test]
async fn a_caller_that_stops_listening_mid_stream_cancels_its_task() {
    let (fake, nats, gw) = setup(slow(), "").await;
    let client = connect(&nats).await;
    let mut call = Call::start(&client, auth(DEMO_KEY), &chat("goes-away")).await;
    let task_id = call.next().await.v["task_id"].as_str().unwrap().to_string();
    assert_eq!(call.next().await.kind, "delta");
    call.sub.unsubscribe().await.unwrap();
    assert!(fake.wait_for(LIMIT, |s| s.aborted.load(SeqCst) == 1).await, "the engine was freed");
    assert!(cancelled_by_client(&terminal_of(&gw, &task_id).await));
    assert_eq!(stored_states(&gw, &task_id).await.last().unwrap(), "CANCELLED");
    let metrics = gw.metrics().render();
    assert!(metrics.contains("edgeway_nats_callers_lost_total{reason=\"no_responders\"} 1"), "{metrics}");
    gw.stop().await;
}

/// `on_disconnect: "continue"`: the task runs on while its caller is away;
/// `ai.v1.resume` streams it again from any kept seq, to its end, for its
/// own application only.
#[tokio::test]
async fn a_caller_that_continues_comes_back_and_resumes_its_task() {
    let (fake, nats, gw) = setup(Knobs::slow(30, 20), "").await;
    let client = connect(&nats).await;
    let mut body = chat("continues");
    body["on_disconnect"] = json!("continue");
    let mut call = Call::start(&client, auth(DEMO_KEY), &body).await;
    let task_id = call.next().await.v["task_id"].as_str().unwrap().to_string();
    assert_eq!(call.next().await.kind, "delta");
    call.sub.unsubscribe().await.unwrap();
    // Nobody listens; the task still runs to its end.
    let end = terminal_of(&gw, &task_id).await;
    assert!(matches!(end, edgeway::task::TaskEvent::Done(_)), "{end:?}");
    assert_eq!(fake.stats.aborted.load(SeqCst), 0);
    wait_metric(&gw, "edgeway_nats_callers_lost_total{reason=\"no_responders\"}", 1).await;

    // The caller comes back and reads the rest from seq 2.
    let resume = json!({"request_id": "continues", "from_seq": 2});
    let mut again = Call::start_on(&client, "ai.v1.resume", auth(DEMO_KEY), &resume).await;
    let events = again.collect().await;
    let seqs: Vec<u64> = events.iter().map(|m| m.v["seq"].as_u64().unwrap()).collect();
    assert_eq!(seqs, (2..2 + seqs.len() as u64).collect::<Vec<_>>(), "contiguous from 2");
    assert_eq!(events.last().unwrap().kind, "done");
    assert_eq!(events.iter().filter(|m| m.kind == "delta").count(), 29, "30 tokens, the first read before");

    // Another application, or an unknown request: an error, nothing else.
    for (key, rid) in [(OPS_KEY, "continues"), (DEMO_KEY, "never-sent")] {
        let resume = json!({"request_id": rid, "from_seq": 0});
        let mut r = Call::start_on(&client, "ai.v1.resume", auth(key), &resume).await;
        let m = r.next().await;
        assert_eq!((m.kind.as_str(), &m.v["code"], &m.v["seq"]), ("error", &json!("INVALID_REQUEST"), &json!(0)));
    }
    // A value other than continue or cancel is refused.
    body["on_disconnect"] = json!("later");
    let mut bad = Call::start(&client, auth(DEMO_KEY), &body).await;
    assert_eq!(bad.next().await.v["code"], "INVALID_REQUEST");
    gw.stop().await;
}

#[tokio::test]
async fn a_caller_that_vanishes_before_the_first_token_is_noticed_by_keepalives() {
    // The engine sits on the prompt for a while: no event would reveal the
    // missing caller before the first token.
    let knobs = Knobs { first_token_delay: Duration::from_secs(3), ..Knobs::default() };
    let (fake, nats, gw) = setup(knobs, "keepalive_ms = 100\n").await;
    let client = connect(&nats).await;
    let mut call = Call::start(&client, auth(DEMO_KEY), &chat("vanishes")).await;
    let task_id = call.next().await.v["task_id"].as_str().unwrap().to_string();
    let keepalive = call.raw_next().await;
    let kind = keepalive.headers.as_ref().and_then(|h| h.get("Edgeway-Event")).map(|v| v.as_str().to_string());
    assert_eq!(kind.as_deref(), Some("keepalive"), "keepalives arrive while the engine is busy");
    assert!(keepalive.payload.is_empty());
    assert!(fake.wait_for(LIMIT, |s| s.active.load(SeqCst) == 1).await);
    drop(call);
    drop(client); // the whole connection goes away
    let end = terminal_of(&gw, &task_id).await;
    assert!(cancelled_by_client(&end), "{end:?}");
    let edgeway::task::TaskEvent::Error { meta, .. } = end else { unreachable!() };
    assert_eq!(meta.timing.first_token_ms, None, "cancelled before the first token, by a keepalive");
    let snap = gw.scheduler().snapshot().await.unwrap();
    assert_eq!(snap.instances[0].running, 0, "the slot is free");
    // The fake engine notices the closed request when it next writes.
    assert!(fake.wait_for(LIMIT, |s| s.aborted.load(SeqCst) == 1).await, "the engine request was dropped");
    assert_eq!(fake.stats.completed.load(SeqCst), 0);
    gw.stop().await;
}

/// Reads lifecycle events from `sub` until `task_id` reaches a terminal
/// state; returns (subject, event) pairs of that task.
async fn events_of(sub: &mut Subscriber, task_id: &str) -> Vec<(String, Value)> {
    let mut out = Vec::new();
    loop {
        let m = tokio::time::timeout(LIMIT, sub.next()).await.expect("events in time").expect("open");
        let text = String::from_utf8(m.payload.to_vec()).unwrap();
        assert!(!text.contains("Say hello"), "no prompt text in lifecycle events: {text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        validate("lifecycle-event", &v);
        if v["task_id"] != task_id {
            continue;
        }
        let end = matches!(v["state"].as_str(), Some("SUCCEEDED" | "FAILED" | "CANCELLED" | "TIMED_OUT" | "REJECTED"));
        out.push((m.subject.to_string(), v));
        if end {
            return out;
        }
    }
}

#[tokio::test]
async fn lifecycle_events_of_http_tasks_are_published_per_tenant_and_state() {
    let (_fake, nats, gw) = setup(Knobs::default(), "").await;
    let client = connect(&nats).await;
    let mut sub = client.subscribe("ai.v1.events.>").await.unwrap();
    client.flush().await.unwrap();
    let resp = post_chat(&gw, DEMO_KEY, &chat_body(false)).await;
    assert_eq!(resp.status(), 200);
    let task_id = resp.headers()["x-task-id"].to_str().unwrap().to_string();
    let events = events_of(&mut sub, &task_id).await;
    let states: Vec<&str> = events.iter().map(|(_, v)| v["state"].as_str().unwrap()).collect();
    assert_eq!(states, ["RECEIVED", "VALIDATING", "QUEUED", "DISPATCHING", "RUNNING", "STREAMING", "SUCCEEDED"]);
    for (subject, v) in &events {
        assert_eq!(subject, &format!("ai.v1.events.demo.{}", v["state"].as_str().unwrap().to_lowercase()));
        assert_eq!(v["ingress"], "http");
        assert_eq!(v["tenant"], "demo");
        assert_eq!(v["application"], "demo");
        assert_eq!(v["node_id"], "test-node");
    }
    let last = &events.last().unwrap().1;
    assert_eq!(last["result"]["status"], "SUCCEEDED");
    assert_eq!(last["result"]["usage"]["output_tokens"], 5);
    assert_eq!(last["instance"], "fake");

    // A refusal at admission is an event too.
    let mut body = chat_body(false);
    body["priority"] = json!("P0");
    let mut rejected = client.subscribe("ai.v1.events.demo.rejected").await.unwrap();
    client.flush().await.unwrap();
    let resp = post_chat(&gw, DEMO_KEY, &body).await;
    assert_eq!(resp.status(), 403);
    let m = tokio::time::timeout(LIMIT, rejected.next()).await.unwrap().unwrap();
    let v: Value = serde_json::from_slice(&m.payload).unwrap();
    validate("lifecycle-event", &v);
    assert_eq!((v["state"].as_str(), v["error_code"].as_str()), (Some("REJECTED"), Some("PERMISSION_DENIED")));
    gw.stop().await;
}

/// Waits until a metric line reaches `want`.
async fn wait_metric(gw: &TestGateway, name: &str, want: u64) {
    let deadline = tokio::time::Instant::now() + LIMIT;
    loop {
        let metrics = gw.metrics().render();
        let v: u64 =
            metrics.lines().find(|l| l.starts_with(name)).and_then(|l| l.rsplit(' ').next()?.parse().ok()).unwrap_or(0);
        if v == want {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "{name} is {v}, not {want}:\n{metrics}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn ready(gw: &TestGateway) -> (u16, Value) {
    let r = client().get(format!("{}/ready", gw.base_url)).bearer_auth(OPS_KEY).send().await.unwrap();
    (r.status().as_u16(), r.json().await.unwrap())
}

#[tokio::test]
async fn the_bus_may_be_down_at_start_and_restart_while_edgeway_serves() {
    let mut nats = NatsServer::stopped(false);
    let (_fake, gw) = gateway_on(&nats, Knobs::default(), "reconnect_max_delay_ms = 200\n").await;
    // Down at start: HTTP serves, /ready is ready and says so.
    let (status, body) = ready(&gw).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["nats"]["state"], "connecting");
    assert_eq!(post_chat(&gw, DEMO_KEY, &chat_body(false)).await.status(), 200);

    nats.restart().await;
    gw.nats().wait_for(BusState::Connected).await;
    let client = connect(&nats).await;
    let mut call = Call::start(&client, auth(DEMO_KEY), &chat("after-start")).await;
    assert_eq!(call.collect().await.last().unwrap().kind, "done");
    assert_eq!(ready(&gw).await.1["nats"]["state"], "connected");
    assert!(gw.metrics().render().contains("edgeway_nats_connected 1"));

    // The server goes away while edgeway runs.
    nats.stop().await;
    gw.nats().wait_for(BusState::Disconnected).await;
    let (status, body) = ready(&gw).await;
    assert_eq!((status, body["nats"]["state"].as_str()), (200, Some("disconnected")), "{body}");
    assert!(gw.metrics().render().contains("edgeway_nats_connected 0"));
    assert_eq!(post_chat(&gw, DEMO_KEY, &chat_body(false)).await.status(), 200, "HTTP does not care");

    // It comes back: the service is found again, events flow again.
    nats.restart().await;
    gw.nats().wait_for(BusState::Connected).await;
    let client = connect(&nats).await;
    let mut sub = client.subscribe("ai.v1.events.demo.succeeded").await.unwrap();
    client.flush().await.unwrap();
    let mut call = Call::start(&client, auth(DEMO_KEY), &chat("after-restart")).await;
    let events = call.collect().await;
    assert_eq!(events.last().unwrap().kind, "done");
    let task_id = events[0].v["task_id"].as_str().unwrap();
    let done = events_of(&mut sub, task_id).await;
    assert_eq!(done[0].1["ingress"], "nats");
    let metrics = gw.metrics().render();
    assert!(metrics.contains("edgeway_nats_connection_events_total{event=\"disconnected\"} 1"), "{metrics}");
    gw.stop().await;
}

#[tokio::test]
async fn jetstream_keeps_events_for_a_subscriber_that_was_down() {
    let (_fake, nats, gw) =
        setup(Knobs::default(), "[nats.jetstream]\nstream = \"EDGE_EVENTS\"\nstorage = \"memory\"\n").await;
    gw.nats().wait_stream_ready().await;
    assert_eq!(ready(&gw).await.1["nats"]["jetstream"], "ok");
    // Nobody listens while the task runs.
    let resp = post_chat(&gw, DEMO_KEY, &chat_body(false)).await;
    let task_id = resp.headers()["x-task-id"].to_str().unwrap().to_string();
    assert_eq!(resp.status(), 200);

    // The late subscriber replays the stream from the start.
    let js = async_nats::jetstream::new(connect(&nats).await);
    let stream = js.get_stream("EDGE_EVENTS").await.unwrap();
    let consumer =
        stream.create_consumer(async_nats::jetstream::consumer::pull::OrderedConfig::default()).await.unwrap();
    let mut messages = consumer.messages().await.unwrap();
    let mut states = Vec::new();
    while states.last().map(String::as_str) != Some("SUCCEEDED") {
        let m = tokio::time::timeout(LIMIT, messages.next()).await.expect("replayed").unwrap().unwrap();
        let v: Value = serde_json::from_slice(&m.payload).unwrap();
        if v["task_id"] == task_id.as_str() {
            let id = m.headers.as_ref().and_then(|h| h.get("Nats-Msg-Id")).unwrap().as_str().to_string();
            assert_eq!(id, format!("{task_id}.{}", v["state"].as_str().unwrap()));
            states.push(v["state"].as_str().unwrap().to_string());
        }
    }
    assert_eq!(states.first().map(String::as_str), Some("RECEIVED"));
    gw.stop().await;
}

#[tokio::test]
async fn an_absent_bus_never_slows_requests_and_lost_events_are_counted() {
    let nats = NatsServer::stopped(false);
    let (_fake, gw) = gateway_on(&nats, Knobs::default(), "events_queue_capacity = 4\n").await;
    for _ in 0..3 {
        let resp = post_chat(&gw, DEMO_KEY, &chat_body(false)).await;
        assert_eq!(resp.status(), 200);
    }
    // 3 tasks × 7 transitions, 4 kept for the reconnect: the rest counted.
    wait_metric(&gw, "edgeway_nats_events_dropped_total{reason=\"queue_full\"}", 17).await;
    gw.stop().await;
}

#[test]
fn the_commented_nats_block_of_the_example_config_is_valid() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config/edgeway.toml");
    let text = std::fs::read_to_string(&path).unwrap();
    let start = text.find("# [nats]\n").expect("a commented [nats] block");
    let end = start + text[start..].find("\n\n").unwrap();
    let block: String = text[start..end].lines().map(|l| format!("{}\n", l.strip_prefix("# ").unwrap())).collect();
    let text = format!("{}\n{block}{}", &text[..start], &text[end..]);
    let env = [("NATS_TOKEN".to_string(), "t0ken".to_string()), ("HOME".to_string(), "/home/edge".to_string())];
    let cfg =
        edgeway::config::Config::from_toml_str(&text, env, path.parent().unwrap()).unwrap_or_else(|e| panic!("{e}"));
    let nats = cfg.nats.expect("[nats] is on");
    assert_eq!(nats.subject("chat"), "ai.v1.chat");
    assert_eq!(nats.auth, edgeway::config::NatsAuth::Token(edgeway::config::Secret::new("t0ken")));
    assert_eq!(nats.jetstream.expect("jetstream").stream, "EDGEWAY_EVENTS");
}

#[tokio::test]
async fn a_stream_is_cancelled_when_the_bus_stays_away() {
    let (fake, mut nats, gw) = setup(slow(), "caller_timeout_ms = 300\nkeepalive_ms = 100\n").await;
    let client = connect(&nats).await;
    let mut call = Call::start(&client, auth(DEMO_KEY), &chat("bus-goes")).await;
    let task_id = call.next().await.v["task_id"].as_str().unwrap().to_string();
    assert_eq!(call.next().await.kind, "delta");
    nats.stop().await;
    assert!(cancelled_by_client(&terminal_of(&gw, &task_id).await));
    assert!(fake.wait_for(LIMIT, |s| s.aborted.load(SeqCst) == 1).await, "the engine was freed");
    let metrics = gw.metrics().render();
    assert!(metrics.contains("edgeway_nats_callers_lost_total{reason=\"bus_unavailable\"} 1"), "{metrics}");
    gw.stop().await;
}

#[tokio::test]
async fn a_traceparent_header_joins_events_store_record_and_engine_call() {
    let (fake, nats, gw) = setup(Knobs::default(), "").await;
    let client = connect(&nats).await;
    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let mut h = auth(DEMO_KEY);
    h.insert("traceparent", format!("00-{trace}-00f067aa0ba902b7-01").as_str());
    let events = Call::start(&client, h, &chat("nats-trace")).await.collect().await;
    for m in &events {
        match m.kind.as_str() {
            "accepted" | "queued" | "done" | "error" => assert_eq!(m.v["trace_id"], trace, "{}", m.v),
            _ => assert!(m.v.get("trace_id").is_none(), "{}", m.v),
        }
    }
    let done = &events.last().unwrap().v;
    assert_eq!(done["result"]["trace_id"], trace);
    let task_id = events[0].v["task_id"].as_str().unwrap();
    gw.store().flush().await;
    let conn = rusqlite::Connection::open(gw.db_path()).unwrap();
    let stored: String =
        conn.query_row("SELECT trace_id FROM tasks WHERE task_id = ?1", [task_id], |r| r.get(0)).unwrap();
    assert_eq!(stored, trace);
    let tps = fake.traceparents();
    assert_eq!(tps.len(), 1);
    let tp = tps[0].as_deref().expect("the engine call has a traceparent");
    assert!(tp.starts_with(&format!("00-{trace}-")) && !tp.contains("00f067aa0ba902b7"), "{tp}");
    gw.stop().await;
}
