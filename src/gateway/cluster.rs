//! The node pool as this node sees it: its own record (built from the
//! scheduler's snapshot and the residency view, as `/v1/models` and the
//! status page read them) and the records of the other nodes that the
//! registry (`ingress::nats::registry`) reads from the bus.
//!
//! A peer counts while its record is fresh: received less than `ttl` ago
//! and with an `updated_at` less than `ttl` old. A deleted or purged key
//! removes it at once; an expired one (the bucket's `max_age`) leaves the
//! view by the same cut-off, since an expiry sends no event.
//!
//! Owns: the record schema (`topics/schemas/node-record.json`), the view
//! and its queries ([`Pool::candidates`]: who serves model M, may receive
//! class C, least loaded first). Does not own: the bus, the bucket or the
//! heartbeat (the registry).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

use crate::error::{ErrorCode, GatewayError};
use crate::task::{DataClass, Identity};

use super::Gateway;

/// Forwarding, as the bus ingress implements it: the engine layer's pool
/// instances reach the other nodes through [`Peers`] (set in
/// [`Gateway::peers`]), with the engine's request, chunks and errors.
pub mod forwarding {
    pub use crate::engine::pool::{Origin, PeerSlot, Peers};
    pub use crate::engine::{EngineChunk, EngineError, EngineRequest, EngineStream};
}

/// The identity of a task another node of the pool forwarded for
/// application `application` of `tenant` (the origin checked the caller's
/// credential): `PERMISSION_DENIED` when this node has no such application
/// (the nodes of a pool share them).
pub fn forwarded_identity(
    config: &crate::config::Config,
    tenant: &str,
    application: &str,
    user: Option<String>,
) -> Result<Identity, GatewayError> {
    let app = config.applications.get(application).filter(|a| a.tenant == tenant).ok_or_else(|| {
        GatewayError::new(
            ErrorCode::PermissionDenied,
            format!("application '{application}' is not configured on this node"),
        )
    })?;
    let mut identity = crate::admission::auth::application_identity(app, user);
    identity.is_admin = false;
    Ok(identity)
}

/// One logical model a node serves.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeModel {
    pub name: String,
    /// The model's residency class on that node (`always`, `on_demand`, …).
    pub residency: String,
    /// Its load state there (`loaded`, `loading`, `unloaded`, `forbidden`).
    pub state: String,
    /// Requests waiting in its queue.
    pub waiting: usize,
    /// A local instance of it is healthy now (records of older nodes have
    /// none: taken as serving).
    #[serde(default = "yes")]
    pub serving: bool,
    /// Slots free now on its healthy local instances, less the requests
    /// waiting for them.
    #[serde(default)]
    pub free_slots: usize,
}

fn yes() -> bool {
    true
}

/// What a node publishes under its `node_id` in the registry bucket.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeRecord {
    pub node_id: String,
    pub zone: String,
    /// The highest data class the node may receive from others.
    pub max_data_class: DataClass,
    /// Its HTTP (business) address, `host:port`.
    pub http_addr: String,
    pub models: Vec<NodeModel>,
    /// Requests waiting in all its queues.
    pub queue_depth: usize,
    /// Engine slots free now on its healthy instances.
    pub free_slots: usize,
    /// 0 normal … 3 busy answers only.
    pub degradation_level: u8,
    /// The edgeway version it runs.
    pub version: String,
    /// Unix time, ms.
    pub started_at_ms: i64,
    /// Unix time of this record, ms.
    pub updated_at_ms: i64,
}

impl NodeRecord {
    /// Whether the node serves `model` (and its class lets it run there).
    pub fn serves(&self, model: &str) -> bool {
        self.models.iter().any(|m| m.name == model && m.state != "forbidden" && m.serving)
    }
}

#[derive(Debug)]
struct Peer {
    record: NodeRecord,
    seen: Instant,
}

#[derive(Debug)]
struct Inner {
    peers: HashMap<String, Peer>,
    /// `connecting`, `ok`, or `unavailable: <why>`.
    state: String,
}

/// The other nodes, shared by the registry (writer) and the facade
/// (readers).
#[derive(Debug)]
pub struct Pool {
    node_id: String,
    /// This node's HTTP (business) address, published in its record.
    http_addr: String,
    ttl: Duration,
    inner: Mutex<Inner>,
    /// Cancelled to stop publishing this node's record without deleting
    /// it ([`Pool::stop_publishing`]).
    publishing: CancellationToken,
}

impl Pool {
    pub fn new(node_id: &str, http_addr: &str, ttl: Duration) -> Pool {
        Pool {
            node_id: node_id.to_string(),
            http_addr: http_addr.to_string(),
            ttl,
            inner: Mutex::new(Inner { peers: HashMap::new(), state: "connecting".into() }),
            publishing: CancellationToken::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A record read from the bucket (by the watch, or by a resync that
    /// reads them all again); this node's own is ignored. Only a newer
    /// record counts as a sign of life: reading the same one again does
    /// not keep a silent node in the view.
    pub fn upsert(&self, record: NodeRecord) {
        if record.node_id == self.node_id {
            return;
        }
        let mut inner = self.lock();
        match inner.peers.get_mut(&record.node_id) {
            Some(p) if p.record.updated_at_ms >= record.updated_at_ms => {}
            Some(p) => *p = Peer { record, seen: Instant::now() },
            None => {
                inner.peers.insert(record.node_id.clone(), Peer { record, seen: Instant::now() });
            }
        }
    }

    /// The node ids in the view (fresh or not yet pruned).
    pub fn known(&self) -> Vec<String> {
        self.lock().peers.keys().cloned().collect()
    }

    /// A key deleted or purged: the node left.
    pub fn remove(&self, node_id: &str) {
        self.lock().peers.remove(node_id);
    }

    pub fn http_addr(&self) -> &str {
        &self.http_addr
    }

    /// The registry's state for `/ready`.
    pub fn set_state(&self, state: impl Into<String>) {
        self.lock().state = state.into();
    }

    pub fn state(&self) -> String {
        self.lock().state.clone()
    }

    /// The fresh peers, by `node_id`; stale ones are dropped.
    pub fn peers(&self) -> Vec<NodeRecord> {
        let now_ms = crate::task::now_ms();
        let ttl = self.ttl;
        let mut inner = self.lock();
        inner.peers.retain(|_, p| {
            p.seen.elapsed() < ttl && now_ms.saturating_sub(p.record.updated_at_ms) < ttl.as_millis() as i64
        });
        let mut v: Vec<NodeRecord> = inner.peers.values().map(|p| p.record.clone()).collect();
        v.sort_by(|a, b| a.node_id.cmp(&b.node_id));
        v
    }

    /// The peers that serve `model` and may receive data of `class`, least
    /// loaded first (degradation level, then queue depth, then most free
    /// slots): the question a forwarding step asks.
    pub fn candidates(&self, model: &str, class: DataClass) -> Vec<NodeRecord> {
        let mut v: Vec<NodeRecord> =
            self.peers().into_iter().filter(|n| n.serves(model) && class <= n.max_data_class).collect();
        v.sort_by_key(|n| (n.degradation_level, n.queue_depth, std::cmp::Reverse(n.free_slots)));
        v
    }

    /// Stops this node's heartbeat without deleting its record, so that
    /// it ages out as a crashed node's would (tests, maintenance).
    pub fn stop_publishing(&self) {
        self.publishing.cancel();
    }

    /// Cancelled once [`Pool::stop_publishing`] is called.
    pub fn publishing(&self) -> CancellationToken {
        self.publishing.clone()
    }

    /// The `cluster` object of `/ready`.
    pub fn report(&self) -> Value {
        json!({ "registry": self.state(), "peers": self.peers().len() })
    }
}

impl Gateway {
    /// Offers the pool to the facade (the registry, once, at start).
    pub fn set_pool(&self, pool: Arc<Pool>) {
        let _ = self.pool.set(pool);
    }

    /// The pool, when `[cluster]` is configured and the registry started.
    pub fn pool(&self) -> Option<&Arc<Pool>> {
        self.pool.get()
    }

    /// Where this node's pool instances find the other nodes (the NATS
    /// ingress sets them).
    pub fn peers(&self) -> &Arc<crate::engine::pool::PeerSlot> {
        self.processes.peers()
    }

    /// This node's record now, with `http_addr` as the registry knows it;
    /// `None` without `[cluster]` or while the scheduler is not running.
    pub async fn node_record(&self, http_addr: &str) -> Option<NodeRecord> {
        let config = self.config();
        let cluster = config.cluster.as_ref()?;
        let snap = self.scheduler.snapshot().await?;
        let models = config
            .models
            .values()
            .map(|m| {
                let c = local_capacity(&snap, m);
                NodeModel {
                    name: m.name.clone(),
                    residency: m.residency.class.as_str().to_string(),
                    state: self.model_residency_state(m).to_string(),
                    waiting: c.waiting,
                    serving: c.serving,
                    free_slots: c.free_slots,
                }
            })
            .collect();
        let now = crate::task::now_ms();
        Some(NodeRecord {
            node_id: config.node_id.clone(),
            zone: cluster.zone.clone(),
            max_data_class: cluster.max_data_class,
            http_addr: http_addr.to_string(),
            models,
            queue_depth: snap.queues.iter().map(|q| q.waiting).sum(),
            // This node's own engines: a pool instance's slots are other
            // nodes' (and a cloud API's are no edge capacity).
            free_slots: snap
                .instances
                .iter()
                .filter(|i| i.up && i.location == crate::task::Location::Local.as_str())
                .map(|i| i.max_concurrency.saturating_sub(i.running))
                .sum(),
            degradation_level: snap.degradation_level,
            version: env!("CARGO_PKG_VERSION").to_string(),
            started_at_ms: now - self.started.elapsed().as_millis() as i64,
            updated_at_ms: now,
        })
    }

    /// Per logical model, the slots free now on this node's own healthy
    /// instances, less the requests already waiting for them: how much
    /// work from the pool's queue this node may take now. Models without
    /// any are left out.
    pub async fn free_local_slots(&self) -> Vec<(String, usize)> {
        let config = self.config();
        let Some(snap) = self.scheduler.snapshot().await else { return Vec::new() };
        config
            .models
            .values()
            .map(|m| (m.name.clone(), local_capacity(&snap, m).free_slots))
            .filter(|(_, free)| *free > 0)
            .collect()
    }

    /// `GET /v1/nodes` for an admin application: this node first (marked
    /// `self`), then the fresh peers; empty without `[cluster]` (or before
    /// the bus connected once).
    pub async fn nodes(&self, who: &Identity) -> Result<Vec<Value>, GatewayError> {
        if !who.is_admin {
            return Err(GatewayError::new(ErrorCode::PermissionDenied, "admin applications only"));
        }
        let mut out = Vec::new();
        let http_addr = self.pool().map(|p| p.http_addr().to_string()).unwrap_or_default();
        if let Some(me) = self.node_record(&http_addr).await {
            let mut v = serde_json::to_value(me).unwrap_or_default();
            v["self"] = json!(true);
            out.push(v);
        }
        for p in self.pool().map(|p| p.peers()).unwrap_or_default() {
            let mut v = serde_json::to_value(p).unwrap_or_default();
            v["self"] = json!(false);
            out.push(v);
        }
        Ok(out)
    }
}

/// What this node has for one logical model now (its record's figures).
struct Capacity {
    /// Some local instance of it is healthy.
    serving: bool,
    /// The slots free on those instances less the requests waiting.
    free_slots: usize,
    /// Requests waiting in its queue.
    waiting: usize,
}

fn local_capacity(snap: &crate::scheduler::Snapshot, model: &crate::config::ModelConfig) -> Capacity {
    let local = crate::task::Location::Local.as_str();
    let mut serving = false;
    let mut free = 0;
    for i in snap.instances.iter().filter(|i| model.instances.contains(&i.name)) {
        use crate::router::breaker::BreakerState;
        if i.up && i.location == local && i.breaker != BreakerState::Open {
            serving = true;
            let room = i.max_concurrency.saturating_sub(i.running);
            // A half-open breaker lets one trial through at a time.
            free += match (i.kv_cache_full, i.breaker) {
                (true, _) => 0,
                (false, BreakerState::HalfOpen) => room.min(usize::from(i.running == 0)),
                (false, _) => room,
            };
        }
    }
    let waiting = snap.queues.iter().find(|q| q.model == model.name).map_or(0, |q| q.waiting);
    Capacity { serving, free_slots: free.saturating_sub(waiting), waiting }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(id: &str, class: DataClass, depth: usize, model: &str) -> NodeRecord {
        NodeRecord {
            node_id: id.into(),
            zone: "z".into(),
            max_data_class: class,
            http_addr: "127.0.0.1:1".into(),
            models: vec![NodeModel {
                name: model.into(),
                residency: "always".into(),
                state: "loaded".into(),
                waiting: 0,
                serving: true,
                free_slots: 1,
            }],
            queue_depth: depth,
            free_slots: 1,
            degradation_level: 0,
            version: "0".into(),
            started_at_ms: 0,
            updated_at_ms: crate::task::now_ms(),
        }
    }

    #[test]
    fn candidates_serve_the_model_allow_the_class_and_come_least_loaded_first() {
        let pool = Pool::new("me", "127.0.0.1:1", Duration::from_secs(60));
        pool.upsert(record("me", DataClass::Secret, 0, "m"));
        pool.upsert(record("busy", DataClass::Secret, 5, "m"));
        pool.upsert(record("idle", DataClass::Sensitive, 0, "m"));
        pool.upsert(record("public-only", DataClass::Public, 0, "m"));
        pool.upsert(record("other-model", DataClass::Secret, 0, "x"));
        let ids = |v: Vec<NodeRecord>| v.into_iter().map(|n| n.node_id).collect::<Vec<_>>();
        assert_eq!(ids(pool.candidates("m", DataClass::Sensitive)), ["idle", "busy"]);
        assert_eq!(ids(pool.candidates("m", DataClass::Secret)), ["busy"]);
        assert_eq!(ids(pool.candidates("m", DataClass::Public)), ["idle", "public-only", "busy"]);
        pool.remove("busy");
        assert_eq!(ids(pool.candidates("m", DataClass::Secret)), Vec::<String>::new());
    }

    #[test]
    fn a_record_older_than_the_ttl_is_gone() {
        let pool = Pool::new("me", "127.0.0.1:1", Duration::from_secs(60));
        let mut old = record("old", DataClass::Secret, 0, "m");
        old.updated_at_ms -= 61_000;
        pool.upsert(old);
        pool.upsert(record("new", DataClass::Secret, 0, "m"));
        assert_eq!(pool.peers().len(), 1);
        assert_eq!(pool.report()["peers"], 1);
    }
}
