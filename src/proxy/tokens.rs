//! The prompt's token ids from the model's own tokenizer (`[[models]] tokenizer`), for the
//! exact count and for looking up what each engine has cached.
//!
//! Invariants: tokenizing runs on the blocking pool, never on a serving thread, once per
//! request, and only when the model has a tokenizer and either some candidate's KV events are
//! live or the prompt is large enough for an exact count (`[routing] tokenize_above`); a model
//! without a tokenizer never reaches this file. A prompt the tokenizer cannot take (a template
//! that refuses it, a prompt of token ids) leaves the estimate in place: the engine, not the
//! gateway, answers for a request it would refuse.

use std::sync::Arc;

use bytes::Bytes;
use serde::Deserialize;

use crate::api::{ClientApi, TokenizeForm};
use crate::fleet::kv::Prompt;
use crate::fleet::Resolved;
use crate::openai::request::RequestFields;
use crate::telemetry::metrics as m;
use crate::tokenizer::Tokenizer;

/// Whether some candidate's engine reports its cache now (the ids would be looked up).
pub(super) fn wanted(resolved: &Resolved) -> bool {
    resolved.candidates.iter().any(|(b, _)| b.state.kv().live())
}

/// The prompt's token ids as the engine will compute them; `None` when the API's prompt is not
/// one the tokenizer takes, or tokenizing failed (counted in `sluice_tokenize_requests_total`
/// with backend `local`).
pub(super) async fn prompt_ids(
    t: &Arc<Tokenizer>,
    api: &dyn ClientApi,
    fields: &RequestFields,
    body: &Bytes,
    adapter: Option<String>,
) -> Option<Prompt> {
    let form = api.tokenize_form(body.get(fields.prompt_span.clone()).unwrap_or_default())?;
    let (t, body, span) = (t.clone(), body.clone(), fields.prompt_span.clone());
    let ids = tokio::task::spawn_blocking(move || encode(&t, form, &body, span)).await;
    match ids {
        Ok(Some(ids)) => {
            m::tokenize_request("local", "ok");
            Some(Prompt::new(ids, adapter))
        }
        _ => {
            m::tokenize_request("local", "error");
            None
        }
    }
}

fn encode(
    t: &Tokenizer,
    form: TokenizeForm,
    body: &[u8],
    span: std::ops::Range<usize>,
) -> Option<Vec<u32>> {
    match form {
        TokenizeForm::ChatMessages => t.chat_ids(body).ok(),
        TokenizeForm::Prompt => {
            let prompt: String = serde_json::from_slice(body.get(span)?).ok()?;
            t.prompt_ids(&prompt, add_special_tokens(body)).ok()
        }
    }
}

/// A completions request's `add_special_tokens` (vLLM's default: true).
fn add_special_tokens(body: &[u8]) -> bool {
    #[derive(Deserialize)]
    struct Flag {
        add_special_tokens: Option<bool>,
    }
    serde_json::from_slice::<Flag>(body)
        .ok()
        .and_then(|f| f.add_special_tokens)
        .unwrap_or(true)
}
