//! The client-API seam: everything that differs between the client APIs Sluice serves, behind
//! one trait, one file per API.
//!
//! The request path (`proxy`) and the stream observer (`proxy::observe`), both above this
//! layer, know no API by name: they ask the request's [`ClientApi`] where the routed fields
//! are, how the model name is put in and taken back out, whether stream usage must be forced,
//! what an event or a whole answer says about usage and output, how an error is shaped for this
//! API's clients, and which backends speak it. The shared mechanisms stay shared: byte splicing
//! ([`crate::openai::edit`]), the SSE reader (`proxy::sse`), the observer's streaming
//! machinery, and the OpenAI response shapes the three OpenAI APIs have in common ([`wire`]).
//!
//! | API | file | path | label |
//! |---|---|---|---|
//! | chat completions | [`chat`] | `/v1/chat/completions` | `chat` |
//! | completions | [`completions`] | `/v1/completions` | `completions` |
//! | embeddings | [`embeddings`] | `/v1/embeddings` | `embeddings` |
//! | Anthropic Messages | [`messages`] | `/v1/messages`, `/v1/messages/count_tokens` | `messages`, `messages_count_tokens` |
//!
//! # Adding a client API
//!
//! 1. Create `src/api/<name>.rs` with a unit struct implementing [`ClientApi`] and a
//!    `pub static <NAME>: &dyn ClientApi` for it, as [`chat`] does. Answer every method for the
//!    new API's wire format: parse its routed fields into [`RequestFields`] (reuse
//!    [`crate::openai::request`]'s helpers or write a borrowed parse of your own; never build a
//!    tree of the body), inspect its stream events and whole answers into [`Seen`] / [`Usage`]
//!    without allocating per event, and shape errors — Sluice's own and the mid-stream terminal
//!    event — the way that API's SDKs read them.
//! 2. Add `pub mod <name>;` and `pub use <name>::<NAME>;` below, a row to the table above, and
//!    unit tests of its answers in its own file (fields, usage whole and streamed, error shape).
//! 3. Add one line to the route table in `server/routes.rs`: `.route(<NAME>.path(),
//!    inference(<NAME>))`.
//!
//! Nothing else changes: not the phases in `proxy/mod.rs`, not `proxy/observe.rs`, not the
//! tokenizer (it asks [`ClientApi::tokenize_form`]).
//!
//! Invariants every implementation keeps:
//! - Request bodies are read once with borrowed values; the bytes go to the backend untouched
//!   except for [`Splice`]s (model name, forced usage).
//! - [`ClientApi::inspect`] runs on every stream event: it borrows, never allocates, and never
//!   panics on any input; data that is not JSON is reported as [`Seen::invalid`].
//! - Every error a client of this API sees is shaped by [`ClientApi::error_response`] or
//!   [`ClientApi::stream_error_event`].

pub mod chat;
pub mod completions;
pub mod embeddings;
pub mod messages;
pub mod wire;

use std::sync::Arc;

use axum::response::Response;
use bytes::Bytes;

use crate::config::BackendKind;
use crate::openai::edit::Splice;
use crate::openai::{ApiError, RequestFields};
// Until `Usage` moves down to the OpenAI vocabulary (`openai::usage`), it is read from the
// settlement that defines it.
pub use crate::openai::usage::Usage;

pub use chat::CHAT;
pub use completions::COMPLETIONS;
pub use embeddings::EMBEDDINGS;
pub use messages::{COUNT_TOKENS, MESSAGES};

/// One client API: what the request path and the stream observer ask of it.
pub trait ClientApi: Send + Sync {
    /// The path clients call, and the path forwarded to a backend that speaks the API natively.
    fn path(&self) -> &'static str;

    /// Low-cardinality label for metrics and the access log (`endpoint`).
    fn label(&self) -> &'static str;

    /// Parse and validate the routed fields of a request body (400 on anything malformed):
    /// model, stream, output limit, `n`, the prompt's span and its tokenizer-free estimate.
    fn parse(&self, body: &[u8]) -> Result<RequestFields, ApiError>;

    /// Whether the answer is streamed to the client (the request asked for it and the API can).
    fn streams(&self, fields: &RequestFields) -> bool;

    /// Expected output tokens, `default` when the client gave no limit.
    fn expected_output(&self, fields: &RequestFields, default: u64) -> u64;

    /// The splice that gives the backend its own name for the model.
    fn rename_model(&self, fields: &RequestFields, to: &str) -> Splice;

    /// For a streamed request: the splice that makes the backend report usage at the end of the
    /// stream when the client did not ask for it. `Some` also makes the observer drop that
    /// report ([`Seen::usage_only`]) before it reaches the client.
    fn force_stream_usage(&self, body: &[u8], fields: &RequestFields) -> Option<Splice>;

    /// What one stream event's data says (called on every event: borrow, never allocate).
    fn inspect(&self, data: &[u8]) -> Seen;

    /// The usage in a whole (non-streamed) answer; `Err` when the body is not JSON at all
    /// (valid JSON of an unexpected shape is `Ok(None)`).
    fn whole_usage(&self, json: &[u8]) -> Result<Option<Usage>, serde_json::Error>;

    /// Apply `edits` to one JSON object (a stream event's data or a whole answer); `None` when
    /// it cannot be read (it is then passed on as it came).
    fn edit(&self, json: &[u8], edits: &Edits) -> Option<Bytes>;

    /// The complete event that ends a stream of this API (`data: [DONE]\n\n`), written in place
    /// of the backend's own end marker and after a backend's in-stream error; `None` when the
    /// API's last event is a typed one.
    fn end_event(&self) -> Option<&'static [u8]>;

    /// The complete event(s) that end a stream a backend broke mid-way, so this API's SDKs
    /// raise instead of returning a truncated answer.
    fn stream_error_event(&self, err: &ApiError) -> Bytes;

    /// The response for an error (Sluice's own, or a backend's normalised into [`ApiError`]).
    fn error_response(&self, err: ApiError) -> Response;

    /// The prefix of the id filled in where a backend leaves it empty (TGI).
    fn id_prefix(&self) -> &'static str;

    /// Whether a backend of `kind` speaks this API natively (only those are candidates).
    fn native(&self, kind: BackendKind) -> bool;

    /// The error for a model whose backends (of `kinds`) all lack this API natively.
    fn unserved(&self, model: &str, _kinds: &[BackendKind]) -> ApiError {
        ApiError::model_not_found(model)
    }

    /// How a backend's tokenizer can count this request's prompt (`prompt`: its raw JSON
    /// value at [`RequestFields::prompt_span`]); `None` when it cannot.
    fn tokenize_form(&self, prompt: &[u8]) -> Option<TokenizeForm>;
}

impl std::fmt::Debug for dyn ClientApi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.label())
    }
}

/// The shape of prompt a tokenizer is asked to count; which backend kinds answer which form is
/// the tokenizer's business ([`crate::fleet::tokenize`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenizeForm {
    /// A chat `messages` array: counted with the model's chat template applied.
    ChatMessages,
    /// A single string prompt, counted as it is.
    Prompt,
}

/// What one stream event told the observer.
#[derive(Debug, Default, Clone, Copy)]
pub struct Seen {
    /// The API's end-of-stream marker: the stream is complete.
    pub done: bool,
    /// The event carries output (text, a tool call, reasoning): ≈ one token.
    pub text: bool,
    pub usage: Option<Usage>,
    /// The event carries only usage (what [`ClientApi::force_stream_usage`] asked for).
    pub usage_only: bool,
    /// The backend reported an error inside the stream.
    pub error: bool,
    /// The data is not JSON at all (valid JSON of an unexpected shape is not flagged).
    pub invalid: bool,
}

/// Edits applied to each event of a stream and to a whole answer (all off = pure
/// pass-through).
#[derive(Debug, Clone, Default)]
pub struct Edits {
    /// Put the client's model name back into `model`.
    pub rename_model: Option<String>,
    /// Drop the usage-only event that Sluice asked for on the client's behalf.
    pub strip_usage: bool,
    /// Replace an empty `id` (TGI) with this one.
    pub fill_id: Option<String>,
    /// TGI's `finish_reason: "stop_sequence"` becomes OpenAI's `"stop"`.
    pub normalize_finish: bool,
    /// The backend's API key: replaced by `[redacted]` wherever the backend echoes it (an error
    /// event inside a 200 stream, say). Not an edit: a stream without it stays zero-copy.
    pub redact: Option<Arc<str>>,
}

impl Edits {
    pub fn is_passthrough(&self) -> bool {
        self.rename_model.is_none()
            && !self.strip_usage
            && self.fill_id.is_none()
            && !self.normalize_finish
    }

    /// Whether a whole (non-streamed) answer is edited (`strip_usage` is for streams only).
    pub fn edits_whole(&self) -> bool {
        self.rename_model.is_some() || self.fill_id.is_some() || self.normalize_finish
    }
}
