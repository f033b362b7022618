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
