//! Continuing an OpenAI Responses stream. vLLM's Responses endpoint cannot continue a partial
//! answer (it renders the conversation with a generation prompt, so a trailing assistant
//! message is a finished turn), so the continuation is asked of a chat completions endpoint —
//! the request translated as for a backend that has no Responses API
//! ([`crate::api::translate::responses`]: `instructions` → a system message, input items →
//! messages, `max_output_tokens` → `max_tokens`, `temperature`, `top_p`), plus the partial
//! answer as a trailing assistant message in the form the backend continues (as for chat) —
//! and its chunks are written back as the Responses events that continue the answer:
//! `response.output_text.delta` on the same item, output index and content index, numbered on
//! from the last `sequence_number` the client got, then the events vLLM closes a message with:
//! `response.output_text.done` (the whole text), `response.content_part.done`,
//! `response.output_item.done` and `response.completed` carrying the first event's response
//! object (its `id`, `created_at`, `model` and echoed request fields) with the whole output,
//! its status (`incomplete` with `incomplete_details.reason: "max_output_tokens"` when the
//! length ran out; vLLM names that event `response.completed` too) and the answer's usage.
//! An error event of the continuing engine ends the stream with the API's `error` event.
//!
//! Only text answers to text conversations are continued: a request with tools, a forced tool
//! choice, `previous_response_id`, `store: true` or `background: true`, structured output,
//! logprobs, reasoning settings, input items other than messages of text, or anything the
//! translation refuses keeps the terminal error; so does a stream that sent anything but one
//! message item's `output_text` deltas. `store: true` is refused because the continued answer
//! is stored nowhere: the response id names the backend that broke, which holds none of it
//! (or, had it stored its own copy, a different text), so a later `GET` or
//! `previous_response_id` could not be what the client read.

use bytes::{Bytes, BytesMut};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use super::{
    continue_chat, json_str, object, Chunk, Continuation, Rewritten, Transcript, CHAT_CONTINUATION,
};
use crate::api::translate::{fresh_id, responses::TRANSLATOR, write_raw_event};
use crate::api::{ClientApi, Usage, CHAT};
use crate::config::BackendKind;
use crate::openai::edit::{self, Splice};
use crate::openai::ApiError;

/// The Responses API's continuation.
pub struct ResponsesContinuation;

pub static RESPONSES_CONTINUATION: &dyn Continuation = &ResponsesContinuation;

/// One event of the client's stream, read borrowed.
#[derive(Deserialize)]
struct Event<'a> {
    #[serde(rename = "type", default)]
    kind: Option<&'a str>,
    #[serde(borrow, default)]
    response: Option<&'a RawValue>,
    #[serde(default)]
    sequence_number: Option<u64>,
    #[serde(borrow, default)]
    item: Option<Item<'a>>,
    #[serde(borrow, default)]
    part: Option<Item<'a>>,
    #[serde(default)]
    output_index: Option<u64>,
    #[serde(default)]
    content_index: Option<u64>,
    #[serde(borrow, default)]
    delta: Option<std::borrow::Cow<'a, str>>,
}

/// An output item or content part: its type, and an item's id.
#[derive(Deserialize)]
struct Item<'a> {
    #[serde(rename = "type", default)]
    kind: Option<&'a str>,
    #[serde(borrow, default)]
    id: Option<&'a RawValue>,
}

/// The members of a response object the stream's identity is read from.
#[derive(Deserialize)]
struct Head<'a> {
    #[serde(borrow, default)]
    id: Option<&'a RawValue>,
    #[serde(borrow, default)]
    created_at: Option<&'a RawValue>,
    #[serde(borrow, default)]
    model: Option<&'a RawValue>,
}

/// The members of the response object that the end of the answer sets (`null` included: it
/// is replaced in place too).
#[derive(Deserialize)]
struct Ending<'a> {
    #[serde(borrow, default, deserialize_with = "raw")]
    incomplete_details: Option<&'a RawValue>,
    #[serde(borrow, default, deserialize_with = "raw")]
    output: Option<&'a RawValue>,
    #[serde(borrow, default, deserialize_with = "raw")]
    status: Option<&'a RawValue>,
    #[serde(borrow, default, deserialize_with = "raw")]
    usage: Option<&'a RawValue>,
}

/// A member's raw value, `null` too (serde reads `null` as `None` for an `Option`).
fn raw<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<&'de RawValue>, D::Error> {
    <&RawValue>::deserialize(d).map(Some)
}

/// A chat stream's error event.
#[derive(Deserialize)]
struct Failed<'a> {
    #[serde(borrow, default)]
    error: Option<&'a RawValue>,
}

/// Why a request cannot be continued beyond what the translation refuses.
fn refuse(req: &Map<String, Value>) -> Result<(), &'static str> {
    let set = |k: &str| {
        req.get(k).is_some_and(|v| {
            !matches!(v, Value::Null | Value::Bool(false))
                && v.as_array().is_none_or(|a| !a.is_empty())
        })
    };
    if set("store") {
        return Err("it asks for the response to be stored");
    }
    if set("tools")
        || req
            .get("tool_choice")
            .is_some_and(|c| c.is_object() || c == "required")
    {
        return Err("it uses tools");
    }
    let text_only = match req.get("input") {
        Some(Value::String(_)) => true,
        Some(Value::Array(items)) => items.iter().all(text_message),
        _ => false,
    };
    text_only
        .then_some(())
        .ok_or("its input is not messages of text")
}

/// An input item that is a message whose content is text.
fn text_message(item: &Value) -> bool {
    let message = matches!(
        item.get("type").and_then(Value::as_str),
        None | Some("message")
    );
    let text = match item.get("content") {
        Some(Value::String(_)) => true,
        Some(Value::Array(parts)) => parts.iter().all(|p| {
            matches!(
                p.get("type").and_then(Value::as_str),
                Some("input_text" | "output_text" | "text")
            )
        }),
        _ => false,
    };
    message && text
}

/// Write one event in vLLM's form: its own members (`before` sorts ahead of
/// `sequence_number`, `after` between it and `type`), numbered on from `t`'s last.
fn event(t: &mut Transcript, kind: &str, before: &str, after: &str, out: &mut BytesMut) {
    let seq = t.seq.map_or(0, |s| s + 1);
    t.seq = Some(seq);
    let data = format!("{{{before}\"sequence_number\":{seq},{after}\"type\":\"{kind}\"}}");
    write_raw_event(out, kind, &data);
}

/// The output message item with its whole text, as vLLM writes it.
fn message_item(id: &str, text: &str) -> String {
    format!(
        "{{\"id\":{id},\"content\":[{{\"annotations\":[],\"text\":{},\"type\":\"output_text\",\"logprobs\":null}}],\"role\":\"assistant\",\"status\":\"completed\",\"type\":\"message\",\"phase\":null}}",
        json_str(text)
    )
}

/// The usage of a response, in vLLM's form.
fn usage_json(u: Usage) -> String {
    format!(
        "{{\"input_tokens\":{},\"input_tokens_details\":{{\"cached_tokens\":0,\"cache_write_tokens\":0,\"input_tokens_per_turn\":[],\"cached_tokens_per_turn\":[]}},\"output_tokens\":{},\"output_tokens_details\":{{\"reasoning_tokens\":0,\"tool_output_tokens\":0,\"output_tokens_per_turn\":[],\"tool_output_tokens_per_turn\":[]}},\"total_tokens\":{}}}",
        u.prompt_tokens,
        u.completion_tokens,
        u.prompt_tokens + u.completion_tokens
    )
}

/// The message item and its text part, opened when the stream broke before they were.
fn open(t: &mut Transcript, out: &mut BytesMut) -> (String, u64, u64) {
    let (id, index) = match t.item.clone() {
        Some(item) => item,
        None => {
            let id = json_str(&fresh_id("msg_"));
            let added = format!("\"item\":{{\"id\":{id},\"content\":[],\"role\":\"assistant\",\"status\":\"in_progress\",\"type\":\"message\",\"phase\":null}},\"output_index\":0,");
            event(t, "response.output_item.added", &added, "", out);
            t.item = Some((id.clone(), 0));
            (id, 0)
        }
    };
    let part = match t.block {
        Some(p) => p,
        None => {
            let added = format!("\"content_index\":0,\"item_id\":{id},\"output_index\":{index},\"part\":{{\"annotations\":[],\"text\":\"\",\"type\":\"output_text\",\"logprobs\":[]}},");
            event(t, "response.content_part.added", &added, "", out);
            t.block = Some(0);
            0
        }
    };
    (id, index, part)
}

/// The response object of the answer's end: the first event's, with the whole output, the
/// status the finish says and the answer's usage.
fn final_response(head: &str, item: &str, finish: Option<&str>, usage: Option<Usage>) -> Bytes {
    let incomplete = finish == Some("length");
    let values = [
        (
            "incomplete_details",
            if incomplete {
                "{\"reason\":\"max_output_tokens\"}".to_string()
            } else {
                "null".to_string()
            },
        ),
        ("output", format!("[{item}]")),
        (
            "status",
            if incomplete {
                "\"incomplete\""
            } else {
                "\"completed\""
            }
            .to_string(),
        ),
        (
            "usage",
            usage.map_or_else(|| "null".to_string(), usage_json),
        ),
    ];
    let head = Bytes::copy_from_slice(head.as_bytes());
    let Ok(e) = serde_json::from_slice::<Ending<'_>>(&head) else {
        return head;
    };
    let raws = [e.incomplete_details, e.output, e.status, e.usage];
    let at = |raw: &RawValue| (raw.get().as_ptr() as usize).checked_sub(head.as_ptr() as usize);
    if raws.iter().all(Option::is_some) {
        let splices = raws
            .iter()
            .zip(&values)
            .filter_map(|(raw, (_, with))| {
                let raw = (*raw)?;
                let start = at(raw)?;
                Some(Splice {
                    span: start..start + raw.get().len(),
                    with: with.clone().into_bytes(),
                })
            })
            .collect();
        return edit::apply(&head, splices);
    }
    // Not vLLM's full object: set the members (their order is then serde_json's).
    let Ok(Value::Object(mut obj)) = serde_json::from_slice::<Value>(&head) else {
        return head;
    };
    for (key, value) in values {
        if let Ok(v) = serde_json::from_str(&value) {
            obj.insert(key.into(), v);
        }
    }
    Bytes::from(Value::Object(obj).to_string())
}

/// The closing events of the message and the response.
fn close(t: &mut Transcript, usage: Option<Usage>, out: &mut BytesMut) {
    let (id, index, part) = open(t, out);
    let text = json_str(&t.text);
    let ids = format!("\"content_index\":{part},\"item_id\":{id},");
    event(
        t,
        "response.output_text.done",
        &format!("{ids}\"logprobs\":[],\"output_index\":{index},"),
        &format!("\"text\":{text},"),
        out,
    );
    event(
        t,
        "response.content_part.done",
        &format!("{ids}\"output_index\":{index},\"part\":{{\"annotations\":[],\"text\":{text},\"type\":\"output_text\",\"logprobs\":null}},"),
        "",
        out,
    );
    let item = message_item(&id, &t.text);
    event(
        t,
        "response.output_item.done",
        &format!("\"item\":{item},\"output_index\":{index},"),
        "",
        out,
    );
    let head = t.head.clone().unwrap_or_else(|| "{}".into());
    let response = final_response(&head, &item, t.stop.as_deref(), usage);
    let response = String::from_utf8_lossy(&response).into_owned();
    event(
        t,
        "response.completed",
        &format!("\"response\":{response},"),
        "",
        out,
    );
    t.block = None;
    t.ended = true;
}

impl ResponsesContinuation {
    /// Record a lifecycle event's response object: the answer's identity.
    fn record_head(raw: &RawValue, t: &mut Transcript) {
        if t.head.is_some() {
            return;
        }
        let Ok(h) = serde_json::from_str::<Head<'_>>(raw.get()) else {
            return;
        };
        t.head = Some(raw.get().to_string());
        t.id = h.id.map(|r| r.get().to_string());
        t.created = h.created_at.map(|r| r.get().to_string());
        t.model = h.model.map(|r| r.get().to_string());
    }
}

impl Continuation for ResponsesContinuation {
    fn continuable(&self, body: &[u8]) -> Result<(), &'static str> {
        let req = object(body).ok_or("it is not a JSON object")?;
        refuse(&req)?;
        // Everything else the chat translation cannot carry faithfully (state, structured
        // output, logprobs, reasoning, fields it does not know) is refused by it.
        TRANSLATOR
            .request(body, true)
            .map(drop)
            .map_err(|_| "it cannot be asked of chat completions")
    }

    fn continues_on(&self, kind: BackendKind) -> bool {
        CHAT_CONTINUATION.continues_on(kind)
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
        if let Some(n) = ev.sequence_number {
            t.seq = Some(n);
        }
        let other = "something other than one message's text was being streamed";
        match ev.kind.unwrap_or("") {
            "response.created" | "response.in_progress" | "response.queued" => {
                if let Some(raw) = ev.response {
                    Self::record_head(raw, t);
                }
            }
            "response.output_item.added" => match ev.item {
                Some(Item {
                    kind: Some("message"),
                    id: Some(id),
                }) if t.item.is_none() => {
                    t.item = Some((id.get().to_string(), ev.output_index.unwrap_or(0)));
                }
                _ => {
                    t.blocked.get_or_insert(other);
                }
            },
            "response.content_part.added" => match ev.part {
                Some(Item {
                    kind: Some("output_text"),
                    ..
                }) if t.block.is_none() && t.item.is_some() => {
                    t.block = Some(ev.content_index.unwrap_or(0));
                }
                _ => {
                    t.blocked.get_or_insert(other);
                }
            },
            "response.output_text.delta" => {
                if let Some(d) = ev.delta.as_deref().filter(|d| !d.is_empty()) {
                    t.text.push_str(d);
                    t.tokens += 1;
                }
            }
            "response.output_text.done"
            | "response.content_part.done"
            | "response.output_item.done"
            | "response.completed"
            | "response.incomplete"
            | "response.failed" => {
                t.blocked.get_or_insert("the answer had finished");
            }
            "error" => {}
            _ => {
                t.blocked.get_or_insert(other);
            }
        }
    }

    fn body(&self, body: &[u8], t: &Transcript, kind: BackendKind, model: &str) -> Option<Bytes> {
        // The end of the answer repeats the response object the stream started with.
        t.head.as_ref()?;
        let chat = TRANSLATOR.request(body, true).ok()?.chat().clone();
        continue_chat(chat, t, kind, model)
    }

    fn rewrite(&self, data: &[u8], t: &mut Transcript, usage: Option<Usage>) -> Rewritten {
        let mut out = BytesMut::new();
        if t.ended {
            return Rewritten::Drop;
        }
        if data == b"[DONE]" {
            // The backend reported no usage: the end is written without it.
            close(t, None, &mut out);
            return Rewritten::Events(out.freeze());
        }
        if let Ok(Failed { error: Some(e) }) = serde_json::from_slice::<Failed<'_>>(data) {
            // The continuing engine failed: the Responses API's error event ends the stream.
            t.ended = true;
            let message = serde_json::from_str::<Value>(e.get())
                .ok()
                .and_then(|v| v.get("message")?.as_str().map(str::to_string))
                .unwrap_or_default();
            let err = ApiError::bad_gateway(format!(
                "The backend continuing the answer failed ({message}). The answer is incomplete."
            ))
            .with_code("backend_stream_interrupted");
            return Rewritten::Events(crate::api::responses::stream_error_event(&err));
        }
        let Ok(chunk) = serde_json::from_slice::<Chunk<'_>>(data) else {
            return Rewritten::Drop;
        };
        for c in chunk.choices.iter().flatten() {
            let text = c.delta.as_ref().and_then(|d| d.content.as_deref());
            if let Some(text) = text.filter(|s| !s.is_empty()) {
                let (id, index, part) = open(t, &mut out);
                t.text.push_str(text);
                let before = format!("\"content_index\":{part},\"delta\":{},\"item_id\":{id},\"logprobs\":[],\"output_index\":{index},", json_str(text));
                event(t, "response.output_text.delta", &before, "", &mut out);
            }
            if let Some(f) = c
                .finish_reason
                .and_then(|r| serde_json::from_str::<String>(r.get()).ok())
            {
                t.stop = Some(f);
            }
        }
        let is_usage = chunk.choices.as_ref().is_some_and(Vec::is_empty)
            && chunk.usage.is_some_and(|u| u.get() != "null");
        if let (true, Some(u)) = (is_usage, usage) {
            close(t, Some(u), &mut out);
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

    /// vLLM's events up to two deltas (the capture's, the id as the client sees it).
    const HEAD: &str = r#"{"id":"resp_00aa_resp_9d18","created_at":1796397572,"incomplete_details":null,"instructions":"Be brief.","metadata":null,"model":"m","object":"response","output":[],"parallel_tool_calls":true,"temperature":1.0,"tool_choice":"none","tools":[],"top_p":1.0,"background":false,"max_output_tokens":6,"max_tool_calls":null,"previous_response_id":null,"prompt":null,"reasoning":null,"service_tier":"auto","status":"in_progress","text":null,"top_logprobs":null,"truncation":"disabled","usage":null,"user":null}"#;

    fn events() -> Vec<String> {
        vec![
            format!(r#"{{"response":{HEAD},"sequence_number":0,"type":"response.created"}}"#),
            format!(r#"{{"response":{HEAD},"sequence_number":1,"type":"response.in_progress"}}"#),
            r#"{"item":{"id":"msg_84c9","content":[],"role":"assistant","status":"in_progress","type":"message","phase":null},"output_index":0,"sequence_number":2,"type":"response.output_item.added"}"#.into(),
            r#"{"content_index":0,"item_id":"msg_84c9","output_index":0,"part":{"annotations":[],"text":"","type":"output_text","logprobs":[]},"sequence_number":3,"type":"response.content_part.added"}"#.into(),
            r#"{"content_index":0,"delta":" under","item_id":"msg_84c9","logprobs":[],"output_index":0,"sequence_number":4,"type":"response.output_text.delta"}"#.into(),
            r#"{"content_index":0,"delta":" the","item_id":"msg_84c9","logprobs":[],"output_index":0,"sequence_number":5,"type":"response.output_text.delta"}"#.into(),
        ]
    }

    fn transcript(upto: usize) -> Transcript {
        let mut t = Transcript::default();
        for e in &events()[..upto] {
            RESPONSES_CONTINUATION.record(e.as_bytes(), &mut t);
        }
        t
    }

    /// The data of each event in `out`, by name.
    fn read(out: &[u8]) -> Vec<(String, Value)> {
        std::str::from_utf8(out)
            .unwrap()
            .split("\n\n")
            .filter(|e| !e.is_empty())
            .map(|e| {
                let name = e.strip_prefix("event: ").unwrap().lines().next().unwrap();
                let data = e.lines().nth(1).unwrap().strip_prefix("data: ").unwrap();
                (name.to_string(), serde_json::from_str(data).unwrap())
            })
            .collect()
    }

    #[test]
    fn a_text_response_is_continued_through_chat_completions() {
        let t = transcript(6);
        assert_eq!(
            (t.text.as_str(), t.tokens, t.seq, t.block, t.blocked),
            (" under the", 2, Some(5), Some(0), None)
        );
        assert_eq!(t.item, Some(("\"msg_84c9\"".to_string(), 0)));
        assert_eq!(
            (t.id.as_deref(), t.created.as_deref(), t.model.as_deref()),
            (
                Some("\"resp_00aa_resp_9d18\""),
                Some("1796397572"),
                Some("\"m\"")
            )
        );
        let body = br#"{"model":"m","instructions":"Be brief.","max_output_tokens":6,"temperature":0.5,"stream":true,"store":false,"input":[{"role":"user","content":[{"type":"input_text","text":"Tell me"}]},{"type":"message","role":"assistant","content":[{"type":"output_text","text":"What?"}]},{"role":"user","content":"The sea."}]}"#;
        assert_eq!(RESPONSES_CONTINUATION.continuable(body), Ok(()));
        let c = RESPONSES_CONTINUATION;
        let chat: Value =
            serde_json::from_slice(&c.body(body, &t, BackendKind::Vllm, "bm").unwrap()).unwrap();
        assert_eq!(
            chat["messages"],
            serde_json::json!([
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Tell me"},
                {"role": "assistant", "content": "What?"},
                {"role": "user", "content": "The sea."},
                {"role": "assistant", "content": " under the"}])
        );
        assert_eq!(
            (
                chat["model"].as_str(),
                chat["max_tokens"].as_u64(),
                chat["temperature"].as_f64(),
                chat["stream_options"]["include_usage"].as_bool()
            ),
            (Some("bm"), Some(4), Some(0.5), Some(true))
        );
        assert_eq!(
            (
                chat["continue_final_message"].as_bool(),
                chat["add_generation_prompt"].as_bool()
            ),
            (Some(true), Some(false))
        );
        // TGI and Ollama continue the same message in their own form, as for chat.
        let tgi: Value =
            serde_json::from_slice(&c.body(body, &t, BackendKind::Tgi, "m").unwrap()).unwrap();
        assert!(
            tgi["continue_final_message"] == true && tgi.get("add_generation_prompt").is_none()
        );
        assert!(c.continues_on(BackendKind::Ollama) && !c.continues_on(BackendKind::OpenAi));
        assert_eq!(c.path(), Some("/v1/chat/completions"));
        // Nothing left to generate, or no response object to end with: no continuation.
        let spent = Transcript {
            tokens: 6,
            ..t.clone()
        };
        assert!(c.body(body, &spent, BackendKind::Vllm, "m").is_none());
        assert!(c
            .body(body, &Transcript::default(), BackendKind::Vllm, "m")
            .is_none());
    }

    #[test]
    fn requests_that_cannot_be_continued_faithfully() {
        for refused in [
            r#"{"model":"m","input":"x","store":true}"#,
            r#"{"model":"m","input":"x","background":true}"#,
            r#"{"model":"m","input":"x","previous_response_id":"resp_1"}"#,
            r#"{"model":"m","input":"x","tools":[{"type":"function","name":"f"}]}"#,
            r#"{"model":"m","input":"x","tool_choice":"required"}"#,
            r#"{"model":"m","input":"x","text":{"format":{"type":"json_object"}}}"#,
            r#"{"model":"m","input":"x","top_logprobs":2}"#,
            r#"{"model":"m","input":"x","include":["message.output_text.logprobs"]}"#,
            r#"{"model":"m","input":"x","reasoning":{"effort":"high"}}"#,
            r#"{"model":"m","input":[{"role":"user","content":[{"type":"input_image","image_url":"http://x/i.png"}]}]}"#,
            r#"{"model":"m","input":[{"type":"function_call_output","call_id":"c","output":"1"}]}"#,
            r#"{"model":"m","input":"x","seed":3}"#,
            "[1]",
        ] {
            assert!(
                RESPONSES_CONTINUATION
                    .continuable(refused.as_bytes())
                    .is_err(),
                "{refused}"
            );
        }
        let fine = br#"{"model":"m","input":"x","store":false,"tools":[],"tool_choice":"none","text":{"format":{"type":"text"}}}"#;
        assert_eq!(RESPONSES_CONTINUATION.continuable(fine), Ok(()));
    }

    #[test]
    fn what_went_out_decides_whether_it_can_be_extended() {
        let mut t = transcript(2);
        let reasoning = r#"{"item":{"id":"rs_1","type":"reasoning","summary":[]},"output_index":0,"sequence_number":2,"type":"response.output_item.added"}"#;
        RESPONSES_CONTINUATION.record(reasoning.as_bytes(), &mut t);
        assert!(t.blocked.is_some());
        let mut t = transcript(6);
        let done = r#"{"content_index":0,"item_id":"msg_84c9","logprobs":[],"output_index":0,"sequence_number":6,"text":" under the","type":"response.output_text.done"}"#;
        RESPONSES_CONTINUATION.record(done.as_bytes(), &mut t);
        assert_eq!(t.blocked, Some("the answer had finished"));
        let mut t = transcript(4);
        let refusal = r#"{"content_index":0,"delta":"no","item_id":"msg_84c9","output_index":0,"sequence_number":4,"type":"response.refusal.delta"}"#;
        RESPONSES_CONTINUATION.record(refusal.as_bytes(), &mut t);
        assert!(t.blocked.is_some());
    }

    #[test]
    fn chat_chunks_become_the_responses_events_that_continue_the_answer() {
        let mut t = transcript(6);
        let c = RESPONSES_CONTINUATION;
        let role = br#"{"id":"chatcmpl-2","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}"#;
        assert_eq!(c.rewrite(role, &mut t, None), Rewritten::Drop);
        let text = br#"{"id":"chatcmpl-2","choices":[{"index":0,"delta":{"content":" sky\""},"finish_reason":null}]}"#;
        assert_eq!(
            c.rewrite(text, &mut t, None),
            Rewritten::Events(Bytes::from_static(b"event: response.output_text.delta\ndata: {\"content_index\":0,\"delta\":\" sky\\\"\",\"item_id\":\"msg_84c9\",\"logprobs\":[],\"output_index\":0,\"sequence_number\":6,\"type\":\"response.output_text.delta\"}\n\n"))
        );
        let last =
            br#"{"choices":[{"index":0,"delta":{"content":" is"},"finish_reason":"length"}]}"#;
        assert!(matches!(
            c.rewrite(last, &mut t, None),
            Rewritten::Events(_)
        ));
        let usage = br#"{"choices":[],"usage":{"prompt_tokens":14,"completion_tokens":2}}"#;
        let joined = Usage {
            prompt_tokens: 12,
            completion_tokens: 4,
            cached_tokens: None,
        };
        let Rewritten::Events(out) = c.rewrite(usage, &mut t, Some(joined)) else {
            panic!("no events")
        };
        let ev = read(&out);
        let names: Vec<&str> = ev.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.completed"
            ]
        );
        let whole = " under the sky\" is";
        let seqs: Vec<u64> = ev
            .iter()
            .map(|(_, v)| v["sequence_number"].as_u64().unwrap())
            .collect();
        assert_eq!(seqs, [8, 9, 10, 11]);
        assert_eq!(ev[0].1["text"], whole);
        assert_eq!(ev[1].1["part"]["text"], whole);
        assert_eq!(ev[2].1["item"]["content"][0]["text"], whole);
        let r = &ev[3].1["response"];
        assert_eq!(
            (
                r["id"].as_str(),
                r["created_at"].as_u64(),
                r["model"].as_str()
            ),
            (Some("resp_00aa_resp_9d18"), Some(1796397572), Some("m"))
        );
        assert_eq!(
            (
                r["status"].as_str(),
                r["incomplete_details"]["reason"].as_str()
            ),
            (Some("incomplete"), Some("max_output_tokens"))
        );
        assert_eq!(r["output"][0]["id"], "msg_84c9");
        assert_eq!(r["output"][0]["content"][0]["text"], whole);
        assert_eq!(
            (
                r["usage"]["input_tokens"].as_u64(),
                r["usage"]["output_tokens"].as_u64(),
                r["usage"]["total_tokens"].as_u64()
            ),
            (Some(12), Some(4), Some(16))
        );
        assert_eq!(r["instructions"], "Be brief.");
        // vLLM's field order is kept: the object is the first one's with four members set.
        let text = std::str::from_utf8(&out).unwrap();
        assert!(
            text.contains("\"object\":\"response\",\"output\":[{\"id\":\"msg_84c9\""),
            "{text}"
        );
        assert_eq!(c.rewrite(b"[DONE]", &mut t, None), Rewritten::Drop);
        // An engine error inside the continuation ends the stream with the API's error event.
        let mut t = transcript(6);
        let failed = br#"{"error":{"message":"EngineCore died","type":"InternalServerError"}}"#;
        let Rewritten::Events(out) = c.rewrite(failed, &mut t, None) else {
            panic!("no error event")
        };
        let ev = read(&out);
        assert_eq!(ev[0].0, "error");
        assert_eq!(ev[0].1["error"]["code"], "backend_stream_interrupted");
        assert!(ev[0].1["message"]
            .as_str()
            .unwrap()
            .contains("EngineCore died"));
        assert_eq!(c.rewrite(b"[DONE]", &mut t, None), Rewritten::Drop);
    }

    #[test]
    fn a_break_before_the_message_opens_it() {
        let mut t = transcript(2);
        let c = RESPONSES_CONTINUATION;
        let text = br#"{"choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":"stop"}]}"#;
        let Rewritten::Events(out) = c.rewrite(text, &mut t, None) else {
            panic!("no events")
        };
        let ev = read(&out);
        let names: Vec<&str> = ev.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta"
            ]
        );
        assert_eq!(ev[0].1["sequence_number"], 2);
        let id = ev[0].1["item"]["id"].as_str().unwrap().to_string();
        assert!(id.starts_with("msg_") && ev[2].1["item_id"] == id.as_str());
        // No usage reported: the end is written at [DONE], complete, without usage.
        let Rewritten::Events(out) = c.rewrite(b"[DONE]", &mut t, None) else {
            panic!("no end")
        };
        let ev = read(&out);
        let r = &ev.last().unwrap().1["response"];
        assert_eq!(
            (r["status"].as_str(), r["usage"].is_null()),
            (Some("completed"), true)
        );
        assert!(r["incomplete_details"].is_null());
        assert_eq!(r["output"][0]["content"][0]["text"], "Hi");
    }
}
