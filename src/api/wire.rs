//! The OpenAI response shapes that chat completions, completions and embeddings share: what a
//! stream chunk or a whole answer says (usage, output, an error), the edits made to one (model
//! name put back, an empty id filled, TGI's finish reason), OpenAI's error answer and event,
//! and the output a generation request expects.
//!
//! Invariants: chunks are read with borrowed [`RawValue`]s (nothing allocated per event but
//! the `choices` vector); a body that is not JSON is told apart from JSON of another shape; an
//! edit only replaces a value with a valid JSON value, so valid JSON stays valid.

use axum::response::{IntoResponse, Response};
use bytes::{Bytes, BytesMut};
use serde::Deserialize;
use serde_json::value::RawValue;

use super::{Edits, Seen, Usage, Whole};
use crate::openai::edit::{self, Splice};
use crate::openai::{ApiError, RequestFields};

/// Output tokens expected of an OpenAI generation request: `max_tokens` (or `default`) for
/// each of its `n` choices.
pub fn expected_output(fields: &RequestFields, default: u64) -> u64 {
    fields
        .max_tokens
        .unwrap_or(default)
        .saturating_mul(fields.n)
}

/// The event that ends an OpenAI stream.
pub const DONE_EVENT: &[u8] = b"data: [DONE]\n\n";

#[derive(Deserialize)]
struct ChunkLite<'a> {
    #[serde(borrow, default)]
    choices: Option<Vec<ChoiceLite<'a>>>,
    #[serde(default)]
    usage: Option<Usage>,
    #[serde(borrow, default)]
    error: Option<&'a RawValue>,
    #[serde(borrow, default)]
    model: Option<&'a RawValue>,
    #[serde(borrow, default)]
    id: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct ChoiceLite<'a> {
    #[serde(borrow, default)]
    delta: Option<DeltaLite<'a>>,
    #[serde(borrow, default)]
    text: Option<&'a RawValue>,
    #[serde(borrow, default)]
    message: Option<&'a RawValue>,
    #[serde(borrow, default)]
    finish_reason: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct DeltaLite<'a> {
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
    #[serde(borrow, default)]
    tool_calls: Option<&'a RawValue>,
    #[serde(borrow, default)]
    reasoning_content: Option<&'a RawValue>,
}

fn has_text(v: Option<&RawValue>) -> bool {
    v.is_some_and(|r| {
        let s = r.get();
        s != "null" && s != "\"\"" && s != "[]"
    })
}

pub fn inspect(data: &[u8]) -> Seen {
    if data == b"[DONE]" {
        return Seen {
            done: true,
            ..Seen::default()
        };
    }
    let chunk = match serde_json::from_slice::<ChunkLite<'_>>(data) {
        Ok(c) => c,
        Err(e) => {
            return Seen {
                invalid: !is_json(data, &e),
                ..Seen::default()
            }
        }
    };
    let mut seen = Seen {
        usage: chunk.usage,
        error: chunk.error.is_some(),
        ..Seen::default()
    };
    if let Some(choices) = &chunk.choices {
        seen.finish = choices
            .iter()
            .find_map(|c| c.finish_reason.and_then(finish_name));
        seen.usage_only = choices.is_empty() && chunk.usage.is_some();
        seen.text = choices.iter().any(|c| {
            has_text(c.text)
                || has_text(c.message)
                || c.delta.as_ref().is_some_and(|d| {
                    has_text(d.content) || has_text(d.tool_calls) || has_text(d.reasoning_content)
                })
        });
    }
    seen
}

/// A finish reason as a label: the known ones by name, any other string `other`, `null`
/// none (trace attributes take only these, never text an engine made up).
pub fn finish_name(raw: &RawValue) -> Option<&'static str> {
    Some(match raw.get() {
        "null" => return None,
        "\"stop\"" => "stop",
        "\"length\"" => "length",
        "\"tool_calls\"" => "tool_calls",
        "\"function_call\"" => "function_call",
        "\"content_filter\"" => "content_filter",
        "\"abort\"" => "abort",
        "\"end_turn\"" => "end_turn",
        "\"max_tokens\"" => "max_tokens",
        "\"stop_sequence\"" => "stop_sequence",
        "\"tool_use\"" => "tool_use",
        "\"pause_turn\"" => "pause_turn",
        "\"refusal\"" => "refusal",
        _ => "other",
    })
}

/// Whether `data`, which failed to read as a chunk with `e`, is JSON all the same. A data error
/// (a wrong type) stops serde before the rest is read, so the rest is checked: found by
/// fuzzing, `{"choices":0` followed by garbage was taken for JSON of another shape.
pub fn is_json(data: &[u8], e: &serde_json::Error) -> bool {
    e.is_data() && serde_json::from_slice::<serde::de::IgnoredAny>(data).is_ok()
}

/// Apply `edits` to one JSON object (a chunk or a whole response).
pub fn edit_json(json: &[u8], edits: &Edits) -> Option<Bytes> {
    let chunk: ChunkLite<'_> = serde_json::from_slice(json).ok()?;
    let mut splices = Vec::new();
    let offset = |raw: &RawValue| (raw.get().as_ptr() as usize).checked_sub(json.as_ptr() as usize);
    if let (Some(to), Some(raw)) = (&edits.rename_model, chunk.model) {
        if raw.get().starts_with('"') {
            let start = offset(raw)?;
            splices.push(Splice {
                span: start..start + raw.get().len(),
                with: edit::json_string(to),
            });
        }
    }
    if let (Some(id), Some(raw)) = (&edits.fill_id, chunk.id) {
        if raw.get() == "\"\"" {
            let start = offset(raw)?;
            splices.push(Splice {
                span: start..start + raw.get().len(),
                with: edit::json_string(id),
            });
        }
    }
    let mut out = edit::apply(&Bytes::copy_from_slice(json), splices);
    if edits.normalize_finish {
        let needle: &[u8] = br#""finish_reason":"stop_sequence""#;
        if out.windows(needle.len()).any(|w| w == needle) {
            let text = String::from_utf8_lossy(&out).replace(
                r#""finish_reason":"stop_sequence""#,
                r#""finish_reason":"stop""#,
            );
            out = Bytes::from(text);
        }
    }
    Some(out)
}

/// The usage and the first choice's finish reason of a whole (non-streamed) response; `Err`
/// when the body is not JSON at all (valid JSON of an unexpected shape says nothing).
pub fn whole(json: &[u8]) -> Result<Whole, serde_json::Error> {
    /// Only `usage` and each choice's `finish_reason` are read; the rest is skipped (and
    /// checked to be JSON) without allocating.
    #[derive(Deserialize)]
    struct Answer {
        #[serde(default)]
        usage: Option<Usage>,
        #[serde(default)]
        choices: Option<FirstFinish>,
    }
    match serde_json::from_slice::<Answer>(json) {
        Ok(a) => Ok(Whole {
            usage: a.usage,
            finish: a.choices.and_then(|c| c.0),
        }),
        // Choices of another shape: the usage alone (a rare second pass, never for an engine
        // that answers as OpenAI does).
        Err(e) if is_json(json, &e) => Ok(Whole {
            usage: whole_usage(json).ok().flatten(),
            finish: None,
        }),
        Err(e) => Err(e),
    }
}

/// The usage of a whole (non-streamed) response; `Err` when the body is not JSON at all (valid
/// JSON of an unexpected shape is `Ok(None)`).
pub fn whole_usage(json: &[u8]) -> Result<Option<Usage>, serde_json::Error> {
    /// Only `usage` is read; the rest is skipped (and checked to be JSON) without allocating.
    #[derive(Deserialize)]
    struct Answer {
        #[serde(default)]
        usage: Option<Usage>,
    }
    match serde_json::from_slice::<Answer>(json) {
        Ok(c) => Ok(c.usage),
        Err(e) if is_json(json, &e) => Ok(None),
        Err(e) => Err(e),
    }
}

/// The first finish reason among a whole answer's `choices`, read choice by choice without
/// collecting them.
struct FirstFinish(Option<&'static str>);

impl<'de> Deserialize<'de> for FirstFinish {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Choices;
        impl<'de> serde::de::Visitor<'de> for Choices {
            type Value = FirstFinish;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a list of choices")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Self::Value, A::Error> {
                let mut first = None;
                while let Some(c) = seq.next_element::<FinishLite<'de>>()? {
                    first = first.or_else(|| c.finish_reason.and_then(finish_name));
                }
                Ok(FirstFinish(first))
            }
        }
        d.deserialize_seq(Choices)
    }
}

/// A whole answer's choice as far as its finish reason.
#[derive(Deserialize)]
struct FinishLite<'a> {
    #[serde(borrow, default)]
    finish_reason: Option<&'a RawValue>,
}

/// OpenAI's terminal error: the error object as a data event, then `[DONE]`, so the SDKs
/// raise (they read an `error` member of a chunk as a failure).
pub fn stream_error_event(err: &ApiError) -> Bytes {
    let mut event = BytesMut::new();
    event.extend_from_slice(b"data: ");
    event.extend_from_slice(err.body_json().as_bytes());
    event.extend_from_slice(b"\n\n");
    event.extend_from_slice(DONE_EVENT);
    event.freeze()
}

/// OpenAI's error answer: `{"error":{message,type,param,code}}` with its status and
/// `Retry-After`.
pub fn error_response(err: ApiError) -> Response {
    err.into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The finish reason of a stream's events, chat's and Anthropic's and the Responses API's,
    /// as a label; text an engine made up is `other`, never copied.
    #[test]
    fn finish_reasons_are_read_as_labels() {
        let chat = br#"{"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}"#;
        assert_eq!(inspect(chat).finish, Some("length"));
        let open = br#"{"choices":[{"index":0,"delta":{"content":"x"},"finish_reason":null}]}"#;
        assert_eq!(inspect(open).finish, None);
        let odd = br#"{"choices":[{"index":0,"delta":{},"finish_reason":"made up text"}]}"#;
        assert_eq!(inspect(odd).finish, Some("other"));
        let messages = br#"{"type":"message_delta","delta":{"stop_reason":"max_tokens"},"usage":{"output_tokens":6}}"#;
        assert_eq!(
            crate::api::messages::MESSAGES.inspect(messages).finish,
            Some("max_tokens")
        );
        let text = br#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"hi"}}"#;
        assert_eq!(crate::api::messages::MESSAGES.inspect(text).finish, None);
        let done = br#"{"type":"response.incomplete","response":{"status":"incomplete"}}"#;
        assert_eq!(
            crate::api::responses::RESPONSES.inspect(done).finish,
            Some("incomplete")
        );
    }

    /// A whole answer's finish reason is read with its usage, in the same pass: the first
    /// choice that names one for chat and completions, Anthropic's `stop_reason`, a final
    /// Responses `status`; choices of another shape keep the usage.
    #[test]
    fn whole_answers_say_why_they_ended() {
        let chat = br#"{"choices":[{"index":0,"message":{"content":"hi"},"finish_reason":"length"}],"usage":{"prompt_tokens":3,"completion_tokens":2}}"#;
        let w = whole(chat).unwrap();
        assert_eq!(
            (w.finish, w.usage.map(|u| u.completion_tokens)),
            (Some("length"), Some(2))
        );
        let two = br#"{"choices":[{"text":"a","finish_reason":null},{"text":"b","finish_reason":"stop"}]}"#;
        assert_eq!(whole(two).unwrap().finish, Some("stop"));
        let odd = br#"{"choices":[1,2],"usage":{"prompt_tokens":3,"completion_tokens":2}}"#;
        let w = whole(odd).unwrap();
        assert_eq!(
            (w.finish, w.usage.map(|u| u.prompt_tokens)),
            (None, Some(3))
        );
        assert_eq!(whole(br#"{"choices":null}"#).unwrap(), Whole::default());
        assert!(whole(b"{\"choices\":[ garbage").is_err());
        let messages = br#"{"type":"message","stop_reason":"end_turn","usage":{"input_tokens":4,"output_tokens":1}}"#;
        let w = crate::api::messages::MESSAGES.whole(messages).unwrap();
        assert_eq!(
            (w.finish, w.usage.map(|u| u.prompt_tokens)),
            (Some("end_turn"), Some(4))
        );
        let responses = crate::api::responses::RESPONSES;
        let done = br#"{"object":"response","status":"incomplete","usage":{"input_tokens":4,"output_tokens":9}}"#;
        assert_eq!(responses.whole(done).unwrap().finish, Some("incomplete"));
        let queued = br#"{"object":"response","status":"queued"}"#;
        assert_eq!(responses.whole(queued).unwrap().finish, None);
    }

    #[test]
    fn inspect_chunks() {
        let s = inspect(br#"{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}"#);
        assert!(!s.text);
        let s = inspect(br#"{"choices":[{"index":0,"delta":{"content":"Hi"}}],"usage":null}"#);
        assert!(s.text && s.usage.is_none());
        let s = inspect(br#"{"choices":[],"usage":{"prompt_tokens":10,"total_tokens":16,"completion_tokens":6}}"#);
        assert!(s.usage_only);
        assert_eq!(
            s.usage,
            Some(Usage {
                prompt_tokens: 10,
                cached_tokens: None,
                completion_tokens: 6
            })
        );
        assert!(inspect(b"[DONE]").done);
        assert!(
            inspect(br#"{"error":{"message":"Model is overloaded","http_status_code":422}}"#).error
        );
        assert!(inspect(br#"{"choices":[{"text":" sh","index":0}]}"#).text);
        // A wrong type early, then garbage: not JSON (found by fuzzing).
        assert!(inspect(b"{\"choices\":0 \x82garbage").invalid);
        assert!(!inspect(br#"{"choices":0}"#).invalid);
        assert!(whole_usage(b"{\"usage\":5 garbage").is_err());
        assert_eq!(whole_usage(br#"{"usage":5}"#).ok(), Some(None));
    }

    #[test]
    fn edits_rename_fill_and_normalise() {
        let edits = Edits {
            rename_model: Some("llama3".into()),
            fill_id: Some("chatcmpl-x".into()),
            normalize_finish: true,
            strip_usage: false,
            redact: None,
            issue_ids: None,
        };
        let out = edit_json(
            br#"{"id":"","model":"llama-3.1-8b","choices":[{"finish_reason":"stop_sequence"}]}"#,
            &edits,
        )
        .unwrap();
        assert_eq!(
            &out[..],
            br#"{"id":"chatcmpl-x","model":"llama3","choices":[{"finish_reason":"stop"}]}"#
        );
    }

    #[test]
    fn whole_usage_reads_usage_and_rejects_what_is_not_json() {
        let whole = br#"{"id":"x","choices":[{"message":{"content":"\"usage\": 9"}}],"usage":{"prompt_tokens":1,"completion_tokens":2,"total_tokens":3}}"#;
        let u = whole_usage(whole).unwrap().unwrap();
        assert_eq!((u.prompt_tokens, u.completion_tokens), (1, 2));
        assert_eq!(whole_usage(br#"{"id":"x","choices":[]}"#).unwrap(), None);
        assert_eq!(
            whole_usage(br#"{"usage":"soon"}"#).unwrap(),
            None,
            "JSON of another shape"
        );
        assert_eq!(whole_usage(b"[1,2]").unwrap(), None);
        assert!(
            whole_usage(br#"{"usage":{"prompt_tokens":1"#).is_err(),
            "cut body"
        );
        assert!(
            whole_usage(b"data: {}\n\n").is_err(),
            "an event stream is not JSON"
        );
    }
}
