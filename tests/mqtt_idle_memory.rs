//! What an idle MQTT device costs the broker in heap (issue 18, "Idle
//! devices"; PATCHES.md #39). A test binary of its own: it counts the live
//! heap bytes of the whole process with a global allocator, which any test
//! running beside it would disturb.
//!
//! The release figure (resident memory per connection against Mosquitto)
//! is `devices-sim/bench/connections.py`; this test guards the cause found
//! there: rumqttd reserved every per-connection queue at its bound up front
//! (about 210 kB of heap per connection, most of it never touched), so that
//! reservations cannot come back unnoticed. It also checks that a device
//! still gets a packet larger than the buffers an idle connection starts
//! with.

mod heap;

mod mqtt_support;

use mqtt_support::raw;
use tokio::io::AsyncWriteExt;

const WARM: usize = 20;
const IDLE: usize = 200;
/// The device whose CONNECT is larger than the read buffer a connection
/// starts with (rumqttd's `FIRST_READ_BYTES`, 256), as a JWT login's is.
const LONG: usize = WARM + IDLE;

fn creds(i: usize) -> (String, String) {
    let pass = match i {
        LONG => format!("idle-pass-{}", "x".repeat(1000)),
        _ => format!("idle-pass-{i}"),
    };
    (format!("idle-{i}"), pass)
}

/// `[mqtt]` with `n` devices (the demo devices of `mqtt_support` too).
fn devices_toml(n: usize) -> String {
    let mut toml = mqtt_support::mqtt_toml("");
    for i in 0..n {
        let (user, pass) = creds(i);
        let hash = hex::encode(edgeway::config::hash_api_key(&pass));
        toml += &format!("[devices.{user}]\ntenant = \"demo\"\napplication = \"demo\"\npassword_sha256 = \"{hash}\"\n");
    }
    toml
}

async fn connect(addr: std::net::SocketAddr, i: usize) -> tokio::net::TcpStream {
    let (user, pass) = creds(i);
    let (s, ack) = raw::connack(addr, &raw::connect(&user, Some((&user, &pass))))
        .await
        .unwrap_or_else(|| panic!("no CONNACK for {user}"));
    assert_eq!(ack, raw::ACCEPTED, "{user} is refused");
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_device_costs_the_broker_little_heap_and_large_packets_still_pass() {
    let fake = edgeway::testing::FakeEngine::start_with(edgeway::testing::Knobs::default()).await;
    let gw = edgeway::testing::TestGateway::with_engine(&fake.url(), "openai", &devices_toml(WARM + IDLE + 1)).await;
    gw.wait_ready().await;
    let addr = gw.running.as_ref().unwrap().mqtt.expect("mqtt is configured").mqtt;

    // Warm up what grows once (runtime registrations, slabs, the
    // connection table), then count what idle connections add.
    let mut sockets = Vec::new();
    for i in 0..WARM {
        sockets.push(connect(addr, i).await);
    }
    assert!(mqtt_support::until_devices_connected(&gw, WARM as i64).await);
    let before = heap::live();
    for i in WARM..WARM + IDLE {
        sockets.push(connect(addr, i).await);
    }
    assert!(mqtt_support::until_devices_connected(&gw, (WARM + IDLE) as i64).await);
    let per_connection = (heap::live() - before) / IDLE as isize;
    eprintln!("heap per idle connection: {per_connection} bytes");
    // Before PATCHES.md 39: about 215 000 bytes (queues reserved at their
    // bounds: 200 incoming packets, 2 x 200 and 2 x 100 notifications, 100
    // acknowledgements, 100 in-flight entries). Before 40, 17 492 (debug
    // build): the connection's task as large as its largest transient step
    // and two 2 KiB buffers. Before 41, 11 404: the task kept the values
    // its set-up moved into the link, and 780-byte errors. After: 7 914
    // (debug; a debug build's futures are larger than a release build's).
    assert!(per_connection < 10 * 1024, "an idle connection holds {per_connection} bytes of heap");

    // A packet far larger than the buffers an idle connection starts with,
    // both ways, on a connection idle until now: it subscribes within its
    // device's subtree and gets its own 60 kB publish back whole.
    let mut s = sockets.pop().unwrap();
    s.write_all(&raw::subscribe(1, "big")).await.unwrap();
    let suback = raw::packet(&mut s).await.expect("a SUBACK");
    assert_eq!(suback[0], 0x90, "a SUBACK: {suback:?}");
    let payload = vec![b'x'; 60 * 1024];
    s.write_all(&raw::publish("big", &payload)).await.unwrap();
    let back = raw::packet(&mut s).await.expect("the publish back");
    assert_eq!(back[0] & 0xF0, 0x30, "a PUBLISH");
    assert!(back.ends_with(&payload), "the payload back whole ({} bytes)", back.len());
    // And again: a buffer that grew for it (or was given back) still works.
    s.write_all(&raw::publish("big", b"small")).await.unwrap();
    let back = raw::packet(&mut s).await.expect("the small publish back");
    assert!(back.ends_with(b"small"));

    // A CONNECT larger than the read buffer a connection starts with.
    let (user, pass) = creds(LONG);
    assert!(raw::connect(&user, Some((&user, &pass))).len() > 1000);
    let mut long = connect(addr, LONG).await;
    long.write_all(&raw::subscribe(1, "long")).await.unwrap();
    let suback = raw::packet(&mut long).await.expect("a SUBACK");
    assert_eq!(suback[0], 0x90, "a SUBACK: {suback:?}");
    drop(fake);
}
