//! The prepare phase: everything before the first attempt — auth, content type, the body
//! (read once, capped), the routed fields, the allow-list and the candidates ([`super::resolve`]),
//! the request's size, the candidates whose context window fits ([`super::context`]), admission.
//! Its product, [`Prepared`], is what every later phase and the files beside them read.
//!
//! Invariants: each step can refuse the request and none has sent anything to a backend; the
//! body is read once into memory, bounded, and never parsed into a tree; a permit, once taken,
//! travels in [`Prepared`] and gives back what it reserved on every exit path.

use std::sync::Arc;

use axum::body::Body;
use axum::response::Response;
use bytes::Bytes;
use http::{header, HeaderMap, HeaderValue, Request, StatusCode};
use http_body_util::{BodyExt, Limited};

use super::resolve::{keep_state, refused_translation, resolve, translate_if_served};
use super::{context, tokens};
use crate::api::translate::Translation;
use crate::api::{BodyForm, ClientApi, Pin};
use crate::auth::Identity;
use crate::config::{Config, PolicyKind};
use crate::fleet::make_room::Background;
use crate::fleet::speed::ModelShapes;
use crate::fleet::Resolved;
use crate::gateway::{Gateway, Runtime};
use crate::limits::Permit;
use crate::openai::{ApiError, RequestFields};
use crate::routing::RouteInput;
use crate::telemetry::access::AccessRecord;
use opentelemetry::KeyValue;

/// Everything before the first attempt: auth, content type, body, fields, allow-list,
/// resolve, size, admission. Each step can refuse the request; none has sent anything.
/// What the prepare phase leads to: a request to route, or an answer given without a backend.
pub(super) enum Step {
    Route(Box<Prepared>),
    Answered(Response),
}

/// What [`prepare`] read and decided: everything the attempts need, read once.
pub(super) struct Prepared {
    pub(super) api: &'static dyn ClientApi,
    pub(super) identity: Identity,
    pub(super) client_headers: HeaderMap,
    pub(super) body: Bytes,
    pub(super) fields: RequestFields,
    pub(super) resolved: Resolved,
    pub(super) policy: PolicyKind,
    pub(super) input: RouteInput,
    pub(super) streaming: bool,
    /// Run by the gateway in the background: it gives way, never asks ([`MakeRoom`]).
    ///
    /// [`MakeRoom`]: crate::fleet::make_room::MakeRoom
    pub(super) background: Option<Background>,
    /// The one backend that holds what the request refers to (its only candidate).
    pub(super) pin: Option<Pin>,
    /// The request translated to chat completions, for the candidates that do not speak its
    /// API natively ([`ClientApi::translator`]).
    pub(super) translation: Option<Translation>,
    pub(super) shapes: Arc<ModelShapes>,
    /// Taken by the answering attempt's settlement; dropped (refunded) when none answers.
    pub(super) permit: Option<Permit>,
    /// Where a background response's follower runs ([`background`]).
    pub(super) main: tokio::runtime::Handle,
    pub(super) limit_headers: HeaderMap,
    /// The workload trace, when `[trace]` is on.
    pub(super) trace: Option<Arc<crate::telemetry::trace::TraceWriter>>,
}

/// The model's own tokenizer answers when no candidate speaks the API, natively or by
/// translation, and the API can be answered that way (`/v1/messages/count_tokens`); `None`
/// otherwise (routing goes on, and says why nothing serves it).
pub(super) fn answer_locally(
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

pub(super) async fn prepare(
    gw: &Gateway,
    rt: &Runtime,
    api: &'static dyn ClientApi,
    req: Request<Body>,
    record: &mut AccessRecord,
) -> Result<Step, ApiError> {
    let Some(span) = record.trace.as_ref().map(|t| t.phase("sluice.admission")) else {
        return steps(gw, rt, api, req, record).await;
    };
    let step = steps(gw, rt, api, req, record).await;
    match &step {
        Ok(Step::Route(p)) => span.set(|| admitted(p)),
        Ok(Step::Answered(_)) => span.set(|| [KeyValue::new("sluice.answered_locally", true)]),
        Err(e) => span.fail(e.label()),
    }
    span.end();
    step
}

/// The admission span's attributes: who, which model, how large (never the prompt).
fn admitted(p: &Prepared) -> Vec<KeyValue> {
    let mut attrs = vec![
        KeyValue::new("sluice.tenant", p.identity.tenant.clone()),
        KeyValue::new("gen_ai.request.model", p.fields.model.clone()),
        KeyValue::new("sluice.model", p.resolved.canonical.clone()),
        KeyValue::new("sluice.prompt_tokens", p.input.prompt_tokens as i64),
        KeyValue::new("sluice.prompt_tokens_exact", p.input.prompt_exact),
        KeyValue::new("sluice.candidates", p.resolved.candidates.len() as i64),
    ];
    if let Some(max) = p.fields.max_tokens {
        attrs.push(KeyValue::new("gen_ai.request.max_tokens", max as i64));
    }
    attrs
}

/// The steps of the phase; each can refuse the request.
async fn steps(
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
    let background = req.extensions().get::<Background>().cloned();
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
    let mut input = size(config, api, &shapes, &resolved, &fields, &body).await;
    input.background = background.is_some();
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
        background,
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

/// The request's expected size for routing and admission: the prompt's token ids from the
/// model's own tokenizer when some candidate reports its cache or the prompt is large
/// (exact), else the prompt's exact count from a candidate's tokenizer for a large prompt,
/// else the estimate corrected by what this model's responses reported; plus the API's
/// expected output (`max_tokens` or, when absent, the model's learned average output).
pub(super) async fn size(
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
        background: false,
    }
}

pub(super) async fn read_body(
    req: Request<Body>,
    limit: usize,
) -> Result<(HeaderMap, Bytes), ApiError> {
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

pub(super) fn check_content_type(headers: &HeaderMap) -> Result<(), ApiError> {
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
pub(super) fn form_boundary(headers: &HeaderMap) -> Result<String, ApiError> {
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
