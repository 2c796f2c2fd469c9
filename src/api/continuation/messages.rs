//! Continuing an Anthropic Messages stream. vLLM's Messages endpoint cannot continue a partial
//! answer (it renders a trailing assistant message as a finished turn and opens a new one), so
//! the continuation is asked of the same engine's chat completions endpoint — the request
//! converted as vLLM's Anthropic handler converts it, plus the partial answer as an open
//! assistant message (`continue_final_message`) — and its chunks are written back as the
//! Messages events that continue the answer: text deltas in the open text block, then
//! `content_block_stop`, `message_delta` (stop reason, the answer's usage) and `message_stop`.
//!
//! Only text answers to text conversations are continued: tools, tool choices, extended
//! thinking, and content other than text blocks keep the terminal error.

use bytes::{Bytes, BytesMut};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use super::{continue_chat, json_str, object, Continuation, Rewritten, Transcript};
use crate::api::translate::write_raw_event;
use crate::api::{ClientApi, Usage, CHAT};
use crate::config::BackendKind;

/// The Messages API's continuation.
pub struct MessagesContinuation;

pub static MESSAGES_CONTINUATION: &dyn Continuation = &MessagesContinuation;

#[derive(Deserialize)]
struct Event<'a> {
    #[serde(rename = "type", default)]
    kind: Option<&'a str>,
    #[serde(borrow, default)]
    message: Option<Start<'a>>,
    #[serde(default)]
    index: Option<u64>,
    #[serde(borrow, default)]
    content_block: Option<Typed<'a>>,
    #[serde(borrow, default)]
    delta: Option<Delta<'a>>,
}

#[derive(Deserialize)]
struct Start<'a> {
    #[serde(borrow, default)]
    id: Option<&'a RawValue>,
    #[serde(borrow, default)]
    model: Option<&'a RawValue>,
    #[serde(default)]
    usage: Option<StartUsage>,
}

#[derive(Deserialize)]
struct StartUsage {
    #[serde(default)]
    input_tokens: Option<u64>,
}

#[derive(Deserialize)]
struct Typed<'a> {
    #[serde(rename = "type", default)]
    kind: Option<&'a str>,
}

#[derive(Deserialize)]
struct Delta<'a> {
    #[serde(rename = "type", default)]
    kind: Option<&'a str>,
    #[serde(borrow, default)]
    text: Option<std::borrow::Cow<'a, str>>,
}

/// The chat chunk fields a continuation event is made of.
#[derive(Deserialize)]
struct ChatChunk<'a> {
    #[serde(borrow, default)]
    choices: Option<Vec<ChatChoice<'a>>>,
    #[serde(default)]
    usage: Option<Usage>,
}

#[derive(Deserialize)]
struct ChatChoice<'a> {
    #[serde(borrow, default)]
    delta: Option<ChatDelta<'a>>,
    #[serde(borrow, default)]
    finish_reason: Option<&'a str>,
}

#[derive(Deserialize)]
struct ChatDelta<'a> {
    #[serde(borrow, default)]
    content: Option<std::borrow::Cow<'a, str>>,
    #[serde(borrow, default)]
    tool_calls: Option<&'a RawValue>,
}

/// The text of a content value made of text only (a string or text blocks); `None` for any
/// other block.
fn text_parts(v: &Value) -> Option<Vec<String>> {
    match v {
        Value::String(s) => Some(vec![s.clone()]),
        Value::Array(blocks) => blocks
            .iter()
            .map(|b| match b.get("type").and_then(Value::as_str) {
                Some("text") => Some(b.get("text")?.as_str()?.to_string()),
                _ => None,
            })
            .collect(),
        _ => None,
    }
}

/// A chat message's content as vLLM's Anthropic handler writes it: one text as a string,
/// several as text parts.
fn chat_content(parts: Vec<String>) -> Value {
    match parts.as_slice() {
        [one] => Value::String(one.clone()),
        _ => Value::Array(
            parts
                .into_iter()
                .map(|t| {
                    let mut p = Map::new();
                    p.insert("type".into(), "text".into());
                    p.insert("text".into(), t.into());
                    Value::Object(p)
                })
                .collect(),
        ),
    }
}

/// Anthropic's stop reason for a chat finish reason (as vLLM maps it).
fn stop_reason(finish: &str) -> &'static str {
    match finish {
        "length" => "max_tokens",
        "tool_calls" => "tool_use",
        _ => "end_turn",
    }
}

impl Continuation for MessagesContinuation {
    fn continuable(&self, body: &[u8]) -> Result<(), &'static str> {
        let req = object(body).ok_or("it is not a JSON object")?;
        let set = |k: &str| req.get(k).is_some_and(|v| !v.is_null());
        let thinking = req
            .get("thinking")
            .and_then(|t| t.get("type"))
            .and_then(Value::as_str)
            .is_some_and(|t| t != "disabled");
        if set("tools") || set("tool_choice") || thinking {
            return Err("it uses tools or extended thinking");
        }
        if req.get("system").is_some_and(|s| text_parts(s).is_none()) {
            return Err("its system prompt is not text");
        }
        let messages = req
            .get("messages")
            .and_then(Value::as_array)
            .ok_or("it has no messages")?;
        let text_only = messages
            .iter()
            .all(|m| m.get("content").and_then(text_parts).is_some());
        text_only.then_some(()).ok_or("its messages are not text")
    }

    fn continues_on(&self, kind: BackendKind) -> bool {
        matches!(kind, BackendKind::Vllm)
    }

    fn path(&self) -> Option<&'static str> {
        Some("/v1/chat/completions")
    }

    fn wire(&self) -> Option<&'static dyn ClientApi> {
        Some(CHAT)
    }

    fn record(&self, data: &[u8], t: &mut Transcript) {
        let Ok(ev) = serde_json::from_slice::<Event<'_>>(data) else {
            return;
        };
        match ev.kind {
            Some("message_start") => {
                let m = ev.message.as_ref();
                t.id = m.and_then(|m| m.id).map(|r| r.get().to_string());
                t.model = m.and_then(|m| m.model).map(|r| r.get().to_string());
                t.prompt_tokens = m.and_then(|m| m.usage.as_ref()?.input_tokens);
            }
            Some("content_block_start") => {
                if ev.content_block.and_then(|b| b.kind) == Some("text") {
                    t.block = ev.index;
                } else {
                    t.blocked
                        .get_or_insert("a tool call or thinking was being streamed");
                }
            }
            Some("content_block_delta") => match ev.delta {
                Some(Delta {
                    kind: Some("text_delta"),
                    text,
                }) => {
                    t.text.push_str(text.as_deref().unwrap_or(""));
                    t.tokens += 1;
                }
                _ => {
                    t.blocked
                        .get_or_insert("a tool call or thinking was being streamed");
                }
            },
            Some("content_block_stop") | Some("message_delta") => {
                t.blocked.get_or_insert("the answer had finished");
            }
            _ => {}
        }
    }

    fn body(&self, body: &[u8], t: &Transcript, kind: BackendKind, model: &str) -> Option<Bytes> {
        let req = object(body)?;
        let mut messages = Vec::new();
        if let Some(system) = req.get("system") {
            let mut m = Map::new();
            m.insert("role".into(), "system".into());
            m.insert("content".into(), text_parts(system)?.concat().into());
            messages.push(Value::Object(m));
        }
        for msg in req.get("messages")?.as_array()? {
            let mut m = Map::new();
            m.insert("role".into(), msg.get("role")?.clone());
            m.insert(
                "content".into(),
                chat_content(text_parts(msg.get("content")?)?),
            );
            messages.push(Value::Object(m));
        }
        let max = req.get("max_tokens")?.as_u64()?;
        let mut chat = Map::new();
        chat.insert("messages".into(), Value::Array(messages));
        chat.insert("max_tokens".into(), max.into());
        chat.insert("max_completion_tokens".into(), max.into());
        for (from, to) in [
            ("stop_sequences", "stop"),
            ("temperature", "temperature"),
            ("top_p", "top_p"),
            ("top_k", "top_k"),
        ] {
            if let Some(v) = req.get(from).filter(|v| !v.is_null()) {
                chat.insert(to.into(), v.clone());
            }
        }
        // the partial answer, the limits less what was streamed, the backend's form
        continue_chat(chat, t, kind, model)
    }

    fn rewrite(&self, data: &[u8], t: &mut Transcript, usage: Option<Usage>) -> Rewritten {
        let mut out = BytesMut::new();
        if data == b"[DONE]" {
            write_raw_event(&mut out, "message_stop", "{\"type\":\"message_stop\"}");
            return Rewritten::Events(out.freeze());
        }
        let Ok(chunk) = serde_json::from_slice::<ChatChunk<'_>>(data) else {
            return Rewritten::Drop;
        };
        for c in chunk.choices.iter().flatten() {
            let text = c.delta.as_ref().and_then(|d| d.content.as_deref());
            if let Some(text) = text.filter(|s| !s.is_empty()) {
                let index = match t.block {
                    Some(i) => i,
                    None => {
                        let i = t.next_block();
                        t.block = Some(i);
                        let start = format!("{{\"type\":\"content_block_start\",\"content_block\":{{\"type\":\"text\",\"text\":\"\"}},\"index\":{i}}}");
                        write_raw_event(&mut out, "content_block_start", &start);
                        i
                    }
                };
                let delta = format!("{{\"type\":\"content_block_delta\",\"delta\":{{\"type\":\"text_delta\",\"text\":{}}},\"index\":{index}}}", json_str(text));
                write_raw_event(&mut out, "content_block_delta", &delta);
            }
            if c.delta.as_ref().is_some_and(|d| d.tool_calls.is_some()) {
                t.stop = Some("tool_calls".into());
            }
            if let Some(f) = c.finish_reason {
                t.stop = Some(f.to_string());
            }
        }
        let is_usage = chunk.choices.as_ref().is_some_and(Vec::is_empty) && chunk.usage.is_some();
        if let (true, Some(u)) = (is_usage, usage) {
            if let Some(i) = t.block.take() {
                let stop = format!("{{\"type\":\"content_block_stop\",\"index\":{i}}}");
                write_raw_event(&mut out, "content_block_stop", &stop);
            }
            let reason = stop_reason(t.stop.as_deref().unwrap_or("stop"));
            let delta = format!("{{\"type\":\"message_delta\",\"delta\":{{\"stop_reason\":\"{reason}\",\"stop_sequence\":null}},\"usage\":{{\"input_tokens\":{},\"output_tokens\":{}}}}}", u.prompt_tokens, u.completion_tokens);
            write_raw_event(&mut out, "message_delta", &delta);
        }
        if out.is_empty() {
            Rewritten::Drop
        } else {
            Rewritten::Events(out.freeze())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const START: &str = r#"{"type":"message_start","message":{"id":"chatcmpl-1","type":"message","role":"assistant","content":[],"model":"m","stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":12,"output_tokens":0}}}"#;
    const BLOCK: &str =
        r#"{"type":"content_block_start","content_block":{"type":"text","text":""},"index":0}"#;
    const DELTA: &str =
        r#"{"type":"content_block_delta","delta":{"type":"text_delta","text":" the"},"index":0}"#;

    fn transcript() -> Transcript {
        let mut t = Transcript::default();
        for e in [START, BLOCK, DELTA, DELTA] {
            MESSAGES_CONTINUATION.record(e.as_bytes(), &mut t);
        }
        t
    }

    #[test]
    fn a_text_message_is_continued_through_chat_completions() {
        let t = transcript();
        assert_eq!(
            (t.text.as_str(), t.tokens, t.block, t.prompt_tokens),
            (" the the", 2, Some(0), Some(12))
        );
        let body = br#"{"model":"m","max_tokens":10,"system":[{"type":"text","text":"Be brief."}],"stop_sequences":["x"],"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]},{"role":"assistant","content":"Sure:"}],"stream":true}"#;
        assert!(MESSAGES_CONTINUATION.continuable(body).is_ok());
        let chat: Value = serde_json::from_slice(
            &MESSAGES_CONTINUATION
                .body(body, &t, BackendKind::Vllm, "bm")
                .unwrap(),
        )
        .unwrap();
        assert_eq!(
            chat["messages"][0],
            serde_json::json!({"role":"system","content":"Be brief."})
        );
        assert_eq!(chat["messages"][1]["content"][1]["text"], "b");
        assert_eq!(
            chat["messages"][2],
            serde_json::json!({"role":"assistant","content":"Sure:"})
        );
        assert_eq!(
            chat["messages"][3],
            serde_json::json!({"role":"assistant","content":" the the"})
        );
        assert_eq!(
            (
                chat["max_tokens"].as_u64(),
                chat["stop"][0].as_str(),
                chat["model"].as_str()
            ),
            (Some(8), Some("x"), Some("bm"))
        );
        assert_eq!(
            (
                chat["continue_final_message"].as_bool(),
                chat["add_generation_prompt"].as_bool()
            ),
            (Some(true), Some(false))
        );
        for refused in [
            r#"{"max_tokens":5,"messages":[],"tools":[{"name":"f"}]}"#,
            r#"{"max_tokens":5,"messages":[],"thinking":{"type":"enabled","budget_tokens":10}}"#,
            r#"{"max_tokens":5,"messages":[{"role":"user","content":[{"type":"image","source":{}}]}]}"#,
        ] {
            assert!(
                MESSAGES_CONTINUATION
                    .continuable(refused.as_bytes())
                    .is_err(),
                "{refused}"
            );
        }
    }

    #[test]
    fn chat_chunks_become_the_messages_events_that_continue_the_answer() {
        let mut t = transcript();
        let c = MESSAGES_CONTINUATION;
        let role = br#"{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}"#;
        assert_eq!(c.rewrite(role, &mut t, None), Rewritten::Drop);
        let text =
            br#"{"choices":[{"index":0,"delta":{"content":" sky"},"finish_reason":"length"}]}"#;
        assert_eq!(
            c.rewrite(text, &mut t, None),
            Rewritten::Events(Bytes::from_static(b"event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"delta\":{\"type\":\"text_delta\",\"text\":\" sky\"},\"index\":0}\n\n"))
        );
        let usage = br#"{"choices":[],"usage":{"prompt_tokens":14,"completion_tokens":1}}"#;
        let joined = Usage {
            prompt_tokens: 12,
            completion_tokens: 3,
            cached_tokens: None,
        };
        let Rewritten::Events(out) = c.rewrite(usage, &mut t, Some(joined)) else {
            panic!("no events")
        };
        assert_eq!(std::str::from_utf8(&out).unwrap(), "event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}\n\nevent: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"max_tokens\",\"stop_sequence\":null},\"usage\":{\"input_tokens\":12,\"output_tokens\":3}}\n\n");
        assert!(
            matches!(c.rewrite(b"[DONE]", &mut t, None), Rewritten::Events(e) if e.starts_with(b"event: message_stop\n"))
        );
        // Broken before any text block: the continuation opens one.
        let mut t = Transcript::default();
        c.record(START.as_bytes(), &mut t);
        let Rewritten::Events(out) = c.rewrite(text, &mut t, None) else {
            panic!("no events")
        };
        assert!(out.starts_with(b"event: content_block_start\n"), "{out:?}");
    }
}
