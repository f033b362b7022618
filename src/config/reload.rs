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
//! tenants (weights, data classes, budgets), `[timeouts]` defaults, `[sessions]`,
//! `[cache]` (the next call's lookup and store use it),
//! the scheduler's global limits (`max_queued`, `max_running`,
//! `priority_aging_seconds`, `busy_retry_after_ms`), models (added,
//! removed, any key changed: routes, fallback chains, residency classes),
//! and engines:
//! - added: a new instance joins routing once its first probe passes (a
//!   supervised one once its process is ready; work meanwhile queues);
//! - changed: the old instance drains (its running work finishes, it gets
//!   no new work) and a new one with the new settings takes new work; a
//!   supervised one whose `process`, `base_url` or `health_path` changed is
//!   restarted with the new command once the old instance drained;
//! - removed: drained, then its process (if edgeway runs it) is stopped.
//!
//! A model removed: new requests for it get the stable unknown-model
//! error (`INVALID_REQUEST`); its queued and running work finishes. Work
//! already admitted keeps what it was admitted with.
//!
//! Refused, naming the keys, with nothing changed (they need a restart):
//! `node_id`, `[http]` (listener addresses), `[store]` (path), `[server]`,
//! `[log]`, `[resources]`, `[routing]`, `[nats]`, `[cluster]`, `[mqtt]` (broker ports)
//! and the other `[scheduler]` keys. The gateway also refuses a reload that
//! would add more instances than a running edgeway has room for
//! ([`crate::engine::RELOAD_ROOM`] since start: each engine added or
//! changed takes one).
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
    /// Models added, removed and changed (any key).
    pub models: Counts,
    /// Engines added, removed (they drain, then stop) and changed (the
    /// old instance drains, a new one takes new work).
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
    let sections: [(&str, bool); 10] = [
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
        ("cluster", same(&old.cluster, &new.cluster)),
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
        || !same(&old.tenant_budgets, &new.tenant_budgets)
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
    if old.cache != new.cache {
        changed_sections.push("cache".to_string());
    }
    Ok(Changes {
        applications: Counts::of(&old.applications, &new.applications),
        api_keys: Counts::of(&keys(old), &keys(new)),
        devices: Counts::of(&old.devices, &new.devices),
        models: Counts::of(&old.models, &new.models),
        engines: Counts::of(&old.engines, &new.engines),
        sections: changed_sections,
    })
}

/// What a reload does to the engine instances, by engine name.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EnginePlan {
    /// Engines the new file adds: a new instance each.
    pub added: Vec<String>,
    /// Engines whose instance is replaced: the engine's settings changed,
    /// or the residency of the model(s) naming it (class, idle time,
    /// weights), which an instance takes when it is made. The old
    /// instance drains; the new one takes new work.
    pub replaced: Vec<String>,
    /// Engines the new file no longer has: they drain, then stop.
    pub removed: Vec<String>,
    /// Supervised engines whose process changes (its `process` section,
    /// `base_url` or `health_path`): the old process stops once its
    /// instance drained, then the new one starts.
    pub restarted: Vec<String>,
}

/// The engine part of a reload from `old` to `new` (see [`EnginePlan`]).
pub fn engine_plan(old: &Config, new: &Config) -> EnginePlan {
    let mut p = EnginePlan::default();
    // What an instance's residency slot is made from (engine::residency).
    let residency_of = |c: &Config, name: &str| -> String {
        let models: Vec<_> = c.models.values().filter(|m| m.instances.iter().any(|n| n == name)).collect();
        format!("{:?} {:?}", models.first().map(|m| &m.residency), models.iter().map(|m| m.weights_bytes).max())
    };
    for name in old.engines.keys().chain(new.engines.keys()).collect::<BTreeSet<_>>() {
        match (old.engines.get(name), new.engines.get(name)) {
            (Some(_), None) => p.removed.push(name.clone()),
            (None, Some(_)) => p.added.push(name.clone()),
            (Some(o), Some(n)) => {
                if !same(o, n) || residency_of(old, name) != residency_of(new, name) {
                    p.replaced.push(name.clone());
                }
                let runs = o.process.is_some() || n.process.is_some();
                if runs && (!same(&o.process, &n.process) || o.base_url != n.base_url || o.health_path != n.health_path)
                {
                    p.restarted.push(name.clone());
                }
            }
            (None, None) => {}
        }
    }
    p
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
        assert_eq!(paths, ["server"], "engines and models change live");
        let js = "[nats]\nurl = \"nats://127.0.0.1:4222\"\n[nats.jetstream]\n[cluster]\nzone = ";
        let (old, new) = (load(&format!("{js}\"a\"\n")), load(&format!("{js}\"b\"\n")));
        let paths: Vec<String> = plan(&old, &new).unwrap_err().0.into_iter().map(|e| e.path).collect();
        assert_eq!(paths, ["cluster"], "the registry reads [cluster] once, at start");
    }

    #[test]
    fn engines_and_models_added_changed_and_removed_are_planned() {
        let old = load("[models.gone]\ninstances = [\"a\"]\n");
        let b = "[engines.b]\ntype = \"openai\"\nbase_url = \"http://127.0.0.1:9\"\nmodel = \"m\"\n[models.new]\ninstances = [\"b\"]\n";
        let new = load(&format!("context_tokens = 8192\n{b}"));
        let c = plan(&old, &new).unwrap();
        assert_eq!(c.engines, Counts { added: 1, removed: 0, changed: 0 });
        assert_eq!(c.models, Counts { added: 1, removed: 1, changed: 1 });
        let p = engine_plan(&old, &new);
        assert_eq!((p.added, p.replaced, p.removed), (vec!["b".to_string()], vec![], vec![]));
        // A residency class changed replaces the instances of its model.
        let p = engine_plan(&load(""), &load("residency = \"forbidden\"\n"));
        assert_eq!(p.replaced, ["a"]);
        assert!(p.restarted.is_empty(), "a has no process");
    }
}
