//! MQTT response streams: what a device receives for one request.
//!
//! A *pump* reads the task's events ([`TaskStream`]), coalesces deltas for
//! weak links (at most one delta message per `coalesce` period or
//! `max_chunk_bytes` of text; the first delta goes out at once; pieces of
//! one tool call coalesce the same way into one `tool_call` message) and appends
//! each rendered message to the stream's own log, numbered by its own
//! contiguous `seq` from 0. The MQTT `seq` therefore counts messages, not
//! task events: several task deltas merged into one message take one
//! number, and `resume`'s `from_seq` refers to these numbers.
//!
//! A *sender* publishes the log from some `seq` on to the device's response
//! topic and follows the live tail. There is at most one sender per stream:
//! a resume replaces it. Logs are kept after the end of the task for
//! `replay_retention`, within a per-stream and a total byte budget, so a
//! device that reconnects can resume. The log and those retention rules
//! are [`crate::task::log`]'s, shared with the scheduler's replay; the MQTT
//! `seq` is this log's own numbering.
//!
//! A *compact* stream (a request's `"compact": true`, or its device's
//! `compact`) gets a short stream id, the lowest number none of the
//! device's kept streams has, and goes to `{prefix}/{device}/s/{sid}`
//! as [`compact_body`]s: the request id only rides in `accepted`. Its log
//! keeps the bodies without their `seq`; the sender writes the `seq` where
//! a device could not count it ([`compact_wire`]).
//! Reusing the numbers keeps the broker's topic names per device few (it
//! never forgets one).
//!
//! # Cancel safety
//! Pumps and senders are spawned tasks. A sender stopped mid-way (replaced
//! by a resume) loses nothing: the log is untouched and the replacement
//! starts where the device asked.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use rumqttd::protocol::PublishProperties;
use tokio::time::sleep_until;
use tokio_util::sync::CancellationToken;

#[cfg(doc)]
use super::requests::Sessions;
use super::Publisher;
use crate::error::GatewayError;
use crate::gateway::{CancelHandle, TaskStream};
use crate::ingress::render::{compact_body, compact_wire, event_json};
use crate::task::log::{EndedQueue, RetainedLog, SeqRange};
use crate::task::{TaskEvent, ToolCallDelta};

/// What happens to a running task when its device drops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnDisconnect {
    /// Keep running for the grace period (the device may resume), then
    /// cancel.
    Continue,
    Cancel,
}

/// Per-request delta coalescing.
#[derive(Debug, Clone, Copy)]
pub struct Coalesce {
    pub period: Duration,
    pub max_bytes: usize,
}

/// Where a sender publishes: the router topic and MQTT 5 properties
/// (correlation data) of every message.
#[derive(Clone)]
pub struct Destination {
    pub topic: String,
    pub correlation: Option<Bytes>,
}

struct SenderSlot {
    stop: CancellationToken,
    /// The device's connection epoch when the sender started.
    epoch: u64,
    /// Set by the sender when it has published the terminal message.
    done: Arc<std::sync::atomic::AtomicBool>,
}

/// One request's response stream.
pub struct MqttStream {
    pub device: String,
    pub request_id: String,
    pub task_id: String,
    pub on_disconnect: OnDisconnect,
    pub cancel: CancelHandle,
    /// The stream id of a compact stream (`None`: the JSON form). Its
    /// destination is the stream's own topic for good.
    pub sid: Option<u32>,
    pub destination: Mutex<Destination>,
    /// Rendered messages by `seq`, within the per-stream byte budget; the
    /// terminal message ends it.
    log: Arc<RetainedLog<Bytes>>,
    sender: Mutex<Option<SenderSlot>>,
}

impl MqttStream {
    pub fn is_ended(&self) -> bool {
        self.log.is_ended()
    }

    /// The oldest kept `seq`, the next `seq` to be produced and the `seq`
    /// of the terminal message, once there is one.
    pub fn range(&self) -> (u64, u64, Option<u64>) {
        let SeqRange { first, next, last } = self.log.range();
        (first, next, last)
    }

    pub fn bytes(&self) -> usize {
        self.log.bytes()
    }

    /// About how many bytes a sender starting at `from` would publish of
    /// what is kept now (the kept bytes in proportion to the messages).
    pub fn backlog_bytes(&self, from: u64) -> usize {
        let (first, next, _) = self.range();
        let kept = next.saturating_sub(first);
        if kept == 0 {
            return 0;
        }
        let from = from.clamp(first, next);
        (self.bytes() as u128 * u128::from(next - from) / u128::from(kept)) as usize
    }

    fn push(&self, msg: Bytes, terminal: bool) {
        if terminal {
            self.log.push_last(msg);
        } else {
            self.log.push(msg);
        }
    }

    /// Whether a sender is publishing (not stopped, not finished) and since
    /// which device epoch.
    pub fn active_sender_epoch(&self) -> Option<u64> {
        let g = self.sender.lock().expect("sender");
        g.as_ref()
            .filter(|s| !s.stop.is_cancelled() && !s.done.load(std::sync::atomic::Ordering::SeqCst))
            .map(|s| s.epoch)
    }

    fn stop_sender(&self) {
        if let Some(s) = self.sender.lock().expect("sender").take() {
            s.stop.cancel();
        }
    }
}

/// The streams of all devices, by (device, request id).
pub struct Streams {
    inner: Mutex<Registry>,
    stream_max_bytes: usize,
}

struct Registry {
    by_key: HashMap<(String, String), Arc<MqttStream>>,
    /// The stream ids of each device's compact streams in `by_key`.
    sids: HashMap<String, BTreeSet<u32>>,
    /// Ended streams, kept for the retention within the total budget.
    ended: EndedQueue<(String, String)>,
}

impl Streams {
    pub fn new(retention: Duration, max_bytes: usize, stream_max_bytes: usize) -> Streams {
        let inner =
            Registry { by_key: HashMap::new(), sids: HashMap::new(), ended: EndedQueue::new(retention, max_bytes) };
        Streams { inner: Mutex::new(inner), stream_max_bytes }
    }

    pub fn get(&self, device: &str, request_id: &str) -> Option<Arc<MqttStream>> {
        self.inner.lock().expect("streams").by_key.get(&(device.to_string(), request_id.to_string())).cloned()
    }

    /// A new stream for a task (replacing an ended one with the same key).
    /// A compact one gets its stream id here; `destination` is told it.
    pub fn insert(
        &self,
        device: &str,
        request_id: &str,
        task: &TaskStream,
        on_disconnect: OnDisconnect,
        compact: bool,
        destination: impl FnOnce(Option<u32>) -> Destination,
    ) -> Arc<MqttStream> {
        let key = (device.to_string(), request_id.to_string());
        let mut g = self.inner.lock().expect("streams");
        if let Some(old) = g.by_key.remove(&key) {
            old.stop_sender();
            g.free_sid(&old);
        }
        let sid = compact.then(|| {
            let used = g.sids.entry(device.to_string()).or_default();
            let sid = (0..).find(|n| !used.contains(n)).expect("fewer than 2^32 streams per device");
            used.insert(sid);
            sid
        });
        let s = Arc::new(MqttStream {
            device: device.to_string(),
            request_id: request_id.to_string(),
            task_id: task.task_id.clone(),
            on_disconnect,
            cancel: task.cancel_handle(),
            sid,
            destination: Mutex::new(destination(sid)),
            log: Arc::new(RetainedLog::with_budget(Bytes::len, self.stream_max_bytes)),
            sender: Mutex::new(None),
        });
        g.by_key.insert(key, s.clone());
        s
    }

    /// Stops the senders of a device that started in `epoch` or before.
    pub fn stop_senders(&self, device: &str, epoch: u64) {
        let g = self.inner.lock().expect("streams");
        for s in g.by_key.values().filter(|s| s.device == device) {
            let mut slot = s.sender.lock().expect("sender");
            if slot.as_ref().is_some_and(|x| x.epoch <= epoch) {
                if let Some(x) = slot.take() {
                    x.stop.cancel();
                }
            }
        }
    }

    /// Live (not ended) streams of a device.
    pub fn live_of(&self, device: &str) -> Vec<Arc<MqttStream>> {
        let g = self.inner.lock().expect("streams");
        g.by_key.values().filter(|s| s.device == device && !s.is_ended()).cloned().collect()
    }

    pub fn len(&self) -> usize {
        self.inner.lock().expect("streams").by_key.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn ended(&self, s: &MqttStream) {
        let mut g = self.inner.lock().expect("streams");
        g.ended.push(Instant::now(), (s.device.clone(), s.request_id.clone()), s.bytes());
        drop(g);
        self.sweep();
    }

    /// Drops ended streams past the retention or over the byte budget.
    pub fn sweep(&self) {
        let now = Instant::now();
        let mut g = self.inner.lock().expect("streams");
        while let Some(key) = g.ended.pop_expired(now) {
            // A live stream that took the key since (a new request with the
            // same id) stays.
            if g.by_key.get(&key).is_some_and(|s| s.is_ended()) {
                // Its sender, if it is still publishing, finishes: the
                // device is owed the end of the stream it holds. With
                // `replay_retention_ms = 0` the sweep at the task's end
                // came before the terminal message went out, and stopped
                // it (item 5a: a repeat, its stream sent again, got no
                // answer either).
                if let Some(s) = g.by_key.remove(&key) {
                    g.free_sid(&s);
                }
            }
        }
    }
}

impl Registry {
    /// Gives a removed stream's id back to its device.
    fn free_sid(&mut self, s: &MqttStream) {
        let Some(sid) = s.sid else { return };
        if let Some(used) = self.sids.get_mut(&s.device) {
            used.remove(&sid);
            if used.is_empty() {
                self.sids.remove(&s.device);
            }
        }
    }
}

/// What a pump holds back to coalesce: text, or the pieces of one tool call
/// (merged into one `tool_call` message with the longer `arguments`
/// fragment; the schema is the same).
enum Held {
    Text(String),
    Call(ToolCallDelta),
}

impl Held {
    fn len(&self) -> usize {
        match self {
            Held::Text(t) => t.len(),
            Held::Call(d) => d.arguments.len(),
        }
    }

    /// Takes in a piece of the same call, if it is one: same index, and
    /// no second id or name (those must each go out once, in order).
    fn merge(&mut self, d: &mut ToolCallDelta) -> bool {
        let Held::Call(h) = self else { return false };
        if h.index != d.index || (h.id.is_some() && d.id.is_some()) || (h.name.is_some() && d.name.is_some()) {
            return false;
        }
        h.id = h.id.take().or(d.id.take());
        h.name = h.name.take().or(d.name.take());
        h.arguments.push_str(&d.arguments);
        true
    }
}

/// Reads the task's events into the stream's log until the terminal event.
pub async fn pump(streams: Arc<Streams>, stream: Arc<MqttStream>, mut task: TaskStream, coalesce: Coalesce) {
    task.detach();
    let rid = stream.request_id.clone();
    let trace_id = task.trace_id.clone();
    let mut seq: u64 = 0;
    let mut held: Option<Held> = None;
    let mut last_flush: Option<tokio::time::Instant> = None;
    let compact = stream.sid.is_some();
    let render = |seq: u64, e: &TaskEvent| match compact {
        true => Bytes::from(compact_body(&rid, e)),
        false => Bytes::from(event_json(seq, &rid, &trace_id, e).to_string()),
    };
    let flush = |held: &mut Option<Held>, seq: &mut u64, last: &mut Option<tokio::time::Instant>| {
        if let Some(h) = held.take() {
            let e = match h {
                Held::Text(text) => TaskEvent::Delta { text },
                Held::Call(d) => TaskEvent::ToolCallDelta(d),
            };
            stream.push(render(*seq, &e), false);
            *seq += 1;
            *last = Some(tokio::time::Instant::now());
        }
    };
    loop {
        let deadline = match (&last_flush, held.is_none()) {
            (Some(l), false) => Some(*l + coalesce.period),
            (None, false) => Some(tokio::time::Instant::now()),
            _ => None,
        };
        let ev = match deadline {
            Some(d) => tokio::select! {
                e = task.recv() => e,
                _ = sleep_until(d) => {
                    flush(&mut held, &mut seq, &mut last_flush);
                    continue;
                }
            },
            None => task.recv().await,
        };
        match ev {
            Some((_, TaskEvent::Delta { text })) => {
                match &mut held {
                    Some(Held::Text(t)) => t.push_str(&text),
                    _ => {
                        flush(&mut held, &mut seq, &mut last_flush);
                        if !text.is_empty() {
                            held = Some(Held::Text(text));
                        }
                    }
                }
                let due = last_flush.is_none_or(|l| l.elapsed() >= coalesce.period);
                if held.as_ref().is_some_and(|h| h.len() >= coalesce.max_bytes) || due {
                    flush(&mut held, &mut seq, &mut last_flush);
                }
            }
            // Pieces of one tool call coalesce like text (review L5).
            Some((_, TaskEvent::ToolCallDelta(mut d))) => {
                if !held.as_mut().is_some_and(|h| h.merge(&mut d)) {
                    flush(&mut held, &mut seq, &mut last_flush);
                    held = Some(Held::Call(d));
                }
                let due = last_flush.is_none_or(|l| l.elapsed() >= coalesce.period);
                if held.as_ref().is_some_and(|h| h.len() >= coalesce.max_bytes) || due {
                    flush(&mut held, &mut seq, &mut last_flush);
                }
            }
            // Embeddings are never a device's task (chat models only take
            // chat); not an end of the stream either way.
            Some((_, e @ (TaskEvent::Accepted { .. } | TaskEvent::Queued { .. } | TaskEvent::Embedding { .. }))) => {
                flush(&mut held, &mut seq, &mut last_flush);
                stream.push(render(seq, &e), false);
                seq += 1;
            }
            Some((_, e)) => {
                flush(&mut held, &mut seq, &mut last_flush);
                stream.push(render(seq, &e), true);
                break;
            }
            None => {
                // Drivers always end with Done or Error; never leave a
                // device without a terminal message anyway.
                flush(&mut held, &mut seq, &mut last_flush);
                let error = GatewayError::internal("the task ended without a result");
                let mut v = crate::ingress::render::rejection_json(Some(&rid), &error);
                let msg = if compact {
                    if let Some(o) = v.as_object_mut() {
                        o.remove("seq");
                        o.remove("request_id");
                    }
                    v.to_string()
                } else {
                    v["seq"] = seq.into();
                    v.to_string()
                };
                stream.push(Bytes::from(msg), true);
                break;
            }
        }
    }
    streams.ended(&stream);
}

/// Starts (or restarts) the stream's sender from `from_seq`, replacing the
/// current one. It serves the device's connections as of `epoch`: once
/// the device has come back (a takeover, or a connect after it had none;
/// `sessions` records it at CONNECT, before the new connection can
/// subscribe; `came_back` is that epoch, [`Sessions::came_back`]) it
/// stops, even before the reconnect's handling would stop
/// it, so nothing of an old sender reaches the new connection (the device
/// resumes from the seq it has; a compact device counts the seqs, and an
/// old sender's message after a loss would be counted wrong). Another
/// instance of the device connecting beside a live one stops nothing.
pub fn start_sender(
    stream: &Arc<MqttStream>,
    from_seq: u64,
    epoch: u64,
    out: Arc<Publisher>,
    came_back: Arc<std::sync::atomic::AtomicU64>,
    tracker: &tokio_util::task::TaskTracker,
    shutdown: &CancellationToken,
) {
    let stop = shutdown.child_token();
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    {
        let mut g = stream.sender.lock().expect("sender");
        if let Some(old) = g.replace(SenderSlot { stop: stop.clone(), epoch, done: done.clone() }) {
            old.stop.cancel();
        }
    }
    tracker.spawn(send_loop(stream.clone(), from_seq, epoch, out, came_back, stop, done));
}

async fn send_loop(
    stream: Arc<MqttStream>,
    next: u64,
    epoch: u64,
    out: Arc<Publisher>,
    came_back: Arc<std::sync::atomic::AtomicU64>,
    stop: CancellationToken,
    done: Arc<std::sync::atomic::AtomicBool>,
) {
    // Starts at the oldest kept message if `next` was trimmed by the
    // per-stream budget: the device sees the gap.
    let mut reader = stream.log.reader(next);
    let compact = stream.sid.is_some();
    let mut first = true;
    loop {
        let batch = tokio::select! {
            biased;
            _ = stop.cancelled() => return,
            b = reader.recv_batch() => b,
        };
        let Some((from, batch)) = batch else {
            // The terminal message is out.
            done.store(true, std::sync::atomic::Ordering::SeqCst);
            return;
        };
        let dest = stream.destination.lock().expect("destination").clone();
        let props = dest.correlation.as_ref().map(|c| PublishProperties {
            correlation_data: Some(c.clone()),
            content_type: Some("application/json".into()),
            ..Default::default()
        });
        for (seq, msg) in (from..).zip(batch) {
            let msg = match compact {
                true => compact_wire(seq, &msg, std::mem::take(&mut first)),
                false => msg,
            };
            // Checked per message: a replaced sender stops at once, and so
            // does one whose device has come back. Waits while
            // edgeway's outgoing queue to the router is full.
            if stop.is_cancelled() || came_back.load(std::sync::atomic::Ordering::Acquire) > epoch {
                return;
            }
            let sent = tokio::select! {
                biased;
                _ = stop.cancelled() => return,
                r = out.publish_queued(&dest.topic, msg, props.clone()) => r,
            };
            if sent.is_err() {
                return;
            }
        }
    }
}
