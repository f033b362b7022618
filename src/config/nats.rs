//! The `[nats]` section: the internal service bus (NATS), its credentials,
//! subjects and the lifecycle event stream. Without `[nats]` (or
//! `EDGEWAY__NATS__URL`) the bus is off and edgeway runs without it.
//!
//! Secrets never come from the config text: a token or password is read
//! from the environment variable the file names, an NKey/JWT from a creds
//! file. They are wrapped in [`Secret`], whose `Debug` prints nothing.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use serde::Deserialize;

/// A credential that must never reach a log line or a debug print.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(s: impl Into<String>) -> Secret {
        Secret(s.into())
    }

    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(***)")
    }
}

/// How edgeway authenticates to the NATS server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NatsAuth {
    None,
    Token(Secret),
    UserPassword {
        user: String,
        password: Secret,
    },
    /// A `.creds` file (user JWT and NKey seed), read at connect time.
    CredsFile(PathBuf),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JetStreamStorage {
    File,
    Memory,
}

/// The JetStream stream that keeps lifecycle events for subscribers that
/// were down. Created (or updated) by edgeway on every (re)connect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JetStreamConfig {
    pub stream: String,
    pub max_age: Duration,
    pub max_bytes: u64,
    pub storage: JetStreamStorage,
}

#[derive(Debug, Clone)]
pub struct NatsConfig {
    /// One server URL or several, comma-separated. Never holds credentials.
    pub url: String,
    /// Connection name shown by the server (`nats server report connections`).
    pub name: String,
    /// Subject prefix: `{prefix}.chat`, `{prefix}.cancel`, `{prefix}.events.…`.
    pub prefix: String,
    pub auth: NatsAuth,
    /// Queue group of the service endpoints: several edgeway nodes on one bus
    /// share the requests.
    pub queue_group: String,
    /// Publish lifecycle events on `{prefix}.events.{tenant}.{state}`.
    pub events: bool,
    /// Lifecycle events waiting to be published; more are dropped (counted).
    pub events_queue_capacity: usize,
    /// After this long without an event on a reply stream, a keepalive probe
    /// is sent so that a vanished caller is noticed while a task waits.
    pub keepalive: Duration,
    /// How long a reply stream may be unable to publish (bus down, client
    /// buffer full) before its task is cancelled.
    pub caller_timeout: Duration,
    pub connect_timeout: Duration,
    /// Upper bound of the exponential reconnect backoff.
    pub reconnect_max_delay: Duration,
    pub jetstream: Option<JetStreamConfig>,
}

impl NatsConfig {
    pub fn subject(&self, suffix: &str) -> String {
        format!("{}.{suffix}", self.prefix)
    }

    /// The server URL(s) without any user information, for logs.
    pub fn redacted_url(&self) -> String {
        self.url
            .split(',')
            .map(|u| match (u.find("://"), u.rfind('@')) {
                (Some(s), Some(at)) if at > s => format!("{}{}", &u[..s + 3], &u[at + 1..]),
                _ => u.to_string(),
            })
            .collect::<Vec<_>>()
            .join(",")
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawNats {
    pub url: String,
    pub name: Option<String>,
    #[serde(default = "d_prefix")]
    pub prefix: String,
    /// Name of the environment variable holding the token.
    pub token_env: Option<String>,
    pub user: Option<String>,
    /// Name of the environment variable holding the password of `user`.
    pub password_env: Option<String>,
    pub creds_file: Option<String>,
    #[serde(default = "d_queue_group")]
    pub queue_group: String,
    #[serde(default = "d_true")]
    pub events: bool,
    #[serde(default = "d_events_queue")]
    pub events_queue_capacity: usize,
    #[serde(default = "d_keepalive")]
    pub keepalive_ms: u64,
    #[serde(default = "d_caller_timeout")]
    pub caller_timeout_ms: u64,
    #[serde(default = "d_connect_timeout")]
    pub connect_timeout_ms: u64,
    #[serde(default = "d_reconnect_max")]
    pub reconnect_max_delay_ms: u64,
    pub jetstream: Option<RawJetStream>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawJetStream {
    #[serde(default = "d_stream")]
    pub stream: String,
    #[serde(default = "d_max_age")]
    pub max_age_ms: u64,
    #[serde(default = "d_max_bytes")]
    pub max_bytes: u64,
    #[serde(default = "d_storage")]
    pub storage: String,
}

fn d_prefix() -> String {
    "ai.v1".into()
}
fn d_queue_group() -> String {
    "edgeway".into()
}
fn d_true() -> bool {
    true
}
fn d_events_queue() -> usize {
    8192
}
fn d_keepalive() -> u64 {
    2_000
}
fn d_caller_timeout() -> u64 {
    10_000
}
fn d_connect_timeout() -> u64 {
    2_000
}
fn d_reconnect_max() -> u64 {
    5_000
}
fn d_stream() -> String {
    "EDGEWAY_EVENTS".into()
}
fn d_max_age() -> u64 {
    24 * 3600 * 1000
}
fn d_max_bytes() -> u64 {
    1024 * 1024 * 1024
}
fn d_storage() -> String {
    "file".into()
}

/// True for a subject of literal tokens (no wildcards, no empty tokens, no
/// whitespace).
fn valid_subject(s: &str) -> bool {
    !s.is_empty()
        && s.split('.').all(|t| !t.is_empty() && !t.contains(['*', '>']) && !t.chars().any(char::is_whitespace))
}

/// Validates `[nats]`, reporting problems through `err(key path, message)`.
pub fn validate(
    n: RawNats,
    env: &[(String, String)],
    base_dir: &Path,
    node_id: &str,
    err: &mut dyn FnMut(String, String),
) -> NatsConfig {
    let getenv = |name: &str| env.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone());
    let url = n.url.trim().to_string();
    if url.is_empty() {
        err("nats.url".into(), "must not be empty".into());
    }
    for u in url.split(',').filter(|u| !u.trim().is_empty()) {
        let u = u.trim();
        if u.split("://").nth(1).is_some_and(|rest| rest.contains('@')) {
            err(
                "nats.url".into(),
                "must not carry credentials; use token_env, user + password_env or creds_file".into(),
            );
        } else if async_nats::ServerAddr::from_str(u).is_err() {
            err("nats.url".into(), format!("{u:?} is not a NATS server URL like nats://127.0.0.1:4222"));
        }
    }
    if !valid_subject(&n.prefix) {
        err("nats.prefix".into(), format!("{:?} is not a subject prefix like \"ai.v1\"", n.prefix));
    }
    if n.queue_group.is_empty() || n.queue_group.chars().any(|c| c.is_whitespace() || c == '*' || c == '>') {
        err("nats.queue_group".into(), "must be a name without spaces or wildcards".into());
    }
    let from_env = |key: &str, var: &str, err: &mut dyn FnMut(String, String)| match getenv(var) {
        Some(v) if !v.is_empty() => Some(Secret(v)),
        _ => {
            err(format!("nats.{key}"), format!("environment variable {var} is not set"));
            None
        }
    };
    let chosen = [n.token_env.is_some(), n.user.is_some() || n.password_env.is_some(), n.creds_file.is_some()];
    let auth = if chosen.iter().filter(|c| **c).count() > 1 {
        err("nats".into(), "use only one of token_env, user + password_env, creds_file".into());
        NatsAuth::None
    } else if let Some(var) = &n.token_env {
        from_env("token_env", var, err).map(NatsAuth::Token).unwrap_or(NatsAuth::None)
    } else if n.user.is_some() || n.password_env.is_some() {
        match (&n.user, &n.password_env) {
            (Some(user), Some(var)) => from_env("password_env", var, err)
                .map(|password| NatsAuth::UserPassword { user: user.clone(), password })
                .unwrap_or(NatsAuth::None),
            (None, _) => {
                err("nats.user".into(), "is required with password_env".into());
                NatsAuth::None
            }
            (_, None) => {
                err("nats.password_env".into(), "is required with user".into());
                NatsAuth::None
            }
        }
    } else if let Some(f) = &n.creds_file {
        let p = if Path::new(f).is_absolute() { PathBuf::from(f) } else { base_dir.join(f) };
        if let Err(e) = std::fs::metadata(&p) {
            err("nats.creds_file".into(), format!("cannot read {}: {e}", p.display()));
        }
        NatsAuth::CredsFile(p)
    } else {
        NatsAuth::None
    };
    if n.events_queue_capacity == 0 {
        err("nats.events_queue_capacity".into(), "must be at least 1".into());
    }
    for (key, v, min) in [
        ("keepalive_ms", n.keepalive_ms, 50),
        ("caller_timeout_ms", n.caller_timeout_ms, 100),
        ("connect_timeout_ms", n.connect_timeout_ms, 100),
        ("reconnect_max_delay_ms", n.reconnect_max_delay_ms, 10),
    ] {
        if v < min {
            err(format!("nats.{key}"), format!("must be at least {min}"));
        }
    }
    let jetstream = n.jetstream.map(|j| {
        if j.stream.is_empty() || j.stream.contains(['.', '*', '>', '/', '\\', ' ', '\t']) {
            err("nats.jetstream.stream".into(), format!("{:?} is not a stream name", j.stream));
        }
        if j.max_age_ms == 0 {
            err("nats.jetstream.max_age_ms".into(), "must be greater than 0".into());
        }
        if j.max_bytes == 0 || j.max_bytes > i64::MAX as u64 {
            err("nats.jetstream.max_bytes".into(), "must be greater than 0".into());
        }
        let storage = match j.storage.as_str() {
            "file" => JetStreamStorage::File,
            "memory" => JetStreamStorage::Memory,
            other => {
                err("nats.jetstream.storage".into(), format!("must be \"file\" or \"memory\", not {other:?}"));
                JetStreamStorage::File
            }
        };
        JetStreamConfig {
            stream: j.stream,
            max_age: Duration::from_millis(j.max_age_ms),
            max_bytes: j.max_bytes,
            storage,
        }
    });
    NatsConfig {
        url,
        name: n.name.unwrap_or_else(|| format!("edgeway-{node_id}")),
        prefix: n.prefix,
        auth,
        queue_group: n.queue_group,
        events: n.events,
        events_queue_capacity: n.events_queue_capacity,
        keepalive: Duration::from_millis(n.keepalive_ms),
        caller_timeout: Duration::from_millis(n.caller_timeout_ms),
        connect_timeout: Duration::from_millis(n.connect_timeout_ms),
        reconnect_max_delay: Duration::from_millis(n.reconnect_max_delay_ms),
        jetstream,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(extra: &str, env: &[(&str, &str)]) -> Result<crate::config::Config, crate::config::ConfigErrors> {
        let text = crate::testing::config_toml("http://127.0.0.1:1", "openai", Path::new("/tmp/x"), extra);
        let env: Vec<(String, String)> = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        crate::config::Config::from_toml_str(&text, env, Path::new("."))
    }

    #[test]
    fn nats_is_off_without_a_url_and_on_with_the_environment_variable() {
        assert!(load("", &[]).unwrap().nats.is_none());
        let c = load("", &[("EDGEWAY__NATS__URL", "nats://127.0.0.1:4222")]).unwrap();
        let n = c.nats.unwrap();
        assert_eq!(n.subject("chat"), "ai.v1.chat");
        assert_eq!(n.name, "edgeway-test-node");
        assert_eq!(n.auth, NatsAuth::None);
        assert!(n.events && n.jetstream.is_none());
    }

    #[test]
    fn secrets_come_from_the_environment_and_never_print() {
        let c = load(
            "[nats]\nurl = \"nats://127.0.0.1:4222\"\ntoken_env = \"NATS_TOKEN\"\n",
            &[("NATS_TOKEN", "s3cret-token")],
        )
        .unwrap();
        let n = c.nats.unwrap();
        assert_eq!(n.auth, NatsAuth::Token(Secret::new("s3cret-token")));
        assert!(!format!("{n:?}").contains("s3cret"));
    }

    #[test]
    fn every_bad_key_is_reported_by_its_path() {
        let e = load(
            "[nats]\nurl = \"nats://u:p@127.0.0.1:4222\"\nprefix = \"ai.*\"\ntoken_env = \"MISSING\"\n\
             user = \"x\"\nkeepalive_ms = 1\n[nats.jetstream]\nstream = \"a.b\"\nstorage = \"disk\"\n",
            &[],
        )
        .unwrap_err();
        let paths: Vec<&str> = e.0.iter().map(|e| e.path.as_str()).collect();
        for p in
            ["nats.url", "nats.prefix", "nats", "nats.keepalive_ms", "nats.jetstream.stream", "nats.jetstream.storage"]
        {
            assert!(paths.contains(&p), "{p} missing in {paths:?}");
        }
        let e = load("[nats]\nurl = \"nats://127.0.0.1:4222\"\nsubjects = 1\n", &[]).unwrap_err();
        assert!(e.to_string().contains("subjects"), "{e}");
    }

    #[test]
    fn urls_are_redacted_for_logs() {
        let mut n = load("", &[("EDGEWAY__NATS__URL", "nats://127.0.0.1:4222")]).unwrap().nats.unwrap();
        n.url = "nats://a:b@h1:4222,tls://h2:4222".into();
        assert_eq!(n.redacted_url(), "nats://h1:4222,tls://h2:4222");
    }
}
