//! The gateway facade: the one object every ingress calls. A call enters
//! here as (caller, body, ingress) and leaves as a [`TaskStream`] or a
//! [`GatewayError`]; a task is looked up, followed or cancelled here for an
//! [`Identity`].
//!
//! Owns, each done once and only here: authentication of a credential,
//! parsing and admission of the shared request JSON, idempotency
//! (`idempotency.rs`), the ownership check of a task (`tasks.rs`), counting
//! refused calls in `edgeway_requests_total` (admitted tasks are counted by
//! the scheduler's driver when they end), key revocation (`keys.rs`), the
//! readiness view (`readiness.rs`), crash recovery (`recovery.rs`), the
//! session API and the session turn of a call (`sessions.rs`), and
//! refusing new work while the gateway drains (`SHUTTING_DOWN`) or the store
//! cannot write (`STORE_UNAVAILABLE`).
//!
//! Does not own: any protocol (no HTTP, MQTT or NATS type appears here: the
//! bus state reaches `/ready` through [`BusStatus`]), building the
//! components or starting listeners (`crate::server`), or any policy
//! (admission, scheduler and router own theirs).

mod audit;
mod budgets;
pub mod cluster;
mod idempotency;
mod keys;
mod readiness;
mod recovery;
mod reload;
mod sessions;
mod status;
mod tasks;
mod user_data;

use idempotency::Repeat;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use sha2::{Digest, Sha256};
use tokio::sync::{broadcast, Notify};
use tracing::Instrument;

use crate::admission::{self, request::parse_body};
use crate::config::Config;
use crate::error::{ErrorCode, GatewayError};
use crate::scheduler::SchedulerHandle;
use crate::store::{Store, StoreError};
use crate::task::{Identity, Ingress, TaskRequest, TaskState};
use crate::telemetry::lifecycle::{LifecycleEvent, Recorder};
use crate::telemetry::Metrics;

// What ingresses need of the layers below, offered here so that they import
// only the facade.
/// The request shapes besides chat, read into the shared body.
pub use crate::admission::operation::{parse_completion, parse_embeddings, EncodingFormat};
pub use crate::admission::request::RequestTimeouts;
pub use crate::admission::request::DEVICE_KEY_PREFIX;
/// For an ingress that authenticates at connect time with rules of its own
/// (MQTT devices may present a JWT).
pub use crate::admission::Authenticator;
pub use crate::admission::ChatRequestBody;
pub use crate::context::sessions::{MemoryEntry, SessionView};
use crate::scheduler::Submitted;
pub use crate::scheduler::{CancelHandle, TaskStream};
pub use audit::{parse_time, AuditQuery, AuditRecord, DEFAULT_AUDIT_PAGE, MAX_AUDIT_PAGE};
pub use budgets::BudgetView;
pub use cluster::{NodeModel, NodeRecord, Pool};
pub use readiness::{ModelReadiness, Readiness};
pub use reload::{ReloadError, ReloadReport};
pub use status::{DeviceList, Status};
pub use tasks::{CancelOutcome, LiveTask, RequestCancel, TaskLookup, TaskView};
pub use user_data::UserDataReport;

/// The state of the message bus as `/ready` reports it. Implemented by the
/// bus ingress; the facade only reads it.
pub trait BusStatus: Send + Sync {
    /// The `nats` object of `/ready` (`{"state": "off"}` without a bus).
    fn report(&self) -> serde_json::Value;
}

/// Who is calling: a credential still to check, or an identity an ingress
/// established itself (an MQTT device authenticated at CONNECT).
#[derive(Debug, Clone)]
pub enum Caller<'a> {
    Credential(Option<&'a str>),
    Identity(Identity),
}

/// Per-call details that come from the protocol rather than the body.
#[derive(Debug, Clone, Default)]
pub struct SubmitOptions {
    /// The request id to use when the body names none (`x-request-id`).
    pub request_id_hint: Option<String>,
    /// The idempotency key to use when the body names none
    /// (`Idempotency-Key`).
    pub idempotency_key: Option<String>,
    /// A W3C `traceparent` the protocol carried (HTTP and NATS header, MQTT
    /// v5 user property): its trace id becomes the task's when valid.
    pub traceparent: Option<String>,
    /// The protocol's request headers (HTTP, NATS), for an application's
    /// `user_header`.
    pub headers: RequestHeaders,
}

/// Reads a request header by its (lowercase) name: how a protocol with
/// headers hands them to the facade, which knows no protocol.
#[derive(Clone, Default)]
pub struct RequestHeaders(Option<Arc<HeaderLookup>>);

/// A protocol's lookup of one header by name.
type HeaderLookup = dyn Fn(&str) -> Option<String> + Send + Sync;

impl RequestHeaders {
    pub fn new(get: impl Fn(&str) -> Option<String> + Send + Sync + 'static) -> RequestHeaders {
        RequestHeaders(Some(Arc::new(get)))
    }

    pub fn get(&self, name: &str) -> Option<String> {
        self.0.as_ref().and_then(|get| get(name))
    }
}

impl std::fmt::Debug for RequestHeaders {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() { "RequestHeaders(..)" } else { "RequestHeaders(none)" })
    }
}

/// An authenticated, parsed call that is not submitted yet (see
/// [`Gateway::prepare`]).
pub struct Call {
    identity: Identity,
    body: ChatRequestBody,
    ingress: Ingress,
    request_id_hint: Option<String>,
    traceparent: Option<String>,
    /// Earlier messages of the conversation the client holds by id (a
    /// Responses `previous_response_id` chain): history for the assembly.
    history: Vec<crate::task::ChatMessage>,
    /// The application's `user_header` and the value the request carried:
    /// the call's user once admission has checked it.
    header_user: Option<(String, String)>,
}

impl Call {
    pub fn body(&self) -> &ChatRequestBody {
        &self.body
    }

    /// The conversation's earlier messages, oldest first: they enter the
    /// prompt as a session's turns do, through the assembly's ladder
    /// (trimmed, not refused, when they outgrow the window).
    pub fn with_history(mut self, history: Vec<crate::task::ChatMessage>) -> Call {
        self.history = history;
        self
    }

    /// For an ingress that derives fields (MQTT: the idempotency key from
    /// the device, the queue timeout from the message expiry).
    pub fn body_mut(&mut self) -> &mut ChatRequestBody {
        &mut self.body
    }
}

/// The parts the facade is made of; built by `crate::server`.
pub struct Parts {
    pub config: Arc<Config>,
    pub auth: Authenticator,
    pub scheduler: SchedulerHandle,
    pub store: Store,
    pub recorder: Recorder,
    pub metrics: Arc<Metrics>,
    pub bus: Arc<dyn BusStatus>,
    /// The engine processes edgeway runs (`[engines.NAME.process]`), for
    /// `/ready`.
    pub processes: crate::engine::supervisor::Processes,
    /// Which engine instance has its model loaded, for `/ready` and
    /// `/v1/models`.
    pub residency: crate::engine::residency::Residency,
}

/// The facade. Shared behind an `Arc`; every field is private so that an
/// ingress can do only what the methods offer.
pub struct Gateway {
    /// The configuration in force; a reload swaps it (`reload.rs`). A call
    /// reads one snapshot and keeps it: what it was admitted with.
    config: std::sync::RwLock<Arc<Config>>,
    /// The reloads: one at a time, their count and the last one's time.
    reloads: reload::Reloads,
    auth: Authenticator,
    scheduler: SchedulerHandle,
    store: Store,
    recorder: Recorder,
    metrics: Arc<Metrics>,
    started: Instant,
    bus: Arc<dyn BusStatus>,
    processes: crate::engine::supervisor::Processes,
    residency: crate::engine::residency::Residency,
    /// Set when the gateway starts to drain before it stops: new work is
    /// refused (`SHUTTING_DOWN`) and `/ready` answers 503.
    draining: AtomicBool,
    /// Parts of an ingress that stopped working ([`Gateway::ingress_failed`]).
    ingress_faults: std::sync::Mutex<Vec<String>>,
    /// Calls between the drain check and the queue (see [`Gateway::admissions_settled`]).
    admitting: Admissions,
    sessions: Arc<crate::context::sessions::Sessions>,
    /// The last minutes of traffic, for the status view.
    history: Arc<status::History>,
    /// The connected devices, once the MQTT ingress offers them.
    devices: std::sync::OnceLock<Arc<dyn status::DeviceList>>,
    /// The connection to an external MQTT broker (`[mqtt] mode =
    /// "external"`), set once by the MQTT ingress.
    mqtt_bus: std::sync::OnceLock<Arc<dyn BusStatus>>,
    /// The node pool, once the registry offers it (`[cluster]`).
    pool: std::sync::OnceLock<Arc<cluster::Pool>>,
    /// The engines' tokenizers and their per-text caches, for assembly.
    tokenizers: crate::context::tokens::Tokenizers,
}

/// Counts the calls in [`Gateway::submit_call`], so that a drain can wait
/// for those that passed its check just before it began: they are queued
/// before the drain parks or follows what is queued, never after.
#[derive(Default)]
struct Admissions {
    count: AtomicUsize,
    done: Notify,
}

struct Admitting<'a>(&'a Admissions);

impl Admissions {
    fn enter(&self) -> Admitting<'_> {
        // SeqCst with `draining`: either this call sees the drain, or the
        // drain sees this call.
        self.count.fetch_add(1, Ordering::SeqCst);
        Admitting(self)
    }
}

impl Drop for Admitting<'_> {
    fn drop(&mut self) {
        if self.0.count.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.done.notify_waiters();
        }
    }
}

/// Refuses a body that says another node forwarded it: only the NATS
/// ingress says so, for a forward signed with the pool's key.
fn unforwarded(body: ChatRequestBody) -> Result<ChatRequestBody, GatewayError> {
    if body.routing.as_ref().is_some_and(|r| r.forwarded_from.is_some()) {
        return Err(GatewayError::invalid("'routing.forwarded_from' is set by edgeway only"));
    }
    Ok(body)
}

/// How long a caller refused for a store that cannot write is told to wait.
const STORE_RETRY_AFTER_MS: u64 = 5000;
/// How long a caller refused during a drain is told to wait (the restart).
const DRAIN_RETRY_AFTER_MS: u64 = 5000;

/// How often expired sessions are swept from memory.
const SESSION_SWEEP: std::time::Duration = std::time::Duration::from_secs(60);

/// The error for a write the store could not make durable.
pub(crate) fn store_failed(e: StoreError) -> GatewayError {
    tracing::error!(error = %e, "a write the caller waits for failed");
    GatewayError::new(ErrorCode::StoreUnavailable, "the task store cannot write; try again later")
        .with_retry_after(STORE_RETRY_AFTER_MS)
}

impl Gateway {
    pub fn new(p: Parts) -> Gateway {
        let sessions = Arc::new(crate::context::sessions::Sessions::new(&p.config, p.store.clone()));
        // Expired sessions leave memory within a minute even when nobody
        // creates or lists one (a facade built outside a runtime, in a unit
        // test, sweeps on access only).
        if tokio::runtime::Handle::try_current().is_ok() {
            crate::context::sessions::Sessions::sweep_every(&sessions, SESSION_SWEEP);
        }
        let history = Arc::new(status::History::new(&p.metrics));
        if tokio::runtime::Handle::try_current().is_ok() {
            status::History::sample_every(&history, p.metrics.clone());
        }
        Gateway {
            reloads: reload::Reloads::new(&p.metrics),
            config: std::sync::RwLock::new(p.config.clone()),
            auth: p.auth,
            scheduler: p.scheduler,
            store: p.store.clone(),
            recorder: p.recorder,
            metrics: p.metrics,
            started: Instant::now(),
            bus: p.bus,
            processes: p.processes,
            residency: p.residency,
            draining: AtomicBool::new(false),
            ingress_faults: Default::default(),
            admitting: Admissions::default(),
            sessions,
            history,
            devices: Default::default(),
            mqtt_bus: Default::default(),
            pool: Default::default(),
            tokenizers: crate::context::tokens::Tokenizers::new(),
        }
    }

    /// Starts the drain: from now on new work is refused with
    /// `SHUTTING_DOWN` and `/ready` answers 503; tasks already admitted go
    /// on (see `crate::server::RunningGateway::shutdown`).
    pub fn begin_drain(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// Returns once no call that passed the drain check before
    /// [`Gateway::begin_drain`] is still on its way to the queue: after it,
    /// every task such a call started is queued (to be parked) or known
    /// live (to be followed). Call after `begin_drain`.
    pub async fn admissions_settled(&self) {
        loop {
            let done = self.admitting.done.notified();
            tokio::pin!(done);
            done.as_mut().enable();
            if self.admitting.count.load(Ordering::SeqCst) == 0 {
                return;
            }
            done.await;
        }
    }

    /// Why no new task may start now, if none may: the gateway is
    /// draining, or the store cannot record it (a task must never run
    /// unrecorded).
    fn closed_to_new_work(&self) -> Option<GatewayError> {
        if self.is_draining() {
            return Some(
                GatewayError::new(ErrorCode::ShuttingDown, "the gateway is shutting down; try again shortly")
                    .with_retry_after(DRAIN_RETRY_AFTER_MS),
            );
        }
        if self.store.is_degraded() {
            return Some(
                GatewayError::new(ErrorCode::StoreUnavailable, "the task store cannot write; try again later")
                    .with_retry_after(STORE_RETRY_AFTER_MS),
            );
        }
        None
    }

    /// The `context_policy` a call of `application` runs under: the
    /// request's own (`requested`) when it names one, else the
    /// application's (the Responses API echoes it as `truncation`).
    pub fn context_policy(
        &self,
        application: &str,
        requested: Option<&str>,
    ) -> Result<crate::config::ContextPolicy, GatewayError> {
        crate::context::window::policy(&self.config(), application, requested)
    }

    /// The configuration in force now (a reload may replace it: read it
    /// once per call).
    pub fn config(&self) -> Arc<Config> {
        self.config.read().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// The Prometheus text of every metric.
    pub fn render_metrics(&self) -> String {
        self.metrics.render()
    }

    /// When this gateway started.
    pub fn started(&self) -> Instant {
        self.started
    }

    /// Every state change of every task, as it is recorded (for the bus's
    /// lifecycle events).
    pub fn subscribe_lifecycle(&self) -> broadcast::Receiver<Arc<LifecycleEvent>> {
        self.recorder.subscribe()
    }

    /// Who a credential (API key or JWT) belongs to. Not counted here: a
    /// refusal is counted by whoever refuses the call it came with.
    pub fn authenticate(&self, credential: Option<&str>) -> Result<Identity, GatewayError> {
        self.auth.authenticate(credential)
    }

    /// [`Gateway::authenticate`], with the user the application's
    /// `user_header` names (for its API keys) when the request carries it:
    /// for requests that are not calls (sessions, task lookups).
    pub fn authenticate_with(
        &self,
        credential: Option<&str>,
        headers: &RequestHeaders,
    ) -> Result<Identity, GatewayError> {
        let mut identity = self.auth.authenticate(credential)?;
        if let Some((name, user)) = self.header_user(&identity, headers) {
            admission::request::check_user_id(&name, &user)?;
            identity.user_id = Some(user);
        }
        Ok(identity)
    }

    /// The application's `user_header` and its value, when `identity`
    /// came with one of the application's API keys (a token names its own
    /// user) and the request carries the header.
    fn header_user(&self, identity: &Identity, headers: &RequestHeaders) -> Option<(String, String)> {
        let name = self.config().applications.get(&identity.application)?.user_header.clone()?;
        let key = identity.credential.as_ref()?;
        if identity.user_id.is_some() || !self.auth.is_key_of(key, &identity.application) {
            return None;
        }
        let value = headers.get(&name)?;
        Some((name, value))
    }

    /// Whether a credential (an identity's [`Identity::credential`]) has
    /// been revoked since it was accepted: for ingresses whose connections
    /// outlive one call (MQTT).
    pub fn credential_revoked(&self, digest: &[u8; 32]) -> bool {
        self.auth.is_revoked(digest)
    }

    /// Changes after every revocation: a connection that outlives one call
    /// checks [`Gateway::credential_revoked`] then.
    pub fn revocations(&self) -> tokio::sync::watch::Receiver<u64> {
        self.auth.revocations()
    }

    /// Authenticates, parses, admits and queues a call: the same path for
    /// every ingress ([`Gateway::prepare`], then [`Gateway::submit_call`]).
    pub async fn submit(
        &self,
        caller: Caller<'_>,
        body: &[u8],
        ingress: Ingress,
        opts: SubmitOptions,
    ) -> Result<TaskStream, GatewayError> {
        let call = self.prepare(caller, body, ingress, opts)?;
        self.submit_call(call).await
    }

    /// The first half of [`Gateway::submit`]: who is calling and what the
    /// body says, for an ingress that reads fields of the body before it
    /// submits (the response format, protocol options). A refusal is
    /// counted here.
    pub fn prepare(
        &self,
        caller: Caller<'_>,
        body: &[u8],
        ingress: Ingress,
        opts: SubmitOptions,
    ) -> Result<Call, GatewayError> {
        let identity = match caller {
            Caller::Identity(i) => i,
            Caller::Credential(c) => self.auth.authenticate(c).map_err(|e| self.refused(ingress, e))?,
        };
        let mut body = parse_body(body).and_then(unforwarded).map_err(|e| self.refused(ingress, e))?;
        if body.idempotency_key.is_none() {
            body.idempotency_key = opts.idempotency_key;
        }
        Ok(Call {
            header_user: self.header_user(&identity, &opts.headers),
            identity,
            body,
            ingress,
            request_id_hint: opts.request_id_hint,
            traceparent: opts.traceparent,
            history: Vec::new(),
        })
    }

    /// [`Gateway::prepare`] for a body of another shape than chat (a legacy
    /// completion, embeddings): `parse` reads it into the shared body with
    /// its operation, and whatever else the ingress needs of it (`T`).
    pub fn prepare_as<T>(
        &self,
        caller: Caller<'_>,
        body: &[u8],
        ingress: Ingress,
        opts: SubmitOptions,
        parse: impl FnOnce(&[u8]) -> Result<(ChatRequestBody, T), GatewayError>,
    ) -> Result<(Call, T), GatewayError> {
        let identity = match caller {
            Caller::Identity(i) => i,
            Caller::Credential(c) => self.auth.authenticate(c).map_err(|e| self.refused(ingress, e))?,
        };
        let (mut body, extra) =
            parse(body).and_then(|(b, x)| Ok((unforwarded(b)?, x))).map_err(|e| self.refused(ingress, e))?;
        if body.idempotency_key.is_none() {
            body.idempotency_key = opts.idempotency_key;
        }
        let call = Call {
            header_user: self.header_user(&identity, &opts.headers),
            identity,
            body,
            ingress,
            request_id_hint: opts.request_id_hint,
            traceparent: opts.traceparent,
            history: Vec::new(),
        };
        Ok((call, extra))
    }

    /// The second half of [`Gateway::submit`]: admission, idempotency and
    /// queueing. A refusal is counted, and recorded in the store, here; an
    /// ingress never counts it again.
    ///
    /// # Cancel safety
    /// Dropping the future (an HTTP client gone mid-call) before it answers
    /// ends the call's record REJECTED and leaves no queued task behind.
    pub async fn submit_call(&self, call: Call) -> Result<TaskStream, GatewayError> {
        // The caller's trace id (protocol header first, then the body's
        // `trace_id` or `metadata.trace_id`), or a new one: never a refusal.
        let (trace_id, parent_span_id) = {
            let body = &call.body;
            let field = body.extra.get("trace_id").and_then(serde_json::Value::as_str);
            let meta = body.metadata.as_ref().and_then(|m| m.get("trace_id")).and_then(serde_json::Value::as_str);
            crate::telemetry::trace::pick(call.traceparent.as_deref(), &[field, meta])
        };
        // Every log line of the call carries its trace id; the task id
        // joins once admission made one.
        let span = crate::telemetry::trace::task_span(&trace_id, None, call.body.request_id.as_deref());
        let (ingress, application) = (call.ingress, call.identity.application.clone());
        // Boxed: admission's future is large, and held by pointer it is not
        // copied into the span's wrapper and into every future that holds
        // this one (an HTTP handler's is moved several times): the copies
        // cost more than the allocation.
        let submitted = Box::pin(self.submit_traced(call, trace_id, parent_span_id)).instrument(span.clone()).await;
        if let Err(e) = &submitted {
            span.in_scope(|| {
                tracing::info!(
                    stage = "end",
                    state = "REJECTED",
                    code = e.code.as_str(),
                    ingress = ingress.as_str(),
                    %application,
                    "request refused"
                )
            });
        }
        submitted
    }

    async fn submit_traced(
        &self,
        call: Call,
        trace_id: String,
        parent_span_id: Option<String>,
    ) -> Result<TaskStream, GatewayError> {
        let Call { mut identity, mut body, ingress, request_id_hint, traceparent: _, history, header_user } = call;
        // The user a trusted header names, once it is known to be a sane
        // one: a bad one refuses the call (recorded below, without it).
        let bad_header_user =
            header_user.and_then(|(name, user)| match admission::request::check_user_id(&name, &user) {
                Ok(()) => {
                    identity.user_id = Some(user);
                    None
                }
                Err(e) => Some(e),
            });
        tracing::info!(
            stage = "access",
            ingress = ingress.as_str(),
            tenant = %identity.tenant,
            application = %identity.application,
            model = %body.model.chars().take(128).collect::<String>(),
            stream = body.stream,
            "request received"
        );
        // `edge` (today only `edge.context`) is for the assembly, not the
        // engine: read after admission, so a bad one is refused after the
        // request's other checks.
        let mut edge = body.extra.remove("edge");
        // Held until the call is queued (or refused): a drain waits for
        // every call that passed the check below before it began.
        let _admitting = self.admitting.enter();
        // While closed, a repeat still joins the task its key already has
        // (one terminal event for it); only a call that would start a task
        // is refused, counted and not recorded (the store may be what is
        // failing).
        let closed = self.closed_to_new_work();
        let model = body.model.clone();
        let request_id = body.request_id.clone().or(request_id_hint.clone());
        let refuse = |e: GatewayError| match &closed {
            Some(c) => self.refused(ingress, c.clone()),
            None => {
                self.recorder.rejected(&identity, ingress, &model, request_id.as_deref(), &trace_id, &e);
                self.refused(ingress, e)
            }
        };
        let context_policy = body.context_policy.clone();
        if let Some(e) = bad_header_user {
            return Err(refuse(e));
        }
        let mut req =
            admission::admit(&self.config(), identity.clone(), body, ingress, request_id_hint).map_err(refuse)?;
        req.trace_id = trace_id.clone();
        req.span_id = crate::telemetry::trace::new_span_id();
        req.parent_span_id = parent_span_id;
        let span = tracing::Span::current();
        span.record("task_id", req.task_id.as_str());
        span.record("request_id", req.request_id.as_str());
        // `edge.cache` is the response cache's (an opt-out); the rest of
        // `edge` is the assembly's.
        let cache_flag = crate::scheduler::cache::take_edge_flag(edge.as_mut()).map_err(refuse)?;
        let context = crate::context::inputs::parse(edge.as_ref()).map_err(refuse)?;
        // Knowledge, tool results and memory are part of the call: a repeat
        // of its idempotency key with other ones is another request, not a
        // repeat (review 14 M5). The digest changes only for calls that
        // have an `edge`; `serde_json` writes object keys sorted.
        if let Some(edge) = &edge {
            let mut h = Sha256::new();
            h.update(req.prompt_sha256.as_bytes());
            h.update(serde_json::to_vec(edge).unwrap_or_default());
            req.prompt_sha256 = hex::encode(h.finalize());
        }
        // So is the conversation it continues.
        if !history.is_empty() {
            let mut h = Sha256::new();
            h.update(req.prompt_sha256.as_bytes());
            h.update(b"history");
            h.update(serde_json::to_vec(&history).unwrap_or_default());
            req.prompt_sha256 = hex::encode(h.finalize());
        }
        let retry_of = match self.known_repeat(&req).await {
            Ok(Repeat::Join(stream)) => return Ok(stream),
            Ok(Repeat::Run { retry_of }) => retry_of,
            Err(e) => return Err(refuse(e)),
        };
        if let Some(e) = closed {
            return Err(self.refused(ingress, e));
        }
        // A spent budget refuses what would start a task (a repeat joined
        // its task above: it costs nothing). Checked against what ended
        // tasks spent: calls admitted together may pass a limit by what
        // they use (see `store::budget`).
        admission::budget::check(self.store.budgets(), &req.identity, crate::task::now_ms()).map_err(refuse)?;
        // A session turn begins here, after a repeat has joined its task
        // (a repeat is not a new turn) and before the task is recorded, so
        // that its record holds the prompt as assembled.
        let turn = self.begin_turn(&mut req, context, history, context_policy.as_deref()).await.map_err(refuse)?;
        match &req.context {
            Some(c) => tracing::info!(
                stage = "context",
                tokens = req.input_tokens_estimate,
                steps = %c.steps.join(","),
                summary_used = c.summary_used,
                "prompt assembled"
            ),
            None => tracing::info!(stage = "context", tokens = req.input_tokens_estimate, steps = "", "prompt as sent"),
        }
        self.debug_prompt(&req);
        // The response cache's key is made of the prompt as assembled (what
        // the engine would see), under the configuration in force now.
        let cache_lookup = crate::scheduler::cache::key_for(&self.config(), &req, cache_flag);
        // The turn may have waited for the one before: a drain begun
        // meanwhile refuses it as it refuses any new work.
        if let Some(e) = self.closed_to_new_work() {
            return Err(self.refused(ingress, e));
        }
        self.recorder.received(&req);
        let admitted = match &retry_of {
            // The record links the new run to the one whose end it retries.
            Some((old, code)) => format!("admitted; runs again after task {old} ended {}", code.as_str()),
            None => "admitted".to_string(),
        };
        self.recorder.transition(&req, TaskState::Validating, &admitted, None, "gateway");
        self.remember_key(&req, retry_of.as_ref().map(|(old, _)| old.as_str()));
        let meta_req = req.clone();
        let mut unqueued = Unqueued { gw: self, req: &meta_req, armed: true };
        let submitted = self.scheduler.submit_cached(req, cache_lookup).await;
        unqueued.armed = false;
        match submitted {
            Ok(Submitted::New(s)) => {
                if let Some(turn) = turn {
                    self.follow_turn(turn, &s.task_id);
                }
                Ok(s)
            }
            Ok(Submitted::Known(existing)) => {
                // Lost a race with a retry of the same key: judged as any
                // repeat, and this call's own record ends here.
                let joined = self.join_repeat(&existing, &meta_req);
                match &joined {
                    // A repeat that joins its task leaves no record of its
                    // own: the task has its one.
                    Ok(_) => {
                        let why = format!("idempotent repeat of task {}", existing.task_id);
                        self.recorder.transition(&meta_req, TaskState::Rejected, &why, None, "gateway");
                    }
                    Err(e) => self.recorder.refused(&meta_req, e.code.as_str(), e.code.as_str(), "gateway"),
                }
                if joined.is_ok() {
                    self.hand_over_key(&meta_req, &existing.task_id);
                }
                match joined {
                    Ok(Some(s)) => Ok(s),
                    // Ended and forgotten between the two looks: the store
                    // has its outcome.
                    Ok(None) => match self.known_repeat(&meta_req).await {
                        Ok(Repeat::Join(s)) => Ok(s),
                        Ok(Repeat::Run { .. }) => {
                            Err(self.refused(ingress, GatewayError::internal("the repeated task vanished")))
                        }
                        Err(e) => Err(self.refused(ingress, e)),
                    },
                    Err(e) => {
                        self.forget_key(&meta_req);
                        Err(self.refused(ingress, e))
                    }
                }
            }
            Err(e) => {
                self.recorder.refused(&meta_req, e.code.as_str(), e.code.as_str(), "scheduler");
                self.forget_key(&meta_req);
                Err(self.refused(ingress, e))
            }
        }
    }

    /// Logs the prompt as it goes to the engine, secrets filtered, when its
    /// application's `debug_prompts` is on (before its `until`) and the
    /// task is in its sample. Prompts are never logged otherwise.
    fn debug_prompt(&self, req: &TaskRequest) {
        let cfg = self.config();
        let Some(app) = cfg.applications.get(&req.identity.application) else { return };
        let Some(d) = app.debug_prompts else { return };
        if crate::task::now_ms() >= d.until_ms || !crate::telemetry::trace::sampled(&req.task_id, d.sample_rate) {
            return;
        }
        let filter = crate::context::fence::SecretFilter::of(&cfg);
        let prompts: Vec<&str> = app.system_prompt.as_deref().into_iter().collect();
        let mut filtered = 0;
        let lines: Vec<String> = req
            .messages
            .iter()
            .map(|m| {
                let text = match &m.content {
                    serde_json::Value::String(s) => s.clone(),
                    other => other.to_string(),
                };
                let (text, n) = filter.filter(&text, &req.identity.tenant, &prompts);
                filtered += n;
                format!("{}: {text}", m.role)
            })
            .collect();
        tracing::info!(
            stage = "prompt_debug",
            application = %app.name,
            filtered,
            until_ms = d.until_ms,
            prompt = %lines.join("\n"),
            "prompt (debug_prompts is on for this application)"
        );
    }

    /// Counts a call refused before it became a task and hands the error
    /// back. The facade calls it for what it refuses; an ingress calls it
    /// only for what it refuses itself, before [`Gateway::submit`] (a
    /// message too large, a missing protocol field).
    pub fn refused(&self, ingress: Ingress, e: GatewayError) -> GatewayError {
        self.metrics.requests.with_label_values(&[ingress.as_str(), e.code.as_str()]).inc();
        e
    }
}

/// Ends the record of a call whose caller went away (its future was
/// dropped) while the scheduler was queueing it: REJECTED, so that no task
/// is left VALIDATING, and its idempotency key is free again. The scheduler
/// undoes its own part (see `SchedulerHandle::submit`).
struct Unqueued<'a> {
    gw: &'a Gateway,
    req: &'a TaskRequest,
    armed: bool,
}

impl Drop for Unqueued<'_> {
    fn drop(&mut self) {
        if self.armed {
            let why = "the caller went away before the task was queued";
            let code = ErrorCode::RequestCancelled.as_str();
            self.gw.recorder.refused(self.req, code, why, "client");
            self.gw.forget_key(self.req);
        }
    }
}
