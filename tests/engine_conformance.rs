//! Conformance tests for the engine adapters: the same behaviour is asserted
//! for every adapter (OpenAI-compatible SSE and Ollama NDJSON), each against
//! the fake engine, which speaks both wire protocols on one port.
//!
//! Every test is a generic async fn over the engine kind; the
//! `conformance!` macro at the bottom instantiates it once per adapter
//! (`openai_*`, `ollama_*`), so an adapter cannot skip a contract.

use std::net::TcpListener;
use std::sync::atomic::Ordering::SeqCst;
use std::sync::Arc;
use std::time::Duration;

use edgeway::config::{EngineConfig, EngineKind};
use edgeway::engine::{Capabilities, Engine, EngineChunk, EngineError, EngineLoad, EngineRequest, EngineStream};
use edgeway::error::ErrorCode;
use edgeway::router::{Instance, Router};
use edgeway::task::{ChatMessage, Operation, SamplingParams};
use edgeway::testing::{FakeEngine, Knobs};

/// The suite runs the HTTP adapters; a pool instance forwards to other
/// edgeway nodes (tests/forwarding.rs).
const HTTP_ONLY: &str = "the conformance suite runs HTTP engines only";
use futures::StreamExt;
use serde_json::{json, Map, Value};

/// Upper bound for anything a test waits on; only reached when a test fails.
const LIMIT: Duration = Duration::from_secs(10);

/// Whether the adapter is configured to stream from the engine.
const STREAM: bool = true;
const WHOLE: bool = false;

fn mode(stream: bool) -> &'static str {
    if stream {
        "streaming"
    } else {
        "non-streaming"
    }
}

fn engine_config(kind: EngineKind, base_url: &str, stream: bool) -> EngineConfig {
    let (model, health_path) = match kind {
        EngineKind::OpenAi => ("fake-model", "/health"),
        EngineKind::Ollama => ("fake", "/api/tags"),
        EngineKind::Pool => unreachable!("{HTTP_ONLY}"),
    };
    EngineConfig {
        name: format!("fake-{}", kind.as_str()),
        kind,
        base_url: base_url.to_string(),
        model: model.to_string(),
        max_concurrency: 2,
        api_key: None,
        health_path: health_path.to_string(),
        health_interval: Duration::from_secs(1),
        connect_timeout: Duration::from_secs(2),
        stream,
        keep_alive: None,
        location: edgeway::task::Location::Local,
        max_data_class: edgeway::task::DataClass::Secret,
        cost_per_1k_tokens: 0.0,
        price: Default::default(),
        reserved_realtime_slots: 0,
        max_prefill_tokens: None,
        long_prompt_tokens: 0,
        slot_affinity: false,
        tokenize: false,
        memory_budget_bytes: None,
        exclusive: true,
        process: None,
        tools: true,
        model_api: edgeway::config::ModelApi::None,
    }
}

/// A fake engine with `knobs` and an adapter of `kind` pointed at it.
struct Setup {
    fake: FakeEngine,
    cfg: EngineConfig,
    engine: Arc<dyn Engine>,
}

impl Setup {
    async fn new(kind: EngineKind, stream: bool, knobs: Knobs) -> Setup {
        Self::with_config(kind, stream, knobs, |_| {}).await
    }

    async fn with_config(kind: EngineKind, stream: bool, knobs: Knobs, tweak: impl FnOnce(&mut EngineConfig)) -> Setup {
        let fake = FakeEngine::start_with(knobs).await;
        let mut cfg = engine_config(kind, &fake.url(), stream);
        tweak(&mut cfg);
        let engine = edgeway::engine::build(&cfg).expect("adapter builds");
        Setup { fake, cfg, engine }
    }

    fn request(&self, max_output_tokens: u32) -> EngineRequest {
        EngineRequest {
            model: self.cfg.model.clone(),
            messages: vec![ChatMessage { role: "user".into(), content: json!("Say something."), extra: Map::new() }],
            params: SamplingParams::default(),
            max_output_tokens,
            tools: None,
            operation: Default::default(),
            slot: None,
            traceparent: None,
            origin: None,
        }
    }

    async fn start(&self, max_output_tokens: u32) -> EngineStream {
        let req = self.request(max_output_tokens);
        tokio::time::timeout(LIMIT, self.engine.stream(&req))
            .await
            .expect("stream() resolves")
            .unwrap_or_else(|e| panic!("stream() failed: {e:?}"))
    }

    fn last_request(&self) -> Value {
        self.fake.stats.last_request.lock().expect("last_request lock").clone().expect("the fake received a request")
    }

    /// Waits until the fake has no generation in progress and has counted
    /// `completed` and `aborted` generations in all.
    async fn settles_at(&self, completed: u64, aborted: u64) -> bool {
        self.fake
            .wait_for(LIMIT, |s| {
                s.completed.load(SeqCst) == completed && s.aborted.load(SeqCst) == aborted && s.active.load(SeqCst) == 0
            })
            .await
    }
}

fn knobs(f: impl FnOnce(&mut Knobs)) -> Knobs {
    let mut k = Knobs::default();
    f(&mut k);
    k
}

/// Reads the stream to its end.
async fn collect(stream: EngineStream) -> Vec<Result<EngineChunk, EngineError>> {
    tokio::time::timeout(LIMIT, stream.collect::<Vec<_>>()).await.expect("stream ends")
}

/// Splits a successful answer into its text, usage chunks and the rest, and
/// checks the chunk order contract: deltas first, `Finish` last and once.
struct Answer {
    text: String,
    usage: Vec<(u32, u32)>,
    finish: String,
    /// Tool-call pieces, in order.
    calls: Vec<edgeway::task::ToolCallDelta>,
}

fn answer(items: Vec<Result<EngineChunk, EngineError>>) -> Answer {
    let chunks: Vec<EngineChunk> =
        items.into_iter().map(|r| r.unwrap_or_else(|e| panic!("unexpected stream error: {e:?}"))).collect();
    let Some(EngineChunk::Finish(finish)) = chunks.last().cloned() else {
        panic!("the last chunk must be Finish: {chunks:?}");
    };
    let mut text = String::new();
    let mut usage = Vec::new();
    let mut seen_usage = false;
    let mut calls = Vec::new();
    for c in &chunks[..chunks.len() - 1] {
        match c {
            EngineChunk::Delta(t) => {
                assert!(!seen_usage, "Delta after Usage: {chunks:?}");
                assert!(!t.is_empty(), "empty Delta: {chunks:?}");
                text.push_str(t);
            }
            EngineChunk::Usage { input_tokens, output_tokens } => {
                seen_usage = true;
                usage.push((*input_tokens, *output_tokens));
            }
            EngineChunk::ToolCall(d) => {
                assert!(!seen_usage, "ToolCall after Usage: {chunks:?}");
                calls.push(d.clone());
            }
            EngineChunk::Finish(_) => panic!("Finish before the end: {chunks:?}"),
            EngineChunk::Embedding { .. } => panic!("an embedding in a chat answer: {chunks:?}"),
        }
    }
    Answer { text, usage, finish, calls }
}

/// A normal answer: deltas that add up to the text, usage, then `stop`.
async fn answer_has_deltas_usage_and_finish(kind: EngineKind, stream: bool) {
    let s = Setup::new(kind, stream, Knobs::default()).await;
    let a = answer(collect(s.start(256).await).await);
    let k = Knobs::default();
    assert_eq!(a.text, k.token_text.repeat(k.tokens as usize));
    assert_eq!(a.usage.len(), 1, "one Usage chunk");
    let (input, output) = a.usage[0];
    assert!(input > 0, "input tokens reported");
    assert_eq!(output, k.tokens);
    assert_eq!(a.finish, "stop");
    assert!(s.settles_at(1, 0).await, "the fake saw one completed generation");

    let req = s.last_request();
    assert_eq!(req["model"], s.cfg.model);
    assert_eq!(req["stream"], stream);
    assert_eq!(req["messages"][0]["role"], "user");
    assert_eq!(req["messages"][0]["content"], "Say something.");
}

/// A request with tools: they reach the engine in its protocol, and the
/// calls the engine makes come back as pieces that add up to each whole
/// call (id and name on a call's first piece), finishing `tool_calls`.
async fn tool_calls_come_back_as_pieces(kind: EngineKind, stream: bool) {
    let args = r#"{"city": "Oslo", "days": 3}"#;
    let s = Setup::new(kind, stream, knobs(|k| k.tool_calls = vec![("get_weather".into(), args.into())])).await;
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]);
    let mut req = s.request(256);
    req.tools = edgeway::task::ToolSet::parse(Some(&tools), Some(&json!("auto")), None).unwrap();
    let r = tokio::time::timeout(LIMIT, s.engine.stream(&req)).await.expect("resolves").expect("stream opens");
    let a = answer(collect(r).await);
    assert_eq!(a.finish, "tool_calls");
    assert!(a.text.is_empty(), "{:?}", a.text);
    let first = &a.calls[0];
    assert_eq!((first.index, first.name.as_deref()), (0, Some("get_weather")));
    assert!(a.calls[1..].iter().all(|c| c.index == 0 && c.name.is_none()), "{:?}", a.calls);
    let whole: String = a.calls.iter().map(|c| c.arguments.as_str()).collect();
    let whole: serde_json::Value = serde_json::from_str(&whole).unwrap();
    assert_eq!(whole, serde_json::from_str::<serde_json::Value>(args).unwrap());
    let sent = s.last_request();
    assert_eq!(sent["tools"], tools);
    if kind == EngineKind::OpenAi {
        assert_eq!(sent["tool_choice"], "auto");
        if stream {
            assert!(a.calls.len() > 2, "arguments in pieces: {:?}", a.calls);
        }
    }
}

/// `max_output_tokens` below what the engine would generate: `length`, and
/// the limit reaches the engine in its own protocol.
async fn max_output_tokens_finishes_with_length(kind: EngineKind, stream: bool) {
    let s = Setup::with_config(kind, stream, knobs(|k| k.tokens = 10), |c| c.keep_alive = Some("5m".into())).await;
    let a = answer(collect(s.start(3).await).await);
    assert_eq!(a.text, "tok ".repeat(3));
    assert_eq!(a.usage.len(), 1, "one Usage chunk");
    assert_eq!(a.usage[0].1, 3, "output tokens");
    assert_eq!(a.finish, "length");

    let req = s.last_request();
    match kind {
        EngineKind::OpenAi => {
            assert_eq!(req["max_tokens"], 3);
            if stream {
                assert_eq!(req["stream_options"]["include_usage"], true);
            } else {
                assert!(req.get("stream_options").is_none(), "{req}");
            }
            // keep_alive is an Ollama notion.
            assert!(req.get("keep_alive").is_none(), "{req}");
        }
        EngineKind::Ollama => {
            assert_eq!(req["options"]["num_predict"], 3);
            assert_eq!(req["keep_alive"], "5m");
        }
        EngineKind::Pool => unreachable!("{HTTP_ONLY}"),
    }
}

/// Ollama's `keep_alive` is sent only when configured.
async fn keep_alive_only_when_configured(kind: EngineKind, stream: bool) {
    let s = Setup::new(kind, stream, Knobs::default()).await;
    answer(collect(s.start(256).await).await);
    let req = s.last_request();
    assert!(req.get("keep_alive").is_none(), "{req}");
}

/// An engine that reports no usage still ends its answer with `Finish`.
async fn without_usage_still_finishes(kind: EngineKind, stream: bool) {
    let s = Setup::new(kind, stream, knobs(|k| k.omit_usage = true)).await;
    let a = answer(collect(s.start(256).await).await);
    assert_eq!(a.text, "tok ".repeat(5));
    assert!(a.usage.is_empty(), "no Usage chunk: {:?}", a.usage);
    assert_eq!(a.finish, "stop");
}

/// An HTTP error from the engine is a `Status` error from `stream()`; only
/// 502 and above count as the engine being unusable.
async fn http_error_is_status_error(kind: EngineKind) {
    for stream in [STREAM, WHOLE] {
        for (code, unreachable) in [(500u16, false), (503, true)] {
            let s = Setup::new(kind, stream, knobs(|k| k.fail_status = Some(code))).await;
            let req = s.request(256);
            let r = tokio::time::timeout(LIMIT, s.engine.stream(&req)).await.expect("stream() resolves");
            let e = match r {
                Ok(_) => panic!("{}: HTTP {code} must fail stream()", mode(stream)),
                Err(e) => e,
            };
            assert!(matches!(e, EngineError::Status { status, .. } if status == code), "{}: {e:?}", mode(stream));
            assert_eq!(e.is_unreachable(), unreachable, "{}: {e:?}", mode(stream));
            assert_eq!(s.fake.stats.requests.load(SeqCst), 1);
        }
    }
}

/// Nothing listening: `Unreachable`.
async fn closed_port_is_unreachable(kind: EngineKind) {
    for stream in [STREAM, WHOLE] {
        let cfg = engine_config(kind, &closed_port_url(), stream);
        let engine = edgeway::engine::build(&cfg).expect("adapter builds");
        let req = EngineRequest {
            model: cfg.model.clone(),
            messages: vec![ChatMessage { role: "user".into(), content: json!("Hi"), extra: Map::new() }],
            params: SamplingParams::default(),
            max_output_tokens: 16,
            tools: None,
            operation: Default::default(),
            slot: None,
            traceparent: None,
            origin: None,
        };
        let r = tokio::time::timeout(LIMIT, engine.stream(&req)).await.expect("stream() resolves");
        let e = match r {
            Ok(_) => panic!("{}: a closed port must fail stream()", mode(stream)),
            Err(e) => e,
        };
        assert!(matches!(e, EngineError::Unreachable(_)), "{}: {e:?}", mode(stream));
        assert!(e.is_unreachable());
    }
}

/// A URL on 127.0.0.1 where nothing listens (a port just freed).
fn closed_port_url() -> String {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = l.local_addr().expect("addr").port();
    drop(l);
    format!("http://127.0.0.1:{port}")
}

/// The engine closes a connection after reading a request, without an
/// answer (as when it closes a kept-alive connection just as it is reused):
/// the adapter sends once and says so with `ConnectionLost` (the engine saw
/// no request), so that the router may send it again.
async fn connection_closed_before_answer_is_connection_lost(kind: EngineKind) {
    let s = Setup::new(kind, STREAM, Knobs::default()).await;
    let proxy = breaking_proxy(&s.fake.url(), 1).await;
    let engine = edgeway::engine::build(&engine_config(kind, &proxy, STREAM)).expect("adapter builds");
    let r = tokio::time::timeout(LIMIT, engine.stream(&s.request(16))).await.expect("stream() resolves");
    match r {
        Err(e) => {
            assert!(matches!(e, EngineError::ConnectionLost(ref m) if m.contains("closed")), "{e:?}");
            assert!(e.is_unreachable());
        }
        Ok(_) => panic!("a broken connection must fail stream()"),
    }
    assert_eq!(s.fake.stats.requests.load(SeqCst), 0);
}

/// Through the router: one connection broken before the answer is sent once
/// more and the answer arrives (the engine ran it once); a second broken
/// connection is `MODEL_UNAVAILABLE` for the client.
async fn router_resends_once_when_connection_closed_before_answer(kind: EngineKind) {
    for (broken, succeeds) in [(1usize, true), (2, false)] {
        let s = Setup::new(kind, STREAM, Knobs::default()).await;
        let proxy = breaking_proxy(&s.fake.url(), broken).await;
        let cfg = engine_config(kind, &proxy, STREAM);
        let router = Router::new(vec![Instance {
            name: cfg.name.clone(),
            engine: edgeway::engine::build(&cfg).expect("adapter builds"),
            engine_model: cfg.model.clone(),
            max_concurrency: cfg.max_concurrency,
            exclusive: cfg.exclusive,
            health_interval: cfg.health_interval,
            price: cfg.price,
        }]);
        let r = tokio::time::timeout(LIMIT, router.open(0, &s.request(16))).await.expect("open() resolves");
        match r {
            Ok(stream) if succeeds => {
                let a = answer(collect(stream).await);
                assert!(!a.finish.is_empty() && !a.text.is_empty(), "{}: {:?}", a.finish, a.text);
                assert_eq!(s.fake.stats.requests.load(SeqCst), 1, "the engine ran it once");
            }
            Err(e) if !succeeds => {
                assert_eq!(e.error.code, ErrorCode::ModelUnavailable, "{e:?}");
                assert!(e.reason.contains("closed"), "{e:?}");
                assert_eq!(s.fake.stats.requests.load(SeqCst), 0);
            }
            other => panic!("{broken} broken connection(s): {:?}", other.map(|_| "a stream")),
        }
    }
}

/// A TCP proxy to `target` whose first `broken` connections read a request
/// and close without answering; later ones are forwarded.
async fn breaking_proxy(target: &str, broken: usize) -> String {
    use tokio::io::AsyncReadExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let target = target.trim_start_matches("http://").to_string();
    tokio::spawn(async move {
        let mut n = 0;
        while let Ok((mut c, _)) = listener.accept().await {
            n += 1;
            if n <= broken {
                let mut buf = vec![0u8; 64 * 1024];
                let _ = c.read(&mut buf).await;
                drop(c);
                continue;
            }
            let target = target.clone();
            tokio::spawn(async move {
                if let Ok(mut up) = tokio::net::TcpStream::connect(&target).await {
                    let _ = tokio::io::copy_bidirectional(&mut c, &mut up).await;
                }
            });
        }
    });
    format!("http://{addr}")
}

/// The engine connection breaks after two tokens: the deltas that arrived,
/// then an error, never a `Finish`.
async fn mid_stream_drop_errors_without_finish(kind: EngineKind) {
    let s = Setup::new(kind, STREAM, knobs(|k| k.drop_after = Some(2))).await;
    let items = collect(s.start(256).await).await;
    let deltas: Vec<&EngineChunk> =
        items.iter().filter_map(|r| r.as_ref().ok()).filter(|c| matches!(c, EngineChunk::Delta(_))).collect();
    assert_eq!(deltas.len(), 2, "{items:?}");
    assert!(!items.iter().any(|r| matches!(r, Ok(EngineChunk::Finish(_)))), "no Finish after a drop: {items:?}");
    let last = items.last().expect("some items");
    assert!(
        matches!(last, Err(EngineError::Truncated) | Err(EngineError::Protocol(_))),
        "ends with Truncated or Protocol: {items:?}"
    );
    // The error is the stream's end, right after the deltas.
    assert_eq!(items.len(), 3, "{items:?}");
    assert!(s.settles_at(0, 1).await);
}

/// Dropping the stream mid-answer closes the engine connection, and the
/// engine stops generating (cancel by drop).
async fn dropping_stream_aborts_generation(kind: EngineKind) {
    let s = Setup::new(
        kind,
        STREAM,
        knobs(|k| {
            k.tokens = 100;
            k.token_delay = Duration::from_millis(50);
        }),
    )
    .await;
    let mut stream = s.start(256).await;
    for _ in 0..2 {
        let c = tokio::time::timeout(LIMIT, stream.next()).await.expect("a chunk arrives");
        assert!(matches!(c, Some(Ok(EngineChunk::Delta(_)))), "{c:?}");
    }
    assert_eq!(s.fake.active(), 1);
    drop(stream);
    assert!(
        s.fake.wait_for(Duration::from_secs(5), |st| st.aborted.load(SeqCst) == 1 && st.active.load(SeqCst) == 0).await,
        "the fake saw the abort (aborted={}, active={})",
        s.fake.stats.aborted.load(SeqCst),
        s.fake.active()
    );
    assert_eq!(s.fake.stats.completed.load(SeqCst), 0);
}

/// Non-streaming: dropping the request while the engine is still working on
/// the whole answer also aborts the generation.
async fn dropping_pending_whole_answer_aborts_generation(kind: EngineKind) {
    let s = Setup::new(
        kind,
        WHOLE,
        knobs(|k| {
            k.tokens = 100;
            k.token_delay = Duration::from_millis(50);
        }),
    )
    .await;
    let engine = s.engine.clone();
    let req = s.request(256);
    let pending = tokio::spawn(async move { engine.stream(&req).await.map(|_| ()) });
    assert!(s.fake.wait_for(LIMIT, |st| st.active.load(SeqCst) == 1).await, "the fake started generating");
    pending.abort();
    assert!(pending.await.expect_err("aborted").is_cancelled());
    assert!(
        s.fake.wait_for(Duration::from_secs(5), |st| st.aborted.load(SeqCst) == 1 && st.active.load(SeqCst) == 0).await,
        "the fake saw the abort (aborted={}, active={})",
        s.fake.stats.aborted.load(SeqCst),
        s.fake.active()
    );
    assert_eq!(s.fake.stats.completed.load(SeqCst), 0);
}

/// `health()` follows the engine's own health answer.
async fn health_follows_engine(kind: EngineKind) {
    let s = Setup::new(kind, STREAM, Knobs::default()).await;
    let h = s.engine.health().await;
    assert!(h.up, "{h:?}");
    assert_eq!(h.detail, "ok");
    match kind {
        // The fake's /api/ps lists the model: it is in memory.
        EngineKind::Ollama => assert_eq!(h.model_resident, Some(true), "{h:?}"),
        EngineKind::OpenAi => assert_eq!(h.model_resident, None, "{h:?}"),
        EngineKind::Pool => unreachable!("{HTTP_ONLY}"),
    }

    s.fake.set(|k| k.healthy = false);
    let h = s.engine.health().await;
    assert!(!h.up, "{h:?}");
    assert!(h.detail.contains("503"), "{h:?}");

    s.fake.set(|k| k.healthy = true);
    let h = s.engine.health().await;
    assert!(h.up, "up again: {h:?}");
    // Probes are not generations.
    assert_eq!(s.fake.stats.requests.load(SeqCst), 0);
}

async fn health_of_closed_port_is_down(kind: EngineKind) {
    let cfg = engine_config(kind, &closed_port_url(), STREAM);
    let engine = edgeway::engine::build(&cfg).expect("adapter builds");
    let h = tokio::time::timeout(LIMIT, engine.health()).await.expect("health() resolves");
    assert!(!h.up, "{h:?}");
    assert!(h.detail.contains("unreachable"), "{h:?}");
}

async fn reports_kind_and_capabilities(kind: EngineKind) {
    for stream in [STREAM, WHOLE] {
        let s = Setup::new(kind, stream, Knobs::default()).await;
        assert_eq!(s.engine.kind(), kind);
        assert_eq!(s.engine.name(), s.cfg.name);
        assert_eq!(
            s.engine.capabilities(),
            Capabilities { streaming: stream, reports_usage: true, cancel_on_disconnect: true },
            "{}",
            mode(stream)
        );
    }
}

/// `load()` passes on what the engine reports about itself where the wire
/// protocol has it (the OpenAI-compatible family: llama.cpp's `/slots`,
/// vLLM's and llama.cpp's `/metrics`), and reports nothing where it does
/// not (Ollama's load is not read; its residency comes with `health()`).
async fn load_reports_what_the_engine_tells(kind: EngineKind) {
    let s = Setup::new(kind, STREAM, knobs(|k| k.metrics = Some(edgeway::testing::vllm_metrics(0.42)))).await;
    let load = s.engine.load().await;
    match kind {
        EngineKind::OpenAi => {
            assert_eq!(load.kv_cache_usage, Some(0.42), "{load:?}");
            assert_eq!(load.busy_slots, Some(0), "{load:?}");
        }
        EngineKind::Ollama => assert_eq!(load, EngineLoad::default()),
        EngineKind::Pool => unreachable!("{HTTP_ONLY}"),
    }
    // Probes are not generations.
    assert_eq!(s.fake.stats.requests.load(SeqCst), 0);
}

impl Setup {
    /// Runs `operation` (a completion or embeddings) with `max_output_tokens`
    /// and no messages, as the driver sends it.
    async fn run(&self, operation: Operation, max_output_tokens: u32) -> Result<EngineStream, EngineError> {
        let req = EngineRequest {
            model: self.cfg.model.clone(),
            messages: Vec::new(),
            params: SamplingParams::default(),
            max_output_tokens,
            tools: None,
            operation,
            slot: None,
            traceparent: None,
            origin: None,
        };
        tokio::time::timeout(LIMIT, self.engine.stream(&req)).await.expect("stream() resolves")
    }
}

/// A legacy completion: the prompt reaches the engine's own completion
/// endpoint as it is (no messages, no chat template), and the answer keeps
/// the chunk contract of a chat.
async fn completion_sends_the_prompt_as_it_is(kind: EngineKind, stream: bool) {
    let s = Setup::new(kind, stream, knobs(|k| k.tokens = 10)).await;
    let op = Operation::Completion { prompt: "Once upon".into() };
    let a = answer(collect(s.run(op, 3).await.expect("stream()")).await);
    assert_eq!(a.text, "tok ".repeat(3));
    assert_eq!(a.finish, "length");
    assert_eq!(a.usage.len(), 1, "one Usage chunk");
    let req = s.last_request();
    assert_eq!(req["prompt"], "Once upon", "{req}");
    assert!(req.get("messages").is_none(), "{req}");
    match kind {
        EngineKind::OpenAi => assert_eq!(s.fake.posts(), vec!["/v1/completions"]),
        EngineKind::Ollama => {
            assert_eq!(s.fake.posts(), vec!["/api/generate"]);
            assert_eq!(req["raw"], true, "no template: {req}");
        }
        EngineKind::Pool => unreachable!("{HTTP_ONLY}"),
    }
}

/// Embeddings: the whole list in one call, one vector per input in input
/// order, the engine's token count, then `stop`; a failed call fails
/// `stream()` itself, before any chunk.
async fn embeddings_come_whole_in_input_order(kind: EngineKind) {
    let s = Setup::new(kind, STREAM, knobs(|k| k.embedding_dim = 4)).await;
    let inputs = vec!["one two".to_string(), "three".to_string()];
    let op = Operation::Embedding { input: inputs.clone(), dimensions: None };
    let chunks: Vec<EngineChunk> =
        collect(s.run(op.clone(), 1).await.expect("stream()")).await.into_iter().map(Result::unwrap).collect();
    let want = vec![
        EngineChunk::Embedding { index: 0, vector: edgeway::testing::fake_embedding("one two", 4) },
        EngineChunk::Embedding { index: 1, vector: edgeway::testing::fake_embedding("three", 4) },
        EngineChunk::Usage { input_tokens: 3, output_tokens: 0 },
        EngineChunk::Finish("stop".into()),
    ];
    assert_eq!(chunks, want);
    let path = if kind == EngineKind::OpenAi { "/v1/embeddings" } else { "/api/embed" };
    assert_eq!(s.fake.posts(), vec![path], "one engine call");
    assert_eq!(s.last_request()["input"], json!(inputs));

    s.fake.set(|k| k.fail_status = Some(503));
    match s.run(op, 1).await {
        Err(EngineError::Status { status: 503, .. }) => {}
        Err(e) => panic!("{e:?}"),
        Ok(_) => panic!("a failed embeddings call must fail stream()"),
    }
}

/// Instantiates each generic test once per adapter, under the names given.
macro_rules! conformance {
    ($($test:ident($($arg:expr),*) => $openai:ident, $ollama:ident;)*) => {
        $(
            #[tokio::test]
            async fn $openai() {
                $test(EngineKind::OpenAi $(, $arg)*).await;
            }

            #[tokio::test]
            async fn $ollama() {
                $test(EngineKind::Ollama $(, $arg)*).await;
            }
        )*
    };
}

conformance! {
    answer_has_deltas_usage_and_finish(STREAM)
        => openai_streams_deltas_usage_and_finish, ollama_streams_deltas_usage_and_finish;
    answer_has_deltas_usage_and_finish(WHOLE)
        => openai_whole_answer_has_deltas_usage_and_finish,
           ollama_whole_answer_has_deltas_usage_and_finish;
    tool_calls_come_back_as_pieces(STREAM)
        => openai_streamed_tool_calls_come_back_as_pieces, ollama_streamed_tool_calls_come_back_as_pieces;
    tool_calls_come_back_as_pieces(WHOLE)
        => openai_whole_tool_calls_come_back_as_pieces, ollama_whole_tool_calls_come_back_as_pieces;
    max_output_tokens_finishes_with_length(STREAM)
        => openai_streamed_max_output_tokens_finishes_with_length,
           ollama_streamed_max_output_tokens_finishes_with_length;
    max_output_tokens_finishes_with_length(WHOLE)
        => openai_whole_max_output_tokens_finishes_with_length,
           ollama_whole_max_output_tokens_finishes_with_length;
    keep_alive_only_when_configured(STREAM)
        => openai_sends_no_keep_alive_unless_configured,
           ollama_sends_no_keep_alive_unless_configured;
    without_usage_still_finishes(STREAM)
        => openai_streamed_without_usage_still_finishes,
           ollama_streamed_without_usage_still_finishes;
    without_usage_still_finishes(WHOLE)
        => openai_whole_without_usage_still_finishes, ollama_whole_without_usage_still_finishes;
    http_error_is_status_error()
        => openai_http_error_is_status_error, ollama_http_error_is_status_error;
    closed_port_is_unreachable()
        => openai_closed_port_is_unreachable, ollama_closed_port_is_unreachable;
    connection_closed_before_answer_is_connection_lost()
        => openai_connection_closed_before_answer_is_connection_lost,
           ollama_connection_closed_before_answer_is_connection_lost;
    router_resends_once_when_connection_closed_before_answer()
        => openai_router_resends_once_when_connection_closed_before_answer,
           ollama_router_resends_once_when_connection_closed_before_answer;
    mid_stream_drop_errors_without_finish()
        => openai_mid_stream_drop_errors_without_finish,
           ollama_mid_stream_drop_errors_without_finish;
    dropping_stream_aborts_generation()
        => openai_dropping_stream_aborts_generation, ollama_dropping_stream_aborts_generation;
    dropping_pending_whole_answer_aborts_generation()
        => openai_dropping_pending_whole_answer_aborts_generation,
           ollama_dropping_pending_whole_answer_aborts_generation;
    health_follows_engine() => openai_health_follows_engine, ollama_health_follows_engine;
    health_of_closed_port_is_down()
        => openai_health_of_closed_port_is_down, ollama_health_of_closed_port_is_down;
    reports_kind_and_capabilities()
        => openai_reports_kind_and_capabilities, ollama_reports_kind_and_capabilities;
    load_reports_what_the_engine_tells()
        => openai_load_reports_what_the_engine_tells, ollama_load_reports_nothing_it_cannot_read;
    completion_sends_the_prompt_as_it_is(STREAM)
        => openai_streamed_completion_sends_the_prompt_as_it_is,
           ollama_streamed_completion_sends_the_prompt_as_it_is;
    completion_sends_the_prompt_as_it_is(WHOLE)
        => openai_whole_completion_sends_the_prompt_as_it_is,
           ollama_whole_completion_sends_the_prompt_as_it_is;
    embeddings_come_whole_in_input_order()
        => openai_embeddings_come_whole_in_input_order, ollama_embeddings_come_whole_in_input_order;
}

/// OpenAI-compatible only: an engine without `/metrics` (404) is not asked
/// at every probe for ever; a missing reading is `None`, never an error.
#[tokio::test]
async fn openai_load_stops_asking_an_engine_without_metrics() {
    let s = Setup::new(EngineKind::OpenAi, STREAM, Knobs::default()).await;
    for _ in 0..6 {
        assert_eq!(s.engine.load().await.kv_cache_usage, None);
    }
    let asked = s.fake.stats.metrics_requests.load(SeqCst);
    assert!((1..6).contains(&asked), "asked {asked} times in 6 probes");
    // A page without a KV gauge (newer llama.cpp builds) is a miss too.
    let s =
        Setup::new(EngineKind::OpenAi, STREAM, knobs(|k| k.metrics = Some("llamacpp:requests_processing 0\n".into())))
            .await;
    for _ in 0..6 {
        assert_eq!(s.engine.load().await.kv_cache_usage, None);
    }
    assert!(s.fake.stats.metrics_requests.load(SeqCst) < 6);
}

/// Ollama only: `/api/ps` says whether the model is in memory.
#[tokio::test]
async fn ollama_health_reports_an_unloaded_model() {
    let s = Setup::new(EngineKind::Ollama, STREAM, knobs(|k| k.resident = false)).await;
    let h = s.engine.health().await;
    assert!(h.up, "installed but not loaded is still up: {h:?}");
    assert_eq!(h.model_resident, Some(false));
    s.fake.set(|k| k.resident = true);
    assert_eq!(s.engine.health().await.model_resident, Some(true));
}

/// Ollama only: the configured model must be installed (listed by
/// `/api/tags`) for the instance to be up.
#[tokio::test]
async fn ollama_health_needs_the_configured_model() {
    let s = Setup::with_config(EngineKind::Ollama, STREAM, Knobs::default(), |c| c.model = "other-model".into()).await;
    let h = s.engine.health().await;
    assert!(!h.up, "{h:?}");
    assert!(h.detail.contains("other-model"), "{h:?}");
    assert_eq!(h.model_resident, Some(false));
}

/// Ollama only: a bare configured name means `:latest`, and an explicit tag
/// must match exactly.
#[tokio::test]
async fn ollama_health_matches_model_tags() {
    for (model, up) in [("fake", true), ("fake:latest", true), ("fake:7b", false)] {
        let s = Setup::with_config(EngineKind::Ollama, STREAM, Knobs::default(), |c| c.model = model.into()).await;
        let h = s.engine.health().await;
        assert_eq!(h.up, up, "{model}: {h:?}");
    }
}

/// The fake keeps every request's body and POST path for the tests that
/// read them, and none with `record` off (a benchmark's long run: kept,
/// they grew its process by a few KB a request).
#[tokio::test]
async fn the_fake_records_requests_only_when_asked() {
    for record in [true, false] {
        let s = Setup::new(EngineKind::OpenAi, STREAM, knobs(|k| k.record = record)).await;
        for chunk in collect(s.start(4).await).await {
            chunk.expect("a chunk");
        }
        assert_eq!(s.fake.requests(), 1, "record = {record}");
        let kept = usize::from(record);
        assert_eq!(s.fake.bodies().len(), kept, "record = {record}");
        assert_eq!(s.fake.posts().len(), kept, "record = {record}");
        assert_eq!(s.fake.traceparents().len(), kept, "record = {record}");
    }
}
