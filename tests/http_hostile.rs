//! Hostile HTTP clients against a real gateway on real sockets: half-sent
//! requests (slowloris), connection floods over the cap, idle connections,
//! and the streams those limits must not cut.

mod common;

use std::time::{Duration, Instant};

use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A gateway whose `[http]` section also has `keys`.
async fn gateway(engine: &FakeEngine, keys: &str) -> TestGateway {
    TestGateway::with_engine_edit(&engine.url(), "openai", "", |t| {
        t.replacen("[http]\n", &format!("[http]\n{keys}\n"), 1)
    })
    .await
}

fn addr(gw: &TestGateway) -> String {
    gw.base_url.trim_start_matches("http://").to_string()
}

/// The value of a metric line (`name{labels}`) on the gateway's page, 0 when
/// absent.
fn metric(gw: &TestGateway, series: &str) -> f64 {
    gw.gateway()
        .render_metrics()
        .lines()
        .find_map(|l| l.strip_prefix(series).and_then(|v| v.strip_prefix(' ')).map(|v| v.parse().unwrap()))
        .unwrap_or(0.0)
}

/// Polls the gateway's own count until `cond` holds (within 10 s).
async fn until(gw: &TestGateway, what: &str, cond: impl Fn(&TestGateway) -> bool) {
    let t = Instant::now();
    while !cond(gw) {
        assert!(t.elapsed() < Duration::from_secs(10), "never: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

const OPEN: &str = "edgeway_http_connections_open{listener=\"main\"}";

/// Reads until the server closes the connection (within `limit`); returns
/// what it sent. Panics if it is still open then.
async fn read_until_closed(s: &mut TcpStream, limit: Duration) -> Vec<u8> {
    let mut got = Vec::new();
    let r = tokio::time::timeout(limit, async {
        let mut buf = [0u8; 4096];
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    assert!(r.is_ok(), "the connection was still open after {limit:?}; it sent {:?}", String::from_utf8_lossy(&got));
    got
}

#[tokio::test]
async fn half_sent_requests_are_closed_after_the_header_timeout() {
    let engine = FakeEngine::start().await;
    let gw = gateway(&engine, "header_read_timeout_ms = 500").await;
    let mut socks = Vec::new();
    for i in 0..60 {
        let mut s = TcpStream::connect(addr(&gw)).await.unwrap();
        // Three kinds: part of a request head, nothing at all, and the
        // HTTP/2 preface without any request.
        match i % 3 {
            0 => s.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: app").await.unwrap(),
            1 => {}
            _ => s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00").await.unwrap(),
        }
        socks.push(s);
    }
    let t = Instant::now();
    for s in &mut socks {
        let got = read_until_closed(s, Duration::from_secs(5)).await;
        assert!(!got.starts_with(b"HTTP/1.1 2"), "{}", String::from_utf8_lossy(&got));
    }
    assert!(t.elapsed() >= Duration::from_millis(300), "closed before the timeout: {:?}", t.elapsed());
    assert_eq!(metric(&gw, "edgeway_http_connections_closed_total{listener=\"main\",reason=\"header_timeout\"}"), 60.0);
    // A client that sends its request in time is served.
    let r = client().get(format!("{}/health", gw.base_url)).send().await.unwrap();
    assert_eq!(r.status(), 200);
    gw.stop().await;
}

#[tokio::test]
async fn a_kept_alive_connection_is_closed_once_idle() {
    // The two timeouts differ, so the reason tells which one closed it.
    // HTTP/1.1 between requests: the header timeout (the wait for the next
    // head).
    let engine = FakeEngine::start().await;
    let gw = gateway(&engine, "header_read_timeout_ms = 300\nidle_timeout_ms = 60000").await;
    let mut s = TcpStream::connect(addr(&gw)).await.unwrap();
    s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
    let got = read_until_closed(&mut s, Duration::from_secs(5)).await;
    assert!(got.starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&got));
    until(&gw, "closed by the header timeout", |gw| {
        metric(gw, "edgeway_http_connections_closed_total{listener=\"main\",reason=\"header_timeout\"}") == 1.0
    })
    .await;
    assert_eq!(metric(&gw, "edgeway_http_connections_closed_total{listener=\"main\",reason=\"idle\"}"), 0.0);
    gw.stop().await;
    // HTTP/2 has no header timeout after the first request: the idle one.
    let gw = gateway(&engine, "header_read_timeout_ms = 60000\nidle_timeout_ms = 300").await;
    let held = ping_until_closed(&gw, Duration::from_secs(10), Duration::from_secs(5)).await;
    assert!(held >= Duration::from_millis(200), "closed after {held:?}");
    until(&gw, "closed as idle", |gw| {
        metric(gw, "edgeway_http_connections_closed_total{listener=\"main\",reason=\"idle\"}") == 1.0
    })
    .await;
    assert_eq!(metric(&gw, "edgeway_http_connections_closed_total{listener=\"main\",reason=\"header_timeout\"}"), 0.0);
    gw.stop().await;
}

#[tokio::test]
async fn at_the_cap_a_new_connection_is_refused_at_once_and_served_once_a_slot_frees() {
    let engine = FakeEngine::start().await;
    let gw = gateway(&engine, "max_connections = 3\nheader_read_timeout_ms = 60000").await;
    let mut holders = Vec::new();
    for _ in 0..3 {
        let mut s = TcpStream::connect(addr(&gw)).await.unwrap();
        s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n").await.unwrap();
        holders.push(s);
    }
    until(&gw, "three connections open", |gw| metric(gw, OPEN) == 3.0).await;

    let t = Instant::now();
    let mut s = TcpStream::connect(addr(&gw)).await.unwrap();
    s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
    let got = String::from_utf8_lossy(&read_until_closed(&mut s, Duration::from_secs(5)).await).to_string();
    assert!(got.starts_with("HTTP/1.1 503"), "{got}");
    assert!(got.contains("RESOURCE_EXHAUSTED") && got.to_lowercase().contains("retry-after: 1"), "{got}");
    // An HTTP client sees the same, promptly.
    let r = client().get(format!("{}/health", gw.base_url)).send().await.unwrap();
    assert_eq!(r.status(), 503);
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(error_code(&body), "RESOURCE_EXHAUSTED");
    assert!(t.elapsed() < Duration::from_secs(2), "refusals took {:?}", t.elapsed());
    assert_eq!(metric(&gw, "edgeway_http_connections_refused_total{listener=\"main\"}"), 2.0);

    drop(holders);
    until(&gw, "the slots freed", |gw| metric(gw, OPEN) == 0.0).await;
    let r = client().get(format!("{}/health", gw.base_url)).send().await.unwrap();
    assert_eq!(r.status(), 200);
    gw.stop().await;
}

#[tokio::test]
async fn a_stream_longer_than_the_idle_timeout_is_not_cut() {
    // Silent for longer than the idle timeout before the first token, then
    // tokens for longer again.
    let engine =
        FakeEngine::start_with(Knobs { first_token_delay: Duration::from_millis(900), ..Knobs::slow(12, 100) }).await;
    let gw = gateway(&engine, "header_read_timeout_ms = 300\nidle_timeout_ms = 300").await;
    gw.wait_ready().await;
    let t = Instant::now();
    let resp = post_chat(&gw, DEMO_KEY, &chat_body(true)).await;
    assert_eq!(resp.status(), 200);
    let (events, done) = read_sse(resp).await;
    assert!(t.elapsed() > Duration::from_millis(1500), "{:?}", t.elapsed());
    assert!(done, "the stream was cut: {events:?}");
    let text: String =
        events.iter().filter_map(|e| e["choices"][0]["delta"]["content"].as_str()).collect::<Vec<_>>().join("");
    assert!(!text.is_empty());
    assert_eq!(
        events.iter().filter(|e| e["choices"][0]["delta"]["content"].as_str().is_some_and(|c| !c.is_empty())).count(),
        12
    );
    // And a non-streamed answer that is silent for as long.
    let resp = post_chat(&gw, DEMO_KEY, &chat_body(false)).await;
    assert_eq!(resp.status(), 200);
    gw.stop().await;
}

#[tokio::test]
async fn shutdown_closes_idle_and_half_sent_connections_without_waiting_for_their_timeouts() {
    let engine = FakeEngine::start().await;
    let gw = gateway(&engine, "header_read_timeout_ms = 60000\nidle_timeout_ms = 60000").await;
    let mut idle = TcpStream::connect(addr(&gw)).await.unwrap();
    idle.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
    let mut buf = [0u8; 1024];
    let n = idle.read(&mut buf).await.unwrap();
    assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
    let mut half = TcpStream::connect(addr(&gw)).await.unwrap();
    half.write_all(b"GET /health HTTP/1.1\r\n").await.unwrap();
    until(&gw, "two connections open", |gw| metric(gw, OPEN) == 2.0).await;
    let t = Instant::now();
    gw.stop().await;
    assert!(t.elapsed() < Duration::from_secs(3), "shutdown took {:?}", t.elapsed());
    read_until_closed(&mut idle, Duration::from_secs(1)).await;
    read_until_closed(&mut half, Duration::from_secs(1)).await;
}

#[tokio::test]
async fn a_request_body_that_stops_arriving_is_cut_after_the_idle_timeout() {
    let engine = FakeEngine::start().await;
    let gw = gateway(&engine, "header_read_timeout_ms = 400\nidle_timeout_ms = 400").await;
    let mut s = TcpStream::connect(addr(&gw)).await.unwrap();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {DEMO_KEY}\r\n\
         Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{{\"model\": \"general-"
    );
    s.write_all(head.as_bytes()).await.unwrap();
    let got = read_until_closed(&mut s, Duration::from_secs(5)).await;
    assert!(!got.starts_with(b"HTTP/1.1 2"), "{}", String::from_utf8_lossy(&got));
    assert_eq!(metric(&gw, "edgeway_http_connections_closed_total{listener=\"main\",reason=\"body_timeout\"}"), 1.0);
    gw.stop().await;
}

#[tokio::test]
async fn a_client_that_stops_reading_its_stream_is_cut_after_the_idle_timeout() {
    // Up to 100 MB of answer, 10 MB/s: the socket buffers fill within a
    // second or so, and the engine is still generating (for about 10 s) when
    // the connection is cut. (All at once, a fast machine's engine could
    // finish before the cut, and then there is nothing left to abort.)
    let engine = FakeEngine::start_with(Knobs {
        tokens: 1000,
        token_text: "x".repeat(100_000),
        token_delay: Duration::from_millis(10),
        ..Knobs::default()
    })
    .await;
    let gw = gateway(&engine, "header_read_timeout_ms = 400\nidle_timeout_ms = 400").await;
    gw.wait_ready().await;
    let mut s = TcpStream::connect(addr(&gw)).await.unwrap();
    let body = chat_body(true).to_string();
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {DEMO_KEY}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    // Never read: the answer backs up until edgeway's writes block.
    let reason = "edgeway_http_connections_closed_total{listener=\"main\",reason=\"write_timeout\"}";
    until(&gw, "the connection cut", |gw| metric(gw, reason) == 1.0).await;
    assert_eq!(metric(&gw, OPEN), 0.0);
    // Its task was cancelled: the engine stops generating for nobody.
    let aborted = engine.wait_for(Duration::from_secs(5), |s| s.aborted.load(std::sync::atomic::Ordering::SeqCst) == 1);
    assert!(aborted.await, "the engine still generates");
    drop(s);
    gw.stop().await;
}

#[tokio::test]
async fn http2_without_tls_is_still_served() {
    let engine = FakeEngine::start().await;
    let gw = gateway(&engine, "header_read_timeout_ms = 400\nidle_timeout_ms = 400").await;
    gw.wait_ready().await;
    edgeway::tls::install_default_provider();
    let h2 = reqwest::Client::builder().http2_prior_knowledge().build().unwrap();
    let r = h2.post(format!("{}/v1/chat/completions", gw.base_url)).bearer_auth(DEMO_KEY).json(&chat_body(false));
    let r = r.send().await.unwrap();
    assert_eq!((r.version(), r.status().as_u16()), (reqwest::Version::HTTP_2, 200));
    gw.stop().await;
}

/// An HTTP/2 (h2c) connection that asked one question, then only PINGs
/// every `every`; returns how long the server kept it open (panics after
/// `limit`).
async fn ping_until_closed(gw: &TestGateway, every: Duration, limit: Duration) -> Duration {
    let tcp = TcpStream::connect(addr(gw)).await.unwrap();
    let (mut send, mut conn) = h2::client::handshake(tcp).await.unwrap();
    let mut pings = conn.ping_pong().unwrap();
    let mut conn = tokio::spawn(conn);
    let req = axum::http::Request::get(format!("{}/health", gw.base_url)).body(()).unwrap();
    let (resp, _) = send.send_request(req, true).unwrap();
    let resp = resp.await.unwrap();
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    while let Some(chunk) = body.data().await {
        let chunk = chunk.unwrap();
        body.flow_control().release_capacity(chunk.len()).unwrap();
    }
    let t = Instant::now();
    loop {
        let ponged = tokio::select! {
            _ = &mut conn => break,
            r = tokio::time::timeout(Duration::from_secs(1), pings.ping(h2::Ping::opaque())) => matches!(r, Ok(Ok(_))),
        };
        if !ponged {
            break;
        }
        tokio::select! {
            _ = &mut conn => break,
            _ = tokio::time::sleep(every.min(limit)) => {}
        }
        assert!(t.elapsed() < limit, "an h2 connection sending only PINGs was still open after {limit:?}");
    }
    // `send` is kept to here: dropping it would end the connection from
    // the client's side.
    drop(send);
    t.elapsed()
}

#[tokio::test]
async fn an_http2_connection_sending_only_pings_is_closed_after_the_idle_timeout() {
    let engine = FakeEngine::start().await;
    let gw = gateway(&engine, "header_read_timeout_ms = 60000\nidle_timeout_ms = 400").await;
    gw.wait_ready().await;
    let held = ping_until_closed(&gw, Duration::from_millis(100), Duration::from_secs(5)).await;
    assert!(held < Duration::from_secs(2), "{held:?}");
    until(&gw, "closed as idle", |gw| {
        metric(gw, "edgeway_http_connections_closed_total{listener=\"main\",reason=\"idle\"}") == 1.0
    })
    .await;
    until(&gw, "the slot freed", |gw| metric(gw, OPEN) == 0.0).await;
    gw.stop().await;
}

#[tokio::test]
async fn a_busy_connection_is_closed_at_its_maximum_age() {
    let engine = FakeEngine::start().await;
    let gw = gateway(&engine, "idle_timeout_ms = 60000\nmax_connection_age_ms = 1000").await;
    gw.wait_ready().await;
    // Requests every 100 ms keep it busy: only its age closes it.
    let mut s = TcpStream::connect(addr(&gw)).await.unwrap();
    let t = Instant::now();
    let mut buf = vec![0u8; 4096];
    let closed = loop {
        assert!(t.elapsed() < Duration::from_secs(5), "still open at 5 s");
        if s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n").await.is_err() {
            break t.elapsed();
        }
        match tokio::time::timeout(Duration::from_secs(2), s.read(&mut buf)).await.unwrap() {
            Ok(0) | Err(_) => break t.elapsed(),
            Ok(_) => {}
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(closed >= Duration::from_millis(800), "closed at {closed:?}");
    assert_eq!(metric(&gw, "edgeway_http_connections_closed_total{listener=\"main\",reason=\"max_age\"}"), 1.0);
    gw.stop().await;
}

/// Opens an h2c connection and starts `POST /v1/chat/completions` with
/// `body`; `end` says whether the body is complete.
async fn h2_chat(
    gw: &TestGateway,
    body: &[u8],
    end: bool,
) -> (h2::client::SendRequest<bytes::Bytes>, h2::client::ResponseFuture, h2::SendStream<bytes::Bytes>, h2::PingPong) {
    let tcp = TcpStream::connect(addr(gw)).await.unwrap();
    let (send, mut conn) = h2::client::handshake(tcp).await.unwrap();
    let pings = conn.ping_pong().unwrap();
    tokio::spawn(conn);
    let mut send = send.ready().await.unwrap();
    let req = axum::http::Request::post(format!("{}/v1/chat/completions", gw.base_url))
        .header("authorization", format!("Bearer {DEMO_KEY}"))
        .header("content-type", "application/json")
        .body(())
        .unwrap();
    let (resp, mut stream) = send.send_request(req, false).unwrap();
    stream.send_data(bytes::Bytes::copy_from_slice(body), end).unwrap();
    (send, resp, stream, pings)
}

#[tokio::test]
async fn an_http2_client_that_stops_reading_after_its_task_ended_frees_its_slot() {
    // 500 kB of answer; the client never opens its window past the first
    // 64 kB, so the answer stays queued in edgeway after the task ended.
    let engine = FakeEngine::start_with(Knobs { tokens: 5, token_text: "x".repeat(100_000), ..Knobs::default() }).await;
    let gw = gateway(&engine, "header_read_timeout_ms = 400\nidle_timeout_ms = 400").await;
    gw.wait_ready().await;
    let body = chat_body(true).to_string();
    let (_send, resp, _stream, _pings) = h2_chat(&gw, body.as_bytes(), true).await;
    let resp = resp.await.unwrap();
    assert_eq!(resp.status(), 200);
    // The engine finished: the task is over, its answer unread.
    assert!(
        engine.wait_for(Duration::from_secs(5), |s| s.completed.load(std::sync::atomic::Ordering::SeqCst) == 1).await
    );
    let reason = "edgeway_http_connections_closed_total{listener=\"main\",reason=\"write_timeout\"}";
    until(&gw, "the connection cut", |gw| metric(gw, reason) == 1.0).await;
    assert_eq!(metric(&gw, OPEN), 0.0);
    gw.stop().await;
}

#[tokio::test]
async fn shutdown_during_a_stalled_request_body_does_not_wait_for_the_grace() {
    // Half a request body, then only PINGs: not progress, so the body
    // timeout still cuts it and the stop does not wait the 5 s grace.
    let engine = FakeEngine::start().await;
    let gw = gateway(&engine, "header_read_timeout_ms = 400\nidle_timeout_ms = 400").await;
    gw.wait_ready().await;
    let (_send, _resp, _stream, mut pings) = h2_chat(&gw, b"{\"model\": \"general-", false).await;
    until(&gw, "the request open", |gw| metric(gw, OPEN) == 1.0).await;
    let pinger = tokio::spawn(async move {
        while pings.ping(h2::Ping::opaque()).await.is_ok() {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    let t = Instant::now();
    gw.stop().await;
    assert!(t.elapsed() < Duration::from_secs(3), "the stop took {:?}", t.elapsed());
    pinger.abort();
}
