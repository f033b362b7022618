//! Health probes: one loop per engine instance that keeps the router's view
//! of the instance current and sends every change to the scheduler's sink,
//! which takes a down instance out of dispatch until it is up again. A
//! healthy engine's self-report (busy slots, KV-cache usage, whether its
//! model is in memory) is passed on at every probe.
//!
//! Owns: when to probe, how many failures make an instance down, the
//! `edgeway_engine_up` and KV-cache gauges. Does not own: what a down
//! instance means for queued work (the scheduler decides).

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use super::{InstanceEvent, InstanceSink, Router};
use crate::telemetry::Metrics;

/// Consecutive failed probes before an instance is marked down. One success
/// marks it up again.
const FAILURES_TO_DOWN: u32 = 2;

/// Probes instance `index` every health interval until `cancel`, and at once
/// when dispatch asks for a re-check. The first probe runs at once.
///
/// # Cancel safety
/// Dropping the future only stops probing; the router and the scheduler
/// keep the last state they were told.
pub(super) async fn probe_loop(
    router: Arc<Router>,
    index: usize,
    metrics: Arc<Metrics>,
    sink: InstanceSink,
    cancel: CancellationToken,
) {
    let inst = router.instance(index);
    let engine = inst.engine.clone();
    let mut failures = 0u32;
    let mut up: Option<bool> = None;
    let mut was_restarting = false;
    // The detail last told (while up).
    let mut detail = String::new();
    let mut tick = tokio::time::interval(inst.health_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tick.tick() => {}
            _ = router.recheck(index).notified() => {}
        }
        let probed_at = std::time::Instant::now();
        let h = tokio::select! {
            _ = cancel.cancelled() => return,
            h = engine.health() => h,
        };
        if h.up {
            let load = tokio::select! {
                _ = cancel.cancelled() => return,
                l = engine.load() => l,
            };
            if let Some(resident) = h.model_resident {
                router.residency.observe(index, resident, probed_at);
            }
            let (error_rate, ttft_p95_ms) = router.measured(index);
            sink(InstanceEvent::Load {
                instance: index,
                load,
                model_resident: h.model_resident,
                error_rate,
                ttft_p95_ms,
            });
            show_kv_cache_usage(&metrics, engine.name(), load.kv_cache_usage);
        } else {
            // A down engine's last reading is stale.
            show_kv_cache_usage(&metrics, engine.name(), None);
        }
        // A supervised engine whose process is (re)starting is down at
        // once, and its breaker does not count it (see Engine::process_down).
        let planned = !h.up && engine.process_down();
        if !planned {
            router.probe_verdict(index, h.up);
        }
        let restarting = planned && engine.process_restarting();
        let now_up = if h.up {
            failures = 0;
            true
        } else {
            failures += 1;
            // Until the first verdict, one failure is enough.
            !(planned || failures >= FAILURES_TO_DOWN || up.is_none())
        };
        // An up instance whose detail changed (a pool instance's nodes) is
        // told again, for `/ready`; without a log line.
        let new_detail = now_up && up == Some(true) && h.up && h.detail != detail;
        if up != Some(now_up) || (!now_up && restarting != was_restarting) || new_detail {
            if up != Some(now_up) {
                if now_up {
                    tracing::info!(engine = engine.name(), "engine instance is up");
                } else {
                    tracing::warn!(engine = engine.name(), detail = %h.detail, "engine instance is down");
                }
            }
            up = Some(now_up);
            metrics.engine_up.with_label_values(&[engine.name()]).set(i64::from(now_up));
            detail.clone_from(&h.detail);
            sink(InstanceEvent::Health { instance: index, up: now_up, restarting, detail: h.detail });
        }
        was_restarting = restarting;
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

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;
    use std::time::Duration;

    use super::*;
    use crate::router::test_engine::{router, Scripted};

    /// Runs the probe over `ups` and returns the verdicts it sent (up or
    /// down, with the detail of the probe that decided) and how many load
    /// reports it passed on.
    async fn probe(ups: Vec<bool>) -> (Vec<(bool, String)>, Vec<(bool, String)>, usize) {
        let n = ups.len();
        let engine = Arc::new(Scripted::probes(ups));
        let router = Arc::new(router(engine.clone(), Duration::from_millis(100)));
        let events = Arc::new(Mutex::new(Vec::new()));
        let (seen, loads) = (events.clone(), Arc::new(AtomicUsize::new(0)));
        let loads_seen = loads.clone();
        let sink: InstanceSink = Arc::new(move |e| match e {
            InstanceEvent::Health { up, detail, .. } => seen.lock().unwrap().push((up, detail)),
            InstanceEvent::Load { load, .. } => {
                assert_eq!(load.busy_slots, Some(1));
                loads_seen.fetch_add(1, Ordering::SeqCst);
            }
            InstanceEvent::Breaker { .. } => {}
        });
        let cancel = CancellationToken::new();
        let task = tokio::spawn(probe_loop(router, 0, Arc::new(Metrics::new()), sink, cancel.clone()));
        // The script's last answer repeats: once probe n has started, the
        // first n are fully handled.
        while engine.probes.load(Ordering::SeqCst) <= n {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        cancel.cancel();
        task.await.unwrap();
        let told = events.lock().unwrap().clone();
        // The scripted detail names each probe, so an up instance is told
        // again at every probe (a changed detail reaches `/ready`): the
        // verdicts are the changes of `up`, each with the detail of the
        // probe that decided it.
        let mut verdicts: Vec<(bool, String)> = Vec::new();
        for (up, detail) in &told {
            if verdicts.last().is_none_or(|(last, _)| last != up) {
                verdicts.push((*up, detail.clone()));
            }
        }
        (verdicts, told, loads.load(Ordering::SeqCst))
    }

    fn verdict(up: bool, detail: &str) -> (bool, String) {
        (up, detail.to_string())
    }

    #[tokio::test(start_paused = true)]
    async fn down_after_two_failures_up_after_one_success() {
        let (events, told, loads) = probe(vec![true, false, true, false, false, false, true]).await;
        // One failure between successes changes nothing; the second in a
        // row makes it down; one success brings it back.
        assert_eq!(
            events,
            vec![verdict(true, "probe 0: ok"), verdict(false, "probe 4: refused"), verdict(true, "probe 6: ok")]
        );
        assert!(loads >= 3, "a healthy engine's load is passed on at every probe: {loads}");
        // Up all along, probe 2's new detail is told again (probe 1's
        // failure, alone, is not).
        assert_eq!(told[..2], [verdict(true, "probe 0: ok"), verdict(true, "probe 2: ok")]);
    }

    #[tokio::test(start_paused = true)]
    async fn first_failure_is_a_verdict() {
        let (events, _, _) = probe(vec![false, true]).await;
        assert_eq!(events, vec![verdict(false, "probe 0: refused"), verdict(true, "probe 1: ok")]);
        let (events, _, _) = probe(vec![false]).await;
        assert_eq!(events, vec![verdict(false, "probe 0: refused")]);
    }

    #[tokio::test(start_paused = true)]
    async fn recheck_probes_at_once() {
        let engine = Arc::new(Scripted::probes(vec![true]));
        let router = Arc::new(router(engine.clone(), Duration::from_secs(3600)));
        let cancel = CancellationToken::new();
        let sink: InstanceSink = Arc::new(|_| {});
        let task = tokio::spawn(probe_loop(router.clone(), 0, Arc::new(Metrics::new()), sink, cancel.clone()));
        while engine.probes.load(Ordering::SeqCst) < 1 {
            tokio::task::yield_now().await;
        }
        router.request_recheck(0);
        tokio::time::timeout(Duration::from_secs(60), async {
            while engine.probes.load(Ordering::SeqCst) < 2 {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("a re-check probes long before the hourly tick");
        cancel.cancel();
        task.await.unwrap();
    }
}
