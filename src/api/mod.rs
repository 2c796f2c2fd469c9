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
//! | Responses | [`responses`] | `/v1/responses` | `responses` |
//! | tokenizer (vLLM) | [`tokenize`] | `/tokenize`, `/detokenize` | `tokenize`, `detokenize` |
//! | batch chat (vLLM) | [`chat_batch`] | `/v1/chat/completions/batch` | `chat_batch` |
//! | rerank, score | [`pooling`] | `/v1/rerank`, `/rerank`, `/v1/score` | `rerank`, `score` |
//! | audio (multipart) | [`audio`] | `/v1/audio/transcriptions`, `/v1/audio/translations` | `audio_transcriptions`, `audio_translations` |
//! | Anthropic Messages | [`messages`] | `/v1/messages`, `/v1/messages/count_tokens` | `messages`, `messages_count_tokens` |
//!
//! # Adding a client API
//!
//! 1. Create `src/api/<name>.rs` with a unit struct implementing [`ClientApi`] and a
//!    `pub static <NAME>: &dyn ClientApi` for it, as [`chat`] does. The provided methods answer
//!    for the OpenAI wire; an API with another wire overrides every one of them: parse its routed fields into [`RequestFields`] (reuse
//!    [`crate::openai::request`]'s helpers or write a borrowed parse of your own; never build a
//!    tree of the body), inspect its stream events and whole answers into [`Seen`] / [`Whole`]
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
//! # Serving an API by translation
//!
//! An API that some backend kinds lack but whose stateless part maps onto chat completions
//! returns a [`translate::Translator`] from [`ClientApi::translator`]. Its backends that do not
//! speak it natively then become candidates too (each backend is sent the request natively when
//! it can): the request is translated once in `prepare` (a field that cannot be carried is a 400
//! naming it, before any attempt), each attempt sends the translated body to
//! `/v1/chat/completions`, and the answer is put back into the API's shape before the observer
//! reads it with this API's own `inspect`/`whole`. The Responses and Messages APIs are
//! served this way ([`translate`]); the native path keeps its byte splicing.
//!
//! Invariants every implementation keeps:
//! - Request bodies are read once with borrowed values; the bytes go to the backend untouched
//!   except for [`Splice`]s (model name, forced usage).
//! - [`ClientApi::inspect`] runs on every stream event: it borrows, never allocates, and never
//!   panics on any input; data that is not JSON is reported as [`Seen::invalid`].
//! - Every error a client of this API sees is shaped by [`ClientApi::error_response`] or
//!   [`ClientApi::stream_error_event`].

pub mod audio;
pub mod chat;
pub mod chat_batch;
pub mod completions;
pub mod continuation;
pub mod embeddings;
pub mod engine;
pub mod messages;
pub mod multipart;
pub mod pooling;
pub mod responses;
pub mod tokenize;
pub mod translate;
pub mod wire;

use std::sync::Arc;

use axum::response::Response;
use bytes::Bytes;

use crate::config::BackendKind;
use crate::openai::edit::Splice;
pub use crate::openai::usage::Usage;
use crate::openai::{ApiError, RequestFields};

pub use audio::{AUDIO_TRANSCRIPTIONS, AUDIO_TRANSLATIONS};
pub use chat::CHAT;
pub use chat_batch::CHAT_BATCH;
pub use completions::COMPLETIONS;
pub use embeddings::EMBEDDINGS;
pub use messages::{COUNT_TOKENS, MESSAGES};
pub use pooling::{RERANK, RERANK_V1, SCORE};
pub use responses::RESPONSES;
pub use tokenize::{DETOKENIZE, TOKENIZE};

/// One client API: what the request path and the stream observer ask of it.
///
/// The five required methods are what every API has of its own. The others answer for the
/// OpenAI wire (`data:` events ending in `[DONE]`, `usage` with `prompt_tokens`, OpenAI's error
/// body, streamed on `stream: true`, spoken by every backend kind); an API with another wire
/// overrides each of them, and its unit tests pin every answer.
pub trait ClientApi: Send + Sync {
    /// The path clients call, and the path forwarded to a backend that speaks the API natively.
    fn path(&self) -> &'static str;

    /// Low-cardinality label for metrics and the access log (`endpoint`).
    fn label(&self) -> &'static str;

    /// Parse and validate the routed fields of a request body (400 on anything malformed):
    /// model, stream, output limit, `n`, the prompt's span and its tokenizer-free estimate.
    fn parse(&self, body: &[u8]) -> Result<RequestFields, ApiError>;

    /// The prefix of the id filled in where a backend leaves it empty (TGI).
    fn id_prefix(&self) -> &'static str;

    /// How a backend's tokenizer can count this request's prompt (`prompt`: its raw JSON
    /// value at [`RequestFields::prompt_span`]); `None` when it cannot.
    fn tokenize_form(&self, prompt: &[u8]) -> Option<TokenizeForm>;

    /// Whether the answer is streamed to the client (the request asked for it and the API can).
    fn streams(&self, fields: &RequestFields) -> bool {
        fields.stream
    }

    /// Expected output tokens, `default` when the client gave no limit.
    fn expected_output(&self, fields: &RequestFields, default: u64) -> u64 {
        wire::expected_output(fields, default)
    }

    /// The splice that gives the backend its own name for the model.
    fn rename_model(&self, fields: &RequestFields, to: &str) -> Splice {
        crate::openai::edit::rename_model(fields, to)
    }

    /// For a streamed request: the splice that makes the backend report usage at the end of the
    /// stream when the client did not ask for it. `Some` also makes the observer drop that
    /// report ([`Seen::usage_only`]) before it reaches the client.
    fn force_stream_usage(&self, body: &[u8], fields: &RequestFields) -> Option<Splice> {
        crate::openai::edit::force_include_usage(body, fields)
    }

    /// What one stream event's data says (called on every event: borrow, never allocate).
    fn inspect(&self, data: &[u8]) -> Seen {
        wire::inspect(data)
    }

    /// What a whole (non-streamed) answer says — its usage and why it ended — read in one
    /// borrowed pass; `Err` when the body is not JSON at all (valid JSON of an unexpected
    /// shape says nothing).
    fn whole(&self, json: &[u8]) -> Result<Whole, serde_json::Error> {
        wire::whole(json)
    }

    /// The usage in a whole answer (see [`ClientApi::whole`]; not overridden).
    fn whole_usage(&self, json: &[u8]) -> Result<Option<Usage>, serde_json::Error> {
        self.whole(json).map(|w| w.usage)
    }

    /// Apply `edits` to one JSON object (a stream event's data or a whole answer); `None` when
    /// it cannot be read (it is then passed on as it came).
    fn edit(&self, json: &[u8], edits: &Edits) -> Option<Bytes> {
        wire::edit_json(json, edits)
    }

    /// The complete event that ends a stream of this API (`data: [DONE]\n\n`), written in place
    /// of the backend's own end marker and after a backend's in-stream error; `None` when the
    /// API's last event is a typed one.
    fn end_event(&self) -> Option<&'static [u8]> {
        Some(wire::DONE_EVENT)
    }

    /// The complete event(s) that end a stream a backend broke mid-way, so this API's SDKs
    /// raise instead of returning a truncated answer.
    fn stream_error_event(&self, err: &ApiError) -> Bytes {
        wire::stream_error_event(err)
    }

    /// The response for an error (Sluice's own, or a backend's normalised into [`ApiError`]).
    fn error_response(&self, err: ApiError) -> Response {
        wire::error_response(err)
    }

    /// Whether a backend of `kind` speaks this API natively (sent the client's bytes on
    /// [`ClientApi::path`]).
    fn native(&self, _kind: BackendKind) -> bool {
        true
    }

    /// How a backend that does not speak this API natively but speaks chat completions serves
    /// it ([`translate`]); `None`: only backends that speak it natively are candidates. A
    /// backend that speaks the API natively is always sent the request natively.
    fn translator(&self) -> Option<&'static dyn translate::Translator> {
        None
    }

    /// The answer, as a JSON body, that the model's own tokenizer gives when no backend of the
    /// model speaks this API (`/v1/messages/count_tokens` for a model only TGI or Ollama
    /// serve); `None` for an API that needs an engine.
    fn answer_locally(
        &self,
        body: &[u8],
        tokenizer: &crate::tokenizer::Tokenizer,
    ) -> Option<Result<Bytes, ApiError>> {
        let _ = (body, tokenizer);
        None
    }

    /// The error for a known model none of whose backends (of `kinds`) speaks this API,
    /// natively or by translation.
    fn unserved(&self, model: &str, _kinds: &[BackendKind]) -> ApiError {
        ApiError::model_not_found(model)
    }

    /// Whether the request refers to state held by one backend (a stored response), for a
    /// caller of `tenant`: that backend is then its only candidate, and the splice gives the
    /// backend its own id. `Err` when the reference is not one this tenant may use.
    fn pin(&self, _body: &[u8], _tenant: &str) -> Result<Option<Pin>, ApiError> {
        Ok(None)
    }

    /// The field of a request that asks the backend to keep state (store a response, run it in
    /// the background, continue a stored one), when it does: only backends that
    /// [`ClientApi::keeps_state`] are then candidates.
    fn needs_state(&self, _body: &[u8]) -> Option<&'static str> {
        None
    }

    /// Whether a backend of `kind` keeps what [`ClientApi::needs_state`] asks for (its answers
    /// can be fetched, cancelled and continued later).
    fn keeps_state(&self, _kind: BackendKind) -> bool {
        true
    }

    /// The error for a request that needs state when none of the model's backends (of `kinds`)
    /// keeps it.
    fn stateless(&self, model: &str, field: &'static str, kinds: &[BackendKind]) -> ApiError {
        let mut names: Vec<&str> = kinds.iter().map(|k| k.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        ApiError::bad_request(format!(
            "`{field}` needs a backend that stores responses; the model `{model}` is served \
             here only by backends that do not ({}).",
            names.join(", ")
        ))
        .with_param(field)
        .with_code("store_not_supported")
    }

    /// For an API whose ids name the backend holding them: the prefix put before every id
    /// `backend` answers with for a caller of `tenant` ([`Edits::issue_ids`]).
    fn issued_ids(&self, _backend: &str, _tenant: &str) -> Option<String> {
        None
    }

    /// The backend holding the object `id` names (a stored response), for a caller of
    /// `tenant`; `Err` (the API's not-found answer) when the id is not one this tenant may use.
    fn locate(&self, id: &str, _tenant: &str) -> Result<Pin, ApiError> {
        Err(ApiError::not_found_path(id))
    }

    /// For a whole answer that is not final (a background response still queued or running,
    /// without usage): the backend's id to follow it by (`GET <path>/<id>`) until it is.
    fn pending(&self, _whole: &[u8]) -> Option<String> {
        None
    }

    /// How a broken stream of this API is continued on another backend
    /// ([`continuation`]); `None` when it cannot be (the client gets the terminal error).
    fn continuation(&self) -> Option<&'static dyn continuation::Continuation> {
        None
    }

    /// How this API's request bodies are encoded: JSON (checked as such, parsed by
    /// [`ClientApi::parse`], sent as `application/json`) unless the API says otherwise.
    fn body_form(&self) -> BodyForm {
        BodyForm::Json
    }

    /// Parse a `multipart/form-data` body with `boundary` (asked only of an API whose
    /// [`ClientApi::body_form`] is [`BodyForm::Multipart`]; the body is forwarded with the
    /// client's content type).
    fn parse_form(&self, _boundary: &str, _body: &[u8]) -> Result<RequestFields, ApiError> {
        Err(ApiError::bad_request(
            "This endpoint does not take multipart/form-data.",
        ))
    }
}

/// A request pinned to the one backend that holds what it refers to: no other candidate, so no
/// failover to another backend either (none has that state).
#[derive(Debug, Clone)]
pub struct Pin {
    /// The id as the client sent it (for error messages).
    pub id: String,
    /// The holding backend's tag ([`responses::ids::tag`] of its configured name).
    pub holder_tag: String,
    /// The id on the holding backend.
    pub backend_id: String,
    /// Puts the backend's own id in place of the client's in a request body.
    pub splice: Option<Splice>,
}

impl Pin {
    /// Whether the backend named `backend` holds the pinned state.
    pub fn holds(&self, backend: &str) -> bool {
        responses::ids::tag(backend) == self.holder_tag
    }

    /// The error when its holder does not have it (any more).
    pub fn not_found(&self) -> ApiError {
        responses::not_found(&self.id)
    }

    /// The error when no backend of the fleet holds it any more.
    pub fn gone(&self) -> ApiError {
        responses::holder_gone(&self.id)
    }

    /// The error when its holder answered it but keeps nothing (an engine without a store).
    pub fn not_stored(&self, backend: &str) -> ApiError {
        responses::not_stored(&self.id, backend)
    }

    /// The error when its holder cannot be reached now.
    pub fn unavailable(&self, backend: &str) -> ApiError {
        responses::holder_unavailable(&self.id, backend)
    }

    /// The error when its holder does not serve the requested model.
    pub fn model_not_there(&self, backend: &str, model: &str) -> ApiError {
        ApiError::bad_request(format!(
            "Response with id '{}' is stored on backend `{backend}`, which does not serve the \
             model `{model}`.",
            self.id
        ))
        .with_param("previous_response_id")
    }
}

/// How a client API's request bodies are encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyForm {
    Json,
    Multipart,
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
    /// Why the answer ended, when this event says it (chat and completions `finish_reason`,
    /// Anthropic's `stop_reason`, the Responses API's final status).
    pub finish: Option<&'static str>,
}

/// What a whole (non-streamed) answer told the gateway.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct Whole {
    pub usage: Option<Usage>,
    /// Why the answer ended, as a label (see [`Seen::finish`]): the first choice's
    /// `finish_reason`, Anthropic's `stop_reason`, the Responses API's final `status`.
    pub finish: Option<&'static str>,
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
    /// Put this prefix before the response ids of the answer (stored responses:
    /// [`ClientApi::issued_ids`]).
    pub issue_ids: Option<Arc<str>>,
}

impl Edits {
    pub fn is_passthrough(&self) -> bool {
        self.rename_model.is_none()
            && !self.strip_usage
            && self.fill_id.is_none()
            && !self.normalize_finish
            && self.issue_ids.is_none()
    }

    /// Whether a whole (non-streamed) answer is edited (`strip_usage` is for streams only).
    pub fn edits_whole(&self) -> bool {
        self.rename_model.is_some()
            || self.fill_id.is_some()
            || self.normalize_finish
            || self.issue_ids.is_some()
    }
}
