//! The NATS ingress and lifecycle sink: how internal services on the
//! machine's bus use edgeway like any other NATS service.
//!
//! - [`service`]: a NATS micro service (`$SRV.PING/INFO/STATS` discovery)
//!   with the endpoints `{prefix}.chat` (the shared request JSON in, the
//!   shared event stream out on the reply subject) and `{prefix}.cancel`.
//!   Identity comes from the message headers (API key or JWT), so the same
//!   application rights apply as over HTTP. A caller that stops listening is
//!   noticed through NATS "no responders" answers and its task cancelled.
//! - [`registry`]: this node's record in the node registry (a JetStream
//!   key-value bucket, `[cluster]`) and the watch that keeps the pool of
//!   other nodes current.
//! - [`forward`]: tasks forwarded to other nodes of the pool (`type =
//!   "pool"` instances) and taken from them (`{prefix}.node.{id}.chat`).
//! - [`lifecycle`]: every state change of every task, whatever its ingress,
//!   published on `{prefix}.events.{tenant}.{state}` (and optionally kept in
//!   a JetStream stream), from a bounded queue that never slows a request.
//!
//! Owns: the bus connection (credentials, reconnect backoff, its state for
//! `/ready` and metrics), subjects, headers and the reply streams. Does not
//! own: validation, queueing or the event JSON (shared with MQTT, see
//! [`crate::ingress::render`]). The subjects and messages are documented in
//! `topics/nats.md`.
//!
//! The bus is optional: when NATS is down at start or drops later, edgeway
//! keeps serving HTTP and MQTT, reconnects with backoff in the background
//! and reports `nats: disconnected` in `/ready` (without becoming unready).

mod audit;
pub mod forward;
pub mod lifecycle;
pub mod registry;
pub mod service;
pub mod work;

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::{json, Value};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::{NatsAuth, NatsConfig};
use crate::gateway::{BusStatus, Gateway};
use crate::telemetry::Metrics;

/// The bus connection as `/ready` reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BusState {
    /// No `[nats]` in the config.
    Off,
    /// Configured; the first connection is not made yet.
    Connecting,
    Connected,
    /// Was connected; reconnecting with backoff.
    Disconnected,
    /// Cannot connect at all (e.g. the creds file cannot be read).
    Failed,
}

impl BusState {
    pub fn as_str(self) -> &'static str {
        match self {
            BusState::Off => "off",
            BusState::Connecting => "connecting",
            BusState::Connected => "connected",
            BusState::Disconnected => "disconnected",
            BusState::Failed => "failed",
        }
    }
}

#[derive(Debug, Clone)]
struct StatusInner {
    state: BusState,
    /// When `state` last changed.
    since: Instant,
    /// Whether the JetStream event stream exists (`None`: not configured or
    /// not checked yet).
    stream_ready: Option<bool>,
    /// Connections made so far (the first and every reconnect).
    connects: u64,
}

/// Shared view of the bus state. Cheap to clone; readers never block the
/// connection.
#[derive(Clone)]
pub struct NatsStatus {
    tx: Arc<watch::Sender<StatusInner>>,
}

impl NatsStatus {
    pub fn new(enabled: bool) -> NatsStatus {
        let state = if enabled { BusState::Connecting } else { BusState::Off };
        let (tx, _) = watch::channel(StatusInner { state, since: Instant::now(), stream_ready: None, connects: 0 });
        NatsStatus { tx: Arc::new(tx) }
    }

    pub fn state(&self) -> BusState {
        self.tx.borrow().state
    }

    /// How long the bus has been unusable, if it is.
    pub fn unavailable_for(&self) -> Option<Duration> {
        let s = self.tx.borrow();
        match s.state {
            BusState::Connected | BusState::Off => None,
            _ => Some(s.since.elapsed()),
        }
    }

    /// Waits until the bus is in `state`.
    pub async fn wait_for(&self, state: BusState) {
        let mut rx = self.tx.subscribe();
        let _ = rx.wait_for(|s| s.state == state).await;
    }

    /// Waits until the JetStream event stream has been created or updated.
    pub async fn wait_stream_ready(&self) {
        let mut rx = self.tx.subscribe();
        let _ = rx.wait_for(|s| s.stream_ready == Some(true)).await;
    }

    /// The `nats` object of `/ready`.
    pub fn to_json(&self) -> Value {
        let s = self.tx.borrow().clone();
        let mut v = json!({ "state": s.state.as_str(), "since_s": s.since.elapsed().as_secs() });
        if let Some(ok) = s.stream_ready {
            v["jetstream"] = json!(if ok { "ok" } else { "unavailable" });
        }
        v
    }

    /// Waits for a connection made after the `seen`-th one; returns its
    /// number.
    pub async fn wait_connect_after(&self, seen: u64) -> u64 {
        let mut rx = self.tx.subscribe();
        let r = rx.wait_for(|s| s.connects > seen).await.map(|s| s.connects);
        r.unwrap_or(seen)
    }

    fn set(&self, state: BusState) {
        self.tx.send_if_modified(|s| {
            let connected = state == BusState::Connected;
            s.connects += u64::from(connected);
            if s.state == state {
                return connected;
            }
            s.state = state;
            s.since = Instant::now();
            true
        });
    }

    fn set_stream_ready(&self, ok: bool) {
        self.tx.send_modify(|s| s.stream_ready = Some(ok));
    }
}

impl BusStatus for NatsStatus {
    fn report(&self) -> Value {
        self.to_json()
    }
}

/// Starts the bus ingress and the lifecycle publisher if `[nats]` is
/// configured. Never waits for the bus: connecting, service registration and
/// reconnects happen in tasks on `tracker`, which end on `shutdown`.
/// `status` is the state the facade reports in `/ready`; this module keeps
/// it current.
/// `http_addr` is the business listener's address, which the node
/// registry (`[cluster]`) publishes.
pub fn start(
    gw: Arc<Gateway>,
    status: NatsStatus,
    http_addr: std::net::SocketAddr,
    tracker: &TaskTracker,
    shutdown: CancellationToken,
) {
    let Some(cfg) = gw.config().nats.clone() else { return };
    // Subscribe now, so no transition between start-up and the first
    // connection is missed (the bounded queue keeps them until then).
    let events = cfg.events.then(|| gw.subscribe_lifecycle());
    let audit = gw.audit_feed();
    let t = tracker.clone();
    tracker.spawn(async move {
        let client = match connect(&cfg, &status, gw.metrics()).await {
            Ok(c) => c,
            Err(e) => {
                tracing::error!(url = %cfg.redacted_url(), error = %e, "NATS bus disabled: cannot connect");
                status.set(BusState::Failed);
                return;
            }
        };
        if let Some(rx) = events {
            let metrics = gw.metrics().clone();
            lifecycle::spawn_publisher(client.clone(), cfg.clone(), metrics, status.clone(), rx, &t, shutdown.clone());
        }
        audit::spawn_publisher(client.clone(), cfg.clone(), status.clone(), audit, &t, shutdown.clone());
        registry::spawn(client.clone(), &cfg, gw.clone(), http_addr.to_string(), &t, shutdown.clone());
        // With the pool's key, pool instances forward over this bus.
        let key = gw.config().cluster.as_ref().and_then(|c| c.key.clone());
        if let (Some(pool), Some(key)) = (gw.pool().cloned(), key) {
            let queue = gw.config().cluster.as_ref().map(|c| forward::WorkQueue {
                js: async_nats::jetstream::new(client.clone()),
                from: c.queue_from,
                metrics: gw.metrics().clone(),
            });
            let peers = forward::NodePeers { client: client.clone(), cfg: cfg.clone(), pool, key, queue };
            gw.peers().set(Arc::new(peers));
        }
        service::run(client, cfg, gw, status, t, shutdown).await;
    });
}

/// Reconnect delay before try `attempts` (the client counts the first try
/// too): at once, then [`super::reconnect_backoff`] of the failures so far.
fn backoff(attempts: usize, max: Duration) -> Duration {
    match attempts {
        0 | 1 => Duration::ZERO,
        n => super::reconnect_backoff(u32::try_from(n - 1).unwrap_or(u32::MAX), max),
    }
}

/// Opens the client connection in the background: returns at once, even
/// when the server is down (the client keeps retrying with backoff).
async fn connect(cfg: &NatsConfig, status: &NatsStatus, metrics: &Arc<Metrics>) -> anyhow::Result<async_nats::Client> {
    let max = cfg.reconnect_max_delay;
    let (st, m, url) = (status.clone(), metrics.clone(), cfg.redacted_url());
    let mut opts = async_nats::ConnectOptions::new()
        .name(&cfg.name)
        .retry_on_initial_connect()
        .max_reconnects(None)
        .connection_timeout(cfg.connect_timeout)
        .reconnect_delay_callback(move |attempts| backoff(attempts, max))
        .event_callback(move |event| {
            use async_nats::Event;
            let label = match &event {
                Event::Connected => {
                    st.set(BusState::Connected);
                    m.nats_connected.set(1);
                    tracing::info!(url = %url, "NATS connected");
                    "connected"
                }
                Event::Disconnected => {
                    st.set(BusState::Disconnected);
                    m.nats_connected.set(0);
                    tracing::warn!(url = %url, "NATS disconnected; reconnecting");
                    "disconnected"
                }
                Event::Closed => {
                    st.set(BusState::Disconnected);
                    m.nats_connected.set(0);
                    "closed"
                }
                Event::LameDuckMode => "lame_duck",
                Event::SlowConsumer(_) => "slow_consumer",
                Event::ServerError(e) => {
                    tracing::warn!(error = %e, "NATS server error");
                    "server_error"
                }
                Event::ClientError(_) => "client_error",
                Event::Draining => "draining",
            };
            m.nats_connection_events.with_label_values(&[label]).inc();
            async {}
        });
    opts = match &cfg.auth {
        NatsAuth::None => opts,
        NatsAuth::Token(t) => opts.token(t.expose().to_string()),
        NatsAuth::UserPassword { user, password } => opts.user_and_password(user.clone(), password.expose().into()),
        NatsAuth::CredsFile(p) => {
            opts.credentials_file(p).await.map_err(|e| anyhow::anyhow!("nats.creds_file {}: {e}", p.display()))?
        }
    };
    tracing::info!(url = %cfg.redacted_url(), name = %cfg.name, "connecting to the NATS bus");
    let servers = cfg
        .url
        .split(',')
        .filter(|u| !u.trim().is_empty())
        .map(|u| u.trim().parse::<async_nats::ServerAddr>())
        .collect::<Result<Vec<_>, _>>()?;
    Ok(opts.connect(servers).await?)
}

/// A subject token made from a tenant name: characters NATS gives meaning
/// to (`.`, `*`, `>`, whitespace) and anything outside `[A-Za-z0-9_-]`
/// become `_`.
pub fn subject_token(s: &str) -> String {
    let t: String =
        s.chars().map(|c| if c.is_ascii_alphanumeric() || c == '_' || c == '-' { c } else { '_' }).collect();
    if t.is_empty() {
        "_".into()
    } else {
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenant_names_become_single_subject_tokens() {
        assert_eq!(subject_token("demo"), "demo");
        assert_eq!(subject_token("acme.eu *>x"), "acme_eu___x");
        assert_eq!(subject_token(""), "_");
    }

    #[test]
    fn backoff_grows_to_the_maximum() {
        let max = Duration::from_secs(5);
        assert_eq!(backoff(1, max), Duration::ZERO);
        assert!(backoff(2, max) >= Duration::from_millis(100) && backoff(2, max) <= Duration::from_millis(125));
        assert!(backoff(60, max) >= max && backoff(60, max) <= max + max / 4);
    }

    #[tokio::test]
    async fn status_reports_how_long_the_bus_has_been_away() {
        let s = NatsStatus::new(true);
        assert_eq!(s.state(), BusState::Connecting);
        assert!(s.unavailable_for().is_some());
        s.set(BusState::Connected);
        s.wait_for(BusState::Connected).await;
        assert_eq!(s.unavailable_for(), None);
        assert_eq!(s.to_json()["state"], "connected");
        assert_eq!(NatsStatus::new(false).to_json()["state"], "off");
    }
}
