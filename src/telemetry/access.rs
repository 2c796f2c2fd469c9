//! The access log: one line per request, written when the request is over (for a stream, when
//! its last byte is sent or the client goes away), plus the request metrics.

use std::net::IpAddr;
use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

use metrics::{Counter, Histogram};

use super::handles::LabelCache;
use super::metrics as m;

/// The client's `x-request-id` when it is sane, else a new random one.
pub fn request_id(headers: &http::HeaderMap) -> String {
    headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|s| !s.is_empty() && s.len() <= 128 && s.bytes().all(|b| b.is_ascii_graphic()))
        .map(str::to_string)
        .unwrap_or_else(new_id)
}

/// The address of the client a request comes from, in the request's extensions: the peer, or
/// the client a trusted proxy forwarded it for (set by the listener's connection service).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientAddr(pub IpAddr);

/// The client address of a request, when the listener recorded one.
pub fn client_addr(extensions: &http::Extensions) -> Option<IpAddr> {
    extensions.get::<ClientAddr>().map(|c| c.0)
}

/// A random 128-bit id in hex.
pub fn new_id() -> String {
    format!("{:032x}", rand::random::<u128>())
}

/// What is known about a request by the time it ends.
#[derive(Debug, Clone)]
pub struct AccessRecord {
    pub request_id: String,
    /// The client's address ([`ClientAddr`]); `-` in the log when unknown.
    pub client: Option<IpAddr>,
    pub endpoint: &'static str,
    pub tenant: String,
    pub model: String,
    pub backend: Option<String>,
    pub status: u16,
    pub stream: bool,
    pub attempts: u32,
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
    pub ttft: Option<Duration>,
    pub started: Instant,
    /// Why it failed, as a low-cardinality label.
    pub error: Option<String>,
    /// The client went away before the end.
    pub cancelled: bool,
    /// The token counts are the gateway's estimate (the backend reported none).
    pub usage_estimated: bool,
    /// The request's server span, when tracing is on (`[tracing]`): ended with this record.
    pub trace: Option<super::otel::RequestTrace>,
}

impl AccessRecord {
    pub fn new(request_id: String, endpoint: &'static str, started: Instant) -> Self {
        AccessRecord {
            request_id,
            client: None,
            endpoint,
            tenant: "-".into(),
            model: "-".into(),
            backend: None,
            status: 0,
            stream: false,
            attempts: 0,
            prompt_tokens: None,
            completion_tokens: None,
            ttft: None,
            started,
            error: None,
            cancelled: false,
            usage_estimated: false,
            trace: None,
        }
    }

    /// Write the log line and record the metrics.
    pub fn finish(&self) {
        let duration = self.started.elapsed();
        let class = m::status_class(self.status);
        let backend = self.backend.as_deref().unwrap_or("-");
        // (hex only if the line is written: the log formats them in place)
        let ids = self.trace.as_ref().and_then(|t| t.ids());
        let trace_id = ids.map(|(t, _)| tracing::field::display(t));
        let span_id = ids.map(|(_, s)| tracing::field::display(s));
        tracing::info!(
            target: "sluice::access",
            request_id = %self.request_id,
            client = %OrDash(self.client),
            endpoint = self.endpoint,
            tenant = %self.tenant,
            model = %self.model,
            backend,
            status = self.status,
            stream = self.stream,
            attempts = self.attempts,
            prompt_tokens = self.prompt_tokens,
            completion_tokens = self.completion_tokens,
            ttft_ms = self.ttft.map(|d| d.as_secs_f64() * 1000.0),
            duration_ms = duration.as_secs_f64() * 1000.0,
            error = self.error.as_deref(),
            cancelled = self.cancelled,
            usage_estimated = self.usage_estimated,
            trace_id,
            span_id,
            "request"
        );
        if let Some(trace) = &self.trace {
            self.end_span(trace, backend);
        }
        let handles = request_handles(self.endpoint, &self.model, &self.tenant, backend, class);
        handles.requests.increment(1);
        handles.duration.record(duration.as_secs_f64());
        if let Some(ttft) = self.ttft {
            handles.ttft.record(ttft.as_secs_f64());
        }
        if let Some(p) = self.prompt_tokens {
            handles.prompt_tokens.increment(p);
        }
        if let Some(c) = self.completion_tokens {
            handles.completion_tokens.increment(c);
        }
    }
}

impl AccessRecord {
    /// End the server span with what the access line says (GenAI conventions' names).
    fn end_span(&self, trace: &super::otel::RequestTrace, backend: &str) {
        use opentelemetry::KeyValue;
        if !trace.recording() {
            return; // (an unsampled span records nothing and ends with its last handle)
        }
        let mut attrs = vec![
            KeyValue::new("gen_ai.request.model", self.model.clone()),
            KeyValue::new("sluice.tenant", self.tenant.clone()),
            KeyValue::new("sluice.backend", backend.to_string()),
            KeyValue::new("sluice.attempts", i64::from(self.attempts)),
            KeyValue::new("sluice.stream", self.stream),
        ];
        let tokens = [
            ("gen_ai.usage.input_tokens", self.prompt_tokens),
            ("gen_ai.usage.output_tokens", self.completion_tokens),
        ];
        for (key, n) in tokens {
            if let Some(n) = n {
                attrs.push(KeyValue::new(key, n as i64));
            }
        }
        if self.cancelled {
            attrs.push(KeyValue::new("sluice.cancelled", true));
        }
        trace.set(|| attrs);
        trace.end(self.status, self.error.as_deref());
    }
}

/// A value in the log, or `-` when unknown.
struct OrDash<T>(Option<T>);

impl<T: std::fmt::Display> std::fmt::Display for OrDash<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0 {
            Some(v) => v.fmt(f),
            None => f.write_str("-"),
        }
    }
}

/// Count tokens reported after the request itself was logged (a background response's usage,
/// known when it finishes), under the request's labels.
pub fn count_tokens(
    endpoint: &'static str,
    model: &str,
    tenant: &str,
    backend: &str,
    prompt: u64,
    completion: u64,
) {
    let handles = request_handles(endpoint, model, tenant, backend, m::status_class(200));
    handles.prompt_tokens.increment(prompt);
    handles.completion_tokens.increment(completion);
}

/// The metrics of a request with one set of labels.
struct RequestHandles {
    requests: Counter,
    duration: Histogram,
    ttft: Histogram,
    prompt_tokens: Counter,
    completion_tokens: Counter,
}

/// Handles by (endpoint, model, tenant, backend, status class).
static REQUEST_HANDLES: LazyLock<LabelCache<5, Arc<RequestHandles>>> =
    LazyLock::new(LabelCache::default);

fn request_handles(
    endpoint: &'static str,
    model: &str,
    tenant: &str,
    backend: &str,
    class: &'static str,
) -> Arc<RequestHandles> {
    REQUEST_HANDLES.handles([endpoint, model, tenant, backend, class], || {
        let (model, tenant, backend) = (model.to_string(), tenant.to_string(), backend.to_string());
        Arc::new(RequestHandles {
            requests: metrics::counter!(
                m::REQUESTS_TOTAL,
                "endpoint" => endpoint,
                "model" => model.clone(),
                "tenant" => tenant.clone(),
                "backend" => backend.clone(),
                "status" => class
            ),
            duration: metrics::histogram!(
                m::REQUEST_DURATION_SECONDS,
                "endpoint" => endpoint,
                "model" => model.clone(),
                "status" => class
            ),
            ttft: metrics::histogram!(
                m::TIME_TO_FIRST_TOKEN_SECONDS,
                "model" => model.clone(),
                "backend" => backend
            ),
            prompt_tokens: metrics::counter!(
                m::PROMPT_TOKENS_TOTAL,
                "model" => model.clone(),
                "tenant" => tenant.clone(),
                "endpoint" => endpoint
            ),
            completion_tokens: metrics::counter!(
                m::COMPLETION_TOKENS_TOTAL,
                "model" => model,
                "tenant" => tenant,
                "endpoint" => endpoint
            ),
        })
    })
}
