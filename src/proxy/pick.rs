//! The pick phase: which backend an attempt goes to, with its slot taken ([`Claimed`]).
//! A native backend first when some candidates serve only by translation; else the policy's
//! choice; when every untried candidate is at its concurrency cap, the fair queue. An
//! interactive request that finds no free slot (it waits in the queue, will wait inside the
//! engine it was sent to, or took a slot a background request holds, which counts as free for
//! it) asks a background one of its model to give its slot up ([`MakeRoom`]); the first one
//! routed to a backend idle of interactive traffic asks the background requests over the bound
//! that holds again there to give way ([`crate::fleet::background`]).
//!
//! [`MakeRoom`]: crate::fleet::make_room::MakeRoom
//!
//! Invariants: only routable backends are picked (healthy or unknown first, overloaded or
//! loading as a last resort); a claimed slot is held by a guard released on every exit path;
//! a queued request waits at most `queue.timeout` and is refused with `Retry-After`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use http::StatusCode;

use super::prepare::Prepared;
use crate::config::{Config, PolicyKind};
use crate::fleet::queue::QueueError;
use crate::fleet::{Backend, LoadGuard};
use crate::gateway::Gateway;
use crate::openai::ApiError;
use crate::routing::{RouteInput, Router};
use crate::telemetry::access::AccessRecord;
use crate::telemetry::metrics as m;
use crate::telemetry::otel::Phase;
use opentelemetry::KeyValue;

/// How long clients are told to wait when no backend can take their request.
pub(super) const NO_BACKEND_RETRY_AFTER: Duration = Duration::from_secs(1);

/// While queued, route again at least this often (health changes free no slot).
pub(super) const QUEUE_RECHECK: Duration = Duration::from_millis(50);

/// Upper bound on routing rounds of one queued request.
pub(super) const MAX_QUEUE_ROUNDS: u32 = 100_000;

/// The backend chosen for one attempt, with its slot already taken.
pub(super) struct Claimed {
    /// Index into the request's candidates.
    pub(super) idx: usize,
    /// The request's share of the backend's load (and, under a cap, its slot).
    pub(super) guard: LoadGuard,
    /// Whether the request will queue inside the engine: its TTFT then says little about the
    /// backend's prefill speed.
    pub(super) queued: bool,
    /// Prompt tokens the backend held in its cache when it was chosen, by its KV events.
    pub(super) cached: Option<u64>,
    /// The request's use of its LoRA adapter there (so that adapter is not unloaded under it).
    pub(super) _adapter: Option<crate::fleet::adapters::AdapterUse>,
}

/// The backend for the next attempt: a native one first when some candidates serve only by
/// translation, else the policy's pick, waiting in the fair queue when all are at their cap.
/// With tracing, one routing span: candidates, the chosen backend, what routing expected there;
/// a wait in the fair queue is a `sluice.queue` span inside it.
pub(super) async fn pick(
    gw: &Gateway,
    config: &Config,
    p: &Prepared,
    tried: &[usize],
    record: &AccessRecord,
) -> Result<Option<Claimed>, ApiError> {
    let span = record.trace.as_ref().map(|t| t.phase("sluice.routing"));
    let mut claimed = match pick_native(gw, config, p, tried) {
        Some(claimed) => Ok(Some(claimed)),
        None => {
            let candidates = &p.resolved.candidates;
            let who = Waiter {
                tenant: &p.identity.tenant,
                span: span.as_ref(),
                asks: p
                    .background
                    .is_none()
                    .then_some(p.resolved.canonical.as_str()),
            };
            pick_or_wait(gw, config, p.policy, candidates, tried, &p.input, who).await
        }
    };
    if let Ok(Some(c)) = &mut claimed {
        if p.background.is_some() {
            c.guard.set_background();
        }
        let backend = &p.resolved.candidates[c.idx].0;
        // an interactive request over the cap took a slot a background one holds
        let over_cap = backend
            .cap()
            .is_some_and(|cap| backend.state.inflight_requests() > cap);
        match &p.background {
            Some(bg) => bg.routed(backend.name()),
            None => {
                // Lines that filled a backend idle of interactive traffic, over the bound
                // that holds again from this request on, give way too.
                let woke = backend.state.interactive_routed();
                let over = match woke.then(|| backend.state.background_allowance()) {
                    Some(Some(a)) => backend.state.background_requests().saturating_sub(a),
                    _ => 0,
                };
                for _ in 0..over + u64::from(c.queued || over_cap) {
                    gw.make_room
                        .ask(&p.resolved.canonical, Some(backend.name()));
                }
            }
        }
    }
    if let Some(span) = span {
        span.set(|| routed(p, tried, &claimed));
        if let Err(e) = &claimed {
            span.fail(e.label());
        }
        span.end();
    }
    claimed
}

/// The routing span's attributes.
fn routed(
    p: &Prepared,
    tried: &[usize],
    claimed: &Result<Option<Claimed>, ApiError>,
) -> Vec<KeyValue> {
    let mut attrs = vec![
        KeyValue::new("sluice.routing.policy", p.policy.as_str()),
        KeyValue::new(
            "sluice.routing.candidates",
            p.resolved.candidates.len() as i64,
        ),
        KeyValue::new("sluice.routing.tried", tried.len() as i64),
    ];
    if let Ok(Some(c)) = claimed {
        let backend = &p.resolved.candidates[c.idx].0;
        attrs.push(KeyValue::new("sluice.backend", backend.name().to_string()));
        attrs.push(KeyValue::new("sluice.routing.engine_queue", c.queued));
        // the score's expected seconds there (to the first token for a stream), with this
        // request's own load already claimed
        let (candidates, input) = (&p.resolved.candidates, &p.input);
        let expected = crate::routing::expected_head_seconds(candidates, c.idx, input, p.streaming);
        if expected < f64::MAX {
            attrs.push(KeyValue::new("sluice.routing.expected_seconds", expected));
        }
        if let Some(cached) = c.cached {
            attrs.push(KeyValue::new(
                "sluice.routing.cached_prefix_tokens",
                cached as i64,
            ));
        }
    }
    attrs
}

/// For a request some candidates serve only by translation: a backend that speaks its API
/// natively, when one can take it now (it keeps every field, and stored state where the engine
/// keeps it). `None`: no translation involved, or no native backend can take it now; the
/// normal pick then chooses among all candidates, so translated backends take the overflow
/// and the failover.
fn pick_native(gw: &Gateway, config: &Config, p: &Prepared, tried: &[usize]) -> Option<Claimed> {
    p.translation.as_ref()?;
    let candidates = &p.resolved.candidates;
    let mut excluded = tried.to_vec();
    excluded.extend((0..candidates.len()).filter(|i| !p.api.native(candidates[*i].0.kind())));
    excluded.sort_unstable();
    excluded.dedup();
    if excluded.len() >= candidates.len() {
        return None;
    }
    pick_and_claim(gw, config, p.policy, candidates, &excluded, &p.input)
}

/// Route, then take the chosen backend's slot. Routing reads the counters without holding
/// them, so a concurrent request can take the last slot between the pick and the claim; the
/// next pick then sees that backend full. Bounded: each lost race means another request got
/// a slot.
pub(super) fn pick_and_claim(
    gw: &Gateway,
    config: &Config,
    policy: PolicyKind,
    candidates: &[(Arc<Backend>, String)],
    tried: &[usize],
    input: &RouteInput,
) -> Option<Claimed> {
    for _ in 0..=candidates.len() {
        let idx = gw.router.pick(config, policy, candidates, tried, input)?;
        let (backend, backend_model) = &candidates[idx];
        let queued = crate::routing::score::would_queue(backend, backend_model);
        let cap = backend.cap();
        let cached = input.cached_on(backend);
        let yielding = backend.yielding_to(input.background);
        let load = input.load_given(cached);
        let Some(guard) = LoadGuard::claim(backend.state.clone(), load, cap, yielding.requests)
        else {
            continue;
        };
        let guard = if cap.is_some() {
            guard.waking(gw.queue.clone())
        } else {
            guard
        };
        let adapter = input.adapter.as_deref();
        return Some(Claimed {
            idx,
            guard,
            queued,
            cached,
            _adapter: adapter.map(|a| backend.state.adapters().begin(a)),
        });
    }
    None
}

/// Who waits in the fair queue: the tenant the queue is fair between, and the span a wait is
/// traced under (a `sluice.queue` span is made under it only when the request does wait).
pub(super) struct Waiter<'a> {
    pub(super) tenant: &'a str,
    pub(super) span: Option<&'a Phase>,
    /// The model to ask room of while waiting (`None`: a background request, which never asks).
    pub(super) asks: Option<&'a str>,
}

/// Pick a backend; when every untried routable candidate is at its concurrency cap, wait in the
/// gateway's fair queue (by tenant) for a slot, up to `queue.timeout`. `Ok(None)`: nothing is
/// routable (or all were tried); `Err`: the queue is full or the wait timed out (503 +
/// `Retry-After`).
pub(super) async fn pick_or_wait(
    gw: &Gateway,
    config: &Config,
    policy: PolicyKind,
    candidates: &[(Arc<Backend>, String)],
    tried: &[usize],
    input: &RouteInput,
    who: Waiter<'_>,
) -> Result<Option<Claimed>, ApiError> {
    if let Some(c) = pick_and_claim(gw, config, policy, candidates, tried, input) {
        return Ok(Some(c));
    }
    if !Router::saturated(candidates, tried, input) {
        return Ok(None);
    }
    let q = config.queue;
    let started = Instant::now();
    let deadline = tokio::time::Instant::now() + q.timeout;
    let refuse = |reason, why| queue_refusal(gw, reason, why);
    let mut ticket = match gw.queue.enter(who.tenant, 1.0, q.size) {
        Ok(t) => t,
        Err(e) => return Err(refuse("full", e)),
    };
    let depth = gw.queue.len();
    metrics::gauge!(m::QUEUE_DEPTH).set(depth as f64);
    let span = who.span.and_then(|s| s.child("sluice.queue"));
    let (waited, outcome) = 'wait: {
        for _ in 0..MAX_QUEUE_ROUNDS {
            if let Some(model) = who.asks {
                gw.make_room.ask(model, None);
            }
            if let Err(e) = ticket.wait(deadline, QUEUE_RECHECK).await {
                drop(ticket);
                metrics::histogram!(m::QUEUE_WAIT_SECONDS, "outcome" => "timeout")
                    .record(started.elapsed().as_secs_f64());
                break 'wait (Err(refuse("timeout", e)), "timeout");
            }
            if let Some(c) = pick_and_claim(gw, config, policy, candidates, tried, input) {
                drop(ticket);
                metrics::gauge!(m::QUEUE_DEPTH).set(gw.queue.len() as f64);
                metrics::histogram!(m::QUEUE_WAIT_SECONDS, "outcome" => "routed")
                    .record(started.elapsed().as_secs_f64());
                break 'wait (Ok(Some(c)), "routed");
            }
            if !Router::saturated(candidates, tried, input) {
                break 'wait (Ok(None), "unroutable");
            }
        }
        (Err(refuse("timeout", QueueError::Timeout)), "timeout")
    };
    if let Some(span) = span {
        end_queue_span(&span, &waited, outcome, depth, started.elapsed());
    }
    waited
}

/// The `sluice.queue` span's attributes, and its end: how the wait ended, how long it took,
/// how many were queued when the request joined them.
fn end_queue_span(
    span: &Phase,
    waited: &Result<Option<Claimed>, ApiError>,
    outcome: &'static str,
    depth: usize,
    took: Duration,
) {
    span.set(|| {
        [
            KeyValue::new("sluice.queue.outcome", outcome),
            KeyValue::new("sluice.queue.depth", depth as i64),
            KeyValue::new("sluice.queue.wait_ms", took.as_secs_f64() * 1000.0),
        ]
    });
    if let Err(e) = waited {
        span.fail(e.label());
    }
    span.end();
}

/// The 503 of a request the fair queue refused (`full`) or gave up on (`timeout`), counted.
fn queue_refusal(gw: &Gateway, reason: &'static str, why: QueueError) -> ApiError {
    metrics::counter!(m::QUEUE_REJECTIONS_TOTAL, "reason" => reason).increment(1);
    metrics::gauge!(m::QUEUE_DEPTH).set(gw.queue.len() as f64);
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "server_error",
        format!("Every backend for this model is at its concurrency limit ({why}). Please retry."),
    )
    .with_code(if reason == "full" {
        "queue_full"
    } else {
        "queue_timeout"
    })
    .with_retry_after(NO_BACKEND_RETRY_AFTER)
}
