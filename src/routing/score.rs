//! The token-aware score: the expected time, in seconds, for this request to finish on a
//! backend, from what the engine reports, what the gateway has in flight there and what it
//! has measured.
//!
//! ```text
//! busy      = max(gateway in-flight requests, engine running + waiting)   (engine: if fresh)
//!             − requests in flight that give way to this one (batch lines, for an interactive one;
//!               their tokens and pending prefill are left out of those below too)
//! slots     = learned full batch | max_concurrent (config or TGI /info) | per-kind default
//! ahead     = max(0, busy + 1 − slots)                  requests queued before this one
//! pending   = prompt tokens sent here whose first token has not come (pending prefill)
//! remaining = (pending / prefill_tps + (tokens in flight − pending) / decode_now)
//!             / gateway in-flight                                   per request in flight
//! wait      = ahead × remaining / slots
//! decode_now= decode_tps × (1 + busy_seen/slots) / (1 + busy/slots)  (batching slows decode)
//! TTFT      = wait + (pending + prompt) / prefill_tps
//! T         = TTFT + output / decode_now
//!             (+ KV pressure above 90%, + a model load when Ollama has it cold)
//! score     = T / weight
//! ```
//!
//! The gateway's tokens in flight are of two kinds: prompt tokens of requests whose first token
//! has not come yet (their prefill is still to do, at prefill speed) and expected output still
//! to stream (at decode speed); a request's prompt leaves the tokens in flight at its first
//! token. The pending prefill is also work the engine does before this request's own prefill
//! (and a step holding a prefill holds every request in it), so it is part of the expected
//! time to first token. Requests that are not streamed show no first token and count as
//! pending until they end.
//!
//! Speeds without measurements take the best of the candidates that have one (or the prior)
//! (else a fixed prior), so a new backend is neither shunned nor flooded; measurements then
//! move each backend to what it actually delivers, which is how a slow and a fast GPU end up
//! sharing the load in proportion to their speed without configuration.
//!
//! Invariant: the score is finite and non-negative for any input (no division by zero).

use std::sync::atomic::Ordering;

use crate::config::BackendKind;
use crate::fleet::adapters::{Setup, PRIOR_LOAD_SECONDS};
use crate::fleet::backend::monotonic_ms;
use crate::fleet::{Backend, Yielding};

/// Prior prefill speed (tokens/s per request) before anything is measured.
pub const PRIOR_PREFILL_TPS: f64 = 4000.0;
/// Prior decode speed (tokens/s per request) before anything is measured.
pub const PRIOR_DECODE_TPS: f64 = 40.0;
/// What a cold Ollama model costs to load, when nothing better is known.
pub const COLD_LOAD_SECONDS: f64 = 30.0;
/// KV usage above which preemption risk is priced in.
const KV_PRESSURE: f64 = 0.9;
/// Decode measurements older than this (ms) on an idle backend are relaxed towards the
/// fleet's best.
const STALE_SPEEDS_MS: u64 = 5_000;

/// Batch slots assumed when neither config, engine nor observation tell.
fn default_slots(kind: BackendKind) -> f64 {
    match kind {
        BackendKind::Vllm => 256.0,
        BackendKind::Tgi => 128.0,
        BackendKind::Ollama => 1.0, // OLLAMA_NUM_PARALLEL defaults to 1
        BackendKind::OpenAi => 64.0,
    }
}

/// What the score knows of the request.
#[derive(Debug, Clone, Copy)]
pub struct Request {
    pub prompt_tokens: u64,
    pub output_tokens: u64,
    /// What this backend must do before it can start it at all (a LoRA adapter to load or
    /// swap in).
    pub setup: Setup,
    /// What requests in flight there that give their slot up to this one hold (the
    /// background ones, for an interactive request: [`Backend::yielding_to`]). It does not
    /// count in its busy, tokens in flight or pending prefill.
    pub yielding: Yielding,
}

/// Relative distance below the candidates' fastest measured speed (prefill or decode) within
/// which a backend's speed counts as that fastest one (see [`breakdown`]).
pub const SPEED_NOISE: f64 = 0.15;

/// Speeds assumed for backends not measured yet (see [`Prior::of`]), and the candidates'
/// fastest measured speeds.
#[derive(Debug, Clone, Copy)]
pub struct Prior {
    pub prefill_tps: f64,
    pub decode_tps: f64,
    /// The fastest of the candidates' measured prefill speeds (two measured at least).
    pub prefill_top: Option<f64>,
    /// The fastest of the candidates' measured decode speeds (two measured at least).
    pub decode_top: Option<f64>,
    /// The shortest adapter load measured on the candidates: the price of a load on one not
    /// measured yet, so it is not priced out by the engine that happened to load first (which
    /// would then swap adapters alone while the other idles).
    pub load_seconds: Option<f64>,
}

/// The largest measured value of `f` over `backends`, when two at least are measured.
fn top(backends: &[&Backend], f: impl Fn(&Backend) -> Option<f64>) -> Option<f64> {
    let (n, max) = backends
        .iter()
        .filter_map(|b| f(b))
        .fold((0, f64::MIN), |(n, m), v| (n + 1, m.max(v)));
    (n >= 2).then_some(max)
}

/// `speed`, or `top` when `speed` is within [`SPEED_NOISE`] below it.
fn snap(speed: f64, top: Option<f64>) -> f64 {
    match top {
        Some(t) if speed >= t * (1.0 - SPEED_NOISE) => t,
        _ => speed,
    }
}

impl Prior {
    /// Optimistic: the fastest of the measured candidates or the fixed prior, whichever is
    /// higher. A backend nobody has measured yet is assumed to be as good as the best, so it
    /// gets the first samples that tell the truth instead of starving behind a measured one.
    pub fn of(backends: &[&Backend]) -> Prior {
        let fastest = |f: &dyn Fn(&Backend) -> Option<f64>, default: f64| {
            backends.iter().filter_map(|b| f(b)).fold(default, f64::max)
        };
        Prior {
            prefill_tps: fastest(&|b| b.state.speeds().prefill_tps.get(), PRIOR_PREFILL_TPS),
            decode_tps: fastest(&|b| b.state.speeds().decode_tps.get(), PRIOR_DECODE_TPS),
            prefill_top: top(backends, |b| b.state.speeds().prefill_tps.get()),
            decode_top: top(backends, |b| b.state.speeds().decode_tps.get()),
            load_seconds: backends
                .iter()
                .filter_map(|b| b.state.adapters().load_seconds())
                .reduce(f64::min),
        }
    }
}

/// The inputs and result of one backend's score (also shown in `/admin/backends`).
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct Breakdown {
    pub busy: f64,
    pub slots: f64,
    pub queued_ahead: f64,
    pub wait_seconds: f64,
    /// Requests sent here without a first token yet, and their estimated prompt tokens.
    pub pending_prefill_requests: f64,
    pub pending_prefill_tokens: f64,
    /// The pending prefill at this backend's prefill speed.
    pub pending_prefill_seconds: f64,
    /// This request's own prefill.
    pub prefill_seconds: f64,
    /// wait + pending prefill + own prefill.
    pub ttft_seconds: f64,
    pub decode_seconds: f64,
    pub penalty_seconds: f64,
    pub expected_seconds: f64,
    pub score: f64,
}

/// Batch slots of a backend, best source first.
pub fn slots(b: &Backend) -> f64 {
    let sig = b.state.signals();
    // What the engine was seen running at most (its real batch limit) beats any announced
    // admission limit (TGI's max_concurrent_requests admits more than it batches).
    // Learned from "running while others wait", which also holds for a moment whenever a
    // request arrives during an engine step (it waits for the next scheduling round) or the KV
    // cache, not the batch, is full: it can read low. What the engine runs right now is a
    // batch it demonstrably holds, so it is a floor.
    if let Some(s) = sig.learned_slots {
        let running = if sig.fresh() {
            sig.total.map_or(0.0, |t| t.running)
        } else {
            0.0
        };
        return (s as f64).max(running).max(1.0);
    }
    if let Some(c) = b.cap() {
        return (c as f64).max(1.0);
    }
    if let Some(s) = sig.max_concurrent {
        return (s as f64).max(1.0);
    }
    default_slots(b.kind())
}

/// Where [`slots`] comes from: `learned` (a full batch was seen), `configured`
/// (`max_concurrent`), `announced` (TGI's `/info`) or `default` (the kind's, nothing known).
pub fn slots_source(b: &Backend) -> &'static str {
    let sig = b.state.signals();
    if sig.learned_slots.is_some() {
        "learned"
    } else if b.cap().is_some() {
        "configured"
    } else if sig.max_concurrent.is_some() {
        "announced"
    } else {
        "default"
    }
}

/// Expected seconds to finish `req` on `b` (serving it as `model`).
pub fn breakdown(b: &Backend, model: &str, req: Request, prior: Prior) -> Breakdown {
    let st = &b.state;
    // Requests that give way to this one (batch lines, for an interactive request) leave it
    // their slots, and the step budget keeps what they add to each step small
    // (`batch::budget`): it is scored as if they were not there. (A line's answer is not
    // streamed, so its prompt would otherwise count as pending prefill until it ends.)
    let y = req.yielding;
    let gw_busy = st.inflight_requests().saturating_sub(y.requests) as f64;
    let gw_tokens = st.inflight_tokens().saturating_sub(y.tokens) as f64;
    let pending_requests = st
        .pending_prefill_requests()
        .saturating_sub(y.prefill_requests) as f64;
    // (the counters are read one by one: never more pending than in flight)
    let pending_tokens =
        (st.pending_prefill_tokens().saturating_sub(y.prefill_tokens) as f64).min(gw_tokens);
    let sig = st.signals();
    let engine = sig.fresh().then(|| sig.load_for(model)).flatten();
    let engine_busy = engine.map_or(0.0, |l| l.running + l.waiting);
    let busy = gw_busy.max(engine_busy - y.requests as f64).max(0.0);
    let slots = slots(b);

    let prefill_tps = st.speeds().prefill_tps.get().unwrap_or(prior.prefill_tps);
    let mut decode_tps = st.speeds().decode_tps.get().unwrap_or(prior.decode_tps);
    // An idle backend whose measurements are old gets the benefit of the doubt on its decode
    // speed, so one bad stretch cannot starve it of the samples that would correct it. Not on
    // its prefill speed: the request that pays for a wrong doubt is then one whose own
    // prefill is short (its decode retries the engine), never a long cold prompt priced at
    // the fleet's best prefill on an engine measured three times slower.
    let last = st.speeds().last_sample_ms.load(Ordering::Relaxed);
    if gw_busy < 1.0 && last != 0 && monotonic_ms().saturating_sub(last) > STALE_SPEEDS_MS {
        decode_tps = decode_tps.max(prior.decode_tps);
    }
    // Like engines measure speeds a few percent apart: each EWMA follows its own requests,
    // their batches and the prefills that stalled their steps. Times an expected output of
    // hundreds of tokens that noise is seconds' worth of score, more than the prefill a
    // cached prefix saves, so requests would leave the engine holding their prefix for the
    // one whose estimate happens to be higher (and replicas, each measuring its own traffic,
    // would disagree on it). A speed within `SPEED_NOISE` below the candidates' fastest counts
    // as the fastest; an engine clearly slower keeps its own.
    let decode_tps = snap(decode_tps, prior.decode_top);
    let prefill_tps = snap(prefill_tps, prior.prefill_top).max(1.0);
    let decode_tps = decode_tps.max(0.01);
    let busy_seen = st.speeds().busy_seen().unwrap_or(busy);
    // Decode per token grows with the batch: scale the measured speed from the batch it was
    // seen at to the batch this request would join.
    let decode_now =
        decode_tps * (1.0 + busy_seen.min(slots) / slots) / (1.0 + (busy + 1.0).min(slots) / slots);

    let queued_ahead = (busy + 1.0 - slots).max(0.0);
    // What a request in flight still has to do: its share of the pending prefill and of the
    // output to come (without gateway requests to go by, one like this one).
    let (prefill_work, decode_work) = if gw_busy >= 1.0 {
        (
            pending_tokens / gw_busy,
            (gw_tokens - pending_tokens).max(0.0) / gw_busy,
        )
    } else {
        (req.prompt_tokens as f64, req.output_tokens as f64)
    };
    let per_request = prefill_work / prefill_tps + decode_work / decode_now;
    let remaining = st
        .speeds()
        .service_seconds
        .get()
        .map_or(per_request, |s| s.min(per_request));
    let wait_seconds = queued_ahead * remaining / slots;
    let pending_prefill_seconds = pending_tokens / prefill_tps;
    let prefill_seconds = req.prompt_tokens as f64 / prefill_tps;
    let setup_seconds = match req.setup {
        Setup::Ready => 0.0,
        Setup::Load { measured } => measured
            .or(prior.load_seconds)
            .unwrap_or(PRIOR_LOAD_SECONDS),
    };
    let ttft_seconds = setup_seconds + wait_seconds + pending_prefill_seconds + prefill_seconds;
    let decode_seconds = req.output_tokens as f64 / decode_now;

    let mut penalty_seconds = 0.0;
    if let Some(kv) = engine.and_then(|l| l.kv_usage) {
        if kv > KV_PRESSURE {
            penalty_seconds += (kv - KV_PRESSURE) * 10.0 * (prefill_seconds + decode_seconds);
        }
    }
    if b.kind() == BackendKind::Ollama && sig.is_loaded(model) == Some(false) {
        penalty_seconds += COLD_LOAD_SECONDS;
    }
    let expected = ttft_seconds + decode_seconds + penalty_seconds;
    let expected = if expected.is_finite() {
        expected.max(0.0)
    } else {
        f64::MAX
    };
    Breakdown {
        busy,
        slots,
        queued_ahead,
        wait_seconds,
        pending_prefill_requests: pending_requests,
        pending_prefill_tokens: pending_tokens,
        pending_prefill_seconds,
        prefill_seconds,
        ttft_seconds,
        decode_seconds,
        penalty_seconds,
        expected_seconds: expected,
        score: expected / f64::from(b.config.weight.max(1)),
    }
}

/// Whether a request sent to `b` now would wait for a batch slot inside the engine: the
/// batch is full by the gateway's count or the engine's, or the engine reports requests
/// already waiting (it admits first come, first served), which holds even while the batch
/// limit is not yet learned.
pub fn would_queue(b: &Backend, model: &str) -> bool {
    free_slots(b, model) < 1.0
}

/// Batch slots of `b` that no request holds by the gateway's count or the engine's (the
/// larger of the two), 0 while the engine reports requests waiting.
pub fn free_slots(b: &Backend, model: &str) -> f64 {
    let gw = b.state.inflight_requests() as f64;
    let sig = b.state.signals();
    let engine = sig.fresh().then(|| sig.load_for(model)).flatten();
    let (engine_busy, engine_waiting) =
        engine.map_or((0.0, 0.0), |l| (l.running + l.waiting, l.waiting));
    if engine_waiting > 0.0 {
        return 0.0;
    }
    (slots(b) - gw.max(engine_busy)).max(0.0)
}

/// Whether the backend is an Ollama node known to have `model` loaded (`Some(false)`: known
/// cold; `None`: not Ollama or unknown).
pub fn warm(b: &Backend, model: &str) -> Option<bool> {
    if b.kind() != BackendKind::Ollama {
        return None;
    }
    b.state.signals().is_loaded(model)
}

/// A backend's measured profile for `/admin/profile` (the input of `sluice plan`'s measured
/// servers): batch slots, KV capacity when learned, the engine's own timing windows and the
/// step costs fitted to them (see [`crate::batching::fit`]), and the gateway's client-side
/// speeds as the fallback for engines that report no timing. `None` until either exists.
pub fn profile_view(b: &Backend) -> Option<serde_json::Value> {
    let sp = b.state.speeds();
    let prefill = sp.prefill_tps.get();
    let decode = sp.decode_tps.get();
    let windows = b.state.timings().windows();
    if windows.is_empty() && (prefill.is_none() || decode.is_none()) {
        return None;
    }
    let sig = b.state.signals();
    let mut v = serde_json::json!({
        "name": b.name(),
        "kind": b.kind().as_str(),
        "slots": slots(b).round() as u64,
        "slots_source": slots_source(b),
        "kv_capacity_tokens": sig.kv_capacity_tokens.or(sig.learned_kv_tokens),
        "samples": sp.samples.load(Ordering::Relaxed),
    });
    if let (Some(prefill), Some(decode)) = (prefill, decode) {
        v["prefill_tokens_per_second"] = prefill.into();
        v["decode"] = serde_json::json!([{
            "batch": sp.busy_seen().unwrap_or(1.0).max(1.0),
            "tokens_per_second": decode,
        }]);
    }
    if !windows.is_empty() {
        let (fit, error) = match crate::batching::fit::fit(&windows) {
            Ok(f) => (serde_json::to_value(f).ok(), None),
            Err(e) => (None, Some(e.to_string())),
        };
        v["engine"] = serde_json::json!({ "fit": fit, "fit_error": error, "windows": windows });
    }
    Some(v)
}

/// The score inputs of a backend for `/admin/backends`: engine signals, measured speeds, the
/// gateway's own counters (in flight, pending prefill) and the breakdown of a reference request (1000 prompt + 200 output tokens) on its first model.
pub fn admin_view(b: &Backend) -> serde_json::Value {
    let sig = b.state.signals();
    let sp = &b.state.speeds();
    let model = b.model_names().into_iter().next().unwrap_or_default();
    let backend_model = b.serves(&model).unwrap_or(model);
    let reference = breakdown(
        b,
        &backend_model,
        Request {
            prompt_tokens: 1000,
            output_tokens: 200,
            setup: Setup::Ready,
            yielding: Yielding::NONE,
        },
        Prior::of(&[b]),
    );
    serde_json::json!({
        "signals": {
            "fresh": sig.fresh(),
            "age_ms": (sig.at_ms > 0).then(|| crate::fleet::backend::monotonic_ms().saturating_sub(sig.at_ms)),
            "running": sig.total.map(|t| t.running),
            "waiting": sig.total.map(|t| t.waiting),
            "kv_cache_usage": sig.total.and_then(|t| t.kv_usage),
            "batch_max_tokens": sig.batch_max_tokens,
            "max_concurrent": sig.max_concurrent,
            "max_total_tokens": sig.max_total_tokens,
            "learned_slots": sig.learned_slots,
            "learned_kv_tokens": sig.learned_kv_tokens,
            "loaded_models": sig.loaded,
            "prefix_cache_queries": sig.prefix_queries,
            "prefix_cache_hits": sig.prefix_hits,
        },
        "speeds": {
            "ttft_seconds": sp.ttft_seconds.get(),
            "prefill_tokens_per_second": sp.prefill_tps.get(),
            "decode_tokens_per_second": sp.decode_tps.get(),
            "service_seconds": sp.service_seconds.get(),
            "busy_seen": sp.busy_seen(),
            "samples": sp.samples.load(Ordering::Relaxed),
            // prefix-affinity weight: capacity at a full batch, and its quantised step
            "capacity_tokens_per_second": super::affinity::learned_capacity(b),
            "home_level": sp.home_level.get(),
        },
        "gateway": {
            "inflight_requests": b.state.inflight_requests(),
            "inflight_tokens": b.state.inflight_tokens(),
            "pending_prefill_requests": b.state.pending_prefill_requests(),
            "pending_prefill_tokens": b.state.pending_prefill_tokens(),
        },
        "slots": reference.slots,
        "reference_request": reference,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{BackendConfig, Timeouts};
    use crate::fleet::signals::{ModelLoad, Signals};
    use crate::fleet::speed::Observation;
    use crate::fleet::{BackendState, Load, LoadGuard};
    use std::sync::Arc;
    use std::time::Duration;

    fn backend(kind: BackendKind, max_concurrent: Option<u32>) -> Backend {
        Backend::new(
            BackendConfig {
                name: "b".into(),
                kind,
                url: "http://127.0.0.1:1".parse().unwrap(),
                models: vec!["m".into()],
                model_names: Default::default(),
                api_key: None,
                weight: 1,
                max_concurrent,
                health_path: None,
                kv_events: Default::default(),
                max_adapters: None,
                lora_adapters: Vec::new(),
                timeouts: Timeouts::default(),
            },
            Arc::new(BackendState::new()),
        )
    }

    const REQ: Request = Request {
        prompt_tokens: 1000,
        output_tokens: 100,
        setup: Setup::Ready,
        yielding: Yielding::NONE,
    };
    const PRIOR: Prior = Prior {
        prefill_tps: 1000.0,
        decode_tps: 50.0,
        prefill_top: None,
        decode_top: None,
        load_seconds: None,
    };

    fn measure(b: &Backend, decode_tps: f64) {
        for _ in 0..10 {
            b.state.speeds().observe(
                &Observation {
                    prompt_tokens: 1000,
                    cached_tokens: 0,
                    completion_tokens: 101,
                    ttft: Some(Duration::from_millis(500)),
                    total: Duration::from_secs_f64(0.5 + 100.0 / decode_tps),
                    queued: false,
                },
                1.0,
            );
        }
    }

    /// Engines measured a few percent apart in decode speed are scored alike (the noise of
    /// their EWMAs would outweigh the prefill a cached prefix saves); one clearly slower keeps
    /// its own speed.
    #[test]
    fn decode_speeds_within_noise_of_the_fastest_count_as_it() {
        let (a, b, c, slow) = (
            backend(BackendKind::Vllm, None),
            backend(BackendKind::Vllm, None),
            backend(BackendKind::Vllm, None),
            backend(BackendKind::Vllm, None),
        );
        measure(&a, 100.0);
        measure(&b, 94.0);
        measure(&c, 97.0);
        measure(&slow, 50.0);
        let prior = Prior::of(&[&a, &b, &c, &slow]);
        assert!(prior.decode_top.is_some_and(|c| (c - 100.0).abs() < 1e-6));
        let s = |x: &Backend| breakdown(x, "m", REQ, prior);
        assert_eq!(s(&a).decode_seconds, s(&b).decode_seconds);
        assert_eq!(s(&a).score, s(&c).score);
        assert!(s(&slow).decode_seconds > 1.8 * s(&a).decode_seconds);
        // one measured candidate has no common speed: its own
        let alone = Prior::of(&[&b]);
        assert_eq!(alone.decode_top, None);
        assert!(breakdown(&b, "m", REQ, alone).decode_seconds > s(&a).decode_seconds);
    }

    /// Prefill speeds within the noise of the fastest are scored alike too; one 25% slower
    /// keeps its own.
    #[test]
    fn prefill_speeds_within_noise_of_the_fastest_count_as_it() {
        let measured = |prefill_tps: f64| {
            let b = backend(BackendKind::Vllm, None);
            for _ in 0..10 {
                b.state.speeds().observe(
                    &Observation {
                        prompt_tokens: 1000,
                        cached_tokens: 0,
                        completion_tokens: 101,
                        ttft: Some(Duration::from_secs_f64(1000.0 / prefill_tps)),
                        total: Duration::from_secs_f64(1000.0 / prefill_tps + 2.0),
                        queued: false,
                    },
                    1.0,
                );
            }
            b
        };
        let (a, b, slow) = (measured(2000.0), measured(1800.0), measured(1500.0));
        let prior = Prior::of(&[&a, &b, &slow]);
        let s = |x: &Backend| breakdown(x, "m", REQ, prior);
        assert_eq!(s(&a).prefill_seconds, s(&b).prefill_seconds);
        assert!((s(&a).prefill_seconds - 0.5).abs() < 1e-6);
        assert!((s(&slow).prefill_seconds - 1000.0 / 1500.0).abs() < 1e-6);
    }

    /// A load is priced at the engine's own measured load time, else the shortest measured on
    /// the candidates, else the fixed prior: an engine that never loaded is not priced out by
    /// the one that happened to load first.
    #[test]
    fn an_engine_that_never_loaded_pays_the_candidates_shortest_load() {
        let (a, b) = (
            backend(BackendKind::Vllm, None),
            backend(BackendKind::Vllm, None),
        );
        let req = |x: &Backend| Request {
            setup: x.state.adapters().setup("x"),
            ..REQ
        };
        let ttft = |x: &Backend, prior| breakdown(x, "m", req(x), prior).ttft_seconds;
        let base = breakdown(&a, "m", REQ, Prior::of(&[&a, &b])).ttft_seconds;
        assert!((ttft(&a, Prior::of(&[&a, &b])) - base - PRIOR_LOAD_SECONDS).abs() < 1e-9);
        a.state
            .adapters()
            .loaded("y", "m", Duration::from_millis(20));
        let prior = Prior::of(&[&a, &b]);
        assert!((ttft(&a, prior) - base - 0.02).abs() < 1e-9);
        assert!((ttft(&b, prior) - base - 0.02).abs() < 1e-9);
        // held and no slot information: ready
        a.state
            .adapters()
            .loaded("x", "m", Duration::from_millis(20));
        assert!((ttft(&a, prior) - base).abs() < 1e-9);
    }

    /// An idle engine measured slow a while ago is retried on its decode speed (the fleet's
    /// best), not its prefill speed: a long cold prompt is not the request that pays for it.
    #[test]
    fn a_stale_idle_backend_is_retried_on_decode_not_prefill() {
        let clock = crate::fleet::clock::Virtual::install(1_000, 1);
        let (fast, slow) = (
            backend(BackendKind::Vllm, None),
            backend(BackendKind::Vllm, None),
        );
        let measure_at = |b: &Backend, prefill_tps: f64, decode_tps: f64| {
            for _ in 0..10 {
                b.state.speeds().observe(
                    &Observation {
                        prompt_tokens: 1000,
                        cached_tokens: 0,
                        completion_tokens: 101,
                        ttft: Some(Duration::from_secs_f64(1000.0 / prefill_tps)),
                        total: Duration::from_secs_f64(1000.0 / prefill_tps + 100.0 / decode_tps),
                        queued: false,
                    },
                    1.0,
                );
            }
        };
        measure_at(&slow, 1000.0, 50.0);
        clock.set_ms(1_000 + STALE_SPEEDS_MS + 1);
        measure_at(&fast, 3000.0, 100.0);
        let prior = Prior::of(&[&fast, &slow]);
        let long = Request {
            prompt_tokens: 20_000,
            output_tokens: 100,
            setup: Setup::Ready,
            yielding: Yielding::NONE,
        };
        let (f, s) = (
            breakdown(&fast, "m", long, prior),
            breakdown(&slow, "m", long, prior),
        );
        assert!((s.prefill_seconds - 20.0).abs() < 1e-6, "{s:?}");
        assert!((s.decode_seconds - f.decode_seconds).abs() < 1e-9);
        assert!(s.score > f.score);
    }

    #[test]
    fn idle_backend_costs_prefill_plus_decode() {
        let b = backend(BackendKind::Vllm, None);
        let s = breakdown(&b, "m", REQ, PRIOR);
        assert_eq!(s.wait_seconds, 0.0);
        assert!((s.prefill_seconds - 1.0).abs() < 1e-9);
        // decode at a batch of 1 of 256 slots: about 2.0 s
        assert!((s.decode_seconds - 2.0).abs() < 0.05, "{s:?}");
        assert!(s.score.is_finite());
    }

    #[test]
    fn measured_fast_backend_scores_lower_than_slow() {
        let fast = backend(BackendKind::Vllm, None);
        let slow = backend(BackendKind::Vllm, None);
        measure(&fast, 100.0);
        measure(&slow, 25.0);
        let prior = Prior::of(&[&fast, &slow]);
        assert!(prior.decode_tps >= 100.0, "optimistic prior: {prior:?}");
        let f = breakdown(&fast, "m", REQ, prior);
        let s = breakdown(&slow, "m", REQ, prior);
        assert!(f.score * 2.5 < s.score, "{f:?} vs {s:?}");
    }

    #[test]
    fn a_request_behind_waiting_ones_would_queue_before_the_batch_limit_is_known() {
        let b = backend(BackendKind::Vllm, None);
        assert!(!would_queue(&b, "m"));
        let load = |running, waiting| {
            let mut sig = Signals {
                at_ms: crate::fleet::backend::monotonic_ms().max(1),
                interval_ms: 1000,
                ..Signals::default()
            };
            sig.per_model.insert(
                "m".into(),
                ModelLoad {
                    running,
                    waiting,
                    kv_usage: None,
                },
            );
            sig
        };
        // the default batch limit (256) is far; nothing waits
        b.state.set_signals(load(12.0, 0.0));
        assert!(!would_queue(&b, "m"));
        // the engine holds requests back at 12: one more waits behind them
        b.state.set_signals(load(12.0, 3.0));
        assert!(would_queue(&b, "m"));
    }

    #[test]
    fn requests_that_give_way_are_not_load_for_the_one_they_give_way_to() {
        let b = backend(BackendKind::Vllm, Some(4));
        let quiet = breakdown(&b, "m", REQ, PRIOR);
        let guards: Vec<LoadGuard> = (0..4)
            .map(|_| {
                let mut g = LoadGuard::claim(b.state.clone(), Load::new(100, 60), None, 0).unwrap();
                g.set_background();
                g
            })
            .collect();
        let interactive = Request {
            yielding: b.yielding_to(false),
            ..REQ
        };
        let given_way = breakdown(&b, "m", interactive, PRIOR);
        assert_eq!(given_way.busy, 0.0);
        assert_eq!(given_way.queued_ahead, 0.0);
        assert_eq!(given_way.decode_seconds, quiet.decode_seconds);
        // a line's answer is not streamed: its prompt stays a pending prefill until it ends,
        // which is no work ahead of the request it gives way to
        assert_eq!(given_way.pending_prefill_tokens, 0.0);
        assert_eq!(given_way.ttft_seconds, quiet.ttft_seconds);
        let background = Request {
            yielding: b.yielding_to(true),
            ..REQ
        };
        let full = breakdown(&b, "m", background, PRIOR);
        assert_eq!((full.busy, full.queued_ahead), (4.0, 1.0));
        assert_eq!(full.pending_prefill_tokens, 240.0);
        assert!(full.wait_seconds > 0.0 && given_way.wait_seconds == 0.0);
        drop(guards);
    }

    #[test]
    fn a_deep_engine_queue_costs_waiting_time() {
        let b = backend(BackendKind::Vllm, None);
        let quiet = breakdown(&b, "m", REQ, PRIOR);
        let mut sig = Signals {
            at_ms: crate::fleet::backend::monotonic_ms().max(1),
            interval_ms: 1000,
            learned_slots: Some(4),
            ..Signals::default()
        };
        sig.per_model.insert(
            "m".into(),
            ModelLoad {
                running: 4.0,
                waiting: 20.0,
                kv_usage: Some(0.5),
            },
        );
        b.state.set_signals(sig);
        let busy = breakdown(&b, "m", REQ, PRIOR);
        assert_eq!(busy.busy, 24.0);
        assert_eq!(busy.queued_ahead, 21.0);
        assert!(busy.wait_seconds > 5.0, "{busy:?}");
        assert!(busy.score > quiet.score * 3.0);
        // a stale snapshot is ignored
        let mut old = (**b.state.signals()).clone();
        old.at_ms = 1;
        b.state.set_signals(old);
        if crate::fleet::backend::monotonic_ms() > 10_000 {
            assert_eq!(breakdown(&b, "m", REQ, PRIOR).busy, 0.0);
        }
    }

    #[test]
    fn gateway_tokens_in_flight_count_at_a_capped_backend() {
        let b = backend(BackendKind::Vllm, Some(2));
        let _g: Vec<_> = (0..4)
            .map(|_| LoadGuard::new(b.state.clone(), 2000))
            .collect();
        let s = breakdown(&b, "m", REQ, PRIOR);
        assert_eq!(s.slots, 2.0);
        assert_eq!(s.queued_ahead, 3.0);
        assert!(s.wait_seconds > 10.0, "{s:?}");
    }

    #[test]
    fn a_big_pending_prefill_loses_to_an_otherwise_equal_backend() {
        let pending = backend(BackendKind::Vllm, None);
        let started = backend(BackendKind::Vllm, None);
        measure(&pending, 50.0);
        measure(&started, 50.0);
        let prior = Prior::of(&[&pending, &started]);
        // one request and 5600 tokens in flight on each; on one, 5000 of them are a prompt
        // still to prefill, on the other everything is output to decode
        let _a = LoadGuard::new(pending.state.clone(), Load::new(5600, 5000));
        let _b = LoadGuard::new(started.state.clone(), Load::new(5600, 0));
        let p = breakdown(&pending, "m", REQ, prior);
        let s = breakdown(&started, "m", REQ, prior);
        assert_eq!((p.busy, p.pending_prefill_tokens), (1.0, 5000.0));
        assert_eq!((s.busy, s.pending_prefill_tokens), (1.0, 0.0));
        // measured prefill: 1000 tokens in 0.5 s
        assert!((p.pending_prefill_seconds - 2.5).abs() < 1e-6, "{p:?}");
        assert!(
            (p.ttft_seconds - s.ttft_seconds - 2.5).abs() < 1e-6,
            "{p:?} vs {s:?}"
        );
        assert!(p.score > s.score + 2.0, "{p:?} vs {s:?}");
    }

    #[test]
    fn the_first_token_ends_a_pending_prefill_and_its_prompt() {
        let b = backend(BackendKind::Vllm, Some(1));
        measure(&b, 50.0);
        let prior = Prior::of(&[&b]);
        let mut g = LoadGuard::new(b.state.clone(), Load::new(5100, 5000));
        let before = breakdown(&b, "m", REQ, prior);
        // one slot, taken: this request waits for the one in flight, prefill included
        assert_eq!(before.queued_ahead, 1.0);
        g.first_token();
        let after = breakdown(&b, "m", REQ, prior);
        assert_eq!(after.pending_prefill_tokens, 0.0);
        assert!(
            after.wait_seconds < before.wait_seconds,
            "{before:?} vs {after:?}"
        );
        assert!(
            before.ttft_seconds - after.ttft_seconds > 2.5,
            "{before:?} vs {after:?}"
        );
    }

    #[test]
    fn a_tgi_batch_at_its_learned_kv_budget_costs_more_than_one_with_room() {
        let scrape = |b: &Backend, held: u64| {
            let text = format!(
                "tgi_queue_size 0\ntgi_batch_current_size 4\ntgi_batch_current_max_tokens {held}\n"
            );
            // a budget of 40k tokens learned earlier, carried into this scrape
            let learned = Signals {
                learned_slots: Some(16),
                learned_kv_tokens: Some(40_000),
                ..Signals::default()
            };
            let mut sig =
                crate::fleet::signals::merge(&learned, crate::fleet::signals::parse_tgi(&text));
            sig.at_ms = crate::fleet::backend::monotonic_ms().max(1);
            sig.interval_ms = 1000;
            b.state.set_signals(sig);
        };
        let full = backend(BackendKind::Tgi, None);
        let room = backend(BackendKind::Tgi, None);
        scrape(&full, 40_000);
        scrape(&room, 20_000);
        let f = breakdown(&full, "m", REQ, PRIOR);
        let r = breakdown(&room, "m", REQ, PRIOR);
        // same batch, same queue: only the KV budget tells them apart
        assert_eq!((f.busy, f.queued_ahead), (r.busy, r.queued_ahead));
        assert_eq!(r.penalty_seconds, 0.0, "{r:?}");
        assert!(
            f.penalty_seconds > 0.9 * (f.prefill_seconds + f.decode_seconds),
            "{f:?}"
        );
        assert!(f.score > r.score * 1.8, "{f:?} vs {r:?}");
    }

    #[test]
    fn cold_ollama_pays_a_load_and_weights_divide() {
        let b = backend(BackendKind::Ollama, None);
        b.state.set_signals(Signals {
            at_ms: crate::fleet::backend::monotonic_ms().max(1),
            interval_ms: 1000,
            loaded: Some(vec!["other:latest".into()]),
            ..Signals::default()
        });
        assert_eq!(warm(&b, "m"), Some(false));
        let s = breakdown(&b, "m", REQ, PRIOR);
        assert!(s.penalty_seconds >= COLD_LOAD_SECONDS);
        let v = backend(BackendKind::Vllm, None);
        assert_eq!(warm(&v, "m"), None);
    }

    #[test]
    fn a_batch_running_now_is_a_floor_under_learned_slots() {
        let b = backend(BackendKind::Vllm, None);
        let load = ModelLoad {
            running: 12.0,
            waiting: 1.0,
            kv_usage: Some(0.3),
        };
        let mut sig = Signals {
            at_ms: crate::fleet::backend::monotonic_ms().max(1),
            interval_ms: 1000,
            // learned when a full KV cache held the batch at 4
            learned_slots: Some(4),
            total: Some(load),
            ..Signals::default()
        };
        sig.per_model.insert("m".into(), load);
        b.state.set_signals(sig);
        let s = breakdown(&b, "m", REQ, PRIOR);
        assert_eq!(s.slots, 12.0, "{s:?}");
        // 13 in the engine plus this one on 12 slots: 2 queued ahead, not 10
        assert_eq!(s.queued_ahead, 2.0, "{s:?}");
    }
}
