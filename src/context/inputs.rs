//! What a call brings for its prompt beside its messages: the request's
//! `edge.context` object (the same on HTTP, MQTT and NATS, since they share
//! the request body) with knowledge passages, tool results and the session
//! memory entries to retrieve.
//!
//! ```json
//! "edge": {"context": {
//!   "knowledge":    [{"text": "…", "source": "wiki/pumps", "relevance": 0.8}],
//!   "tool_results": [{"text": "…", "source": "get_weather"}],
//!   "memory":       {"keys": ["plant"], "tags": ["prefs"]}
//! }}
//! ```
//!
//! Owns: the shape, its limits and their errors (`INVALID_REQUEST` naming
//! the field). Does not own: what becomes of the content (untrusted data,
//! fenced and filtered by `super::fence`, budgeted by `super::assembly`).

use serde::Deserialize;
use serde_json::Value;

use crate::error::GatewayError;

/// Passages of one kind a request may bring.
pub const MAX_PASSAGES: usize = 64;
/// Bytes of one passage's text.
pub const MAX_PASSAGE_BYTES: usize = 64 * 1024;
const MAX_SOURCE_BYTES: usize = 256;
/// Keys and tags of a memory query.
const MAX_MEMORY_NAMES: usize = 32;

/// The request's `edge` object: only `context` is read today, and anything
/// else in it is refused (so a misspelt key is not silently ignored).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Edge {
    #[serde(default)]
    context: Option<ContextRequest>,
}

/// `edge.context`.
#[derive(Debug, Default, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ContextRequest {
    #[serde(default)]
    pub knowledge: Vec<Passage>,
    #[serde(default)]
    pub tool_results: Vec<Passage>,
    /// Memory entries of the call's session to put into the prompt.
    #[serde(default)]
    pub memory: Option<MemoryQuery>,
}

/// A knowledge passage or a tool result as the request gives it.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Passage {
    pub text: String,
    /// Where it comes from (a document, a tool); `request` when not said.
    #[serde(default)]
    pub source: Option<String>,
    /// Higher is more relevant; passages without one are the least.
    #[serde(default)]
    pub relevance: Option<f64>,
}

/// `edge.context.memory`: entries by key, and entries carrying a tag.
#[derive(Debug, Default, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemoryQuery {
    #[serde(default)]
    pub keys: Vec<String>,
    #[serde(default)]
    pub tags: Vec<String>,
}

impl ContextRequest {
    pub fn is_empty(&self) -> bool {
        self.knowledge.is_empty()
            && self.tool_results.is_empty()
            && self.memory.as_ref().is_none_or(|m| m.keys.is_empty() && m.tags.is_empty())
    }
}

/// Reads a request's `edge` value (absent or null: nothing).
pub fn parse(edge: Option<&Value>) -> Result<Option<ContextRequest>, GatewayError> {
    let Some(edge) = edge.filter(|v| !v.is_null()) else { return Ok(None) };
    let edge: Edge = serde_path_to_error::deserialize(edge).map_err(|e| {
        let path = e.path().to_string();
        let at = if path == "." { "edge".to_string() } else { format!("edge.{path}") };
        GatewayError::invalid(format!("invalid field '{at}': {}", e.into_inner()))
    })?;
    let Some(ctx) = edge.context else { return Ok(None) };
    for (kind, list) in [("knowledge", &ctx.knowledge), ("tool_results", &ctx.tool_results)] {
        if list.len() > MAX_PASSAGES {
            return Err(GatewayError::invalid(format!("'edge.context.{kind}' holds at most {MAX_PASSAGES} entries")));
        }
        for (i, p) in list.iter().enumerate() {
            let at = format!("edge.context.{kind}[{i}]");
            if p.text.len() > MAX_PASSAGE_BYTES {
                return Err(GatewayError::invalid(format!("'{at}.text' is longer than {MAX_PASSAGE_BYTES} bytes")));
            }
            if p.source.as_ref().is_some_and(|s| s.is_empty() || s.len() > MAX_SOURCE_BYTES) {
                return Err(GatewayError::invalid(format!("'{at}.source' must be 1..{MAX_SOURCE_BYTES} bytes")));
            }
            if p.relevance.is_some_and(|r| !r.is_finite()) {
                return Err(GatewayError::invalid(format!("'{at}.relevance' must be a finite number")));
            }
        }
    }
    if let Some(m) = &ctx.memory {
        if m.keys.len() + m.tags.len() > MAX_MEMORY_NAMES {
            return Err(GatewayError::invalid(format!(
                "'edge.context.memory' names at most {MAX_MEMORY_NAMES} keys and tags"
            )));
        }
    }
    Ok(Some(ctx).filter(|c| !c.is_empty()))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn reads_the_three_inputs_and_refuses_what_it_does_not_know() {
        let v = json!({"context": {"knowledge": [{"text": "k", "source": "doc", "relevance": 0.5}],
                                    "tool_results": [{"text": "t"}], "memory": {"keys": ["a"]}}});
        let c = parse(Some(&v)).unwrap().unwrap();
        assert_eq!(c.knowledge[0].relevance, Some(0.5));
        assert_eq!(c.tool_results[0].source, None);
        assert_eq!(c.memory.unwrap().keys, vec!["a"]);
        assert_eq!(parse(None).unwrap(), None);
        assert_eq!(parse(Some(&json!({"context": {}}))).unwrap(), None);
        let e = parse(Some(&json!({"context": {"knowledge": [{"txt": "k"}]}}))).unwrap_err();
        assert!(e.message.contains("edge.context.knowledge[0]"), "{}", e.message);
        let e = parse(Some(&json!({"contxt": {}}))).unwrap_err();
        assert!(e.message.contains("'edge.contxt'"), "{}", e.message);
        let many: Vec<Value> = (0..=MAX_PASSAGES).map(|_| json!({"text": "x"})).collect();
        assert!(parse(Some(&json!({"context": {"knowledge": many}}))).is_err());
    }
}
