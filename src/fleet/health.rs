//! Active health probes, one task per backend, each engine probed its own way:
//! vLLM `GET /health` (+ `/v1/models` for discovery), TGI `GET /health` (+ `/info`), Ollama
//! `GET /` (+ `/api/tags`), OpenAI-compatible `GET /v1/models` (or the configured path).
//!
//! Probes never run inference, so they are never billed. Transitions use hysteresis: a backend
//! goes down after `unhealthy_threshold` failed probes in a row and comes back after
//! `healthy_threshold` passes (and, if it was ejected by live traffic, not before its ejection
//! time). A backend that refuses connections and has never been healthy is `starting`.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use rand::Rng;
use serde::Deserialize;
use tokio::task::JoinHandle;

use super::backend::{now_ms, Health};
use super::{Backend, Fleet};
use crate::config::{BackendKind, HealthConfig};

/// Largest probe response read (model lists can be long, but not this long).
const MAX_PROBE_BODY: usize = 4 * 1024 * 1024;
/// Re-read the model list this often once it is known.
const DISCOVERY_EVERY: Duration = Duration::from_secs(10);

/// How one probe went.
#[derive(Debug)]
pub enum ProbeOutcome {
    Ok { models: Option<Vec<String>> },
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
                Some((old, handle)) if old.config == b.config => {
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
    tokio::spawn(async move {
        let mut last_discovery: Option<u64> = None;
        loop {
            let discover = !backend.models_configured()
                && last_discovery.is_none_or(|t| now_ms().saturating_sub(t) >= DISCOVERY_EVERY.as_millis() as u64);
            let outcome = probe(&backend, cfg.timeout, discover).await;
            if let ProbeOutcome::Ok { models: Some(models) } = &outcome {
                let map = backend.discovered_map(models);
                backend.state.discovered.store(Arc::new(map));
                last_discovery = Some(now_ms());
            }
            apply(&backend, &cfg, &outcome);
            let jitter = rand::rng().random_range(0.9..1.1);
            tokio::time::sleep(cfg.interval.mul_f64(jitter)).await;
        }
    })
}

/// Update a backend's health from a probe outcome.
pub fn apply(backend: &Backend, cfg: &HealthConfig, outcome: &ProbeOutcome) {
    let state = &backend.state;
    let current = state.health();
    let mut t = state.track();
    let now = now_ms();
    let next = match outcome {
        ProbeOutcome::Ok { .. } => {
            t.probe_ok_streak = t.probe_ok_streak.saturating_add(1);
            t.probe_fail_streak = 0;
            match current {
                Health::Healthy | Health::Draining => current,
                Health::Unknown => Health::Healthy,
                Health::Ejected if now < t.ejected_until_ms => Health::Ejected,
                _ if t.probe_ok_streak >= cfg.healthy_threshold => Health::Healthy,
                _ => current,
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
    }
    if next != current {
        t.last_change_ms = now;
        drop(t);
        state.set_health(next);
        tracing::info!(backend = backend.name(), from = current.as_str(), to = next.as_str(), "backend state changed");
    }
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
            backend.config.health_path.as_deref().unwrap_or("/v1/models"),
            "/v1/models",
        ),
    };
    let body = match get(backend, health_path).await {
        Ok((status, body)) if status.is_success() => body,
        Ok((status, _)) => return ProbeOutcome::Unhealthy(format!("{health_path} answered {status}")),
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
    match parse_models(backend.kind(), models_path, &body) {
        Some(models) => ProbeOutcome::Ok {
            models: Some(models),
        },
        None => ProbeOutcome::Unhealthy(format!("{models_path} returned an unreadable model list")),
    }
}

async fn get(backend: &Backend, path: &str) -> Result<(StatusCode, Bytes), ProbeOutcome> {
    let uri = backend
        .url_for(path)
        .map_err(|e| ProbeOutcome::Unhealthy(format!("bad probe URL: {e}")))?;
    let mut req = Request::builder().method(Method::GET).uri(uri);
    if let Some(key) = &backend.config.api_key {
        req = req.header(http::header::AUTHORIZATION, format!("Bearer {key}"));
    }
    let req = req
        .body(Full::new(Bytes::new()))
        .map_err(|e| ProbeOutcome::Unhealthy(format!("bad probe request: {e}")))?;
    let resp = backend
        .client
        .request(req)
        .await
        .map_err(|e| ProbeOutcome::Refused(format!("{path}: {}", crate::proxy::forward::describe_client_error(&e))))?;
    let status = resp.status();
    let body = Limited::new(resp.into_body(), MAX_PROBE_BODY)
        .collect()
        .await
        .map_err(|e| ProbeOutcome::Unhealthy(format!("{path}: body: {e}")))?
        .to_bytes();
    Ok((status, body))
}

#[derive(Deserialize)]
struct OpenAiModels {
    data: Vec<OpenAiModel>,
}
#[derive(Deserialize)]
struct OpenAiModel {
    id: String,
}
#[derive(Deserialize)]
struct TgiInfo {
    model_id: String,
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
        (BackendKind::Ollama, "/api/tags") => {
            let tags: OllamaTags = serde_json::from_slice(body).ok()?;
            Some(tags.models.into_iter().map(|m| m.name).collect())
        }
        _ => {
            let list: OpenAiModels = serde_json::from_slice(body).ok()?;
            Some(list.data.into_iter().map(|m| m.id).collect())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_each_kind_of_model_list() {
        let vllm = br#"{"object":"list","data":[{"id":"tiny","object":"model","owned_by":"vllm","max_model_len":1024}]}"#;
        assert_eq!(parse_models(BackendKind::Vllm, "/v1/models", vllm).unwrap(), vec!["tiny"]);
        let tgi = br#"{"model_id":"bigscience/bloom-560m","max_concurrent_requests":128}"#;
        assert_eq!(parse_models(BackendKind::Tgi, "/info", tgi).unwrap(), vec!["bigscience/bloom-560m"]);
        let ollama = br#"{"models":[{"name":"llama3.2:latest","model":"llama3.2:latest"}]}"#;
        assert_eq!(parse_models(BackendKind::Ollama, "/api/tags", ollama).unwrap(), vec!["llama3.2:latest"]);
        assert!(parse_models(BackendKind::Vllm, "/v1/models", b"<html>").is_none());
    }
}
