//! Forwarding between the nodes of a pool (issue 15, the routing chain's
//! edge-node step): the bus side of [`crate::engine::pool`].
//!
//! A forward is a NATS request to `{prefix}.node.{node}.chat`, served by
//! that node only (see `service`): the shared request JSON with
//! `request_id` = the origin's task id, `idempotency_key` =
//! `fwd:{origin node}:{task id}`, the task's priority, data class and what
//! is left of its first-token and total deadlines, and `stream: true`. Who
//! the task is (tenant, application, user) and where it comes from travel
//! in headers, signed with the pool's key (`[cluster] key_env`,
//! HMAC-SHA256 over the subject, time, those headers and the body): a bus
//! client without the key can neither forward nor cancel. The receiving
//! node refuses a class above its `max_data_class`, marks the task
//! `routing.forwarded_from` (it is never forwarded again) and streams its
//! events back exactly as to any NATS caller. The origin turns them into
//! engine chunks; a node that stays silent for three keepalive periods has
//! vanished and the stream ends with an error. Dropping the stream (the
//! client left, a deadline passed) unsubscribes and publishes a signed
//! cancel to `{prefix}.node.{node}.cancel`.
//!
//! Store and forward: work that no node takes now is the same message
//! published to the pool's work queue (`{prefix}.work.{model}.{class}`,
//! see `work`), with the origin's inbox signed too (`Edgeway-Reply`). The
//! origin waits, without a silence limit, until a node says it took the
//! task (`taken`, naming the node), then follows it as a forward; it
//! answers a puller's question whether it still waits, and takes its
//! message out of the stream when the task stops waiting first.
//!
//! Owns: the node and work subjects, the forward's headers, body and
//! signature, and [`NodePeers`], the engine layer's [`Peers`] on this bus. Does not
//! own: who serves what (the registry's [`Pool`]) or the reply stream
//! (`service::relay`).

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_nats::{HeaderMap, StatusCode};
use async_trait::async_trait;
use bytes::Bytes;
use futures::StreamExt;
use serde_json::{json, Value};
use sha2::Sha256;

use super::subject_token;
use crate::config::{Config, NatsConfig, Secret, WORK_MAX_AGE};
use crate::error::{ErrorCode, GatewayError};
use crate::gateway::cluster::forwarding::{EngineChunk, EngineError, EngineRequest, EngineStream, Origin, Peers};
use crate::gateway::cluster::Pool;
use crate::task::{DataClass, Identity, Priority, ToolCallDelta};

pub const ORIGIN_NODE: &str = "Edgeway-Origin-Node";
pub const ORIGIN_TASK: &str = "Edgeway-Origin-Task";
pub const TENANT: &str = "Edgeway-Tenant";
pub const APPLICATION: &str = "Edgeway-App";
pub const USER: &str = "Edgeway-User";
pub const TIME: &str = "Edgeway-Time";
pub const SIGNATURE: &str = "Edgeway-Signature";
/// Queued work only: the origin's inbox its events go to (signed).
pub const REPLY: &str = "Edgeway-Reply";
/// On the `taken` message of queued work: the node that took it.
pub const NODE: &str = "Edgeway-Node";

/// How far a forward's time may be from the receiver's clock.
const MAX_SKEW_MS: i64 = 60_000;

/// The subject node `node` serves `what` (`chat`, `cancel`) on.
pub fn node_subject(cfg: &NatsConfig, node: &str, what: &str) -> String {
    cfg.subject(&format!("node.{}.{what}", subject_token(node)))
}

/// The subject queued work of logical model `model` and data class `class`
/// waits on in the pool's work-queue stream (one subject per class, so
/// that a node pulls only the classes it may receive).
pub fn work_subject(cfg: &NatsConfig, model: &str, class: DataClass) -> String {
    cfg.subject(&format!("work.{}.{}", subject_token(model), class.as_str()))
}

/// The signed fields of a forward or its cancel.
struct Signed<'a> {
    subject: &'a str,
    /// Queued work's reply inbox; empty for a forward (not signed then).
    reply: &'a str,
    time_ms: i64,
    origin_node: &'a str,
    origin_task: &'a str,
    tenant: &'a str,
    application: &'a str,
    user: &'a str,
    body: &'a [u8],
}

impl Signed<'_> {
    fn mac(&self, key: &Secret) -> [u8; 32] {
        let time = self.time_ms.to_string();
        let fields =
            [self.subject, &time, self.origin_node, self.origin_task, self.tenant, self.application, self.user];
        let mut parts: Vec<&[u8]> = vec![b"edgeway-forward-v1\n"];
        for f in &fields {
            parts.push(f.as_bytes());
            parts.push(b"\n");
        }
        if !self.reply.is_empty() {
            parts.push(self.reply.as_bytes());
            parts.push(b"\n");
        }
        parts.push(self.body);
        crate::ingress::hmac::<Sha256>(key.expose().as_bytes(), &parts).into()
    }
}

fn now_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

fn signed_headers(key: &Secret, subject: &str, reply: &str, origin: &Origin, body: &[u8]) -> HeaderMap {
    signed_headers_at(key, subject, reply, origin, body, now_ms())
}

fn signed_headers_at(
    key: &Secret,
    subject: &str,
    reply: &str,
    origin: &Origin,
    body: &[u8],
    time_ms: i64,
) -> HeaderMap {
    // A header value is one line: a JWT's `sub` is not checked for control
    // characters as a request's user id is.
    let user: String = origin.user_id.as_deref().unwrap_or("").chars().filter(|c| !c.is_control()).collect();
    let user = user.as_str();
    let mac = Signed {
        subject,
        reply,
        time_ms,
        origin_node: &origin.node_id,
        origin_task: &origin.task_id,
        tenant: &origin.tenant,
        application: &origin.application,
        user,
        body,
    }
    .mac(key);
    let mut h = HeaderMap::new();
    h.insert(ORIGIN_NODE, origin.node_id.as_str());
    h.insert(ORIGIN_TASK, origin.task_id.as_str());
    h.insert(TENANT, origin.tenant.as_str());
    h.insert(APPLICATION, origin.application.as_str());
    if !user.is_empty() {
        h.insert(USER, user);
    }
    h.insert(TIME, time_ms.to_string().as_str());
    h.insert(SIGNATURE, hex::encode(mac).as_str());
    if !reply.is_empty() {
        h.insert(REPLY, reply);
    }
    h
}

/// A forward (or its cancel, or queued work) whose signature checked out.
pub struct Verified {
    pub origin_node: String,
    pub origin_task: String,
    /// The caller, as this node's configuration has its application.
    pub identity: Identity,
    /// When the origin signed it (Unix ms).
    pub time_ms: i64,
    /// Queued work's reply inbox.
    pub reply: Option<String>,
    /// The signature, hex: one per forward or queued attempt.
    pub signature: String,
}

fn get(h: &HeaderMap, name: &str) -> Option<String> {
    h.get(name).map(|v| v.as_str().to_string())
}

/// Checks a forward's (or cancel's) signature, time and application:
/// `AUTH_FAILED` when this node has no pool key, or the message is not
/// signed with it, or is more than a minute off; `PERMISSION_DENIED` for an
/// application this node does not have (nodes of a pool share them).
pub fn verify(cfg: &Config, subject: &str, headers: Option<&HeaderMap>, body: &[u8]) -> Result<Verified, GatewayError> {
    check(cfg, subject, headers, body, false)
}

/// As [`verify`], for work that waited in the pool's work queue: it may
/// be older than a minute (up to [`WORK_MAX_AGE`]; its own deadline is the
/// puller's to check), and it must name its reply inbox. A copy replayed
/// from the stream is run once all the same: see `work` (the claim is the
/// signature).
pub fn verify_queued(
    cfg: &Config,
    subject: &str,
    headers: Option<&HeaderMap>,
    body: &[u8],
) -> Result<Verified, GatewayError> {
    check(cfg, subject, headers, body, true)
}

fn check(
    cfg: &Config,
    subject: &str,
    headers: Option<&HeaderMap>,
    body: &[u8],
    queued: bool,
) -> Result<Verified, GatewayError> {
    let denied = |why: &str| GatewayError::new(ErrorCode::AuthFailed, format!("not a forward of this pool: {why}"));
    let key = cfg.cluster.as_ref().and_then(|c| c.key.as_ref()).ok_or_else(|| denied("this node has no pool key"))?;
    let h = headers.ok_or_else(|| denied("no headers"))?;
    let need = |name: &str| get(h, name).ok_or_else(|| denied(&format!("no {name} header")));
    let (origin_node, origin_task, tenant, application) =
        (need(ORIGIN_NODE)?, need(ORIGIN_TASK)?, need(TENANT)?, need(APPLICATION)?);
    let user = get(h, USER).unwrap_or_default();
    let reply = if queued { need(REPLY)? } else { String::new() };
    let time_ms: i64 = need(TIME)?.parse().map_err(|_| denied("bad time"))?;
    let given = need(SIGNATURE)?;
    let mac = Signed {
        subject,
        reply: &reply,
        time_ms,
        origin_node: &origin_node,
        origin_task: &origin_task,
        tenant: &tenant,
        application: &application,
        user: &user,
        body,
    }
    .mac(key);
    // Constant time: a guess learns nothing from how long the refusal took.
    let want = hex::encode(mac);
    let same = given.len() == want.len() && given.bytes().zip(want.bytes()).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0;
    if !same {
        return Err(denied("bad signature"));
    }
    let age = now_ms() - time_ms;
    let oldest = if queued { WORK_MAX_AGE.as_millis() as i64 } else { MAX_SKEW_MS };
    if age > oldest || -age > MAX_SKEW_MS {
        return Err(denied("signed too long ago, or ahead of this node's clock by more than a minute"));
    }
    let identity =
        crate::gateway::cluster::forwarded_identity(cfg, &tenant, &application, (!user.is_empty()).then_some(user))?;
    Ok(Verified { origin_node, origin_task, identity, time_ms, reply: queued.then_some(reply), signature: given })
}

/// The request JSON a forward carries.
fn body(req: &EngineRequest, origin: &Origin) -> Result<Vec<u8>, EngineError> {
    let left =
        |at: std::time::Instant| at.saturating_duration_since(std::time::Instant::now()).as_millis().max(1) as u64;
    let first_token_ms = left(origin.first_token_deadline);
    let mut v = json!({
        "model": req.model,
        "messages": req.messages,
        "stream": true,
        "max_tokens": req.max_output_tokens,
        "request_id": origin.task_id,
        "idempotency_key": format!("fwd:{}:{}", origin.node_id, origin.task_id),
        "priority": origin.priority.as_str(),
        "timeouts": { "queue_ms": first_token_ms, "first_token_ms": first_token_ms, "total_ms": left(origin.total_deadline) },
        "routing": { "data_class": origin.data_class.as_str() },
    });
    if let Value::Object(params) = serde_json::to_value(&req.params).unwrap_or_default() {
        let o = v.as_object_mut().expect("an object");
        o.extend(params);
    }
    if let Some(t) = &req.tools {
        v["tools"] = t.tools.clone().into();
        if let Some(c) = &t.tool_choice {
            v["tool_choice"] = c.clone();
        }
        if let Some(p) = t.parallel_tool_calls {
            v["parallel_tool_calls"] = p.into();
        }
    }
    serde_json::to_vec(&v).map_err(|e| EngineError::Protocol(format!("cannot write the forward: {e}")))
}

/// The engine layer's [`Peers`] on this bus: the registry's view of the
/// pool, and forwards over NATS.
pub struct NodePeers {
    pub client: async_nats::Client,
    pub cfg: NatsConfig,
    pub pool: Arc<Pool>,
    pub key: Secret,
    /// The pool's work queue, for store and forward.
    pub queue: Option<WorkQueue>,
}

/// Where low-priority work that no node takes now waits (see `work`).
pub struct WorkQueue {
    pub js: async_nats::jetstream::Context,
    /// `[cluster] queue_from`.
    pub from: Priority,
    pub metrics: Arc<crate::telemetry::Metrics>,
}

impl NodePeers {
    /// A node that sent nothing for this long (it sends a keepalive every
    /// `keepalive_ms` while it has nothing else to say) is gone.
    fn silence(&self) -> Duration {
        self.cfg.keepalive * 3
    }
}

/// Cancels the task on the node that runs it when the stream is dropped
/// before its end (the subscription goes with it).
struct CancelOnDrop {
    client: async_nats::Client,
    subject: String,
    headers: Option<HeaderMap>,
    body: Bytes,
}

impl CancelOnDrop {
    fn disarm(&mut self) {
        self.headers = None;
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        let Some(headers) = self.headers.take() else { return };
        let Ok(rt) = tokio::runtime::Handle::try_current() else { return };
        let (client, subject, body) = (self.client.clone(), self.subject.clone(), self.body.clone());
        rt.spawn(async move {
            let _ = client.publish_with_headers(subject, headers, body).await;
            let _ = client.flush().await;
        });
    }
}

/// What one message of the reply stream says.
enum Said {
    /// Accepted by the node: its task id.
    Accepted(String),
    Chunks(Vec<EngineChunk>),
    /// Nothing for the engine (queued, keepalive).
    Nothing,
    Done(Vec<EngineChunk>),
    Failed(EngineError),
}

fn read(msg: &async_nats::Message, node: &str) -> Said {
    if msg.status == Some(StatusCode::NO_RESPONDERS) {
        return Said::Failed(EngineError::Unreachable(format!("node {node} does not listen")));
    }
    let kind = msg.headers.as_ref().and_then(|h| h.get(super::service::EVENT_HEADER)).map(|v| v.as_str().to_string());
    let v = || serde_json::from_slice::<Value>(&msg.payload).unwrap_or_default();
    match kind.as_deref() {
        Some("accepted") => Said::Accepted(v()["task_id"].as_str().unwrap_or_default().to_string()),
        Some("delta") => Said::Chunks(vec![EngineChunk::Delta(v()["text"].as_str().unwrap_or_default().to_string())]),
        Some("tool_call") => match serde_json::from_value::<ToolCallDelta>(v()) {
            Ok(d) => Said::Chunks(vec![EngineChunk::ToolCall(d)]),
            Err(e) => Said::Failed(EngineError::Protocol(format!("node {node} sent a bad tool call: {e}"))),
        },
        Some("done") => {
            let r = &v()["result"];
            let n = |k: &str| r["usage"][k].as_u64().unwrap_or(0) as u32;
            let mut out =
                vec![EngineChunk::Usage { input_tokens: n("input_tokens"), output_tokens: n("output_tokens") }];
            out.push(EngineChunk::Finish(r["finish_reason"].as_str().unwrap_or("stop").to_string()));
            Said::Done(out)
        }
        Some("error") => {
            let v = v();
            let code = v["code"].as_str().unwrap_or("INTERNAL_ERROR");
            let status = ErrorCode::ALL.into_iter().find(|c| c.as_str() == code).map_or(500, |c| c.http_status());
            Said::Failed(EngineError::Status {
                status,
                body: format!("node {node}: {code}: {}", v["message"].as_str().unwrap_or("")),
            })
        }
        _ => Said::Nothing,
    }
}

#[async_trait]
impl Peers for NodePeers {
    fn candidates(&self, model: &str, class: DataClass) -> Vec<String> {
        self.pool.candidates(model, class).into_iter().map(|n| n.node_id).collect()
    }

    async fn open(&self, node: &str, req: &EngineRequest, origin: &Arc<Origin>) -> Result<EngineStream, EngineError> {
        let subject = node_subject(&self.cfg, node, "chat");
        let (payload, headers) = self.message(&subject, "", req, origin)?;
        let inbox = self.client.new_inbox();
        let sub = self.client.subscribe(inbox.clone()).await.map_err(|e| unreachable(&e))?;
        self.client
            .publish_with_reply_and_headers(subject, inbox, headers, Bytes::from(payload))
            .await
            .map_err(|e| unreachable(&e))?;
        self.follow(node, sub, origin).await
    }

    fn queue_from(&self) -> Option<Priority> {
        self.queue.as_ref().map(|q| q.from)
    }

    async fn enqueue(&self, req: &EngineRequest, origin: &Arc<Origin>) -> Result<EngineStream, EngineError> {
        let Some(q) = &self.queue else {
            return Err(EngineError::Unreachable("the pool has no work queue".into()));
        };
        let subject = work_subject(&self.cfg, &req.model, origin.data_class);
        let inbox = self.client.new_inbox();
        let (payload, mut headers) = self.message(&subject, &inbox, req, origin)?;
        // The stream drops a second copy of one attempt (a publish retried
        // after a lost acknowledgement) within its duplicate window.
        let id = headers.get(SIGNATURE).map(|v| v.as_str().to_string()).unwrap_or_default();
        headers.insert("Nats-Msg-Id", id.as_str());
        let mut sub = self.client.subscribe(inbox.clone()).await.map_err(|e| unreachable(&e))?;
        let published = async {
            let ack = q.js.publish_with_headers(subject, headers, Bytes::from(payload)).await;
            ack.map_err(|e| e.to_string())?.await.map_err(|e| e.to_string())
        };
        let ack = match tokio::time::timeout(Duration::from_secs(5), published).await {
            Ok(Ok(ack)) => ack,
            Ok(Err(e)) => return Err(unreachable(&format!("the pool's work queue: {e}"))),
            Err(_) => return Err(unreachable(&"the pool's work queue did not acknowledge the task")),
        };
        q.metrics.pool_work.with_label_values(&["queued"]).inc();
        tracing::info!(task_id = %origin.task_id, seq = ack.sequence, "task queued in the pool's work queue");
        // Until a node takes it: nobody speaks to the inbox, so there is
        // no silence to notice, only the task's first-token deadline. Left
        // before then, the task leaves the queue.
        let mut unqueue = Unqueue { js: Some(q.js.clone()), stream: ack.stream.clone(), seq: ack.sequence };
        // Set until a node takes it; not cleared when this future is
        // dropped, so the scheduler still reads it when its own deadline
        // ends the wait (`tokio::select!` drops this future first).
        origin.queued.store(true, std::sync::atomic::Ordering::Relaxed);
        // The scheduler's own first-token limit ends the wait; this is a
        // backstop a moment after it.
        let until = origin.first_token_deadline + Duration::from_secs(1);
        let node = loop {
            let msg = match tokio::time::timeout_at(until.into(), sub.next()).await {
                Ok(Some(m)) => m,
                Ok(None) => return Err(unreachable(&"the bus closed the reply stream")),
                Err(_) => {
                    return Err(EngineError::Unreachable(
                        "no node of the pool took the task from the work queue before its first-token deadline".into(),
                    ))
                }
            };
            let h = msg.headers.as_ref();
            match h.and_then(|h| h.get(super::service::EVENT_HEADER)).map(|v| v.as_str()) {
                Some("taken") => match h.and_then(|h| h.get(NODE)) {
                    Some(n) => break n.as_str().to_string(),
                    None => return Err(EngineError::Protocol("queued work taken by an unnamed node".into())),
                },
                Some("error") => {
                    unqueue.js = None;
                    if let Said::Failed(e) = read(&msg, "that took it from the work queue") {
                        return Err(e);
                    }
                }
                // A puller asks whether the task still waits: it does.
                _ => {
                    if let Some(ask) = msg.reply {
                        let _ = self.client.publish(ask, Bytes::new()).await;
                    }
                }
            }
        };
        unqueue.js = None;
        origin.queued.store(false, std::sync::atomic::Ordering::Relaxed);
        self.follow(&node, sub, origin).await
    }
}

fn unreachable(e: &dyn std::fmt::Display) -> EngineError {
    EngineError::Unreachable(format!("bus: {e}"))
}

/// Takes queued work out of the stream when its task stops waiting for it
/// (the client left, a deadline passed) before a node took it.
struct Unqueue {
    js: Option<async_nats::jetstream::Context>,
    stream: String,
    seq: u64,
}

impl Drop for Unqueue {
    fn drop(&mut self) {
        let Some(js) = self.js.take() else { return };
        let Ok(rt) = tokio::runtime::Handle::try_current() else { return };
        let (stream, seq) = (std::mem::take(&mut self.stream), self.seq);
        rt.spawn(async move {
            // Gone already when a node pulled it meanwhile: that node's
            // events find no listener and it cancels the task.
            if let Ok(s) = js.get_stream(&stream).await {
                let _ = s.delete_message(seq).await;
            }
        });
    }
}

impl NodePeers {
    /// A forward's (or queued work's) body and signed headers, with the
    /// task's trace.
    fn message(
        &self,
        subject: &str,
        reply: &str,
        req: &EngineRequest,
        origin: &Origin,
    ) -> Result<(Vec<u8>, HeaderMap), EngineError> {
        let payload = body(req, origin)?;
        let mut headers = signed_headers(&self.key, subject, reply, origin, &payload);
        if let Some(tp) = &req.traceparent {
            headers.insert("traceparent", tp.as_str());
        }
        Ok((payload, headers))
    }

    /// The reply stream of a task sent to `node` (forwarded to it, or
    /// taken by it from the work queue): until it accepts the task, then
    /// its events as engine chunks.
    async fn follow(
        &self,
        node: &str,
        mut sub: async_nats::Subscriber,
        origin: &Arc<Origin>,
    ) -> Result<EngineStream, EngineError> {
        let cancel_subject = node_subject(&self.cfg, node, "cancel");
        let cancel_body = Bytes::from(serde_json::to_vec(&json!({ "request_id": origin.task_id })).expect("JSON"));
        let mut guard = CancelOnDrop {
            client: self.client.clone(),
            headers: Some(signed_headers(&self.key, &cancel_subject, "", origin, &cancel_body)),
            subject: cancel_subject,
            body: cancel_body,
        };
        let silence = self.silence();
        // Until the node accepted the task: a refusal lets the next node
        // try, and nothing runs here.
        loop {
            let until = (tokio::time::Instant::now() + silence).min(origin.first_token_deadline.into());
            let msg = match tokio::time::timeout_at(until, sub.next()).await {
                Ok(Some(m)) => m,
                Ok(None) => return Err(EngineError::Unreachable("the bus closed the reply stream".into())),
                Err(_) => return Err(EngineError::Unreachable(format!("node {node} did not answer"))),
            };
            match read(&msg, node) {
                Said::Accepted(task) => {
                    let _ = origin.forwarded_to.set((node.to_string(), task));
                    break;
                }
                Said::Nothing => {}
                Said::Failed(e) => {
                    guard.disarm();
                    return Err(e);
                }
                Said::Chunks(_) | Said::Done(_) => {
                    return Err(EngineError::Protocol(format!("node {node} answered before accepting")))
                }
            }
        }
        let node = node.to_string();
        let state = (sub, guard, std::collections::VecDeque::<EngineChunk>::new(), false);
        let stream = futures::stream::unfold(state, move |(mut sub, mut guard, mut queue, mut ended)| {
            let node = node.clone();
            async move {
                loop {
                    if let Some(c) = queue.pop_front() {
                        return Some((Ok(c), (sub, guard, queue, ended)));
                    }
                    if ended {
                        return None;
                    }
                    let msg = match tokio::time::timeout(silence, sub.next()).await {
                        Ok(Some(m)) => m,
                        Ok(None) => {
                            let e = EngineError::Unreachable(format!("the reply stream from node {node} closed"));
                            return Some((Err(e), (sub, guard, queue, true)));
                        }
                        Err(_) => {
                            let e = EngineError::Unreachable(format!(
                                "node {node} went silent for {} ms mid-task",
                                silence.as_millis()
                            ));
                            return Some((Err(e), (sub, guard, queue, true)));
                        }
                    };
                    match read(&msg, &node) {
                        Said::Accepted(_) | Said::Nothing => {}
                        Said::Chunks(c) => queue.extend(c),
                        Said::Done(c) => {
                            guard.disarm();
                            queue.extend(c);
                            ended = true;
                        }
                        Said::Failed(e) => {
                            guard.disarm();
                            return Some((Err(e), (sub, guard, queue, true)));
                        }
                    }
                }
            }
        });
        Ok(stream.boxed())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::OnceLock;

    use super::*;

    const KEY: &str = "a-test-key-of-the-pool-0123456789abcdef";

    fn config() -> Config {
        let extra = "[nats]\nurl = \"nats://127.0.0.1:4222\"\n[nats.jetstream]\n\
                     [cluster]\nzone = \"a\"\nkey_env = \"POOL_KEY\"\n";
        let text = crate::testing::config_toml("http://127.0.0.1:1", "openai", std::path::Path::new("/tmp/x"), extra);
        let env = [("POOL_KEY".to_string(), KEY.to_string())];
        Config::from_toml_str(&text, env, std::path::Path::new(".")).unwrap()
    }

    fn origin() -> Origin {
        let now = std::time::Instant::now();
        Origin {
            node_id: "node-a".into(),
            task_id: "t-1".into(),
            tenant: "demo".into(),
            application: "demo".into(),
            user_id: Some("u\r\n1".into()),
            priority: Priority::P4,
            data_class: DataClass::Personal,
            first_token_deadline: now,
            total_deadline: now,
            forwarded_to: OnceLock::new(),
            queued: Default::default(),
        }
    }

    #[test]
    fn forwards_cancels_and_queued_work_verify_only_as_signed_and_only_while_fresh() {
        let cfg = config();
        let key = Secret::new(KEY.to_string());
        let o = origin();
        let body = br#"{"request_id": "t-1"}"#;
        let (subject, work) = ("ai.v1.node.node-b.cancel", "ai.v1.work.general-chat.personal");
        let h = signed_headers(&key, subject, "", &o, body);
        let v = verify(&cfg, subject, Some(&h), body).unwrap();
        assert_eq!((v.origin_node.as_str(), v.origin_task.as_str()), ("node-a", "t-1"));
        assert_eq!((v.identity.application.as_str(), v.identity.user_id.as_deref()), ("demo", Some("u1")));
        assert!(!v.identity.is_admin);
        let refused = |r: Result<Verified, GatewayError>| r.err().map(|e| e.code);
        // Another subject, body or key: refused.
        assert_eq!(refused(verify(&cfg, "ai.v1.node.node-c.cancel", Some(&h), body)), Some(ErrorCode::AuthFailed));
        assert_eq!(refused(verify(&cfg, subject, Some(&h), b"{}")), Some(ErrorCode::AuthFailed));
        let forged = signed_headers(&Secret::new("x".repeat(40)), subject, "", &o, body);
        assert_eq!(refused(verify(&cfg, subject, Some(&forged), body)), Some(ErrorCode::AuthFailed));
        // A forward ten minutes old is stale; queued work may be that old,
        // but not from the future, and its reply inbox is signed.
        let old = signed_headers_at(&key, work, "_INBOX.a", &o, body, now_ms() - 600_000);
        assert_eq!(refused(verify(&cfg, work, Some(&old), body)), Some(ErrorCode::AuthFailed));
        let q = verify_queued(&cfg, work, Some(&old), body).unwrap();
        assert_eq!(q.reply.as_deref(), Some("_INBOX.a"));
        let mut moved = old.clone();
        moved.insert(REPLY, "_INBOX.b");
        assert_eq!(refused(verify_queued(&cfg, work, Some(&moved), body)), Some(ErrorCode::AuthFailed));
        let ahead = signed_headers_at(&key, work, "_INBOX.a", &o, body, now_ms() + 600_000);
        assert_eq!(refused(verify_queued(&cfg, work, Some(&ahead), body)), Some(ErrorCode::AuthFailed));
        // An application this node does not have.
        let mut other = origin();
        other.application = "nope".into();
        let h = signed_headers(&key, subject, "", &other, body);
        assert_eq!(refused(verify(&cfg, subject, Some(&h), body)), Some(ErrorCode::PermissionDenied));
    }

    #[test]
    fn hmac_sha256_matches_rfc_4231() {
        // Test case 2.
        let mac = crate::ingress::hmac::<Sha256>(b"Jefe", &[b"what do ya want ", b"for nothing?"]);
        assert_eq!(hex::encode(mac), "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
        // Test case 6: a key longer than the block.
        let mac =
            crate::ingress::hmac::<Sha256>(&[0xaa; 131], &[b"Test Using Larger Than Block-Size Key - Hash Key First"]);
        assert_eq!(hex::encode(mac), "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
    }
}
