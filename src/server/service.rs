//! The hyper service of one connection: each request through the request guards
//! ([`super::guard`]: id, framing, panic barrier) to the router, with its body under
//! `body_read_timeout` and its place in the connection's in-flight count held by the response
//! body.
//!
//! Invariants: every request carries its client's address ([`ClientAddr`], see
//! [`super::peers`]) in its extensions by the time a handler runs; every response carries the
//! request's `x-request-id`; a body that does not arrive in time is answered 408 (OpenAI-shaped;
//! on HTTP/1 with `connection: close`) in place of whatever the handler would have made of the
//! read error; a request leaves the in-flight count only when its response body is finished or
//! dropped.

use std::convert::Infallible;
use std::future::Future;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::response::IntoResponse;
use axum::Router;
use http::{header, HeaderValue, Request, Response, StatusCode, Version};
use hyper::body::Incoming;
use tokio::sync::Notify;
use tower::ServiceExt;

use super::activity::{Activity, InFlight};
use super::body::{TimedBody, TrackedBody};
use super::guard;
use super::peers::Peers;
use crate::config::validate::ConnectionLimits;
use crate::openai::ApiError;
use crate::telemetry::access::ClientAddr;
use crate::telemetry::metrics as m;

/// One connection's service (hyper clones it per request on HTTP/2).
#[derive(Clone)]
pub(super) struct ConnService {
    pub(super) app: Router,
    pub(super) act: Arc<Activity>,
    pub(super) limits: Arc<ConnectionLimits>,
    pub(super) listener: &'static str,
    /// The connection's peer, and the trusted proxies whose requests name their client.
    pub(super) peer: IpAddr,
    pub(super) peers: Arc<Peers>,
}

type ServiceFuture =
    Pin<Box<dyn Future<Output = Result<Response<TrackedBody>, Infallible>> + Send>>;

impl hyper::service::Service<Request<Incoming>> for ConnService {
    type Response = Response<TrackedBody>;
    type Error = Infallible;
    type Future = ServiceFuture;

    fn call(&self, mut req: Request<Incoming>) -> ServiceFuture {
        let version = req.version();
        let client = self.peers.client(self.peer, req.headers());
        req.extensions_mut().insert(ClientAddr(client));
        let mut flight = InFlight::new(
            self.act.clone(),
            self.limits.clone(),
            version == Version::HTTP_2,
        );
        let app = self.app.clone();
        let timeout = self.limits.body_read_timeout;
        let listener = self.listener;
        Box::pin(async move {
            let id = guard::request_id(req.headers());
            let id_header = HeaderValue::from_str(&id).ok();
            if let Some(v) = &id_header {
                req.headers_mut().insert("x-request-id", v.clone());
            }
            let mut response = if let Some(refused) = guard::refuse_ambiguous_framing(&req) {
                refused
            } else {
                let test_panic = req.headers().contains_key(guard::TEST_PANIC_HEADER);
                let fired = Arc::new(Notify::new());
                let broken = flight.body_broken.clone();
                let req = req.map(|b| TimedBody::new(b, timeout, fired.clone(), broken));
                let handler = async move {
                    match app.oneshot(req).await {
                        Ok(r) => r,
                        Err(never) => match never {},
                    }
                };
                tokio::select! {
                    biased;
                    r = guard::catch_panic(&id, test_panic, handler) => r,
                    () = fired.notified() => {
                        metrics::counter!(m::CLIENT_TIMEOUTS_TOTAL, "listener" => listener, "kind" => "body")
                            .increment(1);
                        body_timed_out(timeout, version)
                    }
                }
            };
            if let Some(v) = id_header {
                response.headers_mut().insert("x-request-id", v);
            }
            flight.answered = true;
            Ok(response.map(|inner| TrackedBody::new(inner, flight)))
        })
    }
}

/// The 408 for a request body that did not arrive within `timeout`; an HTTP/1 connection is
/// closed after it (the rest of the body would be read as the next request).
fn body_timed_out(timeout: Duration, version: Version) -> Response<Body> {
    let mut r = ApiError::new(
        StatusCode::REQUEST_TIMEOUT,
        "invalid_request_error",
        format!(
            "The request body did not arrive within {}.",
            humantime::format_duration(timeout)
        ),
    )
    .with_code("request_timeout")
    .into_response();
    if version < Version::HTTP_2 {
        r.headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    r
}
