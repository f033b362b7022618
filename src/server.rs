//! The server: builds every component from a [`Config`], wires them under
//! one cancellation tree, opens the listeners of every ingress, and shuts
//! everything down, after a drain ([`RunningGateway::drain_and_shutdown`]).
//!
//! Owns: start-up order, the drain and shutdown. Does not own: any policy (each
//! component owns its own) or what a call does (the [`Gateway`] facade).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::admission::Authenticator;
use crate::config::Config;
use crate::gateway::{Gateway, Parts};
use crate::ingress::nats::NatsStatus;
use crate::router::Router;
use crate::scheduler::{self, SchedulerHandle};
use crate::store::{Store, StoreOptions};
use crate::telemetry::lifecycle::Recorder;
use crate::telemetry::Metrics;

/// The longest a drain waits for calls that passed its check just before
/// it began to reach the queue, when the drain itself is shorter.
const ADMISSIONS_SETTLE: Duration = Duration::from_secs(2);

/// A started gateway: its addresses and the handles to stop it.
pub struct RunningGateway {
    pub http_addr: SocketAddr,
    pub admin_addr: Option<SocketAddr>,
    /// The embedded MQTT broker's listeners (`None` without `[mqtt]`).
    pub mqtt: Option<crate::ingress::mqtt::MqttAddrs>,
    pub gateway: Arc<Gateway>,
    /// The components behind the facade, for tests and benchmarks that
    /// look inside (`crate::testing::TestGateway`).
    pub internals: Internals,
    shutdown: CancellationToken,
    tracker: TaskTracker,
    /// The engine processes edgeway runs; stopped after the drain.
    processes: crate::engine::supervisor::Processes,
}

/// The components the facade is made of.
#[derive(Clone)]
pub struct Internals {
    pub scheduler: SchedulerHandle,
    pub store: Store,
    pub recorder: Recorder,
    pub metrics: Arc<Metrics>,
    /// The NATS bus connection state (`off` without `[nats]`).
    pub nats: NatsStatus,
    /// The engine processes edgeway runs (none without
    /// `[engines.NAME.process]`).
    pub processes: crate::engine::supervisor::Processes,
}

impl RunningGateway {
    /// Stops at once: [`Self::drain_and_shutdown`] with no time for running
    /// tasks (queued idempotent tasks are still kept for the next start).
    pub async fn shutdown(self, grace: Duration) {
        self.drain_and_shutdown(Duration::ZERO, grace).await;
    }

    /// The graceful stop (SIGTERM/SIGINT): a drain, then the stop.
    ///
    /// 1. New work is refused (`SHUTTING_DOWN`) and `/ready` answers 503,
    ///    at once; the listeners stay open so that running tasks reach
    ///    their callers.
    /// 2. Calls that passed the drain check before it began reach the
    ///    queue. Waiting tasks that can be queued again at the next start
    ///    (idempotent, never started) leave the queue unrecorded, as after
    ///    a crash: the next start runs them (their callers get
    ///    `SHUTTING_DOWN` and join them by repeating the key). While the
    ///    store cannot write they are cancelled instead (actor `shutdown`):
    ///    their stored request may be lost at exit.
    /// 3. Running and other queued tasks may end for up to `drain`
    ///    (`drain` plus `grace` must fit the service manager's stop
    ///    timeout: Docker waits 10 s, Kubernetes 30 s, before SIGKILL).
    /// 4. What is left is cancelled, recorded with actor `shutdown` and the
    ///    reason "gateway shutting down" (not as a client that went away).
    /// 5. Everything stops; the wait for it is bounded by `grace`.
    /// 6. Writes the store still holds in memory (the disk refused them,
    ///    its reserve spent) are waited for until `drain` plus `grace` from
    ///    the start of the stop: space freed meanwhile still saves them.
    pub async fn drain_and_shutdown(self, drain: Duration, grace: Duration) {
        let deadline = tokio::time::Instant::now() + drain + grace;
        let gw = &self.gateway;
        gw.begin_drain();
        // A call that passed the drain check just before it began is queued
        // (and parked or followed below), not left to meet a stopped
        // scheduler. Bounded: such a call waits at most for a store read.
        if tokio::time::timeout(ADMISSIONS_SETTLE.max(drain), gw.admissions_settled()).await.is_err() {
            tracing::warn!("calls admitted before the drain did not reach the queue in time");
        }
        let scheduler = &self.internals.scheduler;
        let store = &self.internals.store;
        // Parked tasks run at the next start from their stored request; with
        // a store that cannot write, that request may be one of the writes
        // the exit loses: they are cancelled now instead (actor `shutdown`),
        // so that their callers are not promised a run that never comes.
        let parked = if store.is_degraded() {
            let cancelled = scheduler.cancel_parkable("gateway shutting down; the task store cannot write").await;
            tracing::warn!(cancelled, "store degraded: queued idempotent tasks cancelled, not kept for the next start");
            0
        } else {
            scheduler.park_waiting().await
        };
        let first = scheduler.follow_live();
        tracing::info!(parked, live = first.len(), drain_s = drain.as_secs_f64(), "draining");
        let ended = async move {
            let mut live = first;
            while !live.is_empty() {
                futures::future::join_all(
                    live.into_iter().map(|mut s| async move { while s.recv().await.is_some() {} }),
                )
                .await;
                live = scheduler.follow_live();
            }
        };
        if tokio::time::timeout(drain, ended).await.is_err() {
            let cancelled = scheduler.cancel_all("gateway shutting down", "shutdown");
            tracing::warn!(cancelled, "drain time over; cancelling what is left");
        }
        self.shutdown.cancel();
        // The engines stop after the drain (running tasks needed them) and
        // before edgeway exits: SIGTERM to each group, SIGKILL after its
        // stop_grace, waited for, so none is left behind.
        self.processes.stop().await;
        self.tracker.close();
        if tokio::time::timeout(grace, self.tracker.wait()).await.is_err() {
            tracing::warn!("shutdown grace period over; some tasks did not drain");
        }
        if tokio::time::timeout_at(deadline, store.settled()).await.is_err() {
            tracing::warn!("stop time over with task store writes still refused by the disk");
        }
        store.flush().await;
        let lost = store.health().buffered_writes();
        if lost > 0 {
            // Nowhere else to keep them: say what the exit loses.
            let why = store.health().degraded().unwrap_or_default();
            tracing::error!(lost, error = %why, "stopping with task store writes the disk refused; they are lost");
        }
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
    let opts = StoreOptions {
        max_buffered_writes: config.store.max_buffered_writes,
        retention_tasks: config.store.retention_tasks,
        retention_rejected: config.store.retention_rejected,
        retention_audit: config.store.retention_audit,
        reserve_bytes: config.store.reserve_bytes,
        classes: Some(config.store.retention_classes),
        ..StoreOptions::default()
    };
    let store = Store::open_with(&config.store.db_path(), &config.node_id, config.store.store_prompts, opts)?;
    metrics.export_store_errors(store.write_failures());
    metrics.export_store_health(store.health());
    metrics.set_queue_capacities(&config);
    metrics.set_key_expiries(&config, crate::task::now_ms());
    store.budgets().configure(&config);
    if let Some(endpoint) = &config.log.otlp_endpoint {
        metrics.start_otlp(endpoint, &config.node_id);
    }
    let shutdown = CancellationToken::new();
    let tracker = TaskTracker::new();
    // Host CPU, memory, the store's disk and network, on a timer.
    let host = crate::telemetry::host::HostSampler::register(&metrics.registry, &config.store.data_dir);
    tracker.spawn(host.run(shutdown.child_token()));

    // The engine instances, the scheduler over them and, started by it, the
    // router's health probes.
    // Engines edgeway runs itself: what an earlier edgeway left is killed
    // first; each instance is down for routing until its process is ready.
    let processes = crate::engine::supervisor::Processes::start(&config, &metrics).await?;
    let router = match Router::from_config_with(&config, &processes) {
        Ok(r) => Arc::new(r),
        Err(e) => {
            // The engines were started: a failed start must not leave them.
            processes.stop().await;
            return Err(e);
        }
    };
    let residency = router.residency().clone();
    let recorder = Recorder::new(store.clone(), &metrics);
    let scheduler =
        scheduler::start(config.clone(), router, recorder.clone(), metrics.clone(), tracker.clone(), shutdown.clone());

    let auth = Authenticator::new(&config);
    for hex_digest in store.revoked_keys().await {
        if let Some(d) = hex::decode(&hex_digest).ok().and_then(|b| <[u8; 32]>::try_from(b).ok()) {
            auth.revoke(d);
        }
    }
    let nats = NatsStatus::new(config.nats.is_some());
    let internals = Internals {
        scheduler: scheduler.clone(),
        store: store.clone(),
        recorder: recorder.clone(),
        metrics: metrics.clone(),
        nats: nats.clone(),
        processes: processes.clone(),
    };
    let gateway = Arc::new(Gateway::new(Parts {
        config: config.clone(),
        auth,
        scheduler: scheduler.clone(),
        store,
        recorder,
        metrics: metrics.clone(),
        bus: Arc::new(nats.clone()),
        processes: processes.clone(),
        residency,
    }));
    tracker.spawn(crate::admission::gpu_watch::watch(
        config.resources.clone(),
        scheduler,
        metrics,
        shutdown.child_token(),
    ));
    gateway.recover().await;
    let listeners = async {
        let (http, admin) = crate::ingress::http::serve(gateway.clone(), &tracker, shutdown.clone()).await?;
        let mqtt = crate::ingress::mqtt::serve(gateway.clone(), &tracker, shutdown.clone()).await?;
        anyhow::Ok((http, admin, mqtt))
    };
    let (http_addr, admin_addr, mqtt) = match listeners.await {
        Ok(l) => l,
        Err(e) => {
            // Engines started for an edgeway that does not run are stopped.
            shutdown.cancel();
            processes.stop().await;
            return Err(e);
        }
    };
    tracing::info!(%http_addr, admin = ?admin_addr, node = %config.node_id, "edgeway is listening");
    // The bus connects in the background: start-up never waits for NATS.
    crate::ingress::nats::start(gateway.clone(), nats, http_addr, &tracker, shutdown.clone());
    Ok(RunningGateway { http_addr, admin_addr, mqtt, gateway, internals, shutdown, tracker, processes })
}
