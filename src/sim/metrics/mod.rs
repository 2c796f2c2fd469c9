//! Statistics of the simulator and their Prometheus exposition in each engine's own dialect.
//!
//! [`ModelStats`] holds per-model gauges (written by the scheduler), counters and histograms;
//! [`Counters`] holds per-simulator request counters (by HTTP status) used by `/sim/state` and
//! by TGI's `tgi_request_*` series. Everything is lock-free atomics so the zero-delay fast path
//! stays cheap. What is observed when (per engine step, per finished request) lives in
//! `observe`; the texts in `vllm` (vLLM 0.32) and `tgi` (TGI 3.3, metrics-exporter-prometheus).
//!
//! Invariants: vLLM series use vLLM 0.32's names, HELP texts, bucket bounds, float formatting
//! (prometheus_client's `floatToGoString`) and alphabetical label order
//! (`engine`, [`finished_reason`|`le`], `model_name`, [`source`]), with `model_name` = the first
//! served name; TGI series use the `tgi_*` names, bucket layouts and label (`method`) of TGI's
//! router; Ollama has none.

mod observe;
mod tgi;
mod vllm;

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use super::config::SimKind;

pub(crate) use observe::{FinishObs, StepObs};
pub(crate) use tgi::render_tgi;
pub(crate) use vllm::render_vllm;

/// A Prometheus histogram with fixed bounds.
pub(crate) struct Histogram {
    bounds: Box<[f64]>,
    buckets: Vec<AtomicU64>,
    count: AtomicU64,
    sum_bits: AtomicU64,
}

impl Histogram {
    pub(crate) fn new(bounds: &[f64]) -> Self {
        Histogram {
            bounds: bounds.into(),
            buckets: (0..bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            count: AtomicU64::new(0),
            sum_bits: AtomicU64::new(0f64.to_bits()),
        }
    }

    pub(crate) fn observe(&self, v: f64) {
        self.observe_n(v, 1);
    }

    /// Observe `v` `n` times at the cost of one observation.
    pub(crate) fn observe_n(&self, v: f64, n: u64) {
        if n == 0 {
            return;
        }
        if let Some(i) = self.bounds.iter().position(|b| v <= *b) {
            self.buckets[i].fetch_add(n, Relaxed);
        }
        self.count.fetch_add(n, Relaxed);
        let add = v * n as f64;
        if add == 0.0 {
            return;
        }
        let mut cur = self.sum_bits.load(Relaxed);
        loop {
            let new = (f64::from_bits(cur) + add).to_bits();
            match self
                .sum_bits
                .compare_exchange_weak(cur, new, Relaxed, Relaxed)
            {
                Ok(_) => break,
                Err(x) => cur = x,
            }
        }
    }

    pub(crate) fn count(&self) -> u64 {
        self.count.load(Relaxed)
    }

    pub(crate) fn sum(&self) -> f64 {
        f64::from_bits(self.sum_bits.load(Relaxed))
    }

    /// (upper bound, cumulative count) pairs, without +Inf.
    fn cumulative(&self) -> Vec<(f64, u64)> {
        let mut acc = 0;
        self.bounds
            .iter()
            .zip(&self.buckets)
            .map(|(b, c)| {
                acc += c.load(Relaxed);
                (*b, acc)
            })
            .collect()
    }
}

/// vLLM's TTFT buckets.
pub(crate) const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// vLLM's request latency buckets (e2e, queue, inference, prefill, decode).
pub(crate) const LATENCY_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];
/// vLLM's inter-token latency and time-per-output-token buckets.
const ITL_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
/// vLLM's tokens-per-engine-step buckets.
const ITERATION_BUCKETS: &[f64] = &[
    1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0,
];
/// vLLM's `n` parameter buckets.
const PARAMS_N_BUCKETS: &[f64] = &[1.0, 2.0, 5.0, 10.0, 20.0];
/// vLLM's preemptions-per-request buckets.
const PREEMPTION_BUCKETS: &[f64] = &[1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 20.0];

/// vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, … up to `max` (its `max_model_len`).
fn one_two_five(max: u32) -> Vec<f64> {
    let max = u64::from(max);
    let mut out = Vec::new();
    let mut scale = 1u64;
    loop {
        for m in [1u64, 2, 5] {
            let v = m.saturating_mul(scale);
            if v > max || out.len() >= 64 {
                return out;
            }
            out.push(v as f64);
        }
        scale = scale.saturating_mul(10);
    }
}

/// TGI's duration buckets (every `*duration` series): 35 steps of ×1.5 above 0.1 ms.
fn tgi_duration_buckets() -> Vec<f64> {
    let mut v = 0.0001;
    (0..35)
        .map(|_| {
            v *= 1.5;
            v
        })
        .collect()
}

/// TGI's token-count buckets: 100 equal steps up to `max`.
fn tgi_hundredths(max: u32) -> Vec<f64> {
    (0..100)
        .map(|x| (f64::from(max) / 100.0) * f64::from(x + 1))
        .collect()
}

/// Which engine's per-step and per-request series the scheduler records.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Dialect {
    Vllm,
    Tgi,
    /// No `/metrics` (Ollama): only the common counters.
    Plain,
}

impl From<SimKind> for Dialect {
    fn from(k: SimKind) -> Self {
        match k {
            SimKind::Vllm => Dialect::Vllm,
            SimKind::Tgi => Dialect::Tgi,
            SimKind::Ollama => Dialect::Plain,
        }
    }
}

/// vLLM's per-request and per-step histograms.
pub(crate) struct VllmHists {
    pub ttft: Histogram,
    pub itl: Histogram,
    pub tpot: Histogram,
    pub e2e: Histogram,
    pub queue_time: Histogram,
    pub inference_time: Histogram,
    pub prefill_time: Histogram,
    pub decode_time: Histogram,
    pub prompt_tokens: Histogram,
    pub generation_tokens: Histogram,
    pub iteration_tokens: Histogram,
    pub max_generation_tokens: Histogram,
    pub params_n: Histogram,
    pub params_max_tokens: Histogram,
    pub preemptions: Histogram,
    pub prefill_kv_computed: Histogram,
}

impl VllmHists {
    fn new(max_model_len: u32) -> Self {
        let tokens = one_two_five(max_model_len);
        VllmHists {
            ttft: Histogram::new(TTFT_BUCKETS),
            itl: Histogram::new(ITL_BUCKETS),
            tpot: Histogram::new(ITL_BUCKETS),
            e2e: Histogram::new(LATENCY_BUCKETS),
            queue_time: Histogram::new(LATENCY_BUCKETS),
            inference_time: Histogram::new(LATENCY_BUCKETS),
            prefill_time: Histogram::new(LATENCY_BUCKETS),
            decode_time: Histogram::new(LATENCY_BUCKETS),
            prompt_tokens: Histogram::new(&tokens),
            generation_tokens: Histogram::new(&tokens),
            iteration_tokens: Histogram::new(ITERATION_BUCKETS),
            max_generation_tokens: Histogram::new(&tokens),
            params_n: Histogram::new(PARAMS_N_BUCKETS),
            params_max_tokens: Histogram::new(&tokens),
            preemptions: Histogram::new(PREEMPTION_BUCKETS),
            prefill_kv_computed: Histogram::new(&tokens),
        }
    }
}

/// TGI's per-forward-pass histograms (label `method`).
pub(crate) struct TgiForwards {
    pub prefill: Histogram,
    pub decode: Histogram,
    pub next_size: Histogram,
}

impl TgiForwards {
    fn new() -> Self {
        let durations = tgi_duration_buckets();
        let sizes: Vec<f64> = (1..=1024).map(f64::from).collect();
        TgiForwards {
            prefill: Histogram::new(&durations),
            decode: Histogram::new(&durations),
            next_size: Histogram::new(&sizes),
        }
    }
}

/// Per-model statistics.
pub(crate) struct ModelStats {
    pub dialect: Dialect,
    /// Requests submitted and not admitted yet, at once (TGI's queue gauge moves on arrival;
    /// admission limits count these).
    pub waiting: AtomicU64,
    /// Requests the scheduler left waiting at its last admission round: vLLM's
    /// `num_requests_waiting`, which its scheduler reports after each step, so a request that
    /// arrives during a step and is admitted at the next one never shows as waiting.
    pub waiting_scheduled: AtomicU64,
    /// Of those, the ones the last round deferred because their LoRA adapter had no slot
    /// (vLLM's `num_requests_waiting_by_reason{reason="deferred"}`).
    pub waiting_deferred: AtomicU64,
    pub running: AtomicU64,
    pub kv_used_tokens: AtomicU64,
    pub kv_reserved_tokens: AtomicU64,
    pub kv_capacity_tokens: AtomicU64,
    pub batch_max_tokens: AtomicU64,
    pub prefix_queries: AtomicU64,
    pub prefix_hits: AtomicU64,
    /// Prompt tokens of the requests whose prefill completed (vLLM's `prompt_tokens`).
    pub prompt_tokens: AtomicU64,
    /// Of those, the ones served from the prefix cache (the rest were computed).
    pub prompt_cached: AtomicU64,
    pub generation_tokens: AtomicU64,
    pub preemptions: AtomicU64,
    pub iterations: AtomicU64,
    pub aborted: AtomicU64,
    pub success_stop: AtomicU64,
    pub success_length: AtomicU64,
    pub vllm: VllmHists,
    pub tgi: TgiForwards,
    created: f64,
}

impl ModelStats {
    pub(crate) fn new(kind: SimKind, kv_capacity: u64, max_model_len: u32) -> Self {
        ModelStats {
            dialect: kind.into(),
            waiting: AtomicU64::new(0),
            waiting_scheduled: AtomicU64::new(0),
            waiting_deferred: AtomicU64::new(0),
            running: AtomicU64::new(0),
            kv_used_tokens: AtomicU64::new(0),
            kv_reserved_tokens: AtomicU64::new(0),
            kv_capacity_tokens: AtomicU64::new(kv_capacity),
            batch_max_tokens: AtomicU64::new(0),
            prefix_queries: AtomicU64::new(0),
            prefix_hits: AtomicU64::new(0),
            prompt_tokens: AtomicU64::new(0),
            prompt_cached: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            preemptions: AtomicU64::new(0),
            iterations: AtomicU64::new(0),
            aborted: AtomicU64::new(0),
            success_stop: AtomicU64::new(0),
            success_length: AtomicU64::new(0),
            vllm: VllmHists::new(max_model_len),
            tgi: TgiForwards::new(),
            created: super::unix_now_f64(),
        }
    }

    /// KV-cache usage in 0..1 (tokens held by running sequences / capacity).
    pub(crate) fn kv_usage(&self) -> f64 {
        let cap = self.kv_capacity_tokens.load(Relaxed).max(1);
        (self.kv_used_tokens.load(Relaxed) as f64 / cap as f64).min(1.0)
    }
}

/// Per-simulator request counters, and TGI's per-request histograms (its router records them
/// when an answer is complete, except the input length, recorded at validation).
pub(crate) struct Counters {
    pub requests_total: AtomicU64,
    by_status: Vec<AtomicU64>,
    pub tokens_in: AtomicU64,
    pub tokens_out: AtomicU64,
    pub overloaded: AtomicU64,
    pub validation: AtomicU64,
    /// Inference requests received / completed (TGI's `tgi_request_count` / `_success`).
    pub infer_total: AtomicU64,
    pub infer_success: AtomicU64,
    pub tgi_duration: Histogram,
    pub tgi_queue: Histogram,
    pub tgi_inference: Histogram,
    pub tgi_time_per_token: Histogram,
    pub tgi_input_length: Histogram,
    pub tgi_generated_tokens: Histogram,
}

impl Counters {
    /// With TGI's `max_input_tokens` and `max_total_tokens`, which lay out its token buckets.
    pub(crate) fn new(max_input_tokens: u32, max_total_tokens: u32) -> Self {
        let durations = tgi_duration_buckets();
        Counters {
            requests_total: AtomicU64::new(0),
            by_status: (0..600).map(|_| AtomicU64::new(0)).collect(),
            tokens_in: AtomicU64::new(0),
            tokens_out: AtomicU64::new(0),
            overloaded: AtomicU64::new(0),
            validation: AtomicU64::new(0),
            infer_total: AtomicU64::new(0),
            infer_success: AtomicU64::new(0),
            tgi_duration: Histogram::new(&durations),
            tgi_queue: Histogram::new(&durations),
            tgi_inference: Histogram::new(&durations),
            tgi_time_per_token: Histogram::new(&durations),
            tgi_input_length: Histogram::new(&tgi_hundredths(max_input_tokens)),
            tgi_generated_tokens: Histogram::new(&tgi_hundredths(max_total_tokens)),
        }
    }

    pub(crate) fn status(&self, code: u16) {
        self.requests_total.fetch_add(1, Relaxed);
        if let Some(c) = self.by_status.get(code as usize) {
            c.fetch_add(1, Relaxed);
        }
    }

    /// Non-zero status counts.
    pub(crate) fn statuses(&self) -> Vec<(u16, u64)> {
        self.by_status
            .iter()
            .enumerate()
            .filter_map(|(i, c)| {
                let v = c.load(Relaxed);
                (v > 0).then_some((i as u16, v))
            })
            .collect()
    }
}

/// Python prometheus_client's `floatToGoString`.
pub(crate) fn go_float(d: f64) -> String {
    if d == f64::INFINITY {
        return "+Inf".into();
    }
    if d.is_nan() {
        return "NaN".into();
    }
    let mut s = format!("{d}");
    if !s.contains('.') && !s.contains('e') && !s.contains("inf") {
        s.push_str(".0");
    }
    if let Some(dot) = s.find('.') {
        if d > 0.0 && dot > 6 {
            let digits = format!("{}{}", &s[1..dot], &s[dot + 1..]);
            let mantissa = format!("{}.{}", &s[..1], digits);
            let mantissa = mantissa.trim_end_matches(['0', '.']);
            return format!("{mantissa}e+0{}", dot - 1);
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::{go_float, one_two_five, tgi_duration_buckets, tgi_hundredths, Histogram};

    #[test]
    fn floats_like_prometheus_client() {
        assert_eq!(go_float(4.0), "4.0");
        assert_eq!(go_float(0.2666666666666667), "0.2666666666666667");
        assert_eq!(go_float(1796208181.614327), "1.796208181614327e+09");
        assert_eq!(go_float(2560.0), "2560.0");
        assert_eq!(go_float(f64::INFINITY), "+Inf");
    }

    #[test]
    fn vllm_token_buckets_follow_max_model_len() {
        assert_eq!(
            one_two_five(1024),
            [1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0]
        );
        assert_eq!(one_two_five(100).last(), Some(&100.0));
        assert!(one_two_five(0).is_empty());
    }

    #[test]
    fn tgi_buckets_are_its_routers() {
        let d = tgi_duration_buckets();
        assert_eq!(d.len(), 35);
        assert!((d[0] - 0.00015).abs() < 1e-12);
        assert!((d[34] / d[33] - 1.5).abs() < 1e-9);
        let t = tgi_hundredths(8191);
        assert_eq!(t.len(), 100);
        assert!((t[0] - 81.91).abs() < 1e-9);
        assert!((t[99] - 8191.0).abs() < 1e-6);
    }

    #[test]
    fn observe_n_counts_n_times() {
        let h = Histogram::new(&[1.0, 2.0]);
        h.observe_n(1.5, 3);
        h.observe_n(0.5, 0);
        h.observe(5.0);
        assert_eq!(h.count(), 4);
        assert_eq!(h.cumulative(), vec![(1.0, 0), (2.0, 3)]);
        assert!((h.sum() - 9.5).abs() < 1e-12);
    }
}
