//! The vLLM 0.32 personality: routes, headers (`server: uvicorn`, `vary: Origin`), validation
//! errors in vLLM's nested body with an integer `code`, `/tokenize`, `/detokenize`, `/metrics`.
//!
//! Invariants: every configured model name is a served alias of one engine (as
//! `--served-model-name a b` does): requests may use any alias or omit `model`; responses and
//! the metrics label use the first name. Bodies and SSE framing match the captures of a real
//! vLLM 0.32 server byte for byte (except ids, timestamps and the text). A prompt plus
//! `max_tokens` beyond `max_model_len` is vLLM's 400 before any work; `ignore_eos: true` on
//! chat and completions generates exactly `max_tokens` (or what the context leaves) and ends by
//! `length`, as the end of text no longer stops it.

// Validation helpers return the engine's ready-made error answer as their `Err`; it is built
// only on the failure path, so its size does not matter.
#![allow(clippy::result_large_err)]

use std::collections::BTreeMap;
use std::sync::Arc;

use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use serde::de::IgnoredAny;
use serde::Deserialize;

use super::fault::FaultMode;
use super::lora::{Adapter, LoraError};
use super::openai_surface::Prompt;
use super::openai_surface::{
    embeddings_body, js, respond, ChatRequest, CompletionRequest, Ctx, EmbeddingRequest,
    RespondOpts, Surface,
};
use super::server::{empty, json, read_body, EngineInput, Sim, SimBody};
use super::text::{self, PromptTokens};

pub(super) const JSON: &str = "application/json";
pub(super) const SSE: &str = "text/event-stream; charset=utf-8";
/// The version `/version` reports.
pub(crate) const VERSION: &str = "0.32.0";

/// Answer one request in vLLM's manner.
pub(crate) async fn route(sim: &Arc<Sim>, req: Request<Incoming>) -> Response<SimBody> {
    let mut resp = dispatch(sim, req).await;
    let h = resp.headers_mut();
    h.insert(header::SERVER, HeaderValue::from_static("uvicorn"));
    h.insert(header::VARY, HeaderValue::from_static("Origin"));
    resp
}

async fn dispatch(sim: &Arc<Sim>, req: Request<Incoming>) -> Response<SimBody> {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    match (path.as_str(), &method) {
        ("/health", &Method::GET) | ("/ping", &Method::GET) | ("/ping", &Method::POST) => {
            health(sim)
        }
        ("/version", &Method::GET) => json(
            StatusCode::OK,
            JSON,
            format!("{{\"version\":\"{VERSION}\"}}"),
        ),
        ("/v1/models", &Method::GET) => models(sim),
        ("/kv_event_sources", &Method::GET) => {
            json(StatusCode::OK, JSON, sim.kv_event_sources().to_string())
        }
        ("/reset_prefix_cache", &Method::POST) if sim.config.server_dev_mode => {
            reset_prefix_cache(sim, req.uri().query()).await
        }
        ("/reset_prefix_cache", _) if sim.config.server_dev_mode => method_not_allowed(),
        ("/metrics", &Method::GET) => {
            let m = &sim.models[0];
            let body = super::metrics::render_vllm(
                &m.name,
                &m.stats,
                sim.config.timing.kv_capacity_tokens,
                sim.config.timing.block_size,
                sim.lora_info(),
            );
            json(
                StatusCode::OK,
                "text/plain; version=1.0.0; charset=utf-8",
                body,
            )
        }
        ("/v1/load_lora_adapter", &Method::POST) if runtime_lora(sim) => {
            load_lora_adapter(sim, req).await
        }
        ("/v1/unload_lora_adapter", &Method::POST) if runtime_lora(sim) => {
            unload_lora_adapter(sim, req).await
        }
        ("/v1/load_lora_adapter" | "/v1/unload_lora_adapter", _) if runtime_lora(sim) => {
            method_not_allowed()
        }
        ("/v1/chat/completions", &Method::POST) => chat(sim, req).await,
        ("/v1/completions", &Method::POST) => completions(sim, req).await,
        ("/v1/embeddings", &Method::POST) => embeddings(sim, req).await,
        ("/tokenize", &Method::POST) => tokenize(sim, req).await,
        ("/detokenize", &Method::POST) => detokenize(sim, req).await,
        ("/v1/chat/completions/batch", &Method::POST) => chat_batch(sim, req).await,
        ("/v1/responses", &Method::POST) => super::responses::create(sim, req).await,
        ("/v1/messages", &Method::POST) => super::anthropic::messages(sim, req).await,
        ("/v1/messages/count_tokens", &Method::POST) => {
            super::anthropic::count_tokens(sim, req).await
        }
        ("/v1/rerank" | "/rerank", &Method::POST) => super::pooling::rerank(sim, req).await,
        ("/v1/score" | "/score", &Method::POST) => super::pooling::score_pairs(sim, req).await,
        ("/v1/audio/transcriptions", &Method::POST) => {
            super::audio::speech_to_text(sim, req, false).await
        }
        ("/v1/audio/translations", &Method::POST) => {
            super::audio::speech_to_text(sim, req, true).await
        }
        (
            "/health"
            | "/ping"
            | "/version"
            | "/v1/models"
            | "/kv_event_sources"
            | "/metrics"
            | "/v1/chat/completions"
            | "/v1/chat/completions/batch"
            | "/v1/completions"
            | "/v1/embeddings"
            | "/v1/responses"
            | "/v1/messages"
            | "/v1/messages/count_tokens"
            | "/tokenize"
            | "/detokenize"
            | "/v1/rerank"
            | "/rerank"
            | "/v1/score"
            | "/score"
            | "/v1/audio/transcriptions"
            | "/v1/audio/translations",
            _,
        ) => method_not_allowed(),
        _ => match response_route(&path) {
            Some((id, cancel)) if method == (if cancel { Method::POST } else { Method::GET }) => {
                super::responses::by_id(sim, id, cancel, req.uri().query())
            }
            // FastAPI: the path exists, not with this method (vLLM 0.32 has no DELETE)
            Some(_) => method_not_allowed(),
            None => json(StatusCode::NOT_FOUND, JSON, "{\"detail\":\"Not Found\"}"),
        },
    }
}

/// vLLM's development route (`VLLM_SERVER_DEV_MODE=1`): drop the prefix cache, refused
/// (`success: false`) while requests run unless `reset_running_requests=true`. Its
/// `AllBlocksCleared` event is published with the engine's next step.
async fn reset_prefix_cache(sim: &Sim, query: Option<&str>) -> Response<SimBody> {
    let mut force = false;
    for (k, v) in query
        .unwrap_or("")
        .split('&')
        .filter_map(|p| p.split_once('='))
    {
        // reset_external concerns a KV connector's cache; the simulator has none
        if k != "reset_running_requests" && k != "reset_external" {
            continue;
        }
        let Some(b) = query_bool(v) else {
            return error(
                StatusCode::BAD_REQUEST,
                &format!("1 validation error:\n  {{'type': 'bool_parsing', 'loc': ('query', '{k}'), 'msg': 'Input should be a valid boolean, unable to interpret input', 'input': '{v}'}}"),
                "Bad Request",
                None,
            );
        };
        if k == "reset_running_requests" {
            force = b;
        }
    }
    let success = match &sim.models[0].engine {
        Some(engine) => engine.reset_prefix_cache(force).await,
        // no scheduler, no prefix cache: nothing to drop
        None => true,
    };
    json(StatusCode::OK, JSON, format!("{{\"success\":{success}}}"))
}

/// A query parameter as FastAPI reads a `bool`.
fn query_bool(v: &str) -> Option<bool> {
    match v.to_ascii_lowercase().as_str() {
        "1" | "true" | "on" | "yes" | "t" | "y" => Some(true),
        "0" | "false" | "off" | "no" | "f" | "n" => Some(false),
        _ => None,
    }
}

fn method_not_allowed() -> Response<SimBody> {
    json(
        StatusCode::METHOD_NOT_ALLOWED,
        JSON,
        "{\"detail\":\"Method Not Allowed\"}",
    )
}

/// `/v1/responses/{id}` → `(id, false)`, `/v1/responses/{id}/cancel` → `(id, true)`.
fn response_route(path: &str) -> Option<(&str, bool)> {
    let rest = path.strip_prefix("/v1/responses/")?;
    let (id, cancel) = match rest.strip_suffix("/cancel") {
        Some(id) => (id, true),
        None => (rest, false),
    };
    (!id.is_empty() && !id.contains('/')).then_some((id, cancel))
}

fn health(sim: &Sim) -> Response<SimBody> {
    match sim.fault.mode() {
        FaultMode::HealthFail | FaultMode::Loading => empty(StatusCode::SERVICE_UNAVAILABLE),
        _ => empty(StatusCode::OK),
    }
}

fn models(sim: &Sim) -> Response<SimBody> {
    let created = super::unix_now();
    let root = format!("/models/{}", sim.config.models[0]);
    let base = &sim.config.models[0];
    let mut data: Vec<String> = sim
        .config
        .models
        .iter()
        .map(|m| {
            let len = sim.config.max_model_len.to_string();
            model_card(m, &root, None, &len, created)
        })
        .collect();
    // loaded adapters follow, in loading order, as children of the first served name
    for a in sim.loras().map(|r| r.all()).unwrap_or_default() {
        data.push(model_card(a.name(), a.path(), Some(base), "null", created));
    }
    json(
        StatusCode::OK,
        JSON,
        format!("{{\"object\":\"list\",\"data\":[{}]}}", data.join(",")),
    )
}

/// One `/v1/models` entry (vLLM's `ModelCard`): `max_model_len` already written as JSON.
fn model_card(
    id: &str,
    root: &str,
    parent: Option<&str>,
    max_model_len: &str,
    created: u64,
) -> String {
    let perm: u64 = rand::random();
    let parent = parent.map(js).unwrap_or_else(|| "null".into());
    format!(
        "{{\"id\":{},\"object\":\"model\",\"created\":{created},\"owned_by\":\"vllm\",\"root\":{},\"parent\":{parent},\"max_model_len\":{max_model_len},\"permission\":[{{\"id\":\"modelperm-{perm:016x}\",\"object\":\"model_permission\",\"created\":{created},\"allow_create_engine\":false,\"allow_sampling\":true,\"allow_logprobs\":true,\"allow_search_indices\":false,\"allow_view\":true,\"allow_fine_tuning\":false,\"organization\":\"*\",\"group\":null,\"is_blocking\":false}}]}}",
        js(id),
        js(root),
    )
}

/// Whether vLLM's runtime LoRA routes exist (`VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`);
/// without them the paths are unknown (404 `Not Found`), as in vLLM.
fn runtime_lora(sim: &Sim) -> bool {
    sim.loras().is_some_and(|r| r.runtime_updating())
}

/// `POST /v1/load_lora_adapter` fields.
#[derive(Deserialize)]
struct LoadLora {
    #[serde(default)]
    lora_name: Option<String>,
    #[serde(default)]
    lora_path: Option<String>,
    #[serde(default)]
    load_inplace: Option<bool>,
}

/// `POST /v1/unload_lora_adapter` fields.
#[derive(Deserialize)]
struct UnloadLora {
    #[serde(default)]
    lora_name: Option<String>,
}

async fn load_lora_adapter(sim: &Sim, req: Request<Incoming>) -> Response<SimBody> {
    let (body, r) = match read_request::<LoadLora>(req).await {
        Ok(x) => x,
        Err(resp) => return resp,
    };
    let (Some(name), Some(path)) = (&r.lora_name, &r.lora_path) else {
        let field = if r.lora_name.is_none() {
            "lora_name"
        } else {
            "lora_path"
        };
        return missing(&body, field);
    };
    let Some(registry) = sim.loras() else {
        return json(StatusCode::NOT_FOUND, JSON, "{\"detail\":\"Not Found\"}");
    };
    lora_answer(registry.load(name, path, r.load_inplace.unwrap_or(false)))
}

async fn unload_lora_adapter(sim: &Sim, req: Request<Incoming>) -> Response<SimBody> {
    let (body, r) = match read_request::<UnloadLora>(req).await {
        Ok(x) => x,
        Err(resp) => return resp,
    };
    let Some(name) = &r.lora_name else {
        return missing(&body, "lora_name");
    };
    let Some(registry) = sim.loras() else {
        return json(StatusCode::NOT_FOUND, JSON, "{\"detail\":\"Not Found\"}");
    };
    lora_answer(registry.unload(name))
}

/// vLLM's answer to a load or unload: the success text as a plain body without a content
/// type (FastAPI's bare `Response`), or its error.
fn lora_answer(r: Result<String, LoraError>) -> Response<SimBody> {
    match r {
        Ok(text) => {
            let mut resp = json(StatusCode::OK, JSON, text);
            resp.headers_mut().remove(header::CONTENT_TYPE);
            resp
        }
        Err(e) => {
            let (code, ty) = e.status_and_type();
            let status = StatusCode::from_u16(code).unwrap_or(StatusCode::BAD_REQUEST);
            error(status, &e.to_string(), ty, None)
        }
    }
}

/// vLLM's error body.
pub(crate) fn error(
    status: StatusCode,
    message: &str,
    ty: &str,
    param: Option<&str>,
) -> Response<SimBody> {
    let param = param.map(js).unwrap_or_else(|| "null".into());
    json(
        status,
        JSON,
        format!(
            "{{\"error\":{{\"message\":{},\"type\":{},\"param\":{param},\"code\":{}}}}}",
            js(message),
            js(ty),
            status.as_u16()
        ),
    )
}

/// Python's `json` error text for a serde_json error.
fn python_json_error(e: &serde_json::Error) -> &'static str {
    let m = e.to_string();
    if m.contains("key must be a string") {
        "Expecting property name enclosed in double quotes"
    } else if m.contains("expected `:`") {
        "Expecting ':' delimiter"
    } else if m.contains("expected `,` or") {
        "Expecting ',' delimiter"
    } else if m.contains("trailing") {
        "Extra data"
    } else if m.contains("control character") || m.contains("EOF while parsing a string") {
        "Unterminated string starting at"
    } else {
        "Expecting value"
    }
}

fn byte_offset(body: &[u8], line: usize, column: usize) -> usize {
    let mut off = 0usize;
    let mut l = 1usize;
    for (i, b) in body.iter().enumerate() {
        if l == line {
            off = i;
            break;
        }
        if *b == b'\n' {
            l += 1;
            off = i + 1;
        }
    }
    (off + column.saturating_sub(1)).min(body.len())
}

pub(super) fn count_keys(body: &[u8]) -> usize {
    serde_json::from_slice::<BTreeMap<String, IgnoredAny>>(body)
        .map(|m| m.len())
        .unwrap_or(0)
}

/// Parse a JSON body as `T`, answering like FastAPI/pydantic behind vLLM on failure.
pub(super) fn parse<T: for<'de> Deserialize<'de>>(body: &[u8]) -> Result<T, Response<SimBody>> {
    if body.iter().all(|b| b.is_ascii_whitespace()) {
        return Err(error(
            StatusCode::BAD_REQUEST,
            "1 validation error:\n  {'type': 'missing', 'loc': 'body', 'msg': 'Field required', 'input': None}",
            "Bad Request",
            Some("body"),
        ));
    }
    serde_json::from_slice::<T>(body).map_err(|e| {
        use serde_json::error::Category;
        match e.classify() {
            Category::Syntax | Category::Eof | Category::Io => {
                let pos = byte_offset(body, e.line(), e.column());
                let pos = if e.classify() == Category::Eof { body.len() } else { pos };
                error(
                    StatusCode::BAD_REQUEST,
                    &format!(
                        "1 validation error:\n  {{'type': 'json_invalid', 'loc': 'body.{pos}', 'msg': 'JSON decode error', 'input': '<dict of 0 items>', 'ctx': {{'error': '{}'}}}}",
                        python_json_error(&e)
                    ),
                    "Bad Request",
                    Some(&format!("body.{pos}")),
                )
            }
            Category::Data => {
                let msg = e.to_string();
                let msg = msg.split(" at line ").next().unwrap_or(&msg).replace('\'', "\"");
                error(
                    StatusCode::BAD_REQUEST,
                    &format!(
                        "1 validation error:\n  {{'type': 'value_error', 'loc': 'body', 'msg': '{msg}', 'input': '<dict of {} items>'}}",
                        count_keys(body)
                    ),
                    "Bad Request",
                    Some("body"),
                )
            }
        }
    })
}

pub(super) fn missing(body: &[u8], field: &str) -> Response<SimBody> {
    error(
        StatusCode::BAD_REQUEST,
        &format!(
            "1 validation error:\n  {{'type': 'missing', 'loc': 'body.{field}', 'msg': 'Field required', 'input': '<dict of {} items>'}}",
            count_keys(body)
        ),
        "Bad Request",
        Some(&format!("body.{field}")),
    )
}

/// vLLM's model check for routes that serve the base model only: an adapter is a valid name
/// (vLLM accepts it everywhere), an unknown one its 404.
pub(super) fn check_model(sim: &Sim, model: Option<&str>) -> Option<Response<SimBody>> {
    resolve_model(sim, model).err()
}

/// vLLM's model check: no name or a served name is the base model, a loaded LoRA adapter's
/// name is that adapter, anything else vLLM's 404 (with runtime updating on, vLLM first asks
/// its resolvers for it, which uses up an adapter id).
pub(super) fn resolve_model(
    sim: &Sim,
    model: Option<&str>,
) -> Result<Option<Arc<Adapter>>, Response<SimBody>> {
    let m = match model {
        None | Some("") => return Ok(None),
        Some(m) if sim.config.models.iter().any(|x| x == m) => return Ok(None),
        Some(m) => m,
    };
    if let Some(registry) = sim.loras() {
        if let Some(a) = registry.find(m) {
            return Ok(Some(a));
        }
        registry.note_unknown_model();
    }
    Err(error(
        StatusCode::NOT_FOUND,
        &format!(
            "The model `{m}` does not exist. Valid aliases: {}.",
            sim.config.models.join(", ")
        ),
        "NotFoundError",
        Some("model"),
    ))
}

/// The engine-side faults of inference routes.
pub(super) fn inference_fault(sim: &Sim) -> Option<Response<SimBody>> {
    match sim.fault.mode() {
        FaultMode::Overloaded => Some(error(
            StatusCode::SERVICE_UNAVAILABLE,
            "The server is overloaded: the waiting queue is full (max_num_queued_reqs). Please try again later.",
            "ServiceUnavailableError",
            None,
        )),
        FaultMode::Loading => Some(error(
            StatusCode::SERVICE_UNAVAILABLE,
            "The model is still loading. Please try again later.",
            "ServiceUnavailableError",
            None,
        )),
        FaultMode::ErrorRate if sim.fault.roll_error() => Some(error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "EngineCore encountered an issue. See stack trace (above) for the root cause.",
            "InternalServerError",
            None,
        )),
        _ => None,
    }
}

/// Validate `max_tokens` against the context; returns the effective cap.
pub(super) fn max_tokens(
    sim: &Sim,
    requested: Option<i64>,
    prompt_tokens: u32,
) -> Result<u32, Response<SimBody>> {
    let len = i64::from(sim.config.max_model_len);
    let p = i64::from(prompt_tokens);
    if p >= len {
        return Err(error(
            StatusCode::BAD_REQUEST,
            &format!(
                "This model's maximum context length is {len} tokens. However, your request has {p} input tokens. Please reduce the length of the input messages."
            ),
            "BadRequestError",
            None,
        ));
    }
    match requested {
        None => Ok((len - p) as u32),
        Some(m) if m < 1 => Err(error(
            StatusCode::BAD_REQUEST,
            &format!("max_tokens must be at least 1, got {m}. (parameter=max_tokens, value={m})"),
            "BadRequestError",
            Some("max_tokens"),
        )),
        Some(m) if m > len => Err(error(
            StatusCode::BAD_REQUEST,
            &format!(
                "max_tokens={m} cannot be greater than max_model_len={len}. Please request fewer output tokens. (parameter=max_tokens, value={m})"
            ),
            "BadRequestError",
            Some("max_tokens"),
        )),
        Some(m) if m + p > len => Err(error(
            StatusCode::BAD_REQUEST,
            &format!(
                "'max_tokens' or 'max_completion_tokens' is too large: {m}. This model's maximum context length is {len} tokens and your request has {p} input tokens ({m} > {len} - {p}). (parameter=max_tokens, value={m})"
            ),
            "BadRequestError",
            Some("max_tokens"),
        )),
        Some(m) => Ok(m as u32),
    }
}

fn stream_flags(
    stream: Option<bool>,
    opts: &Option<super::openai_surface::StreamOptions>,
) -> Result<(bool, bool), Response<SimBody>> {
    let stream = stream.unwrap_or(false);
    // pydantic: `if data.get("stream_options") and not data.get("stream")` ({} is falsy)
    let set = opts
        .as_ref()
        .map(|o| o.include_usage.is_some())
        .unwrap_or(false);
    if set && !stream {
        return Err(error(
            StatusCode::BAD_REQUEST,
            "Stream options can only be defined when `stream=True`.",
            "BadRequestError",
            None,
        ));
    }
    // vLLM: StreamOptions.include_usage defaults to True when stream_options is present
    let usage = opts
        .as_ref()
        .map(|o| o.include_usage.unwrap_or(true))
        .unwrap_or(false);
    Ok((stream, usage))
}

pub(super) fn seed(sim: &Sim, s: Option<i64>) -> u64 {
    s.map(|v| v as u64).unwrap_or(sim.config.seed)
}

async fn chat(sim: &Arc<Sim>, req: Request<Incoming>) -> Response<SimBody> {
    let (body, r) = match read_request::<ChatRequest>(req).await {
        Ok(x) => x,
        Err(resp) => return resp,
    };
    let adapter = match resolve_model(sim, r.model.as_deref()) {
        Ok(a) => a,
        Err(resp) => return resp,
    };
    if r.messages.is_none() {
        return missing(&body, "messages");
    }
    let (stream, usage) = match stream_flags(r.stream, &r.stream_options) {
        Ok(x) => x,
        Err(resp) => return resp,
    };
    let prompt = match chat_form(&r) {
        Ok(form) => r.render(form),
        Err(resp) => return resp,
    };
    let tokens = match sim.prompt_tokens(&prompt, EngineInput::Chat(&body)) {
        Ok(t) => t,
        Err(e) => return refused(&e),
    };
    let cap = match max_tokens(sim, r.max_completion_tokens.or(r.max_tokens), tokens.len) {
        Ok(c) => c,
        Err(resp) => return resp,
    };
    let cap = Cap::new(cap, r.ignore_eos);
    let prompt = Prompted {
        text: &prompt,
        tokens,
        adapter,
    };
    answer(sim, true, seed(sim, r.seed), prompt, cap, stream, usage).await
}

/// A prompt as the simulator rendered it (its text seeds the answer), as the engine
/// tokenized it, and the LoRA adapter it names (none: the base model).
struct Prompted<'a> {
    text: &'a str,
    tokens: PromptTokens,
    adapter: Option<Arc<Adapter>>,
}

/// vLLM's 400 for a prompt its tokenizer or chat template refuses.
fn refused(why: &str) -> Response<SimBody> {
    error(StatusCode::BAD_REQUEST, why, "BadRequestError", None)
}

/// How long an answer may be: `max_tokens` (or what the context leaves), and whether it must
/// be exactly that long (`ignore_eos`: the end of text does not stop generation, so the answer
/// ends by length).
#[derive(Clone, Copy)]
struct Cap {
    max: u32,
    ignore_eos: bool,
}

impl Cap {
    fn new(max: u32, ignore_eos: Option<bool>) -> Cap {
        Cap {
            max,
            ignore_eos: ignore_eos.unwrap_or(false),
        }
    }
}

/// The template form a chat request asks for: `add_generation_prompt` (default true) appends
/// the assistant header, `continue_final_message` leaves the last message open for the model
/// to continue; both at once is vLLM's 400 (its request validator).
fn chat_form(r: &ChatRequest) -> Result<text::Render, Response<SimBody>> {
    let continues = r.continue_final_message.unwrap_or(false);
    match (continues, r.add_generation_prompt.unwrap_or(true)) {
        (true, true) => Err(error(
            StatusCode::BAD_REQUEST,
            "1 validation error:\n  {'type': 'value_error', 'loc': 'body', 'msg': 'Value error, Cannot set both `continue_final_message` and `add_generation_prompt` to True.'}",
            "Bad Request",
            None,
        )),
        (true, false) => Ok(text::Render::ContinueLast),
        (false, true) => Ok(text::Render::Answer),
        (false, false) => Ok(text::Render::Plain),
    }
}

/// A chat (`chat`) or completions request, checked: the injected fault if one is due, else the
/// first model's answer, whole or streamed.
async fn answer(
    sim: &Arc<Sim>,
    chat: bool,
    seed: u64,
    prompt: Prompted<'_>,
    cap: Cap,
    stream: bool,
    usage: bool,
) -> Response<SimBody> {
    if let Some(resp) = inference_fault(sim) {
        return resp;
    }
    // an adapter's answers carry its name and differ from the base model's, as vLLM's do
    let model = match &prompt.adapter {
        Some(a) => a.name(),
        None => &sim.config.models[0],
    };
    let (text, tokens) = (prompt.text, prompt.tokens);
    let plan = if cap.ignore_eos {
        sim.plan_to_length(seed, model, text, tokens, cap.max)
    } else {
        sim.plan_tokens(seed, model, text, tokens, Some(cap.max))
    }
    .under(prompt.adapter.clone());
    let ctx =
        Ctx::new(Surface::Vllm, chat, model).with_prompt_details(sim.config.prompt_tokens_details);
    let opts = RespondOpts {
        chat,
        stream,
        include_usage: usage,
        model_idx: 0,
        queue_limit: None,
        json_ct: JSON,
        sse_ct: SSE,
        guard: None,
    };
    respond(sim, ctx, plan, opts)
        .await
        .unwrap_or_else(|_| inference_fault_busy())
}

/// A request's body and the request it holds: 413 beyond the size limit, vLLM's 400 when it
/// does not parse.
pub(super) async fn read_request<T: for<'de> Deserialize<'de>>(
    req: Request<Incoming>,
) -> Result<(Bytes, T), Response<SimBody>> {
    let Ok(body) = read_body(req).await else {
        return Err(too_large());
    };
    let r = parse(&body)?;
    Ok((body, r))
}

/// The answer to a body over the size limit.
pub(super) fn too_large() -> Response<SimBody> {
    error(
        StatusCode::PAYLOAD_TOO_LARGE,
        "Request body too large",
        "Bad Request",
        None,
    )
}

pub(super) fn inference_fault_busy() -> Response<SimBody> {
    error(
        StatusCode::SERVICE_UNAVAILABLE,
        "The server is overloaded. Please try again later.",
        "ServiceUnavailableError",
        None,
    )
}

async fn completions(sim: &Arc<Sim>, req: Request<Incoming>) -> Response<SimBody> {
    let (body, r) = match read_request::<CompletionRequest>(req).await {
        Ok(x) => x,
        Err(resp) => return resp,
    };
    let adapter = match resolve_model(sim, r.model.as_deref()) {
        Ok(a) => a,
        Err(resp) => return resp,
    };
    let Some(p) = &r.prompt else {
        return missing(&body, "prompt");
    };
    let (stream, usage) = match stream_flags(r.stream, &r.stream_options) {
        Ok(x) => x,
        Err(resp) => return resp,
    };
    let prompt = p.text();
    let input = match completion_input(p, r.add_special_tokens.unwrap_or(true)) {
        Ok(i) => i,
        Err(e) => return refused(&e),
    };
    let tokens = match sim.prompt_tokens(&prompt, input) {
        Ok(t) => t,
        Err(e) => return refused(&e),
    };
    // vLLM's completions default is 16 tokens
    let cap = match max_tokens(
        sim,
        r.max_tokens.or(r.max_completion_tokens).or(Some(16)),
        tokens.len,
    ) {
        Ok(c) => c,
        Err(resp) => return resp,
    };
    let cap = Cap::new(cap, r.ignore_eos);
    let prompt = Prompted {
        text: &prompt,
        tokens,
        adapter,
    };
    answer(sim, false, seed(sim, r.seed), prompt, cap, stream, usage).await
}

/// What vLLM tokenizes for a completions prompt (the first of a list: the simulator answers
/// the first prompt only): a text with or without special tokens, or the given token ids.
fn completion_input(p: &Prompt, special: bool) -> Result<EngineInput<'_>, String> {
    let ids = |t: &[i64]| -> Result<Vec<u32>, String> {
        t.iter()
            .map(|i| u32::try_from(*i).map_err(|_| format!("Token id {i} is out of vocabulary")))
            .collect()
    };
    Ok(match p {
        Prompt::Text(s) => EngineInput::Completion(s, special),
        Prompt::Texts(v) => EngineInput::Completion(v.first().map_or("", String::as_str), special),
        Prompt::Tokens(t) => EngineInput::Ids(ids(t)?),
        Prompt::TokenLists(v) => EngineInput::Ids(ids(v.first().map_or(&[], Vec::as_slice))?),
    })
}

async fn embeddings(sim: &Arc<Sim>, req: Request<Incoming>) -> Response<SimBody> {
    let (body, r) = match read_request::<EmbeddingRequest>(req).await {
        Ok(x) => x,
        Err(resp) => return resp,
    };
    if let Some(resp) = check_model(sim, r.model.as_deref()) {
        return resp;
    }
    let Some(input) = &r.input else {
        return missing(&body, "input");
    };
    if let Some(resp) = inference_fault(sim) {
        return resp;
    }
    let texts = input.texts();
    let (vectors, tokens) = sim.embed(&texts, r.dimensions);
    json(
        StatusCode::OK,
        JSON,
        embeddings_body(
            Surface::Vllm,
            &js(&sim.config.models[0]),
            &vectors,
            tokens as u32,
        ),
    )
}

/// `POST /v1/chat/completions/batch` fields the simulator reads.
#[derive(Deserialize)]
struct BatchRequest {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    messages: Option<Vec<Vec<super::openai_surface::Message>>>,
    #[serde(default)]
    max_tokens: Option<i64>,
    #[serde(default)]
    max_completion_tokens: Option<i64>,
    #[serde(default)]
    seed: Option<i64>,
}

/// Several conversations in one call: each one is its own sequence in the engine (they run in
/// the same batch), answered as one choice each, with the usage summed.
async fn chat_batch(sim: &Arc<Sim>, req: Request<Incoming>) -> Response<SimBody> {
    let (body, r) = match read_request::<BatchRequest>(req).await {
        Ok(x) => x,
        Err(resp) => return resp,
    };
    let Some(convs) = &r.messages else {
        return missing(&body, "messages");
    };
    if let Some(resp) = check_model(sim, r.model.as_deref()) {
        return resp;
    }
    let prompts: Vec<String> = convs
        .iter()
        .map(|c| {
            text::render_chat(
                c.iter()
                    .map(|m| (m.role.as_deref().unwrap_or("user"), m.text())),
            )
        })
        .collect();
    let longest = prompts
        .iter()
        .map(|p| text::count_tokens(p) as u32)
        .max()
        .unwrap_or(0);
    let cap = match max_tokens(sim, r.max_completion_tokens.or(r.max_tokens), longest) {
        Ok(c) => c,
        Err(resp) => return resp,
    };
    if let Some(resp) = inference_fault(sim) {
        return resp;
    }
    let model = &sim.config.models[0];
    let mut gens = Vec::with_capacity(prompts.len());
    for prompt in &prompts {
        let plan = sim.plan(seed(sim, r.seed), model, prompt, Some(cap));
        match super::gen::Gen::start(sim, 0, plan, None) {
            Ok(g) => gens.push(g),
            Err(_) => return inference_fault_busy(),
        }
    }
    let (mut prompt_tokens, mut completion) = (0, 0);
    let mut cache = super::gen::CacheUse::default();
    let mut choices = Vec::with_capacity(gens.len());
    for g in &mut gens {
        g.run_to_end().await;
        let p = &g.plan;
        prompt_tokens += p.prompt_tokens();
        completion += p.completion_tokens();
        cache = cache + g.cache_use();
        choices.push((p.text(0, p.words.len()), p.finish));
    }
    let ctx =
        Ctx::new(Surface::Vllm, true, model).with_prompt_details(sim.config.prompt_tokens_details);
    json(
        StatusCode::OK,
        JSON,
        ctx.vllm_chat_body(&choices, prompt_tokens, completion, cache),
    )
}

#[derive(Deserialize)]
struct TokenizeRequest {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    prompt: Option<String>,
    #[serde(default)]
    messages: Option<Vec<super::openai_surface::Message>>,
    #[serde(default)]
    return_token_strs: Option<bool>,
    /// The prompt form's default is true (its BOS); the chat form reads it from the body.
    #[serde(default)]
    add_special_tokens: Option<bool>,
}

async fn tokenize(sim: &Arc<Sim>, req: Request<Incoming>) -> Response<SimBody> {
    let (body, r) = match read_request::<TokenizeRequest>(req).await {
        Ok(x) => x,
        Err(resp) => return resp,
    };
    if let Some(resp) = check_model(sim, r.model.as_deref()) {
        return resp;
    }
    if sim.config.tokenizer.is_some() {
        return tokenize_exactly(sim, &body, &r);
    }
    let text = match (&r.prompt, &r.messages) {
        (Some(p), _) => p.clone(),
        (None, Some(m)) => text::render_chat(
            m.iter()
                .map(|m| (m.role.as_deref().unwrap_or("user"), m.text())),
        ),
        (None, None) => return missing(&body, "prompt"),
    };
    let pieces = text::token_strs(&text);
    {
        let mut vocab = sim.vocab.lock().unwrap_or_else(|e| e.into_inner());
        for (id, piece, _, _) in &pieces {
            vocab.insert(*id, piece.clone());
        }
    }
    let ids: Vec<String> = pieces.iter().map(|p| p.0.to_string()).collect();
    let strs = if r.return_token_strs.unwrap_or(false) {
        let v: Vec<&str> = pieces.iter().map(|p| p.1.as_str()).collect();
        serde_json::to_string(&v).unwrap_or_else(|_| "[]".into())
    } else {
        "null".into()
    };
    json(
        StatusCode::OK,
        JSON,
        format!(
            "{{\"count\":{},\"max_model_len\":{},\"tokens\":[{}],\"token_strs\":{strs}}}",
            pieces.len(),
            sim.config.max_model_len,
            ids.join(",")
        ),
    )
}

/// `/tokenize` with the model's real tokenizer: the ids vLLM computes, and its `token_strs`
/// (the vocabulary's spelling of each id).
fn tokenize_exactly(sim: &Sim, body: &[u8], r: &TokenizeRequest) -> Response<SimBody> {
    let input = match (&r.prompt, &r.messages) {
        (Some(p), _) => EngineInput::Completion(p, r.add_special_tokens.unwrap_or(true)),
        (None, Some(_)) => EngineInput::Chat(body),
        (None, None) => return missing(body, "prompt"),
    };
    let tokens = match sim.prompt_tokens("", input) {
        Ok(t) => t,
        Err(e) => return refused(&e),
    };
    let strs = match (r.return_token_strs, &sim.config.tokenizer) {
        (Some(true), Some(t)) => {
            serde_json::to_string(&t.token_strs(&tokens.ids)).unwrap_or_else(|_| "[]".into())
        }
        _ => "null".into(),
    };
    let ids: Vec<String> = tokens.ids.iter().map(u32::to_string).collect();
    json(
        StatusCode::OK,
        JSON,
        format!(
            "{{\"count\":{},\"max_model_len\":{},\"tokens\":[{}],\"token_strs\":{strs}}}",
            tokens.len,
            sim.config.max_model_len,
            ids.join(",")
        ),
    )
}

#[derive(Deserialize)]
struct DetokenizeRequest {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    tokens: Option<Vec<i64>>,
}

async fn detokenize(sim: &Arc<Sim>, req: Request<Incoming>) -> Response<SimBody> {
    let (body, r) = match read_request::<DetokenizeRequest>(req).await {
        Ok(x) => x,
        Err(resp) => return resp,
    };
    if let Some(resp) = check_model(sim, r.model.as_deref()) {
        return resp;
    }
    let Some(tokens) = &r.tokens else {
        return missing(&body, "tokens");
    };
    json(
        StatusCode::OK,
        JSON,
        format!("{{\"prompt\":{}}}", js(&detokenize_learned(sim, tokens))),
    )
}

/// Text of `ids`: pieces `/tokenize` has seen come back as they were, the rest as the
/// tokenizer's own detokenizer renders them.
fn detokenize_learned(sim: &Sim, ids: &[i64]) -> String {
    let vocab = sim.vocab.lock().unwrap_or_else(|e| e.into_inner());
    ids.iter()
        .map(|id| {
            u32::try_from(*id)
                .ok()
                .and_then(|i| vocab.get(&i).cloned())
                .unwrap_or_else(|| text::detokenize(&[*id]))
        })
        .collect()
}
