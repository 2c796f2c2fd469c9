//! Metric names and the Prometheus recorder.
//!
//! Every metric Sluice exports is named here, with `sluice_` prefix and base units. Labels:
//! `endpoint` (the client API's label: chat|completions|embeddings|tokenize|detokenize|
//! chat_batch|rerank|score|audio_transcriptions|audio_translations, and those of the other
//! APIs in `api`; on requests, durations and the token counters), `model` (the client's model name as configured —
//! unknown names are reported as `unknown`), `backend`, `tenant`, `status` (2xx|4xx|5xx), `state`.

use std::sync::{LazyLock, OnceLock};

use metrics::Counter;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use super::handles::LabelCache;

pub const REQUESTS_TOTAL: &str = "sluice_requests_total";
pub const REQUEST_DURATION_SECONDS: &str = "sluice_request_duration_seconds";
pub const TIME_TO_FIRST_TOKEN_SECONDS: &str = "sluice_time_to_first_token_seconds";
pub const PROMPT_TOKENS_TOTAL: &str = "sluice_prompt_tokens_total";
pub const COMPLETION_TOKENS_TOTAL: &str = "sluice_completion_tokens_total";
pub const BACKEND_REQUESTS_TOTAL: &str = "sluice_backend_requests_total";
/// Exact prompt counts asked of a backend's tokenizer (`[routing] tokenize_above`), by
/// `backend` (`-` when none could answer) and `outcome` (ok|error|timeout|no_backend).
pub const TOKENIZE_REQUESTS_TOTAL: &str = "sluice_tokenize_requests_total";
/// Blocks in the gateway's index of a `backend`'s KV cache.
pub const KV_INDEX_BLOCKS: &str = "sluice_kv_index_blocks";
/// Seconds between an engine stamping its last KV-event batch and the gateway applying it.
pub const KV_EVENT_LAG_SECONDS: &str = "sluice_kv_event_lag_seconds";
/// 1 for the `status` (off|connecting|warm|cold|lost) a `backend`'s KV subscription is in.
pub const KV_STATUS: &str = "sluice_kv_status";
/// KV-event batches applied per `backend`.
pub const KV_BATCHES_TOTAL: &str = "sluice_kv_event_batches_total";
/// Blocks per `backend` and `change` (stored|removed|orphaned: stored with a parent the index
/// does not hold, so not keyed).
pub const KV_BLOCKS_TOTAL: &str = "sluice_kv_event_blocks_total";
/// KV-event problems per `backend` and `kind` (gap|malformed|frames|overflow).
pub const KV_EVENT_ERRORS_TOTAL: &str = "sluice_kv_event_errors_total";
/// Prompt tokens the gateway expected cached on the chosen backend, and what the engine
/// reported (`source` predicted|reported), per `backend`; only for answers that report it.
pub const PREFIX_CACHED_TOKENS_TOTAL: &str = "sluice_prefix_cached_tokens_total";
/// Answers whose engine-reported cached tokens the gateway predicted, per `backend` and
/// `outcome` (exact|over|under).
pub const PREFIX_PREDICTIONS_TOTAL: &str = "sluice_prefix_predictions_total";
pub const BACKEND_INFLIGHT_REQUESTS: &str = "sluice_backend_inflight_requests";
pub const BACKEND_INFLIGHT_TOKENS: &str = "sluice_backend_inflight_tokens";
/// Requests sent to a `backend` whose first token has not come yet (pending prefill).
pub const BACKEND_PENDING_PREFILL_REQUESTS: &str = "sluice_backend_pending_prefill_requests";
/// Estimated prompt tokens of those requests.
pub const BACKEND_PENDING_PREFILL_TOKENS: &str = "sluice_backend_pending_prefill_tokens";
pub const BACKEND_STATE: &str = "sluice_backend_state";
pub const FAILOVERS_TOTAL: &str = "sluice_failovers_total";
pub const STREAM_INTERRUPTIONS_TOTAL: &str = "sluice_stream_interruptions_total";
/// Requests withdrawn from a `backend` that failed while they waited for its answer, and sent
/// elsewhere.
pub const RESCUES_TOTAL: &str = "sluice_rescues_total";
/// Waits for a `backend`'s response head far beyond its expected time while other backends
/// answered (each a live failure of that backend).
pub const HANG_SIGNALS_TOTAL: &str = "sluice_hang_signals_total";
/// Copies of a request sent to a second backend at its hang deadline (`[routing] hedge`), by
/// `model`.
pub const HEDGES_TOTAL: &str = "sluice_hedges_total";
/// LoRA adapter loads Sluice asked of an engine, by `backend` and `outcome`
/// (loaded|refused|failed).
pub const ADAPTER_LOADS_TOTAL: &str = "sluice_adapter_loads_total";
/// How long those loads took, by `backend`.
pub const ADAPTER_LOAD_SECONDS: &str = "sluice_adapter_load_seconds";
/// 1 for each LoRA adapter the fleet serves now, by `adapter` and its `base` model (0 once it
/// no longer does): the join that adds an adapter's per-model series up to its base.
pub const ADAPTER_INFO: &str = "sluice_adapter_info";
/// LoRA adapters Sluice unloaded to make room, by `backend`.
pub const ADAPTER_UNLOADS_TOTAL: &str = "sluice_adapter_unloads_total";
/// Broken streams whose continuation on another backend was tried, by the `backend` whose
/// stream broke and `outcome` (continued|failed).
pub const STREAM_CONTINUATIONS_TOTAL: &str = "sluice_stream_continuations_total";
pub const PANICS_TOTAL: &str = "sluice_panics_total";
/// Active health probes by `backend` and `result` (ok|busy|refused|unhealthy).
pub const PROBES_TOTAL: &str = "sluice_backend_probes_total";
/// Ejections by live-traffic failures, per `backend`.
pub const EJECTIONS_TOTAL: &str = "sluice_backend_ejections_total";
/// Concurrency cap in force per `backend` (configured or learned; absent = none).
pub const BACKEND_MAX_CONCURRENT: &str = "sluice_backend_max_concurrent";
/// Share of its fair traffic a `backend` in slow start may take (1 = full).
pub const BACKEND_SLOW_START_SHARE: &str = "sluice_backend_slow_start_share";
/// Requests waiting in the gateway-side queue for a backend slot.
pub const QUEUE_DEPTH: &str = "sluice_queue_depth";
/// Time spent in the wait queue, by `outcome` (routed|timeout).
pub const QUEUE_WAIT_SECONDS: &str = "sluice_queue_wait_seconds";
/// Requests refused by the wait queue, by `reason` (full|timeout).
pub const QUEUE_REJECTIONS_TOTAL: &str = "sluice_queue_rejections_total";
/// OpenTelemetry spans sent to the collector (`[tracing]`).
pub const OTEL_SPANS_EXPORTED_TOTAL: &str = "sluice_otel_spans_exported_total";
/// OpenTelemetry spans dropped, by `reason` (queue_full|export_failed): the queue was full, or
/// the collector did not take their batch (down, unreachable, refusing).
pub const OTEL_SPANS_DROPPED_TOTAL: &str = "sluice_otel_spans_dropped_total";
/// Run-time membership changes, by `source` (registration|expiry|dns|deregistration).
pub const MEMBERSHIP_CHANGES_TOTAL: &str = "sluice_membership_changes_total";
/// Requests refused by a tenant limit; labels `tenant`, `scope` (key|tenant), `limit`
/// (requests|tokens|concurrency|daily_tokens|monthly_tokens|unavailable).
pub const RATELIMIT_REJECTIONS_TOTAL: &str = "sluice_ratelimit_rejections_total";
/// Redis calls of the shared limiter that failed (the local fallback or fail-closed applied).
pub const RATELIMIT_REDIS_ERRORS_TOTAL: &str = "sluice_ratelimit_redis_errors_total";
/// Usage per `key`, `tenant`, `model`, `backend`, from the backends' usage reports.
pub const USAGE_REQUESTS_TOTAL: &str = "sluice_usage_requests_total";
pub const USAGE_PROMPT_TOKENS_TOTAL: &str = "sluice_usage_prompt_tokens_total";
pub const USAGE_COMPLETION_TOKENS_TOTAL: &str = "sluice_usage_completion_tokens_total";
/// Config reloads (file change or SIGHUP), by `result` (applied|rejected).
pub const CONFIG_RELOADS_TOTAL: &str = "sluice_config_reloads_total";
/// Unix time of the last config reload that was applied (absent until the first one).
pub const CONFIG_LAST_RELOAD_SECONDS: &str = "sluice_config_last_reload_timestamp_seconds";
/// Re-reads of the listener's TLS certificate files that found a change, by `result`.
pub const TLS_RELOADS_TOTAL: &str = "sluice_tls_reloads_total";
/// TLS handshakes on the client listener that failed (no or bad client certificate, …).
pub const TLS_HANDSHAKE_ERRORS_TOTAL: &str = "sluice_tls_handshake_errors_total";
/// Always 1, labelled with the `version` of the running binary.
pub const BUILD_INFO: &str = "sluice_build_info";
/// Connections open now, by `listener` (client|admin).
pub const CONNECTIONS_OPEN: &str = "sluice_connections_open";
/// Connections open now per serving thread, by `listener` and `shard` (1..N, see
/// `[server] threads`): how evenly the threads share the connections.
pub const SHARD_CONNECTIONS_OPEN: &str = "sluice_shard_connections_open";
/// Connections closed at accept by a limit, by `listener` and `reason`
/// (max_connections|max_connections_per_ip).
pub const CONNECTIONS_REJECTED_TOTAL: &str = "sluice_connections_rejected_total";
/// Clients cut for being too slow, by `listener` and `kind` (header: no complete request head
/// within `header_read_timeout` — a new connection that starts no request, a trickled head, or
/// on HTTP/1 a kept-alive connection waiting that long; body: 408 after `body_read_timeout`;
/// idle: no request in flight for `idle_timeout`).
pub const CLIENT_TIMEOUTS_TOTAL: &str = "sluice_client_timeouts_total";
/// HTTP/2 connections closed for resetting too many streams (rapid reset), by `listener`.
pub const HTTP2_RESET_FLOODS_TOTAL: &str = "sluice_http2_reset_floods_total";

const LATENCY_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Whether [`handle`] has installed the recorder (metric handles made before are no-ops).
pub fn recorder_installed() -> bool {
    HANDLE.get().is_some()
}

/// The process-wide Prometheus handle; installs the recorder on first use.
pub fn handle() -> PrometheusHandle {
    HANDLE
        .get_or_init(|| {
            let builder = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), LATENCY_BUCKETS)
                .unwrap_or_else(|_| PrometheusBuilder::new());
            let recorder = builder.build_recorder();
            let handle = recorder.handle();
            // Another recorder may be installed already (a test harness); the handle still renders ours.
            let _ = metrics::set_global_recorder(recorder);
            handle
        })
        .clone()
}

/// Count one answer (or failed attempt) of `backend`, by `outcome` (status class or failure).
pub fn backend_request(backend: &str, outcome: &'static str) {
    static HANDLES: LazyLock<LabelCache<2, Counter>> = LazyLock::new(LabelCache::default);
    HANDLES
        .handles([backend, outcome], || {
            metrics::counter!(BACKEND_REQUESTS_TOTAL, "backend" => backend.to_string(), "outcome" => outcome)
        })
        .increment(1);
}

/// Count one adapter load asked of `backend`, by `outcome`, and its time.
pub fn adapter_load(backend: &str, outcome: &'static str, took: std::time::Duration) {
    metrics::counter!(ADAPTER_LOADS_TOTAL, "backend" => backend.to_string(), "outcome" => outcome)
        .increment(1);
    metrics::histogram!(ADAPTER_LOAD_SECONDS, "backend" => backend.to_string())
        .record(took.as_secs_f64());
}

/// Count one adapter unloaded on `backend` to make room.
pub fn adapter_unload(backend: &str) {
    metrics::counter!(ADAPTER_UNLOADS_TOTAL, "backend" => backend.to_string()).increment(1);
}

/// Count one exact prompt count asked of `backend`, by `outcome`.
pub fn tokenize_request(backend: &str, outcome: &'static str) {
    static HANDLES: LazyLock<LabelCache<2, Counter>> = LazyLock::new(LabelCache::default);
    HANDLES
        .handles([backend, outcome], || {
            metrics::counter!(TOKENIZE_REQUESTS_TOTAL, "backend" => backend.to_string(), "outcome" => outcome)
        })
        .increment(1);
}

/// Count one applied KV-event batch of `backend` and its blocks.
pub fn kv_batch(backend: &str, stored: u32, removed: u32, orphaned: u32) {
    static BATCHES: LazyLock<LabelCache<1, Counter>> = LazyLock::new(LabelCache::default);
    static BLOCKS: LazyLock<LabelCache<2, Counter>> = LazyLock::new(LabelCache::default);
    BATCHES
        .handles(
            [backend],
            || metrics::counter!(KV_BATCHES_TOTAL, "backend" => backend.to_string()),
        )
        .increment(1);
    for (change, n) in [
        ("stored", stored),
        ("removed", removed),
        ("orphaned", orphaned),
    ] {
        if n > 0 {
            BLOCKS
                .handles([backend, change], || {
                    metrics::counter!(KV_BLOCKS_TOTAL, "backend" => backend.to_string(), "change" => change)
                })
                .increment(u64::from(n));
        }
    }
}

/// Count one KV-event problem of `backend`.
pub fn kv_event_error(backend: &str, kind: &'static str) {
    metrics::counter!(KV_EVENT_ERRORS_TOTAL, "backend" => backend.to_string(), "kind" => kind)
        .increment(1);
}

/// Count one answer's cached prompt tokens, predicted by the gateway and reported by the engine.
pub fn prefix_prediction(backend: &str, predicted: u64, reported: u64) {
    static TOKENS: LazyLock<LabelCache<2, Counter>> = LazyLock::new(LabelCache::default);
    static OUTCOMES: LazyLock<LabelCache<2, Counter>> = LazyLock::new(LabelCache::default);
    for (source, n) in [("predicted", predicted), ("reported", reported)] {
        TOKENS
            .handles([backend, source], || {
                metrics::counter!(PREFIX_CACHED_TOKENS_TOTAL, "backend" => backend.to_string(), "source" => source)
            })
            .increment(n);
    }
    let outcome = match predicted.cmp(&reported) {
        std::cmp::Ordering::Equal => "exact",
        std::cmp::Ordering::Greater => "over",
        std::cmp::Ordering::Less => "under",
    };
    OUTCOMES
        .handles([backend, outcome], || {
            metrics::counter!(PREFIX_PREDICTIONS_TOTAL, "backend" => backend.to_string(), "outcome" => outcome)
        })
        .increment(1);
}

/// Count one routing decision of `policy` for `backend`.
pub fn routing_decision(policy: &'static str, backend: &str) {
    static HANDLES: LazyLock<LabelCache<2, Counter>> = LazyLock::new(LabelCache::default);
    HANDLES
        .handles([policy, backend], || {
            metrics::counter!(ROUTING_DECISIONS_TOTAL, "policy" => policy, "backend" => backend.to_string())
        })
        .increment(1);
}

/// Count one health probe result.
pub fn probe_result(backend: &str, result: &'static str) {
    metrics::counter!(PROBES_TOTAL, "backend" => backend.to_string(), "result" => result)
        .increment(1);
}

/// Requests waiting inside the engine, per `backend` (from its own metrics).
pub const BACKEND_QUEUE_DEPTH: &str = "sluice_backend_queue_depth";
/// Requests running inside the engine, per `backend`.
pub const BACKEND_RUNNING: &str = "sluice_backend_running_requests";
/// KV-cache usage (0..1) the engine reports, per `backend`.
pub const BACKEND_KV_CACHE_USAGE: &str = "sluice_backend_kv_cache_usage_ratio";
/// Measured time to first token (EWMA), per `backend`.
pub const BACKEND_TTFT_EWMA_SECONDS: &str = "sluice_backend_ttft_ewma_seconds";
/// Measured decode speed (EWMA, tokens/s per request), per `backend`.
pub const BACKEND_DECODE_TOKENS_PER_SECOND: &str = "sluice_backend_decode_tokens_per_second";
/// Measured prefill speed (EWMA, prompt tokens/s per request), per `backend`.
pub const BACKEND_PREFILL_TOKENS_PER_SECOND: &str = "sluice_backend_prefill_tokens_per_second";
/// Routing decisions, by `policy` and chosen `backend`.
pub const ROUTING_DECISIONS_TOTAL: &str = "sluice_routing_decisions_total";
/// Batches created (`POST /v1/batches`).
pub const BATCHES_CREATED_TOTAL: &str = "sluice_batches_created_total";
/// Batch lines finished, by `outcome` (`completed`: a 2xx answer; `failed`: refused or an
/// error answer, both in the error file).
pub const BATCH_LINES_TOTAL: &str = "sluice_batch_lines_total";
/// Batch lines put back to run later, by `reason` (`capacity`: 503; `limits`: 429;
/// `interactive`: stopped to give its slot to an interactive request).
pub const BATCH_LINES_DEFERRED_TOTAL: &str = "sluice_batch_lines_deferred_total";
/// Batch lines waiting to run, over all batches.
pub const BATCH_LINES_QUEUED: &str = "sluice_batch_lines_queued";
/// Batch lines running now.
pub const BATCH_LINES_RUNNING: &str = "sluice_batch_lines_running";
/// The most batch lines a backend may hold at once by its step budget (`[batch]
/// max_ttft_rise`), by `backend`; `+Inf` without fitted step costs or while the backend has
/// no interactive traffic.
pub const BATCH_ALLOWANCE: &str = "sluice_batch_allowance";
/// How long each batch line took in the request path (histogram): its `_sum` is the fleet time
/// batches used of the idle capacity (its rate: the batch lines running on average).
pub const BATCH_LINE_SECONDS: &str = "sluice_batch_line_seconds";

/// `2xx`, `4xx`, `5xx`.
pub fn status_class(status: u16) -> &'static str {
    match status {
        100..=199 => "1xx",
        200..=299 => "2xx",
        300..=399 => "3xx",
        400..=499 => "4xx",
        _ => "5xx",
    }
}
