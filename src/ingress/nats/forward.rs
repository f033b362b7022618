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
//! Owns: the node subjects, the forward's headers, body and signature,
//! and [`NodePeers`], the engine layer's [`Peers`] on this bus. Does not
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
use crate::config::{Config, NatsConfig, Secret};
use crate::error::{ErrorCode, GatewayError};
use crate::gateway::cluster::forwarding::{EngineChunk, EngineError, EngineRequest, EngineStream, Origin, Peers};
use crate::gateway::cluster::Pool;
use crate::task::{DataClass, Identity, ToolCallDelta};

pub const ORIGIN_NODE: &str = "Edgeway-Origin-Node";
pub const ORIGIN_TASK: &str = "Edgeway-Origin-Task";
pub const TENANT: &str = "Edgeway-Tenant";
pub const APPLICATION: &str = "Edgeway-App";
pub const USER: &str = "Edgeway-User";
pub const TIME: &str = "Edgeway-Time";
pub const SIGNATURE: &str = "Edgeway-Signature";

/// How far a forward's time may be from the receiver's clock.
const MAX_SKEW_MS: i64 = 60_000;

/// The subject node `node` serves `what` (`chat`, `cancel`) on.
pub fn node_subject(cfg: &NatsConfig, node: &str, what: &str) -> String {
    cfg.subject(&format!("node.{}.{what}", subject_token(node)))
}

/// The signed fields of a forward or its cancel.
struct Signed<'a> {
    subject: &'a str,
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
        parts.push(self.body);
        crate::ingress::hmac::<Sha256>(key.expose().as_bytes(), &parts).into()
    }
}

fn now_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

fn signed_headers(key: &Secret, subject: &str, origin: &Origin, body: &[u8]) -> HeaderMap {
    let time_ms = now_ms();
    // A header value is one line: a JWT's `sub` is not checked for control
    // characters as a request's user id is.
    let user: String = origin.user_id.as_deref().unwrap_or("").chars().filter(|c| !c.is_control()).collect();
    let user = user.as_str();
    let mac = Signed {
        subject,
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
    h
}

/// A forward (or its cancel) whose signature checked out.
pub struct Verified {
    pub origin_node: String,
    pub origin_task: String,
    /// The caller, as this node's configuration has its application.
    pub identity: Identity,
}

fn get(h: &HeaderMap, name: &str) -> Option<String> {
    h.get(name).map(|v| v.as_str().to_string())
}

/// Checks a forward's (or cancel's) signature, time and application:
/// `AUTH_FAILED` when this node has no pool key, or the message is not
/// signed with it, or is more than a minute off; `PERMISSION_DENIED` for an
/// application this node does not have (nodes of a pool share them).
pub fn verify(cfg: &Config, subject: &str, headers: Option<&HeaderMap>, body: &[u8]) -> Result<Verified, GatewayError> {
    let denied = |why: &str| GatewayError::new(ErrorCode::AuthFailed, format!("not a forward of this pool: {why}"));
    let key = cfg.cluster.as_ref().and_then(|c| c.key.as_ref()).ok_or_else(|| denied("this node has no pool key"))?;
    let h = headers.ok_or_else(|| denied("no headers"))?;
    let need = |name: &str| get(h, name).ok_or_else(|| denied(&format!("no {name} header")));
    let (origin_node, origin_task, tenant, application) =
        (need(ORIGIN_NODE)?, need(ORIGIN_TASK)?, need(TENANT)?, need(APPLICATION)?);
    let user = get(h, USER).unwrap_or_default();
    let time_ms: i64 = need(TIME)?.parse().map_err(|_| denied("bad time"))?;
    let given = need(SIGNATURE)?;
    let mac = Signed {
        subject,
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
    if (now_ms() - time_ms).abs() > MAX_SKEW_MS {
        return Err(denied("signed more than a minute away from this node's clock"));
    }
    if origin_node == cfg.node_id {
        return Err(GatewayError::invalid("a node does not forward to itself"));
    }
    let identity =
        crate::gateway::cluster::forwarded_identity(cfg, &tenant, &application, (!user.is_empty()).then_some(user))?;
    Ok(Verified { origin_node, origin_task, identity })
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
        let payload = body(req, origin)?;
        let mut headers = signed_headers(&self.key, &subject, origin, &payload);
        if let Some(tp) = &req.traceparent {
            headers.insert("traceparent", tp.as_str());
        }
        let unreachable = |e: &dyn std::fmt::Display| EngineError::Unreachable(format!("bus: {e}"));
        let inbox = self.client.new_inbox();
        let mut sub = self.client.subscribe(inbox.clone()).await.map_err(|e| unreachable(&e))?;
        self.client
            .publish_with_reply_and_headers(subject, inbox, headers, Bytes::from(payload))
            .await
            .map_err(|e| unreachable(&e))?;
        let cancel_subject = node_subject(&self.cfg, node, "cancel");
        let cancel_body = Bytes::from(serde_json::to_vec(&json!({ "request_id": origin.task_id })).expect("JSON"));
        let mut guard = CancelOnDrop {
            client: self.client.clone(),
            headers: Some(signed_headers(&self.key, &cancel_subject, origin, &cancel_body)),
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
    use super::*;

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
