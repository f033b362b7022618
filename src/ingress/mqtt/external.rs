//! edgeway on an existing MQTT broker (`[mqtt] mode = "external"`):
//! instead of the embedded broker, an MQTT 5 client (rumqttc) connects to
//! the configured broker, subscribes to the device requests with a shared
//! subscription (`$share/{group}/{prefix}/+/req`, so the nodes of one group
//! split them) and to every cancel and resume (only the node that runs a
//! request knows it; the others ignore them), and publishes the answers on
//! the device-view topics devices already use.
//!
//! ```text
//! device ─▶ broker (ACLs) ─▶ client_loop ─▶ DeviceIngress::dispatch_to ─▶ Gateway::submit
//!                ▲                                     │
//!                └──── Publisher::client ◀── senders ◀─┘
//! ```
//!
//! The device is the one its topic names (`{prefix}/{device}/…`): the
//! broker's ACLs (`edgeway mqtt-acl`) let a device publish only under its
//! own id. Its tenant and rights come from the device registry
//! (`[devices.ID]`); a device id it does not list is refused (counted in
//! `mqtt_rejected_total{code="AUTH_FAILED"}`, not answered).
//!
//! What the embedded broker gives and this mode does not: edgeway sees no
//! device connections, so there is no presence (devices count as always
//! connected; `on_disconnect` never applies: a task runs to its end or its
//! timeouts, and the device resumes what it missed), no wills and no
//! per-connection limits (the broker's own settings apply).
//!
//! Owns: the client connection, its reconnects and its state (`/ready`'s
//! `mqtt_broker`, the `mqtt_broker_connected` metric). Does not own: what
//! a message means ([`super::requests`]), the ACLs (the broker's).

use std::sync::{Arc, Mutex};
use std::time::Instant;

use bytes::Bytes;
use prometheus::{IntCounter, IntGauge};
use rumqttc::v5::mqttbytes::v5::{Packet, SubscribeReasonCode};
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::{AsyncClient, Event, EventLoop, MqttOptions};
use rumqttc::{TlsConfiguration, Transport};
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::requests::{DeviceIngress, Sessions};
use super::streams::Streams;
use super::topics::{mount_name, Inbound, Topics};
use super::{catalogue, MqttMetrics, Publisher};
use crate::config::{ExternalBrokerConfig, MqttConfig};
use crate::error::{ErrorCode, GatewayError};
use crate::gateway::{BusStatus, Gateway};

/// The filters edgeway subscribes to ([`Topics::external_filters`]).
const FILTERS: usize = 3;

/// Requests edgeway's client may have queued for its event loop.
const CLIENT_CHANNEL: usize = 1024;

/// The connection to the broker as `/ready` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BrokerState {
    Connecting,
    Connected,
    Disconnected,
}

impl BrokerState {
    pub fn as_str(self) -> &'static str {
        match self {
            BrokerState::Connecting => "connecting",
            BrokerState::Connected => "connected",
            BrokerState::Disconnected => "disconnected",
        }
    }
}

struct StatusInner {
    state: BrokerState,
    since: Instant,
    /// The last connection or subscription error, for the operator.
    last_error: Option<String>,
    /// Filters the broker has granted since the last connect: devices
    /// are heard once all of them are.
    granted: usize,
}

/// The broker connection's state, shared by the client loop (writes) and
/// `/ready` (reads), with its metrics.
pub struct BrokerStatus {
    inner: Mutex<StatusInner>,
    broker: String,
    tls: bool,
    connected: IntGauge,
    connects: IntCounter,
}

impl BrokerStatus {
    fn new(ext: &ExternalBrokerConfig, registry: &prometheus::Registry) -> BrokerStatus {
        let connected =
            IntGauge::new("mqtt_broker_connected", "1 while edgeway is connected to the external MQTT broker")
                .expect("valid metric");
        let connects = IntCounter::new(
            "mqtt_broker_connects_total",
            "Connections edgeway made to the external MQTT broker (the first and every reconnect)",
        )
        .expect("valid metric");
        // A second gateway in one process (tests) has its own registry.
        let _ = registry.register(Box::new(connected.clone()));
        let _ = registry.register(Box::new(connects.clone()));
        BrokerStatus {
            inner: Mutex::new(StatusInner {
                state: BrokerState::Connecting,
                since: Instant::now(),
                last_error: None,
                granted: 0,
            }),
            broker: format!("{}:{}", ext.host, ext.port),
            tls: ext.tls.is_some(),
            connected,
            connects,
        }
    }

    fn set(&self, state: BrokerState, error: Option<String>) {
        let mut g = self.inner.lock().expect("broker status");
        if g.state != state {
            g.state = state;
            g.since = Instant::now();
            if state == BrokerState::Connected {
                self.connects.inc();
            }
        }
        if error.is_some() {
            g.last_error = error;
        }
        if state != BrokerState::Connected {
            g.granted = 0;
        }
        self.connected.set(i64::from(state == BrokerState::Connected));
    }

    /// Something went wrong that did not end the connection (a refused
    /// subscription).
    fn note(&self, error: String) {
        self.inner.lock().expect("broker status").last_error = Some(error);
    }

    /// A connect: no filter granted yet.
    fn connected(&self) {
        self.set(BrokerState::Connected, None);
        self.inner.lock().expect("broker status").granted = 0;
    }

    /// The broker granted `n` more filters.
    fn granted(&self, n: usize) {
        self.inner.lock().expect("broker status").granted += n;
    }

    pub fn state(&self) -> BrokerState {
        self.inner.lock().expect("broker status").state
    }
}

impl BusStatus for BrokerStatus {
    fn report(&self) -> Value {
        let g = self.inner.lock().expect("broker status");
        json!({
            "mode": "external",
            "broker": self.broker,
            "tls": self.tls,
            "state": g.state.as_str(),
            "since_s": g.since.elapsed().as_secs(),
            // Requests, cancels and resumes are all subscribed.
            "subscribed": g.state == BrokerState::Connected && g.granted >= FILTERS,
            "last_error": g.last_error,
        })
    }
}

/// Starts the device ingress on the external broker of `cfg`. Never waits
/// for the broker: connecting and reconnecting happen in a task on
/// `tracker`, which ends on `shutdown`.
pub fn serve(
    gw: Arc<Gateway>,
    cfg: MqttConfig,
    ext: ExternalBrokerConfig,
    tracker: &TaskTracker,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let topics = Topics::unmounted(&cfg.topic_prefix);
    let registry = &gw.metrics().registry;
    let metrics = MqttMetrics::new(registry);
    let status = Arc::new(BrokerStatus::new(&ext, registry));
    gw.set_mqtt_bus(status.clone());

    let mut opts = MqttOptions::new(&ext.client_id, &ext.host, ext.port);
    opts.set_keep_alive(ext.keep_alive);
    // Subscriptions are made again after each connect.
    opts.set_clean_start(true);
    opts.set_max_packet_size(Some(cfg.max_packet_bytes as u32));
    opts.set_outgoing_inflight_upper_limit(cfg.max_inflight.min(u16::MAX as usize) as u16);
    // Small packets (a request's PUBACK, a delta) leave at once: with
    // Nagle's algorithm each waited for the broker's delayed ACK, about
    // 40 ms per hop (bench/mqtt.rs: 75 ms to the first delta without).
    let mut net = rumqttc::NetworkOptions::new();
    net.set_tcp_nodelay(true);
    opts.set_network_options(net);
    if let Some(tls) = &ext.tls {
        let read = |f: &std::path::Path| {
            std::fs::read(f).map_err(|e| anyhow::anyhow!("mqtt.external: cannot read {}: {e}", f.display()))
        };
        let client_auth = match &tls.client_cert {
            Some((cert, key)) => Some((read(cert)?, read(key)?)),
            None => None,
        };
        let ca = read(&tls.ca_file)?;
        // rustls with the process's provider (installed at start).
        crate::tls::install_default_provider();
        opts.set_transport(Transport::tls_with_config(TlsConfiguration::Simple { ca, alpn: None, client_auth }));
    }
    if let Some(user) = &ext.username {
        opts.set_credentials(user, ext.password.as_ref().map_or("", |p| p.expose()));
    }
    let (client, eventloop) = AsyncClient::new(opts, CLIENT_CHANNEL);
    let out = Arc::new(Publisher::client(client.clone(), metrics.clone()));
    // Queued until the first connection.
    out.publish(&topics.catalogue(), catalogue(&gw.config()), None, true)
        .map_err(|e| anyhow::anyhow!("mqtt: model catalogue: {e}"))?;
    let sessions = Arc::new(Sessions::new(cfg.stream_replay_max_bytes, cfg.resume_replay_bytes_per_s));
    let streams = Arc::new(Streams::new(cfg.replay_retention, cfg.replay_max_bytes, cfg.stream_replay_max_bytes));
    let ingress = Arc::new(DeviceIngress::new(
        gw,
        cfg,
        topics,
        out,
        streams,
        sessions,
        metrics,
        tracker.clone(),
        shutdown.clone(),
    ));
    // No presence on an external broker: the loop only sweeps old streams;
    // the client loop holds the sender.
    let (presence_tx, presence_rx) = mpsc::unbounded_channel();
    tracker.spawn(super::presence_loop(ingress.clone(), presence_rx, shutdown.clone()));
    tracing::info!(broker = %status.broker, client_id = %ext.client_id, "MQTT: connecting to the external broker");
    tracker.spawn(async move {
        let _presence = presence_tx;
        client_loop(ingress, client, eventloop, ext, status, shutdown).await;
    });
    Ok(())
}

/// Polls the client's event loop: sorts device messages into the ingress,
/// subscribes after every connect, and reconnects with backoff.
///
/// # Cancel safety
/// `EventLoop::poll` may be dropped at the shutdown arm: rumqttc keeps its
/// state in the event loop, and edgeway stops with it.
async fn client_loop(
    ingress: Arc<DeviceIngress>,
    client: AsyncClient,
    mut eventloop: EventLoop,
    ext: ExternalBrokerConfig,
    status: Arc<BrokerStatus>,
    shutdown: CancellationToken,
) {
    let filters = ingress.topics.external_filters(&ext.shared_group);
    let mut failures = 0u32;
    loop {
        let event = tokio::select! {
            _ = shutdown.cancelled() => {
                let _ = client.try_disconnect();
                return;
            }
            e = eventloop.poll() => e,
        };
        match event {
            Ok(Event::Incoming(Packet::ConnAck(_))) => {
                failures = 0;
                status.connected();
                tracing::info!(broker = %status.broker, "MQTT: connected to the external broker");
                // From a task of its own: the client's channel may be full
                // of answers, which only this loop drains.
                let (c, filters) = (client.clone(), filters.clone());
                ingress.tracker.spawn(async move {
                    for f in filters {
                        let _ = c.subscribe(f, QoS::AtLeastOnce).await;
                    }
                });
            }
            Ok(Event::Incoming(Packet::Publish(p))) => {
                let topic = String::from_utf8_lossy(&p.topic);
                dispatch(&ingress, &topic, p.payload, p.properties);
            }
            Ok(Event::Incoming(Packet::SubAck(ack))) => {
                status
                    .granted(ack.return_codes.iter().filter(|c| matches!(c, SubscribeReasonCode::Success(_))).count());
                if ack.return_codes.iter().any(|c| !matches!(c, SubscribeReasonCode::Success(_))) {
                    let why = format!("the broker refused a subscription: {:?}", ack.return_codes);
                    tracing::error!(broker = %status.broker, "MQTT: {why}; check the broker's ACL for edgeway's user");
                    status.note(why);
                }
            }
            Ok(_) => {}
            Err(e) => {
                failures += 1;
                let why = e.to_string();
                if failures == 1 || failures.is_power_of_two() {
                    tracing::warn!(broker = %status.broker, error = %why, failures, "MQTT: no connection to the external broker");
                }
                status.set(BrokerState::Disconnected, Some(why));
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(crate::ingress::reconnect_backoff(failures, ext.reconnect_max)) => {}
                }
            }
        }
    }
}

/// One message from the broker, to the inbox of the device its topic
/// names, if the registry knows it.
fn dispatch(
    ingress: &Arc<DeviceIngress>,
    topic: &str,
    payload: Bytes,
    props: Option<rumqttc::v5::mqttbytes::v5::PublishProperties>,
) {
    let Some((id, kind)) = ingress.topics.parse_device_view(topic) else { return };
    let config = ingress.gw.config();
    let Some(device) = config.devices.get(id) else {
        // Refused as at an embedded CONNECT: the device gets nothing.
        let e = GatewayError::new(ErrorCode::AuthFailed, "unknown device");
        let e = ingress.gw.refused(crate::task::Ingress::Mqtt, e);
        ingress.metrics.rejected.with_label_values(&[e.code.as_str()]).inc();
        tracing::info!(device = id, "MQTT: a message from a device the registry does not list was refused");
        return;
    };
    let mount = mount_name(&device.tenant, id);
    ingress.sessions.attach_external(&mount, super::auth::registered_identity(device));
    let mut props = props.map(|p| rumqttd::protocol::PublishProperties {
        payload_format_indicator: p.payload_format_indicator,
        message_expiry_interval: p.message_expiry_interval,
        topic_alias: None,
        response_topic: p.response_topic,
        correlation_data: p.correlation_data,
        user_properties: p.user_properties,
        subscription_identifiers: Vec::new(),
        content_type: p.content_type,
    });
    if kind == Inbound::Request {
        // As the embedded codec does: what is left of the message expiry
        // becomes an absolute time the ingress checks.
        if let Some(p) = props.as_mut() {
            super::codec::expiry_to_property(p, crate::task::now_ms());
        }
    }
    ingress.dispatch_to(&mount, kind, payload, props);
}
