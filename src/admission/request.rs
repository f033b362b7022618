//! The request body every ingress accepts and its validation.

use std::time::{Duration, Instant, SystemTime};

use serde::Deserialize;
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

use crate::config::{ApplicationConfig, Config, ContextPolicy, EngineKind, ModelConfig};
use crate::context::{self, Fit};
use crate::error::{ErrorCode, GatewayError};
use crate::task::{
    ChatMessage, DataClass, Identity, Ingress, Operation, Priority, Routing, SamplingParams, TaskRequest, Timeouts,
    ToolSet,
};

/// OpenAI chat fields plus the edge fields of DESIGN.md. Unknown OpenAI
/// fields are accepted and ignored, except those edgeway cannot honour,
/// which are refused (see [`admit`]).
#[derive(Debug, Deserialize)]
pub struct ChatRequestBody {
    pub model: String,
    pub messages: Vec<ChatMessage>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub max_tokens: Option<u32>,
    pub max_completion_tokens: Option<u32>,
    pub max_output_tokens: Option<u32>,
    #[serde(flatten)]
    pub params: SamplingParams,
    pub n: Option<u32>,
    pub request_id: Option<String>,
    pub idempotency_key: Option<String>,
    pub session_id: Option<String>,
    pub priority: Option<String>,
    pub context_policy: Option<String>,
    pub timeouts: Option<RequestTimeouts>,
    pub routing: Option<Routing>,
    pub metadata: Option<Map<String, Value>>,
    /// OpenAI's `user` field: the end user, when metadata has none.
    pub user: Option<String>,
    /// Tool calling (checked by [`ToolSet::parse`]).
    pub tools: Option<Value>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<Value>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
    /// What the engine is asked: set by the endpoint that read the body
    /// (see [`super::operation`]), never by the body itself.
    #[serde(skip)]
    pub operation: Operation,
}

#[derive(Debug, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RequestTimeouts {
    pub queue_ms: Option<u64>,
    pub first_token_ms: Option<u64>,
    pub inference_ms: Option<u64>,
    pub idle_ms: Option<u64>,
    pub total_ms: Option<u64>,
}

/// Parses a request body, reporting the field that is wrong.
pub fn parse_body(bytes: &[u8]) -> Result<ChatRequestBody, GatewayError> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if inner.is_syntax() || inner.is_eof() {
            GatewayError::invalid(format!("body is not valid JSON: {inner}"))
        } else if path == "." {
            GatewayError::invalid(format!("invalid request: {inner}"))
        } else {
            GatewayError::invalid(format!("invalid field '{path}': {inner}"))
        }
    })
}

const MAX_ID_LEN: usize = 128;

/// Idempotency keys with this prefix are the MQTT ingress's (one per device
/// and request); other callers' keys may not start with it.
pub use crate::task::DEVICE_KEY_PREFIX;

fn check_id(name: &str, v: &str) -> Result<(), GatewayError> {
    if v.is_empty() || v.len() > MAX_ID_LEN || !v.chars().all(|c| c.is_ascii_alphanumeric() || "-_.:".contains(c)) {
        return Err(GatewayError::invalid(format!(
            "'{name}' must be 1..{MAX_ID_LEN} characters of A-Z a-z 0-9 - _ . :"
        )));
    }
    Ok(())
}

/// The class a call is routed under: the strictest of what the request,
/// its application, its tenant and its credential (a device) declare, with
/// `local_only` counting as secret; the configured default when none
/// declares one.
pub fn data_class(
    cfg: &Config,
    tenant: &str,
    app: Option<&ApplicationConfig>,
    credential: Option<DataClass>,
    routing: &Routing,
) -> DataClass {
    [
        routing.data_class,
        routing.local_only.then_some(DataClass::Secret),
        app.and_then(|a| a.data_class),
        cfg.tenant_data_class.get(tenant).copied(),
        credential,
    ]
    .into_iter()
    .flatten()
    .max()
    .unwrap_or(cfg.routing.default_data_class)
}

const MAX_USER_ID_LEN: usize = 128;

pub fn check_user_id(field: &str, u: &str) -> Result<(), GatewayError> {
    if u.is_empty() || u.len() > MAX_USER_ID_LEN || u.chars().any(char::is_control) {
        return Err(GatewayError::invalid(format!(
            "'{field}' must be 1..{MAX_USER_ID_LEN} bytes without control characters"
        )));
    }
    // The platform's own tasks run as these users, exempt from per-user
    // limits: a caller that could claim one could spend their budget.
    if crate::task::is_platform_user(u) {
        return Err(GatewayError::invalid(format!(
            "'{field}' must not start with '{}': user ids with that prefix are the platform's own",
            crate::task::PLATFORM_USER_PREFIX
        )));
    }
    Ok(())
}

/// Turns a parsed body into a validated task, or the error to answer with.
pub fn admit(
    cfg: &Config,
    identity: Identity,
    body: ChatRequestBody,
    ingress: Ingress,
    request_id_hint: Option<String>,
) -> Result<TaskRequest, GatewayError> {
    // An identity outlives the check that made it (an open WebSocket, an
    // MQTT connection): an application a reload removed, or moved to
    // another tenant, no longer admits anything, rather than admitting
    // without its limits and tool policy.
    if cfg.applications.get(&identity.application).is_none_or(|a| a.tenant != identity.tenant) {
        return Err(GatewayError::new(
            ErrorCode::AuthFailed,
            format!("application '{}' is no longer configured", identity.application),
        ));
    }
    let app = app_of(cfg, &identity);
    if let Some(a) = app.filter(|a| !a.may_use_ingress(ingress)) {
        return Err(GatewayError::new(
            ErrorCode::PermissionDenied,
            format!(
                "application '{}' may not call through {} (its allowed_ingresses: {})",
                a.name,
                ingress.as_str(),
                a.allowed_ingresses.iter().flatten().map(|i| i.as_str()).collect::<Vec<_>>().join(", ")
            ),
        ));
    }
    // The deprecated forms of `tools`/`tool_choice`: refused rather than
    // dropped, so a client never believes a function was offered.
    for deprecated in ["functions", "function_call"] {
        if body.extra.get(deprecated).is_some_and(|v| !v.is_null()) {
            return Err(GatewayError::invalid(format!(
                "'{deprecated}' is not supported; declare the functions in 'tools' (and use 'tool_choice')"
            )));
        }
    }
    if body.extra.get("logprobs").and_then(Value::as_bool) == Some(true) {
        return Err(GatewayError::invalid("'logprobs' is not supported by this gateway yet"));
    }
    if body.n.is_some_and(|n| n != 1) {
        return Err(GatewayError::invalid("only n = 1 is supported"));
    }
    let model = cfg.models.get(&body.model).ok_or_else(|| {
        GatewayError::invalid(format!("unknown model '{}'; GET /v1/models lists the models", body.model))
    })?;
    if let Some(a) = app.filter(|a| !a.may_use_model(&model.name)) {
        return Err(GatewayError::new(
            ErrorCode::PermissionDenied,
            format!("application '{}' may not use model '{}' (see GET /v1/models)", a.name, model.name),
        ));
    }
    super::operation::check_model(model, &body.operation, body.idempotency_key.as_deref())?;
    if body.messages.is_empty() {
        return Err(GatewayError::invalid("'messages' must not be empty"));
    }
    for (i, m) in body.messages.iter().enumerate() {
        if !matches!(m.role.as_str(), "system" | "user" | "assistant" | "developer" | "tool") {
            return Err(GatewayError::invalid(format!("messages[{i}].role {:?} is not a chat role", m.role)));
        }
        if !(m.content.is_string() || m.content.is_array() || (m.content.is_null() && m.role == "assistant")) {
            return Err(GatewayError::invalid(format!("messages[{i}].content must be a string or content parts")));
        }
        // A tool result answers one call of an earlier assistant message.
        if m.role == "tool" && !m.extra.get("tool_call_id").is_some_and(Value::is_string) {
            return Err(GatewayError::invalid(format!("messages[{i}] (role \"tool\") needs a 'tool_call_id' string")));
        }
        check_history_tools(i, m, app_of(cfg, &identity))?;
    }
    let tools = ToolSet::parse(body.tools.as_ref(), body.tool_choice.as_ref(), body.parallel_tool_calls.as_ref())
        .map_err(GatewayError::invalid)?;
    let priority = match &body.priority {
        Some(p) => {
            Priority::parse(p).ok_or_else(|| GatewayError::invalid(format!("'priority' must be P0..P4, not {p:?}")))?
        }
        None => identity.default_priority,
    };
    if !super::auth::may_use(&identity, priority) {
        return Err(GatewayError::new(
            ErrorCode::PermissionDenied,
            format!(
                "application '{}' may not use priority {} (most urgent allowed: {})",
                identity.application,
                priority.as_str(),
                identity.max_priority.as_str()
            ),
        ));
    }
    if let Some(a) = app.filter(|a| !a.may_use_priority(priority)) {
        return Err(GatewayError::new(
            ErrorCode::PermissionDenied,
            format!(
                "application '{}' may not use priority {} (its allowed_priorities: {})",
                a.name,
                priority.as_str(),
                a.allowed_priorities.iter().flatten().map(|p| p.as_str()).collect::<Vec<_>>().join(", ")
            ),
        ));
    }
    let request_id = body.request_id.clone().or(request_id_hint).unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
    check_id("request_id", &request_id)?;
    if let Some(k) = &body.idempotency_key {
        check_id("idempotency_key", k)?;
        // The device key space: only the MQTT ingress makes such keys (from
        // the device and its request id), so no other caller can claim a
        // device's future key.
        if ingress != Ingress::Mqtt && k.starts_with(DEVICE_KEY_PREFIX) {
            return Err(GatewayError::invalid(format!(
                "idempotency keys starting with '{DEVICE_KEY_PREFIX}' are reserved for MQTT devices"
            )));
        }
    }
    if let Some(s) = &body.session_id {
        check_id("session_id", s)?;
    }
    if let Some(p) = &body.params.temperature {
        if !(0.0..=2.0).contains(p) {
            return Err(GatewayError::invalid("'temperature' must be between 0 and 2"));
        }
    }
    if let Some(p) = &body.params.top_p {
        if !(0.0..=1.0).contains(p) {
            return Err(GatewayError::invalid("'top_p' must be between 0 and 1"));
        }
    }

    let requested = body.max_output_tokens.or(body.max_completion_tokens).or(body.max_tokens);
    if requested == Some(0) {
        return Err(GatewayError::invalid("'max_output_tokens' must be at least 1"));
    }
    let mut degrade_reason = None;
    let mut max_output_tokens = requested.unwrap_or(model.max_output_tokens);
    if max_output_tokens > model.max_output_tokens {
        max_output_tokens = model.max_output_tokens;
        degrade_reason = Some(format!("output budget capped at the model's {} tokens", model.max_output_tokens));
    }
    let context_policy = context::window::policy(cfg, &identity.application, body.context_policy.as_deref())?;
    let input_tokens_estimate = context::estimate_tokens(&body.messages);
    let fit = match &body.operation {
        // Each input is embedded on its own and nothing is generated.
        Operation::Embedding { .. } => {
            super::operation::embedding_inputs_fit(model, &body.messages).map(|_| Fit::Fits)?
        }
        _ => context::fit(input_tokens_estimate, max_output_tokens, model.context_tokens),
    };
    match fit {
        Fit::Fits => {}
        Fit::ReduceOutput(n) => {
            max_output_tokens = n;
            degrade_reason = Some(format!("output budget reduced to {n} tokens to fit the context window"));
        }
        // A chat call the assembly may still serve: a model with a larger
        // window, or earlier turns it may leave out (`context::window`).
        // The gateway assembles it; its output budget is set there.
        Fit::TooLarge
            if body.operation == Operation::Chat
                && (model.larger_window_model.is_some()
                    || (context_policy == ContextPolicy::Auto
                        && !context::window::earlier_turns(&body.messages).is_empty())) => {}
        Fit::TooLarge => {
            return Err(GatewayError::new(
                ErrorCode::ContextTooLarge,
                format!(
                    "the prompt is about {input_tokens_estimate} tokens; model '{}' takes at most {}",
                    model.name, model.context_tokens
                ),
            ))
        }
    }

    let t = body.timeouts.unwrap_or_default();
    let pick = |asked: Option<u64>, limit: Duration, name: &str| -> Result<Duration, GatewayError> {
        match asked {
            Some(0) => Err(GatewayError::invalid(format!("'timeouts.{name}' must be greater than 0"))),
            // The configured value is both the default and the ceiling.
            Some(ms) => Ok(Duration::from_millis(ms).min(limit)),
            None => Ok(limit),
        }
    };
    let timeouts = Timeouts {
        queue: pick(t.queue_ms, cfg.timeouts.queue, "queue_ms")?,
        first_token: pick(t.first_token_ms, cfg.timeouts.first_token, "first_token_ms")?,
        inference: pick(t.inference_ms, cfg.timeouts.inference, "inference_ms")?,
        idle: pick(t.idle_ms, cfg.timeouts.idle, "idle_ms")?,
        total: pick(t.total_ms, cfg.timeouts.total, "total_ms")?,
    };
    let mut routing = body.routing.unwrap_or_default();
    let data_class = data_class(cfg, &identity.tenant, app, identity.data_class, &routing);
    // Kept with the request, so a task queued again after a restart is
    // routed under the class it was admitted with.
    routing.data_class = Some(data_class);
    let mut allow_smaller_model = routing.allow_smaller_model || app.is_some_and(|a| a.allow_smaller_model);
    // Never a smaller model the application may not name itself.
    allow_smaller_model &= model.fallback_models.iter().all(|m| app.is_none_or(|a| a.may_use_model(m)));
    if let Some(tools) = &tools {
        if let Some(name) = disallowed_tool(app, tools) {
            return Err(GatewayError::new(
                ErrorCode::PermissionDenied,
                format!("application '{}' may not declare tool '{name}'", identity.application),
            ));
        }
        allow_smaller_model &= tools_route(cfg, model, tools, data_class).map_err(GatewayError::invalid)?;
    }
    if !model.instances.iter().any(|i| cfg.engines[i].max_data_class >= data_class) {
        return Err(GatewayError::new(
            ErrorCode::PolicyBlocked,
            format!(
                "model '{}' has no instance that may receive {} data{}",
                model.name,
                data_class.as_str(),
                if routing.local_only { " (the request is local_only)" } else { "" }
            ),
        ));
    }

    let mut metadata = body.metadata.unwrap_or_default();
    let mut identity = identity;
    // With a `user_header`, the proxy in front names the user (the gateway
    // set it from the header); the body's fields are the caller's and are
    // ignored, as they are when the credential (a JWT `sub`) names one.
    if identity.user_id.is_none() && app.is_none_or(|a| a.user_header.is_none()) {
        // A caller-declared user id keys per-user limits and is stored with
        // every task: bounded, and nothing a log line could be split by.
        let declared = metadata.get("user_id").and_then(Value::as_str).map(|u| ("metadata.user_id", u.to_string()));
        let declared = declared.or(body.user.map(|u| ("user", u)));
        if let Some((field, u)) = &declared {
            check_user_id(field, u)?;
        }
        identity.user_id = declared.map(|(_, u)| u);
    }
    metadata.insert("application".into(), Value::String(identity.application.clone()));
    let prompt_sha256 = match &body.operation {
        Operation::Chat => hex::encode(Sha256::digest(serde_json::to_vec(&body.messages).unwrap_or_default())),
        op => super::operation::digest(op),
    };

    Ok(TaskRequest {
        task_id: crate::task::new_task_id(),
        request_id,
        // The gateway sets it: the protocol's header outranks the body.
        trace_id: String::new(),
        span_id: String::new(),
        parent_span_id: None,
        identity,
        ingress,
        logical_model: model.name.clone(),
        messages: body.messages,
        params: body.params,
        priority,
        max_output_tokens,
        timeouts,
        session_id: body.session_id,
        idempotency_key: body.idempotency_key,
        routing,
        data_class,
        allow_smaller_model,
        metadata,
        input_tokens_estimate,
        prompt_sha256,
        received_at: Instant::now(),
        received_wall: SystemTime::now(),
        degrade_reason,
        tools,
        operation: body.operation,
        context: None,
    })
}

fn app_of<'a>(cfg: &'a Config, identity: &Identity) -> Option<&'a ApplicationConfig> {
    cfg.applications.get(&identity.application)
}

/// The tool calls of an earlier assistant turn (`tool_calls`) and the name
/// a tool result may carry: their shape, and their names against the
/// application's `allowed_tools` (a history that names a forbidden tool
/// uses it as much as declaring it does).
fn check_history_tools(i: usize, m: &ChatMessage, app: Option<&ApplicationConfig>) -> Result<(), GatewayError> {
    let forbidden = |name: &str| {
        app.and_then(|a| a.allowed_tools.as_ref()).is_some_and(|allowed| !allowed.iter().any(|a| a == name))
    };
    let denied = |at: String, name: &str| {
        GatewayError::new(
            ErrorCode::PermissionDenied,
            format!(
                "{at} names tool '{name}', which application '{}' may not use",
                app.map(|a| a.name.as_str()).unwrap_or_default()
            ),
        )
    };
    if m.role == "tool" {
        if let Some(name) = m.extra.get("name").filter(|n| !n.is_null()) {
            let Some(name) = name.as_str().filter(|n| crate::task::tools::valid_tool_name(n)) else {
                return Err(GatewayError::invalid(format!("messages[{i}].name must be a tool name")));
            };
            if forbidden(name) {
                return Err(denied(format!("messages[{i}]"), name));
            }
        }
    }
    let calls = match m.extra.get("tool_calls") {
        None | Some(Value::Null) => return Ok(()),
        Some(Value::Array(a)) => a,
        Some(_) => return Err(GatewayError::invalid(format!("messages[{i}].tool_calls must be an array"))),
    };
    if m.role != "assistant" {
        return Err(GatewayError::invalid(format!(
            "messages[{i}].tool_calls: only an assistant message makes tool calls"
        )));
    }
    for (j, c) in calls.iter().enumerate() {
        let at = format!("messages[{i}].tool_calls[{j}]");
        if !c.get("id").is_some_and(Value::is_string) {
            return Err(GatewayError::invalid(format!("{at}.id must be a string")));
        }
        if c.get("type").is_some_and(|t| t != "function") {
            return Err(GatewayError::invalid(format!("{at}.type must be \"function\"")));
        }
        let Some(f) = c.get("function").and_then(Value::as_object) else {
            return Err(GatewayError::invalid(format!("{at}.function must be an object with 'name' and 'arguments'")));
        };
        let Some(name) = f.get("name").and_then(Value::as_str).filter(|n| crate::task::tools::valid_tool_name(n))
        else {
            return Err(GatewayError::invalid(format!(
                "{at}.function.name must be 1..64 characters of a-z A-Z 0-9 _ -"
            )));
        };
        if f.get("arguments").is_some_and(|a| !a.is_string()) {
            return Err(GatewayError::invalid(format!("{at}.function.arguments must be a string (JSON text)")));
        }
        if forbidden(name) {
            return Err(denied(at, name));
        }
    }
    Ok(())
}

/// The first tool `tools` declares that `app`'s `allowed_tools` leaves
/// out, if it has such a list.
pub fn disallowed_tool<'a>(app: Option<&ApplicationConfig>, tools: &'a ToolSet) -> Option<&'a str> {
    let allowed = app.and_then(|a| a.allowed_tools.as_ref())?;
    tools.names().find(|n| !allowed.iter().any(|a| a == n))
}

/// Where a request with `tools` may run, the one rule for admission and
/// for a task queued again after a restart (the config may have changed):
/// `Err` (the reason, for an `INVALID_REQUEST`) when `model` itself cannot
/// honour them, `Ok(false)` when some fallback model could not (so no
/// smaller model for this task), `Ok(true)` otherwise.
pub fn tools_route(cfg: &Config, model: &ModelConfig, tools: &ToolSet, class: DataClass) -> Result<bool, String> {
    if let Some(instance) = without_tools(cfg, &model.instances, class) {
        return Err(format!(
            "model '{}' cannot take 'tools': its instance '{instance}' does not support tool calling \
             (engines.{instance}.tools = false)",
            model.name
        ));
    }
    if let Some(instance) = drops_tool_choice(cfg, &model.instances, tools, class) {
        return Err(format!(
            "model '{}' cannot honour 'tool_choice' {} or 'parallel_tool_calls' false: its instance '{instance}' \
             is an Ollama engine, whose API has neither (leave them out, or use \"auto\")",
            model.name,
            tools
                .tool_choice
                .as_ref()
                .map_or_else(|| "(default)".to_string(), |c| crate::task::tools::short(&c.to_string(), 80)),
        ));
    }
    // Never a smaller model that would drop the tools or their options.
    Ok(model.fallback_models.iter().all(|m| {
        cfg.models.get(m).is_some_and(|fm| {
            without_tools(cfg, &fm.instances, class).is_none()
                && drops_tool_choice(cfg, &fm.instances, tools, class).is_none()
        })
    }))
}

/// The first instance of `instances` that may receive `class` data and
/// would silently drop `tools`' `tool_choice` (other than `auto`) or
/// `parallel_tool_calls: false`: Ollama's API has neither.
fn drops_tool_choice<'a>(cfg: &Config, instances: &'a [String], tools: &ToolSet, class: DataClass) -> Option<&'a str> {
    let default_choice = tools.tool_choice.as_ref().is_none_or(|c| c == "auto");
    if default_choice && tools.parallel_tool_calls != Some(false) {
        return None;
    }
    instances
        .iter()
        .find(|i| cfg.engines.get(*i).is_some_and(|e| e.max_data_class >= class && e.kind == EngineKind::Ollama))
        .map(String::as_str)
}

/// The first instance of `instances` that may receive `class` data and
/// cannot do tools: a request with tools could be routed there, and its
/// tools would be lost. Cloud instances count even when cloud is off now
/// (the setting can change while the task waits).
pub fn without_tools<'a>(cfg: &Config, instances: &'a [String], class: DataClass) -> Option<&'a str> {
    instances
        .iter()
        .find(|i| cfg.engines.get(*i).is_some_and(|e| e.max_data_class >= class && !e.tools))
        .map(String::as_str)
}
