//! Tool calling, as plain data shared by every layer: the tools a request
//! declares ([`ToolSet`], validated once at admission), the pieces of a
//! call an engine streams ([`ToolCallDelta`]), their assembly into whole
//! calls ([`ToolCallAssembler`]) and the check of each call's arguments
//! against the declared JSON schema ([`ToolSet::check`]).
//!
//! Owns: the shapes, their limits and the per-call verdict. Does not own:
//! which application may declare which tool or which are high-risk
//! (configuration, applied by admission and the scheduler's driver), the
//! engines' wire formats (`engine::*`) or how a client sees calls
//! (`ingress::*`).

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Most tools one request may declare (OpenAI's own limit).
pub const MAX_TOOLS: usize = 128;
/// Most bytes of the declared tools, as JSON: they are sent to the engine
/// with every attempt and kept with the queued request.
pub const MAX_TOOLS_BYTES: usize = 256 * 1024;
/// Longest tool name, and its alphabet (OpenAI's rule).
pub const MAX_TOOL_NAME_LEN: usize = 64;

/// Whether `name` is a valid tool name: 1..=64 of `a-z A-Z 0-9 _ -`.
pub fn valid_tool_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_TOOL_NAME_LEN
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

/// The tools of a request, kept as the client sent them (validated), so an
/// engine receives exactly what the client declared.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolSet {
    /// `{"type": "function", "function": {"name", "description"?, "parameters"?}}`, in order.
    pub tools: Vec<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_choice: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parallel_tool_calls: Option<bool>,
}

impl ToolSet {
    /// Validates the request's `tools`, `tool_choice` and
    /// `parallel_tool_calls`. `Ok(None)` when it declares no tools (and
    /// asks for none). The error says which field is wrong, for an
    /// `INVALID_REQUEST`.
    pub fn parse(
        tools: Option<&Value>,
        tool_choice: Option<&Value>,
        parallel_tool_calls: Option<&Value>,
    ) -> Result<Option<ToolSet>, String> {
        let tools = match tools {
            None | Some(Value::Null) => {
                let choice = tool_choice.filter(|c| !c.is_null());
                if choice.is_some_and(|c| c != "none" && c != "auto") {
                    return Err("'tool_choice' names a tool but the request declares no 'tools'".into());
                }
                return Ok(None);
            }
            Some(Value::Array(a)) => a,
            Some(_) => return Err("'tools' must be an array of tools".into()),
        };
        if tools.is_empty() {
            return Err("'tools' must not be empty (leave it out instead)".into());
        }
        if tools.len() > MAX_TOOLS {
            return Err(format!("'tools' declares {} tools; at most {MAX_TOOLS} are allowed", tools.len()));
        }
        let bytes = serde_json::to_vec(tools).map(|v| v.len()).unwrap_or(usize::MAX);
        if bytes > MAX_TOOLS_BYTES {
            return Err(format!("'tools' is {bytes} bytes of JSON; at most {MAX_TOOLS_BYTES} are allowed"));
        }
        let mut names: Vec<&str> = Vec::with_capacity(tools.len());
        for (i, t) in tools.iter().enumerate() {
            let at = format!("tools[{i}]");
            if t.get("type").and_then(Value::as_str) != Some("function") {
                return Err(format!("'{at}.type' must be \"function\""));
            }
            let Some(f) = t.get("function").and_then(Value::as_object) else {
                return Err(format!("'{at}.function' must be an object"));
            };
            let name = f.get("name").and_then(Value::as_str).unwrap_or("");
            if !valid_tool_name(name) {
                return Err(format!(
                    "'{at}.function.name' must be 1..{MAX_TOOL_NAME_LEN} characters of a-z A-Z 0-9 _ -"
                ));
            }
            if names.contains(&name) {
                return Err(format!("'{at}.function.name': tool '{name}' is declared twice"));
            }
            names.push(name);
            if f.get("description").is_some_and(|d| !d.is_string() && !d.is_null()) {
                return Err(format!("'{at}.function.description' must be a string"));
            }
            match f.get("parameters") {
                None | Some(Value::Null) => {}
                Some(p @ Value::Object(_)) => {
                    if let Err(why) = schema_shape(p) {
                        return Err(format!("'{at}.function.parameters' {why}"));
                    }
                    if let Err(e) = jsonschema::validator_for(p) {
                        return Err(format!(
                            "'{at}.function.parameters' is not a usable JSON schema: {}",
                            short(&e.to_string(), 160)
                        ));
                    }
                }
                Some(_) => return Err(format!("'{at}.function.parameters' must be a JSON schema object")),
            }
        }
        let tool_choice = match tool_choice {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) if matches!(s.as_str(), "none" | "auto" | "required") => Some(Value::String(s.clone())),
            Some(c @ Value::Object(_)) => {
                let name = c.get("function").and_then(|f| f.get("name")).and_then(Value::as_str);
                match name {
                    Some(n) if c.get("type").and_then(Value::as_str) == Some("function") && names.contains(&n) => {
                        Some(c.clone())
                    }
                    Some(n) if names.contains(&n) => return Err("'tool_choice.type' must be \"function\"".into()),
                    Some(n) => return Err(format!("'tool_choice' names tool '{}', which 'tools' does not declare", short(n, 64))),
                    None => return Err("'tool_choice.function.name' is missing".into()),
                }
            }
            Some(_) => {
                return Err(
                    "'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": …}}"
                        .into(),
                )
            }
        };
        let parallel_tool_calls = match parallel_tool_calls {
            None | Some(Value::Null) => None,
            Some(Value::Bool(b)) => Some(*b),
            Some(_) => return Err("'parallel_tool_calls' must be true or false".into()),
        };
        Ok(Some(ToolSet { tools: tools.clone(), tool_choice, parallel_tool_calls }))
    }

    /// The declared tool names, in order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tools.iter().filter_map(|t| t.get("function")?.get("name")?.as_str())
    }

    /// The declared parameters schema of tool `name`: `Some(None)` when the
    /// tool is declared without one, `None` when it is not declared.
    fn parameters(&self, name: &str) -> Option<Option<&Value>> {
        self.tools
            .iter()
            .filter_map(|t| t.get("function"))
            .find(|f| f.get("name").and_then(Value::as_str) == Some(name))
            .map(|f| f.get("parameters").filter(|p| !p.is_null()))
    }

    /// The one tool `tool_choice` names, if it names one.
    fn forced(&self) -> Option<&str> {
        self.tool_choice.as_ref()?.get("function")?.get("name")?.as_str()
    }

    /// Whether `tool_choice` asks for at least one call (`"required"` or
    /// a named tool): an answer without one breaks it.
    pub fn requires_call(&self) -> bool {
        self.forced().is_some() || self.tool_choice.as_ref().is_some_and(|c| c == "required")
    }

    /// The request's `tool_choice` / `parallel_tool_calls` against call
    /// number `position` (0-based, in index order) to tool `name`: the
    /// engine may ignore them (Ollama's API has neither, a model may not
    /// follow them), so the gateway holds the calls to them.
    fn choice_verdict(&self, position: usize, name: &str) -> Result<(), String> {
        if self.tool_choice.as_ref().is_some_and(|c| c == "none") {
            return Err("'tool_choice' is \"none\": the model may call no tool".into());
        }
        if let Some(forced) = self.forced() {
            if forced != name {
                return Err(format!("'tool_choice' names tool '{forced}'; the model called another"));
            }
        }
        if position > 0 && self.parallel_tool_calls == Some(false) {
            return Err("'parallel_tool_calls' is false: only the first call may be made".into());
        }
        Ok(())
    }

    /// Checks one whole call: the tool is declared, its arguments are a
    /// JSON object, and they match the tool's schema. `Err` is the short,
    /// stable reason (`unknown_tool`, `invalid_json`, `schema_mismatch`)
    /// and a detail.
    pub fn check(&self, name: &str, arguments: &str) -> Result<(), (&'static str, String)> {
        // The name is the model's text: it stays out of the detail (which
        // is stored and published); the call's own `name` field carries it.
        let Some(schema) = self.parameters(name) else {
            return Err(("unknown_tool", "the model called a tool the request does not declare".to_string()));
        };
        // An empty string is what some engines send for a call without
        // arguments.
        let args: Value = if arguments.trim().is_empty() {
            Value::Object(Default::default())
        } else {
            match serde_json::from_str(arguments) {
                Ok(v) => v,
                // serde_json's syntax errors name a position, not the text.
                Err(e) => return Err(("invalid_json", format!("arguments are not JSON: {e}"))),
            }
        };
        let Some(schema) = schema else {
            return Ok(());
        };
        // Compiled at admission already; a failure here cannot happen.
        let validator =
            jsonschema::validator_for(schema).map_err(|e| ("schema_mismatch", short(&e.to_string(), 160)))?;
        // Bound to a local: the error iterator borrows both values.
        let verdict = match validator.iter_errors(&args).next() {
            None => Ok(()),
            Some(e) => {
                // Only where (the instance path) and which rule (the schema
                // keyword that failed): jsonschema's message quotes the
                // offending value, and the arguments are answer text, kept
                // out of records and events where the text is.
                let path = e.instance_path().to_string();
                let at = if path.is_empty() { "arguments".to_string() } else { format!("arguments{path}") };
                let schema_path = e.schema_path().to_string();
                let keyword = schema_path.rsplit('/').next().filter(|k| !k.is_empty()).unwrap_or("schema");
                Err(("schema_mismatch", short(&format!("{at}: fails '{keyword}' (schema {schema_path})"), 200)))
            }
        };
        verdict
    }
}

/// Most levels of nesting (objects and arrays) of one tool's parameters
/// schema: far more than a tool's arguments need, and a bound on the
/// recursion of every pass over the schema.
pub const MAX_SCHEMA_DEPTH: usize = 64;

/// Checks a client's schema before jsonschema compiles it: nested at most
/// [`MAX_SCHEMA_DEPTH`] levels, `$ref`s only local JSON pointers
/// (`""`, `"#"`, `"#/…"`) that resolve, and no loop of references that
/// checks the same value again without stepping into it (`{"$ref": "#"}`,
/// `{"allOf": [{"$ref": "#"}]}`, a `$defs` entry referring to itself): a
/// client's schema must not be able to send validation round in circles.
/// A reference below `properties`, `items` and the like steps into the
/// arguments, which are finite: allowed (recursive trees).
fn schema_shape(schema: &Value) -> Result<(), String> {
    fn depth(v: &Value, level: usize) -> Result<(), String> {
        if level > MAX_SCHEMA_DEPTH {
            return Err(format!("nests deeper than {MAX_SCHEMA_DEPTH} levels"));
        }
        match v {
            Value::Object(m) => m.values().try_for_each(|c| depth(c, level + 1)),
            Value::Array(a) => a.iter().try_for_each(|c| depth(c, level + 1)),
            _ => Ok(()),
        }
    }
    depth(schema, 1)?;
    // Every subschema, by JSON pointer, and the subschemas that check the
    // same value (in-place applicators and references).
    let mut all = Vec::new();
    fn walk(v: &Value, at: String, all: &mut Vec<String>) {
        match v {
            Value::Object(m) => {
                all.push(at.clone());
                for (k, c) in m {
                    walk(c, format!("{at}/{}", k.replace('~', "~0").replace('/', "~1")), all);
                }
            }
            Value::Array(a) => a.iter().enumerate().for_each(|(i, c)| walk(c, format!("{at}/{i}"), all)),
            _ => {}
        }
    }
    walk(schema, String::new(), &mut all);
    let same_value = |at: &str| -> Result<Vec<String>, String> {
        let Some(node) = schema.pointer(at).and_then(Value::as_object) else {
            return Ok(Vec::new());
        };
        let mut next = Vec::new();
        for k in ["allOf", "anyOf", "oneOf"] {
            if let Some(a) = node.get(k).and_then(Value::as_array) {
                next.extend((0..a.len()).map(|i| format!("{at}/{k}/{i}")));
            }
        }
        for k in ["not", "if", "then", "else"] {
            if node.contains_key(k) {
                next.push(format!("{at}/{k}"));
            }
        }
        for k in ["$ref", "$dynamicRef", "$recursiveRef"] {
            let Some(r) = node.get(k) else { continue };
            let target = r.as_str().and_then(|r| r.strip_prefix('#').or((r.is_empty()).then_some("")));
            match target {
                Some(t) if t.is_empty() || (t.starts_with('/') && schema.pointer(t).is_some()) => {
                    next.push(t.to_string())
                }
                _ => {
                    return Err(format!(
                        "has {k} {}: only local JSON pointers that resolve (\"#/$defs/…\") are allowed",
                        short(&r.to_string(), 64)
                    ))
                }
            }
        }
        Ok(next)
    };
    // Depth-first search for a cycle over "checks the same value" edges.
    let mut state: std::collections::HashMap<String, u8> = Default::default();
    for start in &all {
        if state.contains_key(start) {
            continue;
        }
        let mut stack = vec![(start.clone(), same_value(start)?, 0usize)];
        state.insert(start.clone(), 1);
        while let Some((node, next, i)) = stack.last_mut() {
            if *i == next.len() {
                state.insert(node.clone(), 2);
                stack.pop();
                continue;
            }
            let n = next[*i].clone();
            *i += 1;
            match state.get(&n) {
                Some(1) => return Err("refers to itself without stepping into the value (a $ref loop)".into()),
                Some(_) => {}
                None => {
                    let more = same_value(&n)?;
                    state.insert(n.clone(), 1);
                    stack.push((n, more, 0));
                }
            }
        }
    }
    Ok(())
}

/// One piece of a tool call, as an engine streams it: the first piece of a
/// call carries its `id` and `name`, every piece a fragment of its JSON
/// `arguments` (possibly empty).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCallDelta {
    /// Which call of the answer (0, 1, … for parallel calls).
    pub index: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default)]
    pub arguments: String,
}

/// A whole tool call of an answer, with the gateway's verdict on it (in
/// the result metadata, `edge.tool_calls`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCall {
    pub index: u32,
    pub id: String,
    pub name: String,
    /// The arguments as the model wrote them (JSON text). Left out of the
    /// stored record when the data policy keeps no answer text.
    #[serde(default)]
    pub arguments: String,
    /// The tool is declared and the arguments match its schema.
    pub valid: bool,
    /// Why not: `unknown_tool`, `invalid_json`, `schema_mismatch` or
    /// `tool_choice_violation` (the request's `tool_choice` or
    /// `parallel_tool_calls: false` forbids this call).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Where the arguments broke the schema, for a person.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_detail: Option<String>,
    /// The application lists the tool in `high_risk_tools`: whoever runs it
    /// should ask a person first.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub requires_confirmation: bool,
}

impl ToolCall {
    /// The call as records, lifecycle events and logs may hold it: the
    /// name made safe ([`safe_name`]), and the arguments (answer text)
    /// left out unless `keep_arguments`.
    pub fn for_record(&self, keep_arguments: bool) -> ToolCall {
        let mut c = self.clone();
        c.name = safe_name(&self.name);
        if !keep_arguments {
            c.arguments.clear();
        }
        c
    }
}

/// A tool name fit for a log line or a record: a valid name as it is;
/// anything else (a model may write any text there) escaped to printable
/// ASCII and cut to [`MAX_TOOL_NAME_LEN`] bytes.
pub fn safe_name(name: &str) -> String {
    if valid_tool_name(name) {
        return name.to_string();
    }
    short(&name.escape_default().to_string(), MAX_TOOL_NAME_LEN)
}

/// Puts streamed [`ToolCallDelta`]s together, call by call.
#[derive(Debug, Clone, Default)]
pub struct ToolCallAssembler {
    calls: Vec<(u32, Option<String>, Option<String>, String)>,
}

impl ToolCallAssembler {
    /// Adds `d`, and returns it as a client should see it: the first piece
    /// of each call carries its id (made up from `id_prefix` when the
    /// engine gave none, as Ollama does) and name, later pieces neither.
    pub fn push(&mut self, mut d: ToolCallDelta, id_prefix: &str) -> ToolCallDelta {
        match self.calls.iter_mut().find(|c| c.0 == d.index) {
            Some(call) => {
                // Some engines repeat the id (or send the name late):
                // keep the first, and tell the client only once.
                if call.1.is_none() {
                    call.1 = d.id.clone();
                }
                if call.2.is_none() {
                    call.2 = d.name.clone();
                } else {
                    d.name = None;
                }
                d.id = None;
                call.3.push_str(&d.arguments);
            }
            None => {
                let id = d.id.clone().unwrap_or_else(|| format!("call_{id_prefix}_{}", d.index));
                d.id = Some(id.clone());
                self.calls.push((d.index, Some(id), d.name.clone(), d.arguments.clone()));
            }
        }
        d
    }

    pub fn is_empty(&self) -> bool {
        self.calls.is_empty()
    }

    /// The calls, in index order, checked against `tools` (every call is
    /// invalid when the request declared none), `high_risk` marking those
    /// that need a person's confirmation.
    pub fn finish(&self, tools: Option<&ToolSet>, high_risk: &[String]) -> Vec<ToolCall> {
        let mut calls: Vec<ToolCall> = self
            .calls
            .iter()
            .map(|(index, id, name, arguments)| {
                let name = name.clone().unwrap_or_default();
                let verdict = match tools {
                    Some(t) => t.check(&name, arguments),
                    None => Err(("unknown_tool", "the request declares no tools".to_string())),
                };
                let (error, error_detail) = match verdict {
                    Ok(()) => (None, None),
                    Err((code, detail)) => (Some(code.to_string()), Some(detail)),
                };
                ToolCall {
                    index: *index,
                    id: id.clone().unwrap_or_default(),
                    requires_confirmation: high_risk.contains(&name),
                    name,
                    arguments: arguments.clone(),
                    valid: error.is_none(),
                    error,
                    error_detail,
                }
            })
            .collect();
        calls.sort_by_key(|c| c.index);
        if let Some(t) = tools {
            for (position, c) in calls.iter_mut().enumerate() {
                if !c.valid {
                    continue;
                }
                if let Err(detail) = t.choice_verdict(position, &c.name) {
                    c.valid = false;
                    c.error = Some("tool_choice_violation".into());
                    c.error_detail = Some(detail);
                }
            }
        }
        calls
    }
}

/// `s` cut to at most `n` bytes (on a character boundary), marked with `…`.
pub fn short(s: &str, n: usize) -> String {
    if s.len() <= n {
        return s.to_string();
    }
    let mut end = n;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn set() -> ToolSet {
        let tools = json!([{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
            {"type": "function", "function": {"name": "ping"}}]);
        ToolSet::parse(Some(&tools), Some(&json!("auto")), None).unwrap().unwrap()
    }

    #[test]
    fn bad_declarations_are_refused_with_the_field() {
        let one = |t: Value| ToolSet::parse(Some(&json!([t])), None, None).unwrap_err();
        assert!(one(json!({"type": "code", "function": {"name": "a"}})).contains("tools[0].type"));
        assert!(one(json!({"type": "function", "function": {"name": "a b"}})).contains("tools[0].function.name"));
        assert!(one(json!({"type": "function", "function": {"name": "x".repeat(65)}})).contains("1..64"));
        assert!(one(json!({"type": "function", "function": {"name": "a", "parameters": {"type": 5}}}))
            .contains("not a usable JSON schema"));
        let two =
            json!([{"type": "function", "function": {"name": "a"}}, {"type": "function", "function": {"name": "a"}}]);
        assert!(ToolSet::parse(Some(&two), None, None).unwrap_err().contains("declared twice"));
        let many: Vec<Value> =
            (0..129).map(|i| json!({"type": "function", "function": {"name": format!("t{i}")}})).collect();
        assert!(ToolSet::parse(Some(&Value::Array(many)), None, None).unwrap_err().contains("at most 128"));
        let choice = json!({"type": "function", "function": {"name": "nope"}});
        assert!(ToolSet::parse(Some(&json!([{"type": "function", "function": {"name": "a"}}])), Some(&choice), None)
            .unwrap_err()
            .contains("does not declare"));
        assert_eq!(ToolSet::parse(None, Some(&json!("auto")), None), Ok(None));
    }

    #[test]
    fn streamed_pieces_assemble_and_are_checked() {
        let mut a = ToolCallAssembler::default();
        let first = a.push(
            ToolCallDelta { index: 0, id: None, name: Some("get_weather".into()), arguments: "{\"ci".into() },
            "t1",
        );
        assert_eq!(first.id.as_deref(), Some("call_t1_0"));
        let later =
            a.push(ToolCallDelta { index: 0, id: Some("x".into()), name: None, arguments: "ty\": 3}".into() }, "t1");
        assert_eq!((later.id, later.name), (None, None));
        a.push(
            ToolCallDelta { index: 1, id: Some("c2".into()), name: Some("launch".into()), arguments: "{}".into() },
            "t1",
        );
        a.push(
            ToolCallDelta { index: 2, id: Some("c3".into()), name: Some("ping".into()), arguments: "".into() },
            "t1",
        );
        let calls = a.finish(Some(&set()), &["ping".to_string()]);
        assert_eq!(calls[0].arguments, "{\"city\": 3}");
        assert_eq!(calls[0].error.as_deref(), Some("schema_mismatch"));
        assert!(calls[0].error_detail.as_deref().unwrap().starts_with("arguments/city"), "{:?}", calls[0]);
        assert_eq!(calls[1].error.as_deref(), Some("unknown_tool"));
        assert!(calls[2].valid && calls[2].requires_confirmation && !calls[0].requires_confirmation);
        assert_eq!(set().check("get_weather", "{\"city\": \"Oslo\"}"), Ok(()));
        assert_eq!(set().check("get_weather", "{\"city\"").unwrap_err().0, "invalid_json");
    }

    /// Review M4: the detail of a verdict is stored and published where the
    /// arguments are not; it names the place and the rule, never a value
    /// or the model's tool name.
    #[test]
    fn verdict_details_hold_no_argument_value_or_model_name() {
        let (code, detail) = set().check("get_weather", r#"{"city": ["Oslo-secret"]}"#).unwrap_err();
        assert_eq!(code, "schema_mismatch");
        assert!(!detail.contains("secret"), "{detail}");
        assert!(detail.starts_with("arguments/city: fails 'type'"), "{detail}");
        let (_, detail) = set().check("get_weather", r#"{"town": "Oslo-secret"}"#).unwrap_err();
        assert!(!detail.contains("secret") && detail.contains("'required'"), "{detail}");
        let (code, detail) = set().check("exfiltrate_secret\n", "{}").unwrap_err();
        assert_eq!(code, "unknown_tool");
        assert!(!detail.contains("secret"), "{detail}");
        let long = format!("bad name\n{}", "x".repeat(500));
        let safe = safe_name(&long);
        assert!(safe.len() <= MAX_TOOL_NAME_LEN + '…'.len_utf8() && !safe.contains('\n'), "{safe}");
        assert_eq!(safe_name("get_weather"), "get_weather");
    }
}
