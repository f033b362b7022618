//! Task events rendered as JSON: what the message ingresses (MQTT, NATS)
//! and the task API's SSE send, one object per [`TaskEvent`] with a
//! contiguous `seq` from 0. The schemas live in `topics/`; keep them in
//! step with this file.
//!
//! Owns: the event JSON. Does not own: framing or delivery (each ingress).

use serde_json::{json, Value};

use crate::task::TaskEvent;

/// `{"seq": n, "type": …, …}` for one event of `request_id`. The
/// lifecycle events (`accepted`, `queued`, `done`, `error`) carry the
/// task's `trace_id` (when it has one); the pieces of the answer do not.
pub fn event_json(seq: u64, request_id: &str, trace_id: &str, e: &TaskEvent) -> Value {
    let mut v = event_body(seq, request_id, e);
    if !trace_id.is_empty()
        && matches!(
            e,
            TaskEvent::Accepted { .. } | TaskEvent::Queued { .. } | TaskEvent::Done(_) | TaskEvent::Error { .. }
        )
    {
        v["trace_id"] = trace_id.into();
    }
    v
}

fn event_body(seq: u64, request_id: &str, e: &TaskEvent) -> Value {
    match e {
        TaskEvent::Accepted { task_id, queue_position } => json!({
            "seq": seq, "type": "accepted", "request_id": request_id,
            "task_id": task_id, "queue_position": queue_position,
        }),
        TaskEvent::Queued { position, loading_ms } => {
            let mut v = json!({ "seq": seq, "type": "queued", "request_id": request_id, "position": position });
            if let Some(ms) = loading_ms {
                v["reason"] = "loading".into();
                v["loading_ms"] = (*ms).into();
            }
            v
        }
        TaskEvent::Delta { text } => json!({ "seq": seq, "type": "delta", "request_id": request_id, "text": text }),
        // The first piece of each call carries `id` and `name`; every piece
        // a fragment of the JSON `arguments`, to be concatenated by `index`.
        TaskEvent::ToolCallDelta(d) => {
            let mut v = json!({
                "seq": seq, "type": "tool_call", "request_id": request_id,
                "index": d.index, "arguments": d.arguments,
            });
            if let Some(id) = &d.id {
                v["id"] = id.as_str().into();
            }
            if let Some(name) = &d.name {
                v["name"] = name.as_str().into();
            }
            v
        }
        // Only embedding tasks (`POST /v1/embeddings`) have them; the task
        // API's event stream shows them like any other event.
        TaskEvent::Embedding { index, vector } => json!({
            "seq": seq, "type": "embedding", "request_id": request_id, "index": index, "embedding": vector,
        }),
        TaskEvent::Done(meta) => json!({
            "seq": seq, "type": "done", "request_id": request_id,
            "result": serde_json::to_value(&**meta).unwrap_or(Value::Null),
        }),
        TaskEvent::Error { error, meta } => {
            let mut v = json!({
                "seq": seq, "type": "error", "request_id": request_id,
                "code": error.code.as_str(), "message": error.message,
                "retryable": error.code.retryable(),
                "result": serde_json::to_value(&**meta).unwrap_or(Value::Null),
            });
            if let Some(ms) = error.retry_after_ms {
                v["retry_after_ms"] = ms.into();
            }
            if let Some(at) = &error.resets_at {
                v["resets_at"] = at.as_str().into();
            }
            if error.partial {
                v["partial"] = true.into();
            }
            v
        }
    }
}

/// One event of a compact MQTT stream (topics/README.md "Compact
/// streams"): the `seq` in decimal, then for a delta `:` and its text as
/// it is, for any other event the JSON object of [`event_json`] without
/// `seq`, `request_id` (but for `accepted`, which ties the stream id to
/// the request) and `trace_id`; `done` carries `finish_reason` and `usage`
/// instead of the whole result, `error` no result (both are in the task's
/// record).
pub fn compact_event(seq: u64, request_id: &str, e: &TaskEvent) -> Vec<u8> {
    let mut out = seq.to_string().into_bytes();
    if let TaskEvent::Delta { text } = e {
        out.push(b':');
        out.extend_from_slice(text.as_bytes());
        return out;
    }
    let mut v = event_body(seq, request_id, e);
    if let Some(o) = v.as_object_mut() {
        o.remove("seq");
        if !matches!(e, TaskEvent::Accepted { .. }) {
            o.remove("request_id");
        }
        o.remove("result");
    }
    if let TaskEvent::Done(meta) = e {
        v["finish_reason"] = meta.finish_reason.clone().into();
        v["usage"] = serde_json::to_value(meta.usage).unwrap_or(Value::Null);
        if meta.text_not_kept {
            v["text_not_kept"] = true.into();
        }
    }
    out.extend_from_slice(v.to_string().as_bytes());
    out
}

/// An `error` event for a request that never became a task (bad input,
/// refused at admission): it is the whole stream, so its `seq` is 0.
pub fn rejection_json(request_id: Option<&str>, e: &crate::error::GatewayError) -> Value {
    let mut v = json!({
        "seq": 0, "type": "error", "request_id": request_id,
        "code": e.code.as_str(), "message": e.message, "retryable": e.code.retryable(),
    });
    if let Some(ms) = e.retry_after_ms {
        v["retry_after_ms"] = ms.into();
    }
    if let Some(at) = &e.resets_at {
        v["resets_at"] = at.as_str().into();
    }
    v
}

/// The SSE comment the OpenAI-style streams send for a `queued` event (the
/// SDKs skip comments; it shows the wait and keeps idle-closing proxies
/// from dropping the stream).
pub fn queued_comment(position: usize, loading_ms: Option<u64>) -> String {
    match loading_ms {
        Some(ms) => format!(": queued position {position} (model loading, {ms} ms so far)\n\n"),
        None => format!(": queued position {position}\n\n"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::GatewayError;
    use crate::task::{ResultMeta, TaskState};

    #[test]
    fn compact_events_carry_the_seq_and_only_accepted_names_the_request() {
        let text = |b: Vec<u8>| String::from_utf8(b).unwrap();
        let delta = TaskEvent::Delta { text: "a \"quoted\"\nline".into() };
        assert_eq!(text(compact_event(12, "r1", &delta)), "12:a \"quoted\"\nline");
        let accepted = TaskEvent::Accepted { task_id: "t1".into(), queue_position: 0 };
        let v: Value = serde_json::from_str(&text(compact_event(0, "r1", &accepted))[1..]).unwrap();
        assert_eq!(v, json!({"type": "accepted", "request_id": "r1", "task_id": "t1", "queue_position": 0}));
        let mut meta = ResultMeta::bare("r1", "t1", TaskState::Succeeded, "m", "n");
        meta.finish_reason = Some("stop".into());
        let done = text(compact_event(3, "r1", &TaskEvent::Done(Box::new(meta.clone()))));
        let v: Value = serde_json::from_str(done.strip_prefix('3').unwrap()).unwrap();
        assert_eq!(v["type"], "done");
        assert_eq!(v["finish_reason"], "stop");
        assert_eq!(v["usage"]["output_tokens"], 0);
        assert!(v.get("result").is_none() && v.get("request_id").is_none() && v.get("seq").is_none());
        let error = TaskEvent::Error { error: GatewayError::internal("boom"), meta: Box::new(meta) };
        let v: Value = serde_json::from_str(&text(compact_event(4, "r1", &error))[1..]).unwrap();
        assert_eq!((&v["code"], &v["message"]), (&json!("INTERNAL_ERROR"), &json!("boom")));
        assert!(v.get("result").is_none() && v.get("request_id").is_none());
    }
}
