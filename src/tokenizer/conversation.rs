//! A chat-completions request turned into what the chat template is given, as vLLM 0.32 does
//! it (`parse_chat_messages`, `_postprocess_messages`, the tool dump and the template
//! keyword arguments of its chat path).
//!
//! What the template sees:
//! - each message rebuilt from `role` and `content`, plus `tool_calls`, `reasoning` and
//!   `reasoning_content` for the assistant, `tool_call_id` for a tool result, `name`,
//!   `task`, and `tools` for a developer message; any other field is dropped;
//! - content as one string (text parts joined with `"\n"`, no content = `""`) when the
//!   template's content form is *string*, or as a list of `{"type": "text", "text": …}` parts
//!   when it is *openai* (a tool result's all-text parts are still joined);
//! - each tool call's `arguments` parsed from its JSON text into an object (`{}` when it is
//!   empty, not JSON or not an object); the call's keys in the validated order (`id`,
//!   `function` with `arguments` then `name`, `type`, then the rest);
//! - each tool as `{"type": "function", "function": {"name", "description", "parameters"}}`
//!   (absent ones as null, `strict` and `defer_loading` only when given), other fields
//!   dropped;
//! - `chat_template_kwargs` as extra variables, except those whose value is null or `"auto"`;
//!   `reasoning_effort` (and `enable_thinking` from it) and `documents` when given.
//!
//! Invariant: key order is the request's wherever vLLM keeps it (the body is read into
//! ordered maps), since a template that prints JSON or loops over a map makes it part of the
//! prompt.

use indexmap::IndexMap;
use minijinja::value::ValueKind;
use minijinja::Value;
use serde::Deserialize;

use super::content_format::ContentFormat;

/// The fields of a chat-completions body that decide its prompt.
#[derive(Deserialize)]
pub(crate) struct ChatRequest {
    #[serde(default)]
    messages: Option<Vec<Value>>,
    #[serde(default)]
    tools: Option<Vec<Value>>,
    #[serde(default)]
    add_generation_prompt: Option<bool>,
    #[serde(default)]
    continue_final_message: Option<bool>,
    #[serde(default)]
    add_special_tokens: Option<bool>,
    #[serde(default)]
    chat_template: Option<Value>,
    #[serde(default)]
    chat_template_kwargs: Option<Value>,
    #[serde(default)]
    documents: Option<Value>,
    #[serde(default)]
    reasoning_effort: Option<String>,
}

/// Content part types read as text, and the key that holds their text.
const TEXT_PARTS: [(&str, &str); 5] = [
    ("text", "text"),
    ("input_text", "text"),
    ("output_text", "text"),
    ("refusal", "refusal"),
    ("thinking", "thinking"),
];

/// The keyword arguments transformers' `apply_chat_template` takes itself; they never reach
/// the template as variables.
const CONSUMED_KWARGS: [&str; 14] = [
    "conversation",
    "tools",
    "documents",
    "chat_template",
    "add_generation_prompt",
    "continue_final_message",
    "tokenize",
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "return_dict",
    "return_assistant_tokens_mask",
    "tokenizer_kwargs",
];

impl ChatRequest {
    /// Reads a request body; the error says what is wrong with it.
    pub(crate) fn parse(body: &[u8]) -> Result<ChatRequest, String> {
        let r: ChatRequest =
            serde_json::from_slice(body).map_err(|e| format!("body is not a chat request: {e}"))?;
        if r.messages.is_none() {
            return Err("`messages` is missing".into());
        }
        if r.continue_final_message == Some(true) && r.add_generation_prompt != Some(false) {
            return Err(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
                    .into(),
            );
        }
        let request_template = r
            .chat_template_kwargs
            .as_ref()
            .map(|k| get(k, "chat_template"))
            .is_some_and(|v| v.is_some_and(|v| !v.is_none()));
        if r.chat_template.as_ref().is_some_and(|t| !t.is_none()) || request_template {
            return Err("a chat template given with the request is refused (as vLLM does)".into());
        }
        Ok(r)
    }

    pub(crate) fn add_generation_prompt(&self) -> bool {
        self.add_generation_prompt.unwrap_or(true)
    }

    pub(crate) fn continue_final_message(&self) -> bool {
        self.continue_final_message.unwrap_or(false)
    }

    pub(crate) fn add_special_tokens(&self) -> bool {
        self.add_special_tokens.unwrap_or(false)
    }

    /// The tools the template is given (`None` when the request has none), as vLLM dumps
    /// them; `chat_template_kwargs.tools` replaces them.
    pub(crate) fn tools(&self) -> Result<Option<Value>, String> {
        if let Some(t) = self.kwarg("tools") {
            return Ok(Some(t));
        }
        match &self.tools {
            None => Ok(None),
            Some(tools) => {
                let dumped: Result<Vec<Value>, String> = tools.iter().map(dump_tool).collect();
                Ok(Some(Value::from(dumped?)))
            }
        }
    }

    /// A `chat_template_kwargs` entry, unless its value is null or `"auto"` (vLLM drops those).
    fn kwarg(&self, key: &str) -> Option<Value> {
        let v = get(self.chat_template_kwargs.as_ref()?, key)?;
        (!v.is_none() && v.as_str() != Some("auto")).then_some(v)
    }

    /// The template's variables besides `messages`, `tools`, `documents` and
    /// `add_generation_prompt`, in the order they were given.
    pub(crate) fn template_kwargs(&self) -> Result<Vec<(String, Value)>, String> {
        let mut out: Vec<(String, Value)> = Vec::new();
        if let Some(kwargs) = &self.chat_template_kwargs {
            if kwargs.kind() != ValueKind::Map {
                return Err("`chat_template_kwargs` is not an object".into());
            }
            for key in kwargs.try_iter().map_err(|e| e.to_string())? {
                let Some(name) = key.as_str() else { continue };
                if name == "messages" {
                    return Err("`chat_template_kwargs` may not set `messages`".into());
                }
                if let Some(v) = self
                    .kwarg(name)
                    .filter(|_| !CONSUMED_KWARGS.contains(&name))
                {
                    out.push((name.to_owned(), v));
                }
            }
        }
        if let Some(effort) = &self.reasoning_effort {
            set(&mut out, "reasoning_effort", Value::from(effort.as_str()));
            if self.kwarg("enable_thinking").is_none() {
                set(&mut out, "enable_thinking", Value::from(effort != "none"));
            }
        }
        Ok(out)
    }

    /// `documents` for the template (none when not given); each must be an object.
    pub(crate) fn documents(&self) -> Result<Value, String> {
        let docs = self
            .kwarg("documents")
            .or_else(|| self.documents.clone().filter(|d| !d.is_none()));
        let Some(docs) = docs else {
            return Ok(Value::from(()));
        };
        let items = docs.try_iter().map_err(|_| "`documents` is not a list")?;
        for d in items {
            if d.kind() != ValueKind::Map {
                return Err(
                    "Documents should be a list of dicts with 'title' and 'text' keys!".into(),
                );
            }
        }
        Ok(docs)
    }

    /// The messages as the template sees them (see the module doc).
    pub(crate) fn conversation(&self, format: ContentFormat) -> Result<Vec<Value>, String> {
        let messages = self.messages.as_deref().unwrap_or(&[]);
        if messages.is_empty() {
            return Err("Cannot apply chat template to an empty conversation.".into());
        }
        messages.iter().map(|m| message(m, format)).collect()
    }
}

fn set(out: &mut Vec<(String, Value)>, key: &str, value: Value) {
    match out.iter_mut().find(|(k, _)| k == key) {
        Some(slot) => slot.1 = value,
        None => out.push((key.to_owned(), value)),
    }
}

/// `map[key]`, `None` when the key is absent (a present null is `Some(none)`).
pub(crate) fn get(map: &Value, key: &str) -> Option<Value> {
    if map.kind() != ValueKind::Map {
        return None;
    }
    map.get_item(&Value::from(key))
        .ok()
        .filter(|v| !v.is_undefined())
}

fn ordered(pairs: IndexMap<Value, Value>) -> Value {
    Value::from(pairs)
}

/// One request message as the template sees it.
fn message(m: &Value, format: ContentFormat) -> Result<Value, String> {
    let role = get(m, "role")
        .and_then(|r| r.as_str().map(str::to_owned))
        .ok_or("a message has no `role`")?;
    let mut parts = content_parts(get(m, "content"))?;
    if role == "system" {
        parts = strip_billing_header(parts);
    }
    let mut out = IndexMap::new();
    out.insert(Value::from("role"), Value::from(role.as_str()));
    out.insert(
        Value::from("content"),
        render_content(&parts, format, &role),
    );
    match role.as_str() {
        "assistant" => {
            if let Some(calls) = get(m, "tool_calls").filter(|c| !c.is_none()) {
                if let Some(calls) = tool_calls(&calls)? {
                    out.insert(Value::from("tool_calls"), calls);
                }
            }
            if let Some(r) = get(m, "reasoning").filter(|r| !r.is_none()) {
                out.insert(Value::from("reasoning"), r.clone());
                out.insert(Value::from("reasoning_content"), r);
            }
        }
        "tool" => {
            if let Some(id) = get(m, "tool_call_id") {
                out.insert(Value::from("tool_call_id"), id);
            }
        }
        _ => {}
    }
    for key in ["name", "task"] {
        if let Some(v) = get(m, key).filter(|v| v.kind() == ValueKind::String) {
            out.insert(Value::from(key), v);
        }
    }
    if role == "developer" {
        out.insert(
            Value::from("tools"),
            get(m, "tools").unwrap_or(Value::from(())),
        );
    }
    Ok(ordered(out))
}

/// A content part: its text, or a tool reference (kept as its own part in the *openai* form).
#[derive(Clone, Debug, PartialEq)]
enum Part {
    Text(String),
    ToolReference(Value),
}

/// The parts of a message's content: none for null, one text part for a string.
fn content_parts(content: Option<Value>) -> Result<Vec<Part>, String> {
    let Some(content) = content.filter(|c| !c.is_none()) else {
        return Ok(Vec::new());
    };
    if let Some(s) = content.as_str() {
        return Ok(vec![Part::Text(s.to_owned())]);
    }
    let items = content
        .try_iter()
        .map_err(|_| "a message's `content` is neither text nor a list of parts")?;
    let mut parts = Vec::new();
    for item in items {
        if let Some(p) = content_part(&item)? {
            parts.push(p);
        }
    }
    Ok(parts)
}

fn content_part(item: &Value) -> Result<Option<Part>, String> {
    if let Some(s) = item.as_str() {
        return Ok(Some(Part::Text(s.to_owned())));
    }
    let kind = get(item, "type").ok_or("Missing 'type' field in multimodal part.")?;
    let kind = kind
        .as_str()
        .ok_or("Invalid 'type' field in multimodal part.")?;
    if let Some((_, key)) = TEXT_PARTS.iter().find(|(t, _)| *t == kind) {
        return match get(item, key).filter(|t| !t.is_none()) {
            Some(t) => Ok(Some(Part::Text(
                t.as_str()
                    .ok_or("a text part's text is not a string")?
                    .to_owned(),
            ))),
            // vLLM skips text and refusal parts without text
            None => Ok(None),
        };
    }
    if kind == "tool_reference" {
        return Ok(Some(Part::ToolReference(
            get(item, "name").unwrap_or(Value::from(())),
        )));
    }
    Err(format!(
        "content part type {kind:?} cannot be tokenized without the model's processor"
    ))
}

/// Drops the attribution header line a coding client puts in its system text (vLLM drops it
/// because its value changes on every request).
fn strip_billing_header(parts: Vec<Part>) -> Vec<Part> {
    const HEADER: &str = "x-anthropic-billing-header";
    parts
        .into_iter()
        .filter_map(|p| match p {
            Part::Text(t) if t.starts_with(HEADER) => {
                let rest = t.split_once('\n').map(|(_, r)| r).unwrap_or("");
                (!rest.is_empty()).then(|| Part::Text(rest.to_owned()))
            }
            other => Some(other),
        })
        .collect()
}

fn render_content(parts: &[Part], format: ContentFormat, role: &str) -> Value {
    let all_text = parts.iter().all(|p| matches!(p, Part::Text(_)));
    if format == ContentFormat::String || (role == "tool" && all_text) {
        let texts: Vec<String> = parts
            .iter()
            .map(|p| match p {
                Part::Text(t) => t.clone(),
                Part::ToolReference(n) => n.as_str().unwrap_or_default().to_owned(),
            })
            .collect();
        return Value::from(texts.join("\n"));
    }
    let list: Vec<Value> = parts
        .iter()
        .map(|p| {
            let mut m = IndexMap::new();
            match p {
                Part::Text(t) => {
                    m.insert(Value::from("type"), Value::from("text"));
                    m.insert(Value::from("text"), Value::from(t.as_str()));
                }
                Part::ToolReference(n) => {
                    m.insert(Value::from("type"), Value::from("tool_reference"));
                    m.insert(Value::from("name"), n.clone());
                }
            }
            ordered(m)
        })
        .collect();
    Value::from(list)
}

/// An assistant's tool calls for the template; `None` drops the key (an empty list).
fn tool_calls(calls: &Value) -> Result<Option<Value>, String> {
    if calls.kind() != ValueKind::Seq {
        return Ok(Some(calls.clone()));
    }
    let items: Vec<Value> = calls.try_iter().map_err(|e| e.to_string())?.collect();
    if items.is_empty() {
        return Ok(None);
    }
    let out: Result<Vec<Value>, String> = items.iter().map(tool_call).collect();
    Ok(Some(Value::from(out?)))
}

fn tool_call(call: &Value) -> Result<Value, String> {
    if call.kind() != ValueKind::Map {
        return Err("assistant tool_calls entries must be objects.".into());
    }
    let function = get(call, "function").filter(|f| f.kind() == ValueKind::Map);
    let is_function = get(call, "type").is_none_or(|t| t.as_str() == Some("function"));
    let (Some(function), true) = (function, is_function) else {
        return Err(
            "chat completions only support assistant tool_calls of type 'function'.".into(),
        );
    };
    let mut f = IndexMap::new();
    f.insert(
        Value::from("arguments"),
        arguments(get(&function, "arguments")),
    );
    copy_rest(&mut f, &function, &["arguments"], &["name"]);
    let mut out = IndexMap::new();
    if let Some(id) = get(call, "id") {
        out.insert(Value::from("id"), id);
    }
    out.insert(Value::from("function"), ordered(f));
    copy_rest(&mut out, call, &["id", "function"], &["type"]);
    Ok(ordered(out))
}

/// Copies `first` keys of `from` (when present), then every key not already in `out`, in
/// `from`'s order.
fn copy_rest(out: &mut IndexMap<Value, Value>, from: &Value, skip: &[&str], first: &[&str]) {
    for key in first {
        if let Some(v) = get(from, key) {
            out.insert(Value::from(*key), v);
        }
    }
    let Ok(keys) = from.try_iter() else { return };
    for key in keys {
        let name = key.as_str().unwrap_or_default();
        if skip.contains(&name) || out.contains_key(&key) {
            continue;
        }
        if let Ok(v) = from.get_item(&key) {
            out.insert(key, v);
        }
    }
}

/// A tool call's arguments as an object: a JSON text parsed, `{}` for anything that is not
/// (or does not parse to) a non-empty object.
fn arguments(args: Option<Value>) -> Value {
    let empty = || ordered(IndexMap::new());
    let Some(args) = args.filter(Value::is_true) else {
        return empty();
    };
    if args.kind() == ValueKind::Map {
        return args;
    }
    let parsed = match args.as_str() {
        Some(text) => serde_json::from_str::<Value>(text).ok(),
        None => Some(args),
    };
    parsed
        .filter(|p| p.kind() == ValueKind::Map)
        .unwrap_or_else(empty)
}

/// A request tool as vLLM dumps it for the template.
fn dump_tool(tool: &Value) -> Result<Value, String> {
    let function = get(tool, "function")
        .filter(|f| f.kind() == ValueKind::Map)
        .ok_or("a tool has no `function` object")?;
    let name = get(&function, "name")
        .filter(|n| n.kind() == ValueKind::String)
        .ok_or("a tool's function has no `name`")?;
    if get(tool, "type").is_some_and(|t| t.as_str() != Some("function")) {
        return Err("a tool's `type` is not \"function\"".into());
    }
    let none = || Value::from(());
    let present = |v: &Value| !v.is_none();
    let tool_defer = get(tool, "defer_loading").filter(present);
    let mut f = IndexMap::new();
    f.insert(Value::from("name"), name);
    f.insert(
        Value::from("description"),
        get(&function, "description").unwrap_or_else(none),
    );
    f.insert(
        Value::from("parameters"),
        get(&function, "parameters").unwrap_or_else(none),
    );
    if let Some(strict) = get(&function, "strict").filter(present) {
        f.insert(Value::from("strict"), strict);
    }
    if let Some(defer) = get(&function, "defer_loading")
        .filter(present)
        .or(tool_defer.clone())
    {
        f.insert(Value::from("defer_loading"), defer);
    }
    let mut out = IndexMap::new();
    out.insert(Value::from("type"), Value::from("function"));
    out.insert(Value::from("function"), ordered(f));
    if let Some(defer) = tool_defer {
        out.insert(Value::from("defer_loading"), defer);
    }
    Ok(ordered(out))
}

/// vLLM's rewrite for templates that do not know the `developer` role: developer messages
/// become system messages (without their `tools`), and when that leaves a system message
/// anywhere but first, or more than one, all system texts are merged (`"\n\n"`) into one
/// first message.
pub(crate) fn developer_as_system(conversation: Vec<Value>) -> Vec<Value> {
    let is = |m: &Value, role: &str| get(m, "role").and_then(|r| r.as_str().map(|s| s == role));
    if !conversation
        .iter()
        .any(|m| is(m, "developer") == Some(true))
    {
        return conversation;
    }
    let converted: Vec<Value> = conversation
        .into_iter()
        .map(|m| {
            if is(&m, "developer") != Some(true) {
                return m;
            }
            let mut out = IndexMap::new();
            copy_rest(&mut out, &m, &["tools"], &[]);
            out.insert(Value::from("role"), Value::from("system"));
            ordered(out)
        })
        .collect();
    merge_system(converted)
}

fn merge_system(conversation: Vec<Value>) -> Vec<Value> {
    let mut texts = Vec::new();
    let mut others = Vec::new();
    let mut merge = false;
    for (i, m) in conversation.iter().enumerate() {
        if get(m, "role").and_then(|r| r.as_str().map(|s| s == "system")) != Some(true) {
            others.push(m.clone());
            continue;
        }
        merge |= i > 0 || !texts.is_empty();
        let content = get(m, "content").unwrap_or(Value::from(""));
        let text = match content.as_str() {
            Some(s) => s.to_owned(),
            None => join_part_texts(&content),
        };
        if !text.is_empty() {
            texts.push(text);
        }
    }
    if !merge {
        return conversation;
    }
    let mut system = IndexMap::new();
    system.insert(Value::from("role"), Value::from("system"));
    system.insert(Value::from("content"), Value::from(texts.join("\n\n")));
    std::iter::once(ordered(system)).chain(others).collect()
}

fn join_part_texts(parts: &Value) -> String {
    let Ok(items) = parts.try_iter() else {
        return String::new();
    };
    let texts: Vec<String> = items
        .filter_map(|p| match p.as_str() {
            Some(s) => Some(s.to_owned()),
            None => get(&p, "text").and_then(|t| t.as_str().map(str::to_owned)),
        })
        .collect();
    texts.join("\n")
}

#[cfg(test)]
mod tests;
