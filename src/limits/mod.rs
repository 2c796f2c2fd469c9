//! Tenant limits: requests and tokens per window, concurrency, daily and monthly token budgets —
//! admission before a request is routed, reconciliation with the real usage when it ends, usage
//! accounting.
//!
//! - [`plan`]: the checks one request must pass (key limits, `[limits]` defaults, the tenant's
//!   team limits) and budget calendar arithmetic.
//! - [`local`]: the in-process store (one lock: all checks of a request pass or none is taken).
//! - [`shared`]: the Redis store (the same arithmetic in atomic Lua scripts, server time), used
//!   when `[limits] redis_url` is set, with `fail_open` deciding what happens when it is down.
//! - [`headers`]: OpenAI's `x-ratelimit-*` headers.
//! - [`usage`]: usage per key, tenant, model and backend.
//!
//! Invariants: a [`Permit`] holds whatever it reserved (concurrency slots, a token reservation)
//! and gives back what was not used exactly once — when its hook runs at the end of the request,
//! or when it is dropped unsettled (every early exit), which refunds the whole reservation.
//! Limit and usage state live here, not in the config snapshot, so they outlive reloads; a
//! changed limit applies to the counts already made.

pub mod headers;
pub mod local;
pub mod plan;
pub mod shared;
pub mod usage;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use arc_swap::{ArcSwap, ArcSwapOption};
use http::{HeaderMap, StatusCode};

use crate::auth::Identity;
use crate::config::validate::LimitSet;
use crate::config::Config;
use crate::openai::ApiError;
use crate::settle::{Outcome, SettleHook};
use crate::telemetry::metrics as m;
use headers::go_duration;
use local::LocalStore;
use plan::{Check, CheckState, Kind};
use shared::RedisStore;
use usage::{UsageBook, UsageReport};

/// Wall-clock milliseconds since the epoch (budgets follow UTC days).
pub fn unix_ms() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64() * 1000.0)
        .unwrap_or(0.0)
}

/// What a config says about limits.
#[derive(Debug, Clone)]
struct Settings {
    window_ms: f64,
    fail_open: bool,
    defaults: LimitSet,
    tenants: HashMap<String, LimitSet>,
}

impl Settings {
    fn of(config: &Config) -> Settings {
        Settings {
            window_ms: (config.limits.window.as_secs_f64() * 1000.0).max(1.0),
            fail_open: config.limits.fail_open,
            defaults: config.limits.defaults,
            tenants: config
                .tenants
                .iter()
                .map(|t| (t.name.clone(), t.limits))
                .collect(),
        }
    }
}

/// The limit state of a gateway process (survives reloads).
pub struct Limits {
    settings: ArcSwap<Settings>,
    local: Arc<LocalStore>,
    shared: ArcSwapOption<RedisStore>,
    usage: Arc<UsageBook>,
}

impl std::fmt::Debug for Limits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Limits")
            .field("settings", &self.settings.load())
            .field("shared", &self.shared.load().is_some())
            .finish_non_exhaustive()
    }
}

fn shared_store(config: &Config) -> Option<Arc<RedisStore>> {
    let url = config.redis_url.as_deref()?;
    match RedisStore::new(url, config.limits.concurrency_lease) {
        Ok(s) => Some(Arc::new(s)),
        Err(e) => {
            tracing::error!("limits.redis_url is unusable ({e}); limits are enforced per replica");
            None
        }
    }
}

impl Limits {
    pub fn new(config: &Config) -> Limits {
        Limits {
            settings: ArcSwap::from_pointee(Settings::of(config)),
            local: Arc::new(LocalStore::default()),
            shared: ArcSwapOption::new(shared_store(config)),
            usage: Arc::new(UsageBook::default()),
        }
    }

    /// Apply a new config's limits, keeping the counters of keys that still exist.
    pub fn reconfigure(&self, config: &Config) {
        self.settings.store(Arc::new(Settings::of(config)));
        let same = match (&*self.shared.load(), config.redis_url.as_deref()) {
            (Some(s), Some(url)) => {
                s.url() == url && s.lease_ttl() == config.limits.concurrency_lease
            }
            (None, None) => true,
            _ => false,
        };
        if !same {
            self.shared.store(shared_store(config));
        }
    }

    /// Usage counted so far.
    pub fn usage_report(&self) -> UsageReport {
        self.usage.report()
    }

    /// Admit a request of `identity` for `model` that is expected to use `tokens` tokens
    /// (prompt estimate plus expected output), or refuse it with a 429.
    pub async fn admit(
        &self,
        identity: &Identity,
        model: &str,
        tokens: u64,
    ) -> Result<Permit, ApiError> {
        self.admit_checks(identity, model, tokens, |_| true).await
    }

    /// Admit a request that generates nothing (a call on a stored response by its id): only
    /// the requests-per-window limits apply; no tokens are reserved and no usage is recorded.
    /// `what` names it in a refusal.
    pub async fn admit_request(&self, identity: &Identity, what: &str) -> Result<Permit, ApiError> {
        self.admit_checks(identity, what, 0, |c| c.kind == Kind::Requests)
            .await
    }

    async fn admit_checks(
        &self,
        identity: &Identity,
        model: &str,
        tokens: u64,
        keep: impl Fn(&Check) -> bool,
    ) -> Result<Permit, ApiError> {
        let s = self.settings.load_full();
        let key_limits = identity
            .config
            .as_ref()
            .map(|k| k.limit_set())
            .unwrap_or_default()
            .or(s.defaults);
        let tenant_limits = s.tenants.get(&identity.tenant).copied();
        let mut checks = plan::checks(
            &identity.key,
            key_limits,
            &identity.tenant,
            tenant_limits,
            tokens,
        );
        checks.retain(|c| keep(c));
        let mut held = Held {
            store: None,
            checks: Vec::new(),
            periods: Vec::new(),
            reserved: tokens,
            lease: String::new(),
            renewal: None,
            window_ms: s.window_ms,
            usage: self.usage.clone(),
            key: identity.key.clone(),
            tenant: identity.tenant.clone(),
            model: model.to_string(),
            backend: None,
        };
        if checks.is_empty() {
            return Ok(Permit {
                headers: HeaderMap::new(),
                held: Some(held),
            });
        }
        let lease = format!("{:032x}", rand::random::<u128>());
        let shared = self.shared.load_full();
        let (decision, store) = match shared {
            Some(r) => match r.admit(&checks, s.window_ms, &lease).await {
                Ok(d) => {
                    if d.decision.refused.is_none() {
                        held.renewal = shared::Renewal::start(r.clone(), &checks, &lease);
                    }
                    (d.decision, Store::Shared(r))
                }
                Err(e) => {
                    if !matches!(e, shared::SharedError::Resting) {
                        tracing::warn!(fail_open = s.fail_open, "shared limits unavailable: {e}");
                    }
                    if !s.fail_open {
                        metrics::counter!(m::RATELIMIT_REJECTIONS_TOTAL, "tenant" => identity.tenant.clone(), "scope" => "shared", "limit" => "unavailable").increment(1);
                        return Err(ApiError::new(
                            StatusCode::SERVICE_UNAVAILABLE,
                            "server_error",
                            "The rate limiter is unavailable; please retry shortly.",
                        )
                        .with_code("rate_limiter_unavailable")
                        .with_retry_after(shared::RETRY_AFTER_FAILURE));
                    }
                    let d = self.local.admit(&checks, s.window_ms, unix_ms());
                    (d, Store::Local(self.local.clone()))
                }
            },
            None => {
                let d = self.local.admit(&checks, s.window_ms, unix_ms());
                (d, Store::Local(self.local.clone()))
            }
        };
        let headers = headers::rate_headers(&checks, &decision.states);
        if let Some((i, retry)) = decision.refused {
            let c = &checks[i];
            metrics::counter!(m::RATELIMIT_REJECTIONS_TOTAL, "tenant" => identity.tenant.clone(), "scope" => c.scope.label(), "limit" => c.kind.label()).increment(1);
            let mut err = refusal(c, &decision.states[i], retry, model, s.window_ms);
            err.headers = headers;
            return Err(err);
        }
        held.periods = decision.states.iter().map(|st| st.period).collect();
        held.checks = checks;
        held.lease = lease;
        held.store = Some(store);
        Ok(Permit {
            headers,
            held: Some(held),
        })
    }
}

/// The 429 for a refused check, worded like OpenAI's.
fn refusal(
    c: &Check,
    st: &CheckState,
    retry: Option<u64>,
    model: &str,
    window_ms: f64,
) -> ApiError {
    let who = format!("{} `{}`", c.scope.label(), c.name);
    let per = if (window_ms - 60_000.0).abs() < 0.5 {
        "min".to_string()
    } else {
        go_duration(window_ms as u64)
    };
    let again = retry
        .map(|ms| format!(" Please try again in {}.", go_duration(ms)))
        .unwrap_or_default();
    let (kind, code, message) = match c.kind {
        Kind::Requests => (
            "requests",
            "rate_limit_exceeded",
            format!(
                "Rate limit reached for {model} in {who} on requests per {per} (RPM): Limit {}, Used {}, Requested 1.{again}",
                c.limit, st.used
            ),
        ),
        Kind::Tokens if retry.is_none() => (
            "tokens",
            "rate_limit_exceeded",
            format!(
                "Request too large for {model} in {who} on tokens per {per} (TPM): Limit {}, Requested {}. The input or output tokens must be reduced in order to run successfully.",
                c.limit, c.cost
            ),
        ),
        Kind::Tokens => (
            "tokens",
            "rate_limit_exceeded",
            format!(
                "Rate limit reached for {model} in {who} on tokens per {per} (TPM): Limit {}, Used {}, Requested {}.{again}",
                c.limit, st.used, c.cost
            ),
        ),
        Kind::Concurrency => (
            "requests",
            "rate_limit_exceeded",
            format!(
                "Too many concurrent requests for {model} in {who}: Limit {}.{again}",
                c.limit
            ),
        ),
        Kind::Daily | Kind::Monthly => (
            "insufficient_quota",
            "insufficient_quota",
            format!(
                "You exceeded the {} token budget of {who}: Limit {}, Used {}, Requested {}.{}",
                if c.kind == Kind::Daily { "daily" } else { "monthly" },
                c.limit,
                st.used,
                c.cost,
                retry
                    .map(|ms| format!(" It resets in {}.", go_duration(ms)))
                    .unwrap_or_default()
            ),
        ),
    };
    let mut e = ApiError::new(StatusCode::TOO_MANY_REQUESTS, kind, message).with_code(code);
    if let Some(ms) = retry {
        e = e.with_retry_after(Duration::from_millis(ms));
    }
    e
}

enum Store {
    Local(Arc<LocalStore>),
    Shared(Arc<RedisStore>),
}

/// What an admitted request took, and where.
struct Held {
    /// `None` when no limit applied (nothing to give back).
    store: Option<Store>,
    checks: Vec<Check>,
    periods: Vec<i64>,
    reserved: u64,
    lease: String,
    /// Shared mode: keeps the concurrency leases alive while the request runs.
    renewal: Option<shared::Renewal>,
    window_ms: f64,
    usage: Arc<UsageBook>,
    key: String,
    tenant: String,
    model: String,
    backend: Option<String>,
}

impl Held {
    /// `outcome` is `None` when the permit is dropped unsettled (refund everything).
    fn settle(mut self, outcome: Option<&Outcome>) {
        self.renewal = None;
        let actual = match outcome {
            Some(o) => match o.usage {
                Some(u) => u.prompt_tokens.saturating_add(u.completion_tokens),
                // Finished without a usage report: keep the reservation.
                None if o.complete => self.reserved,
                // Failed: refund.
                None => 0,
            },
            None => 0,
        };
        if let Some(o) = outcome {
            self.usage.record(
                &self.key,
                &self.tenant,
                &self.model,
                self.backend.as_deref().unwrap_or("-"),
                o.usage,
            );
        }
        let delta = i64::try_from(actual)
            .unwrap_or(i64::MAX)
            .saturating_sub(i64::try_from(self.reserved).unwrap_or(i64::MAX));
        match self.store {
            None => {}
            Some(Store::Local(l)) => l.settle(
                &self.checks,
                &self.periods,
                delta,
                self.window_ms,
                unix_ms(),
            ),
            Some(Store::Shared(r)) => {
                let (checks, periods, lease, window) =
                    (self.checks, self.periods, self.lease, self.window_ms);
                let store = r.clone();
                // On the store's runtime; outside any runtime the leases expire on their own.
                let _ = store.spawn(async move {
                    if let Err(e) = r.settle(&checks, &periods, delta, window, &lease).await {
                        tracing::warn!("shared limits: could not settle a request: {e}");
                    }
                });
            }
        }
    }
}

/// What one admitted request holds.
pub struct Permit {
    headers: HeaderMap,
    held: Option<Held>,
}

impl std::fmt::Debug for Permit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Permit")
            .field("headers", &self.headers)
            .finish_non_exhaustive()
    }
}

impl Permit {
    /// `x-ratelimit-*` headers for the response.
    pub fn headers(&self) -> HeaderMap {
        self.headers.clone()
    }

    /// The backend that served the request (for usage accounting).
    pub fn with_backend(mut self, backend: &str) -> Permit {
        if let Some(h) = self.held.as_mut() {
            h.backend = Some(backend.to_string());
        }
        self
    }

    /// Reconcile the reservation with the request's real usage when it ends.
    /// If the hook is dropped without running, the permit's `Drop` refunds as usual.
    pub fn into_hook(self) -> SettleHook {
        Box::new(move |outcome: &Outcome| {
            let mut permit = self;
            if let Some(h) = permit.held.take() {
                h.settle(Some(outcome));
            }
        })
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        if let Some(h) = self.held.take() {
            h.settle(None);
        }
    }
}
