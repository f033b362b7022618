//! Sessions (FR-3.4, FR-3.5): a conversation kept by the gateway so that
//! applications need not send their history with every call. A session
//! belongs to one tenant, application and user ([`Owner`]); to anyone else
//! it does not exist (`SESSION_NOT_FOUND`, never a refusal that would tell
//! it exists).
//!
//! Owns: the live sessions (all of them are held here, in memory), their
//! limits (lifetime, idle expiry, messages, tokens, sessions per user, per
//! application and in all, memory entries), the sweep of expired ones, the raw history of each (the turns that ended well,
//! redacted by the application's rules before anything is kept), the
//! long-term memory entries written through the API, and the one-turn-at-
//! a-time rule of a session ([`TurnLease`]).
//!
//! Retention per data class (`[store.retention.<class>] sessions_hours`):
//! a session that holds a turn of a class with such an age, or was
//! created by a caller whose calls are at least of that class (its
//! application's, tenant's or credential's class), has its idle expiry
//! lowered to that age, so it ends that long after its last turn (or its
//! creation) at the latest, in memory (the sweep) and in the store (its
//! row's `expires_at_ms`, which the retention pass deletes by). Its
//! `limits.idle_expiry_s` shows the lowered value.
//!
//! Persistence follows the data policy of the task store: a session is
//! written to the store (row, history, memory) only when it asked to
//! persist (`persist`, default true) *and* the store may keep text
//! (`[store] store_prompts`). Otherwise it lives in memory only, for its
//! lifetime or until the gateway stops, and its view says `persist: false`.
//!
//! Does not own: which turns enter a prompt (`super::assembly`), the HTTP
//! shape of the API (ingress), or when a turn ends (the gateway watches its
//! task and calls [`TurnLease::finish`]).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::config::SessionsConfig;
use crate::error::{ErrorCode, GatewayError};
use crate::store::sessions::{MemoryRow, MessageRow, SessionRow, StoredSession, SummaryRow};
use crate::store::Store;
use crate::task::{now_ms, ChatMessage, DataClass, Identity};

use super::redact::Redactor;
use super::summary::SessionSummary;

const MAX_ID_LEN: usize = 128;
const MAX_TAGS: usize = 16;
const MAX_MEMORY_BYTES: usize = 16 * 1024;

/// Who a session belongs to.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Owner {
    pub tenant: String,
    pub application: String,
    pub user_id: Option<String>,
}

impl Owner {
    /// The owner a caller acts as: its authenticated user (a JWT `sub`, a
    /// device), else the user it declares (`declared`, an application
    /// acting for its users as with `metadata.user_id`), else none.
    pub fn of(who: &Identity, declared: Option<&str>) -> Result<Owner, GatewayError> {
        let user_id = match (&who.user_id, declared) {
            (Some(u), _) => Some(u.clone()),
            (None, Some(d)) => {
                if d.is_empty() || d.len() > MAX_ID_LEN || d.chars().any(char::is_control) {
                    return Err(GatewayError::invalid(format!(
                        "the user id must be 1..{MAX_ID_LEN} bytes without control characters"
                    )));
                }
                Some(d.to_string())
            }
            (None, None) => None,
        };
        Ok(Owner { tenant: who.tenant.clone(), application: who.application.clone(), user_id })
    }

    fn source(&self) -> String {
        match &self.user_id {
            Some(u) => format!("{}/{u}", self.application),
            None => self.application.clone(),
        }
    }
}

/// Lower limits a session may ask for at creation (never above the
/// configured ones).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitsRequest {
    pub max_messages: Option<u32>,
    pub max_tokens: Option<u64>,
    pub idle_expiry_s: Option<u64>,
    pub max_lifetime_s: Option<u64>,
}

/// The body of `POST /v1/sessions`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateSession {
    #[serde(default)]
    pub metadata: Option<Map<String, Value>>,
    /// Keep the session in the store (where the data policy allows).
    #[serde(default)]
    pub persist: Option<bool>,
    #[serde(default)]
    pub limits: Option<LimitsRequest>,
    /// The user the session is for, when the credential names none.
    #[serde(default)]
    pub user_id: Option<String>,
}

/// The limits a session runs under.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Limits {
    pub max_messages: u32,
    pub max_tokens: u64,
    pub idle_expiry_s: u64,
    pub max_lifetime_s: u64,
}

/// What `GET /v1/sessions/{id}` shows.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SessionView {
    pub id: String,
    pub object: &'static str,
    pub user_id: Option<String>,
    /// Unix seconds.
    pub created_at: i64,
    pub last_used_at: i64,
    pub expires_at: i64,
    pub persist: bool,
    pub metadata: Map<String, Value>,
    pub message_count: u32,
    /// Estimated tokens of the history.
    pub tokens: u64,
    pub memory_entries: usize,
    /// The session's summary of its older turns (`crate::context::summary`):
    /// its version, the model that wrote it, when (Unix milliseconds) and
    /// how many of the oldest messages it replaces; all null until one is
    /// made.
    pub summary_version: Option<u32>,
    pub summary_model: Option<String>,
    pub summary_at_ms: Option<i64>,
    pub summary_covers: Option<u32>,
    pub limits: Limits,
}

/// A memory entry as written (`POST /v1/sessions/{id}/memory`).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemoryWrite {
    pub key: String,
    #[serde(default)]
    pub tags: Vec<String>,
    pub content: String,
}

/// A memory entry as kept and shown.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MemoryEntry {
    pub key: String,
    pub tags: Vec<String>,
    pub content: String,
    /// Who wrote it (`application` or `application/user`).
    pub source: String,
    /// Unix milliseconds.
    pub created_at_ms: i64,
}

/// One message of a session's history with its estimated size.
#[derive(Debug, Clone, PartialEq)]
pub struct HistoryMessage {
    pub message: ChatMessage,
    pub tokens: u32,
}

struct State {
    created_ms: i64,
    last_used_ms: i64,
    limits: Limits,
    persist: bool,
    metadata: Map<String, Value>,
    history: Vec<HistoryMessage>,
    tokens: u64,
    next_seq: u32,
    memory: BTreeMap<String, MemoryEntry>,
    summary: Option<SessionSummary>,
    /// A summary task of this session is running (one at a time).
    summarizing: bool,
}

impl State {
    fn expires_at_ms(&self) -> i64 {
        let life = self.created_ms.saturating_add((self.limits.max_lifetime_s * 1000) as i64);
        let idle = self.last_used_ms.saturating_add((self.limits.idle_expiry_s * 1000) as i64);
        life.min(idle)
    }

    fn expired(&self, now: i64) -> bool {
        now >= self.expires_at_ms()
    }
}

struct Session {
    id: String,
    owner: Owner,
    /// The secret its prompts' fence id is derived from
    /// (`super::fence::session_fence_id`). Kept in memory only: a session
    /// read back after a restart gets a new one (one turn without the
    /// engine's cached prompt head, no secret in the database).
    fence_secret: String,
    /// Held by the turn in progress: turns of one session run one at a time.
    turn: Arc<tokio::sync::Mutex<()>>,
    state: Mutex<State>,
}

impl Session {
    fn view(&self) -> SessionView {
        let s = self.state.lock().expect("session state");
        SessionView {
            id: self.id.clone(),
            object: "session",
            user_id: self.owner.user_id.clone(),
            created_at: s.created_ms / 1000,
            last_used_at: s.last_used_ms / 1000,
            expires_at: s.expires_at_ms() / 1000,
            persist: s.persist,
            metadata: s.metadata.clone(),
            message_count: s.history.len() as u32,
            tokens: s.tokens,
            memory_entries: s.memory.len(),
            summary_version: s.summary.as_ref().map(|m| m.version),
            summary_model: s.summary.as_ref().map(|m| m.model.clone()),
            summary_at_ms: s.summary.as_ref().map(|m| m.at_ms),
            summary_covers: s.summary.as_ref().map(|m| m.covers as u32),
            limits: s.limits,
        }
    }

    fn row(&self, s: &State) -> SessionRow {
        SessionRow {
            session_id: self.id.clone(),
            tenant: self.owner.tenant.clone(),
            application: self.owner.application.clone(),
            user_id: self.owner.user_id.clone(),
            created_at_ms: s.created_ms,
            last_used_ms: s.last_used_ms,
            expires_at_ms: s.expires_at_ms(),
            max_lifetime_ms: (s.limits.max_lifetime_s * 1000) as i64,
            idle_expiry_ms: (s.limits.idle_expiry_s * 1000) as i64,
            max_messages: s.limits.max_messages,
            max_tokens: s.limits.max_tokens,
            message_count: s.history.len() as u32,
            tokens: s.tokens,
            metadata: Value::Object(s.metadata.clone()).to_string(),
            summary: s.summary.as_ref().map(|m| SummaryRow {
                text: m.text.clone(),
                version: m.version,
                model: m.model.clone(),
                at_ms: m.at_ms,
                covers: m.covers as u32,
            }),
        }
    }
}

/// The `[sessions]` limits and the applications' redaction rules in
/// force: swapped whole by a configuration reload ([`Sessions::reconfigure`]),
/// so that a tightened rule applies from the next write on.
struct Rules {
    cfg: SessionsConfig,
    redactor: Redactor,
    /// By [`DataClass`] order: `[store.retention.<class>] sessions_hours`,
    /// the longest idle expiry of a session that holds the class.
    class_idle: [Option<Duration>; 4],
}

impl Rules {
    fn of(config: &crate::config::Config) -> Rules {
        Rules {
            cfg: config.sessions.clone(),
            redactor: Redactor::from_config(config),
            class_idle: config.store.retention_classes.map(|c| c.sessions),
        }
    }

    /// Lowers `limits`' idle expiry to what data class `class` allows.
    fn cap(&self, limits: &mut Limits, class: DataClass) {
        if let Some(max) = self.class_idle[class as usize] {
            limits.idle_expiry_s = limits.idle_expiry_s.min(max.as_secs().max(1));
        }
    }
}

/// The live sessions. Shared by the gateway facade.
pub struct Sessions {
    rules: std::sync::RwLock<Arc<Rules>>,
    store: Store,
    by_id: Mutex<HashMap<String, Arc<Session>>>,
}

fn not_found(id: &str) -> GatewayError {
    GatewayError::new(ErrorCode::SessionNotFound, format!("no session '{id}'"))
}

fn check_key(what: &str, v: &str) -> Result<(), GatewayError> {
    if v.is_empty() || v.len() > MAX_ID_LEN || !v.chars().all(|c| c.is_ascii_alphanumeric() || "-_.:".contains(c)) {
        return Err(GatewayError::invalid(format!(
            "'{what}' must be 1..{MAX_ID_LEN} characters of A-Z a-z 0-9 - _ . :"
        )));
    }
    Ok(())
}

impl Sessions {
    pub fn new(config: &crate::config::Config, store: Store) -> Sessions {
        Sessions {
            rules: std::sync::RwLock::new(Arc::new(Rules::of(config))),
            store,
            by_id: Mutex::new(HashMap::new()),
        }
    }

    /// Puts a reloaded configuration's `[sessions]` limits and redaction
    /// rules in force. Sessions already created keep the limits they were
    /// created with (as a running task keeps its admission); the ceilings
    /// (`max_per_user`, memory entries, `append_failed_turns`) and the
    /// redaction apply to every later write.
    pub fn reconfigure(&self, cfg: &crate::config::Config) {
        let rules = Rules::of(cfg);
        *self.rules.write().unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::new(rules);
    }

    fn rules(&self) -> Arc<Rules> {
        self.rules.read().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    /// Loads the sessions the store kept (at start-up).
    pub async fn restore(&self) -> usize {
        let stored = self.store.sessions().await;
        let n = stored.len();
        let mut map = self.by_id.lock().expect("sessions");
        for s in stored {
            let session = from_stored(s);
            map.insert(session.id.clone(), Arc::new(session));
        }
        n
    }

    /// Whether the store may keep a session's text.
    fn may_persist(&self) -> bool {
        self.store.stores_prompts()
    }

    /// Creates a session for `owner`, whose calls are at least of data
    /// class `class` (its retention applies from the start: memory entries
    /// are written before any turn).
    pub fn create(&self, owner: Owner, req: CreateSession, class: DataClass) -> Result<SessionView, GatewayError> {
        let l = req.limits.unwrap_or_default();
        let rules = self.rules();
        let c = &rules.cfg;
        let pick = |asked: Option<u64>, max: u64, name: &str| -> Result<u64, GatewayError> {
            match asked {
                Some(v) if v == 0 || v > max => {
                    Err(GatewayError::invalid(format!("'limits.{name}' must be 1..{max} (the configured maximum)")))
                }
                Some(v) => Ok(v),
                None => Ok(max),
            }
        };
        let mut limits = Limits {
            max_messages: pick(l.max_messages.map(u64::from), u64::from(c.max_messages), "max_messages")? as u32,
            max_tokens: pick(l.max_tokens, c.max_tokens, "max_tokens")?,
            idle_expiry_s: pick(l.idle_expiry_s, c.idle_expiry.as_secs(), "idle_expiry_s")?,
            max_lifetime_s: pick(l.max_lifetime_s, c.max_lifetime.as_secs(), "max_lifetime_s")?,
        };
        rules.cap(&mut limits, class);
        let metadata = req.metadata.unwrap_or_default();
        if Value::Object(metadata.clone()).to_string().len() > MAX_MEMORY_BYTES {
            return Err(GatewayError::invalid(format!("'metadata' must be at most {MAX_MEMORY_BYTES} bytes of JSON")));
        }
        let now = now_ms();
        let mut map = self.by_id.lock().expect("sessions");
        self.sweep(&mut map, now);
        let held = map.values().filter(|s| s.owner == owner).count();
        if held >= c.max_per_user {
            return Err(GatewayError::new(
                ErrorCode::SessionLimit,
                format!("this user already holds {held} sessions, the most allowed; delete one first"),
            ));
        }
        // Any caller may name any user (`x-user-id`): the application's
        // and the gateway's own bounds hold whatever users it names.
        let of_app =
            map.values().filter(|s| s.owner.tenant == owner.tenant && s.owner.application == owner.application).count();
        if of_app >= c.max_per_application {
            return Err(GatewayError::new(
                ErrorCode::SessionLimit,
                format!("this application already holds {of_app} sessions, the most allowed; delete one first"),
            ));
        }
        if map.len() >= c.max_sessions {
            return Err(GatewayError::new(
                ErrorCode::SessionLimit,
                format!("the gateway holds {} sessions, the most allowed; try again later", map.len()),
            ));
        }
        let session = Session {
            id: format!("sess_{}", uuid::Uuid::now_v7().simple()),
            owner,
            fence_secret: super::fence::new_fence_secret(),
            turn: Default::default(),
            state: Mutex::new(State {
                created_ms: now,
                last_used_ms: now,
                limits,
                persist: req.persist.unwrap_or(true) && self.may_persist(),
                metadata,
                history: Vec::new(),
                tokens: 0,
                next_seq: 0,
                memory: BTreeMap::new(),
                summary: None,
                summarizing: false,
            }),
        };
        {
            let s = session.state.lock().expect("session state");
            if s.persist {
                self.store.session_row(session.row(&s));
            }
        }
        let view = session.view();
        map.insert(session.id.clone(), Arc::new(session));
        Ok(view)
    }

    /// Drops expired sessions from memory, now (see [`Sessions::sweep_every`]).
    pub fn sweep_expired(&self) {
        let mut map = self.by_id.lock().expect("sessions");
        self.sweep(&mut map, now_ms());
    }

    /// Sweeps expired sessions every `period` for as long as `sessions`
    /// lives, so that memory is freed without waiting for a create or a
    /// list. Needs a Tokio runtime.
    pub fn sweep_every(sessions: &Arc<Sessions>, period: Duration) {
        let weak = Arc::downgrade(sessions);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            loop {
                tick.tick().await;
                let Some(s) = weak.upgrade() else { return };
                s.sweep_expired();
            }
        });
    }

    /// Drops expired sessions from memory (the store's retention pass
    /// deletes their rows).
    fn sweep(&self, map: &mut HashMap<String, Arc<Session>>, now: i64) {
        map.retain(|_, s| !s.state.lock().expect("session state").expired(now));
    }

    /// The session `id` of `owner`: `SESSION_NOT_FOUND` for anyone else,
    /// `SESSION_EXPIRED` (once; it is gone afterwards) when it expired.
    fn find(&self, owner: &Owner, id: &str) -> Result<Arc<Session>, GatewayError> {
        let mut map = self.by_id.lock().expect("sessions");
        let s = map.get(id).filter(|s| s.owner == *owner).cloned().ok_or_else(|| not_found(id))?;
        if s.state.lock().expect("session state").expired(now_ms()) {
            map.remove(id);
            self.store.delete_session(id);
            return Err(GatewayError::new(ErrorCode::SessionExpired, format!("session '{id}' has expired")));
        }
        Ok(s)
    }

    pub fn get(&self, owner: &Owner, id: &str) -> Result<SessionView, GatewayError> {
        Ok(self.find(owner, id)?.view())
    }

    /// The owner's live sessions, oldest first.
    pub fn list(&self, owner: &Owner) -> Vec<SessionView> {
        let mut map = self.by_id.lock().expect("sessions");
        self.sweep(&mut map, now_ms());
        let mut out: Vec<SessionView> = map.values().filter(|s| s.owner == *owner).map(|s| s.view()).collect();
        out.sort_by(|a, b| (a.created_at, &a.id).cmp(&(b.created_at, &b.id)));
        out
    }

    /// Deletes a session with its history and memory, here and in the
    /// store.
    pub fn delete(&self, owner: &Owner, id: &str) -> Result<(), GatewayError> {
        let mut map = self.by_id.lock().expect("sessions");
        if !map.get(id).is_some_and(|s| s.owner == *owner) {
            return Err(not_found(id));
        }
        map.remove(id);
        self.store.delete_session(id);
        Ok(())
    }

    /// Drops every session of `user` in `tenant` (any application) from
    /// memory, for the deletion of a user's data (which deletes the
    /// store's copies itself); how many.
    pub fn delete_user(&self, tenant: &str, user: &str) -> usize {
        let mut map = self.by_id.lock().expect("sessions");
        let before = map.len();
        map.retain(|_, s| !(s.owner.tenant == tenant && s.owner.user_id.as_deref() == Some(user)));
        before - map.len()
    }

    pub fn put_memory(&self, owner: &Owner, id: &str, w: MemoryWrite) -> Result<MemoryEntry, GatewayError> {
        check_key("key", &w.key)?;
        if w.tags.len() > MAX_TAGS {
            return Err(GatewayError::invalid(format!("at most {MAX_TAGS} 'tags'")));
        }
        for t in &w.tags {
            check_key("tags[]", t)?;
        }
        if w.content.is_empty() || w.content.len() > MAX_MEMORY_BYTES {
            return Err(GatewayError::invalid(format!("'content' must be 1..{MAX_MEMORY_BYTES} bytes")));
        }
        let s = self.find(owner, id)?;
        let rules = self.rules();
        // Held across the write, as in `append`: a delete between `find`
        // and the write must not be followed by a row nothing purges.
        let map = self.by_id.lock().expect("sessions");
        if !map.get(id).is_some_and(|live| Arc::ptr_eq(live, &s)) {
            return Err(not_found(id));
        }
        let mut st = s.state.lock().expect("session state");
        if !st.memory.contains_key(&w.key) && st.memory.len() >= rules.cfg.max_memory_entries {
            return Err(GatewayError::new(
                ErrorCode::SessionLimit,
                format!("session '{id}' holds {} memory entries, the most allowed", st.memory.len()),
            ));
        }
        let entry = MemoryEntry {
            key: w.key,
            tags: w.tags,
            content: rules.redactor.redact(&owner.application, &w.content),
            source: owner.source(),
            created_at_ms: now_ms(),
        };
        if st.persist {
            self.store.session_memory(MemoryRow {
                session_id: id.to_string(),
                key: entry.key.clone(),
                tags: serde_json::to_string(&entry.tags).unwrap_or_else(|_| "[]".into()),
                content: entry.content.clone(),
                source: entry.source.clone(),
                at_ms: entry.created_at_ms,
            });
        }
        st.memory.insert(entry.key.clone(), entry.clone());
        Ok(entry)
    }

    /// Memory entries of a session, all or those with `key` or `tag`.
    pub fn memory(
        &self,
        owner: &Owner,
        id: &str,
        key: Option<&str>,
        tag: Option<&str>,
    ) -> Result<Vec<MemoryEntry>, GatewayError> {
        let s = self.find(owner, id)?;
        let st = s.state.lock().expect("session state");
        Ok(st
            .memory
            .values()
            .filter(|e| key.is_none_or(|k| e.key == k))
            .filter(|e| tag.is_none_or(|t| e.tags.iter().any(|x| x == t)))
            .cloned()
            .collect())
    }

    pub fn clear_memory(&self, owner: &Owner, id: &str) -> Result<(), GatewayError> {
        let s = self.find(owner, id)?;
        s.state.lock().expect("session state").memory.clear();
        self.store.clear_session_memory(id);
        Ok(())
    }

    /// Starts a turn of session `id` for `owner`, whose new messages are
    /// about `new_tokens`: waits (at most `wait`) for the session's turn in
    /// progress to end, then checks the session's limits. Dropping the
    /// lease without [`TurnLease::finish`] appends nothing.
    ///
    /// Two turns of one session at once are serialized: the second waits
    /// for the first to end and be appended, so it sees it in its prompt.
    ///
    /// # Cancel safety
    /// Dropping the future gives up the wait; nothing has changed.
    pub async fn begin_turn(
        self: &Arc<Self>,
        owner: &Owner,
        id: &str,
        new_messages: usize,
        new_tokens: u32,
        wait: Duration,
    ) -> Result<TurnLease, GatewayError> {
        let s = self.find(owner, id)?;
        let guard = match tokio::time::timeout(wait, s.turn.clone().lock_owned()).await {
            Ok(g) => g,
            Err(_) => {
                return Err(GatewayError::new(
                    ErrorCode::SessionBusy,
                    format!("another turn of session '{id}' was still running; try again when it has ended"),
                ))
            }
        };
        // Checked again after the wait: the turn before may have filled it,
        // or the session may have been deleted meanwhile.
        let s = self.find(owner, id)?;
        {
            let st = s.state.lock().expect("session state");
            // The new messages and the answer.
            if (st.history.len() + new_messages) as u64 + 1 > u64::from(st.limits.max_messages) {
                return Err(GatewayError::new(
                    ErrorCode::SessionMessageLimit,
                    format!("session '{id}' holds {} messages; at most {}", st.history.len(), st.limits.max_messages),
                ));
            }
            if st.tokens + u64::from(new_tokens) > st.limits.max_tokens {
                return Err(GatewayError::new(
                    ErrorCode::SessionTokenLimit,
                    format!("session '{id}' holds about {} tokens; at most {}", st.tokens, st.limits.max_tokens),
                ));
            }
        }
        Ok(TurnLease { sessions: self.clone(), session: s, _turn: guard })
    }

    /// The summary job of session `id` when one is due (see
    /// `super::summary`) and none runs: the summary so far and the
    /// messages after it up to where the recent turns fitting
    /// `share_tokens` begin. The session counts as summarising until the
    /// job is kept or dropped.
    pub fn summary_due(self: &Arc<Self>, id: &str, share_tokens: u32, after: usize) -> Option<SummaryJob> {
        let s = self.by_id.lock().expect("sessions").get(id).cloned()?;
        let mut st = s.state.lock().expect("session state");
        if st.summarizing {
            return None;
        }
        let base = st.summary.as_ref().map_or(0, |m| m.covers);
        let upto = super::summary::due(&st.history, base, share_tokens, after)?;
        st.summarizing = true;
        let job = SummaryJob {
            sessions: self.clone(),
            session: s.clone(),
            previous: st.summary.clone(),
            messages: st.history[base..upto].to_vec(),
            base,
        };
        Some(job)
    }

    /// Appends a turn's messages; the session now holds data of `class`.
    fn append(&self, s: &Session, messages: Vec<ChatMessage>, task_id: &str, class: DataClass) {
        let now = now_ms();
        // Held across the append: a delete meanwhile must not be undone by
        // rows written after it.
        let map = self.by_id.lock().expect("sessions");
        if !map.get(&s.id).is_some_and(|live| std::ptr::eq(live.as_ref(), s)) {
            return;
        }
        let rules = self.rules();
        let mut st = s.state.lock().expect("session state");
        for mut m in messages {
            redact_message(&rules.redactor, &s.owner.application, &mut m);
            let tokens = super::estimate_message(&m);
            let seq = st.next_seq;
            st.next_seq += 1;
            if st.persist {
                self.store.session_message(MessageRow {
                    session_id: s.id.clone(),
                    seq,
                    role: m.role.clone(),
                    content: stored_content(&m),
                    tokens,
                    task_id: Some(task_id.to_string()),
                    at_ms: now,
                });
            }
            st.tokens += u64::from(tokens);
            st.history.push(HistoryMessage { message: m, tokens });
        }
        st.last_used_ms = now;
        rules.cap(&mut st.limits, class);
        if st.persist {
            self.store.session_row(s.row(&st));
        }
    }
}

/// The messages' text parts (and the arguments of an answer's tool
/// calls) with the application's patterns replaced.
fn redact_message(r: &Redactor, app: &str, m: &mut ChatMessage) {
    if let Some(Value::Array(calls)) = m.extra.get_mut("tool_calls") {
        for c in calls {
            if let Some(Value::String(a)) = c.pointer_mut("/function/arguments") {
                *a = r.redact(app, a);
            }
        }
    }
    match &mut m.content {
        Value::String(t) => *t = r.redact(app, t),
        Value::Array(parts) => {
            for p in parts {
                if let Some(Value::String(t)) = p.get_mut("text") {
                    *t = r.redact(app, t);
                }
            }
        }
        _ => {}
    }
}

/// A message's `content` column: the content as JSON (a string, parts or
/// null), or, for a message with other fields (an answer's `tool_calls`, a
/// tool result's `tool_call_id`), an object of the content and those
/// fields. A chat message's content is never an object, so the two cannot
/// be confused.
fn stored_content(m: &ChatMessage) -> String {
    if m.extra.is_empty() {
        return m.content.to_string();
    }
    let mut o = m.extra.clone();
    o.insert("content".into(), m.content.clone());
    Value::Object(o).to_string()
}

/// A message read back from its row (see [`stored_content`]).
fn stored_message(role: &str, content: &str) -> ChatMessage {
    match serde_json::from_str(content) {
        Ok(Value::Object(mut extra)) => {
            let content = extra.remove("content").unwrap_or(Value::Null);
            ChatMessage { role: role.to_string(), content, extra }
        }
        Ok(v) => ChatMessage { role: role.to_string(), content: v, extra: Map::new() },
        Err(_) => {
            ChatMessage { role: role.to_string(), content: Value::String(content.to_string()), extra: Map::new() }
        }
    }
}

fn from_stored(s: StoredSession) -> Session {
    let r = s.row;
    let history: Vec<HistoryMessage> = s
        .messages
        .iter()
        .map(|m| HistoryMessage { message: stored_message(&m.role, &m.content), tokens: m.tokens })
        .collect();
    let memory = s
        .memory
        .into_iter()
        .map(|m| {
            let e = MemoryEntry {
                key: m.key,
                tags: serde_json::from_str(&m.tags).unwrap_or_default(),
                content: m.content,
                source: m.source,
                created_at_ms: m.at_ms,
            };
            (e.key.clone(), e)
        })
        .collect();
    let tokens = history.iter().map(|h| u64::from(h.tokens)).sum();
    let next_seq = s.messages.last().map_or(0, |m| m.seq + 1);
    Session {
        id: r.session_id,
        owner: Owner { tenant: r.tenant, application: r.application, user_id: r.user_id },
        fence_secret: super::fence::new_fence_secret(),
        turn: Default::default(),
        state: Mutex::new(State {
            created_ms: r.created_at_ms,
            last_used_ms: r.last_used_ms,
            limits: Limits {
                max_messages: r.max_messages,
                max_tokens: r.max_tokens,
                idle_expiry_s: (r.idle_expiry_ms / 1000) as u64,
                max_lifetime_s: (r.max_lifetime_ms / 1000) as u64,
            },
            persist: true,
            metadata: serde_json::from_str(&r.metadata).unwrap_or_default(),
            history,
            tokens,
            next_seq,
            memory,
            summary: r.summary.map(|m| SessionSummary {
                text: m.text,
                covers: m.covers as usize,
                version: m.version,
                model: m.model,
                at_ms: m.at_ms,
            }),
            summarizing: false,
        }),
    }
}

/// A turn of a session in progress: holds the session's turn, so the
/// next turn waits until this one is appended (or dropped).
pub struct TurnLease {
    sessions: Arc<Sessions>,
    session: Arc<Session>,
    _turn: tokio::sync::OwnedMutexGuard<()>,
}

impl TurnLease {
    /// The session's history, oldest first, for the assembly.
    pub fn history(&self) -> Vec<HistoryMessage> {
        self.session.state.lock().expect("session state").history.clone()
    }

    /// The fence id of the session's prompts, the same every turn.
    pub fn fence_id(&self) -> String {
        super::fence::session_fence_id(&self.session.fence_secret)
    }

    /// The session's summary of its oldest messages (`covers` of them),
    /// for the assembly; none until one is made.
    pub fn summary(&self) -> Option<SessionSummary> {
        self.session.state.lock().expect("session state").summary.clone()
    }

    /// Ends the turn: appends the user's messages and the answer when the
    /// task `succeeded` (or when `[sessions] append_failed_turns`), then
    /// lets the next turn in.
    /// `calls` are the answer's tool calls (id, name, arguments), kept
    /// with it in the OpenAI form so that the tool results of the next turn
    /// follow the calls they answer. `class`: the task's data class, whose
    /// retention the session takes on with the turn.
    pub fn finish(
        self,
        user: Vec<ChatMessage>,
        answer: String,
        calls: Vec<(String, String, String)>,
        succeeded: bool,
        task_id: &str,
        class: DataClass,
    ) {
        if !(succeeded || self.sessions.rules().cfg.append_failed_turns) {
            return;
        }
        let mut messages = user;
        let mut extra = Map::new();
        if !calls.is_empty() {
            let calls = calls
                .into_iter()
                .map(|(id, name, arguments)| {
                    serde_json::json!({"id": id, "type": "function", "function": {"name": name, "arguments": arguments}})
                })
                .collect();
            extra.insert("tool_calls".into(), Value::Array(calls));
        }
        let content = if answer.is_empty() && !extra.is_empty() { Value::Null } else { Value::String(answer) };
        messages.push(ChatMessage { role: "assistant".into(), content, extra });
        self.sessions.append(&self.session, messages, task_id, class);
    }
}

/// A summary of a session's older messages being made
/// ([`Sessions::summary_due`]). Dropping it without [`SummaryJob::keep`]
/// leaves the session's summary as it was.
pub struct SummaryJob {
    sessions: Arc<Sessions>,
    session: Arc<Session>,
    /// The summary so far, which the new one extends.
    pub previous: Option<SessionSummary>,
    /// The messages after what `previous` covers, to be summarised.
    pub messages: Vec<HistoryMessage>,
    /// How many messages `previous` covers (0 without one).
    pub base: usize,
}

impl SummaryJob {
    /// Keeps `text`, written by `model`, as the summary of the session's
    /// first `covers` messages: the next version, in memory and (as the
    /// session's messages are) in the store. Nothing when the session was
    /// deleted meanwhile.
    pub fn keep(self, text: String, covers: usize, model: String) {
        // Held across the write, as in `append`: a delete meanwhile must
        // not be undone by a row written after it.
        let map = self.sessions.by_id.lock().expect("sessions");
        if !map.get(&self.session.id).is_some_and(|live| Arc::ptr_eq(live, &self.session)) {
            return;
        }
        let mut st = self.session.state.lock().expect("session state");
        let version = st.summary.as_ref().map_or(0, |m| m.version) + 1;
        st.summary = Some(SessionSummary { text, covers, version, model, at_ms: now_ms() });
        if st.persist {
            self.sessions.store.session_row(self.session.row(&st));
        }
    }
}

impl Drop for SummaryJob {
    fn drop(&mut self) {
        self.session.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner).summarizing = false;
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;
    use crate::config::Config;

    const HOUR_MS: i64 = 3_600_000;

    fn config(extra: &str) -> Config {
        let text = format!(
            "[applications.demo]\ntenant = \"demo\"\napi_key_sha256 = [\"{}\"]\n\
             [engines.a]\ntype = \"openai\"\nbase_url = \"http://127.0.0.1:9\"\nmodel = \"m\"\n\
             [models.chat]\ninstances = [\"a\"]\n{extra}",
            hex::encode(crate::config::hash_api_key("k"))
        );
        Config::from_toml_str(&text, std::iter::empty(), std::path::Path::new(".")).unwrap()
    }

    fn owner(user: &str) -> Owner {
        Owner { tenant: "demo".into(), application: "demo".into(), user_id: Some(user.into()) }
    }

    fn expires_at_ms(sessions: &Sessions, id: &str) -> i64 {
        sessions.by_id.lock().unwrap()[id].state.lock().unwrap().expires_at_ms()
    }

    /// The sessions left after a sweep at `now`.
    fn swept_at(sessions: &Sessions, now: i64) -> BTreeSet<String> {
        let mut map = sessions.by_id.lock().unwrap();
        sessions.sweep(&mut map, now);
        map.keys().cloned().collect()
    }

    /// `[store.retention.secret] sessions_hours`: a session created by a
    /// secret caller, or joined by a secret turn, ends that long after its
    /// last turn, in memory and in its stored row, which the store's purge
    /// deletes by; another session keeps the `[sessions]` idle expiry (a
    /// day). Failed before: the key was unknown, and every session lived a
    /// day after its last turn.
    #[tokio::test]
    async fn a_session_holding_a_class_with_sessions_hours_ends_that_long_after_its_last_turn() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("t.db");
        let store = Store::open(&db, "n", true).unwrap();
        let cfg = config("[store.retention.secret]\nsessions_hours = 2\n");
        assert_eq!(cfg.sessions.idle_expiry, Duration::from_secs(24 * 3600));
        let sessions = Arc::new(Sessions::new(&cfg, store.clone()));
        let create = |user: &str, class| sessions.create(owner(user), CreateSession::default(), class).unwrap();
        let plain = create("a", DataClass::Personal);
        assert_eq!(plain.limits.idle_expiry_s, 24 * 3600, "the [sessions] limit");
        let born = create("b", DataClass::Secret);
        assert_eq!(born.limits.idle_expiry_s, 2 * 3600, "created by a secret caller");
        let joined = create("c", DataClass::Personal);
        assert_eq!(joined.limits.idle_expiry_s, 24 * 3600);
        let lease = sessions.begin_turn(&owner("c"), &joined.id, 1, 1, Duration::from_secs(1)).await.unwrap();
        let user = ChatMessage { role: "user".into(), content: "a secret".into(), extra: Map::new() };
        lease.finish(vec![user], "noted".into(), Vec::new(), true, "task-1", DataClass::Secret);
        let view = sessions.get(&owner("c"), &joined.id).unwrap();
        assert_eq!((view.message_count, view.limits.idle_expiry_s), (2, 2 * 3600), "a secret turn joined it");
        assert_eq!(view.expires_at, view.last_used_at + 2 * 3600, "two hours after its last turn");

        // In the store: each row expires when the session does.
        store.flush().await;
        let rows = store.sessions().await;
        for id in [&born.id, &joined.id, &plain.id] {
            let r = &rows.iter().find(|s| s.row.session_id == *id).unwrap().row;
            assert_eq!(r.expires_at_ms, expires_at_ms(&sessions, id), "{id}");
        }
        let row = |id: &str| rows.iter().find(|s| s.row.session_id == id).unwrap().row.clone();
        assert_eq!(row(&joined.id).idle_expiry_ms, 2 * HOUR_MS, "the lowered idle expiry is stored");
        assert_eq!(row(&joined.id).expires_at_ms, row(&joined.id).last_used_ms + 2 * HOUR_MS);
        assert_eq!(row(&plain.id).expires_at_ms, row(&plain.id).created_at_ms + 24 * HOUR_MS);

        // Swept from memory at that age, not before.
        let first = expires_at_ms(&sessions, &born.id).min(expires_at_ms(&sessions, &joined.id));
        let last = expires_at_ms(&sessions, &born.id).max(expires_at_ms(&sessions, &joined.id));
        assert_eq!(swept_at(&sessions, first - 1).len(), 3);
        assert_eq!(swept_at(&sessions, last), BTreeSet::from([plain.id.clone()]));
        // And the store's retention pass deletes their rows, history
        // included, then.
        let c = rusqlite::Connection::open(&db).unwrap();
        let count = |sql: &str| -> i64 { c.query_row(sql, [], |r| r.get(0)).unwrap() };
        assert_eq!(count("SELECT COUNT(*) FROM session_messages"), 2);
        assert_eq!(crate::store::sessions::purge_expired(&c, last + 1, 100).unwrap(), 2);
        assert_eq!(count("SELECT COUNT(*) FROM session_messages"), 0);
        let left: String = c.query_row("SELECT session_id FROM sessions", [], |r| r.get(0)).unwrap();
        assert_eq!(left, plain.id);
    }
}
