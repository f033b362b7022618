//! The router: from a granted slot to a running engine request.
//!
//! Owns: the engine instances (their adapters, as built from the config);
//! their health probes (`health.rs`), which decide when an instance is up
//! or down and pass that, with what the engine says of its load, to the
//! scheduler that dispatches on it; the choice of
//! instance for a task ([`pick`], called by the scheduler's policy); and
//! dispatch (`dispatch.rs`): opening the engine stream, sending a request
//! once more when its connection broke before any answer, and turning an
//! engine's failure into the public error code a client sees. Circuit
//! breakers and residency join the instance state here.
//!
//! Does not own: queues and slots (the scheduler grants a slot on an
//! instance, then calls [`Router::open`]), deadlines and the task's life
//! cycle (the scheduler's driver), or wire formats (the engine adapters).
//! The router knows nothing of the scheduler: instance changes go out
//! through the sink the scheduler hands to [`Router::start_probes`].

pub mod breaker;
pub mod budget;
mod dispatch;
mod health;
mod pick;

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::Config;
use crate::engine::{self, Engine, EngineLoad};
use crate::telemetry::Metrics;

pub use dispatch::DispatchError;
pub use pick::{any_up, pick, InstanceView};

/// One engine instance: an adapter and what the config says about it.
pub struct Instance {
    pub name: String,
    pub engine: Arc<dyn Engine>,
    /// The engine's own name for the model.
    pub engine_model: String,
    pub max_concurrency: usize,
    /// edgeway is the engine's only client, so a busy slot the engine
    /// reports after a cancel is one edgeway asked to stop.
    pub exclusive: bool,
    /// Time between health probes.
    pub health_interval: Duration,
}

/// A change the scheduler must know about, sent through the sink given to
/// [`Router::start_probes`].
#[derive(Debug, Clone, PartialEq)]
pub enum InstanceEvent {
    /// The instance went up or down (only changes are sent), with the
    /// probe's detail (short, for logs and `/ready`, never for clients of
    /// tasks).
    Health { instance: usize, up: bool, detail: String },
    /// What a healthy engine said about itself at a probe: its load and,
    /// where it tells, whether its model is in memory.
    Load { instance: usize, load: EngineLoad, model_resident: Option<bool> },
}

/// Where instance events go (the scheduler's actor).
pub type InstanceSink = Arc<dyn Fn(InstanceEvent) + Send + Sync>;

pub struct Router {
    instances: Vec<Instance>,
    /// Probes wait on these to re-check an instance at once (after an
    /// engine request failed to connect).
    recheck: Vec<Notify>,
}

impl Router {
    /// Builds an adapter for every configured engine, in the config's
    /// order (an instance's index is its position there).
    pub fn from_config(config: &Config) -> anyhow::Result<Router> {
        let mut instances = Vec::with_capacity(config.engines.len());
        for e in config.engines.values() {
            let adapter = engine::build(e).map_err(|err| anyhow::anyhow!("engine {}: {err}", e.name))?;
            instances.push(Instance {
                name: e.name.clone(),
                engine: adapter,
                engine_model: e.model.clone(),
                max_concurrency: e.max_concurrency,
                exclusive: e.exclusive,
                health_interval: e.health_interval,
            });
        }
        Ok(Router::new(instances))
    }

    pub fn new(instances: Vec<Instance>) -> Router {
        let recheck = instances.iter().map(|_| Notify::new()).collect();
        Router { instances, recheck }
    }

    pub fn instances(&self) -> &[Instance] {
        &self.instances
    }

    pub fn instance(&self, i: usize) -> &Instance {
        &self.instances[i]
    }

    /// Asks the probe of instance `i` to check it now rather than at its
    /// next tick.
    pub fn request_recheck(&self, i: usize) {
        self.recheck[i].notify_one();
    }

    /// The generations instance `i`'s engine says it runs (for any client),
    /// where it tells.
    pub async fn busy_slots(&self, i: usize) -> Option<usize> {
        self.instances[i].engine.load().await.busy_slots
    }

    /// Starts one health probe per instance on `tracker`; each stops with
    /// `shutdown`. Changes go to `sink`.
    pub fn start_probes(
        self: &Arc<Self>,
        tracker: &TaskTracker,
        shutdown: &CancellationToken,
        metrics: Arc<Metrics>,
        sink: InstanceSink,
    ) {
        for i in 0..self.instances.len() {
            tracker.spawn(health::probe_loop(self.clone(), i, metrics.clone(), sink.clone(), shutdown.child_token()));
        }
    }
}

/// An engine that answers from a script, for the router's unit tests.
#[cfg(test)]
mod test_engine {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;

    use async_trait::async_trait;

    use crate::config::EngineKind;
    use crate::engine::{Capabilities, Engine, EngineError, EngineHealth, EngineLoad, EngineRequest, EngineStream};

    /// One scripted answer to `stream()`: refused, or these items.
    pub(crate) type Answer = Result<Vec<Result<crate::engine::EngineChunk, EngineError>>, EngineError>;

    pub(crate) struct Scripted {
        /// Health probe answers in order (then the last one repeats).
        pub ups: Vec<bool>,
        pub probes: AtomicUsize,
        /// Answers to `stream()` in order: an error, or a stream of these
        /// items.
        pub streams: Mutex<Vec<Answer>>,
        pub sent: AtomicUsize,
    }

    /// A router over one instance of `engine`, probed every
    /// `health_interval`.
    pub(crate) fn router(engine: std::sync::Arc<Scripted>, health_interval: std::time::Duration) -> super::Router {
        super::Router::new(vec![super::Instance {
            name: "scripted".into(),
            engine,
            engine_model: "m".into(),
            max_concurrency: 1,
            exclusive: true,
            health_interval,
        }])
    }

    impl Scripted {
        pub fn probes(ups: Vec<bool>) -> Scripted {
            Scripted { ups, probes: AtomicUsize::new(0), streams: Mutex::new(Vec::new()), sent: AtomicUsize::new(0) }
        }

        pub fn streams(answers: Vec<Answer>) -> Scripted {
            Scripted {
                ups: vec![true],
                probes: AtomicUsize::new(0),
                streams: Mutex::new(answers),
                sent: AtomicUsize::new(0),
            }
        }
    }

    #[async_trait]
    impl Engine for Scripted {
        fn name(&self) -> &str {
            "scripted"
        }
        fn kind(&self) -> EngineKind {
            EngineKind::OpenAi
        }
        fn capabilities(&self) -> Capabilities {
            Capabilities { streaming: true, reports_usage: true, cancel_on_disconnect: true }
        }
        async fn stream(&self, _req: &EngineRequest) -> Result<EngineStream, EngineError> {
            use futures::StreamExt;
            self.sent.fetch_add(1, Ordering::SeqCst);
            let mut answers = self.streams.lock().unwrap();
            assert!(!answers.is_empty(), "stream() called more often than scripted");
            answers.remove(0).map(|items| futures::stream::iter(items).boxed())
        }
        async fn health(&self) -> EngineHealth {
            let n = self.probes.fetch_add(1, Ordering::SeqCst);
            let up = *self.ups.get(n).or(self.ups.last()).unwrap();
            EngineHealth {
                up,
                detail: format!("probe {n}: {}", if up { "ok" } else { "refused" }),
                model_resident: None,
            }
        }
        async fn load(&self) -> EngineLoad {
            EngineLoad { busy_slots: Some(1), kv_cache_usage: None }
        }
    }
}
