//! The listener side: accept loop, connection admission ([`admission`]), HTTP/1.1 and HTTP/2
//! (h2c by prior knowledge, and by ALPN under TLS), client-side timeouts, the HTTP surface
//! ([`routes`]), TLS material ([`tls`]) and graceful drain.
//!
//! Invariants:
//! - An accept error (e.g. out of file descriptors) never ends the loop, and the loop never
//!   waits for a connection slot: over `max_connections` (per listener) or
//!   `max_connections_per_ip` a socket is closed at once (see [`admission`] for why).
//! - Every admitted connection holds its slot in a guard owned by its task, so every exit
//!   path gives it back.
//! - A client cannot hold a connection without sending: the first request must start within
//!   `header_read_timeout` of the connection being served (covers HTTP/1, HTTP/2's preface
//!   and the version sniffing in between); a request head must arrive within
//!   `header_read_timeout` (hyper, HTTP/1; on HTTP/1 this also bounds the wait for the next
//!   request on a kept-alive connection); a body within `body_read_timeout` of its head (408,
//!   OpenAI-shaped, and the HTTP/1 connection closed); and a connection with no request in
//!   flight is closed after `idle_timeout` (HTTP/2 with GOAWAY first). A request in flight —
//!   until its response body has been sent or dropped — keeps its connection open.
//! - Buffers per connection are bounded: the HTTP/1 read buffer (`max_header_bytes`, which
//!   is also the largest head), HTTP/2's header list, send buffer and receive windows.
//! - HTTP/2 rapid reset: streams reset before the gateway accepted them are capped by h2
//!   (`http2_max_pending_accept_reset_streams`, GOAWAY ENHANCE_YOUR_CALM); requests the client
//!   cancels after they reached the gateway are counted per connection and more than
//!   `http2_max_client_resets` in [`ConnectionLimits::RESET_WINDOW`] close the connection.
//! - On shutdown the listener closes first, then open connections are asked to finish
//!   (HTTP/1 after the current response, HTTP/2 with GOAWAY) and are given `grace` before
//!   they are dropped. Under TLS the handshake runs in the connection's own task (bounded by
//!   a timeout), so a slow or failing client never stalls the accept loop; each connection
//!   takes the certificate in force when it was accepted ([`tls::ServerTls`] swaps it).
//!
//! The limits are read when the listener starts; a reload does not change them.

pub mod admin_auth;
pub mod admission;
pub mod dashboard;
pub mod guard;
pub mod routes;
pub mod shards;
pub mod tls;

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::response::IntoResponse;
use axum::Router;
use bytes::Bytes;
use http::{header, HeaderValue, Request, Response, StatusCode, Version};
use hyper::body::{Frame, Incoming, SizeHint};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;
use tokio::sync::{watch, Notify};
use tokio::time::{Instant, Sleep};
use tower::ServiceExt;

use crate::config::validate::ConnectionLimits;
use crate::openai::ApiError;
use crate::telemetry::metrics as m;

/// How long a client may take to complete the TLS handshake.
const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a connection closed for idleness or abuse may take to finish (GOAWAY sent).
const CLOSE_GRACE: Duration = Duration::from_secs(2);
/// The answer to a connection over a limit on a plain listener (best effort, never waited on).
const REFUSED_503: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: 112\r\nconnection: close\r\nretry-after: 1\r\n\r\n{\"error\":{\"message\":\"Too many connections; retry later.\",\"type\":\"server_error\",\"param\":null,\"code\":\"overloaded\"}}";

/// What one listener enforces.
#[derive(Debug, Clone)]
pub struct ListenerLimits {
    /// The `listener` label of its metrics (`client` or `admin`).
    pub name: &'static str,
    pub max_connections: usize,
    /// 0: no per-address cap.
    pub max_connections_per_ip: usize,
    pub conn: ConnectionLimits,
    /// Threads serving its connections ([`shards`]); 0: the caller's runtime serves them.
    pub shards: usize,
}

impl ListenerLimits {
    /// The client listener's limits (`[server]`).
    pub fn client(c: &crate::config::ServerConfig) -> ListenerLimits {
        ListenerLimits {
            name: "client",
            max_connections: c.connections.max_connections,
            max_connections_per_ip: c.connections.max_connections_per_ip,
            conn: c.connections,
            shards: c.threads.unwrap_or_else(shards::default_count),
        }
    }

    /// The admin listener's limits: its own `admin.max_connections`, no per-address cap, the
    /// `[server]` timeouts and protocol bounds.
    pub fn admin(c: &crate::Config) -> ListenerLimits {
        ListenerLimits {
            name: "admin",
            max_connections: c.admin.as_ref().map_or(256, |a| a.max_connections),
            max_connections_per_ip: 0,
            conn: c.server.connections,
            shards: 0,
        }
    }
}

impl Default for ListenerLimits {
    fn default() -> Self {
        let conn = ConnectionLimits::default();
        ListenerLimits {
            name: "client",
            max_connections: conn.max_connections,
            max_connections_per_ip: conn.max_connections_per_ip,
            conn,
            shards: 0,
        }
    }
}

/// Serve `app` on `listener` until `shutdown` resolves, then drain for at most `grace`.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ListenerLimits,
    shutdown: impl Future<Output = ()>,
    grace: Duration,
) {
    serve_with_tls(listener, app, None, limits, shutdown, grace).await;
}

/// The stage of a listener's life, as its connections see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    Running,
    /// Finish what is in flight, take nothing new.
    Draining,
    /// Grace is over: drop the connection now.
    Abort,
}

fn builder(c: &ConnectionLimits) -> auto::Builder<TokioExecutor> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(c.header_read_timeout)
        .max_headers(c.max_headers)
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

/// Like [`serve`]; with `tls`, every connection is TLS (HTTP/2 or HTTP/1.1 by ALPN).
pub async fn serve_with_tls(
    listener: TcpListener,
    app: Router,
    tls: Option<Arc<tls::ServerTls>>,
    limits: ListenerLimits,
    shutdown: impl Future<Output = ()>,
    grace: Duration,
) {
    warn_if_fd_limit_low(&limits);
    let builder = Arc::new(builder(&limits.conn));
    let admission = admission::Admission::new(
        limits.name,
        limits.max_connections,
        limits.max_connections_per_ip,
    );
    let conn_limits = Arc::new(limits.conn);
    let (stage_tx, stage_rx) = watch::channel(Stage::Running);
    let mut shards = match limits.shards {
        0 => None,
        n => match shards::Shards::start(n, limits.name, &stage_rx) {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::error!(
                    listener = limits.name,
                    "{e}; serving the listener on the main runtime instead"
                );
                None
            }
        },
    };
    tokio::pin!(shutdown);
    let mut accept_errors = 0u32;
    loop {
        let accepted = tokio::select! {
            biased;
            () = &mut shutdown => break,
            accepted = listener.accept() => accepted,
        };
        let (stream, peer) = match accepted {
            Ok(x) => {
                accept_errors = 0;
                x
            }
            Err(e) => {
                accept_errors = accept_errors.saturating_add(1);
                tracing::warn!("accept failed: {e}");
                let backoff = Duration::from_millis(10u64 << accept_errors.min(6));
                tokio::time::sleep(backoff).await;
                continue;
            }
        };
        let slot = match admission.try_admit(peer.ip()) {
            Ok(slot) => slot,
            Err(why) => {
                tracing::debug!(peer = %peer, reason = why.as_str(), "connection refused");
                if tls.is_none() {
                    // One non-blocking write into an empty socket buffer; never waited on.
                    let _ = stream.try_write(REFUSED_503);
                }
                drop(stream);
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let conn = Conn {
            app: app.clone(),
            builder: builder.clone(),
            limits: conn_limits.clone(),
            listener: limits.name,
            stage: stage_rx.clone(),
        };
        let accepted = Accepted {
            conn,
            peer,
            slot,
            tls: tls.as_ref().map(|t| t.acceptor()),
        };
        let Some(shards) = &mut shards else {
            tokio::spawn(accepted.serve(stream, None));
            continue;
        };
        // Moved to its shard's runtime: leaves this one's reactor here, joins the shard's
        // there.
        let stream = match stream.into_std() {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!(peer = %peer, "cannot hand the connection to a shard: {e}");
                continue;
            }
        };
        let placed = shards.place(Box::new(
            move |placement| match tokio::net::TcpStream::from_std(stream) {
                Ok(stream) => {
                    tokio::spawn(accepted.serve(stream, Some(placement)));
                }
                Err(e) => tracing::debug!(peer = %peer, "cannot serve the connection: {e}"),
            },
        ));
        if placed.is_err() {
            tracing::error!(peer = %peer, "a shard of the {} listener is gone; connection closed", limits.name);
        }
    }
    drop(listener);
    drop(stage_rx);
    let _ = stage_tx.send(Stage::Draining);
    // The shards take no more connections; each ends once its own have (every connection, and
    // each shard until it ends, holds a stage receiver, so `closed` covers them all).
    let closing = shards.map(shards::Shards::close);
    if tokio::time::timeout(grace, stage_tx.closed())
        .await
        .is_err()
    {
        tracing::warn!("shutdown grace of {grace:?} over; dropping the connections still open");
        let _ = stage_tx.send(Stage::Abort);
    }
    if let Some(c) = closing {
        c.wait().await;
    }
}

/// An admitted connection on its way to the task that serves it.
struct Accepted {
    conn: Conn,
    peer: std::net::SocketAddr,
    slot: admission::ConnectionGuard,
    tls: Option<tokio_rustls::TlsAcceptor>,
}

impl Accepted {
    /// Serve the connection to its end: the TLS handshake first, when there is one (bounded,
    /// in this task, so a slow client never stalls the accept loop). The admission slot and
    /// the shard placement are held until then.
    async fn serve(self, stream: tokio::net::TcpStream, placement: Option<shards::Placement>) {
        let Accepted {
            conn,
            peer,
            slot,
            tls,
        } = self;
        let _slot = slot;
        let _placement = placement;
        let Some(acceptor) = tls else {
            conn.run(stream).await;
            return;
        };
        let stream =
            match tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => {
                    metrics::counter!(m::TLS_HANDSHAKE_ERRORS_TOTAL).increment(1);
                    tracing::debug!(peer = %peer, "TLS handshake failed: {e}");
                    return;
                }
                Err(_) => {
                    metrics::counter!(m::TLS_HANDSHAKE_ERRORS_TOTAL).increment(1);
                    tracing::debug!(peer = %peer, "TLS handshake timed out");
                    return;
                }
            };
        conn.run(stream).await;
    }
}

/// Warn when the process's open-file limit cannot hold `max_connections` (each connection is
/// a descriptor; a request in flight takes a second one towards its backend). Linux only;
/// elsewhere nothing is checked.
fn warn_if_fd_limit_low(limits: &ListenerLimits) {
    let Some(soft) = open_files_soft_limit() else {
        return;
    };
    let wanted = limits.max_connections as u64 + 128;
    if soft < wanted {
        tracing::warn!(
            listener = limits.name,
            max_connections = limits.max_connections,
            open_files_limit = soft,
            "the open-file limit is below max_connections: beyond it connections fail at accept \
             instead of being refused cleanly; raise it (ulimit -n, systemd LimitNOFILE=, \
             container nofile ulimit) to at least twice max_connections, or lower max_connections"
        );
    }
}

/// The soft `RLIMIT_NOFILE`, from `/proc/self/limits`.
fn open_files_soft_limit() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = text.lines().find(|l| l.starts_with("Max open files"))?;
    line.split_whitespace().nth(3)?.parse().ok()
}

/// What one connection's task needs.
struct Conn {
    app: Router,
    builder: Arc<auto::Builder<TokioExecutor>>,
    limits: Arc<ConnectionLimits>,
    listener: &'static str,
    stage: watch::Receiver<Stage>,
}

impl Conn {
    /// Serve one connection to its end, enforcing the first-request, idle and reset limits.
    async fn run<IO>(self, io: IO)
    where
        IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let Conn {
            app,
            builder,
            limits,
            listener,
            mut stage,
        } = self;
        let act = Arc::new(Activity::new());
        let service = ConnService {
            app,
            act: act.clone(),
            limits: limits.clone(),
            listener,
        };
        // Borrows the shared builder: no per-connection copy of it.
        let conn = builder.serve_connection(TokioIo::new(io), service);
        tokio::pin!(conn);
        // `closing`: graceful shutdown asked; `close_by`: when to drop the connection if the
        // client has not finished by then (none while draining: `Stage::Abort` decides).
        let mut closing = false;
        let mut close_by: Option<Instant> = None;
        let mut timed_out = false;
        let check = tokio::time::sleep_until(act.started + limits.header_read_timeout);
        tokio::pin!(check);
        if *stage.borrow_and_update() != Stage::Running {
            conn.as_mut().graceful_shutdown();
            closing = true;
        }
        loop {
            tokio::select! {
                r = conn.as_mut() => {
                    if let Err(e) = r {
                        let timeout = e
                            .downcast_ref::<hyper::Error>()
                            .is_some_and(hyper::Error::is_timeout);
                        if timeout && !timed_out {
                            metrics::counter!(m::CLIENT_TIMEOUTS_TOTAL, "listener" => listener, "kind" => "header")
                                .increment(1);
                        }
                        tracing::debug!("connection ended: {e}");
                    }
                    return;
                }
                changed = stage.changed() => {
                    let stage = if changed.is_ok() { *stage.borrow_and_update() } else { Stage::Abort };
                    match stage {
                        Stage::Running => {}
                        Stage::Draining => {
                            if !closing {
                                conn.as_mut().graceful_shutdown();
                                closing = true;
                            }
                        }
                        Stage::Abort => return,
                    }
                }
                () = act.flood.notified() => {
                    metrics::counter!(m::HTTP2_RESET_FLOODS_TOTAL, "listener" => listener)
                        .increment(1);
                    tracing::warn!("HTTP/2 client reset too many streams; closing the connection");
                    if !closing {
                        conn.as_mut().graceful_shutdown();
                        closing = true;
                    }
                    let by = Instant::now() + CLOSE_GRACE;
                    close_by = Some(by);
                    check.as_mut().reset(by);
                }
                () = act.idle.notified(), if !closing => {
                    if let Some((deadline, _)) = act.idle_deadline(&limits) {
                        check.as_mut().reset(deadline);
                    }
                }
                () = &mut check, if !closing || close_by.is_some() => {
                    let now = Instant::now();
                    if let Some(by) = close_by {
                        // GOAWAY sent or close asked, and the client is still here.
                        if now >= by {
                            return;
                        }
                        check.as_mut().reset(by);
                        continue;
                    }
                    match act.idle_deadline(&limits) {
                        Some((deadline, kind)) if now >= deadline => {
                            metrics::counter!(m::CLIENT_TIMEOUTS_TOTAL, "listener" => listener, "kind" => kind)
                                .increment(1);
                            timed_out = true;
                            conn.as_mut().graceful_shutdown();
                            closing = true;
                            close_by = Some(now + CLOSE_GRACE);
                            check.as_mut().reset(now + CLOSE_GRACE);
                        }
                        Some((deadline, _)) => check.as_mut().reset(deadline),
                        // A request in flight: look again one idle period later.
                        None => check.as_mut().reset(now + limits.idle_timeout),
                    }
                }
            }
        }
    }
}

/// One connection's activity, shared by its task and its requests.
struct Activity {
    started: Instant,
    /// Requests started (the service was called).
    requests: AtomicU64,
    /// Requests whose response is not finished yet.
    inflight: AtomicUsize,
    /// Milliseconds after `started` when the last request finished.
    last_done_ms: AtomicU64,
    /// Client resets in the current window, and the window's start (ms after `started`).
    resets: AtomicU32,
    reset_window_ms: AtomicU64,
    flooded: AtomicBool,
    flood: Notify,
    /// Woken when the last request in flight finishes, so the idle deadline is re-armed.
    idle: Notify,
}

impl Activity {
    fn new() -> Activity {
        Activity {
            started: Instant::now(),
            requests: AtomicU64::new(0),
            inflight: AtomicUsize::new(0),
            last_done_ms: AtomicU64::new(0),
            resets: AtomicU32::new(0),
            reset_window_ms: AtomicU64::new(0),
            flooded: AtomicBool::new(false),
            flood: Notify::new(),
            idle: Notify::new(),
        }
    }

    /// Milliseconds since this connection's activity record was made (its own monotonic clock).
    fn elapsed_ms(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn at(&self, ms: u64) -> Instant {
        self.started + Duration::from_millis(ms)
    }

    /// When this connection becomes too idle, and the metric kind; `None` while a request is
    /// in flight.
    fn idle_deadline(&self, l: &ConnectionLimits) -> Option<(Instant, &'static str)> {
        if self.inflight.load(Ordering::Acquire) > 0 {
            return None;
        }
        if self.requests.load(Ordering::Acquire) == 0 {
            return Some((self.started + l.header_read_timeout, "header"));
        }
        let last = self.at(self.last_done_ms.load(Ordering::Acquire));
        Some((last + l.idle_timeout, "idle"))
    }

    /// Count a request the client cancelled; past the limit, wake the connection's task once.
    fn client_reset(&self, l: &ConnectionLimits) {
        let now = self.elapsed_ms();
        let window = u64::try_from(ConnectionLimits::RESET_WINDOW.as_millis()).unwrap_or(10_000);
        let start = self.reset_window_ms.load(Ordering::Acquire);
        let n = if now.saturating_sub(start) >= window {
            self.reset_window_ms.store(now, Ordering::Release);
            self.resets.store(1, Ordering::Release);
            1
        } else {
            self.resets.fetch_add(1, Ordering::AcqRel).saturating_add(1)
        };
        if n > l.http2_max_client_resets && !self.flooded.swap(true, Ordering::AcqRel) {
            self.flood.notify_one();
        }
    }
}

/// Holds one request's place in its connection's in-flight count, from the service call until
/// the response body is finished or dropped.
struct InFlight {
    act: Arc<Activity>,
    limits: Arc<ConnectionLimits>,
    h2: bool,
    answered: bool,
    /// Set by the request body when the client broke it off (an HTTP/2 stream reset while
    /// the body was read, which the handler answers before hyper notices the reset).
    body_broken: Arc<AtomicBool>,
}

impl InFlight {
    fn new(act: Arc<Activity>, limits: Arc<ConnectionLimits>, h2: bool) -> InFlight {
        act.requests.fetch_add(1, Ordering::AcqRel);
        act.inflight.fetch_add(1, Ordering::AcqRel);
        InFlight {
            act,
            limits,
            h2,
            answered: false,
            body_broken: Arc::new(AtomicBool::new(false)),
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.act
            .last_done_ms
            .store(self.act.elapsed_ms(), Ordering::Release);
        if self.act.inflight.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.act.idle.notify_one();
        }
        if self.h2 && (!self.answered || self.body_broken.load(Ordering::Acquire)) {
            // The stream was reset (or the connection lost) before the response head, or
            // while its body was being read.
            self.act.client_reset(&self.limits);
        }
    }
}

/// The hyper service of one connection: the router behind the request guards ([`guard`]: id,
/// framing, panic barrier), with the request body under `body_read_timeout` and the request
/// counted in flight until its response body ends.
#[derive(Clone)]
struct ConnService {
    app: Router,
    act: Arc<Activity>,
    limits: Arc<ConnectionLimits>,
    listener: &'static str,
}

type ServiceFuture =
    Pin<Box<dyn Future<Output = Result<Response<TrackedBody>, Infallible>> + Send>>;

impl hyper::service::Service<Request<Incoming>> for ConnService {
    type Response = Response<TrackedBody>;
    type Error = Infallible;
    type Future = ServiceFuture;

    fn call(&self, mut req: Request<Incoming>) -> ServiceFuture {
        let version = req.version();
        let mut flight = InFlight::new(
            self.act.clone(),
            self.limits.clone(),
            version == Version::HTTP_2,
        );
        let app = self.app.clone();
        let timeout = self.limits.body_read_timeout;
        let listener = self.listener;
        Box::pin(async move {
            let id = guard::request_id(req.headers());
            let id_header = HeaderValue::from_str(&id).ok();
            if let Some(v) = &id_header {
                req.headers_mut().insert("x-request-id", v.clone());
            }
            let mut response = if let Some(refused) = guard::refuse_ambiguous_framing(&req) {
                refused
            } else {
                let test_panic = req.headers().contains_key(guard::TEST_PANIC_HEADER);
                let fired = Arc::new(Notify::new());
                let broken = flight.body_broken.clone();
                let req = req.map(|b| TimedBody::new(b, timeout, fired.clone(), broken));
                let handler = async move {
                    match app.oneshot(req).await {
                        Ok(r) => r,
                        Err(never) => match never {},
                    }
                };
                tokio::select! {
                    biased;
                    r = guard::catch_panic(&id, test_panic, handler) => r,
                    () = fired.notified() => {
                        metrics::counter!(m::CLIENT_TIMEOUTS_TOTAL, "listener" => listener, "kind" => "body")
                            .increment(1);
                        let mut r = ApiError::new(
                            StatusCode::REQUEST_TIMEOUT,
                            "invalid_request_error",
                            format!("The request body did not arrive within {}.", humantime::format_duration(timeout)),
                        )
                        .with_code("request_timeout")
                        .into_response();
                        if version < Version::HTTP_2 {
                            r.headers_mut()
                                .insert(header::CONNECTION, HeaderValue::from_static("close"));
                        }
                        r
                    }
                }
            };
            if let Some(v) = id_header {
                response.headers_mut().insert("x-request-id", v);
            }
            flight.answered = true;
            Ok(response.map(|inner| TrackedBody {
                inner,
                _flight: flight,
            }))
        })
    }
}

/// A response body that holds its request's [`InFlight`] until it is finished or dropped.
pub struct TrackedBody {
    inner: Body,
    _flight: InFlight,
}

impl http_body::Body for TrackedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A request body that must arrive within a deadline from its head. When the deadline passes
/// it stops yielding (stays pending) and fires `fired`, so the service answers 408 in place of
/// whatever the handler would have made of a read error. The timer is armed on first poll
/// only: a handler that never reads the body never pays for it.
pub struct TimedBody {
    inner: Incoming,
    deadline: Instant,
    timer: Option<Pin<Box<Sleep>>>,
    fired: Option<Arc<Notify>>,
    /// Set when the client breaks the body off (reset, connection error).
    broken: Arc<AtomicBool>,
    done: bool,
}

impl TimedBody {
    fn new(
        inner: Incoming,
        timeout: Duration,
        fired: Arc<Notify>,
        broken: Arc<AtomicBool>,
    ) -> TimedBody {
        TimedBody {
            inner,
            deadline: Instant::now() + timeout,
            timer: None,
            fired: Some(fired),
            broken,
            done: false,
        }
    }
}

impl http_body::Body for TimedBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = &mut *self;
        if this.done {
            return Pin::new(&mut this.inner).poll_frame(cx);
        }
        if let Poll::Ready(frame) = Pin::new(&mut this.inner).poll_frame(cx) {
            if matches!(frame, Some(Err(_))) {
                this.broken.store(true, Ordering::Release);
            }
            if frame.is_none() || this.inner.is_end_stream() {
                this.done = true;
                this.timer = None;
            }
            return Poll::Ready(frame);
        }
        let deadline = this.deadline;
        let timer = this
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        if timer.as_mut().poll(cx).is_ready() {
            if let Some(f) = this.fired.take() {
                f.notify_one();
            }
        }
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
