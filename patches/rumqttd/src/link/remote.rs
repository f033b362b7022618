use crate::link::local::{LinkError, LinkRx, LinkTx};
use crate::link::network;
use crate::link::network::Network;
use crate::local::LinkBuilder;
use crate::protocol::{
    ConnAck, Connect, ConnectReturnCode, Login, Packet, Protocol, PubAck, PubAckReason, PubComp,
    PubCompReason, PubRec, PubRecReason, QoS,
};
use std::collections::HashSet;
use crate::router::{Event, Notification};
use crate::{ConnectionId, ConnectionSettings};

use flume::{RecvError, SendError, Sender, TrySendError};
use std::cmp::min;
use std::collections::VecDeque;
use std::io;
use std::sync::Arc;
use std::time::Duration;
use subtle::ConstantTimeEq;
use tokio::time::error::Elapsed;
use tokio::{select, time};
use tracing::{trace, Span};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("I/O")]
    Io(#[from] io::Error),
    #[error("Zero keep alive")]
    ZeroKeepAlive,
    #[error("Not connect packet")]
    NotConnectPacket(Box<Packet>),
    #[error("Network {0}")]
    Network(#[from] network::Error),
    #[error("Timeout")]
    Timeout(#[from] Elapsed),
    #[error("Channel send error")]
    Send(Box<SendError<(ConnectionId, Event)>>),
    #[error("Channel recv error")]
    Recv(#[from] RecvError),
    #[error("Got new session, disconnecting old one")]
    SessionEnd,
    #[error("Persistent session requires valid client id")]
    InvalidClientId,
    #[error("Unexpected router message")]
    NotConnectionAck,
    #[error("ConnAck error {0}")]
    ConnectionAck(String),
    #[error("Authentication error")]
    InvalidAuth,
    #[error("Channel try send error")]
    TrySend(Box<TrySendError<(ConnectionId, Event)>>),
    #[error("Link error = {0}")]
    Link(#[from] LinkError),
    /// The client sent DISCONNECT, which the router has been given (it
    /// ends the session or keeps it, by the DISCONNECT's Session Expiry).
    /// (edgeway patch, see PATCHES.md)
    #[error("Disconnected by the client")]
    ClientDisconnected,
}

// The unsent event is boxed, as in `LinkError`: inline, it made every
// future that can fail with this error that much larger. (edgeway patch,
// see PATCHES.md)
impl From<TrySendError<(ConnectionId, Event)>> for Error {
    fn from(e: TrySendError<(ConnectionId, Event)>) -> Self {
        Error::TrySend(Box::new(e))
    }
}

impl From<SendError<(ConnectionId, Event)>> for Error {
    fn from(e: SendError<(ConnectionId, Event)>) -> Self {
        Error::Send(Box::new(e))
    }
}

/// Orchestrates between Router and Network.
pub struct RemoteLink<P> {
    connect: Connect,
    pub(crate) connection_id: ConnectionId,
    network: Network<P>,
    link_tx: LinkTx,
    link_rx: LinkRx,
    notifications: VecDeque<Notification>,
    pub(crate) will_delay_interval: u32,
    /// See [`Completions`]. (edgeway patch, see PATCHES.md)
    completions: Completions,
}

/// The acknowledgements of publishes left out for the client's Maximum
/// Packet Size, given to the router for the client. The router takes
/// acknowledgements in the order it sent the publishes (and PUBCOMPs in
/// the order of its PUBRELs), so each waits until the client acknowledged
/// everything sent before it. Used only when the client set a Maximum
/// Packet Size. (edgeway patch, see PATCHES.md)
#[derive(Default)]
struct Completions {
    /// QoS 1/2 publishes written or left out, until acknowledged, in
    /// order: packet id, QoS, left out.
    publishes: VecDeque<(u16, QoS, bool)>,
    /// PUBRELs written or held back, until PUBCOMP, in order: packet id,
    /// held back.
    pubrels: VecDeque<(u16, bool)>,
    /// QoS 2 publishes left out and answered PUBREC: their PUBREL is held
    /// back and answered PUBCOMP.
    left_out: HashSet<u16>,
}

impl Completions {
    /// Takes the PUBRELs of publishes left out out of what is written.
    fn hold_pubrels(&mut self, packets: &mut VecDeque<Packet>) {
        packets.retain(|p| match p {
            Packet::PubRel(rel, _) => {
                let held = self.left_out.remove(&rel.pkid);
                self.pubrels.push_back((rel.pkid, held));
                !held
            }
            _ => true,
        });
    }

    /// The publishes of a write, in order (see `Network::writev_bounded`).
    fn written(&mut self, publishes: Vec<(QoS, u16, bool)>) {
        for (qos, pkid, left_out) in publishes {
            if qos != QoS::AtMostOnce {
                self.publishes.push_back((pkid, qos, left_out));
            }
        }
    }

    /// The client acknowledged a publish (PUBACK, PUBREC) or a PUBREL
    /// (PUBCOMP: `rel`). A client that acknowledges out of order is the
    /// router's to refuse; this only follows the expected order.
    fn acknowledged(&mut self, pkid: u16, rel: bool) {
        if !rel && self.publishes.front().is_some_and(|(id, ..)| *id == pkid) {
            self.publishes.pop_front();
        }
        if rel && self.pubrels.front().is_some_and(|(id, _)| *id == pkid) {
            self.pubrels.pop_front();
        }
    }

    /// The acknowledgements now due, in order.
    fn settle(&mut self, out: &mut Vec<Packet>) {
        loop {
            if let Some(&(pkid, qos, true)) = self.publishes.front() {
                self.publishes.pop_front();
                out.push(match qos {
                    QoS::ExactlyOnce => {
                        self.left_out.insert(pkid);
                        Packet::PubRec(
                            PubRec {
                                pkid,
                                reason: PubRecReason::Success,
                            },
                            None,
                        )
                    }
                    _ => Packet::PubAck(
                        PubAck {
                            pkid,
                            reason: PubAckReason::Success,
                        },
                        None,
                    ),
                });
                continue;
            }
            if let Some(&(pkid, true)) = self.pubrels.front() {
                self.pubrels.pop_front();
                out.push(Packet::PubComp(
                    PubComp {
                        pkid,
                        reason: PubCompReason::Success,
                    },
                    None,
                ));
                continue;
            }
            return;
        }
    }
}

impl<P> RemoteLink<P> {
    /// See [`LinkRx::link_id`].
    pub(crate) fn link_id(&self) -> u64 {
        self.link_rx.link_id()
    }
}

impl<P: Protocol> RemoteLink<P> {
    pub async fn new(
        router_tx: Sender<(ConnectionId, Event)>,
        tenant_id: Option<String>,
        mut network: Network<P>,
        connect_packet: Packet,
        dynamic_filters: bool,
        assigned_client_id: Option<String>,
    ) -> Result<RemoteLink<P>, Error> {
        let Packet::Connect(connect, props, lastwill, lastwill_props, _) = connect_packet else {
            return Err(Error::NotConnectPacket(Box::new(connect_packet)));
        };

        // Register this connection with the router. Router replys with ack which if ok will
        // start the link. Router can sometimes reject the connection (ex max connection limit)
        let client_id = assigned_client_id.as_ref().unwrap_or(&connect.client_id);
        let clean_session = connect.clean_session;

        let topic_alias_max = props.as_ref().and_then(|p| p.topic_alias_max);
        let session_expiry = props
            .as_ref()
            .and_then(|p| p.session_expiry_interval)
            .unwrap_or(0);

        // MQTT 5 (the v5 codec always gives properties): the session is
        // kept for its expiry after the connection, whatever Clean Start
        // says; 3.1.1: `None`, kept iff not clean. The client's Receive
        // Maximum bounds the QoS 1/2 publishes sent and not acknowledged.
        // (edgeway patch, see PATCHES.md)
        let session_lifetime = props.as_ref().map(|_| session_expiry);
        let receive_maximum = props.as_ref().and_then(|p| p.receive_maximum);
        network.set_max_outgoing_size(props.as_ref().and_then(|p| p.max_packet_size));

        let delay_interval = lastwill_props
            .as_ref()
            .and_then(|f| f.delay_interval)
            .unwrap_or(0);

        // The Server delays publishing the Client’s Will Message until
        // the Will Delay Interval has passed or the Session ends, whichever happens first
        let will_delay_interval = min(session_expiry, delay_interval);

        let (link_tx, link_rx, notification) = LinkBuilder::new(client_id, router_tx.clone())
            .tenant_id(tenant_id)
            .clean_session(clean_session)
            .last_will(lastwill)
            .last_will_properties(lastwill_props)
            .dynamic_filters(dynamic_filters)
            .topic_alias_max(topic_alias_max.unwrap_or(0))
            .session_expiry(session_lifetime)
            .receive_maximum(receive_maximum)
            .build()?;

        let id = link_rx.id();
        Span::current().record("connection_id", id);

        if let Some(mut packet) = notification.into() {
            if let Packet::ConnAck(_ack, props) = &mut packet {
                let mut new_props = props.clone().unwrap_or_default();
                new_props.assigned_client_identifier = assigned_client_id;
                *props = Some(new_props);
                // The router has registered the connection: if the CONNACK
                // cannot be written (the client reset the socket right after
                // CONNECT), tell it the connection is gone, or its slot is
                // never freed and `max_connections` such clients lock
                // everyone out. (edgeway patch, see PATCHES.md)
                if let Err(e) = network.write(packet).await {
                    router_tx.send((id, Event::LinkClosed(link_rx.link_id()))).ok();
                    return Err(e.into());
                }
            }
        }

        Ok(RemoteLink {
            connect,
            connection_id: id,
            network,
            link_tx,
            link_rx,
            // Grows as notifications come (edgeway patch, see PATCHES.md:
            // an idle connection reserved 100 of them, 25 KB).
            notifications: VecDeque::new(),
            will_delay_interval,
            completions: Completions::default(),
        })
    }

    /// See [`Network::linger`]. (edgeway patch, see PATCHES.md)
    pub async fn linger(&mut self, within: Duration) {
        self.network.linger(within).await
    }

    pub async fn start(&mut self) -> Result<(), Error> {
        self.network.set_keepalive(self.connect.keep_alive);
        // The codec may end the connection on its own (an expired or
        // revoked credential), without waiting for the client to send
        // something. (edgeway patch, see PATCHES.md)
        let mut ending = self
            .network
            .ending()
            .unwrap_or_else(|| Box::pin(std::future::pending()));

        // Note:
        // Shouldn't result in bounded queue deadlocks because of blocking n/w send
        loop {
            select! {
                // Every packet goes through the codec's screen; what it
                // answered itself is written after the batch, and what it
                // refused never reaches the router. (edgeway patch, see
                // PATCHES.md)
                o = self.network.read_screened() => {
                    let packet = o?;
                    let bounded = self.network.bounded();
                    let (len, disconnected) = {
                        let mut buffer = self.link_tx.buffer();
                        let read_from = buffer.len();
                        buffer.extend(packet);
                        self.network.readv(&mut buffer)?;
                        let disconnected = buffer.iter().any(|p| matches!(p, Packet::Disconnect(..)));
                        // The acknowledgements due for publishes left out
                        // for the Maximum Packet Size go after the client's
                        // own. (edgeway patch, see PATCHES.md)
                        if bounded {
                            for p in buffer.iter().skip(read_from) {
                                match p {
                                    Packet::PubAck(a, _) => self.completions.acknowledged(a.pkid, false),
                                    Packet::PubRec(r, _) => self.completions.acknowledged(r.pkid, false),
                                    Packet::PubComp(c, _) => self.completions.acknowledged(c.pkid, true),
                                    _ => {}
                                }
                            }
                            let mut completed = Vec::new();
                            self.completions.settle(&mut completed);
                            buffer.extend(completed);
                        }
                        (buffer.len(), disconnected)
                    };

                    trace!("Packets read from network, count = {}", len);
                    if len > 0 {
                        self.link_tx.notify().await?;
                    }
                    self.network.flush_answers().await?;
                    // The router ends the connection at the DISCONNECT it
                    // was just given; nothing more is read. (edgeway patch,
                    // see PATCHES.md)
                    if disconnected {
                        return Err(Error::ClientDisconnected);
                    }
                }
                // Receive from router when previous when state isn't in collision
                // due to previously received data request
                o = self.link_rx.exchange(&mut self.notifications) => {
                    o?;
                    let mut packets = VecDeque::new();
                    let mut unscheduled = false;

                    for notif in self.notifications.drain(..) {
                        if let Some(packet) = notif.into() {
                            packets.push_back(packet);
                        } else {
                            unscheduled = true;
                        }

                    }
                    // Publishes over the client's Maximum Packet Size are
                    // left out and completed as the client would have
                    // (MQTT-3.1.2-25), in order, so that the router's
                    // window moves on. (edgeway patch, see PATCHES.md)
                    let bounded = self.network.bounded();
                    if bounded {
                        self.completions.hold_pubrels(&mut packets);
                    }
                    let publishes = self.network.writev_bounded(packets).await?;
                    if bounded {
                        self.completions.written(publishes);
                        let mut completed = Vec::new();
                        self.completions.settle(&mut completed);
                        if !completed.is_empty() {
                            self.link_tx.buffer().extend(completed);
                            self.link_tx.notify().await?;
                        }
                    }
                    if unscheduled {
                        self.link_rx.wake().await?;
                    }
                }
                last = &mut ending => {
                    // Boxed: the loop's future, which an idle connection
                    // waits in, would hold a packet for this once-only
                    // write. (edgeway patch, see PATCHES.md)
                    if let Some(packet) = last {
                        Box::pin(self.network.write(packet)).await?;
                    }
                    return Err(network::Error::ClosedByCodec.into());
                }
            }
        }
    }
}

/// Read MQTT connect packet from network and verify it.
/// authentication and checks are done here.
pub async fn mqtt_connect<P>(
    config: Arc<ConnectionSettings>,
    network: &mut Network<P>,
) -> Result<Packet, Error>
where
    P: Protocol,
{
    // Wait for MQTT connect packet and error out if it's not received in time to prevent
    // DOS attacks by filling total connections that the server can handle with idle open
    // connections which results in server rejecting new connections
    let connection_timeout_ms = config.connection_timeout_ms.into();
    let packet = time::timeout(Duration::from_millis(connection_timeout_ms), async {
        let packet = network.read().await?;
        Ok::<_, network::Error>(packet)
    })
    .await??;

    let (connect, _props, login) = match packet {
        Packet::Connect(ref connect, ref props, _, _, ref login) => (connect, props, login),
        packet => return Err(Error::NotConnectPacket(Box::new(packet))),
    };

    Span::current().record("client_id", &connect.client_id);

    handle_auth(config.clone(), login.as_ref(), &connect.client_id).await?;

    // When keep_alive feature is disabled client can live forever, which is not good in
    // distributed broker context so currenlty we don't allow it.
    if connect.keep_alive == 0 {
        return Err(Error::ZeroKeepAlive);
    }

    let empty_client_id = connect.client_id.is_empty();
    let clean_session = connect.clean_session;

    if empty_client_id && !clean_session {
        let ack = ConnAck {
            session_present: false,
            code: ConnectReturnCode::ClientIdentifierNotValid,
        };

        let packet = Packet::ConnAck(ack, None);
        network.write(packet).await?;

        return Err(Error::InvalidClientId);
    }

    // Ok((connect, props, lastwill, lastwill_props))
    Ok(packet)
}

async fn handle_auth(
    config: Arc<ConnectionSettings>,
    login: Option<&Login>,
    client_id: &str,
) -> Result<(), Error> {
    if config.auth.is_none() && config.external_auth.is_none() {
        return Ok(());
    }

    // if authentication is configured and connect packet doesn't have login details
    // return an error
    let Some(login) = login else {
        return Err(Error::InvalidAuth);
    };

    let username = &login.username;
    let password = &login.password;

    if let Some(auth) = &config.external_auth {
        if !auth(
            client_id.to_owned(),
            username.to_owned(),
            password.to_owned(),
        )
        .await
        {
            return Err(Error::InvalidAuth);
        }

        return Ok(());
    }

    if let Some(pairs) = &config.auth {
        if let Some(stored_password) = pairs.get(username) {
            if stored_password.as_bytes().ct_eq(password.as_bytes()).into() {
                return Ok(());
            }
        }

        return Err(Error::InvalidAuth);
    }

    Err(Error::InvalidAuth)
}

#[cfg(test)]
mod tests {
    use std::{collections::HashMap, sync::Arc};

    use crate::{protocol::Login, ConnectionSettings};

    use super::handle_auth;

    fn config() -> ConnectionSettings {
        ConnectionSettings {
            connection_timeout_ms: 0,
            max_payload_size: 0,
            max_inflight_count: 0,
            auth: None,
            external_auth: None,
            dynamic_filters: false,
            initial_buffer_bytes: None,
        }
    }

    fn login() -> Login {
        Login {
            username: "u".to_owned(),
            password: "p".to_owned(),
        }
    }

    #[tokio::test]
    async fn no_login_no_auth() {
        let cfg = Arc::new(config());
        let r = handle_auth(cfg, None, "").await;
        assert!(r.is_ok());
    }

    #[tokio::test]
    async fn some_login_no_auth() {
        let cfg = Arc::new(config());
        let login = login();
        let r = handle_auth(cfg, Some(&login), "").await;
        assert!(r.is_ok());
    }

    #[tokio::test]
    async fn login_matches_static_auth() {
        let login = login();
        let mut map = HashMap::<String, String>::new();
        map.insert(login.username.clone(), login.password.clone());

        let mut cfg = config();
        cfg.auth = Some(map);

        let r = handle_auth(Arc::new(cfg), Some(&login), "").await;
        assert!(r.is_ok());
    }

    #[tokio::test]
    async fn login_fails_static_no_external() {
        let login = login();
        let mut map = HashMap::<String, String>::new();
        map.insert("wrong".to_owned(), "wrong".to_owned());

        let mut cfg = config();
        cfg.auth = Some(map);

        let r = handle_auth(Arc::new(cfg), Some(&login), "").await;
        assert!(r.is_err());
    }

    #[tokio::test]
    async fn login_fails_static_matches_external() {
        let login = login();

        let mut map = HashMap::<String, String>::new();
        map.insert("wrong".to_owned(), "wrong".to_owned());

        let dynamic = |_: String, _: String, _: String| async { true };

        let mut cfg = config();
        cfg.auth = Some(map);
        cfg.set_auth_handler(dynamic);

        let r = handle_auth(Arc::new(cfg), Some(&login), "").await;
        assert!(r.is_ok());
    }

    #[tokio::test]
    async fn login_fails_static_fails_external() {
        let login = login();

        let mut map = HashMap::<String, String>::new();
        map.insert("wrong".to_owned(), "wrong".to_owned());

        let dynamic = |_: String, _: String, _: String| async { false };

        let mut cfg = config();
        cfg.auth = Some(map);
        cfg.set_auth_handler(dynamic);

        let r = handle_auth(Arc::new(cfg), Some(&login), "").await;
        assert!(r.is_err());
    }

    #[tokio::test]
    async fn external_auth_clousre_or_fnptr_type_check_or_fail_compile() {
        let closure = |_: String, _: String, _: String| async { false };
        async fn fnptr(_: String, _: String, _: String) -> bool {
            true
        }

        let mut cfg = config();
        cfg.set_auth_handler(closure);
        cfg.set_auth_handler(fnptr);
    }
}
