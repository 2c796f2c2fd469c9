//! Statistics of the simulator and their Prometheus exposition in each engine's own dialect.
//!
//! [`ModelStats`] holds per-model gauges (written by the scheduler), counters and histograms;
//! [`Counters`] holds per-simulator request counters (by HTTP status) used by `/sim/state` and
//! by TGI's `tgi_request_*` counters. Everything is lock-free atomics so the zero-delay fast path
//! stays cheap.
//!
//! Invariants: vLLM series use vLLM 0.32's names, HELP texts, float formatting
//! (prometheus_client's `floatToGoString`) and alphabetical label order
//! (`engine`, [`finished_reason`|`le`], `model_name`), with `model_name` = the first served name;
//! TGI series use the unlabelled `tgi_*` names of metrics-exporter-prometheus; Ollama has none.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// A Prometheus histogram with fixed bounds.
pub(crate) struct Histogram {
    bounds: &'static [f64],
    buckets: Vec<AtomicU64>,
    count: AtomicU64,
    sum_bits: AtomicU64,
}

impl Histogram {
    pub(crate) fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            buckets: (0..bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            count: AtomicU64::new(0),
            sum_bits: AtomicU64::new(0f64.to_bits()),
        }
    }

    pub(crate) fn observe(&self, v: f64) {
        if let Some(i) = self.bounds.iter().position(|b| v <= *b) {
            self.buckets[i].fetch_add(1, Relaxed);
        }
        self.count.fetch_add(1, Relaxed);
        if v == 0.0 {
            return;
        }
        let mut cur = self.sum_bits.load(Relaxed);
        loop {
            let new = (f64::from_bits(cur) + v).to_bits();
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
/// vLLM's request latency buckets.
pub(crate) const LATENCY_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// Per-model statistics.
pub(crate) struct ModelStats {
    /// Requests submitted and not admitted yet, at once (TGI's queue gauge moves on arrival;
    /// admission limits count these).
    pub waiting: AtomicU64,
    /// Requests the scheduler left waiting at its last admission round: vLLM's
    /// `num_requests_waiting`, which its scheduler reports after each step, so a request that
    /// arrives during a step and is admitted at the next one never shows as waiting.
    pub waiting_scheduled: AtomicU64,
    pub running: AtomicU64,
    pub kv_used_tokens: AtomicU64,
    pub kv_reserved_tokens: AtomicU64,
    pub kv_capacity_tokens: AtomicU64,
    pub batch_max_tokens: AtomicU64,
    pub prefix_queries: AtomicU64,
    pub prefix_hits: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub generation_tokens: AtomicU64,
    pub preemptions: AtomicU64,
    pub iterations: AtomicU64,
    pub aborted: AtomicU64,
    pub success_stop: AtomicU64,
    pub success_length: AtomicU64,
    pub ttft: Histogram,
    pub e2e: Histogram,
    pub queue_time: Histogram,
    pub inference_time: Histogram,
    created: f64,
}

impl ModelStats {
    pub(crate) fn new(kv_capacity: u64) -> Self {
        ModelStats {
            waiting: AtomicU64::new(0),
            waiting_scheduled: AtomicU64::new(0),
            running: AtomicU64::new(0),
            kv_used_tokens: AtomicU64::new(0),
            kv_reserved_tokens: AtomicU64::new(0),
            kv_capacity_tokens: AtomicU64::new(kv_capacity),
            batch_max_tokens: AtomicU64::new(0),
            prefix_queries: AtomicU64::new(0),
            prefix_hits: AtomicU64::new(0),
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            preemptions: AtomicU64::new(0),
            iterations: AtomicU64::new(0),
            aborted: AtomicU64::new(0),
            success_stop: AtomicU64::new(0),
            success_length: AtomicU64::new(0),
            ttft: Histogram::new(TTFT_BUCKETS),
            e2e: Histogram::new(LATENCY_BUCKETS),
            queue_time: Histogram::new(LATENCY_BUCKETS),
            inference_time: Histogram::new(LATENCY_BUCKETS),
            created: super::unix_now_f64(),
        }
    }

    /// KV-cache usage in 0..1 (tokens held by running sequences / capacity).
    pub(crate) fn kv_usage(&self) -> f64 {
        let cap = self.kv_capacity_tokens.load(Relaxed).max(1);
        (self.kv_used_tokens.load(Relaxed) as f64 / cap as f64).min(1.0)
    }
}

/// Per-simulator request counters.
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
    pub tgi_input_length: Histogram,
    pub tgi_generated_tokens: Histogram,
}

const TGI_DURATION_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];
const TGI_TOKEN_BUCKETS: &[f64] = &[
    1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0,
];

impl Counters {
    pub(crate) fn new() -> Self {
        Counters {
            requests_total: AtomicU64::new(0),
            by_status: (0..600).map(|_| AtomicU64::new(0)).collect(),
            tokens_in: AtomicU64::new(0),
            tokens_out: AtomicU64::new(0),
            overloaded: AtomicU64::new(0),
            validation: AtomicU64::new(0),
            infer_total: AtomicU64::new(0),
            infer_success: AtomicU64::new(0),
            tgi_duration: Histogram::new(TGI_DURATION_BUCKETS),
            tgi_input_length: Histogram::new(TGI_TOKEN_BUCKETS),
            tgi_generated_tokens: Histogram::new(TGI_TOKEN_BUCKETS),
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

struct Vexp<'a> {
    out: String,
    model: &'a str,
    created: String,
}

impl Vexp<'_> {
    fn head(&mut self, name: &str, help: &str, ty: &str) {
        let _ = writeln!(self.out, "# HELP {name} {help}\n# TYPE {name} {ty}");
    }
    fn gauge(&mut self, name: &str, help: &str, v: f64) {
        self.head(name, help, "gauge");
        let _ = writeln!(
            self.out,
            "{name}{{engine=\"0\",model_name=\"{}\"}} {}",
            self.model,
            go_float(v)
        );
    }
    fn created(&mut self, base: &str, help: &str) {
        let name = format!("{base}_created");
        self.head(&name, help, "gauge");
        let _ = writeln!(
            self.out,
            "{name}{{engine=\"0\",model_name=\"{}\"}} {}",
            self.model, self.created
        );
    }
    fn counter(&mut self, base: &str, help: &str, v: u64) {
        let name = format!("{base}_total");
        self.head(&name, help, "counter");
        let _ = writeln!(
            self.out,
            "{name}{{engine=\"0\",model_name=\"{}\"}} {}",
            self.model,
            go_float(v as f64)
        );
        self.created(base, help);
    }
    fn histogram(&mut self, name: &str, help: &str, h: &Histogram) {
        self.head(name, help, "histogram");
        let m = self.model;
        for (b, c) in h.cumulative() {
            let _ = writeln!(
                self.out,
                "{name}_bucket{{engine=\"0\",le=\"{}\",model_name=\"{m}\"}} {}",
                go_float(b),
                go_float(c as f64)
            );
        }
        let n = h.count();
        let _ = writeln!(
            self.out,
            "{name}_bucket{{engine=\"0\",le=\"+Inf\",model_name=\"{m}\"}} {}",
            go_float(n as f64)
        );
        let _ = writeln!(
            self.out,
            "{name}_count{{engine=\"0\",model_name=\"{m}\"}} {}",
            go_float(n as f64)
        );
        let _ = writeln!(
            self.out,
            "{name}_sum{{engine=\"0\",model_name=\"{m}\"}} {}",
            go_float(h.sum())
        );
        self.created(name, help);
    }
}

/// vLLM 0.32's `/metrics` text for one engine (labelled with the first served name).
pub(crate) fn render_vllm(model: &str, s: &ModelStats, kv_capacity: u64, block: u32) -> String {
    let mut e = Vexp {
        out: String::with_capacity(16 * 1024),
        model,
        created: go_float(s.created),
    };
    let waiting = s.waiting_scheduled.load(Relaxed) as f64;
    e.gauge(
        "vllm:num_requests_running",
        "Number of requests in model execution batches.",
        s.running.load(Relaxed) as f64,
    );
    e.gauge(
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed.",
        waiting,
    );
    e.head(
        "vllm:num_requests_waiting_by_reason",
        "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.",
        "gauge",
    );
    let _ = writeln!(
        e.out,
        "vllm:num_requests_waiting_by_reason{{engine=\"0\",model_name=\"{model}\",reason=\"capacity\"}} {}\nvllm:num_requests_waiting_by_reason{{engine=\"0\",model_name=\"{model}\",reason=\"deferred\"}} 0.0",
        go_float(waiting)
    );
    e.gauge(
        "vllm:kv_cache_usage_perc",
        "KV-cache usage. 1 means 100 percent usage.",
        s.kv_usage(),
    );
    for (name, help, v) in [
        (
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            &s.prefix_queries,
        ),
        (
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            &s.prefix_hits,
        ),
        (
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            &s.preemptions,
        ),
        (
            "vllm:prompt_tokens",
            "Number of prefill tokens processed.",
            &s.prompt_tokens,
        ),
        (
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            &s.generation_tokens,
        ),
    ] {
        e.counter(name, help, v.load(Relaxed));
    }
    let help = "Count of successfully processed requests.";
    e.head("vllm:request_success_total", help, "counter");
    for (reason, v) in [
        ("stop", s.success_stop.load(Relaxed)),
        ("length", s.success_length.load(Relaxed)),
        ("abort", s.aborted.load(Relaxed)),
        ("error", 0),
        ("repetition", 0),
    ] {
        let _ = writeln!(
            e.out,
            "vllm:request_success_total{{engine=\"0\",finished_reason=\"{reason}\",model_name=\"{model}\"}} {}",
            go_float(v as f64)
        );
    }
    e.created("vllm:request_success", help);
    for (name, help, h) in [
        (
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            &s.ttft,
        ),
        (
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            &s.e2e,
        ),
        (
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            &s.queue_time,
        ),
        (
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            &s.inference_time,
        ),
    ] {
        e.histogram(name, help, h);
    }
    e.head(
        "vllm:cache_config_info",
        "Information of the LLMEngine CacheConfig",
        "gauge",
    );
    let blocks = kv_capacity / u64::from(block.max(1));
    let _ = writeln!(
        e.out,
        "vllm:cache_config_info{{block_size=\"{block}\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",engine=\"0\",gpu_memory_utilization=\"0.9\",kv_cache_size_tokens=\"{kv_capacity}\",num_gpu_blocks=\"{blocks}\",prefix_caching_hash_algo=\"sha256\"}} 1.0"
    );
    e.out
}

fn tgi_histogram(out: &mut String, name: &str, h: &Histogram) {
    let _ = writeln!(out, "# TYPE {name} histogram");
    for (b, c) in h.cumulative() {
        let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {c}");
    }
    let n = h.count();
    let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {n}");
    let _ = writeln!(out, "{name}_sum {}", h.sum());
    let _ = writeln!(out, "{name}_count {n}");
}

/// One TGI series without labels, and its blank line.
fn tgi_series(out: &mut String, name: &str, kind: &str, v: u64) {
    let _ = writeln!(out, "# TYPE {name} {kind}\n{name} {v}\n");
}

/// TGI's `/metrics` text.
pub(crate) fn render_tgi(s: &ModelStats, c: &Counters) -> String {
    let mut out = String::with_capacity(4096);
    let ok = c.infer_success.load(Relaxed);
    tgi_series(
        &mut out,
        "tgi_request_count",
        "counter",
        c.infer_total.load(Relaxed),
    );
    tgi_series(&mut out, "tgi_request_success", "counter", ok);
    let _ = writeln!(
        out,
        "# TYPE tgi_request_failure counter\ntgi_request_failure{{err=\"overloaded\"}} {}\ntgi_request_failure{{err=\"validation\"}} {}\n",
        c.overloaded.load(Relaxed),
        c.validation.load(Relaxed)
    );
    for (name, v) in [
        ("tgi_queue_size", &s.waiting),
        ("tgi_batch_current_size", &s.running),
        ("tgi_batch_current_max_tokens", &s.batch_max_tokens),
    ] {
        tgi_series(&mut out, name, "gauge", v.load(Relaxed));
    }
    for (i, (name, h)) in [
        ("tgi_request_duration", &c.tgi_duration),
        ("tgi_request_queue_duration", &s.queue_time),
        ("tgi_request_input_length", &c.tgi_input_length),
        ("tgi_request_generated_tokens", &c.tgi_generated_tokens),
    ]
    .into_iter()
    .enumerate()
    {
        if i > 0 {
            out.push('\n');
        }
        tgi_histogram(&mut out, name, h);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::go_float;

    #[test]
    fn floats_like_prometheus_client() {
        assert_eq!(go_float(4.0), "4.0");
        assert_eq!(go_float(0.2666666666666667), "0.2666666666666667");
        assert_eq!(go_float(1796208181.614327), "1.796208181614327e+09");
        assert_eq!(go_float(2560.0), "2560.0");
        assert_eq!(go_float(f64::INFINITY), "+Inf");
    }
}
