//! The simulator's HTTP/1.1 server: accept loop, per-connection hyper service, response body
//! type, the `/sim/*` control routes, and the shared [`Sim`] state handed to the personalities.
//!
//! Invariants:
//! - Network input never panics the server: bodies are read with a size cap, JSON errors become
//!   the engine's own error answers, and a failing connection only ends that connection.
//! - `/sim/fault` and `/sim/state` always answer, whatever the fault (they are checked first,
//!   and in `refuse` mode new connections are peeked so control requests still get through).
//! - In `hang` mode a request is parked before any answer byte; it resumes when the mode changes.
//! - Streams are produced by one task per response writing into a bounded channel; a send error
//!   (client gone) ends the task, which drops the engine receiver and frees the sequence.

use std::io;
use std::pin::Pin;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, Semaphore};
use tokio::task::JoinSet;

use super::config::{SimConfig, SimKind, Timing};
use super::engine::{Engine, LoraRun};
use super::fault::{FaultMode, FaultRequest, FaultState};
use super::kv_publisher::KvPublisher;
use super::lora::{LoraInfo, Registry};
use super::metrics::{Counters, ModelStats};
use super::text::{self, Plan, PromptTokens};
use super::{ollama, tgi, vllm, SimError};

/// What the engine tokenizes for a request (see [`Sim::prompt_tokens`]).
pub(crate) enum EngineInput<'a> {
    /// A chat-completions body: the engine renders its chat template.
    Chat(&'a [u8]),
    /// A completions prompt, and whether special tokens are added (the request's
    /// `add_special_tokens`, true by default).
    Completion(&'a str, bool),
    /// Token ids the request gave itself.
    Ids(Vec<u32>),
}

/// Largest request body the simulator reads.
pub(crate) const MAX_BODY: usize = 32 * 1024 * 1024;

/// A response body: a whole buffer (with a length) or a channel of chunks (chunked encoding).
pub(crate) enum SimBody {
    /// Known length (`content-length`).
    Full(Option<Bytes>),
    /// Chunks as they are produced; an `Err` aborts the connection mid-body.
    Channel(mpsc::Receiver<Result<Bytes, io::Error>>),
}

impl Body for SimBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        match self.get_mut() {
            SimBody::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            SimBody::Channel(rx) => rx.poll_recv(cx).map(|o| o.map(|r| r.map(Frame::data))),
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self, SimBody::Full(None))
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            SimBody::Full(Some(b)) => SizeHint::with_exact(b.len() as u64),
            SimBody::Full(None) => SizeHint::with_exact(0),
            _ => SizeHint::default(),
        }
    }
}

/// Per-model runtime state.
pub(crate) struct ModelRt {
    /// Served name (vLLM: the first served name; Ollama: `name:tag`).
    pub name: String,
    pub stats: Arc<ModelStats>,
    /// The scheduler (absent at speed 0).
    pub engine: Option<Engine>,
    /// Ollama residency: when the model is unloaded (None = not loaded).
    pub loaded_until: tokio::sync::Mutex<Option<std::time::Instant>>,
    /// A cheap copy of `loaded_until` for `/api/ps` (unix seconds, 0 = not loaded).
    pub loaded_until_unix: std::sync::atomic::AtomicU64,
}

/// State shared by every connection of one simulator.
pub(crate) struct Sim {
    pub config: SimConfig,
    pub fault: Arc<FaultState>,
    pub counters: Counters,
    pub models: Vec<ModelRt>,
    /// TGI's `max_concurrent_requests` semaphore.
    pub permits: Arc<Semaphore>,
    pub started_unix: u64,
    /// vLLM's Responses API store (empty unless `responses_store` is on).
    pub responses: super::responses::ResponseStore,
    /// Token id → text piece, learned from `/tokenize` calls, so `/detokenize` gives the text
    /// back (at most one entry per id of the tokenizer's fixed id range).
    pub vocab: std::sync::Mutex<std::collections::HashMap<u32, String>>,
    /// vLLM's KV-cache event publisher (`--kv-events-config`), fed by the engine.
    kv: Option<KvPublisher>,
    /// vLLM's loaded LoRA adapters (`--enable-lora`).
    loras: Option<Registry>,
    /// vLLM's `lora_requests_info` series, written by the engine (`--enable-lora`).
    lora_info: Option<Arc<LoraInfo>>,
    /// The W3C trace context (`traceparent`, and `tracestate` when sent) of the last
    /// [`TRACE_CONTEXTS_KEPT`] inference requests that had one: a real vLLM makes its request
    /// span a child of it (`--otlp-traces-endpoint`); the simulator shows what it was given
    /// in `/sim/state`.
    trace_contexts: std::sync::Mutex<std::collections::VecDeque<(String, Option<String>)>>,
}

/// How many received trace contexts `/sim/state` shows.
const TRACE_CONTEXTS_KEPT: usize = 64;

impl Sim {
    /// The simulator of `config`, its schedulers and its KV-event publisher started (inside a
    /// tokio runtime); fails when the publisher's sockets cannot be bound.
    pub(crate) fn new(config: SimConfig) -> Result<Sim, SimError> {
        let fault = Arc::new(FaultState::new(config.fault.clone()));
        let kv = match &config.kv_events {
            Some(k) if k.enabled() => Some(KvPublisher::start(k, config.host, fault.clone())?),
            _ => None,
        };
        let lora_on = config.kind == SimKind::Vllm && config.lora.enabled;
        let loras = lora_on
            .then(|| Registry::new(&config.lora, &config.models))
            .transpose()
            .map_err(|e| SimError::Config(format!("--lora-modules: {e}")))?;
        let lora_info = lora_on.then(|| Arc::new(LoraInfo::new(config.lora.max_loras)));
        let names: Vec<String> = match config.kind {
            SimKind::Ollama => config.models.clone(),
            _ => config.models.iter().take(1).cloned().collect(),
        };
        let now = super::unix_now();
        let models = names
            .into_iter()
            .map(|name| {
                let stats = Arc::new(ModelStats::new(
                    config.kind,
                    config.timing.kv_capacity_tokens,
                    config.max_model_len,
                ));
                let engine = (config.speed > 0.0).then(|| {
                    Engine::start(
                        Timing {
                            // TGI prefills an admitted group in a pass of its own
                            prefill_pass: config.kind == SimKind::Tgi,
                            ..config.timing.clone()
                        },
                        config.speed,
                        fault.clone(),
                        stats.clone(),
                        kv.as_ref().map(KvPublisher::sender),
                        lora_info.as_ref().map(|info| LoraRun {
                            max_loras: config.lora.max_loras,
                            load_time: config.lora.load_time,
                            info: info.clone(),
                        }),
                    )
                });
                let preload = config.preloaded || config.kind != SimKind::Ollama;
                let until = preload
                    .then(|| std::time::Instant::now().checked_add(config.keep_alive))
                    .flatten();
                ModelRt {
                    name,
                    stats,
                    engine,
                    loaded_until: tokio::sync::Mutex::new(until),
                    loaded_until_unix: std::sync::atomic::AtomicU64::new(if preload {
                        now + config.keep_alive.as_secs()
                    } else {
                        0
                    }),
                }
            })
            .collect();
        Ok(Sim {
            permits: Arc::new(Semaphore::new(config.max_concurrent_requests)),
            fault,
            counters: Counters::new(config.max_input_tokens, config.max_model_len),
            models,
            started_unix: now,
            responses: Default::default(),
            vocab: Default::default(),
            kv,
            loras,
            lora_info,
            trace_contexts: Default::default(),
            config,
        })
    }

    /// vLLM's loaded LoRA adapters (none: LoRA off).
    pub(crate) fn loras(&self) -> Option<&Registry> {
        self.loras.as_ref()
    }

    /// vLLM's `lora_requests_info` series (none: LoRA off).
    pub(crate) fn lora_info(&self) -> Option<&LoraInfo> {
        self.lora_info.as_deref()
    }

    /// vLLM's `GET /kv_event_sources` body: the publisher's config with its bound endpoints,
    /// `{}` when events are off (as vLLM answers then).
    pub(crate) fn kv_event_sources(&self) -> &str {
        self.kv.as_ref().map_or("{}", KvPublisher::sources_json)
    }

    /// Whether plans need prompt token ids (the scheduler's prefix cache, Ollama's `context`).
    pub(crate) fn needs_prompt_ids(&self) -> bool {
        self.config.speed > 0.0 || self.config.kind == SimKind::Ollama
    }

    /// The prompt tokens of a request as the engine counts them. Every prompt's ids come from
    /// here (or from [`Sim::rendered_tokens`], which it falls back to): usage, the context
    /// check and the scheduler's prefix-cache blocks all read what it returns.
    ///
    /// With a `--tokenizer`, chat bodies and completions prompts are tokenized as vLLM
    /// tokenizes them (`crate::tokenizer`: the chat template, then the encode; the prompt with
    /// special tokens) and token prompts are taken as given; the error is why vLLM would
    /// refuse the request. Without one, the simulator's own tokenizer reads `text`, the prompt
    /// it rendered itself.
    pub(crate) fn prompt_tokens(
        &self,
        text: &str,
        input: EngineInput<'_>,
    ) -> Result<PromptTokens, String> {
        let Some(t) = self.config.tokenizer.as_deref() else {
            return Ok(self.rendered_tokens(text));
        };
        let ids = match input {
            EngineInput::Chat(body) => t.chat_ids(body),
            EngineInput::Completion(prompt, special) => t.prompt_ids(prompt, special),
            EngineInput::Ids(ids) => Ok(ids),
        };
        ids.map(PromptTokens::from_ids).map_err(|e| e.to_string())
    }

    /// The tokens of a prompt the simulator rendered itself, by its own tokenizer (the ids
    /// only when something needs them): every prompt without a `--tokenizer`, and the other
    /// APIs' prompts with one.
    pub(crate) fn rendered_tokens(&self, text: &str) -> PromptTokens {
        PromptTokens::of_text(text, self.needs_prompt_ids())
    }

    /// The words one request to `model` will produce, under this simulator's output-length
    /// timing; the prompt is counted by the simulator's own tokenizer.
    pub(crate) fn plan(&self, seed: u64, model: &str, prompt: &str, max: Option<u32>) -> Plan {
        self.plan_tokens(seed, model, prompt, self.rendered_tokens(prompt), max)
    }

    /// [`Sim::plan`] for a prompt whose tokens are `tokens` (from [`Sim::prompt_tokens`]).
    pub(crate) fn plan_tokens(
        &self,
        seed: u64,
        model: &str,
        prompt: &str,
        tokens: PromptTokens,
        max: Option<u32>,
    ) -> Plan {
        let t = &self.config.timing;
        let (min, most) = (t.min_output_tokens, t.max_output_tokens);
        Plan::new(seed, model, prompt, tokens, max, min, most)
    }

    /// A plan of exactly `len` tokens ending by length, as an engine that ignores the end of
    /// text generates it, also when it continues an answer the prompt ends with.
    pub(crate) fn plan_to_length(
        &self,
        seed: u64,
        model: &str,
        prompt: &str,
        tokens: PromptTokens,
        len: u32,
    ) -> Plan {
        // A natural length nothing reaches: only the cap ends the answer. (One just beyond the
        // cap would end a continued answer early, by the words already given.)
        let beyond = u32::MAX;
        Plan::new(seed, model, prompt, tokens, Some(len), beyond, beyond)
    }

    /// The embedding of each text (`dimensions` long, else the configured size) and the tokens
    /// they count together.
    pub(crate) fn embed(
        &self,
        texts: &[String],
        dimensions: Option<usize>,
    ) -> (Vec<Vec<f32>>, usize) {
        let dim = dimensions
            .unwrap_or(self.config.embedding_dim)
            .clamp(1, 65_536);
        let vectors = texts
            .iter()
            .map(|t| text::embedding(self.config.seed, t, dim))
            .collect();
        let tokens = texts.iter().map(|t| text::count_tokens(t)).sum();
        (vectors, tokens)
    }

    /// Time scale for simulator-side delays (load time); `None` at speed 0.
    pub(crate) fn scaled(&self, d: Duration) -> Option<Duration> {
        if self.config.speed <= 0.0 {
            return None;
        }
        let f = self.fault.slow_factor() / self.config.speed;
        Some(d.mul_f64(f.clamp(0.0, 1.0e6)))
    }
}

/// Serve `listener` until `shutdown` completes.
pub(crate) async fn serve(
    listener: TcpListener,
    sim: Arc<Sim>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), SimError> {
    let mut conns = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            r = listener.accept() => {
                match r {
                    Ok((stream, _)) => {
                        let sim = sim.clone();
                        conns.spawn(serve_conn(sim, stream));
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "sim accept failed");
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                }
            }
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
    conns.abort_all();
    Ok(())
}

async fn is_control_request(stream: &TcpStream) -> bool {
    let mut buf = [0u8; 16];
    for _ in 0..50 {
        let r = tokio::time::timeout(Duration::from_millis(100), stream.peek(&mut buf)).await;
        match r {
            Ok(Ok(n)) if n > 0 => {
                let head = &buf[..n];
                if head.starts_with(b"POST /sim/") || head.starts_with(b"GET /sim/") {
                    return true;
                }
                if n >= 10 || !(b"POST /sim/".starts_with(head) || b"GET /sim/".starts_with(head)) {
                    return false;
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            Ok(Ok(_)) | Ok(Err(_)) => return false,
            Err(_) => return false,
        }
    }
    false
}

async fn serve_conn(sim: Arc<Sim>, stream: TcpStream) {
    if sim.fault.mode() == FaultMode::Refuse && !is_control_request(&stream).await {
        let _ = stream.set_zero_linger();
        drop(stream);
        return;
    }
    let _ = stream.set_nodelay(true);
    let svc = hyper::service::service_fn(move |req| {
        let sim = sim.clone();
        async move { handle(sim, req).await }
    });
    let _ = hyper::server::conn::http1::Builder::new()
        .keep_alive(true)
        .serve_connection(TokioIo::new(stream), svc)
        .await;
}

async fn handle(sim: Arc<Sim>, req: Request<Incoming>) -> Result<Response<SimBody>, io::Error> {
    let path = req.uri().path();
    if path.starts_with("/sim/") {
        return Ok(control(&sim, req).await);
    }
    if let Some(tp) = req
        .headers()
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
    {
        let state = req
            .headers()
            .get("tracestate")
            .and_then(|v| v.to_str().ok());
        let mut kept = sim.trace_contexts.lock().unwrap_or_else(|p| p.into_inner());
        if kept.len() == TRACE_CONTEXTS_KEPT {
            kept.pop_front();
        }
        kept.push_back((tp.to_string(), state.map(str::to_string)));
    }
    match sim.fault.mode() {
        FaultMode::Healthy => {}
        FaultMode::Refuse => {
            // a kept-alive connection: close it without an answer
            return Err(io::Error::new(io::ErrorKind::ConnectionReset, "refusing"));
        }
        FaultMode::Hang => sim.fault.wait_while_hang().await,
        FaultMode::Slow => {
            let ms = sim.fault.current().delay_ms;
            if ms > 0 {
                tokio::time::sleep(Duration::from_millis(ms)).await;
            }
        }
        _ => {}
    }
    let resp = match sim.config.kind {
        SimKind::Vllm => vllm::route(&sim, req).await,
        SimKind::Tgi => tgi::route(&sim, req).await,
        SimKind::Ollama => ollama::route(&sim, req).await,
    };
    sim.counters.status(resp.status().as_u16());
    Ok(resp)
}

/// Read a request body with the size cap.
pub(crate) async fn read_body(req: Request<Incoming>) -> Result<Bytes, ()> {
    match http_body_util::Limited::new(req.into_body(), MAX_BODY)
        .collect()
        .await
    {
        Ok(c) => Ok(c.to_bytes()),
        Err(_) => Err(()),
    }
}

/// Build a response with a body and content type.
pub(crate) fn response(
    status: StatusCode,
    content_type: &'static str,
    body: SimBody,
) -> Response<SimBody> {
    let mut r = Response::new(body);
    *r.status_mut() = status;
    if !content_type.is_empty() {
        r.headers_mut()
            .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    }
    r
}

/// A JSON response with a known length.
pub(crate) fn json(
    status: StatusCode,
    content_type: &'static str,
    body: impl Into<Bytes>,
) -> Response<SimBody> {
    response(status, content_type, SimBody::Full(Some(body.into())))
}

/// Writes the chunks of one streamed response, applying `drop_midstream`.
pub(crate) struct ChunkSink {
    tx: mpsc::Sender<Result<Bytes, io::Error>>,
    sent: u32,
    fault: Arc<FaultState>,
}

impl ChunkSink {
    /// Send one chunk; `false` means stop producing (client gone or connection cut).
    pub(crate) async fn send(&mut self, chunk: impl Into<Bytes>) -> bool {
        let f = self.fault.current();
        if f.mode == FaultMode::DropMidstream && self.sent >= f.after_chunks {
            // let hyper write out what was sent (it flushes once the channel is empty), then
            // abort the body: the connection is closed without the terminating chunk
            for _ in 0..200 {
                if self.tx.capacity() == self.tx.max_capacity() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
            let _ = self
                .tx
                .send(Err(io::Error::new(
                    io::ErrorKind::ConnectionAborted,
                    "drop_midstream",
                )))
                .await;
            return false;
        }
        self.sent += 1;
        self.tx.send(Ok(chunk.into())).await.is_ok()
    }
}

/// Start a streamed response: `produce` runs in its own task and writes through the sink.
pub(crate) fn stream_response<F, Fut>(
    sim: &Arc<Sim>,
    status: StatusCode,
    content_type: &'static str,
    produce: F,
) -> Response<SimBody>
where
    F: FnOnce(ChunkSink) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = mpsc::channel(16);
    let sink = ChunkSink {
        tx,
        sent: 0,
        fault: sim.fault.clone(),
    };
    tokio::spawn(produce(sink));
    response(status, content_type, SimBody::Channel(rx))
}

async fn control(sim: &Sim, req: Request<Incoming>) -> Response<SimBody> {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    match (method, path.as_str()) {
        (Method::POST, "/sim/fault") => {
            let Ok(body) = read_body(req).await else {
                return control_error("could not read the body");
            };
            match serde_json::from_slice::<FaultRequest>(&body) {
                Ok(r) => match r.into_fault() {
                    Ok(f) => {
                        if f.mode == FaultMode::Loading && sim.config.kind == SimKind::Ollama {
                            ollama::unload_all(sim).await;
                        }
                        sim.fault.set(f);
                        json(StatusCode::OK, "application/json", state_json(sim))
                    }
                    Err(e) => control_error(&e),
                },
                Err(e) => control_error(&e.to_string()),
            }
        }
        (Method::GET, "/sim/fault") => {
            let f = sim.fault.current();
            json(
                StatusCode::OK,
                "application/json",
                serde_json::to_vec(&f).unwrap_or_default(),
            )
        }
        (Method::GET, "/sim/state") => json(StatusCode::OK, "application/json", state_json(sim)),
        _ => json(
            StatusCode::NOT_FOUND,
            "application/json",
            r#"{"error":"unknown control route (POST /sim/fault, GET /sim/fault, GET /sim/state)"}"#,
        ),
    }
}

fn control_error(msg: &str) -> Response<SimBody> {
    let body = serde_json::json!({ "error": msg });
    json(
        StatusCode::BAD_REQUEST,
        "application/json",
        body.to_string(),
    )
}

/// The `/sim/state` document.
pub(crate) fn state_json(sim: &Sim) -> Vec<u8> {
    let f = sim.fault.current();
    let (since, remaining) = sim.fault.since_and_remaining();
    let c = &sim.counters;
    let contexts: Vec<(String, Option<String>)> = sim
        .trace_contexts
        .lock()
        .map(|k| k.iter().cloned().collect())
        .unwrap_or_default();
    let models: Vec<serde_json::Value> = sim
        .models
        .iter()
        .map(|m| {
            let s = &m.stats;
            serde_json::json!({
                "name": m.name,
                "waiting": s.waiting.load(Relaxed),
                "running": s.running.load(Relaxed),
                "kv_used_tokens": s.kv_used_tokens.load(Relaxed),
                "kv_reserved_tokens": s.kv_reserved_tokens.load(Relaxed),
                "kv_capacity_tokens": s.kv_capacity_tokens.load(Relaxed),
                "kv_usage": s.kv_usage(),
                "prefix_cache_queries": s.prefix_queries.load(Relaxed),
                "prefix_cache_hits": s.prefix_hits.load(Relaxed),
                "prompt_tokens": s.prompt_tokens.load(Relaxed),
                "generation_tokens": s.generation_tokens.load(Relaxed),
                "requests_finished": s.success_stop.load(Relaxed) + s.success_length.load(Relaxed),
                "requests_aborted": s.aborted.load(Relaxed),
                "loaded": m.loaded_until_unix.load(Relaxed) > super::unix_now(),
            })
        })
        .collect();
    let by_status: serde_json::Map<String, serde_json::Value> = c
        .statuses()
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.into()))
        .collect();
    let waiting: u64 = sim
        .models
        .iter()
        .map(|m| m.stats.waiting.load(Relaxed))
        .sum();
    let running: u64 = sim
        .models
        .iter()
        .map(|m| m.stats.running.load(Relaxed))
        .sum();
    let hits: u64 = sim
        .models
        .iter()
        .map(|m| m.stats.prefix_hits.load(Relaxed))
        .sum();
    let doc = serde_json::json!({
        "kind": sim.config.kind.as_str(),
        "speed": sim.config.speed,
        "fault": f,
        "mode": f.mode,
        "fault_age_seconds": since.as_secs_f64(),
        "fault_remaining_seconds": remaining.map(|d| d.as_secs_f64()),
        "max_num_seqs": sim.config.timing.max_num_seqs,
        "waiting": waiting,
        "running": running,
        "models": models,
        "traceparents": contexts.iter().map(|(p, _)| p).collect::<Vec<_>>(),
        "tracestates": contexts.iter().map(|(_, s)| s).collect::<Vec<_>>(),
        "counters": {
            "requests_total": c.requests_total.load(Relaxed),
            "by_status": by_status,
            "tokens_in": c.tokens_in.load(Relaxed),
            "tokens_out": c.tokens_out.load(Relaxed),
            "prefix_cache_hits": hits,
            "overloaded": c.overloaded.load(Relaxed),
        },
    });
    serde_json::to_vec(&doc).unwrap_or_default()
}

/// An empty-bodied response helper used by health routes.
pub(crate) fn empty(status: StatusCode) -> Response<SimBody> {
    response(status, "", SimBody::Full(None))
}
