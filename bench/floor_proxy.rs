//! The floor under edgeway's HTTP overhead: the least a proxy built on
//! edgeway's own stack does for one non-streaming chat completion, and
//! nothing else. axum in, the API key looked up, the body parsed into a
//! typed request, forwarded with reqwest to the engine, the engine's
//! answer parsed and the OpenAI response encoded again; mimalloc and a
//! multi-threaded tokio runtime as in `src/main.rs`. No store, no
//! scheduler, no admission, no metrics, no log lines.
//!
//! It takes edgeway's command line (`serve --config PATH`) and reads the
//! `listen` address, the first engine's `base_url` and `model` from that
//! config, so `bench/overhead.rs` measures it as it measures edgeway:
//!
//! ```text
//! cargo bench --bench floor_proxy --no-run   # prints the binary's path
//! overhead --rates 2000 --seconds 30 --no-build --edgeway-bin <that path>
//! ```
//!
//! Only `POST /v1/chat/completions` (non-streaming) and `GET /ready` are
//! served: the overhead bench's non-stream phases are what it is for.
//! With `FLOOR_STREAM=1` in its environment it asks the engine for a
//! stream, as edgeway does for every call (so that a client going away
//! stops the engine), and gathers the deltas' text into the answer.

use std::sync::Arc;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use serde_json::Value;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

struct Floor {
    client: reqwest::Client,
    url: String,
    model: String,
    key_sha256: Vec<String>,
    stream: bool,
}

#[derive(Deserialize, Serialize)]
struct Message {
    role: String,
    content: String,
}

#[derive(Deserialize)]
struct ChatRequest {
    model: String,
    messages: Vec<Message>,
    #[serde(default)]
    max_tokens: Option<u32>,
    #[serde(default)]
    stream: bool,
}

#[derive(Serialize)]
struct EngineRequest<'a> {
    model: &'a str,
    messages: &'a [Message],
    #[serde(skip_serializing_if = "Option::is_none")]
    max_tokens: Option<u32>,
    stream: bool,
}

#[derive(Deserialize)]
struct EngineResponse {
    #[serde(default)]
    choices: Vec<EngineChoice>,
    #[serde(default)]
    usage: Option<Value>,
}

#[derive(Deserialize)]
struct EngineChoice {
    message: Message,
    #[serde(default)]
    finish_reason: Option<String>,
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let cfg_path = match args.iter().position(|a| a == "--config") {
        Some(i) if args.get(1).map(String::as_str) == Some("serve") => args.get(i + 1).expect("a path after --config"),
        _ => {
            eprintln!("usage: floor_proxy serve --config PATH (a proxy for bench/overhead.rs to measure)");
            // `cargo bench` runs every bench with `--bench`: nothing to do.
            std::process::exit(if args.iter().any(|a| a == "--bench") { 0 } else { 2 });
        }
    };
    let text = std::fs::read_to_string(cfg_path).expect("config readable");
    let cfg: toml::Value = toml::from_str(&text).expect("config is TOML");
    let listen = cfg["http"]["listen"].as_str().expect("http.listen").to_string();
    let engine = cfg["engines"].as_table().and_then(|t| t.values().next()).expect("an engine");
    let base = engine["base_url"].as_str().expect("engines.*.base_url").trim_end_matches('/');
    let model = engine["model"].as_str().expect("engines.*.model").to_string();
    let key_sha256 = cfg["applications"]
        .as_table()
        .into_iter()
        .flat_map(|apps| apps.values())
        .filter_map(|app| app.get("api_key_sha256").and_then(|k| k.as_array()))
        .flatten()
        .filter_map(|k| k.as_str().map(str::to_string))
        .collect();
    edgeway::tls::install_default_provider();
    let floor = Arc::new(Floor {
        client: reqwest::Client::builder().tcp_nodelay(true).build().expect("client"),
        url: format!("{base}/v1/chat/completions"),
        model,
        key_sha256,
        stream: std::env::var_os("FLOOR_STREAM").is_some_and(|v| v == "1"),
    });
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("tokio runtime");
    rt.block_on(async move {
        let app = Router::new()
            .route("/ready", get(|| async { "ready" }))
            .route("/v1/chat/completions", post(chat))
            .with_state(floor);
        let listener = tokio::net::TcpListener::bind(&listen).await.expect("bind");
        axum::serve(listener, app).await.expect("serve");
    });
}

async fn chat(State(f): State<Arc<Floor>>, headers: HeaderMap, Json(req): Json<ChatRequest>) -> Response {
    let key = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or_default();
    let hashed = hex::encode(edgeway::config::hash_api_key(key));
    if !f.key_sha256.contains(&hashed) {
        return (StatusCode::UNAUTHORIZED, "bad key").into_response();
    }
    if req.stream {
        return (StatusCode::BAD_REQUEST, "the floor proxy does not stream").into_response();
    }
    let body = EngineRequest { model: &f.model, messages: &req.messages, max_tokens: req.max_tokens, stream: f.stream };
    let sent = match f.client.post(&f.url).json(&body).send().await {
        Ok(r) => r,
        Err(e) => return (StatusCode::BAD_GATEWAY, e.to_string()).into_response(),
    };
    let answer = if f.stream { gather(sent).await } else { sent.json::<EngineResponse>().await };
    let answer = match answer {
        Ok(a) => a,
        Err(e) => return (StatusCode::BAD_GATEWAY, e.to_string()).into_response(),
    };
    let choices: Vec<Value> = answer
        .choices
        .into_iter()
        .enumerate()
        .map(|(i, c)| serde_json::json!({ "index": i, "message": c.message, "finish_reason": c.finish_reason }))
        .collect();
    Json(serde_json::json!({
        "id": "chatcmpl-floor",
        "object": "chat.completion",
        "model": req.model,
        "choices": choices,
        "usage": answer.usage,
    }))
    .into_response()
}

#[derive(Deserialize)]
struct Chunk {
    #[serde(default)]
    choices: Vec<ChunkChoice>,
    #[serde(default)]
    usage: Option<Value>,
}

#[derive(Deserialize)]
struct ChunkChoice {
    #[serde(default)]
    delta: Delta,
    #[serde(default)]
    finish_reason: Option<String>,
}

#[derive(Deserialize, Default)]
struct Delta {
    #[serde(default)]
    content: Option<String>,
}

/// Reads the engine's server-sent events as they come, one chunk at a
/// time, and gathers the deltas into one answer.
async fn gather(mut r: reqwest::Response) -> reqwest::Result<EngineResponse> {
    let (mut text, mut finish_reason, mut usage) = (String::new(), None, None);
    let mut buf = Vec::new();
    while let Some(bytes) = r.chunk().await? {
        buf.extend_from_slice(&bytes);
        while let Some(nl) = buf.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = buf.drain(..=nl).collect();
            let Some(data) = line.strip_prefix(b"data: ") else { continue };
            if let Ok(c) = serde_json::from_slice::<Chunk>(data) {
                for ch in c.choices {
                    text.push_str(ch.delta.content.as_deref().unwrap_or_default());
                    finish_reason = ch.finish_reason.or(finish_reason);
                }
                usage = c.usage.or(usage);
            }
        }
    }
    let message = Message { role: "assistant".into(), content: text };
    Ok(EngineResponse { choices: vec![EngineChoice { message, finish_reason }], usage })
}
