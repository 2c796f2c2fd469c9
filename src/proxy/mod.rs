//! Forwarding an inference request: the request path of `docs/request-path.md`, from "body" to
//! "settle", as its phases, one file each.
//!
//! ```text
//! handle ─► prepare ([`prepare`], [`resolve`]): auth, body (capped), content type, fields,
//!           allow-list, resolve, size (estimate, or a large prompt's exact count from a
//!           candidate's tokenizer), the candidates whose context window fits ([`context`]),
//!           admission
//!        ─► attempt loop (proxy):
//!             pick ([`pick`]): a native backend first when some serve by translation; route;
//!             all candidates at their cap → the fair queue, bounded by `queue.timeout`
//!             → attempt ([`attempt`]): rewrite (model name, forced usage) → send, waiting for
//!             the head beside the backend's failure and the hang deadline ([`rescue`]:
//!             withdrawn when the backend fails; with `routing.hedge` a second copy)
//!             → classify: retry elsewhere with the failure, or answer
//!        ─► respond ([`respond`]): a backend error normalised, a stream through
//!           [`observe::ObservedStream`] (continued elsewhere if it breaks: [`resume`]), or the
//!           whole answer read; settlement built once ([`settlement`])
//!        ─► no_answer: the last failure when every attempt was spent
//! ```
//!
//! This file keeps only the sequence ([`proxy`]). What every later phase reads is the first
//! phase's product, [`prepare::Prepared`]. The files beside the phases extend one of them and
//! take what they need from it:
//! [`rescue`] and [`adapter`] the attempt, [`resume`] and [`observe`] the response,
//! [`passthrough`] and [`stored`] the pick, attempt and response of a request no client API
//! routes.
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
mod attempt;
pub mod background;
mod context;
pub mod headers;
pub mod observe;
pub mod passthrough;
mod pick;
mod prepare;
mod rescue;
mod resolve;
mod respond;
pub mod resume;
mod settlement;
pub mod sse;
pub mod stored;
mod tokens;
pub mod translated;

use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::response::Response;
use http::{HeaderMap, Request};

use crate::api::ClientApi;
use crate::gateway::{Gateway, Runtime};
use crate::openai::ApiError;
use crate::telemetry::access::AccessRecord;
use crate::telemetry::otel::{RequestTrace, Tracing};
use attempt::{attempt, Verdict};
use opentelemetry::KeyValue;
use pick::pick;
use prepare::{prepare, Step};
use respond::{no_answer, respond};
use settlement::finish_record;

/// Handle one inference request of `api` end to end.
pub async fn handle(gw: Arc<Gateway>, api: &'static dyn ClientApi, req: Request<Body>) -> Response {
    let started = Instant::now();
    let request_id = crate::telemetry::access::request_id(req.headers());
    let mut record = AccessRecord::new(request_id, api.label(), started);
    record.client = crate::telemetry::access::client_addr(req.extensions());
    let rt = gw.runtime();
    if let Some(otel) = &rt.otel {
        record.trace = Some(server_span(otel, api, req.headers(), &record));
    }
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

/// The request's server span: a child of the client's `traceparent` when it sent one.
fn server_span(
    otel: &Tracing,
    api: &dyn ClientApi,
    headers: &HeaderMap,
    record: &AccessRecord,
) -> RequestTrace {
    let trace = otel.request(headers, record.started, || format!("POST {}", api.path()));
    trace.set(|| {
        [
            KeyValue::new("gen_ai.operation.name", operation(api.label())),
            KeyValue::new("http.request.method", "POST"),
            KeyValue::new("url.path", api.path()),
            KeyValue::new("sluice.request_id", record.request_id.clone()),
        ]
    });
    trace
}

/// The GenAI conventions' `gen_ai.operation.name` of a client API (its label otherwise).
fn operation(label: &'static str) -> &'static str {
    match label {
        "chat" | "chat_batch" | "messages" | "responses" => "chat",
        "completions" => "text_completion",
        other => other,
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
        let claimed = pick(gw, config, p, &tried, record).await;
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
                let resume = resume::Continuer::for_request(
                    gw,
                    config,
                    p,
                    &tried,
                    answer.strip_usage,
                    record,
                );
                return Ok(respond(config, &mut prepared, answer, record, resume).await);
            }
        }
    }
    Err(no_answer(last_failure, prepared))
}
