//! The embedded rumqttd broker: its router (a thread of its own) and
//! listeners (tasks on edgeway's runtime, stopped by the shutdown token),
//! configured from `[mqtt]`.
//!
//! rumqttd's router has no topic ACL and quirks that shape the settings
//! (see DESIGN.md): `RouterConfig::default()` is unusable, a publish that
//! matches no filter disconnects its publisher, and a subscriber that lags
//! further than its filter's in-memory log silently skips ahead. So:
//! - filters are created at start (`d/#`, `s/#`, `x/#`) that match every topic
//!   a device or edgeway can publish, so no publish ever matches nothing;
//! - each filter keeps about `filter_log_bytes` in memory; the filter that
//!   carries requests to edgeway gets a larger log;
//! - every listener uses [`DeviceProtocol`], which authenticates and
//!   isolates devices;
//! - every listener caps its sockets (`max_pending_connects` before CONNECT,
//!   `max_connections` plus those in all) and closes a socket that sends no
//!   CONNECT within `connect_timeout_ms`; what it refused or timed out is
//!   counted in `mqtt_sockets_refused_total` and
//!   `mqtt_connect_timeouts_total` ([`ListenerMetrics`]);
//! - the router keeps at most `max_kept_sessions_per_device` sessions per
//!   device after their connections (its client ids are grouped by device),
//!   the oldest discarded first and counted in
//!   `mqtt_kept_sessions_discarded_total` and
//!   `mqtt_kept_session_messages_dropped_total` ([`KeptSessionMetrics`]).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::task::Poll;

use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{IntCounter, IntCounterVec, IntGaugeVec, Opts, Registry};
use rumqttd::local::{LinkBuilder, LinkRx, LinkTx};
use rumqttd::{
    ConnectionSettings, LinkType, ListenerStats, Router, RouterConfig, RouterStats, Server, ServerSettings, TlsConfig,
};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::protocol::{DeviceProtocol, ProtocolShared};
use super::topics::{DEVICE_MOUNT, DOLLAR_MOUNT, SHARED_MOUNT};
use crate::config::MqttConfig;

/// Where the broker listens.
#[derive(Debug, Clone, Copy)]
pub struct MqttAddrs {
    pub mqtt: SocketAddr,
    pub tls: Option<SocketAddr>,
    pub ws: Option<SocketAddr>,
}

/// Makes local links to the router (edgeway's own connections).
pub type LinkFactory = Box<dyn Fn(&str) -> anyhow::Result<(LinkTx, LinkRx)> + Send + Sync>;

/// Local links of edgeway itself, on top of the device connections.
const LOCAL_LINKS: usize = 8;

/// Room a connection's read buffer makes when it is full (rumqttd's
/// default is 10 KiB): device packets are small. The patched rumqttd
/// starts the read buffer at 256 bytes and the write buffer empty, so an
/// idle device holds neither at this size (PATCHES.md 40).
const INITIAL_BUFFER_BYTES: usize = 2048;

fn router_config(cfg: &MqttConfig, gateway_filter: &str) -> RouterConfig {
    // A filter keeps `count` segments of `size` bytes.
    let count = 4;
    let size = (cfg.filter_log_bytes / count).max(1024);
    let mut custom = HashMap::new();
    // Requests from every device share one filter: give it room for bursts.
    custom.insert(
        gateway_filter.to_string(),
        rumqttd::SegmentConfig { max_segment_size: (cfg.max_packet_bytes * 4).max(size), max_segment_count: 16 },
    );
    RouterConfig {
        max_connections: cfg.max_connections + LOCAL_LINKS,
        max_outgoing_packet_count: 200,
        max_segment_size: size,
        max_segment_count: count,
        custom_segment: Some(custom),
        initialized_filters: Some(vec![
            format!("{DEVICE_MOUNT}#"),
            format!("{SHARED_MOUNT}#"),
            format!("{DOLLAR_MOUNT}#"),
        ]),
        shared_subscriptions_strategy: Default::default(),
        // The router's client ids are `{tenant}:{device}|{client id}`
        // (`topics::router_client_id`): its groups are devices.
        max_kept_sessions_per_group: Some(cfg.max_kept_sessions_per_device),
    }
}

fn server_settings(name: &str, listen: SocketAddr, cfg: &MqttConfig, tls: Option<TlsConfig>) -> ServerSettings {
    ServerSettings {
        name: name.to_string(),
        listen,
        tls,
        next_connection_delay_ms: 0,
        // Sockets before CONNECT are capped apart (each may hold a buffer
        // for one); all sockets of a listener at the device cap plus those.
        max_connections: Some(cfg.max_connections + cfg.max_pending_connects),
        max_awaiting_connect: Some(cfg.max_pending_connects),
        connections: ConnectionSettings {
            connection_timeout_ms: cfg.connect_timeout.as_millis().min(u16::MAX as u128) as u16,
            max_payload_size: cfg.max_packet_bytes,
            max_inflight_count: cfg.max_inflight,
            // Authentication happens in DeviceProtocol, which can answer
            // a refusal with a CONNACK.
            auth: None,
            external_auth: None,
            dynamic_filters: false,
            initial_buffer_bytes: Some(INITIAL_BUFFER_BYTES),
        },
    }
}

/// A concrete address for `addr` (port 0 picks a free port now; rumqttd
/// binds by address and cannot report the port it got).
fn concrete(addr: SocketAddr) -> std::io::Result<SocketAddr> {
    if addr.port() != 0 {
        return Ok(addr);
    }
    let l = std::net::TcpListener::bind(addr)?;
    l.local_addr()
}

/// Sets TCP_NODELAY on rumqttd's listening socket for `addr`.
///
/// rumqttd does not set it on the connections it accepts, so a small
/// publish (an `accepted`, a first delta) written while an earlier one is
/// unacknowledged waits for the device's delayed ACK (~40 ms on Linux).
/// rumqttd binds and accepts inside `Server::start` with no hook, but
/// Linux copies TCP_NODELAY from a listening socket to every socket it
/// accepts: so edgeway finds the listener among its own file descriptors
/// (a listening TCP socket bound to exactly `addr`) and sets it there.
/// Returns whether it did.
#[cfg(target_os = "linux")]
fn nodelay_on_listener(addr: SocketAddr) -> bool {
    use std::os::fd::BorrowedFd;
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else { return false };
    for entry in dir.flatten() {
        let Some(fd) = entry.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else { continue };
        if !std::fs::read_link(entry.path()).is_ok_and(|t| t.to_string_lossy().starts_with("socket:")) {
            continue;
        }
        // SAFETY: only socket options are read and set through the borrow;
        // the descriptor is never closed here. Should another thread close
        // it meanwhile and the number be reused, the calls fail or look at
        // another socket, which the checks below then skip.
        let fd = unsafe { BorrowedFd::borrow_raw(fd) };
        let s = socket2::SockRef::from(&fd);
        let ours = s.is_listener().unwrap_or(false)
            && s.r#type().is_ok_and(|t| t == socket2::Type::STREAM)
            && s.local_addr().ok().and_then(|a| a.as_socket()) == Some(addr);
        if ours {
            return s.set_tcp_nodelay(true).is_ok();
        }
    }
    false
}

#[cfg(not(target_os = "linux"))]
fn nodelay_on_listener(_addr: SocketAddr) -> bool {
    false
}

/// The counters of rumqttd's listeners, read at scrape time. The label
/// `listener` is one of `mqtt`, `mqtt-tls`, `mqtt-ws`.
struct ListenerMetrics {
    listeners: Vec<(&'static str, Arc<ListenerStats>)>,
    refused: IntCounterVec,
    timeouts: IntCounterVec,
    accept_errors: IntCounterVec,
    open: IntGaugeVec,
    awaiting: IntGaugeVec,
}

impl ListenerMetrics {
    fn new(listeners: Vec<(&'static str, Arc<ListenerStats>)>) -> Self {
        let counter =
            |name: &str, help: &str| IntCounterVec::new(Opts::new(name, help), &["listener"]).expect("valid metric");
        let gauge =
            |name: &str, help: &str| IntGaugeVec::new(Opts::new(name, help), &["listener"]).expect("valid metric");
        ListenerMetrics {
            listeners,
            refused: counter("mqtt_sockets_refused_total", "MQTT sockets closed at once at a listener's cap"),
            timeouts: counter(
                "mqtt_connect_timeouts_total",
                "MQTT sockets closed because no CONNECT came within connect_timeout_ms",
            ),
            accept_errors: counter("mqtt_accept_errors_total", "Failed accept() calls of MQTT listeners"),
            open: gauge("mqtt_sockets_open", "Sockets open on an MQTT listener"),
            awaiting: gauge("mqtt_sockets_awaiting_connect", "Sockets of an MQTT listener that sent no CONNECT yet"),
        }
    }
}

impl Collector for ListenerMetrics {
    fn desc(&self) -> Vec<&Desc> {
        [self.refused.desc(), self.timeouts.desc(), self.accept_errors.desc(), self.open.desc(), self.awaiting.desc()]
            .concat()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        use std::sync::atomic::Ordering::Relaxed;
        let as_i64 = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        for (name, s) in &self.listeners {
            for (c, v) in [
                (&self.refused, s.refused_at_cap.load(Relaxed)),
                (&self.timeouts, s.connect_timeouts.load(Relaxed)),
                (&self.accept_errors, s.accept_errors.load(Relaxed)),
            ] {
                let c = c.with_label_values(&[name]);
                c.reset();
                c.inc_by(v);
            }
            self.open.with_label_values(&[name]).set(as_i64(s.open.load(Relaxed)));
            self.awaiting.with_label_values(&[name]).set(as_i64(s.awaiting_connect.load(Relaxed)));
        }
        [
            self.refused.collect(),
            self.timeouts.collect(),
            self.accept_errors.collect(),
            self.open.collect(),
            self.awaiting.collect(),
        ]
        .concat()
    }
}

/// The router's counters of kept sessions discarded for
/// `max_kept_sessions_per_device`, read at scrape time.
struct KeptSessionMetrics {
    stats: Arc<RouterStats>,
    discarded: IntCounter,
    dropped: IntCounter,
}

impl KeptSessionMetrics {
    fn new(stats: Arc<RouterStats>) -> Self {
        KeptSessionMetrics {
            stats,
            discarded: IntCounter::new(
                "mqtt_kept_sessions_discarded_total",
                "Kept MQTT sessions discarded, oldest first, because their device had max_kept_sessions_per_device",
            )
            .expect("valid metric"),
            dropped: IntCounter::new(
                "mqtt_kept_session_messages_dropped_total",
                "Messages those discarded sessions were owed (queued in the broker's filter logs)",
            )
            .expect("valid metric"),
        }
    }
}

impl Collector for KeptSessionMetrics {
    fn desc(&self) -> Vec<&Desc> {
        [self.discarded.desc(), self.dropped.desc()].concat()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        use std::sync::atomic::Ordering::Relaxed;
        for (c, v) in [
            (&self.discarded, self.stats.kept_sessions_discarded.load(Relaxed)),
            (&self.dropped, self.stats.kept_session_messages_dropped.load(Relaxed)),
        ] {
            c.reset();
            c.inc_by(v);
        }
        [self.discarded.collect(), self.dropped.collect()].concat()
    }
}

/// Starts the router and the listeners, whose counters go to `registry`.
/// Returns once every listener is bound.
pub async fn start(
    cfg: &MqttConfig,
    shared: Arc<ProtocolShared>,
    gateway_filter: &str,
    registry: &Registry,
    tracker: &TaskTracker,
    shutdown: CancellationToken,
) -> anyhow::Result<(MqttAddrs, LinkFactory)> {
    let router = Router::new(0, router_config(cfg, gateway_filter));
    let _ = registry.register(Box::new(KeptSessionMetrics::new(router.stats())));
    let router_tx = router.spawn();
    let protocol = DeviceProtocol::new(shared);

    let mut listeners = vec![("mqtt", cfg.listen, None, LinkType::Remote)];
    if let Some(t) = &cfg.tls {
        let tls = TlsConfig::Rustls {
            capath: None,
            certpath: t.cert_file.display().to_string(),
            keypath: t.key_file.display().to_string(),
        };
        listeners.push(("mqtt-tls", t.listen, Some(tls), LinkType::Remote));
    }
    if let Some(ws) = cfg.ws_listen {
        listeners.push(("mqtt-ws", ws, None, LinkType::Websocket));
    }
    let mut bound = Vec::new();
    let mut stats = Vec::new();
    for (name, listen, tls, link_type) in listeners {
        let listen = concrete(listen).map_err(|e| anyhow::anyhow!("mqtt listener {name} on {listen}: {e}"))?;
        let mut server = Server::new(server_settings(name, listen, cfg, tls), router_tx.clone(), protocol.clone());
        stats.push((name, server.stats()));
        let mut accept = Box::pin(async move { server.start(link_type).await });
        // The first poll binds the listener (or fails): after it, clients
        // can connect.
        if let Poll::Ready(r) = futures::poll!(accept.as_mut()) {
            let e = r.err().map(|e| e.to_string()).unwrap_or_else(|| "stopped".into());
            anyhow::bail!("mqtt listener {name} on {listen}: {e}");
        }
        if !nodelay_on_listener(listen) {
            tracing::warn!(
                listener = name,
                "could not set TCP_NODELAY on the MQTT listener: small messages may wait for delayed ACKs"
            );
        }
        let sd = shutdown.clone();
        tracker.spawn(async move {
            tokio::select! {
                _ = sd.cancelled() => {}
                r = accept => if let Err(e) = r {
                    tracing::error!(listener = name, error = %e, "MQTT listener failed");
                },
            }
        });
        bound.push(listen);
    }
    // A second gateway in one process (tests) has its own registry; a
    // failure here only means the metrics are already there.
    let _ = registry.register(Box::new(ListenerMetrics::new(stats)));
    let addrs = MqttAddrs {
        mqtt: bound[0],
        tls: cfg.tls.as_ref().map(|_| bound[1]),
        ws: cfg.ws_listen.map(|_| *bound.last().expect("ws bound")),
    };
    let factory: LinkFactory = Box::new(move |id: &str| {
        let (tx, rx, _ack) = LinkBuilder::new(id, router_tx.clone()).build().map_err(|e| anyhow::anyhow!("{e}"))?;
        Ok((tx, rx))
    });
    Ok((addrs, factory))
}
