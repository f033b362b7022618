//! Helpers shared by the integration tests: an HTTP client, SSE parsing and
//! reading the task store file (its rows, and its bytes).
#![allow(dead_code, unused_imports)]

use std::time::Duration;

use futures::StreamExt;
use serde_json::{json, Value};

pub use edgeway::task::TaskState;
pub use edgeway::telemetry::lifecycle::LifecycleEvent;
pub use edgeway::testing::{FakeEngine, Knobs, TestGateway, DEMO_KEY, OPS_KEY};

pub fn client() -> reqwest::Client {
    edgeway::tls::install_default_provider();
    reqwest::Client::builder().timeout(Duration::from_secs(30)).build().unwrap()
}

pub fn chat_body(stream: bool) -> Value {
    json!({
        "model": "general-chat",
        "messages": [{"role": "user", "content": "Say hello"}],
        "stream": stream,
    })
}

pub async fn post_chat(gw: &TestGateway, key: &str, body: &Value) -> reqwest::Response {
    client().post(format!("{}/v1/chat/completions", gw.base_url)).bearer_auth(key).json(body).send().await.unwrap()
}

/// `GET {base_url}{path}` with `key`, the answer's JSON (whatever its
/// status: the tests assert on the body).
pub async fn get_json(gw: &TestGateway, key: &str, path: &str) -> Value {
    client().get(format!("{}{path}", gw.base_url)).bearer_auth(key).send().await.unwrap().json().await.unwrap()
}

/// Reads an SSE body to its end; returns the JSON of every `data:` line
/// and whether `[DONE]` was seen.
pub async fn read_sse(resp: reqwest::Response) -> (Vec<Value>, bool) {
    let mut events = Vec::new();
    let mut done = false;
    let mut buf = String::new();
    let mut body = resp.bytes_stream();
    while let Some(chunk) = body.next().await {
        buf.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
        while let Some(pos) = buf.find("\n\n") {
            let frame: String = buf.drain(..pos + 2).collect();
            for line in frame.lines() {
                if let Some(data) = line.strip_prefix("data: ") {
                    if data == "[DONE]" {
                        done = true;
                    } else {
                        events.push(serde_json::from_str(data).unwrap());
                    }
                }
            }
        }
    }
    (events, done)
}

/// The states a task went through, from the SQLite file.
pub async fn stored_states(gw: &TestGateway, task_id: &str) -> Vec<String> {
    gw.store().flush().await;
    let conn = rusqlite::Connection::open(gw.db_path()).unwrap();
    let mut stmt = conn.prepare("SELECT state FROM task_transitions WHERE task_id = ?1 ORDER BY seq").unwrap();
    stmt.query_map([task_id], |r| r.get::<_, String>(0)).unwrap().map(Result::unwrap).collect()
}

/// The next lifecycle event that `pred` selects (within 30 s). Subscribe
/// (`gw.recorder().subscribe()`) before causing it.
pub async fn next_event(
    rx: &mut tokio::sync::broadcast::Receiver<std::sync::Arc<LifecycleEvent>>,
    what: &str,
    pred: impl Fn(&LifecycleEvent) -> bool,
) -> std::sync::Arc<LifecycleEvent> {
    let wait = async {
        loop {
            match rx.recv().await {
                Ok(ev) if pred(&ev) => return ev,
                Ok(_) => {}
                Err(e) => panic!("waiting for {what}: {e}"),
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(30), wait).await.unwrap_or_else(|_| panic!("never saw: {what}"))
}

pub fn error_code(v: &Value) -> &str {
    v["error"]["code"].as_str().unwrap_or("<none>")
}

/// The task store's database file and its WAL, as bytes: what a reader of
/// the disk finds (the retention tests look for text in them).
pub fn file_bytes(db: &std::path::Path) -> Vec<u8> {
    let mut out = Vec::new();
    for ext in ["", "-wal"] {
        if let Ok(b) = std::fs::read(format!("{}{ext}", db.display())) {
            out.extend(b);
        }
    }
    out
}

/// Whether `needle`'s bytes occur in `hay`.
pub fn contains(hay: &[u8], needle: &str) -> bool {
    hay.windows(needle.len()).any(|w| w == needle.as_bytes())
}
