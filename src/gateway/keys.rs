//! API key revocation by an admin application: refused from now on, also
//! after a restart (recorded in the store), and every task the key
//! submitted is cancelled. Reinstating accepts the key again.
//!
//! Owns: the admin check for key revocation, the body
//! `{"api_key_sha256": "<hex>"}` or `{"api_key": "<key>"}`, and the rules
//! that an admin acts only within its tenant and never on its own key.
//! Does not own: the key table (admission) or cancelling (scheduler).

use crate::error::{ErrorCode, GatewayError};
use crate::task::Identity;

use super::Gateway;

impl Gateway {
    /// Revokes the key named in `body`; returns how many of its tasks were
    /// cancelled.
    pub async fn revoke_key(&self, who: &Identity, body: &[u8]) -> Result<usize, GatewayError> {
        let digest = self.key_request(who, body)?;
        self.auth.revoke(digest);
        self.store.set_revoked(&hex::encode(digest), &who.application, true).await.map_err(super::store_failed)?;
        let cancelled = self.scheduler.cancel_where(|e| e.credential == Some(digest), "the API key was revoked");
        tracing::warn!(by = %who.application, cancelled, "API key revoked");
        Ok(cancelled)
    }

    /// Accepts a revoked key again; returns whether it was revoked.
    pub async fn reinstate_key(&self, who: &Identity, body: &[u8]) -> Result<bool, GatewayError> {
        let digest = self.key_request(who, body)?;
        let was = self.auth.reinstate(&digest);
        self.store.set_revoked(&hex::encode(digest), &who.application, false).await.map_err(super::store_failed)?;
        tracing::warn!(by = %who.application, was_revoked = was, "API key reinstated");
        Ok(was)
    }

    /// The key digest of a revoke/reinstate request, once the caller is
    /// known to be an admin of the key's tenant.
    fn key_request(&self, who: &Identity, body: &[u8]) -> Result<[u8; 32], GatewayError> {
        if !who.is_admin {
            return Err(GatewayError::new(ErrorCode::PermissionDenied, "admin applications only"));
        }
        let v: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
        let digest = match (v["api_key_sha256"].as_str(), v["api_key"].as_str()) {
            (Some(h), _) => hex::decode(h.trim_start_matches("sha256:"))
                .ok()
                .and_then(|b| <[u8; 32]>::try_from(b).ok())
                .ok_or_else(|| GatewayError::invalid("'api_key_sha256' must be 64 hex characters"))?,
            (None, Some(k)) => crate::config::hash_api_key(k),
            _ => return Err(GatewayError::invalid("send 'api_key_sha256' or 'api_key'")),
        };
        if who.credential == Some(digest) {
            // An admin locked out by its own hand could not undo it.
            return Err(GatewayError::invalid("the key of this request cannot be revoked by itself"));
        }
        match self.auth.key_owner(&digest) {
            Some((tenant, _)) if tenant == who.tenant => Ok(digest),
            _ => Err(GatewayError::invalid("no such key in this tenant")),
        }
    }
}
