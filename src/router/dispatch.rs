//! Dispatch: opening the engine stream for a task that holds a slot, and
//! what a client is told when the engine fails.
//!
//! Owns: the resend-before-any-answer rule, which failures may be retried
//! on another attempt (before the first token only; the driver decides
//! whether to, within the task's deadlines and the retry budget), what
//! each outcome tells the instance's breaker, and the mapping of
//! [`EngineError`]s to public codes. Does not own: deadlines (the driver
//! races [`Router::open`] and the stream against them) or which instance
//! (the slot names it).
//!
//! # Cancel safety
//! Dropping the future of [`Router::open`] drops the engine's HTTP request,
//! which is how the engine learns the client is gone.

use futures::StreamExt;

use super::breaker::Attempt;
use super::Router;
use crate::engine::residency::{Lease, Refused};
use crate::engine::{truncate, EngineError, EngineRequest, EngineStream};
use crate::error::{ErrorCode, GatewayError};

/// The retry label of an attempt that met a supervised engine process
/// that is down and being restarted: a task's first such attempt is not a
/// failure (the driver neither counts it nor spends the retry budget on
/// it); later ones are.
pub const ENGINE_RESTARTING: &str = "engine_restarting";

/// An engine failure as the client sees it, with the reason for the record
/// ([`EngineError::class`]: the record is shown to callers, so the engine's
/// own text goes to the debug log only).

#[derive(Debug)]
pub struct DispatchError {
    pub error: GatewayError,
    pub reason: String,
    /// Another attempt (elsewhere, or later) may succeed, and no output
    /// reached the client: connection refused or lost, 5xx, 429, a stream
    /// that ended before its first token. Never a 4xx or anything after
    /// the first token.
    pub retryable: Option<&'static str>,
}

impl Router {
    /// Starts `req` on instance `i`. A request whose connection broke
    /// before any answer ([`EngineError::ConnectionLost`]: the engine closed
    /// a kept-alive connection just as it was reused) is sent once more, on
    /// a fresh connection; the engine dropped the first attempt when it saw
    /// the connection close, as it does for any disconnect, so nothing runs
    /// twice. Nothing else is sent again here.
    pub async fn open(&self, i: usize, req: &EngineRequest) -> Result<EngineStream, DispatchError> {
        self.open_before(i, req, None).await
    }

    /// [`Router::open`] for a task whose first token is due by
    /// `first_token_by`: an instance whose model is not in memory loads it
    /// first (the task waits), unless the load, as long as the last one
    /// took, would not be done by then: the load goes on for the tasks
    /// after, and this one is told to take the next step (retryable
    /// `model_loading`).
    pub async fn open_before(
        &self,
        i: usize,
        req: &EngineRequest,
        first_token_by: Option<std::time::Instant>,
    ) -> Result<EngineStream, DispatchError> {
        let lease = self.acquire_model(i, first_token_by, crate::task::Priority::P2).await?;
        self.open_leased(i, req, lease).await
    }

    /// The first half of [`Router::open_before`]: instance `i`'s model, in
    /// memory (loaded first if need be, while the task waits), or the
    /// refusal that sends the task to its next step. For a caller that
    /// tells its task's client about the wait before it, and about the
    /// dispatch after it.
    pub async fn acquire_model(
        &self,
        i: usize,
        first_token_by: Option<std::time::Instant>,
        priority: crate::task::Priority,
    ) -> Result<Lease, DispatchError> {
        self.residency.acquire(i, first_token_by, priority).await.map_err(|refused| self.refused(i, refused))
    }

    /// The second half of [`Router::open_before`]: starts `req` on instance
    /// `i`, whose model `lease` holds in memory while the stream lives.
    pub async fn open_leased(
        &self,
        i: usize,
        req: &EngineRequest,
        lease: Lease,
    ) -> Result<EngineStream, DispatchError> {
        self.attempt_started(i);
        let engine = &self.instance(i).engine;
        let first = match engine.stream(req).await {
            Ok(s) => return Ok(hold(s, lease)),
            Err(e) => e,
        };
        let last = match first {
            EngineError::ConnectionLost(_) => {
                tracing::debug!(engine = %self.instance(i).name, error = %first, "engine connection broke before the answer; sending once more");
                match engine.stream(req).await {
                    Ok(s) => return Ok(hold(s, lease)),
                    Err(e) => e,
                }
            }
            e => e,
        };
        Err(self.failed(i, last, false))
    }

    /// A task the instance's model cannot take now (no attempt reached the
    /// engine, so its breaker is not told).
    fn refused(&self, i: usize, refused: Refused) -> DispatchError {
        let name = &self.instance(i).name;
        match refused {
            Refused::WouldMissDeadline { loading_for, expected } => {
                tracing::info!(engine = %name, loading_ms = loading_for.as_millis() as u64, expected_ms = expected.as_millis() as u64, "model is loading; the task takes the next step to keep its first-token deadline");
                DispatchError {
                    error: GatewayError::new(ErrorCode::ModelUnavailable, "the model is loading")
                        .with_retry_after(expected.saturating_sub(loading_for).as_millis().clamp(100, 60_000) as u64),
                    reason: format!(
                        "model loading for {} ms (a load takes about {} ms)",
                        loading_for.as_millis(),
                        expected.as_millis()
                    ),
                    retryable: Some("model_loading"),
                }
            }
            Refused::LoadFailed(why) => {
                tracing::warn!(engine = %name, error = %why, "model could not be loaded for a task");
                DispatchError {
                    error: GatewayError::new(ErrorCode::ModelUnavailable, "the model could not be loaded")
                        .with_retry_after(2000),
                    reason: "model load failed".into(),
                    retryable: Some("model_load_failed"),
                }
            }
            Refused::Forbidden => DispatchError {
                error: GatewayError::new(ErrorCode::PolicyBlocked, "the model is forbidden on this node"),
                reason: "model forbidden on this node".into(),
                retryable: Some("model_forbidden"),
            },
        }
    }

    /// An engine stream that failed after it was opened (`mid_stream` once
    /// any token has arrived).
    pub fn stream_failed(&self, i: usize, e: EngineError, mid_stream: bool) -> DispatchError {
        self.failed(i, e, mid_stream)
    }

    fn failed(&self, i: usize, e: EngineError, mid_stream: bool) -> DispatchError {
        tracing::debug!(engine = %self.instance(i).name, error = %truncate(&e.to_string(), 500), mid_stream, "engine error");
        if e.is_unreachable() {
            self.request_recheck(i);
        }
        // The supervised process is down (killed, restarting): the request
        // reached no engine, so it says nothing of the engine (the breaker
        // is not told, as the probes do not tell it), and the driver
        // retries it without counting a failure or spending the retry
        // budget; while no instance can take it, it queues until the
        // process is back.
        let engine = &self.instance(i).engine;
        if !mid_stream && e.is_unreachable() && engine.process_down() {
            self.attempt_abandoned(i);
            let restarting = engine.process_restarting();
            let error = GatewayError::new(
                ErrorCode::ModelUnavailable,
                if restarting { "the model's engine is restarting" } else { "the model's engine is not reachable" },
            )
            .with_retry_after(2000);
            let retryable = Some(if restarting { ENGINE_RESTARTING } else { "unreachable" });
            return DispatchError { error, reason: e.class(), retryable };
        }
        // What it tells the breaker: a 4xx is the request's fault, not the
        // instance's (a 429 is the instance's: it is overloaded).
        let attempt = match &e {
            EngineError::Status { status, body } if *status >= 500 && out_of_memory(body) => Some(Attempt::OutOfMemory),
            EngineError::Remote(text) if out_of_memory(text) => Some(Attempt::OutOfMemory),
            EngineError::Status { status, .. } if *status < 500 && *status != 429 => None,
            _ => Some(Attempt::Failure),
        };
        match attempt {
            Some(a) => self.attempt_ended(i, a),
            None => self.attempt_abandoned(i),
        }
        let retryable = if mid_stream {
            None
        } else {
            match &e {
                EngineError::Unreachable(_) | EngineError::ConnectionLost(_) => Some("unreachable"),
                EngineError::Status { status: 429, .. } => Some("engine_429"),
                EngineError::Status { status, .. } if *status >= 500 => Some("engine_5xx"),
                // The body broke off or made no sense before any token
                // (an engine killed while answering): nothing reached the
                // client, another instance may answer.
                EngineError::Truncated | EngineError::Protocol(_) => Some("truncated"),
                _ => None,
            }
        };
        let forwarded = engine.kind() == crate::config::EngineKind::Pool;
        let error = if mid_stream && forwarded {
            GatewayError::internal(
                "the node this task was forwarded to failed or vanished while generating; the output is partial",
            )
            .with_partial()
        } else if mid_stream {
            GatewayError::internal("the engine failed while generating; the output is partial").with_partial()
        } else if e.is_unreachable() {
            GatewayError::new(ErrorCode::ModelUnavailable, "the model's engine is not reachable").with_retry_after(2000)
        } else if matches!(e, EngineError::Status { status: 429, .. }) {
            GatewayError::new(ErrorCode::ModelUnavailable, "the model's engine is overloaded").with_retry_after(2000)
        } else if matches!(e, EngineError::Status { status, .. } if status < 500) {
            GatewayError::internal("the engine refused the request")
        } else {
            GatewayError::internal("the engine failed before answering")
        };
        let mut reason = e.class();
        if attempt == Some(Attempt::OutOfMemory) {
            reason.push_str(" (out of memory)");
        }
        DispatchError { error, reason, retryable }
    }
}

/// Keeps the model's lease as long as its stream lives: the model is not
/// unloaded under a running answer, and its idle time starts when the
/// stream is dropped.
fn hold(s: EngineStream, lease: Lease) -> EngineStream {
    s.map(move |item| {
        let _ = &lease;
        item
    })
    .boxed()
}

/// Whether an engine's error text says it ran out of memory (llama.cpp,
/// vLLM and CUDA say it in so many words; "OOM" only as a word of its
/// own, so "room" or "zoom" do not count).
fn out_of_memory(text: &str) -> bool {
    let t = text.to_ascii_lowercase();
    t.contains("out of memory")
        || t.contains("failed to allocate")
        || t.contains("insufficient memory")
        || t.split(|c: char| !c.is_ascii_alphanumeric()).any(|w| w == "oom")
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;
    use std::sync::Arc;
    use std::time::Duration;

    use futures::StreamExt;

    use super::*;
    use crate::engine::EngineChunk;
    use crate::router::test_engine::{self, Scripted};
    use crate::task::SamplingParams;

    fn router(engine: Arc<Scripted>) -> Router {
        test_engine::router(engine, Duration::from_secs(3600))
    }

    fn request() -> EngineRequest {
        EngineRequest {
            model: "m".into(),
            messages: Vec::new(),
            params: SamplingParams::default(),
            max_output_tokens: 4,
            tools: None,
            operation: Default::default(),
            slot: None,
            traceparent: None,
            origin: None,
        }
    }

    fn lost() -> EngineError {
        EngineError::ConnectionLost("connection closed before message completed".into())
    }

    #[tokio::test]
    async fn a_lost_connection_is_sent_once_more_and_only_once() {
        let ok = vec![Ok(EngineChunk::Delta("hi".into())), Ok(EngineChunk::Finish("stop".into()))];
        let engine = Arc::new(Scripted::streams(vec![Err(lost()), Ok(ok)]));
        let r = router(engine.clone());
        let items: Vec<_> = r.open(0, &request()).await.expect("second attempt answers").collect().await;
        assert_eq!(items.len(), 2);
        assert_eq!(engine.sent.load(Ordering::SeqCst), 2);

        let engine = Arc::new(Scripted::streams(vec![Err(lost()), Err(lost())]));
        let e = router(engine.clone()).open(0, &request()).await.map(|_| ()).unwrap_err();
        assert_eq!(e.error.code, ErrorCode::ModelUnavailable);
        assert_eq!(e.error.retry_after_ms, Some(2000));
        assert_eq!(engine.sent.load(Ordering::SeqCst), 2, "never a third time");
    }

    #[tokio::test]
    async fn other_failures_are_not_sent_again_and_map_to_public_codes() {
        // Each engine text carries the prompt back, as engines' errors do.
        let cases = [
            (
                EngineError::Unreachable("refused: my secret prompt".into()),
                ErrorCode::ModelUnavailable,
                "engine not reachable",
            ),
            (
                EngineError::Status { status: 503, body: "loading; my secret prompt".into() },
                ErrorCode::ModelUnavailable,
                "engine answered 503",
            ),
            (
                EngineError::Status { status: 400, body: "bad: my secret prompt".into() },
                ErrorCode::InternalError,
                "engine answered 400",
            ),
            (
                EngineError::Status { status: 500, body: "CUDA out of memory at my secret prompt".into() },
                ErrorCode::InternalError,
                "engine answered 500 (out of memory)",
            ),
            (
                EngineError::Remote("oops: my secret prompt".into()),
                ErrorCode::InternalError,
                "engine reported an error in its stream",
            ),
        ];
        for (err, code, reason) in cases {
            let text = err.to_string();
            let unreachable = err.is_unreachable();
            let engine = Arc::new(Scripted::streams(vec![Err(err)]));
            let r = router(engine.clone());
            let e = r.open(0, &request()).await.map(|_| ()).unwrap_err();
            // An engine that cannot be reached is probed again at once.
            let rechecked = tokio::time::timeout(Duration::from_millis(1), r.recheck(0).notified()).await.is_ok();
            assert_eq!(rechecked, unreachable, "{text}");
            assert_eq!(e.error.code, code, "{text}");
            assert_eq!(engine.sent.load(Ordering::SeqCst), 1, "{text}");
            // The engine's text is for the debug log only: the record is
            // shown to callers too.
            assert_eq!(e.reason, reason, "{text}");
            assert!(!e.error.message.contains("secret"), "{}", e.error.message);
        }
    }

    #[test]
    fn out_of_memory_is_read_from_the_words_engines_use() {
        for yes in ["CUDA error: out of memory", "failed to allocate KV cache", "OOM", "killed (oom)"] {
            assert!(out_of_memory(yes), "{yes}");
        }
        for no in ["no room in the batch", "zoom", "bad request", ""] {
            assert!(!out_of_memory(no), "{no}");
        }
    }

    #[tokio::test]
    async fn a_failure_after_tokens_is_internal_and_says_so() {
        let r = router(Arc::new(Scripted::streams(Vec::new())));
        let e = r.stream_failed(0, EngineError::Unreachable("reset".into()), true);
        assert_eq!(e.error.code, ErrorCode::InternalError);
        assert!(e.error.message.contains("while generating"), "{}", e.error.message);
        let e = r.stream_failed(0, EngineError::Truncated, false);
        assert_eq!(e.error.code, ErrorCode::InternalError);
    }
}
