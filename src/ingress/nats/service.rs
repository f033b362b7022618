//! The `edgeway` NATS micro service: `{prefix}.chat` (streamed
//! request/reply), `{prefix}.cancel` and `{prefix}.resume`, found by
//! `$SRV.PING/INFO/STATS`.
//!
//! A chat request is the shared request JSON with the caller's credential
//! in a header (`Authorization: Bearer …` or `X-Api-Key`). Its events (the
//! JSON of [`crate::ingress::render`], contiguous `seq` from 0, one
//! terminal `done`/`error`) are published in order to the request's reply
//! subject; each message names its event type in the `Edgeway-Event`
//! header. The reply subject must be an inbox (`[nats] reply_prefixes`,
//! `_INBOX.` by default): edgeway publishes with its own bus rights, so a
//! request naming any other subject (`{prefix}.events.…`, another
//! service's) is refused and nothing is published to it.
//!
//! # Caller liveness
//! Every non-terminal message is published with a reply subject of
//! edgeway's own (`{inbox}.{token}`, a random 128-bit token per stream; a
//! request whose reply subject lies under edgeway's own inbox is refused). When the caller has stopped listening (it
//! unsubscribed from its inbox or its connection closed), the NATS server
//! answers such a message at once with a `503 no responders` status, and
//! the task is cancelled: the engine is freed at the next event (unless
//! the request said `on_disconnect: "continue"`: then the task runs on and
//! the caller reads it again with `{prefix}.resume`). While a
//! task produces no event (queued, long prompt processing) an empty
//! `Edgeway-Event: keepalive` message is sent every `keepalive_ms` to the
//! same effect. A stream that cannot publish for `caller_timeout_ms` (the
//! bus is down) is cancelled too.
//!
//! # Cancel safety
//! A reply stream owns its [`TaskStream`]: if the relay task ends for any
//! reason (caller gone, shutdown, panic) the stream is dropped and the task
//! is cancelled, so no engine keeps generating for nobody.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::service::{endpoint::Endpoint, Request, ServiceExt};
use async_nats::{HeaderMap, StatusCode, Subject};
use bytes::Bytes;
use futures::StreamExt;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::NatsStatus;
use crate::config::NatsConfig;
use crate::error::GatewayError;
use crate::gateway::{Call, Caller, Gateway, RequestHeaders, SubmitOptions, TaskStream};
use crate::ingress::render::{event_json, rejection_json};
use crate::task::{Ingress, TaskEvent};

/// The header that names the event type of each message on a reply stream.
pub const EVENT_HEADER: &str = "Edgeway-Event";

/// Reply streams in flight, by the token of their probe reply subject: a
/// `no responders` answer to `{inbox}.{token}` cancels that stream.
///
/// A token is 128 random bits, never a counter: every event carries its
/// probe subject, and a bus client able to answer a guessed one with a
/// `503` status would cancel another caller's stream.
#[derive(Default)]
struct Streams {
    gone: Mutex<HashMap<u128, CancellationToken>>,
}

/// 128 random bits: two v4 UUIDs (122 random bits each) with their fixed
/// version and variant bits moved apart, so that every bit of the XOR is
/// random.
fn random_token() -> u128 {
    uuid::Uuid::new_v4().as_u128() ^ uuid::Uuid::new_v4().as_u128().rotate_left(7)
}

impl Streams {
    fn register(self: &Arc<Self>) -> (u128, CancellationToken, StreamGuard) {
        let token = CancellationToken::new();
        let mut gone = self.gone.lock().expect("streams");
        let n = loop {
            let n = random_token();
            if !gone.contains_key(&n) {
                break n;
            }
        };
        gone.insert(n, token.clone());
        (n, token, StreamGuard { streams: self.clone(), n })
    }

    fn caller_gone(&self, n: u128) {
        if let Some(t) = self.gone.lock().expect("streams").get(&n) {
            t.cancel();
        }
    }

    fn len(&self) -> usize {
        self.gone.lock().expect("streams").len()
    }
}

/// Removes a stream from [`Streams`] when its relay ends, however it ends.
struct StreamGuard {
    streams: Arc<Streams>,
    n: u128,
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.streams.gone.lock().expect("streams").remove(&self.n);
    }
}

/// What every handler needs.
pub(super) struct Ctx {
    pub(super) gw: Arc<Gateway>,
    /// The bus state: a reply stream ends when the bus has been away too long.
    pub(super) status: NatsStatus,
    pub(super) cfg: NatsConfig,
    pub(super) client: async_nats::Client,
    /// `{inbox}`: probe replies come back on `{inbox}.{token}`.
    pub(super) probe_inbox: String,
    streams: Arc<Streams>,
    pub(super) shutdown: CancellationToken,
}

/// Registers the service and serves its endpoints until `shutdown`. The
/// subscriptions are made even while the bus is down; the client sends them
/// when it connects and again after every reconnect.
pub async fn run(
    client: async_nats::Client,
    cfg: NatsConfig,
    gw: Arc<Gateway>,
    status: NatsStatus,
    tracker: TaskTracker,
    shutdown: CancellationToken,
) {
    let metadata = HashMap::from([
        ("node_id".to_string(), gw.config().node_id.clone()),
        ("prefix".to_string(), cfg.prefix.clone()),
        ("events".to_string(), if cfg.events { cfg.subject("events.>") } else { String::new() }),
    ]);
    let service = client
        .service_builder()
        .description("edgeway edge AI gateway: streamed chat completions, cancel")
        .metadata(metadata)
        .queue_group(&cfg.queue_group)
        .start("edgeway", env!("CARGO_PKG_VERSION"))
        .await;
    let service = match service {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "cannot register the NATS service");
            return;
        }
    };
    let endpoint = |name: &str, what: &str| {
        service
            .endpoint_builder()
            .name(name)
            .metadata(HashMap::from([("description".to_string(), what.to_string())]))
            .add(cfg.subject(name))
    };
    let chat = endpoint("chat", "request JSON in; accepted, delta…, done|error events to the reply subject").await;
    let cancel = endpoint("cancel", "{\"request_id\": …} cancels that task of the caller's application").await;
    let resume = endpoint(
        "resume",
        "{\"request_id\": …, \"from_seq\": n} streams that task's events again from seq n to the reply subject",
    )
    .await;
    // Tasks other nodes of the pool forward here (signed with the pool's
    // key; see `forward`): this node's own subjects.
    let node = node_endpoints(&service, &cfg, &gw).await;
    let (mut node_chat, mut node_cancel) = match node {
        Ok(Some((c, x))) => (Some(c), Some(x)),
        Ok(None) => (None, None),
        Err(e) => {
            tracing::error!(error = %e, "cannot subscribe the node's forwarding endpoints");
            (None, None)
        }
    };
    let probe_inbox = client.new_inbox();
    let probes = client.subscribe(format!("{probe_inbox}.*")).await;
    let (mut chat, mut cancel, mut resume, mut probes) = match (chat, cancel, resume, probes) {
        (Ok(c), Ok(x), Ok(r), Ok(p)) => (c, x, r, p),
        (c, x, r, p) => {
            let e = [
                c.err().map(|e| e.to_string()),
                x.err().map(|e| e.to_string()),
                r.err().map(|e| e.to_string()),
                p.err().map(|e| e.to_string()),
            ];
            tracing::error!(error = ?e, "cannot subscribe the NATS endpoints");
            return;
        }
    };
    tracing::info!(chat = %cfg.subject("chat"), cancel = %cfg.subject("cancel"), "NATS service registered");
    let ctx = Arc::new(Ctx {
        gw,
        status,
        cfg: cfg.clone(),
        client: client.clone(),
        probe_inbox,
        streams: Arc::default(),
        shutdown: shutdown.clone(),
    });
    // The pool's work queue: this node pulls what it has room for.
    tracker.spawn(super::work::run(ctx.clone(), tracker.clone()));
    if let Some(js) = cfg.jetstream.clone() {
        tracker.spawn(super::lifecycle::keep_stream(
            client.clone(),
            cfg.clone(),
            js,
            ctx.status.clone(),
            shutdown.clone(),
        ));
    }
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            Some(req) = chat.next() => {
                tracker.spawn(handle_chat(ctx.clone(), req));
            }
            Some(req) = cancel.next() => {
                tracker.spawn(handle_cancel(ctx.clone(), req));
            }
            Some(req) = resume.next() => {
                tracker.spawn(handle_resume(ctx.clone(), req));
            }
            Some(req) = next(&mut node_chat) => {
                tracker.spawn(handle_node_chat(ctx.clone(), req));
            }
            Some(req) = next(&mut node_cancel) => {
                tracker.spawn(handle_node_cancel(ctx.clone(), req));
            }
            Some(msg) = probes.next() => {
                if msg.status == Some(StatusCode::NO_RESPONDERS) {
                    let token = msg.subject.rsplit('.').next().and_then(|n| u128::from_str_radix(n, 16).ok());
                    if let Some(n) = token {
                        ctx.streams.caller_gone(n);
                    }
                }
            }
            else => break,
        }
    }
    // Let the reply streams send their last events (their tasks are being
    // cancelled by the shutdown), then push everything out.
    let bounded = Duration::from_secs(2);
    let _ = tokio::time::timeout(bounded, async {
        while ctx.streams.len() > 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    let _ = tokio::time::timeout(bounded, service.stop()).await;
    let _ = tokio::time::timeout(bounded, client.flush()).await;
}

/// `{prefix}.node.{node_id}.chat` and `.cancel`, when this node has the
/// pool's key.
async fn node_endpoints(
    service: &async_nats::service::Service,
    cfg: &NatsConfig,
    gw: &Gateway,
) -> Result<Option<(Endpoint, Endpoint)>, async_nats::Error> {
    let config = gw.config();
    if config.cluster.as_ref().and_then(|c| c.key.as_ref()).is_none() {
        return Ok(None);
    }
    let add = |what: &str, about: &str| {
        service
            .endpoint_builder()
            .name(format!("node_{what}"))
            .metadata(HashMap::from([("description".to_string(), about.to_string())]))
            .add(super::forward::node_subject(cfg, &config.node_id, what))
    };
    let chat = add("chat", "a task another node of the pool forwards here (signed)").await?;
    let cancel = add("cancel", "cancels a task another node forwarded here (signed)").await?;
    Ok(Some((chat, cancel)))
}

/// The next request of an endpoint that may not be there (never, then).
async fn next(e: &mut Option<Endpoint>) -> Option<Request> {
    match e {
        Some(e) => e.next().await,
        None => std::future::pending().await,
    }
}

/// The caller's credential: `Authorization: Bearer …` (or a bare value) or
/// `X-Api-Key`, header names compared without case.
/// The first value of header `name` (any case), if present.
fn header(headers: Option<&HeaderMap>, name: &str) -> Option<String> {
    let (_, values) = headers?.iter().find(|(n, _)| AsRef::<str>::as_ref(*n).eq_ignore_ascii_case(name))?;
    values.first().map(|v| v.as_str().trim().to_string())
}

pub fn credential(headers: Option<&HeaderMap>) -> Option<String> {
    let headers = headers?;
    let mut api_key = None;
    for (name, values) in headers.iter() {
        let Some(v) = values.first().map(|v| v.as_str().trim()) else { continue };
        let name: &str = name.as_ref();
        if name.eq_ignore_ascii_case("authorization") {
            let v = v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")).unwrap_or(v);
            return Some(v.trim().to_string());
        }
        if name.eq_ignore_ascii_case("x-api-key") {
            api_key = Some(v.to_string());
        }
    }
    api_key
}

pub(super) fn headers_for(event: &str) -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert(EVENT_HEADER, event);
    h
}

/// Headers of a terminal error: the micro-service convention
/// (`Nats-Service-Error`, `Nats-Service-Error-Code`), so generic NATS
/// service clients see a failed call.
pub(super) fn error_headers(e: &GatewayError) -> HeaderMap {
    let mut h = headers_for("error");
    let text: String = format!("{}: {}", e.code.as_str(), e.message).chars().filter(|c| !c.is_control()).collect();
    h.insert(async_nats::service::NATS_SERVICE_ERROR, text.as_str());
    h.insert(async_nats::service::NATS_SERVICE_ERROR_CODE, e.code.http_status().to_string().as_str());
    h
}

pub(super) fn to_bytes(v: &Value) -> Bytes {
    Bytes::from(serde_json::to_vec(v).expect("JSON values serialize"))
}

/// Answers a request that never became a task with its one `error` event.
async fn reject(req: &Request, request_id: Option<&str>, e: &GatewayError) {
    if req.message.reply.is_some() {
        let body = to_bytes(&rejection_json(request_id, e));
        let _ = req.respond_with_headers(Ok(body), error_headers(e)).await;
    }
}

/// Whether the request's reply subject (if any) is one edgeway may
/// publish to: an inbox ([`NatsConfig::reply_allowed`]). A request that
/// names another subject is refused, counted and logged, and nothing is
/// published to that subject (not even the refusal: that would be the
/// very publish the caller must not direct).
fn reply_refused(ctx: &Ctx, req: &Request) -> bool {
    let Some(reply) = &req.message.reply else { return false };
    // edgeway's own inbox (its probe replies) is an inbox too, but never
    // the caller's: a reply stream pointed there would answer edgeway's
    // own liveness probes.
    let own = reply.as_str().strip_prefix(ctx.probe_inbox.as_str()).is_some_and(|r| r.is_empty() || r.starts_with('.'));
    if !own && ctx.cfg.reply_allowed(reply.as_str()) {
        return false;
    }
    let e = GatewayError::invalid(format!(
        "the reply subject must be an inbox of the caller (one of {:?}); nothing was published",
        ctx.cfg.reply_prefixes
    ));
    ctx.gw.refused(Ingress::Nats, e);
    let shown: String = reply.as_str().chars().filter(|c| !c.is_control()).take(128).collect();
    tracing::warn!(subject = %req.message.subject, reply = %shown, "NATS request with a reply subject that is not an inbox refused");
    true
}

/// The reply subject a streaming endpoint answers on: `None` (refused,
/// counted, nothing published) when the request has none (`missing` says
/// what it needs) or names one that is not the caller's inbox
/// ([`reply_refused`]).
fn stream_reply(ctx: &Ctx, req: &Request, missing: &str) -> Option<Subject> {
    let Some(reply) = req.message.reply.clone() else {
        // Nobody to stream to: refuse rather than run a task for nobody.
        ctx.gw.refused(Ingress::Nats, GatewayError::invalid(missing));
        tracing::debug!(subject = %req.message.subject, "NATS request without a reply subject refused");
        return None;
    };
    (!reply_refused(ctx, req)).then_some(reply)
}

async fn handle_chat(ctx: Arc<Ctx>, req: Request) {
    let Some(reply) = stream_reply(&ctx, &req, "a chat request needs a reply subject (use request/reply)") else {
        return;
    };
    let cred = credential(req.message.headers.as_ref());
    let caller = Caller::Credential(cred.as_deref());
    let all = req.message.headers.clone();
    let opts = SubmitOptions {
        traceparent: header(req.message.headers.as_ref(), "traceparent"),
        headers: RequestHeaders::new(move |name| header(all.as_ref(), name)),
        ..Default::default()
    };
    run_chat(&ctx, req, reply, caller, opts, |_| Ok(())).await;
}

/// Prepares the request's call, lets `check` refuse or amend it, submits
/// it and relays its events to `reply`; a refusal is the one `error` event.
async fn run_chat(
    ctx: &Ctx,
    req: Request,
    reply: Subject,
    caller: Caller<'_>,
    opts: SubmitOptions,
    check: impl FnOnce(&mut Call) -> Result<(), GatewayError>,
) {
    let mut keep = false;
    let checked = |call: &mut Call| {
        keep = on_disconnect_continues(call)?;
        check(call)
    };
    match start_chat(&ctx.gw, &req.message.payload, caller, opts, checked).await {
        Ok(mut stream) => {
            if keep {
                stream.detach();
            }
            relay(ctx, Some(req), reply, stream).await
        }
        Err((request_id, e)) => reject(&req, request_id.as_deref(), &e).await,
    }
}

/// The request's `on_disconnect`: `"cancel"` (the default: a caller that
/// stops listening cancels its task) or `"continue"` (the task runs on;
/// the caller reads it again with `{prefix}.resume`).
fn on_disconnect_continues(call: &mut Call) -> Result<bool, GatewayError> {
    match call.body_mut().extra.remove("on_disconnect") {
        None | Some(Value::Null) => Ok(false),
        Some(v) if v == "cancel" => Ok(false),
        Some(v) if v == "continue" => Ok(true),
        Some(_) => Err(GatewayError::invalid("'on_disconnect' must be \"continue\" or \"cancel\"")),
    }
}

/// Prepares a chat call, lets `check` refuse or amend it, and submits it:
/// its stream, or the refusal with the request id when it got that far.
pub(super) async fn start_chat(
    gw: &Gateway,
    payload: &[u8],
    caller: Caller<'_>,
    opts: SubmitOptions,
    check: impl FnOnce(&mut Call) -> Result<(), GatewayError>,
) -> Result<TaskStream, (Option<String>, GatewayError)> {
    let mut call = gw.prepare(caller, payload, Ingress::Nats, opts).map_err(|e| (None, e))?;
    let request_id = call.body().request_id.clone();
    if let Err(e) = check(&mut call) {
        return Err((request_id, gw.refused(Ingress::Nats, e)));
    }
    gw.submit_call(call).await.map_err(|e| (request_id, e))
}

/// The check and mark of a task another node of the pool sent here
/// (forwarded, or taken from the work queue): a class above this node's
/// `max_data_class` is refused; the task is marked
/// `routing.forwarded_from`, so it is never forwarded again.
pub(super) fn forwarded_here(
    config: &crate::config::Config,
    origin_node: &str,
    call: &mut Call,
) -> Result<(), GatewayError> {
    let max = config.cluster.as_ref().map_or(crate::task::DataClass::Public, |c| c.max_data_class);
    let class = call.body().routing.as_ref().and_then(|r| r.data_class);
    if class.is_none_or(|c| c > max) {
        return Err(GatewayError::new(
            crate::error::ErrorCode::PermissionDenied,
            format!("this node may receive at most {} data from other nodes", max.as_str()),
        ));
    }
    call.body_mut().routing.get_or_insert_with(Default::default).forwarded_from = Some(origin_node.to_string());
    Ok(())
}

/// `{prefix}.node.{node_id}.chat`: a task another node forwarded. Its
/// signature names the caller's application (checked by the origin); a
/// class above this node's `max_data_class` is refused; the task is marked
/// `routing.forwarded_from` and streamed back like any NATS caller's.
async fn handle_node_chat(ctx: Arc<Ctx>, req: Request) {
    let gw = &ctx.gw;
    let Some(reply) = stream_reply(&ctx, &req, "a forward needs a reply subject") else { return };
    let config = gw.config();
    let m = &req.message;
    let fwd = match super::forward::verify(&config, m.subject.as_str(), m.headers.as_ref(), &m.payload) {
        Ok(f) => f,
        Err(e) => {
            tracing::warn!(subject = %m.subject, error = %e.message, "forward refused");
            return reject(&req, None, &gw.refused(Ingress::Nats, e)).await;
        }
    };
    if fwd.origin_node == config.node_id {
        return reject(
            &req,
            None,
            &gw.refused(Ingress::Nats, GatewayError::invalid("a node does not forward to itself")),
        )
        .await;
    }
    let opts = SubmitOptions { traceparent: header(m.headers.as_ref(), "traceparent"), ..Default::default() };
    let (origin_node, origin_task) = (fwd.origin_node, fwd.origin_task);
    run_chat(&ctx, req, reply, Caller::Identity(fwd.identity), opts, |call| {
        forwarded_here(&config, &origin_node, call)?;
        tracing::info!(%origin_node, %origin_task, "task forwarded here");
        Ok(())
    })
    .await;
}

/// `{prefix}.node.{node_id}.cancel`: the origin node cancels a task it
/// forwarded here (its client left, a deadline passed).
async fn handle_node_cancel(ctx: Arc<Ctx>, req: Request) {
    let gw = &ctx.gw;
    let config = gw.config();
    let m = &req.message;
    let fwd = match super::forward::verify(&config, m.subject.as_str(), m.headers.as_ref(), &m.payload) {
        Ok(f) => f,
        Err(e) => {
            tracing::warn!(subject = %m.subject, error = %e.message, "cancel of a forward refused");
            return;
        }
    };
    let Ok(body) = serde_json::from_slice::<CancelBody>(&m.payload) else { return };
    let c =
        gw.cancel_request(&fwd.identity, Ingress::Nats, &body.request_id, "cancelled by the node that forwarded it");
    tracing::info!(
        origin_node = %fwd.origin_node, request_id = %body.request_id,
        cancelled = c.as_ref().is_some_and(|c| c.cancelled), "forwarded task cancelled by its origin"
    );
}

/// Why a reply stream stopped before its terminal event.
enum Lost {
    NoResponders,
    BusUnavailable,
}

/// Streams the task's events to `reply` until the terminal event (sent as
/// the service response to `req`, or published when the task came from
/// the work queue) or until the caller is gone.
pub(super) async fn relay(ctx: &Ctx, req: Option<Request>, reply: Subject, mut stream: TaskStream) {
    let terminal = |body: Bytes, headers: HeaderMap| async {
        match &req {
            Some(req) => {
                let _ = req.respond_with_headers(Ok(body), headers).await;
            }
            None => {
                let _ = ctx.client.publish_with_headers(reply.clone(), headers, body).await;
            }
        }
    };
    let (n, gone, _guard) = ctx.streams.register();
    // A Subject: cloning it per message shares its bytes (a String would
    // be copied for every delta).
    let probe_reply = Subject::from(format!("{}.{n:032x}", ctx.probe_inbox));
    let cfg = &ctx.cfg;
    let mut last_sent = Instant::now();
    let mut shutting_down = false;
    let lost = loop {
        tokio::select! {
            biased;
            _ = gone.cancelled() => break Some(Lost::NoResponders),
            _ = ctx.shutdown.cancelled(), if !shutting_down => {
                // The scheduler cancels every task on shutdown; keep relaying
                // so the caller gets its terminal event.
                shutting_down = true;
                stream.cancel_handle().cancel("the gateway is shutting down", "gateway");
            }
            ev = stream.recv() => {
                let Some((seq, ev)) = ev else { break None };
                let body = to_bytes(&event_json(seq, &stream.request_id, &stream.trace_id, &ev));
                match &ev {
                    TaskEvent::Done(_) => {
                        terminal(body, headers_for("done")).await;
                        break None;
                    }
                    TaskEvent::Error { error, .. } => {
                        terminal(body, error_headers(error)).await;
                        break None;
                    }
                    TaskEvent::Accepted { .. }
                    | TaskEvent::Queued { .. }
                    | TaskEvent::Delta { .. }
                    | TaskEvent::ToolCallDelta(_)
                    | TaskEvent::Embedding { .. } => {
                        if ctx.status.unavailable_for().is_some_and(|d| d >= cfg.caller_timeout) {
                            break Some(Lost::BusUnavailable);
                        }
                        let kind = match ev {
                            TaskEvent::Accepted { .. } => "accepted",
                            TaskEvent::Queued { .. } => "queued",
                            TaskEvent::ToolCallDelta(_) => "tool_call",
                            TaskEvent::Embedding { .. } => "embedding",
                            _ => "delta",
                        };
                        let publish = ctx.client.publish_with_reply_and_headers(
                            reply.clone(),
                            probe_reply.clone(),
                            headers_for(kind),
                            body,
                        );
                        if !matches!(tokio::time::timeout(cfg.caller_timeout, publish).await, Ok(Ok(()))) {
                            break Some(Lost::BusUnavailable);
                        }
                        last_sent = Instant::now();
                    }
                }
            }
            _ = tokio::time::sleep_until(last_sent + cfg.keepalive) => {
                if ctx.status.unavailable_for().is_some_and(|d| d >= cfg.caller_timeout) {
                    break Some(Lost::BusUnavailable);
                }
                // Queued on the client while the bus is down; the check
                // above ends the stream if that lasts.
                let publish = ctx.client.publish_with_reply_and_headers(
                    reply.clone(),
                    probe_reply.clone(),
                    headers_for("keepalive"),
                    Bytes::new(),
                );
                if !matches!(tokio::time::timeout(cfg.caller_timeout, publish).await, Ok(Ok(()))) {
                    break Some(Lost::BusUnavailable);
                }
                last_sent = Instant::now();
            }
        }
    };
    if let Some(lost) = lost {
        let (label, why) = match lost {
            Lost::NoResponders => ("no_responders", "NATS caller stopped listening (no responders)"),
            Lost::BusUnavailable => ("bus_unavailable", "NATS bus unavailable to the reply stream"),
        };
        ctx.gw.metrics().nats_callers_lost.with_label_values(&[label]).inc();
        if !stream.cancels_on_drop() {
            // `on_disconnect: "continue"`, or a resumed stream: the task
            // runs on for a later resume.
            tracing::info!(task_id = %stream.task_id, reason = why, "NATS caller gone; its task continues");
            return;
        }
        tracing::info!(task_id = %stream.task_id, reason = why, "cancelling a NATS task whose caller is gone");
        stream.cancel_handle().cancel(why, "client");
    }
}

#[derive(Deserialize)]
struct CancelBody {
    request_id: String,
}

/// The caller (from the credential header) and the JSON body of a
/// `cancel` or `resume` request; `None` once the refusal is answered
/// (`shape` says what the body should be).
async fn caller_and_body<T: serde::de::DeserializeOwned>(
    gw: &Gateway,
    req: &Request,
    shape: &str,
) -> Option<(crate::task::Identity, T)> {
    let identity = match gw.authenticate(credential(req.message.headers.as_ref()).as_deref()) {
        Ok(i) => i,
        Err(e) => {
            reject(req, None, &e).await;
            return None;
        }
    };
    match serde_json::from_slice(&req.message.payload) {
        Ok(b) => Some((identity, b)),
        Err(e) => {
            reject(req, None, &GatewayError::invalid(format!("{shape}: {e}"))).await;
            None
        }
    }
}

#[derive(Deserialize)]
struct ResumeBody {
    request_id: String,
    from_seq: u64,
}

/// `{prefix}.resume`: streams the events of a task the caller's own
/// application started over NATS (by its request id) again from
/// `from_seq`, then its live tail, to the request's reply subject, as the
/// reply stream of a chat: for a caller that came back to a task started
/// with `on_disconnect: "continue"`, or to one that has ended (while its
/// events are kept). Leaving it again never cancels the task. An `error`
/// event (`INVALID_REQUEST`, `seq` = `from_seq`) when the task is unknown
/// or its events are no longer kept.
async fn handle_resume(ctx: Arc<Ctx>, req: Request) {
    let gw = &ctx.gw;
    let Some(reply) = stream_reply(&ctx, &req, "a resume needs a reply subject (use request/reply)") else {
        return;
    };
    let shape = "a resume is {\"request_id\": \"…\", \"from_seq\": n}";
    let Some((identity, body)) = caller_and_body::<ResumeBody>(gw, &req, shape).await else { return };
    let (rid, from) = (body.request_id, body.from_seq);
    match gw.find_request(&identity, Ingress::Nats, &rid).and_then(|t| gw.attach(&t, from)) {
        Some(stream) => relay(&ctx, Some(req), reply, stream).await,
        None => {
            let e = GatewayError::invalid(format!(
                "cannot resume '{rid}' from seq {from}: unknown request, or its events are no longer kept"
            ));
            let mut v = rejection_json(Some(&rid), &gw.refused(Ingress::Nats, e.clone()));
            v["seq"] = from.into();
            if req.message.reply.is_some() {
                let _ = req.respond_with_headers(Ok(to_bytes(&v)), error_headers(&e)).await;
            }
        }
    }
}

/// `{prefix}.cancel`: cancels a task that the caller's own application
/// started over NATS, by its request id (a device's or a web app's task
/// with the same id is out of its reach). Answers (when the message has
/// a reply subject) `{"request_id", "task_id", "cancelled", "status"}`
/// (`status` is the final state of a task that had already ended), or an
/// `error` event.
async fn handle_cancel(ctx: Arc<Ctx>, req: Request) {
    let gw = &ctx.gw;
    if reply_refused(&ctx, &req) {
        return;
    }
    let shape = "a cancel message is {\"request_id\": \"…\"}";
    let Some((identity, body)) = caller_and_body::<CancelBody>(gw, &req, shape).await else { return };
    let rid = body.request_id;
    let Some(c) = gw.cancel_request(&identity, Ingress::Nats, &rid, "cancelled over NATS") else {
        let e = GatewayError::invalid(format!("no known NATS task with request_id '{rid}' for this application"));
        return reject(&req, Some(&rid), &e).await;
    };
    tracing::info!(task_id = %c.task_id, request_id = %rid, cancelled = c.cancelled, "NATS cancel");
    if req.message.reply.is_some() {
        let answer = json!({
            "request_id": rid, "task_id": c.task_id, "cancelled": c.cancelled,
            "status": c.status.map(|s| s.as_str()),
        });
        let _ = req.respond_with_headers(Ok(to_bytes(&answer)), headers_for("cancel")).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_come_from_authorization_or_x_api_key() {
        let mut h = HeaderMap::new();
        h.insert("X-Api-Key", "k1");
        assert_eq!(credential(Some(&h)).as_deref(), Some("k1"));
        h.insert("authorization", "Bearer tok.en.x");
        assert_eq!(credential(Some(&h)).as_deref(), Some("tok.en.x"));
        assert_eq!(credential(None), None);
    }

    #[test]
    fn error_headers_follow_the_micro_convention_without_control_characters() {
        let e = GatewayError::new(crate::error::ErrorCode::QueueFull, "full\r\nreally");
        let h = error_headers(&e);
        assert_eq!(h.get(EVENT_HEADER).unwrap().as_str(), "error");
        assert_eq!(h.get(async_nats::service::NATS_SERVICE_ERROR).unwrap().as_str(), "QUEUE_FULL: fullreally");
        assert_eq!(h.get(async_nats::service::NATS_SERVICE_ERROR_CODE).unwrap().as_str(), "503");
    }

    #[test]
    fn a_stream_leaves_the_registry_when_its_relay_ends() {
        let s = Arc::new(Streams::default());
        let (n, gone, guard) = s.register();
        s.caller_gone(n);
        assert!(gone.is_cancelled());
        assert_eq!(s.len(), 1);
        drop(guard);
        assert_eq!(s.len(), 0);
    }
}
