//! The validated configuration a gateway runs on: what [`super::validate`] produces from a
//! [`super::file::FileConfig`].
//!
//! Invariants: every value here is in range (validation reports anything else as a problem
//! with its location, it never clamps), defaults are already applied, `${ENV}` references are
//! expanded, and TLS files named here existed and parsed when the config was validated. A
//! `Config` is immutable once built and shared as `Arc<Config>`.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use http::Uri;

use super::file::FileConfig;
use crate::tokenizer::Tokenizer;

/// Default largest request body: enough for a 128k-token prompt with room to spare.
pub const DEFAULT_MAX_BODY_BYTES: usize = 16 * 1024 * 1024;
pub const DEFAULT_MAX_RESPONSE_BYTES: usize = 64 * 1024 * 1024;
/// Most threads `[server] threads` may ask for.
pub const MAX_SERVER_THREADS: u64 = 1024;

/// The validated configuration a gateway runs on.
#[derive(Debug, Clone)]
pub struct Config {
    pub server: ServerConfig,
    pub admin: Option<AdminConfig>,
    pub routing: RoutingConfig,
    pub health: HealthConfig,
    pub backends: Vec<BackendConfig>,
    pub models: Vec<ModelConfig>,
    /// `[[adapters]]`: LoRA adapters by name.
    pub adapters: Vec<AdapterConfig>,
    pub keys: Vec<KeyConfig>,
    pub redis_url: Option<String>,
    /// `[[tenants]]`: team limits.
    pub tenants: Vec<TenantConfig>,
    /// `[limits]` beyond the Redis URL.
    pub limits: LimitsConfig,
    /// `[auth] hide_disallowed_models`.
    pub hide_disallowed_models: bool,
    /// `[timeouts]`: the defaults of backends that do not set their own (registered and
    /// discovered members use them too).
    pub backend_timeouts: Timeouts,
    /// `[registration]` and `[[discovery]]`: run-time fleet membership.
    pub membership: MembershipConfig,
    /// `[queue]`: the gateway-side wait queue for saturated backends.
    pub queue: QueueConfig,
    /// `[tls]`: TLS on the client listener.
    pub tls: Option<TlsConfig>,
    /// `[backend_tls]`: trust roots for `https://` backends.
    pub backend_tls: BackendTlsConfig,
    /// `[reload]`: watching the file for changes.
    pub reload: ReloadConfig,
    /// `[[passthrough]]`: the rules for other paths under `/v1/`, longest prefix first.
    pub passthrough: Vec<PassthroughRule>,
    /// The file this came from, for reloads.
    pub source: Option<PathBuf>,
    /// `[trace] path`: where the workload trace is appended (`None`: no trace). Read at
    /// start-up; a reload does not change it.
    pub trace: Option<PathBuf>,
    /// `[batch]`: the Files and Batches APIs (`None`: off). Read at start-up; a reload does
    /// not change it.
    pub batch: Option<BatchConfig>,
    /// `[tracing]` and the `OTEL_*` environment: OpenTelemetry export (`None`: off). Read at
    /// start-up; a reload does not change it.
    pub tracing: Option<crate::telemetry::otel::Settings>,
}

/// `[batch]`, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct BatchConfig {
    /// Where uploaded files and job state live.
    pub dir: PathBuf,
    /// Largest uploaded file in bytes.
    pub max_file_bytes: usize,
    /// Most request lines in one batch.
    pub max_lines: usize,
    /// Batch lines in flight at once, over all batches.
    pub max_in_flight: usize,
    /// How much longer batch lines may make an engine's step for its interactive requests
    /// (a fraction; see `batch::budget`).
    pub max_ttft_rise: f64,
    /// Replicas share `dir` and the batches' work through Redis (`[limits] redis_url`).
    pub shared: bool,
    /// Shared: the lines of one leased chunk.
    pub chunk_lines: usize,
    /// Shared: a chunk lease's lifetime without renewal.
    pub lease: std::time::Duration,
}

/// `[tls]`, checked: the files existed and parsed when the config was validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsConfig {
    pub cert: PathBuf,
    pub key: PathBuf,
    /// Require client certificates signed by this CA bundle (mTLS).
    pub client_ca: Option<PathBuf>,
}

/// `[backend_tls]`, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendTlsConfig {
    pub ca_file: Option<PathBuf>,
    pub system_roots: bool,
}

impl Default for BackendTlsConfig {
    fn default() -> Self {
        BackendTlsConfig {
            ca_file: None,
            system_roots: true,
        }
    }
}

/// One `[[passthrough]]` rule, checked.
#[derive(Debug, Clone)]
pub struct PassthroughRule {
    /// A path under `/v1/` without a trailing slash; it matches itself and what is below it.
    pub prefix: String,
    pub target: PassTarget,
    /// Upper-case HTTP methods.
    pub methods: Vec<http::Method>,
}

impl PassthroughRule {
    /// Whether `path` is the prefix or below it (at a `/`).
    pub fn matches(&self, path: &str) -> bool {
        path.strip_prefix(self.prefix.as_str())
            .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
    }
}

/// Where a pass-through rule sends a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PassTarget {
    /// Routed like any request by the model named in this top-level JSON field of the body.
    ModelField(String),
    /// Sent to these configured backends (a `[[groups]]` entry), by name.
    Group { name: String, backends: Vec<String> },
}

/// `[reload]`, checked.
#[derive(Debug, Clone, Copy)]
pub struct ReloadConfig {
    pub watch: bool,
    pub interval: Duration,
}

#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    /// Threads serving client connections (`crate::server::shards`); `None`: one per core.
    pub threads: Option<usize>,
    pub max_body_bytes: usize,
    pub max_response_bytes: usize,
    pub shutdown_grace: Duration,
    /// Unready-but-serving time between SIGTERM and closing the listener.
    pub shutdown_delay: Duration,
    /// Connection admission, client-side timeouts and protocol bounds of the client listener.
    pub connections: ConnectionLimits,
    /// CORS for the client API: empty = off (no `Access-Control-*` headers at all); `["*"]` =
    /// any origin; otherwise exact origins (`scheme://host[:port]`, lower-case).
    pub cors_allow_origins: Vec<String>,
    /// Peers in these ranges are load balancers or proxies: exempt from the per-address
    /// connection cap, and their requests' client is read from `X-Forwarded-For`.
    pub trusted_proxies: Vec<ipnet::IpNet>,
}

/// The client-facing resource bounds of a listener (`[server]`); see `crate::server`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// Open connections at most.
    pub max_connections: usize,
    /// Open connections per client address (IPv6: per /64); 0 = no per-address cap.
    pub max_connections_per_ip: usize,
    /// Loopback peers (127.0.0.0/8, ::1) are exempt from `max_connections_per_ip`.
    pub per_ip_exempt_loopback: bool,
    /// Longest time to receive a request head (and, HTTP/1, to wait for the next one).
    pub header_read_timeout: Duration,
    /// Longest time to receive a request body after its head.
    pub body_read_timeout: Duration,
    /// A connection with no request in flight is closed after this.
    pub idle_timeout: Duration,
    /// Largest request head (HTTP/1 read buffer, HTTP/2 header list).
    pub max_header_bytes: usize,
    /// Most header fields in an HTTP/1 request.
    pub max_headers: usize,
    pub http2_max_concurrent_streams: u32,
    pub http2_max_pending_accept_reset_streams: usize,
    pub http2_max_local_error_reset_streams: usize,
    /// Requests a client may cancel per connection within [`ConnectionLimits::RESET_WINDOW`].
    pub http2_max_client_resets: u32,
    pub http2_max_send_buf_size: usize,
    pub http2_initial_stream_window_size: u32,
    pub http2_initial_connection_window_size: u32,
}

impl ConnectionLimits {
    /// The window `http2_max_client_resets` is counted over.
    pub const RESET_WINDOW: Duration = Duration::from_secs(10);
    /// The smallest `max_header_bytes` (hyper's smallest HTTP/1 buffer).
    pub const MIN_HEADER_BYTES: usize = 8192;
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits {
            max_connections: 10_000,
            max_connections_per_ip: 1000,
            per_ip_exempt_loopback: true,
            header_read_timeout: Duration::from_secs(30),
            body_read_timeout: Duration::from_secs(60),
            idle_timeout: Duration::from_secs(60),
            max_header_bytes: 64 * 1024,
            max_headers: 100,
            http2_max_concurrent_streams: 256,
            http2_max_pending_accept_reset_streams: 20,
            http2_max_local_error_reset_streams: 1024,
            http2_max_client_resets: 200,
            http2_max_send_buf_size: 256 * 1024,
            http2_initial_stream_window_size: 1024 * 1024,
            http2_initial_connection_window_size: 1024 * 1024,
        }
    }
}

#[derive(Debug, Clone)]
pub struct AdminConfig {
    pub listen: SocketAddr,
    pub token: Option<String>,
    /// Open connections on the admin listener at most.
    pub max_connections: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PolicyKind {
    RoundRobin,
    LeastRequest,
    TokenAware,
    PrefixAffinity,
}

impl FromStr for PolicyKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "round-robin" => PolicyKind::RoundRobin,
            "least-request" => PolicyKind::LeastRequest,
            "token-aware" => PolicyKind::TokenAware,
            "prefix-affinity" => PolicyKind::PrefixAffinity,
            other => {
                return Err(format!(
                "unknown policy `{other}` (expected round-robin, least-request, token-aware or prefix-affinity)"
            ))
            }
        })
    }
}

impl PolicyKind {
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyKind::RoundRobin => "round-robin",
            PolicyKind::LeastRequest => "least-request",
            PolicyKind::TokenAware => "token-aware",
            PolicyKind::PrefixAffinity => "prefix-affinity",
        }
    }
}

#[derive(Debug, Clone)]
pub struct RoutingConfig {
    pub policy: PolicyKind,
    pub max_attempts: u32,
    pub failover_deadline: Duration,
    pub default_max_tokens: u64,
    pub expose_backend_header: bool,
    /// token-aware: with more eligible backends than this, score two random ones
    /// (power of two choices) instead of all.
    pub p2c_above: usize,
    /// Exact prompt counts from a backend's tokenizer for requests estimated at this many
    /// tokens or more (`crate::fleet::tokenize`); 0: never.
    pub tokenize_above: u64,
    pub tokenize_timeout: Duration,
    /// Send a copy elsewhere at a waiting request's hang deadline; keep the first answer.
    pub hedge: bool,
    /// Continue a stream broken after output reached the client on another backend
    /// (`proxy::resume`).
    pub continue_streams: bool,
}

#[derive(Debug, Clone)]
pub struct HealthConfig {
    pub interval: Duration,
    pub timeout: Duration,
    pub healthy_threshold: u32,
    pub unhealthy_threshold: u32,
    pub eject_after_failures: u32,
    pub base_ejection: Duration,
    pub max_ejection: Duration,
    /// After re-admission a backend's share ramps from 10% to 100% over this time (zero: off).
    pub slow_start: Duration,
    /// vLLM: `vllm:num_requests_waiting` at or above this makes a backend `overloaded`
    /// (0: never).
    pub overload_waiting: u64,
    /// How often engine load signals are read (`/metrics`, `/api/ps`); zero: never.
    pub signals_interval: Duration,
    /// Hang deadline of a wait for a response head: `hang_factor` × the expected time to it
    /// plus `hang_grace` (factor 0: no hang deadline).
    pub hang_factor: f64,
    pub hang_grace: Duration,
}

/// Run-time membership: the registration API and DNS discovery.
#[derive(Debug, Clone, PartialEq)]
pub struct MembershipConfig {
    /// TTL of a registration that does not name one.
    pub default_ttl: Duration,
    /// Longest TTL a registration may ask for.
    pub max_ttl: Duration,
    pub discovery: Vec<DiscoveryConfig>,
}

/// One `[[discovery]]` entry: a DNS name whose addresses are backends.
#[derive(Debug, Clone, PartialEq)]
pub struct DiscoveryConfig {
    /// Members are named `<name>@<ip>:<port>`.
    pub name: String,
    pub kind: BackendKind,
    /// `http` or `https`.
    pub scheme: String,
    pub host: String,
    pub port: u16,
    pub models: Vec<String>,
    pub model_names: BTreeMap<String, String>,
    pub api_key: Option<String>,
    pub weight: u32,
    pub max_concurrent: Option<u32>,
    /// Re-resolve this often.
    pub interval: Duration,
}

/// The gateway-side wait queue used when every candidate backend is at its concurrency cap.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QueueConfig {
    /// Requests waiting at most (0: no queue, answer 503 at once).
    pub size: usize,
    /// Longest wait before a 503 with `Retry-After`.
    pub timeout: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BackendKind {
    Vllm,
    Tgi,
    Ollama,
    OpenAi,
}

impl FromStr for BackendKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "vllm" => BackendKind::Vllm,
            "tgi" => BackendKind::Tgi,
            "ollama" => BackendKind::Ollama,
            "openai" => BackendKind::OpenAi,
            other => {
                return Err(format!(
                    "unknown kind `{other}` (expected vllm, tgi, ollama or openai)"
                ))
            }
        })
    }
}

impl BackendKind {
    pub fn as_str(self) -> &'static str {
        match self {
            BackendKind::Vllm => "vllm",
            BackendKind::Tgi => "tgi",
            BackendKind::Ollama => "ollama",
            BackendKind::OpenAi => "openai",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    pub connect: Duration,
    pub first_byte: Duration,
    pub response: Duration,
    pub idle: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            connect: Duration::from_secs(3),
            first_byte: Duration::from_secs(60),
            response: Duration::from_secs(600),
            idle: Duration::from_secs(120),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct BackendConfig {
    pub name: String,
    pub kind: BackendKind,
    /// Scheme and authority, plus a path prefix when the server lives under one.
    pub url: Uri,
    /// Client-facing model names configured for this backend (empty: discover).
    pub models: Vec<String>,
    /// Client model name → backend model name.
    pub model_names: BTreeMap<String, String>,
    pub api_key: Option<String>,
    pub weight: u32,
    pub max_concurrent: Option<u32>,
    pub health_path: Option<String>,
    /// Where its KV-cache events come from (vLLM only).
    pub kv_events: KvEvents,
    /// LoRA adapters kept loaded before the least recently used is unloaded (`None`: the
    /// engine's adapter slots).
    pub max_adapters: Option<u32>,
    /// TGI: the adapters it was started with.
    pub lora_adapters: Vec<String>,
    pub timeouts: Timeouts,
}

/// Where a backend's KV-cache events come from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum KvEvents {
    /// Ask the engine (`GET /kv_event_sources`); nothing when it publishes none.
    #[default]
    Discover,
    /// This publisher endpoint (`tcp://host:port`).
    Endpoint(String),
    Off,
}

#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub name: String,
    pub aliases: Vec<String>,
    pub policy: Option<PolicyKind>,
    /// The model's own tokenizer and chat template (`tokenizer = "<folder>"`), loaded when the
    /// config is validated.
    pub tokenizer: Option<Arc<Tokenizer>>,
}

/// A LoRA adapter (`[[adapters]]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdapterConfig {
    pub name: String,
    /// The canonical name of the model it adapts.
    pub base: String,
    /// Where engines load it from.
    pub path: String,
}

#[derive(Debug, Clone)]
pub struct KeyConfig {
    pub name: String,
    pub tenant: String,
    /// SHA-256 of the key string.
    pub hash: [u8; 32],
    pub models: Vec<String>,
    /// The key's own limits, without the `[limits]` defaults.
    pub limits: LimitSet,
    pub disabled: bool,
    pub expires_at: Option<SystemTime>,
}

/// The limits of one scope (a key or a tenant); `None` = unlimited.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LimitSet {
    pub requests_per_minute: Option<u32>,
    pub tokens_per_minute: Option<u64>,
    pub max_concurrent: Option<u32>,
    /// Token budgets per UTC day / calendar month.
    pub daily_tokens: Option<u64>,
    pub monthly_tokens: Option<u64>,
}

impl LimitSet {
    /// Each field that is unset here taken from `defaults`.
    pub fn or(self, defaults: LimitSet) -> LimitSet {
        LimitSet {
            requests_per_minute: self.requests_per_minute.or(defaults.requests_per_minute),
            tokens_per_minute: self.tokens_per_minute.or(defaults.tokens_per_minute),
            max_concurrent: self.max_concurrent.or(defaults.max_concurrent),
            daily_tokens: self.daily_tokens.or(defaults.daily_tokens),
            monthly_tokens: self.monthly_tokens.or(defaults.monthly_tokens),
        }
    }
}

impl KeyConfig {
    /// The key's own limits (without `[limits]` defaults).
    pub fn limit_set(&self) -> LimitSet {
        self.limits
    }
}

#[derive(Debug, Clone)]
pub struct TenantConfig {
    pub name: String,
    pub limits: LimitSet,
}

#[derive(Debug, Clone)]
pub struct LimitsConfig {
    /// Refuse (false) or enforce locally (true) when Redis is unreachable.
    pub fail_open: bool,
    /// The period of the `*_per_minute` limits.
    pub window: Duration,
    /// Per-key defaults.
    pub defaults: LimitSet,
    /// Shared mode: the lifetime of an unrenewed concurrency slot in Redis.
    pub concurrency_lease: Duration,
}

impl Config {
    /// A config with defaults and no backends: the base for tests and `sluice demo`.
    pub fn empty() -> Config {
        super::validate::validate(FileConfig::default(), &super::env::ProcessEnv)
            .unwrap_or_else(|_| unreachable!("the default config is valid"))
    }

    /// The tokenizer of the model named `canonical`, when its `[[models]]` entry has one.
    pub fn tokenizer(&self, canonical: &str) -> Option<&Arc<Tokenizer>> {
        self.models
            .iter()
            .find(|m| m.name == canonical)?
            .tokenizer
            .as_ref()
    }

    /// Alias or canonical name → canonical name, for every `[[models]]` entry.
    pub fn alias_map(&self) -> HashMap<String, String> {
        let mut map = HashMap::new();
        for m in &self.models {
            map.insert(m.name.clone(), m.name.clone());
            for a in &m.aliases {
                map.insert(a.clone(), m.name.clone());
            }
        }
        map
    }
}
