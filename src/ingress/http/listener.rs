//! The connection loop of one HTTP listener (business or admin port): what
//! `axum::serve` does, plus the limits a hostile client must meet.
//!
//! Owns: accepting (pausing with a growing back-off when `accept` fails,
//! e.g. at the descriptor limit, instead of spinning), the connection cap
//! (beyond it a new connection gets a 503 `RESOURCE_EXHAUSTED` and is
//! closed), the header read timeout (a client that has not sent a whole
//! request head in time is disconnected: slowloris), the idle timeout, and
//! graceful shutdown (stop accepting, let every request in progress be
//! answered, close). Does not own: routes or anything a request means (the
//! axum router it is given).
//!
//! The idle clock restarts only on request progress: a request arriving, a
//! frame of a request body, a frame of an answer taken by hyper. Bytes that
//! are none (HTTP/2 PINGs, SETTINGS, WINDOW_UPDATEs, which hyper answers on
//! its own) do not, or one client could hold a slot for ever. After
//! `idle_timeout` without progress:
//! - a request body is still arriving (slow POST): cut (`body_timeout`);
//! - an answer waits for the client (slow read: a full socket buffer, or an
//!   HTTP/2 window that stays shut), also after its task ended: cut
//!   (`write_timeout`; a running task is cancelled);
//! - an answer waits for edgeway (a stream waiting for its next token):
//!   nothing; the timeout never cuts an answer edgeway is working on;
//! - nothing is owed: a graceful close (`idle`; HTTP/1.1 closes, HTTP/2 sends
//!   GOAWAY), and if the connection is still open an idle timeout later, it
//!   is dropped. The same hard deadline holds after a graceful close for
//!   shutdown or age.
//!
//! A connection is also closed gracefully at `max_connection_age` (`max_age`),
//! however busy: answers in progress may finish until twice that age, then
//! it is dropped.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use bytes::Bytes;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use prometheus::{IntCounterVec, IntGaugeVec, Opts, Registry};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::error::{ErrorCode, GatewayError};

/// The limits of one listener.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_connections: usize,
    pub header_read_timeout: Duration,
    pub idle_timeout: Duration,
    pub max_connection_age: Duration,
}

/// Connections being refused (waiting for the request, then for the client
/// to read the 503) at once, per listener; beyond this a connection over
/// the cap is closed without an answer (the client sees a reset), so a
/// flood of refusals holds a bounded number of descriptors, each for at
/// most `REFUSAL_LINGER`.
const REFUSING_AT_ONCE: usize = 256;
/// How long a refused connection may take to send its request and read
/// the 503.
const REFUSAL_LINGER: Duration = Duration::from_secs(2);
/// Pauses after a failed `accept`: the first, and the most it grows to.
const ACCEPT_PAUSE_MIN: Duration = Duration::from_millis(10);
const ACCEPT_PAUSE_MAX: Duration = Duration::from_secs(1);

/// The listener metrics, labelled by listener (`main`, `admin`).
#[derive(Clone)]
pub struct HttpMetrics {
    /// Connections open now.
    pub open: IntGaugeVec,
    /// Connections refused at the cap.
    pub refused: IntCounterVec,
    /// Connections closed by edgeway, by reason (`header_timeout`, `idle`,
    /// `body_timeout`, `write_timeout`, `max_age`, `shutdown`).
    pub closed: IntCounterVec,
    /// `accept` failures (descriptor limit, out of memory), each followed by
    /// a pause.
    pub accept_errors: IntCounterVec,
}

impl HttpMetrics {
    pub fn new(registry: &Registry) -> HttpMetrics {
        fn reg<T: prometheus::core::Collector + Clone + 'static>(r: &Registry, c: T) -> T {
            // A second gateway in one process (tests) has its own registry;
            // a failure here only means the metric is already there.
            let _ = r.register(Box::new(c.clone()));
            c
        }
        let counter = |name: &str, help: &str, labels: &[&str]| {
            reg(registry, IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric"))
        };
        HttpMetrics {
            open: reg(
                registry,
                IntGaugeVec::new(
                    Opts::new("http_connections_open", "Open HTTP connections, by listener"),
                    &["listener"],
                )
                .expect("valid metric"),
            ),
            refused: counter(
                "http_connections_refused_total",
                "HTTP connections refused at the listener's connection cap",
                &["listener"],
            ),
            closed: counter(
                "http_connections_closed_total",
                "HTTP connections closed by edgeway, by listener and reason (header_timeout, idle, body_timeout, write_timeout, max_age, shutdown)",
                &["listener", "reason"],
            ),
            accept_errors: counter(
                "http_accept_errors_total",
                "Failed accepts (e.g. at the descriptor limit), each followed by a pause",
                &["listener"],
            ),
        }
    }
}

/// Where connections come from: a TCP listener, or a fake in tests.
pub trait Accept: Send + 'static {
    type Io: AsyncRead + AsyncWrite + Unpin + Send + 'static;
    fn accept(&mut self) -> impl Future<Output = io::Result<Self::Io>> + Send;
}

impl Accept for tokio::net::TcpListener {
    type Io = tokio::net::TcpStream;

    async fn accept(&mut self) -> io::Result<tokio::net::TcpStream> {
        let (tcp, _) = tokio::net::TcpListener::accept(self).await?;
        // Tokens are small writes: without TCP_NODELAY, Nagle's algorithm
        // and delayed ACKs hold them back for up to 40 ms.
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "cannot set TCP_NODELAY");
        }
        Ok(tcp)
    }
}

/// Serves `app` on `listener` until `shutdown`, then waits for the open
/// connections to finish their requests.
pub async fn run<L: Accept>(
    name: &'static str,
    mut listener: L,
    app: Router,
    limits: Limits,
    metrics: HttpMetrics,
    shutdown: CancellationToken,
) {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let refusing = Arc::new(Semaphore::new(REFUSING_AT_ONCE));
    let refusal = Arc::new(refusal_response());
    let conns = TaskTracker::new();
    let mut pause = ACCEPT_PAUSE_MIN;
    loop {
        let accepted = tokio::select! {
            _ = shutdown.cancelled() => break,
            r = listener.accept() => r,
        };
        let io = match accepted {
            Ok(io) => {
                pause = ACCEPT_PAUSE_MIN;
                io
            }
            // The peer gave up before we accepted: nothing to do.
            Err(e) if is_connection_error(&e) => continue,
            Err(e) => {
                // EMFILE/ENFILE/ENOMEM: the pending connection stays in the
                // backlog and `accept` would fail again at once. Pause, so
                // closing connections can free descriptors meanwhile.
                metrics.accept_errors.with_label_values(&[name]).inc();
                tracing::error!(listener = name, error = %e, pause_ms = pause.as_millis() as u64,
                    "cannot accept an HTTP connection; pausing");
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = tokio::time::sleep(pause) => {}
                }
                pause = (pause * 2).min(ACCEPT_PAUSE_MAX);
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            metrics.refused.with_label_values(&[name]).inc();
            if let Ok(r) = refusing.clone().try_acquire_owned() {
                let refusal = refusal.clone();
                conns.spawn(async move {
                    refuse(io, &refusal).await;
                    drop(r);
                });
            }
            continue;
        };
        let (app, metrics, shutdown) = (app.clone(), metrics.clone(), shutdown.clone());
        conns.spawn(async move {
            let open = metrics.open.with_label_values(&[name]);
            open.inc();
            if let Some(reason) = serve_connection(io, app, limits, shutdown).await {
                metrics.closed.with_label_values(&[name, reason]).inc();
            }
            open.dec();
            drop(slot);
        });
    }
    drop(listener);
    conns.close();
    conns.wait().await;
}

fn is_connection_error(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionRefused | io::ErrorKind::ConnectionAborted | io::ErrorKind::ConnectionReset
    )
}

/// The whole HTTP/1.1 answer to a connection over the cap.
fn refusal_response() -> Vec<u8> {
    let e = GatewayError::new(ErrorCode::ResourceExhausted, "too many open connections; retry shortly")
        .with_retry_after(1000);
    let body = serde_json::json!({ "error": super::errors::error_object(&e) }).to_string();
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n\
         connection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Writes the 503 and closes. The answer waits for the client's first
/// bytes (an HTTP client treats an answer before its request as a broken
/// connection, not as an answer); what the client sends is read and
/// discarded until it closes, for a moment, because closing a socket with
/// unread input resets it and the client would lose the answer.
async fn refuse<Io: AsyncRead + AsyncWrite + Unpin>(mut io: Io, answer: &[u8]) {
    let _ = tokio::time::timeout(REFUSAL_LINGER, async {
        let mut sink = [0u8; 4096];
        if io.read(&mut sink).await? == 0 {
            return Ok(());
        }
        io.write_all(answer).await?;
        io.shutdown().await?;
        while io.read(&mut sink).await? > 0 {}
        Ok::<_, io::Error>(())
    })
    .await;
}

/// Serves one connection to its end. Returns why edgeway closed it, when it
/// did (`header_timeout`, `idle`, `body_timeout`, `write_timeout`,
/// `max_age`, `shutdown`).
async fn serve_connection<Io: AsyncRead + AsyncWrite + Unpin + Send + 'static>(
    io: Io,
    app: Router,
    limits: Limits,
    shutdown: CancellationToken,
) -> Option<&'static str> {
    let start = Instant::now();
    let conn_state = Arc::new(ConnState::new(start));
    let io = TokioIo::new(Watched { inner: io, state: conn_state.clone() });
    let svc = {
        let state = conn_state.clone();
        let inner = TowerToHyperService::new(app);
        hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
            if !state.first_request.swap(true, Ordering::Relaxed) {
                state.first_arrived.notify_one();
            }
            state.touch();
            let req = req.map(|b| WatchedBody::new(b, &state));
            // The answer is owed from now on; edgeway is the one to wait
            // for until the handler has answered.
            let answer = Count::new_in(&state, |s| &s.answers);
            let handling = Count::new_in(&state, |s| &s.waiting);
            let call = hyper::service::Service::call(&inner, req);
            let state = state.clone();
            async move {
                let res = call.await?;
                drop(handling);
                Ok::<_, std::convert::Infallible>(res.map(|b| WatchedAnswer::new(b, state, answer)))
            }
        })
    };
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder.http1().timer(TokioTimer::new()).header_read_timeout(limits.header_read_timeout);
    builder.http2().timer(TokioTimer::new());
    // With upgrades: `/v1/ws` takes the connection over after its 101.
    let conn = builder.serve_connection_with_upgrades(io, svc);
    tokio::pin!(conn);
    let s = &conn_state;
    // Why and since when edgeway is closing the connection gracefully.
    let mut closing: Option<(&'static str, Instant)> = None;
    // When the idle check last found nothing to cut: the next one is an
    // idle timeout later, also while a graceful close is under way (a
    // client may stop reading or sending after it began).
    let mut checked = start;
    let max_age = start + limits.max_connection_age;
    // Answers still running at `max_age` may finish until then.
    let hard_age = max_age + limits.max_connection_age;
    loop {
        let deadline = if !s.first_request.load(Ordering::Relaxed) {
            start + limits.header_read_timeout
        } else {
            let idle = s.last().max(checked) + limits.idle_timeout;
            idle.min(if closing.is_none() { max_age } else { hard_age })
        };
        tokio::select! {
            r = conn.as_mut() => {
                return match r {
                    Err(e) if is_header_timeout(&*e) => Some("header_timeout"),
                    Err(e) => {
                        tracing::debug!(error = %e, "HTTP connection ended with an error");
                        closing.map(|c| c.0)
                    }
                    Ok(()) => closing.map(|c| c.0),
                };
            }
            // The deadline changes from the header's to the idle one.
            _ = s.first_arrived.notified(), if !s.first_request.load(Ordering::Relaxed) => {}
            _ = shutdown.cancelled(), if closing.is_none() => {
                if !s.first_request.load(Ordering::Relaxed) {
                    // Nothing asked yet (hyper would wait for a half-sent
                    // first head): nothing to finish.
                    return Some("shutdown");
                }
                closing = Some(("shutdown", Instant::now()));
                conn.as_mut().graceful_shutdown();
            }
            _ = tokio::time::sleep_until(deadline) => {
                if !s.first_request.load(Ordering::Relaxed) {
                    // Dropping the connection closes the socket.
                    return Some("header_timeout");
                }
                let now = Instant::now();
                if now >= hard_age {
                    return Some(closing.map_or("max_age", |c| c.0));
                }
                if closing.is_none() && now >= max_age {
                    // GOAWAY for HTTP/2, close after the answer for
                    // HTTP/1.1: the client reconnects, and one connection
                    // cannot hold a slot for ever however busy it keeps it.
                    closing = Some(("max_age", now));
                    conn.as_mut().graceful_shutdown();
                    checked = now;
                    continue;
                }
                if now >= s.last() + limits.idle_timeout {
                    let waiting = s.waiting.load(Ordering::Relaxed);
                    if s.write_blocked.load(Ordering::Relaxed) || s.answers.load(Ordering::Relaxed) > waiting {
                        // An answer waits for a client that stopped reading
                        // (slow read; HTTP/2: a closed window): it would
                        // hold the connection, and its task an engine slot,
                        // for ever.
                        return Some("write_timeout");
                    }
                    if s.bodies.load(Ordering::Relaxed) > 0 {
                        // A request body stalled (slow POST): closing
                        // gracefully would wait for it for ever.
                        return Some("body_timeout");
                    }
                    if waiting == 0 {
                        match closing {
                            None => {
                                closing = Some(("idle", now));
                                conn.as_mut().graceful_shutdown();
                            }
                            // Closing for an idle timeout already and still
                            // open (a client ignoring GOAWAY, bytes that
                            // cannot be flushed): the hard deadline.
                            Some((reason, since)) if now >= since + limits.idle_timeout => return Some(reason),
                            Some(_) => {}
                        }
                    }
                    checked = now;
                }
            }
        }
    }
}

fn is_header_timeout(e: &(dyn std::error::Error + 'static)) -> bool {
    e.downcast_ref::<hyper::Error>().is_some_and(hyper::Error::is_timeout)
}

/// What one connection is doing, for its limits. Only request progress
/// restarts the idle clock: a request arriving, a frame of a request body,
/// a frame of an answer. Bytes that are no progress (HTTP/2 PINGs,
/// SETTINGS, WINDOW_UPDATEs, which hyper answers on its own) do not, or
/// one client could hold a slot for ever with a PING every minute.
struct ConnState {
    start: Instant,
    /// Milliseconds since `start` of the last progress.
    last_ms: AtomicU64,
    /// A write is waiting for the client to read (the socket's buffer is
    /// full).
    write_blocked: AtomicBool,
    /// Whether a request head has arrived. hyper's HTTP/1 header timeout
    /// starts only once it knows the protocol; a client that sends nothing,
    /// or part of the HTTP/2 preface, is bounded by this instead.
    first_request: AtomicBool,
    /// Wakes the connection loop to switch from the header deadline to
    /// the idle one.
    first_arrived: tokio::sync::Notify,
    /// Request bodies being received: a client that stops sending one is
    /// not waiting for us, so the idle timeout cuts it.
    bodies: AtomicUsize,
    /// Answers owed: from the request until the answer's last frame.
    answers: AtomicUsize,
    /// Of `answers`, those waiting for edgeway (the handler has not
    /// answered yet, or the body has no next frame yet: a stream waiting
    /// for its next token). The others wait for the client to take their
    /// next frame.
    waiting: AtomicUsize,
}

impl ConnState {
    fn new(start: Instant) -> ConnState {
        ConnState {
            start,
            last_ms: AtomicU64::new(0),
            write_blocked: AtomicBool::new(false),
            first_request: AtomicBool::new(false),
            first_arrived: tokio::sync::Notify::new(),
            bodies: AtomicUsize::new(0),
            answers: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
        }
    }

    fn touch(&self) {
        self.last_ms.store(self.start.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    fn last(&self) -> Instant {
        self.start + Duration::from_millis(self.last_ms.load(Ordering::Relaxed))
    }
}

/// One in a counter, until dropped.
struct Count(Arc<ConnState>, fn(&ConnState) -> &AtomicUsize);

impl Count {
    fn new_in(state: &Arc<ConnState>, which: fn(&ConnState) -> &AtomicUsize) -> Count {
        which(state).fetch_add(1, Ordering::Relaxed);
        Count(state.clone(), which)
    }
}

impl Drop for Count {
    fn drop(&mut self) {
        (self.1)(&self.0).fetch_sub(1, Ordering::Relaxed);
    }
}

/// A request body, counted in its connection's `bodies` until it has been
/// received in full (or dropped); each frame is progress.
struct WatchedBody {
    inner: Incoming,
    state: Arc<ConnState>,
    receiving: Option<Count>,
}

impl WatchedBody {
    fn new(inner: Incoming, state: &Arc<ConnState>) -> WatchedBody {
        let receiving = (!inner.is_end_stream()).then(|| Count::new_in(state, |s| &s.bodies));
        WatchedBody { inner, state: state.clone(), receiving }
    }
}

impl Body for WatchedBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let r = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(_))) = r {
            self.state.touch();
        }
        if matches!(r, Poll::Ready(None) | Poll::Ready(Some(Err(_)))) || self.inner.is_end_stream() {
            self.receiving = None;
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// An answer's body: each frame taken is progress; while it has no next
/// frame it counts as waiting for edgeway, otherwise for the client.
struct WatchedAnswer<B> {
    inner: B,
    state: Arc<ConnState>,
    owed: Option<Count>,
    waiting: Option<Count>,
}

impl<B> WatchedAnswer<B> {
    fn new(inner: B, state: Arc<ConnState>, owed: Count) -> WatchedAnswer<B> {
        WatchedAnswer { inner, state, owed: Some(owed), waiting: None }
    }
}

impl<B: Body + Unpin> Body for WatchedAnswer<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        let r = Pin::new(&mut self.inner).poll_frame(cx);
        match &r {
            Poll::Pending => {
                if self.waiting.is_none() {
                    self.waiting = Some(Count::new_in(&self.state, |s| &s.waiting));
                }
            }
            Poll::Ready(Some(Ok(_))) => {
                self.state.touch();
                self.waiting = None;
            }
            Poll::Ready(_) => {
                self.waiting = None;
                self.owed = None;
            }
        }
        if self.inner.is_end_stream() {
            self.waiting = None;
            self.owed = None;
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A connection's I/O, recording whether a write waits for the client.
/// Bytes moving are not progress by themselves (see `ConnState`).
struct Watched<Io> {
    inner: Io,
    state: Arc<ConnState>,
}

impl<Io: AsyncRead + Unpin> AsyncRead for Watched<Io> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<Io> Watched<Io> {
    fn wrote(&self, r: &Poll<io::Result<usize>>) {
        let blocked = r.is_pending();
        if self.state.write_blocked.load(Ordering::Relaxed) != blocked {
            self.state.write_blocked.store(blocked, Ordering::Relaxed);
        }
    }
}

impl<Io: AsyncWrite + Unpin> AsyncWrite for Watched<Io> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.wrote(&r);
        r
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.wrote(&r);
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// A listener at the descriptor limit: every accept fails with EMFILE.
    struct Exhausted(Arc<AtomicUsize>);

    impl Accept for Exhausted {
        type Io = tokio::io::DuplexStream;

        async fn accept(&mut self) -> io::Result<tokio::io::DuplexStream> {
            self.0.fetch_add(1, Ordering::Relaxed);
            Err(io::Error::from_raw_os_error(24)) // EMFILE
        }
    }

    #[tokio::test(start_paused = true)]
    async fn failing_accepts_pause_instead_of_spinning() {
        let calls = Arc::new(AtomicUsize::new(0));
        let registry = Registry::new();
        let metrics = HttpMetrics::new(&registry);
        let shutdown = CancellationToken::new();
        let limits = Limits {
            max_connections: 4,
            header_read_timeout: Duration::from_secs(1),
            idle_timeout: Duration::from_secs(1),
            max_connection_age: Duration::from_secs(600),
        };
        let task = tokio::spawn(run(
            "main",
            Exhausted(calls.clone()),
            Router::new(),
            limits,
            metrics.clone(),
            shutdown.clone(),
        ));
        // Five seconds of (virtual) time: pauses of 10, 20, 40 … ms, then
        // 1 s each, are 11 accepts; a loop without pauses makes millions.
        tokio::time::sleep(Duration::from_secs(5)).await;
        let n = calls.load(Ordering::Relaxed);
        assert!((8..=14).contains(&n), "{n} accepts in 5 s");
        assert_eq!(metrics.accept_errors.with_label_values(&["main"]).get() as usize, n);
        shutdown.cancel();
        task.await.unwrap();
    }
}
