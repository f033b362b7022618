//! `[mqtt] mode = "external"`: edgeway as a client of a real Mosquitto
//! broker (started here on a free port, with the ACL and password files
//! `edgeway mqtt-acl` writes from the test config), devices as rumqttc
//! clients of the same broker, fake engines behind edgeway.

mod common;
mod mqtt_support;

use std::path::Path;
use std::sync::atomic::Ordering::SeqCst;
use std::time::Duration;

use edgeway::config::Config;
use edgeway::ingress::mqtt::acl;
use edgeway::testing::{config_toml, Mosquitto, TempDir};
use mqtt_support::*;
use serde_json::{json, Value};

/// edgeway's own password on the broker (the environment variable its
/// `password_env` names, handed to the config loader).
const EDGEWAY_PASSWORD: &str = "edgeway-broker-pass";
const PASSWORD_ENV: &str = "EDGEWAY_TEST_BROKER_PASSWORD";

/// `[mqtt]` in external mode on `port`, and the demo devices (with their
/// plain passwords in the environment for `edgeway mqtt-acl`).
fn external_toml(port: u16, client_id: &str) -> String {
    let hash = |p: &str| hex::encode(edgeway::config::hash_api_key(p));
    format!(
        r#"
[mqtt]
mode = "external"
coalesce_ms = 0
[mqtt.external]
host = "127.0.0.1"
port = {port}
client_id = "{client_id}"
username = "edgeway"
password_env = "{PASSWORD_ENV}"
[devices.demo-device-1]
tenant = "demo"
application = "demo"
password_sha256 = "{}"
mqtt_password_env = "EDGEWAY_TEST_D1"
[devices.demo-device-2]
tenant = "demo"
application = "demo"
password_sha256 = "{}"
mqtt_password_env = "EDGEWAY_TEST_D2"
"#,
        hash(D1.1),
        hash(D2.1)
    )
}

fn env() -> Vec<(String, String)> {
    vec![
        (PASSWORD_ENV.to_string(), EDGEWAY_PASSWORD.to_string()),
        ("EDGEWAY_TEST_D1".to_string(), D1.1.to_string()),
        ("EDGEWAY_TEST_D2".to_string(), D2.1.to_string()),
    ]
}

fn config(engine_url: &str, data: &Path, port: u16, node: &str) -> Config {
    config_with(engine_url, data, port, node, "")
}

/// [`config`] with more keys of `[mqtt.external]`.
fn config_with(engine_url: &str, data: &Path, port: u16, node: &str, external: &str) -> Config {
    let mqtt = external_toml(port, &format!("edgeway-{node}"))
        .replace("[devices.demo-device-1]", &format!("{external}\n[devices.demo-device-1]"));
    let text = config_toml(engine_url, "openai", data, &mqtt)
        .replace("node_id = \"test-node\"", &format!("node_id = \"{node}\""));
    Config::from_toml_str(&text, env(), Path::new(".")).unwrap_or_else(|e| panic!("test config: {e}\n{text}"))
}

/// A Mosquitto that takes only edgeway's user and the demo devices, each
/// limited by the ACLs generated from the test config's registry (written
/// as the `edgeway mqtt-acl` command writes them).
async fn acl_broker() -> Mosquitto {
    let tmp = acl_files();
    // The broker keeps copies: the folder may go.
    Mosquitto::with_acl(&tmp.0.join("mosquitto.passwd"), &tmp.0.join("mosquitto.acl")).await
}

/// `mosquitto.passwd`, `mosquitto.acl` and `emqx-acl.conf` of the test
/// config, in a folder of their own.
fn acl_files() -> TempDir {
    let tmp = TempDir::new("edgeway-acl");
    // The files do not depend on the broker's port.
    let cfg = config("http://127.0.0.1:1", &tmp.0, 1, "a");
    let env: std::collections::HashMap<String, String> = env().into_iter().collect();
    let files = acl::broker_files(&cfg, |v| env.get(v).cloned(), true).expect("broker files");
    let written = acl::write_files(&tmp.0, &files).unwrap();
    assert_eq!(written.len(), 3);
    tmp
}

/// Waits until edgeway's broker connection, as `/ready` reports it,
/// satisfies `cond`.
async fn until_broker(gw: &TestGateway, what: &str, cond: impl Fn(&Value) -> bool) -> Value {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let m = gw.gateway().readiness().await.unwrap().mqtt_bus.expect("the external broker is reported");
        if cond(&m) {
            return m;
        }
        assert!(tokio::time::Instant::now() < deadline, "edgeway's broker connection never became {what}: {m}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A gateway of node `node` on the broker at `port`, with its data
/// directory; returns once the broker has granted all its subscriptions.
async fn gateway(engine_url: &str, port: u16, node: &str) -> (TestGateway, TempDir) {
    let tmp = TempDir::new("edgeway-ext");
    let gw = TestGateway::start(config(engine_url, &tmp.0, port, node)).await;
    gw.wait_ready().await;
    let m = until_broker(&gw, "subscribed", |m| m["subscribed"] == true).await;
    assert_eq!(m["state"], "connected");
    (gw, tmp)
}

#[tokio::test]
async fn a_device_gets_a_streamed_answer_through_mosquitto() {
    let broker = acl_broker().await;
    let fake = FakeEngine::start_with(Knobs::slow(5, 5)).await;
    let (gw, _tmp) = gateway(&fake.url(), broker.port, "a").await;
    assert!(gw.running.as_ref().unwrap().mqtt.is_none(), "no embedded broker in external mode");

    let mut d = device(broker.addr(), V::V5, D1).await;
    d.subscribe(&d.topic("res/#")).await;
    d.publish(&d.topic("req"), request("ext-1").to_string()).await;
    let events = d.stream(&d.topic("res/ext-1")).await;
    assert_eq!(events[0]["type"], "accepted", "{events:#?}");
    let text = check_stream(&events);
    assert_eq!(text, "tok tok tok tok tok ");
    let done = events.last().unwrap();
    assert_eq!(done["type"], "done", "{done}");
    assert_eq!(done["result"]["node_id"], "a", "{done}");

    // The retained model catalogue is on the broker too.
    d.subscribe("ai/v1/shared/models").await;
    let catalogue = d.msg().await.json();
    assert_eq!(catalogue["node_id"], "a");

    // The connection is reported in /ready and the metrics.
    assert_eq!(metric(&gw, "mqtt_broker_connected"), Some(1.0));
    let ready: Value = common::client()
        .get(format!("{}/ready", gw.base_url))
        .bearer_auth(edgeway::testing::OPS_KEY)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let m = &ready["mqtt_broker"];
    assert_eq!((&m["mode"], &m["state"], &m["subscribed"]), (&json!("external"), &json!("connected"), &json!(true)));
    assert_eq!(m["broker"], format!("127.0.0.1:{}", broker.port));
    gw.stop().await;
}

#[tokio::test]
async fn a_cancel_through_the_broker_stops_the_engine() {
    let broker = acl_broker().await;
    let fake = FakeEngine::start_with(Knobs::slow(1000, 20)).await;
    let (gw, _tmp) = gateway(&fake.url(), broker.port, "a").await;
    let mut d = device(broker.addr(), V::V5, D1).await;
    d.subscribe(&d.topic("res/#")).await;
    d.publish(&d.topic("req"), request("to-cancel").to_string()).await;
    let mut events = vec![d.msg().await.json(), d.msg().await.json()];
    assert_eq!(events[1]["type"], "delta", "{events:#?}");
    d.publish(&d.topic("cancel"), json!({"request_id": "to-cancel"}).to_string()).await;
    events.extend(d.stream(&d.topic("res/to-cancel")).await);
    check_stream(&events);
    let last: &Value = events.last().unwrap();
    assert_eq!(last["code"], "REQUEST_CANCELLED", "{last}");
    assert!(fake.wait_for(Duration::from_secs(10), |s| s.active.load(SeqCst) == 0).await);
    assert_eq!(fake.stats.aborted.load(SeqCst), 1);
    gw.stop().await;
}

#[tokio::test]
async fn a_device_the_registry_does_not_list_is_refused() {
    // A broker that lets anyone in (with the generated files the stranger
    // could not even connect): edgeway itself refuses the unlisted id.
    let broker = Mosquitto::anonymous().await;
    let fake = FakeEngine::start().await;
    let (gw, _tmp) = gateway(&fake.url(), broker.port, "a").await;
    let mut stranger = connect(broker.addr(), V::V5, "stranger", "stranger", "x").await.unwrap();
    stranger.subscribe("ai/v1/stranger/res/#").await;
    stranger.publish("ai/v1/stranger/req", request("s-1").to_string()).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while metric(&gw, "mqtt_rejected_total{code=\"AUTH_FAILED\"}") != Some(1.0) {
        assert!(tokio::time::Instant::now() < deadline, "the stranger's request was not refused");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(fake.requests(), 0);
    assert!(stranger.drain().is_empty());
    gw.stop().await;
}

/// With the generated ACLs, device B reads nothing of device A's, whatever
/// filters it uses, and cannot publish a request in A's name; a wrong
/// password is refused by the broker.
#[tokio::test]
async fn the_generated_acls_keep_devices_apart() {
    let broker = acl_broker().await;
    let fake = FakeEngine::start_with(Knobs::slow(5, 5)).await;
    let (gw, _tmp) = gateway(&fake.url(), broker.port, "a").await;
    let refused = connect(broker.addr(), V::V5, D1.0, D1.0, "not-the-password").await;
    assert!(refused.is_err(), "a wrong password is refused by the broker");

    let mut a = device(broker.addr(), V::V5, D1).await;
    let mut b = device(broker.addr(), V::V5, D2).await;
    for filter in ["#", "ai/v1/+/res/#", "ai/v1/demo-device-1/#", "ai/v1/demo-device-1/res/a-1", "$share/x/ai/v1/#"] {
        b.subscribe(filter).await;
    }
    a.subscribe(&a.topic("res/#")).await;
    // B publishes a request in A's name: the broker drops it.
    b.publish("ai/v1/demo-device-1/req", request("spoofed").to_string()).await;
    a.publish(&a.topic("req"), request("a-1").to_string()).await;
    let events = a.stream(&a.topic("res/a-1")).await;
    assert_eq!(events.last().unwrap()["type"], "done", "{events:#?}");

    // B's own request is answered: B's filters do work, on its own topics.
    b.publish(&b.topic("req"), request("b-1").to_string()).await;
    let mut seen = Vec::new();
    loop {
        let m = b.msg().await;
        let done = m.topic == b.topic("res/b-1") && m.json()["type"] == "done";
        seen.push(m.topic);
        if done {
            break;
        }
    }
    let foreign: Vec<_> =
        seen.iter().filter(|t| !t.starts_with("ai/v1/demo-device-2/") && !t.starts_with("ai/v1/shared/")).collect();
    assert!(foreign.is_empty(), "device B read another device's messages: {foreign:?}");
    // Only A's and B's own requests reached an engine; A never got an
    // answer to the spoofed one.
    assert_eq!(fake.requests(), 2);
    assert!(a.drain().iter().all(|m| !m.topic.contains("spoofed")));
    gw.stop().await;
}

/// Two gateways share the subscription: both serve requests, each request
/// is answered exactly once (one task, one engine request, one stream),
/// and a cancel reaches whichever node runs the task.
#[tokio::test]
async fn two_gateways_sharing_the_subscription_each_answer_some_requests_exactly_once() {
    let broker = acl_broker().await;
    let (fake_a, fake_b) =
        (FakeEngine::start_with(Knobs::slow(3, 5)).await, FakeEngine::start_with(Knobs::slow(3, 5)).await);
    let (gw_a, _ta) = gateway(&fake_a.url(), broker.port, "a").await;
    let (gw_b, _tb) = gateway(&fake_b.url(), broker.port, "b").await;
    let mut d = device(broker.addr(), V::V5, D1).await;
    d.subscribe(&d.topic("res/#")).await;
    const N: usize = 20;
    for i in 0..N {
        d.publish(&d.topic("req"), request(&format!("r-{i}")).to_string()).await;
    }
    let mut streams: std::collections::BTreeMap<String, Vec<Value>> = Default::default();
    let mut ended = 0;
    while ended < N {
        let m = d.msg().await;
        let v = m.json();
        if matches!(v["type"].as_str(), Some("done" | "error")) {
            ended += 1;
        }
        streams.entry(m.topic).or_default().push(v);
    }
    assert_eq!(streams.len(), N);
    let mut nodes = std::collections::BTreeMap::<String, usize>::new();
    for (topic, events) in &streams {
        check_stream(events);
        let done = events.last().unwrap();
        assert_eq!(done["type"], "done", "{topic}: {done}");
        assert_eq!(events.iter().filter(|e| e["type"] == "accepted").count(), 1, "{topic}: {events:#?}");
        *nodes.entry(done["result"]["node_id"].as_str().unwrap().to_string()).or_default() += 1;
    }
    assert_eq!(fake_a.requests() + fake_b.requests(), N as u64, "one engine request per device request");
    assert!(nodes.len() == 2 && nodes.values().all(|n| *n > 0), "both nodes served: {nodes:?}");
    assert_eq!(nodes["a"] as u64, fake_a.requests());

    // A resume reaches both nodes: the one that ran the request replays
    // it, the other keeps still (no "unknown request" error).
    let original = &streams[&d.topic("res/r-0")];
    d.publish(&d.topic("resume"), json!({"request_id": "r-0", "from_seq": 1}).to_string()).await;
    let replay = d.stream(&d.topic("res/r-0")).await;
    assert_eq!(replay[..], original[1..], "the replay is the stream from seq 1");
    // A later request's answer comes after anything the resume caused.
    d.publish(&d.topic("req"), request("after-resume").to_string()).await;
    loop {
        let m = d.msg().await;
        let v = m.json();
        assert_ne!(v["type"], "error", "{}: {v}", m.topic);
        if m.topic == d.topic("res/after-resume") && v["type"] == "done" {
            break;
        }
    }

    // A long request and its cancel: the cancel reaches every node, the
    // one running the task stops its engine.
    for f in [&fake_a, &fake_b] {
        f.set(|k| {
            k.tokens = 1000;
            k.token_delay = Duration::from_millis(20);
        });
    }
    d.publish(&d.topic("req"), request("long").to_string()).await;
    let mut events = vec![d.msg().await.json(), d.msg().await.json()];
    assert_eq!(events[1]["type"], "delta", "{events:#?}");
    d.publish(&d.topic("cancel"), json!({"request_id": "long"}).to_string()).await;
    events.extend(d.stream(&d.topic("res/long")).await);
    check_stream(&events);
    assert_eq!(events.last().unwrap()["code"], "REQUEST_CANCELLED", "{events:#?}");
    for f in [&fake_a, &fake_b] {
        assert!(f.wait_for(Duration::from_secs(10), |s| s.active.load(SeqCst) == 0).await);
    }
    assert_eq!(fake_a.stats.aborted.load(SeqCst) + fake_b.stats.aborted.load(SeqCst), 1);
    gw_a.stop().await;
    gw_b.stop().await;
}

/// `config/external-broker.toml` loads, and `edgeway mqtt-acl` writes its
/// files from it: every device's rules, its users in the password file.
#[test]
fn the_example_config_loads_and_its_acls_are_written() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/external-broker.toml");
    let text = std::fs::read_to_string(&path).unwrap();
    let env = [("EDGEWAY_MQTT_BROKER_PASSWORD", "broker-secret"), ("CAM_7_MQTT_PASSWORD", "cam-7-secret")];
    let env: Vec<(String, String)> = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    let cfg = Config::from_toml_str(&text, env.clone(), path.parent().unwrap()).unwrap();
    let ext = cfg.mqtt.as_ref().unwrap().external.as_ref().expect("external mode");
    assert_eq!((ext.host.as_str(), ext.port, ext.client_id.as_str()), ("127.0.0.1", 1883, "edgeway-edge-ext-1"));
    assert_eq!(ext.shared_group, "edgeway");
    let lookup = |extra: &'static [(&str, &str)]| {
        let env = env.clone();
        move |v: &str| {
            env.iter()
                .chain(&extra.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<Vec<_>>())
                .find(|(k, _)| k == v)
                .map(|(_, v)| v.clone())
        }
    };
    // cam-8's password is not in the environment: named in the error.
    let e = acl::broker_files(&cfg, lookup(&[]), true).unwrap_err().to_string();
    assert!(e.contains("cam-8") && !e.contains("cam-7"), "{e}");
    // A password that is not the device's hash's is refused.
    let e = acl::broker_files(&cfg, lookup(&[("CAM_8_MQTT_PASSWORD", "wrong")]), true).unwrap_err().to_string();
    assert!(e.contains("CAM_8_MQTT_PASSWORD") && e.contains("cam-8"), "{e}");
    let files = acl::broker_files(&cfg, lookup(&[("CAM_8_MQTT_PASSWORD", "cam-8-secret")]), true).unwrap();
    let users: Vec<&str> =
        files.mosquitto_passwd.as_deref().unwrap().lines().map(|l| l.split(':').next().unwrap()).collect();
    assert_eq!(users, ["edgeway", "cam-7", "cam-8"]);
    assert!(files.mosquitto_acl.contains("user cam-7\ntopic write ai/v1/cam-7/req\n"), "{}", files.mosquitto_acl);
    assert!(
        files.emqx_acl.contains(
            r#"{allow, {username, "cam-8"}, publish, ["ai/v1/cam-8/req", "ai/v1/cam-8/cancel", "ai/v1/cam-8/resume"]}."#
        ),
        "{}",
        files.emqx_acl
    );
    assert!(files.emqx_acl.trim_end().ends_with("{deny, all}."));
    // The ACLs alone need no device password.
    assert!(acl::broker_files(&cfg, |_| None, false).unwrap().mosquitto_passwd.is_none());
}

/// The broker goes away and comes back: edgeway reports it, reconnects on
/// its own, subscribes again and serves the next request.
#[tokio::test]
async fn edgeway_reconnects_when_the_broker_comes_back() {
    let mut broker = acl_broker().await;
    let fake = FakeEngine::start_with(Knobs::slow(3, 5)).await;
    let (gw, _tmp) = gateway(&fake.url(), broker.port, "a").await;
    assert_eq!(metric(&gw, "mqtt_broker_connects_total"), Some(1.0));
    broker.stop().await;
    let m = until_broker(&gw, "disconnected", |m| m["state"] == "disconnected").await;
    assert!(m["last_error"].is_string(), "{m}");
    assert_eq!(metric(&gw, "mqtt_broker_connected"), Some(0.0));
    broker.restart().await;
    until_broker(&gw, "subscribed again", |m| m["subscribed"] == true).await;
    assert_eq!(metric(&gw, "mqtt_broker_connects_total"), Some(2.0));
    let mut d = device(broker.addr(), V::V5, D1).await;
    d.subscribe(&d.topic("res/#")).await;
    d.publish(&d.topic("req"), request("after-restart").to_string()).await;
    let events = d.stream(&d.topic("res/after-restart")).await;
    assert_eq!(events.last().unwrap()["type"], "done", "{events:#?}");
    gw.stop().await;
}

/// Interoperability: a device that is `mosquitto_sub` and `mosquitto_pub`
/// (clients the project did not write, MQTT 3.1.1) gets its answer through
/// the broker with the generated files.
#[tokio::test]
async fn mosquitto_clients_as_a_device_get_an_answer() {
    use tokio::io::{AsyncBufReadExt, BufReader};
    let broker = acl_broker().await;
    let fake = FakeEngine::start_with(Knobs::slow(4, 5)).await;
    let (gw, _tmp) = gateway(&fake.url(), broker.port, "a").await;
    let port = broker.port.to_string();
    let common = ["-h", "127.0.0.1", "-p", &port, "-u", D1.0, "-P", D1.1, "-q", "1"];
    // The retained catalogue arrives first: then the subscription is in
    // place (one SUBSCRIBE with both filters).
    let mut sub = tokio::process::Command::new("mosquitto_sub")
        .args(common)
        .args(["-i", "demo-device-1:sub", "-v", "-t", "ai/v1/shared/models", "-t", "ai/v1/demo-device-1/res/#"])
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("mosquitto_sub (apt-get install mosquitto-clients)");
    let mut lines = BufReader::new(sub.stdout.take().unwrap()).lines();
    assert!(next_line(&mut lines).await.starts_with("ai/v1/shared/models "));
    let body = json!({"model": "general-chat", "request_id": "cli-1", "messages": [{"role": "user", "content": "Hi"}]});
    let status = tokio::process::Command::new("mosquitto_pub")
        .args(common)
        .args(["-i", "demo-device-1:pub", "-t", "ai/v1/demo-device-1/req", "-m", &body.to_string()])
        .status()
        .await
        .unwrap();
    assert!(status.success());
    let mut events = Vec::new();
    loop {
        let line = next_line(&mut lines).await;
        let (topic, payload) = line.split_once(' ').unwrap();
        assert_eq!(topic, "ai/v1/demo-device-1/res/cli-1");
        let v: Value = serde_json::from_str(payload).unwrap();
        let end = v["type"] == "done" || v["type"] == "error";
        events.push(v);
        if end {
            break;
        }
    }
    assert_eq!(check_stream(&events), "tok tok tok tok ");
    assert_eq!(events.last().unwrap()["type"], "done");
    gw.stop().await;
}

/// The next line `mosquitto_sub` printed.
async fn next_line(lines: &mut tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>) -> String {
    let line = tokio::time::timeout(Duration::from_secs(20), lines.next_line()).await.expect("a line in time");
    line.unwrap().expect("mosquitto_sub is still running")
}

/// A CA and a certificate it signed for 127.0.0.1 and localhost (PEM files
/// `ca.pem`, `server.pem`, `server.key` in the folder), made with openssl.
fn certificates(dir: &Path, ca_name: &str) {
    let run = |args: &[&str]| {
        let out = std::process::Command::new("openssl").args(args).current_dir(dir).output().expect("openssl");
        assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    };
    let subject = format!("/CN={ca_name}");
    run(&[
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj",
        &subject,
    ]);
    run(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        "-subj",
        "/CN=localhost",
    ]);
    std::fs::write(dir.join("san.ext"), "subjectAltName=IP:127.0.0.1,DNS:localhost\n").unwrap();
    run(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.pem",
        "-days",
        "1",
        "-extfile",
        "san.ext",
    ]);
}

/// `tls = true`: edgeway reaches the broker over TLS (a device on the
/// broker's plain listener gets its answer); with a CA that did not sign
/// the broker's certificate it does not connect, and says why.
#[tokio::test]
async fn edgeway_connects_to_the_broker_over_tls() {
    let certs = TempDir::new("edgeway-certs");
    certificates(&certs.0, "edgeway-test-ca");
    let other = TempDir::new("edgeway-other-ca");
    certificates(&other.0, "another-ca");
    let files = acl_files();
    let broker = Mosquitto::with_acl_and_tls(
        &files.0.join("mosquitto.passwd"),
        &files.0.join("mosquitto.acl"),
        &certs.0.join("server.pem"),
        &certs.0.join("server.key"),
    )
    .await;
    let tls_port = broker.tls_port.unwrap();
    let fake = FakeEngine::start_with(Knobs::slow(3, 5)).await;

    // The wrong CA: no connection, and /ready says why.
    let tmp = TempDir::new("edgeway-ext");
    let wrong = format!("tls = true\nca_file = \"{}\"\n", other.0.join("ca.pem").display());
    let gw = TestGateway::start(config_with(&fake.url(), &tmp.0, tls_port, "x", &wrong)).await;
    let m = until_broker(&gw, "refused", |m| m["last_error"].is_string()).await;
    assert_ne!(m["state"], "connected", "{m}");
    assert_eq!(m["tls"], true);
    gw.stop().await;

    let tmp = TempDir::new("edgeway-ext");
    let right = format!("tls = true\nca_file = \"{}\"\n", certs.0.join("ca.pem").display());
    let gw = TestGateway::start(config_with(&fake.url(), &tmp.0, tls_port, "a", &right)).await;
    gw.wait_ready().await;
    until_broker(&gw, "subscribed over TLS", |m| m["subscribed"] == true).await;
    let mut d = device(broker.addr(), V::V5, D1).await;
    d.subscribe(&d.topic("res/#")).await;
    d.publish(&d.topic("req"), request("over-tls").to_string()).await;
    let events = d.stream(&d.topic("res/over-tls")).await;
    assert_eq!(events.last().unwrap()["type"], "done", "{events:#?}");
    gw.stop().await;
}

/// The `edgeway mqtt-acl` command: writes the three files (the password
/// file readable by its owner only) and exits 0; a device without its
/// password in the environment: exit 2, naming it, nothing written.
#[test]
fn the_mqtt_acl_command_writes_the_files() {
    use std::os::unix::fs::PermissionsExt;
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/external-broker.toml");
    let out = TempDir::new("edgeway-acl-cli");
    let run = |env: &[(&str, &str)]| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_edgeway"));
        cmd.arg("mqtt-acl").arg("--config").arg(&config).arg("--out").arg(&out.0);
        cmd.env_remove("CAM_7_MQTT_PASSWORD").env_remove("CAM_8_MQTT_PASSWORD");
        cmd.envs(env.iter().copied()).output().unwrap()
    };
    let broker = ("EDGEWAY_MQTT_BROKER_PASSWORD", "broker-secret");
    let r = run(&[broker, ("CAM_7_MQTT_PASSWORD", "cam-7-secret")]);
    assert_eq!(r.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&r.stderr).contains("cam-8"), "{}", String::from_utf8_lossy(&r.stderr));
    assert!(std::fs::read_dir(&out.0).unwrap().next().is_none(), "nothing written");
    let r = run(&[broker, ("CAM_7_MQTT_PASSWORD", "cam-7-secret"), ("CAM_8_MQTT_PASSWORD", "cam-8-secret")]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    for f in ["mosquitto.acl", "mosquitto.passwd", "emqx-acl.conf"] {
        assert!(out.0.join(f).is_file(), "{f}");
    }
    let mode = std::fs::metadata(out.0.join("mosquitto.passwd")).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    let passwd = std::fs::read_to_string(out.0.join("mosquitto.passwd")).unwrap();
    assert!(passwd.lines().all(|l| l.split(':').nth(1).is_some_and(|h| h.starts_with("$7$101$"))), "{passwd}");
}
