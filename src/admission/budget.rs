//! The budget check of a call: refused `QUOTA_EXCEEDED` while its tenant's
//! or application's daily or monthly budget (tokens or cost) is spent,
//! with the reset time (`retry_after_ms`, `resets_at`).
//!
//! Owns: the refusal and its wording. Does not own: the spent amounts,
//! the windows or the limits in force (`crate::store::budget`), nor where
//! the check runs (the facade, after a repeat of an idempotency key joined
//! its task: a repeat costs nothing and is answered whatever the budget).

use crate::error::{ErrorCode, GatewayError};
use crate::store::budget::{rfc3339, Budgets};
use crate::task::Identity;

/// `Err(QUOTA_EXCEEDED)` when a budget of `who` is spent at `now_ms`.
pub fn check(budgets: &Budgets, who: &Identity, now_ms: i64) -> Result<(), GatewayError> {
    let Some(e) = budgets.check(&who.tenant, &who.application, now_ms) else { return Ok(()) };
    let resets_at = rfc3339(e.resets_at_ms);
    let spent = match e.what {
        "tokens" => format!("{} of {} tokens", e.spent, e.limit),
        _ => format!("a cost of {} of {}", e.spent, e.limit),
    };
    let wait_ms = u64::try_from(e.resets_at_ms.saturating_sub(now_ms)).unwrap_or(0).max(1);
    Err(GatewayError::new(
        ErrorCode::QuotaExceeded,
        format!(
            "the {} budget of {} {:?} is spent ({spent}); it resets at {resets_at}",
            e.period.as_str(),
            e.scope.as_str(),
            e.name
        ),
    )
    .with_retry_after(wait_ms)
    .with_resets_at(resets_at))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spent_budget_is_quota_exceeded_with_its_reset_time() {
        let text = format!(
            "[applications.demo]\ntenant = \"demo\"\napi_key_sha256 = [\"{}\"]\n\
             [engines.a]\ntype = \"openai\"\nbase_url = \"http://127.0.0.1:9\"\nmodel = \"m\"\n\
             [models.chat]\ninstances = [\"a\"]\n[tenants.demo.budget]\ndaily_cost = 0.5\n",
            hex::encode(crate::config::hash_api_key("k"))
        );
        let config =
            crate::config::Config::from_toml_str(&text, std::iter::empty(), std::path::Path::new(".")).unwrap();
        let b = Budgets::default();
        b.configure(&config);
        let who = crate::task::TaskRequest::sample(Vec::new()).identity;
        // 2026-12-02T23:00:00Z: the day resets in an hour.
        let now = 1_796_252_400_000;
        assert!(check(&b, &who, now).is_ok());
        b.charge("demo", "demo", 10, 0.5, now);
        let e = check(&b, &who, now).unwrap_err();
        assert_eq!(e.code, ErrorCode::QuotaExceeded);
        assert_eq!(e.retry_after_ms, Some(3_600_000));
        assert_eq!(e.resets_at.as_deref(), Some("2026-12-03T00:00:00Z"));
        assert!(e.message.contains("daily budget of tenant \"demo\""), "{}", e.message);
    }
}
