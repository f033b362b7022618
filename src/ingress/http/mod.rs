//! The HTTP ingress (axum): the OpenAI-compatible API for web apps and the
//! operational endpoints.
//!
//! Owns: routes, the OpenAI wire format (chunks, SSE, error bodies) and
//! client disconnects (dropping a response drops its task stream, which
//! cancels the task). Does not own: validation or scheduling.

mod chat;
mod errors;
mod tasks;

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use axum::{Json, Router};
use serde_json::json;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::error::{ErrorCode, GatewayError};
use crate::gateway::Gateway;

pub use errors::error_response;

type AppState = Arc<Gateway>;

/// Business endpoints: what applications call.
fn business_routes(state: AppState) -> Router {
    let limit = state.config.http.max_body_bytes;
    Router::new()
        .route("/v1/chat/completions", post(chat::chat_completions))
        .route("/v1/models", get(list_models))
        .route("/v1/tasks", post(tasks::create))
        .route("/v1/tasks/{id}", get(tasks::get).delete(tasks::cancel))
        .route("/v1/tasks/{id}/events", get(tasks::events))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state)
}

/// Operational endpoints: probes and metrics.
fn admin_routes(state: AppState) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
        .route("/admin/keys/revoke", post(revoke_key))
        .route("/admin/keys/reinstate", post(reinstate_key))
        .with_state(state)
}

/// Binds the listeners and serves until `shutdown`. Returns the bound
/// addresses (port 0 in the config picks a free port).
pub async fn serve(
    gw: AppState,
    tracker: &TaskTracker,
    shutdown: CancellationToken,
) -> anyhow::Result<(SocketAddr, Option<SocketAddr>)> {
    let cfg = &gw.config.http;
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {} (http.listen): {e}", cfg.listen))?;
    let addr = listener.local_addr()?;
    let mut app = business_routes(gw.clone());
    let admin_addr = match cfg.admin_listen {
        Some(a) => {
            let l = tokio::net::TcpListener::bind(a)
                .await
                .map_err(|e| anyhow::anyhow!("cannot listen on {a} (http.admin_listen): {e}"))?;
            let admin_addr = l.local_addr()?;
            let admin = admin_routes(gw.clone());
            let sd = shutdown.clone();
            let l = l.tap_io(no_delay);
            tracker.spawn(async move {
                if let Err(e) = axum::serve(l, admin).with_graceful_shutdown(sd.cancelled_owned()).await {
                    tracing::error!(error = %e, "admin listener failed");
                }
            });
            Some(admin_addr)
        }
        None => {
            app = app.merge(admin_routes(gw.clone()));
            None
        }
    };
    // Tokens are small writes: without TCP_NODELAY, Nagle's algorithm and
    // delayed ACKs hold them back for up to 40 ms.
    let listener = listener.tap_io(no_delay);
    tracker.spawn(async move {
        if let Err(e) = axum::serve(listener, app).with_graceful_shutdown(shutdown.cancelled_owned()).await {
            tracing::error!(error = %e, "HTTP listener failed");
        }
    });
    Ok((addr, admin_addr))
}

fn no_delay(tcp: &mut tokio::net::TcpStream) {
    if let Err(e) = tcp.set_nodelay(true) {
        tracing::debug!(error = %e, "cannot set TCP_NODELAY");
    }
}

async fn not_found() -> Response {
    let mut r = error_response(&GatewayError::invalid("no such endpoint"), None);
    *r.status_mut() = StatusCode::NOT_FOUND;
    r
}

async fn list_models(State(gw): State<AppState>, headers: axum::http::HeaderMap) -> Response {
    if let Err(e) = gw.auth.authenticate(chat::bearer(&headers)) {
        return error_response(&e, None).into_response();
    }
    let created = gw.started.elapsed().as_secs();
    let created = crate::task::now_ms() / 1000 - created as i64;
    let data: Vec<_> = gw
        .config
        .models
        .values()
        .map(|m| {
            json!({
                "id": m.name,
                "object": "model",
                "created": created,
                "owned_by": "edgeway",
                "context_window": m.context_tokens,
                "max_output_tokens": m.max_output_tokens,
                "description": m.description,
            })
        })
        .collect();
    Json(json!({ "object": "list", "data": data })).into_response()
}

async fn health() -> Response {
    Json(json!({ "status": "ok" })).into_response()
}

/// Ready when the store answers and every logical model has a healthy
/// instance. 503 otherwise, with the details.
async fn ready(State(gw): State<AppState>) -> Response {
    let Some(snap) = gw.scheduler.snapshot().await else {
        return error_response(&GatewayError::new(ErrorCode::InternalError, "scheduler is not running"), None);
    };
    let store_ok = tokio::time::timeout(std::time::Duration::from_secs(2), gw.store.flush()).await.is_ok();
    let models: Vec<_> = gw
        .config
        .models
        .values()
        .map(|m| {
            let up = m.instances.iter().any(|i| snap.instances.iter().any(|s| &s.name == i && s.up));
            json!({ "model": m.name, "ready": up })
        })
        .collect();
    let ready = store_ok && models.iter().all(|m| m["ready"] == true);
    let body = json!({
        "ready": ready,
        "store": if store_ok { "ok" } else { "not responding" },
        "models": models,
        "instances": snap.instances,
        "queues": snap.queues,
        // Reported, but readiness does not depend on the bus.
        "nats": gw.nats.to_json(),
    });
    let status = if ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (status, Json(body)).into_response()
}

/// `POST /admin/keys/revoke` `{"api_key_sha256": "<hex>"}` or
/// `{"api_key": "<key>"}`: refuses the key from now on, also after a
/// restart (recorded in the store), and cancels every task it submitted.
/// Admin applications only, within their tenant.
async fn revoke_key(State(gw): State<AppState>, headers: axum::http::HeaderMap, body: axum::body::Bytes) -> Response {
    let (who, digest) = match admin_key_request(&gw, &headers, &body) {
        Ok(x) => x,
        Err(resp) => return *resp,
    };
    gw.auth.revoke(digest);
    gw.store.set_revoked(&hex::encode(digest), &who.application, true).await;
    let cancelled = gw.scheduler.cancel_where(|e| e.credential == Some(digest), "the API key was revoked");
    tracing::warn!(by = %who.application, cancelled, "API key revoked");
    Json(json!({ "revoked": true, "cancelled_tasks": cancelled })).into_response()
}

/// `POST /admin/keys/reinstate`, same body: accepts a revoked key again.
async fn reinstate_key(
    State(gw): State<AppState>,
    headers: axum::http::HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    let (who, digest) = match admin_key_request(&gw, &headers, &body) {
        Ok(x) => x,
        Err(resp) => return *resp,
    };
    let was = gw.auth.reinstate(&digest);
    gw.store.set_revoked(&hex::encode(digest), &who.application, false).await;
    tracing::warn!(by = %who.application, was_revoked = was, "API key reinstated");
    Json(json!({ "revoked": false, "was_revoked": was })).into_response()
}

/// The admin caller and the key digest of a revoke/reinstate request.
fn admin_key_request(
    gw: &AppState,
    headers: &axum::http::HeaderMap,
    body: &[u8],
) -> Result<(crate::task::Identity, [u8; 32]), Box<Response>> {
    let who = match gw.auth.authenticate(chat::bearer(headers)) {
        Ok(w) if w.is_admin => w,
        Ok(_) => {
            let e = GatewayError::new(ErrorCode::PermissionDenied, "admin applications only");
            return Err(Box::new(error_response(&e, None)));
        }
        Err(e) => return Err(Box::new(error_response(&e, None))),
    };
    let v: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
    let digest = match (v["api_key_sha256"].as_str(), v["api_key"].as_str()) {
        (Some(h), _) => {
            match hex::decode(h.trim_start_matches("sha256:")).ok().and_then(|b| <[u8; 32]>::try_from(b).ok()) {
                Some(d) => d,
                None => {
                    let e = GatewayError::invalid("'api_key_sha256' must be 64 hex characters");
                    return Err(Box::new(error_response(&e, None)));
                }
            }
        }
        (None, Some(k)) => crate::config::hash_api_key(k),
        _ => return Err(Box::new(error_response(&GatewayError::invalid("send 'api_key_sha256' or 'api_key'"), None))),
    };
    if who.credential == Some(digest) {
        // An admin locked out by its own hand could not undo it.
        return Err(Box::new(error_response(
            &GatewayError::invalid("the key of this request cannot be revoked by itself"),
            None,
        )));
    }
    match gw.auth.key_owner(&digest) {
        Some((tenant, _)) if tenant == who.tenant => Ok((who, digest)),
        _ => Err(Box::new(error_response(&GatewayError::invalid("no such key in this tenant"), None))),
    }
}

async fn metrics(State(gw): State<AppState>) -> Response {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], gw.metrics.render()).into_response()
}
