//! Store and forward (issue 15): the pool's work queue, a JetStream
//! stream with work-queue retention (`[cluster] work_stream`, subjects
//! `{prefix}.work.>`), and this node's puller.
//!
//! A pool instance puts there the low-priority work (`[cluster]
//! queue_from`, P3 and P4 by default) that no node takes now: the signed
//! forward of [`super::forward`], on `{prefix}.work.{model}.{class}`, with
//! the origin's inbox in the signature. The origin keeps the task (its
//! record, its client's stream or device topic, its deadlines): only the
//! engine work waits in the stream, so the answer reaches the client the
//! way it always does, after a reconnect too.
//!
//! Every node pulls, from one durable consumer per model and data class
//! it may receive (`work_{model}_{class}`, shared by the nodes), only
//! while a local instance of the model has a free slot nobody waits for,
//! so queued work goes to whichever node has room first. For each message
//! it pulls:
//! - not signed with the pool's key, or not for this node's applications:
//!   terminated (`refused`);
//! - past its first-token deadline: terminated (`expired`); the origin
//!   has given up on it already;
//! - the claim: the message's signature, one per attempt, is created as a
//!   key of the claims bucket (`{cluster bucket}_claims`) with this node's
//!   id. Delivered again (the stream's at-least-once delivery: a puller
//!   that did not acknowledge in `work_ack_wait_ms`, a copy published
//!   twice), the key exists and the copy is dropped (`duplicate`), unless
//!   the node that claimed it is gone from the registry and the origin
//!   still waits for it: then this node takes the claim over. So each
//!   attempt runs once.
//! - the origin is asked whether it still waits (it answers on the task's
//!   inbox); nobody listening there (its node crashed, the task ended) drops
//!   the message without running it (`abandoned`);
//! - submitted here as a forwarded task: once accepted, the origin is told
//!   who took it (`taken`, with this node's id: where its cancel goes), the
//!   message is acknowledged and the task's events stream to the origin's
//!   inbox as for a forward (keepalives, caller liveness). Refused for
//!   room (queue full, model down meanwhile, a rate), the claim is
//!   released and the message offered again in a second (`requeued`);
//!   refused otherwise, the origin gets the error and the message is
//!   terminated (`refused`).
//!
//! Owns: the stream, the claims bucket, the consumers and the pull loop.
//! Does not own: the message (`forward`) or the reply stream
//! (`service::relay`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::consumer::{pull, AckPolicy, PullConsumer};
use async_nats::jetstream::message::AckKind;
use async_nats::jetstream::{self, kv, stream};
use bytes::Bytes;
use futures::StreamExt;
use serde_json::Value;
use tokio_util::task::TaskTracker;

use super::forward::{self, work_subject, NODE};
use super::service::{error_headers, forwarded_here, headers_for, relay, start_chat, to_bytes, Ctx};
use super::subject_token;
use crate::config::{ClusterConfig, JetStreamStorage, WORK_MAX_AGE};
use crate::error::ErrorCode;
use crate::gateway::{Caller, SubmitOptions};
use crate::ingress::render::rejection_json;
use crate::task::DataClass;

/// How often the puller looks for work while it has room.
const POLL: Duration = Duration::from_millis(200);
/// How long one bus request of the puller may take.
const OP_TIMEOUT: Duration = Duration::from_secs(3);
/// A task refused for room here is offered again after this long.
const REQUEUE_DELAY: Duration = Duration::from_secs(1);

/// The classes a node may receive from others, most open first.
const CLASSES: [DataClass; 4] = [DataClass::Public, DataClass::Personal, DataClass::Sensitive, DataClass::Secret];

/// The durable consumer of model `model`'s `class` work, shared by every
/// node that may take it.
pub fn consumer_name(model: &str, class: DataClass) -> String {
    format!("work_{}_{}", subject_token(model), class.as_str())
}

/// The claims bucket of a pool whose registry bucket is `registry`.
pub fn claims_bucket(registry: &str) -> String {
    format!("{registry}_claims")
}

/// Makes the stream and the claims bucket when missing.
async fn open(
    js: &jetstream::Context,
    ctx: &Ctx,
    cluster: &ClusterConfig,
) -> Result<(stream::Stream, kv::Store), String> {
    let storage = match ctx.cfg.jetstream.as_ref().map(|j| j.storage) {
        Some(JetStreamStorage::Memory) => stream::StorageType::Memory,
        _ => stream::StorageType::File,
    };
    let stream = js
        .get_or_create_stream(stream::Config {
            name: cluster.work_stream.clone(),
            description: Some("edgeway: the pool's work queue (store and forward)".into()),
            subjects: vec![ctx.cfg.subject("work.>")],
            retention: stream::RetentionPolicy::WorkQueue,
            storage,
            num_replicas: cluster.replicas,
            max_age: WORK_MAX_AGE,
            duplicate_window: Duration::from_secs(120),
            ..Default::default()
        })
        .await
        .map_err(|e| format!("work stream: {e}"))?;
    let bucket = claims_bucket(&cluster.bucket);
    let claims = match js.get_key_value(&bucket).await {
        Ok(s) => s,
        Err(_) => js
            .create_key_value(kv::Config {
                bucket: bucket.clone(),
                description: "edgeway: which node took each queued attempt".into(),
                history: 1,
                max_age: WORK_MAX_AGE,
                storage,
                num_replicas: cluster.replicas,
                ..Default::default()
            })
            .await
            .map_err(|e| format!("claims bucket: {e}"))?,
    };
    Ok((stream, claims))
}

/// Pulls queued work while this node has room, until shutdown.
pub(super) async fn run(ctx: Arc<Ctx>, tracker: TaskTracker) {
    let config = ctx.gw.config();
    let Some(cluster) = config.cluster.clone().filter(|c| c.key.is_some()) else { return };
    drop(config);
    let js = jetstream::new(ctx.client.clone());
    let mut delay = Duration::from_millis(100);
    let (stream, claims) = loop {
        let r = tokio::time::timeout(OP_TIMEOUT, open(&js, &ctx, &cluster)).await;
        match r.unwrap_or_else(|_| Err("timed out".into())) {
            Ok(s) => break s,
            Err(e) => tracing::warn!(error = %e, "the pool's work queue is unavailable; retrying"),
        }
        tokio::select! {
            _ = ctx.shutdown.cancelled() => return,
            _ = tokio::time::sleep(delay) => {}
        }
        delay = (delay * 2).min(Duration::from_secs(5));
    };
    tracing::info!(stream = %cluster.work_stream, "pulling from the pool's work queue");
    let mut consumers: HashMap<String, PullConsumer> = HashMap::new();
    // Messages pulled and not yet submitted, by model: not free slots.
    let mut taking: HashMap<String, Arc<AtomicUsize>> = HashMap::new();
    let mut tick = tokio::time::interval(POLL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = ctx.shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        if ctx.gw.is_draining() || ctx.status.unavailable_for().is_some() {
            continue;
        }
        let Some(max) = ctx.gw.config().cluster.as_ref().map(|c| c.max_data_class) else { continue };
        for (model, free) in ctx.gw.free_local_slots().await {
            let pending = taking.entry(model.clone()).or_default().clone();
            let mut free = free.saturating_sub(pending.load(Ordering::Relaxed));
            for class in CLASSES.into_iter().filter(|c| *c <= max) {
                if free == 0 {
                    break;
                }
                let name = consumer_name(&model, class);
                if !consumers.contains_key(&name) {
                    match tokio::time::timeout(OP_TIMEOUT, consumer(&stream, &ctx, &cluster, &model, class)).await {
                        Ok(Ok(c)) => {
                            consumers.insert(name.clone(), c);
                        }
                        Ok(Err(e)) => {
                            tracing::warn!(consumer = %name, error = %e, "cannot open a work-queue consumer; retrying");
                            continue;
                        }
                        Err(_) => continue,
                    }
                }
                let c = &consumers[&name];
                let batch = async {
                    let mut batch = c.fetch().max_messages(free).messages().await.map_err(|e| e.to_string())?;
                    let mut got = Vec::new();
                    while let Some(m) = batch.next().await {
                        got.push(m.map_err(|e| e.to_string())?);
                    }
                    Ok::<_, String>(got)
                };
                let got = match tokio::time::timeout(OP_TIMEOUT, batch).await {
                    Ok(Ok(got)) => got,
                    Ok(Err(e)) => {
                        tracing::debug!(consumer = %name, error = %e, "work-queue fetch failed");
                        consumers.remove(&name);
                        continue;
                    }
                    Err(_) => continue,
                };
                free = free.saturating_sub(got.len());
                for msg in got {
                    pending.fetch_add(1, Ordering::Relaxed);
                    let taken = Taken { pending: pending.clone() };
                    tracker.spawn(take(ctx.clone(), claims.clone(), msg, taken));
                }
            }
        }
    }
}

/// The durable consumer of `model`'s `class` work, made when missing.
async fn consumer(
    stream: &stream::Stream,
    ctx: &Ctx,
    cluster: &ClusterConfig,
    model: &str,
    class: DataClass,
) -> Result<PullConsumer, String> {
    let name = consumer_name(model, class);
    stream
        .get_or_create_consumer(
            &name,
            pull::Config {
                durable_name: Some(name.clone()),
                description: Some(format!("edgeway: queued {} work for model {model}", class.as_str())),
                filter_subject: work_subject(&ctx.cfg, model, class),
                ack_policy: AckPolicy::Explicit,
                ack_wait: cluster.work_ack_wait,
                ..Default::default()
            },
        )
        .await
        .map_err(|e| e.to_string())
}

/// A pulled message no longer counts against the model's free slots once
/// it is submitted (or dropped).
struct Taken {
    pending: Arc<AtomicUsize>,
}

impl Drop for Taken {
    fn drop(&mut self) {
        self.pending.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Why a refusal here should let another node (or this one, later) try.
fn for_room(code: ErrorCode) -> bool {
    matches!(
        code,
        ErrorCode::QueueFull
            | ErrorCode::ModelUnavailable
            | ErrorCode::ResourceExhausted
            | ErrorCode::RateLimited
            | ErrorCode::ShuttingDown
            | ErrorCode::StoreUnavailable
    )
}

enum Claim {
    /// This node runs it.
    Mine,
    /// Another delivery of an attempt a live node took (this one, or
    /// `node`).
    Taken(String),
}

/// Claims attempt `key` for this node (see the module's documentation).
async fn claim(ctx: &Ctx, claims: &kv::Store, key: &str, reply: &str) -> Result<Claim, String> {
    let me = ctx.gw.config().node_id.clone();
    match claims.create(key, Bytes::from(me.clone())).await {
        Ok(_) => return Ok(Claim::Mine),
        Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => {}
        Err(e) => return Err(e.to_string()),
    }
    let Some(entry) = claims.entry(key).await.map_err(|e| e.to_string())? else {
        return Err("the claim vanished".into());
    };
    let holder = String::from_utf8_lossy(&entry.value).to_string();
    let alive = holder == me || ctx.gw.pool().is_some_and(|p| p.peers().iter().any(|n| n.node_id == holder));
    if alive {
        return Ok(Claim::Taken(holder));
    }
    // The node that claimed it is gone. If it had told the origin, the
    // origin noticed its silence and made a new attempt (this inbox is
    // gone then); if not, the origin still waits for this one.
    if !origin_waits(ctx, reply).await {
        return Ok(Claim::Taken(holder));
    }
    match claims.update(key, Bytes::from(me), entry.revision).await {
        Ok(_) => {
            tracing::info!(claimed_by = %holder, "taking over queued work from a node that is gone");
            Ok(Claim::Mine)
        }
        Err(_) => Ok(Claim::Taken(holder)),
    }
}

/// Whether the origin still waits for queued work: it answers a request on
/// the task's inbox at once; `no responders` says nobody listens there any
/// more (the task ended or its node is gone). No answer in time counts as
/// waiting (a slow bus must not drop work).
async fn origin_waits(ctx: &Ctx, reply: &str) -> bool {
    let ask = ctx.client.request(reply.to_string(), Bytes::new());
    !matches!(
        tokio::time::timeout(Duration::from_millis(500), ask).await,
        Ok(Err(e)) if e.kind() == async_nats::RequestErrorKind::NoResponders
    )
}

/// Deletes this node's claim of an attempt it did not run, so that the
/// next delivery may run it; tried three times (a claim left behind drops
/// the next delivery as a duplicate, and the task waits at its origin
/// until its first-token limit and a retry).
async fn release(claims: &kv::Store, key: &str) {
    for attempt in 1..=3 {
        match tokio::time::timeout(OP_TIMEOUT, claims.delete(key)).await {
            Ok(Ok(())) => return,
            Ok(Err(e)) if attempt == 3 => tracing::error!(error = %e, "cannot release a claim of queued work"),
            Err(_) if attempt == 3 => tracing::error!("releasing a claim of queued work timed out"),
            _ => tokio::time::sleep(Duration::from_millis(100 * attempt)).await,
        }
    }
}

/// Handles one pulled message (see the module's documentation).
async fn take(ctx: Arc<Ctx>, claims: kv::Store, msg: jetstream::Message, taken: Taken) {
    let metrics = ctx.gw.metrics().clone();
    let outcome = |o: &str| metrics.pool_work.with_label_values(&[o]).inc();
    let config = ctx.gw.config();
    let subject = msg.subject.to_string();
    let fwd = match forward::verify_queued(&config, &subject, msg.headers.as_ref(), &msg.payload) {
        Ok(f) => f,
        Err(e) => {
            tracing::warn!(subject = %subject, error = %e.message, "queued work refused");
            outcome("refused");
            let _ = msg.ack_with(AckKind::Term).await;
            return;
        }
    };
    let reply = fwd.reply.clone().unwrap_or_default();
    // What is left of its deadlines, after its wait in the queue.
    let waited = (crate::task::now_ms() - fwd.time_ms).max(0) as u64;
    let mut body: Value = serde_json::from_slice(&msg.payload).unwrap_or_default();
    let first_token_left = body["timeouts"]["first_token_ms"].as_u64().unwrap_or(0).saturating_sub(waited);
    if first_token_left == 0 {
        tracing::info!(origin_node = %fwd.origin_node, origin_task = %fwd.origin_task, waited_ms = waited, "queued work past its deadline dropped");
        outcome("expired");
        let _ = msg.ack_with(AckKind::Term).await;
        return;
    }
    if let Some(t) = body.get_mut("timeouts").and_then(Value::as_object_mut) {
        for v in t.values_mut() {
            if let Some(ms) = v.as_u64() {
                *v = ms.saturating_sub(waited).max(1).into();
            }
        }
    }
    match claim(&ctx, &claims, &fwd.signature, &reply).await {
        Ok(Claim::Mine) => {}
        Ok(Claim::Taken(by)) => {
            tracing::info!(origin_node = %fwd.origin_node, origin_task = %fwd.origin_task, taken_by = %by, "queued work delivered again; already taken");
            outcome("duplicate");
            let _ = msg.ack_with(AckKind::Term).await;
            return;
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot claim queued work; offering it again");
            let _ = msg.ack_with(AckKind::Nak(Some(REQUEUE_DELAY))).await;
            return;
        }
    }
    // Nobody waits for it any more (its origin crashed, or the message is
    // a copy of one whose task ended): run nothing.
    if !origin_waits(&ctx, &reply).await {
        tracing::info!(origin_node = %fwd.origin_node, origin_task = %fwd.origin_task, "queued work nobody waits for any more dropped");
        outcome("abandoned");
        let _ = msg.ack_with(AckKind::Term).await;
        return;
    }
    let payload = serde_json::to_vec(&body).unwrap_or_default();
    let opts = SubmitOptions {
        traceparent: msg.headers.as_ref().and_then(|h| h.get("traceparent")).map(|v| v.as_str().to_string()),
        ..Default::default()
    };
    let origin_node = fwd.origin_node.clone();
    let started = start_chat(&ctx.gw, &payload, Caller::Identity(fwd.identity), opts, |call| {
        forwarded_here(&config, &origin_node, call)
    })
    .await;
    drop(taken);
    let reply = async_nats::Subject::from(reply);
    match started {
        Ok(stream) => {
            let mut h = headers_for("taken");
            h.insert(NODE, config.node_id.as_str());
            let _ = ctx.client.publish_with_headers(reply.clone(), h, Bytes::new()).await;
            if let Err(e) = msg.double_ack().await {
                // Delivered again later, the copy finds this node's claim.
                tracing::warn!(error = %e, "queued work taken but its acknowledgement failed");
            }
            outcome("taken");
            tracing::info!(origin_node = %fwd.origin_node, origin_task = %fwd.origin_task, task_id = %stream.task_id, "task taken from the pool's work queue");
            drop(config);
            relay(&ctx, None, reply, stream).await;
        }
        Err((_, e)) if for_room(e.code) => {
            tracing::info!(origin_task = %fwd.origin_task, error = %e.message, "no room for queued work after all; offering it again");
            release(&claims, &fwd.signature).await;
            outcome("requeued");
            let _ = msg.ack_with(AckKind::Nak(Some(REQUEUE_DELAY))).await;
        }
        Err((request_id, e)) => {
            tracing::warn!(origin_task = %fwd.origin_task, error = %e.message, "queued work refused");
            let body = to_bytes(&rejection_json(request_id.as_deref(), &e));
            let _ = ctx.client.publish_with_headers(reply, error_headers(&e), body).await;
            outcome("refused");
            let _ = msg.ack_with(AckKind::Term).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn consumers_are_per_model_and_class() {
        assert_eq!(consumer_name("general-chat", DataClass::Personal), "work_general-chat_personal");
        assert_eq!(consumer_name("a.b c", DataClass::Public), "work_a_b_c_public");
        assert_eq!(claims_bucket("edgeway_nodes"), "edgeway_nodes_claims");
        assert!(for_room(ErrorCode::QueueFull) && !for_room(ErrorCode::PermissionDenied));
    }
}
