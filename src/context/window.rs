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
//! **A call without a session** whose own messages do not fit its model
//! (admission lets it through when this can help: the model names a
//! larger-window model, or its `context_policy` is `auto` and it has
//! earlier turns) is assembled too: it goes to the larger-window model
//! when the policy above allows, else, under `auto`, its earlier turns
//! ([`earlier_turns`]: those before its last user message) become history
//! that the ladder trims as a session's, oldest first. Its question is
//! never cut. A call that fits pays nothing of this: admission's estimate
//! decides, and the gateway skips the assembly as before.
//!
//! **`context_policy`** ([`policy`]): the request's, else the
//! application's (`[applications.X] context_policy`), else `auto`.
//! `disabled` leaves no message of the conversation out (nor replaced by
//! the session summary): the larger-window model, else
//! `CONTEXT_TOO_LARGE`.
//!
//! Owns: whether a call may switch, its policy, and which of a plain
//! call's messages may go. Does not own: the assembly
//! (`super::assembly`) or the switch itself (the gateway re-assembles and
//! sets the task's model before it is queued, so the scheduler and router
//! route it as any call for that model).

use std::ops::Range;

use crate::config::{Config, ContextPolicy, EngineKind, ModelConfig, ModelKind};
use crate::error::GatewayError;
use crate::task::{ChatMessage, Location, TaskRequest};

/// The `context_policy` of a call of `application`: `requested` (the
/// request's field) when it says, else the application's.
pub fn policy(cfg: &Config, application: &str, requested: Option<&str>) -> Result<ContextPolicy, GatewayError> {
    match requested {
        Some(r) => ContextPolicy::parse(r).ok_or_else(|| {
            GatewayError::invalid(format!("'context_policy' must be \"auto\" or \"disabled\", not {r:?}"))
        }),
        None => Ok(cfg.applications.get(application).map_or(ContextPolicy::Auto, |a| a.context_policy)),
    }
}

/// The messages of a call without a session that the ladder may trim as
/// history when its prompt does not fit: those after its leading system
/// (and developer) messages and before its last user message, which
/// stays with what follows it (tool results of its answer).
pub fn earlier_turns(messages: &[ChatMessage]) -> Range<usize> {
    let lead = messages.iter().take_while(|m| matches!(m.role.as_str(), "system" | "developer")).count();
    let last_user = messages.iter().rposition(|m| m.role == "user").unwrap_or(0);
    lead..last_user.max(lead)
}

/// The model `req` may switch to when its prompt does not fit its
/// model's window, if any.
pub fn larger_model<'a>(cfg: &'a Config, req: &TaskRequest) -> Option<&'a ModelConfig> {
    let from = cfg.models.get(&req.logical_model)?;
    let alt = cfg.models.get(from.larger_window_model.as_deref()?)?;
    if alt.kind != ModelKind::Chat || alt.context_tokens <= from.context_tokens {
        return None;
    }
    // As for a smaller fallback model: only one the application may name.
    if cfg.applications.get(&req.identity.application).is_some_and(|a| !a.may_use_model(&alt.name)) {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn msgs(roles: &[&str]) -> Vec<ChatMessage> {
        roles
            .iter()
            .map(|r| ChatMessage { role: r.to_string(), content: "x".into(), extra: Default::default() })
            .collect()
    }

    #[test]
    fn earlier_turns_are_between_the_instructions_and_the_last_question() {
        assert_eq!(earlier_turns(&msgs(&["system", "user", "assistant", "user"])), 1..3);
        assert_eq!(earlier_turns(&msgs(&["user", "assistant", "user", "assistant", "tool"])), 0..2);
        assert!(earlier_turns(&msgs(&["system", "developer", "user"])).is_empty());
        assert!(earlier_turns(&msgs(&["user", "assistant", "tool"])).is_empty());
        assert!(earlier_turns(&msgs(&["system"])).is_empty());
    }
}
