//! Sluice: an OpenAI-compatible gateway for a fleet of inference servers (vLLM, TGI, Ollama and
//! any OpenAI-compatible server).
//!
//! # Layout
//! - [`config`]: the TOML file, `${ENV}` interpolation, validation into the runtime [`Config`].
//! - [`server`]: accept loop, HTTP/1.1 + HTTP/2, the HTTP surface, TLS, graceful drain.
//! - [`openai`]: the request fields routing reads, OpenAI-shaped errors, byte-level JSON edits.
//! - [`api`]: the client-API seam: one file per client API (chat, completions, embeddings).
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

pub mod api;
pub mod auth;
pub mod config;
pub mod demo;
pub mod fleet;
pub mod gateway;
pub mod limits;
pub mod openai;
pub mod proxy;
pub mod routing;
pub mod server;
pub mod sim;
pub mod telemetry;

use std::future::Future;
use std::sync::Arc;

pub use config::Config;
pub use gateway::Gateway;
use tokio::net::TcpListener;

/// Errors that stop the gateway.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
}

/// Serve the gateway on `listener` with `config` until `shutdown` resolves, then drain
/// in-flight requests for at most `server.shutdown_grace`.
///
/// When `[admin]` is configured its listener is bound here and serves the operations
/// endpoints; otherwise they are on `listener` too.
pub async fn run(
    listener: TcpListener,
    config: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), RunError> {
    let admin_listener = match &config.admin {
        Some(a) => Some(
            TcpListener::bind(a.listen)
                .await
                .map_err(|source| RunError::Bind {
                    addr: a.listen,
                    source,
                })?,
        ),
        None => None,
    };
    run_with(listener, admin_listener, config, shutdown).await
}

/// Like [`run`], with the admin listener bound by the caller (tests bind port 0).
pub async fn run_with(
    listener: TcpListener,
    admin_listener: Option<TcpListener>,
    config: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), RunError> {
    let grace = config.server.shutdown_grace;
    server::tls::configure_backends(&config.backend_tls);
    let gw = Gateway::new(config);
    serve_gateway(gw, listener, admin_listener, shutdown, grace).await;
    Ok(())
}

/// Serve an existing [`Gateway`] (so the caller can reload it). With `[tls]` the client
/// listener speaks TLS (certificate re-read on change); the admin listener stays plain HTTP.
/// A TLS configuration that cannot be loaded stops here with an error log: never plain HTTP
/// instead.
pub async fn serve_gateway(
    gw: Arc<Gateway>,
    listener: TcpListener,
    admin_listener: Option<TcpListener>,
    shutdown: impl Future<Output = ()> + Send + 'static,
    grace: std::time::Duration,
) {
    let _ = telemetry::metrics::handle();
    metrics::gauge!(telemetry::metrics::BUILD_INFO, "version" => env!("CARGO_PKG_VERSION"))
        .set(1.0);
    // Present from the start, so `increase(...)` alerts see the first reload too.
    for result in ["applied", "rejected"] {
        metrics::counter!(telemetry::metrics::CONFIG_RELOADS_TOTAL, "result" => result)
            .increment(0);
    }
    let tls = match &gw.runtime().config.tls {
        Some(t) => match server::tls::ServerTls::new(t) {
            Ok(tls) => {
                tls.spawn_watch(Arc::downgrade(&gw));
                Some(tls)
            }
            Err(e) => {
                tracing::error!("cannot serve TLS: {e}");
                return;
            }
        },
        None => None,
    };
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, tls = tls.is_some(), "sluice listening");
    }
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let gw_for_stop = gw.clone();
    tokio::spawn(async move {
        shutdown.await;
        // Readiness goes first; the listeners close after `shutdown_delay`, so a load balancer
        // (Kubernetes endpoints) stops sending before connections are refused.
        gw_for_stop.set_unready();
        let delay = gw_for_stop.runtime().config.server.shutdown_delay;
        if !delay.is_zero() {
            tracing::info!(
                ?delay,
                "unready; closing the listeners after the shutdown delay"
            );
            tokio::time::sleep(delay).await;
        }
        let _ = stop_tx.send(true);
    });
    let wait = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|v| *v).await;
    };
    let admin_task = admin_listener.map(|l| {
        if let Ok(addr) = l.local_addr() {
            tracing::info!(%addr, "admin listening");
        }
        let app = server::routes::admin(gw.clone());
        let limits = server::ListenerLimits::admin(&gw.runtime().config);
        tokio::spawn(server::serve(l, app, limits, wait(stop_rx.clone()), grace))
    });
    let app = server::routes::api(gw.clone(), admin_task.is_none());
    let limits = server::ListenerLimits::client(&gw.runtime().config.server);
    server::serve_with_tls(listener, app, tls, limits, wait(stop_rx), grace).await;
    if let Some(t) = admin_task {
        let _ = t.await;
    }
}
