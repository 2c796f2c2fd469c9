//! Sluice: an OpenAI-compatible gateway for a fleet of inference servers (vLLM, TGI, Ollama and
//! any OpenAI-compatible server).
//!
//! # Layout
//! - [`config`]: the TOML file, `${ENV}` interpolation, validation into the runtime [`Config`].
//! - [`server`]: accept loop, HTTP/1.1 + HTTP/2, the HTTP surface, TLS, graceful drain.
//! - [`openai`]: the request fields routing reads, OpenAI-shaped errors, byte-level JSON edits.
//! - [`auth`]: API keys (stored as SHA-256 hashes) and the tenants they belong to.
//! - [`limits`]: per-key and per-tenant limits: admission, reservation, reconciliation.
//! - [`fleet`]: backends, their live state and load counters, health probes, model discovery.
//! - [`routing`]: policies that pick a backend: round-robin, least-request, token-aware,
//!   prefix-affinity.
//! - [`proxy`]: one request's path: forward, failover, streaming observer, settlement.
//! - [`telemetry`]: logs, metric names, the access log.
//! - [`gateway`]: the shared state (live config snapshot, router, health monitor).
//! - [`sim`]: the backend simulator behind `sluice sim` and `sluice demo`.
//! - [`demo`]: `sluice demo`, a gateway in front of an embedded simulated fleet.
//!
//! The entry point for embedding and tests is [`run`]: it serves a bound listener until the
//! shutdown future resolves.

#![forbid(unsafe_code)]
// Errors here are OpenAI error bodies on the cold path; boxing them would buy nothing measurable.
#![allow(clippy::result_large_err)]

pub mod app;
pub mod auth;
pub mod config;
pub mod demo;
pub mod fleet;
pub mod gateway;
pub mod limits;
pub mod openai;
pub mod proxy;
pub mod routing;
pub mod rt;
pub mod server;
pub mod settle;
pub mod sim;
pub mod telemetry;
pub mod tls;
pub mod upstream;

pub use app::{run, run_with, serve_gateway, RunError};
pub use config::Config;
pub use gateway::Gateway;
