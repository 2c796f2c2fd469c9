//! Sending one attempt to one backend and classifying what came back.
//!
//! An attempt ends in one of three ways: a response head (any status), a failure before any
//! response byte (connect error, reset, time-to-first-byte timeout) — which is always safe to
//! retry elsewhere, because nothing has reached the client — or the caller's deadline.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, Request, StatusCode, Uri};

use super::{ThreadClient, UpstreamResponse};

/// Where an attempt goes: a backend as the upstream client sees it.
pub trait Target {
    /// The URL of `path` (e.g. `/v1/chat/completions`) on this backend.
    fn url_for(&self, path: &str) -> Result<Uri, http::Error>;
    /// The client (connection pool) to send with from this thread.
    fn client(&self) -> &ThreadClient;
}

impl<T: Target + ?Sized> Target for std::sync::Arc<T> {
    fn url_for(&self, path: &str) -> Result<Uri, http::Error> {
        (**self).url_for(path)
    }

    fn client(&self) -> &ThreadClient {
        (**self).client()
    }
}

/// Why an attempt produced no response head.
#[derive(Debug, thiserror::Error)]
pub enum AttemptError {
    #[error("could not connect: {0}")]
    Connect(String),
    #[error("connection failed before the response: {0}")]
    Transport(String),
    #[error("no response head within {0:?}")]
    Timeout(Duration),
    #[error("invalid upstream request: {0}")]
    Build(String),
}

impl AttemptError {
    /// Low-cardinality label.
    pub fn label(&self) -> &'static str {
        match self {
            AttemptError::Connect(_) => "connect",
            AttemptError::Transport(_) => "transport",
            AttemptError::Timeout(_) => "timeout",
            AttemptError::Build(_) => "build",
        }
    }
}

/// Whether a backend's status means "try another backend" (when nothing was sent yet).
pub fn retryable_status(status: StatusCode) -> bool {
    matches!(status.as_u16(), 429 | 502 | 503 | 504)
}

/// Send `body` to `path` on `backend`, waiting at most `timeout` for the response head.
pub async fn send<T: Target + ?Sized>(
    backend: &T,
    path: &str,
    headers: HeaderMap,
    body: Bytes,
    timeout: Duration,
) -> Result<UpstreamResponse, AttemptError> {
    send_method(backend, Method::POST, path, headers, body, timeout).await
}

/// [`send`] with another method (`GET`, `DELETE` of a stored object).
pub async fn send_method<T: Target + ?Sized>(
    backend: &T,
    method: Method,
    path: &str,
    headers: HeaderMap,
    body: Bytes,
    timeout: Duration,
) -> Result<UpstreamResponse, AttemptError> {
    let uri = backend
        .url_for(path)
        .map_err(|e| AttemptError::Build(e.to_string()))?;
    let mut req = Request::builder()
        .method(method)
        .uri(uri)
        .body(body)
        .map_err(|e| AttemptError::Build(e.to_string()))?;
    *req.headers_mut() = headers;
    match tokio::time::timeout(timeout, backend.client().request(req)).await {
        Err(_) => Err(AttemptError::Timeout(timeout)),
        Ok(Ok(resp)) => Ok(resp),
        Ok(Err(e)) => {
            let what = describe_client_error(&e);
            if e.is_connect() {
                Err(AttemptError::Connect(what))
            } else {
                Err(AttemptError::Transport(what))
            }
        }
    }
}

/// A readable one-line description of a client error, with its root cause.
pub fn describe_client_error(e: &(dyn std::error::Error + 'static)) -> String {
    let mut msg = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        source = s.source();
    }
    msg
}

/// Parse a backend's `Retry-After` (seconds or HTTP date), capped at 5 minutes.
pub fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    if let Some(ms) = headers
        .get("retry-after-ms")
        .and_then(|v| v.to_str().ok())
        .and_then(|s| s.trim().parse::<f64>().ok())
    {
        if ms.is_finite() && ms > 0.0 {
            return Some(Duration::from_secs_f64((ms / 1000.0).min(300.0)));
        }
    }
    let v = headers
        .get(http::header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim();
    if let Ok(secs) = v.parse::<f64>() {
        if secs.is_finite() && secs >= 0.0 {
            return Some(Duration::from_secs_f64(secs.min(300.0)));
        }
        return None;
    }
    let when = httpdate::parse_http_date(v).ok()?;
    let d = when.duration_since(std::time::SystemTime::now()).ok()?;
    Some(d.min(Duration::from_secs(300)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_forms() {
        let mut h = HeaderMap::new();
        assert_eq!(retry_after(&h), None);
        h.insert("retry-after", "2".parse().unwrap());
        assert_eq!(retry_after(&h), Some(Duration::from_secs(2)));
        h.insert("retry-after", "99999".parse().unwrap());
        assert_eq!(retry_after(&h), Some(Duration::from_secs(300)));
        h.insert("retry-after", "soon".parse().unwrap());
        assert_eq!(retry_after(&h), None);
        h.insert("retry-after-ms", "250".parse().unwrap());
        assert_eq!(retry_after(&h), Some(Duration::from_millis(250)));
        let mut h = HeaderMap::new();
        let later = std::time::SystemTime::now() + Duration::from_secs(30);
        h.insert(
            "retry-after",
            httpdate::fmt_http_date(later).parse().unwrap(),
        );
        let d = retry_after(&h).unwrap();
        assert!(d > Duration::from_secs(25) && d <= Duration::from_secs(30));
    }

    #[test]
    fn retryable() {
        for s in [429, 502, 503, 504] {
            assert!(retryable_status(StatusCode::from_u16(s).unwrap()));
        }
        for s in [200, 400, 404, 500, 501] {
            assert!(!retryable_status(StatusCode::from_u16(s).unwrap()));
        }
    }
}
