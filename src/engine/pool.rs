//! The `pool` engine (`type = "pool"`): an instance that is the other
//! nodes of the pool. A task it takes is forwarded to a node that serves
//! its model and may receive its data class, least loaded first; the
//! answer streams back as any engine's does, so the scheduler's deadlines,
//! retries, breaker and cancellation apply to a forward unchanged.
//!
//! Owns: the choice of node among the candidates (the first that accepts,
//! at most [`MAX_NODES_TRIED`] of them: a node that refuses before it
//! accepted the task, or has no listener, is passed over, so never-started
//! work goes to the next node), and what the instance's probe reports (up
//! while some node serves the model). Does not own: the bus, the wire of a
//! forward or the node view (the NATS ingress implements [`Peers`] with the
//! node registry's pool), so this layer still imports nothing above it.
//!
//! # Cancel safety
//! As for every adapter, dropping the [`EngineStream`] is the cancel: the
//! [`Peers`] implementation unsubscribes the reply stream and tells the
//! node that runs the task to cancel it.

use std::sync::{Arc, OnceLock};
use std::time::Instant;

use async_trait::async_trait;

use super::{Capabilities, Engine, EngineError, EngineHealth, EngineRequest, EngineStream};
use crate::config::{EngineConfig, EngineKind};
use crate::task::{DataClass, Operation, Priority};

/// At most this many nodes are asked, in turn, before the attempt fails.
pub const MAX_NODES_TRIED: usize = 3;

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
}

impl PoolEngine {
    pub fn new(cfg: EngineConfig, peers: Arc<PeerSlot>) -> PoolEngine {
        PoolEngine { cfg, peers }
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
        if req.operation != Operation::Chat {
            return Err(EngineError::Unreachable("only chat tasks are forwarded".into()));
        }
        let nodes = peers.candidates(&req.model, origin.data_class);
        if nodes.is_empty() {
            return Err(EngineError::Unreachable(format!(
                "no node of the pool serves '{}' and may receive {} data",
                req.model,
                origin.data_class.as_str()
            )));
        }
        let mut last = None;
        for node in nodes.iter().take(MAX_NODES_TRIED) {
            match peers.open(node, req, origin).await {
                Ok(s) => return Ok(s),
                Err(e) => {
                    tracing::info!(node = %node, task_id = %origin.task_id, error = %e, "forward refused; next node");
                    last = Some(e);
                }
            }
        }
        Err(last.expect("at least one node was tried"))
    }

    /// Up while the pool is connected and some node serves the model (for
    /// the least strict class: a task's own class is checked when it is
    /// forwarded).
    async fn health(&self) -> EngineHealth {
        let (up, detail) = match self.peers.get() {
            None => (false, "the node pool is not connected".to_string()),
            Some(p) => match p.candidates(&self.cfg.model, DataClass::Public).len() {
                0 => (false, format!("no node of the pool serves '{}'", self.cfg.model)),
                n => (true, format!("{n} node(s) serve '{}'", self.cfg.model)),
            },
        };
        EngineHealth { up, detail, model_resident: None }
    }
}
