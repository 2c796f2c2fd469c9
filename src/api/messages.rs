//! Anthropic Messages, `POST /v1/messages` and `POST /v1/messages/count_tokens`: forwarded
//! natively to the backends that speak it (vLLM ≥ 0.32); `/v1/messages` is served by
//! translation to chat completions by the other kinds ([`super::translate::messages`]),
//! `count_tokens` only natively.
//!
//! What this module owns:
//! - the routed fields (the body's `model`, `messages`, `max_tokens`, `stream` read like a chat
//!   request's: Anthropic's required `max_tokens` is the output reservation);
//! - the typed stream: `message_start` carries the prompt count, `message_delta` the output
//!   (and, from vLLM, the prompt again), `content_block_delta` is output, `message_stop` ends
//!   the stream, `error` is a backend's in-stream failure. Usage is always reported, so none is
//!   forced;
//! - Anthropic's error shape, `{"type":"error","error":{"type","message"}}`, with the error
//!   type chosen by status (so a backend's own error, whatever it called it, reads the same),
//!   and the mid-stream terminal `event: error` the Anthropic SDKs raise on.
//!
//! `count_tokens` generates nothing: its expected output is 0, and its answer carries no
//! `usage`, so a token limit keeps its reservation (the prompt estimate) and the model's learned
//! shapes are not taught by it. It counts as one request against request limits.
//!
//! Invariants: events are read with borrowed values (nothing allocated per event); the error
//! type depends on the status alone; a body that is not JSON is told apart from JSON of another
//! shape.

use axum::response::{IntoResponse, Response};
use bytes::{Bytes, BytesMut};
use http::{header, HeaderValue, StatusCode};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

use super::{wire, ClientApi, Edits, Seen, TokenizeForm, Usage, Whole};
use crate::config::BackendKind;
use crate::openai::edit::{self, Splice};
use crate::openai::error::insert_retry_after;
use crate::openai::request::{self, PromptField};
use crate::openai::{ApiError, RequestFields};

/// Anthropic Messages.
pub struct Messages;

/// Anthropic Messages' token counting (no generation).
pub struct CountTokens;

/// `POST /v1/messages`.
pub static MESSAGES: &dyn ClientApi = &Messages;

/// `POST /v1/messages/count_tokens`.
pub static COUNT_TOKENS: &dyn ClientApi = &CountTokens;

/// Which backend kinds speak the whole Messages API natively. vLLM serves it since 0.32 (the
/// captures); Ollama serves `/v1/messages` but not `count_tokens`. The `openai` kind is any OpenAI-compatible server, and OpenAI's API has no
/// `/v1/messages`: sending one there would turn a configuration question into a backend 404.
fn native_kind(kind: BackendKind) -> bool {
    matches!(kind, BackendKind::Vllm)
}

/// Anthropic's error `type` for an HTTP status (its documented table; 503 and 529 are both
/// "overloaded", 504 a timeout).
pub fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        400 => "invalid_request_error",
        401 => "authentication_error",
        402 => "billing_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        504 => "timeout_error",
        s if s < 500 => "invalid_request_error",
        _ => "api_error",
    }
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    error: ErrorInner<'a>,
}

#[derive(Serialize)]
struct ErrorInner<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    message: &'a str,
}

/// The error as Anthropic's JSON body.
pub fn error_json(err: &ApiError) -> String {
    let body = ErrorBody {
        kind: "error",
        error: ErrorInner {
            kind: error_type(err.status),
            message: &err.message,
        },
    };
    serde_json::to_string(&body).unwrap_or_else(|_| {
        r#"{"type":"error","error":{"type":"api_error","message":"internal error"}}"#.into()
    })
}

/// Anthropic's error answer: its status, its shape, the error's headers and `retry-after`.
pub fn error_response(err: ApiError) -> Response {
    let body = error_json(&err);
    let mut response = (err.status, body).into_response();
    let headers = response.headers_mut();
    headers.extend(err.headers);
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    if let Some(after) = err.retry_after {
        insert_retry_after(headers, after);
    }
    response
}

/// The typed `error` event the Anthropic SDKs raise on (they read `event: error` whatever the
/// stream's status was).
pub fn stream_error_event(err: &ApiError) -> Bytes {
    let mut event = BytesMut::new();
    event.extend_from_slice(b"event: error\ndata: ");
    event.extend_from_slice(error_json(err).as_bytes());
    event.extend_from_slice(b"\n\n");
    event.freeze()
}

/// A model served here only by backends without the Messages API: a clear 400 naming why.
fn unserved(model: &str, kinds: &[BackendKind]) -> ApiError {
    let mut names: Vec<&str> = kinds.iter().map(|k| k.as_str()).collect();
    names.sort_unstable();
    names.dedup();
    ApiError::bad_request(format!(
        "The model `{model}` is served here only by backends that do not speak the Anthropic \
         Messages API ({}); Sluice forwards /v1/messages natively and does not translate it. \
         Use /v1/chat/completions for this model.",
        names.join(", ")
    ))
    .with_code("api_not_served")
}

#[derive(Deserialize)]
struct AnthropicUsage {
    #[serde(default)]
    input_tokens: Option<u64>,
    #[serde(default)]
    output_tokens: Option<u64>,
    #[serde(default)]
    cache_read_input_tokens: Option<u64>,
}

impl AnthropicUsage {
    fn usage(&self) -> Usage {
        Usage {
            prompt_tokens: self.input_tokens.unwrap_or(0),
            completion_tokens: self.output_tokens.unwrap_or(0),
            cached_tokens: self.cache_read_input_tokens,
        }
    }
}

#[derive(Deserialize)]
struct MessageLite<'a> {
    #[serde(borrow, default)]
    model: Option<&'a RawValue>,
    #[serde(default)]
    usage: Option<AnthropicUsage>,
}

/// One stream event's data or a whole answer, borrowed.
#[derive(Deserialize)]
struct EventLite<'a> {
    #[serde(rename = "type", default)]
    kind: Option<&'a str>,
    #[serde(borrow, default)]
    message: Option<MessageLite<'a>>,
    #[serde(default)]
    usage: Option<AnthropicUsage>,
    #[serde(borrow, default)]
    model: Option<&'a RawValue>,
    #[serde(borrow, default)]
    delta: Option<DeltaLite<'a>>,
    /// A whole answer's (a stream's is in its `message_delta`).
    #[serde(borrow, default)]
    stop_reason: Option<&'a RawValue>,
}

/// A `message_delta`'s delta (other events' deltas read as one with nothing set).
#[derive(Deserialize)]
struct DeltaLite<'a> {
    #[serde(borrow, default)]
    stop_reason: Option<&'a RawValue>,
}

fn inspect(data: &[u8]) -> Seen {
    let event = match serde_json::from_slice::<EventLite<'_>>(data) {
        Ok(e) => e,
        Err(e) => {
            return Seen {
                invalid: !wire::is_json(data, &e),
                ..Seen::default()
            }
        }
    };
    let mut seen = Seen::default();
    match event.kind {
        Some("message_stop") => seen.done = true,
        Some("message_start") => {
            seen.usage = event
                .message
                .and_then(|m| m.usage)
                .map(|u| u.usage())
                .filter(|u| u.prompt_tokens > 0 || u.completion_tokens > 0);
        }
        Some("message_delta") => {
            seen.usage = event.usage.map(|u| u.usage());
            seen.finish = event
                .delta
                .and_then(|d| d.stop_reason)
                .and_then(wire::finish_name);
        }
        Some("content_block_delta") => seen.text = true,
        Some("error") => seen.error = true,
        _ => {}
    }
    seen
}

fn whole(json: &[u8]) -> Result<Whole, serde_json::Error> {
    match serde_json::from_slice::<EventLite<'_>>(json) {
        Ok(e) => Ok(Whole {
            usage: e.usage.map(|u| u.usage()),
            finish: e.stop_reason.and_then(wire::finish_name),
        }),
        Err(e) if wire::is_json(json, &e) => Ok(Whole::default()),
        Err(e) => Err(e),
    }
}

/// Put the client's model name back: top-level `model` in a whole answer, `message.model` in
/// `message_start`. Only the rename applies (the other edits are for TGI, never a candidate).
fn edit_json(json: &[u8], edits: &Edits) -> Option<Bytes> {
    let event: EventLite<'_> = serde_json::from_slice(json).ok()?;
    let raw = event.model.or(event.message.and_then(|m| m.model));
    let mut splices = Vec::new();
    if let (Some(to), Some(raw)) = (&edits.rename_model, raw) {
        if raw.get().starts_with('"') {
            let start = (raw.get().as_ptr() as usize).checked_sub(json.as_ptr() as usize)?;
            splices.push(Splice {
                span: start..start + raw.get().len(),
                with: edit::json_string(to),
            });
        }
    }
    Some(edit::apply(&Bytes::copy_from_slice(json), splices))
}

/// What the two Messages paths answer alike (all but the path, label and generation).
macro_rules! shared_messages_api {
    () => {
        fn parse(&self, body: &[u8]) -> Result<RequestFields, ApiError> {
            request::parse(PromptField::Messages, body)
        }

        fn force_stream_usage(&self, _body: &[u8], _fields: &RequestFields) -> Option<Splice> {
            None
        }

        fn inspect(&self, data: &[u8]) -> Seen {
            inspect(data)
        }

        fn edit(&self, json: &[u8], edits: &Edits) -> Option<Bytes> {
            edit_json(json, edits)
        }

        fn end_event(&self) -> Option<&'static [u8]> {
            None
        }

        fn stream_error_event(&self, err: &ApiError) -> Bytes {
            stream_error_event(err)
        }

        fn error_response(&self, err: ApiError) -> Response {
            error_response(err)
        }

        fn id_prefix(&self) -> &'static str {
            "msg_"
        }

        fn unserved(&self, model: &str, kinds: &[BackendKind]) -> ApiError {
            unserved(model, kinds)
        }

        fn tokenize_form(&self, _prompt: &[u8]) -> Option<TokenizeForm> {
            // Anthropic content blocks and a separate `system` are not what the engines'
            // chat-template tokenizers read: the estimate is used.
            None
        }
    };
}

impl ClientApi for Messages {
    fn path(&self) -> &'static str {
        "/v1/messages"
    }

    fn translator(&self) -> Option<&'static dyn super::translate::Translator> {
        Some(super::translate::messages::TRANSLATOR)
    }

    fn label(&self) -> &'static str {
        "messages"
    }

    fn whole(&self, json: &[u8]) -> Result<Whole, serde_json::Error> {
        whole(json)
    }

    fn native(&self, kind: BackendKind) -> bool {
        native_kind(kind) || kind == BackendKind::Ollama
    }

    fn continuation(&self) -> Option<&'static dyn super::continuation::Continuation> {
        Some(super::continuation::messages::MESSAGES_CONTINUATION)
    }

    shared_messages_api!();
}

impl ClientApi for CountTokens {
    fn path(&self) -> &'static str {
        "/v1/messages/count_tokens"
    }

    fn label(&self) -> &'static str {
        "messages_count_tokens"
    }

    fn streams(&self, _fields: &RequestFields) -> bool {
        false
    }

    fn expected_output(&self, _fields: &RequestFields, _default: u64) -> u64 {
        0
    }

    fn whole(&self, json: &[u8]) -> Result<Whole, serde_json::Error> {
        // Checked to be JSON; `input_tokens` is a count, not usage (see the module doc).
        serde_json::from_slice::<serde::de::IgnoredAny>(json).map(|_| Whole::default())
    }

    fn native(&self, kind: BackendKind) -> bool {
        native_kind(kind) // Ollama has no count_tokens
    }

    /// vLLM's count: the request as the chat request it becomes, through the model's chat
    /// template; its answer's shape (`context_management` included).
    fn answer_locally(
        &self,
        body: &[u8],
        tokenizer: &crate::tokenizer::Tokenizer,
    ) -> Option<Result<Bytes, ApiError>> {
        let count = || -> Result<Bytes, ApiError> {
            let chat = super::translate::messages::TRANSLATOR.request(body, false)?;
            let chat = serde_json::to_vec(chat.chat())
                .map_err(|e| ApiError::bad_request(e.to_string()))?;
            let ids = tokenizer
                .chat_ids(&chat)
                .map_err(|e| ApiError::bad_request(e.to_string()))?;
            let n = ids.len();
            Ok(Bytes::from(format!(
                "{{\"input_tokens\":{n},\"context_management\":{{\"original_input_tokens\":{n}}}}}"
            )))
        };
        Some(count())
    }

    shared_messages_api!();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body_of(resp: Response) -> (StatusCode, http::HeaderMap, serde_json::Value) {
        let status = resp.status();
        let headers = resp.headers().clone();
        let bytes = futures_executor(resp);
        (status, headers, serde_json::from_slice(&bytes).unwrap())
    }

    fn futures_executor(resp: Response) -> Bytes {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(axum::body::to_bytes(resp.into_body(), usize::MAX))
            .unwrap()
    }

    #[test]
    fn routed_fields_and_kinds() {
        let body = br#"{"model":"m","max_tokens":16,"stream":true,"messages":[{"role":"user","content":"hi"}]}"#;
        let f = MESSAGES.parse(body).unwrap();
        assert!(MESSAGES.streams(&f));
        assert_eq!(MESSAGES.expected_output(&f, 100), 16);
        assert!(!COUNT_TOKENS.streams(&f));
        assert_eq!(COUNT_TOKENS.expected_output(&f, 100), 0);
        assert_eq!(MESSAGES.path(), "/v1/messages");
        assert_eq!(MESSAGES.label(), "messages");
        assert!(MESSAGES.force_stream_usage(body, &f).is_none());
        assert!(MESSAGES.native(BackendKind::Vllm) && COUNT_TOKENS.native(BackendKind::Vllm));
        // Ollama serves /v1/messages but has no count_tokens.
        assert!(MESSAGES.native(BackendKind::Ollama) && !COUNT_TOKENS.native(BackendKind::Ollama));
        for kind in [BackendKind::Tgi, BackendKind::OpenAi] {
            assert!(!MESSAGES.native(kind) && !COUNT_TOKENS.native(kind));
        }
        let err = MESSAGES.unserved("m", &[BackendKind::Tgi, BackendKind::Ollama]);
        assert_eq!(err.status, 400);
        assert!(err.message.contains("ollama, tgi"), "{}", err.message);
    }

    #[test]
    fn stream_events_and_usage() {
        let start = br#"{"type":"message_start","message":{"id":"x","model":"tiny","usage":{"input_tokens":10,"output_tokens":0}}}"#;
        let s = MESSAGES.inspect(start);
        assert_eq!(s.usage.map(|u| u.prompt_tokens), Some(10));
        assert!(!s.text && !s.done);
        let s = MESSAGES.inspect(
            br#"{"type":"content_block_delta","delta":{"type":"text_delta","text":" ac"},"index":0}"#,
        );
        assert!(s.text);
        let s = MESSAGES.inspect(br#"{"type":"message_delta","delta":{"stop_reason":"max_tokens"},"usage":{"input_tokens":10,"output_tokens":6}}"#);
        assert_eq!(
            s.usage,
            Some(Usage {
                prompt_tokens: 10,
                cached_tokens: None,
                completion_tokens: 6
            })
        );
        assert!(MESSAGES.inspect(br#"{"type":"message_stop"}"#).done);
        assert!(MESSAGES.inspect(br#"{"type":"error","error":{}}"#).error);
        assert!(MESSAGES.inspect(b"{\"type\":0 \x82garbage").invalid);
        assert_eq!(MESSAGES.end_event(), None);
        let whole = br#"{"id":"m","type":"message","model":"tiny","usage":{"input_tokens":21,"output_tokens":8}}"#;
        let u = MESSAGES.whole_usage(whole).unwrap().unwrap();
        assert_eq!((u.prompt_tokens, u.completion_tokens), (21, 8));
        assert!(MESSAGES.whole_usage(b"{\"usage\":").is_err());
        assert_eq!(
            COUNT_TOKENS.whole_usage(br#"{"input_tokens":10}"#).unwrap(),
            None
        );
    }

    #[test]
    fn model_renamed_whole_and_in_message_start() {
        let edits = Edits {
            rename_model: Some("client".into()),
            ..Edits::default()
        };
        let out = MESSAGES
            .edit(br#"{"id":"m","model":"tiny","usage":{}}"#, &edits)
            .unwrap();
        assert_eq!(&out[..], br#"{"id":"m","model":"client","usage":{}}"#);
        let out = MESSAGES
            .edit(
                br#"{"type":"message_start","message":{"model":"tiny"}}"#,
                &edits,
            )
            .unwrap();
        assert_eq!(
            &out[..],
            br#"{"type":"message_start","message":{"model":"client"}}"#
        );
    }

    #[test]
    fn every_error_status_has_anthropics_shape_and_type() {
        let cases = [
            (ApiError::bad_request("x"), 400, "invalid_request_error"),
            (
                ApiError::new(StatusCode::UNAUTHORIZED, "authentication_error", "x"),
                401,
                "authentication_error",
            ),
            (
                ApiError::new(StatusCode::FORBIDDEN, "permission_error", "x"),
                403,
                "permission_error",
            ),
            (ApiError::model_not_found("m"), 404, "not_found_error"),
            (ApiError::payload_too_large(10), 413, "request_too_large"),
            (
                ApiError::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", "x")
                    .with_retry_after(std::time::Duration::from_millis(1500)),
                429,
                "rate_limit_error",
            ),
            (ApiError::internal("x"), 500, "api_error"),
            (ApiError::bad_gateway("x"), 502, "api_error"),
            (
                ApiError::no_backend("m", std::time::Duration::from_secs(1)),
                503,
                "overloaded_error",
            ),
            (ApiError::timeout("head"), 504, "timeout_error"),
            (
                crate::openai::error::from_backend(
                    StatusCode::from_u16(529).unwrap(),
                    br#"{"type":"error","error":{"type":"overloaded_error","message":"busy"}}"#,
                ),
                529,
                "overloaded_error",
            ),
            (
                crate::openai::error::from_backend(
                    StatusCode::NOT_FOUND,
                    br#"{"type":"error","error":{"type":"NotFoundError","message":"The model `nope` does not exist."}}"#,
                ),
                404,
                "not_found_error",
            ),
        ];
        for (err, status, kind) in cases {
            let (got, headers, v) = body_of(MESSAGES.error_response(err));
            assert_eq!(got.as_u16(), status);
            assert_eq!(headers["content-type"], "application/json");
            assert_eq!(v["type"], "error", "{v}");
            assert_eq!(v["error"]["type"], kind, "{status}: {v}");
            assert!(v["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()));
            if status == 429 {
                assert_eq!(headers["retry-after"], "2");
            }
            if status == 413 {
                assert_eq!(headers["connection"], "close");
            }
        }
    }

    #[test]
    fn mid_stream_error_is_a_typed_error_event() {
        let event = MESSAGES.stream_error_event(&ApiError::bad_gateway("gone"));
        let text = std::str::from_utf8(&event).unwrap();
        let data = text
            .strip_prefix("event: error\ndata: ")
            .and_then(|t| t.strip_suffix("\n\n"))
            .unwrap();
        let v: serde_json::Value = serde_json::from_str(data).unwrap();
        assert_eq!(v["type"], "error");
        assert_eq!(v["error"]["type"], "api_error");
        assert_eq!(v["error"]["message"], "gone");
    }
}
