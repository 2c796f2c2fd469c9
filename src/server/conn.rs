//! One connection served to its end: HTTP/1.1 or HTTP/2 (by prior knowledge or ALPN) with the
//! protocol bounds of [`builder`], and the connection's state machine ([`State`]) that
//! enforces the first-request, idle and reset limits and the listener's drain.
//!
//! Invariants:
//! - A client cannot hold a connection without sending: the first request must start within
//!   `header_read_timeout` of the connection being served (covers HTTP/1, HTTP/2's preface
//!   and the version sniffing in between); a request head must arrive within
//!   `header_read_timeout` (hyper, HTTP/1; on HTTP/1 this also bounds the wait for the next
//!   request on a kept-alive connection); and a connection with no request in flight is
//!   closed after `idle_timeout` (HTTP/2 with GOAWAY first). A request in flight — until its
//!   response body has been sent or dropped — keeps its connection open.
//! - Buffers per connection are bounded: the HTTP/1 read buffer (`max_header_bytes`, which
//!   is also the largest head), HTTP/2's header list, send buffer and receive windows.
//! - HTTP/2 rapid reset: streams reset before the gateway accepted them are capped by h2
//!   (`http2_max_pending_accept_reset_streams`, GOAWAY ENHANCE_YOUR_CALM); more than
//!   `http2_max_client_resets` requests cancelled in [`ConnectionLimits::RESET_WINDOW`] close
//!   the connection.
//! - The state only moves forwards: `Open` → `Draining` or `Closing`, `Draining` → `Closing`;
//!   graceful shutdown is asked of hyper exactly once, on leaving `Open`. A connection in
//!   `Closing` is dropped at its deadline; one in `Draining` when the listener says
//!   [`Stage::Abort`].

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::sync::watch;
use tokio::time::Instant;

use super::activity::Activity;
use super::peers::Peers;
use super::service::ConnService;
use super::Stage;
use crate::config::validate::ConnectionLimits;
use crate::telemetry::metrics as m;

/// How long a connection closed for idleness or abuse may take to finish (GOAWAY sent).
const CLOSE_GRACE: Duration = Duration::from_secs(2);

/// The hyper connection builder of a listener, with its protocol bounds.
pub(super) fn builder(c: &ConnectionLimits) -> auto::Builder<TokioExecutor> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(c.header_read_timeout)
        .max_headers(c.max_headers)
        // Validation keeps it at least that; hyper panics below it, so a hand-built
        // `ConnectionLimits` must not reach that.
        .max_buf_size(c.max_header_bytes.max(ConnectionLimits::MIN_HEADER_BYTES));
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(c.http2_max_concurrent_streams)
        .max_pending_accept_reset_streams(c.http2_max_pending_accept_reset_streams)
        .max_local_error_reset_streams(c.http2_max_local_error_reset_streams)
        .max_header_list_size(u32::try_from(c.max_header_bytes).unwrap_or(u32::MAX))
        .max_send_buf_size(c.http2_max_send_buf_size)
        .initial_stream_window_size(c.http2_initial_stream_window_size)
        .initial_connection_window_size(c.http2_initial_connection_window_size)
        .keep_alive_interval(Some(Duration::from_secs(30)));
    builder
}

/// Where a connection is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Serving; the check timer watches the first-request and idle deadlines.
    Open,
    /// The listener drains: hyper finishes what is in flight (HTTP/1 after the current
    /// response, HTTP/2 with GOAWAY); no deadline of its own, [`Stage::Abort`] ends it.
    Draining,
    /// Closing for idleness or abuse (GOAWAY sent): dropped at `by` if the client is still
    /// there. `timeout_counted`: a client timeout was counted already, so hyper's own timeout
    /// error that may follow is not counted twice.
    Closing { by: Instant, timeout_counted: bool },
}

impl State {
    fn timeout_counted(self) -> bool {
        matches!(
            self,
            State::Closing {
                timeout_counted: true,
                ..
            }
        )
    }
}

/// What one connection's task needs.
pub(super) struct Conn {
    pub(super) app: Router,
    pub(super) builder: Arc<auto::Builder<TokioExecutor>>,
    pub(super) limits: Arc<ConnectionLimits>,
    pub(super) listener: &'static str,
    pub(super) stage: watch::Receiver<Stage>,
    /// The address the connection comes from.
    pub(super) peer: std::net::IpAddr,
    pub(super) peers: Arc<Peers>,
}

impl Conn {
    /// Serve one connection to its end, enforcing the first-request, idle and reset limits.
    pub(super) async fn run<IO>(self, io: IO)
    where
        IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let Conn {
            app,
            builder,
            limits,
            listener,
            mut stage,
            peer,
            peers,
        } = self;
        let act = Arc::new(Activity::new());
        let service = ConnService {
            app,
            act: act.clone(),
            limits: limits.clone(),
            listener,
            peer,
            peers,
        };
        // Borrows the shared builder: no per-connection copy of it.
        let conn = builder.serve_connection(TokioIo::new(io), service);
        tokio::pin!(conn);
        let mut state = State::Open;
        let check = tokio::time::sleep_until(act.started + limits.header_read_timeout);
        tokio::pin!(check);
        if *stage.borrow_and_update() != Stage::Running {
            conn.as_mut().graceful_shutdown();
            state = State::Draining;
        }
        loop {
            tokio::select! {
                r = conn.as_mut() => {
                    if let Err(e) = r {
                        ended_with(&*e, listener, state);
                    }
                    return;
                }
                changed = stage.changed() => {
                    let stage = if changed.is_ok() { *stage.borrow_and_update() } else { Stage::Abort };
                    match stage {
                        Stage::Running => {}
                        Stage::Draining => {
                            if state == State::Open {
                                conn.as_mut().graceful_shutdown();
                                state = State::Draining;
                            }
                        }
                        Stage::Abort => return,
                    }
                }
                () = act.flood.notified() => {
                    metrics::counter!(m::HTTP2_RESET_FLOODS_TOTAL, "listener" => listener)
                        .increment(1);
                    tracing::warn!("HTTP/2 client reset too many streams; closing the connection");
                    if state == State::Open {
                        conn.as_mut().graceful_shutdown();
                    }
                    let by = Instant::now() + CLOSE_GRACE;
                    state = State::Closing { by, timeout_counted: state.timeout_counted() };
                    check.as_mut().reset(by);
                }
                () = act.idle.notified(), if state == State::Open => {
                    if let Some((deadline, _)) = act.idle_deadline(&limits) {
                        check.as_mut().reset(deadline);
                    }
                }
                () = &mut check, if state != State::Draining => match due(state, &act, &limits) {
                    Due::Drop => return,
                    Due::Wait(at) => check.as_mut().reset(at),
                    Due::Close { by, kind } => {
                        metrics::counter!(m::CLIENT_TIMEOUTS_TOTAL, "listener" => listener, "kind" => kind)
                            .increment(1);
                        conn.as_mut().graceful_shutdown();
                        state = State::Closing { by, timeout_counted: true };
                        check.as_mut().reset(by);
                    }
                },
            }
        }
    }
}

/// What a connection does when its check timer fires (never while draining).
enum Due {
    /// Its closing deadline passed: drop it now.
    Drop,
    /// Nothing yet: look again then.
    Wait(Instant),
    /// Too long without a request (`kind`: `header` before the first, `idle` after): close it,
    /// dropping it at `by` if the client is still there.
    Close { by: Instant, kind: &'static str },
}

fn due(state: State, act: &Activity, limits: &ConnectionLimits) -> Due {
    let now = Instant::now();
    if let State::Closing { by, .. } = state {
        // GOAWAY sent or close asked, and the client is still here.
        return if now >= by { Due::Drop } else { Due::Wait(by) };
    }
    match act.idle_deadline(limits) {
        Some((deadline, kind)) if now >= deadline => Due::Close {
            by: now + CLOSE_GRACE,
            kind,
        },
        Some((deadline, _)) => Due::Wait(deadline),
        // A request in flight: look again one idle period later.
        None => Due::Wait(now + limits.idle_timeout),
    }
}

/// A connection ended with an error: hyper's own header timeout is counted unless the
/// connection was closed for a timeout that was counted already.
fn ended_with(e: &(dyn std::error::Error + 'static), listener: &'static str, state: State) {
    let timeout = e
        .downcast_ref::<hyper::Error>()
        .is_some_and(hyper::Error::is_timeout);
    if timeout && !state.timeout_counted() {
        metrics::counter!(m::CLIENT_TIMEOUTS_TOTAL, "listener" => listener, "kind" => "header")
            .increment(1);
    }
    tracing::debug!("connection ended: {e}");
}
