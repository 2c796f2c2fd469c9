//! The listener side: the accept loop and drain ([`accept`]), connection admission
//! ([`admission`]) and what a peer address stands for ([`peers`]), the TLS handshake ([`handshake`]), the open-file probe ([`fd`]), one
//! connection's state machine with HTTP/1.1 and HTTP/2 (h2c by prior knowledge, and by ALPN
//! under TLS) and its client-side timeouts ([`conn`]), the per-request service ([`service`])
//! and what it shares with the connection ([`activity`]), the body wrappers ([`body`]), the
//! HTTP surface ([`routes`]), TLS material ([`tls`]) and the serving threads ([`shards`]).
//!
//! Invariants (each file states its own in detail):
//! - The accept loop never ends on an accept error and never waits, for a slot or a client.
//! - Every admitted connection holds its slot in a guard owned by its task, so every exit
//!   path gives it back.
//! - A client cannot hold a connection without sending, a request body must arrive within
//!   `body_read_timeout` of its head, and a connection with no request in flight is closed
//!   after `idle_timeout`; a request in flight keeps its connection open.
//! - On shutdown the listener closes first, then open connections are asked to finish and are
//!   given `grace` before they are dropped.
//!
//! The limits are read when the listener starts; a reload does not change them.

mod accept;
mod activity;
pub mod admin_auth;
pub mod admission;
mod body;
mod conn;
pub mod dashboard;
mod fd;
pub mod guard;
mod handshake;
pub mod peers;
pub mod routes;
mod service;
pub mod shards;
pub mod tls;

pub use accept::{serve, serve_with_tls, ListenerLimits};
pub use body::{TimedBody, TrackedBody};

/// The stage of a listener's life, as its connections (and serving threads) see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    Running,
    /// Finish what is in flight, take nothing new.
    Draining,
    /// Grace is over: drop the connection now.
    Abort,
}
