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
//! their deadline, then its process (if edgeway runs it) is stopped. An
//! engine the file adds gets a new instance (a supervised one's process is
//! started; the instance takes work once its probe passes); a changed one
//! gets a new instance too, and the old one drains as a removed one does
//! (a supervised engine whose command changed is stopped once drained and
//! started again with the new one). Work queued for a changed engine
//! waits for its new instance (the scheduler maps it over). A reload that
//! touches an engine whose previous instance still drains is refused
//! (`engines.NAME`): a supervised process is known by its engine's name,
//! so two generations in flight could stop the wrong one. A refused reload
//! changes nothing (a process prepared before the refusal is undone).
//!
//! Running and queued tasks keep what they were admitted with: their
//! request was resolved against the configuration of their admission, and
//! a lowered limit only judges later admissions and grants.
//!
//! Owns: the order of the swap, the reload count and the version and time
//! of the last reload. Does not own: the rule of what may change (`config`)
//! or the triggers (the HTTP admin route, the signal in `main`).

use std::collections::HashMap;
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
    /// Engines whose previous instance still drains (with how many such
    /// instances): a reload that touches one is refused until the drain
    /// task (which stops and starts its process) has ended.
    draining: Arc<std::sync::Mutex<HashMap<String, usize>>>,
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
        Reloads { one_at_a_time: Default::default(), total, last: Default::default(), draining: Default::default() }
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
        let engines = crate::config::reload::engine_plan(&old, &new);
        let refuse = |path: &str, message: String| {
            ReloadError::Invalid(ConfigErrors(vec![crate::config::ConfigError { path: path.to_string(), message }]))
        };
        // A supervised engine's process is known by its name: a second
        // generation started, stopped or replaced while the first still
        // drains would stop the wrong process (review 15 H2). The simple
        // rule: wait for the drain.
        {
            let draining = self.reloads.draining.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            let touched = engines.added.iter().chain(&engines.replaced).chain(&engines.removed);
            let busy: Vec<crate::config::ConfigError> = touched
                .filter(|name| draining.contains_key(*name))
                .map(|name| crate::config::ConfigError {
                    path: format!("engines.{name}"),
                    message: "its previous instance, removed or changed by an earlier reload, is still draining; \
                              reload again once its running tasks have ended"
                        .to_string(),
                })
                .collect();
            if !busy.is_empty() {
                return Err(ReloadError::Invalid(ConfigErrors(busy)));
            }
        }
        let router = self.scheduler.router().clone();
        let fresh: Vec<&String> = engines.added.iter().chain(&engines.replaced).collect();
        if fresh.len() > router.room() {
            return Err(refuse(
                "engines",
                format!(
                    "{} engine(s) added or changed, room for {} more since start ({} in all); this needs a restart",
                    fresh.len(),
                    router.room(),
                    crate::engine::RELOAD_ROOM
                ),
            ));
        }
        let report =
            ReloadReport { previous_version: old.version.clone(), config_version: new.version.clone(), changes };
        new.source = old.source.clone();
        let new = Arc::new(new);
        // Processes of engines added, or changed in how they run: made
        // ready (their instance waits for them), started below or once
        // the old one is gone.
        // Every adapter can be built (a bad URL…) before anything changes.
        for name in &fresh {
            crate::engine::build(&new.engines[*name]).map_err(|e| refuse(&format!("engines.{name}"), e.to_string()))?;
        }
        let restarted = |n: &String| engines.restarted.contains(n);
        // What each prepare replaced: a refusal after it puts that back,
        // so a refused reload leaves no prepared process or status.
        let mut undo = Vec::new();
        let rollback = |undo: Vec<(&String, _)>| {
            for (name, before) in undo {
                self.processes.unprepare(name, before);
            }
        };
        for name in fresh.iter().filter(|n| engines.added.contains(n) || restarted(n)) {
            let before = self.processes.before_prepare(name);
            if let Err(e) = self.processes.prepare(&new.engines[*name]).await {
                rollback(undo);
                return Err(refuse(&format!("engines.{name}"), format!("cannot prepare its process: {e}")));
            }
            if new.engines[*name].process.is_some() {
                undo.push((*name, before));
            }
        }
        // Every instance is made before any is added: a failure leaves the
        // router as it was.
        let mut instances = Vec::new();
        for name in &fresh {
            match crate::router::Router::build_instance(&new.engines[*name], &self.processes) {
                Ok(inst) => instances.push(inst),
                Err(e) => {
                    rollback(undo);
                    return Err(refuse(&format!("engines.{name}"), e.to_string()));
                }
            }
        }
        let added: Vec<(String, usize)> = instances
            .into_iter()
            .filter_map(|inst| {
                let name = inst.name.clone();
                router.add_instance(&new, inst).map(|i| (name, i))
            })
            .collect();
        // The order: limits and credentials first, then the configuration
        // admission reads; a call in between sees the new keys with the old
        // admission rules at worst, never a key without its application.
        let retired = self.scheduler.set_limits(&new, &added);
        self.metrics.set_queue_capacities(&new);
        self.metrics.set_key_expiries(&new, crate::task::now_ms());
        self.store.budgets().configure(&new);
        self.auth.reload(&new);
        self.sessions.reconfigure(&new);
        *self.config.write().unwrap_or_else(std::sync::PoisonError::into_inner) = new.clone();
        // Connections that outlive one call (MQTT) check their credential
        // again: a device or application the file no longer has ends.
        self.auth.announce();
        *self.reloads.last.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(SystemTime::now());
        // The scheduler took the limits (and knows the new instances) once
        // it answers a later command: the reload's answer means "in force".
        let _ = self.scheduler.snapshot().await;
        for (name, i) in &added {
            router.start_probe(*i);
            if engines.added.contains(name) {
                self.processes.launch(name);
            }
        }
        for (engine, i) in retired {
            // Its running tasks end as they would (finished, or at their
            // deadline), then its process stops (removed, or changed in how
            // it runs: then the new one starts). Not tracked: it ends by
            // itself, and at shutdown with the scheduler (`when_idle_at`
            // answers `None`) or the processes' own stop.
            let (scheduler, processes, router) = (self.scheduler.clone(), self.processes.clone(), router.clone());
            let removed = !new.engines.contains_key(&engine);
            let restart = engines.restarted.contains(&engine);
            let old_runs = old.engines.get(&engine).is_some_and(|e| e.process.is_some());
            let draining = self.reloads.draining.clone();
            *draining.lock().unwrap_or_else(std::sync::PoisonError::into_inner).entry(engine.clone()).or_default() += 1;
            tokio::spawn(async move {
                let what = if removed { "removed from" } else { "changed in" };
                tracing::info!(%engine, instance = i, "engine {what} the configuration: draining");
                if scheduler.when_idle_at(i).await.is_some() {
                    router.retire(i);
                    if (removed || restart) && old_runs {
                        processes.stop_one(&engine).await;
                    }
                    if restart {
                        processes.launch(&engine);
                    }
                    tracing::info!(%engine, instance = i, "engine {what} the configuration: drained");
                }
                let mut draining = draining.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                if let Some(n) = draining.get_mut(&engine) {
                    *n -= 1;
                    if *n == 0 {
                        draining.remove(&engine);
                    }
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
    /// configuration in force (`None`: not a key, one a reload removed, or
    /// one that expired): for connections that outlive one call
    /// (WebSocket).
    pub fn key_owner(&self, digest: &[u8; 32]) -> Option<(String, String)> {
        self.auth.key_owner_in_force(digest)
    }
}
