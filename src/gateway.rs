//! The pipeline wiring: builds every component from a [`Config`], starts
//! them under one cancellation tree, and offers the one entry point that all
//! ingresses share ([`Gateway::submit`]).
//!
//! Owns: start-up order and shutdown. Does not own: any policy (each
//! component owns its own).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::admission::{self, Authenticator, ChatRequestBody};
use crate::config::Config;
use crate::engine;
use crate::error::GatewayError;
use crate::scheduler::{self, Instance, SchedulerHandle, TaskStream};
use crate::store::Store;
use crate::task::{Identity, Ingress, TaskState};
use crate::telemetry::lifecycle::Recorder;
use crate::telemetry::Metrics;

/// Everything an ingress needs. Shared behind an `Arc`.
pub struct Gateway {
    pub config: Arc<Config>,
    pub auth: Authenticator,
    pub scheduler: SchedulerHandle,
    pub store: Store,
    pub recorder: Recorder,
    pub metrics: Arc<Metrics>,
    pub started: Instant,
}

impl Gateway {
    /// Admits a parsed request and queues it: the same path for every
    /// ingress. Records the task (or its rejection) in the store.
    pub async fn submit(
        &self,
        identity: Identity,
        body: ChatRequestBody,
        ingress: Ingress,
        request_id_hint: Option<String>,
    ) -> Result<TaskStream, GatewayError> {
        let model = body.model.clone();
        let request_id = body.request_id.clone().or(request_id_hint.clone());
        let req = match admission::admit(&self.config, identity.clone(), body, ingress, request_id_hint) {
            Ok(r) => r,
            Err(e) => {
                self.recorder.rejected(&identity, ingress, &model, request_id.as_deref(), &e);
                self.count_rejection(ingress, &e);
                return Err(e);
            }
        };
        // An idempotent repeat joins the task that is already known.
        if let Some(key) = &req.idempotency_key {
            let id = &req.identity;
            if let Some(existing) = self.scheduler.find_by_idempotency_key(&id.tenant, &id.application, key) {
                if existing.prompt_sha256 != req.prompt_sha256 {
                    let e = GatewayError::invalid("this idempotency key was already used for a different request");
                    self.recorder.rejected(&identity, ingress, &model, request_id.as_deref(), &e);
                    self.count_rejection(ingress, &e);
                    return Err(e);
                }
                if let Some(s) = self.scheduler.attach(&existing.task_id, 0) {
                    return Ok(s);
                }
            }
        }
        self.recorder.received(&req);
        self.recorder.transition(&req, TaskState::Validating, "admitted", None, "gateway");
        let meta_req = req.clone();
        match self.scheduler.submit(req).await {
            Ok(s) if s.joined => {
                // Lost a race with an identical retry: this call is that task.
                let why = format!("idempotent repeat of task {}", s.task_id);
                self.recorder.transition(&meta_req, TaskState::Rejected, &why, None, "gateway");
                Ok(s)
            }
            Ok(s) => Ok(s),
            Err(e) => {
                self.recorder.transition(&meta_req, TaskState::Rejected, e.code.as_str(), None, "scheduler");
                self.count_rejection(ingress, &e);
                Err(e)
            }
        }
    }

    /// Counts a call refused before it became a task.
    pub fn count_rejection(&self, ingress: Ingress, e: &GatewayError) {
        self.metrics.requests.with_label_values(&[ingress.as_str(), e.code.as_str()]).inc();
    }
}

/// A started gateway: its addresses and the handles to stop it.
pub struct RunningGateway {
    pub http_addr: SocketAddr,
    pub admin_addr: Option<SocketAddr>,
    pub gateway: Arc<Gateway>,
    shutdown: CancellationToken,
    tracker: TaskTracker,
}

impl RunningGateway {
    /// Stops accepting, cancels every task (their engines stop), and waits
    /// up to `grace` for everything to drain.
    pub async fn shutdown(self, grace: Duration) {
        self.shutdown.cancel();
        self.tracker.close();
        if tokio::time::timeout(grace, self.tracker.wait()).await.is_err() {
            tracing::warn!("shutdown grace period over; some tasks did not drain");
        }
        self.gateway.store.flush().await;
    }

    pub fn shutdown_token(&self) -> CancellationToken {
        self.shutdown.clone()
    }
}

/// Builds and starts every component. Listeners are bound before this
/// returns, so the addresses are ready for clients.
pub async fn start(config: Config) -> anyhow::Result<RunningGateway> {
    crate::tls::install_default_provider();
    let config = Arc::new(config);
    let metrics = Arc::new(Metrics::new());
    let store = Store::open(&config.store.db_path(), &config.node_id, config.store.store_prompts, metrics.clone())?;
    let shutdown = CancellationToken::new();
    let tracker = TaskTracker::new();

    let mut instances = Vec::new();
    for e in config.engines.values() {
        let adapter = engine::build(e).map_err(|err| anyhow::anyhow!("engine {}: {err}", e.name))?;
        metrics.running.with_label_values(&[&e.name]).set(0);
        instances.push(Instance {
            name: e.name.clone(),
            engine: adapter,
            engine_model: e.model.clone(),
            max_concurrency: e.max_concurrency,
        });
    }
    let probes: Vec<_> = instances
        .iter()
        .enumerate()
        .map(|(i, inst)| (i, inst.engine.clone(), config.engines[&inst.name].health_interval))
        .collect();
    let recorder = Recorder::new(store.clone());
    let scheduler = scheduler::start(
        config.clone(),
        instances,
        recorder.clone(),
        metrics.clone(),
        tracker.clone(),
        shutdown.clone(),
    );
    for (i, engine, interval) in probes {
        tracker.spawn(engine::health::probe_loop(
            i,
            engine,
            interval,
            scheduler.clone(),
            metrics.clone(),
            shutdown.child_token(),
        ));
    }

    let gateway = Arc::new(Gateway {
        auth: Authenticator::new(&config),
        config: config.clone(),
        scheduler,
        store,
        recorder,
        metrics,
        started: Instant::now(),
    });
    let (http_addr, admin_addr) = crate::ingress::http::serve(gateway.clone(), &tracker, shutdown.clone()).await?;
    tracing::info!(%http_addr, admin = ?admin_addr, node = %config.node_id, "edgeway is listening");
    Ok(RunningGateway { http_addr, admin_addr, gateway, shutdown, tracker })
}
