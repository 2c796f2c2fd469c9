//! One request's spans: the server span ([`RequestTrace`]) and its phases' ([`Phase`]), and
//! the client's W3C trace context read from HTTP headers.
//!
//! A sampled request has real spans; an unsampled one has none — only the ids its engine is
//! told ([`super::sampling`]), so its phases cost a pointer copy each.
//!
//! Invariant: a span ends once — explicitly at the end of its phase, or when its last handle
//! is dropped (a client that went away ends the request's spans with it).

use std::borrow::Cow;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use opentelemetry::propagation::Extractor;
use opentelemetry::trace::{
    SamplingDecision, SamplingResult, Span as _, SpanId, SpanKind, Status, TraceContextExt,
    TraceId, Tracer,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::trace::SdkTracer;

use super::sampling::{write_context, Decision, Unsampled};

/// The request's server span, in the context its phases start under, or an unsampled
/// request's ids. One pointer wide, so the access record that carries it stays as small with
/// tracing off.
#[derive(Debug, Clone)]
pub struct RequestTrace(Arc<Server>);

#[derive(Debug)]
enum Server {
    Sampled {
        cx: Context,
        tracer: SdkTracer,
        /// The request's arrival on the wall clock: the server span's start, and the origin
        /// of the offsets a phase placed after the fact is given.
        started: SystemTime,
    },
    Unsampled(Unsampled),
}

impl RequestTrace {
    /// The server span named `name()` as `decision` says (`name` is called only when it is
    /// sampled), starting when the request `arrived`: the origin every later offset of the
    /// request path (`sent_after`, the TTFT) is measured from.
    pub(super) fn start(
        tracer: &SdkTracer,
        decision: Decision,
        arrived: Instant,
        name: impl FnOnce() -> String,
    ) -> RequestTrace {
        let (parent, trace_id) = match decision {
            Decision::Drop(ids) => return RequestTrace(Arc::new(Server::Unsampled(ids))),
            Decision::Sample(parent, trace_id) => (parent, trace_id),
        };
        let now = SystemTime::now();
        let started = now.checked_sub(arrived.elapsed()).unwrap_or(now);
        let mut builder = tracer
            .span_builder(name())
            .with_kind(SpanKind::Server)
            .with_start_time(started)
            .with_sampling_result(SamplingResult {
                decision: SamplingDecision::RecordAndSample,
                attributes: Vec::new(),
                trace_state: parent.span().span_context().trace_state().clone(),
            });
        if let Some(id) = trace_id {
            builder = builder.with_trace_id(id);
        }
        let span = builder.start_with_context(tracer, &parent);
        RequestTrace(Arc::new(Server::Sampled {
            cx: parent.with_span(span),
            tracer: tracer.clone(),
            started,
        }))
    }

    /// The trace and span ids (for the access log, which formats them only when it writes);
    /// `None` when the span is invalid.
    pub fn ids(&self) -> Option<(TraceId, SpanId)> {
        match &*self.0 {
            Server::Sampled { cx, .. } => {
                let span = cx.span();
                let sc = span.span_context();
                sc.is_valid().then(|| (sc.trace_id(), sc.span_id()))
            }
            Server::Unsampled(u) => Some((u.trace_id, u.span_id)),
        }
    }

    /// Whether the server span is sampled (recorded and exported). An unsampled request
    /// still carries its context to the engine, but makes no span and builds no attribute.
    pub fn recording(&self) -> bool {
        matches!(&*self.0, Server::Sampled { .. })
    }

    /// Set attributes on the server span; `attributes` is called only when it is recorded.
    pub fn set<I: IntoIterator<Item = KeyValue>>(&self, attributes: impl FnOnce() -> I) {
        if let Server::Sampled { cx, .. } = &*self.0 {
            cx.span().set_attributes(attributes());
        }
    }

    /// A span under the server span for a stretch already over, `from` to `to` after the
    /// server span's start (the wait for the first token, known only once it came);
    /// `attributes` is called only when it is recorded.
    pub fn past_phase<I: IntoIterator<Item = KeyValue>>(
        &self,
        name: &'static str,
        (from, to): (Duration, Duration),
        attributes: impl FnOnce() -> I,
    ) {
        if let Server::Sampled {
            cx,
            tracer,
            started,
        } = &*self.0
        {
            let mut span = tracer
                .span_builder(name)
                .with_kind(SpanKind::Internal)
                .with_start_time(*started + from)
                .with_attributes(attributes())
                .start_with_context(tracer, cx);
            span.end_with_timestamp(*started + to.max(from));
        }
    }

    /// A phase's span under the server span (for an unsampled request, no span: the engine
    /// is still told the trace).
    pub fn phase(&self, name: &'static str) -> Phase {
        match &*self.0 {
            Server::Sampled { cx, tracer, .. } => Phase::under(tracer, cx, name),
            Server::Unsampled(_) => Phase(Inner::Unsampled(self.clone())),
        }
    }

    /// End the server span with the request's status and, for a failure, its `error.type`.
    pub fn end(&self, status: u16, error: Option<&str>) {
        let Server::Sampled { cx, .. } = &*self.0 else {
            return;
        };
        let span = cx.span();
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
/// continuation), or, for an unsampled request, its trace context only.
#[derive(Debug, Clone)]
pub struct Phase(Inner);

#[derive(Debug, Clone)]
enum Inner {
    /// Its own span, recorded.
    Recorded { cx: Context, tracer: SdkTracer },
    /// An unsampled request's: no span, never ended here.
    Unsampled(RequestTrace),
}

impl Phase {
    /// A recorded span named `name` under the span of `parent`.
    fn under(tracer: &SdkTracer, parent: &Context, name: &'static str) -> Phase {
        let span = tracer
            .span_builder(name)
            .with_kind(SpanKind::Internal)
            .start_with_context(tracer, parent);
        Phase(Inner::Recorded {
            cx: parent.with_span(span),
            tracer: tracer.clone(),
        })
    }

    /// The recorded span's context.
    fn recorded(&self) -> Option<&Context> {
        match &self.0 {
            Inner::Recorded { cx, .. } => Some(cx),
            Inner::Unsampled(_) => None,
        }
    }

    /// A span under this one (`None` when this one is not recorded: nothing to nest in).
    pub fn child(&self, name: &'static str) -> Option<Phase> {
        match &self.0 {
            Inner::Recorded { cx, tracer } => Some(Phase::under(tracer, cx, name)),
            Inner::Unsampled(_) => None,
        }
    }

    /// Set attributes on the phase's span; `attributes` is called only when it is recorded.
    pub fn set<I: IntoIterator<Item = KeyValue>>(&self, attributes: impl FnOnce() -> I) {
        if let Some(cx) = self.recorded() {
            cx.span().set_attributes(attributes());
        }
    }

    /// The phase failed: `error.type` and an error status.
    pub fn fail(&self, error_type: &str) {
        let Some(cx) = self.recorded() else {
            return;
        };
        let span = cx.span();
        span.set_attribute(KeyValue::new("error.type", error_type.to_string()));
        span.set_status(Status::error(Cow::Owned(error_type.to_string())));
    }

    /// Write this span's context as `traceparent` (and `tracestate`) into a backend's
    /// request headers, replacing what the client sent: the engine's span is this one's child
    /// (an unsampled request's: the child of the span id Sluice stands for, flag `00`).
    pub fn inject(&self, headers: &mut http::HeaderMap) {
        match &self.0 {
            Inner::Recorded { cx, .. } => {
                let span = cx.span();
                let sc = span.span_context();
                let (trace, id) = (sc.trace_id(), sc.span_id());
                write_context(headers, trace, id, sc.is_sampled(), sc.trace_state());
            }
            Inner::Unsampled(trace) => {
                if let Server::Unsampled(u) = &*trace.0 {
                    write_context(headers, u.trace_id, u.span_id, false, &u.state);
                }
            }
        }
    }

    /// End the span now.
    pub fn end(&self) {
        if let Some(cx) = self.recorded() {
            cx.span().end();
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
