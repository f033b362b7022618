//! `GET /admin/budgets?tenant=`: what the admin application's tenant and
//! each of its applications spent in the current UTC day and month
//! (tokens and cost), their limits (`null`: none), the used share and when
//! each window resets. `tenant` may name the caller's own tenant or be
//! left out; another is refused `PERMISSION_DENIED`.
//!
//! Owns: the query string and the answer's JSON. Does not own: who may
//! read (gateway) or the amounts (store).

use std::sync::Arc;

use axum::extract::State;
use axum::http::Uri;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use super::caller::Caller;
use super::errors::ApiError;
use crate::error::{ErrorCode, GatewayError};
use crate::gateway::Gateway;

pub async fn view(State(gw): State<Arc<Gateway>>, Caller(who): Caller, uri: Uri) -> Result<Response, ApiError> {
    let mut tenant = None;
    for pair in uri.query().unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=').unwrap_or((pair, "")) {
            ("tenant", "") => {}
            ("tenant", v) => tenant = Some(v.to_string()),
            (other, _) => {
                let name: String = other.chars().take(64).collect();
                return Err(
                    GatewayError::new(ErrorCode::InvalidRequest, format!("unknown query parameter {name:?}")).into()
                );
            }
        }
    }
    let budgets = gw.budgets(&who, tenant.as_deref())?;
    Ok(Json(json!({ "tenant": who.tenant, "budgets": budgets })).into_response())
}
