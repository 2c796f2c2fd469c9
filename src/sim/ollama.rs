//! The Ollama personality: `GET /`, `/api/version`, `/api/tags`, `/api/ps`, native `/api/chat`
//! and `/api/generate` (NDJSON, `stream` defaults to true, durations in ns, `omitempty`
//! metrics), `/api/embed`, `/api/show`, the OpenAI-compatible `/v1/*` routes, and the
//! Responses and Messages APIs (`ollama_compat`); no `/metrics`.
//!
//! Invariants:
//! - Names are `model:tag` (`:latest` by default); each model has its own scheduler with
//!   `OLLAMA_NUM_PARALLEL` running slots and a waiting queue bounded by `OLLAMA_MAX_QUEUE`
//!   (503 `server busy, please try again.  maximum pending requests exceeded` beyond it).
//! - Residency: a model is loaded until `keep_alive` after its last request; the first request
//!   for an unloaded model pays the load time (one request loads, concurrent ones wait for it)
//!   and reports it as `load_duration`; `/api/ps` lists exactly the loaded models.
//! - `max_completion_tokens` is ignored on `/v1/*`, as Ollama does.
//! - A prompt as long as the context window (`num_ctx`, `/api/ps` `context_length`) or longer
//!   is not refused: it is truncated as Ollama's runner does with context shift on (its
//!   default), keeping `num_keep` tokens (default 4; -1: all that fit) and the end, so only
//!   `num_ctx - (num_ctx - num_keep) / 2` tokens are prefilled and reported as
//!   `prompt_eval_count`. (Real Ollama first drops whole old chat messages to fit; the
//!   simulator cuts the rendered prompt only.)

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::Value;
use sha2::{Digest, Sha256};

use super::config::ollama_name;
use super::fault::FaultMode;
use super::gen::Gen;
use super::openai_surface::{
    embeddings_body, js, respond, ChatRequest, CompletionRequest, Ctx, EmbeddingRequest, Input,
    Message, RespondOpts, StreamOptions, Surface,
};
use super::server::{json, read_body, stream_response, Sim, SimBody};
use super::text::{self, Finish, Plan};

const JSON: &str = "application/json; charset=utf-8";
const NDJSON: &str = "application/x-ndjson";
const SSE: &str = "text/event-stream";
const TEXT: &str = "text/plain; charset=utf-8";
/// The version `/api/version` reports.
pub(crate) const VERSION: &str = "0.13.5";
pub(super) const BUSY: &str = "server busy, please try again.  maximum pending requests exceeded";

/// Answer one request in Ollama's manner.
pub(crate) async fn route(sim: &Arc<Sim>, req: Request<Incoming>) -> Response<SimBody> {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let get = method == Method::GET || method == Method::HEAD;
    match (path.as_str(), method == Method::POST) {
        ("/", _) if get => match sim.fault.mode() {
            FaultMode::HealthFail => {
                json(StatusCode::SERVICE_UNAVAILABLE, TEXT, "Ollama is not ready")
            }
            _ => json(StatusCode::OK, TEXT, "Ollama is running"),
        },
        ("/api/version", _) if get => json(
            StatusCode::OK,
            JSON,
            format!("{{\"version\":\"{VERSION}\"}}"),
        ),
        ("/api/tags", _) if get => tags(sim),
        ("/api/ps", _) if get => ps(sim),
        ("/api/chat", true) => native(sim, req, true).await,
        ("/api/generate", true) => native(sim, req, false).await,
        ("/api/embed", true) => embed(sim, req).await,
        ("/api/show", true) => show(sim, req).await,
        ("/v1/chat/completions", true) => openai(sim, req, true).await,
        ("/v1/completions", true) => openai(sim, req, false).await,
        ("/v1/embeddings", true) => openai_embeddings(sim, req).await,
        ("/v1/responses", true) => super::ollama_compat::responses(sim, req).await,
        ("/v1/messages", true) => super::ollama_compat::messages(sim, req).await,
        ("/v1/models", _) if get => v1_models(sim),
        (p, _) if get && p.starts_with("/v1/models/") => v1_model(sim, &p["/v1/models/".len()..]),
        _ => json(StatusCode::NOT_FOUND, TEXT, "404 page not found"),
    }
}

fn err(status: StatusCode, msg: &str) -> Response<SimBody> {
    json(status, JSON, format!("{{\"error\":{}}}", js(msg)))
}

/// The request in `body`, or a 400 with the message Ollama's Go decoder gives, in the shape
/// `fail` gives errors (the native API's or the OpenAI-compatible one's).
pub(super) fn parse<T: DeserializeOwned>(
    body: &[u8],
    fail: ErrorShape,
) -> Result<T, Response<SimBody>> {
    serde_json::from_slice(body)
        .map_err(|e| fail(StatusCode::BAD_REQUEST, &go_json_error(body, &e)))
}

/// The request's body read and parsed: 400 when it is too large or not the request.
async fn read_json<T: DeserializeOwned>(
    req: Request<Incoming>,
    fail: ErrorShape,
) -> Result<T, Response<SimBody>> {
    let Ok(body) = read_body(req).await else {
        return Err(fail(
            StatusCode::BAD_REQUEST,
            "http: request body too large",
        ));
    };
    parse(&body, fail)
}

/// The requested model's name and index: 400 when none is named, 404 when it is unknown.
pub(super) fn named_model(
    sim: &Sim,
    name: Option<String>,
    fail: ErrorShape,
) -> Result<(String, usize), Response<SimBody>> {
    let Some(name) = name.filter(|m| !m.is_empty()) else {
        return Err(fail(StatusCode::BAD_REQUEST, "model is required"));
    };
    match model_index(sim, &name) {
        Some(idx) => Ok((name, idx)),
        None => Err(fail(
            StatusCode::NOT_FOUND,
            &format!("model '{name}' not found"),
        )),
    }
}

/// How an error is shaped: [`err`] for the native API, [`v1_err`] for the OpenAI-compatible one.
pub(super) type ErrorShape = fn(StatusCode, &str) -> Response<SimBody>;

pub(super) fn v1_err(status: StatusCode, msg: &str) -> Response<SimBody> {
    let ty = match status.as_u16() {
        400 => "invalid_request_error",
        404 => "not_found_error",
        _ => "api_error",
    };
    json(
        status,
        JSON,
        format!(
            "{{\"error\":{{\"message\":{},\"type\":\"{ty}\",\"param\":null,\"code\":null}}}}",
            js(msg)
        ),
    )
}

/// RFC 3339 with nanoseconds in UTC, as Go's `time.Time` marshals.
pub(crate) fn rfc3339(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs() as i64;
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    // civil-from-days (Howard Hinnant)
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let mut y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    if month <= 2 {
        y += 1;
    }
    let nanos = d.subsec_nanos();
    let frac = if nanos == 0 {
        String::new()
    } else {
        let s = format!(".{nanos:09}");
        s.trim_end_matches('0').to_string()
    };
    format!(
        "{y:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}{frac}Z",
        rem / 3600,
        (rem / 60) % 60,
        rem % 60
    )
}

fn digest(name: &str) -> String {
    hex::encode(Sha256::digest(name.as_bytes()))
}

fn details() -> &'static str {
    "{\"parent_model\":\"\",\"format\":\"gguf\",\"family\":\"llama\",\"families\":[\"llama\"],\"parameter_size\":\"3.2B\",\"quantization_level\":\"Q4_K_M\"}"
}

const SIZE: u64 = 2_019_393_189;
/// Ollama's default `num_keep`.
const NUM_KEEP: u32 = 4;

fn tags(sim: &Sim) -> Response<SimBody> {
    let modified =
        rfc3339(UNIX_EPOCH + Duration::from_secs(sim.started_unix.saturating_sub(86_400)));
    let models: Vec<String> = sim
        .config
        .models
        .iter()
        .map(|m| {
            format!(
                "{{\"name\":{n},\"model\":{n},\"modified_at\":\"{modified}\",\"size\":{SIZE},\"digest\":\"{}\",\"details\":{}}}",
                digest(m),
                details(),
                n = js(m)
            )
        })
        .collect();
    json(
        StatusCode::OK,
        JSON,
        format!("{{\"models\":[{}]}}", models.join(",")),
    )
}

fn ps(sim: &Sim) -> Response<SimBody> {
    let now = super::unix_now();
    let models: Vec<String> = sim
        .models
        .iter()
        .filter_map(|m| {
            let until = m.loaded_until_unix.load(Relaxed);
            (until > now).then(|| {
                let exp = if until == u64::MAX {
                    "2318-08-23T13:17:11.231893458Z".to_string()
                } else {
                    rfc3339(UNIX_EPOCH + Duration::from_secs(until))
                };
                format!(
                    "{{\"name\":{n},\"model\":{n},\"size\":{SIZE},\"digest\":\"{}\",\"details\":{},\"expires_at\":\"{exp}\",\"size_vram\":{SIZE},\"context_length\":{}}}",
                    digest(&m.name),
                    details(),
                    sim.config.max_model_len,
                    n = js(&m.name)
                )
            })
        })
        .collect();
    json(
        StatusCode::OK,
        JSON,
        format!("{{\"models\":[{}]}}", models.join(",")),
    )
}

fn model_index(sim: &Sim, name: &str) -> Option<usize> {
    let n = ollama_name(name);
    sim.models.iter().position(|m| m.name == n)
}

/// Unload every model (the `loading` fault).
pub(crate) async fn unload_all(sim: &Sim) {
    for m in &sim.models {
        *m.loaded_until.lock().await = None;
        m.loaded_until_unix.store(0, Relaxed);
    }
}

/// `keep_alive`: a number of seconds, a Go duration string, negative = forever.
fn keep_alive(sim: &Sim, v: Option<&Value>) -> Option<Duration> {
    let secs = match v {
        None | Some(Value::Null) => return Some(sim.config.keep_alive),
        Some(Value::Number(n)) => n.as_f64().unwrap_or(300.0),
        Some(Value::String(s)) => {
            let s = s.trim();
            let (num, mult) = if let Some(x) = s.strip_suffix("ms") {
                (x, 0.001)
            } else if let Some(x) = s.strip_suffix('s') {
                (x, 1.0)
            } else if let Some(x) = s.strip_suffix('m') {
                (x, 60.0)
            } else if let Some(x) = s.strip_suffix('h') {
                (x, 3600.0)
            } else {
                (s, 1.0)
            };
            num.parse::<f64>().map(|v| v * mult).unwrap_or(300.0)
        }
        Some(_) => 300.0,
    };
    if secs < 0.0 {
        None // forever
    } else {
        Some(Duration::from_secs_f64(secs.min(1.0e9)))
    }
}

/// Make sure the model is loaded; returns the time spent loading.
pub(super) async fn ensure_loaded(sim: &Sim, idx: usize) -> Duration {
    let m = &sim.models[idx];
    let start = Instant::now();
    let mut guard = m.loaded_until.lock().await;
    let loaded = matches!(*guard, Some(t) if t > Instant::now());
    if !loaded {
        let wait = if sim.fault.mode() == FaultMode::Loading {
            sim.fault.since_and_remaining().1
        } else {
            sim.scaled(sim.config.load_time)
        };
        if let Some(d) = wait {
            tokio::time::sleep(d).await;
        }
        *guard = Instant::now().checked_add(sim.config.keep_alive);
        m.loaded_until_unix
            .store(super::unix_now() + sim.config.keep_alive.as_secs(), Relaxed);
    }
    drop(guard);
    let took = start.elapsed();
    if took.is_zero() {
        Duration::from_nanos(1)
    } else {
        took
    }
}

/// After a request: the model stays loaded for `keep_alive` (None = forever).
pub(super) async fn touch(sim: &Sim, idx: usize, ka: Option<Duration>) {
    let m = &sim.models[idx];
    let mut g = m.loaded_until.lock().await;
    match ka {
        None => {
            *g = Instant::now().checked_add(Duration::from_secs(1 << 32));
            m.loaded_until_unix.store(u64::MAX, Relaxed);
        }
        Some(d) => {
            *g = Instant::now().checked_add(d);
            m.loaded_until_unix.store(
                if d.is_zero() {
                    0
                } else {
                    super::unix_now() + d.as_secs().max(1)
                },
                Relaxed,
            );
        }
    }
}

pub(super) fn inference_fault(sim: &Sim) -> Option<(StatusCode, &'static str)> {
    match sim.fault.mode() {
        FaultMode::Overloaded => Some((StatusCode::SERVICE_UNAVAILABLE, BUSY)),
        FaultMode::ErrorRate if sim.fault.roll_error() => Some((
            StatusCode::INTERNAL_SERVER_ERROR,
            "llama runner process has terminated: exit status 2",
        )),
        _ => None,
    }
}

fn go_json_error(body: &[u8], e: &serde_json::Error) -> String {
    use serde_json::error::Category;
    match e.classify() {
        Category::Eof => "unexpected EOF".to_string(),
        Category::Syntax => {
            let col = e.column().saturating_sub(1);
            let c = body.get(col).map(|b| *b as char).unwrap_or(' ');
            format!("invalid character '{c}' looking for beginning of object key string")
        }
        _ => {
            let m = e.to_string();
            let m = m.split(" at line ").next().unwrap_or(&m).to_string();
            format!("json: cannot unmarshal {m}")
        }
    }
}

#[derive(Deserialize, Default)]
struct Options {
    #[serde(default)]
    num_predict: Option<i64>,
    /// Prompt tokens kept from the start when a prompt is truncated to the context (-1: all
    /// that fit).
    #[serde(default)]
    num_keep: Option<i64>,
    #[serde(default)]
    seed: Option<i64>,
}

#[derive(Deserialize)]
struct NativeRequest {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    messages: Option<Vec<Message>>,
    #[serde(default)]
    prompt: Option<String>,
    #[serde(default)]
    system: Option<String>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    options: Option<Options>,
    #[serde(default)]
    keep_alive: Option<Value>,
}

fn metrics_json(load_ns: u64, gen: &Gen) -> String {
    let (total, prefill, decode) = gen.durations_ns();
    let p = &gen.plan;
    // omitempty: zero values are absent
    let mut s = String::new();
    for (k, v) in [
        ("total_duration", total + load_ns),
        ("load_duration", load_ns),
        ("prompt_eval_count", u64::from(p.prompt_tokens())),
        ("prompt_eval_duration", prefill),
        ("eval_count", u64::from(p.completion_tokens())),
        ("eval_duration", decode),
    ] {
        if v > 0 {
            s.push_str(&format!(",\"{k}\":{v}"));
        }
    }
    s
}

/// `/api/generate`'s `context`: the prompt's token ids, then the answer's.
fn context(p: &Plan) -> String {
    let ids: Vec<String> = p
        .prompt_ids
        .iter()
        .map(|i| i.to_string())
        .chain((0..p.words.len()).map(|i| p.token_id(i).to_string()))
        .collect();
    ids.join(",")
}

async fn native(sim: &Arc<Sim>, req: Request<Incoming>, chat: bool) -> Response<SimBody> {
    let Ok(body) = read_body(req).await else {
        return err(StatusCode::BAD_REQUEST, "http: request body too large");
    };
    if body.iter().all(|b| b.is_ascii_whitespace()) {
        return err(StatusCode::BAD_REQUEST, "missing request body");
    }
    let r: NativeRequest = match parse(&body, err) {
        Ok(r) => r,
        Err(resp) => return resp,
    };
    let (name, idx) = match named_model(sim, r.model.clone(), err) {
        Ok(x) => x,
        Err(resp) => return resp,
    };
    let ka = keep_alive(sim, r.keep_alive.as_ref());
    let name_json = js(&name);
    let empty = if chat {
        r.messages.as_ref().map(|m| m.is_empty()).unwrap_or(true)
    } else {
        r.prompt.as_deref().map(str::is_empty).unwrap_or(true)
    };
    if empty {
        // load (or unload with keep_alive 0) without generating
        let reason = if ka == Some(Duration::ZERO) {
            touch(sim, idx, ka).await;
            "unload"
        } else {
            ensure_loaded(sim, idx).await;
            touch(sim, idx, ka).await;
            "load"
        };
        let now = rfc3339(SystemTime::now());
        let body = if chat {
            format!("{{\"model\":{name_json},\"created_at\":\"{now}\",\"message\":{{\"role\":\"assistant\",\"content\":\"\"}},\"done_reason\":\"{reason}\",\"done\":true}}")
        } else {
            format!("{{\"model\":{name_json},\"created_at\":\"{now}\",\"response\":\"\",\"done\":true,\"done_reason\":\"{reason}\"}}")
        };
        return json(StatusCode::OK, JSON, body);
    }
    if let Some((status, msg)) = inference_fault(sim) {
        return err(status, msg);
    }
    let prompt = if chat {
        let msgs = r.messages.as_deref().unwrap_or(&[]);
        // a trailing assistant message is left open: the model continues it
        let open = msgs.last().and_then(|m| m.role.as_deref()) == Some("assistant");
        let form = if open {
            text::Render::ContinueLast
        } else {
            text::Render::Answer
        };
        text::render_chat_with(
            msgs.iter()
                .map(|m| (m.role.as_deref().unwrap_or("user"), m.text())),
            form,
        )
    } else {
        let mut p = String::new();
        if let Some(s) = &r.system {
            p.push_str(s);
            p.push('\n');
        }
        p.push_str(r.prompt.as_deref().unwrap_or(""));
        p
    };
    let opts = r.options.unwrap_or_default();
    let max = match opts.num_predict {
        Some(n) if n > 0 => Some(n as u32),
        _ => None,
    };
    let seed = opts.seed.map(|s| s as u64).unwrap_or(sim.config.seed);
    let mut plan = sim.plan(seed, &sim.models[idx].name, &prompt, max);
    let keep = opts
        .num_keep
        .map_or(NUM_KEEP, |k| u32::try_from(k).unwrap_or(u32::MAX));
    plan.fit_context(sim.config.max_model_len, keep);
    let load = ensure_loaded(sim, idx).await;
    let load_ns = load.as_nanos() as u64;
    let Ok(mut gen) = Gen::start(sim, idx, plan, Some(sim.config.max_queue)) else {
        return err(StatusCode::SERVICE_UNAVAILABLE, BUSY);
    };
    let stream = r.stream.unwrap_or(true);
    let done_reason = |f: Finish| match f {
        Finish::Stop => "stop",
        Finish::Length => "length",
    };
    if !stream {
        gen.run_to_end().await;
        touch(sim, idx, ka).await;
        let p = &gen.plan;
        let text = p.text(0, p.words.len());
        let now = rfc3339(SystemTime::now());
        let m = metrics_json(load_ns, &gen);
        let body = if chat {
            format!("{{\"model\":{name_json},\"created_at\":\"{now}\",\"message\":{{\"role\":\"assistant\",\"content\":\"{text}\"}},\"done_reason\":\"{}\",\"done\":true{m}}}", done_reason(p.finish))
        } else {
            format!("{{\"model\":{name_json},\"created_at\":\"{now}\",\"response\":\"{text}\",\"done\":true,\"done_reason\":\"{}\",\"context\":[{}]{m}}}", done_reason(p.finish), context(p))
        };
        return json(StatusCode::OK, JSON, body);
    }
    let sim2 = sim.clone();
    stream_response(sim, StatusCode::OK, NDJSON, move |mut sink| async move {
        while let Some(range) = gen.next().await {
            for i in range {
                let now = rfc3339(SystemTime::now());
                let w = gen.plan.text(i, i + 1);
                let line = if chat {
                    format!("{{\"model\":{name_json},\"created_at\":\"{now}\",\"message\":{{\"role\":\"assistant\",\"content\":\"{w}\"}},\"done\":false}}\n")
                } else {
                    format!("{{\"model\":{name_json},\"created_at\":\"{now}\",\"response\":\"{w}\",\"done\":false}}\n")
                };
                if !sink.send(line).await {
                    return;
                }
            }
        }
        touch(&sim2, idx, ka).await;
        let now = rfc3339(SystemTime::now());
        let p = &gen.plan;
        let m = metrics_json(load_ns, &gen);
        let line = if chat {
            format!("{{\"model\":{name_json},\"created_at\":\"{now}\",\"message\":{{\"role\":\"assistant\",\"content\":\"\"}},\"done_reason\":\"{}\",\"done\":true{m}}}\n", done_reason(p.finish))
        } else {
            format!("{{\"model\":{name_json},\"created_at\":\"{now}\",\"response\":\"\",\"done\":true,\"done_reason\":\"{}\",\"context\":[{}]{m}}}\n", done_reason(p.finish), context(p))
        };
        let _ = sink.send(line).await;
    })
}

#[derive(Deserialize)]
struct EmbedRequest {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    input: Option<Input>,
    #[serde(default)]
    dimensions: Option<usize>,
    #[serde(default)]
    keep_alive: Option<Value>,
}

async fn embed(sim: &Arc<Sim>, req: Request<Incoming>) -> Response<SimBody> {
    let r: EmbedRequest = match read_json(req, err).await {
        Ok(r) => r,
        Err(resp) => return resp,
    };
    let (name, idx) = match named_model(sim, r.model.clone(), err) {
        Ok(x) => x,
        Err(resp) => return resp,
    };
    if let Some((status, msg)) = inference_fault(sim) {
        return err(status, msg);
    }
    let start = Instant::now();
    let load = ensure_loaded(sim, idx).await;
    let texts = r.input.as_ref().map(|i| i.texts()).unwrap_or_default();
    let (vectors, tokens) = sim.embed(&texts, r.dimensions);
    let vecs: Vec<String> = vectors
        .iter()
        .map(|v| serde_json::to_string(v).unwrap_or_default())
        .collect();
    touch(sim, idx, keep_alive(sim, r.keep_alive.as_ref())).await;
    let total = start.elapsed().as_nanos().max(1) as u64;
    json(
        StatusCode::OK,
        JSON,
        format!(
            "{{\"model\":{},\"embeddings\":[{}],\"total_duration\":{total},\"load_duration\":{},\"prompt_eval_count\":{tokens}}}",
            js(&name),
            vecs.join(","),
            load.as_nanos().max(1)
        ),
    )
}

#[derive(Deserialize)]
struct ShowRequest {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    name: Option<String>,
}

async fn show(sim: &Arc<Sim>, req: Request<Incoming>) -> Response<SimBody> {
    let r: ShowRequest = match read_json(req, err).await {
        Ok(r) => r,
        Err(resp) => return resp,
    };
    let (_, idx) = match named_model(sim, r.model.or(r.name), err) {
        Ok(x) => x,
        Err(resp) => return resp,
    };
    let n = &sim.models[idx].name;
    let modified =
        rfc3339(UNIX_EPOCH + Duration::from_secs(sim.started_unix.saturating_sub(86_400)));
    let modelfile = format!(
        "# Modelfile generated by \"ollama show\"\nFROM {n}\nTEMPLATE \"{{{{ .Prompt }}}}\"\n"
    );
    json(
        StatusCode::OK,
        JSON,
        format!(
            "{{\"license\":\"\",\"modelfile\":{},\"parameters\":\"\",\"template\":\"{{{{ .Prompt }}}}\",\"details\":{},\"model_info\":{{\"general.architecture\":\"llama\",\"general.parameter_count\":3212749888,\"llama.context_length\":{},\"llama.embedding_length\":{}}},\"capabilities\":[\"completion\",\"embedding\"],\"modified_at\":\"{modified}\"}}",
            js(&modelfile),
            details(),
            sim.config.max_model_len,
            sim.config.embedding_dim
        ),
    )
}

fn v1_models(sim: &Sim) -> Response<SimBody> {
    let created = sim.started_unix.saturating_sub(86_400);
    let data: Vec<String> = sim
        .config
        .models
        .iter()
        .map(|m| {
            format!(
                "{{\"id\":{},\"object\":\"model\",\"created\":{created},\"owned_by\":\"library\"}}",
                js(m)
            )
        })
        .collect();
    json(
        StatusCode::OK,
        JSON,
        format!("{{\"object\":\"list\",\"data\":[{}]}}", data.join(",")),
    )
}

fn v1_model(sim: &Sim, name: &str) -> Response<SimBody> {
    match model_index(sim, name) {
        Some(i) => json(
            StatusCode::OK,
            JSON,
            format!(
                "{{\"id\":{},\"object\":\"model\",\"created\":{},\"owned_by\":\"library\"}}",
                js(&sim.models[i].name),
                sim.started_unix.saturating_sub(86_400)
            ),
        ),
        None => v1_err(StatusCode::NOT_FOUND, &format!("model '{name}' not found")),
    }
}

async fn openai(sim: &Arc<Sim>, req: Request<Incoming>, chat: bool) -> Response<SimBody> {
    let Ok(body) = read_body(req).await else {
        return v1_err(StatusCode::BAD_REQUEST, "http: request body too large");
    };
    let (model, prompt, max_tokens, (stream, usage), seed) = if chat {
        let r: ChatRequest = match parse(&body, v1_err) {
            Ok(r) => r,
            Err(resp) => return resp,
        };
        if r.messages.as_ref().map(|m| m.is_empty()).unwrap_or(true) {
            return v1_err(StatusCode::BAD_REQUEST, "[] is too short - 'messages'");
        }
        // max_completion_tokens is not a field of Ollama's request: ignored
        // Ollama's template leaves a trailing assistant message open: the model continues it
        let form = if r.ends_with_assistant() {
            text::Render::ContinueLast
        } else {
            text::Render::Answer
        };
        (
            r.model.clone(),
            r.render(form),
            r.max_tokens,
            StreamOptions::flags(r.stream, &r.stream_options),
            r.seed,
        )
    } else {
        let r: CompletionRequest = match parse(&body, v1_err) {
            Ok(r) => r,
            Err(resp) => return resp,
        };
        (
            r.model.clone(),
            r.prompt.as_ref().map(|p| p.text()).unwrap_or_default(),
            r.max_tokens,
            StreamOptions::flags(r.stream, &r.stream_options),
            r.seed,
        )
    };
    let (name, idx) = match named_model(sim, model, v1_err) {
        Ok(x) => x,
        Err(resp) => return resp,
    };
    if let Some((status, msg)) = inference_fault(sim) {
        return v1_err(status, msg);
    }
    let max = max_tokens.filter(|m| *m > 0).map(|m| m as u32);
    let seed = seed.map(|s| s as u64).unwrap_or(sim.config.seed);
    let mut plan = sim.plan(seed, &sim.models[idx].name, &prompt, max);
    plan.fit_context(sim.config.max_model_len, NUM_KEEP);
    ensure_loaded(sim, idx).await;
    let ctx = Ctx::new(Surface::Ollama, chat, &name);
    let opts = RespondOpts {
        chat,
        stream,
        include_usage: usage,
        model_idx: idx,
        queue_limit: Some(sim.config.max_queue),
        json_ct: JSON,
        sse_ct: SSE,
        guard: None,
    };
    let resp = match respond(sim, ctx, plan, opts).await {
        Ok(r) => r,
        Err(_) => return v1_err(StatusCode::SERVICE_UNAVAILABLE, BUSY),
    };
    touch(sim, idx, Some(sim.config.keep_alive)).await;
    resp
}

async fn openai_embeddings(sim: &Arc<Sim>, req: Request<Incoming>) -> Response<SimBody> {
    let r: EmbeddingRequest = match read_json(req, v1_err).await {
        Ok(r) => r,
        Err(resp) => return resp,
    };
    let (name, idx) = match named_model(sim, r.model.clone(), v1_err) {
        Ok(x) => x,
        Err(resp) => return resp,
    };
    let Some(input) = &r.input else {
        return v1_err(StatusCode::BAD_REQUEST, "invalid input");
    };
    if let Some((status, msg)) = inference_fault(sim) {
        return v1_err(status, msg);
    }
    ensure_loaded(sim, idx).await;
    let texts = input.texts();
    let (vecs, tokens) = sim.embed(&texts, r.dimensions);
    touch(sim, idx, Some(sim.config.keep_alive)).await;
    json(
        StatusCode::OK,
        JSON,
        embeddings_body(Surface::Ollama, &js(&name), &vecs, tokens as u32),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_formats_utc() {
        let t = UNIX_EPOCH + Duration::new(1_796_208_183, 385_406_455);
        assert_eq!(rfc3339(t), "2026-12-02T10:43:03.385406455Z");
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00Z");
    }
}
