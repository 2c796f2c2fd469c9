//! Pass-through rules (`[[passthrough]]`): a request under `/v1/` that no client API serves is
//! forwarded as it is when a rule names its path — routed like any request by a model field of
//! its JSON body, or sent to a named group of backends — with auth, allow-lists, the body cap,
//! request and token limits, failover before the first byte, the access log and metrics
//! (endpoint `passthrough`) still applied. Without a matching rule it is the OpenAI 404, as for
//! any unknown path.
//!
//! Invariants: the path, query string and body reach the backend unchanged except the model
//! field's value, which becomes the backend's own name for the model; the answer is passed on
//! unchanged (headers filtered as for every answer). Nothing is known of the API behind the
//! path: the reservation is the body's size (about 4 bytes a token), reconciled with `usage`
//! when the answer is a whole JSON body carrying OpenAI's or the Responses API's usage, kept
//! as the charge otherwise. A key limited to some models may use only model-routed rules: a
//! group rule names no model its allow-list could admit.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::response::Response;
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use serde_json::value::RawValue;

use super::attempt::{attempt_span, classify, end_attempt_span, read_capped, MAX_ERROR_BODY};
use super::headers;
use super::pick::{pick_and_claim, Claimed};
use super::prepare::read_body;
use super::settlement::take_record;
use crate::api::{wire, Usage};
use crate::auth::Identity;
use crate::config::{Config, PassTarget, PassthroughRule};
use crate::fleet::Backend;
use crate::gateway::{Gateway, Runtime};
use crate::openai::edit::{self, Splice};
use crate::openai::ApiError;
use crate::routing::RouteInput;
use crate::settle::Settle;
use crate::telemetry::access::AccessRecord;

/// The `endpoint` label of pass-through requests.
pub const LABEL: &str = "passthrough";

/// The rule for `path`, the most specific first.
pub fn rule_for<'c>(config: &'c Config, path: &str) -> Option<&'c PassthroughRule> {
    config.passthrough.iter().find(|r| r.matches(path))
}

/// Handle one request that a rule of the current config names.
pub async fn handle(gw: Arc<Gateway>, req: Request<Body>) -> Response {
    let started = Instant::now();
    let request_id = crate::telemetry::access::request_id(req.headers());
    let mut record = AccessRecord::new(request_id, LABEL, started);
    record.client = crate::telemetry::access::client_addr(req.extensions());
    let rt = gw.runtime();
    if let Some(otel) = &rt.otel {
        // named by the rule, not the path: a path may carry ids
        if let Some(rule) = rule_for(&rt.config, req.uri().path()) {
            let name = || format!("{} {}", req.method(), rule.prefix);
            record.trace = Some(otel.request(req.headers(), record.started, name));
        }
    }
    match forward(&gw, &rt, req, &mut record).await {
        Ok(resp) => resp,
        Err(err) => {
            record.status = err.status.as_u16();
            record.error = Some(err.label().to_string());
            record.finish();
            crate::api::CHAT.error_response(err)
        }
    }
}

/// What the request goes to: the backends, each with its name for the model (empty for a
/// group), and the model's name for limits and logs.
struct Target {
    candidates: Vec<(Arc<Backend>, String)>,
    model: String,
    /// The model field's value in the body (model-routed rules).
    field: Option<std::ops::Range<usize>>,
}

async fn forward(
    gw: &Gateway,
    rt: &Runtime,
    req: Request<Body>,
    record: &mut AccessRecord,
) -> Result<Response, ApiError> {
    let config = &rt.config;
    let path = req.uri().path().to_string();
    let rule = rule_for(config, &path).ok_or_else(|| ApiError::not_found_path(&path))?;
    if !rule.methods.contains(req.method()) {
        return Err(ApiError::method_not_allowed());
    }
    let identity = rt.keys.authenticate(req.headers())?;
    record.tenant = identity.tenant.clone();
    let method = req.method().clone();
    let path_and_query = req
        .uri()
        .path_and_query()
        .map(|pq| pq.as_str().to_string())
        .unwrap_or(path);
    let (client_headers, body) = read_body(req, config.server.max_body_bytes).await?;
    let target = target(rt, rule, &identity, &body)?;
    record.model = target.model.clone();
    let tokens = (body.len() as u64).div_ceil(4);
    let permit = gw.limits.admit(&identity, &target.model, tokens).await?;
    let limit_headers = permit.headers();
    let input = RouteInput {
        tokens,
        prefix_hash: None,
        prompt_tokens: tokens,
        prefix_tokens: 0,
        prompt: None,
        prompt_exact: false,
        adapter: None,
        background: false,
    };
    let mut tried = Vec::new();
    let mut last: Option<ApiError> = None;
    for attempt_no in 0..config.routing.max_attempts {
        let policy = config.routing.policy;
        let Some(claimed) = pick_and_claim(gw, config, policy, &target.candidates, &tried, &input)
        else {
            break;
        };
        tried.push(claimed.idx);
        let (backend, backend_model) = &target.candidates[claimed.idx];
        record.attempts = attempt_no + 1;
        record.backend = Some(backend.name().to_string());
        let upstream_body = match &target.field {
            Some(span) if *backend_model != target.model => edit::apply(
                &body,
                vec![Splice {
                    span: span.clone(),
                    with: edit::json_string(backend_model),
                }],
            ),
            _ => body.clone(),
        };
        let mut headers = headers::upstream_headers(
            &client_headers,
            &record.request_id,
            backend.config.api_key.as_deref(),
        );
        if let Some(ct) = client_headers.get(http::header::CONTENT_TYPE) {
            headers.insert(http::header::CONTENT_TYPE, ct.clone());
        }
        let span = record.trace.as_ref().map(|t| {
            let span = attempt_span(t, backend, backend_model, false);
            span.inject(&mut headers);
            span
        });
        let timeouts = backend.config.timeouts;
        let deadline = tokio::time::Instant::now() + timeouts.response;
        backend.state.count_request();
        let sent = crate::upstream::send_method(
            backend.as_ref(),
            method.clone(),
            &path_and_query,
            headers,
            upstream_body,
            timeouts.first_byte,
        )
        .await;
        let retries_left = attempt_no + 1 < config.routing.max_attempts;
        let status = sent.as_ref().ok().map(|r| r.status().as_u16());
        let n = attempt_no as usize + 1;
        match classify(config, backend, sent, retries_left, deadline, record).await {
            Err(e) => {
                if let Some(span) = &span {
                    end_attempt_span(span, n, "retried", status, Some(e.label()));
                }
                last = Some(e);
            }
            Ok(resp) => {
                if let Some(span) = &span {
                    end_attempt_span(span, n, "answered", status, None);
                }
                let permit = permit.with_backend(backend.name());
                let answered = Answered {
                    resp,
                    backend: backend.clone(),
                    claimed,
                    deadline,
                };
                let mut out = respond(config, answered, permit, record).await;
                out.headers_mut().extend(limit_headers);
                return Ok(out);
            }
        }
    }
    Err(last
        .unwrap_or_else(|| ApiError::no_backend(&target.model, std::time::Duration::from_secs(1))))
}

/// The backends a request of `rule` may go to.
fn target(
    rt: &Runtime,
    rule: &PassthroughRule,
    identity: &Identity,
    body: &Bytes,
) -> Result<Target, ApiError> {
    match &rule.target {
        PassTarget::ModelField(field) => {
            let (model, span) = model_field(body, field)?;
            if !identity.allows(&rt.fleet, &model) {
                return Err(crate::auth::model_refused(
                    &model,
                    rt.config.hide_disallowed_models,
                ));
            }
            let resolved = rt
                .fleet
                .resolve(&model)
                .ok_or_else(|| ApiError::model_not_found(&model))?;
            Ok(Target {
                candidates: resolved.candidates,
                model,
                field: Some(span),
            })
        }
        PassTarget::Group { name, backends } => {
            if identity
                .config
                .as_ref()
                .is_some_and(|k| !k.models.is_empty())
            {
                return Err(ApiError::new(
                    StatusCode::FORBIDDEN,
                    "permission_error",
                    format!(
                        "This key may use only some models, and `{}` is sent to the backend \
                         group `{name}` without naming a model.",
                        rule.prefix
                    ),
                )
                .with_code("model_not_allowed"));
            }
            let candidates = rt
                .fleet
                .backends()
                .iter()
                .filter(|b| backends.iter().any(|n| n == b.name()))
                .map(|b| (b.clone(), String::new()))
                .collect();
            Ok(Target {
                candidates,
                model: format!("group:{name}"),
                field: None,
            })
        }
    }
}

/// The string value of the top-level JSON field `field` of `body` and its span.
fn model_field(body: &[u8], field: &str) -> Result<(String, std::ops::Range<usize>), ApiError> {
    let fields: BTreeMap<Cow<'_, str>, &RawValue> =
        serde_json::from_slice(body).map_err(ApiError::invalid_json)?;
    let missing = || {
        ApiError::bad_request(format!(
            "This path is routed by the body's `{field}` field, which must be a non-empty \
             string."
        ))
        .with_param(field)
    };
    let raw = fields.get(field).ok_or_else(missing)?;
    let model: String = serde_json::from_str(raw.get()).map_err(|_| missing())?;
    if model.is_empty() {
        return Err(missing());
    }
    let start = (raw.get().as_ptr() as usize)
        .checked_sub(body.as_ptr() as usize)
        .ok_or_else(missing)?;
    Ok((model, start..start + raw.get().len()))
}

/// The backend that answered, with what the response needs.
struct Answered {
    resp: http::Response<crate::upstream::Body>,
    backend: Arc<Backend>,
    claimed: Claimed,
    deadline: tokio::time::Instant,
}

/// Pass the answer on: a whole JSON answer is read (within `max_response_bytes`) for its usage;
/// anything else streams through as it comes, and the reservation is the charge.
async fn respond(
    config: &Config,
    a: Answered,
    permit: crate::limits::Permit,
    record: &mut AccessRecord,
) -> Response {
    let status = a.resp.status();
    record.status = status.as_u16();
    let mut settle = Settle::new(take_record(record));
    settle.guard = Some(a.claimed.guard);
    settle.hooks.push(permit.into_hook());
    let (parts, body) = a.resp.into_parts();
    let headers = headers::downstream_headers(&parts.headers);
    let json = parts
        .headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.starts_with("application/json"));
    if json || !status.is_success() {
        let limit = config.server.max_response_bytes.max(MAX_ERROR_BODY);
        let idle = a.backend.config.timeouts.idle;
        let bytes = match read_capped(body, limit, idle, a.deadline).await {
            Ok(b) => b,
            Err(e) => {
                settle.record.error = Some("backend_body".into());
                settle.record.status = 502;
                return crate::api::CHAT.error_response(ApiError::bad_gateway(format!(
                    "Backend `{}` did not send its whole answer: {e}",
                    a.backend.name()
                )));
            }
        };
        settle.usage = status
            .is_success()
            .then(|| wire::whole_usage(&bytes).ok().flatten())
            .flatten()
            .or_else(|| responses_usage(&bytes));
        settle.complete = status.is_success();
        settle.finish();
        let mut out = Response::new(Body::new(Full::new(bytes)));
        *out.status_mut() = status;
        *out.headers_mut() = headers;
        return out;
    }
    settle.record.stream = true;
    settle.complete = true; // nothing is read: a body that was sent is charged as reserved
    let mut out = Response::new(Body::new(Relay { body, settle }));
    *out.status_mut() = status;
    *out.headers_mut() = headers;
    out
}

/// Usage in the Responses/Anthropic form (`input_tokens`, `output_tokens`).
fn responses_usage(json: &[u8]) -> Option<Usage> {
    crate::api::RESPONSES.whole_usage(json).ok().flatten()
}

pin_project_lite::pin_project! {
    /// The backend's body on its way to the client, settling the request when it ends or is
    /// dropped.
    struct Relay {
        #[pin]
        body: crate::upstream::Body,
        settle: Settle,
    }
}

impl http_body::Body for Relay {
    type Data = Bytes;
    type Error = crate::upstream::ClientError;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        let this = self.project();
        let polled = this.body.poll_frame(cx);
        match &polled {
            std::task::Poll::Ready(None) => this.settle.run(),
            std::task::Poll::Ready(Some(Err(_))) => {
                this.settle.complete = false;
                this.settle.record.error = Some("backend_stream_interrupted".into());
                this.settle.run();
            }
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_served_list_covers_every_client_api() {
        use crate::api::*;
        let apis: &[&dyn ClientApi] = &[
            CHAT,
            COMPLETIONS,
            EMBEDDINGS,
            RESPONSES,
            MESSAGES,
            COUNT_TOKENS,
            RERANK,
            RERANK_V1,
            SCORE,
            AUDIO_TRANSCRIPTIONS,
            AUDIO_TRANSLATIONS,
            CHAT_BATCH,
            TOKENIZE,
            DETOKENIZE,
        ];
        let served = crate::config::validate::passthrough_served();
        for api in apis {
            let path = api.path();
            if path.starts_with("/v1/") {
                assert!(
                    served
                        .iter()
                        .any(|s| path == *s || path.starts_with(&format!("{s}/"))),
                    "{path} is not in the served list"
                );
            }
        }
    }

    #[test]
    fn the_model_field_is_read_with_its_span() {
        let body = br#"{"input":"x","engine":"m-1","n":2}"#;
        let (m, span) = model_field(body, "engine").unwrap();
        assert_eq!((m.as_str(), &body[span]), ("m-1", &br#""m-1""#[..]));
        for (bad, field) in [
            (&br#"{"input":"x"}"#[..], "model"),
            (br#"{"model":3}"#, "model"),
            (br#"{"model":""}"#, "model"),
            (br#"not json"#, "model"),
            (br#"[1,2]"#, "model"),
        ] {
            assert_eq!(model_field(bad, field).unwrap_err().status, 400, "{bad:?}");
        }
    }
}
