//! Audit records on the bus: each record, once committed to the store, as
//! its JSON (the stored record with `seq`, `prev_sha256` and `sha256`) on
//! `{prefix}.audit.{tenant}` (e.g. `ai.v1.audit.demo`). Never prompt or
//! answer text (records hold none).
//!
//! Best effort: the store offers records on a bounded broadcast, read by
//! one task here, so neither a task nor the store's writer ever waits for
//! the bus. Records are published while the bus is connected; those that
//! arrive while it is not, or that a slow bus makes this reader miss, are
//! not published (the store keeps every one: `GET /admin/audit`,
//! `edgeway audit export`).
//!
//! Owns: the audit subject. Does not own: the records (store) or the
//! connection (`super`).

use std::sync::Arc;

use bytes::Bytes;
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::{subject_token, BusState, NatsStatus};
use crate::config::NatsConfig;
use crate::gateway::AuditRecord;

/// The subject of one audit record.
pub fn audit_subject(cfg: &NatsConfig, tenant: &str) -> String {
    format!("{}.audit.{}", cfg.prefix, subject_token(tenant))
}

pub fn spawn_publisher(
    client: async_nats::Client,
    cfg: NatsConfig,
    status: NatsStatus,
    mut rx: broadcast::Receiver<Arc<AuditRecord>>,
    tracker: &TaskTracker,
    shutdown: CancellationToken,
) {
    tracker.spawn(async move {
        let mut missed = 0u64;
        loop {
            let r = tokio::select! {
                r = rx.recv() => r,
                _ = shutdown.cancelled() => break,
            };
            let rec = match r {
                Ok(rec) => rec,
                Err(broadcast::error::RecvError::Lagged(n)) => {
                    missed += n;
                    tracing::warn!(missed, "audit records not published: the bus publisher fell behind");
                    continue;
                }
                Err(broadcast::error::RecvError::Closed) => break,
            };
            if status.state() != BusState::Connected {
                continue;
            }
            let Ok(payload) = serde_json::to_vec(&*rec) else { continue };
            let subject = audit_subject(&cfg, &rec.entry.tenant);
            tokio::select! {
                r = client.publish(subject, Bytes::from(payload)) => {
                    if let Err(e) = r {
                        tracing::debug!(error = %e, seq = rec.seq, "audit record not published");
                    }
                }
                _ = shutdown.cancelled() => break,
            }
        }
    });
}
