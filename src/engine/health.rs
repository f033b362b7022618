//! Health checking of engine instances: a probe loop per instance that
//! reports up/down transitions to the scheduler, which takes a down instance
//! out of dispatch until it is up again, and passes on what a healthy
//! engine says about itself (busy slots, KV-cache usage, whether its model
//! is in memory) at every probe.

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use super::Engine;
use crate::scheduler::SchedulerHandle;
use crate::telemetry::Metrics;

/// Consecutive failed probes before an instance is marked down. One success
/// marks it up again.
const FAILURES_TO_DOWN: u32 = 2;

/// Probes `engine` every `interval` until `cancel`; tells the scheduler about
/// every change. The first probe runs at once.
///
/// # Cancel safety
/// Dropping the future only stops probing; the scheduler keeps the last
/// state it was told.
pub async fn probe_loop(
    index: usize,
    engine: Arc<dyn Engine>,
    interval: std::time::Duration,
    scheduler: SchedulerHandle,
    metrics: Arc<Metrics>,
    cancel: CancellationToken,
) {
    let mut failures = 0u32;
    let mut up: Option<bool> = None;
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tick.tick() => {}
            _ = scheduler.recheck_requested(index) => {}
        }
        let h = tokio::select! {
            _ = cancel.cancelled() => return,
            h = engine.health() => h,
        };
        if h.up {
            let load = tokio::select! {
                _ = cancel.cancelled() => return,
                l = engine.load() => l,
            };
            scheduler.report_engine_state(index, load, h.model_resident);
            show_kv_cache_usage(&metrics, engine.name(), load.kv_cache_usage);
        } else {
            // A down engine's last reading is stale.
            show_kv_cache_usage(&metrics, engine.name(), None);
        }
        let now_up = if h.up {
            failures = 0;
            true
        } else {
            failures += 1;
            // Until the first verdict, one failure is enough.
            !(failures >= FAILURES_TO_DOWN || up.is_none())
        };
        if up != Some(now_up) {
            if now_up {
                tracing::info!(engine = engine.name(), "engine instance is up");
            } else {
                tracing::warn!(engine = engine.name(), detail = %h.detail, "engine instance is down");
            }
            up = Some(now_up);
            metrics.engine_up.with_label_values(&[engine.name()]).set(i64::from(now_up));
            scheduler.set_instance_health(index, now_up, h.detail.clone());
        }
    }
}

/// Sets the instance's KV-cache gauge, or removes it while there is no
/// reading (a stale value would look like a live one).
fn show_kv_cache_usage(metrics: &Metrics, engine: &str, usage: Option<f64>) {
    match usage {
        Some(u) => metrics.engine_kv_cache_usage.with_label_values(&[engine]).set(u),
        None => {
            let _ = metrics.engine_kv_cache_usage.remove_label_values(&[engine]);
        }
    }
}
