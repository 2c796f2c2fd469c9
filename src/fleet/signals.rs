//! Load signals read from the engines themselves, per backend kind, refreshed on the probe
//! cadence (`health.signals_interval`):
//!
//! - vLLM `/metrics`: `vllm:num_requests_waiting`, `vllm:num_requests_running`,
//!   `vllm:kv_cache_usage_perc` (falling back to the old `vllm:gpu_cache_usage_perc`), per
//!   `model_name`, summed over `engine` (data-parallel ranks); prefix-cache counters.
//! - TGI `/metrics`: `tgi_queue_size`, `tgi_batch_current_size`, `tgi_batch_current_max_tokens`;
//!   `/info` `max_concurrent_requests` and `max_total_tokens` as capacity. TGI exports no KV
//!   gauge and `/info` no KV budget, so the budget is learned: the most tokens the running batch
//!   held (`tgi_batch_current_max_tokens`: prompt plus allowed output of each request, what
//!   TGI reserves) while requests waited. Usage is then the batch's tokens over that budget.
//! - Ollama `/api/ps`: the models loaded now (routing prefers a warm node).
//! - OpenAI-compatible: nothing to read; the gateway's own counts are used.
//!
//! The result is an immutable [`Signals`] snapshot published through an `ArcSwap` in
//! [`super::BackendState::signals`]; routing reads it without a lock. A failed scrape keeps the
//! previous snapshot, which then ages: [`Signals::fresh`] says whether it may still be trusted.
//! Invariant: nothing a backend sends can panic this module (bodies are size-capped by the
//! probe client and parsed tolerantly by [`super::prom`]).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;

use super::backend::monotonic_ms;
use super::prom::{self, Sample};
use super::Backend;
use crate::config::{BackendKind, HealthConfig};
use crate::telemetry::metrics as m;

/// Re-read TGI's `/info` (capacity) this often.
const INFO_EVERY_MS: u64 = 10_000;
/// A snapshot older than this many scrape intervals is ignored by routing.
const STALE_INTERVALS: u64 = 3;

/// Load of one model on one engine.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ModelLoad {
    pub running: f64,
    pub waiting: f64,
    /// 0..1.
    pub kv_usage: Option<f64>,
}

/// What the engine last said about its load.
#[derive(Debug, Clone, Default)]
pub struct Signals {
    /// When this was read (ms since process start; 0 = never).
    pub at_ms: u64,
    /// How often it is refreshed (to judge staleness).
    pub interval_ms: u64,
    /// Sum over models (vLLM) or the engine's single queue (TGI).
    pub total: Option<ModelLoad>,
    /// vLLM: per `model_name`.
    pub per_model: HashMap<String, ModelLoad>,
    /// TGI: token budget of the current batch.
    pub batch_max_tokens: Option<f64>,
    /// TGI `/info`.
    pub max_concurrent: Option<u64>,
    pub max_total_tokens: Option<u64>,
    /// Batch slots learned from observation: the most requests seen running while others
    /// waited (vLLM's `max_num_seqs`, or the KV cache's limit, whichever binds).
    pub learned_slots: Option<u64>,
    /// TGI: the KV token budget learned from observation, the most `batch_max_tokens` seen
    /// while requests waited (a lower bound of the real budget that only grows).
    pub learned_kv_tokens: Option<u64>,
    /// Full-batch readings in a row that were below `learned_slots` (it drifts down only after
    /// [`LOW_READINGS`] of them).
    pub slots_low: u8,
    /// vLLM: the KV cache's size in tokens as the engine reports it
    /// (`vllm:cache_config_info{kv_cache_size_tokens}`; the smallest engine's).
    pub kv_capacity_tokens: Option<u64>,
    /// Ollama `/api/ps`: the names of the loaded models (`None`: unknown).
    pub loaded: Option<Vec<String>>,
    /// vLLM prefix cache counters (tokens), summed over models.
    pub prefix_queries: Option<f64>,
    pub prefix_hits: Option<f64>,
}

impl Signals {
    /// Whether the snapshot is recent enough to route on.
    pub fn fresh(&self) -> bool {
        self.at_ms != 0
            && monotonic_ms().saturating_sub(self.at_ms)
                <= self.interval_ms.max(100).saturating_mul(STALE_INTERVALS)
    }

    /// Load for `model` (the backend's name for it), else the engine total.
    pub fn load_for(&self, model: &str) -> Option<ModelLoad> {
        self.per_model.get(model).copied().or(self.total)
    }

    /// Whether `model` is loaded (Ollama); `None` when unknown.
    pub fn is_loaded(&self, model: &str) -> Option<bool> {
        let loaded = self.loaded.as_ref()?;
        let bare = model.strip_suffix(":latest").unwrap_or(model);
        Some(loaded.iter().any(|m| {
            let mb = m.strip_suffix(":latest").unwrap_or(m);
            mb == bare
        }))
    }
}

/// Read vLLM load from a `/metrics` exposition.
pub fn parse_vllm(text: &str) -> Signals {
    vllm_signals(&prom::parse(text))
}

/// vLLM load from an exposition's samples.
fn vllm_signals(samples: &[prom::Sample]) -> Signals {
    let mut per_model: HashMap<String, ModelLoad> = HashMap::new();
    let mut kv_new: HashMap<String, (f64, u32)> = HashMap::new();
    let mut kv_old: HashMap<String, (f64, u32)> = HashMap::new();
    let mut queries = None::<f64>;
    let mut hits = None::<f64>;
    let mut kv_capacity = None::<u64>;
    for s in samples.iter().filter(|s| s.value.is_finite()) {
        let model = s.label("model_name").unwrap_or("").to_string();
        match s.name.as_str() {
            "vllm:num_requests_running" => per_model.entry(model).or_default().running += s.value,
            "vllm:num_requests_waiting" => per_model.entry(model).or_default().waiting += s.value,
            // KV usage is a ratio per engine: average over engines.
            "vllm:kv_cache_usage_perc" => add_avg(&mut kv_new, model, s.value),
            "vllm:gpu_cache_usage_perc" => add_avg(&mut kv_old, model, s.value),
            "vllm:prefix_cache_queries_total" | "vllm:prefix_cache_queries" => {
                *queries.get_or_insert(0.0) += s.value
            }
            "vllm:prefix_cache_hits_total" | "vllm:prefix_cache_hits" => {
                *hits.get_or_insert(0.0) += s.value
            }
            "vllm:cache_config_info" => {
                let size = s
                    .label("kv_cache_size_tokens")
                    .and_then(|v| v.parse::<u64>().ok());
                if let Some(size) = size.filter(|n| *n > 0) {
                    kv_capacity = Some(kv_capacity.map_or(size, |k| k.min(size)));
                }
            }
            _ => {}
        }
    }
    for (model, load) in per_model.iter_mut() {
        load.kv_usage = kv_new
            .get(model)
            .or_else(|| kv_old.get(model))
            .map(|(sum, n)| (sum / f64::from(*n)).clamp(0.0, 1.0));
    }
    let total = (!per_model.is_empty()).then(|| {
        let mut t = ModelLoad::default();
        let mut kv = Vec::new();
        for l in per_model.values() {
            t.running += l.running;
            t.waiting += l.waiting;
            kv.extend(l.kv_usage);
        }
        t.kv_usage = kv.into_iter().reduce(f64::max);
        t
    });
    Signals {
        total,
        per_model,
        prefix_queries: queries,
        prefix_hits: hits,
        kv_capacity_tokens: kv_capacity,
        ..Signals::default()
    }
}

fn add_avg(map: &mut HashMap<String, (f64, u32)>, model: String, v: f64) {
    let e = map.entry(model).or_insert((0.0, 0));
    e.0 += v;
    e.1 += 1;
}

/// Read TGI load from its `/metrics` (no model label: one model per TGI).
pub fn parse_tgi(text: &str) -> Signals {
    tgi_signals(&prom::parse(text))
}

fn tgi_signals(samples: &[Sample]) -> Signals {
    let get = |name: &str| prom::sum(samples, name, |_| true);
    let queue = get("tgi_queue_size");
    let batch = get("tgi_batch_current_size");
    let total = (queue.is_some() || batch.is_some()).then(|| ModelLoad {
        running: batch.unwrap_or(0.0).max(0.0),
        waiting: queue.unwrap_or(0.0).max(0.0),
        kv_usage: None,
    });
    Signals {
        total,
        batch_max_tokens: get("tgi_batch_current_max_tokens"),
        ..Signals::default()
    }
}

#[derive(Deserialize)]
struct TgiInfo {
    max_concurrent_requests: Option<u64>,
    max_total_tokens: Option<u64>,
}

/// TGI `/info` capacity: (max_concurrent_requests, max_total_tokens).
pub fn parse_tgi_info(body: &[u8]) -> Option<(Option<u64>, Option<u64>)> {
    let info: TgiInfo = serde_json::from_slice(body).ok()?;
    Some((info.max_concurrent_requests, info.max_total_tokens))
}

#[derive(Deserialize)]
struct OllamaPs {
    #[serde(default)]
    models: Vec<OllamaPsModel>,
}
#[derive(Deserialize)]
struct OllamaPsModel {
    #[serde(default)]
    name: String,
    #[serde(default)]
    model: String,
    /// The loaded runner's context window (`num_ctx`); absent before Ollama 0.6.
    #[serde(default)]
    context_length: u64,
}

/// The context window of each loaded model of an Ollama `/api/ps` answer (what Ollama
/// truncates prompts to; a model's `/api/show` `<arch>.context_length` is what it was trained
/// for, which the runner does not use unless asked to).
pub fn parse_ollama_context(body: &[u8]) -> std::collections::BTreeMap<String, u64> {
    let Ok(ps) = serde_json::from_slice::<OllamaPs>(body) else {
        return Default::default();
    };
    ps.models
        .into_iter()
        .filter(|m| m.context_length > 0)
        .map(|m| {
            let name = if m.name.is_empty() { m.model } else { m.name };
            (name, m.context_length)
        })
        .filter(|(n, _)| !n.is_empty())
        .collect()
}

/// The loaded models of an Ollama `/api/ps` answer.
pub fn parse_ollama_ps(body: &[u8]) -> Option<Vec<String>> {
    let ps: OllamaPs = serde_json::from_slice(body).ok()?;
    Some(
        ps.models
            .into_iter()
            .map(|m| if m.name.is_empty() { m.model } else { m.name })
            .filter(|n| !n.is_empty())
            .collect(),
    )
}

/// Full-batch readings below the learned batch limit, in a row, before it drifts down. A slot
/// freed by a finished request is refilled only at the engine's next step, so one reading
/// taken in between shows one sequence fewer running beside a queue; a real lower limit
/// shows on every reading.
pub const LOW_READINGS: u8 = 3;

/// Carry learned facts from the previous snapshot into a new one.
pub(crate) fn merge(prev: &Signals, mut next: Signals) -> Signals {
    if next.max_concurrent.is_none() {
        next.max_concurrent = prev.max_concurrent;
        next.max_total_tokens = prev.max_total_tokens;
    }
    next.learned_slots = prev.learned_slots;
    next.learned_kv_tokens = prev.learned_kv_tokens;
    next.kv_capacity_tokens = next.kv_capacity_tokens.or(prev.kv_capacity_tokens);
    let Some(mut t) = next.total else {
        return next;
    };
    // Running while others wait = the batch is full: that many is the engine's limit now.
    next.slots_low = prev.slots_low;
    if t.waiting >= 1.0 && t.running >= 1.0 {
        let seen = t.running as u64;
        next.slots_low = match prev.learned_slots {
            Some(s) if s > seen => prev.slots_low.saturating_add(1),
            _ => 0,
        };
        next.learned_slots = Some(match prev.learned_slots {
            Some(s) if s > seen && next.slots_low < LOW_READINGS => s,
            Some(s) if s > seen => s - (s - seen).div_ceil(8), // drift down slowly
            _ => seen,
        });
        // ... and the tokens it holds are within its KV budget, which is at least that much.
        // (Two running at least: a lone request larger than the budget is admitted alone.)
        if let Some(held) = next.batch_max_tokens.filter(|_| t.running >= 2.0) {
            let held = held.max(0.0) as u64;
            next.learned_kv_tokens = Some(next.learned_kv_tokens.map_or(held, |b| b.max(held)));
        }
    }
    if t.kv_usage.is_none() {
        if let (Some(held), Some(budget)) = (next.batch_max_tokens, next.learned_kv_tokens) {
            if budget > 0 {
                t.kv_usage = Some((held.max(0.0) / budget as f64).min(1.0));
                next.total = Some(t);
            }
        }
    }
    next
}

/// Scrape one backend's signals once and publish them. Failures keep the old snapshot.
pub async fn refresh(backend: &Backend, cfg: &HealthConfig, last_info_ms: &mut u64) {
    let interval_ms = u64::try_from(cfg.signals_interval.as_millis()).unwrap_or(u64::MAX);
    let timeout = cfg.timeout;
    let get = |path: &'static str| async move {
        match tokio::time::timeout(timeout, super::health::get(backend, path)).await {
            Ok(Ok((status, body))) if status.is_success() => Some(body),
            _ => None,
        }
    };
    let next = match backend.kind() {
        BackendKind::Vllm => {
            let Some(body) = get("/metrics").await else {
                return;
            };
            let samples = prom::parse(&String::from_utf8_lossy(&body));
            if let Some(c) = super::timings::Counters::from_vllm(&samples, unix_seconds()) {
                backend.state.timings().observe(c);
            }
            backend.state.adapters().observe_metrics(&samples);
            vllm_signals(&samples)
        }
        BackendKind::Tgi => {
            let Some(body) = get("/metrics").await else {
                return;
            };
            let samples = prom::parse(&String::from_utf8_lossy(&body));
            if let Some(c) = super::timings::Counters::from_tgi(&samples, unix_seconds()) {
                backend.state.timings().observe(c);
            }
            let mut s = tgi_signals(&samples);
            if monotonic_ms().saturating_sub(*last_info_ms) >= INFO_EVERY_MS || *last_info_ms == 0 {
                if let Some((mc, mt)) = get("/info").await.as_deref().and_then(parse_tgi_info) {
                    s.max_concurrent = mc;
                    s.max_total_tokens = mt;
                    *last_info_ms = monotonic_ms().max(1);
                }
            }
            s
        }
        BackendKind::Ollama => {
            let Some(body) = get("/api/ps").await else {
                return;
            };
            let Some(loaded) = parse_ollama_ps(&body) else {
                return;
            };
            backend
                .state
                .add_context_lengths(parse_ollama_context(&body));
            Signals {
                loaded: Some(loaded),
                ..Signals::default()
            }
        }
        BackendKind::OpenAi => return,
    };
    let prev = backend.state.signals();
    let mut next = merge(&prev, next);
    next.at_ms = monotonic_ms().max(1);
    next.interval_ms = interval_ms;
    if let Some(t) = next.total {
        backend.state.set_engine_waiting(t.waiting.max(0.0) as u64);
    }
    backend_signals(backend.name(), &next);
    backend.state.set_signals(next);
}

fn unix_seconds() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The signals loop of one backend: runs beside its health probe, forever.
pub async fn run(backend: Arc<Backend>, cfg: HealthConfig) {
    if backend.kind() == BackendKind::OpenAi || cfg.signals_interval.is_zero() {
        return;
    }
    let mut last_info_ms = 0u64;
    loop {
        if backend.state.health().routable() {
            refresh(&backend, &cfg, &mut last_info_ms).await;
        }
        let interval = cfg.signals_interval.max(Duration::from_millis(10));
        tokio::time::sleep(until_next_scrape(unix_ms(), interval, backend.name())).await;
    }
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// The wait until a backend's next scrape: the next instant of the wall clock at `offset`
/// past a multiple of `interval`, the offset drawn from the backend's name. Every gateway
/// replica then reads an engine at the same instants (as far as their clocks agree) and routes
/// on the same readings; the backends of one gateway are read at instants spread over the
/// interval, not all at once.
fn until_next_scrape(now_ms: u64, interval: Duration, name: &str) -> Duration {
    let every = u64::try_from(interval.as_millis())
        .unwrap_or(u64::MAX)
        .max(1);
    let mut h = crate::openai::request::Fnv64::new();
    h.write(name.as_bytes());
    let offset = h.finish() % every;
    let since = (now_ms % every + every - offset) % every;
    Duration::from_millis(every - since)
}

/// Publish a backend's freshly read engine signals.
pub fn backend_signals(backend: &str, s: &Signals) {
    if let Some(t) = s.total {
        metrics::gauge!(m::BACKEND_QUEUE_DEPTH, "backend" => backend.to_string()).set(t.waiting);
        metrics::gauge!(m::BACKEND_RUNNING, "backend" => backend.to_string()).set(t.running);
        if let Some(kv) = t.kv_usage {
            metrics::gauge!(m::BACKEND_KV_CACHE_USAGE, "backend" => backend.to_string()).set(kv);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scrapes_fall_on_the_same_wall_clock_instants_for_every_replica() {
        let second = Duration::from_secs(1);
        // two replicas whose loops woke at different moments wait for the same instant
        let a = 1_000_000 + until_next_scrape(1_000_000, second, "gpu-a").as_millis() as u64;
        let b = 1_000_731 + until_next_scrape(1_000_731, second, "gpu-a").as_millis() as u64;
        assert!(a == b || a.abs_diff(b) == 1_000, "{a} {b}");
        // never zero, never more than the interval
        for now in [0, 1, 999, 1_000, 123_456_789] {
            let wait = until_next_scrape(now, second, "gpu-a");
            assert!(wait > Duration::ZERO && wait <= second, "{wait:?}");
        }
        // another backend at another instant of the interval
        let c = until_next_scrape(1_000_000, second, "gpu-b");
        assert_ne!(c, until_next_scrape(1_000_000, second, "gpu-a"));
    }

    #[test]
    fn vllm_sums_engines_per_model_and_falls_back_to_gpu_cache() {
        let text = "vllm:num_requests_running{engine=\"0\",model_name=\"a\"} 3\n\
            vllm:num_requests_running{engine=\"1\",model_name=\"a\"} 2\n\
            vllm:num_requests_waiting{engine=\"0\",model_name=\"a\"} 4\n\
            vllm:num_requests_waiting{engine=\"1\",model_name=\"a\"} 1\n\
            vllm:num_requests_waiting_by_reason{engine=\"0\",model_name=\"a\",reason=\"capacity\"} 99\n\
            vllm:gpu_cache_usage_perc{engine=\"0\",model_name=\"a\"} 0.5\n\
            vllm:gpu_cache_usage_perc{engine=\"1\",model_name=\"a\"} 0.7\n\
            vllm:num_requests_running{engine=\"0\",model_name=\"b\"} 1\n\
            vllm:num_requests_waiting{engine=\"0\",model_name=\"b\"} NaN\n\
            vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"b\"} 0.1\n\
            vllm:gpu_cache_usage_perc{engine=\"0\",model_name=\"b\"} 0.9\n";
        let s = parse_vllm(text);
        let a = s.load_for("a").unwrap();
        assert_eq!((a.running, a.waiting), (5.0, 5.0));
        assert!((a.kv_usage.unwrap() - 0.6).abs() < 1e-9);
        let b = s.load_for("b").unwrap();
        assert_eq!((b.running, b.waiting), (1.0, 0.0));
        assert_eq!(b.kv_usage, Some(0.1), "new name preferred over the old");
        let t = s.total.unwrap();
        assert_eq!((t.running, t.waiting), (6.0, 5.0));
        assert_eq!(s.load_for("unknown").unwrap().running, 6.0);
    }

    #[test]
    fn vllm_real_capture() {
        let text = include_str!("../../tests/fixtures/vllm-0.32.0/metrics-under-load.txt");
        let s = parse_vllm(text);
        let l = s.load_for("tiny").unwrap();
        assert_eq!((l.running, l.waiting), (4.0, 12.0));
        assert!((l.kv_usage.unwrap() - 0.2667).abs() < 1e-3);
        assert_eq!(s.prefix_queries, Some(428.0));
        assert_eq!(
            s.kv_capacity_tokens,
            Some(2048),
            "cache_config_info's kv_cache_size_tokens"
        );
        let merged = merge(&Signals::default(), s);
        assert_eq!(merged.learned_slots, Some(4));
        assert_eq!(merged.kv_capacity_tokens, Some(2048));
    }

    #[test]
    fn tgi_metrics_info_and_ollama_ps() {
        let s = parse_tgi(
            "# TYPE tgi_queue_size gauge\ntgi_queue_size 7\ntgi_batch_current_size 4\ntgi_batch_current_max_tokens 9000\n",
        );
        let t = s.total.unwrap();
        assert_eq!((t.running, t.waiting), (4.0, 7.0));
        assert_eq!(s.batch_max_tokens, Some(9000.0));
        assert_eq!(
            parse_tgi_info(
                br#"{"model_id":"x","max_concurrent_requests":128,"max_total_tokens":4096}"#
            ),
            Some((Some(128), Some(4096)))
        );
        let loaded = parse_ollama_ps(
            br#"{"models":[{"name":"llama3.2:latest","model":"llama3.2:latest","size":1}]}"#,
        )
        .unwrap();
        let s = Signals {
            loaded: Some(loaded),
            ..Signals::default()
        };
        assert_eq!(s.is_loaded("llama3.2"), Some(true));
        assert_eq!(s.is_loaded("llama3.2:latest"), Some(true));
        assert_eq!(s.is_loaded("qwen"), Some(false));
        assert_eq!(Signals::default().is_loaded("x"), None);
        assert!(parse_ollama_ps(b"nope").is_none());
        // The loaded runners' windows; a model without one (older Ollama) or garbage: none.
        let ps = br#"{"models":[{"name":"a:latest","context_length":8192},{"name":"b","model":"b"},{"model":"c:7b","context_length":2048}]}"#;
        let ctx = parse_ollama_context(ps);
        assert_eq!(
            ctx.into_iter().collect::<Vec<_>>(),
            [("a:latest".to_string(), 8192), ("c:7b".to_string(), 2048)]
        );
        assert!(parse_ollama_context(b"[]").is_empty());
        assert!(
            parse_ollama_context(br#"{"models":[{"name":"a","context_length":"big"}]}"#).is_empty()
        );
    }

    #[test]
    fn learned_slots_follow_full_batches_and_capacity_carries_over() {
        let prev = Signals {
            max_concurrent: Some(10),
            learned_slots: Some(16),
            ..Signals::default()
        };
        let full = Signals {
            total: Some(ModelLoad {
                running: 8.0,
                waiting: 3.0,
                kv_usage: None,
            }),
            ..Signals::default()
        };
        let m = merge(&prev, full.clone());
        assert_eq!(m.max_concurrent, Some(10));
        assert_eq!(
            m.learned_slots,
            Some(16),
            "one low reading is a slot between steps"
        );
        let m = merge(&merge(&m, full.clone()), full.clone());
        assert_eq!(m.learned_slots, Some(15), "three in a row drift it down");
        let idle = Signals::default();
        assert_eq!(merge(&m, idle).learned_slots, Some(15));
    }

    fn tgi(running: f64, waiting: f64, held: f64) -> Signals {
        let mut s = parse_tgi(&format!(
            "tgi_queue_size {waiting}\ntgi_batch_current_size {running}\ntgi_batch_current_max_tokens {held}\n"
        ));
        s.at_ms = 1;
        s
    }

    #[test]
    fn tgi_kv_usage_is_the_batch_over_a_budget_learned_from_full_batches() {
        // nothing ever waited: no budget, no usage
        let m = merge(&Signals::default(), tgi(3.0, 0.0, 20_000.0));
        assert_eq!(m.learned_kv_tokens, None);
        assert_eq!(m.total.unwrap().kv_usage, None);
        // requests wait beside 6 running that hold 50k tokens: the budget is at least 50k
        let m = merge(&m, tgi(6.0, 2.0, 50_000.0));
        assert_eq!(m.learned_kv_tokens, Some(50_000));
        assert_eq!(m.total.unwrap().kv_usage, Some(1.0));
        // a queue beside a smaller batch (slot-bound, or a step boundary) does not lower it
        let m = merge(&m, tgi(16.0, 1.0, 30_000.0));
        assert_eq!(m.learned_kv_tokens, Some(50_000));
        assert_eq!(m.total.unwrap().kv_usage, Some(0.6));
        // a lone oversized request admitted into an empty batch teaches nothing
        let m = merge(&m, tgi(1.0, 4.0, 90_000.0));
        assert_eq!(m.learned_kv_tokens, Some(50_000));
        assert_eq!(m.total.unwrap().kv_usage, Some(1.0));
        // the budget carries over and keeps pricing the batch once the queue is gone
        let m = merge(&m, tgi(2.0, 0.0, 12_500.0));
        assert_eq!(m.total.unwrap().kv_usage, Some(0.25));
        assert_eq!(m.load_for("any").unwrap().kv_usage, Some(0.25));
    }
}
