//! rumqttd at the process's descriptor limit (PATCHES.md #4). A test binary
//! of its own: it lowers the limit of the whole process, which would break
//! any test running beside it.

mod mqtt_support;

use std::io::{Read, Write};
use std::time::Duration;

use mqtt_support::raw::{self, bare_rumqttd};

/// CPU time this process has used (user and system), in clock ticks.
/// `stat` is `/proc/self/stat`, opened while descriptors were left.
fn cpu_ticks(stat: &std::fs::File) -> u64 {
    use std::os::unix::fs::FileExt;
    let mut buf = vec![0u8; 4096];
    let n = stat.read_at(&mut buf, 0).expect("/proc/self/stat");
    let stat = String::from_utf8_lossy(&buf[..n]);
    // After the command name in parentheses: state is field 3, utime 14,
    // stime 15.
    let rest = &stat[stat.rfind(')').expect("comm") + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

fn set_soft_nofile(n: u64) {
    let mut l = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: plain system calls on a local struct.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut l), 0);
        l.rlim_cur = n.min(l.rlim_max);
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &l), 0);
    }
}

/// With a socket waiting in the backlog and no descriptor left, accept()
/// fails at once, again and again. Unpatched, the accept loop retried at
/// once: a core spun for as long as the condition lasted (and logged an
/// error each time). Patched, it backs off, and accepts the waiting socket
/// once descriptors are free again.
#[cfg(target_os = "linux")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rumqttd_at_the_descriptor_limit_the_accept_loop_backs_off() {
    let addr = bare_rumqttd(1000).await;
    let stat = std::fs::File::open("/proc/self/stat").unwrap();
    let open_now = std::fs::read_dir("/proc/self/fd").unwrap().count() as u64;
    // Spare descriptors, freed one at a time below.
    let mut spare: Vec<std::fs::File> = (0..2).map(|_| std::fs::File::open("/dev/null").unwrap()).collect();
    set_soft_nofile(open_now + 40);
    // Connections until no descriptor is left (each costs one here and one
    // in the listener).
    let mut clients = Vec::new();
    while let Ok(s) = std::net::TcpStream::connect(addr) {
        clients.push(s);
        assert!(clients.len() < 1000, "the limit holds");
    }
    // One more connection, waiting in the backlog: the listener has no
    // descriptor to accept it with.
    drop(spare.pop());
    let mut waiting = std::net::TcpStream::connect(addr).expect("a descriptor was freed for it");
    // Let the listener meet the condition, then measure a second of it.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let before = cpu_ticks(&stat);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let spent = cpu_ticks(&stat) - before;
    eprintln!("CPU at the descriptor limit: {spent} ticks in 1 s");
    set_soft_nofile(u64::MAX);
    // Ticks are 1/100 s on Linux: a spinning loop uses about 100.
    assert!(spent < 20, "{spent} ticks of CPU in one second at the descriptor limit");
    // Descriptors again: the waiting connection is served.
    drop(clients);
    waiting.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    waiting.write_all(&raw::connect("waiting", None)).unwrap();
    let mut ack = [0u8; 4];
    waiting.read_exact(&mut ack).expect("a CONNACK once descriptors are free");
    assert_eq!(ack, raw::ACCEPTED);
}
