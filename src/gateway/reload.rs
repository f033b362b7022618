//! Configuration reload (`SIGHUP`, `POST /admin/reload`): the one place
//! that swaps what a running edgeway reads from its configuration.
//!
//! A reload reads the file the gateway started from ([`Config::load`]: the
//! same path, the same `EDGEWAY__…` overrides, the same whole validation),
//! judges the change ([`crate::config::reload::plan`]: what may change
//! without a restart) and then, only when both pass, swaps in one step:
//! the facade's configuration (admission, timeouts defaults, devices at
//! MQTT CONNECT, `/ready`), the authenticator's keys and applications, and
//! the scheduler's limits and routes. An engine the file no longer has
//! drains: no new work from the swap on, its running tasks finish or meet
//! their deadline, then its process (if edgeway runs it) is stopped. A
//! refused reload changes nothing.
//!
//! Running and queued tasks keep what they were admitted with: their
//! request was resolved against the configuration of their admission, and
//! a lowered limit only judges later admissions and grants.
//!
//! Owns: the order of the swap, the reload count and the version and time
//! of the last reload. Does not own: the rule of what may change (`config`)
//! or the triggers (the HTTP admin route, the signal in `main`).

use std::sync::Arc;
use std::time::SystemTime;

use prometheus::{IntCounterVec, Opts};

use crate::config::reload::Changes;
use crate::config::{Config, ConfigErrors};
use crate::error::{ErrorCode, GatewayError};
use crate::task::Identity;
use crate::telemetry::Metrics;

use super::Gateway;

/// The reloads of one gateway.
pub(super) struct Reloads {
    /// One reload at a time: two would judge their change against the
    /// same old configuration and the second would undo the first's count.
    one_at_a_time: tokio::sync::Mutex<()>,
    /// `edgeway_config_reloads_total{result="ok|refused"}`.
    total: IntCounterVec,
    /// When the configuration in force was put in force by a reload.
    last: std::sync::Mutex<Option<SystemTime>>,
}

impl Reloads {
    pub(super) fn new(metrics: &Metrics) -> Reloads {
        let total = IntCounterVec::new(
            Opts::new("config_reloads_total", "Configuration reloads by result (ok, refused)"),
            &["result"],
        )
        .expect("valid metric");
        // Registered by the facade so that telemetry needs no field for
        // it; one gateway per metrics registry.
        let _ = metrics.registry.register(Box::new(total.clone()));
        for r in ["ok", "refused"] {
            total.with_label_values(&[r]).reset();
        }
        Reloads { one_at_a_time: Default::default(), total, last: Default::default() }
    }
}

/// What an accepted reload did.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ReloadReport {
    /// The version in force before.
    pub previous_version: String,
    /// The version in force now (the same when nothing changed).
    pub config_version: String,
    pub changes: Changes,
}

/// Why a reload was refused; the configuration in force stays.
#[derive(Debug, Clone)]
pub enum ReloadError {
    /// The caller may not reload (not an admin application).
    Denied(GatewayError),
    /// The file cannot be read or is invalid, or it changes what needs a
    /// restart: every problem with its key path.
    Invalid(ConfigErrors),
}

impl ReloadError {
    /// The error code: `CONFIG_INVALID` for a refused file.
    pub fn code(&self) -> ErrorCode {
        match self {
            ReloadError::Denied(e) => e.code,
            ReloadError::Invalid(_) => ErrorCode::ConfigInvalid,
        }
    }
}

impl Gateway {
    /// `POST /admin/reload`: as [`Gateway::reload`], for admin
    /// applications only.
    pub async fn reload_as(&self, who: &Identity) -> Result<ReloadReport, ReloadError> {
        if !who.is_admin {
            return Err(ReloadError::Denied(GatewayError::new(ErrorCode::PermissionDenied, "admin applications only")));
        }
        tracing::info!(application = %who.application, "configuration reload asked for");
        self.reload().await
    }

    /// Reads the configuration file again and puts it in force, or
    /// refuses it with every problem and changes nothing (see the module
    /// doc). Logged and counted either way.
    pub async fn reload(&self) -> Result<ReloadReport, ReloadError> {
        let _one = self.reloads.one_at_a_time.lock().await;
        let result = self.reload_now().await;
        let label = if result.is_ok() { "ok" } else { "refused" };
        self.reloads.total.with_label_values(&[label]).inc();
        match &result {
            Ok(r) => tracing::info!(
                version = %r.config_version,
                previous = %r.previous_version,
                changes = %serde_json::to_string(&r.changes).unwrap_or_default(),
                "configuration reloaded"
            ),
            Err(ReloadError::Invalid(e)) => {
                tracing::error!(errors = %e, "configuration reload refused; the configuration in force stays")
            }
            Err(ReloadError::Denied(_)) => {}
        }
        result
    }

    async fn reload_now(&self) -> Result<ReloadReport, ReloadError> {
        let old = self.config();
        let Some(path) = old.source.clone() else {
            return Err(ReloadError::Invalid(ConfigErrors(vec![crate::config::ConfigError {
                path: String::new(),
                message: "this gateway was not started from a file: there is nothing to reload".into(),
            }])));
        };
        // Reading and validating may hash keys and read files: off the
        // runtime's threads.
        let load = tokio::task::spawn_blocking(move || Config::load(&path));
        let loaded = load.await.map_err(|e| {
            ReloadError::Invalid(ConfigErrors(vec![crate::config::ConfigError {
                path: String::new(),
                message: format!("loading failed: {e}"),
            }]))
        })?;
        let mut new = loaded.map_err(ReloadError::Invalid)?;
        let changes = crate::config::reload::plan(&old, &new).map_err(ReloadError::Invalid)?;
        let report =
            ReloadReport { previous_version: old.version.clone(), config_version: new.version.clone(), changes };
        new.source = old.source.clone();
        let removed: Vec<String> = old.engines.keys().filter(|e| !new.engines.contains_key(*e)).cloned().collect();
        let new = Arc::new(new);
        // The order: limits and credentials first, then the configuration
        // admission reads; a call in between sees the new keys with the old
        // admission rules at worst, never a key without its application.
        self.scheduler.set_limits(&new);
        self.metrics.set_queue_capacities(&new);
        self.auth.reload(&new);
        self.sessions.reconfigure(&new);
        *self.config.write().unwrap_or_else(std::sync::PoisonError::into_inner) = new;
        // Connections that outlive one call (MQTT) check their credential
        // again: a device or application the file no longer has ends.
        self.auth.announce();
        *self.reloads.last.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(SystemTime::now());
        // The scheduler took the limits once it answers a later command:
        // the reload's answer means "in force".
        let _ = self.scheduler.snapshot().await;
        for engine in removed {
            // Its running tasks end as they would (finished, or at their
            // deadline), then its process stops. Not tracked: it ends by
            // itself, and at shutdown with the scheduler (`when_idle`
            // answers `None`) or the processes' own stop.
            let (scheduler, processes) = (self.scheduler.clone(), self.processes.clone());
            tokio::spawn(async move {
                tracing::info!(%engine, "engine removed from the configuration: draining");
                if scheduler.when_idle(&engine).await.is_some() {
                    processes.stop_one(&engine).await;
                    tracing::info!(%engine, "engine removed from the configuration: drained and stopped");
                }
            });
        }
        Ok(report)
    }

    /// The time of the last accepted reload (`None`: none since start).
    pub fn last_reload(&self) -> Option<SystemTime> {
        *self.reloads.last.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The tenant and application an API key digest belongs to in the
    /// configuration in force (`None`: not a key, or one a reload
    /// removed): for connections that outlive one call (WebSocket).
    pub fn key_owner(&self, digest: &[u8; 32]) -> Option<(String, String)> {
        self.auth.key_owner(digest)
    }
}
