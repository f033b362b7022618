//! Admission: who is calling and whether the call may enter.
//!
//! Owns: authentication ([`auth`]), parsing the shared request JSON (OpenAI
//! chat fields plus edge fields, the same on every ingress) and turning it
//! into a validated [`TaskRequest`]: priority rights, model lookup, context
//! budget, timeouts. Does not own: queueing and capacity (scheduler).

pub mod auth;
pub mod request;
pub mod resources;

pub use auth::Authenticator;
pub use request::{admit, ChatRequestBody};
