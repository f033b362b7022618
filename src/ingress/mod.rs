//! Ingresses: the doors into edgeway. Each turns its own wire format into a
//! call of the [`crate::gateway::Gateway`] facade (the shared request JSON,
//! a credential or an identity) and renders the shared
//! [`crate::task::TaskEvent`] stream back into its format.
//!
//! Owns: protocols (HTTP/SSE, MQTT, NATS), their listeners and connections.
//! Does not own: authentication, admission, idempotency, ownership of tasks
//! or counting calls (the facade does each once); none of them calls an
//! engine or touches a queue. An ingress imports only `gateway`,
//! `telemetry`, `config`, `task`, `error` and `tls`.
//!
//! - [`render`]: the event JSON shared by the message ingresses.
//! - [`http`], [`mqtt`], [`nats`]: one module per protocol.

pub mod http;
pub mod mqtt;
pub mod nats;
pub mod render;

use std::time::Duration;

/// The wait before reconnecting to a bus or broker after `failures`
/// failed tries in a row (at least 1): 100 ms doubling up to `max`, with
/// up to 25 % jitter so several nodes do not retry in step. The NATS
/// client and the external MQTT broker's client both use it.
pub(crate) fn reconnect_backoff(failures: u32, max: Duration) -> Duration {
    let base = Duration::from_millis(100).saturating_mul(1u32 << failures.saturating_sub(1).min(16)).min(max);
    let jitter = uuid::Uuid::new_v4().as_u128() as u64 % (base.as_millis() as u64 / 4 + 1);
    base + Duration::from_millis(jitter)
}

/// HMAC (RFC 2104) with hash `D` of `parts`, in order, under `key`:
/// SHA-256 signs the pool's forwards (`nats::forward`), SHA-512 derives
/// Mosquitto's PBKDF2 password hashes (`mqtt::acl`).
pub(crate) fn hmac<D>(key: &[u8], parts: &[&[u8]]) -> sha2::digest::Output<D>
where
    D: sha2::Digest + sha2::digest::core_api::BlockSizeUser,
{
    use sha2::digest::core_api::Block;
    let mut k = Block::<D>::default();
    if key.len() > k.len() {
        let h = D::digest(key);
        k[..h.len()].copy_from_slice(&h);
    } else {
        k[..key.len()].copy_from_slice(key);
    }
    let mut inner = D::new();
    inner.update(k.iter().map(|b| b ^ 0x36).collect::<Block<D>>());
    for p in parts {
        inner.update(p);
    }
    let mut outer = D::new();
    outer.update(k.iter().map(|b| b ^ 0x5c).collect::<Block<D>>());
    outer.update(inner.finalize());
    outer.finalize()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reconnects_back_off_to_the_maximum() {
        let max = Duration::from_secs(5);
        assert!(reconnect_backoff(1, max) >= Duration::from_millis(100));
        assert!(reconnect_backoff(1, max) < Duration::from_millis(130));
        assert!(reconnect_backoff(4, max) >= Duration::from_millis(800));
        assert!(reconnect_backoff(30, max) >= max && reconnect_backoff(30, max) <= max + max / 4);
    }
}
