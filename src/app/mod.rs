//! The composition root: the one path that builds a gateway from a config and serves it
//! (used by `sluice serve`, `sluice demo` and the tests), and the config file watcher
//! ([`reload`]).
//!
//! Everything below is assembled here and nowhere else: the gateway's shared state
//! ([`Gateway::new`], which builds the fleet with its backend TLS from the snapshot), the
//! listeners with their TLS and limits, the admin surface, readiness on shutdown.

pub mod reload;

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::config::Config;
use crate::gateway::Gateway;
use crate::{server, telemetry};

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
    let (_, serving) = start(
        config,
        Listeners {
            client: listener,
            admin: admin_listener,
        },
        None,
        shutdown,
    );
    serving.await;
    Ok(())
}

/// Where a gateway serves: the client listener, and the admin listener when `[admin]` has its
/// own.
pub struct Listeners {
    pub client: TcpListener,
    pub admin: Option<TcpListener>,
}

/// The one build-and-serve path (`sluice serve`, `sluice demo`, the tests): build the gateway
/// for `config` and return it with the future that serves it on `listeners` until `shutdown`
/// resolves, then drains for at most `server.shutdown_grace`. With `reload_from`, that file is
/// reloaded on SIGHUP and on change ([`reload::spawn_watcher`]) once serving starts. Must run
/// inside a tokio runtime (the gateway starts its probes at once).
pub fn start(
    config: Config,
    listeners: Listeners,
    reload_from: Option<PathBuf>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> (Arc<Gateway>, impl Future<Output = ()> + Send + 'static) {
    let grace = config.server.shutdown_grace;
    let gw = Gateway::new(config);
    let serving = {
        let gw = gw.clone();
        async move {
            if let Some(path) = reload_from {
                reload::spawn_watcher(gw.clone(), path);
            }
            serve_gateway(gw, listeners.client, listeners.admin, shutdown, grace).await;
        }
    };
    (gw, serving)
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
    publish_build_metrics();
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
    let stop_rx = spawn_shutdown(gw.clone(), shutdown);
    let wait = |mut rx: watch::Receiver<bool>| async move {
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
    let (batches, runner) = start_batches(&gw, stop_rx.clone()).await;
    let app = server::routes::api(gw.clone(), admin_task.is_none(), batches);
    let limits = server::ListenerLimits::client(&gw.runtime().config.server);
    server::serve_with_tls(listener, app, tls, limits, wait(stop_rx), grace).await;
    if let Some(t) = admin_task {
        let _ = t.await;
    }
    if let Some(r) = runner {
        let _ = r.await;
    }
}

/// With `[batch]`: its store opened and its runner started (stopped with the listeners).
/// A store that cannot be opened leaves the Files and Batches APIs off, with an error log.
async fn start_batches(
    gw: &Arc<Gateway>,
    stop: watch::Receiver<bool>,
) -> (
    Option<Arc<crate::batch::Batches>>,
    Option<tokio::task::JoinHandle<()>>,
) {
    let Some(config) = gw.runtime().config.batch.clone() else {
        return (None, None);
    };
    let opened = tokio::task::spawn_blocking(move || crate::batch::Batches::open(&config)).await;
    match opened {
        Ok(Ok(b)) => {
            let runner = tokio::spawn(crate::batch::run(b.clone(), gw.clone(), stop));
            (Some(b), Some(runner))
        }
        Ok(Err(e)) => {
            tracing::error!(error = %e, "[batch] is off: its folder cannot be opened");
            (None, None)
        }
        Err(e) => {
            tracing::error!(error = %e, "[batch] is off");
            (None, None)
        }
    }
}

/// The metrics present from the start: the build, and the reload counters (so `increase(...)`
/// alerts see the first reload too).
fn publish_build_metrics() {
    let _ = telemetry::metrics::handle();
    metrics::gauge!(telemetry::metrics::BUILD_INFO, "version" => env!("CARGO_PKG_VERSION"))
        .set(1.0);
    for result in ["applied", "rejected"] {
        metrics::counter!(telemetry::metrics::CONFIG_RELOADS_TOTAL, "result" => result)
            .increment(0);
    }
}

/// When `shutdown` resolves: readiness goes first, then the listeners are told to close after
/// `shutdown_delay`, so a load balancer (Kubernetes endpoints) stops sending before
/// connections are refused. The receiver turns true when the listeners should close.
fn spawn_shutdown(
    gw: Arc<Gateway>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> watch::Receiver<bool> {
    let (stop_tx, stop_rx) = watch::channel(false);
    tokio::spawn(async move {
        shutdown.await;
        gw.set_unready();
        let delay = gw.runtime().config.server.shutdown_delay;
        if !delay.is_zero() {
            tracing::info!(
                ?delay,
                "unready; closing the listeners after the shutdown delay"
            );
            tokio::time::sleep(delay).await;
        }
        let _ = stop_tx.send(true);
    });
    stop_rx
}
