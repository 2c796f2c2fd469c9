//! Active health probes, one task per backend, each engine probed its own way:
//! vLLM `GET /health` (+ `/v1/models` for discovery), TGI `GET /health` (+ `/info`), Ollama
//! `GET /` (+ `/api/tags`), OpenAI-compatible `GET /v1/models` (or the configured path).
//!
//! Probes never run inference, so they are never billed. Transitions use hysteresis: a backend
//! goes down after `unhealthy_threshold` failed probes in a row and comes back after
//! `healthy_threshold` passes (and, if it was ejected by live traffic, not before its ejection
//! time). A backend that refuses connections and has never been healthy is `starting`.
//!
//! Beyond up/down: TGI's `/info` announces `max_concurrent_requests`, learned as the backend's
//! concurrency cap (unless `max_concurrent` is configured); with `health.overload_waiting` set,
//! vLLM's `/metrics` is read and a queue of that many waiting requests makes it `overloaded`.
//! An `overloaded` backend (busy answer) returns to `healthy` only once its skip time passed.
//! A backend re-admitted after being ejected, down or overloaded by its queue starts a slow
//! start: its share of traffic ramps up over `health.slow_start` (see the router).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, StatusCode};
use rand::Rng;
use serde::Deserialize;
use tokio::task::JoinHandle;

use super::backend::{monotonic_ms, Health};
use super::{Backend, Fleet};
use crate::config::{BackendKind, HealthConfig};

/// Largest probe response read (model lists can be long, but not this long).
const MAX_PROBE_BODY: usize = 4 * 1024 * 1024;
/// Re-read the model list this often once it is known.
const DISCOVERY_EVERY: Duration = Duration::from_secs(10);

/// How one probe went.
#[derive(Debug)]
pub enum ProbeOutcome {
    Ok {
        models: Option<Vec<String>>,
    },
    /// The engine is up but its own queue is past `health.overload_waiting`.
    Busy(u64),
    /// Connection refused or reset before an answer.
    Refused(String),
    /// The engine answered that it is not ready (e.g. 503 while loading).
    Unhealthy(String),
}

/// Runs one probe task per backend of the current fleet.
#[derive(Default)]
pub struct HealthMonitor {
    tasks: HashMap<usize, (Arc<Backend>, JoinHandle<()>)>,
}

impl HealthMonitor {
    /// Start probes for backends new in `fleet`, stop those of backends no longer in it.
    pub fn sync(&mut self, fleet: &Fleet, cfg: &HealthConfig) {
        let mut keep = HashMap::new();
        for b in &fleet.backends {
            let key = Arc::as_ptr(&b.state) as usize;
            match self.tasks.remove(&key) {
                Some((old, handle)) if old.same_setup(b) => {
                    keep.insert(key, (old, handle));
                }
                Some((_, handle)) => {
                    handle.abort();
                    keep.insert(key, (b.clone(), spawn_probe(b.clone(), cfg.clone())));
                }
                None => {
                    keep.insert(key, (b.clone(), spawn_probe(b.clone(), cfg.clone())));
                }
            }
        }
        for (_, (_, handle)) in self.tasks.drain() {
            handle.abort();
        }
        self.tasks = keep;
    }
}

impl Drop for HealthMonitor {
    fn drop(&mut self) {
        for (_, (_, handle)) in self.tasks.drain() {
            handle.abort();
        }
    }
}

fn spawn_probe(backend: Arc<Backend>, cfg: HealthConfig) -> JoinHandle<()> {
    // The engine's load signals are read by a loop of their own cadence in the same task, so
    // aborting the task stops both.
    // So does the KV-event subscription (vLLM only; it returns at once for other kinds).
    let signals = super::signals::run(backend.clone(), cfg.clone());
    let kv = super::kv::subscribe::run(backend.clone());
    let probe = probe_loop(backend, cfg);
    tokio::spawn(async move {
        tokio::join!(probe, signals, kv);
    })
}

async fn probe_loop(backend: Arc<Backend>, cfg: HealthConfig) {
    {
        let mut last_discovery: Option<u64> = None;
        let mut last_context: Option<u64> = None;
        loop {
            // TGI's /info also carries its concurrency limit, so it is read even when the
            // models are configured.
            let discover = (!backend.models_configured() || backend.kind() == BackendKind::Tgi)
                && last_discovery.is_none_or(|t| {
                    monotonic_ms().saturating_sub(t) >= DISCOVERY_EVERY.as_millis() as u64
                });
            let mut outcome = probe(&backend, cfg.timeout, discover).await;
            if let ProbeOutcome::Ok {
                models: Some(models),
            } = &outcome
            {
                if !backend.models_configured() {
                    let map = backend.discovered_map(models);
                    backend.state.set_discovered(map);
                }
                last_discovery = Some(monotonic_ms());
            }
            if matches!(outcome, ProbeOutcome::Ok { .. }) {
                learn_listing(&backend, &mut last_context).await;
            }
            if matches!(outcome, ProbeOutcome::Ok { .. })
                && backend.kind() == BackendKind::Vllm
                && cfg.overload_waiting > 0
            {
                if let Some(waiting) = scrape_waiting(&backend, cfg.timeout).await {
                    backend.state.set_engine_waiting(waiting);
                    if waiting >= cfg.overload_waiting {
                        outcome = ProbeOutcome::Busy(waiting);
                    }
                }
            }
            crate::telemetry::metrics::probe_result(backend.name(), outcome.label());
            apply(&backend, &cfg, &outcome);
            let jitter = rand::rng().random_range(0.9..1.1);
            tokio::time::sleep(cfg.interval.mul_f64(jitter)).await;
        }
    }
}

/// For a vLLM or OpenAI-compatible backend, read its `/v1/models` at the discovery cadence:
/// the context lengths (when its models are configured, so discovery does not read the list)
/// and, from vLLM, the LoRA adapters it holds. Best effort: a failure says nothing about the
/// backend's health.
async fn learn_listing(backend: &Backend, last: &mut Option<u64>) {
    let vllm = backend.kind() == BackendKind::Vllm;
    let listed = vllm || backend.kind() == BackendKind::OpenAi;
    let due =
        last.is_none_or(|t| monotonic_ms().saturating_sub(t) >= DISCOVERY_EVERY.as_millis() as u64);
    if !(listed && (backend.models_configured() || vllm) && due) {
        return;
    }
    *last = Some(monotonic_ms());
    if let Ok((status, body)) = get(backend, "/v1/models").await {
        if status.is_success() {
            if backend.models_configured() {
                backend
                    .state
                    .set_context_lengths(parse_context_lengths(&body));
            }
            if let Some(adapters) = super::adapters::parse_listed(&body).filter(|_| vllm) {
                backend.state.adapters().set_listed(adapters);
            }
        }
    }
}

/// Update a backend's health from a probe outcome.
pub fn apply(backend: &Backend, cfg: &HealthConfig, outcome: &ProbeOutcome) {
    let state = &backend.state;
    let current = state.health();
    let mut t = state.track();
    let now = monotonic_ms();
    t.last_probe_ms = now;
    let next = match outcome {
        ProbeOutcome::Ok { .. } => {
            t.probe_ok_streak = t.probe_ok_streak.saturating_add(1);
            t.probe_fail_streak = 0;
            match current {
                Health::Healthy | Health::Draining => current,
                Health::Unknown => Health::Healthy,
                Health::Ejected if now < t.ejected_until_ms => Health::Ejected,
                Health::Overloaded if now < state.skip_until_ms() => Health::Overloaded,
                _ if t.probe_ok_streak >= cfg.healthy_threshold => Health::Healthy,
                _ => current,
            }
        }
        ProbeOutcome::Busy(waiting) => {
            t.probe_ok_streak = 0;
            t.probe_fail_streak = 0;
            t.last_error = Some(format!("{waiting} requests waiting in the engine"));
            match current {
                Health::Draining | Health::Ejected | Health::Starting | Health::Down => current,
                _ => Health::Overloaded,
            }
        }
        ProbeOutcome::Refused(why) | ProbeOutcome::Unhealthy(why) => {
            t.probe_fail_streak = t.probe_fail_streak.saturating_add(1);
            t.probe_ok_streak = 0;
            t.last_error = Some(why.clone());
            let refused = matches!(outcome, ProbeOutcome::Refused(_));
            match current {
                Health::Draining => current,
                _ if refused && !t.ever_healthy => Health::Starting,
                Health::Unknown => Health::Down,
                Health::Ejected => Health::Ejected,
                _ if t.probe_fail_streak >= cfg.unhealthy_threshold => Health::Down,
                _ => current,
            }
        }
    };
    if next == Health::Healthy {
        t.ever_healthy = true;
        t.live_fail_streak = 0;
        // Re-admission (not the first sight, not the end of a short busy skip): slow start.
        if matches!(current, Health::Ejected | Health::Down | Health::Loading)
            || (current == Health::Starting && t.ejections > 0)
        {
            state.record_admission(now);
        }
    }
    if next != current {
        t.last_change_ms = now;
        drop(t);
        state.set_health(next);
        tracing::info!(
            backend = backend.name(),
            from = current.as_str(),
            to = next.as_str(),
            "backend state changed"
        );
    }
}

impl ProbeOutcome {
    /// Low-cardinality label for metrics.
    pub fn label(&self) -> &'static str {
        match self {
            ProbeOutcome::Ok { .. } => "ok",
            ProbeOutcome::Busy(_) => "busy",
            ProbeOutcome::Refused(_) => "refused",
            ProbeOutcome::Unhealthy(_) => "unhealthy",
        }
    }
}

/// vLLM's `vllm:num_requests_waiting` (summed over models) from `/metrics`.
async fn scrape_waiting(backend: &Backend, timeout: Duration) -> Option<u64> {
    let (status, body) = tokio::time::timeout(timeout, get(backend, "/metrics"))
        .await
        .ok()?
        .ok()?;
    if !status.is_success() {
        return None;
    }
    parse_waiting(&body)
}

/// Sum of the `vllm:num_requests_waiting` samples of a Prometheus text exposition.
pub fn parse_waiting(body: &[u8]) -> Option<u64> {
    let text = std::str::from_utf8(body).ok()?;
    let mut found = false;
    let mut sum = 0f64;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("vllm:num_requests_waiting") else {
            continue;
        };
        if !(rest.starts_with('{') || rest.starts_with(' ')) {
            continue; // e.g. vllm:num_requests_waiting_by_reason
        }
        if let Some(v) = rest.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) {
            if v.is_finite() && v >= 0.0 {
                sum += v;
                found = true;
            }
        }
    }
    found.then_some(sum as u64)
}

/// Probe one backend the way its kind expects.
pub async fn probe(backend: &Backend, timeout: Duration, discover: bool) -> ProbeOutcome {
    match tokio::time::timeout(timeout, probe_inner(backend, discover)).await {
        Ok(outcome) => outcome,
        Err(_) => ProbeOutcome::Unhealthy(format!("probe timed out after {timeout:?}")),
    }
}

async fn probe_inner(backend: &Backend, discover: bool) -> ProbeOutcome {
    let (health_path, models_path) = match backend.kind() {
        BackendKind::Vllm => ("/health", "/v1/models"),
        BackendKind::Tgi => ("/health", "/info"),
        BackendKind::Ollama => ("/", "/api/tags"),
        BackendKind::OpenAi => (
            backend
                .config
                .health_path
                .as_deref()
                .unwrap_or("/v1/models"),
            "/v1/models",
        ),
    };
    let body = match get(backend, health_path).await {
        Ok((status, body)) if status.is_success() => body,
        Ok((status, _)) => {
            return ProbeOutcome::Unhealthy(format!("{health_path} answered {status}"))
        }
        Err(e) => return e,
    };
    if !discover {
        return ProbeOutcome::Ok { models: None };
    }
    let body = if health_path == models_path {
        body
    } else {
        match get(backend, models_path).await {
            Ok((status, body)) if status.is_success() => body,
            Ok((status, _)) => {
                return ProbeOutcome::Unhealthy(format!("{models_path} answered {status}"))
            }
            Err(e) => return e,
        }
    };
    if backend.kind() == BackendKind::Tgi {
        if let Some(n) = parse_tgi_limit(&body) {
            backend.state.set_learned_max_concurrent(n);
        }
        backend.state.set_context_lengths(parse_tgi_context(&body));
    }
    if models_path == "/v1/models" {
        backend
            .state
            .set_context_lengths(parse_context_lengths(&body));
    }
    match parse_models(backend.kind(), models_path, &body) {
        Some(models) => ProbeOutcome::Ok {
            models: Some(models),
        },
        None => ProbeOutcome::Unhealthy(format!("{models_path} returned an unreadable model list")),
    }
}

pub(crate) async fn get(
    backend: &Backend,
    path: &str,
) -> Result<(StatusCode, Bytes), ProbeOutcome> {
    use super::backend::CallError;
    backend
        .call(Method::GET, path, None, MAX_PROBE_BODY)
        .await
        .map_err(|e| match e {
            CallError::Url(e) => ProbeOutcome::Unhealthy(format!("bad probe URL: {e}")),
            CallError::Request(e) => ProbeOutcome::Unhealthy(format!("bad probe request: {e}")),
            CallError::Transport(e) => ProbeOutcome::Refused(format!("{path}: {e}")),
            CallError::Body(e) => ProbeOutcome::Unhealthy(format!("{path}: body: {e}")),
        })
}

#[derive(Deserialize)]
struct OpenAiModels {
    data: Vec<OpenAiModel>,
}
#[derive(Deserialize)]
struct OpenAiModel {
    id: String,
    /// Set on a LoRA adapter (its base): adapters are not models of their own here.
    #[serde(default)]
    parent: Option<String>,
}
#[derive(Deserialize)]
struct ContextModels {
    data: Vec<ContextModel>,
}
#[derive(Deserialize)]
struct ContextModel {
    id: String,
    #[serde(default)]
    max_model_len: Option<u64>,
}

/// The context length of each model of an OpenAI-shaped model list that reports one (vLLM's
/// `max_model_len`); empty for any other body.
pub fn parse_context_lengths(body: &[u8]) -> std::collections::BTreeMap<String, u64> {
    let Ok(list) = serde_json::from_slice::<ContextModels>(body) else {
        return Default::default();
    };
    list.data
        .into_iter()
        .filter_map(|m| Some((m.id, m.max_model_len.filter(|n| *n > 0)?)))
        .collect()
}

#[derive(Deserialize)]
struct TgiInfo {
    model_id: String,
}

#[derive(Deserialize)]
struct TgiLimits {
    max_concurrent_requests: Option<u64>,
}

#[derive(Deserialize)]
struct TgiContext {
    model_id: String,
    max_total_tokens: Option<u64>,
}

/// TGI's context window from its `/info`: `max_total_tokens` (prompt plus new tokens) for its
/// `model_id`; empty when it reports none.
pub fn parse_tgi_context(body: &[u8]) -> std::collections::BTreeMap<String, u64> {
    serde_json::from_slice::<TgiContext>(body)
        .ok()
        .and_then(|i| Some((i.model_id, i.max_total_tokens.filter(|n| *n > 0)?)))
        .into_iter()
        .collect()
}

/// TGI's announced concurrency limit from its `/info`.
pub fn parse_tgi_limit(body: &[u8]) -> Option<u64> {
    serde_json::from_slice::<TgiLimits>(body)
        .ok()?
        .max_concurrent_requests
        .filter(|n| *n > 0)
}
#[derive(Deserialize)]
struct OllamaTags {
    models: Vec<OllamaTag>,
}
#[derive(Deserialize)]
struct OllamaTag {
    name: String,
}

/// Read the model names out of a backend's model list.
pub fn parse_models(kind: BackendKind, path: &str, body: &[u8]) -> Option<Vec<String>> {
    match (kind, path) {
        (BackendKind::Tgi, "/info") => {
            let info: TgiInfo = serde_json::from_slice(body).ok()?;
            Some(vec![info.model_id])
        }
        (BackendKind::Tgi, _) => None,
        (BackendKind::Ollama, "/api/tags") => {
            let tags: OllamaTags = serde_json::from_slice(body).ok()?;
            Some(tags.models.into_iter().map(|m| m.name).collect())
        }
        _ => {
            let list: OpenAiModels = serde_json::from_slice(body).ok()?;
            Some(
                list.data
                    .into_iter()
                    .filter(|m| m.parent.is_none())
                    .map(|m| m.id)
                    .collect(),
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_each_kind_of_model_list() {
        let vllm = br#"{"object":"list","data":[{"id":"tiny","object":"model","owned_by":"vllm","max_model_len":1024}]}"#;
        assert_eq!(
            parse_models(BackendKind::Vllm, "/v1/models", vllm).unwrap(),
            vec!["tiny"]
        );
        let tgi = br#"{"model_id":"bigscience/bloom-560m","max_concurrent_requests":128}"#;
        assert_eq!(
            parse_models(BackendKind::Tgi, "/info", tgi).unwrap(),
            vec!["bigscience/bloom-560m"]
        );
        let ollama = br#"{"models":[{"name":"llama3.2:latest","model":"llama3.2:latest"}]}"#;
        assert_eq!(
            parse_models(BackendKind::Ollama, "/api/tags", ollama).unwrap(),
            vec!["llama3.2:latest"]
        );
        assert!(parse_models(BackendKind::Vllm, "/v1/models", b"<html>").is_none());
        let lengths = parse_context_lengths(vllm);
        assert_eq!(lengths.get("tiny"), Some(&1024));
        assert!(parse_context_lengths(br#"{"data":[{"id":"x"}]}"#).is_empty());
        assert!(parse_context_lengths(tgi).is_empty());
        assert_eq!(parse_tgi_limit(tgi), Some(128));
        // TGI's window: max_total_tokens of its model_id; nothing when absent, zero or garbled.
        let info = br#"{"model_id":"m","max_input_tokens":4095,"max_total_tokens":4096}"#;
        assert_eq!(parse_tgi_context(info).get("m"), Some(&4096));
        assert!(parse_tgi_context(tgi).is_empty());
        assert!(parse_tgi_context(br#"{"model_id":"m","max_total_tokens":0}"#).is_empty());
        assert!(parse_tgi_context(br#"{"model_id":"m","max_total_tokens":-5}"#).is_empty());
        assert!(parse_tgi_context(b"{").is_empty());
    }

    #[test]
    fn reads_vllm_waiting_queue() {
        let text = b"# HELP vllm:num_requests_waiting x\n# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 12.0\nvllm:num_requests_waiting_by_reason{reason=\"capacity\"} 99.0\nvllm:num_requests_running{model_name=\"m\"} 3.0\n";
        assert_eq!(parse_waiting(text), Some(12));
        assert_eq!(parse_waiting(b"other 1\n"), None);
    }
}
