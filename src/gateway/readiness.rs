//! The readiness view behind `/ready`: ready when the store answers and
//! can write, every logical model has a healthy instance, every `always`
//! model is loaded (residency), no ingress
//! reported a lost part ([`Gateway::ingress_failed`]), and the gateway is
//! not draining. The bus is reported but readiness does not depend on
//! it.
//!
//! Owns: the readiness rule. Does not own: the response format (ingress)
//! or the bus state (read through [`super::BusStatus`]).

use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;

use crate::error::GatewayError;
use crate::scheduler::{InstanceSnapshot, QueueSnapshot};

use super::Gateway;

/// How long the store may take to answer before it counts as down.
const STORE_PROBE: Duration = Duration::from_secs(2);

#[derive(Debug, Clone, Serialize)]
pub struct ModelReadiness {
    pub model: String,
    pub ready: bool,
}

/// What `/ready` reports.
#[derive(Debug, Clone)]
pub struct Readiness {
    pub ready: bool,
    /// The store answers and can write.
    pub store_ok: bool,
    /// Why the store cannot write, while it cannot.
    pub store_degraded: Option<String>,
    /// Writes kept in memory until the store can write again.
    pub store_buffered_writes: usize,
    /// The gateway is draining before it stops.
    pub draining: bool,
    /// Why it is not ready, one line each (empty when ready).
    pub not_ready: Vec<String>,
    pub models: Vec<ModelReadiness>,
    pub instances: Vec<InstanceSnapshot>,
    pub queues: Vec<QueueSnapshot>,
    /// 0 normal … 3 busy answers only (see the scheduler's snapshot).
    pub degradation_level: u8,
    /// The bus as [`super::BusStatus::report`] describes it.
    pub bus: serde_json::Value,
    /// The connection to an external MQTT broker (`None`: no `[mqtt]`, or
    /// the embedded broker). Reported; readiness does not depend on it.
    pub mqtt_bus: Option<serde_json::Value>,
    /// The node registry (`[cluster]`): `{"registry": "off"}` without it,
    /// else its state (`connecting`, `ok`, `unavailable: …`) and the
    /// number of fresh peers. Reported; readiness does not depend on it.
    pub cluster: serde_json::Value,
    /// The engine processes edgeway runs: state, restarts, uptime, why one
    /// is down.
    pub engine_processes: Vec<crate::engine::supervisor::ProcessReport>,
    /// The version (a hash of the effective content) of the configuration
    /// in force.
    pub config_version: String,
    /// When a reload last put a configuration in force (`None`: the one
    /// read at start is in force).
    pub config_reloaded_at: Option<std::time::SystemTime>,
}

impl Readiness {
    /// The `store` field of `/ready`: `ok`, `not responding` or
    /// `degraded: <why>`.
    pub fn store_state(&self) -> String {
        match (&self.store_degraded, self.store_ok) {
            (Some(why), _) => format!("degraded: {why}"),
            (None, true) => "ok".to_string(),
            (None, false) => "not responding".to_string(),
        }
    }
}

impl Gateway {
    /// An ingress lost a part it cannot restart (MQTT: the thread that
    /// hands edgeway's publishes to the broker): `/ready` is not ready
    /// from now on, saying `why`.
    pub fn ingress_failed(&self, why: impl Into<String>) {
        self.ingress_faults.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(why.into());
    }

    /// Offers the state of the connection to an external MQTT broker to
    /// `/ready` (the MQTT ingress, once, at start).
    pub fn set_mqtt_bus(&self, bus: Arc<dyn super::BusStatus>) {
        let _ = self.mqtt_bus.set(bus);
    }

    /// The readiness view; an error when the scheduler is not running.
    pub async fn readiness(&self) -> Result<Readiness, GatewayError> {
        let Some(snap) = self.scheduler.snapshot().await else {
            return Err(GatewayError::internal("scheduler is not running"));
        };
        let answers = tokio::time::timeout(STORE_PROBE, self.store.flush()).await.is_ok();
        let health = self.store.health();
        let store_degraded = health.degraded();
        let store_ok = answers && store_degraded.is_none();
        let draining = self.is_draining();
        let config = self.config();
        let models: Vec<_> = config
            .models
            .values()
            .map(|m| {
                let up = m.instances.iter().any(|i| snap.instances.iter().any(|s| &s.name == i && s.up));
                ModelReadiness { model: m.name.clone(), ready: up }
            })
            .collect();
        let mut not_ready = Vec::new();
        if draining {
            not_ready.push("the gateway is shutting down".to_string());
        }
        if !answers {
            not_ready.push("the task store is not responding".to_string());
        }
        if let Some(why) = &store_degraded {
            not_ready.push(format!("the task store cannot write: {why}"));
        }
        not_ready.extend(self.ingress_faults.lock().unwrap_or_else(std::sync::PoisonError::into_inner).iter().cloned());
        let engine_processes = self.processes.reports();
        for p in engine_processes.iter().filter(|p| p.state == crate::engine::supervisor::ProcessState::Failed) {
            not_ready.push(format!("engine process {} failed: {}", p.instance, p.reason.as_deref().unwrap_or("")));
        }
        for m in models.iter().filter(|m| !m.ready) {
            not_ready.push(format!("model {} has no healthy instance", m.model));
        }
        // `always` models are loaded before edgeway is ready.
        not_ready.extend(self.residency.not_ready());
        let bus = self.bus.report();
        Ok(Readiness {
            ready: not_ready.is_empty(),
            store_ok,
            store_degraded,
            store_buffered_writes: health.buffered_writes(),
            draining,
            not_ready,
            models,
            instances: snap.instances,
            queues: snap.queues,
            degradation_level: snap.degradation_level,
            cluster: match (self.pool(), &config.cluster) {
                (Some(p), _) => p.report(),
                (None, Some(_)) => {
                    // Not started: the bus is still connecting, or failed.
                    let registry = if bus["state"] == "failed" { "unavailable: the bus failed" } else { "connecting" };
                    serde_json::json!({ "registry": registry, "peers": 0 })
                }
                (None, None) => serde_json::json!({ "registry": "off" }),
            },
            bus,
            mqtt_bus: self.mqtt_bus.get().map(|b| b.report()),
            engine_processes,
            config_version: config.version.clone(),
            config_reloaded_at: self.last_reload(),
        })
    }

    /// A model's residency state on this node for `GET /v1/models`: the
    /// best of its local engines (`loaded`, `loading`, `unloaded`), or
    /// `forbidden` when its class says so; a model with only remote
    /// instances is `loaded` (it is, where it runs).
    pub fn model_residency_state(&self, m: &crate::config::ModelConfig) -> &'static str {
        use crate::engine::residency::State;
        if m.residency.class == crate::config::ResidencyClass::Forbidden {
            return State::Forbidden.as_str();
        }
        let config = self.config();
        let states: Vec<State> = m
            .instances
            .iter()
            .filter(|i| config.engines.get(*i).is_some_and(|e| e.is_local()))
            .filter_map(|i| self.residency.state_of(i))
            .collect();
        [State::Loaded, State::Loading, State::Unloaded]
            .into_iter()
            .find(|s| states.contains(s))
            .unwrap_or(if states.is_empty() { State::Loaded } else { State::Unloaded })
            .as_str()
    }
}
