//! Sluice: an OpenAI-compatible gateway for a fleet of inference servers (vLLM, TGI, Ollama and
//! any OpenAI-compatible server).
//!
//! # Layers
//! Bottom to top; a module names only modules of its own layer or lower ones (the table in
//! docs/architecture.md, enforced by `tests/it/layering.rs`).
//!
//! 1. [`telemetry`]: logs, metric names, the access record and request ids; [`batching`]: the
//!    continuous-batching engine model without a clock (shared by [`sim`] and [`plan`]);
//!    [`kvevents`]: vLLM's KV-cache events on the wire (subscribed to by [`fleet`], published by
//!    [`sim`]);
//!    [`tokenizer`]: a model's own tokenizer and chat template, giving the prompt token ids a
//!    vLLM engine computes.
//! 2. [`rt`]: the current serving thread's index, the default number of serving threads.
//! 3. [`tls`]: TLS material from plain inputs: CA bundles, server certificates, the backend
//!    client config.
//! 4. [`config`]: the TOML file, `${ENV}` interpolation, validation into the runtime [`Config`].
//! 5. [`openai`]: the OpenAI wire vocabulary: request fields, errors, byte-level JSON edits,
//!    usage.
//! 6. [`api`]: the client-API seam, one file per client API.
//! 7. [`upstream`]: the HTTP client to backends: per-thread pools, backend TLS per fleet, send.
//! 8. [`fleet`]: backends, their live state and load guards, health probes, signals, discovery,
//!    the wait queue.
//! 9. [`settle`]: what runs once when a request is over (load guard, hooks, access line).
//! 10. [`auth`]: API keys (stored as SHA-256 hashes) and the tenants they belong to.
//! 11. [`limits`]: per-key and per-tenant limits: admission, reservation, reconciliation.
//! 12. [`routing`]: policies that pick a backend: round-robin, least-request, token-aware,
//!     prefix-affinity.
//! 13. [`gateway`]: the shared state (live config snapshot, fleet, router, limits, queue).
//! 14. [`proxy`]: one request's path: attempts, failover, the streaming observer.
//! 15. [`batch`]: the OpenAI Files and Batches APIs: files and job state on disk, batch lines
//!     run through [`proxy`] on the fleet's idle capacity.
//! 16. [`server`]: accept loop, HTTP/1.1 + HTTP/2, routes, listener TLS, graceful drain.
//! 17. [`app`]: the composition root: the one build-and-serve path, the config reload watcher.
//! 18. [`plan`]: `sluice plan`, capacity planning: the fleet in virtual time, routed by
//!     [`routing`].
//! 19. [`demo`]: `sluice demo`, a gateway in front of an embedded simulated fleet.
//!
//! Standalone: [`sim`], the backend simulator behind `sluice sim` and `sluice demo` (names
//! only layer 1: [`telemetry`], [`batching`], [`kvevents`], [`tokenizer`]).
//!
//! The entry point for embedding and tests is [`run`] (in [`app`]): it serves a bound listener
//! until the shutdown future resolves.

#![forbid(unsafe_code)]
// Errors here are OpenAI error bodies on the cold path; boxing them would buy nothing measurable.
#![allow(clippy::result_large_err)]

pub mod api;
pub mod app;
pub mod auth;
pub mod batch;
pub mod batching;
pub mod config;
pub mod demo;
pub mod fleet;
pub mod gateway;
pub mod kvevents;
pub mod limits;
pub mod openai;
pub mod plan;
pub mod proxy;
pub mod routing;
pub mod rt;
pub mod server;
pub mod settle;
pub mod sim;
pub mod telemetry;
pub mod tls;
pub mod tokenizer;
pub mod upstream;

pub use app::{run, run_with, serve_gateway, RunError};
pub use config::Config;
pub use gateway::Gateway;
