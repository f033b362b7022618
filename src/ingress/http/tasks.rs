//! The task API: submit without holding a connection, look a task up,
//! cancel it, and follow its events (SSE that resumes from `Last-Event-ID`).
//! Only the owning application (or an admin application) sees or cancels a
//! task; to anyone else it does not exist (the facade checks ownership;
//! this file renders what it finds).

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::caller::{id_headers, Caller, Credential};
use super::chat::submit_options;
use super::errors::ApiError;
use crate::error::{ErrorCode, GatewayError};
use crate::gateway::{self, CancelOutcome, Gateway, TaskLookup};
use crate::ingress::render::event_json;
use crate::task::{Identity, Ingress};

const NO_SUCH_TASK: &str = "no such task";

/// `POST /v1/tasks`: the chat body; answers 202 at once and the task runs
/// whether or not anyone listens.
pub async fn create(
    State(gw): State<Arc<Gateway>>,
    Credential(cred): Credential,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let caller = gateway::Caller::Credential(cred.as_deref());
    let mut task = gw.submit(caller, &body, Ingress::Http, submit_options(&headers)).await?;
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
    id_headers(resp.headers_mut(), &task.request_id, &task.task_id, Some(&task.trace_id));
    Ok(resp)
}

/// `GET /v1/tasks/{id}`: state, transitions, result metadata, and the
/// result text when the data policy keeps it.
pub async fn get(
    State(gw): State<Arc<Gateway>>,
    Caller(who): Caller,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let rec = gw.task(&who, &id).await?.ok_or(ApiError::NotFound(NO_SUCH_TASK))?;
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
        "trace_id": rec.trace_id,
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
    id_headers(resp.headers_mut(), &rec.request_id, &rec.task_id, rec.trace_id.as_deref());
    Ok(resp)
}

/// `GET /admin/tasks/{id}/context` (admin applications only, tasks of
/// their tenant): the segment plan of the task's assembled prompt (kinds,
/// sources, trust, token counts, the budget and the ladder steps taken;
/// recorded with its result, so `null` until the task has ended or when
/// its messages went as they came), and the prompt as sent only where the
/// store keeps text (`[store] store_prompts`).
pub async fn context(
    State(gw): State<Arc<Gateway>>,
    Caller(who): Caller,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    if !who.is_admin {
        return Err(GatewayError::new(ErrorCode::PermissionDenied, "admin applications only").into());
    }
    let rec = gw.task(&who, &id).await?.ok_or(ApiError::NotFound(NO_SUCH_TASK))?;
    let prompt = rec.prompt_text.as_deref().and_then(|t| serde_json::from_str::<Value>(t).ok());
    let body = json!({
        "task_id": rec.task_id,
        "status": rec.state,
        "context": rec.result.and_then(|r| r.context),
        "prompt": prompt,
    });
    Ok(Json(body).into_response())
}

/// `DELETE /v1/tasks/{id}`: cancels a queued or running task. 202 when it
/// was cancelled, 409 when it had already ended.
pub async fn cancel(
    State(gw): State<Arc<Gateway>>,
    Caller(who): Caller,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    cancel_as(&gw, &who, &id, "cancelled by DELETE /v1/tasks").await
}

/// The cancel of [`cancel`], with the reason to record (the status page's
/// `DELETE /admin/tasks/{id}` shares it).
pub async fn cancel_as(gw: &Gateway, who: &Identity, id: &str, reason: &str) -> Result<Response, ApiError> {
    let outcome = gw.cancel(who, id, reason).await.ok_or(ApiError::NotFound(NO_SUCH_TASK))?;
    Ok(match outcome {
        CancelOutcome::Ended { state } => {
            (StatusCode::CONFLICT, Json(json!({"task_id": id, "status": state, "cancelled": false}))).into_response()
        }
        CancelOutcome::Live { cancelled } => {
            let status = if cancelled { StatusCode::ACCEPTED } else { StatusCode::CONFLICT };
            (status, Json(json!({"task_id": id, "cancelled": cancelled}))).into_response()
        }
    })
}

/// `GET /v1/tasks/{id}/events`: the task's events as SSE, each with its
/// sequence number as the event id. A client that reconnects with
/// `Last-Event-ID: n` receives everything after `n`, then the live tail.
/// Disconnecting does not cancel the task.
pub async fn events(
    State(gw): State<Arc<Gateway>>,
    Caller(who): Caller,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let task = match gw.lookup(&who, &id).await {
        TaskLookup::Live(t) => t,
        TaskLookup::NotFound => return Err(ApiError::NotFound(NO_SUCH_TASK)),
        TaskLookup::Gone { result } => {
            let e =
                GatewayError::invalid("this task's events are no longer retained; GET /v1/tasks/{id} has its result");
            return Err(ApiError::Gone(e, result));
        }
    };
    let from = match headers.get("last-event-id").map(|v| v.to_str().map(|s| s.trim().parse::<u64>())) {
        None => 0,
        Some(Ok(Ok(n))) => n + 1,
        Some(_) => {
            return Err(
                GatewayError::new(ErrorCode::InvalidRequest, "Last-Event-ID must be an event id (a number)").into()
            )
        }
    };
    let stream = gw.attach(&task, from).ok_or(ApiError::NotFound(NO_SUCH_TASK))?;
    let request_id = task.request_id().to_string();
    let trace_id = stream.trace_id.clone();
    let body = futures::stream::unfold((stream, request_id), |(mut s, rid)| async move {
        let (seq, ev) = s.recv().await?;
        let v = event_json(seq, &rid, &s.trace_id, &ev);
        let ty = v["type"].as_str().unwrap_or("event").to_string();
        let frame = format!("id: {seq}\nevent: {ty}\ndata: {v}\n\n");
        Some((Ok::<_, std::convert::Infallible>(Bytes::from(frame)), (s, rid)))
    });
    let mut resp = Response::new(Body::from_stream(body));
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    id_headers(h, task.request_id(), task.task_id(), Some(&trace_id));
    Ok(resp)
}
