//! Task lifecycle recording: every state change of every task, whatever its
//! ingress, goes through the [`Recorder`], which writes it to the task store
//! and offers it to in-process subscribers (the NATS event publisher, tests)
//! on a bounded broadcast channel. A slow subscriber loses events (and
//! counts them) instead of slowing the request path.
//!
//! Owns: enforcing the task state machine ([`TaskState::can_move_to`]) where
//! transitions are recorded. The recorder knows the current state of every
//! live task; a transition the machine does not allow (or any after the
//! task's terminal state) is refused: not written, not published, logged,
//! counted in `edgeway_illegal_transitions_total{from,to}`, and a panic in
//! debug builds so that tests catch the code path that tried it.
//! Also charges what each task cost to its tenant's and application's
//! budgets when it ends (`crate::store::budget`): counted in
//! `edgeway_cost_total`, with the budgets' used share and warnings as
//! metrics, a warning also on the task's terminal event
//! (`budget_warnings`) and in the log.
//! Does not own: the decisions (scheduler, gateway) or the SQL (store).

use std::collections::hash_map::DefaultHasher;
use std::collections::{HashMap, VecDeque};
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex};

use prometheus::IntCounterVec;
use serde::Serialize;
use tokio::sync::broadcast;

use super::Metrics;
use crate::error::GatewayError;
use crate::store::budget::{BudgetWarning, Scope};
use crate::store::{KeyedResult, Store};
use crate::task::{Identity, Ingress, ResultMeta, TaskRequest, TaskState};

/// One state change, as published to subscribers. Never carries prompt or
/// result text.
#[derive(Debug, Clone, Serialize)]
pub struct LifecycleEvent {
    pub task_id: String,
    pub request_id: String,
    pub trace_id: String,
    pub tenant: String,
    pub application: String,
    pub user_id: Option<String>,
    pub ingress: &'static str,
    pub logical_model: String,
    pub priority: &'static str,
    pub state: TaskState,
    pub at_ms: i64,
    pub reason: String,
    pub node_id: String,
    pub instance: Option<String>,
    pub actor: &'static str,
    /// Set on terminal states.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error_code: Option<&'static str>,
    /// Set on terminal states of tasks that were queued.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub result: Option<ResultMeta>,
    /// On the terminal event of the task whose cost took a budget window
    /// past its `warn_percent` (once per window).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub budget_warnings: Vec<BudgetWarning>,
}

#[derive(Clone)]
pub struct Recorder {
    store: Store,
    tx: broadcast::Sender<Arc<LifecycleEvent>>,
    live: Arc<LiveStates>,
    /// Refused transitions, by `from` (a state, or `NONE` for a task not
    /// live) and `to`.
    illegal: IntCounterVec,
    /// The last [`RECENT_FAILURES`] tasks that ended otherwise than SUCCEEDED
    /// (and calls refused at admission), newest last, for the status page.
    /// Written only when something fails: no cost on the success path.
    failures: Arc<Mutex<VecDeque<Failure>>>,
    cost: prometheus::CounterVec,
    budget_used: prometheus::GaugeVec,
    budget_warnings: IntCounterVec,
}

/// How many recent failures the status page keeps.
pub const RECENT_FAILURES: usize = 50;
/// Reasons are cut to this many characters in the failure ring.
const FAILURE_REASON_CHARS: usize = 200;

/// A task that ended otherwise than SUCCEEDED, or a call refused at admission.
#[derive(Debug, Clone, Serialize)]
pub struct Failure {
    pub at_ms: i64,
    /// For the tenant filter of the status view; not shown.
    #[serde(skip)]
    pub tenant: String,
    pub task_id: String,
    pub application: String,
    pub ingress: &'static str,
    pub logical_model: String,
    pub state: TaskState,
    /// The error code (`REQUEST_CANCELLED`, `ENGINE_TIMEOUT`, …).
    pub code: &'static str,
    pub reason: String,
}

/// Events buffered per subscriber before the slowest one starts losing them.
const BROADCAST_CAPACITY: usize = 4096;

/// Lock shards of the live-state table: transitions of different tasks
/// (recorded from many driver tasks at once) rarely wait on each other.
const SHARDS: usize = 16;

/// The current state of every live task; a task leaves at its terminal
/// state, so the table holds only the tasks in flight.
struct LiveStates {
    shards: Vec<Mutex<HashMap<String, TaskState>>>,
}

impl LiveStates {
    fn new() -> LiveStates {
        LiveStates { shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect() }
    }

    fn shard(&self, task_id: &str) -> std::sync::MutexGuard<'_, HashMap<String, TaskState>> {
        let mut h = DefaultHasher::new();
        task_id.hash(&mut h);
        let m = &self.shards[(h.finish() as usize) % SHARDS];
        // A panic while the lock was held (none writes half a state) leaves
        // the table consistent.
        m.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Recorder {
    pub fn new(store: Store, metrics: &Metrics) -> Recorder {
        let (tx, _) = broadcast::channel(BROADCAST_CAPACITY);
        Recorder {
            store,
            tx,
            live: Arc::new(LiveStates::new()),
            illegal: metrics.illegal_transitions.clone(),
            failures: Arc::default(),
            cost: metrics.cost.clone(),
            budget_used: metrics.budget_used.clone(),
            budget_warnings: metrics.budget_warnings.clone(),
        }
    }

    /// The current state of a live task (`None` once it has ended).
    pub fn state_of(&self, task_id: &str) -> Option<TaskState> {
        self.live.shard(task_id).get(task_id).copied()
    }

    /// The recent failures, oldest first (at most [`RECENT_FAILURES`]).
    pub fn recent_failures(&self) -> Vec<Failure> {
        self.failures.lock().unwrap_or_else(|e| e.into_inner()).iter().cloned().collect()
    }

    fn failed(&self, f: Failure) {
        let mut ring = self.failures.lock().unwrap_or_else(|e| e.into_inner());
        if ring.len() == RECENT_FAILURES {
            ring.pop_front();
        }
        ring.push_back(f);
    }

    /// Moves `task_id` to `to` if the state machine allows it from the
    /// task's current state (`RECEIVED` only for a task not live yet), and
    /// then runs `write` (under the task's lock, so the store sees the
    /// transitions of a task in the order they were checked). Refuses it
    /// otherwise; returns whether it was recorded.
    fn advance(&self, task_id: &str, to: TaskState, reason: &str, write: impl FnOnce()) -> bool {
        let from = {
            let mut live = self.live.shard(task_id);
            let from = live.get(task_id).copied();
            let legal = match from {
                None => to == TaskState::Received,
                Some(f) => f.can_move_to(to),
            };
            if legal {
                if to.is_terminal() {
                    live.remove(task_id);
                } else if let Some(state) = live.get_mut(task_id) {
                    *state = to;
                } else {
                    live.insert(task_id.to_string(), to);
                }
                write();
                return true;
            }
            from
        };
        self.refuse(task_id, from, to, reason);
        false
    }

    #[cold]
    fn refuse(&self, task_id: &str, from: Option<TaskState>, to: TaskState, reason: &str) {
        let from = from.map_or("NONE", TaskState::as_str);
        self.illegal.with_label_values(&[from, to.as_str()]).inc();
        tracing::error!(task_id, from, to = to.as_str(), reason, "illegal task state transition refused");
        // The lock is released: the panic poisons nothing.
        debug_assert!(false, "illegal task state transition {from} -> {} of task {task_id} ({reason})", to.as_str());
    }

    /// Takes over a task that the last run left unfinished, at the state
    /// the store has for it (recovery, at start-up, before new work), so
    /// that what recovery writes next is checked like any transition.
    pub fn adopt(&self, task_id: &str, state: TaskState) {
        if state.is_terminal() {
            return;
        }
        self.live.shard(task_id).insert(task_id.to_string(), state);
    }

    /// Ends an adopted task that recovery cannot resume (with no
    /// subscribers told: nobody waits for it in this run).
    pub fn end_recovered(&self, meta: &ResultMeta, reason: &str, error_code: &'static str) {
        self.advance(&meta.task_id, meta.status, reason, || {
            self.store.finish(meta, reason, None, "gateway", Some(error_code), None, KeyedResult::None, None);
        });
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    pub fn subscribe(&self) -> broadcast::Receiver<Arc<LifecycleEvent>> {
        self.tx.subscribe()
    }

    /// Records a new task at RECEIVED.
    pub fn received(&self, req: &TaskRequest) {
        let (state, reason, actor) = (TaskState::Received, req.ingress.as_str(), "client");
        let recorded = self.advance(&req.task_id, state, reason, || {
            self.store.new_task(req);
            self.store.transition(&req.task_id, state, reason, None, actor);
        });
        if recorded {
            self.publish(req, state, reason, None, actor, None, None);
        }
    }

    /// Records a state change; a terminal one that has result metadata
    /// goes through [`Self::finished`] instead.
    pub fn transition(
        &self,
        req: &TaskRequest,
        state: TaskState,
        reason: &str,
        instance: Option<&str>,
        actor: &'static str,
    ) {
        let recorded = self.advance(&req.task_id, state, reason, || {
            self.store.transition(&req.task_id, state, reason, instance, actor);
        });
        if recorded {
            self.publish(req, state, reason, instance, actor, None, None);
        }
    }

    /// Ends a validated task REJECTED with `code` (the scheduler refused
    /// it, or its caller went away before it was queued), with its audit
    /// record: a refused call is audited wherever it is refused.
    pub fn refused(&self, req: &TaskRequest, code: &'static str, reason: &str, actor: &'static str) {
        let state = TaskState::Rejected;
        let recorded = self.advance(&req.task_id, state, reason, || {
            self.store.refuse(req, reason, actor, code);
        });
        if !recorded {
            return;
        }
        self.failed(Failure {
            at_ms: crate::task::now_ms(),
            task_id: req.task_id.clone(),
            tenant: req.identity.tenant.clone(),
            application: req.identity.application.clone(),
            ingress: req.ingress.as_str(),
            logical_model: req.logical_model.clone(),
            state,
            code,
            reason: reason.chars().take(FAILURE_REASON_CHARS).collect(),
        });
        self.publish(req, state, reason, None, actor, Some(code), None);
    }

    /// Records the terminal state with the result metadata.
    #[allow(clippy::too_many_arguments)]
    pub fn finished(
        &self,
        req: &TaskRequest,
        meta: &ResultMeta,
        reason: &str,
        instance: Option<&str>,
        actor: &'static str,
        error_code: Option<&'static str>,
        result_text: Option<String>,
    ) {
        let keyed = match &req.idempotency_key {
            None => KeyedResult::None,
            // A device that sent no key never chose one (the ingress
            // derived it from the request id): its answer goes to the file
            // only where the policy keeps text; a repeat meanwhile is
            // answered from memory. A device that sent its own key asked
            // for the replay, as any caller does (review 15 L4).
            Some(k) if crate::task::is_derived_device_key(k) && !self.store.stores_prompts() => KeyedResult::Outcome,
            Some(_) => KeyedResult::OutcomeAndText,
        };
        let recorded = self.advance(&req.task_id, meta.status, reason, || {
            self.store.finish(
                meta,
                reason,
                instance,
                actor,
                error_code,
                result_text,
                keyed,
                req.identity.credential.as_ref(),
            );
        });
        if let (true, Some(code)) = (recorded && meta.status != TaskState::Succeeded, error_code) {
            self.failed(Failure {
                at_ms: crate::task::now_ms(),
                task_id: req.task_id.clone(),
                tenant: req.identity.tenant.clone(),
                application: req.identity.application.clone(),
                ingress: req.ingress.as_str(),
                logical_model: req.logical_model.clone(),
                state: meta.status,
                code,
                reason: reason.chars().take(FAILURE_REASON_CHARS).collect(),
            });
        }
        if recorded {
            let warnings = self.charge(req, meta);
            // Lifecycle events carry no answer text, and tool-call
            // arguments are answer text; names are made safe.
            let mut public = None;
            if !meta.tool_calls.is_empty() {
                let mut m = meta.clone();
                m.tool_calls = meta.tool_calls.iter().map(|c| c.for_record(false)).collect();
                public = Some(m);
            }
            let shown = public.as_ref().unwrap_or(meta);
            self.publish_with(req, meta.status, reason, instance, actor, error_code, Some(shown), warnings);
        }
    }

    /// Charges a finished task's tokens and cost to its tenant's and
    /// application's budgets (in memory; the store writes them with the
    /// terminal state), counts the cost and the budgets' used shares, and
    /// returns the warnings the charge set off (logged here).
    fn charge(&self, req: &TaskRequest, meta: &ResultMeta) -> Vec<BudgetWarning> {
        // A task another node forwarded here is charged there, on the node
        // its caller called (at its pool instance's prices): charged here
        // too, its tokens would count twice in the pool.
        if req.routing.forwarded_from.is_some() {
            return Vec::new();
        }
        // A cache hit ran no engine: it spends no budget (review 16 M2);
        // its usage is the stored answer's, reported again.
        let tokens =
            if meta.cache_hit { 0 } else { u64::from(meta.usage.input_tokens) + u64::from(meta.usage.output_tokens) };
        let cost = if meta.cache_hit { 0.0 } else { meta.cost.unwrap_or(0.0) };
        let who = &req.identity;
        let c = self.store.budgets().charge(&who.tenant, &who.application, tokens, cost, crate::task::now_ms());
        self.cost.with_label_values(&[&c.tenant_label, &c.application_label]).inc_by(cost.max(0.0));
        let app_label = |scope: Scope| if scope == Scope::Tenant { "*" } else { c.application_label.as_str() };
        for u in &c.used {
            self.budget_used.with_label_values(&[&c.tenant_label, app_label(u.scope), u.period.as_str()]).set(u.ratio);
        }
        for w in &c.warnings {
            let scope = if w.scope == Scope::Tenant.as_str() { Scope::Tenant } else { Scope::Application };
            self.budget_warnings.with_label_values(&[&c.tenant_label, app_label(scope), w.window]).inc();
            tracing::warn!(
                stage = "budget",
                scope = w.scope,
                name = %w.name,
                window = w.window,
                used_ratio = w.used_ratio,
                warn_percent = w.warn_percent,
                resets_at = %w.resets_at,
                task_id = %req.task_id,
                "a budget passed its warning threshold"
            );
        }
        c.warnings
    }

    /// Records a call refused at admission (before it had a validated task):
    /// a new task that went RECEIVED → VALIDATING → REJECTED at once, so it
    /// never becomes live.
    pub fn rejected(
        &self,
        who: &Identity,
        ingress: Ingress,
        model: &str,
        request_id: Option<&str>,
        trace_id: &str,
        e: &GatewayError,
    ) {
        let task_id = self.store.rejected(who, ingress, model, trace_id, e);
        self.failed(Failure {
            at_ms: crate::task::now_ms(),
            task_id: task_id.clone(),
            tenant: who.tenant.clone(),
            application: who.application.clone(),
            ingress: ingress.as_str(),
            // The model a refused call named is the caller's text: cut.
            logical_model: model.chars().take(128).collect(),
            state: TaskState::Rejected,
            code: e.code.as_str(),
            reason: e.message.chars().take(FAILURE_REASON_CHARS).collect(),
        });
        if self.tx.receiver_count() == 0 {
            return;
        }
        let _ = self.tx.send(Arc::new(LifecycleEvent {
            task_id,
            request_id: request_id.unwrap_or_default().to_string(),
            trace_id: trace_id.to_string(),
            tenant: who.tenant.clone(),
            application: who.application.clone(),
            user_id: who.user_id.clone(),
            ingress: ingress.as_str(),
            logical_model: model.chars().take(128).collect(),
            priority: "",
            state: TaskState::Rejected,
            at_ms: crate::task::now_ms(),
            reason: e.message.clone(),
            node_id: self.store.node_id().to_string(),
            instance: None,
            actor: "gateway",
            error_code: Some(e.code.as_str()),
            result: None,
            budget_warnings: Vec::new(),
        }));
    }

    #[allow(clippy::too_many_arguments)]
    fn publish(
        &self,
        req: &TaskRequest,
        state: TaskState,
        reason: &str,
        instance: Option<&str>,
        actor: &'static str,
        error_code: Option<&'static str>,
        meta: Option<&ResultMeta>,
    ) {
        self.publish_with(req, state, reason, instance, actor, error_code, meta, Vec::new());
    }

    #[allow(clippy::too_many_arguments)]
    fn publish_with(
        &self,
        req: &TaskRequest,
        state: TaskState,
        reason: &str,
        instance: Option<&str>,
        actor: &'static str,
        error_code: Option<&'static str>,
        meta: Option<&ResultMeta>,
        budget_warnings: Vec<BudgetWarning>,
    ) {
        if self.tx.receiver_count() == 0 {
            return;
        }
        let _ = self.tx.send(Arc::new(LifecycleEvent {
            task_id: req.task_id.clone(),
            request_id: req.request_id.clone(),
            trace_id: req.trace_id.clone(),
            tenant: req.identity.tenant.clone(),
            application: req.identity.application.clone(),
            user_id: req.identity.user_id.clone(),
            ingress: req.ingress.as_str(),
            logical_model: req.logical_model.clone(),
            priority: req.priority.as_str(),
            state,
            at_ms: crate::task::now_ms(),
            reason: reason.to_string(),
            node_id: self.store.node_id().to_string(),
            instance: instance.map(str::to_string),
            actor,
            error_code,
            result: meta.cloned(),
            budget_warnings,
        }));
    }
}

#[cfg(test)]
mod tests {
    use std::panic::{catch_unwind, AssertUnwindSafe};

    use super::*;
    use TaskState::*;

    struct Setup {
        _dir: tempfile::TempDir,
        store: Store,
        metrics: Metrics,
        rec: Recorder,
    }

    fn setup() -> Setup {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("edgeway.db"), "n1", false).unwrap();
        let metrics = Metrics::new();
        let rec = Recorder::new(store.clone(), &metrics);
        Setup { _dir: dir, store, metrics, rec }
    }

    fn request() -> TaskRequest {
        TaskRequest::sample(Vec::new())
    }

    fn meta(req: &TaskRequest, status: TaskState) -> ResultMeta {
        ResultMeta::bare(&req.request_id, &req.task_id, status, &req.logical_model, "n1")
    }

    fn illegal(m: &Metrics, from: &str, to: TaskState) -> u64 {
        m.illegal_transitions.with_label_values(&[from, to.as_str()]).get()
    }

    /// Runs an illegal call: in debug builds it must panic (so tests catch
    /// the code path), in release builds it must not.
    fn refused(f: impl FnOnce()) {
        let r = catch_unwind(AssertUnwindSafe(f));
        assert_eq!(r.is_err(), cfg!(debug_assertions), "debug builds fail on an illegal transition");
    }

    async fn states(store: &Store, id: &str) -> (TaskState, Vec<TaskState>) {
        store.flush().await;
        let rec = store.get(id).await.unwrap().expect("task stored");
        (rec.state, rec.transitions.iter().map(|t| t.state).collect())
    }

    /// The terminal state, its transition and its error code are one
    /// write, so a reader (`GET /v1/tasks/{id}`) never sees CANCELLED
    /// without REQUEST_CANCELLED. They were two writes, and a batch could
    /// commit between them (the e2e test of a cancel saw `error_code` None
    /// once). A degraded store that may buffer only one write shows it:
    /// with two writes the second was dropped.
    #[tokio::test]
    async fn the_terminal_state_and_its_error_code_are_one_write() {
        let s = setup();
        let req = request();
        s.rec.received(&req);
        for st in [Validating, Queued, Dispatching, Running] {
            s.rec.transition(&req, st, "test", None, "scheduler");
        }
        s.store.flush().await;
        // The same file again, with a buffer of one write (the bound holds
        // while healthy too, so the start of the task is written above).
        let opts = crate::store::StoreOptions { max_buffered_writes: 1, ..Default::default() };
        let store = Store::open_with(&s._dir.path().join("edgeway.db"), "n1", false, opts).unwrap();
        let rec = Recorder::new(store.clone(), &Metrics::new());
        rec.adopt(&req.task_id, Running);
        store.set_writer_pragma("query_only", 1).await;
        rec.finished(&req, &meta(&req, Cancelled), "cancelled", None, "client", Some("REQUEST_CANCELLED"), None);
        store.flush().await;
        assert_eq!(store.health().dropped_writes(), 0, "the end of a task is one write");
        store.set_writer_pragma("query_only", 0).await;
        let (state, seen) = states(&store, &req.task_id).await;
        assert_eq!(state, Cancelled);
        assert_eq!(seen.last(), Some(&Cancelled));
        let rec = store.get(&req.task_id).await.unwrap().unwrap();
        assert_eq!(rec.error_code.as_deref(), Some("REQUEST_CANCELLED"));
    }

    #[tokio::test]
    async fn a_legal_life_is_recorded_and_published() {
        let s = setup();
        let mut sub = s.rec.subscribe();
        let req = request();
        s.rec.received(&req);
        for st in [Validating, Queued, Dispatching, Running, Streaming] {
            s.rec.transition(&req, st, "test", None, "scheduler");
        }
        s.rec.finished(&req, &meta(&req, Succeeded), "finished (stop)", None, "engine", None, None);
        let (state, seen) = states(&s.store, &req.task_id).await;
        assert_eq!(state, Succeeded);
        assert_eq!(seen, [Received, Validating, Queued, Dispatching, Running, Streaming, Succeeded]);
        let mut published = Vec::new();
        while let Ok(e) = sub.try_recv() {
            published.push(e.state);
        }
        assert_eq!(published, seen);
        assert!(!s.metrics.render().contains("edgeway_illegal_transitions_total{"), "nothing refused");
    }

    #[tokio::test]
    async fn an_illegal_transition_is_refused_logged_and_counted() {
        let s = setup();
        let mut sub = s.rec.subscribe();
        let req = request();
        s.rec.received(&req);
        refused(|| s.rec.transition(&req, Running, "skips the queue", None, "engine"));
        assert_eq!(illegal(&s.metrics, "RECEIVED", Running), 1);
        assert_eq!(states(&s.store, &req.task_id).await, (Received, vec![Received]), "not written");
        assert_eq!(sub.try_recv().unwrap().state, Received);
        assert!(sub.try_recv().is_err(), "not published");

        // The refusal left the task where it was: its legal next step works.
        s.rec.transition(&req, Validating, "admitted", None, "gateway");
        assert_eq!(states(&s.store, &req.task_id).await, (Validating, vec![Received, Validating]));

        // RECEIVED twice is a task recorded twice.
        refused(|| s.rec.received(&req));
        assert_eq!(illegal(&s.metrics, "VALIDATING", Received), 1);
        // A task that was never received has no transitions to make.
        let stranger = request();
        refused(|| s.rec.transition(&stranger, Queued, "test", None, "scheduler"));
        assert_eq!(illegal(&s.metrics, "NONE", Queued), 1);
        s.store.flush().await;
        assert_eq!(s.store.get(&stranger.task_id).await.unwrap(), None);
        assert!(s.metrics.render().contains("edgeway_illegal_transitions_total{from=\"NONE\",to=\"QUEUED\"} 1"));
    }

    #[tokio::test]
    async fn a_second_terminal_state_is_refused() {
        let s = setup();
        let req = request();
        s.rec.received(&req);
        s.rec.transition(&req, Validating, "admitted", None, "gateway");
        s.rec.transition(&req, Queued, "admitted", None, "scheduler");
        s.rec.finished(&req, &meta(&req, Cancelled), "cancelled by the client", None, "client", None, None);
        refused(|| s.rec.finished(&req, &meta(&req, Failed), "engine error", None, "engine", None, None));
        refused(|| s.rec.transition(&req, Rejected, "late", None, "gateway"));
        assert_eq!(illegal(&s.metrics, "NONE", Failed), 1);
        assert_eq!(illegal(&s.metrics, "NONE", Rejected), 1);
        assert_eq!(states(&s.store, &req.task_id).await, (Cancelled, vec![Received, Validating, Queued, Cancelled]));
    }

    #[tokio::test]
    async fn recovery_writes_are_checked_from_the_stored_state() {
        let s = setup();
        // Left by the "last run": one task streaming, one validating.
        let (streaming, validating) = (request(), request());
        for (req, last) in [(&streaming, Streaming), (&validating, Validating)] {
            s.rec.received(req);
            let path = [Validating, Queued, Dispatching, Running, Streaming];
            for st in path.iter().take_while(|st| **st != last).chain([&last]) {
                s.rec.transition(req, *st, "test", None, "scheduler");
            }
        }
        // The new run knows nothing until it adopts them.
        let rec = Recorder::new(s.store.clone(), &s.metrics);
        refused(|| rec.end_recovered(&meta(&streaming, Failed), "restart", "INTERNAL_ERROR"));
        rec.adopt(&streaming.task_id, Streaming);
        rec.end_recovered(
            &meta(&streaming, Failed),
            "gateway restarted while the task was STREAMING",
            "INTERNAL_ERROR",
        );
        rec.adopt(&validating.task_id, Validating);
        rec.transition(&validating, Queued, "re-queued after a gateway restart", None, "scheduler");
        rec.transition(&validating, Dispatching, "slot granted", None, "scheduler");
        refused(|| {
            rec.finished(&validating, &meta(&validating, Succeeded), "no engine ran", None, "engine", None, None)
        });
        assert_eq!(illegal(&s.metrics, "DISPATCHING", Succeeded), 1);
        let (state, seen) = states(&s.store, &streaming.task_id).await;
        assert_eq!((state, seen.last().copied()), (Failed, Some(Failed)));
        assert_eq!(
            s.store.get(&streaming.task_id).await.unwrap().unwrap().error_code.as_deref(),
            Some("INTERNAL_ERROR")
        );
        assert_eq!(states(&s.store, &validating.task_id).await.0, Dispatching);
    }
}
