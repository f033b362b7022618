//! The node registry: this node's record in a JetStream key-value bucket
//! (key = `node_id`, value = the JSON record of
//! [`crate::gateway::NodeRecord`]), refreshed every heartbeat and purged at
//! shutdown, and a watch on the bucket that keeps the facade's
//! [`Pool`] of the other nodes current.
//!
//! The bucket is created when missing with `max_age` = the TTL and history
//! 1, so the record of a node that stops refreshing expires; since an
//! expiry sends no watch event, the pool drops records older than the TTL
//! itself. The bus being down is reported in `/ready`'s `cluster` field
//! (never a readiness failure) and everything is retried.
//!
//! Owns: the bucket, the heartbeat, the watch. Does not own: the record's
//! content or the view (`gateway::cluster`), the connection (`super`).

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, kv};
use futures::StreamExt;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::{ClusterConfig, JetStreamStorage, NatsConfig};
use crate::gateway::{Gateway, NodeRecord, Pool};

/// How long the purge at shutdown may take.
const PURGE_TIMEOUT: Duration = Duration::from_secs(2);
/// How long one registry request may take before it counts as failed.
const OP_TIMEOUT: Duration = Duration::from_secs(3);

/// Starts the registry when `[cluster]` is configured: offers the pool to
/// the facade at once, then publishes and watches in tasks on `tracker`.
pub fn spawn(
    client: async_nats::Client,
    nats: &NatsConfig,
    gw: Arc<Gateway>,
    http_addr: String,
    tracker: &TaskTracker,
    shutdown: CancellationToken,
) {
    let Some(cfg) = gw.config().cluster.clone() else { return };
    let pool = Arc::new(Pool::new(&gw.config().node_id, &http_addr, cfg.ttl));
    gw.set_pool(pool.clone());
    let storage = match nats.jetstream.as_ref().map(|j| j.storage) {
        Some(JetStreamStorage::Memory) => jetstream::stream::StorageType::Memory,
        _ => jetstream::stream::StorageType::File,
    };
    let js = jetstream::new(client);
    let t = tracker.clone();
    tracker.spawn(async move {
        let bucket = Bucket { js, cfg: cfg.clone(), storage };
        let Some(store) = open_bucket(&bucket, &gw, &pool, &shutdown).await else { return };
        t.spawn(watch(store.clone(), pool.clone(), cfg, gw.clone(), shutdown.clone()));
        heartbeat(store, bucket, gw, pool, http_addr, shutdown).await;
    });
}

/// How to create the bucket again (a server restarted without it, e.g.
/// memory storage).
struct Bucket {
    js: jetstream::Context,
    cfg: ClusterConfig,
    storage: jetstream::stream::StorageType,
}

impl Bucket {
    fn config(&self) -> kv::Config {
        kv::Config {
            bucket: self.cfg.bucket.clone(),
            description: "edgeway node registry".into(),
            history: 1,
            max_age: self.cfg.ttl,
            storage: self.storage,
            num_replicas: self.cfg.replicas,
            ..Default::default()
        }
    }

    /// Creates the bucket if it is missing; errors are left to the next
    /// write to report.
    async fn recreate(&self) {
        if self.js.get_key_value(&self.cfg.bucket).await.is_err() {
            let _ = self.js.create_key_value(self.config()).await;
        }
    }
}

/// The bucket, created when missing; retried until it answers or the
/// gateway stops.
async fn open_bucket(bucket: &Bucket, gw: &Gateway, pool: &Pool, shutdown: &CancellationToken) -> Option<kv::Store> {
    let (js, cfg) = (&bucket.js, &bucket.cfg);
    let mut delay = Duration::from_millis(100);
    loop {
        let attempt = async {
            match js.get_key_value(&cfg.bucket).await {
                Ok(s) => Ok(s),
                Err(_) => js.create_key_value(bucket.config()).await.map_err(|e| e.to_string()),
            }
        };
        let result = tokio::select! {
            _ = shutdown.cancelled() => return None,
            r = tokio::time::timeout(OP_TIMEOUT, attempt) => r.unwrap_or_else(|_| Err("timed out".into())),
        };
        match result {
            Ok(s) => return Some(s),
            Err(e) => {
                gw.metrics().cluster_publish_failures.with_label_values(&["bucket"]).inc();
                tracing::warn!(bucket = %cfg.bucket, error = %e, "node registry bucket unavailable; retrying");
                pool.set_state(format!("unavailable: {e}"));
            }
        }
        tokio::select! {
            _ = shutdown.cancelled() => return None,
            _ = tokio::time::sleep(delay) => {}
        }
        delay = (delay * 2).min(cfg.heartbeat);
    }
}

/// Puts this node's record every heartbeat; purges it when the gateway
/// starts to drain or stops.
async fn heartbeat(
    store: kv::Store,
    bucket: Bucket,
    gw: Arc<Gateway>,
    pool: Arc<Pool>,
    http_addr: String,
    shutdown: CancellationToken,
) {
    let cfg = bucket.cfg.clone();
    let node_id = gw.config().node_id.clone();
    let stopped = pool.publishing();
    let mut tick = tokio::time::interval(cfg.heartbeat);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = stopped.cancelled() => {
                // The record ages out as a crashed node's would.
                shutdown.cancelled().await;
                return;
            }
            _ = tick.tick() => {}
        }
        if gw.is_draining() {
            // A draining node takes no new work: it leaves the pool now.
            break;
        }
        gw.metrics().cluster_nodes.set(pool.peers().len() as i64 + 1);
        let Some(record) = gw.node_record(&http_addr).await else { continue };
        let Ok(body) = serde_json::to_vec(&record) else { continue };
        let put = tokio::select! {
            // A put held up (a leader election) does not delay the purge.
            _ = shutdown.cancelled() => break,
            r = tokio::time::timeout(OP_TIMEOUT, store.put(&node_id, body.into())) => r,
        };
        match put {
            Ok(Ok(_)) => pool.set_state("ok"),
            Ok(Err(e)) => {
                failed(&gw, &pool, "put", &e.to_string());
                if e.kind() != kv::PutErrorKind::InvalidKey {
                    // The stream may be gone (a server restarted with
                    // memory storage): make it again for the next beat.
                    let _ = tokio::time::timeout(OP_TIMEOUT, bucket.recreate()).await;
                }
            }
            Err(_) => failed(&gw, &pool, "put", "timed out"),
        }
    }
    // Peers see the node leave at once, not a TTL later.
    match tokio::time::timeout(PURGE_TIMEOUT, store.purge(&node_id)).await {
        Ok(Ok(())) => tracing::info!(node = %node_id, "left the node registry"),
        Ok(Err(e)) => failed(&gw, &pool, "purge", &e.to_string()),
        Err(_) => failed(&gw, &pool, "purge", "timed out"),
    }
}

fn failed(gw: &Gateway, pool: &Pool, op: &str, why: &str) {
    gw.metrics().cluster_publish_failures.with_label_values(&[op]).inc();
    tracing::warn!(op, error = why, "node registry write failed; retrying");
    pool.set_state(format!("unavailable: {why}"));
}

/// Keeps the pool current from the bucket's changes (a put, a delete or
/// purge at once), and reads every record again each heartbeat: a watch
/// whose consumer sat on a server that left can stay silent for a while,
/// and an expired key sends no event at all. A broken watch is opened
/// again at the next resync.
async fn watch(store: kv::Store, pool: Arc<Pool>, cfg: ClusterConfig, gw: Arc<Gateway>, shutdown: CancellationToken) {
    let mut resync = tokio::time::interval(cfg.heartbeat);
    resync.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut watch: Option<kv::Watch> = None;
    loop {
        let next = async {
            match watch.as_mut() {
                Some(w) => w.next().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = resync.tick() => {
                if watch.is_none() {
                    match tokio::time::timeout(OP_TIMEOUT, store.watch_all()).await {
                        Ok(Ok(w)) => watch = Some(w),
                        Ok(Err(e)) => tracing::warn!(error = %e, "cannot watch the node registry; retrying"),
                        Err(_) => tracing::warn!("watching the node registry timed out; retrying"),
                    }
                }
                if let Err(e) = tokio::time::timeout(OP_TIMEOUT, read_all(&store, &pool)).await.unwrap_or_else(|_| Err("timed out".into())) {
                    tracing::debug!(error = %e, "node registry resync failed");
                }
            }
            n = next => match n {
                Some(Ok(e)) => match e.operation {
                    kv::Operation::Put => apply(&pool, &e.key, &e.value),
                    kv::Operation::Delete | kv::Operation::Purge => pool.remove(&e.key),
                },
                Some(Err(e)) => {
                    tracing::warn!(error = %e, "node registry watch failed; watching again");
                    watch = None;
                }
                None => watch = None,
            },
        }
        gw.metrics().cluster_nodes.set(pool.peers().len() as i64 + 1);
    }
}

/// A record read under `key`, into the pool.
fn apply(pool: &Pool, key: &str, value: &[u8]) {
    match serde_json::from_slice::<NodeRecord>(value) {
        Ok(r) if r.node_id == key => pool.upsert(r),
        Ok(_) => tracing::warn!(key, "node record under another node's key; ignored"),
        Err(err) => tracing::warn!(key, error = %err, "unreadable node record; ignored"),
    }
}

/// Reads every record of the bucket; nodes whose key is gone leave.
async fn read_all(store: &kv::Store, pool: &Pool) -> Result<(), String> {
    let keys: Vec<String> =
        store.keys().await.map_err(|e| e.to_string())?.filter_map(|k| async { k.ok() }).collect().await;
    for k in &keys {
        if let Some(v) = store.get(k).await.map_err(|e| e.to_string())? {
            apply(pool, k, &v);
        }
    }
    for gone in pool.known().into_iter().filter(|k| !keys.contains(k)) {
        pool.remove(&gone);
    }
    Ok(())
}
