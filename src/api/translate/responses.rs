//! The OpenAI Responses API over chat completions (the stateless part).
//!
//! Request: `instructions` becomes the first `system` message; `input` (a string, or items)
//! maps item by item: a message (`user`, `assistant`, `system`, `developer` → `system`) with
//! `input_text`/`output_text` → text and `input_image` with an `image_url` → an `image_url`
//! part; `function_call` items → an assistant message's `tool_calls` (consecutive calls in one
//! message); `function_call_output` → a `tool` message. Function `tools` → chat's function
//! tools, `tool_choice` as it is (a named function in chat's form), `max_output_tokens` →
//! `max_tokens`, `temperature`, `top_p`, `parallel_tool_calls` as they are; a stream asks for
//! `stream_options.include_usage`. `metadata`, `user`, `service_tier`, `safety_identifier`,
//! `prompt_cache_key`, `prompt_cache_retention`, `stream_options` do not change an answer and
//! are echoed or not sent.
//!
//! Refused (400, `param` naming the field): `previous_response_id`, `conversation`,
//! `background: true`, `store: true` (state lives in one engine's memory; chat completions has
//! none), non-empty `include`, `reasoning`, `prompt`, `max_tool_calls`, `top_logprobs`,
//! `truncation: "auto"`, a `text.format` other than text, `text.verbosity`, built-in tools
//! (`web_search`, `file_search`, `computer_use_preview`, `code_interpreter`, `mcp`, …),
//! `tool_choice` naming one, input items other than messages and function calls and their
//! outputs (`reasoning`, `item_reference`, …), images by `file_id`, files, and any field the
//! API does not define.
//!
//! Answer: a response object shaped like vLLM's (`status` `completed`, or `incomplete` with
//! `incomplete_details.reason: "max_output_tokens"` when the backend said `length`); `output`
//! is a `message` item with one `output_text` part, then one `function_call` item per call;
//! usage with `input_tokens`/`output_tokens`/`total_tokens`. A stream is vLLM's event sequence:
//! `response.created`, `response.in_progress`, per item `response.output_item.added`, for text
//! `response.content_part.added`, `response.output_text.delta`…, `response.output_text.done`,
//! `response.content_part.done`, for a call `response.function_call_arguments.delta`…,
//! `response.function_call_arguments.done`, then `response.output_item.done`, and
//! `response.completed` with the whole response and its usage (vLLM ends an incomplete answer
//! with `response.completed` too, its `status` saying `incomplete`).

use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use serde_json::{json, Map, Value};

use super::chat::{ChunkReader, Counts, Piece, Stop, Whole};
use super::{
    fresh_id, now_secs, pass_on, untranslatable, write_event, Reply, StreamReply, Translation,
    Translator,
};
use crate::openai::ApiError;

/// The Responses API's translator.
pub struct ResponsesTranslator;

/// The Responses API's translator.
pub static TRANSLATOR: &dyn Translator = &ResponsesTranslator;

/// What the response object echoes of the request.
const ECHOED: [&str; 9] = [
    "instructions",
    "max_output_tokens",
    "metadata",
    "parallel_tool_calls",
    "temperature",
    "tool_choice",
    "tools",
    "top_p",
    "user",
];

fn is_set(v: &Value) -> bool {
    !matches!(v, Value::Null | Value::Bool(false))
        && v.as_array().is_none_or(|a| !a.is_empty())
        && v.as_u64() != Some(0)
}

impl Translator for ResponsesTranslator {
    fn request(&self, body: &[u8], stream: bool) -> Result<Translation, ApiError> {
        let req: Map<String, Value> =
            serde_json::from_slice(body).map_err(ApiError::invalid_json)?;
        let mut chat = Map::new();
        for (key, value) in &req {
            if value.is_null() {
                continue;
            }
            top_level(key, value, &mut chat)?;
        }
        let mut messages = Vec::new();
        if let Some(Value::String(s)) = req.get("instructions") {
            messages.push(json!({"role": "system", "content": s}));
        }
        match req.get("input") {
            Some(Value::String(s)) => messages.push(json!({"role": "user", "content": s})),
            Some(Value::Array(items)) => {
                for (i, item) in items.iter().enumerate() {
                    input_item(i, item, &mut messages)?;
                }
            }
            _ => {
                return Err(
                    ApiError::bad_request("`input` must be a string or a list of items.")
                        .with_param("input"),
                )
            }
        }
        chat.insert("messages".into(), Value::Array(messages));
        if stream {
            chat.insert("stream".into(), Value::Bool(true));
            chat.insert("stream_options".into(), json!({"include_usage": true}));
        }
        let echo: Map<String, Value> = ECHOED
            .iter()
            .filter_map(|k| req.get(*k).map(|v| (k.to_string(), v.clone())))
            .collect();
        let model = req.get("model").and_then(Value::as_str).unwrap_or_default();
        let reply = ResponsesReply {
            model: model.to_string(),
            echo,
        };
        Ok(Translation::new(chat, Arc::new(reply)))
    }
}

/// One top-level field: mapped into `chat`, accepted as having no effect, or refused.
fn top_level(key: &str, value: &Value, chat: &mut Map<String, Value>) -> Result<(), ApiError> {
    let stateful = "keeps no state between requests";
    match key {
        "model"
        | "input"
        | "instructions"
        | "stream"
        | "metadata"
        | "user"
        | "service_tier"
        | "safety_identifier"
        | "prompt_cache_key"
        | "prompt_cache_retention"
        | "stream_options" => {}
        "max_output_tokens" => {
            chat.insert("max_tokens".into(), value.clone());
        }
        "temperature" | "top_p" | "parallel_tool_calls" => {
            chat.insert(key.into(), value.clone());
        }
        "tools" => {
            chat.insert("tools".into(), tools(value)?);
        }
        "tool_choice" => {
            chat.insert("tool_choice".into(), tool_choice(value)?);
        }
        "truncation" if value == "disabled" => {}
        "truncation" => return Err(untranslatable(key, "cannot truncate a conversation")),
        "text" => text_config(value)?,
        "previous_response_id" | "conversation" => return Err(untranslatable(key, stateful)),
        "store" | "background" if !is_set(value) => {}
        "store" => return Err(untranslatable(key, stateful)),
        "background" => return Err(untranslatable(key, "answers only while the client waits")),
        "include" | "top_logprobs" if !is_set(value) => {}
        "include" => {
            return Err(untranslatable(
                key,
                "has none of the extra output it asks for",
            ))
        }
        "top_logprobs" => {
            return Err(untranslatable(
                key,
                "is not asked for log probabilities here",
            ))
        }
        "reasoning"
            if value
                .as_object()
                .is_some_and(|o| o.values().all(Value::is_null)) => {}
        "reasoning" => return Err(untranslatable(key, "has no reasoning configuration")),
        "prompt" => return Err(untranslatable(key, "has no stored prompt templates")),
        "max_tool_calls" => return Err(untranslatable(key, "cannot limit tool calls")),
        other => return Err(untranslatable(other, "has no such field")),
    }
    Ok(())
}

/// `text`: only plain text output translates.
fn text_config(value: &Value) -> Result<(), ApiError> {
    if let Some(format) = value.get("format").filter(|f| !f.is_null()) {
        if format.get("type").and_then(Value::as_str) != Some("text") {
            return Err(untranslatable(
                "text.format",
                "is not asked for structured output here",
            ));
        }
    }
    if value.get("verbosity").is_some_and(|v| !v.is_null()) {
        return Err(untranslatable("text.verbosity", "has no verbosity"));
    }
    Ok(())
}

fn tools(value: &Value) -> Result<Value, ApiError> {
    let Value::Array(list) = value else {
        return Err(ApiError::bad_request("`tools` must be an array.").with_param("tools"));
    };
    let mut out = Vec::with_capacity(list.len());
    for (i, tool) in list.iter().enumerate() {
        match tool.get("type").and_then(Value::as_str) {
            Some("function") => {}
            kind => {
                return Err(untranslatable(
                    &format!("tools[{i}].type"),
                    &format!(
                        "has no built-in tool `{}` (only function tools)",
                        kind.unwrap_or("?")
                    ),
                ))
            }
        }
        let mut function = Map::new();
        for key in ["name", "description", "parameters", "strict"] {
            if let Some(v) = tool.get(key).filter(|v| !v.is_null()) {
                function.insert(key.into(), v.clone());
            }
        }
        out.push(json!({"type": "function", "function": function}));
    }
    Ok(Value::Array(out))
}

fn tool_choice(value: &Value) -> Result<Value, ApiError> {
    match value {
        Value::String(s) if matches!(s.as_str(), "auto" | "none" | "required") => Ok(value.clone()),
        Value::Object(o) if o.get("type").and_then(Value::as_str) == Some("function") => {
            let name = o.get("name").and_then(Value::as_str).ok_or_else(|| {
                ApiError::bad_request("`tool_choice.name` is required.")
                    .with_param("tool_choice.name")
            })?;
            Ok(json!({"type": "function", "function": {"name": name}}))
        }
        _ => Err(untranslatable(
            "tool_choice",
            "knows only auto, none, required and a named function",
        )),
    }
}

/// The content of a message item: a string, or parts (text and images by URL).
fn content(role: &str, content: Option<&Value>, param: &str) -> Result<Value, ApiError> {
    let parts = match content {
        Some(Value::String(s)) => return Ok(Value::String(s.clone())),
        Some(Value::Array(parts)) => parts,
        _ => {
            return Err(ApiError::bad_request(format!(
                "`{param}.content` must be a string or a list of parts."
            ))
            .with_param(format!("{param}.content")))
        }
    };
    let mut out = Vec::with_capacity(parts.len());
    for (j, part) in parts.iter().enumerate() {
        let param = format!("{param}.content[{j}]");
        match part.get("type").and_then(Value::as_str) {
            Some("input_text" | "output_text" | "text") => {
                let text = part.get("text").and_then(Value::as_str).unwrap_or_default();
                out.push(json!({"type": "text", "text": text}));
            }
            Some("input_image") => {
                let Some(url) = part.get("image_url").and_then(Value::as_str) else {
                    return Err(untranslatable(
                        &format!("{param}.file_id"),
                        "takes images only by URL",
                    ));
                };
                let mut image = json!({"url": url});
                if let Some(d) = part.get("detail").filter(|d| !d.is_null()) {
                    image["detail"] = d.clone();
                }
                out.push(json!({"type": "image_url", "image_url": image}));
            }
            kind => {
                return Err(untranslatable(
                    &format!("{param}.type"),
                    &format!("has no `{}` content", kind.unwrap_or("?")),
                ))
            }
        }
    }
    let only_text = out.iter().all(|p| p["type"] == "text");
    if only_text && (role == "assistant" || out.len() == 1) {
        let texts: Vec<&str> = out.iter().filter_map(|p| p["text"].as_str()).collect();
        return Ok(Value::String(texts.concat()));
    }
    Ok(Value::Array(out))
}

/// One input item as chat messages (consecutive function calls join one assistant message).
fn input_item(i: usize, item: &Value, out: &mut Vec<Value>) -> Result<(), ApiError> {
    let param = format!("input[{i}]");
    let kind = item.get("type").and_then(Value::as_str);
    match kind {
        None | Some("message") => {
            let role = match item.get("role").and_then(Value::as_str) {
                Some("developer" | "system") => "system",
                Some(r @ ("user" | "assistant")) => r,
                _ => {
                    return Err(ApiError::bad_request(format!(
                        "`{param}.role` must be user, assistant, system or developer."
                    ))
                    .with_param(format!("{param}.role")))
                }
            };
            let content = content(role, item.get("content"), &param)?;
            out.push(json!({"role": role, "content": content}));
        }
        Some("function_call") => {
            let call = json!({
                "id": item.get("call_id").and_then(Value::as_str).unwrap_or_default(),
                "type": "function",
                "function": {
                    "name": item.get("name").and_then(Value::as_str).unwrap_or_default(),
                    "arguments": item.get("arguments").and_then(Value::as_str).unwrap_or("{}"),
                },
            });
            let joined = out.last_mut().and_then(|m| {
                let calls = m.get_mut("tool_calls")?.as_array_mut()?;
                calls.push(call.clone());
                Some(())
            });
            if joined.is_none() {
                out.push(json!({"role": "assistant", "tool_calls": [call]}));
            }
        }
        Some("function_call_output") => {
            let output = match item.get("output") {
                Some(Value::String(s)) => s.clone(),
                Some(parts @ Value::Array(_)) => match content("tool", Some(parts), &param)? {
                    Value::String(s) => s,
                    _ => {
                        return Err(untranslatable(
                            &format!("{param}.output"),
                            "takes only text as a tool's result",
                        ))
                    }
                },
                _ => String::new(),
            };
            let id = item
                .get("call_id")
                .and_then(Value::as_str)
                .unwrap_or_default();
            out.push(json!({"role": "tool", "tool_call_id": id, "content": output}));
        }
        Some(other) => {
            return Err(untranslatable(
                &format!("{param}.type"),
                &format!("has no `{other}` item"),
            ))
        }
    }
    Ok(())
}

/// Puts a chat answer back into the Responses API's shape.
struct ResponsesReply {
    model: String,
    echo: Map<String, Value>,
}

fn usage(c: Counts) -> Value {
    json!({
        "input_tokens": c.input,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": c.output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": c.input + c.output,
    })
}

fn message_item(id: &str, text: &str, status: &str) -> Value {
    let content = if status == "in_progress" {
        json!([])
    } else {
        json!([{"annotations": [], "text": text, "type": "output_text", "logprobs": null}])
    };
    json!({"id": id, "content": content, "role": "assistant", "status": status, "type": "message"})
}

fn call_item(id: &str, call_id: &str, name: &str, arguments: &str, status: &str) -> Value {
    json!({"id": id, "type": "function_call", "status": status, "arguments": arguments,
           "call_id": call_id, "name": name})
}

fn call_id(id: &str) -> String {
    if id.is_empty() {
        fresh_id("call_")
    } else {
        id.to_string()
    }
}

impl ResponsesReply {
    /// The response object.
    fn response(
        &self,
        id: &str,
        created: u64,
        end: Option<(&Stop, Counts)>,
        output: Vec<Value>,
    ) -> Value {
        let get = |k: &str, default: Value| self.echo.get(k).cloned().unwrap_or(default);
        let (status, incomplete, usage) = match end {
            None => ("in_progress", Value::Null, Value::Null),
            Some((Stop::Length, c)) => (
                "incomplete",
                json!({"reason": "max_output_tokens"}),
                usage(c),
            ),
            Some((_, c)) => ("completed", Value::Null, usage(c)),
        };
        json!({
            "id": id, "created_at": created, "incomplete_details": incomplete,
            "instructions": get("instructions", Value::Null), "metadata": get("metadata", Value::Null),
            "model": self.model, "object": "response", "output": output,
            "parallel_tool_calls": get("parallel_tool_calls", json!(true)),
            "temperature": get("temperature", json!(1.0)),
            "tool_choice": get("tool_choice", json!("auto")), "tools": get("tools", json!([])),
            "top_p": get("top_p", json!(1.0)), "background": false,
            "max_output_tokens": get("max_output_tokens", Value::Null), "max_tool_calls": null,
            "previous_response_id": null, "prompt": null, "reasoning": null,
            "service_tier": "auto", "status": status, "text": null, "top_logprobs": null,
            "truncation": "disabled", "usage": usage, "user": get("user", Value::Null),
        })
    }
}

impl Reply for ResponsesReply {
    fn whole(&self, json: &[u8]) -> Result<Bytes, String> {
        let w = Whole::read(json)?;
        let mut output = Vec::new();
        if !w.text.is_empty() || w.calls.is_empty() {
            output.push(message_item(&fresh_id("msg_"), &w.text, "completed"));
        }
        for call in &w.calls {
            let (id, call_id) = (fresh_id("fc_"), call_id(&call.id));
            output.push(call_item(
                &id,
                &call_id,
                &call.name,
                &call.arguments,
                "completed",
            ));
        }
        let end = (&w.stop, w.counts.unwrap_or_default());
        let answer = self.response(&fresh_id("resp_"), now_secs(), Some(end), output);
        Ok(Bytes::from(answer.to_string()))
    }

    fn stream(&self) -> Box<dyn StreamReply> {
        Box::new(ResponsesStream {
            reply: ResponsesReply {
                model: self.model.clone(),
                echo: self.echo.clone(),
            },
            reader: ChunkReader::default(),
            id: fresh_id("resp_"),
            created: now_secs(),
            sequence: 0,
            started: false,
            open: None,
            output: Vec::new(),
        })
    }
}

/// The output item being streamed.
enum Item {
    Message {
        id: String,
        text: String,
    },
    Call {
        id: String,
        call_id: String,
        name: String,
        arguments: String,
    },
}

struct ResponsesStream {
    reply: ResponsesReply,
    reader: ChunkReader,
    id: String,
    created: u64,
    sequence: u64,
    started: bool,
    open: Option<Item>,
    /// The finished items.
    output: Vec<Value>,
}

impl ResponsesStream {
    /// Write an event: its `type` and `sequence_number` are set here.
    fn emit(&mut self, out: &mut BytesMut, kind: &str, mut data: Value) {
        data["sequence_number"] = json!(self.sequence);
        data["type"] = json!(kind);
        self.sequence += 1;
        write_event(out, kind, &data);
    }

    fn start(&mut self, out: &mut BytesMut) {
        if self.started {
            return;
        }
        self.started = true;
        let response = self
            .reply
            .response(&self.id, self.created, None, Vec::new());
        self.emit(out, "response.created", json!({"response": response}));
        self.emit(out, "response.in_progress", json!({"response": response}));
    }

    fn index(&self) -> usize {
        self.output.len()
    }

    fn open_message(&mut self, out: &mut BytesMut) {
        self.close(out);
        let (id, index) = (fresh_id("msg_"), self.index());
        let item = message_item(&id, "", "in_progress");
        self.emit(
            out,
            "response.output_item.added",
            json!({"item": item, "output_index": index}),
        );
        let part = json!({"annotations": [], "text": "", "type": "output_text", "logprobs": []});
        self.emit(
            out,
            "response.content_part.added",
            json!({"content_index": 0, "item_id": id, "output_index": index, "part": part}),
        );
        self.open = Some(Item::Message {
            id,
            text: String::new(),
        });
    }

    fn open_call(&mut self, out: &mut BytesMut, id: &str, name: String) {
        self.close(out);
        let (item_id, call_id, index) = (fresh_id("fc_"), call_id(id), self.index());
        let item = call_item(&item_id, &call_id, &name, "", "in_progress");
        self.emit(
            out,
            "response.output_item.added",
            json!({"item": item, "output_index": index}),
        );
        self.open = Some(Item::Call {
            id: item_id,
            call_id,
            name,
            arguments: String::new(),
        });
    }

    fn close(&mut self, out: &mut BytesMut) {
        let index = self.index();
        let item = match self.open.take() {
            None => return,
            Some(Item::Message { id, text }) => {
                let ids = json!({"content_index": 0, "item_id": id, "output_index": index});
                let mut done = ids.clone();
                done["logprobs"] = json!([]);
                done["text"] = json!(text);
                self.emit(out, "response.output_text.done", done);
                let mut part = ids;
                part["part"] = json!({"annotations": [], "text": text, "type": "output_text", "logprobs": null});
                self.emit(out, "response.content_part.done", part);
                message_item(&id, &text, "completed")
            }
            Some(Item::Call {
                id,
                call_id,
                name,
                arguments,
            }) => {
                let done = json!({"arguments": arguments, "item_id": id, "name": name, "output_index": index});
                self.emit(out, "response.function_call_arguments.done", done);
                call_item(&id, &call_id, &name, &arguments, "completed")
            }
        };
        self.emit(
            out,
            "response.output_item.done",
            json!({"item": item, "output_index": index}),
        );
        self.output.push(item);
    }

    fn piece(&mut self, piece: Piece, out: &mut BytesMut) {
        match piece {
            Piece::Text(delta) => {
                if !matches!(self.open, Some(Item::Message { .. })) {
                    self.open_message(out);
                }
                let Some(Item::Message { id, text }) = &mut self.open else {
                    return;
                };
                text.push_str(&delta);
                let event = json!({"content_index": 0, "delta": delta, "item_id": id, "logprobs": [], "output_index": self.output.len()});
                self.emit(out, "response.output_text.delta", event);
            }
            Piece::CallStart { id, name } => self.open_call(out, &id, name),
            Piece::Args(delta) => {
                let Some(Item::Call { id, arguments, .. }) = &mut self.open else {
                    return;
                };
                arguments.push_str(&delta);
                let event =
                    json!({"delta": delta, "item_id": id, "output_index": self.output.len()});
                self.emit(out, "response.function_call_arguments.delta", event);
            }
        }
    }
}

impl StreamReply for ResponsesStream {
    fn event(&mut self, data: &[u8], out: &mut BytesMut) -> bool {
        let Ok(read) = self.reader.read(data) else {
            pass_on(data, out);
            return true;
        };
        self.start(out);
        if let Some(message) = read.error {
            let err = ApiError::bad_gateway(format!("The backend failed: {message}"));
            out.extend_from_slice(&crate::api::responses::stream_error_event(&err));
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
        if self.output.is_empty() && self.open.is_none() {
            self.open_message(out);
        }
        self.close(out);
        let counts = self.reader.final_counts();
        let output = std::mem::take(&mut self.output);
        let response = self
            .reply
            .response(&self.id, self.created, Some((&stop, counts)), output);
        self.emit(out, "response.completed", json!({"response": response}));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn translate(body: Value, stream: bool) -> Result<Translation, ApiError> {
        TRANSLATOR.request(body.to_string().as_bytes(), stream)
    }

    #[test]
    fn request_maps_every_translated_field() {
        let t = translate(
            json!({"model": "m", "instructions": "Be brief.", "max_output_tokens": 9, "temperature": 0.1,
                "top_p": 0.5, "parallel_tool_calls": false, "store": false, "metadata": {"k": "v"},
                "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": true}],
                "tool_choice": {"type": "function", "name": "f"},
                "input": [
                    {"role": "developer", "content": "Dev."},
                    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "see"},
                        {"type": "input_image", "image_url": "http://x/i.png", "detail": "low"}]},
                    {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                    {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{\"a\":2}"},
                    {"type": "function_call_output", "call_id": "c1", "output": "one"},
                    {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]},
                    {"role": "assistant", "content": [{"type": "output_text", "text": "Done."}]}]}),
            true,
        )
        .unwrap();
        assert_eq!(
            Value::Object(t.chat().clone()),
            json!({"max_tokens": 9, "temperature": 0.1, "top_p": 0.5, "parallel_tool_calls": false,
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "strict": true}}],
                "tool_choice": {"type": "function", "function": {"name": "f"}},
                "stream": true, "stream_options": {"include_usage": true},
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "system", "content": "Dev."},
                    {"role": "user", "content": [{"type": "text", "text": "see"},
                        {"type": "image_url", "image_url": {"url": "http://x/i.png", "detail": "low"}}]},
                    {"role": "assistant", "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                        {"id": "c2", "type": "function", "function": {"name": "f", "arguments": "{\"a\":2}"}}]},
                    {"role": "tool", "tool_call_id": "c1", "content": "one"},
                    {"role": "tool", "tool_call_id": "c2", "content": "two"},
                    {"role": "assistant", "content": "Done."}]})
        );
        let t = translate(json!({"model": "m", "input": "hi"}), false).unwrap();
        assert_eq!(
            t.chat()["messages"],
            json!([{"role": "user", "content": "hi"}])
        );
        assert!(translate(json!({"model": "m", "input": 5}), false).is_err());
    }

    #[test]
    fn refusals_name_the_field() {
        for (extra, param) in [
            (json!({"previous_response_id": "r"}), "previous_response_id"),
            (json!({"store": true}), "store"),
            (json!({"background": true}), "background"),
            (json!({"include": ["x"]}), "include"),
            (json!({"reasoning": {"effort": "low"}}), "reasoning"),
            (
                json!({"text": {"format": {"type": "json_schema"}}}),
                "text.format",
            ),
            (
                json!({"tools": [{"type": "code_interpreter"}]}),
                "tools[0].type",
            ),
            (
                json!({"tool_choice": {"type": "file_search"}}),
                "tool_choice",
            ),
            (json!({"input": [{"type": "reasoning"}]}), "input[0].type"),
            (json!({"nope": 1}), "nope"),
        ] {
            let mut req = json!({"model": "m", "input": "hi"});
            for (k, v) in extra.as_object().unwrap() {
                req[k] = v.clone();
            }
            let err = translate(req, false).err().unwrap();
            assert_eq!(
                (err.status.as_u16(), err.param.as_deref()),
                (400, Some(param)),
                "{err:?}"
            );
        }
    }

    fn reply() -> ResponsesReply {
        let mut echo = Map::new();
        echo.insert("max_output_tokens".into(), json!(4));
        ResponsesReply {
            model: "client-m".into(),
            echo,
        }
    }

    #[test]
    fn whole_answers_as_response_objects() {
        let answer = br#"{"choices":[{"message":{"content":"Hi","tool_calls":[{"id":"c9","function":{"name":"f","arguments":"{}"}}]},"finish_reason":"tool_calls"}],"usage":{"prompt_tokens":3,"completion_tokens":4}}"#;
        let v: Value = serde_json::from_slice(&reply().whole(answer).unwrap()).unwrap();
        assert_eq!(
            (v["status"].as_str(), v["model"].as_str()),
            (Some("completed"), Some("client-m"))
        );
        assert_eq!(v["output"][0]["content"][0]["text"], "Hi");
        assert_eq!(v["output"][1]["type"], "function_call");
        assert_eq!(v["output"][1]["call_id"], "c9");
        assert_eq!(v["usage"]["total_tokens"], 7);
        assert_eq!(v["max_output_tokens"], 4);
        let cut = br#"{"choices":[{"message":{"content":"Hi"},"finish_reason":"length"}]}"#;
        let v: Value = serde_json::from_slice(&reply().whole(cut).unwrap()).unwrap();
        assert_eq!(v["status"], "incomplete");
        assert_eq!(v["incomplete_details"]["reason"], "max_output_tokens");
    }

    #[test]
    fn stream_of_text_then_a_call_is_numbered_and_complete() {
        let mut s = reply().stream();
        let mut out = BytesMut::new();
        for c in [
            r#"{"choices":[{"delta":{"content":"Hi"}}]}"#,
            r#"{"choices":[{"delta":{"content":" there"}}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"id":"c1","function":{"name":"f","arguments":"{}"}}]},"finish_reason":"stop"}]}"#,
            r#"{"choices":[],"usage":{"prompt_tokens":2,"completion_tokens":3}}"#,
        ] {
            assert!(s.event(c.as_bytes(), &mut out));
        }
        s.end(&mut out);
        let text = String::from_utf8(out.to_vec()).unwrap();
        let events: Vec<(String, Value)> = text
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
        let kinds: Vec<&str> = events.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(
            kinds,
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.completed"
            ]
        );
        for (i, (kind, data)) in events.iter().enumerate() {
            assert_eq!(
                (data["sequence_number"].as_u64(), data["type"].as_str()),
                (Some(i as u64), Some(kind.as_str()))
            );
        }
        assert_eq!(events[6].1["text"], "Hi there");
        assert_eq!(events[9].1["output_index"], 1);
        let done = &events[13].1["response"];
        assert_eq!(done["status"], "completed");
        assert_eq!(done["usage"]["output_tokens"], 3);
        assert_eq!(done["output"][1]["arguments"], "{}");
        assert_eq!(done["id"], events[0].1["response"]["id"]);
    }
}
