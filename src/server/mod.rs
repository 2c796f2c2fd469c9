//! The listener side: accept loop, HTTP/1.1 and HTTP/2 (h2c by prior knowledge, and by ALPN
//! under TLS), the HTTP surface ([`routes`]), TLS material ([`tls`]) and graceful drain.
//!
//! Invariants: an accept error (e.g. out of file descriptors) never ends the loop; on shutdown
//! the listener closes first, then open connections are asked to finish (HTTP/1 after the
//! current response, HTTP/2 with GOAWAY) and are given `grace` before they are dropped.
//! Under TLS the handshake runs in the connection's own task (bounded by a timeout), so a slow
//! or failing client never stalls the accept loop; each connection takes the certificate in
//! force when it was accepted ([`tls::ServerTls`] swaps it on file change).

pub mod dashboard;
pub mod guard;
pub mod routes;
pub mod tls;

use std::sync::Arc;

use std::future::Future;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;

/// How long a client may take to complete the TLS handshake.
const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Serve `app` on `listener` until `shutdown` resolves, then drain for at most `grace`.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    shutdown: impl Future<Output = ()>,
    grace: Duration,
) {
    serve_with_tls(listener, app, None, shutdown, grace).await;
}

/// Like [`serve`]; with `tls`, every connection is TLS (HTTP/2 or HTTP/1.1 by ALPN).
pub async fn serve_with_tls(
    listener: TcpListener,
    app: Router,
    tls: Option<Arc<tls::ServerTls>>,
    shutdown: impl Future<Output = ()>,
    grace: Duration,
) {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(Duration::from_secs(30))
        .max_buf_size(256 * 1024);
    builder
        .http2()
        .timer(hyper_util::rt::TokioTimer::new())
        .max_concurrent_streams(1024)
        .keep_alive_interval(Some(Duration::from_secs(30)));
    let graceful = GracefulShutdown::new();
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
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(app.clone());
        let Some(tls) = &tls else {
            let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
            let conn = graceful.watch(conn.into_owned());
            tokio::spawn(async move {
                let _ = conn.await;
            });
            continue;
        };
        let acceptor = tls.acceptor();
        let watcher = graceful.watcher();
        let builder = builder.clone();
        tokio::spawn(async move {
            let stream =
                match tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                    Ok(Ok(s)) => s,
                    Ok(Err(e)) => {
                        metrics::counter!(crate::telemetry::metrics::TLS_HANDSHAKE_ERRORS_TOTAL)
                            .increment(1);
                        tracing::debug!(peer = %peer, "TLS handshake failed: {e}");
                        return;
                    }
                    Err(_) => {
                        metrics::counter!(crate::telemetry::metrics::TLS_HANDSHAKE_ERRORS_TOTAL)
                            .increment(1);
                        tracing::debug!(peer = %peer, "TLS handshake timed out");
                        return;
                    }
                };
            let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
            let _ = watcher.watch(conn.into_owned()).await;
        });
    }
    drop(listener);
    tokio::select! {
        () = graceful.shutdown() => {}
        () = tokio::time::sleep(grace) => {
            tracing::warn!("shutdown grace of {grace:?} over; dropping the connections still open");
        }
    }
}
