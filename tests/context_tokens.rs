//! Token counts from the engine's own tokenizer (issue 12, FR-3.2), over
//! HTTP against the fake engine, whose `/tokenize` counts one token per
//! word (plus BOS with special tokens) and whose `/apply-template` adds two
//! marker words per message and one for the answer: with the engine's
//! counts a message is its words + 2 and a prompt 2 more. Checked: the
//! counts and `edge.context.exact: true`; a session's turns are tokenized
//! once, not again on later turns; a failing or slow tokenizer leaves the
//! estimate, `exact: false`, and the call goes on within the deadline.
//! The larger-window switch, for a session turn and for a call without a
//! session that does not fit (which otherwise loses its oldest turns, per
//! its `context_policy`); a call that fits is neither assembled nor
//! tokenized.

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

/// The fake engine with `tokenize = true` on its instance.
async fn gateway(knobs: Knobs) -> (FakeEngine, TestGateway) {
    let fake = FakeEngine::start_with(knobs).await;
    let gw = TestGateway::with_engine_edit(&fake.url(), "openai", "", |t| {
        t.replace("model = \"fake-model\"\n", "model = \"fake-model\"\ntokenize = true\n")
    })
    .await;
    gw.wait_ready().await;
    (fake, gw)
}

async fn session(gw: &TestGateway) -> String {
    let resp = client().post(format!("{}/v1/sessions", gw.base_url)).bearer_auth(DEMO_KEY).json(&json!({})).send();
    let v: Value = resp.await.unwrap().json().await.unwrap();
    v["id"].as_str().unwrap().to_string()
}

async fn turn(gw: &TestGateway, id: &str, text: &str) -> Value {
    let body = json!({"model": "general-chat", "session_id": id, "max_tokens": 20,
                      "messages": [{"role": "user", "content": text}]});
    let resp = post_chat(gw, DEMO_KEY, &body).await;
    assert_eq!(resp.status(), 200);
    resp.json().await.unwrap()
}

#[tokio::test]
async fn counts_come_from_the_engines_tokenizer_and_a_turn_is_tokenized_once() {
    let (fake, gw) = gateway(Knobs { tokens: 3, token_text: "w ".into(), ..Knobs::default() }).await;
    let id = session(&gw).await;

    let v = turn(&gw, &id, "how hot is pump three").await;
    let ctx = &v["edge"]["context"];
    assert_eq!(ctx["exact"], true, "{v}");
    // 5 words, 2 template tokens for the message, 2 for the prompt.
    assert_eq!(ctx["tokens"]["request"], 9, "{ctx}");
    let first = fake.tokenized();
    assert!(first.iter().any(|t| t == "how hot is pump three"), "{first:?}");

    // The next turn: only its own question and the last answer are new;
    // the first question is counted from the cache.
    let v = turn(&gw, &id, "and pump four").await;
    let ctx = &v["edge"]["context"];
    assert_eq!(ctx["exact"], true, "{v}");
    let answer = v["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    let new: Vec<String> = fake.tokenized()[first.len()..].to_vec();
    let mut want = vec![answer.clone(), "and pump four".to_string()];
    want.sort();
    let mut got = new.clone();
    got.sort();
    assert_eq!(got, want, "tokenized on the second turn: {new:?}");
    // The two turns: 5 + 2 and the answer's words + 2.
    let answer_words = answer.split_whitespace().count() as u64;
    assert_eq!(ctx["tokens"]["turns"], 7 + answer_words + 2, "{ctx}");
    assert_eq!(ctx["tokens"]["request"], 3 + 2 + 2, "{ctx}");

    // A third turn: nothing of the history again (the last answer is the
    // same text as the first, counted already).
    let before = fake.tokenized().len();
    let v = turn(&gw, &id, "thanks").await;
    assert_eq!(v["edge"]["context"]["exact"], true, "{v}");
    assert_eq!(v["edge"]["context"]["tokens"]["turns"], 7 + (answer_words + 2) + 5 + (answer_words + 2), "{v}");
    assert_eq!(fake.tokenized()[before..], ["thanks".to_string()]);
    gw.stop().await;
}

fn tokenize_posts(fake: &FakeEngine) -> usize {
    fake.posts().iter().filter(|p| p.as_str() == "/tokenize" || p.as_str() == "/apply-template").count()
}

#[tokio::test]
async fn a_failing_tokenizer_leaves_the_estimate_and_is_left_alone_a_while() {
    let (fake, gw) = gateway(Knobs { tokenize_status: Some(500), ..Knobs::default() }).await;
    let id = session(&gw).await;
    let v = turn(&gw, &id, "how hot is pump three").await;
    let ctx = &v["edge"]["context"];
    assert_eq!(ctx["exact"], false, "{v}");
    // The estimate: 4 per message + 2 per prompt + 21 bytes * 2 / 7.
    assert_eq!(ctx["tokens"]["request"], 4 + 2 + 6, "{ctx}");
    assert!(tokenize_posts(&fake) > 0);

    // Working again, but within the pause: not asked.
    let asked = tokenize_posts(&fake);
    fake.set(|k| k.tokenize_status = None);
    let v = turn(&gw, &id, "and pump four").await;
    assert_eq!(v["edge"]["context"]["exact"], false, "{v}");
    assert_eq!(tokenize_posts(&fake), asked);
    gw.stop().await;
}

#[tokio::test]
async fn a_slow_tokenizer_does_not_hold_the_call_past_its_deadline() {
    let (_fake, gw) = gateway(Knobs { tokenize_delay: Duration::from_secs(5), ..Knobs::default() }).await;
    let id = session(&gw).await;
    let started = Instant::now();
    let v = turn(&gw, &id, "how hot is pump three").await;
    assert_eq!(v["edge"]["context"]["exact"], false, "{v}");
    // The deadline is 300 ms; the rest is room for a loaded machine.
    assert!(started.elapsed() < Duration::from_secs(3), "{:?}", started.elapsed());
    gw.stop().await;
}

/// `general-chat` with a 512-token window naming `big-chat` (8192 tokens)
/// as its larger-window model, served by instance `far` (an edge node:
/// sensitive data at most) on the same fake engine.
async fn two_windows() -> (FakeEngine, TestGateway) {
    let fake = FakeEngine::start().await;
    let extra = "larger_window_model = \"big-chat\"\n\n[models.big-chat]\ninstances = [\"far\"]\ncontext_tokens = 8192\nmax_output_tokens = 256\n";
    let url = fake.url();
    let gw = TestGateway::with_engine_edit(&fake.url(), "openai", extra, move |t| {
        let far = format!(
            "[engines.far]\ntype = \"openai\"\nbase_url = \"{url}\"\nmodel = \"fake-model\"\nmax_concurrency = 2\n\
             health_interval_ms = 100\nlocation = \"edge-node\"\n\n[models.general-chat]"
        );
        t.replace("context_tokens = 2048", "context_tokens = 512").replace("[models.general-chat]", &far)
    })
    .await;
    gw.wait_ready().await;
    (fake, gw)
}

/// A session whose first turn is a pinned question of about 450 tokens:
/// it fits 512 alone, but the next question does not fit beside it.
async fn pinned_session(gw: &TestGateway, routing: &Value) -> String {
    let id = session(gw).await;
    let body = json!({"model": "general-chat", "session_id": id, "max_tokens": 20, "routing": routing,
                      "messages": [{"role": "user", "content": "p ".repeat(775), "pinned": true}]});
    let resp = post_chat(gw, DEMO_KEY, &body).await;
    assert_eq!(resp.status(), 200, "{:?}", resp.text().await);
    id
}

fn second_turn(id: &str, routing: &Value) -> Value {
    json!({"model": "general-chat", "session_id": id, "max_tokens": 20, "routing": routing,
           "messages": [{"role": "user", "content": "and now, what about the second pump in the east hall?"}]})
}

#[tokio::test]
async fn a_prompt_too_large_after_trimming_goes_to_the_larger_window_model() {
    let (fake, gw) = two_windows().await;
    let routing = json!({});
    let id = pinned_session(&gw, &routing).await;
    let resp = post_chat(&gw, DEMO_KEY, &second_turn(&id, &routing)).await;
    assert_eq!(resp.status(), 200);
    let v: Value = resp.json().await.unwrap();
    let ctx = &v["edge"]["context"];
    let steps = ctx["steps"].as_array().unwrap();
    assert!(
        steps[0].as_str().unwrap().starts_with(
            "switched to model 'big-chat' (8192 tokens): the prompt does not fit 'general-chat' (512 tokens)"
        ),
        "{ctx}"
    );
    assert_eq!(ctx["budget"]["window"], 8192, "{ctx}");
    assert_eq!(v["edge"]["logical_model"], "big-chat", "the result names the model used: {v}");
    // The whole conversation went, the pinned question first.
    let sent = fake.last_request().unwrap();
    let messages = sent["messages"].as_array().unwrap();
    assert_eq!(messages.len(), 3, "{sent}");
    assert!(messages[0]["content"].as_str().unwrap().starts_with("p p p"));
    gw.stop().await;
}

#[tokio::test]
async fn the_switch_never_takes_data_where_its_class_may_not_go() {
    let (fake, gw) = two_windows().await;
    // Secret data: `far`, an edge node, may not have it.
    let routing = json!({"local_only": true});
    let id = pinned_session(&gw, &routing).await;
    let before = fake.requests();
    let resp = post_chat(&gw, DEMO_KEY, &second_turn(&id, &routing)).await;
    assert_eq!(resp.status(), 413);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(error_code(&v), "CONTEXT_TOO_LARGE", "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("'general-chat'"), "{v}");
    assert_eq!(fake.requests(), before);
    gw.stop().await;
}

/// Issue 12, oversized plain calls: a call without a session or
/// `edge.context` whose own question does not fit its model (about 580
/// tokens by the estimate, for a 512-token window) was refused at
/// admission, so it never reached the larger-window model. Now it goes
/// there, whole. A call that fits is not assembled at all.
#[tokio::test]
async fn a_plain_call_too_large_for_its_model_goes_to_the_larger_window_model() {
    let (fake, gw) = two_windows().await;
    let question = "p ".repeat(1000);
    let body = json!({"model": "general-chat", "max_tokens": 20, "messages": [{"role": "user", "content": question}]});
    let resp = post_chat(&gw, DEMO_KEY, &body).await;
    let status = resp.status();
    let v: Value = resp.json().await.unwrap();
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["edge"]["logical_model"], "big-chat", "{v}");
    let steps = v["edge"]["context"]["steps"].as_array().unwrap();
    assert!(steps[0].as_str().unwrap().starts_with("switched to model 'big-chat' (8192 tokens)"), "{v}");
    assert_eq!(steps.len(), 1, "nothing trimmed: {v}");
    let sent = fake.last_request().unwrap();
    assert_eq!(sent["messages"], json!([{"role": "user", "content": question}]), "sent whole");

    let body = json!({"model": "general-chat", "max_tokens": 20, "messages": [{"role": "user", "content": "hi"}]});
    let v: Value = post_chat(&gw, DEMO_KEY, &body).await.json().await.unwrap();
    assert_eq!(v["edge"]["logical_model"], "general-chat", "{v}");
    assert!(v["edge"]["context"].is_null(), "a call that fits is not assembled: {v}");
    gw.stop().await;
}

/// The same call where the switch may not take its data (`local_only`):
/// under `context_policy` "auto" (the default) its earlier turns are
/// trimmed as a session's are, oldest first, its question and system
/// message kept; "disabled" refuses it `CONTEXT_TOO_LARGE`; another value
/// is `INVALID_REQUEST`. Before, all three were refused at admission (the
/// field was read by nobody).
#[tokio::test]
async fn a_plain_call_that_may_not_switch_loses_its_oldest_turns_unless_its_policy_says_no() {
    let (fake, gw) = two_windows().await;
    let mut body = json!({"model": "general-chat", "max_tokens": 20, "routing": {"local_only": true}, "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "o ".repeat(900)}, {"role": "assistant", "content": "noted"},
        {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"},
        {"role": "user", "content": "and the east hall?"}]});
    let resp = post_chat(&gw, DEMO_KEY, &body).await;
    let status = resp.status();
    let v: Value = resp.json().await.unwrap();
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["edge"]["logical_model"], "general-chat", "{v}");
    assert_eq!(v["edge"]["context"]["steps"], json!(["dropped the 2 oldest messages (no pinned state)"]), "{v}");
    let sent = fake.last_request().unwrap();
    let contents: Vec<&str> =
        sent["messages"].as_array().unwrap().iter().map(|m| m["content"].as_str().unwrap()).collect();
    assert_eq!(contents, ["You are terse.", "q2", "a2", "and the east hall?"]);

    let calls = fake.requests();
    body["context_policy"] = json!("disabled");
    let resp = post_chat(&gw, DEMO_KEY, &body).await;
    assert_eq!(resp.status(), 413);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(error_code(&v), "CONTEXT_TOO_LARGE", "{v}");
    body["context_policy"] = json!("sometimes");
    let resp = post_chat(&gw, DEMO_KEY, &body).await;
    assert_eq!(resp.status(), 400);
    let v: Value = resp.json().await.unwrap();
    assert!(v["error"]["message"].as_str().unwrap().contains("'context_policy'"), "{v}");
    assert_eq!(fake.requests(), calls, "refused calls never reach the engine");
    gw.stop().await;
}

/// Only a call that does not fit by admission's estimate is assembled, so
/// the common call that fits asks the tokenizer nothing. One whose
/// estimate is too large (long words: 8800 bytes) may fit by the engine's
/// count (800 words): it is counted, and runs untrimmed.
#[tokio::test]
async fn a_plain_call_that_fits_is_not_tokenized_and_one_over_the_estimate_is_counted() {
    let (fake, gw) = gateway(Knobs::default()).await;
    let body = json!({"model": "general-chat", "max_tokens": 20, "messages": [{"role": "user", "content": "hello"}]});
    let v: Value = post_chat(&gw, DEMO_KEY, &body).await.json().await.unwrap();
    assert!(v["edge"]["context"].is_null(), "{v}");
    assert_eq!(tokenize_posts(&fake), 0, "{:?}", fake.posts());

    let body = json!({"model": "general-chat", "max_tokens": 20, "messages": [
        {"role": "user", "content": "abcdefghij ".repeat(800)}, {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "and now?"}]});
    let resp = post_chat(&gw, DEMO_KEY, &body).await;
    let status = resp.status();
    let v: Value = resp.json().await.unwrap();
    assert_eq!(status, 200, "{v}");
    let ctx = &v["edge"]["context"];
    assert_eq!((&ctx["exact"], &ctx["steps"]), (&json!(true), &json!([])), "{v}");
    assert!(tokenize_posts(&fake) > 0);
    assert_eq!(fake.last_request().unwrap()["messages"].as_array().unwrap().len(), 3);
    gw.stop().await;
}
