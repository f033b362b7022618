//! The status view behind `GET /admin/status`, the `/status` page and
//! `edgeway status`: one snapshot of what the box is doing now (queues by
//! model and priority, running tasks with their age and tokens, engines
//! with health, breaker, residency and KV use, connected devices, recent
//! failures with their codes, the degradation level) and of the last
//! minutes of traffic and time to first token.
//!
//! Owns: what the snapshot holds, the tenant filter of its task lists, and
//! the traffic history (a ring of [`BUCKET`]-long buckets sampled from the
//! metrics, so that the request path pays nothing for it). Does not own:
//! the wire format or the page (ingress), the failure ring (the lifecycle
//! [`Recorder`](crate::telemetry::lifecycle::Recorder) fills it), nor the
//! device table (the MQTT ingress offers it through [`DeviceList`]).

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use prometheus::core::Collector;
use serde::Serialize;

use crate::error::GatewayError;
use crate::scheduler::InstanceSnapshot;
use crate::task::{Identity, TaskState};
use crate::telemetry::lifecycle::Failure;
use crate::telemetry::Metrics;

use super::Gateway;

/// The length of one traffic bucket.
pub const BUCKET: Duration = Duration::from_secs(10);
/// Traffic buckets kept: five minutes.
pub const BUCKETS: usize = 30;
/// Running tasks listed at most (all are counted).
pub const MAX_RUNNING_LISTED: usize = 200;
/// Connected devices listed at most (all are counted).
pub const MAX_DEVICES_LISTED: usize = 100;

/// The connected devices, offered by the MQTT ingress.
pub trait DeviceList: Send + Sync {
    /// How many devices have an open connection (all tenants), and the
    /// ids of up to `max` of those of `tenant` (sorted).
    fn connected(&self, tenant: &str, max: usize) -> (usize, Vec<String>);
}

/// The whole picture, as `GET /admin/status` serves it.
#[derive(Debug, Clone, Serialize)]
pub struct Status {
    /// Unix time of the snapshot, ms.
    pub at_ms: i64,
    pub node_id: String,
    pub uptime_s: u64,
    pub config_version: String,
    pub draining: bool,
    /// `ok`, or why the store cannot write.
    pub store: String,
    /// 0 normal … 3 busy answers only (see `/ready`).
    pub degradation_level: u8,
    pub queues: Vec<QueueStatus>,
    /// Live tasks of the caller's tenant (queued or running), oldest first,
    /// at most [`MAX_RUNNING_LISTED`].
    pub tasks: Vec<LiveTaskStatus>,
    /// How many live tasks of the caller's tenant there are.
    pub tasks_total: usize,
    pub engines: Vec<EngineStatus>,
    pub engine_processes: Vec<crate::engine::supervisor::ProcessReport>,
    /// `null` when MQTT is off.
    pub devices: Option<Devices>,
    /// The node pool as `GET /v1/nodes` shows it (this node first); empty
    /// without `[cluster]`.
    pub nodes: Vec<serde_json::Value>,
    /// Recent failures of the caller's tenant, newest first.
    pub failures: Vec<Failure>,
    /// Traffic per [`BUCKET`], oldest first; the last one is the bucket in
    /// progress.
    pub traffic: Vec<Bucket>,
}

#[derive(Debug, Clone, Serialize)]
pub struct QueueStatus {
    pub model: String,
    pub waiting: usize,
    pub capacity: usize,
    /// Waiting tasks by priority (`P0` … `P4`), only those with some.
    pub by_priority: BTreeMap<String, i64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct LiveTaskStatus {
    pub task_id: String,
    pub request_id: String,
    pub application: String,
    /// `http`, `mqtt`, `nats` or `ws`.
    pub ingress: &'static str,
    pub model: String,
    pub priority: &'static str,
    /// `QUEUED`, `DISPATCHING`, `RUNNING`, … (`null` in the instant
    /// between its end and its leaving the list).
    pub state: Option<TaskState>,
    pub age_ms: u64,
    /// Output deltas streamed so far: tokens, for engines that send one
    /// token per chunk (llama.cpp, vLLM).
    pub tokens: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct EngineStatus {
    #[serde(flatten)]
    pub instance: InstanceSnapshot,
    /// `loaded`, `loading` or `unloaded` for an instance whose model
    /// edgeway loads and unloads; `null` otherwise.
    pub residency: Option<&'static str>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Devices {
    /// Devices connected, of every tenant (as `edgeway_mqtt_devices_connected`).
    pub connected: usize,
    /// The caller's tenant's, at most [`MAX_DEVICES_LISTED`], sorted.
    pub ids: Vec<String>,
}

/// One traffic bucket.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Bucket {
    /// Unix time of its start, ms.
    pub start_ms: i64,
    /// Its length so far, s.
    pub seconds: f64,
    /// Tasks that ended in it, and how many of them not SUCCEEDED.
    pub finished: u64,
    pub failed: u64,
    /// First tokens in it, and their mean time from receipt, ms.
    pub ttft_count: u64,
    pub ttft_mean_ms: Option<f64>,
}

/// Running totals read from the metrics.
#[derive(Debug, Clone, Copy, Default)]
struct Totals {
    finished: u64,
    failed: u64,
    ttft_count: u64,
    ttft_sum_s: f64,
}

impl Totals {
    fn read(m: &Metrics) -> Totals {
        let mut t = Totals::default();
        for f in m.tasks_finished.collect() {
            for x in f.get_metric() {
                let n = x.get_counter().get_value() as u64;
                t.finished += n;
                if x.get_label().iter().any(|l| l.name() == "state" && l.value() != TaskState::Succeeded.as_str()) {
                    t.failed += n;
                }
            }
        }
        for f in m.first_token.collect() {
            for x in f.get_metric() {
                let h = x.get_histogram();
                t.ttft_count += h.get_sample_count();
                t.ttft_sum_s += h.get_sample_sum();
            }
        }
        t
    }

    fn bucket_since(&self, base: &Totals, start_ms: i64, seconds: f64) -> Bucket {
        let ttft_count = self.ttft_count.saturating_sub(base.ttft_count);
        Bucket {
            start_ms,
            seconds,
            finished: self.finished.saturating_sub(base.finished),
            failed: self.failed.saturating_sub(base.failed),
            ttft_count,
            ttft_mean_ms: (ttft_count > 0).then(|| (self.ttft_sum_s - base.ttft_sum_s) * 1000.0 / ttft_count as f64),
        }
    }
}

/// The traffic of the last minutes: closed buckets and the totals at the
/// start of the one in progress.
pub(super) struct History {
    inner: Mutex<HistoryInner>,
}

struct HistoryInner {
    base: Totals,
    started: Instant,
    started_ms: i64,
    closed: VecDeque<Bucket>,
}

impl History {
    pub(super) fn new(m: &Metrics) -> History {
        History {
            inner: Mutex::new(HistoryInner {
                base: Totals::read(m),
                started: Instant::now(),
                started_ms: crate::task::now_ms(),
                closed: VecDeque::new(),
            }),
        }
    }

    /// Closes the bucket in progress and starts the next.
    fn roll(&self, m: &Metrics) {
        let now = Totals::read(m);
        let mut g = self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let b = now.bucket_since(&g.base, g.started_ms, g.started.elapsed().as_secs_f64());
        if g.closed.len() == BUCKETS - 1 {
            g.closed.pop_front();
        }
        g.closed.push_back(b);
        g.base = now;
        g.started = Instant::now();
        g.started_ms = crate::task::now_ms();
    }

    fn buckets(&self, m: &Metrics) -> Vec<Bucket> {
        let now = Totals::read(m);
        let g = self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut v: Vec<Bucket> = g.closed.iter().cloned().collect();
        v.push(now.bucket_since(&g.base, g.started_ms, g.started.elapsed().as_secs_f64()));
        v
    }

    /// Closes a bucket every [`BUCKET`] while the history lives (its
    /// gateway holds it).
    pub(super) fn sample_every(history: &Arc<History>, metrics: Arc<Metrics>) {
        let history: Weak<History> = Arc::downgrade(history);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(BUCKET);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            loop {
                tick.tick().await;
                let Some(h) = history.upgrade() else { return };
                h.roll(&metrics);
            }
        });
    }
}

impl Gateway {
    /// Offers the connected devices to the status view (the MQTT ingress,
    /// once, at start).
    pub fn set_device_list(&self, list: Arc<dyn DeviceList>) {
        let _ = self.devices.set(list);
    }

    /// The status snapshot for an admin application (`PERMISSION_DENIED`
    /// for any other): node-wide queues, engines and devices, and the
    /// tasks and failures of its own tenant.
    pub async fn status(&self, who: &Identity) -> Result<Status, GatewayError> {
        if !who.is_admin {
            return Err(GatewayError::new(crate::error::ErrorCode::PermissionDenied, "admin applications only"));
        }
        let Some(snap) = self.scheduler.snapshot().await else {
            return Err(GatewayError::internal("scheduler is not running"));
        };
        let config = self.config();
        let mut by_priority: BTreeMap<String, BTreeMap<String, i64>> = BTreeMap::new();
        for f in self.metrics.queue_depth.collect() {
            for x in f.get_metric() {
                let label = |n: &str| x.get_label().iter().find(|l| l.name() == n).map(|l| l.value().to_string());
                let (Some(model), Some(p)) = (label("model"), label("priority")) else { continue };
                let n = x.get_gauge().get_value() as i64;
                if n > 0 {
                    by_priority.entry(model).or_default().insert(p, n);
                }
            }
        }
        let queues = snap
            .queues
            .into_iter()
            .map(|q| QueueStatus {
                by_priority: by_priority.remove(&q.model).unwrap_or_default(),
                model: q.model,
                waiting: q.waiting,
                capacity: q.capacity,
            })
            .collect();
        let mut live: Vec<_> = self.scheduler.live_tasks().into_iter().filter(|e| e.tenant == who.tenant).collect();
        live.sort_by_key(|e| e.created);
        let tasks_total = live.len();
        let tasks = live
            .iter()
            .take(MAX_RUNNING_LISTED)
            .map(|e| LiveTaskStatus {
                task_id: e.task_id.clone(),
                request_id: e.request_id.clone(),
                application: e.application.clone(),
                ingress: e.ingress.as_str(),
                model: e.logical_model.clone(),
                priority: e.priority.as_str(),
                state: self.recorder.state_of(&e.task_id),
                age_ms: e.created.elapsed().as_millis() as u64,
                tokens: e.log.deltas(),
            })
            .collect();
        let engines = snap
            .instances
            .into_iter()
            .map(|i| EngineStatus {
                residency: config
                    .engines
                    .get(&i.name)
                    .filter(|e| e.is_local())
                    .and_then(|_| self.residency.state_of(&i.name))
                    .map(|s| s.as_str()),
                instance: i,
            })
            .collect();
        let devices = self.devices.get().map(|d| {
            let (connected, ids) = d.connected(&who.tenant, MAX_DEVICES_LISTED);
            Devices { connected, ids }
        });
        let nodes = self.nodes(who).await?;
        let mut failures: Vec<Failure> =
            self.recorder.recent_failures().into_iter().filter(|f| f.tenant == who.tenant).collect();
        failures.reverse();
        Ok(Status {
            at_ms: crate::task::now_ms(),
            node_id: self.store.node_id().to_string(),
            uptime_s: self.started.elapsed().as_secs(),
            config_version: config.version.clone(),
            draining: self.is_draining(),
            store: self.store.health().degraded().map_or_else(|| "ok".to_string(), |why| format!("degraded: {why}")),
            degradation_level: snap.degradation_level,
            queues,
            tasks,
            tasks_total,
            engines,
            engine_processes: self.processes.reports(),
            devices,
            nodes,
            failures,
            traffic: self.history.buckets(&self.metrics),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traffic_buckets_count_ends_failures_and_first_tokens_since_their_start() {
        let m = Metrics::new();
        let h = History::new(&m);
        m.tasks_finished.with_label_values(&["m", "SUCCEEDED"]).inc_by(3);
        m.tasks_finished.with_label_values(&["m", "FAILED"]).inc();
        m.first_token.with_label_values(&["m", "P2"]).observe(0.1);
        m.first_token.with_label_values(&["m", "P2"]).observe(0.3);
        let b = h.buckets(&m);
        assert_eq!(b.len(), 1);
        assert_eq!((b[0].finished, b[0].failed, b[0].ttft_count), (4, 1, 2));
        assert!((b[0].ttft_mean_ms.unwrap() - 200.0).abs() < 1e-6);
        h.roll(&m);
        m.tasks_finished.with_label_values(&["m", "CANCELLED"]).inc();
        let b = h.buckets(&m);
        assert_eq!(b.len(), 2);
        assert_eq!((b[1].finished, b[1].failed, b[1].ttft_count, b[1].ttft_mean_ms), (1, 1, 0, None));
        for _ in 0..BUCKETS * 2 {
            h.roll(&m);
        }
        assert_eq!(h.buckets(&m).len(), BUCKETS, "the ring is bounded");
    }
}
