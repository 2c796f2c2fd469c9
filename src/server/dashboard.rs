//! The status page (`GET /dashboard`) and the JSON it refreshes from (`GET /admin/summary`).
//!
//! The page is one self-contained HTML file ([`PAGE`], embedded at build time): no external
//! script, style, font or image, so it works offline and behind a strict network policy; its
//! Content-Security-Policy allows nothing but itself and fetches to the same origin. It polls
//! [`summary`] and draws its charts on `<canvas>`.
//!
//! The summary is built from state the gateway already keeps: the live fleet snapshot (state,
//! in-flight, failures, the engines' own queue depth), the wait queue, the usage book of
//! `src/limits` (tenants and backends, since process start) and the configured limits, and the
//! Prometheus recorder (TTFT histograms by backend, request counts by status class). Counters
//! are cumulative; the page derives rates from two consecutive polls.
//!
//! Invariants: the summary never includes an API key, a key hash, a prompt or a backend's API
//! key; the admin token is checked exactly as for the other operations routes (a browser,
//! which cannot set a header when it navigates, may pass it as `?token=` to the page, whose
//! script then sends it as a Bearer header).

use std::collections::BTreeMap;

use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

use crate::gateway::Gateway;
use crate::telemetry::metrics as m;

/// The page itself.
pub const PAGE: &str = include_str!("dashboard.html");

/// What the page may load: itself, and fetches to the same origin.
const CSP: &str = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; \
                   connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; \
                   frame-ancestors 'none'";

/// The page as a response.
pub fn page() -> Response {
    let mut r = ([(header::CONTENT_TYPE, "text/html; charset=utf-8")], PAGE).into_response();
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    r
}

/// The admin token the dashboard's `query` carries as `token=…` (empty when none); the
/// comparison is [`super::admin_auth::token_matches`]'s.
pub fn query_token(query: Option<&str>) -> String {
    query
        .unwrap_or("")
        .split('&')
        .find_map(|kv| kv.strip_prefix("token="))
        .map(percent_decode)
        .unwrap_or_default()
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' => {
                let hex = b
                    .get(i + 1..i + 3)
                    .and_then(|h| std::str::from_utf8(h).ok())
                    .filter(|h| h.bytes().all(|c| c.is_ascii_hexdigit()))
                    .and_then(|h| u8::from_str_radix(h, 16).ok());
                if let Some(v) = hex {
                    out.push(v);
                    i += 3;
                    continue;
                }
                out.push(b'%');
            }
            b'+' => out.push(b' '),
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A histogram as cumulative `(le, count)` pairs, `le` ascending (`+Inf` last).
type Buckets = Vec<(f64, f64)>;

/// What the summary reads from the Prometheus text of this process.
#[derive(Default)]
struct Scraped {
    ttft_by_backend: BTreeMap<String, BTreeMap<u64, (f64, f64)>>,
    requests_total: f64,
    requests_by_status: BTreeMap<String, f64>,
    /// Per client API (`endpoint` label): requests, errors (4xx and 5xx), prompt and
    /// completion tokens.
    by_endpoint: BTreeMap<String, [f64; 4]>,
    /// The batch runner's lines (`[batch]`): by metric name, summed over labels.
    batch: BTreeMap<String, f64>,
}

/// The summary's `batch` object: this replica's batch lines (always all present, 0 without
/// `[batch]`).
const BATCH_KEYS: &[&str] = &[
    "lines_queued",
    "lines_running",
    "lines_completed",
    "lines_failed",
    "lines_deferred",
    "line_seconds",
    "batches_created",
];

/// Batch gauges and counters read as they are, and their names in the summary.
const BATCH_FIELDS: &[(&str, &str)] = &[
    (m::BATCH_LINES_QUEUED, "lines_queued"),
    (m::BATCH_LINES_RUNNING, "lines_running"),
    (m::BATCHES_CREATED_TOTAL, "batches_created"),
];

fn scrape(text: &str) -> Scraped {
    let bucket = format!("{}_bucket", m::TIME_TO_FIRST_TOKEN_SECONDS);
    let mut out = Scraped::default();
    for sample in crate::fleet::prom::parse(text) {
        let (name, value) = (sample.name.as_str(), sample.value);
        let label = |k: &str| sample.label(k).map(str::to_string);
        if name == bucket {
            let (Some(backend), Some(le)) = (label("backend"), label("le")) else {
                continue;
            };
            let le: f64 = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().unwrap_or(f64::INFINITY)
            };
            let slot = out
                .ttft_by_backend
                .entry(backend)
                .or_default()
                .entry(le.to_bits())
                .or_insert((le, 0.0));
            slot.1 += value;
        } else if name == m::REQUESTS_TOTAL {
            out.requests_total += value;
            let status = label("status");
            if let Some(e) = label("endpoint") {
                let row = out.by_endpoint.entry(e).or_default();
                row[0] += value;
                if status.as_deref().is_some_and(|s| s != "2xx") {
                    row[1] += value;
                }
            }
            if let Some(s) = status {
                *out.requests_by_status.entry(s).or_default() += value;
            }
        } else if let Some(field) = batch_field(name, sample.label("outcome")) {
            *out.batch.entry(field.to_string()).or_default() += value;
        } else if name == m::PROMPT_TOKENS_TOTAL || name == m::COMPLETION_TOKENS_TOTAL {
            if let Some(e) = label("endpoint") {
                let col = if name == m::PROMPT_TOKENS_TOTAL { 2 } else { 3 };
                out.by_endpoint.entry(e).or_default()[col] += value;
            }
        }
    }
    out
}

/// The summary's name of a batch sample: lines by outcome, line seconds (the idle capacity
/// used), deferrals, the gauges of [`BATCH_FIELDS`].
fn batch_field(name: &str, outcome: Option<&str>) -> Option<&'static str> {
    if name == m::BATCH_LINES_TOTAL {
        return match outcome {
            Some("completed") => Some("lines_completed"),
            Some("failed") => Some("lines_failed"),
            _ => None,
        };
    }
    let sum = format!("{}_sum", m::BATCH_LINE_SECONDS);
    let deferred = m::BATCH_LINES_DEFERRED_TOTAL;
    match name {
        n if n == sum => Some("line_seconds"),
        n if n == deferred => Some("lines_deferred"),
        n => BATCH_FIELDS.iter().find(|(m, _)| *m == n).map(|(_, f)| *f),
    }
}

fn sorted(b: &BTreeMap<u64, (f64, f64)>) -> Buckets {
    let mut v: Buckets = b.values().copied().collect();
    v.sort_by(|a, b| a.0.total_cmp(&b.0));
    v
}

/// The `q` quantile of a cumulative histogram, interpolated within its bucket like
/// Prometheus' `histogram_quantile`. `None` without observations.
pub fn quantile(q: f64, buckets: &[(f64, f64)]) -> Option<f64> {
    let total = buckets.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = q * total;
    let mut prev = (0.0, 0.0);
    for &(le, count) in buckets {
        if count >= rank {
            if le.is_infinite() {
                return Some(prev.0);
            }
            let width = count - prev.1;
            let frac = if width > 0.0 {
                (rank - prev.1) / width
            } else {
                1.0
            };
            return Some(prev.0 + (le - prev.0) * frac);
        }
        prev = (le, count);
    }
    Some(prev.0)
}

fn merge(all: &BTreeMap<String, BTreeMap<u64, (f64, f64)>>) -> Buckets {
    let mut sum: BTreeMap<u64, (f64, f64)> = BTreeMap::new();
    for b in all.values() {
        for (k, (le, c)) in b {
            sum.entry(*k).or_insert((*le, 0.0)).1 += c;
        }
    }
    sorted(&sum)
}

fn limits_json(l: &crate::config::validate::LimitSet) -> Value {
    json!({
        "requests_per_minute": l.requests_per_minute,
        "tokens_per_minute": l.tokens_per_minute,
        "max_concurrent": l.max_concurrent,
        "daily_tokens": l.daily_tokens,
        "monthly_tokens": l.monthly_tokens,
    })
}

/// The fleet, the gateway and the tenants in one JSON document (`GET /admin/summary`).
pub fn summary(gw: &Gateway) -> Value {
    let rt = gw.runtime();
    let scraped = scrape(&m::handle().render());
    let usage = gw.limits.usage_report();
    let usage_json = serde_json::to_value(&usage).unwrap_or(Value::Null);
    let backends: Vec<Value> = rt
        .fleet
        .backends
        .iter()
        .map(|b| {
            let v = b.view(rt.config.health.slow_start);
            let ttft = scraped
                .ttft_by_backend
                .get(&v.name)
                .map(sorted)
                .unwrap_or_default();
            let used = usage.backends.get(&v.name);
            // The dashboard's own names for some view fields: `queue_depth` is the engine's
            // waiting count, `errors_total` the live failures.
            json!({
                "name": v.name,
                "kind": v.kind,
                "state": v.state,
                "draining": v.draining,
                "models": v.models,
                "queue_depth": v.engine_waiting,
                "inflight_requests": v.inflight_requests,
                "inflight_tokens": v.inflight_tokens,
                "max_concurrent": v.max_concurrent,
                "requests_total": v.requests_total,
                "errors_total": v.failures_total,
                "prompt_tokens_total": used.map_or(0, |u| u.prompt_tokens),
                "completion_tokens_total": used.map_or(0, |u| u.completion_tokens),
                "ttft_p50_seconds": quantile(0.5, &ttft),
                "ttft_p99_seconds": quantile(0.99, &ttft),
                "ttft_count": ttft.last().map_or(0.0, |b| b.1),
                "last_error": v.last_error,
                "kv_cache": v.kv_cache,
            })
        })
        .collect();
    let all = merge(&scraped.ttft_by_backend);
    let mut tenants: BTreeMap<String, Value> = BTreeMap::new();
    for t in &rt.config.tenants {
        tenants.insert(
            t.name.clone(),
            json!({"tenant": t.name, "limits": limits_json(&t.limits), "keys": []}),
        );
    }
    for k in &rt.config.keys {
        let entry = tenants
            .entry(k.tenant.clone())
            .or_insert_with(|| json!({"tenant": k.tenant, "limits": Value::Null, "keys": []}));
        if let Some(keys) = entry.get_mut("keys").and_then(Value::as_array_mut) {
            let limits = k.limit_set().or(rt.config.limits.defaults);
            keys.push(
                json!({"key": k.name, "limits": limits_json(&limits), "disabled": k.disabled}),
            );
        }
    }
    for (name, t) in &mut tenants {
        let used = usage.tenants.get(name).copied().unwrap_or_default();
        if let Some(obj) = t.as_object_mut() {
            obj.insert(
                "usage".into(),
                serde_json::to_value(used).unwrap_or(Value::Null),
            );
        }
    }
    // Tenants seen in traffic but not configured (an open gateway's `anonymous`).
    for (name, used) in &usage.tenants {
        tenants.entry(name.clone()).or_insert_with(
            || json!({"tenant": name, "limits": Value::Null, "keys": [], "usage": used}),
        );
    }
    let now_ms = crate::fleet::backend::monotonic_ms();
    let batch = BATCH_KEYS
        .iter()
        .map(|f| {
            (
                f.to_string(),
                json!(scraped.batch.get(*f).copied().unwrap_or(0.0)),
            )
        })
        .collect::<serde_json::Map<_, _>>();
    json!({
        "version": env!("CARGO_PKG_VERSION"),
        "now_ms": now_ms,
        "ready": gw.is_ready(),
        "accepting": gw.accepting(),
        "policy": rt.config.routing.policy.as_str(),
        "queue_depth": gw.queue.len(),
        "requests_total": scraped.requests_total,
        "requests_by_status": scraped.requests_by_status,
        "endpoints": scraped.by_endpoint.iter().map(|(e, [r, err, p, c])| json!({
            "endpoint": e, "requests": r, "errors": err, "prompt_tokens": p, "completion_tokens": c,
        })).collect::<Vec<_>>(),
        "ttft_p50_seconds": quantile(0.5, &all),
        "ttft_p99_seconds": quantile(0.99, &all),
        "ttft_buckets": all.iter().map(|(le, c)| json!([if le.is_finite() { json!(le) } else { json!("+Inf") }, c])).collect::<Vec<_>>(),
        "backends": backends,
        "batch": batch,
        "tenants": tenants.into_values().collect::<Vec<_>>(),
        "usage": usage_json,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantile_interpolates_like_prometheus() {
        let b = [(0.1, 50.0), (0.2, 100.0), (f64::INFINITY, 100.0)];
        assert!((quantile(0.5, &b).unwrap() - 0.1).abs() < 1e-9);
        assert!((quantile(0.75, &b).unwrap() - 0.15).abs() < 1e-9);
        assert_eq!(quantile(0.5, &[(0.1, 0.0), (f64::INFINITY, 0.0)]), None);
        assert_eq!(
            quantile(0.99, &[(0.1, 0.0), (f64::INFINITY, 4.0)]),
            Some(0.1)
        );
    }

    #[test]
    fn parses_prometheus_lines() {
        let t = "# TYPE x histogram\nsluice_time_to_first_token_seconds_bucket{model=\"m\",backend=\"a\",le=\"0.1\"} 3\n\
                 sluice_time_to_first_token_seconds_bucket{model=\"m\",backend=\"a\",le=\"+Inf\"} 4\n\
                 sluice_requests_total{endpoint=\"chat\",model=\"m\",tenant=\"t\",backend=\"a\",status=\"2xx\"} 4\n\
                 sluice_batch_lines_total{outcome=\"completed\"} 7\nsluice_batch_lines_total{outcome=\"failed\"} 2\n\
                 sluice_batch_lines_queued 3\nsluice_batch_line_seconds_sum 1.5\nsluice_batch_line_seconds_count 9\n";
        let s = scrape(t);
        let a = sorted(&s.ttft_by_backend["a"]);
        assert_eq!(a, vec![(0.1, 3.0), (f64::INFINITY, 4.0)]);
        assert_eq!(s.requests_total, 4.0);
        assert_eq!(s.requests_by_status["2xx"], 4.0);
        assert_eq!(s.by_endpoint["chat"], [4.0, 0.0, 0.0, 0.0]);
        let b = |k: &str| s.batch.get(k).copied();
        assert_eq!(
            (b("lines_completed"), b("lines_failed"), b("lines_queued")),
            (Some(7.0), Some(2.0), Some(3.0))
        );
        assert_eq!(b("line_seconds"), Some(1.5));
    }

    #[test]
    fn query_token_is_decoded() {
        assert_eq!(percent_decode("a%2Fb+c"), "a/b c");
        assert_eq!(percent_decode("100%"), "100%");
        assert_eq!(percent_decode("%zz"), "%zz");
    }
}
