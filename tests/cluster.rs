//! The node registry (issue 15) against a real three-server NATS cluster
//! with JetStream on loopback: three edgeway nodes with fake engines
//! publish their records into the `edgeway_nodes` key-value bucket and see
//! each other in `GET /v1/nodes`; a node that shuts down leaves at once (its
//! key purged), one that stops refreshing leaves after the TTL, and the
//! registry survives the loss of one NATS server (bucket with 3 replicas).

mod common;

use std::time::Duration;

use common::*;
use edgeway::testing::NatsCluster;
use serde_json::Value;

/// A stream leader election after a server is killed takes up to ~10 s
/// (nats-server's raft election timeout is 4-9 s): the TTL outlasts it.
const HEARTBEAT_MS: u64 = 1000;
const TTL_MS: u64 = 15_000;

async fn node(nats_url: &str, id: &str, zone: &str, class: &str) -> (FakeEngine, TestGateway) {
    let fake = FakeEngine::start().await;
    let extra = format!(
        "\n[nats]\nurl = \"{nats_url}\"\n[nats.jetstream]\nstorage = \"memory\"\n\
         [cluster]\nzone = \"{zone}\"\nmax_data_class = \"{class}\"\nheartbeat_ms = {HEARTBEAT_MS}\n\
         ttl_ms = {TTL_MS}\nreplicas = 3\n"
    );
    let gw = TestGateway::with_engine_edit(&fake.url(), "openai", &extra, |t| {
        t.replace("node_id = \"test-node\"", &format!("node_id = \"{id}\""))
    })
    .await;
    gw.wait_ready().await;
    (fake, gw)
}

async fn nodes(gw: &TestGateway) -> Vec<Value> {
    let v = get_json(gw, OPS_KEY, "/v1/nodes").await;
    v["data"].as_array().cloned().unwrap_or_else(|| panic!("no node list: {v}"))
}

fn ids(list: &[Value]) -> Vec<String> {
    list.iter().map(|n| n["node_id"].as_str().unwrap_or_default().to_string()).collect()
}

/// Polls `GET /v1/nodes` on `gw` until its ids are `want` (this node
/// first); returns the list and how long it took.
async fn until_nodes(gw: &TestGateway, want: &[&str], within: Duration) -> (Vec<Value>, Duration) {
    let start = tokio::time::Instant::now();
    loop {
        let list = nodes(gw).await;
        if ids(&list) == want {
            return (list, start.elapsed());
        }
        assert!(start.elapsed() < within, "nodes {:?} never became {want:?} within {within:?}", ids(&list));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn nodes_see_each_other_and_leave_by_purge_or_by_ttl_and_survive_a_server_loss() {
    let mut cluster = NatsCluster::start().await;
    let url = cluster.url();
    let (_fa, a) = node(&url, "node-a", "site-1", "secret").await;
    let (_fb, b) = node(&url, "node-b", "site-1", "sensitive").await;
    let (_fc, c) = node(&url, "node-c", "site-2", "personal").await;
    let few_heartbeats = Duration::from_secs(10);

    // Each node sees the others, itself first, with their zone and models.
    let (list, took) = until_nodes(&a, &["node-a", "node-b", "node-c"], few_heartbeats).await;
    eprintln!("node-a saw the pool after {took:?}");
    until_nodes(&b, &["node-b", "node-a", "node-c"], few_heartbeats).await;
    until_nodes(&c, &["node-c", "node-a", "node-b"], few_heartbeats).await;
    assert_eq!(list[0]["self"], true);
    assert_eq!(list[1]["self"], false);
    assert_eq!(list[2]["zone"], "site-2");
    assert_eq!(list[2]["max_data_class"], "personal");
    assert_eq!(list[1]["models"][0]["name"], "general-chat");
    assert_eq!(list[1]["models"][0]["state"], "loaded");
    assert_eq!(list[1]["free_slots"], 2);
    assert_eq!(list[1]["http_addr"], b.base_url.trim_start_matches("http://"));
    assert!(list[1]["updated_at_ms"].as_i64().unwrap() >= list[1]["started_at_ms"].as_i64().unwrap());

    // Every record, as a peer reads it from the bucket, follows the schema.
    let schema: Value = serde_json::from_str(
        &std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/topics/schemas/node-record.json")).unwrap(),
    )
    .unwrap();
    let schema = jsonschema::validator_for(&schema).unwrap();
    for mut n in list.clone() {
        n.as_object_mut().unwrap().remove("self");
        let errors: Vec<String> = schema.iter_errors(&n).map(|e| e.to_string()).collect();
        assert!(errors.is_empty(), "{n}: {errors:?}");
    }

    // The forwarding question: who else serves the model and may take the class.
    let pool = a.gateway().pool().expect("pool");
    let who = |class| pool.candidates("general-chat", class).into_iter().map(|n| n.node_id).collect::<Vec<_>>();
    assert_eq!(who(edgeway::task::DataClass::Sensitive), ["node-b"]);
    assert_eq!(who(edgeway::task::DataClass::Personal).len(), 2);

    // /ready reports the registry, the metrics count the pool.
    let ready = get_json(&a, OPS_KEY, "/ready").await;
    assert_eq!(ready["cluster"]["registry"], "ok", "{ready}");
    assert_eq!(ready["cluster"]["peers"], 2);
    let metrics = a.metrics().render();
    assert!(metrics.contains("edgeway_cluster_nodes 3"), "{metrics}");

    // The status page's data carries the pool too.
    let status = get_json(&a, OPS_KEY, "/admin/status").await;
    assert_eq!(ids(status["nodes"].as_array().unwrap()), ["node-a", "node-b", "node-c"]);
    let page = client().get(format!("{}/status", a.base_url)).send().await.unwrap().text().await.unwrap();
    assert!(page.contains("<table id=\"nodes\">") && page.contains("fill(\"nodes\""), "the page shows the pool");
    // Not for a non-admin application.
    let denied = client().get(format!("{}/v1/nodes", a.base_url)).bearer_auth(DEMO_KEY).send().await.unwrap();
    assert_eq!(denied.status(), 403);

    // The bucket is replicated on all three servers.
    let js = async_nats::jetstream::new(async_nats::connect(cluster.servers[1].url()).await.unwrap());
    let mut stream = js.get_stream("KV_edgeway_nodes").await.expect("the registry's stream");
    let info = stream.info().await.unwrap();
    assert_eq!(info.config.num_replicas, 3);
    assert_eq!(info.config.max_age, Duration::from_millis(TTL_MS));
    eprintln!("registry stream cluster: {:?}", info.cluster);

    // One NATS server of three dies: every node stays registered (the
    // clients move to another server, the bucket has 3 replicas).
    cluster.servers[0].stop().await;
    let killed_at = edgeway::task::now_ms();
    let start = tokio::time::Instant::now();
    loop {
        // Nobody drops out meanwhile, on any node.
        for (gw, me) in [(&a, "node-a"), (&b, "node-b"), (&c, "node-c")] {
            let list = nodes(gw).await;
            assert_eq!(list.len(), 3, "{me} lost a node after a server loss: {:?}", ids(&list));
        }
        // Until every registry writes again and records written after the
        // loss arrive.
        let mut all_ok = true;
        for gw in [&a, &b, &c] {
            all_ok &= get_json(gw, OPS_KEY, "/ready").await["cluster"]["registry"] == "ok";
        }
        let fresh = nodes(&a).await.iter().skip(1).all(|n| n["updated_at_ms"].as_i64().unwrap() > killed_at);
        if all_ok && fresh && start.elapsed() > Duration::from_millis(3 * HEARTBEAT_MS) {
            break;
        }
        assert!(start.elapsed() < Duration::from_millis(TTL_MS * 2), "the registry did not recover");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    eprintln!("registry writing again {:?} after a server was killed", start.elapsed());

    // A node that stops refreshing (its registry task stopped, its key
    // left in place) is gone after the TTL, not before.
    c.gateway().pool().expect("pool").stop_publishing();
    let (_, took) = until_nodes(&a, &["node-a", "node-b"], Duration::from_millis(TTL_MS * 4)).await;
    eprintln!("a silent node-c left node-a's view after {took:?}");
    assert!(took >= Duration::from_millis(TTL_MS - 2 * HEARTBEAT_MS - 300), "left too early: {took:?}");

    // A node that shuts down leaves at once: its key is purged when its
    // drain begins. (Measured: 70-350 ms from the start of its stop; about
    // 4.7 s when the killed server held the R1 lifecycle-event stream of
    // `[nats.jetstream]`, whose publisher then holds the node's stop: with
    // `events = false` it is 70-90 ms whichever server was killed.)
    let stopping = tokio::time::Instant::now();
    b.stop().await;
    let (_, took) = until_nodes(&a, &["node-a"], Duration::from_millis(TTL_MS)).await;
    let since_stop = stopping.elapsed();
    eprintln!("node-b left node-a's view {since_stop:?} after its stop began ({took:?} after it returned)");
    assert!(since_stop < Duration::from_millis(TTL_MS), "not purged: {since_stop:?}");
    a.stop().await;
    c.stop().await;
}

#[test]
fn the_two_node_pool_example_config_loads() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config/two-node-pool.toml");
    let text = std::fs::read_to_string(&path).unwrap();
    let env = [("EDGEWAY_POOL_KEY".to_string(), "k".repeat(32))];
    let cfg =
        edgeway::config::Config::from_toml_str(&text, env, path.parent().unwrap()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(cfg.engines["pool"].kind, edgeway::config::EngineKind::Pool);
    assert_eq!(cfg.models["general-chat"].instances, ["llama-local", "pool"]);
    let c = cfg.cluster.expect("[cluster] is on");
    assert!(c.key.is_some(), "the example forwards");
    assert_eq!((c.zone.as_str(), c.bucket.as_str(), c.replicas), ("site-1", "edgeway_nodes", 3));
    assert_eq!(c.max_data_class, edgeway::task::DataClass::Sensitive);
    assert!(c.ttl > c.heartbeat * 5, "the example's ttl outlasts a leader election");
    assert_eq!(cfg.nats.expect("[nats]").url.split(',').count(), 3);
}

/// The bus down: the registry says so in `/ready` (which stays ready) and
/// counts the failed writes; the bus back (a restarted server that lost the
/// memory-stored bucket): the registry makes the bucket again and writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bus_outage_shows_in_ready_and_the_registry_comes_back() {
    let mut nats = edgeway::testing::NatsServer::start(true).await;
    let fake = FakeEngine::start().await;
    let extra = format!(
        "\n[nats]\nurl = \"{}\"\nreconnect_max_delay_ms = 500\n[nats.jetstream]\nstorage = \"memory\"\n\
         [cluster]\nzone = \"z\"\nheartbeat_ms = 200\n",
        nats.url()
    );
    let gw = TestGateway::with_engine(&fake.url(), "openai", &extra).await;
    gw.wait_ready().await;
    let registry = |v: Value| v["cluster"]["registry"].as_str().unwrap_or_default().to_string();
    let until = |want: &'static str| {
        let gw = &gw;
        async move {
            let start = tokio::time::Instant::now();
            loop {
                let r = get_json(gw, OPS_KEY, "/ready").await;
                if registry(r.clone()).starts_with(want) {
                    return r;
                }
                assert!(start.elapsed() < Duration::from_secs(30), "registry never {want}: {r}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    until("ok").await;
    nats.stop().await;
    let r = until("unavailable").await;
    assert_eq!(r["ready"], true, "the bus is not a readiness condition: {r}");
    assert!(gw.metrics().render().contains("edgeway_cluster_publish_failures_total{op=\"put\"}"));
    nats.restart().await;
    until("ok").await;
    assert_eq!(nodes(&gw).await.len(), 1);
    gw.stop().await;
}
