//! The backend simulator: `sluice sim` imitates vLLM, TGI and Ollama closely enough that the
//! gateway cannot tell — same endpoints, bodies, SSE/NDJSON framing, error bodies, metric names
//! and overload behaviour — with a continuous-batching timing model and run-time faults.
//!
//! # Module map
//! - [`config`]: [`SimKind`], the `sluice sim` arguments ([`SimArgs`]) and [`SimConfig`].
//! - `server`: accept loop, hyper service, response body type, `/sim/*` control routes.
//! - `engine`: the per-model continuous-batching scheduler (queue, batch limit, prefill,
//!   decode steps, KV capacity, prefix cache).
//! - `gen`: one generation as a handler sees it (fast path at speed 0, or scheduled).
//! - `text`: deterministic text and the documented simple tokenizer.
//! - [`fault`]: run-time faults and their shared state.
//! - [`kv_config`]: vLLM's `--kv-events-config` (defaults, bind or connect, `/kv_event_sources`).
//! - [`lora`]: vLLM's LoRA settings, its registry of loaded adapters, the GPU slots and
//!   `vllm:lora_requests_info`.
//! - `kv_publisher`: the KV-cache event publisher (PUB socket, sequence numbers, replay).
//! - `openai_surface`: the OpenAI-compatible bodies with per-engine quirks.
//! - `vllm`, `tgi`, `ollama`: the personalities.
//! - `responses`, `anthropic`: vLLM's OpenAI Responses API (with its response store) and its
//!   Anthropic Messages API.
//! - `metrics`: statistics and their Prometheus exposition per engine.
//!
//! # Control endpoint (stable contract)
//! On the simulator's own port, never subject to a fault:
//!
//! - `POST /sim/fault` with `{"mode": M, ...params}` sets the fault and answers the new
//!   `/sim/state`. Modes and parameters:
//!   - `healthy`: normal behaviour.
//!   - `hang`: requests (inference and health) are accepted and never answered while the mode
//!     lasts; when the mode changes they continue normally.
//!   - `slow`: `factor` (default 10) multiplies every delay of the timing model (and Ollama's
//!     load time); optional `delay_ms` adds a fixed delay before each answer, also at speed 0.
//!   - `error_rate`: a fraction `rate` (default 1.0) of inference requests gets the engine's own
//!     5xx (vLLM 500 `InternalServerError`, TGI 500 `incomplete_generation`, Ollama 500
//!     `{"error":…}`); health still passes, so `rate: 1.0` is "inference fails, health passes".
//!   - `drop_midstream`: a stream is cut abruptly (no terminating chunk) after `after_chunks`
//!     chunks (default 1).
//!   - `overloaded`: inference gets the engine's overload answer (vLLM 503
//!     `ServiceUnavailableError`, TGI 429 `Model is overloaded` or its in-stream event, Ollama
//!     503 `server busy, please try again.  maximum pending requests exceeded`).
//!   - `health_fail`: health checks fail (vLLM 503 empty, TGI 503 `{"error":"unhealthy",
//!     "error_type":"healthcheck"}`, Ollama `GET /` 503) while inference works.
//!   - `loading`: for `seconds` (default 5): vLLM/TGI fail health and inference with 503; Ollama
//!     unloads its models and the next request pays `seconds` of load time (`load_duration`).
//!     Reverts to healthy by itself.
//!   - `refuse`: new connections are reset, kept-alive ones closed at their next request, except
//!     connections whose first bytes are a `/sim/` request; `seconds` > 0 reverts by itself.
//!     (The listener stays open, so a client sees a reset rather than ECONNREFUSED.)
//!   - `kv_skip`: the vLLM KV-event publisher does not send the batches numbered `seqs` (a list
//!     of sequence numbers); they are numbered and kept for replay all the same, so a subscriber
//!     sees a gap it can fill from replay. Requests are served normally.
//!   - `kv_lost`: as `kv_skip`, and the replay socket answers nothing at all (not even the end
//!     marker): the gap cannot be filled.
//! - `GET /sim/fault`: the active fault.
//! - `GET /sim/state`: `{"kind","speed","mode","fault":{…},"waiting","running","max_num_seqs",
//!   "models":[{"name","waiting","running","kv_used_tokens","kv_capacity_tokens","kv_usage",
//!   "prefix_cache_queries","prefix_cache_hits","prompt_tokens","generation_tokens","loaded",…}],
//!   "traceparents":[the last 64 `traceparent` headers of inference requests, oldest first],
//!   "tracestates":[the `tracestate` sent with each of them, or null],
//!   "counters":{"requests_total","by_status":{"200":n,…},"tokens_in","tokens_out",
//!   "prefix_cache_hits","overloaded"}}`.
//!
//! Unknown modes or parameters get 400 `{"error":"…"}`.
//!
//! # Models per personality
//! - vLLM: every `--model` is a served alias of one engine (`--served-model-name a b`): any
//!   alias (or no `model`) is accepted, responses and the `model_name` metrics label use the
//!   first name, and an unknown name gets 404 "The model `x` does not exist. Valid aliases: a, b.".
//!   With `--enable-prompt-tokens-details` (off by default, as in vLLM) every usage carries
//!   `prompt_tokens_details` as vLLM 0.32 writes it: chat `{"cached_tokens","created_cache_tokens",
//!   "multimodal_tokens":null}` (its streamed usage chunk without the null), completions
//!   `cached_tokens` only; `cached_tokens` is the prefix-cache hit (whole blocks, never the
//!   block of the last prompt token), `created_cache_tokens` the prompt's other whole blocks.
//!   Messages then reports `cache_read_input_tokens` and `cache_creation_input_tokens` apart
//!   from `input_tokens` (final usage only); Responses always reports `cached_tokens` and
//!   `cache_write_tokens`.
//!
//!   KV-cache events: `--kv-events-config` (vLLM's JSON; needs a speed above 0) publishes the
//!   prefix cache's changes over ZMQ as vLLM 0.32 does: one batch per engine step that stored
//!   or evicted blocks, `[topic, seq, msgpack]` from seq 0, `BlockStored` (engine hashes = the
//!   simulator's chained block hashes, the blocks' prompt tokens, medium `GPU`, group 0,
//!   `full_attention`, `extra_keys` null per block), one `BlockRemoved` per evicted block,
//!   `AllBlocksCleared`; the last `buffer_steps` batches on the replay ROUTER (`kv_publisher`
//!   has the framing). The publisher binds when its endpoint has a wildcard host and connects
//!   otherwise; `tcp://*:0` binds a free port of `--host` (vLLM binds its node's address) and
//!   any port-0 bind is reported with its real port: `GET /kv_event_sources` answers
//!   `{"0":{…config, endpoints as bound}}`, `{}` without events. `--server-dev-mode` (vLLM's
//!   `VLLM_SERVER_DEV_MODE=1`) serves `POST /reset_prefix_cache[?reset_running_requests=true]`:
//!   `{"success":false}` while requests run unless forced; its `AllBlocksCleared` is published
//!   with the engine's next step, as vLLM does.
//!   With `--tokenizer <folder>` (a model's tokenizer folder, [`crate::tokenizer`]) chat and
//!   completions prompts are tokenized exactly as vLLM does — the chat template rendered and
//!   encoded without special tokens, a completions prompt encoded with them, token prompts
//!   taken as given — for usage, the context-length check, the prefix cache's blocks and
//!   `/tokenize` (`token_strs` from the vocabulary); a request the template refuses gets
//!   vLLM's 400. The text of the answers, `/detokenize`, the batch chat endpoint and the
//!   Responses and Messages APIs keep the simulator's own tokenizer.
//!
//!   vLLM also serves `POST /v1/responses` (whole, or typed SSE events without `[DONE]`),
//!   `POST /v1/messages` and `/v1/messages/count_tokens` (Anthropic's shapes; validation errors
//!   stay in OpenAI's shape, as in vLLM), `POST /detokenize` (pieces `/tokenize` has seen come
//!   back as text) and `POST /v1/chat/completions/batch` (one choice per conversation), all
//!   through the same engine as chat. `--enable-responses-store` (vLLM's
//!   `VLLM_ENABLE_RESPONSES_API_STORE=1`, off by default) keeps responses in the process:
//!   `GET /v1/responses/{id}`, `POST /v1/responses/{id}/cancel`, `previous_response_id`
//!   (the stored conversation and its output become the prompt's prefix) and `background`
//!   (answered at once as `queued`, `in_progress` once the engine produces its first token).
//!   Without it, `background` gets vLLM's 400 and `store` is silently ignored.
//!   LoRA adapters (`--enable-lora`, `lora`): `--max-loras N` (default 1) GPU slots,
//!   `--max-cpu-loras M` (checked: at least N), `--max-lora-rank` (accepted, no effect),
//!   `--lora-modules name=path …` loaded at start, `--allow-runtime-lora-updating` (vLLM's
//!   `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`) for `POST /v1/load_lora_adapter`
//!   `{"lora_name","lora_path","load_inplace"?}` and `POST /v1/unload_lora_adapter`
//!   `{"lora_name"}` (vLLM 0.32's plain-text successes and its errors; without the flag the
//!   paths are 404 `Not Found`), and `--lora-load-ms` (default 25), what swapping an adapter
//!   into a slot adds to the step that needs it. *Bad path rule*: a `lora_path` is an adapter
//!   when it exists on the simulator's machine (file or folder); anything else is vLLM's 404
//!   `Loading lora X failed: No adapter found for P` (and a bad `--lora-modules` path fails the
//!   start). Loaded adapters are models: `/v1/models` lists them after the base model with
//!   `parent` = the first served name, `root` = the path, `max_model_len` null; chat and
//!   completions naming one are answered under its name (other routes accept the name and
//!   answer with the base model); an unloaded one is the unknown-model 404. The engine runs at
//!   most N distinct adapters at once: a request for another waits, deferred
//!   (`vllm:num_requests_waiting_by_reason{reason="deferred"}`), while base-model and running
//!   adapters' requests pass it. `vllm:lora_requests_info{max_lora,running_lora_adapters,
//!   waiting_lora_adapters}` keeps one series per state with the time it was last seen; as in
//!   vLLM 0.32 both labels name the adapters whose requests have produced output, so a waiting
//!   adapter appears once it runs. An adapter's prompt blocks are keyed by it (never a hit for
//!   the base model or another adapter) and published with `lora_name`, `lora_id` and
//!   `extra_keys` `[name]` per block.
//! - TGI: one model (`model_id` = the first name); the Messages API echoes whatever `model` the
//!   client sent. `--lora-adapters a,b` (fixed at start; `name=path` is named `name`): a request
//!   names one in `parameters.adapter_id` or, on the OpenAI routes, in `model` (`tgi` = the
//!   base model); an id TGI was not started with is answered by the base model, as TGI's shards
//!   fall back to it. `/info` lists no adapters (TGI's has no such field).
//! - Ollama: real separate models (`name:tag`, `:latest` by default), each with its own
//!   scheduler, parallel slots, pending queue and residency.
//!
//! # Timing model
//! See `engine`: defaults are 256 running sequences (TGI 128, Ollama 1), a 131 072-token KV
//! cache, 100 µs of prefill per uncached prompt token, decode steps of 15 ms + 150 µs per
//! running sequence (Ollama 20 ms), 16-token prefix-cache blocks, natural answers of 16–128
//! tokens. `--speed F` divides every duration by F; `--speed 0` bypasses the scheduler.
//!
//! # Engine metrics
//! What each engine reports about its own timing is measured on the scheduler's clock (see
//! `metrics::observe` for when each series is observed):
//! - vLLM `/metrics`: per step `iteration_tokens_total`, `inter_token_latency_seconds`,
//!   `time_to_first_token_seconds`, `prompt_tokens_total`, `prompt_tokens_by_source_total`,
//!   `prompt_tokens_cached_total`, `generation_tokens_total`; per finished request the queue,
//!   prefill (its admission step), decode, inference and e2e times, time per output token, and
//!   the prompt, generation, KV-computed, `max_tokens` and `n` histograms.
//! - TGI `/metrics`: `tgi_batch_forward_duration{method}` per forward pass (a step that admits
//!   requests is a prefill forward for them, its share of the step by the timing model, plus a
//!   decode forward for the requests already running), `tgi_batch_next_size`, and per request
//!   the queue, inference, mean-time-per-token, input-length and generated-token histograms.
//! - Ollama's final `/api/chat` and `/api/generate` object: `prompt_eval_duration` is the
//!   admission step, `eval_duration` the steps from the first to the last token.
//!
//! # Simplifications (known differences from the real engines)
//! - No preemption: a request reserves `prompt + max output` KV tokens when admitted, so
//!   `vllm:num_preemptions_total` stays 0; requests wait instead. A forced prefix-cache reset
//!   leaves running requests running.
//! - Only prompt blocks are cached: vLLM also caches (and announces with `BlockStored`) a
//!   block that fills up during decoding, whose tokens include generated ones; the simulator
//!   does not. KV events carry no multimodal or cache-salt keys; `hwm` is reported but
//!   the PUB socket's per-subscriber queue is fixed at 100 000 messages (vLLM's default);
//!   only `tcp://` endpoints, one data-parallel rank.
//! - `n > 1`, `stop` sequences, logprobs, tools and response formats are accepted and ignored,
//!   except TGI's chat completions, which call a tool as TGI does when `tool_choice` forces one
//!   (`required` or a named function; `tgi_tools`);
//!   the last generated token carries the finish reason (no separate EOS token, so TGI's
//!   `finish_reason` is `length` or `eos_token`, never `stop_sequence`).
//! - LoRA: the load cost is one figure per swap into a GPU slot (vLLM's CPU cache of
//!   `--max-cpu-loras` adapters and its reads from disk are not timed); the Responses,
//!   Messages, batch-chat, pooling and audio routes accept an adapter's name but run the base
//!   model; the load routes do not check the request's content type; a body missing both
//!   `lora_name` and `lora_path` is reported for `lora_name` only (pydantic lists both).
//! - `error_rate` answers before the first byte (an HTTP 5xx), never inside a stream.
//! - Engine metrics: a request's whole prompt is prefilled in its admission step (no chunked
//!   prefill), so TGI 3's chunking (newcomers prefilled together with the running batch) is
//!   not imitated; aborted requests are not in vLLM's per-request histograms; vLLM's FLOPs
//!   estimates, multi-modal and external caches, sleep state and admission rejections are not
//!   exposed; TGI's `/metrics` has no `# HELP` lines.
//! - Not simulated: API keys, vLLM `/load`, `/pooling`, `/generative_scoring`, harmony models
//!   (reasoning items) and tool calls in Responses or Messages output (tools are accepted and
//!   answered with text; they do not count in the prompt), `GET /v1/responses/{id}?stream=true`
//!   (answered as JSON), `background` together with `stream` (streamed like a foreground
//!   response, then stored), TGI `/chat_tokenize` and platform routes, Ollama model management
//!   (`/api/pull`, …) and legacy `/api/embeddings`.

mod anthropic;
mod audio;
pub mod config;
mod engine;
pub mod fault;
mod gen;
pub mod kv_config;
mod kv_publisher;
pub mod lora;
mod metrics;
mod ollama;
mod ollama_compat;
mod openai_surface;
mod pooling;
mod responses;
mod server;
mod text;
mod tgi;
mod tgi_tools;
mod vllm;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use tokio::net::TcpListener;
use tokio::sync::oneshot;

pub use config::{SimArgs, SimConfig, SimKind, Timing};
pub use fault::{Fault, FaultMode};
pub use kv_config::KvEventsConfig;
pub use lora::LoraSettings;

/// Errors of the simulator.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// The configuration is invalid.
    #[error("invalid simulator configuration: {0}")]
    Config(String),
    /// A socket operation failed.
    #[error("simulator I/O error: {0}")]
    Io(#[from] std::io::Error),
}

pub(crate) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

pub(crate) fn unix_now_f64() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// Serve the simulator on `listener` until `shutdown` completes.
///
/// With `config.threads == 0` the simulator runs on the caller's runtime. With `N >= 1` it runs
/// on N dedicated OS threads, each with its own single-threaded tokio runtime accepting from
/// the same listening socket (no cross-thread wake-ups on the request path; the schedulers live
/// on the first thread); the caller's task just waits for `shutdown`.
pub async fn run(
    listener: TcpListener,
    config: SimConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), SimError> {
    let config = config.validate()?;
    tracing::info!(
        kind = %config.kind,
        addr = %listener.local_addr()?,
        models = ?config.models,
        speed = config.speed,
        threads = config.threads,
        "simulator listening"
    );
    if config.threads == 0 {
        let sim = Arc::new(server::Sim::new(config)?);
        return server::serve(listener, sim, shutdown).await;
    }
    let threads = config.threads;
    let std_listener = listener.into_std()?;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut runtimes = Vec::with_capacity(threads);
    for _ in 0..threads {
        runtimes.push(
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?,
        );
    }
    // the schedulers are spawned on the first shard's runtime
    let sim = {
        let _enter = runtimes[0].enter();
        Arc::new(server::Sim::new(config)?)
    };
    let mut done = Vec::with_capacity(threads);
    for (i, rt) in runtimes.into_iter().enumerate() {
        let l = std_listener.try_clone()?;
        let sim = sim.clone();
        let mut stop = stop_rx.clone();
        let (done_tx, done_rx) = oneshot::channel::<Result<(), SimError>>();
        std::thread::Builder::new()
            .name(format!("sluice-sim-{i}"))
            .spawn(move || {
                let r = rt.block_on(async move {
                    let listener = TcpListener::from_std(l)?;
                    server::serve(listener, sim, async move {
                        let _ = stop.wait_for(|s| *s).await;
                    })
                    .await
                });
                let _ = done_tx.send(r);
            })?;
        done.push(done_rx);
    }
    drop(std_listener);
    let first_exit = async {
        let mut result = Ok(());
        for d in &mut done {
            if let Ok(Err(e)) = d.await {
                result = Err(e);
            }
        }
        result
    };
    tokio::pin!(shutdown);
    tokio::select! {
        _ = &mut shutdown => {}
        r = first_exit => return r,
    }
    let _ = stop_tx.send(true);
    for d in done {
        let _ = d.await;
    }
    Ok(())
}

/// A simulator running in a tokio task; dropping the handle stops it.
pub struct SimHandle {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<Result<(), SimError>>>,
    sim: Arc<server::Sim>,
}

impl SimHandle {
    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://HOST:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Set the fault in-process (same effect as `POST /sim/fault`).
    pub fn set_fault(&self, fault: Fault) -> Result<(), SimError> {
        fault.validate().map_err(SimError::Config)?;
        self.sim.fault.set(fault);
        Ok(())
    }

    /// The `/sim/state` document.
    pub fn state(&self) -> serde_json::Value {
        serde_json::from_slice(&server::state_json(&self.sim)).unwrap_or_default()
    }

    /// Stop the simulator and wait for its task.
    pub async fn shutdown(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
    }
}

impl Drop for SimHandle {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.task.take() {
            t.abort();
        }
    }
}

/// Bind `config.bind_addr()` (port 0 = any free port) and run the simulator in a tokio task.
pub async fn spawn(config: SimConfig) -> Result<SimHandle, SimError> {
    let config = config.validate()?;
    let listener = TcpListener::bind(config.bind_addr()).await?;
    let addr = listener.local_addr()?;
    let sim = Arc::new(server::Sim::new(config)?);
    let (tx, rx) = oneshot::channel::<()>();
    let task = tokio::spawn(server::serve(listener, sim.clone(), async move {
        let _ = rx.await;
    }));
    Ok(SimHandle {
        addr,
        stop: Some(tx),
        task: Some(task),
        sim,
    })
}
