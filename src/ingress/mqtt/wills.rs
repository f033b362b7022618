//! Device wills, kept by edgeway instead of rumqttd's router (see
//! [`super::protocol`] for why): taken out of CONNECT, dropped on a clean
//! DISCONNECT (kept with MQTT 5's reason 0x04), and published by edgeway
//! (in the device's subtree, at the will's QoS and retain flag) when the
//! connection ends any other way: after the MQTT 5 will delay unless the
//! client id connects again
//! first, or at once when the session ends with the connection (MQTT 5
//! Session Expiry 0, and 3.1.1). A will counts against its device's
//! quotas ([`DeviceQuotas`]) when it is published, not when it is armed (a
//! reconnect may cancel it): a retained will over the retained quota still
//! goes to current subscribers, not kept; one to a topic over the topic
//! quota does not go (nobody is left to tell).
//!
//! Owns: pending wills and their publication. Does not own: when a
//! connection ends (the codec's drop) or mounting the will topic
//! ([`super::codec`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rumqttd::protocol::{LastWill, LastWillProperties, PublishProperties, QoS};
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::connections::{DeviceQuotas, Quota};
use super::Publisher;

/// A will to publish for a connection that ended without a clean
/// DISCONNECT: its topic is already mounted in the device's subtree.
#[derive(Debug)]
pub struct PendingWill {
    pub client_id: String,
    /// The device (its mount) whose quotas the will counts against.
    pub device: String,
    pub quotas: Arc<DeviceQuotas>,
    /// Tells this will from a later one of the same client id.
    pub generation: u64,
    pub topic: String,
    pub payload: bytes::Bytes,
    pub retain: bool,
    /// The will's QoS: the most a subscriber receives it at.
    pub qos: QoS,
    pub props: Option<PublishProperties>,
    pub delay: Duration,
    /// Cancelled when the same client id connects again before the delay
    /// is over.
    pub cancel: CancellationToken,
}

/// Wills armed and not yet published or cancelled, by client id.
pub struct Wills {
    tx: UnboundedSender<PendingWill>,
    pending: Mutex<HashMap<String, (u64, CancellationToken)>>,
    next_generation: AtomicU64,
}

impl Wills {
    /// Armed wills go to `tx` (read by [`publish_loop`]).
    pub fn new(tx: UnboundedSender<PendingWill>) -> Self {
        Wills { tx, pending: Mutex::default(), next_generation: AtomicU64::new(1) }
    }

    /// A connection with a will ended without a clean DISCONNECT.
    /// `session_expiry`: the MQTT 5 Session Expiry Interval of the
    /// connection (0 for 3.1.1): the will goes at the end of the delay or of
    /// the session, whichever comes first.
    pub fn arm(
        &self,
        client_id: &str,
        (device, quotas): (&str, &Arc<DeviceQuotas>),
        will: LastWill,
        props: Option<LastWillProperties>,
        session_expiry: u32,
    ) {
        let cancel = CancellationToken::new();
        let generation = self.next_generation.fetch_add(1, Ordering::Relaxed);
        let old = self.pending.lock().expect("wills").insert(client_id.to_string(), (generation, cancel.clone()));
        if let Some((_, old)) = old {
            old.cancel();
        }
        let delay = props.as_ref().and_then(|p| p.delay_interval).unwrap_or(0).min(session_expiry);
        let _ = self.tx.send(PendingWill {
            client_id: client_id.to_string(),
            device: device.to_string(),
            quotas: quotas.clone(),
            generation,
            topic: String::from_utf8_lossy(&will.topic).into_owned(),
            payload: will.message,
            retain: will.retain,
            qos: will.qos,
            props: props.map(publish_properties),
            delay: Duration::from_secs(delay.into()),
            cancel,
        });
    }

    /// A client id connected: a delayed will of its last connection is not
    /// published.
    pub fn cancel(&self, client_id: &str) {
        if let Some((_, t)) = self.pending.lock().expect("wills").remove(client_id) {
            t.cancel();
        }
    }

    /// A will was published or cancelled: forget it, unless a newer one of
    /// the same client id took its place.
    pub fn done(&self, w: &PendingWill) {
        let mut g = self.pending.lock().expect("wills");
        if g.get(&w.client_id).is_some_and(|(gen, _)| *gen == w.generation) {
            g.remove(&w.client_id);
        }
    }
}

impl PendingWill {
    /// Counts the will against its device's quotas as it is published:
    /// whether it is retained (not over the retained quota), or `None` when
    /// it is not published (over the topic quota).
    fn counted(&self) -> Option<bool> {
        let (quotas, topic, len) = (&self.quotas, self.topic.as_bytes(), self.payload.len());
        let mut retain = self.retain;
        let mut counted = quotas.publish(&self.device, topic, retain, len);
        if let Err(Quota::Retained | Quota::RetainedBytes) = counted {
            retain = false;
            counted = quotas.publish(&self.device, topic, false, len);
        }
        match counted {
            Ok(()) => Some(retain),
            Err(quota) => {
                tracing::info!(device = %self.device, reason = quota.reason(), "MQTT: will dropped");
                None
            }
        }
    }
}

/// The PUBLISH properties of a will.
fn publish_properties(p: LastWillProperties) -> PublishProperties {
    PublishProperties {
        payload_format_indicator: p.payload_format_indicator,
        message_expiry_interval: p.message_expiry_interval,
        content_type: p.content_type,
        // As the device sent it, like a PUBLISH's (only topic names are
        // mounted).
        response_topic: p.response_topic,
        correlation_data: p.correlation_data,
        user_properties: p.user_properties,
        ..Default::default()
    }
}

/// Publishes armed wills, each after its delay unless its client id
/// connected again meanwhile. A will reaches each subscriber at the lower
/// of its QoS and the subscription's, as a PUBLISH at the will QoS would
/// (MQTT 5 section 3.8.4).
pub async fn publish_loop(
    wills: Arc<Wills>,
    out: Arc<Publisher>,
    mut rx: UnboundedReceiver<PendingWill>,
    tracker: TaskTracker,
    shutdown: CancellationToken,
) {
    loop {
        let w = tokio::select! {
            _ = shutdown.cancelled() => return,
            w = rx.recv() => match w { Some(w) => w, None => return },
        };
        let (wills, out, shutdown) = (wills.clone(), out.clone(), shutdown.clone());
        tracker.spawn(async move {
            let publish = tokio::select! {
                _ = shutdown.cancelled() => false,
                _ = w.cancel.cancelled() => false,
                _ = tokio::time::sleep(w.delay) => true,
            };
            wills.done(&w);
            let Some(retain) = publish.then(|| w.counted()).flatten() else { return };
            if out.publish_at(&w.topic, w.payload.clone(), w.props.clone(), retain, w.qos).is_err() {
                tracing::warn!(client_id = %w.client_id, "MQTT: could not publish a will (router gone)");
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quotas() -> Arc<DeviceQuotas> {
        use super::super::connections::QuotaLimits;
        Arc::new(DeviceQuotas::new(QuotaLimits { retained: 1, retained_bytes: 100, topics: 2 }))
    }

    fn will() -> LastWill {
        LastWill { topic: "d/dev1/status".into(), message: "gone".into(), qos: QoS::AtMostOnce, retain: false }
    }

    fn props(delay: u32) -> Option<LastWillProperties> {
        Some(LastWillProperties {
            delay_interval: Some(delay),
            payload_format_indicator: None,
            message_expiry_interval: None,
            content_type: None,
            response_topic: Some("r".into()),
            correlation_data: None,
            user_properties: vec![],
        })
    }

    #[test]
    fn the_delay_is_bounded_by_the_session_and_a_reconnect_cancels() {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let wills = Wills::new(tx);
        let q = quotas();
        wills.arm("c1", ("t/dev1", &q), will(), props(30), 10);
        let w = rx.try_recv().unwrap();
        assert_eq!((w.delay, w.topic.as_str()), (Duration::from_secs(10), "d/dev1/status"));
        assert_eq!(w.props.as_ref().and_then(|p| p.response_topic.as_deref()), Some("r"));
        // 3.1.1 (no session after the connection): at once.
        wills.arm("c2", ("t/dev1", &q), will(), None, 0);
        assert_eq!(rx.try_recv().unwrap().delay, Duration::ZERO);
        wills.cancel("c1");
        assert!(w.cancel.is_cancelled());
    }

    #[test]
    fn a_newer_will_replaces_an_older_one_of_the_same_client_id() {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let wills = Wills::new(tx);
        let q = quotas();
        wills.arm("c1", ("t/dev1", &q), will(), props(60), 60);
        wills.arm("c1", ("t/dev1", &q), will(), props(60), 60);
        let (old, new) = (rx.try_recv().unwrap(), rx.try_recv().unwrap());
        assert!(old.cancel.is_cancelled() && !new.cancel.is_cancelled());
        // The old one finishing does not forget the new one.
        wills.done(&old);
        wills.cancel("c1");
        assert!(new.cancel.is_cancelled());
    }

    #[test]
    fn a_will_counts_when_it_is_published() {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let wills = Wills::new(tx);
        let q = quotas();
        let retained = |topic: &str| LastWill { topic: topic.to_string().into(), retain: true, ..will() };
        wills.arm("c1", ("t/dev1", &q), retained("d/dev1/a"), None, 0);
        let w = rx.try_recv().unwrap();
        assert_eq!(q.retained("t/dev1"), (0, 0), "armed: not counted");
        assert_eq!(w.counted(), Some(true));
        assert_eq!(q.retained("t/dev1").0, 1);
        wills.arm("c1", ("t/dev1", &q), retained("d/dev1/b"), None, 0);
        assert_eq!(rx.try_recv().unwrap().counted(), Some(false), "over the retained quota: not kept");
        wills.arm("c1", ("t/dev1", &q), retained("d/dev1/c"), None, 0);
        assert_eq!(rx.try_recv().unwrap().counted(), None, "over the topic quota: not published");
    }
}
