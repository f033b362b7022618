//! Dispatch: opening the engine stream for a task that holds a slot, and
//! what a client is told when the engine fails.
//!
//! Owns: the resend-before-any-answer rule and the mapping of
//! [`EngineError`]s to public codes. Does not own: deadlines (the driver
//! races [`Router::open`] and the stream against them) or which instance
//! (the slot names it).
//!
//! # Cancel safety
//! Dropping the future of [`Router::open`] drops the engine's HTTP request,
//! which is how the engine learns the client is gone.

use super::Router;
use crate::engine::{truncate, EngineError, EngineRequest, EngineStream};
use crate::error::{ErrorCode, GatewayError};

/// An engine failure as the client sees it, with the reason for the record
/// (the engine's own text stays in edgeway's record and logs).
#[derive(Debug)]
pub struct DispatchError {
    pub error: GatewayError,
    pub reason: String,
}

impl Router {
    /// Starts `req` on instance `i`. A request whose connection broke
    /// before any answer ([`EngineError::ConnectionLost`]: the engine closed
    /// a kept-alive connection just as it was reused) is sent once more, on
    /// a fresh connection; the engine dropped the first attempt when it saw
    /// the connection close, as it does for any disconnect, so nothing runs
    /// twice. Nothing else is sent again here.
    pub async fn open(&self, i: usize, req: &EngineRequest) -> Result<EngineStream, DispatchError> {
        let engine = &self.instance(i).engine;
        let first = match engine.stream(req).await {
            Ok(s) => return Ok(s),
            Err(e) => e,
        };
        let last = match first {
            EngineError::ConnectionLost(_) => {
                tracing::debug!(engine = %self.instance(i).name, error = %first, "engine connection broke before the answer; sending once more");
                match engine.stream(req).await {
                    Ok(s) => return Ok(s),
                    Err(e) => e,
                }
            }
            e => e,
        };
        Err(self.failed(i, last, false))
    }

    /// An engine stream that failed after it was opened (`mid_stream` once
    /// any token has arrived).
    pub fn stream_failed(&self, i: usize, e: EngineError, mid_stream: bool) -> DispatchError {
        self.failed(i, e, mid_stream)
    }

    fn failed(&self, i: usize, e: EngineError, mid_stream: bool) -> DispatchError {
        if e.is_unreachable() {
            self.request_recheck(i);
        }
        let error = if e.is_unreachable() && !mid_stream {
            GatewayError::new(ErrorCode::ModelUnavailable, "the model's engine is not reachable").with_retry_after(2000)
        } else {
            GatewayError::internal(if mid_stream {
                "the engine failed while generating"
            } else {
                "the engine refused the request"
            })
        };
        DispatchError { error, reason: format!("engine error: {}", truncate(&e.to_string(), 200)) }
    }
}
