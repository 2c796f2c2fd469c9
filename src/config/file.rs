//! The config file as written: serde types with `deny_unknown_fields`, so a typo is an error
//! with a line number instead of a silently ignored setting. Defaults live in [`super::validate`].

use std::collections::BTreeMap;

use serde::Deserialize;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    #[serde(default)]
    pub server: ServerSection,
    pub admin: Option<AdminSection>,
    #[serde(default)]
    pub routing: RoutingSection,
    #[serde(default)]
    pub timeouts: TimeoutsSection,
    #[serde(default)]
    pub health: HealthSection,
    #[serde(default)]
    pub backends: Vec<BackendSection>,
    #[serde(default)]
    pub models: Vec<ModelSection>,
    /// LoRA adapters: each served on the engines of its base model, loaded where missing.
    #[serde(default)]
    pub adapters: Vec<AdapterSection>,
    #[serde(default)]
    pub keys: Vec<KeySection>,
    #[serde(default)]
    pub limits: LimitsSection,
    /// Team limits shared by every key of a tenant.
    #[serde(default)]
    pub tenants: Vec<TenantSection>,
    #[serde(default)]
    pub auth: AuthSection,
    /// Run-time registration of backends (`POST /admin/backends`).
    #[serde(default)]
    pub registration: RegistrationSection,
    /// DNS names whose addresses are backends, re-resolved periodically.
    #[serde(default)]
    pub discovery: Vec<DiscoverySection>,
    /// The wait queue used when every candidate backend is at its concurrency cap.
    #[serde(default)]
    pub queue: QueueSection,
    /// TLS on the client listener (`server.listen`): certificate, key, optional client CA (mTLS).
    pub tls: Option<TlsSection>,
    /// TLS towards `https://` backends: extra trust roots.
    #[serde(default)]
    pub backend_tls: BackendTlsSection,
    /// Live reload of this file when it changes on disk.
    #[serde(default)]
    pub reload: ReloadSection,
    /// A privacy-safe workload trace for `sluice plan` (off unless present).
    pub trace: Option<TraceSection>,
    /// The Files and Batches APIs (off unless present).
    pub batch: Option<BatchSection>,
    /// OpenTelemetry traces (off unless an OTLP endpoint is set here or in the environment).
    #[serde(default)]
    pub tracing: TracingSection,
    /// Pass-through rules: other paths under `/v1/` forwarded as they are.
    #[serde(default)]
    pub passthrough: Vec<PassthroughSection>,
    /// Named groups of `[[backends]]` a pass-through rule can send to.
    #[serde(default)]
    pub groups: Vec<GroupSection>,
}

/// `[trace]`: append one JSON line per answered request (arrival time, model, API, token
/// counts, shared-prefix fingerprint; never text) to `path`, written off the request path.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TraceSection {
    pub path: String,
}

/// `[batch]`: the OpenAI Files and Batches APIs, with uploaded files and job state kept in
/// `dir`, and batch lines run on the fleet's idle capacity.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BatchSection {
    /// The folder of uploaded files and job state (created when missing).
    pub dir: String,
    /// Largest uploaded file in bytes (default 100 MiB); a larger upload gets 413.
    pub max_file_bytes: Option<u64>,
    /// Most request lines in one batch's input file (default 50000).
    pub max_lines: Option<u64>,
    /// Batch lines in flight at once over all batches (default 4).
    pub max_in_flight: Option<u64>,
    /// How much longer batch lines may make an engine's step for the interactive requests it
    /// runs, as a fraction, by the engine's own fitted step costs (default 0.05).
    pub max_ttft_rise: Option<f64>,
    /// Several replicas share `dir` and the work of each batch, through the Redis of
    /// `[limits] redis_url` (default false: one replica owns `dir`).
    pub shared: Option<bool>,
    /// Shared: the lines of one chunk, the unit a replica leases and commits (default 100).
    pub chunk_lines: Option<u64>,
    /// Shared: how long a chunk's lease outlives a replica that stopped renewing it
    /// (default "30s"; renewed every third of it).
    pub lease: Option<String>,
}

/// `[tracing]`: OpenTelemetry spans exported over OTLP. Each key left out is taken from the
/// standard `OTEL_*` environment variables, else its default.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TracingSection {
    /// `false` turns tracing off even when the environment names an endpoint.
    pub enabled: Option<bool>,
    /// The collector's base URL (`http://collector:4318`; for `grpc`, `http://collector:4317`).
    pub otlp_endpoint: Option<String>,
    /// `http/protobuf` (default) or `grpc`.
    pub protocol: Option<String>,
    /// Share of new traces sampled, 0.0–1.0 (default 1.0); a client's own sampling decision
    /// is followed for its traces.
    pub sample_ratio: Option<f64>,
    /// `service.name` (default `sluice`).
    pub service_name: Option<String>,
    /// Headers on every export (a collector's auth); values may use `${ENV}`.
    #[serde(default)]
    pub headers: std::collections::BTreeMap<String, String>,
    /// Resource attributes beside `service.name` (`deployment.environment = "prod"`).
    #[serde(default)]
    pub resource: std::collections::BTreeMap<String, String>,
    /// Most finished spans waiting for export (default 2048); beyond, spans are dropped and
    /// counted.
    pub queue_size: Option<u64>,
    /// Longest a finished span waits before its batch is sent (default `1s`).
    pub export_interval: Option<String>,
    /// Bound on one export (default `10s`).
    pub export_timeout: Option<String>,
    /// Extra roots (PEM) for an `https` collector, beside the system's (either protocol).
    pub ca_file: Option<String>,
}

impl TracingSection {
    /// Whether the file sets anything but `enabled`.
    pub fn sets_any(&self) -> bool {
        self.otlp_endpoint.is_some()
            || self.protocol.is_some()
            || self.sample_ratio.is_some()
            || self.service_name.is_some()
            || !self.headers.is_empty()
            || !self.resource.is_empty()
            || self.queue_size.is_some()
            || self.export_interval.is_some()
            || self.export_timeout.is_some()
            || self.ca_file.is_some()
    }
}

/// `[[passthrough]]`: requests whose path starts with `prefix` are forwarded as they are,
/// routed by the JSON body's `model_field` or sent to the backends of `group` (exactly one).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PassthroughSection {
    pub prefix: String,
    pub model_field: Option<String>,
    pub group: Option<String>,
    /// HTTP methods the rule takes (default `["POST"]`).
    pub methods: Option<Vec<String>>,
}

/// `[[groups]]`: a named set of configured backends.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GroupSection {
    pub name: String,
    #[serde(default)]
    pub backends: Vec<String>,
}

/// `[tls]`: serve the client listener over TLS (HTTP/2 and HTTP/1.1 negotiated by ALPN).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsSection {
    /// PEM certificate chain, leaf first. Re-read when the file changes.
    pub cert: String,
    /// PEM private key (PKCS#8, PKCS#1 or SEC1). Re-read when the file changes.
    pub key: String,
    /// PEM CA bundle: when set, clients must present a certificate it signed (mTLS).
    pub client_ca: Option<String>,
}

/// `[backend_tls]`: how `https://` backends are verified.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackendTlsSection {
    /// PEM CA bundle trusted for backends, in addition to the system roots.
    pub ca_file: Option<String>,
    /// Trust the system's roots too (default true).
    pub system_roots: Option<bool>,
}

/// `[reload]`: watch the config file and apply it when it changes (SIGHUP works regardless).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReloadSection {
    /// Watch the file (default true).
    pub watch: Option<bool>,
    /// How often the file (and the TLS files) are checked, e.g. "1s" (the default; at least
    /// 10ms).
    pub interval: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegistrationSection {
    /// TTL of a registration that names none, e.g. "30s"; a member that stops heartbeating
    /// leaves the pool when it passes. At most `max_ttl`.
    pub ttl: Option<String>,
    /// Longest TTL a registration may ask for.
    pub max_ttl: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiscoverySection {
    /// Members are named `<name>@<ip>:<port>`.
    pub name: String,
    pub kind: String,
    /// A DNS name that resolves to many addresses (e.g. a Kubernetes headless Service).
    pub host: String,
    pub port: u16,
    /// `http` (default) or `https`.
    pub scheme: Option<String>,
    #[serde(default)]
    pub models: Vec<String>,
    #[serde(default)]
    pub model_names: BTreeMap<String, String>,
    pub api_key: Option<String>,
    pub weight: Option<u32>,
    pub max_concurrent: Option<u32>,
    /// Re-resolve this often (default "5s").
    pub interval: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QueueSection {
    /// Requests that may wait at most (default 1024; 0 = no queue).
    pub size: Option<u64>,
    /// Longest wait before 503 with Retry-After (default "5s").
    pub timeout: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerSection {
    pub listen: Option<String>,
    /// Threads serving client connections, each with its own connection pools (default: one
    /// per core).
    pub threads: Option<u64>,
    /// Largest request body, in bytes.
    pub max_body_bytes: Option<u64>,
    /// Largest non-streaming response body read from a backend, in bytes.
    pub max_response_bytes: Option<u64>,
    /// How long in-flight requests may run after SIGTERM, e.g. "30s".
    pub shutdown_grace: Option<String>,
    /// After SIGTERM, how long `/readyz` answers 503 while everything is still served, before
    /// the listener closes (lets a load balancer or Kubernetes stop sending first; default "0s").
    pub shutdown_delay: Option<String>,
    /// Open connections on the client listener at most (default 10000); beyond, a new
    /// connection is closed at once.
    pub max_connections: Option<u64>,
    /// Open connections from one client address (IPv6: one /64) at most (default 1000; 0 = no
    /// per-address cap). Loopback and `trusted_proxies` peers are exempt.
    pub max_connections_per_ip: Option<u64>,
    /// Loopback peers (a sidecar, a local proxy) are exempt from `max_connections_per_ip`
    /// (default true); false caps them like any address.
    pub per_ip_exempt_loopback: Option<bool>,
    /// CIDR ranges of the load balancers and proxies in front of the gateway (default none):
    /// exempt from `max_connections_per_ip`, and the client of their requests is the rightmost
    /// `X-Forwarded-For` entry that is not one of them.
    pub trusted_proxies: Option<Vec<String>>,
    /// Longest time to receive a request head (default "30s"; slowloris). HTTP/1 waits at most
    /// this long for the next request on a kept-alive connection, too.
    pub header_read_timeout: Option<String>,
    /// Longest time to receive a request body once its head arrived (default "60s"; 408 beyond).
    pub body_read_timeout: Option<String>,
    /// A connection with no request in flight is closed after this (default "60s").
    pub idle_timeout: Option<String>,
    /// Largest request head in bytes (default 65536, at least 8192; 431 beyond). Also the
    /// HTTP/1 connection's read buffer and HTTP/2's SETTINGS_MAX_HEADER_LIST_SIZE.
    pub max_header_bytes: Option<u64>,
    /// Most header fields in an HTTP/1 request (default 100; 431 beyond).
    pub max_headers: Option<u64>,
    /// HTTP/2 streams open at once per connection (default 256).
    pub http2_max_concurrent_streams: Option<u64>,
    /// HTTP/2 streams a client may reset before the gateway accepted them (default 20; beyond,
    /// GOAWAY ENHANCE_YOUR_CALM).
    pub http2_max_pending_accept_reset_streams: Option<u64>,
    /// HTTP/2 streams the gateway may reset for protocol errors per connection (default 1024).
    pub http2_max_local_error_reset_streams: Option<u64>,
    /// HTTP/2 requests a client may cancel (RST_STREAM) per connection within 10 s after they
    /// reached the gateway (default 200; beyond, GOAWAY and close: rapid reset).
    pub http2_max_client_resets: Option<u64>,
    /// HTTP/2 bytes buffered for sending per stream (default 262144).
    pub http2_max_send_buf_size: Option<u64>,
    /// HTTP/2 receive window per stream, in bytes (default 1048576).
    pub http2_initial_stream_window_size: Option<u64>,
    /// HTTP/2 receive window per connection, in bytes (default 1048576).
    pub http2_initial_connection_window_size: Option<u64>,
    /// Origins whose browser pages may call the client API (CORS): exact origins such as
    /// "https://app.example.com", or "*" alone for any. None (the default): no CORS headers.
    pub cors_allow_origins: Option<Vec<String>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdminSection {
    pub listen: Option<String>,
    pub token: Option<String>,
    /// Open connections on the admin listener at most (default 256).
    pub max_connections: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RoutingSection {
    pub policy: Option<String>,
    /// Attempts per request across backends (failover), including the first (1 to 16).
    pub max_attempts: Option<u32>,
    /// Total time budget for finding a backend that answers, e.g. "10s".
    pub failover_deadline: Option<String>,
    /// Output tokens assumed when a request sets no `max_tokens`.
    pub default_max_tokens: Option<u64>,
    /// Add `x-sluice-backend` to responses, naming the backend that served them.
    pub expose_backend_header: Option<bool>,
    /// token-aware: above this many eligible backends, power of two choices (default 16; at
    /// least 2).
    pub p2c_above: Option<usize>,
    /// Ask a vLLM or TGI backend's tokenizer for the exact prompt tokens of requests estimated
    /// at this many tokens or more (default 0: never; the estimate is used).
    pub tokenize_above: Option<u64>,
    /// Longest wait for that count before the estimate is used instead (default "250ms").
    pub tokenize_timeout: Option<String>,
    /// At the hang deadline (`[health] hang_factor`), send a copy of the request to another
    /// backend and keep whichever answers first (default false: it costs GPU work).
    pub hedge: Option<bool>,
    /// Continue a stream that breaks after output reached the client on another backend
    /// (default true).
    pub continue_streams: Option<bool>,
}

#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TimeoutsSection {
    /// TCP connect, e.g. "3s".
    pub connect: Option<String>,
    /// Streaming requests: until the response head arrives.
    pub first_byte: Option<String>,
    /// Non-streaming requests: until the response head arrives (the whole generation).
    pub response: Option<String>,
    /// Longest silence between two chunks of a response body.
    pub idle: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HealthSection {
    pub interval: Option<String>,
    pub timeout: Option<String>,
    /// Probes in a row that mark a backend healthy again / down (each at least 1).
    pub healthy_threshold: Option<u32>,
    pub unhealthy_threshold: Option<u32>,
    /// Consecutive live-traffic failures that eject a backend at once (at least 1).
    pub eject_after_failures: Option<u32>,
    /// First ejection time; doubles on each repeat, up to `max_ejection` (which it may not
    /// exceed).
    pub base_ejection: Option<String>,
    pub max_ejection: Option<String>,
    /// After re-admission, ramp a backend's share from 10% to 100% over this time
    /// (default "5s"; "0s" = off).
    pub slow_start: Option<String>,
    /// vLLM: this many waiting requests (from `/metrics`) make a backend `overloaded`
    /// (default 0 = never).
    pub overload_waiting: Option<u64>,
    /// How often engine load signals are read (default: `interval`; "0s" = never).
    pub signals_interval: Option<String>,
    /// A wait for a response head longer than `hang_factor` × the backend's expected time to
    /// it plus `hang_grace`, while other backends answer, is a live failure of that backend
    /// (default 4; 0 = off).
    pub hang_factor: Option<f64>,
    /// The fixed part of that deadline (default "5s").
    pub hang_grace: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackendSection {
    pub name: String,
    pub kind: String,
    pub url: String,
    /// Models this backend serves, by the names clients use. Empty: ask the backend.
    #[serde(default)]
    pub models: Vec<String>,
    /// Client model name → the name this backend knows it by.
    #[serde(default)]
    pub model_names: BTreeMap<String, String>,
    /// Sent as `Authorization: Bearer …` to this backend.
    pub api_key: Option<String>,
    pub weight: Option<u32>,
    pub max_concurrent: Option<u32>,
    /// Probe path override (openai kind; default `/v1/models`).
    pub health_path: Option<String>,
    /// vLLM KV-cache events: `false` turns them off, a `tcp://host:port` string names the
    /// publisher (default: asked of the engine's `GET /kv_event_sources`).
    pub kv_events: Option<KvEventsSetting>,
    /// LoRA adapters Sluice keeps loaded on this engine before it unloads the least recently
    /// used one (default: the engine's adapter slots, `max_lora`).
    pub max_adapters: Option<u32>,
    /// TGI only: the LoRA adapters it was started with (its `--lora-adapters`), which it does
    /// not list anywhere.
    #[serde(default)]
    pub lora_adapters: Vec<String>,
    #[serde(default)]
    pub timeouts: TimeoutsSection,
}

/// `kv_events = false | true | "tcp://host:port"`.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum KvEventsSetting {
    On(bool),
    Endpoint(String),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    pub name: String,
    #[serde(default)]
    pub aliases: Vec<String>,
    /// Routing policy for this model (overrides `[routing].policy`).
    pub policy: Option<String>,
    /// The model's tokenizer folder (`tokenizer.json`, `tokenizer_config.json`, the chat
    /// template), read at load so the gateway computes prompt token ids as the engines do.
    pub tokenizer: Option<String>,
}

/// `[[adapters]]`: a LoRA adapter clients name as their model.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdapterSection {
    pub name: String,
    /// The model it adapts (a `[[models]]` name or a model a backend serves).
    pub base: String,
    /// Where the engines load it from (a folder on the engines' machines).
    pub path: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeySection {
    pub name: String,
    /// `sha256:<hex>` of the whole key string, from `sluice key new`.
    pub hash: String,
    /// Tenant (person, app or team) the key belongs to; defaults to the key's name.
    pub tenant: Option<String>,
    /// Models this key may use (client names or aliases); empty = all.
    #[serde(default)]
    pub models: Vec<String>,
    pub requests_per_minute: Option<u32>,
    pub tokens_per_minute: Option<u64>,
    pub max_concurrent: Option<u32>,
    /// Token budget per UTC day.
    pub daily_tokens: Option<u64>,
    /// Token budget per UTC calendar month.
    pub monthly_tokens: Option<u64>,
    #[serde(default)]
    pub disabled: bool,
    /// RFC 3339 time after which the key is refused.
    pub expires_at: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitsSection {
    pub redis_url: Option<String>,
    /// When Redis is unreachable: `true` (default) enforces the limits per replica from local
    /// state; `false` refuses requests with 503 until Redis is back.
    pub fail_open: Option<bool>,
    /// The period the `*_per_minute` limits are counted over (default "60s"; shorter for tests,
    /// at least 1ms).
    pub window: Option<String>,
    /// Shared mode: how long a concurrency slot outlives a replica that died holding it
    /// (default "5m"; renewed every third of it while the request runs).
    pub concurrency_lease: Option<String>,
    /// Defaults for keys that do not set their own.
    pub requests_per_minute: Option<u32>,
    pub tokens_per_minute: Option<u64>,
    pub max_concurrent: Option<u32>,
    pub daily_tokens: Option<u64>,
    pub monthly_tokens: Option<u64>,
}

/// `[[tenants]]`: limits for the sum of a tenant's keys (a team total).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantSection {
    pub name: String,
    pub requests_per_minute: Option<u32>,
    pub tokens_per_minute: Option<u64>,
    pub max_concurrent: Option<u32>,
    pub daily_tokens: Option<u64>,
    pub monthly_tokens: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuthSection {
    /// Answer a model outside a key's allow-list with 404 `model_not_found` instead of 403, so
    /// the names of models a key may not use do not leak.
    pub hide_disallowed_models: Option<bool>,
}
