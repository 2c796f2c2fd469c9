//! The gateway's shared state: the live runtime snapshot (config, fleet, keys) behind an
//! `ArcSwap`, the router, the health monitor and the readiness flag.
//!
//! Invariant: a request loads the snapshot once and uses it to the end; a reload builds a whole
//! new snapshot (reusing backend states) and swaps it in atomically.
//!
//! Tracing (`[tracing]`) is part of the snapshot: a reload that changes its settings starts a
//! new tracer provider (exporter, sampler, span queue) and puts it in the new snapshot; the old
//! one serves the requests that started under it and, once the last of them is gone, its
//! export task sends what it queued and ends, on the main runtime, never on a request.
//!
//! Membership: a fleet snapshot is the configured backends plus the run-time members —
//! registered through the admin API (TTL heartbeat) and discovered through DNS. Every rebuild
//! (reload, registration, expiry, re-resolution) goes through [`Gateway::rebuild`], so run-time
//! members survive reloads. A backend that leaves the fleet is marked draining: requests of
//! older snapshots finish on it, none starts there.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use arc_swap::ArcSwap;

use crate::auth::KeyStore;
use crate::config::Config;
use crate::fleet::discovery::{self, Discovered};
use crate::fleet::health::HealthMonitor;
use crate::fleet::queue::WaitQueue;
use crate::fleet::registration::Registrations;
use crate::fleet::Fleet;
use crate::limits::Limits;
use crate::routing::Router;
use crate::telemetry::otel::{Settings, Tracing};

/// One consistent view of the configuration.
pub struct Runtime {
    pub config: Arc<Config>,
    pub fleet: Arc<Fleet>,
    pub keys: Arc<KeyStore>,
    /// OpenTelemetry export (`[tracing]`); `None`: off, and the request path makes no span.
    pub otel: Option<Arc<Tracing>>,
}

/// State shared by every connection and request.
pub struct Gateway {
    runtime: ArcSwap<Runtime>,
    pub router: Router,
    /// Tenant limits; outlive reloads.
    pub limits: Limits,
    health: Mutex<HealthMonitor>,
    ready: AtomicBool,
    /// Requests waiting for a backend slot (outlives reloads).
    pub queue: Arc<WaitQueue>,
    /// Interactive requests' asks for the slots background ones hold.
    pub make_room: crate::fleet::make_room::MakeRoom,
    /// Members registered through the admin API (outlive reloads).
    pub registrations: Registrations,
    /// Members found through DNS (outlive reloads).
    pub discovered: Discovered,
    /// Serialises fleet rebuilds, so two concurrent changes cannot lose one another.
    rebuild_lock: Mutex<()>,
    /// The workload trace (`[trace]`), opened at start-up.
    pub trace: Option<Arc<crate::telemetry::trace::TraceWriter>>,
    /// The runtime the gateway was built on (the control runtime): work that outlives a
    /// request, such as following a background response, runs there.
    pub main: tokio::runtime::Handle,
}

impl Gateway {
    /// Build the gateway and start probing its backends. Must run inside a tokio runtime.
    pub fn new(config: Config) -> Arc<Gateway> {
        let fleet = Fleet::build(&config, None);
        let limits = Limits::new(&config);
        let main = tokio::runtime::Handle::current();
        let runtime = Runtime {
            keys: Arc::new(KeyStore::new(&config)),
            fleet: Arc::new(fleet),
            otel: start_tracing(config.tracing.as_ref(), &main),
            config: Arc::new(config),
        };
        let trace = runtime.config.trace.as_ref().and_then(|path| {
            crate::telemetry::trace::TraceWriter::open(path)
                .map_err(|e| tracing::error!("cannot open the trace {}: {e}", path.display()))
                .ok()
                .map(Arc::new)
        });
        let mut monitor = HealthMonitor::default();
        monitor.sync(&runtime.fleet, &runtime.config.health);
        if runtime.keys.is_open() {
            tracing::warn!(
                "no [[keys]] configured: the gateway is OPEN, anyone who can reach it may use it \
                 (fine for a localhost sidecar, not for a shared network)"
            );
        }
        let gw = Arc::new(Gateway {
            runtime: ArcSwap::from_pointee(runtime),
            router: Router::new(),
            limits,
            health: Mutex::new(monitor),
            ready: AtomicBool::new(true),
            queue: WaitQueue::new(),
            make_room: Default::default(),
            registrations: Registrations::default(),
            discovered: Discovered::default(),
            rebuild_lock: Mutex::new(()),
            trace,
            main,
        });
        spawn_membership(Arc::downgrade(&gw));
        gw
    }

    /// The current snapshot.
    pub fn runtime(&self) -> Arc<Runtime> {
        self.runtime.load_full()
    }

    /// Swap in a new config; backends whose name, kind and URL are unchanged keep their state.
    pub fn reload(&self, config: Config) {
        let _serial = self.rebuild_lock.lock().unwrap_or_else(|p| p.into_inner());
        let old = self.runtime();
        let configured: std::collections::HashSet<&str> =
            config.backends.iter().map(|b| b.name.as_str()).collect();
        self.registrations.drop_shadowed(&configured);
        self.discovered.retain(&config.membership.discovery);
        let fleet = Fleet::build_with(&config, &self.members(&config), Some(&old.fleet));
        mark_removed_draining(&old.fleet, &fleet);
        self.limits.reconfigure(&config);
        let otel = if config.tracing == old.config.tracing {
            old.otel.clone()
        } else {
            start_tracing(config.tracing.as_ref(), &self.main)
        };
        let next = Runtime {
            keys: Arc::new(KeyStore::new(&config)),
            fleet: Arc::new(fleet),
            otel,
            config: Arc::new(config),
        };
        self.health
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .sync(&next.fleet, &next.config.health);
        self.runtime.store(Arc::new(next));
    }

    /// The run-time members for `config`: registered, then discovered.
    fn members(&self, config: &Config) -> Vec<crate::config::BackendConfig> {
        let mut m = self.registrations.configs();
        m.extend(
            self.discovered
                .configs(&config.membership.discovery, config.backend_timeouts),
        );
        m
    }

    /// Rebuild the fleet of the current config after a membership change (registration,
    /// expiry, DNS), keeping every unchanged backend's state.
    pub fn rebuild(&self) {
        let _serial = self.rebuild_lock.lock().unwrap_or_else(|p| p.into_inner());
        let old = self.runtime();
        let fleet = Fleet::build_with(&old.config, &self.members(&old.config), Some(&old.fleet));
        mark_removed_draining(&old.fleet, &fleet);
        let next = Runtime {
            keys: old.keys.clone(),
            fleet: Arc::new(fleet),
            otel: old.otel.clone(),
            config: old.config.clone(),
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

/// Tracing as `settings` say (`None`: off), its export task on `main`; an `https` collector
/// trusted as an https backend is, by the system's roots and its `ca_file`. A provider that
/// cannot be built leaves tracing off, with the reason logged.
fn start_tracing(
    settings: Option<&Settings>,
    main: &tokio::runtime::Handle,
) -> Option<Arc<Tracing>> {
    let settings = settings?;
    let tls = if settings.endpoint.starts_with("https://") {
        let extra = settings
            .ca_pem
            .as_deref()
            .map(|pem| crate::tls::ca_roots("tracing.ca_file", pem))
            .transpose();
        match extra.and_then(|extra| crate::tls::client_config_with(true, extra)) {
            Ok(tls) => Some(tls),
            Err(e) => {
                tracing::error!("tracing is off: the collector's TLS: {e}");
                return None;
            }
        }
    } else {
        None
    };
    match Tracing::start(settings, tls, main) {
        Ok(t) => Some(Arc::new(t)),
        Err(e) => {
            tracing::error!("tracing is off: {e}");
            None
        }
    }
}

/// Backends of `old` whose state is not carried into `new` stop taking requests.
fn mark_removed_draining(old: &Fleet, new: &Fleet) {
    for b in &old.backends {
        if !new.backends.iter().any(|n| Arc::ptr_eq(&n.state, &b.state)) {
            b.state.start_draining();
            tracing::info!(backend = b.name(), "backend left the fleet; draining");
        }
    }
}

/// How often membership (TTL expiry, DNS re-resolution) is checked.
const MEMBERSHIP_TICK: Duration = Duration::from_millis(100);

/// Expire registrations and re-resolve DNS entries for as long as the gateway lives.
fn spawn_membership(gw: Weak<Gateway>) {
    tokio::spawn(async move {
        let mut due: std::collections::HashMap<String, tokio::time::Instant> =
            std::collections::HashMap::new();
        loop {
            tokio::time::sleep(MEMBERSHIP_TICK).await;
            let Some(gw) = gw.upgrade() else { return };
            let mut changed = false;
            for name in gw.registrations.expire() {
                tracing::warn!(backend = %name, "registration expired (no heartbeat within its TTL)");
                // A member that stopped heartbeating is presumed dead: requests still waiting
                // for its answer are rescued elsewhere now (streams it is answering go on
                // while it drains).
                if let Some(b) = gw.runtime().fleet.get(&name) {
                    b.state.set_health(crate::fleet::Health::Down);
                }
                metrics::counter!(crate::telemetry::metrics::MEMBERSHIP_CHANGES_TOTAL, "source" => "expiry")
                    .increment(1);
                changed = true;
            }
            let rt = gw.runtime();
            let now = tokio::time::Instant::now();
            for d in &rt.config.membership.discovery {
                if due.get(&d.name).is_some_and(|t| *t > now) {
                    continue;
                }
                due.insert(d.name.clone(), now + d.interval);
                match tokio::time::timeout(d.interval, discovery::resolve(&d.host, d.port)).await {
                    Ok(Ok(addrs)) => {
                        if gw.discovered.update(&d.name, addrs) {
                            metrics::counter!(crate::telemetry::metrics::MEMBERSHIP_CHANGES_TOTAL, "source" => "dns")
                                .increment(1);
                            tracing::info!(entry = %d.name, host = %d.host, "DNS members changed");
                            changed = true;
                        }
                    }
                    Ok(Err(e)) => {
                        tracing::warn!(entry = %d.name, host = %d.host, "DNS lookup failed: {e}")
                    }
                    Err(_) => {
                        tracing::warn!(entry = %d.name, host = %d.host, "DNS lookup timed out")
                    }
                }
            }
            due.retain(|k, _| rt.config.membership.discovery.iter().any(|d| &d.name == k));
            drop(rt);
            if changed {
                gw.rebuild();
            }
        }
    });
}
