//! Calls on one stored object by its id (`GET`/`DELETE /v1/responses/{id}`,
//! `POST /v1/responses/{id}/cancel`): sent to the one backend the id names, never to another.
//!
//! The request's API decodes the id ([`ClientApi::locate`]); an id it did not issue, or one of
//! another tenant, gets its not-found answer without reaching any backend. A holder that left
//! the fleet gets the "gone" answer, one that cannot be reached the "unavailable" one (503
//! with `Retry-After`); whatever the holder answers is passed on, with its ids put back into
//! the client's form. Nothing here is retried elsewhere: no other backend has the object.
//!
//! The client's query string (`?stream=true`, `starting_after`, `include[]`) is forwarded as
//! it came. A streamed answer (a background response replayed as events) is relayed event by
//! event with the ids rewritten, ending with the API's error event if the holder breaks or
//! goes idle. Each call counts as one request against the caller's requests-per-window limits;
//! it generates nothing, so no tokens are reserved or counted.

use std::sync::Arc;
use std::time::Instant;

use crate::upstream::Body as Incoming;
use axum::body::Body;
use axum::response::Response;
use bytes::{Bytes, BytesMut};
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame;

use super::attempt::{read_capped, MAX_ERROR_BODY};
use super::headers;
use super::observe::Redactor;
use super::sse::{event_data_borrowed, lines, SseScanner};
use crate::api::{ClientApi, Edits, Pin};
use crate::fleet::Backend;
use crate::gateway::{Gateway, Runtime};
use crate::openai::error::from_backend_redacted;
use crate::openai::ApiError;
use crate::telemetry::access::AccessRecord;
use opentelemetry::KeyValue;

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
    record.client = crate::telemetry::access::client_addr(req.extensions());
    let rt = gw.runtime();
    if let Some(otel) = &rt.otel {
        let name = || format!("{} {}/{{id}}", call.method(), api.path());
        record.trace = Some(otel.request(req.headers(), record.started, name));
    }
    let result = forward(&gw, &rt, api, call, &id, req, &mut record).await;
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
    rt: &Runtime,
    api: &'static dyn ClientApi,
    call: Call,
    id: &str,
    req: Request<Body>,
    record: &mut AccessRecord,
) -> Result<Response, ApiError> {
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
    let limit_headers = gw
        .limits
        .admit_request(&identity, api.label())
        .await?
        .headers();
    let holder = Holder {
        pin: &pin,
        backend,
        tenant: &identity.tenant,
    };
    let mut answer = call_holder(rt, api, call, holder, req, record)
        .await
        .map_err(|mut e| {
            e.headers.extend(limit_headers.clone());
            e
        })?;
    answer.headers_mut().extend(limit_headers);
    Ok(answer)
}

/// The stored object's holder, for a caller of `tenant`.
struct Holder<'a> {
    pin: &'a Pin,
    backend: Arc<Backend>,
    tenant: &'a str,
}

/// Send the call to the holder, with the client's query string, and pass on its answer.
async fn call_holder(
    rt: &crate::gateway::Runtime,
    api: &'static dyn ClientApi,
    call: Call,
    holder: Holder<'_>,
    req: Request<Body>,
    record: &mut AccessRecord,
) -> Result<Response, ApiError> {
    let Holder {
        pin,
        backend,
        tenant,
    } = holder;
    record.backend = Some(backend.name().to_string());
    record.attempts = 1;
    let query = req
        .uri()
        .query()
        .map(|q| format!("?{q}"))
        .unwrap_or_default();
    let path = format!("{}/{}{}{query}", api.path(), pin.backend_id, call.suffix());
    let mut headers = headers::upstream_headers(
        req.headers(),
        &record.request_id,
        backend.config.api_key.as_deref(),
    );
    let span = record.trace.as_ref().map(|t| {
        let span = t.phase("sluice.stored_lookup");
        span.set(|| {
            [
                KeyValue::new("sluice.backend", backend.name().to_string()),
                KeyValue::new("sluice.tenant", tenant.to_string()),
            ]
        });
        span.inject(&mut headers);
        span
    });
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
    if let Some(span) = span {
        match &sent {
            Ok(r) => span.set(|| {
                [KeyValue::new(
                    "http.response.status_code",
                    i64::from(r.status().as_u16()),
                )]
            }),
            Err(e) => span.fail(e.label()),
        }
        span.end();
    }
    let resp = sent.map_err(|e| {
        tracing::warn!(request_id = %record.request_id, backend = backend.name(), "stored call failed: {e}");
        pin.unavailable(backend.name())
    })?;
    let status = resp.status();
    let edits = Edits {
        issue_ids: api.issued_ids(backend.name(), tenant).map(Arc::from),
        redact: backend.config.api_key.as_deref().map(Arc::from),
        ..Edits::default()
    };
    let idle = backend.config.timeouts.idle;
    if status.is_success() && headers::is_sse(resp.headers()) {
        record.stream = true;
        let (parts, body) = resp.into_parts();
        let relay = Relay::new(api, body, edits, idle);
        let mut response = Response::new(relay.into_body());
        *response.status_mut() = status;
        *response.headers_mut() = headers::downstream_headers(&parts.headers);
        return Ok(response);
    }
    let (parts, body) = resp.into_parts();
    let limit = rt.config.server.max_response_bytes.max(MAX_ERROR_BODY);
    let body = read_capped(body, limit, idle, deadline)
        .await
        .map_err(|_| pin.unavailable(backend.name()))?;
    if !status.is_success() {
        return Err(backend_error(&backend, pin, status, &body));
    }
    let body = api.edit(&body, &edits).unwrap_or(body);
    let body = Redactor::new(edits.redact.as_deref()).apply(body);
    let mut response = Response::new(Body::new(Full::new(body)));
    *response.status_mut() = status;
    *response.headers_mut() = headers::downstream_headers(&parts.headers);
    Ok(response)
}

/// A streamed answer of the holder on its way to the client: whole events only, each one's
/// data edited (ids in the client's form, the backend's key redacted), its other lines kept.
struct Relay {
    api: &'static dyn ClientApi,
    upstream: Incoming,
    scanner: SseScanner,
    edits: Edits,
    redactor: Redactor,
    idle: std::time::Duration,
    ended: bool,
}

impl Relay {
    fn new(
        api: &'static dyn ClientApi,
        upstream: Incoming,
        edits: Edits,
        idle: std::time::Duration,
    ) -> Relay {
        Relay {
            api,
            upstream,
            scanner: SseScanner::new(),
            redactor: Redactor::new(edits.redact.as_deref()),
            edits,
            idle,
            ended: false,
        }
    }

    fn into_body(self) -> Body {
        let stream = futures_util::stream::unfold(self, |mut relay| async move {
            let chunk = relay.next_chunk().await?;
            Some((Ok::<_, std::convert::Infallible>(Frame::data(chunk)), relay))
        });
        Body::new(StreamBody::new(stream))
    }

    /// The next bytes for the client; `None` once the stream is over.
    async fn next_chunk(&mut self) -> Option<Bytes> {
        while !self.ended {
            let frame = match tokio::time::timeout(self.idle, self.upstream.frame()).await {
                Ok(Some(Ok(frame))) => frame,
                Ok(None) => {
                    self.ended = true;
                    let rest = self.scanner.take_rest();
                    return (!rest.is_empty()).then(|| self.rewrite(rest));
                }
                Ok(Some(Err(e))) => return Some(self.fail(&format!("the stream broke: {e}"))),
                Err(_) => return Some(self.fail("the stream went idle")),
            };
            let Ok(data) = frame.into_data() else {
                continue; // trailers
            };
            if let Err(e) = self.scanner.feed(&data) {
                return Some(self.fail(&e.to_string()));
            }
            let mut batch = BytesMut::new();
            while let Some(event) = self.scanner.next_event() {
                batch.extend_from_slice(&self.rewrite(event));
            }
            if !batch.is_empty() {
                return Some(self.redactor.apply(batch.freeze()));
            }
        }
        None
    }

    /// One event with its data edited; other lines (`event:`, `id:`) as they came.
    fn rewrite(&self, event: Bytes) -> Bytes {
        let Some(data) = event_data_borrowed(&event) else {
            return event;
        };
        let Some(edited) = self.api.edit(&data, &self.edits) else {
            return event;
        };
        let mut out = BytesMut::with_capacity(event.len() + 32);
        for line in lines(&event).filter(|l| !l.is_empty() && !l.starts_with(b"data")) {
            out.extend_from_slice(line);
            out.extend_from_slice(b"\n");
        }
        // one `data:` line per line of the payload (JSON may be sent over several lines)
        for line in edited.split(|b| *b == b'\n' || *b == b'\r') {
            out.extend_from_slice(b"data: ");
            out.extend_from_slice(line);
            out.extend_from_slice(b"\n");
        }
        out.extend_from_slice(b"\n");
        out.freeze()
    }

    /// End the stream with the API's error event.
    fn fail(&mut self, why: &str) -> Bytes {
        self.ended = true;
        tracing::warn!("stored response stream: {why}");
        let err = ApiError::bad_gateway(format!("The backend's stream ended abnormally: {why}."))
            .with_code("backend_stream_interrupted");
        self.api.stream_error_event(&err)
    }
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
