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

/// A compact stream's seq is written on every message that is not a delta,
/// on the first message each sender publishes, and on every delta whose
/// seq is a multiple of this (topics/README.md "Compact streams"): a
/// device counts the others, and a written seq it did not count shows a
/// loss within at most this many messages.
pub const COMPACT_SEQ_EVERY: u64 = 16;

/// The body of one event of a compact MQTT stream (topics/README.md
/// "Compact streams"), without its `seq` (the sender writes it, or leaves
/// it to be counted: [`compact_wire`]):
/// - a delta: `:` and its text as it is;
/// - `accepted`: `+` and the request id (the one message that names the
///   request), then ` ` and the queue position when it is not 0;
/// - `done`: `.`, the finish reason (`-` for none), ` ` input tokens,
///   ` ` output tokens, then ` estimated` and ` text_not_kept` when set
///   (the whole result is in the task's record);
/// - any other event: the JSON object of [`event_json`] without `seq`,
///   `request_id`, `trace_id` and `result`.
pub fn compact_body(request_id: &str, e: &TaskEvent) -> Vec<u8> {
    match e {
        TaskEvent::Delta { text } => {
            let mut out = Vec::with_capacity(1 + text.len());
            out.push(b':');
            out.extend_from_slice(text.as_bytes());
            out
        }
        TaskEvent::Accepted { queue_position, .. } => match queue_position {
            0 => format!("+{request_id}").into_bytes(),
            n => format!("+{request_id} {n}").into_bytes(),
        },
        TaskEvent::Done(meta) => {
            let u = meta.usage;
            let mut out = format!(
                ".{} {} {}",
                meta.finish_reason.as_deref().filter(|r| !r.is_empty() && !r.contains(' ')).unwrap_or("-"),
                u.input_tokens,
                u.output_tokens
            );
            if u.estimated {
                out.push_str(" estimated");
            }
            if meta.text_not_kept {
                out.push_str(" text_not_kept");
            }
            out.into_bytes()
        }
        _ => {
            let mut v = event_body(0, request_id, e);
            if let Some(o) = v.as_object_mut() {
                o.remove("seq");
                o.remove("request_id");
                o.remove("result");
            }
            v.to_string().into_bytes()
        }
    }
}

/// What a compact stream's sender publishes for message `seq` of body
/// `body` ([`compact_body`]); `first`: the first message this sender
/// publishes. The seq is written (in decimal, before the body) on the
/// first message, on anything but a delta and every
/// [`COMPACT_SEQ_EVERY`]th delta; a delta without it drops its `:` too
/// unless its text starts with a digit or `:` (which would read as a seq or
/// as the marker).
pub fn compact_wire(seq: u64, body: &bytes::Bytes, first: bool) -> bytes::Bytes {
    let delta = body.first() == Some(&b':');
    if first || !delta || seq % COMPACT_SEQ_EVERY == 0 {
        let mut out = Vec::with_capacity(20 + body.len());
        out.extend_from_slice(seq.to_string().as_bytes());
        out.extend_from_slice(body);
        return out.into();
    }
    match body.get(1) {
        Some(c) if !c.is_ascii_digit() && *c != b':' => body.slice(1..),
        _ => body.clone(),
    }
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
    use bytes::Bytes;

    #[test]
    fn compact_bodies_are_minimal_and_only_accepted_names_the_request() {
        let text = |b: Vec<u8>| String::from_utf8(b).unwrap();
        let delta = TaskEvent::Delta { text: "a \"quoted\"\nline".into() };
        assert_eq!(text(compact_body("r1", &delta)), ":a \"quoted\"\nline");
        let accepted = TaskEvent::Accepted { task_id: "t1".into(), queue_position: 0 };
        assert_eq!(text(compact_body("r1", &accepted)), "+r1");
        let queued = TaskEvent::Accepted { task_id: "t1".into(), queue_position: 3 };
        assert_eq!(text(compact_body("r1", &queued)), "+r1 3");
        let mut meta = ResultMeta::bare("r1", "t1", TaskState::Succeeded, "m", "n");
        meta.finish_reason = Some("stop".into());
        meta.usage.input_tokens = 12;
        meta.usage.output_tokens = 256;
        assert_eq!(text(compact_body("r1", &TaskEvent::Done(Box::new(meta.clone())))), ".stop 12 256");
        let mut odd = meta.clone();
        (odd.finish_reason, odd.usage.estimated, odd.text_not_kept) = (None, true, true);
        assert_eq!(text(compact_body("r1", &TaskEvent::Done(Box::new(odd)))), ".- 12 256 estimated text_not_kept");
        let error = TaskEvent::Error { error: GatewayError::internal("boom"), meta: Box::new(meta) };
        let v: Value = serde_json::from_slice(&compact_body("r1", &error)).unwrap();
        assert_eq!(
            (&v["type"], &v["code"], &v["message"]),
            (&json!("error"), &json!("INTERNAL_ERROR"), &json!("boom"))
        );
        assert!(v.get("result").is_none() && v.get("request_id").is_none() && v.get("seq").is_none());
    }

    #[test]
    fn a_compact_sender_writes_the_seq_where_a_device_could_not_count_it() {
        let wire = |seq, body: &str, first| {
            String::from_utf8(compact_wire(seq, &Bytes::from(body.to_string()), first).to_vec()).unwrap()
        };
        // First of a sender, not a delta, every 16th delta: written.
        assert_eq!(wire(5, ":text", true), "5:text");
        assert_eq!(wire(0, "+r1", false), "0+r1");
        assert_eq!(wire(9, ".stop 1 2", false), "9.stop 1 2");
        assert_eq!(wire(4, "{\"type\":\"queued\"}", false), "4{\"type\":\"queued\"}");
        assert_eq!(wire(32, ": the", false), "32: the");
        // Otherwise counted: the marker goes too unless the text could
        // read as a seq or as the marker.
        assert_eq!(wire(5, ": the", false), " the");
        assert_eq!(wire(5, ":{x}.+", false), "{x}.+");
        assert_eq!(wire(5, ":42 is", false), ":42 is");
        assert_eq!(wire(5, "::x", false), "::x");
        assert_eq!(wire(5, ":", false), ":");
    }
}
