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
use crate::error::ErrorCode;
use crate::error::GatewayError;
use crate::router::Router;
use crate::scheduler::{self, SchedulerHandle, TaskStream};
use crate::store::{IdempotentRecord, Store, StoredRequest};
use crate::task::{Identity, Ingress, Priority, ResultMeta, TaskEvent, TaskRequest, TaskState};
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
    /// The NATS bus connection state (`off` without `[nats]`).
    pub nats: crate::ingress::nats::NatsStatus,
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
        let refuse = |e: GatewayError| {
            self.recorder.rejected(&identity, ingress, &model, request_id.as_deref(), &e);
            self.count_rejection(ingress, &e);
            e
        };
        let req = admission::admit(&self.config, identity.clone(), body, ingress, request_id_hint).map_err(refuse)?;
        // An idempotent repeat joins the task that is already known: live
        // here, or (after a restart, or once its events are no longer
        // retained) from the store.
        if let Some(key) = &req.idempotency_key {
            let id = &req.identity;
            let reused =
                || refuse(GatewayError::invalid("this idempotency key was already used for a different request"));
            if let Some(existing) = self.scheduler.find_by_idempotency_key(&id.tenant, &id.application, key) {
                if existing.prompt_sha256 != req.prompt_sha256 {
                    return Err(reused());
                }
                if let Some(s) = self.scheduler.attach(&existing.task_id, 0) {
                    return Ok(s);
                }
            }
            if let Some(rec) = self.store.lookup_idempotency(&id.tenant, &id.application, key).await {
                if rec.state != TaskState::Rejected {
                    if rec.prompt_sha256 != req.prompt_sha256 {
                        return Err(reused());
                    }
                    if let Some(s) = self.scheduler.attach(&rec.task_id, 0) {
                        return Ok(s);
                    }
                    return Ok(self.replay_stored(rec));
                }
            }
        }
        self.recorder.received(&req);
        self.recorder.transition(&req, TaskState::Validating, "admitted", None, "gateway");
        if req.idempotency_key.is_some() {
            let ttl = self.config.scheduler.idempotency_ttl.as_millis() as i64;
            self.store.remember(stored_request(&req), ttl);
        }
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
                if let Some(key) = &meta_req.idempotency_key {
                    let id = &meta_req.identity;
                    self.store.forget_key(&id.tenant, &id.application, key, &meta_req.task_id);
                }
                self.count_rejection(ingress, &e);
                Err(e)
            }
        }
    }

    /// The outcome of a finished task as a stream: accepted, the kept
    /// answer text, then done or error.
    fn replay_stored(&self, rec: IdempotentRecord) -> TaskStream {
        let mut events = vec![TaskEvent::Accepted { task_id: rec.task_id.clone(), queue_position: 0 }];
        if let Some(t) = rec.result_text.filter(|t| !t.is_empty()) {
            events.push(TaskEvent::Delta { text: t });
        }
        let meta = rec
            .result
            .unwrap_or_else(|| ResultMeta::bare(&rec.request_id, &rec.task_id, rec.state, "", &self.config.node_id));
        let code =
            rec.error_code.as_deref().and_then(|c| serde_json::from_value(serde_json::Value::String(c.into())).ok());
        match (rec.state, code) {
            (TaskState::Succeeded, _) => events.push(TaskEvent::Done(Box::new(meta))),
            (_, code) => {
                let code = code.unwrap_or(ErrorCode::InternalError);
                let msg = format!("the original task ended {}", rec.state.as_str());
                events.push(TaskEvent::Error { error: GatewayError::new(code, msg), meta: Box::new(meta) });
            }
        }
        self.scheduler.replay(&rec.task_id, &rec.request_id, events)
    }

    /// Ends or re-queues the tasks that were not terminal when the gateway
    /// last stopped (a crash or `kill -9`): tasks that never started and
    /// carry an idempotency key are queued again; every other one ends
    /// FAILED with the reason. Runs before the listeners open.
    pub async fn recover(&self) -> (usize, usize) {
        let (mut requeued, mut failed) = (0, 0);
        for u in self.store.unfinished().await {
            // From here on, what is written for the task is checked against
            // the state machine like any transition of this run.
            self.recorder.adopt(&u.task_id, u.state);
            // Re-queued only from a state that may move to QUEUED: a task
            // that never started.
            let waiting = u.state.can_move_to(TaskState::Queued);
            let rebuilt = match (&u.request, waiting) {
                (Some(r), true) => self.rebuild(r),
                _ => None,
            };
            if let Some(req) = rebuilt {
                match self.scheduler.resubmit(req).await {
                    Ok(()) => {
                        requeued += 1;
                        continue;
                    }
                    Err(e) => tracing::warn!(task_id = %u.task_id, error = %e, "could not re-queue task"),
                }
            }
            failed += 1;
            let reason = format!("gateway restarted while the task was {}", u.state.as_str());
            let mut meta =
                ResultMeta::bare(&u.request_id, &u.task_id, TaskState::Failed, &u.logical_model, &self.config.node_id);
            meta.session_id = u.session_id.clone();
            self.recorder.end_recovered(&meta, &reason, ErrorCode::InternalError.as_str());
        }
        if requeued + failed > 0 {
            tracing::warn!(requeued, failed, "recovered tasks left unfinished by the last run");
        }
        (requeued, failed)
    }

    /// A task request again from what the store kept, if its application
    /// and model still exist.
    fn rebuild(&self, r: &StoredRequest) -> Option<TaskRequest> {
        let app = self.config.applications.get(&r.application)?;
        let model = self.config.models.get(&r.logical_model)?;
        let priority = Priority::parse(&r.priority)?;
        let ingress = match r.ingress.as_str() {
            "mqtt" => Ingress::Mqtt,
            "nats" => Ingress::Nats,
            _ => Ingress::Http,
        };
        Some(TaskRequest {
            task_id: r.task_id.clone(),
            request_id: r.request_id.clone(),
            identity: Identity {
                tenant: app.tenant.clone(),
                application: app.name.clone(),
                user_id: r.user_id.clone(),
                max_priority: app.max_priority,
                default_priority: app.default_priority,
                is_admin: app.admin,
                credential: None,
            },
            ingress,
            logical_model: model.name.clone(),
            messages: r.messages.clone(),
            params: r.params.clone(),
            priority,
            max_output_tokens: r.max_output_tokens.min(model.max_output_tokens),
            timeouts: self.config.timeouts,
            session_id: r.session_id.clone(),
            idempotency_key: r.idempotency_key.clone(),
            routing: r.routing.clone(),
            metadata: r.metadata.clone(),
            input_tokens_estimate: r.input_tokens_estimate,
            prompt_sha256: r.prompt_sha256.clone(),
            received_at: std::time::Instant::now(),
            received_wall: std::time::SystemTime::now(),
            degrade_reason: r.degrade_reason.clone(),
        })
    }

    /// Counts a call refused before it became a task.
    pub fn count_rejection(&self, ingress: Ingress, e: &GatewayError) {
        self.metrics.requests.with_label_values(&[ingress.as_str(), e.code.as_str()]).inc();
    }
}

fn stored_request(r: &TaskRequest) -> StoredRequest {
    StoredRequest {
        task_id: r.task_id.clone(),
        request_id: r.request_id.clone(),
        tenant: r.identity.tenant.clone(),
        application: r.identity.application.clone(),
        user_id: r.identity.user_id.clone(),
        ingress: r.ingress.as_str().to_string(),
        logical_model: r.logical_model.clone(),
        messages: r.messages.clone(),
        params: r.params.clone(),
        priority: r.priority.as_str().to_string(),
        max_output_tokens: r.max_output_tokens,
        session_id: r.session_id.clone(),
        idempotency_key: r.idempotency_key.clone(),
        routing: r.routing.clone(),
        metadata: r.metadata.clone(),
        prompt_sha256: r.prompt_sha256.clone(),
        input_tokens_estimate: r.input_tokens_estimate,
        degrade_reason: r.degrade_reason.clone(),
    }
}

/// A started gateway: its addresses and the handles to stop it.
pub struct RunningGateway {
    pub http_addr: SocketAddr,
    pub admin_addr: Option<SocketAddr>,
    /// The embedded MQTT broker's listeners (`None` without `[mqtt]`).
    pub mqtt: Option<crate::ingress::mqtt::MqttAddrs>,
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
    let store = Store::open(&config.store.db_path(), &config.node_id, config.store.store_prompts)?;
    metrics.export_store_errors(store.write_failures());
    let shutdown = CancellationToken::new();
    let tracker = TaskTracker::new();

    let router = Arc::new(Router::from_config(&config)?);
    let recorder = Recorder::new(store.clone(), &metrics);
    let scheduler =
        scheduler::start(config.clone(), router, recorder.clone(), metrics.clone(), tracker.clone(), shutdown.clone());

    let auth = Authenticator::new(&config);
    for hex_digest in store.revoked_keys().await {
        if let Some(d) = hex::decode(&hex_digest).ok().and_then(|b| <[u8; 32]>::try_from(b).ok()) {
            auth.revoke(d);
        }
    }
    let gateway = Arc::new(Gateway {
        auth,
        config: config.clone(),
        scheduler,
        store,
        recorder,
        metrics,
        started: Instant::now(),
        nats: crate::ingress::nats::NatsStatus::new(config.nats.is_some()),
    });
    tracker.spawn(crate::admission::gpu_watch::watch(
        config.resources.clone(),
        gateway.scheduler.clone(),
        gateway.metrics.clone(),
        shutdown.child_token(),
    ));
    gateway.recover().await;
    let (http_addr, admin_addr) = crate::ingress::http::serve(gateway.clone(), &tracker, shutdown.clone()).await?;
    let mqtt = crate::ingress::mqtt::serve(gateway.clone(), &tracker, shutdown.clone()).await?;
    tracing::info!(%http_addr, admin = ?admin_addr, node = %config.node_id, "edgeway is listening");
    // The bus connects in the background: start-up never waits for NATS.
    crate::ingress::nats::start(gateway.clone(), &tracker, shutdown.clone());
    Ok(RunningGateway { http_addr, admin_addr, mqtt, gateway, shutdown, tracker })
}
