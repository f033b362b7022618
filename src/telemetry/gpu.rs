//! GPU figures beyond the danger watch's own (utilisation, power,
//! throttling, memory size), read through NVML in the GPU watch's poll, so
//! NVML is opened once and only where `[resources] gpu` is on.
//!
//! Owns: setting the `edgeway_gpu_*` gauges from one NVML reading. Does not
//! own: the poll loop or the danger decision (`admission::gpu_watch`).
//! Without an NVIDIA driver NVML does not open and no `edgeway_gpu_*`
//! series exists: absent, never a made-up 0. A figure one GPU does not
//! report (power on some boards) is left out for that GPU alone.

use nvml_wrapper::bitmasks::device::ThrottleReasons;
use nvml_wrapper::Nvml;

use super::Metrics;

/// Clock slowdowns that mean heat or power, not an idle GPU or a clock an
/// administrator set.
fn throttled_for_heat_or_power(r: ThrottleReasons) -> bool {
    r.intersects(
        ThrottleReasons::SW_POWER_CAP
            | ThrottleReasons::HW_SLOWDOWN
            | ThrottleReasons::SW_THERMAL_SLOWDOWN
            | ThrottleReasons::HW_THERMAL_SLOWDOWN
            | ThrottleReasons::HW_POWER_BRAKE_SLOWDOWN,
    )
}

/// Reads utilisation, power, throttling and memory size of every GPU and
/// sets their gauges. Blocking (NVML calls the driver): run it where the
/// watch already blocks.
pub fn record(nvml: &Nvml, metrics: &Metrics) {
    let Ok(n) = nvml.device_count() else { return };
    for i in 0..n {
        let Ok(d) = nvml.device_by_index(i) else { continue };
        let idx = i.to_string();
        let idx = [idx.as_str()];
        if let Ok(m) = d.memory_info() {
            metrics.gpu_memory_total.with_label_values(&idx).set(i64::try_from(m.total).unwrap_or(i64::MAX));
        }
        if let Ok(u) = d.utilization_rates() {
            metrics.gpu_utilization.with_label_values(&idx).set(f64::from(u.gpu) / 100.0);
        }
        if let Ok(mw) = d.power_usage() {
            metrics.gpu_power.with_label_values(&idx).set(f64::from(mw) / 1000.0);
        }
        if let Ok(r) = d.current_throttle_reasons() {
            metrics.gpu_throttled.with_label_values(&idx).set(i64::from(throttled_for_heat_or_power(r)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_heat_and_power_count_as_throttling() {
        assert!(!throttled_for_heat_or_power(ThrottleReasons::GPU_IDLE));
        assert!(!throttled_for_heat_or_power(ThrottleReasons::APPLICATIONS_CLOCKS_SETTING));
        assert!(!throttled_for_heat_or_power(ThrottleReasons::NONE));
        assert!(throttled_for_heat_or_power(ThrottleReasons::SW_POWER_CAP | ThrottleReasons::GPU_IDLE));
        assert!(throttled_for_heat_or_power(ThrottleReasons::HW_THERMAL_SLOWDOWN));
    }
}
