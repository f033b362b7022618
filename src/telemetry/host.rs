//! Host resources as metrics: CPU use, memory, the store's file system and
//! network bytes, read from `/proc` and `statvfs` by a sampler on a timer
//! (never while a scrape waits, never on the request path).
//!
//! Owns: the `edgeway_host_*` families and the sampler. Does not own: GPU
//! figures ([`super::gpu`], fed by the GPU watch), nor any decision taken
//! on them (the store's own disk reserve reads the disk itself).
//!
//! A source that cannot be read (no `/proc` on this system) has no family:
//! the metric is absent rather than a made-up 0.

use std::path::{Path, PathBuf};
use std::time::Duration;

use prometheus::{Gauge, IntCounter, IntGauge, Opts, Registry};
use tokio_util::sync::CancellationToken;

/// How often the host is read. Slow enough to cost nothing measurable (a
/// few small file reads), quick enough for a 15 s scrape interval.
pub const SAMPLE_INTERVAL: Duration = Duration::from_secs(5);

/// CPU time counters of `/proc/stat`'s first line, in ticks.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct CpuTimes {
    pub busy: u64,
    pub total: u64,
}

/// `/proc/stat`'s aggregate `cpu` line: idle and iowait are idle, the rest
/// (guest time is already inside user and nice) is busy.
pub fn parse_cpu(stat: &str) -> Option<CpuTimes> {
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let f: Vec<u64> = line.split_whitespace().skip(1).take(8).map(|v| v.parse().ok()).collect::<Option<_>>()?;
    if f.len() < 5 {
        return None;
    }
    let total: u64 = f.iter().sum();
    let idle = f[3] + f[4];
    Some(CpuTimes { busy: total - idle, total })
}

/// `MemTotal` and `MemAvailable` of `/proc/meminfo`, in bytes.
pub fn parse_meminfo(meminfo: &str) -> Option<(u64, u64)> {
    let kib = |key: &str| -> Option<u64> {
        let l = meminfo.lines().find(|l| l.starts_with(key))?;
        l[key.len()..].trim().trim_end_matches("kB").trim().parse::<u64>().ok().map(|v| v * 1024)
    };
    Some((kib("MemTotal:")?, kib("MemAvailable:")?))
}

/// Bytes received and sent by every interface but loopback, from
/// `/proc/net/dev`: what the box exchanges with others.
pub fn parse_net_dev(dev: &str) -> Option<(u64, u64)> {
    let mut rx = 0u64;
    let mut tx = 0u64;
    let mut seen = false;
    for line in dev.lines().skip(2) {
        let Some((name, rest)) = line.split_once(':') else { continue };
        if name.trim() == "lo" {
            continue;
        }
        let f: Vec<u64> = rest.split_whitespace().filter_map(|v| v.parse().ok()).collect();
        if f.len() >= 9 {
            rx = rx.saturating_add(f[0]);
            tx = tx.saturating_add(f[8]);
            seen = true;
        }
    }
    // A box with loopback only has sent nothing: 0 is the truth there.
    seen.then_some((rx, tx)).or(Some((0, 0)))
}

/// Size and free space (for unprivileged users) of the file system that
/// holds `dir`, in bytes.
pub fn disk_space(dir: &Path) -> Option<(u64, u64)> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: `c` is a valid NUL-terminated path and `st` a writable
    // statvfs that the call fills in before it is read.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return None;
    }
    let frsize = st.f_frsize as u64;
    Some(((st.f_blocks as u64).saturating_mul(frsize), (st.f_bavail as u64).saturating_mul(frsize)))
}

fn read(path: &str) -> Option<String> {
    std::fs::read_to_string(path).ok()
}

struct Cpu {
    usage: Gauge,
    last: CpuTimes,
}

struct Memory {
    total: IntGauge,
    available: IntGauge,
}

struct Disk {
    dir: PathBuf,
    total: IntGauge,
    available: IntGauge,
}

struct Network {
    rx: IntCounter,
    tx: IntCounter,
    last: (u64, u64),
}

/// The host families this system can fill, and the last readings the
/// next ones are compared with.
pub struct HostSampler {
    cpu: Option<Cpu>,
    memory: Option<Memory>,
    disk: Option<Disk>,
    network: Option<Network>,
}

fn register<C: prometheus::core::Collector + Clone + 'static>(registry: &Registry, c: C) -> C {
    registry.register(Box::new(c.clone())).expect("unique metric");
    c
}

impl HostSampler {
    /// Registers the families whose source can be read here and sets them
    /// from a first reading (CPU use then is the average since boot).
    /// `data_dir` is the store's directory: its file system is the disk
    /// that fills up.
    pub fn register(registry: &Registry, data_dir: &Path) -> HostSampler {
        let int_gauge = |name: &str, help: &str| register(registry, IntGauge::new(name, help).expect("valid metric"));
        let counter = |name: &str, help: &str| register(registry, IntCounter::new(name, help).expect("valid metric"));
        let cpu = read("/proc/stat").and_then(|s| parse_cpu(&s)).map(|_| Cpu {
            usage: register(
                registry,
                Gauge::with_opts(Opts::new(
                    "host_cpu_usage_ratio",
                    "Share of the host's CPU time spent busy over the last sampling interval (0..1)",
                ))
                .expect("valid metric"),
            ),
            last: CpuTimes::default(),
        });
        let memory = read("/proc/meminfo").and_then(|s| parse_meminfo(&s)).map(|_| Memory {
            total: int_gauge("host_memory_total_bytes", "Host memory"),
            available: int_gauge("host_memory_available_bytes", "Host memory available to new work (MemAvailable)"),
        });
        let disk = disk_space(data_dir).map(|_| Disk {
            dir: data_dir.to_path_buf(),
            total: int_gauge("host_disk_total_bytes", "Size of the file system holding the task store"),
            available: int_gauge("host_disk_available_bytes", "Free space on the file system holding the task store"),
        });
        let network = read("/proc/net/dev").and_then(|s| parse_net_dev(&s)).map(|_| Network {
            rx: counter("host_network_receive_bytes_total", "Bytes the host received (all interfaces but loopback)"),
            tx: counter("host_network_transmit_bytes_total", "Bytes the host sent (all interfaces but loopback)"),
            last: (0, 0),
        });
        let mut s = HostSampler { cpu, memory, disk, network };
        s.sample();
        s
    }

    /// Reads every source once and sets the families. A source that fails
    /// now keeps its last value (a counter must not go back).
    pub fn sample(&mut self) {
        if let Some(c) = &mut self.cpu {
            if let Some(now) = read("/proc/stat").and_then(|s| parse_cpu(&s)) {
                let (busy, total) = (now.busy.saturating_sub(c.last.busy), now.total.saturating_sub(c.last.total));
                if total > 0 {
                    c.usage.set(busy as f64 / total as f64);
                }
                c.last = now;
            }
        }
        if let Some(m) = &self.memory {
            if let Some((total, available)) = read("/proc/meminfo").and_then(|s| parse_meminfo(&s)) {
                m.total.set(i64::try_from(total).unwrap_or(i64::MAX));
                m.available.set(i64::try_from(available).unwrap_or(i64::MAX));
            }
        }
        if let Some(d) = &self.disk {
            if let Some((total, available)) = disk_space(&d.dir) {
                d.total.set(i64::try_from(total).unwrap_or(i64::MAX));
                d.available.set(i64::try_from(available).unwrap_or(i64::MAX));
            }
        }
        if let Some(n) = &mut self.network {
            if let Some((rx, tx)) = read("/proc/net/dev").and_then(|s| parse_net_dev(&s)) {
                // An interface that went away makes the sum smaller: the
                // counters stay, and count from the new sum on.
                n.rx.inc_by(rx.saturating_sub(n.last.0));
                n.tx.inc_by(tx.saturating_sub(n.last.1));
                n.last = (rx, tx);
            }
        }
    }

    /// Samples every [`SAMPLE_INTERVAL`] until `cancel`. The reads are a
    /// few small files from a kernel file system: they do not block.
    pub async fn run(mut self, cancel: CancellationToken) {
        let mut tick = tokio::time::interval(SAMPLE_INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await; // the first tick is now: `register` just sampled
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tick.tick() => self.sample(),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_files_are_parsed_as_the_kernel_writes_them() {
        let stat = "cpu  100 5 50 800 20 1 2 3 0 0\ncpu0 50 2 25 400 10 0 1 1 0 0\nintr 1\n";
        assert_eq!(parse_cpu(stat), Some(CpuTimes { busy: 161, total: 981 }));
        assert_eq!(parse_cpu("intr 1\n"), None);
        let mem = "MemTotal:       16000000 kB\nMemFree:  100 kB\nMemAvailable:    8000000 kB\n";
        assert_eq!(parse_meminfo(mem), Some((16_000_000 * 1024, 8_000_000 * 1024)));
        assert_eq!(parse_meminfo("MemTotal: 1 kB\n"), None, "an old kernel without MemAvailable");
        let dev = "Inter-|   Receive |  Transmit\n face |bytes packets errs drop fifo frame compressed multicast|bytes\n    lo: 900 9 0 0 0 0 0 0 900 9 0 0 0 0 0 0\n  eth0: 1000 10 0 0 0 0 0 0 2000 20 0 0 0 0 0 0\n wlan0: 5 1 0 0 0 0 0 0 7 1 0 0 0 0 0 0\n";
        assert_eq!(parse_net_dev(dev), Some((1005, 2007)), "loopback left out");
    }

    #[test]
    fn the_sampler_exports_what_this_host_has_and_counts_network_bytes_once() {
        let registry = Registry::new_custom(Some("edgeway".into()), None).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let mut s = HostSampler::register(&registry, dir.path());
        let text = || {
            let mut buf = Vec::new();
            prometheus::Encoder::encode(&prometheus::TextEncoder::new(), &registry.gather(), &mut buf).unwrap();
            String::from_utf8(buf).unwrap()
        };
        let value = |t: &str, name: &str| -> f64 {
            t.lines().find_map(|l| l.strip_prefix(&format!("{name} "))).unwrap().trim().parse().unwrap()
        };
        let t = text();
        // This test runs on Linux: every source is there.
        let (total, available) =
            (value(&t, "edgeway_host_disk_total_bytes"), value(&t, "edgeway_host_disk_available_bytes"));
        assert!(total > 0.0 && available <= total, "{t}");
        assert!(value(&t, "edgeway_host_memory_available_bytes") <= value(&t, "edgeway_host_memory_total_bytes"));
        let cpu = value(&t, "edgeway_host_cpu_usage_ratio");
        assert!((0.0..=1.0).contains(&cpu), "{cpu}");
        let rx = value(&t, "edgeway_host_network_receive_bytes_total");
        let (now_rx, _) = parse_net_dev(&read("/proc/net/dev").unwrap()).unwrap();
        assert!(rx <= now_rx as f64, "the first sample counts what the interfaces had, not more");
        s.sample();
        let (later_rx, _) = parse_net_dev(&read("/proc/net/dev").unwrap()).unwrap();
        assert!(value(&text(), "edgeway_host_network_receive_bytes_total") <= later_rx as f64, "not counted twice");
    }
}
