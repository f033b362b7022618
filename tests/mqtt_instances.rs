//! Instances per device (`mqtt.max_instances_per_device`) over time: an
//! instance that disconnected no longer counts. Real broker, real sockets.

mod common;
mod mqtt_support;

use mqtt_support::*;

/// Review M5: the count was opened under the bare device id and closed
/// under the mount `{tenant}/{device}`, so it never went down: after
/// `max_instances_per_device` different client ids, every new instance of
/// the device was refused (0x97) until edgeway restarted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_that_disconnected_no_longer_count_against_the_limit() {
    let (_fake, gw, addr) = start(Knobs::default(), "max_instances_per_device = 2").await;
    for id in ["demo-device-1:a", "demo-device-1:b"] {
        let mut d = connect(addr, V::V5, id, D1.0, D1.1).await.expect("instance connects");
        assert!(until_devices_connected(&gw, 1).await);
        d.disconnect_and_wait().await;
        // The count drops where the broker reports the device gone.
        assert!(until_devices_connected(&gw, 0).await);
    }
    let _c = connect(addr, V::V5, "demo-device-1:c", D1.0, D1.1).await.expect("a third instance after two left");
    let _d = connect(addr, V::V4, "demo-device-1:d", D1.0, D1.1).await.expect("a fourth, two at once");
    let e = connect(addr, V::V5, "demo-device-1:e", D1.0, D1.1).await.err().expect("a third at once is refused");
    assert!(e.contains("QuotaExceeded"), "{e}");
    gw.stop().await;
}
