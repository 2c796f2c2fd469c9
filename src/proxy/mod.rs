//! Forwarding an inference request: the request path of `docs/request-path.md`, from "body" to
//! "settle", as its phases.
//!
//! ```text
//! handle ─► prepare: auth, body (capped), content type, fields, allow-list, resolve,
//!           size (estimate, or a large prompt's exact count from a candidate's tokenizer),
//!           the candidates whose context window fits ([`context`]), admission
//!        ─► attempt loop (proxy):
//!             pick_or_wait (all candidates at their cap → the fair queue, bounded by
//!             `queue.timeout`) → attempt: rewrite (model name, forced usage) → send, waiting
//!             for the head beside the backend's failure and the hang deadline ([`rescue`]:
//!             withdrawn when the backend fails; with `routing.hedge` a second copy)
//!             → classify: retry elsewhere with the failure, or answer
//!        ─► respond: a backend error normalised, a stream through [`observe::ObservedStream`],
//!           or the whole answer read; settlement built once ([`settlement`])
//!        ─► no_answer: the last failure when every attempt was spent
//! ```
//!
//! Nothing here knows a client API by name: what differs between chat completions,
//! completions, embeddings (fields, rewrites, usage, error shapes) is the request's
//! [`ClientApi`] ([`crate::api`]).
//!
//! Invariants (see also the module docs of [`observe`] and [`crate::fleet::load`]):
//! - A request is retried on another backend only while nothing has been sent to the client;
//!   attempts are bounded by `routing.max_attempts` and `routing.failover_deadline`.
//! - The client's `Authorization` never reaches a backend (see [`headers`]).
//! - Load counters are held by guards and released on every exit path; the guard of a capped
//!   backend hands its freed slot to the next queued request.
//! - A backend's busy answer (429/503) makes it skipped for its `Retry-After` (or a doubling
//!   backoff) and `overloaded`; other retryable failures count towards its ejection.
//! - No network input can panic this code; every failure is an [`ApiError`], shaped for the
//!   client by its API.

mod adapter;
pub mod background;
mod context;
pub mod headers;
pub mod observe;
pub mod passthrough;
mod rescue;
pub mod resume;
pub mod sse;
pub mod stored;
mod tokens;
pub mod translated;

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::response::Response;
use bytes::Bytes;
use http::{header, HeaderMap, HeaderValue, Request, StatusCode};
use http_body_util::{BodyExt, Full, Limited};

use crate::api::translate::{Reply, Translation};
use crate::api::{BodyForm, ClientApi, Edits, Pin};
use crate::auth::Identity;
use crate::config::{BackendKind, Config, PolicyKind};
use crate::fleet::speed::ModelShapes;
use crate::fleet::{Backend, LoadGuard, Resolved};
use crate::gateway::{Gateway, Runtime};
use crate::limits::Permit;
use crate::openai::edit;
use crate::openai::error::{from_backend_redacted, insert_retry_after};
use crate::openai::{ApiError, RequestFields};
use crate::routing::RouteInput;
use crate::settle::{Outcome, Settle, SettleHook};
use crate::telemetry::access::AccessRecord;
use crate::telemetry::metrics as m;
use crate::upstream::Body as Incoming;
use crate::upstream::{retry_after, retryable_status, AttemptError};
use observe::ObservedStream;

/// Largest error body read from a backend to normalise it.
const MAX_ERROR_BODY: usize = 256 * 1024;
/// How long clients are told to wait when no backend can take their request.
const NO_BACKEND_RETRY_AFTER: Duration = Duration::from_secs(1);
/// While queued, route again at least this often (health changes free no slot).
const QUEUE_RECHECK: Duration = Duration::from_millis(50);
/// Upper bound on routing rounds of one queued request.
const MAX_QUEUE_ROUNDS: u32 = 100_000;

/// Handle one inference request of `api` end to end.
pub async fn handle(gw: Arc<Gateway>, api: &'static dyn ClientApi, req: Request<Body>) -> Response {
    let started = Instant::now();
    let request_id = crate::telemetry::access::request_id(req.headers());
    let mut record = AccessRecord::new(request_id, api.label(), started);
    record.client = crate::telemetry::access::client_addr(req.extensions());
    let rt = gw.runtime();
    // (the connection's service puts the request id on the response, as on every response)
    match proxy(&gw, &rt, api, req, &mut record).await {
        Ok(resp) => resp,
        Err(err) => {
            record.status = err.status.as_u16();
            record.error = Some(err.label().to_string());
            record.finish();
            api.error_response(err)
        }
    }
}

/// The phases in order: prepare, then attempts on one backend after another until one is
/// answered; when none is, the last failure (`Err`: `handle` finishes the record).
async fn proxy(
    gw: &Arc<Gateway>,
    rt: &Runtime,
    api: &'static dyn ClientApi,
    req: Request<Body>,
    record: &mut AccessRecord,
) -> Result<Response, ApiError> {
    let config = &rt.config;
    let mut prepared = match prepare(gw, rt, api, req, record).await? {
        Step::Route(p) => *p,
        Step::Answered(response) => {
            record.status = response.status().as_u16();
            finish_record(record);
            return Ok(response);
        }
    };
    let p = &prepared;
    let deadline = Instant::now() + config.routing.failover_deadline;
    let mut tried: Vec<usize> = Vec::new();
    let mut last_failure: Option<ApiError> = None;
    // (a hedged attempt tries two backends)
    while (tried.len() as u32) < config.routing.max_attempts {
        if !tried.is_empty() && Instant::now() >= deadline {
            break;
        }
        let candidates = &p.resolved.candidates;
        let native_first = pick_native(gw, config, p, &tried);
        let claimed = match native_first {
            Some(claimed) => Ok(Some(claimed)),
            None => {
                let tenant = &p.identity.tenant;
                pick_or_wait(gw, config, p.policy, candidates, &tried, &p.input, tenant).await
            }
        };
        let claimed = match claimed {
            Ok(Some(claimed)) => claimed,
            Ok(None) => break,
            Err(e) => {
                last_failure = Some(e);
                break;
            }
        };
        tried.push(claimed.idx);
        match attempt(gw, config, p, claimed, &mut tried, deadline, record).await {
            Verdict::Retry(failure) => last_failure = Some(failure),
            Verdict::Refuse(refused) => return Err(refused),
            Verdict::Answer(answer) => {
                let resume = continuer(gw, config, p, &tried, answer.strip_usage, record);
                return Ok(respond(config, &mut prepared, answer, record, resume).await);
            }
        }
    }
    Err(no_answer(last_failure, prepared))
}

/// What [`prepare`] read and decided: everything the attempts need, read once.
struct Prepared {
    api: &'static dyn ClientApi,
    identity: Identity,
    client_headers: HeaderMap,
    body: Bytes,
    fields: RequestFields,
    resolved: Resolved,
    policy: PolicyKind,
    input: RouteInput,
    streaming: bool,
    /// The one backend that holds what the request refers to (its only candidate).
    pin: Option<Pin>,
    /// The request translated to chat completions, for the candidates that do not speak its
    /// API natively ([`ClientApi::translator`]).
    translation: Option<Translation>,
    shapes: Arc<ModelShapes>,
    /// Taken by the answering attempt's settlement; dropped (refunded) when none answers.
    permit: Option<Permit>,
    /// Where a background response's follower runs ([`background`]).
    main: tokio::runtime::Handle,
    limit_headers: HeaderMap,
    /// The workload trace, when `[trace]` is on.
    trace: Option<Arc<crate::telemetry::trace::TraceWriter>>,
}

/// Everything before the first attempt: auth, content type, body, fields, allow-list,
/// resolve, size, admission. Each step can refuse the request; none has sent anything.
/// What the prepare phase leads to: a request to route, or an answer given without a backend.
enum Step {
    Route(Box<Prepared>),
    Answered(Response),
}

/// The model's own tokenizer answers when no candidate speaks the API, natively or by
/// translation, and the API can be answered that way (`/v1/messages/count_tokens`); `None`
/// otherwise (routing goes on, and says why nothing serves it).
fn answer_locally(
    rt: &Runtime,
    api: &dyn ClientApi,
    identity: &Identity,
    fields: &RequestFields,
    body: &Bytes,
    translation: &Option<Result<Translation, ApiError>>,
) -> Option<Result<Response, ApiError>> {
    if matches!(translation, Some(Ok(_))) || !identity.allows(&rt.fleet, &fields.model) {
        return None;
    }
    let resolved = rt.fleet.resolve(&fields.model)?;
    if resolved
        .candidates
        .iter()
        .any(|(b, _)| api.native(b.kind()))
    {
        return None;
    }
    let tokenizer = rt.config.tokenizer(&resolved.canonical)?;
    let answer = api.answer_locally(body, tokenizer)?;
    Some(answer.map(|json| {
        let mut r = Response::new(Body::from(json));
        r.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        r
    }))
}

async fn prepare(
    gw: &Gateway,
    rt: &Runtime,
    api: &'static dyn ClientApi,
    req: Request<Body>,
    record: &mut AccessRecord,
) -> Result<Step, ApiError> {
    let config = &rt.config;
    let identity = rt
        .keys
        .authenticate_request(req.headers(), req.extensions())?;
    record.tenant = identity.tenant.clone();
    let boundary = match api.body_form() {
        BodyForm::Json => check_content_type(req.headers()).map(|()| None)?,
        BodyForm::Multipart => Some(form_boundary(req.headers())?),
    };
    let (client_headers, body) = read_body(req, config.server.max_body_bytes).await?;
    let fields = match &boundary {
        Some(b) => api.parse_form(b, &body)?,
        None => api.parse(&body)?,
    };
    record.stream = fields.stream;
    let translation = translate_if_served(rt, api, &fields, &body);
    if let Some(answer) = answer_locally(rt, api, &identity, &fields, &body, &translation) {
        return answer.map(Step::Answered);
    }
    let pin = match api.pin(&body, &identity.tenant) {
        Ok(pin) => pin,
        // A reference to stored state, for a model only translation serves: the field is
        // what cannot be served, whatever it names.
        Err(e) => return Err(refused_translation(rt, api, &fields, translation).unwrap_or(e)),
    };
    let resolved = resolve(
        rt,
        api,
        &identity,
        &fields,
        pin.as_ref(),
        translation.as_ref(),
    )?;
    let mut resolved = keep_state(rt, api, &body, &fields, pin.as_ref(), resolved)?;
    let translation = translation.and_then(Result::ok);
    record.model = resolved.canonical.clone();
    let policy = resolved.policy.unwrap_or(config.routing.policy);
    let shapes = gw.router.shapes.clone();
    let input = size(config, api, &shapes, &resolved, &fields, &body).await;
    context::fit(&mut resolved, fields.max_tokens, &input)?;
    let permit = gw
        .limits
        .admit(&identity, &resolved.canonical, input.tokens)
        .await?;
    Ok(Step::Route(Box::new(Prepared {
        api,
        identity,
        client_headers,
        streaming: api.streams(&fields),
        pin,
        translation,
        body,
        fields,
        resolved,
        policy,
        input,
        shapes,
        limit_headers: permit.headers(),
        permit: Some(permit),
        trace: gw.trace.clone(),
        main: gw.main.clone(),
    })))
}

/// The allow-list, then the model's candidates among the backends that speak `api`, natively or
/// by translation (only the holder of a pinned request). Both are candidates, so failover
/// crosses them; a native one is preferred when one can take the request ([`pick_native`]), and
/// each backend is sent the request natively when it speaks the API.
fn resolve(
    rt: &Runtime,
    api: &dyn ClientApi,
    identity: &Identity,
    fields: &RequestFields,
    pin: Option<&Pin>,
    translation: Option<&Result<Translation, ApiError>>,
) -> Result<Resolved, ApiError> {
    if !identity.allows(&rt.fleet, &fields.model) {
        return Err(crate::auth::model_refused(
            &fields.model,
            rt.config.hide_disallowed_models,
        ));
    }
    let mut resolved = rt
        .fleet
        .resolve(&fields.model)
        .ok_or_else(|| ApiError::model_not_found(&fields.model))?;
    let by_translation =
        |kind| !api.native(kind) && api.translator().is_some_and(|t| t.serves(kind));
    let translated = matches!(translation, Some(Ok(_)));
    let servable = |kind| api.native(kind) || (translated && by_translation(kind));
    if !resolved.candidates.iter().any(|(b, _)| servable(b.kind())) {
        // Only translation could serve it, and the request does not translate: say why.
        if let Some(Err(refused)) = translation {
            if resolved
                .candidates
                .iter()
                .any(|(b, _)| by_translation(b.kind()))
            {
                return Err(refused.clone());
            }
        }
        let kinds: Vec<_> = resolved.candidates.iter().map(|(b, _)| b.kind()).collect();
        return Err(api.unserved(&fields.model, &kinds));
    }
    resolved.candidates.retain(|(b, _)| servable(b.kind()));
    if let Some(pin) = pin {
        resolved.candidates.retain(|(b, _)| pin.holds(b.name()));
        if resolved.candidates.is_empty() {
            let holder = rt.fleet.backends().iter().find(|b| pin.holds(b.name()));
            return Err(match holder {
                Some(b) => pin.model_not_there(b.name(), &fields.model),
                None => pin.gone(),
            });
        }
    }
    Ok(resolved)
}

/// A request that needs state kept by its backend (a stored or background response) goes
/// only to backends that keep it; `Err` when the model has none, or when the pinned holder is
/// one that keeps nothing.
fn keep_state(
    rt: &Runtime,
    api: &dyn ClientApi,
    body: &[u8],
    fields: &RequestFields,
    pin: Option<&Pin>,
    mut resolved: Resolved,
) -> Result<Resolved, ApiError> {
    let Some(field) = api.needs_state(body) else {
        return Ok(resolved);
    };
    let kinds: Vec<_> = resolved.candidates.iter().map(|(b, _)| b.kind()).collect();
    resolved
        .candidates
        .retain(|(b, _)| api.keeps_state(b.kind()));
    if !resolved.candidates.is_empty() {
        return Ok(resolved);
    }
    let holder = pin.and_then(|p| {
        rt.fleet
            .backends()
            .iter()
            .find(|b| p.holds(b.name()))
            .map(|b| (p, b))
    });
    Err(match holder {
        Some((pin, b)) => pin.not_stored(b.name()),
        None => api.stateless(&fields.model, field, &kinds),
    })
}

/// The request translated for the backends that serve its API only by translation, when the
/// model has any (a model served only natively pays nothing for it).
fn translate_if_served(
    rt: &Runtime,
    api: &dyn ClientApi,
    fields: &RequestFields,
    body: &[u8],
) -> Option<Result<Translation, ApiError>> {
    let translator = api.translator()?;
    let resolved = rt.fleet.resolve(&fields.model)?;
    let needed = resolved
        .candidates
        .iter()
        .any(|(b, _)| !api.native(b.kind()) && translator.serves(b.kind()));
    needed.then(|| translator.request(body, api.streams(fields)))
}

/// The translation's refusal when the model exists and none of its backends speaks `api`
/// natively.
fn refused_translation(
    rt: &Runtime,
    api: &dyn ClientApi,
    fields: &RequestFields,
    translation: Option<Result<Translation, ApiError>>,
) -> Option<ApiError> {
    let refused = translation?.err()?;
    let resolved = rt.fleet.resolve(&fields.model)?;
    let native = resolved
        .candidates
        .iter()
        .any(|(b, _)| api.native(b.kind()));
    (!native).then_some(refused)
}

/// The request's expected size for routing and admission: the prompt's token ids from the
/// model's own tokenizer when some candidate reports its cache or the prompt is large
/// (exact), else the prompt's exact count from a candidate's tokenizer for a large prompt,
/// else the estimate corrected by what this model's responses reported; plus the API's
/// expected output (`max_tokens` or, when absent, the model's learned average output).
async fn size(
    config: &Config,
    api: &dyn ClientApi,
    shapes: &ModelShapes,
    resolved: &Resolved,
    fields: &RequestFields,
    body: &Bytes,
) -> RouteInput {
    let corrected = shapes.corrected_prompt(&resolved.canonical, fields.prompt_tokens_estimate);
    let above = config.routing.tokenize_above;
    let large = above > 0 && corrected >= above;
    // an adapter's prompt is its base model's, tokenized alike and cached apart (by name)
    let adapter = resolved.adapter.as_ref().map(|a| a.name.clone());
    let model = resolved
        .adapter
        .as_ref()
        .map_or(&resolved.canonical, |a| &a.base);
    let prompt = match config.tokenizer(model) {
        Some(t) if large || tokens::wanted(resolved) => {
            tokens::prompt_ids(t, api, fields, body, adapter.clone()).await
        }
        _ => None,
    };
    let exact = match &prompt {
        Some(p) => Some(p.len() as u64),
        None if large => crate::fleet::tokenize::count(
            &resolved.candidates,
            api,
            body.get(fields.prompt_span.clone()).unwrap_or_default(),
            config.routing.tokenize_timeout,
        )
        .await
        .ok(),
        None => None,
    };
    let prompt_tokens = exact.unwrap_or(corrected);
    // The prefix is the same share of the prompt whichever way the prompt was counted.
    let prefix_tokens = match exact {
        Some(n) if fields.prompt_tokens_estimate > 0 => {
            let share = fields.prefix_tokens_estimate as f64 / fields.prompt_tokens_estimate as f64;
            (n as f64 * share.min(1.0)) as u64
        }
        _ => shapes.corrected_prompt(&resolved.canonical, fields.prefix_tokens_estimate),
    };
    let default_output = shapes
        .output_tokens(&resolved.canonical)
        .unwrap_or(config.routing.default_max_tokens);
    RouteInput {
        tokens: prompt_tokens + api.expected_output(fields, default_output),
        prefix_hash: fields.prefix_hash,
        prompt_tokens,
        prefix_tokens,
        prompt: prompt.map(Arc::new),
        prompt_exact: exact.is_some(),
        adapter,
    }
}

async fn read_body(req: Request<Body>, limit: usize) -> Result<(HeaderMap, Bytes), ApiError> {
    let (parts, body) = req.into_parts();
    if let Some(len) = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|s| s.parse::<u64>().ok())
    {
        if len > limit as u64 {
            return Err(ApiError::payload_too_large(limit));
        }
    }
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok((parts.headers, collected.to_bytes())),
        Err(e) => {
            if e.downcast_ref::<http_body_util::LengthLimitError>()
                .is_some()
            {
                Err(ApiError::payload_too_large(limit))
            } else {
                Err(ApiError::bad_request(format!(
                    "Could not read the request body: {e}"
                )))
            }
        }
    }
}

fn check_content_type(headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(ct) = headers.get(header::CONTENT_TYPE) else {
        return Ok(()); // lenient: many scripts omit it; the body must still be JSON
    };
    let ct = ct.to_str().unwrap_or("");
    let essence = ct.split(';').next().unwrap_or("").trim();
    if essence.eq_ignore_ascii_case("application/json")
        || essence.to_ascii_lowercase().ends_with("+json")
    {
        Ok(())
    } else {
        Err(ApiError::unsupported_media_type(ct))
    }
}

/// The boundary of a `multipart/form-data` request (415 for any other content type).
fn form_boundary(headers: &HeaderMap) -> Result<String, ApiError> {
    let ct = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    crate::api::multipart::boundary(ct)
        .map(str::to_string)
        .map_err(|e| {
            ApiError::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "invalid_request_error",
                format!("Expected a multipart/form-data body: {e}."),
            )
            .with_code("unsupported_media_type")
        })
}

/// How an attempt ended: what [`classify`] decided. (It lives for one match on the attempt's
/// stack: boxing the answer would cost an allocation per request.)
#[allow(clippy::large_enum_variant)]
enum Verdict {
    /// Try another backend; the client gets this failure if none is left.
    Retry(ApiError),
    /// Answer the client from this backend.
    Answer(Answer),
    /// What the request needs cannot be had on any backend: the client's answer.
    Refuse(ApiError),
}

/// A backend's answer that goes to the client, with what the response phase needs of its send.
struct Answer {
    resp: http::Response<Incoming>,
    /// The backend that answered, with its slot.
    claimed: Claimed,
    /// Since the request arrived, when it was sent to this backend.
    sent_after: Duration,
    /// A non-streamed answer (or an error body) must be complete by then.
    body_deadline: tokio::time::Instant,
    /// Sluice forced stream usage: the observer drops it before it reaches the client.
    strip_usage: bool,
    /// The answer is a chat completion to be put back into the client API's shape.
    reply: Option<std::sync::Arc<dyn Reply>>,
}

/// One attempt on the claimed backend (already in `tried`), and with hedging a copy on a
/// second one: send, wait for a head — withdrawn when the backend fails, hedged at the hang
/// deadline — and classify. The first copy whose head is an answer wins; the other is dropped.
async fn attempt(
    gw: &Gateway,
    config: &Config,
    p: &Prepared,
    claimed: Claimed,
    tried: &mut Vec<usize>,
    deadline: Instant,
    record: &mut AccessRecord,
) -> Verdict {
    let attempt_no = tried.len().saturating_sub(1) as u32;
    if attempt_no > 0 {
        metrics::counter!(m::FAILOVERS_TOTAL, "model" => p.resolved.canonical.clone()).increment(1);
    }
    if let Some(a) = &p.resolved.adapter {
        let backend = &p.resolved.candidates[claimed.idx].0;
        match adapter::ensure(backend, a).await {
            Ok(()) => {}
            Err(adapter::Missing::Elsewhere(e)) => return Verdict::Retry(e),
            Err(adapter::Missing::Refused(e)) => return Verdict::Refuse(e),
        }
    }
    let mut copies = vec![rescue::Copy::launch(config, p, claimed, record, true)];
    let mut last = None;
    while !copies.is_empty() {
        let (i, waited) = rescue::await_any(config, p, &mut copies).await;
        match waited {
            rescue::Waited::Head(sent) => {
                let copy = copies.swap_remove(i);
                let backend = &p.resolved.candidates[copy.claimed.idx].0;
                let retries_left =
                    !copies.is_empty() || (tried.len() as u32) < config.routing.max_attempts;
                record.attempts = tried.len() as u32;
                record.backend = Some(backend.name().to_string());
                let deadline = copy.body_deadline;
                match classify(config, backend, sent, retries_left, deadline, record).await {
                    Ok(resp) => {
                        rescue::cancel(p, &copies);
                        return Verdict::Answer(copy.answer(resp));
                    }
                    Err(failure) => last = Some(failure),
                }
            }
            rescue::Waited::Withdrawn(health) => {
                let copy = copies.swap_remove(i);
                let backend = &p.resolved.candidates[copy.claimed.idx].0;
                last = Some(rescue::withdrawn(backend, health, &record.request_id));
            }
            rescue::Waited::Hung => {
                if let Some(c) = hedge(gw, config, p, tried, copies.len(), deadline) {
                    tried.push(c.idx);
                    copies.push(rescue::Copy::launch(config, p, c, record, false));
                }
            }
        }
    }
    Verdict::Retry(last.unwrap_or_else(|| ApiError::internal("no attempt was made")))
}

/// The second copy of a request at its hang deadline, with `routing.hedge`: the next-best
/// untried backend with a free slot, while attempts and the failover deadline allow.
fn hedge(
    gw: &Gateway,
    config: &Config,
    p: &Prepared,
    tried: &[usize],
    copies: usize,
    deadline: Instant,
) -> Option<Claimed> {
    let r = &config.routing;
    // (a copy is not sent where an adapter would have to be loaded first)
    if !r.hedge
        || p.resolved.adapter.is_some()
        || copies > 1
        || tried.len() as u32 >= r.max_attempts
        || Instant::now() >= deadline
    {
        return None;
    }
    let claimed = pick_and_claim(
        gw,
        config,
        p.policy,
        &p.resolved.candidates,
        tried,
        &p.input,
    )?;
    metrics::counter!(m::HEDGES_TOTAL, "model" => p.resolved.canonical.clone()).increment(1);
    Some(claimed)
}

/// The body for one backend: the client's bytes with the backend's model name and, for a
/// stream, forced usage spliced in; and whether the observer must strip that usage.
fn rewrite(p: &Prepared, backend_model: &str) -> (Bytes, bool) {
    let mut splices = Vec::new();
    if backend_model != p.fields.model {
        splices.push(p.api.rename_model(&p.fields, backend_model));
    }
    let forced = if p.streaming {
        p.api.force_stream_usage(&p.body, &p.fields)
    } else {
        None
    };
    let strip_usage = forced.is_some();
    splices.extend(forced);
    splices.extend(p.pin.as_ref().and_then(|pin| pin.splice.clone()));
    (edit::apply(&p.body, splices), strip_usage)
}

/// What an answer's status says about its backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Said {
    /// 429/503: skipped for its `Retry-After` (or a doubling backoff), shown `overloaded`.
    Busy,
    /// Another 5xx: counts towards its ejection.
    Failing,
    /// Anything else, 4xx included: the backend works.
    Working,
}

/// The classification of a backend's status: whether the request goes to another backend
/// (a retryable status while attempts are left), and what it says about the backend.
fn judge(status: StatusCode, retries_left: bool) -> (bool, Said) {
    let said = match status.as_u16() {
        429 | 503 => Said::Busy,
        _ if status.is_server_error() => Said::Failing,
        _ => Said::Working,
    };
    (retryable_status(status) && retries_left, said)
}

/// The failure a send that got no response head leaves for the client.
fn transport_failure(backend: &str, e: &AttemptError) -> ApiError {
    match e {
        AttemptError::Timeout(d) => ApiError::timeout(&format!("no response within {d:?}")),
        other => ApiError::bad_gateway(format!("Backend `{backend}` failed: {}", other.label())),
    }
}

/// The one classification of what an attempt got back: `Err` (retry elsewhere with this
/// failure: no head, or a retryable status while attempts are left) or `Ok` (answer the
/// client). Records what it says about the backend's health.
async fn classify<B: UpstreamBody>(
    config: &Config,
    backend: &Backend,
    sent: Result<http::Response<B>, AttemptError>,
    retries_left: bool,
    body_deadline: tokio::time::Instant,
    record: &AccessRecord,
) -> Result<http::Response<B>, ApiError> {
    let resp = match sent {
        Ok(resp) => resp,
        Err(e) => {
            tracing::warn!(
                request_id = %record.request_id,
                backend = backend.name(),
                attempt = record.attempts,
                "attempt failed: {e}"
            );
            m::backend_request(backend.name(), e.label());
            let connect = matches!(e, AttemptError::Connect(_));
            backend
                .state
                .record_live_failure(&config.health, connect, e.label());
            return Err(transport_failure(backend.name(), &e));
        }
    };
    let status = resp.status();
    m::backend_request(backend.name(), m::status_class(status.as_u16()));
    let (retry, said) = judge(status, retries_left);
    match said {
        Said::Busy => backend.state.record_busy(retry_after(resp.headers())),
        Said::Failing => backend
            .state
            .record_live_failure(&config.health, false, status.as_str()),
        Said::Working => backend.state.record_live_success(),
    }
    if !retry {
        return Ok(resp);
    }
    let idle = backend.config.timeouts.idle;
    let err_body = read_capped(resp.into_body(), MAX_ERROR_BODY, idle, body_deadline)
        .await
        .unwrap_or_default();
    tracing::info!(request_id = %record.request_id, backend = backend.name(), status = status.as_u16(), "backend busy or failing; trying another");
    Err(from_backend_redacted(
        status,
        &err_body,
        backend.config.api_key.as_deref(),
    ))
}

/// What continues this request's stream on another backend if it breaks after it was
/// committed (`routing.continue_streams`; [`resume`]); `None` for an answer that is not
/// streamed, an API that cannot be continued, or a request pinned to one backend.
fn continuer(
    gw: &Arc<Gateway>,
    config: &Config,
    p: &Prepared,
    tried: &[usize],
    strip_usage: bool,
    record: &AccessRecord,
) -> Option<resume::Continuer> {
    if !config.routing.continue_streams || !p.streaming || p.pin.is_some() {
        return None;
    }
    p.api.continuation()?;
    // an adapter's stream continues only where the adapter is held: nothing is loaded mid-answer
    let mut tried = tried.to_vec();
    if let Some(a) = &p.resolved.adapter {
        let candidates = &p.resolved.candidates;
        let elsewhere: Vec<usize> = (0..candidates.len())
            .filter(|&i| !tried.contains(&i) && !candidates[i].0.state.adapters().holds(&a.name))
            .collect();
        tried.extend(elsewhere);
    }
    Some(resume::Continuer {
        gw: gw.clone(),
        api: p.api,
        body: p.body.clone(),
        fields: p.fields.clone(),
        candidates: p.resolved.candidates.clone(),
        policy: p.policy,
        input: p.input.clone(),
        tenant: p.identity.tenant.clone(),
        client_headers: p.client_headers.clone(),
        request_id: record.request_id.clone(),
        tried,
        strip_usage,
    })
}

/// Answer the client from the backend that answered: its error normalised, its stream through
/// the observer, or its whole answer read. From here on nothing is retried.
async fn respond(
    config: &Config,
    p: &mut Prepared,
    answer: Answer,
    record: &mut AccessRecord,
    resume: Option<resume::Continuer>,
) -> Response {
    let permit = p.permit.take();
    let claimed = answer.claimed;
    let (backend, backend_model) = &p.resolved.candidates[claimed.idx];
    let status = answer.resp.status();
    record.status = status.as_u16();
    let (parts, upstream) = answer.resp.into_parts();
    if !status.is_success() {
        let idle = backend.config.timeouts.idle;
        let err_body = read_capped(upstream, MAX_ERROR_BODY, idle, answer.body_deadline)
            .await
            .unwrap_or_default();
        let err = from_backend_redacted(status, &err_body, backend.config.api_key.as_deref());
        let mut response = p.api.error_response(err);
        if let Some(after) = retry_after(&parts.headers) {
            insert_retry_after(response.headers_mut(), after);
        }
        response.headers_mut().extend(p.limit_headers.clone());
        routing_headers(config, backend, claimed.cached, response.headers_mut());
        record.error = Some(format!("backend_{}", status.as_u16()));
        finish_record(record);
        return response;
    }
    let mut out_headers = headers::downstream_headers(&parts.headers);
    routing_headers(config, backend, claimed.cached, &mut out_headers);
    let edits = match answer.reply {
        // The translation writes the client's shape: model name, ids and finish included.
        Some(_) => Edits {
            redact: backend.config.api_key.as_deref().map(Arc::from),
            ..Edits::default()
        },
        None => answer_edits(
            p,
            backend,
            backend_model,
            answer.strip_usage,
            &record.request_id,
        ),
    };
    out_headers.extend(p.limit_headers.clone());
    let settle = settlement(p, permit, backend, claimed, answer.sent_after, record);
    let answer_parts = (status, out_headers, upstream, edits, settle);
    if p.streaming && is_sse(&parts.headers) {
        // A translated stream is not continued: its events are rebuilt from another API's.
        let resume = match answer.reply {
            Some(_) => None,
            None => resume.and_then(resume::Continuer::into_resume),
        };
        return stream_answer(config, p.api, backend, answer_parts, answer.reply, resume);
    }
    let reply = answer.reply.as_deref();
    whole_answer(
        config,
        p.api,
        backend,
        answer_parts,
        answer.body_deadline,
        reply,
    )
    .await
}

/// The edits the client's answer needs: its model name back, forced usage dropped, and TGI's
/// empty id and `stop_sequence` finish reason made OpenAI's.
fn answer_edits(
    p: &Prepared,
    backend: &Backend,
    backend_model: &str,
    strip_usage: bool,
    request_id: &str,
) -> Edits {
    let tgi = backend.kind() == BackendKind::Tgi;
    Edits {
        rename_model: (backend_model != p.fields.model).then(|| p.fields.model.clone()),
        strip_usage,
        fill_id: tgi.then(|| format!("{}{request_id}", p.api.id_prefix())),
        normalize_finish: tgi,
        redact: backend.config.api_key.as_deref().map(Arc::from),
        issue_ids: p
            .api
            .issued_ids(backend.name(), &p.identity.tenant)
            .map(Arc::from),
    }
}

/// With `[routing] expose_backend_header`, the backend that answered and the prompt tokens
/// routing expected cached there, on every answer a backend gave, its errors included.
fn routing_headers(
    config: &Config,
    backend: &Backend,
    cached: Option<u64>,
    headers: &mut HeaderMap,
) {
    if !config.routing.expose_backend_header {
        return;
    }
    if let Ok(v) = HeaderValue::from_str(backend.name()) {
        headers.insert("x-sluice-backend", v);
    }
    if let Some(c) = cached {
        headers.insert("x-sluice-cached-prefix", HeaderValue::from(c));
    }
}

/// The settlement of an answered request (runs once, when the answer is over): the load
/// guard, the limits' reconciliation, and what the answer teaches about backend and model.
fn settlement(
    p: &Prepared,
    permit: Option<Permit>,
    backend: &Arc<Backend>,
    claimed: Claimed,
    sent_after: Duration,
    record: &mut AccessRecord,
) -> Settle {
    let mut settle = Settle::new(take_record(record));
    if let Some(predicted) = claimed.cached {
        settle.hooks.push(prediction_hook(backend, predicted));
    }
    settle.guard = Some(claimed.guard);
    settle.prompt_estimate = p.fields.prompt_tokens_estimate;
    if let Some(permit) = permit {
        let follow = background::Follow {
            api: p.api,
            backend: backend.clone(),
            tenant: p.identity.tenant.clone(),
            model: p.resolved.canonical.clone(),
            main: p.main.clone(),
        };
        let hook = permit.with_backend(backend.name()).into_hook();
        settle
            .hooks
            .push(background::settle_or_follow(hook, follow));
    }
    settle.hooks.push(observe::learn_hook(
        backend.clone(),
        p.shapes.clone(),
        p.resolved.canonical.clone(),
        p.fields.prompt_tokens_estimate,
        sent_after,
        claimed.queued,
        claimed.cached,
    ));
    if let Some(trace) = &p.trace {
        settle
            .hooks
            .push(trace_hook(p, trace.clone(), backend.name()));
    }
    settle
}

/// Count the cached prompt tokens routing expected on the backend against what its engine
/// reported (answers that report none are not counted).
fn prediction_hook(backend: &Arc<Backend>, predicted: u64) -> SettleHook {
    let backend = backend.clone();
    Box::new(move |o: &Outcome| {
        if let Some(reported) = o.usage.and_then(|u| u.cached_tokens) {
            m::prefix_prediction(backend.name(), predicted, reported);
            backend.state.kv().record_prediction(predicted, reported);
        }
    })
}

/// The trace line of an answered request: counts, the prefix fingerprint, the backend and the
/// latencies measured here (TTFT for streams, TPOT for complete streams one backend produced),
/// never text.
fn trace_hook(
    p: &Prepared,
    trace: Arc<crate::telemetry::trace::TraceWriter>,
    backend: &str,
) -> SettleHook {
    let backend = backend.to_string();
    let model = p.resolved.canonical.clone();
    let api = p.api.path();
    let prefix = p.input.prefix_hash.map(|h| format!("{h:016x}"));
    let prefix_tokens = p.input.prefix_tokens;
    // what routing expects as output when the client set a limit (0: it did not)
    let max_tokens = Some(p.api.expected_output(&p.fields, 0)).filter(|m| *m > 0);
    Box::new(move |o: &Outcome| {
        let Some(u) = o.usage else {
            return;
        };
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        let tpot = o
            .ttft
            .filter(|_| o.complete && !o.continued)
            .and_then(|t| crate::telemetry::trace::tpot_ms(t, o.elapsed, u.completion_tokens));
        trace.record(&crate::telemetry::trace::TraceLine {
            ts: now.saturating_sub(o.elapsed).as_secs_f64(),
            model: &model,
            api,
            prompt_tokens: u.prompt_tokens,
            completion_tokens: u.completion_tokens,
            cached_tokens: u.cached_tokens.unwrap_or(0),
            prefix: prefix.clone(),
            prefix_tokens: if prefix.is_some() { prefix_tokens } else { 0 },
            max_tokens,
            backend: Some(&backend),
            ttft_ms: o.ttft.map(ms),
            tpot_ms: tpot,
            duration_ms: ms(o.elapsed),
        });
    })
}

/// A successful answer on its way out: status, headers, the backend's body, its edits, and the
/// settlement that runs when it is over.
type AnswerParts = (StatusCode, HeaderMap, Incoming, Edits, Settle);

/// Whether the backend answered with an event stream (a backend may answer a stream request
/// with a whole JSON body; it is then read whole).
pub(super) fn is_sse(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.starts_with("text/event-stream"))
}

/// Stream the answer through the observer (usage and first token on the side); a translated
/// chat stream is put back into the client API's events first.
fn stream_answer(
    config: &Config,
    api: &'static dyn ClientApi,
    backend: &Arc<Backend>,
    (status, headers, upstream, edits, settle): AnswerParts,
    reply: Option<Arc<dyn Reply>>,
    resume: Option<resume::Resume<Incoming>>,
) -> Response {
    let idle = backend.config.timeouts.idle;
    let health = config.health.clone();
    let backend = backend.clone();
    let body = match reply {
        Some(reply) => {
            let upstream = translated::TranslatedBody::new(upstream, reply.stream());
            Body::new(ObservedStream::new(
                api, upstream, edits, idle, backend, health, settle,
            ))
        }
        None => Body::new(
            ObservedStream::new(api, upstream, edits, idle, backend, health, settle)
                .resuming(resume),
        ),
    };
    let mut response = Response::new(body);
    *response.status_mut() = status;
    *response.headers_mut() = headers;
    response
        .headers_mut()
        .insert("x-accel-buffering", HeaderValue::from_static("no"));
    response
        .headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}

/// Read the whole answer (capped, by the body deadline), take its usage, edit it and settle.
async fn whole_answer(
    config: &Config,
    api: &dyn ClientApi,
    backend: &Backend,
    (status, headers, upstream, edits, mut settle): AnswerParts,
    body_deadline: tokio::time::Instant,
    reply: Option<&dyn Reply>,
) -> Response {
    let (limit, idle) = (
        config.server.max_response_bytes,
        backend.config.timeouts.idle,
    );
    let whole = match read_capped(upstream, limit, idle, body_deadline).await {
        Ok(b) => b,
        Err(e) => {
            let why = format!("failed while sending its answer: {e}");
            return broken_answer(config, api, backend, settle, "body", "backend_body", &why);
        }
    };
    let whole = match reply.map(|r| r.whole(&whole)) {
        None => whole,
        Some(Ok(translated)) => translated,
        Some(Err(e)) => {
            let why = format!("sent a chat answer that cannot be translated: {e}.");
            let label = "backend_invalid_body";
            return broken_answer(config, api, backend, settle, "invalid body", label, &why);
        }
    };
    settle.usage = match api.whole_usage(&whole) {
        Ok(u) => u,
        // Not JSON (garbage, NDJSON, a cut body): the client gets a clean 502, not the bytes.
        Err(e) => {
            let why = format!("sent an answer that is not JSON ({e}).");
            let label = "backend_invalid_body";
            return broken_answer(config, api, backend, settle, "invalid body", label, &why);
        }
    };
    settle.complete = true;
    if settle.usage.is_none() {
        settle.pending = api.pending(&whole);
    }
    let whole = if edits.edits_whole() {
        api.edit(&whole, &edits).unwrap_or(whole)
    } else {
        whole
    };
    let whole = observe::Redactor::new(edits.redact.as_deref()).apply(whole);
    settle.finish();
    let mut response = Response::new(Body::new(Full::new(whole)));
    *response.status_mut() = status;
    *response.headers_mut() = headers;
    response
}

/// The one fallback for a successful head whose body cannot be passed on: the backend is
/// marked as for any broken answer, the request settles as a 502, the client gets a clean 502.
fn broken_answer(
    config: &Config,
    api: &dyn ClientApi,
    backend: &Backend,
    mut settle: Settle,
    health_reason: &str,
    label: &str,
    why: &str,
) -> Response {
    backend
        .state
        .record_live_failure(&config.health, false, health_reason);
    settle.record.status = 502;
    settle.record.error = Some(label.into());
    settle.finish();
    let message = format!("Backend `{}` {why}", backend.name());
    api.error_response(ApiError::bad_gateway(message))
}

/// The answer when every attempt was spent: the last failure (a busy one with a
/// `Retry-After`), or "no backend" when none could be tried.
fn no_answer(last_failure: Option<ApiError>, p: Prepared) -> ApiError {
    let holder = p.resolved.candidates.first().map(|(b, _)| b.name());
    let mut err = match last_failure {
        // Only the holder has the pinned state: its failure is "unavailable", whatever it was.
        _ if p.pin.is_some() => p
            .pin
            .as_ref()
            .map(|pin| pin.unavailable(holder.unwrap_or_default()))
            .unwrap_or_else(|| ApiError::internal("pinned")),
        Some(mut e) => {
            if e.status == StatusCode::TOO_MANY_REQUESTS
                || e.status == StatusCode::SERVICE_UNAVAILABLE
            {
                e.retry_after = e.retry_after.or(Some(NO_BACKEND_RETRY_AFTER));
            }
            e
        }
        None => ApiError::no_backend(&p.fields.model, NO_BACKEND_RETRY_AFTER),
    };
    err.headers.extend(p.limit_headers);
    err
}

/// For a request some candidates serve only by translation: a backend that speaks its API
/// natively, when one can take it now (it keeps every field, and stored state where the engine
/// keeps it). `None`: no translation involved, or no native backend can take it now; the
/// normal pick then chooses among all candidates, so translated backends take the overflow
/// and the failover.
fn pick_native(gw: &Gateway, config: &Config, p: &Prepared, tried: &[usize]) -> Option<Claimed> {
    p.translation.as_ref()?;
    let candidates = &p.resolved.candidates;
    let mut excluded = tried.to_vec();
    excluded.extend((0..candidates.len()).filter(|i| !p.api.native(candidates[*i].0.kind())));
    excluded.sort_unstable();
    excluded.dedup();
    if excluded.len() >= candidates.len() {
        return None;
    }
    pick_and_claim(gw, config, p.policy, candidates, &excluded, &p.input)
}

/// The backend chosen for one attempt, with its slot already taken.
struct Claimed {
    /// Index into the request's candidates.
    idx: usize,
    /// The request's share of the backend's load (and, under a cap, its slot).
    guard: LoadGuard,
    /// Whether the request will queue inside the engine: its TTFT then says little about the
    /// backend's prefill speed.
    queued: bool,
    /// Prompt tokens the backend held in its cache when it was chosen, by its KV events.
    cached: Option<u64>,
    /// The request's use of its LoRA adapter there (so that adapter is not unloaded under it).
    _adapter: Option<crate::fleet::adapters::AdapterUse>,
}

/// Route, then take the chosen backend's slot. Routing reads the counters without holding
/// them, so a concurrent request can take the last slot between the pick and the claim; the
/// next pick then sees that backend full. Bounded: each lost race means another request got
/// a slot.
fn pick_and_claim(
    gw: &Gateway,
    config: &crate::config::Config,
    policy: crate::config::PolicyKind,
    candidates: &[(Arc<crate::fleet::Backend>, String)],
    tried: &[usize],
    input: &RouteInput,
) -> Option<Claimed> {
    for _ in 0..=candidates.len() {
        let idx = gw.router.pick(config, policy, candidates, tried, input)?;
        let (backend, backend_model) = &candidates[idx];
        let queued = crate::routing::score::would_queue(backend, backend_model);
        let cap = backend.cap();
        let Some(guard) = LoadGuard::claim(backend.state.clone(), input.load_on(backend), cap)
        else {
            continue;
        };
        let guard = if cap.is_some() {
            guard.waking(gw.queue.clone())
        } else {
            guard
        };
        let cached = input.cached_on(backend);
        let adapter = input.adapter.as_deref();
        return Some(Claimed {
            idx,
            guard,
            queued,
            cached,
            _adapter: adapter.map(|a| backend.state.adapters().begin(a)),
        });
    }
    None
}

/// Pick a backend; when every untried routable candidate is at its concurrency cap, wait in the
/// gateway's fair queue (by tenant) for a slot, up to `queue.timeout`. `Ok(None)`: nothing is
/// routable (or all were tried); `Err`: the queue is full or the wait timed out (503 +
/// `Retry-After`).
async fn pick_or_wait(
    gw: &Gateway,
    config: &crate::config::Config,
    policy: crate::config::PolicyKind,
    candidates: &[(Arc<crate::fleet::Backend>, String)],
    tried: &[usize],
    input: &RouteInput,
    tenant: &str,
) -> Result<Option<Claimed>, ApiError> {
    use crate::fleet::queue::QueueError;
    use crate::routing::Router;
    if let Some(c) = pick_and_claim(gw, config, policy, candidates, tried, input) {
        return Ok(Some(c));
    }
    if !Router::saturated(candidates, tried) {
        return Ok(None);
    }
    let q = config.queue;
    let started = Instant::now();
    let deadline = tokio::time::Instant::now() + q.timeout;
    let refuse = |reason: &'static str, why: QueueError| {
        metrics::counter!(m::QUEUE_REJECTIONS_TOTAL, "reason" => reason).increment(1);
        metrics::gauge!(m::QUEUE_DEPTH).set(gw.queue.len() as f64);
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            format!(
                "Every backend for this model is at its concurrency limit ({why}). Please retry."
            ),
        )
        .with_code(if reason == "full" {
            "queue_full"
        } else {
            "queue_timeout"
        })
        .with_retry_after(NO_BACKEND_RETRY_AFTER)
    };
    let mut ticket = match gw.queue.enter(tenant, 1.0, q.size) {
        Ok(t) => t,
        Err(e) => return Err(refuse("full", e)),
    };
    metrics::gauge!(m::QUEUE_DEPTH).set(gw.queue.len() as f64);
    for _ in 0..MAX_QUEUE_ROUNDS {
        if let Err(e) = ticket.wait(deadline, QUEUE_RECHECK).await {
            drop(ticket);
            metrics::histogram!(m::QUEUE_WAIT_SECONDS, "outcome" => "timeout")
                .record(started.elapsed().as_secs_f64());
            return Err(refuse("timeout", e));
        }
        if let Some(c) = pick_and_claim(gw, config, policy, candidates, tried, input) {
            drop(ticket);
            metrics::gauge!(m::QUEUE_DEPTH).set(gw.queue.len() as f64);
            metrics::histogram!(m::QUEUE_WAIT_SECONDS, "outcome" => "routed")
                .record(started.elapsed().as_secs_f64());
            return Ok(Some(c));
        }
        if !Router::saturated(candidates, tried) {
            return Ok(None);
        }
    }
    Err(refuse("timeout", QueueError::Timeout))
}

/// Move the record out (into a [`Settle`] or to be finished now). After this, `proxy` must not
/// return `Err`, because `handle` finishes the record of a failed request itself.
fn take_record(record: &mut AccessRecord) -> AccessRecord {
    let blank = AccessRecord::new(String::new(), record.endpoint, record.started);
    std::mem::replace(record, blank)
}

fn finish_record(record: &mut AccessRecord) {
    let taken = take_record(record);
    taken.finish();
}

/// A backend's response body ([`Incoming`]; generic so the classification can be driven
/// without a connection).
trait UpstreamBody: http_body::Body<Data = Bytes, Error: std::fmt::Display> + Unpin {}
impl<B: http_body::Body<Data = Bytes, Error: std::fmt::Display> + Unpin> UpstreamBody for B {}

/// Read a body up to `limit` bytes, allowing at most `idle` between frames and ending by
/// `deadline`.
async fn read_capped<B: UpstreamBody>(
    body: B,
    limit: usize,
    idle: Duration,
    deadline: tokio::time::Instant,
) -> Result<Bytes, String> {
    let mut body = body;
    let mut buf = bytes::BytesMut::new();
    loop {
        let until = deadline.min(tokio::time::Instant::now() + idle);
        match tokio::time::timeout_at(until, body.frame()).await {
            Err(_) if until == deadline => return Err("not complete in time".to_string()),
            Err(_) => return Err(format!("no data for {idle:?}")),
            Ok(None) => return Ok(buf.freeze()),
            Ok(Some(Err(e))) => return Err(e.to_string()),
            Ok(Some(Ok(frame))) => {
                if let Ok(data) = frame.into_data() {
                    if buf.len() + data.len() > limit {
                        return Err(format!("response larger than {limit} bytes"));
                    }
                    buf.extend_from_slice(&data);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet::Health;

    #[test]
    fn statuses_retry_or_answer_busy_or_failing() {
        use Said::*;
        // (status, retry while attempts are left, retry on the last attempt, what it says)
        let cases = [
            (200, false, false, Working),
            (201, false, false, Working),
            (400, false, false, Working),
            (401, false, false, Working),
            (404, false, false, Working),
            (413, false, false, Working),
            (422, false, false, Working),
            (429, true, false, Busy),
            (500, false, false, Failing),
            (501, false, false, Failing),
            (502, true, false, Failing),
            (503, true, false, Busy),
            (504, true, false, Failing),
        ];
        for (code, retry, retry_last, said) in cases {
            let status = StatusCode::from_u16(code).unwrap();
            assert_eq!(judge(status, true), (retry, said), "{code}");
            assert_eq!(judge(status, false), (retry_last, said), "{code} (last)");
        }
    }

    #[test]
    fn failures_without_a_head_are_502_or_504() {
        let timeout = transport_failure("b", &AttemptError::Timeout(Duration::from_secs(2)));
        assert_eq!(
            (timeout.status, timeout.code.as_deref()),
            (StatusCode::GATEWAY_TIMEOUT, Some("backend_timeout"))
        );
        for (e, label) in [
            (AttemptError::Connect("refused".into()), "connect"),
            (AttemptError::Transport("reset".into()), "transport"),
            (AttemptError::Build("uri".into()), "build"),
        ] {
            let err = transport_failure("b", &e);
            assert_eq!(err.status, StatusCode::BAD_GATEWAY);
            assert_eq!(err.message, format!("Backend `b` failed: {label}"));
        }
    }

    /// A config with one vLLM backend, and that backend.
    fn one_backend() -> (Config, Arc<Backend>) {
        let config = crate::config::from_str(
            "[[backends]]\nname = \"b\"\nkind = \"vllm\"\nurl = \"http://127.0.0.1:9\"\nmodels = [\"m\"]\napi_key = \"sk-be\"\n",
            "t",
        )
        .unwrap();
        let backend = Arc::new(Backend::new(
            config.backends[0].clone(),
            Arc::new(crate::fleet::BackendState::new()),
        ));
        (config, backend)
    }

    fn answer(code: u16, body: &'static str) -> Result<http::Response<Full<Bytes>>, AttemptError> {
        Ok(http::Response::builder()
            .status(code)
            .header("retry-after", "7")
            .body(Full::new(Bytes::from_static(body.as_bytes())))
            .unwrap())
    }

    async fn run(
        sent: Result<http::Response<Full<Bytes>>, AttemptError>,
        retries_left: bool,
    ) -> (Result<StatusCode, ApiError>, Health) {
        let (config, backend) = one_backend();
        let record = AccessRecord::new("r".into(), "chat", Instant::now());
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        let verdict = classify(&config, &backend, sent, retries_left, deadline, &record).await;
        (verdict.map(|r| r.status()), backend.state.health())
    }

    #[tokio::test]
    async fn one_classification_of_an_attempt() {
        // A busy answer goes elsewhere with the backend's error, and the backend is overloaded.
        let (verdict, health) = run(answer(429, r#"{"error":"slow down sk-be"}"#), true).await;
        let err = verdict.unwrap_err();
        assert_eq!(err.status, StatusCode::TOO_MANY_REQUESTS);
        assert!(!err.message.contains("sk-be"), "{}", err.message);
        assert_eq!(health, Health::Overloaded);
        // The same on the last attempt is the client's answer; the backend is still busy.
        let (verdict, health) = run(answer(503, "busy"), false).await;
        assert_eq!(verdict.unwrap(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(health, Health::Overloaded);
        // A failing answer goes elsewhere but does not make the backend overloaded.
        let (verdict, health) = run(answer(502, "bad"), true).await;
        assert_eq!(verdict.unwrap_err().status, StatusCode::BAD_GATEWAY);
        assert_ne!(health, Health::Overloaded);
        // Answers the client gets as they are: success, client errors, other server errors.
        for code in [200, 400, 404, 500] {
            let (verdict, health) = run(answer(code, "{}"), true).await;
            assert_eq!(verdict.unwrap().as_u16(), code);
            assert_ne!(health, Health::Overloaded, "{code}");
        }
        // No head: always elsewhere, even on the last attempt; a failure, never "busy".
        let refused = Err(AttemptError::Connect("refused".into()));
        let (verdict, health) = run(refused, false).await;
        assert_eq!(verdict.unwrap_err().status, StatusCode::BAD_GATEWAY);
        assert_ne!(health, Health::Overloaded);
        let timeout = Err(AttemptError::Timeout(Duration::from_secs(1)));
        let (verdict, _) = run(timeout, true).await;
        assert_eq!(verdict.unwrap_err().status, StatusCode::GATEWAY_TIMEOUT);
    }
}
