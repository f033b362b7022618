//! What edgeway does with the messages devices publish to it: requests,
//! cancels and resumes, and what happens to a device's tasks when it
//! drops.
//!
//! A request goes through the [`Gateway`] facade like every other ingress (the
//! idempotency key is derived from the device's mount and its `request_id`,
//! in a key space no other ingress may use, so a repeat never starts a
//! second inference, two devices never share a task and no HTTP or NATS
//! caller can claim a device's key); its events go to the device through a
//! [`streams::MqttStream`].
//!
//! Devices are known by their *mount*, `{tenant}/{device}`
//! ([`super::topics::mount_name`]): sessions, streams and resumes are per
//! tenant.
//!
//! **One device does not slow the others**: edgeway's link only sorts
//! messages into per-device inboxes ([`DeviceIngress::dispatch`], no await,
//! so the reader keeps up with the router's log); each inbox is worked by a
//! task of its own, in order (a cancel after its request). A device with
//! [`DEVICE_INBOX`] requests and resumes waiting (or
//! [`DEVICE_INBOX_REQUESTS_OF_BYTES`] × `max_request_bytes` of payload) gets
//! `RATE_LIMITED` for more; cancels are always taken, up to
//! [`DEVICE_INBOX_HARD`] messages.
//! Resumes (and repeats of a request, which send its stream again from the
//! start) are paid for from a per-device byte budget (see
//! [`ResumeBudget`]), so a small message cannot replay megabytes over and
//! over.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use bytes::Bytes;
use rumqttd::protocol::PublishProperties;
use serde_json::Value;
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::codec::EXPIRES_AT_PROPERTY;
use super::presence::Presence;
use super::streams::{self, Coalesce, Destination, OnDisconnect, Streams};
use super::topics::{device_of_mount, Inbound, Topics};
use super::{MqttMetrics, Publisher};
use crate::config::mqtt::{MAX_CHUNK_BYTES, MAX_COALESCE_MS};
use crate::config::{DeviceConfig, MqttConfig};
use crate::error::{ErrorCode, GatewayError};
use crate::gateway::{Caller, Gateway, RequestTimeouts, SubmitOptions, DEVICE_KEY_PREFIX};
use crate::ingress::render::rejection_json;
use crate::task::{Identity, Ingress};

/// A device as the ingress knows it: who it is and whether it is online.
struct Device {
    identity: Identity,
    /// Connections that are open now, with their client ids (a device may
    /// have several instances; a takeover briefly has two of one id).
    live: Vec<(u64, String)>,
    /// Counts connects. Senders and disconnect timers remember the epoch
    /// they started in, so a late event never stops what a newer
    /// connection started.
    epoch: u64,
    /// The epoch of the last connect that ended what the device was being
    /// sent: a takeover, or a connect while it had no connection (another
    /// instance connecting beside a live one is neither). Shared with the
    /// device's senders, which read it before every message.
    came_back: Arc<AtomicU64>,
    resumes: ResumeBudget,
}

/// What a device's resumes may replay: a token bucket of bytes, full at
/// `capacity` (one whole kept stream, `stream_replay_max_bytes`), refilled
/// at `resume_replay_bytes_per_s`. A resume costs the bytes it replays, at
/// least [`RESUME_MIN_COST`]; one the bucket cannot pay is refused with
/// `RATE_LIMITED` and the time to wait.
#[derive(Debug, Clone, Copy)]
pub struct ResumeBudget {
    tokens: f64,
    at: Instant,
}

/// The least a resume costs, in bytes (a resume of nothing is not free).
pub const RESUME_MIN_COST: usize = 512;

impl ResumeBudget {
    fn full(capacity: usize) -> ResumeBudget {
        ResumeBudget { tokens: capacity as f64, at: Instant::now() }
    }

    /// Takes `cost` bytes, or says how many ms until it could.
    fn take(&mut self, cost: usize, capacity: usize, per_s: usize, now: Instant) -> Result<(), u64> {
        let refill = now.saturating_duration_since(self.at).as_secs_f64() * per_s as f64;
        self.tokens = (self.tokens + refill).min(capacity as f64);
        self.at = now;
        // Not `clamp`: it panics for a capacity under the minimum, and this
        // runs under the sessions' lock.
        let cost = cost.max(RESUME_MIN_COST).min(capacity) as f64;
        if self.tokens >= cost {
            self.tokens -= cost;
            Ok(())
        } else {
            Err(((cost - self.tokens) / per_s.max(1) as f64 * 1000.0).ceil() as u64)
        }
    }
}

/// What a connect or disconnect changed, for the ingress.
#[derive(Debug, Clone)]
pub enum Change {
    /// A client id connected while its previous connection was still open
    /// (the device reconnected before the broker noticed the old one died).
    Takeover {
        device: String,
        epoch: u64,
    },
    /// The device's last connection ended.
    Offline {
        device: String,
        epoch: u64,
    },
    Other,
}

/// Devices seen since start, by mount. Updated by the codec at CONNECT
/// (before the router sees anything from the connection) and when a
/// connection ends.
pub struct Sessions {
    devices: Mutex<HashMap<String, Device>>,
    /// Resume budget: capacity (bytes) and refill (bytes per second).
    resume_capacity: usize,
    resume_per_s: usize,
}

impl Sessions {
    pub fn new(resume_capacity: usize, resume_per_s: usize) -> Sessions {
        Sessions { devices: Mutex::new(HashMap::new()), resume_capacity, resume_per_s }
    }

    /// Charges a resume of `bytes` to the device's budget; `Err(ms)` to
    /// wait when it cannot pay.
    pub fn charge_resume(&self, device: &str, bytes: usize) -> Result<(), u64> {
        let mut g = self.devices.lock().expect("sessions");
        let Some(d) = g.get_mut(device) else { return Ok(()) };
        d.resumes.take(bytes, self.resume_capacity, self.resume_per_s, Instant::now())
    }

    pub fn apply(&self, p: &Presence) -> Change {
        let mut g = self.devices.lock().expect("sessions");
        match p {
            Presence::Connected { device, client_id, conn, identity } => {
                let capacity = self.resume_capacity;
                let d = g.entry(device.clone()).or_insert_with(|| Device {
                    identity: identity.clone(),
                    live: Vec::new(),
                    epoch: 0,
                    came_back: Arc::default(),
                    resumes: ResumeBudget::full(capacity),
                });
                d.identity = identity.clone();
                let takeover = d.live.iter().any(|(_, c)| c == client_id);
                let returning = takeover || d.live.is_empty();
                d.live.push((*conn, client_id.clone()));
                d.epoch += 1;
                if returning {
                    d.came_back.store(d.epoch, Ordering::Release);
                }
                if takeover {
                    Change::Takeover { device: device.clone(), epoch: d.epoch }
                } else {
                    Change::Other
                }
            }
            Presence::Disconnected { device, conn } => match g.get_mut(device) {
                Some(d) => {
                    let before = d.live.len();
                    d.live.retain(|(c, _)| c != conn);
                    if before > 0 && d.live.is_empty() {
                        Change::Offline { device: device.clone(), epoch: d.epoch }
                    } else {
                        Change::Other
                    }
                }
                None => Change::Other,
            },
        }
    }

    pub fn identity(&self, device: &str) -> Option<Identity> {
        self.devices.lock().expect("sessions").get(device).map(|d| d.identity.clone())
    }

    /// The epoch of the device's last connect that ended what it was being
    /// sent (a takeover, or a connect while it had no connection; 0: none),
    /// as it changes: what a sender reads without taking this lock. A
    /// device not seen yet gets a value of its own that stays 0.
    pub fn came_back(&self, device: &str) -> Arc<AtomicU64> {
        self.devices.lock().expect("sessions").get(device).map(|d| d.came_back.clone()).unwrap_or_default()
    }

    /// (online, epoch)
    pub fn state(&self, device: &str) -> (bool, u64) {
        let g = self.devices.lock().expect("sessions");
        g.get(device).map(|d| (!d.live.is_empty(), d.epoch)).unwrap_or((false, 0))
    }

    /// A device of an external broker (`mode = "external"`), where
    /// edgeway sees no connections: known with `identity` and counted as
    /// connected for good (its `on_disconnect` never applies), so the
    /// ingress serves it like a connected device.
    pub fn attach_external(&self, device: &str, identity: Identity) {
        let mut g = self.devices.lock().expect("sessions");
        let capacity = self.resume_capacity;
        let d = g.entry(device.to_string()).or_insert_with(|| Device {
            identity: identity.clone(),
            live: vec![(0, String::new())],
            epoch: 1,
            came_back: Arc::default(),
            resumes: ResumeBudget::full(capacity),
        });
        d.identity = identity;
    }

    pub fn online_count(&self) -> usize {
        self.devices.lock().expect("sessions").values().filter(|d| !d.live.is_empty()).count()
    }
}

/// Requests and resumes that may wait in one device's inbox; more are
/// answered `RATE_LIMITED` at once.
pub const DEVICE_INBOX: usize = 64;
/// Messages of any kind (cancels included) that may wait in one device's
/// inbox; more are dropped and counted.
pub const DEVICE_INBOX_HARD: usize = 1024;
/// Payload bytes that may wait in one device's inbox, in units of
/// `max_request_bytes`; more are answered `RATE_LIMITED`.
pub const DEVICE_INBOX_REQUESTS_OF_BYTES: usize = 4;
/// The largest cancel taken (`{"request_id": …}` is far smaller); bigger
/// ones are dropped unread.
pub const MAX_CANCEL_BYTES: usize = 4096;

/// One message for a device's inbox.
pub struct Message {
    kind: Inbound,
    payload: Bytes,
    props: Option<PublishProperties>,
}

/// What waits in a device's inbox: messages, of those the requests and
/// resumes, and their payload bytes.
#[derive(Default)]
struct Waiting {
    all: AtomicUsize,
    work: AtomicUsize,
    bytes: AtomicUsize,
}

impl Waiting {
    fn add(&self, m: &Message, sign: bool) {
        let op = |a: &AtomicUsize, n: usize| {
            if sign {
                a.fetch_add(n, Ordering::SeqCst)
            } else {
                a.fetch_sub(n, Ordering::SeqCst)
            }
        };
        op(&self.all, 1);
        op(&self.bytes, m.payload.len());
        if m.kind != Inbound::Cancel {
            op(&self.work, 1);
        }
    }
}

/// A device's inbox: its messages in order, and what waits.
struct Inbox {
    tx: mpsc::UnboundedSender<Message>,
    waiting: Arc<Waiting>,
}

/// Removes a device's inbox entry when its worker ends, if it is still
/// that worker's (the same `waiting`).
struct InboxGuard<'a> {
    inboxes: &'a Mutex<HashMap<String, Inbox>>,
    device: &'a str,
    waiting: &'a Arc<Waiting>,
}

impl Drop for InboxGuard<'_> {
    fn drop(&mut self) {
        let mut g = self.inboxes.lock().unwrap_or_else(PoisonError::into_inner);
        if g.get(self.device).is_some_and(|i| Arc::ptr_eq(&i.waiting, self.waiting)) {
            g.remove(self.device);
        }
    }
}

/// The MQTT ingress behind edgeway's link to the broker.
pub struct DeviceIngress {
    pub gw: Arc<Gateway>,
    pub cfg: MqttConfig,
    pub topics: Topics,
    pub out: Arc<Publisher>,
    pub streams: Arc<Streams>,
    pub sessions: Arc<Sessions>,
    pub metrics: MqttMetrics,
    pub tracker: TaskTracker,
    pub shutdown: CancellationToken,
    /// Inboxes of the devices with messages waiting, by mount.
    inboxes: Mutex<HashMap<String, Inbox>>,
}

/// The idempotency key of a device's request: unique per device and tenant
/// (`mount`), so two devices of one application never join each other's
/// tasks, and in the key space only the MQTT ingress may use
/// ([`DEVICE_KEY_PREFIX`]), so no other caller can take it first.
fn device_key(mount: &str, key: &str) -> String {
    format!("{DEVICE_KEY_PREFIX}{}", device_key_digest(mount, key))
}

/// [`device_key`] of a key the device sent itself
/// ([`crate::task::DEVICE_OWN_KEY_PREFIX`]).
fn device_own_key(mount: &str, key: &str) -> String {
    format!("{}{}", crate::task::DEVICE_OWN_KEY_PREFIX, device_key_digest(mount, key))
}

fn device_key_digest(mount: &str, key: &str) -> String {
    let mut h = Sha256::new();
    h.update(mount.as_bytes());
    h.update([0]);
    h.update(key.as_bytes());
    hex::encode(h.finalize())[..40].to_string()
}

/// A resume (or a repeat sent again from the start) the device's resume
/// budget cannot pay now.
fn resumed_too_much(wait_ms: u64) -> GatewayError {
    GatewayError::new(
        ErrorCode::RateLimited,
        format!("this device replayed too much at once; resume or repeat again in {wait_ms} ms"),
    )
    .with_retry_after(wait_ms)
}

fn valid_id(s: &str) -> bool {
    (1..=128).contains(&s.len()) && s.chars().all(|c| c.is_ascii_alphanumeric() || "-_.:".contains(c))
}

/// The `request_id` of a payload that is not a valid request, if one can
/// be read at all.
fn salvage_request_id(payload: &[u8]) -> Option<String> {
    if let Ok(v) = serde_json::from_slice::<Value>(payload) {
        return v.get("request_id").and_then(Value::as_str).filter(|s| valid_id(s)).map(str::to_string);
    }
    scan_request_id(payload)
}

/// `"request_id": "…"` found in the text of a payload, without parsing it
/// (cut off, not JSON, or no time to parse it).
fn scan_request_id(payload: &[u8]) -> Option<String> {
    let text = String::from_utf8_lossy(&payload[..payload.len().min(64 * 1024)]);
    let at = text.find("\"request_id\"")?;
    let rest = text[at + 12..].trim_start().strip_prefix(':')?.trim_start().strip_prefix('"')?;
    let id = &rest[..rest.find('"')?];
    valid_id(id).then(|| id.to_string())
}

fn user_property<'a>(props: &'a Option<PublishProperties>, key: &str) -> Option<&'a str> {
    props.as_ref()?.user_properties.iter().rev().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
}

/// The MQTT-only fields of a request (ignored by the other ingresses).
struct MqttFields {
    on_disconnect: OnDisconnect,
    /// Unix ms after which the request must not start.
    expires_at: Option<i64>,
    coalesce: Coalesce,
    /// `"compact": true`, or the device's `compact` when the request does
    /// not say.
    compact: bool,
}

/// Reads the MQTT-only fields; what a request leaves out comes from its
/// device's `[devices.ID]` section (`device`), then from `[mqtt]`.
fn mqtt_fields(
    extra: &serde_json::Map<String, Value>,
    cfg: &MqttConfig,
    device: Option<&DeviceConfig>,
) -> Result<MqttFields, GatewayError> {
    let on_disconnect = match extra.get("on_disconnect") {
        None | Some(Value::Null) => OnDisconnect::Continue,
        Some(Value::String(s)) if s == "continue" => OnDisconnect::Continue,
        Some(Value::String(s)) if s == "cancel" => OnDisconnect::Cancel,
        Some(_) => return Err(GatewayError::invalid("'on_disconnect' must be \"continue\" or \"cancel\"")),
    };
    let expires_at = match extra.get("expires_at") {
        None | Some(Value::Null) => None,
        Some(v) => Some(
            v.as_i64()
                .filter(|t| *t >= 0)
                .ok_or_else(|| GatewayError::invalid("'expires_at' must be unix time in milliseconds"))?,
        ),
    };
    let period = match extra.get("coalesce_ms") {
        None | Some(Value::Null) => device.and_then(|d| d.coalesce).unwrap_or(cfg.coalesce),
        Some(v) => std::time::Duration::from_millis(
            v.as_u64()
                .filter(|ms| *ms <= MAX_COALESCE_MS)
                .ok_or_else(|| GatewayError::invalid(format!("'coalesce_ms' must be 0..{MAX_COALESCE_MS}")))?,
        ),
    };
    let max_bytes = match extra.get("max_chunk_bytes") {
        None | Some(Value::Null) => device.and_then(|d| d.max_chunk_bytes).unwrap_or(cfg.max_chunk_bytes),
        Some(v) => v
            .as_u64()
            .filter(|b| (1..=MAX_CHUNK_BYTES as u64).contains(b))
            .ok_or_else(|| GatewayError::invalid(format!("'max_chunk_bytes' must be 1..{MAX_CHUNK_BYTES}")))?
            as usize,
    };
    let compact = match extra.get("compact") {
        None | Some(Value::Null) => device.is_some_and(|d| d.compact),
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(GatewayError::invalid("'compact' must be true or false")),
    };
    Ok(MqttFields { on_disconnect, expires_at, coalesce: Coalesce { period, max_bytes }, compact })
}

/// In the methods below, `device` is the device's mount
/// (`{tenant}/{device}`), as the router and the sessions know it.
impl DeviceIngress {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        gw: Arc<Gateway>,
        cfg: MqttConfig,
        topics: Topics,
        out: Arc<Publisher>,
        streams: Arc<Streams>,
        sessions: Arc<Sessions>,
        metrics: MqttMetrics,
        tracker: TaskTracker,
        shutdown: CancellationToken,
    ) -> DeviceIngress {
        DeviceIngress {
            gw,
            cfg,
            topics,
            out,
            streams,
            sessions,
            metrics,
            tracker,
            shutdown,
            inboxes: Mutex::new(HashMap::new()),
        }
    }

    /// Starts sending `stream` to `device` from `from_seq`, as of the
    /// device's connections of `epoch` ([`streams::start_sender`]).
    fn start_sender(&self, device: &str, stream: &Arc<streams::MqttStream>, from_seq: u64, epoch: u64) {
        let came_back = self.sessions.came_back(device);
        streams::start_sender(stream, from_seq, epoch, self.out.clone(), came_back, &self.tracker, &self.shutdown);
    }

    /// Router topic and correlation data of the answers to a message from
    /// `device`: the MQTT 5 response topic when it is inside the device's
    /// namespace, else `{prefix}/{device}/res/{request_id}`.
    fn destination(
        &self,
        device: &str,
        request_id: Option<&str>,
        props: &Option<PublishProperties>,
    ) -> Option<Destination> {
        let id = device_of_mount(device);
        let correlation = props.as_ref().and_then(|p| p.correlation_data.clone());
        let asked = props.as_ref().and_then(|p| p.response_topic.as_deref());
        let topic = match (asked, request_id) {
            (Some(t), _) if self.topics.valid_response_topic(id, t) => t.to_string(),
            (_, Some(rid)) => self.topics.response(id, rid),
            _ => return None,
        };
        Some(Destination { topic: self.topics.internal(device, &topic), correlation })
    }

    fn publish_to(&self, dest: &Destination, payload: Value) {
        let props = dest.correlation.as_ref().map(|c| PublishProperties {
            correlation_data: Some(c.clone()),
            content_type: Some("application/json".into()),
            ..Default::default()
        });
        let _ = self.out.publish(&dest.topic, Bytes::from(payload.to_string()), props, false);
    }

    /// Refuses a message for a reason of the MQTT ingress's own (before the
    /// gateway saw it): counted by the facade, then answered.
    fn refuse(&self, device: &str, rid: Option<&str>, props: &Option<PublishProperties>, seq: u64, e: GatewayError) {
        let e = self.gw.refused(Ingress::Mqtt, e);
        self.reject(device, rid, props, seq, &e);
    }

    /// Answers a request that never became a task (or a resume that cannot
    /// be served) with one `error` message. Does not count the call: the
    /// gateway counted what it refused, [`Self::refuse`] the rest.
    fn reject(&self, device: &str, rid: Option<&str>, props: &Option<PublishProperties>, seq: u64, e: &GatewayError) {
        self.metrics.rejected.with_label_values(&[e.code.as_str()]).inc();
        match self.destination(device, rid, props) {
            Some(dest) => {
                let mut v = rejection_json(rid, e);
                v["seq"] = seq.into();
                self.publish_to(&dest, v);
            }
            None => tracing::info!(device, code = e.code.as_str(), "MQTT message refused; no request id to answer"),
        }
    }

    /// One message from edgeway's link, put in its device's inbox. Never
    /// waits: the link's reader must keep up with the router's log.
    pub fn dispatch(self: &Arc<Self>, topic: &str, payload: Bytes, props: Option<PublishProperties>) {
        let Some((device, kind)) = self.topics.parse_inbound(topic) else { return };
        self.dispatch_to(device, kind, payload, props)
    }

    /// A message of the device mounted at `device`, put in its inbox.
    pub fn dispatch_to(
        self: &Arc<Self>,
        device: &str,
        kind: Inbound,
        payload: Bytes,
        props: Option<PublishProperties>,
    ) {
        if kind == Inbound::Cancel && payload.len() > MAX_CANCEL_BYTES {
            self.metrics.overflow.inc();
            tracing::info!(device, bytes = payload.len(), "MQTT: an oversized cancel dropped unread");
            return;
        }
        let m = Message { kind, payload, props };
        let mut g = self.inboxes.lock().unwrap_or_else(PoisonError::into_inner);
        let inbox = g.entry(device.to_string()).or_insert_with(|| self.start_inbox(device));
        let w = &inbox.waiting;
        let all = w.all.load(Ordering::SeqCst);
        let full_of_work = w.work.load(Ordering::SeqCst) >= DEVICE_INBOX
            || w.bytes.load(Ordering::SeqCst) + m.payload.len()
                > DEVICE_INBOX_REQUESTS_OF_BYTES * self.cfg.max_request_bytes;
        if all >= DEVICE_INBOX_HARD || (m.kind != Inbound::Cancel && full_of_work) {
            drop(g);
            self.metrics.overflow.inc();
            if m.kind == Inbound::Cancel || all >= DEVICE_INBOX_HARD {
                tracing::warn!(device, "MQTT: a device's inbox is full; message dropped");
                return;
            }
            let label = if m.kind == Inbound::Request { "req" } else { "resume" };
            self.metrics.inbound.with_label_values(&[label]).inc();
            let e = GatewayError::new(
                ErrorCode::RateLimited,
                "this device has too many messages waiting to be handled; send fewer at once",
            )
            .with_retry_after(1000);
            // No time to parse the payload here.
            return self.refuse(device, scan_request_id(&m.payload).as_deref(), &m.props, 0, e);
        }
        w.add(&m, true);
        // The receiver lives until the entry is removed (under this lock),
        // also when its worker dies ([`InboxGuard`]); should it be gone
        // anyway, a fresh worker takes the message.
        if let Err(mpsc::error::SendError(m)) = inbox.tx.send(m) {
            w.add(&m, false);
            tracing::error!(device, "MQTT: a device's inbox had no worker; a new one is started");
            let fresh = self.start_inbox(device);
            fresh.waiting.add(&m, true);
            let _ = fresh.tx.send(m);
            g.insert(device.to_string(), fresh);
        }
    }

    /// A new inbox for `device` and its worker.
    fn start_inbox(self: &Arc<Self>, device: &str) -> Inbox {
        let (tx, rx) = mpsc::unbounded_channel();
        let inbox = Inbox { tx, waiting: Arc::new(Waiting::default()) };
        self.tracker.spawn(self.clone().work_inbox(device.to_string(), rx, inbox.waiting.clone()));
        inbox
    }

    /// Handles a device's messages in order, then leaves once its inbox is
    /// empty (checked under the inboxes' lock, so no message is left behind).
    async fn work_inbox(
        self: Arc<Self>,
        device: String,
        mut rx: mpsc::UnboundedReceiver<Message>,
        waiting: Arc<Waiting>,
    ) {
        // Removes the entry however this ends (a panic in a handler, the
        // shutdown), unless a newer worker's is there by then.
        let _guard = InboxGuard { inboxes: &self.inboxes, device: &device, waiting: &waiting };
        loop {
            while let Ok(m) = rx.try_recv() {
                // Counted out before it is handled (its payload is then
                // owned by the handler).
                waiting.add(&m, false);
                tokio::select! {
                    _ = self.shutdown.cancelled() => return,
                    _ = self.on_message(&device, m) => {}
                }
            }
            let mut g = self.inboxes.lock().unwrap_or_else(PoisonError::into_inner);
            if rx.is_empty() {
                // (The guard then finds no entry of this worker's.)
                g.remove(&device);
                return;
            }
        }
    }

    /// One message of a device.
    async fn on_message(&self, device: &str, m: Message) {
        match m.kind {
            Inbound::Request => self.on_request(device, m.payload, m.props).await,
            Inbound::Cancel => self.on_cancel(device, &m.payload),
            Inbound::Resume => self.on_resume(device, &m.payload, m.props),
        }
    }

    async fn on_request(&self, device: &str, payload: Bytes, props: Option<PublishProperties>) {
        self.metrics.inbound.with_label_values(&["req"]).inc();
        let Some(identity) = self.sessions.identity(device) else { return };
        if payload.len() > self.cfg.max_request_bytes {
            let e = GatewayError::invalid(format!(
                "the request is {} bytes; this gateway takes at most {}",
                payload.len(),
                self.cfg.max_request_bytes
            ));
            return self.refuse(device, salvage_request_id(&payload).as_deref(), &props, 0, e);
        }
        let tenant = identity.tenant.clone();
        let caller = Caller::Identity(identity);
        // A v5 device may carry its trace in a `traceparent` user property;
        // any device in the request's `trace_id` field (read by the gateway).
        let traceparent = user_property(&props, "traceparent").map(str::to_string);
        let opts = SubmitOptions { traceparent, ..SubmitOptions::default() };
        let mut call = match self.gw.prepare(caller, &payload, Ingress::Mqtt, opts) {
            Ok(c) => c,
            Err(e) => return self.reject(device, salvage_request_id(&payload).as_deref(), &props, 0, &e),
        };
        let Some(rid) = call.body().request_id.clone().filter(|r| valid_id(r)) else {
            let e = GatewayError::invalid("'request_id' is required: 1..128 characters of A-Z a-z 0-9 - _ . :");
            return self.refuse(device, None, &props, 0, e);
        };
        // The device's own defaults, when it is registered under this
        // tenant (a JWT-only device has none).
        let config = self.gw.config();
        let registered = config.devices.get(device_of_mount(device)).filter(|d| d.tenant == tenant);
        let fields = match mqtt_fields(&call.body().extra, &self.cfg, registered) {
            Ok(f) => f,
            Err(e) => return self.refuse(device, Some(&rid), &props, 0, e),
        };
        // Expiry: the request's own `expires_at` and its MQTT 5 message
        // expiry, whichever is earlier. A stale request never runs; one
        // that expires while queued ends with QUEUE_TIMEOUT.
        let mqtt_expiry = user_property(&props, EXPIRES_AT_PROPERTY).and_then(|v| v.parse::<i64>().ok());
        let expires_at = match (fields.expires_at, mqtt_expiry) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        if let Some(at) = expires_at {
            let left = at - crate::task::now_ms();
            if left <= 0 {
                let e = GatewayError::new(ErrorCode::QueueTimeout, "the request expired before it could start");
                return self.refuse(device, Some(&rid), &props, 0, e);
            }
            let t = call.body_mut().timeouts.get_or_insert_with(RequestTimeouts::default);
            t.queue_ms = Some(t.queue_ms.map_or(left as u64, |q| q.min(left as u64)));
        }
        // Whether the device chose its key decides whether its answer is
        // kept with it (see `DEVICE_OWN_KEY_PREFIX`).
        let key = match call.body().idempotency_key.clone() {
            Some(own) => device_own_key(device, &own),
            None => device_key(device, &rid),
        };
        call.body_mut().idempotency_key = Some(key);
        let Some(dest) = self.destination(device, Some(&rid), &props) else { return };
        let (online, epoch) = self.sessions.state(device);

        let task = match self.gw.submit_call(call).await {
            Ok(t) => t,
            Err(e) => return self.reject(device, Some(&rid), &props, 0, &e),
        };
        if let Some(existing) = self.streams.get(device, &rid).filter(|s| s.task_id == task.task_id) {
            // A repeat (QoS 1 redelivery, a retry after a reconnect): the
            // same task. On the connection that is already receiving it,
            // nothing to do; otherwise the stream starts over from seq 0
            // (or the final result, when it is over).
            self.metrics.inbound.with_label_values(&["repeat"]).inc();
            if existing.active_sender_epoch() != Some(epoch) {
                // Sent again from the start: paid like a resume from 0.
                if let Err(wait_ms) = self.sessions.charge_resume(device, existing.backlog_bytes(0)) {
                    return self.refuse(device, Some(&rid), &props, 0, resumed_too_much(wait_ms));
                }
                // A compact stream keeps its own topic (and its form: the
                // repeat's `compact` does not change a stream already made).
                if existing.sid.is_none() {
                    *existing.destination.lock().expect("destination") = dest;
                }
                self.start_sender(device, &existing, 0, epoch);
            }
            return;
        }
        let topics = &self.topics;
        let stream = self.streams.insert(device, &rid, &task, fields.on_disconnect, fields.compact, |sid| match sid {
            // No correlation data: the topic tells the stream.
            Some(sid) => Destination {
                topic: topics.internal(device, &topics.compact_stream(device_of_mount(device), sid)),
                correlation: None,
            },
            None => dest,
        });
        self.tracker.spawn(streams::pump(self.streams.clone(), stream.clone(), task, fields.coalesce));
        self.start_sender(device, &stream, 0, epoch);
        if !online {
            // The device dropped after publishing: its policy applies now.
            self.device_dropped(device, epoch);
        }
    }

    fn on_cancel(&self, device: &str, payload: &[u8]) {
        self.metrics.inbound.with_label_values(&["cancel"]).inc();
        let Some(rid) = serde_json::from_slice::<Value>(payload)
            .ok()
            .and_then(|v| v.get("request_id").and_then(Value::as_str).map(str::to_string))
        else {
            return;
        };
        if let Some(s) = self.streams.get(device, &rid) {
            if !s.is_ended() {
                s.cancel.cancel("cancelled by the device", "client");
            }
        }
    }

    fn on_resume(&self, device: &str, payload: &[u8], props: Option<PublishProperties>) {
        self.metrics.inbound.with_label_values(&["resume"]).inc();
        let v: Value = serde_json::from_slice(payload).unwrap_or(Value::Null);
        let rid = v.get("request_id").and_then(Value::as_str).filter(|r| valid_id(r)).map(str::to_string);
        let from = v.get("from_seq").and_then(Value::as_u64);
        let (Some(rid), Some(from)) = (rid, from) else {
            let e = GatewayError::invalid("a resume is {\"request_id\": …, \"from_seq\": n}");
            let rid = salvage_request_id(payload);
            return self.refuse(device, rid.as_deref(), &props, 0, e);
        };
        let outcome = |o: &str| self.metrics.resumes.with_label_values(&[o]).inc();
        let Some(stream) = self.streams.get(device, &rid) else {
            outcome("unknown");
            if self.cfg.external.is_some() {
                // On an external broker every node hears every resume: the
                // node that ran the request answers it, the others keep
                // still.
                return;
            }
            let e = GatewayError::invalid(format!(
                "cannot resume '{rid}': unknown request, or its events are no longer kept"
            ));
            return self.refuse(device, Some(&rid), &props, from, e);
        };
        let (first, next, terminal) = stream.range();
        if from < first || terminal.is_some_and(|t| from > t) || (terminal.is_none() && from > next) {
            outcome("out_of_range");
            let e = GatewayError::invalid(format!(
                "cannot resume '{rid}' from seq {from}: seqs {first}..{} are available",
                terminal.unwrap_or(next)
            ));
            return self.refuse(device, Some(&rid), &props, from, e);
        }
        if let Err(wait_ms) = self.sessions.charge_resume(device, stream.backlog_bytes(from)) {
            outcome("rate_limited");
            return self.refuse(device, Some(&rid), &props, from, resumed_too_much(wait_ms));
        }
        outcome("ok");
        let json_form = stream.sid.is_none();
        if json_form && props.as_ref().is_some_and(|p| p.response_topic.is_some() || p.correlation_data.is_some()) {
            if let Some(dest) = self.destination(device, Some(&rid), &props) {
                *stream.destination.lock().expect("destination") = dest;
            }
        }
        let (_, epoch) = self.sessions.state(device);
        self.start_sender(device, &stream, from, epoch);
    }

    /// A device has no connection left (as of `epoch`): its running tasks
    /// follow their `on_disconnect` policy.
    pub fn device_dropped(&self, device: &str, epoch: u64) {
        self.streams.stop_senders(device, epoch);
        for s in self.streams.live_of(device) {
            match s.on_disconnect {
                OnDisconnect::Cancel => s.cancel.cancel("device disconnected (on_disconnect = cancel)", "client"),
                OnDisconnect::Continue => {
                    let sessions = self.sessions.clone();
                    let grace = self.cfg.disconnect_grace;
                    let sd = self.shutdown.clone();
                    let device = device.to_string();
                    self.tracker.spawn(async move {
                        tokio::select! {
                            _ = sd.cancelled() => {}
                            _ = tokio::time::sleep(grace) => {
                                let (online, now_epoch) = sessions.state(&device);
                                if !online && now_epoch == epoch && !s.is_ended() {
                                    s.cancel.cancel("device did not come back within the disconnect grace period", "client");
                                }
                            }
                        }
                    });
                }
            }
        }
    }

    /// A reconnect or a drop ends what the device was being sent: messages
    /// in flight on the old connection are lost, and the device resumes
    /// from the `seq` it has (so it never gets a message twice). A drop
    /// also applies the tasks' `on_disconnect` policy.
    pub fn on_presence(&self, c: &Change) {
        match c {
            Change::Takeover { device, epoch } => self.streams.stop_senders(device, epoch - 1),
            // Only if the device has not come back since the event was made.
            Change::Offline { device, epoch } if self.sessions.state(device) == (false, *epoch) => {
                self.device_dropped(device, *epoch)
            }
            Change::Offline { .. } => {}
            Change::Other => {}
        }
        self.metrics.connected.set(self.sessions.online_count() as i64);
    }
}

/// The private payload rules of [`DeviceIngress::on_message`], for the
/// `device_payload` fuzz target (`fuzz/`), which has no gateway to drive
/// them through. Not API: nothing else may call them.
#[doc(hidden)]
pub mod fuzzing {
    use super::*;

    pub fn salvage_request_id(payload: &[u8]) -> Option<String> {
        super::salvage_request_id(payload)
    }

    pub fn mqtt_fields(extra: &serde_json::Map<String, Value>, cfg: &MqttConfig) -> Result<(), GatewayError> {
        super::mqtt_fields(extra, cfg, None).map(|_| ())
    }

    pub fn device_key(device: &str, key: &str) -> String {
        super::device_key(device, key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_ids_are_salvaged_from_broken_payloads() {
        assert_eq!(salvage_request_id(br#"{"request_id": "r-1", "model": 5}"#).as_deref(), Some("r-1"));
        assert_eq!(salvage_request_id(br#"{"request_id": "r-2", "messages": [ oops"#).as_deref(), Some("r-2"));
        assert_eq!(salvage_request_id(br#"{"request_id": "a/b"}"#), None);
        assert_eq!(salvage_request_id(b"\xff\xfe"), None);
    }

    #[test]
    fn idempotency_keys_are_per_device_and_tenant_in_the_device_key_space() {
        assert_ne!(device_key("t/dev1", "r1"), device_key("t/dev2", "r1"));
        assert_ne!(device_key("t1/dev1", "r1"), device_key("t2/dev1", "r1"));
        assert_eq!(device_key("t/dev1", "r1"), device_key("t/dev1", "r1"));
        assert!(device_key("a", "b").len() <= 128);
        assert!(device_key("a", "b").starts_with(DEVICE_KEY_PREFIX));
        assert!(crate::task::is_derived_device_key(&device_key("a", "b")));
        let own = device_own_key("a", "b");
        assert!(own.starts_with(DEVICE_KEY_PREFIX) && own.len() <= 128);
        assert!(!crate::task::is_derived_device_key(&own));
    }

    #[test]
    fn the_resume_budget_holds_one_whole_stream_and_refills_at_its_rate() {
        let t0 = Instant::now();
        let mut b = ResumeBudget { tokens: 4096.0, at: t0 };
        assert_eq!(b.take(3000, 4096, 1000, t0), Ok(()));
        // 1096 left: a 2000-byte resume waits about 904 ms.
        assert_eq!(b.take(2000, 4096, 1000, t0), Err(904));
        assert_eq!(b.take(2000, 4096, 1000, t0 + std::time::Duration::from_millis(904)), Ok(()));
        // Tiny resumes still cost RESUME_MIN_COST; a huge one costs at most
        // the capacity (it can always be served from a full bucket).
        let mut b = ResumeBudget { tokens: 4096.0, at: t0 };
        for _ in 0..(4096 / RESUME_MIN_COST) {
            assert_eq!(b.take(1, 4096, 1000, t0), Ok(()));
        }
        assert!(b.take(1, 4096, 1000, t0).is_err());
        let mut b = ResumeBudget { tokens: 4096.0, at: t0 };
        assert_eq!(b.take(1 << 20, 4096, 1000, t0), Ok(()));
    }

    #[test]
    fn a_resume_budget_below_the_minimum_cost_charges_its_capacity_without_panicking() {
        let t0 = Instant::now();
        let mut b = ResumeBudget { tokens: 256.0, at: t0 };
        assert_eq!(b.take(1, 256, 1024, t0), Ok(()));
        assert!(b.take(1, 256, 1024, t0).is_err());
    }

    /// A worker that dies (a panic) takes its inbox entry with it, so the
    /// next message starts a fresh worker instead of queueing for nobody
    /// with counters that never go down; a newer entry is left alone.
    #[test]
    fn a_dead_inbox_worker_removes_its_own_entry_only() {
        let inboxes = Mutex::new(HashMap::new());
        let (tx, _rx) = mpsc::unbounded_channel();
        let waiting = Arc::new(Waiting::default());
        inboxes.lock().unwrap().insert("t/d".to_string(), Inbox { tx: tx.clone(), waiting: waiting.clone() });
        let died = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _guard = InboxGuard { inboxes: &inboxes, device: "t/d", waiting: &waiting };
            panic!("a handler failed");
        }));
        assert!(died.is_err());
        assert!(inboxes.lock().unwrap().is_empty(), "the dead worker's entry is gone");
        let newer = Arc::new(Waiting::default());
        inboxes.lock().unwrap().insert("t/d".to_string(), Inbox { tx, waiting: newer });
        drop(InboxGuard { inboxes: &inboxes, device: "t/d", waiting: &waiting });
        assert_eq!(inboxes.lock().unwrap().len(), 1, "a newer worker's entry stays");
    }
}
