//! Forwarding an inference request: the request path of DESIGN.md from "body" to "settle".
//!
//! ```text
//! auth → body (capped) → fields → allow-list → resolve model → size (estimate, or a large
//! prompt's exact count from a candidate's tokenizer) → admission → attempt loop:
//!     pick backend (all candidates at their cap → wait in the fair queue, bounded by
//!     `queue.timeout`) → rewrite (model name, include_usage) → send
//!     connect error / reset / TTFB timeout / 429 / 502 / 503 / 504  → next backend
//!     any other status → answer the client (errors normalised to OpenAI's shape)
//! → stream through [`observe::ObservedStream`] or buffer a non-streamed answer → settle
//! ```
//!
//! Invariants (see also the module docs of [`observe`] and [`crate::fleet::load`]):
//! - A request is retried on another backend only while nothing has been sent to the client;
//!   attempts are bounded by `routing.max_attempts` and `routing.failover_deadline`.
//! - The client's `Authorization` never reaches a backend (see [`headers`]).
//! - Load counters are held by guards and released on every exit path; the guard of a capped
//!   backend hands its freed slot to the next queued request.
//! - A backend's busy answer (429/503) makes it skipped for its `Retry-After` (or a doubling
//!   backoff) and `overloaded`; other retryable failures count towards its ejection.
//! - No network input can panic this code; every failure is an [`ApiError`].

pub mod headers;
pub mod observe;
pub mod sse;

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::{header, HeaderMap, HeaderValue, Request, StatusCode};
use http_body_util::{BodyExt, Full, Limited};

use crate::config::BackendKind;
use crate::fleet::LoadGuard;
use crate::gateway::{Gateway, Runtime};
use crate::openai::edit::{self, Splice};
use crate::openai::error::{from_backend_redacted, insert_retry_after};
use crate::openai::{request, ApiError, Endpoint};
use crate::routing::RouteInput;
use crate::telemetry::access::AccessRecord;
use crate::telemetry::metrics as m;
use crate::upstream::{self as forward, retry_after, retryable_status, AttemptError};
use observe::{Edits, ObservedStream, Settle};

/// Largest error body read from a backend to normalise it.
const MAX_ERROR_BODY: usize = 256 * 1024;
/// How long clients are told to wait when no backend can take their request.
const NO_BACKEND_RETRY_AFTER: Duration = Duration::from_secs(1);
/// While queued, route again at least this often (health changes free no slot).
const QUEUE_RECHECK: Duration = Duration::from_millis(50);
/// Upper bound on routing rounds of one queued request.
const MAX_QUEUE_ROUNDS: u32 = 100_000;

/// Handle one inference request end to end.
pub async fn handle(gw: Arc<Gateway>, endpoint: Endpoint, req: Request<Body>) -> Response {
    let started = Instant::now();
    let request_id = crate::telemetry::access::request_id(req.headers());
    let mut record = AccessRecord::new(request_id, endpoint.label(), started);
    let rt = gw.runtime();
    // (the connection's service puts the request id on the response, as on every response)
    match proxy(&gw, &rt, endpoint, req, &mut record).await {
        Ok(resp) => resp,
        Err(err) => {
            record.status = err.status.as_u16();
            record.error = Some(err.label().to_string());
            record.finish();
            err.into_response()
        }
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

async fn proxy(
    gw: &Gateway,
    rt: &Runtime,
    endpoint: Endpoint,
    req: Request<Body>,
    record: &mut AccessRecord,
) -> Result<Response, ApiError> {
    let config = &rt.config;
    let identity = rt.keys.authenticate(req.headers())?;
    record.tenant = identity.tenant.clone();
    check_content_type(req.headers())?;
    let (client_headers, body) = read_body(req, config.server.max_body_bytes).await?;
    let fields = request::parse(endpoint, &body)?;
    record.stream = fields.stream;

    if !identity.allows(&rt.fleet, &fields.model) {
        return Err(crate::auth::model_refused(
            &fields.model,
            config.hide_disallowed_models,
        ));
    }
    let resolved = rt
        .fleet
        .resolve(&fields.model)
        .ok_or_else(|| ApiError::model_not_found(&fields.model))?;
    record.model = resolved.canonical.clone();

    let policy = resolved.policy.unwrap_or(config.routing.policy);
    // Expected size: the prompt's exact count for a large prompt when a candidate's tokenizer
    // answers in time, else the estimate corrected by what this model's responses reported;
    // plus max_tokens or, when absent, the model's learned average output.
    let shapes = gw.router.shapes.clone();
    let corrected = shapes.corrected_prompt(&resolved.canonical, fields.prompt_tokens_estimate);
    let exact = match config.routing.tokenize_above {
        above if above > 0 && corrected >= above => crate::fleet::tokenize::count(
            &resolved.candidates,
            endpoint,
            body.get(fields.prompt_span.clone()).unwrap_or_default(),
            config.routing.tokenize_timeout,
        )
        .await
        .ok(),
        _ => None,
    };
    let prompt_estimate = exact.unwrap_or(corrected);
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
    let expected_tokens = prompt_estimate + fields.expected_output(default_output);
    let permit = gw
        .limits
        .admit(&identity, &resolved.canonical, expected_tokens)
        .await?;
    let limit_headers = permit.headers();
    let mut permit = Some(permit);
    let input = RouteInput {
        tokens: expected_tokens,
        prefix_hash: fields.prefix_hash,
        prompt_tokens: prompt_estimate,
        prefix_tokens,
    };
    let streaming = fields.stream && endpoint != Endpoint::Embeddings;
    let deadline = Instant::now() + config.routing.failover_deadline;
    let mut tried: Vec<usize> = Vec::new();
    let mut last_failure: Option<ApiError> = None;

    for attempt in 0..config.routing.max_attempts {
        if attempt > 0 && Instant::now() >= deadline {
            break;
        }
        let Claimed { idx, guard, queued } = match pick_or_wait(
            gw,
            config,
            policy,
            &resolved.candidates,
            &tried,
            input,
            &identity.tenant,
        )
        .await
        {
            Ok(Some(claimed)) => claimed,
            Ok(None) => break,
            Err(e) => {
                last_failure = Some(e);
                break;
            }
        };
        tried.push(idx);
        if attempt > 0 {
            metrics::counter!(m::FAILOVERS_TOTAL, "model" => resolved.canonical.clone())
                .increment(1);
        }
        let (backend, backend_model) = &resolved.candidates[idx];
        record.attempts = attempt + 1;
        record.backend = Some(backend.name().to_string());

        let mut splices: Vec<Splice> = Vec::new();
        if backend_model != &fields.model {
            splices.push(edit::rename_model(&fields, backend_model));
        }
        let inject_usage = streaming && fields.include_usage != Some(true);
        if inject_usage {
            if let Some(s) = edit::force_include_usage(&body, &fields) {
                splices.push(s);
            }
        }
        let upstream_body = edit::apply(&body, splices);
        let headers = headers::upstream_headers(
            &client_headers,
            &record.request_id,
            backend.config.api_key.as_deref(),
        );
        let timeouts = backend.config.timeouts;
        let head_timeout = if streaming {
            timeouts.first_byte
        } else {
            timeouts.response
        };
        let sent_after = record.started.elapsed();
        // A non-streamed answer (or an error body) must be complete within `timeouts.response`
        // of the send, so a backend trickling bytes just faster than `idle` cannot hold it.
        let body_deadline = tokio::time::Instant::now() + timeouts.response;
        backend.state.count_request();

        let resp = match forward::send(
            backend,
            endpoint.path(),
            headers,
            upstream_body,
            head_timeout,
        )
        .await
        {
            Ok(resp) => resp,
            Err(e) => {
                let connect = matches!(e, AttemptError::Connect(_));
                tracing::warn!(
                    request_id = %record.request_id,
                    backend = backend.name(),
                    attempt = attempt + 1,
                    "attempt failed: {e}"
                );
                m::backend_request(backend.name(), e.label());
                backend
                    .state
                    .record_live_failure(&config.health, connect, e.label());
                last_failure = Some(match e {
                    AttemptError::Timeout(d) => {
                        ApiError::timeout(&format!("no response within {d:?}"))
                    }
                    other => ApiError::bad_gateway(format!(
                        "Backend `{}` failed: {}",
                        backend.name(),
                        other.label()
                    )),
                });
                continue;
            }
        };

        let status = resp.status();
        m::backend_request(backend.name(), m::status_class(status.as_u16()));
        if retryable_status(status) && attempt + 1 < config.routing.max_attempts {
            let after = retry_after(resp.headers());
            match status.as_u16() {
                429 | 503 => backend.state.record_busy(after),
                _ => backend
                    .state
                    .record_live_failure(&config.health, false, status.as_str()),
            }
            let err_body = read_capped(
                resp.into_body(),
                MAX_ERROR_BODY,
                timeouts.idle,
                body_deadline,
            )
            .await
            .unwrap_or_default();
            last_failure = Some(from_backend_redacted(
                status,
                &err_body,
                backend.config.api_key.as_deref(),
            ));
            tracing::info!(request_id = %record.request_id, backend = backend.name(), status = status.as_u16(), "backend busy or failing; trying another");
            continue;
        }
        if matches!(status.as_u16(), 429 | 503) {
            backend.state.record_busy(retry_after(resp.headers()));
        } else if status.is_server_error() {
            backend
                .state
                .record_live_failure(&config.health, false, status.as_str());
        } else {
            backend.state.record_live_success();
        }
        record.status = status.as_u16();

        let (parts, upstream) = resp.into_parts();
        if !status.is_success() {
            let err_body = read_capped(upstream, MAX_ERROR_BODY, timeouts.idle, body_deadline)
                .await
                .unwrap_or_default();
            let mut response =
                from_backend_redacted(status, &err_body, backend.config.api_key.as_deref())
                    .into_response();
            if let Some(after) = retry_after(&parts.headers) {
                insert_retry_after(response.headers_mut(), after);
            }
            response.headers_mut().extend(limit_headers.clone());
            record.error = Some(format!("backend_{}", status.as_u16()));
            finish_record(record);
            return Ok(response);
        }

        let mut out_headers = headers::downstream_headers(&parts.headers);
        if config.routing.expose_backend_header {
            if let Ok(v) = HeaderValue::from_str(backend.name()) {
                out_headers.insert("x-sluice-backend", v);
            }
        }
        let edits = Edits {
            rename_model: (backend_model != &fields.model).then(|| fields.model.clone()),
            strip_usage: inject_usage,
            fill_id: (backend.kind() == BackendKind::Tgi)
                .then(|| id_for(endpoint, &record.request_id)),
            normalize_finish: backend.kind() == BackendKind::Tgi,
            redact: backend.config.api_key.as_deref().map(Arc::from),
        };
        out_headers.extend(limit_headers.clone());
        let mut settle = Settle::new(take_record(record));
        settle.guard = Some(guard);
        settle.prompt_estimate = fields.prompt_tokens_estimate;
        if let Some(p) = permit.take() {
            settle
                .hooks
                .push(p.with_backend(backend.name()).into_hook());
        }
        settle.hooks.push(observe::learn_hook(
            backend.clone(),
            shapes.clone(),
            resolved.canonical.clone(),
            fields.prompt_tokens_estimate,
            sent_after,
            queued,
        ));

        let is_sse = parts
            .headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|ct| ct.starts_with("text/event-stream"));
        if streaming && is_sse {
            let body = ObservedStream::new(
                upstream,
                edits,
                timeouts.idle,
                backend.clone(),
                config.health.clone(),
                settle,
            );
            let mut response = Response::new(Body::new(body));
            *response.status_mut() = status;
            *response.headers_mut() = out_headers;
            response
                .headers_mut()
                .insert("x-accel-buffering", HeaderValue::from_static("no"));
            response
                .headers_mut()
                .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
            return Ok(response);
        }

        let whole = match read_capped(
            upstream,
            config.server.max_response_bytes,
            timeouts.idle,
            body_deadline,
        )
        .await
        {
            Ok(b) => b,
            Err(e) => {
                backend
                    .state
                    .record_live_failure(&config.health, false, "body");
                settle.record.status = 502;
                settle.record.error = Some("backend_body".into());
                settle.finish();
                return Ok(ApiError::bad_gateway(format!(
                    "Backend `{}` failed while sending its answer: {e}",
                    backend.name()
                ))
                .into_response());
            }
        };
        settle.usage = match observe::whole_usage(&whole) {
            Ok(u) => u,
            Err(e) => {
                // Not JSON (garbage, NDJSON, a cut body): the client gets a clean 502, not the
                // bytes; the backend is marked as for any broken answer.
                backend
                    .state
                    .record_live_failure(&config.health, false, "invalid body");
                settle.record.status = 502;
                settle.record.error = Some("backend_invalid_body".into());
                settle.finish();
                return Ok(ApiError::bad_gateway(format!(
                    "Backend `{}` sent an answer that is not JSON ({}).",
                    backend.name(),
                    e
                ))
                .into_response());
            }
        };
        settle.complete = true;
        let whole =
            if edits.rename_model.is_some() || edits.fill_id.is_some() || edits.normalize_finish {
                observe::edit_json(&whole, &edits).unwrap_or(whole)
            } else {
                whole
            };
        let whole = observe::Redactor::new(edits.redact.as_deref()).apply(whole);
        settle.finish();
        let mut response = Response::new(Body::new(Full::new(whole)));
        *response.status_mut() = status;
        *response.headers_mut() = out_headers;
        return Ok(response);
    }

    let mut err = match last_failure {
        Some(mut e) => {
            if e.status == StatusCode::TOO_MANY_REQUESTS
                || e.status == StatusCode::SERVICE_UNAVAILABLE
            {
                e.retry_after = e.retry_after.or(Some(NO_BACKEND_RETRY_AFTER));
            }
            e
        }
        None => ApiError::no_backend(&fields.model, NO_BACKEND_RETRY_AFTER),
    };
    err.headers.extend(limit_headers);
    Err(err)
}

/// Pick a backend; when every untried routable candidate is at its concurrency cap, wait in the
/// gateway's fair queue (by tenant) for a slot, up to `queue.timeout`. `Ok(None)`: nothing is
/// routable (or all were tried); `Err`: the queue is full or the wait timed out (503 +
/// `Retry-After`).
/// The backend chosen for one attempt, with its slot already taken.
struct Claimed {
    /// Index into the request's candidates.
    idx: usize,
    /// The request's share of the backend's load (and, under a cap, its slot).
    guard: LoadGuard,
    /// Whether the request will queue inside the engine: its TTFT then says little about the
    /// backend's prefill speed.
    queued: bool,
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
    input: RouteInput,
) -> Option<Claimed> {
    for _ in 0..=candidates.len() {
        let idx = gw.router.pick(config, policy, candidates, tried, input)?;
        let (backend, backend_model) = &candidates[idx];
        let queued = crate::routing::score::would_queue(backend, backend_model);
        let cap = backend.cap();
        let Some(guard) = LoadGuard::claim(backend.state.clone(), input.load(), cap) else {
            continue;
        };
        let guard = if cap.is_some() {
            guard.waking(gw.queue.clone())
        } else {
            guard
        };
        return Some(Claimed { idx, guard, queued });
    }
    None
}

async fn pick_or_wait(
    gw: &Gateway,
    config: &crate::config::Config,
    policy: crate::config::PolicyKind,
    candidates: &[(Arc<crate::fleet::Backend>, String)],
    tried: &[usize],
    input: RouteInput,
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

/// An id for responses whose backend leaves it empty (TGI).
fn id_for(endpoint: Endpoint, request_id: &str) -> String {
    let prefix = match endpoint {
        Endpoint::Chat => "chatcmpl-",
        Endpoint::Completions => "cmpl-",
        Endpoint::Embeddings => "embd-",
    };
    format!("{prefix}{request_id}")
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

/// Read a body up to `limit` bytes, allowing at most `idle` between frames and ending by
/// `deadline`.
async fn read_capped(
    body: hyper::body::Incoming,
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
