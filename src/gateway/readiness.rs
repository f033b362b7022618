//! The readiness view behind `/ready`: ready when the store answers and
//! every logical model has a healthy instance. The bus is reported but
//! readiness does not depend on it.
//!
//! Owns: the readiness rule. Does not own: the response format (ingress)
//! or the bus state (read through [`super::BusStatus`]).

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
    pub store_ok: bool,
    pub models: Vec<ModelReadiness>,
    pub instances: Vec<InstanceSnapshot>,
    pub queues: Vec<QueueSnapshot>,
    /// 0 normal … 3 busy answers only (see the scheduler's snapshot).
    pub degradation_level: u8,
    /// The bus as [`super::BusStatus::report`] describes it.
    pub bus: serde_json::Value,
}

impl Gateway {
    /// The readiness view; an error when the scheduler is not running.
    pub async fn readiness(&self) -> Result<Readiness, GatewayError> {
        let Some(snap) = self.scheduler.snapshot().await else {
            return Err(GatewayError::internal("scheduler is not running"));
        };
        let store_ok = tokio::time::timeout(STORE_PROBE, self.store.flush()).await.is_ok();
        let models: Vec<_> = self
            .config
            .models
            .values()
            .map(|m| {
                let up = m.instances.iter().any(|i| snap.instances.iter().any(|s| &s.name == i && s.up));
                ModelReadiness { model: m.name.clone(), ready: up }
            })
            .collect();
        let ready = store_ok && models.iter().all(|m| m.ready);
        Ok(Readiness {
            ready,
            store_ok,
            models,
            instances: snap.instances,
            queues: snap.queues,
            degradation_level: snap.degradation_level,
            bus: self.bus.report(),
        })
    }
}
