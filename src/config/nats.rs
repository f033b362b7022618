//! The `[nats]` section: the internal service bus (NATS), its credentials,
//! subjects and the lifecycle event stream. Without `[nats]` (or
//! `EDGEWAY__NATS__URL`) the bus is off and edgeway runs without it.
//!
//! Secrets never come from the config text: a token or password is read
//! from the environment variable the file names, an NKey/JWT from a creds
//! file. They are wrapped in [`Secret`], whose `Debug` prints nothing.
//!
//! Owns: this section's format, defaults and rules. Does not own: the bus
//! connection (`ingress::nats`), which reads [`NatsConfig`].

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use serde::Deserialize;

use super::raw::Field;
use super::validate::{env_var, resolve};
use super::Problems;

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

/// Written `storage = "file"` or `storage = "memory"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
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
    /// Prefixes a request's reply subject must start with (inboxes): edgeway
    /// publishes replies with its own bus rights, so a caller must not point
    /// them at other subjects (`{prefix}.events.…`, another service).
    pub reply_prefixes: Vec<String>,
}

impl NatsConfig {
    /// Whether edgeway may publish a reply to `subject`.
    pub fn reply_allowed(&self, subject: &str) -> bool {
        self.reply_prefixes.iter().any(|p| subject.len() > p.len() && subject.starts_with(p.as_str()))
            && valid_subject(subject)
    }

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
#[serde(default, deny_unknown_fields)]
pub struct RawNats {
    pub url: Field<String>,
    /// Default: `edgeway-{node_id}`.
    pub name: Option<String>,
    pub prefix: String,
    /// Name of the environment variable holding the token.
    pub token_env: Option<String>,
    pub user: Option<String>,
    /// Name of the environment variable holding the password of `user`.
    pub password_env: Option<String>,
    pub creds_file: Option<PathBuf>,
    pub queue_group: String,
    pub events: bool,
    pub events_queue_capacity: usize,
    pub keepalive_ms: u64,
    pub caller_timeout_ms: u64,
    pub connect_timeout_ms: u64,
    pub reconnect_max_delay_ms: u64,
    pub jetstream: Option<RawJetStream>,
    pub reply_prefixes: Vec<String>,
}

impl Default for RawNats {
    fn default() -> Self {
        RawNats {
            url: Field::Missing,
            name: None,
            prefix: "ai.v1".into(),
            token_env: None,
            user: None,
            password_env: None,
            creds_file: None,
            queue_group: "edgeway".into(),
            events: true,
            events_queue_capacity: 8192,
            keepalive_ms: 2_000,
            caller_timeout_ms: 10_000,
            connect_timeout_ms: 2_000,
            reconnect_max_delay_ms: 5_000,
            jetstream: None,
            reply_prefixes: vec!["_INBOX.".into()],
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawJetStream {
    pub stream: String,
    pub max_age_ms: u64,
    pub max_bytes: u64,
    pub storage: Field<JetStreamStorage>,
}

impl Default for RawJetStream {
    fn default() -> Self {
        RawJetStream {
            stream: "EDGEWAY_EVENTS".into(),
            max_age_ms: 24 * 3600 * 1000,
            max_bytes: 1024 * 1024 * 1024,
            storage: Field::Valid(JetStreamStorage::File),
        }
    }
}

/// True for a subject of literal tokens (no wildcards, no empty tokens, no
/// whitespace).
fn valid_subject(s: &str) -> bool {
    !s.is_empty()
        && s.split('.').all(|t| !t.is_empty() && !t.contains(['*', '>']) && !t.chars().any(char::is_whitespace))
}

/// Validates `[nats]`; `None` after reporting a problem.
pub(super) fn validate(
    mut n: RawNats,
    env: &[(String, String)],
    base_dir: &Path,
    node_id: &str,
    p: &mut Problems,
) -> Option<NatsConfig> {
    let url = std::mem::take(&mut n.url).get("nats.url", p).map(|u| u.trim().to_string());
    if let Some(url) = &url {
        check_urls(url, p);
    }
    if !valid_subject(&n.prefix) {
        p.add("nats.prefix", format!("{:?} is not a subject prefix like \"ai.v1\"", n.prefix));
    }
    if n.queue_group.is_empty() || n.queue_group.chars().any(|c| c.is_whitespace() || c == '*' || c == '>') {
        p.add("nats.queue_group", "must be a name without spaces or wildcards");
    }
    let auth = auth(&n, env, base_dir, p);
    if n.events_queue_capacity == 0 {
        p.add("nats.events_queue_capacity", "must be at least 1");
    }
    for (key, v, min) in [
        ("keepalive_ms", n.keepalive_ms, 50),
        ("caller_timeout_ms", n.caller_timeout_ms, 100),
        ("connect_timeout_ms", n.connect_timeout_ms, 100),
        ("reconnect_max_delay_ms", n.reconnect_max_delay_ms, 10),
    ] {
        if v < min {
            p.add(format!("nats.{key}"), format!("must be at least {min}"));
        }
    }
    if n.reply_prefixes.is_empty() {
        p.add("nats.reply_prefixes", "must name at least one prefix (the default is [\"_INBOX.\"])");
    }
    for r in &n.reply_prefixes {
        let body = r.strip_suffix('.').unwrap_or(r);
        if !r.ends_with('.') || !valid_subject(body) {
            p.add("nats.reply_prefixes", format!("{r:?} is not a subject prefix ending in '.' like \"_INBOX.\""));
        } else if format!("{}.", n.prefix).starts_with(r.as_str()) || r.starts_with(&format!("{}.", n.prefix)) {
            p.add("nats.reply_prefixes", format!("{r:?} overlaps edgeway's own subjects ({}.…)", n.prefix));
        }
    }
    let jetstream = match n.jetstream {
        None => Some(None),
        Some(j) => jetstream(j, p).map(Some),
    };
    Some(NatsConfig {
        url: url?,
        name: n.name.unwrap_or_else(|| format!("edgeway-{node_id}")),
        prefix: n.prefix,
        auth: auth?,
        queue_group: n.queue_group,
        events: n.events,
        events_queue_capacity: n.events_queue_capacity,
        keepalive: Duration::from_millis(n.keepalive_ms),
        caller_timeout: Duration::from_millis(n.caller_timeout_ms),
        connect_timeout: Duration::from_millis(n.connect_timeout_ms),
        reconnect_max_delay: Duration::from_millis(n.reconnect_max_delay_ms),
        jetstream: jetstream?,
        reply_prefixes: n.reply_prefixes,
    })
}

/// One server URL or several, comma-separated, none with credentials.
fn check_urls(url: &str, p: &mut Problems) {
    if url.is_empty() {
        p.add("nats.url", "must not be empty");
    }
    for u in url.split(',').map(str::trim).filter(|u| !u.is_empty()) {
        if u.split("://").nth(1).is_some_and(|rest| rest.contains('@')) {
            p.add("nats.url", "must not carry credentials; use token_env, user + password_env or creds_file");
        } else if async_nats::ServerAddr::from_str(u).is_err() {
            p.add("nats.url", format!("{u:?} is not a NATS server URL like nats://127.0.0.1:4222"));
        }
    }
}

/// At most one way to authenticate; `None` after reporting a problem.
fn auth(n: &RawNats, env: &[(String, String)], base_dir: &Path, p: &mut Problems) -> Option<NatsAuth> {
    let chosen = [n.token_env.is_some(), n.user.is_some() || n.password_env.is_some(), n.creds_file.is_some()];
    if chosen.iter().filter(|c| **c).count() > 1 {
        p.add("nats", "use only one of token_env, user + password_env, creds_file");
        return None;
    }
    if let Some(var) = &n.token_env {
        return secret(env, "token_env", var, p).map(NatsAuth::Token);
    }
    match (&n.user, &n.password_env, &n.creds_file) {
        (Some(user), Some(var), _) => {
            secret(env, "password_env", var, p).map(|password| NatsAuth::UserPassword { user: user.clone(), password })
        }
        (None, Some(_), _) => {
            p.add("nats.user", "is required with password_env");
            None
        }
        (Some(_), None, _) => {
            p.add("nats.password_env", "is required with user");
            None
        }
        (None, None, Some(f)) => {
            let path = resolve(base_dir, f);
            match std::fs::metadata(&path) {
                Ok(_) => Some(NatsAuth::CredsFile(path)),
                Err(e) => {
                    p.add("nats.creds_file", format!("cannot read {}: {e}", path.display()));
                    None
                }
            }
        }
        (None, None, None) => Some(NatsAuth::None),
    }
}

/// The secret in environment variable `var`, named by key `nats.{key}`.
fn secret(env: &[(String, String)], key: &str, var: &str, p: &mut Problems) -> Option<Secret> {
    match env_var(env, var) {
        Some(v) if !v.is_empty() => Some(Secret::new(v)),
        _ => {
            p.add(format!("nats.{key}"), format!("environment variable {var} is not set"));
            None
        }
    }
}

fn jetstream(j: RawJetStream, p: &mut Problems) -> Option<JetStreamConfig> {
    if j.stream.is_empty() || j.stream.contains(['.', '*', '>', '/', '\\', ' ', '\t']) {
        p.add("nats.jetstream.stream", format!("{:?} is not a stream name", j.stream));
    }
    if j.max_age_ms == 0 {
        p.add("nats.jetstream.max_age_ms", "must be greater than 0");
    }
    if j.max_bytes == 0 || j.max_bytes > i64::MAX as u64 {
        p.add("nats.jetstream.max_bytes", "must be greater than 0");
    }
    let storage = j.storage.get("nats.jetstream.storage", p);
    Some(JetStreamConfig {
        stream: j.stream,
        max_age: Duration::from_millis(j.max_age_ms),
        max_bytes: j.max_bytes,
        storage: storage?,
    })
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
    fn reply_subjects_must_be_inboxes() {
        let on = |extra: &str| load(&format!("[nats]\nurl = \"nats://127.0.0.1:4222\"\n{extra}"), &[]);
        let n = on("").unwrap().nats.unwrap();
        assert_eq!(n.reply_prefixes, ["_INBOX."]);
        assert!(n.reply_allowed("_INBOX.abc.1"));
        for bad in ["_INBOX.", "ai.v1.events.demo.SUCCEEDED", "victim", "_INBOX.a b", "_INBOX.*", ""] {
            assert!(!n.reply_allowed(bad), "{bad}");
        }
        let n = on("reply_prefixes = [\"_INBOX.\", \"_R_.svc.\"]").unwrap().nats.unwrap();
        assert!(n.reply_allowed("_R_.svc.x"));
        for bad in ["[]", "[\"_INBOX\"]", "[\"ai.\"]", "[\"ai.v1.x.\"]", "[\"a*.\"]"] {
            let e = on(&format!("reply_prefixes = {bad}")).unwrap_err();
            assert!(e.0.iter().any(|e| e.path == "nats.reply_prefixes"), "{bad}: {e}");
        }
    }

    #[test]
    fn urls_are_redacted_for_logs() {
        let mut n = load("", &[("EDGEWAY__NATS__URL", "nats://127.0.0.1:4222")]).unwrap().nats.unwrap();
        n.url = "nats://a:b@h1:4222,tls://h2:4222".into();
        assert_eq!(n.redacted_url(), "nats://h1:4222,tls://h2:4222");
    }
}
