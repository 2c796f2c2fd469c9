//! The engines' own JSON paths that Sluice forwards as they are: one request, one whole JSON
//! answer, routed by the body's `model` (`/tokenize`, `/detokenize`, `/v1/rerank`, `/rerank`,
//! `/v1/score`). [`EnginePath`] is the one [`ClientApi`] behind them; the statics live in
//! [`super::tokenize`] and [`super::pooling`].
//!
//! Invariants: only `model` (and its span, for a backend's own model name) is read from the
//! body; the rest goes to the backend byte for byte. These answers are never streamed and
//! produce no output tokens; the prompt estimate is the body's size, so limits still reserve
//! for the request. Only backend kinds listed in [`EnginePath::kinds`] are candidates.

use std::ops::Range;

use serde::Deserialize;
use serde_json::value::RawValue;

use super::{ClientApi, TokenizeForm};
use crate::config::BackendKind;
use crate::openai::edit::Splice;
use crate::openai::request::{self, PromptField};
use crate::openai::{ApiError, RequestFields};

/// One engine path: where it is, its metrics label and the backend kinds that serve it.
pub struct EnginePath {
    pub path: &'static str,
    pub label: &'static str,
    pub kinds: &'static [BackendKind],
}

/// The fields of an engine request body: `model`, and the members whose size is the prompt.
#[derive(Deserialize)]
struct Wire<'a> {
    #[serde(borrow)]
    model: Option<&'a RawValue>,
}

/// The byte span of a borrowed raw value inside `body`.
pub(crate) fn span_of(body: &[u8], raw: &RawValue) -> Range<usize> {
    let start = (raw.get().as_ptr() as usize).saturating_sub(body.as_ptr() as usize);
    start..(start + raw.get().len()).min(body.len())
}

/// Check that `body` is one JSON object nested no deeper than [`request::MAX_DEPTH`].
pub(crate) fn check_object(body: &[u8]) -> Result<usize, ApiError> {
    let start = body
        .iter()
        .position(|b| !b.is_ascii_whitespace())
        .ok_or_else(|| {
            ApiError::bad_request("The request body is empty; expected a JSON object.")
        })?;
    if body[start] != b'{' {
        return Err(ApiError::bad_request(
            "The request body must be a JSON object.",
        ));
    }
    if request::nesting_depth(body) > request::MAX_DEPTH {
        return Err(ApiError::bad_request(format!(
            "The request body is nested more than {} levels deep.",
            request::MAX_DEPTH
        ))
        .with_code("invalid_json"));
    }
    Ok(start)
}

/// The `model` member: a non-empty string.
pub(crate) fn model_of(raw: Option<&RawValue>) -> Result<String, ApiError> {
    let raw = raw.ok_or_else(|| {
        ApiError::bad_request("you must provide a model parameter").with_param("model")
    })?;
    match serde_json::from_str::<serde_json::Value>(raw.get()) {
        Ok(serde_json::Value::String(s)) if !s.is_empty() => Ok(s),
        Ok(serde_json::Value::String(_)) => {
            Err(ApiError::bad_request("`model` must not be empty.").with_param("model"))
        }
        _ => Err(ApiError::bad_request("`model` must be a string.").with_param("model")),
    }
}

/// Routed fields of a request that carries only its model: no stream, no output, the whole
/// body counted as prompt (bytes / 4) so limits reserve for it.
pub(crate) fn fields(
    body: &[u8],
    model: String,
    model_span: Range<usize>,
    object_start: usize,
) -> RequestFields {
    RequestFields {
        prompt_field: PromptField::Input,
        model,
        model_span,
        stream: false,
        include_usage: None,
        stream_options_span: None,
        max_tokens: Some(0),
        n: 1,
        prompt_tokens_estimate: (body.len() as u64).div_ceil(4),
        prefix_hash: None,
        prefix_tokens_estimate: 0,
        prompt_span: 0..0,
        object_start,
        has_members: true,
    }
}

impl ClientApi for EnginePath {
    fn path(&self) -> &'static str {
        self.path
    }

    fn label(&self) -> &'static str {
        self.label
    }

    fn parse(&self, body: &[u8]) -> Result<RequestFields, ApiError> {
        let start = check_object(body)?;
        let wire: Wire<'_> = serde_json::from_slice(body).map_err(ApiError::invalid_json)?;
        let model = model_of(wire.model)?;
        let span = wire.model.map(|r| span_of(body, r)).unwrap_or_default();
        Ok(fields(body, model, span, start + 1))
    }

    fn streams(&self, _fields: &RequestFields) -> bool {
        false
    }

    fn expected_output(&self, _fields: &RequestFields, _default: u64) -> u64 {
        0
    }

    fn force_stream_usage(&self, _body: &[u8], _fields: &RequestFields) -> Option<Splice> {
        None
    }

    fn id_prefix(&self) -> &'static str {
        ""
    }

    fn native(&self, kind: BackendKind) -> bool {
        self.kinds.contains(&kind)
    }

    fn tokenize_form(&self, _prompt: &[u8]) -> Option<TokenizeForm> {
        None
    }
}
