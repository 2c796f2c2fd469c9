//! vLLM 0.32's `/metrics` text for one engine: its families in the order a real server writes
//! them, each with its HELP text, `_created` gauges (one per label set) and labels in
//! alphabetical order. Families the simulator has no counterpart for (FLOPs estimates,
//! multi-modal and external caches, sleep state, admission rejections) are left out.

use std::fmt::Write as _;
use std::sync::atomic::Ordering::Relaxed;

use super::{go_float, Histogram, ModelStats};
use crate::sim::lora::LoraInfo;

/// The writer of one exposition: the model label and the `_created` timestamp.
struct Vexp<'a> {
    out: String,
    model: &'a str,
    created: String,
}

impl Vexp<'_> {
    /// `{engine="0",…,model_name="m",…}` with `extra` in its alphabetical place.
    fn labels(&self, extra: Option<(&str, &str)>) -> String {
        let m = self.model;
        match extra {
            Some((k, v)) if k < "model_name" => {
                format!("{{engine=\"0\",{k}=\"{v}\",model_name=\"{m}\"}}")
            }
            Some((k, v)) => format!("{{engine=\"0\",model_name=\"{m}\",{k}=\"{v}\"}}"),
            None => format!("{{engine=\"0\",model_name=\"{m}\"}}"),
        }
    }
    fn head(&mut self, name: &str, help: &str, ty: &str) {
        let _ = writeln!(self.out, "# HELP {name} {help}\n# TYPE {name} {ty}");
    }
    fn line(&mut self, name: &str, extra: Option<(&str, &str)>, v: f64) {
        let l = self.labels(extra);
        let _ = writeln!(self.out, "{name}{l} {}", go_float(v));
    }
    fn gauge(&mut self, name: &str, help: &str, v: f64) {
        self.head(name, help, "gauge");
        self.line(name, None, v);
    }
    /// The `_created` gauge of `base`, one line per value of the label `key`.
    fn created(&mut self, base: &str, help: &str, key: &str, values: &[&str]) {
        let name = format!("{base}_created");
        self.head(&name, help, "gauge");
        let created = self.created.clone();
        for v in values {
            let extra = (!key.is_empty()).then_some((key, *v));
            let l = self.labels(extra);
            let _ = writeln!(self.out, "{name}{l} {created}");
        }
    }
    fn counter(&mut self, base: &str, help: &str, v: u64) {
        self.counter_by(base, help, "", &[("", v)]);
    }
    /// A counter with one series per value of the label `key` ("" for none).
    fn counter_by(&mut self, base: &str, help: &str, key: &str, series: &[(&str, u64)]) {
        let name = format!("{base}_total");
        self.head(&name, help, "counter");
        for (value, v) in series {
            let extra = (!key.is_empty()).then_some((key, *value));
            self.line(&name, extra, *v as f64);
        }
        let values: Vec<&str> = series.iter().map(|(value, _)| *value).collect();
        self.created(base, help, key, &values);
    }
    fn histogram(&mut self, name: &str, help: &str, h: &Histogram) {
        self.head(name, help, "histogram");
        let bucket = format!("{name}_bucket");
        for (b, c) in h.cumulative() {
            self.line(&bucket, Some(("le", &go_float(b))), c as f64);
        }
        let n = h.count() as f64;
        self.line(&bucket, Some(("le", "+Inf")), n);
        self.line(&format!("{name}_count"), None, n);
        self.line(&format!("{name}_sum"), None, h.sum());
        self.created(name, help, "", &[""]);
    }
}

/// vLLM 0.32's `/metrics` text for one engine (labelled with the first served name).
/// With LoRA on, `lora` writes `vllm:lora_requests_info` after the request histograms, where
/// vLLM registers it.
pub(crate) fn render_vllm(
    model: &str,
    s: &ModelStats,
    kv_capacity: u64,
    block: u32,
    lora: Option<&LoraInfo>,
) -> String {
    let mut e = Vexp {
        out: String::with_capacity(32 * 1024),
        model,
        created: go_float(s.created),
    };
    scheduler_gauges(&mut e, s);
    token_counters(&mut e, s);
    histograms(&mut e, s);
    if let Some(lora) = lora {
        lora.render(&mut e.out);
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

fn scheduler_gauges(e: &mut Vexp<'_>, s: &ModelStats) {
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
    let name = "vllm:num_requests_waiting_by_reason";
    e.head(
        name,
        "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.",
        "gauge",
    );
    let deferred = s.waiting_deferred.load(Relaxed) as f64;
    e.line(
        name,
        Some(("reason", "capacity")),
        (waiting - deferred).max(0.0),
    );
    e.line(name, Some(("reason", "deferred")), deferred);
    e.gauge(
        "vllm:kv_cache_usage_perc",
        "KV-cache usage. 1 means 100 percent usage.",
        s.kv_usage(),
    );
}

fn token_counters(e: &mut Vexp<'_>, s: &ModelStats) {
    let hits = s.prefix_hits.load(Relaxed);
    let prompt = s.prompt_tokens.load(Relaxed);
    let cached = s.prompt_cached.load(Relaxed);
    e.counter(
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
        s.prefix_queries.load(Relaxed),
    );
    e.counter(
        "vllm:prefix_cache_hits",
        "Prefix cache hits, in terms of number of cached tokens.",
        hits,
    );
    e.counter(
        "vllm:num_preemptions",
        "Cumulative number of preemption from the engine.",
        s.preemptions.load(Relaxed),
    );
    e.counter(
        "vllm:prompt_tokens",
        "Number of prefill tokens processed.",
        prompt,
    );
    e.counter_by(
        "vllm:prompt_tokens_by_source",
        "Number of prompt tokens by source.",
        "source",
        &[
            ("local_compute", prompt.saturating_sub(cached)),
            ("local_cache_hit", cached),
            ("external_kv_transfer", 0),
        ],
    );
    e.counter(
        "vllm:prompt_tokens_cached",
        "Number of cached prompt tokens (local + external).",
        cached,
    );
    e.counter_by(
        "vllm:prompt_tokens_cached_by_source",
        "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), host (offloaded to DRAM), disk, p2p (transferred from another vLLM instance) or external_unspecified. Counted at admission; sums to vllm:prefix_cache_hits + vllm:external_prefix_cache_hits.",
        "source",
        &[
            ("device", hits),
            ("host", 0),
            ("p2p", 0),
            ("disk", 0),
            ("external_unspecified", 0),
        ],
    );
    e.counter(
        "vllm:generation_tokens",
        "Number of generation tokens processed.",
        s.generation_tokens.load(Relaxed),
    );
    e.counter_by(
        "vllm:request_success",
        "Count of successfully processed requests.",
        "finished_reason",
        &[
            ("stop", s.success_stop.load(Relaxed)),
            ("length", s.success_length.load(Relaxed)),
            ("abort", s.aborted.load(Relaxed)),
            ("error", 0),
            ("repetition", 0),
        ],
    );
}

fn histograms(e: &mut Vexp<'_>, s: &ModelStats) {
    let v = &s.vllm;
    let families: [(&str, &str, &Histogram); 16] = [
        (
            "vllm:request_prompt_tokens",
            "Number of prefill tokens processed.",
            &v.prompt_tokens,
        ),
        (
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            &v.generation_tokens,
        ),
        (
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            &v.iteration_tokens,
        ),
        (
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            &v.max_generation_tokens,
        ),
        (
            "vllm:request_params_n",
            "Histogram of the n request parameter.",
            &v.params_n,
        ),
        (
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            &v.params_max_tokens,
        ),
        (
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            &v.ttft,
        ),
        (
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            &v.itl,
        ),
        (
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            &v.tpot,
        ),
        (
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            &v.e2e,
        ),
        (
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            &v.queue_time,
        ),
        (
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            &v.inference_time,
        ),
        (
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            &v.prefill_time,
        ),
        (
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            &v.decode_time,
        ),
        (
            "vllm:request_num_preemptions",
            "Histogram of the number of times a request was preempted.",
            &v.preemptions,
        ),
        (
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            &v.prefill_kv_computed,
        ),
    ];
    for (name, help, h) in families {
        e.histogram(name, help, h);
    }
}

#[cfg(test)]
mod tests {
    use super::render_vllm;
    use crate::sim::metrics::{FinishObs, ModelStats, StepObs};
    use crate::sim::SimKind;

    /// `/metrics` of a real vLLM 0.32 (`--max-model-len 1024`) under load.
    const CAPTURE: &str =
        include_str!("../../../tests/fixtures/vllm-0.32.0/metrics-under-load.txt");

    /// `name{labels}` of a sample line.
    fn key(line: &str) -> &str {
        line.rsplit_once(' ').map_or(line, |(k, _)| k)
    }

    /// The family a sample belongs to (its `# TYPE` name).
    fn family(name: &str) -> &str {
        let name = name.split('{').next().unwrap_or(name);
        for suffix in ["_bucket", "_count", "_sum"] {
            if let Some(base) = name.strip_suffix(suffix) {
                if CAPTURE.contains(&format!("# TYPE {base} histogram")) {
                    return base;
                }
            }
        }
        name
    }

    fn sim_text() -> String {
        let s = ModelStats::new(SimKind::Vllm, 2048, 1024);
        s.step(&StepObs {
            secs: 0.03,
            prefilled: 2,
            prompt_tokens: 200,
            cached_tokens: 16,
            generated: 2,
            ..Default::default()
        });
        s.first_token(0.03);
        s.step(&StepObs {
            secs: 0.01,
            itl_secs: 0.01,
            decoding: 2,
            generated: 2,
            ..Default::default()
        });
        s.finished(&FinishObs {
            prefill: Some(0.03),
            decode: 0.01,
            generated: 2,
            prompt_tokens: 100,
            max_tokens: 2,
            ..Default::default()
        });
        render_vllm("tiny", &s, 2048, 128, None)
    }

    #[test]
    fn every_line_has_the_captures_name_help_labels_and_buckets() {
        let text = sim_text();
        let keys: Vec<&str> = CAPTURE
            .lines()
            .filter(|l| !l.starts_with('#'))
            .map(key)
            .collect();
        for line in text.lines().filter(|l| !l.contains("cache_config_info")) {
            if line.starts_with('#') {
                assert!(
                    CAPTURE.lines().any(|c| c == line),
                    "not in the capture: {line}"
                );
            } else {
                assert!(
                    keys.contains(&key(line)),
                    "no such series in the capture: {line}"
                );
            }
        }
    }

    #[test]
    fn every_family_has_all_the_captures_series_in_its_order() {
        let text = sim_text();
        let families: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .filter_map(|l| l.split(' ').next())
            .collect();
        for line in CAPTURE.lines().filter(|l| !l.starts_with('#')) {
            let k = key(line);
            if families.contains(&family(k)) && !k.contains("cache_config_info") {
                assert!(text.lines().any(|l| key(l) == k), "sim lacks {k}");
            }
        }
        let order: Vec<usize> = families
            .iter()
            .map(|f| {
                CAPTURE
                    .find(&format!("# TYPE {f} "))
                    .expect("family in capture")
            })
            .collect();
        assert!(order.windows(2).all(|w| w[0] < w[1]), "{families:?}");
        for f in [
            "vllm:request_prefill_time_seconds",
            "vllm:request_decode_time_seconds",
            "vllm:inter_token_latency_seconds",
            "vllm:iteration_tokens_total",
            "vllm:prompt_tokens_by_source_total",
            "vllm:prompt_tokens_cached_total",
            "vllm:request_prefill_kv_computed_tokens",
            "vllm:request_params_max_tokens",
        ] {
            assert!(families.contains(&f), "missing {f}");
        }
    }

    #[test]
    fn values_are_what_was_observed() {
        let text = sim_text();
        for line in [
            "vllm:prompt_tokens_total{engine=\"0\",model_name=\"tiny\"} 200.0",
            "vllm:prompt_tokens_by_source_total{engine=\"0\",model_name=\"tiny\",source=\"local_compute\"} 184.0",
            "vllm:prompt_tokens_by_source_total{engine=\"0\",model_name=\"tiny\",source=\"local_cache_hit\"} 16.0",
            "vllm:prompt_tokens_cached_total{engine=\"0\",model_name=\"tiny\"} 16.0",
            "vllm:iteration_tokens_total_count{engine=\"0\",model_name=\"tiny\"} 2.0",
            "vllm:iteration_tokens_total_sum{engine=\"0\",model_name=\"tiny\"} 204.0",
            "vllm:inter_token_latency_seconds_count{engine=\"0\",model_name=\"tiny\"} 2.0",
            "vllm:request_prefill_time_seconds_sum{engine=\"0\",model_name=\"tiny\"} 0.03",
            "vllm:request_time_per_output_token_seconds_sum{engine=\"0\",model_name=\"tiny\"} 0.01",
            "vllm:request_params_max_tokens_bucket{engine=\"0\",le=\"2.0\",model_name=\"tiny\"} 1.0",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line}\n{text}");
        }
    }
}
