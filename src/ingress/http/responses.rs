//! `POST /v1/responses`: OpenAI's Responses API, the form newer SDK code
//! (`client.responses.create`) defaults to, streamed (SSE events with
//! `type` and `sequence_number`) and not.
//!
//! Owns: the Responses wire format, both ways: a request is translated
//! into the chat body the gateway already understands (input items to
//! messages, `instructions` to a system message, function tools to chat
//! tools), so it takes the very same path as a chat call (authentication,
//! admission, idempotency, scheduling, the store, cancellation when the
//! client goes away); the task's events are rendered as a Response object
//! or as its stream of events. Does not own: validation of what the chat
//! body carries (admission), the task (the gateway facade).
//!
//! Not supported, refused with `INVALID_REQUEST` naming the field:
//! `conversation` (it needs sessions, which the gateway does not have
//! yet), background responses, reasoning options, built-in tools, and any
//! other field this file does not know.
//!
//! `truncation` (`"auto"` or `"disabled"`) is the chat body's
//! `context_policy` (see `crate::context::window`), and the Response's
//! `truncation` says the policy the call ran under: the request's, else
//! its application's `context_policy` (`auto` by default).
//!
//! `previous_response_id` continues a stored Response, as OpenAI does: the
//! request's messages are that Response's conversation (its own input,
//! after its own previous chain's), its output (text as an assistant
//! message, function calls as tool calls) and then the new `input`; the
//! previous `instructions` are not carried over. Each stored Response
//! keeps the conversation it answered, so a chain of any length costs one
//! lookup. An id that is unknown, not stored (`store: false`), purged,
//! deleted, or another application's is answered 404 `INVALID_REQUEST`
//! ("no such previous response"), as `GET /v1/responses/{id}` answers it;
//! so is another user's (the credential's user, else `metadata.user_id`
//! or `user`, as for sessions). A chain reads like a session whose history
//! the client holds by id: the request's own messages go through
//! admission as any call's, and the chain's earlier messages enter the
//! prompt as a session's turns do, through the assembly's ladder (the
//! oldest left out, recorded in `edge.context`, when they outgrow the
//! model's window: trimmed, not refused, unless `truncation` is
//! `"disabled"`); it is not a `/v1/sessions`
//! session (no turn lock, no summary), and a request naming both is
//! refused.
//!
//! The conversation is written to the store only where the data policy
//! lets it keep prompts (`[store] store_prompts`); otherwise, a Response
//! kept because the caller asked (`"store": true`) keeps its conversation
//! in memory only, for the last [`MEMORY_CONVERSATIONS`] Responses and at
//! most [`MEMORY_CONVERSATION_BYTES`] of them (after that, or after a
//! restart, it continues from its output alone). A chain
//! whose conversation would pass [`MAX_CHAIN_BYTES`] of JSON or
//! [`MAX_CHAIN_MESSAGES`] messages is refused `CONTEXT_TOO_LARGE` (413):
//! its prompt could not fit any window, and each link would store it
//! whole again.
//!
//! Stored responses: a Response is a task, and `GET /v1/responses/{id}`
//! returns the very object its create returned (status, output, usage),
//! kept with the task record and purged with it (`[store]
//! retention_tasks_hours`), to the application that created it only
//! (anyone else gets 404). `DELETE` forgets it. It is kept when the
//! request says `"store": true`, or says nothing and the data policy keeps
//! answers (`[store] store_prompts`): answer text is not kept against the
//! operator's policy unless the caller asks for it, as with an idempotency
//! key. The Response's `store` says which it was. A stream the client
//! left before its end cancels the task, and nothing is kept.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};

use super::caller::{self, id_headers, Credential};
use super::chat::submit_options;
use super::errors::ApiError;
use super::sse;
use crate::error::{ErrorCode, GatewayError};
use crate::gateway::{Caller, Gateway, TaskStream};
use crate::task::{Ingress, ResultMeta, TaskEvent};

/// Fields of the Responses API passed on to the chat body as they are.
const SAME_AS_CHAT: &[&str] =
    &["model", "temperature", "top_p", "max_output_tokens", "metadata", "user", "parallel_tool_calls"];

/// Edgeway's own request fields (see the chat API), accepted here too.
const EDGE_FIELDS: &[&str] =
    &["request_id", "idempotency_key", "session_id", "priority", "context_policy", "timeouts", "routing"];

/// Fields read here and not passed on as they are.
const HANDLED: &[&str] = &[
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "stream",
    "stream_options",
    "store",
    "previous_response_id",
    "truncation",
];

fn invalid(msg: impl Into<String>) -> GatewayError {
    GatewayError::invalid(msg)
}

/// What the Response object echoes of the request.
#[derive(Default)]
struct Echo {
    instructions: Value,
    tools: Value,
    tool_choice: Value,
    parallel_tool_calls: Value,
    temperature: Value,
    top_p: Value,
    max_output_tokens: Value,
    metadata: Value,
    user: Value,
    /// What the request said of `store` (`None`: nothing).
    store: Option<bool>,
    /// The stored Response this one continues.
    previous_response_id: Option<String>,
    /// The call's `context_policy` (the request's `truncation`, else the
    /// application's), as OpenAI names it: `auto` or `disabled`.
    truncation: &'static str,
}

/// A Responses request as a chat request body (JSON), whether it streams,
/// and what the answer echoes.
fn to_chat(body: &[u8]) -> Result<(Value, bool, Echo), GatewayError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| invalid(format!("body is not valid JSON: {e}")))?;
    let Value::Object(req) = v else { return Err(invalid("invalid request: expected a JSON object")) };
    let mut chat = Map::new();
    for (k, val) in &req {
        // An explicit null is the same as leaving the field out (the SDKs
        // send some that way).
        if val.is_null() || SAME_AS_CHAT.contains(&k.as_str()) || EDGE_FIELDS.contains(&k.as_str()) {
            if !val.is_null() {
                chat.insert(k.clone(), val.clone());
            }
            continue;
        }
        if HANDLED.contains(&k.as_str()) {
            continue;
        }
        let off = match k.as_str() {
            "conversation" => {
                return Err(invalid(format!(
                    "'{k}' is not supported until the gateway has sessions; use 'previous_response_id' or send the whole conversation in 'input'"
                )))
            }
            // The defaults say nothing that needs supporting.
            "background" => val == &Value::Bool(false),
            "text" => val.get("format").is_none_or(|f| f.get("type").is_some_and(|t| t == "text")),
            _ => false,
        };
        if !off {
            return Err(invalid(format!("'{k}' is not supported by /v1/responses on this gateway")));
        }
    }
    // OpenAI's `truncation` is edgeway's `context_policy`, the same two
    // values: whether the conversation's oldest messages may be left out.
    if let Some(t) = req.get("truncation").filter(|v| !v.is_null()) {
        let Some(t) = t.as_str().filter(|t| matches!(*t, "auto" | "disabled")) else {
            return Err(invalid("invalid field 'truncation': expected \"auto\" or \"disabled\""));
        };
        if chat.get("context_policy").is_some_and(|c| c != t) {
            return Err(invalid("'truncation' and 'context_policy' say different things: give one"));
        }
        chat.insert("context_policy".into(), t.into());
    }
    let mut messages = Vec::new();
    if let Some(i) = req.get("instructions").filter(|v| !v.is_null()) {
        let Some(text) = i.as_str() else { return Err(invalid("invalid field 'instructions': expected a string")) };
        messages.push(json!({"role": "system", "content": text}));
    }
    match req.get("input") {
        Some(Value::String(s)) => messages.push(json!({"role": "user", "content": s})),
        Some(Value::Array(items)) => {
            for (i, item) in items.iter().enumerate() {
                input_item(i, item, &mut messages)?;
            }
        }
        None | Some(Value::Null) => return Err(invalid("missing field 'input'")),
        Some(_) => return Err(invalid("invalid field 'input': expected a string or a list of input items")),
    }
    chat.insert("messages".into(), Value::Array(messages));
    if let Some(tools) = req.get("tools").filter(|v| !v.is_null()) {
        chat.insert("tools".into(), chat_tools(tools)?);
    }
    if let Some(choice) = req.get("tool_choice").filter(|v| !v.is_null()) {
        chat.insert("tool_choice".into(), chat_tool_choice(choice)?);
    }
    let stream = match req.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(invalid("invalid field 'stream': expected a boolean")),
    };
    chat.insert("stream".into(), stream.into());
    let get = |k: &str| req.get(k).cloned().unwrap_or(Value::Null);
    let echo = Echo {
        instructions: get("instructions"),
        tools: req.get("tools").filter(|v| !v.is_null()).cloned().unwrap_or(json!([])),
        tool_choice: req.get("tool_choice").filter(|v| !v.is_null()).cloned().unwrap_or(json!("auto")),
        parallel_tool_calls: req.get("parallel_tool_calls").filter(|v| !v.is_null()).cloned().unwrap_or(json!(true)),
        temperature: get("temperature"),
        top_p: get("top_p"),
        max_output_tokens: get("max_output_tokens"),
        metadata: req.get("metadata").filter(|v| !v.is_null()).cloned().unwrap_or(json!({})),
        user: get("user"),
        store: match req.get("store") {
            None | Some(Value::Null) => None,
            Some(Value::Bool(b)) => Some(*b),
            Some(_) => return Err(invalid("invalid field 'store': expected a boolean")),
        },
        previous_response_id: match req.get("previous_response_id") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s.clone()),
            Some(_) => return Err(invalid("invalid field 'previous_response_id': expected a string")),
        },
        // Set by `create`, which knows the caller's application.
        truncation: "auto",
    };
    Ok((Value::Object(chat), stream, echo))
}

/// The text of a message's `content`: a string, or a list of text parts.
fn content_text(at: &str, content: &Value) -> Result<String, GatewayError> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut text = String::new();
            for (j, p) in parts.iter().enumerate() {
                let kind = p.get("type").and_then(Value::as_str).unwrap_or("<none>");
                match (kind, p.get("text").and_then(Value::as_str)) {
                    ("input_text" | "output_text" | "text", Some(t)) => text.push_str(t),
                    ("input_text" | "output_text" | "text", None) => {
                        return Err(invalid(format!("invalid field '{at}.content[{j}].text': expected a string")))
                    }
                    _ => {
                        return Err(invalid(format!(
                            "'{at}.content[{j}]': content of type '{kind}' is not supported (text only)"
                        )))
                    }
                }
            }
            Ok(text)
        }
        _ => Err(invalid(format!("invalid field '{at}.content': expected a string or a list of parts"))),
    }
}

/// One item of `input` as chat messages: a message, a function call the
/// model made earlier (joined to the assistant message before it) or the
/// output of one (a `tool` message).
fn input_item(i: usize, item: &Value, messages: &mut Vec<Value>) -> Result<(), GatewayError> {
    let at = format!("input[{i}]");
    let kind = item.get("type").and_then(Value::as_str).unwrap_or("message");
    let str_field = |k: &str| {
        item.get(k)
            .and_then(Value::as_str)
            .ok_or_else(|| invalid(format!("invalid field '{at}.{k}': expected a string")))
    };
    match kind {
        "message" => {
            let role = match str_field("role")? {
                "developer" | "system" => "system",
                r @ ("user" | "assistant") => r,
                r => return Err(invalid(format!("invalid field '{at}.role': unknown role '{r}'"))),
            };
            let text = content_text(&at, item.get("content").unwrap_or(&Value::Null))?;
            messages.push(json!({"role": role, "content": text}));
        }
        "function_call" => {
            let call = json!({
                "id": str_field("call_id")?, "type": "function",
                "function": {"name": str_field("name")?, "arguments": str_field("arguments")?},
            });
            // Parallel calls are one assistant message with several calls.
            match messages.last_mut() {
                Some(m) if m["role"] == "assistant" && m["tool_calls"].is_array() => {
                    m["tool_calls"].as_array_mut().expect("checked").push(call)
                }
                _ => messages.push(json!({"role": "assistant", "content": null, "tool_calls": [call]})),
            }
        }
        "function_call_output" => {
            let output = content_text(&at, item.get("output").unwrap_or(&Value::Null))?;
            messages.push(json!({"role": "tool", "tool_call_id": str_field("call_id")?, "content": output}));
        }
        k => return Err(invalid(format!("'{at}': input items of type '{k}' are not supported"))),
    }
    Ok(())
}

/// Responses function tools (`{"type":"function","name",…}`) as chat tools
/// (`{"type":"function","function":{"name",…}}`).
fn chat_tools(tools: &Value) -> Result<Value, GatewayError> {
    let Some(list) = tools.as_array() else { return Err(invalid("invalid field 'tools': expected a list")) };
    let mut out = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        match t.get("type").and_then(Value::as_str) {
            Some("function") => {}
            Some(other) => {
                return Err(invalid(format!(
                    "'tools[{i}]': built-in tools ('{other}') are not supported; function tools only"
                )))
            }
            None => return Err(invalid(format!("invalid field 'tools[{i}].type': expected \"function\""))),
        }
        let Some(name) = t.get("name").and_then(Value::as_str) else {
            return Err(invalid(format!("invalid field 'tools[{i}].name': expected a string")));
        };
        let mut f = json!({ "name": name });
        for k in ["description", "parameters", "strict"] {
            if let Some(v) = t.get(k).filter(|v| !v.is_null()) {
                f[k] = v.clone();
            }
        }
        out.push(json!({"type": "function", "function": f}));
    }
    Ok(Value::Array(out))
}

fn chat_tool_choice(choice: &Value) -> Result<Value, GatewayError> {
    match choice {
        Value::String(_) => Ok(choice.clone()),
        Value::Object(o) if o.get("type").is_some_and(|t| t == "function") => match o.get("name") {
            Some(Value::String(n)) => Ok(json!({"type": "function", "function": {"name": n}})),
            _ => Err(invalid("invalid field 'tool_choice.name': expected a string")),
        },
        _ => Err(invalid("'tool_choice': only \"none\", \"auto\", \"required\" or a function are supported")),
    }
}

pub async fn create(
    State(gw): State<Arc<Gateway>>,
    Credential(cred): Credential,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    // Who is calling comes before what the body says, as for chat.
    let identity = gw
        .authenticate_with(cred.as_deref(), &super::caller::request_headers(&headers))
        .map_err(|e| gw.refused(Ingress::Http, e))?;
    let (mut chat, stream, mut echo) = to_chat(&body).map_err(|e| gw.refused(Ingress::Http, e))?;
    // A bad `context_policy` is refused by admission, below.
    let requested = chat.get("context_policy").and_then(Value::as_str);
    let policy = gw.context_policy(&identity.application, requested);
    echo.truncation = policy.map_or("auto", |p| p.as_str());
    let (conversation, chain) = continue_from(&gw, &identity, &mut chat, &echo).await?;
    let chat = serde_json::to_vec(&chat).map_err(|e| GatewayError::internal(e.to_string()))?;
    let call = gw.prepare(Caller::Identity(identity), &chat, Ingress::Http, submit_options(&headers))?;
    let call = call.with_history(chain);
    let model = call.body().model.clone();
    let store = echo.store.unwrap_or(gw.config().store.store_prompts);
    let task = gw.submit_call(call).await?;
    let keep = store.then(|| (gw.clone(), conversation));
    let out = Output::new(&task.task_id, model, echo, keep);
    Ok(if stream { sse_response(task, out) } else { whole_response(task, out).await })
}

const NO_SUCH_PREVIOUS: &str = "no such previous response ('previous_response_id')";

/// The most a `previous_response_id` chain's conversation may hold.
pub const MAX_CHAIN_BYTES: usize = 1024 * 1024;
pub const MAX_CHAIN_MESSAGES: usize = 1000;
/// Conversations kept in memory (without `store_prompts`), newest last:
/// at most this many, and at most this many bytes in all (each may hold
/// up to `MAX_CHAIN_BYTES`: 1000 full ones would be a gigabyte; review 14
/// M4).
pub const MEMORY_CONVERSATIONS: usize = 1000;
pub const MEMORY_CONVERSATION_BYTES: usize = 64 * 1024 * 1024;

/// Conversations of Responses kept where the store may not keep prompts:
/// in this process only, bounded (oldest out first). Keyed by task id,
/// which is unique across gateways in one process (tests run several).
static IN_MEMORY: std::sync::Mutex<std::collections::VecDeque<(String, Arc<str>)>> =
    std::sync::Mutex::new(std::collections::VecDeque::new());

fn remember_conversation(task_id: &str, conversation: &str) {
    let mut m = IN_MEMORY.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    m.retain(|(id, _)| id != task_id);
    m.push_back((task_id.to_string(), Arc::from(conversation)));
    let mut bytes: usize = m.iter().map(|(_, c)| c.len()).sum();
    while m.len() > MEMORY_CONVERSATIONS || (bytes > MEMORY_CONVERSATION_BYTES && m.len() > 1) {
        if let Some((_, c)) = m.pop_front() {
            bytes -= c.len();
        }
    }
}

/// Drops the conversations kept in memory for these tasks (a user's data
/// deleted).
pub(super) fn forget_conversations(task_ids: &[String]) {
    if task_ids.is_empty() {
        return;
    }
    let ids: std::collections::HashSet<&str> = task_ids.iter().map(String::as_str).collect();
    let mut m = IN_MEMORY.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    m.retain(|(id, _)| !ids.contains(id.as_str()));
}

fn remembered_conversation(task_id: &str) -> Option<String> {
    let m = IN_MEMORY.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    m.iter().find(|(id, _)| id == task_id).map(|(_, c)| c.to_string())
}

/// The user a Responses call acts as: its credential's, else the one its
/// body declares (`metadata.user_id`, then `user`), as admission reads it.
fn caller_user(who: &crate::task::Identity, chat: &Value) -> Option<String> {
    who.user_id.clone().or_else(|| {
        chat.pointer("/metadata/user_id").or_else(|| chat.get("user")).and_then(Value::as_str).map(str::to_string)
    })
}

/// Reads the conversation of the Response that `previous_response_id`
/// names (its input chain, then its output); returns the conversation
/// this request answers (without its instructions, the request's input
/// after the chain), as it is kept with its Response, and the chain's
/// messages, the call's history (`chat` keeps only the request's own).
async fn continue_from(
    gw: &Gateway,
    who: &crate::task::Identity,
    chat: &mut Value,
    echo: &Echo,
) -> Result<(String, Vec<crate::task::ChatMessage>), ApiError> {
    let mut conversation: Vec<Value> = Vec::new();
    if let Some(prev) = &echo.previous_response_id {
        let task_id = task_id(prev).map_err(|_| ApiError::NotFound(NO_SUCH_PREVIOUS))?;
        let user = caller_user(who, chat);
        let (body, earlier) = gw
            .response_with_conversation(who, user.as_deref(), task_id)
            .await?
            .ok_or(ApiError::NotFound(NO_SUCH_PREVIOUS))?;
        let earlier = earlier.or_else(|| remembered_conversation(task_id));
        let broken = |e: serde_json::Error| GatewayError::internal(format!("a stored response is unreadable: {e}"));
        // A Response kept by an earlier version has no conversation: it
        // continues from its output alone.
        if let Some(m) = earlier {
            conversation = serde_json::from_str(&m).map_err(broken)?;
        }
        let body: Value = serde_json::from_str(&body).map_err(broken)?;
        // The output items are input items of the same shape.
        for (i, item) in body["output"].as_array().into_iter().flatten().enumerate() {
            input_item(i, item, &mut conversation)
                .map_err(|e| GatewayError::internal(format!("a stored response's output: {}", e.message)))?;
        }
    }
    let chain = serde_json::from_value(Value::Array(conversation.clone()))
        .map_err(|e| GatewayError::internal(format!("a stored conversation is unreadable: {e}")))?;
    let messages = chat["messages"].as_array().expect("to_chat sets messages");
    let instructions = usize::from(!echo.instructions.is_null());
    conversation.extend(messages[instructions..].iter().cloned());
    let text = serde_json::to_string(&conversation).map_err(|e| GatewayError::internal(e.to_string()))?;
    if text.len() > MAX_CHAIN_BYTES || conversation.len() > MAX_CHAIN_MESSAGES {
        return Err(GatewayError::new(
            crate::error::ErrorCode::ContextTooLarge,
            format!(
                "the 'previous_response_id' chain holds {} messages ({} bytes); at most {MAX_CHAIN_MESSAGES} \
                 messages and {MAX_CHAIN_BYTES} bytes: start a new conversation",
                conversation.len(),
                text.len()
            ),
        )
        .into());
    }
    Ok((text, chain))
}

/// One function call of the answer, as it streams in.
struct Call {
    index: u32,
    call_id: String,
    name: String,
    arguments: String,
    output_index: usize,
}

/// The answer so far, and what is needed to render it as a Response.
struct Output {
    id: String,
    task_id: String,
    created_at: i64,
    model: String,
    echo: Echo,
    text: String,
    /// The message item's `output_index`, once it has one.
    message: Option<usize>,
    calls: Vec<Call>,
    items: usize,
    /// Where the final Response is kept, when it is stored, and the
    /// conversation it answers (kept with it).
    keep: Option<(Arc<Gateway>, String)>,
}

impl Output {
    fn new(task_id: &str, model: String, echo: Echo, keep: Option<(Arc<Gateway>, String)>) -> Output {
        Output {
            id: format!("resp_{task_id}"),
            task_id: task_id.to_string(),
            created_at: crate::task::now_ms() / 1000,
            model,
            echo,
            text: String::new(),
            message: None,
            calls: Vec::new(),
            items: 0,
            keep,
        }
    }

    fn message_id(&self) -> String {
        format!("msg_{}", self.task_id)
    }

    fn call_id(&self, c: &Call) -> String {
        format!("fc_{}_{}", self.task_id, c.index)
    }

    fn text_part(&self) -> Value {
        json!({"type": "output_text", "text": self.text, "annotations": [], "logprobs": []})
    }

    fn message_item(&self, status: &str) -> Value {
        let content = if status == "in_progress" { json!([]) } else { json!([self.text_part()]) };
        json!({"id": self.message_id(), "type": "message", "role": "assistant", "status": status, "content": content})
    }

    fn call_item(&self, c: &Call, status: &str) -> Value {
        json!({
            "id": self.call_id(c), "type": "function_call", "status": status,
            "call_id": c.call_id, "name": c.name, "arguments": c.arguments,
        })
    }

    /// Every output item in `output_index` order.
    fn items(&self, status: &str) -> Vec<Value> {
        let mut items: Vec<(usize, Value)> =
            self.calls.iter().map(|c| (c.output_index, self.call_item(c, status))).collect();
        if let Some(i) = self.message {
            items.push((i, self.message_item(status)));
        }
        items.sort_by_key(|(i, _)| *i);
        items.into_iter().map(|(_, v)| v).collect()
    }

    /// The Response object. `meta` is the task's result, once there is one.
    fn response(&self, status: &str, meta: Option<&ResultMeta>, error: Option<&GatewayError>) -> Value {
        let item_status = match status {
            "completed" => "completed",
            "in_progress" => "in_progress",
            _ => "incomplete",
        };
        let e = &self.echo;
        let mut r = json!({
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "error": error.map(|e| json!({"code": e.code.as_str(), "message": e.message})),
            "incomplete_details": if status == "incomplete" { json!({"reason": "max_output_tokens"}) } else { Value::Null },
            "instructions": e.instructions, "max_output_tokens": e.max_output_tokens, "model": self.model,
            "output": if status == "in_progress" { json!([]) } else { Value::Array(self.items(item_status)) },
            "parallel_tool_calls": e.parallel_tool_calls, "temperature": e.temperature, "top_p": e.top_p,
            "tool_choice": e.tool_choice, "tools": e.tools, "metadata": e.metadata, "user": e.user,
            "store": self.keep.is_some(), "text": {"format": {"type": "text"}}, "truncation": e.truncation,
            "previous_response_id": e.previous_response_id,
            "usage": Value::Null,
        });
        if let Some(m) = meta {
            r["usage"] = json!({
                "input_tokens": m.usage.input_tokens, "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": m.usage.output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": m.usage.total_tokens,
            });
            r["edge"] = serde_json::to_value(m).unwrap_or(Value::Null);
        }
        r
    }

    /// Keeps the final Response `r` when it is stored.
    fn kept(&self, r: &Value) {
        if let Some((gw, conversation)) = &self.keep {
            // The input text goes to the store only under the data policy
            // that lets it keep prompts (review L7).
            let stored = if gw.config().store.store_prompts {
                Some(conversation.clone())
            } else {
                remember_conversation(&self.task_id, conversation);
                None
            };
            gw.keep_response(&self.task_id, r.to_string(), stored);
        }
    }

    /// Takes in one event; returns the stream events it makes (without
    /// `sequence_number`, which the stream adds).
    fn take(&mut self, ev: &TaskEvent) -> Vec<Value> {
        let mut out = Vec::new();
        match ev {
            TaskEvent::Accepted { .. } => {
                out.push(json!({"type": "response.created", "response": self.response("in_progress", None, None)}));
                out.push(json!({"type": "response.in_progress", "response": self.response("in_progress", None, None)}));
            }
            // A Responses task is a chat: it never has embeddings.
            TaskEvent::Queued { .. } | TaskEvent::Embedding { .. } => {}
            TaskEvent::Delta { text } => {
                let idx = match self.message {
                    Some(i) => i,
                    None => {
                        let i = self.items;
                        self.items += 1;
                        self.message = Some(i);
                        out.push(json!({"type": "response.output_item.added", "output_index": i,
                            "item": self.message_item("in_progress")}));
                        out.push(json!({"type": "response.content_part.added", "output_index": i,
                            "item_id": self.message_id(), "content_index": 0, "part": self.text_part()}));
                        i
                    }
                };
                self.text.push_str(text);
                out.push(json!({"type": "response.output_text.delta", "output_index": idx,
                    "item_id": self.message_id(), "content_index": 0, "delta": text, "logprobs": []}));
            }
            TaskEvent::ToolCallDelta(d) => {
                let pos = match self.calls.iter().position(|c| c.index == d.index) {
                    Some(p) => p,
                    None => {
                        let c = Call {
                            index: d.index,
                            call_id: d.id.clone().unwrap_or_default(),
                            name: d.name.clone().unwrap_or_default(),
                            arguments: String::new(),
                            output_index: self.items,
                        };
                        self.items += 1;
                        out.push(json!({"type": "response.output_item.added", "output_index": c.output_index,
                            "item": self.call_item(&c, "in_progress")}));
                        self.calls.push(c);
                        self.calls.len() - 1
                    }
                };
                let c = &mut self.calls[pos];
                c.arguments.push_str(&d.arguments);
                if !d.arguments.is_empty() {
                    let c = &self.calls[pos];
                    out.push(json!({"type": "response.function_call_arguments.delta", "output_index": c.output_index,
                        "item_id": self.call_id(c), "delta": d.arguments}));
                }
            }
            TaskEvent::Done(meta) => {
                let status = if meta.finish_reason.as_deref() == Some("length") { "incomplete" } else { "completed" };
                let item_status = if status == "completed" { "completed" } else { "incomplete" };
                let mut closing: Vec<(usize, Vec<Value>)> = Vec::new();
                if let Some(i) = self.message {
                    let id = self.message_id();
                    closing.push((
                        i,
                        vec![
                            json!({"type": "response.output_text.done", "output_index": i, "item_id": id,
                                "content_index": 0, "text": self.text, "logprobs": []}),
                            json!({"type": "response.content_part.done", "output_index": i, "item_id": id,
                                "content_index": 0, "part": self.text_part()}),
                            json!({"type": "response.output_item.done", "output_index": i,
                                "item": self.message_item(item_status)}),
                        ],
                    ));
                }
                for c in &self.calls {
                    closing.push((
                        c.output_index,
                        vec![
                            json!({"type": "response.function_call_arguments.done", "output_index": c.output_index,
                                "item_id": self.call_id(c), "name": c.name, "arguments": c.arguments}),
                            json!({"type": "response.output_item.done", "output_index": c.output_index,
                                "item": self.call_item(c, item_status)}),
                        ],
                    ));
                }
                closing.sort_by_key(|(i, _)| *i);
                out.extend(closing.into_iter().flat_map(|(_, evs)| evs));
                let response = self.response(status, Some(meta), None);
                self.kept(&response);
                out.push(json!({"type": format!("response.{status}"), "response": response}));
            }
            TaskEvent::Error { error, meta } => {
                let response = self.response("failed", Some(meta), Some(error));
                self.kept(&response);
                out.push(json!({"type": "response.failed", "response": response}));
            }
        }
        out
    }
}

/// The Responses stream: each task event as the API's events, each with
/// the next `sequence_number`.
struct Events {
    out: Output,
    seq: u64,
}

/// `event: <type>` and `data: <json>` with the next `sequence_number`.
fn push_event(buf: &mut Vec<u8>, seq: &mut u64, mut v: Value) {
    v["sequence_number"] = (*seq).into();
    *seq += 1;
    buf.extend_from_slice(b"event: ");
    buf.extend_from_slice(v["type"].as_str().unwrap_or("message").as_bytes());
    buf.extend_from_slice(b"\ndata: ");
    buf.extend_from_slice(v.to_string().as_bytes());
    buf.extend_from_slice(b"\n\n");
}

impl sse::Render for Events {
    fn event(&mut self, ev: TaskEvent) -> Bytes {
        let mut buf = Vec::with_capacity(256);
        if let TaskEvent::Queued { position, loading_ms } = &ev {
            // A comment: the SDKs skip it; it shows the wait and keeps
            // idle-closing proxies from dropping the stream.
            buf.extend_from_slice(crate::ingress::render::queued_comment(*position, *loading_ms).as_bytes());
        }
        for v in self.out.take(&ev) {
            push_event(&mut buf, &mut self.seq, v);
        }
        Bytes::from(buf)
    }

    fn lost(&mut self, e: &GatewayError) -> Bytes {
        let mut buf = Vec::with_capacity(256);
        let v = json!({"type": "response.failed", "response": self.out.response("failed", None, Some(e))});
        push_event(&mut buf, &mut self.seq, v);
        Bytes::from(buf)
    }
}

fn sse_response(task: TaskStream, out: Output) -> Response {
    sse::respond(task, Events { out, seq: 0 })
}

/// Waits for the whole answer. If the client disconnects, hyper drops this
/// future, the task stream is dropped and the task is cancelled.
async fn whole_response(mut task: TaskStream, mut out: Output) -> Response {
    while let Some((_, ev)) = task.recv().await {
        // The last event `take` makes of a terminal event carries the
        // final Response (and keeps it, when it is stored).
        let last = out.take(&ev).pop();
        match ev {
            TaskEvent::Done(meta) => {
                let body = last.and_then(|mut v| v.get_mut("response").map(Value::take)).unwrap_or(Value::Null);
                let mut resp = (StatusCode::OK, Json(body)).into_response();
                id_headers(resp.headers_mut(), &meta.request_id, &meta.task_id, meta.trace_id.as_deref());
                return resp;
            }
            TaskEvent::Error { error, meta } => return ApiError::Gateway(error, Some(meta)).into_response(),
            _ => {}
        }
    }
    ApiError::from(GatewayError::new(ErrorCode::InternalError, "the task ended without a result")).into_response()
}

const NO_SUCH_RESPONSE: &str = "no such response";

/// The task id of a Response id (`resp_<task id>`).
fn task_id(id: &str) -> Result<&str, ApiError> {
    id.strip_prefix("resp_").filter(|t| !t.is_empty()).ok_or(ApiError::NotFound(NO_SUCH_RESPONSE))
}

/// `GET /v1/responses/{id}`: the stored Response, as its create returned it.
pub async fn retrieve(
    State(gw): State<Arc<Gateway>>,
    caller::Caller(who): caller::Caller,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let body = gw.response(&who, task_id(&id)?).await?.ok_or(ApiError::NotFound(NO_SUCH_RESPONSE))?;
    Ok(([(header::CONTENT_TYPE, "application/json")], body).into_response())
}

/// `DELETE /v1/responses/{id}`: forgets a stored Response (its task
/// record stays, as for any task).
pub async fn delete(
    State(gw): State<Arc<Gateway>>,
    caller::Caller(who): caller::Caller,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    if !gw.forget_response(&who, task_id(&id)?).await? {
        return Err(ApiError::NotFound(NO_SUCH_RESPONSE));
    }
    Ok(Json(json!({"id": id, "object": "response", "deleted": true})).into_response())
}
