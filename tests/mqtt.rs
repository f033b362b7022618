//! Devices over MQTT against the fake engine: a whole gateway with its
//! embedded broker on a free port, devices as real MQTT 3.1.1 and 5
//! clients (rumqttc) on real sockets. Every message edgeway sends is
//! validated against `topics/schemas`.

mod mqtt_support;

use std::sync::atomic::Ordering::SeqCst;
use std::time::Duration;

use bytes::Bytes;
use mqtt_support::*;
use rumqttc::v5::mqttbytes::v5::PublishProperties;
use serde_json::json;

#[tokio::test]
async fn requests_stream_to_the_response_topic_on_mqtt_3_and_5() {
    let (fake, gw, addr) = start(Knobs::default(), "coalesce_ms = 0").await;
    for (v, creds) in [(V::V4, D1), (V::V5, D2)] {
        let mut d = device(addr, v, creds).await;
        d.subscribe(&d.topic("res/#")).await;
        let rid = format!("r-{v:?}");
        d.publish(&d.topic("req"), request(&rid).to_string()).await;
        let events = d.stream(&d.topic(&format!("res/{rid}"))).await;
        assert_eq!(events[0]["type"], "accepted");
        assert!(events[0]["task_id"].is_string());
        assert_eq!(check_stream(&events), "tok tok tok tok tok ");
        let done = events.last().unwrap();
        assert_eq!(done["type"], "done", "{done}");
        assert_eq!(done["result"]["status"], "SUCCEEDED");
        assert_eq!(done["result"]["request_id"], rid.as_str());
        assert_eq!(done["result"]["usage"]["output_tokens"], 5);
    }
    assert_eq!(fake.stats.requests.load(SeqCst), 2);
    gw.stop().await;
}

#[tokio::test]
async fn mqtt_5_response_topic_and_correlation_data_are_honoured() {
    let (_fake, gw, addr) = start(Knobs::default(), "").await;
    let mut d = device(addr, V::V5, D1).await;
    d.subscribe(&d.topic("answers/#")).await;
    let props = PublishProperties {
        response_topic: Some(d.topic("answers/7")),
        correlation_data: Some(Bytes::from_static(b"corr-7")),
        ..Default::default()
    };
    d.publish_v5(&d.topic("req"), request("r-corr").to_string(), props).await;
    let mut events = Vec::new();
    loop {
        let m = d.msg().await;
        assert_eq!(m.topic, d.topic("answers/7"));
        assert_eq!(m.correlation.as_deref(), Some(&b"corr-7"[..]));
        let v = m.json();
        let end = v["type"] == "done";
        events.push(v);
        if end {
            break;
        }
    }
    assert_eq!(check_stream(&events), "tok tok tok tok tok ");

    // A response topic outside the device's namespace is not used.
    d.subscribe(&d.topic("res/#")).await;
    let props = PublishProperties { response_topic: Some("ai/v1/demo-device-2/res/x".into()), ..Default::default() };
    d.publish_v5(&d.topic("req"), request("r-outside").to_string(), props).await;
    let events = d.stream(&d.topic("res/r-outside")).await;
    assert_eq!(events.last().unwrap()["type"], "done");
    gw.stop().await;
}

#[tokio::test]
async fn wrong_credentials_spoofed_ids_and_unknown_devices_are_refused_at_connect() {
    let (_fake, gw, addr) = start(Knobs::default(), "").await;
    for v in [V::V4, V::V5] {
        let bad = [
            ("demo-device-1", "demo-device-1", "wrong"),
            // Someone else's password, own id.
            ("demo-device-2", "demo-device-2", "demo-pass-1"),
            // Another device's credentials under a spoofed client id.
            ("demo-device-2", "demo-device-1", "demo-pass-1"),
            ("intruder", "intruder", "demo-pass-1"),
        ];
        for (id, user, pass) in bad {
            let e = connect(addr, v, id, user, pass).await.err().unwrap_or_else(|| panic!("{id}/{user} connected"));
            assert!(e.contains("BadUserNamePassword"), "{v:?} {id}/{user}: {e}");
        }
        let e = connect(addr, v, "bad/id", "bad/id", "x").await.err().expect("refused");
        assert!(e.contains("ClientId") || e.contains("Identifier"), "{v:?}: {e}");
    }
    // The real devices still connect (refusals did not take their ids).
    let mut d = device(addr, V::V4, D1).await;
    d.subscribe(&d.topic("res/#")).await;
    d.publish(&d.topic("req"), request("after-refusals").to_string()).await;
    let events = d.stream(&d.topic("res/after-refusals")).await;
    assert_eq!(events.last().unwrap()["type"], "done");
    gw.stop().await;
}

#[tokio::test]
async fn a_hostile_device_receives_nothing_of_others_and_starts_nothing_in_their_name() {
    let (fake, gw, addr) = start(Knobs::slow(20, 20), "coalesce_ms = 0").await;
    let mut victim = device(addr, V::V5, D1).await;
    victim.subscribe(&victim.topic("#")).await;
    let mut hostile = device(addr, V::V5, D2).await;
    let filters = [
        "#",
        "+/#",
        "ai/#",
        "ai/v1/+/res/#",
        "ai/v1/demo-device-1/#",
        "ai/v1/demo-device-1/res/victim-1",
        "$share/g/ai/v1/demo-device-1/#",
        "+/+/+/+/+",
        "d/#",
        "d/demo-device-1/#",
    ];
    for f in filters {
        hostile.subscribe(f).await;
    }

    victim.publish(&victim.topic("req"), request("victim-1").to_string()).await;
    // The victim's own request shows up on its `#` too; its stream follows.
    let first = victim.msg().await;
    assert_eq!(first.topic, victim.topic("req"));
    let accepted = victim.msg().await.json();
    assert_eq!(accepted["type"], "accepted");

    // The hostile device acts in the victim's name: a request, a cancel of
    // the running task, a resume; and tries its own resume of the victim's
    // request id.
    let own = [
        request("hostile-1").to_string(),
        json!({"request_id": "victim-1"}).to_string(),
        json!({"request_id": "victim-1", "from_seq": 0}).to_string(),
    ];
    hostile.publish("ai/v1/demo-device-1/req", own[0].clone()).await;
    hostile.publish("ai/v1/demo-device-1/cancel", own[1].clone()).await;
    hostile.publish("ai/v1/demo-device-1/resume", own[2].clone()).await;
    hostile.subscribe(&hostile.topic("res/#")).await;
    hostile.publish(&hostile.topic("resume"), json!({"request_id": "victim-1", "from_seq": 0}).to_string()).await;

    // The victim's task is not cancelled and the victim gets exactly its
    // own stream.
    let mut rest = Vec::new();
    loop {
        let m = victim.msg().await;
        assert_eq!(m.topic, victim.topic("res/victim-1"), "{}", String::from_utf8_lossy(&m.payload));
        let v = m.json();
        let end = v["type"] == "done" || v["type"] == "error";
        rest.push(v);
        if end {
            break;
        }
    }
    let mut all = vec![accepted];
    all.extend(rest);
    assert_eq!(check_stream(&all).len(), 20 * 4);
    assert_eq!(all.last().unwrap()["type"], "done");

    // A probe published by the hostile device into its own subtree matches
    // each of its filters; anything leaked would sit before it in the same
    // filter logs. What it got: its own probe copies, the answer to its
    // own resume and its own publishes (which stay in its private subtree,
    // whatever topic it named), nothing else.
    let leaked =
        |m: &Msg| !m.topic.starts_with("ai/v1/demo-device-2/") && !own.iter().any(|o| m.payload == o.as_bytes());
    hostile.publish(&hostile.topic("res/probe"), "probe").await;
    let mut probes = 0;
    let mut own_answer = false;
    while probes < 4 || !own_answer {
        let m = hostile.msg().await;
        assert!(!leaked(&m), "leaked to the hostile device: {m:?}");
        if m.payload == "probe" {
            probes += 1;
        } else if m.topic.starts_with("ai/v1/demo-device-2/res/") {
            let v = m.json();
            assert_eq!(v["type"], "error", "{v}");
            assert_eq!(v["code"], "INVALID_REQUEST");
            own_answer = true;
        }
    }
    for m in hostile.drain() {
        assert!(!leaked(&m), "leaked to the hostile device: {m:?}");
    }
    // Only the victim's request ran.
    assert_eq!(fake.stats.requests.load(SeqCst), 1);
    assert_eq!(fake.stats.aborted.load(SeqCst), 0);
    gw.stop().await;
}

#[tokio::test]
async fn cancel_stops_the_engine_and_ends_the_stream_with_request_cancelled() {
    for form in FORMS {
        let (fake, gw, addr) = start(Knobs::slow(1000, 20), "coalesce_ms = 0").await;
        let mut d = device(addr, V::V4, D1).await;
        form.subscribe(&mut d).await;
        d.publish(&d.topic("req"), form.request("to-cancel").to_string()).await;
        let mut r = StreamReader::new(form, "to-cancel");
        let mut events = vec![r.next(&mut d).await, r.next(&mut d).await];
        assert_eq!(events[1]["type"], "delta", "{form:?}");
        d.publish(&d.topic("cancel"), json!({"request_id": "to-cancel"}).to_string()).await;
        events.extend(r.until_end(&mut d).await);
        check_stream(&events);
        let last = events.last().unwrap();
        assert_eq!(last["type"], "error");
        assert_eq!(last["code"], "REQUEST_CANCELLED", "{form:?}");
        assert!(fake.wait_for(Duration::from_secs(10), |s| s.active.load(SeqCst) == 0).await);
        assert_eq!(fake.stats.aborted.load(SeqCst), 1);
        gw.stop().await;
    }
}

#[tokio::test]
async fn a_repeated_request_id_never_starts_a_second_inference() {
    for form in FORMS {
        let (fake, gw, addr) = start(Knobs::slow(10, 10), "coalesce_ms = 0").await;
        let mut d = device(addr, V::V4, D1).await;
        form.subscribe(&mut d).await;
        d.publish(&d.topic("req"), form.request("same").to_string()).await;
        let mut r = StreamReader::new(form, "same");
        let first = r.until_end(&mut d).await;
        let text = check_stream(&first);

        // The device reconnects and retries: it gets the finished stream
        // again (a compact one on the same stream topic).
        d.disconnect().await;
        drop(d);
        let mut d = device(addr, V::V4, D1).await;
        form.subscribe(&mut d).await;
        d.publish(&d.topic("req"), form.request("same").to_string()).await;
        let again = r.until_end(&mut d).await;
        assert_eq!(check_stream(&again), text);
        assert_eq!(again, first, "the same messages, the same seqs ({form:?})");

        // Two devices may use the same request id: two tasks.
        let mut d2 = device(addr, V::V4, D2).await;
        form.subscribe(&mut d2).await;
        d2.publish(&d2.topic("req"), form.request("same").to_string()).await;
        let other = StreamReader::new(form, "same").until_end(&mut d2).await;
        // (Only the JSON form names the task; in both the engine runs
        // twice, counted below.)
        if form == Form::Json {
            assert_ne!(other[0]["task_id"], first[0]["task_id"]);
        }

        // The same id with a different prompt is refused (on
        // `res/{request_id}`, in JSON, in both forms: it has no stream).
        let mut changed = form.request("same");
        changed["messages"][0]["content"] = json!("something else");
        d.publish(&d.topic("req"), changed.to_string()).await;
        let refused = d.stream(&d.topic("res/same")).await;
        assert_eq!(refused[0]["code"], "INVALID_REQUEST", "{refused:?}");
        assert_eq!(fake.stats.requests.load(SeqCst), 2);
        gw.stop().await;
    }
}

#[tokio::test]
async fn a_device_resumes_after_a_dropped_connection_and_misses_nothing() {
    for form in FORMS {
        let (fake, gw, addr) = start(Knobs::slow(40, 25), "coalesce_ms = 0").await;
        let mut d = device(addr, V::V5, D1).await;
        form.subscribe(&mut d).await;
        d.publish(&d.topic("req"), form.request("long").to_string()).await;
        let mut r = StreamReader::new(form, "long");
        let mut got = Vec::new();
        while got.len() < 5 {
            got.push(r.next(&mut d).await);
        }
        // The network drops (no DISCONNECT); the task goes on meanwhile.
        d.kill();
        assert!(fake.wait_for(Duration::from_secs(10), |s| s.requests.load(SeqCst) == 1).await);

        let mut d = device(addr, V::V5, D1).await;
        form.subscribe(&mut d).await;
        let from = got.len() as u64;
        d.publish(&d.topic("resume"), json!({"request_id": "long", "from_seq": from}).to_string()).await;
        got.extend(r.until_end(&mut d).await);
        // Anything that arrived before the drop is not sent twice; seq is
        // contiguous across the reconnect.
        assert_eq!(check_stream(&got).len(), 40 * 4, "{form:?}");
        assert_eq!(got.last().unwrap()["type"], "done");
        assert_eq!(fake.stats.requests.load(SeqCst), 1);

        // After the end, a resume from any kept seq replays the rest.
        d.publish(&d.topic("resume"), json!({"request_id": "long", "from_seq": 3}).to_string()).await;
        let tail = r.until_end(&mut d).await;
        assert_eq!(tail, got[3..].to_vec());

        // Resumes that cannot be served get an explicit error (in JSON on
        // `res/{request_id}`, in both forms).
        d.publish(&d.topic("resume"), json!({"request_id": "never-sent", "from_seq": 0}).to_string()).await;
        let e = d.stream(&d.topic("res/never-sent")).await;
        assert_eq!((e.len(), &e[0]["code"]), (1, &json!("INVALID_REQUEST")));
        let beyond = got.len() as u64 + 5;
        d.publish(&d.topic("resume"), json!({"request_id": "long", "from_seq": beyond}).to_string()).await;
        let e = d.stream(&d.topic("res/long")).await;
        assert_eq!(e[0]["seq"], beyond);
        assert_eq!(e[0]["code"], "INVALID_REQUEST");
        gw.stop().await;
    }
}

#[tokio::test]
async fn on_disconnect_cancel_stops_the_task_when_the_device_drops() {
    let (fake, gw, addr) = start(Knobs::slow(1000, 20), "coalesce_ms = 0").await;
    let mut d = device(addr, V::V4, D1).await;
    d.subscribe(&d.topic("res/#")).await;
    let mut req = request("drop-cancel");
    req["on_disconnect"] = json!("cancel");
    d.publish(&d.topic("req"), req.to_string()).await;
    let _accepted = d.msg().await;
    let _delta = d.msg().await;
    d.kill();
    assert!(fake.wait_for(Duration::from_secs(10), |s| s.aborted.load(SeqCst) == 1).await);
    gw.stop().await;
}

/// `on_disconnect = "continue"` (the default): while the device is away
/// the task runs on, and the device resumes it to the end. Were continue to
/// behave like cancel, the drop (handled before the device comes back)
/// would end the stream with REQUEST_CANCELLED and the engine would see an
/// abort.
#[tokio::test]
async fn on_disconnect_continue_keeps_the_task_running_and_resumable_while_the_device_is_away() {
    let (fake, gw, addr) = start(Knobs::slow(200, 20), "coalesce_ms = 0\ndisconnect_grace_ms = 60000").await;
    let mut lifecycle = gw.recorder().subscribe();
    let mut d = device(addr, V::V4, D1).await;
    d.subscribe(&d.topic("res/#")).await;
    let mut req = request("drop-continue");
    req["on_disconnect"] = json!("continue");
    d.publish(&d.topic("req"), req.to_string()).await;
    let mut got = vec![d.msg().await.json(), d.msg().await.json()];
    assert_eq!((got[0]["type"].as_str(), got[1]["type"].as_str()), (Some("accepted"), Some("delta")));
    let task_id = got[0]["task_id"].as_str().unwrap().to_string();
    d.kill();
    // The ingress has handled the drop (the device's last connection
    // ended) before the device comes back.
    assert!(until_devices_connected(&gw, 0).await, "the drop is handled");

    let mut d = device(addr, V::V4, D1).await;
    d.subscribe(&d.topic("res/#")).await;
    let from = got.len() as u64;
    d.publish(&d.topic("resume"), json!({"request_id": "drop-continue", "from_seq": from}).to_string()).await;
    got.extend(d.stream(&d.topic("res/drop-continue")).await);
    assert_eq!(check_stream(&got).len(), 200 * 4);
    assert_eq!(got.last().unwrap()["type"], "done", "{:?}", got.last());
    let end = recorded_end(&mut lifecycle, &task_id).await;
    assert_eq!(end.state.as_str(), "SUCCEEDED", "{end:?}");
    assert_eq!((fake.stats.requests.load(SeqCst), fake.stats.aborted.load(SeqCst)), (1, 0));
    gw.stop().await;
}

/// Nobody comes back: the task is cancelled once the grace period is over,
/// not at the drop, and the record says why.
#[tokio::test]
async fn on_disconnect_continue_cancels_only_after_the_grace_period() {
    let grace = Duration::from_millis(500);
    let extra = format!("coalesce_ms = 0\ndisconnect_grace_ms = {}", grace.as_millis());
    let (fake, gw, addr) = start(Knobs::slow(1000, 20), &extra).await;
    let mut lifecycle = gw.recorder().subscribe();
    let mut d = device(addr, V::V4, D1).await;
    d.subscribe(&d.topic("res/#")).await;
    // No `on_disconnect` field: `continue` is the default.
    let req = request("drop-continue");
    d.publish(&d.topic("req"), req.to_string()).await;
    let accepted = d.msg().await.json();
    let _delta = d.msg().await;
    let task_id = accepted["task_id"].as_str().unwrap().to_string();
    let dropped = std::time::Instant::now();
    d.kill();
    assert!(fake.wait_for(Duration::from_secs(10), |s| s.aborted.load(SeqCst) == 1).await);
    // The grace period starts when the drop is handled, after `dropped`.
    assert!(dropped.elapsed() >= grace, "cancelled {:?} after the drop", dropped.elapsed());
    let end = recorded_end(&mut lifecycle, &task_id).await;
    assert_eq!(end.state.as_str(), "CANCELLED", "{end:?}");
    assert!(end.reason.contains("grace period"), "{end:?}");
    gw.stop().await;
}

#[tokio::test]
async fn expired_requests_are_answered_and_never_run() {
    let (fake, gw, addr) = start(Knobs::slow(200, 20), "").await;
    let mut d = device(addr, V::V5, D1).await;
    d.subscribe(&d.topic("res/#")).await;
    let mut stale = request("stale");
    stale["expires_at"] = json!(edgeway::task::now_ms() - 1000);
    d.publish(&d.topic("req"), stale.to_string()).await;
    let e = d.stream(&d.topic("res/stale")).await;
    assert_eq!(e.len(), 1);
    assert_eq!(e[0]["code"], "QUEUE_TIMEOUT");

    // Both engine slots busy: a request with a 1 s MQTT 5 message expiry
    // waits in the queue, expires there and never reaches the engine.
    for rid in ["busy-1", "busy-2"] {
        d.publish(&d.topic("req"), request(rid).to_string()).await;
    }
    assert!(fake.wait_for(Duration::from_secs(10), |s| s.active.load(SeqCst) == 2).await);
    let props = PublishProperties { message_expiry_interval: Some(1), ..Default::default() };
    d.publish_v5(&d.topic("req"), request("expiring").to_string(), props).await;
    let mut last = None;
    while last.is_none() {
        let m = d.msg().await;
        if m.topic == d.topic("res/expiring") {
            let v = m.json();
            if v["type"] == "error" {
                last = Some(v);
            }
        }
    }
    assert_eq!(last.unwrap()["code"], "QUEUE_TIMEOUT");
    assert_eq!(fake.stats.requests.load(SeqCst), 2, "the expired request never ran");
    gw.stop().await;
}

#[tokio::test]
async fn malformed_and_oversized_payloads_get_invalid_request_and_harm_no_one() {
    let (fake, gw, addr) = start(Knobs::slow(30, 10), "coalesce_ms = 0\nmax_request_bytes = 2048").await;
    let mut other = device(addr, V::V4, D2).await;
    other.subscribe(&other.topic("res/#")).await;
    other.publish(&other.topic("req"), request("innocent").to_string()).await;
    let _ = other.msg().await;

    let mut d = device(addr, V::V4, D1).await;
    d.subscribe(&d.topic("res/#")).await;
    d.publish(&d.topic("req"), r#"{"request_id": "broken-1", "messages": [ oops"#).await;
    let e = d.stream(&d.topic("res/broken-1")).await;
    assert_eq!(e[0]["code"], "INVALID_REQUEST");
    let mut bad_field = request("bad-field");
    bad_field["messages"] = json!("not a list");
    d.publish(&d.topic("req"), bad_field.to_string()).await;
    let e = d.stream(&d.topic("res/bad-field")).await;
    assert!(e[0]["message"].as_str().unwrap().contains("messages"), "{e:?}");
    let mut big = request("too-big");
    big["messages"][0]["content"] = json!("x".repeat(4096));
    d.publish(&d.topic("req"), big.to_string()).await;
    let e = d.stream(&d.topic("res/too-big")).await;
    assert_eq!((e.len(), &e[0]["code"]), (1, &json!("INVALID_REQUEST")));
    let mut no_id = request("x");
    no_id.as_object_mut().unwrap().remove("request_id");
    d.publish(&d.topic("req"), no_id.to_string()).await;
    d.publish(&d.topic("req"), b"\xff\xfe not even text".to_vec()).await;
    // The device is still connected and served.
    d.publish(&d.topic("req"), request("fine").to_string()).await;
    let e = d.stream(&d.topic("res/fine")).await;
    assert_eq!(e.last().unwrap()["type"], "done");

    let mut rest = other.stream(&other.topic("res/innocent")).await;
    assert_eq!(rest.pop().unwrap()["type"], "done");
    assert_eq!(fake.stats.requests.load(SeqCst), 2);
    gw.stop().await;
}

#[tokio::test]
async fn waiting_requests_are_told_their_queue_position_as_it_changes() {
    // Two slots, 30 ms per token; updates every 50 ms. q0 ends after 3
    // tokens, q1 after 20: q2 takes q0's slot and q3 is next for a while.
    let (fake, gw, addr) = start(Knobs::slow(20, 30), "coalesce_ms = 0\n[scheduler]\nqueue_update_ms = 50").await;
    let mut d = device(addr, V::V5, D1).await;
    d.subscribe(&d.topic("res/#")).await;
    let ids = ["q0", "q1", "q2", "q3"];
    for rid in ids {
        let mut r = request(rid);
        if rid == "q0" {
            r["max_tokens"] = json!(3);
        }
        d.publish(&d.topic("req"), r.to_string()).await;
    }
    let mut streams: std::collections::HashMap<String, Vec<serde_json::Value>> = Default::default();
    while streams.values().filter(|s| s.last().is_some_and(|e| e["type"] == "done")).count() < ids.len() {
        let m = d.msg().await;
        let rid = m.topic.rsplit('/').next().unwrap().to_string();
        streams.entry(rid).or_default().push(m.json());
    }
    for rid in ids {
        check_stream(&streams[rid]);
    }
    let told = |rid: &str| -> Vec<u64> {
        let s = &streams[rid];
        let first = s[0]["queue_position"].as_u64().unwrap();
        std::iter::once(first)
            .chain(s.iter().filter(|e| e["type"] == "queued").map(|e| e["position"].as_u64().unwrap()))
            .collect()
    };
    // The first two ran at once; q3 waited behind q2 and was told when it
    // became next. Nothing is queued once deltas flow.
    assert_eq!(told("q2"), [0], "{:#?}", streams["q2"]);
    assert_eq!(told("q3"), [1, 0], "{:#?}", streams["q3"]);
    for rid in ids {
        let s = &streams[rid];
        let first_delta = s.iter().position(|e| e["type"] == "delta").unwrap();
        assert!(s[first_delta..].iter().all(|e| e["type"] != "queued"), "{s:#?}");
    }
    assert_eq!(fake.stats.requests.load(SeqCst), 4);
    gw.stop().await;
}

/// rumqttd does not set TCP_NODELAY on the connections it accepts; edgeway
/// sets it on the listener, which Linux copies to accepted sockets. Looks at
/// the broker's side of a device connection (the gateway runs in this
/// process).
#[cfg(target_os = "linux")]
#[tokio::test]
async fn device_connections_are_accepted_with_tcp_nodelay() {
    use std::os::fd::BorrowedFd;
    let (_fake, gw, addr) = start(Knobs::default(), "").await;
    let mut d = device(addr, V::V4, D1).await;
    d.subscribe(&d.topic("res/#")).await;
    let mut accepted = Vec::new();
    for entry in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
        let Some(fd) = entry.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else { continue };
        if !std::fs::read_link(entry.path()).is_ok_and(|t| t.to_string_lossy().starts_with("socket:")) {
            continue;
        }
        // SAFETY: the descriptor is only borrowed to read socket options.
        let fd = unsafe { BorrowedFd::borrow_raw(fd) };
        let s = socket2::SockRef::from(&fd);
        if s.local_addr().ok().and_then(|a| a.as_socket()) == Some(addr) && !s.is_listener().unwrap_or(true) {
            accepted.push(s.tcp_nodelay().unwrap());
        }
    }
    assert_eq!(accepted, [true], "the broker's end of the one device connection");
    gw.stop().await;
}

/// A device that sends DISCONNECT and connects again at once, over and
/// over, always gets its SUBACK and its messages (the unpatched rumqttd
/// lost the new connection's subscriptions now and then: PATCHES.md #3). A
/// multi-threaded runtime, as in the binary, so the old connection's end
/// and the new CONNECT race for real.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn immediate_reconnects_after_disconnect_keep_their_subscriptions() {
    let (_fake, gw, addr) = start(Knobs::default(), "").await;
    for v in [V::V4, V::V5] {
        for i in 0..40 {
            let mut d = device(addr, v, D1).await;
            d.subscribe(&d.topic("echo/#")).await;
            d.publish(&d.topic(&format!("echo/{i}")), "ping").await;
            let m = d.msg().await;
            assert_eq!(m.topic, d.topic(&format!("echo/{i}")), "{v:?} round {i}");
            d.disconnect_and_wait().await;
        }
    }
    gw.stop().await;
}

/// MQTT-4.7.2-1: filters starting with a wildcard do not match topics
/// starting with `$`; filters starting with `$` do.
#[tokio::test]
async fn wildcards_do_not_match_dollar_topics() {
    let (_fake, gw, addr) = start(Knobs::default(), "").await;
    let mut d = device(addr, V::V5, D1).await;
    d.subscribe("#").await;
    d.subscribe("+/+").await;
    d.publish("$TopicA/B", "dollar").await;
    d.publish("plain/B", "plain").await;
    // One copy per matching filter (`#` and `+/+`), none of the `$` topic.
    for _ in 0..2 {
        let m = d.msg().await;
        assert_eq!((m.topic.as_str(), &m.payload[..]), ("plain/B", &b"plain"[..]), "only the plain topic");
    }
    d.subscribe("$TopicA/#").await;
    d.publish("$TopicA/B", "dollar").await;
    let m = d.msg().await;
    assert_eq!(m.topic, "$TopicA/B");
    gw.stop().await;
}

/// MQTT-3.1.0-2: a second CONNECT on a connection closes it, and the device
/// is not left counted as connected.
#[tokio::test]
async fn a_second_connect_closes_the_connection() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (_fake, gw, addr) = start(Knobs::default(), "").await;
    let connect = {
        let mut body = Vec::new();
        body.extend_from_slice(&[0, 4, b'M', b'Q', b'T', b'T', 4, 0xC2, 0, 60]);
        for s in [D1.0, D1.0, D1.1] {
            body.extend_from_slice(&(s.len() as u16).to_be_bytes());
            body.extend_from_slice(s.as_bytes());
        }
        let mut p = vec![0x10, body.len() as u8];
        p.extend_from_slice(&body);
        p
    };
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(&connect).await.unwrap();
    let mut ack = [0u8; 4];
    s.read_exact(&mut ack).await.unwrap();
    assert_eq!(ack, [0x20, 2, 0, 0], "CONNACK accepted");
    s.write_all(&connect).await.unwrap();
    let mut rest = Vec::new();
    let n = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut rest)).await.expect("closed in time");
    assert!(n.is_ok(), "{n:?}");
    assert!(until_devices_connected(&gw, 0).await, "connected: {:?}", devices_connected(&gw));
    // And the client id connects normally again.
    let mut d = device(addr, V::V4, D1).await;
    d.subscribe(&d.topic("x")).await;
    gw.stop().await;
}

/// Wills stay inside the device's subtree and follow MQTT: published when
/// a connection dies, not after a clean DISCONNECT, and seen by the
/// device's other connections only.
#[tokio::test]
async fn wills_are_published_on_a_dead_connection_only_and_only_to_the_device() {
    let (_fake, gw, addr) = start(Knobs::default(), "").await;
    let mut watch = connect(addr, V::V5, "demo-device-1:watch", D1.0, D1.1).await.unwrap();
    watch.subscribe("ai/v1/demo-device-1/status/#").await;
    let mut other = device(addr, V::V4, D2).await;
    other.subscribe("#").await;
    for (v, name) in [(V::V4, "v4"), (V::V5, "v5")] {
        let topic = format!("ai/v1/demo-device-1/status/{name}");
        // A clean DISCONNECT, done before the next connection: no will
        // (had one been kept, it would arrive before the next one's).
        let mut d = connect_with_will(addr, v, D1.0, D1.0, D1.1, Some((&topic, "clean"))).await.unwrap();
        d.disconnect_and_wait().await;
        // A dead connection (another client id: no reconnect cancels
        // anything): the will.
        let dead = "demo-device-1:dead";
        let d = connect_with_will(addr, v, dead, D1.0, D1.1, Some((&topic, "gone"))).await.unwrap();
        d.kill();
        let m = watch.msg().await;
        assert_eq!((m.topic.as_str(), &m.payload[..]), (topic.as_str(), &b"gone"[..]), "{v:?}");
    }
    // Nothing else arrived for the watcher, and nothing for another device.
    watch.publish("ai/v1/demo-device-1/status/end", "end").await;
    assert_eq!(watch.msg().await.topic, "ai/v1/demo-device-1/status/end");
    other.publish("ai/v1/demo-device-2/probe", "p").await;
    assert_eq!(other.msg().await.topic, "ai/v1/demo-device-2/probe");
    gw.stop().await;
}

#[tokio::test]
async fn deltas_are_coalesced_per_request_with_contiguous_seq() {
    let (_fake, gw, addr) = start(Knobs::slow(60, 5), "coalesce_ms = 100\nmax_chunk_bytes = 4096").await;
    let mut d = device(addr, V::V4, D1).await;
    d.subscribe(&d.topic("res/#")).await;
    d.publish(&d.topic("req"), request("coalesced").to_string()).await;
    let coalesced = d.stream(&d.topic("res/coalesced")).await;
    let text = check_stream(&coalesced);
    assert_eq!(text, "tok ".repeat(60));
    let n = coalesced.iter().filter(|e| e["type"] == "delta").count();

    // Per request: one message per token.
    let mut req = request("per-token");
    req["coalesce_ms"] = json!(0);
    req["max_chunk_bytes"] = json!(1);
    d.publish(&d.topic("req"), req.to_string()).await;
    let each = d.stream(&d.topic("res/per-token")).await;
    assert_eq!(check_stream(&each), text);
    assert_eq!(each.iter().filter(|e| e["type"] == "delta").count(), 60);
    assert!(n < 60, "{n} delta messages for 60 tokens");

    // Per request: by size.
    let mut req = request("by-size");
    req["coalesce_ms"] = json!(60000);
    req["max_chunk_bytes"] = json!(40);
    d.publish(&d.topic("req"), req.to_string()).await;
    let sized = d.stream(&d.topic("res/by-size")).await;
    assert_eq!(check_stream(&sized), text);
    for e in sized.iter().filter(|e| e["type"] == "delta").skip(1) {
        let len = e["text"].as_str().unwrap().len();
        assert!(len >= 40 || e == sized.iter().rev().find(|e| e["type"] == "delta").unwrap(), "{len}");
    }
    gw.stop().await;
}

#[tokio::test]
async fn the_model_catalogue_is_retained_and_read_only() {
    let (_fake, gw, addr) = start(Knobs::default(), "").await;
    let mut d = device(addr, V::V4, D1).await;
    d.subscribe("ai/v1/shared/models").await;
    let m = d.msg().await;
    assert_eq!(m.topic, "ai/v1/shared/models");
    assert_eq!(m.json()["models"][0]["id"], "general-chat");
    // A device cannot overwrite it: its publish stays in its own subtree.
    d.publish("ai/v1/shared/models", "{\"models\": []}").await;
    let mut d2 = device(addr, V::V4, D2).await;
    d2.subscribe("ai/v1/shared/models").await;
    assert_eq!(d2.msg().await.json()["models"][0]["id"], "general-chat");
    gw.stop().await;
}

#[tokio::test]
async fn a_device_may_keep_several_connections_under_instance_names() {
    let (_fake, gw, addr) = start(Knobs::default(), "").await;
    let mut sub = connect(addr, V::V4, "demo-device-1:sub", D1.0, D1.1).await.expect("instance connects");
    sub.subscribe("ai/v1/demo-device-1/res/#").await;
    let publisher = connect(addr, V::V5, "demo-device-1:pub", D1.0, D1.1).await.expect("instance connects");
    publisher.publish("ai/v1/demo-device-1/req", request("two-conns").to_string()).await;
    let events = sub.stream("ai/v1/demo-device-1/res/two-conns").await;
    assert_eq!(events.last().unwrap()["type"], "done");
    // Another device's credentials do not open an instance of this one.
    let e = connect(addr, V::V4, "demo-device-1:x", D2.0, D2.1).await.err().expect("refused");
    assert!(e.contains("BadUserNamePassword"), "{e}");
    gw.stop().await;
}

#[tokio::test]
async fn the_catalogue_lists_only_what_a_device_can_ask_for() {
    // An embedding model serves `POST /v1/embeddings` only: devices send
    // chat, so it is not theirs to see, and a request naming it is refused
    // by name.
    let fake = FakeEngine::start().await;
    let embed = format!(
        "[engines.emb]\ntype = \"openai\"\nbase_url = \"{}\"\nmodel = \"e\"\nhealth_interval_ms = 100\n[models.embed]\nkind = \"embedding\"\ninstances = [\"emb\"]\n",
        fake.url()
    );
    let gw = TestGateway::with_engine(&fake.url(), "openai", &(mqtt_toml("") + &embed)).await;
    gw.wait_ready().await;
    let addr = gw.running.as_ref().unwrap().mqtt.expect("mqtt is configured").mqtt;
    let mut d = device(addr, V::V4, D1).await;
    d.subscribe("ai/v1/shared/models").await;
    let ids: Vec<_> = d.msg().await.json()["models"].as_array().unwrap().iter().map(|m| m["id"].clone()).collect();
    assert_eq!(ids, vec![json!("general-chat")]);
    let mut r = request("embed-1");
    r["model"] = json!("embed");
    d.subscribe(&d.topic("res/embed-1")).await;
    d.publish(&d.topic("req"), r.to_string()).await;
    let events = d.stream(&d.topic("res/embed-1")).await;
    let last = events.last().unwrap();
    assert_eq!((last["type"].as_str(), last["code"].as_str()), (Some("error"), Some("INVALID_REQUEST")), "{last}");
    assert!(last["message"].as_str().unwrap().contains("'embed'"), "{last}");
    gw.stop().await;
}

/// A compact stream (topics/README.md "Compact streams"): its own topic
/// `s/{sid}` with the lowest stream id the device has free, the request id
/// only in `accepted` (`0+{request_id}`), deltas as their bare text with
/// the seq counted (written on the first message, every 16th delta and
/// anything else), `done` as `.{finish_reason} {input} {output}`; ids are
/// freed when a stream is no longer kept, and reused.
#[tokio::test]
async fn compact_streams_have_a_short_id_and_a_minimal_envelope() {
    let (_fake, gw, addr) = start(Knobs::slow(20, 20), "coalesce_ms = 0\nreplay_retention_ms = 0").await;
    let mut d = device(addr, V::V4, D1).await;
    Form::Compact.subscribe(&mut d).await;
    // Two at once: two streams, ids 0 and 1.
    d.publish(&d.topic("req"), Form::Compact.request("first-request").to_string()).await;
    d.publish(&d.topic("req"), Form::Compact.request("second-request").to_string()).await;
    let mut by_topic: std::collections::BTreeMap<String, Vec<Bytes>> = Default::default();
    let mut seqs = CompactSeqs::default();
    let mut ended = 0;
    while ended < 2 {
        let m = d.msg().await;
        let v = seqs.parse(&m.topic, &m.payload);
        ended += usize::from(v["type"] == "done");
        by_topic.entry(m.topic.clone()).or_default().push(m.payload.clone());
    }
    let topics: Vec<&String> = by_topic.keys().collect();
    assert_eq!(topics, [&d.topic("s/0"), &d.topic("s/1")]);
    for msgs in by_topic.values() {
        let mut prev = None;
        let events: Vec<_> = msgs
            .iter()
            .map(|p| {
                let v = parse_compact(p, prev);
                prev = v["seq"].as_u64();
                v
            })
            .collect();
        assert_eq!(check_stream(&events), "tok ".repeat(20));
        let rid = events[0]["request_id"].as_str().unwrap();
        assert!(rid.ends_with("-request"));
        assert_eq!(&msgs[0][..], format!("0+{rid}").as_bytes());
        for (seq, p) in msgs.iter().enumerate().skip(1) {
            assert!(!String::from_utf8_lossy(p).contains("request"), "only accepted names the request");
            if events[seq]["type"] == "delta" {
                let wire = match seq % 16 {
                    0 => format!("{seq}:tok "),
                    _ => "tok ".to_string(),
                };
                assert_eq!(String::from_utf8_lossy(p), wire, "seq {seq}");
            }
        }
        let done = events.last().unwrap();
        assert_eq!((&done["finish_reason"], &done["usage"]["output_tokens"]), (&json!("stop"), &json!(20)));
        let input = done["usage"]["input_tokens"].as_u64().unwrap();
        assert_eq!(&msgs[msgs.len() - 1][..], format!("21.stop {input} 20").as_bytes());
    }
    // Once a stream is no longer kept (`replay_retention_ms = 0`: at its
    // end; a resume then finds nothing), its id is free again.
    for msgs in by_topic.values() {
        let rid = parse_compact(&msgs[0], None)["request_id"].as_str().unwrap().to_string();
        let last = msgs.len() - 1;
        loop {
            d.publish(&d.topic("resume"), json!({"request_id": rid, "from_seq": last}).to_string()).await;
            let m = d.msg().await;
            if m.topic == d.topic(&format!("res/{rid}")) {
                assert!(m.json()["message"].as_str().unwrap().contains("unknown request"), "{:?}", m.payload);
                break;
            }
            // Still kept: its `done` again, with its seq written.
            assert_eq!(parse_compact(&m.payload, None)["type"], "done");
        }
    }
    d.publish(&d.topic("req"), Form::Compact.request("third-request").to_string()).await;
    let mut r = StreamReader::new(Form::Compact, "third-request");
    r.until_end(&mut d).await;
    assert_eq!(r.topic, Some(d.topic("s/0")));
    gw.stop().await;
}

/// A resume of a compact stream writes the seq of its first message (the
/// device counts from there), and a text that would read as a seq keeps
/// its `:`.
#[tokio::test]
async fn a_compact_resume_writes_its_first_seq_and_digits_keep_their_marker() {
    let knobs =
        Knobs { tokens: 12, token_text: "7 ".into(), token_delay: Duration::from_millis(5), ..Knobs::default() };
    let (_fake, gw, addr) = start(knobs, "coalesce_ms = 0").await;
    let mut d = device(addr, V::V4, D1).await;
    Form::Compact.subscribe(&mut d).await;
    d.publish(&d.topic("req"), Form::Compact.request("digits").to_string()).await;
    let mut r = StreamReader::new(Form::Compact, "digits");
    let events = r.until_end(&mut d).await;
    assert_eq!(check_stream(&events), "7 ".repeat(12));
    d.publish(&d.topic("resume"), json!({"request_id": "digits", "from_seq": 5}).to_string()).await;
    let mut payloads = Vec::new();
    loop {
        let m = d.msg().await;
        payloads.push(String::from_utf8(m.payload.to_vec()).unwrap());
        if parse_compact(&m.payload, Some(0))["type"] == "done" {
            break;
        }
    }
    assert_eq!(payloads[0], "5:7 ", "the resume's first message has its seq");
    assert_eq!(payloads[1], ":7 ", "a counted delta whose text starts with a digit keeps its marker");
    assert_eq!(payloads.len(), events.len() - 5);
    gw.stop().await;
}

/// A sender stops when its device comes back (a takeover, or a connect
/// after it had none), not when another instance of the device connects
/// beside the live one: that instance's stream goes on to its end.
#[tokio::test]
async fn another_instance_connecting_does_not_stop_a_live_instances_stream() {
    let (_fake, gw, addr) = start(Knobs::slow(30, 20), "coalesce_ms = 0\nmax_instances_per_device = 2").await;
    let topic = |rest: &str| format!("ai/v1/{}/{rest}", D1.0);
    let mut a = connect(addr, V::V4, "demo-device-1:a", D1.0, D1.1).await.expect("instance a");
    a.subscribe(&topic("res/#")).await;
    a.subscribe(&topic("s/#")).await;
    a.publish(&topic("req"), Form::Compact.request("kept").to_string()).await;
    let mut seqs = CompactSeqs::default();
    let mut events = Vec::new();
    while events.len() < 3 {
        let m = a.msg().await;
        events.push(seqs.parse(&m.topic, &m.payload));
    }
    let _b = connect(addr, V::V4, "demo-device-1:b", D1.0, D1.1).await.expect("instance b");
    assert!(until_devices_connected(&gw, 1).await);
    loop {
        let m = a.msg().await;
        let v = seqs.parse(&m.topic, &m.payload);
        let end = v["type"] == "done";
        events.push(v);
        if end {
            break;
        }
    }
    assert_eq!(check_stream(&events), "tok ".repeat(30), "the whole stream, without a resume");
    gw.stop().await;
}

/// `[devices.ID] compact` and `coalesce_ms`: the device's defaults, which
/// its requests may override (`"compact": false`, `coalesce_ms`).
#[tokio::test]
async fn a_device_may_default_to_compact_streams_and_its_own_coalescing() {
    let tuned = format!(
        "{}compact = true\ncoalesce_ms = 0\n",
        devices_sim::device_config("tuned", "tuned-pass", "demo", "demo")
    );
    let (_fake, gw, addr) =
        start(Knobs::slow(20, 5), &format!("coalesce_ms = 60000\nmax_chunk_bytes = 4096\n{tuned}")).await;
    let mut d = device(addr, V::V4, ("tuned", "tuned-pass")).await;
    Form::Compact.subscribe(&mut d).await;
    d.publish(&d.topic("req"), request("plain").to_string()).await;
    let events = StreamReader::new(Form::Compact, "plain").until_end(&mut d).await;
    assert_eq!(check_stream(&events), "tok ".repeat(20));
    assert_eq!(events.iter().filter(|e| e["type"] == "delta").count(), 20, "the device's coalesce_ms = 0");

    let mut json_form = request("as-json");
    json_form["compact"] = json!(false);
    d.publish(&d.topic("req"), json_form.to_string()).await;
    let events = d.stream(&d.topic("res/as-json")).await;
    assert_eq!(events.iter().filter(|e| e["type"] == "delta").count(), 20);
    assert_eq!(events[1]["request_id"], "as-json");

    let mut req = request("by-request");
    req["coalesce_ms"] = json!(60000);
    d.publish(&d.topic("req"), req.to_string()).await;
    let events = StreamReader::new(Form::Compact, "by-request").until_end(&mut d).await;
    // The first delta at once, the rest within one period.
    assert_eq!(events.iter().filter(|e| e["type"] == "delta").count(), 2, "the request's coalesce_ms");

    // Other devices keep `[mqtt]`'s.
    let mut other = device(addr, V::V4, D1).await;
    other.subscribe(&other.topic("res/#")).await;
    other.publish(&other.topic("req"), request("default").to_string()).await;
    let events = other.stream(&other.topic("res/default")).await;
    assert_eq!(events.iter().filter(|e| e["type"] == "delta").count(), 2);
    gw.stop().await;
}

/// MQTT 5 topic aliases on what edgeway sends: only to a device whose
/// CONNECT allows them, the topic once and then the alias alone; with every
/// alias taken, the oldest moves to the new topic. Both forms.
#[tokio::test]
async fn responses_use_topic_aliases_where_the_device_allows_them() {
    let (_fake, gw, addr) = start(Knobs::slow(5, 5), "coalesce_ms = 0").await;
    for form in FORMS {
        // One alias: each new stream's topic takes it over.
        let mut d = device_with_aliases(addr, D1, 1).await;
        form.subscribe(&mut d).await;
        for rid in ["a1", "a2"] {
            let rid = format!("{rid}-{form:?}");
            d.publish(&d.topic("req"), form.request(&rid).to_string()).await;
            let mut seen = Vec::new();
            let mut r = StreamReader::new(form, &rid);
            loop {
                // The reader checks the (resolved) topic of every message.
                let m = d.msg().await;
                seen.push(m.alias);
                d.pending_front(m);
                let v = r.next(&mut d).await;
                if v["type"] == "done" {
                    break;
                }
            }
            assert_eq!(seen[0], Some((1, false)), "{form:?}: the topic with the alias");
            assert!(seen[1..].iter().all(|a| *a == Some((1, true))), "{form:?}: then the alias alone: {seen:?}");
        }
        d.disconnect_and_wait().await;
        // A device that allows none gets whole topics.
        for v in [V::V5, V::V4] {
            let mut d = device(addr, v, D2).await;
            form.subscribe(&mut d).await;
            let rid = format!("b-{form:?}-{v:?}");
            d.publish(&d.topic("req"), form.request(&rid).to_string()).await;
            let mut r = StreamReader::new(form, &rid);
            loop {
                let m = d.msg().await;
                assert_eq!(m.alias, None);
                d.pending_front(m);
                if r.next(&mut d).await["type"] == "done" {
                    break;
                }
            }
            d.disconnect_and_wait().await;
        }
    }
    gw.stop().await;
}
