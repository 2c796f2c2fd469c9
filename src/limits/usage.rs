//! Usage accounting: requests, prompt and completion tokens per key, tenant, model and backend,
//! taken from the backends' own usage reports (on streams, from the usage chunk Sluice asks for
//! upstream). Lives in [`super::Limits`], so it survives config reloads; exported as metrics
//! (names in [`crate::telemetry::metrics`]) and as JSON at `GET /admin/usage`.
//!
//! Only configured names are recorded (key name, tenant name, canonical model, backend name),
//! never a key or any request content.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use metrics::Counter;
use serde::Serialize;

use crate::openai::usage::Usage;
use crate::telemetry::handles::LabelCache;
use crate::telemetry::metrics as m;

/// The totals of one row (key, tenant, model, backend) and its metric handles.
struct Counters {
    requests: AtomicU64,
    prompt_tokens: AtomicU64,
    completion_tokens: AtomicU64,
    requests_metric: Counter,
    prompt_tokens_metric: Counter,
    completion_tokens_metric: Counter,
}

impl Counters {
    fn new(labels: [&str; 4]) -> Counters {
        let labels = [
            ("key", labels[0].to_string()),
            ("tenant", labels[1].to_string()),
            ("model", labels[2].to_string()),
            ("backend", labels[3].to_string()),
        ];
        Counters {
            requests: AtomicU64::new(0),
            prompt_tokens: AtomicU64::new(0),
            completion_tokens: AtomicU64::new(0),
            requests_metric: metrics::counter!(m::USAGE_REQUESTS_TOTAL, &labels),
            prompt_tokens_metric: metrics::counter!(m::USAGE_PROMPT_TOKENS_TOTAL, &labels),
            completion_tokens_metric: metrics::counter!(m::USAGE_COMPLETION_TOKENS_TOTAL, &labels),
        }
    }
}

/// Totals of one row or one group.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq, Eq)]
pub struct Totals {
    pub requests: u64,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub total_tokens: u64,
}

impl Totals {
    fn add(&mut self, o: Totals) {
        self.requests += o.requests;
        self.prompt_tokens += o.prompt_tokens;
        self.completion_tokens += o.completion_tokens;
        self.total_tokens += o.total_tokens;
    }
}

/// One line of the usage report.
#[derive(Debug, Clone, Serialize)]
pub struct UsageRow {
    pub key: String,
    pub tenant: String,
    pub model: String,
    pub backend: String,
    #[serde(flatten)]
    pub totals: Totals,
}

/// The whole report, as `/admin/usage` serves it.
#[derive(Debug, Clone, Serialize)]
pub struct UsageReport {
    pub rows: Vec<UsageRow>,
    pub keys: BTreeMap<String, Totals>,
    pub tenants: BTreeMap<String, Totals>,
    pub models: BTreeMap<String, Totals>,
    pub backends: BTreeMap<String, Totals>,
}

/// Usage counters of this process.
#[derive(Default)]
pub struct UsageBook {
    /// By (key, tenant, model, backend).
    rows: LabelCache<4, Arc<Counters>>,
}

impl std::fmt::Debug for UsageBook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UsageBook").finish_non_exhaustive()
    }
}

impl UsageBook {
    /// Count one answered request and the tokens its backend reported.
    pub fn record(
        &self,
        key: &str,
        tenant: &str,
        model: &str,
        backend: &str,
        usage: Option<Usage>,
    ) {
        let labels = [key, tenant, model, backend];
        let c = self.rows.get(labels, || Arc::new(Counters::new(labels)));
        let u = usage.unwrap_or_default();
        c.requests.fetch_add(1, Ordering::Relaxed);
        c.prompt_tokens
            .fetch_add(u.prompt_tokens, Ordering::Relaxed);
        c.completion_tokens
            .fetch_add(u.completion_tokens, Ordering::Relaxed);
        c.requests_metric.increment(1);
        c.prompt_tokens_metric.increment(u.prompt_tokens);
        c.completion_tokens_metric.increment(u.completion_tokens);
    }

    /// Everything counted so far, by row and grouped.
    pub fn report(&self) -> UsageReport {
        let mut rows: Vec<UsageRow> = self
            .rows
            .snapshot()
            .into_iter()
            .map(|([key, tenant, model, backend], c)| {
                let p = c.prompt_tokens.load(Ordering::Relaxed);
                let q = c.completion_tokens.load(Ordering::Relaxed);
                UsageRow {
                    key,
                    tenant,
                    model,
                    backend,
                    totals: Totals {
                        requests: c.requests.load(Ordering::Relaxed),
                        prompt_tokens: p,
                        completion_tokens: q,
                        total_tokens: p + q,
                    },
                }
            })
            .collect();
        rows.sort_by(|a, b| {
            (&a.tenant, &a.key, &a.model, &a.backend)
                .cmp(&(&b.tenant, &b.key, &b.model, &b.backend))
        });
        let mut report = UsageReport {
            rows: Vec::new(),
            keys: BTreeMap::new(),
            tenants: BTreeMap::new(),
            models: BTreeMap::new(),
            backends: BTreeMap::new(),
        };
        for r in &rows {
            report.keys.entry(r.key.clone()).or_default().add(r.totals);
            report
                .tenants
                .entry(r.tenant.clone())
                .or_default()
                .add(r.totals);
            report
                .models
                .entry(r.model.clone())
                .or_default()
                .add(r.totals);
            report
                .backends
                .entry(r.backend.clone())
                .or_default()
                .add(r.totals);
        }
        report.rows = rows;
        report
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grouped_totals() {
        let b = UsageBook::default();
        let u = |p, c| {
            Some(Usage {
                prompt_tokens: p,
                completion_tokens: c,
                cached_tokens: None,
            })
        };
        b.record("a", "team", "m", "gpu-1", u(3, 4));
        b.record("a", "team", "m", "gpu-2", u(1, 1));
        b.record("b", "team", "m", "gpu-1", None);
        let r = b.report();
        assert_eq!(r.rows.len(), 3);
        assert_eq!(r.tenants["team"].requests, 3);
        assert_eq!(r.tenants["team"].total_tokens, 9);
        assert_eq!(r.keys["a"].prompt_tokens, 4);
        assert_eq!(r.backends["gpu-1"].completion_tokens, 4);
    }
}
