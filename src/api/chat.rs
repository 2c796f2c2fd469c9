//! OpenAI chat completions, `POST /v1/chat/completions`: the prompt is `messages`, streamed on
//! `stream: true` with usage forced by `stream_options.include_usage`, and counted by a
//! tokenizer with the model's chat template applied. Every backend kind speaks it natively.

use super::{ClientApi, TokenizeForm};
use crate::openai::request::{self, PromptField};
use crate::openai::{ApiError, RequestFields};

/// Chat completions.
pub struct Chat;

/// The chat completions API.
pub static CHAT: &dyn ClientApi = &Chat;

impl ClientApi for Chat {
    fn path(&self) -> &'static str {
        "/v1/chat/completions"
    }

    fn label(&self) -> &'static str {
        "chat"
    }

    fn parse(&self, body: &[u8]) -> Result<RequestFields, ApiError> {
        request::parse(PromptField::Messages, body)
    }

    fn id_prefix(&self) -> &'static str {
        "chatcmpl-"
    }

    fn tokenize_form(&self, _prompt: &[u8]) -> Option<TokenizeForm> {
        Some(TokenizeForm::ChatMessages)
    }

    fn continuation(&self) -> Option<&'static dyn super::continuation::Continuation> {
        Some(super::continuation::CHAT_CONTINUATION)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::BackendKind;
    use crate::openai::edit;
    use bytes::Bytes;

    #[test]
    fn routed_fields_and_output() {
        let body = br#"{"model":"m","stream":true,"max_tokens":10,"n":2,"messages":[{"role":"user","content":"hi"}]}"#;
        let f = CHAT.parse(body).unwrap();
        assert_eq!(f.prompt_field, PromptField::Messages);
        assert_eq!(
            &body[f.prompt_span.clone()],
            br#"[{"role":"user","content":"hi"}]"#
        );
        assert!(CHAT.streams(&f));
        assert_eq!(CHAT.expected_output(&f, 100), 20);
        assert!(CHAT.parse(br#"{"model":"m","prompt":"x"}"#).is_err());
        let f = CHAT
            .parse(br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#)
            .unwrap();
        assert_eq!(CHAT.expected_output(&f, 100), 100);
        assert_eq!(
            (CHAT.path(), CHAT.label()),
            ("/v1/chat/completions", "chat")
        );
        assert_eq!(CHAT.tokenize_form(b"[]"), Some(TokenizeForm::ChatMessages));
        assert_eq!(CHAT.id_prefix(), "chatcmpl-");
        for kind in [
            BackendKind::Vllm,
            BackendKind::Tgi,
            BackendKind::Ollama,
            BackendKind::OpenAi,
        ] {
            assert!(CHAT.native(kind));
        }
    }

    #[test]
    fn usage_forced_and_renamed_in_the_body() {
        let body = Bytes::from_static(
            br#"{"model":"m","stream":true,"messages":[{"role":"user","content":"x"}]}"#,
        );
        let f = CHAT.parse(&body).unwrap();
        let splices = vec![
            CHAT.rename_model(&f, "b"),
            CHAT.force_stream_usage(&body, &f).unwrap(),
        ];
        let v: serde_json::Value = serde_json::from_slice(&edit::apply(&body, splices)).unwrap();
        assert_eq!(v["model"], "b");
        assert_eq!(v["stream_options"]["include_usage"], true);
    }

    #[test]
    fn usage_whole_and_streamed() {
        let whole = br#"{"id":"x","choices":[{"message":{"role":"assistant","content":"hi"}}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}"#;
        let u = CHAT.whole_usage(whole).unwrap().unwrap();
        assert_eq!((u.prompt_tokens, u.completion_tokens), (3, 1));
        let s = CHAT.inspect(br#"{"choices":[{"index":0,"delta":{"content":"Hi"}}]}"#);
        assert!(s.text && !s.usage_only);
        let s = CHAT.inspect(br#"{"choices":[{"index":0,"delta":{"tool_calls":[{"id":"t"}]}}]}"#);
        assert!(s.text);
        let s = CHAT.inspect(
            br#"{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}"#,
        );
        assert!(s.usage_only && s.usage.is_some());
        assert!(CHAT.inspect(b"[DONE]").done);
        assert_eq!(CHAT.end_event(), Some(&b"data: [DONE]\n\n"[..]));
    }

    #[test]
    fn errors_are_openai_shaped() {
        let err = ApiError::bad_gateway("gone");
        let event = CHAT.stream_error_event(&err);
        let text = std::str::from_utf8(&event).unwrap();
        let data = text
            .strip_prefix("data: ")
            .and_then(|t| t.strip_suffix("\n\ndata: [DONE]\n\n"))
            .unwrap();
        let v: serde_json::Value = serde_json::from_str(data).unwrap();
        assert_eq!(v["error"]["message"], "gone");
        assert_eq!(v["error"]["type"], "server_error");
        let resp = CHAT.error_response(ApiError::model_not_found("x"));
        assert_eq!(resp.status(), 404);
        assert_eq!(resp.headers()["content-type"], "application/json");
    }
}
