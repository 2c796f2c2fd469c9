//! The sampling decision, made before any span object is built, and the W3C trace context
//! written into a backend's headers.
//!
//! At a low `sample_ratio` almost every request is unsampled: it must cost two random ids, a
//! header lookup and the `traceparent` its engine is sent — no span, no OpenTelemetry context,
//! no id formatted unless the access log writes it. So the decision is taken here, from the
//! client's `traceparent` (parsed only when it sent one) or from a fresh trace id, and a span
//! is built only for a sampled request, with this decision handed to the SDK.
//!
//! Invariants: the decision is the parent-based ratio sampler's — a client's valid context
//! decides by its sampled flag; a new trace is sampled when the low 63 bits of its id fall
//! under `ratio × 2^63`, exactly as the SDK's `TraceIdRatioBased` decides, so the same trace
//! id gets the same decision from every hop that samples by that rule. An unsampled request's
//! engine is still told the trace (flag `00`), with Sluice's own span id as its parent.

use http::{HeaderMap, HeaderName, HeaderValue};
use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{SpanId, TraceContextExt, TraceId, TraceState};
use opentelemetry::Context;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{IdGenerator, RandomIdGenerator};

use super::span::Headers;

pub(super) static TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");
static TRACESTATE: HeaderName = HeaderName::from_static("tracestate");

/// What [`Sampler::decide`] chose for one request.
pub(super) enum Decision {
    /// Record and export: the span's parent context (the client's, or empty for a new trace)
    /// and, for a new trace, its id.
    Sample(Context, Option<TraceId>),
    /// Record nothing; the trace the engine is told about.
    Drop(Unsampled),
}

/// An unsampled request's trace context: its trace (the client's or a new one), the span id
/// Sluice stands for, and the client's `tracestate` to pass on.
#[derive(Debug)]
pub(super) struct Unsampled {
    pub(super) trace_id: TraceId,
    pub(super) span_id: SpanId,
    pub(super) state: TraceState,
}

/// The parent-based ratio sampler of the request's server span.
#[derive(Debug)]
pub(super) struct Sampler {
    /// A new trace is sampled when its id's low 63 bits are below this (the SDK's rule).
    bound: u64,
    /// Every new trace is sampled (`sample_ratio` 1.0 or more).
    always: bool,
    ids: RandomIdGenerator,
}

impl Sampler {
    pub(super) fn new(ratio: f64) -> Sampler {
        Sampler {
            bound: (ratio.max(0.0) * (1u64 << 63) as f64) as u64,
            always: ratio >= 1.0,
            ids: RandomIdGenerator::default(),
        }
    }

    /// Sample or not, by the client's context when it sent a valid one, else by a new
    /// trace id.
    pub(super) fn decide(&self, headers: &HeaderMap) -> Decision {
        if headers.contains_key(&TRACEPARENT) {
            let parent = TraceContextPropagator::new()
                .extract_with_context(&Context::new(), &Headers(headers));
            let sc = parent.span().span_context().clone();
            if sc.is_valid() {
                if sc.is_sampled() {
                    return Decision::Sample(parent, None);
                }
                return Decision::Drop(Unsampled {
                    trace_id: sc.trace_id(),
                    span_id: self.ids.new_span_id(),
                    state: sc.trace_state().clone(),
                });
            }
        }
        let trace_id = self.ids.new_trace_id();
        if self.samples(trace_id) {
            return Decision::Sample(Context::new(), Some(trace_id));
        }
        Decision::Drop(Unsampled {
            trace_id,
            span_id: self.ids.new_span_id(),
            state: TraceState::NONE,
        })
    }

    /// The ratio rule for a new trace.
    fn samples(&self, trace_id: TraceId) -> bool {
        let low = u64::from_be_bytes(trace_id.to_bytes()[8..].try_into().unwrap_or([0xff; 8]));
        self.always || low >> 1 < self.bound
    }
}

/// Write `traceparent` (and `tracestate` when there is one) into a backend's request headers,
/// replacing the client's: version 00, the trace, the parent span, the sampled flag.
pub(super) fn write_context(
    headers: &mut HeaderMap,
    trace_id: TraceId,
    span_id: SpanId,
    sampled: bool,
    state: &TraceState,
) {
    let mut value = [0u8; 55];
    value[..3].copy_from_slice(b"00-");
    hex(&trace_id.to_bytes(), &mut value[3..35]);
    value[35] = b'-';
    hex(&span_id.to_bytes(), &mut value[36..52]);
    value[52..].copy_from_slice(if sampled { b"-01" } else { b"-00" });
    if let Ok(v) = HeaderValue::from_bytes(&value) {
        headers.insert(TRACEPARENT.clone(), v);
    }
    let state = state.header();
    match HeaderValue::from_str(&state) {
        Ok(v) if !state.is_empty() => {
            headers.insert(TRACESTATE.clone(), v);
        }
        _ => {
            headers.remove(&TRACESTATE);
        }
    }
}

/// `bytes` in lowercase hex into `out` (twice as long).
fn hex(bytes: &[u8], out: &mut [u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for (b, pair) in bytes.iter().zip(out.chunks_exact_mut(2)) {
        pair[0] = DIGITS[usize::from(b >> 4)];
        pair[1] = DIGITS[usize::from(b & 0xf)];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn traceparent(flags: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        let v = format!("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-{flags}");
        h.insert("traceparent", v.parse().unwrap());
        h.insert("tracestate", "vendor=client".parse().unwrap());
        h
    }

    /// The rule is the SDK's: the same ids are sampled at a ratio of 0.25, about a quarter.
    #[test]
    fn new_traces_follow_the_ratio_rule() {
        let sampler = Sampler::new(0.25);
        let low = |l: u64| TraceId::from(u128::from(l) | (7u128 << 64));
        assert!(sampler.samples(low(0)));
        assert!(sampler.samples(low((1u64 << 62) - 1)));
        assert!(!sampler.samples(low(1u64 << 62)));
        assert!(!sampler.samples(low(u64::MAX)));
        let sampled = (0..4000)
            .filter(|_| matches!(sampler.decide(&HeaderMap::new()), Decision::Sample(..)))
            .count();
        assert!((800..1200).contains(&sampled), "{sampled}");
        assert!(Sampler::new(1.0).samples(low(u64::MAX)));
        assert!(!Sampler::new(0.0).samples(low(0)));
    }

    #[test]
    fn a_clients_context_decides_for_its_trace() {
        let sampler = Sampler::new(0.0);
        assert!(matches!(
            sampler.decide(&traceparent("01")),
            Decision::Sample(_, None)
        ));
        let Decision::Drop(u) = sampler.decide(&traceparent("00")) else {
            panic!("an unsampled client trace is not sampled");
        };
        assert_eq!(u.trace_id.to_string(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_ne!(u.span_id.to_string(), "00f067aa0ba902b7");
        assert_eq!(u.state.header(), "vendor=client");
        // An invalid one is ignored: a new trace, by the ratio.
        let mut bad = HeaderMap::new();
        bad.insert("traceparent", "00-zz-00".parse().unwrap());
        assert!(matches!(
            Sampler::new(1.0).decide(&bad),
            Decision::Sample(_, Some(_))
        ));
    }

    #[test]
    fn the_context_written_for_a_backend_replaces_the_clients() {
        let mut h = traceparent("01");
        let trace = TraceId::from(0x4bf92f3577b34da6a3ce929d0e0e4736);
        write_context(&mut h, trace, SpanId::from(0xab), false, &TraceState::NONE);
        assert_eq!(
            h["traceparent"],
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00000000000000ab-00"
        );
        assert!(h.get("tracestate").is_none(), "no empty tracestate");
        let state: TraceState = "k=v".parse().unwrap();
        write_context(&mut h, trace, SpanId::from(0xab), true, &state);
        assert!(h["traceparent"].to_str().unwrap().ends_with("-01"));
        assert_eq!(h["tracestate"], "k=v");
    }
}
