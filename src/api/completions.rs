//! OpenAI (legacy) completions, `POST /v1/completions`: the prompt is `prompt` (a string or an
//! array), streamed on `stream: true` with usage forced by `stream_options.include_usage`; a
//! string prompt can be counted by a tokenizer as it is. Every backend kind speaks it natively.

use super::{ClientApi, TokenizeForm};
use crate::openai::request::{self, PromptField};
use crate::openai::{ApiError, RequestFields};

/// Completions.
pub struct Completions;

/// The completions API.
pub static COMPLETIONS: &dyn ClientApi = &Completions;

impl ClientApi for Completions {
    fn path(&self) -> &'static str {
        "/v1/completions"
    }

    fn label(&self) -> &'static str {
        "completions"
    }

    fn parse(&self, body: &[u8]) -> Result<RequestFields, ApiError> {
        request::parse(PromptField::Prompt, body)
    }

    fn id_prefix(&self) -> &'static str {
        "cmpl-"
    }

    fn tokenize_form(&self, prompt: &[u8]) -> Option<TokenizeForm> {
        // Token ids and batches of prompts are not one text to count.
        (prompt.first() == Some(&b'"')).then_some(TokenizeForm::Prompt)
    }

    fn continuation(&self) -> Option<&'static dyn super::continuation::Continuation> {
        Some(super::continuation::COMPLETIONS_CONTINUATION)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::Edits;
    use crate::config::BackendKind;

    #[test]
    fn routed_fields_and_output() {
        let body = br#"{"model":"m","stream":true,"max_tokens":7,"prompt":"abcdabcd"}"#;
        let f = COMPLETIONS.parse(body).unwrap();
        assert_eq!(f.prompt_field, PromptField::Prompt);
        assert_eq!(&body[f.prompt_span.clone()], br#""abcdabcd""#);
        assert_eq!(f.prompt_tokens_estimate, 3);
        assert!(COMPLETIONS.streams(&f));
        assert_eq!(COMPLETIONS.expected_output(&f, 100), 7);
        assert!(COMPLETIONS.parse(br#"{"model":"m","prompt":5}"#).is_err());
        assert!(COMPLETIONS
            .parse(br#"{"model":"m","messages":[]}"#)
            .is_err());
        assert_eq!(
            (
                COMPLETIONS.path(),
                COMPLETIONS.label(),
                COMPLETIONS.id_prefix()
            ),
            ("/v1/completions", "completions", "cmpl-")
        );
        assert_eq!(
            COMPLETIONS.tokenize_form(br#""once""#),
            Some(TokenizeForm::Prompt)
        );
        assert_eq!(COMPLETIONS.tokenize_form(b"[1,2,3]"), None);
        assert!(COMPLETIONS.native(BackendKind::Tgi));
    }

    #[test]
    fn usage_whole_and_streamed() {
        let whole = br#"{"id":"","choices":[{"text":"x","finish_reason":"stop_sequence"}],"usage":{"prompt_tokens":2,"completion_tokens":5}}"#;
        let u = COMPLETIONS.whole_usage(whole).unwrap().unwrap();
        assert_eq!((u.prompt_tokens, u.completion_tokens), (2, 5));
        let edits = Edits {
            fill_id: Some("cmpl-r".into()),
            normalize_finish: true,
            ..Edits::default()
        };
        let out = COMPLETIONS.edit(whole, &edits).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(
            (v["id"].as_str(), v["choices"][0]["finish_reason"].as_str()),
            (Some("cmpl-r"), Some("stop"))
        );
        assert!(
            COMPLETIONS
                .inspect(br#"{"choices":[{"text":" sh","index":0}]}"#)
                .text
        );
        assert!(
            !COMPLETIONS
                .inspect(br#"{"choices":[{"text":"","index":0}]}"#)
                .text
        );
        assert!(COMPLETIONS.inspect(b"[DONE]").done);
        assert_eq!(COMPLETIONS.end_event(), Some(&b"data: [DONE]\n\n"[..]));
    }

    #[test]
    fn errors_are_openai_shaped() {
        let event = COMPLETIONS.stream_error_event(&ApiError::bad_gateway("cut"));
        assert!(event.starts_with(b"data: {\"error\":{\"message\":\"cut\""));
        assert!(event.ends_with(b"\n\ndata: [DONE]\n\n"));
        let resp = COMPLETIONS.error_response(ApiError::payload_too_large(10));
        assert_eq!(resp.status(), 413);
    }
}
