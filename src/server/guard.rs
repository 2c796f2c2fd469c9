//! The outermost layer of every request: a request id for everything that follows, and a panic
//! barrier.
//!
//! Invariants: every request carries an `x-request-id` (the client's when it is sane, else a new
//! one) in its headers by the time a handler runs, and every response carries it back; a panic
//! in a handler becomes an OpenAI-shaped 500, is logged with the request id and counted in
//! `sluice_panics_total`, and the process keeps serving. (A panic while a streamed body is
//! being polled ends that one connection's task; tokio contains it the same way.)

use axum::body::Body;
use axum::extract::Request;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use futures_util::FutureExt;
use http::{HeaderMap, HeaderValue};

use crate::openai::ApiError;
use crate::telemetry::metrics as m;

/// Header that makes a debug build panic inside the handler, so tests can prove the barrier.
/// Release builds ignore it.
pub const TEST_PANIC_HEADER: &str = "x-sluice-test-panic";

/// The client's `x-request-id` when it is sane, else a new random one.
pub fn request_id(headers: &HeaderMap) -> String {
    headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|s| !s.is_empty() && s.len() <= 128 && s.bytes().all(|b| b.is_ascii_graphic()))
        .map(str::to_string)
        .unwrap_or_else(new_id)
}

/// A random 128-bit id in hex.
pub fn new_id() -> String {
    format!("{:032x}", rand::random::<u128>())
}

/// Middleware: assign the request id, run the handler behind a panic barrier.
pub async fn request_guard(mut req: Request<Body>, next: Next) -> Response {
    let id = request_id(req.headers());
    let header = HeaderValue::from_str(&id).ok();
    if let Some(v) = &header {
        req.headers_mut().insert("x-request-id", v.clone());
    }
    let test_panic = cfg!(debug_assertions) && req.headers().contains_key(TEST_PANIC_HEADER);
    let run = async move {
        if test_panic {
            panic!("deliberate panic requested by {TEST_PANIC_HEADER}");
        }
        next.run(req).await
    };
    let mut response = match std::panic::AssertUnwindSafe(run).catch_unwind().await {
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
    };
    if let Some(v) = header {
        response.headers_mut().insert("x-request-id", v);
    }
    response
}
