//! `DELETE /admin/users/{user}/data`: an admin application deletes one
//! user's data in its own tenant: the text of the user's tasks, the
//! answers kept with their idempotency keys, their stored Responses, and
//! the user's sessions with their history and memory, in memory and in the
//! store, and the response-cache answers their calls stored, leaving an
//! audit record of the deletion (who asked, which user, what went).
//!
//! Owns: who may ask (an admin application, for its own tenant only, as
//! `/admin/audit`), the user id's bounds, and the order (memory first, so
//! no session of the user is written again after the store's copy went).
//! Does not own: what the store deletes (`store::user_data`), the
//! Responses' conversations kept in memory (the HTTP ingress drops them),
//! or ended tasks' event logs the scheduler keeps in memory for a repeat
//! (they hold answer text and go with `[scheduler] replay_retention_ms`).

use super::{store_failed, Gateway};
use crate::error::{ErrorCode, GatewayError};
use crate::store::{audit, AuditEntry, UserDataForgotten};
use crate::task::Identity;

/// A user id's bounds (as admission's for a declared user).
const MAX_USER_LEN: usize = 128;

/// What a deletion removed.
#[derive(Debug, Clone)]
pub struct UserDataReport {
    pub tenant: String,
    pub user: String,
    pub store: UserDataForgotten,
    /// The user's sessions dropped from memory.
    pub sessions_in_memory: usize,
    /// Response-cache answers the user's calls had stored.
    pub cached_answers: usize,
}

impl Gateway {
    /// Deletes `user`'s data in `tenant` (the caller's own; `None`: that
    /// one) for an admin application.
    pub async fn delete_user_data(
        &self,
        who: &Identity,
        tenant: Option<&str>,
        user: &str,
    ) -> Result<UserDataReport, GatewayError> {
        if !who.is_admin {
            return Err(GatewayError::new(ErrorCode::PermissionDenied, "admin applications only"));
        }
        let tenant = match tenant {
            None => who.tenant.clone(),
            Some(t) if t == who.tenant => who.tenant.clone(),
            Some(_) => {
                return Err(GatewayError::new(
                    ErrorCode::PermissionDenied,
                    "an admin application deletes its own tenant's user data only",
                ))
            }
        };
        if user.is_empty() || user.len() > MAX_USER_LEN || user.chars().any(char::is_control) {
            return Err(GatewayError::invalid(format!(
                "user must be 1..{MAX_USER_LEN} bytes without control characters"
            )));
        }
        let sessions_in_memory = self.sessions.delete_user(&tenant, user);
        let cached_answers = self.scheduler.forget_cached_answers_of(&tenant, user);
        let entry = AuditEntry {
            at_ms: crate::task::now_ms(),
            tenant: tenant.clone(),
            application: who.application.clone(),
            user_id: Some(user.to_string()),
            key_id: audit::key_id(who.credential.as_ref()),
            ingress: "admin".into(),
            result: "USER_DATA_DELETED".into(),
            error_code: None,
            ..AuditEntry::refused("")
        };
        let store = self.store.forget_user(&tenant, user, entry).await.map_err(store_failed)?;
        tracing::info!(
            tenant = %tenant,
            user = %user,
            tasks = store.deleted.task_texts,
            sessions = store.deleted.sessions,
            by = %who.application,
            "a user's data deleted"
        );
        Ok(UserDataReport { tenant, user: user.to_string(), store, sessions_in_memory, cached_answers })
    }
}
