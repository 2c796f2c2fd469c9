//! One request's spans: the server span ([`RequestTrace`]) and its phases' ([`Phase`]), and
//! the W3C trace context read from and written to HTTP headers.
//!
//! Invariant: a span ends once — explicitly at the end of its phase, or when its last handle
//! is dropped (a client that went away ends the request's spans with it).

use std::borrow::Cow;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::{Span as _, SpanKind, Status, TraceContextExt, Tracer};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracer;

/// The request's server span, in the context its phases start under. One pointer wide, so
/// the access record that carries it stays as small with tracing off.
#[derive(Debug, Clone)]
pub struct RequestTrace(Arc<Server>);

#[derive(Debug)]
struct Server {
    cx: Context,
    recording: bool,
    tracer: SdkTracer,
    started: SystemTime,
}

impl RequestTrace {
    pub(super) fn start(tracer: &SdkTracer, parent: &Context, name: String) -> RequestTrace {
        let span = tracer
            .span_builder(name)
            .with_kind(SpanKind::Server)
            .start_with_context(tracer, parent);
        let recording = span.is_recording();
        RequestTrace(Arc::new(Server {
            recording,
            cx: parent.with_span(span),
            tracer: tracer.clone(),
            started: SystemTime::now(),
        }))
    }

    /// The trace and span ids in hex (for the access log); `None` when the span is invalid.
    pub fn ids(&self) -> Option<(String, String)> {
        let sc = self.0.cx.span().span_context().clone();
        sc.is_valid()
            .then(|| (sc.trace_id().to_string(), sc.span_id().to_string()))
    }

    /// Whether the server span is sampled (recorded and exported). An unsampled request
    /// still carries its context to the engine, but makes no phase span and builds no
    /// attribute.
    pub fn recording(&self) -> bool {
        self.0.recording
    }

    /// Set attributes on the server span; `attributes` is called only when it is recorded.
    pub fn set<I: IntoIterator<Item = KeyValue>>(&self, attributes: impl FnOnce() -> I) {
        if self.0.recording {
            self.0.cx.span().set_attributes(attributes());
        }
    }

    /// An event on the server span, `after` its start (the first token).
    pub fn event_after(&self, name: &'static str, after: Duration) {
        let at = self.0.started + after;
        self.0
            .cx
            .span()
            .add_event_with_timestamp(name, at, Vec::new());
    }

    /// A phase's span under the server span (for an unsampled request, the server span's
    /// context itself: nothing is recorded, the engine is still told the trace).
    pub fn phase(&self, name: &'static str) -> Phase {
        if !self.0.recording {
            return Phase {
                cx: self.0.cx.clone(),
                tracer: None,
            };
        }
        Phase::under(&self.0.tracer, &self.0.cx, name)
    }

    /// End the server span with the request's status and, for a failure, its `error.type`.
    pub fn end(&self, status: u16, error: Option<&str>) {
        let span = self.0.cx.span();
        span.set_attribute(KeyValue::new(
            "http.response.status_code",
            i64::from(status),
        ));
        if let Some(e) = error {
            span.set_attribute(KeyValue::new("error.type", e.to_string()));
        }
        if status >= 500 {
            span.set_status(Status::error(Cow::Owned(error.unwrap_or("").to_string())));
        }
        span.end();
    }
}

/// A phase's span (admission, routing, the fair-queue wait, an attempt, the stream, a
/// continuation).
#[derive(Debug, Clone)]
pub struct Phase {
    cx: Context,
    /// The tracer when the span is its own and recorded (`None`: the unsampled server span's
    /// context, never ended here).
    tracer: Option<SdkTracer>,
}

impl Phase {
    /// A recorded span named `name` under the span of `parent`.
    fn under(tracer: &SdkTracer, parent: &Context, name: &'static str) -> Phase {
        let span = tracer
            .span_builder(name)
            .with_kind(SpanKind::Internal)
            .start_with_context(tracer, parent);
        Phase {
            cx: parent.with_span(span),
            tracer: Some(tracer.clone()),
        }
    }

    /// A span under this one (`None` when this one is not recorded: nothing to nest in).
    pub fn child(&self, name: &'static str) -> Option<Phase> {
        let tracer = self.tracer.as_ref()?;
        Some(Phase::under(tracer, &self.cx, name))
    }

    /// Set attributes on the phase's span; `attributes` is called only when it is recorded.
    pub fn set<I: IntoIterator<Item = KeyValue>>(&self, attributes: impl FnOnce() -> I) {
        if self.tracer.is_some() {
            self.cx.span().set_attributes(attributes());
        }
    }

    /// The phase failed: `error.type` and an error status.
    pub fn fail(&self, error_type: &str) {
        if self.tracer.is_none() {
            return;
        }
        let span = self.cx.span();
        span.set_attribute(KeyValue::new("error.type", error_type.to_string()));
        span.set_status(Status::error(Cow::Owned(error_type.to_string())));
    }

    /// Write this span's context as `traceparent` (and `tracestate`) into a backend's
    /// request headers, replacing what the client sent: the engine's span is this one's child.
    pub fn inject(&self, headers: &mut http::HeaderMap) {
        headers.remove("traceparent");
        headers.remove("tracestate");
        TraceContextPropagator::new().inject_context(&self.cx, &mut HeadersMut(headers));
    }

    /// End the span now.
    pub fn end(&self) {
        if self.tracer.is_some() {
            self.cx.span().end();
        }
    }
}

/// Request headers as the propagator reads them.
pub(super) struct Headers<'a>(pub(super) &'a http::HeaderMap);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}

/// Headers the propagator writes.
struct HeadersMut<'a>(&'a mut http::HeaderMap);

impl Injector for HeadersMut<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(k), Ok(v)) = (
            http::HeaderName::from_bytes(key.as_bytes()),
            http::HeaderValue::from_str(&value),
        ) {
            self.0.insert(k, v);
        }
    }
}
