//! The respond phase: the answering backend's response goes to the client — its error
//! normalised and shaped by the client API, its stream through the observer, or its whole
//! answer read — and the answer when no attempt got one ([`no_answer`]).
//!
//! Invariants: the answer is committed — from here on nothing is retried (a broken stream may
//! only be continued, [`super::resume`]); every byte of a stream reaches the client as it
//! arrives; an answer whose body cannot be passed on becomes the one clean 502.

use std::sync::Arc;

use axum::body::Body;
use axum::response::Response;
use http::{header, HeaderMap, HeaderValue, StatusCode};
use http_body_util::Full;

use super::attempt::{read_capped, Answer, MAX_ERROR_BODY};
use super::headers::{self, is_sse};
use super::observe::{self, ObservedStream};
use super::pick::NO_BACKEND_RETRY_AFTER;
use super::prepare::Prepared;
use super::settlement::{finish_record, settlement};
use super::{resume, translated};
use crate::api::translate::Reply;
use crate::api::{ClientApi, Edits};
use crate::config::{BackendKind, Config};
use crate::fleet::Backend;
use crate::openai::error::{from_backend_redacted, insert_retry_after};
use crate::openai::ApiError;
use crate::settle::Settle;
use crate::telemetry::access::AccessRecord;
use crate::upstream::retry_after;
use crate::upstream::Body as Incoming;

/// Answer the client from the backend that answered: its error normalised, its stream through
/// the observer, or its whole answer read. From here on nothing is retried.
pub(super) async fn respond(
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
        let (deadline, cached) = (answer.body_deadline, claimed.cached);
        return error_answer(
            config,
            p,
            backend,
            (status, parts.headers, upstream),
            deadline,
            cached,
            record,
        )
        .await;
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

/// A backend's error answer, normalised (its key redacted) and shaped by the client API, with
/// its `Retry-After`, the limit headers and the routing headers.
async fn error_answer(
    config: &Config,
    p: &Prepared,
    backend: &Backend,
    (status, headers, upstream): (StatusCode, HeaderMap, Incoming),
    body_deadline: tokio::time::Instant,
    cached: Option<u64>,
    record: &mut AccessRecord,
) -> Response {
    let idle = backend.config.timeouts.idle;
    let err_body = read_capped(upstream, MAX_ERROR_BODY, idle, body_deadline)
        .await
        .unwrap_or_default();
    let err = from_backend_redacted(status, &err_body, backend.config.api_key.as_deref());
    let mut response = p.api.error_response(err);
    if let Some(after) = retry_after(&headers) {
        insert_retry_after(response.headers_mut(), after);
    }
    response.headers_mut().extend(p.limit_headers.clone());
    routing_headers(config, backend, cached, response.headers_mut());
    record.error = Some(format!("backend_{}", status.as_u16()));
    finish_record(record);
    response
}

/// The edits the client's answer needs: its model name back, forced usage dropped, and TGI's
/// empty id and `stop_sequence` finish reason made OpenAI's.
pub(super) fn answer_edits(
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
pub(super) fn routing_headers(
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

/// A successful answer on its way out: status, headers, the backend's body, its edits, and the
/// settlement that runs when it is over.
pub(super) type AnswerParts = (StatusCode, HeaderMap, Incoming, Edits, Settle);

/// Stream the answer through the observer (usage and first token on the side); a translated
/// chat stream is put back into the client API's events first.
pub(super) fn stream_answer(
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
pub(super) async fn whole_answer(
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
    // (read with the usage, in the same pass: no second parse for the trace's finish reason)
    let said = match api.whole(&whole) {
        Ok(said) => said,
        // Not JSON (garbage, NDJSON, a cut body): the client gets a clean 502, not the bytes.
        Err(e) => {
            let why = format!("sent an answer that is not JSON ({e}).");
            let label = "backend_invalid_body";
            return broken_answer(config, api, backend, settle, "invalid body", label, &why);
        }
    };
    (settle.usage, settle.finish) = (said.usage, said.finish);
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
pub(super) fn broken_answer(
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
pub(super) fn no_answer(last_failure: Option<ApiError>, p: Prepared) -> ApiError {
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
