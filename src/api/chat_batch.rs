//! vLLM's batch chat, `POST /v1/chat/completions/batch`: `messages` is a list of
//! conversations, answered whole as one `chat.completion` with one choice per conversation and
//! the usage summed over them. Never streamed. Only vLLM serves it.
//!
//! Invariant: limits reserve for every conversation: the expected output is `max_tokens` (or
//! the model's default) times the number of conversations, and the settlement reconciles with
//! the summed usage of the answer.

use serde::Deserialize;
use serde_json::value::RawValue;

use super::engine::{check_object, fields, model_of, span_of};
use super::{ClientApi, TokenizeForm};
use crate::config::BackendKind;
use crate::openai::edit::Splice;
use crate::openai::request::MAX_TOKENS_LIMIT;
use crate::openai::{ApiError, RequestFields};

/// Batch chat completions.
pub struct ChatBatch;

/// The batch chat API.
pub static CHAT_BATCH: &dyn ClientApi = &ChatBatch;

/// Most conversations accepted in one call.
pub const MAX_CONVERSATIONS: u64 = 1024;

#[derive(Deserialize)]
struct Wire<'a> {
    #[serde(borrow)]
    model: Option<&'a RawValue>,
    #[serde(borrow)]
    messages: Option<Vec<&'a RawValue>>,
    max_tokens: Option<Option<u64>>,
    max_completion_tokens: Option<Option<u64>>,
}

impl ClientApi for ChatBatch {
    fn path(&self) -> &'static str {
        "/v1/chat/completions/batch"
    }

    fn label(&self) -> &'static str {
        "chat_batch"
    }

    fn parse(&self, body: &[u8]) -> Result<RequestFields, ApiError> {
        let start = check_object(body)?;
        let wire: Wire<'_> = serde_json::from_slice(body).map_err(|e| {
            ApiError::bad_request(format!(
                "Invalid batch request (`messages` is a list of conversations, `max_tokens` a \
                 non-negative integer): {e}"
            ))
        })?;
        let model = model_of(wire.model)?;
        let span = wire.model.map(|r| span_of(body, r)).unwrap_or_default();
        let convs = wire.messages.ok_or_else(|| {
            ApiError::bad_request("`messages` is required.").with_param("messages")
        })?;
        if convs.iter().any(|c| !c.get().starts_with('[')) {
            return Err(ApiError::bad_request(
                "`messages` must be a list of conversations (each a list of messages).",
            )
            .with_param("messages"));
        }
        let n = convs.len() as u64;
        if n == 0 || n > MAX_CONVERSATIONS {
            return Err(ApiError::bad_request(format!(
                "`messages` must hold between 1 and {MAX_CONVERSATIONS} conversations."
            ))
            .with_param("messages"));
        }
        let max_tokens = wire
            .max_completion_tokens
            .flatten()
            .or(wire.max_tokens.flatten());
        if max_tokens.is_some_and(|m| m > MAX_TOKENS_LIMIT) {
            return Err(ApiError::bad_request(format!(
                "`max_tokens` is beyond any model's context; the limit is {MAX_TOKENS_LIMIT}."
            ))
            .with_param("max_tokens"));
        }
        let mut f = fields(body, model, span, start + 1);
        f.prompt_field = crate::openai::request::PromptField::Messages;
        f.max_tokens = max_tokens;
        f.n = n;
        Ok(f)
    }

    fn streams(&self, _fields: &RequestFields) -> bool {
        false
    }

    fn force_stream_usage(&self, _body: &[u8], _fields: &RequestFields) -> Option<Splice> {
        None
    }

    fn id_prefix(&self) -> &'static str {
        "chatcmpl-"
    }

    fn native(&self, kind: BackendKind) -> bool {
        kind == BackendKind::Vllm
    }

    fn tokenize_form(&self, _prompt: &[u8]) -> Option<TokenizeForm> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_reserve_for_every_conversation() {
        let body = br#"{"model":"m","messages":[[{"role":"user","content":"a"}],[{"role":"user","content":"b"}],[]],"max_tokens":5}"#;
        let f = CHAT_BATCH.parse(body).unwrap();
        assert_eq!((f.model.as_str(), f.n, f.max_tokens), ("m", 3, Some(5)));
        assert_eq!(CHAT_BATCH.expected_output(&f, 100), 15);
        let f = CHAT_BATCH
            .parse(br#"{"model":"m","messages":[[],[]]}"#)
            .unwrap();
        assert_eq!(CHAT_BATCH.expected_output(&f, 100), 200);
        assert!(!CHAT_BATCH.streams(&f));
        for bad in [
            &br#"{"model":"m"}"#[..],
            br#"{"model":"m","messages":[]}"#,
            br#"{"model":"m","messages":[{"role":"user"}]}"#,
            br#"{"model":"m","messages":[[]],"max_tokens":-1}"#,
            br#"{"messages":[[]]}"#,
        ] {
            assert_eq!(CHAT_BATCH.parse(bad).unwrap_err().status, 400);
        }
    }

    #[test]
    fn summed_usage_of_the_answer() {
        let whole = br#"{"object":"chat.completion","choices":[],"usage":{"prompt_tokens":16,"total_tokens":22,"completion_tokens":6}}"#;
        let u = CHAT_BATCH.whole_usage(whole).unwrap().unwrap();
        assert_eq!((u.prompt_tokens, u.completion_tokens), (16, 6));
        assert!(CHAT_BATCH.native(BackendKind::Vllm) && !CHAT_BATCH.native(BackendKind::Tgi));
    }
}
