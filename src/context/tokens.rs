//! Exact token counts from the engine's own tokenizer (FR-3.2): for a
//! logical model with a llama-server instance configured `tokenize = true`,
//! prompt assembly counts every text with the engine's `POST /tokenize`
//! and the chat template's own tokens with `POST /apply-template`, instead
//! of the byte estimate (`super::estimate_message`).
//!
//! **Cache.** A count is kept per engine instance, keyed by a keyed hash
//! of the text, in a bounded LRU ([`CACHE_ENTRIES`]): a session's turns
//! are tokenized once, when they first enter a prompt, never again on the
//! next turns. The template's overhead (tokens per message and per prompt)
//! is measured once per instance, with two probe conversations.
//!
//! **Deadline.** The engine is asked only for texts the cache lacks, all
//! of them at once (a few in flight), within [`TOKENIZE_DEADLINE`] in all;
//! a cached prompt asks nothing. A text the engine did not count in time
//! (down, slow, an error) is estimated, and the plan says `exact: false`;
//! the call goes on either way, and the engine is not asked again for
//! [`TOKENIZER_PAUSE`].
//!
//! **Two passes.** The assembly is synchronous and its ladder decides on
//! counts, and the texts it counts (fenced blocks, a shortened passage)
//! exist only inside it. So [`Tokenizers::assemble`] runs it once on a
//! copy to learn which texts it counts that are not cached, has the engine
//! count them, then runs it for real with the same fence id: every count
//! then comes from the cache.
//!
//! **Which engine.** The first instance of the model, in its configured
//! order, with `tokenize = true`, not in the cloud and allowed the task's
//! data class: counting sends the text to that engine, so it must be one
//! the task's text may go to.
//!
//! Owns: the token caches and the tokenizer calls' timing. Does not own:
//! the HTTP calls themselves (`crate::engine::openai::{tokenize,
//! apply_template}`) or what the counts decide (`super::assembly`).
//! Counting is per text: the tokens where two texts join (a message's
//! parts, blocks joined by blank lines) may differ by one from the count of
//! the joined text, which the window's safety margin covers.

use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasher, RandomState};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use serde_json::Value;

use super::assembly::{self, Count, Inputs, Plan, Rules};
use crate::config::{Config, EngineConfig};
use crate::error::GatewayError;
use crate::task::{ChatMessage, Location, TaskRequest};

/// Counts kept per engine instance.
pub const CACHE_ENTRIES: usize = 16_384;
/// The most the engine's counting may add to a call's assembly.
pub const TOKENIZE_DEADLINE: Duration = Duration::from_millis(300);
/// Tokenizer requests in flight at once per call.
const IN_FLIGHT: usize = 8;
/// After the tokenizer failed or missed the deadline, calls use the
/// estimate this long without asking it: a broken or overloaded engine
/// must not cost every call the deadline.
pub const TOKENIZER_PAUSE: Duration = Duration::from_secs(30);

/// The chat template's own tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Overhead {
    /// Role markers and separators of one message.
    pub per_message: u32,
    /// Once per prompt (BOS, the generation prompt).
    pub per_prompt: u32,
}

/// A bounded least-recently-used map from a text's hash to its count.
#[derive(Default)]
struct Lru {
    /// hash -> (count, last use)
    map: HashMap<u64, (u32, u64)>,
    /// last use -> hash, oldest first.
    order: BTreeMap<u64, u64>,
    tick: u64,
}

impl Lru {
    fn get(&mut self, key: u64) -> Option<u32> {
        let (count, used) = self.map.get_mut(&key)?;
        self.order.remove(used);
        self.tick += 1;
        *used = self.tick;
        self.order.insert(self.tick, key);
        Some(*count)
    }

    fn insert(&mut self, key: u64, count: u32) {
        self.tick += 1;
        if let Some((_, used)) = self.map.insert(key, (count, self.tick)) {
            self.order.remove(&used);
        }
        self.order.insert(self.tick, key);
        while self.map.len() > CACHE_ENTRIES {
            let Some((_, oldest)) = self.order.pop_first() else { break };
            self.map.remove(&oldest);
        }
    }
}

/// One engine instance's tokenizer: where to ask, and what it said.
struct Engine {
    cfg: EngineConfig,
    counts: Mutex<Lru>,
    overhead: Mutex<Option<Overhead>>,
    /// Not asked until then ([`TOKENIZER_PAUSE`]).
    paused_until: Mutex<Option<tokio::time::Instant>>,
}

impl Engine {
    fn paused(&self) -> bool {
        self.paused_until.lock().expect("pause").is_some_and(|t| tokio::time::Instant::now() < t)
    }

    fn pause(&self) {
        *self.paused_until.lock().expect("pause") = Some(tokio::time::Instant::now() + TOKENIZER_PAUSE);
    }
}

/// The tokenizers of the configured engines and their caches. One per
/// gateway; a reload that changes an engine's address or model starts its
/// cache afresh.
pub struct Tokenizers {
    client: Option<reqwest::Client>,
    hasher: RandomState,
    engines: Mutex<HashMap<String, Arc<Engine>>>,
}

impl Default for Tokenizers {
    fn default() -> Self {
        Tokenizers::new()
    }
}

impl Tokenizers {
    pub fn new() -> Tokenizers {
        let client = crate::engine::http_client(Duration::from_millis(200)).ok();
        Tokenizers { client, hasher: RandomState::new(), engines: Mutex::default() }
    }

    fn key(&self, text: &str) -> u64 {
        self.hasher.hash_one(text)
    }

    /// The tokenizer that counts `req`'s prompt, if its model has one the
    /// task's text may go to.
    fn engine_for(&self, cfg: &Config, req: &TaskRequest) -> Option<Arc<Engine>> {
        let model = cfg.models.get(&req.logical_model)?;
        let e = model
            .instances
            .iter()
            .filter_map(|n| cfg.engines.get(n))
            .find(|e| e.tokenize && e.location != Location::Cloud && req.data_class <= e.max_data_class)?;
        let mut engines = self.engines.lock().expect("tokenizers");
        let known = engines.get(&e.name).filter(|k| k.cfg.base_url == e.base_url && k.cfg.model == e.model);
        if let Some(k) = known {
            return Some(k.clone());
        }
        let fresh = Arc::new(Engine {
            cfg: e.clone(),
            counts: Mutex::default(),
            overhead: Mutex::new(None),
            paused_until: Mutex::new(None),
        });
        engines.insert(e.name.clone(), fresh.clone());
        Some(fresh)
    }

    /// [`assembly::assemble`] with the engine's counts where `req`'s model
    /// has a tokenizer (see the module doc), else with the estimate.
    pub async fn assemble(
        &self,
        cfg: &Config,
        req: &mut TaskRequest,
        inputs: Inputs<'_>,
        rules: &Rules<'_>,
    ) -> Result<Plan, GatewayError> {
        let engine = self.engine_for(cfg, req).filter(|e| !e.paused());
        let (Some(engine), Some(client)) = (engine, self.client.as_ref()) else {
            return assembly::assemble(req, inputs, rules);
        };
        let deadline = tokio::time::Instant::now() + TOKENIZE_DEADLINE;
        let cached = *engine.overhead.lock().expect("overhead");
        let overhead = match cached {
            Some(o) => Some(o),
            None => tokio::time::timeout_at(deadline, self.measure(client, &engine)).await.ok().flatten(),
        };
        let Some(overhead) = overhead else {
            tracing::debug!(engine = %engine.cfg.name, "tokenizer unavailable; counts are estimated");
            engine.pause();
            return assembly::assemble(req, inputs, rules);
        };
        // Both passes fence with one id: the session's where it has one.
        let fence_id = inputs
            .fence_id
            .clone()
            .or_else(|| rules.fence_id.map(str::to_string))
            .unwrap_or_else(super::fence::new_fence_id);
        let counter = Counter { tokenizers: self, engine: &engine, overhead, misses: Mutex::default() };
        let rules = Rules { fence_id: Some(&fence_id), counter: Some(&counter), ..*rules };
        // Pass 1, on a copy: which texts are not counted yet.
        let mut copy = req.clone();
        let _ = assembly::assemble(&mut copy, inputs.clone(), &rules);
        let misses = std::mem::take(&mut *counter.misses.lock().expect("misses"));
        if !misses.is_empty() {
            let fill = self.fill(client, &engine, misses);
            if !tokio::time::timeout_at(deadline, fill).await.unwrap_or(false) {
                tracing::debug!(engine = %engine.cfg.name, "tokenizer failed or too slow; some counts are estimated");
                engine.pause();
            }
        }
        assembly::assemble(req, inputs, &rules)
    }

    /// Counts `texts` with the engine, a few at a time, caching each count
    /// as it comes (a deadline that cuts this short keeps those). Whether
    /// every one was counted.
    async fn fill(&self, client: &reqwest::Client, engine: &Engine, texts: Vec<String>) -> bool {
        let mut unique: Vec<(u64, String)> = Vec::with_capacity(texts.len());
        for t in texts {
            let k = self.key(&t);
            if !unique.iter().any(|(u, _)| *u == k) {
                unique.push((k, t));
            }
        }
        let limit = TOKENIZE_DEADLINE;
        let failed = std::sync::atomic::AtomicBool::new(false);
        futures::stream::iter(unique)
            .for_each_concurrent(IN_FLIGHT, |(k, t)| {
                let failed = &failed;
                async move {
                    match crate::engine::openai::tokenize(client, &engine.cfg, &t, false, limit).await {
                        Ok(n) => engine.counts.lock().expect("counts").insert(k, n),
                        Err(e) => {
                            failed.store(true, std::sync::atomic::Ordering::Relaxed);
                            tracing::debug!(engine = %engine.cfg.name, error = %e, "tokenize failed");
                        }
                    }
                }
            })
            .await;
        !failed.into_inner()
    }

    /// The template's overhead: the tokens of two templated probe
    /// conversations (one message, three) less their contents' own.
    async fn measure(&self, client: &reqwest::Client, engine: &Engine) -> Option<Overhead> {
        let m = |role: &str, text: &str| ChatMessage {
            role: role.into(),
            content: Value::String(text.into()),
            extra: Default::default(),
        };
        let one = vec![m("user", "Hello")];
        let three = vec![m("user", "Hello"), m("assistant", "Hi there"), m("user", "Thanks")];
        let limit = TOKENIZE_DEADLINE;
        let templated = |msgs: Vec<ChatMessage>| async move {
            let p = crate::engine::openai::apply_template(client, &engine.cfg, &msgs, limit).await?;
            crate::engine::openai::tokenize(client, &engine.cfg, &p, true, limit).await
        };
        let plain = |t: &'static str| crate::engine::openai::tokenize(client, &engine.cfg, t, false, limit);
        let r =
            futures::try_join!(templated(one), templated(three), plain("Hello"), plain("Hi there"), plain("Thanks"));
        let (t1, t3, hello, hi, thanks) = match r {
            Ok(v) => v,
            Err(e) => {
                tracing::debug!(engine = %engine.cfg.name, error = %e, "cannot measure the chat template");
                return None;
            }
        };
        let per_message = t3.checked_sub(t1 + hi + thanks)?.div_ceil(2);
        let per_prompt = t1.saturating_sub(hello + per_message);
        let o = Overhead { per_message, per_prompt };
        *engine.overhead.lock().expect("overhead") = Some(o);
        Some(o)
    }
}

/// The assembly's view of one engine's cache during one call: counts it
/// has, and the texts it lacks (for the engine to count).
struct Counter<'a> {
    tokenizers: &'a Tokenizers,
    engine: &'a Engine,
    overhead: Overhead,
    misses: Mutex<Vec<String>>,
}

impl Count for Counter<'_> {
    fn count(&self, text: &str) -> Option<u32> {
        if text.is_empty() {
            return Some(0);
        }
        let hit = self.engine.counts.lock().expect("counts").get(self.tokenizers.key(text));
        if hit.is_none() {
            self.misses.lock().expect("misses").push(text.to_string());
        }
        hit
    }

    fn per_message(&self) -> u32 {
        self.overhead.per_message
    }

    fn per_prompt(&self) -> u32 {
        self.overhead.per_prompt
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cache_keeps_the_most_recently_used_counts() {
        let mut lru = Lru::default();
        for k in 0..CACHE_ENTRIES as u64 {
            lru.insert(k, k as u32);
        }
        // 0 used again: 1 is now the oldest and goes first.
        assert_eq!(lru.get(0), Some(0));
        lru.insert(u64::MAX, 7);
        assert_eq!(lru.map.len(), CACHE_ENTRIES);
        assert_eq!(lru.get(1), None);
        assert_eq!((lru.get(0), lru.get(2), lru.get(u64::MAX)), (Some(0), Some(2), Some(7)));
        assert_eq!(lru.order.len(), lru.map.len());
    }
}
