//! A fake inference server speaking both wire protocols edgeway uses
//! (OpenAI-compatible SSE and Ollama NDJSON), with knobs for latency,
//! failures and mid-stream drops, and counters that show whether a client
//! really went away (what llama.cpp's `/slots` shows for the real engine).
//! It reports its own state like the real engines: a Prometheus `/metrics`
//! page (vLLM's KV-cache gauge, see [`vllm_metrics`]) and Ollama's
//! `/api/ps` (models in memory).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// Behaviour of the fake, changeable while it runs.
#[derive(Debug, Clone)]
pub struct Knobs {
    /// Tokens generated per answer (capped by the request's max tokens).
    pub tokens: u32,
    pub token_text: String,
    /// Delay before the response headers (engine busy accepting).
    pub accept_delay: Duration,
    pub first_token_delay: Duration,
    pub token_delay: Duration,
    /// Answer every generation request with this HTTP status.
    pub fail_status: Option<u16>,
    /// The error message of a failed answer (`fail_status`, `fail_next`).
    pub fail_message: String,
    /// Answer the next this many generation requests with HTTP 500, then
    /// behave as the other knobs say (an engine that recovers).
    pub fail_next: u32,
    /// Abort the connection after this many tokens.
    pub drop_after: Option<u32>,
    /// Never report usage.
    pub omit_usage: bool,
    /// What health endpoints answer.
    pub healthy: bool,
    /// Keep generating after the client went away (an engine that does
    /// not notice disconnects).
    pub ignore_disconnect: bool,
    /// The `/metrics` page (Prometheus text); `None` answers 404, like an
    /// engine without one.
    pub metrics: Option<String>,
    /// Whether Ollama's `/api/ps` lists the model as loaded.
    pub resident: bool,
    /// The `finish_reason` of a whole answer, instead of `stop`/`length`
    /// (an engine that says something odd).
    pub finish_reason: Option<String>,
    /// Calls `(name, arguments JSON text)` the fake makes instead of
    /// writing text, when the request declares `tools`. OpenAI-style, the
    /// arguments stream in pieces of [`TOOL_ARGS_PIECE`] bytes, one piece
    /// per token; Ollama-style, each call comes whole.
    pub tool_calls: Vec<(String, String)>,
    /// Length of the vectors of `/v1/embeddings` and `/api/embed`.
    pub embedding_dim: usize,
    /// Answer the generation or embedding requests with these ordinals
    /// (1: the first this fake saw) with HTTP 500: a failure in the middle
    /// of a series of calls.
    pub fail_requests: Vec<u64>,
    /// Answer the generation requests whose body (as JSON text) contains
    /// `.0` with HTTP status `.1`: one kind of call failing beside others.
    pub fail_matching: Option<(String, u16)>,
    /// llama-server router mode (with `--no-models-autoload`): the models
    /// of its models dir, all unloaded at start, listed by `GET /models`,
    /// loaded by `POST /models/load` (in the background, `load_delay`
    /// long) and unloaded by `POST /models/unload`; a generation for a
    /// model that is not loaded gets 400 "model is not loaded". Empty: not
    /// router mode.
    pub router_models: Vec<String>,
    pub load_delay: Duration,
    /// An unload answers at once and the model stays `loaded` this long
    /// (llama-server stops the model's process in the background).
    pub unload_delay: Duration,
    /// `--models-max`: loading one more unloads the least recently used
    /// (0: no limit).
    pub models_max: usize,
    /// Loads fail (the model's process exits: `unloaded`, `failed`).
    pub load_fails: bool,
    /// llama-server's `/tokenize` and `/apply-template` answer with this
    /// HTTP status instead (a tokenizer that fails).
    pub tokenize_status: Option<u16>,
    /// Delay before `/tokenize` and `/apply-template` answer.
    pub tokenize_delay: Duration,
    /// OpenAI chat: each token is the text of the request's last message
    /// and a space, instead of `token_text` (an answer that carries what
    /// was asked: tests look for one caller's bytes in another's answers).
    pub echo: bool,
    /// Keep every request's body, POST path and `traceparent` in [`Stats`]
    /// (tests read them back). A benchmark's long run turns it off: kept,
    /// they were most of the 3 GiB `bench/overhead --soak` grew by over
    /// ten minutes at 2000 req/s.
    pub record: bool,
}

/// Bytes of a tool call's arguments per streamed piece.
pub const TOOL_ARGS_PIECE: usize = 5;

impl Knobs {
    /// `tokens` per answer, one every `delay_ms` milliseconds.
    pub fn slow(tokens: u32, delay_ms: u64) -> Knobs {
        Knobs { tokens, token_delay: Duration::from_millis(delay_ms), ..Knobs::default() }
    }
}

impl Default for Knobs {
    fn default() -> Self {
        Knobs {
            tokens: 5,
            token_text: "tok ".into(),
            accept_delay: Duration::ZERO,
            first_token_delay: Duration::ZERO,
            token_delay: Duration::ZERO,
            fail_status: None,
            fail_message: "fake engine failure: secret internal detail".into(),
            fail_next: 0,
            drop_after: None,
            omit_usage: false,
            healthy: true,
            ignore_disconnect: false,
            metrics: None,
            resident: true,
            finish_reason: None,
            tool_calls: Vec::new(),
            embedding_dim: 8,
            fail_requests: Vec::new(),
            fail_matching: None,
            router_models: Vec::new(),
            load_delay: Duration::ZERO,
            unload_delay: Duration::ZERO,
            models_max: 0,
            load_fails: false,
            tokenize_status: None,
            tokenize_delay: Duration::ZERO,
            echo: false,
            record: true,
        }
    }
}

/// What the fake saw.
#[derive(Default)]
pub struct Stats {
    pub requests: AtomicU64,
    /// Generations in progress (a slot busy, in llama.cpp terms).
    pub active: AtomicI64,
    pub completed: AtomicU64,
    /// Generations whose client went away before the end.
    pub aborted: AtomicU64,
    pub last_request: Mutex<Option<Value>>,
    /// Every generation or embedding request body, in order.
    pub bodies: Mutex<Vec<Value>>,
    /// Requests for `/metrics`.
    pub metrics_requests: AtomicU64,
    /// The path of every POST, in order (which endpoint an adapter used).
    pub posts: Mutex<Vec<String>>,
    /// The `traceparent` header of every POST (`None` when it had none),
    /// in the order of `posts`.
    pub traceparents: Mutex<Vec<Option<String>>>,
    /// Router mode: "load NAME" (when a load completes), "unload NAME"
    /// (by request), "evict NAME" (by `models_max`), in order.
    pub model_events: Mutex<Vec<String>>,
    /// The `content` of every `/tokenize` request, in order.
    pub tokenized: Mutex<Vec<String>>,
    changed: Notify,
}

struct Shared {
    knobs: Mutex<Knobs>,
    stats: Arc<Stats>,
    /// Router mode: each model's status and when it was last used.
    models: Mutex<std::collections::HashMap<String, (&'static str, bool, std::time::Instant)>>,
}

pub struct FakeEngine {
    pub addr: SocketAddr,
    pub stats: Arc<Stats>,
    shared: Arc<Shared>,
    shutdown: CancellationToken,
    /// The server task, awaited by [`FakeEngine::stop`].
    server: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl FakeEngine {
    pub async fn start() -> FakeEngine {
        Self::start_with(Knobs::default()).await
    }

    pub async fn start_with(knobs: Knobs) -> FakeEngine {
        let stats = Arc::new(Stats::default());
        let shared = Arc::new(Shared { knobs: Mutex::new(knobs), stats: stats.clone(), models: Mutex::default() });
        let app = Router::new()
            .route("/v1/chat/completions", post(openai_chat))
            .route("/v1/completions", post(openai_completion))
            .route("/v1/embeddings", post(openai_embeddings))
            .route("/api/generate", post(ollama_generate))
            .route("/api/embed", post(ollama_embed))
            .route("/v1/models", get(openai_models))
            .route("/health", get(health))
            .route("/slots", get(slots))
            .route("/api/chat", post(ollama_chat))
            .route("/api/tags", get(ollama_tags))
            .route("/api/ps", get(ollama_ps))
            .route("/metrics", get(metrics))
            .route("/models", get(router_list))
            .route("/models/load", post(router_load))
            .route("/models/unload", post(router_unload))
            .route("/tokenize", post(tokenize))
            .route("/apply-template", post(apply_template))
            .layer(axum::middleware::from_fn_with_state(shared.clone(), record_post))
            .with_state(shared.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind fake engine");
        let addr = listener.local_addr().expect("local addr");
        let shutdown = CancellationToken::new();
        let sd = shutdown.clone();
        // Like llama-server (cpp-httplib built with CPPHTTPLIB_TCP_NODELAY),
        // vLLM (uvicorn) and Ollama (Go): small SSE writes go out at once
        // instead of waiting for the client's delayed ACK (Nagle, ~40 ms).
        let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
            let _ = tcp.set_nodelay(true);
        });
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, app).with_graceful_shutdown(sd.cancelled_owned()).await;
        });
        FakeEngine { addr, stats, shared, shutdown, server: Mutex::new(Some(server)) }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn set(&self, f: impl FnOnce(&mut Knobs)) {
        f(&mut self.shared.knobs.lock().expect("knobs"));
    }

    /// Stops listening and closes its connections, waiting until it has:
    /// from then on a connection to its address is refused (an engine
    /// process that died while the gateway still thinks it is up).
    pub async fn stop(&self) {
        self.shutdown.cancel();
        let server = self.server.lock().expect("server").take();
        if let Some(server) = server {
            // Graceful: idle keep-alive connections are closed; a generation
            // in progress would hold it, so do not wait for ever.
            let _ = tokio::time::timeout(Duration::from_secs(5), server).await;
        }
    }

    /// Router mode: the status of model `name` (`loaded`, `loading`,
    /// `unloaded`), as `GET /models` shows it.
    pub fn model_status(&self, name: &str) -> &'static str {
        router_status(&self.shared, name).0
    }

    /// Router mode: the load, unload and eviction events so far.
    pub fn model_events(&self) -> Vec<String> {
        self.stats.model_events.lock().expect("events").clone()
    }

    /// Generation requests received so far.
    pub fn requests(&self) -> u64 {
        self.stats.requests.load(Ordering::SeqCst)
    }

    pub fn active(&self) -> i64 {
        self.stats.active.load(Ordering::SeqCst)
    }

    /// Waits until `cond` holds on the stats (checked at every change), or
    /// `limit` passes. Returns whether it held.
    pub async fn wait_for(&self, limit: Duration, cond: impl Fn(&Stats) -> bool) -> bool {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let notified = self.stats.changed.notified();
            if cond(&self.stats) {
                return true;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return cond(&self.stats);
            }
        }
    }
}

impl Drop for FakeEngine {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// Counts a generation as active until dropped; a drop before `complete`
/// counts as an abort.
struct Generation {
    stats: Arc<Stats>,
    done: bool,
}

impl Generation {
    fn start(stats: &Arc<Stats>) -> Generation {
        stats.active.fetch_add(1, Ordering::SeqCst);
        stats.changed.notify_waiters();
        Generation { stats: stats.clone(), done: false }
    }

    fn complete(&mut self) {
        self.done = true;
    }
}

impl Drop for Generation {
    fn drop(&mut self) {
        if self.done {
            self.stats.completed.fetch_add(1, Ordering::SeqCst);
        } else {
            self.stats.aborted.fetch_add(1, Ordering::SeqCst);
        }
        self.stats.active.fetch_sub(1, Ordering::SeqCst);
        self.stats.changed.notify_waiters();
    }
}

async fn begin(s: &Shared, body: &Value) -> Result<Knobs, Response> {
    let router_mode = !s.knobs.lock().expect("knobs").router_models.is_empty();
    if router_mode {
        let name = body["model"].as_str().unwrap_or_default();
        let mut models = s.models.lock().expect("models");
        match models.get_mut(name) {
            Some(m) if m.0 == "loaded" => m.2 = std::time::Instant::now(),
            Some(m) if m.0 == "loading" => {
                let e = json!({"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}});
                return Err((StatusCode::SERVICE_UNAVAILABLE, Json(e)).into_response());
            }
            _ => {
                let e =
                    json!({"error": {"code": 400, "message": "model is not loaded", "type": "invalid_request_error"}});
                return Err((StatusCode::BAD_REQUEST, Json(e)).into_response());
            }
        }
    }
    let ordinal = s.stats.requests.fetch_add(1, Ordering::SeqCst) + 1;
    *s.stats.last_request.lock().expect("last") = Some(body.clone());
    let (k, fail_now) = {
        let mut knobs = s.knobs.lock().expect("knobs");
        let fail_now = knobs.fail_next > 0 || knobs.fail_requests.contains(&ordinal);
        knobs.fail_next = knobs.fail_next.saturating_sub(1);
        (knobs.clone(), fail_now)
    };
    if k.record {
        s.stats.bodies.lock().expect("bodies").push(body.clone());
    }
    if !k.accept_delay.is_zero() {
        tokio::time::sleep(k.accept_delay).await;
    }
    let matching = k.fail_matching.as_ref().filter(|(text, _)| body.to_string().contains(text.as_str())).map(|m| m.1);
    if let Some(code) = if fail_now { Some(500) } else { matching.or(k.fail_status) } {
        let status = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        return Err((status, Json(json!({"error": {"message": k.fail_message}}))).into_response());
    }
    Ok(k)
}

fn token_count(k: &Knobs, max: Option<u64>) -> u32 {
    max.map(|m| (m as u32).min(k.tokens)).unwrap_or(k.tokens)
}

fn prompt_tokens(body: &Value) -> u32 {
    body["messages"].as_array().map(|m| m.len() as u32 * 4 + 3).unwrap_or(0)
}

type Frame = Result<Bytes, std::io::Error>;

/// Streams `n` tokens framed by `frame`, honouring delays and drops.
fn generate(
    k: Knobs,
    n: u32,
    stats: Arc<Stats>,
    mut frame: impl FnMut(Option<u32>) -> Vec<Bytes> + Send + 'static,
) -> Body {
    let (tx, rx) = tokio::sync::mpsc::channel::<Frame>(4);
    tokio::spawn(async move {
        let mut g = Generation::start(&stats);
        // A client that goes away while the engine is still before its
        // first token stops the generation too (a preempted request).
        tokio::select! {
            _ = tokio::time::sleep(k.first_token_delay) => {}
            _ = tx.closed(), if !k.ignore_disconnect => return,
        }
        for i in 0..n {
            if i > 0 && !k.token_delay.is_zero() {
                tokio::time::sleep(k.token_delay).await;
            }
            if k.drop_after == Some(i) {
                let _ = tx.send(Err(std::io::Error::other("fake mid-stream drop"))).await;
                return;
            }
            for b in frame(Some(i)) {
                // A failed send means the client is gone: stop generating
                // (unless told to behave like an engine that does not).
                if tx.send(Ok(b)).await.is_err() && !k.ignore_disconnect {
                    return;
                }
            }
        }
        for b in frame(None) {
            if tx.send(Ok(b)).await.is_err() {
                return;
            }
        }
        g.complete();
        drop(g);
    });
    // hyper discards body bytes it has buffered but not yet written when the
    // body fails. One `Pending` before the failure makes it flush them, so
    // the client really receives the tokens sent before a `drop_after`.
    let frames = futures::StreamExt::then(tokio_stream::wrappers::ReceiverStream::new(rx), |f: Frame| async move {
        if f.is_err() {
            tokio::task::yield_now().await;
        }
        f
    });
    Body::from_stream(frames)
}

/// The streamed pieces of the calls, OpenAI-style: per call a first piece
/// with id, type, name and empty arguments, then the arguments split.
fn tool_call_pieces(calls: &[(String, String)]) -> Vec<Value> {
    let mut out = Vec::new();
    for (i, (name, args)) in calls.iter().enumerate() {
        out.push(json!({"index": i, "id": format!("call_fake_{i}"), "type": "function", "function": {"name": name, "arguments": ""}}));
        let chars: Vec<char> = args.chars().collect();
        for piece in chars.chunks(TOOL_ARGS_PIECE) {
            out.push(json!({"index": i, "function": {"arguments": piece.iter().collect::<String>()}}));
        }
    }
    out
}

/// The fake's tool-call answer (OpenAI form), when the knobs and the
/// request ask for one.
async fn openai_tool_calls(s: &Shared, k: Knobs, body: &Value) -> Response {
    let model = body["model"].as_str().unwrap_or("fake").to_string();
    let pt = prompt_tokens(body);
    let pieces = tool_call_pieces(&k.tool_calls);
    let n = pieces.len() as u32;
    let usage = json!({"prompt_tokens": pt, "completion_tokens": n, "total_tokens": pt + n});
    if !body["stream"].as_bool().unwrap_or(false) {
        let mut g = Generation::start(&s.stats);
        tokio::time::sleep(k.first_token_delay).await;
        g.complete();
        let calls: Vec<Value> = k
            .tool_calls
            .iter()
            .enumerate()
            .map(|(i, (name, args))| json!({"id": format!("call_fake_{i}"), "type": "function", "function": {"name": name, "arguments": args}}))
            .collect();
        return Json(json!({
            "id": "chatcmpl-fake", "object": "chat.completion", "created": 0, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": null, "tool_calls": calls}, "finish_reason": "tool_calls"}],
            "usage": usage,
        }))
        .into_response();
    }
    let sse = |v: Value| Bytes::from(format!("data: {v}\n\n"));
    let chunk = move |delta: Value, finish: Option<&str>| json!({"id": "c", "object": "chat.completion.chunk", "model": model, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]});
    let body = generate(k, n, s.stats.clone(), move |i| match i {
        Some(i) => {
            let mut delta = json!({"tool_calls": [pieces[i as usize].clone()]});
            if i == 0 {
                delta["role"] = "assistant".into();
                delta["content"] = Value::Null;
            }
            vec![sse(chunk(delta, None))]
        }
        None => vec![
            sse(chunk(json!({}), Some("tool_calls"))),
            sse(json!({"id": "c", "object": "chat.completion.chunk", "choices": [], "usage": usage})),
            Bytes::from_static(b"data: [DONE]\n\n"),
        ],
    });
    ([("content-type", "text/event-stream")], body).into_response()
}

/// Whether the fake answers `body` with tool calls.
fn wants_tool_calls(k: &Knobs, body: &Value) -> bool {
    !k.tool_calls.is_empty() && body["tools"].as_array().is_some_and(|t| !t.is_empty())
}

async fn openai_chat(State(s): State<Arc<Shared>>, Json(body): Json<Value>) -> Response {
    let k = match begin(&s, &body).await {
        Ok(k) => k,
        Err(r) => return r,
    };
    if wants_tool_calls(&k, &body) {
        return openai_tool_calls(&s, k, &body).await;
    }
    let n = token_count(&k, body["max_tokens"].as_u64());
    let model = body["model"].as_str().unwrap_or("fake").to_string();
    let pt = prompt_tokens(&body);
    let text = match body["messages"].as_array().and_then(|m| m.last()) {
        Some(last) if k.echo => format!("{} ", last["content"].as_str().unwrap_or_default()),
        _ => k.token_text.clone(),
    };
    if !body["stream"].as_bool().unwrap_or(false) {
        let mut g = Generation::start(&s.stats);
        tokio::time::sleep(k.first_token_delay + k.token_delay * n.saturating_sub(1)).await;
        g.complete();
        let mut v = json!({
            "id": "chatcmpl-fake", "object": "chat.completion", "created": 0, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text.repeat(n as usize)}, "finish_reason": if n < k.tokens { "length" } else { "stop" }}],
        });
        if !k.omit_usage {
            v["usage"] = json!({"prompt_tokens": pt, "completion_tokens": n, "total_tokens": pt + n});
        }
        return Json(v).into_response();
    }
    let include_usage = body["stream_options"]["include_usage"].as_bool().unwrap_or(false) && !k.omit_usage;
    let finish = match &k.finish_reason {
        Some(f) => f.clone(),
        None => (if n < k.tokens { "length" } else { "stop" }).to_string(),
    };
    let sse = |v: Value| Bytes::from(format!("data: {v}\n\n"));
    let body = generate(k, n, s.stats.clone(), move |i| match i {
        Some(0) => vec![
            sse(
                json!({"id": "c", "object": "chat.completion.chunk", "model": model, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null}]}),
            ),
            sse(
                json!({"id": "c", "object": "chat.completion.chunk", "model": model, "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": null}]}),
            ),
        ],
        Some(_) => vec![sse(
            json!({"id": "c", "object": "chat.completion.chunk", "model": model, "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": null}]}),
        )],
        None => {
            let mut v = vec![sse(
                json!({"id": "c", "object": "chat.completion.chunk", "model": model, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]}),
            )];
            if include_usage {
                v.push(sse(json!({"id": "c", "object": "chat.completion.chunk", "model": model, "choices": [], "usage": {"prompt_tokens": pt, "completion_tokens": n, "total_tokens": pt + n}})));
            }
            v.push(Bytes::from_static(b"data: [DONE]\n\n"));
            v
        }
    });
    ([("content-type", "text/event-stream")], body).into_response()
}

async fn ollama_chat(State(s): State<Arc<Shared>>, Json(body): Json<Value>) -> Response {
    let k = match begin(&s, &body).await {
        Ok(k) => k,
        Err(r) => return r,
    };
    let n = token_count(&k, body["options"]["num_predict"].as_u64());
    let model = body["model"].as_str().unwrap_or("fake").to_string();
    let pt = prompt_tokens(&body);
    let omit_usage = k.omit_usage;
    let text = k.token_text.clone();
    let finish = if n < k.tokens { "length" } else { "stop" };
    let line = |v: Value| Bytes::from(format!("{v}\n"));
    if wants_tool_calls(&k, &body) {
        // Ollama's form: whole calls, arguments as objects, `stop`.
        let calls: Vec<Value> = k
            .tool_calls
            .iter()
            .map(|(name, args)| {
                let args: Value = serde_json::from_str(args).unwrap_or(Value::String(args.clone()));
                json!({"function": {"name": name, "arguments": args}})
            })
            .collect();
        let n = calls.len() as u32;
        let last = json!({"model": model, "message": {"role": "assistant", "content": ""}, "done": true, "done_reason": "stop", "prompt_eval_count": pt, "eval_count": n});
        if !body["stream"].as_bool().unwrap_or(true) {
            let mut v = last;
            v["message"]["tool_calls"] = Value::Array(calls);
            return Json(v).into_response();
        }
        let body = generate(k, n, s.stats.clone(), move |i| match i {
            Some(i) => vec![line(
                json!({"model": model, "message": {"role": "assistant", "content": "", "tool_calls": [calls[i as usize].clone()]}, "done": false}),
            )],
            None => vec![line(last.clone())],
        });
        return ([("content-type", "application/x-ndjson")], body).into_response();
    }
    if !body["stream"].as_bool().unwrap_or(true) {
        let mut g = Generation::start(&s.stats);
        tokio::time::sleep(k.first_token_delay + k.token_delay * n.saturating_sub(1)).await;
        g.complete();
        let mut v = json!({"model": model, "message": {"role": "assistant", "content": text.repeat(n as usize)}, "done": true, "done_reason": finish});
        if !omit_usage {
            v["prompt_eval_count"] = pt.into();
            v["eval_count"] = n.into();
        }
        return Json(v).into_response();
    }
    let body = generate(k, n, s.stats.clone(), move |i| match i {
        Some(_) => {
            vec![line(json!({"model": model, "message": {"role": "assistant", "content": text}, "done": false}))]
        }
        None => {
            let mut v = json!({"model": model, "message": {"role": "assistant", "content": ""}, "done": true, "done_reason": finish});
            if !omit_usage {
                v["prompt_eval_count"] = pt.into();
                v["eval_count"] = n.into();
            }
            vec![line(v)]
        }
    });
    ([("content-type", "application/x-ndjson")], body).into_response()
}

fn health_status(s: &Shared) -> StatusCode {
    if s.knobs.lock().expect("knobs").healthy {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    }
}

/// llama.cpp-style `/slots`: one entry per generation in progress.
async fn slots(State(s): State<Arc<Shared>>) -> Response {
    let n = s.stats.active.load(Ordering::SeqCst).max(0);
    let v: Vec<Value> = (0..n).map(|i| json!({"id": i, "is_processing": true})).collect();
    Json(v).into_response()
}

async fn health(State(s): State<Arc<Shared>>) -> Response {
    (health_status(&s), Json(json!({"status": "ok"}))).into_response()
}

async fn openai_models(State(s): State<Arc<Shared>>) -> Response {
    (health_status(&s), Json(json!({"object": "list", "data": [{"id": "fake", "object": "model"}]}))).into_response()
}

/// A vLLM-style `/metrics` page reporting `usage` (0..=1) of the KV cache,
/// with the neighbours a real page has.
pub fn vllm_metrics(usage: f64) -> String {
    format!(
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n\
         # TYPE vllm:num_requests_running gauge\n\
         vllm:num_requests_running{{engine=\"0\",model_name=\"fake-model\"}} 1.0\n\
         # HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n\
         # TYPE vllm:kv_cache_usage_perc gauge\n\
         vllm:kv_cache_usage_perc{{engine=\"0\",model_name=\"fake-model\"}} {usage}\n"
    )
}

async fn metrics(State(s): State<Arc<Shared>>) -> Response {
    s.stats.metrics_requests.fetch_add(1, Ordering::SeqCst);
    match s.knobs.lock().expect("knobs").metrics.clone() {
        Some(page) => ([("content-type", "text/plain; version=0.0.4")], page).into_response(),
        None => (StatusCode::NOT_FOUND, "404 page not found").into_response(),
    }
}

async fn ollama_ps(State(s): State<Arc<Shared>>) -> Response {
    let resident = s.knobs.lock().expect("knobs").resident;
    let models = if resident { json!([{"name": "fake:latest", "model": "fake:latest"}]) } else { json!([]) };
    (health_status(&s), Json(json!({ "models": models }))).into_response()
}

async fn ollama_tags(State(s): State<Arc<Shared>>) -> Response {
    (health_status(&s), Json(json!({"models": [{"name": "fake:latest", "model": "fake:latest"}]}))).into_response()
}

/// A vector for `text` that depends on the text alone (as a real
/// embedding model's does), so that the same input gives the same vector
/// on every instance.
pub fn fake_embedding(text: &str, dim: usize) -> Vec<f32> {
    use sha2::{Digest, Sha256};
    let digest = Sha256::digest(text.as_bytes());
    (0..dim).map(|i| (f32::from(digest[i % digest.len()]) - 127.5) / 128.0 + i as f32 / 1024.0).collect()
}

/// The inputs of an embedding request (a string or a list of strings).
fn embedding_inputs(body: &Value) -> Vec<String> {
    match &body["input"] {
        Value::String(s) => vec![s.clone()],
        Value::Array(a) => a.iter().map(|v| v.as_str().unwrap_or_default().to_string()).collect(),
        _ => Vec::new(),
    }
}

/// Embeds every input after the configured first-token delay (the whole
/// answer at once, as real engines send it).
async fn embed(s: &Shared, body: &Value) -> Result<(Vec<Vec<f32>>, u32, Knobs), Response> {
    let k = begin(s, body).await?;
    let inputs = embedding_inputs(body);
    let mut g = Generation::start(&s.stats);
    tokio::time::sleep(k.first_token_delay).await;
    g.complete();
    let tokens: u32 = inputs.iter().map(|t| t.split_whitespace().count().max(1) as u32).sum();
    Ok((inputs.iter().map(|t| fake_embedding(t, k.embedding_dim)).collect(), tokens, k))
}

async fn openai_embeddings(State(s): State<Arc<Shared>>, Json(body): Json<Value>) -> Response {
    let (vectors, tokens, k) = match embed(&s, &body).await {
        Ok(v) => v,
        Err(r) => return r,
    };
    let data: Vec<Value> = vectors
        .into_iter()
        .enumerate()
        .map(|(i, v)| json!({"object": "embedding", "index": i, "embedding": v}))
        .collect();
    let mut v = json!({"object": "list", "model": body["model"], "data": data});
    if !k.omit_usage {
        v["usage"] = json!({"prompt_tokens": tokens, "total_tokens": tokens});
    }
    Json(v).into_response()
}

async fn ollama_embed(State(s): State<Arc<Shared>>, Json(body): Json<Value>) -> Response {
    let (vectors, tokens, k) = match embed(&s, &body).await {
        Ok(v) => v,
        Err(r) => return r,
    };
    let mut v = json!({"model": body["model"], "embeddings": vectors});
    if !k.omit_usage {
        v["prompt_eval_count"] = tokens.into();
    }
    Json(v).into_response()
}

/// A legacy completion: the `/v1/completions` shape (`choices[].text`).
async fn openai_completion(State(s): State<Arc<Shared>>, Json(body): Json<Value>) -> Response {
    let k = match begin(&s, &body).await {
        Ok(k) => k,
        Err(r) => return r,
    };
    let n = token_count(&k, body["max_tokens"].as_u64());
    let model = body["model"].as_str().unwrap_or("fake").to_string();
    let pt = body["prompt"].as_str().map(|p| p.split_whitespace().count() as u32 + 1).unwrap_or(0);
    let finish = if n < k.tokens { "length" } else { "stop" };
    if !body["stream"].as_bool().unwrap_or(false) {
        let mut g = Generation::start(&s.stats);
        tokio::time::sleep(k.first_token_delay + k.token_delay * n.saturating_sub(1)).await;
        g.complete();
        let mut v = json!({
            "id": "cmpl-fake", "object": "text_completion", "created": 0, "model": model,
            "choices": [{"index": 0, "text": k.token_text.repeat(n as usize), "logprobs": null, "finish_reason": finish}],
        });
        if !k.omit_usage {
            v["usage"] = json!({"prompt_tokens": pt, "completion_tokens": n, "total_tokens": pt + n});
        }
        return Json(v).into_response();
    }
    let include_usage = body["stream_options"]["include_usage"].as_bool().unwrap_or(false) && !k.omit_usage;
    let text = k.token_text.clone();
    let sse = |v: Value| Bytes::from(format!("data: {v}\n\n"));
    let body = generate(k, n, s.stats.clone(), move |i| match i {
        Some(_) => vec![sse(
            json!({"id": "c", "object": "text_completion", "model": model, "choices": [{"index": 0, "text": text, "finish_reason": null}]}),
        )],
        None => {
            let mut v = vec![sse(
                json!({"id": "c", "object": "text_completion", "model": model, "choices": [{"index": 0, "text": "", "finish_reason": finish}]}),
            )];
            if include_usage {
                v.push(sse(json!({"id": "c", "object": "text_completion", "model": model, "choices": [], "usage": {"prompt_tokens": pt, "completion_tokens": n, "total_tokens": pt + n}})));
            }
            v.push(Bytes::from_static(b"data: [DONE]\n\n"));
            v
        }
    });
    ([("content-type", "text/event-stream")], body).into_response()
}

/// Ollama's `/api/generate` (`response` text per NDJSON line).
async fn ollama_generate(State(s): State<Arc<Shared>>, Json(body): Json<Value>) -> Response {
    // No prompt: Ollama loads the model (or, with keep_alive 0, unloads
    // it) and answers once done; no generation.
    if body.get("prompt").is_none() {
        let unload = body["keep_alive"] == json!(0);
        s.knobs.lock().expect("knobs").resident = !unload;
        let model = body["model"].as_str().unwrap_or("fake");
        let event = format!("{} {model}", if unload { "unload" } else { "load" });
        s.stats.model_events.lock().expect("events").push(event);
        s.stats.changed.notify_waiters();
        let reason = if unload { "unload" } else { "load" };
        return Json(json!({"model": model, "response": "", "done": true, "done_reason": reason})).into_response();
    }
    let k = match begin(&s, &body).await {
        Ok(k) => k,
        Err(r) => return r,
    };
    let n = token_count(&k, body["options"]["num_predict"].as_u64());
    let model = body["model"].as_str().unwrap_or("fake").to_string();
    let pt = body["prompt"].as_str().map(|p| p.split_whitespace().count() as u32 + 1).unwrap_or(0);
    let omit_usage = k.omit_usage;
    let text = k.token_text.clone();
    let finish = if n < k.tokens { "length" } else { "stop" };
    let line = |v: Value| Bytes::from(format!("{v}\n"));
    let last = move |response: String| {
        let mut v = json!({"model": model, "response": response, "done": true, "done_reason": finish});
        if !omit_usage {
            v["prompt_eval_count"] = pt.into();
            v["eval_count"] = n.into();
        }
        v
    };
    if !body["stream"].as_bool().unwrap_or(true) {
        let mut g = Generation::start(&s.stats);
        tokio::time::sleep(k.first_token_delay + k.token_delay * n.saturating_sub(1)).await;
        g.complete();
        return Json(last(text.repeat(n as usize))).into_response();
    }
    let body = generate(k, n, s.stats.clone(), move |i| match i {
        Some(_) => vec![line(json!({"response": text, "done": false}))],
        None => vec![line(last(String::new()))],
    });
    ([("content-type", "application/x-ndjson")], body).into_response()
}

/// The status of router-mode model `name` (models never touched are
/// unloaded).
fn router_status(s: &Shared, name: &str) -> (&'static str, bool) {
    s.models.lock().expect("models").get(name).map_or(("unloaded", false), |m| (m.0, m.1))
}

async fn router_list(State(s): State<Arc<Shared>>) -> Response {
    let names = s.knobs.lock().expect("knobs").router_models.clone();
    if names.is_empty() {
        return StatusCode::NOT_FOUND.into_response();
    }
    let data: Vec<Value> = names
        .iter()
        .map(|n| {
            let (value, failed) = router_status(&s, n);
            let mut status = json!({"value": value});
            if failed {
                status["failed"] = json!(true);
                status["exit_code"] = json!(1);
            }
            json!({"id": n, "object": "model", "status": status})
        })
        .collect();
    Json(json!({"data": data})).into_response()
}

async fn router_load(State(s): State<Arc<Shared>>, Json(body): Json<Value>) -> Response {
    let k = s.knobs.lock().expect("knobs").clone();
    let name = body["model"].as_str().unwrap_or_default().to_string();
    if !k.router_models.contains(&name) {
        return (StatusCode::NOT_FOUND, Json(json!({"error": {"code": 404, "message": "File Not Found"}})))
            .into_response();
    }
    {
        let mut models = s.models.lock().expect("models");
        let now = std::time::Instant::now();
        let e = models.entry(name.clone()).or_insert(("unloaded", false, now));
        if e.0 != "unloaded" {
            return (
                StatusCode::BAD_REQUEST,
                Json(json!({"error": {"code": 400, "message": "model is already loaded"}})),
            )
                .into_response();
        }
        *e = ("loading", false, now);
    }
    let shared = s.clone();
    tokio::spawn(async move {
        tokio::time::sleep(k.load_delay).await;
        let mut models = shared.models.lock().expect("models");
        let now = std::time::Instant::now();
        if k.load_fails {
            models.insert(name, ("unloaded", true, now));
            return;
        }
        if k.models_max > 0 {
            loop {
                let loaded: Vec<(String, std::time::Instant)> =
                    models.iter().filter(|(_, m)| m.0 == "loaded").map(|(n, m)| (n.clone(), m.2)).collect();
                if loaded.len() < k.models_max {
                    break;
                }
                let lru = loaded.into_iter().min_by_key(|(_, t)| *t).map(|(n, _)| n).expect("one loaded");
                models.insert(lru.clone(), ("unloaded", false, now));
                shared.stats.model_events.lock().expect("events").push(format!("evict {lru}"));
            }
        }
        models.insert(name.clone(), ("loaded", false, now));
        shared.stats.model_events.lock().expect("events").push(format!("load {name}"));
        drop(models);
        shared.stats.changed.notify_waiters();
    });
    Json(json!({"success": true})).into_response()
}

async fn router_unload(State(s): State<Arc<Shared>>, Json(body): Json<Value>) -> Response {
    let name = body["model"].as_str().unwrap_or_default().to_string();
    let delay = s.knobs.lock().expect("knobs").unload_delay;
    if router_status(&s, &name).0 != "loaded" {
        return (StatusCode::BAD_REQUEST, Json(json!({"error": {"code": 400, "message": "model is not running"}})))
            .into_response();
    }
    let shared = s.clone();
    let unload = async move {
        tokio::time::sleep(delay).await;
        let mut models = shared.models.lock().expect("models");
        if let Some(m) = models.get_mut(&name).filter(|m| m.0 == "loaded") {
            *m = ("unloaded", false, std::time::Instant::now());
            shared.stats.model_events.lock().expect("events").push(format!("unload {name}"));
        }
        drop(models);
        shared.stats.changed.notify_waiters();
    };
    if delay.is_zero() {
        unload.await;
    } else {
        tokio::spawn(unload);
    }
    Json(json!({"success": true})).into_response()
}

async fn record_post(
    State(s): State<Arc<Shared>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if req.method() == axum::http::Method::POST && s.knobs.lock().expect("knobs").record {
        s.stats.posts.lock().expect("posts").push(req.uri().path().to_string());
        let tp = req.headers().get("traceparent").and_then(|v| v.to_str().ok()).map(str::to_string);
        s.stats.traceparents.lock().expect("traceparents").push(tp);
    }
    next.run(req).await
}

/// llama-server's `/tokenize`, deterministic: one token per
/// whitespace-separated word, plus a BOS with `add_special`.
async fn tokenize(State(s): State<Arc<Shared>>, Json(body): Json<Value>) -> Response {
    let (status, delay) = {
        let k = s.knobs.lock().expect("knobs");
        (k.tokenize_status, k.tokenize_delay)
    };
    tokio::time::sleep(delay).await;
    if let Some(code) = status {
        return (StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR), "tokenizer failed")
            .into_response();
    }
    let text = body["content"].as_str().unwrap_or_default().to_string();
    let special = body["add_special"].as_bool().unwrap_or(false);
    let n = text.split_whitespace().count() + usize::from(special);
    s.stats.tokenized.lock().expect("tokenized").push(text);
    Json(json!({"tokens": (0..n as u32).collect::<Vec<_>>()})).into_response()
}

/// llama-server's `/apply-template`, with a template of two marker words
/// per message (`<|role|> … <|end|>`) and one for the answer to come: with
/// [`tokenize`]'s BOS, 2 tokens per message and 2 per prompt.
async fn apply_template(State(s): State<Arc<Shared>>, Json(body): Json<Value>) -> Response {
    let (status, delay) = {
        let k = s.knobs.lock().expect("knobs");
        (k.tokenize_status, k.tokenize_delay)
    };
    tokio::time::sleep(delay).await;
    if let Some(code) = status {
        return (StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR), "template failed")
            .into_response();
    }
    let mut prompt = String::new();
    for m in body["messages"].as_array().into_iter().flatten() {
        let role = m["role"].as_str().unwrap_or("user");
        prompt.push_str(&format!("<|{role}|> {} <|end|>\n", m["content"].as_str().unwrap_or_default()));
    }
    prompt.push_str("<|assistant|>");
    Json(json!({"prompt": prompt})).into_response()
}

impl FakeEngine {
    /// The texts `/tokenize` was asked to count so far, in order.
    pub fn tokenized(&self) -> Vec<String> {
        self.stats.tokenized.lock().expect("tokenized").clone()
    }

    /// The paths POSTed to so far.
    pub fn posts(&self) -> Vec<String> {
        self.stats.posts.lock().expect("posts").clone()
    }

    /// The `traceparent` header of each POST so far, in order.
    pub fn traceparents(&self) -> Vec<Option<String>> {
        self.stats.traceparents.lock().expect("traceparents").clone()
    }

    /// Every generation or embedding request body so far, in order.
    pub fn bodies(&self) -> Vec<Value> {
        self.stats.bodies.lock().expect("bodies").clone()
    }

    /// The body of the last generation or embedding request.
    pub fn last_request(&self) -> Option<Value> {
        self.stats.last_request.lock().expect("last").clone()
    }
}
