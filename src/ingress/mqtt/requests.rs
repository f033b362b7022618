//! What edgeway does with the messages devices publish to it: requests,
//! cancels and resumes, and what happens to a device's tasks when it
//! drops.
//!
//! A request goes through the [`Gateway`] facade like every other ingress (the
//! idempotency key is derived from the device and its `request_id`, so a
//! repeat never starts a second inference and two devices never share a
//! task); its events go to the device through a [`streams::MqttStream`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use rumqttd::protocol::PublishProperties;
use serde_json::Value;
use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::codec::EXPIRES_AT_PROPERTY;
use super::presence::Presence;
use super::streams::{self, Coalesce, Destination, OnDisconnect, Streams};
use super::topics::{Inbound, Topics};
use super::{MqttMetrics, Publisher};
use crate::config::MqttConfig;
use crate::error::{ErrorCode, GatewayError};
use crate::gateway::{Caller, Gateway, RequestTimeouts, SubmitOptions};
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

/// Devices seen since start. Updated by the codec at CONNECT (before the
/// router sees anything from the connection) and when a connection ends.
#[derive(Default)]
pub struct Sessions {
    devices: Mutex<HashMap<String, Device>>,
}

impl Sessions {
    pub fn apply(&self, p: &Presence) -> Change {
        let mut g = self.devices.lock().expect("sessions");
        match p {
            Presence::Connected { device, client_id, conn, identity } => {
                let d = g.entry(device.clone()).or_insert_with(|| Device {
                    identity: identity.clone(),
                    live: Vec::new(),
                    epoch: 0,
                });
                d.identity = identity.clone();
                let takeover = d.live.iter().any(|(_, c)| c == client_id);
                d.live.push((*conn, client_id.clone()));
                d.epoch += 1;
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

    /// (online, epoch)
    pub fn state(&self, device: &str) -> (bool, u64) {
        let g = self.devices.lock().expect("sessions");
        g.get(device).map(|d| (!d.live.is_empty(), d.epoch)).unwrap_or((false, 0))
    }

    pub fn online_count(&self) -> usize {
        self.devices.lock().expect("sessions").values().filter(|d| !d.live.is_empty()).count()
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
}

/// The idempotency key of a device's request: unique per device, so two
/// devices of one application never join each other's tasks.
fn device_key(device: &str, key: &str) -> String {
    let mut h = Sha256::new();
    h.update(device.as_bytes());
    h.update([0]);
    h.update(key.as_bytes());
    format!("mqtt-{}", &hex::encode(h.finalize())[..40])
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
    // Not JSON (or cut off): look for `"request_id": "…"` in the text.
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
}

fn mqtt_fields(extra: &serde_json::Map<String, Value>, cfg: &MqttConfig) -> Result<MqttFields, GatewayError> {
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
        None | Some(Value::Null) => cfg.coalesce,
        Some(v) => std::time::Duration::from_millis(
            v.as_u64()
                .filter(|ms| *ms <= 60_000)
                .ok_or_else(|| GatewayError::invalid("'coalesce_ms' must be 0..60000"))?,
        ),
    };
    let max_bytes = match extra.get("max_chunk_bytes") {
        None | Some(Value::Null) => cfg.max_chunk_bytes,
        Some(v) => v
            .as_u64()
            .filter(|b| (1..=1024 * 1024).contains(b))
            .ok_or_else(|| GatewayError::invalid("'max_chunk_bytes' must be 1..1048576"))? as usize,
    };
    Ok(MqttFields { on_disconnect, expires_at, coalesce: Coalesce { period, max_bytes } })
}

impl DeviceIngress {
    /// Router topic and correlation data of the answers to a message from
    /// `device`: the MQTT 5 response topic when it is inside the device's
    /// namespace, else `{prefix}/{device}/res/{request_id}`.
    fn destination(
        &self,
        device: &str,
        request_id: Option<&str>,
        props: &Option<PublishProperties>,
    ) -> Option<Destination> {
        let correlation = props.as_ref().and_then(|p| p.correlation_data.clone());
        let asked = props.as_ref().and_then(|p| p.response_topic.as_deref());
        let topic = match (asked, request_id) {
            (Some(t), _) if self.topics.valid_response_topic(device, t) => t.to_string(),
            (_, Some(rid)) => self.topics.response(device, rid),
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

    /// One message from edgeway's link.
    pub async fn on_message(&self, topic: &str, payload: Bytes, props: Option<PublishProperties>) {
        let Some((device, kind)) = self.topics.parse_inbound(topic) else { return };
        let device = device.to_string();
        match kind {
            Inbound::Request => self.on_request(&device, payload, props).await,
            Inbound::Cancel => self.on_cancel(&device, &payload),
            Inbound::Resume => self.on_resume(&device, &payload, props),
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
        let caller = Caller::Identity(identity);
        let mut call = match self.gw.prepare(caller, &payload, Ingress::Mqtt, SubmitOptions::default()) {
            Ok(c) => c,
            Err(e) => return self.reject(device, salvage_request_id(&payload).as_deref(), &props, 0, &e),
        };
        let Some(rid) = call.body().request_id.clone().filter(|r| valid_id(r)) else {
            let e = GatewayError::invalid("'request_id' is required: 1..128 characters of A-Z a-z 0-9 - _ . :");
            return self.refuse(device, None, &props, 0, e);
        };
        let fields = match mqtt_fields(&call.body().extra, &self.cfg) {
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
        let key = call.body().idempotency_key.clone().unwrap_or_else(|| rid.clone());
        call.body_mut().idempotency_key = Some(device_key(device, &key));
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
                *existing.destination.lock().expect("destination") = dest;
                streams::start_sender(&existing, 0, epoch, self.out.clone(), &self.tracker, &self.shutdown);
            }
            return;
        }
        let stream = self.streams.insert(device, &rid, &task, fields.on_disconnect, dest);
        self.tracker.spawn(streams::pump(self.streams.clone(), stream.clone(), task, fields.coalesce));
        streams::start_sender(&stream, 0, epoch, self.out.clone(), &self.tracker, &self.shutdown);
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
        outcome("ok");
        if props.as_ref().is_some_and(|p| p.response_topic.is_some() || p.correlation_data.is_some()) {
            if let Some(dest) = self.destination(device, Some(&rid), &props) {
                *stream.destination.lock().expect("destination") = dest;
            }
        }
        let (_, epoch) = self.sessions.state(device);
        streams::start_sender(&stream, from, epoch, self.out.clone(), &self.tracker, &self.shutdown);
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
        super::mqtt_fields(extra, cfg).map(|_| ())
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
    fn idempotency_keys_are_per_device() {
        assert_ne!(device_key("dev1", "r1"), device_key("dev2", "r1"));
        assert_eq!(device_key("dev1", "r1"), device_key("dev1", "r1"));
        assert!(device_key("a", "b").len() <= 128);
    }
}
