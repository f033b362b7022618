//! `GET /v1/ws`: the WebSocket channel, for browsers and devices that
//! cannot speak MQTT. JSON text frames carry the same messages as the MQTT
//! topics (`topics/schemas`): a client sends `{"type": "request", …}` (the
//! request schema), `{"type": "cancel", "request_id"}` or
//! `{"type": "resume", "request_id", "from_seq"}`; edgeway sends each
//! request's seq'd events (`accepted`, `queued`, `delta`, `tool_call`,
//! `done`, `error`, rendered by `ingress::render`), each with its
//! `request_id`, so one socket carries several requests.
//!
//! Authenticated once, at the upgrade: the same credential as HTTP
//! (`Authorization: Bearer …`, `x-api-key`) or, for browsers, which cannot
//! set headers on a WebSocket, a subprotocol `bearer.<key>` offered next to
//! `edgeway` (the one edgeway answers with). Not in the query string: URLs
//! end up in logs. A revoked key, or one a reload removed, is refused at its
//! next request frame and the socket closed.
//!
//! A closed socket follows each request's `on_disconnect`: `cancel` (the
//! default here) cancels it; `continue` keeps it running, and a new socket
//! of the same application resumes it by `request_id` from the task's
//! retained events. A bad frame gets an `error` event (`INVALID_REQUEST`)
//! and the socket stays open. Bounded: `http.ws_max_in_flight` requests per
//! socket, messages of `http.max_body_bytes` (a bigger one closes the
//! socket, code 1009).
//!
//! Owns: the framing and the socket's requests. Does not own:
//! authentication, validation, tasks (the gateway facade), the event JSON
//! (`ingress::render`). After the upgrade a socket is no longer an HTTP
//! connection: the listener's connection cap does not count it. Instead a
//! socket is pinged every half `http.idle_timeout` and closed when nothing
//! (not even a pong) came from its client for a whole one (a dead peer, or
//! a client that stopped reading: its `cancel` requests are cancelled). At
//! shutdown, after the drain, each socket sends its requests' last events
//! and closes with 1001.

use std::collections::HashMap;
use std::sync::Arc;

use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade};
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use axum::Extension;
use futures::{SinkExt, StreamExt};
use serde_json::{Map, Value};
use tokio::sync::mpsc;
use tokio::task::{AbortHandle, JoinSet};
use tokio::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

use super::caller::Credential;
use super::errors::ApiError;
use crate::error::{ErrorCode, GatewayError};
use crate::gateway::{Caller, CancelHandle, Gateway, SubmitOptions, TaskStream};
use crate::ingress::render::{event_json, rejection_json};

use crate::task::{Identity, Ingress};

/// The subprotocol edgeway answers with when a client offers it.
const PROTOCOL: &str = "edgeway";
/// A subprotocol that carries the API key: `bearer.<key>`.
const KEY_PROTOCOL_PREFIX: &str = "bearer.";
/// Frames waiting for the socket. A client that stops reading holds its
/// requests' streams here, then back (the tasks wait, nothing is lost).
const OUTBOX: usize = 64;

/// How long a closing socket may take to send what it still owes.
const CLOSE_GRACE: Duration = Duration::from_secs(5);

/// The server's shutdown, after the drain (see `http::serve`).
#[derive(Clone)]
pub struct Shutdown(pub CancellationToken);

/// A key offered as a subprotocol.
fn protocol_key(headers: &HeaderMap) -> Option<String> {
    let offered = headers.get("sec-websocket-protocol")?.to_str().ok()?;
    offered.split(',').map(str::trim).find_map(|p| p.strip_prefix(KEY_PROTOCOL_PREFIX)).map(str::to_string)
}

pub async fn upgrade(
    State(gw): State<Arc<Gateway>>,
    Extension(Shutdown(shutdown)): Extension<Shutdown>,
    Credential(cred): Credential,
    headers: HeaderMap,
    ws: WebSocketUpgrade,
) -> Result<Response, ApiError> {
    let cred = cred.or_else(|| protocol_key(&headers));
    let identity = gw
        .authenticate_with(cred.as_deref(), &super::caller::request_headers(&headers))
        .map_err(|e| gw.refused(Ingress::Ws, e))?;
    let max = gw.config().http.max_body_bytes;
    // An API key (not a JWT, whose id digest names no key): checked again
    // at each request frame against the keys in force.
    let from_key = identity.credential.is_some_and(|d| gw.key_owner(&d).is_some());
    Ok(ws
        .protocols([PROTOCOL])
        .max_message_size(max)
        .max_frame_size(max)
        .on_upgrade(move |socket| Socket::new(gw, identity, from_key).run(socket, shutdown)))
}

/// What happens to a request when its socket closes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum OnDisconnect {
    Cancel,
    Continue,
}

/// A request this socket is sending the events of.
struct Flight {
    /// Tells a replaced forwarder's end from its replacement's.
    no: u64,
    abort: AbortHandle,
    cancel: CancelHandle,
    on_disconnect: OnDisconnect,
}

struct Socket {
    gw: Arc<Gateway>,
    identity: Identity,
    /// The socket was opened with an API key (see `upgrade`).
    from_key: bool,
    flights: HashMap<String, Flight>,
    forwarders: JoinSet<(String, u64)>,
    next_no: u64,
    out: mpsc::Sender<Message>,
    outbox: Option<mpsc::Receiver<Message>>,
}

fn text(v: &Value) -> Message {
    Message::Text(v.to_string().into())
}

/// A request id as the topic schemas allow it.
fn valid_id(s: &str) -> bool {
    (1..=128).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"._:-".contains(&b))
}

impl Socket {
    fn new(gw: Arc<Gateway>, identity: Identity, from_key: bool) -> Socket {
        let (out, outbox) = mpsc::channel(OUTBOX);
        Socket {
            gw,
            identity,
            from_key,
            flights: HashMap::new(),
            forwarders: JoinSet::new(),
            next_no: 0,
            out,
            outbox: Some(outbox),
        }
    }

    async fn run(mut self, socket: WebSocket, shutdown: CancellationToken) {
        let (mut sink, mut frames) = socket.split();
        let mut outbox = self.outbox.take().expect("run once");
        let writer = tokio::spawn(async move {
            while let Some(m) = outbox.recv().await {
                if sink.send(m).await.is_err() {
                    break;
                }
            }
            let _ = sink.close().await;
        });
        let idle = self.gw.config().http.idle_timeout;
        let mut ping = tokio::time::interval(idle / 2);
        ping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut heard = Instant::now();
        // Set at shutdown: the socket ends once its streams have.
        let mut closing: Option<Instant> = None;
        let mut close = None;
        loop {
            if closing.is_some() && self.forwarders.is_empty() {
                close = Some((1001, "edgeway is shutting down"));
                break;
            }
            tokio::select! {
                frame = frames.next(), if closing.is_none() => {
                    heard = Instant::now();
                    match frame {
                    Some(Ok(Message::Text(t))) => {
                        if !self.frame(t.as_str()).await {
                            break;
                        }
                    }
                    Some(Ok(Message::Binary(_))) => {
                        self.send(rejection_json(None, &GatewayError::invalid("frames are JSON text, not binary"))).await;
                    }
                    // tungstenite answers pings itself.
                    Some(Ok(Message::Ping(_) | Message::Pong(_))) => {}
                    Some(Ok(Message::Close(_))) | Some(Err(_)) | None => break,
                    }
                },
                _ = ping.tick() => {
                    if heard.elapsed() >= idle {
                        close = Some((1001, "nothing heard from the client within http.idle_timeout"));
                        break;
                    }
                    // Never waits: a full outbox already means a silent client.
                    let _ = self.out.try_send(Message::Ping(Default::default()));
                }
                _ = shutdown.cancelled(), if closing.is_none() => closing = Some(Instant::now() + CLOSE_GRACE),
                _ = tokio::time::sleep_until(closing.unwrap_or_else(Instant::now)), if closing.is_some() => {
                    close = Some((1001, "edgeway is shutting down"));
                    break;
                }
                Some(done) = self.forwarders.join_next(), if !self.forwarders.is_empty() => {
                    if let Ok((rid, no)) = done {
                        if self.flights.get(&rid).is_some_and(|f| f.no == no) {
                            self.flights.remove(&rid);
                        }
                    }
                }
            }
        }
        self.closed();
        if let Some((code, reason)) = close {
            let _ = self.out.try_send(Message::Close(Some(CloseFrame { code, reason: reason.into() })));
        }
        drop(self.out);
        // A client that stopped reading would hold the writer for ever.
        let abort = writer.abort_handle();
        if tokio::time::timeout(CLOSE_GRACE, writer).await.is_err() {
            abort.abort();
        }
    }

    /// The socket is gone: each request follows its `on_disconnect`.
    fn closed(&mut self) {
        for (_, f) in self.flights.drain() {
            if f.on_disconnect == OnDisconnect::Cancel {
                f.cancel.cancel("websocket closed (on_disconnect = cancel)", "client");
            }
            // A `continue` stream is detached: dropping it leaves the task.
            f.abort.abort();
        }
    }

    /// An answer to a frame. Never waits, so a client that stopped reading
    /// cannot stall the socket's loop (the idle check closes it); with the
    /// outbox full the answer is dropped.
    async fn send(&self, v: Value) {
        let _ = self.out.try_send(text(&v));
    }

    /// Handles one client frame; `false` closes the socket.
    async fn frame(&mut self, t: &str) -> bool {
        let Ok(Value::Object(mut m)) = serde_json::from_str::<Value>(t) else {
            self.send(rejection_json(None, &GatewayError::invalid("a frame is one JSON object"))).await;
            return true;
        };
        let rid = m.get("request_id").and_then(Value::as_str).filter(|r| valid_id(r)).map(str::to_string);
        let kind = m.remove("type");
        let Some(rid) = rid else {
            let e = GatewayError::invalid("'request_id' is required: 1 to 128 of A-Z a-z 0-9 . _ : -");
            self.send(rejection_json(None, &e)).await;
            return true;
        };
        match kind.as_ref().and_then(Value::as_str) {
            Some("request") => return self.request(rid, m).await,
            Some("cancel") => self.cancel(&rid),
            Some("resume") => self.resume(rid, m.get("from_seq").and_then(Value::as_u64)).await,
            _ => {
                let e = GatewayError::invalid("'type' must be \"request\", \"cancel\" or \"resume\"");
                self.send(rejection_json(Some(&rid), &e)).await;
            }
        }
        true
    }

    async fn request(&mut self, rid: String, body: Map<String, Value>) -> bool {
        if self.identity.credential.is_some_and(|d| self.gw.credential_revoked(&d)) {
            let e = GatewayError::new(ErrorCode::AuthFailed, "the API key of this socket was revoked");
            self.send(rejection_json(Some(&rid), &self.gw.refused(Ingress::Ws, e))).await;
            return false;
        }
        // A key a reload removed (or gave to another application) no
        // longer holds for the socket it opened.
        if self.from_key
            && self.identity.credential.and_then(|d| self.gw.key_owner(&d))
                != Some((self.identity.tenant.clone(), self.identity.application.clone()))
        {
            let e = GatewayError::new(ErrorCode::AuthFailed, "the API key of this socket is no longer configured");
            self.send(rejection_json(Some(&rid), &self.gw.refused(Ingress::Ws, e))).await;
            return false;
        }
        if self.flights.contains_key(&rid) {
            let e = GatewayError::invalid(format!("request '{rid}' is already in flight on this socket"));
            self.send(rejection_json(Some(&rid), &e)).await;
            return true;
        }
        if self.flights.len() >= self.gw.config().http.ws_max_in_flight {
            let e = GatewayError::new(
                ErrorCode::RateLimited,
                format!("{} requests in flight on this socket (http.ws_max_in_flight)", self.flights.len()),
            );
            self.send(rejection_json(Some(&rid), &self.gw.refused(Ingress::Ws, e))).await;
            return true;
        }
        match self.submit(body).await {
            Ok((mut task, on_disconnect)) => {
                if on_disconnect == OnDisconnect::Continue {
                    task.detach();
                }
                self.forward(rid, task, on_disconnect);
            }
            Err(e) => self.send(rejection_json(Some(&rid), &e)).await,
        }
        true
    }

    async fn submit(&self, body: Map<String, Value>) -> Result<(TaskStream, OnDisconnect), GatewayError> {
        let gw = &self.gw;
        let bytes = serde_json::to_vec(&body).map_err(|e| GatewayError::internal(e.to_string()))?;
        let caller = Caller::Identity(self.identity.clone());
        let mut call = gw.prepare(caller, &bytes, Ingress::Ws, SubmitOptions::default())?;
        let on_disconnect = match call.body_mut().extra.remove("on_disconnect") {
            None | Some(Value::Null) => OnDisconnect::Cancel,
            Some(v) if v == "cancel" => OnDisconnect::Cancel,
            Some(v) if v == "continue" => OnDisconnect::Continue,
            Some(_) => {
                let e = GatewayError::invalid("'on_disconnect' must be \"continue\" or \"cancel\"");
                return Err(gw.refused(Ingress::Ws, e));
            }
        };
        Ok((gw.submit_call(call).await?, on_disconnect))
    }

    /// Sends `task`'s events as they come, in place of any stream of the
    /// same request this socket was sending.
    fn forward(&mut self, rid: String, mut task: TaskStream, on_disconnect: OnDisconnect) {
        if let Some(old) = self.flights.remove(&rid) {
            old.abort.abort();
        }
        self.next_no += 1;
        let no = self.next_no;
        let cancel = task.cancel_handle();
        let out = self.out.clone();
        let id = rid.clone();
        let abort = self.forwarders.spawn(async move {
            while let Some((seq, ev)) = task.recv().await {
                if out.send(text(&event_json(seq, &id, &task.trace_id, &ev))).await.is_err() {
                    break;
                }
            }
            (id, no)
        });
        self.flights.insert(rid, Flight { no, abort, cancel, on_disconnect });
    }

    /// Cancels a request of this socket, or one of the application's that
    /// another (closed) socket left running. Unknown or finished requests
    /// are ignored, as on MQTT.
    fn cancel(&mut self, rid: &str) {
        match self.flights.get(rid) {
            Some(f) => f.cancel.cancel("cancelled by the client", "client"),
            None => {
                let _ = self.gw.cancel_request(&self.identity, Ingress::Ws, rid, "cancelled by the client");
            }
        }
    }

    /// Sends a request's events again from `from_seq` (its retained log),
    /// then the live tail. An error event (`seq` = `from_seq`) when it
    /// cannot.
    async fn resume(&mut self, rid: String, from: Option<u64>) {
        let Some(from) = from else {
            let e = GatewayError::invalid("a resume is {\"type\": \"resume\", \"request_id\": …, \"from_seq\": n}");
            return self.send(rejection_json(Some(&rid), &e)).await;
        };
        let stream = self.gw.find_request(&self.identity, Ingress::Ws, &rid).and_then(|t| self.gw.attach(&t, from));
        match stream {
            // Attached streams never cancel their task when dropped.
            Some(task) => self.forward(rid, task, OnDisconnect::Continue),
            None => {
                let e = GatewayError::invalid(format!(
                    "cannot resume '{rid}' from seq {from}: unknown request, or its events are no longer kept"
                ));
                let mut v = rejection_json(Some(&rid), &e);
                v["seq"] = from.into();
                self.send(v).await;
            }
        }
    }
}
