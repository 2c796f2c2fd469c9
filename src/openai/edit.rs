//! Small edits of a JSON body without re-serialising it.
//!
//! A request body can be megabytes of prompt; renaming its `model` or turning on
//! `stream_options.include_usage` must not parse it into a tree and print it again. Edits are byte
//! splices at spans found by [`super::request::parse`] (or [`top_level_model_span`] for responses),
//! applied in one copy. Invariant: every replacement is itself valid JSON for the slot it fills, so
//! a valid body stays valid.

use std::ops::Range;

use bytes::{Bytes, BytesMut};
use serde::Deserialize;
use serde_json::value::RawValue;

use super::RequestFields;

/// One replacement of `span` by `with`.
#[derive(Debug, Clone)]
pub struct Splice {
    pub span: Range<usize>,
    pub with: Vec<u8>,
}

/// Apply non-overlapping splices to `body` in one pass.
pub fn apply(body: &Bytes, mut splices: Vec<Splice>) -> Bytes {
    if splices.is_empty() {
        return body.clone();
    }
    splices.sort_by_key(|s| s.span.start);
    let extra: usize = splices.iter().map(|s| s.with.len()).sum();
    let mut out = BytesMut::with_capacity(body.len() + extra);
    let mut at = 0;
    for s in &splices {
        let start = s.span.start.clamp(at, body.len());
        let end = s.span.end.clamp(start, body.len());
        out.extend_from_slice(&body[at..start]);
        out.extend_from_slice(&s.with);
        at = end;
    }
    out.extend_from_slice(&body[at..]);
    out.freeze()
}

/// A JSON string literal for `s`.
pub fn json_string(s: &str) -> Vec<u8> {
    serde_json::to_vec(s).unwrap_or_else(|_| b"\"\"".to_vec())
}

/// The splice that renames the request's model.
pub fn rename_model(fields: &RequestFields, to: &str) -> Splice {
    Splice {
        span: fields.model_span.clone(),
        with: json_string(to),
    }
}

/// The splice that makes a streaming request carry `stream_options.include_usage = true`,
/// keeping any other stream option the client set. `None` if it is already on.
pub fn force_include_usage(body: &[u8], fields: &RequestFields) -> Option<Splice> {
    if fields.include_usage == Some(true) {
        return None;
    }
    match &fields.stream_options_span {
        Some(span) => {
            let raw = body.get(span.clone())?;
            let mut map = match serde_json::from_slice::<serde_json::Value>(raw) {
                Ok(serde_json::Value::Object(m)) => m,
                _ => serde_json::Map::new(),
            };
            map.insert("include_usage".into(), serde_json::Value::Bool(true));
            Some(Splice {
                span: span.clone(),
                with: serde_json::to_vec(&map).ok()?,
            })
        }
        None => {
            let comma = if fields.has_members { "," } else { "" };
            Some(Splice {
                span: fields.object_start..fields.object_start,
                with: format!(r#""stream_options":{{"include_usage":true}}{comma}"#).into_bytes(),
            })
        }
    }
}

#[derive(Deserialize)]
struct ModelOnly<'a> {
    #[serde(borrow)]
    model: Option<&'a RawValue>,
}

/// Span of the top-level `"model"` string value of a JSON object (a response or an SSE chunk).
pub fn top_level_model_span(json: &[u8]) -> Option<Range<usize>> {
    let parsed: ModelOnly<'_> = serde_json::from_slice(json).ok()?;
    let raw = parsed.model?;
    if !raw.get().starts_with('"') {
        return None;
    }
    let start = (raw.get().as_ptr() as usize).checked_sub(json.as_ptr() as usize)?;
    Some(start..start + raw.get().len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::openai::request::{parse, PromptField};

    #[test]
    fn rename_keeps_everything_else() {
        let body = Bytes::from_static(
            br#"{ "messages":[{"role":"user","content":"hi"}], "model" : "llama3", "x":1}"#,
        );
        let f = parse(PromptField::Messages, &body).unwrap();
        let out = apply(&body, vec![rename_model(&f, "llama3.1:8b")]);
        assert_eq!(
            &out[..],
            br#"{ "messages":[{"role":"user","content":"hi"}], "model" : "llama3.1:8b", "x":1}"#
        );
    }

    #[test]
    fn include_usage_inserted_or_merged() {
        let body = Bytes::from_static(
            br#"{"model":"m","stream":true,"messages":[{"role":"user","content":"x"}]}"#,
        );
        let f = parse(PromptField::Messages, &body).unwrap();
        let out = apply(
            &body,
            vec![
                force_include_usage(&body, &f).unwrap(),
                rename_model(&f, "z"),
            ],
        );
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["stream_options"]["include_usage"], true);
        assert_eq!(v["model"], "z");

        let body = Bytes::from_static(br#"{"model":"m","stream":true,"stream_options":{"include_usage":false,"continuous_usage_stats":true},"messages":[{"role":"user","content":"x"}]}"#);
        let f = parse(PromptField::Messages, &body).unwrap();
        let out = apply(&body, vec![force_include_usage(&body, &f).unwrap()]);
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["stream_options"]["include_usage"], true);
        assert_eq!(v["stream_options"]["continuous_usage_stats"], true);

        let body = Bytes::from_static(br#"{"model":"m","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"x"}]}"#);
        let f = parse(PromptField::Messages, &body).unwrap();
        assert!(force_include_usage(&body, &f).is_none());
    }

    #[test]
    fn response_model_span() {
        let json = br#"{"id":"x","model":"llama3.1:8b","choices":[]}"#;
        let span = top_level_model_span(json).unwrap();
        assert_eq!(&json[span], br#""llama3.1:8b""#);
        assert!(top_level_model_span(b"not json").is_none());
        assert!(top_level_model_span(br#"{"model":null}"#).is_none());
    }
}
