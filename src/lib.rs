//! edgeway: an edge AI gateway. Every AI call on the machine enters through
//! it, becomes a task with a recorded life cycle, waits its turn in one
//! priority scheduler and runs on a local inference engine.
//!
//! # Pipeline
//!
//! ```text
//! ingress ─▶ admission ─▶ context ─▶ scheduler ─▶ router ─▶ engine adapter ─▶ engine
//!  (http)    (identity,   (token      (queues,     (logical   (OpenAI-compatible,
//!            validation)   budget)     slots,       model →    Ollama)
//!                                      timeouts)    instance)
//!    ◀──────────── TaskEvent stream (Accepted, Delta…, Done | Error) ◀──────────┘
//! every transition ─▶ store (SQLite), telemetry (Prometheus, logs), NATS (lifecycle events)
//! ```
//!
//! # Layout
//! - [`ingress`]: the doors (HTTP/SSE, MQTT, NATS); render [`task::TaskEvent`]s;
//!   NATS also carries every task's lifecycle events to internal services.
//! - [`admission`]: API keys and JWTs, request JSON → [`task::TaskRequest`].
//! - [`context`]: token estimates and context-window fit.
//! - [`scheduler`]: the actor that owns queues and slots, and task drivers.
//! - [`router`]: logical model → engine instance.
//! - [`engine`]: one trait, adapters per wire protocol, health probes.
//! - [`store`]: SQLite task and transition records on a dedicated thread.
//! - [`telemetry`]: Prometheus metrics and structured logs.
//! - [`config`]: TOML + environment → validated typed config.
//! - [`error`]: the public error codes; [`task`]: the shared task model.
//! - [`gateway`]: the facade every ingress calls (auth, admission,
//!   idempotency, ownership, counting); [`server`]: wiring, listeners and
//!   shutdown.
//! - `testing` (cargo feature `testing`, on in tests and benches only):
//!   fake engines, a NATS launcher and an in-process test gateway.

pub mod admission;
pub mod config;
pub mod context;
pub mod engine;
pub mod error;
pub mod gateway;
pub mod ingress;
pub mod router;
pub mod scheduler;
pub mod server;
pub mod store;
pub mod task;
pub mod telemetry;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod tls;
