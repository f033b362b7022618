//! The status page and its data: `GET /admin/status` (one JSON snapshot),
//! `GET /admin/status/stream` (the same as server-sent events, one a
//! second), `GET /status` (a self-contained HTML page that shows them
//! live) and `DELETE /admin/tasks/{id}` (the page's cancel button). Also
//! the text form of a snapshot that `edgeway status` prints.
//!
//! The page needs an admin application's key, like the JSON it reads. The
//! browser keeps it in `sessionStorage` (gone with the tab, never in a URL
//! or a cookie, so no request from another site carries it) and sends it
//! as `Authorization: Bearer` from `fetch()`; the stream is read with
//! `fetch()` streaming, since `EventSource` cannot send a header. The page
//! itself holds no data and is served to anyone who reaches the route.
//!
//! Owns: these routes, the page asset (`status.html`: no external script,
//! style or font; works offline) and the text rendering. Does not own:
//! what a snapshot holds (the gateway's status view) or the cancel
//! (the facade's, as for `DELETE /v1/tasks/{id}`).

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde_json::Value;

use super::caller::{Caller, Credential};
use super::errors::ApiError;
use super::ws::Shutdown;
use crate::error::{ErrorCode, GatewayError};
use crate::gateway::Gateway;

/// The page, compiled in.
const PAGE: &str = include_str!("status.html");

/// How often the stream sends a snapshot.
pub const STREAM_PERIOD: Duration = Duration::from_secs(1);

/// `GET /admin/status`: the snapshot as JSON (admin applications only).
pub async fn json(State(gw): State<Arc<Gateway>>, Caller(who): Caller) -> Result<Response, ApiError> {
    let s = gw.status(&who).await?;
    let mut resp = Json(s).into_response();
    resp.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    Ok(resp)
}

/// `GET /v1/nodes`: the node pool (admin applications only): this node
/// first (`"self": true`), then the other nodes of the registry.
pub async fn nodes(State(gw): State<Arc<Gateway>>, Caller(who): Caller) -> Result<Response, ApiError> {
    let nodes = gw.nodes(&who).await?;
    let mut resp = Json(serde_json::json!({ "object": "list", "data": nodes })).into_response();
    resp.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    Ok(resp)
}

/// `GET /admin/status/stream`: a `status` event with the snapshot at once
/// and then every [`STREAM_PERIOD`], until the client goes, the server
/// stops, or the credential that opened it no longer opens it (revoked,
/// removed or no longer an admin's at a reload, expired).
pub async fn stream(
    State(gw): State<Arc<Gateway>>,
    Caller(who): Caller,
    Credential(credential): Credential,
    Extension(Shutdown(shutdown)): Extension<Shutdown>,
) -> Result<Response, ApiError> {
    // Refused before the stream starts: a plain error body.
    let first = gw.status(&who).await?;
    // The first snapshot goes at once; the next one a period later (a
    // plain `interval` would tick at once again).
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + STREAM_PERIOD, STREAM_PERIOD);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let state = (gw, who, tick, shutdown, Some(first));
    let body = futures::stream::unfold(state, move |(gw, who, mut tick, shutdown, first)| {
        let credential = credential.clone();
        async move {
            let (who, snapshot) = match first {
                Some(s) => (who, s),
                None => {
                    tokio::select! {
                        _ = shutdown.cancelled() => return None,
                        _ = tick.tick() => {}
                    }
                    // The credential is judged again at each snapshot, as a
                    // new call would be: a key revoked or removed at reload,
                    // an application that lost `admin` or moved tenant, an
                    // expired token: the stream ends.
                    let now = gw.authenticate(credential.as_deref()).ok()?;
                    if !now.is_admin || now.tenant != who.tenant {
                        return None;
                    }
                    let s = gw.status(&now).await.ok()?;
                    (now, s)
                }
            };
            let data = serde_json::to_string(&snapshot).ok()?;
            let frame = Bytes::from(format!("event: status\ndata: {data}\n\n"));
            Some((Ok::<_, std::convert::Infallible>(frame), (gw, who, tick, shutdown, None)))
        }
    });
    let mut resp = Response::new(Body::from_stream(body));
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    Ok(resp)
}

/// The page's content policy: of scripts, only the page's own inline one,
/// named by its digest (review 15 L7: `'unsafe-inline'` would also run a
/// script that markup injected into the page brought along); its inline
/// style; connections to this origin only; no frames, no forms.
pub fn page_csp() -> &'static str {
    static CSP: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    CSP.get_or_init(|| {
        format!(
            "default-src 'none'; script-src '{}'; style-src 'unsafe-inline'; \
             connect-src 'self'; img-src data:; frame-ancestors 'none'; form-action 'none'",
            script_hash(PAGE)
        )
    })
}

/// The CSP source (`sha256-<base64>`) of the one inline script of `page`:
/// the digest of the exact text between `<script>` and `</script>`, as the
/// browser hashes it.
fn script_hash(page: &str) -> String {
    use base64::Engine as _;
    use sha2::{Digest, Sha256};
    let start = page.find("<script>").expect("the page has an inline script") + "<script>".len();
    let len = page[start..].find("</script>").expect("the page's script ends");
    let digest = Sha256::digest(&page.as_bytes()[start..start + len]);
    format!("sha256-{}", base64::engine::general_purpose::STANDARD.encode(digest))
}

/// `GET /status`: the page, under [`page_csp`].
pub async fn page() -> Response {
    let mut resp = ([(header::CONTENT_TYPE, "text/html; charset=utf-8")], PAGE).into_response();
    let h = resp.headers_mut();
    h.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(page_csp()));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    resp
}

/// `DELETE /admin/tasks/{id}`: the page's cancel button. The facade's
/// cancel, as `DELETE /v1/tasks/{id}` (same answers), for admin
/// applications only: the page lives on the admin routes, which on
/// `admin_listen` are another origin than `/v1`.
pub async fn cancel(
    State(gw): State<Arc<Gateway>>,
    Caller(who): Caller,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    if !who.is_admin {
        return Err(GatewayError::new(ErrorCode::PermissionDenied, "admin applications only").into());
    }
    super::tasks::cancel_as(&gw, &who, &id, "cancelled by an operator (DELETE /admin/tasks)").await
}

/// The text form of a `/admin/status` snapshot, for a terminal.
pub fn render_text(v: &Value) -> String {
    let mut o = String::new();
    // Model names, task ids and failure reasons are callers' text: no
    // control character (an ANSI escape, a carriage return) reaches the
    // operator's terminal (review 15 L1).
    let s = |v: &Value| match v {
        Value::String(s) => s.chars().map(|c| if c.is_control() { '\u{fffd}' } else { c }).collect(),
        Value::Null => "-".to_string(),
        v => v.to_string(),
    };
    let _ = writeln!(
        o,
        "edgeway {}  up {}s  config {}  store {}  degradation level {}{}",
        s(&v["node_id"]),
        s(&v["uptime_s"]),
        s(&v["config_version"]).chars().take(12).collect::<String>(),
        s(&v["store"]),
        s(&v["degradation_level"]),
        if v["draining"] == Value::Bool(true) { "  DRAINING" } else { "" },
    );
    let _ = writeln!(o, "\nQUEUES");
    for q in v["queues"].as_array().into_iter().flatten() {
        let by: Vec<String> =
            q["by_priority"].as_object().into_iter().flatten().map(|(p, n)| format!("{p}={n}")).collect();
        let _ =
            writeln!(o, "  {:<24} {:>4} / {:<5} {}", s(&q["model"]), s(&q["waiting"]), s(&q["capacity"]), by.join(" "));
    }
    let _ = writeln!(o, "\nENGINES");
    for e in v["engines"].as_array().into_iter().flatten() {
        let kv = e["kv_cache_usage"].as_f64().map_or("-".to_string(), |u| format!("{:.0}%", u * 100.0));
        let _ = writeln!(
            o,
            "  {:<24} {:<5} running {}/{}  breaker {}  residency {}  kv {}  {}",
            s(&e["name"]),
            if e["up"] == Value::Bool(true) { "up" } else { "DOWN" },
            s(&e["running"]),
            s(&e["max_concurrency"]),
            s(&e["breaker"]),
            s(&e["residency"]),
            kv,
            s(&e["detail"]),
        );
    }
    let _ = writeln!(o, "\nTASKS ({} live)", s(&v["tasks_total"]));
    for t in v["tasks"].as_array().into_iter().flatten() {
        let age = t["age_ms"].as_u64().unwrap_or(0) as f64 / 1000.0;
        let _ = writeln!(
            o,
            "  {}  {:<11} {:<4} {:<5} {:<16} {:<20} age {:>6.1}s  tokens {}",
            s(&t["task_id"]),
            s(&t["state"]),
            s(&t["priority"]),
            s(&t["ingress"]),
            s(&t["application"]),
            s(&t["model"]),
            age,
            s(&t["tokens"]),
        );
    }
    match &v["devices"] {
        Value::Null => {
            let _ = writeln!(o, "\nDEVICES  (MQTT off)");
        }
        d => {
            let ids: Vec<String> = d["ids"].as_array().into_iter().flatten().map(&s).collect();
            let _ = writeln!(o, "\nDEVICES  {} connected  {}", s(&d["connected"]), ids.join(" "));
        }
    }
    let _ = writeln!(o, "\nRECENT FAILURES");
    for f in v["failures"].as_array().into_iter().flatten().take(10) {
        let _ = writeln!(
            o,
            "  {}  {:<20} {:<10} {:<16} {}  {}",
            s(&f["task_id"]),
            s(&f["code"]),
            s(&f["state"]),
            s(&f["application"]),
            s(&f["logical_model"]),
            s(&f["reason"]),
        );
    }
    let _ = writeln!(o, "\nTRAFFIC (per 10 s, oldest first)");
    let buckets: Vec<&Value> = v["traffic"].as_array().into_iter().flatten().collect();
    let ended: Vec<String> = buckets.iter().map(|b| s(&b["finished"])).collect();
    let failed: Vec<String> = buckets.iter().map(|b| s(&b["failed"])).collect();
    let ttft: Vec<String> =
        buckets.iter().map(|b| b["ttft_mean_ms"].as_f64().map_or("-".to_string(), |t| format!("{t:.0}"))).collect();
    let _ = writeln!(o, "  ended      {}", ended.join(" "));
    let _ = writeln!(o, "  failed     {}", failed.join(" "));
    let _ = writeln!(o, "  ttft ms    {}", ttft.join(" "));
    o
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    #[test]
    fn callers_text_reaches_the_terminal_without_control_characters() {
        let v = json!({
            "queues": [{"model": "m\u{1b}[2J", "waiting": 0, "capacity": 1, "by_priority": {}}],
            "failures": [{"task_id": "t", "code": "FAILED", "reason": "bad\r\u{1b}]0;owned\u{7}\nline"}],
        });
        let text = super::render_text(&v);
        assert!(!text.chars().any(|c| c.is_control() && c != '\n'), "{text:?}");
        assert!(
            text.contains("m\u{fffd}[2J") && text.contains("bad\u{fffd}\u{fffd}]0;owned\u{fffd}\u{fffd}line"),
            "{text}"
        );
    }
}
