//! One backend: configuration, HTTP client and live state.
//!
//! [`BackendState`] is what routing reads on every request, so the hot fields are atomics read
//! without a lock; health transitions, which touch several fields at once, take a short mutex and
//! then publish the resulting [`Health`] atomically.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use bytes::Bytes;
use http::{header, Method, Request, StatusCode, Uri};
use http_body_util::{BodyExt, Limited};

use super::background::LineBound;
use super::load::{LoadCounters, Yielding};
use super::signals::Signals;
use super::speed::Speeds;
use crate::config::{BackendConfig, BackendKind, HealthConfig};
use crate::upstream::{BackendTls, Pools, Target, ThreadClient};
pub use crate::upstream::{HttpClient, HttpsConnector};

/// Why a gateway-side call to a backend ([`Backend::call`]) brought no whole answer.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    #[error("bad URL: {0}")]
    Url(String),
    #[error("bad request: {0}")]
    Request(String),
    /// Connect or transport failure, with its root cause.
    #[error("{0}")]
    Transport(String),
    /// The answer's body broke off or was larger than the limit.
    #[error("body: {0}")]
    Body(String),
}

/// Where a backend stands, as routing and `/admin/backends` see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Health {
    /// Not probed yet: routable, failover covers a wrong guess.
    Unknown = 0,
    /// Refusing connections and never seen healthy: still starting, not an alarm.
    Starting = 1,
    Healthy = 2,
    /// The engine said it is busy (429/503 or a huge queue): used only when nothing better exists.
    Overloaded = 3,
    /// Loading a model (Ollama): used only when nothing better exists.
    Loading = 4,
    /// Taken out by live-traffic failures until its ejection time passes and probes pass.
    Ejected = 5,
    /// Leaving the pool: no new requests, in-flight ones finish.
    Draining = 6,
    /// Probes fail.
    Down = 7,
}

impl Health {
    pub fn from_u8(v: u8) -> Health {
        match v {
            1 => Health::Starting,
            2 => Health::Healthy,
            3 => Health::Overloaded,
            4 => Health::Loading,
            5 => Health::Ejected,
            6 => Health::Draining,
            7 => Health::Down,
            _ => Health::Unknown,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Health::Unknown => "unknown",
            Health::Starting => "starting",
            Health::Healthy => "healthy",
            Health::Overloaded => "overloaded",
            Health::Loading => "loading",
            Health::Ejected => "ejected",
            Health::Draining => "draining",
            Health::Down => "down",
        }
    }

    pub const ALL: [Health; 8] = [
        Health::Unknown,
        Health::Starting,
        Health::Healthy,
        Health::Overloaded,
        Health::Loading,
        Health::Ejected,
        Health::Draining,
        Health::Down,
    ];

    /// Whether routing may pick it at all.
    pub fn routable(self) -> bool {
        matches!(
            self,
            Health::Unknown | Health::Healthy | Health::Overloaded | Health::Loading
        )
    }

    /// Whether routing prefers it over degraded backends.
    pub fn preferred(self) -> bool {
        matches!(self, Health::Unknown | Health::Healthy)
    }

    /// Whether it is out because it failed (probes, live traffic, or refusing connections):
    /// requests still waiting for its answer are rescued elsewhere.
    pub fn failed(self) -> bool {
        matches!(self, Health::Ejected | Health::Down | Health::Starting)
    }
}

pub use super::clock::monotonic_ms;

/// Client model name → the name the backend knows it by.
pub type ModelMap = HashMap<String, String>;

/// Health bookkeeping that changes together.
#[derive(Debug, Default)]
pub struct Track {
    pub probe_ok_streak: u32,
    pub probe_fail_streak: u32,
    pub live_fail_streak: u32,
    pub ejections: u32,
    pub ejected_until_ms: u64,
    pub ever_healthy: bool,
    pub last_error: Option<String>,
    pub last_change_ms: u64,
    /// Busy answers (429/503) in a row: each doubles the skip when no `Retry-After` is given.
    pub busy_streak: u32,
    /// When the last probe ran (ms since process start), for `/admin/backends`.
    pub last_probe_ms: u64,
}

/// How long a backend is skipped after a busy answer without `Retry-After`: 250 ms, doubling
/// with each busy answer in a row, at most 8 s.
pub fn busy_backoff(streak: u32) -> Duration {
    Duration::from_millis(250u64 << streak.min(5))
}

/// The smallest share of traffic a backend in slow start gets.
pub const SLOW_START_MIN_SHARE: f64 = 0.1;

/// Live state of one backend.
///
/// Every field is private: the load counters change only through [`super::LoadGuard`], the
/// rest only through the named methods below (`record_*`, `set_*`, `count_request`, ...).
/// Readers use the accessors, or [`super::view::BackendView`] for one snapshot of all of it.
#[derive(Debug)]
pub struct BackendState {
    health: AtomicU8,
    track: Mutex<Track>,
    /// Requests and tokens in flight here, and pending prefills (see [`super::load`]).
    load: LoadCounters,
    /// A backend's `Retry-After`: not routed to before this time (ms since process start).
    skip_until_ms: AtomicU64,
    draining: AtomicBool,
    /// Models discovered from the backend's own list (empty until the first probe answers).
    discovered: ArcSwap<ModelMap>,
    /// Context length per backend model name, as the backend's model list reports it (vLLM's
    /// `max_model_len`); empty when it reports none.
    context_lengths: ArcSwap<BTreeMap<String, u64>>,
    requests_total: AtomicU64,
    failures_total: AtomicU64,
    /// When the backend was last re-admitted (ms since process start; 0 = never): its share of
    /// traffic ramps up from then over `health.slow_start`.
    admitted_at_ms: AtomicU64,
    /// Concurrency limit the engine announced (TGI `/info` `max_concurrent_requests`; 0 = none).
    learned_max_concurrent: AtomicU64,
    /// Requests waiting inside the engine (vLLM `vllm:num_requests_waiting`), from the probe.
    engine_waiting: AtomicU64,
    /// The engine's own load report, refreshed by the signals loop (see [`super::signals`]).
    signals: ArcSwap<Signals>,
    /// When a metrics read last showed requests waiting in the engine (ms; 0 = never).
    waiting_seen_ms: AtomicU64,
    /// Measured speeds (EWMAs), fed when requests settle (see [`super::speed`]).
    speeds: Speeds,
    /// What the engine reports of its own timing, as windows (see [`super::timings`]).
    timings: super::timings::Timings,
    kv: super::kv::KvCache,
    adapters: Arc<super::adapters::Adapters>,
    /// Bumped each time the backend enters a failed state ([`Health::failed`]): requests
    /// waiting for its response head select on it and are rescued elsewhere at once.
    withdrawals: tokio::sync::watch::Sender<u64>,
    /// When it last answered a live request (ms since process start; 0 = never): the
    /// adaptive first-byte deadline counts a wait only while other backends answer.
    last_answer_ms: AtomicU64,
    /// The bound on background requests here, set by whoever runs them (the batch
    /// runner's step budget), and when an interactive request last came.
    allowance: super::background::Allowance,
}

impl Default for BackendState {
    fn default() -> Self {
        Self::new()
    }
}

impl BackendState {
    pub fn new() -> Self {
        BackendState {
            health: AtomicU8::new(Health::Unknown as u8),
            track: Mutex::new(Track::default()),
            load: LoadCounters::default(),
            skip_until_ms: AtomicU64::new(0),
            draining: AtomicBool::new(false),
            discovered: ArcSwap::from_pointee(ModelMap::new()),
            context_lengths: ArcSwap::from_pointee(BTreeMap::new()),
            requests_total: AtomicU64::new(0),
            failures_total: AtomicU64::new(0),
            admitted_at_ms: AtomicU64::new(0),
            learned_max_concurrent: AtomicU64::new(0),
            engine_waiting: AtomicU64::new(0),
            signals: ArcSwap::from_pointee(Signals::default()),
            waiting_seen_ms: AtomicU64::new(0),
            speeds: Speeds::default(),
            timings: Default::default(),
            kv: Default::default(),
            adapters: Default::default(),
            withdrawals: tokio::sync::watch::Sender::new(0),
            last_answer_ms: AtomicU64::new(0),
            allowance: Default::default(),
        }
    }

    /// The load counters, for [`super::LoadGuard`], the only code that changes them.
    pub(super) fn counters(&self) -> &LoadCounters {
        &self.load
    }

    /// Requests Sluice has in flight here.
    pub fn inflight_requests(&self) -> u64 {
        self.load.requests()
    }

    /// Of the requests in flight, those run in the background.
    pub fn background_requests(&self) -> u64 {
        self.load.background()
    }

    /// What the background requests in flight hold of the counters.
    pub fn background_load(&self) -> Yielding {
        self.load.background_load()
    }

    /// The most background requests routed here at once now (`None`: no bound but the
    /// slots), by the published bound and the interactive requests in flight
    /// ([`super::background`]).
    pub fn background_allowance(&self) -> Option<u64> {
        self.allowance
            .allowance(self.interactive_requests(), monotonic_ms())
    }

    /// Bound the background requests routed here from now on (`None`: no bound). Those in
    /// flight are not cut; a pick reads the bound without holding it, so lines routed at the
    /// same instant can pass it by the few of one dispatch round.
    pub fn set_background_bound(&self, bound: Option<LineBound>) {
        self.allowance.set(bound);
    }

    /// An interactive request, counted in flight here, was routed here: the allowance holds
    /// (see [`super::background::IDLE`]). Whether the backend was idle until it came (its
    /// background requests held no bound).
    pub fn interactive_routed(&self) -> bool {
        let others = self.interactive_requests().saturating_sub(1);
        self.allowance.interactive_routed(monotonic_ms(), others)
    }

    /// Of the requests in flight, those not run in the background.
    fn interactive_requests(&self) -> u64 {
        self.inflight_requests()
            .saturating_sub(self.background_requests())
    }

    /// Tokens (prompt still to prefill plus output still expected) of the requests in flight.
    pub fn inflight_tokens(&self) -> u64 {
        self.load.tokens()
    }

    /// Requests sent here whose first token has not come yet: the prefill work queued ahead
    /// of a new request.
    pub fn pending_prefill_requests(&self) -> u64 {
        self.load.pending_prefill_requests()
    }

    /// The estimated prompt tokens of [`Self::pending_prefill_requests`].
    pub fn pending_prefill_tokens(&self) -> u64 {
        self.load.pending_prefill_tokens()
    }

    /// Requests sent here since the process started (attempts, failovers included).
    pub fn requests_total(&self) -> u64 {
        self.requests_total.load(Ordering::Relaxed)
    }

    /// One request is being sent here.
    pub fn count_request(&self) {
        self.requests_total.fetch_add(1, Ordering::Relaxed);
    }

    /// Live-traffic failures here since the process started.
    pub fn failures_total(&self) -> u64 {
        self.failures_total.load(Ordering::Relaxed)
    }

    /// Not routed to before this time (ms since process start, see [`monotonic_ms`]).
    pub fn skip_until_ms(&self) -> u64 {
        self.skip_until_ms.load(Ordering::Relaxed)
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// The backend left the fleet: no new requests, in-flight ones finish.
    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::Relaxed);
    }

    /// Models discovered from the backend's own list (empty until the first probe answers).
    pub fn discovered(&self) -> arc_swap::Guard<Arc<ModelMap>> {
        self.discovered.load()
    }

    pub fn set_discovered(&self, models: ModelMap) {
        self.discovered.store(Arc::new(models));
    }

    /// The context length the backend reported for its model `backend_model`.
    /// (Ollama names `m` and `m:latest` the same model.)
    pub fn context_length(&self, backend_model: &str) -> Option<u64> {
        let lengths = self.context_lengths.load();
        let bare = backend_model.strip_suffix(":latest");
        lengths
            .get(backend_model)
            .or_else(|| bare.and_then(|b| lengths.get(b)))
            .or_else(|| lengths.get(&format!("{backend_model}:latest")))
            .copied()
    }

    /// Replace the reported context lengths (an empty report keeps the previous ones: a list
    /// that lost the field says nothing new about the models).
    pub fn set_context_lengths(&self, lengths: BTreeMap<String, u64>) {
        if !lengths.is_empty() {
            self.context_lengths.store(Arc::new(lengths));
        }
    }

    /// Add reported context lengths to those known (Ollama reports only its loaded models).
    pub fn add_context_lengths(&self, lengths: BTreeMap<String, u64>) {
        if !lengths.is_empty() {
            let mut all = BTreeMap::clone(&self.context_lengths.load());
            all.extend(lengths);
            self.context_lengths.store(Arc::new(all));
        }
    }

    /// Every context length known, by backend model name.
    pub fn context_lengths(&self) -> Arc<BTreeMap<String, u64>> {
        self.context_lengths.load_full()
    }

    /// The backend was re-admitted at `at_ms` (ms since process start): slow start begins.
    pub fn record_admission(&self, at_ms: u64) {
        self.admitted_at_ms.store(at_ms.max(1), Ordering::Relaxed);
    }

    /// Concurrency limit the engine announced (0: none).
    pub fn learned_max_concurrent(&self) -> u64 {
        self.learned_max_concurrent.load(Ordering::Relaxed)
    }

    pub fn set_learned_max_concurrent(&self, n: u64) {
        self.learned_max_concurrent.store(n, Ordering::Relaxed);
    }

    /// Requests waiting inside the engine, as it last reported them.
    pub fn engine_waiting(&self) -> u64 {
        self.engine_waiting.load(Ordering::Relaxed)
    }

    pub fn set_engine_waiting(&self, n: u64) {
        self.engine_waiting.store(n, Ordering::Relaxed);
    }

    /// The engine's own load report (see [`super::signals`]).
    pub fn signals(&self) -> arc_swap::Guard<Arc<Signals>> {
        self.signals.load()
    }

    pub fn set_signals(&self, signals: Signals) {
        let waiting = signals
            .total
            .iter()
            .chain(signals.per_model.values())
            .any(|l| l.waiting > 0.0);
        if waiting && signals.at_ms != 0 {
            self.waiting_seen_ms
                .fetch_max(signals.at_ms, Ordering::Relaxed);
        }
        self.signals.store(Arc::new(signals));
    }

    /// When a metrics read last showed requests waiting in the engine (ms, see
    /// [`monotonic_ms`]; 0 = never).
    pub fn waiting_seen_ms(&self) -> u64 {
        self.waiting_seen_ms.load(Ordering::Relaxed)
    }

    /// Measured speeds (EWMAs); they change only through [`Speeds::observe`].
    pub fn speeds(&self) -> &Speeds {
        &self.speeds
    }

    /// What the engine holds in its prefix cache, from its KV events.
    pub fn kv(&self) -> &super::kv::KvCache {
        &self.kv
    }

    /// The LoRA adapters it holds and runs.
    pub fn adapters(&self) -> &Arc<super::adapters::Adapters> {
        &self.adapters
    }

    pub fn timings(&self) -> &super::timings::Timings {
        &self.timings
    }

    pub fn health(&self) -> Health {
        if self.is_draining() {
            return Health::Draining;
        }
        Health::from_u8(self.health.load(Ordering::Relaxed))
    }

    /// Set the health; entering a failed state ([`Health::failed`]) from another state
    /// wakes the requests waiting here (see [`Self::withdrawals`]).
    pub fn set_health(&self, h: Health) {
        let before = Health::from_u8(self.health.swap(h as u8, Ordering::Relaxed));
        if h.failed() && !before.failed() {
            self.withdrawals.send_modify(|n| *n = n.wrapping_add(1));
        }
    }

    /// The health as last set, draining or not: a member that left because it failed is
    /// draining and failed at once.
    pub fn health_as_set(&self) -> Health {
        Health::from_u8(self.health.load(Ordering::Relaxed))
    }

    /// A receiver that sees the backend enter a failed state from now on. Subscribe before
    /// sending, then check [`Self::health`]: a failure in between is not missed.
    pub fn withdrawals(&self) -> tokio::sync::watch::Receiver<u64> {
        self.withdrawals.subscribe()
    }

    /// When it last answered a live request (ms since process start; 0 = never).
    pub fn last_answer_ms(&self) -> u64 {
        self.last_answer_ms.load(Ordering::Relaxed)
    }

    pub fn track(&self) -> std::sync::MutexGuard<'_, Track> {
        self.track.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether a request may be sent here now.
    pub fn routable(&self) -> bool {
        self.health().routable() && self.skip_until_ms() <= monotonic_ms()
    }

    /// Honour a backend's `Retry-After`.
    pub fn skip_for(&self, d: Duration) {
        let until = monotonic_ms().saturating_add(u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        self.skip_until_ms.fetch_max(until, Ordering::Relaxed);
    }

    /// A live request got an answer from this backend (any status it is responsible for
    /// being well, e.g. 2xx or a client's 4xx).
    pub fn record_live_success(&self) {
        self.last_answer_ms
            .fetch_max(monotonic_ms().max(1), Ordering::Relaxed);
        let mut t = self.track();
        t.live_fail_streak = 0;
        t.busy_streak = 0;
    }

    /// The engine answered "busy" (429, or 503 from an engine that is up): skip it for its
    /// `Retry-After`, or for a backoff that doubles with each busy answer in a row, and show
    /// it `overloaded` until probes see it fine after the skip.
    pub fn record_busy(&self, retry_after: Option<Duration>) {
        let mut t = self.track();
        let skip = retry_after.unwrap_or_else(|| busy_backoff(t.busy_streak));
        t.busy_streak = t.busy_streak.saturating_add(1);
        t.last_error = Some("busy".into());
        let current = self.health();
        if matches!(current, Health::Healthy | Health::Unknown) {
            t.last_change_ms = monotonic_ms();
            drop(t);
            self.set_health(Health::Overloaded);
        } else {
            drop(t);
        }
        self.skip_for(skip);
    }

    /// The share of its fair traffic this backend may take now: ramps linearly from
    /// [`SLOW_START_MIN_SHARE`] to 1 during `slow_start` after a re-admission.
    pub fn slow_start_share(&self, slow_start: Duration) -> f64 {
        let at = self.admitted_at_ms.load(Ordering::Relaxed);
        let window = u64::try_from(slow_start.as_millis()).unwrap_or(u64::MAX);
        if at == 0 || window == 0 {
            return 1.0;
        }
        let elapsed = monotonic_ms().saturating_sub(at);
        if elapsed >= window {
            return 1.0;
        }
        let f = elapsed as f64 / window as f64;
        SLOW_START_MIN_SHARE + (1.0 - SLOW_START_MIN_SHARE) * f
    }

    /// A live request failed at this backend. A connect failure ejects at once (the process is
    /// gone or refusing); other failures eject after `eject_after_failures` in a row.
    pub fn record_live_failure(&self, cfg: &HealthConfig, connect_failure: bool, why: &str) {
        self.failures_total.fetch_add(1, Ordering::Relaxed);
        let mut t = self.track();
        t.live_fail_streak += 1;
        t.last_error = Some(why.to_string());
        let current = self.health();
        if matches!(current, Health::Ejected | Health::Draining) {
            return;
        }
        if connect_failure || t.live_fail_streak >= cfg.eject_after_failures {
            let factor = 1u32 << t.ejections.min(16);
            let base = cfg
                .base_ejection
                .saturating_mul(factor)
                .min(cfg.max_ejection);
            t.ejections = t.ejections.saturating_add(1);
            t.ejected_until_ms =
                monotonic_ms() + u64::try_from(base.as_millis()).unwrap_or(u64::MAX);
            t.probe_ok_streak = 0;
            t.last_change_ms = monotonic_ms();
            let next = if !t.ever_healthy && connect_failure {
                Health::Starting
            } else {
                Health::Ejected
            };
            drop(t);
            self.set_health(next);
        }
    }
}

/// A backend of one config snapshot.
#[derive(Debug)]
pub struct Backend {
    pub config: BackendConfig,
    pub state: Arc<BackendState>,
    /// Connection pools, one per serving thread, over the fleet's backend TLS configuration.
    pools: Pools,
    /// Client model name → backend name, from the config.
    configured: ModelMap,
}

impl Backend {
    /// A backend with the default backend TLS settings (the system's trust roots).
    pub fn new(config: BackendConfig, state: Arc<BackendState>) -> Backend {
        Backend::with_tls(config, state, &BackendTls::default())
    }

    /// A backend whose clients use `tls` (its fleet's `[backend_tls]`).
    pub fn with_tls(config: BackendConfig, state: Arc<BackendState>, tls: &BackendTls) -> Backend {
        let pools = Pools::new(tls, config.timeouts.connect);
        let mut configured = ModelMap::new();
        for m in &config.models {
            let backend_name = config
                .model_names
                .get(m)
                .cloned()
                .unwrap_or_else(|| m.clone());
            configured.insert(m.clone(), backend_name);
        }
        // TGI lists no adapters: the ones it was started with are held for its base model
        if let Some(base) = config
            .models
            .first()
            .filter(|_| config.kind == BackendKind::Tgi)
        {
            let held = config
                .lora_adapters
                .iter()
                .map(|a| (a.clone(), base.clone()));
            state.adapters().set_listed(held);
        }
        Backend {
            config,
            state,
            pools,
            configured,
        }
    }

    pub fn name(&self) -> &str {
        &self.config.name
    }

    /// Whether `other` has the same configuration and TLS client settings, so what was built
    /// for one (a probe task) serves the other.
    pub fn same_setup(&self, other: &Backend) -> bool {
        self.config == other.config && self.pools.same_tls(&other.pools)
    }

    /// The HTTP client for this thread: a serving thread's own pool (see [`Pools::client`]),
    /// the control runtime's pool elsewhere.
    pub fn client(&self) -> &ThreadClient {
        self.pools.client()
    }

    pub fn kind(&self) -> BackendKind {
        self.config.kind
    }

    /// A call of the gateway's own to this backend (probes, scraping, tokenizer): `method` on
    /// `path` with the backend's key when it has one, a JSON `body` when given, and the answer
    /// read whole up to `limit` bytes. Any status is an answer; timeouts are the caller's.
    pub async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<Bytes>,
        limit: usize,
    ) -> Result<(StatusCode, Bytes), CallError> {
        let uri = self
            .url_for(path)
            .map_err(|e| CallError::Url(e.to_string()))?;
        let mut req = Request::builder().method(method).uri(uri);
        if let Some(key) = &self.config.api_key {
            req = req.header(header::AUTHORIZATION, format!("Bearer {key}"));
        }
        if body.is_some() {
            req = req.header(header::CONTENT_TYPE, "application/json");
        }
        let req = req
            .body(body.unwrap_or_default())
            .map_err(|e| CallError::Request(e.to_string()))?;
        let resp = self
            .client()
            .request(req)
            .await
            .map_err(|e| CallError::Transport(crate::upstream::describe_client_error(&e)))?;
        let status = resp.status();
        let body = Limited::new(resp.into_body(), limit)
            .collect()
            .await
            .map_err(|e| CallError::Body(e.to_string()))?
            .to_bytes();
        Ok((status, body))
    }

    /// The most requests Sluice sends here at once: the configured `max_concurrent`, else the
    /// limit the engine announced, else none.
    pub fn cap(&self) -> Option<u64> {
        if let Some(c) = self.config.max_concurrent {
            return Some(u64::from(c));
        }
        match self.state.learned_max_concurrent() {
            0 => None,
            n => Some(n),
        }
    }

    /// What background requests hold here that counts as free for a request: all of it for
    /// an interactive request (they give way to it; their slots, tokens and pending
    /// prefills), nothing for a background one.
    pub fn yielding_to(&self, background: bool) -> Yielding {
        if background {
            Yielding::NONE
        } else {
            self.state.background_load()
        }
    }

    /// Whether the backend has a slot for a request under its cap ([`Backend::yielding_to`]),
    /// and for a background one under its background allowance.
    pub fn has_slot_for(&self, background: bool) -> bool {
        if background
            && self
                .state
                .background_allowance()
                .is_some_and(|a| self.state.background_requests() >= a)
        {
            return false;
        }
        self.cap().is_none_or(|c| {
            self.state.inflight_requests() < c.saturating_add(self.yielding_to(background).requests)
        })
    }

    /// The backend's name for a client model, if it serves it.
    pub fn serves(&self, model: &str) -> Option<String> {
        if !self.configured.is_empty() {
            return self.configured.get(model).cloned();
        }
        self.state.discovered().get(model).cloned()
    }

    /// Client-facing model names this backend serves now.
    pub fn model_names(&self) -> Vec<String> {
        if !self.configured.is_empty() {
            let mut v: Vec<String> = self.configured.keys().cloned().collect();
            v.sort();
            return v;
        }
        let d = self.state.discovered();
        let mut v: Vec<String> = d.keys().cloned().collect();
        v.sort();
        v
    }

    /// Whether models come from the config (true) or from discovery.
    pub fn models_configured(&self) -> bool {
        !self.configured.is_empty()
    }

    /// Turn the names a backend lists into the client-facing map, applying `model_names`
    /// in reverse and Ollama's implicit `:latest` tag.
    pub fn discovered_map(&self, listed: &[String]) -> ModelMap {
        let mut map = ModelMap::new();
        for id in listed {
            map.insert(id.clone(), id.clone());
            if self.config.kind == BackendKind::Ollama {
                if let Some(bare) = id.strip_suffix(":latest") {
                    map.insert(bare.to_string(), id.clone());
                }
            }
            for (client, backend) in &self.config.model_names {
                if backend == id {
                    map.insert(client.clone(), id.clone());
                }
            }
        }
        map
    }

    /// The URL of `path` (e.g. `/v1/chat/completions`) on this backend. A base URL that
    /// already ends in `/v1` is not given a second one.
    pub fn url_for(&self, path: &str) -> Result<Uri, http::Error> {
        let base = &self.config.url;
        let prefix = base.path().trim_end_matches('/');
        let full_path = if prefix.ends_with("/v1") && path.starts_with("/v1/") {
            format!("{prefix}{}", &path[3..])
        } else {
            format!("{prefix}{path}")
        };
        let mut parts = http::uri::Parts::default();
        parts.scheme = base.scheme().cloned();
        parts.authority = base.authority().cloned();
        parts.path_and_query = Some(full_path.parse()?);
        Ok(Uri::from_parts(parts)?)
    }
}

impl Target for Backend {
    fn url_for(&self, path: &str) -> Result<Uri, http::Error> {
        Backend::url_for(self, path)
    }

    fn client(&self) -> &ThreadClient {
        Backend::client(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::validate::parse_backend_url;
    use crate::config::Timeouts;
    use crate::fleet::LoadGuard;
    use std::collections::BTreeMap;

    fn backend(kind: BackendKind, url: &str, models: &[&str], names: &[(&str, &str)]) -> Backend {
        Backend::new(
            BackendConfig {
                name: "b".into(),
                kind,
                url: parse_backend_url(url).unwrap(),
                models: models.iter().map(|s| s.to_string()).collect(),
                model_names: names
                    .iter()
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .collect::<BTreeMap<_, _>>(),
                api_key: None,
                weight: 1,
                max_concurrent: None,
                health_path: None,
                kv_events: Default::default(),
                max_adapters: None,
                lora_adapters: Vec::new(),
                timeouts: Timeouts::default(),
            },
            Arc::new(BackendState::new()),
        )
    }

    #[test]
    fn urls() {
        let b = backend(BackendKind::Vllm, "http://h:8000", &[], &[]);
        assert_eq!(b.url_for("/v1/models").unwrap(), "http://h:8000/v1/models");
        let b = backend(BackendKind::OpenAi, "https://api.x.com/v1", &[], &[]);
        assert_eq!(
            b.url_for("/v1/chat/completions").unwrap(),
            "https://api.x.com/v1/chat/completions"
        );
        let b = backend(BackendKind::OpenAi, "http://h/prefix/", &[], &[]);
        assert_eq!(
            b.url_for("/v1/models").unwrap(),
            "http://h/prefix/v1/models"
        );
    }

    #[test]
    fn configured_and_discovered_names() {
        let b = backend(
            BackendKind::Ollama,
            "http://h",
            &["llama-3.1-8b"],
            &[("llama-3.1-8b", "llama3.1:8b")],
        );
        assert_eq!(b.serves("llama-3.1-8b").as_deref(), Some("llama3.1:8b"));
        assert_eq!(b.serves("other"), None);

        let b = backend(
            BackendKind::Ollama,
            "http://h",
            &[],
            &[("llama-3.1-8b", "llama3.1:8b")],
        );
        let map = b.discovered_map(&["llama3.1:8b".into(), "qwen:latest".into()]);
        b.state.set_discovered(map);
        assert_eq!(b.serves("llama-3.1-8b").as_deref(), Some("llama3.1:8b"));
        assert_eq!(b.serves("qwen").as_deref(), Some("qwen:latest"));
        assert_eq!(b.serves("qwen:latest").as_deref(), Some("qwen:latest"));
    }

    #[test]
    fn context_lengths_are_found_by_either_ollama_name_and_failures_withdraw() {
        let s = BackendState::new();
        s.set_context_lengths([("a:latest".to_string(), 8192), ("b".to_string(), 4096)].into());
        s.add_context_lengths([("c".to_string(), 2048)].into());
        s.set_context_lengths(BTreeMap::new());
        assert_eq!(s.context_length("a"), Some(8192));
        assert_eq!(s.context_length("b:latest"), Some(4096));
        assert_eq!(s.context_length("c"), Some(2048));
        assert_eq!(s.context_length("d"), None);
        // Entering a failed state wakes the waiters once; staying failed or recovering does not.
        let mut rx = s.withdrawals();
        s.set_health(Health::Healthy);
        s.set_health(Health::Overloaded);
        assert!(!rx.has_changed().unwrap());
        s.set_health(Health::Down);
        assert!(rx.has_changed().unwrap());
        rx.mark_unchanged();
        s.set_health(Health::Ejected);
        assert!(!rx.has_changed().unwrap());
        s.set_health(Health::Healthy);
        s.set_health(Health::Starting);
        assert!(rx.has_changed().unwrap());
    }

    #[test]
    fn connect_failure_ejects_at_once_other_failures_after_streak() {
        let cfg = crate::config::Config::empty().health;
        let s = BackendState::new();
        s.set_health(Health::Healthy);
        s.track().ever_healthy = true;
        s.record_live_failure(&cfg, false, "502");
        s.record_live_failure(&cfg, false, "502");
        assert_eq!(s.health(), Health::Healthy);
        s.record_live_failure(&cfg, false, "502");
        assert_eq!(s.health(), Health::Ejected);

        let s = BackendState::new();
        s.set_health(Health::Healthy);
        s.track().ever_healthy = true;
        s.record_live_failure(&cfg, true, "refused");
        assert_eq!(s.health(), Health::Ejected);
        assert!(!s.routable());
    }

    #[test]
    fn busy_answers_back_off_and_show_overloaded() {
        let s = BackendState::new();
        s.set_health(Health::Healthy);
        s.record_busy(None);
        assert_eq!(s.health(), Health::Overloaded);
        assert!(!s.routable());
        let first = s.skip_until_ms();
        s.record_busy(None);
        assert!(s.skip_until_ms() >= first);
        assert_eq!(s.track().busy_streak, 2);
        assert_eq!(busy_backoff(1), Duration::from_millis(500));
        assert_eq!(busy_backoff(30), Duration::from_millis(8000));
        s.record_live_success();
        assert_eq!(s.track().busy_streak, 0);
    }

    #[test]
    fn slow_start_ramps_from_min_share() {
        let s = BackendState::new();
        assert_eq!(s.slow_start_share(Duration::from_secs(5)), 1.0);
        s.record_admission(monotonic_ms());
        let share = s.slow_start_share(Duration::from_secs(5));
        assert!((SLOW_START_MIN_SHARE..0.2).contains(&share), "{share}");
        assert_eq!(s.slow_start_share(Duration::ZERO), 1.0);
    }

    #[test]
    fn a_background_allowance_bounds_only_background_requests() {
        let b = backend(BackendKind::Vllm, "http://127.0.0.1:1", &["m"], &[]);
        assert_eq!(b.state.background_allowance(), None);
        let one = LineBound {
            lines: 1.0,
            per_interactive: 0.0,
        };
        b.state.set_background_bound(Some(one));
        assert_eq!(
            b.state.background_allowance(),
            None,
            "no interactive request has come: nothing to protect"
        );
        let _interactive = LoadGuard::claim(b.state.clone(), 1, None, 0).unwrap();
        assert!(b.state.interactive_routed(), "the first one after none");
        assert_eq!(b.state.background_allowance(), Some(1));
        assert!(b.has_slot_for(true), "none held yet");
        let mut line = LoadGuard::claim(b.state.clone(), 1, None, 0).unwrap();
        line.set_background();
        assert!(!b.has_slot_for(true), "the one allowed is held");
        assert!(
            b.has_slot_for(false),
            "interactive requests are not bounded by it"
        );
        let grows = LineBound {
            lines: 1.0,
            per_interactive: 1.0,
        };
        b.state.set_background_bound(Some(grows));
        assert_eq!(
            b.state.background_allowance(),
            Some(2),
            "one more per interactive"
        );
        b.state.set_background_bound(None);
        assert!(b.has_slot_for(true));
    }

    #[test]
    fn each_shard_has_its_own_pool() {
        let b = Arc::new(backend(
            BackendKind::Vllm,
            "http://127.0.0.1:1",
            &["m"],
            &[],
        ));
        let pool = |b: &Backend| b.client() as *const ThreadClient as usize;
        let control = pool(&b);
        assert_eq!(control, pool(&b), "one pool per thread, kept");
        let on_shard = |i: usize| {
            let b = b.clone();
            std::thread::spawn(move || {
                crate::rt::enter(i);
                pool(&b)
            })
            .join()
            .unwrap()
        };
        let first = on_shard(1);
        assert_ne!(first, control, "a shard does not share the control pool");
        assert_eq!(first, on_shard(1), "the same shard, the same pool");
        if crate::rt::default_count() > 1 {
            assert_ne!(first, on_shard(2), "another shard, another pool");
        }
        // shards beyond the cores share pools, never the control one
        let beyond = on_shard(crate::rt::default_count() + 1);
        assert_ne!(beyond, control);
    }
}
