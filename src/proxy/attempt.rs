//! The attempt phase: one send of the request to a claimed backend (and with `routing.hedge`
//! a copy to a second one), waiting for its head ([`super::rescue`]), and THE classification of
//! what came back ([`classify`]): retry elsewhere, or answer.
//!
//! Invariants: nothing has been sent to the client, so a retry is still safe; what an answer
//! says about its backend (busy, failing, working) is recorded on the backend once, here; a
//! backend's error body is read capped and redacted of its key before it can reach a client.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http::StatusCode;
use http_body_util::BodyExt;

use super::pick::{pick_and_claim, Claimed};
use super::prepare::Prepared;
use super::{adapter, rescue};
use crate::api::translate::Reply;
use crate::config::Config;
use crate::fleet::Backend;
use crate::gateway::Gateway;
use crate::openai::edit;
use crate::openai::error::from_backend_redacted;
use crate::openai::ApiError;
use crate::telemetry::access::AccessRecord;
use crate::telemetry::metrics as m;
use crate::telemetry::otel::{Phase, RequestTrace};
use crate::upstream::Body as Incoming;
use crate::upstream::{retry_after, retryable_status, AttemptError};
use opentelemetry::KeyValue;

/// Largest error body read from a backend to normalise it.
pub(super) const MAX_ERROR_BODY: usize = 256 * 1024;

/// How an attempt ended: what [`classify`] decided. (It lives for one match on the attempt's
/// stack: boxing the answer would cost an allocation per request.)
#[allow(clippy::large_enum_variant)]
pub(super) enum Verdict {
    /// Try another backend; the client gets this failure if none is left.
    Retry(ApiError),
    /// Answer the client from this backend.
    Answer(Answer),
    /// What the request needs cannot be had on any backend: the client's answer.
    Refuse(ApiError),
}

/// A backend's answer that goes to the client, with what the response phase needs of its send.
pub(super) struct Answer {
    pub(super) resp: http::Response<Incoming>,
    /// The backend that answered, with its slot.
    pub(super) claimed: Claimed,
    /// Since the request arrived, when it was sent to this backend.
    pub(super) sent_after: Duration,
    /// A non-streamed answer (or an error body) must be complete by then.
    pub(super) body_deadline: tokio::time::Instant,
    /// Sluice forced stream usage: the observer drops it before it reaches the client.
    pub(super) strip_usage: bool,
    /// The answer is a chat completion to be put back into the client API's shape.
    pub(super) reply: Option<std::sync::Arc<dyn Reply>>,
}

/// One attempt on the claimed backend (already in `tried`), and with hedging a copy on a
/// second one: send, wait for a head — withdrawn when the backend fails, hedged at the hang
/// deadline — and classify. The first copy whose head is an answer wins; the other is dropped.
pub(super) async fn attempt(
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
                let status = sent.as_ref().ok().map(|r| r.status().as_u16());
                match classify(config, backend, sent, retries_left, deadline, record).await {
                    Ok(resp) => {
                        copy.end_span(tried.len(), "answered", status, None);
                        rescue::cancel(p, &copies);
                        return Verdict::Answer(copy.answer(resp));
                    }
                    Err(failure) => {
                        copy.end_span(tried.len(), "retried", status, Some(failure.label()));
                        last = Some(failure);
                    }
                }
            }
            rescue::Waited::Withdrawn(health) => {
                let copy = copies.swap_remove(i);
                let backend = &p.resolved.candidates[copy.claimed.idx].0;
                copy.end_span(tried.len(), "rescued", None, Some(health.as_str()));
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

/// An attempt's span: the backend, its address, the model name it was sent, whether it is a
/// hedged copy.
pub(super) fn attempt_span(
    trace: &RequestTrace,
    backend: &Backend,
    model: &str,
    hedge: bool,
) -> Phase {
    let span = trace.phase("sluice.attempt");
    let url = &backend.config.url;
    let port = url.port_u16().unwrap_or(match url.scheme_str() {
        Some("https") => 443,
        _ => 80,
    });
    span.set(|| {
        [
            KeyValue::new("sluice.backend", backend.name().to_string()),
            KeyValue::new("sluice.backend.kind", backend.kind().as_str()),
            KeyValue::new("server.address", url.host().unwrap_or_default().to_string()),
            KeyValue::new("server.port", i64::from(port)),
            KeyValue::new("gen_ai.request.model", model.to_string()),
            KeyValue::new("sluice.hedge", hedge),
        ]
    });
    span
}

/// End an attempt's span: its number, how it ended (`answered`, `retried`, `rescued`,
/// `cancelled`), the backend's status and why it was not the answer (`error.type` too).
pub(super) fn end_attempt_span(
    span: &Phase,
    attempt: usize,
    outcome: &'static str,
    status: Option<u16>,
    why: Option<&str>,
) {
    span.set(|| {
        [
            KeyValue::new("sluice.attempt", attempt as i64),
            KeyValue::new("sluice.attempt.outcome", outcome),
        ]
    });
    if let Some(status) = status {
        span.set(|| {
            [KeyValue::new(
                "http.response.status_code",
                i64::from(status),
            )]
        });
    }
    if let Some(why) = why {
        span.set(|| [KeyValue::new("sluice.retry.reason", why.to_string())]);
        span.fail(why);
    }
    span.end();
}

/// The second copy of a request at its hang deadline, with `routing.hedge`: the next-best
/// untried backend with a free slot, while attempts and the failover deadline allow.
pub(super) fn hedge(
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
pub(super) fn rewrite(p: &Prepared, backend_model: &str) -> (Bytes, bool) {
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
pub(super) enum Said {
    /// 429/503: skipped for its `Retry-After` (or a doubling backoff), shown `overloaded`.
    Busy,
    /// Another 5xx: counts towards its ejection.
    Failing,
    /// Anything else, 4xx included: the backend works.
    Working,
}

/// The classification of a backend's status: whether the request goes to another backend
/// (a retryable status while attempts are left), and what it says about the backend.
pub(super) fn judge(status: StatusCode, retries_left: bool) -> (bool, Said) {
    let said = match status.as_u16() {
        429 | 503 => Said::Busy,
        _ if status.is_server_error() => Said::Failing,
        _ => Said::Working,
    };
    (retryable_status(status) && retries_left, said)
}

/// The failure a send that got no response head leaves for the client.
pub(super) fn transport_failure(backend: &str, e: &AttemptError) -> ApiError {
    match e {
        AttemptError::Timeout(d) => ApiError::timeout(&format!("no response within {d:?}")),
        other => ApiError::bad_gateway(format!("Backend `{backend}` failed: {}", other.label())),
    }
}

/// The one classification of what an attempt got back: `Err` (retry elsewhere with this
/// failure: no head, or a retryable status while attempts are left) or `Ok` (answer the
/// client). Records what it says about the backend's health.
pub(super) async fn classify<B: UpstreamBody>(
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

/// A backend's response body ([`Incoming`]; generic so the classification can be driven
/// without a connection).
pub(super) trait UpstreamBody:
    http_body::Body<Data = Bytes, Error: std::fmt::Display> + Unpin
{
}

impl<B: http_body::Body<Data = Bytes, Error: std::fmt::Display> + Unpin> UpstreamBody for B {}

/// Read a body up to `limit` bytes, allowing at most `idle` between frames and ending by
/// `deadline`.
pub(super) async fn read_capped<B: UpstreamBody>(
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
    use std::sync::Arc;

    use http_body_util::Full;

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
