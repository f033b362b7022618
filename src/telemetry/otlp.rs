//! Optional OTLP export of task spans, when `[log] otlp_endpoint` is set:
//! one span per task (`task`, from its arrival to its end, with its ids,
//! model, instance, state and token counts), sent as OTLP/HTTP with the
//! JSON encoding (`POST {endpoint}/v1/traces`) to a collector (the
//! OpenTelemetry Collector, Jaeger, Tempo all take it on port 4318).
//!
//! Written over reqwest rather than with the `opentelemetry` crates: the
//! OTLP/JSON body is small and stable, and those crates (SDK, exporter,
//! protobuf code) would cost the build more than this whole file.
//!
//! Owns: batching and sending. Spans wait in a bounded queue and go out in
//! batches (up to [`BATCH`] spans, at least once a second); a full queue
//! or a failed send drops spans (counted in
//! `edgeway_otlp_spans_dropped_total`), never slows a task. Does not own:
//! what a span says (the scheduler's driver fills [`TaskSpan`]).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use prometheus::IntCounter;
use serde_json::{json, Value};
use tokio::sync::mpsc;

/// Spans sent in one request at most.
pub const BATCH: usize = 512;
/// Spans waiting to be sent before new ones are dropped.
const QUEUE: usize = 8192;
/// How long a span waits for its batch to fill.
const FLUSH_EVERY: Duration = Duration::from_secs(1);

/// One task, as its span says it.
#[derive(Debug, Clone)]
pub struct TaskSpan {
    pub trace_id: String,
    pub span_id: String,
    /// The caller's span, when it sent a `traceparent`.
    pub parent_span_id: Option<String>,
    pub start: SystemTime,
    pub end: SystemTime,
    /// The OTLP status: an error for a task that did not succeed.
    pub ok: bool,
    /// String attributes (`edgeway.task_id`, …).
    pub attributes: Vec<(&'static str, String)>,
    /// Integer attributes (token counts, attempts).
    pub counts: Vec<(&'static str, i64)>,
}

/// Where spans go; cheap to clone. [`SpanExporter::off`] drops them.
#[derive(Clone, Default)]
pub struct SpanExporter {
    tx: Option<mpsc::Sender<TaskSpan>>,
    dropped: Option<IntCounter>,
}

impl SpanExporter {
    pub fn off() -> SpanExporter {
        SpanExporter::default()
    }

    /// Starts the sender task (on the current runtime), posting to
    /// `{endpoint}/v1/traces` with `node_id` as `service.instance.id`.
    pub fn start(endpoint: &str, node_id: &str, dropped: IntCounter) -> SpanExporter {
        let (tx, rx) = mpsc::channel(QUEUE);
        let url = format!("{}/v1/traces", endpoint.trim_end_matches('/'));
        let client = reqwest::Client::builder().timeout(Duration::from_secs(10)).build().unwrap_or_default();
        tokio::spawn(send_loop(rx, client, url, node_id.to_string(), dropped.clone()));
        SpanExporter { tx: Some(tx), dropped: Some(dropped) }
    }

    pub fn is_on(&self) -> bool {
        self.tx.is_some()
    }

    /// Queues `span`, or drops it (counted) when the queue is full.
    pub fn export(&self, span: TaskSpan) {
        let Some(tx) = &self.tx else { return };
        if tx.try_send(span).is_err() {
            if let Some(d) = &self.dropped {
                d.inc();
            }
        }
    }
}

async fn send_loop(
    mut rx: mpsc::Receiver<TaskSpan>,
    client: reqwest::Client,
    url: String,
    node_id: String,
    dropped: IntCounter,
) {
    let mut last_warned: Option<tokio::time::Instant> = None;
    loop {
        let Some(first) = rx.recv().await else { return };
        let mut batch = vec![first];
        let deadline = tokio::time::Instant::now() + FLUSH_EVERY;
        while batch.len() < BATCH {
            match tokio::time::timeout_at(deadline, rx.recv()).await {
                Ok(Some(s)) => batch.push(s),
                Ok(None) | Err(_) => break,
            }
        }
        let n = batch.len() as u64;
        let body = encode(&batch, &node_id);
        let sent = client.post(&url).json(&body).send().await;
        let failed = match sent {
            Ok(r) if r.status().is_success() => None,
            Ok(r) => Some(format!("collector answered {}", r.status())),
            Err(e) => Some(format!("cannot reach the collector: {e}")),
        };
        if let Some(why) = failed {
            dropped.inc_by(n);
            // Once a minute at most: a collector that is down must not
            // flood the log.
            if last_warned.is_none_or(|t| t.elapsed() >= Duration::from_secs(60)) {
                last_warned = Some(tokio::time::Instant::now());
                tracing::warn!(spans = n, %url, error = %why, "OTLP span export failed; spans dropped");
            }
        }
    }
}

fn unix_nanos(t: SystemTime) -> String {
    t.duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0).to_string()
}

/// The OTLP/JSON `ExportTraceServiceRequest` of `spans` (ids in hex, as
/// the JSON encoding wants; times as decimal strings of Unix nanoseconds).
pub fn encode(spans: &[TaskSpan], node_id: &str) -> Value {
    let spans: Vec<Value> = spans
        .iter()
        .map(|s| {
            let mut attributes: Vec<Value> =
                s.attributes.iter().map(|(k, v)| json!({"key": k, "value": {"stringValue": v}})).collect();
            attributes.extend(s.counts.iter().map(|(k, v)| json!({"key": k, "value": {"intValue": v.to_string()}})));
            let mut span = json!({
                "traceId": s.trace_id,
                "spanId": s.span_id,
                "name": "task",
                // SPAN_KIND_SERVER: edgeway serves the caller's request.
                "kind": 2,
                "startTimeUnixNano": unix_nanos(s.start),
                "endTimeUnixNano": unix_nanos(s.end),
                "attributes": attributes,
                // STATUS_CODE_OK / STATUS_CODE_ERROR.
                "status": {"code": if s.ok { 1 } else { 2 }},
            });
            if let Some(p) = &s.parent_span_id {
                span["parentSpanId"] = p.as_str().into();
            }
            span
        })
        .collect();
    json!({
        "resourceSpans": [{
            "resource": {"attributes": [
                {"key": "service.name", "value": {"stringValue": "edgeway"}},
                {"key": "service.instance.id", "value": {"stringValue": node_id}},
            ]},
            "scopeSpans": [{
                "scope": {"name": "edgeway", "version": env!("CARGO_PKG_VERSION")},
                "spans": spans,
            }],
        }],
    })
}
