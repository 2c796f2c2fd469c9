//! The HTTP client towards backends.
//!
//! - [`client`]: the clients of one backend, one connection pool per serving thread
//!   ([`Pools`]), and the TLS client configuration a fleet's backends share ([`BackendTls`],
//!   built from the config snapshot's `[backend_tls]`).
//! - [`h1`]: the HTTP/1.1 client for plain-http backends, run in the request's own task.
//! - [`body`]: the response body of either client behind one type ([`Body`]).
//! - [`send`](mod@send): sending one attempt and classifying what came back
//!   ([`AttemptError`]), the description of a client error, `Retry-After` parsing.
//!
//! This layer knows backends only through [`Target`] (a URL and a client); what a backend is
//! (its state, its models) is the fleet's.
//!
//! Invariants: a request served by a serving thread uses that thread's pool, so no request
//! wakes another thread; nothing here keeps process-wide settings (a backend's client is built
//! from the TLS configuration of the fleet it belongs to).

pub mod body;
pub mod client;
pub mod h1;
pub mod send;

pub use body::{Body, ClientError, UpstreamResponse};
pub use client::{BackendTls, HttpClient, HttpsConnector, Pools, ThreadClient};
pub use send::{
    describe_client_error, retry_after, retryable_status, send, send_method, AttemptError, Target,
};
