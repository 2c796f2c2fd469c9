//! The checks around every request, run by the connection's service before and around the
//! router: the request id, the HTTP/1 framing check and the panic barrier.
//!
//! Invariants: every request carries an `x-request-id` (the client's when it is sane, else a new
//! one) in its headers by the time a handler runs, and every response carries it back; an
//! HTTP/1 request with ambiguous body framing never reaches a handler; a panic in a handler
//! becomes an OpenAI-shaped 500, is logged with the request id and counted in
//! `sluice_panics_total`, and the process keeps serving. (A panic while a streamed body is
//! being polled ends that one connection's task; tokio contains it the same way.)
//!
//! They are plain functions called in line by the service rather than router middleware: each
//! middleware layer costs every request a boxed future and a clone of the service below it.

use std::future::Future;

use axum::response::{IntoResponse, Response};
use futures_util::FutureExt;
use http::{header, HeaderValue, Request, Version};

use crate::openai::ApiError;
pub use crate::telemetry::access::{new_id, request_id};
use crate::telemetry::metrics as m;

/// Header that makes a debug build panic inside the handler, so tests can prove the barrier.
/// Release builds ignore it.
pub const TEST_PANIC_HEADER: &str = "x-sluice-test-panic";

/// Refuse an HTTP/1 request whose body framing is ambiguous: `Content-Length` together with
/// `Transfer-Encoding`, or more than one `Content-Length` (two headers or a list). hyper picks
/// one reading (chunked wins); a proxy in front of the gateway may have picked the other, which
/// is how requests are smuggled. The answer is a 400 with `Connection: close`, so the rest of
/// the bytes on that connection are never read as another request.
pub fn refuse_ambiguous_framing<B>(req: &Request<B>) -> Option<Response> {
    if req.version() >= Version::HTTP_2 {
        return None;
    }
    let h = req.headers();
    let mut lengths = h.get_all(header::CONTENT_LENGTH).iter();
    let first = lengths.next();
    let ambiguous = lengths.next().is_some()
        || first.is_some_and(|v| v.as_bytes().contains(&b','))
        || (first.is_some() && h.contains_key(header::TRANSFER_ENCODING));
    if !ambiguous {
        return None;
    }
    let mut resp = ApiError::bad_request(
        "The request has conflicting Content-Length / Transfer-Encoding headers.",
    )
    .with_code("invalid_framing")
    .into_response();
    resp.headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    Some(resp)
}

/// Run `handler` behind the panic barrier. `test_panic` (honoured by debug builds only, see
/// [`TEST_PANIC_HEADER`]) panics in its place.
pub async fn catch_panic(
    id: &str,
    test_panic: bool,
    handler: impl Future<Output = Response>,
) -> Response {
    let test_panic = cfg!(debug_assertions) && test_panic;
    let run = async move {
        if test_panic {
            panic!("deliberate panic requested by {TEST_PANIC_HEADER}");
        }
        handler.await
    };
    match std::panic::AssertUnwindSafe(run).catch_unwind().await {
        Ok(r) => r,
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            tracing::error!(request_id = %id, "handler panicked: {what}");
            metrics::counter!(m::PANICS_TOTAL).increment(1);
            ApiError::internal("The gateway hit an internal error while handling this request.")
                .into_response()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderMap;

    fn req(version: Version, headers: &[(&str, &str)]) -> Request<()> {
        let mut b = Request::builder()
            .method("POST")
            .uri("/v1/chat/completions");
        b = b.version(version);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(()).unwrap()
    }

    // hyper already refuses most of these itself (a second line of defence, should a future
    // hyper or another server in front read them differently).
    #[test]
    fn ambiguous_http1_framing_is_refused_with_close() {
        for headers in [
            &[("content-length", "5"), ("content-length", "6")][..],
            &[("content-length", "5, 5")][..],
            &[("content-length", "5"), ("transfer-encoding", "chunked")][..],
        ] {
            let refused = refuse_ambiguous_framing(&req(Version::HTTP_11, headers));
            let resp = refused.unwrap_or_else(|| panic!("{headers:?} passed"));
            assert_eq!(resp.status(), http::StatusCode::BAD_REQUEST);
            assert_eq!(resp.headers()[header::CONNECTION], "close");
        }
        for headers in [
            &[("content-length", "5")][..],
            &[("transfer-encoding", "chunked")][..],
            &[][..],
        ] {
            assert!(refuse_ambiguous_framing(&req(Version::HTTP_11, headers)).is_none());
        }
        // HTTP/2 frames its bodies itself
        let h2 = req(
            Version::HTTP_2,
            &[("content-length", "5"), ("content-length", "6")],
        );
        assert!(refuse_ambiguous_framing(&h2).is_none());
    }

    #[test]
    fn request_ids_are_the_clients_when_sane() {
        let mut h = HeaderMap::new();
        h.insert("x-request-id", HeaderValue::from_static("abc-1"));
        assert_eq!(request_id(&h), "abc-1");
        h.insert("x-request-id", HeaderValue::from_static("has space"));
        assert_eq!(request_id(&h).len(), 32);
        assert_eq!(request_id(&HeaderMap::new()).len(), 32);
    }
}
