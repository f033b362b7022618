//! The `[cluster]` section: this node's entry in the node registry, a
//! JetStream key-value bucket on the bus that every node of a pool writes
//! its record into and watches (see `ingress::nats::registry`). Needs
//! `[nats]` with `[nats.jetstream]`.
//!
//! Owns: this section's format, defaults and rules. Does not own: the
//! registry itself or the record it publishes.

use std::time::Duration;

use serde::Deserialize;

use super::nats::Secret;
use super::raw::{Field, PriorityName};
use super::validate::env_var;
use super::Problems;
use crate::task::{DataClass, Priority};

/// The typed `[cluster]` section.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterConfig {
    /// This node's data zone (e.g. a site or a legal area), shown to peers.
    pub zone: String,
    /// The highest data class this node may receive from other nodes.
    pub max_data_class: DataClass,
    /// The JetStream key-value bucket of the registry.
    pub bucket: String,
    /// How often this node refreshes its record.
    pub heartbeat: Duration,
    /// A record not refreshed for this long is gone (the bucket's
    /// `max_age`, and the local view's own cut-off).
    pub ttl: Duration,
    /// Replicas of the bucket's stream (1 on a single server; 3 on a
    /// three-server cluster keeps the registry through a server loss).
    pub replicas: usize,
    /// The pool's shared key (from the environment variable `key_env`):
    /// forwarded tasks and their cancels are signed with it (HMAC-SHA256),
    /// and a node without one neither forwards nor takes forwarded work.
    pub key: Option<Secret>,
    /// Store and forward: work of this priority or less urgent (P3 by
    /// default: P3 and P4) that no node can start now waits in the pool's
    /// work queue, a JetStream work-queue stream, until a node with a free
    /// slot pulls it. More urgent work is never queued there: it takes the
    /// rest of its fallback chain (a canned answer) instead.
    pub queue_from: Priority,
    /// The work-queue stream (subjects `{prefix}.work.>`).
    pub work_stream: String,
    /// How long a node that pulled a task has to take it before the
    /// stream offers it to another node.
    pub work_ack_wait: Duration,
}

/// How long queued work and the claims that make it run once are kept at
/// most (a task's own deadline usually ends its wait much sooner).
pub const WORK_MAX_AGE: Duration = Duration::from_secs(24 * 3600);

/// The shortest pool key accepted: 32 characters.
pub const MIN_KEY_LEN: usize = 32;

#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawCluster {
    pub zone: Field<String>,
    pub max_data_class: Field<DataClass>,
    pub bucket: String,
    pub heartbeat_ms: u64,
    /// Default: three heartbeats.
    pub ttl_ms: Option<u64>,
    pub replicas: usize,
    /// The environment variable that holds the pool's shared key.
    pub key_env: Option<String>,
    pub queue_from: Field<PriorityName>,
    pub work_stream: String,
    pub work_ack_wait_ms: u64,
}

impl Default for RawCluster {
    fn default() -> Self {
        RawCluster {
            zone: Field::Missing,
            max_data_class: Field::Valid(DataClass::Sensitive),
            bucket: "edgeway_nodes".into(),
            heartbeat_ms: 2_000,
            ttl_ms: None,
            replicas: 1,
            key_env: None,
            queue_from: Field::Valid(PriorityName(Priority::P3)),
            work_stream: "edgeway_work".into(),
            work_ack_wait_ms: 30_000,
        }
    }
}

/// Validates `[cluster]`; `jetstream` says whether `[nats.jetstream]` is
/// configured. `None` after reporting a problem.
pub(super) fn validate(
    c: RawCluster,
    jetstream: bool,
    env: &[(String, String)],
    p: &mut Problems,
) -> Option<ClusterConfig> {
    if !jetstream {
        p.add("cluster", "needs [nats] with [nats.jetstream]: the registry is a JetStream key-value bucket");
    }
    let zone = c.zone.get("cluster.zone", p);
    if let Some(z) = &zone {
        if z.is_empty() || z.len() > 64 || z.chars().any(|c| c.is_whitespace() || c.is_control()) {
            p.add("cluster.zone", "must be 1..64 characters without spaces");
        }
    }
    let max_data_class = c.max_data_class.get("cluster.max_data_class", p);
    if c.bucket.is_empty()
        || c.bucket.len() > 64
        || !c.bucket.chars().all(|ch| ch.is_ascii_alphanumeric() || ch == '_' || ch == '-')
    {
        p.add("cluster.bucket", format!("{:?} is not a bucket name (letters, digits, '_', '-')", c.bucket));
    }
    if c.heartbeat_ms < 50 {
        p.add("cluster.heartbeat_ms", "must be at least 50");
    }
    let ttl_ms = c.ttl_ms.unwrap_or(c.heartbeat_ms.saturating_mul(3));
    if ttl_ms <= c.heartbeat_ms {
        p.add("cluster.ttl_ms", format!("must be greater than heartbeat_ms ({})", c.heartbeat_ms));
    }
    let stream_name = |n: &str| {
        !n.is_empty() && n.len() <= 64 && n.chars().all(|ch| ch.is_ascii_alphanumeric() || ch == '_' || ch == '-')
    };
    if !stream_name(&c.work_stream) {
        p.add("cluster.work_stream", format!("{:?} is not a stream name (letters, digits, '_', '-')", c.work_stream));
    }
    if c.work_ack_wait_ms < 100 {
        p.add("cluster.work_ack_wait_ms", "must be at least 100");
    }
    let queue_from = c.queue_from.get("cluster.queue_from", p);
    if !(1..=5).contains(&c.replicas) {
        p.add("cluster.replicas", "must be 1..5");
    }
    let key = match c.key_env.as_deref() {
        None => Some(None),
        Some(var) => match env_var(env, var) {
            Some(v) if v.len() >= MIN_KEY_LEN => Some(Some(Secret::new(v))),
            Some(_) => {
                p.add("cluster.key_env", format!("the key in {var} must be at least {MIN_KEY_LEN} characters"));
                None
            }
            None => {
                p.add("cluster.key_env", format!("environment variable {var} is not set"));
                None
            }
        },
    };
    Some(ClusterConfig {
        key: key?,
        zone: zone?,
        max_data_class: max_data_class?,
        bucket: c.bucket,
        heartbeat: Duration::from_millis(c.heartbeat_ms),
        ttl: Duration::from_millis(ttl_ms),
        replicas: c.replicas,
        queue_from: queue_from?.0,
        work_stream: c.work_stream,
        work_ack_wait: Duration::from_millis(c.work_ack_wait_ms),
    })
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::config::EngineKind;
    use crate::task::Location;

    fn load(extra: &str) -> Result<crate::config::Config, crate::config::ConfigErrors> {
        let text = crate::testing::config_toml("http://127.0.0.1:1", "openai", Path::new("/tmp/x"), extra);
        crate::config::Config::from_toml_str(&text, std::iter::empty(), Path::new("."))
    }

    const JS: &str = "[nats]\nurl = \"nats://127.0.0.1:4222\"\n[nats.jetstream]\n";

    #[test]
    fn defaults_follow_the_heartbeat() {
        let c = load(&format!("{JS}[cluster]\nzone = \"site-a\"\nheartbeat_ms = 500\n")).unwrap();
        let c = c.cluster.unwrap();
        assert_eq!(c.bucket, "edgeway_nodes");
        assert_eq!(c.heartbeat, Duration::from_millis(500));
        assert_eq!(c.ttl, Duration::from_millis(1500));
        assert_eq!(c.max_data_class, DataClass::Sensitive);
        assert_eq!((c.queue_from, c.work_stream.as_str()), (Priority::P3, "edgeway_work"));
        assert_eq!(c.work_ack_wait, Duration::from_secs(30));
        assert!(load("").unwrap().cluster.is_none());
    }

    #[test]
    fn a_pool_instance_needs_the_pool_key_and_no_address() {
        let pool = "[engines.pool]\ntype = \"pool\"\nmodel = \"general-chat\"\n";
        let cluster = format!("{JS}[cluster]\nzone = \"a\"\nkey_env = \"POOL_KEY\"\n");
        let with = |extra: &str, key: &str| {
            let text = crate::testing::config_toml("http://127.0.0.1:1", "openai", Path::new("/tmp/x"), extra);
            let env = [("POOL_KEY".to_string(), key.to_string())];
            crate::config::Config::from_toml_str(&text, env, Path::new("."))
        };
        let long = "k".repeat(MIN_KEY_LEN);
        let c = with(&format!("{cluster}{pool}"), &long).unwrap();
        let e = &c.engines["pool"];
        assert_eq!(
            (e.kind, e.location, e.max_data_class),
            (EngineKind::Pool, Location::EdgeNode, DataClass::Sensitive)
        );
        assert_eq!(c.cluster.unwrap().key.unwrap().expose(), long);
        // No key: no forwarding.
        let e = load(&format!("{JS}[cluster]\nzone = \"a\"\n{pool}")).unwrap_err();
        assert!(e.0.iter().any(|e| e.path == "engines.pool.type"), "{e}");
        let e = with(&format!("{cluster}{pool}"), "short").unwrap_err();
        assert!(e.0.iter().any(|e| e.path == "cluster.key_env"), "{e}");
        // A pool instance has no address, process or other location.
        let e = with(&format!("{cluster}{pool}base_url = \"http://x\"\nlocation = \"local\"\n"), &long).unwrap_err();
        let paths: Vec<&str> = e.0.iter().map(|e| e.path.as_str()).collect();
        assert!(paths.contains(&"engines.pool.base_url") && paths.contains(&"engines.pool.location"), "{e}");
    }

    #[test]
    fn every_bad_key_is_reported_by_its_path() {
        let e = load(
            "[cluster]\nzone = \"a b\"\nmax_data_class = \"top\"\nbucket = \"a.b\"\nheartbeat_ms = 1000\n\
             ttl_ms = 1000\nreplicas = 0\nqueue_from = \"P9\"\nwork_stream = \"a.b\"\nwork_ack_wait_ms = 1\n",
        )
        .unwrap_err();
        let paths: Vec<&str> = e.0.iter().map(|e| e.path.as_str()).collect();
        for p in [
            "cluster",
            "cluster.zone",
            "cluster.max_data_class",
            "cluster.bucket",
            "cluster.ttl_ms",
            "cluster.replicas",
            "cluster.queue_from",
            "cluster.work_stream",
            "cluster.work_ack_wait_ms",
        ] {
            assert!(paths.contains(&p), "{p} missing in {paths:?}");
        }
        let e = load(&format!("{JS}[cluster]\nzone = \"a\"\nnodes = 3\n")).unwrap_err();
        assert!(e.to_string().contains("nodes"), "{e}");
        let e = load(&format!("{JS}[cluster]\n")).unwrap_err();
        assert!(e.0.iter().any(|e| e.path == "cluster.zone"), "{e}");
    }
}
