//! The HTTP ingress (axum): the OpenAI-compatible API for web apps and the
//! operational endpoints.
//!
//! Owns: routes, the OpenAI wire format (chunks, SSE, error bodies), where
//! HTTP carries a credential (`caller.rs`), the mapping of errors to
//! responses (`errors.rs`), client disconnects (dropping a response drops
//! its task stream, which cancels the task) and connections: caps,
//! header and idle timeouts, graceful shutdown (`listener.rs`). Does not own: authentication,
//! validation, ownership of tasks or scheduling (the gateway facade).

mod audit;
mod budgets;
mod caller;
mod chat;
mod completions;
mod embeddings;
mod errors;
mod listener;
mod responses;
mod sessions;
mod sse;
mod status;
mod tasks;
mod user_data;
mod ws;

use std::net::SocketAddr;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Extension;
use axum::{Json, Router};
use serde_json::json;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::error::{ErrorCode, GatewayError};
use crate::gateway::{Gateway, ReloadError};
use caller::{Caller, Credential};
use errors::ApiError;
/// The text form of a status snapshot (`edgeway status`).
pub use status::render_text as render_status_text;

type AppState = Arc<Gateway>;

/// Business endpoints: what applications call.
fn business_routes(state: AppState) -> Router {
    let limit = state.config().http.max_body_bytes;
    Router::new()
        .route("/v1/chat/completions", post(chat::chat_completions))
        .route("/v1/completions", post(completions::completions))
        .route("/v1/embeddings", post(embeddings::embeddings))
        .route("/v1/responses", post(responses::create))
        .route("/v1/responses/{id}", get(responses::retrieve).delete(responses::delete))
        .route("/v1/ws", get(ws::upgrade))
        .route("/v1/models", get(list_models))
        .route("/v1/tasks", post(tasks::create))
        .route("/v1/tasks/{id}", get(tasks::get).delete(tasks::cancel))
        .route("/v1/tasks/{id}/events", get(tasks::events))
        .route("/v1/sessions", post(sessions::create).get(sessions::list))
        .route("/v1/sessions/{id}", get(sessions::get).delete(sessions::delete))
        .route(
            "/v1/sessions/{id}/memory",
            post(sessions::put_memory).get(sessions::memory).delete(sessions::clear_memory),
        )
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state)
}

/// Operational endpoints: probes and metrics. On the business port
/// (`guarded`), reachable by anyone who can reach the API, `/metrics` and
/// the details of `/ready` (instances, queues, breakers, the bus) need an
/// admin application's credential: they describe the deployment and its
/// load. `/health` and the bare `/ready` status stay open for load
/// balancers. On `admin_listen`, a port for the operator's network only,
/// all of it is open. The status page and its data need an admin
/// application's key on either port (`status.rs`).
fn admin_routes(state: AppState, guarded: bool, shutdown: CancellationToken) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
        .route("/admin/keys/revoke", post(revoke_key))
        .route("/admin/keys/reinstate", post(reinstate_key))
        .route("/admin/reload", post(reload_config))
        .route("/admin/tasks/{id}/context", get(tasks::context))
        .route("/admin/tasks/{id}", axum::routing::delete(status::cancel))
        .route("/v1/nodes", get(status::nodes))
        .route("/admin/status", get(status::json))
        .route("/admin/status/stream", get(status::stream))
        .route("/status", get(status::page))
        .route("/admin/audit", get(audit::page))
        .route("/admin/budgets", get(budgets::view))
        .route("/admin/users/{user}/data", axum::routing::delete(user_data::delete))
        .layer(Extension(OpsGuard(guarded)))
        .layer(Extension(ws::Shutdown(shutdown)))
        .with_state(state)
}

/// Whether the operational endpoints need an admin credential.
#[derive(Clone, Copy)]
struct OpsGuard(bool);

/// Whether `cred` may see operational details: always when unguarded;
/// else only an admin application (401 for a bad credential, 403 for
/// another application's, and `Ok(false)` for none at all).
fn ops_access(gw: &Gateway, guard: OpsGuard, cred: Option<&str>) -> Result<bool, ApiError> {
    if !guard.0 {
        return Ok(true);
    }
    let Some(cred) = cred else { return Ok(false) };
    if !gw.authenticate(Some(cred))?.is_admin {
        return Err(GatewayError::new(ErrorCode::PermissionDenied, "admin applications only").into());
    }
    Ok(true)
}

/// Binds the listeners and serves until `shutdown`. Returns the bound
/// addresses (port 0 in the config picks a free port).
pub async fn serve(
    gw: AppState,
    tracker: &TaskTracker,
    shutdown: CancellationToken,
) -> anyhow::Result<(SocketAddr, Option<SocketAddr>)> {
    let cfg = &gw.config().http;
    let metrics = listener::HttpMetrics::new(&gw.metrics().registry);
    let limits = |max_connections| listener::Limits {
        max_connections,
        header_read_timeout: cfg.header_read_timeout,
        idle_timeout: cfg.idle_timeout,
        max_connection_age: cfg.max_connection_age,
    };
    let main = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {} (http.listen): {e}", cfg.listen))?;
    let addr = main.local_addr()?;
    // WebSockets outlive their HTTP connection: they close on this token.
    let mut app = business_routes(gw.clone()).layer(Extension(ws::Shutdown(shutdown.clone())));
    let admin_addr = match cfg.admin_listen {
        Some(a) => {
            let l = tokio::net::TcpListener::bind(a)
                .await
                .map_err(|e| anyhow::anyhow!("cannot listen on {a} (http.admin_listen): {e}"))?;
            let admin_addr = l.local_addr()?;
            let admin = admin_routes(gw.clone(), false, shutdown.clone());
            tracker.spawn(listener::run(
                "admin",
                l,
                admin,
                limits(cfg.admin_max_connections),
                metrics.clone(),
                shutdown.clone(),
            ));
            Some(admin_addr)
        }
        None => {
            app = app.merge(admin_routes(gw.clone(), true, shutdown.clone()));
            None
        }
    };
    tracker.spawn(listener::run("main", main, app, limits(cfg.max_connections), metrics, shutdown));
    Ok((addr, admin_addr))
}

async fn not_found() -> ApiError {
    ApiError::NotFound("no such endpoint")
}

async fn list_models(State(gw): State<AppState>, Caller(who): Caller) -> Response {
    let created = gw.started().elapsed().as_secs();
    let created = crate::task::now_ms() / 1000 - created as i64;
    let cfg = gw.config();
    // Only the models the caller's application may name (`allowed_models`).
    let app = cfg.applications.get(&who.application);
    let data: Vec<_> = cfg
        .models
        .values()
        .filter(|m| app.is_none_or(|a| a.may_use_model(&m.name)))
        .map(|m| {
            let cfg = gw.config();
            // Whether a request with `tools` is taken: only when every
            // instance does tools (admission refuses it otherwise).
            let tools = m.kind == crate::config::ModelKind::Chat
                && m.instances.iter().all(|i| cfg.engines.get(i).is_some_and(|e| e.tools));
            let mut v = json!({
                "id": m.name,
                "object": "model",
                "created": created,
                "owned_by": "edgeway",
                "context_window": m.context_tokens,
                "max_output_tokens": m.max_output_tokens,
                "description": m.description,
                // `chat` (chat and text completions) or `embedding`.
                "kind": m.kind.as_str(),
                "tools": tools,
            });
            // Residency on this node: its class, and its state on the
            // local engines (the best of them: loaded, loading, unloaded;
            // `forbidden` when the class says so).
            v["residency"] = json!(m.residency.class.as_str());
            v["state"] = json!(gw.model_residency_state(m));
            if m.kind == crate::config::ModelKind::Embedding {
                // The vector length where the operator states it, else null.
                v["dimensions"] = json!(m.dimensions);
                v["supports_dimensions"] = json!(m.supports_dimensions);
            }
            v
        })
        .collect();
    Json(json!({ "object": "list", "data": data })).into_response()
}

async fn health() -> Response {
    Json(json!({ "status": "ok" })).into_response()
}

/// Ready when the store answers and every logical model has a healthy
/// instance. 503 otherwise. The details come with it where the caller may
/// see them ([`ops_access`]); else the body is `{"ready": …}` alone.
async fn ready(
    State(gw): State<AppState>,
    Extension(guard): Extension<OpsGuard>,
    Credential(cred): Credential,
) -> Result<Response, ApiError> {
    let detailed = ops_access(&gw, guard, cred.as_deref())?;
    let r = gw.readiness().await?;
    let status = if r.ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    if !detailed {
        return Ok((status, Json(json!({ "ready": r.ready }))).into_response());
    }
    let mut body = json!({
        "ready": r.ready,
        "store": r.store_state(),
        "not_ready": r.not_ready,
        "models": r.models,
        "instances": r.instances,
        "queues": r.queues,
        "degradation_level": r.degradation_level,
        // Reported, but readiness does not depend on the bus.
        "nats": r.bus,
        // The node registry; reported, not a readiness condition either.
        "cluster": r.cluster,
        "engine_processes": r.engine_processes,
        "config_version": r.config_version,
        // Unix time in milliseconds; null until the first reload.
        "config_reloaded_at_ms": r.config_reloaded_at
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map(|d| d.as_millis() as u64),
    });
    // Reported, but readiness does not depend on it either.
    if let Some(m) = r.mqtt_bus {
        body["mqtt_broker"] = m;
    }
    Ok((status, Json(body)).into_response())
}

/// `POST /admin/keys/revoke` `{"api_key_sha256": "<hex>"}` or
/// `{"api_key": "<key>"}`: refuses the key from now on, also after a
/// restart (recorded in the store), and cancels every task it submitted.
/// Admin applications only, within their tenant (the facade checks).
async fn revoke_key(State(gw): State<AppState>, Caller(who): Caller, body: Bytes) -> Result<Response, ApiError> {
    let cancelled = gw.revoke_key(&who, &body).await?;
    Ok(Json(json!({ "revoked": true, "cancelled_tasks": cancelled })).into_response())
}

/// `POST /admin/reload`: reads the configuration file again and puts it in
/// force (admin applications only). 200 with the new `config_version` and
/// what changed; a refused file: 422 `CONFIG_INVALID` with every problem
/// by key path (`errors`), and the configuration in force stays.
async fn reload_config(State(gw): State<AppState>, Caller(who): Caller) -> Result<Response, ApiError> {
    match gw.reload_as(&who).await {
        Ok(report) => Ok(Json(json!({ "reloaded": true, "config_version": report.config_version,
            "previous_version": report.previous_version, "changes": report.changes }))
        .into_response()),
        Err(ReloadError::Denied(e)) => Err(e.into()),
        Err(ReloadError::Invalid(errors)) => {
            let code = ErrorCode::ConfigInvalid;
            let list: Vec<_> = errors.0.iter().map(|x| json!({ "path": x.path, "message": x.message })).collect();
            let body = json!({ "error": {
                "code": code.as_str(),
                "type": code.error_type(),
                "message": format!("configuration refused ({} problem(s)); the configuration in force stays", list.len()),
                "errors": list,
            }});
            let status = StatusCode::from_u16(code.http_status()).unwrap_or(StatusCode::UNPROCESSABLE_ENTITY);
            Ok((status, Json(body)).into_response())
        }
    }
}

/// `POST /admin/keys/reinstate`, same body: accepts a revoked key again.
async fn reinstate_key(State(gw): State<AppState>, Caller(who): Caller, body: Bytes) -> Result<Response, ApiError> {
    let was = gw.reinstate_key(&who, &body).await?;
    Ok(Json(json!({ "revoked": false, "was_revoked": was })).into_response())
}

async fn metrics(
    State(gw): State<AppState>,
    Extension(guard): Extension<OpsGuard>,
    Credential(cred): Credential,
) -> Result<Response, ApiError> {
    if !ops_access(&gw, guard, cred.as_deref())? {
        return Err(GatewayError::new(
            ErrorCode::AuthFailed,
            "metrics on this port need an admin application's key (or set http.admin_listen)",
        )
        .into());
    }
    Ok(([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], gw.render_metrics()).into_response())
}
