//! Calls on one stored object by its id (`GET`/`DELETE /v1/responses/{id}`,
//! `POST /v1/responses/{id}/cancel`): sent to the one backend the id names, never to another.
//!
//! The request's API decodes the id ([`ClientApi::locate`]); an id it did not issue, or one of
//! another tenant, gets its not-found answer without reaching any backend. A holder that left
//! the fleet gets the "gone" answer, one that cannot be reached the "unavailable" one (503
//! with `Retry-After`); whatever the holder answers is passed on, with its ids put back into
//! the client's form. Nothing here is retried elsewhere: no other backend has the object.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::response::Response;
use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::Full;

use super::{headers, read_capped, MAX_ERROR_BODY};
use crate::api::{ClientApi, Edits, Pin};
use crate::fleet::Backend;
use crate::gateway::Gateway;
use crate::openai::error::from_backend_redacted;
use crate::openai::ApiError;
use crate::telemetry::access::AccessRecord;

/// Which call on the stored object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Call {
    Get,
    Delete,
    Cancel,
}

impl Call {
    fn method(self) -> Method {
        match self {
            Call::Get => Method::GET,
            Call::Delete => Method::DELETE,
            Call::Cancel => Method::POST,
        }
    }

    fn suffix(self) -> &'static str {
        match self {
            Call::Cancel => "/cancel",
            Call::Get | Call::Delete => "",
        }
    }
}

/// Handle one call on the stored object `id` of `api`.
pub async fn handle(
    gw: Arc<Gateway>,
    api: &'static dyn ClientApi,
    call: Call,
    id: String,
    req: Request<Body>,
) -> Response {
    let started = Instant::now();
    let request_id = crate::telemetry::access::request_id(req.headers());
    let mut record = AccessRecord::new(request_id, api.label(), started);
    let result = forward(&gw, api, call, &id, req, &mut record).await;
    let response = result.unwrap_or_else(|err| {
        record.error = Some(err.label().to_string());
        api.error_response(err)
    });
    record.status = response.status().as_u16();
    record.finish();
    response
}

async fn forward(
    gw: &Gateway,
    api: &'static dyn ClientApi,
    call: Call,
    id: &str,
    req: Request<Body>,
    record: &mut AccessRecord,
) -> Result<Response, ApiError> {
    let rt = gw.runtime();
    let identity = rt.keys.authenticate(req.headers())?;
    record.tenant = identity.tenant.clone();
    let pin = api.locate(id, &identity.tenant)?;
    let backend = rt
        .fleet
        .backends()
        .iter()
        .find(|b| pin.holds(b.name()) && api.native(b.kind()))
        .cloned()
        .ok_or_else(|| pin.gone())?;
    if !api.keeps_state(backend.kind()) {
        return Err(pin.not_stored(backend.name()));
    }
    record.backend = Some(backend.name().to_string());
    record.attempts = 1;
    let path = format!("{}/{}{}", api.path(), pin.backend_id, call.suffix());
    let headers = headers::upstream_headers(
        req.headers(),
        &record.request_id,
        backend.config.api_key.as_deref(),
    );
    let timeout = backend.config.timeouts.response;
    let deadline = tokio::time::Instant::now() + timeout;
    let sent = crate::upstream::send_method(
        backend.as_ref(),
        call.method(),
        &path,
        headers,
        Bytes::new(),
        timeout,
    )
    .await;
    let resp = sent.map_err(|e| {
        tracing::warn!(request_id = %record.request_id, backend = backend.name(), "stored call failed: {e}");
        pin.unavailable(backend.name())
    })?;
    let status = resp.status();
    let (parts, body) = resp.into_parts();
    let limit = rt.config.server.max_response_bytes.max(MAX_ERROR_BODY);
    let idle = backend.config.timeouts.idle;
    let body = read_capped(body, limit, idle, deadline)
        .await
        .map_err(|_| pin.unavailable(backend.name()))?;
    if !status.is_success() {
        return Err(backend_error(&backend, &pin, status, &body));
    }
    let edits = Edits {
        issue_ids: api
            .issued_ids(backend.name(), &identity.tenant)
            .map(Arc::from),
        redact: backend.config.api_key.as_deref().map(Arc::from),
        ..Edits::default()
    };
    let body = api.edit(&body, &edits).unwrap_or(body);
    let body = super::observe::Redactor::new(edits.redact.as_deref()).apply(body);
    let mut response = Response::new(Body::new(Full::new(body)));
    *response.status_mut() = status;
    *response.headers_mut() = headers::downstream_headers(&parts.headers);
    Ok(response)
}

/// The holder's refusal: its not-found is the client id's not-found (it lost the object, e.g.
/// on a restart); a busy or failing holder is "unavailable"; anything else (405 where the
/// engine has no such call, 400 cancelling a response that is not in the background) is its
/// own answer.
fn backend_error(backend: &Backend, pin: &Pin, status: StatusCode, body: &[u8]) -> ApiError {
    match status.as_u16() {
        404 => pin.not_found(),
        502..=504 => pin.unavailable(backend.name()),
        _ => from_backend_redacted(status, body, backend.config.api_key.as_deref()),
    }
}
