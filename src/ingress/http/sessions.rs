//! The session API (`/v1/sessions`): create, look up, list and delete a
//! caller's sessions, and write, read and clear their memory entries.
//!
//! The user a call acts for is the credential's (a JWT `sub`), else the
//! `x-user-id` header (an application acting for its users, as
//! `metadata.user_id` does for a chat); `POST /v1/sessions` may also name
//! it in the body (`user_id`). For an application with a `user_header`,
//! only that header names the user (as for its calls). A session of another tenant, application or
//! user answers 404 `SESSION_NOT_FOUND`, the same as one that never was.
//!
//! Owns: the routes' HTTP shape. Does not own: sessions, ownership or
//! limits (the facade and `crate::context::sessions` behind it).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::json;

use super::caller::{header_text, Caller};
use super::errors::ApiError;
use crate::gateway::Gateway;

/// The header naming the user an application acts for.
pub const USER_HEADER: &str = "x-user-id";

fn user(h: &HeaderMap) -> Option<String> {
    header_text(h, USER_HEADER)
}

/// `POST /v1/sessions`: 201 with the session.
pub async fn create(
    State(gw): State<Arc<Gateway>>,
    Caller(who): Caller,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let s = gw.create_session(&who, user(&headers).as_deref(), &body)?;
    Ok((StatusCode::CREATED, Json(s)).into_response())
}

/// `GET /v1/sessions`: the caller's sessions.
pub async fn list(
    State(gw): State<Arc<Gateway>>,
    Caller(who): Caller,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let data = gw.list_sessions(&who, user(&headers).as_deref())?;
    Ok(Json(json!({"object": "list", "data": data})).into_response())
}

/// `GET /v1/sessions/{id}`.
pub async fn get(
    State(gw): State<Arc<Gateway>>,
    Caller(who): Caller,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    Ok(Json(gw.session(&who, user(&headers).as_deref(), &id)?).into_response())
}

/// `DELETE /v1/sessions/{id}`: the session, its history and its memory,
/// here and in the store.
pub async fn delete(
    State(gw): State<Arc<Gateway>>,
    Caller(who): Caller,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    gw.delete_session(&who, user(&headers).as_deref(), &id)?;
    Ok(Json(json!({"id": id, "object": "session", "deleted": true})).into_response())
}

/// The filters of `GET /v1/sessions/{id}/memory`.
#[derive(Debug, Deserialize)]
pub struct MemoryQuery {
    key: Option<String>,
    tag: Option<String>,
}

/// `POST /v1/sessions/{id}/memory`: `{key, tags, content}`; an entry with
/// the same key is replaced.
pub async fn put_memory(
    State(gw): State<Arc<Gateway>>,
    Caller(who): Caller,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let e = gw.put_session_memory(&who, user(&headers).as_deref(), &id, &body)?;
    Ok((StatusCode::CREATED, Json(e)).into_response())
}

/// `GET /v1/sessions/{id}/memory[?key=…|tag=…]`.
pub async fn memory(
    State(gw): State<Arc<Gateway>>,
    Caller(who): Caller,
    headers: HeaderMap,
    Path(id): Path<String>,
    Query(q): Query<MemoryQuery>,
) -> Result<Response, ApiError> {
    let data = gw.session_memory(&who, user(&headers).as_deref(), &id, q.key.as_deref(), q.tag.as_deref())?;
    Ok(Json(json!({"object": "list", "data": data})).into_response())
}

/// `DELETE /v1/sessions/{id}/memory`.
pub async fn clear_memory(
    State(gw): State<Arc<Gateway>>,
    Caller(who): Caller,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    gw.clear_session_memory(&who, user(&headers).as_deref(), &id)?;
    Ok(Json(json!({"id": id, "object": "session.memory", "deleted": true})).into_response())
}
