//! Settlement of an answered request, built once in the respond phase: the load guard, the
//! limits' reconciliation (or a background response's follower), what the answer teaches
//! about its backend and model, the workload trace line; and the access record moved out of
//! the request path.
//!
//! Invariants: a settlement runs exactly once, when the answer is over, whatever ended it;
//! after the record is taken, the request path must not return `Err` (`handle` finishes the
//! record of a failed request itself).

use std::sync::Arc;
use std::time::Duration;

use super::pick::Claimed;
use super::prepare::Prepared;
use super::{background, observe};
use crate::fleet::Backend;
use crate::limits::Permit;
use crate::settle::{Outcome, Settle, SettleHook};
use crate::telemetry::access::AccessRecord;
use crate::telemetry::metrics as m;
use crate::telemetry::otel::RequestTrace;
use opentelemetry::KeyValue;

/// The settlement of an answered request (runs once, when the answer is over): the load
/// guard, the limits' reconciliation, and what the answer teaches about backend and model.
pub(super) fn settlement(
    p: &Prepared,
    permit: Option<Permit>,
    backend: &Arc<Backend>,
    claimed: Claimed,
    sent_after: Duration,
    record: &mut AccessRecord,
) -> Settle {
    let mut settle = Settle::new(take_record(record));
    if let Some(trace) = settle.record.trace.as_ref().filter(|t| t.recording()) {
        settle
            .hooks
            .push(answer_span(p, trace, claimed.idx, sent_after));
    }
    if let Some(predicted) = claimed.cached {
        settle.hooks.push(prediction_hook(backend, predicted));
    }
    settle.guard = Some(claimed.guard);
    settle.prompt_estimate = p.fields.prompt_tokens_estimate;
    if let Some(permit) = permit {
        let follow = background::Follow {
            api: p.api,
            backend: backend.clone(),
            tenant: p.identity.tenant.clone(),
            model: p.resolved.canonical.clone(),
            main: p.main.clone(),
        };
        let hook = permit.with_backend(backend.name()).into_hook();
        settle
            .hooks
            .push(background::settle_or_follow(hook, follow));
    }
    settle.hooks.push(observe::learn_hook(
        backend.clone(),
        p.shapes.clone(),
        p.resolved.canonical.clone(),
        p.fields.prompt_tokens_estimate,
        sent_after,
        claimed.queued,
        claimed.cached,
    ));
    if let Some(trace) = &p.trace {
        settle
            .hooks
            .push(trace_hook(p, trace.clone(), backend.name()));
    }
    settle
}

/// With tracing: the model the engine answered as, on the server span, and the answer's span
/// from commit to its last byte (`sluice.stream` for a stream), ended by the settlement with
/// its token counts and whether it was complete or continued elsewhere. A stream also gets
/// `sluice.first_token`: from the answering attempt's send to the first token passed on (a
/// whole answer's first byte is its head, where its attempt span ends).
fn answer_span(p: &Prepared, trace: &RequestTrace, idx: usize, sent_after: Duration) -> SettleHook {
    let model = &p.resolved.candidates[idx].1;
    trace.set(|| [KeyValue::new("gen_ai.response.model", model.clone())]);
    let first_token = trace.clone();
    let span = trace.phase(if p.streaming {
        "sluice.stream"
    } else {
        "sluice.response"
    });
    Box::new(move |o: &Outcome| {
        span.set(|| {
            [
                KeyValue::new("sluice.complete", o.complete),
                KeyValue::new("sluice.continued", o.continued),
            ]
        });
        if let Some(reason) = o.finish {
            span.set(|| {
                [KeyValue::new(
                    "gen_ai.response.finish_reasons",
                    opentelemetry::Value::Array(
                        vec![opentelemetry::StringValue::from(reason)].into(),
                    ),
                )]
            });
        }
        if let Some(u) = o.usage {
            span.set(|| {
                [
                    KeyValue::new("gen_ai.usage.input_tokens", u.prompt_tokens as i64),
                    KeyValue::new("gen_ai.usage.output_tokens", u.completion_tokens as i64),
                ]
            });
        }
        span.end();
        if let Some(ttft) = o.ttft {
            first_token.past_phase("sluice.first_token", (sent_after, ttft), || {
                [KeyValue::new("sluice.ttft_ms", ttft.as_secs_f64() * 1000.0)]
            });
        }
    })
}

/// Count the cached prompt tokens routing expected on the backend against what its engine
/// reported (answers that report none are not counted).
pub(super) fn prediction_hook(backend: &Arc<Backend>, predicted: u64) -> SettleHook {
    let backend = backend.clone();
    Box::new(move |o: &Outcome| {
        if let Some(reported) = o.usage.and_then(|u| u.cached_tokens) {
            m::prefix_prediction(backend.name(), predicted, reported);
            backend.state.kv().record_prediction(predicted, reported);
        }
    })
}

/// The trace line of an answered request: counts, the prefix fingerprint, the backend and the
/// latencies measured here (TTFT for streams, TPOT for complete streams one backend produced),
/// never text.
pub(super) fn trace_hook(
    p: &Prepared,
    trace: Arc<crate::telemetry::trace::TraceWriter>,
    backend: &str,
) -> SettleHook {
    let backend = backend.to_string();
    let model = p.resolved.canonical.clone();
    let api = p.api.path();
    let prefix = p.input.prefix_hash.map(|h| format!("{h:016x}"));
    let prefix_tokens = p.input.prefix_tokens;
    // what routing expects as output when the client set a limit (0: it did not)
    let max_tokens = Some(p.api.expected_output(&p.fields, 0)).filter(|m| *m > 0);
    Box::new(move |o: &Outcome| {
        let Some(u) = o.usage else {
            return;
        };
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        let tpot = o
            .ttft
            .filter(|_| o.complete && !o.continued)
            .and_then(|t| crate::telemetry::trace::tpot_ms(t, o.elapsed, u.completion_tokens));
        trace.record(&crate::telemetry::trace::TraceLine {
            ts: now.saturating_sub(o.elapsed).as_secs_f64(),
            model: &model,
            api,
            prompt_tokens: u.prompt_tokens,
            completion_tokens: u.completion_tokens,
            cached_tokens: u.cached_tokens.unwrap_or(0),
            prefix: prefix.clone(),
            prefix_tokens: if prefix.is_some() { prefix_tokens } else { 0 },
            max_tokens,
            backend: Some(&backend),
            ttft_ms: o.ttft.map(ms),
            tpot_ms: tpot,
            duration_ms: ms(o.elapsed),
        });
    })
}

/// Move the record out (into a [`Settle`] or to be finished now). After this, `proxy` must not
/// return `Err`, because `handle` finishes the record of a failed request itself.
pub(super) fn take_record(record: &mut AccessRecord) -> AccessRecord {
    let blank = AccessRecord::new(String::new(), record.endpoint, record.started);
    std::mem::replace(record, blank)
}

pub(super) fn finish_record(record: &mut AccessRecord) {
    let taken = take_record(record);
    taken.finish();
}
