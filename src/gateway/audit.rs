//! The audit trail for its readers: the admin query (`GET /admin/audit`),
//! the feed the NATS publisher reads, and the time bounds the query and
//! `edgeway audit export` take.
//!
//! Owns: who may read which records (an admin application, its own
//! tenant's only) and the page bound. Does not own: what a record holds or
//! its chain (`store::audit`), nor rendering (ingress).

use std::sync::Arc;

use tokio::sync::broadcast;

use super::{store_failed, Gateway};
use crate::error::{ErrorCode, GatewayError};
use crate::task::Identity;

pub type AuditRecord = crate::store::AuditRecord;
pub type AuditQuery = crate::store::AuditQuery;

/// Records per page at most (`limit` above it is lowered to it).
pub const MAX_AUDIT_PAGE: usize = 1000;
/// The wait a refused audit query is told to take.
const AUDIT_BUSY_RETRY_MS: u64 = 1000;
/// Records per page when the query names no `limit`.
pub const DEFAULT_AUDIT_PAGE: usize = 100;

impl Gateway {
    /// A page of audit records for an admin application: its own tenant's
    /// (`q.tenant` empty means that one; another is refused), oldest first.
    pub async fn audit_page(&self, who: &Identity, mut q: AuditQuery) -> Result<Vec<AuditRecord>, GatewayError> {
        if !who.is_admin {
            return Err(GatewayError::new(ErrorCode::PermissionDenied, "admin applications only"));
        }
        match q.tenant.as_deref() {
            None => q.tenant = Some(who.tenant.clone()),
            Some(t) if t == who.tenant => {}
            Some(_) => {
                return Err(GatewayError::new(
                    ErrorCode::PermissionDenied,
                    "an admin application reads its own tenant's audit records only",
                ))
            }
        }
        q.limit = match q.limit {
            0 => DEFAULT_AUDIT_PAGE,
            n => n.min(MAX_AUDIT_PAGE),
        };
        match self.store.audit(q).await {
            Err(crate::store::StoreError::Busy) => Err(GatewayError::new(
                ErrorCode::RateLimited,
                format!("at most {} audit queries run at once; retry shortly", crate::store::AUDIT_QUERIES_AT_ONCE),
            )
            .with_retry_after(AUDIT_BUSY_RETRY_MS)),
            r => r.map_err(store_failed),
        }
    }

    /// Audit records as they are committed, for the NATS publisher (best
    /// effort: a lagging receiver loses records; the store keeps them).
    pub fn audit_feed(&self) -> broadcast::Receiver<Arc<AuditRecord>> {
        self.store.audit_feed()
    }
}

/// A time bound: unix milliseconds, or RFC 3339 in UTC or with an offset
/// (`2026-12-02T10:00:00Z`, `2026-12-02T11:00:00.5+01:00`), or a bare date
/// (`2026-12-02`, midnight UTC).
pub fn parse_time(s: &str) -> Option<i64> {
    let s = s.trim();
    if let Ok(ms) = s.parse::<i64>() {
        return Some(ms);
    }
    let b = s.as_bytes();
    let num = |from: usize, len: usize| -> Option<i64> {
        let t = s.get(from..from + len)?;
        t.bytes().all(|c| c.is_ascii_digit()).then(|| t.parse().ok())?
    };
    if b.len() < 10 || b[4] != b'-' || b[7] != b'-' {
        return None;
    }
    let (y, m, d) = (num(0, 4)?, num(5, 2)?, num(8, 2)?);
    if !(1..=12).contains(&m) || !(1..=31).contains(&d) {
        return None;
    }
    let days = days_from_civil(y, m, d);
    if b.len() == 10 {
        return Some(days * 86_400_000);
    }
    if b.len() < 20 || !matches!(b[10], b'T' | b't' | b' ') || b[13] != b':' || b[16] != b':' {
        return None;
    }
    let (hh, mm, ss) = (num(11, 2)?, num(14, 2)?, num(17, 2)?);
    if hh > 23 || mm > 59 || ss > 60 {
        return None;
    }
    let mut i = 19;
    let mut frac_ms = 0;
    if b.get(i) == Some(&b'.') {
        let start = i + 1;
        i = start;
        while b.get(i).is_some_and(u8::is_ascii_digit) {
            i += 1;
        }
        if i == start {
            return None;
        }
        let digits = &s[start..i.min(start + 3)];
        frac_ms = digits.parse::<i64>().ok()? * 10i64.pow(3 - digits.len() as u32);
    }
    let offset_min = match &s[i..] {
        "Z" | "z" => 0,
        o if o.len() == 6 && matches!(o.as_bytes()[0], b'+' | b'-') && o.as_bytes()[3] == b':' => {
            let sign = if o.starts_with('-') { -1 } else { 1 };
            sign * (num(i + 1, 2)? * 60 + num(i + 4, 2)?)
        }
        _ => return None,
    };
    Some(((days * 86_400 + hh * 3600 + mm * 60 + ss - offset_min * 60) * 1000) + frac_ms)
}

/// Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's
/// algorithm).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::parse_time;

    #[test]
    fn time_bounds_parse() {
        assert_eq!(parse_time("1764669600000"), Some(1_764_669_600_000));
        assert_eq!(parse_time("1970-01-01"), Some(0));
        assert_eq!(parse_time("2026-12-02T10:00:00Z"), Some(1_796_205_600_000));
        assert_eq!(parse_time("2026-12-02T11:00:00.5+01:00"), Some(1_796_205_600_500));
        assert_eq!(parse_time("2000-02-29T00:00:00Z"), Some(951_782_400_000));
        for bad in
            ["", "yesterday", "2026-13-01", "2026-12-02T10:00", "2026-12-02T10:00:00", "2026-12-02T10:00:00+0100"]
        {
            assert_eq!(parse_time(bad), None, "{bad}");
        }
    }
}
