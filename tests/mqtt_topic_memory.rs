//! rumqttd's memory per topic name (PATCHES.md #8). A test binary of its
//! own: it counts the live heap bytes of the whole process with a global
//! allocator, which any test running beside it would disturb.
//!
//! edgeway publishes every response stream to a topic of its own
//! (`…/res/{request_id}`), from one local link that lives as long as the
//! process, so whatever the router keeps per topic name grows with every
//! request ever served (the one-hour soak found it).

mod heap;

use rumqttd::local::LinkBuilder;
use rumqttd::{Notification, Router, RouterConfig};

/// Publishes `n` messages from `first` on, each to a topic never used
/// before, in batches; after each batch waits until the subscriber got its
/// last message (the router has handled the batch).
fn publish_new_topics(tx: &mut rumqttd::local::LinkTx, rx: &mut rumqttd::local::LinkRx, first: usize, n: usize) {
    const BATCH: usize = 200;
    let mut i = first;
    while i < first + n {
        let end = (i + BATCH).min(first + n);
        for k in i..end {
            tx.publish(format!("t/dev/res/request-{k:08}"), "x").expect("publish");
        }
        let last = format!("t/dev/res/request-{:08}", end - 1);
        loop {
            // A subscriber that falls behind the (tiny) log skips ahead, but
            // always gets the newest message.
            match rx.recv_deadline(std::time::Instant::now() + std::time::Duration::from_secs(10)) {
                Ok(Some(Notification::Forward(f))) if f.publish.topic == last.as_bytes() => break,
                // The link's buffer filled up before this thread emptied it
                // (MAX_CHANNEL_CAPACITY, 200, one batch): the router pauses
                // the link until told it is ready, as edgeway's own link
                // does (src/ingress/mqtt/mod.rs). Without this the test hung
                // whenever this thread fell behind (seen once in CI, under
                // load).
                Ok(Some(Notification::Unschedule)) => rx.ready().expect("ready"),
                Ok(_) => {}
                Err(e) => panic!("the router did not deliver {last}: {e}"),
            }
        }
        i = end;
    }
}

#[test]
fn rumqttd_memory_does_not_grow_with_topic_names() {
    let router = Router::new(
        0,
        RouterConfig {
            max_connections: 10,
            max_outgoing_packet_count: 200,
            // The smallest log the router allows: what it keeps of the
            // messages themselves is a few kB, whatever their number.
            max_segment_size: 1024,
            max_segment_count: 2,
            custom_segment: None,
            initialized_filters: Some(vec!["t/#".to_string()]),
            shared_subscriptions_strategy: Default::default(),
            // Later settings of the patched crate (the kept-session cap).
            ..Default::default()
        },
    );
    let router_tx = router.spawn();
    let (mut tx, mut rx, _) = LinkBuilder::new("probe", router_tx).build().expect("local link");
    tx.subscribe("t/#").expect("subscribe");

    // Warm up past every bound the router may have per topic (the topic
    // cache keeps 4096), then count what 40 000 more new topics add.
    publish_new_topics(&mut tx, &mut rx, 0, 10_000);
    let before = heap::live();
    publish_new_topics(&mut tx, &mut rx, 10_000, 40_000);
    let grown = heap::live() - before;
    // Before the patch: about 230 bytes per new topic (a meter per topic
    // on the link, and the router's topic -> filters cache), 9 MB here.
    // After: the cache's refill, at most 4096 entries (well under 1 MB).
    assert!(grown < 3 * 1024 * 1024, "the heap grew {grown} bytes over 40 000 new topic names");
}
