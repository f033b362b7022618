//! The device door: an MQTT broker (rumqttd) embedded in edgeway, and the
//! ingress that turns device messages into tasks.
//!
//! ```text
//! device ─TCP/TLS/WS─▶ DeviceProtocol ─▶ rumqttd router ─▶ edgeway's link ─▶ requests ─▶ Gateway::submit
//!        (auth, mount d/{id}/…)                                   ▲                        │
//!                                                                 └── senders ◀── pumps ◀──┘ (TaskStream)
//! ```
//!
//! - [`broker`]: router and listeners, configured from `[mqtt]`.
//! - [`protocol`]: the codec wrapper rumqttd calls per connection; it
//!   authenticates devices and keeps each one inside its own topic subtree
//!   by calling:
//!   - [`codec`]: packet rewriting as pure functions (version detection,
//!     mounting, refusals);
//!   - [`connections`]: connection states and the table of open
//!     connections (takeover, broker ids);
//!   - [`wills`]: wills kept and published by edgeway;
//!   - [`presence`]: connects and disconnects reported to the ingress.
//! - [`topics`]: device-view and router-view topic names.
//! - [`requests`]: requests, cancels, resumes, disconnect policy.
//! - [`streams`]: per-request response streams (coalescing, replay).
//! - [`auth`]: device credentials.
//!
//! Owns: the broker, device sessions and the MQTT rendering of task events.
//! Does not own: admission, queues or engines (everything goes through
//! [`Gateway::submit`]). The topic and message contracts are in `topics/`.

pub mod auth;
pub mod broker;
pub mod codec;
pub mod connections;
pub mod presence;
pub mod protocol;
pub mod requests;
pub mod streams;
pub mod topics;
pub mod wills;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures::FutureExt;
use prometheus::{IntCounter, IntCounterVec, IntGauge, Opts, Registry};
use rumqttd::local::{LinkRx, LinkTx};
use rumqttd::protocol::{Packet, Publish, PublishProperties};
use rumqttd::Notification;
use serde_json::json;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use broker::MqttAddrs;
use presence::PresenceReporter;
use protocol::ProtocolShared;
use requests::{Change, DeviceIngress, Sessions};
use streams::Streams;
use topics::Topics;
use wills::Wills;

use crate::config::Config;
use crate::gateway::Gateway;

/// Metrics of the MQTT ingress. Labels are closed sets.
#[derive(Clone)]
pub struct MqttMetrics {
    /// Devices with an open connection.
    pub connected: IntGauge,
    /// Messages from devices to edgeway, by kind (`req`, `cancel`,
    /// `resume`, `repeat`).
    pub inbound: IntCounterVec,
    /// Messages edgeway published to devices, and their payload bytes.
    pub messages_out: IntCounter,
    pub bytes_out: IntCounter,
    /// Requests answered with an error before they became a task, by code.
    pub rejected: IntCounterVec,
    /// Resumes, by outcome (`ok`, `unknown`, `out_of_range`).
    pub resumes: IntCounterVec,
}

impl MqttMetrics {
    fn new(registry: &Registry) -> MqttMetrics {
        fn reg<T: prometheus::core::Collector + Clone + 'static>(r: &Registry, c: T) -> T {
            // A second gateway in one process (tests) has its own registry;
            // a failure here only means the metric is already there.
            let _ = r.register(Box::new(c.clone()));
            c
        }
        let vec = |name: &str, help: &str, label: &str| {
            reg(registry, IntCounterVec::new(Opts::new(name, help), &[label]).expect("valid metric"))
        };
        MqttMetrics {
            connected: reg(
                registry,
                IntGauge::new("mqtt_devices_connected", "Devices with an open MQTT connection").expect("valid metric"),
            ),
            inbound: vec("mqtt_messages_in_total", "Device messages to edgeway, by kind", "kind"),
            messages_out: reg(
                registry,
                IntCounter::new("mqtt_messages_out_total", "Messages published to devices").expect("valid metric"),
            ),
            bytes_out: reg(
                registry,
                IntCounter::new("mqtt_bytes_out_total", "Payload bytes published to devices").expect("valid metric"),
            ),
            rejected: vec("mqtt_rejected_total", "Device requests refused before they became a task", "code"),
            resumes: vec("mqtt_resumes_total", "Stream resumes, by outcome", "outcome"),
        }
    }
}

/// edgeway's publishing end of its link to the router.
pub struct Publisher {
    tx: Mutex<LinkTx>,
    metrics: MqttMetrics,
}

impl Publisher {
    /// Publishes at QoS 0 into the router (which delivers with the QoS of
    /// each subscription).
    pub fn publish(
        &self,
        topic: &str,
        payload: Bytes,
        props: Option<PublishProperties>,
        retain: bool,
    ) -> Result<(), LinkClosed> {
        self.metrics.messages_out.inc();
        self.metrics.bytes_out.inc_by(payload.len() as u64);
        let p = Publish::new(Bytes::copy_from_slice(topic.as_bytes()), payload, retain);
        let mut tx = self.tx.lock().expect("link");
        // `send` has no await point inside: it completes on first poll.
        match tx.send(Packet::Publish(p, props)).now_or_never() {
            Some(Ok(_)) => Ok(()),
            _ => Err(LinkClosed),
        }
    }
}

/// The router is gone (edgeway is shutting down).
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("the MQTT router is gone")]
pub struct LinkClosed;

/// The retained model catalogue on `{prefix}/shared/models`.
fn catalogue(cfg: &Config) -> Bytes {
    let models: Vec<_> = cfg
        .models
        .values()
        .map(|m| {
            json!({
                "id": m.name, "description": m.description,
                "context_tokens": m.context_tokens, "max_output_tokens": m.max_output_tokens,
            })
        })
        .collect();
    Bytes::from(json!({ "node_id": cfg.node_id, "models": models }).to_string())
}

/// Starts the broker and the device ingress when `[mqtt]` is configured.
/// Returns once every listener is bound.
pub async fn serve(
    gw: Arc<Gateway>,
    tracker: &TaskTracker,
    shutdown: CancellationToken,
) -> anyhow::Result<Option<MqttAddrs>> {
    let Some(cfg) = gw.config().mqtt.clone() else { return Ok(None) };
    let topics = Topics::new(&cfg.topic_prefix);
    let sessions = Arc::new(Sessions::default());
    let (presence_tx, presence_rx) = mpsc::unbounded_channel();
    let (wills_tx, wills_rx) = mpsc::unbounded_channel();
    let wills = Arc::new(Wills::new(wills_tx));
    let shared = Arc::new(
        ProtocolShared::new(
            auth::DeviceDirectory::new(gw.config()),
            topics.clone(),
            PresenceReporter::new(sessions.clone(), presence_tx),
            wills.clone(),
        )
        .with_config(&cfg),
    );
    let (addrs, links) =
        broker::start(&cfg, shared, &topics.gateway_filter(), &gw.metrics().registry, tracker, shutdown.clone())
            .await?;
    // '@' is not a device id character: no device can take this link over.
    let (mut tx, rx) = links("@edgeway").map_err(|e| e.context("mqtt: edgeway's link to the broker"))?;
    tx.subscribe(topics.gateway_filter()).map_err(|e| anyhow::anyhow!("mqtt: subscribe: {e}"))?;
    let metrics = MqttMetrics::new(&gw.metrics().registry);
    let out = Arc::new(Publisher { tx: Mutex::new(tx), metrics: metrics.clone() });
    out.publish(&topics.internal_shared(&topics.catalogue()), catalogue(gw.config()), None, true)
        .map_err(|e| anyhow::anyhow!("mqtt: model catalogue: {e}"))?;
    let streams = Arc::new(Streams::new(cfg.replay_retention, cfg.replay_max_bytes, cfg.stream_replay_max_bytes));
    let ingress = Arc::new(DeviceIngress {
        gw,
        cfg,
        topics,
        out,
        streams,
        sessions,
        metrics,
        tracker: tracker.clone(),
        shutdown: shutdown.clone(),
    });
    tracker.spawn(wills::publish_loop(wills, ingress.out.clone(), wills_rx, tracker.clone(), shutdown.clone()));
    tracker.spawn(link_loop(ingress.clone(), rx, shutdown.clone()));
    tracker.spawn(presence_loop(ingress, presence_rx, shutdown));
    tracing::info!(mqtt = %addrs.mqtt, tls = ?addrs.tls, ws = ?addrs.ws, "MQTT broker is listening");
    Ok(Some(addrs))
}

/// Reads what devices publish to edgeway, in order.
///
/// # Cancel safety
/// `LinkRx::next` can be dropped at the shutdown arm without losing a
/// message that matters: the ingress stops with it.
async fn link_loop(ingress: Arc<DeviceIngress>, mut rx: LinkRx, shutdown: CancellationToken) {
    loop {
        let n = tokio::select! {
            _ = shutdown.cancelled() => return,
            n = rx.next() => n,
        };
        match n {
            Ok(Some(Notification::Forward(f))) => {
                let topic = String::from_utf8_lossy(&f.publish.topic).into_owned();
                ingress.on_message(&topic, f.publish.payload, f.properties).await;
            }
            // Our buffer filled up: the router stops delivering until told.
            Ok(Some(Notification::Unschedule)) => {
                if rx.wake().await.is_err() {
                    return;
                }
            }
            Ok(_) => {}
            Err(e) => {
                tracing::error!(error = %e, "MQTT: edgeway's link to the broker failed");
                return;
            }
        }
    }
}

/// Applies device connects and disconnects, and expires old streams.
async fn presence_loop(
    ingress: Arc<DeviceIngress>,
    mut rx: mpsc::UnboundedReceiver<Change>,
    shutdown: CancellationToken,
) {
    let mut sweep = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            p = rx.recv() => match p {
                Some(p) => ingress.on_presence(&p),
                None => return,
            },
            _ = sweep.tick() => ingress.streams.sweep(),
        }
    }
}
