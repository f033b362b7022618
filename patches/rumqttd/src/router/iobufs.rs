use std::{
    collections::{HashMap, VecDeque},
    sync::Arc,
};

use flume::{Receiver, Sender};
use parking_lot::Mutex;
use tracing::{error, warn};

use crate::{
    protocol::Packet,
    router::{FilterIdx, MAX_CHANNEL_CAPACITY},
    Cursor, Notification,
};

use super::{Forward, IncomingMeter, OutgoingMeter};

const MAX_INFLIGHT: usize = 100;
const MAX_PKID: u16 = MAX_INFLIGHT as u16;

#[derive(Debug)]
pub struct Incoming {
    /// Identifier associated with connected client
    pub(crate) client_id: String,
    /// Recv buffer
    pub(crate) buffer: Arc<Mutex<VecDeque<Packet>>>,
    /// incoming metrics
    pub(crate) meter: IncomingMeter,
}

impl Incoming {
    #[inline]
    pub(crate) fn new(client_id: String) -> Self {
        Self {
            // Empty until the first packets: an idle connection holds no
            // queue (200 packets, 78 KB, were reserved up front). (edgeway
            // patch, see PATCHES.md)
            buffer: Arc::new(Mutex::new(VecDeque::new())),
            meter: Default::default(),
            client_id,
        }
    }

    #[inline]
    pub(crate) fn buffer(&self) -> Arc<Mutex<VecDeque<Packet>>> {
        self.buffer.clone()
    }

    #[inline]
    pub(crate) fn exchange(&mut self, mut v: VecDeque<Packet>) -> VecDeque<Packet> {
        std::mem::swap(&mut v, &mut self.buffer.lock());
        v
    }
}

#[derive(Debug)]
pub struct Outgoing {
    /// Identifier associated with connected client
    pub(crate) client_id: String,
    /// Send buffer
    pub(crate) data_buffer: Arc<Mutex<VecDeque<Notification>>>,
    /// Handle which is given to router to allow router to communicate with this connection
    pub(crate) handle: Sender<()>,
    /// The buffer to keep track of inflight packets.
    /// (packet id, share key ([`share_key`]), filter, cursor); the share
    /// key fits beside the packet id, so an entry is no larger (edgeway
    /// patch 38)
    inflight_buffer: VecDeque<(u16, u32, FilterIdx, Option<Cursor>)>,
    /// PubRels waiting for PubComp
    pub(crate) unacked_pubrels: VecDeque<u16>,
    /// Last packet id
    last_pkid: u16,
    /// Metrics of outgoing messages of this connection
    pub(crate) meter: OutgoingMeter,
    /// Most QoS 1/2 publishes unacknowledged at once: the client's Receive
    /// Maximum, at most `MAX_INFLIGHT`. (edgeway patch, see PATCHES.md)
    max_inflight: usize,
}

impl Outgoing {
    #[inline]
    pub(crate) fn new(client_id: String) -> (Self, Receiver<()>) {
        let (handle, rx) = flume::bounded(MAX_CHANNEL_CAPACITY);
        // The queues grow as the connection uses them (their bounds,
        // `MAX_CHANNEL_CAPACITY` and `max_inflight`, are checked by
        // length): reserved up front at their bounds they cost an idle
        // connection 54 KB. (edgeway patch, see PATCHES.md)
        let data_buffer = VecDeque::new();
        let inflight_buffer = VecDeque::new();
        let unacked_pubrels = VecDeque::new();

        let outgoing = Self {
            client_id,
            data_buffer: Arc::new(Mutex::new(data_buffer)),
            inflight_buffer,
            unacked_pubrels,
            handle,
            last_pkid: 0,
            meter: Default::default(),
            max_inflight: MAX_INFLIGHT,
        };

        (outgoing, rx)
    }

    #[inline]
    pub(crate) fn buffer(&self) -> Arc<Mutex<VecDeque<Notification>>> {
        self.data_buffer.clone()
    }

    /// The client's Receive Maximum (MQTT 5 CONNECT; `None`: none told, 65
    /// 535 by the specification): the broker never has more QoS 1/2
    /// publishes unacknowledged towards the client; the rest wait in the
    /// filter logs. (edgeway patch, see PATCHES.md)
    pub fn set_receive_maximum(&mut self, receive_maximum: Option<u16>) {
        let max = receive_maximum.map_or(MAX_INFLIGHT, usize::from);
        self.max_inflight = max.clamp(1, MAX_INFLIGHT);
    }

    pub fn free_slots(&self) -> usize {
        self.max_inflight.saturating_sub(self.inflight_buffer.len())
    }

    pub fn push_notification(&mut self, notification: Notification) -> usize {
        let mut buffer = self.data_buffer.lock();
        buffer.push_back(notification);
        buffer.len()
    }

    /// Push packets to the outgoing buffer.
    /// `share`: the [`share_key`] of the request the publishes are for.
    pub fn push_forwards(
        &mut self,
        publishes: impl Iterator<Item = Forward>,
        qos: u8,
        filter_idx: usize,
        share: u32,
    ) -> (usize, usize) {
        let mut buffer = self.data_buffer.lock();
        let publishes = publishes;

        if qos == 0 {
            for p in publishes {
                self.meter.publish_count += 1;
                buffer.push_back(Notification::Forward(p));
                // self.meter.total_size += p.len();
            }

            // self.meter.update_data_rate(total_size);
            let buffer_count = buffer.len();
            let inflight_count = self.inflight_buffer.len();
            return (buffer_count, inflight_count);
        }

        for mut p in publishes {
            // Index and pkid of current outgoing packet
            self.last_pkid += 1;
            p.publish.pkid = self.last_pkid;

            self.inflight_buffer
                .push_back((self.last_pkid, share, filter_idx, p.cursor));

            // Place max pkid packet at index 0
            if self.last_pkid == MAX_PKID {
                self.last_pkid = 0;
            }

            self.meter.publish_count += 1;
            self.meter.total_size += p.publish.topic.len() + p.publish.payload.len();
            buffer.push_back(Notification::Forward(p));
        }

        let buffer_count = buffer.len();
        let inflight_count = self.inflight_buffer.len();

        if inflight_count > MAX_INFLIGHT {
            warn!(
                "More inflight publishes than max allowed, inflight count = {}, max allowed = {}",
                inflight_count, MAX_INFLIGHT
            );
        }

        (buffer_count, inflight_count)
    }

    /// Takes the PUBACK or PUBREC of `pkid`; `None` if nothing with that
    /// id is in flight (unsolicited). Out of order is fine: a client may
    /// complete a QoS 2 flow before it acknowledges an earlier QoS 1
    /// message (MQTT-4.6.0; rumqttd disconnected it, edgeway patch 37).
    /// What stays in flight keeps its order, so the first entry of a
    /// filter is still its earliest cursor (`retransmission_map`).
    pub fn register_ack(&mut self, pkid: u16) -> Option<()> {
        let at = self.inflight_buffer.iter().position(|(id, ..)| *id == pkid);
        let Some(at) = at else {
            error!(pkid, "unsolicited ack.");
            return None;
        };
        self.inflight_buffer.remove(at);
        Some(())
    }

    pub fn register_pubrec(&mut self, pkid: u16) {
        // NOTE: we can return true of false
        // to indicate whether this is duplicate or not
        self.unacked_pubrels.push_back(pkid);
    }

    // OASIS standards don't specify anything about ordering of PubComp
    // https://docs.oasis-open.org/mqtt/mqtt/v5.0/os/mqtt-v5.0-os.html#_Toc3901240
    // Out of order is taken, as for the other acks (edgeway patch 37);
    // an unsolicited one is not.
    pub fn register_pubcomp(&mut self, pkid: u16) -> Option<()> {
        let at = self.unacked_pubrels.iter().position(|id| *id == pkid);
        let Some(at) = at else {
            error!(pkid, "unsolicited pubcomp.");
            return None;
        };
        self.unacked_pubrels.remove(at);
        Some(())
    }

    // Here we are assuming that the first unique filter_idx we find while iterating will have the
    // least corresponding cursor because of the way we insert into the inflight_buffer
    // Keyed by filter and share key: a connection's plain and `$share`
    // requests on one filter are rewound each to its own (edgeway patch 38)
    pub fn retransmission_map(&self) -> HashMap<(FilterIdx, u32), Cursor> {
        let mut o = HashMap::new();
        for (_, share, filter_idx, cursor) in self.inflight_buffer.iter() {
            // if cursor in None, it means it was a retained publish
            if let Some(cursor) = cursor {
                o.entry((*filter_idx, *share)).or_insert(*cursor);
            }
        }

        o
    }
}

/// Tells apart a connection's requests on one filter in flight: 0 for the
/// plain one, else from the name of its share group (nonzero). (edgeway
/// patch 38)
pub(crate) fn share_key(group: Option<&str>) -> u32 {
    use std::hash::{Hash, Hasher};
    group.map_or(0, |g| {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        g.hash(&mut h);
        (h.finish() as u32) | 1
    })
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn retransmission_map_is_calculated_accurately() {
        let (mut outgoing, _) = Outgoing::new("retransmission-test".to_string());
        let mut result = HashMap::new();

        result.insert((0, 0), (0, 8));
        result.insert((1, 0), (0, 1));
        result.insert((2, 0), (1, 1));
        result.insert((3, 0), (1, 0));
        result.insert((3, 5), (1, 2));

        let buf = vec![
            (1, 0, 0, Some((0, 8))),
            (1, 0, 0, Some((0, 10))),
            (1, 0, 1, Some((0, 1))),
            (3, 0, 1, Some((0, 4))),
            (2, 0, 2, Some((1, 1))),
            (1, 0, 2, Some((2, 6))),
            (1, 0, 2, Some((2, 1))),
            (1, 5, 3, Some((1, 2))),
            (1, 0, 3, Some((1, 0))),
            (1, 0, 3, Some((1, 1))),
            (1, 0, 3, Some((1, 3))),
            (1, 0, 3, Some((1, 3))),
        ];

        outgoing.inflight_buffer.extend(buf);
        assert_eq!(outgoing.retransmission_map(), result);
    }

    // use super::{Outgoing, MAX_INFLIGHT};
    // use crate::protocol::{Publish, QoS};
    // use crate::router::Forward;
    // use crate::Notification;
    //
    // fn publishes(count: usize) -> impl Iterator<Item = Forward> {
    //     (1..=count).map(|v| {
    //         let publish = Publish {
    //             dup: false,
    //             retain: false,
    //             pkid: 0,
    //             qos: QoS::AtLeastOnce,
    //             topic: "hello/world".into(),
    //             payload: vec![1, 2, 3].into(),
    //         };
    //
    //         Forward {
    //             cursor: (0, v as u64),
    //             publish,
    //             size: 0,
    //         }
    //     })
    // }
    //
    // #[test]
    // fn inflight_ring_buffer_pushes_correctly() {
    //     let count = MAX_INFLIGHT as usize;
    //     let (mut outgoing, _rx) = Outgoing::new("hello".to_owned());
    //     outgoing.push_forwards(publishes(count), 1, 3);
    //
    //     // Index 1 = (0, 1), Index 99 = (0, 99), Index 0 = (0, 100)
    //     assert_eq!(outgoing.inflight_buffer[0].unwrap().1, (0, count as u64));
    //     for i in 1..count {
    //         assert_eq!(outgoing.inflight_buffer[i].unwrap().1, (0, i as u64));
    //     }
    //
    //     // Outgoing publish pkids are as expected
    //     for (i, o) in outgoing.data_buffer.lock().iter().enumerate() {
    //         let pkid = match &o {
    //             Notification::Forward(f) => f.publish.pkid,
    //             _ => unreachable!(),
    //         };
    //
    //         assert_eq!(pkid, i as u16 + 1);
    //     }
    // }
    //
    // #[test]
    // fn inflight_ring_buffer_pops_correctly() {
    //     let (mut outgoing, _rx) = Outgoing::new("hello".to_owned());
    //     outgoing.push_forwards(publishes(MAX_INFLIGHT as usize), 1, 3);
    //
    //     for pkid in 1..=MAX_INFLIGHT {
    //         let (unsolicited, outoforder) = outgoing.register_ack(pkid);
    //         assert_eq!(unsolicited, false);
    //         assert_eq!(outoforder, false);
    //     }
    // }
}
