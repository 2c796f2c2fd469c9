//! The accept loop of one listener: admission, hand-off of each admitted connection to the
//! task (and serving thread) that serves it, and the drain on shutdown.
//!
//! Invariants:
//! - An accept error (e.g. out of file descriptors) never ends the loop, and the loop never
//!   waits for a connection slot: over `max_connections` (per listener) or
//!   `max_connections_per_ip` (for the peers it applies to, [`super::peers`]) a socket is
//!   closed at once (see [`super::admission`] for why).
//! - The loop never waits on a client either: the TLS handshake runs in the connection's own
//!   task ([`super::handshake`]).
//! - On shutdown the listener closes first, then open connections are asked to finish
//!   ([`Stage::Draining`]) and are given `grace` before they are dropped ([`Stage::Abort`]).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use super::admission::Admission;
use super::conn::{self, Conn};
use super::handshake::Accepted;
use super::peers::Peers;
use super::{fd, shards, tls, Stage};
use crate::config::validate::ConnectionLimits;

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
    /// Which peers the per-address cap applies to, and who their requests' clients are.
    pub peers: Arc<Peers>,
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
            peers: Arc::new(Peers::of(c)),
            conn: c.connections,
            shards: c.threads.unwrap_or_else(shards::default_count),
        }
    }

    /// The admin listener's limits: its own `admin.max_connections`, no per-address cap, the
    /// `[server]` trusted proxies, timeouts and protocol bounds.
    pub fn admin(c: &crate::Config) -> ListenerLimits {
        ListenerLimits {
            name: "admin",
            max_connections: c.admin.as_ref().map_or(256, |a| a.max_connections),
            max_connections_per_ip: 0,
            peers: Arc::new(Peers::of(&c.server)),
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
            peers: Arc::default(),
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

/// Like [`serve`]; with `tls`, every connection is TLS (HTTP/2 or HTTP/1.1 by ALPN).
pub async fn serve_with_tls(
    listener: TcpListener,
    app: Router,
    tls: Option<Arc<tls::ServerTls>>,
    limits: ListenerLimits,
    shutdown: impl Future<Output = ()>,
    grace: Duration,
) {
    fd::warn_if_fd_limit_low(&limits);
    let builder = Arc::new(conn::builder(&limits.conn));
    let admission = Admission::new(
        limits.name,
        limits.max_connections,
        limits.max_connections_per_ip,
        limits.peers.clone(),
    );
    let conn_limits = Arc::new(limits.conn);
    let (stage_tx, stage_rx) = watch::channel(Stage::Running);
    let mut shards = start_shards(&limits, &stage_rx);
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
            peer: peer.ip(),
            peers: limits.peers.clone(),
        };
        let accepted = Accepted {
            conn,
            peer,
            slot,
            tls: tls.as_ref().map(|t| t.acceptor()),
        };
        match &mut shards {
            None => {
                tokio::spawn(accepted.serve(stream, None));
            }
            Some(shards) => hand_to_shard(shards, accepted, stream, limits.name),
        }
    }
    drop(listener);
    drain(stage_tx, stage_rx, shards, grace).await;
}

/// The listener's serving threads; `None` (the caller's runtime serves) when it asks for none
/// or they cannot start.
fn start_shards(limits: &ListenerLimits, stage: &watch::Receiver<Stage>) -> Option<shards::Shards> {
    match limits.shards {
        0 => None,
        n => match shards::Shards::start(n, limits.name, stage) {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::error!(
                    listener = limits.name,
                    "{e}; serving the listener on the main runtime instead"
                );
                None
            }
        },
    }
}

/// Move an admitted connection to a shard's runtime: it leaves this one's reactor here and
/// joins the shard's there.
fn hand_to_shard(
    shards: &mut shards::Shards,
    accepted: Accepted,
    stream: TcpStream,
    listener: &'static str,
) {
    let peer = accepted.peer;
    let stream = match stream.into_std() {
        Ok(s) => s,
        Err(e) => {
            tracing::debug!(peer = %peer, "cannot hand the connection to a shard: {e}");
            return;
        }
    };
    let placed = shards.place(Box::new(move |placement| {
        match TcpStream::from_std(stream) {
            Ok(stream) => {
                tokio::spawn(accepted.serve(stream, Some(placement)));
            }
            Err(e) => tracing::debug!(peer = %peer, "cannot serve the connection: {e}"),
        }
    }));
    if placed.is_err() {
        tracing::error!(peer = %peer, "a shard of the {listener} listener is gone; connection closed");
    }
}

/// After the listener closed: ask every connection to finish, wait up to `grace` for them,
/// then drop the rest.
async fn drain(
    stage_tx: watch::Sender<Stage>,
    stage_rx: watch::Receiver<Stage>,
    shards: Option<shards::Shards>,
    grace: Duration,
) {
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
