//! The cost of assembling a long session's prompt (issue 12 benchmark):
//! a session of 200 turns (400 messages of 150 to 400 bytes) assembled for
//! its next call, in-process, against the fake engine's tokenizer
//! (`/tokenize`, one token per word):
//!
//! - `estimate`: the byte estimate only (no tokenizer configured);
//! - `engine counts, all cached`: every text counted already (the same
//!   call again): no tokenizer request;
//! - `engine counts, new question`: the usual next turn, whose question
//!   (and last answer) are new: one `/tokenize` round trip each, to the
//!   in-process fake (a real llama-server adds its own tokenizing time).
//!
//! The window (8192) holds only the newest turns, so the ladder runs
//! (oldest turns dropped) as it would for such a session.
//!
//! ```text
//! cargo bench --bench context -- 2000
//! ```

use std::time::{Duration, Instant};

use edgeway::config::Config;
use edgeway::context::assembly::{self, Inputs, Rules};
use edgeway::context::sessions::HistoryMessage;
use edgeway::context::tokens::Tokenizers;
use edgeway::task::{ChatMessage, TaskRequest};
use edgeway::testing::{config_toml, FakeEngine, TempDir};
use serde_json::Value;

const WORDS: &[&str] = &["pump", "valve", "sensor", "pressure", "flow", "tank", "motor", "alarm", "level", "east"];

fn text(seed: usize, bytes: usize) -> String {
    let mut s = format!("turn {seed}:");
    let mut i = seed;
    while s.len() < bytes {
        s.push(' ');
        s.push_str(WORDS[i % WORDS.len()]);
        i = i.wrapping_mul(31).wrapping_add(7);
    }
    s
}

fn msg(role: &str, t: String) -> ChatMessage {
    ChatMessage { role: role.into(), content: Value::String(t), extra: Default::default() }
}

fn pct(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i].as_secs_f64() * 1e6
}

#[tokio::main]
async fn main() {
    let n: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(2000);
    let fake = FakeEngine::start().await;
    let tmp = TempDir::new("edgeway-bench-context");
    let toml = config_toml(&fake.url(), "openai", &tmp.0, "")
        .replace("model = \"fake-model\"\n", "model = \"fake-model\"\ntokenize = true\n")
        .replace("context_tokens = 2048", "context_tokens = 8192");
    let cfg = Config::from_toml_str(&toml, std::iter::empty(), std::path::Path::new(".")).expect("config");
    let history: Vec<HistoryMessage> = (0..400)
        .map(|i| {
            let m = if i % 2 == 0 { msg("user", text(i, 150)) } else { msg("assistant", text(i, 400)) };
            HistoryMessage { tokens: edgeway::context::estimate_message(&m), message: m }
        })
        .collect();
    let rules = Rules { context_tokens: 8192, budget: cfg.models["general-chat"].context_budget, ..Default::default() };
    let request = |i: usize| {
        let mut r = TaskRequest::sample(vec![msg("user", text(100_000 + i, 120))]);
        r.max_output_tokens = 256;
        r.session_id = Some("bench".into());
        r
    };
    let inputs = || Inputs { history: &history, session: Some("bench"), ..Default::default() };
    let tokenizers = Tokenizers::new();
    // Warm, as the session grew: a turn at a time, each counting only its
    // new messages (all 400 at once would not fit the tokenizer deadline).
    for k in (2..=history.len()).step_by(2) {
        let mut warm = request(0);
        let inputs = Inputs { history: &history[..k], session: Some("bench"), ..Default::default() };
        tokenizers.assemble(&cfg, &mut warm, inputs, &rules).await.expect("assemble");
    }
    let mut warm = request(0);
    let plan = tokenizers.assemble(&cfg, &mut warm, inputs(), &rules).await.expect("assemble");
    assert!(plan.exact, "not every count cached after the warm-up: {:?}", plan.steps);
    let used = plan.turns_used;
    let mut inexact = 0;

    let mut rows = Vec::new();
    let mut times = Vec::with_capacity(n);
    for _ in 0..n {
        let mut r = request(0);
        let t = Instant::now();
        let p = assembly::assemble(&mut r, inputs(), &rules).expect("assemble");
        times.push(t.elapsed());
        assert!(!p.exact);
    }
    rows.push(("estimate", std::mem::take(&mut times)));
    for _ in 0..n {
        let mut r = request(0);
        let t = Instant::now();
        let p = tokenizers.assemble(&cfg, &mut r, inputs(), &rules).await.expect("assemble");
        times.push(t.elapsed());
        inexact += usize::from(!p.exact);
    }
    rows.push(("engine counts, all cached", std::mem::take(&mut times)));
    for i in 0..n {
        let mut r = request(i + 1);
        let t = Instant::now();
        let p = tokenizers.assemble(&cfg, &mut r, inputs(), &rules).await.expect("assemble");
        times.push(t.elapsed());
        inexact += usize::from(!p.exact);
    }
    rows.push(("engine counts, new question", std::mem::take(&mut times)));

    println!(
        "200-turn session (400 messages), window 8192: {used} history messages fit; {n} assemblies each; \
         {inexact} of the engine-count assemblies fell back to the estimate"
    );
    println!("| counts | p50 µs | p99 µs | max µs |");
    println!("|---|---|---|---|");
    for (name, mut t) in rows {
        t.sort();
        println!(
            "| {name} | {:.0} | {:.0} | {:.0} |",
            pct(&t, 0.5),
            pct(&t, 0.99),
            t.last().unwrap().as_secs_f64() * 1e6
        );
    }
}
