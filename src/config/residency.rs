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
