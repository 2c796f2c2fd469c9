//! Translation: a client API served by a backend that does not speak it natively but speaks
//! chat completions (TGI, Ollama, the generic `openai` kind), over `/v1/chat/completions`.
//!
//! What this module owns: the stateless mapping of the Responses API ([`responses`]) and the
//! Anthropic Messages API ([`messages`]) to a chat-completions request, and of a chat answer —
//! whole or as a stream of chunks — back to the client API's own shape ([`chat`] reads the
//! chat side once for both). The request path asks the client API for its [`Translator`]
//! ([`crate::api::ClientApi::translator`]); everything else on the path stays shared: the
//! translated answer goes through the same observer, inspected by the client API's own
//! `inspect`/`whole_usage`, so usage accounting, token limits, metrics and the mid-stream
//! terminal error are the same mechanism as for a native answer.
//!
//! Re-serialising is unavoidable here: a translated request is a different JSON document, so
//! its body is parsed into a tree and written anew (once per request, the backend's model name
//! put in per attempt), and each chat chunk is parsed and written out as the client API's
//! events. The native path is untouched: it still forwards the client's bytes with splices.
//!
//! Invariants:
//! - What cannot be translated faithfully is refused before any backend is tried, with a 400
//!   naming the field (`param`; for the Messages API the field is named in the message, its
//!   error shape has no `param`). Nothing is dropped silently: a field is either mapped,
//!   documented as having no effect on the answer (a hint such as `cache_control`), or refused.
//! - A translated stream is complete only when the backend said why it stopped
//!   (`finish_reason`) and ended (`[DONE]` or the end of the body after it): only then are the
//!   client API's closing events written. A stream that breaks earlier gets no closing events,
//!   so the observer ends it with the client API's error event, as for a native stream.
//! - A backend's in-stream error becomes the client API's error event, and nothing after it is
//!   translated.
//! - Translation never panics on any backend input: a chat answer that cannot be read is an
//!   `Err` (a 502 for the client), an event that is not JSON is passed on for the observer to
//!   refuse.

pub mod chat;
pub mod messages;
pub mod responses;

use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use serde_json::{Map, Value};

use crate::config::BackendKind;
use crate::openai::ApiError;

/// The path a translated request is sent to.
pub const CHAT_PATH: &str = "/v1/chat/completions";

/// Serves one client API over chat completions.
pub trait Translator: Send + Sync {
    /// Whether a backend of `kind` can serve the API by translation (it speaks chat
    /// completions). Every configured kind does; a kind that speaks the API natively is always
    /// sent natively.
    fn serves(&self, kind: BackendKind) -> bool {
        let _ = kind;
        true
    }

    /// The chat-completions request for a client request (`stream`: whether it is streamed),
    /// or the 400 naming the first field that cannot be translated.
    fn request(&self, body: &[u8], stream: bool) -> Result<Translation, ApiError>;
}

/// A request translated once, sent to each attempted backend with its own model name.
pub struct Translation {
    chat: Map<String, Value>,
    /// How the answer is put back into the client API's shape.
    pub reply: Arc<dyn Reply>,
}

impl Translation {
    pub fn new(chat: Map<String, Value>, reply: Arc<dyn Reply>) -> Translation {
        Translation { chat, reply }
    }

    /// The chat body for a backend that calls the model `model`.
    pub fn body(&self, model: &str) -> Bytes {
        let mut chat = self.chat.clone();
        chat.insert("model".into(), Value::String(model.to_string()));
        Bytes::from(Value::Object(chat).to_string())
    }

    /// The translated request without its model (for tests and logs).
    pub fn chat(&self) -> &Map<String, Value> {
        &self.chat
    }
}

/// How a chat answer becomes the client API's answer.
pub trait Reply: Send + Sync {
    /// A whole chat completion as the client API's whole answer; `Err` says why it cannot be
    /// read.
    fn whole(&self, chat: &[u8]) -> Result<Bytes, String>;

    /// A translator for one streamed answer.
    fn stream(&self) -> Box<dyn StreamReply>;
}

/// One streamed answer being translated, event by event.
pub trait StreamReply: Send {
    /// One chat event's data (JSON, not `[DONE]`): the client API's events for it go to `out`
    /// (complete SSE events). Returns `false` when the stream is over for the client (the
    /// backend reported an error, written as the API's error event).
    fn event(&mut self, data: &[u8], out: &mut BytesMut) -> bool;

    /// The backend ended the stream (`[DONE]`, or the end of its body): the closing events,
    /// when the backend said why it stopped; nothing otherwise (the observer then reports the
    /// stream as broken).
    fn end(&mut self, out: &mut BytesMut);
}

/// The 400 for a field the translation cannot carry.
pub fn untranslatable(param: &str, why: &str) -> ApiError {
    ApiError::bad_request(format!(
        "`{param}` cannot be served by this model's backends: they are reached by translation \
         to chat completions, which {why}."
    ))
    .with_param(param)
    .with_code("untranslatable_field")
}

/// Write one typed SSE event (`event: <kind>` + `data: <json>`).
pub fn write_event(out: &mut BytesMut, kind: &str, data: &Value) {
    write_raw_event(out, kind, &data.to_string());
}

/// [`write_event`] with its data already written as JSON text.
pub fn write_raw_event(out: &mut BytesMut, kind: &str, json: &str) {
    out.extend_from_slice(b"event: ");
    out.extend_from_slice(kind.as_bytes());
    out.extend_from_slice(b"\ndata: ");
    out.extend_from_slice(json.as_bytes());
    out.extend_from_slice(b"\n\n");
}

/// Pass an event whose data is not a chat chunk on as it came: the observer reads it with the
/// client API's `inspect` and ends the stream with the API's error if it is not JSON.
pub fn pass_on(data: &[u8], out: &mut BytesMut) {
    for line in data.split(|b| *b == b'\n' || *b == b'\r') {
        out.extend_from_slice(b"data: ");
        out.extend_from_slice(line);
        out.extend_from_slice(b"\n");
    }
    out.extend_from_slice(b"\n");
}

/// A fresh id for what a translated answer names (the response, its items): random, so it
/// says nothing about the request.
pub fn fresh_id(prefix: &str) -> String {
    format!("{prefix}{:024x}", rand::random::<u128>() >> 32)
}

/// Seconds since the Unix epoch.
pub fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}
