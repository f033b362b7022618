//! The `pool` engine (`type = "pool"`): an instance that is the other
//! nodes of the pool. A task it takes is forwarded to a node that serves
//! its model and may receive its data class, least loaded first; the
//! answer streams back as any engine's does, so the scheduler's deadlines,
//! retries, breaker and cancellation apply to a forward unchanged.
//!
//! Owns: the choice of node among the candidates (the first that accepts,
//! at most [`MAX_NODES_TRIED`] of them: a node that refuses before it
//! accepted the task, or has no listener, is passed over, so never-started
//! work goes to the next node); a breaker per node ([`NodeBreakers`]: a
//! node whose forwards failed [`NODE_FAILURES_TO_OPEN`] times in a row is
//! passed over for a cool-down, then given one task to prove itself); and
//! what the instance's probe reports (up while some node serves the
//! model). Does not own: the bus, the wire of a
//! forward or the node view (the NATS ingress implements [`Peers`] with the
//! node registry's pool), so this layer still imports nothing above it.
//!
//! # Cancel safety
//! As for every adapter, dropping the [`EngineStream`] is the cancel: the
//! [`Peers`] implementation unsubscribes the reply stream and tells the
//! node that runs the task to cancel it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures::StreamExt;

use super::{Capabilities, Engine, EngineChunk, EngineError, EngineHealth, EngineLoad, EngineRequest, EngineStream};
use crate::config::{EngineConfig, EngineKind};
use crate::task::{DataClass, Operation, Priority};

/// At most this many nodes are asked, in turn, before the attempt fails.
pub const MAX_NODES_TRIED: usize = 3;

/// Forwards to one node that fail in a row before it is passed over.
pub const NODE_FAILURES_TO_OPEN: u32 = 3;
/// How long a failing node is passed over at first; doubled each time it
/// fails again after its cool-down, up to [`NODE_COOL_DOWN_MAX`].
pub const NODE_COOL_DOWN: Duration = Duration::from_secs(5);
pub const NODE_COOL_DOWN_MAX: Duration = Duration::from_secs(60);

/// A breaker per node, for one pool instance: forwards that failed (a
/// refusal, no listener, silence, an error in the stream) in a row open it;
/// an open node is passed over until its cool-down ends, then one task may
/// try it (half-open): a success closes it, a failure opens it again for
/// twice as long. A task's own fault (a 4xx of the node) counts neither
/// way. Nodes are tried in the registry's order among those not open; when
/// every candidate is open, none is asked.
#[derive(Default)]
pub struct NodeBreakers {
    nodes: Mutex<HashMap<String, NodeState>>,
}

#[derive(Debug, Clone, Copy, Default)]
struct NodeState {
    failures: u32,
    /// Passed over until then.
    open_until: Option<Instant>,
    /// The cool-down of the last opening.
    cool_down: Duration,
    /// One task is trying the node after its cool-down.
    probing: bool,
}

impl NodeBreakers {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, NodeState>> {
        self.nodes.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether a task may be forwarded to `node` now (taking the one
    /// half-open try when its cool-down is over).
    pub fn admit(&self, node: &str, now: Instant) -> bool {
        let mut nodes = self.lock();
        let Some(s) = nodes.get_mut(node) else { return true };
        match s.open_until {
            None => true,
            Some(until) if now < until => false,
            Some(_) if s.probing => false,
            Some(_) => {
                s.probing = true;
                true
            }
        }
    }

    pub fn success(&self, node: &str) {
        self.lock().remove(node);
    }

    pub fn failure(&self, node: &str, now: Instant) {
        let mut nodes = self.lock();
        let s = nodes.entry(node.to_string()).or_default();
        s.failures += 1;
        if s.probing || s.failures >= NODE_FAILURES_TO_OPEN {
            let next = if s.probing { (s.cool_down * 2).min(NODE_COOL_DOWN_MAX) } else { NODE_COOL_DOWN };
            s.cool_down = next;
            s.open_until = Some(now + next);
            s.probing = false;
            tracing::warn!(
                node,
                failures = s.failures,
                cool_down_ms = next.as_millis() as u64,
                "forwards to a node keep failing; passing it over"
            );
        }
    }

    /// A try that ended without a verdict (the task was cancelled).
    pub fn abandoned(&self, node: &str) {
        if let Some(s) = self.lock().get_mut(node) {
            s.probing = false;
        }
    }

    /// The nodes passed over now.
    pub fn open(&self, now: Instant) -> Vec<String> {
        self.lock().iter().filter(|(_, s)| s.open_until.is_some_and(|u| now < u)).map(|(n, _)| n.clone()).collect()
    }
}

/// Whether a failed forward says something about the node (not the
/// task's own fault: a 4xx other than 429).
fn counts(e: &EngineError) -> bool {
    !matches!(e, EngineError::Status { status, .. } if *status < 500 && *status != 429)
}

/// Who a forwarded task is, for the node that runs it: set by the
/// scheduler's driver on the [`EngineRequest`] of a pool instance only.
#[derive(Debug)]
pub struct Origin {
    /// This node.
    pub node_id: String,
    pub task_id: String,
    pub tenant: String,
    pub application: String,
    pub user_id: Option<String>,
    pub priority: Priority,
    pub data_class: DataClass,
    /// The task's first-token and total deadlines: the node that runs it
    /// gets what is left of them.
    pub first_token_deadline: Instant,
    pub total_deadline: Instant,
    /// The node that accepted the task and its task id there, once one did
    /// (for this task's record).
    pub forwarded_to: OnceLock<(String, String)>,
    /// Put in the pool's work queue and not taken by a node yet (set by the
    /// [`Peers`] implementation). A deadline that passes then is no verdict
    /// on the instance: waiting is what the queue is for.
    pub queued: std::sync::atomic::AtomicBool,
}

/// The other nodes, as the bus sees them (implemented by the NATS
/// ingress).
#[async_trait]
pub trait Peers: Send + Sync + 'static {
    /// The nodes that serve logical model `model` and may receive `class`
    /// data, best first.
    fn candidates(&self, model: &str, class: DataClass) -> Vec<String>;
    /// Forwards the request to `node`; resolves once that node accepted
    /// the task (its `accepted` event), with the rest of its answer as a
    /// stream. A refusal before that is an error and the task runs
    /// nowhere.
    async fn open(&self, node: &str, req: &EngineRequest, origin: &Arc<Origin>) -> Result<EngineStream, EngineError>;
    /// Store and forward: work of this priority or less urgent that no
    /// node takes now may wait in the pool's work queue (`None`: there is
    /// none).
    fn queue_from(&self) -> Option<Priority>;
    /// Puts the request in the pool's work queue; resolves once a node
    /// pulled it and accepted the task, with the rest of its answer as a
    /// stream (as [`Peers::open`]), or with an error when the task's
    /// first-token deadline passes first. Dropping the future takes the
    /// request out of the queue.
    async fn enqueue(&self, req: &EngineRequest, origin: &Arc<Origin>) -> Result<EngineStream, EngineError>;
}

/// Where a running edgeway's [`Peers`] are, once its bus is up (shared by
/// every pool instance it builds, those of reloads included).
#[derive(Default)]
pub struct PeerSlot(OnceLock<Arc<dyn Peers>>);

impl PeerSlot {
    /// Set once, by the NATS ingress; later calls are ignored.
    pub fn set(&self, peers: Arc<dyn Peers>) {
        let _ = self.0.set(peers);
    }

    pub fn get(&self) -> Option<&Arc<dyn Peers>> {
        self.0.get()
    }
}

pub struct PoolEngine {
    cfg: EngineConfig,
    peers: Arc<PeerSlot>,
    breakers: Arc<NodeBreakers>,
}

impl PoolEngine {
    pub fn new(cfg: EngineConfig, peers: Arc<PeerSlot>) -> PoolEngine {
        PoolEngine { cfg, peers, breakers: Arc::default() }
    }
}

/// Tells the node's breaker how a forward's stream ended: a success at its
/// `Finish`, a failure at an error (that counts), nothing when it was
/// dropped before either.
struct Verdict {
    breakers: Arc<NodeBreakers>,
    node: String,
    given: bool,
}

impl Verdict {
    fn see(&mut self, item: &Result<EngineChunk, EngineError>) {
        if self.given {
            return;
        }
        match item {
            Ok(EngineChunk::Finish(_)) => self.breakers.success(&self.node),
            Err(e) if counts(e) => self.breakers.failure(&self.node, Instant::now()),
            Err(_) => self.breakers.abandoned(&self.node),
            Ok(_) => return,
        }
        self.given = true;
    }
}

impl Drop for Verdict {
    fn drop(&mut self) {
        if !self.given {
            self.breakers.abandoned(&self.node);
        }
    }
}

#[async_trait]
impl Engine for PoolEngine {
    fn name(&self) -> &str {
        &self.cfg.name
    }

    fn kind(&self) -> EngineKind {
        EngineKind::Pool
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities { streaming: true, reports_usage: true, cancel_on_disconnect: true }
    }

    async fn stream(&self, req: &EngineRequest) -> Result<EngineStream, EngineError> {
        let Some(peers) = self.peers.get() else {
            return Err(EngineError::Unreachable("the node pool is not connected".into()));
        };
        let Some(origin) = &req.origin else {
            return Err(EngineError::Protocol("a forward needs its origin".into()));
        };
        // The call's own fault, not the instance's: its breaker does not
        // count it.
        if req.operation != Operation::Chat {
            return Err(EngineError::Status { status: 400, body: "only chat tasks are forwarded".into() });
        }
        let nodes = peers.candidates(&req.model, origin.data_class);
        let queued = peers.queue_from().is_some_and(|from| origin.priority >= from);
        let direct = self.forward(peers, &nodes, req, origin).await;
        match direct {
            Ok(s) => Ok(s),
            // No node takes it now: low-priority work waits in the pool's
            // work queue for one that can (the task's own fault excepted).
            Err(e) if queued && counts(&e) => {
                tracing::info!(task_id = %origin.task_id, model = %req.model, why = %e, "no node takes the task now; it waits in the pool's work queue");
                peers.enqueue(req, origin).await
            }
            Err(e) => Err(e),
        }
    }

    /// Up while the pool is connected and some node serves the model (for
    /// the least strict class: a task's own class is checked when it is
    /// forwarded), or while it has a work queue that holds low-priority
    /// work until one does.
    async fn health(&self) -> EngineHealth {
        let (up, detail) = match self.peers.get() {
            None => (false, "the node pool is not connected".to_string()),
            Some(p) => match (p.candidates(&self.cfg.model, DataClass::Public).len(), p.queue_from()) {
                (0, None) => (false, format!("no node of the pool serves '{}'", self.cfg.model)),
                (0, Some(from)) => (
                    true,
                    format!(
                        "no node of the pool serves '{}' now; {} work and less urgent waits in the pool's work queue",
                        self.cfg.model,
                        from.as_str()
                    ),
                ),
                (n, _) => {
                    let open = self.breakers.open(Instant::now());
                    let failing = if open.is_empty() {
                        String::new()
                    } else {
                        format!("; failing, passed over: {}", open.join(", "))
                    };
                    (true, format!("{n} node(s) serve '{}'{failing}", self.cfg.model))
                }
            },
        };
        EngineHealth { up, detail, model_resident: None }
    }

    /// While no node serves the model, the instance takes only the work
    /// its pool's queue holds (see [`Peers::queue_from`]).
    async fn load(&self) -> EngineLoad {
        let takes_from = match self.peers.get() {
            Some(p) if p.candidates(&self.cfg.model, DataClass::Public).is_empty() => p.queue_from(),
            _ => None,
        };
        EngineLoad { takes_from, ..EngineLoad::default() }
    }
}

impl PoolEngine {
    /// Forwards to the first of `nodes` that accepts the task.
    async fn forward(
        &self,
        peers: &Arc<dyn Peers>,
        nodes: &[String],
        req: &EngineRequest,
        origin: &Arc<Origin>,
    ) -> Result<EngineStream, EngineError> {
        if nodes.is_empty() {
            return Err(EngineError::Unreachable(format!(
                "no node of the pool serves '{}' and may receive {} data",
                req.model,
                origin.data_class.as_str()
            )));
        }
        let mut last = None;
        let admitted = nodes.iter().filter(|n| self.breakers.admit(n, Instant::now()));
        for node in admitted.take(MAX_NODES_TRIED) {
            match peers.open(node, req, origin).await {
                Ok(s) => {
                    let mut verdict = Verdict { breakers: self.breakers.clone(), node: node.clone(), given: false };
                    return Ok(s.inspect(move |item| verdict.see(item)).boxed());
                }
                Err(e) => {
                    tracing::info!(node = %node, task_id = %origin.task_id, error = %e, "forward refused; next node");
                    if counts(&e) {
                        self.breakers.failure(node, Instant::now());
                    } else {
                        self.breakers.abandoned(node);
                    }
                    last = Some(e);
                }
            }
        }
        Err(last.unwrap_or_else(|| {
            EngineError::Unreachable(format!("every node that serves '{}' is failing; passed over", req.model))
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_that_keeps_failing_is_passed_over_then_tried_once_after_its_cool_down() {
        let b = NodeBreakers::default();
        let t0 = Instant::now();
        for _ in 0..NODE_FAILURES_TO_OPEN - 1 {
            assert!(b.admit("x", t0));
            b.failure("x", t0);
        }
        assert!(b.admit("x", t0), "still closed below the threshold");
        b.failure("x", t0);
        assert!(!b.admit("x", t0), "open");
        assert!(b.admit("y", t0), "other nodes are not affected");
        assert_eq!(b.open(t0), ["x"]);
        // After the cool-down: one try (half-open), not two.
        let later = t0 + NODE_COOL_DOWN;
        assert!(b.admit("x", later));
        assert!(!b.admit("x", later));
        // It fails again: open for twice as long.
        b.failure("x", later);
        assert!(!b.admit("x", later + NODE_COOL_DOWN));
        assert!(b.admit("x", later + NODE_COOL_DOWN * 2));
        // A success closes it.
        b.success("x");
        assert!(b.admit("x", later) && b.open(later).is_empty());
    }

    #[test]
    fn a_try_without_verdict_lets_the_next_task_try() {
        let b = NodeBreakers::default();
        let t0 = Instant::now();
        for _ in 0..NODE_FAILURES_TO_OPEN {
            b.failure("x", t0);
        }
        let later = t0 + NODE_COOL_DOWN;
        assert!(b.admit("x", later));
        b.abandoned("x");
        assert!(b.admit("x", later), "the cancelled try gave no verdict");
        assert!(!counts(&EngineError::Status { status: 400, body: String::new() }));
        assert!(counts(&EngineError::Status { status: 503, body: String::new() }));
    }
}
