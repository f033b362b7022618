//! The retention purge on a large store: a SQLite file filled with
//! finished task rows (7 transitions each, as a real task leaves), then
//! purged by the store's own writer thread, pass after pass, as a gateway
//! whose retention they are all past would. Prints the fill time, the
//! purge's wall time, the time each pass held the writer (mean and
//! longest), rows per second, and the load of the machine before and after
//! (a shared machine: read the figures with it).
//!
//! ```text
//! cargo bench --bench purge                      # 1 000 000 tasks
//! PURGE_ROWS=100000 PURGE_BATCH=2000 cargo bench --bench purge
//! ```
//!
//! Passes run back to back here (`purge_interval` 1 ms); a gateway runs one
//! a second while it is behind (`StoreOptions::purge_interval` is a
//! minute, a full pass brings the next one to a second), so its backlog
//! drains at `batch` tasks a second, each pass holding the writer as long
//! as measured here.

use std::path::Path;
use std::time::{Duration, Instant};

use edgeway::store::{Store, StoreOptions};
use rusqlite::{params, Connection};

fn env(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn load() -> String {
    std::fs::read_to_string("/proc/loadavg").unwrap_or_default().trim().to_string()
}

fn file_mb(db: &Path) -> f64 {
    let size = |p: String| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
    (size(db.display().to_string()) + size(format!("{}-wal", db.display()))) as f64 / 1e6
}

/// `n` finished tasks, `updated_at_ms` 1..=n (all long past any retention).
fn fill(db: &Path, n: usize) {
    let c = Connection::open(db).unwrap();
    c.pragma_update(None, "journal_mode", "WAL").unwrap();
    c.pragma_update(None, "synchronous", "NORMAL").unwrap();
    let result_json = format!(
        r#"{{"request_id":"req","task_id":"t","status":"SUCCEEDED","model":"general-chat","instance":"fake","node_id":"edge-1","usage":{{"input_tokens":24,"output_tokens":64,"total_tokens":88}},"timing":{{"queue_ms":1,"first_token_ms":40,"total_ms":900}},"route":{{"requested_model":"general-chat","attempts":1,"data_class":"personal","hops":[],"degraded":false}},"pad":"{}"}}"#,
        "x".repeat(100)
    );
    let states = ["RECEIVED", "VALIDATING", "QUEUED", "DISPATCHING", "RUNNING", "STREAMING", "SUCCEEDED"];
    let chunk = 50_000;
    let mut i = 0;
    while i < n {
        let t = c.unchecked_transaction().unwrap();
        {
            let mut task = t
                .prepare(
                    "INSERT INTO tasks (task_id, request_id, tenant, application, user_id, ingress, logical_model, \
                     priority, state, created_at_ms, updated_at_ms, prompt_sha256, result_json, trace_id, data_class) \
                     VALUES (?1, ?2, 'demo', 'demo', ?3, 'http', 'general-chat', 'P2', 'SUCCEEDED', ?4, ?4, ?5, ?6, ?7, \
                     'personal')",
                )
                .unwrap();
            let mut tr = t
                .prepare(
                    "INSERT INTO task_transitions (task_id, seq, state, at_ms, reason, node_id, instance, actor) \
                     VALUES (?1, ?2, ?3, ?4, 'a reason of about forty characters long', 'edge-1', 'fake', 'scheduler')",
                )
                .unwrap();
            for k in i..(i + chunk).min(n) {
                let id = format!("{k:032x}");
                let at = k as i64 + 1;
                task.execute(params![
                    id,
                    format!("req-{k}"),
                    format!("user-{}", k % 100),
                    at,
                    format!("{:064x}", k),
                    result_json,
                    id
                ])
                .unwrap();
                for (seq, state) in states.iter().enumerate() {
                    tr.execute(params![id, seq as i64, state, at]).unwrap();
                }
            }
        }
        t.commit().unwrap();
        i += chunk;
    }
    c.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(())).unwrap();
}

fn main() {
    let n = env("PURGE_ROWS", 1_000_000);
    let batch = env("PURGE_BATCH", 1000);
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("edgeway.db");
    println!("load before: {}", load());
    // The store makes the schema (and its migrations), then goes.
    drop(Store::open(&db, "edge-1", false).unwrap());
    std::thread::sleep(Duration::from_millis(200));
    let start = Instant::now();
    fill(&db, n);
    println!(
        "filled {n} finished tasks × 7 transitions in {:.1} s; file {:.0} MB",
        start.elapsed().as_secs_f64(),
        file_mb(&db)
    );

    let opts = StoreOptions {
        retention_tasks: Some(Duration::from_millis(1)),
        purge_interval: Duration::from_millis(1),
        purge_batch: batch,
        ..StoreOptions::default()
    };
    let start = Instant::now();
    let store = Store::open_with(&db, "edge-1", false, opts).unwrap();
    let health = store.health();
    let deadline = start + Duration::from_secs(3600);
    while health.purge_stats().rows < n as u64 {
        assert!(Instant::now() < deadline, "the purge did not finish within an hour: {:?}", health.purge_stats());
        std::thread::sleep(Duration::from_millis(20));
    }
    let wall = start.elapsed();
    let s = health.purge_stats();
    println!(
        "purged {} tasks in {} passes of up to {batch}: wall {:.1} s, writer held {:.1} s in all, \
         a pass {:.1} ms on average, {:.1} ms at most; {:.0} tasks/s while purging",
        s.rows,
        s.passes,
        wall.as_secs_f64(),
        s.total.as_secs_f64(),
        s.total.as_secs_f64() * 1e3 / s.passes.max(1) as f64,
        s.longest.as_secs_f64() * 1e3,
        s.rows as f64 / s.total.as_secs_f64()
    );
    println!(
        "at a gateway's pace (a pass a second while behind): {n} tasks drain in about {:.0} min",
        (n as f64 / batch as f64) / 60.0
    );
    drop(store);
    std::thread::sleep(Duration::from_millis(200));
    println!("file after: {:.0} MB (freed pages are reused, not given back)", file_mb(&db));
    println!("load after: {}", load());
}
