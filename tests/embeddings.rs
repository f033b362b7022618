//! `POST /v1/embeddings` end to end (issue 17) against fake engines on real
//! sockets: one engine call per request, float and base64, both wire
//! families, the model's kind, refused inputs, a failed instance retried on
//! another, the record in the store, and the batch lane (a queued chat is
//! granted before queued embeddings).

mod common;

use std::time::Duration;

use base64::Engine as _;
use common::*;
use edgeway::testing::fake_embedding;
use serde_json::{json, Value};

/// An embedding model `embed` served by engine `emb` at `url` (kind
/// `openai` or `ollama`), beside the test config's chat model. `model_extra`
/// goes into `[models.embed]`.
fn embed_section(url: &str, kind: &str, model_extra: &str) -> String {
    let model = if kind == "ollama" { "fake" } else { "fake-embed" };
    format!(
        r#"
[engines.emb]
type = "{kind}"
base_url = "{url}"
model = "{model}"
max_concurrency = 2
health_interval_ms = 100
[models.embed]
kind = "embedding"
instances = ["emb"]
context_tokens = 512
{model_extra}
"#
    )
}

async fn post(gw: &TestGateway, path: &str, key: Option<&str>, body: &Value) -> (u16, Value) {
    let mut rb = client().post(format!("{}{path}", gw.base_url)).json(body);
    if let Some(k) = key {
        rb = rb.bearer_auth(k);
    }
    let resp = rb.send().await.unwrap();
    let status = resp.status().as_u16();
    let text = resp.text().await.unwrap();
    (status, serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}")))
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()
}

fn base64_floats(v: &Value) -> Vec<f32> {
    let bytes = base64::engine::general_purpose::STANDARD.decode(v.as_str().unwrap()).unwrap();
    bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

#[tokio::test]
async fn a_list_is_one_engine_call_and_comes_back_as_floats_or_base64() {
    let chat = FakeEngine::start().await;
    let emb = FakeEngine::start().await;
    let gw = TestGateway::with_engine(&chat.url(), "openai", &embed_section(&emb.url(), "openai", "")).await;
    gw.wait_ready().await;
    let inputs = ["the first text", "a second one"];

    let (status, v) = post(&gw, "/v1/embeddings", Some(DEMO_KEY), &json!({"model": "embed", "input": inputs})).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "list");
    assert_eq!(v["model"], "embed");
    let data = v["data"].as_array().unwrap();
    assert_eq!(data.len(), 2, "{v}");
    for (i, d) in data.iter().enumerate() {
        assert_eq!(d["object"], "embedding");
        assert_eq!(d["index"], i);
        assert_eq!(floats(&d["embedding"]), fake_embedding(inputs[i], 8), "input {i}");
    }
    // The engine counted 3 + 3 words as tokens; usage is in its tokens.
    assert_eq!(v["usage"], json!({"prompt_tokens": 6, "total_tokens": 6}));
    assert_eq!(v["edge"]["status"], "SUCCEEDED");
    assert_eq!(emb.posts(), vec!["/v1/embeddings"], "one engine call for the whole list");
    let sent = emb.last_request().unwrap();
    assert_eq!(sent["input"], json!(inputs));
    assert_eq!(sent["model"], "fake-embed");
    assert_eq!(chat.requests(), 0);

    // The record: a task like any other, in the batch lane, usage in tokens.
    let task_id = v["edge"]["task_id"].as_str().unwrap().to_string();
    let states = stored_states(&gw, &task_id).await;
    assert_eq!(states.first().map(String::as_str), Some("RECEIVED"), "{states:?}");
    assert!(states.contains(&"QUEUED".to_string()) && states.last().unwrap() == "SUCCEEDED", "{states:?}");
    let rec = gw.store().get(&task_id).await.unwrap().expect("stored");
    assert_eq!(rec.priority, "P4");
    assert_eq!(rec.logical_model, "embed");
    assert_eq!(rec.result.as_ref().unwrap().usage.input_tokens, 6);

    // base64: little-endian f32, the same numbers; a single string works too.
    let (status, b) = post(
        &gw,
        "/v1/embeddings",
        Some(DEMO_KEY),
        &json!({"model": "embed", "input": inputs[1], "encoding_format": "base64"}),
    )
    .await;
    assert_eq!(status, 200, "{b}");
    assert_eq!(b["data"].as_array().unwrap().len(), 1);
    assert_eq!(base64_floats(&b["data"][0]["embedding"]), fake_embedding(inputs[1], 8));
    gw.stop().await;
}

#[tokio::test]
async fn ollama_serves_embeddings_through_api_embed() {
    let chat = FakeEngine::start().await;
    let emb = FakeEngine::start().await;
    let gw = TestGateway::with_engine(&chat.url(), "openai", &embed_section(&emb.url(), "ollama", "")).await;
    gw.wait_ready().await;
    let (status, v) =
        post(&gw, "/v1/embeddings", Some(DEMO_KEY), &json!({"model": "embed", "input": ["a b", "c"]})).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(floats(&v["data"][1]["embedding"]), fake_embedding("c", 8));
    assert_eq!(v["usage"]["prompt_tokens"], 3);
    assert_eq!(emb.posts(), vec!["/api/embed"]);
    assert_eq!(emb.last_request().unwrap()["input"], json!(["a b", "c"]));
    gw.stop().await;
}

#[tokio::test]
async fn wrong_kinds_and_unsupported_inputs_are_refused_by_name() {
    let chat = FakeEngine::start().await;
    let emb = FakeEngine::start().await;
    let section = embed_section(&emb.url(), "openai", "")
        + &format!(
            "[engines.emb2]\ntype = \"openai\"\nbase_url = \"{}\"\nmodel = \"m\"\n[models.sized]\nkind = \"embedding\"\ninstances = [\"emb2\"]\nsupports_dimensions = true\ndimensions = 8\n",
            emb.url()
        );
    let gw = TestGateway::with_engine(&chat.url(), "openai", &section).await;
    let cases = [
        ("/v1/embeddings", json!({"model": "general-chat", "input": "x"}), "'general-chat'"),
        ("/v1/chat/completions", json!({"model": "embed", "messages": [{"role": "user", "content": "x"}]}), "'embed'"),
        ("/v1/completions", json!({"model": "embed", "prompt": "x"}), "'embed'"),
        (
            "/v1/embeddings",
            json!({"model": "embed", "input": "x", "dimensions": 4}),
            "'embed' does not support 'dimensions'",
        ),
        ("/v1/embeddings", json!({"model": "embed", "input": [[1, 2, 3]]}), "token ids"),
        ("/v1/embeddings", json!({"model": "embed", "input": "x", "idempotency_key": "k1"}), "idempotency"),
        ("/v1/embeddings", json!({"model": "embed", "input": ["x".repeat(4000)]}), "input[0]"),
    ];
    for (path, body, says) in cases {
        let (status, v) = post(&gw, path, Some(DEMO_KEY), &body).await;
        let code = if says == "input[0]" { "CONTEXT_TOO_LARGE" } else { "INVALID_REQUEST" };
        assert_eq!(
            (status, error_code(&v)),
            (if code == "INVALID_REQUEST" { 400 } else { 413 }, code),
            "{path} {body}: {v}"
        );
        assert!(v["error"]["message"].as_str().unwrap().contains(says), "{path}: {v}");
    }
    // The same auth as chat.
    let (status, v) = post(&gw, "/v1/embeddings", None, &json!({"model": "embed", "input": "x"})).await;
    assert_eq!((status, error_code(&v)), (401, "AUTH_FAILED"));
    assert_eq!(emb.requests(), 0, "nothing refused reached an engine");

    // A model that supports `dimensions` passes it on.
    let (status, v) =
        post(&gw, "/v1/embeddings", Some(DEMO_KEY), &json!({"model": "sized", "input": "x", "dimensions": 4})).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(emb.last_request().unwrap()["dimensions"], 4);

    // `/v1/models` says which is which.
    let models: Value = client()
        .get(format!("{}/v1/models", gw.base_url))
        .bearer_auth(DEMO_KEY)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let model = |id: &str| models["data"].as_array().unwrap().iter().find(|m| m["id"] == id).unwrap().clone();
    let kind = |id: &str| model(id)["kind"].clone();
    assert_eq!((kind("embed"), kind("general-chat")), (json!("embedding"), json!("chat")));
    // And what each takes: the vector length where it is configured.
    assert_eq!(model("sized")["dimensions"], 8, "{models}");
    assert_eq!(model("sized")["supports_dimensions"], true);
    assert_eq!(model("embed")["dimensions"], Value::Null);
    assert_eq!(model("embed")["supports_dimensions"], false);
    assert!(model("general-chat").get("dimensions").is_none(), "{models}");
    assert_eq!((model("embed")["tools"].clone(), model("general-chat")["tools"].clone()), (json!(false), json!(false)));
    gw.stop().await;
}

#[tokio::test]
async fn an_instance_that_fails_is_retried_on_another() {
    let chat = FakeEngine::start().await;
    let bad = FakeEngine::start_with(Knobs { fail_status: Some(500), ..Knobs::default() }).await;
    let good = FakeEngine::start().await;
    let section = embed_section(&bad.url(), "openai", "")
        .replace("instances = [\"emb\"]", "instances = [\"emb\", \"emb2\"]")
        + &format!(
            "[engines.emb2]\ntype = \"openai\"\nbase_url = \"{}\"\nmodel = \"fake-embed\"\nhealth_interval_ms = 100\n",
            good.url()
        );
    let gw = TestGateway::with_engine(&chat.url(), "openai", &section).await;
    gw.wait_ready().await;
    let (status, v) =
        post(&gw, "/v1/embeddings", Some(DEMO_KEY), &json!({"model": "embed", "input": ["x", "y"]})).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(floats(&v["data"][1]["embedding"]), fake_embedding("y", 8));
    assert_eq!(bad.requests(), 1, "the first (listed first) instance was tried");
    assert_eq!(good.requests(), 1);
    let route = &v["edge"]["route"];
    assert_eq!((route["attempts"].as_u64(), route["instance"].as_str()), (Some(2), Some("emb2")), "{route}");
    gw.stop().await;
}

#[tokio::test]
async fn a_queued_chat_is_granted_before_queued_embeddings() {
    // One running task at a time over all engines: chat and embeddings
    // compete for it.
    let chat =
        FakeEngine::start_with(Knobs { first_token_delay: Duration::from_millis(300), ..Knobs::default() }).await;
    let emb = FakeEngine::start().await;
    let section = embed_section(&emb.url(), "openai", "") + "[scheduler]\nmax_running = 1\n";
    let gw = TestGateway::with_engine(&chat.url(), "openai", &section).await;
    gw.wait_ready().await;
    let mut events = gw.recorder().subscribe();

    // A chat takes the one slot.
    let first = tokio::spawn({
        let url = gw.base_url.clone();
        async move {
            client()
                .post(format!("{url}/v1/chat/completions"))
                .bearer_auth(DEMO_KEY)
                .json(&chat_body(false))
                .send()
                .await
                .unwrap()
                .status()
        }
    });
    let holder = next_event(&mut events, "the first chat runs", |e| e.state == TaskState::Dispatching).await;
    // Embeddings queue first, then a chat.
    let embedding = tokio::spawn({
        let url = gw.base_url.clone();
        async move {
            client()
                .post(format!("{url}/v1/embeddings"))
                .bearer_auth(DEMO_KEY)
                .json(&json!({"model": "embed", "input": ["bulk", "indexing"]}))
                .send()
                .await
                .unwrap()
                .status()
        }
    });
    let queued_embedding =
        next_event(&mut events, "embeddings queued", |e| e.state == TaskState::Queued && e.logical_model == "embed")
            .await;
    assert_eq!(queued_embedding.priority, "P4");
    let second = tokio::spawn({
        let url = gw.base_url.clone();
        async move {
            client()
                .post(format!("{url}/v1/chat/completions"))
                .bearer_auth(DEMO_KEY)
                .json(&chat_body(false))
                .send()
                .await
                .unwrap()
                .status()
        }
    });
    let queued_chat = next_event(&mut events, "second chat queued", |e| {
        e.state == TaskState::Queued && e.logical_model == "general-chat" && e.task_id != holder.task_id
    })
    .await;
    // When the slot frees, the chat that came later goes first.
    let next =
        next_event(&mut events, "the next grant", |e| e.state == TaskState::Dispatching && e.task_id != holder.task_id)
            .await;
    assert_eq!(next.task_id, queued_chat.task_id, "the chat is granted before the embeddings queued before it");
    for h in [first, second, embedding] {
        assert_eq!(h.await.unwrap(), 200);
    }
    gw.stop().await;
}

#[tokio::test]
async fn the_task_events_show_one_embedding_per_input() {
    let chat = FakeEngine::start().await;
    let emb = FakeEngine::start().await;
    let gw = TestGateway::with_engine(&chat.url(), "openai", &embed_section(&emb.url(), "openai", "")).await;
    gw.wait_ready().await;
    let (status, v) =
        post(&gw, "/v1/embeddings", Some(DEMO_KEY), &json!({"model": "embed", "input": ["a", "b"]})).await;
    assert_eq!(status, 200, "{v}");
    let task_id = v["edge"]["task_id"].as_str().unwrap();
    let resp =
        client().get(format!("{}/v1/tasks/{task_id}/events", gw.base_url)).bearer_auth(DEMO_KEY).send().await.unwrap();
    let (events, _) = read_sse(resp).await;
    let types: Vec<_> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(types, ["accepted", "embedding", "embedding", "done"], "{events:?}");
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("topics/schemas/event-embedding.json");
    let schema: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    let validator = jsonschema::validator_for(&schema).unwrap();
    for (i, e) in events[1..3].iter().enumerate() {
        assert!(validator.is_valid(e), "{e}");
        assert_eq!(e["index"], i);
        assert_eq!(floats(&e["embedding"]), floats(&v["data"][i]["embedding"]));
    }
    gw.stop().await;
}

/// Review M6: an embedding call that outlasts the gateway's first-token
/// limit says nothing about the instance (a big batch is slow anywhere):
/// it is not retried on every instance, each counted failed, which would
/// open every embedding instance's breaker; the task ends with the timeout.
#[tokio::test]
async fn an_embedding_timeout_is_not_an_instance_failure() {
    let chat = FakeEngine::start().await;
    let slow = || Knobs { first_token_delay: Duration::from_millis(1500), ..Knobs::default() };
    let a = FakeEngine::start_with(slow()).await;
    let b = FakeEngine::start_with(slow()).await;
    let section =
        embed_section(&a.url(), "openai", "").replace("instances = [\"emb\"]", "instances = [\"emb\", \"emb2\"]")
            + &format!(
            "[engines.emb2]\ntype = \"openai\"\nbase_url = \"{}\"\nmodel = \"fake-embed\"\nhealth_interval_ms = 100\n",
            b.url()
        ) + "[timeouts]\nfirst_token_ms = 300\n";
    let gw = TestGateway::with_engine(&chat.url(), "openai", &section).await;
    gw.wait_ready().await;
    let inputs: Vec<String> = (0..64).map(|i| format!("input {i}")).collect();
    let (status, v) = post(&gw, "/v1/embeddings", Some(DEMO_KEY), &json!({"model": "embed", "input": inputs})).await;
    assert_eq!(status, 504, "{v}");
    assert_eq!(a.requests() + b.requests(), 1, "one engine call, not one per instance: {v}");
    gw.stop().await;
}

/// The `input` lists the engine was sent, call by call.
fn sent_inputs(engine: &FakeEngine) -> Vec<Vec<String>> {
    engine
        .bodies()
        .iter()
        .map(|b| b["input"].as_array().unwrap().iter().map(|s| s.as_str().unwrap().to_string()).collect())
        .collect()
}

fn numbered(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("text number {i}")).collect()
}

/// Issue 17, "batched per engine": a list longer than the model's
/// `max_batch_inputs` goes to the engine in calls of that many, in order,
/// within one task; the answer is the concatenation (each `index` the
/// input's), usage the sum.
#[tokio::test]
async fn a_long_list_is_split_into_engine_calls_in_input_order() {
    let chat = FakeEngine::start().await;
    let emb = FakeEngine::start().await;
    let section = embed_section(&emb.url(), "openai", "max_batch_inputs = 4");
    let gw = TestGateway::with_engine(&chat.url(), "openai", &section).await;
    gw.wait_ready().await;
    let inputs = numbered(10);
    let (status, v) = post(&gw, "/v1/embeddings", Some(DEMO_KEY), &json!({"model": "embed", "input": inputs})).await;
    assert_eq!(status, 200, "{v}");
    let calls = sent_inputs(&emb);
    assert_eq!(calls, vec![inputs[0..4].to_vec(), inputs[4..8].to_vec(), inputs[8..10].to_vec()]);
    let data = v["data"].as_array().unwrap();
    assert_eq!(data.len(), 10);
    for (i, d) in data.iter().enumerate() {
        assert_eq!(d["index"], i, "{v}");
        assert_eq!(floats(&d["embedding"]), fake_embedding(&inputs[i], 8), "input {i}");
    }
    // Three words an input, as the fake counts tokens, over all calls.
    assert_eq!(v["usage"], json!({"prompt_tokens": 30, "total_tokens": 30}));
    assert_eq!(v["edge"]["route"]["attempts"], 1, "one task, one attempt: {v}");
    // The task's own events are numbered the same way.
    let task_id = v["edge"]["task_id"].as_str().unwrap();
    let resp =
        client().get(format!("{}/v1/tasks/{task_id}/events", gw.base_url)).bearer_auth(DEMO_KEY).send().await.unwrap();
    let (events, _) = read_sse(resp).await;
    let indexes: Vec<u64> =
        events.iter().filter(|e| e["type"] == "embedding").map(|e| e["index"].as_u64().unwrap()).collect();
    assert_eq!(indexes, (0..10).collect::<Vec<u64>>());

    gw.stop().await;
}

/// A call that fails in the middle of a list is retried (the usual retry
/// rules) from its own first input: finished calls are not sent again.
#[tokio::test]
async fn a_failed_call_is_retried_from_its_offset_without_redoing_finished_ones() {
    let chat = FakeEngine::start().await;
    let emb = FakeEngine::start_with(Knobs { fail_requests: vec![2], ..Knobs::default() }).await;
    let section = embed_section(&emb.url(), "openai", "max_batch_inputs = 4");
    let gw = TestGateway::with_engine(&chat.url(), "openai", &section).await;
    gw.wait_ready().await;
    let inputs = numbered(10);
    let (status, v) = post(&gw, "/v1/embeddings", Some(DEMO_KEY), &json!({"model": "embed", "input": inputs})).await;
    assert_eq!(status, 200, "{v}");
    let calls = sent_inputs(&emb);
    assert_eq!(
        calls,
        vec![inputs[0..4].to_vec(), inputs[4..8].to_vec(), inputs[4..8].to_vec(), inputs[8..10].to_vec()],
        "only the failed call is sent again"
    );
    let data = v["data"].as_array().unwrap();
    assert_eq!(data.len(), 10, "{v}");
    for (i, d) in data.iter().enumerate() {
        assert_eq!((d["index"].as_u64(), floats(&d["embedding"])), (Some(i as u64), fake_embedding(&inputs[i], 8)));
    }
    assert_eq!(v["usage"]["prompt_tokens"], 30, "the failed call counts nothing");
    assert_eq!(v["edge"]["route"]["attempts"], 2, "{v}");
    gw.stop().await;
}

/// A cancel (here: the client goes away) between calls stops the rest of
/// the list: no further call reaches the engine.
#[tokio::test]
async fn a_cancel_stops_the_remaining_calls() {
    let chat = FakeEngine::start().await;
    let emb = FakeEngine::start_with(Knobs { first_token_delay: Duration::from_millis(400), ..Knobs::default() }).await;
    let section = embed_section(&emb.url(), "openai", "max_batch_inputs = 2");
    let gw = TestGateway::with_engine(&chat.url(), "openai", &section).await;
    gw.wait_ready().await;
    let mut events = gw.recorder().subscribe();
    let request = tokio::spawn({
        let url = gw.base_url.clone();
        async move {
            client()
                .post(format!("{url}/v1/embeddings"))
                .bearer_auth(DEMO_KEY)
                .json(&json!({"model": "embed", "input": numbered(12)}))
                .send()
                .await
        }
    });
    // The second call is under way: the client goes away.
    assert!(emb.wait_for(Duration::from_secs(10), |s| s.requests.load(std::sync::atomic::Ordering::SeqCst) >= 2).await);
    request.abort();
    let end = next_event(&mut events, "the task ends", |e| e.state.is_terminal()).await;
    assert_eq!(end.state, TaskState::Cancelled, "{end:?}");
    assert_eq!(emb.requests(), 2, "no call after the cancel");
    gw.stop().await;
}

/// Review 13 HIGH-4: a list whose call 2 failed used to be moved to the
/// model's fallback (another model, another vector space, here another
/// dimension) for the rest of its inputs, so one answer mixed vectors of
/// two models. A part-answered list stays on its model: the failed call is
/// retried there (the same instance after the back-off) and every vector
/// comes from it.
#[tokio::test]
async fn a_list_retried_after_a_call_answered_stays_on_its_model_and_one_dimension() {
    let chat = FakeEngine::start().await;
    let emb = FakeEngine::start_with(Knobs { fail_requests: vec![2], ..Knobs::default() }).await;
    let small = FakeEngine::start_with(Knobs { embedding_dim: 4, ..Knobs::default() }).await;
    let mut section = embed_section(&emb.url(), "openai", "max_batch_inputs = 4\nfallback_models = [\"embed-small\"]");
    section.push_str(&format!(
        "[engines.emb-small]\ntype = \"openai\"\nbase_url = \"{}\"\nmodel = \"fake-embed\"\nhealth_interval_ms = 100\n\
         [models.embed-small]\nkind = \"embedding\"\ninstances = [\"emb-small\"]\ncontext_tokens = 512\nmax_batch_inputs = 4\n",
        small.url()
    ));
    // The demo application may take a smaller model (the fallback step).
    let allow =
        |t: String| t.replacen("default_priority = \"P2\"", "default_priority = \"P2\"\nallow_smaller_model = true", 1);
    let gw = TestGateway::with_engine_edit(&chat.url(), "openai", &section, allow).await;
    gw.wait_ready().await;
    let inputs = numbered(10);
    let (status, v) = post(&gw, "/v1/embeddings", Some(DEMO_KEY), &json!({"model": "embed", "input": inputs})).await;
    assert_eq!(status, 200, "{v}");
    let data = v["data"].as_array().unwrap();
    assert_eq!(data.len(), 10, "{v}");
    let dims: Vec<usize> = data.iter().map(|d| floats(&d["embedding"]).len()).collect();
    assert_eq!(dims, vec![8; 10], "every vector from the model that answered the first call");
    for (i, d) in data.iter().enumerate() {
        assert_eq!(floats(&d["embedding"]), fake_embedding(&inputs[i], 8));
    }
    assert_eq!(small.requests(), 0, "the fallback model never answered part of the list");
    gw.stop().await;
}
