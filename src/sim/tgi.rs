//! The TGI (text-generation-inference 3.3) personality: `/health`, `/info`, native `/generate`
//! and `/generate_stream` (SSE `data:` without a space, no `[DONE]`), the Messages API
//! (`id: ""`, `model` echoed, `data:[DONE]`), `/v1/models`, `/tokenize`, `/metrics`.
//!
//! Invariants: TGI serves one model (`model_id` = the first configured name); a semaphore of
//! `max_concurrent_requests` permits is tried without waiting, as TGI's `try_acquire_owned`:
//! a non-stream request past it gets 429 `Model is overloaded`, a stream gets the error as an
//! SSE event inside a 200. Validation errors are 422 `{"error","error_type":"validation"}`
//! (in-stream for streams); malformed JSON gets axum's plain-text rejection.
//!
//! LoRA (TGI's multi-LoRA): `--lora-adapters` are fixed at start; a request names one in
//! `parameters.adapter_id` (`/generate`, `/generate_stream`) or in `model` (its OpenAI routes;
//! `tgi` means the base model) and is answered by it. An id TGI was not started with is not an
//! error: TGI's shards fall back to the base model. `/info` does not list adapters (TGI 3's
//! `Info` has no such field).

// Validation helpers return the engine's ready-made error answer as their `Err`; it is built
// only on the failure path, so its size does not matter.
#![allow(clippy::result_large_err)]

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use serde::Deserialize;
use tokio::sync::OwnedSemaphorePermit;

use super::fault::FaultMode;
use super::gen::Gen;
use super::openai_surface::{
    js, respond, ChatRequest, CompletionRequest, Ctx, RespondOpts, StreamOptions, Surface,
    TGI_VERSION,
};
use super::server::{empty, json, read_body, stream_response, Sim, SimBody};
use super::text::{self, Finish, Plan};

const JSON: &str = "application/json";
const SSE: &str = "text/event-stream";
const TEXT: &str = "text/plain; charset=utf-8";

/// Answer one request in TGI's manner.
pub(crate) async fn route(sim: &Arc<Sim>, req: Request<Incoming>) -> Response<SimBody> {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    match (path.as_str(), &method) {
        ("/" | "/health" | "/ping", &Method::GET) => health(sim),
        ("/info", &Method::GET) => info(sim),
        ("/v1/models", &Method::GET) => {
            let m = js(&sim.config.models[0]);
            json(
                StatusCode::OK,
                JSON,
                format!("{{\"object\":\"list\",\"data\":[{{\"id\":{m},\"object\":\"model\",\"created\":0,\"owned_by\":{m}}}]}}"),
            )
        }
        ("/metrics", &Method::GET) => json(
            StatusCode::OK,
            "text/plain; charset=utf-8",
            super::metrics::render_tgi(&sim.models[0].stats, &sim.counters),
        ),
        ("/generate", &Method::POST) => generate(sim, req, Native::Generate).await,
        ("/generate_stream", &Method::POST) => generate(sim, req, Native::Stream).await,
        ("/", &Method::POST) => generate(sim, req, Native::Compat).await,
        ("/v1/chat/completions", &Method::POST) => openai(sim, req, true).await,
        ("/v1/completions", &Method::POST) => openai(sim, req, false).await,
        ("/tokenize", &Method::POST) => tokenize(sim, req).await,
        (
            "/"
            | "/health"
            | "/ping"
            | "/info"
            | "/v1/models"
            | "/metrics"
            | "/generate"
            | "/generate_stream"
            | "/v1/chat/completions"
            | "/v1/completions"
            | "/tokenize",
            _,
        ) => empty(StatusCode::METHOD_NOT_ALLOWED),
        _ => empty(StatusCode::NOT_FOUND),
    }
}

fn error(status: StatusCode, message: &str, ty: &str) -> Response<SimBody> {
    json(
        status,
        JSON,
        format!("{{\"error\":{},\"error_type\":{}}}", js(message), js(ty)),
    )
}

fn health(sim: &Sim) -> Response<SimBody> {
    match sim.fault.mode() {
        FaultMode::HealthFail | FaultMode::Loading => {
            error(StatusCode::SERVICE_UNAVAILABLE, "unhealthy", "healthcheck")
        }
        _ => empty(StatusCode::OK),
    }
}

fn info(sim: &Sim) -> Response<SimBody> {
    let c = &sim.config;
    json(
        StatusCode::OK,
        JSON,
        format!(
            "{{\"model_id\":{},\"model_sha\":null,\"model_pipeline_tag\":\"text-generation\",\"max_concurrent_requests\":{},\"max_best_of\":2,\"max_stop_sequences\":4,\"max_input_tokens\":{},\"max_total_tokens\":{},\"validation_workers\":2,\"max_client_batch_size\":4,\"router\":\"text-generation-router\",\"version\":\"{TGI_VERSION}\",\"sha\":null,\"docker_label\":null}}",
            js(&c.models[0]),
            c.max_concurrent_requests,
            c.max_input_tokens.min(c.max_model_len.saturating_sub(1)),
            c.max_model_len
        ),
    )
}

/// axum's `Json` extractor rejections, as TGI answers malformed bodies.
fn parse<T: for<'de> Deserialize<'de>>(body: &[u8]) -> Result<T, Response<SimBody>> {
    serde_json::from_slice::<T>(body).map_err(|e| {
        use serde_json::error::Category;
        match e.classify() {
            Category::Data => json(
                StatusCode::UNPROCESSABLE_ENTITY,
                TEXT,
                format!("Failed to deserialize the JSON body into the target type: {e}"),
            ),
            _ => json(
                StatusCode::BAD_REQUEST,
                TEXT,
                format!("Failed to parse the request body as JSON: {e}"),
            ),
        }
    })
}

fn is_json(req: &Request<Incoming>) -> bool {
    req.headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|v| v.starts_with("application/json") || v.contains("+json"))
        .unwrap_or(false)
}

fn unsupported_media() -> Response<SimBody> {
    json(
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        TEXT,
        "Expected request with `Content-Type: application/json`",
    )
}

/// Validation and the effective `max_new_tokens`, with TGI's messages.
fn validate(sim: &Sim, input: u32, max_new: Option<i64>) -> Result<u32, String> {
    let max_input = sim
        .config
        .max_input_tokens
        .min(sim.config.max_model_len.saturating_sub(1));
    let total = sim.config.max_model_len;
    if input > max_input {
        return Err(format!(
            "`inputs` must have less than {max_input} tokens. Given: {input}"
        ));
    }
    match max_new {
        Some(m) if m <= 0 => Err("`max_new_tokens` must be strictly positive".into()),
        Some(m) if m + i64::from(input) > i64::from(total) => Err(format!(
            "`inputs` tokens + `max_new_tokens` must be <= {total}. Given: {input} `inputs` tokens and {m} `max_new_tokens`"
        )),
        Some(m) => Ok(m as u32),
        None => Ok(total - input),
    }
}

enum Gate {
    Go(OwnedSemaphorePermit),
    Overloaded,
    Failed(Response<SimBody>),
}

/// Faults and the concurrency limit.
fn gate(sim: &Sim) -> Gate {
    match sim.fault.mode() {
        FaultMode::Overloaded => return Gate::Overloaded,
        FaultMode::Loading => {
            return Gate::Failed(error(
                StatusCode::SERVICE_UNAVAILABLE,
                "Model is loading",
                "unhealthy",
            ))
        }
        FaultMode::ErrorRate if sim.fault.roll_error() => {
            return Gate::Failed(error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "Incomplete generation",
                "incomplete_generation",
            ))
        }
        _ => {}
    }
    match sim.permits.clone().try_acquire_owned() {
        Ok(p) => Gate::Go(p),
        Err(_) => Gate::Overloaded,
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Native {
    Generate,
    Stream,
    Compat,
}

#[derive(Deserialize)]
struct Parameters {
    #[serde(default)]
    max_new_tokens: Option<i64>,
    #[serde(default)]
    details: Option<bool>,
    #[serde(default)]
    seed: Option<u64>,
    /// The LoRA adapter to run under (one of `--lora-adapters`).
    #[serde(default)]
    adapter_id: Option<String>,
}

#[derive(Deserialize)]
struct GenerateRequest {
    inputs: String,
    #[serde(default)]
    parameters: Option<Parameters>,
    #[serde(default)]
    stream: Option<bool>,
}

/// What a request asking for the adapter `id` runs under, as the name that seeds its words:
/// one of `--lora-adapters`, else the base model. TGI does not refuse an unknown adapter id:
/// its shards look it up and fall back to the base model (index 0).
fn adapter<'a>(sim: &'a Sim, id: Option<&str>) -> &'a str {
    id.and_then(|id| sim.config.tgi_lora_adapters.iter().find(|a| *a == id))
        .unwrap_or(&sim.config.models[0])
}

fn logprob(word: u16) -> f64 {
    -((word % 40) as f64) / 16.0 - 0.0625
}

fn token_json(plan: &Plan, i: usize) -> String {
    let w = plan.words.get(i).copied().unwrap_or(0);
    format!(
        "{{\"id\":{},\"text\":\"{}\",\"logprob\":{},\"special\":false}}",
        plan.token_id(i),
        plan.text(i, i + 1),
        logprob(w)
    )
}

fn native_finish(f: Finish) -> &'static str {
    match f {
        Finish::Stop => "eos_token",
        Finish::Length => "length",
    }
}

fn overloaded_response(sim: &Sim) -> Response<SimBody> {
    sim.counters.overloaded.fetch_add(1, Relaxed);
    error(
        StatusCode::TOO_MANY_REQUESTS,
        "Model is overloaded",
        "overloaded",
    )
}

fn stream_error(sim: &Arc<Sim>, body: String) -> Response<SimBody> {
    let mut r = stream_response(sim, StatusCode::OK, SSE, move |mut sink| async move {
        let _ = sink.send(body).await;
    });
    stream_headers(&mut r, 0);
    r
}

fn stream_headers(r: &mut Response<SimBody>, chars: usize) {
    let h = r.headers_mut();
    h.insert("x-compute-type", HeaderValue::from_static("gpu+optimized"));
    if let Ok(v) = HeaderValue::from_str(&chars.to_string()) {
        h.insert("x-compute-characters", v);
    }
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
}

/// A JSON request's body: 415 for another content type, 413 beyond the size limit.
async fn read_json_body(req: Request<Incoming>) -> Result<Bytes, Response<SimBody>> {
    if !is_json(&req) {
        return Err(unsupported_media());
    }
    read_body(req)
        .await
        .map_err(|_| json(StatusCode::PAYLOAD_TOO_LARGE, TEXT, "length limit exceeded"))
}

async fn generate(sim: &Arc<Sim>, req: Request<Incoming>, kind: Native) -> Response<SimBody> {
    let body = match read_json_body(req).await {
        Ok(b) => b,
        Err(resp) => return resp,
    };
    let r: GenerateRequest = match parse(&body) {
        Ok(r) => r,
        Err(resp) => return resp,
    };
    let stream = match kind {
        Native::Generate => false,
        Native::Stream => true,
        Native::Compat => r.stream.unwrap_or(false),
    };
    let params = r.parameters.unwrap_or(Parameters {
        max_new_tokens: None,
        details: None,
        seed: None,
        adapter_id: None,
    });
    let input_tokens = text::count_tokens(&r.inputs) as u32;
    let chars = r.inputs.chars().count();
    let cap = match validate(sim, input_tokens, params.max_new_tokens) {
        Ok(c) => c,
        Err(msg) => {
            sim.counters.validation.fetch_add(1, Relaxed);
            if stream {
                return stream_error(
                    sim,
                    format!(
                        "data:{{\"error\":{},\"error_type\":\"validation\"}}\n\n",
                        js(&msg)
                    ),
                );
            }
            return error(StatusCode::UNPROCESSABLE_ENTITY, &msg, "validation");
        }
    };
    let permit = match gate(sim) {
        Gate::Go(p) => p,
        Gate::Overloaded if stream => {
            sim.counters.overloaded.fetch_add(1, Relaxed);
            return stream_error(
                sim,
                "data:{\"error\":\"Model is overloaded\",\"error_type\":\"overloaded\"}\n\n".into(),
            );
        }
        Gate::Overloaded => return overloaded_response(sim),
        Gate::Failed(resp) => return resp,
    };
    let seed = params.seed.unwrap_or(sim.config.seed);
    let runs = adapter(sim, params.adapter_id.as_deref());
    let plan = sim.plan(seed, runs, &r.inputs, Some(cap));
    let Ok(mut gen) = Gen::start(sim, 0, plan, None) else {
        return overloaded_response(sim);
    };
    let seed_json = params
        .seed
        .map(|s| s.to_string())
        .unwrap_or_else(|| "null".into());
    if !stream {
        gen.run_to_end().await;
        drop(permit);
        let p = &gen.plan;
        let text = p.text(0, p.words.len());
        let details = if params.details.unwrap_or(false) {
            let tokens: Vec<String> = (0..p.words.len()).map(|i| token_json(p, i)).collect();
            format!(
                ",\"details\":{{\"finish_reason\":\"{}\",\"generated_tokens\":{},\"seed\":{seed_json},\"prefill\":[],\"tokens\":[{}]}}",
                native_finish(p.finish),
                p.completion_tokens(),
                tokens.join(",")
            )
        } else {
            String::new()
        };
        let one = format!("{{\"generated_text\":\"{text}\"{details}}}");
        let body = if kind == Native::Compat {
            format!("[{one}]")
        } else {
            one
        };
        let mut resp = json(StatusCode::OK, JSON, body);
        let (total, _, _) = gen.durations_ns();
        let (queue, inference) = gen.queue_inference_ns();
        let n = p.completion_tokens().max(1) as u64;
        let h = resp.headers_mut();
        let ms = |ns: u64| (ns / 1_000_000).to_string();
        for (k, v) in [
            ("x-compute-type", "gpu+optimized".to_string()),
            ("x-compute-time", format!("{}", total as f64 / 1e9)),
            ("x-compute-characters", chars.to_string()),
            ("x-total-time", ms(total)),
            ("x-validation-time", "0".to_string()),
            ("x-queue-time", ms(queue)),
            ("x-inference-time", ms(inference)),
            ("x-time-per-token", ms(inference / n)),
            ("x-prompt-tokens", p.prompt_tokens().to_string()),
            ("x-generated-tokens", p.completion_tokens().to_string()),
        ] {
            if let Ok(v) = HeaderValue::from_str(&v) {
                h.insert(k, v);
            }
        }
        return resp;
    }
    let mut resp = stream_response(sim, StatusCode::OK, SSE, move |mut sink| async move {
        let _permit = permit;
        let total = gen.plan.words.len();
        while let Some(range) = gen.next().await {
            for i in range {
                let last = i + 1 == total;
                let tail = if last {
                    let p = &gen.plan;
                    format!(
                        "\"generated_text\":\"{}\",\"details\":{{\"finish_reason\":\"{}\",\"generated_tokens\":{},\"seed\":{seed_json},\"input_length\":{}}}",
                        p.text(0, total),
                        native_finish(p.finish),
                        p.completion_tokens(),
                        p.prompt_tokens()
                    )
                } else {
                    "\"generated_text\":null,\"details\":null".to_string()
                };
                let ev = format!(
                    "data:{{\"index\":{},\"token\":{},{tail}}}\n\n",
                    i + 1,
                    token_json(&gen.plan, i)
                );
                if !sink.send(ev).await {
                    return;
                }
            }
        }
    });
    stream_headers(&mut resp, chars);
    resp
}

/// TGI's 422 for a request without a required field (axum's JSON extractor).
fn missing_field(body: &[u8], field: &str) -> Response<SimBody> {
    json(
        StatusCode::UNPROCESSABLE_ENTITY,
        TEXT,
        format!(
            "Failed to deserialize the JSON body into the target type: missing field `{field}` at line 1 column {}",
            body.len()
        ),
    )
}

async fn openai(sim: &Arc<Sim>, req: Request<Incoming>, chat: bool) -> Response<SimBody> {
    let body = match read_json_body(req).await {
        Ok(b) => b,
        Err(resp) => return resp,
    };
    // Tools are read from the body as TGI reads them (see `tgi_tools`).
    let tool_body: Option<serde_json::Value> = if chat {
        serde_json::from_slice(&body).ok()
    } else {
        None
    };
    let (model, prompt, max_tokens, (stream, usage), seed) = if chat {
        let r: ChatRequest = match parse(&body) {
            Ok(r) => r,
            Err(resp) => return resp,
        };
        if r.messages.is_none() {
            return missing_field(&body, "messages");
        }
        // TGI: `continue_final_message` leaves the last message open (no generation prompt)
        let form = match r.continue_final_message {
            Some(true) => text::Render::ContinueLast,
            _ => text::Render::Answer,
        };
        (
            r.model.clone(),
            r.render(form),
            r.max_tokens.or(r.max_completion_tokens),
            StreamOptions::flags(r.stream, &r.stream_options),
            r.seed,
        )
    } else {
        let r: CompletionRequest = match parse(&body) {
            Ok(r) => r,
            Err(resp) => return resp,
        };
        let Some(p) = &r.prompt else {
            return missing_field(&body, "prompt");
        };
        (
            r.model.clone(),
            p.text(),
            r.max_tokens.or(r.max_completion_tokens),
            StreamOptions::flags(r.stream, &r.stream_options),
            r.seed,
        )
    };
    // TGI: "tgi" or no model means model_id; anything else is echoed back
    let echo = match model.as_deref() {
        None | Some("tgi") | Some("") => sim.config.models[0].clone(),
        Some(m) => m.to_string(),
    };
    let input_tokens = text::count_tokens(&prompt) as u32;
    let in_stream_error = |msg: &str| {
        format!(
            "data:{{\"error\":{{\"message\":{},\"http_status_code\":422}}}}\n\ndata:[DONE]\n\n",
            js(msg)
        )
    };
    let cap = match validate(sim, input_tokens, max_tokens) {
        Ok(c) => c,
        Err(msg) => {
            sim.counters.validation.fetch_add(1, Relaxed);
            if stream {
                return stream_error(sim, in_stream_error(&msg));
            }
            return error(StatusCode::UNPROCESSABLE_ENTITY, &msg, "validation");
        }
    };
    let seed = seed.map(|s| s as u64).unwrap_or(sim.config.seed);
    // TGI's OpenAI routes pass `model` on as the adapter id
    let runs = adapter(sim, model.as_deref().filter(|m| *m != "tgi"));
    let mut plan = sim.plan(seed, runs, &prompt, Some(cap));
    let words = plan.text(0, plan.words.len());
    let words: Vec<&str> = words.split_whitespace().collect();
    let forced = match tool_body
        .as_ref()
        .map(|b| super::tgi_tools::forced(b, &words))
    {
        Some(Err(msg)) => {
            return error(StatusCode::UNPROCESSABLE_ENTITY, &msg, "tool_error");
        }
        Some(Ok(f)) => f,
        None => None,
    };
    if let Some(f) = &forced {
        super::tgi_tools::shape_plan(&mut plan, f, cap);
    }
    let permit = match gate(sim) {
        Gate::Go(p) => p,
        Gate::Overloaded if stream => {
            sim.counters.overloaded.fetch_add(1, Relaxed);
            return stream_error(sim, in_stream_error("Model is overloaded"));
        }
        Gate::Overloaded => return overloaded_response(sim),
        Gate::Failed(resp) => return resp,
    };
    let ctx = Ctx::new(Surface::Tgi, chat, &echo);
    if let Some(forced) = forced {
        let call = ToolCall {
            forced,
            stream,
            usage,
        };
        return tool_call(sim, ctx, plan, call, permit, prompt.chars().count()).await;
    }
    let opts = RespondOpts {
        chat,
        stream,
        include_usage: usage,
        model_idx: 0,
        queue_limit: None,
        json_ct: JSON,
        sse_ct: SSE,
        guard: Some(Box::new(permit)),
    };
    match respond(sim, ctx, plan, opts).await {
        Ok(mut r) => {
            if stream {
                stream_headers(&mut r, prompt.chars().count());
            }
            r
        }
        Err(_) => overloaded_response(sim),
    }
}

/// A forced tool call to answer, and how.
struct ToolCall {
    forced: super::tgi_tools::Forced,
    stream: bool,
    usage: bool,
}

/// Answer with a tool call (see `tgi_tools`), whole or streamed, holding the permit throughout.
async fn tool_call(
    sim: &Arc<Sim>,
    ctx: Ctx,
    plan: Plan,
    call: ToolCall,
    permit: OwnedSemaphorePermit,
    prompt_chars: usize,
) -> Response<SimBody> {
    use super::tgi_tools::{chunk, whole};
    let Ok(mut gen) = Gen::start(sim, 0, plan, None) else {
        return overloaded_response(sim);
    };
    let model = ctx.model_json.clone();
    if !call.stream {
        gen.run_to_end().await;
        drop(permit);
        let p = &gen.plan;
        let usage = format!(
            "{{\"prompt_tokens\":{},\"completion_tokens\":{},\"total_tokens\":{}}}",
            p.prompt_tokens(),
            p.completion_tokens(),
            p.prompt_tokens() + p.completion_tokens()
        );
        return match whole(&call.forced, p, &model, ctx.created, &usage) {
            Ok(body) => json(StatusCode::OK, JSON, body),
            Err(msg) => error(StatusCode::UNPROCESSABLE_ENTITY, &msg, "tool_error"),
        };
    }
    let mut r = stream_response(sim, StatusCode::OK, SSE, move |mut sink| async move {
        let _permit = permit;
        while let Some(range) = gen.next().await {
            for i in range {
                if !sink
                    .send(chunk(&call.forced, &gen.plan, i, &model, ctx.created))
                    .await
                {
                    return;
                }
            }
        }
        if call.usage {
            let p = &gen.plan;
            let u = ctx.usage_chunk(
                true,
                p.prompt_tokens(),
                p.completion_tokens(),
                gen.cache_use(),
            );
            if !sink.send(u).await {
                return;
            }
        }
        let _ = sink.send(ctx.done()).await;
    });
    stream_headers(&mut r, prompt_chars);
    r
}

#[derive(Deserialize)]
struct TokenizeRequest {
    inputs: String,
}

async fn tokenize(_sim: &Arc<Sim>, req: Request<Incoming>) -> Response<SimBody> {
    let body = match read_json_body(req).await {
        Ok(b) => b,
        Err(resp) => return resp,
    };
    let r: TokenizeRequest = match parse(&body) {
        Ok(r) => r,
        Err(resp) => return resp,
    };
    let items: Vec<String> = text::token_strs(&r.inputs)
        .into_iter()
        .map(|(id, t, start, stop)| {
            format!(
                "{{\"id\":{id},\"text\":{},\"start\":{start},\"stop\":{stop}}}",
                js(&t)
            )
        })
        .collect();
    json(StatusCode::OK, JSON, format!("[{}]", items.join(",")))
}
