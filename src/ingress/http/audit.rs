//! `GET /admin/audit?tenant=&since=&until=&after=&limit=`: a bounded page
//! of audit records, oldest first, for an admin application (its own
//! tenant's only; `tenant` may name it or be left out).
//!
//! `since` (inclusive) and `until` (exclusive) are unix milliseconds or
//! RFC 3339; `limit` defaults to 100 and is lowered to 1000; `after` is the
//! `seq` of the last record of the previous page (the body's `next_after`,
//! `null` on the last page).
//!
//! Owns: the query string and the page's JSON. Does not own: who may read
//! (gateway) or the records (store).

use std::sync::Arc;

use axum::extract::State;
use axum::http::Uri;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use super::caller::Caller;
use super::errors::ApiError;
use crate::error::{ErrorCode, GatewayError};
use crate::gateway::{parse_time, AuditQuery, Gateway};

pub async fn page(State(gw): State<Arc<Gateway>>, Caller(who): Caller, uri: Uri) -> Result<Response, ApiError> {
    let q = parse_query(uri.query().unwrap_or(""))?;
    let limit = q.limit;
    let records = gw.audit_page(&who, q).await?;
    let next_after = (limit > 0 && records.len() >= limit.min(crate::gateway::MAX_AUDIT_PAGE)
        || limit == 0 && records.len() >= crate::gateway::DEFAULT_AUDIT_PAGE)
        .then(|| records.last().map(|r| r.seq))
        .flatten();
    Ok(Json(json!({ "records": records, "next_after": next_after })).into_response())
}

fn bad(msg: String) -> ApiError {
    GatewayError::new(ErrorCode::InvalidRequest, msg).into()
}

fn parse_query(raw: &str) -> Result<AuditQuery, ApiError> {
    let mut q = AuditQuery::default();
    for pair in raw.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let v = decode(v).ok_or_else(|| bad(format!("{k}: not valid percent-encoded UTF-8")))?;
        let time = |v: &str| parse_time(v).ok_or_else(|| bad(format!("{k}: expected unix milliseconds or RFC 3339")));
        match k {
            "tenant" if !v.is_empty() => q.tenant = Some(v),
            "tenant" => {}
            "since" => q.since_ms = Some(time(&v)?),
            "until" => q.until_ms = Some(time(&v)?),
            "after" => q.after_seq = Some(v.parse().map_err(|_| bad("after: expected a record's seq".into()))?),
            "limit" => {
                q.limit =
                    v.parse().ok().filter(|n| *n > 0).ok_or_else(|| bad("limit: expected a positive count".into()))?
            }
            other => {
                return Err(bad(format!("unknown query parameter {:?}", other.chars().take(64).collect::<String>())))
            }
        }
    }
    Ok(q)
}

/// Percent-decoding of a query value (`+` is a space).
pub(super) fn decode(v: &str) -> Option<String> {
    let b = v.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' => {
                let h = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
                out.push(u8::from_str_radix(h, 16).ok()?);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_query_string_parses_and_refuses_what_it_does_not_know() {
        let q = parse_query("tenant=a%20b&since=2026-12-02T10%3A00%3A00Z&until=5&after=7&limit=3").unwrap();
        assert_eq!(q.tenant.as_deref(), Some("a b"));
        assert_eq!((q.since_ms, q.until_ms, q.after_seq, q.limit), (Some(1_796_205_600_000), Some(5), Some(7), 3));
        for bad in ["since=yesterday", "limit=0", "limit=x", "after=x", "prompt=1", "tenant=%zz"] {
            assert!(parse_query(bad).is_err(), "{bad}");
        }
    }
}
