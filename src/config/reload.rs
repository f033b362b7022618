//! Hot reload, the pure part: what changed between the configuration in
//! force and a newly loaded one, whether a running edgeway can take the
//! change, and the version (hash) of a file's effective content.
//!
//! Owns: the rule of what a reload may change ([`plan`]) and the summary of
//! a change ([`Changes`]) that is logged and answered. Does not own: reading
//! the file (that is [`Config::load`], the same as at start), nor applying
//! the new configuration to the running components (the gateway's
//! `reload`, the one place that swaps them).
//!
//! # What a reload changes
//! Applied at once, to new work: applications (their API keys, priorities,
//! limits, tools), `[auth.jwt]`, devices (checked at each MQTT CONNECT),
//! tenants (weights, data classes), `[timeouts]` defaults, the scheduler's
//! global limits (`max_queued`, `max_running`, `priority_aging_seconds`,
//! `busy_retry_after_ms`), each model's `queue_capacity`, `max_running`,
//! `instances` and `fallback_models` (routes and chains), and engines
//! removed: they get no new work, their running work finishes (or meets its
//! deadline), then edgeway stops their process. Work already admitted keeps
//! what it was admitted with.
//!
//! Refused, naming the keys, with nothing changed (they need a restart):
//! `node_id`, `[http]`, `[store]`, `[server]`, `[log]`, `[resources]`,
//! `[routing]`, `[nats]`, `[mqtt]`, the other `[scheduler]` keys, engines
//! added or changed (a changed engine is a removed one plus an added one,
//! and the router's instances are fixed at start), and models added,
//! removed or changed beyond their limits and routes.
//! A change of a `[nats]` secret alone is not seen (secrets are compared
//! through their redacted form).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Debug;

use sha2::{Digest, Sha256};

use super::{Config, ConfigError, ConfigErrors};

/// What a reload added, removed and changed of one kind of entry.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Counts {
    pub added: usize,
    pub removed: usize,
    pub changed: usize,
}

impl Counts {
    fn of<T: Debug>(old: &BTreeMap<String, T>, new: &BTreeMap<String, T>) -> Counts {
        let mut c = Counts::default();
        for (name, n) in new {
            match old.get(name) {
                None => c.added += 1,
                Some(o) if !same(o, n) => c.changed += 1,
                Some(_) => {}
            }
        }
        c.removed = old.keys().filter(|k| !new.contains_key(*k)).count();
        c
    }

    fn is_zero(&self) -> bool {
        *self == Counts::default()
    }
}

/// The summary of an accepted reload, as logged and answered.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Changes {
    pub applications: Counts,
    /// API keys by digest, over all applications (a key moved from one
    /// application to another counts as changed).
    pub api_keys: Counts,
    pub devices: Counts,
    /// Models whose limits or routes changed (nothing else of a model
    /// may).
    pub models: Counts,
    /// Engines removed (they drain, then stop); none is added or changed
    /// at reload (see the module doc).
    pub engines: Counts,
    /// The other sections that changed: `timeouts`, `tenants`,
    /// `scheduler`, `auth.jwt`.
    pub sections: Vec<String>,
}

impl Changes {
    /// Nothing in force changes.
    pub fn is_empty(&self) -> bool {
        self.applications.is_zero()
            && self.api_keys.is_zero()
            && self.devices.is_zero()
            && self.models.is_zero()
            && self.engines.is_zero()
            && self.sections.is_empty()
    }
}

/// Two values are the same configuration. Through `Debug`, so that every
/// field counts, also those added later (a model's or engine's new keys are
/// carried along without naming them here); maps compared this way must be
/// ordered (`BTreeMap`), never `HashMap`.
fn same<T: Debug>(a: &T, b: &T) -> bool {
    format!("{a:?}") == format!("{b:?}")
}

fn sorted<V: Debug>(m: &std::collections::HashMap<String, V>) -> BTreeMap<&String, String> {
    m.iter().map(|(k, v)| (k, format!("{v:?}"))).collect()
}

/// Judges a reload from `old` (in force) to `new` (validated whole): the
/// summary of what it changes, or every key path that needs a restart.
pub fn plan(old: &Config, new: &Config) -> Result<Changes, ConfigErrors> {
    let mut refused = Vec::new();
    let mut restart = |path: &str, what: &str| {
        refused.push(ConfigError { path: path.to_string(), message: format!("{what}; this needs a restart") })
    };
    let sections: [(&str, bool); 9] = [
        ("node_id", same(&old.node_id, &new.node_id)),
        ("http", same(&old.http, &new.http)),
        ("store", same(&old.store, &new.store)),
        ("server", same(&old.server, &new.server)),
        ("log", same(&old.log, &new.log)),
        (
            "resources",
            same(&old.resources, &new.resources)
                && old.cancel_grace == new.cancel_grace
                && old.kv_cache_high_water == new.kv_cache_high_water,
        ),
        ("routing", same(&old.routing, &new.routing)),
        ("nats", same(&old.nats, &new.nats)),
        ("mqtt", same(&old.mqtt, &new.mqtt)),
    ];
    for (path, unchanged) in sections {
        if !unchanged {
            restart(path, "changed");
        }
    }
    // The scheduler keys that a reload applies, set equal so that only the
    // others are compared.
    let mut s = new.scheduler.clone();
    s.max_queued = old.scheduler.max_queued;
    s.max_running = old.scheduler.max_running;
    s.priority_aging = old.scheduler.priority_aging;
    s.busy_retry_after_ms = old.scheduler.busy_retry_after_ms;
    s.queue_capacity = old.scheduler.queue_capacity;
    if !same(&old.scheduler, &s) {
        restart(
            "scheduler",
            "keys other than max_queued, max_running, priority_aging_seconds and busy_retry_after_ms changed",
        );
    }
    let mut engines = Counts::default();
    for name in old.engines.keys().chain(new.engines.keys()).collect::<BTreeSet<_>>() {
        match (old.engines.get(name), new.engines.get(name)) {
            // It drains, then its process stops (the gateway's reload).
            (Some(_), None) => engines.removed += 1,
            (None, Some(_)) => restart(&format!("engines.{name}"), "added (an engine cannot start at reload)"),
            (Some(o), Some(n)) if !same(o, n) => restart(
                &format!("engines.{name}"),
                "changed (a changed engine is a removed one and an added one, and an engine cannot start at reload)",
            ),
            _ => {}
        }
    }
    let mut models = Counts::default();
    for name in old.models.keys().chain(new.models.keys()).collect::<BTreeSet<_>>() {
        match (old.models.get(name), new.models.get(name)) {
            (Some(_), None) => restart(&format!("models.{name}"), "removed"),
            (None, Some(_)) => restart(&format!("models.{name}"), "added"),
            (Some(o), Some(n)) if !same(o, n) => {
                let mut routes_only = n.clone();
                routes_only.queue_capacity = o.queue_capacity;
                routes_only.max_running = o.max_running;
                routes_only.instances = o.instances.clone();
                routes_only.fallback_models = o.fallback_models.clone();
                if same(o, &routes_only) {
                    models.changed += 1;
                } else {
                    restart(
                        &format!("models.{name}"),
                        "keys other than queue_capacity, max_running, instances and fallback_models changed",
                    );
                }
            }
            _ => {}
        }
    }
    if !refused.is_empty() {
        return Err(ConfigErrors(refused));
    }
    let keys = |c: &Config| -> BTreeMap<String, String> {
        c.applications
            .values()
            .flat_map(|a| a.api_key_sha256.iter().map(move |k| (hex::encode(k), a.name.clone())))
            .collect()
    };
    let mut changed_sections = Vec::new();
    if old.timeouts != new.timeouts {
        changed_sections.push("timeouts".to_string());
    }
    if sorted(&old.tenant_weights) != sorted(&new.tenant_weights)
        || sorted(&old.tenant_data_class) != sorted(&new.tenant_data_class)
    {
        changed_sections.push("tenants".to_string());
    }
    if !same(&old.scheduler, &new.scheduler) {
        changed_sections.push("scheduler".to_string());
    }
    if !same(&old.auth, &new.auth) {
        changed_sections.push("auth.jwt".to_string());
    }
    if !same(&old.sessions, &new.sessions) {
        changed_sections.push("sessions".to_string());
    }
    Ok(Changes {
        applications: Counts::of(&old.applications, &new.applications),
        api_keys: Counts::of(&keys(old), &keys(new)),
        devices: Counts::of(&old.devices, &new.devices),
        models,
        engines,
        sections: changed_sections,
    })
}

/// The version of a configuration: a hash of its effective content (the
/// file's values after the `EDGEWAY__…` overrides, in a canonical form, so
/// that comments, spacing and key order do not count). 16 hex digits.
pub(super) fn version_of(effective: &toml::Value) -> String {
    // `toml::Value` tables are ordered by key: the text is canonical.
    let text = toml::to_string(effective).unwrap_or_else(|_| format!("{effective:?}"));
    hex::encode(&Sha256::digest(text.as_bytes())[..8])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(extra: &str) -> Config {
        let text = format!(
            r#"
[http]
listen = "127.0.0.1:0"
[applications.demo]
tenant = "demo"
api_key_sha256 = ["{}"]
[engines.a]
type = "openai"
base_url = "http://127.0.0.1:9"
model = "m"
[models.chat]
instances = ["a"]
{extra}
"#,
            hex::encode(crate::config::hash_api_key("k1"))
        );
        Config::from_toml_str(&text, std::iter::empty(), std::path::Path::new(".")).unwrap()
    }

    #[test]
    fn limits_and_keys_reload_and_are_counted() {
        let old = load("");
        let new = load(&format!(
            "queue_capacity = 3\nmax_running = 1\n[applications.more]\ntenant = \"demo\"\napi_key_sha256 = [\"{}\"]\n",
            hex::encode(crate::config::hash_api_key("k2"))
        ));
        let c = plan(&old, &new).unwrap();
        assert_eq!(c.applications, Counts { added: 1, removed: 0, changed: 0 });
        assert_eq!(c.api_keys, Counts { added: 1, removed: 0, changed: 0 });
        assert_eq!(c.models, Counts { added: 0, removed: 0, changed: 1 });
        assert!(plan(&old, &load("")).unwrap().is_empty());
        assert_eq!(old.version, load("").version, "the same content, the same version");
        assert_ne!(old.version, new.version);
    }

    #[test]
    fn restart_only_changes_are_refused_by_key_path() {
        let old = load("");
        let new = load("context_tokens = 8192\n[engines.b]\ntype = \"openai\"\nbase_url = \"http://127.0.0.1:9\"\nmodel = \"m\"\n[server]\ndrain_timeout_s = 1\n");
        let paths: Vec<String> = plan(&old, &new).unwrap_err().0.into_iter().map(|e| e.path).collect();
        assert_eq!(paths, ["server", "engines.b", "models.chat"]);
    }
}
