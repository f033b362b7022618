//! The response cache: the answers of deterministic calls, kept in memory
//! for a while and served again, exactly, to a repeat of the same call by
//! the same tenant, application and user.
//!
//! A call's key is the SHA-256 of its scope (tenant, application, user)
//! and its normalised request: the logical model, the operation, the
//! messages as they go to the engine (after prompt assembly: the system
//! prompt, the session turns, the knowledge passages are in them; the
//! random id of the untrusted-data fence, new for every call without a
//! session, left out), the sampling parameters and the output budget,
//! written as canonical JSON (object keys sorted, no blanks). Two tenants,
//! two applications of one tenant, or two users of one application never
//! share an entry: their scope is hashed with the request (a hit would
//! otherwise tell one user, by its speed and `cache_age_ms`, that another
//! asked the same question, and when). Calls without a user id share the
//! application's entries.
//!
//! Only a call whose answer the request fixes is cached ([`key_for`]): a
//! chat or completion (not embeddings), at `temperature` 0 or with a fixed
//! `seed`, without tools, of a data class up to `[cache] max_data_class`
//! (sensitive and secret data are never cached), and neither its
//! application (`cache = false`) nor the request (`edge.cache: false`)
//! opted out. Only a successful, complete answer of the requested logical
//! model is stored ([`storable`]): not a cancelled or timed-out one, not a
//! canned or cached one, not one cut short by admission (`degraded` at
//! admission), not one with tool calls, and not one of a smaller fallback
//! model (the caller asked for another model; a request naming the smaller
//! model directly is that model's own call and is cached as such).
//!
//! Entries expire after `ttl_s` for fresh hits; the routing chain's cached
//! step (when every engine step failed) may serve one up to `stale_ttl_s`
//! old, marked stale. Past both, or beyond `max_bytes` (least recently used
//! first), an entry is dropped. Settings come with each key from the
//! configuration the call was admitted with, so a reload applies to the
//! next call.
//!
//! Owns: the key, the rules above, the entries and their byte budget, and
//! the `edgeway_cache_*` metrics. Does not own: how a hit is streamed and
//! recorded (the driver, as any answer), or reading `edge.cache` out of a
//! request (the facade calls [`take_edge_flag`]). Nothing here is stored on
//! disk: a restart empties the cache.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prometheus::{IntCounterVec, IntGauge, Opts, Registry};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::config::{CacheConfig, Config};
use crate::error::GatewayError;
use crate::task::{Operation, TaskRequest, Usage};

/// Bytes an entry costs beside its text: the key, the map and LRU slots,
/// the answer's fixed fields. An estimate; it keeps many tiny answers from
/// passing the budget unseen.
const ENTRY_OVERHEAD: usize = 160;

/// The cache settings of one call, from the configuration it was admitted
/// with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settings {
    pub ttl: Duration,
    pub stale_ttl: Duration,
    pub max_bytes: usize,
}

impl Settings {
    fn of(c: &CacheConfig) -> Settings {
        Settings { ttl: c.ttl, stale_ttl: c.stale_ttl, max_bytes: c.max_bytes }
    }

    /// Past this age an entry serves nothing.
    fn horizon(&self) -> Duration {
        self.ttl.max(self.stale_ttl)
    }
}

/// The key of a cacheable call, with the settings it is looked up under.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheKey {
    digest: [u8; 32],
    pub settings: Settings,
}

/// Why a call is not looked up (`edgeway_cache_bypassed_total{reason}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bypass {
    /// Neither `temperature` 0 nor a `seed`.
    Nondeterministic,
    Tools,
    /// Its data class is above `[cache] max_data_class`.
    DataClass,
    /// The request (`edge.cache: false`) or its application (`cache =
    /// false`) opted out.
    OptedOut,
    /// Embeddings are not cached.
    Operation,
}

impl Bypass {
    pub const ALL: [Bypass; 5] =
        [Bypass::Nondeterministic, Bypass::Tools, Bypass::DataClass, Bypass::OptedOut, Bypass::Operation];

    pub fn as_str(self) -> &'static str {
        match self {
            Bypass::Nondeterministic => "nondeterministic",
            Bypass::Tools => "tools",
            Bypass::DataClass => "data_class",
            Bypass::OptedOut => "opted_out",
            Bypass::Operation => "operation",
        }
    }
}

/// What the facade found out about a call, for the scheduler.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup {
    /// The cache is off (`[cache] enabled = false`): nothing is counted.
    Off,
    Bypass(Bypass),
    Key(CacheKey),
}

/// Reads `cache` out of a request's `edge` object (and removes it, so that
/// the rest of `edge` is read as before): `Some(false)` opts the call out,
/// `Some(true)` is the default, anything else is refused.
pub fn take_edge_flag(edge: Option<&mut Value>) -> Result<Option<bool>, GatewayError> {
    let Some(obj) = edge.and_then(Value::as_object_mut) else { return Ok(None) };
    match obj.remove("cache") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(b)),
        Some(_) => Err(GatewayError::invalid("invalid field 'edge.cache': must be true or false")),
    }
}

/// Whether the call `req` of `cfg`'s configuration is looked up, and under
/// which key. `edge_flag` is the request's `edge.cache`.
pub fn key_for(cfg: &Config, req: &TaskRequest, edge_flag: Option<bool>) -> Lookup {
    let c = &cfg.cache;
    if !c.enabled {
        return Lookup::Off;
    }
    let app_allows = cfg.applications.get(&req.identity.application).is_none_or(|a| a.cache);
    if edge_flag == Some(false) || !app_allows {
        return Lookup::Bypass(Bypass::OptedOut);
    }
    if matches!(req.operation, Operation::Embedding { .. }) {
        return Lookup::Bypass(Bypass::Operation);
    }
    if req.tools.is_some() {
        return Lookup::Bypass(Bypass::Tools);
    }
    if req.data_class > c.max_data_class {
        return Lookup::Bypass(Bypass::DataClass);
    }
    let deterministic = req.params.temperature == Some(0.0) || req.params.seed.is_some();
    if !deterministic {
        return Lookup::Bypass(Bypass::Nondeterministic);
    }
    Lookup::Key(CacheKey { digest: digest(req), settings: Settings::of(c) })
}

/// SHA-256 of the scope and the normalised request.
fn digest(req: &TaskRequest) -> [u8; 32] {
    let doc = json!({
        "v": 1,
        "tenant": req.identity.tenant,
        "application": req.identity.application,
        "user": req.identity.user_id,
        "model": req.logical_model,
        "operation": req.operation,
        "messages": without_fence_ids(serde_json::to_value(&req.messages).unwrap_or_default()),
        "params": req.params,
        "max_output_tokens": req.max_output_tokens,
    });
    let mut bytes = Vec::new();
    write_canonical(&doc, &mut bytes);
    Sha256::digest(&bytes).into()
}

/// `v` with the id of every untrusted-data fence marker blanked. A call
/// without a session is fenced with a new random id each time; anything
/// inside a fence that imitates a marker was neutralised by prompt
/// assembly, so what still reads as a marker is one of edgeway's own.
fn without_fence_ids(v: Value) -> Value {
    static MARKER: std::sync::OnceLock<regex::Regex> = std::sync::OnceLock::new();
    let re = MARKER.get_or_init(|| regex::Regex::new(r#"(</?untrusted-data id=")[0-9a-f]{12}(")"#).expect("pattern"));
    match v {
        Value::String(t) if t.contains("untrusted-data id=") => {
            Value::String(re.replace_all(&t, "${1}${2}").into_owned())
        }
        Value::Array(a) => Value::Array(a.into_iter().map(without_fence_ids).collect()),
        Value::Object(m) => Value::Object(m.into_iter().map(|(k, v)| (k, without_fence_ids(v))).collect()),
        other => other,
    }
}

/// JSON with object keys sorted at every level and no blanks, whatever
/// order the value was built in (so the key does not depend on how
/// `serde_json` keeps maps).
fn write_canonical(v: &Value, out: &mut Vec<u8>) {
    match v {
        Value::Object(m) => {
            out.push(b'{');
            let sorted: BTreeMap<&String, &Value> = m.iter().collect();
            for (i, (k, v)) in sorted.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                out.extend(serde_json::to_vec(k).unwrap_or_default());
                out.push(b':');
                write_canonical(v, out);
            }
            out.push(b'}');
        }
        Value::Array(a) => {
            out.push(b'[');
            for (i, v) in a.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_canonical(v, out);
            }
            out.push(b']');
        }
        scalar => out.extend(serde_json::to_vec(scalar).unwrap_or_default()),
    }
}

/// A stored answer: what a hit streams and reports.
#[derive(Debug, Clone, PartialEq)]
pub struct Answer {
    pub text: String,
    /// `stop` or `length`.
    pub finish_reason: String,
    /// The logical model that answered.
    pub model: String,
    /// The tokens of the answered call (input and output), reported again
    /// with every hit.
    pub usage: Usage,
    /// The tenant and user whose call stored it (`None`: no user id), so
    /// that deleting a user's data (`DELETE /admin/users/{user}/data`)
    /// also drops the answers their prompts produced.
    pub owner: Option<(String, String)>,
}

impl Answer {
    fn bytes(&self) -> usize {
        self.text.len() + self.model.len() + self.finish_reason.len() + ENTRY_OVERHEAD
    }
}

/// A hit: the answer, how old it is, and whether it is past its `ttl`
/// (served only by the routing chain's cached step).
#[derive(Debug, Clone)]
pub struct Hit {
    pub answer: Arc<Answer>,
    pub age: Duration,
    pub stale: bool,
}

/// Whether a finished call's answer may be stored: it succeeded, complete
/// (`stop` or `length`), from the requested logical model's own step (its
/// local, edge-node or cloud instances; not a smaller model, canned or
/// cached answer), not cut by admission, without tool calls.
pub fn storable(
    step: Option<crate::task::FallbackStep>,
    succeeded: bool,
    finish_reason: Option<&str>,
    admission_degraded: bool,
    tool_calls: bool,
) -> bool {
    use crate::task::FallbackStep as S;
    succeeded
        && !admission_degraded
        && !tool_calls
        && matches!(finish_reason, Some("stop" | "length"))
        && matches!(step, Some(S::SameModel | S::EdgeNode | S::Cloud))
}

struct Entry {
    answer: Arc<Answer>,
    stored: Instant,
    /// Its place in `by_use` and `by_age`.
    used: u64,
    born: u64,
    bytes: usize,
}

/// The entries, least recently used first in `by_use`, oldest first in
/// `by_age`. A pure state machine over the clock it is given.
#[derive(Default)]
struct Entries {
    map: HashMap<[u8; 32], Entry>,
    by_use: BTreeMap<u64, [u8; 32]>,
    by_age: BTreeMap<u64, [u8; 32]>,
    tick: u64,
    bytes: usize,
}

/// What a change of the entries did, for the metrics.
#[derive(Debug, Default, PartialEq, Eq)]
struct Dropped {
    /// Past the byte budget (least recently used).
    evicted: u64,
    /// Past every ttl.
    expired: u64,
}

/// A lookup's result.
#[derive(Debug)]
enum Found {
    Hit(Hit),
    /// No entry (or one past every ttl).
    Absent,
    /// An entry past `ttl` on a fresh lookup (kept for the stale step).
    Expired,
}

impl Entries {
    fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    fn remove(&mut self, digest: &[u8; 32]) -> Option<Entry> {
        let e = self.map.remove(digest)?;
        self.by_use.remove(&e.used);
        self.by_age.remove(&e.born);
        self.bytes -= e.bytes;
        Some(e)
    }

    /// Drops the entries past `horizon`, oldest first.
    fn expire(&mut self, now: Instant, horizon: Duration) -> u64 {
        let mut n = 0;
        while let Some((_, d)) = self.by_age.first_key_value() {
            let d = *d;
            let old = self.map.get(&d).is_some_and(|e| now.saturating_duration_since(e.stored) > horizon);
            if !old {
                break;
            }
            self.remove(&d);
            n += 1;
        }
        n
    }

    /// Looks `key` up; `stale_ok`: an entry past `ttl` but within
    /// `stale_ttl` is a (stale) hit.
    fn get(&mut self, key: &CacheKey, now: Instant, stale_ok: bool) -> (Found, Dropped) {
        let s = key.settings;
        let dropped = Dropped { expired: self.expire(now, s.horizon()), evicted: 0 };
        let tick = self.next_tick();
        let Some(e) = self.map.get_mut(&key.digest) else { return (Found::Absent, dropped) };
        let age = now.saturating_duration_since(e.stored);
        let fresh = age <= s.ttl;
        // Still here after `expire`: within `stale_ttl` if not fresh.
        if !(fresh || (stale_ok && age <= s.stale_ttl)) {
            return (Found::Expired, dropped);
        }
        self.by_use.remove(&e.used);
        e.used = tick;
        self.by_use.insert(tick, key.digest);
        (Found::Hit(Hit { answer: e.answer.clone(), age, stale: !fresh }), dropped)
    }

    /// Stores `answer` under `key` (replacing an older one), then drops
    /// the least recently used entries until the budget holds. An answer
    /// bigger than the whole budget is not stored.
    fn put(&mut self, key: &CacheKey, answer: Answer, now: Instant) -> Dropped {
        let s = key.settings;
        let mut dropped = Dropped { expired: self.expire(now, s.horizon()), evicted: 0 };
        self.remove(&key.digest);
        let bytes = answer.bytes();
        if bytes > s.max_bytes {
            return dropped;
        }
        let t = self.next_tick();
        self.map.insert(key.digest, Entry { answer: Arc::new(answer), stored: now, used: t, born: t, bytes });
        self.by_use.insert(t, key.digest);
        self.by_age.insert(t, key.digest);
        self.bytes += bytes;
        while self.bytes > s.max_bytes {
            let Some((_, d)) = self.by_use.first_key_value() else { break };
            let d = *d;
            self.remove(&d);
            dropped.evicted += 1;
        }
        dropped
    }

    /// Drops the entries stored by `tenant`'s `user`; how many went. Walks
    /// every entry: a rare admin operation, not on any call's path.
    fn forget_owner(&mut self, tenant: &str, user: &str) -> usize {
        let theirs: Vec<[u8; 32]> = self
            .map
            .iter()
            .filter(|(_, e)| e.answer.owner.as_ref().is_some_and(|(t, u)| t == tenant && u == user))
            .map(|(d, _)| *d)
            .collect();
        for d in &theirs {
            self.remove(d);
        }
        theirs.len()
    }
}

/// The `edgeway_cache_*` families, every label value present from the
/// start (they are closed sets).
struct CacheMetrics {
    hits: IntCounterVec,
    misses: IntCounterVec,
    bypassed: IntCounterVec,
    evictions: IntCounterVec,
    bytes: IntGauge,
    entries: IntGauge,
}

impl CacheMetrics {
    fn new(registry: &Registry) -> CacheMetrics {
        let counter = |name: &str, help: &str, label: &str, values: &[&str]| {
            let c = IntCounterVec::new(Opts::new(name, help), &[label]).expect("valid metric");
            for v in values {
                c.with_label_values(&[v]);
            }
            // Registered once per registry; a second cache on the same one
            // (never in the gateway) keeps its counts to itself.
            let _ = registry.register(Box::new(c.clone()));
            c
        };
        let gauge = |name: &str, help: &str| {
            let g = IntGauge::new(name, help).expect("valid metric");
            let _ = registry.register(Box::new(g.clone()));
            g
        };
        let bypass: Vec<&str> = Bypass::ALL.iter().map(|b| b.as_str()).collect();
        CacheMetrics {
            hits: counter(
                "cache_hits_total",
                "Calls answered from the response cache, by kind (fresh; stale: the routing chain's cached step)",
                "kind",
                &["fresh", "stale"],
            ),
            misses: counter(
                "cache_misses_total",
                "Cacheable calls the response cache could not answer, by reason (absent; expired: past ttl_s)",
                "reason",
                &["absent", "expired"],
            ),
            bypassed: counter(
                "cache_bypassed_total",
                "Calls the response cache does not look up, by reason",
                "reason",
                bypass.as_slice(),
            ),
            evictions: counter(
                "cache_evictions_total",
                "Entries dropped from the response cache, by reason (bytes: max_bytes, least recently used first; expired: past every ttl)",
                "reason",
                &["bytes", "expired"],
            ),
            bytes: gauge("cache_bytes", "Bytes the response cache holds (answer text plus a fixed overhead per entry)"),
            entries: gauge("cache_entries", "Answers the response cache holds"),
        }
    }
}

/// The cache, shared by the scheduler's drivers. Cheap to look up: one
/// short lock, never held across an `.await`.
pub struct ResponseCache {
    entries: Mutex<Entries>,
    metrics: CacheMetrics,
}

impl ResponseCache {
    /// An empty cache whose metrics are registered in `registry`.
    pub fn new(registry: &Registry) -> ResponseCache {
        ResponseCache { entries: Mutex::new(Entries::default()), metrics: CacheMetrics::new(registry) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Entries> {
        self.entries.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn account(&self, e: &Entries, d: &Dropped) {
        if d.evicted > 0 {
            self.metrics.evictions.with_label_values(&["bytes"]).inc_by(d.evicted);
        }
        if d.expired > 0 {
            self.metrics.evictions.with_label_values(&["expired"]).inc_by(d.expired);
        }
        self.metrics.bytes.set(e.bytes as i64);
        self.metrics.entries.set(e.map.len() as i64);
    }

    /// Counts a call that is not looked up.
    pub fn bypassed(&self, why: Bypass) {
        self.metrics.bypassed.with_label_values(&[why.as_str()]).inc();
    }

    /// A fresh answer for `key` (within its `ttl`); a miss is counted.
    pub fn fresh(&self, key: &CacheKey) -> Option<Hit> {
        self.fresh_at(key, Instant::now())
    }

    fn fresh_at(&self, key: &CacheKey, now: Instant) -> Option<Hit> {
        let mut e = self.lock();
        let (found, dropped) = e.get(key, now, false);
        self.account(&e, &dropped);
        match found {
            Found::Hit(h) => {
                self.metrics.hits.with_label_values(&["fresh"]).inc();
                Some(h)
            }
            Found::Absent => {
                self.metrics.misses.with_label_values(&["absent"]).inc();
                None
            }
            Found::Expired => {
                self.metrics.misses.with_label_values(&["expired"]).inc();
                None
            }
        }
    }

    /// An answer for `key` up to `stale_ttl` old, for the routing chain's
    /// cached step (every engine step failed). Only a hit is counted: the
    /// call was counted a miss when it came.
    pub fn stale(&self, key: &CacheKey) -> Option<Hit> {
        let mut e = self.lock();
        let (found, dropped) = e.get(key, Instant::now(), true);
        self.account(&e, &dropped);
        match found {
            Found::Hit(h) => {
                self.metrics.hits.with_label_values(&[if h.stale { "stale" } else { "fresh" }]).inc();
                Some(h)
            }
            _ => None,
        }
    }

    /// Stores a finished call's answer (see [`storable`]).
    pub fn put(&self, key: &CacheKey, answer: Answer) {
        let mut e = self.lock();
        let dropped = e.put(key, answer, Instant::now());
        self.account(&e, &dropped);
    }

    /// Drops the answers stored by `tenant`'s `user` (a deletion of the
    /// user's data); how many went.
    pub fn forget_user(&self, tenant: &str, user: &str) -> usize {
        let mut e = self.lock();
        let n = e.forget_owner(tenant, user);
        self.account(&e, &Dropped::default());
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::task::{ChatMessage, DataClass};

    fn cfg(extra: &str) -> Config {
        let text = format!(
            r#"
[applications.a]
tenant = "t1"
api_key_sha256 = ["{k}"]
[engines.e]
type = "openai"
base_url = "http://127.0.0.1:1"
model = "m"
[models.general-chat]
instances = ["e"]
context_tokens = 2048
max_output_tokens = 256
[cache]
enabled = true
{extra}
"#,
            k = "0".repeat(64)
        );
        Config::from_toml_str(&text, std::iter::empty(), std::path::Path::new(".")).unwrap()
    }

    fn req(text: &str) -> TaskRequest {
        let mut r = TaskRequest::sample(vec![ChatMessage {
            role: "user".into(),
            content: Value::String(text.into()),
            extra: Default::default(),
        }]);
        r.params.temperature = Some(0.0);
        r
    }

    fn key(c: &Config, r: &TaskRequest) -> CacheKey {
        match key_for(c, r, None) {
            Lookup::Key(k) => k,
            other => panic!("not cacheable: {other:?}"),
        }
    }

    fn answer(text: &str) -> Answer {
        Answer {
            text: text.into(),
            finish_reason: "stop".into(),
            model: "general-chat".into(),
            usage: Usage::default(),
            owner: None,
        }
    }

    #[test]
    fn forgetting_a_user_drops_only_the_answers_their_calls_stored() {
        let s = settings(60, 600, 1 << 20);
        let mut e = Entries::default();
        let t0 = Instant::now();
        let owned = |text: &str, t: &str, u: &str| Answer { owner: Some((t.into(), u.into())), ..answer(text) };
        e.put(&k(1, s), owned("alice's", "t1", "alice"), t0);
        e.put(&k(2, s), owned("bob's", "t1", "bob"), t0);
        e.put(&k(3, s), owned("other tenant's alice", "t2", "alice"), t0);
        e.put(&k(4, s), answer("no user"), t0);
        let before = e.bytes;
        assert_eq!(e.forget_owner("t1", "alice"), 1);
        assert!(e.bytes < before, "the bytes are given back");
        let left: Vec<String> = [1, 2, 3, 4]
            .into_iter()
            .filter_map(|n| match e.get(&k(n, s), t0, false).0 {
                Found::Hit(h) => Some(h.answer.text.clone()),
                _ => None,
            })
            .collect();
        assert_eq!(left, ["bob's", "other tenant's alice", "no user"]);
        assert_eq!(e.forget_owner("t1", "alice"), 0);
    }

    /// Review 16 M3: a call with knowledge passages and no session is
    /// fenced with a new random id each time; its repeat still hits.
    #[test]
    fn the_key_ignores_the_fence_id_but_not_what_is_fenced() {
        let c = cfg("");
        let fenced = |id: &str, doc: &str| {
            req(&format!(
                "<untrusted-data id=\"{id}\" kind=\"knowledge\" source=\"kb\">\n{doc}\n</untrusted-data id=\"{id}\">\nQ?"
            ))
        };
        let a = key(&c, &fenced("0123456789ab", "the manual"));
        assert_eq!(a, key(&c, &fenced("ba9876543210", "the manual")));
        assert_ne!(a, key(&c, &fenced("0123456789ab", "another manual")));
    }

    #[test]
    fn the_key_is_scoped_to_tenant_and_application_and_ignores_map_order() {
        let c = cfg("");
        let r = req("hi");
        let k = key(&c, &r);
        let mut other_app = r.clone();
        other_app.identity.application = "b".into();
        let mut other_tenant = r.clone();
        other_tenant.identity.tenant = "t2".into();
        assert_ne!(k, key(&c, &other_app));
        assert_ne!(k, key(&c, &other_tenant));
        // Nor across users of one application (review 16 M1).
        let mut alice = r.clone();
        alice.identity.user_id = Some("alice".into());
        let mut bob = r.clone();
        bob.identity.user_id = Some("bob".into());
        assert_ne!(key(&c, &alice), key(&c, &bob));
        assert_ne!(key(&c, &alice), k);
        assert_ne!(k, key(&c, &req("hi!")));
        let mut budget = r.clone();
        budget.max_output_tokens += 1;
        assert_ne!(k, key(&c, &budget));
        // A new task of the same call has the same key.
        assert_eq!(k, key(&c, &req("hi")));
        // Key order inside a message does not matter.
        let a: Value = serde_json::from_str(r#"{"b":1,"a":[{"y":2,"x":1}]}"#).unwrap();
        let b: Value = serde_json::from_str(r#"{"a":[{"x":1,"y":2}],"b":1}"#).unwrap();
        let (mut x, mut y) = (Vec::new(), Vec::new());
        write_canonical(&a, &mut x);
        write_canonical(&b, &mut y);
        assert_eq!(x, y);
        assert_eq!(String::from_utf8(x).unwrap(), r#"{"a":[{"x":1,"y":2}],"b":1}"#);
    }

    #[test]
    fn only_deterministic_calls_without_tools_of_allowed_classes_are_looked_up() {
        let c = cfg("");
        let mut warm = req("hi");
        warm.params.temperature = Some(0.7);
        assert_eq!(key_for(&c, &warm, None), Lookup::Bypass(Bypass::Nondeterministic));
        warm.params.seed = Some(7);
        assert!(matches!(key_for(&c, &warm, None), Lookup::Key(_)));
        let mut unset = req("hi");
        unset.params.temperature = None;
        assert_eq!(key_for(&c, &unset, None), Lookup::Bypass(Bypass::Nondeterministic));
        let mut secret = req("hi");
        secret.data_class = DataClass::Secret;
        assert_eq!(key_for(&c, &secret, None), Lookup::Bypass(Bypass::DataClass));
        let mut sensitive = req("hi");
        sensitive.data_class = DataClass::Sensitive;
        assert_eq!(key_for(&c, &sensitive, None), Lookup::Bypass(Bypass::DataClass));
        assert_eq!(key_for(&c, &req("hi"), Some(false)), Lookup::Bypass(Bypass::OptedOut));
        assert!(matches!(key_for(&c, &req("hi"), Some(true)), Lookup::Key(_)));
        let mut public_only = cfg("max_data_class = \"public\"");
        assert_eq!(key_for(&public_only, &req("hi"), None), Lookup::Bypass(Bypass::DataClass));
        public_only.cache.enabled = false;
        assert_eq!(key_for(&public_only, &req("hi"), None), Lookup::Off);
        let mut tools = req("hi");
        tools.tools = Some(crate::task::ToolSet {
            tools: vec![serde_json::json!({"type": "function", "function": {"name": "f"}})],
            tool_choice: None,
            parallel_tool_calls: None,
        });
        assert_eq!(key_for(&c, &tools, None), Lookup::Bypass(Bypass::Tools));
        let mut emb = req("hi");
        emb.operation = Operation::Embedding { input: vec!["x".into()], dimensions: None };
        assert_eq!(key_for(&c, &emb, None), Lookup::Bypass(Bypass::Operation));
        let mut app_off = cfg("");
        let mut r = req("hi");
        r.identity.application = "a".into();
        assert!(matches!(key_for(&app_off, &r, None), Lookup::Key(_)));
        app_off.applications.get_mut("a").expect("application a").cache = false;
        assert_eq!(key_for(&app_off, &r, None), Lookup::Bypass(Bypass::OptedOut));
    }

    #[test]
    fn the_edge_flag_is_taken_out_and_checked() {
        let mut e = serde_json::json!({"cache": false, "context": {}});
        assert_eq!(take_edge_flag(Some(&mut e)).unwrap(), Some(false));
        assert_eq!(e, serde_json::json!({"context": {}}));
        assert_eq!(take_edge_flag(None).unwrap(), None);
        let mut bad = serde_json::json!({"cache": "no"});
        let err = take_edge_flag(Some(&mut bad)).unwrap_err();
        assert_eq!(err.code, crate::error::ErrorCode::InvalidRequest);
        assert!(err.message.contains("edge.cache"), "{}", err.message);
    }

    fn settings(ttl: u64, stale: u64, max_bytes: usize) -> Settings {
        Settings { ttl: Duration::from_secs(ttl), stale_ttl: Duration::from_secs(stale), max_bytes }
    }

    fn k(n: u8, s: Settings) -> CacheKey {
        CacheKey { digest: [n; 32], settings: s }
    }

    #[test]
    fn ttl_then_stale_ttl_then_gone() {
        let s = settings(10, 100, 1 << 20);
        let mut e = Entries::default();
        let t0 = Instant::now();
        e.put(&k(1, s), answer("a"), t0);
        let (f, _) = e.get(&k(1, s), t0 + Duration::from_secs(10), false);
        assert!(matches!(f, Found::Hit(Hit { stale: false, .. })), "{f:?}");
        let (f, _) = e.get(&k(1, s), t0 + Duration::from_secs(11), false);
        assert!(matches!(f, Found::Expired), "{f:?}");
        let (f, _) = e.get(&k(1, s), t0 + Duration::from_secs(50), true);
        match f {
            Found::Hit(h) => assert!(h.stale && h.age == Duration::from_secs(50)),
            other => panic!("{other:?}"),
        }
        let (f, d) = e.get(&k(1, s), t0 + Duration::from_secs(101), true);
        assert!(matches!(f, Found::Absent), "{f:?}");
        assert_eq!(d.expired, 1);
        assert_eq!((e.map.len(), e.bytes, e.by_use.len(), e.by_age.len()), (0, 0, 0, 0));
    }

    #[test]
    fn the_byte_budget_drops_the_least_recently_used_first() {
        let one = answer("x").bytes();
        let s = settings(100, 100, 3 * one);
        let mut e = Entries::default();
        let t = Instant::now();
        for n in 1..=3 {
            assert_eq!(e.put(&k(n, s), answer("x"), t), Dropped::default());
        }
        // 1 is used again: 2 is now the least recently used.
        assert!(matches!(e.get(&k(1, s), t, false).0, Found::Hit(_)));
        assert_eq!(e.put(&k(4, s), answer("x"), t).evicted, 1);
        assert!(matches!(e.get(&k(2, s), t, false).0, Found::Absent));
        for n in [1, 3, 4] {
            assert!(matches!(e.get(&k(n, s), t, false).0, Found::Hit(_)), "{n}");
        }
        assert_eq!(e.bytes, 3 * one);
        // Replacing an entry does not count it twice.
        e.put(&k(4, s), answer("x"), t);
        assert_eq!((e.bytes, e.map.len()), (3 * one, 3));
        // An answer over the whole budget is not stored, and drops nothing.
        let big = answer(&"y".repeat(4 * one));
        assert_eq!(e.put(&k(5, s), big, t), Dropped::default());
        assert_eq!(e.map.len(), 3);
    }

    #[test]
    fn only_complete_answers_of_the_requested_model_are_stored() {
        use crate::task::FallbackStep as S;
        assert!(storable(Some(S::SameModel), true, Some("stop"), false, false));
        assert!(storable(Some(S::Cloud), true, Some("length"), false, false));
        assert!(!storable(Some(S::SmallerModel), true, Some("stop"), false, false));
        assert!(!storable(Some(S::Canned), true, Some("stop"), false, false));
        assert!(!storable(Some(S::Cached), true, Some("stop"), false, false));
        assert!(!storable(Some(S::SameModel), false, None, false, false));
        assert!(!storable(Some(S::SameModel), true, Some("stop"), true, false));
        assert!(!storable(Some(S::SameModel), true, Some("tool_calls"), false, true));
        assert!(!storable(Some(S::SameModel), true, Some("other"), false, false));
    }
}
