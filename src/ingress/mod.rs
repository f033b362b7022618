//! Ingresses: the doors into edgeway. Each turns its own wire format into
//! the shared request JSON and a [`crate::task::TaskRequest`] through
//! [`crate::gateway::Gateway::submit`], and renders the shared
//! [`crate::task::TaskEvent`] stream back into its format. None of them
//! calls an engine or touches a queue.

pub mod events;
pub mod http;
pub mod mqtt;
pub mod nats;
