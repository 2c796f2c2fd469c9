//! The access log: one line per request, written when the request is over (for a stream, when
//! its last byte is sent or the client goes away), plus the request metrics.

use std::time::{Duration, Instant};

use super::metrics as m;

/// What is known about a request by the time it ends.
#[derive(Debug, Clone)]
pub struct AccessRecord {
    pub request_id: String,
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
}

impl AccessRecord {
    pub fn new(request_id: String, endpoint: &'static str, started: Instant) -> Self {
        AccessRecord {
            request_id,
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
        }
    }

    /// Write the log line and record the metrics.
    pub fn finish(&self) {
        let duration = self.started.elapsed();
        let class = m::status_class(self.status);
        let backend = self.backend.as_deref().unwrap_or("-");
        tracing::info!(
            target: "sluice::access",
            request_id = %self.request_id,
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
            "request"
        );
        let labels = [
            ("endpoint", self.endpoint.to_string()),
            ("model", self.model.clone()),
            ("tenant", self.tenant.clone()),
            ("backend", backend.to_string()),
            ("status", class.to_string()),
        ];
        metrics::counter!(m::REQUESTS_TOTAL, &labels).increment(1);
        metrics::histogram!(
            m::REQUEST_DURATION_SECONDS,
            "endpoint" => self.endpoint,
            "model" => self.model.clone(),
            "status" => class
        )
        .record(duration.as_secs_f64());
        if let Some(ttft) = self.ttft {
            metrics::histogram!(m::TIME_TO_FIRST_TOKEN_SECONDS, "model" => self.model.clone(), "backend" => backend.to_string())
                .record(ttft.as_secs_f64());
        }
        if let Some(p) = self.prompt_tokens {
            metrics::counter!(m::PROMPT_TOKENS_TOTAL, "model" => self.model.clone(), "tenant" => self.tenant.clone())
                .increment(p);
        }
        if let Some(c) = self.completion_tokens {
            metrics::counter!(m::COMPLETION_TOKENS_TOTAL, "model" => self.model.clone(), "tenant" => self.tenant.clone())
                .increment(c);
        }
    }
}
