//! One serialisable snapshot of a backend: its config and its live state.
//!
//! [`BackendView`] is what operations surfaces read: `/admin/backends` serialises it (its field
//! names are that endpoint's), the dashboard summary and the per-backend metrics gauges take
//! their values from it. The snapshot is consistent enough, not atomic: the health bookkeeping is
//! read under one lock, each counter with one load.

use std::time::Duration;

use serde::Serialize;

use super::backend::{monotonic_ms, Backend, Health};

/// A backend as `/admin/backends` shows it (fields in that endpoint's order). Fields marked
/// `skip` are read by the other surfaces only (the pending prefills appear in `/admin/backends`
/// under `routing`).
#[derive(Debug, Clone, Serialize)]
pub struct BackendView {
    pub name: String,
    pub kind: &'static str,
    pub url: String,
    /// [`Health::as_str`] of [`Self::health`].
    pub state: &'static str,
    pub models: Vec<String>,
    pub inflight_requests: u64,
    pub inflight_tokens: u64,
    pub requests_total: u64,
    pub failures_total: u64,
    /// Live-traffic failures in a row.
    pub consecutive_failures: u32,
    pub ejections: u32,
    pub ejected_for_ms: u64,
    pub skipped_for_ms: u64,
    pub last_error: Option<String>,
    pub weight: u32,
    /// [`Backend::cap`].
    pub max_concurrent: Option<u64>,
    pub slow_start_share: f64,
    pub engine_waiting: u64,
    pub ever_healthy: bool,
    pub probe_ok_streak: u32,
    pub probe_fail_streak: u32,
    pub busy_streak: u32,
    pub state_for_ms: u64,
    pub last_probe_ms_ago: Option<u64>,
    /// Context window per model, by the backend's model name, as the engine reported it
    /// (vLLM `max_model_len`, TGI `max_total_tokens`, Ollama's loaded `context_length`).
    pub context_lengths: std::collections::BTreeMap<String, u64>,
    /// What its KV-cache events tell (vLLM; `status: "off"` for the rest).
    pub kv_cache: super::kv::KvView,
    /// The LoRA adapters it holds, its adapter slots and its learned load time.
    pub adapters: AdaptersView,
    #[serde(skip)]
    pub health: Health,
    #[serde(skip)]
    pub draining: bool,
    #[serde(skip)]
    pub pending_prefill_requests: u64,
    #[serde(skip)]
    pub pending_prefill_tokens: u64,
}

/// A backend's LoRA adapters as the operations surfaces show them.
#[derive(Debug, Clone, serde::Serialize)]
pub struct AdaptersView {
    pub held: Vec<super::adapters::HeldView>,
    /// The engine's adapter slots (`max_lora`), when reported.
    pub max_lora: Option<u32>,
    /// The learned time of a load there, when one was measured.
    pub load_seconds: Option<f64>,
}

impl Backend {
    /// A snapshot of this backend; `slow_start` is the snapshot's `health.slow_start`.
    pub fn view(&self, slow_start: Duration) -> BackendView {
        let s = &self.state;
        let now = monotonic_ms();
        let health = s.health();
        let t = s.track();
        BackendView {
            name: self.name().to_string(),
            kind: self.kind().as_str(),
            url: self.config.url.to_string(),
            state: health.as_str(),
            models: self.model_names(),
            inflight_requests: s.inflight_requests(),
            inflight_tokens: s.inflight_tokens(),
            requests_total: s.requests_total(),
            failures_total: s.failures_total(),
            consecutive_failures: t.live_fail_streak,
            ejections: t.ejections,
            ejected_for_ms: t.ejected_until_ms.saturating_sub(now),
            skipped_for_ms: s.skip_until_ms().saturating_sub(now),
            last_error: t.last_error.clone(),
            weight: self.config.weight,
            max_concurrent: self.cap(),
            slow_start_share: s.slow_start_share(slow_start),
            engine_waiting: s.engine_waiting(),
            ever_healthy: t.ever_healthy,
            probe_ok_streak: t.probe_ok_streak,
            probe_fail_streak: t.probe_fail_streak,
            busy_streak: t.busy_streak,
            state_for_ms: now.saturating_sub(t.last_change_ms),
            last_probe_ms_ago: (t.last_probe_ms > 0).then(|| now.saturating_sub(t.last_probe_ms)),
            context_lengths: (*s.context_lengths()).clone(),
            kv_cache: s.kv().view(),
            adapters: AdaptersView {
                held: s.adapters().view(),
                max_lora: s.adapters().max_lora(),
                load_seconds: s.adapters().load_seconds(),
            },
            health,
            draining: s.is_draining(),
            pending_prefill_requests: s.pending_prefill_requests(),
            pending_prefill_tokens: s.pending_prefill_tokens(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::config::{BackendConfig, BackendKind, Timeouts};
    use crate::fleet::{BackendState, Load, LoadGuard};

    fn backend() -> Backend {
        let cfg = BackendConfig {
            name: "b0".into(),
            kind: BackendKind::Vllm,
            url: "http://127.0.0.1:1".parse().unwrap(),
            models: vec!["m".into()],
            model_names: Default::default(),
            api_key: None,
            weight: 3,
            max_concurrent: Some(8),
            health_path: None,
            kv_events: Default::default(),
            max_adapters: None,
            lora_adapters: Vec::new(),
            timeouts: Timeouts::default(),
        };
        Backend::new(cfg, Arc::new(BackendState::new()))
    }

    /// The names `/admin/backends` has always shown for a backend's own fields.
    const ADMIN_FIELDS: [&str; 27] = [
        "name",
        "kind",
        "url",
        "state",
        "models",
        "inflight_requests",
        "inflight_tokens",
        "requests_total",
        "failures_total",
        "consecutive_failures",
        "ejections",
        "ejected_for_ms",
        "skipped_for_ms",
        "last_error",
        "weight",
        "max_concurrent",
        "slow_start_share",
        "engine_waiting",
        "ever_healthy",
        "probe_ok_streak",
        "probe_fail_streak",
        "busy_streak",
        "state_for_ms",
        "last_probe_ms_ago",
        "context_lengths",
        "kv_cache",
        "adapters",
    ];

    #[test]
    fn the_view_serialises_the_admin_field_names_and_values() {
        let b = backend();
        let _g = LoadGuard::new(b.state.clone(), Load::new(100, 40));
        b.state.count_request();
        b.state.set_engine_waiting(5);
        b.state.record_busy(None);
        b.state
            .set_context_lengths([("m".to_string(), 4096)].into());
        let v = serde_json::to_value(b.view(Duration::ZERO)).unwrap();
        assert_eq!(v["context_lengths"], serde_json::json!({"m": 4096}));
        let obj = v.as_object().unwrap();
        let mut names: Vec<&str> = obj.keys().map(String::as_str).collect();
        let mut want = ADMIN_FIELDS.to_vec();
        names.sort_unstable();
        want.sort_unstable();
        assert_eq!(names, want);
        assert_eq!(v["name"], "b0");
        assert_eq!(v["kind"], "vllm");
        assert_eq!(v["url"], b.config.url.to_string());
        assert_eq!(v["state"], "overloaded");
        assert_eq!(v["models"], serde_json::json!(["m"]));
        assert_eq!(v["inflight_requests"], 1);
        assert_eq!(v["inflight_tokens"], 100);
        assert_eq!(v["requests_total"], 1);
        assert_eq!(v["failures_total"], 0);
        assert_eq!(v["busy_streak"], 1);
        assert_eq!(v["last_error"], "busy");
        assert_eq!(v["weight"], 3);
        assert_eq!(v["max_concurrent"], 8);
        assert_eq!(v["slow_start_share"], 1.0);
        assert_eq!(v["engine_waiting"], 5);
        assert_eq!(v["last_probe_ms_ago"], serde_json::Value::Null);
        assert!(v["skipped_for_ms"].as_u64().is_some_and(|ms| ms <= 250));
        assert_eq!(v["kv_cache"]["status"], "off");
        b.state.kv().record_prediction(128, 128);
        b.state.kv().record_prediction(0, 128);
        let v = serde_json::to_value(b.view(Duration::ZERO)).unwrap();
        assert_eq!(
            (
                &v["kv_cache"]["predictions"],
                &v["kv_cache"]["predictions_exact"]
            ),
            (&serde_json::json!(2), &serde_json::json!(1))
        );
        assert_eq!(v["kv_cache"]["reported_tokens"], 256);
    }

    #[test]
    fn the_view_carries_what_the_metrics_read() {
        let b = backend();
        let _g = LoadGuard::new(b.state.clone(), Load::new(100, 40));
        b.state.start_draining();
        let v = b.view(Duration::ZERO);
        assert_eq!(v.health, Health::Draining);
        assert_eq!(v.state, "draining");
        assert!(v.draining);
        assert_eq!(
            (v.pending_prefill_requests, v.pending_prefill_tokens),
            (1, 40)
        );
    }
}
