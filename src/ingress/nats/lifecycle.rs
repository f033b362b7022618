//! Lifecycle events on the bus: every state change of every task, whatever
//! its ingress, as the JSON of [`LifecycleEvent`] on
//! `{prefix}.events.{tenant}.{state}` (state in lower case, e.g.
//! `ai.v1.events.demo.succeeded`). The events never carry prompt or result
//! text.
//!
//! Publishing is bounded and never slows a request: the recorder's
//! broadcast is read by one task into a queue of `events_queue_capacity`,
//! and another task publishes from it while the bus is connected. While the
//! bus is slow or down the queue fills and further events are dropped and
//! counted (`edgeway_nats_events_dropped_total{reason}`); what the queue
//! holds is published after the reconnect.
//!
//! With `[nats.jetstream]`, edgeway creates (or updates) a stream over
//! `{prefix}.events.>` on every (re)connect, so a subscriber that was down
//! can replay what it missed; each event carries `Nats-Msg-Id:
//! {task_id}.{state}` for JetStream's duplicate detection.
//!
//! Owns: lifecycle subjects, the bounded publishing queue and the JetStream
//! stream. Does not own: the bus connection or its state (`super`) or what
//! a transition is (the recorder in `telemetry`).

use std::sync::Arc;
use std::time::Duration;

use async_nats::HeaderMap;
use bytes::Bytes;
use tokio::sync::{broadcast, mpsc};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::{subject_token, BusState, NatsStatus};
use crate::config::{JetStreamConfig, JetStreamStorage, NatsConfig};
use crate::telemetry::lifecycle::LifecycleEvent;
use crate::telemetry::Metrics;

/// How long, after shutdown began, the publisher keeps taking events (the
/// last transitions of the tasks being cancelled) before it stops.
const SHUTDOWN_DRAIN_IDLE: Duration = Duration::from_millis(300);
const SHUTDOWN_DRAIN_MAX: Duration = Duration::from_secs(2);

/// The subject of one lifecycle event.
pub fn event_subject(cfg: &NatsConfig, ev: &LifecycleEvent) -> String {
    format!("{}.events.{}.{}", cfg.prefix, subject_token(&ev.tenant), ev.state.as_str().to_ascii_lowercase())
}

/// Starts the reader (broadcast → bounded queue) and the publisher (queue →
/// NATS) on `tracker`.
pub fn spawn_publisher(
    client: async_nats::Client,
    cfg: NatsConfig,
    metrics: Arc<Metrics>,
    status: NatsStatus,
    mut rx: broadcast::Receiver<Arc<LifecycleEvent>>,
    tracker: &TaskTracker,
    shutdown: CancellationToken,
) {
    let (tx, mut queue) = mpsc::channel::<Arc<LifecycleEvent>>(cfg.events_queue_capacity);
    let m = metrics.clone();
    let sd = shutdown.clone();
    tracker.spawn(async move {
        let dropped = |reason: &str, n: u64| m.nats_events_dropped.with_label_values(&[reason]).inc_by(n);
        let offer = |r: Result<Arc<LifecycleEvent>, broadcast::error::RecvError>| match r {
            Ok(ev) => {
                if tx.try_send(ev).is_err() {
                    dropped("queue_full", 1);
                }
                true
            }
            Err(broadcast::error::RecvError::Lagged(n)) => {
                dropped("lagged", n);
                true
            }
            Err(broadcast::error::RecvError::Closed) => false,
        };
        loop {
            tokio::select! {
                _ = sd.cancelled() => break,
                r = rx.recv() => if !offer(r) { return },
            }
        }
        // Shutting down: take the last transitions until things go quiet.
        let deadline = tokio::time::Instant::now() + SHUTDOWN_DRAIN_MAX;
        while let Ok(Ok(r)) =
            tokio::time::timeout_at(deadline.min(tokio::time::Instant::now() + SHUTDOWN_DRAIN_IDLE), rx.recv()).await
        {
            if !offer(Ok(r)) {
                break;
            }
        }
    });
    let with_msg_id = cfg.jetstream.is_some();
    tracker.spawn(async move {
        let m = &metrics;
        loop {
            // While the bus is down, events wait in the queue (and the reader
            // drops what does not fit) instead of piling up in the client.
            if status.state() != BusState::Connected {
                tokio::select! {
                    _ = status.wait_for(BusState::Connected) => {}
                    _ = shutdown.cancelled() => {
                        queue.close();
                        let mut lost = 0;
                        while queue.recv().await.is_some() {
                            lost += 1;
                        }
                        m.nats_events_dropped.with_label_values(&["shutdown"]).inc_by(lost);
                        break;
                    }
                }
            }
            // Ends when the reader has ended and the queue is empty.
            let Some(ev) = queue.recv().await else { break };
            let payload = match serde_json::to_vec(&*ev) {
                Ok(p) => Bytes::from(p),
                Err(_) => continue,
            };
            let subject = event_subject(&cfg, &ev);
            let publish = async {
                if with_msg_id {
                    let mut h = HeaderMap::new();
                    h.insert("Nats-Msg-Id", format!("{}.{}", ev.task_id, ev.state.as_str()).as_str());
                    client.publish_with_headers(subject, h, payload).await
                } else {
                    client.publish(subject, payload).await
                }
            };
            // Waits while the client's own buffer is full: this queue then
            // fills and the reader drops, never the request path.
            let ok = if shutdown.is_cancelled() {
                matches!(tokio::time::timeout(Duration::from_secs(1), publish).await, Ok(Ok(())))
            } else {
                tokio::select! {
                    r = publish => r.is_ok(),
                    _ = shutdown.cancelled() => false,
                }
            };
            if ok {
                m.nats_events_published.with_label_values(&[ev.state.as_str()]).inc();
            } else {
                m.nats_events_dropped.with_label_values(&["publish_error"]).inc();
            }
        }
        let _ = tokio::time::timeout(Duration::from_secs(1), client.flush()).await;
    });
}

/// The JetStream stream for lifecycle events.
pub fn stream_config(cfg: &NatsConfig, js: &JetStreamConfig) -> async_nats::jetstream::stream::Config {
    use async_nats::jetstream::stream;
    stream::Config {
        name: js.stream.clone(),
        description: Some("edgeway task lifecycle events".into()),
        subjects: vec![format!("{}.events.>", cfg.prefix)],
        max_age: js.max_age,
        max_bytes: js.max_bytes as i64,
        storage: match js.storage {
            JetStreamStorage::File => stream::StorageType::File,
            JetStreamStorage::Memory => stream::StorageType::Memory,
        },
        ..Default::default()
    }
}

/// Creates or updates the event stream each time the bus (re)connects (a
/// restarted server with memory storage has lost it).
pub async fn keep_stream(
    client: async_nats::Client,
    cfg: NatsConfig,
    js: JetStreamConfig,
    status: NatsStatus,
    shutdown: CancellationToken,
) {
    let ctx = async_nats::jetstream::new(client);
    let mut seen = 0;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            n = status.wait_connect_after(seen) => seen = n,
        }
        let mut delay = Duration::from_millis(200);
        loop {
            match ctx.create_or_update_stream(stream_config(&cfg, &js)).await {
                Ok(_) => {
                    tracing::info!(stream = %js.stream, "JetStream event stream ready");
                    status.set_stream_ready(true);
                    break;
                }
                Err(e) => {
                    tracing::warn!(stream = %js.stream, error = %e, "cannot create the JetStream event stream");
                    status.set_stream_ready(false);
                    if status.state() != BusState::Connected {
                        break;
                    }
                    tokio::select! {
                        _ = shutdown.cancelled() => return,
                        _ = tokio::time::sleep(delay) => {}
                    }
                    delay = (delay * 2).min(Duration::from_secs(30));
                }
            }
        }
    }
}
