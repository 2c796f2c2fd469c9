//! Simulator configuration: the engine kind, the `sluice sim` command-line arguments and the
//! validated [`SimConfig`] the server runs on.
//!
//! Invariants: a `SimConfig` always names at least one model, has a finite non-negative `speed`,
//! non-zero batch and KV limits, and (for Ollama) model names normalised to `name:tag`.
//! Defaults are per kind and follow each engine's own defaults where they exist
//! (vLLM `--max-num-seqs 256`, TGI `MAX_CONCURRENT_REQUESTS 128`, Ollama `OLLAMA_NUM_PARALLEL 1`,
//! `OLLAMA_MAX_QUEUE 512`, `OLLAMA_KEEP_ALIVE 5m`).

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use super::fault::{Fault, FaultMode};
use super::kv_config::KvEventsConfig;
use super::lora::LoraSettings;
use super::SimError;
use crate::tokenizer::Tokenizer;

/// Which engine the simulator imitates.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SimKind {
    /// vLLM's OpenAI-compatible server.
    Vllm,
    /// Hugging Face text-generation-inference.
    Tgi,
    /// Ollama.
    Ollama,
}

impl SimKind {
    /// The lower-case name used on the command line and in logs.
    pub fn as_str(self) -> &'static str {
        match self {
            SimKind::Vllm => "vllm",
            SimKind::Tgi => "tgi",
            SimKind::Ollama => "ollama",
        }
    }
}

impl fmt::Display for SimKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for SimKind {
    type Err = SimError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "vllm" => Ok(SimKind::Vllm),
            "tgi" => Ok(SimKind::Tgi),
            "ollama" => Ok(SimKind::Ollama),
            other => Err(SimError::Config(format!(
                "unknown simulator kind `{other}` (expected vllm, tgi or ollama)"
            ))),
        }
    }
}

pub use crate::batching::Timing;

/// The validated configuration of one simulator.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// Engine personality.
    pub kind: SimKind,
    /// Served model names (the first one is the default model and the vLLM metrics label).
    pub models: Vec<String>,
    /// Address to bind (`sluice sim --host`).
    pub host: IpAddr,
    /// Port to bind (0 = any free port).
    pub port: u16,
    /// Time scale: `F` = F times faster than the default timing model; 0 = no delays at all.
    pub speed: f64,
    /// Seed of the deterministic text generator (a request's own `seed` takes precedence).
    pub seed: u64,
    /// Continuous-batching timing model.
    pub timing: Timing,
    /// vLLM `max_model_len` (also TGI `max_total_tokens` and Ollama's context length).
    pub max_model_len: u32,
    /// TGI `max_concurrent_requests`: past this many in-flight requests TGI answers 429.
    pub max_concurrent_requests: usize,
    /// TGI `max_input_tokens`.
    pub max_input_tokens: u32,
    /// Ollama `OLLAMA_MAX_QUEUE`: waiting requests beyond it get 503 "server busy".
    pub max_queue: usize,
    /// Ollama model load time paid by the first request after the model was unloaded.
    pub load_time: Duration,
    /// Ollama `OLLAMA_KEEP_ALIVE`: how long a model stays loaded after its last request.
    pub keep_alive: Duration,
    /// Whether Ollama models start loaded (false = the first request pays `load_time`).
    pub preloaded: bool,
    /// Dimension of the embedding vectors.
    pub embedding_dim: usize,
    /// vLLM `--enable-prompt-tokens-details`: usage reports
    /// `prompt_tokens_details.cached_tokens` (the request's prefix-cache hit). Off by default,
    /// as in vLLM.
    pub prompt_tokens_details: bool,
    /// vLLM `VLLM_ENABLE_RESPONSES_API_STORE=1`: the Responses API keeps responses in this
    /// process's memory (`store`, `GET /v1/responses/{id}`, `previous_response_id`,
    /// `background`, cancel). Off by default, as in vLLM.
    pub responses_store: bool,
    /// vLLM `--kv-events-config`: publish the prefix cache's changes over ZMQ (vLLM only; needs
    /// the scheduler, so a speed above 0).
    pub kv_events: Option<KvEventsConfig>,
    /// vLLM `VLLM_SERVER_DEV_MODE=1`: its development routes, of which the simulator serves
    /// `POST /reset_prefix_cache`. Off by default, as in vLLM.
    pub server_dev_mode: bool,
    /// Fault active at start-up (normally healthy).
    pub fault: Fault,
    /// `run` only: N >= 1 = serve on N dedicated threads, each a single-threaded runtime
    /// accepting from the same socket (no cross-thread wake-ups); 0 = the caller's runtime.
    pub threads: usize,
    /// vLLM: the model's real tokenizer (`--tokenizer <folder>`): chat and completions prompts
    /// are tokenized exactly as vLLM does, for usage, the prefix cache and `/tokenize`. `None`
    /// = the simulator's own tokenizer.
    pub tokenizer: Option<Arc<Tokenizer>>,
    /// vLLM's LoRA adapters (`--enable-lora` and its companions; off by default, as in vLLM).
    pub lora: LoraSettings,
    /// TGI `--lora-adapters`: the adapter ids requests may name (`adapter_id`, or `model` on
    /// its OpenAI routes), fixed at start.
    pub tgi_lora_adapters: Vec<String>,
}

impl SimConfig {
    /// A configuration with the kind's realistic defaults, serving `models`.
    pub fn new(kind: SimKind, models: Vec<String>) -> SimConfig {
        let mut timing = Timing::default();
        let max_concurrent_requests = match kind {
            SimKind::Tgi => 128,
            _ => 1024,
        };
        match kind {
            SimKind::Vllm => {}
            SimKind::Tgi => timing.max_num_seqs = 128,
            SimKind::Ollama => {
                timing.max_num_seqs = 1;
                // llama.cpp on one GPU: slower steps, no batching gain.
                timing.decode_base = Duration::from_millis(20);
            }
        }
        let models = if kind == SimKind::Ollama {
            models.into_iter().map(|m| ollama_name(&m)).collect()
        } else {
            models
        };
        SimConfig {
            kind,
            models,
            host: IpAddr::V4(Ipv4Addr::LOCALHOST),
            port: 0,
            speed: 1.0,
            seed: 0,
            timing,
            max_model_len: match kind {
                SimKind::Ollama => 4096,
                _ => 8192,
            },
            max_concurrent_requests,
            max_input_tokens: 8191,
            max_queue: 512,
            load_time: Duration::from_millis(1500),
            keep_alive: Duration::from_secs(300),
            preloaded: false,
            embedding_dim: 384,
            prompt_tokens_details: false,
            responses_store: false,
            kv_events: None,
            server_dev_mode: false,
            fault: Fault::healthy(),
            threads: 0,
            tokenizer: None,
            lora: LoraSettings::default(),
            tgi_lora_adapters: Vec::new(),
        }
    }

    /// Time scale (0 = no delays at all).
    pub fn speed(mut self, speed: f64) -> Self {
        self.speed = speed;
        self
    }
    /// Port to bind.
    pub fn port(mut self, port: u16) -> Self {
        self.port = port;
        self
    }
    /// Host to bind.
    pub fn host(mut self, host: IpAddr) -> Self {
        self.host = host;
        self
    }
    /// Seed of the text generator.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }
    /// Maximum running sequences (Ollama: parallel slots per model).
    pub fn max_num_seqs(mut self, n: usize) -> Self {
        self.timing.max_num_seqs = n;
        self
    }
    /// Ollama `OLLAMA_NUM_PARALLEL` (same as `max_num_seqs`).
    pub fn parallel(self, n: usize) -> Self {
        self.max_num_seqs(n)
    }
    /// KV-cache capacity in tokens.
    pub fn kv_capacity_tokens(mut self, tokens: u64) -> Self {
        self.timing.kv_capacity_tokens = tokens;
        self
    }
    /// TGI `max_concurrent_requests`.
    pub fn max_concurrent_requests(mut self, n: usize) -> Self {
        self.max_concurrent_requests = n;
        self
    }
    /// Ollama `OLLAMA_MAX_QUEUE`.
    pub fn max_queue(mut self, n: usize) -> Self {
        self.max_queue = n;
        self
    }
    /// Ollama model load time.
    pub fn load_time(mut self, d: Duration) -> Self {
        self.load_time = d;
        self
    }
    /// Ollama keep-alive.
    pub fn keep_alive(mut self, d: Duration) -> Self {
        self.keep_alive = d;
        self
    }
    /// Whether Ollama models start loaded.
    pub fn preloaded(mut self, yes: bool) -> Self {
        self.preloaded = yes;
        self
    }
    /// vLLM `--enable-prompt-tokens-details` (ignored by the other kinds).
    pub fn prompt_tokens_details(mut self, yes: bool) -> Self {
        self.prompt_tokens_details = yes;
        self
    }
    /// vLLM's Responses API store (`VLLM_ENABLE_RESPONSES_API_STORE=1`; ignored by the other
    /// kinds).
    pub fn responses_store(mut self, yes: bool) -> Self {
        self.responses_store = yes;
        self
    }
    /// vLLM `--kv-events-config` (see [`KvEventsConfig::from_json`]).
    pub fn kv_events_config(mut self, config: KvEventsConfig) -> Self {
        self.kv_events = Some(config);
        self
    }
    /// vLLM `VLLM_SERVER_DEV_MODE=1` (`POST /reset_prefix_cache`; ignored by the other kinds).
    pub fn server_dev_mode(mut self, yes: bool) -> Self {
        self.server_dev_mode = yes;
        self
    }
    /// vLLM `max_model_len`.
    pub fn max_model_len(mut self, n: u32) -> Self {
        self.max_model_len = n;
        self
    }
    /// Replace the whole timing model.
    pub fn timing(mut self, timing: Timing) -> Self {
        self.timing = timing;
        self
    }
    /// Natural answer length range in tokens.
    pub fn output_tokens(mut self, min: u32, max: u32) -> Self {
        self.timing.min_output_tokens = min;
        self.timing.max_output_tokens = max;
        self
    }
    /// `run` only: N >= 1 dedicated single-threaded runtimes, 0 = the caller's runtime.
    pub fn threads(mut self, threads: usize) -> Self {
        self.threads = threads;
        self
    }
    /// Fault active at start-up.
    pub fn fault(mut self, fault: Fault) -> Self {
        self.fault = fault;
        self
    }
    /// vLLM: tokenize chat and completions prompts with the model's real tokenizer, exactly as
    /// vLLM does (ignored by the other kinds).
    pub fn tokenizer(mut self, tokenizer: Arc<Tokenizer>) -> Self {
        self.tokenizer = Some(tokenizer);
        self
    }

    /// vLLM's LoRA settings (`--enable-lora`, …; see [`LoraSettings`]).
    pub fn lora(mut self, settings: LoraSettings) -> Self {
        self.lora = settings;
        self
    }
    /// TGI `--lora-adapters`: the adapter ids requests may name.
    pub fn tgi_lora_adapters(mut self, ids: Vec<String>) -> Self {
        self.tgi_lora_adapters = ids;
        self
    }

    /// The address `sluice sim` binds.
    pub fn bind_addr(&self) -> SocketAddr {
        SocketAddr::new(self.host, self.port)
    }

    /// Check the invariants listed in the module doc.
    pub fn validate(mut self) -> Result<SimConfig, SimError> {
        if self.models.is_empty() {
            return Err(SimError::Config("at least one --model is required".into()));
        }
        if self.models.iter().any(|m| m.trim().is_empty()) {
            return Err(SimError::Config("model names must not be empty".into()));
        }
        if !self.speed.is_finite() || self.speed < 0.0 {
            return Err(SimError::Config(format!(
                "--speed must be a finite number >= 0, got {}",
                self.speed
            )));
        }
        if self.timing.max_num_seqs == 0 || self.timing.kv_capacity_tokens == 0 {
            return Err(SimError::Config(
                "--max-num-seqs and --kv-capacity-tokens must be > 0".into(),
            ));
        }
        if self.timing.block_size == 0 {
            return Err(SimError::Config("--block-size must be > 0".into()));
        }
        if self.timing.min_output_tokens == 0
            || self.timing.min_output_tokens > self.timing.max_output_tokens
        {
            return Err(SimError::Config(
                "output token range must satisfy 1 <= min <= max".into(),
            ));
        }
        if self.max_model_len == 0 || self.max_concurrent_requests == 0 {
            return Err(SimError::Config(
                "--max-model-len and --max-concurrent-requests must be > 0".into(),
            ));
        }
        if self.threads > 256 {
            return Err(SimError::Config("--threads must be at most 256".into()));
        }
        if self.kind == SimKind::Ollama {
            self.models = self.models.iter().map(|m| ollama_name(m)).collect();
        }
        let mut seen = std::collections::HashSet::new();
        for m in &self.models {
            if !seen.insert(m.clone()) {
                return Err(SimError::Config(format!("model `{m}` is listed twice")));
            }
        }
        self.fault.validate().map_err(SimError::Config)?;
        self.validate_lora()?;
        if self.kv_events.as_ref().is_some_and(KvEventsConfig::enabled) {
            if self.kind != SimKind::Vllm {
                return Err(SimError::Config(
                    "--kv-events-config is a vLLM flag (--kind vllm)".into(),
                ));
            }
            if self.speed <= 0.0 {
                return Err(SimError::Config(
                    "--kv-events-config needs the prefix cache's scheduler: --speed above 0".into(),
                ));
            }
        }
        Ok(self)
    }
}

impl SimConfig {
    /// The LoRA flags belong to their engine and hold vLLM's own checks.
    fn validate_lora(&self) -> Result<(), SimError> {
        if self.lora != LoraSettings::default() && self.kind != SimKind::Vllm {
            return Err(SimError::Config(
                "--enable-lora and its companions are vLLM flags (--kind vllm)".into(),
            ));
        }
        if !self.tgi_lora_adapters.is_empty() && self.kind != SimKind::Tgi {
            return Err(SimError::Config(
                "--lora-adapters is a TGI flag (--kind tgi)".into(),
            ));
        }
        self.lora.validate().map_err(SimError::Config)
    }
}

/// Ollama names are `model:tag`; the tag defaults to `latest`.
pub(crate) fn ollama_name(name: &str) -> String {
    let last = name.rsplit('/').next().unwrap_or(name);
    if last.contains(':') {
        name.to_string()
    } else {
        format!("{name}:latest")
    }
}

fn parse_duration_secs(s: &str) -> Result<Duration, String> {
    let v: f64 = s
        .trim_end_matches('s')
        .parse()
        .map_err(|_| format!("`{s}` is not a number of seconds"))?;
    if !v.is_finite() || !(0.0..=1.0e9).contains(&v) {
        return Err(format!("`{s}` must be between 0 and 1e9 seconds"));
    }
    Ok(Duration::from_secs_f64(v))
}

/// Arguments of `sluice sim`.
#[derive(clap::Args, Clone, Debug)]
pub struct SimArgs {
    /// Engine to imitate: vllm, tgi or ollama.
    #[arg(long, value_parser = parse_kind)]
    pub kind: SimKind,
    /// Address to bind.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// Port to bind (0 = any free port).
    #[arg(long, default_value_t = 0)]
    pub port: u16,
    /// A served model name (repeat for several models).
    #[arg(long = "model", required = true)]
    pub models: Vec<String>,
    /// F times faster than the default timing model; 0 = no delays at all.
    #[arg(long, default_value_t = 1.0)]
    pub speed: f64,
    /// Seed of the deterministic text generator.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Maximum running sequences per model (Ollama: parallel slots, like OLLAMA_NUM_PARALLEL).
    #[arg(long, alias = "parallel")]
    pub max_num_seqs: Option<usize>,
    /// KV-cache capacity in tokens per model.
    #[arg(long)]
    pub kv_capacity_tokens: Option<u64>,
    /// Prefill cost per uncached prompt token, in microseconds.
    #[arg(long)]
    pub prefill_us_per_token: Option<u64>,
    /// Fixed cost of a decode step, in microseconds.
    #[arg(long)]
    pub decode_base_us: Option<u64>,
    /// Extra decode-step cost per running sequence, in microseconds.
    #[arg(long)]
    pub decode_per_seq_us: Option<u64>,
    /// Prefix-cache block size in tokens.
    #[arg(long)]
    pub block_size: Option<u32>,
    /// Tokens the prefix cache may keep (default: the KV capacity).
    #[arg(long)]
    pub prefix_cache_tokens: Option<u64>,
    /// Shortest natural answer in tokens.
    #[arg(long)]
    pub min_output_tokens: Option<u32>,
    /// Longest natural answer in tokens.
    #[arg(long)]
    pub max_output_tokens: Option<u32>,
    /// Context length (vLLM max_model_len, TGI max_total_tokens, Ollama context length).
    #[arg(long)]
    pub max_model_len: Option<u32>,
    /// TGI max_concurrent_requests (429 beyond it).
    #[arg(long)]
    pub max_concurrent_requests: Option<usize>,
    /// TGI max_input_tokens.
    #[arg(long)]
    pub max_input_tokens: Option<u32>,
    /// Ollama OLLAMA_MAX_QUEUE (503 beyond it).
    #[arg(long)]
    pub max_queue: Option<usize>,
    /// Ollama model load time in seconds.
    #[arg(long, value_parser = parse_duration_secs)]
    pub load_time: Option<Duration>,
    /// Ollama keep-alive in seconds.
    #[arg(long, value_parser = parse_duration_secs)]
    pub keep_alive: Option<Duration>,
    /// Ollama: start with the models loaded.
    #[arg(long)]
    pub preloaded: bool,
    /// vLLM: report each request's prefix-cache hit as usage.prompt_tokens_details.cached_tokens
    /// (off by default, as in vLLM).
    #[arg(long)]
    pub enable_prompt_tokens_details: bool,
    /// vLLM: keep Responses API answers in this process's memory, like
    /// VLLM_ENABLE_RESPONSES_API_STORE=1 (store, GET /v1/responses/{id}, previous_response_id,
    /// background and cancel). Off by default, as in vLLM: `background` then gets a 400.
    #[arg(long)]
    pub enable_responses_store: bool,
    /// vLLM: publish KV-cache events as vLLM does with this JSON (its KVEventsConfig:
    /// enable_kv_cache_events, publisher, endpoint, replay_endpoint, buffer_steps, hwm,
    /// max_queue_size, topic). `tcp://*:0` binds a free port of --host; GET /kv_event_sources
    /// shows the endpoints bound.
    #[arg(long, value_parser = parse_kv_events)]
    pub kv_events_config: Option<KvEventsConfig>,
    /// vLLM: its development routes, like VLLM_SERVER_DEV_MODE=1 (POST /reset_prefix_cache).
    #[arg(long)]
    pub server_dev_mode: bool,
    /// Fault at start-up: healthy, hang, slow, error_rate, drop_midstream, overloaded,
    /// health_fail, loading, refuse, kv_skip, kv_lost.
    #[arg(long, default_value = "healthy", value_parser = parse_mode)]
    pub fault: FaultMode,
    /// `slow` fault: latency multiplier.
    #[arg(long)]
    pub fault_factor: Option<f64>,
    /// `error_rate` fault: fraction of inference requests answered with a 5xx.
    #[arg(long)]
    pub fault_rate: Option<f64>,
    /// `drop_midstream` fault: chunks sent before the connection is cut.
    #[arg(long)]
    pub fault_after_chunks: Option<u32>,
    /// `loading` / `refuse` fault: duration in seconds.
    #[arg(long)]
    pub fault_seconds: Option<f64>,
    /// `kv_skip` / `kv_lost` fault: sequence numbers of the KV-event batches not sent
    /// (comma-separated).
    #[arg(long, value_delimiter = ',')]
    pub fault_seqs: Vec<i64>,
    /// Serving threads: N >= 1 dedicated single-threaded runtimes sharing the listening socket;
    /// 0 = share the process runtime.
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    /// vLLM: the model's tokenizer folder (tokenizer.json, tokenizer_config.json, chat
    /// template); prompts are then tokenized exactly as vLLM does (usage, prefix cache,
    /// /tokenize). Without it the simulator's own tokenizer counts.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// vLLM: serve LoRA adapters (loaded ones are models: /v1/models lists them, requests name
    /// them in `model`).
    #[arg(long)]
    pub enable_lora: bool,
    /// vLLM: adapters a batch may run at once (GPU slots); a request for another one waits
    /// (default 1, as in vLLM).
    #[arg(long)]
    pub max_loras: Option<usize>,
    /// vLLM: the largest adapter rank; accepted for compatibility, no effect.
    #[arg(long)]
    pub max_lora_rank: Option<u32>,
    /// vLLM: adapters kept in CPU memory; must be at least --max-loras, as vLLM checks.
    #[arg(long)]
    pub max_cpu_loras: Option<usize>,
    /// vLLM: adapters loaded at start, `name=path` (several values or several flags). A path
    /// must exist on this machine.
    #[arg(long, num_args = 1.., value_parser = parse_lora_module)]
    pub lora_modules: Vec<(String, String)>,
    /// vLLM: serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter, like
    /// VLLM_ALLOW_RUNTIME_LORA_UPDATING=True.
    #[arg(long)]
    pub allow_runtime_lora_updating: bool,
    /// vLLM: milliseconds swapping an adapter into a GPU slot adds to the engine step that
    /// needs it (timing model; default 25).
    #[arg(long)]
    pub lora_load_ms: Option<u64>,
    /// TGI: LoRA adapter ids requests may name (comma-separated; `name=path` names a local
    /// one), fixed at start.
    #[arg(long, value_delimiter = ',')]
    pub lora_adapters: Vec<String>,
}

fn parse_lora_module(s: &str) -> Result<(String, String), String> {
    super::lora::parse_module(s)
}

/// `slot` takes `v` when it is given.
fn set<T>(slot: &mut T, v: Option<T>) {
    if let Some(v) = v {
        *slot = v;
    }
}

fn parse_kind(s: &str) -> Result<SimKind, String> {
    s.parse().map_err(|e: SimError| e.to_string())
}

fn parse_mode(s: &str) -> Result<FaultMode, String> {
    s.parse()
}

fn parse_kv_events(s: &str) -> Result<KvEventsConfig, String> {
    KvEventsConfig::from_json(s).map_err(|e| e.to_string())
}

/// The id a TGI `--lora-adapters` entry is requested by: `name=path` is `name`, `id@revision`
/// is `id`.
fn tgi_adapter_id(entry: &str) -> String {
    let entry = entry.trim();
    let id = match entry.split_once('=') {
        Some((name, _)) => name,
        None => entry.split('@').next().unwrap_or(entry),
    };
    id.to_string()
}

impl SimArgs {
    /// The LoRA flags as [`LoraSettings`].
    fn lora_settings(&self) -> LoraSettings {
        let mut l = LoraSettings {
            enabled: self.enable_lora,
            max_cpu_loras: self.max_cpu_loras,
            modules: self.lora_modules.clone(),
            runtime_updating: self.allow_runtime_lora_updating,
            ..LoraSettings::default()
        };
        set(&mut l.max_loras, self.max_loras);
        set(
            &mut l.load_time,
            self.lora_load_ms.map(Duration::from_millis),
        );
        l
    }

    /// Validate the arguments into a [`SimConfig`].
    pub fn into_config(self) -> Result<SimConfig, SimError> {
        let lora = self.lora_settings();
        let tgi_lora_adapters = self
            .lora_adapters
            .iter()
            .map(|a| tgi_adapter_id(a))
            .collect();
        let mut c = SimConfig::new(self.kind, self.models)
            .host(self.host)
            .port(self.port)
            .speed(self.speed)
            .seed(self.seed);
        let t = &mut c.timing;
        set(&mut t.max_num_seqs, self.max_num_seqs);
        set(&mut t.kv_capacity_tokens, self.kv_capacity_tokens);
        if self.prefix_cache_tokens.is_some() {
            t.prefix_cache_tokens = self.prefix_cache_tokens;
        }
        set(
            &mut t.prefill_per_token,
            self.prefill_us_per_token.map(Duration::from_micros),
        );
        set(
            &mut t.decode_base,
            self.decode_base_us.map(Duration::from_micros),
        );
        set(
            &mut t.decode_per_seq,
            self.decode_per_seq_us.map(Duration::from_micros),
        );
        set(&mut t.block_size, self.block_size);
        set(&mut t.min_output_tokens, self.min_output_tokens);
        set(&mut t.max_output_tokens, self.max_output_tokens);
        set(&mut c.max_model_len, self.max_model_len);
        set(&mut c.max_concurrent_requests, self.max_concurrent_requests);
        set(&mut c.max_input_tokens, self.max_input_tokens);
        set(&mut c.max_queue, self.max_queue);
        set(&mut c.load_time, self.load_time);
        set(&mut c.keep_alive, self.keep_alive);
        c.preloaded = self.preloaded;
        c.prompt_tokens_details = self.enable_prompt_tokens_details;
        c.responses_store = self.enable_responses_store;
        c.kv_events = self.kv_events_config;
        c.server_dev_mode = self.server_dev_mode;
        c.threads = self.threads;
        c.lora = lora;
        c.tgi_lora_adapters = tgi_lora_adapters;
        if let Some(dir) = &self.tokenizer {
            let t =
                Tokenizer::load(dir).map_err(|e| SimError::Config(format!("--tokenizer: {e}")))?;
            c.tokenizer = Some(Arc::new(t));
        }
        c.fault = Fault::from_parts(
            self.fault,
            self.fault_factor,
            self.fault_rate,
            self.fault_after_chunks,
            self.fault_seconds,
            None,
        )
        .with_seqs(self.fault_seqs);
        c.validate()
    }
}
