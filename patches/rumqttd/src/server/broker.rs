use crate::link::alerts::{self};
use crate::link::console::ConsoleLink;
use crate::link::network::{self, Network, N};
use crate::link::remote::{self, mqtt_connect, RemoteLink};
use crate::link::{bridge, timer};
use crate::local::LinkBuilder;
use crate::protocol::v4::V4;
use crate::protocol::v5::V5;
use crate::protocol::{Packet, Protocol};
#[cfg(any(feature = "use-rustls", feature = "use-native-tls"))]
use crate::server::tls::{self, TLSAcceptor};
use crate::{meters, ConnectionSettings, Meter};
use flume::{RecvError, SendError, Sender};
use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use tracing::{error, field, info, warn, Instrument};
use uuid::Uuid;

#[cfg(feature = "websocket")]
use async_tungstenite::tokio::accept_hdr_async;
#[cfg(feature = "websocket")]
use async_tungstenite::tungstenite::handshake::server::{
    Callback, ErrorResponse, Request, Response,
};
#[cfg(feature = "websocket")]
use async_tungstenite::tungstenite::http::HeaderValue;
#[cfg(feature = "websocket")]
use ws_stream_tungstenite::WsStream;

use metrics::gauge;
use metrics_exporter_prometheus::PrometheusBuilder;
use std::time::Duration;
use std::{io, thread};

use crate::link::console;
use crate::link::local::{self, LinkRx, LinkTx};
use crate::router::{Event, Router};
use crate::{Config, ConnectionId, ServerSettings, TlsConfig};

use tokio::net::{TcpListener, TcpStream};
use tokio::time::error::Elapsed;
use tokio::{task, time};

#[derive(Debug, thiserror::Error)]
#[error("Acceptor error")]
pub enum Error {
    #[error("I/O {0}")]
    Io(#[from] io::Error),
    #[error("Timeout")]
    Timeout(#[from] Elapsed),
    #[error("Channel recv error")]
    Recv(#[from] RecvError),
    #[error("Channel send error")]
    Send(#[from] SendError<(ConnectionId, Event)>),
    #[cfg(any(feature = "use-rustls", feature = "use-native-tls"))]
    #[error("Certs error = {0}")]
    Certs(#[from] tls::Error),
    #[error("Accept error = {0}")]
    Accept(String),
    #[error("Remote error = {0}")]
    Remote(#[from] remote::Error),
    #[error("Invalid configuration")]
    Config(String),
}

pub struct Broker {
    config: Arc<Config>,
    router_tx: Sender<(ConnectionId, Event)>,
}

impl Broker {
    pub fn new(config: Config) -> Broker {
        let config = Arc::new(config);
        let router_config = config.router.clone();
        let router: Router = Router::new(config.id, router_config);

        // Setup cluster if cluster settings are configured.
        match config.cluster.clone() {
            Some(_cluster_config) => {
                // let node_id = cluster_config.node_id;
                // let listen = cluster_config.listen;
                // let seniors = cluster_config.seniors;
                // let mut cluster = RemoteCluster::new(node_id, &listen, seniors);
                // Broker::setup_remote_cluster(&mut router, node_id, &mut cluster);

                // Start router first and then cluster in the background
                let router_tx = router.spawn();
                // cluster.spawn();
                Broker { config, router_tx }
            }
            None => {
                let router_tx = router.spawn();
                Broker { config, router_tx }
            }
        }
    }

    // pub fn new_local_cluster(
    //     config: Config,
    //     node_id: NodeId,
    //     seniors: Vec<(NodeId, Sender<ReplicationData>)>,
    // ) -> (Broker, Sender<ReplicationData>) {
    //     let config = Arc::new(config);
    //     let router_config = config.router.clone();

    //     let mut router = Router::new(config.id, router_config);
    //     let (mut cluster, tx) = LocalCluster::new(node_id, seniors);
    //     Broker::setup_local_cluster(&mut router, node_id, &mut cluster);

    //     // Start router first and then cluster in the background
    //     let router_tx = router.spawn();
    //     cluster.spawn();

    //     (Broker { config, router_tx }, tx)
    // }

    // fn setup_remote_cluster(router: &mut Router, node_id: NodeId, cluster: &mut RemoteCluster) {
    //     // Retrieve pre-configured list of router <-> replica link from router
    //     // and add the link to cluster
    //     let nodes: Vec<NodeId> = (0..MAX_NODES).filter(|v| *v != node_id).collect();
    //     for node_id in nodes {
    //         let link = router.get_replica_handle(node_id);
    //         cluster.add_replica_router_handle(node_id, link);
    //     }
    // }

    // fn setup_local_cluster(router: &mut Router, node_id: NodeId, cluster: &mut LocalCluster) {
    //     // Retrieve pre-configured list of router <-> replica link from router
    //     // and add the link to cluster
    //     let nodes: Vec<NodeId> = (0..MAX_NODES).filter(|v| *v != node_id).collect();
    //     for node_id in nodes {
    //         let link = router.get_replica_handle(node_id);
    //         cluster.add_replica_router_handle(node_id, link);
    //     }
    // }

    // Link to get meters
    pub fn meters(&self) -> Result<meters::MetersLink, meters::LinkError> {
        let link = meters::MetersLink::new(self.router_tx.clone())?;
        Ok(link)
    }

    // Link to get alerts
    pub fn alerts(&self) -> Result<alerts::AlertsLink, alerts::LinkError> {
        let link = alerts::AlertsLink::new(self.router_tx.clone())?;
        Ok(link)
    }

    pub fn link(&self, client_id: &str) -> Result<(LinkTx, LinkRx), local::LinkError> {
        // Register this connection with the router. Router replies with ack which if ok will
        // start the link. Router can sometimes reject the connection (ex. max connection limit).
        let (link_tx, link_rx, _ack) =
            LinkBuilder::new(client_id, self.router_tx.clone()).build()?;
        Ok((link_tx, link_rx))
    }

    #[tracing::instrument(skip(self))]
    pub fn start(&mut self) -> Result<(), Error> {
        if self.config.v4.is_none()
            && self.config.v5.is_none()
            && (cfg!(not(feature = "websocket")) || self.config.ws.is_none())
        {
            return Err(Error::Config(
                "Atleast one server config must be specified, \
                consider adding either of [v4.x]/[v5.x] or [ws.x] (if enabled) in config file."
                    .to_string(),
            ));
        }

        // we don't know which servers (v4/v5/ws) user will spawn
        // so we collect handles for all of the spawned servers
        let mut server_thread_handles = Vec::new();

        if let Some(metrics_config) = self.config.metrics.clone() {
            let timer_thread = thread::Builder::new().name("timer".to_owned());
            let router_tx = self.router_tx.clone();
            timer_thread.spawn(move || {
                let mut runtime = tokio::runtime::Builder::new_current_thread();
                let runtime = runtime.enable_all().build().unwrap();

                runtime.block_on(async move {
                    timer::start(metrics_config, router_tx).await;
                });
            })?;
        }

        // Spawn bridge in a separate thread.
        if let Some(bridge_config) = self.config.bridge.clone() {
            let bridge_thread = thread::Builder::new().name(bridge_config.name.clone());
            let router_tx = self.router_tx.clone();
            bridge_thread.spawn(move || {
                let mut runtime = tokio::runtime::Builder::new_current_thread();
                let runtime = runtime.enable_all().build().unwrap();

                runtime.block_on(async move {
                    if let Err(e) = bridge::start(bridge_config, router_tx, V4).await {
                        error!(error=?e, "Bridge Link error");
                    };
                });
            })?;
        }

        // Spawn servers in a separate thread.
        if let Some(v4_config) = &self.config.v4 {
            for (_, config) in v4_config.clone() {
                let server_thread = thread::Builder::new().name(config.name.clone());
                let mut server = Server::new(config, self.router_tx.clone(), V4);
                let handle = server_thread.spawn(move || {
                    let mut runtime = tokio::runtime::Builder::new_current_thread();
                    let runtime = runtime.enable_all().build().unwrap();

                    runtime.block_on(async {
                        if let Err(e) = server.start(LinkType::Remote).await {
                            error!(error=?e, "Server error - V4");
                        }
                    });
                })?;
                server_thread_handles.push(handle)
            }
        }

        if let Some(v5_config) = &self.config.v5 {
            for (_, config) in v5_config.clone() {
                let server_thread = thread::Builder::new().name(config.name.clone());
                let mut server = Server::new(config, self.router_tx.clone(), V5);
                let handle = server_thread.spawn(move || {
                    let mut runtime = tokio::runtime::Builder::new_current_thread();
                    let runtime = runtime.enable_all().build().unwrap();

                    runtime.block_on(async {
                        if let Err(e) = server.start(LinkType::Remote).await {
                            error!(error=?e, "Server error - V5");
                        }
                    });
                })?;
                server_thread_handles.push(handle)
            }
        }

        #[cfg(not(feature = "websocket"))]
        if self.config.ws.is_some() {
            warn!("websocket feature is disabled, [ws] config will be ignored.");
        }

        #[cfg(feature = "websocket")]
        if let Some(ws_config) = &self.config.ws {
            for (_, config) in ws_config.clone() {
                let server_thread = thread::Builder::new().name(config.name.clone());
                //TODO: Add support for V5 procotol with websockets. Registered in config or on ServerSettings
                let mut server = Server::new(config, self.router_tx.clone(), V4);
                let handle = server_thread.spawn(move || {
                    let mut runtime = tokio::runtime::Builder::new_current_thread();
                    let runtime = runtime.enable_all().build().unwrap();

                    runtime.block_on(async {
                        if let Err(e) = server.start(LinkType::Websocket).await {
                            error!(error=?e, "Server error - WS");
                        }
                    });
                })?;
                server_thread_handles.push(handle)
            }
        }

        if let Some(prometheus_setting) = &self.config.prometheus {
            let timeout = prometheus_setting.interval;
            // If port is specified use it instead of listen.
            // NOTE: This means listen is ignored when `port` is specified.
            // `port` will be removed in future release in favour of `listen`
            let addr = {
                #[allow(deprecated)]
                match prometheus_setting.port {
                    Some(port) => SocketAddr::new("127.0.0.1".parse().unwrap(), port),
                    None => prometheus_setting.listen.unwrap_or(SocketAddr::new(
                        IpAddr::V4(Ipv4Addr::new(127, 0, 0, 1)),
                        9042,
                    )),
                }
            };
            let metrics_thread = thread::Builder::new().name("Metrics".to_owned());
            let meter_link = self.meters().unwrap();
            metrics_thread.spawn(move || {
                let builder = PrometheusBuilder::new().with_http_listener(addr);
                builder.install().unwrap();

                let total_publishes = gauge!("metrics.router.total_publishes");
                let total_connections = gauge!("metrics.router.total_connections");
                let failed_publishes = gauge!("metrics.router.failed_publishes");
                loop {
                    if let Ok(metrics) = meter_link.recv() {
                        for m in metrics {
                            match m {
                                Meter::Router(_, ref r) => {
                                    total_connections.set(r.total_connections as f64);
                                    total_publishes.set(r.total_publishes as f64);
                                    failed_publishes.set(r.failed_publishes as f64);
                                }
                                _ => continue,
                            }
                        }
                    }

                    std::thread::sleep(Duration::from_secs(timeout));
                }
            })?;
        }

        if let Some(console) = self.config.console.clone() {
            let console_link = ConsoleLink::new(console, self.router_tx.clone());

            let console_link = Arc::new(console_link);
            let console_thread = thread::Builder::new().name("Console".to_string());
            console_thread.spawn(move || {
                let mut runtime = tokio::runtime::Builder::new_current_thread();
                let runtime = runtime.enable_all().build().unwrap();
                runtime.block_on(console::start(console_link));
            })?;
        }

        // in ideal case, where server doesn't crash, join() will never resolve
        // we still try to join threads so that we don't return from function
        // unless everything crashes.
        server_thread_handles.into_iter().for_each(|handle| {
            // join() might panic in case the thread panics
            // we just ignore it
            let _ = handle.join();
        });

        Ok(())
    }
}

/// Backoff of the accept loop after a failed accept() (edgeway patch).
const ACCEPT_BACKOFF_MIN: Duration = Duration::from_millis(10);
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);

#[derive(Copy, Clone)]
pub enum LinkType {
    #[cfg(feature = "websocket")]
    Websocket,
    Remote,
}

#[derive(PartialEq)]
enum AwaitingWill {
    Cancel,
    Fire,
}

pub struct Server<P> {
    config: ServerSettings,
    router_tx: Sender<(ConnectionId, Event)>,
    protocol: P,
    awaiting_will_handler: Arc<Mutex<HashMap<String, Sender<AwaitingWill>>>>,
    stats: Arc<ListenerStats>,
}

impl<P: Protocol + Clone + Send + 'static> Server<P> {
    pub fn new(
        config: ServerSettings,
        router_tx: Sender<(ConnectionId, Event)>,
        protocol: P,
    ) -> Server<P> {
        Server {
            config,
            router_tx,
            protocol,
            awaiting_will_handler: Arc::new(Mutex::new(HashMap::default())),
            stats: Arc::default(),
        }
    }

    /// The counters of this listener (edgeway patch).
    pub fn stats(&self) -> Arc<ListenerStats> {
        self.stats.clone()
    }

    pub async fn start(&mut self, link_type: LinkType) -> Result<(), Error> {
        let listener = TcpListener::bind(&self.config.listen).await?;
        let delay = Duration::from_millis(self.config.next_connection_delay_ms);
        let mut count: usize = 0;
        // Zero while accept() works; then how long to wait before the next
        // try (edgeway patch, see PATCHES.md).
        let mut accept_backoff = Duration::ZERO;

        let config = Arc::new(self.config.connections.clone());
        info!(
            config = self.config.name,
            listen_addr = self.config.listen.to_string(),
            "Listening for remote connections",
        );
        loop {
            // Await new network connection.
            let (stream, addr) = match listener.accept().await {
                Ok((s, r)) => {
                    if !accept_backoff.is_zero() {
                        info!(name=?self.config.name, "Accepting sockets again");
                        accept_backoff = Duration::ZERO;
                    }
                    (s, r)
                }
                // At the descriptor limit (EMFILE, ENFILE) or out of memory,
                // accept() fails at once for as long as the condition
                // lasts: retrying at once spins a core and floods the log.
                // Log once, back off (10 ms doubling up to 1 s).
                Err(e) => {
                    self.stats.accept_errors.fetch_add(1, Ordering::Relaxed);
                    if accept_backoff.is_zero() {
                        error!(error=?e, name=?self.config.name, "Unable to accept socket, backing off");
                    }
                    accept_backoff = (accept_backoff * 2).clamp(ACCEPT_BACKOFF_MIN, ACCEPT_BACKOFF_MAX);
                    time::sleep(accept_backoff).await;
                    continue;
                }
            };

            let Some(slot) = ListenerSlot::admit(&self.stats, &self.config) else {
                // At a cap: closed at once, counted (edgeway patch).
                self.stats.refused_at_cap.fetch_add(1, Ordering::Relaxed);
                drop(stream);
                continue;
            };

            let config = config.clone();
            let router_tx = self.router_tx.clone();
            count += 1;

            // The codec of this socket learns who is at the other end
            // (edgeway patch, see PATCHES.md).
            let mut protocol = self.protocol.clone();
            protocol.peer(addr);
            let tls = self.config.tls.clone();
            let will_handlers = self.awaiting_will_handler.clone();
            let name = self.config.name.clone();
            let stats = self.stats.clone();
            let span = match link_type {
                #[cfg(feature = "websocket")]
                LinkType::Websocket => tracing::info_span!(
                    "websocket_link",
                    client_id = field::Empty,
                    connection_id = field::Empty
                ),
                LinkType::Remote => tracing::error_span!(
                    "remote_link",
                    client_id = field::Empty,
                    connection_id = field::Empty,
                ),
            };
            // The TLS and WebSocket handshakes run in the connection's
            // task, within the connection timeout: in the accept loop, one
            // client that stalls its handshake would stop the listener
            // (edgeway patch, see PATCHES.md).
            // The connection's set-up (handshake, CONNECT, the link's
            // creation) is a future of its own, boxed and freed once done:
            // a task is as large as its largest state for its whole life,
            // and the idle connection's state (the link's loop) is much
            // smaller than the set-up's. (edgeway patch, see PATCHES.md)
            let establish = Box::pin(async move {
                let handshake_timeout = Duration::from_millis(config.connection_timeout_ms.into());
                let handshake = async {
                    let (network, tenant_id) = tls_accept(tls.as_ref(), stream).await?;
                    let network: Box<dyn N> = match link_type {
                        #[cfg(feature = "websocket")]
                        LinkType::Websocket => Box::new(WsStream::new(
                            accept_hdr_async(network, WSCallback)
                                .await
                                .map_err(|e| Error::Accept(e.to_string()))?,
                        )),
                        LinkType::Remote => network,
                    };
                    Ok::<_, Error>((network, tenant_id))
                };
                let (network, tenant_id) = match time::timeout(handshake_timeout, handshake).await {
                    Ok(Ok(o)) => o,
                    Ok(Err(e)) => {
                        error!(error=?e, "Handshake error");
                        return None;
                    }
                    Err(_) => {
                        stats.connect_timeouts.fetch_add(1, Ordering::Relaxed);
                        return None;
                    }
                };
                info!(?name, ?addr, count, tenant=?tenant_id, "accept");
                establish(config, tenant_id, router_tx, network, protocol, will_handlers, slot).await
            });
            task::spawn(
                async move {
                    let Some(connected) = establish.await else {
                        return;
                    };
                    connected.run().await;
                }
                .instrument(span),
            );

            time::sleep(delay).await;
        }
    }
}

// Depending on TLS or not create a new Network
async fn tls_accept(
    tls: Option<&TlsConfig>,
    stream: TcpStream,
) -> Result<(Box<dyn N>, Option<String>), Error> {
    #[cfg(any(feature = "use-rustls", feature = "use-native-tls"))]
    match tls {
        Some(c) => {
            let (tenant_id, network) = TLSAcceptor::new(c)?.accept(stream).await?;
            Ok((network, tenant_id))
        }
        None => Ok((Box::new(stream), None)),
    }
    #[cfg(not(any(feature = "use-rustls", feature = "use-native-tls")))]
    {
        let _ = tls;
        Ok((Box::new(stream), None))
    }
}

/// Counters of one listener, read by the embedding program (edgeway patch,
/// see PATCHES.md).
#[derive(Debug, Default)]
pub struct ListenerStats {
    /// Sockets accepted and not closed yet, in any state.
    pub open: AtomicUsize,
    /// Of those, sockets whose CONNECT has not been read yet.
    pub awaiting_connect: AtomicUsize,
    /// Sockets closed at once because a cap of the listener was reached.
    pub refused_at_cap: AtomicU64,
    /// Sockets closed because their handshake or CONNECT did not come
    /// within the connection timeout.
    pub connect_timeouts: AtomicU64,
    /// Failed accept() calls (at the descriptor limit, for example).
    pub accept_errors: AtomicU64,
}

/// A socket counted in its listener's [`ListenerStats`] until dropped.
struct ListenerSlot {
    stats: Arc<ListenerStats>,
    awaiting_connect: bool,
}

impl ListenerSlot {
    /// `None` when a cap of the listener is reached. Only the accept loop
    /// adds, so a check and its add cannot race with another add.
    fn admit(stats: &Arc<ListenerStats>, config: &ServerSettings) -> Option<ListenerSlot> {
        let full = |n: &AtomicUsize, cap: Option<usize>| {
            cap.is_some_and(|cap| n.load(Ordering::Relaxed) >= cap)
        };
        if full(&stats.open, config.max_connections)
            || full(&stats.awaiting_connect, config.max_awaiting_connect)
        {
            return None;
        }
        stats.open.fetch_add(1, Ordering::Relaxed);
        stats.awaiting_connect.fetch_add(1, Ordering::Relaxed);
        Some(ListenerSlot {
            stats: stats.clone(),
            awaiting_connect: true,
        })
    }

    /// Its CONNECT was read.
    fn connected(&mut self) {
        if std::mem::take(&mut self.awaiting_connect) {
            self.stats.awaiting_connect.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl Drop for ListenerSlot {
    fn drop(&mut self) {
        self.connected();
        self.stats.open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Configures the Websocket connection to indicate the correct protocol
/// by adding the "sec-websocket-protocol" with value of "mqtt" to the response header
#[cfg(feature = "websocket")]
struct WSCallback;
#[cfg(feature = "websocket")]
impl Callback for WSCallback {
    fn on_request(
        self,
        _request: &Request,
        mut response: Response,
    ) -> Result<Response, ErrorResponse> {
        response
            .headers_mut()
            .insert("sec-websocket-protocol", HeaderValue::from_static("mqtt"));
        Ok(response)
    }
}

/// How long a connection the server ended is read on, at most, before its
/// socket is closed (see [`remote`]). (edgeway patch, see PATCHES.md)
const LINGER_AFTER_DISCONNECT: Duration = Duration::from_secs(1);

/// A new network connection should wait for a mqtt connect packet. This should be handled
/// asynchronously to avoid blocking other new connections while this connection is
/// waiting for mqtt connect packet. Also this honours connection wait time as per config to prevent
/// denial of service attacks (rogue clients which only establish network connections without
/// sending a mqtt connection packet to make the server reach its concurrent connection limit).
async fn establish<P: Protocol>(
    config: Arc<ConnectionSettings>,
    tenant_id: Option<String>,
    router_tx: Sender<(ConnectionId, Event)>,
    stream: Box<dyn N>,
    protocol: P,
    will_handlers: Arc<Mutex<HashMap<String, Sender<AwaitingWill>>>>,
    mut slot: ListenerSlot,
) -> Option<Connected<P>> {
    let mut network = Network::with_buffers(
        stream,
        config.max_payload_size,
        config.max_inflight_count,
        protocol,
        config.initial_buffer_bytes.unwrap_or(10 * 1024),
    );

    let dynamic_filters = config.dynamic_filters;

    let connect_packet = match mqtt_connect(config, &mut network).await {
        Ok(p) => {
            slot.connected();
            p
        }
        Err(remote::Error::Timeout(_)) => {
            slot.stats.connect_timeouts.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        Err(e) => {
            error!(error=?e, "Error while handling MQTT connect packet");
            return None;
        }
    };

    let (mut client_id, clean_session) = match &connect_packet {
        Packet::Connect(ref connect, _, _, _, _) => {
            (connect.client_id.clone(), connect.clean_session)
        }
        _ => unreachable!(),
    };

    let mut assigned_client_id = None;
    if client_id.is_empty() {
        let uuid = Uuid::new_v4().simple();
        client_id = format!("rumqtt-{uuid}");
        assigned_client_id = Some(client_id.clone());
    }

    if let Some(tenant_id) = &tenant_id {
        // client_id is set to "tenant_id.client_id"
        // this is to make sure we are consistent,
        // as Connection uses this format of client_id
        client_id = format!("{tenant_id}.{client_id}");
    }

    // (edgeway patch, see PATCHES.md) The map is taken out of its lock
    // before anything else: a panic under the lock would poison it for
    // every later connection of the listener. An entry whose connection is
    // already gone (it failed before its link started) has no receiver:
    // there is nobody to tell, which is not an error.
    let (will_tx, will_rx) = flume::bounded::<AwaitingWill>(1);
    let previous = lock_wills(&will_handlers).insert(client_id.clone(), will_tx.clone());
    if let Some(sender) = previous {
        let awaiting_will = if clean_session {
            AwaitingWill::Fire
        } else {
            AwaitingWill::Cancel
        };
        sender.try_send(awaiting_will).ok();
    }

    // Start the link
    let link = match RemoteLink::new(
        router_tx.clone(),
        tenant_id.clone(),
        network,
        connect_packet,
        dynamic_filters,
        assigned_client_id,
    )
    .await
    {
        Ok(l) => l,
        Err(e) => {
            error!(error=?e, "Remote link error");
            forget_will_handler(&will_handlers, &client_id, &will_tx);
            return None;
        }
    };
    Some(Connected {
        link,
        tenant_id,
        client_id,
        router_tx,
        will_handlers,
        will_tx,
        will_rx,
        slot,
    })
}

/// A connection whose CONNECT was accepted and whose link the router
/// has: what its task keeps while the client is connected, and after, for
/// its will. (edgeway patch, see PATCHES.md)
struct Connected<P: Protocol> {
    link: RemoteLink<P>,
    tenant_id: Option<String>,
    client_id: String,
    router_tx: Sender<(ConnectionId, Event)>,
    will_handlers: Arc<Mutex<HashMap<String, Sender<AwaitingWill>>>>,
    will_tx: Sender<AwaitingWill>,
    will_rx: flume::Receiver<AwaitingWill>,
    slot: ListenerSlot,
}

impl<P: Protocol> Connected<P> {
    /// Runs the link until the connection ends, then publishes the
    /// client's will when it is due. Not an `async fn`: its future would
    /// hold `self` twice (the argument and the binding it is moved to); the
    /// block's capture is used in place, never moved into locals.
    fn run(self) -> impl std::future::Future<Output = ()> {
        let mut this = self;
        async move {
            let connection_id = this.link.connection_id;
            let link_id = this.link.link_id();
            let will_delay_interval = this.link.will_delay_interval;
            let mut send_disconnect = true;
            let mut linger = false;

            match this.link.start().await {
                // Connection got closed. This shouldn't usually happen.
                Ok(_) => error!("connection-stop"),
                // No need to send a disconnect message when disconnection
                // originated internally in the router.
                Err(remote::Error::Link(e)) => {
                    error!(error=?e, "router-drop");
                    send_disconnect = false;
                }
                // The codec ended it (a limit, an expired credential): it logs why.
                // (edgeway patch, see PATCHES.md)
                Err(remote::Error::Network(network::Error::ClosedByCodec)) => {
                    info!("closed by the codec");
                    linger = true;
                }
                // The client sent DISCONNECT; the router has it. (edgeway patch,
                // see PATCHES.md)
                Err(remote::Error::ClientDisconnected) => {
                    info!("disconnected by the client");
                }
                // Connection was closed by peer
                Err(remote::Error::Network(network::Error::Io(err)) | remote::Error::Io(err))
                    if err.kind() == io::ErrorKind::ConnectionAborted =>
                {
                    info!(error=?err, "disconnected");
                }
                // Any other error
                Err(e) => {
                    error!(error=?e, "disconnected");
                }
            };

            if send_disconnect {
                // Not `Event::Disconnect`: the router may have dropped this link
                // already and given its connection id to a new one (a reconnect of
                // the same client id). (edgeway patch, see PATCHES.md)
                let disconnect = Event::LinkClosed(link_id);
                let message = (connection_id, disconnect);
                this.router_tx.send(message).ok();
            }

            // The server ended it (its DISCONNECT is written) while the client
            // may still be writing: read on for a while so that the socket does
            // not close with unread input, which the kernel answers with a reset
            // that fails the client's writes and can discard the DISCONNECT. The
            // router has let the link go; the listener slot (its connection cap)
            // is held until the end. (edgeway patch, see PATCHES.md)
            if linger {
                Box::pin(this.link.linger(LINGER_AFTER_DISCONNECT)).await;
            }

            // this is important to stop the connection
            drop(this.link);
            drop(this.slot);

            let publish_will = match tokio::time::timeout(
                Duration::from_secs(will_delay_interval as u64),
                this.will_rx.recv_async(),
            )
            .await
            {
                Ok(w) => w.is_ok_and(|k| k == AwaitingWill::Fire),
                Err(_) => {
                    // no need to keep the sender after timeout (unless it is a newer
                    // connection's)
                    forget_will_handler(&this.will_handlers, &this.client_id, &this.will_tx);
                    // as will delay interval has passed, publish the will message
                    true
                }
            };

            if publish_will {
                let message = Event::PublishWill((this.client_id, this.tenant_id));
                // is this connection_id really correct at this point?
                // as we have disconnected already, some other connection
                // might be using this connection ID!
                // It won't matter in this case as we don't use it
                // but might affect logs?
                this.router_tx.send((connection_id, message)).ok();
            }
        }
    }
}

/// The will handlers of a listener, even if a connection task panicked
/// while holding the lock (the map itself is always consistent: each
/// operation is a single insert or remove).
fn lock_wills(
    will_handlers: &Mutex<HashMap<String, Sender<AwaitingWill>>>,
) -> std::sync::MutexGuard<'_, HashMap<String, Sender<AwaitingWill>>> {
    will_handlers.lock().unwrap_or_else(|e| e.into_inner())
}

/// Removes the will handler of `client_id` if it is still `ours` (a newer
/// connection of the same client id may have replaced it).
fn forget_will_handler(
    will_handlers: &Mutex<HashMap<String, Sender<AwaitingWill>>>,
    client_id: &str,
    ours: &Sender<AwaitingWill>,
) {
    let mut handlers = lock_wills(will_handlers);
    if handlers.get(client_id).is_some_and(|s| s.same_channel(ours)) {
        handlers.remove(client_id);
    }
}
