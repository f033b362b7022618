//! The WebSocket channel (`/v1/ws`) with a real WebSocket client
//! (tokio-tungstenite) against the fake engine: a request's seq'd events
//! (the MQTT topic schema), several requests on one socket, cancel, a
//! closed socket cancelling by default, resume on a new socket after a
//! drop (`on_disconnect: "continue"`), bad frames answered without closing
//! the socket, the in-flight bound, and authentication at the upgrade.

mod common;
mod mqtt_support;

use std::collections::HashMap;
use std::time::Duration;

use common::*;
use futures::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::Message;

type Ws = tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

async fn gateway(knobs: Knobs) -> (FakeEngine, TestGateway) {
    let fake = FakeEngine::start_with(knobs).await;
    let gw = TestGateway::with_engine(&fake.url(), "openai", "").await;
    gw.wait_ready().await;
    (fake, gw)
}

fn url(gw: &TestGateway) -> String {
    format!("{}/v1/ws", gw.base_url.replace("http://", "ws://"))
}

async fn connect(gw: &TestGateway) -> Ws {
    let mut req = url(gw).into_client_request().unwrap();
    req.headers_mut().insert("authorization", format!("Bearer {DEMO_KEY}").parse().unwrap());
    tokio_tungstenite::connect_async(req).await.expect("upgrade").0
}

fn request(rid: &str, extra: Value) -> Message {
    let mut v = json!({
        "type": "request", "request_id": rid, "model": "general-chat",
        "messages": [{"role": "user", "content": "Say hello"}],
    });
    v.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    if v["model"] == "general-chat" && extra.get("on_disconnect") != Some(&json!("later")) {
        // The MQTT request schema, `type` and all.
        mqtt_support::validate("request", &v);
    }
    Message::text(v.to_string())
}

async fn send(ws: &mut Ws, v: Value) {
    ws.send(Message::text(v.to_string())).await.unwrap();
}

/// The next JSON event (within 30 s).
async fn next(ws: &mut Ws) -> Value {
    let wait = async {
        loop {
            match ws.next().await.expect("socket open").expect("frame") {
                Message::Text(t) => {
                    let v = serde_json::from_str::<Value>(t.as_str()).unwrap();
                    // The same event schemas as the MQTT topics.
                    mqtt_support::validate(&format!("event-{}", v["type"].as_str().unwrap()), &v);
                    return v;
                }
                Message::Ping(_) | Message::Pong(_) => {}
                m => panic!("unexpected frame {m:?}"),
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(30), wait).await.expect("an event within 30 s")
}

/// Events until `rid`'s terminal one; returns them (of `rid` only).
async fn until_end(ws: &mut Ws, rid: &str) -> Vec<Value> {
    let mut evs = Vec::new();
    loop {
        let v = next(ws).await;
        if v["request_id"] == rid {
            let end = v["type"] == "done" || v["type"] == "error";
            evs.push(v);
            if end {
                return evs;
            }
        }
    }
}

fn text_of(evs: &[Value]) -> String {
    evs.iter().filter(|e| e["type"] == "delta").map(|e| e["text"].as_str().unwrap()).collect()
}

#[tokio::test]
async fn one_socket_carries_several_requests_as_seqd_events() {
    let (_fake, gw) = gateway(Knobs::default()).await;
    let mut ws = connect(&gw).await;
    ws.send(request("r1", json!({}))).await.unwrap();
    ws.send(request("r2", json!({}))).await.unwrap();
    let mut by_rid: HashMap<String, Vec<Value>> = HashMap::new();
    while by_rid.values().filter(|e| e.last().is_some_and(|l| l["type"] == "done")).count() < 2 {
        let v = next(&mut ws).await;
        by_rid.entry(v["request_id"].as_str().unwrap().to_string()).or_default().push(v);
    }
    for rid in ["r1", "r2"] {
        let evs = &by_rid[rid];
        assert_eq!(evs[0]["type"], "accepted", "{evs:#?}");
        for (i, e) in evs.iter().enumerate() {
            assert_eq!(e["seq"], i, "contiguous seqs from 0: {evs:#?}");
        }
        assert_eq!(text_of(evs), "tok tok tok tok tok ");
        let done = evs.last().unwrap();
        assert_eq!(done["result"]["status"], "SUCCEEDED");
        assert_eq!(done["result"]["request_id"], rid);
    }
    gw.stop().await;
}

#[tokio::test]
async fn a_cancel_frame_stops_the_request() {
    let (_fake, gw) = gateway(Knobs::slow(1000, 20)).await;
    let mut ws = connect(&gw).await;
    ws.send(request("c1", json!({}))).await.unwrap();
    let accepted = next(&mut ws).await;
    let task_id = accepted["task_id"].as_str().unwrap().to_string();
    while next(&mut ws).await["type"] != "delta" {}
    send(&mut ws, json!({"type": "cancel", "request_id": "c1"})).await;
    let evs = until_end(&mut ws, "c1").await;
    let last = evs.last().unwrap();
    assert_eq!(last["type"], "error");
    assert_eq!(last["code"], "REQUEST_CANCELLED", "{last}");
    gw.wait_for_state(&task_id, TaskState::Cancelled).await;
    gw.stop().await;
}

#[tokio::test]
async fn a_closed_socket_cancels_its_requests_by_default() {
    let (fake, gw) = gateway(Knobs::slow(1000, 20)).await;
    let mut ws = connect(&gw).await;
    ws.send(request("d1", json!({}))).await.unwrap();
    let task_id = next(&mut ws).await["task_id"].as_str().unwrap().to_string();
    while next(&mut ws).await["type"] != "delta" {}
    drop(ws);
    gw.wait_for_state(&task_id, TaskState::Cancelled).await;
    assert!(fake.wait_for(Duration::from_secs(10), |s| s.active.load(std::sync::atomic::Ordering::SeqCst) == 0).await);
    gw.stop().await;
}

#[tokio::test]
async fn a_continue_request_resumes_on_a_new_socket() {
    let (_fake, gw) = gateway(Knobs::slow(40, 20)).await;
    let mut ws = connect(&gw).await;
    ws.send(request("k1", json!({"on_disconnect": "continue"}))).await.unwrap();
    let mut first = Vec::new();
    while first.len() < 4 {
        first.push(next(&mut ws).await);
    }
    let task_id = first[0]["task_id"].as_str().unwrap().to_string();
    drop(ws);
    // Still running, and resumable from the next seq on a new socket.
    let mut ws = connect(&gw).await;
    send(&mut ws, json!({"type": "resume", "request_id": "k1", "from_seq": 4})).await;
    let rest = until_end(&mut ws, "k1").await;
    assert_eq!(rest[0]["seq"], 4, "{rest:#?}");
    for (i, e) in rest.iter().enumerate() {
        assert_eq!(e["seq"], 4 + i as u64);
    }
    assert_eq!(rest.last().unwrap()["type"], "done", "{rest:#?}");
    let all: Vec<Value> = first.into_iter().chain(rest).collect();
    assert_eq!(text_of(&all), "tok ".repeat(40));
    assert_eq!(stored_states(&gw, &task_id).await.last().map(String::as_str), Some("SUCCEEDED"));
    // An unknown request cannot be resumed: an error at that seq.
    send(&mut ws, json!({"type": "resume", "request_id": "nope", "from_seq": 2})).await;
    let e = next(&mut ws).await;
    assert_eq!(
        (e["type"].as_str(), e["code"].as_str(), e["seq"].as_u64()),
        (Some("error"), Some("INVALID_REQUEST"), Some(2))
    );
    gw.stop().await;
}

#[tokio::test]
async fn bad_frames_get_an_error_and_the_socket_stays_open() {
    let (fake, gw) = gateway(Knobs::default()).await;
    let mut ws = connect(&gw).await;
    let bad = [
        Message::text("not json"),
        Message::binary(vec![1u8, 2, 3]),
        Message::text(json!({"type": "request"}).to_string()),
        Message::text(json!({"type": "launch", "request_id": "b1"}).to_string()),
        request("b2", json!({"model": "no-such-model"})),
        request("b3", json!({"on_disconnect": "later"})),
    ];
    for m in bad {
        let shown = format!("{m:?}");
        ws.send(m).await.unwrap();
        let e = next(&mut ws).await;
        assert_eq!(e["type"], "error", "{shown}: {e}");
        assert!(e["code"] == "INVALID_REQUEST" || e["code"] == "MODEL_NOT_FOUND", "{shown}: {e}");
        assert_eq!(e["seq"], 0);
    }
    assert_eq!(fake.requests(), 0);
    ws.send(request("ok", json!({}))).await.unwrap();
    assert_eq!(until_end(&mut ws, "ok").await.last().unwrap()["type"], "done");
    gw.stop().await;
}

#[tokio::test]
async fn requests_in_flight_on_a_socket_are_bounded() {
    let fake = FakeEngine::start_with(Knobs::slow(1000, 20)).await;
    let gw = TestGateway::with_engine_edit(&fake.url(), "openai", "", |t| {
        t.replacen("[http]\n", "[http]\nws_max_in_flight = 1\n", 1)
    })
    .await;
    gw.wait_ready().await;
    let mut ws = connect(&gw).await;
    ws.send(request("f1", json!({}))).await.unwrap();
    assert_eq!(next(&mut ws).await["type"], "accepted");
    ws.send(request("f2", json!({}))).await.unwrap();
    let e = loop {
        let v = next(&mut ws).await;
        if v["request_id"] == "f2" {
            break v;
        }
    };
    assert_eq!(e["code"], "RATE_LIMITED", "{e}");
    // The same request id twice on one socket is refused as such.
    ws.send(request("f1", json!({}))).await.unwrap();
    let e = loop {
        let v = next(&mut ws).await;
        if v["type"] == "error" {
            break v;
        }
    };
    assert_eq!((e["request_id"].as_str(), e["code"].as_str()), (Some("f1"), Some("INVALID_REQUEST")), "{e}");
    assert!(e["message"].as_str().unwrap().contains("already in flight"), "{e}");
    gw.stop().await;
}

#[tokio::test]
async fn the_upgrade_needs_a_key_in_a_header_or_a_subprotocol() {
    let (_fake, gw) = gateway(Knobs::default()).await;
    for key in [None, Some("wrong-key")] {
        let mut req = url(&gw).into_client_request().unwrap();
        if let Some(k) = key {
            req.headers_mut().insert("authorization", format!("Bearer {k}").parse().unwrap());
        }
        match tokio_tungstenite::connect_async(req).await {
            Err(tokio_tungstenite::tungstenite::Error::Http(resp)) => assert_eq!(resp.status(), 401, "{key:?}"),
            other => panic!("{key:?}: expected 401, got {:?}", other.map(|_| ())),
        }
    }
    // A browser offers the key as a subprotocol next to "edgeway".
    let mut req = url(&gw).into_client_request().unwrap();
    req.headers_mut().insert("sec-websocket-protocol", format!("edgeway, bearer.{DEMO_KEY}").parse().unwrap());
    let (mut ws, resp) = tokio_tungstenite::connect_async(req).await.expect("upgrade with a subprotocol key");
    assert_eq!(resp.headers()["sec-websocket-protocol"], "edgeway");
    ws.send(request("p1", json!({}))).await.unwrap();
    assert_eq!(until_end(&mut ws, "p1").await.last().unwrap()["type"], "done");
    gw.stop().await;
}

/// The next frame that is not a ping or pong, as it is.
async fn next_frame(ws: &mut Ws) -> Option<Message> {
    let wait = async {
        loop {
            match ws.next().await {
                Some(Ok(Message::Ping(_) | Message::Pong(_))) => {}
                Some(Ok(m)) => return Some(m),
                Some(Err(e)) => {
                    eprintln!("socket error: {e}");
                    return None;
                }
                None => return None,
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(30), wait).await.expect("a frame within 30 s")
}

fn is_going_away(m: &Option<Message>) -> bool {
    match m {
        Some(Message::Close(Some(f))) => u16::from(f.code) == 1001,
        _ => false,
    }
}

#[tokio::test]
async fn a_silent_client_is_closed_and_its_request_cancelled_a_live_one_stays() {
    let fake = FakeEngine::start_with(Knobs::slow(1000, 20)).await;
    let gw = TestGateway::with_engine_edit(&fake.url(), "openai", "", |t| {
        t.replacen("[http]\n", "[http]\nidle_timeout_ms = 300\n", 1)
    })
    .await;
    gw.wait_ready().await;
    let mut live = connect(&gw).await;
    let mut silent = connect(&gw).await;
    silent.send(request("s1", json!({}))).await.unwrap();
    // The live client reads (tungstenite answers the pings as it does) for
    // well over an idle timeout and hears nothing else.
    assert!(tokio::time::timeout(Duration::from_millis(1200), next(&mut live)).await.is_err());
    // The silent one answered no ping: closed, its request cancelled.
    let mut task_id = None;
    let end = loop {
        match next_frame(&mut silent).await {
            Some(Message::Text(t)) => {
                let v: Value = serde_json::from_str(t.as_str()).unwrap();
                if v["type"] == "accepted" {
                    task_id = v["task_id"].as_str().map(str::to_string);
                }
            }
            other => break other,
        }
    };
    // The close frame may not be read: tungstenite answers the pings it
    // reads first on a socket that is already shut (broken pipe).
    assert!(end.is_none() || is_going_away(&end), "{end:?}");
    gw.wait_for_state(&task_id.unwrap(), TaskState::Cancelled).await;
    live.send(request("l1", json!({"max_tokens": 2}))).await.unwrap();
    assert_eq!(until_end(&mut live, "l1").await.last().unwrap()["type"], "done");
    gw.stop().await;
}

#[tokio::test]
async fn at_shutdown_a_socket_sends_the_last_events_then_closes() {
    let (_fake, gw) = gateway(Knobs::slow(1000, 20)).await;
    let mut ws = connect(&gw).await;
    ws.send(request("z1", json!({}))).await.unwrap();
    assert_eq!(next(&mut ws).await["type"], "accepted");
    let stop = tokio::spawn(gw.stop());
    let evs = until_end(&mut ws, "z1").await;
    assert_eq!(evs.last().unwrap()["type"], "error", "{evs:#?}");
    let end = next_frame(&mut ws).await;
    assert!(is_going_away(&end), "{end:?}");
    stop.await.unwrap();
}
