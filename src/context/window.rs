//! The larger-window switch, the ladder's last step before
//! `CONTEXT_TOO_LARGE` (FR-3.3): a logical model may name a chat model
//! with a larger window (`[models.X] larger_window_model`); a call whose
//! prompt does not fit its model after trimming is assembled again for
//! that model and queued for it, when the routing policy lets the call go
//! there.
//!
//! **The policy.** The alternative must have an instance the call's data
//! may reach: its `max_data_class` at least the call's class (which counts
//! `local_only` as secret), not in the cloud unless `[routing] allow_cloud`
//! (and never for `local_only`), and, for a call with tools, every such
//! instance taking tools from an OpenAI-style engine (as admission asks of
//! fallbacks). Otherwise the call is refused as before.
//!
//! Owns: whether a call may switch. Does not own: the assembly
//! (`super::assembly`) or the switch itself (the gateway re-assembles and
//! sets the task's model before it is queued, so the scheduler and router
//! route it as any call for that model).

use crate::config::{Config, EngineKind, ModelConfig, ModelKind};
use crate::task::{Location, TaskRequest};

/// The model `req` may switch to when its prompt does not fit its
/// model's window, if any.
pub fn larger_model<'a>(cfg: &'a Config, req: &TaskRequest) -> Option<&'a ModelConfig> {
    let from = cfg.models.get(&req.logical_model)?;
    let alt = cfg.models.get(from.larger_window_model.as_deref()?)?;
    if alt.kind != ModelKind::Chat || alt.context_tokens <= from.context_tokens {
        return None;
    }
    let reachable: Vec<_> = alt
        .instances
        .iter()
        .filter_map(|n| cfg.engines.get(n))
        .filter(|e| req.data_class <= e.max_data_class)
        .filter(|e| match e.location {
            Location::Cloud => cfg.routing.allow_cloud && !req.routing.local_only,
            Location::EdgeNode => !req.routing.local_only,
            Location::Local => true,
        })
        .collect();
    if reachable.is_empty() {
        return None;
    }
    if req.tools.is_some() && !reachable.iter().all(|e| e.tools && e.kind == EngineKind::OpenAi) {
        return None;
    }
    Some(alt)
}
