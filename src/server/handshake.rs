//! An admitted connection's first step in its own task: the TLS handshake, when the listener
//! has TLS.
//!
//! Invariants: the handshake is bounded by [`TLS_HANDSHAKE_TIMEOUT`] and runs in the
//! connection's task, so a slow or failing client never stalls the accept loop; each
//! connection takes the certificate in force when it was accepted ([`super::tls::ServerTls`]
//! swaps it); the admission slot and the shard placement are held until the connection ends,
//! whichever way it ends.

use std::time::Duration;

use tokio::net::TcpStream;

use super::admission::ConnectionGuard;
use super::conn::Conn;
use super::shards::Placement;
use crate::telemetry::metrics as m;

/// How long a client may take to complete the TLS handshake.
const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// An admitted connection on its way to the task that serves it.
pub(super) struct Accepted {
    pub(super) conn: Conn,
    pub(super) peer: std::net::SocketAddr,
    pub(super) slot: ConnectionGuard,
    pub(super) tls: Option<tokio_rustls::TlsAcceptor>,
}

impl Accepted {
    /// Serve the connection to its end, after the TLS handshake when there is one.
    pub(super) async fn serve(self, stream: TcpStream, placement: Option<Placement>) {
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
