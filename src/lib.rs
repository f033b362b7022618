//! edgeway: an edge AI gateway. Every AI call on the machine enters through
//! it, becomes a task with a recorded life cycle, waits its turn in one
//! priority scheduler and runs on a local inference engine.
//!
//! # Pipeline
//!
//! ```text
//! ingress ─▶ gateway ─▶ admission ─▶ context ─▶ scheduler ─▶ router ─▶ engine adapter ─▶ engine
//! (HTTP/SSE,  (facade:   (identity,   (token     (queues,     (instance   (wire protocol:
//!  MQTT,       auth,      request →    budget)    slots,       state,      OpenAI-compatible,
//!  NATS)       idem-      TaskRequest)            deadlines,   health,     Ollama)
//!              potency,                           life cycle)  dispatch,
//!              owner-                                          resend,
//!              ship)                                           error codes)
//!    ◀──────────── TaskEvent stream (Accepted, Queued…, Delta…, Done | Error) ◀──────────┘
//! every transition ─▶ telemetry (Recorder: state machine, Prometheus, logs) ─▶ store (SQLite)
//!                     and NATS lifecycle events
//! ```
//!
//! Imports follow the data, one way: a module uses only modules to its
//! right above (and telemetry, store, then `config`, `task`, `error` at the
//! bottom, which use nothing above them). An ingress uses only the
//! [`gateway`] facade and that bottom layer. `server` wires it all;
//! `tests/architecture.rs` fails on any import against the direction.
//!
//! # Layout
//! - [`server`]: builds every component from the config, opens the
//!   listeners, shuts down with a grace period.
//! - [`ingress`]: the doors (HTTP/SSE, MQTT with its embedded broker or as a
//!   client of an external one, NATS);
//!   render [`task::TaskEvent`]s; NATS also carries every task's lifecycle
//!   events to internal services.
//! - [`gateway`]: the facade every ingress calls: authentication, parsing,
//!   admission, idempotency, ownership of tasks, request counting, crash
//!   recovery, readiness.
//! - [`admission`]: API keys and JWTs, request JSON → [`task::TaskRequest`],
//!   the GPU watchdog that closes admission.
//! - [`context`]: token estimates and context-window fit.
//! - [`scheduler`]: the actor that owns queues and slots (a pure policy
//!   inside it), the registry of live tasks, one driver per task.
//! - [`router`]: engine instances and their health probes, the choice of
//!   instance, dispatch (opening the engine stream, resend before any
//!   answer, engine failure → public error code).
//! - [`engine`]: one trait, one adapter per wire protocol.
//! - [`telemetry`]: Prometheus metrics, structured logs, and the lifecycle
//!   recorder that enforces the task state machine.
//! - [`store`]: SQLite records of tasks, transitions, idempotency keys,
//!   pending requests and revoked keys, on a dedicated writer thread.
//! - [`config`]: TOML + environment → validated typed config (plain data).
//! - [`task`]: the shared task model; [`error`]: the public error codes;
//!   [`tls`]: the process's one crypto provider.
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
