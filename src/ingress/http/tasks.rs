//! The task API: submit without holding a connection, look a task up,
//! cancel it, and follow its events (SSE that resumes from `Last-Event-ID`).
//! Only the owning application (or an admin application) sees or cancels a
//! task; to anyone else it does not exist.

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::chat::{bearer, id_headers, read_call};
use super::errors::error_response;
use crate::error::{ErrorCode, GatewayError};
use crate::gateway::Gateway;
use crate::ingress::events::event_json;
use crate::task::{Identity, Ingress};

fn not_found() -> Response {
    let mut r = error_response(&GatewayError::invalid("no such task"), None);
    *r.status_mut() = StatusCode::NOT_FOUND;
    r
}

fn owns(who: &Identity, tenant: &str, app: &str) -> bool {
    who.tenant == tenant && (who.is_admin || who.application == app)
}

/// `POST /v1/tasks`: the chat body; answers 202 at once and the task runs
/// whether or not anyone listens.
pub async fn create(State(gw): State<Arc<Gateway>>, headers: HeaderMap, body: Bytes) -> Response {
    let (identity, req, hint) = match read_call(&gw, &headers, &body) {
        Ok(c) => c,
        Err(resp) => return *resp,
    };
    let mut task = match gw.submit(identity, req, Ingress::Http, hint).await {
        Ok(t) => t,
        Err(e) => return error_response(&e, None),
    };
    task.detach();
    let body = json!({
        "task_id": task.task_id,
        "request_id": task.request_id,
        "status": "QUEUED",
        "queue_position": task.queue_position,
        "joined": task.joined,
        "links": {
            "self": format!("/v1/tasks/{}", task.task_id),
            "events": format!("/v1/tasks/{}/events", task.task_id),
        },
    });
    let mut resp = (StatusCode::ACCEPTED, Json(body)).into_response();
    id_headers(resp.headers_mut(), &task.request_id, &task.task_id);
    resp
}

/// `GET /v1/tasks/{id}`: state, transitions, result metadata, and the
/// result text when the data policy keeps it.
pub async fn get(State(gw): State<Arc<Gateway>>, headers: HeaderMap, Path(id): Path<String>) -> Response {
    let who = match gw.auth.authenticate(bearer(&headers)) {
        Ok(i) => i,
        Err(e) => return error_response(&e, None),
    };
    gw.store.flush().await;
    let rec = match gw.store.get(&id).await {
        Ok(Some(r)) => r,
        Ok(None) => return not_found(),
        Err(e) => {
            tracing::error!(error = %e, "task store read failed");
            return error_response(&GatewayError::internal("the task store is not available"), None);
        }
    };
    if !owns(&who, &rec.tenant, &rec.application) {
        return not_found();
    }
    let transitions: Vec<Value> = rec
        .transitions
        .iter()
        .map(|t| {
            json!({
                "state": t.state, "at_ms": t.at_ms, "reason": t.reason,
                "node_id": t.node_id, "instance": t.instance, "actor": t.actor,
            })
        })
        .collect();
    let body = json!({
        "task_id": rec.task_id,
        "request_id": rec.request_id,
        "status": rec.state,
        "application": rec.application,
        "logical_model": rec.logical_model,
        "priority": rec.priority,
        "created_at_ms": rec.created_at_ms,
        "error_code": rec.error_code,
        "transitions": transitions,
        "edge": rec.result,
        "result_text": rec.result_text,
    });
    let mut resp = Json(body).into_response();
    id_headers(resp.headers_mut(), &rec.request_id, &rec.task_id);
    resp
}

/// `DELETE /v1/tasks/{id}`: cancels a queued or running task.
pub async fn cancel(State(gw): State<Arc<Gateway>>, headers: HeaderMap, Path(id): Path<String>) -> Response {
    let who = match gw.auth.authenticate(bearer(&headers)) {
        Ok(i) => i,
        Err(e) => return error_response(&e, None),
    };
    let Some(entry) = gw.scheduler.get(&id) else {
        // Not live here: maybe ended long ago.
        return match gw.store.get(&id).await {
            Ok(Some(rec)) if owns(&who, &rec.tenant, &rec.application) => {
                (StatusCode::CONFLICT, Json(json!({"task_id": id, "status": rec.state, "cancelled": false})))
                    .into_response()
            }
            _ => not_found(),
        };
    };
    if !owns(&who, &entry.tenant, &entry.application) {
        return not_found();
    }
    let actor = if who.application == entry.application { "client" } else { "admin" };
    let cancelled = gw.scheduler.cancel(&id, "cancelled by DELETE /v1/tasks", actor);
    let status = if cancelled { StatusCode::ACCEPTED } else { StatusCode::CONFLICT };
    (status, Json(json!({"task_id": id, "cancelled": cancelled}))).into_response()
}

/// `GET /v1/tasks/{id}/events`: the task's events as SSE, each with its
/// sequence number as the event id. A client that reconnects with
/// `Last-Event-ID: n` receives everything after `n`, then the live tail.
/// Disconnecting does not cancel the task.
pub async fn events(State(gw): State<Arc<Gateway>>, headers: HeaderMap, Path(id): Path<String>) -> Response {
    let who = match gw.auth.authenticate(bearer(&headers)) {
        Ok(i) => i,
        Err(e) => return error_response(&e, None),
    };
    let Some(entry) = gw.scheduler.get(&id) else {
        return match gw.store.get(&id).await {
            Ok(Some(rec)) if owns(&who, &rec.tenant, &rec.application) => {
                let e = GatewayError::invalid(
                    "this task's events are no longer retained; GET /v1/tasks/{id} has its result",
                );
                let mut r = error_response(&e, rec.result.as_ref());
                *r.status_mut() = StatusCode::GONE;
                r
            }
            _ => not_found(),
        };
    };
    if !owns(&who, &entry.tenant, &entry.application) {
        return not_found();
    }
    let from = match headers.get("last-event-id").map(|v| v.to_str().map(|s| s.trim().parse::<u64>())) {
        None => 0,
        Some(Ok(Ok(n))) => n + 1,
        Some(_) => {
            let e = GatewayError::new(ErrorCode::InvalidRequest, "Last-Event-ID must be an event id (a number)");
            return error_response(&e, None);
        }
    };
    let Some(stream) = gw.scheduler.attach(&id, from) else { return not_found() };
    let request_id = entry.request_id.clone();
    let body = futures::stream::unfold((stream, request_id), |(mut s, rid)| async move {
        let (seq, ev) = s.recv().await?;
        let v = event_json(seq, &rid, &ev);
        let ty = v["type"].as_str().unwrap_or("event").to_string();
        let frame = format!("id: {seq}\nevent: {ty}\ndata: {v}\n\n");
        Some((Ok::<_, std::convert::Infallible>(Bytes::from(frame)), (s, rid)))
    });
    let mut resp = Response::new(Body::from_stream(body));
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    id_headers(h, &entry.request_id, &entry.task_id);
    resp
}
