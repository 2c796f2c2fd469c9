//! Exact prompt token counts from a backend's own tokenizer, for requests whose estimate is
//! large enough that its error would move a routing decision or a token limit.
//!
//! - vLLM `POST /tokenize`: the chat form (`messages`, with `add_generation_prompt`) applies the
//!   model's chat template, so its `count` is the prompt the engine will prefill; the
//!   completions form takes the `prompt` string.
//! - TGI `POST /tokenize`: raw `inputs` only (a list of tokens back), so completions with a
//!   string prompt. TGI's chat template is not applied there; chat requests keep the estimate.
//! - Ollama and OpenAI-compatible servers have no tokenizer endpoint: the estimate stays.
//!
//! Invariants: a count is asked of one routable candidate only, bounded by a timeout; any
//! failure (no capable backend, error status, unreadable answer, timeout) leaves the estimate
//! in place and is counted in `sluice_tokenize_requests_total`, never failing the request. The
//! answer is read with a size cap (vLLM returns the token ids too: ~8 bytes a token).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::Method;
use serde::Deserialize;

use super::backend::CallError;
use super::Backend;
use crate::api::{ClientApi, TokenizeForm};
use crate::config::BackendKind;
use crate::telemetry::metrics as m;

/// Largest tokenizer answer read: the ids of a 1M-token prompt.
const MAX_ANSWER_BYTES: usize = 16 * 1024 * 1024;

/// Why no exact count came back.
#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    #[error("no routable candidate can count this request's tokens")]
    NoBackend,
    #[error("request: {0}")]
    Request(String),
    #[error("status {0}")]
    Status(u16),
    #[error("unreadable answer: {0}")]
    Answer(String),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
}

impl TokenizeError {
    /// The `outcome` label.
    pub fn label(&self) -> &'static str {
        match self {
            TokenizeError::NoBackend => "no_backend",
            TokenizeError::Timeout(_) => "timeout",
            _ => "error",
        }
    }
}

/// The forms of question a tokenizer takes.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Form {
    /// vLLM, chat form: the model's template applied to `messages`.
    VllmChat,
    /// vLLM, a string `prompt`.
    VllmPrompt,
    /// TGI, raw `inputs`.
    TgiInputs,
}

/// How a backend of `kind` can count a prompt the request's API can put in `wanted` form
/// ([`ClientApi::tokenize_form`]); `None` when it cannot.
fn form(kind: BackendKind, wanted: Option<TokenizeForm>) -> Option<Form> {
    match (kind, wanted?) {
        (BackendKind::Vllm, TokenizeForm::ChatMessages) => Some(Form::VllmChat),
        (BackendKind::Vllm, TokenizeForm::Prompt) => Some(Form::VllmPrompt),
        (BackendKind::Tgi, TokenizeForm::Prompt) => Some(Form::TgiInputs),
        _ => None,
    }
}

/// The question of `form` for `prompt`, with the backend's name for the model.
fn question(form: Form, backend_model: &str, prompt: &[u8]) -> Vec<u8> {
    // A string serialises without fail.
    let model = serde_json::to_string(backend_model).unwrap_or_else(|_| "\"\"".into());
    let mut out = Vec::with_capacity(prompt.len() + model.len() + 64);
    match form {
        Form::VllmChat | Form::VllmPrompt => {
            out.extend_from_slice(b"{\"model\":");
            out.extend_from_slice(model.as_bytes());
            out.extend_from_slice(if form == Form::VllmChat {
                b",\"add_generation_prompt\":true,\"messages\":"
            } else {
                b",\"prompt\":"
            });
        }
        Form::TgiInputs => out.extend_from_slice(b"{\"inputs\":"),
    }
    out.extend_from_slice(prompt);
    out.push(b'}');
    out
}

#[derive(Deserialize)]
struct VllmCount {
    count: u64,
}

/// The count in a tokenizer's answer.
fn answer(kind: BackendKind, body: &[u8]) -> Result<u64, TokenizeError> {
    match kind {
        BackendKind::Vllm => serde_json::from_slice::<VllmCount>(body)
            .map(|c| c.count)
            .map_err(|e| TokenizeError::Answer(e.to_string())),
        _ => serde_json::from_slice::<Vec<serde::de::IgnoredAny>>(body)
            .map(|t| t.len() as u64)
            .map_err(|e| TokenizeError::Answer(e.to_string())),
    }
}

/// Turn for spreading the questions over the capable candidates.
static NEXT: AtomicUsize = AtomicUsize::new(0);

/// The exact prompt tokens of a request, from one routable candidate's tokenizer (taken in
/// turn among those that can count it). `prompt` is the raw JSON value of `messages`, `prompt`
/// or `input`.
pub async fn count(
    candidates: &[(Arc<Backend>, String)],
    api: &dyn ClientApi,
    prompt: &[u8],
    timeout: Duration,
) -> Result<u64, TokenizeError> {
    let wanted = api.tokenize_form(prompt);
    let capable: Vec<(&Backend, &str, Form)> = candidates
        .iter()
        .filter(|(b, _)| b.state.routable())
        .filter_map(|(b, m)| Some((&**b, m.as_str(), form(b.kind(), wanted)?)))
        .collect();
    if capable.is_empty() {
        m::tokenize_request("-", TokenizeError::NoBackend.label());
        return Err(TokenizeError::NoBackend);
    }
    let (backend, model, form) = capable[NEXT.fetch_add(1, Ordering::Relaxed) % capable.len()];
    let result =
        match tokio::time::timeout(timeout, ask(backend, question(form, model, prompt))).await {
            Ok(r) => r,
            Err(_) => Err(TokenizeError::Timeout(timeout)),
        };
    match &result {
        Ok(_) => m::tokenize_request(backend.name(), "ok"),
        Err(e) => {
            tracing::debug!(backend = backend.name(), "exact token count failed: {e}");
            m::tokenize_request(backend.name(), e.label());
        }
    }
    result
}

async fn ask(backend: &Backend, question: Vec<u8>) -> Result<u64, TokenizeError> {
    let (status, body) = backend
        .call(
            Method::POST,
            "/tokenize",
            Some(Bytes::from(question)),
            MAX_ANSWER_BYTES,
        )
        .await
        .map_err(|e| match e {
            CallError::Body(e) => TokenizeError::Answer(e),
            other => TokenizeError::Request(other.to_string()),
        })?;
    if !status.is_success() {
        return Err(TokenizeError::Status(status.as_u16()));
    }
    answer(backend.kind(), &body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{CHAT, COMPLETIONS, EMBEDDINGS};

    fn q(kind: BackendKind, api: &dyn ClientApi, prompt: &str) -> Option<serde_json::Value> {
        form(kind, api.tokenize_form(prompt.as_bytes())).map(|f| {
            serde_json::from_slice(&question(f, "llama \"3\"", prompt.as_bytes()))
                .expect("valid JSON")
        })
    }

    #[test]
    fn questions_by_kind_and_endpoint() {
        let msgs = r#"[{"role":"user","content":"hi \"there\""}]"#;
        let v = q(BackendKind::Vllm, CHAT, msgs).unwrap();
        assert_eq!(v["model"], "llama \"3\"");
        assert_eq!(v["add_generation_prompt"], true);
        assert_eq!(v["messages"][0]["content"], "hi \"there\"");
        let v = q(BackendKind::Vllm, COMPLETIONS, r#""once upon""#).unwrap();
        assert_eq!(v["prompt"], "once upon");
        let v = q(BackendKind::Tgi, COMPLETIONS, r#""once upon""#).unwrap();
        assert_eq!(v, serde_json::json!({"inputs": "once upon"}));
        // no template on TGI's /tokenize; token-id and batched prompts; no tokenizer at all
        assert!(q(BackendKind::Tgi, CHAT, msgs).is_none());
        assert!(q(BackendKind::Vllm, COMPLETIONS, "[1,2,3]").is_none());
        assert!(q(BackendKind::Vllm, EMBEDDINGS, r#""x""#).is_none());
        assert!(q(BackendKind::Ollama, CHAT, msgs).is_none());
        assert!(q(BackendKind::OpenAi, CHAT, msgs).is_none());
    }

    #[test]
    fn answers_by_kind() {
        let vllm = br#"{"count":17,"max_model_len":8192,"tokens":[1,2],"token_strs":null}"#;
        assert_eq!(answer(BackendKind::Vllm, vllm).unwrap(), 17);
        let tgi =
            br#"[{"id":1,"text":"a","start":0,"stop":1},{"id":2,"text":"b","start":1,"stop":2}]"#;
        assert_eq!(answer(BackendKind::Tgi, tgi).unwrap(), 2);
        for bad in [
            &b"{}"[..],
            b"",
            b"[1,",
            b"{\"count\":-1}",
            b"{\"count\":\"3\"}",
        ] {
            assert!(answer(BackendKind::Vllm, bad).is_err(), "{bad:?}");
        }
        assert!(answer(BackendKind::Tgi, b"{\"count\":3}").is_err());
    }
}
