//! The device door: an MQTT broker (rumqttd) embedded in edgeway, and the
//! ingress that turns device messages into tasks.
//!
//! ```text
//! device ─TCP/TLS/WS─▶ DeviceProtocol ─▶ rumqttd router ─▶ edgeway's link ─▶ requests ─▶ Gateway::submit
//!   (auth, mount d/{tenant}/{id}/…)                                   ▲                        │
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
//! - [`auth`]: device credentials, the tenant a device id belongs to.
//! - [`external`]: `[mqtt] mode = "external"`: no embedded broker; edgeway
//!   is a client of an existing one (the ingress above, fed and publishing
//!   through that client), whose ACLs [`acl`] writes.
//!
//! edgeway's own link to the router: a reader ([`link_loop`]) that only
//! sorts device messages into per-device inboxes, so it keeps up with the
//! router's log (a reader that falls behind it is skipped ahead by rumqttd
//! without a word: the reader sees the gap in the log offsets, logs it and
//! counts it in `mqtt_link_skipped_total`); and a writer thread
//! ([`Publisher`]) that hands edgeway's publishes to the router, so a full
//! router channel blocks that thread, never a runtime worker.
//!
//! Owns: the broker, device sessions and the MQTT rendering of task events.
//! Does not own: admission, queues or engines (everything goes through
//! [`Gateway::submit`]). The topic and message contracts are in `topics/`.

pub mod acl;
pub mod auth;
pub mod broker;
pub mod codec;
pub mod connections;
pub mod external;
pub mod presence;
pub mod protocol;
pub mod requests;
pub mod streams;
pub mod topics;
pub mod wills;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use prometheus::{IntCounter, IntCounterVec, IntGauge, Opts, Registry};
use rumqttd::local::{LinkRx, LinkTx};
use rumqttd::protocol::{Packet, Publish, PublishProperties, QoS};
use rumqttd::Notification;
use serde_json::json;
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use broker::MqttAddrs;
use presence::PresenceReporter;
use protocol::ProtocolShared;
use requests::{Change, DeviceIngress, Sessions};
use streams::Streams;
use topics::Topics;
use wills::Wills;

use crate::config::{Config, ModelKind};
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
    /// Resumes, by outcome (`ok`, `unknown`, `out_of_range`,
    /// `rate_limited`).
    pub resumes: IntCounterVec,
    /// Messages the router skipped on edgeway's link (it fell further
    /// behind than the link's log; or a message expired in the log).
    pub link_skipped: IntCounter,
    /// Device messages refused or dropped because the device's inbox was
    /// full.
    pub overflow: IntCounter,
    /// Single publishes (refusals, wills) dropped because edgeway's queue
    /// to the router was full.
    pub publish_dropped: IntCounter,
    /// 1 once the writer thread to the router has failed (all MQTT output
    /// stopped; `/ready` says so too).
    pub publisher_failed: IntGauge,
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
            link_skipped: reg(
                registry,
                IntCounter::new(
                    "mqtt_link_skipped_total",
                    "Device messages the broker skipped on edgeway's link (it fell behind, or they expired: \
                     an MQTT 5 message expiry a device sets counts here too)",
                )
                .expect("valid metric"),
            ),
            overflow: reg(
                registry,
                IntCounter::new("mqtt_inbox_overflow_total", "Device messages refused or dropped: device inbox full")
                    .expect("valid metric"),
            ),
            publish_dropped: reg(
                registry,
                IntCounter::new(
                    "mqtt_publishes_dropped_total",
                    "Single publishes to devices (refusals, wills) dropped: edgeway's queue to the broker was full",
                )
                .expect("valid metric"),
            ),
            publisher_failed: reg(
                registry,
                IntGauge::new("mqtt_publisher_failed", "1 once edgeway's writer to the broker has failed")
                    .expect("valid metric"),
            ),
        }
    }
}

/// Publishes edgeway sends that may wait in [`Publisher`]'s queue for the
/// writer thread; a stream sender waits for room beyond it. Single
/// publishes have as much room of their own; past it they are dropped and
/// counted (a flood answered `RATE_LIMITED` while the router is stalled
/// would otherwise grow the queue without limit).
const PUBLISH_QUEUE: usize = 4096;

/// One publish on its way to the router, with the queue room it holds.
struct Outgoing {
    packet: Packet,
    /// Held until the router has the packet.
    room: Option<OwnedSemaphorePermit>,
}

/// edgeway's publishing end of its link to the router. The link's `send`
/// blocks its thread while the router's channel is full, so a thread of
/// its own does the sending; publishers only queue.
///
/// On an external broker (`mode = "external"`) the same publisher hands the
/// publishes to edgeway's MQTT client instead ([`Publisher::client`]); its
/// event loop does the sending, and its request channel is the queue.
pub struct Publisher {
    sink: Sink,
    room: Arc<Semaphore>,
    /// Room of the single publishes ([`Self::publish`]).
    single_room: Arc<Semaphore>,
    closed: Arc<AtomicBool>,
    metrics: MqttMetrics,
}

/// Where a [`Publisher`]'s publishes go.
enum Sink {
    /// The writer thread into the embedded broker's router.
    Link(std::sync::mpsc::Sender<Outgoing>),
    /// The client of an external broker, at QoS 1 (or 0, where asked).
    Client(rumqttc::v5::AsyncClient),
}

/// rumqttd's publish properties (the ingress's) as the client's.
fn client_properties(p: Option<PublishProperties>) -> rumqttc::v5::mqttbytes::v5::PublishProperties {
    let p = p.unwrap_or_default();
    rumqttc::v5::mqttbytes::v5::PublishProperties {
        payload_format_indicator: p.payload_format_indicator,
        message_expiry_interval: p.message_expiry_interval,
        topic_alias: None,
        response_topic: p.response_topic,
        correlation_data: p.correlation_data,
        user_properties: p.user_properties,
        subscription_identifiers: Vec::new(),
        content_type: p.content_type,
    }
}

/// The client's QoS for an ingress QoS (which means "at most this"): QoS 2
/// is not worth its round trips here, as devices drop repeats by `seq`.
fn client_qos(qos: QoS) -> rumqttc::v5::mqttbytes::QoS {
    match qos {
        QoS::AtMostOnce => rumqttc::v5::mqttbytes::QoS::AtMostOnce,
        _ => rumqttc::v5::mqttbytes::QoS::AtLeastOnce,
    }
}

impl Publisher {
    /// A publisher into an external broker through `client`, whose event
    /// loop someone else polls ([`external`]).
    pub fn client(client: rumqttc::v5::AsyncClient, metrics: MqttMetrics) -> Publisher {
        Publisher {
            sink: Sink::Client(client),
            room: Arc::new(Semaphore::new(PUBLISH_QUEUE)),
            single_room: Arc::new(Semaphore::new(PUBLISH_QUEUE)),
            closed: Arc::new(AtomicBool::new(false)),
            metrics,
        }
    }

    /// Starts the writer thread of `tx`. It ends when the publisher is
    /// dropped or the router is gone; `on_failure` runs if it ends on an
    /// error while the publisher is still in use.
    pub fn start(
        tx: LinkTx,
        metrics: MqttMetrics,
        on_failure: impl FnOnce() + Send + 'static,
    ) -> std::io::Result<Publisher> {
        let (queue, rx) = std::sync::mpsc::channel();
        let closed = Arc::new(AtomicBool::new(false));
        let c = closed.clone();
        let m = metrics.clone();
        std::thread::Builder::new().name("mqtt-publisher".into()).spawn(move || {
            if write_loop(tx, rx, c).is_err() {
                tracing::error!("MQTT: edgeway's writer to the broker failed; nothing more reaches devices");
                m.publisher_failed.set(1);
                on_failure();
            }
        })?;
        Ok(Publisher {
            sink: Sink::Link(queue),
            room: Arc::new(Semaphore::new(PUBLISH_QUEUE)),
            single_room: Arc::new(Semaphore::new(PUBLISH_QUEUE)),
            closed,
            metrics,
        })
    }

    fn enqueue(
        &self,
        topic: &str,
        payload: Bytes,
        props: Option<PublishProperties>,
        retain: bool,
        qos: QoS,
        room: Option<OwnedSemaphorePermit>,
    ) -> Result<(), LinkClosed> {
        if self.closed.load(Ordering::SeqCst) {
            return Err(LinkClosed);
        }
        self.metrics.messages_out.inc();
        self.metrics.bytes_out.inc_by(payload.len() as u64);
        // No acknowledgement: the router delivers at the lower of `qos`
        // and each subscription's QoS.
        match &self.sink {
            Sink::Link(queue) => {
                let p = Publish::unacknowledged(Bytes::copy_from_slice(topic.as_bytes()), payload, retain, qos);
                queue.send(Outgoing { packet: Packet::Publish(p, props), room }).map_err(|_| LinkClosed)
            }
            Sink::Client(client) => {
                // The client's channel is full (the broker is slow or
                // away): a single publish is dropped, as above.
                if client
                    .try_publish_with_properties(topic, client_qos(qos), retain, payload, client_properties(props))
                    .is_err()
                {
                    self.metrics.publish_dropped.inc();
                }
                Ok(())
            }
        }
    }

    /// Publishes into the router, delivered at the QoS of each
    /// subscription ([`Publish::unacknowledged`] at QoS 2: edgeway's own
    /// messages go at the QoS the device subscribed with). Never waits: for
    /// single answers (refusals, the catalogue); a stream uses
    /// [`Self::publish_queued`].
    pub fn publish(
        &self,
        topic: &str,
        payload: Bytes,
        props: Option<PublishProperties>,
        retain: bool,
    ) -> Result<(), LinkClosed> {
        self.publish_at(topic, payload, props, retain, QoS::ExactlyOnce)
    }

    /// [`Self::publish`] delivered at the lower of `qos` and each
    /// subscription's QoS: a device's will, at its will QoS.
    pub fn publish_at(
        &self,
        topic: &str,
        payload: Bytes,
        props: Option<PublishProperties>,
        retain: bool,
        qos: QoS,
    ) -> Result<(), LinkClosed> {
        let Ok(room) = self.single_room.clone().try_acquire_owned() else {
            self.metrics.publish_dropped.inc();
            return Ok(());
        };
        self.enqueue(topic, payload, props, retain, qos, Some(room))
    }

    /// [`Self::publish`], waiting (asynchronously) while edgeway's queue to
    /// the router is full: back-pressure on the stream senders.
    pub async fn publish_queued(
        &self,
        topic: &str,
        payload: Bytes,
        props: Option<PublishProperties>,
    ) -> Result<(), LinkClosed> {
        if let Sink::Client(client) = &self.sink {
            self.metrics.messages_out.inc();
            self.metrics.bytes_out.inc_by(payload.len() as u64);
            // Waits while the client's channel is full; fails only once
            // its event loop is gone (edgeway stopping).
            let qos = rumqttc::v5::mqttbytes::QoS::AtLeastOnce;
            return client
                .publish_with_properties(topic, qos, false, payload, client_properties(props))
                .await
                .map_err(|_| LinkClosed);
        }
        let room = self.room.clone().acquire_owned().await.map_err(|_| LinkClosed)?;
        self.enqueue(topic, payload, props, false, QoS::ExactlyOnce, Some(room))
    }
}

/// The writer thread: hands queued publishes to the router, one router
/// notification per batch. `Err` when the router refused a send.
fn write_loop(
    mut tx: LinkTx,
    rx: std::sync::mpsc::Receiver<Outgoing>,
    closed: Arc<AtomicBool>,
) -> Result<(), LinkClosed> {
    while let Ok(first) = rx.recv() {
        let mut batch = vec![first];
        while batch.len() < 256 {
            match rx.try_recv() {
                Ok(m) => batch.push(m),
                Err(_) => break,
            }
        }
        let (mut packets, rooms): (Vec<Packet>, Vec<_>) = batch.into_iter().map(|m| (m.packet, m.room)).unzip();
        let last = packets.pop().expect("a batch has one");
        tx.buffer().extend(packets);
        // Blocks this thread (only) while the router's channel is full.
        if futures::executor::block_on(tx.send(last)).is_err() {
            closed.store(true, Ordering::SeqCst);
            return Err(LinkClosed);
        }
        // The batch's queue room is freed once the router has it.
        drop(rooms);
    }
    Ok(())
}

/// The router is gone (edgeway is shutting down).
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("the MQTT router is gone")]
pub struct LinkClosed;

/// The retained model catalogue on `{prefix}/shared/models`: the models a
/// device can ask for (chat; embedding models serve HTTP only).
fn catalogue(cfg: &Config) -> Bytes {
    let models: Vec<_> = cfg
        .models
        .values()
        .filter(|m| m.kind == ModelKind::Chat)
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
/// Returns once every listener is bound. With `mode = "external"` there are
/// none (`Ok(None)`): the ingress is a client of that broker ([`external`]).
pub async fn serve(
    gw: Arc<Gateway>,
    tracker: &TaskTracker,
    shutdown: CancellationToken,
) -> anyhow::Result<Option<MqttAddrs>> {
    let Some(cfg) = gw.config().mqtt.clone() else { return Ok(None) };
    if let Some(ext) = cfg.external.clone() {
        // No broker of edgeway's own: a client of the site's.
        external::serve(gw, cfg, ext, tracker, shutdown)?;
        return Ok(None);
    }
    let topics = Topics::new(&cfg.topic_prefix);
    let sessions = Arc::new(Sessions::new(cfg.stream_replay_max_bytes, cfg.resume_replay_bytes_per_s));
    let (presence_tx, presence_rx) = mpsc::unbounded_channel();
    let (wills_tx, wills_rx) = mpsc::unbounded_channel();
    let wills = Arc::new(Wills::new(wills_tx));
    let shared = Arc::new(
        ProtocolShared::new(
            auth::DeviceDirectory::new(gw.clone()),
            topics.clone(),
            PresenceReporter::new(sessions.clone(), presence_tx),
            wills.clone(),
        )
        .with_config(&cfg),
    );
    gw.set_device_list(shared.clone());
    let (addrs, links) =
        broker::start(&cfg, shared, &topics.gateway_filter(), &gw.metrics().registry, tracker, shutdown.clone())
            .await?;
    // '@' is not a device id character: no device can take this link over.
    let (mut tx, rx) = links("@edgeway").map_err(|e| e.context("mqtt: edgeway's link to the broker"))?;
    tx.subscribe(topics.gateway_filter()).map_err(|e| anyhow::anyhow!("mqtt: subscribe: {e}"))?;
    let metrics = MqttMetrics::new(&gw.metrics().registry);
    let failed = {
        let (gw, shutdown) = (Arc::downgrade(&gw), shutdown.clone());
        move || {
            // At shutdown the router goes first: not a failure.
            if let Some(gw) = gw.upgrade().filter(|_| !shutdown.is_cancelled()) {
                gw.ingress_failed("the MQTT broker no longer takes edgeway's publishes");
            }
        }
    };
    let out = Arc::new(
        Publisher::start(tx, metrics.clone(), failed).map_err(|e| anyhow::anyhow!("mqtt: publisher thread: {e}"))?,
    );
    out.publish(&topics.internal_shared(&topics.catalogue()), catalogue(&gw.config()), None, true)
        .map_err(|e| anyhow::anyhow!("mqtt: model catalogue: {e}"))?;
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
    tracker.spawn(wills::publish_loop(wills, ingress.out.clone(), wills_rx, tracker.clone(), shutdown.clone()));
    tracker.spawn(link_loop(ingress.clone(), rx, shutdown.clone()));
    tracker.spawn(presence_loop(ingress, presence_rx, shutdown));
    tracing::info!(mqtt = %addrs.mqtt, tls = ?addrs.tls, ws = ?addrs.ws, "MQTT broker is listening");
    Ok(Some(addrs))
}

/// Counts the messages the router skipped on edgeway's link: the offsets of
/// one filter's log are consecutive, so a jump is messages never delivered.
#[derive(Default)]
struct GapDetector {
    last: Option<u64>,
    /// When a gap was last logged: at most one line per [`GAP_LOG_EVERY`]
    /// (a device can cause gaps at will with MQTT 5 message expiries).
    logged: Option<std::time::Instant>,
    /// Skipped since the last line.
    unlogged: u64,
}

/// The least time between two log lines about gaps.
const GAP_LOG_EVERY: Duration = Duration::from_secs(10);

impl GapDetector {
    /// The messages skipped before the one at `offset`.
    fn skipped(&mut self, offset: u64) -> u64 {
        let gap = match self.last {
            Some(last) if offset > last + 1 => offset - last - 1,
            _ => 0,
        };
        self.last = Some(offset);
        gap
    }

    /// Whether to log `lost` more skipped messages now; `Some(n)`: log `n`
    /// (those not logged yet included).
    fn log_now(&mut self, lost: u64, now: std::time::Instant) -> Option<u64> {
        self.unlogged += lost;
        if self.logged.is_some_and(|at| now.duration_since(at) < GAP_LOG_EVERY) {
            return None;
        }
        self.logged = Some(now);
        Some(std::mem::take(&mut self.unlogged))
    }
}

/// Reads what devices publish to edgeway, in order, into the devices'
/// inboxes.
///
/// # Cancel safety
/// `LinkRx::next` can be dropped at the shutdown arm without losing a
/// message that matters: the ingress stops with it.
async fn link_loop(ingress: Arc<DeviceIngress>, mut rx: LinkRx, shutdown: CancellationToken) {
    let mut gaps = GapDetector::default();
    loop {
        let n = tokio::select! {
            _ = shutdown.cancelled() => return,
            n = rx.next() => n,
        };
        match n {
            Ok(Some(Notification::Forward(f))) => {
                if let Some((_, offset)) = f.cursor {
                    let lost = gaps.skipped(offset);
                    if lost > 0 {
                        ingress.metrics.link_skipped.inc_by(lost);
                        if let Some(lost) = gaps.log_now(lost, std::time::Instant::now()) {
                            tracing::error!(
                                lost,
                                "MQTT: the broker skipped device messages on edgeway's link (it fell behind the \
                                 log, or they expired)"
                            );
                        }
                    }
                }
                let topic = String::from_utf8_lossy(&f.publish.topic);
                ingress.dispatch(&topic, f.publish.payload, f.properties);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gaps_in_the_link_log_are_counted() {
        let mut g = GapDetector::default();
        assert_eq!([g.skipped(7), g.skipped(8), g.skipped(9), g.skipped(15), g.skipped(16)], [0, 0, 0, 5, 0]);
    }

    #[test]
    fn gaps_are_logged_at_most_once_per_period_with_what_was_not_logged() {
        let mut g = GapDetector::default();
        let t0 = std::time::Instant::now();
        assert_eq!(g.log_now(5, t0), Some(5));
        for i in 1..100 {
            assert_eq!(g.log_now(1, t0 + Duration::from_millis(i)), None);
        }
        assert_eq!(g.log_now(1, t0 + GAP_LOG_EVERY), Some(100));
    }

    /// Single publishes while the router is stalled are bounded: past the
    /// queue's room they are dropped and counted, not queued.
    #[test]
    fn single_publishes_are_bounded_while_the_router_is_stalled() {
        let (router_tx, _router_rx) = flume::bounded(1);
        let mut filler = LinkTx::new(0, router_tx.clone(), Default::default());
        filler.publish("t", "x").unwrap();
        let metrics = MqttMetrics::new(&Registry::new());
        let out = Publisher::start(LinkTx::new(1, router_tx, Default::default()), metrics.clone(), || {}).unwrap();
        for i in 0..2 * PUBLISH_QUEUE {
            out.publish(&format!("d/t/dev/r/{i}"), Bytes::from_static(b"p"), None, false).unwrap();
        }
        let dropped = metrics.publish_dropped.get();
        // The writer thread holds one batch of up to 256 at the router.
        assert!((PUBLISH_QUEUE as u64 - 256..=PUBLISH_QUEUE as u64).contains(&dropped), "{dropped}");
        drop(filler);
    }

    /// A writer that fails (the router refused a send) says so: the
    /// failure hook runs and the metric is set.
    #[test]
    fn a_failed_writer_is_reported() {
        let (router_tx, router_rx) = flume::bounded(8);
        drop(router_rx);
        let metrics = MqttMetrics::new(&Registry::new());
        let (failed_tx, failed_rx) = std::sync::mpsc::channel();
        let out = Publisher::start(LinkTx::new(1, router_tx, Default::default()), metrics.clone(), move || {
            failed_tx.send(()).unwrap();
        })
        .unwrap();
        out.publish("d/t/dev/r/1", Bytes::from_static(b"p"), None, false).unwrap();
        failed_rx.recv_timeout(Duration::from_secs(10)).expect("the failure was reported");
        assert_eq!(metrics.publisher_failed.get(), 1);
    }

    /// rumqttd's `LinkTx::send` blocks its thread while the router's
    /// channel is full. Publishing must not: on a runtime with one worker,
    /// other tasks (an HTTP call) still run while the router is stalled.
    #[test]
    fn a_full_router_channel_blocks_no_runtime_thread() {
        let (router_tx, router_rx) = flume::bounded(1);
        // Fill the channel: the router is stalled.
        let mut filler = LinkTx::new(0, router_tx.clone(), Default::default());
        filler.publish("t", "x").unwrap();
        let link = LinkTx::new(1, router_tx, Default::default());
        let out = Arc::new(Publisher::start(link, MqttMetrics::new(&Registry::new()), || {}).unwrap());
        let (answered_tx, answered_rx) = std::sync::mpsc::channel();
        let o = out.clone();
        // The runtime runs on a thread of its own: if publishing blocks it,
        // this test fails instead of hanging.
        let runtime = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(async move {
                let publishing = tokio::spawn(async move {
                    for i in 0..3 * PUBLISH_QUEUE {
                        let topic = format!("d/t/dev/r/{i}");
                        if i % 2 == 0 {
                            o.publish(&topic, Bytes::from_static(b"p"), None, false).unwrap();
                        } else {
                            o.publish_queued(&topic, Bytes::from_static(b"p"), None).await.unwrap();
                        }
                    }
                });
                tokio::task::yield_now().await;
                // Another task of this runtime answers meanwhile.
                tokio::spawn(async {}).await.unwrap();
                answered_tx.send(publishing.is_finished()).unwrap();
                publishing.await.unwrap();
            })
        });
        let finished = answered_rx.recv_timeout(Duration::from_secs(20)).expect("the runtime thread was blocked");
        assert!(!finished, "the stream sender waits for room");
        // The router drains its channel: everything goes through.
        let mut notified = 0;
        while router_rx.recv_timeout(Duration::from_secs(3)).is_ok() {
            notified += 1;
        }
        runtime.join().unwrap();
        assert!(notified >= 2, "{notified}");
        drop(out);
    }
}
