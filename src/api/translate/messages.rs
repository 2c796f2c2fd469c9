//! The Anthropic Messages API over chat completions.
//!
//! Request: `system` (a string or text blocks) becomes the first `system` message; each message's
//! blocks map as `text` → text, `image` (a URL, or base64 as a `data:` URL) → an `image_url`
//! part, an assistant's `tool_use` → `tool_calls` (arguments as JSON text), a user's
//! `tool_result` → a `tool` message (before the rest of that user message, as chat requires);
//! `tools` → function tools, `tool_choice` `auto`/`any`/`tool`/`none` → `auto`/`required`/the
//! named function/`none` (`disable_parallel_tool_use` → `parallel_tool_calls: false`);
//! `stop_sequences` → `stop`, `max_tokens`, `temperature`, `top_p` as they are; a stream asks
//! for `stream_options.include_usage`. `metadata`, `service_tier` and `cache_control` do not
//! change an answer and are not sent. Refused (400): `thinking` (enabled), `top_k`, `container`,
//! `mcp_servers`, server tools (a tool with a `type`), `is_error` tool results, images inside
//! tool results, `thinking`/`document`/other blocks, and any field the API does not define.
//!
//! Answer: `content` is a text block then one `tool_use` block per call; `stop_reason` is
//! `end_turn`, `max_tokens` (`length`), `stop_sequence` (with the sequence when the backend or a
//! single requested sequence says which) or `tool_use` (an answer with tool calls, whatever the
//! backend called its finish); usage is the backend's prompt and completion counts. A stream is
//! `message_start`, `content_block_start`/`content_block_delta` (`text_delta`,
//! `input_json_delta`)/`content_block_stop` per block, `message_delta` (stop reason, usage with
//! `input_tokens` and `output_tokens`), `message_stop` — as vLLM's native stream, except that
//! `message_start` reports 0 input tokens: the chat stream reports usage only at its end, so the
//! count comes in `message_delta` (where the Anthropic SDKs take it from).

use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use serde_json::{json, Map, Value};

use super::chat::{ChunkReader, Counts, Piece, Stop, Whole};
use super::{fresh_id, untranslatable, write_event, Reply, StreamReply, Translation, Translator};
use crate::openai::ApiError;

/// The Messages API's translator.
pub struct MessagesTranslator;

/// The Messages API's translator.
pub static TRANSLATOR: &dyn Translator = &MessagesTranslator;

type Refusal = ApiError;

fn field<'a>(obj: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    obj.get(key).filter(|v| !v.is_null())
}

impl Translator for MessagesTranslator {
    fn request(&self, body: &[u8], stream: bool) -> Result<Translation, ApiError> {
        let req: Map<String, Value> =
            serde_json::from_slice(body).map_err(ApiError::invalid_json)?;
        let mut chat = Map::new();
        let mut messages = Vec::new();
        for (key, value) in &req {
            if value.is_null() {
                continue;
            }
            match key.as_str() {
                "model" | "messages" | "system" | "stream" | "metadata" | "service_tier" => {}
                "max_tokens" | "temperature" | "top_p" => {
                    chat.insert(key.clone(), value.clone());
                }
                "stop_sequences" => {
                    chat.insert("stop".into(), value.clone());
                }
                "tools" => {
                    chat.insert("tools".into(), tools(value)?);
                }
                "tool_choice" => tool_choice(value, &mut chat)?,
                "thinking" if value.get("type").and_then(Value::as_str) == Some("disabled") => {}
                "thinking" => return Err(untranslatable("thinking", "has no extended thinking")),
                "top_k" => return Err(untranslatable("top_k", "has no top-k sampling")),
                "container" | "mcp_servers" => {
                    return Err(untranslatable(key, "runs no server-side tools"))
                }
                other => return Err(untranslatable(other, "has no such field")),
            }
        }
        if let Some(system) = field(&req, "system") {
            messages.push(json!({"role": "system", "content": system_text(system)?}));
        }
        let Some(Value::Array(turns)) = field(&req, "messages") else {
            return Err(
                ApiError::bad_request("`messages` must be an array.").with_param("messages")
            );
        };
        for (i, turn) in turns.iter().enumerate() {
            message(i, turn, &mut messages)?;
        }
        chat.insert("messages".into(), Value::Array(messages));
        if stream {
            chat.insert("stream".into(), Value::Bool(true));
            chat.insert("stream_options".into(), json!({"include_usage": true}));
        }
        let stops = match req.get("stop_sequences") {
            Some(Value::Array(s)) => s
                .iter()
                .filter_map(|v| v.as_str().map(String::from))
                .collect(),
            _ => Vec::new(),
        };
        let model = req.get("model").and_then(Value::as_str).unwrap_or_default();
        let reply = MessagesReply {
            model: model.to_string(),
            stops,
        };
        Ok(Translation::new(chat, Arc::new(reply)))
    }
}

/// `system`: a string, or text blocks (joined).
fn system_text(system: &Value) -> Result<String, Refusal> {
    match system {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => blocks
            .iter()
            .map(
                |b| match (b.get("type").and_then(Value::as_str), b.get("text")) {
                    (Some("text"), Some(Value::String(t))) => Ok(t.as_str()),
                    _ => Err(untranslatable(
                        "system",
                        "takes only text as a system prompt",
                    )),
                },
            )
            .collect::<Result<Vec<_>, _>>()
            .map(|t| t.join("\n")),
        _ => Err(
            ApiError::bad_request("`system` must be a string or text blocks.").with_param("system"),
        ),
    }
}

fn tools(value: &Value) -> Result<Value, Refusal> {
    let Value::Array(list) = value else {
        return Err(ApiError::bad_request("`tools` must be an array.").with_param("tools"));
    };
    let mut out = Vec::with_capacity(list.len());
    for (i, tool) in list.iter().enumerate() {
        let param = format!("tools[{i}]");
        match tool.get("type").and_then(Value::as_str) {
            None | Some("custom") => {}
            Some(kind) => {
                return Err(untranslatable(
                    &format!("{param}.type"),
                    &format!(
                        "has no server tool `{kind}` (only client tools with an input_schema)"
                    ),
                ))
            }
        }
        let name = tool.get("name").and_then(Value::as_str).ok_or_else(|| {
            ApiError::bad_request(format!("`{param}.name` is required."))
                .with_param(format!("{param}.name"))
        })?;
        let mut function = json!({"name": name, "parameters": tool.get("input_schema").cloned().unwrap_or(json!({"type": "object"}))});
        if let Some(d) = tool.get("description").filter(|d| !d.is_null()) {
            function["description"] = d.clone();
        }
        out.push(json!({"type": "function", "function": function}));
    }
    Ok(Value::Array(out))
}

fn tool_choice(value: &Value, chat: &mut Map<String, Value>) -> Result<(), Refusal> {
    let choice = match value.get("type").and_then(Value::as_str) {
        Some("auto") => json!("auto"),
        Some("any") => json!("required"),
        Some("none") => json!("none"),
        Some("tool") => {
            let name = value.get("name").and_then(Value::as_str).ok_or_else(|| {
                ApiError::bad_request("`tool_choice.name` is required.")
                    .with_param("tool_choice.name")
            })?;
            json!({"type": "function", "function": {"name": name}})
        }
        _ => {
            return Err(untranslatable(
                "tool_choice",
                "knows only auto, any, tool and none",
            ))
        }
    };
    chat.insert("tool_choice".into(), choice);
    if value.get("disable_parallel_tool_use") == Some(&Value::Bool(true)) {
        chat.insert("parallel_tool_calls".into(), Value::Bool(false));
    }
    Ok(())
}

/// A content part for an `image` block (`source`: a URL, or base64 data as a `data:` URL).
fn image_part(block: &Value, param: &str) -> Result<Value, Refusal> {
    let source = block.get("source").unwrap_or(&Value::Null);
    let url = match source.get("type").and_then(Value::as_str) {
        Some("url") => source.get("url").and_then(Value::as_str).map(String::from),
        Some("base64") => match (
            source.get("media_type").and_then(Value::as_str),
            source.get("data").and_then(Value::as_str),
        ) {
            (Some(mt), Some(data)) => Some(format!("data:{mt};base64,{data}")),
            _ => None,
        },
        _ => None,
    };
    let url = url.ok_or_else(|| {
        untranslatable(
            &format!("{param}.source"),
            "takes images only as a URL or base64 data",
        )
    })?;
    Ok(json!({"type": "image_url", "image_url": {"url": url}}))
}

/// The text of a `tool_result`'s content (a string or text blocks).
fn tool_result_text(content: Option<&Value>, param: &str) -> Result<String, Refusal> {
    match content {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(blocks)) => blocks
            .iter()
            .map(
                |b| match (b.get("type").and_then(Value::as_str), b.get("text")) {
                    (Some("text"), Some(Value::String(t))) => Ok(t.as_str()),
                    _ => Err(untranslatable(
                        &format!("{param}.content"),
                        "takes only text as a tool's result",
                    )),
                },
            )
            .collect::<Result<Vec<_>, _>>()
            .map(|t| t.join("\n")),
        Some(_) => Err(ApiError::bad_request(format!(
            "`{param}.content` must be a string or blocks."
        ))
        .with_param(param)),
    }
}

/// One Messages-API message as one or more chat messages.
fn message(i: usize, turn: &Value, out: &mut Vec<Value>) -> Result<(), Refusal> {
    let param = format!("messages[{i}]");
    let role = match turn.get("role").and_then(Value::as_str) {
        Some(r @ ("user" | "assistant")) => r,
        _ => {
            return Err(ApiError::bad_request(format!(
                "`{param}.role` must be `user` or `assistant`."
            ))
            .with_param(format!("{param}.role")))
        }
    };
    let blocks = match turn.get("content") {
        Some(Value::String(s)) => {
            out.push(json!({"role": role, "content": s}));
            return Ok(());
        }
        Some(Value::Array(blocks)) => blocks,
        _ => {
            return Err(ApiError::bad_request(format!(
                "`{param}.content` must be a string or blocks."
            ))
            .with_param(format!("{param}.content")))
        }
    };
    let (mut parts, mut calls) = (Vec::new(), Vec::new());
    for (j, block) in blocks.iter().enumerate() {
        let param = format!("{param}.content[{j}]");
        match (role, block.get("type").and_then(Value::as_str)) {
            (_, Some("text")) => {
                let text = block
                    .get("text")
                    .and_then(Value::as_str)
                    .unwrap_or_default();
                parts.push(json!({"type": "text", "text": text}));
            }
            ("user", Some("image")) => parts.push(image_part(block, &param)?),
            ("user", Some("tool_result")) => {
                if block.get("is_error") == Some(&Value::Bool(true)) {
                    return Err(untranslatable(
                        &format!("{param}.is_error"),
                        "cannot mark a tool's result as an error",
                    ));
                }
                let id = block
                    .get("tool_use_id")
                    .and_then(Value::as_str)
                    .unwrap_or_default();
                let text = tool_result_text(block.get("content"), &param)?;
                out.push(json!({"role": "tool", "tool_call_id": id, "content": text}));
            }
            ("assistant", Some("tool_use")) => {
                let input = block.get("input").cloned().unwrap_or(json!({}));
                calls.push(json!({
                    "id": block.get("id").and_then(Value::as_str).unwrap_or_default(),
                    "type": "function",
                    "function": {
                        "name": block.get("name").and_then(Value::as_str).unwrap_or_default(),
                        "arguments": input.to_string(),
                    },
                }));
            }
            (_, kind) => {
                return Err(untranslatable(
                    &format!("{param}.type"),
                    &format!("has no `{}` block in a {role} message", kind.unwrap_or("?")),
                ))
            }
        }
    }
    if !parts.is_empty() {
        let only_text = parts.iter().all(|p| p["type"] == "text");
        let content = if only_text && (role == "assistant" || parts.len() == 1) {
            let texts: Vec<&str> = parts.iter().filter_map(|p| p["text"].as_str()).collect();
            Value::String(texts.concat())
        } else {
            Value::Array(parts)
        };
        out.push(json!({"role": role, "content": content}));
    }
    if !calls.is_empty() {
        // A message of its own: some engines (TGI) read a message as text or as tool calls,
        // never both.
        out.push(json!({"role": "assistant", "tool_calls": calls}));
    }
    Ok(())
}

/// Puts a chat answer back into the Messages API's shape.
struct MessagesReply {
    model: String,
    stops: Vec<String>,
}

impl MessagesReply {
    /// `stop_reason` and `stop_sequence`.
    fn stop(&self, stop: &Stop) -> (&'static str, Value) {
        match stop {
            Stop::End => ("end_turn", Value::Null),
            Stop::Length => ("max_tokens", Value::Null),
            Stop::ToolCalls => ("tool_use", Value::Null),
            Stop::Sequence(Some(s)) => ("stop_sequence", json!(s)),
            Stop::Sequence(None) => match self.stops.as_slice() {
                [only] => ("stop_sequence", json!(only)),
                _ => ("stop_sequence", Value::Null),
            },
        }
    }
}

fn usage(c: Counts) -> Value {
    json!({"input_tokens": c.input, "output_tokens": c.output})
}

fn tool_id(id: &str) -> String {
    if id.is_empty() {
        fresh_id("toolu_")
    } else {
        id.to_string()
    }
}

impl Reply for MessagesReply {
    fn whole(&self, json: &[u8]) -> Result<Bytes, String> {
        let w = Whole::read(json)?;
        let mut content = Vec::new();
        if !w.text.is_empty() || w.calls.is_empty() {
            content.push(json!({"type": "text", "text": w.text}));
        }
        for call in &w.calls {
            let input: Value = if call.arguments.trim().is_empty() {
                json!({})
            } else {
                serde_json::from_str(&call.arguments)
                    .map_err(|e| format!("sent tool call arguments that are not JSON ({e})"))?
            };
            content.push(json!({"type": "tool_use", "id": tool_id(&call.id), "name": call.name, "input": input}));
        }
        let (reason, sequence) = self.stop(&w.stop);
        let answer = json!({
            "id": fresh_id("msg_"),
            "type": "message",
            "role": "assistant",
            "content": content,
            "model": self.model,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": usage(w.counts.unwrap_or_default()),
        });
        Ok(Bytes::from(answer.to_string()))
    }

    fn stream(&self) -> Box<dyn StreamReply> {
        Box::new(MessagesStream {
            reply: MessagesReply {
                model: self.model.clone(),
                stops: self.stops.clone(),
            },
            reader: ChunkReader::default(),
            started: false,
            open: Open::None,
            blocks: 0,
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Open {
    None,
    Text,
    Tool,
}

struct MessagesStream {
    reply: MessagesReply,
    reader: ChunkReader,
    started: bool,
    open: Open,
    /// Blocks started so far (the next block's index).
    blocks: u64,
}

impl MessagesStream {
    fn start(&mut self, out: &mut BytesMut) {
        if self.started {
            return;
        }
        self.started = true;
        let message = json!({
            "id": fresh_id("msg_"), "type": "message", "role": "assistant", "content": [],
            "model": self.reply.model, "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        });
        write_event(
            out,
            "message_start",
            &json!({"type": "message_start", "message": message}),
        );
    }

    fn close(&mut self, out: &mut BytesMut) {
        if self.open != Open::None {
            let index = self.blocks - 1;
            write_event(
                out,
                "content_block_stop",
                &json!({"type": "content_block_stop", "index": index}),
            );
            self.open = Open::None;
        }
    }

    fn open(&mut self, kind: Open, block: Value, out: &mut BytesMut) {
        self.close(out);
        let event =
            json!({"type": "content_block_start", "content_block": block, "index": self.blocks});
        write_event(out, "content_block_start", &event);
        self.blocks += 1;
        self.open = kind;
    }

    fn delta(&self, delta: Value, out: &mut BytesMut) {
        let event =
            json!({"type": "content_block_delta", "delta": delta, "index": self.blocks - 1});
        write_event(out, "content_block_delta", &event);
    }

    fn piece(&mut self, piece: Piece, out: &mut BytesMut) {
        match piece {
            Piece::Text(text) => {
                if self.open != Open::Text {
                    self.open(Open::Text, json!({"type": "text", "text": ""}), out);
                }
                self.delta(json!({"type": "text_delta", "text": text}), out);
            }
            Piece::CallStart { id, name } => {
                let block =
                    json!({"type": "tool_use", "id": tool_id(&id), "name": name, "input": {}});
                self.open(Open::Tool, block, out);
            }
            Piece::Args(args) if self.open == Open::Tool => {
                self.delta(
                    json!({"type": "input_json_delta", "partial_json": args}),
                    out,
                );
            }
            Piece::Args(_) => {}
        }
    }
}

impl StreamReply for MessagesStream {
    fn event(&mut self, data: &[u8], out: &mut BytesMut) -> bool {
        let Ok(read) = self.reader.read(data) else {
            super::pass_on(data, out);
            return true;
        };
        self.start(out);
        if let Some(message) = read.error {
            let err = ApiError::bad_gateway(format!("The backend failed: {message}"));
            out.extend_from_slice(&crate::api::messages::stream_error_event(&err));
            return false;
        }
        for piece in read.pieces {
            self.piece(piece, out);
        }
        true
    }

    fn end(&mut self, out: &mut BytesMut) {
        let Some(stop) = self.reader.final_stop() else {
            return;
        };
        self.start(out);
        if self.blocks == 0 {
            self.open(Open::Text, json!({"type": "text", "text": ""}), out);
        }
        self.close(out);
        let (reason, sequence) = self.reply.stop(&stop);
        let delta = json!({
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": usage(self.reader.final_counts()),
        });
        write_event(out, "message_delta", &delta);
        write_event(out, "message_stop", &json!({"type": "message_stop"}));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn translate(body: Value, stream: bool) -> Translation {
        TRANSLATOR
            .request(body.to_string().as_bytes(), stream)
            .unwrap()
    }

    #[test]
    fn request_maps_every_translated_field() {
        let t = translate(
            json!({"model": "m", "max_tokens": 9, "system": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}],
                "stop_sequences": ["END"], "temperature": 0.2, "top_p": 0.8, "metadata": {"user_id": "u"},
                "tools": [{"name": "f", "description": "d", "input_schema": {"type": "object"}, "cache_control": {"type": "ephemeral"}}],
                "tool_choice": {"type": "any", "disable_parallel_tool_use": true},
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "look"},
                        {"type": "image", "source": {"type": "url", "url": "http://x/a.png"}},
                        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "QUJD"}}]},
                    {"role": "assistant", "content": [{"type": "text", "text": "Calling."},
                        {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "42"}]},
                        {"type": "text", "text": "thanks"}]}]}),
            true,
        );
        let chat = Value::Object(t.chat().clone());
        assert_eq!(
            chat,
            json!({"max_tokens": 9, "stop": ["END"], "temperature": 0.2, "top_p": 0.8,
                "tools": [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}],
                "tool_choice": "required", "parallel_tool_calls": false,
                "stream": true, "stream_options": {"include_usage": true},
                "messages": [
                    {"role": "system", "content": "A\nB"},
                    {"role": "user", "content": [{"type": "text", "text": "look"},
                        {"type": "image_url", "image_url": {"url": "http://x/a.png"}},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,QUJD"}}]},
                    {"role": "assistant", "content": "Calling."},
                    {"role": "assistant", "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "f", "arguments": "{\"a\":1}"}}]},
                    {"role": "tool", "tool_call_id": "t1", "content": "42"},
                    {"role": "user", "content": "thanks"}]})
        );
        let body: Value = serde_json::from_slice(&t.body("backend-m")).unwrap();
        assert_eq!(body["model"], "backend-m");
        for (choice, want) in [
            (json!({"type": "auto"}), json!("auto")),
            (json!({"type": "none"}), json!("none")),
            (
                json!({"type": "tool", "name": "f"}),
                json!({"type": "function", "function": {"name": "f"}}),
            ),
        ] {
            let t = translate(
                json!({"model": "m", "max_tokens": 1, "tool_choice": choice, "messages": []}),
                false,
            );
            assert_eq!(t.chat()["tool_choice"], want);
            assert!(!t.chat().contains_key("stream"));
        }
    }

    #[test]
    fn refusals_name_the_field() {
        for (body, param) in [
            (
                json!({"thinking": {"type": "enabled", "budget_tokens": 10}}),
                "thinking",
            ),
            (json!({"top_k": 1}), "top_k"),
            (json!({"mcp_servers": []}), "mcp_servers"),
            (json!({"bogus": 1}), "bogus"),
            (
                json!({"tools": [{"type": "bash_20250124", "name": "bash"}]}),
                "tools[0].type",
            ),
            (json!({"system": [{"type": "image"}]}), "system"),
            (
                json!({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}]}]}),
                "messages[0].content[0].source",
            ),
        ] {
            let mut req = json!({"model": "m", "max_tokens": 1, "messages": []});
            for (k, v) in body.as_object().unwrap() {
                req[k] = v.clone();
            }
            let err = TRANSLATOR
                .request(req.to_string().as_bytes(), false)
                .err()
                .unwrap();
            assert_eq!(
                (err.status.as_u16(), err.param.as_deref()),
                (400, Some(param)),
                "{err:?}"
            );
            assert!(
                err.message.contains(&format!("`{param}`")),
                "{}",
                err.message
            );
        }
    }

    fn reply(stops: &[&str]) -> MessagesReply {
        MessagesReply {
            model: "client-m".into(),
            stops: stops.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn whole_answers_in_anthropics_shape() {
        let text = br#"{"choices":[{"message":{"content":"Hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":7,"completion_tokens":2}}"#;
        let v: Value = serde_json::from_slice(&reply(&[]).whole(text).unwrap()).unwrap();
        assert_eq!(v["content"], json!([{"type": "text", "text": "Hi"}]));
        assert_eq!(
            (v["stop_reason"].as_str(), v["model"].as_str()),
            (Some("end_turn"), Some("client-m"))
        );
        assert_eq!(v["usage"], json!({"input_tokens": 7, "output_tokens": 2}));
        assert!(v["id"].as_str().unwrap().starts_with("msg_"));
        let seq = br#"{"choices":[{"message":{"content":"Hi"},"finish_reason":"stop_sequence"}]}"#;
        let v: Value = serde_json::from_slice(&reply(&["END"]).whole(seq).unwrap()).unwrap();
        assert_eq!(
            (v["stop_reason"].as_str(), v["stop_sequence"].as_str()),
            (Some("stop_sequence"), Some("END"))
        );
        let v: Value = serde_json::from_slice(&reply(&["A", "B"]).whole(seq).unwrap()).unwrap();
        assert!(v["stop_sequence"].is_null());
        let call = br#"{"choices":[{"message":{"tool_calls":[{"id":"","function":{"name":"f","arguments":"{\"x\":1}"}}]},"finish_reason":"stop"}]}"#;
        let v: Value = serde_json::from_slice(&reply(&[]).whole(call).unwrap()).unwrap();
        assert_eq!(v["stop_reason"], "tool_use");
        assert_eq!(v["content"][0]["input"], json!({"x": 1}));
        assert!(v["content"][0]["id"]
            .as_str()
            .unwrap()
            .starts_with("toolu_"));
        let cut = br#"{"choices":[{"message":{"tool_calls":[{"function":{"name":"f","arguments":"{\"x\":"}}]},"finish_reason":"length"}]}"#;
        assert!(reply(&[]).whole(cut).unwrap_err().contains("not JSON"));
    }

    fn run(chunks: &[&str]) -> (Vec<(String, Value)>, bool) {
        let mut s = reply(&[]).stream();
        let mut out = BytesMut::new();
        let mut open = true;
        for c in chunks {
            open = s.event(c.as_bytes(), &mut out);
            if !open {
                break;
            }
        }
        if open {
            s.end(&mut out);
        }
        let text = String::from_utf8(out.to_vec()).unwrap();
        let events = text
            .split("\n\n")
            .filter(|e| !e.is_empty())
            .map(|e| {
                let (kind, data) = e.split_once("\ndata: ").unwrap();
                (
                    kind.trim_start_matches("event: ").to_string(),
                    serde_json::from_str(data).unwrap(),
                )
            })
            .collect();
        (events, open)
    }

    #[test]
    fn stream_of_text_then_a_tool_call() {
        let (events, open) = run(&[
            r#"{"choices":[{"delta":{"content":"Hi"},"finish_reason":null}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"id":"c1","function":{"name":"f","arguments":"{\"x\""}}]},"finish_reason":null}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"arguments":":1}"}}]},"finish_reason":"tool_calls"}]}"#,
            r#"{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":4}}"#,
        ]);
        assert!(open);
        let kinds: Vec<&str> = events.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(
            kinds,
            [
                "message_start",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop"
            ]
        );
        assert_eq!(
            events[4].1["content_block"],
            json!({"type": "tool_use", "id": "c1", "name": "f", "input": {}})
        );
        assert_eq!(events[4].1["index"], 1);
        assert_eq!(
            events[6].1["delta"],
            json!({"type": "input_json_delta", "partial_json": ":1}"})
        );
        assert_eq!(events[8].1["delta"]["stop_reason"], "tool_use");
        assert_eq!(
            events[8].1["usage"],
            json!({"input_tokens": 5, "output_tokens": 4})
        );
        assert_eq!(events[0].1["message"]["model"], "client-m");
    }

    #[test]
    fn stream_errors_and_breaks() {
        let (events, open) = run(&[
            r#"{"choices":[{"delta":{"content":"Hi"}}]}"#,
            r#"{"error":{"message":"engine died"}}"#,
        ]);
        assert!(!open);
        let (kind, data) = events.last().unwrap();
        assert_eq!(
            (kind.as_str(), data["error"]["type"].as_str()),
            ("error", Some("api_error"))
        );
        assert!(data["error"]["message"]
            .as_str()
            .unwrap()
            .contains("engine died"));
        // No finish reason: no closing events (the observer reports the stream as broken).
        let (events, _) = run(&[r#"{"choices":[{"delta":{"content":"Hi"}}]}"#]);
        assert!(!events
            .iter()
            .any(|(k, _)| k == "message_stop" || k == "message_delta"));
        // An answer with no output still has its one (empty) text block.
        let (events, _) =
            run(&[r#"{"choices":[{"delta":{"content":""},"finish_reason":"stop"}]}"#]);
        assert_eq!(
            events[1].1["content_block"],
            json!({"type": "text", "text": ""})
        );
        assert_eq!(events[3].1["delta"]["stop_reason"], "end_turn");
        // Data that is not a chat chunk is passed on for the observer to judge.
        let mut s = reply(&[]).stream();
        let mut out = BytesMut::new();
        assert!(s.event(b"{not json", &mut out));
        assert_eq!(&out[..], b"data: {not json\n\n");
    }
}
