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
