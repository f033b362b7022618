//! GPU watchdog: polls accelerator state (NVML, when an NVIDIA GPU and
//! driver are present) and, when the machine enters the danger zone
//! (temperature or memory over the configured thresholds), closes admission
//! and cancels running and waiting work from `cancel_from_priority` down;
//! admission reopens when readings are back under the limits.
//!
//! Owns: the poll loop, the danger decision ([`danger`]) and the GPU gauges
//! it sets. Does not own: which tasks run or how a cancel reaches the engine
//! (scheduler), nor memory admission without a GPU (each engine's configured
//! `memory_budget_mb`).
//!
//! Without a GPU, NVML fails to initialise (an error, not a panic) and the
//! watch only logs that once.

use tokio_util::sync::CancellationToken;

use crate::config::ResourceConfig;
use crate::scheduler::SchedulerHandle;
use crate::telemetry::Metrics;

/// One reading of one GPU.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuReading {
    pub index: u32,
    pub temperature_c: u32,
    pub memory_used: u64,
    pub memory_total: u64,
}

/// Why the readings are dangerous, or `None`.
pub fn danger(readings: &[GpuReading], cfg: &ResourceConfig) -> Option<String> {
    readings.iter().find_map(|r| {
        let mem_pct = if r.memory_total > 0 { r.memory_used as f64 * 100.0 / r.memory_total as f64 } else { 0.0 };
        if r.temperature_c >= cfg.danger_gpu_temperature_c {
            Some(format!("GPU {} at {} °C (limit {} °C)", r.index, r.temperature_c, cfg.danger_gpu_temperature_c))
        } else if mem_pct >= cfg.danger_gpu_memory_percent {
            Some(format!("GPU {} memory {:.1} % used (limit {:.1} %)", r.index, mem_pct, cfg.danger_gpu_memory_percent))
        } else {
            None
        }
    })
}

/// Reads every GPU through NVML. `Err` when there is no usable driver.
pub fn read_gpus(nvml: &nvml_wrapper::Nvml) -> Result<Vec<GpuReading>, nvml_wrapper::error::NvmlError> {
    use nvml_wrapper::enum_wrappers::device::TemperatureSensor;
    let n = nvml.device_count()?;
    let mut out = Vec::with_capacity(n as usize);
    for i in 0..n {
        let d = nvml.device_by_index(i)?;
        let mem = d.memory_info()?;
        out.push(GpuReading {
            index: i,
            temperature_c: d.temperature(TemperatureSensor::Gpu).unwrap_or(0),
            memory_used: mem.used,
            memory_total: mem.total,
        });
    }
    Ok(out)
}

/// Watches the GPUs until `cancel`; reports danger changes to the scheduler.
///
/// # Cancel safety
/// Dropping it only stops the watch; the scheduler keeps the last state.
pub async fn watch(
    cfg: ResourceConfig,
    scheduler: SchedulerHandle,
    metrics: std::sync::Arc<Metrics>,
    cancel: CancellationToken,
) {
    if !cfg.gpu {
        return;
    }
    let nvml = match tokio::task::spawn_blocking(nvml_wrapper::Nvml::init).await {
        Ok(Ok(n)) => n,
        Ok(Err(e)) => {
            tracing::info!(error = %e, "no NVIDIA GPU to watch (NVML unavailable); memory admission uses configured budgets");
            return;
        }
        Err(_) => return,
    };
    let nvml = std::sync::Arc::new(nvml);
    let mut in_danger = false;
    let mut tick = tokio::time::interval(cfg.poll_interval);
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tick.tick() => {}
        }
        let (n, m) = (nvml.clone(), metrics.clone());
        let readings = match tokio::task::spawn_blocking(move || {
            crate::telemetry::gpu::record(&n, &m);
            read_gpus(&n)
        })
        .await
        {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "reading the GPUs failed");
                continue;
            }
            Err(_) => continue,
        };
        for r in &readings {
            let idx = r.index.to_string();
            metrics.gpu_temperature.with_label_values(&[&idx]).set(i64::from(r.temperature_c));
            metrics.gpu_memory_used.with_label_values(&[&idx]).set(r.memory_used as i64);
        }
        match danger(&readings, &cfg) {
            Some(why) if !in_danger => {
                in_danger = true;
                tracing::warn!(reason = %why, "danger zone: admission stopped, low-priority work cancelled");
                scheduler.set_danger(Some(why.clone()));
                let n =
                    scheduler.cancel_where(|e| e.priority >= cfg.cancel_from_priority, &format!("danger state: {why}"));
                tracing::warn!(cancelled = n, "cancelled tasks for the danger state");
            }
            None if in_danger => {
                in_danger = false;
                tracing::info!("out of the danger zone: admitting work again");
                scheduler.set_danger(None);
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::task::Priority;

    fn cfg() -> ResourceConfig {
        ResourceConfig {
            gpu: true,
            poll_interval: Duration::from_secs(1),
            danger_gpu_temperature_c: 90,
            danger_gpu_memory_percent: 97.0,
            cancel_from_priority: Priority::P3,
        }
    }

    #[test]
    fn danger_zone_thresholds() {
        let ok = GpuReading { index: 0, temperature_c: 70, memory_used: 50, memory_total: 100 };
        assert_eq!(danger(std::slice::from_ref(&ok), &cfg()), None);
        let hot = GpuReading { temperature_c: 91, ..ok.clone() };
        assert!(danger(&[ok.clone(), hot], &cfg()).unwrap().contains("91 °C"));
        let full = GpuReading { memory_used: 98, ..ok };
        assert!(danger(&[full], &cfg()).unwrap().contains("memory 98.0 %"));
    }

    #[test]
    fn no_gpu_is_an_error_not_a_panic() {
        // On machines without the NVIDIA driver this must fail cleanly; on a
        // GPU machine it reads every device.
        match nvml_wrapper::Nvml::init() {
            Err(_) => {}
            Ok(n) => {
                let r = read_gpus(&n).unwrap();
                assert!(r.iter().all(|g| g.memory_total > 0));
            }
        }
    }
}
