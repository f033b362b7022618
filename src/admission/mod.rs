//! Admission: who is calling and whether the call may enter.
//!
//! Owns: authentication ([`auth`]), parsing the shared request JSON (OpenAI
//! chat fields plus edge fields, the same on every ingress) and turning it
//! into a validated [`crate::task::TaskRequest`]: priority rights, model lookup, context
//! budget, timeouts; [`budget`], which refuses a call while its tenant's or
//! application's spending budget is spent; and [`gpu_watch`], which closes
//! admission and cancels work while the GPU is in its danger zone. Does not own: queueing and
//! capacity (scheduler).

pub mod auth;
pub mod budget;
pub mod gpu_watch;
pub mod operation;
pub mod request;

pub use auth::Authenticator;
pub use request::{admit, data_class, disallowed_tool, tools_route, without_tools, ChatRequestBody};
