//! Test and benchmark support: fake engines, `nats-server` and `mosquitto`
//! launchers and an in-process gateway on port 0. Used by `tests/` and `bench/`; not part
//! of the gateway's behaviour, and compiled only with the cargo feature
//! `testing` (or in this crate's unit tests), so the release binary does not
//! contain it.

pub mod fake_engine;
pub mod mosquitto;
pub mod nats_server;

use std::path::PathBuf;
use std::time::Duration;

use tokio::sync::broadcast;

use crate::config::Config;
use crate::gateway::Gateway;
use crate::ingress::nats::NatsStatus;
use crate::scheduler::SchedulerHandle;
use crate::server::{self, RunningGateway};
use crate::store::Store;
use crate::task::TaskState;
use crate::telemetry::lifecycle::Recorder;
use crate::telemetry::Metrics;

pub use fake_engine::{fake_embedding, vllm_metrics, FakeEngine, Knobs};
pub use mosquitto::Mosquitto;
pub use nats_server::{NatsCluster, NatsServer};

/// API keys of the test configs (the same as the example config's).
pub const DEMO_KEY: &str = "sk-edgeway-demo";
pub const OPS_KEY: &str = "sk-edgeway-ops";

/// A minimal config: applications `demo` (P1–P4) and `ops` (P0–P4, admin), one
/// engine `fake` of `kind` at `engine_url` serving model `general-chat`.
/// `extra` is TOML appended inside `[models.general-chat]`: bare keys set
/// that model's options, and later `[section]` headers add sections.
pub fn config_toml(engine_url: &str, kind: &str, data_dir: &std::path::Path, extra: &str) -> String {
    let demo = hex::encode(crate::config::hash_api_key(DEMO_KEY));
    let ops = hex::encode(crate::config::hash_api_key(OPS_KEY));
    let model = if kind == "ollama" { "fake" } else { "fake-model" };
    format!(
        r#"
node_id = "test-node"
[http]
listen = "127.0.0.1:0"
[store]
data_dir = "{data}"
[applications.demo]
tenant = "demo"
api_key_sha256 = ["{demo}"]
max_priority = "P1"
default_priority = "P2"
[applications.ops]
tenant = "demo"
api_key_sha256 = ["{ops}"]
max_priority = "P0"
default_priority = "P1"
admin = true
[engines.fake]
type = "{kind}"
base_url = "{engine_url}"
model = "{model}"
max_concurrency = 2
health_interval_ms = 100
[models.general-chat]
instances = ["fake"]
context_tokens = 2048
max_output_tokens = 256
{extra}
"#,
        data = data_dir.display().to_string().replace('\\', "\\\\"),
    )
}

/// A gateway running in this process, on free ports, with its own data
/// directory.
pub struct TestGateway {
    pub running: Option<RunningGateway>,
    pub base_url: String,
    pub data_dir: PathBuf,
    _tmp: Option<TempDir>,
}

/// A directory (named `{prefix}…` in the system's temp dir) removed on
/// drop. Its path is `.0`; the second field is the `tempfile` guard.
pub struct TempDir(
    pub PathBuf,
    /// Held for its `Drop`, which removes the directory.
    #[allow(dead_code)]
    tempfile::TempDir,
);

impl TempDir {
    pub fn new(prefix: &str) -> TempDir {
        let dir = tempfile::Builder::new().prefix(&format!("{prefix}-")).tempdir().expect("create temp dir");
        TempDir(dir.path().to_path_buf(), dir)
    }
}

impl TestGateway {
    pub async fn start(config: Config) -> TestGateway {
        let data_dir = config.store.data_dir.clone();
        let running = server::start(config).await.expect("gateway starts");
        let base_url = format!("http://{}", running.http_addr);
        TestGateway { running: Some(running), base_url, data_dir, _tmp: None }
    }

    /// Starts with [`config_toml`] around a fake engine.
    pub async fn with_engine(engine_url: &str, kind: &str, extra: &str) -> TestGateway {
        Self::with_engine_edit(engine_url, kind, extra, |t| t).await
    }

    /// Like [`Self::with_engine`], letting the test edit the TOML text first
    /// (e.g. to change the engine's `max_concurrency`).
    pub async fn with_engine_edit(
        engine_url: &str,
        kind: &str,
        extra: &str,
        edit: impl FnOnce(String) -> String,
    ) -> TestGateway {
        let tmp = TempDir::new("edgeway-test");
        let text = edit(config_toml(engine_url, kind, &tmp.0, extra));
        let config = Config::from_toml_str(&text, std::iter::empty(), std::path::Path::new("."))
            .unwrap_or_else(|e| panic!("test config: {e}\n{text}"));
        let mut gw = Self::start(config).await;
        gw._tmp = Some(tmp);
        gw
    }

    /// The facade, as the ingresses call it.
    pub fn gateway(&self) -> &std::sync::Arc<Gateway> {
        &self.running().gateway
    }

    fn running(&self) -> &RunningGateway {
        self.running.as_ref().expect("running")
    }

    /// The scheduler behind the facade (snapshots, attaching to a task).
    pub fn scheduler(&self) -> &SchedulerHandle {
        &self.running().internals.scheduler
    }

    /// The task store behind the facade.
    pub fn store(&self) -> &Store {
        &self.running().internals.store
    }

    /// The lifecycle recorder (its subscription shows each transition as
    /// it is recorded).
    pub fn recorder(&self) -> &Recorder {
        &self.running().internals.recorder
    }

    pub fn metrics(&self) -> &std::sync::Arc<Metrics> {
        &self.running().internals.metrics
    }

    /// The NATS bus state (`off` without `[nats]`).
    pub fn nats(&self) -> &NatsStatus {
        &self.running().internals.nats
    }

    pub fn db_path(&self) -> PathBuf {
        self.data_dir.join("edgeway.db")
    }

    /// Waits until task `task_id` has been recorded in `state`, also when
    /// that happened before this call: the recorder's subscription is made
    /// first, then the store is read, so no transition falls in between.
    pub async fn wait_for_state(&self, task_id: &str, state: TaskState) {
        let mut rx = self.recorder().subscribe();
        let recorded = || async {
            self.store().flush().await;
            let rec = self.store().get(task_id).await.expect("store answers");
            rec.is_some_and(|r| r.transitions.iter().any(|t| t.state == state))
        };
        let wait = async {
            if recorded().await {
                return;
            }
            loop {
                match rx.recv().await {
                    Ok(ev) if ev.task_id == task_id && ev.state == state => return,
                    Ok(_) => {}
                    // Missed some: the store has them.
                    Err(broadcast::error::RecvError::Lagged(_)) => {
                        if recorded().await {
                            return;
                        }
                    }
                    Err(broadcast::error::RecvError::Closed) => panic!("the recorder stopped"),
                }
            }
        };
        if tokio::time::timeout(Duration::from_secs(30), wait).await.is_err() {
            panic!("task {task_id} was never recorded {}", state.as_str());
        }
    }

    /// Waits until every engine instance has passed its first health check.
    pub async fn wait_ready(&self) {
        for _ in 0..800 {
            if let Some(s) = self.scheduler().snapshot().await {
                if s.instances.iter().all(|i| i.up && i.detail == "ok") {
                    return;
                }
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("engines did not become healthy");
    }

    /// Stops the gateway; fails the test if any code path tried an illegal
    /// task state transition while it ran (the recorder refuses and counts
    /// them; its debug assertion fires inside a spawned task, which alone
    /// would not fail the test).
    pub async fn stop(mut self) {
        if let Some(r) = self.running.take() {
            let metrics = r.internals.metrics.clone();
            r.shutdown(Duration::from_secs(5)).await;
            assert_no_illegal_transitions(&metrics);
        }
    }
}

impl Drop for TestGateway {
    fn drop(&mut self) {
        if let Some(r) = &self.running {
            if !std::thread::panicking() {
                assert_no_illegal_transitions(&r.internals.metrics);
            }
        }
    }
}

fn assert_no_illegal_transitions(metrics: &Metrics) {
    use prometheus::core::Collector;
    let refused: Vec<String> = metrics
        .illegal_transitions
        .collect()
        .iter()
        .flat_map(|f| f.get_metric())
        .filter(|m| m.get_counter().get_value() > 0.0)
        .map(|m| {
            let labels: Vec<String> = m.get_label().iter().map(|l| format!("{}={}", l.name(), l.value())).collect();
            format!("{} ×{}", labels.join(","), m.get_counter().get_value())
        })
        .collect();
    assert!(refused.is_empty(), "illegal task state transitions were tried: {refused:?}");
}
