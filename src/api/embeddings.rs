//! OpenAI embeddings, `POST /v1/embeddings`: the input is `input` (a string or an array); the
//! answer is never streamed (a `stream` field is ignored) and produces no output tokens. No
//! tokenizer form: the estimate stands. Every backend kind is sent it as it is.

use super::{ClientApi, TokenizeForm};
use crate::openai::request::{self, PromptField};
use crate::openai::{ApiError, RequestFields};

/// Embeddings.
pub struct Embeddings;

/// The embeddings API.
pub static EMBEDDINGS: &dyn ClientApi = &Embeddings;

impl ClientApi for Embeddings {
    fn path(&self) -> &'static str {
        "/v1/embeddings"
    }

    fn label(&self) -> &'static str {
        "embeddings"
    }

    fn parse(&self, body: &[u8]) -> Result<RequestFields, ApiError> {
        request::parse(PromptField::Input, body)
    }

    fn streams(&self, _fields: &RequestFields) -> bool {
        false
    }

    fn expected_output(&self, _fields: &RequestFields, _default: u64) -> u64 {
        0
    }

    fn id_prefix(&self) -> &'static str {
        "embd-"
    }

    fn tokenize_form(&self, _prompt: &[u8]) -> Option<TokenizeForm> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::BackendKind;

    #[test]
    fn routed_fields_and_output() {
        let f = EMBEDDINGS
            .parse(br#"{"model":"m","input":["a","b"]}"#)
            .unwrap();
        assert_eq!(f.prompt_field, PromptField::Input);
        assert_eq!(EMBEDDINGS.expected_output(&f, 100), 0);
        let f = EMBEDDINGS
            .parse(br#"{"model":"m","stream":true,"max_tokens":9,"input":"a"}"#)
            .unwrap();
        assert!(!EMBEDDINGS.streams(&f), "embeddings are never streamed");
        assert_eq!(EMBEDDINGS.expected_output(&f, 100), 0);
        assert!(EMBEDDINGS.parse(br#"{"model":"m"}"#).is_err());
        assert_eq!(
            (
                EMBEDDINGS.path(),
                EMBEDDINGS.label(),
                EMBEDDINGS.id_prefix()
            ),
            ("/v1/embeddings", "embeddings", "embd-")
        );
        assert_eq!(EMBEDDINGS.tokenize_form(br#""x""#), None);
        assert!(EMBEDDINGS.native(BackendKind::Ollama));
    }

    #[test]
    fn usage_of_a_whole_answer() {
        let whole = br#"{"object":"list","data":[{"embedding":[0.1]}],"usage":{"prompt_tokens":4,"total_tokens":4}}"#;
        let u = EMBEDDINGS.whole_usage(whole).unwrap().unwrap();
        assert_eq!((u.prompt_tokens, u.completion_tokens), (4, 0));
        assert!(EMBEDDINGS.whole_usage(b"data: {}").is_err());
    }

    #[test]
    fn errors_are_openai_shaped() {
        let resp = EMBEDDINGS.error_response(ApiError::bad_request("no"));
        assert_eq!(resp.status(), 400);
        let event = EMBEDDINGS.stream_error_event(&ApiError::bad_gateway("x"));
        assert!(event.ends_with(b"data: [DONE]\n\n"));
    }
}
