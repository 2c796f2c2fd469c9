//! Continuing a broken stream on another backend: what an API needs to say for it (the
//! request path's side is `proxy::resume`, the stream's `proxy::observe`).
//!
//! An API that can continue an answer implements [`Continuation`]: it records what each event
//! sent to the client says ([`Transcript`]: the first chunk's `id`, `created` and `model`, the
//! text so far, the tokens streamed, whether a role delta, a finish, a tool call or reasoning
//! went out), tells whether a request can be continued faithfully at all, builds the request
//! that asks a backend of a given kind to continue the partial answer, and rewrites the
//! continuation's events so that they read as the same answer. An API an engine cannot
//! continue natively (Messages: [`messages`], Responses: [`responses`]) continues through the
//! chat completions endpoint ([`Continuation::path`], [`Continuation::wire`]) and writes the
//! chat chunks back as its own events ([`Rewritten::Events`]).
//!
//! Invariants:
//! - A request is continued only when the continuation can be the same answer: one choice
//!   (`n` 1, no `best_of`), no logprobs, no structured output (`response_format` other than
//!   text, guided decoding, a forced tool choice: the grammar's state cannot be moved), no
//!   `echo`/`suffix`, and nothing sent yet that the continuation cannot extend (a tool call,
//!   reasoning, a finish). Anything else keeps the terminal error.
//! - The continuation's `max_tokens` (and `min_tokens`) are the client's minus the tokens
//!   already streamed; nothing is left to generate → no continuation.
//! - Rewritten events carry the first chunk's `id`, `created` and `model`; the continuation's
//!   own role delta is dropped; its usage is the answer's ([`joined_usage`]).
//! - The request is read into a tree only here, on the rare continuation path.

use bytes::Bytes;
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Map, Value};

pub mod messages;
pub mod responses;

use super::{ClientApi, Usage};
use crate::config::BackendKind;
use crate::openai::edit::{self, Splice};

/// What the client has received of a streamed answer so far.
#[derive(Debug, Clone, Default)]
pub struct Transcript {
    /// The first chunk's `id`, `created` and `model`, as JSON (as the client saw them).
    pub id: Option<String>,
    pub created: Option<String>,
    pub model: Option<String>,
    /// The answer's text so far (chat: the content deltas; completions: the text).
    pub text: String,
    /// Output events streamed (≈ tokens: engines stream one token per event).
    pub tokens: u64,
    /// Why the answer can no longer be continued, once something went out that a
    /// continuation could not extend.
    pub blocked: Option<&'static str>,
    /// The prompt's tokens, when the stream reported them before its end (Anthropic's
    /// `message_start`).
    pub prompt_tokens: Option<u64>,
    /// The open content block, and the index of the next one (typed-event APIs).
    pub block: Option<u64>,
    pub next: u64,
    /// The continuation's finish reason, until its end is written.
    pub stop: Option<String>,
    /// The response object of the stream's first lifecycle event, as the client saw it
    /// (Responses: the answer's last event carries it whole).
    pub head: Option<String>,
    /// The open output item: its id (as JSON) and output index (Responses).
    pub item: Option<(String, u64)>,
    /// The last event's `sequence_number` (Responses).
    pub seq: Option<u64>,
    /// The continuation's closing events were written.
    pub ended: bool,
}

impl Transcript {
    /// The index of a new content block.
    pub fn next_block(&mut self) -> u64 {
        let i = self.next;
        self.next += 1;
        i
    }
}

/// What a continuation event becomes for the client.
#[derive(Debug, PartialEq, Eq)]
pub enum Rewritten {
    /// Not sent (the continuation's own role delta).
    Drop,
    /// Sent, as these bytes (the event's data).
    Send(Bytes),
    /// Complete events (their `event:` and `data:` lines), sent as they are.
    Events(Bytes),
}

/// The usage of one answer made of `t`'s streamed tokens and a continuation that reported
/// `cont`: the prompt as the continuing engine counted it without the text already streamed
/// (the original prompt, to within a token where a tokenizer merges across the join) unless
/// the stream reported its prompt already, and every token produced.
pub fn joined_usage(t: &Transcript, cont: Usage) -> Usage {
    Usage {
        prompt_tokens: t
            .prompt_tokens
            .unwrap_or_else(|| cont.prompt_tokens.saturating_sub(t.tokens)),
        completion_tokens: cont.completion_tokens + t.tokens,
        cached_tokens: None,
    }
}

/// An API whose streamed answers can be continued on another backend.
pub trait Continuation: Send + Sync {
    /// `Err(why)` when the request (its body) cannot be continued faithfully.
    fn continuable(&self, body: &[u8]) -> Result<(), &'static str>;

    /// Whether a backend of `kind` can continue this API's partial answer.
    fn continues_on(&self, kind: BackendKind) -> bool;

    /// Record one event the client was sent (`data`, JSON) in `t`.
    fn record(&self, data: &[u8], t: &mut Transcript);

    /// The path the continuation is sent to, when not the API's own.
    fn path(&self) -> Option<&'static str> {
        None
    }

    /// The API whose events the continuation answers with, when not this one (its events
    /// are then read as that API's and [`Continuation::rewrite`] writes them as this one's).
    fn wire(&self) -> Option<&'static dyn ClientApi> {
        None
    }

    /// The body that asks a backend of `kind` (its model name `model`) to continue the answer
    /// `t` to the request `body`; `None` when it cannot be built (nothing left to generate).
    fn body(&self, body: &[u8], t: &Transcript, kind: BackendKind, model: &str) -> Option<Bytes>;

    /// One event of the continuation (already edited for the client), rewritten to continue
    /// `t`; `usage`: the answer's usage, put in place of the continuation's own.
    fn rewrite(&self, data: &[u8], t: &mut Transcript, usage: Option<Usage>) -> Rewritten;
}

/// Chat completions: the partial answer is an assistant message the engine continues.
pub struct ChatContinuation;
/// Completions: the prompt is followed by the text so far.
pub struct CompletionsContinuation;

pub static CHAT_CONTINUATION: &dyn Continuation = &ChatContinuation;
pub static COMPLETIONS_CONTINUATION: &dyn Continuation = &CompletionsContinuation;

#[derive(Deserialize)]
struct Chunk<'a> {
    #[serde(borrow, default)]
    id: Option<&'a RawValue>,
    #[serde(borrow, default)]
    created: Option<&'a RawValue>,
    #[serde(borrow, default)]
    model: Option<&'a RawValue>,
    #[serde(borrow, default)]
    choices: Option<Vec<Choice<'a>>>,
    #[serde(borrow, default)]
    usage: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct Choice<'a> {
    #[serde(borrow, default)]
    delta: Option<Delta<'a>>,
    #[serde(borrow, default)]
    text: Option<std::borrow::Cow<'a, str>>,
    #[serde(borrow, default)]
    finish_reason: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct Delta<'a> {
    #[serde(borrow, default)]
    role: Option<&'a RawValue>,
    #[serde(borrow, default)]
    content: Option<std::borrow::Cow<'a, str>>,
    #[serde(borrow, default)]
    tool_calls: Option<&'a RawValue>,
    #[serde(borrow, default)]
    reasoning_content: Option<&'a RawValue>,
    #[serde(borrow, default)]
    reasoning: Option<&'a RawValue>,
}

fn present(v: Option<&RawValue>) -> bool {
    v.is_some_and(|r| !matches!(r.get(), "null" | "\"\"" | "[]"))
}

/// Record the first chunk's identity and what every chunk adds (shared by chat and
/// completions: `text` is the completions field, the delta the chat one).
fn record_chunk(data: &[u8], t: &mut Transcript) {
    let Ok(chunk) = serde_json::from_slice::<Chunk<'_>>(data) else {
        return;
    };
    if t.id.is_none() {
        t.id = chunk.id.map(|r| r.get().to_string());
        t.created = chunk.created.map(|r| r.get().to_string());
        t.model = chunk.model.map(|r| r.get().to_string());
    }
    for choice in chunk.choices.iter().flatten() {
        let mut produced = false;
        if let Some(text) = choice.text.as_deref().filter(|s| !s.is_empty()) {
            t.text.push_str(text);
            produced = true;
        }
        if let Some(d) = &choice.delta {
            if let Some(text) = d.content.as_deref().filter(|s| !s.is_empty()) {
                t.text.push_str(text);
                produced = true;
            }
            if present(d.tool_calls) {
                t.blocked.get_or_insert("a tool call was being streamed");
                produced = true;
            }
            if present(d.reasoning_content) || present(d.reasoning) {
                t.blocked.get_or_insert("reasoning was being streamed");
                produced = true;
            }
        }
        if present(choice.finish_reason) {
            t.blocked.get_or_insert("the answer had finished");
        }
        if produced {
            t.tokens += 1;
        }
    }
}

/// The members of a request that make it impossible to continue faithfully.
fn refuse(req: &Map<String, Value>, completions: bool) -> Result<(), &'static str> {
    let num = |k: &str| req.get(k).and_then(Value::as_u64).unwrap_or(1);
    if num("n") > 1 || num("best_of") > 1 {
        return Err("it asks for several choices");
    }
    let set = |k: &str| {
        req.get(k)
            .is_some_and(|v| !matches!(v, Value::Null | Value::Bool(false)))
    };
    if set("logprobs") || set("top_logprobs") || set("prompt_logprobs") {
        return Err("it asks for logprobs");
    }
    let structured = [
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "structured_outputs",
    ];
    let text_format = req
        .get("response_format")
        .is_none_or(|f| f.is_null() || f.get("type").and_then(Value::as_str) == Some("text"));
    if !text_format || structured.iter().any(|k| set(k)) {
        return Err("its output is structured");
    }
    let forced_tool = req
        .get("tool_choice")
        .is_some_and(|c| c.is_object() || c.as_str() == Some("required"));
    if forced_tool {
        return Err("it forces a tool call");
    }
    if set("echo") || (completions && set("suffix")) {
        return Err("it echoes its prompt or has a suffix");
    }
    Ok(())
}

/// The request as a JSON object (`None` when it is not one).
fn object(body: &[u8]) -> Option<Map<String, Value>> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(m)) => Some(m),
        _ => None,
    }
}

/// The limits of a continuation: the client's output limits less what was streamed, forced
/// stream usage, and the backend's model name; `None` when nothing is left to generate.
fn limit(req: &mut Map<String, Value>, t: &Transcript, model: &str) -> Option<()> {
    for key in ["max_tokens", "max_completion_tokens"] {
        if let Some(max) = req.get(key).and_then(Value::as_u64) {
            let left = max.checked_sub(t.tokens).filter(|n| *n > 0)?;
            req.insert(key.into(), left.into());
        }
    }
    if let Some(min) = req.get("min_tokens").and_then(Value::as_u64) {
        req.insert("min_tokens".into(), min.saturating_sub(t.tokens).into());
    }
    req.insert("model".into(), model.into());
    req.insert("stream".into(), true.into());
    let mut options = match req.remove("stream_options") {
        Some(Value::Object(o)) => o,
        _ => Map::new(),
    };
    options.insert("include_usage".into(), true.into());
    req.insert("stream_options".into(), Value::Object(options));
    Some(())
}

/// `s` as a JSON string.
fn json_str(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into())
}

fn to_bytes(req: Map<String, Value>) -> Option<Bytes> {
    serde_json::to_vec(&Value::Object(req))
        .ok()
        .map(Bytes::from)
}

/// The chat completions request `req` made to continue the partial answer `t` on a backend
/// of `kind` (its model name `model`): the text so far as a trailing assistant message, in
/// the form that backend continues (the table in docs/request-path.md), and the limits less
/// what was streamed; `None` when nothing is left to generate.
fn continue_chat(
    mut req: Map<String, Value>,
    t: &Transcript,
    kind: BackendKind,
    model: &str,
) -> Option<Bytes> {
    limit(&mut req, t, model)?;
    let Some(Value::Array(messages)) = req.get_mut("messages") else {
        return None;
    };
    let mut partial = Map::new();
    partial.insert("role".into(), "assistant".into());
    partial.insert("content".into(), t.text.clone().into());
    messages.push(Value::Object(partial));
    match kind {
        BackendKind::Vllm => {
            req.insert("continue_final_message".into(), true.into());
            req.insert("add_generation_prompt".into(), false.into());
        }
        BackendKind::Tgi => {
            req.insert("continue_final_message".into(), true.into());
        }
        _ => {}
    }
    to_bytes(req)
}

/// The continuation's event with the first chunk's `id`, `created`, `model` and the answer's
/// usage spliced in; `drop_role`: a chat delta that only announces the role is not sent.
fn rewrite_chunk(data: &[u8], t: &Transcript, usage: Option<Usage>, drop_role: bool) -> Rewritten {
    let Ok(chunk) = serde_json::from_slice::<Chunk<'_>>(data) else {
        return Rewritten::Send(Bytes::copy_from_slice(data));
    };
    let announces_role_only = chunk.choices.as_deref().is_some_and(|c| {
        !c.is_empty()
            && c.iter().all(|c| {
                !present(c.finish_reason)
                    && c.delta.as_ref().is_some_and(|d| {
                        present(d.role)
                            && d.content.as_deref().unwrap_or("").is_empty()
                            && !present(d.tool_calls)
                            && !present(d.reasoning_content)
                            && !present(d.reasoning)
                    })
            })
    });
    if drop_role && announces_role_only && t.id.is_some() {
        return Rewritten::Drop;
    }
    let at = |raw: &RawValue| (raw.get().as_ptr() as usize).checked_sub(data.as_ptr() as usize);
    let mut splices = Vec::new();
    let put = |splices: &mut Vec<Splice>, raw: Option<&RawValue>, with: Option<Vec<u8>>| {
        if let (Some(raw), Some(with)) = (raw, with) {
            if let Some(start) = at(raw) {
                splices.push(Splice {
                    span: start..start + raw.get().len(),
                    with,
                });
            }
        }
    };
    // The role was announced once, at the start of the answer: not again on its deltas.
    if drop_role && t.id.is_some() {
        for d in chunk
            .choices
            .iter()
            .flatten()
            .filter_map(|c| c.delta.as_ref())
        {
            if let Some(span) = d.role.and_then(|r| member_span(data, r)) {
                splices.push(Splice {
                    span,
                    with: Vec::new(),
                });
            }
        }
    }
    put(&mut splices, chunk.id, t.id.clone().map(String::into_bytes));
    put(
        &mut splices,
        chunk.created,
        t.created.clone().map(String::into_bytes),
    );
    put(
        &mut splices,
        chunk.model,
        t.model.clone().map(String::into_bytes),
    );
    let usage_json = usage.map(|u| {
        format!(
            "{{\"prompt_tokens\":{},\"total_tokens\":{},\"completion_tokens\":{}}}",
            u.prompt_tokens,
            u.prompt_tokens + u.completion_tokens,
            u.completion_tokens
        )
        .into_bytes()
    });
    put(
        &mut splices,
        chunk.usage.filter(|u| u.get() != "null"),
        usage_json,
    );
    Rewritten::Send(edit::apply(&Bytes::copy_from_slice(data), splices))
}

/// The bytes of the object member whose value is `value` (its key, the colon, the value, and
/// the comma that separates it from a neighbour), so that removing them leaves valid JSON.
fn member_span(data: &[u8], value: &RawValue) -> Option<std::ops::Range<usize>> {
    let start = (value.get().as_ptr() as usize).checked_sub(data.as_ptr() as usize)?;
    let end = start + value.get().len();
    let ws = |b: &u8| b.is_ascii_whitespace();
    // back over `:` and the key's closing quote to its opening quote
    let mut i = start;
    while i > 0 && (ws(&data[i - 1]) || data[i - 1] == b':') {
        i -= 1;
    }
    let close = i.checked_sub(1).filter(|c| data[*c] == b'"')?;
    let open = data[..close].iter().rposition(|b| *b == b'"')?;
    let mut after = end;
    while after < data.len() && ws(&data[after]) {
        after += 1;
    }
    if data.get(after) == Some(&b',') {
        return Some(open..after + 1);
    }
    // the last member: take the comma before it
    let mut before = open;
    while before > 0 && ws(&data[before - 1]) {
        before -= 1;
    }
    (before > 0 && data[before - 1] == b',').then(|| before - 1..end)
}

impl Continuation for ChatContinuation {
    fn continuable(&self, body: &[u8]) -> Result<(), &'static str> {
        let req = object(body).ok_or("it is not a JSON object")?;
        refuse(&req, false)
    }

    fn continues_on(&self, kind: BackendKind) -> bool {
        // vLLM and TGI (`continue_final_message`), Ollama (a trailing assistant message is
        // continued); a generic OpenAI server starts a new turn.
        matches!(
            kind,
            BackendKind::Vllm | BackendKind::Tgi | BackendKind::Ollama
        )
    }

    fn record(&self, data: &[u8], t: &mut Transcript) {
        record_chunk(data, t);
    }

    fn body(&self, body: &[u8], t: &Transcript, kind: BackendKind, model: &str) -> Option<Bytes> {
        continue_chat(object(body)?, t, kind, model)
    }

    fn rewrite(&self, data: &[u8], t: &mut Transcript, usage: Option<Usage>) -> Rewritten {
        rewrite_chunk(data, t, usage, true)
    }
}

impl Continuation for CompletionsContinuation {
    fn continuable(&self, body: &[u8]) -> Result<(), &'static str> {
        let req = object(body).ok_or("it is not a JSON object")?;
        refuse(&req, true)?;
        match req.get("prompt") {
            Some(Value::String(_)) => Ok(()),
            _ => Err("its prompt is not one text"),
        }
    }

    fn continues_on(&self, kind: BackendKind) -> bool {
        // The prompt is taken as it is (Ollama's completions wrap it in the chat template).
        matches!(kind, BackendKind::Vllm | BackendKind::Tgi)
    }

    fn record(&self, data: &[u8], t: &mut Transcript) {
        record_chunk(data, t);
    }

    fn body(&self, body: &[u8], t: &Transcript, _: BackendKind, model: &str) -> Option<Bytes> {
        let mut req = object(body)?;
        limit(&mut req, t, model)?;
        let Some(Value::String(prompt)) = req.get_mut("prompt") else {
            return None;
        };
        prompt.push_str(&t.text);
        to_bytes(req)
    }

    fn rewrite(&self, data: &[u8], t: &mut Transcript, usage: Option<Usage>) -> Rewritten {
        rewrite_chunk(data, t, usage, false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn transcript(events: &[&str]) -> Transcript {
        let mut t = Transcript::default();
        for e in events {
            CHAT_CONTINUATION.record(e.as_bytes(), &mut t);
        }
        t
    }

    #[test]
    fn the_transcript_is_what_the_client_saw() {
        let t = transcript(&[
            r#"{"id":"chatcmpl-1","created":7,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}"#,
            r#"{"id":"chatcmpl-1","created":7,"model":"m","choices":[{"index":0,"delta":{"content":" the"}}]}"#,
            r#"{"id":"chatcmpl-1","created":7,"model":"m","choices":[{"index":0,"delta":{"content":" sky\"s"}}]}"#,
        ]);
        assert_eq!(
            (t.id.as_deref(), t.created.as_deref(), t.model.as_deref()),
            (Some("\"chatcmpl-1\""), Some("7"), Some("\"m\""))
        );
        assert_eq!(
            (t.text.as_str(), t.tokens, t.blocked),
            (" the sky\"s", 2, None)
        );
        let tool = r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\"a"}}]}}]}"#;
        assert!(transcript(&[tool]).blocked.is_some());
        let done = r#"{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}"#;
        assert!(transcript(&[done]).blocked.is_some());
        let reasoning = r#"{"choices":[{"index":0,"delta":{"reasoning_content":"hm"}}]}"#;
        assert!(transcript(&[reasoning]).blocked.is_some());
    }

    #[test]
    fn requests_that_cannot_be_continued_faithfully() {
        let ok = br#"{"model":"m","messages":[],"n":1,"logprobs":false,"response_format":{"type":"text"},"tool_choice":"auto"}"#;
        assert_eq!(CHAT_CONTINUATION.continuable(ok), Ok(()));
        for refused in [
            r#"{"n":2}"#,
            r#"{"logprobs":true}"#,
            r#"{"top_logprobs":2}"#,
            r#"{"response_format":{"type":"json_object"}}"#,
            r#"{"guided_json":{"type":"object"}}"#,
            r#"{"structured_outputs":{"regex":"a+"}}"#,
            r#"{"tool_choice":"required"}"#,
            r#"{"tool_choice":{"type":"function","function":{"name":"f"}}}"#,
            r#"{"echo":true}"#,
            "[1]",
        ] {
            assert!(
                CHAT_CONTINUATION.continuable(refused.as_bytes()).is_err(),
                "{refused}"
            );
        }
        let c = COMPLETIONS_CONTINUATION;
        assert!(c.continuable(br#"{"prompt":"a"}"#).is_ok());
        for refused in [
            r#"{"prompt":["a","b"]}"#,
            r#"{"prompt":[1,2]}"#,
            r#"{"prompt":"a","best_of":2}"#,
            r#"{"prompt":"a","logprobs":1}"#,
            r#"{"prompt":"a","suffix":"z"}"#,
        ] {
            assert!(c.continuable(refused.as_bytes()).is_err(), "{refused}");
        }
    }

    #[test]
    fn continuation_bodies_per_kind() {
        let t = Transcript {
            text: " the sky".into(),
            tokens: 2,
            ..Transcript::default()
        };
        let body = br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":10,"min_tokens":1,"stream":true}"#;
        let vllm = CHAT_CONTINUATION
            .body(body, &t, BackendKind::Vllm, "b-m")
            .unwrap();
        let v: Value = serde_json::from_slice(&vllm).unwrap();
        assert_eq!(v["messages"][1]["role"], "assistant");
        assert_eq!(v["messages"][1]["content"], " the sky");
        assert_eq!(
            (
                v["continue_final_message"].as_bool(),
                v["add_generation_prompt"].as_bool()
            ),
            (Some(true), Some(false))
        );
        assert_eq!(
            (v["max_tokens"].as_u64(), v["min_tokens"].as_u64()),
            (Some(8), Some(0))
        );
        assert_eq!(
            (
                v["model"].as_str(),
                v["stream_options"]["include_usage"].as_bool()
            ),
            (Some("b-m"), Some(true))
        );
        let tgi: Value = serde_json::from_slice(
            &CHAT_CONTINUATION
                .body(body, &t, BackendKind::Tgi, "m")
                .unwrap(),
        )
        .unwrap();
        assert_eq!(tgi["continue_final_message"], true);
        assert!(tgi.get("add_generation_prompt").is_none());
        let ollama: Value = serde_json::from_slice(
            &CHAT_CONTINUATION
                .body(body, &t, BackendKind::Ollama, "m")
                .unwrap(),
        )
        .unwrap();
        assert!(ollama.get("continue_final_message").is_none());
        // Nothing left to generate: no continuation.
        let spent = Transcript {
            tokens: 10,
            ..t.clone()
        };
        assert!(CHAT_CONTINUATION
            .body(body, &spent, BackendKind::Vllm, "m")
            .is_none());
        let cbody = br#"{"model":"m","prompt":"Once","max_tokens":5}"#;
        let c: Value = serde_json::from_slice(
            &COMPLETIONS_CONTINUATION
                .body(cbody, &t, BackendKind::Vllm, "m")
                .unwrap(),
        )
        .unwrap();
        assert_eq!(
            (c["prompt"].as_str(), c["max_tokens"].as_u64()),
            (Some("Once the sky"), Some(3))
        );
        assert!(!COMPLETIONS_CONTINUATION.continues_on(BackendKind::Ollama));
        assert!(!CHAT_CONTINUATION.continues_on(BackendKind::OpenAi));
    }

    #[test]
    fn continuation_events_read_as_the_same_answer() {
        let mut t = Transcript {
            id: Some("\"chatcmpl-1\"".into()),
            created: Some("7".into()),
            model: Some("\"m\"".into()),
            tokens: 2,
            ..Transcript::default()
        };
        let role = br#"{"id":"chatcmpl-2","created":9,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}"#;
        assert_eq!(
            CHAT_CONTINUATION.rewrite(role, &mut t, None),
            Rewritten::Drop
        );
        let chunk = br#"{"id":"chatcmpl-2","created":9,"model":"m2","choices":[{"index":0,"delta":{"content":" sea"}}]}"#;
        let Rewritten::Send(out) = CHAT_CONTINUATION.rewrite(chunk, &mut t, None) else {
            panic!("dropped")
        };
        assert_eq!(
            &out[..],
            br#"{"id":"chatcmpl-1","created":7,"model":"m","choices":[{"index":0,"delta":{"content":" sea"}}]}"#
        );
        // TGI and Ollama name the role on every delta: not again after the first.
        let tgi = br#"{"id":"","created":9,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":" sea"},"finish_reason":null}]}"#;
        let Rewritten::Send(out) = CHAT_CONTINUATION.rewrite(tgi, &mut t, None) else {
            panic!("dropped")
        };
        assert_eq!(
            &out[..],
            br#"{"id":"chatcmpl-1","created":7,"model":"m","choices":[{"index":0,"delta":{"content":" sea"},"finish_reason":null}]}"#
        );
        let last = br#"{"choices":[{"delta":{"content":"","role" : "assistant" },"finish_reason":"stop"}]}"#;
        let Rewritten::Send(out) = CHAT_CONTINUATION.rewrite(last, &mut t, None) else {
            panic!("dropped")
        };
        assert_eq!(
            &out[..],
            br#"{"choices":[{"delta":{"content":"" },"finish_reason":"stop"}]}"#
        );
        let usage = br#"{"id":"chatcmpl-2","created":9,"model":"m","choices":[],"usage":{"prompt_tokens":12,"total_tokens":15,"completion_tokens":3}}"#;
        let joined = joined_usage(
            &t,
            Usage {
                prompt_tokens: 12,
                completion_tokens: 3,
                cached_tokens: None,
            },
        );
        assert_eq!(
            joined,
            Usage {
                prompt_tokens: 10,
                cached_tokens: None,
                completion_tokens: 5
            }
        );
        let Rewritten::Send(out) = CHAT_CONTINUATION.rewrite(usage, &mut t, Some(joined)) else {
            panic!("dropped")
        };
        assert_eq!(
            &out[..],
            br#"{"id":"chatcmpl-1","created":7,"model":"m","choices":[],"usage":{"prompt_tokens":10,"total_tokens":15,"completion_tokens":5}}"#
        );
    }
}
