//! Validation of a [`FileConfig`] into the runtime [`Config`]: defaults applied, `${ENV}`
//! expanded, addresses and URLs parsed, cross-references checked. Every problem is collected with
//! its location (`backends[2].url: …`) so one run of `sluice check` shows them all.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::{Duration, SystemTime};

use http::Uri;

use super::env::{expand, Env};
use super::file::{FileConfig, TimeoutsSection};

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
    /// The file this came from, for reloads.
    pub source: Option<PathBuf>,
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
}

/// The client-facing resource bounds of a listener (`[server]`); see `crate::server`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// Open connections at most.
    pub max_connections: usize,
    /// Open connections per client address (IPv6: per /64); 0 = no per-address cap.
    pub max_connections_per_ip: usize,
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
    pub timeouts: Timeouts,
}

#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub name: String,
    pub aliases: Vec<String>,
    pub policy: Option<PolicyKind>,
}

#[derive(Debug, Clone)]
pub struct KeyConfig {
    pub name: String,
    pub tenant: String,
    /// SHA-256 of the key string.
    pub hash: [u8; 32],
    pub models: Vec<String>,
    pub requests_per_minute: Option<u32>,
    pub tokens_per_minute: Option<u64>,
    pub max_concurrent: Option<u32>,
    pub disabled: bool,
    pub expires_at: Option<SystemTime>,
    /// Token budgets per UTC day / calendar month.
    pub daily_tokens: Option<u64>,
    pub monthly_tokens: Option<u64>,
}

/// The limits of one scope (a key or a tenant); `None` = unlimited.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LimitSet {
    pub requests_per_minute: Option<u32>,
    pub tokens_per_minute: Option<u64>,
    pub max_concurrent: Option<u32>,
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
        LimitSet {
            requests_per_minute: self.requests_per_minute,
            tokens_per_minute: self.tokens_per_minute,
            max_concurrent: self.max_concurrent,
            daily_tokens: self.daily_tokens,
            monthly_tokens: self.monthly_tokens,
        }
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
        validate(FileConfig::default(), &super::env::ProcessEnv)
            .unwrap_or_else(|_| unreachable!("the default config is valid"))
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

struct Problems(Vec<String>);

impl Problems {
    fn push(&mut self, at: impl std::fmt::Display, what: impl std::fmt::Display) {
        self.0.push(format!("{at}: {what}"));
    }
}

fn duration(p: &mut Problems, at: &str, v: &Option<String>, default: Duration) -> Duration {
    match v {
        None => default,
        Some(s) => match humantime::parse_duration(s) {
            Ok(d) if !d.is_zero() => d,
            Ok(_) => {
                p.push(at, "must be greater than zero");
                default
            }
            Err(e) => {
                p.push(
                    at,
                    format!("`{s}` is not a duration like \"500ms\" or \"30s\" ({e})"),
                );
                default
            }
        },
    }
}

fn addr(p: &mut Problems, at: &str, v: &str, env: &dyn Env) -> Option<SocketAddr> {
    let v = match expand(v, env) {
        Ok(v) => v,
        Err(e) => {
            p.push(at, e);
            return None;
        }
    };
    match v.parse::<SocketAddr>() {
        Ok(a) => Some(a),
        Err(_) => {
            p.push(
                at,
                format!("`{v}` is not an address like \"127.0.0.1:8080\""),
            );
            None
        }
    }
}

fn secret(p: &mut Problems, at: &str, v: &Option<String>, env: &dyn Env) -> Option<String> {
    let v = v.as_ref()?;
    match expand(v, env) {
        Ok(s) if s.is_empty() => {
            p.push(at, "is empty");
            None
        }
        Ok(s) => Some(s),
        Err(e) => {
            p.push(at, e);
            None
        }
    }
}

fn timeouts(p: &mut Problems, at: &str, t: &TimeoutsSection, base: Timeouts) -> Timeouts {
    Timeouts {
        connect: duration(p, &format!("{at}.connect"), &t.connect, base.connect),
        first_byte: duration(
            p,
            &format!("{at}.first_byte"),
            &t.first_byte,
            base.first_byte,
        ),
        response: duration(p, &format!("{at}.response"), &t.response, base.response),
        idle: duration(p, &format!("{at}.idle"), &t.idle, base.idle),
    }
}

/// Parse a backend base URL: http or https, with a host; a trailing `/` is dropped.
pub fn parse_backend_url(s: &str) -> Result<Uri, String> {
    let uri: Uri = s.parse().map_err(|e| format!("`{s}` is not a URL ({e})"))?;
    match uri.scheme_str() {
        Some("http") | Some("https") => {}
        _ => return Err(format!("`{s}` must start with http:// or https://")),
    }
    if uri.authority().is_none() {
        return Err(format!("`{s}` has no host"));
    }
    if uri.query().is_some() {
        return Err(format!("`{s}` must not have a query string"));
    }
    let trimmed = s.trim_end_matches('/');
    trimmed
        .parse()
        .map_err(|e| format!("`{s}` is not a URL ({e})"))
}

fn zero_budgets(p: &mut Problems, at: &str, daily: Option<u64>, monthly: Option<u64>) {
    if daily == Some(0) {
        p.push(
            format!("{at}.daily_tokens"),
            "must be at least 1 (or absent)",
        );
    }
    if monthly == Some(0) {
        p.push(
            format!("{at}.monthly_tokens"),
            "must be at least 1 (or absent)",
        );
    }
}

fn zero_limits(p: &mut Problems, at: &str, l: LimitSet) {
    if l.requests_per_minute == Some(0) {
        p.push(
            format!("{at}.requests_per_minute"),
            "must be at least 1 (or absent)",
        );
    }
    if l.tokens_per_minute == Some(0) {
        p.push(
            format!("{at}.tokens_per_minute"),
            "must be at least 1 (or absent)",
        );
    }
    if l.max_concurrent == Some(0) {
        p.push(
            format!("{at}.max_concurrent"),
            "must be at least 1 (or absent)",
        );
    }
    zero_budgets(p, at, l.daily_tokens, l.monthly_tokens);
}

/// Parse `sha256:<64 hex digits>`.
pub fn parse_key_hash(s: &str) -> Result<[u8; 32], String> {
    let hex_part = s.strip_prefix("sha256:").ok_or_else(|| {
        "must look like sha256:<64 hex digits> (from `sluice key new`)".to_string()
    })?;
    let bytes =
        hex::decode(hex_part).map_err(|_| "the part after sha256: is not hex".to_string())?;
    bytes
        .try_into()
        .map_err(|_| "a SHA-256 hash has 64 hex digits".to_string())
}

/// `[tls]`, `[backend_tls]` and `[reload]`: paths expanded, PEM files read and parsed now, so
/// a bad certificate is a config error (at start, in `sluice check` and on reload).
fn tls_and_reload(
    p: &mut Problems,
    f: &FileConfig,
    env: &dyn Env,
) -> (Option<TlsConfig>, BackendTlsConfig, ReloadConfig) {
    let mut path = |at: &str, v: &str| match expand(v, env) {
        Ok(s) if s.trim().is_empty() => {
            p.push(at, "is empty");
            None
        }
        Ok(s) => Some(PathBuf::from(s)),
        Err(e) => {
            p.push(at, e);
            None
        }
    };
    let tls = f.tls.as_ref().and_then(|t| {
        let cert = path("tls.cert", &t.cert);
        let key = path("tls.key", &t.key);
        let client_ca = t.client_ca.as_deref().map(|c| path("tls.client_ca", c));
        let client_ca = match client_ca {
            Some(None) => return None,
            Some(Some(c)) => Some(c),
            None => None,
        };
        Some(TlsConfig {
            cert: cert?,
            key: key?,
            client_ca,
        })
    });
    let backend_ca = f
        .backend_tls
        .ca_file
        .as_deref()
        .and_then(|c| path("backend_tls.ca_file", c));
    if let Some(t) = &tls {
        if let Err(e) = crate::tls::check_server_files(crate::tls::ServerFiles {
            cert: &t.cert,
            key: &t.key,
            client_ca: t.client_ca.as_deref(),
        }) {
            p.push("tls", e);
        }
    }
    if let Some(c) = &backend_ca {
        if let Err(e) = crate::tls::load_ca(c) {
            p.push("backend_tls.ca_file", e);
        }
    }
    let backend_tls = BackendTlsConfig {
        ca_file: backend_ca,
        system_roots: f.backend_tls.system_roots.unwrap_or(true),
    };
    let reload = ReloadConfig {
        watch: f.reload.watch.unwrap_or(true),
        interval: duration(
            p,
            "reload.interval",
            &f.reload.interval,
            Duration::from_secs(1),
        ),
    };
    (tls, backend_tls, reload)
}

/// `server.cors_allow_origins`: "*" alone, or origins `http(s)://host[:port]` without a path.
fn cors_origins(p: &mut Problems, list: Option<&[String]>) -> Vec<String> {
    let Some(list) = list else {
        return Vec::new();
    };
    if list.iter().any(|o| o == "*") {
        if list.len() > 1 {
            p.push(
                "server.cors_allow_origins",
                "\"*\" allows every origin and must be the only entry",
            );
        }
        return vec!["*".to_string()];
    }
    let mut out = Vec::with_capacity(list.len());
    for (i, o) in list.iter().enumerate() {
        let rest = o
            .strip_prefix("https://")
            .or_else(|| o.strip_prefix("http://"));
        let ok = rest.is_some_and(|host| {
            !host.is_empty()
                && host
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-.:[]".contains(&b))
        });
        if ok {
            out.push(o.to_ascii_lowercase());
        } else {
            p.push(
                format!("server.cors_allow_origins[{i}]"),
                format!("`{o}` is not an origin like \"https://app.example.com\" (scheme, host, optional port; no path) or \"*\""),
            );
        }
    }
    out
}

/// Validate a parsed file.
pub fn validate(f: FileConfig, env: &dyn Env) -> Result<Config, Vec<String>> {
    let mut p = Problems(Vec::new());

    let listen = f.server.listen.as_deref().unwrap_or("127.0.0.1:8080");
    let listen = addr(&mut p, "server.listen", listen, env)
        .unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 8080)));
    let max_body_bytes = match f.server.max_body_bytes {
        None => DEFAULT_MAX_BODY_BYTES,
        Some(0) => {
            p.push("server.max_body_bytes", "must be greater than zero");
            DEFAULT_MAX_BODY_BYTES
        }
        Some(n) => usize::try_from(n).unwrap_or(usize::MAX),
    };
    let max_response_bytes = match f.server.max_response_bytes {
        None => DEFAULT_MAX_RESPONSE_BYTES,
        Some(0) => {
            p.push("server.max_response_bytes", "must be greater than zero");
            DEFAULT_MAX_RESPONSE_BYTES
        }
        Some(n) => usize::try_from(n).unwrap_or(usize::MAX),
    };
    let threads = f
        .server
        .threads
        .map(|n| bounded(&mut p, "server.threads", n, 1, MAX_SERVER_THREADS));
    let server = ServerConfig {
        listen,
        threads,
        max_body_bytes,
        max_response_bytes,
        shutdown_grace: duration(
            &mut p,
            "server.shutdown_grace",
            &f.server.shutdown_grace,
            Duration::from_secs(30),
        ),
        shutdown_delay: zero_ok_duration(
            &mut p,
            "server.shutdown_delay",
            &f.server.shutdown_delay,
            Duration::ZERO,
        ),
        connections: connection_limits(&mut p, &f.server),
        cors_allow_origins: cors_origins(&mut p, f.server.cors_allow_origins.as_deref()),
    };

    let admin = f.admin.as_ref().and_then(|a| {
        let listen = addr(
            &mut p,
            "admin.listen",
            a.listen.as_deref().unwrap_or("127.0.0.1:9090"),
            env,
        )?;
        let token = secret(&mut p, "admin.token", &a.token, env);
        if token.is_none() && !listen.ip().is_loopback() {
            p.push(
                "admin.token",
                "is required when admin.listen is not a loopback address",
            );
        }
        let max_connections = match a.max_connections {
            None => 256,
            Some(n) => bounded(&mut p, "admin.max_connections", n, 1, 1 << 20),
        };
        Some(AdminConfig {
            listen,
            token,
            max_connections,
        })
    });

    let policy = match f.routing.policy.as_deref() {
        None => PolicyKind::TokenAware,
        Some(s) => PolicyKind::from_str(s).unwrap_or_else(|e| {
            p.push("routing.policy", e);
            PolicyKind::TokenAware
        }),
    };
    let max_attempts = match f.routing.max_attempts {
        None => 3,
        Some(0) => {
            p.push("routing.max_attempts", "must be at least 1");
            3
        }
        Some(n) => n.min(16),
    };
    let routing = RoutingConfig {
        policy,
        max_attempts,
        failover_deadline: duration(
            &mut p,
            "routing.failover_deadline",
            &f.routing.failover_deadline,
            Duration::from_secs(15),
        ),
        default_max_tokens: f.routing.default_max_tokens.unwrap_or(256),
        expose_backend_header: f.routing.expose_backend_header.unwrap_or(false),
        p2c_above: f.routing.p2c_above.unwrap_or(16),
        tokenize_above: f.routing.tokenize_above.unwrap_or(0),
        tokenize_timeout: duration(
            &mut p,
            "routing.tokenize_timeout",
            &f.routing.tokenize_timeout,
            Duration::from_millis(250),
        ),
    };

    let h = &f.health;
    let health = HealthConfig {
        interval: duration(
            &mut p,
            "health.interval",
            &h.interval,
            Duration::from_millis(1000),
        ),
        timeout: duration(
            &mut p,
            "health.timeout",
            &h.timeout,
            Duration::from_millis(800),
        ),
        healthy_threshold: h.healthy_threshold.unwrap_or(2).max(1),
        unhealthy_threshold: h.unhealthy_threshold.unwrap_or(2).max(1),
        eject_after_failures: h.eject_after_failures.unwrap_or(3).max(1),
        base_ejection: duration(
            &mut p,
            "health.base_ejection",
            &h.base_ejection,
            Duration::from_secs(2),
        ),
        max_ejection: duration(
            &mut p,
            "health.max_ejection",
            &h.max_ejection,
            Duration::from_secs(60),
        ),
        slow_start: zero_ok_duration(
            &mut p,
            "health.slow_start",
            &h.slow_start,
            Duration::from_secs(5),
        ),
        overload_waiting: h.overload_waiting.unwrap_or(0),
        signals_interval: Duration::ZERO,
    };
    let health = HealthConfig {
        signals_interval: zero_ok_duration(
            &mut p,
            "health.signals_interval",
            &h.signals_interval,
            health.interval,
        ),
        ..health
    };

    let base_timeouts = timeouts(&mut p, "timeouts", &f.timeouts, Timeouts::default());

    let mut models = Vec::new();
    let mut model_names: HashMap<String, String> = HashMap::new();
    for (i, m) in f.models.iter().enumerate() {
        let at = format!("models[{i}]");
        if m.name.trim().is_empty() {
            p.push(format!("{at}.name"), "is empty");
        }
        for n in std::iter::once(&m.name).chain(m.aliases.iter()) {
            if let Some(prev) = model_names.insert(n.clone(), at.clone()) {
                p.push(&at, format!("name `{n}` is already used by {prev}"));
            }
        }
        let policy = m.policy.as_deref().and_then(|s| {
            PolicyKind::from_str(s)
                .map_err(|e| p.push(format!("{at}.policy"), e))
                .ok()
        });
        models.push(ModelConfig {
            name: m.name.clone(),
            aliases: m.aliases.clone(),
            policy,
        });
    }

    let mut backends = Vec::new();
    let mut backend_names = HashSet::new();
    for (i, b) in f.backends.iter().enumerate() {
        let at = format!("backends[{i}]");
        if b.name.trim().is_empty() {
            p.push(format!("{at}.name"), "is empty");
        } else if !backend_names.insert(b.name.clone()) {
            p.push(
                format!("{at}.name"),
                format!("`{}` is used by another backend", b.name),
            );
        }
        let kind = BackendKind::from_str(&b.kind).unwrap_or_else(|e| {
            p.push(format!("{at}.kind"), e);
            BackendKind::OpenAi
        });
        let url = match expand(&b.url, env).and_then(|u| parse_backend_url(&u)) {
            Ok(u) => u,
            Err(e) => {
                p.push(format!("{at}.url"), e);
                Uri::from_static("http://127.0.0.1")
            }
        };
        for client in b.model_names.keys() {
            if !b.models.is_empty() && !b.models.contains(client) {
                p.push(
                    format!("{at}.model_names"),
                    format!("`{client}` is not in this backend's models"),
                );
            }
        }
        let weight = match b.weight {
            None => 1,
            Some(0) => {
                p.push(format!("{at}.weight"), "must be at least 1");
                1
            }
            Some(w) => w,
        };
        if b.max_concurrent == Some(0) {
            p.push(format!("{at}.max_concurrent"), "must be at least 1");
        }
        if let Some(path) = &b.health_path {
            if !path.starts_with('/') {
                p.push(format!("{at}.health_path"), "must start with /");
            }
        }
        backends.push(BackendConfig {
            name: b.name.clone(),
            kind,
            url,
            models: b.models.clone(),
            model_names: b.model_names.clone(),
            api_key: secret(&mut p, &format!("{at}.api_key"), &b.api_key, env),
            weight,
            max_concurrent: b.max_concurrent,
            health_path: b.health_path.clone(),
            timeouts: timeouts(
                &mut p,
                &format!("{at}.timeouts"),
                &b.timeouts,
                base_timeouts,
            ),
        });
    }

    let mut keys = Vec::new();
    let mut key_names = HashSet::new();
    let mut hashes = HashSet::new();
    for (i, k) in f.keys.iter().enumerate() {
        let at = format!("keys[{i}]");
        if !key_names.insert(k.name.clone()) {
            p.push(
                format!("{at}.name"),
                format!("`{}` is used by another key", k.name),
            );
        }
        let hash = match parse_key_hash(&k.hash) {
            Ok(h) => {
                if !hashes.insert(h) {
                    p.push(format!("{at}.hash"), "the same key is configured twice");
                }
                h
            }
            Err(e) => {
                p.push(format!("{at}.hash"), e);
                [0; 32]
            }
        };
        let expires_at = k.expires_at.as_ref().and_then(|s| {
            humantime::parse_rfc3339_weak(s)
                .map_err(|e| p.push(format!("{at}.expires_at"), format!("`{s}`: {e}")))
                .ok()
        });
        if k.requests_per_minute == Some(0) {
            p.push(
                format!("{at}.requests_per_minute"),
                "must be at least 1 (or absent)",
            );
        }
        if k.tokens_per_minute == Some(0) {
            p.push(
                format!("{at}.tokens_per_minute"),
                "must be at least 1 (or absent)",
            );
        }
        if k.max_concurrent == Some(0) {
            p.push(
                format!("{at}.max_concurrent"),
                "must be at least 1 (or absent)",
            );
        }
        zero_budgets(&mut p, &at, k.daily_tokens, k.monthly_tokens);
        keys.push(KeyConfig {
            name: k.name.clone(),
            tenant: k.tenant.clone().unwrap_or_else(|| k.name.clone()),
            hash,
            models: k.models.clone(),
            requests_per_minute: k.requests_per_minute,
            tokens_per_minute: k.tokens_per_minute,
            max_concurrent: k.max_concurrent,
            disabled: k.disabled,
            expires_at,
            daily_tokens: k.daily_tokens,
            monthly_tokens: k.monthly_tokens,
        });
    }

    let mut tenants = Vec::new();
    let mut tenant_names = HashSet::new();
    for (i, t) in f.tenants.iter().enumerate() {
        let at = format!("tenants[{i}]");
        if t.name.trim().is_empty() {
            p.push(format!("{at}.name"), "is empty");
        } else if !tenant_names.insert(t.name.clone()) {
            p.push(
                format!("{at}.name"),
                format!("`{}` is used by another tenant", t.name),
            );
        }
        let limits = LimitSet {
            requests_per_minute: t.requests_per_minute,
            tokens_per_minute: t.tokens_per_minute,
            max_concurrent: t.max_concurrent,
            daily_tokens: t.daily_tokens,
            monthly_tokens: t.monthly_tokens,
        };
        zero_limits(&mut p, &at, limits);
        tenants.push(TenantConfig {
            name: t.name.clone(),
            limits,
        });
    }
    let l = &f.limits;
    let defaults = LimitSet {
        requests_per_minute: l.requests_per_minute,
        tokens_per_minute: l.tokens_per_minute,
        max_concurrent: l.max_concurrent,
        daily_tokens: l.daily_tokens,
        monthly_tokens: l.monthly_tokens,
    };
    zero_limits(&mut p, "limits", defaults);
    let limits = LimitsConfig {
        fail_open: l.fail_open.unwrap_or(true),
        window: duration(&mut p, "limits.window", &l.window, Duration::from_secs(60)),
        defaults,
        concurrency_lease: duration(
            &mut p,
            "limits.concurrency_lease",
            &l.concurrency_lease,
            Duration::from_secs(5 * 60),
        ),
    };
    if limits.concurrency_lease < Duration::from_secs(1) {
        p.push("limits.concurrency_lease", "must be at least 1s");
    }
    let hide_disallowed_models = f.auth.hide_disallowed_models.unwrap_or(false);

    let redis_url = secret(&mut p, "limits.redis_url", &f.limits.redis_url, env);
    if let Some(u) = &redis_url {
        if !(u.starts_with("redis://")
            || u.starts_with("redis+unix://")
            || u.starts_with("unix://"))
        {
            p.push(
                "limits.redis_url",
                "must start with redis:// (or unix:// for a socket)",
            );
        }
    }
    let (membership, queue) = membership_and_queue(&mut p, &f, env);
    let (tls, backend_tls, reload) = tls_and_reload(&mut p, &f, env);

    if p.0.is_empty() {
        Ok(Config {
            server,
            admin,
            routing,
            health,
            backends,
            models,
            keys,
            redis_url,
            tenants,
            limits,
            hide_disallowed_models,
            backend_timeouts: base_timeouts,
            membership,
            queue,
            tls,
            backend_tls,
            reload,
            source: None,
        })
    } else {
        Err(p.0)
    }
}

/// A duration where `"0s"` means "off".
fn zero_ok_duration(p: &mut Problems, at: &str, v: &Option<String>, default: Duration) -> Duration {
    match v.as_deref().map(str::trim) {
        Some("0") | Some("0s") | Some("0ms") => Duration::ZERO,
        _ => duration(p, at, v, default),
    }
}

/// `n` when it lies in `min..=max`, else a problem at `at` (and `min`).
fn bounded(p: &mut Problems, at: &str, n: u64, min: u64, max: u64) -> usize {
    if (min..=max).contains(&n) {
        usize::try_from(n).unwrap_or(usize::MAX)
    } else {
        p.push(at, format!("must be between {min} and {max}"));
        usize::try_from(min).unwrap_or(usize::MAX)
    }
}

/// `[server]`'s connection admission, client-side timeouts and protocol bounds.
fn connection_limits(p: &mut Problems, s: &super::file::ServerSection) -> ConnectionLimits {
    let d = ConnectionLimits::default();
    let num = |p: &mut Problems, at: &str, v: Option<u64>, def: usize, min: u64, max: u64| match v {
        None => def,
        Some(n) => bounded(p, at, n, min, max),
    };
    // HTTP/2 window sizes: RFC 9113 caps them at 2^31-1; below 64 KiB streams crawl.
    let window = |p: &mut Problems, at: &str, v: Option<u64>, def: u32| {
        u32::try_from(num(p, at, v, def as usize, 65_535, (1 << 31) - 1)).unwrap_or(def)
    };
    ConnectionLimits {
        max_connections: num(
            p,
            "server.max_connections",
            s.max_connections,
            d.max_connections,
            1,
            1 << 24,
        ),
        max_connections_per_ip: num(
            p,
            "server.max_connections_per_ip",
            s.max_connections_per_ip,
            d.max_connections_per_ip,
            0,
            1 << 24,
        ),
        header_read_timeout: duration(
            p,
            "server.header_read_timeout",
            &s.header_read_timeout,
            d.header_read_timeout,
        ),
        body_read_timeout: duration(
            p,
            "server.body_read_timeout",
            &s.body_read_timeout,
            d.body_read_timeout,
        ),
        idle_timeout: duration(p, "server.idle_timeout", &s.idle_timeout, d.idle_timeout),
        max_header_bytes: num(
            p,
            "server.max_header_bytes",
            s.max_header_bytes,
            d.max_header_bytes,
            ConnectionLimits::MIN_HEADER_BYTES as u64,
            16 << 20,
        ),
        max_headers: num(
            p,
            "server.max_headers",
            s.max_headers,
            d.max_headers,
            1,
            10_000,
        ),
        http2_max_concurrent_streams: u32::try_from(num(
            p,
            "server.http2_max_concurrent_streams",
            s.http2_max_concurrent_streams,
            d.http2_max_concurrent_streams as usize,
            1,
            1 << 20,
        ))
        .unwrap_or(d.http2_max_concurrent_streams),
        http2_max_pending_accept_reset_streams: num(
            p,
            "server.http2_max_pending_accept_reset_streams",
            s.http2_max_pending_accept_reset_streams,
            d.http2_max_pending_accept_reset_streams,
            1,
            1 << 20,
        ),
        http2_max_local_error_reset_streams: num(
            p,
            "server.http2_max_local_error_reset_streams",
            s.http2_max_local_error_reset_streams,
            d.http2_max_local_error_reset_streams,
            1,
            1 << 20,
        ),
        http2_max_client_resets: u32::try_from(num(
            p,
            "server.http2_max_client_resets",
            s.http2_max_client_resets,
            d.http2_max_client_resets as usize,
            1,
            1 << 20,
        ))
        .unwrap_or(d.http2_max_client_resets),
        http2_max_send_buf_size: num(
            p,
            "server.http2_max_send_buf_size",
            s.http2_max_send_buf_size,
            d.http2_max_send_buf_size,
            16 * 1024,
            64 << 20,
        ),
        http2_initial_stream_window_size: window(
            p,
            "server.http2_initial_stream_window_size",
            s.http2_initial_stream_window_size,
            d.http2_initial_stream_window_size,
        ),
        http2_initial_connection_window_size: window(
            p,
            "server.http2_initial_connection_window_size",
            s.http2_initial_connection_window_size,
            d.http2_initial_connection_window_size,
        ),
    }
}

/// `[registration]`, `[[discovery]]` and `[queue]`.
fn membership_and_queue(
    p: &mut Problems,
    f: &FileConfig,
    env: &dyn Env,
) -> (MembershipConfig, QueueConfig) {
    let r = &f.registration;
    let default_ttl = duration(p, "registration.ttl", &r.ttl, Duration::from_secs(30));
    let max_ttl = duration(
        p,
        "registration.max_ttl",
        &r.max_ttl,
        Duration::from_secs(3600),
    );
    let mut discovery = Vec::new();
    let mut names = HashSet::new();
    for (i, d) in f.discovery.iter().enumerate() {
        let at = format!("discovery[{i}]");
        if d.name.trim().is_empty() || d.name.contains('@') {
            p.push(format!("{at}.name"), "must be non-empty and without `@`");
        } else if !names.insert(d.name.clone()) || f.backends.iter().any(|b| b.name == d.name) {
            p.push(format!("{at}.name"), format!("`{}` is used twice", d.name));
        }
        let kind = BackendKind::from_str(&d.kind).unwrap_or_else(|e| {
            p.push(format!("{at}.kind"), e);
            BackendKind::OpenAi
        });
        let scheme = d.scheme.clone().unwrap_or_else(|| "http".into());
        if scheme != "http" && scheme != "https" {
            p.push(format!("{at}.scheme"), "must be http or https");
        }
        if d.host.trim().is_empty() {
            p.push(format!("{at}.host"), "is empty");
        }
        if d.port == 0 {
            p.push(format!("{at}.port"), "must be 1..65535");
        }
        if d.weight == Some(0) {
            p.push(format!("{at}.weight"), "must be at least 1");
        }
        if d.max_concurrent == Some(0) {
            p.push(format!("{at}.max_concurrent"), "must be at least 1");
        }
        discovery.push(DiscoveryConfig {
            name: d.name.clone(),
            kind,
            scheme,
            host: d.host.clone(),
            port: d.port,
            models: d.models.clone(),
            model_names: d.model_names.clone(),
            api_key: secret(p, &format!("{at}.api_key"), &d.api_key, env),
            weight: d.weight.unwrap_or(1).max(1),
            max_concurrent: d.max_concurrent,
            interval: duration(
                p,
                &format!("{at}.interval"),
                &d.interval,
                Duration::from_secs(5),
            ),
        });
    }
    let q = &f.queue;
    let queue = QueueConfig {
        size: q
            .size
            .map_or(1024, |n| usize::try_from(n).unwrap_or(usize::MAX)),
        timeout: duration(p, "queue.timeout", &q.timeout, Duration::from_secs(5)),
    };
    (
        MembershipConfig {
            default_ttl,
            max_ttl,
            discovery,
        },
        queue,
    )
}

#[cfg(test)]
mod tests {
    use super::super::from_str;
    use super::*;

    #[test]
    fn defaults() {
        let c = from_str("", "t").unwrap();
        assert_eq!(c.server.listen.port(), 8080);
        assert_eq!(c.server.max_body_bytes, DEFAULT_MAX_BODY_BYTES);
        assert_eq!(c.routing.policy, PolicyKind::TokenAware);
        assert_eq!(c.routing.max_attempts, 3);
        assert!(c.backends.is_empty() && c.keys.is_empty());
    }

    #[test]
    fn all_problems_listed_with_locations() {
        let text = r#"
[routing]
policy = "random"
[[backends]]
name = "a"
kind = "llamafile"
url = "ftp://x"
[[backends]]
name = "a"
kind = "vllm"
url = "http://127.0.0.1:1"
timeouts = { connect = "soon" }
[[keys]]
name = "k"
hash = "md5:abc"
"#;
        let err = from_str(text, "f.toml").unwrap_err().problems();
        let joined = err.join("\n");
        for needle in [
            "routing.policy",
            "backends[0].kind",
            "backends[0].url",
            "backends[1].name",
            "backends[1].timeouts.connect",
            "keys[0].hash",
        ] {
            assert!(joined.contains(needle), "missing {needle} in:\n{joined}");
        }
        assert_eq!(err.len(), 6, "{joined}");
    }

    #[test]
    fn connection_limits_defaults_and_bounds() {
        let c = from_str("", "t").unwrap();
        assert_eq!(c.server.connections, ConnectionLimits::default());
        let text = "[server]\nmax_connections = 0\nmax_header_bytes = 100\nidle_timeout = \"0s\"\nhttp2_initial_stream_window_size = 1\n[admin]\nmax_connections = 0\n";
        let joined = from_str(text, "t").unwrap_err().problems().join("\n");
        for needle in [
            "server.max_connections: must be between 1",
            "server.max_header_bytes: must be between 8192",
            "server.idle_timeout: must be greater than zero",
            "server.http2_initial_stream_window_size: must be between 65535",
            "admin.max_connections: must be between 1",
        ] {
            assert!(joined.contains(needle), "missing {needle} in:\n{joined}");
        }
        let ok = from_str(
            "[server]\nmax_connections_per_ip = 0\nbody_read_timeout = \"2s\"\n",
            "t",
        )
        .unwrap();
        assert_eq!(ok.server.connections.max_connections_per_ip, 0);
        assert_eq!(
            ok.server.connections.body_read_timeout,
            Duration::from_secs(2)
        );
    }

    #[test]
    fn admin_off_loopback_needs_token() {
        let err = from_str("[admin]\nlisten = \"0.0.0.0:9090\"\n", "t").unwrap_err();
        assert!(err.to_string().contains("admin.token"));
        assert!(from_str("[admin]\nlisten = \"127.0.0.1:9090\"\n", "t").is_ok());
    }

    #[test]
    fn backend_url_forms() {
        assert_eq!(
            parse_backend_url("http://h:1/").unwrap().to_string(),
            "http://h:1/"
        );
        assert_eq!(parse_backend_url("https://h/v1/").unwrap().path(), "/v1");
        assert!(parse_backend_url("h:1").is_err());
        assert!(parse_backend_url("http://h?x=1").is_err());
    }

    #[test]
    fn key_hash() {
        let h = format!("sha256:{}", "ab".repeat(32));
        assert_eq!(parse_key_hash(&h).unwrap(), [0xab; 32]);
        assert!(parse_key_hash("sha256:abcd").is_err());
    }
}
