//! The routed-field reader of a client body never panics; when it accepts a body, its spans
//! point at the values it read, and the body edits (model rename, forced
//! `stream_options.include_usage`) keep a valid JSON body valid and re-readable with the same
//! fields.
#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use serde::de::IgnoredAny;
use sluice::api::{CHAT, COMPLETIONS, EMBEDDINGS};
use sluice::openai::edit;
use sluice::openai::RequestFields;

/// Names the body is renamed to: plain, needing escapes, non-ASCII.
const RENAMES: &[&str] = &["llama3.1:8b", "a\"b\\c\n\u{2028}", "ü/モデル", ""];

fn same_routing(a: &RequestFields, b: &RequestFields) {
    assert_eq!(a.prompt_field, b.prompt_field);
    assert_eq!(a.stream, b.stream);
    assert_eq!(a.max_tokens, b.max_tokens);
    assert_eq!(a.n, b.n);
    assert_eq!(a.prompt_tokens_estimate, b.prompt_tokens_estimate);
    assert_eq!(a.prefix_hash, b.prefix_hash);
}

fuzz_target!(|data: &[u8]| {
    let Some((&sel, body)) = data.split_first() else {
        return;
    };
    let api = match sel % 3 {
        0 => CHAT,
        1 => COMPLETIONS,
        _ => EMBEDDINGS,
    };
    let Ok(fields) = api.parse(body) else {
        return;
    };

    // Spans point at the values that were read.
    let model_raw = &body[fields.model_span.clone()];
    let model: String = serde_json::from_slice(model_raw).expect("model span is a JSON string");
    assert_eq!(model, fields.model);
    if let Some(span) = &fields.stream_options_span {
        let raw = &body[span.clone()];
        serde_json::from_slice::<IgnoredAny>(raw).expect("stream_options span is JSON");
    }
    // The prompt's span (what an exact count sends to a backend's tokenizer) is one JSON value.
    let prompt_raw = &body[fields.prompt_span.clone()];
    serde_json::from_slice::<IgnoredAny>(prompt_raw).expect("prompt span is JSON");
    assert!(fields.object_start >= 1 && fields.object_start <= body.len());
    assert_eq!(body[fields.object_start - 1], b'{');

    // Edits keep a valid body valid (serde_json is the judge of "valid").
    let valid = serde_json::from_slice::<IgnoredAny>(body).is_ok();
    let to = RENAMES[usize::from(sel / 3) % RENAMES.len()];
    let bytes = Bytes::copy_from_slice(body);
    let mut splices = vec![edit::rename_model(&fields, to)];
    let forced = edit::force_include_usage(body, &fields);
    if fields.include_usage == Some(true) {
        assert!(forced.is_none());
    }
    let forcing = forced.is_some();
    splices.extend(forced);
    let out = edit::apply(&bytes, splices);
    if !valid {
        return;
    }
    serde_json::from_slice::<IgnoredAny>(&out).unwrap_or_else(|e| {
        panic!(
            "edited body is not JSON ({e}): {:?}",
            String::from_utf8_lossy(&out)
        )
    });
    if to.is_empty() {
        // An empty model is (rightly) refused by the reader; the JSON is still valid.
        return;
    }
    let again = api.parse(&out).unwrap_or_else(|e| {
        panic!(
            "edited body is refused ({e}): {:?}",
            String::from_utf8_lossy(&out)
        )
    });
    assert_eq!(again.model, to);
    if forcing {
        assert_eq!(again.include_usage, Some(true));
    } else {
        assert_eq!(again.include_usage, fields.include_usage);
    }
    same_routing(&fields, &again);
});
