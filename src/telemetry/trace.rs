//! Trace ids: the one `trace_id` that joins a task's `request_id`,
//! `task_id` and `session_id` across ingresses, the store, lifecycle events,
//! logs and the engines it calls.
//!
//! Owns: the W3C Trace Context forms (`traceparent`, version `00`): reading
//! a caller's header or field, making a new id when there is none (or it is
//! not valid: a bad trace header is never an error, W3C says to start a new
//! trace), and the `traceparent` of each engine call (same trace id, a new
//! span id per call). Does not own: where each ingress finds it (the
//! ingresses), or where it is stored and published (store, recorder).

/// A trace id: 32 lowercase hex digits, not all zero.
pub fn valid_trace_id(s: &str) -> bool {
    s.len() == 32 && is_lower_hex(s) && s.bytes().any(|b| b != b'0')
}

fn is_lower_hex(s: &str) -> bool {
    s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// The trace id and parent span id of a W3C `traceparent` header
/// (`00-<trace id>-<parent span id>-<flags>`), if it is a valid one.
/// Versions above `00` may append fields (`-…`), which are ignored, as the
/// specification asks; version `ff` is invalid.
pub fn parse_traceparent(header: &str) -> Option<(String, String)> {
    let h = header.trim();
    let mut parts = h.split('-');
    let version = parts.next()?;
    let trace_id = parts.next()?;
    let span_id = parts.next()?;
    let flags = parts.next()?;
    let rest = parts.next();
    if version.len() != 2 || !is_lower_hex(version) || version == "ff" {
        return None;
    }
    if version == "00" && rest.is_some() {
        return None;
    }
    let span_ok = span_id.len() == 16 && is_lower_hex(span_id) && span_id.bytes().any(|b| b != b'0');
    if !valid_trace_id(trace_id) || !span_ok || flags.len() != 2 || !is_lower_hex(flags) {
        return None;
    }
    Some((trace_id.to_string(), span_id.to_string()))
}

/// The trace id a caller sent, in the order its carriers are trusted: a
/// `traceparent` (header or MQTT v5 user property), then a bare `trace_id`
/// (a request field, or `metadata.trace_id`). Invalid ones are skipped; a
/// new id when none is valid. With the caller's span when the id came
/// from a `traceparent`.
pub fn pick(traceparent: Option<&str>, fields: &[Option<&str>]) -> (String, Option<String>) {
    if let Some((trace, span)) = traceparent.and_then(parse_traceparent) {
        return (trace, Some(span));
    }
    let field = fields.iter().flatten().map(|s| s.trim()).find(|s| valid_trace_id(s)).map(str::to_string);
    (field.unwrap_or_else(new_trace_id), None)
}

/// The span around a task's work (admission, queueing, dispatch, the
/// engine calls): every log line inside it carries `trace_id`, `task_id`
/// and `request_id` (JSON logs: in `span` and `spans`). A root span, so a
/// task's lines do not inherit the span of whatever started it.
pub fn task_span(trace_id: &str, task_id: Option<&str>, request_id: Option<&str>) -> tracing::Span {
    let span = tracing::info_span!(
        parent: None,
        "task",
        trace_id = %trace_id,
        task_id = tracing::field::Empty,
        request_id = tracing::field::Empty
    );
    if let Some(t) = task_id {
        span.record("task_id", t);
    }
    if let Some(r) = request_id {
        span.record("request_id", r);
    }
    span
}

/// Whether task `task_id` falls in a sample of `rate` (0..=1): decided by
/// a digest of its id, so the same task is always in or out. (Not by the
/// id's own bits: UUIDv7's low bits hold a counter, not uniform noise.)
pub fn sampled(task_id: &str, rate: f64) -> bool {
    use sha2::{Digest, Sha256};
    let d = Sha256::digest(task_id.as_bytes());
    let x = u64::from_be_bytes(d[..8].try_into().expect("8 bytes"));
    (x as f64) < rate * u64::MAX as f64
}

/// A new random trace id (UUIDv4 bits: 122 random, never all zero).
pub fn new_trace_id() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

/// A new random span id: 16 hex digits, never all zero.
pub fn new_span_id() -> String {
    let mut id = uuid::Uuid::new_v4().simple().to_string();
    id.truncate(16);
    if id.bytes().all(|b| b == b'0') {
        id.replace_range(15..16, "1");
    }
    id
}

/// The `traceparent` of the engine calls of a task: its trace id and its
/// own span (`span_id`, a new one, not the caller's), so that an engine's
/// spans hang under the task's; sampled flag set (the caller's sampling
/// decision is not kept; engines that trace want the call).
pub fn child_traceparent(trace_id: &str, span_id: &str) -> String {
    format!("00-{trace_id}-{span_id}-01")
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";

    #[test]
    fn a_valid_traceparent_gives_its_trace_id() {
        let ids = Some((ID.to_string(), "00f067aa0ba902b7".to_string()));
        assert_eq!(parse_traceparent(&format!("00-{ID}-00f067aa0ba902b7-01")), ids);
        // A later version may add fields.
        assert_eq!(parse_traceparent(&format!("01-{ID}-00f067aa0ba902b7-01-extra")), ids);
    }

    #[test]
    fn an_invalid_traceparent_is_ignored() {
        for bad in [
            String::new(),
            "garbage".into(),
            format!("00-{}-00f067aa0ba902b7-01", "0".repeat(32)),
            format!("00-{ID}-0000000000000000-01"),
            format!("00-{}-00f067aa0ba902b7-01", ID.to_uppercase()),
            format!("ff-{ID}-00f067aa0ba902b7-01"),
            format!("00-{ID}-00f067aa0ba902b7-01-extra"),
            format!("00-{ID}-00f067aa0ba902b7"),
            format!("00-{}-00f067aa0ba902b7-01", &ID[1..]),
        ] {
            assert_eq!(parse_traceparent(&bad), None, "{bad}");
        }
    }

    #[test]
    fn pick_prefers_the_header_then_fields_then_a_new_id() {
        let header = format!("00-{ID}-00f067aa0ba902b7-01");
        let other = "0af7651916cd43dd8448eb211c80319c";
        assert_eq!(pick(Some(&header), &[Some(other)]), (ID.to_string(), Some("00f067aa0ba902b7".to_string())));
        assert_eq!(pick(Some("bad"), &[Some("nope"), Some(other)]), (other.to_string(), None));
        let (fresh, parent) = pick(None, &[Some("nope")]);
        assert!(valid_trace_id(&fresh) && fresh != ID && fresh != other && parent.is_none());
        assert_ne!(fresh, pick(None, &[]).0);
    }

    #[test]
    fn sampling_follows_the_rate() {
        let ids: Vec<String> = (0..4000).map(|_| crate::task::new_task_id()).collect();
        for rate in [0.1, 0.5] {
            let n = ids.iter().filter(|id| sampled(id, rate)).count() as f64 / ids.len() as f64;
            assert!((n - rate).abs() < 0.05, "rate {rate}: {n}");
        }
        assert!(ids.iter().all(|id| sampled(id, 1.0)));
        assert!(!ids.iter().any(|id| sampled(id, 0.0)));
    }

    #[test]
    fn an_engine_call_gets_the_same_trace_and_the_tasks_span() {
        let (a, b) = (new_span_id(), new_span_id());
        assert_ne!(a, b);
        let tp = child_traceparent(ID, &a);
        assert_eq!(parse_traceparent(&tp), Some((ID.to_string(), a)));
        assert!(tp.starts_with("00-") && tp.ends_with("-01"));
    }
}
