//! The gateway's shared state: the live runtime snapshot (config, fleet, keys) behind an
//! `ArcSwap`, the router, the health monitor and the readiness flag.
//!
//! Invariant: a request loads the snapshot once and uses it to the end; a reload builds a whole
//! new snapshot (reusing backend states) and swaps it in atomically.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;

use crate::auth::KeyStore;
use crate::config::Config;
use crate::fleet::health::HealthMonitor;
use crate::fleet::Fleet;
use crate::limits::Limits;
use crate::routing::Router;

/// One consistent view of the configuration.
pub struct Runtime {
    pub config: Arc<Config>,
    pub fleet: Arc<Fleet>,
    pub keys: Arc<KeyStore>,
}

/// State shared by every connection and request.
pub struct Gateway {
    runtime: ArcSwap<Runtime>,
    pub router: Router,
    /// Tenant limits; outlive reloads.
    pub limits: Limits,
    health: Mutex<HealthMonitor>,
    ready: AtomicBool,
}

impl Gateway {
    /// Build the gateway and start probing its backends. Must run inside a tokio runtime.
    pub fn new(config: Config) -> Arc<Gateway> {
        let fleet = Fleet::build(&config, None);
        let limits = Limits::new(&config);
        let runtime = Runtime {
            keys: Arc::new(KeyStore::new(&config)),
            fleet: Arc::new(fleet),
            config: Arc::new(config),
        };
        let mut monitor = HealthMonitor::default();
        monitor.sync(&runtime.fleet, &runtime.config.health);
        if runtime.keys.is_open() {
            tracing::warn!(
                "no [[keys]] configured: the gateway is OPEN, anyone who can reach it may use it \
                 (fine for a localhost sidecar, not for a shared network)"
            );
        }
        Arc::new(Gateway {
            runtime: ArcSwap::from_pointee(runtime),
            router: Router::new(),
            limits,
            health: Mutex::new(monitor),
            ready: AtomicBool::new(true),
        })
    }

    /// The current snapshot.
    pub fn runtime(&self) -> Arc<Runtime> {
        self.runtime.load_full()
    }

    /// Swap in a new config; backends whose name, kind and URL are unchanged keep their state.
    pub fn reload(&self, config: Config) {
        let old = self.runtime();
        let fleet = Fleet::build(&config, Some(&old.fleet));
        self.limits.reconfigure(&config);
        let next = Runtime {
            keys: Arc::new(KeyStore::new(&config)),
            fleet: Arc::new(fleet),
            config: Arc::new(config),
        };
        self.health
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .sync(&next.fleet, &next.config.health);
        self.runtime.store(Arc::new(next));
    }

    /// Whether `/readyz` should say yes: not shutting down, and some backend can serve.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Relaxed) && self.runtime().fleet.any_routable()
    }

    /// Start refusing readiness (first step of a graceful shutdown).
    pub fn set_unready(&self) {
        self.ready.store(false, Ordering::Relaxed);
    }

    pub fn accepting(&self) -> bool {
        self.ready.load(Ordering::Relaxed)
    }
}
