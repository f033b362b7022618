//! Model residency (FR-4.7): the `[models.NAME]` keys `residency`,
//! `idle_unload_s` and `restricted_to`, and the `[engines.NAME]` key
//! `model_api` that says whether edgeway can load and unload models
//! through the engine's own API.
//!
//! Owns: these keys, their defaults and rules. Does not own: loading,
//! unloading or the routing that follows from a class
//! (`engine::residency`, the scheduler's policy).
//!
//! The configuration is per node already (one file per edgeway), so a
//! class is "per model and node": another node's file may give the same
//! model another class.

use std::time::Duration;

use serde::Deserialize;

use super::Problems;
use crate::task::Priority;

/// When a model may be in an engine's memory on this node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ResidencyClass {
    /// Loaded at start and kept loaded; edgeway is not ready until it is.
    /// The default: it is what every engine did before residency existed
    /// (llama-server and vLLM load their model at start and keep it).
    #[default]
    Always,
    /// Loaded on first use, unloaded after `idle_unload_s` without work or
    /// earlier when the memory is needed (least recently used first).
    OnDemand,
    /// Like `on_demand`, but only for the work `restricted_to` names;
    /// other work takes the next routing step or is refused.
    Restricted,
    /// Never loaded on this node: work takes the next routing step or is
    /// refused (`POLICY_BLOCKED`).
    Forbidden,
}

impl ResidencyClass {
    pub fn as_str(self) -> &'static str {
        match self {
            ResidencyClass::Always => "always",
            ResidencyClass::OnDemand => "on_demand",
            ResidencyClass::Restricted => "restricted",
            ResidencyClass::Forbidden => "forbidden",
        }
    }

    fn parse(s: &str) -> Option<ResidencyClass> {
        Some(match s {
            "always" => ResidencyClass::Always,
            "on_demand" => ResidencyClass::OnDemand,
            "restricted" => ResidencyClass::Restricted,
            "forbidden" => ResidencyClass::Forbidden,
            _ => return None,
        })
    }
}

/// Which work a `restricted` model is for. Every condition given must hold
/// (an application named *and* a priority at least as urgent).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Restriction {
    /// Applications allowed (empty: any).
    pub applications: Vec<String>,
    /// The least urgent priority allowed (`None`: any).
    pub max_priority: Option<Priority>,
}

impl Restriction {
    pub fn allows(&self, app: &str, priority: Priority) -> bool {
        (self.applications.is_empty() || self.applications.iter().any(|a| a == app))
            && self.max_priority.is_none_or(|m| priority <= m)
    }

    /// For refusals and logs: "applications [ops], priorities up to P1".
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if !self.applications.is_empty() {
            parts.push(format!("applications [{}]", self.applications.join(", ")));
        }
        if let Some(p) = self.max_priority {
            parts.push(format!("priorities up to {}", p.as_str()));
        }
        parts.join(", ")
    }
}

/// A model's residency on this node.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Residency {
    pub class: ResidencyClass,
    /// `on_demand` / `restricted`: unload after this long without work
    /// (`None`: only when the memory is needed).
    pub idle_unload: Option<Duration>,
    /// `restricted` only.
    pub restricted_to: Option<Restriction>,
}

impl Residency {
    /// Whether work of `app` at `priority` may use the model here.
    pub fn allows(&self, app: &str, priority: Priority) -> bool {
        match self.class {
            ResidencyClass::Forbidden => false,
            ResidencyClass::Restricted => self.restricted_to.as_ref().is_none_or(|r| r.allows(app, priority)),
            _ => true,
        }
    }
}

/// How edgeway loads and unloads models on an engine (`[engines.NAME]
/// model_api`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ModelApi {
    /// The engine keeps its model loaded by itself (plain llama-server,
    /// vLLM, cloud APIs; vLLM's sleep / wake-up is not used): edgeway never
    /// loads or unloads, and the model counts as loaded while the engine is
    /// healthy. The default, and what edgeway did before residency.
    #[default]
    None,
    /// llama-server in router mode (`--models-dir`): `GET /models`,
    /// `POST /models/load`, `POST /models/unload`.
    LlamaRouter,
    /// Ollama: `/api/ps`, a load by a generate without a prompt, an unload
    /// by `keep_alive: 0`.
    Ollama,
}

impl ModelApi {
    pub fn as_str(self) -> &'static str {
        match self {
            ModelApi::None => "none",
            ModelApi::LlamaRouter => "llama-router",
            ModelApi::Ollama => "ollama",
        }
    }
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct RawRestriction {
    #[serde(default)]
    pub applications: Vec<String>,
    pub max_priority: Option<String>,
}

/// Reads `[engines.NAME] model_api`.
pub(super) fn model_api(path: &str, raw: Option<&str>, openai: Option<bool>, p: &mut Problems) -> Option<ModelApi> {
    let api = match raw {
        None | Some("none") => ModelApi::None,
        Some("llama-router") => ModelApi::LlamaRouter,
        Some("ollama") => ModelApi::Ollama,
        Some(other) => {
            p.add(path, format!("{other:?} is not one of \"none\", \"llama-router\", \"ollama\""));
            return None;
        }
    };
    match (api, openai) {
        (ModelApi::LlamaRouter, Some(false)) => p.add(path, "\"llama-router\" needs type = \"openai\""),
        (ModelApi::Ollama, Some(true)) => p.add(path, "\"ollama\" needs type = \"ollama\""),
        _ => {}
    }
    Some(api)
}

/// Reads a model's residency keys (`path` is `models.NAME`).
pub(super) fn residency(
    path: &str,
    class: Option<&str>,
    idle_unload_s: Option<u64>,
    restricted_to: Option<RawRestriction>,
    p: &mut Problems,
) -> Option<Residency> {
    let class = match class.map(|c| (c, ResidencyClass::parse(c))) {
        None => ResidencyClass::default(),
        Some((_, Some(c))) => c,
        Some((c, None)) => {
            p.add(
                format!("{path}.residency"),
                format!("{c:?} is not one of \"always\", \"on_demand\", \"restricted\", \"forbidden\""),
            );
            return None;
        }
    };
    let unloads = matches!(class, ResidencyClass::OnDemand | ResidencyClass::Restricted);
    if idle_unload_s.is_some() && !unloads {
        p.add(format!("{path}.idle_unload_s"), "only for residency = \"on_demand\" or \"restricted\"");
    }
    if idle_unload_s == Some(0) {
        p.add(format!("{path}.idle_unload_s"), "must be at least 1 (leave it out to unload only for memory)");
    }
    let restricted_to = match (class, restricted_to) {
        (ResidencyClass::Restricted, None) => {
            p.add(format!("{path}.restricted_to"), "residency = \"restricted\" needs it");
            None
        }
        (ResidencyClass::Restricted, Some(r)) => {
            let max_priority = match r.max_priority.as_deref().map(|s| (s, Priority::parse(s))) {
                None => None,
                Some((_, Some(pr))) => Some(pr),
                Some((s, None)) => {
                    p.add(format!("{path}.restricted_to.max_priority"), format!("{s:?} is not P0..P4"));
                    None
                }
            };
            if r.applications.is_empty() && max_priority.is_none() {
                p.add(format!("{path}.restricted_to"), "name applications, a max_priority, or both");
            }
            Some(Restriction { applications: r.applications, max_priority })
        }
        (_, Some(_)) => {
            p.add(format!("{path}.restricted_to"), "only for residency = \"restricted\"");
            None
        }
        (_, None) => None,
    };
    Some(Residency { class, idle_unload: idle_unload_s.map(Duration::from_secs), restricted_to })
}

/// Rules across engines and models: a class that loads or unloads needs an
/// engine that can, and the models naming one engine instance (one engine
/// model) agree on its class.
pub(super) fn cross_check(
    engines: &super::validate::Entries<super::EngineConfig>,
    models: &super::validate::Entries<super::ModelConfig>,
    p: &mut Problems,
) {
    let mut class_of: std::collections::BTreeMap<&str, (&str, ResidencyClass)> = Default::default();
    for (name, m) in models.iter().filter_map(|(n, m)| m.as_ref().map(|m| (n, m))) {
        for inst in &m.instances {
            let api = engines.get(inst).and_then(Option::as_ref).map(|e| e.model_api);
            if m.residency.class == ResidencyClass::OnDemand && api == Some(ModelApi::None) {
                p.add(
                    format!("models.{name}.residency"),
                    format!("\"on_demand\" needs engines that can load and unload: set engines.{inst}.model_api"),
                );
            }
            match class_of.get(inst.as_str()) {
                Some((other, c)) if *c != m.residency.class => p.add(
                    format!("models.{name}.residency"),
                    format!("engine {inst:?} is also named by model {other:?} with residency {:?}", c.as_str()),
                ),
                Some(_) => {}
                None => {
                    class_of.insert(inst, (name, m.residency.class));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn load(engine_keys: &str, model_keys: &str) -> Result<Config, Vec<(String, String)>> {
        let dir = std::path::Path::new("/tmp/edgeway-residency-test");
        let text = crate::testing::config_toml("http://127.0.0.1:9", "openai", dir, model_keys).replacen(
            "health_interval_ms = 100",
            &format!("health_interval_ms = 100\n{engine_keys}"),
            1,
        );
        Config::from_toml_str(&text, std::iter::empty(), std::path::Path::new("."))
            .map_err(|e| e.0.into_iter().map(|e| (e.path, e.message)).collect())
    }

    fn error_at(r: Result<Config, Vec<(String, String)>>, path: &str) -> String {
        let errors = r.expect_err("refused");
        errors.iter().find(|(p, _)| p == path).map(|(_, m)| m.clone()).unwrap_or_else(|| panic!("{errors:?}"))
    }

    #[test]
    fn the_default_is_always_with_no_model_api() {
        let c = load("", "").unwrap();
        assert_eq!(c.models["general-chat"].residency, Residency::default());
        assert_eq!(c.models["general-chat"].residency.class, ResidencyClass::Always);
        assert_eq!(c.engines["fake"].model_api, ModelApi::None);
    }

    #[test]
    fn every_class_and_its_keys_are_read() {
        let c = load(
            "model_api = \"llama-router\"",
            "residency = \"restricted\"\nidle_unload_s = 30\nrestricted_to = { applications = [\"ops\"], max_priority = \"P1\" }",
        )
        .unwrap();
        let r = &c.models["general-chat"].residency;
        assert_eq!(r.class, ResidencyClass::Restricted);
        assert_eq!(r.idle_unload, Some(Duration::from_secs(30)));
        assert!(r.allows("ops", Priority::P0));
        assert!(!r.allows("ops", Priority::P2), "every condition must hold");
        assert!(!r.allows("demo", Priority::P0));
        assert_eq!(c.engines["fake"].model_api, ModelApi::LlamaRouter);
        let c = load("", "residency = \"forbidden\"").unwrap();
        assert!(!c.models["general-chat"].residency.allows("ops", Priority::P0));
    }

    #[test]
    fn bad_residency_keys_are_refused_by_path() {
        assert!(error_at(load("", "residency = \"sometimes\""), "models.general-chat.residency").contains("on_demand"));
        // on_demand needs an engine that can unload.
        assert!(error_at(load("", "residency = \"on_demand\""), "models.general-chat.residency").contains("model_api"));
        assert!(error_at(load("", "idle_unload_s = 5"), "models.general-chat.idle_unload_s").contains("on_demand"));
        let zero = load("model_api = \"llama-router\"", "residency = \"on_demand\"\nidle_unload_s = 0");
        assert!(error_at(zero, "models.general-chat.idle_unload_s").contains("at least 1"));
        assert!(error_at(load("", "residency = \"restricted\""), "models.general-chat.restricted_to").contains("needs"));
        let empty = load("", "residency = \"restricted\"\nrestricted_to = {}");
        assert!(error_at(empty, "models.general-chat.restricted_to").contains("name applications"));
        let bad_p = load("", "residency = \"restricted\"\nrestricted_to = { max_priority = \"P9\" }");
        assert!(error_at(bad_p, "models.general-chat.restricted_to.max_priority").contains("P0..P4"));
        let stray = load("", "restricted_to = { max_priority = \"P1\" }");
        assert!(error_at(stray, "models.general-chat.restricted_to").contains("only for"));
        assert!(error_at(load("model_api = \"ollama\"", ""), "engines.fake.model_api").contains("type = \"ollama\""));
        assert!(error_at(load("model_api = \"vllm\"", ""), "engines.fake.model_api").contains("not one of"));
    }

    #[test]
    fn models_sharing_an_engine_share_its_class() {
        let r = load(
            "model_api = \"llama-router\"",
            "residency = \"on_demand\"\n[models.other]\ninstances = [\"fake\"]\nresidency = \"forbidden\"",
        );
        assert!(error_at(r, "models.other.residency").contains("also named by model"));
    }
}
