//! TGI's tool calling on `/v1/chat/completions`, as TGI 3.x does it.
//!
//! With `tools` and a `tool_choice` other than `none`, TGI constrains generation with a grammar
//! over the tools' schemas. `required` and a named function force a call: the model writes
//! `{"function": {"_name": …, <arguments>}}`, and TGI answers with `tool_calls` (one call, id
//! counted on from the integer ids of the conversation's earlier calls, arguments a JSON string,
//! `description: null`) and no `content`, its `finish_reason` the generation's (`stop` for an
//! end of sequence: TGI never says `tool_calls`). Streamed, every chunk carries the call's
//! `index: 0`, its `id` and a fragment of the arguments; the name comes on the first chunk only.
//! Under `auto` TGI adds a `no_tool` choice; the simulator's model always picks it, which makes
//! TGI generate again without tools: a plain text answer.
//!
//! Arguments are generated from the chosen tool's `parameters`: each required property (all, if
//! none is marked) gets a value of its type (the first `enum` value, a word for a string, a
//! number, `true`, an empty array or object), one token per fragment; a call cut by `max_tokens`
//! ends with `length` when streamed, and is TGI's 422 `tool_error` when whole (the arguments
//! are not JSON).

use serde_json::{json, Map, Value};

use super::openai_surface::TGI_FINGERPRINT;
use super::text::{Finish, Plan};

/// A forced tool call the request asks for: the tool, and the id TGI gives the call.
#[derive(Debug)]
pub(crate) struct Forced {
    pub name: String,
    pub id: String,
    /// The arguments' JSON text, one fragment per token.
    pub fragments: Vec<String>,
}

/// What `tools`/`tool_choice` make TGI do: `Ok(None)` for a text answer, `Err` for TGI's 422
/// message (a named tool that is not in `tools`).
pub(crate) fn forced(body: &Value, seed_words: &[&str]) -> Result<Option<Forced>, String> {
    let tools: &[Value] = match body.get("tools") {
        Some(Value::Array(t)) if !t.is_empty() => t,
        _ => return Ok(None),
    };
    let named = match body.get("tool_choice") {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::String(s)) => match s.as_str() {
            "none" | "auto" => return Ok(None),
            "required" => None,
            other => Some(other.to_string()),
        },
        Some(choice) => choice
            .pointer("/function/name")
            .and_then(Value::as_str)
            .map(str::to_string),
    };
    let name_of = |t: &Value| {
        t.pointer("/function/name")
            .and_then(Value::as_str)
            .map(str::to_string)
    };
    let tool = match &named {
        Some(n) => tools
            .iter()
            .find(|t| name_of(t).as_deref() == Some(n))
            .ok_or_else(|| format!("Tool error: Tool with name {n} not found"))?,
        None => &tools[0],
    };
    let params = tool
        .pointer("/function/parameters")
        .or_else(|| tool.pointer("/function/arguments"));
    Ok(Some(Forced {
        name: name_of(tool).unwrap_or_default(),
        id: next_id(body),
        fragments: fragments(params, seed_words),
    }))
}

/// TGI's id for a new call: one more than the largest integer id of the conversation's calls
/// (0 for the first), a UUID-like id when an earlier id is not an integer.
fn next_id(body: &Value) -> String {
    let ids = body
        .get("messages")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|m| m.get("tool_calls").and_then(Value::as_array))
        .flatten()
        .map(|c| {
            c.get("id")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .parse::<u64>()
        });
    let mut next = 0;
    for id in ids {
        match id {
            Ok(n) => next = next.max(n + 1),
            Err(_) => return format!("{:032x}", rand::random::<u128>()),
        }
    }
    next.to_string()
}

/// A value of the property's schema type.
fn value_of(schema: &Value, word: &str, n: usize) -> Value {
    if let Some(first) = schema
        .get("enum")
        .and_then(Value::as_array)
        .and_then(|e| e.first())
    {
        return first.clone();
    }
    match schema.get("type").and_then(Value::as_str) {
        Some("integer") => json!(n + 1),
        Some("number") => json!(n as f64 + 0.5),
        Some("boolean") => json!(true),
        Some("array") => json!([]),
        Some("object") => json!({}),
        _ => json!(word.trim()),
    }
}

/// The arguments' JSON text as token fragments: `{`, then per property its key and its value,
/// then `}`.
fn fragments(params: Option<&Value>, words: &[&str]) -> Vec<String> {
    let props = params
        .and_then(|p| p.get("properties"))
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default();
    let required: Vec<String> = params
        .and_then(|p| p.get("required"))
        .and_then(Value::as_array)
        .map(|r| {
            r.iter()
                .filter_map(|v| v.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_else(|| props.keys().cloned().collect());
    let mut out = vec!["{".to_string()];
    for (i, key) in required.iter().enumerate() {
        let schema = props.get(key).cloned().unwrap_or(Value::Object(Map::new()));
        let word = words.get(i % words.len().max(1)).copied().unwrap_or("x");
        let sep = if i == 0 { "" } else { ", " };
        out.push(format!("{sep}{}: ", Value::String(key.clone())));
        out.push(value_of(&schema, word, i).to_string());
    }
    out.push("}".to_string());
    out
}

/// The plan's length and finish made those of the call: one token per fragment, cut at the
/// plan's cap.
pub(crate) fn shape_plan(plan: &mut Plan, forced: &Forced, cap: u32) {
    let n = forced.fragments.len();
    let (len, finish) = if n as u32 > cap {
        (cap as usize, Finish::Length)
    } else {
        (n, Finish::Stop)
    };
    plan.words.resize(len, 0);
    plan.finish = finish;
}

/// The whole answer; `Err` is TGI's tool error when the arguments were cut.
pub(crate) fn whole(
    forced: &Forced,
    plan: &Plan,
    model_json: &str,
    created: u64,
    usage: &str,
) -> Result<String, String> {
    let arguments: String = forced
        .fragments
        .iter()
        .take(plan.words.len())
        .map(String::as_str)
        .collect();
    let parsed: Value = serde_json::from_str(&arguments)
        .map_err(|e| format!("Tool error: Failed to parse generated text: {e} {arguments:?}"))?;
    let call = json!({"id": forced.id, "type": "function", "function": {"description": null, "name": forced.name, "arguments": parsed.to_string()}});
    Ok(format!(
        "{{\"object\":\"chat.completion\",\"id\":\"\",\"created\":{created},\"model\":{model_json},\"system_fingerprint\":\"{TGI_FINGERPRINT}\",\"choices\":[{{\"index\":0,\"message\":{},\"logprobs\":null,\"finish_reason\":\"{}\"}}],\"usage\":{usage}}}",
        json!({"role": "assistant", "tool_calls": [call]}),
        plan.finish.as_openai()
    ))
}

/// The streamed chunk of token `i` (its fragment; the name on the first, the finish on the
/// last).
pub(crate) fn chunk(
    forced: &Forced,
    plan: &Plan,
    i: usize,
    model_json: &str,
    created: u64,
) -> String {
    let name = if i == 0 {
        json!(forced.name)
    } else {
        Value::Null
    };
    let fragment = forced.fragments.get(i).cloned().unwrap_or_default();
    let finish = if i + 1 == plan.words.len() {
        json!(plan.finish.as_openai())
    } else {
        Value::Null
    };
    let delta = json!({"role": "assistant", "tool_calls": [{"index": 0, "id": forced.id, "type": "function", "function": {"name": name, "arguments": fragment}}]});
    format!(
        "data:{{\"object\":\"chat.completion.chunk\",\"id\":\"\",\"created\":{created},\"model\":{model_json},\"system_fingerprint\":\"{TGI_FINGERPRINT}\",\"choices\":[{{\"index\":0,\"delta\":{delta},\"logprobs\":null,\"finish_reason\":{finish}}}],\"usage\":null}}\n\n"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools() -> Value {
        json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "unit": {"enum": ["c", "f"]}}, "required": ["city", "days", "unit"]}}}, {"type": "function", "function": {"name": "other", "parameters": {"type": "object", "properties": {}}}}])
    }

    #[test]
    fn forced_only_by_required_or_a_named_tool() {
        let words = ["paris"];
        for choice in [json!("auto"), json!("none"), Value::Null] {
            let body = json!({"tools": tools(), "tool_choice": choice});
            assert!(forced(&body, &words).unwrap().is_none());
        }
        let body = json!({"tools": tools(), "tool_choice": "required"});
        let f = forced(&body, &words).unwrap().unwrap();
        assert_eq!((f.name.as_str(), f.id.as_str()), ("get_weather", "0"));
        let args: Value = serde_json::from_str(&f.fragments.concat()).unwrap();
        assert_eq!(args, json!({"city": "paris", "days": 2, "unit": "c"}));
        let body = json!({"tools": tools(), "tool_choice": {"type": "function", "function": {"name": "other"}},
            "messages": [{"role": "assistant", "tool_calls": [{"id": "4", "type": "function", "function": {"name": "other", "arguments": "{}"}}]}]});
        let f = forced(&body, &words).unwrap().unwrap();
        assert_eq!(
            (
                f.name.as_str(),
                f.id.as_str(),
                f.fragments.concat().as_str()
            ),
            ("other", "5", "{}")
        );
        let body = json!({"tools": tools(), "tool_choice": {"type": "function", "function": {"name": "nope"}}});
        assert!(forced(&body, &words)
            .unwrap_err()
            .contains("nope not found"));
    }
}
