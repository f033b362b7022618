//! Budgets for their readers: `GET /admin/budgets`, what a tenant and its
//! applications spent in the current UTC day and month against their
//! limits, and when each window resets.
//!
//! Owns: who may read which tenant's budgets (an admin application, its
//! own tenant's only, as for the audit trail). Does not own: the amounts
//! or limits (`store::budget`) nor rendering (ingress).

use super::Gateway;
use crate::error::{ErrorCode, GatewayError};
use crate::task::Identity;

pub type BudgetView = crate::store::budget::BudgetView;

impl Gateway {
    /// Every budget window of `tenant` (`None`: the caller's own) and of
    /// its applications, for an admin application of that tenant.
    pub fn budgets(&self, who: &Identity, tenant: Option<&str>) -> Result<Vec<BudgetView>, GatewayError> {
        if !who.is_admin {
            return Err(GatewayError::new(ErrorCode::PermissionDenied, "admin applications only"));
        }
        if tenant.is_some_and(|t| t != who.tenant) {
            return Err(GatewayError::new(
                ErrorCode::PermissionDenied,
                "an admin application reads its own tenant's budgets only",
            ));
        }
        Ok(self.store.budgets().view(&who.tenant, crate::task::now_ms()))
    }
}
