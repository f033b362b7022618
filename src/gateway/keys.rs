//! Revocation of an API key or a JWT (by its `jti`) by an admin
//! application: refused from now on, also after a restart (recorded in the
//! store), and every task the key or token submitted is cancelled.
//! Reinstating accepts it again.
//!
//! While the store cannot write, a revocation is still in force at once
//! (refused, tasks cancelled) but answered `STORE_UNAVAILABLE` with a
//! message saying so: it is not durable until the store writes again.
//!
//! Owns: the admin check for revocation, the body
//! `{"api_key_sha256": "<hex>"}`, `{"api_key": "<key>"}` or
//! `{"jti": "<token id>"}`, and the rules that an admin acts only within its
//! tenant and never on its own credential. A token id is recorded in the
//! revoked-key table as [`jwt_id_digest`] of the admin's tenant, so it
//! reaches that tenant's tokens only. Does not own: the key table
//! (admission) or cancelling (scheduler).

use crate::admission::auth::jwt_id_digest;
use crate::error::{ErrorCode, GatewayError};
use crate::task::Identity;

use super::Gateway;

impl Gateway {
    /// Revokes the key or token named in `body`; returns how many of its
    /// tasks were cancelled.
    pub async fn revoke_key(&self, who: &Identity, body: &[u8]) -> Result<usize, GatewayError> {
        let (digest, what) = self.key_request(who, body)?;
        // In force at once, whatever the store says: refused from now on and
        // its tasks cancelled. Only the durability waits for the disk.
        self.auth.revoke(digest);
        let reason = if what == "token" { "the token was revoked" } else { "the API key was revoked" };
        let cancelled = self.scheduler.cancel_where(|e| e.credential == Some(digest), reason);
        tracing::warn!(by = %who.application, what, cancelled, "credential revoked");
        if let Err(e) = self.store.set_revoked(&hex::encode(digest), &who.application, true).await {
            // 503, not `revoked: true`: a restart before the store writes
            // again would bring the credential back. The write stays
            // buffered and lands once the store can write; repeating the
            // call confirms it.
            tracing::error!(error = %e, what, "a revocation is in force but not yet durable");
            return Err(GatewayError::new(
                ErrorCode::StoreUnavailable,
                format!(
                    "the {what} is revoked now and {cancelled} of its tasks were cancelled, but the revocation is not \
                     yet durable (the task store cannot write): a restart before it can would undo it; repeat this \
                     call until it succeeds"
                ),
            )
            .with_retry_after(super::STORE_RETRY_AFTER_MS));
        }
        Ok(cancelled)
    }

    /// Accepts a revoked key or token again; returns whether it was revoked.
    pub async fn reinstate_key(&self, who: &Identity, body: &[u8]) -> Result<bool, GatewayError> {
        let (digest, what) = self.key_request(who, body)?;
        let was = self.auth.reinstate(&digest);
        self.store.set_revoked(&hex::encode(digest), &who.application, false).await.map_err(super::store_failed)?;
        tracing::warn!(by = %who.application, what, was_revoked = was, "credential reinstated");
        Ok(was)
    }

    /// The digest of a revoke/reinstate request and what it names (`key`,
    /// `token`), once the caller is known to be an admin of its tenant.
    fn key_request(&self, who: &Identity, body: &[u8]) -> Result<([u8; 32], &'static str), GatewayError> {
        if !who.is_admin {
            return Err(GatewayError::new(ErrorCode::PermissionDenied, "admin applications only"));
        }
        let v: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
        let (digest, what) = match (v["api_key_sha256"].as_str(), v["api_key"].as_str(), v["jti"].as_str()) {
            (Some(h), _, _) => (
                hex::decode(h.trim_start_matches("sha256:"))
                    .ok()
                    .and_then(|b| <[u8; 32]>::try_from(b).ok())
                    .ok_or_else(|| GatewayError::invalid("'api_key_sha256' must be 64 hex characters"))?,
                "key",
            ),
            (None, Some(k), _) => (crate::config::hash_api_key(k), "key"),
            (None, None, Some(jti)) if !jti.is_empty() && jti.len() <= 1024 => {
                (jwt_id_digest(&who.tenant, jti), "token")
            }
            (None, None, Some(_)) => return Err(GatewayError::invalid("'jti' must be 1 to 1024 bytes")),
            _ => return Err(GatewayError::invalid("send 'api_key_sha256', 'api_key' or 'jti'")),
        };
        if who.credential == Some(digest) {
            // An admin locked out by its own hand could not undo it.
            return Err(GatewayError::invalid("the credential of this request cannot be revoked by itself"));
        }
        if what == "token" {
            // Any id of the admin's tenant: its tokens are not listed anywhere.
            return Ok((digest, what));
        }
        match self.auth.key_owner(&digest) {
            Some((tenant, _)) if tenant == who.tenant => Ok((digest, what)),
            _ => Err(GatewayError::invalid("no such key in this tenant")),
        }
    }
}
