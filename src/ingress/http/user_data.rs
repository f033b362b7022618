//! `DELETE /admin/users/{user}/data?tenant=`: deletes one user's data (see
//! `gateway::user_data`) and answers what went:
//! `{"tenant", "user", "deleted": {task_texts, idempotency_answers,
//! responses, pending_requests, sessions, sessions_in_memory, cached_answers},
//! "audit_seq", "wal_truncated"}`.
//!
//! Owns: the query string, the Responses' conversations this ingress keeps
//! in memory, and the JSON. Does not own: who may ask (gateway) or what
//! the store deletes.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::Uri;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use super::caller::Caller;
use super::errors::ApiError;
use crate::error::GatewayError;
use crate::gateway::Gateway;

pub async fn delete(
    State(gw): State<Arc<Gateway>>,
    Caller(who): Caller,
    Path(user): Path<String>,
    uri: Uri,
) -> Result<Response, ApiError> {
    let mut tenant = None;
    for pair in uri.query().unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        match k {
            "tenant" => {
                let v = super::audit::decode(v)
                    .ok_or_else(|| GatewayError::invalid("tenant: not valid percent-encoded UTF-8"))?;
                tenant = Some(v).filter(|v| !v.is_empty());
            }
            other => {
                let other: String = other.chars().take(64).collect();
                return Err(GatewayError::invalid(format!("unknown query parameter {other:?}")).into());
            }
        }
    }
    let r = gw.delete_user_data(&who, tenant.as_deref(), &user).await?;
    super::responses::forget_conversations(&r.store.task_ids);
    let d = &r.store.deleted;
    Ok(Json(json!({
        "tenant": r.tenant,
        "user": r.user,
        "deleted": {
            "task_texts": d.task_texts,
            "idempotency_answers": d.idempotency_answers,
            "responses": d.responses,
            "pending_requests": d.pending_requests,
            "sessions": d.sessions,
            "sessions_in_memory": r.sessions_in_memory,
            "cached_answers": r.cached_answers,
        },
        "audit_seq": r.store.audit_seq,
        "wal_truncated": r.store.wal_truncated,
    }))
    .into_response())
}
