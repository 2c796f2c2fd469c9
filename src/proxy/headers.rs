//! Which headers cross the gateway.
//!
//! Towards a backend Sluice builds the request headers itself from a short allow-list, so the
//! client's `Authorization`, cookies and hop-by-hop headers never reach it; the backend's own
//! key, when configured, is added instead. Towards the client, hop-by-hop headers and those the
//! gateway recomputes (length, date, server) are dropped from the backend's response.

use http::header::{self, HeaderMap, HeaderName, HeaderValue};

/// Client headers forwarded to backends as they are.
const FORWARDED: &[&str] = &[
    "accept",
    "user-agent",
    "traceparent",
    "tracestate",
    "baggage",
    // The Anthropic SDKs' API version and beta flags, read by engines serving /v1/messages.
    "anthropic-version",
    "anthropic-beta",
];

/// Response headers never copied from a backend.
const DROPPED_FROM_BACKEND: &[HeaderName] = &[
    header::CONNECTION,
    header::TRANSFER_ENCODING,
    header::CONTENT_LENGTH,
    header::DATE,
    header::SERVER,
    header::UPGRADE,
    header::TRAILER,
    header::TE,
    header::PROXY_AUTHENTICATE,
    header::SET_COOKIE,
];

/// Headers for the upstream request.
pub fn upstream_headers(client: &HeaderMap, request_id: &str, api_key: Option<&str>) -> HeaderMap {
    let mut h = HeaderMap::with_capacity(8);
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    for name in FORWARDED {
        if let Some(v) = client.get(*name) {
            h.insert(HeaderName::from_static(name), v.clone());
        }
    }
    if let Ok(v) = HeaderValue::from_str(request_id) {
        h.insert("x-request-id", v);
    }
    if let Some(key) = api_key {
        if let Ok(mut v) = HeaderValue::from_str(&format!("Bearer {key}")) {
            v.set_sensitive(true);
            h.insert(header::AUTHORIZATION, v);
        }
    }
    h
}

/// Copy a backend's response headers that may reach the client.
pub fn downstream_headers(backend: &HeaderMap) -> HeaderMap {
    let named_by_connection: Vec<String> = backend
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|s| s.trim().to_ascii_lowercase())
        .collect();
    let mut out = HeaderMap::with_capacity(backend.len());
    for (name, value) in backend {
        if DROPPED_FROM_BACKEND.contains(name)
            || name.as_str() == "keep-alive"
            || name.as_str() == "proxy-connection"
            || named_by_connection.iter().any(|n| n == name.as_str())
        {
            continue;
        }
        out.append(name.clone(), value.clone());
    }
    out
}

/// Whether the backend answered with an event stream (a backend may answer a stream request
/// with a whole JSON body; it is then read whole).
pub fn is_sse(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.starts_with("text/event-stream"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_authorization_never_forwarded() {
        let mut c = HeaderMap::new();
        c.insert(
            header::AUTHORIZATION,
            "Bearer client-secret".parse().unwrap(),
        );
        c.insert(header::COOKIE, "a=b".parse().unwrap());
        c.insert("traceparent", "00-abc-def-01".parse().unwrap());
        let h = upstream_headers(&c, "req-1", None);
        assert!(h.get(header::AUTHORIZATION).is_none());
        assert!(h.get(header::COOKIE).is_none());
        assert_eq!(h["traceparent"], "00-abc-def-01");
        assert_eq!(h["x-request-id"], "req-1");
        let h = upstream_headers(&c, "req-1", Some("backend-key"));
        assert_eq!(h[header::AUTHORIZATION], "Bearer backend-key");
        // The Anthropic SDKs' version and beta headers reach engines serving /v1/messages.
        c.insert("anthropic-version", "2023-06-01".parse().unwrap());
        c.insert("anthropic-beta", "b1".parse().unwrap());
        let h = upstream_headers(&c, "req-1", None);
        assert_eq!(h["anthropic-version"], "2023-06-01");
        assert_eq!(h["anthropic-beta"], "b1");
    }

    #[test]
    fn hop_by_hop_dropped() {
        let mut b = HeaderMap::new();
        b.insert(header::CONNECTION, "close, x-hop".parse().unwrap());
        b.insert("x-hop", "1".parse().unwrap());
        b.insert("keep-alive", "timeout=5".parse().unwrap());
        b.insert(header::TRANSFER_ENCODING, "chunked".parse().unwrap());
        b.insert(header::CONTENT_TYPE, "text/event-stream".parse().unwrap());
        b.insert("x-compute-time", "1".parse().unwrap());
        let out = downstream_headers(&b);
        assert_eq!(out.len(), 2);
        assert!(out.contains_key("x-compute-time"));
    }
}
