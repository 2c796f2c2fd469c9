//! OpenAI-shaped errors: `{"error":{"message","type","param","code"}}` with the right HTTP status.
//!
//! Every failure the gateway reports to a client passes through [`ApiError`], so the body shape,
//! the status and the `Retry-After` header are decided in one place. Backend error bodies in other
//! shapes (TGI's `{error, error_type}`, vLLM's integer `code` or pre-0.10.1 flat body, vLLM's
//! `{"error":"Unauthorized"}`) are normalised by [`from_backend`].

use std::borrow::Cow;
use std::time::Duration;

use axum::response::{IntoResponse, Response};
use http::{header, HeaderValue, StatusCode};
use serde::Serialize;
use serde_json::Value;

/// An error as a client sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type`: `invalid_request_error`, `authentication_error`, `rate_limit_error`…
    pub kind: Cow<'static, str>,
    pub param: Option<String>,
    pub code: Option<String>,
    /// Sent as `Retry-After` (whole seconds, rounded up) and `retry-after-ms`.
    pub retry_after: Option<Duration>,
    /// More headers for the answer (e.g. `x-ratelimit-*`).
    pub headers: http::HeaderMap,
}

#[derive(Serialize)]
struct Body<'a> {
    error: Inner<'a>,
}

#[derive(Serialize)]
struct Inner<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    param: Option<&'a str>,
    code: Option<&'a str>,
}

impl ApiError {
    pub fn new(
        status: StatusCode,
        kind: impl Into<Cow<'static, str>>,
        message: impl Into<String>,
    ) -> Self {
        ApiError {
            status,
            message: message.into(),
            kind: kind.into(),
            param: None,
            code: None,
            retry_after: None,
            headers: http::HeaderMap::new(),
        }
    }

    pub fn with_code(mut self, code: impl Into<String>) -> Self {
        self.code = Some(code.into());
        self
    }

    pub fn with_param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }

    pub fn with_retry_after(mut self, after: Duration) -> Self {
        self.retry_after = Some(after);
        self
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    pub fn invalid_json(detail: impl std::fmt::Display) -> Self {
        Self::bad_request(format!(
            "We could not parse the JSON body of your request: {detail}"
        ))
        .with_code("invalid_json")
    }

    pub fn model_not_found(model: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("The model `{model}` does not exist or you do not have access to it."),
        )
        .with_param("model")
        .with_code("model_not_found")
    }

    pub fn not_found_path(path: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("Unknown request URL: {path}. Please check the URL and method."),
        )
        .with_code("unknown_url")
    }

    pub fn method_not_allowed() -> Self {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "invalid_request_error",
            "Method not allowed for this URL.",
        )
        .with_code("method_not_allowed")
    }

    /// The body was refused before it was read to its end, so what is left of it is still on
    /// the connection: the answer says `connection: close`, or an HTTP/1.1 client would send
    /// its next request on a connection the server is about to close (HTTP/2 drops the header).
    pub fn payload_too_large(limit: usize) -> Self {
        let mut err = Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!("Request body exceeds the limit of {limit} bytes."),
        )
        .with_code("request_too_large");
        err.headers
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
        err
    }

    pub fn unsupported_media_type(got: &str) -> Self {
        Self::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "invalid_request_error",
            format!("Content-Type must be application/json, got `{got}`."),
        )
        .with_code("unsupported_media_type")
    }

    pub fn no_backend(model: &str, retry_after: Duration) -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            format!("No backend is available for model `{model}` right now. Please retry."),
        )
        .with_code("no_backend_available")
        .with_retry_after(retry_after)
    }

    pub fn timeout(what: &str) -> Self {
        Self::new(
            StatusCode::GATEWAY_TIMEOUT,
            "server_error",
            format!("The backend did not answer in time ({what})."),
        )
        .with_code("backend_timeout")
    }

    pub fn bad_gateway(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_GATEWAY, "server_error", message).with_code("backend_error")
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
            .with_code("internal_error")
    }

    /// The JSON body, e.g. for an SSE error event.
    pub fn body_json(&self) -> String {
        let body = Body {
            error: Inner {
                message: &self.message,
                kind: &self.kind,
                param: self.param.as_deref(),
                code: self.code.as_deref(),
            },
        };
        serde_json::to_string(&body).unwrap_or_else(|_| {
            r#"{"error":{"message":"internal error","type":"server_error","param":null,"code":null}}"#
                .to_string()
        })
    }

    /// Low-cardinality label for metrics and logs.
    pub fn label(&self) -> &str {
        self.code.as_deref().unwrap_or(&self.kind)
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status.as_u16(), self.message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, self.body_json()).into_response();
        let headers = response.headers_mut();
        headers.extend(self.headers);
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let Some(after) = self.retry_after {
            insert_retry_after(headers, after);
        }
        response
    }
}

/// `Retry-After` in whole seconds (at least 1) plus the OpenAI SDK's `retry-after-ms`.
pub fn insert_retry_after(headers: &mut http::HeaderMap, after: Duration) {
    let ms = after.as_millis().max(1);
    let secs = after.as_secs() + u64::from(after.subsec_nanos() > 0);
    headers.insert(header::RETRY_AFTER, HeaderValue::from(secs.max(1)));
    if let Ok(v) = HeaderValue::from_str(&ms.to_string()) {
        headers.insert("retry-after-ms", v);
    }
}

/// A backend's error answer as an [`ApiError`] with the backend's status and message, whatever
/// shape its body had (OpenAI's, vLLM's integer `code` or pre-0.10.1 flat body, TGI's
/// `{error, error_type}`, a bare string or plain text). Parsed once, straight into the error.
pub fn from_backend(status: StatusCode, body: &[u8]) -> ApiError {
    let fallback_type = default_type(status);
    let (message, kind, param, code) = match serde_json::from_slice::<Value>(body) {
        Err(_) => {
            let text = String::from_utf8_lossy(body);
            let text = text.trim();
            let message = if text.is_empty() {
                status
                    .canonical_reason()
                    .unwrap_or("backend error")
                    .to_string()
            } else {
                truncate(text, 2000)
            };
            (message, fallback_type.to_string(), None, None)
        }
        Ok(value) => match &value {
            Value::Object(map) => match map.get("error") {
                // OpenAI / current vLLM: {"error": {...}}
                Some(Value::Object(inner)) => (
                    string_field(inner, "message").unwrap_or_else(|| value.to_string()),
                    string_field(inner, "type").unwrap_or_else(|| fallback_type.to_string()),
                    string_field(inner, "param"),
                    code_field(inner.get("code")),
                ),
                // TGI {"error": "...", "error_type": "..."}; vLLM auth {"error": "Unauthorized"};
                // Ollama native {"error": "..."}.
                Some(Value::String(message)) => (
                    message.clone(),
                    string_field(map, "error_type").unwrap_or_else(|| fallback_type.to_string()),
                    None,
                    None,
                ),
                // vLLM before 0.10.1: {"object":"error","message":…,"type":…,"param":…,"code":400}
                _ => (
                    string_field(map, "message")
                        .unwrap_or_else(|| truncate(&value.to_string(), 2000)),
                    string_field(map, "type").unwrap_or_else(|| fallback_type.to_string()),
                    string_field(map, "param"),
                    code_field(map.get("code")),
                ),
            },
            other => (other.to_string(), fallback_type.to_string(), None, None),
        },
    };
    let kind = if !kind.is_empty() {
        kind
    } else if status.is_client_error() {
        "invalid_request_error".to_string()
    } else {
        "server_error".to_string()
    };
    let mut err = ApiError::new(status, kind, message);
    err.param = param;
    err.code = code;
    err
}

/// [`from_backend`] with `secret` (the key the gateway sent that backend) cut out of the text
/// that reaches the client: some servers echo the credential they were given in their errors.
pub fn from_backend_redacted(status: StatusCode, body: &[u8], secret: Option<&str>) -> ApiError {
    let mut err = from_backend(status, body);
    if let Some(secret) = secret.filter(|s| !s.is_empty()) {
        let cut = |s: &mut String| {
            if s.contains(secret) {
                *s = s.replace(secret, "[redacted]");
            }
        };
        cut(&mut err.message);
        for field in [&mut err.param, &mut err.code].into_iter().flatten() {
            cut(field);
        }
        if err.kind.contains(secret) {
            err.kind = Cow::Owned(err.kind.replace(secret, "[redacted]"));
        }
    }
    err
}

fn default_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        429 => "rate_limit_error",
        400..=499 => "invalid_request_error",
        _ => "server_error",
    }
}

fn string_field(map: &serde_json::Map<String, Value>, key: &str) -> Option<String> {
    map.get(key).and_then(Value::as_str).map(str::to_string)
}

fn code_field(v: Option<&Value>) -> Option<String> {
    match v {
        Some(Value::String(s)) => Some(s.clone()),
        Some(Value::Number(n)) => Some(n.to_string()),
        _ => None,
    }
}

fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backend_key_echoed_in_an_error_is_redacted() {
        let body = br#"{"error":{"message":"Incorrect API key provided: Bearer be-1","param":"be-1","code":"k"}}"#;
        let e = from_backend_redacted(StatusCode::UNAUTHORIZED, body, Some("be-1"));
        assert_eq!(e.message, "Incorrect API key provided: Bearer [redacted]");
        assert_eq!(e.param.as_deref(), Some("[redacted]"));
        let e = from_backend_redacted(StatusCode::UNAUTHORIZED, b"bad key be-1", Some("be-1"));
        assert_eq!(e.message, "bad key [redacted]");
        let e = from_backend_redacted(StatusCode::UNAUTHORIZED, b"bad key be-1", None);
        assert_eq!(e.message, "bad key be-1");
    }

    #[test]
    fn openai_shape_is_kept() {
        let body =
            br#"{"error":{"message":"m","type":"invalid_request_error","param":"p","code":"c"}}"#;
        let e = from_backend(StatusCode::BAD_REQUEST, body);
        assert_eq!(
            (e.message.as_str(), &*e.kind),
            ("m", "invalid_request_error")
        );
        assert_eq!(
            (e.param.as_deref(), e.code.as_deref()),
            (Some("p"), Some("c"))
        );
    }

    #[test]
    fn vllm_integer_code_becomes_string() {
        let body = br#"{"error":{"message":"The model `nope` does not exist.","type":"NotFoundError","param":"model","code":404}}"#;
        let e = from_backend(StatusCode::NOT_FOUND, body);
        assert_eq!(e.code.as_deref(), Some("404"));
        assert_eq!(&*e.kind, "NotFoundError");
        assert_eq!(e.param.as_deref(), Some("model"));
    }

    #[test]
    fn vllm_legacy_flat_body() {
        let body = br#"{"object":"error","message":"too long","type":"BadRequestError","param":null,"code":400}"#;
        let e = from_backend(StatusCode::BAD_REQUEST, body);
        assert_eq!(e.message, "too long");
        assert_eq!(&*e.kind, "BadRequestError");
    }

    #[test]
    fn tgi_body() {
        let body = br#"{"error":"Model is overloaded","error_type":"overloaded"}"#;
        let e = from_backend(StatusCode::TOO_MANY_REQUESTS, body);
        assert_eq!(e.message, "Model is overloaded");
        assert_eq!(&*e.kind, "overloaded");
        assert!(e.code.is_none());
    }

    #[test]
    fn plain_text_and_empty() {
        let e = from_backend(StatusCode::UNAUTHORIZED, b"");
        assert_eq!(e.message, "Unauthorized");
        assert_eq!(&*e.kind, "authentication_error");
        let e = from_backend(StatusCode::BAD_GATEWAY, b"upstream died");
        assert_eq!(e.message, "upstream died");
        let e = from_backend(
            StatusCode::BAD_GATEWAY,
            br#"{"error":{"message":"x","type":""}}"#,
        );
        assert_eq!(&*e.kind, "server_error");
    }

    #[test]
    fn retry_after_rounds_up() {
        let mut h = http::HeaderMap::new();
        insert_retry_after(&mut h, Duration::from_millis(1500));
        assert_eq!(h["retry-after"], "2");
        assert_eq!(h["retry-after-ms"], "1500");
    }
}
